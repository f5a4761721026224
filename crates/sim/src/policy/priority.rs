//! `priority`: hardware strict priority, the baseline PeRF calls SP (ATC'24 §5.2.1, Fig 7).
//!
//! This models an RNIC whose traffic classes an operator has configured for strict
//! priority, with each application mapped to a class by the service level of its
//! connections: latency flows on lane 2, throughput flows on lane 1, bandwidth flows on
//! lane 0 (the lanes of the scenario's `sl` are replaced). The policy does that once, at
//! the start, with [`PolicyContext::set_priority`], and otherwise passes requests through
//! as `native` does: no splitting, no pacing, no probe. What the hardware then does is the
//! RNIC model's ([`crate::rnic`]): its arbiter serves a ready queue pair of a higher lane
//! before any of a lower one, round-robin within a lane, lets a lane-0 packet into its
//! transmit FIFO only when the FIFO is empty, so a latency message waits for at most the
//! packet being sent, and switches on the way buffer and arbitrate each lane apart.
//!
//! Why Justitia and PeRF exist although hardware can do this:
//!
//! - **Few hardware queues.** There are at most a handful of classes (InfiniBand's 15 data
//!   VLs, Ethernet's 8 priorities, of which switches often offer two lossless ones:
//!   Justitia §6.4.2). Tenants outnumber them, so flows share a class and meet each other's
//!   anomalies inside it (Justitia Fig 21).
//! - **Configuration.** Every NIC and switch on the path must map service levels to
//!   classes and schedule them, and each application must be put in its class ahead of
//!   time; that does not follow tenants whose demands change (PeRF §1).
//! - **Starvation.** Strict priority gives a higher class everything it asks for: a
//!   throughput flow that saturates the RNIC with small messages leaves a bandwidth flow
//!   below it almost nothing (PeRF Fig 7b, where SP's B_App collapses against an M_App).

use justitia_core::flow::FlowClass;

use super::{FlowInfo, Policy, PolicyContext};
use crate::rnic::{QpId, WorkRequest};

/// The lane a class of flow is put on: latency above throughput above bandwidth.
fn lane_of(class: FlowClass) -> u8 {
    match class {
        FlowClass::Latency => 2,
        FlowClass::Throughput => 1,
        FlowClass::Bandwidth => 0,
    }
}

/// Strict-priority traffic classes on one host, set up by class.
#[derive(Debug, Default)]
pub struct PriorityPolicy;

impl Policy for PriorityPolicy {
    fn name(&self) -> &str {
        "priority"
    }

    fn on_start(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        for flow in flows {
            let lane = lane_of(flow.spec.class);
            for &qp in &flow.qps {
                ctx.set_priority(qp, lane);
            }
        }
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        ctx.post(qp, wr);
    }
}
