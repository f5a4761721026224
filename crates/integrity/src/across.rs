//! The checker across two hosts: a *server* process holds the responder QP and the remote
//! regions, a *client* process on another host holds the requester and moves data to or
//! from them.
//!
//! The two exchange what connecting needs over one TCP connection, as perftest does out
//! of band: the client sends [`Hello`] (its QP's endpoint, the seed, the regions it
//! wants, the mode of the run), the server creates the regions and answers with its
//! endpoint and each region's address and rkey; both then connect their QPs.
//!
//! In the default READ mode the server fills region `r` wholly with the pattern of
//! [`region_seed`]`(seed, r)`. Every transfer the client's plan draws is posted as an
//! RDMA READ, so its bytes cross the link from the server's RNIC to the client's, and the
//! client checks each destination against the pattern at the remote offset it came from,
//! the guard bytes around it and every completion, as the one-process checker does. The
//! client sends one byte after every batch, and [`DONE`] at the end; the server then
//! checks that no READ changed its regions and answers with one verdict byte.
//!
//! In the two-sided modes (`--two-sided send` or `write-imm`, see [`crate::two_sided`])
//! data flows the other way and the server judges it. Both ends draw the same batches of
//! messages from the seed and the settings the hello carries. Per batch: the client asks
//! for it ([`NEXT_BATCH`]); the server lays out its region, posts every receive of the
//! batch and says so ([`RECEIVES_POSTED`]), so that no message ever meets a missing
//! receive; the client posts the batch's SENDs or WRITEs with immediate, all signaled, and
//! checks its send completions; the server checks every receive completion (order,
//! `wr_id`, status, opcode, byte count, immediate flag and value), every byte, the guards
//! around every range and the rest of its region, and answers with a [`Verdict`] that
//! names the first faults. After [`DONE`] it checks that no stray completion came and
//! answers with a last verdict.
//!
//! The server trusts nothing it is sent: every field of [`Hello`] is range-checked (at
//! most [`MAX_REGIONS`] regions of at most [`MAX_REGION_LEN`] bytes; a known mode; for
//! two-sided runs the caps of [`MessageConfig::validate`] and a region length that matches
//! them), and every read of the connection has a deadline, so a client that goes silent
//! ends the server's run, as does one that goes away before it is done.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_verbs::sys::*;
use justitia_verbs::{
    CompletionChannel, CompletionQueue, Context, Endpoint, Ibverbs, MemoryRegion, ProtectionDomain,
    QpCaps, QueuePair, RecvRequest, SendRequest, VerbsError,
};

use crate::checker::{
    batch_queue_depth, check_send_completion, local_sges, queue_depth, wait_for, Awaited,
    CheckError, Fault, Report,
};
use crate::pattern;
use crate::plan::{Batch, Operation, Placement, PlanConfig, GUARD};
use crate::two_sided::{
    eventless_completion, extra_completion, fill_sources, judge_bytes, judge_completion,
    judge_elsewhere, missing_completion, prepare_region, restore_region, Message, MessageBatch,
    MessageConfig, MessagePlanner, MessageReport, Mismatch, TwoSided,
};

/// Regions a client may ask for at most.
pub const MAX_REGIONS: u32 = 8;
/// Bytes a region may have at most (the checker's largest transfer and its slack).
pub const MAX_REGION_LEN: u64 = (1 << 30) + crate::plan::REGION_SLACK as u64;
/// The byte a client sends after its last batch.
pub const DONE: u8 = 0xff;
/// The byte a client sends after every other batch (keeps the server's deadline).
const PROGRESS: u8 = 0x01;
/// The byte a two-sided client sends before each batch: post its receives.
pub const NEXT_BATCH: u8 = 0x01;
/// The byte the server of a two-sided run answers once a batch's receives are posted.
pub const RECEIVES_POSTED: u8 = b'R';
/// Bytes of text a [`Verdict`] carries at most.
pub const MAX_VERDICT_TEXT: usize = 4096;
/// How many faults a [`Verdict`] describes at most (it counts them all).
const VERDICT_FAULTS: usize = 5;
const MAGIC: [u8; 4] = *b"JIX2";
/// The greeting of a checker from before the hello had a mode.
const OLD_MAGIC: [u8; 4] = *b"JIX1";
/// Bytes of a [`Hello`] on the connection.
pub const HELLO_LEN: usize = 4 + ENDPOINT_LEN + 8 + 8 + 4 + MODE_LEN;
const ENDPOINT_LEN: usize = 4 + 4 + 2 + 16;
/// Mode, largest message, SGEs, messages per batch, boundary.
const MODE_LEN: usize = 1 + 8 + 4 + 4 + 8;
const REGION_LEN: usize = 8 + 4;
const VERDICT_HEAD: usize = 1 + 4 + 4 + 2;

/// The mode byte of the hello: READs.
const MODE_READ: u8 = 0;
/// The mode byte of the hello: SENDs.
const MODE_SEND: u8 = 1;
/// The mode byte of the hello: WRITEs with immediate.
const MODE_WRITE_IMM: u8 = 2;
/// The bit of a two-sided hello's mode byte that asks for late polling
/// ([`MessageConfig::late_polling`]).
const MODE_LATE_POLLING: u8 = 0x80;
/// The bit of a two-sided hello's mode byte that asks the server to wait for completion
/// events ([`MessageConfig::events`]).
const MODE_EVENTS: u8 = 0x40;
/// How long the event-driven server waits for an event before it looks whether a
/// completion came without one.
const EVENT_WAIT: Duration = Duration::from_secs(1);
/// How long it then gives an event raised with the completion it found to show.
const EVENT_GRACE: Duration = Duration::from_millis(200);
/// What a late-polling client sends once every send of a batch completed.
pub const SENDS_COMPLETED: u8 = b'S';

/// Why a run across two hosts stopped.
#[derive(Debug, thiserror::Error)]
pub enum AcrossError {
    /// The checker's own checks or the verbs failed.
    #[error(transparent)]
    Check(#[from] CheckError),
    /// The TCP connection failed or timed out.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The peer sent something that is not this protocol or is out of range.
    #[error("the other process sent {0}")]
    Protocol(String),
    /// This end's own settings are out of range.
    #[error("settings out of range: {0}")]
    Settings(String),
}

impl From<VerbsError> for AcrossError {
    fn from(e: VerbsError) -> Self {
        AcrossError::Check(CheckError::Verbs(e))
    }
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> AcrossError {
    move |source| {
        // A socket's deadline passing shows as EAGAIN on Linux; say what it means.
        let timed_out = matches!(
            source.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        let source = if timed_out && source.raw_os_error().is_some() {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the deadline (--timeout) passed without a word from the other process",
            )
        } else {
            source
        };
        AcrossError::Io { what, source }
    }
}

/// The seed of the pattern region `region` of a run seeded with `seed` holds.
pub fn region_seed(seed: u64, region: usize) -> u64 {
    seed ^ (region as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93)
}

/// What the client tells the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The client's QP.
    pub endpoint: Endpoint,
    /// The run's seed (the regions' patterns, and a two-sided run's plan, derive from it).
    pub seed: u64,
    /// Bytes per region.
    pub region_len: u64,
    /// Regions.
    pub regions: u32,
    /// `None`: the client READs (the default mode). Otherwise the shape of the two-sided
    /// messages it sends, from which the server draws the same plan.
    pub messages: Option<MessageConfig>,
}

fn put_endpoint(out: &mut Vec<u8>, e: &Endpoint) {
    out.extend_from_slice(&e.qp_num.to_be_bytes());
    out.extend_from_slice(&e.psn.to_be_bytes());
    out.extend_from_slice(&e.lid.to_be_bytes());
    out.extend_from_slice(&e.gid);
}

fn get_endpoint(b: &[u8]) -> Endpoint {
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[10..26]);
    Endpoint {
        qp_num: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        psn: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
        lid: u16::from_be_bytes([b[8], b[9]]),
        gid,
    }
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(w)
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A count for the wire: one too large for its field becomes the field's largest value,
/// which the other end refuses by name.
fn wire_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A count from the wire: one too large for this machine becomes `usize::MAX`, which the
/// caps refuse.
fn host_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

impl Hello {
    /// Its bytes on the connection: magic, endpoint (QP number, PSN, LID, GID), seed,
    /// bytes per region, regions, then the mode (0 READ, 1 SEND, 2 WRITE with immediate;
    /// 0x80 added for late polling, 0x40 for events) and the two-sided shape (largest
    /// message, SGEs, messages per batch, boundary or 0; all 0 in READ mode); big-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(&MAGIC);
        put_endpoint(&mut out, &self.endpoint);
        out.extend_from_slice(&self.seed.to_be_bytes());
        out.extend_from_slice(&self.region_len.to_be_bytes());
        out.extend_from_slice(&self.regions.to_be_bytes());
        let (mode, size, sges, batch, boundary) = match &self.messages {
            None => (MODE_READ, 0, 0, 0, 0),
            Some(c) => (
                match c.mode {
                    TwoSided::Send => MODE_SEND,
                    TwoSided::WriteImm => MODE_WRITE_IMM,
                } | if c.late_polling { MODE_LATE_POLLING } else { 0 }
                    | if c.events { MODE_EVENTS } else { 0 },
                c.max_size as u64,
                wire_u32(c.max_sges),
                wire_u32(c.max_batch),
                c.boundary.unwrap_or(0) as u64,
            ),
        };
        out.push(mode);
        out.extend_from_slice(&size.to_be_bytes());
        out.extend_from_slice(&sges.to_be_bytes());
        out.extend_from_slice(&batch.to_be_bytes());
        out.extend_from_slice(&boundary.to_be_bytes());
        out
    }

