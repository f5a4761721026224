//! The control block: one sealed memfd the daemon writes and every shaper maps read-only.
//!
//! The block is a [`Header`] followed by [`Header::slots`] [`Slot`]s, every field an
//! `AtomicU64` so that both sides touch it only through atomic loads and stores (no
//! process-shared lock exists anywhere). The daemon is the single writer; it publishes
//! each slot and the header's status through a seqlock: the sequence word is made odd,
//! the fields are stored, the word is made even again. A reader loads the word, the
//! fields, then the word again and keeps the copy only if both loads saw the same even
//! value; it gives up after a few attempts rather than wait, because a shaper must never
//! block a verb on the daemon.
//!
//! The memfd is created with sealing allowed, sized, mapped writable by the daemon, and
//! then sealed with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL`:
//! the daemon's own mapping stays writable, while any later `mmap(PROT_WRITE, MAP_SHARED)`
//! or `write(2)` on the descriptor fails for everyone, including a client that received
//! it over `SCM_RIGHTS`, and nobody can lift the seals.
//!
//! There are two kinds of block ([`Header::kind`]). The **shared block** ([`KIND_SHARED`],
//! no slots) is passed to every connection: the heartbeat, the boot id and the daemon-wide
//! status, what every tenant may see. Each tenant (a uid, or a cgroup) has a **tenant
//! page** of its own ([`KIND_TENANT`]), another sealed memfd passed only to that tenant's
//! connections, holding the slots of its own flows: their allotments and the usage the
//! daemon counted for them. A process of one tenant is never given another's page, so it
//! cannot read another tenant's flows. Version 3 made this split; a reader of version 2
//! found every flow's slot in the one block.
//!
//! Layout version 2 made a slot two cache lines (128 bytes) to carry the release phase
//! ([`Slot::phase_offset`], [`Slot::phase_epoch`]): the eight words of version 1 were all
//! in use. A reader of another version refuses the block ([`BlockError::Version`]), so a
//! shaper older than its daemon keeps its static settings instead of misreading slots.
//!
//! The heartbeat is the daemon's `CLOCK_MONOTONIC` time in nanoseconds, stored at every
//! wake-up; the boot id is random per daemon start. A reader that sees the heartbeat not
//! move for longer than [`Header::stale_after_ns`] does not use the allotments until it
//! moves again; one that sees a boot id other than the one it registered with treats the
//! daemon as gone.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use justitia_core::control_verbs::ControlVerbBudget;
use justitia_core::message_charge::MessageCharge;
use justitia_core::queue_turns::TurnBudget;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// `b"JUSTCB\0\x01"` read as a little-endian word: identifies a control block.
pub const MAGIC: u64 = u64::from_le_bytes(*b"JUSTCB\0\x01");
/// The layout version; a reader refuses any other.
pub const LAYOUT_VERSION: u64 = 3;
/// [`Header::kind`] of the shared block: header only, every connection gets it.
pub const KIND_SHARED: u64 = 0;
/// [`Header::kind`] of a tenant page: the slots of one tenant's flows.
pub const KIND_TENANT: u64 = 1;
/// Slots in a tenant page when the configuration does not say (one per registered flow).
pub const DEFAULT_SLOTS: u32 = 1024;
/// The most slots a block may have (an 8 MiB block), so a size read from a peer is bounded.
pub const MAX_SLOTS: u32 = 65_536;
/// The fixed-point scale of [`Slot::phase_offset`]: an offset in [0, 1) is stored as
/// `offset * PHASE_ONE`, below `PHASE_ONE`.
pub const PHASE_ONE: u64 = 1 << 32;
/// How many times a reader retries a torn read before giving up for this call.
pub const READ_ATTEMPTS: u32 = 8;

/// The first 128 bytes of the block.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: AtomicU64,
    /// [`LAYOUT_VERSION`].
    pub version: AtomicU64,
    /// Number of slots after the header.
    pub slots: AtomicU64,
    /// Random per daemon start.
    pub boot_id: AtomicU64,
    /// The daemon's `CLOCK_MONOTONIC` time (ns) at its latest wake-up.
    pub heartbeat_ns: AtomicU64,
    /// After how long without a heartbeat readers consider the daemon gone (ns).
    pub stale_after_ns: AtomicU64,
    /// Seqlock word of the status fields below.
    pub seq: AtomicU64,
    /// SafeUtil, bytes/s.
    pub safe_util: AtomicU64,
    /// Current99 in ns (0 while unknown).
    pub current_p99_ns: AtomicU64,
    /// Target99 in ns (0 while unknown).
    pub target_p99_ns: AtomicU64,
    /// The control loop's latest generation.
    pub generation: AtomicU64,
    /// [`KIND_SHARED`] or [`KIND_TENANT`].
    pub kind: AtomicU64,
    /// In a tenant page, each of the tenant's processes' control-verb budget in verbs per
    /// 1000 s (0: not paced), under [`Header::seq`] with the status. Added within layout
    /// 3: a block written before it holds 0 here, which reads as not paced.
    pub control_verbs_per_ks: AtomicU64,
    /// The control-verb burst that goes with it.
    pub control_verb_burst: AtomicU64,
    /// In a tenant page, how many of each of the tenant's processes' shaped QPs may post
    /// at once (0: no turns), under [`Header::seq`] with the status (see
    /// [`justitia_core::queue_turns`]). Added within layout 3, as the control-verb budget.
    pub qp_turns_open: AtomicU64,
    /// The bytes of one turn that goes with it.
    pub qp_turn_bytes: AtomicU64,
}

