//! `adaptive`'s charge for the memory-translation caches, on the simulated host: the
//! observations the core's [`TranslationBudget`] needs, fed request by request.
//!
//! For each request a paced flow hands the RNIC, the driver reads the memory its payload
//! spans ([`PolicyContext::payload_pages`]: region, first page, pages, what the request
//! itself says) and records it in the core's per-tenant sets within the tenant's share
//! (set by the driver from [`AdaptiveLaw::translation_share`](
//! justitia_core::adaptive::AdaptiveLaw::translation_share) at each plan); the entries the
//! tenant's share did not hold become operations ([`AdaptiveConfig::miss_operations`])
//! charged to the flow's pacer on top of the request's own. It never reads the RNIC's
//! caches: what the RNIC really misses is the model's business, not the shaper's.

use std::collections::BTreeMap;

use justitia_core::adaptive::{AdaptiveConfig, TranslationBudget, TranslationShare};
use justitia_core::flow::{FlowSpec, TenantId};

use super::PolicyContext;
use crate::rnic::{QpId, WorkRequest};

/// Per tenant, the translation entries its paced requests keep within its share, and what
/// the others cost.
pub struct TranslationCharge {
    config: AdaptiveConfig,
    budget: TranslationBudget<TenantId>,
    shares: BTreeMap<TenantId, TranslationShare>,
    /// Entries charged so far, over every tenant.
    misses: u64,
}

impl TranslationCharge {
    /// A charge with the law's settings (the caches' sizes, a miss's time, one queue pair's
    /// message rate); no tenant has a share until [`TranslationCharge::set_shares`].
    pub fn new(config: AdaptiveConfig) -> Self {
        TranslationCharge {
            config,
            budget: TranslationBudget::new(),
            shares: BTreeMap::new(),
            misses: 0,
        }
    }

    /// Each tenant's share of the caches from now on; a tenant not named has none (never
    /// charged).
    pub fn set_shares(&mut self, shares: impl IntoIterator<Item = (TenantId, TranslationShare)>) {
        self.shares = shares.into_iter().collect();
    }

    /// Records `wr`, about to be posted on `qp` by a flow of `spec`, and returns the
    /// operations it costs beyond its own one: its tenant's misses within its share.
    pub fn extra_operations(
        &mut self,
        ctx: &PolicyContext<'_>,
        spec: &FlowSpec,
        qp: QpId,
        wr: &WorkRequest,
    ) -> u64 {
        let Some(share) = self.shares.get(&spec.tenant).copied() else {
            return 0;
        };
        let Some(access) = ctx.payload_pages(qp, wr) else {
            return 0;
        };
        let misses = self.budget.touch(&spec.tenant, share, &access);
        self.misses += misses;
        self.config.miss_operations(misses)
    }

    /// Entries charged so far.
    pub fn misses(&self) -> u64 {
        self.misses
    }
}
