//! Scenarios: one experiment per TOML file.
//!
//! ```toml
//! description = "16 B latency flow against one 1 MB bandwidth flow on IB-56"
//! profile = "IB-56"            # built-in name, or a path to a profile file
//! duration_ms = 20
//! warmup_ms = 2
//! seed = 1
//!
//! [[flows]]
//! name = "lat"                 # from the first host to the second unless `from`/`to` say
//! [flows.latency]
//! size = 16
//!
//! [[flows]]
//! name = "bw"
//! [flows.bandwidth]
//! size = "1MB"
//! depth = 16
//!
//! [[variants]]                 # runs side by side; without variants, one run per policy
//! name = "alone"
//! flows = ["lat"]
//! [[variants]]
//! name = "with bw"
//! [[variants]]
//! name = "with bw + justitia"
//! policy = "justitia"
//! ```
//!
//! Each flow has exactly one application table (`latency`, `throughput`, `bandwidth`,
//! `rpc` or `storage`; see [`crate::app`]). Unknown fields are errors, and every
//! validation error names the field (`flows[1] (bw): bandwidth.depth ...`).
//!
//! The profile is looked up as: a path (anything ending in `.toml`) relative to the
//! scenario file; else `profiles/<name>.toml` beside the scenario's folder; else the
//! built-in profile of that name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use justitia_core::flow::{FlowClass, Weight};
use serde::{Deserialize, Serialize};

use crate::app::bandwidth::{BandwidthApp, BandwidthParams};
use crate::app::control::{ControlApp, ControlParams};
use crate::app::latency::{LatencyApp, LatencyMode, LatencyParams};
use crate::app::rpc::{RpcApp, RpcParams};
use crate::app::storage::{StorageApp, StorageParams};
use crate::app::throughput::{ThroughputApp, ThroughputParams};
use crate::app::{AppModel, Connection};
use crate::model_profile::{
    InputArbitration, ModelProfile, ModelProfileError, SwitchParams, VlArbitration, VIRTUAL_LANES,
};
use crate::policy::justitia::JustitiaParams;
use crate::policy::preempt::PreemptParams;
use crate::policy::PolicySpec;
use crate::rnic::{ControlVerb, Opcode, DEFAULT_PAGE_BYTES};
use crate::units::ByteSize;

/// A scenario file's contents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// One line: what the experiment shows.
    pub description: String,
    /// The RNIC model profile (built-in name or file).
    pub profile: String,
    /// Hosts and how they are joined.
    #[serde(default)]
    pub topology: TopologySpec,
    /// Simulated time of each run, in ms.
    pub duration_ms: f64,
    /// Time at the start of each run that is not measured, in ms.
    #[serde(default)]
    pub warmup_ms: f64,
    /// Seed of all randomness.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Interval of the time series, ms; by default a thousandth of the run (at least
    /// 0.05 ms). See [`crate::series`].
    #[serde(default)]
    pub series_ms: Option<f64>,
    /// Policies to run side by side, each with every flow, when there are no variants.
    #[serde(default)]
    pub policies: Vec<PolicySpec>,
    /// Parameters of the `justitia` policy for every run that uses it.
    #[serde(default)]
    pub justitia: JustitiaParams,
    /// Parameters of the `preempt` policy, and the yield baseline of `adaptive`.
    #[serde(default)]
    pub preempt: PreemptParams,
    /// The flows.
    pub flows: Vec<FlowSpec>,
    /// Runs to compare (e.g. alone / with competitor / with policy).
    #[serde(default)]
    pub variants: Vec<VariantSpec>,
}

fn default_seed() -> u64 {
    1
}

fn one() -> u32 {
    1
}

/// The topology of a scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    /// How the hosts are joined.
    #[serde(default)]
    pub kind: TopologyKind,
    /// Host names; flows refer to them.
    #[serde(default = "default_hosts")]
    pub hosts: Vec<String>,
    /// With `kind = "two-switches"`: the hosts cabled to the second (downstream) switch;
    /// the others are on the first.
    #[serde(default)]
    pub downstream: Vec<String>,
    /// Changes to the profile's `[switch]` table for this scenario.
    #[serde(default)]
    pub switch: SwitchOverrides,
}

impl Default for TopologySpec {
    fn default() -> Self {
        TopologySpec {
            kind: TopologyKind::default(),
            hosts: default_hosts(),
            downstream: Vec::new(),
            switch: SwitchOverrides::default(),
        }
    }
}

/// A scenario's changes to the switch of its profile (e.g. RPerf's simulated switch: 32 KB
/// input buffers, no jitter, FCFS or round robin).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchOverrides {
    /// Input arbitration.
    #[serde(default)]
    pub arbitration: Option<InputArbitration>,
    /// Buffer of each input port per virtual lane, bytes.
    #[serde(default)]
    pub input_buffer_bytes: Option<ByteSize>,
    /// Forwarding latency, ns.
    #[serde(default)]
    pub port_latency_ns: Option<f64>,
    /// Per-packet forwarding jitter, ns.
    #[serde(default)]
    pub jitter_ns: Option<f64>,
    /// Arbitration among virtual lanes.
    #[serde(default)]
    pub vl_arbitration: Option<VlArbitration>,
    /// Weights of the virtual lanes.
    #[serde(default)]
    pub vl_weights: Option<Vec<u32>>,
}

impl SwitchOverrides {
    fn is_empty(&self) -> bool {
        *self == SwitchOverrides::default()
    }

