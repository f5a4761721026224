//! Carrying out allotments on one host, as `libjustitia.so` does: every resource-hungry
//! flow's requests are cut by the core's [`ChunkPlan`] into the allotment's chunk size and
//! released by the core's [`Pacer`] at the allotment's rate. Nothing here decides a rate or
//! a chunk size; the host's control loop does, and [`PacedShaper::set_allotment`] carries
//! it out.
//!
//! A bandwidth flow's SENDs are split only through the shapers' protocol
//! ([`super::split`], the core's `two_sided`) when the policy turns it on
//! ([`PacedShaper::with_split_sends`]): announced when posted, each chunk sent against the
//! receiver's credit. Without it a SEND goes whole, as `libjustitia.so` sends it today.
//!
//! Latency flows, and flows without an allotment, pass untouched. The application hears of
//! a request only when its last chunk completes. The shaper tells its caller when a flow
//! starts or stops having work ([`Activity`]): it has work from its first request until it
//! has no chunk waiting and none on the RNIC. Counting chunks on the RNIC keeps a flow with
//! requests outstanding busy; the control loop's idle grace keeps a flow whose application
//! waits between two requests from losing its share.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use justitia_core::chunk::{self, ChunkLimits, ChunkPlan, RemoteAddr, SendFlags, Sge, SgeList};
use justitia_core::control_loop::Allotment;
use justitia_core::flow::{FlowClass, FlowId};
use justitia_core::pacer::{PaceRate, Pacer, ReleasePhase};

use super::split::{SideChannel, SplitSender};
use super::translation::TranslationCharge;
use super::{FlowInfo, PolicyContext};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::Picos;
use justitia_core::two_sided::Posting;

/// Timer tags at or above this are the shaper's: the flow's index is added.
pub const PACE_TIMER: u64 = 1 << 62;

/// A flow's change of activity, for the control loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    /// The flow has chunks to send and had none before.
    HasWork(FlowId),
    /// The flow has no chunk left to send.
    Idle(FlowId),
}

/// A message an application posted that has not been fully handed to the RNIC.
#[derive(Clone, Copy)]
struct Pending {
    qp: QpId,
    app_tag: u64,
    opcode: Opcode,
    inline: bool,
    bytes: u32,
    /// Its number in the split-SEND protocol, when announced: its chunks come from the
    /// queue pair's [`SplitSender`], not from a plan.
    split: Option<u64>,
}

impl Pending {
    /// The message as the application posted it.
    fn request(&self) -> WorkRequest {
        WorkRequest {
            tag: self.app_tag,
            opcode: self.opcode,
            bytes: self.bytes,
            inline: self.inline,
        }
    }

    /// The message cut by the core's planner into chunks of at most `chunk_bytes`.
    fn plan(&self, chunk_bytes: u32) -> Result<ChunkPlan, chunk::ChunkError> {
        ChunkPlan::new(core_request(&self.request()), limits(chunk_bytes))
    }
}

/// The message at the head of a flow's queue, being handed to the RNIC chunk by chunk.
struct Cutting {
    message: Pending,
    plan: ChunkPlan,
}

struct PacedFlow {
    info: FlowInfo,
    /// The message being cut; `None` while the flow has nothing waiting.
    head: Option<Cutting>,
    /// The messages behind the head, in order. A message is planned only when it reaches
    /// the head: a plan holds a whole work request (hundreds of bytes) and is re-cut at
    /// every change of chunk size, while one made at the head from the message as posted
    /// is the same plan (the planner refuses a request for its shape, never for a chunk
    /// size, and a re-cut plan of an untouched message is that of the message).
    queued: VecDeque<Pending>,
    /// `None`: released as posted (no allotment yet, or a latency flow).
    pacer: Option<Pacer>,
    chunk_bytes: u32,
    /// When the flow's pacing timer is due, if one is set.
    wake_at: Option<Picos>,
    /// Whether the caller was last told the flow has work.
    busy: bool,
    /// Chunks handed to the RNIC and not completed.
    in_flight: usize,
}

