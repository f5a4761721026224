//! Calibration kept apart from validation: the papers' figures the model is judged by.
//!
//! One table (`crates/sim/validation/targets.toml`, compiled in as [`BUILTIN_TABLE`]) has a
//! check for every published figure of the validation targets (N.., J.., P.., R..): the
//! figure as published, its source, the tolerance and why, the scenario and the expression
//! over that scenario's report that gives the model's figure, and whether the figure was
//! used to set a model parameter (`fit`), holds by construction (`identity`), or neither
//! (`validate`). Only the validate set says how well the model predicts; a fitted figure met
//! within tolerance shows only that the fit held, and an identity (a total equal to the
//! MaxRate a parameter was fitted to, a share equal to the controller's sharing floor, a
//! ratio of two runs the model cannot tell apart) cannot fail while the model runs at all.
//! Identities are shown and counted apart, never in the validate set.
//!
//! [`Validation::run`] runs every scenario the table names once and evaluates every check
//! against the reports; `justitia validate` prints the result and writes
//! `docs/calibration.md` from it.
//!
//! A model figure is an expression of metrics, numbers and `+ - * /`, with parentheses:
//!
//! | metric | value |
//! | --- | --- |
//! | `p50`, `p99`, `p999`, `mean` (`"variant", "flow"`) | the flow's latency percentile or mean, us |
//! | `gbps` (`"variant", "flow"`) | the flow's payload rate, Gb/s |
//! | `mmsgs` (`"variant", "flow"`) | the flow's message rate, M msgs/s |
//! | `sum`, `jain`, `min`, `max` (`metric, "variant", "prefix"`) | over the flows whose names start with `prefix` |
//!
//! Each metric may name another scenario first (`p50("scenario", "variant", "flow")`);
//! otherwise it reads the check's own scenario.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;
use std::time::Instant;

use serde::Deserialize;

use crate::report::{jain_index, FlowReport, ScenarioReport};
use crate::{Experiment, RunError, ScenarioError};

/// The table of checks, as compiled into the library.
pub const BUILTIN_TABLE: &str = include_str!("../validation/targets.toml");

/// Why the table could not be read or a check could not be evaluated.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    /// The table's TOML did not parse or has unknown or mistyped fields.
    #[error("validation table {origin}: {message}")]
    Table {
        /// Where the table came from.
        origin: String,
        /// The parser's message.
        message: String,
    },
    /// One check of the table is malformed.
    #[error("validation table {origin}, check `{id}`: {reason}")]
    Check {
        /// Where the table came from.
        origin: String,
        /// The check.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A scenario the table names did not load.
    #[error("validation scenario `{scenario}`: {source}")]
    Scenario {
        /// The scenario's name.
        scenario: String,
        /// Why it did not load (boxed: it is large, and rare).
        source: Box<ScenarioError>,
    },
    /// A scenario the table names did not run.
    #[error("validation scenario `{scenario}`: {source}")]
    Run {
        /// The scenario's name.
        scenario: String,
        /// Why it did not run (boxed: it is large, and rare).
        source: Box<RunError>,
    },
    /// A check's expression names a run, flow or figure the report does not have.
    #[error("check `{id}`: {reason}")]
    Evaluate {
        /// The check.
        id: String,
        /// What was missing.
        reason: String,
    },
}

/// Whether a figure was used to set a model parameter, or holds by construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tag {
    /// A parameter of `profiles/*.toml` was fitted to this figure: meeting it shows the fit
    /// held, nothing more.
    Fit,
    /// The model's figure equals the published one by construction: a total equal to a
    /// fitted capacity, a share equal to the controller's sharing floor, a ratio of two runs
    /// the model serves alike. Shown, never counted as a validation; its basis says why
    /// (`identity: ...`).
    Identity,
    /// No parameter was set from this figure and it does not hold by construction: it
    /// tests the model out of sample.
    Validate,
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tag::Fit => "fit",
            Tag::Identity => "identity",
            Tag::Validate => "validate",
        })
    }
}

/// A published figure: a value, a range, or only a direction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Published {
    /// One value.
    Value(f64),
    /// A range, low to high (the paper gives a span, e.g. over message sizes).
    Range(f64, f64),
    /// Only a direction: the figure lies above this bound.
    Above(f64),
    /// Only a direction: the figure lies below this bound.
    Below(f64),
}

impl Published {
    /// The model's signed distance from the figure, relative to it (zero inside a range);
    /// `None` for a direction.
    pub fn relative_error(&self, model: f64) -> Option<f64> {
        match *self {
            Published::Value(v) => Some((model - v) / v),
            Published::Range(lo, _) if model < lo => Some((model - lo) / lo),
            Published::Range(_, hi) if model > hi => Some((model - hi) / hi),
            Published::Range(..) => Some(0.0),
            Published::Above(_) | Published::Below(_) => None,
        }
    }

