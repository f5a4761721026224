//! The bandwidth flow: large messages, a fixed number in flight per queue pair.
//!
//! Each queue pair keeps `depth` messages of `size` bytes outstanding and reposts as it
//! learns of completions. With event-driven polling the thread sleeps until a completion
//! event and needs `host.wakeup_us` to act; with `depth = 1` the link is idle for that
//! long after every message, which is why a 1 MB flow gets less than a 1 GB flow when both
//! poll by events (KBNets study §3.3, Justitia §2.1.5, N6) and why busy polling removes the
//! gap. Several queue pairs (`qps`) model an application that opens more connections
//! (Justitia Fig 5b, PeRF's B_App_multi).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::{AppIo, AppModel, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::Picos;
use crate::units::ByteSize;

/// Parameters of a bandwidth flow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthParams {
    /// Message size (Justitia: 1 MB or 1 GB; PeRF B_App: 1 MB).
    pub size: ByteSize,
    /// Messages outstanding per queue pair.
    #[serde(default = "one")]
    pub depth: u32,
    /// Queue pairs of the application, each with its own messages.
    #[serde(default = "one")]
    pub qps: u32,
    /// How completions are noticed (Justitia's bandwidth flows: events).
    #[serde(default = "event")]
    pub polling: Polling,
    /// The operation.
    #[serde(default = "write")]
    pub opcode: Opcode,
}

fn one() -> u32 {
    1
}

fn event() -> Polling {
    Polling::Event
}

fn write() -> Opcode {
    Opcode::Write
}

const WAKE: u64 = u64::MAX;

struct Lane {
    conn: Connection,
    posted_at: VecDeque<Picos>,
    refill_pending: bool,
}

/// A bandwidth flow.
pub(crate) struct BandwidthApp {
    lanes: Vec<Lane>,
    wr: WorkRequest,
    depth: usize,
    polling: Polling,
    wake_at: Option<Picos>,
    next_tag: u64,
    stopped: bool,
}

impl BandwidthApp {
    pub(crate) fn new(params: &BandwidthParams, conns: Vec<Connection>) -> Self {
        BandwidthApp {
            lanes: conns
                .into_iter()
                .map(|conn| Lane {
                    conn,
                    posted_at: VecDeque::new(),
                    refill_pending: false,
                })
                .collect(),
            wr: WorkRequest {
                tag: 0,
                opcode: params.opcode,
                bytes: params.size.bytes().min(u64::from(u32::MAX)) as u32,
                inline: false,
            },
            depth: params.depth.max(1) as usize,
            polling: params.polling,
            wake_at: None,
            next_tag: 0,
            stopped: false,
        }
    }

    fn refill(&mut self, io: &mut AppIo<'_>, lane: usize) {
        if self.stopped {
            return;
        }
        let now = io.now();
        while self.lanes[lane].posted_at.len() < self.depth {
            self.next_tag += 1;
            let wr = WorkRequest {
                tag: self.next_tag,
                ..self.wr
            };
            io.post(self.lanes[lane].conn.client, wr);
            self.lanes[lane].posted_at.push_back(now);
        }
    }
}

impl AppModel for BandwidthApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        for lane in 0..self.lanes.len() {
            self.refill(io, lane);
        }
    }

    fn stop(&mut self) {
        self.stopped = true;
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        if tag == WAKE {
            self.wake_at = None;
            for lane in 0..self.lanes.len() {
                self.refill(io, lane);
            }
        } else if let Some(lane) = self.lanes.get_mut(tag as usize) {
            lane.refill_pending = false;
            self.refill(io, tag as usize);
        }
    }

    fn on_completion(&mut self, io: &mut AppIo<'_>, qp: QpId, _tag: u64) {
        let Some(lane) = self.lanes.iter().position(|l| l.conn.client == qp) else {
            return;
        };
        let seen = match (self.polling, self.wake_at) {
            (Polling::Busy, _) => {
                let seen = io.now() + io.reaction(Polling::Busy);
                if !self.lanes[lane].refill_pending {
                    self.lanes[lane].refill_pending = true;
                    io.timer(seen, lane as u64);
                }
                seen
            }
            // One wake-up serves every completion that arrives until it.
            (Polling::Event, Some(wake)) => wake,
            (Polling::Event, None) => {
                let wake = io.now() + io.reaction(Polling::Event);
                self.wake_at = Some(wake);
                io.timer(wake, WAKE);
                wake
            }
        };
        if let Some(posted) = self.lanes[lane].posted_at.pop_front() {
            io.record_latency(seen, seen - posted);
            io.record_message(seen);
        }
    }

    fn on_delivery(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _bytes: u32) {}
}
