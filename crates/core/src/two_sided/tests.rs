#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;
use crate::chunk::{RemoteAddr, SendFlags};

/// Both shapers and a NIC that moves bytes: the sender's memory is one buffer whose byte
/// at address `a` is `pattern(a)`; the receiver's memory is a buffer written only through
/// posted receives, FIFO, as an RNIC does.
struct Pair {
    tx: SendSide,
    rx: RecvSide,
    /// Receives posted to the "NIC", in order: (seq, scatter list).
    rq: VecDeque<InternalRecv>,
    /// Chunks posted and not yet landed, in order.
    wire: VecDeque<OutChunk>,
    /// Receiver memory, addressed from 0.
    mem: Vec<u8>,
    /// Most chunks in flight seen against the receives credited and not consumed.
    completions: Vec<AppCompletion>,
    sends_done: Vec<AppCompletion>,
    room: u32,
    /// A side channel that loses and repeats datagrams: a xorshift state and the percent
    /// of datagrams lost (as many again are delivered twice). `None`: every one arrives
    /// once.
    loss: Option<(u64, u64)>,
}

fn pattern(addr: u64) -> u8 {
    (addr.wrapping_mul(31) ^ (addr >> 8)) as u8
}

impl Pair {
    fn new(mem: usize, max_sge: usize, room: u32) -> Self {
        Pair {
            tx: SendSide::new(0, max_sge),
            rx: RecvSide::new(0, max_sge, room),
            rq: VecDeque::new(),
            wire: VecDeque::new(),
            mem: vec![0; mem],
            completions: Vec::new(),
            sends_done: Vec::new(),
            room,
            loss: None,
        }
    }

    /// How many times the side channel delivers the next datagram: 0 (lost), 1 or 2.
    fn copies(&mut self) -> u32 {
        let Some((state, percent)) = &mut self.loss else {
            return 1;
        };
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        match *state % 100 {
            r if r < *percent => 0,
            r if r < 2 * *percent => 2,
            _ => 1,
        }
    }

    /// A credit over the side channel.
    fn credit(&mut self, seq: u64, posting: Posting) {
        for _ in 0..self.copies() {
            self.tx.on_credit(seq, posting).unwrap();
        }
    }

    /// Runs the protocol until nothing moves: announcements through the wire format,
    /// postings, credits back, chunks onto the NIC into the receives in FIFO order. With
    /// a lossy side channel, whenever nothing moves time passes and the sender repeats
    /// what has no credit, until every message completed.
    fn run(&mut self, announces: &mut VecDeque<Announce>) {
        let mut now = 0;
        let mut idle = 0;
        loop {
            let mut moved = false;
            while let Some(a) = announces.pop_front() {
                let wire = SideMessage::Announce {
                    qp_num: 7,
                    message: a,
                };
                let (buf, len) = wire.encode();
                let SideMessage::Announce { message, .. } =
                    SideMessage::decode(&buf[..len]).unwrap()
                else {
                    panic!("kind changed on the wire");
                };
                for _ in 0..self.copies() {
                    if let Announced::Repeated(Some(posting)) =
                        self.rx.on_announce(message).unwrap()
                    {
                        self.credit(message.seq, posting);
                    }
                }
                moved = true;
            }
            let room = self.room.saturating_sub(self.rq.len() as u32);
            if let Some((recvs, posting, seq)) = self.rx.next_posting(room) {
                self.rq.extend(recvs);
                self.credit(seq, posting);
                moved = true;
            }
            // Chunks go onto the wire as the sender allows, and land a few at a time, so
            // that many are in flight at once: each one that consumes a receive must have
            // one posted and not yet taken.
            while let Some(chunk) = self.tx.next_chunk() {
                self.wire.push_back(chunk);
                let consuming = self.wire.iter().filter(|c| consumes(c)).count();
                assert!(
                    consuming <= self.rq.len(),
                    "{consuming} receive-consuming chunks in flight, {} receives posted",
                    self.rq.len()
                );
                assert!(self.tx.chunks_in_flight() as usize >= self.wire.len());
                moved = true;
            }
            for _ in 0..self.wire.len().div_ceil(2) {
                if let Some(chunk) = self.wire.pop_front() {
                    self.deliver(chunk);
                    moved = true;
                }
            }
            if moved {
                idle = 0;
                continue;
            }
            if self.loss.is_none() || self.tx.outstanding() == 0 {
                return;
            }
            self.tx.reannounce(now);
            now += ANNOUNCE_RETRY_MAX_NS;
            let again = self.tx.reannounce(now);
            announces.extend(again);
            idle += 1;
            assert!(
                idle < 1000,
                "no progress: {} outstanding",
                self.tx.outstanding()
            );
        }
    }

    /// The NIC: a chunk's bytes into the head receive (a SEND) or straight to the remote
    /// address (a WRITE); the receive's and the send's completions.
    fn deliver(&mut self, chunk: OutChunk) {
        let data: Vec<u8> = chunk
            .request
            .sges
            .iter()
            .flat_map(|s| (0..u64::from(s.length)).map(move |i| pattern(s.addr + i)))
            .collect();
        let consumes = consumes(&chunk);
        let mut status = WC_SUCCESS;
        if matches!(
            chunk.request.opcode,
            Opcode::Write | Opcode::WriteWithImm { .. }
        ) {
            let remote = chunk.request.remote.unwrap();
            let at = remote.addr as usize;
            self.mem[at..at + data.len()].copy_from_slice(&data);
        }
        if consumes {
            let recv = self
                .rq
                .pop_front()
                .expect("a chunk arrived without a receive");
            let is_send = matches!(
                chunk.request.opcode,
                Opcode::Send | Opcode::SendWithImm { .. }
            );
            let room: u64 = recv.sges.total_bytes();
            let (rx_status, len) = if is_send && data.len() as u64 > room {
                (WC_LOC_LEN_ERR, 0)
            } else {
                if is_send {
                    scatter(&mut self.mem, &recv.sges, &data);
                }
                (WC_SUCCESS, data.len() as u32)
            };
            status = rx_status;
            if let Some(c) = self
                .rx
                .on_recv_done(rx_status, len, chunk.request.opcode.imm())
            {
                self.completions.push(c);
            }
        }
        if let Some(c) = self.tx.on_chunk_done(chunk.seq, status) {
            self.sends_done.push(c);
        }
    }
}

