//! The latency flow: one small message at a time, each completion timed.
//!
//! Two ways of timing, as in the papers' tools:
//! - **post-and-poll** (`mode = "post-poll"`, the default): post one request, busy-poll
//!   its completion; the sample is post to completion seen. This is also how Justitia's
//!   daemon times its reference flow (§4.2.1) and how PeRF times a D_App.
//! - **ping-pong** (`mode = "ping-pong"`): perftest's `*_lat`: the client writes, the
//!   server polls its memory and writes back; the sample is half the round trip.
//!
//! With `interval_us` > 0 the flow is sparse (a D_App): a new message starts at most every
//! interval instead of right after the previous one.

use serde::{Deserialize, Serialize};

use super::{AppIo, AppModel, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::{self, Picos};
use crate::units::ByteSize;

/// How a latency flow times its messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LatencyMode {
    /// Post, then busy-poll the completion: sample = post to completion.
    #[default]
    PostPoll,
    /// Write, the peer writes back: sample = half the round trip.
    PingPong,
    /// RPerf's LSG (§IV): post, busy-poll the completion; sample = the network round trip
    /// from the request leaving the RNIC to its ACK coming back, with the local and remote
    /// processing left out (RPerf subtracts a loopback message's completion time).
    Rperf,
}

/// Parameters of a latency flow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatencyParams {
    /// Message size (Justitia: 16 B).
    pub size: ByteSize,
    /// How each message is timed.
    #[serde(default)]
    pub mode: LatencyMode,
    /// Post the payload inline (when it fits the RNIC's inline limit).
    #[serde(default = "yes")]
    pub inline: bool,
    /// The operation (`write`, `send` or `read`; ping-pong uses writes).
    #[serde(default = "write")]
    pub opcode: Opcode,
    /// Minimum time between the starts of two messages, in us; 0 sends back to back.
    #[serde(default)]
    pub interval_us: f64,
}

fn yes() -> bool {
    true
}

fn write() -> Opcode {
    Opcode::Write
}

const SEEN: u64 = 0;
const POST: u64 = 1;
const PONG: u64 = 2;

/// A latency flow on one connection.
pub(crate) struct LatencyApp {
    conn: Connection,
    wr: WorkRequest,
    mode: LatencyMode,
    interval: Picos,
    posted_at: Picos,
    next_tag: u64,
    stopped: bool,
    wire_rtt: Picos,
}

impl LatencyApp {
    pub(crate) fn new(params: &LatencyParams, conn: Connection) -> Self {
        let opcode = match params.mode {
            LatencyMode::PingPong => Opcode::Write,
            LatencyMode::PostPoll | LatencyMode::Rperf => params.opcode,
        };
        LatencyApp {
            conn,
            wr: WorkRequest {
                tag: 0,
                opcode,
                bytes: params.size.bytes().min(u64::from(u32::MAX)) as u32,
                inline: params.inline,
            },
            mode: params.mode,
            interval: time::from_us(params.interval_us),
            posted_at: 0,
            next_tag: 0,
            stopped: false,
            wire_rtt: 0,
        }
    }

    fn send(&mut self, io: &mut AppIo<'_>) {
        if self.stopped {
            return;
        }
        self.posted_at = io.now();
        self.next_tag += 1;
        let wr = WorkRequest {
            tag: self.next_tag,
            ..self.wr
        };
        io.post(self.conn.client, wr);
    }

    /// After a sample: the next message now, or at the next interval boundary.
    fn next(&mut self, io: &mut AppIo<'_>) {
        let due = self.posted_at + self.interval;
        if self.interval > 0 && due > io.now() {
            io.timer(due, POST);
        } else {
            self.send(io);
        }
    }
}

impl AppModel for LatencyApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        self.send(io);
    }

    fn stop(&mut self) {
        self.stopped = true;
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        match tag {
            SEEN => {
                let sample = io.now() - self.posted_at;
                let sample = match self.mode {
                    LatencyMode::PostPoll => sample,
                    LatencyMode::PingPong => sample / 2,
                    LatencyMode::Rperf => self.wire_rtt,
                };
                let now = io.now();
                io.record_latency(now, sample);
                io.record_message(now);
                self.next(io);
            }
            POST => self.send(io),
            // A ping already on its way is answered even after the flow stopped.
            PONG => io.post(self.conn.server, self.wr),
            _ => {}
        }
    }

    fn on_completion(&mut self, io: &mut AppIo<'_>, qp: QpId, _tag: u64) {
        if self.mode != LatencyMode::PingPong && qp == self.conn.client {
            self.wire_rtt = io.wire_rtt.unwrap_or(0);
            let at = io.now() + io.reaction(Polling::Busy);
            io.timer(at, SEEN);
        }
    }

    fn on_delivery(&mut self, io: &mut AppIo<'_>, qp: QpId, _bytes: u32) {
        if self.mode != LatencyMode::PingPong {
            return;
        }
        let at = io.now() + io.reaction(Polling::Busy);
        if qp == self.conn.server {
            io.timer(at, PONG);
        } else {
            io.timer(at, SEEN);
        }
    }
}
