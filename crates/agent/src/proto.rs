//! The messages on the daemon's registration socket, and their parser.
//!
//! The socket is `SOCK_SEQPACKET`: the kernel keeps message boundaries, so one datagram is
//! one message and a message longer than [`MAX_MESSAGE`] is seen as truncated (and
//! refused) rather than run into the next. A message is a 4-byte header (`b"JA"`, the
//! protocol version, the kind) and a fixed-size little-endian body; the parser demands the
//! exact length of its kind and checks every field's range, so no input makes it panic or
//! allocate beyond the message.
//!
//! Version 1's kinds: register (1), usage (2), unregister (3), and remote end (4),
//! unknown layout (5), control verbs (6), QP turns (7), latency (8), pairing (9) and
//! unpairing (10), added later within the version: a daemon that does not know one of
//! kinds 4 to 10 refuses that message alone (the flow stays registered and shaped), so a
//! newer shaper works with an older daemon. The daemon's replies are hello (0x81),
//! registered (0x82), refused (0x83) and paired (0x84); a daemon sends a paired reply
//! only on a connection that sent a pairing, so an older shaper never sees one.
//!
//! No message carries an identity the daemon trusts: the tenant is the peer's uid from
//! `SO_PEERCRED`. A registration states the uid its sender believes it runs as only so
//! that the daemon can refuse a confused or lying client loudly.

use justitia_core::flow::FlowClass;

/// The two bytes every message starts with.
pub const MAGIC: [u8; 2] = *b"JA";
/// The protocol version this crate speaks.
pub const PROTO_VERSION: u8 = 1;
/// The longest valid message, and the receive buffer size (one more, to see oversize).
pub const MAX_MESSAGE: usize = 64;
/// A uid that stands for "none stated".
pub const NO_UID: u32 = u32::MAX;

const KIND_REGISTER: u8 = 1;
const KIND_USAGE: u8 = 2;
const KIND_UNREGISTER: u8 = 3;
const KIND_REMOTE: u8 = 4;
const KIND_UNKNOWN_LAYOUT: u8 = 5;
const KIND_CONTROL_VERBS: u8 = 6;
const KIND_QP_TURNS: u8 = 7;
const KIND_LATENCY: u8 = 8;
const KIND_PAIRING: u8 = 9;
const KIND_UNPAIRING: u8 = 10;
const KIND_HELLO: u8 = 0x81;
const KIND_REGISTERED: u8 = 0x82;
const KIND_REFUSED: u8 = 0x83;
const KIND_PAIRED: u8 = 0x84;

/// Queue pair numbers are 24 bits (InfiniBand and RoCE): a parsed one is below this.
pub const QPN_LIMIT: u32 = 1 << 24;
/// A Q_Key with this bit set is a controlled one, which an unprivileged process cannot
/// send with: a side channel's Q_Key never has it.
pub const QKEY_CONTROLLED: u32 = 1 << 31;

/// A shaper asks for a flow to be steered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Register {
    /// The client's own reference for the flow, echoed in the reply.
    pub client_ref: u64,
    /// The flow's class.
    pub class: FlowClass,
    /// Queue pairs the flow posts on (at least 1).
    pub qps: u32,
    /// The flow's own demand in bytes/s (0: as much as it may have).
    pub demand_bytes_per_sec: u64,
    /// The uid the client believes it runs as, checked against the kernel's ([`NO_UID`]:
    /// not stated).
    pub claimed_uid: u32,
}

/// Where a flow's RC QP goes, learnt by the shaper when the QP moved to RTR
/// (`ibv_modify_qp` with the address vector and the destination QP number), and whether
/// the flow posts READs: the daemon then tells the peer host's daemon (see
/// `justitia-peer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteEnd {
    /// The daemon's flow id.
    pub flow: u64,
    /// The destination GID (all zero when the QP is addressed by LID alone).
    pub gid: [u8; 16],
    /// The destination LID (0 on RoCE, or when a GID is given).
    pub lid: u16,
    /// The remote QP number (24 bits).
    pub qpn: u32,
    /// The flow posts READs: their data leaves the remote host's RNIC.
    pub reads: bool,
}

/// A shaper reports a flow's activity and what it sent since the last report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// The daemon's flow id.
    pub flow: u64,
    /// Whether the flow has work.
    pub active: bool,
    /// Bytes posted since the previous report.
    pub bytes: u64,
    /// Work requests posted since the previous report.
    pub ops: u64,
}

/// A process's control verbs since its previous report (see
/// [`justitia_core::control_verbs`]): the daemon adds them to its tenant's counts. Per
/// connection, not per flow: a process that only registers memory has no flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlVerbReport {
    /// Memory registrations and QP creations issued.
    pub verbs: u64,
    /// Of them, those that waited for the process's budget.
    pub delayed: u64,
    /// The time they waited, in nanoseconds.
    pub waited_ns: u64,
}

/// A process's QP turns since its previous report (see [`justitia_core::queue_turns`]):
/// the daemon adds them to its tenant's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpTurnReport {
    /// Times one of its QPs had to wait in line for a turn.
    pub waits: u64,
    /// Times one of its QPs gave a spent turn up to a waiting one.
    pub yields: u64,
}

/// The longest round trips one [`LatencyReport`] carries.
pub const LATENCY_LONGEST: usize = 12;

