//! Yield planning for the `preempt` and `adaptive` policies.
//!
//! An RNIC schedules its queue pairs without regard to message size, so a QP sending a large
//! message holds the RNIC while small-message QPs wait. PeRF (§3.5.2, §4.1) splits every
//! large message into sub-messages of SUB_MSG_SIZE bytes and posts zero-wait work requests
//! between them: each is a payload-free request the large-message QP must get through, during
//! which the RNIC turns to other QPs, so small messages get through sooner while the large
//! one still takes all bandwidth nobody else wants (no pacing, hence work-conserving). The number of yields after each sub-message is
//! ceil(SUB_MSG_SIZE / 0_WAIT_UNIT): 16 with the defaults of 16 KB and 1 KB, 19 for PeRF_S
//! (unit 900 B, §5.3), which favours small messages more.
//!
//! PeRF's zero-wait request is a vendor extension; the standard-verbs form used here is a
//! zero-length, unsignaled RDMA WRITE ([`yield_request`]): it carries no payload, and the
//! responder checks neither address nor key for it (InfiniBand spec C9-88), though its QP
//! must allow remote writes. Yields are unsignaled, so they free their send-queue slots
//! only when a later signaled request completes; PeRF polls them early for the same reason
//! (§4.3), and a shaper must count them against the queue depth it keeps for the
//! application.
//!
//! Sub-messages of a real work request come from [`crate::chunk::ChunkPlan`] with
//! [`YieldPlanner::chunk_limits`]; [`YieldPlanner::yields_after`] says how many yields follow
//! each chunk. [`YieldPlanner::steps`] plans a bare byte count (for the simulator). The
//! yield density can be changed at run time ([`YieldPlanner::set_yields_per_sub_message`]),
//! which is how the `adaptive` policy steers it from the latency controller; a plan in
//! progress picks the change up at its next step ([`YieldPlanner::next_step`]).
//!
//! Invariants: the steps of a plan cover its bytes exactly once, in order, each at most one
//! sub-message long (a plan of zero bytes is one empty step); every step but the last is
//! followed by the current yield count and the last by none; the yield count never exceeds
//! [`MAX_YIELDS_PER_SUB_MESSAGE`].

use std::iter::FusedIterator;

use crate::chunk::{Chunk, ChunkLimits, Opcode, RemoteAddr, SendFlags, SgeList, WorkRequest};
use crate::profile::KIB;

/// PeRF's default SUB_MSG_SIZE: 16 KB.
pub const DEFAULT_SUB_MESSAGE_BYTES: u32 = 16 * KIB;
/// PeRF's default 0_WAIT_UNIT: 1 KB, giving 16 yields per sub-message.
pub const DEFAULT_YIELD_UNIT_BYTES: u32 = KIB;
/// PeRF_S's 0_WAIT_UNIT: 900 B, giving 19 yields per 16 KB sub-message.
pub const SMALL_MESSAGE_FRIENDLY_YIELD_UNIT_BYTES: u32 = 900;
/// The most yields after one sub-message. Every yield takes a send-queue slot until a
/// later signaled request completes, and send queues hold a few hundred to a few thousand
/// entries, so more would stall the application rather than help its neighbours.
pub const MAX_YIELDS_PER_SUB_MESSAGE: u32 = 1024;

/// Sub-message size and yield unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct YieldConfig {
    /// Bytes per sub-message (SUB_MSG_SIZE).
    pub sub_message_bytes: u32,
    /// Bytes of sub-message per yield (0_WAIT_UNIT); smaller means more yields.
    pub yield_unit_bytes: u32,
}

impl Default for YieldConfig {
    /// PeRF's defaults: 16 KB sub-messages, 1 KB unit.
    fn default() -> Self {
        YieldConfig {
            sub_message_bytes: DEFAULT_SUB_MESSAGE_BYTES,
            yield_unit_bytes: DEFAULT_YIELD_UNIT_BYTES,
        }
    }
}

/// A yield configuration value out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum YieldConfigError {
    /// The sub-message size is zero.
    #[error("yield config: sub_message_bytes must be positive")]
    ZeroSubMessage,
    /// The yield unit is zero.
    #[error("yield config: yield_unit_bytes must be positive")]
    ZeroYieldUnit,
    /// The unit is so small that a sub-message would be followed by too many yields.
    #[error("yield config: a {unit} B unit gives {yields} yields per {sub_message} B sub-message, more than {MAX_YIELDS_PER_SUB_MESSAGE}")]
    TooManyYields {
        /// The sub-message size.
        sub_message: u32,
        /// The yield unit.
        unit: u32,
        /// The yields it would take.
        yields: u32,
    },
}

