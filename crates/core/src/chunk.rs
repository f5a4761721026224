//! Chunk planning: turning one work request into a sequence of smaller ones.
//!
//! A large message holds the RNIC for as long as it takes to send, and every small message
//! queued behind it waits (head-of-line blocking). Justitia's bandwidth shaper therefore
//! divides each message larger than a chunk into chunk-sized pieces so the RNIC only sees
//! roughly equal-sized messages, and paces them (Justitia §4.3; chunk sizes in §5.1). The
//! split is invisible to the application (§5.2): it sees one completion per signaled
//! request, after the whole message has landed. PeRF's preemption (PeRF §3.5.2, §4.1) splits
//! large messages into sub-messages the same way and interleaves yields between them
//! ([`crate::yield_plan`]).
//!
//! This module only computes chunks; posting them is the caller's job. The request is
//! modelled in plain Rust types ([`WorkRequest`]) independent of the verbs ABI, but [`Sge`]
//! has the memory layout of `struct ibv_sge`, and every list of SGEs is a fixed-capacity
//! array ([`SgeList`]), so splitting allocates nothing. A [`ChunkPlan`] owns its request and
//! hands out chunks one at a time, so a shaper can keep it in a queue and resume it as
//! tokens arrive.
//!
//! Invariants of a plan:
//! - the chunks cover the request's local byte stream exactly once, in order, each chunk
//!   holding at least one byte and at most the chunk size; zero-length SGEs are skipped;
//! - a chunk has its own SGE list, sub-ranges of the original SGEs, never more than the SGE
//!   limit: a chunk that would need more is cut short at an SGE boundary;
//! - one-sided chunks (WRITE, READ) address `remote_addr + offset`, where `offset` counts the
//!   request's bytes before the chunk (for a READ the local SGEs are the destination);
//! - only the last chunk carries the original `wr_id`, the signaled and solicited flags and
//!   the immediate data (earlier chunks of a `*_WITH_IMM` request use the plain opcode and
//!   `wr_id` 0), and only the first chunk carries the fence;
//! - atomics, inline requests, requests no larger than one chunk and two-sided requests whose
//!   peer does not cooperate are not split: their plan is the request itself.

use std::fmt;
use std::iter::FusedIterator;
use std::ops::Deref;

/// The most SGEs a work request or chunk can hold. Common providers cap a QP's send SGEs
/// at about this (mlx5 30, rxe 32); a request with more is refused
/// ([`ChunkError::TooManySges`]), and a shaper can pass it through unsplit.
pub const MAX_SGES: usize = 32;

/// One scatter/gather element: a range of registered local memory.
///
/// The layout is that of `struct ibv_sge`, so a slice of chunk SGEs can be handed to the
/// verbs layer without copying field by field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sge {
    /// Start address of the range in the local address space.
    pub addr: u64,
    /// Length of the range in bytes.
    pub length: u32,
    /// Local key of the memory region holding the range.
    pub lkey: u32,
}

/// A list of at most [`MAX_SGES`] SGEs, stored inline so building one never allocates.
#[derive(Clone, Copy)]
pub struct SgeList {
    len: usize,
    items: [Sge; MAX_SGES],
}

impl SgeList {
    /// An empty list.
    pub const fn new() -> Self {
        SgeList {
            len: 0,
            items: [Sge {
                addr: 0,
                length: 0,
                lkey: 0,
            }; MAX_SGES],
        }
    }

    /// Appends an SGE, refusing the one past [`MAX_SGES`].
    pub fn push(&mut self, sge: Sge) -> Result<(), ChunkError> {
        let slot = self
            .items
            .get_mut(self.len)
            .ok_or(ChunkError::TooManySges {
                count: self.len + 1,
            })?;
        *slot = sge;
        self.len += 1;
        Ok(())
    }

    /// The SGEs, in order.
    pub fn as_slice(&self) -> &[Sge] {
        &self.items[..self.len]
    }

    /// Sum of the SGE lengths. Cannot overflow: at most 32 lengths of at most `u32::MAX`.
    pub fn total_bytes(&self) -> u64 {
        self.iter().map(|sge| u64::from(sge.length)).sum()
    }
}

impl Default for SgeList {
    fn default() -> Self {
        SgeList::new()
    }
}

impl Deref for SgeList {
    type Target = [Sge];

    fn deref(&self) -> &[Sge] {
        self.as_slice()
    }
}