/// Whether a chunk takes a receive at the peer: every one but a plain WRITE.
fn consumes(chunk: &OutChunk) -> bool {
    !matches!(chunk.request.opcode, Opcode::Write)
}

fn scatter(mem: &mut [u8], sges: &[Sge], data: &[u8]) {
    let mut at = 0;
    for s in sges {
        let n = (s.length as usize).min(data.len() - at);
        mem[s.addr as usize..s.addr as usize + n].copy_from_slice(&data[at..at + n]);
        at += n;
    }
}

/// An application receive's buffer: `length` bytes at address 0 of its region (lkey 1).
fn sink(length: u32) -> [Sge; 1] {
    [Sge {
        addr: 0,
        length,
        lkey: 1,
    }]
}

/// The sender's buffer of a message: `length` bytes at address 0 of its region (lkey 2).
fn source(length: u32) -> [Sge; 1] {
    [Sge {
        addr: 0,
        length,
        lkey: 2,
    }]
}

fn request(wr_id: u64, opcode: Opcode, sges: &[Sge], remote: u64) -> WorkRequest {
    WorkRequest {
        wr_id,
        opcode,
        sges: SgeList::try_from(sges).unwrap(),
        remote: Some(RemoteAddr {
            addr: remote,
            rkey: 3,
        }),
        flags: SendFlags {
            signaled: true,
            ..SendFlags::default()
        },
    }
}

/// Cuts `len` bytes starting at `base` into SGEs at the given fractional cuts.
fn sges_of(base: u64, len: u32, cuts: &[u32]) -> Vec<Sge> {
    let mut points: Vec<u32> = cuts
        .iter()
        .map(|c| c % len.max(1))
        .filter(|&c| c > 0)
        .collect();
    points.sort_unstable();
    points.dedup();
    points.push(len);
    let mut out = Vec::new();
    let mut from = 0;
    for p in points {
        out.push(Sge {
            addr: base + u64::from(from),
            length: p - from,
            lkey: 1,
        });
        from = p;
    }
    out
}

fn expected_at(sges: &[Sge], len: u32) -> Vec<u8> {
    sges.iter()
        .flat_map(|s| (0..u64::from(s.length)).map(move |i| pattern(s.addr + i)))
        .take(len as usize)
        .collect()
}

fn gathered(mem: &[u8], sges: &[Sge], len: u32) -> Vec<u8> {
    sges.iter()
        .flat_map(|s| {
            mem[s.addr as usize..(s.addr + u64::from(s.length)) as usize]
                .iter()
                .copied()
        })
        .take(len as usize)
        .collect()
}

/// A 10 000 B SEND in 4096 B chunks goes as three SENDs into three receives that are
/// slices of the application's two SGEs; the application sees one completion of 10 000 B
/// with the immediate the last chunk carried, and the sender's request completes once.
#[test]
fn a_send_is_split_into_slices_of_the_receive_and_completes_once() {
    let mut pair = Pair::new(20_000, 4, 64);
    let app = [
        Sge {
            addr: 0,
            length: 6000,
            lkey: 1,
        },
        Sge {
            addr: 8000,
            length: 6000,
            lkey: 1,
        },
    ];
    pair.rx.post_recv(11, &app).unwrap();
    let src = [Sge {
        addr: 1 << 20,
        length: 10_000,
        lkey: 2,
    }];
    let a = pair
        .tx
        .post(request(5, Opcode::SendWithImm { imm: 77 }, &src, 0), 4096)
        .unwrap();
    assert_eq!((a.len, a.chunks(), a.imm), (10_000, 3, Some(77)));
    pair.run(&mut VecDeque::from([a]));
    assert_eq!(
        pair.completions,
        [AppCompletion {
            wr_id: 11,
            status: WC_SUCCESS,
            byte_len: 10_000,
            imm: Some(77),
            signaled: true
        }]
    );
    assert_eq!(pair.sends_done.len(), 1);
    assert_eq!(pair.sends_done[0].wr_id, 5);
    assert_eq!(gathered(&pair.mem, &app, 10_000), expected_at(&src, 10_000));
    assert_eq!(pair.tx.outstanding(), 0);
}

/// Nothing goes before the credit: an announced message with no application receive
/// waits, and its chunks go only once the receive is posted and credited.
#[test]
fn no_chunk_goes_without_a_credit() {
    let mut pair = Pair::new(1 << 16, 4, 64);
    let src = source(9000);
    let a = pair
        .tx
        .post(request(1, Opcode::Send, &src, 0), 1000)
        .unwrap();
    pair.run(&mut VecDeque::from([a]));
    assert_eq!(pair.tx.ready_bytes(), None);
    assert!(pair.tx.next_chunk().is_none());
    pair.rx
        .post_recv(
            2,
            &[Sge {
                addr: 0,
                length: 9000,
                lkey: 1,
            }],
        )
        .unwrap();
    pair.run(&mut VecDeque::new());
    assert_eq!(pair.completions.len(), 1);
    assert_eq!(pair.completions[0].byte_len, 9000);
}

