//! The isolation verdict of a run: for each victim flow, its figures under competition
//! against the same figures when it ran alone, and whether each ratio is within the limits
//! given on the command line.
//!
//! Every victim is judged on every limit that applies to it: `--min-rate-ratio` on every
//! flow's rate (a bandwidth flow's goodput in Gb/s, any other flow's messages per second)
//! and `--max-p99-ratio` on the p99 of every flow that takes latency samples, so a latency
//! flow is judged by p99 and by rate. A victim's baseline is the first run of the
//! scenario in which it ran alone; the runs judged are those in which it ran beside other
//! flows under a policy, or, when the scenario has no such run, every run in which it had
//! company. With `--repeat`, each figure is the median over the repeats (see
//! [`Spread::of`]) and the verdict is taken on the medians.
//!
//! A p99 taken from too few samples is the largest sample (see
//! [`Percentile::min_samples`]); such a figure is shown, marked, and not judged.

use anyhow::{bail, Result};
use justitia_sim::{FlowReport, ScenarioReport};

use super::samples::Percentile;
use super::spread::{fewest_samples, flow_in_each, Spread};

/// The limits of a verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limits {
    /// Largest p99 under competition over p99 alone.
    pub max_p99_ratio: Option<f64>,
    /// Smallest rate under competition over the rate alone.
    pub min_rate_ratio: Option<f64>,
}

/// The figure a judgement compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Criterion {
    /// The p99 latency, limited by `--max-p99-ratio`.
    P99,
    /// Messages per second, limited by `--min-rate-ratio`: the rate of latency and
    /// throughput flows.
    MessageRate,
    /// Goodput, limited by `--min-rate-ratio`: the rate of a bandwidth flow, which is what
    /// it is there for.
    Goodput,
}

impl Criterion {
    /// The figure's name and unit, as in the report's tables.
    pub fn label(self) -> &'static str {
        match self {
            Criterion::P99 => "p99 (us)",
            Criterion::MessageRate => "rate (msgs/s)",
            Criterion::Goodput => "goodput (Gb/s)",
        }
    }

    /// The flag that sets its limit.
    fn flag(self) -> &'static str {
        match self {
            Criterion::P99 => "--max-p99-ratio",
            Criterion::MessageRate | Criterion::Goodput => "--min-rate-ratio",
        }
    }

    fn value(self, flow: &FlowReport) -> Option<f64> {
        match self {
            Criterion::P99 => flow.latency.map(|l| l.p99_us),
            Criterion::MessageRate => Some(flow.msgs_per_sec),
            Criterion::Goodput => Some(flow.gbps),
        }
    }

    /// Whether the limit is a ceiling (latency grows under competition) rather than a
    /// floor (rates shrink).
    fn is_ceiling(self) -> bool {
        self == Criterion::P99
    }
}

/// A victim's figure in one run, over the repeats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measure {
    /// Median and range over the repeats.
    pub spread: Spread,
    /// For a percentile, the fewest latency samples any repeat took it from.
    pub samples: Option<u64>,
}

impl Measure {
    fn show(&self, repeats: usize) -> String {
        let figure = self.spread.show(repeats);
        match self.samples {
            Some(n) if repeats > 1 => format!("{figure} [n>={n}]"),
            Some(n) => format!("{figure} [n={n}]"),
            None => figure,
        }
    }
}

/// What became of one judgement.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Within its limit.
    Passed,
    /// Beyond its limit.
    Failed,
    /// Not judged, for the reason given.
    NotJudged(String),
}

/// One figure of one victim in one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Judgement {
    /// The run judged.
    pub run: String,
    /// The victim.
    pub flow: String,
    /// The figure compared.
    pub criterion: Criterion,
    /// The figure alone; `None` when the victim has no such figure alone.
    pub alone: Option<Measure>,
    /// The figure in the run judged; `None` when it has none there.
    pub measured: Option<Measure>,
    /// The limit on measured / alone.
    pub limit: f64,
    /// Passed, failed or not judged.
    pub outcome: Outcome,
}

impl Judgement {
    /// The median measured over the median alone; `None` without both, or when the
    /// figure alone is 0.
    pub fn ratio(&self) -> Option<f64> {
        let (alone, measured) = (self.alone?, self.measured?);
        (alone.spread.median > 0.0).then(|| measured.spread.median / alone.spread.median)
    }

