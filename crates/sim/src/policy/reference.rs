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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::ids::HostId;
    use crate::policy::test_host::TestHost;

    /// The probe goes towards the first latency flow's peer, else the first flow's; a host
    /// without flows sends none.
    #[test]
    fn the_probe_follows_the_latency_flow() {
        let mut host = TestHost::new();
        let bandwidth = host.flow_to(1, FlowClass::Bandwidth, HostId(1));
        let latency = host.flow_to(2, FlowClass::Latency, HostId(2));
        for (flows, peer) in [
            (vec![bandwidth.clone(), latency], HostId(2)),
            (vec![bandwidth], HostId(1)),
        ] {
            let mut probe = ReferenceProbe::new(10);
            probe.connect(&mut host.ctx(), &flows);
            assert!(probe.send(&mut host.ctx()));
            let qp = (0..64).map(QpId).find(|&qp| probe.owns(qp)).unwrap();
            assert_eq!(host.peer_of(qp), peer);
            let posted = host.posted(qp);
            assert_eq!(posted.len(), 1);
            assert_eq!((posted[0].opcode, posted[0].bytes), (Opcode::Write, 10));
            assert!(!probe.owns(flows[0].qps[0]));
        }
        let mut alone = ReferenceProbe::new(10);
        alone.connect(&mut host.ctx(), &[]);
        assert!(!alone.send(&mut host.ctx()));
    }
}