    /// Refuses a connection whose first bytes are not this protocol's, before the rest of
    /// a hello is waited for.
    pub fn check_magic(first: &[u8]) -> Result<(), AcrossError> {
        if first.get(..4) == Some(&MAGIC[..]) {
            return Ok(());
        }
        if first.get(..4) == Some(&OLD_MAGIC[..]) {
            return Err(AcrossError::Protocol(
                "the greeting of an older checker (JIX1, a hello without a mode): run the same \
                 justitia-integrity on both hosts"
                    .into(),
            ));
        }
        Err(AcrossError::Protocol(format!(
            "no checker greeting (first bytes {:02x?})",
            &first[..first.len().min(4)]
        )))
    }

    /// Parses and range-checks a hello.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, AcrossError> {
        Self::check_magic(&b[..4])?;
        let at = 4 + ENDPOINT_LEN;
        let m = at + 20;
        let (size, sges, batch, boundary) = (
            get_u64(b, m + 1),
            get_u32(b, m + 9),
            get_u32(b, m + 13),
            get_u64(b, m + 17),
        );
        let late_polling = b[m] & MODE_LATE_POLLING != 0;
        let events = b[m] & MODE_EVENTS != 0;
        let mode = match b[m] & !(MODE_LATE_POLLING | MODE_EVENTS) {
            MODE_READ if late_polling => {
                return Err(AcrossError::Protocol(
                    "late polling asked of a READ hello (it is a two-sided mode's)".into(),
                ))
            }
            MODE_READ if events => {
                return Err(AcrossError::Protocol(
                    "events asked of a READ hello (they are a two-sided mode's)".into(),
                ))
            }
            MODE_READ => None,
            MODE_SEND => Some(TwoSided::Send),
            MODE_WRITE_IMM => Some(TwoSided::WriteImm),
            other => {
                return Err(AcrossError::Protocol(format!(
                    "mode {other} (known: {MODE_READ} read, {MODE_SEND} send, \
                     {MODE_WRITE_IMM} write-imm)"
                )))
            }
        };
        let messages = match mode {
            None if (size, sges, batch, boundary) != (0, 0, 0, 0) => {
                return Err(AcrossError::Protocol(format!(
                    "two-sided settings in a READ hello (max_size {size}, max_sges {sges}, \
                     max_batch {batch}, boundary {boundary}; all must be 0)"
                )))
            }
            None => None,
            Some(mode) => {
                let c = MessageConfig {
                    mode,
                    max_size: host_usize(size),
                    max_sges: host_usize(u64::from(sges)),
                    max_batch: host_usize(u64::from(batch)),
                    boundary: (boundary != 0).then(|| host_usize(boundary)),
                    late_polling,
                    events,
                };
                c.validate().map_err(AcrossError::Protocol)?;
                Some(c)
            }
        };
        let hello = Hello {
            endpoint: get_endpoint(&b[4..at]),
            seed: get_u64(b, at),
            region_len: get_u64(b, at + 8),
            regions: get_u32(b, at + 16),
            messages,
        };
        if let Some(c) = &hello.messages {
            // One region, exactly as long as the plan needs: the server allocates it.
            if hello.regions != 1 {
                return Err(AcrossError::Protocol(format!(
                    "regions {} (a two-sided run has 1)",
                    hello.regions
                )));
            }
            if hello.region_len != c.region_len() as u64 {
                return Err(AcrossError::Protocol(format!(
                    "region_len {} (the two-sided settings need {})",
                    hello.region_len,
                    c.region_len()
                )));
            }
            return Ok(hello);
        }
        if hello.regions == 0 || hello.regions > MAX_REGIONS {
            return Err(AcrossError::Protocol(format!(
                "regions {} (1 to {MAX_REGIONS})",
                hello.regions
            )));
        }
        if hello.region_len < 2 * GUARD as u64 || hello.region_len > MAX_REGION_LEN {
            return Err(AcrossError::Protocol(format!(
                "region_len {} ({} to {MAX_REGION_LEN})",
                hello.region_len,
                2 * GUARD
            )));
        }
        Ok(hello)
    }
}

/// The server's word on one batch of two-sided messages, or on the run at its end. On
/// the connection: kind (0 pass, 1 fail, 2 stopped), completions judged, faults (u32
/// each), the length of the text (u16) and the text, one fault a line; big-endian.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Receive completions the server judged.
    pub judged: u32,
    /// Faults it found (0 for a pass).
    pub mismatches: u32,
    /// It stopped the run: the completions could no longer be matched to the messages.
    pub stopped: bool,
    /// The first faults, one a line; at most [`MAX_VERDICT_TEXT`] bytes.
    pub text: String,
}