    /// `params` with these changes.
    pub fn apply(&self, params: &SwitchParams) -> SwitchParams {
        let mut p = params.clone();
        if let Some(a) = self.arbitration {
            p.arbitration = a;
        }
        if let Some(b) = self.input_buffer_bytes {
            p.input_buffer_bytes = b.bytes().min(u64::from(u32::MAX)) as u32;
        }
        if let Some(l) = self.port_latency_ns {
            p.port_latency_ns = l;
        }
        if let Some(j) = self.jitter_ns {
            p.jitter_ns = j;
        }
        if let Some(v) = self.vl_arbitration {
            p.vl_arbitration = v;
        }
        if let Some(w) = &self.vl_weights {
            p.vl_weights = w.clone();
        }
        p
    }
}

fn default_hosts() -> Vec<String> {
    vec!["a".to_string(), "b".to_string()]
}

/// Kinds of topology.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TopologyKind {
    /// Two hosts on one cable (the papers' one-switch testbeds, with the switch's
    /// forwarding latency folded into the link's propagation).
    #[default]
    BackToBack,
    /// Every host cabled to one switch (needs a profile with a `[switch]` table).
    Switch,
    /// Two switches joined by one inter-switch link; `downstream` names the hosts of the
    /// second one.
    TwoSwitches,
}

/// One run of a scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariantSpec {
    /// Its name in reports and plots (e.g. `alone`, `with bw`, `with bw + justitia`).
    pub name: String,
    /// Names of the flows that run; all of them when absent.
    #[serde(default)]
    pub flows: Option<Vec<String>>,
    /// The policy on every host.
    #[serde(default)]
    pub policy: PolicySpec,
    /// Parameters of the `justitia` policy for this run, replacing the scenario's.
    #[serde(default)]
    pub justitia: Option<JustitiaParams>,
    /// Parameters of the `preempt` policy for this run, replacing the scenario's.
    #[serde(default)]
    pub preempt: Option<PreemptParams>,
}

/// A flow: an application between two hosts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    /// Its name in variants and reports.
    pub name: String,
    /// The host that posts the requests; the first host when absent.
    #[serde(default)]
    pub from: Option<String>,
    /// The other end; the second host when absent.
    #[serde(default)]
    pub to: Option<String>,
    /// The class the policy is told; by default that of the application model.
    #[serde(default)]
    pub class: Option<FlowClass>,
    /// The tenant (flows of one tenant share one share); by default one per flow.
    #[serde(default)]
    pub tenant: Option<u64>,
    /// The tenant's weight.
    #[serde(default)]
    pub weight: Option<Weight>,
    /// Run this many identical flows, named `name#1`, `name#2`, ..., each its own tenant
    /// unless `tenant` is given.
    #[serde(default = "one")]
    pub copies: u32,
    /// When the flow starts, in ms.
    #[serde(default)]
    pub start_ms: f64,
    /// When it stops posting, in ms; it runs to the end when absent.
    #[serde(default)]
    pub stop_ms: Option<f64>,
    /// Spans `[from, to]` in ms during which the application posts nothing new, then
    /// resumes (bandwidth and throughput flows). Unlike `stop_ms` the flow stays
    /// registered with the policy: it is idle, not gone, and the policy sees that only
    /// from its lack of work.
    #[serde(default)]
    pub pauses_ms: Vec<[f64; 2]>,
    /// Service level of its queue pairs (0-3), which a switch maps to the virtual lane of
    /// the same number.
    #[serde(default)]
    pub sl: u8,
    /// A latency flow.
    #[serde(default)]
    pub latency: Option<LatencyParams>,
    /// A throughput flow.
    #[serde(default)]
    pub throughput: Option<ThroughputParams>,
    /// A bandwidth flow.
    #[serde(default)]
    pub bandwidth: Option<BandwidthParams>,
    /// An RPC service.
    #[serde(default)]
    pub rpc: Option<RpcParams>,
    /// A storage service.
    #[serde(default)]
    pub storage: Option<StorageParams>,
    /// A control-verb storm.
    #[serde(default)]
    pub control: Option<ControlParams>,
    /// The memory its requests read their payload from; by default one region per queue
    /// pair, as large as a message.
    #[serde(default)]
    pub memory: Option<MemorySpec>,
    /// Whether the responder posts receives; `false` (SEND flows only): it posts none, so
    /// every SEND meets an RNR NAK and is sent again after the RNR timer, for ever.
    #[serde(default = "yes")]
    pub post_receives: bool,
}

fn yes() -> bool {
    true
}

/// The memory regions a flow's requests read their payload from (see
/// `rnic::memory`): message `k` of a queue pair uses region `k mod mrs`, walking through
/// it a message (in whole pages) at a time from `offset`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySpec {
    /// Regions the flow registers (shared by its queue pairs).
    #[serde(default = "one")]
    pub mrs: u32,
    /// Each region's size; by default one message.
    #[serde(default)]
    pub mr_size: Option<ByteSize>,
    /// The registration's page size (4 KB; 2 MB for huge pages).
    #[serde(default = "base_page")]
    pub page: ByteSize,
    /// Where the first message starts in its region: not a multiple of the PCIe max
    /// payload size, every payload read needs one TLP more.
    #[serde(default)]
    pub offset: ByteSize,
}

fn base_page() -> ByteSize {
    ByteSize(DEFAULT_PAGE_BYTES)
}

/// The most memory regions one flow may register: a typo such as `mrs = 1e9` is refused
/// rather than run (ConnectX RNICs support some millions).
pub const MAX_MRS_PER_FLOW: u32 = 1 << 20;

