//! `preempt`: PeRF's message-level preemption (ATC'24, §3.5.2 and §4.1) on standard verbs.
//!
//! Every message of a bandwidth flow is cut into SUB_MSG_SIZE sub-messages, and after each
//! but the last the shaper posts ceil(SUB_MSG_SIZE / 0_WAIT_UNIT) zero-length RDMA WRITEs
//! on the same queue pair (the core's [`YieldPlanner`]; 16 with the defaults of 16 KB and
//! 1 KB). Each yield is a work request the RNIC must fetch, process and send as a
//! header-only packet, during which its round-robin arbiter serves other queue pairs, so a
//! small message waits behind at most a sub-message's worth of the large one instead of
//! the transmit pipeline full of it. Nothing is paced: the bandwidth flow keeps every turn
//! nobody else wants (work conservation). Classes are the scenario's, as for `justitia`.
//!
//! Not modelled: PeRF's QP-level PAUSE/RESUME of multi-queue-pair applications
//! (QNum_allow), its early completion engine and its own classifier; the peer of a split
//! SEND is assumed to cooperate.

use justitia_core::yield_plan::{YieldConfig, YieldConfigError, YieldPlanner};
use serde::{Deserialize, Serialize};

use super::yielding::YieldShaper;
use super::{FlowInfo, Policy, PolicyContext, PolicyFigures};
use crate::rnic::{QpId, WorkRequest};
use crate::units::ByteSize;

/// Parameters of the `preempt` policy (and the yield baseline of `adaptive`); the
/// defaults are PeRF's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreemptParams {
    /// SUB_MSG_SIZE (PeRF: 16 KB).
    #[serde(default = "default_sub_message")]
    pub sub_message: ByteSize,
    /// 0_WAIT_UNIT: sub-message bytes per yield (PeRF: 1 KB; PeRF_S: 900 B).
    #[serde(default = "default_yield_unit")]
    pub yield_unit: ByteSize,
    /// Sub-messages a queue pair may have in flight: enough to keep a 100 Gb/s link busy
    /// over a few microseconds of round trip, few enough that the send queue stays short.
    #[serde(default = "default_window")]
    pub window: u32,
}

fn default_sub_message() -> ByteSize {
    ByteSize(u64::from(
        justitia_core::yield_plan::DEFAULT_SUB_MESSAGE_BYTES,
    ))
}

fn default_yield_unit() -> ByteSize {
    ByteSize(u64::from(
        justitia_core::yield_plan::DEFAULT_YIELD_UNIT_BYTES,
    ))
}

fn default_window() -> u32 {
    8
}

impl Default for PreemptParams {
    fn default() -> Self {
        PreemptParams {
            sub_message: default_sub_message(),
            yield_unit: default_yield_unit(),
            window: default_window(),
        }
    }
}

impl PreemptParams {
    /// The core's yield configuration.
    pub fn yield_config(&self) -> Result<YieldConfig, YieldConfigError> {
        let bytes = |size: ByteSize| u32::try_from(size.bytes()).unwrap_or(u32::MAX);
        let config = YieldConfig {
            sub_message_bytes: bytes(self.sub_message),
            yield_unit_bytes: bytes(self.yield_unit),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges; the error is (field, reason).
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.window == 0 {
            return Err(("window".into(), "must be at least 1".into()));
        }
        self.yield_config()
            .map(|_| ())
            .map_err(|e| ("yield_unit".into(), e.to_string()))
    }
}

/// PeRF's preemption on one host.
pub struct PreemptPolicy {
    planner: YieldPlanner,
    window: u32,
    shaper: Option<YieldShaper>,
}

impl PreemptPolicy {
    /// A policy with these parameters.
    pub fn new(params: &PreemptParams) -> Result<Self, YieldConfigError> {
        Ok(PreemptPolicy {
            planner: YieldPlanner::new(params.yield_config()?)?,
            window: params.window,
            shaper: None,
        })
    }
}

impl Policy for PreemptPolicy {
    fn name(&self) -> &str {
        "preempt"
    }

    fn on_start(&mut self, _ctx: &mut PolicyContext<'_>, flows: &[FlowInfo]) {
        self.shaper = Some(YieldShaper::new(self.planner, self.window, flows));
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        match &mut self.shaper {
            Some(shaper) => shaper.on_post(ctx, qp, wr),
            None => ctx.post(qp, wr),
        }
    }

    fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        match &mut self.shaper {
            Some(shaper) => shaper.on_completion(ctx, qp, tag),
            None => ctx.complete(qp, tag),
        }
    }

    fn figures(&self) -> PolicyFigures {
        let mut f = PolicyFigures::new();
        f.insert(
            "yields_per_sub_message".into(),
            f64::from(self.planner.yields_per_sub_message()),
        );
        if let Some(shaper) = &self.shaper {
            let c = shaper.counters();
            f.insert("sub_messages".into(), c.sub_messages as f64);
            f.insert("yields".into(), c.yields as f64);
        }
        f
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use justitia_core::flow::FlowClass;

    use super::*;
    use crate::policy::test_host::{write, TestHost};

    fn params(sub_message: u64, yield_unit: u64, window: u32) -> PreemptParams {
        PreemptParams {
            sub_message: ByteSize(sub_message),
            yield_unit: ByteSize(yield_unit),
            window,
        }
    }

    /// The parameters reach the core as given, and what the core or the window refuses is
    /// refused with the field to blame.
    #[test]
    fn parameters_are_checked_and_passed_on() {
        let config = PreemptParams::default().yield_config().unwrap();
        assert_eq!(
            (config.sub_message_bytes, config.yield_unit_bytes),
            (16 * 1024, 1024)
        );
        let config = params(4096, 900, 1).yield_config().unwrap();
        assert_eq!(
            (config.sub_message_bytes, config.yield_unit_bytes),
            (4096, 900)
        );
        assert_eq!(params(4096, 900, 1).validate(), Ok(()));
        assert_eq!(params(4096, 900, 0).validate().unwrap_err().0, "window");
        assert_eq!(params(4096, 0, 1).validate().unwrap_err().0, "yield_unit");
        assert!(PreemptPolicy::new(&params(4096, 0, 1)).is_err());
    }

    /// The policy reports PeRF's density (16 KB / 1 KB = 16 yields per sub-message) and
    /// what it handed the RNIC: a 64 KB message is four sub-messages and 3 x 16 yields.
    #[test]
    fn figures_count_what_was_handed() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let mut policy = PreemptPolicy::new(&PreemptParams::default()).unwrap();
        policy.on_start(&mut host.ctx(), std::slice::from_ref(&info));
        policy.on_post(&mut host.ctx(), info.qps[0], write(7, 64 * 1024));
        let figures = policy.figures();
        assert_eq!(figures["yields_per_sub_message"], 16.0);
        assert_eq!(figures["sub_messages"], 4.0);
        assert_eq!(figures["yields"], 48.0);
    }
}
