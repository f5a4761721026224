//! Per-process counters, written as JSON at exit when `JUSTITIA_STATS` names a file.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::follow::FollowStatus;

/// The live counters. Every field only grows (`queued_max` is a running maximum).
#[derive(Debug, Default)]
pub struct Counters {
    /// Send requests the application posted (every QP, shaped or not).
    pub requests: AtomicU64,
    /// Requests that were split into two or more chunks.
    pub split_requests: AtomicU64,
    /// Chunks posted for split requests.
    pub chunks: AtomicU64,
    /// Payload bytes of the application's send requests.
    pub bytes: AtomicU64,
    /// Zero-length yields posted (`preempt`).
    pub yields: AtomicU64,
    /// Total time work requests waited for pacing tokens, in nanoseconds.
    pub pacing_delay_ns: AtomicU64,
    /// Most application requests waiting in the software queues at once.
    pub queued_max: AtomicU64,
    /// Queue pairs created.
    pub qps: AtomicU64,
    /// Error completions reported to the application, and posts the shaper had to fail.
    pub errors: AtomicU64,
    /// Connections made to `justitiad` ([`FollowStatus::connections`]): 1 for a process
    /// that followed one daemon throughout, one more for each time a daemon answered again
    /// after a loss. Published by the follower thread after each of its ticks.
    pub daemon_connections: AtomicU64,
    /// Times the followed daemon was found gone ([`FollowStatus::fallbacks`]: its
    /// connection closed, as when it exits, is killed or is replaced), after each of which
    /// the shaper enforced its static settings until a daemon answered. Published as
    /// `daemon_connections` is.
    pub daemon_fallbacks: AtomicU64,
    /// Of `split_requests`, those split while a daemon the process had followed was gone
    /// ([`FollowStatus::split_while_gone`]). Published as `daemon_connections` is.
    pub split_while_daemon_gone: AtomicU64,
    /// Times a shaped QP with requests to post was put in line for a turn
    /// (`JUSTITIA_QP_TURNS`).
    pub turn_waits: AtomicU64,
    /// Times a QP that had spent its turn gave it to one in line, with requests left.
    pub turn_yields: AtomicU64,
    /// Side channels open ([`FollowStatus::side_channels`]). Published as
    /// `daemon_connections` is.
    pub side_channels: AtomicU64,
    /// Queue pairs' pairings reported to a daemon (`crate::pairing`). Published as
    /// `daemon_connections` is.
    pub pairings_reported: AtomicU64,
    /// Peer side channels the daemon found for the process's queue pairs. Published as
    /// `daemon_connections` is.
    pub qps_paired: AtomicU64,
    /// Of them, those whose peer's hello came on the side channel: the two shapers agree
    /// on the version. Published as `daemon_connections` is.
    pub qps_agreed: AtomicU64,
    /// Datagrams the side channels dropped: not a message, or not from the side channel
    /// they claim. Published as `daemon_connections` is.
    pub side_refused: AtomicU64,
    /// Two-sided messages announced to the peer's shaper (each then goes whole or split
    /// as the peer posted its receives).
    pub announced: AtomicU64,
    /// Queue pairs whose receives the shaper owns (the peer splits its sends to them).
    pub qps_owning_receives: AtomicU64,
    /// Polls of a receive CQ by the shaper's own thread on its timer, for a queue pair
    /// whose peer's message waited for room in its receive queue: an application that
    /// polls only later would otherwise hold the message back.
    pub receiver_polls_aside: AtomicU64,
    /// Arms of a receive CQ for the application's next completion that the shaper made
    /// arms for the next solicited one: the CQ's completions were all of split messages
    /// whose ends the peer's shaper marks, so an event-driven receiver wakes per message
    /// rather than per chunk.
    pub cq_arms_solicited: AtomicU64,
    /// Times a two-sided message waited for its peer's credit before its next chunk (or
    /// the message itself) could go: the receiver had not posted its receives yet. The
    /// flow then goes on at its rate, without the burst it would have after idling.
    pub credit_holds: AtomicU64,
}

