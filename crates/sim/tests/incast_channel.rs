//! Incast (Justitia §6.7, Fig. 25) with the daemons' protocol (`justitia-peer`) in the loop:
//! eight senders' daemons declare their bandwidth flows into r, and a ninth its latency flow,
//! in datagrams signed, checked and ordered by the code `justitiad` runs, delayed by the
//! link; r's daemon counts the nine incast units and grants each unit of weight a ninth of
//! its MaxRate (`justitia_core::incast`), and the senders pace to it. A grant delayed by the
//! link takes effect two round trips after the flows start (the handshake, then the demand); grants that stop lapse within the
//! channel's silence, and the senders run at their own allotment again (fail-open).

#![allow(clippy::expect_used)]

mod common;

use common::{assert_between, experiment, flow, latency, report, run};

const SCENARIO: &str = "incast-8-to-1-peer-channel-roce100";

/// The channel's silence and refresh by default (`justitia_peer::channel`), and the
/// paper's RefPeriod, ms.
const SILENCE_MS: f64 = 20.0;
const REFRESH_MS: f64 = 5.0;
const REF_PERIOD_MS: f64 = 0.5;

const SENDERS: [&str; 8] = ["s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8"];

fn figure(r: &justitia_sim::RunReport, key: &str) -> Option<f64> {
    r.policy_figures.get(key).copied()
}

/// r's share per unit of weight, Gb/s, from first principles: its MaxRate over nine units
/// of weight 1 (eight bandwidth senders and s9's latency flow, each its own host).
fn share_gbps() -> f64 {
    experiment(SCENARIO).profile.policy.max_rate_bytes_per_sec() * 8.0 / 1e9 / 9.0
}

/// The senders' goodput, Gb/s, in `variant`.
fn rates(r: &justitia_sim::ScenarioReport, variant: &str) -> Vec<f64> {
    let v = run(r, variant);
    SENDERS.iter().map(|s| flow(v, s).gbps).collect()
}

/// Fig. 25 with Justitia: r grants a ninth of its MaxRate per unit of weight, every
/// bandwidth sender is capped at it and paced to it (within the 5% a 1 MB chunk at the
/// measurement window's edges and the pacer's burst allow), where natively each takes an
/// eighth of the link; the latency flow's median falls by at least a quarter (the direction
/// of §6.7: the validation table's J9 checks the same runs). Every daemon sends and nothing is
/// refused.
#[test]
fn the_receiver_grants_each_sender_a_ninth_and_the_senders_pace_to_it() {
    let r = report(SCENARIO);
    let share = share_gbps();
    let j = run(&r, "incast + justitia");
    assert_between(
        "r's incast share, Gb/s",
        figure(j, "r.peer_incast_share_gbps").expect("r grants a share"),
        share * (1.0 - 1e-9),
        share,
    );
    for host in SENDERS.iter().chain(&["s9", "r"]) {
        let sent = figure(j, &format!("{host}.peer_datagrams_sent")).unwrap_or(0.0);
        assert!(sent >= 2.0, "{host} sent {sent} datagrams");
        assert_eq!(
            figure(j, &format!("{host}.peer_datagrams_refused")),
            Some(0.0)
        );
    }
    for (s, rate) in SENDERS.iter().zip(rates(&r, "incast + justitia")) {
        assert_between(
            &format!("{s}: cap, Gb/s"),
            figure(j, &format!("{s}.incast_cap_gbps")).expect("capped"),
            share * (1.0 - 1e-9),
            share,
        );
        assert_between(
            &format!("{s}: goodput, Gb/s"),
            rate,
            0.9 * share,
            1.05 * share,
        );
    }
    // Natively the round-robin switch gives each an eighth of the link, above the share.
    for (s, rate) in SENDERS.iter().zip(rates(&r, "incast")) {
        assert!(rate > 1.1 * share, "{s} natively at {rate} Gb/s");
    }
    let native = latency(run(&r, "incast"), "lat").p50_us;
    let justitia = latency(j, "lat").p50_us;
    assert!(
        native / justitia >= 1.33,
        "latency median: native {native} us, Justitia {justitia} us"
    );
}

/// With 2 ms each way the share reaches every sender two round trips after the flows
/// start (8 ms: the session's handshake, then the demand out and the grant back at once),
/// not before, and at most a RefPeriod later; until then nothing constrains them (they
/// hold no share: fail-open).
#[test]
fn a_delayed_grant_takes_effect_two_round_trips_after_the_start() {
    let r = report(SCENARIO);
    let d = run(&r, "incast + justitia, 2 ms each way");
    for s in SENDERS {
        let first = figure(d, &format!("{s}.peer_first_incast_share_ms")).expect("a share");
        assert!(
            (8.0..=8.0 + REF_PERIOD_MS).contains(&first),
            "{s}: first share at {first} ms, expected 8 to 8.5"
        );
    }
    let prompt = run(&r, "incast + justitia");
    for s in SENDERS {
        let first = figure(prompt, &format!("{s}.peer_first_incast_share_ms")).expect("a share");
        assert!(
            first <= 4.0 * 0.010 + 0.001,
            "{s}: first share at {first} ms"
        );
        // The receiver serves no READ: its guarantee is the whole RNIC, which is no
        // guarantee to report.
        let guarantee = figure(prompt, &format!("{s}.peer_first_guarantee_ms"));
        assert_eq!(guarantee, None, "{s}");
    }
}

/// Every daemon silent from 10 ms: r's last grant left within a refresh before that, so
/// each sender lets it lapse (fail-open) between 10 + silence - refresh and 10 + silence
/// (plus a RefPeriod of slack for timer alignment): 25 to 30.5 ms. Then no sender is capped,
/// and over the run they send more than the share allows: at least the 10 ms to the end of
/// the 40 ms run at an eighth of the link instead of a ninth of MaxRate.
#[test]
fn grants_that_stop_lapse_within_the_silence_bound_and_senders_run_free() {
    let r = report(SCENARIO);
    let s = run(&r, "incast + justitia, daemons silent from 10 ms");
    let (low, high) = (
        10.0 + SILENCE_MS - REFRESH_MS,
        10.0 + SILENCE_MS + REF_PERIOD_MS,
    );
    for sender in SENDERS {
        let lapsed =
            figure(s, &format!("{sender}.peer_incast_share_lapsed_ms")).expect("the share lapsed");
        assert!(
            (low..=high).contains(&lapsed),
            "{sender}: lapsed at {lapsed} ms, expected {low} to {high}"
        );
        assert_eq!(
            figure(s, &format!("{sender}.incast_cap_gbps")),
            None,
            "{sender} still capped"
        );
    }
    let free: f64 = rates(&r, "incast + justitia, daemons silent from 10 ms")
        .iter()
        .sum();
    let paced: f64 = rates(&r, "incast + justitia").iter().sum();
    assert!(
        free > paced * 1.02,
        "senders' total {free} Gb/s after the lapse, {paced} paced throughout"
    );
}
