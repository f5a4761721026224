//! The shaper's fail-open paths (a panic on the post path, a QP map with no room), the
//! reentrancy guard, and automatic classification, against the mock provider.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::{forget, pattern, rdma, rig, rig_with, sge, Rig, RKEY};
use crate::clock::Clock;
use crate::engine::fault::{self, PostFault};
use crate::engine::{self, Engine, QpInit, QpShared};
use crate::exports::{on_create_cq, on_create_qp};
use crate::ffi::Reentry;
use crate::mock::MockDevice;
use crate::registry::PtrMap;

const SPLIT_1K: &[(&str, &str)] = &[("JUSTITIA_CLASS", "bandwidth"), ("JUSTITIA_CHUNK", "1K")];

fn ids(wcs: &[ibv_wc]) -> Vec<u64> {
    wcs.iter().map(|w| w.wr_id).collect()
}

/// Three signaled 4 KiB WRITEs from `src` to consecutive places of `remote`, ids 0, 1, 2.
fn three_writes(src: &[u8], remote: u64, sges: &mut [[ibv_sge; 1]; 3]) -> Vec<ibv_send_wr> {
    sges.iter_mut()
        .enumerate()
        .map(|(i, s)| {
            s[0] = sge(src, i * 4096, 4096);
            rdma(
                IBV_WR_RDMA_WRITE,
                i as u64,
                s,
                remote + i as u64 * 4096,
                true,
            )
        })
        .collect()
}

/// The shaper panicked after posting part of a list (the first request's 4 chunks and 2
/// of the second's fill the 6-deep hardware queue). The fallback used to post the whole
/// list again to the provider; now the requests with WQEs out stay the shaper's and go out
/// once, the rest is refused with EIO at the first request not taken, and the QP's posts
/// pass through from then on.
#[test]
fn a_panic_after_posting_part_of_a_list_refuses_only_the_rest() {
    let r = rig_with(SPLIT_1K, 6, false);
    let src = pattern(3 * 4096, 60);
    let mut dst = vec![0u8; 3 * 4096];
    let mut sges = [[ibv_sge::default(); 1]; 3];
    let mut wrs = three_writes(&src, dst.as_mut_ptr() as u64, &mut sges);
    fault::inject(PostFault::AfterDrain);
    assert_eq!(r.post(&mut wrs), (libc::EIO, Some(2)));
    assert_eq!(r.log().len(), 6, "nothing posted twice");
    // The second request's last chunks follow as completions free slots.
    assert_eq!(ids(&r.run()), [0, 1]);
    assert_eq!(r.log().len(), 8);
    // The application posts the refused request again: it passes through whole.
    let mut retry = [wrs[2]];
    assert_eq!(r.post(&mut retry), (0, None));
    let log = r.log();
    assert_eq!(log.len(), 9);
    assert_eq!((log[8].wr_id, log[8].len()), (2, 4096));
    assert_eq!(ids(&r.run()), [2]);
    let mut ranges: Vec<(u64, u64)> = log.iter().map(|w| (w.remote_addr, w.len())).collect();
    ranges.sort_unstable();
    ranges.dedup();
    assert_eq!(ranges.len(), log.len(), "every byte written once");
    assert_eq!(src, dst);
    let stats = r.engine.stats();
    assert_eq!((stats.requests, stats.split_requests), (3, 2));
}

/// A panic before anything of the list was posted: all of it is refused (nothing is held),
/// and posted again it passes through whole.
#[test]
fn a_panic_before_posting_refuses_the_whole_list() {
    let r = rig(SPLIT_1K);
    let src = pattern(3 * 4096, 61);
    let mut dst = vec![0u8; 3 * 4096];
    let mut sges = [[ibv_sge::default(); 1]; 3];
    let mut wrs = three_writes(&src, dst.as_mut_ptr() as u64, &mut sges);
    fault::inject(PostFault::BeforeAccept(2));
    assert_eq!(r.post(&mut wrs), (libc::EIO, Some(0)));
    assert!(r.log().is_empty());
    assert_eq!(r.post(&mut wrs), (0, None));
    assert_eq!(
        r.log()
            .iter()
            .map(|w| (w.wr_id, w.len()))
            .collect::<Vec<_>>(),
        [(0, 4096), (1, 4096), (2, 4096)]
    );
    assert_eq!(ids(&r.run()), [0, 1, 2]);
    assert_eq!(src, dst);
}

