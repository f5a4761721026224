//! `preempt`'s machinery: bandwidth flows' messages cut into sub-messages with zero-length
//! yield writes between them.
//!
//! A [`YieldShaper`] keeps, per queue pair of a bandwidth flow, the messages the
//! application posted and a [`YieldCursor`] into the head one. It hands the RNIC at most
//! `window` sub-messages per queue pair ahead of their completions (so that a change of the
//! yield density takes effect within a few sub-messages, and the send queue stays as short
//! as a real one), each followed by the planner's current number of yields: real
//! zero-payload RDMA WRITEs on the same queue pair, which the RNIC model fetches, books at
//! its processing unit and sends as header-only packets, and which thereby give the other
//! queue pairs turns in the round-robin arbiter. The model signals every request, so yields
//! complete too; the shaper drops those completions, as a shaper that posts them unsignaled
//! never sees them. The application hears of a message when its last sub-message completes.
//! Nothing is paced.
//!
//! Latency and throughput flows, and requests on queue pairs the shaper does not know,
//! pass through untouched.

use std::collections::{BTreeMap, VecDeque};

use justitia_core::flow::FlowClass;
use justitia_core::yield_plan::{YieldCursor, YieldPlanner};

use super::{FlowInfo, PolicyContext};
use crate::rnic::{Opcode, QpId, WorkRequest};

/// A message of a bandwidth flow not yet fully handed to the RNIC.
struct Message {
    app_tag: u64,
    opcode: Opcode,
    inline: bool,
    cursor: YieldCursor,
}

/// A bandwidth flow's queue pair.
struct YieldQp {
    pending: VecDeque<Message>,
    /// Sub-messages handed to the RNIC and not completed.
    in_flight: u32,
}

/// What a request the shaper handed to the RNIC stands for.
#[derive(Clone, Copy)]
enum Handed {
    /// An application request passed through.
    Whole { app_tag: u64 },
    /// A sub-message; `last` ends the application's message.
    SubMessage { app_tag: u64, last: bool },
    /// A zero-length yield.
    Yield,
}

/// Counters the policies report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct YieldCounters {
    /// Sub-messages handed to the RNIC.
    pub sub_messages: u64,
    /// Zero-length yields handed to the RNIC.
    pub yields: u64,
}

/// Sub-message splitting with yields for one host's bandwidth flows.
pub struct YieldShaper {
    planner: YieldPlanner,
    window: u32,
    qps: BTreeMap<QpId, YieldQp>,
    handed: BTreeMap<u64, Handed>,
    next_tag: u64,
    counters: YieldCounters,
}

impl YieldShaper {
    /// A shaper for `flows` (those not of class bandwidth are passed through), planning with
    /// `planner` and keeping at most `window` sub-messages in flight per queue pair.
    pub fn new(planner: YieldPlanner, window: u32, flows: &[FlowInfo]) -> Self {
        let qps = flows
            .iter()
            .filter(|f| f.spec.class == FlowClass::Bandwidth)
            .flat_map(|f| f.qps.iter())
            .map(|&qp| {
                let entry = YieldQp {
                    pending: VecDeque::new(),
                    in_flight: 0,
                };
                (qp, entry)
            })
            .collect();
        YieldShaper {
            planner,
            window: window.max(1),
            qps,
            handed: BTreeMap::new(),
            next_tag: 1,
            counters: YieldCounters::default(),
        }
    }

    /// What the shaper has handed to the RNIC so far.
    pub fn counters(&self) -> YieldCounters {
        self.counters
    }

    /// An application posted `wr` on `qp`.
    pub fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let Some(entry) = self.qps.get_mut(&qp) else {
            let tag = hand(
                &mut self.handed,
                &mut self.next_tag,
                Handed::Whole { app_tag: wr.tag },
            );
            ctx.post(qp, WorkRequest { tag, ..wr });
            return;
        };
        entry.pending.push_back(Message {
            app_tag: wr.tag,
            opcode: wr.opcode,
            inline: wr.inline,
            cursor: YieldCursor::new(u64::from(wr.bytes)),
        });
        self.pump(ctx, qp);
    }

    /// A request the shaper handed to the RNIC completed; tells the application when it
    /// ends one of its requests.
    pub fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        match self.handed.remove(&tag) {
            Some(Handed::Whole { app_tag }) => ctx.complete(qp, app_tag),
            Some(Handed::SubMessage { app_tag, last }) => {
                if let Some(entry) = self.qps.get_mut(&qp) {
                    entry.in_flight = entry.in_flight.saturating_sub(1);
                }
                if last {
                    ctx.complete(qp, app_tag);
                }
                self.pump(ctx, qp);
            }
            Some(Handed::Yield) | None => {}
        }
    }

    /// Hands the RNIC what the window allows on `qp`.
    fn pump(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId) {
        let Some(entry) = self.qps.get_mut(&qp) else {
            return;
        };
        while entry.in_flight < self.window {
            let Some(head) = entry.pending.front_mut() else {
                return;
            };
            let Some(step) = self.planner.next_step(&mut head.cursor) else {
                entry.pending.pop_front();
                continue;
            };
            let (app_tag, opcode, inline) = (head.app_tag, head.opcode, head.inline);
            let last = head.cursor.is_done();
            if last {
                entry.pending.pop_front();
            }
            entry.in_flight += 1;
            let tag = hand(
                &mut self.handed,
                &mut self.next_tag,
                Handed::SubMessage { app_tag, last },
            );
            self.counters.sub_messages += 1;
            ctx.post(
                qp,
                WorkRequest {
                    tag,
                    opcode,
                    bytes: step.bytes,
                    inline,
                },
            );
            for _ in 0..step.yields_after {
                let tag = hand(&mut self.handed, &mut self.next_tag, Handed::Yield);
                self.counters.yields += 1;
                ctx.post(qp, yield_request(tag));
            }
        }
    }
}

