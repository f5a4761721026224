//! Seeded random batches of transfers: what to post, where its bytes live and what must
//! come back. Pure: no verbs, so the layouts themselves are unit-tested.

use rand_core::{Rng, SeedableRng};
use rand_pcg::Pcg64Mcg;

/// Untouched bytes kept on each side of every destination range, checked after the
/// transfer to catch a chunk that overran its place.
pub const GUARD: usize = 64;

/// Room in each region beyond the largest transfer, for the guards and random offsets of
/// every range a batch places in it.
pub const REGION_SLACK: usize = 64 * 1024;

/// The RDMA operation of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    /// RDMA WRITE: local SGEs to a remote range.
    Write,
    /// RDMA READ: a remote range into local SGEs.
    Read,
    /// RDMA WRITE_WITH_IMM: a write that also consumes a receive at the responder, which
    /// sees the immediate value and the byte count.
    WriteWithImm,
}

impl Operation {
    /// The name used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Write => "WRITE",
            Operation::Read => "READ",
            Operation::WriteWithImm => "WRITE_WITH_IMM",
        }
    }
}

/// A byte range in one of the checker's memory regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Index of the region (local or remote, depending on the side).
    pub region: usize,
    /// Offset in the region.
    pub offset: usize,
    /// Length in bytes (at least 1).
    pub len: usize,
}

/// One work request and everything needed to check it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// What to do.
    pub op: Operation,
    /// The application's identifier, any 64-bit value (the shaper may reserve none).
    pub wr_id: u64,
    /// Whether the request asks for a completion.
    pub signaled: bool,
    /// The local buffers, in message order.
    pub local: Vec<Placement>,
    /// The remote range (one memory region, contiguous).
    pub remote: Placement,
    /// Immediate value for [`Operation::WriteWithImm`].
    pub imm: u32,
    /// Seeds the data pattern of this transfer.
    pub pattern_seed: u64,
}

impl Transfer {
    /// Total bytes moved.
    pub fn len(&self) -> usize {
        self.remote.len
    }

    /// Never true: every transfer moves at least one byte.
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }
}

/// Requests posted together and completed before the next batch starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The requests, in posting order; the last one is always signaled.
    pub transfers: Vec<Transfer>,
    /// Post all requests in one `ibv_post_send` call (a linked list) rather than one call
    /// each.
    pub post_as_list: bool,
}

/// The shape of the random batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// Largest transfer, and the most bytes one batch moves in all.
    pub max_size: usize,
    /// Most SGEs per request.
    pub max_sges: usize,
    /// Most requests per batch.
    pub max_batch: usize,
    /// Number of local memory regions the SGEs are spread over.
    pub local_regions: usize,
    /// Number of remote memory regions.
    pub remote_regions: usize,
    /// If set, a quarter of the sizes are drawn near multiples of this (a chunk size), so
    /// that splits at and around chunk boundaries are exercised.
    pub boundary: Option<usize>,
    /// Whether WRITE_WITH_IMM requests are drawn.
    pub with_imm: bool,
}

impl PlanConfig {
    /// Bytes each region must have for any batch this configuration draws.
    pub fn region_len(&self) -> usize {
        self.max_size + REGION_SLACK
    }
}

/// Hands out disjoint ranges, each with at least [`GUARD`] free bytes on both sides, from a
/// set of equally sized regions.
pub(crate) struct RegionCursor {
    next: Vec<usize>,
    len: usize,
}

impl RegionCursor {
    pub(crate) fn new(regions: usize, len: usize) -> Self {
        RegionCursor {
            next: vec![0; regions],
            len,
        }
    }

    /// A range of `len` bytes in a random region that has room, at a random small gap
    /// after the previous range there (so offsets and alignments vary).
    pub(crate) fn place(&mut self, rng: &mut Pcg64Mcg, len: usize) -> Placement {
        let gap = |rng: &mut Pcg64Mcg| GUARD + below(rng, GUARD as u64) as usize;
        let first = below(rng, self.next.len() as u64) as usize;
        let fits = |start: usize| start + 2 * GUARD + len <= self.len;
        let region = (0..self.next.len())
            .map(|k| (first + k) % self.next.len())
            .find(|&r| fits(self.next[r]))
            // A batch moves at most max_size bytes and each region holds max_size plus
            // slack for every gap, so the first region always has room.
            .unwrap_or(0);
        let offset = self.next[region] + gap(rng);
        self.next[region] = offset + len;
        Placement {
            region,
            offset,
            len,
        }
    }
}

