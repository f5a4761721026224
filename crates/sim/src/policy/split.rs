//! Split SENDs in the simulator: the shapers' side-channel protocol of
//! [`justitia_core::two_sided`], carried out as a shaper on each host would.
//!
//! A bandwidth flow's SEND is announced on the side channel when the application posts it
//! ([`SplitSender::post`]); the receiving host's policy pairs the announcement with the
//! application's receive and posts receives for it (the core's [`RecvSide`]), and returns a
//! credit; the sender's shaper hands chunks to the RNIC only against that credit, as its
//! pacer allows ([`SplitSender::ready_bytes`], [`SplitSender::next_chunk`]). So a split SEND
//! costs what it would ship: its announcement and credit, each a SEND of its encoded bytes
//! on the side channel (a connection of the policies' own between the two hosts, over the
//! same links as the data, seen by the receiving policy [`SIDE_CHANNEL_POLL`] after the
//! RNIC delivered it), and a side-channel round trip before its first chunk may go. A
//! message no larger than the chunk goes whole, still announced and credited.
//!
//! Assumed, and said so in `docs/simulator.md`: the simulated applications keep receives
//! posted (the RNIC model has no receive queue to run dry), so the receiving policy stands
//! in an application receive of the message's length when the announcement arrives;
//! posting receives costs the receiver's CPU, not modelled; the two shapers agree on the
//! protocol when the connection is set up (the offer and accept, one side-channel round
//! trip before the first message, are not simulated); the side channel is a reliable
//! connection here where the shaper's is a UD queue pair, so its acknowledgements are
//! extra wire the shaper's would not cost.

use std::collections::BTreeMap;

use justitia_core::chunk::{self, SendFlags, Sge, SgeList};
use justitia_core::two_sided::{Posting, RecvSide, SendSide, SideMessage, WC_SUCCESS};

#[cfg(doc)]
use super::SIDE_CHANNEL_POLL;
use super::{PolicyContext, PolicyFigures, PolicyMessage};
use crate::rnic::QpId;
use crate::topology::HostId;

/// Tags of side-channel SENDs: at or above this, so that they never meet a shaper's.
pub const SIDE_TAG: u64 = 1 << 60;

/// Most SGEs the simulated receives and chunks use: the simulated messages have one.
const MAX_SGE: usize = 1;

/// One queue pair's sending half: the core's [`SendSide`] and where its announcements go.
pub struct SplitSender {
    side: SendSide,
    /// The host at the other end.
    peer: HostId,
    /// The queue pair at the other end, named in the announcements.
    peer_qp: QpId,
    /// Announcements made and not yet handed to the side channel.
    outbox: Vec<SideMessage>,
}

impl SplitSender {
    /// The sending half of `qp`, whose other end is `peer_qp` on `peer`.
    pub fn new(peer: HostId, peer_qp: QpId) -> Self {
        SplitSender {
            side: SendSide::new(0, MAX_SGE),
            peer,
            peer_qp,
            outbox: Vec::new(),
        }
    }

    /// The application posted a SEND of `bytes` under `app_tag`, cut to `chunk_bytes`:
    /// queues it and its announcement. Returns its number, `None` if the core refused it
    /// (the caller sends it whole and unannounced then; the receiver passes an
    /// unannounced message through).
    pub fn post(&mut self, app_tag: u64, bytes: u32, chunk_bytes: u32) -> Option<u64> {
        let mut sges = SgeList::new();
        if bytes > 0 {
            sges.push(Sge {
                addr: 0x1000,
                length: bytes,
                lkey: 1,
            })
            .ok()?;
        }
        let request = chunk::WorkRequest {
            wr_id: app_tag,
            opcode: chunk::Opcode::Send,
            sges,
            remote: None,
            flags: SendFlags {
                signaled: true,
                ..SendFlags::default()
            },
        };
        let message = self.side.post(request, chunk_bytes.max(1)).ok()?;
        self.outbox.push(SideMessage::Announce {
            qp_num: self.peer_qp.0,
            message,
        });
        Some(message.seq)
    }

    /// Bytes of the chunk that may go now, `None` while the next waits for its credit.
    pub fn ready_bytes(&self) -> Option<u32> {
        self.side.ready_bytes()
    }

    /// The chunk that may go now: its message's number, its bytes, whether it is the
    /// message's last.
    pub fn next_chunk(&mut self) -> Option<(u64, u32, bool)> {
        let chunk = self.side.next_chunk()?;
        let bytes = u32::try_from(chunk.request.sges.total_bytes()).unwrap_or(u32::MAX);
        Some((chunk.seq, bytes, chunk.is_last))
    }

    /// A chunk of message `seq` completed: the application's tag when it was the last.
    pub fn chunk_done(&mut self, seq: u64) -> Option<u64> {
        self.side
            .on_chunk_done(seq, WC_SUCCESS)
            .map(|done| done.wr_id)
    }

    /// The receiver's credit for message `seq`.
    pub fn on_credit(&mut self, seq: u64, posting: Posting) {
        // A credit the core refuses is dropped: the message waits, as it would for a
        // credit that never came.
        let _ = self.side.on_credit(seq, posting);
    }

    /// Announcements to send, and the host they go to.
    pub fn take_outbox(&mut self) -> (HostId, Vec<SideMessage>) {
        (self.peer, std::mem::take(&mut self.outbox))
    }
}

/// What the protocol cost and did on one host.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    announces: u64,
    credits: u64,
    /// Wire bytes of the side-channel messages sent: encoded bytes and packet headers.
    side_wire_bytes: u64,
    /// SENDs announced, and of them split into two or more chunks.
    messages: u64,
    split: u64,
    /// Payload bytes of the announced SENDs.
    message_bytes: u64,
    refused: u64,
}