/// A caller that cuts the messages itself takes each one out once its credit has come, in
/// order: a later message credited first waits for the earlier one, and a split SEND's
/// credit for fewer receives than its chunks is handed out as it stands (once) and the
/// message stays until the rest comes.
#[test]
fn credited_messages_are_taken_out_in_order_and_only_when_fully_credited() {
    let mut tx = SendSide::new(7, 4);
    let src = source(9000);
    let a = tx.post(request(1, Opcode::Send, &src, 0), 1000).unwrap();
    let b = tx.post(request(2, Opcode::Send, &src, 0), 9000).unwrap();
    let c = tx.post(request(3, Opcode::Send, &src, 0), 3000).unwrap();
    assert_eq!((a.seq, a.chunks(), b.chunks(), c.chunks()), (7, 9, 1, 3));
    assert_eq!(tx.take_credited(), None, "nothing credited");
    tx.on_credit(b.seq, Posting::Whole).unwrap();
    assert_eq!(tx.take_credited(), None, "the second waits for the first");
    tx.on_credit(a.seq, Posting::Split { posted: 4 }).unwrap();
    assert_eq!(tx.take_credited(), Some((7, Posting::Split { posted: 4 })));
    assert_eq!(
        tx.take_credited(),
        None,
        "4 of 9 receives posted, handed out once"
    );
    tx.on_credit(a.seq, Posting::Split { posted: 9 }).unwrap();
    assert_eq!(tx.take_credited(), Some((7, Posting::Split { posted: 9 })));
    assert_eq!(tx.take_credited(), Some((8, Posting::Whole)));
    assert_eq!(tx.take_credited(), None);
    assert_eq!(tx.outstanding(), 1, "the third still waits for its credit");
    tx.on_credit(a.seq, Posting::Split { posted: 9 })
        .expect("a repeated credit for a message taken out is ignored");
    assert!(tx.reannounce(0).is_empty(), "first seen");
    assert_eq!(
        tx.reannounce(ANNOUNCE_RETRY_NS),
        vec![c],
        "only the third repeats"
    );
    // The receiver says the third waits for an application receive: the wait before
    // giving up on the peer counts from then.
    assert_eq!(tx.uncredited_since(), Some(0));
    tx.on_waiting(c.seq, 5 * ANNOUNCE_RETRY_NS);
    assert_eq!(tx.uncredited_since(), Some(5 * ANNOUNCE_RETRY_NS));
    tx.on_waiting(a.seq, 9 * ANNOUNCE_RETRY_NS);
    assert_eq!(
        tx.uncredited_since(),
        Some(5 * ANNOUNCE_RETRY_NS),
        "a message taken out is not waited for"
    );
    assert!(!tx.withdraw(a.seq), "only the newest is withdrawn");
    assert!(tx.withdraw(c.seq));
    assert_eq!(tx.outstanding(), 0);
    let again = tx.post(request(4, Opcode::Send, &src, 0), 3000).unwrap();
    assert_eq!(again.seq, c.seq, "the next message takes its number");
}

/// Entering the protocol mid-stream: the receiver posted 3 receives whole and offers 3;
/// the sender had sent 5 whole, so it accepts 5 and the receiver posts 2 of its held
/// receives whole before the first announced message. Before the offer receives go whole;
/// a repeated offer gets the same accept; an accept below the offer is refused.
#[test]
fn the_agreement_starts_announcing_after_every_whole_message() {
    let (mut tx, mut rx) = (SenderAgreement::new(), ReceiverAgreement::new());
    assert_eq!(tx.first(), None, "whole until agreed");
    for _ in 0..3 {
        assert!(rx.posts_whole());
        rx.posted_whole();
    }
    for _ in 0..4 {
        tx.sent_whole();
    }
    tx.sent_whole_to(5);
    tx.sent_whole_to(2);
    let offer = rx.offer(9);
    assert!(!rx.posts_whole());
    assert_eq!(
        offer,
        SideMessage::Offer {
            qp_num: 9,
            first: 3
        }
    );
    let (accept, first) = tx.on_offer(4, 3);
    assert_eq!(
        (accept, first),
        (
            SideMessage::Accept {
                qp_num: 4,
                first: 5
            },
            5
        )
    );
    assert_eq!(tx.on_offer(4, 3).1, 5, "a repeated offer, the same answer");
    assert_eq!(tx.first(), Some(5));
    assert_eq!(rx.on_accept(5), Ok(2));
    let mut low = ReceiverAgreement::new();
    low.posted_whole();
    low.offer(9);
    assert!(low.on_accept(0).is_err());
    assert!(
        ReceiverAgreement::new().on_accept(0).is_err(),
        "no offer made"
    );
}

/// A credit for part of a message's receives lets exactly that many chunks go; the rest
/// wait for the next credit.
#[test]
fn a_partial_credit_lets_only_its_chunks_go() {
    let mut tx = SendSide::new(0, 4);
    let src = source(4000);
    tx.post(request(1, Opcode::Send, &src, 0), 1000).unwrap();
    tx.on_credit(0, Posting::Split { posted: 2 }).unwrap();
    assert_eq!(tx.ready_bytes(), Some(1000));
    let first: Vec<u32> = std::iter::from_fn(|| tx.next_chunk())
        .map(|c| c.offset)
        .collect();
    assert_eq!(first, [0, 1000]);
    assert_eq!(tx.chunks_in_flight(), 2);
    tx.on_credit(0, Posting::Split { posted: 4 }).unwrap();
    let rest: Vec<(u32, bool)> = std::iter::from_fn(|| tx.next_chunk())
        .map(|c| (c.offset, c.is_last))
        .collect();
    assert_eq!(rest, [(2000, false), (3000, true)]);
}