/// The application model of a flow, borrowed from its spec.
#[derive(Clone, Copy, Debug)]
pub enum AppSpec<'a> {
    /// See [`crate::app::latency`].
    Latency(&'a LatencyParams),
    /// See [`crate::app::throughput`].
    Throughput(&'a ThroughputParams),
    /// See [`crate::app::bandwidth`].
    Bandwidth(&'a BandwidthParams),
    /// See [`crate::app::rpc`].
    Rpc(&'a RpcParams),
    /// See [`crate::app::storage`].
    Storage(&'a StorageParams),
    /// See [`crate::app::control`].
    Control(&'a ControlParams),
}

impl AppSpec<'_> {
    /// The model's name (the table's key).
    pub fn kind(&self) -> &'static str {
        match self {
            AppSpec::Latency(_) => "latency",
            AppSpec::Throughput(_) => "throughput",
            AppSpec::Bandwidth(_) => "bandwidth",
            AppSpec::Rpc(_) => "rpc",
            AppSpec::Storage(_) => "storage",
            AppSpec::Control(_) => "control",
        }
    }

    /// The class a flow of this model has unless the scenario says otherwise.
    pub fn default_class(&self) -> FlowClass {
        match self {
            AppSpec::Latency(_) => FlowClass::Latency,
            AppSpec::Throughput(_) | AppSpec::Rpc(_) | AppSpec::Control(_) => FlowClass::Throughput,
            AppSpec::Bandwidth(_) | AppSpec::Storage(_) => FlowClass::Bandwidth,
        }
    }

    /// Connections (queue pairs per side) the application opens.
    pub fn connections(&self) -> u32 {
        match self {
            AppSpec::Latency(_) => 1,
            AppSpec::Throughput(p) => p.qps,
            AppSpec::Bandwidth(p) => p.qps,
            AppSpec::Rpc(p) => p.threads,
            AppSpec::Storage(p) => p.backends,
            AppSpec::Control(_) => 0,
        }
    }

    /// Whether the responder side posts too (ping-pong replies, RPC responses).
    pub fn server_posts(&self) -> bool {
        match self {
            AppSpec::Latency(p) => p.mode == LatencyMode::PingPong,
            AppSpec::Rpc(_) => true,
            _ => false,
        }
    }

    /// Whether its requests are READs: their data leaves the peer's RNIC, so the peer
    /// serves them (Justitia §4.4).
    pub fn reads(&self) -> bool {
        match self {
            AppSpec::Bandwidth(p) => p.opcode == Opcode::Read,
            AppSpec::Throughput(p) => p.opcode == Opcode::Read,
            _ => false,
        }
    }

    /// Builds the model over its connections ([`Self::connections`] of them, the first
    /// for a latency flow). Adding a model is a module, a table in [`FlowSpec`], a variant
    /// here and its arms in this impl.
    pub(crate) fn build(&self, conns: Vec<Connection>) -> Box<dyn AppModel> {
        match *self {
            AppSpec::Latency(p) => Box::new(LatencyApp::new(p, conns[0])),
            AppSpec::Throughput(p) => Box::new(ThroughputApp::new(p, conns)),
            AppSpec::Bandwidth(p) => Box::new(BandwidthApp::new(p, conns)),
            AppSpec::Rpc(p) => Box::new(RpcApp::new(p, conns)),
            AppSpec::Storage(p) => Box::new(StorageApp::new(p, conns)),
            AppSpec::Control(p) => Box::new(ControlApp::new(p)),
        }
    }
}

impl FlowSpec {
    /// The one application table, or `None` when there are zero or several.
    pub fn app(&self) -> Option<AppSpec<'_>> {
        let mut found = [
            self.latency.as_ref().map(AppSpec::Latency),
            self.throughput.as_ref().map(AppSpec::Throughput),
            self.bandwidth.as_ref().map(AppSpec::Bandwidth),
            self.rpc.as_ref().map(AppSpec::Rpc),
            self.storage.as_ref().map(AppSpec::Storage),
            self.control.as_ref().map(AppSpec::Control),
        ]
        .into_iter()
        .flatten();
        let first = found.next();
        if found.next().is_some() {
            None
        } else {
            first
        }
    }

    /// The class the policy is told.
    pub fn class(&self) -> FlowClass {
        self.class
            .or_else(|| self.app().map(|a| a.default_class()))
            .unwrap_or(FlowClass::Bandwidth)
    }
}

/// Why a scenario was refused.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("reading scenario {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The cause, said in the message (not also returned as `source()`).
        cause: std::io::Error,
    },
    /// The folder of scenarios does not exist or could not be listed.
    #[error("cannot read scenario folder {path}: {cause}")]
    Folder {
        /// The folder.
        path: String,
        /// The cause, said in the message (not also returned as `source()`).
        cause: std::io::Error,
    },
    /// The TOML did not parse, or had unknown or mistyped fields.
    #[error("scenario {origin}: {message}")]
    Parse {
        /// Where the text came from.
        origin: String,
        /// The parser's message, naming the field.
        message: String,
    },
    /// A field parsed but its value is unusable.
    #[error("scenario {origin}: {field}: {reason}")]
    Invalid {
        /// Where the text came from.
        origin: String,
        /// The offending field (e.g. `flows[1] (bw): bandwidth.depth`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The profile could not be found or is invalid.
    #[error("scenario {origin}: profile: {cause}")]
    Profile {
        /// Where the scenario came from.
        origin: String,
        /// The profile's error, said in the message (not also returned as `source()`).
        cause: ModelProfileError,
    },
}

/// A run of a scenario as resolved: its name, policy and flows.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedVariant {
    /// Name in reports.
    pub name: String,
    /// The policy on every host.
    pub policy: PolicySpec,
    /// The `justitia` parameters in force.
    pub justitia: JustitiaParams,
    /// The `preempt` parameters in force.
    pub preempt: PreemptParams,
    /// The flows that run, in scenario order, copies expanded.
    pub flows: Vec<FlowRef>,
}

