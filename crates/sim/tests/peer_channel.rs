//! The remote-READ rule of §4.4 with the daemons' own protocol (`justitia-peer`) in the
//! loop: the requester's demand and the responder's guarantees are datagrams signed,
//! checked and ordered by the code `justitiad` runs, delayed by the link; a delayed
//! guarantee arrives when the delays say, and guarantees that stop lapse within the
//! channel's silence (fail-open).

#![allow(clippy::expect_used)]

mod common;

use common::{report, run};

/// The channel's silence and refresh by default (`justitia_peer::channel`), and the
/// paper's RefPeriod, ms.
const SILENCE_MS: f64 = 20.0;
const REFRESH_MS: f64 = 5.0;
const REF_PERIOD_MS: f64 = 0.5;

fn figure(r: &justitia_sim::RunReport, key: &str) -> Option<f64> {
    r.policy_figures.get(key).copied()
}

/// Fig. 24's setting: b READs from a. Both daemons send datagrams; b (the requester)
/// takes a's guarantee within two message delays (10 us each) and a RefPeriod of its
/// READ flow starting at 0; nothing is refused.
#[test]
fn the_requester_takes_the_responders_guarantee_over_the_channel() {
    let r = report("remote-read-peer-channel-ib56");
    let j = run(&r, "justitia");
    for host in ["a", "b"] {
        let sent = figure(j, &format!("{host}.peer_datagrams_sent")).unwrap_or(0.0);
        assert!(sent >= 2.0, "{host} sent {sent} datagrams");
        assert_eq!(
            figure(j, &format!("{host}.peer_datagrams_refused")),
            Some(0.0)
        );
    }
    let first = figure(j, "b.peer_first_guarantee_ms").expect("b got a guarantee");
    assert!(
        first <= 2.0 * 0.010 + REF_PERIOD_MS + 0.05,
        "first guarantee at {first} ms"
    );
    assert_eq!(
        figure(j, "b.peer_guarantee_lapsed_ms"),
        None,
        "a never went silent"
    );
    // b only reads from a: a's grants carry no incast share for it.
    assert_eq!(figure(j, "b.peer_first_incast_share_ms"), None);
}

/// With 2 ms each way the first guarantee reaches b no earlier than two round trips (8 ms:
/// the session's handshake, then the demand out and the grant back) and no later than two
/// and a half round trips and a RefPeriod: here both daemons have flows against each other
/// and initiate at once; the tie-break lets one go on as initiator, so the other's first
/// demand leaves after the initiator's confirmation reaches it (6 ms), and a announces at
/// its next update.
#[test]
fn a_delayed_guarantee_arrives_two_round_trips_after_the_read_starts() {
    let r = report("remote-read-peer-channel-ib56");
    let d = run(&r, "justitia, 2 ms each way");
    let first = figure(d, "b.peer_first_guarantee_ms").expect("b got a guarantee");
    assert!(
        (8.0..=10.0 + REF_PERIOD_MS + 0.05).contains(&first),
        "first guarantee at {first} ms, expected 8 to 10.5"
    );
}

/// Every daemon silent from 10 ms: a's last grant left within a refresh before that, so b
/// lets it lapse (fail-open) between 10 + silence - refresh and 10 + silence (plus the
/// message delay and a RefPeriod of slack for timer alignment): 25 to 30.5 ms.
#[test]
fn guarantees_that_stop_lapse_within_the_silence_bound() {
    let r = report("remote-read-peer-channel-ib56");
    let s = run(&r, "justitia, daemons silent from 10 ms");
    let lapsed = figure(s, "b.peer_guarantee_lapsed_ms").expect("the guarantee lapsed");
    let (low, high) = (
        10.0 + SILENCE_MS - REFRESH_MS,
        10.0 + SILENCE_MS + REF_PERIOD_MS,
    );
    assert!(
        (low..=high).contains(&lapsed),
        "lapsed at {lapsed} ms, expected {low} to {high}"
    );
}

/// b READs 1 MB messages from a while a's latency flow runs: a counts its latency flow and
/// b's READ unit, so it guarantees b half of IB-56's 48 Gb/s, 24.00 Gb/s, and the channel
/// renews that grant every 5 ms. At a RefPeriod of 100 us the guarantee must hold between
/// two refreshes as it does at 500 us: the READ flow stays within 1 % of 24.00 Gb/s (what
/// its pacer lets through; uncapped, it takes the link's 48).
#[test]
fn a_read_flow_stays_at_its_24_gbps_guarantee_at_a_100_us_ref_period() {
    let scenario = r#"
description = "remote READ capped over the peer channel at RefPeriods of 500 and 100 us"
profile = "IB-56"
duration_ms = 60
warmup_ms = 3
seed = 1

[topology]
hosts = ["a", "b"]

[[flows]]
name = "lat"
from = "a"
to = "b"
[flows.latency]
size = 16
mode = "ping-pong"

[[flows]]
name = "remote read"
from = "b"
to = "a"
[flows.bandwidth]
size = "1MB"
depth = 8
opcode = "read"

[[variants]]
name = "500 us"
policy = "justitia"
[variants.justitia]
target99_us = 2.0
ref_period_us = 500.0

[[variants]]
name = "100 us"
policy = "justitia"
[variants.justitia]
target99_us = 2.0
ref_period_us = 100.0
"#;
    let report = justitia_sim::Experiment::from_toml(
        "read-guarantee-ref-period",
        scenario,
        Some(&common::scenarios_dir()),
    )
    .expect("scenario")
    .run()
    .expect("run");
    let profile = justitia_core::profile::RnicProfile::builtin("IB-56").expect("IB-56");
    let guarantee = profile.max_rate_gbps / 2.0;
    for variant in ["500 us", "100 us"] {
        let gbps = common::flow(run(&report, variant), "remote read").gbps;
        assert!(
            (gbps - guarantee).abs() <= 0.01 * guarantee,
            "RefPeriod {variant}: the READ flow at {gbps:.2} Gb/s, its guarantee {guarantee:.2} Gb/s"
        );
    }
}