    /// The model's signed distance from the figure in its unit (zero inside a range); `None`
    /// for a direction.
    pub fn absolute_error(&self, model: f64) -> Option<f64> {
        match *self {
            Published::Value(v) => Some(model - v),
            Published::Range(lo, _) if model < lo => Some(model - lo),
            Published::Range(_, hi) if model > hi => Some(model - hi),
            Published::Range(..) => Some(0.0),
            Published::Above(_) | Published::Below(_) => None,
        }
    }
}

impl fmt::Display for Published {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Published::Value(v) => write!(f, "{}", short(v)),
            Published::Range(lo, hi) => write!(f, "{}-{}", short(lo), short(hi)),
            Published::Above(v) => write!(f, "> {}", short(v)),
            Published::Below(v) => write!(f, "< {}", short(v)),
        }
    }
}

/// How far the model may be from a value or range and still meet it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// A fraction of the published figure.
    Relative(f64),
    /// An amount in the figure's unit.
    Absolute(f64),
    /// A direction is met or not; it has no tolerance.
    Direction,
}

/// One published figure and how the model's is obtained.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    /// Unique id, starting with the target's (`N2.ib.p50x`).
    pub id: String,
    /// The target of `validation-targets.md` (`N2`).
    pub target: String,
    /// What the figure is.
    pub what: String,
    /// The published figure.
    pub paper: Published,
    /// Its unit (`us`, `Gb/s`, `x` for a ratio).
    pub unit: String,
    /// Where it is published.
    pub source: String,
    /// How far off the model may be.
    pub tolerance: Tolerance,
    /// Why that tolerance.
    pub basis: String,
    /// Fitted or out of sample.
    pub tag: Tag,
    /// The scenario producing the model's figure; `None` where the simulator has none yet.
    pub scenario: Option<String>,
    /// The model's figure, as written in the table.
    pub model: Option<String>,
    expr: Option<Expr>,
}

impl Check {
    /// The scenarios this check reads.
    pub fn scenarios(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        if let (Some(own), Some(expr)) = (&self.scenario, &self.expr) {
            expr.scenarios(own, &mut out);
        }
        out
    }

    /// The tolerance as written for a reader (`±25%`, `±0.2 us`, `direction`).
    pub fn tolerance_text(&self) -> String {
        match self.tolerance {
            Tolerance::Relative(t) => format!("±{}%", short(t * 100.0)),
            Tolerance::Absolute(t) => format!("±{} {}", short(t), self.unit)
                .trim_end()
                .to_string(),
            Tolerance::Direction => "direction".to_string(),
        }
    }
}

/// The table as written in TOML.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    check: Vec<CheckFile>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PaperFile {
    One(f64),
    Two([f64; 2]),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckFile {
    id: String,
    what: String,
    #[serde(default)]
    paper: Option<PaperFile>,
    #[serde(default)]
    above: Option<f64>,
    #[serde(default)]
    below: Option<f64>,
    unit: String,
    source: String,
    #[serde(default)]
    tolerance: Option<f64>,
    #[serde(default)]
    tolerance_abs: Option<f64>,
    basis: String,
    tag: Tag,
    #[serde(default)]
    scenario: Option<String>,
    #[serde(default)]
    model: Option<String>,
}

/// Parses a table; `origin` names it in errors.
pub fn parse_table(text: &str, origin: &str) -> Result<Vec<Check>, ValidationError> {
    let file: TableFile = toml::from_str(text).map_err(|e| ValidationError::Table {
        origin: origin.to_string(),
        message: e.to_string().trim().to_string(),
    })?;
    let mut seen = BTreeSet::new();
    file.check
        .into_iter()
        .map(|c| {
            let bad = |reason: String| ValidationError::Check {
                origin: origin.to_string(),
                id: c.id.clone(),
                reason,
            };
            if !seen.insert(c.id.clone()) {
                return Err(bad("the id is used twice".into()));
            }
            let target = c
                .id
                .split('.')
                .next()
                .filter(|t| !t.is_empty())
                .ok_or_else(|| bad("the id must start with the target's id".into()))?
                .to_string();
            let paper = match (&c.paper, c.above, c.below) {
                (Some(PaperFile::One(v)), None, None) if *v != 0.0 => Published::Value(*v),
                (Some(PaperFile::Two([lo, hi])), None, None) if lo < hi && *lo != 0.0 => {
                    Published::Range(*lo, *hi)
                }
                (None, Some(v), None) => Published::Above(v),
                (None, None, Some(v)) => Published::Below(v),
                _ => {
                    return Err(bad(
                        "give exactly one of `paper` (a non-zero value or [low, high]), `above` or `below`"
                            .into(),
                    ))
                }
            };
            let direction = matches!(paper, Published::Above(_) | Published::Below(_));
            let tolerance = match (c.tolerance, c.tolerance_abs, direction) {
                (None, None, true) => Tolerance::Direction,
                (Some(t), None, false) if t > 0.0 => Tolerance::Relative(t),
                (None, Some(t), false) if t > 0.0 => Tolerance::Absolute(t),
                _ => {
                    return Err(bad(
                        "a value or range needs one positive `tolerance` (relative) or `tolerance_abs`; a direction (`above`, `below`) neither"
                            .into(),
                    ))
                }
            };
            let expr = match (&c.scenario, &c.model) {
                (Some(_), Some(m)) => Some(parse_expr(m).map_err(|e| bad(format!("model: {e}")))?),
                (None, None) => None,
                _ => return Err(bad("give both `scenario` and `model`, or neither".into())),
            };
            Ok(Check {
                target,
                what: c.what,
                paper,
                unit: c.unit,
                source: c.source,
                tolerance,
                basis: c.basis,
                tag: c.tag,
                scenario: c.scenario,
                model: c.model,
                expr,
                id: c.id,
            })
        })
        .collect()
}