impl PartialEq for SgeList {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for SgeList {}

impl fmt::Debug for SgeList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl TryFrom<&[Sge]> for SgeList {
    type Error = ChunkError;

    fn try_from(sges: &[Sge]) -> Result<Self, Self::Error> {
        let mut list = SgeList::new();
        list.items
            .get_mut(..sges.len())
            .ok_or(ChunkError::TooManySges { count: sges.len() })?
            .copy_from_slice(sges);
        list.len = sges.len();
        Ok(list)
    }
}

/// What a work request asks the RNIC to do, with the operands that only some opcodes have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// RDMA WRITE: local SGEs to remote memory.
    Write,
    /// RDMA WRITE that also consumes a receive at the peer and delivers `imm` with it.
    WriteWithImm {
        /// Immediate data, passed through as given (verbs keeps it in network byte order).
        imm: u32,
    },
    /// RDMA READ: remote memory into the local SGEs.
    Read,
    /// SEND: local SGEs into a receive buffer the peer posted.
    Send,
    /// SEND that also delivers `imm` with the receive completion.
    SendWithImm {
        /// Immediate data, passed through as given.
        imm: u32,
    },
    /// 64-bit compare-and-swap on remote memory.
    AtomicCmpAndSwp {
        /// Value expected at the remote address.
        compare: u64,
        /// Value written if the comparison holds.
        swap: u64,
    },
    /// 64-bit fetch-and-add on remote memory.
    AtomicFetchAndAdd {
        /// Value added to the remote word.
        add: u64,
    },
}

impl Opcode {
    /// True for the opcodes that address remote memory (WRITE, READ, atomics) and so need
    /// a remote address and rkey.
    pub fn is_one_sided(self) -> bool {
        !matches!(self, Opcode::Send | Opcode::SendWithImm { .. })
    }

    /// True for the two atomics, which act on one 8-byte word and are never split.
    pub fn is_atomic(self) -> bool {
        matches!(
            self,
            Opcode::AtomicCmpAndSwp { .. } | Opcode::AtomicFetchAndAdd { .. }
        )
    }

    /// The immediate data, for the `*_WITH_IMM` opcodes.
    pub fn imm(self) -> Option<u32> {
        match self {
            Opcode::WriteWithImm { imm } | Opcode::SendWithImm { imm } => Some(imm),
            _ => None,
        }
    }

    /// The same operation without immediate data (WRITE_WITH_IMM becomes WRITE,
    /// SEND_WITH_IMM becomes SEND); other opcodes are returned unchanged.
    pub fn without_imm(self) -> Opcode {
        match self {
            Opcode::WriteWithImm { .. } => Opcode::Write,
            Opcode::SendWithImm { .. } => Opcode::Send,
            other => other,
        }
    }

    /// The verbs name of the opcode (`IBV_WR_` without the prefix).
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Write => "RDMA_WRITE",
            Opcode::WriteWithImm { .. } => "RDMA_WRITE_WITH_IMM",
            Opcode::Read => "RDMA_READ",
            Opcode::Send => "SEND",
            Opcode::SendWithImm { .. } => "SEND_WITH_IMM",
            Opcode::AtomicCmpAndSwp { .. } => "ATOMIC_CMP_AND_SWP",
            Opcode::AtomicFetchAndAdd { .. } => "ATOMIC_FETCH_AND_ADD",
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The remote side of a one-sided operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Remote key of the peer's memory region.
    pub rkey: u32,
}

/// The send flags of a work request that the chunk rules care about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SendFlags {
    /// A completion is generated when the request finishes.
    pub signaled: bool,
    /// The request waits for earlier READs and atomics on the QP to finish.
    pub fence: bool,
    /// The receive completion at the peer raises a solicited event.
    pub solicited: bool,
    /// The payload is copied into the work queue entry at post time.
    pub inline: bool,
}

/// One work request, as posted by an application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// The application's identifier, returned in the request's completion.
    pub wr_id: u64,
    /// The operation and its operands.
    pub opcode: Opcode,
    /// Local memory: the source of a WRITE or SEND, the destination of a READ.
    pub sges: SgeList,
    /// Remote memory; required for one-sided opcodes, passed through untouched otherwise.
    pub remote: Option<RemoteAddr>,
    /// Send flags.
    pub flags: SendFlags,
}

