//! Publication: what the loop decided, written where the shapers and the operator read it.
//!
//! Inputs: the [`ControlLoop`](justitia_core::control_loop::ControlLoop)'s allotments (or, under `policy = "adaptive"`, the
//! adaptive driver's), the incast caps the peer channel's shares put on flows into a peer
//! (see `peering.rs`), and the loop's status. Outputs: each flow's slot in its tenant's
//! private page, the shared control block's status, and the metrics.
//!
//! Invariants: a flow's slot is written only into its own tenant's page; a flow the policy
//! gives no allotment is published as unpaced ([`unpaced_slot`]: a resource-hungry flow's
//! slot marked for one with no rate yet, any other unshaped), never left with another
//! flow's figures; an incast cap only lowers a rate; the status is published only when an
//! update ran or the flows changed, and publishing it allocates nothing.

use std::collections::BTreeMap;

use justitia_agent::block::{phase_to_fixed, BlockStatus, SlotAllotment, SlotState};
use justitia_core::incast::paced_plan;
use justitia_core::message_charge::MessageCharge;

use crate::adaptive::AdaptiveDriver;
use crate::metrics::Tenant;

use super::{secs, Daemon, Flow};

impl Daemon {
    /// Publishes the status into the block and the metrics when an update ran or the
    /// flows changed since the last publication; otherwise there is nothing new.
    pub(super) fn publish_status(&mut self) {
        let key = (
            self.lp.updates(),
            self.flows.len(),
            self.lp.generation() ^ self.adaptive.as_ref().map_or(0, |d| d.generation() << 32),
        );
        if self.published == Some(key) {
            return;
        }
        self.published = Some(key);
        let t = self.lp.target();
        let cur = self.lp.current_p99();
        self.block.set_status(BlockStatus {
            safe_util: self.lp.safe_util() as u64,
            current_p99_ns: cur.map_or(0, |d| d.as_nanos() as u64),
            target_p99_ns: t.value.map_or(0, |d| d.as_nanos() as u64),
            generation: self.lp.generation(),
        });
        self.metrics.safe_util.set(self.lp.safe_util());
        let counted = self.metrics.safe_util_decreases.get();
        self.metrics
            .safe_util_decreases
            .inc_by(self.lp.decreases().saturating_sub(counted));
        self.metrics.current_p99.set(secs(cur));
        self.metrics.target_p99.set(secs(t.value));
        let c = self.lp.counts();
        for (gauge, n) in self
            .class_gauges
            .iter()
            .zip([c.latency, c.bandwidth, c.throughput])
        {
            gauge.set(i64::from(n));
        }
        self.metrics.flows_registered.set(self.flows.len() as i64);
        if let Some(a) = self.adaptive.as_ref().map(AdaptiveDriver::state) {
            self.metrics
                .adaptive_pace
                .set(a.pace_bytes_per_sec.unwrap_or(f64::NAN));
            self.metrics.adaptive_chunk.set(i64::from(a.chunk_bytes));
            self.metrics.adaptive_fraction.set(a.fraction);
            self.metrics.adaptive_other_load.set(a.other_bytes_per_sec);
            self.metrics
                .adaptive_tail
                .set(a.tail_ns.map_or(f64::NAN, |ns| ns as f64 / 1e9));
            let counted = self.metrics.adaptive_applications_tail_updates.get();
            self.metrics
                .adaptive_applications_tail_updates
                .inc_by(a.applications_tail_updates.saturating_sub(counted));
            let counted = self.metrics.adaptive_decreases.get();
            self.metrics
                .adaptive_decreases
                .inc_by(a.decreases.saturating_sub(counted));
        }
    }

    /// Flow `id`'s slot under the policy in effect, lowered to its incast `cap` (see
    /// [`Self::incast_cap`]) under either policy.
    pub(super) fn slot_of(&self, id: u64, f: &Flow, cap: Option<f64>) -> SlotAllotment {
        if let Some(driver) = &self.adaptive {
            return match driver.allotment(id).map(|a| paced_plan(a, cap)) {
                Some(a) => SlotAllotment {
                    flow: id,
                    state: SlotState::Allotted,
                    bytes_per_sec: (a.bytes_per_sec as u64).max(1),
                    ops_per_sec: a.ops_per_sec.map_or(0, |o| (o as u64).max(1)),
                    chunk_bytes: u64::from(a.chunk_bytes),
                    token_bytes: u64::from(a.chunk_bytes),
                    generation: driver.generation(),
                    // One phase for all: each flow's pacer on its own schedule.
                    phase_offset: 0,
                    phase_epoch: 0,
                    charge: a.charge,
                },
                None => unpaced_slot(id, f, driver.generation()),
            };
        }
        match self.paced_allotment(id, cap) {
            Some(a) => SlotAllotment {
                flow: id,
                state: SlotState::Allotted,
                bytes_per_sec: a.bytes_per_sec as u64,
                ops_per_sec: a.ops_per_sec as u64,
                chunk_bytes: u64::from(a.chunk_bytes),
                token_bytes: a.token.bytes,
                generation: a.generation,
                // The shaper's pacer puts the flow at this place in the release interval
                // when the epoch is new, so flows sharing the NIC do not release together.
                phase_offset: phase_to_fixed(a.phase.offset),
                phase_epoch: a.phase.epoch,
                charge: MessageCharge::NONE,
            },
            None => unpaced_slot(id, f, 0),
        }
    }

    pub(super) fn publish_allotments(&mut self) {
        let mut per_uid: BTreeMap<u32, f64> = BTreeMap::new();
        let caps = self.incast_caps();
        for (&id, f) in &self.flows {
            let s = self.slot_of(id, f, self.incast_cap(&caps, f));
            if let Some(p) = self.pages.get(&f.tenant) {
                p.page.set_slot(f.slot, s);
            }
            *per_uid.entry(f.uid).or_default() += s.bytes_per_sec as f64;
        }
        self.metrics.tenant_allotment.clear();
        for (uid, v) in per_uid {
            self.metrics
                .tenant_allotment
                .get_or_create(&Tenant {
                    uid: uid.to_string(),
                })
                .set(v);
        }
    }

    /// A flow's allotted bytes/s under the policy in effect, lowered to its incast `cap`,
    /// as its slot holds it.
    pub(super) fn allotted_bytes(&self, id: u64, cap: Option<f64>) -> Option<f64> {
        match &self.adaptive {
            Some(driver) => driver
                .allotment(id)
                .map(|a| paced_plan(a, cap).bytes_per_sec),
            None => self.paced_allotment(id, cap).map(|a| a.bytes_per_sec),
        }
    }
}

/// A flow's slot while the policy gives it no allotment: a resource-hungry flow's slot is
/// marked for one with no rate yet (its shaper reads no allotment from it), any other
/// flow's is unshaped.
fn unpaced_slot(id: u64, f: &Flow, generation: u64) -> SlotAllotment {
    SlotAllotment {
        flow: id,
        state: if f.class.is_resource_hungry() {
            SlotState::Allotted
        } else {
            SlotState::Unshaped
        },
        bytes_per_sec: 0,
        ops_per_sec: 0,
        chunk_bytes: 0,
        token_bytes: 0,
        generation,
        phase_offset: 0,
        phase_epoch: 0,
        charge: MessageCharge::NONE,
    }
}
