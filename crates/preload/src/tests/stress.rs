//! Many threads through the exported hooks at once, against the mock provider: posters on
//! QPs that share CQs, pollers of those CQs, a thread playing the hardware, and the pacer
//! thread, while QPs are moved to the error state, destroyed and created again. Every
//! signaled request completes exactly once with its own `wr_id` (success, or a flush error
//! after the move to the error state); none completes twice, no tag reaches a poller, no
//! post reaches a destroyed QP, and the whole run ends within its deadline.
//!
//! Also the test the sanitizer step of `scripts/test.sh` runs (AddressSanitizer, which
//! sees a use after free of a QP's or CQ's state, or of the mock's objects).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use justitia_verbs::ops;
use justitia_verbs::sys::*;

use super::{forget, lookup, qp_attr, rdma, sge};
use crate::clock::MonotonicClock;
use crate::engine::{self, PacerMode};
use crate::exports::{engine_from, on_create_cq, on_create_qp};
use crate::mock::MockDevice;

/// Posting threads, each with one QP at a time.
const POSTERS: usize = 4;
/// CQs, each shared by `POSTERS / CQS` QPs and polled by two threads.
const CQS: usize = 2;
/// QP incarnations per poster (each created, used, then destroyed).
const ROUNDS: u64 = 6;
/// Requests per incarnation.
const REQUESTS: u64 = 40;
/// The whole run's deadline: a hang fails the test instead of stalling the suite.
const DEADLINE: Duration = Duration::from_secs(60);

/// A `wr_id` the test gives: poster, round and request in distinct bits (never a tag,
/// which is an address in the shaper's heap, well above these).
fn wr_id(poster: usize, round: u64, i: u64) -> u64 {
    (poster as u64) << 24 | round << 12 | i
}