/// One flow of a run: a flow of the scenario, or one of its copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowRef {
    /// Index into [`Scenario::flows`].
    pub spec: usize,
    /// Which copy (0-based).
    pub copy: u32,
    /// Its name in reports: the flow's name, with `#n` for copies.
    pub name: String,
}

impl Scenario {
    /// Parses a scenario; `origin` names the source in errors. The profile is not resolved.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ScenarioError> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            origin: origin.to_string(),
            message: e.to_string().trim().to_string(),
        })?;
        scenario.validate(origin)?;
        Ok(scenario)
    }

    /// The runs of this scenario, in order.
    pub fn variants(&self) -> Vec<ResolvedVariant> {
        let refs_of = |spec: usize| -> Vec<FlowRef> {
            let flow = &self.flows[spec];
            (0..flow.copies)
                .map(|copy| FlowRef {
                    spec,
                    copy,
                    name: if flow.copies > 1 {
                        format!("{}#{}", flow.name, copy + 1)
                    } else {
                        flow.name.clone()
                    },
                })
                .collect()
        };
        let all: Vec<FlowRef> = (0..self.flows.len()).flat_map(refs_of).collect();
        if self.variants.is_empty() {
            let policies = if self.policies.is_empty() {
                vec![PolicySpec::Native]
            } else {
                self.policies.clone()
            };
            return policies
                .into_iter()
                .map(|p| ResolvedVariant {
                    name: p.as_str().to_string(),
                    policy: p,
                    justitia: self.justitia.clone(),
                    preempt: self.preempt.clone(),
                    flows: all.clone(),
                })
                .collect();
        }
        self.variants
            .iter()
            .map(|v| ResolvedVariant {
                name: v.name.clone(),
                policy: v.policy,
                justitia: v.justitia.clone().unwrap_or_else(|| self.justitia.clone()),
                preempt: v.preempt.clone().unwrap_or_else(|| self.preempt.clone()),
                flows: match &v.flows {
                    None => all.clone(),
                    Some(names) => (0..self.flows.len())
                        .filter(|&i| names.contains(&self.flows[i].name))
                        .flat_map(refs_of)
                        .collect(),
                },
            })
            .collect()
    }

    /// The host a flow posts from and the one it talks to.
    pub fn endpoints(&self, flow: &FlowSpec) -> (String, String) {
        let hosts = &self.topology.hosts;
        let first = hosts.first().cloned().unwrap_or_default();
        let second = hosts.get(1).cloned().unwrap_or_default();
        (
            flow.from.clone().unwrap_or(first),
            flow.to.clone().unwrap_or(second),
        )
    }

    fn validate(&self, origin: &str) -> Result<(), ScenarioError> {
        let invalid = |field: String, reason: String| ScenarioError::Invalid {
            origin: origin.to_string(),
            field,
            reason,
        };
        if self.description.trim().is_empty() {
            return Err(invalid("description".into(), "must not be empty".into()));
        }
        if !(self.duration_ms.is_finite()
            && self.duration_ms > 0.0
            && self.duration_ms <= MAX_DURATION_MS)
        {
            return Err(invalid(
                "duration_ms".into(),
                format!(
                    "must be a positive number of ms up to {MAX_DURATION_MS}, got {}",
                    self.duration_ms
                ),
            ));
        }
        if !(self.warmup_ms.is_finite()
            && self.warmup_ms >= 0.0
            && self.warmup_ms < self.duration_ms)
        {
            return Err(invalid(
                "warmup_ms".into(),
                format!(
                    "must be at least 0 and below duration_ms ({}), got {}",
                    self.duration_ms, self.warmup_ms
                ),
            ));
        }
        if let Some(series) = self.series_ms {
            if !(series.is_finite() && series > 0.0) {
                return Err(invalid(
                    "series_ms".into(),
                    format!("must be a positive number of ms, got {series}"),
                ));
            }
        }
        let hosts = &self.topology.hosts;
        match self.topology.kind {
            TopologyKind::BackToBack if hosts.len() != 2 => {
                return Err(invalid(
                    "topology.hosts".into(),
                    format!("a back-to-back topology has 2 hosts, got {}", hosts.len()),
                ));
            }
            _ => {}
        }
        if self.topology.kind == TopologyKind::BackToBack && !self.topology.switch.is_empty() {
            return Err(invalid(
                "topology.switch".into(),
                "only a switched topology has a switch".into(),
            ));
        }
        if let Some(h) = self.topology.downstream.iter().find(|d| !hosts.contains(d)) {
            return Err(invalid(
                "topology.downstream".into(),
                format!("`{h}` is not in topology.hosts"),
            ));
        }
        if self.topology.kind != TopologyKind::TwoSwitches && !self.topology.downstream.is_empty() {
            return Err(invalid(
                "topology.downstream".into(),
                "only a two-switches topology has a downstream switch".into(),
            ));
        }
        if hosts.len() < 2 {
            return Err(invalid(
                "topology.hosts".into(),
                "at least 2 hosts are needed".into(),
            ));
        }
        if hosts.iter().collect::<BTreeSet<_>>().len() != hosts.len() {
            return Err(invalid(
                "topology.hosts".into(),
                "host names must be unique".into(),
            ));
        }
        self.justitia
            .validate()
            .map_err(|(field, reason)| invalid(format!("justitia.{field}"), reason))?;
        self.preempt
            .validate()
            .map_err(|(field, reason)| invalid(format!("preempt.{field}"), reason))?;
        if self.flows.is_empty() {
            return Err(invalid(
                "flows".into(),
                "at least one flow is needed".into(),
            ));
        }
        let mut names = BTreeSet::new();
        for (i, flow) in self.flows.iter().enumerate() {
            let at = |field: &str| format!("flows[{i}] ({}): {field}", flow.name);
            if flow.name.trim().is_empty() {
                return Err(invalid(
                    format!("flows[{i}].name"),
                    "must not be empty".into(),
                ));
            }
            if let Err((_, reason)) = count_within("copies", flow.copies, MAX_COPIES) {
                return Err(invalid(at("copies"), reason));
            }
            if !names.insert(flow.name.as_str()) {
                return Err(invalid(at("name"), "two flows have this name".into()));
            }
            let (from, to) = self.endpoints(flow);
            if !hosts.contains(&from) {
                return Err(invalid(at("from"), format!("no host named `{from}`")));
            }
            if !hosts.contains(&to) {
                return Err(invalid(at("to"), format!("no host named `{to}`")));
            }
            if from == to {
                return Err(invalid(at("to"), "a flow needs two different hosts".into()));
            }
            if usize::from(flow.sl) >= VIRTUAL_LANES {
                return Err(invalid(
                    at("sl"),
                    format!("must be below {VIRTUAL_LANES}, got {}", flow.sl),
                ));
            }
            if !(flow.start_ms.is_finite()
                && flow.start_ms >= 0.0
                && flow.start_ms < self.duration_ms)
            {
                return Err(invalid(
                    at("start_ms"),
                    format!("must be in [0, duration_ms), got {}", flow.start_ms),
                ));
            }
            if let Some(stop) = flow.stop_ms {
                if !(stop.is_finite() && stop > flow.start_ms) {
                    return Err(invalid(
                        at("stop_ms"),
                        format!("must be after start_ms ({}), got {stop}", flow.start_ms),
                    ));
                }
            }
            let mut previous_end = flow.start_ms;
            for (p, [from, to]) in flow.pauses_ms.iter().copied().enumerate() {
                if !(from.is_finite() && to.is_finite() && from >= previous_end && to > from) {
                    return Err(invalid(
                        at(&format!("pauses_ms[{p}]")),
                        format!(
                            "spans must be in order, after start_ms and after each other, \
                             each ending after it begins; got [{from}, {to}]"
                        ),
                    ));
                }
                previous_end = to;
            }
            if flow.stop_ms.is_some_and(|stop| previous_end >= stop) {
                return Err(invalid(
                    at("pauses_ms"),
                    "the last pause must end before stop_ms".into(),
                ));
            }
            if !flow.pauses_ms.is_empty()
                && !matches!(
                    flow.app(),
                    Some(AppSpec::Bandwidth(_) | AppSpec::Throughput(_))
                )
            {
                return Err(invalid(
                    at("pauses_ms"),
                    "only bandwidth and throughput flows pause".into(),
                ));
            }
            let Some(app) = flow.app() else {
                return Err(invalid(
                    at("application"),
                    "give exactly one of the tables latency, throughput, bandwidth, rpc, storage, \
                     control"
                        .into(),
                ));
            };
            validate_app(&app).map_err(|(field, reason)| {
                invalid(at(&format!("{}.{field}", app.kind())), reason)
            })?;
            if let Some(m) = &flow.memory {
                if app.connections() == 0 {
                    return Err(invalid(
                        at("memory"),
                        "a control-verb storm reads no memory".into(),
                    ));
                }
                validate_memory(m)
                    .map_err(|(field, reason)| invalid(at(&format!("memory.{field}")), reason))?;
            }
            if !flow.post_receives {
                let sends = match app {
                    AppSpec::Throughput(p) => p.opcode == Opcode::Send,
                    AppSpec::Bandwidth(p) => p.opcode == Opcode::Send,
                    _ => false,
                };
                if !sends {
                    return Err(invalid(
                        at("post_receives"),
                        "can be false only for a throughput or bandwidth flow with \
                         opcode = \"send\": only a SEND needs a receive"
                            .into(),
                    ));
                }
            }
        }
        let mut variant_names = BTreeSet::new();
        for (i, v) in self.variants.iter().enumerate() {
            let at = |field: &str| format!("variants[{i}] ({}): {field}", v.name);
            if !variant_names.insert(v.name.as_str()) {
                return Err(invalid(at("name"), "two variants have this name".into()));
            }
            if let Some(flows) = &v.flows {
                if flows.is_empty() {
                    return Err(invalid(at("flows"), "at least one flow is needed".into()));
                }
                if let Some(unknown) = flows.iter().find(|n| !names.contains(n.as_str())) {
                    return Err(invalid(at("flows"), format!("no flow named `{unknown}`")));
                }
            }
            if let Some(j) = &v.justitia {
                j.validate()
                    .map_err(|(field, reason)| invalid(at(&format!("justitia.{field}")), reason))?;
            }
            if let Some(pp) = &v.preempt {
                pp.validate()
                    .map_err(|(field, reason)| invalid(at(&format!("preempt.{field}")), reason))?;
            }
        }
        Ok(())
    }
}

