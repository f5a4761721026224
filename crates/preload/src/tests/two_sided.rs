//! Splitting two-sided requests between two shaped QPs of this process, connected on the
//! mock provider (whose SENDs consume the peer's receives, and count an RNR when none is
//! posted) and paired by hand, over a side channel that loops back in process.

use std::collections::VecDeque;
use std::sync::Mutex;

use justitia_core::two_sided::SideMessage;

use super::*;
use crate::pairing::{self, Connection, PeerSide, Port, Source};
use crate::remote::End;
use crate::side_channel::{Datagram, SideAddress, SideChannels};

/// The GID both ends of the loop stand at.
const GID: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x22, 0, 1];

/// The side channel's own queue pair number.
const SIDE_QPN: u32 = 0x0051;

/// Datagrams sent come back from the side channel itself; one in `lose_one_in` (0:
/// none), drawn at random from a fixed seed, is lost, as UD may lose them.
#[derive(Debug)]
struct LoopSideChannels {
    queue: Arc<Mutex<VecDeque<Datagram>>>,
    draws: u64,
    lose_one_in: u64,
    /// Every datagram is lost: the other end is gone.
    silent: Arc<std::sync::atomic::AtomicBool>,
}

impl SideChannels for LoopSideChannels {
    fn open(&mut self, _port: &Port) -> Result<SideAddress, String> {
        Ok(SideAddress {
            qpn: SIDE_QPN,
            qkey: crate::side_channel::SIDE_QKEY,
        })
    }

    fn count(&self) -> u32 {
        1
    }

    fn send(
        &mut self,
        port: &Port,
        _sgid_index: u8,
        _to: &justitia_verbs::DatagramDest,
        bytes: &[u8],
    ) -> Result<(), String> {
        // xorshift64: a fixed sequence, so a failure repeats.
        self.draws ^= self.draws << 13;
        self.draws ^= self.draws >> 7;
        self.draws ^= self.draws << 17;
        let silent = self.silent.load(std::sync::atomic::Ordering::Relaxed);
        if silent || (self.lose_one_in != 0 && self.draws.is_multiple_of(self.lose_one_in)) {
            return Ok(());
        }
        self.queue.lock().unwrap().push_back(Datagram {
            source: Source {
                port: port.clone(),
                gid: Some(GID),
                lid: 0,
                qpn: SIDE_QPN,
            },
            bytes: bytes.to_vec(),
        });
        Ok(())
    }

    fn receive(&mut self, max: usize) -> Vec<Datagram> {
        let mut q = self.queue.lock().unwrap();
        let n = q.len().min(max);
        q.drain(..n).collect()
    }
}

/// Two shaped QPs, `a` and `b`, each with its own CQ, connected to each other on one mock
/// device, paired through a looping side channel. `b`'s send completions may go to a CQ
/// of their own (as perftest's SEND tests have it), never polled: `cqs[1]` is then its
/// receive CQ only.
struct Pair {
    _record: std::sync::MutexGuard<'static, ()>,
    dev: MockDevice,
    engine: Arc<Engine>,
    cqs: [*mut ibv_cq; 2],
    /// `b`'s send CQ, when not `cqs[1]`.
    b_send_cq: Option<*mut ibv_cq>,
    qps: [*mut ibv_qp; 2],
    now_ns: u64,
    /// How far the clock moves each step.
    step_ns: u64,
    queue: Arc<Mutex<VecDeque<Datagram>>>,
    silent: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        for qp in self.qps {
            // SAFETY: the mock's live QP.
            pairing::on_destroy(unsafe { (*qp).qp_num });
        }
        forget(&self.dev, &self.qps, self.cqs[0]);
        for cq in [Some(self.cqs[1]), self.b_send_cq].into_iter().flatten() {
            if let Some(t) = engine::cq_token(cq) {
                engine::unregister_cq(cq, t);
            }
        }
    }
}

const CHUNK: u32 = 4096;

