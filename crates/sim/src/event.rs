//! What the event loop handles, and the completions it passes up to applications: the
//! types applications, policies and the run share, kept apart from the run itself so that
//! the models depend on them and the run on the models, never both ways.

use crate::rnic::{ControlVerb, QpId, RnicEvent};
use crate::switch::SwitchEvent;
use crate::time::Picos;
use crate::topology::HostId;

/// Everything that can happen.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Event {
    /// An RNIC's.
    Rnic(RnicEvent),
    /// A switch's.
    Switch(SwitchEvent),
    /// An application's timer.
    AppTimer { app: u32, tag: u64 },
    /// A policy's timer.
    PolicyTimer { host: HostId, tag: u64 },
    /// A message between policies arrives at `host`; it waits in the run's mailbox slot.
    PolicyMessage { host: HostId, slot: u32 },
    /// A flow starts.
    FlowStart(u32),
    /// A flow stops posting.
    FlowStop(u32),
    /// A flow's application pauses (posts nothing new; the policy is not told).
    AppPause(u32),
    /// A paused application posts again.
    AppResume(u32),
    /// A control verb that `host`'s policy held reaches the RNIC (application `app` issued
    /// it at `issued`; `pages`: of the region it registers).
    ControlIssue {
        host: HostId,
        app: u32,
        verb: ControlVerb,
        pages: u32,
        issued: Picos,
    },
}

impl From<RnicEvent> for Event {
    fn from(event: RnicEvent) -> Self {
        Event::Rnic(event)
    }
}

impl From<SwitchEvent> for Event {
    fn from(event: SwitchEvent) -> Self {
        Event::Switch(event)
    }
}

/// A completion to pass up to an application.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Notice {
    pub(crate) app: u32,
    pub(crate) qp: QpId,
    pub(crate) tag: u64,
}
