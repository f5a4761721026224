//! The queue-pair context cache (`rnic.qp_cache_entries`) in a what-if scenario,
//! `many-qps-message-rate-roce100`: RoCE-100 with a bounded cache, and one application of
//! 16 B WRITEs on more and more queue pairs. Expected values from the profile's parameters
//! and the model's documented steps, not from another model run.

mod common;

use common::{assert_between, experiment, report, run};
use justitia_sim::scenario::AppSpec;

const SCENARIO: &str = "many-qps-message-rate-roce100";

/// Message rate of one application of 16 B inline WRITEs on K queue pairs, in M msgs/s.
///
/// Each message is one packet, so the RNIC's packet scheduler (`nic_mops`) and the wire
/// (its packet rate at 16 B plus headers and the RETH) cap the total; the queue pairs sit
/// on min(K, units) processing units, each starting one message per `1/qp_mops` and, when
/// every context must be read first, per `1/qp_mops + read_latency`; and each queue pair's
/// CPU posts one request per `post_ns`.
///
/// Up to the cache's capacity every context stays on chip once loaded, so after the warm-up
/// no touch misses. Beyond it, each unit serves its queue pairs in turn (each re-books its
/// next message as its last one starts), so between two messages of a queue pair all K - 1
/// others start one: with K - 1 at least the capacity, its context has always been evicted
/// and every message misses.
#[test]
fn held_contexts_keep_the_message_rate_and_evicted_ones_cost_a_read_per_message() {
    let exp = experiment(SCENARIO);
    let p = &exp.profile;
    let capacity = p.rnic.qp_cache_entries;
    assert!(capacity > 0, "the what-if profile has a bounded cache");
    let units = f64::from(p.rnic.processing_units);
    let unit_us = 1.0 / p.rnic.qp_mops;
    let read_us = p.pcie.read_latency_ns / 1e3;
    let r = report(SCENARIO);
    let (mut held, mut evicted) = (0, 0);
    for spec in &exp.scenario.flows {
        let Some(AppSpec::Throughput(t)) = spec.app() else {
            panic!("{}: a throughput flow", spec.name);
        };
        let k = t.qps;
        let size = t.size.bytes() as f64;
        assert!(
            t.inline && size <= f64::from(p.rnic.max_inline_bytes) && size <= f64::from(p.mtu()),
            "{}: one inline packet per message",
            spec.name
        );
        let wire_bytes =
            size + f64::from(p.link.header_bytes) + f64::from(p.link.first_packet_extra_bytes);
        let wire_mpps = p.link.gbps * 1e3 / 8.0 / wire_bytes;
        let post_mops = f64::from(k) * 1e3 / p.host.post_ns;
        let busy = units.min(f64::from(k));
        let variant = format!("{k} QPs");
        let measured = common::flow(run(&r, &variant), &spec.name).msgs_per_sec / 1e6;
        if k <= capacity {
            held += 1;
            let cap = p
                .rnic
                .nic_mops
                .min(wire_mpps)
                .min(post_mops)
                .min(busy * p.rnic.qp_mops);
            assert_between(
                &format!("{variant}, every context held: M msgs/s"),
                measured,
                0.98 * cap,
                1.005 * cap,
            );
        } else {
            evicted += 1;
            let bound = p
                .rnic
                .nic_mops
                .min(wire_mpps)
                .min(post_mops)
                .min(busy / (unit_us + read_us));
            assert!(
                bound < 0.5 * p.rnic.nic_mops,
                "{variant}: the misses, not the scheduler, are the limit ({bound:.2})"
            );
            assert_between(
                &format!("{variant}, a context read per message: M msgs/s"),
                measured,
                0.97 * bound,
                1.005 * bound,
            );
        }
    }
    assert!(
        held >= 2 && evicted >= 1,
        "the scenario has variants both within and beyond the cache"
    );
}
