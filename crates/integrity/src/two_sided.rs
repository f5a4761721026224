//! Two-sided messages across two hosts (`--two-sided`): what the client posts, what the
//! server's receives must show for it, and the judges of each received message. Pure: no
//! verbs, so the plan and every check are unit-tested, the checks by mutating a correct
//! message one field at a time.
//!
//! Two modes:
//!
//! - [`TwoSided::Send`]: the client posts SENDs, about half of them SENDs with immediate,
//!   each from a random scatter list over its own buffer; the server posts one receive per
//!   message whose random scatter list covers the message and a random slack after it.
//! - [`TwoSided::WriteImm`]: the client posts RDMA WRITEs with immediate into the server's
//!   region at an offset the plan draws; each consumes one receive the server posted with
//!   no SGE, or sometimes a small one that must stay untouched.
//!
//! Both ends draw the same [`MessageBatch`]es from the run's seed and [`MessageConfig`]
//! (the client's hello carries both), so the server knows each message's length, immediate,
//! scatter lists and pattern without being told. Its region holds a background pattern
//! ([`crate::pattern`] seeded per run); before a batch every range a message may land in
//! gets the complement of the message's pattern ([`prepare_region`]), so a byte that never
//! arrived differs. After the batch the server judges every completion
//! ([`judge_completion`]), every byte of every message and the guard bytes around every
//! range ([`judge_bytes`]), and the rest of the region ([`judge_elsewhere`]), then puts the
//! background back ([`restore_region`]).

use std::fmt;

use justitia_verbs::sys::{
    ibv_wc, ibv_wc_opcode, ibv_wc_status, IBV_WC_RDMA_READ, IBV_WC_RDMA_WRITE, IBV_WC_RECV,
    IBV_WC_RECV_RDMA_WITH_IMM, IBV_WC_SEND, IBV_WC_SUCCESS, IBV_WC_WITH_IMM,
};
use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::pattern;
use crate::plan::{below, log_uniform, split, Placement, RegionCursor, GUARD};

/// Largest message (as `--max-size` allows: an SGE's length is a 32-bit field).
pub const MAX_MESSAGE: usize = 1 << 30;
/// Most SGEs in one request or receive a client may ask for (rxe offers 32).
pub const MAX_SGES: usize = 32;
/// Most messages per batch a client may ask for.
pub const MAX_BATCH: usize = 64;
/// Most bytes a receive of a SEND covers beyond the message.
pub const MAX_RECV_SLACK: usize = 4096;
/// Most bytes of the SGE a receive for a WRITE with immediate sometimes has.
pub const MAX_IMM_RECV_SGE: usize = 64;

/// The two-sided operation a run checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum TwoSided {
    /// SEND, and SEND with immediate on about half the messages, into posted receives.
    Send,
    /// RDMA WRITE with immediate into the server's region, each consuming a receive.
    WriteImm,
}

impl TwoSided {
    /// The option value that selects this mode.
    pub fn as_str(self) -> &'static str {
        match self {
            TwoSided::Send => "send",
            TwoSided::WriteImm => "write-imm",
        }
    }

    /// The opcode the receive completion of every message carries.
    pub fn recv_opcode(self) -> ibv_wc_opcode {
        match self {
            TwoSided::Send => IBV_WC_RECV,
            TwoSided::WriteImm => IBV_WC_RECV_RDMA_WITH_IMM,
        }
    }

    /// The opcode the client's send completion of every message carries.
    pub fn send_opcode(self) -> ibv_wc_opcode {
        match self {
            TwoSided::Send => IBV_WC_SEND,
            TwoSided::WriteImm => IBV_WC_RDMA_WRITE,
        }
    }
}

/// The shape of a two-sided run's batches; both ends must hold the same one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageConfig {
    /// What the client posts.
    pub mode: TwoSided,
    /// Largest message, and the most bytes one batch moves in all.
    pub max_size: usize,
    /// Most SGEs per request and per receive.
    pub max_sges: usize,
    /// Most messages per batch.
    pub max_batch: usize,
    /// If set, some sizes are drawn within a byte of multiples of this (a chunk size).
    pub boundary: Option<usize>,
    /// The server polls its receive CQ for a batch only once the client says that every
    /// send of the batch completed, as an application does that looks for its messages
    /// only after a later word from the sender. Natively a send completes whether or not
    /// the receiver polls; a shaper must not make it wait for the receiver's poll.
    pub late_polling: bool,
    /// The server sleeps until its receive CQ's completion events (`ibv_req_notify_cq`,
    /// `ibv_get_cq_event`) instead of polling, with its sends on a CQ of their own, as an
    /// event-driven server does: a completion that arrives without its event is a fault.
    pub events: bool,
}

impl MessageConfig {
    /// Bytes of the client's buffer and of the server's region: the largest batch, plus
    /// for every message the receive's slack (or the small receive SGE of a WRITE with
    /// immediate) and the guard gaps around each of its ranges.
    pub fn region_len(&self) -> usize {
        let per_message = MAX_RECV_SLACK.max(MAX_IMM_RECV_SGE) + (self.max_sges + 1) * 2 * GUARD;
        self.max_size + self.max_batch * per_message + GUARD
    }

    /// Checks every field against its cap; the error names the field and its range. The
    /// server allocates what these ask for, so it calls this on every hello.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_size == 0 || self.max_size > MAX_MESSAGE {
            return Err(format!("max_size {} (1 to {MAX_MESSAGE})", self.max_size));
        }
        if self.max_sges == 0 || self.max_sges > MAX_SGES {
            return Err(format!("max_sges {} (1 to {MAX_SGES})", self.max_sges));
        }
        if self.max_batch == 0 || self.max_batch > MAX_BATCH {
            return Err(format!("max_batch {} (1 to {MAX_BATCH})", self.max_batch));
        }
        if let Some(b) = self.boundary {
            if b == 0 || b > MAX_MESSAGE {
                return Err(format!("boundary {b} (none, or 1 to {MAX_MESSAGE})"));
            }
        }
        Ok(())
    }
}