/// A message longer than the application's receive is posted whole and fails at the NIC
/// as it would natively; the next message is unaffected in order.
#[test]
fn a_message_longer_than_the_receive_goes_whole_and_fails_natively() {
    let mut pair = Pair::new(1 << 16, 4, 64);
    pair.rx
        .post_recv(
            1,
            &[Sge {
                addr: 0,
                length: 100,
                lkey: 1,
            }],
        )
        .unwrap();
    let src = source(5000);
    let a = pair
        .tx
        .post(request(9, Opcode::Send, &src, 0), 1000)
        .unwrap();
    pair.run(&mut VecDeque::from([a]));
    assert_eq!(pair.completions[0].status, WC_LOC_LEN_ERR);
    assert_eq!(pair.sends_done[0].status, WC_LOC_LEN_ERR);
    assert!(pair.sends_done[0].signaled, "an error is always reported");
}

/// WRITE with immediate: the data goes as WRITE chunks with no receive, the last chunk
/// carries the immediate and consumes the application's one receive, whose completion
/// reports the whole message's length.
#[test]
fn a_write_with_immediate_goes_as_writes_and_the_last_consumes_the_receive() {
    let mut pair = Pair::new(1 << 16, 4, 64);
    pair.rx.post_recv(3, &[]).unwrap();
    let src = [Sge {
        addr: 0,
        length: 10_000,
        lkey: 2,
    }];
    let a = pair
        .tx
        .post(
            request(4, Opcode::WriteWithImm { imm: 9 }, &src, 4096),
            3000,
        )
        .unwrap();
    pair.run(&mut VecDeque::from([a]));
    assert_eq!(
        pair.completions,
        [AppCompletion {
            wr_id: 3,
            status: WC_SUCCESS,
            byte_len: 10_000,
            imm: Some(9),
            signaled: true
        }]
    );
    assert_eq!(pair.mem[4096..14_096], expected_at(&src, 10_000)[..]);
}

/// A chunk's failure completes the application's send with that error, once; teardown
/// flushes every other request and receive, leaving nothing pending.
#[test]
fn a_failed_chunk_completes_the_request_and_teardown_leaves_nothing() {
    let mut tx = SendSide::new(0, 4);
    let src = source(3000);
    let a = tx.post(request(1, Opcode::Send, &src, 0), 1000).unwrap();
    tx.post(request(2, Opcode::Send, &src, 0), 1000).unwrap();
    tx.on_credit(a.seq, Posting::Split { posted: 3 }).unwrap();
    let first = tx.next_chunk().unwrap();
    let done = tx.on_chunk_done(first.seq, 12).unwrap();
    assert_eq!((done.wr_id, done.status), (1, 12));
    assert_eq!(tx.on_chunk_done(first.seq, WC_WR_FLUSH_ERR), None);
    let flushed = tx.teardown();
    assert_eq!(
        flushed
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect::<Vec<_>>(),
        [(2, WC_WR_FLUSH_ERR)]
    );
    assert_eq!(tx.outstanding(), 0);

    // A peer that stops crediting: the waiting requests fail, none hangs.
    let b = tx.post(request(3, Opcode::Send, &src, 0), 1000).unwrap();
    assert_eq!(tx.next_chunk(), None, "no credit for {b:?}");
    let failed = tx.abandon(12);
    assert_eq!(
        failed
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect::<Vec<_>>(),
        [(3, 12)]
    );

    let mut rx = RecvSide::new(0, 4, 64);
    rx.post_recv(7, &sink(3000)).unwrap();
    rx.post_recv(8, &sink(3000)).unwrap();
    rx.on_announce(a).unwrap();
    assert!(rx.next_posting(64).is_some());
    let flushed = rx.teardown();
    assert_eq!(flushed.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [7, 8]);
    assert_eq!(rx.held(), 0);
}

/// A hostile credit (more receives than chunks, a shrinking one, an unknown message) and
/// an announcement out of order are refused, not obeyed.
#[test]
fn hostile_credits_and_announcements_are_refused() {
    let mut tx = SendSide::new(0, 4);
    let src = source(3000);
    let a = tx.post(request(1, Opcode::Send, &src, 0), 1000).unwrap();
    assert!(tx.on_credit(0, Posting::Split { posted: 4 }).is_err());
    assert!(
        tx.on_credit(9, Posting::Split { posted: 1 }).is_err(),
        "never announced"
    );
    tx.on_credit(0, Posting::Split { posted: 2 }).unwrap();
    tx.on_credit(0, Posting::Split { posted: 2 }).unwrap();
    assert!(tx.on_credit(0, Posting::Split { posted: 1 }).is_err());
    assert!(tx.on_credit(0, Posting::Whole).is_err());
    let mut rx = RecvSide::new(0, 4, 64);
    assert_eq!(
        rx.on_announce(Announce { seq: 1, ..a }),
        Ok(Announced::Ahead),
        "beyond a gap: dropped, the sender repeats in order"
    );
    assert_eq!(rx.on_announce(a), Ok(Announced::Taken));
    assert_eq!(
        rx.on_announce(a),
        Ok(Announced::Repeated(None)),
        "repeated before it was posted: nothing to credit again"
    );
    assert_eq!(
        rx.on_announce(Announce {
            chunk_bytes: 0,
            ..a
        }),
        Err(TwoSidedError::ZeroChunk)
    );
    let read = request(1, Opcode::Read, &src, 0);
    assert_eq!(
        tx.post(read, 1000),
        Err(TwoSidedError::NotTwoSided(Opcode::Read))
    );
}

