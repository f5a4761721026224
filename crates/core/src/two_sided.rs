//! Splitting two-sided requests: the protocol two shapers speak so that a SEND (with or
//! without immediate) or a WRITE with immediate can go as chunks (Justitia §5.2: the sender
//! tells the receiver of chunk sizes, and the receiver posts receives for the chunks ahead
//! of them).
//!
//! A SEND consumes one receive at the peer, and a receive queue is FIFO: a SEND cut into n
//! chunks needs n receives posted, in order, exactly where the application's one receive
//! would have been. So the receiving shaper owns the queue pair's receive queue: it holds
//! the application's receives and, for each message the sender announces on the side
//! channel, posts either the application's receive whole or one receive per chunk whose
//! scatter list is the matching slice of the application's (zero copy). It returns a
//! credit naming how many receives it posted, and the sender sends a chunk only against a
//! credit, so splitting never causes an RNR. The design and its reasons are in
//! `docs/architecture.md` ("Splitting two-sided requests").
//!
//! This module is the protocol's state, pure: no I/O, no clock. [`SenderAgreement`] and
//! [`ReceiverAgreement`] decide from which message a queue pair's requests are announced
//! (the receiver's offer, the sender's accept; before it, and for ever with a peer that
//! never offers, everything goes whole); [`SendSide`] is then the sending shaper's half for
//! the queue pair, [`RecvSide`] the receiving shaper's, and [`SideMessage`] the side
//! channel's wire format ([`SideMessage::encode`], [`SideMessage::decode`], which never
//! panics on hostile bytes).
//!
//! Invariants:
//! - a message's chunks are the byte ranges `[i * chunk, min((i + 1) * chunk, len))` of
//!   its stream on both sides, with the chunk size the announcement carries, so the sender's
//!   i-th chunk lands in exactly the receiver's i-th internal receive of that message;
//! - the sender never has posted more receive-consuming chunks of a message than the
//!   receiver's credit for it says it posted receives;
//! - messages are announced, credited, sent and completed in the order posted;
//! - the application sees one completion per message, with the message's whole length and
//!   its immediate data, after its last chunk landed (receiver) or completed (sender);
//! - teardown hands back every application request and receive not yet completed, so the
//!   caller can flush them: nothing is left pending;
//! - the sender marks solicited the chunk that ends each message, and an announced message
//!   that goes whole, so that a receiver may arm its receive CQ for solicited completions
//!   only and still see each message's completion (the marking is the sending shaper's, on
//!   the work requests it posts; see `docs/architecture.md`, "Events");
//! - the side channel is a datagram service: a lost announcement is sent again until its
//!   credit comes ([`SendSide::reannounce`]), a lost credit is sent again when its
//!   announcement repeats ([`Announced::Repeated`]), and repeats and reorderings change
//!   nothing ([`RecvSide::on_announce`], [`SendSide::on_credit`]).

use std::collections::VecDeque;

use crate::chunk::{ChunkError, Opcode, Sge, SgeList, WorkRequest, MAX_SGES};

/// The protocol version this module speaks. A peer that offers any other is treated as an
/// unshaped one: its requests go whole.
pub const VERSION: u8 = 1;

/// `IBV_WC_SUCCESS`.
pub const WC_SUCCESS: u32 = 0;
/// `IBV_WC_LOC_LEN_ERR`: a receive too short for its message (what the RNIC reports
/// natively), or a chunk that did not fill its slice.
pub const WC_LOC_LEN_ERR: u32 = 1;
/// `IBV_WC_WR_FLUSH_ERR`: the request was flushed when its queue pair went to error or was
/// torn down.
pub const WC_WR_FLUSH_ERR: u32 = 5;

/// Which two-sided operation a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// SEND or SEND with immediate: every chunk consumes a receive.
    Send,
    /// WRITE with immediate: the chunks are WRITEs, the last carries the immediate and
    /// consumes the one receive.
    WriteWithImm,
}

/// The announcement of one message, sent when the application posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Announce {
    /// The message's number on its queue pair, from the first announced one.
    pub seq: u64,
    /// Its length in bytes.
    pub len: u32,
    /// The chunk size it is cut to; a message no longer than it goes whole.
    pub chunk_bytes: u32,
    /// Its immediate data, if any.
    pub imm: Option<u32>,
    /// SEND or WRITE with immediate.
    pub kind: MessageKind,
}

impl Announce {
    /// How many chunks the message goes as if the receiver posts it split.
    pub fn chunks(&self) -> u32 {
        if self.len <= self.chunk_bytes {
            1
        } else {
            self.len.div_ceil(self.chunk_bytes)
        }
    }

    /// How many receives the message consumes when split: one per chunk for a SEND, one
    /// (the last chunk's) for a WRITE with immediate.
    pub fn receives_when_split(&self) -> u32 {
        match self.kind {
            MessageKind::Send => self.chunks(),
            MessageKind::WriteWithImm => 1,
        }
    }
}

/// How the receiver posted receives for a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Posting {
    /// The application's receive as it is: the message must go whole (it fits one chunk,
    /// it is longer than the receive and must fail natively, or the slices would need more
    /// SGEs than a receive holds).
    Whole,
    /// This many of the message's split receives are posted so far (cumulative).
    Split {
        /// Receives posted for the message.
        posted: u32,
    },
}

/// One side-channel message, tagged with the application queue pair's number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SideMessage {
    /// Receiver to sender: I shape this queue pair's receives; announce every message from
    /// number `first` on (the receives before it were posted whole).
    Offer {
        /// The application queue pair's number at the sender.
        qp_num: u32,
        /// The first message to announce.
        first: u64,
    },
    /// Sender to receiver: agreed; messages before `first` went or go whole.
    Accept {
        /// The application queue pair's number at the receiver.
        qp_num: u32,
        /// The first announced message: the larger of the offer's and what the sender had
        /// already sent whole.
        first: u64,
    },
    /// Sender to receiver: a message was posted.
    Announce {
        /// The application queue pair's number at the receiver.
        qp_num: u32,
        /// The message.
        message: Announce,
    },
    /// Either end, once the daemons paired the queue pair: "I shape the other end of your
    /// queue pair `qp_num` and speak this version" (the version byte every message
    /// carries). The two hellos are the agreement on the version; the offer follows them.
    /// `heard`: the sender has had the receiver's hello (so it need not be answered).
    /// `splits`: the sender would split its two-sided requests on the queue pair, so the
    /// receiver offers to own its receives (a peer that never splits is never offered,
    /// and its receiver never holds a receive for it).
    Hello {
        /// The application queue pair's number at the receiver.
        qp_num: u32,
        /// The sender has had the receiver's hello.
        heard: bool,
        /// The sender splits its SENDs and WRITEs with immediate on the queue pair.
        splits: bool,
    },
    /// Receiver to sender, answering a repeated announcement of message `seq`: it is
    /// taken and waits for an application receive. The sender then knows its peer is
    /// there (and does not give up on it) while the peer's application takes its time.
    Waiting {
        /// The application queue pair's number at the sender.
        qp_num: u32,
        /// The message.
        seq: u64,
    },
    /// Receiver to sender: receives posted for message `seq`.
    Credit {
        /// The application queue pair's number at the sender.
        qp_num: u32,
        /// The message.
        seq: u64,
        /// What is posted for it.
        posting: Posting,
    },
}