/// A panic after the call settled (every request taken, the first chunk out, the rest
/// waiting for tokens) but before the pacer was told: the call succeeds, and the shaper
/// still releases what it holds, at the rate.
#[test]
fn a_panic_after_the_call_settled_keeps_the_list_and_still_paces_it() {
    let r = rig(&[
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_CHUNK", "1K"),
        ("JUSTITIA_RATE", "1M"),
    ]);
    let src = pattern(3 * 4096, 62);
    let mut dst = vec![0u8; 3 * 4096];
    let mut sges = [[ibv_sge::default(); 1]; 3];
    let mut wrs = three_writes(&src, dst.as_mut_ptr() as u64, &mut sges);
    fault::inject(PostFault::AfterSettled);
    assert_eq!(r.post(&mut wrs), (0, None));
    // The pacer's burst is two 1 KiB chunks: they and the chunk that overdraws it go.
    assert_eq!(r.log().len(), 3, "the rest waits for tokens");
    let mut seen = Vec::new();
    while seen.len() < 3 && r.clock.now() < Duration::from_secs(1) {
        r.clock.advance(Duration::from_millis(1));
        r.engine.pacer_tick(r.clock.now());
        seen.extend(r.run());
    }
    assert_eq!(ids(&seen), [0, 1, 2]);
    assert_eq!(r.log().len(), 12, "each request's 4 chunks, once");
    // The last chunk goes once 11 chunks less the 2 KiB burst have accrued at 1 MB/s:
    // 9.2 ms (the virtual clock steps by 1 ms).
    assert!(r.clock.now() >= Duration::from_millis(10), "paced");
    assert_eq!(src, dst);
    // From now on the QP's posts pass through: whole and unpaced.
    let mut s = [sge(&src, 0, 4096)];
    let mut w = [rdma(
        IBV_WR_RDMA_WRITE,
        9,
        &mut s,
        dst.as_mut_ptr() as u64,
        true,
    )];
    assert_eq!(r.post(&mut w), (0, None));
    assert_eq!(r.log().len(), 13);
    assert_eq!(ids(&r.run()), [9]);
}

/// An engine with `vars` on a fresh mock device with one registered CQ.
fn device(vars: &[(&str, &str)]) -> (MockDevice, Arc<Engine>, *mut ibv_cq) {
    let (engine, dev) = super::attached(vars);
    let cq = dev.create_cq();
    // SAFETY: cq was just created on the context.
    unsafe { on_create_cq(dev.context(), cq) };
    (dev, engine, cq)
}

/// Writes `len` bytes of `src` to `remote` with the `ibv_wr_*` verbs installed in `qp`,
/// signaled, as one batch; returns what `ibv_wr_complete` returned.
fn wr_write(qp: *mut ibv_qp, wr_id: u64, src: &[u8], remote: u64) -> c_int {
    let qpx = qp.cast::<ibv_qp_ex>();
    // SAFETY: the pointers in a live extended QP, called as the inline ibv_wr_* do.
    unsafe {
        let x = &mut *qpx;
        x.wr_start.unwrap()(qpx);
        x.wr_id = wr_id;
        x.wr_flags = IBV_SEND_SIGNALED;
        x.wr_rdma_write.unwrap()(qpx, RKEY, remote);
        x.wr_set_sge.unwrap()(qpx, 1, src.as_ptr() as u64, src.len() as u32);
        x.wr_complete.unwrap()(qpx)
    }
}

/// Attributes of an RC QP with the `ibv_wr_*` send operations, for `create_qp_ex`.
fn rc_ex_attr(cq: *mut ibv_cq) -> ibv_qp_init_attr_ex {
    ibv_qp_init_attr_ex {
        send_cq: cq,
        recv_cq: cq,
        qp_type: IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: 16,
            max_send_sge: 1,
            ..Default::default()
        },
        comp_mask: IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        ..Default::default()
    }
}

