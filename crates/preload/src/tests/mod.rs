//! The shaper against the in-process mock provider: what reaches the provider, what the
//! application sees, and when.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::c_int;
use std::sync::Arc;
use std::time::Duration;

use justitia_core::message_charge::MessageCharge;
use justitia_verbs::ops;
use justitia_verbs::sys::*;

use crate::clock::{Clock, VirtualClock};
use crate::engine::{self, Engine, PacerMode};
use crate::exports::{engine_from, on_create_cq, on_create_qp};
use crate::mock::{MockDevice, PostedWr};

mod control_verbs;
mod daemon;
mod extended;
mod fork;
mod hardening;
mod locks;
mod real_apps;
mod regressions;
mod stress;
mod teardown;
mod turns;
mod two_sided;

const RKEY: u32 = 0x77;

/// The process's pairing record (`crate::pairing`) is one for every test: a test that
/// pairs QPs holds this, so that another's registration (which makes every pairing due
/// again) does not undo its pairings halfway.
fn pairing_record() -> std::sync::MutexGuard<'static, ()> {
    static RECORD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    RECORD.lock().unwrap_or_else(|e| e.into_inner())
}

/// A mock device with one RC QP whose send and receive CQ is one CQ, attached to an engine
/// with a virtual clock and a manual pacer.
struct Rig {
    dev: MockDevice,
    engine: Arc<Engine>,
    clock: Arc<VirtualClock>,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
}

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

/// An engine configured by `vars` on a virtual clock (the pacer driven by the test), and a
/// mock device whose context it is attached to.
fn attached(vars: &[(&str, &str)]) -> (Arc<Engine>, MockDevice) {
    attached_on(vars, Arc::new(VirtualClock::new()), PacerMode::Manual)
}

/// An engine configured by `vars` reading `clock`, its pacer driven as `pacer` says, and a
/// mock device whose context it is attached to.
fn attached_on(
    vars: &[(&str, &str)],
    clock: Arc<dyn crate::clock::Clock>,
    pacer: PacerMode,
) -> (Arc<Engine>, MockDevice) {
    let engine = engine_from(lookup(vars), clock, pacer).unwrap();
    let dev = MockDevice::new();
    // SAFETY: a fresh mock context.
    assert!(unsafe { crate::install::attach_context(dev.context(), Arc::clone(&engine)) });
    (engine, dev)
}

/// An engine configured by `vars` on a virtual clock (the pacer driven by the test), a
/// mock device attached to it, a registered CQ, and an RC QP created through the shaper's
/// `ibv_create_qp_ex` with `depth` send slots of `sges` SGEs and the `ibv_wr_*` interface.
fn ex_rig(
    vars: &[(&str, &str)],
    depth: u32,
    sges: u32,
) -> (Arc<Engine>, MockDevice, *mut ibv_cq, *mut ibv_qp) {
    let (engine, dev) = attached(vars);
    let ctx = dev.context();
    let cq = dev.create_cq();
    // SAFETY: cq was just created on ctx.
    unsafe { on_create_cq(ctx, cq) };
    let mut attr = qp_attr_ex(
        cq,
        depth,
        sges,
        IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
    );
    // SAFETY: a live context, through the shaper's create_qp_ex.
    let qp = unsafe { ops::create_qp_ex(ctx, &mut attr) };
    assert!(!qp.is_null());
    (engine, dev, cq, qp)
}

fn rig_with(vars: &[(&str, &str)], depth: u32, sig_all: bool) -> Rig {
    rig_on(vars, depth, sig_all, std::ptr::null_mut())
}

/// A rig whose CQ is bound to `channel` (null: none).
fn rig_on(vars: &[(&str, &str)], depth: u32, sig_all: bool, channel: *mut ibv_comp_channel) -> Rig {
    rig_device(vars, depth, sig_all, channel, false)
}

/// A rig on a device taken for Soft-RoCE (rxe) when `soft_roce`.
fn rig_device(
    vars: &[(&str, &str)],
    depth: u32,
    sig_all: bool,
    channel: *mut ibv_comp_channel,
    soft_roce: bool,
) -> Rig {
    let clock = Arc::new(VirtualClock::new());
    let engine = engine_from(lookup(vars), clock.clone(), PacerMode::Manual).unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: a fresh mock context.
    assert!(unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) });
    if soft_roce {
        engine::mark_soft_roce(ctx);
    }
    let cq = dev.create_cq_on(channel);
    // SAFETY: cq was just created on ctx.
    unsafe { on_create_cq(ctx, cq) };
    let mut attr = ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        sq_sig_all: c_int::from(sig_all),
        cap: ibv_qp_cap {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        },
        ..Default::default()
    };
    let qp = dev.create_qp(&mut attr);
    // SAFETY: qp was just created with attr.
    unsafe { on_create_qp(qp, &attr) };
    Rig {
        dev,
        engine,
        clock,
        cq,
        qp,
    }
}

fn rig(vars: &[(&str, &str)]) -> Rig {
    rig_with(vars, 64, false)
}

impl Drop for Rig {
    fn drop(&mut self) {
        forget(&self.dev, &[self.qp], self.cq);
    }
}

/// Unregisters `qps` and `cq` (null: none) from the engine and detaches the mock's context,
/// as the destroy and close verbs would, so that tests sharing the global maps stay apart.
fn forget(dev: &MockDevice, qps: &[*mut ibv_qp], cq: *mut ibv_cq) {
    let ctx = dev.context();
    for &qp in qps {
        if let Some(t) = engine::qp_token(qp) {
            engine::unregister_qp(qp, t);
        }
    }
    if let Some(t) = engine::cq_token(cq) {
        engine::unregister_cq(cq, t);
    }
    engine::detach_context(ctx);
}

fn rdma(
    opcode: ibv_wr_opcode,
    wr_id: u64,
    sges: &mut [ibv_sge],
    remote: u64,
    signaled: bool,
) -> ibv_send_wr {
    let mut wr = ibv_send_wr {
        wr_id,
        sg_list: sges.as_mut_ptr(),
        num_sge: sges.len() as c_int,
        opcode,
        send_flags: if signaled { IBV_SEND_SIGNALED } else { 0 },
        ..Default::default()
    };
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = RKEY;
    wr
}