/// A host's side channel and receiving halves: one connection per peer host (standing for
/// the shaper's one UD queue pair per process), and a [`RecvSide`] per application queue
/// pair that receives announced SENDs.
pub struct SideChannel {
    channels: BTreeMap<HostId, QpId>,
    receivers: BTreeMap<QpId, RecvSide>,
    header_bytes: u32,
    next_tag: u64,
    counts: Counts,
}

impl SideChannel {
    /// A side channel whose messages each cost `header_bytes` of packet headers on the wire.
    pub fn new(header_bytes: u32) -> Self {
        SideChannel {
            channels: BTreeMap::new(),
            receivers: BTreeMap::new(),
            header_bytes,
            next_tag: SIDE_TAG,
            counts: Counts::default(),
        }
    }

    /// Whether `tag` is a side-channel SEND's (its completion is the channel's alone).
    pub fn owns_tag(tag: u64) -> bool {
        tag >= SIDE_TAG
    }

    /// Sends a sender's announcements.
    pub fn flush(&mut self, ctx: &mut PolicyContext<'_>, sender: &mut SplitSender) {
        let (peer, messages) = sender.take_outbox();
        for message in messages {
            if let SideMessage::Announce { message: a, .. } = message {
                self.counts.announces += 1;
                self.counts.messages += 1;
                self.counts.split += u64::from(a.chunks() > 1);
                self.counts.message_bytes += u64::from(a.len);
            }
            self.send(ctx, peer, message);
        }
    }

    fn send(&mut self, ctx: &mut PolicyContext<'_>, peer: HostId, message: SideMessage) {
        let qp = *self
            .channels
            .entry(peer)
            .or_insert_with(|| ctx.connect_side_channel(peer));
        let (buf, len) = message.encode();
        let tag = self.next_tag;
        self.next_tag += 1;
        self.counts.side_wire_bytes += (len as u64) + u64::from(self.header_bytes);
        let bytes = u32::try_from(len).unwrap_or(u32::MAX);
        ctx.send_on_wire(qp, PolicyMessage::Side(buf[..len].to_vec()), bytes, tag);
    }

    /// A side-channel message from `from` arrived. An announcement is answered here with
    /// a credit; a credit is returned for the sending shaper: its queue pair, message and
    /// posting.
    pub fn on_message(
        &mut self,
        ctx: &mut PolicyContext<'_>,
        from: HostId,
        bytes: &[u8],
    ) -> Option<(QpId, u64, Posting)> {
        match SideMessage::decode(bytes) {
            Ok(SideMessage::Announce { qp_num, message }) => {
                self.on_announce(ctx, from, QpId(qp_num), message);
                None
            }
            Ok(SideMessage::Credit {
                qp_num,
                seq,
                posting,
            }) => Some((QpId(qp_num), seq, posting)),
            Ok(_) | Err(_) => {
                self.counts.refused += 1;
                None
            }
        }
    }

    /// The receiving shaper: stands in the application's receive (see the module doc),
    /// posts the message's receives and credits them.
    fn on_announce(
        &mut self,
        ctx: &mut PolicyContext<'_>,
        from: HostId,
        qp: QpId,
        message: justitia_core::two_sided::Announce,
    ) {
        let rx = self
            .receivers
            .entry(qp)
            // The simulated applications' receive queues have no depth to run out of.
            .or_insert_with(|| RecvSide::new(0, MAX_SGE, u32::MAX));
        let receive = Sge {
            addr: 0x1000,
            length: message.len.max(1),
            lkey: 1,
        };
        if rx.on_announce(message).is_err() || rx.post_recv(message.seq, &[receive]).is_err() {
            self.counts.refused += 1;
            return;
        }
        let sender_qp = ctx.peer_of(qp);
        let mut credits = Vec::new();
        while let Some((_receives, posting, seq)) = rx.next_posting(u32::MAX) {
            credits.push(SideMessage::Credit {
                qp_num: sender_qp.0,
                seq,
                posting,
            });
        }
        for credit in credits {
            self.counts.credits += 1;
            self.send(ctx, from, credit);
        }
    }

    /// The RNIC delivered `bytes` on application queue pair `qp`: what the application is
    /// told. A queue pair with announced messages landing hears once per message, with its
    /// whole length; any other delivery passes.
    pub fn on_delivery(&mut self, qp: QpId, bytes: u32) -> Option<u32> {
        match self.receivers.get_mut(&qp) {
            Some(rx) if rx.landing() > 0 => rx
                .on_recv_done(WC_SUCCESS, bytes, None)
                .map(|done| done.byte_len),
            _ => Some(bytes),
        }
    }

    /// The protocol's figures, for the policy's: messages, splits and the side channel's
    /// wire bytes against the announced messages' payload.
    pub fn figures(&self, f: &mut PolicyFigures) {
        let c = self.counts;
        if c.messages == 0 && c.credits == 0 {
            return;
        }
        f.insert("split_send_messages".into(), c.messages as f64);
        f.insert("split_send_split".into(), c.split as f64);
        f.insert("split_send_bytes".into(), c.message_bytes as f64);
        f.insert("side_announces".into(), c.announces as f64);
        f.insert("side_credits".into(), c.credits as f64);
        f.insert("side_wire_bytes".into(), c.side_wire_bytes as f64);
        if c.refused > 0 {
            f.insert("side_refused".into(), c.refused as f64);
        }
    }
}