/// One message and everything both ends need to post and check it. Offsets are in the
/// client's buffer ([`Message::local`]) or the server's region (the rest); every
/// [`Placement::region`] is 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Its number in the run, from 0.
    pub index: u64,
    /// What carries it.
    pub mode: TwoSided,
    /// Bytes (at least 1).
    pub len: usize,
    /// The immediate value, as the application hands it to the verbs (host order; the
    /// wire and the completion carry it in network order). Always set for a WRITE with
    /// immediate; `None` for a plain SEND.
    pub imm: Option<u32>,
    /// The client's request's `wr_id`.
    pub send_wr_id: u64,
    /// The `wr_id` of the server's receive for it.
    pub recv_wr_id: u64,
    /// Seeds the message's data pattern.
    pub pattern_seed: u64,
    /// The client's scatter list: exactly the message, in order.
    pub local: Vec<Placement>,
    /// The receive's scatter list. SEND: at least the message, in order; WRITE with
    /// immediate: empty, or one small SGE no byte may land in.
    pub recv: Vec<Placement>,
    /// Where a WRITE with immediate lands in the server's region (`None` for SEND).
    pub remote: Option<Placement>,
}

impl Message {
    /// The operation's name in reports.
    pub fn kind(&self) -> &'static str {
        match (self.mode, self.imm) {
            (TwoSided::Send, None) => "SEND",
            (TwoSided::Send, Some(_)) => "SEND_WITH_IMM",
            (TwoSided::WriteImm, _) => "WRITE_WITH_IMM",
        }
    }

    /// `message N (KIND of LEN bytes)`, how reports name it.
    pub fn describe(&self) -> String {
        format!(
            "message {} ({} of {} bytes)",
            self.index,
            self.kind(),
            self.len
        )
    }

    /// The ranges of the server's region the message's receive and data may touch.
    fn server_ranges(&self) -> impl Iterator<Item = &Placement> + '_ {
        self.recv.iter().chain(self.remote.iter())
    }
}

/// Messages the server posts receives for together, then the client posts together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageBatch {
    /// In posting order.
    pub messages: Vec<Message>,
    /// The client posts all requests in one `ibv_post_send` call rather than one each.
    pub post_as_list: bool,
}

impl MessageBatch {
    /// True when every range, guards included, lies within buffers of `region_len` bytes
    /// (always, for a batch of a [`MessagePlanner`] whose configuration gives that
    /// length; checked before any byte is touched all the same).
    pub fn fits(&self, region_len: usize) -> bool {
        self.messages.iter().all(|m| {
            m.local
                .iter()
                .chain(m.server_ranges())
                .all(|p| p.offset >= GUARD && p.offset + p.len + GUARD <= region_len)
        })
    }
}

/// Draws message batches from a seed; the same seed and configuration give the same
/// batches on both ends.
pub struct MessagePlanner {
    rng: Pcg64Mcg,
    config: MessageConfig,
    next_index: u64,
}

impl MessagePlanner {
    /// A planner for `config`, seeded with `seed`.
    pub fn new(seed: u64, config: MessageConfig) -> Self {
        MessagePlanner {
            // Apart from the READ plan's stream of the same seed.
            rng: Pcg64Mcg::seed_from_u64(seed ^ 0x7477_6f2d_7369_6465),
            config,
            next_index: 0,
        }
    }

    /// The next batch: 1 to `max_batch` messages of at most `max_size` bytes in all.
    pub fn next_batch(&mut self) -> MessageBatch {
        let cfg = self.config.clone();
        let count = 1 + below(&mut self.rng, cfg.max_batch.max(1) as u64) as usize;
        let region_len = cfg.region_len();
        let mut local = RegionCursor::new(1, region_len);
        let mut server = RegionCursor::new(1, region_len);
        let mut budget = cfg.max_size.max(1);
        let mut messages = Vec::with_capacity(count);
        for _ in 0..count {
            if budget == 0 {
                break;
            }
            let len = self.size(budget);
            budget -= len;
            // Drawn in the same order whatever the mode, so a message's fields do not
            // depend on which of them the mode uses.
            let with_imm = self.rng.next_u32() & 1 == 0;
            let imm_value = self.rng.next_u32();
            let send_wr_id = self.rng.next_u64();
            let recv_wr_id = self.rng.next_u64();
            let pattern_seed = self.rng.next_u64();
            let local_sges = split(&mut self.rng, len, cfg.max_sges)
                .into_iter()
                .map(|part| local.place(&mut self.rng, part))
                .collect();
            let (imm, recv, remote) = match cfg.mode {
                TwoSided::Send => {
                    // Sometimes exactly the message, else up to a few KiB more.
                    let slack = if below(&mut self.rng, 4) == 0 {
                        0
                    } else {
                        below(&mut self.rng, MAX_RECV_SLACK as u64 + 1) as usize
                    };
                    let recv = split(&mut self.rng, len + slack, cfg.max_sges)
                        .into_iter()
                        .map(|part| server.place(&mut self.rng, part))
                        .collect();
                    (with_imm.then_some(imm_value), recv, None)
                }
                TwoSided::WriteImm => {
                    let remote = server.place(&mut self.rng, len);
                    // Most applications post a receive without SGEs for a WRITE with
                    // immediate; some post a small buffer, which must stay untouched.
                    let recv = if below(&mut self.rng, 4) == 0 {
                        let small = 1 + below(&mut self.rng, MAX_IMM_RECV_SGE as u64) as usize;
                        vec![server.place(&mut self.rng, small)]
                    } else {
                        Vec::new()
                    };
                    (Some(imm_value), recv, Some(remote))
                }
            };
            messages.push(Message {
                index: self.next_index,
                mode: cfg.mode,
                len,
                imm,
                send_wr_id,
                recv_wr_id,
                pattern_seed,
                local: local_sges,
                recv,
                remote,
            });
            self.next_index += 1;
        }
        MessageBatch {
            messages,
            post_as_list: self.rng.next_u32() & 1 == 0,
        }
    }

