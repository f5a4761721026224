//! What one flow does: the plan a runner hands to a load-generator process (as JSON on its
//! command line) and the figures the process hands back (as JSON on its stdout).
//!
//! A plan is complete in itself: both ends of a flow read the same plan, so the responder
//! knows whether to post receives (SEND), to answer (ping-pong) or to stay passive
//! (WRITE, READ). Every size and count is checked by [`FlowPlan::validate`] before any
//! verbs object exists, against caps that keep one process's memory bounded.

use serde::{Deserialize, Serialize};

/// Largest message: 1 GiB (the papers' largest bandwidth flow).
pub const MAX_MESSAGE_BYTES: u64 = 1 << 30;

/// Most queue pairs of one flow.
pub const MAX_QPS: u32 = 256;

/// Most messages outstanding per queue pair.
pub const MAX_DEPTH: u32 = 1024;

/// Most memory one flow registers per side: 2 GiB.
pub const MAX_REGISTERED_BYTES: u64 = 2 << 30;

/// The operation a flow's requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND, received into posted receive buffers.
    Send,
}

impl Op {
    /// The name as scenarios and reports write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
            Op::Send => "send",
        }
    }
}

/// How a latency flow times its messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LatencyMethod {
    /// Post one request, busy-poll its completion: sample = post to completion seen, which
    /// includes both ends' software and PCIe time.
    PostPoll,
    /// perftest's `*_lat`: the requester sends, the responder answers as soon as it sees the
    /// message; sample = half the round trip.
    PingPong,
    /// RPerf: an over-the-wire SEND and a loopback SEND posted back to back, the wire one
    /// first, each timed from its own post to its own completion, both polled by one
    /// pinned thread; sample = T_W - T_L, the network's round trip without the local
    /// end's posting and completion costs (the remote RNIC acknowledges on receipt, so no
    /// remote software time is in T_W).
    Rperf,
}

impl LatencyMethod {
    /// The name as the command line writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            LatencyMethod::PostPoll => "post-poll",
            LatencyMethod::PingPong => "ping-pong",
            LatencyMethod::Rperf => "rperf",
        }
    }
}

/// How a stream notices completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Polling {
    /// Spin on the completion queue.
    Busy,
    /// Sleep on the completion channel until an event.
    Event,
}

/// What a flow's requester does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum Workload {
    /// One message at a time, each timed.
    Latency {
        /// Message size, bytes.
        size: u64,
        /// The operation (ping-pong and RPerf force theirs: WRITE or SEND, and SEND).
        op: Op,
        /// How each message is timed.
        method: LatencyMethod,
        /// Post the payload inline when the QP allows it.
        inline: bool,
        /// Least time between the starts of two messages, us; 0 is back to back.
        interval_us: f64,
    },
    /// perftest's bandwidth tests: every queue pair keeps `depth` messages outstanding,
    /// posted `batch` at a time as one list.
    Stream {
        /// Message size, bytes.
        size: u64,
        /// Queue pairs.
        qps: u32,
        /// Messages outstanding per queue pair.
        depth: u32,
        /// Requests per `ibv_post_send` list (perftest's post list).
        batch: u32,
        /// The operation.
        op: Op,
        /// Post payloads inline when the QP allows it.
        inline: bool,
        /// How completions are noticed.
        polling: Polling,
    },
}

/// One flow of one run, as a load-generator process runs it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowPlan {
    /// The flow's name in the scenario (with `#n` for copies): every error names it.
    pub name: String,
    /// What it does.
    pub workload: Workload,
    /// From the common start to when it begins posting, ms.
    pub start_ms: f64,
    /// From the common start to when it stops posting, ms.
    pub stop_ms: f64,
    /// Start of the measurement window, ms from the common start.
    pub window_from_ms: f64,
    /// End of the measurement window, ms from the common start.
    pub window_to_ms: f64,
}

