//! Remote READs (§4.4) in the loop: the READ units this host serves and the guarantee it
//! announces for them; on the requester, each READ flow's newest guarantee from the host it
//! reads from, its lifetime, and the flow's allotment from it (see the module
//! documentation's "Remote READs").
//!
//! Inputs: [`ControlLoop::set_remote_reads`], [`ControlLoop::set_flow_reads_from`] and
//! [`ControlLoop::read_guarantee_received`] from the driver; the loop's
//! [`LoopConfig::read_guarantee_lifetime`].
//!
//! Invariants: `capped` counts the flows holding a guarantee (checked at every update in
//! debug builds); a flow's guarantee only moves to a strictly newer one, and is dropped
//! [`LoopConfig::read_guarantee_lifetime`] after the last one applied; a READ flow's
//! allotment is its guarantee times its tenant's weight (the responder's whole RNIC at
//! most), split among its tenant's active READ flows of its class against that host, or
//! MaxRate without a guarantee; the allotments are computed in O(m log m) in the m READ
//! flows.

use super::*;

impl ControlLoop {
    /// The remote READ units this host serves now (the requesters' flows that have work,
    /// one unit per requester host, tenant and class; the driver learns of them from the
    /// requesters). They count with the local flows in the guarantee this host announces
    /// after every update.
    pub fn set_remote_reads(&mut self, now: Duration, units: &[RemoteReadUnit]) {
        self.advance(now);
        let mut units = units.to_vec();
        units.sort_unstable();
        if units != self.remote_reads {
            self.remote_reads = units;
            self.stir();
        }
    }

    /// Marks a flow as a READ requester's flow against host `responder` (in the driver's
    /// numbering), or unmarks it with `None`: see "Remote READs". A marked flow leaves
    /// this host's L, B, T and division from the next update on.
    pub fn set_flow_reads_from(
        &mut self,
        now: Duration,
        id: FlowId,
        responder: Option<u64>,
    ) -> Result<(), LoopError> {
        self.advance(now);
        let index = self.find(id).ok_or(LoopError::UnknownFlow(id))?;
        if self.flows[index].reads_from == responder {
            return Ok(());
        }
        // Uncounted under the old marking, counted again under the new.
        let active = self.flows[index].active;
        self.count_activity(index, false);
        self.flows[index].reads_from = responder;
        self.count_activity(index, active);
        self.caps_changed = true;
        self.stir();
        Ok(())
    }

    /// The weighted count of this host's active units and the remote READ units it
    /// serves: the guarantee is 1 over it (see [`crate::remote_read`]).
    pub(super) fn weighted_units(&self) -> u64 {
        let local: u64 = self
            .tenants
            .iter()
            .filter(|t| t.flows > 0)
            .map(|t| {
                let latency = u64::from(t.active[class_index(FlowClass::Latency)] > 0);
                let hungry = [FlowClass::Throughput, FlowClass::Bandwidth]
                    .iter()
                    .filter(|&&c| t.active[class_index(c)] > 0)
                    .count() as u64;
                latency + hungry * u64::from(t.weight.max(1))
            })
            .sum();
        let remote: u64 = self.remote_reads.iter().map(RemoteReadUnit::weighted).sum();
        local.saturating_add(remote)
    }