    /// One line for the terminal: outcome, figures (with their spread over `repeats` and
    /// their samples), ratio and limit, or why it was not judged.
    pub fn line(&self, repeats: usize) -> String {
        let show = |m: &Option<Measure>| m.map_or_else(|| "-".to_string(), |m| m.show(repeats));
        let head = format!(
            "{} in `{}`: {} {} vs {} alone",
            self.flow,
            self.run,
            self.criterion.label(),
            show(&self.measured),
            show(&self.alone)
        );
        let bound = if self.criterion.is_ceiling() {
            "at most"
        } else {
            "at least"
        };
        let ratio = self.ratio().map_or_else(|| "-".to_string(), ratio_text);
        match &self.outcome {
            Outcome::Passed | Outcome::Failed => format!(
                "{} {head} = x{ratio} ({bound} x{:.2})",
                if self.outcome == Outcome::Passed {
                    "PASS"
                } else {
                    "FAIL"
                },
                self.limit
            ),
            Outcome::NotJudged(why) => format!("NOT JUDGED {head}: {why}"),
        }
    }
}

/// A ratio with two decimals, or in scientific notation below 0.1, so that a collapse
/// (0.02 Gb/s of 83.89) does not print as `x0.00`.
fn ratio_text(ratio: f64) -> String {
    if ratio >= 0.1 {
        format!("{ratio:.2}")
    } else {
        format!("{ratio:.2e}")
    }
}

/// Every judgement of a run's verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// One per victim, run judged and criterion.
    pub judgements: Vec<Judgement>,
    /// How many repeats the figures are the medians of.
    pub repeats: usize,
    limits: Limits,
}

impl Verdict {
    /// The judgements' lines.
    pub fn lines(&self) -> Vec<String> {
        self.judgements
            .iter()
            .map(|j| j.line(self.repeats))
            .collect()
    }

    fn count(&self, outcome: impl Fn(&Outcome) -> bool) -> usize {
        self.judgements
            .iter()
            .filter(|j| outcome(&j.outcome))
            .count()
    }