impl PacedFlow {
    /// The chunk size the flow's messages are planned with: bandwidth flows are cut to the
    /// allotment's chunk; a throughput flow's small messages go whole, one operation each.
    fn plan_chunk_bytes(&self) -> u32 {
        match self.info.spec.class {
            FlowClass::Bandwidth => self.chunk_bytes,
            _ => u32::MAX,
        }
    }
}

/// A request handed to the RNIC: whose it is and whether it ends an application request.
#[derive(Clone, Copy)]
struct InFlight {
    app_tag: u64,
    last: bool,
    /// The shaped flow it belongs to (`None` for what passed untouched).
    flow: Option<usize>,
    /// The announced message it is a chunk of: its sender says when the message is done.
    split: Option<u64>,
}

/// The pacing half of a host's policy.
pub struct PacedShaper {
    flows: Vec<PacedFlow>,
    /// The flow of each queue pair, indexed by [`QpId::index`] (a run's queue pairs are
    /// numbered densely, so the table is as long as the largest number here).
    by_qp: Vec<Option<usize>>,
    by_id: BTreeMap<FlowId, usize>,
    /// Requests handed to the RNIC, by tag: entry `i` is tag `first_tag + i`. Tags are
    /// handed out in order and mostly complete in order, so this stays short.
    in_flight: VecDeque<Option<InFlight>>,
    first_tag: u64,
    activity: Vec<Activity>,
    /// Whether bandwidth flows' SENDs go through the split protocol.
    split_sends: bool,
    /// The sending half of each queue pair with announced SENDs.
    senders: BTreeMap<QpId, SplitSender>,
    /// What each request costs the translation caches beyond its one operation (`None`:
    /// nothing).
    translation: Option<TranslationCharge>,
}

fn duration(t: Picos) -> Duration {
    Duration::from_nanos(t / 1_000)
}

impl PacedShaper {
    /// A shaper for the flows that post from this host; nothing is paced until an
    /// allotment is set.
    pub fn new(flows: &[FlowInfo]) -> Self {
        let mut shaper = PacedShaper {
            flows: Vec::new(),
            by_qp: Vec::new(),
            by_id: BTreeMap::new(),
            in_flight: VecDeque::new(),
            first_tag: 1,
            activity: Vec::new(),
            split_sends: false,
            senders: BTreeMap::new(),
            translation: None,
        };
        for info in flows {
            let index = shaper.flows.len();
            for &qp in &info.qps {
                if qp.index() >= shaper.by_qp.len() {
                    shaper.by_qp.resize(qp.index() + 1, None);
                }
                shaper.by_qp[qp.index()] = Some(index);
            }
            shaper.by_id.insert(info.spec.id, index);
            shaper.flows.push(PacedFlow {
                info: info.clone(),
                head: None,
                queued: VecDeque::new(),
                pacer: None,
                chunk_bytes: u32::MAX,
                wake_at: None,
                busy: false,
                in_flight: 0,
            });
        }
        shaper
    }

    /// Splits the bandwidth flows' SENDs through the shapers' protocol (announcements go
    /// out through [`PacedShaper::flush_side`], credits come in through
    /// [`PacedShaper::on_credit`]).
    pub fn with_split_sends(mut self) -> Self {
        self.split_sends = true;
        self
    }

    /// Charges each request the flows hand the RNIC what `charge` says it costs the
    /// translation caches, in operations on top of its own one.
    pub fn with_translation(mut self, charge: TranslationCharge) -> Self {
        self.translation = Some(charge);
        self
    }

    /// The translation charge, if there is one.
    pub fn translation_mut(&mut self) -> Option<&mut TranslationCharge> {
        self.translation.as_mut()
    }