impl WorkRequest {
    /// The request that carries one chunk of this one, whose scatter list and remote
    /// address are `sges` and `remote`: the application's id, immediate data, signalling and
    /// solicited event go with the last chunk only and its fence with the first, so the
    /// application hears of the request once, when it has all gone; only a request that
    /// goes as one chunk stays inline.
    pub fn chunk_request(
        &self,
        sges: SgeList,
        remote: Option<RemoteAddr>,
        first: bool,
        is_last: bool,
    ) -> WorkRequest {
        WorkRequest {
            wr_id: if is_last { self.wr_id } else { 0 },
            opcode: if is_last {
                self.opcode
            } else {
                self.opcode.without_imm()
            },
            sges,
            remote,
            flags: SendFlags {
                signaled: is_last && self.flags.signaled,
                fence: first && self.flags.fence,
                solicited: is_last && self.flags.solicited,
                inline: first && is_last && self.flags.inline,
            },
        }
    }

    /// Checks the request and returns its length in bytes.
    ///
    /// The length must fit the 32-bit byte count of a verbs message, no SGE may run past the
    /// end of the local address space, and a one-sided request needs a remote range that
    /// does not run past the end of the remote address space.
    pub fn validated_len(&self) -> Result<u32, ChunkError> {
        let total = self.sges.total_bytes();
        let len = u32::try_from(total).map_err(|_| ChunkError::LengthOverflow { total })?;
        for (index, sge) in self.sges.iter().enumerate() {
            if last_byte(sge.addr, u64::from(sge.length)).is_none() {
                return Err(ChunkError::LocalAddressOverflow {
                    index,
                    addr: sge.addr,
                    length: sge.length,
                });
            }
        }
        if self.opcode.is_one_sided() {
            let remote = self.remote.ok_or(ChunkError::MissingRemote {
                opcode: self.opcode,
            })?;
            if last_byte(remote.addr, total).is_none() {
                return Err(ChunkError::RemoteAddressOverflow {
                    addr: remote.addr,
                    length: len,
                });
            }
        }
        Ok(len)
    }
}

/// The address of the last byte of a range, `None` if the range wraps around the address
/// space. An empty range never wraps.
fn last_byte(addr: u64, length: u64) -> Option<u64> {
    addr.checked_add(length.saturating_sub(1))
}

/// How a request may be split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkLimits {
    /// Largest chunk in bytes (Justitia's TokenBytes, PeRF's SUB_MSG_SIZE). At least 1.
    pub chunk_bytes: u32,
    /// Most SGEs one chunk may use (the QP's `max_send_sge`). At least 1; values above
    /// [`MAX_SGES`] act as [`MAX_SGES`].
    pub max_sge: usize,
    /// The peer has agreed to receive a SEND in pieces (it posts a receive per chunk).
    /// Without that agreement two-sided requests are never split.
    pub split_two_sided: bool,
}

/// Why a plan is the request itself rather than a split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WholeReason {
    /// Atomics act on a single word.
    Atomic,
    /// The payload is copied at post time, and inline sizes are tiny anyway.
    Inline,
    /// A split SEND would consume several receives at a peer that expects one.
    TwoSidedWithoutPeer,
    /// The request is no larger than one chunk.
    FitsOneChunk,
}

/// Why a request could not be planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// The chunk size is zero.
    #[error("chunk size must be at least 1 byte")]
    ZeroChunkSize,
    /// The SGE limit is zero.
    #[error("SGE limit must allow at least 1 SGE per chunk")]
    ZeroMaxSge,
    /// More SGEs than an [`SgeList`] holds.
    #[error("work request has {count} SGEs, more than the {MAX_SGES} supported")]
    TooManySges {
        /// How many SGEs were offered.
        count: usize,
    },
    /// The SGE lengths add up to more than a verbs message can carry.
    #[error("SGE lengths add up to {total} bytes, more than the {max} a work request can carry", max = u32::MAX)]
    LengthOverflow {
        /// The sum of the SGE lengths.
        total: u64,
    },
    /// A one-sided request has no remote address and rkey.
    #[error("{opcode} needs a remote address and rkey")]
    MissingRemote {
        /// The request's opcode.
        opcode: Opcode,
    },
    /// An SGE runs past the end of the local address space.
    #[error(
        "SGE {index} at {addr:#x} with length {length} runs past the end of the address space"
    )]
    LocalAddressOverflow {
        /// Position of the SGE in the request.
        index: usize,
        /// Its start address.
        addr: u64,
        /// Its length.
        length: u32,
    },
    /// The remote range runs past the end of the remote address space.
    #[error(
        "remote range at {addr:#x} with length {length} runs past the end of the address space"
    )]
    RemoteAddressOverflow {
        /// The remote start address.
        addr: u64,
        /// The request's length.
        length: u32,
    },
}