fn sge(buf: &[u8], offset: usize, len: usize) -> ibv_sge {
    ibv_sge {
        addr: buf.as_ptr() as u64 + offset as u64,
        length: len as u32,
        lkey: 1,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The attributes of an RC QP with `depth` send slots of one SGE each, whose send and
/// receive CQ is `cq`.
fn qp_attr(cq: *mut ibv_cq, depth: u32) -> ibv_qp_init_attr {
    ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: depth,
            max_send_sge: 1,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The extended attributes of an RC QP with `depth` send slots of `sges` SGEs each, whose
/// send and receive CQ is `cq`, with `comp_mask`'s fields valid.
fn qp_attr_ex(cq: *mut ibv_cq, depth: u32, sges: u32, comp_mask: u32) -> ibv_qp_init_attr_ex {
    ibv_qp_init_attr_ex {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: depth,
            max_send_sge: sges,
            ..Default::default()
        },
        comp_mask,
        ..Default::default()
    }
}

/// Creates a QP with `attr` on the mock and tells the shaper, as its `ibv_create_qp` does.
fn create_qp(dev: &MockDevice, mut attr: ibv_qp_init_attr) -> *mut ibv_qp {
    let qp = dev.create_qp(&mut attr);
    // SAFETY: qp was just created with attr.
    unsafe { on_create_qp(qp, &attr) };
    qp
}

/// Posts `wr` alone on `qp` through the shaper's `ibv_post_send`; returns its result.
fn post_on(qp: *mut ibv_qp, wr: &mut ibv_send_wr) -> c_int {
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live QP and a one-request list.
    unsafe { ops::post_send(qp, wr, &mut bad) }
}

impl Rig {
    /// Posts `wrs` as one list; returns the result and the index `bad_wr` points at.
    fn post(&self, wrs: &mut [ibv_send_wr]) -> (c_int, Option<usize>) {
        for i in 1..wrs.len() {
            let next: *mut ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        if let Some(last) = wrs.last_mut() {
            last.next = std::ptr::null_mut();
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live QP and a valid list.
        let rc = unsafe { ops::post_send(self.qp, wrs.as_mut_ptr(), &mut bad) };
        let index = (!bad.is_null()).then(|| {
            // SAFETY: bad points into wrs.
            usize::try_from(unsafe { bad.offset_from(wrs.as_ptr()) }).unwrap()
        });
        (rc, index)
    }

    /// Polls until the CQ is empty.
    fn poll(&self) -> Vec<ibv_wc> {
        let mut out = Vec::new();
        let mut buf = [ibv_wc::default(); 4];
        loop {
            // SAFETY: a live CQ and room for 4 entries.
            let n = unsafe { ops::poll_cq(self.cq, 4, buf.as_mut_ptr()) };
            assert!(n >= 0);
            out.extend_from_slice(&buf[..n as usize]);
            if n < 4 {
                return out;
            }
        }
    }

    /// Executes and polls until nothing moves; returns the completions the application saw.
    fn run(&self) -> Vec<ibv_wc> {
        let mut seen = Vec::new();
        loop {
            let ran = self.dev.execute_all(self.qp);
            let got = self.poll();
            let moved = ran > 0 || !got.is_empty();
            seen.extend(got);
            if !moved {
                return seen;
            }
        }
    }

    fn log(&self) -> Vec<PostedWr> {
        self.dev.log()
    }

    /// Posts one RDMA WRITE (`wr_id`) of `len` patterned bytes (`seed`) into a zeroed
    /// destination of the same length, and checks that the shaper took it; returns the
    /// source and the destination, to compare once the WRITE has run.
    fn post_write(&self, len: usize, seed: u8, wr_id: u64, signaled: bool) -> (Vec<u8>, Vec<u8>) {
        let src = pattern(len, seed);
        let mut dst = vec![0u8; len];
        let mut s = [sge(&src, 0, len)];
        let mut w = [rdma(
            IBV_WR_RDMA_WRITE,
            wr_id,
            &mut s,
            dst.as_mut_ptr() as u64,
            signaled,
        )];
        assert_eq!(self.post(&mut w), (0, None), "WRITE {wr_id} taken whole");
        (src, dst)
    }
}

/// What `ibv_modify_qp(qp, {qp_state: ERR}, IBV_QP_STATE)` tells the shaper.
fn to_error(qp: *mut ibv_qp) {
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_ERR,
        ..Default::default()
    };
    engine::qp(qp).unwrap().on_modify(&attr, IBV_QP_STATE);
}

const BANDWIDTH_64K: &[(&str, &str)] =
    &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "64K")];

#[test]
fn unset_class_only_observes_and_counts() {
    let r = rig(&[]);
    let (src, dst) = r.post_write(1 << 20, 1, 7, true);
    let log = r.log();
    assert_eq!(log.len(), 1, "not split");
    assert_eq!(log[0].wr_id, 7);
    assert_eq!(log[0].len(), 1 << 20);
    let wcs = r.run();
    assert_eq!(wcs.len(), 1);
    assert_eq!((wcs[0].wr_id, wcs[0].byte_len), (7, 1 << 20));
    assert_eq!(src, dst);
    let stats = r.engine.stats();
    assert_eq!(
        (stats.requests, stats.bytes, stats.chunks, stats.qps),
        (1, 1 << 20, 0, 1)
    );
}

#[test]
fn latency_class_passes_through() {
    let r = rig(&[("JUSTITIA_CLASS", "latency"), ("JUSTITIA_CHUNK", "1K")]);
    let (src, dst) = r.post_write(8192, 2, 1, true);
    assert_eq!(r.log().len(), 1);
    assert_eq!(r.run().len(), 1);
    assert_eq!(src, dst);
}

/// A latency-class process times one signaled request at a time, once timing is on (the
/// follower turns it on when a daemon reads the round trips), from its post to the poll
/// that returns its completion, among the requests the stride makes candidates; a refused
/// post, an error or a request given up leaves no round trip and lets the next candidate
/// be timed.
#[test]
fn a_latency_process_times_one_signaled_request_at_a_time() {
    use crate::engine::qp::TIMED_STRIDE;
    let r = rig(&[("JUSTITIA_CLASS", "latency")]);
    let trips = r
        .engine
        .round_trips()
        .expect("a latency process times round trips");
    // The mock runs a WRITE when the test executes it: its buffers outlive every request.
    let src = pattern(64, 1);
    let mut dst = vec![0u8; 64];
    let to = dst.as_mut_ptr() as u64;
    let write = |wr_id: u64, signaled: bool| {
        let mut s = [sge(&src, 0, 64)];
        let mut w = [rdma(IBV_WR_RDMA_WRITE, wr_id, &mut s, to, signaled)];
        r.post(&mut w).0
    };
    // Requests completed one by one until the next one posted is a candidate.
    let to_candidate = || {
        while !r.engine.stats().requests.is_multiple_of(TIMED_STRIDE) {
            assert_eq!(write(100, true), 0);
            assert_eq!(r.run().len(), 1);
        }
    };
    // Off: nothing timed.
    for wr_id in 0..TIMED_STRIDE {
        assert_eq!(write(wr_id, true), 0);
        assert_eq!(r.run().len(), 1);
    }
    assert_eq!(trips.take(), None);
    trips.set_wanted(true);
    // On: one in the stride.
    for wr_id in 0..2 * TIMED_STRIDE {
        assert_eq!(write(wr_id, true), 0);
        assert_eq!(r.run().len(), 1);
    }
    let (count, longest) = trips.take().expect("round trips");
    assert_eq!(u64::from(count), 2);
    // The mock completes at once: a round trip of the test's own few steps, not a
    // timestamp or an unset one (those would be the uptime, or 4.3 s saturated).
    assert!(longest[0] > 0 && longest[0] < 1_000_000_000, "{longest:?}");
    // Two candidates in flight at once: the first is timed, the second finds it busy.
    to_candidate();
    for wr_id in 0..=TIMED_STRIDE {
        assert_eq!(write(wr_id, true), 0);
    }
    assert_eq!(r.run().len() as u64, TIMED_STRIDE + 1);
    assert_eq!(trips.take().map(|t| t.0), Some(1));
    // An unsignaled candidate has no completion to end it.
    to_candidate();
    assert_eq!(write(6, false), 0);
    assert_eq!(r.run().len(), 0);
    assert_eq!(trips.take(), None);
    // A candidate refused by the provider is not timed, and the next one is.
    to_candidate();
    r.dev.refuse_next_post(r.qp, libc::ENOMEM);
    assert_eq!(write(7, true), libc::ENOMEM);
    to_candidate();
    assert_eq!(write(8, true), 0);
    assert_eq!(r.run().len(), 1);
    assert_eq!(trips.take().map(|t| t.0), Some(1));
    // Given up after a second without its completion: it completes later, uncounted, and
    // the next candidate is timed.
    to_candidate();
    assert_eq!(write(9, true), 0);
    let now = justitia_agent::block::monotonic_ns();
    trips.give_up_stale(now);
    trips.give_up_stale(now + crate::round_trips::GIVE_UP_AFTER_NS + 1);
    assert_eq!(r.run().len(), 1);
    assert_eq!(trips.take(), None);
    to_candidate();
    assert_eq!(write(10, true), 0);
    assert_eq!(r.run().len(), 1);
    assert_eq!(trips.take().map(|t| t.0), Some(1));
    // An error ends the timing without a round trip.
    to_candidate();
    r.dev.fail_next(r.qp, IBV_WC_REM_ACCESS_ERR);
    assert_eq!(write(11, true), 0);
    let wcs = r.run();
    assert_eq!(wcs[0].status, IBV_WC_REM_ACCESS_ERR);
    assert_eq!(trips.take(), None);
    assert_eq!(dst, src);
}

#[test]
fn only_a_process_that_shapes_qps_or_times_round_trips_hooks_the_poll() {
    let poll_hook = |vars: &[(&str, &str)]| {
        let r = rig(vars);
        // SAFETY: the rig's live context.
        let installed = unsafe { (*r.dev.context()).ops.poll_cq };
        installed.map(|f| f as *const () as usize)
    };
    let shaping = Some(crate::hooks::poll_cq as *const () as usize);
    let timing = Some(crate::hooks::poll_cq_timed as *const () as usize);
    assert_ne!(
        poll_hook(&[]),
        shaping,
        "class unset: the provider's poll stays"
    );
    assert_ne!(poll_hook(&[]), timing);
    let off = poll_hook(&[("JUSTITIA_CLASS", "latency"), ("JUSTITIA_DAEMON", "off")]);
    assert!(
        off != shaping && off != timing,
        "latency, no daemon: the provider's"
    );
    // A latency process that may follow a daemon looks for its timed requests'
    // completions in its polls (see `crate::round_trips`), with a hook of its own.
    assert_eq!(poll_hook(&[("JUSTITIA_CLASS", "latency")]), timing);
    assert_eq!(poll_hook(BANDWIDTH_64K), shaping);
    assert_eq!(poll_hook(&[("JUSTITIA_CLASS", "throughput")]), shaping);
    assert_eq!(poll_hook(&[("JUSTITIA_CLASS", "auto")]), shaping);
}

#[test]
fn large_write_is_split_in_order_with_one_completion() {
    let r = rig(BANDWIDTH_64K);
    let (src, dst) = r.post_write(1 << 20, 3, 42, true);
    let remote = dst.as_ptr() as u64;
    let log = r.log();
    assert_eq!(log.len(), 16);
    for (i, w) in log.iter().enumerate() {
        assert_eq!(w.opcode, IBV_WR_RDMA_WRITE);
        assert_eq!(
            w.remote_addr,
            remote + (i as u64) * 65_536,
            "chunk {i} in order"
        );
        assert_eq!(w.rkey, RKEY);
        assert_eq!(w.len(), 65_536);
        assert_eq!(w.signaled(), i == 15, "only the last chunk is signaled");
    }
    // Every chunk carries a distinct tag of the shaper's, never the application's wr_id
    // (its completion gets that back).
    let mut tags: Vec<u64> = log.iter().map(|w| w.wr_id).collect();
    tags.sort_unstable();
    tags.dedup();
    assert_eq!(tags.len(), 16);
    assert!(!tags.contains(&42));
    assert_eq!(
        r.dev.post_calls(),
        1,
        "the chunks go to the provider as one list"
    );
    let wcs = r.run();
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].wr_id, 42);
    assert_eq!(wcs[0].status, IBV_WC_SUCCESS);
    assert_eq!(wcs[0].opcode, IBV_WC_RDMA_WRITE);
    assert_eq!(wcs[0].byte_len, 1 << 20);
    assert_eq!(src, dst);
    let stats = r.engine.stats();
    assert_eq!(
        (stats.requests, stats.split_requests, stats.chunks),
        (1, 1, 16)
    );
}