/// What a slot is being used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum SlotState {
    /// No flow.
    Free = 0,
    /// A resource-hungry flow with an allotment to follow.
    Allotted = 1,
    /// A latency flow: never shaped.
    Unshaped = 2,
}

impl SlotState {
    fn from_word(word: u64) -> Option<Self> {
        match word {
            0 => Some(SlotState::Free),
            1 => Some(SlotState::Allotted),
            2 => Some(SlotState::Unshaped),
            _ => None,
        }
    }
}

/// One flow's allotment, 128 bytes (two cache lines).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct Slot {
    /// Seqlock word.
    pub seq: AtomicU64,
    /// The daemon's id of the flow in this slot (0 when free).
    pub flow: AtomicU64,
    /// [`SlotState`] as a word.
    pub state: AtomicU64,
    /// Bytes per second.
    pub bytes_per_sec: AtomicU64,
    /// Operations per second.
    pub ops_per_sec: AtomicU64,
    /// The chunk size bandwidth requests are cut to.
    pub chunk_bytes: AtomicU64,
    /// The multi-resource token's byte size.
    pub token_bytes: AtomicU64,
    /// The control loop generation that set this allotment.
    pub generation: AtomicU64,
    /// The release phase's offset in one release interval, in units of
    /// 1/[`PHASE_ONE`] (below `PHASE_ONE`).
    pub phase_offset: AtomicU64,
    /// The release phase's epoch: the generation that assigned the phases.
    pub phase_epoch: AtomicU64,
    /// Bytes the daemon has counted for the flow from its usage reports (outside the
    /// seqlock: one word, stored whole).
    pub usage_bytes: AtomicU64,
    /// What each of the flow's requests is charged in its pace
    /// ([`MessageCharge::to_words`]). Added within layout 3: a block written before it
    /// holds zeros here, which charge the payload.
    pub charge: [AtomicU64; 5],
}

const _: () = assert!(std::mem::size_of::<Header>() == 128);
const _: () = assert!(std::mem::size_of::<Slot>() == 128);

/// A flow's allotment as read from its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAllotment {
    /// The daemon's flow id.
    pub flow: u64,
    /// Whether the flow is shaped.
    pub state: SlotState,
    /// Bytes per second.
    pub bytes_per_sec: u64,
    /// Operations per second.
    pub ops_per_sec: u64,
    /// Chunk size.
    pub chunk_bytes: u64,
    /// Token bytes.
    pub token_bytes: u64,
    /// The generation that set it.
    pub generation: u64,
    /// The release phase's offset, in units of 1/[`PHASE_ONE`]; see [`phase_to_fixed`].
    pub phase_offset: u64,
    /// The release phase's epoch.
    pub phase_epoch: u64,
    /// What each of the flow's requests is charged in its pace.
    pub charge: MessageCharge,
}

/// An offset in [0, 1) as stored in [`Slot::phase_offset`]: rounded to the nearest
/// 1/[`PHASE_ONE`], wrapped into [0, 1), and 0 for a value that is not finite.
pub fn phase_to_fixed(offset: f64) -> u64 {
    if !offset.is_finite() {
        return 0;
    }
    let fixed = (offset.rem_euclid(1.0) * PHASE_ONE as f64).round() as u64;
    // An offset a hair below 1 rounds up to a whole interval, which is offset 0.
    fixed % PHASE_ONE
}

/// A stored offset back as a fraction in [0, 1); a word at or above [`PHASE_ONE`] (which a
/// daemon does not write) wraps.
pub fn phase_from_fixed(fixed: u64) -> f64 {
    (fixed % PHASE_ONE) as f64 / PHASE_ONE as f64
}

/// The daemon-wide status in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockStatus {
    /// SafeUtil, bytes/s.
    pub safe_util: u64,
    /// Current99, ns (0 unknown).
    pub current_p99_ns: u64,
    /// Target99, ns (0 unknown).
    pub target_p99_ns: u64,
    /// Latest generation.
    pub generation: u64,
}

