//! The scale scenario `benches/scale.rs` times and `tests/event_cost.rs` checks: one
//! latency flow beside many bandwidth flows of eight queue pairs each.

/// Queue pairs of each bandwidth flow.
pub const QPS_PER_FLOW: u32 = 8;

/// The scenario with `flows` bandwidth flows over `simulated_ms`, with one variant per
/// name in `variants` (`native`, or a policy's name), written as a scenario file would be.
pub fn scenario(flows: u32, simulated_ms: f64, variants: &[&str]) -> String {
    let mut text = format!(
        r#"
description = "one latency flow beside {flows} bandwidth flows of {QPS_PER_FLOW} QPs"
profile = "RoCE-100"
duration_ms = {simulated_ms}
warmup_ms = 2
seed = 1

[justitia]
target99_us = 2.0

[[flows]]
name = "lat"
[flows.latency]
size = 16

[[flows]]
name = "bw"
copies = {flows}
[flows.bandwidth]
size = "1MB"
depth = 8
qps = {QPS_PER_FLOW}
"#
    );
    for v in variants {
        text.push_str(&format!("\n[[variants]]\nname = \"{v}\"\n"));
        if *v != "native" {
            text.push_str(&format!("policy = \"{v}\"\n"));
        }
    }
    text
}