#[test]
fn write_with_imm_is_never_split() {
    // The peer's receive completion reports the length of the message that carried the
    // immediate; split, it would report the last chunk's (seen on Soft-RoCE).
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "4K")]);
    let src = pattern(10_000, 4);
    let mut dst = vec![0u8; 10_000];
    let mut s = [sge(&src, 0, 10_000)];
    let mut wr = rdma(
        IBV_WR_RDMA_WRITE_WITH_IMM,
        5,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    );
    wr.__bindgen_anon_1.imm_data = 0xabcd_0123;
    wr.send_flags |= IBV_SEND_SOLICITED | IBV_SEND_FENCE;
    assert_eq!(r.post(&mut [wr]).0, 0);
    let log = r.log();
    assert_eq!(log.len(), 1);
    assert_eq!(
        (log[0].opcode, log[0].imm_data, log[0].len()),
        (IBV_WR_RDMA_WRITE_WITH_IMM, 0xabcd_0123, 10_000)
    );
    assert_eq!(
        log[0].send_flags & (IBV_SEND_SOLICITED | IBV_SEND_FENCE),
        IBV_SEND_SOLICITED | IBV_SEND_FENCE
    );
    assert_eq!(
        r.run().iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [5],
        "the application's wr_id comes back"
    );
    assert_eq!(src, dst);
    assert_eq!(r.engine.stats().split_requests, 0);
}

