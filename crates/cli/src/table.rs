//! The terminal report: a heading per scenario, then per run a summary line and a table of
//! its flows.

use std::fmt::Write as _;

use comfy_table::{CellAlignment, ColumnConstraint, Table, Width};
use justitia_sim::{FlowReport, RunReport, ScenarioReport};

use crate::backend::Backend;

/// Column headings of the flow table, units in brackets.
pub const FLOW_COLUMNS: [&str; 7] = [
    "flow",
    "class",
    "p50 (us)",
    "p99 (us)",
    "p99.9 (us)",
    "rate (msgs/s)",
    "goodput (Gb/s)",
];

/// A table style with no borders and a dashed line under the headings only (comfy-table's
/// preset string: the sixth character draws header lines, spaces draw nothing).
const UNDERLINED_HEADER: &str = "     -             ";

/// Columns that hold text; the others are numbers and align right.
const TEXT_COLUMNS: usize = 2;

/// Renders the whole report of one simulated scenario.
pub fn render(report: &ScenarioReport) -> String {
    render_on(report, &Backend::Simulator)
}

/// Renders the whole report of one scenario, its heading naming the backend it ran on.
pub fn render_on(report: &ScenarioReport, backend: &Backend) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "{}: {}", report.scenario, report.description);
    let _ = writeln!(out, "{}", backend.heading(report));
    let mut tables: Vec<Table> = report.runs.iter().map(|r| flow_table(&r.flows)).collect();
    same_column_widths(&mut tables);
    for (i, (run, table)) in report.runs.iter().zip(&tables).enumerate() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "[{}/{}] {}",
            i + 1,
            report.runs.len(),
            run_summary(run)
        );
        for line in table.lines() {
            let _ = writeln!(out, "  {}", line.trim_end());
        }
        for line in policy_figures(run) {
            let _ = writeln!(out, "  {line}");
        }
        if !run.fabric_figures.is_empty() {
            let figures: Vec<String> = run
                .fabric_figures
                .iter()
                .map(|(k, v)| format!("{k} {}", number(*v)))
                .collect();
            let _ = writeln!(out, "  fabric: {}", figures.join(", "));
        }
    }
    out
}

/// Gives every table the widest width of each column, so that the runs of a scenario line
/// up under each other and read as one comparison.
fn same_column_widths(tables: &mut [Table]) {
    let mut widths: Vec<u16> = Vec::new();
    for table in tables.iter() {
        for (i, w) in table.column_max_content_widths().into_iter().enumerate() {
            match widths.get_mut(i) {
                Some(widest) => *widest = (*widest).max(w),
                None => widths.push(w),
            }
        }
    }
    for table in tables {
        let padded: Vec<u16> = table
            .column_iter()
            .zip(&widths)
            .map(|(column, &w)| w.saturating_add(column.padding_width()))
            .collect();
        // An absolute width counts the cell padding too.
        table.set_constraints(
            padded
                .into_iter()
                .map(|w| ColumnConstraint::Absolute(Width::Fixed(w))),
        );
    }
}

/// What the policy reported about itself, one line per host (`a.safe_util_gbps` and
/// `a.tokens` become `policy on a: safe_util_gbps 24, tokens 18162`).
fn policy_figures(run: &RunReport) -> Vec<String> {
    let mut hosts: Vec<(&str, Vec<String>)> = Vec::new();
    for (key, value) in &run.policy_figures {
        let (host, figure) = key.split_once('.').unwrap_or(("", key));
        let entry = format!("{figure} {}", number(*value));
        match hosts.iter_mut().find(|(h, _)| *h == host) {
            Some((_, figures)) => figures.push(entry),
            None => hosts.push((host, vec![entry])),
        }
    }
    hosts
        .into_iter()
        .map(|(host, figures)| format!("policy on {host}: {}", figures.join(", ")))
        .collect()
}

/// One line about a run: its name, policy and run-wide figures.
fn run_summary(run: &RunReport) -> String {
    let jain = run
        .jain_bandwidth
        .map_or_else(|| "-".to_string(), |j| format!("{j:.3}"));
    format!(
        "{}: policy {}, utilisation {:.1} %, Jain index (bandwidth flows) {}, {} events",
        run.variant,
        run.policy,
        run.utilisation * 100.0,
        jain,
        count(run.events),
    )
}

fn flow_table(flows: &[FlowReport]) -> Table {
    let mut table = Table::new();
    table.load_preset(UNDERLINED_HEADER);
    table.set_header(FLOW_COLUMNS.to_vec());
    for flow in flows {
        let latency = |pick: fn(&justitia_sim::LatencyReport) -> f64| {
            flow.latency
                .as_ref()
                .map_or_else(|| "-".to_string(), |l| format!("{:.2}", pick(l)))
        };
        table.add_row(vec![
            flow.name.clone(),
            flow.class.to_string(),
            latency(|l| l.p50_us),
            latency(|l| l.p99_us),
            latency(|l| l.p999_us),
            rate(flow.msgs_per_sec),
            format!("{:.2}", flow.gbps),
        ]);
    }
    for column in table.column_iter_mut().skip(TEXT_COLUMNS) {
        column.set_cell_alignment(CellAlignment::Right);
    }
    // The first column starts flush, so that the heading underline starts with the text.
    if let Some(first) = table.column_iter_mut().next() {
        first.set_padding((0, 1));
    }
    table
}