    /// A size in `1..=budget`: mostly log-uniform; a quarter at an edge (1 byte, either
    /// side of a 4 KiB page, the largest, a power of two or one byte off one); with a
    /// boundary, some within a byte of its multiples.
    fn size(&mut self, budget: usize) -> usize {
        let max = self.config.max_size.max(1);
        let size = match below(&mut self.rng, 16) {
            0..=3 => match below(&mut self.rng, 6) {
                0 => 1,
                1 => 4095 + below(&mut self.rng, 3) as usize,
                2 => max,
                _ => {
                    let bits = u64::from(usize::BITS - max.leading_zeros());
                    let power = 1usize << below(&mut self.rng, bits);
                    (power + below(&mut self.rng, 3) as usize).saturating_sub(1)
                }
            },
            4..=6 => match self.config.boundary.filter(|&c| c > 0) {
                Some(chunk) => {
                    let base = (log_uniform(&mut self.rng, max) / chunk).max(1) * chunk;
                    (base + below(&mut self.rng, 3) as usize).saturating_sub(1)
                }
                None => log_uniform(&mut self.rng, budget),
            },
            _ => log_uniform(&mut self.rng, budget),
        };
        size.clamp(1, budget)
    }
}

/// Fills the client's scatter lists of `batch` in `buffer` with each message's pattern.
pub fn fill_sources(batch: &MessageBatch, buffer: &mut [u8]) {
    for m in &batch.messages {
        let mut at = 0;
        for p in &m.local {
            pattern::fill(m.pattern_seed, at, &mut buffer[p.offset..p.offset + p.len]);
            at += p.len;
        }
    }
}

/// Lays out the server's region for `batch`: every range a message may land in (its
/// receive's SGEs, the slack after the message included; a WRITE's destination; the small
/// receive SGE of a WRITE with immediate) gets the complement of the message's pattern at
/// the message offsets it stands for, so that a byte that never arrived, or one that
/// arrived where nothing may, differs. The rest keeps the background.
pub fn prepare_region(batch: &MessageBatch, region: &mut [u8]) {
    for m in &batch.messages {
        let mut at = 0;
        for p in &m.recv {
            let mem = &mut region[p.offset..p.offset + p.len];
            pattern::fill_complement(m.pattern_seed, at, mem);
            // A WRITE's receive buffer stands for nothing; its bytes restart at 0.
            at = if m.mode == TwoSided::Send {
                at + p.len
            } else {
                0
            };
        }
        if let Some(p) = m.remote {
            pattern::fill_complement(m.pattern_seed, 0, &mut region[p.offset..p.offset + p.len]);
        }
    }
}

/// Puts the background back over every range of `batch` and its guards (or over the whole
/// region when `whole`, after something changed outside them), so that the next batch
/// starts from a known region.
pub fn restore_region(batch: &MessageBatch, region: &mut [u8], background: u64, whole: bool) {
    if whole {
        pattern::fill(background, 0, region);
        return;
    }
    for p in batch.messages.iter().flat_map(Message::server_ranges) {
        let (start, end) = guarded(p, region.len());
        pattern::fill(background, start, &mut region[start..end]);
    }
}

/// The range of `p` with its guards, within a region of `len` bytes.
fn guarded(p: &Placement, len: usize) -> (usize, usize) {
    (
        p.offset.saturating_sub(GUARD),
        (p.offset + p.len + GUARD).min(len),
    )
}

/// A field of a received message (or of the region) the server judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    /// A completion missing, or one beyond one per receive.
    Completion,
    /// The completion belongs to another receive (wrong order or identity).
    WrId,
    /// The completion's status.
    Status,
    /// The completion's opcode.
    Opcode,
    /// The completion's byte count.
    ByteLen,
    /// `IBV_WC_WITH_IMM` in the completion's flags.
    ImmFlag,
    /// The completion's immediate value.
    ImmData,
    /// The QP the completion names.
    QpNum,
    /// A byte of the message.
    Data,
    /// A byte of a receive's SGEs after the end of the message.
    Slack,
    /// A byte of the small receive SGE of a WRITE with immediate.
    RecvBuffer,
    /// A guard byte next to a range.
    Guard,
    /// A byte of the region outside every range of the batch and its guards.
    Elsewhere,
    /// The completion event of a CQ armed for the next completion (`--events`).
    Event,
}

impl Field {
    /// Its name in reports (the verbs field where there is one).
    pub fn as_str(self) -> &'static str {
        match self {
            Field::Completion => "completion",
            Field::WrId => "wr_id",
            Field::Status => "status",
            Field::Opcode => "opcode",
            Field::ByteLen => "byte_len",
            Field::ImmFlag => "wc_flags IBV_WC_WITH_IMM",
            Field::ImmData => "imm_data",
            Field::QpNum => "qp_num",
            Field::Data => "data",
            Field::Slack => "slack after the message",
            Field::RecvBuffer => "receive buffer",
            Field::Guard => "guard",
            Field::Elsewhere => "region outside every message",
            Field::Event => "completion event",
        }
    }

    /// True for the faults after which the completion stream can no longer be matched to
    /// the messages (or the queue pair is in error): the run stops after the batch.
    pub fn ends_the_run(self) -> bool {
        matches!(self, Field::Completion | Field::WrId | Field::Status)
    }
}

/// One thing a received message got wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The message (`None` for what concerns no single message).
    pub message: Option<u64>,
    /// What it concerns, as reports name it ("message 17 (SEND of 4097 bytes)").
    pub what: String,
    /// Which field.
    pub field: Field,
    /// What the field had to be.
    pub expected: String,
    /// What it was.
    pub got: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}: expected {}, got {}",
            self.what,
            self.field.as_str(),
            self.expected,
            self.got
        )
    }
}

fn mismatch(m: &Message, field: Field, expected: String, got: String) -> Mismatch {
    Mismatch {
        message: Some(m.index),
        what: m.describe(),
        field,
        expected,
        got,
    }
}