/// A latency flow's round trips since its previous report, as its shaper timed them
/// (from the post of a request to the poll that found its completion): how many, and the
/// longest of them, from which the daemon's [`LatencyTail`] takes the tenant's p99 (see
/// there for why the longest suffice).
///
/// [`LatencyTail`]: justitia_core::adaptive::latency_tail::LatencyTail
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencyReport {
    /// The daemon's flow id.
    pub flow: u64,
    /// Round trips timed (at least 1).
    pub count: u32,
    /// The longest of them in nanoseconds, longest first; the first `min(count, 12)` are
    /// read, the rest are zero.
    pub longest_ns: [u32; LATENCY_LONGEST],
}

/// A shaper's RC queue pair that reached RTR, and its process's side channel: the daemon
/// sends the pair (this queue pair, the remote one) with the side channel to the daemon of
/// the remote end's host, which matches it against its own shapers' pairings and tells
/// its shaper the side channel found (see `docs/architecture.md`, "Splitting two-sided
/// requests"). A pairing replaces an earlier one of the same `local_qpn` (a queue pair
/// reset and connected again).
///
/// Invariants of a parsed pairing: the three queue pair numbers are in
/// `1..`[`QPN_LIMIT`], the remote end has a GID or a LID, and `side_qkey` is not a
/// controlled one ([`QKEY_CONTROLLED`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpPairing {
    /// The daemon's flow id of the flow that posts on the queue pair.
    pub flow: u64,
    /// The queue pair's own number.
    pub local_qpn: u32,
    /// The destination GID (all zero when the QP is addressed by LID alone).
    pub remote_gid: [u8; 16],
    /// The destination LID (0 on RoCE, or when a GID is given).
    pub remote_lid: u16,
    /// The remote queue pair's number.
    pub remote_qpn: u32,
    /// The process's side channel on the queue pair's device: its UD queue pair's number.
    pub side_qpn: u32,
    /// The side channel's Q_Key.
    pub side_qkey: u32,
}

/// The daemon found the side channel of the process at the other end of one of the
/// shaper's queue pairs (its host's daemon matched the two pairings exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paired {
    /// The flow the pairing was reported for.
    pub flow: u64,
    /// The shaper's queue pair it was reported for.
    pub local_qpn: u32,
    /// The remote process's side channel: its UD queue pair's number, reached at the
    /// queue pair's remote GID or LID.
    pub side_qpn: u32,
    /// Its Q_Key.
    pub side_qkey: u32,
}

/// Client to daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Register a flow.
    Register(Register),
    /// Report usage.
    Usage(Usage),
    /// The flow is gone.
    Unregister {
        /// The daemon's flow id.
        flow: u64,
    },
    /// Where the flow's QP goes (sent once it is known, and again if it READs).
    Remote(RemoteEnd),
    /// The shaper cannot read the control block the daemon sent (another layout version,
    /// after an upgrade of one side): it runs on its static settings, and says so once per
    /// connection attempt so that the daemon can tell its operator which tenants it does
    /// not serve.
    UnknownLayout {
        /// The layout version the daemon's block has.
        found: u64,
        /// The layout version the shaper reads.
        known: u64,
    },
    /// The process's control verbs since its previous report.
    ControlVerbs(ControlVerbReport),
    /// The process's QP turns since its previous report.
    QpTurns(QpTurnReport),
    /// A latency flow's round trips since its previous report.
    Latency(LatencyReport),
    /// A queue pair reached RTR and its process's side channel takes part in splitting.
    Pairing(QpPairing),
    /// A queue pair's pairing is gone (the queue pair was destroyed or reset).
    Unpairing {
        /// The flow it was reported for.
        flow: u64,
        /// The queue pair's number.
        local_qpn: u32,
    },
}

/// Soft admission's verdict, as told to the shaper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionReply {
    /// Admitted.
    Admitted,
    /// Admitted although Current99 is above Target99.
    AdmittedWithWarning,
    /// Not admitted (the configuration asks for it): leave the flow unshaped.
    NotAdmitted,
}

impl AdmissionReply {
    /// The verdict's one spelling in every report: the `registrations` metric's label,
    /// `justitia flows` (table and JSON) and the log.
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionReply::Admitted => "admitted",
            AdmissionReply::AdmittedWithWarning => "admitted_with_warning",
            AdmissionReply::NotAdmitted => "not_admitted",
        }
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefuseReason {
    /// The message claimed a uid other than the sender's.
    WrongUid,
    /// Every slot of the control block is in use.
    Full,
    /// The message was malformed.
    Malformed,
    /// The sender has too many flows registered.
    TooManyFlows,
}

/// Daemon to client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Sent once on connection, with the control block's descriptor attached.
    Hello {
        /// The daemon's boot id (also in the block).
        boot_id: u64,
    },
    /// A flow was registered.
    Registered {
        /// The client's reference.
        client_ref: u64,
        /// The daemon's flow id.
        flow: u64,
        /// The control block slot holding its allotment.
        slot: u32,
        /// Soft admission's verdict.
        admission: AdmissionReply,
    },
    /// A registration was refused.
    Refused {
        /// The client's reference (0 when the message could not be read).
        client_ref: u64,
        /// Why.
        reason: RefuseReason,
    },
    /// A pairing found its other end.
    Paired(Paired),
}