/// Why bytes from the side channel are not a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Nothing arrived.
    #[error("empty side-channel message")]
    Empty,
    /// A version this end does not speak.
    #[error("side-channel version {0}, this end speaks {VERSION}")]
    Version(u8),
    /// An unknown kind byte.
    #[error("unknown side-channel message kind {0}")]
    Kind(u8),
    /// Fewer or more bytes than the kind has.
    #[error("side-channel message of kind {kind} is {got} bytes, not {want}")]
    Length {
        /// The kind byte.
        kind: u8,
        /// Its length.
        want: usize,
        /// What arrived.
        got: usize,
    },
    /// A flags byte with bits this version does not define.
    #[error("side-channel flags {0:#04x} not defined in version {VERSION}")]
    Flags(u8),
    /// An announcement whose chunk size is zero.
    #[error("announcement with a chunk size of 0")]
    ZeroChunk,
}

const KIND_OFFER: u8 = 1;
const KIND_ACCEPT: u8 = 2;
const KIND_ANNOUNCE: u8 = 3;
const KIND_CREDIT: u8 = 4;
const KIND_HELLO: u8 = 5;
const KIND_WAITING: u8 = 6;
const FLAG_IMM: u8 = 1;
const FLAG_WRITE: u8 = 2;
const FLAG_WHOLE: u8 = 4;
const FLAG_HEARD: u8 = 1;
const FLAG_SPLITS: u8 = 2;

/// The longest encoded message: an announcement.
pub const MAX_WIRE_BYTES: usize = 2 + 4 + 8 + 4 + 4 + 4 + 1;

impl SideMessage {
    /// The wire bytes: version, kind, queue pair number, then the kind's fields, all
    /// little-endian; returns the buffer and how much of it is used.
    pub fn encode(&self) -> ([u8; MAX_WIRE_BYTES], usize) {
        let mut w = Writer::default();
        w.put(&[VERSION]);
        match *self {
            SideMessage::Offer { qp_num, first }
            | SideMessage::Accept { qp_num, first }
            | SideMessage::Waiting { qp_num, seq: first } => {
                let kind = match self {
                    SideMessage::Offer { .. } => KIND_OFFER,
                    SideMessage::Waiting { .. } => KIND_WAITING,
                    _ => KIND_ACCEPT,
                };
                w.put(&[kind]);
                w.put(&qp_num.to_le_bytes());
                w.put(&first.to_le_bytes());
            }
            SideMessage::Announce { qp_num, message } => {
                w.put(&[KIND_ANNOUNCE]);
                w.put(&qp_num.to_le_bytes());
                w.put(&message.seq.to_le_bytes());
                w.put(&message.len.to_le_bytes());
                w.put(&message.chunk_bytes.to_le_bytes());
                w.put(&message.imm.unwrap_or(0).to_le_bytes());
                let mut flags = 0;
                if message.imm.is_some() {
                    flags |= FLAG_IMM;
                }
                if message.kind == MessageKind::WriteWithImm {
                    flags |= FLAG_WRITE;
                }
                w.put(&[flags]);
            }
            SideMessage::Credit {
                qp_num,
                seq,
                posting,
            } => {
                w.put(&[KIND_CREDIT]);
                w.put(&qp_num.to_le_bytes());
                w.put(&seq.to_le_bytes());
                let (posted, flags) = match posting {
                    Posting::Whole => (1, FLAG_WHOLE),
                    Posting::Split { posted } => (posted, 0),
                };
                w.put(&posted.to_le_bytes());
                w.put(&[flags]);
            }
            SideMessage::Hello {
                qp_num,
                heard,
                splits,
            } => {
                w.put(&[KIND_HELLO]);
                w.put(&qp_num.to_le_bytes());
                let mut flags = 0;
                if heard {
                    flags |= FLAG_HEARD;
                }
                if splits {
                    flags |= FLAG_SPLITS;
                }
                w.put(&[flags]);
            }
        }
        (w.buf, w.len)
    }

    /// Reads one message, checking its version, kind, exact length and flags.
    pub fn decode(bytes: &[u8]) -> Result<SideMessage, WireError> {
        let (&version, rest) = bytes.split_first().ok_or(WireError::Empty)?;
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        let (&kind, body) = rest.split_first().ok_or(WireError::Empty)?;
        let want = match kind {
            KIND_OFFER | KIND_ACCEPT | KIND_WAITING => 12,
            KIND_ANNOUNCE => 25,
            KIND_CREDIT => 17,
            KIND_HELLO => 5,
            other => return Err(WireError::Kind(other)),
        };
        if body.len() != want {
            return Err(WireError::Length {
                kind,
                want,
                got: body.len(),
            });
        }
        let mut r = Reader { body };
        let qp_num = r.u32();
        match kind {
            KIND_OFFER => Ok(SideMessage::Offer {
                qp_num,
                first: r.u64(),
            }),
            KIND_ACCEPT => Ok(SideMessage::Accept {
                qp_num,
                first: r.u64(),
            }),
            KIND_WAITING => Ok(SideMessage::Waiting {
                qp_num,
                seq: r.u64(),
            }),
            KIND_ANNOUNCE => decode_announce(qp_num, &mut r),
            KIND_HELLO => match r.u8() {
                flags if flags & !(FLAG_HEARD | FLAG_SPLITS) == 0 => Ok(SideMessage::Hello {
                    qp_num,
                    heard: flags & FLAG_HEARD != 0,
                    splits: flags & FLAG_SPLITS != 0,
                }),
                other => Err(WireError::Flags(other)),
            },
            _ => decode_credit(qp_num, &mut r),
        }
    }
}