/// Why a control block could not be created or mapped.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// The call and its purpose.
        what: &'static str,
        /// The error.
        source: rustix::io::Errno,
    },
    /// The block is laid out in a version this reader does not know (a daemon newer or
    /// older than the shaper).
    #[error("control block layout version {found}, this reader knows {known}")]
    Version {
        /// The block's version.
        found: u64,
        /// [`LAYOUT_VERSION`].
        known: u64,
    },
    /// The descriptor does not hold a block this reader understands.
    #[error("not a justitia control block: {0}")]
    Invalid(String),
}

fn sys(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> BlockError {
    move |source| BlockError::Sys { what, source }
}

/// The byte length of a block with `slots` slots.
pub fn block_len(slots: u32) -> usize {
    std::mem::size_of::<Header>() + slots as usize * std::mem::size_of::<Slot>()
}

/// The current `CLOCK_MONOTONIC` time in ns, the heartbeat's clock.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// A mapping of a block; unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the live mapping made in `map`, unmapped only here.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl Mapping {
    fn map(fd: BorrowedFd<'_>, len: usize, writable: bool) -> Result<Self, rustix::io::Errno> {
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh shared mapping of the whole descriptor; nothing else aliases it
        // in this process except through the atomics below.
        let ptr =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0)? };
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(rustix::io::Errno::NOMEM)?;
        Ok(Mapping { ptr, len })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is page aligned and at least a header long (checked by the
        // constructors); Header is all atomics, valid for any bit pattern.
        unsafe { &*self.ptr.as_ptr().cast::<Header>() }
    }

    fn slot(&self, index: u32) -> Option<&Slot> {
        let offset = block_len(index);
        if offset + std::mem::size_of::<Slot>() > self.len {
            return None;
        }
        // SAFETY: in bounds (checked above) and 64-byte aligned (header and slots are
        // multiples of 64 from a page-aligned base); all atomics.
        Some(unsafe { &*self.ptr.as_ptr().add(offset).cast::<Slot>() })
    }
}

/// The daemon's side: creates, seals and writes the block.
#[derive(Debug)]
pub struct BlockWriter {
    fd: OwnedFd,
    map: Mapping,
    slots: u32,
}

impl BlockWriter {
    /// Creates the sealed shared block (no slots) with this boot id and staleness limit,
    /// heartbeat set to now.
    pub fn create_shared(boot_id: u64, stale_after_ns: u64) -> Result<Self, BlockError> {
        Self::create(KIND_SHARED, 0, boot_id, stale_after_ns)
    }

    /// Creates a sealed tenant page of `slots` slots (1..=[`MAX_SLOTS`]) with this boot id.
    pub fn create_tenant_page(slots: u32, boot_id: u64) -> Result<Self, BlockError> {
        if slots == 0 {
            return Err(BlockError::Invalid(
                "a tenant page needs at least 1 slot".into(),
            ));
        }
        Self::create(KIND_TENANT, slots, boot_id, 0)
    }