impl Verdict {
    /// The verdict on `judged` completions that found `found`.
    pub fn new(judged: usize, found: &[Mismatch], stopped: bool) -> Self {
        let mut text = String::new();
        for f in found.iter().take(VERDICT_FAULTS) {
            let line = f.to_string();
            if text.len() + line.len() + 1 > MAX_VERDICT_TEXT {
                break;
            }
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&line);
        }
        // A single fault longer than the cap is cut at a character boundary.
        if text.is_empty() {
            if let Some(f) = found.first() {
                let line = f.to_string();
                let mut end = line.len().min(MAX_VERDICT_TEXT);
                while !line.is_char_boundary(end) {
                    end -= 1;
                }
                text = line[..end].to_string();
            }
        }
        Verdict {
            judged: wire_u32(judged),
            mismatches: wire_u32(found.len()),
            stopped,
            text,
        }
    }

    /// Its bytes on the connection.
    pub fn encode(&self) -> Vec<u8> {
        let kind: u8 = if self.stopped {
            2
        } else {
            u8::from(self.mismatches > 0)
        };
        let text = &self.text.as_bytes()[..self.text.len().min(MAX_VERDICT_TEXT)];
        let mut out = Vec::with_capacity(VERDICT_HEAD + text.len());
        out.push(kind);
        out.extend_from_slice(&self.judged.to_be_bytes());
        out.extend_from_slice(&self.mismatches.to_be_bytes());
        out.extend_from_slice(&(text.len() as u16).to_be_bytes());
        out.extend_from_slice(text);
        out
    }

    /// Reads one verdict from `conn` (whose reads have a deadline), refusing one that is
    /// not well formed: an unknown kind, a pass with faults or a failure without, a text
    /// beyond the cap.
    pub fn read(conn: &mut impl Read, what: &'static str) -> Result<Self, AcrossError> {
        let mut head = [0u8; VERDICT_HEAD];
        conn.read_exact(&mut head).map_err(io(what))?;
        let judged = get_u32(&head, 1);
        let mismatches = get_u32(&head, 5);
        let len = usize::from(u16::from_be_bytes([head[9], head[10]]));
        let stopped = match (head[0], mismatches) {
            (0, 0) => false,
            (1, 1..) => false,
            (2, _) => true,
            (kind, n) => {
                return Err(AcrossError::Protocol(format!(
                    "a verdict of kind {kind} with {n} faults (0 pass with none, 1 fail with \
                     some, 2 stopped)"
                )))
            }
        };
        if len > MAX_VERDICT_TEXT {
            return Err(AcrossError::Protocol(format!(
                "a verdict with {len} bytes of text (at most {MAX_VERDICT_TEXT})"
            )));
        }
        let mut text = vec![0u8; len];
        conn.read_exact(&mut text).map_err(io(what))?;
        Ok(Verdict {
            judged,
            mismatches,
            stopped,
            text: String::from_utf8_lossy(&text).into_owned(),
        })
    }

    /// Adds what the server found to the client's `report`.
    fn absorb(&self, report: &mut MessageReport) {
        report.recv_completions += u64::from(self.judged);
        report.mismatches += u64::from(self.mismatches);
        report.stopped |= self.stopped;
        for line in self.text.lines().filter(|l| !l.is_empty()) {
            report.problem(format!("at the server: {line}"));
        }
    }
}

/// How both ends set up their device.
#[derive(Clone, Debug)]
pub struct AcrossOptions {
    /// Device name (`None`: the first device).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID index (on RoCE v2 across a routed link, the IPv4-mapped GID's).
    pub gid_index: u8,
    /// How long to wait for one batch's completions, and for the other process.
    pub timeout: Duration,
}

/// The first PSN each side sends with.
const CLIENT_PSN: u32 = 0x2468;
const SERVER_PSN: u32 = 0x1357;

/// What the server saw: the client's run's end and whether its regions were intact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerReport {
    /// Batches the client said it ran.
    pub batches: u64,
    /// Regions whose bytes differ from their pattern at the end (READs must change none).
    pub changed_regions: usize,
    /// The client said it was done (not gone midway).
    pub done: bool,
}

/// Accepts one connection on `listener`, waiting at most `timeout`: a client that never
/// comes ends the server with an error, as one that says nothing does.
fn accept_within(
    listener: &TcpListener,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr), AcrossError> {
    listener
        .set_nonblocking(true)
        .map_err(io("making the checker's TCP port non-blocking"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok(accepted) => return Ok(accepted),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(io("accepting the client")(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no client within {timeout:?}"),
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io("accepting the client")(e)),
        }
    }
}

/// What the server ran: a client's READs, or its two-sided messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// The default mode: the client READ from the regions.
    Reads(ServerReport),
    /// `--two-sided`: the server received and judged every message.
    Messages {
        /// What the client sent.
        mode: TwoSided,
        /// The run's seed.
        seed: u64,
        /// What the server counted and found.
        report: MessageReport,
    },
}

/// Serves one client on `listen` (port 0: a free port, printed): answers its hello, then
/// holds the regions while it READs and checks them when it is done, or receives and
/// judges its two-sided messages.
pub fn serve(listen: SocketAddr, options: &AcrossOptions) -> Result<Served, AcrossError> {
    let listener = TcpListener::bind(listen).map_err(io("binding the checker's TCP port"))?;
    // The bound address: port 0 asks the kernel for a free one, which the caller reads here.
    let bound = listener
        .local_addr()
        .map_err(io("reading the checker's TCP port"))?;
    println!("justitia-integrity: serving on {bound}, waiting for one client");
    let (mut conn, from) = accept_within(&listener, options.timeout)?;
    conn.set_nonblocking(false)
        .map_err(io("making the client's connection blocking"))?;
    conn.set_read_timeout(Some(options.timeout))
        .map_err(io("setting the read deadline"))?;
    conn.set_write_timeout(Some(options.timeout))
        .map_err(io("setting the write deadline"))?;
    let mut b = [0u8; HELLO_LEN];
    // A stranger, or a checker of another version, is told so before the rest is waited for.
    conn.read_exact(&mut b[..4])
        .map_err(io("reading the client's hello"))?;
    Hello::check_magic(&b[..4])?;
    conn.read_exact(&mut b[4..])
        .map_err(io("reading the client's hello"))?;
    let hello = Hello::decode(&b)?;
    match hello.messages.clone() {
        None => serve_reads(conn, from, &hello, options).map(Served::Reads),
        Some(config) => {
            let mode = config.mode;
            serve_messages(conn, from, &hello, config, options).map(|report| Served::Messages {
                mode,
                seed: hello.seed,
                report,
            })
        }
    }
}

/// The server's answer to a hello: its QP's endpoint, and each region's address and rkey.
fn answer(own: &Endpoint, regions: &[(u64, u32)]) -> Vec<u8> {
    let mut reply = Vec::with_capacity(4 + ENDPOINT_LEN + regions.len() * REGION_LEN);
    reply.extend_from_slice(&MAGIC);
    put_endpoint(&mut reply, own);
    for (addr, rkey) in regions {
        reply.extend_from_slice(&addr.to_be_bytes());
        reply.extend_from_slice(&rkey.to_be_bytes());
    }
    reply
}

