//! The isolation verdict of a run: for each victim flow, its figure under competition
//! against the same figure when it ran alone, and whether the ratio is within the limits
//! given on the command line.
//!
//! A victim is judged by its p99 latency when it has latency samples and a p99 limit is
//! given, else by its message rate. Its baseline is the first run of the scenario in
//! which it ran alone; the runs judged are those in which it ran beside other flows under
//! a policy, or, when the scenario has no such run, every run in which it had company.

use justitia_core::flow::FlowClass;
use justitia_sim::{RunReport, ScenarioReport};

/// The limits of a verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limits {
    /// Largest p99 under competition over p99 alone.
    pub max_p99_ratio: Option<f64>,
    /// Smallest message rate under competition over the rate alone.
    pub min_rate_ratio: Option<f64>,
}

/// One victim in one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Judgement {
    /// The run judged.
    pub run: String,
    /// The victim.
    pub flow: String,
    /// `p99 (us)` or `rate (msgs/s)`.
    pub figure: &'static str,
    /// Its value alone.
    pub alone: f64,
    /// Its value in the run judged.
    pub measured: f64,
    /// The limit on measured / alone.
    pub limit: f64,
    /// Whether it is within the limit.
    pub passed: bool,
}

impl Judgement {
    /// measured / alone.
    pub fn ratio(&self) -> f64 {
        if self.alone > 0.0 {
            self.measured / self.alone
        } else {
            f64::INFINITY
        }
    }

    /// One line for the terminal.
    pub fn line(&self) -> String {
        let bound = if self.figure.starts_with("p99") {
            "at most"
        } else {
            "at least"
        };
        format!(
            "{} {} in `{}`: {} {:.2} vs {:.2} alone = x{:.2} ({bound} x{:.2})",
            if self.passed { "PASS" } else { "FAIL" },
            self.flow,
            self.run,
            self.figure,
            self.measured,
            self.alone,
            self.ratio(),
            self.limit
        )
    }
}

fn alone_run<'a>(report: &'a ScenarioReport, flow: &str) -> Option<&'a RunReport> {
    report
        .runs
        .iter()
        .find(|r| r.flows.len() == 1 && r.flows[0].name == flow)
}