fn decode_announce(qp_num: u32, r: &mut Reader<'_>) -> Result<SideMessage, WireError> {
    let (seq, len, chunk_bytes, imm, flags) = (r.u64(), r.u32(), r.u32(), r.u32(), r.u8());
    if flags & !(FLAG_IMM | FLAG_WRITE) != 0 {
        return Err(WireError::Flags(flags));
    }
    if chunk_bytes == 0 {
        return Err(WireError::ZeroChunk);
    }
    let kind = if flags & FLAG_WRITE != 0 {
        MessageKind::WriteWithImm
    } else {
        MessageKind::Send
    };
    let imm = (flags & FLAG_IMM != 0).then_some(imm);
    if kind == MessageKind::WriteWithImm && imm.is_none() {
        // A WRITE without immediate consumes no receive and is never announced.
        return Err(WireError::Flags(flags));
    }
    Ok(SideMessage::Announce {
        qp_num,
        message: Announce {
            seq,
            len,
            chunk_bytes,
            imm,
            kind,
        },
    })
}

fn decode_credit(qp_num: u32, r: &mut Reader<'_>) -> Result<SideMessage, WireError> {
    let (seq, posted, flags) = (r.u64(), r.u32(), r.u8());
    let posting = match flags {
        FLAG_WHOLE => Posting::Whole,
        0 => Posting::Split { posted },
        other => return Err(WireError::Flags(other)),
    };
    Ok(SideMessage::Credit {
        qp_num,
        seq,
        posting,
    })
}

#[derive(Default)]
struct Writer {
    buf: [u8; MAX_WIRE_BYTES],
    len: usize,
}

impl Writer {
    /// Appends; every message's fields fit [`MAX_WIRE_BYTES`], so nothing is cut.
    fn put(&mut self, bytes: &[u8]) {
        let end = (self.len + bytes.len()).min(MAX_WIRE_BYTES);
        let n = end - self.len;
        self.buf[self.len..end].copy_from_slice(&bytes[..n]);
        self.len = end;
    }
}

/// Reads fields from a body whose length was checked against its kind, so no read runs
/// short; a short one would read zeros rather than panic.
struct Reader<'a> {
    body: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        let n = N.min(self.body.len());
        out[..n].copy_from_slice(&self.body[..n]);
        self.body = &self.body[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

/// Why the protocol refused an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TwoSidedError {
    /// Only SEND, SEND with immediate and WRITE with immediate consume receives.
    #[error("{0} is not a two-sided request")]
    NotTwoSided(Opcode),
    /// The request's shape (SGEs, length) is not one a work request can have.
    #[error(transparent)]
    Shape(#[from] ChunkError),
    /// A chunk size of zero.
    #[error("chunk size must be at least 1 byte")]
    ZeroChunk,
    /// An accept that does not answer the offer (below it, without one, or changed).
    #[error("accept from message {got} does not answer the offer of {want}")]
    BadAccept {
        /// The number expected next.
        want: u64,
        /// The number that arrived.
        got: u64,
    },
    /// More announcements held than [`MAX_ANNOUNCED`]: a peer announcing without end.
    #[error("{held} announcements already held ahead of the application's receives")]
    TooManyAnnounced {
        /// Announcements held.
        held: usize,
    },
    /// A credit for a message not outstanding, or claiming more receives than its chunks.
    #[error("credit for message {seq} does not match an outstanding message")]
    BadCredit {
        /// The message it names.
        seq: u64,
    },
}

/// The byte range `[offset, offset + len)` of an SGE list's stream as a list of its own.
/// `None` when the range needs more than `max_sge` SGEs or runs past the list's end.
pub fn slice_sges(sges: &[Sge], offset: u64, len: u64, max_sge: usize) -> Option<SgeList> {
    let mut out = SgeList::new();
    let (mut skip, mut want) = (offset, len);
    for sge in sges {
        if want == 0 {
            break;
        }
        let length = u64::from(sge.length);
        if skip >= length {
            skip -= length;
            continue;
        }
        let take = (length - skip).min(want);
        if out.len() >= max_sge.min(MAX_SGES) {
            return None;
        }
        // Cannot fail: the count was checked against MAX_SGES just above.
        out.push(Sge {
            addr: sge.addr.checked_add(skip)?,
            length: u32::try_from(take).ok()?,
            lkey: sge.lkey,
        })
        .ok()?;
        want -= take;
        skip = 0;
    }
    (want == 0).then_some(out)
}

/// How long a hello waits for the peer's before it is sent again.
pub const HELLO_RETRY_NS: u64 = 100_000_000;

/// Hellos sent without hearing the peer's before it is taken as not answering (a shaper
/// that predates the side channel's messages, one that speaks another version, or one
/// gone): 5 s at [`HELLO_RETRY_NS`].
pub const HELLO_TRIES: u32 = 50;

/// The exchange of hellos for one paired queue pair (see [`SideMessage::Hello`]): each end
/// sends its hello until it has had the peer's and knows the peer has had its own, and
/// answers a hello that says it has not. It is pure: the caller passes the time and
/// sends what [`Greeting::due`] returns.
///
/// Invariants: at most [`HELLO_TRIES`] hellos are sent on the timer and at most as many
/// answers, whatever the peer sends; once both ends have heard each other nothing more
/// is due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Greeting {
    heard: bool,
    peer_heard: bool,
    /// A hello saying `heard` was sent: the peer will know.
    told_heard: bool,
    sent: u32,
    answers: u32,
    answer_now: bool,
    next_ns: Option<u64>,
}

impl Greeting {
    /// Nothing sent or heard yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The hello to send at `now_ns`, if one is due: its `heard` flag.
    pub fn due(&mut self, now_ns: u64) -> Option<bool> {
        if self.answer_now {
            self.answer_now = false;
        } else if (self.heard && self.peer_heard)
            || self.sent >= HELLO_TRIES
            || self.next_ns.is_some_and(|at| now_ns < at)
        {
            return None;
        } else {
            self.sent += 1;
            self.next_ns = Some(now_ns.saturating_add(HELLO_RETRY_NS));
        }
        self.told_heard |= self.heard;
        Some(self.heard)
    }

    /// The peer's hello arrived; `peer_heard` is its flag. Returns true the first time
    /// (the two ends now agree on the version). It is answered when the peer has not had
    /// this end's hello, or has not been told that this end has had its own.
    pub fn on_hello(&mut self, peer_heard: bool) -> bool {
        let first = !self.heard;
        self.heard = true;
        self.peer_heard |= peer_heard;
        if (!peer_heard || !self.told_heard) && self.answers < HELLO_TRIES {
            self.answers += 1;
            self.answer_now = true;
        }
        first
    }