#[test]
fn read_is_split_and_lands_in_the_local_sges() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "3000")]);
    let remote = pattern(9000, 5);
    let local_a = vec![0u8; 4000];
    let local_b = vec![0u8; 5000];
    let mut s = [sge(&local_a, 0, 4000), sge(&local_b, 0, 5000)];
    let mut wrs = [rdma(
        IBV_WR_RDMA_READ,
        9,
        &mut s,
        remote.as_ptr() as u64,
        true,
    )];
    assert_eq!(r.post(&mut wrs).0, 0);
    let log = r.log();
    assert_eq!(log.len(), 3);
    assert!(log.iter().all(|w| w.opcode == IBV_WR_RDMA_READ));
    // The second chunk spans the two local SGEs.
    assert_eq!(log[1].sges.len(), 2);
    assert_eq!(log[1].remote_addr, remote.as_ptr() as u64 + 3000);
    let wcs = r.run();
    assert_eq!(
        (wcs.len(), wcs[0].wr_id, wcs[0].opcode, wcs[0].byte_len),
        (1, 9, IBV_WC_RDMA_READ, 9000)
    );
    assert_eq!(&remote[..4000], &local_a[..]);
    assert_eq!(&remote[4000..], &local_b[..]);
}

#[test]
fn many_small_sges_are_split_within_the_sge_limit() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")]);
    let src = pattern(4 * 700, 6);
    let mut dst = vec![0u8; 4 * 700];
    let mut s: Vec<ibv_sge> = (0..4).map(|i| sge(&src, i * 700, 700)).collect();
    let mut wrs = [rdma(
        IBV_WR_RDMA_WRITE,
        3,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    )];
    assert_eq!(r.post(&mut wrs).0, 0);
    let log = r.log();
    assert!(log.iter().all(|w| w.sges.len() <= 4 && w.len() <= 1024));
    assert_eq!(log.iter().map(PostedWr::len).sum::<u64>(), 2800);
    assert_eq!(r.run().len(), 1);
    assert_eq!(src, dst);
}

#[test]
fn two_sided_atomic_and_inline_requests_are_not_split() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")]);
    let src = pattern(8192, 7);
    let mut s1 = [sge(&src, 0, 8192)];
    let send = rdma(IBV_WR_SEND, 1, &mut s1, 0, true);
    let mut s2 = [sge(&src, 0, 8)];
    let mut word = 0u64;
    let mut atomic = rdma(IBV_WR_ATOMIC_FETCH_AND_ADD, 2, &mut s2, 0, true);
    atomic.wr.atomic.remote_addr = &mut word as *mut u64 as u64;
    atomic.wr.atomic.compare_add = 1;
    let mut s3 = [sge(&src, 0, 60)];
    let mut dst = vec![0u8; 60];
    let mut inline = rdma(IBV_WR_RDMA_WRITE, 3, &mut s3, dst.as_mut_ptr() as u64, true);
    inline.send_flags |= IBV_SEND_INLINE;
    assert_eq!(r.post(&mut [send, atomic, inline]).0, 0);
    let log = r.log();
    assert_eq!(
        log.iter().map(|w| w.opcode).collect::<Vec<_>>(),
        [IBV_WR_SEND, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_WRITE]
    );
    assert_eq!(log[0].len(), 8192);
    // The inline payload was copied at post time into the shaper's own buffer.
    assert_ne!(log[2].sges[0].addr, src.as_ptr() as u64);
    assert_eq!(
        r.run().iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(&dst[..], &src[..60]);
}

#[test]
fn unsignaled_requests_complete_silently() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")]);
    let src = pattern(4096, 8);
    let mut dst = vec![0u8; 4096 * 3];
    let base = dst.as_mut_ptr() as u64;
    let mut s = [sge(&src, 0, 4096)];
    let mut s2 = s;
    let mut s3 = s;
    let mut wrs = [
        rdma(IBV_WR_RDMA_WRITE, 1, &mut s, base, false),
        rdma(IBV_WR_RDMA_WRITE, 2, &mut s2, base + 4096, false),
        rdma(IBV_WR_RDMA_WRITE, 3, &mut s3, base + 8192, true),
    ];
    assert_eq!(r.post(&mut wrs).0, 0);
    assert_eq!(r.log().len(), 12);
    let wcs = r.run();
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [3]);
    for part in dst.chunks(4096) {
        assert_eq!(part, &src[..]);
    }
    // Unsignaled requests alone produce nothing the application sees.
    let mut s4 = [sge(&src, 0, 4096)];
    assert_eq!(
        r.post(&mut [rdma(IBV_WR_RDMA_WRITE, 4, &mut s4, base, false)])
            .0,
        0
    );
    assert!(r.run().is_empty());
}

#[test]
fn internal_signals_keep_slots_flowing_when_the_application_rarely_signals() {
    // Depth 8: a 16-chunk unsignaled request cannot fit; the shaper signals internally,
    // hides those completions, and drains the rest on completions.
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")],
        8,
        false,
    );
    let src = pattern(16 * 1024, 9);
    let mut dst = vec![0u8; 16 * 1024];
    let mut s = [sge(&src, 0, src.len())];
    let mut s2 = [sge(&src, 0, 16)];
    let mut wrs = [
        rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, false),
        rdma(IBV_WR_RDMA_WRITE, 2, &mut s2, dst.as_mut_ptr() as u64, true),
    ];
    assert_eq!(r.post(&mut wrs).0, 0);
    assert!(
        r.dev.queued(r.qp) <= 8,
        "never more than the hardware queue holds"
    );
    let wcs = r.run();
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [2]);
    assert_eq!(r.log().len(), 17);
    assert!(r.log().iter().filter(|w| w.signaled()).count() >= 2);
    assert_eq!(&dst[16..], &src[16..]);
}

#[test]
fn queue_depth_is_the_applications_and_the_software_queue_drains() {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")],
        4,
        false,
    );
    let src = pattern(16 * 1024, 10);
    let mut dst = vec![0u8; 16 * 1024];
    let base = dst.as_mut_ptr() as u64;
    let mut sg: Vec<[ibv_sge; 1]> = (0..5).map(|_| [sge(&src, 0, src.len())]).collect();
    let mut wrs: Vec<ibv_send_wr> = sg
        .iter_mut()
        .enumerate()
        .map(|(i, s)| rdma(IBV_WR_RDMA_WRITE, i as u64, s, base, true))
        .collect();
    // Four requests (64 chunks) are accepted; the fifth exceeds max_send_wr.
    let (rc, bad) = r.post(&mut wrs);
    assert_eq!((rc, bad), (libc::ENOMEM, Some(4)));
    assert_eq!(r.dev.queued(r.qp), 4, "the hardware queue holds 4 WQEs");
    assert_eq!(r.engine.stats().queued_max, 4);
    let wcs = r.run();
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!(r.log().len(), 64);
    // Retired: there is room for four more.
    let mut more = vec![wrs[4]];
    assert_eq!(r.post(&mut more).0, 0);
    assert_eq!(r.run().len(), 1);
    assert_eq!(src, dst);
}