impl Pair {
    /// The pair with QPs numbered from `first` (apart from other tests' in the process's
    /// pairing record), `depth` receives deep, losing one datagram in `lose_one_in`; with
    /// `b_send_cq_apart`, `b`'s send completions go to a CQ of their own.
    fn new(first: u32, depth: u32, lose_one_in: u64, b_send_cq_apart: bool) -> Pair {
        let held = pairing_record();
        let (engine, dev) = attached(&[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_TWO_SIDED", "split"),
            ("JUSTITIA_CHUNK", "4096"),
        ]);
        let queue: Arc<Mutex<VecDeque<Datagram>>> = Arc::default();
        let silent: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        engine
            .hold_follower()
            .unwrap()
            .set_side_channels(Box::new(LoopSideChannels {
                queue: Arc::clone(&queue),
                draws: 0x9e37_79b9_7f4a_7c15,
                lose_one_in,
                silent: Arc::clone(&silent),
            }));
        dev.number_qps_from(first);
        let ctx = dev.context();
        let mut cqs = [std::ptr::null_mut(); 2];
        let mut qps = [std::ptr::null_mut(); 2];
        let b_send_cq = b_send_cq_apart.then(|| {
            let cq = dev.create_cq();
            // SAFETY: just created on ctx.
            unsafe { on_create_cq(ctx, cq) };
            cq
        });
        for i in 0..2 {
            cqs[i] = dev.create_cq();
            // SAFETY: just created on ctx.
            unsafe { on_create_cq(ctx, cqs[i]) };
            qps[i] = create_qp(
                &dev,
                ibv_qp_init_attr {
                    send_cq: if i == 1 {
                        b_send_cq.unwrap_or(cqs[i])
                    } else {
                        cqs[i]
                    },
                    recv_cq: cqs[i],
                    qp_type: IBV_QPT_RC,
                    cap: ibv_qp_cap {
                        max_send_wr: 64,
                        max_recv_wr: depth,
                        max_send_sge: 4,
                        max_recv_sge: 4,
                        max_inline_data: 64,
                    },
                    ..Default::default()
                },
            );
        }
        dev.connect(qps[0], qps[1]);
        let port = Port {
            device: "mock0".into(),
            number: 1,
        };
        // SAFETY: the mock's live QPs.
        let nums = unsafe { [(*qps[0]).qp_num, (*qps[1]).qp_num] };
        let mut record = pairing::record();
        for (me, them) in [(nums[0], nums[1]), (nums[1], nums[0])] {
            let c = Connection {
                qpn: me,
                end: End {
                    gid: GID,
                    lid: 0,
                    qpn: them,
                },
                port: port.clone(),
                sgid_index: 0,
            };
            assert!(record.connected(c.clone()));
            record.reported(&c, 0);
            assert!(record.paired(
                me,
                PeerSide {
                    qpn: SIDE_QPN,
                    qkey: crate::side_channel::SIDE_QKEY,
                }
            ));
        }
        drop(record);
        Pair {
            _record: held,
            dev,
            engine,
            cqs,
            b_send_cq,
            qps,
            now_ns: 1_000_000,
            step_ns: 1_000_000,
            queue,
            silent,
        }
    }

    /// [`Pair::new`], run until both ends own their receives (offers and accepts repeat
    /// as they are lost: a message sent whole meanwhile would meet no receive, which the
    /// mock fails at once where a NIC retries it); with the completions polled so far.
    fn agreed(first: u32, depth: u32, lose_one_in: u64) -> (Pair, [Vec<ibv_wc>; 2]) {
        Pair::agreed_on(first, depth, lose_one_in, false)
    }

    /// [`Pair::agreed`], with `b`'s send CQ apart as [`Pair::new`] says.
    fn agreed_on(
        first: u32,
        depth: u32,
        lose_one_in: u64,
        b_send_cq_apart: bool,
    ) -> (Pair, [Vec<ibv_wc>; 2]) {
        let mut pair = Pair::new(first, depth, lose_one_in, b_send_cq_apart);
        let mut got = [Vec::new(), Vec::new()];
        let engine = Arc::clone(&pair.engine);
        pair.run_until(&mut got, |_| engine.stats().qps_owning_receives == 2);
        (pair, got)
    }

    /// One step: the side thread's turn, every queued request executed, both CQs polled
    /// into `got`.
    fn step(&mut self, got: &mut [Vec<ibv_wc>; 2]) {
        self.step_polling(got, [true, true]);
    }

    /// [`Pair::step`], with only the CQs `polled` says polled (an application that does
    /// not poll yet).
    fn step_polling(&mut self, got: &mut [Vec<ibv_wc>; 2], polled: [bool; 2]) {
        self.now_ns += self.step_ns;
        self.engine.side_turn(self.now_ns);
        for (i, qp) in self.qps.iter().enumerate() {
            self.dev.execute_all(*qp);
            if !polled[i] {
                continue;
            }
            let mut wc = [ibv_wc::default(); 16];
            loop {
                // SAFETY: a live CQ and room for 16.
                let n = unsafe { ops::poll_cq(self.cqs[i], 16, wc.as_mut_ptr()) };
                assert!(n >= 0);
                got[i].extend_from_slice(&wc[..n as usize]);
                if n < 16 {
                    break;
                }
            }
        }
    }

    /// Steps until `done` (at most 2000 steps).
    fn run_until(&mut self, got: &mut [Vec<ibv_wc>; 2], done: impl Fn(&[Vec<ibv_wc>; 2]) -> bool) {
        for _ in 0..2000 {
            if done(got) {
                return;
            }
            self.step(got);
        }
        panic!(
            "not done after 2000 steps: {} and {} completions, {:?}",
            got[0].len(),
            got[1].len(),
            self.engine.stats()
        );
    }