#[test]
fn posters_pollers_and_the_pacer_on_shared_cqs_with_errors_and_destroys() {
    let vars = [
        ("JUSTITIA_CLASS", "bandwidth"),
        ("JUSTITIA_CHUNK", "4K"),
        ("JUSTITIA_RATE", "400M"),
        ("JUSTITIA_DAEMON", "off"),
    ];
    let engine = engine_from(
        lookup(&vars),
        Arc::new(MonotonicClock::new()),
        PacerMode::Thread,
    )
    .unwrap();
    let dev = MockDevice::new();
    let ctx = dev.context();
    // SAFETY: a fresh mock context.
    assert!(unsafe { crate::install::attach_context(ctx, Arc::clone(&engine)) });
    let cqs: Vec<usize> = (0..CQS)
        .map(|_| {
            let cq = dev.create_cq_on(std::ptr::null_mut());
            dev.set_cq_size(cq, 4096);
            // SAFETY: cq was just created on ctx.
            unsafe { on_create_cq(ctx, cq) };
            cq as usize
        })
        .collect();
    // The QPs alive now, for the hardware thread.
    let live: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    // Completions seen by the pollers: wr_id -> (times, last status).
    let seen: Mutex<HashMap<u64, (u32, u32)>> = Mutex::new(HashMap::new());
    let stop = AtomicBool::new(false);
    let unknown = AtomicU64::new(0);
    let start = Instant::now();
    let src = vec![0x5au8; 64 << 10];
    let dst_len = 64 << 10;

    std::thread::scope(|s| {
        // The hardware: runs a few WQEs of every live QP at a time.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let qps = live.lock().unwrap().clone();
                for qp in qps {
                    dev.execute(qp as *mut ibv_qp, 3);
                }
                std::thread::yield_now();
            }
        });
        // Two pollers per CQ.
        for &cq in cqs.iter().chain(cqs.iter()) {
            let (seen, stop, unknown) = (&seen, &stop, &unknown);
            s.spawn(move || {
                let mut buf = [ibv_wc::default(); 8];
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: a live CQ, room for 8 entries.
                    let n = unsafe { ops::poll_cq(cq as *mut ibv_cq, 8, buf.as_mut_ptr()) };
                    assert!(n >= 0, "poll failed: {n}");
                    let mut seen = seen.lock().unwrap();
                    for wc in &buf[..n as usize] {
                        if wc.wr_id >= 1 << 40 {
                            unknown.fetch_add(1, Ordering::Relaxed);
                        }
                        let e = seen.entry(wc.wr_id).or_insert((0, 0));
                        e.0 += 1;
                        e.1 = wc.status;
                    }
                    drop(seen);
                    if n == 0 {
                        std::thread::yield_now();
                    }
                }
            });
        }
        // The posters: each creates a QP, posts, sometimes moves it to the error state,
        // waits for every completion, destroys it, and starts again.
        let posters: Vec<_> = (0..POSTERS)
            .map(|p| {
                let (dev, live, seen, src, cqs) = (&dev, &live, &seen, &src, &cqs);
                s.spawn(move || {
                    let mut dst = vec![0u8; dst_len];
                    let cq = cqs[p % CQS] as *mut ibv_cq;
                    for round in 0..ROUNDS {
                        let mut attr = qp_attr(cq, 8);
                        let qp = dev.create_qp(&mut attr);
                        // SAFETY: qp was just created with attr.
                        unsafe { on_create_qp(qp, &attr) };
                        live.lock().unwrap().push(qp as usize);
                        let to_error_at = (round % 2 == 1).then_some(REQUESTS / 2);
                        let mut posted = Vec::new();
                        for i in 0..REQUESTS {
                            if to_error_at == Some(i) {
                                dev.set_error(qp);
                                let attr = ibv_qp_attr {
                                    qp_state: IBV_QPS_ERR,
                                    ..Default::default()
                                };
                                engine::qp(qp).unwrap().on_modify(&attr, IBV_QP_STATE);
                            }
                            let len = [100usize, 3000, 9000, 40_000][(i % 4) as usize];
                            let mut s1 = [sge(src, 0, len)];
                            let id = wr_id(p, round, i);
                            let mut w = rdma(
                                IBV_WR_RDMA_WRITE,
                                id,
                                &mut s1,
                                dst.as_mut_ptr() as u64,
                                true,
                            );
                            loop {
                                let mut bad = std::ptr::null_mut();
                                // SAFETY: a live QP, one request whose SGE lives for the call.
                                let rc = unsafe { ops::post_send(qp, &mut w, &mut bad) };
                                if rc == 0 {
                                    posted.push(id);
                                    break;
                                }
                                assert_eq!(rc, libc::ENOMEM, "post {id:#x}");
                                assert!(start.elapsed() < DEADLINE, "a full queue never drained");
                                std::thread::yield_now();
                            }
                        }
                        // Every request completes (a flush error after the move to ERR).
                        while !posted
                            .iter()
                            .all(|id| seen.lock().unwrap().contains_key(id))
                        {
                            assert!(
                                start.elapsed() < DEADLINE,
                                "poster {p} round {round}: completions missing"
                            );
                            std::thread::yield_now();
                        }
                        live.lock().unwrap().retain(|&q| q != qp as usize);
                        let rc = engine::destroy_qp(qp, || {
                            dev.destroy_qp(qp);
                            0
                        });
                        assert_eq!(rc, 0);
                    }
                })
            })
            .collect();
        // The pollers and the hardware run until told to stop: told before a poster's
        // failure is passed on, so that it fails the test instead of hanging it.
        let results: Vec<_> = posters.into_iter().map(|p| p.join()).collect();
        stop.store(true, Ordering::Relaxed);
        for result in results {
            if let Err(panic) = result {
                std::panic::resume_unwind(panic);
            }
        }
    });

    let seen = seen.into_inner().unwrap();
    assert_eq!(unknown.load(Ordering::Relaxed), 0, "a tag reached a poller");
    let mut errors = 0;
    for p in 0..POSTERS {
        for round in 0..ROUNDS {
            for i in 0..REQUESTS {
                let id = wr_id(p, round, i);
                let (times, status) = seen.get(&id).copied().unwrap_or((0, 0));
                assert_eq!(times, 1, "request {id:#x} completed {times} times");
                if status != IBV_WC_SUCCESS {
                    assert_eq!(status, IBV_WC_WR_FLUSH_ERR, "request {id:#x}");
                    assert!(
                        round % 2 == 1 && i >= REQUESTS / 2 - 8,
                        "request {id:#x} failed"
                    );
                    errors += 1;
                }
            }
        }
    }
    assert_eq!(
        seen.len() as u64,
        POSTERS as u64 * ROUNDS * REQUESTS,
        "completions of requests never posted"
    );
    assert!(errors > 0, "the moves to the error state flushed nothing");
    assert_eq!(
        dev.posts_after_destroy(),
        0,
        "a post reached a destroyed QP"
    );
    for &cq in &cqs {
        forget(&dev, &[], cq as *mut ibv_cq);
    }
}