    /// When [`Greeting::due`] may next return a hello (`Some(0)`: now), or, with every
    /// hello sent unanswered, when [`Greeting::gave_up`] turns true; `None` once both ends
    /// have heard each other. A hello arriving changes it.
    pub fn next_event_ns(&self) -> Option<u64> {
        if self.answer_now {
            Some(0)
        } else if self.heard && self.peer_heard {
            None
        } else if self.sent < HELLO_TRIES {
            Some(self.next_ns.unwrap_or(0))
        } else if !self.heard {
            self.next_ns
        } else {
            None
        }
    }

    /// The peer's hello has arrived: it shapes its end and speaks [`VERSION`].
    pub fn agreed(&self) -> bool {
        self.heard
    }

    /// Every hello went unanswered: at `now_ns` the last one's wait is over and none of
    /// the peer's came.
    pub fn gave_up(&self, now_ns: u64) -> bool {
        !self.heard && self.sent >= HELLO_TRIES && self.next_ns.is_some_and(|at| now_ns >= at)
    }
}

/// The sending shaper's agreement with its peer about one queue pair. Until the receiver
/// offers the protocol, and for ever with a peer that never does, every request goes whole
/// and unannounced, as natively; the sender counts them, because each takes a receive the
/// receiver posted whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderAgreement {
    sent_whole: u64,
    first: Option<u64>,
}

impl SenderAgreement {
    /// No agreement yet.
    pub fn new() -> Self {
        SenderAgreement::default()
    }

    /// The first announced message's number once agreed; `None`: send whole, unannounced.
    pub fn first(&self) -> Option<u64> {
        self.first
    }

    /// A two-sided request went whole and unannounced (before any agreement).
    pub fn sent_whole(&mut self) {
        self.sent_whole += 1;
    }

    /// `n` two-sided requests in all have gone (or will go) whole and unannounced: what
    /// a caller that counts them itself (the shaper's send queue) says before it passes
    /// on an offer. Counts never go down.
    pub fn sent_whole_to(&mut self, n: u64) {
        self.sent_whole = self.sent_whole.max(n);
    }

    /// The receiver's offer ("I posted `first` receives whole"): messages from the larger
    /// of that and what this end already sent whole are announced. Returns the accept to
    /// send (a repeated offer gets the same answer) and that number, from which the
    /// caller builds its [`SendSide`].
    pub fn on_offer(&mut self, qp_num: u32, first: u64) -> (SideMessage, u64) {
        let agreed = *self.first.get_or_insert(first.max(self.sent_whole));
        (
            SideMessage::Accept {
                qp_num,
                first: agreed,
            },
            agreed,
        )
    }
}

/// The receiving shaper's agreement with its peer about one queue pair: it posts the
/// application's receives whole until it offers the protocol, holds them from the offer,
/// and on the accept posts whole those the sender's whole messages still need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverAgreement {
    posted_whole: u64,
    offered: bool,
    first: Option<u64>,
}

impl ReceiverAgreement {
    /// No offer made yet.
    pub fn new() -> Self {
        ReceiverAgreement::default()
    }

    /// Whether an application receive posted now goes to the NIC whole (before the offer).
    pub fn posts_whole(&self) -> bool {
        !self.offered
    }

    /// An application receive went to the NIC whole.
    pub fn posted_whole(&mut self) {
        self.posted_whole += 1;
    }

    /// The offer to send; from now on application receives are held.
    pub fn offer(&mut self, qp_num: u32) -> SideMessage {
        self.offered = true;
        SideMessage::Offer {
            qp_num,
            first: self.posted_whole,
        }
    }

    /// The sender's accept: how many held application receives to post whole first (the
    /// sender's whole messages beyond the offer), after which the caller builds its
    /// [`RecvSide`] from `first`. An accept below the offer, or without one, is refused;
    /// a repeated accept returns the same count, which the caller acts on once.
    pub fn on_accept(&mut self, first: u64) -> Result<u64, TwoSidedError> {
        if !self.offered || first < self.posted_whole || self.first.is_some_and(|f| f != first) {
            return Err(TwoSidedError::BadAccept {
                want: self.posted_whole,
                got: first,
            });
        }
        self.first = Some(first);
        Ok(first - self.posted_whole)
    }
}

/// One request the sending shaper is to post now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutChunk {
    /// The message it belongs to.
    pub seq: u64,
    /// Its position in the message, from 0.
    pub index: u32,
    /// Its first byte in the message.
    pub offset: u32,
    /// The request: opcode (the message's for the last chunk, without immediate for the
    /// others; a WRITE with immediate's early chunks are WRITEs), slice of the SGEs, remote
    /// address moved by the offset for a WRITE; `wr_id` is the application's on the last
    /// chunk, 0 on others (the caller tags its chunks itself).
    pub request: WorkRequest,
    /// The chunk ends the message.
    pub is_last: bool,
}

/// A completion the application is to see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppCompletion {
    /// The application's `wr_id`.
    pub wr_id: u64,
    /// `IBV_WC_*` status.
    pub status: u32,
    /// Bytes: the whole message's for a receive, the request's for a send.
    pub byte_len: u32,
    /// Immediate data delivered with a receive.
    pub imm: Option<u32>,
    /// The request asked for a completion (a send's signaled flag; receives always do).
    pub signaled: bool,
}

/// A message the sender announced and has not completed.
#[derive(Clone, Copy, Debug)]
struct Outgoing {
    announce: Announce,
    request: WorkRequest,
    /// What the receiver posted, once its credit arrived (grown by each later credit
    /// while it posts the message's receives in parts).
    posting: Option<Posting>,
    /// The credit [`SendSide::take_credited`] last handed out for it.
    taken: Option<Posting>,
    /// Chunks handed out (as a whole message: 0 or 1).
    sent: u32,
    /// Chunks completed.
    done: u32,
    /// Chunks the message goes as, once the credit said how.
    total: u32,
    /// When [`SendSide::reannounce`] first saw it uncredited, and last sent it again.
    first_seen_ns: Option<u64>,
    last_sent_ns: u64,
    /// Times it was announced again.
    repeats: u32,
}

impl Outgoing {
    /// Whether the receiver has posted every receive the message consumes: its credit is
    /// whole, a WRITE with immediate's one receive, or a SEND's one per chunk.
    fn fully_credited(&self) -> bool {
        match (self.posting, self.announce.kind) {
            (None, _) => false,
            (Some(Posting::Whole), _) => true,
            (Some(Posting::Split { posted }), MessageKind::WriteWithImm) => posted >= 1,
            (Some(Posting::Split { posted }), MessageKind::Send) => {
                posted >= self.announce.chunks()
            }
        }
    }
}

/// How long an announcement waits for its credit before it is sent again; each repeat
/// waits twice as long as the one before, up to [`ANNOUNCE_RETRY_MAX_NS`]. A credit comes
/// only once the application posted a receive for the message, which may take long, so
/// the repeats back off.
pub const ANNOUNCE_RETRY_NS: u64 = 20_000_000;

