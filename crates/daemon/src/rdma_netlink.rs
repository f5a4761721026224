//! The RDMA queue pairs the kernel tracks, read as iproute2's `rdma resource show qp` reads
//! them: over `NETLINK_RDMA` (protocol 20), the nldev interface's device dump
//! (`RDMA_NLDEV_CMD_GET`), then for each device wanted a dump of its QP table
//! (`RDMA_NLDEV_CMD_RES_QP_GET` with the device's index: the kernel answers that command
//! for one device at a time, `EINVAL` without an index).
//!
//! One job: [`dump_queue_pairs`] opens a socket of its own, asks, reads each answer to its
//! `NLMSG_DONE` and closes the socket, so a dump cut short leaves nothing for the next one
//! to read. The socket is non-blocking and every receive waits in poll(2) no later than the
//! dump's deadline; a dump stops at a cap of queue pairs and says that some were left
//! unread. The framing (`nlmsghdr`, `NLMSG_ERROR`, `NLMSG_DONE`, attribute headers) is
//! `netlink-packet-core`'s; the nldev attributes are parsed here, as no crate knows them.
//! Their numbers are the kernel's ABI (`include/uapi/rdma/rdma_netlink.h`, whose attribute
//! enum must never be reordered).
//!
//! The parser ([`NldevMessage`]) is total on any bytes: every length is checked before it
//! is used, nothing is indexed unchecked, and a malformed message is a [`ParseError`]
//! naming the attribute path and the reason. Attributes it does not know are skipped (newer
//! kernels add some: the port, the PD, driver details); numbers must have exactly their
//! width and names at most [`MAX_NAME`] bytes.
//!
//! What the kernel shows: a user QP carries the pid (in the reader's pid namespace) of the
//! thread that created it, a kernel QP the name of its kernel module instead, and a user
//! QP the reader cannot name carries neither: its process is exiting, or lives in a pid
//! namespace the reader does not see (older kernels leave such QPs out altogether).

use std::time::{Duration, Instant};

use netlink_packet_core::{
    parse_u32, parse_u8, DefaultNla, Emitable, NetlinkDeserializable, NetlinkHeader,
    NetlinkMessage, NetlinkPayload, NetlinkSerializable, NlasIterator, NLA_HEADER_SIZE, NLM_F_DUMP,
    NLM_F_REQUEST,
};
use rustix::net::netlink::SocketAddrNetlink;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// `RDMA_NL_NLDEV`: the nldev client of RDMA netlink.
const RDMA_NL_NLDEV: u16 = 5;
/// `RDMA_NLDEV_CMD_GET`: the devices (a dump lists all of them).
const RDMA_NLDEV_CMD_GET: u16 = 1;
/// `RDMA_NLDEV_CMD_RES_QP_GET`: a device's queue pairs (a dump lists all of them).
const RDMA_NLDEV_CMD_RES_QP_GET: u16 = 10;
/// `RDMA_NLDEV_ATTR_DEV_INDEX` (u32).
const ATTR_DEV_INDEX: u16 = 1;
/// `RDMA_NLDEV_ATTR_DEV_NAME` (string).
const ATTR_DEV_NAME: u16 = 2;
/// `RDMA_NLDEV_ATTR_RES_QP` (nested: a table of entries).
const ATTR_RES_QP: u16 = 19;
/// `RDMA_NLDEV_ATTR_RES_QP_ENTRY` (nested: one queue pair).
const ATTR_RES_QP_ENTRY: u16 = 20;
/// `RDMA_NLDEV_ATTR_RES_LQPN` (u32): the local QP number.
const ATTR_RES_LQPN: u16 = 21;
/// `RDMA_NLDEV_ATTR_RES_TYPE` (u8): `enum ib_qp_type`.
const ATTR_RES_TYPE: u16 = 26;
/// `RDMA_NLDEV_ATTR_RES_STATE` (u8): `enum ib_qp_state`.
const ATTR_RES_STATE: u16 = 27;
/// `RDMA_NLDEV_ATTR_RES_PID` (u32): the creating task, user QPs only.
const ATTR_RES_PID: u16 = 28;
/// `RDMA_NLDEV_ATTR_RES_KERN_NAME` (string): the owning module, kernel QPs only.
const ATTR_RES_KERN_NAME: u16 = 29;

/// The longest device or kernel name accepted (`IB_DEVICE_NAME_MAX`).
pub const MAX_NAME: usize = 64;
/// Devices read from the device dump at most; more are left out.
pub const MAX_DEVICES: usize = 256;
/// The receive buffer. The kernel sizes a dump's messages to the reader's buffer up to
/// 32 KiB; a datagram larger than this one is an error, never read in part.
const RECEIVE_BUFFER: usize = 64 * 1024;

/// `RDMA_NL_GET_TYPE(RDMA_NL_NLDEV, op)`: the message type of an nldev command.
const fn nldev_type(op: u16) -> u16 {
    (RDMA_NL_NLDEV << 10) + op
}

/// A queue pair's transport, `enum ib_qp_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QpType(pub u8);

impl QpType {
    /// Reliable connection.
    pub const RC: QpType = QpType(2);
    /// Unreliable connection.
    pub const UC: QpType = QpType(3);
    /// Unreliable datagram.
    pub const UD: QpType = QpType(4);
}

