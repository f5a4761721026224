//! How many latency samples a percentile needs before it says more than the largest
//! sample, the notes that say so under a report, and the footnote of the figure tables.

use std::fmt::Write as _;

use comfy_table::{CellAlignment, Table};
use justitia_sim::ScenarioReport;

/// A percentile of a flow's latency samples, as the load generator reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Percentile {
    /// The median.
    P50,
    /// The 99th percentile.
    P99,
    /// The 99.9th percentile.
    P999,
}

impl Percentile {
    /// Its name in tables and verdict lines.
    pub fn name(self) -> &'static str {
        match self {
            Percentile::P50 => "p50",
            Percentile::P99 => "p99",
            Percentile::P999 => "p99.9",
        }
    }

    /// The fewest samples for which this percentile is not simply the largest sample.
    ///
    /// The load generator's histogram (HdrHistogram's `value_at_quantile`) gives the
    /// q-quantile of n samples as the sample of rank ceil(q·n), counting from 1 at the
    /// smallest. That rank is n, the largest sample, exactly when q·n > n − 1, that is when
    /// n < 1 / (1 − q). So the percentile names some other sample only from
    /// n = 1 / (1 − q) on: 2 samples for p50, 100 for p99 (rank 99 of 100), 1000 for p99.9
    /// (rank 999 of 1000). Below that a "p99" is the one worst sample, and a ratio of two
    /// of them compares outliers, not tails.
    pub fn min_samples(self) -> u64 {
        match self {
            Percentile::P50 => 2,
            Percentile::P99 => 100,
            Percentile::P999 => 1000,
        }
    }

    /// Whether `samples` are enough for this percentile to be other than the largest.
    pub fn distinct_from_max(self, samples: u64) -> bool {
        samples >= self.min_samples()
    }

    /// The percentile a table's figure label (`p99 (us)`) names, if any.
    pub fn of_figure(figure: &str) -> Option<Percentile> {
        [Percentile::P50, Percentile::P99, Percentile::P999]
            .into_iter()
            .find(|p| figure.strip_prefix(p.name()) == Some(" (us)"))
    }
}

/// Writes a table of figures (its columns 3 to 6 numbers, right-aligned) indented under
/// a heading already in `out`, and, when a percentile in it was `marked` with `*`, the
/// footnote that says why.
pub fn write_figure_table(out: &mut String, table: &mut Table, marked: bool) {
    for i in 3..7 {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    for line in table.lines() {
        let _ = writeln!(out, "  {}", line.trim_end());
    }
    if marked {
        let _ = writeln!(
            out,
            "  * fewer samples than the percentile needs (p99 100, p99.9 1000): it is the largest sample"
        );
    }
}

/// One note for every flow of every run whose p99 or p99.9 is only its largest sample,
/// naming the flow, the run, the samples and what the percentile needs.
pub fn notes(report: &ScenarioReport) -> Vec<String> {
    let mut out = Vec::new();
    for run in &report.runs {
        for flow in &run.flows {
            let Some(latency) = &flow.latency else {
                continue;
            };
            let n = latency.samples;
            let maxed: Vec<Percentile> = [Percentile::P99, Percentile::P999]
                .into_iter()
                .filter(|p| !p.distinct_from_max(n))
                .collect();
            let needs: Vec<String> = maxed
                .iter()
                .map(|p| format!("{} needs {}", p.name(), p.min_samples()))
                .collect();
            let names: Vec<&str> = maxed.iter().map(|p| p.name()).collect();
            match names.as_slice() {
                [] => {}
                [one] => out.push(format!(
                    "{} in `{}`: {n} samples, so {one} is its largest sample ({})",
                    flow.name,
                    run.variant,
                    needs.join(", ")
                )),
                _ => out.push(format!(
                    "{} in `{}`: {n} samples, so {} are both its largest sample ({})",
                    flow.name,
                    run.variant,
                    names.join(" and "),
                    needs.join(", ")
                )),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::fixtures::{run, scenario};
    use super::*;
    use justitia_core::flow::FlowClass;
    use justitia_sim::{FlowReport, LatencyReport};

    #[test]
    fn a_percentile_needs_one_over_one_minus_q_samples() {
        // The histogram's rank of the q-quantile of n samples, ceil(q·n), in whole numbers:
        // q = 99/100 gives ceil(99·n / 100), q = 999/1000 gives ceil(999·n / 1000).
        for n in 1u64..=3000 {
            let p99_rank = (99 * n).div_ceil(100);
            let p999_rank = (999 * n).div_ceil(1000);
            assert_eq!(
                Percentile::P99.distinct_from_max(n),
                p99_rank < n,
                "n = {n}"
            );
            assert_eq!(
                Percentile::P999.distinct_from_max(n),
                p999_rank < n,
                "n = {n}"
            );
        }
        // The boundaries: 99 samples make p99 the 99th of 99, 100 make it the 99th of 100.
        assert!(!Percentile::P99.distinct_from_max(99));
        assert!(Percentile::P99.distinct_from_max(100));
        assert!(!Percentile::P999.distinct_from_max(999));
        assert!(Percentile::P999.distinct_from_max(1000));
        assert_eq!(Percentile::of_figure("p99.9 (us)"), Some(Percentile::P999));
        assert_eq!(Percentile::of_figure("p99 (us)"), Some(Percentile::P99));
        assert_eq!(Percentile::of_figure("rate (msgs/s)"), None);
    }

    fn report_with_samples(samples: &[u64]) -> ScenarioReport {
        let flows = samples
            .iter()
            .enumerate()
            .map(|(i, &samples)| FlowReport {
                name: format!("lat{i}"),
                class: FlowClass::Latency,
                app: "latency".into(),
                messages: samples,
                msgs_per_sec: 1.0,
                gbps: 0.0,
                latency: Some(LatencyReport {
                    samples,
                    p50_us: 1.0,
                    p99_us: 2.0,
                    p999_us: 3.0,
                    mean_us: 1.0,
                    max_us: 3.0,
                }),
            })
            .collect();
        scenario(vec![run("alone", "native", flows)])
    }

    #[test]
    fn notes_name_each_flow_whose_tail_is_its_largest_sample() {
        let notes = notes(&report_with_samples(&[72, 500, 1000]));
        assert_eq!(
            notes,
            [
                "lat0 in `alone`: 72 samples, so p99 and p99.9 are both its largest sample (p99 needs 100, p99.9 needs 1000)",
                "lat1 in `alone`: 500 samples, so p99.9 is its largest sample (p99.9 needs 1000)",
            ]
        );
    }
}