    fn create(
        kind: u64,
        slots: u32,
        boot_id: u64,
        stale_after_ns: u64,
    ) -> Result<Self, BlockError> {
        if slots > MAX_SLOTS {
            return Err(BlockError::Invalid(format!(
                "{slots} slots, expected at most {MAX_SLOTS}"
            )));
        }
        let len = block_len(slots);
        let fd = rustix::fs::memfd_create(
            "justitia-control-block",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(sys("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(sys("ftruncate of the memfd"))?;
        let map = Mapping::map(fd.as_fd(), len, true).map_err(sys("mmap of the memfd"))?;
        // Sealed after the writable mapping exists: FUTURE_WRITE forbids new writable
        // mappings and write(2) but leaves this one working.
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL,
        )
        .map_err(sys("sealing the memfd"))?;
        let h = map.header();
        h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        h.kind.store(kind, Ordering::Relaxed);
        h.slots.store(u64::from(slots), Ordering::Relaxed);
        h.boot_id.store(boot_id, Ordering::Relaxed);
        h.stale_after_ns.store(stale_after_ns, Ordering::Relaxed);
        h.heartbeat_ns.store(monotonic_ns(), Ordering::Relaxed);
        // The magic last, released: a reader that sees it sees the rest.
        h.magic.store(MAGIC, Ordering::Release);
        Ok(BlockWriter { fd, map, slots })
    }

    /// The descriptor to pass to clients.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Stores the heartbeat.
    pub fn beat(&self, now_ns: u64) {
        self.map
            .header()
            .heartbeat_ns
            .store(now_ns, Ordering::Release);
    }

    /// Publishes the daemon-wide status.
    pub fn set_status(&self, status: BlockStatus) {
        let h = self.map.header();
        seq_write(&h.seq, || {
            h.safe_util.store(status.safe_util, Ordering::Relaxed);
            h.current_p99_ns
                .store(status.current_p99_ns, Ordering::Relaxed);
            h.target_p99_ns
                .store(status.target_p99_ns, Ordering::Relaxed);
            h.generation.store(status.generation, Ordering::Relaxed);
        });
    }

    /// Publishes the control-verb budget of each of the page's tenant's processes
    /// (`None`: not paced). Rates are stored in verbs per 1000 s, rounded down, so a
    /// rate below one verb per 1000 s is not paced.
    pub fn set_control_budget(&self, budget: Option<ControlVerbBudget>) {
        let h = self.map.header();
        let (per_ks, burst) = budget.map_or((0, 0), |b| {
            // `as` saturates: a rate past u64::MAX verbs per 1000 s is as good as unpaced.
            ((b.per_sec * 1e3) as u64, u64::from(b.burst.max(1)))
        });
        seq_write(&h.seq, || {
            h.control_verbs_per_ks.store(per_ks, Ordering::Relaxed);
            h.control_verb_burst.store(burst, Ordering::Relaxed);
        });
    }

    /// Publishes the QP turns of each of the page's tenant's processes (`None`: no
    /// turns).
    pub fn set_turn_budget(&self, budget: Option<TurnBudget>) {
        let h = self.map.header();
        let (open, bytes) = budget.map_or((0, 0), |b| {
            (
                u64::try_from(b.open.max(1)).unwrap_or(u64::MAX),
                b.turn_bytes.max(1),
            )
        });
        seq_write(&h.seq, || {
            h.qp_turns_open.store(open, Ordering::Relaxed);
            h.qp_turn_bytes.store(bytes, Ordering::Relaxed);
        });
    }

    /// Publishes a slot; returns false for an index out of range.
    pub fn set_slot(&self, index: u32, a: SlotAllotment) -> bool {
        let Some(s) = self.map.slot(index).filter(|_| index < self.slots) else {
            return false;
        };
        seq_write(&s.seq, || {
            s.flow.store(a.flow, Ordering::Relaxed);
            s.state.store(a.state as u64, Ordering::Relaxed);
            s.bytes_per_sec.store(a.bytes_per_sec, Ordering::Relaxed);
            s.ops_per_sec.store(a.ops_per_sec, Ordering::Relaxed);
            s.chunk_bytes.store(a.chunk_bytes, Ordering::Relaxed);
            s.token_bytes.store(a.token_bytes, Ordering::Relaxed);
            s.generation.store(a.generation, Ordering::Relaxed);
            s.phase_offset.store(a.phase_offset, Ordering::Relaxed);
            s.phase_epoch.store(a.phase_epoch, Ordering::Relaxed);
            for (word, value) in s.charge.iter().zip(a.charge.to_words()) {
                word.store(value, Ordering::Relaxed);
            }
        });
        true
    }

    /// Stores the bytes counted for the flow in slot `index`; returns false for an index
    /// out of range.
    pub fn set_usage(&self, index: u32, bytes: u64) -> bool {
        let Some(s) = self.map.slot(index).filter(|_| index < self.slots) else {
            return false;
        };
        s.usage_bytes.store(bytes, Ordering::Relaxed);
        true
    }

    /// Frees a slot.
    pub fn clear_slot(&self, index: u32) -> bool {
        self.set_usage(index, 0);
        self.set_slot(
            index,
            SlotAllotment {
                flow: 0,
                state: SlotState::Free,
                bytes_per_sec: 0,
                ops_per_sec: 0,
                chunk_bytes: 0,
                token_bytes: 0,
                generation: 0,
                phase_offset: 0,
                phase_epoch: 0,
                charge: MessageCharge::NONE,
            },
        )
    }

    /// Leaves slot `index` as a write in progress leaves it (its sequence word odd), so
    /// every read of it is torn: for tests of what readers do then.
    #[cfg(test)]
    pub(crate) fn tear_slot(&self, index: u32) {
        if let Some(s) = self.map.slot(index) {
            s.seq.fetch_or(1, Ordering::Release);
        }
    }

    /// A reader over the daemon's own mapping, for reports and tests.
    pub fn reader(&self) -> Result<BlockReader, BlockError> {
        BlockReader::map(self.fd.as_fd())
    }
}

/// Single-writer seqlock store: odd while writing, even when done.
fn seq_write(seq: &AtomicU64, write: impl FnOnce()) {
    let s = seq.load(Ordering::Relaxed);
    seq.store(s.wrapping_add(1), Ordering::Relaxed);
    // Orders the odd word before the field stores.
    fence(Ordering::Release);
    write();
    seq.store(s.wrapping_add(2), Ordering::Release);
}

/// Seqlock read: `None` when every attempt was torn.
fn seq_read<T>(seq: &AtomicU64, read: impl Fn() -> T) -> Option<T> {
    for _ in 0..READ_ATTEMPTS {
        let before = seq.load(Ordering::Acquire);
        if before & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let value = read();
        // Orders the field loads before the second load of the word.
        fence(Ordering::Acquire);
        if seq.load(Ordering::Relaxed) == before {
            return Some(value);
        }
    }
    None
}

/// A shaper's side: a read-only mapping of a block received from the daemon.
#[derive(Debug)]
pub struct BlockReader {
    map: Mapping,
    kind: u64,
    slots: u32,
    boot_id: u64,
    stale_after_ns: u64,
}

impl BlockReader {
    /// Maps the block behind `fd` read-only and checks its magic, version and size.
    pub fn map(fd: BorrowedFd<'_>) -> Result<Self, BlockError> {
        let stat = rustix::fs::fstat(fd).map_err(sys("fstat of the control block"))?;
        let len = usize::try_from(stat.st_size)
            .map_err(|_| BlockError::Invalid(format!("size {}", stat.st_size)))?;
        if len < block_len(0) || len > block_len(MAX_SLOTS) {
            return Err(BlockError::Invalid(format!(
                "size {len} bytes out of range"
            )));
        }
        let map = Mapping::map(fd, len, false).map_err(sys("mmap of the control block"))?;
        let h = map.header();
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(BlockError::Invalid("bad magic".into()));
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(BlockError::Version {
                found: version,
                known: LAYOUT_VERSION,
            });
        }
        let kind = h.kind.load(Ordering::Relaxed);
        if kind != KIND_SHARED && kind != KIND_TENANT {
            return Err(BlockError::Invalid(format!("unknown kind {kind}")));
        }
        let slots = h.slots.load(Ordering::Relaxed);
        if slots > u64::from(MAX_SLOTS) || block_len(slots as u32) > len {
            return Err(BlockError::Invalid(format!(
                "{slots} slots do not fit {len} bytes"
            )));
        }
        Ok(BlockReader {
            kind,
            slots: slots as u32,
            boot_id: h.boot_id.load(Ordering::Relaxed),
            stale_after_ns: h.stale_after_ns.load(Ordering::Relaxed),
            map,
        })
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// [`KIND_SHARED`] or [`KIND_TENANT`].
    pub fn kind(&self) -> u64 {
        self.kind
    }

    /// The bytes the daemon counted for the flow in slot `index`, `None` out of range.
    pub fn usage(&self, index: u32) -> Option<u64> {
        if index >= self.slots {
            return None;
        }
        Some(self.map.slot(index)?.usage_bytes.load(Ordering::Relaxed))
    }

    /// The boot id the block was created with.
    pub fn boot_id(&self) -> u64 {
        self.boot_id
    }

    /// The latest heartbeat (ns, `CLOCK_MONOTONIC`).
    pub fn heartbeat_ns(&self) -> u64 {
        self.map.header().heartbeat_ns.load(Ordering::Acquire)
    }

    /// The block's staleness limit (ns).
    pub fn stale_after_ns(&self) -> u64 {
        self.stale_after_ns
    }

    /// Whether the heartbeat is older than the block's staleness limit at `now_ns` read
    /// on the daemon's clock (a reader in another time namespace measures ages with
    /// the heartbeat's progress instead, as the agent client does).
    pub fn is_stale(&self, now_ns: u64) -> bool {
        now_ns.saturating_sub(self.heartbeat_ns()) > self.stale_after_ns
    }

    /// The daemon-wide status, `None` if every attempt was torn.
    pub fn status(&self) -> Option<BlockStatus> {
        let h = self.map.header();
        seq_read(&h.seq, || BlockStatus {
            safe_util: h.safe_util.load(Ordering::Relaxed),
            current_p99_ns: h.current_p99_ns.load(Ordering::Relaxed),
            target_p99_ns: h.target_p99_ns.load(Ordering::Relaxed),
            generation: h.generation.load(Ordering::Relaxed),
        })
    }

    /// The control-verb budget the daemon published for each of the tenant's processes,
    /// `None` when not paced (or torn on every attempt).
    pub fn control_budget(&self) -> Option<ControlVerbBudget> {
        let h = self.map.header();
        let (per_ks, burst) = seq_read(&h.seq, || {
            (
                h.control_verbs_per_ks.load(Ordering::Relaxed),
                h.control_verb_burst.load(Ordering::Relaxed),
            )
        })?;
        (per_ks > 0).then(|| ControlVerbBudget {
            per_sec: per_ks as f64 / 1e3,
            burst: u32::try_from(burst).unwrap_or(u32::MAX).max(1),
        })
    }

    /// The QP turns the daemon published for each of the tenant's processes, `None` when
    /// there are none (or torn on every attempt).
    pub fn turn_budget(&self) -> Option<TurnBudget> {
        let h = self.map.header();
        let (open, bytes) = seq_read(&h.seq, || {
            (
                h.qp_turns_open.load(Ordering::Relaxed),
                h.qp_turn_bytes.load(Ordering::Relaxed),
            )
        })?;
        (open > 0).then(|| TurnBudget {
            open: usize::try_from(open).unwrap_or(usize::MAX),
            turn_bytes: bytes.max(1),
        })
    }

    /// A slot's content, `None` when out of range, torn on every attempt, or holding a
    /// state word this reader does not know.
    pub fn slot(&self, index: u32) -> Option<SlotAllotment> {
        if index >= self.slots {
            return None;
        }
        let s = self.map.slot(index)?;
        let (a, state) = seq_read(&s.seq, || {
            let a = SlotAllotment {
                flow: s.flow.load(Ordering::Relaxed),
                state: SlotState::Free,
                bytes_per_sec: s.bytes_per_sec.load(Ordering::Relaxed),
                ops_per_sec: s.ops_per_sec.load(Ordering::Relaxed),
                chunk_bytes: s.chunk_bytes.load(Ordering::Relaxed),
                token_bytes: s.token_bytes.load(Ordering::Relaxed),
                generation: s.generation.load(Ordering::Relaxed),
                phase_offset: s.phase_offset.load(Ordering::Relaxed),
                phase_epoch: s.phase_epoch.load(Ordering::Relaxed),
                charge: MessageCharge::from_words(
                    s.charge.each_ref().map(|w| w.load(Ordering::Relaxed)),
                ),
            };
            (a, s.state.load(Ordering::Relaxed))
        })?;
        Some(SlotAllotment {
            state: SlotState::from_word(state)?,
            ..a
        })
    }
}

/// A fresh random boot id (never zero).
pub fn random_boot_id() -> u64 {
    let mut buf = [0u8; 8];
    // getrandom without flags blocks only before the kernel's pool is initialised at boot;
    // fall back to the clock mixed with the pid if it fails for any reason.
    match rustix::rand::getrandom(&mut buf, rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_le_bytes(buf) | 1,
        _ => (monotonic_ns() ^ (u64::from(std::process::id()) << 32)) | 1,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn allot(flow: u64, v: u64) -> SlotAllotment {
        SlotAllotment {
            flow,
            state: SlotState::Allotted,
            bytes_per_sec: v,
            ops_per_sec: v,
            chunk_bytes: v,
            token_bytes: v,
            generation: v,
            phase_offset: v,
            phase_epoch: v,
            charge: MessageCharge::NONE,
        }
    }

    #[test]
    fn the_shared_block_has_status_and_no_slots_and_a_tenant_page_has_slots_and_usage() {
        let shared = BlockWriter::create_shared(42, 5_000_000).unwrap();
        let r = shared.reader().unwrap();
        assert_eq!((r.kind(), r.slots(), r.boot_id()), (KIND_SHARED, 0, 42));
        assert_eq!(r.slot(0), None);
        shared.set_status(BlockStatus {
            safe_util: 9,
            ..BlockStatus::default()
        });
        assert_eq!(r.status().unwrap().safe_util, 9);
        let page = BlockWriter::create_tenant_page(2, 42).unwrap();
        let r = page.reader().unwrap();
        assert_eq!((r.kind(), r.slots(), r.boot_id()), (KIND_TENANT, 2, 42));
        assert!(page.set_slot(1, allot(7, 100)));
        assert!(page.set_usage(1, 4096));
        assert_eq!(r.slot(1), Some(allot(7, 100)));
        assert_eq!(r.usage(1), Some(4096));
        assert_eq!(r.usage(2), None);
        assert!(!page.set_usage(2, 1));
        assert!(page.clear_slot(1));
        assert_eq!(r.usage(1), Some(0));
        assert!(BlockWriter::create_tenant_page(0, 42).is_err());
    }

    #[test]
    fn the_turn_budget_makes_the_round_trip_beside_the_control_budget() {
        let page = BlockWriter::create_tenant_page(1, 42).unwrap();
        let r = page.reader().unwrap();
        assert_eq!(r.turn_budget(), None, "a new page has no turns");
        let t = TurnBudget {
            open: 96,
            turn_bytes: 8 << 20,
        };
        let c = ControlVerbBudget {
            per_sec: 10.0,
            burst: 4,
        };
        page.set_turn_budget(Some(t));
        page.set_control_budget(Some(c));
        assert_eq!((r.turn_budget(), r.control_budget()), (Some(t), Some(c)));
        page.set_turn_budget(None);
        assert_eq!((r.turn_budget(), r.control_budget()), (None, Some(c)));
    }

    #[test]
    fn the_control_verb_budget_makes_the_round_trip_and_zero_is_not_paced() {
        let page = BlockWriter::create_tenant_page(1, 42).unwrap();
        let r = page.reader().unwrap();
        assert_eq!(r.control_budget(), None, "a new page paces nothing");
        let b = ControlVerbBudget {
            per_sec: 333.5,
            burst: 16,
        };
        page.set_control_budget(Some(b));
        assert_eq!(r.control_budget(), Some(b));
        // Below one verb per 1000 s the stored rate is 0: not paced.
        page.set_control_budget(Some(ControlVerbBudget {
            per_sec: 0.0004,
            burst: 1,
        }));
        assert_eq!(r.control_budget(), None);
        page.set_control_budget(Some(b));
        page.set_control_budget(None);
        assert_eq!(r.control_budget(), None);
        // The status around it is untouched.
        page.set_status(BlockStatus {
            safe_util: 5,
            ..BlockStatus::default()
        });
        page.set_control_budget(Some(b));
        assert_eq!(
            (r.status().unwrap().safe_util, r.control_budget()),
            (5, Some(b))
        );
    }

    #[test]
    fn reader_sees_what_the_writer_published() {
        let w = BlockWriter::create(KIND_TENANT, 4, 42, 5_000_000).unwrap();
        let r = BlockReader::map(w.fd()).unwrap();
        assert_eq!((r.slots(), r.boot_id()), (4, 42));
        assert_eq!(r.slot(2).unwrap().state, SlotState::Free);
        assert!(w.set_slot(2, allot(7, 1234)));
        assert_eq!(r.slot(2), Some(allot(7, 1234)));
        assert!(!w.set_slot(4, allot(7, 1)), "slot 4 of 4 is out of range");
        assert_eq!(r.slot(4), None);
        w.set_status(BlockStatus {
            safe_util: 9,
            current_p99_ns: 8,
            target_p99_ns: 7,
            generation: 6,
        });
        assert_eq!(r.status().unwrap().current_p99_ns, 8);
    }

    /// The charge's words make the round trip beside the rest of the slot, and a freed
    /// slot charges the payload again.
    #[test]
    fn the_message_charge_makes_the_round_trip() {
        let w = BlockWriter::create(KIND_TENANT, 2, 1, 5_000_000).unwrap();
        let r = w.reader().unwrap();
        let a = SlotAllotment {
            charge: MessageCharge {
                least_bytes: 115,
                byte_cost: 4_149_100_479,
                packet_cost: 340_226_239_278,
                request_cost: 66_385_607_664,
                mtu_shift: 12,
            },
            ..allot(3, 100)
        };
        assert!(w.set_slot(1, a));
        assert_eq!(r.slot(1), Some(a));
        assert_eq!(r.slot(1).unwrap().charge.charged(64), 156);
        assert!(w.clear_slot(1));
        assert_eq!(r.slot(1).unwrap().charge, MessageCharge::NONE);
    }

    #[test]
    fn the_release_phase_makes_the_round_trip() {
        let w = BlockWriter::create(KIND_TENANT, 3, 1, 5_000_000).unwrap();
        let r = w.reader().unwrap();
        for (index, offset, epoch) in [(0u32, 0.0, 9u64), (1, 0.5, 9), (2, 2.0 / 3.0, u64::MAX)] {
            let a = SlotAllotment {
                phase_offset: phase_to_fixed(offset),
                phase_epoch: epoch,
                ..allot(u64::from(index) + 1, 100)
            };
            assert!(w.set_slot(index, a));
            let got = r.slot(index).unwrap();
            assert_eq!((got.phase_offset, got.phase_epoch), (a.phase_offset, epoch));
            let back = phase_from_fixed(got.phase_offset);
            assert!((back - offset).abs() < 1e-9, "{offset} came back as {back}");
        }
        // Exact halves are exact in the fixed point.
        assert_eq!(r.slot(1).unwrap().phase_offset, 1 << 31);
        // A freed slot holds no phase.
        assert!(w.clear_slot(1));
        let freed = r.slot(1).unwrap();
        assert_eq!((freed.phase_offset, freed.phase_epoch), (0, 0));
    }

    #[test]
    fn offsets_are_wrapped_into_one_interval() {
        assert_eq!(phase_to_fixed(0.25), 1 << 30);
        assert_eq!(phase_to_fixed(1.25), 1 << 30);
        assert_eq!(phase_to_fixed(-0.75), 1 << 30);
        assert_eq!(
            phase_to_fixed(1.0 - 1e-12),
            0,
            "a whole interval is offset 0"
        );
        assert_eq!(phase_to_fixed(f64::NAN), 0);
        assert_eq!(phase_to_fixed(f64::INFINITY), 0);
        assert!(phase_to_fixed(0.999_999) < PHASE_ONE);
        assert_eq!(phase_from_fixed(PHASE_ONE + (1 << 31)), 0.5);
    }

    #[test]
    fn a_block_of_another_layout_version_is_refused_by_version() {
        let w = BlockWriter::create(KIND_TENANT, 1, 1, 5_000_000).unwrap();
        // A daemon of layout 1 (64-byte slots without a phase).
        w.map.header().version.store(1, Ordering::Release);
        match BlockReader::map(w.fd()) {
            Err(BlockError::Version { found, known }) => assert_eq!((found, known), (1, 3)),
            other => panic!("expected a version refusal, got {other:?}"),
        }
        // Layout 2 kept every flow's slot in the one block every tenant mapped.
        w.map.header().version.store(2, Ordering::Release);
        assert!(matches!(
            BlockReader::map(w.fd()),
            Err(BlockError::Version { found: 2, .. })
        ));
        w.map
            .header()
            .version
            .store(LAYOUT_VERSION, Ordering::Release);
        assert!(BlockReader::map(w.fd()).is_ok());
    }

    #[test]
    fn heartbeat_goes_stale_after_the_limit() {
        let w = BlockWriter::create(KIND_TENANT, 1, 1, 1_000).unwrap();
        let r = w.reader().unwrap();
        w.beat(10_000);
        assert!(!r.is_stale(10_999));
        assert!(!r.is_stale(11_000));
        assert!(r.is_stale(11_001));
    }

    #[test]
    fn a_reader_cannot_map_the_block_writable_nor_write_it() {
        let w = BlockWriter::create(KIND_TENANT, 2, 1, 1).unwrap();
        let len = block_len(2);
        // SAFETY: a plain mmap attempt whose result is unmapped if it succeeds.
        let res = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                w.fd(),
                0,
            )
        };
        assert_eq!(res.err(), Some(rustix::io::Errno::PERM));
        assert_eq!(
            rustix::io::pwrite(w.fd(), &[1u8; 8], 0).err(),
            Some(rustix::io::Errno::PERM)
        );
        assert_eq!(
            rustix::fs::ftruncate(w.fd(), 1).err(),
            Some(rustix::io::Errno::PERM)
        );
        assert_eq!(
            rustix::fs::fcntl_add_seals(w.fd(), SealFlags::empty()).err(),
            Some(rustix::io::Errno::PERM),
            "F_SEAL_SEAL forbids changing the seals"
        );
        // A read-only mapping cannot be made writable afterwards either.
        let r = BlockReader::map(w.fd()).unwrap();
        // SAFETY: mprotect on our own live read-only mapping; expected to fail.
        let res = unsafe {
            rustix::mm::mprotect(
                r.map.ptr.as_ptr().cast(),
                r.map.len,
                rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE,
            )
        };
        assert!(res.is_err(), "mprotect to writable must fail");
    }

    #[test]
    fn a_descriptor_of_another_kind_is_refused() {
        let fd = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, block_len(1) as u64).unwrap();
        assert!(matches!(
            BlockReader::map(fd.as_fd()),
            Err(BlockError::Invalid(_))
        ));
        rustix::fs::ftruncate(&fd, 10).unwrap();
        assert!(matches!(
            BlockReader::map(fd.as_fd()),
            Err(BlockError::Invalid(_))
        ));
    }