impl std::fmt::Display for QpType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            0 => "SMI",
            1 => "GSI",
            2 => "RC",
            3 => "UC",
            4 => "UD",
            5 => "RAW_IPV6",
            6 => "RAW_ETHERTYPE",
            8 => "RAW_PACKET",
            9 => "XRC_INI",
            10 => "XRC_TGT",
            0xff => "DRIVER",
            other => return write!(f, "type {other}"),
        };
        f.write_str(name)
    }
}

/// A queue pair's state, `enum ib_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QpState(pub u8);

impl std::fmt::Display for QpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            0 => "RESET",
            1 => "INIT",
            2 => "RTR",
            3 => "RTS",
            4 => "SQD",
            5 => "SQE",
            6 => "ERR",
            other => return write!(f, "state {other}"),
        };
        f.write_str(name)
    }
}

/// Who holds a queue pair, as the kernel says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QpOwner {
    /// A user QP: the pid of the thread that created it, in the reader's pid namespace
    /// (a thread id when a thread other than the main one created it).
    Process(i32),
    /// A kernel QP: the name of the kernel module that holds it.
    Kernel(String),
    /// A user QP whose process the reader cannot name: it is exiting, or in a pid
    /// namespace the reader does not see.
    Unnamed,
}

/// One queue pair of a device's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpEntry {
    /// Its local QP number.
    pub qpn: u32,
    /// Its transport.
    pub qp_type: QpType,
    /// Its state, when the kernel gave it.
    pub state: Option<QpState>,
    /// Who holds it.
    pub owner: QpOwner,
}

/// An RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    /// The kernel's index of it.
    pub index: u32,
    /// Its name (`mlx5_0`, `rxe0`).
    pub name: String,
}

/// A device and the queue pairs read from its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceQps {
    /// The device.
    pub device: RdmaDevice,
    /// Its queue pairs (those of one message, or of the whole dump once gathered).
    pub qps: Vec<QpEntry>,
}

/// An nldev answer, as far as this module reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NldevMessage {
    /// One device of the device dump.
    Device(RdmaDevice),
    /// One message of a device's QP dump (a dump of many QPs spans several).
    QueuePairs(DeviceQps),
}

/// A malformed message: where in it (the attribute path) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct ParseError {
    /// The attributes from the message down to the offending one, `>`-separated.
    pub path: String,
    /// What is wrong there.
    pub reason: String,
}

impl ParseError {
    fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        ParseError {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// The same error, found inside `outer`.
    fn inside(mut self, outer: &str) -> Self {
        self.path = format!("{outer} > {}", self.path);
        self
    }
}

impl NetlinkDeserializable for NldevMessage {
    type Error = ParseError;