    /// Hands the announcements made since the last call to the side channel.
    pub fn flush_side(&mut self, ctx: &mut PolicyContext<'_>, side: &mut SideChannel) {
        for sender in self.senders.values_mut() {
            side.flush(ctx, sender);
        }
    }

    /// The receiver's credit for message `seq` of `qp`: its chunks may go.
    pub fn on_credit(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, seq: u64, posting: Posting) {
        let Some(sender) = self.senders.get_mut(&qp) else {
            return;
        };
        sender.on_credit(seq, posting);
        if let Some(index) = self.flow_of(qp) {
            self.pump(ctx, index);
        }
    }

    /// Whether there are changes of activity to take.
    pub fn has_activity(&self) -> bool {
        !self.activity.is_empty()
    }

    /// Changes of activity since the last call, in order.
    pub fn take_activity(&mut self) -> Vec<Activity> {
        std::mem::take(&mut self.activity)
    }

    /// Whether the flow has chunks waiting.
    pub fn has_work(&self, flow: FlowId) -> bool {
        self.by_id
            .get(&flow)
            .is_some_and(|&i| self.flows[i].head.is_some())
    }

    /// Paces `flow` at `allotment`'s rate and release phase from now on, its requests cut
    /// to the allotment's chunk size; `None` releases them as posted. What the flow has not
    /// sent yet is re-cut to a new chunk size.
    pub fn set_allotment(
        &mut self,
        ctx: &mut PolicyContext<'_>,
        flow: FlowId,
        allotment: Option<Allotment>,
    ) {
        self.set_rate(ctx, flow, allotment.map(|a| (a.pace_rate(), Some(a.phase))));
    }

    /// Paces `flow` at `rate` from now on, with no release phase (for a policy that sets
    /// rates of its own rather than the control loop's allotments); `None` releases its
    /// requests as posted.
    pub fn set_pace(&mut self, ctx: &mut PolicyContext<'_>, flow: FlowId, rate: Option<PaceRate>) {
        self.set_rate(ctx, flow, rate.map(|r| (r, None)));
    }

    /// The rate `flow` is paced at, `None` while it is released as posted.
    #[cfg(test)]
    pub(crate) fn pace_of(&self, flow: FlowId) -> Option<PaceRate> {
        let &index = self.by_id.get(&flow)?;
        self.flows[index].pacer.as_ref().map(Pacer::rate)
    }

    /// Whether `qp` belongs to one of the shaper's flows.
    pub fn shapes(&self, qp: QpId) -> bool {
        self.flow_of(qp).is_some()
    }

    fn set_rate(
        &mut self,
        ctx: &mut PolicyContext<'_>,
        flow: FlowId,
        rate: Option<(PaceRate, Option<ReleasePhase>)>,
    ) {
        let Some(&index) = self.by_id.get(&flow) else {
            return;
        };
        let now = duration(ctx.now());
        let f = &mut self.flows[index];
        let chunk_bytes = rate.map_or(u32::MAX, |(r, _)| r.chunk_bytes.max(1));
        match (&mut f.pacer, rate) {
            (Some(pacer), Some((r, Some(phase)))) => pacer.set_rate_in_phase(now, r, phase),
            (Some(pacer), Some((r, None))) => pacer.set_rate(now, r),
            (pacer, _) => *pacer = rate.map(|(r, _)| Pacer::new(r, now)),
        }
        if chunk_bytes != f.chunk_bytes {
            f.chunk_bytes = chunk_bytes;
            // Only the head has a plan; the messages behind it are planned at the new size
            // when their turn comes.
            // An announced message keeps the chunk size its announcement gave.
            let head = f.head.as_mut().filter(|h| h.message.split.is_none());
            if let (FlowClass::Bandwidth, Some(head)) = (f.info.spec.class, head) {
                let rest = head.plan.remaining_bytes();
                let left = Pending {
                    bytes: rest,
                    ..head.message
                };
                if let Ok(plan) = left.plan(chunk_bytes) {
                    head.plan = plan;
                }
            }
        }
        f.wake_at = None;
        self.pump(ctx, index);
    }

