//! Model profiles: everything the simulator needs to know about one RNIC model and its
//! fabric.
//!
//! A model profile embeds the policy-facing [`RnicProfile`] of `justitia-core` (MaxRate,
//! MaxTput, MTU, chunk sizes: what the daemon would be configured with) and adds the
//! parameters of the simulated hardware, grouped by the model that reads them:
//!
//! | table | model | parameters |
//! | --- | --- | --- |
//! | `[policy]` | the daemon and shapers | see [`RnicProfile`] |
//! | `[link]` | [`crate::link`] | signalling rate, propagation, per-packet header bytes |
//! | `[pcie]` | [`crate::rnic`] | doorbell, DMA read/write latencies, payload read and write bandwidth |
//! | `[rnic]` | [`crate::rnic`] | processing units, message-rate caps, transmit FIFO, queue-pair context cache, inline limit, receive stage |
//! | `[host]` | [`crate::app`] | CPU cost of a post, poll detection, event wake-up, jitter |
//!
//! The profiles of the papers' hardware live in `profiles/*.toml` at the repository root,
//! each parameter with a comment naming the measurement it was fitted to; they are also
//! compiled in ([`ModelProfile::builtin`]) so that the library works from any directory.

use std::path::Path;

use justitia_core::profile::{builtin_profile_text, ProfileError, RnicFacts, RnicProfile};
use serde::{Deserialize, Serialize};

use crate::time::{self, ByteTime, Picos};

/// The simulated hardware of one RNIC model, plus the policy's view of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// What the policy is configured with (MaxRate, MaxTput, MTU, chunk sizes).
    pub policy: RnicProfile,
    /// The wire between two nodes.
    pub link: LinkParams,
    /// The PCIe path between host memory and the RNIC.
    pub pcie: PcieParams,
    /// The RNIC's internals.
    pub rnic: RnicParams,
    /// The host CPU's side of posting and polling.
    pub host: HostParams,
    /// The switch of switched topologies; profiles of back-to-back testbeds have none.
    #[serde(default)]
    pub switch: Option<SwitchParams>,
}

/// How a switch output port picks among the input buffers that hold a packet for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputArbitration {
    /// The packet that entered the switch first, among the heads of the input buffers.
    #[default]
    Fcfs,
    /// The next input port in turn that has a head packet for this output.
    RoundRobin,
}

/// How a switch output port shares itself among virtual lanes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VlArbitration {
    /// The highest-numbered virtual lane with a packet goes first.
    #[default]
    Strict,
    /// Weighted round robin in bytes, by `vl_weights`.
    Weighted,
}

/// Number of virtual lanes the model carries (service level `n` maps to lane `n`).
pub const VIRTUAL_LANES: usize = 4;

/// Priority flow control (IEEE 802.1Qbb), Ethernet's lossless mode: a switch input buffer
/// (port, lane) that fills to `xoff_bytes` pauses that lane of the sender upstream, and
/// resumes it once drained to `xon_bytes`. The pause travels back up the cable, and the
/// sender finishes the packet it is sending, so the buffer must hold `xoff_bytes` plus that
/// headroom (checked by [`ModelProfile::validate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PfcParams {
    /// Bytes held in an input buffer at or above which its lane is paused upstream.
    pub xoff_bytes: u32,
    /// Bytes held at or below which a paused lane is resumed.
    pub xon_bytes: u32,
}

/// Parameters of a switch: lossless by InfiniBand's credits, or by Ethernet's PFC when
/// `pfc` is given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchParams {
    /// One-way propagation of each cable (host to switch, switch to switch), in ns.
    pub cable_ns: f64,
    /// Cut-through forwarding latency from the head of a packet entering to it leaving,
    /// with an idle output, in ns.
    pub port_latency_ns: f64,
    /// Extra forwarding latency of each packet, uniform in [0, this], in ns; a packet never
    /// overtakes an earlier one of the same input buffer.
    #[serde(default)]
    pub jitter_ns: f64,
    /// Buffer of each input port, per virtual lane, in bytes on the wire: under credits,
    /// what its upstream sender starts with; under PFC, what it can hold.
    pub input_buffer_bytes: u32,
    /// Pause frames instead of credits (RoCE switches); none: credits (InfiniBand).
    #[serde(default)]
    pub pfc: Option<PfcParams>,
    /// Input arbitration at each output port.
    #[serde(default)]
    pub arbitration: InputArbitration,
    /// Arbitration among virtual lanes.
    #[serde(default)]
    pub vl_arbitration: VlArbitration,
    /// Weights of the virtual lanes under weighted arbitration (lane 0 first); lanes
    /// left out weigh 1.
    #[serde(default)]
    pub vl_weights: Vec<u32>,
}