    /// Why the verdict fails: a judgement failed, or a limit given judged nothing at all
    /// (every figure it applies to was not judged), which would otherwise pass a run that
    /// was never checked. `None` when it passes.
    pub fn failure(&self) -> Option<String> {
        let judged = self.count(|o| !matches!(o, Outcome::NotJudged(_)));
        let failed = self.count(|o| *o == Outcome::Failed);
        let mut why = Vec::new();
        if failed > 0 {
            why.push(format!("{failed} of {judged} judgements failed"));
        }
        let given = [
            (Criterion::P99, self.limits.max_p99_ratio),
            (Criterion::MessageRate, self.limits.min_rate_ratio),
        ];
        for (criterion, limit) in given {
            if limit.is_none() {
                continue;
            }
            let flag = criterion.flag();
            let applies: Vec<&Judgement> = self
                .judgements
                .iter()
                .filter(|j| j.criterion.flag() == flag)
                .collect();
            if applies.is_empty() {
                why.push(format!("{flag} applies to no victim"));
            } else if applies
                .iter()
                .all(|j| matches!(j.outcome, Outcome::NotJudged(_)))
            {
                let which = match applies.len() {
                    1 => "the one figure".to_string(),
                    n => format!("all {n} figures"),
                };
                why.push(format!(
                    "{flag} judged nothing: {which} it applies to could not be judged (see why above)"
                ));
            }
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// The closing line of a verdict that passed.
    pub fn summary(&self) -> String {
        let not_judged = self.count(|o| matches!(o, Outcome::NotJudged(_)));
        if not_judged == 0 {
            "every victim passed".to_string()
        } else {
            format!(
                "every judged figure passed ({} judged); {not_judged} not judged (see why above)",
                self.judgements.len() - not_judged
            )
        }
    }
}

/// The criteria `limits` set for `victim`: p99 when it takes latency samples, its rate
/// (goodput for a bandwidth flow) always.
fn criteria(victim: &FlowReport, limits: Limits) -> Vec<(Criterion, f64)> {
    let mut out = Vec::new();
    if let Some(limit) = limits.max_p99_ratio {
        if victim.app == "latency" || victim.latency.is_some() {
            out.push((Criterion::P99, limit));
        }
    }
    if let Some(limit) = limits.min_rate_ratio {
        let rate = if victim.app == "bandwidth" {
            Criterion::Goodput
        } else {
            Criterion::MessageRate
        };
        out.push((rate, limit));
    }
    out
}

fn measure(flows: &[&FlowReport], criterion: Criterion) -> Option<Measure> {
    let values: Vec<f64> = flows.iter().filter_map(|f| criterion.value(f)).collect();
    Some(Measure {
        spread: Spread::of(&values)?,
        samples: (criterion == Criterion::P99).then(|| fewest_samples(flows)),
    })
}

/// Why a p99 from `samples` samples in `place` cannot be judged, if it cannot.
fn too_few(samples: Option<u64>, place: &str) -> Option<String> {
    let n = samples?;
    let p = Percentile::P99;
    if n == 0 {
        return Some(format!("a repeat took no latency samples {place}"));
    }
    (!p.distinct_from_max(n)).then(|| {
        format!(
            "{n} samples {place} make {} the largest sample (it needs at least {}; a longer --duration-ms takes more)",
            p.name(),
            p.min_samples()
        )
    })
}

fn judgement(
    repeats: &[ScenarioReport],
    alone_run: &str,
    run: &str,
    flow: &str,
    (criterion, limit): (Criterion, f64),
) -> Judgement {
    let alone = measure(&flow_in_each(repeats, alone_run, flow), criterion);
    let measured = measure(&flow_in_each(repeats, run, flow), criterion);
    let label = criterion.label();
    let outcome = match (alone, measured) {
        (None, _) => Outcome::NotJudged(format!("no {label} alone")),
        (_, None) => Outcome::NotJudged(format!("no {label} in `{run}`")),
        (Some(a), Some(m)) => {
            let short: Vec<String> = [
                too_few(a.samples, "alone"),
                too_few(m.samples, &format!("in `{run}`")),
            ]
            .into_iter()
            .flatten()
            .collect();
            let ratio = m.spread.median / a.spread.median;
            if !short.is_empty() {
                Outcome::NotJudged(short.join("; "))
            } else if a.spread.median <= 0.0 {
                Outcome::NotJudged(format!(
                    "its {label} alone is 0, so there is nothing to compare with"
                ))
            } else if (criterion.is_ceiling() && ratio <= limit)
                || (!criterion.is_ceiling() && ratio >= limit)
            {
                Outcome::Passed
            } else {
                Outcome::Failed
            }
        }
    };
    Judgement {
        run: run.to_string(),
        flow: flow.to_string(),
        criterion,
        alone,
        measured,
        limit,
        outcome,
    }
}

/// Judges every victim (`victims`, or by default every flow that ran alone) on every
/// criterion `limits` sets for it, on the medians of `repeats` (the reports of the
/// scenario's repeats, in order; their runs and flows are the same).
pub fn judge(repeats: &[ScenarioReport], limits: Limits, victims: &[String]) -> Result<Verdict> {
    let Some(first) = repeats.first() else {
        bail!("no repeat of the scenario was measured, so there is nothing to judge");
    };
    let alone: Vec<(&str, &FlowReport)> = first
        .runs
        .iter()
        .filter_map(|r| match r.flows.as_slice() {
            [only] => Some((r.variant.as_str(), only)),
            _ => None,
        })
        .collect();
    let mut chosen: Vec<(&str, &FlowReport)> = Vec::new();
    for (run, flow) in &alone {
        // The first run a flow is alone in is its baseline.
        if !chosen.iter().any(|(_, f)| f.name == flow.name) {
            chosen.push((run, flow));
        }
    }
    if !victims.is_empty() {
        for v in victims {
            if !chosen.iter().any(|(_, f)| &f.name == v) {
                bail!("victim {v}: no run of the scenario runs it alone, so there is no baseline");
            }
        }
        chosen.retain(|(_, f)| victims.contains(&f.name));
    }
    if chosen.is_empty() {
        bail!("no flow runs alone in any run of the scenario, so no victim has a baseline");
    }
    let mut judgements = Vec::new();
    for (alone_run, victim) in chosen {
        let contended: Vec<&str> = first
            .runs
            .iter()
            .filter(|r| r.flows.len() > 1 && r.flow(&victim.name).is_some())
            .map(|r| r.variant.as_str())
            .collect();
        let policed: Vec<&str> = first
            .runs
            .iter()
            .filter(|r| contended.contains(&r.variant.as_str()) && r.policy != "native")
            .map(|r| r.variant.as_str())
            .collect();
        let judged = if policed.is_empty() {
            contended
        } else {
            policed
        };
        for run in judged {
            for criterion in criteria(victim, limits) {
                judgements.push(judgement(repeats, alone_run, run, &victim.name, criterion));
            }
        }
    }
    if judgements.is_empty() {
        bail!("no victim could be judged: no victim runs beside another flow, or no limit applies (--max-p99-ratio judges flows with latency samples, --min-rate-ratio every flow)");
    }
    Ok(Verdict {
        judgements,
        repeats: repeats.len(),
        limits,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::fixtures::{flow, run, scenario};
    use super::*;
    use justitia_core::flow::FlowClass;

    /// A latency flow (p99 10 us alone, 50 natively beside the bandwidth flow, 11 under
    /// Justitia; 1000 msgs/s throughout) and a bandwidth flow (100 msgs/s alone, 50 under
    /// Justitia).
    fn report() -> ScenarioReport {
        let lat = |p99| flow("lat", FlowClass::Latency, Some(p99), 1000.0);
        let bw = |rate: f64| FlowReport {
            gbps: rate / 10.0,
            ..flow("bw", FlowClass::Bandwidth, None, rate)
        };
        scenario(vec![
            run("alone", "native", vec![lat(10.0)]),
            run("bw alone", "native", vec![bw(100.0)]),
            run("with bw", "native", vec![lat(50.0), bw(100.0)]),
            run("with bw + justitia", "justitia", vec![lat(11.0), bw(50.0)]),
        ])
    }

    fn both(p99: f64, rate: f64) -> Limits {
        Limits {
            max_p99_ratio: Some(p99),
            min_rate_ratio: Some(rate),
        }
    }

    fn outcomes(v: &Verdict) -> Vec<(&str, &str, &Outcome)> {
        v.judgements
            .iter()
            .map(|j| (j.flow.as_str(), j.criterion.label(), &j.outcome))
            .collect()
    }

    /// The run the review found passing: the latency flow held its p99 under the policy,
    /// the 1 MB bandwidth flow fell from 83.89 Gb/s alone to 0.02 Gb/s beside it.
    fn collapsed_bandwidth() -> ScenarioReport {
        let mut r = report();
        // 1 MB messages: 83.89 Gb/s is 83.89e9 / 8 / 1_048_576 = 10_000.5 msgs/s, and
        // 0.02 Gb/s is 2.38 msgs/s.
        let bw = |gbps: f64, rate: f64| FlowReport {
            gbps,
            ..flow("bw", FlowClass::Bandwidth, None, rate)
        };
        r.runs[1].flows = vec![bw(83.89, 10_000.5)];
        r.runs[3].flows[1] = bw(0.02, 2.38);
        r
    }

    #[test]
    fn a_bandwidth_flow_that_collapsed_fails_the_rate_limit() {
        let v = judge(&[collapsed_bandwidth()], both(1.2, 0.8), &[]).unwrap();
        let bw: Vec<&Judgement> = v.judgements.iter().filter(|j| j.flow == "bw").collect();
        assert_eq!(bw.len(), 1, "the bandwidth flow is judged: {v:?}");
        assert_eq!(bw[0].run, "with bw + justitia");
        assert_eq!(bw[0].criterion, Criterion::Goodput);
        // 0.02 / 83.89 = 0.000238, far below 0.8.
        assert!(
            (bw[0].ratio().unwrap() - 0.000_238_4).abs() < 1e-7,
            "{:?}",
            bw[0]
        );
        assert_eq!(bw[0].outcome, Outcome::Failed);
        assert_eq!(
            bw[0].line(1),
            "FAIL bw in `with bw + justitia`: goodput (Gb/s) 0.02 vs 83.89 alone = x2.38e-4 (at least x0.80)"
        );
        assert_eq!(
            v.failure().as_deref(),
            Some("1 of 3 judgements failed"),
            "{:?}",
            v.lines()
        );
    }

    #[test]
    fn a_latency_victim_is_judged_by_p99_and_by_rate_under_the_policy() {
        let v = judge(&[report()], both(1.2, 0.8), &["lat".to_string()]).unwrap();
        // The native run is not judged when a policed one exists.
        assert!(v.judgements.iter().all(|j| j.run == "with bw + justitia"));
        assert_eq!(
            outcomes(&v),
            [
                ("lat", "p99 (us)", &Outcome::Passed),
                ("lat", "rate (msgs/s)", &Outcome::Passed),
            ]
        );
        // p99 11 over 10: x1.10; rate 1000 over 1000: x1.00.
        assert!((v.judgements[0].ratio().unwrap() - 1.1).abs() < 1e-12);
        assert_eq!(v.judgements[1].ratio(), Some(1.0));
        assert_eq!(
            v.lines(),
            [
                "PASS lat in `with bw + justitia`: p99 (us) 11.00 [n=1000] vs 10.00 [n=1000] alone = x1.10 (at most x1.20)",
                "PASS lat in `with bw + justitia`: rate (msgs/s) 1000.00 vs 1000.00 alone = x1.00 (at least x0.80)",
            ]
        );
        assert_eq!(v.failure(), None);
        assert_eq!(v.summary(), "every victim passed");
        // A strict p99 limit fails it: x1.10 is above x1.05.
        let strict = judge(&[report()], both(1.05, 0.8), &[]).unwrap();
        assert_eq!(strict.judgements[0].outcome, Outcome::Failed);
        // And by default the bandwidth flow is a victim too: 50 msgs/s of 100 is x0.50,
        // judged as goodput, 5 Gb/s of 10.
        let bw = &strict.judgements[2];
        assert_eq!((bw.flow.as_str(), bw.criterion), ("bw", Criterion::Goodput));
        assert_eq!(bw.ratio(), Some(0.5));
        assert_eq!(bw.outcome, Outcome::Failed);
        assert_eq!(
            strict.failure().as_deref(),
            Some("2 of 3 judgements failed")
        );
    }

    #[test]
    fn only_the_limits_given_are_judged_and_a_victim_needs_a_baseline() {
        let rate_only = Limits {
            max_p99_ratio: None,
            min_rate_ratio: Some(0.8),
        };
        let v = judge(&[report()], rate_only, &[]).unwrap();
        assert_eq!(
            outcomes(&v),
            [
                ("lat", "rate (msgs/s)", &Outcome::Passed),
                ("bw", "goodput (Gb/s)", &Outcome::Failed),
            ]
        );
        let err = judge(&[report()], rate_only, &["nobody".to_string()]).unwrap_err();
        assert!(err.to_string().contains("victim nobody: no run"), "{err}");
        // A p99 limit alone on a bandwidth victim applies to nothing: the verdict fails.
        let p99_only = Limits {
            max_p99_ratio: Some(1.2),
            min_rate_ratio: None,
        };
        let err = judge(&[report()], p99_only, &["bw".to_string()]).unwrap_err();
        assert!(
            err.to_string().contains("no victim could be judged"),
            "{err}"
        );
        // Both limits on the bandwidth flow alone: the p99 limit applies to nothing, which
        // fails the verdict too.
        let v = judge(&[report()], both(1.2, 0.8), &["bw".to_string()]).unwrap();
        assert_eq!(
            v.failure().as_deref(),
            Some("1 of 1 judgements failed; --max-p99-ratio applies to no victim")
        );
    }

    /// `report()` with the latency flow's samples set: `alone` alone, `with` under the
    /// policy.
    fn with_samples(alone: u64, with: u64) -> ScenarioReport {
        let mut r = report();
        for (run, n) in [(0, alone), (3, with)] {
            if let Some(l) = r.runs[run].flows[0].latency.as_mut() {
                l.samples = n;
            }
        }
        r
    }

    #[test]
    fn a_p99_of_too_few_samples_is_shown_but_not_judged() {
        // 72 samples under the policy: their p99 is the 72nd of 72, the largest.
        let strict = both(1.05, 0.8);
        let v = judge(&[with_samples(1500, 72)], strict, &["lat".to_string()]).unwrap();
        assert_eq!(
            v.lines()[0],
            "NOT JUDGED lat in `with bw + justitia`: p99 (us) 11.00 [n=72] vs 10.00 [n=1500] alone: 72 samples in `with bw + justitia` make p99 the largest sample (it needs at least 100; a longer --duration-ms takes more)"
        );
        assert_eq!(v.judgements[1].outcome, Outcome::Passed);
        // Every p99 was left unjudged, so the p99 limit judged nothing: the verdict fails.
        assert_eq!(
            v.failure().as_deref(),
            Some("--max-p99-ratio judged nothing: the one figure it applies to could not be judged (see why above)")
        );
        // 100 samples make p99 the 99th of 100, a tail: the same strict limit now judges
        // x1.10 against x1.05, and fails.
        let v = judge(&[with_samples(100, 100)], strict, &["lat".to_string()]).unwrap();
        assert_eq!(v.judgements[0].outcome, Outcome::Failed);
        assert_eq!(v.failure().as_deref(), Some("1 of 2 judgements failed"));
        // Too few alone: 99 samples.
        let v = judge(&[with_samples(99, 5000)], both(1.2, 0.8), &[]).unwrap();
        assert!(
            matches!(&v.judgements[0].outcome, Outcome::NotJudged(why) if why.starts_with("99 samples alone make p99")),
            "{:?}",
            v.judgements[0]
        );
        // The bandwidth flow's x0.50 fails, and the p99 limit judged nothing.
        assert_eq!(
            v.failure().as_deref(),
            Some("1 of 2 judgements failed; --max-p99-ratio judged nothing: the one figure it applies to could not be judged (see why above)")
        );
        // A second policed run with 72 samples: its p99 is not judged, the first run's is
        // (x1.10, within x1.2), and the verdict passes saying what it left out.
        let mut r = with_samples(1500, 1500);
        let mut short = flow("lat", FlowClass::Latency, Some(12.0), 1000.0);
        if let Some(l) = short.latency.as_mut() {
            l.samples = 72;
        }
        let bw = r.runs[3].flows[1].clone();
        r.runs
            .push(run("with bw + preempt", "preempt", vec![short, bw]));
        let v = judge(&[r], both(1.2, 0.8), &["lat".to_string()]).unwrap();
        assert_eq!(v.failure(), None, "{:?}", v.lines());
        assert_eq!(
            v.summary(),
            "every judged figure passed (3 judged); 1 not judged (see why above)"
        );
    }

    #[test]
    fn over_repeats_the_verdict_is_taken_on_the_medians() {
        // The bandwidth flow's goodput alone in three repeats: 80, 90, 84 Gb/s (median 84);
        // beside the latency flow under the policy: 60, 70, 80 (median 70). 70 / 84 =
        // 0.833 passes x0.8, although the first repeat alone (60 / 80 = 0.75) would not.
        let repeats: Vec<ScenarioReport> = [(80.0, 60.0), (90.0, 70.0), (84.0, 80.0)]
            .into_iter()
            .map(|(alone, with)| {
                let mut r = report();
                r.runs[1].flows[0].gbps = alone;
                r.runs[3].flows[1].gbps = with;
                r
            })
            .collect();
        let bw = ["bw".to_string()];
        let limits = both(1.2, 0.8);
        let first = judge(&repeats[..1], limits, &bw).unwrap();
        assert_eq!(first.judgements[0].ratio(), Some(0.75));
        assert_eq!(first.judgements[0].outcome, Outcome::Failed);
        let v = judge(&repeats, limits, &bw).unwrap();
        let j = &v.judgements[0];
        assert!((j.ratio().unwrap() - 70.0 / 84.0).abs() < 1e-12);
        assert_eq!(j.outcome, Outcome::Passed);
        assert_eq!(
            v.lines(),
            ["PASS bw in `with bw + justitia`: goodput (Gb/s) 70.00 (60.00..80.00) vs 84.00 (80.00..90.00) alone = x0.83 (at least x0.80)"]
        );
    }
}