fn check_size(field: &'static str, size: ByteSize) -> Result<(), (String, String)> {
    if size.bytes() > u64::from(u32::MAX) {
        Err((
            field.into(),
            format!("{size} is above the 4 GB a work request can carry"),
        ))
    } else {
        Ok(())
    }
}

/// The longest run a scenario may ask for, in simulated ms: an hour, far beyond any
/// experiment here, and well inside what picosecond time can count (about five hours).
pub const MAX_DURATION_MS: f64 = 3_600_000.0;
/// The most copies of one flow.
pub const MAX_COPIES: u32 = 4096;
/// The most queue pairs (threads, backends) of one flow.
pub const MAX_QPS_PER_FLOW: u32 = 4096;
/// The deepest send queue, and so the largest batch or outstanding depth, a flow may ask
/// for: the most work requests a ConnectX send queue holds.
pub const MAX_QUEUE_DEPTH: u32 = 32768;

/// A count that must be at least 1 and at most `max`: a bound that keeps a typo such as
/// `depth = 4e9` from becoming a run that never ends.
fn count_within(field: &'static str, v: u32, max: u32) -> Result<(), (String, String)> {
    if (1..=max).contains(&v) {
        Ok(())
    } else {
        Err((
            field.into(),
            format!("must be between 1 and {max}, got {v}"),
        ))
    }
}