    /// Steps 20 ms at a time until A's first completion, which must be `wr_id` failed with
    /// `IBV_WC_RETRY_EXC_ERR` (its shaper gave up on a silent peer); returns how long
    /// that took.
    fn until_given_up(&mut self, got: &mut [Vec<ibv_wc>; 2], wr_id: u64) -> u64 {
        self.step_ns = 20_000_000;
        let started = self.now_ns;
        self.run_until(got, |g| !g[0].is_empty());
        assert_eq!(
            (got[0][0].wr_id, got[0][0].status),
            (wr_id, IBV_WC_RETRY_EXC_ERR)
        );
        self.now_ns - started
    }

    /// Gives QP `qp` the transport timeout perftest sets (`timeout` 14, `retry_cnt` 7:
    /// 0.54 s), as `ibv_modify_qp` to RTS does.
    fn transport_timeout(&self, qp: usize) {
        let attr = ibv_qp_attr {
            timeout: 14,
            retry_cnt: 7,
            ..Default::default()
        };
        engine::qp(self.qps[qp])
            .unwrap()
            .on_modify(&attr, IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT);
    }

    fn post_recv(&self, qp: usize, wr_id: u64, sges: &mut [ibv_sge]) -> c_int {
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: sges.as_mut_ptr(),
            num_sge: sges.len() as c_int,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP, one request.
        unsafe { ops::post_recv(self.qps[qp], &mut wr, &mut bad) }
    }
}

/// Cuts `len` bytes at `offset` of `buf` into up to `parts` SGEs.
fn sges_over(buf: &[u8], offset: usize, len: usize, parts: usize) -> Vec<ibv_sge> {
    let step = len.div_ceil(parts).max(1);
    (0..len)
        .step_by(step)
        .map(|at| sge(buf, offset + at, step.min(len - at)))
        .collect()
}

/// SENDs (some with immediate) of 1 B to 5 chunks and a WRITE with immediate, from
/// scatter lists of up to 3 SGEs into receives of 2 SGEs with slack: once the two ends
/// agree, every message lands whole in its receive, in order, with its length and
/// immediate, the ones longer than a chunk split (and the sender's chunks no longer than
/// one); no RNR is ever caused, and the sender sees one completion per request.
#[test]
fn sends_longer_than_a_chunk_are_split_into_the_receives_the_peer_posted_for_them() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0100, 64, 0);
    let sizes: [usize; 8] = [1, 4096, 4097, 10_000, 20_480, 100, 12_288, 3];
    let total: usize = sizes.iter().sum();
    let src = pattern(total, 7);
    let slack = 64;
    let dst = vec![0u8; total + sizes.len() * slack];
    let mut at = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let room = len + slack;
        let mut sges = sges_over(&dst, at + i * slack, room, 2);
        assert_eq!(pair.post_recv(1, 1000 + i as u64, &mut sges), 0);
        at += len;
    }
    let mut at = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let mut sges = sges_over(&src, at, len, 3);
        let opcode = if i % 3 == 1 {
            IBV_WR_SEND_WITH_IMM
        } else {
            IBV_WR_SEND
        };
        let mut wr = rdma(opcode, 2000 + i as u64, &mut sges, 0, true);
        wr.__bindgen_anon_1.imm_data = 0xabc0 + i as u32;
        assert_eq!(post_on(pair.qps[0], &mut wr), 0);
        at += len;
    }
    pair.run_until(&mut got, |g| {
        g[1].len() == sizes.len() && g[0].len() == sizes.len()
    });
    assert_eq!(pair.dev.rnr(), 0, "no RNR caused");
    let mut at = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let r = &got[1][i];
        assert_eq!(
            (r.wr_id, r.status, r.byte_len, r.opcode),
            (1000 + i as u64, IBV_WC_SUCCESS, len as u32, IBV_WC_RECV),
            "receive {i}"
        );
        let with_imm = i % 3 == 1;
        assert_eq!(r.wc_flags & IBV_WC_WITH_IMM != 0, with_imm, "receive {i}");
        if with_imm {
            // SAFETY: reading the union as the immediate.
            assert_eq!(unsafe { r.__bindgen_anon_1.imm_data }, 0xabc0 + i as u32);
        }
        let start = at + i * slack;
        assert_eq!(&dst[start..start + len], &src[at..at + len], "bytes of {i}");
        assert!(
            dst[start + len..start + len + slack]
                .iter()
                .all(|&b| b == 0),
            "slack of {i} untouched"
        );
        let s = &got[0][i];
        assert_eq!(
            (s.wr_id, s.status, s.opcode),
            (2000 + i as u64, IBV_WC_SUCCESS, IBV_WC_SEND)
        );
        at += len;
    }
    let stats = pair.engine.stats();
    let longer = sizes.iter().filter(|&&l| l > CHUNK as usize).count() as u64;
    assert_eq!(stats.split_requests, longer, "{stats:?}");
    assert_eq!(stats.announced, sizes.len() as u64);
    assert!(pair
        .dev
        .log()
        .iter()
        .filter(|w| w.opcode == IBV_WR_SEND || w.opcode == IBV_WR_SEND_WITH_IMM)
        .all(|w| w.len() <= u64::from(CHUNK)));
    // The receiver's queue holds nothing of the shaper's once every message landed.
    assert_eq!(pair.dev.receives_posted(pair.qps[1]), 0);
}

