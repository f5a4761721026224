//! `--compare`: the model's and the device's figures of the same scenario side by side,
//! each with measured / model, and beside each measured percentile the samples it came
//! from.

use std::fmt::Write as _;

use comfy_table::Table;
use justitia_sim::{FlowReport, ScenarioReport};

use super::samples::{write_figure_table, Percentile};

/// One figure of one flow in one run, from both backends.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The run.
    pub run: String,
    /// The flow (or `(run)` for run-wide figures).
    pub flow: String,
    /// The figure, with its unit.
    pub figure: &'static str,
    /// The simulator's value.
    pub model: f64,
    /// The device's value.
    pub measured: f64,
    /// For a percentile, the latency samples the device's value came from.
    pub samples: Option<u64>,
}

impl Row {
    /// measured / model; `None` when the model says 0.
    pub fn ratio(&self) -> Option<f64> {
        (self.model != 0.0).then(|| self.measured / self.model)
    }

    /// Whether the measured figure is a percentile of too few samples to be other than the
    /// largest sample.
    pub fn is_largest_sample(&self) -> bool {
        match (Percentile::of_figure(self.figure), self.samples) {
            (Some(p), Some(n)) => !p.distinct_from_max(n),
            _ => false,
        }
    }
}

/// Every figure of a flow, with its label: the percentiles (when it took latency samples),
/// its rate and its goodput.
pub fn flow_figures(f: &FlowReport) -> Vec<(&'static str, Option<f64>)> {
    let l = f.latency.as_ref();
    vec![
        ("p50 (us)", l.map(|l| l.p50_us)),
        ("p99 (us)", l.map(|l| l.p99_us)),
        ("p99.9 (us)", l.map(|l| l.p999_us)),
        ("rate (msgs/s)", Some(f.msgs_per_sec)),
        ("goodput (Gb/s)", Some(f.gbps)),
    ]
}

/// Every figure both reports have, in the model's order of runs and flows.
pub fn rows(model: &ScenarioReport, measured: &ScenarioReport) -> Vec<Row> {
    let mut out = Vec::new();
    for run in &model.runs {
        let Some(real) = measured.run(&run.variant) else {
            continue;
        };
        for flow in &run.flows {
            let Some(real_flow) = real.flow(&flow.name) else {
                continue;
            };
            for ((figure, m), (_, r)) in flow_figures(flow).into_iter().zip(flow_figures(real_flow))
            {
                if let (Some(model), Some(measured)) = (m, r) {
                    let samples = Percentile::of_figure(figure)
                        .and(real_flow.latency.as_ref())
                        .map(|l| l.samples);
                    out.push(Row {
                        run: run.variant.clone(),
                        flow: flow.name.clone(),
                        figure,
                        model,
                        measured,
                        samples,
                    });
                }
            }
        }
        // The run's whole payload, a figure both backends define alike. Not utilisation:
        // the model's is the busiest host's payload over the profile's MaxRate, the
        // device's the payload over the port's link rate (0 when sysfs has none), so the
        // two compared showed "100.11 vs 0.00" for one run.
        let payload = |flows: &[FlowReport]| flows.iter().map(|f| f.gbps).sum::<f64>();
        out.push(Row {
            run: run.variant.clone(),
            flow: "(run)".into(),
            figure: "payload (Gb/s)",
            model: payload(&run.flows),
            measured: payload(&real.flows),
            samples: None,
        });
    }
    out
}