/// The longest wait between two repeats of one announcement.
pub const ANNOUNCE_RETRY_MAX_NS: u64 = 1_000_000_000;

/// The sending shaper's half for one queue pair.
#[derive(Debug, Default)]
pub struct SendSide {
    outgoing: VecDeque<Outgoing>,
    next_seq: u64,
    max_sge: usize,
}

impl SendSide {
    /// A sender whose first announced message is number `first` (from the offer and
    /// accept), posting chunks of at most `max_sge` SGEs.
    pub fn new(first: u64, max_sge: usize) -> Self {
        SendSide {
            outgoing: VecDeque::new(),
            next_seq: first,
            max_sge: max_sge.clamp(1, MAX_SGES),
        }
    }

    /// The application posted `request`: queues it and returns the announcement to send.
    pub fn post(
        &mut self,
        request: WorkRequest,
        chunk_bytes: u32,
    ) -> Result<Announce, TwoSidedError> {
        let kind = match request.opcode {
            Opcode::Send | Opcode::SendWithImm { .. } => MessageKind::Send,
            Opcode::WriteWithImm { .. } => MessageKind::WriteWithImm,
            other => return Err(TwoSidedError::NotTwoSided(other)),
        };
        if chunk_bytes == 0 {
            return Err(TwoSidedError::ZeroChunk);
        }
        let len = request.validated_len()?;
        // Slices of the sender's own list that need too many SGEs make the message go
        // whole, decided here so the announcement says so (a chunk the size of the message).
        let chunk_bytes = if self.slices_fit(&request, len, chunk_bytes) {
            chunk_bytes
        } else {
            len.max(1)
        };
        let announce = Announce {
            seq: self.next_seq,
            len,
            chunk_bytes,
            imm: request.opcode.imm(),
            kind,
        };
        self.next_seq += 1;
        self.outgoing.push_back(Outgoing {
            announce,
            request,
            posting: None,
            taken: None,
            sent: 0,
            done: 0,
            total: 0,
            first_seen_ns: None,
            last_sent_ns: 0,
            repeats: 0,
        });
        Ok(announce)
    }

    fn slices_fit(&self, request: &WorkRequest, len: u32, chunk_bytes: u32) -> bool {
        let step = u64::from(chunk_bytes);
        (0..u64::from(len).div_ceil(step)).all(|i| {
            let offset = i * step;
            let take = step.min(u64::from(len) - offset);
            slice_sges(&request.sges, offset, take, self.max_sge).is_some()
        })
    }

    /// The receiver's credit for message `seq`. A credit for a message already completed
    /// (a repeat that crossed the last chunk) is ignored; one for a message never
    /// announced is refused.
    pub fn on_credit(&mut self, seq: u64, posting: Posting) -> Result<(), TwoSidedError> {
        let oldest = self
            .outgoing
            .front()
            .map_or(self.next_seq, |m| m.announce.seq);
        if seq < oldest {
            return Ok(());
        }
        let message = self
            .outgoing
            .iter_mut()
            .find(|m| m.announce.seq == seq)
            .ok_or(TwoSidedError::BadCredit { seq })?;
        let receives = message.announce.receives_when_split();
        let (total, fits) = match posting {
            Posting::Whole => (1, true),
            Posting::Split { posted } => (message.announce.chunks(), posted <= receives),
        };
        // A credit repeated (the side channel repeats what was not answered) is harmless;
        // a split credit that shrinks, or a change between whole and split, is a peer
        // that is confused or hostile, refused rather than obeyed.
        let consistent = match (message.posting, posting) {
            (None, _) | (Some(Posting::Whole), Posting::Whole) => true,
            (Some(Posting::Split { posted: old }), Posting::Split { posted }) => posted >= old,
            _ => false,
        };
        if !fits || !consistent {
            return Err(TwoSidedError::BadCredit { seq });
        }
        message.posting = Some(posting);
        message.total = total;
        // The peer is there: the wait for the rest of the credit, if any, starts again
        // (see `reannounce` and `uncredited_since`).
        message.first_seen_ns = None;
        Ok(())
    }

    /// Takes back the newest message, `seq`, whose request the caller did not keep (a
    /// post call the provider refused part of) and whose announcement it never sent: the
    /// next message gets its number again. False, changing nothing, when `seq` is not the
    /// newest message.
    pub fn withdraw(&mut self, seq: u64) -> bool {
        let newest = self.outgoing.back().map(|m| m.announce.seq);
        if newest != Some(seq) || seq + 1 != self.next_seq {
            return false;
        }
        self.outgoing.pop_back();
        self.next_seq = seq;
        true
    }

    /// The oldest message's credit, each time it has come or grown since last taken: its
    /// number and how the receiver posted it so far. For a caller that cuts and
    /// completes the messages itself (the shaper's send queue, whose chunks are cut to
    /// the announced chunk size as [`SendSide::next_chunk`] would, and go no further than
    /// the receives credited): once the credit is complete the message is taken out, and
    /// this side keeps only the messages still waiting for all of theirs. Messages come
    /// out in order, so a later message's credit waits for every earlier one's to be
    /// complete (the receiver posts the receives in message order anyway).
    pub fn take_credited(&mut self) -> Option<(u64, Posting)> {
        let front = self.outgoing.front_mut()?;
        let posting = front.posting?;
        if front.sent > 0 {
            return None;
        }
        let seq = front.announce.seq;
        if front.fully_credited() {
            self.outgoing.pop_front();
            return Some((seq, posting));
        }
        if front.taken == Some(posting) {
            return None;
        }
        front.taken = Some(posting);
        Some((seq, posting))
    }

    /// Bytes of the chunk [`SendSide::next_chunk`] would hand out now, for the pacer.
    pub fn ready_bytes(&self) -> Option<u32> {
        let (message, index) = self.ready()?;
        let a = message.announce;
        Some(match message.posting {
            Some(Posting::Whole) => a.len,
            _ => a.chunk_bytes.min(a.len - index * a.chunk_bytes),
        })
    }

    /// The first message with a chunk not yet handed out, and that chunk's index, if the
    /// credit allows it to go now. Messages go in order: a later message never passes an
    /// earlier one still waiting for its credit.
    fn ready(&self) -> Option<(&Outgoing, u32)> {
        let message = self
            .outgoing
            .iter()
            .find(|m| m.total == 0 || m.sent < m.total)?;
        let posting = message.posting?;
        let index = message.sent;
        let allowed = match (posting, message.announce.kind) {
            (Posting::Whole, _) => index < 1,
            (Posting::Split { posted }, MessageKind::Send) => index < posted,
            // Only the last chunk consumes a receive.
            (Posting::Split { posted }, MessageKind::WriteWithImm) => {
                index + 1 < message.total || posted >= 1
            }
        };
        allowed.then_some((message, index))
    }