/// SENDs needing more receives than the receiver's queue holds (16 and 10 chunks into a
/// queue of 6) go split all the same: the receiving shaper posts each message's
/// receives in parts as room frees, credits each part, and the sender sends no chunk
/// past the credit. Every byte lands in its receive, with the whole length, no RNR is
/// caused, the queue is never overfilled (the mock refuses a receive past its depth),
/// and every SEND on the wire is one chunk.
#[test]
fn sends_needing_more_receives_than_the_queue_holds_go_split_in_parts() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0900, 6, 0);
    let sizes: [usize; 3] = [16 * 4096, 10 * 4096 - 5, 3 * 4096];
    let total: usize = sizes.iter().sum();
    let src = pattern(total, 11);
    let dst = vec![0u8; total];
    let mut at = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let mut sges = sges_over(&dst, at, len, 2);
        assert_eq!(pair.post_recv(1, 1000 + i as u64, &mut sges), 0);
        at += len;
    }
    let mut at = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let mut sges = sges_over(&src, at, len, 3);
        let mut wr = rdma(IBV_WR_SEND, 2000 + i as u64, &mut sges, 0, true);
        assert_eq!(post_on(pair.qps[0], &mut wr), 0);
        at += len;
    }
    pair.run_until(&mut got, |g| {
        g[1].len() == sizes.len() && g[0].len() == sizes.len()
    });
    assert_eq!(pair.dev.rnr(), 0, "no RNR caused");
    assert_eq!(dst, src, "every byte in its receive");
    for (i, &len) in sizes.iter().enumerate() {
        let r = &got[1][i];
        assert_eq!(
            (r.wr_id, r.status, r.byte_len),
            (1000 + i as u64, IBV_WC_SUCCESS, len as u32),
            "receive {i}"
        );
        let s = &got[0][i];
        assert_eq!((s.wr_id, s.status), (2000 + i as u64, IBV_WC_SUCCESS));
    }
    let stats = pair.engine.stats();
    assert_eq!(stats.split_requests, 3, "{stats:?}");
    let sends: Vec<u64> = pair
        .dev
        .log()
        .iter()
        .filter(|w| w.opcode == IBV_WR_SEND)
        .map(|w| w.len())
        .collect();
    assert_eq!(sends.len(), 16 + 10 + 3);
    assert!(sends.iter().all(|&l| l <= u64::from(CHUNK)));
    assert_eq!(pair.dev.receives_posted(pair.qps[1]), 0);
}

/// A receiver whose application polls its receive CQ only once the message is there (as
/// one that spins on a flag written behind it, then polls): a SEND needing more receives
/// than the queue holds (16 chunks into a queue of 6) still completes at the sender, the
/// room it needs freed by the side thread's polls aside; every byte has landed when the
/// application first polls, and it finds its one completion, whole, and no RNR was caused.
/// The receiver's send completions go to another CQ, so its receive CQ knows it only as
/// a receiver.
#[test]
fn a_receiver_that_polls_only_once_the_message_came_still_gets_it() {
    let (mut pair, mut got) = Pair::agreed_on(0x7a_0b00, 6, 0, true);
    let len = 16 * CHUNK as usize;
    let src = pattern(len, 9);
    let dst = vec![0u8; len];
    let mut r = sges_over(&dst, 0, len, 2);
    assert_eq!(pair.post_recv(1, 1000, &mut r), 0);
    let mut s = [sge(&src, 0, len)];
    let mut wr = rdma(IBV_WR_SEND, 2000, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    for _ in 0..2000 {
        if !got[0].is_empty() {
            break;
        }
        pair.step_polling(&mut got, [true, false]);
    }
    assert_eq!(
        got[0]
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        [(2000, IBV_WC_SUCCESS)],
        "the SEND completed without the receiver's application polling"
    );
    assert!(got[1].is_empty());
    assert_eq!(dst, src, "every byte in its receive");
    pair.step(&mut got);
    assert_eq!(
        got[1]
            .iter()
            .map(|w| (w.wr_id, w.status, w.byte_len))
            .collect::<Vec<_>>(),
        [(1000, IBV_WC_SUCCESS, len as u32)]
    );
    assert_eq!(pair.dev.rnr(), 0);
    let stats = pair.engine.stats();
    assert_eq!(stats.split_requests, 1);
    assert!(stats.receiver_polls_aside > 0, "{stats:?}");
}

/// A WRITE with immediate longer than a chunk goes as WRITEs whose last carries the
/// immediate: the peer's one receive completes with the whole length and the immediate.
#[test]
fn a_write_with_immediate_goes_as_writes_and_completes_the_one_receive_whole() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0200, 16, 0);
    let len = 3 * CHUNK as usize + 5;
    let src = pattern(len, 3);
    let dst = vec![0u8; len];
    let recv_buf = vec![0u8; 8];
    let mut r = [sge(&recv_buf, 0, 8)];
    assert_eq!(pair.post_recv(1, 77, &mut r), 0);
    let mut s = [sge(&src, 0, len)];
    let mut wr = rdma(
        IBV_WR_RDMA_WRITE_WITH_IMM,
        78,
        &mut s,
        dst.as_ptr() as u64,
        true,
    );
    wr.__bindgen_anon_1.imm_data = 0x1234;
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    pair.run_until(&mut got, |g| g[1].len() == 1 && g[0].len() == 1);
    let r = &got[1][0];
    assert_eq!(
        (r.wr_id, r.status, r.byte_len, r.opcode),
        (77, IBV_WC_SUCCESS, len as u32, IBV_WC_RECV_RDMA_WITH_IMM)
    );
    // SAFETY: reading the union as the immediate.
    assert_eq!(unsafe { r.__bindgen_anon_1.imm_data }, 0x1234);
    assert_eq!(dst, src);
    assert_eq!((got[0][0].wr_id, got[0][0].status), (78, IBV_WC_SUCCESS));
    assert_eq!(pair.dev.rnr(), 0);
    let writes = pair
        .dev
        .log()
        .iter()
        .filter(|w| w.opcode == IBV_WR_RDMA_WRITE)
        .count();
    assert_eq!(writes, 3, "the first chunks go as WRITEs");
}

