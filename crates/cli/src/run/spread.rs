//! `--repeat N`: the scenario's runs measured N times over. Each figure reported is the
//! median of its N values, shown with its spread (the smallest and largest of the N), as
//! the paper reports the median of five runs.

use std::fmt::Write as _;

use comfy_table::Table;
use justitia_sim::{FlowReport, LatencyReport, ScenarioReport};

use super::compare::flow_figures;
use super::samples::{write_figure_table, Percentile};

/// One figure over the repeats of a run: its median and its range.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// The median of the values.
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; `None` when there are none.
    ///
    /// The median of an even number of values is the mean of the two middle ones: with two
    /// repeats, the lower alone would favour whichever limit is a ceiling and the upper
    /// whichever is a floor, and the mean favours neither.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let (&min, &max) = (sorted.first()?, sorted.last()?);
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Spread { median, min, max })
    }

    /// `median` alone for one repeat, `median (min..max)` for several.
    pub fn show(&self, repeats: usize) -> String {
        if repeats > 1 {
            format!("{:.2} ({:.2}..{:.2})", self.median, self.min, self.max)
        } else {
            format!("{:.2}", self.median)
        }
    }
}

/// The same flow of the same run in every repeat that has it.
pub fn flow_in_each<'a>(
    repeats: &'a [ScenarioReport],
    run: &str,
    flow: &str,
) -> Vec<&'a FlowReport> {
    repeats
        .iter()
        .filter_map(|r| r.run(run)?.flow(flow))
        .collect()
}

/// The fewest latency samples the flow took in any repeat (0 when a repeat took none):
/// a percentile of the median is only as distinct from the largest sample as the
/// percentile of the repeat with the fewest samples.
pub fn fewest_samples(flows: &[&FlowReport]) -> u64 {
    flows
        .iter()
        .map(|f| f.latency.map_or(0, |l| l.samples))
        .min()
        .unwrap_or(0)
}

fn median_of(flows: &[&FlowReport], figure: impl Fn(&FlowReport) -> f64) -> Option<f64> {
    let values: Vec<f64> = flows.iter().map(|f| figure(f)).collect();
    Spread::of(&values).map(|s| s.median)
}

fn median_latency(flows: &[&FlowReport]) -> Option<LatencyReport> {
    let sampled: Vec<LatencyReport> = flows.iter().filter_map(|f| f.latency).collect();
    let median = |figure: fn(&LatencyReport) -> f64| {
        let values: Vec<f64> = sampled.iter().map(figure).collect();
        Spread::of(&values).map(|s| s.median)
    };
    Some(LatencyReport {
        samples: fewest_samples(flows),
        p50_us: median(|l| l.p50_us)?,
        p99_us: median(|l| l.p99_us)?,
        p999_us: median(|l| l.p999_us)?,
        mean_us: median(|l| l.mean_us)?,
        max_us: median(|l| l.max_us)?,
    })
}

/// The report of the repeats taken together: the first repeat's runs and flows, each
/// figure the median of that figure over the repeats, except a flow's latency `samples`,
/// which is the fewest any repeat took (see [`fewest_samples`]). Message counts are
/// rounded to the nearest whole message. `None` when there are no repeats.
pub fn median_report(repeats: &[ScenarioReport]) -> Option<ScenarioReport> {
    let mut report = repeats.first()?.clone();
    for run in &mut report.runs {
        let same_run: Vec<_> = repeats.iter().filter_map(|r| r.run(&run.variant)).collect();
        let run_median = |figure: fn(&justitia_sim::RunReport) -> f64| {
            let values: Vec<f64> = same_run.iter().map(|r| figure(r)).collect();
            Spread::of(&values).map_or(0.0, |s| s.median)
        };
        run.utilisation = run_median(|r| r.utilisation);
        run.wall_seconds = run_median(|r| r.wall_seconds);
        let jains: Vec<f64> = same_run.iter().filter_map(|r| r.jain_bandwidth).collect();
        run.jain_bandwidth = Spread::of(&jains).map(|s| s.median);
        for flow in &mut run.flows {
            let each = flow_in_each(repeats, &run.variant, &flow.name);
            flow.messages =
                median_of(&each, |f| f.messages as f64).map_or(flow.messages, |m| m.round() as u64);
            flow.msgs_per_sec = median_of(&each, |f| f.msgs_per_sec).unwrap_or(flow.msgs_per_sec);
            flow.gbps = median_of(&each, |f| f.gbps).unwrap_or(flow.gbps);
            flow.latency = median_latency(&each);
        }
    }
    Some(report)
}