    /// The next chunk that may go now: credited, in order. `None` when every chunk
    /// announced so far is out or waits for a credit.
    pub fn next_chunk(&mut self) -> Option<OutChunk> {
        let (message, index) = self.ready()?;
        let seq = message.announce.seq;
        let chunk = build_chunk(message, index, self.max_sge)?;
        if let Some(m) = self.outgoing.iter_mut().find(|m| m.announce.seq == seq) {
            m.sent += 1;
        }
        Some(chunk)
    }

    /// A chunk of message `seq` completed with `status`. Returns the application's
    /// completion when it ends the message: the last chunk's success, or the first
    /// failure (the queue pair is in error then; the rest of its chunks flush and are
    /// ignored).
    pub fn on_chunk_done(&mut self, seq: u64, status: u32) -> Option<AppCompletion> {
        let at = self.outgoing.iter().position(|m| m.announce.seq == seq)?;
        let message = &mut self.outgoing[at];
        message.done += 1;
        let finished = status != WC_SUCCESS || message.done >= message.total;
        if !finished {
            return None;
        }
        let message = self.outgoing.remove(at)?;
        Some(AppCompletion {
            wr_id: message.request.wr_id,
            status,
            byte_len: message.announce.len,
            imm: None,
            signaled: message.request.flags.signaled || status != WC_SUCCESS,
        })
    }

    /// The announcements to send again at `now_ns`: those whose credit is not complete
    /// (none yet, or receives posted in part, whose next credit may have been lost) and
    /// whose wait ([`ANNOUNCE_RETRY_NS`], doubling per repeat up to
    /// [`ANNOUNCE_RETRY_MAX_NS`]) is over. A message is first seen by this call (its
    /// first wait starts then, and again after each credit).
    pub fn reannounce(&mut self, now_ns: u64) -> Vec<Announce> {
        let mut again = Vec::new();
        for m in self.outgoing.iter_mut().filter(|m| !m.fully_credited()) {
            if m.first_seen_ns.is_none() {
                m.first_seen_ns = Some(now_ns);
                m.last_sent_ns = now_ns;
                continue;
            }
            let wait = ANNOUNCE_RETRY_NS
                .saturating_mul(1 << m.repeats.min(16))
                .min(ANNOUNCE_RETRY_MAX_NS);
            if now_ns.saturating_sub(m.last_sent_ns) >= wait {
                m.last_sent_ns = now_ns;
                m.repeats = m.repeats.saturating_add(1);
                again.push(m.announce);
            }
        }
        again
    }

    /// The receiver says message `seq` is taken and waits for an application receive
    /// ([`SideMessage::Waiting`]) at `now_ns`: its wait for a credit counts from now, as
    /// far as giving up on the peer goes ([`SendSide::uncredited_since`]); its repeats
    /// keep their pace.
    pub fn on_waiting(&mut self, seq: u64, now_ns: u64) {
        if let Some(m) = self
            .outgoing
            .iter_mut()
            .find(|m| m.announce.seq == seq && !m.fully_credited())
        {
            m.first_seen_ns = Some(now_ns);
        }
    }

    /// Since when the oldest message whose credit is not complete has waited for more of
    /// it, as [`SendSide::reannounce`] first saw it (every credit, a repeated one too,
    /// starts the wait again): what the caller compares with the queue
    /// pair's transport timeout before it gives up on the peer ([`SendSide::abandon`]).
    pub fn uncredited_since(&self) -> Option<u64> {
        self.outgoing
            .iter()
            .filter(|m| !m.fully_credited())
            .filter_map(|m| m.first_seen_ns)
            .min()
    }

    /// Messages announced and not completed.
    pub fn outstanding(&self) -> usize {
        self.outgoing.len()
    }

    /// Chunks handed out and not completed: never more than the receives credited.
    pub fn chunks_in_flight(&self) -> u32 {
        self.outgoing
            .iter()
            .map(|m| m.sent - m.done.min(m.sent))
            .sum()
    }

    /// The queue pair is destroyed or reset: every message not completed, in order, as a
    /// flushed completion (verbs flushes every outstanding request, signaled or not).
    pub fn teardown(&mut self) -> Vec<AppCompletion> {
        self.abandon(WC_WR_FLUSH_ERR)
    }

    /// The peer stopped answering (its credits have not come for longer than the queue
    /// pair's own transport timeout, which the caller measures): every message not
    /// completed fails with `status`, in order, as the NIC would fail requests to a dead
    /// peer (`IBV_WC_RETRY_EXC_ERR`, 12), so the application never hangs on a credit.
    pub fn abandon(&mut self, status: u32) -> Vec<AppCompletion> {
        self.outgoing
            .drain(..)
            .map(|m| AppCompletion {
                wr_id: m.request.wr_id,
                status,
                byte_len: 0,
                imm: None,
                signaled: true,
            })
            .collect()
    }
}

/// Builds chunk `index` of `message`.
fn build_chunk(message: &Outgoing, index: u32, max_sge: usize) -> Option<OutChunk> {
    let a = message.announce;
    let whole = message.posting == Some(Posting::Whole);
    let (offset, len) = if whole {
        (0, a.len)
    } else {
        let offset = index.checked_mul(a.chunk_bytes)?;
        (offset, a.chunk_bytes.min(a.len - offset))
    };
    let is_last = whole || index + 1 >= message.total;
    let original = message.request;
    let sges = if whole {
        original.sges
    } else {
        slice_sges(&original.sges, offset.into(), len.into(), max_sge)?
    };
    let remote = original.remote.map(|r| match a.kind {
        MessageKind::WriteWithImm => crate::chunk::RemoteAddr {
            addr: r.addr.wrapping_add(u64::from(offset)),
            rkey: r.rkey,
        },
        MessageKind::Send => r,
    });
    Some(OutChunk {
        seq: a.seq,
        index,
        offset,
        request: original.chunk_request(sges, remote, index == 0, is_last),
        is_last,
    })
}

/// One receive the receiving shaper is to post to the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InternalRecv {
    /// The message it is for.
    pub seq: u64,
    /// Its position among the message's receives, from 0.
    pub index: u32,
    /// Its scatter list: the application's whole, or the slice for chunk `index`.
    pub sges: SgeList,
}