#[test]
fn an_error_on_a_chunk_is_reported_once_on_the_original_request() {
    let r = rig(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")]);
    let src = pattern(8192, 11);
    let mut dst = vec![0u8; 8192];
    let base = dst.as_mut_ptr() as u64;
    let mut s = [sge(&src, 0, 8192)];
    let mut s2 = s;
    let mut s3 = s;
    let mut wrs = [
        rdma(IBV_WR_RDMA_WRITE, 10, &mut s, base, true),
        rdma(IBV_WR_RDMA_WRITE, 11, &mut s2, base, false),
        rdma(IBV_WR_RDMA_WRITE, 12, &mut s3, base, true),
    ];
    assert_eq!(r.post(&mut wrs).0, 0);
    // The first request completes; the third chunk of the second fails.
    r.dev.execute(r.qp, 8);
    let first = r.poll();
    assert_eq!(
        first
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        [(10, IBV_WC_SUCCESS)]
    );
    r.dev.execute(r.qp, 2);
    r.dev.fail_next(r.qp, IBV_WC_REM_ACCESS_ERR);
    let rest = r.run();
    let got: Vec<_> = rest.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [(11, IBV_WC_REM_ACCESS_ERR), (12, IBV_WC_WR_FLUSH_ERR)]
    );
    assert_eq!(r.engine.stats().errors, 2);
    // A request posted to the failed QP gets its flush error too.
    let mut s4 = [sge(&src, 0, 8192)];
    assert_eq!(
        r.post(&mut [rdma(IBV_WR_RDMA_WRITE, 13, &mut s4, base, false)])
            .0,
        0
    );
    let late = r.run();
    assert_eq!(
        late.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(13, IBV_WC_WR_FLUSH_ERR)]
    );
}

#[test]
fn a_refused_first_post_is_returned_to_the_application() {
    let r = rig(BANDWIDTH_64K);
    let src = pattern(1 << 18, 12);
    let mut dst = vec![0u8; 1 << 18];
    let mut s = [sge(&src, 0, src.len())];
    let mut s2 = s;
    let mut wrs = [
        rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true),
        rdma(IBV_WR_RDMA_WRITE, 2, &mut s2, dst.as_mut_ptr() as u64, true),
    ];
    r.dev.refuse_next_post(r.qp, libc::EINVAL);
    assert_eq!(r.post(&mut wrs), (libc::EINVAL, Some(0)));
    assert!(r.log().is_empty());
    // Nothing was kept: the whole capacity is the application's again.
    assert_eq!(r.post(&mut wrs).0, 0);
    assert_eq!(r.run().len(), 2);
}

#[test]
fn signal_all_qps_see_one_completion_per_request() {
    let r = rig_with(
        &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")],
        16,
        true,
    );
    let (src, dst) = r.post_write(4096, 13, 77, false);
    let wcs = r.run();
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [77]);
    assert_eq!(src, dst);
}

#[test]
fn preempt_inserts_zero_length_yields_between_sub_messages() {
    let r = rig(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_POLICY", "preempt"),
        ("JUSTITIA_SUBMSG", "16K"),
        ("JUSTITIA_YIELD_UNIT", "1K"),
    ]);
    let (src, dst) = r.post_write(64 * 1024, 14, 8, true);
    let remote = dst.as_ptr() as u64;
    let log = r.log();
    // 4 sub-messages, 16 yields after each but the last.
    assert_eq!(log.len(), 4 + 3 * 16);
    let payload: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, w)| !w.is_empty())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(payload, [0, 17, 34, 51]);
    for y in log.iter().filter(|w| w.is_empty()) {
        assert_eq!(
            (y.opcode, y.sges.len(), y.remote_addr, y.rkey),
            (IBV_WR_RDMA_WRITE, 0, remote, RKEY)
        );
        assert!(!y.signaled() || r.log().len() > 32);
    }
    let wcs = r.run();
    assert_eq!(
        wcs.iter()
            .map(|w| (w.wr_id, w.byte_len))
            .collect::<Vec<_>>(),
        [(8, 65_536)]
    );
    assert_eq!(src, dst);
    let stats = r.engine.stats();
    assert_eq!(
        (stats.yields, stats.chunks, stats.pacing_delay_ns),
        (48, 4, 0)
    );
}

#[test]
fn pacing_conforms_to_the_rate_on_a_virtual_clock() {
    let r = rig_with(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "64K"),
            ("JUSTITIA_RATE", "10M"),
        ],
        128,
        false,
    );
    let src = pattern(1 << 20, 15);
    let mut dst = vec![0u8; 1 << 20];
    let remote = dst.as_mut_ptr() as u64;
    let horizon = Duration::from_secs(10);
    let mut outstanding = 0usize;
    let mut next_id = 0u64;
    while r.clock.now() < horizon {
        while outstanding < 4 {
            let mut s = [sge(&src, 0, src.len())];
            let mut w = [rdma(IBV_WR_RDMA_WRITE, next_id, &mut s, remote, true)];
            assert_eq!(r.post(&mut w).0, 0, "posting never blocks");
            next_id += 1;
            outstanding += 1;
        }
        let next = r.engine.pacer_tick(r.clock.now());
        r.dev.execute_all(r.qp);
        outstanding -= r.poll().len();
        r.clock
            .set(next.unwrap_or(r.clock.now() + Duration::from_millis(1)));
    }
    let bytes: u64 = r.log().iter().map(PostedWr::len).sum();
    let rate = bytes as f64 / horizon.as_secs_f64();
    assert!((rate / 10e6 - 1.0).abs() < 0.02, "paced at {rate} B/s");
    let stats = r.engine.stats();
    // A chunk is waiting for tokens nearly all the time: the waits add up to the horizon.
    let waited = stats.pacing_delay_ns as f64 / 1e9;
    assert!(
        (waited / horizon.as_secs_f64() - 1.0).abs() < 0.05,
        "waited {waited} s"
    );
    // Requests are counted when their first chunk goes; at most the 4 outstanding wait.
    assert!(stats.requests <= next_id && stats.requests + 4 >= next_id);
    assert_eq!(src, dst);
}