/// The comparison as a table, under a heading naming both backends.
pub fn render(rows: &[Row], scenario: &str, model_profile: &str, device: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{scenario}: model (simulator, RNIC profile {model_profile}) vs measured (real verbs on {device})"
    );
    let mut table = Table::new();
    table.load_preset("     -             ");
    table.set_header(vec![
        "run",
        "flow",
        "figure",
        "model",
        "measured",
        "measured/model",
        "samples",
    ]);
    let mut marked = false;
    for r in rows {
        let samples = match r.samples {
            Some(n) if r.is_largest_sample() => {
                marked = true;
                format!("{n} *")
            }
            Some(n) => n.to_string(),
            None => String::new(),
        };
        table.add_row(vec![
            r.run.clone(),
            r.flow.clone(),
            r.figure.to_string(),
            format!("{:.2}", r.model),
            format!("{:.2}", r.measured),
            r.ratio()
                .map_or_else(|| "-".to_string(), |x| format!("x{x:.3}")),
            samples,
        ]);
    }
    write_figure_table(&mut out, &mut table, marked);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::fixtures::{flow, run, scenario};
    use super::*;
    use justitia_core::flow::FlowClass;
    use justitia_sim::{LatencyReport, RunReport};

    fn report(p99: f64, rate: f64, samples: u64) -> ScenarioReport {
        let lat = FlowReport {
            messages: 10,
            latency: Some(LatencyReport {
                samples,
                p50_us: 1.0,
                p99_us: p99,
                p999_us: p99,
                mean_us: 1.0,
                max_us: p99,
            }),
            ..flow("lat", FlowClass::Latency, None, rate)
        };
        scenario(vec![RunReport {
            utilisation: 0.5,
            ..run("alone", "native", vec![lat])
        }])
    }

    /// The run's row compares the payload both backends measure alike, whatever their
    /// utilisations say (the model's over MaxRate, the device's over a link rate sysfs may
    /// not give: 0 here).
    #[test]
    fn the_run_row_compares_payload_not_utilisation() {
        let bw = |gbps: f64| FlowReport {
            gbps,
            ..flow("bw", FlowClass::Bandwidth, None, 1000.0)
        };
        let model = scenario(vec![RunReport {
            utilisation: 1.0011,
            ..run("with bw", "native", vec![bw(54.5)])
        }]);
        let measured = scenario(vec![RunReport {
            utilisation: 0.0,
            ..run("with bw", "native", vec![bw(40.0)])
        }]);
        let rows = rows(&model, &measured);
        let run_row = rows.iter().find(|r| r.flow == "(run)").unwrap();
        assert_eq!(
            (run_row.figure, run_row.model, run_row.measured),
            ("payload (Gb/s)", 54.5, 40.0)
        );
        assert!(rows.iter().all(|r| r.figure != "utilisation (%)"));
    }

    #[test]
    fn every_figure_of_both_sides_with_its_ratio() {
        // 500 samples measured: p99 is the 495th of 500, p99.9 the 500th, the largest.
        let rows = rows(
            &report(2.0, 500_000.0, 100_000),
            &report(40.0, 25_000.0, 500),
        );
        let figures: Vec<&str> = rows.iter().map(|r| r.figure).collect();
        assert_eq!(
            figures,
            [
                "p50 (us)",
                "p99 (us)",
                "p99.9 (us)",
                "rate (msgs/s)",
                "goodput (Gb/s)",
                "payload (Gb/s)"
            ]
        );
        assert_eq!(rows[1].ratio(), Some(20.0));
        assert_eq!(rows[3].ratio(), Some(0.05));
        // Goodput 0 in the model: no ratio.
        assert_eq!(rows[4].ratio(), None);
        let text = render(&rows, "s", "IB-56", "rxe0");
        assert!(text.contains("x20.000"), "{text}");
        assert!(text.contains("real verbs on rxe0"), "{text}");
        let samples: Vec<Option<u64>> = rows.iter().map(|r| r.samples).collect();
        assert_eq!(samples, [Some(500), Some(500), Some(500), None, None, None]);
        let marked: Vec<bool> = rows.iter().map(Row::is_largest_sample).collect();
        assert_eq!(marked, [false, false, true, false, false, false]);
        let p999 = text
            .lines()
            .find(|l| l.contains("p99.9 (us)"))
            .unwrap_or_default();
        assert!(p999.trim_end().ends_with("500 *"), "{text}");
        assert!(
            text.contains("* fewer samples than the percentile needs"),
            "{text}"
        );
    }
}