/// A copy of the counters, in the JSON form written at exit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// See [`Counters::requests`].
    pub requests: u64,
    /// See [`Counters::split_requests`].
    pub split_requests: u64,
    /// See [`Counters::chunks`].
    pub chunks: u64,
    /// See [`Counters::bytes`].
    pub bytes: u64,
    /// See [`Counters::yields`].
    pub yields: u64,
    /// See [`Counters::pacing_delay_ns`].
    pub pacing_delay_ns: u64,
    /// See [`Counters::queued_max`].
    pub queued_max: u64,
    /// See [`Counters::qps`].
    pub qps: u64,
    /// See [`Counters::errors`].
    pub errors: u64,
    /// See [`Counters::daemon_connections`].
    pub daemon_connections: u64,
    /// See [`Counters::daemon_fallbacks`].
    pub daemon_fallbacks: u64,
    /// See [`Counters::split_while_daemon_gone`].
    pub split_while_daemon_gone: u64,
    /// Control verbs (memory registrations, QP creations) the process issued.
    #[serde(default)]
    pub control_verbs: u64,
    /// Of them, those that waited for the process's control-verb budget.
    #[serde(default)]
    pub control_verbs_delayed: u64,
    /// The time they waited, in nanoseconds.
    #[serde(default)]
    pub control_wait_ns: u64,
    /// See [`Counters::turn_waits`].
    #[serde(default)]
    pub turn_waits: u64,
    /// See [`Counters::turn_yields`].
    #[serde(default)]
    pub turn_yields: u64,
    /// See [`Counters::side_channels`].
    #[serde(default)]
    pub side_channels: u64,
    /// See [`Counters::pairings_reported`].
    #[serde(default)]
    pub pairings_reported: u64,
    /// See [`Counters::qps_paired`].
    #[serde(default)]
    pub qps_paired: u64,
    /// See [`Counters::qps_agreed`].
    #[serde(default)]
    pub qps_agreed: u64,
    /// See [`Counters::side_refused`].
    #[serde(default)]
    pub side_refused: u64,
    /// See [`Counters::announced`].
    #[serde(default)]
    pub announced: u64,
    /// See [`Counters::qps_owning_receives`].
    #[serde(default)]
    pub qps_owning_receives: u64,
    /// See [`Counters::receiver_polls_aside`].
    #[serde(default)]
    pub receiver_polls_aside: u64,
    /// See [`Counters::cq_arms_solicited`].
    #[serde(default)]
    pub cq_arms_solicited: u64,
    /// See [`Counters::credit_holds`].
    #[serde(default)]
    pub credit_holds: u64,
}

impl Counters {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Raises the running maximum of queued requests to `queued`.
    pub fn note_queued(&self, queued: u64) {
        self.queued_max.fetch_max(queued, Ordering::Relaxed);
    }