/// The name of a completion opcode, for reports.
pub fn wc_opcode_name(opcode: ibv_wc_opcode) -> String {
    let name = match opcode {
        IBV_WC_SEND => "IBV_WC_SEND",
        IBV_WC_RDMA_WRITE => "IBV_WC_RDMA_WRITE",
        IBV_WC_RDMA_READ => "IBV_WC_RDMA_READ",
        IBV_WC_RECV => "IBV_WC_RECV",
        IBV_WC_RECV_RDMA_WITH_IMM => "IBV_WC_RECV_RDMA_WITH_IMM",
        other => return format!("opcode {other}"),
    };
    format!("{name} ({opcode})")
}

/// Judges the receive completion `wc` that arrived when `m`'s was due, on the QP numbered
/// `qp_num`; `status_str` names a status. A completion of another receive, or one with an
/// error status, is judged no further: its other fields say nothing about `m`.
pub fn judge_completion(
    m: &Message,
    wc: &ibv_wc,
    qp_num: u32,
    status_str: &dyn Fn(ibv_wc_status) -> String,
) -> Vec<Mismatch> {
    if wc.wr_id != m.recv_wr_id {
        return vec![mismatch(
            m,
            Field::WrId,
            format!("{:#x}, the receive posted for it", m.recv_wr_id),
            format!("{:#x} (status {})", wc.wr_id, status_str(wc.status)),
        )];
    }
    if wc.status != IBV_WC_SUCCESS {
        return vec![mismatch(
            m,
            Field::Status,
            status_str(IBV_WC_SUCCESS),
            format!(
                "{} (status {}, vendor error {:#x})",
                status_str(wc.status),
                wc.status,
                wc.vendor_err
            ),
        )];
    }
    let mut out = Vec::new();
    let opcode = m.mode.recv_opcode();
    if wc.opcode != opcode {
        out.push(mismatch(
            m,
            Field::Opcode,
            wc_opcode_name(opcode),
            wc_opcode_name(wc.opcode),
        ));
    }
    // For a WRITE with immediate too: the verbs give the WRITE's length, the only way the
    // receiver learns it.
    if wc.byte_len as usize != m.len {
        out.push(mismatch(
            m,
            Field::ByteLen,
            m.len.to_string(),
            wc.byte_len.to_string(),
        ));
    }
    let flagged = wc.wc_flags & IBV_WC_WITH_IMM != 0;
    match m.imm {
        Some(_) if !flagged => out.push(mismatch(
            m,
            Field::ImmFlag,
            "set".into(),
            format!("clear (wc_flags {:#x})", wc.wc_flags),
        )),
        None if flagged => out.push(mismatch(
            m,
            Field::ImmFlag,
            "clear (a SEND without immediate)".into(),
            format!("set (wc_flags {:#x})", wc.wc_flags),
        )),
        _ => {}
    }
    if let (Some(imm), true) = (m.imm, flagged) {
        // SAFETY: both members of the union are plain 32-bit integers.
        let raw = unsafe { wc.__bindgen_anon_1.imm_data };
        // The client posted htonl(imm); the application reads the field raw.
        if raw != imm.to_be() {
            out.push(mismatch(
                m,
                Field::ImmData,
                format!("{imm:#010x} (network order)"),
                format!("{:#010x} (network order)", u32::from_be(raw)),
            ));
        }
    }
    if wc.qp_num != qp_num {
        out.push(mismatch(
            m,
            Field::QpNum,
            format!("{qp_num:#x}"),
            format!("{:#x}", wc.qp_num),
        ));
    }
    out
}

/// No completion for `m` arrived within `waited`, after `arrived` of its batch's did.
pub fn missing_completion(m: &Message, waited: std::time::Duration, arrived: usize) -> Mismatch {
    mismatch(
        m,
        Field::Completion,
        format!("a receive completion (wr_id {:#x})", m.recv_wr_id),
        format!("none within {waited:?}, after {arrived} of the batch's"),
    )
}

/// The completion of `m` was found in a CQ armed for the next completion, with no event
/// raised for it within `waited` (and a grace after).
pub fn eventless_completion(m: &Message, waited: std::time::Duration) -> Mismatch {
    mismatch(
        m,
        Field::Event,
        "an event for its receive completion (the CQ was armed for the next completion)".into(),
        format!("the completion in the CQ with no event within {waited:?}"),
    )
}

/// A completion arrived that no posted receive was left for; `after` says when ("after
/// the batch of messages 4 to 7").
pub fn extra_completion(
    wc: &ibv_wc,
    after: &str,
    status_str: &dyn Fn(ibv_wc_status) -> String,
) -> Mismatch {
    Mismatch {
        message: None,
        what: after.to_string(),
        field: Field::Completion,
        expected: "no completion beyond one per receive".into(),
        got: format!(
            "one with wr_id {:#x} (status {})",
            wc.wr_id,
            status_str(wc.status)
        ),
    }
}