/// Issue 9, item 2: the shaper paces with the core's pacer, whose burst is two chunks or
/// the pacer thread's release window (100 us) at the rate, whichever is more. At 24 Gb/s
/// with 5 KiB chunks that is 300 kB: a 1 MB WRITE starts with 59 chunks back to back (58
/// fit in 300 000 B, and the 59th overdraws it); the shaper's old 1 ms bucket held 3 MB
/// there and let the whole request out at once. The rest follows at the rate.
#[test]
fn a_bandwidth_flow_starts_with_at_most_its_burst_back_to_back() {
    let r = rig_with(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "5K"),
            ("JUSTITIA_RATE", "3G"),
        ],
        512,
        false,
    );
    let (src, dst) = r.post_write(1 << 20, 19, 1, true);
    assert_eq!(r.log().len(), 59, "the burst and one chunk");
    // Polled every microsecond, in which 3 kB accrue at 3 GB/s: never more than two chunks
    // at once after the burst.
    let mut most = 0;
    let mut seen = Vec::new();
    while seen.is_empty() && r.clock.now() < Duration::from_millis(10) {
        r.clock.advance(Duration::from_micros(1));
        let before = r.log().len();
        r.engine.pacer_tick(r.clock.now());
        most = most.max(r.log().len() - before);
        seen.extend(r.run());
    }
    assert!(most <= 2, "{most} chunks at once");
    assert_eq!(seen.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1]);
    // The last (205th) chunk goes when the 204 before it (1 044 480 B) less the 300 000 B
    // burst have accrued at 3 GB/s: 248.2 us, seen at the next microsecond.
    let took = r.clock.now();
    assert!(
        took >= Duration::from_micros(248) && took <= Duration::from_micros(251),
        "{took:?}"
    );
    assert_eq!(src, dst);
}

#[test]
fn a_polling_application_releases_paced_chunks_itself_at_the_rate() {
    let r = rig_with(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "64K"),
            ("JUSTITIA_RATE", "10M"),
        ],
        128,
        false,
    );
    let src = pattern(1 << 20, 17);
    let mut dst = vec![0u8; 1 << 20];
    let remote = dst.as_mut_ptr() as u64;
    let horizon = Duration::from_secs(5);
    let mut outstanding = 0usize;
    let mut next_id = 0u64;
    // Busy polling every 100 us, and never a pacer tick: the polls alone must release the
    // chunks, on time.
    while r.clock.now() < horizon {
        while outstanding < 4 {
            let mut s = [sge(&src, 0, src.len())];
            let mut w = [rdma(IBV_WR_RDMA_WRITE, next_id, &mut s, remote, true)];
            assert_eq!(r.post(&mut w).0, 0);
            next_id += 1;
            outstanding += 1;
        }
        r.dev.execute_all(r.qp);
        outstanding -= r.poll().len();
        r.clock.advance(Duration::from_micros(100));
    }
    let bytes: u64 = r.log().iter().map(PostedWr::len).sum();
    let rate = bytes as f64 / horizon.as_secs_f64();
    assert!((rate / 10e6 - 1.0).abs() < 0.02, "paced at {rate} B/s");
    assert_eq!(src, dst);
}

/// Single requests on an idle queue are posted straight from the application's request
/// (no copy, no batch), but still asked of the pacer: at 1000 ops/s, of ten 16 B WRITEs
/// posted one call each at once, three go (the burst of two operations and the one that
/// overdraws it) and the rest wait behind them, in order, at the rate.
#[test]
fn single_posts_on_an_idle_queue_are_still_paced_and_kept_in_order() {
    let r = rig(&[
        ("JUSTITIA_CLASS", "throughput"),
        ("JUSTITIA_RATE", "1G:1000"),
    ]);
    let src = pattern(16, 23);
    let mut dst = vec![0u8; 16];
    for id in 0..10 {
        let mut s = [sge(&src, 0, 16)];
        let mut w = [rdma(
            IBV_WR_RDMA_WRITE,
            id,
            &mut s,
            dst.as_mut_ptr() as u64,
            true,
        )];
        assert_eq!(r.post(&mut w).0, 0);
    }
    assert_eq!(r.log().len(), 3, "the burst and one request");
    let mut seen = r.run();
    while seen.len() < 10 && r.clock.now() < Duration::from_secs(1) {
        r.clock.advance(Duration::from_micros(100));
        r.engine.pacer_tick(r.clock.now());
        seen.extend(r.run());
    }
    assert_eq!(
        seen.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (0..10).collect::<Vec<_>>()
    );
    // Seven more at 1 ms each.
    let took = r.clock.now();
    assert!(
        took >= Duration::from_millis(7) && took <= Duration::from_micros(7_200),
        "{took:?}"
    );
    assert_eq!(src, dst);
}

#[test]
fn throughput_class_is_paced_by_operations() {
    let r = rig(&[
        ("JUSTITIA_CLASS", "throughput"),
        ("JUSTITIA_RATE", "1G:1000"),
    ]);
    let src = pattern(16, 16);
    let mut dst = vec![0u8; 16];
    let mut outstanding = 0usize;
    while r.clock.now() < Duration::from_secs(2) {
        if outstanding == 0 {
            let mut s: Vec<[ibv_sge; 1]> = (0..32).map(|_| [sge(&src, 0, 16)]).collect();
            let mut wrs: Vec<ibv_send_wr> = s
                .iter_mut()
                .map(|s| rdma(IBV_WR_RDMA_WRITE, 0, s, dst.as_mut_ptr() as u64, true))
                .collect();
            assert_eq!(r.post(&mut wrs).0, 0);
            outstanding = 32;
        }
        let next = r.engine.pacer_tick(r.clock.now());
        r.dev.execute_all(r.qp);
        outstanding -= r.poll().len();
        r.clock
            .set(next.unwrap_or(r.clock.now() + Duration::from_millis(1)));
    }
    let ops = r.log().len() as f64 / 2.0;
    assert!((ops / 1000.0 - 1.0).abs() < 0.02, "{ops} ops/s");
    assert!(r.log().iter().all(|w| w.len() == 16), "not split");
}

/// The daemon's price under `adaptive` ([`MessageCharge`]) holds small requests to what
/// they cost, not to their payload. At 10 MB/s with 64 KiB chunks the burst is two chunks,
/// 131 072 B. Of 500 WRITEs of 64 B posted at once, each charged its least of 1000 B, 131
/// fit in it and the 132nd overdraws it: 132 go (posted straight, the fast lane's charge),
/// and the rest are released at 10 000 a second (drains from the pacer, their charge):
/// 100 more in 10 ms. Priced by their payload all 500 fit in the burst (32 000 B).
#[test]
fn small_requests_are_paced_at_what_the_daemon_charges_them() {
    let run = |charge: MessageCharge| {
        let r = rig_with(
            &[
                ("JUSTITIA_CLASS", "bandwidth"),
                ("JUSTITIA_CHUNK", "64K"),
                ("JUSTITIA_RATE", "10M"),
            ],
            1024,
            false,
        );
        r.engine.apply(
            crate::follow::Settings {
                charge,
                ..r.engine.settings()
            },
            r.clock.now(),
        );
        assert_eq!(r.engine.settings().charge, charge);
        let src = pattern(64, 29);
        let mut dst = vec![0u8; 64];
        for id in 0..500 {
            let mut s = [sge(&src, 0, 64)];
            let mut w = [rdma(
                IBV_WR_RDMA_WRITE,
                id,
                &mut s,
                dst.as_mut_ptr() as u64,
                false,
            )];
            assert_eq!(r.post(&mut w).0, 0);
        }
        let at_once = r.log().len();
        while r.clock.now() < Duration::from_millis(10) {
            r.clock.advance(Duration::from_micros(100));
            r.engine.pacer_tick(r.clock.now());
            r.run();
        }
        (at_once, r.log().len())
    };
    let least = MessageCharge {
        least_bytes: 1000,
        ..MessageCharge::NONE
    };
    let (at_once, by_10ms) = run(least);
    assert_eq!(at_once, 132);
    assert!((231..=233).contains(&by_10ms), "{by_10ms} by 10 ms");
    assert_eq!(run(MessageCharge::NONE), (500, 500));
}

