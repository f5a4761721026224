//! Costs on the RNIC's memory-translation caches: what a tenant's messages cost when they
//! touch more memory regions or pages than its share of the caches can keep.
//!
//! **What it works against.** Before a processing unit starts a message that reads its
//! payload from host memory it needs the region's MPT entry and the MTT entry of every
//! page the payload spans; an entry the RNIC does not cache is read from host memory
//! first, the unit held meanwhile. The caches are shared by every tenant, so one that
//! spreads small messages over many regions or pages misses on nearly every message: each
//! of its messages holds a unit for a few reads of host memory rather than one message
//! start, and the queue pairs that share the unit wait behind it. Counted as one
//! operation a message, such a tenant is held to its share of the message rate and still
//! takes most of the units' time.
//!
//! **What the host knows.** Not the RNIC's hits and misses, but each work request's memory
//! region, address and length, hence the pages it reads. So the host keeps, per tenant, a
//! least-recently-used set of the regions and pages the tenant's own requests touched, of
//! the size of its share of each cache ([`TranslationShare`], from
//! [`AdaptiveLaw::translation_share`](super::AdaptiveLaw::translation_share): the cache's
//! entries by the tenant's weight over L+B+T, at least one, at most the cache). A request
//! is charged an entry read for each region or page it brings into a full set in place of
//! one of the tenant's own ([`TranslationBudget::touch`]): what the request would cost if
//! the caches were split among the tenants by weight and each kept its own part. A tenant
//! whose regions and pages fit its share is charged nothing, not even for filling it (a
//! one-off of at most its share's entries, not a rate), whatever the others do to the
//! real caches; one that walks more of them than its share pays for every entry it
//! brings in once its share is full, and the operations pacing of its flows
//! ([`AdaptiveConfig::miss_operations`](super::AdaptiveConfig::miss_operations)) holds it
//! to its share of the processing units' time, not of the message starts.
//!
//! Invariants: each set holds at most its capacity of keys (0: unbounded, never charged);
//! [`TranslationBudget::touch`] counts exactly the keys it inserted in place of another;
//! tenants are independent: one tenant's requests never change another's charges.

use std::collections::BTreeMap;

/// The translation entries one tenant may keep: its share of each cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TranslationShare {
    /// MPT entries, one per memory region; 0: the cache is not bounded (never a miss).
    pub regions: u32,
    /// MTT entries, one per registered page; 0: the cache is not bounded.
    pub pages: u32,
}

/// The memory a work request reads its payload from: what a shaper knows from the request
/// (its region's key, its address and length) and the region's page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// The memory region (its key, or any number that names it on the host).
    pub region: u64,
    /// The first page the payload touches, counted in the region.
    pub first_page: u64,
    /// The pages it spans (0: no payload read).
    pub pages: u64,
}

/// A least-recently-used set of at most `capacity` keys (0: unbounded).
#[derive(Clone, Debug)]
struct Lru<K> {
    capacity: usize,
    /// Each held key's stamp: the larger, the more recent.
    stamp: BTreeMap<K, u64>,
    /// The held keys by stamp, the least recent first.
    order: BTreeMap<u64, K>,
    clock: u64,
}