/// Why a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Fewer bytes than a header.
    #[error("truncated: {got} bytes, a header is 4")]
    NoHeader {
        /// Bytes received.
        got: usize,
    },
    /// Longer than any message.
    #[error("oversized: {got} bytes, at most {MAX_MESSAGE}")]
    Oversized {
        /// Bytes received (at least).
        got: usize,
    },
    /// Not starting with `JA`.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// Another protocol version.
    #[error("protocol version {0}, this daemon speaks {PROTO_VERSION}")]
    BadVersion(u8),
    /// An unknown kind (or one sent in the wrong direction).
    #[error("unknown message kind {0:#04x}")]
    UnknownKind(u8),
    /// The body's length is not its kind's.
    #[error("{kind} message of {got} bytes, expected {want}")]
    BadLength {
        /// The kind's name.
        kind: &'static str,
        /// Bytes received.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// A field out of range.
    #[error("field `{field}`: {reason}")]
    BadField {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        let n = self.0.len().min(4);
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        u32::from_le_bytes(b)
    }
    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        let n = self.0.len().min(8);
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        u64::from_le_bytes(b)
    }
}

fn header(kind: u8) -> Vec<u8> {
    let mut v = Vec::with_capacity(MAX_MESSAGE);
    v.extend_from_slice(&MAGIC);
    v.push(PROTO_VERSION);
    v.push(kind);
    v
}

/// Checks the header and the exact length; returns the kind and a cursor on the body.
fn open(
    msg: &[u8],
    body_len: impl Fn(u8) -> Option<(&'static str, usize)>,
) -> Result<(u8, Cursor<'_>), ParseError> {
    if msg.len() > MAX_MESSAGE {
        return Err(ParseError::Oversized { got: msg.len() });
    }
    if msg.len() < 4 {
        return Err(ParseError::NoHeader { got: msg.len() });
    }
    if msg[..2] != MAGIC {
        return Err(ParseError::BadMagic([msg[0], msg[1]]));
    }
    if msg[2] != PROTO_VERSION {
        return Err(ParseError::BadVersion(msg[2]));
    }
    let kind = msg[3];
    let (name, want) = body_len(kind).ok_or(ParseError::UnknownKind(kind))?;
    let body = &msg[4..];
    if body.len() != want {
        return Err(ParseError::BadLength {
            kind: name,
            got: msg.len(),
            want: want + 4,
        });
    }
    Ok((kind, Cursor(body)))
}

fn class_code(class: FlowClass) -> u8 {
    match class {
        FlowClass::Latency => 0,
        FlowClass::Throughput => 1,
        FlowClass::Bandwidth => 2,
    }
}

/// A queue pair number the wire carries: 24 bits, and not 0 (no queue pair has it).
fn qpn_field(field: &'static str, qpn: u32) -> Result<u32, ParseError> {
    if qpn == 0 || qpn >= QPN_LIMIT {
        return Err(ParseError::BadField {
            field,
            reason: format!("{qpn} is not a queue pair number (1 to 2^24 - 1)"),
        });
    }
    Ok(qpn)
}

/// A side channel's Q_Key: not a controlled one.
fn qkey_field(qkey: u32) -> Result<u32, ParseError> {
    if qkey & QKEY_CONTROLLED != 0 {
        return Err(ParseError::BadField {
            field: "side_qkey",
            reason: format!("{qkey:#010x} is a controlled Q_Key"),
        });
    }
    Ok(qkey)
}

fn bool_field(field: &'static str, b: u8) -> Result<bool, ParseError> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(ParseError::BadField {
            field,
            reason: format!("{b} is neither 0 nor 1"),
        }),
    }
}

