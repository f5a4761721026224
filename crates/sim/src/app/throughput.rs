//! The throughput flow: batches of small messages, as many in flight as the depth allows.
//!
//! Each queue pair keeps at most `depth` requests outstanding and posts `batch` at a time
//! (one post list, one doorbell) whenever a whole batch fits. With `depth = batch` (the
//! default) every batch waits for the previous one to complete, like Justitia's
//! throughput-sensitive flows (continuous batches of 64 x 16 B); a larger depth keeps the
//! pipeline full, like perftest's `*_bw` with small messages (PeRF's M_App). Every message's
//! post-to-completion time is recorded too.

use serde::{Deserialize, Serialize};

use super::lanes::Lanes;
use super::{AppIo, AppModel, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
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

/// A throughput flow: lanes that post a batch at a time.
pub(crate) struct ThroughputApp {
    lanes: Lanes,
    polling: Polling,
}

impl ThroughputApp {
    pub(crate) fn new(params: &ThroughputParams, conns: Vec<Connection>) -> Self {
        let batch = params.batch.max(1) as usize;
        let wr = WorkRequest {
            tag: 0,
            opcode: params.opcode,
            bytes: params.size.bytes().min(u64::from(u32::MAX)) as u32,
            inline: params.inline,
        };
        let depth = params.depth.map_or(batch, |d| d as usize);
        ThroughputApp {
            lanes: Lanes::new(conns, wr, batch, depth),
            polling: params.polling,
        }
    }
}

impl AppModel for ThroughputApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        self.lanes.resume();
        self.lanes.refill_all(io);
    }

    fn stop(&mut self) {
        self.lanes.stop();
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        self.lanes.on_refill_timer(io, tag as usize);
    }

    fn on_completion(&mut self, io: &mut AppIo<'_>, qp: QpId, _tag: u64) {
        let Some(lane) = self.lanes.of_qp(qp) else {
            return;
        };
        let seen = io.now() + io.reaction(self.polling);
        self.lanes.complete_oldest(io, lane, seen);
        self.lanes.schedule_refill(io, lane, seen);
    }

    fn on_delivery(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _bytes: u32) {}
}