    /// An application posted `wr` on `qp`.
    pub fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let Some(index) = self.flow_of(qp) else {
            self.pass_through(ctx, qp, wr);
            return;
        };
        let f = &self.flows[index];
        if f.info.spec.class == FlowClass::Latency {
            self.pass_through(ctx, qp, wr);
            return;
        }
        let mut message = Pending {
            qp,
            app_tag: wr.tag,
            opcode: wr.opcode,
            inline: wr.inline,
            bytes: wr.bytes,
            split: None,
        };
        if self.split_sends
            && f.info.spec.class == FlowClass::Bandwidth
            && wr.opcode == Opcode::Send
            && !wr.inline
        {
            let chunk_bytes = f.plan_chunk_bytes();
            let peer = f.info.peer;
            let sender = self
                .senders
                .entry(qp)
                .or_insert_with(|| SplitSender::new(peer, ctx.peer_of(qp)));
            message.split = sender.post(wr.tag, wr.bytes, chunk_bytes);
        }
        let f = &self.flows[index];
        // A message behind the head is only checked here, its plan dropped unread: it is
        // planned again when it reaches the head (see `PacedFlow::queued`).
        let planned = message.plan(f.plan_chunk_bytes());
        let head = match planned {
            Ok(plan) if f.head.is_none() => Some(Cutting { message, plan }),
            Ok(_) => None,
            Err(_) => {
                // A request the planner refuses is passed through unshaped, never dropped.
                self.pass_through(ctx, qp, wr);
                return;
            }
        };
        let f = &mut self.flows[index];
        if !f.busy {
            f.busy = true;
            self.activity.push(Activity::HasWork(f.info.spec.id));
        }
        match head {
            Some(head) => f.head = Some(head),
            None => f.queued.push_back(message),
        }
        self.pump(ctx, index);
    }

    /// A request the shaper handed to the RNIC completed: tells the application when it
    /// was the last chunk of its request.
    pub fn on_completion(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, tag: u64) {
        let Some(done) = self.untrack(tag) else {
            return;
        };
        if let Some(index) = done.flow {
            let f = &mut self.flows[index];
            f.in_flight = f.in_flight.saturating_sub(1);
            self.note_idle(index);
        }
        let split_done = done
            .split
            .and_then(|seq| self.senders.get_mut(&qp)?.chunk_done(seq));
        if let Some(app_tag) = split_done {
            ctx.complete(qp, app_tag);
        } else if done.last {
            ctx.complete(qp, done.app_tag);
        }
    }

    /// Reports a busy flow that ran out of work (nothing waiting, nothing on the RNIC) as
    /// idle.
    fn note_idle(&mut self, index: usize) {
        let f = &mut self.flows[index];
        if f.busy && f.head.is_none() && f.in_flight == 0 {
            f.busy = false;
            self.activity.push(Activity::Idle(f.info.spec.id));
        }
    }

    /// A timer with a tag at or above [`PACE_TIMER`] fired.
    pub fn on_timer(&mut self, ctx: &mut PolicyContext<'_>, tag: u64) {
        let Some(index) = tag
            .checked_sub(PACE_TIMER)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return;
        };
        let Some(f) = self.flows.get_mut(index) else {
            return;
        };
        // A timer set before the rate changed is stale: another one is due.
        if f.wake_at != Some(ctx.now()) {
            return;
        }
        f.wake_at = None;
        self.pump(ctx, index);
    }

    /// Hands the flow's chunks to the RNIC while its pacer allows; sets a timer for when it
    /// will allow the next one.
    fn pump(&mut self, ctx: &mut PolicyContext<'_>, index: usize) {
        let now = ctx.now();
        loop {
            let f = &mut self.flows[index];
            if f.head.is_none() {
                let Some(message) = f.queued.pop_front() else {
                    break;
                };
                match message.plan(f.plan_chunk_bytes()) {
                    Ok(plan) => f.head = Some(Cutting { message, plan }),
                    // Planned once already when posted, so refused only if the planner
                    // changed its mind; passed through then, as it would have been.
                    Err(_) => self.pass_through(ctx, message.qp, message.request()),
                }
                continue;
            }
            let Some(head) = &mut f.head else {
                break;
            };
            let split = head.message.split;
            let next = match split {
                // Announced: the next chunk its credit allows, or wait for the credit
                // (its arrival pumps the flow again).
                Some(_) => match self
                    .senders
                    .get(&head.message.qp)
                    .and_then(SplitSender::ready_bytes)
                {
                    Some(bytes) => bytes,
                    None => break,
                },
                // The plan cuts one SGE into chunks of at most the chunk size, or goes whole.
                None if head.plan.is_split() => head.plan.remaining_bytes().min(f.chunk_bytes),
                None => head.plan.remaining_bytes(),
            };
            if let Some(pacer) = &mut f.pacer {
                if let Err(wait) = pacer.try_release(duration(now), u64::from(next), 1) {
                    // The pacer never asks for more than its MAX_WAIT (a minute).
                    let at = now.saturating_add(
                        u64::try_from(wait.as_nanos())
                            .unwrap_or(u64::MAX)
                            .saturating_mul(1_000),
                    );
                    if f.wake_at != Some(at) {
                        f.wake_at = Some(at);
                        ctx.set_timer(at, PACE_TIMER + index as u64);
                    }
                    return;
                }
            }
            let Pending {
                qp,
                app_tag,
                opcode,
                inline,
                ..
            } = head.message;
            let (bytes, is_last) = match split {
                Some(_) => match self.senders.get_mut(&qp).and_then(SplitSender::next_chunk) {
                    Some((_, bytes, is_last)) => (bytes, is_last),
                    None => break,
                },
                None => {
                    let Some(chunk) = head.plan.next() else {
                        f.head = None;
                        continue;
                    };
                    let bytes = u32::try_from(chunk.request.sges.total_bytes()).unwrap_or(u32::MAX);
                    (bytes, chunk.is_last)
                }
            };
            if is_last {
                f.head = None;
            }
            f.in_flight += 1;
            let spec = f.info.spec;
            let tag = self.track(InFlight {
                app_tag,
                last: is_last,
                flow: Some(index),
                split,
            });
            let wr = WorkRequest {
                tag,
                opcode,
                bytes,
                inline,
            };
            if let Some(charge) = &mut self.translation {
                // Charged once released, before the post moves the queue pair's walk on:
                // the pacer let it go on its balance, and the next request waits for this
                // one's full cost.
                let extra = charge.extra_operations(ctx, &spec, qp, &wr);
                if let Some(pacer) = self.flows[index].pacer.as_mut().filter(|_| extra > 0) {
                    pacer.charge(0, extra);
                }
            }
            ctx.post(qp, wr);
        }
        self.note_idle(index);
    }

    /// Hands a request to the RNIC as it is (under a tag of the shaper's, like every
    /// request, so that tags never collide).
    fn pass_through(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        let tag = self.track(InFlight {
            app_tag: wr.tag,
            last: true,
            flow: None,
            split: None,
        });
        ctx.post(qp, WorkRequest { tag, ..wr });
    }

    fn flow_of(&self, qp: QpId) -> Option<usize> {
        self.by_qp.get(qp.index()).copied().flatten()
    }

    fn track(&mut self, request: InFlight) -> u64 {
        self.in_flight.push_back(Some(request));
        self.first_tag + self.in_flight.len() as u64 - 1
    }

    fn untrack(&mut self, tag: u64) -> Option<InFlight> {
        let index = usize::try_from(tag.checked_sub(self.first_tag)?).ok()?;
        let request = self.in_flight.get_mut(index)?.take();
        while let Some(None) = self.in_flight.front() {
            self.in_flight.pop_front();
            self.first_tag += 1;
        }
        request
    }
}