/// The built-in table.
pub fn builtin_table() -> Result<Vec<Check>, ValidationError> {
    parse_table(BUILTIN_TABLE, "crates/sim/validation/targets.toml")
}

/// What became of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Within tolerance, or the direction holds.
    Pass,
    /// Outside tolerance, or the direction does not hold.
    Fail,
    /// The simulator has no scenario for the figure.
    NoScenario,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::NoScenario => "no scenario",
        })
    }
}

/// One check with the model's figure.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The check.
    pub check: Check,
    /// The model's figure; `None` without a scenario.
    pub model: Option<f64>,
    /// The model's error relative to the published figure; `None` for a direction or
    /// without a scenario.
    pub error: Option<f64>,
    /// Met or not.
    pub status: Status,
}

impl Outcome {
    fn judge(check: Check, model: Option<f64>) -> Self {
        let Some(m) = model else {
            return Outcome {
                check,
                model,
                error: None,
                status: Status::NoScenario,
            };
        };
        let error = check.paper.relative_error(m);
        let met = match (check.paper, check.tolerance) {
            (Published::Above(b), _) => m > b,
            (Published::Below(b), _) => m < b,
            (_, Tolerance::Relative(t)) => error.is_some_and(|e| e.abs() <= t),
            (p, Tolerance::Absolute(t)) => p.absolute_error(m).is_some_and(|e| e.abs() <= t),
            (_, Tolerance::Direction) => false,
        } && m.is_finite();
        Outcome {
            check,
            model,
            error,
            status: if met { Status::Pass } else { Status::Fail },
        }
    }
}

/// Counts and errors of one set (fit or validate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Checks with a scenario.
    pub checked: usize,
    /// Of those, within tolerance (or direction met).
    pub passed: usize,
    /// Of those, directions only.
    pub directions: usize,
    /// Checks without a scenario.
    pub no_scenario: usize,
    /// Median of the absolute relative errors of values and ranges.
    pub median_error: Option<f64>,
    /// Largest absolute relative error, with the check's id.
    pub max_error: Option<(f64, usize)>,
}

/// All checks evaluated.
#[derive(Clone, Debug, PartialEq)]
pub struct Validation {
    /// One per check, in table order.
    pub outcomes: Vec<Outcome>,
    /// Wall-clock time of the scenario runs, seconds (not part of any written report).
    pub wall_seconds: f64,
    /// Scenarios run.
    pub scenarios: usize,
}