    fn deserialize(header: &NetlinkHeader, payload: &[u8]) -> Result<Self, ParseError> {
        match header.message_type {
            t if t == nldev_type(RDMA_NLDEV_CMD_GET) => {
                parse_device(payload).map(NldevMessage::Device)
            }
            t if t == nldev_type(RDMA_NLDEV_CMD_RES_QP_GET) => {
                parse_queue_pairs(payload).map(NldevMessage::QueuePairs)
            }
            other => Err(ParseError::new(
                "message",
                format!("type {other:#x} is not an answer to a command this reader sends"),
            )),
        }
    }
}

/// The attributes of `bytes`, as (type without its flags, value), each checked to lie
/// within `bytes`; `within` names them in errors.
fn attributes<'a>(
    bytes: &'a [u8],
    within: &'a str,
) -> impl Iterator<Item = Result<(u16, &'a [u8]), ParseError>> + 'a {
    NlasIterator::new(bytes).map(move |nla| {
        let nla = nla.map_err(|e| ParseError::new(within, e.to_string()))?;
        let kind = nla.kind();
        let end = usize::from(nla.length());
        // The iterator checked that the length covers its header and lies within the
        // buffer; the range is taken checked all the same.
        let value = nla
            .into_inner()
            .get(NLA_HEADER_SIZE..end)
            .ok_or_else(|| ParseError::new(within, "an attribute outside its buffer"))?;
        Ok((kind, value))
    })
}

fn u32_attr(value: &[u8], name: &str) -> Result<u32, ParseError> {
    parse_u32(value).map_err(|e| ParseError::new(name, e.to_string()))
}

fn u8_attr(value: &[u8], name: &str) -> Result<u8, ParseError> {
    parse_u8(value).map_err(|e| ParseError::new(name, e.to_string()))
}

/// A NUL-terminated (or not) name of at most [`MAX_NAME`] bytes; bytes that are not
/// UTF-8 are replaced.
fn name_attr(value: &[u8], name: &str) -> Result<String, ParseError> {
    let text = value.strip_suffix(&[0]).unwrap_or(value);
    if text.len() > MAX_NAME {
        return Err(ParseError::new(
            name,
            format!("{} bytes, longer than {MAX_NAME}", text.len()),
        ));
    }
    if text.contains(&0) {
        return Err(ParseError::new(name, "a NUL inside the name"));
    }
    Ok(String::from_utf8_lossy(text).into_owned())
}

/// The device's index and name, which every nldev answer about a device starts with.
struct DeviceHandle {
    index: Option<u32>,
    name: Option<String>,
}

impl DeviceHandle {
    fn take(&mut self, kind: u16, value: &[u8]) -> Result<bool, ParseError> {
        match kind {
            ATTR_DEV_INDEX => self.index = Some(u32_attr(value, "RDMA_NLDEV_ATTR_DEV_INDEX")?),
            ATTR_DEV_NAME => self.name = Some(name_attr(value, "RDMA_NLDEV_ATTR_DEV_NAME")?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn device(self) -> Result<RdmaDevice, ParseError> {
        Ok(RdmaDevice {
            index: self
                .index
                .ok_or_else(|| ParseError::new("RDMA_NLDEV_ATTR_DEV_INDEX", "missing"))?,
            name: self
                .name
                .ok_or_else(|| ParseError::new("RDMA_NLDEV_ATTR_DEV_NAME", "missing"))?,
        })
    }
}

/// One device of the device dump.
fn parse_device(payload: &[u8]) -> Result<RdmaDevice, ParseError> {
    const WHAT: &str = "RDMA_NLDEV_CMD_GET";
    let mut handle = DeviceHandle {
        index: None,
        name: None,
    };
    for attr in attributes(payload, WHAT) {
        let (kind, value) = attr?;
        handle.take(kind, value).map_err(|e| e.inside(WHAT))?;
    }
    handle.device().map_err(|e| e.inside(WHAT))
}

/// One message of a device's QP dump.
fn parse_queue_pairs(payload: &[u8]) -> Result<DeviceQps, ParseError> {
    const WHAT: &str = "RDMA_NLDEV_CMD_RES_QP_GET";
    let mut handle = DeviceHandle {
        index: None,
        name: None,
    };
    let mut qps = Vec::new();
    for attr in attributes(payload, WHAT) {
        let (kind, value) = attr?;
        if handle.take(kind, value).map_err(|e| e.inside(WHAT))? || kind != ATTR_RES_QP {
            continue;
        }
        for entry in attributes(value, "RDMA_NLDEV_ATTR_RES_QP") {
            let (kind, value) = entry.map_err(|e| e.inside(WHAT))?;
            if kind != ATTR_RES_QP_ENTRY {
                continue;
            }
            let n = qps.len() + 1;
            let qp = parse_entry(value).map_err(|e| {
                e.inside(&format!("RDMA_NLDEV_ATTR_RES_QP_ENTRY {n}"))
                    .inside("RDMA_NLDEV_ATTR_RES_QP")
                    .inside(WHAT)
            })?;
            qps.push(qp);
        }
    }
    let device = handle.device().map_err(|e| e.inside(WHAT))?;
    Ok(DeviceQps { device, qps })
}

/// One `RDMA_NLDEV_ATTR_RES_QP_ENTRY`.
fn parse_entry(bytes: &[u8]) -> Result<QpEntry, ParseError> {
    let (mut qpn, mut qp_type, mut state, mut pid, mut kernel) = (None, None, None, None, None);
    for attr in attributes(bytes, "attributes") {
        let (kind, value) = attr?;
        match kind {
            ATTR_RES_LQPN => qpn = Some(u32_attr(value, "RDMA_NLDEV_ATTR_RES_LQPN")?),
            ATTR_RES_TYPE => qp_type = Some(QpType(u8_attr(value, "RDMA_NLDEV_ATTR_RES_TYPE")?)),
            ATTR_RES_STATE => {
                state = Some(QpState(u8_attr(value, "RDMA_NLDEV_ATTR_RES_STATE")?));
            }
            ATTR_RES_PID => pid = Some(u32_attr(value, "RDMA_NLDEV_ATTR_RES_PID")?),
            ATTR_RES_KERN_NAME => {
                kernel = Some(name_attr(value, "RDMA_NLDEV_ATTR_RES_KERN_NAME")?);
            }
            _ => {}
        }
    }
    let owner =
        match (pid, kernel) {
            (Some(_), Some(_)) => return Err(ParseError::new(
                "RDMA_NLDEV_ATTR_RES_PID",
                "given beside RDMA_NLDEV_ATTR_RES_KERN_NAME: a QP is a process's or the kernel's",
            )),
            (None, Some(name)) => QpOwner::Kernel(name),
            (None | Some(0), None) => QpOwner::Unnamed,
            (Some(pid), None) => QpOwner::Process(i32::try_from(pid).map_err(|_| {
                ParseError::new("RDMA_NLDEV_ATTR_RES_PID", format!("{pid} is not a pid"))
            })?),
        };
    Ok(QpEntry {
        qpn: qpn.ok_or_else(|| ParseError::new("RDMA_NLDEV_ATTR_RES_LQPN", "missing"))?,
        qp_type: qp_type.ok_or_else(|| ParseError::new("RDMA_NLDEV_ATTR_RES_TYPE", "missing"))?,
        state,
        owner,
    })
}

/// A dump request: `op`, for one device or all.
struct NldevRequest {
    op: u16,
    device_index: Option<u32>,
}

impl NldevRequest {
    fn attribute(&self) -> Option<DefaultNla> {
        self.device_index
            .map(|i| DefaultNla::new(ATTR_DEV_INDEX, i.to_ne_bytes().to_vec()))
    }

    /// The request as sent: a dump, sequence number `seq`.
    fn encode(self, seq: u32) -> Vec<u8> {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(self));
        msg.finalize();
        let mut bytes = vec![0; msg.buffer_len()];
        msg.serialize(&mut bytes);
        bytes
    }
}

impl NetlinkSerializable for NldevRequest {
    fn message_type(&self) -> u16 {
        nldev_type(self.op)
    }

    fn buffer_len(&self) -> usize {
        self.attribute().map_or(0, |a| a.buffer_len())
    }

    fn serialize(&self, buffer: &mut [u8]) {
        if let Some(a) = self.attribute() {
            a.emit(buffer);
        }
    }
}

/// Which devices to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceFilter {
    /// Every device the kernel lists (in the reader's network namespace).
    All,
    /// The devices of these names (those the kernel does not list are left out).
    Named(Vec<String>),
}

impl DeviceFilter {
    fn wants(&self, name: &str) -> bool {
        match self {
            DeviceFilter::All => true,
            DeviceFilter::Named(names) => names.iter().any(|n| n == name),
        }
    }
}

/// The queue pairs of the devices read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QpDump {
    /// Each device read, with its queue pairs.
    pub devices: Vec<DeviceQps>,
    /// The cap was reached: some queue pairs were left unread.
    pub capped: bool,
}

/// Why a dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// No `NETLINK_RDMA` socket: a kernel without RDMA (or `ib_core` not loaded), or a
    /// sandbox that forbids netlink.
    #[error("no NETLINK_RDMA socket: {0}")]
    Unavailable(#[source] std::io::Error),
    /// The request could not be sent.
    #[error("sending {what}: {source}")]
    Send {
        /// The command.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// Reading the answer failed.
    #[error("reading the answer to {what}: {source}")]
    Receive {
        /// The command.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The kernel answered with an error (an old kernel without the command: `EINVAL` or
    /// `EOPNOTSUPP`).
    #[error("the kernel refused {what}: {source}")]
    Refused {
        /// The command.
        what: &'static str,
        /// Its errno.
        source: std::io::Error,
    },
    /// The answer did not end before the deadline.
    #[error("{what}: no complete answer within {timeout:?}")]
    Timeout {
        /// The command.
        what: &'static str,
        /// The dump's time limit.
        timeout: Duration,
    },
    /// A datagram larger than the receive buffer.
    #[error("{what}: a datagram of {len} bytes, more than the {RECEIVE_BUFFER}-byte buffer")]
    Oversized {
        /// The command.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// A message that does not parse.
    #[error("{what}: malformed answer: {reason}")]
    Malformed {
        /// The command.
        what: &'static str,
        /// Why, with the attribute path.
        reason: String,
    },
}

fn io_error(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.raw_os_error())
}

/// What a message handler tells the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Read on.
    More,
    /// Enough: stop reading this dump.
    Stop,
}

/// Where a datagram left the dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// More datagrams follow.
    Reading,
    /// The kernel's `NLMSG_DONE`, or the handler said stop.
    Finished,
}

/// Hands the messages of one datagram that answer request `seq` to `on_message`, in
/// order; those of another sequence number are skipped.
fn take_datagram(
    datagram: &[u8],
    seq: u32,
    what: &'static str,
    on_message: &mut dyn FnMut(NldevMessage) -> Next,
) -> Result<Progress, DumpError> {
    let mut rest = datagram;
    while !rest.is_empty() {
        let msg = NetlinkMessage::<NldevMessage>::deserialize(rest).map_err(|e| {
            DumpError::Malformed {
                what,
                reason: e.to_string(),
            }
        })?;
        // Checked by the parse: at least a header, at most what is left. Messages are
        // 4-byte aligned within a datagram.
        let step = (msg.header.length as usize).saturating_add(3) & !3;
        rest = rest.get(step..).unwrap_or_default();
        if msg.header.sequence_number != seq {
            continue;
        }
        match msg.payload {
            NetlinkPayload::Done(done) if done.code != 0 => {
                return Err(DumpError::Refused {
                    what,
                    source: std::io::Error::from_raw_os_error(done.code.saturating_abs()),
                })
            }
            NetlinkPayload::Done(_) => return Ok(Progress::Finished),
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(DumpError::Refused {
                    what,
                    source: std::io::Error::from_raw_os_error(e.raw_code().saturating_abs()),
                })
            }
            NetlinkPayload::Overrun(_) => {
                return Err(DumpError::Malformed {
                    what,
                    reason: "the kernel reported an overrun".into(),
                })
            }
            NetlinkPayload::InnerMessage(m) => match on_message(m) {
                Next::Stop => return Ok(Progress::Finished),
                Next::More => {}
            },
            // An acknowledgement or a no-op.
            _ => {}
        }
    }
    Ok(Progress::Reading)
}