/// One piece of a planned request, ready to post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The work request to post for this piece.
    pub request: WorkRequest,
    /// Position of the chunk in its plan, from 0.
    pub index: u32,
    /// Bytes of the original request before this chunk.
    pub offset: u32,
    /// True for the chunk that completes the original request.
    pub is_last: bool,
}

/// The chunks of one work request, handed out in order by [`Iterator::next`].
///
/// A plan either splits the request or is the request itself ([`ChunkPlan::whole_reason`]
/// says which); in the second case it yields exactly one chunk, the unchanged request.
#[derive(Clone, Debug)]
pub struct ChunkPlan {
    request: WorkRequest,
    whole: Option<WholeReason>,
    chunk_bytes: u32,
    max_sge: usize,
    len: u32,
    /// SGE of the original request the next chunk starts in.
    sge_index: usize,
    /// Bytes of that SGE already planned.
    sge_offset: u32,
    /// Bytes of the request already planned.
    planned: u32,
    next_index: u32,
    done: bool,
}

impl ChunkPlan {
    /// Plans `request` under `limits`, checking both.
    pub fn new(request: WorkRequest, limits: ChunkLimits) -> Result<Self, ChunkError> {
        if limits.chunk_bytes == 0 {
            return Err(ChunkError::ZeroChunkSize);
        }
        if limits.max_sge == 0 {
            return Err(ChunkError::ZeroMaxSge);
        }
        let len = request.validated_len()?;
        let whole = if request.opcode.is_atomic() {
            Some(WholeReason::Atomic)
        } else if request.flags.inline {
            Some(WholeReason::Inline)
        } else if !request.opcode.is_one_sided() && !limits.split_two_sided {
            Some(WholeReason::TwoSidedWithoutPeer)
        } else if len <= limits.chunk_bytes {
            Some(WholeReason::FitsOneChunk)
        } else {
            None
        };
        Ok(ChunkPlan {
            request,
            whole,
            chunk_bytes: limits.chunk_bytes,
            max_sge: limits.max_sge.min(MAX_SGES),
            len,
            sge_index: 0,
            sge_offset: 0,
            planned: 0,
            next_index: 0,
            done: false,
        })
    }

    /// Why the plan is the request itself, or `None` if it splits the request.
    pub fn whole_reason(&self) -> Option<WholeReason> {
        self.whole
    }

    /// True if the request is split into two or more chunks.
    pub fn is_split(&self) -> bool {
        self.whole.is_none()
    }

    /// The original request.
    pub fn request(&self) -> &WorkRequest {
        &self.request
    }

    /// Length of the original request in bytes.
    pub fn len_bytes(&self) -> u32 {
        self.len
    }

    /// Bytes not yet handed out in a chunk.
    pub fn remaining_bytes(&self) -> u32 {
        if self.done {
            0
        } else {
            self.len - self.planned
        }
    }

    /// Builds the next chunk of a split request.
    fn next_split(&mut self) -> Option<Chunk> {
        let offset = self.planned;
        let mut budget = self.chunk_bytes.min(self.len - offset);
        let mut sges = SgeList::new();
        while budget > 0 && sges.len() < self.max_sge {
            let Some(&sge) = self.request.sges.get(self.sge_index) else {
                break;
            };
            let left = sge.length - self.sge_offset;
            if left == 0 {
                self.sge_index += 1;
                self.sge_offset = 0;
                continue;
            }
            let take = left.min(budget);
            // Cannot wrap: validated_len checked that the SGE's last byte is addressable.
            let piece = Sge {
                addr: sge.addr + u64::from(self.sge_offset),
                length: take,
                lkey: sge.lkey,
            };
            if sges.push(piece).is_err() {
                break;
            }
            self.sge_offset += take;
            budget -= take;
        }
        let taken: u32 = sges.iter().map(|sge| sge.length).sum();
        if taken == 0 {
            // Unreachable while the SGE lengths add up to `len`; stop rather than loop.
            self.done = true;
            return None;
        }
        self.planned += taken;
        let is_last = self.planned == self.len;
        let first = self.next_index == 0;
        let original = &self.request;
        let remote = match original.remote {
            Some(remote) if original.opcode.is_one_sided() => Some(RemoteAddr {
                // Cannot wrap: validated_len checked the remote range's last byte.
                addr: remote.addr + u64::from(offset),
                rkey: remote.rkey,
            }),
            other => other,
        };
        let chunk = Chunk {
            // Inline requests are never split: each chunk here goes from memory.
            request: original.chunk_request(sges, remote, first, is_last),
            index: self.next_index,
            offset,
            is_last,
        };
        self.next_index += 1;
        self.done = is_last;
        Some(chunk)
    }
}