fn validate_memory(m: &MemorySpec) -> Result<(), (String, String)> {
    if !(1..=MAX_MRS_PER_FLOW).contains(&m.mrs) {
        return Err((
            "mrs".into(),
            format!("must be between 1 and {MAX_MRS_PER_FLOW}, got {}", m.mrs),
        ));
    }
    let page = m.page.bytes();
    if !(page.is_power_of_two() && page >= DEFAULT_PAGE_BYTES) {
        return Err((
            "page".into(),
            format!("must be a power of two of at least 4 KB, got {}", m.page),
        ));
    }
    if let Some(size) = m.mr_size {
        // Pages of a region are numbered in 32 bits in the RNIC's translation cache.
        if size.bytes() == 0 || size.bytes() / page >= 1 << 32 {
            return Err((
                "mr_size".into(),
                format!("must be positive and under 2^32 pages, got {size}"),
            ));
        }
        if m.offset.bytes() >= size.bytes() {
            return Err((
                "offset".into(),
                format!(
                    "must be inside the region (mr_size {size}), got {}",
                    m.offset
                ),
            ));
        }
    }
    if m.offset.bytes() > u64::from(u32::MAX) {
        return Err((
            "offset".into(),
            format!("must be under 4 GB, got {}", m.offset),
        ));
    }
    Ok(())
}

fn validate_app(app: &AppSpec<'_>) -> Result<(), (String, String)> {
    match app {
        AppSpec::Latency(p) => {
            check_size("size", p.size)?;
            // RPerf times a request by its ACK, and a READ is answered by data, not an ACK.
            if p.mode == LatencyMode::Rperf && p.opcode == Opcode::Read {
                return Err((
                    "opcode".into(),
                    "cannot be `read` with mode = \"rperf\": a READ gets no ACK to time, \
                     so the flow would take no samples"
                        .into(),
                ));
            }
            if !(p.interval_us.is_finite() && p.interval_us >= 0.0) {
                return Err(("interval_us".into(), "must be zero or positive".into()));
            }
        }
        AppSpec::Throughput(p) => {
            check_size("size", p.size)?;
            count_within("batch", p.batch, MAX_QUEUE_DEPTH)?;
            count_within("qps", p.qps, MAX_QPS_PER_FLOW)?;
            if let Some(depth) = p.depth {
                count_within("depth", depth, MAX_QUEUE_DEPTH)?;
                if depth < p.batch {
                    return Err((
                        "depth".into(),
                        format!("must be at least batch ({})", p.batch),
                    ));
                }
            }
        }
        AppSpec::Bandwidth(p) => {
            check_size("size", p.size)?;
            count_within("depth", p.depth, MAX_QUEUE_DEPTH)?;
            count_within("qps", p.qps, MAX_QPS_PER_FLOW)?;
            if p.size.bytes() == 0 {
                return Err(("size".into(), "must be positive".into()));
            }
        }
        AppSpec::Rpc(p) => {
            check_size("request_size", p.request_size)?;
            if let Some(r) = p.response_size {
                check_size("response_size", r)?;
            }
            count_within("batch", p.batch, MAX_QUEUE_DEPTH)?;
            count_within("threads", p.threads, MAX_QPS_PER_FLOW)?;
        }
        AppSpec::Storage(p) => {
            check_size("split_size", p.split_size)?;
            if p.split_size.bytes() == 0 {
                return Err(("split_size".into(), "must be positive".into()));
            }
            if p.object_size.bytes() == 0 {
                return Err(("object_size".into(), "must be positive".into()));
            }
            count_within("backends", p.backends, MAX_QPS_PER_FLOW)?;
            count_within("depth", p.depth, MAX_QUEUE_DEPTH)?;
        }
        AppSpec::Control(p) => {
            if !(p.interval_us.is_finite() && p.interval_us >= 0.0) {
                return Err(("interval_us".into(), "must be zero or positive".into()));
            }
            let pages = p.mr_size.bytes().div_ceil(DEFAULT_PAGE_BYTES);
            if pages == 0 || pages > u64::from(u32::MAX) {
                return Err((
                    "mr_size".into(),
                    format!("must be positive and under 2^32 pages, got {}", p.mr_size),
                ));
            }
        }
    }
    Ok(())
}

/// A scenario with its profile resolved, ready to [`run`](Experiment::run).
#[derive(Clone, Debug, PartialEq)]
pub struct Experiment {
    /// The scenario's name: its file name without `.toml`.
    pub name: String,
    /// The scenario.
    pub scenario: Scenario,
    /// The RNIC model it runs on.
    pub profile: ModelProfile,
}

