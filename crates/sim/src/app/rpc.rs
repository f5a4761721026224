//! An RPC service: clients send batches of small requests, the server answers each one.
//!
//! Modelled after the FaSST and eRPC deployments of Justitia §2.2: 32 B requests in
//! batches of 8, several client threads (one queue pair each), SENDs both ways, busy
//! polling on both sides. A client thread posts a batch, the server thread replies to each
//! request as it notices it, and the client posts the next batch once the whole batch is
//! answered. A sample is one request's post-to-response time; the message count is the
//! number of answered requests.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::{AppIo, AppModel, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::Picos;
use crate::units::ByteSize;

/// Parameters of an RPC service.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RpcParams {
    /// Request size (FaSST and eRPC in Justitia §2.2: 32 B).
    pub request_size: ByteSize,
    /// Response size; defaults to the request size.
    #[serde(default)]
    pub response_size: Option<ByteSize>,
    /// Requests per batch (Justitia §2.2: 8).
    pub batch: u32,
    /// Client threads, one queue pair each (FaSST: 4, eRPC: 2).
    #[serde(default = "one")]
    pub threads: u32,
    /// Post requests and responses inline when they fit.
    #[serde(default = "yes")]
    pub inline: bool,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

struct Thread {
    conn: Connection,
    posted_at: VecDeque<Picos>,
    unanswered: u32,
}

/// Timers: `thread * 2` for a client's next batch, `thread * 2 + 1` for a server reply.
pub(crate) struct RpcApp {
    threads: Vec<Thread>,
    request: WorkRequest,
    response: WorkRequest,
    batch: u32,
    next_tag: u64,
    stopped: bool,
}

impl RpcApp {
    pub(crate) fn new(params: &RpcParams, conns: Vec<Connection>) -> Self {
        let size = |s: ByteSize| s.bytes().min(u64::from(u32::MAX)) as u32;
        let request_bytes = size(params.request_size);
        let response_bytes = params.response_size.map_or(request_bytes, size);
        RpcApp {
            threads: conns
                .into_iter()
                .map(|conn| Thread {
                    conn,
                    posted_at: VecDeque::new(),
                    unanswered: 0,
                })
                .collect(),
            request: WorkRequest {
                tag: 0,
                opcode: Opcode::Send,
                bytes: request_bytes,
                inline: params.inline,
            },
            response: WorkRequest {
                tag: 0,
                opcode: Opcode::Send,
                bytes: response_bytes,
                inline: params.inline,
            },
            batch: params.batch.max(1),
            next_tag: 0,
            stopped: false,
        }
    }

    fn post_batch(&mut self, io: &mut AppIo<'_>, t: usize) {
        if self.stopped {
            return;
        }
        let now = io.now();
        for _ in 0..self.batch {
            self.next_tag += 1;
            let wr = WorkRequest {
                tag: self.next_tag,
                ..self.request
            };
            io.post(self.threads[t].conn.client, wr);
            self.threads[t].posted_at.push_back(now);
        }
        self.threads[t].unanswered = self.batch;
    }
}

impl AppModel for RpcApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        for t in 0..self.threads.len() {
            self.post_batch(io, t);
        }
    }

    fn stop(&mut self) {
        self.stopped = true;
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        let t = (tag / 2) as usize;
        if t >= self.threads.len() {
            return;
        }
        if tag.is_multiple_of(2) {
            self.post_batch(io, t);
        } else {
            self.next_tag += 1;
            let wr = WorkRequest {
                tag: self.next_tag,
                ..self.response
            };
            io.post(self.threads[t].conn.server, wr);
        }
    }

    fn on_completion(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _tag: u64) {}

    fn on_delivery(&mut self, io: &mut AppIo<'_>, qp: QpId, _bytes: u32) {
        let seen = io.now() + io.reaction(Polling::Busy);
        if let Some(t) = self.threads.iter().position(|th| th.conn.server == qp) {
            io.timer(seen, t as u64 * 2 + 1);
        } else if let Some(t) = self.threads.iter().position(|th| th.conn.client == qp) {
            if let Some(posted) = self.threads[t].posted_at.pop_front() {
                io.record_latency(seen, seen - posted);
                io.record_message(seen);
            }
            let th = &mut self.threads[t];
            th.unanswered = th.unanswered.saturating_sub(1);
            if th.unanswered == 0 {
                io.timer(seen, t as u64 * 2);
            }
        }
    }
}