/// One byte from `conn`; `None` when the peer closed the connection.
fn read_byte(conn: &mut TcpStream) -> std::io::Result<Option<u8>> {
    let mut byte = [0u8; 1];
    loop {
        match conn.read(&mut byte) {
            Ok(0) => return Ok(None),
            Ok(_) => return Ok(Some(byte[0])),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The READ mode's server: the regions, filled with their patterns, until the client is
/// done; then whether any READ changed them.
fn serve_reads(
    mut conn: TcpStream,
    from: SocketAddr,
    hello: &Hello,
    options: &AcrossOptions,
) -> Result<ServerReport, AcrossError> {
    println!(
        "justitia-integrity: client {from}: QP {:#x}, {} regions of {} bytes, seed {}",
        hello.endpoint.qp_num, hello.regions, hello.region_len, hello.seed
    );

    let verbs = Arc::new(Ibverbs::load()?);
    let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, 64, None)?;
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = QueuePair::create_rc(&pd, &cq, &cq, caps)?;
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
    let len = usize::try_from(hello.region_len)
        .map_err(|_| AcrossError::Protocol(format!("region_len {}", hello.region_len)))?;
    let mut regions = (0..hello.regions)
        .map(|_| MemoryRegion::new(&pd, len, access))
        .collect::<Result<Vec<_>, _>>()?;
    for (r, mr) in regions.iter_mut().enumerate() {
        pattern::fill(region_seed(hello.seed, r), 0, mr.as_mut_slice());
    }
    let own = qp.endpoint(options.port, options.gid_index, SERVER_PSN)?;
    qp.connect(options.port, options.gid_index, SERVER_PSN, &hello.endpoint)?;
    let keys: Vec<(u64, u32)> = regions.iter().map(|mr| (mr.addr(), mr.rkey())).collect();
    conn.write_all(&answer(&own, &keys))
        .map_err(io("answering the client"))?;

    let mut report = ServerReport {
        batches: 0,
        changed_regions: 0,
        done: false,
    };
    loop {
        match read_byte(&mut conn).map_err(io("waiting for the client's next batch"))? {
            None => break,
            Some(DONE) => {
                report.done = true;
                break;
            }
            Some(_) => report.batches += 1,
        }
    }
    report.changed_regions = regions
        .iter()
        .enumerate()
        .filter(|(r, mr)| pattern::check(region_seed(hello.seed, *r), 0, mr.as_slice()).is_some())
        .count();
    if report.done {
        let verdict = u8::from(report.changed_regions == 0);
        // The client may already be gone; its own verdict stands then.
        let _ = conn.write_all(&[verdict]);
    }
    Ok(report)
}

/// The two-sided server: one region on a background pattern and a QP whose receives the
/// client's messages consume; per batch, the receives posted before the client may send,
/// then every completion and byte judged and the verdict sent back.
fn serve_messages(
    mut conn: TcpStream,
    from: SocketAddr,
    hello: &Hello,
    config: MessageConfig,
    options: &AcrossOptions,
) -> Result<MessageReport, AcrossError> {
    println!(
        "justitia-integrity: client {from}: QP {:#x}, two-sided {} messages of up to {} bytes, \
         up to {} SGEs, up to {} a batch, seed {}",
        hello.endpoint.qp_num,
        config.mode.as_str(),
        config.max_size,
        config.max_sges,
        config.max_batch,
        hello.seed
    );
    let verbs = Arc::new(Ibverbs::load()?);
    let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let depth = batch_queue_depth(config.max_batch);
    // Event-driven: the receive CQ on a channel of its own, the sends' CQ apart (the
    // server sends nothing, but an event-driven server's receive CQ commonly carries its
    // receives alone).
    let channel = if config.events {
        let channel = CompletionChannel::new(&ctx)?;
        channel.set_nonblocking()?;
        Some(channel)
    } else {
        None
    };
    let cq = CompletionQueue::new(&ctx, 2 * depth, channel.as_ref())?;
    let send_cq = match &channel {
        Some(_) => CompletionQueue::new(&ctx, 16, None)?,
        None => cq.clone(),
    };
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: wire_u32(config.max_sges),
        max_inline_data: 0,
    };
    let qp = QueuePair::create_rc(&pd, &send_cq, &cq, caps)?;
    let access = match config.mode {
        TwoSided::Send => IBV_ACCESS_LOCAL_WRITE,
        TwoSided::WriteImm => IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
    };
    let mut region = MemoryRegion::new(&pd, config.region_len(), access)?;
    let background = region_seed(hello.seed, 0);
    pattern::fill(background, 0, region.as_mut_slice());
    let own = qp.endpoint(options.port, options.gid_index, SERVER_PSN)?;
    qp.connect(options.port, options.gid_index, SERVER_PSN, &hello.endpoint)?;
    conn.write_all(&answer(&own, &[(region.addr(), region.rkey())]))
        .map_err(io("answering the client"))?;

    let status_str = |s: ibv_wc_status| verbs.status_str(s);
    let qpn = qp.qp_num();
    let late_polling = config.late_polling;
    let mut planner = MessagePlanner::new(hello.seed, config);
    let mut report = MessageReport::default();
    loop {
        match read_byte(&mut conn).map_err(io("waiting for the client's next batch"))? {
            None => {
                return Err(io("waiting for the client's next batch")(
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "the client went away after {} batches without saying it was done",
                            report.batches
                        ),
                    ),
                ))
            }
            Some(DONE) => break,
            Some(NEXT_BATCH) => {}
            Some(other) => {
                return Err(AcrossError::Protocol(format!(
                    "byte {other:#04x} where the next batch ({NEXT_BATCH:#04x}) or the end \
                     ({DONE:#04x}) was due"
                )))
            }
        }
        let batch = planner.next_batch();
        if !batch.fits(region.len()) {
            return Err(AcrossError::Settings(format!(
                "batch {} does not fit the region of {} bytes",
                report.batches,
                region.len()
            )));
        }
        prepare_region(&batch, region.as_mut_slice());
        let receives = batch
            .messages
            .iter()
            .map(|m| {
                let sges = m
                    .recv
                    .iter()
                    .map(|p| region.sge(p.offset, sge_len(p)?))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(RecvRequest {
                    wr_id: m.recv_wr_id,
                    sges,
                })
            })
            .collect::<Result<Vec<_>, VerbsError>>()?;
        qp.post_recv(&receives)?;
        conn.write_all(&[RECEIVES_POSTED])
            .map_err(io("telling the client the batch's receives are posted"))?;
        if late_polling {
            await_sends_completed(&mut conn, report.batches)?;
        }

        let wait = Wait {
            timeout: options.timeout,
            events: channel.as_ref(),
        };
        let (judged, mut found) = await_receives(&cq, &batch, qpn, &wait, &status_str)?;
        let stopped = found.iter().any(|f| f.field.ends_the_run());
        if !stopped {
            for m in &batch.messages {
                found.extend(judge_bytes(m, region.as_slice(), background));
            }
            let elsewhere = judge_elsewhere(&batch, region.as_slice(), background);
            restore_region(
                &batch,
                region.as_mut_slice(),
                background,
                !elsewhere.is_empty(),
            );
            found.extend(elsewhere);
        }
        // A client that went away leaves its receives without completions: that is the
        // client gone, not a fault of the messages.
        if stopped && peer_gone(&conn) {
            return Err(io("waiting for the batch's receive completions")(
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the client went away during batch {} without saying it was done",
                        report.batches
                    ),
                ),
            ));
        }
        report.batches += 1;
        for m in batch.messages.iter().take(judged) {
            report.count(m);
        }
        report.recv_completions += judged as u64;
        report.found(&found);
        report.stopped = stopped;
        conn.write_all(&Verdict::new(judged, &found, stopped).encode())
            .map_err(io("sending the client the batch's verdict"))?;
        if stopped {
            return Ok(report);
        }
    }
    // After the last batch, a stray completion (a chunk wrongly reported as a message,
    // say) has had time to arrive; none may have.
    std::thread::sleep(Duration::from_millis(200));
    let mut wc = [ibv_wc::default(); 4];
    let n = cq.poll(&mut wc)?;
    let found: Vec<Mismatch> = wc[..n]
        .iter()
        .map(|c| extra_completion(c, "after the last batch", &status_str))
        .collect();
    report.found(&found);
    // The client may already be gone; its own verdict stands then.
    let _ = conn.write_all(&Verdict::new(0, &found, false).encode());
    Ok(report)
}

/// Reads the late-polling client's word that every send of batch `batch` completed,
/// within the connection's deadline.
fn await_sends_completed(conn: &mut TcpStream, batch: u64) -> Result<(), AcrossError> {
    const WHAT: &str = "waiting for the client's word that the batch's sends completed";
    match read_byte(conn).map_err(io(WHAT))? {
        Some(SENDS_COMPLETED) => Ok(()),
        None => Err(io(WHAT)(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the client went away with the sends of batch {batch} not all completed"),
        ))),
        Some(other) => Err(AcrossError::Protocol(format!(
            "byte {other:#04x} where the word that the sends completed ({SENDS_COMPLETED:#04x}) \
             was due"
        ))),
    }
}

/// True when the peer has closed `conn` (or it failed): a look without waiting for data.
fn peer_gone(conn: &TcpStream) -> bool {
    if conn.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let gone = match conn.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    conn.set_nonblocking(false).is_err() || gone
}

/// An SGE's length field for `p`.
fn sge_len(p: &Placement) -> Result<u32, VerbsError> {
    u32::try_from(p.len)
        .map_err(|_| VerbsError::InvalidArgument(format!("an SGE of {} bytes", p.len)))
}

/// How the server waits for a batch's receive completions.
struct Wait<'a> {
    /// The longest wait with no completion before the next one is reported missing.
    timeout: Duration,
    /// The receive CQ's channel (non-blocking) when the server sleeps until events.
    events: Option<&'a CompletionChannel>,
}

