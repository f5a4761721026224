//! One 16-byte RDMA WRITE posted and its completion polled, `N` times, against the mock
//! provider: either straight to the provider (`direct`), through the shaper's pass-through
//! path (`shaper`, class unset: observe and count), through its shaped path (`shaped`,
//! bandwidth class: the request is too small to split, but is posted with the shaper's tag
//! and its completion translated), or through the shaped path of a throughput flow paced by
//! operations (`paced`: `JUSTITIA_RATE` of 100 GB/s and 1 G ops/s, far above what the loop
//! reaches, so the pacer is asked about every request and never holds one back). Run by
//! `crates/preload/bench/callgrind.sh`, which counts the instructions spent inside
//! `justitia_bench_post` and `justitia_bench_poll` under callgrind.
//!
//! Usage: `post_poll_loop direct|shaper|shaped|paced N`

use std::ffi::c_int;
use std::sync::Arc;

use justitia::clock::MonotonicClock;
use justitia::engine::PacerMode;
use justitia::exports::{engine_from, on_create_cq, on_create_qp};
use justitia::mock::MockDevice;
use justitia_verbs::ops;
use justitia_verbs::sys::*;

/// One post, as the application's inline `ibv_post_send` makes it.
#[no_mangle]
#[inline(never)]
extern "C" fn justitia_bench_post(qp: *mut ibv_qp, wr: *mut ibv_send_wr) -> c_int {
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live mock QP and a valid request.
    unsafe { ops::post_send(qp, wr, &mut bad) }
}

/// One poll, as the application's inline `ibv_poll_cq` makes it.
#[no_mangle]
#[inline(never)]
extern "C" fn justitia_bench_poll(cq: *mut ibv_cq, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live mock CQ with room for one completion.
    unsafe { ops::poll_cq(cq, 1, wc) }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "shaper".into());
    let iterations: u64 = args.next().unwrap_or_else(|| "100000".into()).parse()?;
    let (shaped, class, rate) = match mode.as_str() {
        "direct" => (false, None, None),
        "shaper" => (true, None, None),
        "shaped" => (true, Some("bandwidth"), None),
        "paced" => (true, Some("throughput"), Some("100G:1G")),
        other => anyhow::bail!("mode must be direct, shaper, shaped or paced, not {other}"),
    };

    let dev = MockDevice::new();
    let ctx = dev.context();
    if shaped {
        let lookup = |name: &str| {
            match name {
                "JUSTITIA_CLASS" => class,
                "JUSTITIA_RATE" => rate,
                _ => None,
            }
            .map(str::to_string)
        };
        let engine = engine_from(lookup, Arc::new(MonotonicClock::new()), PacerMode::Manual)
            .ok_or_else(|| anyhow::anyhow!("no engine"))?;
        // SAFETY: a fresh mock context.
        unsafe { justitia::install::attach_context(ctx, engine) };
    }
    let cq = dev.create_cq();
    let mut attr = ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: 16,
            max_send_sge: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let qp = dev.create_qp(&mut attr);
    if shaped {
        // SAFETY: cq and qp were just created on ctx.
        unsafe {
            on_create_cq(ctx, cq);
            on_create_qp(qp, &attr);
        }
    }

    let src = [7u8; 16];
    let mut dst = [0u8; 16];
    let mut sge = ibv_sge {
        addr: src.as_ptr() as u64,
        length: 16,
        lkey: 1,
    };
    let mut wr = ibv_send_wr {
        wr_id: 1,
        sg_list: &mut sge,
        num_sge: 1,
        opcode: IBV_WR_RDMA_WRITE,
        send_flags: IBV_SEND_SIGNALED,
        ..Default::default()
    };
    wr.wr.rdma.remote_addr = dst.as_mut_ptr() as u64;
    let mut wc = ibv_wc::default();
    let mut completions = 0u64;
    for _ in 0..iterations {
        anyhow::ensure!(justitia_bench_post(qp, &mut wr) == 0, "post failed");
        dev.execute_all(qp);
        completions += u64::try_from(justitia_bench_poll(cq, &mut wc)).unwrap_or(0);
    }
    anyhow::ensure!(
        completions == iterations,
        "{completions} completions for {iterations} posts"
    );
    println!("{mode}: {iterations} posts and polls");
    Ok(())
}