/// A number without a needless fraction: `30`, `2.5`.
/// A policy's figure: whole numbers as they are, others to three decimals without trailing
/// zeros (`1.982`, not the `1.9819999999999998` an f32 widened to f64 prints as).
pub(crate) fn number(x: f64) -> String {
    if x.fract() == 0.0 {
        return format!("{x}");
    }
    let text = format!("{x:.3}");
    match text.trim_end_matches('0').trim_end_matches('.') {
        "-0" => "0".to_string(),
        short => short.to_string(),
    }
}

/// A rate with three significant figures and a k or M multiplier: `384 k`, `5.74 k`,
/// `13.0 M`, `229`; 1 MB transfers and 16 B messages differ by five orders of magnitude.
fn rate(per_sec: f64) -> String {
    let (scaled, suffix) = if per_sec >= 1e6 {
        (per_sec / 1e6, " M")
    } else if per_sec >= 1e3 {
        (per_sec / 1e3, " k")
    } else {
        (per_sec, "")
    };
    let decimals = if scaled >= 100.0 {
        0
    } else if scaled >= 10.0 {
        1
    } else {
        2
    };
    format!("{scaled:.decimals$}{suffix}")
}

/// A count in thousands or millions, so that large counts read at a glance.
fn count(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1} k", n as f64 / 1e3),
        _ => format!("{:.1} M", n as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use justitia_core::flow::FlowClass;
    use justitia_sim::LatencyReport;
    use std::collections::BTreeMap;

    fn report() -> ScenarioReport {
        let lat = FlowReport {
            name: "lat".into(),
            class: FlowClass::Latency,
            app: "latency".into(),
            messages: 1000,
            msgs_per_sec: 385_000.0,
            gbps: 0.05,
            latency: Some(LatencyReport {
                samples: 1000,
                p50_us: 1.3,
                p99_us: 1.4,
                p999_us: 1.55,
                mean_us: 1.31,
                max_us: 2.0,
            }),
        };
        let bw = FlowReport {
            name: "bw".into(),
            class: FlowClass::Bandwidth,
            app: "bandwidth".into(),
            messages: 100,
            msgs_per_sec: 5_700.0,
            gbps: 47.9,
            latency: None,
        };
        ScenarioReport {
            scenario: "s".into(),
            description: "a test".into(),
            profile: "IB-56".into(),
            seed: 1,
            duration_ms: 30.0,
            warmup_ms: 2.5,
            runs: vec![RunReport {
                variant: "with bw".into(),
                policy: "native".into(),
                flows: vec![lat, bw],
                utilisation: 0.978,
                jain_bandwidth: Some(1.0),
                policy_figures: BTreeMap::new(),
                fabric_figures: BTreeMap::new(),
                events: 1_234_567,
                series: Default::default(),
                wall_seconds: 0.5,
            }],
        }
    }

    #[test]
    fn render_shows_every_figure_with_units() {
        let text = render(&report());
        assert!(text.starts_with("s: a test\n"));
        assert!(text.contains("30 ms simulated per run (first 2.5 ms not measured), seed 1"));
        assert!(text.contains(
            "[1/1] with bw: policy native, utilisation 97.8 %, Jain index (bandwidth flows) 1.000, 1.2 M events"
        ));
        for heading in FLOW_COLUMNS {
            assert!(text.contains(heading), "missing column {heading}");
        }
        let lat = text
            .lines()
            .find(|l| l.contains("lat "))
            .unwrap_or_default();
        for figure in ["latency", "1.30", "1.40", "1.55", "385 k", "0.05"] {
            assert!(lat.contains(figure), "{figure} missing from {lat}");
        }
        let bw = text.lines().find(|l| l.contains("bw ")).unwrap_or_default();
        assert_eq!(bw.matches(" - ").count(), 3, "{bw}");
        assert!(bw.contains("47.90"));
    }

    #[test]
    fn numbers_align_right() {
        let text = render(&report());
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("lat ") || l.contains("bw "))
            .collect();
        assert_eq!(rows.len(), 2);
        // Right alignment puts the last digit of each goodput in the same column.
        let end = |row: &str, figure: &str| row.find(figure).map(|i| i + figure.len());
        assert_eq!(end(rows[0], "0.05"), end(rows[1], "47.90"));
    }

    #[test]
    fn rates_keep_three_figures() {
        assert_eq!(rate(229.4), "229");
        assert_eq!(rate(5_740.7), "5.74 k");
        assert_eq!(rate(383_703.7), "384 k");
        assert_eq!(rate(13_040_000.0), "13.0 M");
        assert_eq!(rate(0.5), "0.50");
    }

    #[test]
    fn policy_numbers_drop_float_noise() {
        assert_eq!(number(48.0), "48");
        assert_eq!(number(18162.0), "18162");
        assert_eq!(number(1.9819999999999998), "1.982");
        assert_eq!(number(f64::from(28.952_f32)), "28.952");
        assert_eq!(number(0.5), "0.5");
        assert_eq!(number(-0.0004), "0");
    }

    #[test]
    fn policy_figures_read_per_host() {
        let mut run = report().runs.remove(0);
        assert!(policy_figures(&run).is_empty());
        run.policy_figures.insert("a.safe_util_gbps".into(), 24.0);
        run.policy_figures.insert("a.tokens".into(), 18162.0);
        run.policy_figures.insert("b.tokens".into(), 0.0);
        assert_eq!(
            policy_figures(&run),
            vec![
                "policy on a: safe_util_gbps 24, tokens 18162",
                "policy on b: tokens 0"
            ]
        );
    }

    #[test]
    fn counts_read_at_a_glance() {
        assert_eq!(count(42), "42");
        assert_eq!(count(12_345), "12.3 k");
        assert_eq!(count(98_765_432), "98.8 M");
    }
}