/// Judges the bytes `m` left in the server's `region` (laid out by [`prepare_region`] on a
/// background seeded with `background`): every byte of the message where it belongs
/// (across the receive's SGEs in order, or at the WRITE's destination) equal to its
/// pattern, the slack after it and any receive buffer of a WRITE unchanged, and the guard
/// bytes on both sides of every range untouched. `region` must hold the batch
/// ([`MessageBatch::fits`]).
pub fn judge_bytes(m: &Message, region: &[u8], background: u64) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let seed = m.pattern_seed;
    let bytes = |p: &Placement| &region[p.offset..p.offset + p.len];
    let guards = |out: &mut Vec<Mismatch>, p: &Placement, name: &str| {
        let (before, after) = (p.offset - GUARD, p.offset + p.len);
        for (side, start) in [("before", before), ("after", after)] {
            if let Some(d) = pattern::check(background, start, &region[start..start + GUARD]) {
                out.push(mismatch(
                    m,
                    Field::Guard,
                    format!(
                        "the {GUARD} bytes {side} {name} (region offsets {start} to {}) unchanged, {:#04x} at {}",
                        start + GUARD - 1,
                        d.expected,
                        d.first_offset
                    ),
                    format!("{:#04x} there ({} bytes changed)", d.found, d.bytes),
                ));
            }
        }
    };
    match m.mode {
        TwoSided::Send => {
            // The offset in the receive buffer (and so in the message) each SGE starts at;
            // past the message's end the SGEs hold slack, laid out at the same offsets.
            let mut at = 0;
            for (k, p) in m.recv.iter().enumerate() {
                let name = format!("receive SGE {k} of {}", m.recv.len());
                let covered = p.len.min(m.len.saturating_sub(at));
                let (data, slack) = bytes(p).split_at(covered);
                if let Some(d) = pattern::check(seed, at, data) {
                    out.push(mismatch(
                        m,
                        Field::Data,
                        format!(
                            "{:#04x} at message offset {} ({name}, region offset {})",
                            d.expected,
                            d.first_offset,
                            p.offset + d.first_offset - at
                        ),
                        format!("{:#04x} ({} bytes of the SGE differ)", d.found, d.bytes),
                    ));
                }
                if let Some(d) = pattern::check_complement(seed, at + covered, slack) {
                    out.push(mismatch(
                        m,
                        Field::Slack,
                        format!(
                            "{:#04x} left at region offset {} ({name}, {} bytes past the message's end)",
                            d.expected,
                            p.offset + d.first_offset - at,
                            d.first_offset - m.len
                        ),
                        format!("{:#04x} ({} bytes changed)", d.found, d.bytes),
                    ));
                }
                guards(&mut out, p, &name);
                at += p.len;
            }
        }
        TwoSided::WriteImm => {
            if let Some(p) = &m.remote {
                if let Some(d) = pattern::check(seed, 0, bytes(p)) {
                    out.push(mismatch(
                        m,
                        Field::Data,
                        format!(
                            "{:#04x} at message offset {} (region offset {})",
                            d.expected,
                            d.first_offset,
                            p.offset + d.first_offset
                        ),
                        format!("{:#04x} ({} bytes differ)", d.found, d.bytes),
                    ));
                }
                guards(&mut out, p, "the WRITE's destination");
            }
            for p in &m.recv {
                if let Some(d) = pattern::check_complement(seed, 0, bytes(p)) {
                    out.push(mismatch(
                        m,
                        Field::RecvBuffer,
                        format!(
                            "the receive's {} bytes untouched, {:#04x} at region offset {}",
                            p.len,
                            d.expected,
                            p.offset + d.first_offset
                        ),
                        format!("{:#04x} ({} bytes changed)", d.found, d.bytes),
                    ));
                }
                guards(&mut out, p, "the receive's SGE");
            }
        }
    }
    out
}

/// Judges the rest of the server's `region` after `batch`: every byte outside the batch's
/// ranges and their guards must still hold the background seeded with `background`. One
/// mismatch per stretch between ranges that changed.
pub fn judge_elsewhere(batch: &MessageBatch, region: &[u8], background: u64) -> Vec<Mismatch> {
    let mut taken: Vec<(usize, usize)> = batch
        .messages
        .iter()
        .flat_map(Message::server_ranges)
        .map(|p| guarded(p, region.len()))
        .collect();
    taken.sort_unstable();
    let what = match (batch.messages.first(), batch.messages.last()) {
        (Some(a), Some(b)) => format!("the batch of messages {} to {}", a.index, b.index),
        _ => "an empty batch".to_string(),
    };
    // The stretches between the taken ranges (which may overlap: guards of neighbours).
    let mut gaps = Vec::new();
    let mut from = 0;
    for &(start, end) in &taken {
        if start > from {
            gaps.push((from, start));
        }
        from = from.max(end);
    }
    if from < region.len() {
        gaps.push((from, region.len()));
    }
    let mut out = Vec::new();
    for (start, end) in gaps {
        if let Some(d) = pattern::check(background, start, &region[start..end]) {
            out.push(Mismatch {
                message: None,
                what: what.clone(),
                field: Field::Elsewhere,
                expected: format!(
                    "region offsets {start} to {} unchanged, {:#04x} at {}",
                    end - 1,
                    d.expected,
                    d.first_offset
                ),
                got: format!("{:#04x} there ({} bytes changed)", d.found, d.bytes),
            });
        }
    }
    out
}

/// What one end of a two-sided run counted and found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MessageReport {
    /// Batches run.
    pub batches: u64,
    /// Messages posted (client) or received (server).
    pub messages: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Plain SENDs.
    pub sends: u64,
    /// SENDs with immediate.
    pub sends_with_imm: u64,
    /// WRITEs with immediate.
    pub writes_with_imm: u64,
    /// Send completions checked (client).
    pub send_completions: u64,
    /// Receive completions checked (by the server; the client counts what it was told).
    pub recv_completions: u64,
    /// Faults found: each wrong field of a message counts once, as does each changed
    /// stretch of the region outside the messages. Zero for a pass.
    pub mismatches: u64,
    /// The first few faults, described.
    pub problems: Vec<String>,
    /// The server stopped the run after a fault that left the completions unmatched.
    pub stopped: bool,
}

impl MessageReport {
    /// Problems kept in [`MessageReport::problems`]; later ones are only counted.
    pub const KEEP: usize = 20;

    /// True when every message arrived as sent and the run went to its end.
    pub fn clean(&self) -> bool {
        self.mismatches == 0 && !self.stopped
    }

    /// Counts `m` as run.
    pub fn count(&mut self, m: &Message) {
        self.messages += 1;
        self.bytes += m.len as u64;
        match m.kind() {
            "SEND" => self.sends += 1,
            "SEND_WITH_IMM" => self.sends_with_imm += 1,
            _ => self.writes_with_imm += 1,
        }
    }

    /// Keeps `text` if fewer than [`MessageReport::KEEP`] problems are kept.
    pub fn problem(&mut self, text: String) {
        if self.problems.len() < Self::KEEP {
            self.problems.push(text);
        }
    }

    /// Counts `found` and keeps the first descriptions.
    pub fn found(&mut self, found: &[Mismatch]) {
        self.mismatches += found.len() as u64;
        for f in found {
            self.problem(f.to_string());
        }
    }

