//! The bandwidth flow: large messages, a fixed number in flight per queue pair.
//!
//! Each queue pair keeps `depth` messages of `size` bytes outstanding and reposts as it
//! learns of completions. With event-driven polling the thread sleeps until a completion
//! event and needs `host.wakeup_us` to act; with `depth = 1` the link is idle for that
//! long after every message, which is why a 1 MB flow gets less than a 1 GB flow when both
//! poll by events (KBNets study §3.3, Justitia §2.1.5, N6) and why busy polling removes the
//! gap. Several queue pairs (`qps`) model an application that opens more connections
//! (Justitia Fig 5b, PeRF's B_App_multi).

use serde::{Deserialize, Serialize};

use super::lanes::Lanes;
use super::{AppIo, AppModel, CompletionWatch, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
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

/// A bandwidth flow: lanes that post one message at a time.
pub(crate) struct BandwidthApp {
    lanes: Lanes,
    watch: CompletionWatch,
}

impl BandwidthApp {
    pub(crate) fn new(params: &BandwidthParams, conns: Vec<Connection>) -> Self {
        let wr = WorkRequest {
            tag: 0,
            opcode: params.opcode,
            bytes: params.size.bytes().min(u64::from(u32::MAX)) as u32,
            inline: false,
        };
        BandwidthApp {
            lanes: Lanes::new(conns, wr, 1, params.depth.max(1) as usize),
            watch: CompletionWatch::new(params.polling),
        }
    }
}

impl AppModel for BandwidthApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        self.lanes.resume();
        self.lanes.refill_all(io);
    }

    fn stop(&mut self) {
        self.lanes.stop();
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        if self.watch.woke(tag) {
            self.lanes.refill_all(io);
        } else {
            self.lanes.on_refill_timer(io, tag as usize);
        }
    }

    fn on_completion(&mut self, io: &mut AppIo<'_>, qp: QpId, _tag: u64) {
        let Some(lane) = self.lanes.of_qp(qp) else {
            return;
        };
        let seen = self.watch.seen(io);
        self.lanes.complete_oldest(io, lane, seen);
        // A sleeping thread refills every lane at its wake-up.
        if self.watch.polling() == Polling::Busy {
            self.lanes.schedule_refill(io, lane, seen);
        }
    }

    fn on_delivery(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _bytes: u32) {}
}