/// Parameters of a link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkParams {
    /// Data rate on the wire in Gb/s, after line coding (FDR 4x: 54.5; 40GbE: 40).
    pub gbps: f64,
    /// One-way propagation from one host's port to the other's, in ns, including the
    /// forwarding latency of the single cut-through switch of the papers' testbeds.
    pub propagation_ns: f64,
    /// Bytes every packet adds on the wire: transport and network headers, CRCs, and for
    /// Ethernet the preamble and inter-frame gap.
    pub header_bytes: u32,
    /// Extra bytes on the first packet of a WRITE or READ request (the RETH).
    #[serde(default)]
    pub first_packet_extra_bytes: u32,
    /// Bytes of an acknowledgement on the wire.
    pub ack_bytes: u32,
}

/// Parameters of the PCIe path.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcieParams {
    /// Time from the CPU's doorbell write until the RNIC sees it, in ns.
    pub doorbell_ns: f64,
    /// Round trip of a DMA read (WQE fetch, first payload read), in ns.
    pub read_latency_ns: f64,
    /// Time for a DMA write (payload at the receiver, a CQE) to become visible, in ns.
    pub write_latency_ns: f64,
    /// Payload read bandwidth in Gb/s; 0 when PCIe never limits transmission.
    #[serde(default)]
    pub read_gbps: f64,
    /// Half-width of the uniform variation of each packet's payload read time, in ns
    /// (read completions do not return at a perfectly even pace).
    #[serde(default)]
    pub read_jitter_ns: f64,
    /// Bandwidth of the receiver's payload writes into host memory, in Gb/s of payload;
    /// 0 (the default) when PCIe never limits reception. Below the link's payload rate it
    /// needs `rnic.rx_buffer_bytes`, the buffer that fills while writes lag arrivals.
    #[serde(default)]
    pub write_gbps: f64,
    /// Largest payload of one PCIe transaction (TLP), in bytes: a payload read is split
    /// at every multiple of it in host memory, so one that does not start on such a
    /// boundary needs one TLP more. Modelled only with `read_tlp_ns`; 0 (the default): not
    /// modelled.
    #[serde(default)]
    pub max_payload_bytes: u32,
    /// Time the RNIC's PCIe read path spends per read TLP, in ns, on top of the payload's
    /// bytes at `read_gbps`: the request and completion headers and the read-request
    /// limit. 0 (the default): TLPs cost nothing of their own.
    #[serde(default)]
    pub read_tlp_ns: f64,
}

