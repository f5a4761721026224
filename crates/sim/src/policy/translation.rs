//! `adaptive`'s charge for the memory-translation caches, on the simulated host: the
//! observations the core's [`TranslationBudget`] needs, fed request by request.
//!
//! For each request a paced flow hands the RNIC, the driver reads the memory its payload
//! spans ([`PolicyContext::payload_pages`]: region, first page, pages, what the request
//! itself says) and records it in the core's per-tenant sets within the tenant's share
//! (set by the driver from [`AdaptiveLaw::translation_share`](
//! justitia_core::adaptive::AdaptiveLaw::translation_share) at each plan); the entries it
//! brought into the tenant's full sets become operations
//! ([`AdaptiveConfig::miss_operations`]) charged to the flow's pacer on top of the
//! request's own. It never reads the RNIC's
//! caches: what the RNIC really misses is the model's business, not the shaper's.

use std::collections::BTreeMap;

use justitia_core::adaptive::{AdaptiveConfig, TranslationBudget, TranslationShare};
use justitia_core::flow::{FlowSpec, TenantId};

use super::PolicyContext;
use crate::rnic::{QpId, WorkRequest};

/// Per tenant, the translation entries its paced requests keep within its share, and what
/// the requests that bring in more cost.
pub struct TranslationCharge {
    config: AdaptiveConfig,
    budget: TranslationBudget<TenantId>,
    shares: BTreeMap<TenantId, TranslationShare>,
}

impl TranslationCharge {
    /// A charge with the law's settings (the caches' sizes, a miss's time, MaxTput and the
    /// processing units); no tenant has a share until [`TranslationCharge::set_shares`].
    pub fn new(config: AdaptiveConfig) -> Self {
        TranslationCharge {
            config,
            budget: TranslationBudget::new(),
            shares: BTreeMap::new(),
        }
    }

    /// Each tenant's share of the caches from now on; a tenant not named has none (never
    /// charged).
    pub fn set_shares(&mut self, shares: impl IntoIterator<Item = (TenantId, TranslationShare)>) {
        self.shares = shares.into_iter().collect();
    }

    /// Records `wr`, about to be posted on `qp` by a flow of `spec`, and returns the
    /// operations it costs beyond its own one: the entries it brought into its tenant's
    /// full share.
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
        self.config.miss_operations(misses)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use justitia_core::flow::FlowClass;

    use super::*;
    use crate::policy::test_host::{write, TestHost};

    /// A throughput flow whose 64 B WRITEs walk 8 regions of 1 MB, a new region each and a
    /// new page every 8, with a share of 2 regions and 4 pages, on RoCE-100-husky's 600 ns
    /// misses, 105 M messages/s and 16 units (3.94 operations a miss). Messages 0 and 1
    /// fill the share's regions and their pages (nothing); 2 and 3 each bring a region in
    /// place of one of the tenant's, their pages still filling the share (4 operations);
    /// from 4 on a region and a page (8). The walk is read, not moved: asked twice before
    /// the post, a message is the same one. An inline message reads no payload, and a
    /// tenant without a share is never charged.
    #[test]
    fn a_request_is_charged_what_it_brings_into_its_tenants_full_share() {
        let mut host = TestHost::new();
        let flow = host.flow(1, FlowClass::Throughput);
        let qp = flow.qps[0];
        host.set_memory(&flow.qps, 8, 1 << 20);
        let config = AdaptiveConfig {
            max_ops_per_sec: 105e6,
            translation_miss: Duration::from_nanos(600),
            processing_units: 16,
            ..AdaptiveConfig::for_rnic(12.125e9, 4096, 1 << 20)
        };
        let mut charge = TranslationCharge::new(config);
        let share = TranslationShare {
            regions: 2,
            pages: 4,
        };
        charge.set_shares([(flow.spec.tenant, share)]);
        let mut charged = Vec::new();
        for k in 0..10 {
            let wr = write(k, 64);
            let first = host.ctx().payload_pages(qp, &wr);
            assert_eq!(first, host.ctx().payload_pages(qp, &wr));
            let page = first.map(|a| (a.first_page, a.pages));
            assert_eq!(page, Some((k / 8, 1)), "message {k}");
            charged.push(charge.extra_operations(&host.ctx(), &flow.spec, qp, &wr));
            host.ctx().post(qp, wr);
        }
        assert_eq!(charged, [0, 0, 4, 4, 8, 8, 8, 8, 8, 8]);
        let inline = WorkRequest {
            inline: true,
            ..write(10, 16)
        };
        assert_eq!(host.ctx().payload_pages(qp, &inline), None);
        assert_eq!(
            charge.extra_operations(&host.ctx(), &flow.spec, qp, &inline),
            0
        );
        charge.set_shares([]);
        assert_eq!(
            charge.extra_operations(&host.ctx(), &flow.spec, qp, &write(11, 64)),
            0
        );
    }
}