    /// A guarantee from the host a READ flow of this host reads from. A newer one caps the
    /// flow's allotment from the next update on; a stale one (reordered, replayed) is
    /// ignored. Refused, changing nothing, if its figures are out of range.
    pub fn read_guarantee_received(
        &mut self,
        now: Duration,
        id: FlowId,
        guarantee: ReadGuarantee,
    ) -> Result<Receipt, LoopError> {
        let now = self.advance(now);
        let index = self.find(id).ok_or(LoopError::UnknownFlow(id))?;
        let flow = &mut self.flows[index];
        if flow.read_cap.is_none() {
            self.capped += 1;
        }
        let (receiver, heard_at) = flow
            .read_cap
            .get_or_insert_with(|| (ReadGuaranteeReceiver::new(), now));
        let before = receiver
            .current()
            .map(|g| (g.bytes_per_sec, g.ops_per_sec, g.chunk_bytes));
        let receipt = match receiver.accept(guarantee) {
            Ok(receipt) => receipt,
            Err(e) => {
                if receiver.current().is_none() {
                    flow.read_cap = None;
                    self.capped -= 1;
                }
                return Err(e.into());
            }
        };
        if receipt == Receipt::Applied {
            *heard_at = now;
            let after = (
                guarantee.bytes_per_sec,
                guarantee.ops_per_sec,
                guarantee.chunk_bytes,
            );
            if before != Some(after) {
                self.caps_changed = true;
                self.stir();
            }
        }
        Ok(receipt)
    }

    /// The guarantee capping a flow's allotment now, if any.
    pub fn read_cap(&self, id: FlowId) -> Option<ReadGuarantee> {
        let flow = &self.flows[self.find(id)?];
        flow.read_cap
            .as_ref()
            .and_then(|(r, _)| r.current().copied())
    }

    /// Drops the guarantees not renewed for [`LoopConfig::read_guarantee_lifetime`]: a
    /// guarantee that lapses (its sender gone, or restarted in an epoch the receiver cannot
    /// order) stops capping.
    pub(super) fn lapse_read_caps(&mut self, now: Duration) {
        let hold = self.config.read_guarantee_lifetime;
        for flow in &mut self.flows {
            if let Some((_, heard_at)) = flow.read_cap {
                if heard_at.saturating_add(hold) <= now {
                    flow.read_cap = None;
                    self.capped -= 1;
                    self.caps_changed = true;
                }
            }
        }
    }

    /// The allotments of the READ requesters' flows (see "Remote READs"), in increasing
    /// order of place: the guarantee times the tenant's weight, divided among the tenant's
    /// active READ flows of the class against the same host; MaxRate without a guarantee.
    /// Allocates only while some flow is so marked. O(m log m) in the m marked flows: their
    /// (responder, tenant, class) keys are sorted once, and each flow's siblings are the
    /// run of its key, found by two binary searches.
    pub(super) fn read_allotments(&self) -> Vec<(usize, (f64, f64, u32))> {
        let max = (
            self.profile.max_rate_bytes_per_sec(),
            self.profile.max_ops_per_sec(),
        );
        let marked = |f: &FlowState| f.reads_from.is_some() && f.spec.class.is_resource_hungry();
        let key = |f: &FlowState| (f.reads_from, f.spec.tenant, class_index(f.spec.class));
        let mut active: Vec<_> = self
            .flows
            .iter()
            .filter(|f| marked(f) && f.active)
            .map(key)
            .collect();
        active.sort_unstable();
        let mut out = Vec::new();
        for (index, flow) in self.flows.iter().enumerate().filter(|(_, f)| marked(f)) {
            if !flow.active {
                out.push((index, (0.0, 0.0, u32::MAX)));
                continue;
            }
            let Some(cap) = flow.read_cap.as_ref().and_then(|(r, _)| r.current()) else {
                out.push((index, (max.0, max.1, u32::MAX)));
                continue;
            };
            let own = key(flow);
            let siblings = (active.partition_point(|k| *k <= own)
                - active.partition_point(|k| *k < own))
            .max(1) as f64;
            // The responder's whole RNIC at most: its figures are its fraction of its
            // MaxRate and MaxTput.
            let scale = (cap.fraction * f64::from(flow.spec.weight.get())).min(1.0)
                / cap.fraction
                / siblings;
            out.push((
                index,
                (
                    cap.bytes_per_sec * scale,
                    cap.ops_per_sec * scale,
                    cap.chunk_bytes,
                ),
            ));
        }
        out
    }
}
