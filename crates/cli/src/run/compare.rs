//! `--compare`: the model's and the device's figures of the same scenario side by side,
//! each with measured / model.

use std::fmt::Write as _;

use comfy_table::{CellAlignment, Table};
use justitia_sim::{FlowReport, ScenarioReport};

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
}

impl Row {
    /// measured / model; `None` when the model says 0.
    pub fn ratio(&self) -> Option<f64> {
        (self.model != 0.0).then(|| self.measured / self.model)
    }
}

fn flow_figures(f: &FlowReport) -> Vec<(&'static str, Option<f64>)> {
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
                    out.push(Row {
                        run: run.variant.clone(),
                        flow: flow.name.clone(),
                        figure,
                        model,
                        measured,
                    });
                }
            }
        }
        out.push(Row {
            run: run.variant.clone(),
            flow: "(run)".into(),
            figure: "utilisation (%)",
            model: run.utilisation * 100.0,
            measured: real.utilisation * 100.0,
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
    ]);
    for r in rows {
        table.add_row(vec![
            r.run.clone(),
            r.flow.clone(),
            r.figure.to_string(),
            format!("{:.2}", r.model),
            format!("{:.2}", r.measured),
            r.ratio()
                .map_or_else(|| "-".to_string(), |x| format!("x{x:.3}")),
        ]);
    }
    for i in 3..6 {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    for line in table.lines() {
        let _ = writeln!(out, "  {}", line.trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use justitia_core::flow::FlowClass;
    use justitia_sim::{LatencyReport, RunReport};

    fn report(p99: f64, rate: f64) -> ScenarioReport {
        ScenarioReport {
            scenario: "s".into(),
            description: "d".into(),
            profile: "p".into(),
            seed: 1,
            duration_ms: 1.0,
            warmup_ms: 0.0,
            runs: vec![RunReport {
                variant: "alone".into(),
                policy: "native".into(),
                flows: vec![FlowReport {
                    name: "lat".into(),
                    class: FlowClass::Latency,
                    app: "latency".into(),
                    messages: 10,
                    msgs_per_sec: rate,
                    gbps: 0.0,
                    latency: Some(LatencyReport {
                        samples: 10,
                        p50_us: 1.0,
                        p99_us: p99,
                        p999_us: p99,
                        mean_us: 1.0,
                        max_us: p99,
                    }),
                }],
                utilisation: 0.5,
                jain_bandwidth: None,
                policy_figures: Default::default(),
                fabric_figures: Default::default(),
                events: 0,
                series: Default::default(),
                wall_seconds: 0.0,
            }],
        }
    }

    #[test]
    fn every_figure_of_both_sides_with_its_ratio() {
        let rows = rows(&report(2.0, 500_000.0), &report(40.0, 25_000.0));
        let figures: Vec<&str> = rows.iter().map(|r| r.figure).collect();
        assert_eq!(
            figures,
            [
                "p50 (us)",
                "p99 (us)",
                "p99.9 (us)",
                "rate (msgs/s)",
                "goodput (Gb/s)",
                "utilisation (%)"
            ]
        );
        assert_eq!(rows[1].ratio(), Some(20.0));
        assert_eq!(rows[3].ratio(), Some(0.05));
        // Goodput 0 in the model: no ratio.
        assert_eq!(rows[4].ratio(), None);
        let text = render(&rows, "s", "IB-56", "rxe0");
        assert!(text.contains("x20.000"), "{text}");
        assert!(text.contains("real verbs on rxe0"), "{text}");
    }
}
