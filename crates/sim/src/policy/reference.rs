//! The reference flow of Justitia §4.2.1, shared by `justitia` and `adaptive`: a small
//! message to a latency flow's peer on the policy's own queue pair every RefPeriod, whose
//! post-to-completion times feed the core's [`TailEstimator`].

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use justitia_core::estimator::{EstimatorError, Quantile, TailEstimator};
use justitia_core::flow::{FlowClass, FlowCounts, FlowSpec, TenantId};

use super::{FlowInfo, PolicyContext};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::Picos;

/// The reference flow and its tail estimate.
pub struct ReferenceProbe {
    qp: Option<QpId>,
    size: u32,
    posted: VecDeque<Picos>,
    estimator: TailEstimator,
}

impl ReferenceProbe {
    /// A probe of `size`-byte messages whose p99 is taken over the last `window` samples.
    pub fn new(size: u32, window: u32) -> Result<Self, EstimatorError> {
        Ok(ReferenceProbe {
            qp: None,
            size,
            posted: VecDeque::new(),
            estimator: TailEstimator::new(window as usize, Quantile::P99)?,
        })
    }

    /// Opens the probe's queue pair towards the peer of the first latency flow of `flows`,
    /// if there is one.
    pub fn connect(&mut self, ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        if let Some(peer) = flows
            .iter()
            .find(|f| f.spec.class == FlowClass::Latency)
            .map(|f| f.peer)
        {
            self.qp = Some(ctx.connect_probe(peer));
        }
    }

    /// Sends one reference message now.
    pub fn send(&mut self, ctx: &mut PolicyContext<'_>) {
        if let Some(qp) = self.qp {
            self.posted.push_back(ctx.now());
            ctx.post(
                qp,
                WorkRequest {
                    tag: 0,
                    opcode: Opcode::Write,
                    bytes: self.size,
                    inline: true,
                },
            );
        }
    }

    /// Takes a completion if it is the probe's (recording its latency); false otherwise.
    pub fn on_completion(&mut self, ctx: &PolicyContext<'_>, qp: QpId) -> bool {
        if Some(qp) != self.qp {
            return false;
        }
        if let Some(posted) = self.posted.pop_front() {
            self.estimator
                .record(Duration::from_nanos((ctx.now() - posted) / 1_000));
        }
        true
    }

    /// Current99, `None` before the first sample.
    pub fn current99(&self) -> Option<Duration> {
        self.estimator.estimate()
    }

    /// Forgets the samples (the set of flows changed what they measure).
    pub fn clear(&mut self) {
        self.estimator.clear();
    }
}

/// L, B, T of active flows, a tenant's flows of one class counting once (Justitia §4.2.2).
pub fn active_counts<'a>(active: impl Iterator<Item = &'a FlowSpec>) -> FlowCounts {
    let distinct: BTreeSet<(FlowClass, TenantId)> =
        active.map(|spec| (spec.class, spec.tenant)).collect();
    let mut counts = FlowCounts::default();
    for (class, _) in distinct {
        counts.add(class);
    }
    counts
}