/// A plan that cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("flow {flow}: {field}: {reason}")]
pub struct PlanError {
    /// The flow.
    pub flow: String,
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl FlowPlan {
    /// Checks every size, count and time against the caps above.
    pub fn validate(&self) -> Result<(), PlanError> {
        let err = |field: &'static str, reason: String| PlanError {
            flow: self.name.clone(),
            field,
            reason,
        };
        let times = [
            self.start_ms,
            self.stop_ms,
            self.window_from_ms,
            self.window_to_ms,
        ];
        if times.iter().any(|t| !t.is_finite() || *t < 0.0) {
            return Err(err("times", format!("must be finite and >= 0: {times:?}")));
        }
        if self.stop_ms <= self.start_ms || self.window_to_ms <= self.window_from_ms {
            return Err(err(
                "times",
                format!("each span must end after it starts: {times:?}"),
            ));
        }
        let size = match &self.workload {
            Workload::Latency {
                size, interval_us, ..
            } => {
                if !interval_us.is_finite() || *interval_us < 0.0 {
                    return Err(err(
                        "interval_us",
                        format!("must be >= 0, got {interval_us}"),
                    ));
                }
                *size
            }
            Workload::Stream {
                size,
                qps,
                depth,
                batch,
                ..
            } => {
                if *qps == 0 || *qps > MAX_QPS {
                    return Err(err("qps", format!("must be 1 to {MAX_QPS}, got {qps}")));
                }
                if *depth == 0 || *depth > MAX_DEPTH {
                    return Err(err(
                        "depth",
                        format!("must be 1 to {MAX_DEPTH}, got {depth}"),
                    ));
                }
                if *batch == 0 || batch > depth {
                    return Err(err(
                        "batch",
                        format!("must be 1 to depth ({depth}), got {batch}"),
                    ));
                }
                let registered = size.saturating_mul(u64::from(*qps) * u64::from(*depth));
                if registered > MAX_REGISTERED_BYTES {
                    return Err(err(
                        "size",
                        format!(
                            "size x qps x depth = {registered} bytes, above the {MAX_REGISTERED_BYTES} a flow may register"
                        ),
                    ));
                }
                *size
            }
        };
        if size == 0 || size > MAX_MESSAGE_BYTES {
            return Err(err(
                "size",
                format!("must be 1 to {MAX_MESSAGE_BYTES} bytes, got {size}"),
            ));
        }
        Ok(())
    }

    /// Queue pairs across the wire (a latency flow has one).
    pub fn wire_qps(&self) -> u32 {
        match &self.workload {
            Workload::Latency { .. } => 1,
            Workload::Stream { qps, .. } => *qps,
        }
    }
}

/// Latency percentiles, us.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Samples.
    pub samples: u64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Largest.
    pub max_us: f64,
}

/// What a flow's requester measured inside its window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowOutcome {
    /// The flow.
    pub name: String,
    /// Messages completed inside the window.
    pub messages: u64,
    /// Payload bytes of those messages.
    pub bytes: u64,
    /// Length of the window as measured, s.
    pub window_s: f64,
    /// Latency samples (latency flows).
    pub latency: Option<Percentiles>,
    /// RPerf: the loopback SENDs' own post-to-completion times (T_L).
    pub loopback: Option<Percentiles>,
    /// RPerf: the over-the-wire SENDs' post-to-completion times (T_W).
    pub wire: Option<Percentiles>,
    /// RPerf: pairs whose loopback completed after the wire one (T_W - T_L < 0, counted
    /// as 0).
    pub negative_samples: u64,
    /// The clock that timed the samples (`tsc` at its fitted or given rate, or
    /// `monotonic`).
    pub clock: String,
    /// Samples in the window whose wait for a completion yielded the CPU (only with
    /// `--idle yield`): each may hold a scheduler's delay. Absent from older outcomes.
    #[serde(default)]
    pub yielded_samples: u64,
    /// The latency samples as a histogram, ns: `[value, count]` for every bucket that holds
    /// samples, in increasing order, each bucket named by the largest value it holds
    /// (HdrHistogram, 3 significant figures). Empty for flows without latency samples, and
    /// in older outcomes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub latency_histogram: Vec<[u64; 2]>,
    /// The path MTU the flow's queue pairs were connected with, bytes (`None`: not known,
    /// or an older outcome).
    #[serde(default)]
    pub path_mtu: Option<u32>,
    /// The device's clock for NIC completion time stamps, kHz, when it offers them;
    /// `None` when it offers none (Soft-RoCE) or cannot say.
    #[serde(default)]
    pub nic_clock_khz: Option<u64>,
    /// RPerf's T_W - T_L was taken from the NIC's completion time stamps (the two SENDs'
    /// completions, in `nic_clock_khz` ticks) and the host's clock between the two posts;
    /// false: from the host's clock alone (every other method, and a device offering none).
    #[serde(default)]
    pub nic_stamps_read: bool,
}

