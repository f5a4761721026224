//! The reference flow of Justitia §4.2.1, shared by `justitia` and `adaptive`: the
//! transport only. The core's control loop says when a probe is due and keeps the
//! samples; this posts the small WRITE on the policy's own queue pair and recognises its
//! completion.

use super::{FlowInfo, PolicyContext};
use crate::rnic::{Opcode, QpId, WorkRequest};
use justitia_core::flow::FlowClass;

/// The reference flow's queue pair and message.
pub struct ReferenceProbe {
    qp: Option<QpId>,
    size: u32,
}

impl ReferenceProbe {
    /// A probe of `size`-byte messages, not connected yet.
    pub fn new(size: u32) -> Self {
        ReferenceProbe { qp: None, size }
    }

    /// Opens the probe's queue pair towards the peer of the first latency flow of `flows`,
    /// if there is one, or else of the first flow (whose path a latency flow would share);
    /// a host without flows sends no probe.
    pub fn connect(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        let peer = flows
            .iter()
            .find(|f| f.spec.class == FlowClass::Latency)
            .or_else(|| flows.first())
            .map(|f| f.peer);
        if let Some(peer) = peer {
            self.qp = Some(ctx.connect_probe(peer));
        }
    }

    /// Posts one reference message now (inline, as a 10 B WRITE is); false without a
    /// queue pair.
    pub fn send(&mut self, ctx: &mut PolicyContext<'_>) -> bool {
        let Some(qp) = self.qp else {
            return false;
        };
        ctx.post(
            qp,
            WorkRequest {
                tag: 0,
                opcode: Opcode::Write,
                bytes: self.size,
                inline: true,
            },
        );
        true
    }

    /// Whether `qp` is the probe's queue pair.
    pub fn owns(&self, qp: QpId) -> bool {
        Some(qp) == self.qp
    }
}