/// How a flow's requests are cut by the planner: `chunk_bytes` chunks; a SEND only through
/// the split protocol (an announced message is not planned), so the planner sends one whole.
fn limits(chunk_bytes: u32) -> ChunkLimits {
    ChunkLimits {
        chunk_bytes,
        max_sge: 1,
        split_two_sided: false,
    }
}

/// A core work request standing for a simulated one: one SGE of the message's length at a
/// made-up address, which is all the chunk planner needs to cut it.
fn core_request(wr: &WorkRequest) -> chunk::WorkRequest {
    let mut sges = SgeList::new();
    if wr.bytes > 0 {
        // One SGE always fits an empty list.
        let _ = sges.push(Sge {
            addr: 0x1000,
            length: wr.bytes,
            lkey: 1,
        });
    }
    chunk::WorkRequest {
        wr_id: wr.tag,
        opcode: match wr.opcode {
            Opcode::Write => chunk::Opcode::Write,
            Opcode::Send => chunk::Opcode::Send,
            Opcode::Read => chunk::Opcode::Read,
        },
        sges,
        remote: Some(RemoteAddr {
            addr: 0x1_0000_0000,
            rkey: 1,
        }),
        flags: SendFlags {
            signaled: true,
            inline: wr.inline,
            ..SendFlags::default()
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::policy::test_host::{write, TestHost};

    const KIB: u32 = 1024;

    fn rate(bytes_per_sec: u64, chunk_bytes: u32) -> Option<PaceRate> {
        Some(PaceRate {
            bytes_per_sec,
            ops_per_sec: None,
            chunk_bytes,
        })
    }

    /// Runs the shaper's pacing timers until none is left; the time of the last.
    fn drain_timers(host: &mut TestHost, shaper: &mut PacedShaper) -> Picos {
        let mut last = host.now();
        while let Some((at, tag)) = host.next_timer() {
            assert!(tag >= PACE_TIMER, "only the shaper sets timers here");
            shaper.on_timer(&mut host.ctx(), tag);
            last = at;
        }
        last
    }

    /// A paced bandwidth flow's message goes as chunks of the pace's size, a burst of at
    /// most two chunks (the pacer's BURST_CHUNKS) plus the one that overdraws it at once,
    /// the rest at the rate; the application hears once, when the last chunk completes.
    #[test]
    fn a_paced_message_goes_in_chunks_at_the_rate() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = PacedShaper::new(std::slice::from_ref(&info));
        shaper.set_pace(&mut host.ctx(), info.spec.id, rate(1_000_000_000, 16 * KIB));
        shaper.on_post(&mut host.ctx(), qp, write(7, 256 * KIB));
        let at_once = host.posted(qp).len();
        assert!((1..=3).contains(&at_once), "{at_once} chunks at once");
        assert!(shaper.has_work(info.spec.id));
        let start = host.now();
        let end = drain_timers(&mut host, &mut shaper);
        let posted = host.posted(qp);
        assert_eq!(posted.len(), 16);
        assert!(posted.iter().all(|w| w.bytes == 16 * KIB));
        assert!(!shaper.has_work(info.spec.id));
        // 256 KiB less the burst at 1 GB/s: 13 to 15 chunks of 16.384 us.
        let spent_us = (end - start) as f64 / 1e6;
        assert!(
            (13.0 * 16.384 - 0.01..=15.0 * 16.384 + 0.01).contains(&spent_us),
            "{spent_us} us"
        );
        for (i, w) in posted.iter().enumerate() {
            shaper.on_completion(&mut host.ctx(), qp, w.tag);
            let told = host.completed();
            assert_eq!(told, if i == 15 { vec![7] } else { vec![] });
        }
    }

    /// The flow tells its caller when it starts having work and when it has nothing left
    /// waiting or on the RNIC; nothing is reported twice.
    #[test]
    fn activity_runs_from_the_first_post_to_the_last_completion() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Throughput);
        let qp = info.qps[0];
        let id = info.spec.id;
        let mut shaper = PacedShaper::new(std::slice::from_ref(&info));
        assert!(!shaper.has_activity());
        shaper.on_post(&mut host.ctx(), qp, write(1, 64));
        shaper.on_post(&mut host.ctx(), qp, write(2, 64));
        assert!(shaper.has_activity());
        assert_eq!(shaper.take_activity(), vec![Activity::HasWork(id)]);
        assert!(!shaper.has_activity());
        // Not paced: both went as posted, so nothing waits, but the flow is busy.
        assert!(!shaper.has_work(id));
        let posted = host.posted(qp);
        assert_eq!(posted.iter().map(|w| w.bytes).collect::<Vec<_>>(), [64, 64]);
        shaper.on_completion(&mut host.ctx(), qp, posted[0].tag);
        assert!(!shaper.has_activity());
        shaper.on_completion(&mut host.ctx(), qp, posted[1].tag);
        assert_eq!(shaper.take_activity(), vec![Activity::Idle(id)]);
        assert_eq!(host.completed(), vec![1, 2]);
    }

    /// A change of chunk size mid-message re-cuts only what is left: every byte of the
    /// message is sent once.
    #[test]
    fn a_new_chunk_size_recuts_only_the_rest() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = PacedShaper::new(std::slice::from_ref(&info));
        shaper.set_pace(&mut host.ctx(), info.spec.id, rate(1_000_000, 16 * KIB));
        shaper.on_post(&mut host.ctx(), qp, write(7, 64 * KIB));
        let first = host.posted(qp).len();
        assert!(first < 4, "{first} of 4 chunks before the change");
        shaper.set_pace(&mut host.ctx(), info.spec.id, rate(1_000_000_000, 4 * KIB));
        drain_timers(&mut host, &mut shaper);
        let posted = host.posted(qp);
        let total: u32 = posted.iter().map(|w| w.bytes).sum();
        assert_eq!(total, 64 * KIB);
        assert!(posted[first..].iter().all(|w| w.bytes == 4 * KIB));
    }

    /// Latency flows, queue pairs of no flow of the shaper and inline requests pass as
    /// posted (an inline request is never cut), each under a tag of the shaper's whose
    /// completion reaches the application under its own tag.
    #[test]
    fn what_is_not_shaped_passes_whole_under_the_shapers_tag() {
        let mut host = TestHost::new();
        let latency = host.flow(1, FlowClass::Latency);
        let bandwidth = host.flow(2, FlowClass::Bandwidth);
        let stranger = host.flow(3, FlowClass::Bandwidth);
        let mut shaper = PacedShaper::new(&[latency.clone(), bandwidth.clone()]);
        assert!(shaper.shapes(latency.qps[0]) && shaper.shapes(bandwidth.qps[0]));
        assert!(!shaper.shapes(stranger.qps[0]));
        shaper.set_pace(&mut host.ctx(), bandwidth.spec.id, rate(1_000_000_000, 64));
        let inline = WorkRequest {
            inline: true,
            ..write(1000, 200)
        };
        shaper.on_post(&mut host.ctx(), bandwidth.qps[0], inline);
        shaper.on_post(&mut host.ctx(), latency.qps[0], write(1001, 64 * KIB));
        shaper.on_post(&mut host.ctx(), stranger.qps[0], write(1002, 64 * KIB));
        for (qp, tag, bytes) in [
            (bandwidth.qps[0], 1000, 200),
            (latency.qps[0], 1001, 64 * KIB),
            (stranger.qps[0], 1002, 64 * KIB),
        ] {
            let posted = host.posted(qp);
            assert_eq!(posted.len(), 1);
            assert_eq!(posted[0].bytes, bytes);
            assert!(posted[0].tag < 1000, "the shaper's own tag");
            shaper.on_completion(&mut host.ctx(), qp, posted[0].tag);
            assert_eq!(host.completed(), vec![tag]);
        }
    }

    /// A bandwidth flow's SEND goes whole without the split protocol, as the shipped shaper
    /// sends it. With it, the SEND is announced (one side-channel message of 27 B and the
    /// headers), no chunk goes before the receiver's credit, only as many as it credits go,
    /// and the application hears once, when the last chunk completes.
    #[test]
    fn a_send_is_split_only_against_the_receivers_credit() {
        let mut host = TestHost::new();
        let send = |tag, bytes| WorkRequest {
            tag,
            opcode: Opcode::Send,
            bytes,
            inline: false,
        };
        let fast = rate(1_000_000_000_000, 16 * KIB);
        let plain = host.flow(1, FlowClass::Bandwidth);
        let mut shaper = PacedShaper::new(std::slice::from_ref(&plain));
        shaper.set_pace(&mut host.ctx(), plain.spec.id, fast);
        shaper.on_post(&mut host.ctx(), plain.qps[0], send(5, 64 * KIB));
        let whole: Vec<u32> = host.posted(plain.qps[0]).iter().map(|w| w.bytes).collect();
        assert_eq!(whole, [64 * KIB]);

        let info = host.flow(2, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = PacedShaper::new(std::slice::from_ref(&info)).with_split_sends();
        let mut side = SideChannel::new(82);
        shaper.set_pace(&mut host.ctx(), info.spec.id, fast);
        shaper.on_post(&mut host.ctx(), qp, send(7, 64 * KIB));
        shaper.flush_side(&mut host.ctx(), &mut side);
        assert!(host.posted(qp).is_empty(), "nothing before the credit");
        let mut figures = super::super::PolicyFigures::new();
        side.figures(&mut figures);
        assert_eq!(figures["side_announces"], 1.0);
        assert_eq!(figures["side_wire_bytes"], 27.0 + 82.0);
        shaper.on_credit(&mut host.ctx(), qp, 0, Posting::Split { posted: 2 });
        drain_timers(&mut host, &mut shaper);
        assert_eq!(host.posted(qp).len(), 2, "only what is credited");
        shaper.on_credit(&mut host.ctx(), qp, 0, Posting::Split { posted: 4 });
        drain_timers(&mut host, &mut shaper);
        let posted = host.posted(qp);
        assert!(posted
            .iter()
            .all(|w| w.bytes == 16 * KIB && w.opcode == Opcode::Send));
        assert_eq!(posted.len(), 4);
        for (i, w) in posted.iter().enumerate() {
            shaper.on_completion(&mut host.ctx(), qp, w.tag);
            assert_eq!(host.completed(), if i == 3 { vec![7] } else { vec![] });
        }
        assert!(!shaper.has_work(info.spec.id));
    }

    /// A zero-length request of a paced flow goes as one zero-length request.
    #[test]
    fn an_empty_request_goes_as_one() {
        let mut host = TestHost::new();
        let info = host.flow(1, FlowClass::Bandwidth);
        let qp = info.qps[0];
        let mut shaper = PacedShaper::new(std::slice::from_ref(&info));
        shaper.set_pace(&mut host.ctx(), info.spec.id, rate(1_000_000_000, 4 * KIB));
        shaper.on_post(&mut host.ctx(), qp, write(9, 0));
        let posted = host.posted(qp);
        assert_eq!(posted.iter().map(|w| w.bytes).collect::<Vec<_>>(), [0]);
        shaper.on_completion(&mut host.ctx(), qp, posted[0].tag);
        assert_eq!(host.completed(), vec![9]);
    }
}