impl Iterator for ChunkPlan {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        if self.done {
            return None;
        }
        if self.whole.is_some() {
            self.done = true;
            return Some(Chunk {
                request: self.request,
                index: 0,
                offset: 0,
                is_last: true,
            });
        }
        self.next_split()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.done {
            return (0, Some(0));
        }
        if self.whole.is_some() {
            return (1, Some(1));
        }
        // Every chunk holds at least one byte and at most chunk_bytes.
        let remaining = self.len - self.planned;
        let at_least = remaining.div_ceil(self.chunk_bytes);
        (
            usize::try_from(at_least).unwrap_or(usize::MAX),
            usize::try_from(remaining).ok(),
        )
    }
}

impl FusedIterator for ChunkPlan {}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const REMOTE: RemoteAddr = RemoteAddr {
        addr: 0x7000_0000,
        rkey: 0x55,
    };

    fn sge(addr: u64, length: u32) -> Sge {
        Sge {
            addr,
            length,
            lkey: 9,
        }
    }

    fn request(opcode: Opcode, sges: &[Sge]) -> WorkRequest {
        WorkRequest {
            wr_id: 42,
            opcode,
            sges: SgeList::try_from(sges).unwrap(),
            remote: opcode.is_one_sided().then_some(REMOTE),
            flags: SendFlags {
                signaled: true,
                fence: true,
                solicited: true,
                inline: false,
            },
        }
    }

    fn limits(chunk_bytes: u32, max_sge: usize) -> ChunkLimits {
        ChunkLimits {
            chunk_bytes,
            max_sge,
            split_two_sided: false,
        }
    }

    fn chunks(request: WorkRequest, limits: ChunkLimits) -> Vec<Chunk> {
        ChunkPlan::new(request, limits).unwrap().collect()
    }

    /// The list refuses the SGE past the 32nd and says how many were offered; two lists
    /// are equal only with the same SGEs; it prints as its SGEs.
    #[test]
    fn an_sge_list_holds_at_most_max_sges_and_compares_and_prints_its_items() {
        let mut list = SgeList::new();
        for i in 0..MAX_SGES {
            list.push(sge(i as u64 * 64, 64)).unwrap();
        }
        assert_eq!(
            list.push(sge(0, 1)),
            Err(ChunkError::TooManySges {
                count: MAX_SGES + 1
            })
        );
        let one = SgeList::try_from(&[sge(0x1000, 8)][..]).unwrap();
        let other = SgeList::try_from(&[sge(0x2000, 8)][..]).unwrap();
        assert_ne!(one, other);
        assert_eq!(one, SgeList::try_from(&[sge(0x1000, 8)][..]).unwrap());
        assert_eq!(
            format!("{one:?}"),
            "[Sge { addr: 4096, length: 8, lkey: 9 }]"
        );
    }

    /// Opcodes print as their verbs names, `IBV_WR_` left off.
    #[test]
    fn opcodes_print_their_verbs_names() {
        let names: Vec<String> = [
            Opcode::Write,
            Opcode::WriteWithImm { imm: 1 },
            Opcode::Read,
            Opcode::Send,
            Opcode::SendWithImm { imm: 1 },
        ]
        .iter()
        .map(|o| o.to_string())
        .collect();
        assert_eq!(
            names,
            [
                "RDMA_WRITE",
                "RDMA_WRITE_WITH_IMM",
                "RDMA_READ",
                "SEND",
                "SEND_WITH_IMM"
            ]
        );
    }

    /// A plan says whether it splits: 3000 B in 1000 B chunks does, 800 B does not.
    /// A split SEND's remote fields, if a caller left any, go through untouched: only a
    /// one-sided request's remote address moves with each chunk's offset.
    #[test]
    fn a_split_sends_remote_fields_are_not_offset() {
        let mut req = request(Opcode::Send, &[sge(0, 3000)]);
        req.remote = Some(REMOTE);
        let got = chunks(
            req,
            ChunkLimits {
                split_two_sided: true,
                ..limits(1000, 1)
            },
        );
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|c| c.request.remote == Some(REMOTE)));
    }

    #[test]
    fn a_plan_says_whether_it_splits() {
        let split = ChunkPlan::new(request(Opcode::Write, &[sge(0, 3000)]), limits(1000, 1));
        assert!(split.unwrap().is_split());
        let whole = ChunkPlan::new(request(Opcode::Write, &[sge(0, 800)]), limits(1000, 1));
        assert!(!whole.unwrap().is_split());
    }

    #[test]
    fn write_is_split_into_chunk_sized_pieces_with_remote_offsets() {
        let got = chunks(
            request(Opcode::Write, &[sge(0x1000, 12_000)]),
            limits(5120, 4),
        );
        let lens: Vec<u32> = got
            .iter()
            .map(|c| c.request.sges.total_bytes() as u32)
            .collect();
        assert_eq!(lens, [5120, 5120, 1760]);
        let remotes: Vec<u64> = got.iter().map(|c| c.request.remote.unwrap().addr).collect();
        assert_eq!(
            remotes,
            [REMOTE.addr, REMOTE.addr + 5120, REMOTE.addr + 10_240]
        );
        assert!(got
            .iter()
            .all(|c| c.request.remote.unwrap().rkey == REMOTE.rkey));
        assert_eq!(got[1].request.sges[0], sge(0x1000 + 5120, 5120));
        assert_eq!(got.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn only_last_chunk_carries_wr_id_signaled_and_solicited_and_first_carries_fence() {
        let got = chunks(request(Opcode::Write, &[sge(0, 3000)]), limits(1000, 1));
        assert_eq!(got.len(), 3);
        for (i, chunk) in got.iter().enumerate() {
            let last = i == 2;
            assert_eq!(chunk.is_last, last);
            assert_eq!(chunk.request.wr_id, if last { 42 } else { 0 });
            assert_eq!(chunk.request.flags.signaled, last);
            assert_eq!(chunk.request.flags.solicited, last);
            assert_eq!(chunk.request.flags.fence, i == 0);
            assert!(!chunk.request.flags.inline);
        }
    }

    #[test]
    fn unsignaled_request_stays_unsignaled_on_every_chunk() {
        let mut req = request(Opcode::Write, &[sge(0, 3000)]);
        req.flags.signaled = false;
        assert!(chunks(req, limits(1000, 1))
            .iter()
            .all(|c| !c.request.flags.signaled));
    }

    #[test]
    fn write_with_imm_becomes_plain_write_except_on_last_chunk() {
        let got = chunks(
            request(Opcode::WriteWithImm { imm: 7 }, &[sge(0, 2500)]),
            limits(1000, 1),
        );
        let ops: Vec<Opcode> = got.iter().map(|c| c.request.opcode).collect();
        assert_eq!(
            ops,
            [
                Opcode::Write,
                Opcode::Write,
                Opcode::WriteWithImm { imm: 7 }
            ]
        );
        assert_eq!(got[2].request.opcode.imm(), Some(7));
    }

    #[test]
    fn read_splits_local_destination_and_remote_source_alike() {
        let got = chunks(
            request(Opcode::Read, &[sge(0x10, 1500), sge(0x9000, 1500)]),
            limits(1000, 2),
        );
        assert!(got.iter().all(|c| c.request.opcode == Opcode::Read));
        assert_eq!(
            got[1].request.sges.as_slice(),
            [sge(0x10 + 1000, 500), sge(0x9000, 500)]
        );
        assert_eq!(got[1].request.remote.unwrap().addr, REMOTE.addr + 1000);
        assert_eq!(got[2].request.sges.as_slice(), [sge(0x9000 + 500, 1000)]);
    }

    #[test]
    fn send_is_not_split_unless_peer_cooperates() {
        let req = request(Opcode::Send, &[sge(0, 4000)]);
        let plan = ChunkPlan::new(req, limits(1000, 1)).unwrap();
        assert_eq!(plan.whole_reason(), Some(WholeReason::TwoSidedWithoutPeer));
        assert_eq!(plan.collect::<Vec<_>>().len(), 1);

        let cooperating = ChunkLimits {
            split_two_sided: true,
            ..limits(1000, 1)
        };
        let got = chunks(req, cooperating);
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|c| c.request.opcode == Opcode::Send));
        assert!(got.iter().all(|c| c.request.remote.is_none()));
    }

    #[test]
    fn send_with_imm_splits_into_sends_and_ends_with_the_imm() {
        let cooperating = ChunkLimits {
            split_two_sided: true,
            ..limits(1000, 1)
        };
        let got = chunks(
            request(Opcode::SendWithImm { imm: 3 }, &[sge(0, 2000)]),
            cooperating,
        );
        let ops: Vec<Opcode> = got.iter().map(|c| c.request.opcode).collect();
        assert_eq!(ops, [Opcode::Send, Opcode::SendWithImm { imm: 3 }]);
    }

    #[test]
    fn atomics_are_never_split() {
        for opcode in [
            Opcode::AtomicCmpAndSwp {
                compare: 1,
                swap: 2,
            },
            Opcode::AtomicFetchAndAdd { add: 5 },
        ] {
            let req = request(opcode, &[sge(0, 8)]);
            let plan = ChunkPlan::new(req, limits(1, 1)).unwrap();
            assert_eq!(plan.whole_reason(), Some(WholeReason::Atomic));
            let got: Vec<Chunk> = plan.collect();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].request, req);
        }
    }

    #[test]
    fn inline_requests_are_never_split() {
        let mut req = request(Opcode::Write, &[sge(0, 200)]);
        req.flags.inline = true;
        let plan = ChunkPlan::new(req, limits(64, 1)).unwrap();
        assert_eq!(plan.whole_reason(), Some(WholeReason::Inline));
        assert_eq!(plan.map(|c| c.request).collect::<Vec<_>>(), [req]);
    }

    #[test]
    fn request_no_larger_than_a_chunk_is_the_plan_itself() {
        let req = request(
            Opcode::WriteWithImm { imm: 1 },
            &[sge(0, 600), sge(0x5000, 400)],
        );
        let plan = ChunkPlan::new(req, limits(1000, 1)).unwrap();
        assert_eq!(plan.whole_reason(), Some(WholeReason::FitsOneChunk));
        assert!(!plan.is_split());
        let got: Vec<Chunk> = plan.collect();
        assert_eq!(
            got,
            [Chunk {
                request: req,
                index: 0,
                offset: 0,
                is_last: true
            }]
        );
    }

    #[test]
    fn zero_length_request_is_one_unsplit_chunk() {
        let req = request(Opcode::Write, &[]);
        let plan = ChunkPlan::new(req, limits(1, 1)).unwrap();
        assert_eq!(plan.whole_reason(), Some(WholeReason::FitsOneChunk));
        assert_eq!(plan.count(), 1);
    }

    #[test]
    fn chunk_spans_sges_and_skips_zero_length_ones() {
        let got = chunks(
            request(
                Opcode::Write,
                &[
                    sge(0x100, 300),
                    sge(0x999, 0),
                    sge(0x200, 300),
                    sge(0x300, 400),
                ],
            ),
            limits(500, 4),
        );
        assert_eq!(
            got[0].request.sges.as_slice(),
            [sge(0x100, 300), sge(0x200, 200)]
        );
        assert_eq!(
            got[1].request.sges.as_slice(),
            [sge(0x200 + 200, 100), sge(0x300, 400)]
        );
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn chunk_needing_too_many_sges_is_cut_at_an_sge_boundary() {
        let many: Vec<Sge> = (0..6).map(|i| sge(i * 0x1000, 100)).collect();
        let got = chunks(request(Opcode::Write, &many), limits(500, 2));
        let lens: Vec<u64> = got.iter().map(|c| c.request.sges.total_bytes()).collect();
        assert_eq!(lens, [200, 200, 200]);
        assert!(got.iter().all(|c| c.request.sges.len() == 2));
        assert_eq!(got[1].request.remote.unwrap().addr, REMOTE.addr + 200);
    }

    #[test]
    fn sge_limit_above_capacity_acts_as_capacity() {
        let many: Vec<Sge> = (0..MAX_SGES as u64).map(|i| sge(i * 0x1000, 1)).collect();
        let got = chunks(request(Opcode::Write, &many), limits(8, usize::MAX));
        assert_eq!(got.len(), MAX_SGES / 8);
    }

    #[test]
    fn remaining_bytes_and_size_hint_track_progress() {
        let mut plan =
            ChunkPlan::new(request(Opcode::Write, &[sge(0, 2500)]), limits(1000, 1)).unwrap();
        assert_eq!(plan.len_bytes(), 2500);
        assert_eq!(plan.size_hint().0, 3);
        plan.next();
        assert_eq!(plan.remaining_bytes(), 1500);
        assert_eq!(plan.size_hint(), (2, Some(1500)));
        assert_eq!(plan.by_ref().count(), 2);
        assert_eq!(plan.remaining_bytes(), 0);
        assert_eq!(plan.next(), None);
    }

    #[test]
    fn invalid_limits_are_errors() {
        let req = request(Opcode::Write, &[sge(0, 10)]);
        assert_eq!(
            ChunkPlan::new(req, limits(0, 1)).err(),
            Some(ChunkError::ZeroChunkSize)
        );
        assert_eq!(
            ChunkPlan::new(req, limits(1, 0)).err(),
            Some(ChunkError::ZeroMaxSge)
        );
    }

    #[test]
    fn one_sided_without_remote_is_an_error() {
        for opcode in [
            Opcode::Write,
            Opcode::Read,
            Opcode::AtomicFetchAndAdd { add: 1 },
        ] {
            let mut req = request(opcode, &[sge(0, 10)]);
            req.remote = None;
            let err = ChunkPlan::new(req, limits(4, 1)).err();
            assert_eq!(err, Some(ChunkError::MissingRemote { opcode }));
            assert!(err.unwrap().to_string().contains(opcode.name()));
        }
    }

    #[test]
    fn total_length_overflow_is_an_error() {
        let req = request(Opcode::Write, &[sge(0, u32::MAX), sge(0, 1)]);
        assert_eq!(
            ChunkPlan::new(req, limits(4096, 2)).err(),
            Some(ChunkError::LengthOverflow {
                total: u64::from(u32::MAX) + 1
            })
        );
    }

    #[test]
    fn address_ranges_that_wrap_are_errors() {
        let req = request(Opcode::Write, &[sge(u64::MAX - 5, 10)]);
        assert!(matches!(
            ChunkPlan::new(req, limits(4, 1)),
            Err(ChunkError::LocalAddressOverflow { index: 0, .. })
        ));
        let mut req = request(Opcode::Write, &[sge(0, 10)]);
        req.remote = Some(RemoteAddr {
            addr: u64::MAX - 5,
            rkey: 1,
        });
        assert!(matches!(
            ChunkPlan::new(req, limits(4, 1)),
            Err(ChunkError::RemoteAddressOverflow { .. })
        ));
        // A range ending on the very last byte is fine.
        let req = request(Opcode::Write, &[sge(u64::MAX - 9, 10)]);
        assert!(ChunkPlan::new(req, limits(4, 1)).is_ok());
    }

    #[test]
    fn sge_list_refuses_more_than_capacity() {
        let many = vec![sge(0, 1); MAX_SGES + 1];
        assert_eq!(
            SgeList::try_from(many.as_slice()).err(),
            Some(ChunkError::TooManySges {
                count: MAX_SGES + 1
            })
        );
        let mut list = SgeList::try_from(&many[..MAX_SGES]).unwrap();
        assert_eq!(list.len(), MAX_SGES);
        assert!(list.push(sge(0, 1)).is_err());
    }

    #[test]
    fn sge_has_the_ibv_sge_layout() {
        assert_eq!(std::mem::size_of::<Sge>(), 16);
        assert_eq!(std::mem::align_of::<Sge>(), 8);
    }

    /// A WRITE of u32::MAX bytes (4 GiB less one) cut at 1 MiB is 4095 whole chunks and a
    /// last one of 1 MiB less one byte: the bytes left, `len - offset`, never overflow
    /// (their sum with the offset does, past 2 GiB).
    #[test]
    fn a_request_of_4_gib_less_one_is_4095_whole_1_mib_chunks_and_one_short() {
        let write = request(Opcode::Write, &[sge(0x1000, u32::MAX)]);
        let lens: Vec<u32> = chunks(write, limits(1 << 20, 1))
            .iter()
            .map(|c| c.request.sges.total_bytes() as u32)
            .collect();
        assert_eq!(lens.len(), 4096);
        assert!(
            lens[..4095].iter().all(|&l| l == 1 << 20),
            "whole 1 MiB chunks"
        );
        assert_eq!(lens[4095], (1 << 20) - 1);
    }
}
