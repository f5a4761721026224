//! The control-verb budget: under `justitia` and `adaptive` a storm's verbs complete at its
//! tenant's share of the host's `control_verbs_per_sec`, plus its burst; without a budget,
//! and under `native` and `preempt`, at the control path's rate. Counted by hand from the
//! profile (`RoCE-100-husky`: `rnic.reg_mr_us = 50`) and the scenario below.

mod common;

use common::{flow, run, scenarios_dir};
use justitia_sim::Experiment;

/// 20 ms measured from the start. On host `a`: a latency flow (tenant 1, weight 1) and a
/// storm registering 4 KB regions back to back (tenant 2, weight 3). The host's budget,
/// 4000 verbs/s with a burst of 4, gives the storm 4000 x 3 / 4 = 3000 verbs/s.
const SCENARIO: &str = r#"
description = "a control-verb storm beside a latency flow, with and without a budget"
profile = "RoCE-100-husky"
duration_ms = 20
warmup_ms = 0
seed = 1

[justitia]
control_verbs_per_sec = 4000
control_verb_burst = 4

[[flows]]
name = "lat"
tenant = 1
[flows.latency]
size = 16

[[flows]]
name = "storm"
tenant = 2
weight = 3
[flows.control]
verb = "reg-mr"

[[variants]]
name = "native"

[[variants]]
name = "preempt"
policy = "preempt"

[[variants]]
name = "justitia"
policy = "justitia"

[[variants]]
name = "adaptive"
policy = "adaptive"

[[variants]]
name = "justitia, no budget"
policy = "justitia"
[variants.justitia]
target99_x_idle = 2.0

[[variants]]
name = "adaptive, budget 0"
policy = "adaptive"
[variants.justitia]
control_verbs_per_sec = 0
"#;

/// The run's length, s.
const DURATION: f64 = 0.020;
/// The control path's time per registration, s.
const REG_MR: f64 = 50e-6;

/// The storm's completed verbs in `variant`.
fn verbs(report: &justitia_sim::ScenarioReport, variant: &str) -> f64 {
    flow(run(report, variant), "storm").messages as f64
}

#[test]
fn a_budget_holds_a_storm_to_its_share_plus_its_burst() {
    let exp = Experiment::from_toml("control-verb-budget", SCENARIO, Some(&scenarios_dir()))
        .unwrap_or_else(|e| panic!("{e}"));
    let report = exp.run().unwrap_or_else(|e| panic!("{e}"));
    // Paced: 3000 verbs/s x 20 ms + 4 = 64. By hand: the burst's 4 go back to back
    // (done at 50, 100, 150, 200 us), then verb k (from 4) goes at (k - 3) / 3000 s and is
    // done 50 us later, k = 62 the last by 20 ms: 63 verbs, within one of 64.
    let paced = 3000.0 * DURATION + 4.0;
    for variant in ["justitia", "adaptive"] {
        let got = verbs(&report, variant);
        assert!(
            (got - paced).abs() <= 1.0,
            "{variant}: {got} verbs against {paced}"
        );
        let figures = &run(&report, variant).policy_figures;
        // Admitted: the 63 done and the one waiting at the end.
        assert_eq!(figures.get("a.control_verbs_admitted"), Some(&64.0));
        assert_eq!(figures.get("a.control_verbs_delayed"), Some(&60.0));
        // Host b issues none and reports none.
        assert_eq!(figures.get("b.control_verbs_admitted"), None);
    }
    // Not paced: one verb every 50 us, 20 ms / 50 us = 400.
    let path = DURATION / REG_MR;
    for variant in [
        "native",
        "preempt",
        "justitia, no budget",
        "adaptive, budget 0",
    ] {
        let got = verbs(&report, variant);
        assert!(
            (got - path).abs() <= 1.0,
            "{variant}: {got} verbs against {path}"
        );
        let figures = &run(&report, variant).policy_figures;
        assert_eq!(figures.get("a.control_verbs_admitted"), None, "{variant}");
    }
    // A paced verb's latency sample counts its wait: the median is about the interval,
    // 333 us, far above the path's 50 us.
    let p50 = run(&report, "justitia")
        .flow("storm")
        .and_then(|f| f.latency)
        .map(|l| l.p50_us)
        .unwrap_or_default();
    assert!(p50 > 250.0, "paced p50 {p50} us");
}