impl Request {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        match *self {
            Request::Register(r) => {
                let mut v = header(KIND_REGISTER);
                v.extend_from_slice(&r.client_ref.to_le_bytes());
                v.push(class_code(r.class));
                v.extend_from_slice(&r.qps.to_le_bytes());
                v.extend_from_slice(&r.demand_bytes_per_sec.to_le_bytes());
                v.extend_from_slice(&r.claimed_uid.to_le_bytes());
                v
            }
            Request::Usage(u) => {
                let mut v = header(KIND_USAGE);
                v.extend_from_slice(&u.flow.to_le_bytes());
                v.push(u8::from(u.active));
                v.extend_from_slice(&u.bytes.to_le_bytes());
                v.extend_from_slice(&u.ops.to_le_bytes());
                v
            }
            Request::Unregister { flow } => {
                let mut v = header(KIND_UNREGISTER);
                v.extend_from_slice(&flow.to_le_bytes());
                v
            }
            Request::Remote(r) => {
                let mut v = header(KIND_REMOTE);
                v.extend_from_slice(&r.flow.to_le_bytes());
                v.extend_from_slice(&r.gid);
                v.extend_from_slice(&r.lid.to_le_bytes());
                v.extend_from_slice(&r.qpn.to_le_bytes());
                v.push(u8::from(r.reads));
                v
            }
            Request::UnknownLayout { found, known } => {
                let mut v = header(KIND_UNKNOWN_LAYOUT);
                v.extend_from_slice(&found.to_le_bytes());
                v.extend_from_slice(&known.to_le_bytes());
                v
            }
            Request::ControlVerbs(r) => {
                let mut v = header(KIND_CONTROL_VERBS);
                v.extend_from_slice(&r.verbs.to_le_bytes());
                v.extend_from_slice(&r.delayed.to_le_bytes());
                v.extend_from_slice(&r.waited_ns.to_le_bytes());
                v
            }
            Request::QpTurns(r) => {
                let mut v = header(KIND_QP_TURNS);
                v.extend_from_slice(&r.waits.to_le_bytes());
                v.extend_from_slice(&r.yields.to_le_bytes());
                v
            }
            Request::Latency(r) => {
                let mut v = header(KIND_LATENCY);
                v.extend_from_slice(&r.flow.to_le_bytes());
                v.extend_from_slice(&r.count.to_le_bytes());
                for ns in r.longest_ns {
                    v.extend_from_slice(&ns.to_le_bytes());
                }
                v
            }
            Request::Pairing(p) => {
                let mut v = header(KIND_PAIRING);
                v.extend_from_slice(&p.flow.to_le_bytes());
                v.extend_from_slice(&p.local_qpn.to_le_bytes());
                v.extend_from_slice(&p.remote_gid);
                v.extend_from_slice(&p.remote_lid.to_le_bytes());
                v.extend_from_slice(&p.remote_qpn.to_le_bytes());
                v.extend_from_slice(&p.side_qpn.to_le_bytes());
                v.extend_from_slice(&p.side_qkey.to_le_bytes());
                v
            }
            Request::Unpairing { flow, local_qpn } => {
                let mut v = header(KIND_UNPAIRING);
                v.extend_from_slice(&flow.to_le_bytes());
                v.extend_from_slice(&local_qpn.to_le_bytes());
                v
            }
        }
    }

    /// Parses one message, refusing anything but exactly one well-formed request.
    pub fn parse(msg: &[u8]) -> Result<Request, ParseError> {
        let (kind, mut c) = open(msg, |k| match k {
            KIND_REGISTER => Some(("register", 25)),
            KIND_USAGE => Some(("usage", 25)),
            KIND_UNREGISTER => Some(("unregister", 8)),
            KIND_REMOTE => Some(("remote", 31)),
            KIND_UNKNOWN_LAYOUT => Some(("unknown layout", 16)),
            KIND_CONTROL_VERBS => Some(("control verbs", 24)),
            KIND_QP_TURNS => Some(("qp turns", 16)),
            KIND_LATENCY => Some(("latency", 12 + 4 * LATENCY_LONGEST)),
            KIND_PAIRING => Some(("pairing", 42)),
            KIND_UNPAIRING => Some(("unpairing", 12)),
            _ => None,
        })?;
        Ok(match kind {
            KIND_REGISTER => {
                let client_ref = c.u64();
                let class = match c.u8() {
                    0 => FlowClass::Latency,
                    1 => FlowClass::Throughput,
                    2 => FlowClass::Bandwidth,
                    other => {
                        return Err(ParseError::BadField {
                            field: "class",
                            reason: format!("unknown class {other}"),
                        })
                    }
                };
                let qps = c.u32();
                if qps == 0 || qps > 1 << 20 {
                    return Err(ParseError::BadField {
                        field: "qps",
                        reason: format!("{qps} queue pairs, expected 1..=1048576"),
                    });
                }
                Request::Register(Register {
                    client_ref,
                    class,
                    qps,
                    demand_bytes_per_sec: c.u64(),
                    claimed_uid: c.u32(),
                })
            }
            KIND_USAGE => {
                let flow = c.u64();
                let active = bool_field("active", c.u8())?;
                Request::Usage(Usage {
                    flow,
                    active,
                    bytes: c.u64(),
                    ops: c.u64(),
                })
            }
            KIND_REMOTE => {
                let flow = c.u64();
                let mut gid = [0u8; 16];
                for b in &mut gid {
                    *b = c.u8();
                }
                let lid = u16::from(c.u8()) | u16::from(c.u8()) << 8;
                let qpn = c.u32();
                if qpn >= 1 << 24 {
                    return Err(ParseError::BadField {
                        field: "qpn",
                        reason: format!("{qpn} does not fit 24 bits"),
                    });
                }
                if gid == [0; 16] && lid == 0 {
                    return Err(ParseError::BadField {
                        field: "gid",
                        reason: "neither a GID nor a LID".into(),
                    });
                }
                let reads = bool_field("reads", c.u8())?;
                Request::Remote(RemoteEnd {
                    flow,
                    gid,
                    lid,
                    qpn,
                    reads,
                })
            }
            KIND_UNKNOWN_LAYOUT => Request::UnknownLayout {
                found: c.u64(),
                known: c.u64(),
            },
            KIND_CONTROL_VERBS => {
                let (verbs, delayed, waited_ns) = (c.u64(), c.u64(), c.u64());
                if delayed > verbs {
                    return Err(ParseError::BadField {
                        field: "delayed",
                        reason: format!("{delayed} delayed of {verbs} verbs"),
                    });
                }
                Request::ControlVerbs(ControlVerbReport {
                    verbs,
                    delayed,
                    waited_ns,
                })
            }
            KIND_QP_TURNS => Request::QpTurns(QpTurnReport {
                waits: c.u64(),
                yields: c.u64(),
            }),
            KIND_LATENCY => {
                let (flow, count) = (c.u64(), c.u32());
                let mut longest_ns = [0u32; LATENCY_LONGEST];
                for ns in &mut longest_ns {
                    *ns = c.u32();
                }
                if count == 0 {
                    return Err(ParseError::BadField {
                        field: "count",
                        reason: "a report of no round trips".into(),
                    });
                }
                let (named, rest) = longest_ns.split_at(LATENCY_LONGEST.min(count as usize));
                if named.windows(2).any(|w| w[0] < w[1]) || rest.iter().any(|&ns| ns != 0) {
                    return Err(ParseError::BadField {
                        field: "longest_ns",
                        reason: format!(
                            "{longest_ns:?} for {count} round trips: not the longest first, zeros after"
                        ),
                    });
                }
                Request::Latency(LatencyReport {
                    flow,
                    count,
                    longest_ns,
                })
            }
            KIND_PAIRING => {
                let flow = c.u64();
                let local_qpn = qpn_field("local_qpn", c.u32())?;
                let mut remote_gid = [0u8; 16];
                for b in &mut remote_gid {
                    *b = c.u8();
                }
                let remote_lid = u16::from(c.u8()) | u16::from(c.u8()) << 8;
                if remote_gid == [0; 16] && remote_lid == 0 {
                    return Err(ParseError::BadField {
                        field: "remote_gid",
                        reason: "neither a GID nor a LID".into(),
                    });
                }
                Request::Pairing(QpPairing {
                    flow,
                    local_qpn,
                    remote_gid,
                    remote_lid,
                    remote_qpn: qpn_field("remote_qpn", c.u32())?,
                    side_qpn: qpn_field("side_qpn", c.u32())?,
                    side_qkey: qkey_field(c.u32())?,
                })
            }
            KIND_UNPAIRING => Request::Unpairing {
                flow: c.u64(),
                local_qpn: qpn_field("local_qpn", c.u32())?,
            },
            _ => Request::Unregister { flow: c.u64() },
        })
    }
}