impl YieldConfig {
    /// Checks that both sizes are positive and the yield count stays within
    /// [`MAX_YIELDS_PER_SUB_MESSAGE`].
    pub fn validate(&self) -> Result<(), YieldConfigError> {
        self.yields_per_sub_message().map(|_| ())
    }

    /// ceil(sub_message_bytes / yield_unit_bytes), validated.
    pub fn yields_per_sub_message(&self) -> Result<u32, YieldConfigError> {
        if self.sub_message_bytes == 0 {
            return Err(YieldConfigError::ZeroSubMessage);
        }
        if self.yield_unit_bytes == 0 {
            return Err(YieldConfigError::ZeroYieldUnit);
        }
        let yields = yields_for(self.sub_message_bytes, self.yield_unit_bytes);
        if yields > MAX_YIELDS_PER_SUB_MESSAGE {
            return Err(YieldConfigError::TooManyYields {
                sub_message: self.sub_message_bytes,
                unit: self.yield_unit_bytes,
                yields,
            });
        }
        Ok(yields)
    }
}

/// ceil(sub_message / unit): the yields that give small-message QPs one turn per `unit`
/// bytes the large-message QP sends. `unit` must be positive.
const fn yields_for(sub_message: u32, unit: u32) -> u32 {
    sub_message.div_ceil(unit)
}

/// One sub-message of a plan and the yields posted after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct YieldStep {
    /// Bytes of the message before this sub-message.
    pub offset: u64,
    /// Length of this sub-message.
    pub bytes: u32,
    /// Zero-length yields to post after it; 0 after the last sub-message.
    pub yields_after: u32,
}

/// Where a plan over a bare byte count stands; advanced by [`YieldPlanner::next_step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct YieldCursor {
    total: u64,
    offset: u64,
    done: bool,
}

impl YieldCursor {
    /// A cursor at the start of a message of `total_bytes` bytes.
    pub fn new(total_bytes: u64) -> Self {
        YieldCursor {
            total: total_bytes,
            offset: 0,
            done: false,
        }
    }

    /// Bytes not yet covered by a step.
    pub fn remaining_bytes(&self) -> u64 {
        self.total - self.offset
    }

    /// True once the last step has been handed out.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

/// Sub-message size and current yield density; plans sub-messages and the yields between
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct YieldPlanner {
    sub_message_bytes: u32,
    yields_per_sub_message: u32,
}

impl YieldPlanner {
    /// A planner with the configured sub-message size and ceil(S/U) yields.
    pub fn new(config: YieldConfig) -> Result<Self, YieldConfigError> {
        Ok(YieldPlanner {
            sub_message_bytes: config.sub_message_bytes,
            yields_per_sub_message: config.yields_per_sub_message()?,
        })
    }

    /// Bytes per sub-message.
    pub fn sub_message_bytes(&self) -> u32 {
        self.sub_message_bytes
    }

    /// Yields posted after every sub-message but the last.
    pub fn yields_per_sub_message(&self) -> u32 {
        self.yields_per_sub_message
    }

    /// Sets the yield density directly (the `adaptive` policy's knob), capped at
    /// [`MAX_YIELDS_PER_SUB_MESSAGE`]; 0 splits without yielding.
    pub fn set_yields_per_sub_message(&mut self, yields: u32) {
        self.yields_per_sub_message = yields.min(MAX_YIELDS_PER_SUB_MESSAGE);
    }

    /// Sets the yield density from a yield unit, as PeRF configures it.
    pub fn set_yield_unit(&mut self, unit_bytes: u32) -> Result<(), YieldConfigError> {
        self.yields_per_sub_message = YieldConfig {
            sub_message_bytes: self.sub_message_bytes,
            yield_unit_bytes: unit_bytes,
        }
        .yields_per_sub_message()?;
        Ok(())
    }

    /// Chunk limits that split a work request into this planner's sub-messages.
    pub fn chunk_limits(&self, max_sge: usize, split_two_sided: bool) -> ChunkLimits {
        ChunkLimits {
            chunk_bytes: self.sub_message_bytes,
            max_sge,
            split_two_sided,
        }
    }

    /// Yields to post after `chunk`, a sub-message planned with [`Self::chunk_limits`].
    pub fn yields_after(&self, chunk: &Chunk) -> u32 {
        self.yields_after_sub_message(chunk.is_last)
    }

