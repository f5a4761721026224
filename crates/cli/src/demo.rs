//! `justitia demo`: a scripted walk through the policy engine on a built-in RNIC profile.
//!
//! It drives the real controller, token stream, allotment and chunk planner with a
//! hand-written timeline and prints every decision, so an operator can see what the policy
//! does without hardware or a simulator run.

use std::time::Duration;

use anyhow::{Context, Result};
use justitia_core::allotment::{allot_rates, Demand, FlowDemand, Token, TokenStream};
use justitia_core::chunk::{
    ChunkLimits, ChunkPlan, Opcode, RemoteAddr, SendFlags, Sge, SgeList, WorkRequest,
};
use justitia_core::controller::{ControllerConfig, SafeUtilController};
use justitia_core::flow::{FlowClass, FlowCounts, FlowId, FlowSpec, TenantId, Weight};
use justitia_core::profile::{RnicProfile, MIB};

/// Runs the demo on the named built-in profile.
pub fn run(profile_name: &str) -> Result<()> {
    let profile = RnicProfile::builtin(profile_name)?;
    println!(
        "RNIC profile {}: MaxRate {:.1} Gb/s, MaxTput {:.1} M ops/s, MTU {} B",
        profile.name, profile.max_rate_gbps, profile.max_tput_mops, profile.mtu
    );
    controller_timeline(&profile)?;
    tokens_and_rates(&profile);
    chunking(&profile)?;
    Ok(())
}

fn gbps(bytes_per_sec: f64) -> f64 {
    bytes_per_sec * 8.0 / 1e9
}

/// One bandwidth flow runs alone, then a latency flow joins and its tail is violated for a
/// while, then the tail recovers.
fn controller_timeline(profile: &RnicProfile) -> Result<()> {
    let config = ControllerConfig::default();
    let mut controller =
        SafeUtilController::new(config, profile).context("building the SafeUtil controller")?;
    println!(
        "\nSafeUtil controller (Target99 {} us, RefPeriod {} us):",
        config.target_p99.as_micros(),
        config.ref_period.as_micros()
    );
    println!(
        "{:>8}  {:>3} {:>3} {:>3}  {:>9}  {:<10} {:>10}  {:>9}",
        "t (ms)", "L", "B", "T", "p99 (us)", "action", "SafeUtil", "tau (us)"
    );
    let alone = FlowCounts {
        latency: 0,
        bandwidth: 1,
        throughput: 0,
    };
    let shared = FlowCounts {
        latency: 1,
        bandwidth: 1,
        throughput: 0,
    };
    let timeline: Vec<(FlowCounts, Option<f64>)> = [(alone, None); 2]
        .into_iter()
        .chain([(shared, Some(4.5)); 4])
        .chain([(shared, Some(1.6)); 6])
        .collect();
    for (step, (counts, p99_us)) in timeline.into_iter().enumerate() {
        let now = config.ref_period * step as u32;
        let p99 = p99_us.map(|us| Duration::from_nanos((us * 1000.0) as u64));
        let action = controller.update(now, counts, p99);
        println!(
            "{:>8.1}  {:>3} {:>3} {:>3}  {:>9}  {:<10} {:>6.1} Gb/s  {:>9.1}",
            now.as_secs_f64() * 1e3,
            counts.latency,
            counts.bandwidth,
            counts.throughput,
            p99_us.map_or("-".to_string(), |us| format!("{us:.1}")),
            format!("{action:?}"),
            gbps(controller.safe_util()),
            controller.tau().as_secs_f64() * 1e6,
        );
    }
    println!(
        "admitting another latency flow now: {:?}",
        controller.admit_latency_flow()
    );
    Ok(())
}

