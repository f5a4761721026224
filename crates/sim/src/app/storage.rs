//! A storage service that moves objects as 1 MB splits.
//!
//! The blob store of Justitia §2.2.1 divides objects larger than 1 MB into 1 MB splits and
//! spreads them over backend servers, which makes a stream of 1 MB transfers. Here the
//! frontend writes objects of `object_size` one after another as `split_size` WRITEs, round
//! robin over `backends` queue pairs, with at most `depth` splits in flight, and learns of
//! completions by events. A sample is one object's time from its first split's post to its
//! last split's completion; the message count is the number of objects stored.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::{AppIo, AppModel, CompletionWatch, Connection, Polling};
use crate::rnic::{Opcode, QpId, WorkRequest};
use crate::time::Picos;
use crate::units::ByteSize;

/// Parameters of a storage service.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageParams {
    /// Size of each stored object.
    pub object_size: ByteSize,
    /// Size of a split (Justitia §2.2.1: 1 MB).
    #[serde(default = "one_megabyte")]
    pub split_size: ByteSize,
    /// Queue pairs to backends; splits go round robin over them.
    #[serde(default = "one")]
    pub backends: u32,
    /// Splits in flight at most.
    #[serde(default = "four")]
    pub depth: u32,
    /// How completions are noticed.
    #[serde(default = "event")]
    pub polling: Polling,
}

fn one_megabyte() -> ByteSize {
    ByteSize(1 << 20)
}

fn one() -> u32 {
    1
}

fn four() -> u32 {
    4
}

fn event() -> Polling {
    Polling::Event
}

struct Object {
    started: Picos,
    unfinished: u64,
}

/// A storage frontend. Tags are split numbers; object `i` is splits
/// `[i * splits_per_object, (i + 1) * splits_per_object)`.
pub(crate) struct StorageApp {
    conns: Vec<Connection>,
    split_bytes: u32,
    splits_per_object: u64,
    depth: u64,
    watch: CompletionWatch,
    next_split: u64,
    in_flight: u64,
    objects: VecDeque<Object>,
    first_object: u64,
    stopped: bool,
}

impl StorageApp {
    pub(crate) fn new(params: &StorageParams, conns: Vec<Connection>) -> Self {
        let split = params.split_size.bytes().clamp(1, u64::from(u32::MAX));
        StorageApp {
            conns,
            split_bytes: split as u32,
            splits_per_object: params.object_size.bytes().div_ceil(split).max(1),
            depth: u64::from(params.depth.max(1)),
            watch: CompletionWatch::new(params.polling),
            next_split: 0,
            in_flight: 0,
            objects: VecDeque::new(),
            first_object: 0,
            stopped: false,
        }
    }

    fn fill(&mut self, io: &mut AppIo<'_>) {
        if self.stopped {
            return;
        }
        while self.in_flight < self.depth {
            let split = self.next_split;
            self.next_split += 1;
            if split.is_multiple_of(self.splits_per_object) {
                self.objects.push_back(Object {
                    started: io.now(),
                    unfinished: self.splits_per_object,
                });
            }
            let conn = self.conns[(split % self.conns.len() as u64) as usize];
            io.post(
                conn.client,
                WorkRequest {
                    tag: split,
                    opcode: Opcode::Write,
                    bytes: self.split_bytes,
                    inline: false,
                },
            );
            self.in_flight += 1;
        }
    }
}

impl AppModel for StorageApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        self.fill(io);
    }

    fn stop(&mut self) {
        self.stopped = true;
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        self.watch.woke(tag);
        self.fill(io);
    }

    fn on_completion(&mut self, io: &mut AppIo<'_>, _qp: QpId, tag: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        let seen = self.watch.seen(io);
        // A sleeping thread fills at its wake-up; a busy one as soon as it notices.
        if self.watch.polling() == Polling::Busy {
            io.timer(seen, 0);
        }
        let object = tag / self.splits_per_object;
        if let Some(o) = object
            .checked_sub(self.first_object)
            .and_then(|i| self.objects.get_mut(i as usize))
        {
            o.unfinished = o.unfinished.saturating_sub(1);
        }
        while self.objects.front().is_some_and(|o| o.unfinished == 0) {
            if let Some(o) = self.objects.pop_front() {
                io.record_latency(seen, seen - o.started);
                io.record_message(seen);
            }
            self.first_object += 1;
        }
    }

    fn on_delivery(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _bytes: u32) {}
}