impl Experiment {
    /// Loads a scenario file and resolves its profile.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ScenarioError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|cause| ScenarioError::Io {
            path: path.display().to_string(),
            cause,
        })?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        Self::from_toml(&name, &text, path.parent())
    }

    /// Parses a scenario named `name`; `dir` is the folder it lives in (for the profile
    /// lookup), if any.
    pub fn from_toml(name: &str, text: &str, dir: Option<&Path>) -> Result<Self, ScenarioError> {
        let scenario = Scenario::from_toml(text, name)?;
        let mut profile =
            resolve_profile(&scenario.profile, dir).map_err(|cause| ScenarioError::Profile {
                origin: name.to_string(),
                cause,
            })?;
        if scenario.topology.kind != TopologyKind::BackToBack {
            let Some(params) = &profile.switch else {
                return Err(ScenarioError::Invalid {
                    origin: name.to_string(),
                    field: "topology.kind".into(),
                    reason: format!(
                        "profile {} has no [switch] table for a switched topology",
                        profile.name()
                    ),
                });
            };
            profile.switch = Some(scenario.topology.switch.apply(params));
            profile
                .validate(name)
                .map_err(|cause| ScenarioError::Profile {
                    origin: name.to_string(),
                    cause,
                })?;
        }
        check_against_profile(&scenario, &profile).map_err(|(field, reason)| {
            ScenarioError::Invalid {
                origin: name.to_string(),
                field,
                reason,
            }
        })?;
        Ok(Experiment {
            name: name.to_string(),
            scenario,
            profile,
        })
    }

    /// The same experiment on another RNIC model (e.g. a variant of a profile).
    pub fn with_profile(mut self, profile: ModelProfile) -> Self {
        self.profile = profile;
        self
    }
}