impl Validation {
    /// Runs every scenario the checks read (each once, from `scenarios_dir`) and evaluates
    /// every check; `progress` hears each scenario's name before it runs.
    pub fn run(
        checks: Vec<Check>,
        scenarios_dir: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self, ValidationError> {
        let started = Instant::now();
        let names: BTreeSet<String> = checks.iter().flat_map(Check::scenarios).collect();
        let mut reports = BTreeMap::new();
        for name in &names {
            progress(name);
            let experiment =
                Experiment::load(scenarios_dir.join(format!("{name}.toml"))).map_err(|source| {
                    ValidationError::Scenario {
                        scenario: name.clone(),
                        source: Box::new(source),
                    }
                })?;
            let report = experiment.run().map_err(|source| ValidationError::Run {
                scenario: name.clone(),
                source: Box::new(source),
            })?;
            reports.insert(name.clone(), report);
        }
        let wall_seconds = started.elapsed().as_secs_f64();
        let mut v = Self::evaluate(checks, &reports)?;
        v.wall_seconds = wall_seconds;
        Ok(v)
    }

    /// Evaluates every check against reports already run, keyed by scenario name.
    pub fn evaluate(
        checks: Vec<Check>,
        reports: &BTreeMap<String, ScenarioReport>,
    ) -> Result<Self, ValidationError> {
        let outcomes = checks
            .into_iter()
            .map(|check| {
                let model = match (&check.scenario, &check.expr) {
                    (Some(own), Some(expr)) => Some(expr.eval(own, reports).map_err(|reason| {
                        ValidationError::Evaluate {
                            id: check.id.clone(),
                            reason,
                        }
                    })?),
                    _ => None,
                };
                Ok(Outcome::judge(check, model))
            })
            .collect::<Result<Vec<_>, ValidationError>>()?;
        Ok(Validation {
            outcomes,
            wall_seconds: 0.0,
            scenarios: reports.len(),
        })
    }

    /// Counts and errors of the checks tagged `tag`.
    pub fn summary(&self, tag: Tag) -> Summary {
        let set: Vec<(usize, &Outcome)> = self
            .outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| o.check.tag == tag)
            .collect();
        let checked: Vec<&(usize, &Outcome)> = set
            .iter()
            .filter(|(_, o)| o.status != Status::NoScenario)
            .collect();
        let mut errors: Vec<(f64, usize)> = checked
            .iter()
            .filter_map(|(i, o)| o.error.map(|e| (e.abs(), *i)))
            .collect();
        errors.sort_by(|a, b| a.0.total_cmp(&b.0));
        let median_error = match errors.len() {
            0 => None,
            n if n % 2 == 1 => Some(errors[n / 2].0),
            n => Some((errors[n / 2 - 1].0 + errors[n / 2].0) / 2.0),
        };
        Summary {
            checked: checked.len(),
            passed: checked
                .iter()
                .filter(|(_, o)| o.status == Status::Pass)
                .count(),
            directions: checked.iter().filter(|(_, o)| o.error.is_none()).count(),
            no_scenario: set.len() - checked.len(),
            median_error,
            max_error: errors.last().copied(),
        }
    }

    /// The summary of one set in a sentence.
    pub fn summary_text(&self, tag: Tag) -> String {
        let s = self.summary(tag);
        let mut text = format!(
            "{tag} set: {} of {} checks within tolerance ({} values or ranges, {} directions), {} without a scenario",
            s.passed,
            s.checked,
            s.checked - s.directions,
            s.directions,
            s.no_scenario
        );
        let (met, targets) = self.targets_met(tag);
        text.push_str(&format!(
            "; {met} of {targets} targets with every such check within tolerance"
        ));
        if let (Some(median), Some((max, at))) = (s.median_error, s.max_error) {
            text.push_str(&format!(
                "; error |model - paper| / paper of the values: median {:.1}%, max {:.0}% ({})",
                median * 100.0,
                max * 100.0,
                self.outcomes[at].check.id
            ));
        }
        text
    }

    /// Targets (`N3`) with at least one check tagged `tag` that has a scenario, and of those
    /// the ones whose every such check is met: (met, targets).
    pub fn targets_met(&self, tag: Tag) -> (usize, usize) {
        let mut all_met: BTreeMap<&str, bool> = BTreeMap::new();
        for o in &self.outcomes {
            if o.check.tag == tag && o.status != Status::NoScenario {
                let met = all_met.entry(o.check.target.as_str()).or_insert(true);
                *met &= o.status == Status::Pass;
            }
        }
        (all_met.values().filter(|m| **m).count(), all_met.len())
    }

    /// The ids of the validate-set checks outside tolerance.
    pub fn validate_failures(&self) -> Vec<&Outcome> {
        self.outcomes
            .iter()
            .filter(|o| o.check.tag == Tag::Validate && o.status == Status::Fail)
            .collect()
    }