impl Reply {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        match *self {
            Reply::Hello { boot_id } => {
                let mut v = header(KIND_HELLO);
                v.extend_from_slice(&boot_id.to_le_bytes());
                v
            }
            Reply::Registered {
                client_ref,
                flow,
                slot,
                admission,
            } => {
                let mut v = header(KIND_REGISTERED);
                v.extend_from_slice(&client_ref.to_le_bytes());
                v.extend_from_slice(&flow.to_le_bytes());
                v.extend_from_slice(&slot.to_le_bytes());
                v.push(match admission {
                    AdmissionReply::Admitted => 0,
                    AdmissionReply::AdmittedWithWarning => 1,
                    AdmissionReply::NotAdmitted => 2,
                });
                v
            }
            Reply::Refused { client_ref, reason } => {
                let mut v = header(KIND_REFUSED);
                v.extend_from_slice(&client_ref.to_le_bytes());
                v.push(match reason {
                    RefuseReason::WrongUid => 0,
                    RefuseReason::Full => 1,
                    RefuseReason::Malformed => 2,
                    RefuseReason::TooManyFlows => 3,
                });
                v
            }
            Reply::Paired(p) => {
                let mut v = header(KIND_PAIRED);
                v.extend_from_slice(&p.flow.to_le_bytes());
                v.extend_from_slice(&p.local_qpn.to_le_bytes());
                v.extend_from_slice(&p.side_qpn.to_le_bytes());
                v.extend_from_slice(&p.side_qkey.to_le_bytes());
                v
            }
        }
    }

    /// Parses one reply.
    pub fn parse(msg: &[u8]) -> Result<Reply, ParseError> {
        let (kind, mut c) = open(msg, |k| match k {
            KIND_HELLO => Some(("hello", 8)),
            KIND_REGISTERED => Some(("registered", 21)),
            KIND_REFUSED => Some(("refused", 9)),
            KIND_PAIRED => Some(("paired", 20)),
            _ => None,
        })?;
        Ok(match kind {
            KIND_HELLO => Reply::Hello { boot_id: c.u64() },
            KIND_PAIRED => Reply::Paired(Paired {
                flow: c.u64(),
                local_qpn: qpn_field("local_qpn", c.u32())?,
                side_qpn: qpn_field("side_qpn", c.u32())?,
                side_qkey: qkey_field(c.u32())?,
            }),
            KIND_REGISTERED => {
                let client_ref = c.u64();
                let flow = c.u64();
                let slot = c.u32();
                let admission = match c.u8() {
                    0 => AdmissionReply::Admitted,
                    1 => AdmissionReply::AdmittedWithWarning,
                    2 => AdmissionReply::NotAdmitted,
                    other => {
                        return Err(ParseError::BadField {
                            field: "admission",
                            reason: format!("unknown verdict {other}"),
                        })
                    }
                };
                Reply::Registered {
                    client_ref,
                    flow,
                    slot,
                    admission,
                }
            }
            _ => {
                let client_ref = c.u64();
                let reason = match c.u8() {
                    0 => RefuseReason::WrongUid,
                    1 => RefuseReason::Full,
                    2 => RefuseReason::Malformed,
                    3 => RefuseReason::TooManyFlows,
                    other => {
                        return Err(ParseError::BadField {
                            field: "reason",
                            reason: format!("unknown reason {other}"),
                        })
                    }
                };
                Reply::Refused { client_ref, reason }
            }
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reg() -> Register {
        Register {
            client_ref: 7,
            class: FlowClass::Bandwidth,
            qps: 2,
            demand_bytes_per_sec: 1 << 30,
            claimed_uid: 1000,
        }
    }

    #[test]
    fn requests_round_trip_with_fixed_lengths() {
        let r = Request::Register(reg());
        let wire = r.encode();
        assert_eq!(wire.len(), 29);
        assert_eq!(&wire[..4], b"JA\x01\x01");
        assert_eq!(Request::parse(&wire), Ok(r));
        let u = Request::Usage(Usage {
            flow: 3,
            active: true,
            bytes: 10,
            ops: 1,
        });
        assert_eq!(Request::parse(&u.encode()), Ok(u));
        let g = Request::Unregister { flow: 9 };
        assert_eq!(g.encode().len(), 12);
        assert_eq!(Request::parse(&g.encode()), Ok(g));
        let l = Request::UnknownLayout { found: 4, known: 3 };
        let wire = l.encode();
        assert_eq!(wire.len(), 20);
        assert_eq!(&wire[..4], b"JA\x01\x05");
        assert_eq!(Request::parse(&wire), Ok(l));
        assert!(matches!(
            Request::parse(&wire[..19]),
            Err(ParseError::BadLength {
                kind: "unknown layout",
                got: 19,
                want: 20
            })
        ));
        let c = Request::ControlVerbs(ControlVerbReport {
            verbs: 5000,
            delayed: 4000,
            waited_ns: 7_000_000_000,
        });
        let wire = c.encode();
        assert_eq!(wire.len(), 28);
        assert_eq!(&wire[..4], b"JA\x01\x06");
        assert_eq!(Request::parse(&wire), Ok(c));
        // More delayed than issued is a confused or lying sender.
        let bad = Request::ControlVerbs(ControlVerbReport {
            verbs: 1,
            delayed: 2,
            waited_ns: 0,
        });
        assert!(matches!(
            Request::parse(&bad.encode()),
            Err(ParseError::BadField {
                field: "delayed",
                ..
            })
        ));
    }

    #[test]
    fn a_qp_turn_report_round_trips_and_must_be_whole() {
        let t = Request::QpTurns(QpTurnReport {
            waits: 6,
            yields: 776,
        });
        let wire = t.encode();
        assert_eq!(wire.len(), 20);
        assert_eq!(&wire[..4], b"JA\x01\x07");
        assert_eq!(Request::parse(&wire), Ok(t));
        assert!(matches!(
            Request::parse(&wire[..19]),
            Err(ParseError::BadLength {
                kind: "qp turns",
                got: 19,
                want: 20
            })
        ));
        let mut long = wire.clone();
        long.push(0);
        assert!(Request::parse(&long).is_err());
    }

    #[test]
    fn a_latency_report_round_trips_longest_first_and_fills_the_largest_message() {
        let mut longest_ns = [0u32; LATENCY_LONGEST];
        longest_ns[..3].copy_from_slice(&[9_000, 4_000, 4_000]);
        let r = LatencyReport {
            flow: 5,
            count: 3,
            longest_ns,
        };
        let wire = Request::Latency(r).encode();
        assert_eq!(wire.len(), MAX_MESSAGE);
        assert_eq!(&wire[..4], b"JA\x01\x08");
        assert_eq!(Request::parse(&wire), Ok(Request::Latency(r)));
        let field = |r: LatencyReport| match Request::parse(&Request::Latency(r).encode()) {
            Err(ParseError::BadField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(LatencyReport { count: 0, ..r }), "count");
        // Shortest first, or a value named beyond the count.
        let mut rising = longest_ns;
        rising[..3].copy_from_slice(&[1, 2, 3]);
        assert_eq!(
            field(LatencyReport {
                longest_ns: rising,
                ..r
            }),
            "longest_ns"
        );
        assert_eq!(field(LatencyReport { count: 2, ..r }), "longest_ns");
        // Counting more than it names is what a report of a busy flow looks like.
        let mut full = [7u32; LATENCY_LONGEST];
        full[0] = 8;
        let many = LatencyReport {
            count: 1_000,
            longest_ns: full,
            ..r
        };
        assert_eq!(
            Request::parse(&Request::Latency(many).encode()),
            Ok(Request::Latency(many))
        );
        assert!(Request::parse(&wire[..MAX_MESSAGE - 1]).is_err());
    }

    #[test]
    fn a_remote_end_round_trips_and_needs_a_gid_or_lid_and_a_24_bit_qpn() {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 0, 2]);
        let r = RemoteEnd {
            flow: 4,
            gid,
            lid: 0,
            qpn: 0x11,
            reads: true,
        };
        let wire = Request::Remote(r).encode();
        assert_eq!(wire.len(), 35);
        assert_eq!(&wire[..4], b"JA\x01\x04");
        assert_eq!(Request::parse(&wire), Ok(Request::Remote(r)));
        let bad = |r: RemoteEnd| match Request::parse(&Request::Remote(r).encode()) {
            Err(ParseError::BadField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(bad(RemoteEnd { qpn: 1 << 24, ..r }), "qpn");
        assert_eq!(bad(RemoteEnd { gid: [0; 16], ..r }), "gid");
        let by_lid = RemoteEnd {
            gid: [0; 16],
            lid: 12,
            ..r
        };
        assert_eq!(
            Request::parse(&Request::Remote(by_lid).encode()),
            Ok(Request::Remote(by_lid))
        );
        let mut wire = Request::Remote(r).encode();
        wire[34] = 2;
        assert!(matches!(
            Request::parse(&wire),
            Err(ParseError::BadField { field: "reads", .. })
        ));
    }

    #[test]
    fn malformed_requests_are_refused_with_a_reason() {
        let wire = Request::Register(reg()).encode();
        assert_eq!(
            Request::parse(&wire[..3]),
            Err(ParseError::NoHeader { got: 3 })
        );
        assert!(matches!(
            Request::parse(&wire[..28]),
            Err(ParseError::BadLength {
                kind: "register",
                got: 28,
                want: 29
            })
        ));
        let mut long = wire.clone();
        long.push(0);
        assert!(matches!(
            Request::parse(&long),
            Err(ParseError::BadLength { .. })
        ));
        assert_eq!(
            Request::parse(&[0u8; MAX_MESSAGE + 1]),
            Err(ParseError::Oversized {
                got: MAX_MESSAGE + 1
            })
        );
        let mut bad = wire.clone();
        bad[0] = b'X';
        assert!(matches!(Request::parse(&bad), Err(ParseError::BadMagic(_))));
        bad = wire.clone();
        bad[2] = 2;
        assert_eq!(Request::parse(&bad), Err(ParseError::BadVersion(2)));
        bad = wire.clone();
        bad[3] = KIND_HELLO;
        assert_eq!(
            Request::parse(&bad),
            Err(ParseError::UnknownKind(KIND_HELLO))
        );
        bad = wire.clone();
        bad[12] = 3; // class
        assert!(matches!(
            Request::parse(&bad),
            Err(ParseError::BadField { field: "class", .. })
        ));
        bad = wire.clone();
        bad[13..17].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            Request::parse(&bad),
            Err(ParseError::BadField { field: "qps", .. })
        ));
        let mut usage = Request::Usage(Usage {
            flow: 1,
            active: false,
            bytes: 0,
            ops: 0,
        })
        .encode();
        usage[12] = 2;
        assert!(matches!(
            Request::parse(&usage),
            Err(ParseError::BadField {
                field: "active",
                ..
            })
        ));
    }

    #[test]
    fn replies_round_trip() {
        for r in [
            Reply::Hello { boot_id: 5 },
            Reply::Registered {
                client_ref: 1,
                flow: 2,
                slot: 3,
                admission: AdmissionReply::AdmittedWithWarning,
            },
            Reply::Refused {
                client_ref: 4,
                reason: RefuseReason::WrongUid,
            },
            Reply::Paired(Paired {
                flow: 6,
                local_qpn: 0x11,
                side_qpn: 0x12,
                side_qkey: 0x1111_2222,
            }),
        ] {
            assert_eq!(Reply::parse(&r.encode()), Ok(r));
        }
    }

    fn pairing() -> QpPairing {
        let mut remote_gid = [0u8; 16];
        remote_gid[10] = 0xff;
        remote_gid[11] = 0xff;
        remote_gid[12..].copy_from_slice(&[10, 0, 0, 2]);
        QpPairing {
            flow: 4,
            local_qpn: 0x11,
            remote_gid,
            remote_lid: 0,
            remote_qpn: 0x22,
            side_qpn: 0x33,
            side_qkey: 0x1111_2222,
        }
    }

    #[test]
    fn a_pairing_has_the_documented_layout_and_round_trips() {
        let p = pairing();
        let wire = Request::Pairing(p).encode();
        let mut want = b"JA\x01\x09".to_vec();
        want.extend_from_slice(&[4, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[0x11, 0, 0, 0]);
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2]);
        want.extend_from_slice(&[0, 0]);
        want.extend_from_slice(&[0x22, 0, 0, 0, 0x33, 0, 0, 0, 0x22, 0x22, 0x11, 0x11]);
        assert_eq!(wire, want);
        assert_eq!(Request::parse(&wire), Ok(Request::Pairing(p)));
        let by_lid = QpPairing {
            remote_gid: [0; 16],
            remote_lid: 9,
            ..p
        };
        assert_eq!(
            Request::parse(&Request::Pairing(by_lid).encode()),
            Ok(Request::Pairing(by_lid))
        );
        let u = Request::Unpairing {
            flow: 4,
            local_qpn: 0x11,
        };
        let wire = u.encode();
        assert_eq!(wire, b"JA\x01\x0a\x04\0\0\0\0\0\0\0\x11\0\0\0");
        assert_eq!(Request::parse(&wire), Ok(u));
        let paired = Reply::Paired(Paired {
            flow: 4,
            local_qpn: 0x11,
            side_qpn: 0x44,
            side_qkey: 7,
        })
        .encode();
        assert_eq!(
            paired,
            b"JA\x01\x84\x04\0\0\0\0\0\0\0\x11\0\0\0\x44\0\0\0\x07\0\0\0"
        );
    }

    #[test]
    fn a_pairing_field_out_of_range_is_refused_by_name() {
        let p = pairing();
        let bad = |p: QpPairing| match Request::parse(&Request::Pairing(p).encode()) {
            Err(ParseError::BadField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        for qpn in [0, QPN_LIMIT, u32::MAX] {
            assert_eq!(
                bad(QpPairing {
                    local_qpn: qpn,
                    ..p
                }),
                "local_qpn"
            );
            assert_eq!(
                bad(QpPairing {
                    remote_qpn: qpn,
                    ..p
                }),
                "remote_qpn"
            );
            assert_eq!(bad(QpPairing { side_qpn: qpn, ..p }), "side_qpn");
            let u = Request::Unpairing {
                flow: 1,
                local_qpn: qpn,
            };
            assert!(matches!(
                Request::parse(&u.encode()),
                Err(ParseError::BadField {
                    field: "local_qpn",
                    ..
                })
            ));
        }
        let top = QpPairing {
            local_qpn: QPN_LIMIT - 1,
            remote_qpn: QPN_LIMIT - 1,
            side_qpn: QPN_LIMIT - 1,
            side_qkey: QKEY_CONTROLLED - 1,
            ..p
        };
        assert_eq!(
            Request::parse(&Request::Pairing(top).encode()),
            Ok(Request::Pairing(top))
        );
        assert_eq!(
            bad(QpPairing {
                side_qkey: QKEY_CONTROLLED,
                ..p
            }),
            "side_qkey"
        );
        assert_eq!(
            bad(QpPairing {
                remote_gid: [0; 16],
                remote_lid: 0,
                ..p
            }),
            "remote_gid"
        );
        let paired = |side_qpn, side_qkey| {
            Reply::parse(
                &Reply::Paired(Paired {
                    flow: 1,
                    local_qpn: 2,
                    side_qpn,
                    side_qkey,
                })
                .encode(),
            )
        };
        assert!(matches!(
            paired(0, 1),
            Err(ParseError::BadField {
                field: "side_qpn",
                ..
            })
        ));
        assert!(matches!(
            paired(3, QKEY_CONTROLLED | 1),
            Err(ParseError::BadField {
                field: "side_qkey",
                ..
            })
        ));
        let wire = Request::Pairing(p).encode();
        assert!(matches!(
            Request::parse(&wire[..wire.len() - 1]),
            Err(ParseError::BadLength {
                kind: "pairing",
                ..
            })
        ));
    }

    /// A bounded fuzz run inside `cargo test` (so in `scripts/test.sh`, on the stable
    /// toolchain): random bytes, and valid messages with random bytes flipped, cut or
    /// appended, from a fixed seed; the parser must return (never panic), whatever it
    /// accepts must re-encode to exactly the input, and whatever it refuses it refuses
    /// with a reason. `JUSTITIA_FUZZ_CASES` and `JUSTITIA_FUZZ_SEED` run it longer or from
    /// another seed; the default is 200000 cases, well under a second.
    #[test]
    fn bounded_fuzz_of_the_parser() {
        let cases: u32 = std::env::var("JUSTITIA_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200_000);
        let mut x: u64 = std::env::var("JUSTITIA_FUZZ_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&s| s != 0)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let seeds = [
            Request::Register(reg()).encode(),
            Request::Usage(Usage {
                flow: 1,
                active: true,
                bytes: 2,
                ops: 3,
            })
            .encode(),
            Request::Unregister { flow: 1 }.encode(),
            Request::Pairing(pairing()).encode(),
        ];
        let mut accepted = 0u64;
        for i in 0..cases {
            let mut msg = seeds[i as usize % seeds.len()].clone();
            match next() % 4 {
                0 => {
                    let len = (next() % (MAX_MESSAGE as u64 + 8)) as usize;
                    msg = (0..len).map(|_| next() as u8).collect();
                }
                1 => {
                    let at = (next() as usize) % msg.len();
                    msg[at] ^= 1 << (next() % 8);
                }
                2 => msg.truncate((next() as usize) % msg.len()),
                _ => msg.extend((0..next() % 4 + 1).map(|_| next() as u8)),
            }
            match Request::parse(&msg) {
                Ok(r) => {
                    assert_eq!(r.encode(), msg);
                    accepted += 1;
                }
                Err(e) => assert!(e.to_string().len() > 10, "{e:?} has no reason"),
            }
        }
        // Flipping a bit of a value field keeps a valid message; most mutations do not.
        let share = accepted as f64 / f64::from(cases.max(1));
        assert!(
            share > 0.005 && share < 0.5,
            "{accepted} of {cases} accepted"
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_accepted_ones_round_trip(
            msg in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            if let Ok(r) = Request::parse(&msg) {
                prop_assert_eq!(r.encode(), msg.clone());
            }
            if let Ok(r) = Reply::parse(&msg) {
                prop_assert_eq!(r.encode(), msg);
            }
        }

        #[test]
        fn every_truncation_of_a_valid_message_is_refused(
            client_ref in any::<u64>(), qps in 1u32..1000, cut in 0usize..29
        ) {
            let wire = Request::Register(Register { client_ref, qps, ..reg() }).encode();
            prop_assert!(Request::parse(&wire[..cut]).is_err());
        }

        #[test]
        fn oversized_messages_are_refused(extra in 1usize..4096) {
            let mut wire = Request::Register(reg()).encode();
            wire.resize(MAX_MESSAGE + extra, 0);
            prop_assert_eq!(Request::parse(&wire), Err(ParseError::Oversized { got: MAX_MESSAGE + extra }));
        }
    }
}