/// Parameters of the RNIC.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RnicParams {
    /// Processing units; queue pair `i` is served by unit `i mod processing_units`.
    pub processing_units: u32,
    /// Message-rate cap of one processing unit (so of one queue pair), in M msgs/s.
    pub qp_mops: f64,
    /// Message-rate cap of the whole RNIC (its packet scheduler), in M packets/s.
    pub nic_mops: f64,
    /// Time a processing unit needs to turn a fetched WQE into its first packet, in ns.
    pub wqe_process_ns: f64,
    /// Receive-side processing of a packet before it is acknowledged or written, in ns.
    pub rx_process_ns: f64,
    /// Capacity of the transmit FIFO behind the round-robin arbiter, in bytes on the wire.
    pub tx_fifo_bytes: u32,
    /// Payload fetched ahead in one burst for each queue pair streaming a message larger
    /// than this, in bytes, while more than one queue pair does: the transmit FIFO then
    /// holds `tx_fifo_bytes` plus one burst per streaming queue pair beyond the first.
    /// 0 (the default): the FIFO holds `tx_fifo_bytes` however many queue pairs stream.
    #[serde(default)]
    pub fetch_burst_bytes: u32,
    /// Queue-pair contexts the RNIC holds on chip, the least recently used evicted first.
    /// A processing unit that starts a message (a send, a READ request or a READ response)
    /// of a queue pair whose context is not held reads it over PCIe first: it starts one
    /// DMA read round trip (`pcie.read_latency_ns`) later, busy meanwhile. 0 (the
    /// default): every context is on chip, however many queue pairs there are.
    #[serde(default)]
    pub qp_cache_entries: u32,
    /// Largest payload that can be posted inline (copied into the WQE by the CPU).
    pub max_inline_bytes: u32,
    /// Packet-rate cap of the receive pipeline, in M packets/s; 0 (the default): no cap.
    #[serde(default)]
    pub rx_mops: f64,
    /// The receive buffer between the port and the receive pipeline, per virtual lane, in
    /// bytes on the wire: the link-level credits the sender on the link into this host
    /// starts with. 0 (the default): no receive stage is modelled, a packet is processed
    /// the moment it arrives. Needed when `pcie.write_gbps` or `rnic.rx_mops` is set.
    #[serde(default)]
    pub rx_buffer_bytes: u32,
    /// Memory-protection (MPT) entries the RNIC holds on chip, one per memory region, the
    /// least recently used evicted first. 0 (the default): every entry on chip.
    #[serde(default)]
    pub mpt_cache_entries: u32,
    /// Memory-translation (MTT) entries the RNIC holds on chip, one per registered page,
    /// the least recently used evicted first. 0 (the default): every entry on chip.
    #[serde(default)]
    pub mtt_cache_entries: u32,
    /// Time a processing unit waits for each MPT or MTT entry it does not hold, in ns
    /// (read from host memory one after another). Needed when either cache is bounded.
    #[serde(default)]
    pub translation_miss_ns: f64,
    /// Time the RNIC's doorbell engine spends on one doorbell, in ns; WQEs posted to a
    /// queue pair together (a post list) share one. 0 (the default), with `wqe_fetch_ns`
    /// 0: no engine is modelled.
    #[serde(default)]
    pub doorbell_process_ns: f64,
    /// Time the doorbell engine spends fetching one WQE that is not inline, in ns.
    #[serde(default)]
    pub wqe_fetch_ns: f64,
    /// Time the receive stage spends on a SEND that finds no receive posted (an RNR NAK),
    /// in ns, on top of the packet: every packet behind it waits. Needs a receive stage
    /// (`rx_buffer_bytes`). 0 (the default): the NAK costs the stage nothing.
    #[serde(default)]
    pub rnr_nak_ns: f64,
    /// How long a requester waits after an RNR NAK before it sends the message again
    /// (the responder's `min_rnr_timer`), in us. Needed by flows whose responder posts no
    /// receives.
    #[serde(default)]
    pub rnr_timer_us: f64,
    /// Time the RNIC's control path takes to register a memory region, in us (firmware
    /// commands run one at a time).
    #[serde(default)]
    pub reg_mr_us: f64,
    /// Time the RNIC's control path takes to create a queue pair (and bring it to RTS),
    /// in us.
    #[serde(default)]
    pub create_qp_us: f64,
}

/// Parameters of the host CPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostParams {
    /// CPU time to build and post one work request, in ns.
    pub post_ns: f64,
    /// Mean delay from a completion becoming visible to a busy-polling thread acting on it,
    /// in ns; the delay is uniform in [0, 2 x this] (where in its loop the thread is).
    pub poll_ns: f64,
    /// Delay from a completion to an event-driven thread acting on it (interrupt,
    /// wake-up, re-arm, poll), in us.
    pub wakeup_us: f64,
    /// Mean of an exponentially distributed extra delay on every doorbell, in ns: the
    /// spread of PCIe and cache latencies that makes even an idle RNIC's tail differ
    /// from its median.
    pub jitter_ns: f64,
}