    /// The next step of the plan at `cursor`, with the planner's current sub-message size
    /// and yield density, or `None` when the plan is complete.
    pub fn next_step(&self, cursor: &mut YieldCursor) -> Option<YieldStep> {
        if cursor.done {
            return None;
        }
        let remaining = cursor.total - cursor.offset;
        let bytes = u32::try_from(remaining)
            .unwrap_or(u32::MAX)
            .min(self.sub_message_bytes);
        let step_offset = cursor.offset;
        cursor.offset += u64::from(bytes);
        cursor.done = cursor.offset == cursor.total;
        Some(YieldStep {
            offset: step_offset,
            bytes,
            yields_after: self.yields_after_sub_message(cursor.done),
        })
    }

    /// The whole plan for a message of `total_bytes` bytes at the current density.
    pub fn steps(&self, total_bytes: u64) -> YieldSteps<'_> {
        YieldSteps {
            planner: self,
            cursor: YieldCursor::new(total_bytes),
        }
    }

    /// The one rule: yields between sub-messages, none after the last.
    fn yields_after_sub_message(&self, is_last: bool) -> u32 {
        if is_last {
            0
        } else {
            self.yields_per_sub_message
        }
    }
}

impl Default for YieldPlanner {
    /// PeRF's defaults: 16 KB sub-messages, 16 yields.
    fn default() -> Self {
        YieldPlanner {
            sub_message_bytes: DEFAULT_SUB_MESSAGE_BYTES,
            yields_per_sub_message: yields_for(DEFAULT_SUB_MESSAGE_BYTES, DEFAULT_YIELD_UNIT_BYTES),
        }
    }
}

/// The steps of one plan at a fixed density; see [`YieldPlanner::steps`].
#[derive(Clone, Debug)]
pub struct YieldSteps<'a> {
    planner: &'a YieldPlanner,
    cursor: YieldCursor,
}

impl Iterator for YieldSteps<'_> {
    type Item = YieldStep;

    fn next(&mut self) -> Option<YieldStep> {
        self.planner.next_step(&mut self.cursor)
    }
}

impl FusedIterator for YieldSteps<'_> {}