    /// `docs/calibration.md`: the summary and every check, deterministic (no wall time).
    pub fn markdown(&self, regenerate: &str) -> String {
        let mut md = String::new();
        md.push_str("# Calibration and validation\n\n");
        md.push_str(&format!(
            "<!-- Generated from crates/sim/validation/targets.toml; do not edit. Regenerate with:\n     {regenerate} -->\n\n"
        ));
        md.push_str(
            "Every published figure of the validation targets (`validation-targets.md`) and \
             of the applications Justitia measured (A), the model's figure from a simulator scenario, and whether a model parameter was fitted \
             to it (`fit`: meeting it shows only that the fit held), whether it holds by \
             construction (`identity`: shown, not counted) or neither (`validate`: out of \
             sample). Errors are (model - paper) / paper, zero inside a published range; a \
             direction is met or not.\n\n",
        );
        md.push_str(&format!("- {}\n", self.summary_text(Tag::Validate)));
        md.push_str(&format!("- {}\n", self.summary_text(Tag::Fit)));
        md.push_str(&format!("- {}\n", self.summary_text(Tag::Identity)));
        md.push_str(&format!("- scenarios run: {}\n\n", self.scenarios));
        let gaps = self.validate_failures();
        if !gaps.is_empty() {
            md.push_str("## Validate-set checks outside tolerance\n\n");
            for o in gaps {
                md.push_str(&format!(
                    "- {}: {}: paper {} {}, model {}{}\n",
                    o.check.id,
                    o.check.what,
                    o.check.paper,
                    o.check.unit,
                    o.model.map(short).unwrap_or_default(),
                    o.error
                        .map(|e| format!(" ({:+.0}%)", e * 100.0))
                        .unwrap_or_default()
                ));
            }
            md.push('\n');
        }
        md.push_str("## All checks\n\n");
        md.push_str("| id | figure | paper | model | error | tolerance | set | result | source | scenario: model | tolerance basis |\n");
        md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for o in &self.outcomes {
            let c = &o.check;
            md.push_str(&format!(
                "| {} | {} | {} {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                c.id,
                cell(&c.what),
                c.paper,
                c.unit,
                o.model.map(short).unwrap_or_else(|| "-".into()),
                o.error
                    .map(|e| format!("{:+.1}%", e * 100.0))
                    .unwrap_or_else(|| "-".into()),
                c.tolerance_text(),
                c.tag,
                o.status,
                cell(&c.source),
                match (&c.scenario, &c.model) {
                    (Some(s), Some(m)) => format!("`{s}`: `{}`", cell(m)),
                    _ => "-".into(),
                },
                cell(&c.basis),
            ));
        }
        md
    }
}

/// A number with three significant figures at most, no trailing zeros.
fn short(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let magnitude = if v == 0.0 {
        0
    } else {
        v.abs().log10().floor() as i32
    };
    let decimals = (2 - magnitude).clamp(0, 4) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Text safe inside a markdown table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// A flow figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Metric {
    P50,
    P99,
    P999,
    Mean,
    Gbps,
    Mmsgs,
}

impl Metric {
    fn named(name: &str) -> Option<Self> {
        Some(match name {
            "p50" => Metric::P50,
            "p99" => Metric::P99,
            "p999" => Metric::P999,
            "mean" => Metric::Mean,
            "gbps" => Metric::Gbps,
            "mmsgs" => Metric::Mmsgs,
            _ => return None,
        })
    }

    fn of(self, flow: &FlowReport) -> Result<f64, String> {
        let latency = || {
            flow.latency
                .ok_or_else(|| format!("flow `{}` took no latency samples", flow.name))
        };
        Ok(match self {
            Metric::P50 => latency()?.p50_us,
            Metric::P99 => latency()?.p99_us,
            Metric::P999 => latency()?.p999_us,
            Metric::Mean => latency()?.mean_us,
            Metric::Gbps => flow.gbps,
            Metric::Mmsgs => flow.msgs_per_sec / 1e6,
        })
    }
}

/// How a metric is combined over several flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Aggregate {
    Sum,
    Jain,
    Min,
    Max,
}

/// Where a metric is read: an optional other scenario, a run, a flow (or a flow prefix).
#[derive(Clone, Debug, PartialEq)]
struct Place {
    scenario: Option<String>,
    variant: String,
    flow: String,
}

#[derive(Clone, Debug, PartialEq)]
enum Expr {
    Number(f64),
    Flow(Metric, Place),
    Flows(Aggregate, Metric, Place),
    Binary(char, Box<Expr>, Box<Expr>),
}

impl Expr {
    fn scenarios(&self, own: &str, out: &mut BTreeSet<String>) {
        match self {
            Expr::Number(_) => {}
            Expr::Flow(_, p) | Expr::Flows(_, _, p) => {
                out.insert(p.scenario.clone().unwrap_or_else(|| own.to_string()));
            }
            Expr::Binary(_, a, b) => {
                a.scenarios(own, out);
                b.scenarios(own, out);
            }
        }
    }