/// A uniform integer in `0..n` (`n > 0`), by multiply-high: no modulo bias worth the name.
pub(crate) fn below(rng: &mut Pcg64Mcg, n: u64) -> u64 {
    ((u128::from(rng.next_u64()) * u128::from(n)) >> 64) as u64
}

/// Draws batches from a seed; the same seed and configuration give the same batches.
pub struct Planner {
    rng: Pcg64Mcg,
    config: PlanConfig,
}

impl Planner {
    /// A planner for `config`, seeded with `seed`.
    pub fn new(seed: u64, config: PlanConfig) -> Self {
        Planner {
            rng: Pcg64Mcg::seed_from_u64(seed),
            config,
        }
    }

    /// The next batch.
    pub fn next_batch(&mut self) -> Batch {
        let cfg = self.config.clone();
        let count = 1 + below(&mut self.rng, cfg.max_batch.max(1) as u64) as usize;
        let mut local = RegionCursor::new(cfg.local_regions.max(1), cfg.region_len());
        let mut remote = RegionCursor::new(cfg.remote_regions.max(1), cfg.region_len());
        let mut budget = cfg.max_size.max(1);
        let mut transfers = Vec::with_capacity(count);
        for i in 0..count {
            if budget == 0 {
                break;
            }
            let len = self.size(budget);
            budget -= len;
            let op = match below(&mut self.rng, 20) {
                0..=8 => Operation::Write,
                9..=16 => Operation::Read,
                _ if cfg.with_imm => Operation::WriteWithImm,
                _ => Operation::Write,
            };
            let local = self
                .split(len)
                .into_iter()
                .map(|part| local.place(&mut self.rng, part))
                .collect();
            transfers.push(Transfer {
                op,
                wr_id: self.rng.next_u64(),
                signaled: i + 1 == count || self.rng.next_u32() & 1 == 0,
                local,
                remote: remote.place(&mut self.rng, len),
                imm: self.rng.next_u32(),
                pattern_seed: self.rng.next_u64(),
            });
        }
        // The budget may run out before `count`; the last request posted must be signaled,
        // or its completion (and those of the unsignaled ones before it) would never show.
        if let Some(last) = transfers.last_mut() {
            last.signaled = true;
        }
        Batch {
            transfers,
            post_as_list: self.rng.next_u32() & 1 == 0,
        }
    }

    /// A size in `1..=budget`: log-uniform (as many 10-byte as 10-megabyte transfers), or
    /// within one byte of a multiple of the boundary.
    fn size(&mut self, budget: usize) -> usize {
        let size = self.log_uniform(budget);
        if let Some(chunk) = self.config.boundary.filter(|&c| c > 0) {
            if below(&mut self.rng, 4) == 0 {
                // The nearest multiple of the chunk (at least one), then one byte less,
                // exactly, or one byte more.
                let base = (size / chunk).max(1) * chunk;
                let size = (base + below(&mut self.rng, 3) as usize).saturating_sub(1);
                return size.clamp(1, budget);
            }
        }
        size
    }

    /// A size in `1..=budget` whose logarithm is about uniform.
    fn log_uniform(&mut self, budget: usize) -> usize {
        log_uniform(&mut self.rng, budget)
    }

    /// Splits `len` bytes into 1 to `max_sges` non-empty parts at random points.
    fn split(&mut self, len: usize) -> Vec<usize> {
        split(&mut self.rng, len, self.config.max_sges)
    }
}

/// A size in `1..=budget` (`budget > 0`) whose logarithm is about uniform: as many 10-byte
/// as 10-megabyte sizes.
pub(crate) fn log_uniform(rng: &mut Pcg64Mcg, budget: usize) -> usize {
    let bits = u64::from(usize::BITS - budget.leading_zeros()); // budget < 2^bits
    let low = 1u64 << below(rng, bits);
    let size = low + below(rng, low);
    (size as usize).clamp(1, budget)
}

