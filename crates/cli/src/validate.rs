//! `justitia validate`: every published figure of the validation targets against the
//! model's, the fitted ones kept apart from those the model predicts out of sample.

use std::fs;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use justitia_sim::validation::{self, Outcome, Tag, Validation};

/// The command that regenerates `docs/calibration.md`, written into its header.
const REGENERATE: &str =
    "cargo run --release -p justitia-cli -- validate --markdown docs/calibration.md";

/// Arguments of `justitia validate`.
#[derive(Args, Debug)]
#[command(after_help = "\
Output:
  stdout       one line per check: id, paper's figure, model's figure, error (model - paper)
               / paper, tolerance, fit, identity or validate, result; then the summary of each set
               (checks within tolerance, median and largest error).
  stderr       the scenarios run and the wall time.
  --markdown F the same as a markdown document (docs/calibration.md is this output).

Every scenario the table names runs once, from scenarios/ in the working directory, and
serves all the checks that read it. Fit checks are figures a parameter of profiles/*.toml
was set to; identity checks hold by construction (a fitted capacity, the controller's
sharing floor) and are counted apart; only the validate set measures the model out of
sample.")]
pub struct ValidateArgs {
    /// The table of checks; the one compiled in (crates/sim/validation/targets.toml) if not
    /// given.
    #[arg(long, value_name = "FILE")]
    table: Option<PathBuf>,

    /// Folder of the scenario files the table names.
    #[arg(long, value_name = "DIR", default_value = "scenarios")]
    scenarios: PathBuf,

    /// Also write the result as markdown to FILE (docs/calibration.md).
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
}

/// Runs `justitia validate`.
pub fn run(args: &ValidateArgs) -> Result<()> {
    let checks = match &args.table {
        Some(path) => {
            let text = fs::read_to_string(path)
                .with_context(|| format!("reading validation table {}", path.display()))?;
            validation::parse_table(&text, &path.display().to_string())?
        }
        None => validation::builtin_table()?,
    };
    let result = Validation::run(checks, &args.scenarios, &mut |name| {
        eprintln!("running {name}");
    })
    .with_context(|| format!("running the scenarios in {}", args.scenarios.display()))?;
    print!("{}", render(&result));
    eprintln!(
        "{} scenarios in {:.1} s wall time",
        result.scenarios, result.wall_seconds
    );
    if let Some(path) = &args.markdown {
        fs::write(path, result.markdown(REGENERATE))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The plain-text table and the summaries.
fn render(v: &Validation) -> String {
    let rows: Vec<[String; 7]> = v.outcomes.iter().map(row).collect();
    let header = [
        "id",
        "paper",
        "model",
        "error",
        "tolerance",
        "set",
        "result",
    ]
    .map(String::from);
    let mut widths = header.clone().map(|h| h.chars().count());
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String; 7]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            let pad = w - cell.chars().count();
            // Figures are right-aligned, names and words left-aligned.
            if (1..=4).contains(&i) {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            }
            s.push_str("  ");
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(&header);
    for r in &rows {
        out.push_str(&line(r));
    }
    out.push('\n');
    out.push_str(&v.summary_text(Tag::Validate));
    out.push('\n');
    out.push_str(&v.summary_text(Tag::Fit));
    out.push('\n');
    out.push_str(&v.summary_text(Tag::Identity));
    out.push('\n');
    out
}

fn row(o: &Outcome) -> [String; 7] {
    let c = &o.check;
    let unit = if c.unit.is_empty() {
        String::new()
    } else {
        format!(" {}", c.unit)
    };
    [
        c.id.clone(),
        format!("{}{unit}", c.paper),
        o.model
            .map(|m| format!("{m:.3}"))
            .unwrap_or_else(|| "-".into()),
        o.error
            .map(|e| format!("{:+.1}%", e * 100.0))
            .unwrap_or_else(|| "-".into()),
        c.tolerance_text(),
        c.tag.to_string(),
        o.status.to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use justitia_core::flow::FlowClass;
    use justitia_sim::{FlowReport, RunReport, ScenarioReport};

    use super::*;

    fn report() -> BTreeMap<String, ScenarioReport> {
        let flow = FlowReport {
            name: "bw".into(),
            class: FlowClass::Bandwidth,
            app: "bandwidth".into(),
            messages: 1,
            msgs_per_sec: 1.0,
            gbps: 45.0,
            latency: None,
        };
        let run = RunReport {
            variant: "alone".into(),
            policy: "native".into(),
            flows: vec![flow],
            utilisation: 1.0,
            jain_bandwidth: None,
            policy_figures: BTreeMap::new(),
            fabric_figures: BTreeMap::new(),
            events: 0,
            series: Default::default(),
            wall_seconds: 0.0,
        };
        let report = ScenarioReport {
            scenario: "s".into(),
            description: String::new(),
            profile: "IB-56".into(),
            seed: 1,
            duration_ms: 1.0,
            warmup_ms: 0.0,
            runs: vec![run],
        };
        BTreeMap::from([("s".to_string(), report)])
    }

    #[test]
    fn each_check_is_one_aligned_line_and_the_summary_counts_the_sets() {
        let table = r#"
            [[check]]
            id = "X1.bw"
            what = "a rate"
            paper = 48.0
            unit = "Gb/s"
            source = "s"
            tolerance = 0.05
            basis = "b"
            tag = "validate"
            scenario = "s"
            model = 'gbps("alone", "bw")'
            [[check]]
            id = "X2"
            what = "missing"
            paper = 2.0
            unit = "x"
            source = "s"
            tolerance = 0.3
            basis = "b"
            tag = "validate"
        "#;
        let checks = validation::parse_table(table, "test").unwrap_or_else(|e| panic!("{e}"));
        let v = Validation::evaluate(checks, &report()).unwrap_or_else(|e| panic!("{e}"));
        let text = render(&v);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("id "), "{text}");
        // 45 against 48: -6.25%, outside 5%.
        assert!(
            lines[1].starts_with("X1.bw")
                && lines[1].contains("48 Gb/s")
                && lines[1].contains("45.000")
                && lines[1].contains("-6.2%")
                && lines[1].ends_with("FAIL"),
            "{text}"
        );
        assert!(lines[2].ends_with("no scenario"), "{text}");
        // The paper column is right-aligned: both figures end in the same column.
        let end = |l: &str, s: &str| l.find(s).map(|i| i + s.len());
        assert_eq!(end(lines[1], "Gb/s"), end(lines[2], "2 x"), "{text}");
        assert!(
            text.contains("validate set: 0 of 1 checks within tolerance")
                && text.contains("1 without a scenario")
                && text.contains("median 6.2%"),
            "{text}"
        );
    }
}