/// An application receive, held by the shaper.
#[derive(Clone, Copy, Debug)]
struct AppRecv {
    wr_id: u64,
    sges: SgeList,
}

/// A message whose receives are (being) posted, paired with its application receive.
#[derive(Clone, Copy, Debug)]
struct Landing {
    announce: Announce,
    app: AppRecv,
    /// What is credited so far: updated as the receives are posted part by part.
    posting: Posting,
    /// Receives to post in all (1 when whole).
    receives: u32,
    /// Receives posted so far: fewer than `receives` only while a message that needs more
    /// receives than the queue holds is posted in parts, as room frees.
    posted: u32,
    /// Internal receives completed.
    landed: u32,
}

/// The most receives one message is split into. A message that would need more (a chunk
/// size, which the peer controls, tiny against a large receive) goes whole: the receiver
/// never plans more receives for one message than this.
pub const MAX_SPLIT_RECEIVES: u32 = 1 << 16;

/// What an announcement did at the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announced {
    /// The next one in order: taken.
    Taken,
    /// One taken before: the sender repeats an announcement it has had no credit for, so
    /// the credit was lost or is still to come. `Some`: the message's receives are
    /// posted and not all completed, and this credit is to be sent again.
    Repeated(Option<Posting>),
    /// Beyond the next one expected (that one was lost): dropped, as the sender repeats
    /// every announcement it has no credit for, in order.
    Ahead,
}

/// The most announcements a receiver holds that no application receive has met yet. An
/// honest sender announces at most its send queue's depth ahead, which devices keep far
/// below this; a peer that goes on announcing is refused rather than queued without end.
pub const MAX_ANNOUNCED: usize = 1 << 14;

/// The receiving shaper's half for one queue pair.
#[derive(Debug, Default)]
pub struct RecvSide {
    app: VecDeque<AppRecv>,
    announced: VecDeque<Announce>,
    landing: VecDeque<Landing>,
    next_seq: u64,
    max_sge: usize,
    queue_depth: u32,
    /// The plan of the front announcement into the front application receive, by the
    /// announcement's number, while it waits for room: planning a message checks every
    /// slice (up to [`MAX_SPLIT_RECEIVES`]), and a message waiting for room is asked
    /// after each receive that completes.
    front_plan: Option<(u64, Posting, u32)>,
}

impl RecvSide {
    /// A receiver expecting announcement `first` next, posting receives of at most
    /// `max_sge` SGEs (the queue pair's `max_recv_sge`) into a receive queue of
    /// `queue_depth` entries (its `max_recv_wr`). A message that needs more split receives
    /// than the queue holds is posted in parts as room frees, each part credited (see
    /// [`RecvSide::next_posting`]); one that would need more than [`MAX_SPLIT_RECEIVES`]
    /// goes whole.
    pub fn new(first: u64, max_sge: usize, queue_depth: u32) -> Self {
        RecvSide {
            app: VecDeque::new(),
            announced: VecDeque::new(),
            landing: VecDeque::new(),
            next_seq: first,
            max_sge: max_sge.clamp(1, MAX_SGES),
            queue_depth: queue_depth.max(1),
            front_plan: None,
        }
    }

    /// The application posted a receive.
    pub fn post_recv(&mut self, wr_id: u64, sges: &[Sge]) -> Result<(), TwoSidedError> {
        let sges = SgeList::try_from(sges)?;
        u32::try_from(sges.total_bytes()).map_err(|_| ChunkError::LengthOverflow {
            total: sges.total_bytes(),
        })?;
        self.app.push_back(AppRecv { wr_id, sges });
        Ok(())
    }

    /// An announcement arrived. The side channel may lose, repeat or reorder datagrams:
    /// one already taken is answered with its credit again if it was posted
    /// ([`Announced::Repeated`]), one beyond a gap is dropped ([`Announced::Ahead`]), the
    /// sender's repeats fill the gap in order. Refused: a chunk size of zero, and one
    /// past [`MAX_ANNOUNCED`] held.
    pub fn on_announce(&mut self, announce: Announce) -> Result<Announced, TwoSidedError> {
        if announce.chunk_bytes == 0 {
            return Err(TwoSidedError::ZeroChunk);
        }
        if announce.seq < self.next_seq {
            let posting = self
                .landing
                .iter()
                .find(|l| l.announce.seq == announce.seq)
                .map(|l| l.posting);
            return Ok(Announced::Repeated(posting));
        }
        if announce.seq > self.next_seq {
            return Ok(Announced::Ahead);
        }
        if self.announced.len() >= MAX_ANNOUNCED {
            return Err(TwoSidedError::TooManyAnnounced {
                held: self.announced.len(),
            });
        }
        self.next_seq += 1;
        self.announced.push_back(announce);
        Ok(Announced::Taken)
    }

    /// The receives to post next, in order, with the credit to return and the message it
    /// is for, when the queue's `room` (free receive slots) allows.
    ///
    /// A message whose receives are posted in parts comes first: its next part, once room
    /// for the rest of it or for half the queue has freed (so that the credits, one per
    /// part, come in batches rather than one per receive). Otherwise the next announced
    /// message meets the next application receive, if both are there: its receives all
    /// at once when they fit `room`; when they are more than the whole queue holds, a
    /// first part once half the queue is free; else it waits for room. Receives go to
    /// the queue in message order, so a message's parts never interleave with another's.
    pub fn next_posting(&mut self, room: u32) -> Option<(Vec<InternalRecv>, Posting, u64)> {
        let batch = (self.queue_depth / 2).max(1);
        let max_sge = self.max_sge;
        if let Some(landing) = self.landing.back_mut().filter(|l| l.posted < l.receives) {
            let left = landing.receives - landing.posted;
            if room < left.min(batch) {
                return None;
            }
            let count = left.min(room);
            let recvs = receives_of(landing, landing.posted, count, max_sge);
            landing.posted += count;
            landing.posting = Posting::Split {
                posted: landing.posted,
            };
            return Some((recvs, landing.posting, landing.announce.seq));
        }
        let announce = *self.announced.front()?;
        let app = *self.app.front()?;
        // Both queues only grow at the back until the pair is taken below, so a plan of
        // the same announcement is of the same pair.
        let (posting, receives) = match self.front_plan {
            Some((seq, posting, receives)) if seq == announce.seq => (posting, receives),
            _ => {
                let (posting, receives) = self.plan(&announce, &app);
                self.front_plan = Some((announce.seq, posting, receives));
                (posting, receives)
            }
        };
        let count = if receives <= room {
            receives
        } else if receives > self.queue_depth && room >= batch {
            room
        } else {
            return None;
        };
        self.announced.pop_front();
        self.app.pop_front();
        self.front_plan = None;
        let mut landing = Landing {
            announce,
            app,
            posting,
            receives,
            posted: count,
            landed: 0,
        };
        if let Posting::Split { .. } = posting {
            landing.posting = Posting::Split { posted: count };
        }
        let recvs = receives_of(&landing, 0, count, max_sge);
        let posting = landing.posting;
        self.landing.push_back(landing);
        Some((recvs, posting, announce.seq))
    }