/// Polls `cq` until one receive completion per message of `batch` has arrived, judging
/// each against the message it is due for. Stops early, with what it found, at a fault
/// that ends the run, a completion beyond the batch's, or when none came for the wait's
/// timeout. With events, the CQ is armed for the next completion and polled once more
/// before each sleep (a completion before the arm raises no event); a completion found
/// after [`EVENT_WAIT`] with no event, and none within [`EVENT_GRACE`] after it, is
/// reported (once a batch) and judged as it is. Returns how many completions were judged
/// and the faults.
fn await_receives(
    cq: &CompletionQueue,
    batch: &MessageBatch,
    qp_num: u32,
    wait: &Wait<'_>,
    status_str: &dyn Fn(ibv_wc_status) -> String,
) -> Result<(usize, Vec<Mismatch>), AcrossError> {
    let timeout = wait.timeout;
    // Armed and polled empty since: only an event (or a completion without one) comes.
    let mut armed = false;
    // The last sleep ended with no event: a completion found now came without one.
    let mut unwoken = false;
    let mut eventless = false;
    let after = || match (batch.messages.first(), batch.messages.last()) {
        (Some(a), Some(b)) => format!("after the batch of messages {} to {}", a.index, b.index),
        _ => "after an empty batch".to_string(),
    };
    let mut found = Vec::new();
    let mut next = 0;
    let mut wc = [ibv_wc::default(); 16];
    let mut last_seen = Instant::now();
    while next < batch.messages.len() {
        let n = cq.poll(&mut wc)?;
        if let (true, Some(channel), Some(m)) =
            (n > 0 && unwoken, wait.events, batch.messages.get(next))
        {
            if !eventless && channel.wait_timeout(EVENT_GRACE)?.is_none() {
                eventless = true;
                found.push(eventless_completion(m, EVENT_WAIT));
            }
        }
        if n > 0 {
            armed = false;
            unwoken = false;
        }
        for c in &wc[..n] {
            let Some(m) = batch.messages.get(next) else {
                found.push(extra_completion(c, &after(), status_str));
                return Ok((next, found));
            };
            let faults = judge_completion(m, c, qp_num, status_str);
            next += 1;
            let stop = faults.iter().any(|f| f.field.ends_the_run());
            found.extend(faults);
            if stop {
                return Ok((next, found));
            }
        }
        if n > 0 {
            last_seen = Instant::now();
        } else if let Some(m) = batch.messages.get(next) {
            if last_seen.elapsed() > timeout {
                found.push(missing_completion(m, timeout, next));
                return Ok((next, found));
            }
            match wait.events {
                // Soft-RoCE does its work in kernel threads; leave them the CPU.
                None => std::thread::yield_now(),
                Some(_) if !armed => {
                    cq.req_notify(false)?;
                    armed = true;
                }
                Some(channel) => {
                    let woken = channel.wait_timeout(EVENT_WAIT)?.is_some();
                    unwoken = !woken;
                    armed = !woken;
                }
            }
        }
    }
    // Exactly one completion per receive: nothing may follow.
    let n = cq.poll(&mut wc)?;
    if let Some(c) = wc[..n].first() {
        found.push(extra_completion(c, &after(), status_str));
    }
    Ok((next, found))
}

/// Connects to the server at `server`, sends `hello` and reads the answer: the server's
/// QP's endpoint and the address and rkey of each region the hello asked for. The
/// connection's reads and writes have the deadline of `options`.
fn greet(
    server: SocketAddr,
    options: &AcrossOptions,
    hello: &Hello,
) -> Result<Greeted, AcrossError> {
    let mut conn = TcpStream::connect_timeout(&server, options.timeout)
        .map_err(io("connecting to the server"))?;
    conn.set_read_timeout(Some(options.timeout))
        .map_err(io("setting the read deadline"))?;
    conn.set_write_timeout(Some(options.timeout))
        .map_err(io("setting the write deadline"))?;
    conn.write_all(&hello.encode())
        .map_err(io("sending the hello"))?;
    let mut head = [0u8; 4 + ENDPOINT_LEN];
    conn.read_exact(&mut head)
        .map_err(io("reading the server's answer"))?;
    if head[..4] != MAGIC {
        return Err(AcrossError::Protocol(format!(
            "no checker answer (first bytes {:02x?}; an older checker answers JIX1)",
            &head[..4]
        )));
    }
    let theirs = get_endpoint(&head[4..]);
    let mut remote = Vec::with_capacity(hello.regions as usize);
    for _ in 0..hello.regions {
        let mut r = [0u8; REGION_LEN];
        conn.read_exact(&mut r)
            .map_err(io("reading the server's regions"))?;
        remote.push((get_u64(&r, 0), get_u32(&r, 8)));
    }
    Ok(Greeted {
        conn,
        theirs,
        remote,
    })
}

/// What a client has once the server answered its hello.
struct Greeted {
    /// The connection, with deadlines on reads and writes.
    conn: TcpStream,
    /// The server's QP.
    theirs: Endpoint,
    /// The server's regions: address and rkey.
    remote: Vec<(u64, u32)>,
}

/// The client's end: the requester QP, its local regions and the server's regions.
pub struct Client {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    conn: TcpStream,
    qp: QueuePair,
    cq: CompletionQueue,
    local: Vec<MemoryRegion>,
    /// The server's regions: address and rkey.
    remote: Vec<(u64, u32)>,
    seed: u64,
    timeout: Duration,
    // Kept alive for the objects above.
    _pd: ProtectionDomain,
    _unused_cq: CompletionQueue,
}

impl Client {
    /// Opens the device, connects to the server at `server` and connects the QPs, for a
    /// run of `plan` seeded with `seed`.
    pub fn connect(
        server: SocketAddr,
        options: &AcrossOptions,
        plan: &PlanConfig,
        seed: u64,
    ) -> Result<Self, AcrossError> {
        let regions = u32::try_from(plan.remote_regions.max(1))
            .ok()
            .filter(|&n| n <= MAX_REGIONS)
            .ok_or_else(|| AcrossError::Protocol("too many remote regions".into()))?;
        let verbs = Arc::new(Ibverbs::load()?);
        let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
        let pd = ProtectionDomain::new(&ctx)?;
        let depth = queue_depth(plan);
        // Room for every request the send queue holds and more: a shaper that finds a CQ
        // smaller than its QPs' send queues leaves those QPs unshaped.
        let cq = CompletionQueue::new(&ctx, 2 * depth, None)?;
        let unused_cq = CompletionQueue::new(&ctx, 16, None)?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: 16,
            max_send_sge: u32::try_from(plan.max_sges.max(1)).unwrap_or(u32::MAX),
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = QueuePair::create_rc(&pd, &cq, &unused_cq, caps)?;
        let access = IBV_ACCESS_LOCAL_WRITE;
        let local = (0..plan.local_regions.max(1))
            .map(|_| MemoryRegion::new(&pd, plan.region_len(), access))
            .collect::<Result<Vec<_>, _>>()?;

        let hello = Hello {
            endpoint: qp.endpoint(options.port, options.gid_index, CLIENT_PSN)?,
            seed,
            region_len: plan.region_len() as u64,
            regions,
            messages: None,
        };
        let Greeted {
            conn,
            theirs,
            remote,
        } = greet(server, options, &hello)?;
        qp.connect(options.port, options.gid_index, CLIENT_PSN, &theirs)?;
        Ok(Client {
            verbs,
            conn,
            qp,
            cq,
            local,
            remote,
            seed,
            timeout: options.timeout,
            _pd: pd,
            _unused_cq: unused_cq,
            ctx,
        })
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        self.ctx.name()
    }

    fn local_bytes(&self, at: &Placement) -> &[u8] {
        &self.local[at.region].as_slice()[at.offset..at.offset + at.len]
    }