/// Every message kind round-trips through the wire format.
#[test]
fn every_side_message_round_trips() {
    let announce = Announce {
        seq: 1 << 40,
        len: 16 << 20,
        chunk_bytes: 65_536,
        imm: Some(0xdead_beef),
        kind: MessageKind::WriteWithImm,
    };
    for m in [
        SideMessage::Offer {
            qp_num: 1,
            first: 3,
        },
        SideMessage::Accept {
            qp_num: 2,
            first: 4,
        },
        SideMessage::Announce {
            qp_num: 3,
            message: announce,
        },
        SideMessage::Announce {
            qp_num: 3,
            message: Announce {
                imm: None,
                kind: MessageKind::Send,
                ..announce
            },
        },
        SideMessage::Credit {
            qp_num: 4,
            seq: 5,
            posting: Posting::Whole,
        },
        SideMessage::Credit {
            qp_num: 4,
            seq: 5,
            posting: Posting::Split { posted: 16 },
        },
        SideMessage::Hello {
            qp_num: 6,
            heard: false,
            splits: true,
        },
        SideMessage::Waiting { qp_num: 7, seq: 9 },
        SideMessage::Hello {
            qp_num: 6,
            heard: true,
            splits: false,
        },
    ] {
        let (buf, len) = m.encode();
        assert_eq!(SideMessage::decode(&buf[..len]), Ok(m));
    }
}

/// Hostile bytes give a typed error naming what is wrong.
#[test]
fn hostile_bytes_give_typed_errors() {
    let (buf, len) = SideMessage::Credit {
        qp_num: 4,
        seq: 5,
        posting: Posting::Whole,
    }
    .encode();
    assert_eq!(SideMessage::decode(&[]), Err(WireError::Empty));
    assert_eq!(SideMessage::decode(&[1]), Err(WireError::Empty));
    assert_eq!(SideMessage::decode(&[2, 4]), Err(WireError::Version(2)));
    assert_eq!(SideMessage::decode(&[1, 9]), Err(WireError::Kind(9)));
    assert_eq!(
        SideMessage::decode(&buf[..len - 1]),
        Err(WireError::Length {
            kind: 4,
            want: 17,
            got: 16
        })
    );
    let mut bad = buf;
    bad[len - 1] = 0x80;
    assert_eq!(
        SideMessage::decode(&bad[..len]),
        Err(WireError::Flags(0x80))
    );
    let (hello, n) = SideMessage::Hello {
        qp_num: 6,
        heard: true,
        splits: true,
    }
    .encode();
    assert_eq!(&hello[..n], &[1, 5, 6, 0, 0, 0, 3], "the documented layout");
    let mut bad = hello;
    bad[n - 1] = 4;
    assert_eq!(SideMessage::decode(&bad[..n]), Err(WireError::Flags(4)));
    assert_eq!(
        SideMessage::decode(&hello[..n - 1]),
        Err(WireError::Length {
            kind: 5,
            want: 5,
            got: 4
        })
    );
}

proptest! {
    /// Decoding any bytes never panics.
    #[test]
    fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
        let _ = SideMessage::decode(&bytes);
    }
}