/// Files `what` under the next tag, which it returns.
fn hand(handed: &mut BTreeMap<u64, Handed>, next_tag: &mut u64, what: Handed) -> u64 {
    let tag = *next_tag;
    *next_tag += 1;
    handed.insert(tag, what);
    tag
}

/// The standard-verbs yield: a zero-length RDMA WRITE (a header-only packet).
fn yield_request(tag: u64) -> WorkRequest {
    WorkRequest {
        tag,
        opcode: Opcode::Write,
        bytes: 0,
        inline: true,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use justitia_core::yield_plan::YieldConfig;

    use super::*;
    use crate::policy::test_host::{write, TestHost};

    /// PeRF's defaults: 16 KB sub-messages, a yield per 1 KB of them.
    fn planner() -> YieldPlanner {
        let config = YieldConfig {
            sub_message_bytes: 16 * 1024,
            yield_unit_bytes: 1024,
        };
        YieldPlanner::new(config).unwrap()
    }

    /// A 64 KB message goes as four 16 KB sub-messages, each but the last followed by 16
    /// zero-length inline WRITEs; the application hears once, when the last sub-message
    /// completes, and never of the yields.
    #[test]
    fn a_message_goes_as_sub_messages_with_yields_between() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = YieldShaper::new(planner(), 8, std::slice::from_ref(&info));
        shaper.on_post(&mut host.ctx(), qp, write(7, 64 * 1024));
        let posted = host.posted(qp);
        let shape: Vec<u32> = posted.iter().map(|w| w.bytes).collect();
        let mut expected = Vec::new();
        for i in 0..4 {
            expected.push(16 * 1024);
            if i < 3 {
                expected.extend([0; 16]);
            }
        }
        assert_eq!(shape, expected);
        assert!(posted.iter().all(|w| w.opcode == Opcode::Write));
        assert!(posted.iter().filter(|w| w.bytes == 0).all(|w| w.inline));
        assert_eq!(
            shaper.counters(),
            YieldCounters {
                sub_messages: 4,
                yields: 48
            }
        );
        let last = posted.len() - 1;
        for (i, w) in posted.iter().enumerate() {
            shaper.on_completion(&mut host.ctx(), qp, w.tag);
            let told = host.completed();
            assert_eq!(told, if i == last { vec![7] } else { vec![] }, "{i}");
        }
    }

    /// At most `window` sub-messages are on the RNIC per queue pair; each completion lets
    /// the next one go.
    #[test]
    fn the_window_bounds_sub_messages_in_flight() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = YieldShaper::new(planner(), 2, std::slice::from_ref(&info));
        shaper.on_post(&mut host.ctx(), qp, write(7, 64 * 1024));
        let subs = |host: &TestHost| host.posted(qp).iter().filter(|w| w.bytes > 0).count();
        assert_eq!(subs(&host), 2);
        let first = host.posted(qp)[0].tag;
        // A yield's completion frees nothing.
        let a_yield = host.posted(qp)[1].tag;
        shaper.on_completion(&mut host.ctx(), qp, a_yield);
        assert_eq!(subs(&host), 2);
        shaper.on_completion(&mut host.ctx(), qp, first);
        assert_eq!(subs(&host), 3);
    }

    /// Latency and throughput flows' requests, and those on queue pairs the shaper does
    /// not know, pass whole under a tag of the shaper's.
    #[test]
    fn other_flows_pass_whole() {
        let mut host = TestHost::new();
        let latency = host.flow(1, FlowClass::Latency);
        let throughput = host.flow(2, FlowClass::Throughput);
        let stranger = host.flow(3, FlowClass::Bandwidth);
        let mut shaper = YieldShaper::new(planner(), 8, &[latency.clone(), throughput.clone()]);
        for (i, info) in [latency, throughput, stranger].iter().enumerate() {
            let qp = info.qps[0];
            let tag = 1000 + i as u64;
            shaper.on_post(&mut host.ctx(), qp, write(tag, 64 * 1024));
            let posted = host.posted(qp);
            assert_eq!(posted.iter().map(|w| w.bytes).collect::<Vec<_>>(), [65536]);
            assert!(posted[0].tag < 1000);
            shaper.on_completion(&mut host.ctx(), qp, posted[0].tag);
            assert_eq!(host.completed(), vec![tag]);
        }
        assert_eq!(shaper.counters(), YieldCounters::default());
    }
}