    /// Posts `batch` with every transfer an RDMA READ from the server's regions, checks
    /// its completions, every destination byte and the guards around each, adding to
    /// `report`.
    pub fn run_batch(&mut self, batch: &Batch, report: &mut Report) -> Result<(), AcrossError> {
        let mut transfers = batch.transfers.clone();
        for t in &mut transfers {
            t.op = Operation::Read;
        }
        // Destinations hold the complement of what must arrive, so a byte never written
        // differs; the guard bytes around each are kept to compare after.
        let mut guards = Vec::new();
        for t in &transfers {
            let seed = region_seed(self.seed, t.remote.region);
            let mut offset = t.remote.offset;
            for p in &t.local {
                let mem = self.local[p.region].as_mut_slice();
                pattern::fill_complement(seed, offset, &mut mem[p.offset..p.offset + p.len]);
                offset += p.len;
                let end = p.offset + p.len;
                guards.push((
                    *p,
                    mem[p.offset - GUARD..p.offset].to_vec(),
                    mem[end..end + GUARD].to_vec(),
                ));
            }
        }
        let requests = transfers
            .iter()
            .map(|t| {
                let sges = local_sges(&self.local, t)?;
                let (addr, rkey) = self.remote[t.remote.region];
                let mut r = SendRequest::read(t.wr_id, sges, addr + t.remote.offset as u64, rkey);
                r.signaled = t.signaled;
                Ok(r)
            })
            .collect::<Result<Vec<_>, VerbsError>>()?;
        post_requests(&self.qp, &requests, batch.post_as_list)?;
        let signaled: Vec<_> = transfers.iter().filter(|t| t.signaled).collect();
        let qpn = self.qp.qp_num();
        let verbs = Arc::clone(&self.verbs);
        let cq = &self.cq;
        wait_for(
            |wc| cq.poll(wc),
            "send",
            &signaled,
            self.timeout,
            report,
            |wc, t| check_send_completion(&verbs, wc, t, qpn),
        )?;
        no_extra_send_completion(&self.cq, "signaled request")?;
        report.send_completions += signaled.len() as u64;
        for t in &transfers {
            let seed = region_seed(self.seed, t.remote.region);
            let mut offset = t.remote.offset;
            let mut bad = Vec::new();
            for p in &t.local {
                if let Some(m) = pattern::check(seed, offset, self.local_bytes(p)) {
                    bad.push(format!(
                        "{} bytes differ from remote offset {} (expected {:#04x}, found {:#04x})",
                        m.bytes, m.first_offset, m.expected, m.found
                    ));
                }
                offset += p.len;
            }
            if !bad.is_empty() {
                report.mismatched_transfers += 1;
                report.problem(format!(
                    "READ of {} bytes from region {} offset {} in {} SGE(s), wr_id {:#x}: {}",
                    t.len(),
                    t.remote.region,
                    t.remote.offset,
                    t.local.len(),
                    t.wr_id,
                    bad.join("; ")
                ));
            }
            report.transfers += 1;
            report.reads += 1;
            report.bytes += t.len() as u64;
            report.unsignaled += u64::from(!t.signaled);
        }
        for (p, before, after) in guards {
            let mem = self.local[p.region].as_slice();
            let end = p.offset + p.len;
            if mem[p.offset - GUARD..p.offset] != before[..] || mem[end..end + GUARD] != after[..] {
                report.overruns += 1;
                report.problem(format!("bytes next to the local range {p:?} changed"));
            }
        }
        self.conn
            .write_all(&[PROGRESS])
            .map_err(io("telling the server a batch ended"))?;
        Ok(())
    }

    /// Ends the run: tells the server, and returns whether it found its regions intact.
    pub fn finish(mut self) -> Result<bool, AcrossError> {
        self.conn
            .write_all(&[DONE])
            .map_err(io("telling the server the run ended"))?;
        let mut verdict = [0u8; 1];
        self.conn
            .read_exact(&mut verdict)
            .map_err(io("reading the server's verdict"))?;
        Ok(verdict[0] == 1)
    }
}

impl Awaited for Message {
    fn awaited_wr_id(&self) -> u64 {
        self.send_wr_id
    }
}

/// Checks the client's send completion `wc` that arrived when `m`'s was due.
fn check_message_send(verbs: &Ibverbs, wc: &ibv_wc, m: &Message, qp_num: u32) -> Result<(), Fault> {
    if wc.wr_id != m.send_wr_id {
        return Err(Fault::Fatal(format!(
            "expected the completion of {} (wr_id {:#x}) next, got wr_id {:#x} (status {})",
            m.describe(),
            m.send_wr_id,
            wc.wr_id,
            verbs.status_str(wc.status)
        )));
    }
    if wc.status != IBV_WC_SUCCESS {
        return Err(Fault::Fatal(format!(
            "{} completed with status {} (vendor error {:#x})",
            m.describe(),
            verbs.status_str(wc.status),
            wc.vendor_err
        )));
    }
    let opcode = m.mode.send_opcode();
    if wc.opcode != opcode {
        return Err(Fault::Detail(format!(
            "{}: opcode: expected {}, got {}",
            m.describe(),
            crate::two_sided::wc_opcode_name(opcode),
            crate::two_sided::wc_opcode_name(wc.opcode)
        )));
    }
    if wc.qp_num != qp_num {
        return Err(Fault::Detail(format!(
            "{}: qp_num: expected {qp_num:#x}, got {:#x}",
            m.describe(),
            wc.qp_num
        )));
    }
    Ok(())
}

/// The client's end of a two-sided run: the requester QP, the buffer its messages are
/// sent from, and the server's region (the destination of WRITEs with immediate).
pub struct MessageClient {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    conn: TcpStream,
    qp: QueuePair,
    cq: CompletionQueue,
    buffer: MemoryRegion,
    /// The server's region: address and rkey.
    remote: (u64, u32),
    timeout: Duration,
    /// Tell the server when a batch's sends completed ([`MessageConfig::late_polling`]).
    late_polling: bool,
    // Kept alive for the objects above.
    _pd: ProtectionDomain,
    _unused_cq: CompletionQueue,
}

impl MessageClient {
    /// Opens the device, connects to the server at `server` and connects the QPs, for a
    /// two-sided run of `config` seeded with `seed` (the hello carries both, so the server
    /// draws the same plan).
    pub fn connect(
        server: SocketAddr,
        options: &AcrossOptions,
        config: &MessageConfig,
        seed: u64,
    ) -> Result<Self, AcrossError> {
        config.validate().map_err(AcrossError::Settings)?;
        let verbs = Arc::new(Ibverbs::load()?);
        let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
        let pd = ProtectionDomain::new(&ctx)?;
        let depth = batch_queue_depth(config.max_batch);
        // Room for every request the send queue holds and more, as in READ mode.
        let cq = CompletionQueue::new(&ctx, 2 * depth, None)?;
        let unused_cq = CompletionQueue::new(&ctx, 16, None)?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: 16,
            max_send_sge: wire_u32(config.max_sges),
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = QueuePair::create_rc(&pd, &cq, &unused_cq, caps)?;
        let buffer = MemoryRegion::new(&pd, config.region_len(), IBV_ACCESS_LOCAL_WRITE)?;
        let hello = Hello {
            endpoint: qp.endpoint(options.port, options.gid_index, CLIENT_PSN)?,
            seed,
            region_len: config.region_len() as u64,
            regions: 1,
            messages: Some(config.clone()),
        };
        let Greeted {
            conn,
            theirs,
            remote,
        } = greet(server, options, &hello)?;
        let Some(&remote) = remote.first() else {
            return Err(AcrossError::Protocol("no region".into()));
        };
        qp.connect(options.port, options.gid_index, CLIENT_PSN, &theirs)?;
        Ok(MessageClient {
            verbs,
            ctx,
            conn,
            qp,
            cq,
            buffer,
            remote,
            timeout: options.timeout,
            late_polling: config.late_polling,
            _pd: pd,
            _unused_cq: unused_cq,
        })
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        self.ctx.name()
    }

