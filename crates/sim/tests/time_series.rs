//! The time series a run records: one sample per interval, rates that add up to what the
//! run's report measured, and a control series only where a control loop steers flows.

mod common;

use justitia_sim::series::Mode;

#[test]
fn series_sample_every_interval_and_rates_add_up_to_the_report() {
    let mut experiment = common::experiment("lat-vs-1mb-bw-ib56");
    experiment.scenario.duration_ms = 10.0;
    experiment.scenario.warmup_ms = 1.0;
    experiment.scenario.series_ms = Some(0.25);
    let report = experiment.run().unwrap_or_else(|e| panic!("{e}"));
    for run in &report.runs {
        let s = &run.series;
        assert_eq!(s.interval_ms, 0.25);
        assert_eq!(s.t_ms.len(), 40, "{}: 10 ms / 0.25 ms", run.variant);
        assert!((s.t_ms[0] - 0.25).abs() < 1e-9 && (s.t_ms[39] - 10.0).abs() < 1e-9);
        for flow in &s.flows {
            assert_eq!(flow.gbps.len(), 40);
            // Over the measured window [1, 10) ms the samples' mean is the report's goodput
            // (samples are whole intervals, so the window is 36 of them).
            let first = s.index_at(1.25);
            let mean: f64 =
                flow.gbps[first..].iter().sum::<f64>() / (flow.gbps.len() - first) as f64;
            let reported = run.flow(&flow.name).map_or(f64::NAN, |f| f.gbps);
            assert!(
                (mean - reported).abs() <= 0.02 * reported.max(0.1),
                "{} {}: series mean {mean:.3} Gb/s, report {reported:.3}",
                run.variant,
                flow.name
            );
        }
    }
    let native = common::run(&report, "with bw");
    assert!(native.series.controls.is_empty(), "native has no loop");
    let justitia = common::run(&report, "with bw + justitia");
    // Only the host the bandwidth flow posts from steers something.
    assert_eq!(justitia.series.controls.len(), 1);
    let control = &justitia.series.controls[0];
    assert_eq!(control.host, "a");
    assert_eq!(control.safe_util_gbps.len(), 40);
    assert!(control.mode.iter().all(|m| *m == Mode::Normal));
    // SafeUtil starts at MaxRate (48 Gb/s on IB-56) before the first update at 0.5 ms.
    assert!(
        (control.safe_util_gbps[0] - 48.0).abs() < 0.5,
        "{control:?}"
    );
    // The probe has samples once the latency flow runs and the first probes completed (the
    // loop's window restarts at each decrease, so not at every sample).
    assert!(control.current99_us.iter().any(|c| c.is_some()));
    assert!(control.current99_us[0].is_none());
}

#[test]
fn the_interval_is_bounded() {
    let mut experiment = common::experiment("lat-vs-1mb-bw-ib56");
    experiment.scenario.duration_ms = 4.0;
    experiment.scenario.warmup_ms = 1.0;
    // 4 ms at 0.1 us would be 40 000 samples: widened to 20 000.
    experiment.scenario.series_ms = Some(0.0001);
    let report = experiment.run().unwrap_or_else(|e| panic!("{e}"));
    for run in &report.runs {
        assert_eq!(run.series.t_ms.len(), justitia_sim::series::MAX_SAMPLES);
    }
}

#[test]
fn a_paused_application_sends_nothing_and_then_resumes() {
    let mut experiment = common::experiment("lat-vs-1mb-bw-ib56");
    experiment.scenario.duration_ms = 12.0;
    experiment.scenario.warmup_ms = 1.0;
    experiment.scenario.series_ms = Some(0.5);
    let bw = experiment
        .scenario
        .flows
        .iter_mut()
        .find(|f| f.name == "bw")
        .unwrap_or_else(|| panic!("no bw flow"));
    bw.pauses_ms = vec![[4.0, 8.0]];
    let report = experiment.run().unwrap_or_else(|e| panic!("{e}"));
    let series = &common::run(&report, "bw alone").series;
    let gbps = &series.flow("bw").unwrap_or_else(|| panic!("no bw")).gbps;
    // 8 messages of 1 MB were in flight at the pause (175 us each at 48 Gb/s): drained by
    // 5.5 ms; nothing after until the resume.
    let (from, to) = (series.index_at(6.0), series.index_at(8.0));
    assert!(gbps[from..to].iter().all(|&g| g == 0.0), "{gbps:?}");
    let after = series.index_at(9.0);
    assert!(gbps[after..].iter().all(|&g| g > 40.0), "{gbps:?}");
    assert!(gbps[series.index_at(2.0)..series.index_at(4.0)]
        .iter()
        .all(|&g| g > 40.0));
}