/// A `NETLINK_RDMA` socket for one dump after another, each waited for until `deadline`.
struct NldevSocket {
    fd: std::os::fd::OwnedFd,
    seq: u32,
    buf: Vec<u8>,
    deadline: Instant,
    timeout: Duration,
}

impl NldevSocket {
    fn open(timeout: Duration) -> Result<NldevSocket, DumpError> {
        let fd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            Some(rustix::net::netlink::RDMA),
        )
        .map_err(|e| DumpError::Unavailable(io_error(e)))?;
        rustix::net::bind(&fd, &SocketAddrNetlink::new(0, 0))
            .map_err(|e| DumpError::Unavailable(io_error(e)))?;
        Ok(NldevSocket {
            fd,
            seq: 0,
            buf: vec![0; RECEIVE_BUFFER],
            deadline: Instant::now() + timeout,
            timeout,
        })
    }

    /// Sends a dump request and hands its answer's messages to `on_message` until the
    /// kernel's `NLMSG_DONE` or until it says stop.
    fn dump(
        &mut self,
        request: NldevRequest,
        what: &'static str,
        on_message: &mut dyn FnMut(NldevMessage) -> Next,
    ) -> Result<(), DumpError> {
        self.seq = self.seq.wrapping_add(1);
        let bytes = request.encode(self.seq);
        rustix::net::sendto(
            &self.fd,
            &bytes,
            SendFlags::DONTWAIT,
            &SocketAddrNetlink::new(0, 0),
        )
        .map_err(|e| DumpError::Send {
            what,
            source: io_error(e),
        })?;
        loop {
            let len = self.receive(what)?;
            let datagram = self.buf.get(..len).unwrap_or_default();
            if take_datagram(datagram, self.seq, what, on_message)? == Progress::Finished {
                return Ok(());
            }
        }
    }

    /// Waits for the next datagram from the kernel, no later than the deadline; returns
    /// its length (in `buf`). Datagrams from any other sender are dropped.
    fn receive(&mut self, what: &'static str) -> Result<usize, DumpError> {
        let receive_error = |e: rustix::io::Errno| DumpError::Receive {
            what,
            source: io_error(e),
        };
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DumpError::Timeout {
                    what,
                    timeout: self.timeout,
                });
            }
            let wait = rustix::time::Timespec {
                tv_sec: i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: left.subsec_nanos().into(),
            };
            let mut fds = [rustix::event::PollFd::new(
                &self.fd,
                rustix::event::PollFlags::IN,
            )];
            match rustix::event::poll(&mut fds, Some(&wait)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(receive_error(e)),
            }
            match rustix::net::recvfrom(
                &self.fd,
                &mut self.buf[..],
                RecvFlags::DONTWAIT | RecvFlags::TRUNC,
            ) {
                Ok((_, len, _)) if len > self.buf.len() => {
                    return Err(DumpError::Oversized { what, len })
                }
                Ok((_, len, from)) => {
                    let kernel = from
                        .and_then(|a| SocketAddrNetlink::try_from(a).ok())
                        .is_some_and(|a| a.pid() == 0);
                    if kernel {
                        return Ok(len);
                    }
                }
                // Nothing yet (poll timed out, or woke for nothing): the deadline is
                // looked at again.
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
                Err(e) => return Err(receive_error(e)),
            }
        }
    }
}