/// Why a model profile was refused.
#[derive(Debug, thiserror::Error)]
pub enum ModelProfileError {
    /// The file could not be read.
    #[error("reading RNIC model profile {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The cause, said in the message (not also returned as `source()`).
        cause: std::io::Error,
    },
    /// The TOML did not parse, or had unknown or mistyped fields.
    #[error("RNIC model profile {origin}: {message}")]
    Parse {
        /// Where the text came from.
        origin: String,
        /// The parser's message, naming the field.
        message: String,
    },
    /// The `[policy]` table is invalid.
    #[error("RNIC model profile {origin}: [policy] {cause}")]
    Policy {
        /// Where the text came from.
        origin: String,
        /// The core's validation error, said in the message (not also returned as
        /// `source()`).
        cause: ProfileError,
    },
    /// A hardware parameter is out of range.
    #[error("RNIC model profile {origin}: field `{field}` {reason}")]
    Invalid {
        /// Where the text came from.
        origin: String,
        /// The offending field, as `table.key`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No built-in profile has that name.
    #[error("no RNIC model profile named `{0}` (built in: {known})", known = ModelProfile::BUILTIN_NAMES.join(", "))]
    UnknownBuiltin(String),
}

impl ModelProfile {
    /// Names of the built-in model profiles (the files in `profiles/`).
    pub const BUILTIN_NAMES: [&'static str; 8] = RnicProfile::BUILTIN_NAMES;

    /// A built-in profile by name, case-insensitive (`ib-56`, `RoCE-100`, ...).
    pub fn builtin(name: &str) -> Result<Self, ModelProfileError> {
        let (canonical, text) = builtin_profile_text(name)
            .ok_or_else(|| ModelProfileError::UnknownBuiltin(name.to_string()))?;
        Self::from_toml(text, &format!("built-in {canonical}"))
    }

    /// Parses and validates a profile; `origin` names the source in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ModelProfileError> {
        let profile: ModelProfile = toml::from_str(text).map_err(|e| ModelProfileError::Parse {
            origin: origin.to_string(),
            message: e.to_string().trim().to_string(),
        })?;
        profile.validate(origin)?;
        Ok(profile)
    }