#[test]
fn wr_batches_are_collected_and_split() {
    let (_engine, dev, cq, qp) = ex_rig(BANDWIDTH_64K, 32, 2);
    let qpx = qp.cast::<ibv_qp_ex>();
    let src = pattern(256 * 1024, 17);
    let mut dst = vec![0u8; 256 * 1024];
    // SAFETY: the pointers the shaper installed, called as the inline ibv_wr_* do.
    unsafe {
        let x = &mut *qpx;
        x.wr_start.unwrap()(qpx);
        for (i, half) in [0usize, 128 * 1024].iter().enumerate() {
            x.wr_id = 100 + i as u64;
            x.wr_flags = IBV_SEND_SIGNALED;
            x.wr_rdma_write.unwrap()(qpx, RKEY, dst.as_mut_ptr() as u64 + *half as u64);
            x.wr_set_sge.unwrap()(qpx, 1, src.as_ptr() as u64 + *half as u64, 128 * 1024);
        }
        assert_eq!(x.wr_complete.unwrap()(qpx), 0);
    }
    let log = dev.log();
    assert_eq!(log.len(), 4, "two requests of two chunks each");
    assert!(
        log.iter().all(|w| ![100, 101].contains(&w.wr_id)),
        "every WQE carries a tag"
    );
    dev.execute_all(qp);
    let mut wc = [ibv_wc::default(); 8];
    // SAFETY: a live CQ with room for 8.
    let n = unsafe { ops::poll_cq(cq, 8, wc.as_mut_ptr()) };
    assert_eq!(n, 2);
    assert_eq!((wc[0].wr_id, wc[1].wr_id), (100, 101));
    assert_eq!(src, dst);
    // A batch larger than the free capacity is refused whole.
    // SAFETY: as above.
    unsafe {
        let x = &mut *qpx;
        x.wr_start.unwrap()(qpx);
        for _ in 0..33 {
            x.wr_rdma_write.unwrap()(qpx, RKEY, dst.as_mut_ptr() as u64);
            x.wr_set_sge.unwrap()(qpx, 1, src.as_ptr() as u64, 8);
        }
        assert_eq!(x.wr_complete.unwrap()(qpx), libc::ENOMEM);
    }
    assert_eq!(dev.log().len(), 4);
    forget(&dev, &[qp], cq);
}

/// A latency process's requests posted through `ibv_wr_*` (perftest's default on rxe) are
/// timed as its `ibv_post_send` ones are: the candidate's `wr_id` and flags are read where
/// the application put them, and the poll that returns its completion ends its timing.
#[test]
fn a_latency_process_times_its_wr_requests() {
    use crate::engine::qp::TIMED_STRIDE;
    let (engine, dev, cq, qp) = ex_rig(&[("JUSTITIA_CLASS", "latency")], 8, 1);
    let qpx = qp.cast::<ibv_qp_ex>();
    let trips = engine
        .round_trips()
        .expect("a latency process times round trips");
    trips.set_wanted(true);
    let src = pattern(64, 19);
    let mut dst = vec![0u8; 64];
    for wr_id in 0..2 * TIMED_STRIDE {
        // SAFETY: the installed pointers, as the inline ibv_wr_* call them.
        unsafe {
            let x = &mut *qpx;
            x.wr_start.unwrap()(qpx);
            x.wr_id = wr_id;
            x.wr_flags = IBV_SEND_SIGNALED;
            x.wr_rdma_write.unwrap()(qpx, RKEY, dst.as_mut_ptr() as u64);
            x.wr_set_sge.unwrap()(qpx, 1, src.as_ptr() as u64, 64);
            assert_eq!(x.wr_complete.unwrap()(qpx), 0);
        }
        dev.execute_all(qp);
        let mut wc = [ibv_wc::default(); 2];
        // SAFETY: a live CQ with room for 2.
        assert_eq!(unsafe { ops::poll_cq(cq, 2, wc.as_mut_ptr()) }, 1);
        assert_eq!(wc[0].wr_id, wr_id);
    }
    assert_eq!(
        trips.take().map(|t| u64::from(t.0)),
        Some(2),
        "one in the stride"
    );
    assert_eq!(src, dst);
    forget(&dev, &[qp], cq);
}

#[test]
fn observed_wr_batches_reach_the_provider_and_are_counted() {
    let (engine, dev, cq, qp) = ex_rig(&[], 8, 1);
    let qpx = qp.cast::<ibv_qp_ex>();
    let src = pattern(1 << 20, 18);
    let mut dst = vec![0u8; 1 << 20];
    // SAFETY: the installed pointers.
    unsafe {
        let x = &mut *qpx;
        x.wr_start.unwrap()(qpx);
        x.wr_id = 5;
        x.wr_flags = IBV_SEND_SIGNALED;
        x.wr_rdma_write.unwrap()(qpx, RKEY, dst.as_mut_ptr() as u64);
        x.wr_set_sge.unwrap()(qpx, 1, src.as_ptr() as u64, 1 << 20);
        assert_eq!(x.wr_complete.unwrap()(qpx), 0);
    }
    assert_eq!(
        dev.log().len(),
        1,
        "forwarded whole to the provider's own wr_*"
    );
    dev.execute_all(qp);
    assert_eq!(src, dst);
    let stats = engine.stats();
    assert_eq!((stats.requests, stats.bytes), (1, 1 << 20));
    forget(&dev, &[qp], cq);
}

#[test]
fn extended_cq_polling_hides_internal_entries_and_rewrites_the_length() {
    let clock = Arc::new(VirtualClock::new());
    let engine = engine_from(
        lookup(&[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")]),
        clock,
        PacerMode::Manual,
    )
    .unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: fresh mock context.
    unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) };
    let mut cq_attr = ibv_cq_init_attr_ex {
        cqe: 64,
        wc_flags: u64::from(IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_BYTE_LEN),
        ..Default::default()
    };
    // SAFETY: a live context, through the shaper's create_cq_ex.
    let cqx = unsafe { ops::create_cq_ex(ctx, &mut cq_attr) };
    let cq = cqx.cast::<ibv_cq>();
    let qp = create_qp(
        &dev,
        ibv_qp_init_attr {
            sq_sig_all: 1,
            ..qp_attr(cq, 16)
        },
    );
    let src = pattern(4096, 19);
    let mut dst = vec![0u8; 4096];
    let mut s = [sge(&src, 0, 4096)];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 31, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(post_on(qp, &mut w), 0);
    dev.execute_all(qp);
    let mut seen = Vec::new();
    // SAFETY: the installed poll pointers, used as the inline ibv_start_poll & co.
    unsafe {
        let c = &mut *cqx;
        let mut attr = ibv_poll_cq_attr::default();
        let mut rc = c.start_poll.unwrap()(cqx, &mut attr);
        if rc == 0 {
            while rc == 0 {
                seen.push(((*cqx).wr_id, (*cqx).status, c.read_byte_len.unwrap()(cqx)));
                rc = c.next_poll.unwrap()(cqx);
            }
            c.end_poll.unwrap()(cqx);
        }
    }
    assert_eq!(seen, [(31, IBV_WC_SUCCESS, 4096)]);
    assert_eq!(src, dst);
    forget(&dev, &[qp], std::ptr::null_mut());
}