/// What a scenario's flows need of its profile: an RNR timer for SENDs without receives
/// (else they would be sent again at once, for ever, at no cost), and a time for each
/// control verb a storm issues (a storm of verbs taking no time would never let time
/// pass).
fn check_against_profile(
    scenario: &Scenario,
    profile: &ModelProfile,
) -> Result<(), (String, String)> {
    for (i, flow) in scenario.flows.iter().enumerate() {
        let at = |field: &str| format!("flows[{i}] ({}): {field}", flow.name);
        if !flow.post_receives && profile.rnic.rnr_timer_us <= 0.0 {
            return Err((
                at("post_receives"),
                format!(
                    "needs a profile with rnic.rnr_timer_us set; {} has none",
                    profile.name()
                ),
            ));
        }
        if let Some(c) = &flow.control {
            let (needed, us) = match c.verb {
                ControlVerb::RegMr => ("rnic.reg_mr_us", profile.rnic.reg_mr_us),
                ControlVerb::CreateQp => ("rnic.create_qp_us", profile.rnic.create_qp_us),
            };
            if us <= 0.0 {
                return Err((
                    at("control.verb"),
                    format!(
                        "needs a profile with {needed} set; {} has none",
                        profile.name()
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn resolve_profile(spec: &str, dir: Option<&Path>) -> Result<ModelProfile, ModelProfileError> {
    if spec.ends_with(".toml") {
        let path = match dir {
            Some(d) => d.join(spec),
            None => PathBuf::from(spec),
        };
        return ModelProfile::from_file(&path);
    }
    if let Some(d) = dir {
        let beside = d
            .join("..")
            .join("profiles")
            .join(format!("{}.toml", spec.to_ascii_lowercase()));
        if beside.is_file() {
            return ModelProfile::from_file(&beside);
        }
    }
    ModelProfile::builtin(spec)
}

/// A scenario file's name and one-line description, for listings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScenarioSummary {
    /// File name without `.toml`.
    pub name: String,
    /// The file.
    pub path: PathBuf,
    /// Its description.
    pub description: String,
}

/// The scenarios in a folder, sorted by name. Files that do not parse are reported as
/// errors rather than skipped, so a broken scenario cannot hide.
pub fn list_scenarios(dir: &Path) -> Result<Vec<ScenarioSummary>, ScenarioError> {
    let entries = std::fs::read_dir(dir).map_err(|cause| ScenarioError::Folder {
        path: dir.display().to_string(),
        cause,
    })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let experiment = Experiment::load(&path)?;
            Ok(ScenarioSummary {
                name: experiment.name,
                path,
                description: experiment.scenario.description,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const BASE: &str = r#"
description = "test"
profile = "IB-56"
duration_ms = 5
warmup_ms = 1

[[flows]]
name = "lat"
[flows.latency]
size = 16

[[flows]]
name = "bw"
[flows.bandwidth]
size = "1MB"
depth = 4
"#;

    fn err(text: &str) -> String {
        Experiment::from_toml("t", text, None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn base_parses_with_defaults() {
        let e = Experiment::from_toml("t", BASE, None).unwrap();
        assert_eq!(e.profile.name(), "IB-56");
        let v = e.scenario.variants();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].policy, PolicySpec::Native);
        let specs: Vec<usize> = v[0].flows.iter().map(|f| f.spec).collect();
        assert_eq!(specs, vec![0, 1]);
        assert_eq!(e.scenario.flows[1].class(), FlowClass::Bandwidth);
        assert_eq!(
            e.scenario.endpoints(&e.scenario.flows[0]),
            ("a".to_string(), "b".to_string())
        );
    }

    #[test]
    fn policies_list_expands_to_runs() {
        let text = BASE.replace(
            "warmup_ms = 1",
            "warmup_ms = 1\npolicies = [\"native\", \"justitia\", \"priority\"]",
        );
        let e = Experiment::from_toml("t", &text, None).unwrap();
        let names: Vec<_> = e.scenario.variants().into_iter().map(|v| v.name).collect();
        assert_eq!(names, vec!["native", "justitia", "priority"]);
    }

    #[test]
    fn unknown_policy_names_the_field_and_the_policies() {
        let text = BASE.replace("warmup_ms = 1", "warmup_ms = 1\npolicies = [\"strict\"]");
        let err = Experiment::from_toml("t", &text, None)
            .unwrap_err()
            .to_string();
        for needle in ["policies", "strict", "`adaptive`, `priority`"] {
            assert!(err.contains(needle), "{needle} not in: {err}");
        }
    }

    #[test]
    fn variants_select_flows() {
        let text = format!(
            "{BASE}\n[[variants]]\nname = \"alone\"\nflows = [\"lat\"]\n[[variants]]\nname = \"both\"\npolicy = \"justitia\"\n"
        );
        let e = Experiment::from_toml("t", &text, None).unwrap();
        let v = e.scenario.variants();
        let names =
            |i: usize| -> Vec<String> { v[i].flows.iter().map(|f| f.name.clone()).collect() };
        assert_eq!(names(0), vec!["lat"]);
        assert_eq!(names(1), vec!["lat", "bw"]);
        assert_eq!(v[1].policy, PolicySpec::Justitia);
    }

    #[test]
    fn copies_expand_into_named_flows() {
        let text = BASE.replace("name = \"bw\"", "name = \"bw\"\ncopies = 3");
        let e = Experiment::from_toml("t", &text, None).unwrap();
        let v = e.scenario.variants();
        let names: Vec<_> = v[0].flows.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, vec!["lat", "bw#1", "bw#2", "bw#3"]);
        assert_eq!(v[0].flows[3].copy, 2);
        assert!(
            err(&BASE.replace("name = \"bw\"", "name = \"bw\"\ncopies = 0")).contains("copies")
        );
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(&BASE.replace("depth = 4", "dept = 4")).contains("dept"));
        assert!(
            err(&BASE.replace("depth = 4", "depth = 0")).contains("flows[1] (bw): bandwidth.depth")
        );
        assert!(err(&BASE.replace("duration_ms = 5", "duration_ms = -5")).contains("duration_ms"));
        assert!(
            err(&BASE.replace("duration_ms = 5", "duration_ms = 1e300")).contains("duration_ms")
        );
        assert!(err(&BASE.replace("depth = 4", "depth = 4000000000"))
            .contains("flows[1] (bw): bandwidth.depth: must be between 1 and 32768"));
        assert!(
            err(&BASE.replace("name = \"bw\"", "name = \"bw\"\ncopies = 100000"))
                .contains("copies")
        );
        assert!(err(&BASE.replace("warmup_ms = 1", "warmup_ms = 9")).contains("warmup_ms"));
        assert!(err(&BASE.replace("profile = \"IB-56\"", "profile = \"CX9\"")).contains("CX9"));
        assert!(err(&BASE.replace("size = 16", "size = \"16XB\"")).contains("XB"));
        assert!(
            err(&BASE.replace("name = \"bw\"", "name = \"lat\"")).contains("flows[1] (lat): name")
        );
        let two_apps = BASE.replace(
            "[flows.latency]\nsize = 16",
            "[flows.latency]\nsize = 16\n[flows.throughput]\nsize = 16\nbatch = 4",
        );
        assert!(err(&two_apps).contains("exactly one"));
        let bad_host = BASE.replace("name = \"bw\"", "name = \"bw\"\nto = \"z\"");
        assert!(err(&bad_host).contains("flows[1] (bw): to"));
        let bad_variant = format!("{BASE}\n[[variants]]\nname = \"x\"\nflows = [\"nope\"]\n");
        assert!(err(&bad_variant).contains("variants[0] (x): flows"));
        let bad_policy = format!("{BASE}\n[[variants]]\nname = \"x\"\npolicy = \"magic\"\n");
        assert!(err(&bad_policy).contains("magic"));
    }

    #[test]
    fn rperf_latency_flow_must_not_read() {
        let rperf = |opcode: &str| {
            BASE.replace(
                "size = 16",
                &format!("size = 16\nmode = \"rperf\"\nopcode = \"{opcode}\""),
            )
        };
        let refused = err(&rperf("read"));
        assert!(
            refused.contains("flows[0] (lat): latency.opcode"),
            "{refused}"
        );
        assert!(Experiment::from_toml("t", &rperf("write"), None).is_ok());
    }

    #[test]
    fn io_errors_say_their_cause_once() {
        let missing = Path::new("/nonexistent/scenarios");
        let e = list_scenarios(missing).unwrap_err();
        assert!(matches!(e, ScenarioError::Folder { .. }), "{e:?}");
        let said = e.to_string();
        assert!(
            said.starts_with("cannot read scenario folder /nonexistent/scenarios: "),
            "{said}"
        );
        assert!(std::error::Error::source(&e).is_none());
        let e = Experiment::load(missing.join("x.toml")).unwrap_err();
        assert!(e
            .to_string()
            .starts_with("reading scenario /nonexistent/scenarios/x.toml: "));
        assert!(std::error::Error::source(&e).is_none());
    }

    #[test]
    fn pauses_are_checked() {
        let with = |extra: &str| BASE.replace("name = \"bw\"", &format!("name = \"bw\"\n{extra}"));
        assert!(Experiment::from_toml("t", &with("pauses_ms = [[1, 2], [3, 4]]"), None).is_ok());
        assert!(err(&with("pauses_ms = [[2, 1]]")).contains("flows[1] (bw): pauses_ms[0]"));
        assert!(err(&with("pauses_ms = [[1, 3], [2, 4]]")).contains("pauses_ms[1]"));
        let latency = BASE.replace("name = \"lat\"", "name = \"lat\"\npauses_ms = [[1, 2]]");
        assert!(err(&latency).contains("only bandwidth and throughput flows pause"));
        let late = with("stop_ms = 2\npauses_ms = [[1, 3]]");
        assert!(err(&late).contains("before stop_ms"), "{}", err(&late));
    }
}