    /// The request that sends `m` from the client's buffer.
    fn request(&self, m: &Message) -> Result<SendRequest, VerbsError> {
        let sges = m
            .local
            .iter()
            .map(|p| self.buffer.sge(p.offset, sge_len(p)?))
            .collect::<Result<Vec<_>, _>>()?;
        let mut r = match (m.mode, m.remote) {
            (TwoSided::Send, _) => SendRequest::send(m.send_wr_id, sges),
            (TwoSided::WriteImm, Some(at)) => {
                let (addr, rkey) = self.remote;
                let mut r = SendRequest::write(m.send_wr_id, sges, addr + at.offset as u64, rkey);
                r.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                r
            }
            (TwoSided::WriteImm, None) => {
                return Err(VerbsError::InvalidArgument(format!(
                    "{} has no destination",
                    m.describe()
                )))
            }
        };
        if let Some(imm) = m.imm {
            if m.mode == TwoSided::Send {
                r.opcode = IBV_WR_SEND_WITH_IMM;
            }
            // In host order: the verbs layer posts htonl(imm), as an application does.
            r.imm_data = imm;
        }
        // Every request is signaled, so every one is seen to complete, in order.
        r.signaled = true;
        Ok(r)
    }

    /// Runs `batch`: asks the server for it, waits until its receives are posted, posts
    /// every message, checks every send completion, and adds the server's verdict on the
    /// batch to `report` (which says whether the server stopped the run).
    pub fn run_batch(
        &mut self,
        batch: &MessageBatch,
        report: &mut MessageReport,
    ) -> Result<(), AcrossError> {
        if !batch.fits(self.buffer.len()) {
            return Err(AcrossError::Settings(format!(
                "a batch that does not fit the buffer of {} bytes",
                self.buffer.len()
            )));
        }
        self.conn
            .write_all(&[NEXT_BATCH])
            .map_err(io("asking the server for the next batch"))?;
        fill_sources(batch, self.buffer.as_mut_slice());
        let requests = batch
            .messages
            .iter()
            .map(|m| self.request(m))
            .collect::<Result<Vec<_>, _>>()?;
        // Only once every receive of the batch is posted may a message go: none meets a
        // missing receive (no receiver-not-ready retries).
        let mut go = [0u8; 1];
        self.conn
            .read_exact(&mut go)
            .map_err(io("waiting for the server to post the batch's receives"))?;
        if go[0] != RECEIVES_POSTED {
            return Err(AcrossError::Protocol(format!(
                "byte {:#04x} where the go-ahead for a batch ({RECEIVES_POSTED:#04x}) was due",
                go[0]
            )));
        }
        post_requests(&self.qp, &requests, batch.post_as_list)?;
        let expected: Vec<&Message> = batch.messages.iter().collect();
        let qpn = self.qp.qp_num();
        let verbs = Arc::clone(&self.verbs);
        let cq = &self.cq;
        let mut seen = Report::default();
        wait_for(
            |wc| cq.poll(wc),
            "send",
            &expected,
            self.timeout,
            &mut seen,
            |wc, m| check_message_send(&verbs, wc, m, qpn),
        )?;
        no_extra_send_completion(&self.cq, "request")?;
        if self.late_polling {
            self.conn
                .write_all(&[SENDS_COMPLETED])
                .map_err(io("telling the server the batch's sends completed"))?;
        }
        report.send_completions += expected.len() as u64;
        report.mismatches += seen.bad_completions;
        for p in seen.problems {
            report.problem(p);
        }
        let verdict = Verdict::read(&mut self.conn, "reading the server's verdict on a batch")?;
        if verdict.judged as usize > batch.messages.len() {
            return Err(AcrossError::Protocol(format!(
                "a verdict on {} completions for a batch of {} messages",
                verdict.judged,
                batch.messages.len()
            )));
        }
        report.batches += 1;
        for m in &batch.messages {
            report.count(m);
        }
        verdict.absorb(report);
        Ok(())
    }

    /// Ends the run: tells the server, and adds its last verdict (no stray completion
    /// after the last batch) to `report`.
    pub fn finish(mut self, report: &mut MessageReport) -> Result<(), AcrossError> {
        self.conn
            .write_all(&[DONE])
            .map_err(io("telling the server the run ended"))?;
        let verdict = Verdict::read(&mut self.conn, "reading the server's last verdict")?;
        verdict.absorb(report);
        Ok(())
    }
}

/// Fails when `cq` holds a completion beyond the one per `what` already taken.
fn no_extra_send_completion(cq: &CompletionQueue, what: &str) -> Result<(), AcrossError> {
    let mut wc = [ibv_wc::default(); 4];
    let extra = cq.poll(&mut wc)?;
    if extra > 0 {
        return Err(CheckError::Completion {
            queue: "send",
            detail: format!(
                "{extra} completion(s) beyond one per {what}, first wr_id {:#x}",
                wc[0].wr_id
            ),
        }
        .into());
    }
    Ok(())
}