    /// The messages by kind, for summary lines: "3 SEND, 2 SEND_WITH_IMM".
    pub fn kinds(&self) -> String {
        let kinds = [
            (self.sends, "SEND"),
            (self.sends_with_imm, "SEND_WITH_IMM"),
            (self.writes_with_imm, "WRITE_WITH_IMM"),
        ];
        let parts: Vec<String> = kinds
            .iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, k)| format!("{n} {k}"))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mode: TwoSided) -> MessageConfig {
        MessageConfig {
            mode,
            max_size: 1 << 20,
            max_sges: 6,
            max_batch: 4,
            boundary: None,
            late_polling: false,
            events: false,
        }
    }

    fn overlap(a: &Placement, b: &Placement) -> bool {
        a.offset < b.offset + b.len + GUARD && b.offset < a.offset + a.len + GUARD
    }

    fn disjoint(ranges: &[Placement]) {
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                assert!(!overlap(a, b), "{a:?} overlaps {b:?}");
            }
        }
    }

    #[test]
    fn batches_are_well_formed_on_both_ends() {
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            let cfg = config(mode);
            let mut planner = MessagePlanner::new(1, cfg.clone());
            let mut index = 0;
            let mut exact = 0;
            let mut with_slack = 0;
            for _ in 0..2000 {
                let b = planner.next_batch();
                assert!(!b.messages.is_empty() && b.messages.len() <= cfg.max_batch);
                assert!(b.fits(cfg.region_len()), "{b:?}");
                assert!(b.messages.iter().map(|m| m.len).sum::<usize>() <= cfg.max_size);
                let (mut locals, mut servers) = (Vec::new(), Vec::new());
                for m in &b.messages {
                    assert_eq!(m.index, index);
                    index += 1;
                    assert!(m.len >= 1 && m.len <= cfg.max_size);
                    assert_ne!(m.send_wr_id, m.recv_wr_id);
                    // The client's list covers the message exactly.
                    assert!(!m.local.is_empty() && m.local.len() <= cfg.max_sges);
                    assert_eq!(m.local.iter().map(|p| p.len).sum::<usize>(), m.len);
                    assert!(m.local.iter().chain(&m.recv).all(|p| p.len >= 1));
                    match mode {
                        TwoSided::Send => {
                            // The receive covers at least the message, at most the slack more.
                            assert!(!m.recv.is_empty() && m.recv.len() <= cfg.max_sges);
                            let covered: usize = m.recv.iter().map(|p| p.len).sum();
                            assert!(covered >= m.len && covered <= m.len + MAX_RECV_SLACK);
                            if covered == m.len {
                                exact += 1;
                            } else {
                                with_slack += 1;
                            }
                            assert_eq!(m.remote, None);
                        }
                        TwoSided::WriteImm => {
                            assert!(m.imm.is_some());
                            assert!(m.remote.is_some_and(|p| p.len == m.len));
                            assert!(m.recv.len() <= 1);
                            assert!(m.recv.iter().all(|p| p.len <= MAX_IMM_RECV_SGE));
                        }
                    }
                    locals.extend(m.local.iter().copied());
                    servers.extend(m.server_ranges().copied());
                }
                // Disjoint, guards included: no message can hide another's error.
                disjoint(&locals);
                disjoint(&servers);
            }
            if mode == TwoSided::Send {
                assert!(exact > 100 && with_slack > 100, "{exact} {with_slack}");
            }
        }
    }

    #[test]
    fn sizes_cover_one_byte_page_edges_powers_of_two_and_the_maximum() {
        let cfg = config(TwoSided::Send);
        let mut planner = MessagePlanner::new(2, cfg.clone());
        let sizes: Vec<usize> = (0..3000)
            .flat_map(|_| planner.next_batch().messages)
            .map(|m| m.len)
            .collect();
        for edge in [1, 4095, 4096, 4097, cfg.max_size, 1 << 10, (1 << 16) + 1] {
            assert!(sizes.contains(&edge), "no message of {edge} bytes");
        }
        // Small, mid and large sizes all occur.
        assert!(sizes.iter().filter(|&&s| s < 64).count() > 100);
        assert!(
            sizes
                .iter()
                .filter(|&&s| (4 << 10..64 << 10).contains(&s))
                .count()
                > 100
        );
        assert!(sizes.iter().filter(|&&s| s > 256 << 10).count() > 100);
    }

    #[test]
    fn sizes_hit_chunk_boundaries_when_asked() {
        let chunk = 65536;
        let mut planner = MessagePlanner::new(
            3,
            MessageConfig {
                boundary: Some(chunk),
                ..config(TwoSided::WriteImm)
            },
        );
        let sizes: Vec<usize> = (0..3000)
            .flat_map(|_| planner.next_batch().messages)
            .map(|m| m.len)
            .collect();
        for off in [chunk - 1, 0, 1] {
            assert!(
                sizes.iter().any(|&s| s > chunk && s % chunk == off),
                "{off}"
            );
        }
    }

    #[test]
    fn sends_carry_an_immediate_about_half_the_time_and_lists_vary() {
        let mut planner = MessagePlanner::new(4, config(TwoSided::Send));
        let messages: Vec<Message> = (0..1000)
            .flat_map(|_| planner.next_batch().messages)
            .collect();
        let with = messages.iter().filter(|m| m.imm.is_some()).count();
        assert!(with * 3 > messages.len() && with * 3 < 2 * messages.len());
        assert!(messages.iter().any(|m| m.local.len() == 1));
        assert!(messages.iter().any(|m| m.local.len() >= 5));
        assert!(messages.iter().any(|m| m.recv.len() == 1));
        assert!(messages.iter().any(|m| m.recv.len() >= 5));
        // The two ends split differently.
        assert!(messages.iter().any(|m| m
            .local
            .iter()
            .map(|p| p.len)
            .ne(m.recv.iter().map(|p| p.len))));
        let mut planner = MessagePlanner::new(4, config(TwoSided::WriteImm));
        let messages: Vec<Message> = (0..1000)
            .flat_map(|_| planner.next_batch().messages)
            .collect();
        assert!(messages.iter().any(|m| m.recv.is_empty()));
        assert!(messages.iter().any(|m| m.recv.len() == 1));
    }

    #[test]
    fn the_seed_replays_the_same_messages_on_both_ends() {
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            // Each end builds its own planner from the seed and configuration.
            let mut client = MessagePlanner::new(99, config(mode));
            let mut server = MessagePlanner::new(99, config(mode));
            let mut other = MessagePlanner::new(100, config(mode));
            let a: Vec<MessageBatch> = (0..100).map(|_| client.next_batch()).collect();
            let b: Vec<MessageBatch> = (0..100).map(|_| server.next_batch()).collect();
            let c: Vec<MessageBatch> = (0..100).map(|_| other.next_batch()).collect();
            assert_eq!(a, b);
            assert_ne!(a, c);
        }
    }

    #[test]
    fn configurations_beyond_the_caps_are_refused_naming_the_field() {
        let ok = config(TwoSided::Send);
        assert_eq!(ok.validate(), Ok(()));
        for (bad, field) in [
            (
                MessageConfig {
                    max_size: 0,
                    ..ok.clone()
                },
                "max_size",
            ),
            (
                MessageConfig {
                    max_size: MAX_MESSAGE + 1,
                    ..ok.clone()
                },
                "max_size",
            ),
            (
                MessageConfig {
                    max_sges: MAX_SGES + 1,
                    ..ok.clone()
                },
                "max_sges",
            ),
            (
                MessageConfig {
                    max_batch: 0,
                    ..ok.clone()
                },
                "max_batch",
            ),
            (
                MessageConfig {
                    boundary: Some(0),
                    ..ok.clone()
                },
                "boundary",
            ),
        ] {
            let e = bad.validate().err().unwrap_or_default();
            assert!(e.starts_with(field), "{bad:?}: {e:?}");
        }
    }

    /// The server's region and completions for `batch` as a correct device leaves them:
    /// each message's bytes scattered over its receive's SGEs in order (or written at its
    /// destination), and a completion per message.
    struct Delivered {
        region: Vec<u8>,
        wcs: Vec<ibv_wc>,
    }

    const BACKGROUND: u64 = 0xbac6;
    const QPN: u32 = 0x123;

    fn deliver(batch: &MessageBatch, region_len: usize) -> Delivered {
        let mut region = vec![0u8; region_len];
        pattern::fill(BACKGROUND, 0, &mut region);
        prepare_region(batch, &mut region);
        let mut wcs = Vec::new();
        for m in &batch.messages {
            match m.mode {
                TwoSided::Send => {
                    let mut at = 0;
                    for p in &m.recv {
                        let n = p.len.min(m.len - at);
                        pattern::fill(m.pattern_seed, at, &mut region[p.offset..p.offset + n]);
                        at += n;
                    }
                }
                TwoSided::WriteImm => {
                    if let Some(p) = m.remote {
                        pattern::fill(m.pattern_seed, 0, &mut region[p.offset..p.offset + p.len]);
                    }
                }
            }
            let mut wc = ibv_wc {
                wr_id: m.recv_wr_id,
                status: IBV_WC_SUCCESS,
                opcode: m.mode.recv_opcode(),
                byte_len: m.len as u32,
                qp_num: QPN,
                ..ibv_wc::default()
            };
            if let Some(imm) = m.imm {
                wc.wc_flags = IBV_WC_WITH_IMM;
                wc.__bindgen_anon_1.imm_data = imm.to_be();
            }
            wcs.push(wc);
        }
        Delivered { region, wcs }
    }

    fn status(s: ibv_wc_status) -> String {
        format!("status #{s}")
    }

    /// Every fault of `batch` as delivered in `d`, as the server judges them.
    fn judge(batch: &MessageBatch, d: &Delivered) -> Vec<Mismatch> {
        let mut out = Vec::new();
        for (m, wc) in batch.messages.iter().zip(&d.wcs) {
            out.extend(judge_completion(m, wc, QPN, &status));
            out.extend(judge_bytes(m, &d.region, BACKGROUND));
        }
        out.extend(judge_elsewhere(batch, &d.region, BACKGROUND));
        out
    }

    /// A batch of the mode with at least two messages, the first with an immediate and
    /// the second without (SEND), and a receive with slack over several SGEs.
    fn sample(mode: TwoSided) -> (MessageBatch, usize) {
        let cfg = MessageConfig {
            max_size: 64 << 10,
            ..config(mode)
        };
        let mut planner = MessagePlanner::new(5, cfg.clone());
        loop {
            let b = planner.next_batch();
            let [a, second, ..] = &b.messages[..] else {
                continue;
            };
            let shaped = match mode {
                TwoSided::Send => {
                    a.imm.is_some()
                        && second.imm.is_none()
                        && a.recv.len() >= 3
                        && a.recv.iter().map(|p| p.len).sum::<usize>() > a.len
                        && a.len > 100
                }
                TwoSided::WriteImm => a.recv.len() == 1 && a.len > 100,
            };
            if shaped {
                return (b, cfg.region_len());
            }
        }
    }

    fn fields(found: &[Mismatch]) -> Vec<Field> {
        found.iter().map(|m| m.field).collect()
    }

    #[test]
    fn a_message_delivered_as_sent_passes() {
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            let (batch, len) = sample(mode);
            let d = deliver(&batch, len);
            assert_eq!(judge(&batch, &d), vec![], "{mode:?}");
            // And the region is ready for the next batch once restored.
            let mut region = d.region;
            restore_region(&batch, &mut region, BACKGROUND, false);
            assert_eq!(pattern::check(BACKGROUND, 0, &region), None);
        }
    }

    /// Each mutation of a correct completion is reported as exactly one mismatch naming
    /// the field it broke, on message 0.
    #[test]
    fn each_wrong_completion_field_is_named() {
        type Mutation = fn(&mut ibv_wc, &Message);
        let mutations: [(Mutation, Field); 8] = [
            (|wc, _| wc.byte_len += 1, Field::ByteLen),
            (|wc, _| wc.byte_len -= 1, Field::ByteLen),
            (|wc, _| wc.wc_flags &= !IBV_WC_WITH_IMM, Field::ImmFlag),
            (
                |wc, m| wc.__bindgen_anon_1.imm_data = m.imm.unwrap_or(0).wrapping_add(1).to_be(),
                Field::ImmData,
            ),
            (|wc, _| wc.wr_id ^= 1, Field::WrId),
            (|wc, _| wc.opcode = IBV_WC_SEND, Field::Opcode),
            (|wc, _| wc.status = 12, Field::Status),
            (|wc, _| wc.qp_num += 1, Field::QpNum),
        ];
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            let (batch, len) = sample(mode);
            for (mutate, field) in mutations {
                let mut d = deliver(&batch, len);
                mutate(&mut d.wcs[0], &batch.messages[0]);
                let found = judge(&batch, &d);
                assert_eq!(fields(&found), vec![field], "{mode:?}: {found:?}");
                assert_eq!(found[0].message, Some(batch.messages[0].index));
                let text = found[0].to_string();
                assert!(text.starts_with("message "), "{text}");
                assert!(text.contains(field.as_str()), "{text}");
                assert!(
                    text.contains("expected") && text.contains(", got "),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn the_immediate_is_compared_in_network_order() {
        let (batch, len) = sample(TwoSided::Send);
        let m = &batch.messages[0];
        let Some(imm) = m.imm else {
            panic!("the sample's first message has an immediate");
        };
        let mut d = deliver(&batch, len);
        // The value in host order instead of htonl(value): a byte-order slip.
        d.wcs[0].__bindgen_anon_1.imm_data = imm;
        let expect = if imm.swap_bytes() == imm {
            vec![]
        } else {
            vec![Field::ImmData]
        };
        let found = judge_completion(m, &d.wcs[0], QPN, &status);
        assert_eq!(fields(&found), expect);
        if let Some(f) = found.first() {
            assert!(f.expected.contains(&format!("{imm:#010x}")), "{f}");
        }
    }

    #[test]
    fn a_send_without_immediate_must_not_be_flagged() {
        let (batch, len) = sample(TwoSided::Send);
        let mut d = deliver(&batch, len);
        d.wcs[1].wc_flags |= IBV_WC_WITH_IMM;
        assert_eq!(fields(&judge(&batch, &d)), vec![Field::ImmFlag]);
    }

    #[test]
    fn completions_out_of_order_are_named_by_wr_id() {
        let (batch, len) = sample(TwoSided::Send);
        let mut d = deliver(&batch, len);
        d.wcs.swap(0, 1);
        let found = judge(&batch, &d);
        assert_eq!(fields(&found), vec![Field::WrId, Field::WrId]);
        assert!(found.iter().all(|f| f.field.ends_the_run()));
    }

    /// Each mutation of a correct region is reported as a mismatch naming what it broke.
    #[test]
    fn each_wrong_byte_is_named() {
        for mode in [TwoSided::Send, TwoSided::WriteImm] {
            let (batch, len) = sample(mode);
            let m = &batch.messages[0];
            let data = match mode {
                // The message's last byte, wherever the receive's SGEs put it.
                TwoSided::Send => {
                    let mut at = 0;
                    let p = m.recv.iter().find(|p| {
                        at += p.len;
                        at >= m.len
                    });
                    p.map_or(0, |p| p.offset + p.len - (at - m.len) - 1)
                }
                TwoSided::WriteImm => m.remote.map_or(0, |p| p.offset + p.len - 1),
            };
            let last = m.recv[m.recv.len() - 1];
            let mut cases = vec![
                (data, Field::Data),
                (m.recv[0].offset - 1, Field::Guard),
                (last.offset + last.len, Field::Guard),
                (len - 1, Field::Elsewhere),
            ];
            match mode {
                // The receive's last byte lies in the slack after the message.
                TwoSided::Send => cases.push((last.offset + last.len - 1, Field::Slack)),
                TwoSided::WriteImm => cases.push((m.recv[0].offset, Field::RecvBuffer)),
            }
            for (at, field) in cases {
                let mut d = deliver(&batch, len);
                d.region[at] ^= 0x40;
                let found = judge(&batch, &d);
                // A guard byte may lie in the guards of two neighbouring ranges.
                let want = if field == Field::Guard && found.len() == 2 {
                    vec![field; 2]
                } else {
                    vec![field]
                };
                assert_eq!(fields(&found), want, "{mode:?} byte {at}: {found:?}");
                assert!(found[0].to_string().contains(field.as_str()));
            }
        }
    }

    #[test]
    fn a_byte_that_never_arrived_is_a_data_mismatch() {
        let (batch, len) = sample(TwoSided::Send);
        let m = &batch.messages[0];
        let mut d = deliver(&batch, len);
        // The message's first byte left as prepared: a chunk that never landed.
        let p = m.recv[0];
        pattern::fill_complement(m.pattern_seed, 0, &mut d.region[p.offset..p.offset + 1]);
        let found = judge(&batch, &d);
        assert_eq!(fields(&found), vec![Field::Data]);
        assert!(
            found[0].expected.contains("message offset 0"),
            "{}",
            found[0]
        );
    }

    #[test]
    fn reports_count_by_kind_and_pass_only_clean() {
        let (batch, _) = sample(TwoSided::Send);
        let mut r = MessageReport::default();
        for m in &batch.messages {
            r.count(m);
        }
        assert_eq!(r.messages, batch.messages.len() as u64);
        assert!(r.kinds().contains("SEND_WITH_IMM"));
        assert!(r.clean());
        r.found(&[extra_completion(
            &ibv_wc::default(),
            "after the last batch",
            &status,
        )]);
        assert!(!r.clean());
        assert_eq!(r.problems.len(), 1);
        let stopped = MessageReport {
            stopped: true,
            ..MessageReport::default()
        };
        assert!(!stopped.clean());
    }
}