/// With one datagram in three lost, announcements and credits are repeated until they
/// come: every message still lands in order, with no RNR.
#[test]
fn a_lossy_side_channel_delays_messages_but_loses_none() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0300, 32, 3);
    let n = 12usize;
    let len = 2 * CHUNK as usize + 1;
    let src = pattern(len * n, 9);
    let dst = vec![0u8; len * n];
    for i in 0..n {
        let mut r = [sge(&dst, i * len, len)];
        assert_eq!(pair.post_recv(1, i as u64, &mut r), 0);
    }
    for i in 0..n {
        let mut s = [sge(&src, i * len, len)];
        let mut wr = rdma(IBV_WR_SEND, 100 + i as u64, &mut s, 0, true);
        assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    }
    pair.run_until(&mut got, |g| g[1].len() == n && g[0].len() == n);
    assert_eq!(pair.dev.rnr(), 0);
    assert!(got[1]
        .iter()
        .enumerate()
        .all(|(i, w)| w.wr_id == i as u64 && w.status == IBV_WC_SUCCESS));
    assert_eq!(dst, src);
}

fn loop_source() -> Source {
    Source {
        port: Port {
            device: "mock0".into(),
            number: 1,
        },
        gid: Some(GID),
        lid: 0,
        qpn: SIDE_QPN,
    }
}

/// Only the paired side channel's messages are taken: an announcement from another
/// side channel is refused and counted, and the receiver posts nothing for it.
#[test]
fn a_message_from_another_side_channel_is_refused() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0400, 8, 0);
    let buf = vec![0u8; 64];
    let mut r = [sge(&buf, 0, 64)];
    assert_eq!(pair.post_recv(1, 5, &mut r), 0);
    let refused = pairing::record().counts().refused;
    let (bytes, n) = SideMessage::Announce {
        qp_num: 0x7a_0401,
        message: justitia_core::two_sided::Announce {
            seq: 0,
            len: 10,
            chunk_bytes: 4096,
            imm: None,
            kind: justitia_core::two_sided::MessageKind::Send,
        },
    }
    .encode();
    pair.queue.lock().unwrap().push_back(Datagram {
        source: Source {
            qpn: SIDE_QPN + 1,
            ..loop_source()
        },
        bytes: bytes[..n].to_vec(),
    });
    pair.step(&mut got);
    assert!(pairing::record().counts().refused > refused, "counted");
    assert_eq!(
        pair.dev.receives_posted(pair.qps[1]),
        0,
        "nothing posted for it"
    );
    assert!(got[1].is_empty());
}

/// Moves `qp` to the error state as `ibv_modify_qp` does: at the provider and in the
/// shaper's view.
fn to_error(pair: &Pair, qp: usize) {
    pair.dev.set_error(pair.qps[qp]);
    let attr = ibv_qp_attr {
        qp_state: IBV_QPS_ERR,
        ..Default::default()
    };
    engine::qp(pair.qps[qp])
        .unwrap()
        .on_modify(&attr, IBV_QP_STATE);
}

