//! The machinery shared by `preempt` and `adaptive`: bandwidth flows' messages cut into
//! sub-messages with zero-length yield writes between them, optionally paced.
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
//!
//! With a pacing rate set, sub-messages of each flow leave no faster than its share of
//! that rate (the rate split evenly over the bandwidth flows that have messages waiting).
//! Latency and throughput flows, and requests on queue pairs the shaper does not know,
//! pass through untouched.

use std::collections::{BTreeMap, VecDeque};

use justitia_core::flow::FlowClass;
use justitia_core::yield_plan::{YieldCursor, YieldPlanner};

use super::{FlowInfo, PolicyContext};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::{self, Picos};

/// A message of a bandwidth flow not yet fully handed to the RNIC.
struct Message {
    app_tag: u64,
    opcode: Opcode,
    inline: bool,
    cursor: YieldCursor,
}

/// A bandwidth flow's queue pair.
struct YieldQp {
    flow: usize,
    pending: VecDeque<Message>,
    /// Sub-messages handed to the RNIC and not completed.
    in_flight: u32,
}

/// Pacing state of a bandwidth flow.
struct PacedFlow {
    qps: Vec<QpId>,
    /// Earliest time the flow's next sub-message may leave while pacing.
    next_at: Picos,
    /// A pacing timer is set for `next_at`.
    timer_set: bool,
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

/// Sub-message splitting with yields, and optional pacing, for one host's bandwidth flows.
pub struct YieldShaper {
    planner: YieldPlanner,
    window: u32,
    qps: BTreeMap<QpId, YieldQp>,
    flows: Vec<PacedFlow>,
    /// Total rate of the bandwidth flows in bytes/s while pacing.
    pacing: Option<f64>,
    handed: BTreeMap<u64, Handed>,
    next_tag: u64,
    counters: YieldCounters,
}

impl YieldShaper {
    /// A shaper for `flows` (those not of class bandwidth are passed through), planning with
    /// `planner` and keeping at most `window` sub-messages in flight per queue pair.
    pub fn new(planner: YieldPlanner, window: u32, flows: &[FlowInfo]) -> Self {
        let mut qps = BTreeMap::new();
        let mut paced = Vec::new();
        for info in flows
            .iter()
            .filter(|f| f.spec.class == FlowClass::Bandwidth)
        {
            let flow = paced.len();
            for &qp in &info.qps {
                qps.insert(
                    qp,
                    YieldQp {
                        flow,
                        pending: VecDeque::new(),
                        in_flight: 0,
                    },
                );
            }
            paced.push(PacedFlow {
                qps: info.qps.clone(),
                next_at: 0,
                timer_set: false,
            });
        }
        YieldShaper {
            planner,
            window: window.max(1),
            qps,
            flows: paced,
            pacing: None,
            handed: BTreeMap::new(),
            next_tag: 1,
            counters: YieldCounters::default(),
        }
    }

    /// The planner, whose yield density the `adaptive` policy steers.
    pub fn planner_mut(&mut self) -> &mut YieldPlanner {
        &mut self.planner
    }

    /// Yields after each sub-message now.
    pub fn yields_per_sub_message(&self) -> u32 {
        self.planner.yields_per_sub_message()
    }

    /// The total pacing rate in bytes/s, `None` when not pacing.
    pub fn pacing(&self) -> Option<f64> {
        self.pacing
    }

    /// Sets (or, with `None`, lifts) the total pacing rate of the bandwidth flows, bytes/s.
    pub fn set_pacing(&mut self, ctx: &mut PolicyContext<'_>, rate: Option<f64>) {
        self.pacing = rate.filter(|r| r.is_finite() && *r > 0.0);
        if self.pacing.is_none() {
            for flow in 0..self.flows.len() {
                self.pump_flow(ctx, flow);
            }
        }
    }

    /// What the shaper has handed to the RNIC so far.
    pub fn counters(&self) -> YieldCounters {
        self.counters
    }

    /// An application posted `wr` on `qp`.
    pub fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let Some(entry) = self.qps.get_mut(&qp) else {
            let tag = self.hand(Handed::Whole { app_tag: wr.tag });
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

    /// A pacing timer of flow `flow` fired.
    pub fn on_pacing_timer(&mut self, ctx: &mut PolicyContext<'_>, flow: usize) {
        if let Some(f) = self.flows.get_mut(flow) {
            f.timer_set = false;
        }
        self.pump_flow(ctx, flow);
    }

    fn pump_flow(&mut self, ctx: &mut PolicyContext<'_>, flow: usize) {
        let qps = self
            .flows
            .get(flow)
            .map(|f| f.qps.clone())
            .unwrap_or_default();
        for qp in qps {
            self.pump(ctx, qp);
        }
    }

    /// Bandwidth flows with messages waiting, among which the pacing rate is split.
    fn waiting_flows(&self) -> usize {
        let mut waiting = vec![false; self.flows.len()];
        for entry in self.qps.values() {
            if !entry.pending.is_empty() {
                waiting[entry.flow] = true;
            }
        }
        waiting.iter().filter(|&&w| w).count().max(1)
    }

    /// Hands the RNIC what the window and the pacing allow on `qp`.
    fn pump(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId) {
        loop {
            let Some(entry) = self.qps.get(&qp) else {
                return;
            };
            if entry.in_flight >= self.window || entry.pending.is_empty() {
                return;
            }
            let flow = entry.flow;
            let now = ctx.now();
            if self.pacing.is_some() && self.flows[flow].next_at > now {
                let f = &mut self.flows[flow];
                if !f.timer_set {
                    f.timer_set = true;
                    ctx.set_timer(f.next_at, PACING_TIMER | flow as u64);
                }
                return;
            }
            let share = self.pacing.map(|rate| rate / self.waiting_flows() as f64);
            let Some(entry) = self.qps.get_mut(&qp) else {
                return;
            };
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
            if let Some(share) = share {
                let f = &mut self.flows[flow];
                let spacing = time::from_ns(f64::from(step.bytes) / share * 1e9);
                f.next_at = f.next_at.max(now).saturating_add(spacing);
            }
            let tag = self.hand(Handed::SubMessage { app_tag, last });
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
                let tag = self.hand(Handed::Yield);
                self.counters.yields += 1;
                ctx.post(qp, yield_request(tag));
            }
        }
    }

    fn hand(&mut self, what: Handed) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.handed.insert(tag, what);
        tag
    }
}

/// Timer tags at or above this are pacing timers; the low bits name the flow.
pub const PACING_TIMER: u64 = 1 << 62;

/// The standard-verbs yield: a zero-length RDMA WRITE (a header-only packet).
fn yield_request(tag: u64) -> WorkRequest {
    WorkRequest {
        tag,
        opcode: Opcode::Write,
        bytes: 0,
        inline: true,
    }
}