/// The figures of every flow of every run over the repeats, as a table: median, smallest,
/// largest, and beside each percentile the fewest samples of any repeat, marked `*` when
/// too few for the percentile to be other than the largest sample.
pub fn render(repeats: &[ScenarioReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "each figure is the median of {} repeats, with the smallest and largest:",
        repeats.len()
    );
    let mut table = Table::new();
    table.load_preset("     -             ");
    table.set_header(vec![
        "run", "flow", "figure", "median", "min", "max", "samples",
    ]);
    let mut marked = false;
    let Some(first) = repeats.first() else {
        return out;
    };
    for run in &first.runs {
        for flow in &run.flows {
            let each = flow_in_each(repeats, &run.variant, &flow.name);
            let fewest = fewest_samples(&each);
            let figures = each.first().map(|f| flow_figures(f)).unwrap_or_default();
            for (k, (figure, _)) in figures.into_iter().enumerate() {
                // Every flow report has the same figures in the same order.
                let values: Vec<f64> = each
                    .iter()
                    .filter_map(|f| flow_figures(f).get(k).and_then(|(_, v)| *v))
                    .collect();
                let Some(spread) = Spread::of(&values) else {
                    continue;
                };
                let samples = match Percentile::of_figure(figure) {
                    Some(p) if !p.distinct_from_max(fewest) => {
                        marked = true;
                        format!("{fewest} *")
                    }
                    Some(_) => fewest.to_string(),
                    None => String::new(),
                };
                table.add_row(vec![
                    run.variant.clone(),
                    flow.name.clone(),
                    figure.to_string(),
                    format!("{:.2}", spread.median),
                    format!("{:.2}", spread.min),
                    format!("{:.2}", spread.max),
                    samples,
                ]);
            }
        }
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
    use justitia_sim::RunReport;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(
            Spread::of(&[7.0]),
            Some(Spread {
                median: 7.0,
                min: 7.0,
                max: 7.0
            })
        );
        // Sorted 1, 2, 9: the middle one.
        assert_eq!(
            Spread::of(&[9.0, 1.0, 2.0]),
            Some(Spread {
                median: 2.0,
                min: 1.0,
                max: 9.0
            })
        );
        // Sorted 1, 3, 5, 100: (3 + 5) / 2 = 4.
        assert_eq!(
            Spread::of(&[5.0, 100.0, 1.0, 3.0]),
            Some(Spread {
                median: 4.0,
                min: 1.0,
                max: 100.0
            })
        );
        let five = Spread::of(&[10.0, 12.0, 11.0, 50.0, 9.0]).unwrap();
        assert_eq!(five.show(5), "11.00 (9.00..50.00)");
        assert_eq!(five.show(1), "11.00");
    }

    fn repeat(rate: f64, gbps: f64, p99: f64, samples: u64) -> ScenarioReport {
        let lat = FlowReport {
            messages: samples,
            latency: Some(LatencyReport {
                samples,
                p50_us: p99 / 2.0,
                p99_us: p99,
                p999_us: p99 * 2.0,
                mean_us: p99 / 2.0,
                max_us: p99 * 3.0,
            }),
            ..flow("lat", FlowClass::Latency, None, rate)
        };
        let bw = FlowReport {
            messages: 10,
            gbps,
            ..flow("bw", FlowClass::Bandwidth, None, rate)
        };
        scenario(vec![RunReport {
            utilisation: gbps / 100.0,
            jain_bandwidth: Some(1.0),
            wall_seconds: 2.0,
            ..run("with bw", "native", vec![lat, bw])
        }])
    }

    #[test]
    fn the_median_report_takes_each_figure_apart() {
        // Rates 100, 300, 200 (median 200); goodputs 80, 10, 40 (median 40); p99s 5, 7, 6
        // (median 6), each from another repeat; samples 1500, 90, 2000 (fewest 90).
        let repeats = [
            repeat(100.0, 80.0, 5.0, 1500),
            repeat(300.0, 10.0, 7.0, 90),
            repeat(200.0, 40.0, 6.0, 2000),
        ];
        let median = median_report(&repeats).unwrap();
        let run = &median.runs[0];
        let lat = run.flow("lat").unwrap();
        let bw = run.flow("bw").unwrap();
        assert_eq!(lat.msgs_per_sec, 200.0);
        assert_eq!(bw.gbps, 40.0);
        assert_eq!(run.utilisation, 0.4);
        let l = lat.latency.unwrap();
        assert_eq!(l.p99_us, 6.0);
        assert_eq!(l.p50_us, 3.0);
        assert_eq!(l.p999_us, 12.0);
        assert_eq!(l.samples, 90);
        // Messages 1500, 90, 2000: median 1500.
        assert_eq!(lat.messages, 1500);
        let text = render(&repeats);
        assert!(
            text.starts_with("each figure is the median of 3 repeats"),
            "{text}"
        );
        let p99_row = text
            .lines()
            .find(|l| l.contains("lat") && l.contains("p99 (us)"))
            .unwrap();
        let cells: Vec<&str> = p99_row.split_whitespace().collect();
        // run `with bw` is two words: with, bw, lat, p99, (us), 6.00, 5.00, 7.00, 90, *
        assert_eq!(
            cells,
            ["with", "bw", "lat", "p99", "(us)", "6.00", "5.00", "7.00", "90", "*"]
        );
        assert!(
            text.contains("* fewer samples than the percentile needs"),
            "{text}"
        );
        assert!(median_report(&[]).is_none());
    }
}