/// Posts `requests` as one list (`as_list`) or one request a post, as the plan drew.
fn post_requests(
    qp: &QueuePair,
    requests: &[SendRequest],
    as_list: bool,
) -> Result<(), VerbsError> {
    if as_list {
        qp.post_send(requests)
    } else {
        requests
            .iter()
            .try_for_each(|r| qp.post_send(std::slice::from_ref(r)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn hello() -> Hello {
        Hello {
            endpoint: Endpoint {
                qp_num: 0x11,
                psn: 0x2468,
                lid: 0,
                gid: [7; 16],
            },
            seed: 42,
            region_len: 1 << 20,
            regions: 2,
            messages: None,
        }
    }

    fn messages(mode: TwoSided) -> MessageConfig {
        MessageConfig {
            mode,
            max_size: 1 << 20,
            max_sges: 6,
            max_batch: 4,
            boundary: Some(65536),
            late_polling: false,
            events: false,
        }
    }

    /// A two-sided hello as the client sends it.
    fn two_sided(mode: TwoSided) -> Hello {
        let c = messages(mode);
        Hello {
            region_len: c.region_len() as u64,
            regions: 1,
            messages: Some(c),
            ..hello()
        }
    }

    fn bytes(h: &Hello) -> [u8; HELLO_LEN] {
        h.encode().try_into().unwrap()
    }

    fn refusal(b: &[u8; HELLO_LEN]) -> String {
        Hello::decode(b).unwrap_err().to_string()
    }

    #[test]
    fn a_hello_survives_the_wire() {
        assert_eq!(Hello::decode(&bytes(&hello())).unwrap(), hello());
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            let h = two_sided(mode);
            assert_eq!(Hello::decode(&bytes(&h)).unwrap(), h);
            let plain = Hello {
                messages: Some(MessageConfig {
                    boundary: None,
                    ..messages(mode)
                }),
                ..h.clone()
            };
            assert_eq!(Hello::decode(&bytes(&plain)).unwrap(), plain);
            let late = Hello {
                messages: Some(MessageConfig {
                    late_polling: true,
                    ..messages(mode)
                }),
                ..h
            };
            assert_eq!(Hello::decode(&bytes(&late)).unwrap(), late);
            assert_ne!(bytes(&late), bytes(&two_sided(mode)));
            let evented = Hello {
                messages: Some(MessageConfig {
                    late_polling: true,
                    events: true,
                    ..messages(mode)
                }),
                ..two_sided(mode)
            };
            assert_eq!(Hello::decode(&bytes(&evented)).unwrap(), evented);
            assert_ne!(bytes(&evented), bytes(&late));
        }
    }

    /// The server draws its plan from the hello it decodes: the same batches as the
    /// client's, message for message.
    #[test]
    fn both_ends_draw_the_same_messages_through_the_hello() {
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            let sent = two_sided(mode);
            let got = Hello::decode(&bytes(&sent)).unwrap();
            let (Some(ours), Some(theirs)) = (sent.messages, got.messages) else {
                panic!("a two-sided hello lost its mode");
            };
            let mut client = MessagePlanner::new(sent.seed, ours);
            let mut server = MessagePlanner::new(got.seed, theirs);
            for _ in 0..200 {
                assert_eq!(client.next_batch(), server.next_batch());
            }
        }
    }

    #[test]
    fn an_unknown_mode_is_refused_naming_it() {
        let mut b = bytes(&two_sided(TwoSided::Send));
        b[4 + ENDPOINT_LEN + 20] = 7;
        let e = refusal(&b);
        assert!(e.contains("mode 7"), "{e}");
        assert!(e.contains("send") && e.contains("write-imm"), "{e}");
    }

    #[test]
    fn two_sided_bits_in_a_read_hello_are_refused_naming_them() {
        for (bit, named) in [(MODE_LATE_POLLING, "late polling"), (MODE_EVENTS, "events")] {
            let mut b = bytes(&hello());
            b[4 + ENDPOINT_LEN + 20] = bit;
            let e = refusal(&b);
            assert!(e.contains(named) && e.contains("READ"), "{e}");
        }
    }

    #[test]
    fn a_read_hello_with_two_sided_settings_is_refused() {
        let mut b = bytes(&hello());
        // max_sges of a READ hello must be 0.
        b[4 + ENDPOINT_LEN + 20 + 12] = 3;
        let e = refusal(&b);
        assert!(e.contains("READ hello") && e.contains("max_sges 3"), "{e}");
    }

    /// Every two-sided field is range-checked before anything is allocated, and the
    /// region must be exactly what the settings need.
    #[test]
    fn a_two_sided_hello_out_of_range_is_refused_naming_the_field() {
        let ok = two_sided(TwoSided::WriteImm);
        let with = |c: MessageConfig| Hello {
            region_len: c.region_len() as u64,
            messages: Some(c),
            ..ok.clone()
        };
        let base = messages(TwoSided::WriteImm);
        for (h, field) in [
            (
                with(MessageConfig {
                    max_size: crate::two_sided::MAX_MESSAGE + 1,
                    ..base.clone()
                }),
                "max_size",
            ),
            (
                with(MessageConfig {
                    max_sges: 0,
                    ..base.clone()
                }),
                "max_sges 0",
            ),
            (
                with(MessageConfig {
                    max_sges: 1000,
                    ..base.clone()
                }),
                "max_sges 1000",
            ),
            (
                with(MessageConfig {
                    max_batch: 1 << 20,
                    ..base.clone()
                }),
                "max_batch",
            ),
            (
                Hello {
                    region_len: ok.region_len + 1,
                    ..ok.clone()
                },
                "region_len",
            ),
            (
                Hello {
                    region_len: 1 << 44,
                    ..ok.clone()
                },
                "region_len",
            ),
            (
                Hello {
                    regions: 2,
                    ..ok.clone()
                },
                "regions 2",
            ),
        ] {
            let e = refusal(&bytes(&h));
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn an_older_checker_is_told_to_match_versions() {
        let mut b = bytes(&hello());
        b[..4].copy_from_slice(b"JIX1");
        let e = refusal(&b);
        assert!(e.contains("older checker"), "{e}");
        assert!(Hello::check_magic(b"JIX2").is_ok());
        assert!(Hello::check_magic(b"GET ").is_err());
    }

    #[test]
    fn a_verdict_survives_the_wire() {
        let pass = Verdict::new(3, &[], false);
        let got = Verdict::read(&mut &pass.encode()[..], "reading").unwrap();
        assert_eq!(got, pass);
        let fault = Mismatch {
            message: Some(4),
            what: "message 4 (SEND of 9 bytes)".into(),
            field: crate::two_sided::Field::ByteLen,
            expected: "9".into(),
            got: "8".into(),
        };
        let fail = Verdict::new(2, &vec![fault.clone(); 8], false);
        assert_eq!(fail.mismatches, 8);
        assert_eq!(fail.text.lines().count(), VERDICT_FAULTS);
        let got = Verdict::read(&mut &fail.encode()[..], "reading").unwrap();
        assert_eq!(got, fail);
        let mut report = MessageReport::default();
        got.absorb(&mut report);
        assert_eq!((report.mismatches, report.recv_completions), (8, 2));
        assert!(report.problems[0].contains("byte_len: expected 9, got 8"));
        assert!(!report.clean());
        let stopped = Verdict::new(1, &[fault], true);
        let got = Verdict::read(&mut &stopped.encode()[..], "reading").unwrap();
        assert!(got.stopped);
    }

    /// The client trusts the server no more than the reverse: a verdict that contradicts
    /// itself or carries more text than the cap is refused.
    #[test]
    fn a_malformed_verdict_is_refused() {
        let frame = |kind: u8, faults: u32, len: u16| {
            let mut b = vec![kind];
            b.extend_from_slice(&1u32.to_be_bytes());
            b.extend_from_slice(&faults.to_be_bytes());
            b.extend_from_slice(&len.to_be_bytes());
            b.extend(std::iter::repeat_n(b'x', usize::from(len)));
            b
        };
        for (b, says) in [
            (frame(0, 1, 0), "kind 0 with 1 faults"),
            (frame(1, 0, 0), "kind 1 with 0 faults"),
            (frame(9, 0, 0), "kind 9"),
            (frame(1, 1, 5000), "5000 bytes of text"),
        ] {
            let e = Verdict::read(&mut &b[..], "reading")
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{says}: {e}");
        }
        // Cut short: an error naming what was being read, not a hang or a panic.
        let e = Verdict::read(&mut &frame(1, 1, 10)[..15], "reading the verdict")
            .unwrap_err()
            .to_string();
        assert!(e.contains("reading the verdict"), "{e}");
    }

    /// The server allocates what the hello asks for: counts and sizes beyond the caps,
    /// and a stranger's bytes, are refused naming the field.
    #[test]
    fn a_hello_out_of_range_is_refused_naming_the_field() {
        for (h, field) in [
            (
                Hello {
                    regions: 0,
                    ..hello()
                },
                "regions",
            ),
            (
                Hello {
                    regions: MAX_REGIONS + 1,
                    ..hello()
                },
                "regions",
            ),
            (
                Hello {
                    region_len: MAX_REGION_LEN + 1,
                    ..hello()
                },
                "region_len",
            ),
            (
                Hello {
                    region_len: 1,
                    ..hello()
                },
                "region_len",
            ),
        ] {
            let bytes: [u8; HELLO_LEN] = h.encode().try_into().unwrap();
            let e = Hello::decode(&bytes).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let mut bytes: [u8; HELLO_LEN] = hello().encode().try_into().unwrap();
        bytes[0] = b'G';
        assert!(Hello::decode(&bytes).is_err());
    }

    #[test]
    fn a_passed_deadline_is_named_as_such() {
        let e = io("reading the server's verdict")(std::io::Error::from_raw_os_error(EAGAIN))
            .to_string();
        assert!(e.starts_with("reading the server's verdict: "), "{e}");
        assert!(e.contains("deadline (--timeout) passed"), "{e}");
        // A timeout the checker words itself keeps its words.
        let own = std::io::Error::new(std::io::ErrorKind::TimedOut, "no client within 5s");
        assert!(io("accepting the client")(own)
            .to_string()
            .contains("no client within 5s"));
    }

    /// EAGAIN, what a read past its deadline returns on Linux.
    const EAGAIN: i32 = 11;

    #[test]
    fn regions_of_one_run_hold_different_patterns() {
        let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
        pattern::fill(region_seed(5, 0), 0, &mut a);
        pattern::fill(region_seed(5, 1), 0, &mut b);
        assert_ne!(a, b, "a READ from the wrong region must not pass");
    }
}