    /// Publishes the follower's counts (running counts: each only grows).
    pub fn note_follow(&self, status: &FollowStatus) {
        self.daemon_connections
            .fetch_max(status.connections, Ordering::Relaxed);
        self.daemon_fallbacks
            .fetch_max(status.fallbacks, Ordering::Relaxed);
        self.split_while_daemon_gone
            .fetch_max(status.split_while_gone, Ordering::Relaxed);
        self.side_channels
            .fetch_max(u64::from(status.side_channels), Ordering::Relaxed);
        self.pairings_reported
            .fetch_max(status.pairing.reported, Ordering::Relaxed);
        self.qps_paired
            .fetch_max(status.pairing.paired, Ordering::Relaxed);
        self.qps_agreed
            .fetch_max(status.pairing.agreed, Ordering::Relaxed);
        self.side_refused
            .fetch_max(status.pairing.refused, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            requests: get(&self.requests),
            split_requests: get(&self.split_requests),
            chunks: get(&self.chunks),
            bytes: get(&self.bytes),
            yields: get(&self.yields),
            pacing_delay_ns: get(&self.pacing_delay_ns),
            queued_max: get(&self.queued_max),
            qps: get(&self.qps),
            errors: get(&self.errors),
            daemon_connections: get(&self.daemon_connections),
            daemon_fallbacks: get(&self.daemon_fallbacks),
            split_while_daemon_gone: get(&self.split_while_daemon_gone),
            // The engine's control-verb pacer keeps these (see `Engine::stats`).
            control_verbs: 0,
            control_verbs_delayed: 0,
            control_wait_ns: 0,
            turn_waits: get(&self.turn_waits),
            turn_yields: get(&self.turn_yields),
            side_channels: get(&self.side_channels),
            pairings_reported: get(&self.pairings_reported),
            qps_paired: get(&self.qps_paired),
            qps_agreed: get(&self.qps_agreed),
            side_refused: get(&self.side_refused),
            announced: get(&self.announced),
            qps_owning_receives: get(&self.qps_owning_receives),
            receiver_polls_aside: get(&self.receiver_polls_aside),
            cq_arms_solicited: get(&self.cq_arms_solicited),
            credit_holds: get(&self.credit_holds),
        }
    }
}

impl StatsSnapshot {
    /// The one-line JSON object.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Writes the JSON object and a newline to `path` (replacing the file).
    pub fn write_to(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, format!("{}\n", self.to_json()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn json_has_exactly_the_documented_keys() {
        let c = Counters::default();
        Counters::add(&c.requests, 3);
        Counters::add(&c.chunks, 16);
        c.note_queued(5);
        c.note_queued(2);
        let json = c.snapshot().to_json();
        assert_eq!(
            json,
            "{\"requests\":3,\"split_requests\":0,\"chunks\":16,\"bytes\":0,\"yields\":0,\
             \"pacing_delay_ns\":0,\"queued_max\":5,\"qps\":0,\"errors\":0,\
             \"daemon_connections\":0,\"daemon_fallbacks\":0,\"split_while_daemon_gone\":0,\
             \"control_verbs\":0,\"control_verbs_delayed\":0,\"control_wait_ns\":0,\
             \"turn_waits\":0,\"turn_yields\":0,\"side_channels\":0,\"pairings_reported\":0,\
             \"qps_paired\":0,\"qps_agreed\":0,\"side_refused\":0,\"announced\":0,\
             \"qps_owning_receives\":0,\"receiver_polls_aside\":0,\"cq_arms_solicited\":0,\"credit_holds\":0}"
        );
        let back: StatsSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c.snapshot());
    }

    /// The follower's counts as its ticks publish them: running counts, so a status read
    /// late (an older one) never takes them back.
    #[test]
    fn the_followers_counts_are_published_and_only_grow() {
        let c = Counters::default();
        let status = |connections, fallbacks, split_while_gone| FollowStatus {
            connected: true,
            flow: None,
            allotment: None,
            active: false,
            fallbacks,
            stale_periods: 0,
            connections,
            split_while_gone,
            side_channels: 1,
            pairing: crate::pairing::PairingCounts {
                reported: connections,
                paired: fallbacks,
                agreed: fallbacks,
                ..Default::default()
            },
        };
        c.note_follow(&status(2, 1, 40));
        c.note_follow(&status(1, 0, 7));
        let s = c.snapshot();
        assert_eq!(
            (
                s.daemon_connections,
                s.daemon_fallbacks,
                s.split_while_daemon_gone
            ),
            (2, 1, 40)
        );
        assert_eq!(
            (
                s.side_channels,
                s.pairings_reported,
                s.qps_paired,
                s.qps_agreed
            ),
            (1, 2, 1, 1)
        );
        assert!(s.to_json().contains(
            "\"daemon_connections\":2,\"daemon_fallbacks\":1,\"split_while_daemon_gone\":40,"
        ));
    }
}