    #[test]
    fn concurrent_reads_are_never_torn() {
        // Every field of a slot is written with the same value; a torn read would mix two.
        // The writer keeps writing until the reader has checked enough reads made while it
        // wrote, so that the two overlap however the threads are scheduled; only a reader
        // the writer starves for the writer's whole budget fails the count.
        const READS: u64 = 10_000;
        const WRITE_BUDGET: u64 = 50_000_000;
        let w = Arc::new(BlockWriter::create(KIND_TENANT, 1, 1, 1).unwrap());
        let r = w.reader().unwrap();
        let enough = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (w, enough) = (Arc::clone(&w), Arc::clone(&enough));
            std::thread::spawn(move || {
                let mut v = 1u64;
                while !enough.load(Ordering::Relaxed) && v < WRITE_BUDGET {
                    w.set_slot(0, allot(v, v));
                    v += 1;
                }
                v
            })
        };
        let mut seen = 0u64;
        while !writer.is_finished() {
            if let Some(a) = r.slot(0) {
                if a.state == SlotState::Allotted {
                    assert!(
                        [
                            a.bytes_per_sec,
                            a.ops_per_sec,
                            a.chunk_bytes,
                            a.token_bytes,
                            a.generation,
                            a.phase_offset,
                            a.phase_epoch
                        ]
                        .iter()
                        .all(|&x| x == a.flow),
                        "torn read {a:?}"
                    );
                    seen += 1;
                    if seen == READS {
                        enough.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
        let written = writer.join().unwrap();
        assert!(
            seen >= READS,
            "{seen} reads checked while the writer wrote {written} times"
        );
        let last = r.slot(0).unwrap();
        assert_eq!(
            last.flow,
            written - 1,
            "the last write is the one read after"
        );
    }
}