/// The command name of a QP dump, in errors.
const RES_QP_GET: &str = "RDMA_NLDEV_CMD_RES_QP_GET";

/// One device's QP dump, gathered message by message: what [`dump_queue_pairs`] does
/// with each datagram of the kernel's answer, apart from the socket (so that it can be
/// timed on synthetic datagrams).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpGather {
    device_index: u32,
    room: usize,
    /// The queue pairs read so far.
    pub qps: Vec<QpEntry>,
    /// The cap was reached: the dump stopped with queue pairs left unread.
    pub capped: bool,
}

impl QpGather {
    /// A gathering of the QP dump of device `device_index`, of at most `room` queue
    /// pairs.
    pub fn new(device_index: u32, room: usize) -> QpGather {
        QpGather {
            device_index,
            room,
            qps: Vec::new(),
            capped: false,
        }
    }

    fn take(&mut self, m: NldevMessage) -> Next {
        let NldevMessage::QueuePairs(part) = m else {
            return Next::More;
        };
        // A message about another device (never sent in answer to this request) is not
        // this device's.
        if part.device.index != self.device_index {
            return Next::More;
        }
        let room = self.room.saturating_sub(self.qps.len());
        self.capped = part.qps.len() > room;
        self.qps.extend(part.qps.into_iter().take(room));
        if self.capped {
            Next::Stop
        } else {
            Next::More
        }
    }

    /// Takes one datagram of the answer to the request of sequence number `seq`;
    /// whether the dump is over (the kernel's `NLMSG_DONE`, or the cap).
    pub fn take_datagram(&mut self, datagram: &[u8], seq: u32) -> Result<bool, DumpError> {
        let progress = take_datagram(datagram, seq, RES_QP_GET, &mut |m| self.take(m))?;
        Ok(progress == Progress::Finished)
    }
}