    /// Reads and validates a profile file.
    pub fn from_file(path: &Path) -> Result<Self, ModelProfileError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ModelProfileError::Io {
            path: path.display().to_string(),
            cause,
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Checks every parameter's range. `rnic.qp_cache_entries` takes any value: 0 models
    /// no cache, and a cache of any size works with every other parameter (a miss costs
    /// `pcie.read_latency_ns`, which may be 0; a PFC profile's headroom counts the transmit
    /// FIFO, which the cache does not change).
    pub fn validate(&self, origin: &str) -> Result<(), ModelProfileError> {
        self.policy
            .validate()
            .map_err(|cause| ModelProfileError::Policy {
                origin: origin.to_string(),
                cause,
            })?;
        let invalid = |field: &'static str, reason: String| ModelProfileError::Invalid {
            origin: origin.to_string(),
            field,
            reason,
        };
        let positive = |field: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!("must be a positive number, got {v}"),
                ))
            }
        };
        let non_negative = |field: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(invalid(field, format!("must be zero or positive, got {v}")))
            }
        };
        positive("link.gbps", self.link.gbps)?;
        non_negative("link.propagation_ns", self.link.propagation_ns)?;
        if self.link.ack_bytes == 0 {
            return Err(invalid("link.ack_bytes", "must be positive".into()));
        }
        non_negative("pcie.doorbell_ns", self.pcie.doorbell_ns)?;
        non_negative("pcie.read_latency_ns", self.pcie.read_latency_ns)?;
        non_negative("pcie.write_latency_ns", self.pcie.write_latency_ns)?;
        non_negative("pcie.read_gbps", self.pcie.read_gbps)?;
        non_negative("pcie.read_jitter_ns", self.pcie.read_jitter_ns)?;
        non_negative("pcie.write_gbps", self.pcie.write_gbps)?;
        non_negative("rnic.rx_mops", self.rnic.rx_mops)?;
        let largest_packet =
            self.mtu() + self.link.header_bytes + self.link.first_packet_extra_bytes;
        if self.rnic.rx_buffer_bytes == 0 && (self.pcie.write_gbps > 0.0 || self.rnic.rx_mops > 0.0)
        {
            return Err(invalid(
                "rnic.rx_buffer_bytes",
                format!(
                    "must be set (at least one packet, {largest_packet} bytes) when \
                     pcie.write_gbps or rnic.rx_mops limits the receive side: the sender \
                     is held back by the credits of that buffer"
                ),
            ));
        }
        if self.rnic.rx_buffer_bytes > 0 && self.rnic.rx_buffer_bytes < largest_packet {
            return Err(invalid(
                "rnic.rx_buffer_bytes",
                format!(
                    "must be 0 or hold the largest packet ({largest_packet} bytes), got {}",
                    self.rnic.rx_buffer_bytes
                ),
            ));
        }
        non_negative("pcie.read_tlp_ns", self.pcie.read_tlp_ns)?;
        if self.pcie.read_tlp_ns > 0.0 {
            let mps = self.pcie.max_payload_bytes;
            if !(mps.is_power_of_two() && self.mtu().is_multiple_of(mps)) {
                return Err(invalid(
                    "pcie.max_payload_bytes",
                    format!(
                        "must be a power of two dividing the MTU ({}) when pcie.read_tlp_ns \
                         is set, got {mps}",
                        self.mtu()
                    ),
                ));
            }
        }
        non_negative("rnic.translation_miss_ns", self.rnic.translation_miss_ns)?;
        if (self.rnic.mpt_cache_entries > 0 || self.rnic.mtt_cache_entries > 0)
            && self.rnic.translation_miss_ns <= 0.0
        {
            return Err(invalid(
                "rnic.translation_miss_ns",
                "must be positive when rnic.mpt_cache_entries or rnic.mtt_cache_entries \
                 bounds a translation cache: a miss costs it"
                    .into(),
            ));
        }
        non_negative("rnic.doorbell_process_ns", self.rnic.doorbell_process_ns)?;
        non_negative("rnic.wqe_fetch_ns", self.rnic.wqe_fetch_ns)?;
        non_negative("rnic.rnr_nak_ns", self.rnic.rnr_nak_ns)?;
        non_negative("rnic.rnr_timer_us", self.rnic.rnr_timer_us)?;
        if self.rnic.rnr_nak_ns > 0.0 && self.rnic.rx_buffer_bytes == 0 {
            return Err(invalid(
                "rnic.rnr_nak_ns",
                "needs a receive stage (rnic.rx_buffer_bytes): an RNR NAK occupies it".into(),
            ));
        }
        non_negative("rnic.reg_mr_us", self.rnic.reg_mr_us)?;
        non_negative("rnic.create_qp_us", self.rnic.create_qp_us)?;
        if self.rnic.processing_units == 0 {
            return Err(invalid(
                "rnic.processing_units",
                "must be at least 1".into(),
            ));
        }
        positive("rnic.qp_mops", self.rnic.qp_mops)?;
        positive("rnic.nic_mops", self.rnic.nic_mops)?;
        non_negative("rnic.wqe_process_ns", self.rnic.wqe_process_ns)?;
        non_negative("rnic.rx_process_ns", self.rnic.rx_process_ns)?;
        if self.rnic.tx_fifo_bytes == 0 {
            return Err(invalid("rnic.tx_fifo_bytes", "must be positive".into()));
        }
        if self.rnic.fetch_burst_bytes > 0 && self.rnic.fetch_burst_bytes < self.mtu() {
            return Err(invalid(
                "rnic.fetch_burst_bytes",
                format!(
                    "must be 0 or at least the MTU ({}), got {}",
                    self.mtu(),
                    self.rnic.fetch_burst_bytes
                ),
            ));
        }
        non_negative("host.post_ns", self.host.post_ns)?;
        non_negative("host.poll_ns", self.host.poll_ns)?;
        non_negative("host.wakeup_us", self.host.wakeup_us)?;
        non_negative("host.jitter_ns", self.host.jitter_ns)?;
        if let Some(sw) = &self.switch {
            non_negative("switch.cable_ns", sw.cable_ns)?;
            non_negative("switch.port_latency_ns", sw.port_latency_ns)?;
            non_negative("switch.jitter_ns", sw.jitter_ns)?;
            if sw.input_buffer_bytes < self.mtu() + self.link.header_bytes * 2 {
                return Err(invalid(
                    "switch.input_buffer_bytes",
                    format!(
                        "must hold at least one MTU packet ({} bytes), got {}",
                        self.mtu() + self.link.header_bytes * 2,
                        sw.input_buffer_bytes
                    ),
                ));
            }
            if let Some(pfc) = &sw.pfc {
                if self.rnic.fetch_burst_bytes > 0 {
                    // A pause stops the arbiter, not the FIFO; a FIFO that grows with the
                    // streaming queue pairs would need a headroom no buffer could bound.
                    return Err(invalid(
                        "rnic.fetch_burst_bytes",
                        "must be 0 on a profile with [switch.pfc]: the headroom counts a \
                         transmit FIFO of tx_fifo_bytes"
                            .into(),
                    ));
                }
                let headroom = self.pfc_headroom_bytes(sw);
                if pfc.xon_bytes >= pfc.xoff_bytes {
                    return Err(invalid(
                        "switch.pfc.xon_bytes",
                        format!(
                            "must be below xoff_bytes ({}), got {}",
                            pfc.xoff_bytes, pfc.xon_bytes
                        ),
                    ));
                }
                if u64::from(pfc.xoff_bytes) + u64::from(headroom)
                    > u64::from(sw.input_buffer_bytes)
                {
                    return Err(invalid(
                        "switch.pfc.xoff_bytes",
                        format!(
                            "plus the headroom of {headroom} bytes (two packets, an RNIC's \
                             transmit FIFO, and the cable's round trip and the forwarding \
                             latency at the link rate) must fit input_buffer_bytes ({}), got {}",
                            sw.input_buffer_bytes, pfc.xoff_bytes
                        ),
                    ));
                }
            }
            if sw.vl_weights.len() > VIRTUAL_LANES || sw.vl_weights.contains(&0) {
                return Err(invalid(
                    "switch.vl_weights",
                    format!("at most {VIRTUAL_LANES} weights, each at least 1"),
                ));
            }
        }
        Ok(())
    }

    /// What a PFC input buffer may still take once it reaches XOFF, in wire bytes: the
    /// packet being received when it does; the bytes on the cable while the pause travels
    /// up it and the last of them come down; the packet the sender had started, and an
    /// RNIC sender's transmit FIFO (the pause stops its arbiter, not what it queued); and
    /// the bytes that arrive while a packet is forwarded (a packet counts from when it is
    /// eligible, [`SwitchParams::port_latency_ns`] plus at most the jitter after its head
    /// arrived).
    pub fn pfc_headroom_bytes(&self, sw: &SwitchParams) -> u32 {
        let packet = self.mtu() + self.link.header_bytes;
        let ns = 2.0 * sw.cable_ns + sw.port_latency_ns + sw.jitter_ns;
        let in_flight = (ns * self.link.gbps / 8.0)
            .ceil()
            .min(f64::from(u32::MAX / 4)) as u32;
        (2 * packet)
            .saturating_add(self.rnic.tx_fifo_bytes)
            .saturating_add(in_flight)
    }

    /// What its model tables tell the `adaptive` law, as a daemon reads them from the
    /// same file ([`RnicFacts::builtin`]).
    pub fn facts(&self) -> RnicFacts {
        RnicFacts {
            wire_gbps: self.link.gbps,
            header_bytes: self.link.header_bytes,
            first_packet_extra_bytes: self.link.first_packet_extra_bytes,
            ack_bytes: self.link.ack_bytes,
            pcie_read_latency_ns: self.pcie.read_latency_ns,
            processing_units: self.rnic.processing_units,
            qp_mops: self.rnic.qp_mops,
            qp_cache_entries: self.rnic.qp_cache_entries,
            mpt_cache_entries: self.rnic.mpt_cache_entries,
            mtt_cache_entries: self.rnic.mtt_cache_entries,
            translation_miss_ns: self.rnic.translation_miss_ns,
        }
    }

    /// The profile's name (that of its `[policy]` table).
    pub fn name(&self) -> &str {
        &self.policy.name
    }

    /// Path MTU in bytes.
    pub fn mtu(&self) -> u32 {
        self.policy.mtu
    }

    /// The wire's byte time.
    pub fn wire_byte_time(&self) -> ByteTime {
        ByteTime::from_gbps(self.link.gbps)
    }

    /// The payload DMA's byte time (zero when PCIe never limits).
    pub fn dma_byte_time(&self) -> ByteTime {
        ByteTime::from_gbps(self.pcie.read_gbps)
    }

    /// The receiver's payload write byte time (zero when PCIe never limits reception).
    pub fn rx_write_byte_time(&self) -> ByteTime {
        ByteTime::from_gbps(self.pcie.write_gbps)
    }

    /// Bytes a data packet with `payload` bytes occupies on the wire.
    pub fn wire_bytes(&self, payload: u32, first_of_request: bool) -> u32 {
        let extra = if first_of_request {
            self.link.first_packet_extra_bytes
        } else {
            0
        };
        payload + self.link.header_bytes + extra
    }

    /// The highest payload rate one flow of `message_bytes`-byte WRITEs can reach on the
    /// wire alone, in Gb/s: the lower of the wire after headers and the payload DMA.
    pub fn payload_gbps_limit(&self, message_bytes: u64) -> f64 {
        let mtu = u64::from(self.mtu());
        let packets = message_bytes.div_ceil(mtu).max(1);
        let wire = message_bytes
            + packets * u64::from(self.link.header_bytes)
            + u64::from(self.link.first_packet_extra_bytes);
        let wire_limit = self.link.gbps * message_bytes as f64 / wire as f64;
        if self.pcie.read_gbps > 0.0 {
            wire_limit.min(self.pcie.read_gbps)
        } else {
            wire_limit
        }
    }

    /// The host's event wake-up delay.
    pub fn wakeup(&self) -> Picos {
        time::from_us(self.host.wakeup_us)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A daemon reads the law's figures from the profile file itself; they are the
    /// model's, for every built-in.
    #[test]
    fn a_daemon_reads_the_facts_the_model_is_built_from() {
        for name in ModelProfile::BUILTIN_NAMES {
            let model = ModelProfile::builtin(name).unwrap();
            assert_eq!(RnicFacts::builtin(name), Some(model.facts()), "{name}");
        }
    }

    #[test]
    fn every_builtin_parses_and_validates() {
        for name in ModelProfile::BUILTIN_NAMES {
            let p = ModelProfile::builtin(name).unwrap();
            assert_eq!(p.name(), name);
        }
        assert!(ModelProfile::builtin("roce-100").is_ok());
        assert!(matches!(
            ModelProfile::builtin("cx9"),
            Err(ModelProfileError::UnknownBuiltin(_))
        ));
    }

    #[test]
    fn bad_fields_are_named() {
        let text = include_str!("../../../profiles/ib-56.toml");
        let bad = text.replace("tx_fifo_bytes", "tx_fifo_byte");
        let err = ModelProfile::from_toml(&bad, "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tx_fifo_byte"), "{err}");
        let bad = text.replace("qp_mops = ", "qp_mops = -");
        let err = ModelProfile::from_toml(&bad, "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("rnic.qp_mops"), "{err}");
        let bad = text.replace("mtu = 4096", "mtu = 1500");
        let err = ModelProfile::from_toml(&bad, "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("mtu"), "{err}");
    }

    #[test]
    fn a_limited_receive_stage_needs_a_buffer_that_holds_a_packet() {
        let text = include_str!("../../../profiles/roce-100-switch-gen3x8.toml");
        let p = ModelProfile::from_toml(text, "test").unwrap();
        assert!(p.pcie.write_gbps > 0.0 && p.rnic.rx_buffer_bytes > 0);
        let refusal = |from: &str, to: &str| {
            ModelProfile::from_toml(&text.replace(from, to), "test")
                .unwrap_err()
                .to_string()
        };
        let err = refusal("rx_buffer_bytes = 262144", "rx_buffer_bytes = 0");
        assert!(
            err.contains("rnic.rx_buffer_bytes") && err.contains("at least one packet, 4194"),
            "{err}"
        );
        // The largest packet: a 4 KB payload, 82 header bytes and a RETH of 16.
        let err = refusal("rx_buffer_bytes = 262144", "rx_buffer_bytes = 4193");
        assert!(
            err.contains("largest packet (4194 bytes), got 4193"),
            "{err}"
        );
        let err = refusal("write_gbps = 56", "write_gbps = -56");
        assert!(err.contains("pcie.write_gbps"), "{err}");
        // Profiles without a receive stage are unchanged by it.
        let plain = ModelProfile::builtin("RoCE-100").unwrap();
        assert_eq!(
            (
                plain.pcie.write_gbps,
                plain.rnic.rx_mops,
                plain.rnic.rx_buffer_bytes
            ),
            (0.0, 0.0, 0)
        );
    }

    #[test]
    fn pfc_thresholds_that_could_lose_a_packet_are_refused() {
        let text = include_str!("../../../profiles/roce-100-switch.toml");
        let p = ModelProfile::from_toml(text, "test").unwrap();
        let sw = p.switch.as_ref().unwrap();
        // Two 4178-byte packets, the 24000-byte transmit FIFO, and 350 ns of cables and
        // forwarding at 100 Gb/s (4375 bytes).
        assert_eq!(p.pfc_headroom_bytes(sw), 2 * 4178 + 24_000 + 4375);
        let refusal = |from: &str, to: &str| {
            ModelProfile::from_toml(&text.replace(from, to), "test")
                .unwrap_err()
                .to_string()
        };
        let err = refusal("xon_bytes = 32768", "xon_bytes = 65536");
        assert!(
            err.contains("switch.pfc.xon_bytes") && err.contains("below"),
            "{err}"
        );
        let err = refusal("xoff_bytes = 65536", "xoff_bytes = 100000");
        assert!(
            err.contains("switch.pfc.xoff_bytes") && err.contains("headroom of 36731"),
            "{err}"
        );
    }

    #[test]
    fn fetch_bursts_below_a_packet_or_beside_pfc_are_refused() {
        let refusal = |text: &str, from: &str, to: &str| {
            let line = |v: &str| format!("fetch_burst_bytes = {v} ");
            ModelProfile::from_toml(&text.replace(&line(from), &line(to)), "test")
                .unwrap_err()
                .to_string()
        };
        let ib = include_str!("../../../profiles/ib-56.toml");
        let err = refusal(ib, "32768", "1000");
        assert!(
            err.contains("rnic.fetch_burst_bytes") && err.contains("MTU (4096), got 1000"),
            "{err}"
        );
        let roce = include_str!("../../../profiles/roce-100-switch.toml");
        let err = refusal(roce, "0", "65536");
        assert!(
            err.contains("rnic.fetch_burst_bytes") && err.contains("[switch.pfc]"),
            "{err}"
        );
    }

    #[test]
    fn the_qp_context_cache_defaults_to_unbounded_and_takes_any_size() {
        for name in ModelProfile::BUILTIN_NAMES {
            let p = ModelProfile::builtin(name).unwrap();
            assert_eq!(p.rnic.qp_cache_entries, 0, "{name}: not modelled");
        }
        let text = include_str!("../../../profiles/roce-100.toml");
        let line = "qp_cache_entries = 0 ";
        assert!(text.contains(line), "the profile says why it is 0");
        let without = ModelProfile::from_toml(&text.replace(line, "# "), "test").unwrap();
        assert_eq!(without.rnic.qp_cache_entries, 0, "serde default");
        for n in ["1", "256", "4294967295"] {
            let with = text.replace(line, &format!("qp_cache_entries = {n} "));
            let p = ModelProfile::from_toml(&with, "test").unwrap();
            assert_eq!(p.rnic.qp_cache_entries.to_string(), n);
        }
        let err = ModelProfile::from_toml(&text.replace(line, "qp_cache_entries = -1 "), "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("qp_cache_entries"), "{err}");
    }

    #[test]
    fn a_missing_file_says_its_cause_once() {
        let e = ModelProfile::from_file(Path::new("/nonexistent/rnic.toml")).unwrap_err();
        let said = e.to_string();
        assert!(
            said.starts_with("reading RNIC model profile /nonexistent/rnic.toml: "),
            "{said}"
        );
        assert!(std::error::Error::source(&e).is_none());
    }

    #[test]
    fn ib56_bandwidth_ceiling_is_the_papers_application_level_rate() {
        // Justitia §2: about 48 Gb/s application level on the 56 Gb/s ConnectX-3 Pro.
        let p = ModelProfile::builtin("IB-56").unwrap();
        let limit = p.payload_gbps_limit(1 << 20);
        assert!((limit - 48.0).abs() < 1.5, "{limit}");
    }
}