/// The work request of one yield: a zero-length, unsignaled RDMA WRITE. It has no SGEs and
/// a null remote address and key, which the responder does not check for zero-length
/// writes.
pub fn yield_request() -> WorkRequest {
    WorkRequest {
        wr_id: 0,
        opcode: Opcode::Write,
        sges: SgeList::new(),
        remote: Some(RemoteAddr::default()),
        flags: SendFlags::default(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::chunk::{ChunkPlan, Sge};

    #[test]
    fn defaults_give_sixteen_yields_per_sixteen_kib() {
        let planner = YieldPlanner::new(YieldConfig::default()).unwrap();
        assert_eq!(planner.sub_message_bytes(), 16 * 1024);
        assert_eq!(planner.yields_per_sub_message(), 16);
        assert_eq!(planner, YieldPlanner::default());
    }

    #[test]
    fn small_message_friendly_unit_gives_nineteen_yields() {
        let config = YieldConfig {
            yield_unit_bytes: SMALL_MESSAGE_FRIENDLY_YIELD_UNIT_BYTES,
            ..YieldConfig::default()
        };
        assert_eq!(config.yields_per_sub_message(), Ok(19));
    }

    #[test]
    fn plan_over_one_mib_is_sixty_four_sub_messages_with_yields_between() {
        let planner = YieldPlanner::default();
        let steps: Vec<YieldStep> = planner.steps(1 << 20).collect();
        assert_eq!(steps.len(), 64);
        assert!(steps.iter().all(|s| s.bytes == 16 * 1024));
        assert!(steps[..63].iter().all(|s| s.yields_after == 16));
        assert_eq!(steps[63].yields_after, 0);
        assert_eq!(steps[63].offset, 63 * 16 * 1024);
        let total_yields: u32 = steps.iter().map(|s| s.yields_after).sum();
        assert_eq!(total_yields, 63 * 16);
    }

    #[test]
    fn short_tail_is_the_last_sub_message() {
        let steps: Vec<YieldStep> = YieldPlanner::default().steps(40_000).collect();
        let bytes: Vec<u32> = steps.iter().map(|s| s.bytes).collect();
        assert_eq!(bytes, [16_384, 16_384, 7_232]);
        assert_eq!(steps[2].yields_after, 0);
    }

    #[test]
    fn message_within_one_sub_message_has_no_yields() {
        let steps: Vec<YieldStep> = YieldPlanner::default().steps(16 * 1024).collect();
        assert_eq!(
            steps,
            [YieldStep {
                offset: 0,
                bytes: 16 * 1024,
                yields_after: 0
            }]
        );
        assert_eq!(YieldPlanner::default().steps(0).count(), 1);
    }

    /// The densest plan allowed: 1024 yields a sub-message (1 MiB in 1 KiB units) is
    /// accepted, one more refused.
    #[test]
    fn the_most_yields_a_sub_message_is_accepted() {
        let most = YieldConfig {
            sub_message_bytes: MAX_YIELDS_PER_SUB_MESSAGE * 1024,
            yield_unit_bytes: 1024,
        };
        assert_eq!(most.yields_per_sub_message(), Ok(1024));
        let more = YieldConfig {
            sub_message_bytes: most.sub_message_bytes + 1,
            ..most
        };
        assert!(more.yields_per_sub_message().is_err());
    }

    #[test]
    fn density_change_applies_to_the_next_step_of_a_plan_in_progress() {
        let mut planner = YieldPlanner::default();
        let mut cursor = YieldCursor::new(4 * 16 * 1024);
        assert!(!cursor.is_done());
        assert_eq!(planner.next_step(&mut cursor).unwrap().yields_after, 16);
        assert!(!cursor.is_done(), "three sub-messages to go");
        planner.set_yields_per_sub_message(4);
        assert_eq!(planner.next_step(&mut cursor).unwrap().yields_after, 4);
        planner.set_yields_per_sub_message(0);
        assert_eq!(planner.next_step(&mut cursor).unwrap().yields_after, 0);
        assert_eq!(cursor.remaining_bytes(), 16 * 1024);
        planner.set_yields_per_sub_message(u32::MAX);
        assert_eq!(planner.yields_per_sub_message(), MAX_YIELDS_PER_SUB_MESSAGE);
        let last = planner.next_step(&mut cursor).unwrap();
        assert_eq!(last.yields_after, 0);
        assert!(cursor.is_done());
        assert_eq!(planner.next_step(&mut cursor), None);
    }

    #[test]
    fn yield_unit_sets_density_and_is_validated() {
        let mut planner = YieldPlanner::default();
        planner.set_yield_unit(4096).unwrap();
        assert_eq!(planner.yields_per_sub_message(), 4);
        assert_eq!(
            planner.set_yield_unit(0),
            Err(YieldConfigError::ZeroYieldUnit)
        );
        assert!(matches!(
            planner.set_yield_unit(1),
            Err(YieldConfigError::TooManyYields { yields: 16_384, .. })
        ));
        assert_eq!(planner.yields_per_sub_message(), 4);
    }

    #[test]
    fn invalid_configs_are_refused() {
        let zero_sub = YieldConfig {
            sub_message_bytes: 0,
            ..YieldConfig::default()
        };
        assert_eq!(
            YieldPlanner::new(zero_sub),
            Err(YieldConfigError::ZeroSubMessage)
        );
        let zero_unit = YieldConfig {
            yield_unit_bytes: 0,
            ..YieldConfig::default()
        };
        assert_eq!(zero_unit.validate(), Err(YieldConfigError::ZeroYieldUnit));
        assert_eq!(YieldConfig::default().validate(), Ok(()));
    }

    #[test]
    fn chunk_plan_with_planner_limits_gets_yields_between_sub_messages() {
        let planner = YieldPlanner::default();
        let request = WorkRequest {
            wr_id: 1,
            opcode: Opcode::Write,
            sges: SgeList::try_from(
                [Sge {
                    addr: 0x1000,
                    length: 40_000,
                    lkey: 1,
                }]
                .as_slice(),
            )
            .unwrap(),
            remote: Some(RemoteAddr { addr: 0, rkey: 2 }),
            flags: SendFlags {
                signaled: true,
                ..SendFlags::default()
            },
        };
        let plan = ChunkPlan::new(request, planner.chunk_limits(1, false)).unwrap();
        let yields: Vec<u32> = plan.map(|c| planner.yields_after(&c)).collect();
        assert_eq!(yields, [16, 16, 0]);
    }

    #[test]
    fn yield_request_is_a_zero_length_unsignaled_write_that_plans_whole() {
        let request = yield_request();
        assert_eq!(request.opcode, Opcode::Write);
        assert!(request.sges.is_empty());
        assert!(!request.flags.signaled);
        let plan = ChunkPlan::new(request, YieldPlanner::default().chunk_limits(1, false));
        assert_eq!(plan.map(|p| p.count()).ok(), Some(1));
    }
}