/// The queue pairs of the devices `filter` names, at most `max_qps` of them, read within
/// `timeout`: see the module documentation.
pub fn dump_queue_pairs(
    filter: &DeviceFilter,
    max_qps: usize,
    timeout: Duration,
) -> Result<QpDump, DumpError> {
    let mut sock = NldevSocket::open(timeout)?;
    let mut devices = Vec::new();
    sock.dump(
        NldevRequest {
            op: RDMA_NLDEV_CMD_GET,
            device_index: None,
        },
        "RDMA_NLDEV_CMD_GET",
        &mut |m| {
            if let NldevMessage::Device(d) = m {
                if filter.wants(&d.name) && devices.len() < MAX_DEVICES {
                    devices.push(d);
                }
            }
            Next::More
        },
    )?;
    let mut dump = QpDump::default();
    let mut read = 0usize;
    for device in devices {
        let mut gather = QpGather::new(device.index, max_qps.saturating_sub(read));
        sock.dump(
            NldevRequest {
                op: RDMA_NLDEV_CMD_RES_QP_GET,
                device_index: Some(device.index),
            },
            RES_QP_GET,
            &mut |m| gather.take(m),
        )?;
        read += gather.qps.len();
        let capped = gather.capped;
        dump.devices.push(DeviceQps {
            device,
            qps: gather.qps,
        });
        if capped {
            dump.capped = true;
            break;
        }
    }
    Ok(dump)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// One attribute: its header, the value, padding to 4 bytes.
    fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
        let len = u16::try_from(4 + value.len()).unwrap();
        let mut out = [len.to_ne_bytes(), kind.to_ne_bytes()].concat();
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    fn message(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(16 + payload.len()).unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&flags.to_ne_bytes());
        out.extend_from_slice(&seq.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn user_qp(qpn: u32, qp_type: u8, pid: u32) -> Vec<u8> {
        let entry = [
            nla(ATTR_RES_LQPN, &qpn.to_ne_bytes()),
            nla(ATTR_RES_TYPE, &[qp_type]),
            nla(ATTR_RES_STATE, &[3]),
            nla(ATTR_RES_PID, &pid.to_ne_bytes()),
        ]
        .concat();
        nla(ATTR_RES_QP_ENTRY, &entry)
    }

    fn qp_message(seq: u32, index: u32, name: &str, entries: &[Vec<u8>]) -> Vec<u8> {
        let payload = [
            nla(ATTR_DEV_INDEX, &index.to_ne_bytes()),
            nla(ATTR_DEV_NAME, format!("{name}\0").as_bytes()),
            nla(ATTR_RES_QP, &entries.concat()),
        ]
        .concat();
        message(nldev_type(RDMA_NLDEV_CMD_RES_QP_GET), 2, seq, &payload)
    }

    fn parse(bytes: &[u8]) -> Result<NldevMessage, String> {
        NetlinkMessage::<NldevMessage>::deserialize(bytes)
            .map_err(|e| e.to_string())
            .and_then(|m| match m.payload {
                NetlinkPayload::InnerMessage(m) => Ok(m),
                other => Err(format!("not an nldev message: {other:?}")),
            })
    }

    /// The kernel's answer for rxe0 (index 3): an RC QP 17 in RTS of pid 4242 and the GSI
    /// QP 1 of ib_core, byte by byte (little-endian). Lengths by hand: LQPN 4+4 = 8;
    /// TYPE and STATE 4+1 = 5, padded to 8; PID 8; so the first entry is 4 + 32 = 36. The
    /// second: LQPN, TYPE, STATE 24, KERN_NAME 4 + "ib_core\0" 8 = 12, so 4 + 36 = 40.
    /// RES_QP: 4 + 36 + 40 = 80; DEV_INDEX 8, DEV_NAME 4 + "rxe0\0" 5 = 9 padded to 12;
    /// payload 100, message 116. The type is (5 << 10) + 10 = 5130 = 0x140a.
    #[rustfmt::skip]
    const RXE0: [u8; 116] = [
        116, 0, 0, 0,  0x0a, 0x14,  2, 0,  9, 0, 0, 0,  0, 0, 0, 0,
        8, 0, 1, 0,  3, 0, 0, 0,
        9, 0, 2, 0,  b'r', b'x', b'e', b'0',  0, 0, 0, 0,
        80, 0, 19, 0,
          36, 0, 20, 0,
            8, 0, 21, 0,  17, 0, 0, 0,
            5, 0, 26, 0,  2, 0, 0, 0,
            5, 0, 27, 0,  3, 0, 0, 0,
            8, 0, 28, 0,  0x92, 0x10, 0, 0,
          40, 0, 20, 0,
            8, 0, 21, 0,  1, 0, 0, 0,
            5, 0, 26, 0,  1, 0, 0, 0,
            5, 0, 27, 0,  3, 0, 0, 0,
            12, 0, 29, 0,  b'i', b'b', b'_', b'c', b'o', b'r', b'e', 0,
    ];

    #[test]
    #[cfg(target_endian = "little")]
    fn a_qp_table_is_read_byte_by_byte() {
        let m = parse(&RXE0).unwrap();
        let NldevMessage::QueuePairs(d) = m else {
            panic!("{m:?}")
        };
        assert_eq!(
            d.device,
            RdmaDevice {
                index: 3,
                name: "rxe0".into()
            }
        );
        assert_eq!(
            d.qps,
            [
                QpEntry {
                    qpn: 17,
                    qp_type: QpType::RC,
                    state: Some(QpState(3)),
                    owner: QpOwner::Process(4242),
                },
                QpEntry {
                    qpn: 1,
                    qp_type: QpType(1),
                    state: Some(QpState(3)),
                    owner: QpOwner::Kernel("ib_core".into()),
                },
            ]
        );
        assert_eq!(
            qp_message(9, 3, "rxe0", &[user_qp(17, 2, 4242)]).len(),
            16 + 20 + 40
        );
        assert_eq!(
            (
                QpType::RC.to_string(),
                QpType(1).to_string(),
                QpType(7).to_string()
            ),
            ("RC".into(), "GSI".into(), "type 7".into())
        );
        assert_eq!(QpState(3).to_string(), "RTS");
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn a_dump_request_is_the_kernels_layout() {
        // 16 + DEV_INDEX (8) = 24 bytes; type 0x140a; NLM_F_REQUEST | NLM_F_DUMP = 0x301.
        let bytes = NldevRequest {
            op: RDMA_NLDEV_CMD_RES_QP_GET,
            device_index: Some(3),
        }
        .encode(7);
        assert_eq!(
            bytes,
            [24, 0, 0, 0, 0x0a, 0x14, 0x01, 0x03, 7, 0, 0, 0, 0, 0, 0, 0, 8, 0, 1, 0, 3, 0, 0, 0]
        );
        let all = NldevRequest {
            op: RDMA_NLDEV_CMD_GET,
            device_index: None,
        }
        .encode(1);
        assert_eq!(
            all,
            [16, 0, 0, 0, 0x01, 0x14, 0x01, 0x03, 1, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn a_device_message_gives_index_and_name() {
        let payload = [
            nla(ATTR_DEV_INDEX, &7u32.to_ne_bytes()),
            nla(ATTR_DEV_NAME, b"mlx5_0\0"),
            // The port count and the firmware version: not read.
            nla(3, &1u32.to_ne_bytes()),
            nla(5, b"20.31.1014\0"),
        ]
        .concat();
        let m = parse(&message(nldev_type(RDMA_NLDEV_CMD_GET), 2, 1, &payload)).unwrap();
        assert_eq!(
            m,
            NldevMessage::Device(RdmaDevice {
                index: 7,
                name: "mlx5_0".into()
            })
        );
        let nameless = message(
            nldev_type(RDMA_NLDEV_CMD_GET),
            2,
            1,
            &nla(ATTR_DEV_INDEX, &7u32.to_ne_bytes()),
        );
        assert_eq!(
            parse(&nameless).unwrap_err(),
            "Failed to parse message with type 5121: RDMA_NLDEV_CMD_GET > RDMA_NLDEV_ATTR_DEV_NAME: missing"
        );
    }

    #[test]
    fn unknown_attributes_and_nested_flags_are_taken_in_their_stride() {
        // A newer kernel's entry: the port, the PD number and a driver table among the
        // known attributes, and the nested flag (0x8000) on the table and the entry.
        let entry = [
            nla(ATTR_RES_LQPN, &5u32.to_ne_bytes()),
            nla(3, &1u32.to_ne_bytes()),
            nla(ATTR_RES_TYPE, &[4]),
            nla(0x8000 | 58, &nla(59, b"x")),
            nla(ATTR_RES_PID, &77u32.to_ne_bytes()),
        ]
        .concat();
        let payload = [
            nla(ATTR_DEV_INDEX, &1u32.to_ne_bytes()),
            nla(ATTR_DEV_NAME, b"rxe0"),
            nla(
                0x8000 | ATTR_RES_QP,
                &nla(0x8000 | ATTR_RES_QP_ENTRY, &entry),
            ),
        ]
        .concat();
        let m = parse(&message(
            nldev_type(RDMA_NLDEV_CMD_RES_QP_GET),
            2,
            1,
            &payload,
        ))
        .unwrap();
        let NldevMessage::QueuePairs(d) = m else {
            panic!("{m:?}")
        };
        assert_eq!(d.device.name, "rxe0");
        assert_eq!(
            d.qps,
            [QpEntry {
                qpn: 5,
                qp_type: QpType::UD,
                state: None,
                owner: QpOwner::Process(77)
            }]
        );
    }

    /// Each malformed entry, and the path and reason its error must give.
    #[test]
    fn malformed_entries_name_the_attribute_and_the_reason() {
        let lqpn = nla(ATTR_RES_LQPN, &1u32.to_ne_bytes());
        let rc = nla(ATTR_RES_TYPE, &[2]);
        let cases: [(Vec<u8>, &str); 7] = [
            (
                [nla(ATTR_RES_LQPN, &[1, 0]), rc.clone()].concat(),
                "RDMA_NLDEV_ATTR_RES_LQPN: Invalid number. Expected 4 bytes, received 2 bytes",
            ),
            (rc.clone(), "RDMA_NLDEV_ATTR_RES_LQPN: missing"),
            (lqpn.clone(), "RDMA_NLDEV_ATTR_RES_TYPE: missing"),
            (
                [lqpn.clone(), nla(ATTR_RES_TYPE, &[2, 0])].concat(),
                "RDMA_NLDEV_ATTR_RES_TYPE: Invalid number. Expected 1 bytes, received 2 bytes",
            ),
            (
                [
                    lqpn.clone(),
                    rc.clone(),
                    nla(ATTR_RES_PID, &u32::MAX.to_ne_bytes()),
                ]
                .concat(),
                "RDMA_NLDEV_ATTR_RES_PID: 4294967295 is not a pid",
            ),
            (
                [
                    lqpn.clone(),
                    rc.clone(),
                    nla(ATTR_RES_PID, &1u32.to_ne_bytes()),
                    nla(ATTR_RES_KERN_NAME, b"ib_core\0"),
                ]
                .concat(),
                "RDMA_NLDEV_ATTR_RES_PID: given beside RDMA_NLDEV_ATTR_RES_KERN_NAME",
            ),
            (
                [
                    lqpn.clone(),
                    rc.clone(),
                    nla(ATTR_RES_KERN_NAME, &[b'k'; 65]),
                ]
                .concat(),
                "RDMA_NLDEV_ATTR_RES_KERN_NAME: 65 bytes, longer than 64",
            ),
        ];
        for (entry, want) in cases {
            let bytes = qp_message(
                1,
                1,
                "rxe0",
                &[user_qp(9, 2, 1), nla(ATTR_RES_QP_ENTRY, &entry)],
            );
            let err = parse(&bytes).unwrap_err();
            let path = "RDMA_NLDEV_CMD_RES_QP_GET > RDMA_NLDEV_ATTR_RES_QP > RDMA_NLDEV_ATTR_RES_QP_ENTRY 2 > ";
            assert!(
                err.contains(&format!("{path}{want}")),
                "{err}\nwanted {want}"
            );
        }
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn truncated_and_oversized_attributes_are_errors() {
        let good = qp_message(1, 1, "rxe0", &[user_qp(9, 2, 1)]);
        // The message's own length cut to end inside the last attribute (the datagram
        // shortened with it): the attribute's length now runs past its buffer.
        let mut cut = good[..good.len() - 2].to_vec();
        let len = u32::try_from(cut.len()).unwrap();
        cut[..4].copy_from_slice(&len.to_ne_bytes());
        // The payload is 60 bytes: DEV_INDEX 8 and DEV_NAME 12, then RES_QP's 40 in 38.
        let err = parse(&cut).unwrap_err();
        assert!(
            err.ends_with(
                "RDMA_NLDEV_CMD_RES_QP_GET: buffer has length: 38, but the NLA is 40 bytes"
            ),
            "{err}"
        );
        // An attribute that claims more than its table holds.
        let mut long = good.clone();
        let lqpn_at = long.windows(4).position(|w| w == [8, 0, 21, 0]).unwrap();
        long[lqpn_at] = 200;
        let err = parse(&long).unwrap_err();
        assert!(
            err.contains("RDMA_NLDEV_ATTR_RES_QP_ENTRY 1 > attributes"),
            "{err}"
        );
        // An attribute shorter than its own header.
        long[lqpn_at] = 2;
        let err = parse(&long).unwrap_err();
        assert!(err.contains("invalid length: 2"), "{err}");
        // A message length beyond the datagram, and one below a header.
        let mut over = good.clone();
        over[..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(parse(&over).unwrap_err().contains("length field says 1000"));
        let mut under = good;
        under[..4].copy_from_slice(&8u32.to_ne_bytes());
        assert!(parse(&under).is_err());
        assert!(parse(&[]).is_err());
    }

    /// Every prefix of a real answer, and every byte of it set to each of several values,
    /// parses or fails: nothing panics.
    #[test]
    fn no_truncation_or_single_byte_change_panics() {
        let datagram = [
            qp_message(4, 1, "rxe0", &[user_qp(9, 2, 1), user_qp(10, 4, 2)]),
            message(3, 2, 4, &0i32.to_ne_bytes()),
        ]
        .concat();
        for len in 0..=datagram.len() {
            let _ = take_datagram(&datagram[..len], 4, "test", &mut |_| Next::More);
        }
        for at in 0..datagram.len() {
            for value in [0, 1, 3, 4, 0x7f, 0x80, 0xff] {
                let mut changed = datagram.clone();
                changed[at] = value;
                let _ = take_datagram(&changed, 4, "test", &mut |_| Next::More);
            }
        }
    }

    #[test]
    fn a_datagram_is_read_to_its_done_and_errors_are_the_kernels() {
        let done = message(3, 2, 4, &0i32.to_ne_bytes());
        let datagram = [
            qp_message(4, 1, "rxe0", &[user_qp(9, 2, 1)]),
            // An answer to an earlier request: skipped.
            qp_message(3, 1, "rxe0", &[user_qp(99, 2, 1)]),
            qp_message(4, 1, "rxe0", &[user_qp(10, 2, 1)]),
            done.clone(),
        ]
        .concat();
        let mut seen = Vec::new();
        let progress = take_datagram(&datagram, 4, "test", &mut |m| {
            if let NldevMessage::QueuePairs(d) = m {
                seen.extend(d.qps.iter().map(|q| q.qpn));
            }
            Next::More
        })
        .unwrap();
        assert_eq!((progress, seen), (Progress::Finished, vec![9, 10]));
        // Without its done, more is to come; a handler that has enough stops it.
        let first = qp_message(4, 1, "rxe0", &[user_qp(9, 2, 1)]);
        assert_eq!(
            take_datagram(&first, 4, "test", &mut |_| Next::More).unwrap(),
            Progress::Reading
        );
        assert_eq!(
            take_datagram(&first, 4, "test", &mut |_| Next::Stop).unwrap(),
            Progress::Finished
        );
        // A dump the kernel ended with an error (EINVAL: no such device), and an
        // NLMSG_ERROR (EOPNOTSUPP).
        let failed = message(3, 2, 4, &(-22i32).to_ne_bytes());
        let e = take_datagram(&failed, 4, "test", &mut |_| Next::More).unwrap_err();
        assert!(
            matches!(&e, DumpError::Refused { source, .. } if source.raw_os_error() == Some(22)),
            "{e}"
        );
        let nack = message(
            2,
            0,
            4,
            &[(-95i32).to_ne_bytes().as_slice(), &first[..16]].concat(),
        );
        let e = take_datagram(&nack, 4, "test", &mut |_| Next::More).unwrap_err();
        assert!(
            matches!(&e, DumpError::Refused { source, .. } if source.raw_os_error() == Some(95)),
            "{e}"
        );
        // Codes whose absolute value does not fit: refused all the same.
        for kind in [2u16, 3] {
            let odd = message(
                kind,
                0,
                4,
                &[i32::MIN.to_ne_bytes().as_slice(), &first[..16]].concat(),
            );
            let e = take_datagram(&odd, 4, "test", &mut |_| Next::More).unwrap_err();
            assert!(matches!(&e, DumpError::Refused { .. }), "{e}");
        }
        // A message of a type this reader never asks for.
        let odd = message(nldev_type(9), 2, 4, &[]);
        let e = take_datagram(&odd, 4, "test", &mut |_| Next::More).unwrap_err();
        assert!(e.to_string().contains("type 0x1409"), "{e}");
    }

    #[test]
    fn the_device_filter_takes_names() {
        assert!(DeviceFilter::All.wants("rxe0"));
        let named = DeviceFilter::Named(vec!["mlx5_0".into()]);
        assert!(named.wants("mlx5_0") && !named.wants("mlx5_1"));
    }
}