fn rc_attr(cq: *mut ibv_cq, qp_type: ibv_qp_type) -> ibv_qp_init_attr {
    ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        qp_type,
        cap: ibv_qp_cap {
            max_send_wr: 16,
            max_send_sge: 1,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn init_of(a: &ibv_qp_init_attr) -> QpInit {
    QpInit {
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        qp_type: a.qp_type,
        sig_all: a.sq_sig_all != 0,
        cap: a.cap,
        shapable: true,
        has_srq: !a.srq.is_null(),
    }
}

/// A QP that finds the QP map full used to get the shaper's `ibv_wr_*` verbs anyway, which
/// found no state and dropped the requests (`ibv_wr_complete` returned EINVAL). It must
/// pass through untouched.
#[test]
fn a_qp_the_map_has_no_room_for_passes_through_untouched() {
    let (dev, _engine, cq) = device(SPLIT_1K);
    let ctx = engine::context(dev.context()).unwrap();
    let map: PtrMap<QpShared, 2> = PtrMap::new();
    // Two observed QPs fill the map (UD: not shaped, so their CQ knows nothing of them).
    let mut fillers = Vec::new();
    for _ in 0..2 {
        let mut a = rc_attr(cq, IBV_QPT_UD);
        let q = dev.create_qp(&mut a);
        // SAFETY: just created on the context.
        assert!(unsafe {
            crate::install::register_qp_in(&map, ctx, q, init_of(&a), std::ptr::null_mut())
        });
        fillers.push(q);
    }
    // A shaped QP with ibv_wr_* send operations finds no room.
    let mut a = rc_attr(cq, IBV_QPT_RC);
    let qp = dev.create_qp(&mut a);
    // SAFETY: just created; the mock allocates every QP as an extended one.
    let registered = unsafe {
        crate::install::register_qp_in(&map, ctx, qp, init_of(&a), qp.cast::<ibv_qp_ex>())
    };
    assert!(!registered);
    assert_eq!(engine::cq(cq).unwrap().shaped.load(Ordering::Relaxed), 0);
    let src = pattern(8192, 63);
    let mut dst = vec![0u8; 8192];
    let remote = dst.as_mut_ptr() as u64;
    assert_eq!(wr_write(qp, 1, &src[..4096], remote), 0);
    let mut s = [sge(&src, 4096, 4096)];
    let mut w = rdma(IBV_WR_RDMA_WRITE, 2, &mut s, remote + 4096, true);
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live QP and a valid request.
    assert_eq!(unsafe { ops::post_send(qp, &mut w, &mut bad) }, 0);
    assert_eq!(
        dev.log()
            .iter()
            .map(|w| (w.wr_id, w.len()))
            .collect::<Vec<_>>(),
        [(1, 4096), (2, 4096)],
        "whole, through the provider's own verbs"
    );
    dev.execute_all(qp);
    let mut wc = [ibv_wc::default(); 4];
    // SAFETY: a live CQ with room for 4.
    let n = unsafe { ops::poll_cq(cq, 4, wc.as_mut_ptr()) };
    assert_eq!(ids(&wc[..n as usize]), [1, 2]);
    assert_eq!(src, dst);
    for q in fillers {
        let token = map.get(q.cast()).unwrap();
        assert!(map.remove(q.cast(), token).is_some());
    }
    forget(&dev, &[qp], cq);
}

/// A QP that libibverbs or a provider creates while the shaper is inside a real verb (the
/// reentrancy guard is held) is the provider's business: not registered, its `ibv_wr_*`
/// verbs left alone.
#[test]
fn a_qp_created_inside_the_shaper_is_not_registered() {
    let (dev, _engine, cq) = device(SPLIT_1K);
    let ctx = dev.context();
    let mut attr = rc_ex_attr(cq);
    let inside = {
        let _guard = Reentry::enter().unwrap();
        // SAFETY: a live context, through the shaper's create_qp_ex.
        unsafe { ops::create_qp_ex(ctx, &mut attr) }
    };
    assert!(!inside.is_null());
    assert!(engine::qp_token(inside).is_none(), "not registered");
    let src = pattern(4096, 64);
    let mut dst = vec![0u8; 4096];
    assert_eq!(wr_write(inside, 1, &src, dst.as_mut_ptr() as u64), 0);
    assert_eq!(
        dev.log().len(),
        1,
        "whole, through the provider's own verbs"
    );
    // The same call outside the guard registers the QP and shapes it.
    // SAFETY: as above.
    let outside = unsafe { ops::create_qp_ex(ctx, &mut attr) };
    assert!(engine::qp_token(outside).is_some());
    assert_eq!(wr_write(outside, 2, &src, dst.as_mut_ptr() as u64), 0);
    assert_eq!(dev.log().len(), 1 + 4, "split into 1 KiB chunks");
    forget(&dev, &[inside, outside], cq);
}

/// `JUSTITIA_CLASS=auto`: the core classifier decides each QP's class from its first
/// evidence. 1 MB WRITEs make a bandwidth flow, split and paced; 16 B WRITEs on another
/// QP of the same device make a latency flow, posted whole and at once although the
/// bandwidth flow has emptied the (process-wide) rate pacer's balance.
#[test]
fn auto_class_splits_large_writes_and_passes_small_ones_whole() {
    let r: Rig = rig(&[
        ("JUSTITIA_CLASS", "auto"),
        ("JUSTITIA_CHUNK", "64K"),
        ("JUSTITIA_RATE", "10M"),
    ]);
    let mut attr = rc_attr(r.cq, IBV_QPT_RC);
    let small = r.dev.create_qp(&mut attr);
    // SAFETY: just created with attr.
    unsafe { on_create_qp(small, &attr) };
    // SAFETY: live QPs.
    let (big_num, small_num) = unsafe { ((*r.qp).qp_num, (*small).qp_num) };
    let src = pattern(1 << 20, 65);
    let mut dst = vec![0u8; 1 << 20];
    let remote = dst.as_mut_ptr() as u64;
    let mut s = [sge(&src, 0, src.len())];
    assert_eq!(
        r.post(&mut [rdma(IBV_WR_RDMA_WRITE, 1, &mut s, remote, true)]),
        (0, None)
    );
    assert_eq!(
        r.log().len(),
        3,
        "the burst (two 64 KiB chunks) and the chunk that overdraws it, the rest paced"
    );
    let mut small_dst = vec![0u8; 64];
    let mut ss: Vec<[ibv_sge; 1]> = (0..4).map(|i| [sge(&src, i * 16, 16)]).collect();
    let mut small_wrs: Vec<ibv_send_wr> = ss
        .iter_mut()
        .enumerate()
        .map(|(i, s)| {
            let to = small_dst.as_mut_ptr() as u64 + i as u64 * 16;
            rdma(IBV_WR_RDMA_WRITE, 10 + i as u64, s, to, true)
        })
        .collect();
    for i in 1..small_wrs.len() {
        let next: *mut ibv_send_wr = &mut small_wrs[i];
        small_wrs[i - 1].next = next;
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live QP and a valid list.
    assert_eq!(
        unsafe { ops::post_send(small, small_wrs.as_mut_ptr(), &mut bad) },
        0
    );
    let on = |num: u32| -> Vec<(u64, u64)> {
        r.log()
            .iter()
            .filter(|w| w.qp_num == num)
            .map(|w| (w.wr_id, w.len()))
            .collect()
    };
    assert_eq!(
        on(small_num)
            .iter()
            .map(|&(_, len)| len)
            .collect::<Vec<_>>(),
        [16, 16, 16, 16],
        "whole and unpaced"
    );
    let mut seen = Vec::new();
    while seen.len() < 5 && r.clock.now() < Duration::from_secs(1) {
        r.engine.pacer_tick(r.clock.now());
        r.dev.execute_all(r.qp);
        r.dev.execute_all(small);
        seen.extend(r.poll());
        r.clock.advance(Duration::from_micros(100));
    }
    let mut got = ids(&seen);
    got.sort_unstable();
    assert_eq!(got, [1, 10, 11, 12, 13]);
    let big = on(big_num);
    assert_eq!(big.len(), 16, "split into 64 KiB chunks");
    assert!(big.iter().all(|&(_, len)| len == 65_536));
    assert_eq!(src, dst);
    assert_eq!(&small_dst[..], &src[..64]);
    let stats = r.engine.stats();
    assert_eq!((stats.requests, stats.split_requests), (5, 1));
    if let Some(t) = engine::qp_token(small) {
        engine::unregister_qp(small, t);
    }
}

/// A panic inside `ibv_wr_complete` used to refuse the batch and leave the QP shaped, with
/// whatever the panic left behind. Now the batch is refused with nothing of it posted, and
/// the QP fails open: the next batch goes out whole, unsplit.
#[test]
fn a_panic_in_a_wr_batch_refuses_it_and_the_qp_passes_through() {
    let (dev, _engine, cq) = device(SPLIT_1K);
    let mut attr = rc_ex_attr(cq);
    // SAFETY: a live context, through the shaper's create_qp_ex.
    let qp = unsafe { ops::create_qp_ex(dev.context(), &mut attr) };
    assert!(!qp.is_null());
    let src = pattern(8192, 64);
    let mut dst = vec![0u8; 8192];
    let remote = dst.as_mut_ptr() as u64;
    fault::inject(PostFault::BeforeAccept(0));
    assert_eq!(wr_write(qp, 1, &src[..4096], remote), libc::EIO);
    assert!(
        dev.log().is_empty(),
        "nothing of the refused batch is posted"
    );
    assert_eq!(wr_write(qp, 2, &src[4096..], remote + 4096), 0);
    assert_eq!(
        dev.log().iter().map(|w| w.len()).collect::<Vec<_>>(),
        [4096],
        "whole: the QP no longer splits"
    );
    dev.execute_all(qp);
    assert_eq!(src[4096..], dst[4096..]);
    forget(&dev, &[qp], cq);
}