/// A message longer than the receive the peer posted for it goes whole and fails as it
/// would natively: a local length error at the receiver, a remote error at the sender.
#[test]
fn a_message_longer_than_its_receive_fails_as_it_would_natively() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0500, 8, 0);
    let small = vec![0u8; 100];
    let mut r = [sge(&small, 0, 100)];
    assert_eq!(pair.post_recv(1, 9, &mut r), 0);
    let src = pattern(10_000, 1);
    let mut s = [sge(&src, 0, 10_000)];
    let mut wr = rdma(IBV_WR_SEND, 10, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    pair.run_until(&mut got, |g| !g[0].is_empty() && !g[1].is_empty());
    assert_eq!((got[1][0].wr_id, got[1][0].status), (9, IBV_WC_LOC_LEN_ERR));
    assert_eq!(
        (got[0][0].wr_id, got[0][0].status),
        (10, IBV_WC_REM_INV_REQ_ERR)
    );
    assert_eq!(pair.engine.stats().split_requests, 0, "sent whole");
}

/// A QP moved to the error state flushes every receive the shaper holds for it, and the
/// sender's requests waiting for a credit: nothing is left pending on either end.
#[test]
fn moving_to_the_error_state_flushes_what_the_shaper_holds() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0600, 8, 0);
    // Receives on B with nothing announced: held by the shaper, none at the NIC.
    let buf = vec![0u8; 3 * 64];
    for i in 0..3 {
        let mut r = [sge(&buf, i * 64, 64)];
        assert_eq!(pair.post_recv(1, 20 + i as u64, &mut r), 0);
    }
    assert_eq!(pair.dev.receives_posted(pair.qps[1]), 0, "held");
    // SENDs on B to A, which posted no receive: they wait for A's credit.
    let src = pattern(64, 2);
    for i in 0..2 {
        let mut s = [sge(&src, 0, 64)];
        let mut wr = rdma(IBV_WR_SEND, 30 + i, &mut s, 0, true);
        assert_eq!(post_on(pair.qps[1], &mut wr), 0);
    }
    pair.step(&mut got);
    assert!(got[1].is_empty(), "nothing completes before the error");
    to_error(&pair, 1);
    pair.run_until(&mut got, |g| g[1].len() == 5);
    let mut ids: Vec<(u64, u32)> = got[1].iter().map(|w| (w.wr_id, w.status)).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        [20, 21, 22, 30, 31].map(|id| (id, IBV_WC_WR_FLUSH_ERR)),
        "each receive and send flushed once"
    );
    for _ in 0..20 {
        pair.step(&mut got);
    }
    assert_eq!(got[1].len(), 5, "and nothing more");
}

/// The peer's shaper goes silent (its process gone) while a SEND waits for its credit:
/// after the QP's transport timeout (at least 3 s), the SEND fails with
/// `IBV_WC_RETRY_EXC_ERR`, as toward a peer that is gone, and one posted after it
/// flushes; the application never hangs on a credit.
#[test]
fn a_peer_gone_silent_fails_the_waiting_send_instead_of_hanging_it() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0700, 8, 0);
    pair.transport_timeout(0);
    pair.silent
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let src = pattern(100, 4);
    let mut s = [sge(&src, 0, 100)];
    let mut wr = rdma(IBV_WR_SEND, 40, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    let waited = pair.until_given_up(&mut got, 40);
    assert!(
        (3_000_000_000..3_100_000_000).contains(&waited),
        "given up after {waited} ns"
    );
    let mut wr = rdma(IBV_WR_SEND, 41, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    pair.run_until(&mut got, |g| g[0].len() == 2);
    assert_eq!(
        (got[0][1].wr_id, got[0][1].status),
        (41, IBV_WC_WR_FLUSH_ERR)
    );
    assert_eq!(pair.dev.rnr(), 0, "nothing reached the NIC whole");
}

/// The peer's shaper goes silent in the middle of a SEND whose receives it posts in parts
/// (16 chunks into a queue of 6): the chunks credited go, and after the transport timeout
/// with no further credit the SEND fails with `IBV_WC_RETRY_EXC_ERR`, once; the
/// application never hangs on the rest of the credit.
#[test]
fn a_peer_gone_silent_mid_message_fails_the_send_instead_of_hanging_it() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0a00, 6, 0);
    pair.transport_timeout(0);
    let len = 16 * CHUNK as usize;
    let src = pattern(len, 5);
    let dst = vec![0u8; len];
    let mut r = [sge(&dst, 0, len)];
    assert_eq!(pair.post_recv(1, 1000, &mut r), 0);
    let mut s = [sge(&src, 0, len)];
    let mut wr = rdma(IBV_WR_SEND, 2000, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    let sends = |pair: &Pair| {
        pair.dev
            .log()
            .iter()
            .filter(|w| w.opcode == IBV_WR_SEND)
            .count()
    };
    for _ in 0..2000 {
        if sends(&pair) >= 3 {
            break;
        }
        pair.step(&mut got);
    }
    assert!(
        (3..16).contains(&sends(&pair)),
        "{} chunks sent",
        sends(&pair)
    );
    pair.silent
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let waited = pair.until_given_up(&mut got, 2000);
    assert!(sends(&pair) < 16, "the chunks past the credit never went");
    assert!(
        (3_000_000_000..3_200_000_000).contains(&waited),
        "given up after {waited} ns"
    );
    for _ in 0..10 {
        pair.step(&mut got);
    }
    assert_eq!(got[0].len(), 1, "one completion, once");
    assert_eq!(pair.dev.rnr(), 0);
}

