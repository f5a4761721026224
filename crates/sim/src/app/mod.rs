//! Application models: what the papers' benchmark programs and services do with an RNIC.
//!
//! | model | module | from |
//! | --- | --- | --- |
//! | latency flow (ping-pong or post-and-poll, size, inline, optional gap) | [`latency`] | perftest `*_lat`; Justitia §2.1; PeRF D_App |
//! | throughput flow (batches of small messages, outstanding depth) | [`throughput`] | Justitia §2.1; PeRF M_App |
//! | bandwidth flow (message size, depth, busy or event-driven polling) | [`bandwidth`] | perftest `*_bw`; KBNets study; PeRF B_App |
//! | RPC service (batched small requests and responses) | [`rpc`] | FaSST, eRPC (Justitia §2.2) |
//! | storage service (objects moved as 1 MB splits) | [`storage`] | the blob store of Justitia §2.2.1 |
//! | control-verb storm (reg_mr or create_qp, back to back or at an interval) | [`control`] | Husky §4 |
//!
//! An application owns queue pairs on both ends of its connection(s). It posts work
//! requests (through the host's policy, which may shape them), learns of completions of its
//! own requests, and of messages delivered to its side of a connection. It reacts after the
//! host's polling delay: about `host.poll_ns` when it busy-polls, `host.wakeup_us` more
//! when it sleeps until a completion event.

pub mod bandwidth;
pub mod control;
mod lanes;
pub mod latency;
pub mod rpc;
pub mod storage;
pub mod throughput;

use rand_core::Rng;
use rand_pcg::Pcg64Mcg;
use serde::{Deserialize, Serialize};

use crate::engine::EventQueue;
use crate::event::Event;
use crate::metrics::FlowMetrics;
use crate::rnic::{ControlVerb, QpId, WorkRequest};
use crate::time::Picos;

/// How an application learns of completions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Polling {
    /// A thread spins on the completion queue: it reacts after a delay uniform in
    /// [0, 2 x `host.poll_ns`] (where in its polling loop the CQE lands).
    #[default]
    Busy,
    /// A thread sleeps until a completion event: it reacts after `host.wakeup_us`, and
    /// handles every completion that arrived meanwhile in the same wake-up.
    Event,
}

/// Timer tag of a sleeping thread's wake-up; the applications' own tags stay below it.
pub(crate) const WAKE: u64 = u64::MAX;

/// When a thread notices its completions: a busy-polling thread each one after its own
/// polling delay; a sleeping thread at one wake-up (a [`WAKE`] timer) for every completion
/// that arrives until it.
pub(crate) struct CompletionWatch {
    polling: Polling,
    wake_at: Option<Picos>,
}

impl CompletionWatch {
    /// A thread that polls this way.
    pub(crate) fn new(polling: Polling) -> Self {
        CompletionWatch {
            polling,
            wake_at: None,
        }
    }

    /// How the thread polls.
    pub(crate) fn polling(&self) -> Polling {
        self.polling
    }

    /// When a completion that arrives now is noticed.
    pub(crate) fn seen(&mut self, io: &mut AppIo<'_>) -> Picos {
        match (self.polling, self.wake_at) {
            (Polling::Busy, _) => io.now() + io.reaction(Polling::Busy),
            (Polling::Event, Some(wake)) => wake,
            (Polling::Event, None) => {
                let wake = io.now() + io.reaction(Polling::Event);
                self.wake_at = Some(wake);
                io.timer(wake, WAKE);
                wake
            }
        }
    }

    /// A timer fired: true, and the thread is awake, if it was the wake-up.
    pub(crate) fn woke(&mut self, tag: u64) -> bool {
        let woke = tag == WAKE;
        if woke {
            self.wake_at = None;
        }
        woke
    }
}

/// What an application may do while handling a callback.
pub(crate) struct AppIo<'a> {
    pub(crate) now: Picos,
    pub(crate) app: u32,
    pub(crate) queue: &'a mut EventQueue<Event>,
    pub(crate) posts: &'a mut Vec<(QpId, WorkRequest)>,
    /// Control verbs issued: (application, verb, pages of the region it registers).
    pub(crate) controls: &'a mut Vec<(u32, ControlVerb, u32)>,
    pub(crate) metrics: &'a mut FlowMetrics,
    pub(crate) poll: Picos,
    pub(crate) wakeup: Picos,
    pub(crate) rng: &'a mut Pcg64Mcg,
    /// In a completion callback: the completed request's network round trip as RPerf
    /// measures it, when the queue pair has had one acknowledged.
    pub(crate) wire_rtt: Option<Picos>,
}

impl AppIo<'_> {
    /// Now.
    pub(crate) fn now(&self) -> Picos {
        self.now
    }

    /// Posts a work request (it goes through the host's policy).
    pub(crate) fn post(&mut self, qp: QpId, wr: WorkRequest) {
        self.posts.push((qp, wr));
    }

    /// Issues a control verb on the application's host (`pages`: of the region it
    /// registers); it goes through the host's policy, which may hold it, and
    /// [`AppModel::on_control_done`] is called when it completes.
    pub(crate) fn control(&mut self, verb: ControlVerb, pages: u32) {
        self.controls.push((self.app, verb, pages));
    }

    /// Calls [`AppModel::on_timer`] with `tag` at `at`.
    pub(crate) fn timer(&mut self, at: Picos, tag: u64) {
        self.queue
            .schedule(at, Event::AppTimer { app: self.app, tag });
    }

    /// The delay before this application acts on a completion.
    pub(crate) fn reaction(&mut self, polling: Polling) -> Picos {
        let poll = self.rng.next_u64() % (2 * self.poll + 1);
        match polling {
            Polling::Busy => poll,
            Polling::Event => self.wakeup + poll,
        }
    }

    /// Records one latency sample observed at `at`.
    pub(crate) fn record_latency(&mut self, at: Picos, latency: Picos) {
        self.metrics.record_latency(at, latency);
    }

    /// Records one completed application-level message observed at `at`.
    pub(crate) fn record_message(&mut self, at: Picos) {
        self.metrics.record_message(at);
    }
}

/// An application model.
pub(crate) trait AppModel {
    /// The flow starts, or resumes after a pause (bandwidth and throughput flows): post the
    /// first requests.
    fn start(&mut self, io: &mut AppIo<'_>);
    /// The flow stops: post nothing new (requests in flight still complete).
    fn stop(&mut self);
    /// A timer set with [`AppIo::timer`] fired.
    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64);
    /// A work request this application posted on `qp` completed (the CQE is visible).
    fn on_completion(&mut self, io: &mut AppIo<'_>, qp: QpId, tag: u64);
    /// A message arrived on this application's side `qp` of a connection and is in memory.
    fn on_delivery(&mut self, io: &mut AppIo<'_>, qp: QpId, bytes: u32);
    /// A control verb this application issued at `issued` completed. Only control-verb
    /// storms issue any, so the others keep this default.
    fn on_control_done(&mut self, _io: &mut AppIo<'_>, _issued: Picos) {}
}

/// Queue pairs of one connection of an application: the requester's and the responder's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Connection {
    /// On the host that posts the flow's requests.
    pub(crate) client: QpId,
    /// On the other host.
    pub(crate) server: QpId,
}
