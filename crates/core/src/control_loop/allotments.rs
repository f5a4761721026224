//! The division of SafeUtil among the active resource-hungry flows and the allotments
//! handed to the driver (see the module documentation's "Division" and "Release
//! phases").
//!
//! Inputs: the tenants' aggregates (largest weight and active flows, kept up to date by
//! the loop's inputs), SafeUtil, the chunk size, and the READ flows' allotments
//! ([`super::remote_reads`]).
//!
//! Invariants: a tenant of weight w among tenants of summed weight W gets w / W of
//! SafeUtil, split equally among its active resource-hungry flows, the same to the last bit
//! as `allot_rates` with unbounded demands; an idle flow's allotment is zero; an allotment
//! whose figures change takes a new generation, and one event announces it; release phases
//! are 0, 1/n, ... in the order of the sharing flows' ids.

use super::*;

/// One entry of a division's memo of fractions: tenants of equal weight and flow count get
/// the same fraction, so when many tenants share a few weights most need no division.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ShareMemo {
    /// The division it was computed in (divisions are numbered from 1).
    pub(super) division: u64,
    pub(super) weight: u32,
    pub(super) flows: u32,
    pub(super) flow_share: f64,
}

impl ShareMemo {
    /// Entries in the memo (direct-mapped: a tenant whose slot holds another key divides).
    pub(super) const SLOTS: usize = 16;

    /// The memo slot of a tenant of `weight` with `flows` active resource-hungry flows.
    pub(super) fn slot(weight: u32, flows: u32) -> usize {
        (weight.wrapping_mul(7) ^ flows) as usize % Self::SLOTS
    }
}

impl ControlLoop {
    /// Each tenant's fraction of SafeUtil per active resource-hungry flow: what
    /// `allot_rates` gives of SafeUtil 1 with every demand unbounded, computed the same way
    /// so that it is the same to the last bit. With unbounded demands the water level is
    /// reached at once: a tenant of weight w gets 1 x w / (the sum of the weights), and its
    /// n flows each get that divided by n. [`reallot`](Self::reallot) hands the fractions
    /// to the flows.
    pub(super) fn divide(&mut self) {
        if std::mem::take(&mut self.weights_stale) {
            self.find_stale_weights();
        }
        // Integer weights sum exactly in f64, in any order, as they do in `allot_rates`.
        let total_weight: u64 = self
            .tenants
            .iter()
            .filter(|t| t.hungry() > 0)
            .map(|t| u64::from(t.weight))
            .sum();
        let total_weight = total_weight as f64;
        self.division += 1;
        for tenant in &mut self.tenants {
            let hungry = tenant.hungry();
            if hungry == 0 {
                continue;
            }
            let memo = &mut self.share_memo[ShareMemo::slot(tenant.weight, hungry)];
            if memo.division != self.division
                || memo.weight != tenant.weight
                || memo.flows != hungry
            {
                // `allot_rates` multiplies by the capacity, 1, which is exact; so is dividing
                // by one flow, skipped because a division costs more than the rest.
                let share = f64::from(tenant.weight) / total_weight;
                *memo = ShareMemo {
                    division: self.division,
                    weight: tenant.weight,
                    flows: hungry,
                    flow_share: if hungry == 1 {
                        share
                    } else {
                        share / f64::from(hungry)
                    },
                };
            }
            tenant.flow_share = memo.flow_share;
        }
    }

    /// The largest weight of every tenant marked stale, from its active flows.
    pub(super) fn find_stale_weights(&mut self) {
        for tenant in self.tenants.iter_mut().filter(|t| t.weight_stale) {
            tenant.weight = 0;
            tenant.weight_count = 0;
        }
        for flow in self.flows.iter().filter(|f| f.shares()) {
            let tenant = &mut self.tenants[flow.tenant];
            if tenant.weight_stale {
                tenant.add_weight(flow.spec.weight.get());
            }
        }
        for tenant in &mut self.tenants {
            tenant.weight_stale = false;
        }
    }

    /// Rewrites the allotments from the shares and SafeUtil, taking each flow's share
    /// from its tenant after a division; all of them change with the chunk size. Emits an
    /// event if any changed.
    pub(super) fn reallot(&mut self, divided: bool, rechunked: bool) {
        let generation = self.generation + 1;
        // New phases, or a new chunk size (a new release interval), are a new assignment:
        // every pacer moves its flow to its phase. A change of SafeUtil alone is not.
        let rephased = (divided && self.assign_phases()) || rechunked;
        if rephased {
            self.phase_epoch += 1;
        }
        let safe_util = self.controller.safe_util();
        let ops_per_byte = self.profile.ops_per_byte();
        let read_allotments = self.read_allotments();
        // In the order of places, as the pass below goes: each flow's entry, if it has one,
        // is the next.
        let mut read_allotments = read_allotments.iter().peekable();
        let mut changed = false;
        let tenants = &self.tenants;
        for (index, flow) in self.flows.iter_mut().enumerate() {
            if divided {
                flow.share = if flow.shares() {
                    tenants[flow.tenant].flow_share
                } else {
                    0.0
                };
            }
            if !flow.spec.class.is_resource_hungry() {
                continue;
            }
            let mut bytes_per_sec = flow.share * safe_util;
            let mut ops_per_sec = bytes_per_sec * ops_per_byte;
            let mut chunk_cap = u32::MAX;
            if let Some(&(_, allotted)) = read_allotments.next_if(|(i, _)| *i == index) {
                (bytes_per_sec, ops_per_sec, chunk_cap) = allotted;
            } else if let Some(cap) = flow.read_cap.as_ref().and_then(|(r, _)| r.current()) {
                // A READ flow gets no more than the host it reads from guarantees it
                // (§4.4), in that host's chunks.
                bytes_per_sec = bytes_per_sec.min(cap.bytes_per_sec);
                ops_per_sec = ops_per_sec.min(cap.ops_per_sec);
                chunk_cap = cap.chunk_bytes;
            }
            if rephased
                || flow.bytes_per_sec != bytes_per_sec
                || flow.ops_per_sec != ops_per_sec
                || flow.chunk_cap != chunk_cap
            {
                flow.bytes_per_sec = bytes_per_sec;
                flow.ops_per_sec = ops_per_sec;
                flow.chunk_cap = chunk_cap;
                flow.generation = generation;
                changed = true;
            }
        }
        if changed {
            self.generation = generation;
            self.events
                .push_back(Event::AllotmentsChanged { generation });
        }
    }

    /// Gives the n flows that share offsets 0, 1/n, 2/n, ... in the order of their ids, and
    /// the others 0. Returns whether any offset changed.
    pub(super) fn assign_phases(&mut self) -> bool {
        if !std::mem::take(&mut self.sharing_changed) {
            // The flows that share are those of the last assignment (a latency flow
            // changed, or a flow went and came back): every offset would stay.
            return false;
        }
        let mut changed = false;
        self.phase_order.clear();
        for (index, flow) in self.flows.iter_mut().enumerate() {
            if flow.shares() {
                self.phase_order.push((flow.spec.id, index));
            } else if flow.phase != 0.0 {
                flow.phase = 0.0;
                changed = true;
            }
        }
        // Ids are unique, so an unstable sort gives the one id order, and it sorts in place.
        self.phase_order.sort_unstable_by_key(|&(id, _)| id);
        let n = self.phase_order.len() as f64;
        for (rank, &(_, index)) in self.phase_order.iter().enumerate() {
            let offset = rank as f64 / n;
            let flow = &mut self.flows[index];
            if flow.phase != offset {
                flow.phase = offset;
                changed = true;
            }
        }
        changed
    }
}