    fn eval(&self, own: &str, reports: &BTreeMap<String, ScenarioReport>) -> Result<f64, String> {
        let run = |p: &Place| {
            let name = p.scenario.as_deref().unwrap_or(own);
            let report = reports
                .get(name)
                .ok_or_else(|| format!("scenario `{name}` was not run"))?;
            report
                .run(&p.variant)
                .ok_or_else(|| format!("scenario `{name}` has no run `{}`", p.variant))
        };
        match self {
            Expr::Number(v) => Ok(*v),
            Expr::Flow(metric, p) => {
                let r = run(p)?;
                let flow = r
                    .flow(&p.flow)
                    .ok_or_else(|| format!("run `{}` has no flow `{}`", p.variant, p.flow))?;
                metric.of(flow)
            }
            Expr::Flows(agg, metric, p) => {
                let r = run(p)?;
                let values = r
                    .flows
                    .iter()
                    .filter(|f| f.name.starts_with(&p.flow))
                    .map(|f| metric.of(f))
                    .collect::<Result<Vec<f64>, String>>()?;
                if values.is_empty() {
                    return Err(format!(
                        "run `{}` has no flow named `{}...`",
                        p.variant, p.flow
                    ));
                }
                Ok(match agg {
                    Aggregate::Sum => values.iter().sum(),
                    Aggregate::Jain => jain_index(&values).unwrap_or(0.0),
                    Aggregate::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
                    Aggregate::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                })
            }
            Expr::Binary(op, a, b) => {
                let (x, y) = (a.eval(own, reports)?, b.eval(own, reports)?);
                match op {
                    '+' => Ok(x + y),
                    '-' => Ok(x - y),
                    '*' => Ok(x * y),
                    _ if y == 0.0 => Err("division by zero".to_string()),
                    _ => Ok(x / y),
                }
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Number(f64),
    Name(String),
    Text(String),
    Symbol(char),
}

fn tokens(text: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some(&(at, c)) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if "+-*/(),".contains(c) {
            out.push(Token::Symbol(c));
            chars.next();
        } else if c == '"' {
            chars.next();
            let mut s = String::new();
            loop {
                match chars.next() {
                    Some((_, '"')) => break,
                    Some((_, ch)) => s.push(ch),
                    None => return Err(format!("unterminated string at {at}")),
                }
            }
            out.push(Token::Text(s));
        } else if c.is_ascii_digit() || c == '.' {
            let mut s = String::new();
            while let Some(&(_, d)) = chars.peek() {
                if d.is_ascii_digit() || d == '.' || d == 'e' {
                    s.push(d);
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(Token::Number(
                s.parse().map_err(|_| format!("bad number `{s}` at {at}"))?,
            ));
        } else if c.is_ascii_alphabetic() {
            let mut s = String::new();
            while let Some(&(_, d)) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' {
                    s.push(d);
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(Token::Name(s));
        } else {
            return Err(format!("unexpected `{c}` at {at}"));
        }
    }
    Ok(out)
}

/// A recursive-descent parser over the tokens: sums of products of factors.
struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

fn parse_expr(text: &str) -> Result<Expr, String> {
    let mut p = Parser {
        tokens: tokens(text)?,
        at: 0,
    };
    let e = p.sum()?;
    match p.tokens.get(p.at) {
        None => Ok(e),
        Some(t) => Err(format!("unexpected {t:?} after a complete expression")),
    }
}

impl Parser {
    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn peek_symbol(&self, symbols: &str) -> Option<char> {
        match self.tokens.get(self.at) {
            Some(Token::Symbol(c)) if symbols.contains(*c) => Some(*c),
            _ => None,
        }
    }

    fn expect(&mut self, symbol: char) -> Result<(), String> {
        match self.next() {
            Some(Token::Symbol(c)) if c == symbol => Ok(()),
            other => Err(format!("expected `{symbol}`, found {other:?}")),
        }
    }

    fn sum(&mut self) -> Result<Expr, String> {
        let mut e = self.product()?;
        while let Some(op) = self.peek_symbol("+-") {
            self.at += 1;
            e = Expr::Binary(op, Box::new(e), Box::new(self.product()?));
        }
        Ok(e)
    }

    fn product(&mut self) -> Result<Expr, String> {
        let mut e = self.factor()?;
        while let Some(op) = self.peek_symbol("*/") {
            self.at += 1;
            e = Expr::Binary(op, Box::new(e), Box::new(self.factor()?));
        }
        Ok(e)
    }

    fn factor(&mut self) -> Result<Expr, String> {
        match self.next() {
            Some(Token::Number(v)) => Ok(Expr::Number(v)),
            Some(Token::Symbol('(')) => {
                let e = self.sum()?;
                self.expect(')')?;
                Ok(e)
            }
            Some(Token::Name(name)) => {
                self.expect('(')?;
                let e = if let Some(metric) = Metric::named(&name) {
                    Expr::Flow(metric, self.place()?)
                } else {
                    let agg = match name.as_str() {
                        "sum" => Aggregate::Sum,
                        "jain" => Aggregate::Jain,
                        "min" => Aggregate::Min,
                        "max" => Aggregate::Max,
                        _ => return Err(format!("unknown function `{name}`")),
                    };
                    let metric = match self.next() {
                        Some(Token::Name(m)) => Metric::named(&m)
                            .ok_or_else(|| format!("`{name}` of unknown metric `{m}`"))?,
                        other => return Err(format!("`{name}` needs a metric, found {other:?}")),
                    };
                    self.expect(',')?;
                    Expr::Flows(agg, metric, self.place()?)
                };
                self.expect(')')?;
                Ok(e)
            }
            other => Err(format!("expected a number, metric or `(`, found {other:?}")),
        }
    }

    /// `"variant", "flow"` or `"scenario", "variant", "flow"`.
    fn place(&mut self) -> Result<Place, String> {
        let mut texts = Vec::new();
        loop {
            match self.next() {
                Some(Token::Text(s)) => texts.push(s),
                other => return Err(format!("expected a quoted name, found {other:?}")),
            }
            if self.peek_symbol(",").is_some() && texts.len() < 3 {
                self.at += 1;
            } else {
                break;
            }
        }
        let mut texts = texts.into_iter();
        match (texts.next(), texts.next(), texts.next()) {
            (Some(variant), Some(flow), None) => Ok(Place {
                scenario: None,
                variant,
                flow,
            }),
            (Some(scenario), Some(variant), Some(flow)) => Ok(Place {
                scenario: Some(scenario),
                variant,
                flow,
            }),
            _ => Err(
                "a metric reads (\"variant\", \"flow\") or (\"scenario\", \"variant\", \"flow\")"
                    .into(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::report::{LatencyReport, RunReport};
    use justitia_core::flow::FlowClass;

    fn flow(name: &str, gbps: f64, p50: Option<f64>) -> FlowReport {
        FlowReport {
            name: name.into(),
            class: FlowClass::Bandwidth,
            app: "bandwidth".into(),
            messages: 1,
            msgs_per_sec: 2e6,
            gbps,
            latency: p50.map(|p| LatencyReport {
                samples: 10,
                p50_us: p,
                p99_us: 2.0 * p,
                p999_us: 3.0 * p,
                mean_us: p,
                max_us: 4.0 * p,
            }),
        }
    }

    fn reports() -> BTreeMap<String, ScenarioReport> {
        let run = |variant: &str, flows: Vec<FlowReport>| RunReport {
            variant: variant.into(),
            policy: "native".into(),
            flows,
            utilisation: 1.0,
            jain_bandwidth: None,
            policy_figures: BTreeMap::new(),
            fabric_figures: BTreeMap::new(),
            events: 0,
            series: Default::default(),
            wall_seconds: 0.0,
        };
        let report = |name: &str, runs| ScenarioReport {
            scenario: name.into(),
            description: String::new(),
            profile: "IB-56".into(),
            seed: 1,
            duration_ms: 1.0,
            warmup_ms: 0.0,
            runs,
        };
        let mut m = BTreeMap::new();
        m.insert(
            "s".to_string(),
            report(
                "s",
                vec![
                    run("alone", vec![flow("lat", 0.1, Some(1.0))]),
                    run(
                        "with bw",
                        vec![
                            flow("lat", 0.1, Some(3.0)),
                            flow("bw1", 30.0, None),
                            flow("bw2", 10.0, None),
                        ],
                    ),
                ],
            ),
        );
        m.insert(
            "other".to_string(),
            report("other", vec![run("x", vec![flow("lat", 0.1, Some(5.0))])]),
        );
        m
    }

    fn eval(text: &str) -> Result<f64, String> {
        parse_expr(text)?.eval("s", &reports())
    }

    #[test]
    fn expressions_read_the_reports() {
        assert_eq!(
            eval(r#"p50("with bw", "lat") / p50("alone", "lat")"#),
            Ok(3.0)
        );
        assert_eq!(eval(r#"p999("with bw", "lat")"#), Ok(9.0));
        assert_eq!(eval(r#"sum(gbps, "with bw", "bw")"#), Ok(40.0));
        assert_eq!(
            eval(r#"max(gbps, "with bw", "bw") - min(gbps, "with bw", "bw")"#),
            Ok(20.0)
        );
        // Jain's index of 30 and 10: 40^2 / (2 x 1000) = 0.8.
        assert!((eval(r#"jain(gbps, "with bw", "bw")"#).unwrap() - 0.8).abs() < 1e-12);
        assert_eq!(eval(r#"mmsgs("alone", "lat") * 2"#), Ok(4.0));
        assert_eq!(eval(r#"1 - 2 * 3"#), Ok(-5.0));
        assert_eq!(eval(r#"(1 - 2) * 3"#), Ok(-3.0));
        assert_eq!(
            eval(r#"p50("other", "x", "lat") / p50("alone", "lat")"#),
            Ok(5.0)
        );
    }

    #[test]
    fn missing_runs_flows_and_samples_are_named() {
        assert!(eval(r#"p50("nope", "lat")"#).unwrap_err().contains("nope"));
        assert!(eval(r#"p50("alone", "bw")"#).unwrap_err().contains("bw"));
        assert!(eval(r#"p50("with bw", "bw1")"#)
            .unwrap_err()
            .contains("no latency samples"));
        assert!(eval(r#"sum(gbps, "alone", "bw")"#)
            .unwrap_err()
            .contains("bw..."));
        assert!(parse_expr(r#"p51("alone", "lat")"#)
            .unwrap_err()
            .contains("p51"));
        assert!(parse_expr(r#"p50("alone")"#).is_err());
        assert!(parse_expr(r#"p50("alone", "lat") p50"#).is_err());
        assert!(parse_expr(r#"p50("alone, "lat")"#).is_err());
    }

    #[test]
    fn a_value_passes_within_its_tolerance_only() {
        let table = r#"
            [[check]]
            id = "X1.a"
            what = "a ratio"
            paper = 2.0
            unit = "x"
            source = "s"
            tolerance = 0.25
            basis = "b"
            tag = "validate"
            scenario = "s"
            model = 'p50("with bw", "lat") / p50("alone", "lat")'
            [[check]]
            id = "X1.b"
            what = "a range"
            paper = [2.5, 3.5]
            unit = "us"
            source = "s"
            tolerance_abs = 0.1
            basis = "b"
            tag = "fit"
            scenario = "s"
            model = 'p50("with bw", "lat")'
            [[check]]
            id = "X2"
            what = "a direction"
            below = 2.9
            unit = "x"
            source = "s"
            basis = "b"
            tag = "validate"
            scenario = "s"
            model = 'p50("with bw", "lat")'
            [[check]]
            id = "X3"
            what = "no scenario"
            paper = 1.0
            unit = "x"
            source = "s"
            tolerance = 0.1
            basis = "b"
            tag = "validate"
        "#;
        let checks = parse_table(table, "test").unwrap();
        let v = Validation::evaluate(checks, &reports()).unwrap();
        let by_id = |id: &str| v.outcomes.iter().find(|o| o.check.id == id).unwrap();
        // 3 against 2: +50%, outside 25%.
        assert_eq!(by_id("X1.a").status, Status::Fail);
        assert_eq!(by_id("X1.a").error, Some(0.5));
        assert_eq!(by_id("X1.a").check.target, "X1");
        // 3 inside [2.5, 3.5].
        assert_eq!(by_id("X1.b").status, Status::Pass);
        assert_eq!(by_id("X1.b").error, Some(0.0));
        assert_eq!(by_id("X2").status, Status::Fail);
        assert_eq!(by_id("X3").status, Status::NoScenario);
        let s = v.summary(Tag::Validate);
        assert_eq!(
            (s.checked, s.passed, s.directions, s.no_scenario),
            (2, 0, 1, 1)
        );
        assert_eq!(s.median_error, Some(0.5));
        // X1 has one validate check, outside tolerance; X2's only check fails too.
        assert_eq!(v.targets_met(Tag::Validate), (0, 2));
        assert_eq!(v.targets_met(Tag::Fit), (1, 1));
        let md = v.markdown("regenerate");
        assert!(
            md.contains("| X1.a | a ratio | 2 x | 3 | +50.0% | ±25% | validate | FAIL |"),
            "{md}"
        );
    }

    #[test]
    fn malformed_checks_are_refused_with_their_id() {
        let base = r#"
            [[check]]
            id = "X1"
            what = "w"
            paper = 2.0
            unit = "x"
            source = "s"
            tolerance = 0.25
            basis = "b"
            tag = "validate"
            scenario = "s"
            model = 'p50("alone", "lat")'
        "#;
        assert!(parse_table(base, "t").is_ok());
        for (bad, said) in [
            (base.replace("tolerance = 0.25", ""), "tolerance"),
            (base.replace("paper = 2.0", "above = 2.0"), "direction"),
            (base.replace("scenario = \"s\"", ""), "both"),
            (base.replace("p50(", "p5("), "p5"),
            (
                base.replace("tag = \"validate\"", "tag = \"guess\""),
                "guess",
            ),
            (format!("{base}{base}"), "twice"),
        ] {
            let err = parse_table(&bad, "t").unwrap_err().to_string();
            assert!(err.contains(said), "`{err}` should say `{said}`");
        }
    }

    #[test]
    fn numbers_are_written_short() {
        assert_eq!(short(1.85), "1.85");
        assert_eq!(short(1.3), "1.3");
        assert_eq!(short(94.8), "94.8");
        assert_eq!(short(105.0), "105");
        assert_eq!(short(0.2), "0.2");
        assert_eq!(short(2.0 / 3.0), "0.667");
    }
}
