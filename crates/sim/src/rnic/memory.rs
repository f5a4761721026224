//! Where a queue pair's messages lie in registered memory: the memory regions a flow
//! registered, their page size, and the walk its messages take through them. The
//! translation caches (`translation`) look up the pages a message spans, and the PCIe
//! read path (`Costs::tlp_time`) splits its payload at the max-payload boundaries.
//!
//! Message `k` of a queue pair uses region `k mod mrs`, at offset
//! `offset + (j mod n) x step` with `j = k div mrs`, where `step` is the message's size
//! rounded up to whole pages and `n` the steps that fit in the region after `offset`
//! (at least 1): a flow whose regions are larger than its messages spreads its accesses
//! over every page of them, one after another, and a step of whole pages keeps every
//! message's misalignment that of `offset`. The queue pairs of a flow take turns in one
//! walk (the `j`-th of `q` places messages `j`, `j + q`, `j + 2q`, ...), so that they
//! spread over the regions together rather than touch the same pages in step. A queue
//! pair without a layout of its own has
//! one region of its own holding one message at offset 0 (perftest's buffer).
//!
//! Invariants: `mrs` is at least 1, `page_bytes` a power of two, and the regions
//! `first_mr..first_mr + mrs` belong to this layout alone.

/// The memory a queue pair's messages use, and how far they have walked through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MemoryLayout {
    /// The first of its regions' numbers (numbered per run).
    pub(crate) first_mr: u32,
    /// Its regions.
    pub(crate) mrs: u32,
    /// Each region's size in bytes (0: as large as one message).
    pub(crate) mr_bytes: u64,
    /// The registration's page size in bytes.
    pub(crate) page_bytes: u64,
    /// Where the first message starts in its region, in bytes.
    pub(crate) offset: u64,
    /// The walk's index of its next message.
    next: u64,
    /// How far its walk moves per message: the flow's queue pairs.
    stride: u64,
}

/// Where one message lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Its region.
    pub(crate) mr: u32,
    /// Its first byte's offset in the region.
    pub(crate) at: u64,
}

impl MemoryLayout {
    /// `mrs` regions (at least 1) of `mr_bytes` each from region `first_mr`, pages of
    /// `page_bytes`, the first message at `offset`.
    pub(crate) fn new(
        first_mr: u32,
        mrs: u32,
        mr_bytes: u64,
        page_bytes: u64,
        offset: u64,
    ) -> Self {
        MemoryLayout {
            first_mr,
            mrs: mrs.max(1),
            mr_bytes,
            page_bytes: page_bytes.max(1),
            offset,
            next: 0,
            stride: 1,
        }
    }

    /// The same layout for the `j`-th of `q` queue pairs sharing it: its messages are
    /// `j`, `j + q`, ... of the flow's walk.
    pub(crate) fn turn(self, j: u64, q: u64) -> Self {
        MemoryLayout {
            next: j,
            stride: q.max(1),
            ..self
        }
    }

    /// Places the next message of `bytes`.
    pub(crate) fn place(&mut self, bytes: u32) -> Placement {
        let k = self.next;
        self.next += self.stride;
        let mrs = u64::from(self.mrs);
        let step = u64::from(bytes).div_ceil(self.page_bytes).max(1) * self.page_bytes;
        let n = (self.mr_bytes.saturating_sub(self.offset) / step).max(1);
        Placement {
            mr: self.first_mr + (k % mrs) as u32,
            at: self.offset + (k / mrs % n) * step,
        }
    }

    /// The pages `bytes` from `at` span: (first page, count); none for no bytes.
    pub(crate) fn pages(&self, at: u64, bytes: u32) -> (u64, u64) {
        if bytes == 0 {
            return (at / self.page_bytes, 0);
        }
        let first = at / self.page_bytes;
        let last = (at + u64::from(bytes) - 1) / self.page_bytes;
        (first, last - first + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two regions of 16 KB, 4 KB pages, offset 100: 1000-byte messages step one page
    /// (1000 rounded up to 4096), and (16384 - 100) / 4096 = 3 steps fit. Messages 0-7:
    /// region 5, 6, 5, 6, ... at 100, 100, 4196, 4196, 8292, 8292, 100, 100.
    #[test]
    fn messages_walk_the_regions_in_page_steps() {
        let mut m = MemoryLayout::new(5, 2, 16_384, 4096, 100);
        let placed: Vec<(u32, u64)> = (0..8)
            .map(|_| m.place(1000))
            .map(|p| (p.mr, p.at))
            .collect();
        assert_eq!(
            placed,
            [
                (5, 100),
                (6, 100),
                (5, 4196),
                (6, 4196),
                (5, 8292),
                (6, 8292),
                (5, 100),
                (6, 100)
            ]
        );
    }

    /// The second of two queue pairs of that layout takes the walk's odd messages: region
    /// 6, 6, 6 at 100, 4196, 8292.
    #[test]
    fn queue_pairs_of_a_flow_take_turns_in_one_walk() {
        let mut m = MemoryLayout::new(5, 2, 16_384, 4096, 100).turn(1, 2);
        let placed: Vec<(u32, u64)> = (0..3)
            .map(|_| m.place(1000))
            .map(|p| (p.mr, p.at))
            .collect();
        assert_eq!(placed, [(6, 100), (6, 4196), (6, 8292)]);
    }

    /// The default: one region as large as a message, every message at 0.
    #[test]
    fn a_region_the_size_of_a_message_holds_it_at_0() {
        let mut m = MemoryLayout::new(0, 1, 0, 4096, 0);
        assert!((0..5).all(|_| m.place(1 << 20) == Placement { mr: 0, at: 0 }));
    }

    /// 4 KB pages: 64 bytes at 4090 span pages 0 and 1; 4096 bytes at 0 one page; 1 MB at
    /// 0 256 pages; nothing, none.
    #[test]
    fn pages_spanned() {
        let m = MemoryLayout::new(0, 1, 0, 4096, 0);
        assert_eq!(m.pages(4090, 64), (0, 2));
        assert_eq!(m.pages(0, 4096), (0, 1));
        assert_eq!(m.pages(0, 1 << 20), (0, 256));
        assert_eq!(m.pages(8192, 0).1, 0);
    }
}