/// Splits `len` bytes (`len > 0`) into 1 to `max_parts` non-empty parts at random points.
pub(crate) fn split(rng: &mut Pcg64Mcg, len: usize, max_parts: usize) -> Vec<usize> {
    let parts = 1 + below(rng, max_parts.clamp(1, len) as u64) as usize;
    let mut cuts: Vec<usize> = (1..parts)
        .map(|_| 1 + below(rng, (len - 1) as u64) as usize)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::with_capacity(cuts.len() + 1);
    let mut prev = 0;
    for cut in cuts.into_iter().chain(std::iter::once(len)) {
        out.push(cut - prev);
        prev = cut;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> PlanConfig {
        PlanConfig {
            max_size: 16 << 20,
            max_sges: 6,
            max_batch: 4,
            local_regions: 3,
            remote_regions: 2,
            boundary: Some(65536),
            with_imm: true,
        }
    }

    fn overlap(a: &Placement, b: &Placement) -> bool {
        a.region == b.region
            && a.offset < b.offset + b.len + GUARD
            && b.offset < a.offset + a.len + GUARD
    }

    #[test]
    fn batches_are_well_formed() {
        let cfg = config();
        let mut planner = Planner::new(1, cfg.clone());
        for _ in 0..2000 {
            let batch = planner.next_batch();
            assert!(!batch.transfers.is_empty());
            assert!(batch.transfers.len() <= cfg.max_batch);
            assert!(batch.transfers.last().is_some_and(|t| t.signaled));
            let total: usize = batch.transfers.iter().map(Transfer::len).sum();
            assert!(total <= cfg.max_size);
            let mut locals = Vec::new();
            let mut remotes = Vec::new();
            for t in &batch.transfers {
                assert!(!t.is_empty());
                assert!(!t.local.is_empty() && t.local.len() <= cfg.max_sges);
                assert_eq!(t.local.iter().map(|p| p.len).sum::<usize>(), t.len());
                for p in t.local.iter().chain([&t.remote]) {
                    assert!(p.len >= 1);
                    assert!(p.offset >= GUARD);
                    assert!(p.offset + p.len + GUARD <= cfg.region_len());
                }
                assert!(t.local.iter().all(|p| p.region < cfg.local_regions));
                assert!(t.remote.region < cfg.remote_regions);
                locals.extend(t.local.iter().copied());
                remotes.push(t.remote);
            }
            // Disjoint, guards included: no transfer of a batch can hide another's error.
            for set in [&locals, &remotes] {
                for (i, a) in set.iter().enumerate() {
                    for b in &set[i + 1..] {
                        assert!(!overlap(a, b), "{a:?} overlaps {b:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn sizes_span_one_byte_to_the_maximum_and_hit_chunk_boundaries() {
        let cfg = config();
        let mut planner = Planner::new(2, cfg.clone());
        let sizes: Vec<usize> = (0..3000)
            .flat_map(|_| planner.next_batch().transfers)
            .map(|t| t.len())
            .collect();
        assert!(sizes.iter().any(|&s| s < 16));
        assert!(sizes.iter().any(|&s| s > 8 << 20));
        let chunk = 65536;
        assert!(sizes.iter().any(|&s| s % chunk == 0));
        assert!(sizes.iter().any(|&s| s % chunk == chunk - 1));
        assert!(sizes.iter().any(|&s| s > chunk && s % chunk == 1));
    }

    #[test]
    fn every_shape_is_drawn() {
        let mut planner = Planner::new(3, config());
        let batches: Vec<Batch> = (0..500).map(|_| planner.next_batch()).collect();
        let transfers: Vec<&Transfer> = batches.iter().flat_map(|b| &b.transfers).collect();
        for op in [Operation::Write, Operation::Read, Operation::WriteWithImm] {
            assert!(transfers.iter().any(|t| t.op == op), "{op:?}");
        }
        assert!(transfers.iter().any(|t| !t.signaled));
        assert!(transfers.iter().any(|t| t.local.len() >= 4));
        assert!(transfers
            .iter()
            .any(|t| t.local.iter().any(|p| p.region != t.local[0].region)));
        assert!(batches
            .iter()
            .any(|b| b.post_as_list && b.transfers.len() > 1));
        assert!(batches
            .iter()
            .any(|b| !b.post_as_list && b.transfers.len() > 1));
    }

    #[test]
    fn the_seed_replays_the_same_batches() {
        let mut a = Planner::new(99, config());
        let mut b = Planner::new(99, config());
        let mut c = Planner::new(100, config());
        let first: Vec<Batch> = (0..50).map(|_| a.next_batch()).collect();
        let again: Vec<Batch> = (0..50).map(|_| b.next_batch()).collect();
        let other: Vec<Batch> = (0..50).map(|_| c.next_batch()).collect();
        assert_eq!(first, again);
        assert_ne!(first, other);
    }

    #[test]
    fn without_imm_no_write_with_imm_is_drawn() {
        let mut planner = Planner::new(
            4,
            PlanConfig {
                with_imm: false,
                ..config()
            },
        );
        assert!((0..500)
            .flat_map(|_| planner.next_batch().transfers)
            .all(|t| t.op != Operation::WriteWithImm));
    }
}