    /// How `announce` lands in `app`, and how many receives that takes: whole (1) when it
    /// fits one chunk, is longer than the receive (it then fails at the NIC as natively),
    /// would need more than [`MAX_SPLIT_RECEIVES`], or a slice needs more SGEs than a
    /// receive holds; a WRITE with immediate split takes 1 (its data needs no receive);
    /// a SEND split takes one per chunk.
    fn plan(&self, announce: &Announce, app: &AppRecv) -> (Posting, u32) {
        if announce.chunks() <= 1 {
            return (Posting::Whole, 1);
        }
        if announce.kind == MessageKind::WriteWithImm {
            return (Posting::Split { posted: 1 }, 1);
        }
        let chunks = announce.chunks();
        if u64::from(announce.len) > app.sges.total_bytes() || chunks > MAX_SPLIT_RECEIVES {
            return (Posting::Whole, 1);
        }
        let step = u64::from(announce.chunk_bytes);
        let fits = (0..u64::from(chunks)).all(|index| {
            let offset = index * step;
            let len = step.min(u64::from(announce.len) - offset);
            slice_sges(&app.sges, offset, len, self.max_sge).is_some()
        });
        if !fits {
            return (Posting::Whole, 1);
        }
        (Posting::Split { posted: chunks }, chunks)
    }

    /// An internal receive completed (they complete in the order posted) with `status`,
    /// `byte_len` and immediate data `imm`. Returns the application's completion when it
    /// ends a message: whole length and immediate on success, the first failure
    /// otherwise (later receives of the message flush and are ignored).
    pub fn on_recv_done(
        &mut self,
        status: u32,
        byte_len: u32,
        imm: Option<u32>,
    ) -> Option<AppCompletion> {
        let landing = self.landing.front_mut()?;
        let expected = expected_len(landing);
        landing.landed += 1;
        let short = status == WC_SUCCESS && expected.is_some_and(|want| byte_len != want);
        let status = if short { WC_LOC_LEN_ERR } else { status };
        if status == WC_SUCCESS && landing.landed < landing.receives {
            return None;
        }
        let landing = self.landing.pop_front()?;
        let byte_len = match landing.posting {
            // Posted whole: the NIC's completion is the native one.
            Posting::Whole => byte_len,
            // Split: the whole message's length, which a WRITE with immediate's last
            // chunk alone would not report.
            Posting::Split { .. } if status == WC_SUCCESS => landing.announce.len,
            Posting::Split { .. } => 0,
        };
        Some(AppCompletion {
            wr_id: landing.app.wr_id,
            status,
            byte_len,
            imm: if status == WC_SUCCESS {
                imm.or(landing.announce.imm)
            } else {
                None
            },
            signaled: true,
        })
    }

    /// Whether message `seq` is announced and still waits for an application receive:
    /// what the receiver answers a repeated announcement of it with
    /// ([`SideMessage::Waiting`]).
    pub fn waiting(&self, seq: u64) -> bool {
        self.announced.iter().any(|a| a.seq == seq)
    }

    /// Whether receives wait to be posted for want of room in the queue (what
    /// [`RecvSide::next_posting`] would post with room enough): the rest of a message
    /// posted in parts, or an announced message that has met its application receive.
    /// Room frees only as the queue's receives complete, so a receiver that waits for room
    /// must have its completions read even when its application does not poll: the peer's
    /// message, which the application may wait for before it polls, goes no further.
    pub fn waits_for_room(&self) -> bool {
        self.landing.back().is_some_and(|l| l.posted < l.receives)
            || (!self.announced.is_empty() && !self.app.is_empty())
    }

    /// Messages whose receives are posted and not all completed.
    pub fn landing(&self) -> usize {
        self.landing.len()
    }

    /// Application receives held, not yet paired with a message.
    pub fn held(&self) -> usize {
        self.app.len()
    }

    /// The queue pair is destroyed or reset: every application receive not completed,
    /// paired or held, in order, as a flushed completion.
    pub fn teardown(&mut self) -> Vec<AppCompletion> {
        let flushed = |wr_id| AppCompletion {
            wr_id,
            status: WC_WR_FLUSH_ERR,
            byte_len: 0,
            imm: None,
            signaled: true,
        };
        self.announced.clear();
        self.front_plan = None;
        let landing = self.landing.drain(..).map(|l| flushed(l.app.wr_id));
        let held = self.app.drain(..).map(|a| flushed(a.wr_id));
        landing.chain(held).collect()
    }
}

/// Receives `from .. from + count` of `landing`, as [`RecvSide::plan`] planned them: the
/// application's receive as posted when whole or a WRITE with immediate, else the
/// message's slices (every one of which `plan` found to fit).
fn receives_of(landing: &Landing, from: u32, count: u32, max_sge: usize) -> Vec<InternalRecv> {
    let a = landing.announce;
    let whole = matches!(landing.posting, Posting::Whole) || a.kind == MessageKind::WriteWithImm;
    if whole {
        return vec![InternalRecv {
            seq: a.seq,
            index: 0,
            sges: landing.app.sges,
        }];
    }
    let step = u64::from(a.chunk_bytes);
    (from..from.saturating_add(count))
        .filter_map(|index| {
            let offset = u64::from(index) * step;
            let len = step.min(u64::from(a.len).saturating_sub(offset));
            let sges = slice_sges(&landing.app.sges, offset, len, max_sge)?;
            Some(InternalRecv {
                seq: a.seq,
                index,
                sges,
            })
        })
        .collect()
}

/// The byte count the next internal receive of `landing` must report: its slice's, or for
/// a whole posting whatever the NIC says (checked by the NIC itself).
fn expected_len(landing: &Landing) -> Option<u32> {
    let a = landing.announce;
    match (landing.posting, a.kind) {
        (Posting::Split { .. }, MessageKind::Send) => {
            let offset = landing.landed.saturating_mul(a.chunk_bytes);
            Some(a.chunk_bytes.min(a.len.saturating_sub(offset)))
        }
        // Whole SEND: the NIC's own length check applies. A WRITE with immediate's
        // receive reports only its last chunk's bytes: accept what the NIC says.
        _ => None,
    }
}

#[cfg(test)]
mod tests;