impl FlowOutcome {
    /// Messages per second in the window.
    pub fn msgs_per_sec(&self) -> f64 {
        if self.window_s > 0.0 {
            self.messages as f64 / self.window_s
        } else {
            0.0
        }
    }

    /// Payload in Gb/s in the window.
    pub fn gbps(&self) -> f64 {
        if self.window_s > 0.0 {
            self.bytes as f64 * 8.0 / self.window_s / 1e9
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(size: u64, qps: u32, depth: u32, batch: u32) -> FlowPlan {
        FlowPlan {
            name: "bw".into(),
            workload: Workload::Stream {
                size,
                qps,
                depth,
                batch,
                op: Op::Write,
                inline: false,
                polling: Polling::Busy,
            },
            start_ms: 0.0,
            stop_ms: 100.0,
            window_from_ms: 10.0,
            window_to_ms: 100.0,
        }
    }

    #[test]
    fn caps_name_the_field_and_the_flow() {
        assert_eq!(stream(1 << 20, 1, 8, 1).validate(), Ok(()));
        let e = stream(1 << 20, 1, 8, 9).validate().err();
        assert_eq!(e.as_ref().map(|e| e.field), Some("batch"));
        assert!(e.is_some_and(|e| e.to_string().starts_with("flow bw: batch:")));
        assert_eq!(
            stream(1 << 30, 4, 8, 1).validate().err().map(|e| e.field),
            Some("size")
        );
        assert_eq!(
            stream(16, 0, 8, 1).validate().err().map(|e| e.field),
            Some("qps")
        );
        let mut backwards = stream(16, 1, 1, 1);
        backwards.window_to_ms = 5.0;
        assert_eq!(backwards.validate().err().map(|e| e.field), Some("times"));
    }

    #[test]
    fn rates_come_from_the_window() {
        let o = FlowOutcome {
            name: "x".into(),
            messages: 1000,
            bytes: 1000 * 1_000_000,
            window_s: 0.5,
            latency: None,
            loopback: None,
            wire: None,
            negative_samples: 0,
            clock: "monotonic".into(),
            yielded_samples: 0,
            latency_histogram: Vec::new(),
            path_mtu: Some(1024),
            nic_clock_khz: None,
            nic_stamps_read: false,
        };
        assert_eq!(o.msgs_per_sec(), 2000.0);
        assert!((o.gbps() - 16.0).abs() < 1e-12);
    }

    #[test]
    fn an_outcome_without_yield_counts_reads_as_none_yielded() {
        let line = r#"{"name":"lat","messages":3,"bytes":48,"window_s":1.0,"latency":null,
            "loopback":null,"wire":null,"negative_samples":0,"clock":"monotonic"}"#;
        let o: FlowOutcome = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((o.messages, o.yielded_samples), (3, 0));
        assert!(o.latency_histogram.is_empty());
        assert_eq!(
            (o.path_mtu, o.nic_clock_khz, o.nic_stamps_read),
            (None, None, false)
        );
    }
}
