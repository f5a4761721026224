//! The throughput flow: batches of small messages, as many in flight as the depth allows.
//!
//! Each queue pair keeps at most `depth` requests outstanding and posts `batch` at a time
//! (one post list, one doorbell) whenever a whole batch fits. With `depth = batch` (the
//! default) every batch waits for the previous one to complete, like Justitia's
//! throughput-sensitive flows (continuous batches of 64 x 16 B); a larger depth keeps the
//! pipeline full, like perftest's `*_bw` with small messages (PeRF's M_App). Every message's
//! post-to-completion time is recorded too.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::{AppIo, AppModel, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::Picos;
use crate::units::ByteSize;

/// Parameters of a throughput flow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThroughputParams {
    /// Message size (Justitia: 16 B).
    pub size: ByteSize,
    /// Messages posted together (Justitia: 64; PeRF M_App: 32).
    pub batch: u32,
    /// Most messages outstanding per queue pair; defaults to `batch`.
    #[serde(default)]
    pub depth: Option<u32>,
    /// Queue pairs, each driven independently (PeRF's M_App_multi).
    #[serde(default = "one")]
    pub qps: u32,
    /// Post payloads inline when they fit.
    #[serde(default = "yes")]
    pub inline: bool,
    /// The operation.
    #[serde(default = "write")]
    pub opcode: Opcode,
    /// How completions are noticed.
    #[serde(default)]
    pub polling: Polling,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn write() -> Opcode {
    Opcode::Write
}

struct Lane {
    conn: Connection,
    posted_at: VecDeque<Picos>,
    refill_pending: bool,
}

/// A throughput flow.
pub(crate) struct ThroughputApp {
    lanes: Vec<Lane>,
    wr: WorkRequest,
    batch: usize,
    depth: usize,
    polling: Polling,
    next_tag: u64,
    stopped: bool,
}

impl ThroughputApp {
    pub(crate) fn new(params: &ThroughputParams, conns: Vec<Connection>) -> Self {
        let batch = params.batch.max(1) as usize;
        ThroughputApp {
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
                inline: params.inline,
            },
            batch,
            depth: params.depth.map_or(batch, |d| d as usize).max(batch),
            polling: params.polling,
            next_tag: 0,
            stopped: false,
        }
    }

    fn refill(&mut self, io: &mut AppIo<'_>, lane: usize) {
        if self.stopped {
            return;
        }
        let now = io.now();
        while self.lanes[lane].posted_at.len() + self.batch <= self.depth {
            for _ in 0..self.batch {
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
}

impl AppModel for ThroughputApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        for lane in 0..self.lanes.len() {
            self.refill(io, lane);
        }
    }

    fn stop(&mut self) {
        self.stopped = true;
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        let lane = tag as usize;
        if lane < self.lanes.len() {
            self.lanes[lane].refill_pending = false;
            self.refill(io, lane);
        }
    }

    fn on_completion(&mut self, io: &mut AppIo<'_>, qp: QpId, _tag: u64) {
        let Some(lane) = self.lanes.iter().position(|l| l.conn.client == qp) else {
            return;
        };
        let seen = io.now() + io.reaction(self.polling);
        if let Some(posted) = self.lanes[lane].posted_at.pop_front() {
            io.record_latency(seen, seen - posted);
            io.record_message(seen);
        }
        let l = &mut self.lanes[lane];
        if !l.refill_pending && l.posted_at.len() + self.batch <= self.depth {
            l.refill_pending = true;
            io.timer(seen, lane as u64);
        }
    }

    fn on_delivery(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _bytes: u32) {}
}