#[test]
fn notify_requests_reach_the_provider() {
    let r = rig(BANDWIDTH_64K);
    // SAFETY: a live CQ.
    assert_eq!(unsafe { ops::req_notify_cq(r.cq, 0) }, 0);
    assert_eq!(r.dev.notify_calls(), 1);
}

#[test]
fn bad_settings_turn_the_shaper_off_instead_of_failing() {
    let clock = Arc::new(VirtualClock::new());
    for (var, value) in [
        ("JUSTITIA_CLASS", "mouse"),
        ("JUSTITIA_RATE", "fast"),
        ("JUSTITIA_CHUNK", "-1"),
        ("JUSTITIA_POLICY", "x"),
    ] {
        assert!(engine_from(lookup(&[(var, value)]), clock.clone(), PacerMode::Manual).is_none());
    }
    // An application on a device whose open found no engine runs on the provider alone.
    let dev = MockDevice::new();
    let cq = dev.create_cq();
    let qp = dev.create_qp(&mut qp_attr(cq, 4));
    let src = pattern(1 << 16, 20);
    let mut dst = vec![0u8; 1 << 16];
    let mut s = [sge(&src, 0, src.len())];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
    assert_eq!(post_on(qp, &mut w), 0);
    dev.execute_all(qp);
    assert_eq!(dev.log().len(), 1);
    assert_eq!(src, dst);
}

#[test]
fn the_pacer_thread_posts_what_waits_for_tokens() {
    let engine = engine_from(
        lookup(&[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "16K"),
            ("JUSTITIA_RATE", "2M"),
        ]),
        Arc::new(crate::clock::MonotonicClock::new()),
        PacerMode::Thread,
    )
    .unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: a fresh mock context.
    unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) };
    let cq = dev.create_cq();
    // SAFETY: just created.
    unsafe { on_create_cq(ctx, cq) };
    let qp = create_qp(&dev, qp_attr(cq, 64));
    let src = pattern(200_000, 21);
    let mut dst = vec![0u8; 200_000];
    let mut s = [sge(&src, 0, src.len())];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 1, &mut s, dst.as_mut_ptr() as u64, true);
    let start = std::time::Instant::now();
    assert_eq!(post_on(qp, &mut w), 0);
    let chunks = 200_000usize.div_ceil(16 * 1024);
    assert!(dev.log().len() < chunks, "the rest waits for tokens");
    // No poll until every chunk is out: a poll would release paced chunks itself, so only
    // the pacer thread can have posted them.
    while dev.log().len() < chunks && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = start.elapsed();
    assert_eq!(
        dev.log().len(),
        chunks,
        "the pacer thread posted every chunk"
    );
    // 200 kB at 2 MB/s is 100 ms. The pacer's burst is two 16 KiB chunks (at 2 MB/s, its
    // 100 us window is 200 B), so the 13th and last chunk goes when 12 chunks less the burst have accrued:
    // (196 608 - 32 768) B / 2 MB/s = 81.9 ms.
    assert!(took >= Duration::from_millis(80), "{took:?}");
    dev.execute_all(qp);
    let mut wc = [ibv_wc::default(); 2];
    // SAFETY: a live CQ with room for two.
    let n = unsafe { ops::poll_cq(cq, 2, wc.as_mut_ptr()) };
    assert_eq!((n, wc[0].wr_id, wc[0].byte_len), (1, 1, 200_000));
    assert_eq!(src, dst);
    forget(&dev, &[qp], std::ptr::null_mut());
}

/// An application that posts and then waits without polling leaves the releasing to the
/// pacer thread, whose timed wait returns up to the kernel's timer slack (50 us by default)
/// after the deadline. At 1 GB/s with 5 KiB chunks, 50 us is 50 kB: a burst of two chunks
/// (10 KiB) let each late wake-up release only the burst and one chunk, about a quarter of
/// the rate. With a burst window as long as the thread's release granularity, each wake-up
/// releases what accrued since the last, and the flow holds its rate. The queue is deep
/// enough (4096 WQEs, 20 MB) that its slots never run out within the 10 ms measured here,
/// so only the pacer can hold the flow back.
#[test]
fn the_pacer_thread_alone_holds_a_bandwidth_flow_at_its_rate() {
    let r = rig_with(
        &[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_CHUNK", "5K"),
            ("JUSTITIA_RATE", "1G"),
        ],
        4096,
        false,
    );
    let len = 1 << 20;
    let src = pattern(len, 23);
    let mut dst = vec![0u8; len];
    let remote = dst.as_mut_ptr() as u64;
    // 12 MiB waiting, more than 10 ms at the rate; one signaled request at the end.
    for id in 0..12u64 {
        let mut s = [sge(&src, 0, len)];
        let mut w = [rdma(IBV_WR_RDMA_WRITE, id, &mut s, remote, id == 11)];
        assert_eq!(r.post(&mut w).0, 0);
    }
    // The pacer thread, as the kernel runs it: it wakes one timer slack after each
    // deadline, releases what is due, and the NIC executes what was posted. No poll.
    let slack = Duration::from_micros(50);
    let horizon = Duration::from_millis(10);
    let mut last = Duration::ZERO;
    while let Some(at) = r.engine.pacer_tick(r.clock.now()) {
        r.dev.execute_all(r.qp);
        last = r.clock.now();
        if at + slack > horizon {
            break;
        }
        r.clock.set(at + slack);
    }
    assert!(last >= Duration::from_millis(9), "stopped at {last:?}");
    let bytes: u64 = r.log().iter().map(PostedWr::len).sum();
    let rate = bytes as f64 / last.as_secs_f64();
    // At least 97 % of 1 GB/s; and never past the rate by more than the burst (the 100 us
    // release window at the rate, 100 kB) and a chunk.
    assert!(
        rate >= 0.97e9,
        "the pacer thread alone released {rate:.3e} B/s"
    );
    assert!(
        bytes as f64 <= 1e9 * last.as_secs_f64() + 100e3 + 5120.0 + 1.0,
        "{bytes} B by {last:?}"
    );
}