/// One message of a random run: its length, its source cuts, its receive's cuts.
#[derive(Clone, Debug)]
struct Case {
    len: u32,
    src_cuts: Vec<u32>,
    dst_cuts: Vec<u32>,
    imm: Option<u32>,
    /// A WRITE with immediate (its immediate is `imm` or 0) rather than a SEND.
    write: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let len = prop_oneof![1u32..4096, 1u32..=(16 << 20)];
    (
        len,
        proptest::collection::vec(any::<u32>(), 0..5),
        proptest::collection::vec(any::<u32>(), 0..5),
        any::<Option<u32>>(),
        any::<bool>(),
    )
        .prop_map(|(len, src_cuts, dst_cuts, imm, write)| Case {
            len,
            src_cuts,
            dst_cuts,
            imm,
            write,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random SENDs and WRITEs with immediate of 1 B to 16 MiB, random scatter lists on
    /// both sides, chunk sizes below, at and above the message, a receive queue of bounded
    /// room, chunks landing a few at a time: every byte lands in the right place of the
    /// right receive (or remote range), the application's completions come in order with
    /// the whole length and immediate, every request completes once, and the chunks in
    /// flight that consume a receive never outnumber the receives posted (`Pair::run`
    /// asserts it after every chunk; the NIC model panics on a chunk without a receive).
    /// The same over a side channel that loses up to 39 % of its datagrams and delivers
    /// as many twice: the repeats make every loss good and change nothing else.
    #[test]
    fn every_byte_lands_in_its_receive_in_order(
        cases in proptest::collection::vec(case(), 1..4),
        chunk_pick in 0usize..3,
        chunk_raw in 1u32..(1 << 20),
        room in 1u32..400,
        loss in prop_oneof![Just(None), (1u64.., 1u64..40).prop_map(Some)],
    ) {
        let total: u64 = cases.iter().map(|c| u64::from(c.len)).sum();
        let mut pair = Pair::new(total as usize, 32, room.max(1));
        pair.loss = loss;
        let mut announces = VecDeque::new();
        let mut recvs = Vec::new();
        let mut src_base = 0u64;
        let mut dst_base = 0u64;
        let mut sources = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let chunk = match chunk_pick {
                0 => chunk_raw.min(c.len).max(1),
                1 => c.len,
                _ => c.len.saturating_add(chunk_raw),
            };
            // Chunks big enough that a message needs at most four times `room`
            // receives (the queue's depth): one needing more than the queue holds is
            // posted in parts, and the run stays short.
            let chunk = chunk.max(c.len.div_ceil(room.max(1).saturating_mul(4)));
            let src = sges_of(src_base, c.len, &c.src_cuts);
            let dst = sges_of(dst_base, c.len, &c.dst_cuts);
            pair.rx.post_recv(100 + i as u64, &dst).unwrap();
            // A WRITE with immediate lands at the remote address, where the receive's
            // slices would be: the same bytes are checked either way.
            let opcode = match (c.write, c.imm) {
                (true, imm) => Opcode::WriteWithImm { imm: imm.unwrap_or(0) },
                (false, Some(imm)) => Opcode::SendWithImm { imm },
                (false, None) => Opcode::Send,
            };
            announces.push_back(pair.tx.post(request(i as u64, opcode, &src, dst_base), chunk).unwrap());
            recvs.push(dst);
            sources.push(src);
            src_base += u64::from(c.len);
            dst_base += u64::from(c.len);
        }
        pair.run(&mut announces);
        prop_assert_eq!(pair.completions.len(), cases.len());
        prop_assert_eq!(pair.sends_done.len(), cases.len());
        for (i, c) in cases.iter().enumerate() {
            let got = pair.completions[i];
            prop_assert_eq!(got.wr_id, 100 + i as u64);
            prop_assert_eq!(got.status, WC_SUCCESS);
            prop_assert_eq!(got.byte_len, c.len);
            prop_assert_eq!(got.imm, if c.write { Some(c.imm.unwrap_or(0)) } else { c.imm });
            prop_assert_eq!(pair.sends_done[i].wr_id, i as u64);
            prop_assert!(gathered(&pair.mem, &recvs[i], c.len) == expected_at(&sources[i], c.len));
        }
        prop_assert_eq!(pair.tx.chunks_in_flight(), 0);
    }
}

/// What a peer announces cannot make the receiver build more than its queue holds: a
/// 1-byte chunk against a 16 MiB receive is posted whole (one receive: it would need more
/// than MAX_SPLIT_RECEIVES), a message needing more receives than the queue's depth is
/// posted no further than the room the caller gives; and announcements past
/// MAX_ANNOUNCED held are refused.
#[test]
fn an_announcement_never_plans_more_receives_than_the_queue_holds() {
    let mut rx = RecvSide::new(0, 4, 8);
    rx.post_recv(1, &sink(16 << 20)).unwrap();
    rx.post_recv(2, &sink(18 << 10)).unwrap();
    rx.on_announce(send_announce(0, 16 << 20, 1)).unwrap();
    let (recvs, posting, _) = rx.next_posting(8).unwrap();
    assert_eq!((recvs.len(), posting), (1, Posting::Whole));
    rx.on_announce(send_announce(1, 9 << 11, 1 << 11)).unwrap();
    let (recvs, posting, _) = rx.next_posting(8).unwrap();
    assert_eq!((recvs.len(), posting), (8, Posting::Split { posted: 8 }));

    let mut rx = RecvSide::new(0, 4, 8);
    for seq in 0..MAX_ANNOUNCED as u64 {
        rx.on_announce(send_announce(seq, 100, 64)).unwrap();
    }
    assert!(matches!(
        rx.on_announce(send_announce(MAX_ANNOUNCED as u64, 100, 64)),
        Err(TwoSidedError::TooManyAnnounced { held }) if held == MAX_ANNOUNCED
    ));
}

/// A SEND announcement of `len` bytes in chunks of `chunk_bytes`.
fn send_announce(seq: u64, len: u32, chunk_bytes: u32) -> Announce {
    Announce {
        seq,
        len,
        chunk_bytes,
        imm: None,
        kind: MessageKind::Send,
    }
}

/// A message needing more receives than the queue holds (20 chunks, a queue of 8) is
/// posted in parts: a first part once half the queue is free, each later part once room
/// for the rest or for half the queue has freed, each part credited with the receives
/// posted so far; its slices are the receive's in order; the application hears once,
/// with the whole length, when the last chunk lands; the next message's receives wait
/// for the last part (they never interleave), and a repeated announcement is answered
/// with the credit as it stands.
#[test]
fn a_message_longer_than_the_queue_is_posted_in_parts_each_credited() {
    let mut rx = RecvSide::new(0, 4, 8);
    rx.post_recv(1, &sink(20 << 10)).unwrap();
    rx.post_recv(2, &sink(4 << 10)).unwrap();
    rx.on_announce(send_announce(0, 20 << 10, 1 << 10)).unwrap();
    rx.on_announce(send_announce(1, 4 << 10, 1 << 10)).unwrap();
    // Less than half the queue free: nothing yet.
    assert!(rx.next_posting(3).is_none());
    assert!(rx.waits_for_room());
    let (recvs, posting, seq) = rx.next_posting(5).unwrap();
    assert_eq!(
        (recvs.len(), posting, seq),
        (5, Posting::Split { posted: 5 }, 0)
    );
    assert_eq!(
        recvs
            .iter()
            .map(|r| (r.index, r.sges[0].addr))
            .collect::<Vec<_>>(),
        (0..5).map(|i| (i, u64::from(i) << 10)).collect::<Vec<_>>()
    );
    assert_eq!(
        rx.on_announce(send_announce(0, 20 << 10, 1 << 10)),
        Ok(Announced::Repeated(Some(Posting::Split { posted: 5 })))
    );
    let mut posted = 5u32;
    let mut in_queue = 5u32;
    let mut done = Vec::new();
    while posted < 20 {
        // One chunk lands: nothing for the application until the last.
        done.extend(rx.on_recv_done(WC_SUCCESS, 1 << 10, None));
        in_queue -= 1;
        let room = 8 - in_queue;
        match rx.next_posting(room) {
            Some((recvs, Posting::Split { posted: now }, 0)) => {
                assert!(
                    room >= 4 || 20 - posted <= room,
                    "a part of {} posted with {room} free",
                    recvs.len()
                );
                assert_eq!(recvs[0].index, posted);
                posted += recvs.len() as u32;
                in_queue += recvs.len() as u32;
                assert_eq!(now, posted);
                assert!(in_queue <= 8);
            }
            None => assert!(room < 4 && 20 - posted > room),
            other => panic!("not the first message's next part: {other:?}"),
        }
        // The second message waits behind the first's parts whatever the room.
        assert!(rx.waits_for_room());
    }
    assert!(done.is_empty());
    for _ in 0..in_queue - 1 {
        assert!(rx.on_recv_done(WC_SUCCESS, 1 << 10, None).is_none());
    }
    // Every receive of the first message is posted: the second's may go now.
    let (recvs, posting, seq) = rx.next_posting(7).unwrap();
    assert_eq!(
        (recvs.len(), posting, seq),
        (4, Posting::Split { posted: 4 }, 1)
    );
    // Nothing announced is left to post.
    assert!(!rx.waits_for_room());
    let first = rx.on_recv_done(WC_SUCCESS, 1 << 10, None).unwrap();
    assert_eq!(
        (first.wr_id, first.byte_len, first.status),
        (1, 20 << 10, WC_SUCCESS)
    );
}

/// A receiver waits for room only when it has receives to post: not with an announcement
/// and no application receive for it, nor with a receive and nothing announced, and no
/// longer once the message fits and is posted.
#[test]
fn waiting_for_room_is_told_apart_from_waiting_for_the_other_side() {
    let mut rx = RecvSide::new(0, 4, 8);
    assert!(!rx.waits_for_room());
    rx.on_announce(send_announce(0, 4 << 10, 1 << 10)).unwrap();
    assert!(!rx.waits_for_room(), "no application receive yet");
    rx.post_recv(1, &sink(4 << 10)).unwrap();
    assert!(rx.waits_for_room());
    assert!(rx.next_posting(3).is_none());
    assert!(rx.waits_for_room(), "4 receives need room for 4");
    assert!(rx.next_posting(4).is_some());
    assert!(!rx.waits_for_room());
    rx.post_recv(2, &sink(4 << 10)).unwrap();
    assert!(
        !rx.waits_for_room(),
        "nothing announced for the second receive"
    );
}

/// The sender of a message credited in parts sends no chunk past the receives credited,
/// hands each new credit to [`SendSide::take_credited`] once and takes the message out
/// when the credit is complete; a credit that shrinks is refused; while the credit is
/// partial the announcement is repeated, and each credit starts its wait again.
#[test]
fn a_sender_follows_a_credit_given_in_parts() {
    let mut tx = SendSide::new(0, 4);
    let a = tx
        .post(request(9, Opcode::Send, &source(10 << 10), 0), 1 << 10)
        .unwrap();
    assert_eq!(a.chunks(), 10);
    tx.on_credit(0, Posting::Split { posted: 4 }).unwrap();
    assert_eq!(tx.take_credited(), Some((0, Posting::Split { posted: 4 })));
    assert_eq!(tx.take_credited(), None);
    assert!(matches!(
        tx.on_credit(0, Posting::Split { posted: 3 }),
        Err(TwoSidedError::BadCredit { seq: 0 })
    ));
    // Not complete: repeated after its wait, and the give-up clock runs.
    assert!(tx.reannounce(0).is_empty());
    assert_eq!(tx.uncredited_since(), Some(0));
    assert_eq!(tx.reannounce(ANNOUNCE_RETRY_NS), vec![a]);
    // A credit, even one that adds nothing, says the peer is there.
    tx.on_credit(0, Posting::Split { posted: 4 }).unwrap();
    assert_eq!(tx.uncredited_since(), None);
    assert_eq!(tx.take_credited(), None);
    tx.on_credit(0, Posting::Split { posted: 10 }).unwrap();
    assert_eq!(tx.take_credited(), Some((0, Posting::Split { posted: 10 })));
    assert_eq!(tx.outstanding(), 0);
    assert!(tx.reannounce(10 * ANNOUNCE_RETRY_MAX_NS).is_empty());

    // Sent chunk by chunk, never past the credit.
    let mut tx = SendSide::new(0, 4);
    tx.post(request(9, Opcode::Send, &source(10 << 10), 0), 1 << 10)
        .unwrap();
    tx.on_credit(0, Posting::Split { posted: 3 }).unwrap();
    let sent: Vec<u32> = std::iter::from_fn(|| tx.next_chunk())
        .map(|c| c.index)
        .collect();
    assert_eq!(sent, vec![0, 1, 2]);
    tx.on_credit(0, Posting::Split { posted: 10 }).unwrap();
    assert_eq!(std::iter::from_fn(|| tx.next_chunk()).count(), 7);
}

/// A hello goes at once, again every [`HELLO_RETRY_NS`] while unanswered, at most
/// [`HELLO_TRIES`] times, and then the peer is given up on.
#[test]
fn an_unanswered_hello_is_retried_then_given_up() {
    let mut g = Greeting::new();
    assert_eq!(g.due(0), Some(false));
    assert_eq!(g.due(HELLO_RETRY_NS - 1), None);
    let mut now = HELLO_RETRY_NS;
    let mut sent = 1;
    while let Some(heard) = g.due(now) {
        assert!(!heard);
        sent += 1;
        now += HELLO_RETRY_NS;
    }
    assert_eq!(sent, HELLO_TRIES);
    assert!(!g.agreed());
    assert!(!g.gave_up(now - HELLO_RETRY_NS - 1));
    assert!(g.gave_up(now));
}

/// Two ends that each send a hello, with any of them lost, end agreed on both sides, and
/// nothing is due after: neither end answers an answer.
#[test]
fn two_greetings_agree_and_fall_silent() {
    for lose_first in [false, true] {
        let (mut a, mut b) = (Greeting::new(), Greeting::new());
        let mut now = 0;
        for round in 0..10 {
            let to_b = a.due(now);
            let to_a = b.due(now);
            if let Some(h) = to_b {
                if !(lose_first && round == 0) {
                    b.on_hello(h);
                }
            }
            if let Some(h) = to_a {
                a.on_hello(h);
            }
            // Answers go within the same instant.
            while let Some(h) = b.due(now) {
                a.on_hello(h);
            }
            while let Some(h) = a.due(now) {
                b.on_hello(h);
            }
            now += HELLO_RETRY_NS;
        }
        assert!(a.agreed() && b.agreed(), "lose_first {lose_first}");
        assert_eq!((a.due(now), b.due(now)), (None, None));
    }
}

/// A peer that keeps sending hellos saying it has not heard gets at most
/// [`HELLO_TRIES`] answers.
#[test]
fn a_peer_repeating_hellos_gets_a_bounded_number_of_answers() {
    let mut g = Greeting::new();
    let mut answers = 0;
    for _ in 0..10 * HELLO_TRIES {
        g.on_hello(false);
        if g.due(0).is_some() {
            answers += 1;
        }
    }
    // The first due at time 0 is the timer's own hello, the rest answers.
    assert!(answers <= HELLO_TRIES + 1, "{answers}");
    assert!(g.agreed());
}

proptest! {
    /// Whatever the peer sends and whenever, one end sends at most [`HELLO_TRIES`]
    /// hellos on its timer and as many answers.
    #[test]
    fn hellos_sent_are_bounded(events in proptest::collection::vec((any::<bool>(), any::<bool>(), 0u64..3), 0..400)) {
        let mut g = Greeting::new();
        let mut now = 0;
        let mut sent = 0;
        for (arrives, peer_heard, step) in events {
            if arrives {
                g.on_hello(peer_heard);
            }
            while g.due(now).is_some() {
                sent += 1;
                prop_assert!(sent <= 2 * HELLO_TRIES);
            }
            now += step * HELLO_RETRY_NS;
        }
    }
}

/// A lost announcement is sent again after [`ANNOUNCE_RETRY_NS`], then after waits that
/// double up to [`ANNOUNCE_RETRY_MAX_NS`]; its credit stops the repeats. A lost credit is
/// sent again when the announcement repeats; a credit for a message already completed
/// is ignored.
#[test]
fn announcements_repeat_until_credited_and_a_repeat_brings_the_credit_again() {
    let mut tx = SendSide::new(0, 4);
    let src = source(3000);
    let a = tx.post(request(1, Opcode::Send, &src, 0), 1000).unwrap();
    assert!(
        tx.reannounce(0).is_empty(),
        "first seen: the announcement just went"
    );
    assert_eq!(tx.uncredited_since(), Some(0));
    assert!(tx.reannounce(ANNOUNCE_RETRY_NS - 1).is_empty());
    assert_eq!(tx.reannounce(ANNOUNCE_RETRY_NS), vec![a]);
    assert!(
        tx.reannounce(2 * ANNOUNCE_RETRY_NS).is_empty(),
        "the second wait doubles"
    );
    assert_eq!(tx.reannounce(3 * ANNOUNCE_RETRY_NS), vec![a]);
    let mut now = 3 * ANNOUNCE_RETRY_NS;
    for _ in 0..20 {
        now += ANNOUNCE_RETRY_MAX_NS;
        assert_eq!(tx.reannounce(now), vec![a], "the wait stops growing");
    }
    // The receiver took it and posted it; its credit was lost: the repeat brings it again.
    let mut rx = RecvSide::new(0, 4, 64);
    rx.post_recv(9, &sink(3000)).unwrap();
    assert_eq!(rx.on_announce(a), Ok(Announced::Taken));
    let (_, posting, seq) = rx.next_posting(64).unwrap();
    assert_eq!(rx.on_announce(a), Ok(Announced::Repeated(Some(posting))));
    tx.on_credit(seq, posting).unwrap();
    assert!(
        tx.reannounce(now + ANNOUNCE_RETRY_MAX_NS).is_empty(),
        "credited: no repeat"
    );
    assert_eq!(tx.uncredited_since(), None);
    while let Some(c) = tx.next_chunk() {
        tx.on_chunk_done(c.seq, WC_SUCCESS);
    }
    assert_eq!(tx.outstanding(), 0);
    assert_eq!(
        tx.on_credit(seq, posting),
        Ok(()),
        "a late repeat of the credit"
    );
}

/// A message taken and not yet paired with an application receive is waiting: a repeat
/// of its announcement is answered as such; once posted, with its credit.
#[test]
fn a_repeated_announcement_without_an_application_receive_is_answered_as_waiting() {
    let mut rx = RecvSide::new(0, 4, 64);
    let a = Announce {
        seq: 0,
        len: 10,
        chunk_bytes: 4096,
        imm: None,
        kind: MessageKind::Send,
    };
    assert_eq!(rx.on_announce(a), Ok(Announced::Taken));
    assert!(rx.waiting(0));
    assert!(!rx.waiting(1), "never announced");
    assert_eq!(rx.on_announce(a), Ok(Announced::Repeated(None)));
    rx.post_recv(
        1,
        &[Sge {
            addr: 0,
            length: 64,
            lkey: 1,
        }],
    )
    .unwrap();
    let (_, posting, seq) = rx.next_posting(64).unwrap();
    assert_eq!((seq, posting), (0, Posting::Whole));
    assert!(!rx.waiting(0));
    assert_eq!(rx.on_announce(a), Ok(Announced::Repeated(Some(posting))));
}