/// Tokens of the §4.2.3 example and the rate split between two tenants, one of which opens
/// four queue pairs.
fn tokens_and_rates(profile: &RnicProfile) {
    let token = Token::for_profile(1_000_000, profile);
    let tau = Duration::from_secs_f64(token.bytes as f64 / profile.max_rate_bytes_per_sec());
    println!(
        "\nTokens at full rate: {} bytes and {} ops every {:.1} us",
        token.bytes,
        token.ops,
        tau.as_secs_f64() * 1e6
    );
    let flow = |id: u64, tenant: u64, class: FlowClass| FlowSpec {
        id: FlowId(id),
        tenant: TenantId(tenant),
        class,
        weight: Weight::ONE,
    };
    let flows = [
        flow(1, 1, FlowClass::Bandwidth),
        flow(2, 2, FlowClass::Bandwidth),
        flow(3, 2, FlowClass::Bandwidth),
        flow(4, 2, FlowClass::Bandwidth),
        flow(5, 2, FlowClass::Bandwidth),
        flow(6, 3, FlowClass::Throughput),
    ];
    let mut stream = TokenStream::new(token, Duration::ZERO);
    let mut per_tenant = [0u32; 4];
    let mut now = Duration::ZERO;
    for _ in 0..60 {
        if let Some(grant) = stream.issue(now, tau, &flows) {
            if let Some(count) = per_tenant.get_mut(grant.tenant.0 as usize) {
                *count += 1;
            }
        }
        now = stream.next_token_due(tau);
    }
    println!(
        "Round-robin over 60 tokens: tenant 1 (1 QP) {}, tenant 2 (4 QPs) {}, tenant 3 (throughput) {}",
        per_tenant[1], per_tenant[2], per_tenant[3]
    );
    let demands: Vec<FlowDemand> = flows
        .iter()
        .map(|&spec| FlowDemand {
            spec,
            demand: if spec.class == FlowClass::Throughput {
                Demand::OpsPerSec(2e6)
            } else {
                Demand::Unbounded
            },
        })
        .collect();
    println!("Rate allotment of MaxRate (tenant 3 asks for only 2 M ops/s):");
    for rate in allot_rates(profile.max_rate_bytes_per_sec(), profile, &demands) {
        println!(
            "  flow {} of tenant {}: {:>6.2} Gb/s, {:>6.2} M ops/s",
            rate.flow.0,
            rate.tenant.0,
            gbps(rate.bytes_per_sec),
            rate.ops_per_sec / 1e6
        );
    }
}

/// How one 1 MB RDMA WRITE over two SGEs is cut while latency flows are present.
fn chunking(profile: &RnicProfile) -> Result<()> {
    let mut sges = SgeList::new();
    sges.push(Sge {
        addr: 0x10_0000,
        length: 601 * 1024,
        lkey: 7,
    })?;
    sges.push(Sge {
        addr: 0x90_0000,
        length: 423 * 1024,
        lkey: 8,
    })?;
    let request = WorkRequest {
        wr_id: 42,
        opcode: Opcode::Write,
        sges,
        remote: Some(RemoteAddr {
            addr: 0x7000_0000,
            rkey: 9,
        }),
        flags: SendFlags {
            signaled: true,
            ..SendFlags::default()
        },
    };
    let limits = ChunkLimits {
        chunk_bytes: profile.chunk_bytes(true),
        max_sge: 4,
        split_two_sided: false,
    };
    let chunks: Vec<_> = ChunkPlan::new(request, limits)?.collect();
    println!(
        "\nA {} MiB WRITE over 2 SGEs with latency flows present: {} chunks of {} B",
        request.sges.total_bytes() / u64::from(MIB),
        chunks.len(),
        limits.chunk_bytes
    );
    let spanning = chunks.iter().find(|c| c.request.sges.as_slice().len() > 1);
    for chunk in chunks.iter().take(1).chain(spanning).chain(chunks.last()) {
        println!(
            "  chunk {:>3}: offset {:>7}, remote 0x{:x}, {} SGE(s), signaled {}, wr_id {}",
            chunk.index,
            chunk.offset,
            chunk.request.remote.map_or(0, |r| r.addr),
            chunk.request.sges.as_slice().len(),
            chunk.request.flags.signaled,
            chunk.request.wr_id
        );
    }
    Ok(())
}
