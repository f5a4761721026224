//! A host for the policy drivers' unit tests: host 0 of three RoCE-100 hosts on a switch,
//! whose event queue is never run, so every request a driver hands the RNIC stays in its queue pair's
//! send queue for the test to read, and completions are fed to the driver by hand.

#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;

use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};

use super::{FlowInfo, Mailbox, PolicyContext};
use crate::engine::EventQueue;
use crate::event::{Event, Notice};
use crate::ids::HostId;
use crate::model_profile::ModelProfile;
use crate::rnic::{Endpoint, Fabric, Opcode, QpId, QpOwner, WorkRequest};
use crate::time::Picos;
use crate::topology::Topology;

/// Host 0, where the driver under test runs.
pub(crate) struct TestHost {
    fabric: Fabric,
    queue: EventQueue<Event>,
    notices: VecDeque<Notice>,
    mailbox: Mailbox,
    apps: u32,
}

impl TestHost {
    pub(crate) fn new() -> Self {
        let profile = ModelProfile::builtin("RoCE-100").unwrap();
        let topology = Topology::switched(&[("a", 0), ("b", 0), ("c", 0)], 1, &profile.link);
        TestHost {
            fabric: Fabric::new(topology, &profile, 1, (0, Picos::MAX)),
            queue: EventQueue::new(),
            notices: VecDeque::new(),
            mailbox: Mailbox::default(),
            apps: 0,
        }
    }

    /// A flow of its own application from host 0 to host 1 on one new queue pair.
    pub(crate) fn flow(&mut self, id: u64, class: FlowClass) -> FlowInfo {
        self.flow_to(id, class, HostId(1))
    }

    /// A flow of its own application from host 0 to `peer` on one new queue pair.
    pub(crate) fn flow_to(&mut self, id: u64, class: FlowClass, peer: HostId) -> FlowInfo {
        let app = self.apps;
        self.apps += 1;
        let end = |host| Endpoint {
            host,
            owner: QpOwner::App(app),
            deliver: false,
        };
        let (qp, _) = self
            .fabric
            .connect(end(HostId(0)), end(peer), Some(id as u32));
        FlowInfo {
            spec: FlowSpec {
                id: FlowId(id),
                tenant: TenantId(id),
                class,
                weight: Weight::ONE,
            },
            name: format!("flow{id}"),
            qps: vec![qp],
            peer,
            reads: false,
        }
    }

    /// The queue pairs `qps` of one flow read their messages from `mrs` regions of
    /// `mr_bytes` each, 4 KB pages, the walk from offset 0 (see `rnic::memory`).
    pub(crate) fn set_memory(&mut self, qps: &[QpId], mrs: u32, mr_bytes: u64) {
        self.fabric.set_memory(qps, mrs, mr_bytes, 4096, 0);
    }

    /// What the driver may do, now.
    pub(crate) fn ctx(&mut self) -> PolicyContext<'_> {
        PolicyContext {
            host: HostId(0),
            fabric: &mut self.fabric,
            queue: &mut self.queue,
            notices: &mut self.notices,
            mailbox: &mut self.mailbox,
        }
    }

    /// The requests the driver has handed the RNIC on `qp`, in order.
    pub(crate) fn posted(&self, qp: QpId) -> Vec<WorkRequest> {
        self.fabric.send_queue(qp)
    }

    /// The application tags the driver has completed since the last call, in order.
    pub(crate) fn completed(&mut self) -> Vec<u64> {
        self.notices.drain(..).map(|n| n.tag).collect()
    }

    /// Runs the clock to the next timer the driver set, dropping the RNIC's own events:
    /// its time and tag.
    pub(crate) fn next_timer(&mut self) -> Option<(Picos, u64)> {
        while let Some((at, event)) = self.queue.pop_until(Picos::MAX) {
            if let Event::PolicyTimer { tag, .. } = event {
                return Some((at, tag));
            }
        }
        None
    }

    /// Runs the clock out, dropping the RNIC's events: the control verbs the driver held,
    /// as (application, when they reach the RNIC), in time order.
    pub(crate) fn control_issues(&mut self) -> Vec<(u32, Picos)> {
        let mut issues = Vec::new();
        while let Some((at, event)) = self.queue.pop_until(Picos::MAX) {
            if let Event::ControlIssue { app, .. } = event {
                issues.push((app, at));
            }
        }
        issues
    }

    /// The host at the other end of `qp`.
    pub(crate) fn peer_of(&self, qp: QpId) -> HostId {
        // `connect` numbers a connection's two ends one after the other.
        self.fabric.host_of(QpId(qp.0 + 1))
    }

    /// The next timer the driver set that is due before `at`, dropping the RNIC's events
    /// on the way; `None` once the next is due at `at` or later, the clock then at `at`
    /// with what is due then still queued.
    pub(crate) fn next_timer_before(&mut self, at: Picos) -> Option<(Picos, u64)> {
        while let Some((when, event)) = self.queue.pop_until(at.saturating_sub(1)) {
            if let Event::PolicyTimer { tag, .. } = event {
                return Some((when, tag));
            }
        }
        self.queue.advance_to(at);
        None
    }

    /// Runs the clock to `at`, dropping the RNIC's events due before it; no timer of the
    /// driver may fall due on the way.
    pub(crate) fn advance_to(&mut self, at: Picos) {
        while let Some((_, event)) = self.queue.pop_until(at) {
            assert!(
                !matches!(event, Event::PolicyTimer { .. }),
                "a timer fell due before {at} ps"
            );
        }
        self.queue.advance_to(at);
    }

    /// Now.
    pub(crate) fn now(&self) -> Picos {
        self.queue.now()
    }
}

/// An application's RDMA WRITE of `bytes`, not inline.
pub(crate) fn write(tag: u64, bytes: u32) -> WorkRequest {
    WorkRequest {
        tag,
        opcode: Opcode::Write,
        bytes,
        inline: false,
    }
}