/// Judges every victim (`victims`, or by default the latency- and throughput-class flows
/// that ran alone, or every flow that ran alone when there are none of those).
pub fn judge(
    report: &ScenarioReport,
    limits: Limits,
    victims: &[String],
) -> Result<Vec<Judgement>, String> {
    let with_baseline: Vec<&str> = report
        .runs
        .iter()
        .filter(|r| r.flows.len() == 1)
        .map(|r| r.flows[0].name.as_str())
        .collect();
    let chosen: Vec<String> = if victims.is_empty() {
        let protected: Vec<String> = report
            .runs
            .iter()
            .filter(|r| r.flows.len() == 1 && r.flows[0].class != FlowClass::Bandwidth)
            .map(|r| r.flows[0].name.clone())
            .collect();
        if protected.is_empty() {
            with_baseline.iter().map(|s| s.to_string()).collect()
        } else {
            protected
        }
    } else {
        for v in victims {
            if !with_baseline.contains(&v.as_str()) {
                return Err(format!(
                    "victim {v}: no run of the scenario runs it alone, so there is no baseline"
                ));
            }
        }
        victims.to_vec()
    };
    if chosen.is_empty() {
        return Err(
            "no flow runs alone in any run of the scenario, so no victim has a baseline".into(),
        );
    }
    let mut out = Vec::new();
    for victim in &chosen {
        let Some(alone) = alone_run(report, victim).and_then(|r| r.flow(victim)) else {
            continue;
        };
        let contended: Vec<&RunReport> = report
            .runs
            .iter()
            .filter(|r| r.flows.len() > 1 && r.flow(victim).is_some())
            .collect();
        let policed: Vec<&RunReport> = contended
            .iter()
            .copied()
            .filter(|r| r.policy != "native")
            .collect();
        let judged = if policed.is_empty() {
            contended
        } else {
            policed
        };
        for run in judged {
            let Some(flow) = run.flow(victim) else {
                continue;
            };
            let by_p99 = limits.max_p99_ratio.zip(alone.latency.zip(flow.latency));
            if let Some((limit, (a, m))) = by_p99 {
                let j = Judgement {
                    run: run.variant.clone(),
                    flow: victim.clone(),
                    figure: "p99 (us)",
                    alone: a.p99_us,
                    measured: m.p99_us,
                    limit,
                    passed: false,
                };
                out.push(Judgement {
                    passed: j.ratio() <= limit,
                    ..j
                });
            } else if let Some(limit) = limits.min_rate_ratio {
                let j = Judgement {
                    run: run.variant.clone(),
                    flow: victim.clone(),
                    figure: "rate (msgs/s)",
                    alone: alone.msgs_per_sec,
                    measured: flow.msgs_per_sec,
                    limit,
                    passed: false,
                };
                out.push(Judgement {
                    passed: j.ratio() >= limit,
                    ..j
                });
            }
        }
    }
    if out.is_empty() {
        return Err("no victim could be judged: give --max-p99-ratio for latency victims, --min-rate-ratio for the others".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use justitia_sim::{FlowReport, LatencyReport};

    fn flow(name: &str, class: FlowClass, p99: Option<f64>, rate: f64) -> FlowReport {
        FlowReport {
            name: name.into(),
            class,
            app: "x".into(),
            messages: 1,
            msgs_per_sec: rate,
            gbps: 0.0,
            latency: p99.map(|p99_us| LatencyReport {
                samples: 100,
                p50_us: p99_us / 2.0,
                p99_us,
                p999_us: p99_us,
                mean_us: p99_us / 2.0,
                max_us: p99_us,
            }),
        }
    }

    fn run(variant: &str, policy: &str, flows: Vec<FlowReport>) -> RunReport {
        RunReport {
            variant: variant.into(),
            policy: policy.into(),
            flows,
            utilisation: 0.0,
            jain_bandwidth: None,
            policy_figures: Default::default(),
            fabric_figures: Default::default(),
            events: 0,
            series: Default::default(),
            wall_seconds: 0.0,
        }
    }

    fn report() -> ScenarioReport {
        let lat = |p99| flow("lat", FlowClass::Latency, Some(p99), 1000.0);
        let bw = |rate| flow("bw", FlowClass::Bandwidth, None, rate);
        ScenarioReport {
            scenario: "s".into(),
            description: "d".into(),
            profile: "p".into(),
            seed: 1,
            duration_ms: 1.0,
            warmup_ms: 0.0,
            runs: vec![
                run("alone", "native", vec![lat(10.0)]),
                run("bw alone", "native", vec![bw(100.0)]),
                run("with bw", "native", vec![lat(50.0), bw(100.0)]),
                run("with bw + justitia", "justitia", vec![lat(11.0), bw(50.0)]),
            ],
        }
    }

    #[test]
    fn the_latency_victim_is_judged_under_the_policy_by_its_p99() {
        let limits = Limits {
            max_p99_ratio: Some(1.2),
            min_rate_ratio: Some(0.8),
        };
        let j = judge(&report(), limits, &[]).unwrap_or_else(|e| panic!("{e}"));
        // The bandwidth flow is not a victim by default; the native run is not judged.
        assert_eq!(j.len(), 1, "{j:?}");
        assert_eq!(j[0].run, "with bw + justitia");
        assert!((j[0].ratio() - 1.1).abs() < 1e-12);
        assert!(j[0].passed);
        let strict = Limits {
            max_p99_ratio: Some(1.05),
            ..limits
        };
        assert!(!judge(&report(), strict, &[]).unwrap_or_default()[0].passed);
    }

    #[test]
    fn a_named_victim_is_judged_by_rate_and_needs_a_baseline() {
        let limits = Limits {
            max_p99_ratio: None,
            min_rate_ratio: Some(0.8),
        };
        let j = judge(&report(), limits, &["bw".to_string()]).unwrap_or_default();
        assert_eq!(j.len(), 1);
        assert_eq!(j[0].figure, "rate (msgs/s)");
        assert!(!j[0].passed, "{j:?}");
        assert!(judge(&report(), limits, &["nobody".to_string()]).is_err());
    }
}