impl<K: Ord + Copy> Lru<K> {
    fn new() -> Self {
        Lru {
            capacity: 0,
            stamp: BTreeMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Holds at most `capacity` keys from now on, evicting the least recent beyond it.
    fn resize(&mut self, capacity: usize) {
        self.capacity = capacity;
        if capacity == 0 {
            self.stamp.clear();
            self.order.clear();
            return;
        }
        while self.stamp.len() > capacity {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            self.stamp.remove(&key);
        }
    }

    /// Makes `key` the most recent, inserting it if it was not held. True when it took the
    /// place of another key (the set was full): a miss that evicts; never one when
    /// unbounded.
    fn touch(&mut self, key: K) -> bool {
        if self.capacity == 0 {
            return false;
        }
        self.clock += 1;
        if let Some(old) = self.stamp.insert(key, self.clock) {
            self.order.remove(&old);
            self.order.insert(self.clock, key);
            return false;
        }
        self.order.insert(self.clock, key);
        if self.stamp.len() <= self.capacity {
            return false;
        }
        if let Some((_, lru)) = self.order.pop_first() {
            self.stamp.remove(&lru);
        }
        true
    }
}

/// One tenant's sets: regions, and (region, page) pairs.
#[derive(Clone, Debug)]
struct TenantEntries {
    regions: Lru<u64>,
    pages: Lru<(u64, u64)>,
}

/// Per tenant, the translation entries its own requests keep within its share, and the
/// misses each request takes there (see the module documentation).
#[derive(Clone, Debug)]
pub struct TranslationBudget<T> {
    tenants: BTreeMap<T, TenantEntries>,
}

impl<T: Ord + Clone> Default for TranslationBudget<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Ord + Clone> TranslationBudget<T> {
    /// No tenant has touched anything yet.
    pub fn new() -> Self {
        TranslationBudget {
            tenants: BTreeMap::new(),
        }
    }

    /// Records a request of `tenant` reading `access`, within `share` (a share smaller than
    /// before drops the tenant's least recent entries first): the entries it brought into
    /// its full sets in place of others of its own, its region's and each page's.
    pub fn touch(&mut self, tenant: &T, share: TranslationShare, access: &Access) -> u64 {
        if access.pages == 0 {
            return 0;
        }
        let entries = self
            .tenants
            .entry(tenant.clone())
            .or_insert_with(|| TenantEntries {
                regions: Lru::new(),
                pages: Lru::new(),
            });
        let capacity = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
        entries.regions.resize(capacity(share.regions));
        entries.pages.resize(capacity(share.pages));
        let mut misses = u64::from(entries.regions.touch(access.region));
        for page in access.first_page..access.first_page.saturating_add(access.pages) {
            misses += u64::from(entries.pages.touch((access.region, page)));
        }
        misses
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(region: u64, first_page: u64, pages: u64) -> Access {
        Access {
            region,
            first_page,
            pages,
        }
    }

    /// A share of 2 regions and 4 pages. Region 1 pages 0-2, cold, fill part of it: 0;
    /// again, 0; region 2 pages 0-1: the region and page (2, 0) fill it, page (2, 1) takes
    /// the place of (1, 0): 1; region 3 page 0 takes region 1's place and (1, 1)'s: 2;
    /// region 1 page 2: the region takes region 2's place, its page is held: 1. Tenant 8
    /// touching ten regions a page each fills its share with the first two regions and
    /// four pages, then pays for the other 8 regions and 6 pages: 14; tenant 7's charges
    /// do not change.
    #[test]
    fn a_tenant_is_charged_the_entries_it_brings_into_its_full_share() {
        let share = TranslationShare {
            regions: 2,
            pages: 4,
        };
        let mut b = TranslationBudget::new();
        assert_eq!(b.touch(&7, share, &access(1, 0, 3)), 0);
        assert_eq!(b.touch(&7, share, &access(1, 0, 3)), 0);
        assert_eq!(b.touch(&7, share, &access(2, 0, 2)), 1);
        assert_eq!(b.touch(&7, share, &access(3, 0, 1)), 2);
        assert_eq!(b.touch(&7, share, &access(1, 2, 1)), 1);
        let other: u64 = (10..20).map(|r| b.touch(&8, share, &access(r, 0, 1))).sum();
        assert_eq!(other, 14);
        assert_eq!(b.touch(&7, share, &access(1, 2, 1)), 0);
        assert_eq!(b.touch(&7, share, &access(3, 0, 1)), 0);
        // Unbounded caches never charge; nor does a request that reads no payload.
        let free = TranslationShare::default();
        assert_eq!(b.touch(&9, free, &access(1, 0, 1000)), 0);
        assert_eq!(b.touch(&7, share, &access(5, 0, 0)), 0);
    }

    /// A smaller share drops the least recent entries: four pages held, the share cut to
    /// two keeps the last two touched, and the next page takes the place of one of them.
    #[test]
    fn a_smaller_share_keeps_the_most_recent_entries() {
        let wide = TranslationShare {
            regions: 4,
            pages: 4,
        };
        let narrow = TranslationShare {
            regions: 4,
            pages: 2,
        };
        let mut b = TranslationBudget::new();
        assert_eq!(b.touch(&1, wide, &access(1, 0, 4)), 0);
        assert_eq!(b.touch(&1, narrow, &access(1, 2, 2)), 0);
        assert_eq!(b.touch(&1, narrow, &access(1, 0, 1)), 1);
        assert_eq!(b.touch(&1, wide, &access(1, 3, 1)), 0);
    }
}