/// A peer that is there but whose application has not posted the receive yet answers
/// each repeated announcement (it waits): the sender never gives up on it, and the
/// message goes once the receive comes, 10 s later.
#[test]
fn a_peer_whose_application_is_slow_to_post_is_never_given_up_on() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0800, 8, 0);
    pair.transport_timeout(0);
    let src = pattern(100, 4);
    let mut s = [sge(&src, 0, 100)];
    let mut wr = rdma(IBV_WR_SEND, 50, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    pair.step_ns = 20_000_000;
    for _ in 0..500 {
        pair.step(&mut got);
    }
    assert!(got[0].is_empty(), "still waiting after 10 s");
    let dst = vec![0u8; 100];
    let mut r = [sge(&dst, 0, 100)];
    assert_eq!(pair.post_recv(1, 51, &mut r), 0);
    pair.run_until(&mut got, |g| g[0].len() == 1 && g[1].len() == 1);
    assert_eq!((got[0][0].wr_id, got[0][0].status), (50, IBV_WC_SUCCESS));
    assert_eq!((got[1][0].wr_id, got[1][0].byte_len), (51, 100));
    assert_eq!(dst, src);
}

/// A QP destroyed with the shaper's receives in its queue, by a provider that leaves a
/// destroyed QP's completions in its CQ (rxe): their flushes, which carry the shaper's
/// tags, never reach the application; its own receive's flush does, once.
#[test]
fn a_destroyed_qps_internal_receives_never_reach_the_application() {
    let (mut pair, _) = Pair::agreed(0x7a_0900, 8, 0);
    pair.dev.keep_stale_completions();
    let dst = vec![0u8; 3 * CHUNK as usize];
    let mut r = [sge(&dst, 0, dst.len())];
    assert_eq!(pair.post_recv(1, 60, &mut r), 0);
    let src = pattern(dst.len(), 5);
    let mut s = [sge(&src, 0, src.len())];
    let mut wr = rdma(IBV_WR_SEND, 61, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    // The announcement and the credit, without running A's chunks.
    pair.now_ns += pair.step_ns;
    pair.engine.side_turn(pair.now_ns);
    assert_eq!(
        pair.dev.receives_posted(pair.qps[1]),
        3,
        "one receive per chunk"
    );
    to_error(&pair, 1);
    let qp = pair.qps[1];
    // SAFETY: the mock's live QP, destroyed through the shaper as ibv_destroy_qp does.
    let rc = engine::destroy_qp(qp, || {
        pair.dev.destroy_qp(qp);
        0
    });
    assert_eq!(rc, 0);
    let mut wc = [ibv_wc::default(); 16];
    // SAFETY: a live CQ and room for 16.
    let n = unsafe { ops::poll_cq(pair.cqs[1], 16, wc.as_mut_ptr()) };
    let seen: Vec<u64> = wc[..n as usize].iter().map(|w| w.wr_id).collect();
    assert!(
        seen.iter().all(|&id| id == 60),
        "only the application's own receive: {seen:x?}"
    );
    assert!(seen.len() <= 1);
}

/// A list longer than the send queue: the request past `max_send_wr` is refused with
/// `ENOMEM` before it is announced, so the peer pairs no receive with a message that
/// never comes, and every request the call kept lands in its receive.
#[test]
fn a_request_refused_for_a_full_queue_is_never_announced() {
    let (mut pair, mut got) = Pair::agreed(0x7a_0a00, 128, 0);
    let n = 65usize;
    let dst = vec![0u8; 100 * n];
    for i in 0..n {
        let mut r = [sge(&dst, i * 100, 100)];
        assert_eq!(pair.post_recv(1, 100 + i as u64, &mut r), 0);
    }
    let src = pattern(100 * n, 6);
    let mut sges: Vec<[ibv_sge; 1]> = (0..n).map(|i| [sge(&src, i * 100, 100)]).collect();
    let mut wrs: Vec<ibv_send_wr> = sges
        .iter_mut()
        .enumerate()
        .map(|(i, s)| rdma(IBV_WR_SEND, 200 + i as u64, s, 0, true))
        .collect();
    let base = wrs.as_mut_ptr();
    for i in 0..n - 1 {
        // SAFETY: i + 1 < n, both within the list.
        unsafe { (*base.add(i)).next = base.add(i + 1) };
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live QP and a valid list.
    let rc = unsafe { ops::post_send(pair.qps[0], base, &mut bad) };
    assert_eq!(rc, libc::ENOMEM);
    // SAFETY: within the list.
    assert_eq!(bad, unsafe { base.add(64) }, "the 65th is refused");
    assert_eq!(pair.engine.stats().announced, 64);
    pair.run_until(&mut got, |g| g[0].len() == 64 && g[1].len() == 64);
    for _ in 0..20 {
        pair.step(&mut got);
    }
    assert_eq!(got[1].len(), 64, "the 65th receive waits for a message");
    assert!(got[1]
        .iter()
        .enumerate()
        .all(|(i, w)| w.wr_id == 100 + i as u64 && w.status == IBV_WC_SUCCESS));
    assert_eq!(&dst[..6400], &src[..6400]);
}

/// An event-driven receiver: its receive CQ, which carries only its split messages, is
/// armed for solicited completions only once its QP owns its receives (before, and on a CQ
/// that carries send completions too, an arm stays one for the next completion); the
/// sender marks solicited the end of each message and of each half of a credited part, so
/// a SEND of 16 chunks into a queue of 6 leaves chunks unmarked but never half a queue's
/// worth in a row (the receiver wakes in time to post the next part). A QP that names the CQ later turns the standing arm
/// back into one for the next completion, and so does the receiver's failure.
#[test]
fn a_receive_cq_of_split_messages_only_is_armed_for_their_marked_ends() {
    let mut pair = Pair::new(0x7a_0f00, 6, 0, true);
    let arm = |cq| {
        // SAFETY: a live CQ.
        assert_eq!(unsafe { ops::req_notify_cq(cq, 0) }, 0);
    };
    arm(pair.cqs[1]);
    assert_eq!(pair.dev.arms_of(pair.cqs[1]), [0], "before the agreement");
    let mut got = [Vec::new(), Vec::new()];
    let engine = Arc::clone(&pair.engine);
    pair.run_until(&mut got, |_| engine.stats().qps_owning_receives == 2);
    arm(pair.cqs[1]);
    arm(pair.cqs[0]);
    assert_eq!(
        pair.dev.arms_of(pair.cqs[1]),
        [0, 1],
        "owned, receives only"
    );
    assert_eq!(
        pair.dev.arms_of(pair.cqs[0]),
        [0],
        "A's sends complete there too"
    );
    assert_eq!(pair.engine.stats().cq_arms_solicited, 1);

    let len = 16 * CHUNK as usize;
    let src = pattern(len, 5);
    let dst = vec![0u8; len];
    let mut r = sges_over(&dst, 0, len, 2);
    assert_eq!(pair.post_recv(1, 70, &mut r), 0);
    let mut s = sges_over(&src, 0, len, 3);
    let mut wr = rdma(IBV_WR_SEND, 71, &mut s, 0, true);
    assert_eq!(post_on(pair.qps[0], &mut wr), 0);
    pair.run_until(&mut got, |g| g[0].len() == 1 && g[1].len() == 1);
    assert_eq!(dst, src);
    assert_eq!((got[1][0].wr_id, got[1][0].byte_len), (70, len as u32));
    // It waited for its first credit and for later parts of it.
    assert!(
        pair.engine.stats().credit_holds >= 2,
        "{:?}",
        pair.engine.stats()
    );
    let marks: Vec<bool> = pair
        .dev
        .log()
        .iter()
        .filter(|w| w.opcode == IBV_WR_SEND)
        .map(|w| w.send_flags & IBV_SEND_SOLICITED != 0)
        .collect();
    assert_eq!(marks.len(), 16);
    assert_eq!(marks.last(), Some(&true), "the message's end: {marks:?}");
    assert!(marks.contains(&false), "not every chunk: {marks:?}");
    let longest_unmarked = marks.split(|&m| m).map(<[bool]>::len).max().unwrap_or(0);
    assert!(
        longest_unmarked < 3,
        "a mark within every half queue's worth of chunks: {marks:?}"
    );

    // Another QP names the CQ (its receives): the standing solicited arm goes back.
    let other = create_qp(
        &pair.dev,
        ibv_qp_init_attr {
            send_cq: pair.b_send_cq.unwrap(),
            recv_cq: pair.cqs[1],
            qp_type: IBV_QPT_RC,
            cap: ibv_qp_cap {
                max_send_wr: 4,
                max_recv_wr: 4,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            ..Default::default()
        },
    );
    assert_eq!(pair.dev.arms_of(pair.cqs[1]), [0, 1, 0], "re-armed");
    arm(pair.cqs[1]);
    assert_eq!(pair.dev.arms_of(pair.cqs[1]), [0, 1, 0, 0], "not quiet");
    if let Some(t) = engine::qp_token(other) {
        engine::unregister_qp(other, t);
    }
    arm(pair.cqs[1]);
    assert_eq!(
        pair.dev.arms_of(pair.cqs[1]),
        [0, 1, 0, 0, 1],
        "quiet again"
    );
    to_error(&pair, 1);
    assert_eq!(
        pair.dev.arms_of(pair.cqs[1]),
        [0, 1, 0, 0, 1, 0],
        "the receiver failed"
    );
}
