//! `justitiad.toml`: every key, its default, and the checks that refuse a bad value.
//!
//! The file is read as a TOML table and each key taken out by name, so every refusal
//! names the file, the key and the reason, and an unknown key (a typo) is refused rather
//! than ignored. An absent file at the default path means "all defaults"; an absent file
//! named with `--config` is an error.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `device` | first device with an active port | RDMA device the reference flow runs on |
//! | `port` | first active port of `device` | its port |
//! | `gid_index` | `"auto"` | GID index of the loopback connection: `"auto"`, the first GID of the port whose address is configured on its network device and out of duplicate address detection (RoCE v2 before v1, IPv4 before IPv6), or an index, refused at start when its GID is no such address (see [`crate::gid`]) |
//! | `policy` | `"justitia"` | the policy bandwidth and throughput flows are shaped by: `"justitia"` (the control loop's SafeUtil split among the flows), or `"adaptive"` (the adaptive law: bandwidth flows paced together just below what the transmitter drains, in chunks sized from Current99; see [`crate::adaptive`]) |
//! | `profile` | looked up from the port's link layer and speed x width | RNIC profile name (`roce-100`, `ib-56`, ...) |
//! | `target` | `"2x"` | Target99: `"150us"`, `"2ms"`, `"800ns"` absolute, or `"2.5x"` the probe's idle p99 |
//! | `ref_period_us` | 500 | RefPeriod: probe interval and control interval (with no latency flow, no probe runs and the loop updates every 10 RefPeriods, acting on any change at the next RefPeriod tick) |
//! | `probe_timeout_ms` | 5 | a probe not completed by then is lost |
//! | `probe` | `"verbs"` | `"verbs"`: 10 B WRITEs in loopback on the port, or across the wire to a member's daemon with `peer.probe_to`; `"synthetic"`: a constant latency without a device (tests, hosts without RDMA) |
//! | `synthetic_latency_us` | 20 | the synthetic probe's latency |
//! | `socket` | `/run/justitia/justitiad.sock` | registration socket (mode 0666: any local process may register, as itself) |
//! | `admin_socket` | `/run/justitia/justitiad-admin.sock` | admin socket |
//! | `admin_group` | none | a group whose members may use the admin socket besides root |
//! | `metrics` | `127.0.0.1:9464` | (`--metrics` on the command line replaces it) Prometheus endpoint: `address:port`, or `unix:/path` (mode 0660, group `admin_group`), which alone carries the per-tenant series labelled by uid; `""` turns it off. A failed bind is retried, never fatal |
//! | `stale_after_ms` | 5 | a heartbeat older than this makes shapers fall back |
//! | `slots` | 1024 | flows the daemon registers at most (and slots of each tenant page) |
//! | `max_flows_per_tenant` | 256 | flows one tenant may register (a quarter of `slots` is kept for tenants with few flows, see `limits`); with `tenant = "uid"` or `"cgroup"` the cap is per uid, since a user with a delegated cgroup subtree could otherwise make tenants at will, and so is it for processes in no pod with `"pod"` and `"namespace"` |
//! | `max_connections_per_tenant` | 64 | connections one tenant (as for `max_flows_per_tenant`) may hold on the registration socket |
//! | `max_remote_ends_per_tenant` | 16 | distinct peer hosts one tenant's flows may name as their remote ends (1..=1024); a flow naming one more is refused for its remote part and counted as a local flow |
//! | `control_verbs_per_sec` | 0 | the host's budget of control verbs (memory registrations and QP creations) per second, shared among the connected tenants by weight and within a tenant evenly among its processes, whose shapers hold each to its share (see `justitia_core::control_verbs`); 0 leaves them unpaced. 0..=10000000 |
//! | `control_verb_burst` | 16 | control verbs each process may issue back to back before its share paces it, 1..=65536 |
//! | `qp_turns` | 0 | the host's budget of shaped queue pairs posting at once (set it to the RNIC's QP-context cache entries), shared among the connected tenants by weight and within a tenant evenly among its processes, at least one each; a process's queue pairs beyond its share wait for turns (see `justitia_core::queue_turns`); 0 gives no turns. 0..=1048576 |
//! | `qp_turn_bytes` | 8388608; under `policy = "adaptive"` the law's context turn (`justitia_core::adaptive::AdaptiveLaw::context_turn_bytes`: 28 MiB on `roce-100`) | bytes a queue pair posts in one turn while another of its process waits, 4096..=1073741824 |
//! | `admission` | `"warn"` | a latency flow arriving while Current99 > Target99: `"warn"` admits it with a warning, `"refuse"` tells it it is not admitted |
//! | `unshaped_scan_ms` | 100 | how often the daemon lists the RDMA queue pairs the kernel holds on its devices (the probe's device; with the synthetic probe `device`, or every device) to find processes without a shaper registered, 10..=60000; 0 turns it off. A process is listed within about this interval and 100 ms of its first queue pair; a scan waits at least 50 times its own duration before the next (see [`crate::unshaped`]) |
//! | `tenant` | `"uid"` | what a tenant is, for counting a tenant's flows of one class once: `"uid"`; `"cgroup"`, the cgroup (v2; else the v1 `name=systemd` hierarchy) of the registering process when it connects; `"pod"`, the Kubernetes pod that cgroup belongs to (see [`crate::kubepods`]); `"namespace"`, that pod's namespace (from `pod_logs_dir`; the pod while its namespace is not found there). A process in no pod is its cgroup's tenant with `"pod"` and `"namespace"` |
//! | `pod_logs_dir` | `/var/log/pods` | kubelet's pod log directory, whose entries `<namespace>_<pod>_<UID>` name the pods (`tenant = "namespace"`, and weights by namespace or pod) |
//! | `[weights]` | all 1 | a tenant's share weight (1..=1000): `"<uid>" = w`, `"namespace/<namespace>" = w`, `"pod/<namespace>/<pod>" = w`; a flow takes its pod's weight, else its namespace's, else its uid's, else 1 |
//! | `[peer]` | off | the peer channel to other hosts' daemons (remote READs, incast); on when the table is present |
//! | `peer.node` | required | (`--peer-node` on the command line replaces it) this host's RDMA port GID (IPv6 form), or on RoCE v2 its IPv4 address |
//! | `peer.key_file` | none | this host's private key (`justitiad genkey`), mode 0600 or stricter |
//! | `peer.key_credential` | `"peer.key"` | without `key_file`: the systemd credential holding the key (`$CREDENTIALS_DIRECTORY/<name>`, from `LoadCredential=`) |
//! | `peer.members_file` | none | instead of `[peer.members]`: a file holding its entries alone, read again within a second of a change and on SIGHUP (see [`crate::members_file`]); absent, it lists no member yet |
//! | `[peer.members]` | required (or `members_file`) | `"<GID or IPv4>" = "<public key>"` or `{ key = "<public key>", address = "address:port" }`: the hosts this one talks to (`justitiad pubkey` prints a host's key) |
//! | `peer.listen` | `"0.0.0.0:7471"` | the UDP address the channel binds |
//! | `peer.port` | 7471 | the port peers' daemons listen on (RoCE discovery from the GID) |
//! | `peer.max_peers` | 64 | members at most (this host aside) |
//! | `peer.max_flows_per_peer` | 1024 | flows one peer may declare against this host |
//! | `peer.max_messages_per_sec` | 2000 | datagrams one peer may send per second |
//! | `peer.silence_ms` | 20 | a peer silent this long stops counting and constraining (fail-open); also the lifetime of a READ guarantee it gave, so at least `refresh_ms` x 4 (three lost refreshes in a row survived) |
//! | `peer.refresh_ms` | 5 | how often an unchanged demand or grant is sent again |
//! | `peer.probe_to` | none | a member (GID or IPv4) whose daemon the reference flow crosses the wire to, as Justitia's does (§4.2.1): the probe runs in loopback until that daemon answers, then WRITEs to a queue pair it makes for this host, so that Current99 (and an idle-multiple Target99, measured again then) sees the link and the far RNIC (see [`crate::wire_probe`]). Needs `probe = "verbs"`; changed only by a restart |
//! | `[peer.hosts]` | none | `"<GID>" = "address:port"`: peers whose GID holds no routable address (InfiniBand, link-local) |
//! | `[peer.lids]` | none | `"<LID>" = "<GID>"`: InfiniBand peers reached by LID alone |

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use justitia_core::control_loop::Target99;
use justitia_core::flow::Weight;

/// The default configuration path.
pub const DEFAULT_PATH: &str = "/etc/justitia/justitiad.toml";

/// The bytes of one QP turn when `qp_turn_bytes` is not set and the policy is not
/// `adaptive`.
pub const DEFAULT_QP_TURN_BYTES: u64 = 8 << 20;

/// The reference flow's source.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ProbeKind {
    /// Real verbs on the configured port.
    Verbs,
    /// A constant latency, no device.
    Synthetic(Duration),
}

/// What to do with a latency flow that arrives while the target is violated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionPolicy {
    /// Admit with a warning.
    Warn,
    /// Tell it it is not admitted.
    Refuse,
}

/// Which policy shapes the resource-hungry flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Justitia's control loop: SafeUtil split among the flows.
    Justitia,
    /// The adaptive law (see [`crate::adaptive`]).
    Adaptive,
}

impl PolicyKind {
    /// The name the configuration, the metrics and `justitia status` use.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Justitia => "justitia",
            PolicyKind::Adaptive => "adaptive",
        }
    }
}

/// What makes two flows one tenant's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantBy {
    /// The registering process's uid.
    Uid,
    /// The registering process's cgroup, read from `/proc/<pid>/cgroup` when it connects.
    Cgroup,
    /// The Kubernetes pod of that cgroup; a process in no pod is its cgroup's tenant.
    Pod,
    /// The namespace of that pod; the pod while its namespace is unknown.
    Namespace,
}

/// Share weights by uid, namespace and pod (`[weights]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Weights {
    /// `"<uid>" = w`.
    pub uids: BTreeMap<u32, u32>,
    /// `"namespace/<namespace>" = w`.
    pub namespaces: BTreeMap<String, u32>,
    /// `"pod/<namespace>/<pod>" = w`.
    pub pods: BTreeMap<(String, String), u32>,
}

/// The daemon's settings. See the module documentation for each key.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Device name.
    pub device: Option<String>,
    /// Port number.
    pub port: Option<u8>,
    /// GID index, or automatic.
    pub gid_index: crate::gid::GidChoice,
    /// Profile name.
    pub profile: Option<String>,
    /// The shaping policy.
    pub policy: PolicyKind,
    /// Target99.
    pub target: Target99,
    /// RefPeriod.
    pub ref_period: Duration,
    /// Probe timeout.
    pub probe_timeout: Duration,
    /// Probe source.
    pub probe: ProbeKind,
    /// Registration socket.
    pub socket: PathBuf,
    /// Admin socket.
    pub admin_socket: PathBuf,
    /// Admin group name.
    pub admin_group: Option<String>,
    /// Metrics address, `None` when off.
    pub metrics: Option<String>,
    /// Heartbeat staleness limit.
    pub stale_after: Duration,
    /// Flows registered at most, and the slots of each tenant page.
    pub slots: u32,
    /// Flows per tenant (per uid outside pods, see the key's documentation).
    pub max_flows_per_tenant: usize,
    /// Connections per tenant (as `max_flows_per_tenant`).
    pub max_connections_per_tenant: usize,
    /// Distinct peer hosts one tenant's flows may name as their remote ends.
    pub max_remote_ends_per_tenant: usize,
    /// The host's control-verb budget, verbs/s (0: unpaced).
    pub control_verbs_per_sec: u32,
    /// Control verbs each process may issue back to back.
    pub control_verb_burst: u32,
    /// The host's budget of shaped QPs posting at once (0: no turns).
    pub qp_turns: u32,
    /// The bytes of one turn (`None`: [`DEFAULT_QP_TURN_BYTES`], or under `adaptive` the
    /// law's context turn).
    pub qp_turn_bytes: Option<u64>,
    /// Soft admission policy.
    pub admission: AdmissionPolicy,
    /// What a tenant is.
    pub tenant: TenantBy,
    /// The time between scans for unshaped processes; `None`: no scan.
    pub unshaped_scan: Option<Duration>,
    /// kubelet's pod log directory.
    pub pod_logs_dir: PathBuf,
    /// Share weights.
    pub weights: Weights,
    /// The peer channel, when on.
    pub peer: Option<crate::peer::PeerSettings>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            device: None,
            port: None,
            gid_index: crate::gid::GidChoice::Auto,
            profile: None,
            policy: PolicyKind::Justitia,
            target: Target99::IdleMultiple(2.0),
            ref_period: Duration::from_micros(500),
            probe_timeout: Duration::from_millis(5),
            probe: ProbeKind::Verbs,
            socket: PathBuf::from("/run/justitia/justitiad.sock"),
            admin_socket: PathBuf::from("/run/justitia/justitiad-admin.sock"),
            admin_group: None,
            metrics: Some("127.0.0.1:9464".into()),
            stale_after: Duration::from_millis(5),
            slots: justitia_agent::block::DEFAULT_SLOTS,
            max_flows_per_tenant: 256,
            max_connections_per_tenant: 64,
            max_remote_ends_per_tenant: 16,
            control_verbs_per_sec: 0,
            control_verb_burst: 16,
            qp_turns: 0,
            qp_turn_bytes: None,
            admission: AdmissionPolicy::Warn,
            tenant: TenantBy::Uid,
            unshaped_scan: Some(Duration::from_millis(100)),
            pod_logs_dir: PathBuf::from("/var/log/pods"),
            weights: Weights::default(),
            peer: None,
        }
    }
}

/// A refused configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// The key (or `(file)` / `(syntax)`), or the command-line flag (`--metrics`,
    /// `--peer-node`) whose value was refused.
    pub key: String,
    /// Why.
    pub reason: String,
}

impl ConfigError {
    fn describe(&self) -> String {
        if self.key.starts_with("--") {
            format!(
                "command line: flag `{}` (over {}): {}",
                self.key,
                self.file.display(),
                self.reason
            )
        } else {
            format!(
                "{}: key `{}`: {}",
                self.file.display(),
                self.key,
                self.reason
            )
        }
    }
}

/// Values given on `justitiad`'s command line that replace the file's: a DaemonSet fills
/// them per node from the downward API (`--peer-node $(HOST_IP)`), so that one
/// configuration serves every node. Each is checked exactly as the key it replaces, and a
/// refusal names the flag.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--metrics`: replaces `metrics`.
    pub metrics: Option<String>,
    /// `--peer-node`: replaces `[peer] node`; refused when the file has no `[peer]` table.
    pub peer_node: Option<String>,
}

/// Parses a Target99 as written in the file or on the admin socket.
pub fn parse_target(text: &str) -> Result<Target99, String> {
    let t = text.trim();
    let num = |s: &str| -> Result<f64, String> {
        s.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("`{text}` is not a positive number with a unit"))
    };
    if let Some(m) = t.strip_suffix('x') {
        let m = num(m)?;
        if m < 1.0 {
            return Err(format!("an idle multiple must be at least 1, got {m}"));
        }
        return Ok(Target99::IdleMultiple(m));
    }
    let (value, scale) = if let Some(v) = t.strip_suffix("ns") {
        (v, 1e-9)
    } else if let Some(v) = t.strip_suffix("us") {
        (v, 1e-6)
    } else if let Some(v) = t.strip_suffix("ms") {
        (v, 1e-3)
    } else {
        return Err(format!(
            "`{text}` has no unit: write e.g. `150us`, `2ms`, `800ns` or `2x`"
        ));
    };
    let secs = num(value)? * scale;
    if secs > 10.0 {
        return Err(format!("`{text}` is longer than 10 s"));
    }
    Ok(Target99::Absolute(Duration::from_secs_f64(secs)))
}

impl Config {
    /// The weight of the flows of `uid` in `pod` (if in one): the pod's configured weight,
    /// else its namespace's, else the uid's, else one. A weight the configuration holds was
    /// checked at load, so one out of range cannot be found here.
    pub fn weight_of(&self, uid: u32, pod: Option<&crate::kubepods::PodName>) -> Weight {
        let w = &self.weights;
        pod.and_then(|p| {
            w.pods
                .get(&(p.namespace.clone(), p.name.clone()))
                .or_else(|| w.namespaces.get(&p.namespace))
        })
        .or_else(|| w.uids.get(&uid))
        .and_then(|&w| Weight::new(w).ok())
        .unwrap_or(Weight::ONE)
    }

    /// Reads `path`. `required` says whether an absent file is an error (a path given on
    /// the command line) or means the defaults (the default path).
    pub fn load(path: &Path, required: bool) -> Result<Config, ConfigError> {
        Config::load_with(path, required, &Overrides::default())
    }

    /// [`Config::load`] with the command line's `overrides` applied; with
    /// `[peer] members_file`, the members are read from that file (absent: none yet).
    pub fn load_with(
        path: &Path,
        required: bool,
        overrides: &Overrides,
    ) -> Result<Config, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => String::new(),
            Err(e) => {
                return Err(ConfigError {
                    file: path.to_path_buf(),
                    key: "(file)".into(),
                    reason: e.to_string(),
                })
            }
        };
        let mut c = Config::parse_with(path, &text, overrides)?;
        if let Some(peer) = c.peer.as_mut() {
            if let Some(file) = peer.members_file.clone() {
                let listed = crate::members_file::read(&file, peer.node, peer.channel.max_peers)
                    .map_err(|e| e.into_config_error())?;
                peer.apply_members(listed);
            }
        }
        Ok(c)
    }

    /// Parses the text of `file`.
    pub fn parse(file: &Path, text: &str) -> Result<Config, ConfigError> {
        Config::parse_with(file, text, &Overrides::default())
    }

    /// Parses the text of `file` with the command line's `overrides` in place of the keys
    /// they replace. A `members_file` is not read here (see [`Config::load_with`]).
    pub fn parse_with(
        file: &Path,
        text: &str,
        overrides: &Overrides,
    ) -> Result<Config, ConfigError> {
        let err = |key: &str, reason: String| ConfigError {
            file: file.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| err("(syntax)", e.message().to_string()))?;
        if let Some(m) = &overrides.metrics {
            table.insert("metrics".into(), toml::Value::String(m.clone()));
        }
        if let Some(node) = &overrides.peer_node {
            match table.get_mut("peer") {
                Some(toml::Value::Table(t)) => {
                    t.insert("node".into(), toml::Value::String(node.clone()));
                }
                _ => {
                    return Err(err(
                        "--peer-node",
                        "the configuration has no [peer] table: the peer channel is off".into(),
                    ))
                }
            }
        }
        Config::from_table(file, table).map_err(|mut e| {
            if e.key == "metrics" && overrides.metrics.is_some() {
                e.key = "--metrics".into();
            } else if e.key == "peer.node" && overrides.peer_node.is_some() {
                e.key = "--peer-node".into();
            }
            e
        })
    }

    fn from_table(file: &Path, mut table: toml::Table) -> Result<Config, ConfigError> {
        let err = |key: &str, reason: String| ConfigError {
            file: file.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        let mut c = Config::default();
        let mut take = |key: &str| table.remove(key);
        let string = |key: &str, v: toml::Value| -> Result<String, ConfigError> {
            match v {
                toml::Value::String(s) => Ok(s),
                other => Err(err(
                    key,
                    format!("expected a string, got {}", other.type_str()),
                )),
            }
        };
        let int = |key: &str, v: toml::Value, lo: i64, hi: i64| -> Result<i64, ConfigError> {
            match v {
                toml::Value::Integer(i) if (lo..=hi).contains(&i) => Ok(i),
                toml::Value::Integer(i) => {
                    Err(err(key, format!("{i} is out of range {lo}..={hi}")))
                }
                other => Err(err(
                    key,
                    format!("expected an integer, got {}", other.type_str()),
                )),
            }
        };
        if let Some(v) = take("device") {
            let s = string("device", v)?;
            if s.is_empty() {
                return Err(err(
                    "device",
                    "must not be empty (omit it for the first active device)".into(),
                ));
            }
            c.device = Some(s);
        }
        if let Some(v) = take("port") {
            c.port = Some(int("port", v, 1, 255)? as u8);
        }
        if let Some(v) = take("gid_index") {
            c.gid_index = match v {
                toml::Value::String(s) if s == "auto" => crate::gid::GidChoice::Auto,
                toml::Value::String(s) => {
                    return Err(err(
                        "gid_index",
                        format!("`{s}` is neither \"auto\" nor an index 0..=255"),
                    ))
                }
                v => crate::gid::GidChoice::Index(int("gid_index", v, 0, 255)? as u8),
            };
        }
        if let Some(v) = take("profile") {
            let s = string("profile", v)?;
            justitia_core::profile::RnicProfile::builtin(&s)
                .map_err(|e| err("profile", e.to_string()))?;
            c.profile = Some(s);
        }
        if let Some(v) = take("policy") {
            c.policy = match string("policy", v)?.as_str() {
                "justitia" => PolicyKind::Justitia,
                "adaptive" => PolicyKind::Adaptive,
                other => {
                    return Err(err(
                        "policy",
                        format!("`{other}` is neither `justitia` nor `adaptive`"),
                    ))
                }
            };
        }
        if let Some(v) = take("target") {
            c.target = parse_target(&string("target", v)?).map_err(|r| err("target", r))?;
        }
        if let Some(v) = take("ref_period_us") {
            c.ref_period = Duration::from_micros(int("ref_period_us", v, 50, 1_000_000)? as u64);
        }
        if let Some(v) = take("probe_timeout_ms") {
            c.probe_timeout = Duration::from_millis(int("probe_timeout_ms", v, 1, 10_000)? as u64);
        }
        if let Some(v) = take("synthetic_latency_us") {
            c.probe = ProbeKind::Synthetic(Duration::from_micros(int(
                "synthetic_latency_us",
                v,
                1,
                1_000_000,
            )? as u64));
        }
        if let Some(v) = take("probe") {
            match string("probe", v)?.as_str() {
                "verbs" => c.probe = ProbeKind::Verbs,
                "synthetic" => {
                    if c.probe == ProbeKind::Verbs {
                        c.probe = ProbeKind::Synthetic(Duration::from_micros(20));
                    }
                }
                other => {
                    return Err(err(
                        "probe",
                        format!("`{other}` is neither `verbs` nor `synthetic`"),
                    ))
                }
            }
        } else if matches!(c.probe, ProbeKind::Synthetic(_)) {
            return Err(err(
                "synthetic_latency_us",
                "given without `probe = \"synthetic\"`".into(),
            ));
        }
        for (key, slot) in [
            ("socket", &mut c.socket),
            ("admin_socket", &mut c.admin_socket),
        ] {
            if let Some(v) = take(key) {
                let s = string(key, v)?;
                if !s.starts_with('/') || s.len() > 100 {
                    return Err(err(
                        key,
                        format!("`{s}` must be an absolute path of at most 100 bytes"),
                    ));
                }
                *slot = PathBuf::from(s);
            }
        }
        if let Some(v) = take("admin_group") {
            let s = string("admin_group", v)?;
            if group_id(&s).is_none() {
                return Err(err("admin_group", format!("no group `{s}` in /etc/group")));
            }
            c.admin_group = Some(s);
        }
        if let Some(v) = take("metrics") {
            let s = string("metrics", v)?;
            if s.is_empty() {
                c.metrics = None;
            } else {
                crate::metrics::Endpoint::parse(&s).map_err(|e| err("metrics", e))?;
                c.metrics = Some(s);
            }
        }
        if let Some(v) = take("stale_after_ms") {
            c.stale_after = Duration::from_millis(int("stale_after_ms", v, 1, 10_000)? as u64);
        }
        if let Some(v) = take("slots") {
            c.slots = int("slots", v, 1, i64::from(justitia_agent::block::MAX_SLOTS))? as u32;
        }
        for old in ["max_flows_per_uid", "max_connections_per_uid"] {
            if take(old).is_some() {
                let new = old.replace("_uid", "_tenant");
                return Err(err(
                    old,
                    format!("renamed `{new}`: the caps are per tenant (per uid outside pods)"),
                ));
            }
        }
        if let Some(v) = take("max_flows_per_tenant") {
            c.max_flows_per_tenant = int("max_flows_per_tenant", v, 1, 65_536)? as usize;
        }
        if let Some(v) = take("max_connections_per_tenant") {
            c.max_connections_per_tenant =
                int("max_connections_per_tenant", v, 1, 65_536)? as usize;
        }
        if let Some(v) = take("max_remote_ends_per_tenant") {
            c.max_remote_ends_per_tenant = int("max_remote_ends_per_tenant", v, 1, 1024)? as usize;
        }
        if let Some(v) = take("control_verbs_per_sec") {
            c.control_verbs_per_sec = int("control_verbs_per_sec", v, 0, 10_000_000)? as u32;
        }
        if let Some(v) = take("control_verb_burst") {
            c.control_verb_burst = int("control_verb_burst", v, 1, 65_536)? as u32;
        }
        if let Some(v) = take("qp_turns") {
            c.qp_turns = int("qp_turns", v, 0, 1 << 20)? as u32;
        }
        if let Some(v) = take("qp_turn_bytes") {
            c.qp_turn_bytes = Some(int("qp_turn_bytes", v, 4096, 1 << 30)? as u64);
        }
        if let Some(v) = take("admission") {
            c.admission = match string("admission", v)?.as_str() {
                "warn" => AdmissionPolicy::Warn,
                "refuse" => AdmissionPolicy::Refuse,
                other => {
                    return Err(err(
                        "admission",
                        format!("`{other}` is neither `warn` nor `refuse`"),
                    ))
                }
            };
        }
        if let Some(v) = take("tenant") {
            c.tenant = match string("tenant", v)?.as_str() {
                "uid" => TenantBy::Uid,
                "cgroup" => TenantBy::Cgroup,
                "pod" => TenantBy::Pod,
                "namespace" => TenantBy::Namespace,
                other => {
                    return Err(err(
                        "tenant",
                        format!("`{other}` is neither `uid`, `cgroup`, `pod` nor `namespace`"),
                    ))
                }
            };
        }
        if let Some(v) = take("pod_logs_dir") {
            c.pod_logs_dir = PathBuf::from(string("pod_logs_dir", v)?);
            if !c.pod_logs_dir.is_absolute() {
                return Err(err("pod_logs_dir", "must be an absolute path".into()));
            }
        }
        if let Some(v) = take("unshaped_scan_ms") {
            // A scan costs the daemon tens of microseconds with a few hundred queue pairs
            // (benches/unshaped_scan.rs) and the kernel a query of each (a firmware
            // command each on some RNICs); the scanning thread bounds its own share
            // whatever the interval (crate::unshaped::next_wait).
            c.unshaped_scan = match int("unshaped_scan_ms", v, 0, 60_000)? {
                0 => None,
                ms @ 10.. => Some(Duration::from_millis(ms as u64)),
                ms => {
                    return Err(err(
                        "unshaped_scan_ms",
                        format!("{ms} is out of range: 0 (off) or 10..=60000"),
                    ))
                }
            };
        }
        if let Some(v) = take("weights") {
            let toml::Value::Table(t) = v else {
                return Err(err(
                    "weights",
                    "expected a table of \"uid\" = weight".into(),
                ));
            };
            for (name, w) in t {
                let key = format!("weights.{name}");
                let weight = int(&key, w, 1, 1000)? as u32;
                let parts: Vec<&str> = name.split('/').collect();
                use crate::kubepods::{valid_namespace, valid_pod_name};
                match parts.as_slice() {
                    ["namespace", ns] if valid_namespace(ns) => {
                        c.weights.namespaces.insert(ns.to_string(), weight);
                    }
                    ["pod", ns, pod] if valid_namespace(ns) && valid_pod_name(pod) => {
                        c.weights.pods.insert((ns.to_string(), pod.to_string()), weight);
                    }
                    [uid] => {
                        let id: u32 = uid.parse().map_err(|_| {
                            err(&key, format!("`{uid}` is not a numeric uid (or namespace/<namespace>, pod/<namespace>/<pod>)"))
                        })?;
                        c.weights.uids.insert(id, weight);
                    }
                    _ => {
                        return Err(err(
                            &key,
                            "expected \"<uid>\", \"namespace/<namespace>\" or \"pod/<namespace>/<pod>\", with DNS names".into(),
                        ))
                    }
                }
            }
        }
        if let Some(v) = take("peer") {
            let toml::Value::Table(t) = v else {
                return Err(err("peer", "expected a table".into()));
            };
            let peer = parse_peer(t).map_err(|(key, reason)| err(&key, reason))?;
            // A READ guarantee lasts as long as its responder may be silent (silence_ms);
            // renewed every refresh_ms, it must outlive DEFAULT_REFRESH_LOSSES lost
            // renewals in a row, or it lapses between two and the READ flow runs uncapped.
            let needed = justitia_core::control_loop::read_guarantee_lifetime(
                peer.channel.refresh,
                justitia_core::control_loop::DEFAULT_REFRESH_LOSSES,
            );
            if peer.channel.silence < needed {
                return Err(err(
                    "peer.silence_ms",
                    format!(
                        "{:?} is the READ guarantee's lifetime and must be at least refresh_ms {:?} x ({} lost refreshes + 1) = {needed:?}",
                        peer.channel.silence,
                        peer.channel.refresh,
                        justitia_core::control_loop::DEFAULT_REFRESH_LOSSES
                    ),
                ));
            }
            if peer.probe_to.is_some() && c.probe != ProbeKind::Verbs {
                return Err(err(
                    "peer.probe_to",
                    "needs `probe = \"verbs\"`: the synthetic probe has no queue pair".into(),
                ));
            }
            c.peer = Some(peer);
        }
        if c.probe_timeout <= c.ref_period {
            return Err(err(
                "probe_timeout_ms",
                format!(
                    "{:?} must exceed RefPeriod {:?}",
                    c.probe_timeout, c.ref_period
                ),
            ));
        }
        if let Some((key, _)) = table.into_iter().next() {
            return Err(err(&key, "unknown key".into()));
        }
        Ok(c)
    }
}

/// The `[peer]` table; an error names its key (`peer.<key>`) and the reason.
fn parse_peer(mut t: toml::Table) -> Result<crate::peer::PeerSettings, (String, String)> {
    use crate::peer::{parse_gid, KeySource, PeerSettings, DEFAULT_CREDENTIAL, DEFAULT_PORT};
    use justitia_peer::channel::ChannelConfig;
    let name = |key: &str| format!("peer.{key}");
    let string = |key: &str, v: toml::Value| match v {
        toml::Value::String(s) => Ok(s),
        other => Err((
            name(key),
            format!("expected a string, got {}", other.type_str()),
        )),
    };
    let int = |key: &str, v: toml::Value, lo: i64, hi: i64| match v {
        toml::Value::Integer(i) if (lo..=hi).contains(&i) => Ok(i),
        toml::Value::Integer(i) => Err((name(key), format!("{i} is out of range {lo}..={hi}"))),
        other => Err((
            name(key),
            format!("expected an integer, got {}", other.type_str()),
        )),
    };
    let addr = |key: &str, s: &str| {
        s.parse::<std::net::SocketAddr>()
            .map_err(|_| (key.to_string(), format!("`{s}` is not an address:port")))
    };
    let node = t.remove("node").ok_or_else(|| {
        (
            name("node"),
            "required: this host's GID or IPv4 address".to_string(),
        )
    })?;
    let node = parse_gid(&string("node", node)?).map_err(|r| (name("node"), r))?;
    let credential = t
        .remove("key_credential")
        .map(|v| string("key_credential", v))
        .transpose()?;
    let key = match (t.remove("key_file"), credential) {
        (Some(_), Some(_)) => {
            return Err((
                name("key_credential"),
                "set key_file or key_credential, not both".into(),
            ))
        }
        (Some(v), None) => {
            let path = PathBuf::from(string("key_file", v)?);
            if !path.is_absolute() {
                return Err((name("key_file"), "must be an absolute path".into()));
            }
            KeySource::File(path)
        }
        (None, Some(c)) => {
            if c.is_empty() || c.contains('/') || c == "." || c == ".." {
                return Err((
                    name("key_credential"),
                    format!("`{c}` is not a credential name"),
                ));
            }
            KeySource::Credential(c)
        }
        (None, None) => KeySource::Credential(DEFAULT_CREDENTIAL.into()),
    };
    let listen = match t.remove("listen") {
        Some(v) => addr(&name("listen"), &string("listen", v)?)?,
        None => std::net::SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)),
    };
    let port = match t.remove("port") {
        Some(v) => int("port", v, 1, 65_535)? as u16,
        None => DEFAULT_PORT,
    };
    let mut channel = ChannelConfig::default();
    if let Some(v) = t.remove("max_peers") {
        channel.max_peers = int("max_peers", v, 1, 4096)? as usize;
    }
    if let Some(v) = t.remove("max_flows_per_peer") {
        channel.max_flows_per_peer = int("max_flows_per_peer", v, 1, 65_536)? as u32;
    }
    if let Some(v) = t.remove("max_messages_per_sec") {
        channel.max_messages_per_sec = int("max_messages_per_sec", v, 10, 1_000_000)? as u32;
    }
    if let Some(v) = t.remove("silence_ms") {
        channel.silence = Duration::from_millis(int("silence_ms", v, 1, 60_000)? as u64);
    }
    if let Some(v) = t.remove("refresh_ms") {
        channel.refresh = Duration::from_millis(int("refresh_ms", v, 1, 60_000)? as u64);
    }
    channel
        .validate()
        .map_err(|e| ("peer".to_string(), e.to_string()))?;
    let mut hosts = BTreeMap::new();
    if let Some(v) = t.remove("hosts") {
        let toml::Value::Table(map) = v else {
            return Err((
                name("hosts"),
                "expected a table of \"GID\" = \"address:port\"".into(),
            ));
        };
        for (gid, a) in map {
            let key = format!("peer.hosts.{gid}");
            let node = parse_gid(&gid).map_err(|r| (key.clone(), r))?;
            let toml::Value::String(a) = a else {
                return Err((key, "expected \"address:port\"".into()));
            };
            hosts.insert(node, addr(&key, &a)?);
        }
    }
    let members_file = match t.remove("members_file") {
        None => None,
        Some(v) => {
            let path = PathBuf::from(string("members_file", v)?);
            if !path.is_absolute() {
                return Err((name("members_file"), "must be an absolute path".into()));
            }
            Some(path)
        }
    };
    let table_hosts = hosts.clone();
    let members = match (t.remove("members"), &members_file) {
        (Some(_), Some(_)) => {
            return Err((
                name("members_file"),
                "set [peer.members] or members_file, not both".into(),
            ))
        }
        (None, Some(_)) => BTreeMap::new(),
        (Some(toml::Value::Table(map)), None) => {
            let (members, addresses) =
                parse_members(map, "peer.members.", node, channel.max_peers)?;
            hosts.extend(addresses);
            members
        }
        _ => {
            return Err((
                name("members"),
                "required: a table of \"GID or IPv4\" = \"public key\" (one per host this one talks to), or members_file".into(),
            ))
        }
    };
    let mut lids = BTreeMap::new();
    if let Some(v) = t.remove("lids") {
        let toml::Value::Table(map) = v else {
            return Err((name("lids"), "expected a table of \"LID\" = \"GID\"".into()));
        };
        for (lid, g) in map {
            let key = format!("peer.lids.{lid}");
            let l: u16 = lid
                .parse()
                .ok()
                .filter(|&l| l > 0)
                .ok_or_else(|| (key.clone(), format!("`{lid}` is not a LID (1..=65535)")))?;
            let toml::Value::String(g) = g else {
                return Err((key, "expected a GID".into()));
            };
            lids.insert(l, parse_gid(&g).map_err(|r| (key, r))?);
        }
    }
    let probe_to = match t.remove("probe_to") {
        None => None,
        Some(v) => {
            let to = parse_gid(&string("probe_to", v)?).map_err(|r| (name("probe_to"), r))?;
            if to == node {
                return Err((
                    name("probe_to"),
                    "names this host: the reference flow crosses the wire to another".into(),
                ));
            }
            // With a members file the members are known only at run time: a reference
            // peer missing there is said then, and the probe stays in loopback.
            if members_file.is_none() && !members.contains_key(&to) {
                return Err((
                    name("probe_to"),
                    "is not a member: add it to [peer.members]".into(),
                ));
            }
            Some(to)
        }
    };
    if let Some((key, _)) = t.into_iter().next() {
        return Err((name(&key), "unknown key".into()));
    }
    Ok(PeerSettings {
        node,
        probe_to,
        listen,
        port,
        key,
        members,
        hosts,
        lids,
        channel,
        members_file,
        table_hosts,
    })
}

/// The members and their addresses (`address` given) from a table of member entries
/// (`[peer.members]`, or a members file), each error naming `prefix` and the entry; this
/// host's own address (`node`) is not taken. At most `max_peers` others.
#[allow(clippy::type_complexity)]
pub(crate) fn parse_members(
    map: toml::Table,
    prefix: &str,
    node: justitia_peer::NodeId,
    max_peers: usize,
) -> Result<
    (
        BTreeMap<justitia_peer::NodeId, justitia_peer::keys::PublicKey>,
        BTreeMap<justitia_peer::NodeId, std::net::SocketAddr>,
    ),
    (String, String),
> {
    use crate::peer::parse_gid;
    use justitia_peer::keys::PublicKey;
    let addr = |key: &str, s: &str| {
        s.parse::<std::net::SocketAddr>()
            .map_err(|_| (key.to_string(), format!("`{s}` is not an address:port")))
    };
    let mut hosts = BTreeMap::new();
    let mut members = BTreeMap::new();
    for (gid, v) in map {
        let key = format!("{prefix}{gid}");
        let member = parse_gid(&gid).map_err(|r| (key.clone(), r))?;
        let (public, address) = match v {
            toml::Value::String(k) => (k, None),
            toml::Value::Table(mut m) => {
                let k = match m.remove("key") {
                    Some(toml::Value::String(k)) => k,
                    _ => return Err((format!("{key}.key"), "required: the public key".into())),
                };
                let a = match m.remove("address") {
                    None => None,
                    Some(toml::Value::String(a)) => Some(addr(&format!("{key}.address"), &a)?),
                    Some(_) => {
                        return Err((format!("{key}.address"), "expected \"address:port\"".into()))
                    }
                };
                if let Some((k, _)) = m.into_iter().next() {
                    return Err((format!("{key}.{k}"), "unknown key".into()));
                }
                (k, a)
            }
            _ => {
                return Err((
                    key,
                    "expected \"public key\" or { key = ..., address = ... }".into(),
                ))
            }
        };
        let public = PublicKey::parse(&public).map_err(|e| (key.clone(), e.to_string()))?;
        if let Some(other) = members.iter().find(|(_, &p)| p == public).map(|(n, _)| *n) {
            return Err((
                key,
                format!("the same public key as {other}: one host could speak for the other"),
            ));
        }
        if let Some(a) = address.filter(|_| member != node) {
            hosts.insert(member, a);
        }
        members.insert(member, public);
    }
    let others = members.keys().filter(|&&m| m != node).count();
    if others > max_peers {
        let table = prefix.trim_end_matches('.');
        return Err((
            if table.is_empty() {
                "(members)".into()
            } else {
                table.to_string()
            },
            format!("{others} members besides this host; max_peers is {max_peers}"),
        ));
    }
    Ok((members, hosts))
}

/// A group's id from `/etc/group`.
pub fn group_id(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == name).then_some(())?;
        f.nth(1)?.parse().ok()
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("/etc/justitia/justitiad.toml"), text)
    }

    #[test]
    fn probe_to_names_another_member_and_needs_the_verbs_probe() {
        let k1 = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";
        let base = "[peer]\nnode = \"10.0.0.1\"\nkey_file = \"/k\"\n";
        let members = format!("[peer.members]\n\"10.0.0.2\" = \"{k1}\"\n");
        let p = parse(&format!("{base}probe_to = \"10.0.0.2\"\n{members}"))
            .unwrap()
            .peer
            .unwrap();
        assert_eq!(
            p.probe_to,
            Some(crate::peer::parse_gid("10.0.0.2").unwrap())
        );
        assert_eq!(
            parse(&format!("{base}{members}"))
                .unwrap()
                .peer
                .unwrap()
                .probe_to,
            None
        );
        for (probe_to, why) in [
            ("\"10.0.0.3\"", "not a member"),
            ("\"10.0.0.1\"", "names this host"),
            ("\"host-b\"", "neither a GID"),
            ("3", "expected a string"),
        ] {
            let e = parse(&format!("{base}probe_to = {probe_to}\n{members}")).unwrap_err();
            assert_eq!(e.key, "peer.probe_to", "{e}");
            assert!(e.reason.contains(why), "{probe_to}: {e}");
        }
        // With a members file the members are known at run time only.
        let file = "[peer]\nnode = \"10.0.0.1\"\nkey_file = \"/k\"\nmembers_file = \"/m\"\nprobe_to = \"10.0.0.3\"\n";
        assert!(parse(file).is_ok());
        let e = parse(&format!(
            "probe = \"synthetic\"\n{base}probe_to = \"10.0.0.2\"\n{members}"
        ))
        .unwrap_err();
        assert_eq!(e.key, "peer.probe_to", "{e}");
        assert!(e.reason.contains("probe = \"verbs\""), "{e}");
    }

    #[test]
    fn the_peer_table_turns_the_channel_on_and_names_a_bad_key() {
        // Two public keys (any 32 bytes not all alike are a key's text).
        let k1 = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";
        let k2 = "IB8eHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=";
        let c = parse(&format!(
            "[peer]\nnode = \"10.0.0.1\"\nkey_file = \"/etc/justitia/peer.key\"\nsilence_ms = 40\n\
             [peer.members]\n\"10.0.0.1\" = \"{k1}\"\n\"fe80::2\" = {{ key = \"{k2}\", address = \"192.168.0.2:7000\" }}\n\
             [peer.lids]\n\"12\" = \"fe80::2\"\n",
        ))
        .unwrap();
        let p = c.peer.unwrap();
        assert_eq!(p.node, crate::peer::parse_gid("::ffff:10.0.0.1").unwrap());
        assert_eq!(p.listen, "0.0.0.0:7471".parse().unwrap());
        assert_eq!(p.channel.silence, Duration::from_millis(40));
        let ib = crate::peer::parse_gid("fe80::2").unwrap();
        assert_eq!(p.lids[&12], ib);
        assert_eq!(p.hosts[&ib], "192.168.0.2:7000".parse().unwrap());
        assert_eq!(p.members.len(), 2);
        assert_eq!(
            p.key,
            crate::peer::KeySource::File("/etc/justitia/peer.key".into())
        );
        let key = |text: &str| parse(text).err().map(|e| e.key);
        let members = format!("[peer.members]\n\"10.0.0.2\" = \"{k1}\"\n");
        assert_eq!(
            key(&format!("[peer]\nkey_file = \"/k\"\n{members}")),
            Some("peer.node".into())
        );
        assert_eq!(
            key("[peer]\nnode = \"10.0.0.1\"\n"),
            Some("peer.members".into())
        );
        // Without key_file: the systemd credential peer.key.
        let p = parse(&format!("[peer]\nnode = \"10.0.0.1\"\n{members}"))
            .unwrap()
            .peer
            .unwrap();
        assert_eq!(p.key, crate::peer::KeySource::Credential("peer.key".into()));
        let base = "[peer]\nnode = \"10.0.0.1\"\nkey_file = \"/k\"\n";
        assert_eq!(
            key(&format!("{base}colour = 1\n{members}")),
            Some("peer.colour".into())
        );
        assert_eq!(
            key(&format!("{base}silence_ms = 6\n{members}")),
            Some("peer".into())
        );
        // The READ guarantee's lifetime (silence_ms) must outlive three lost refreshes.
        let e = parse(&format!("{base}silence_ms = 15\n{members}")).unwrap_err();
        assert_eq!(e.key, "peer.silence_ms", "{e}");
        assert!(
            e.reason
                .contains("at least refresh_ms 5ms x (3 lost refreshes + 1) = 20ms"),
            "{e}"
        );
        assert!(parse(&format!("{base}silence_ms = 20\n{members}")).is_ok());
        assert_eq!(
            key(&format!("{base}key_credential = \"../x\"\n{members}")),
            Some("peer.key_credential".into())
        );
        assert_eq!(
            key(&format!(
                "{base}[peer.hosts]\n\"fe80::2\" = \"nowhere\"\n{members}"
            )),
            Some("peer.hosts.fe80::2".into())
        );
        assert_eq!(
            key(&format!("{base}[peer.members]\n\"10.0.0.2\" = \"AAAA\"\n")),
            Some("peer.members.10.0.0.2".into())
        );
        assert_eq!(
            key(&format!(
                "{base}[peer.members]\n\"10.0.0.2\" = \"{k1}\"\n\"10.0.0.3\" = \"{k1}\"\n"
            )),
            Some("peer.members.10.0.0.3".into()),
            "two members with one key"
        );
        assert_eq!(parse("").unwrap().peer, None, "off by default");
    }

    #[test]
    fn command_line_values_replace_the_files_and_are_checked_as_its_keys() {
        let k1 = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";
        let file = Path::new("/etc/justitia/justitiad.toml");
        let with = |text: &str, metrics: Option<&str>, node: Option<&str>| {
            Config::parse_with(
                file,
                text,
                &Overrides {
                    metrics: metrics.map(str::to_string),
                    peer_node: node.map(str::to_string),
                },
            )
        };
        let peer = format!(
            "metrics = \"0.0.0.0:9464\"\n[peer]\nnode = \"10.0.0.9\"\nkey_file = \"/k\"\n[peer.members]\n\"10.0.0.2\" = \"{k1}\"\n"
        );
        let c = with(&peer, Some("192.0.2.10:9464"), Some("192.0.2.10")).unwrap();
        assert_eq!(c.metrics.as_deref(), Some("192.0.2.10:9464"));
        assert_eq!(
            c.peer.unwrap().node,
            crate::peer::parse_gid("192.0.2.10").unwrap()
        );
        // A node id the file does not give, from the command line alone.
        let no_node =
            format!("[peer]\nkey_file = \"/k\"\n[peer.members]\n\"10.0.0.2\" = \"{k1}\"\n");
        assert!(with(&no_node, None, Some("192.0.2.10")).is_ok());
        assert_eq!(with(&no_node, None, None).unwrap_err().key, "peer.node");
        // Refusals name the flag, with the key's own reason.
        for (metrics, node, flag, needle) in [
            (Some("node-a:9464"), None, "--metrics", "address:port"),
            (Some("192.0.2.10"), None, "--metrics", "address:port"),
            (None, Some("node-a"), "--peer-node", "neither a GID"),
            (None, Some("$(HOST_IP)"), "--peer-node", "neither a GID"),
        ] {
            let e = with(&peer, metrics, node).unwrap_err();
            assert_eq!(e.key, flag, "{e}");
            assert!(e.reason.contains(needle), "{e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("command line: flag `{flag}`")),
                "{e}"
            );
        }
        // The file's own bad value still names the file's key.
        let e = with("metrics = \"x\"", None, None).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/etc/justitia/justitiad.toml: key `metrics`"),
            "{e}"
        );
        // --peer-node without a [peer] table: the channel is off, and the flag is refused.
        let e = with("", None, Some("192.0.2.10")).unwrap_err();
        assert_eq!(e.key, "--peer-node");
        assert!(e.reason.contains("no [peer] table"), "{e}");
        // An absent default file takes the flags over the defaults.
        let p = Path::new("/nonexistent/justitiad.toml");
        let o = Overrides {
            metrics: Some("192.0.2.10:9464".into()),
            peer_node: None,
        };
        assert_eq!(
            Config::load_with(p, false, &o).unwrap().metrics.as_deref(),
            Some("192.0.2.10:9464")
        );
    }

    #[test]
    fn members_come_from_members_file_when_set() {
        let k1 = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";
        let k2 = "IB8eHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=";
        let dir = tempfile::tempdir().unwrap();
        let members = dir.path().join("members.toml");
        let config = dir.path().join("justitiad.toml");
        std::fs::write(
            &config,
            format!(
                "[peer]\nnode = \"10.0.0.1\"\nkey_file = \"/k\"\nmembers_file = \"{}\"\n[peer.hosts]\n\"fe80::9\" = \"192.168.0.9:7471\"\n",
                members.display()
            ),
        )
        .unwrap();
        // Not there yet (the list not rendered): no member, and the channel on.
        let p = Config::load(&config, true).unwrap().peer.unwrap();
        assert!(p.members.is_empty());
        assert_eq!(p.members_file.as_deref(), Some(members.as_path()));
        std::fs::write(
            &members,
            format!("\"10.0.0.1\" = \"{k1}\"\n\"fe80::2\" = {{ key = \"{k2}\", address = \"192.168.0.2:7471\" }}\n"),
        )
        .unwrap();
        let p = Config::load(&config, true).unwrap().peer.unwrap();
        assert_eq!(p.members.len(), 2);
        assert_eq!(p.hosts.len(), 2, "[peer.hosts] and the file's address");
        // A bad file: the error names the members file and the entry.
        std::fs::write(&members, "\"10.0.0.2\" = \"AAAA\"\n").unwrap();
        let e = Config::load(&config, true).unwrap_err();
        assert_eq!(e.file, members);
        assert_eq!(e.key, "10.0.0.2");
        // Not both, and an absolute path.
        let key = |text: &str| parse(text).err().map(|e| e.key);
        assert_eq!(
            key(&format!("[peer]\nnode = \"10.0.0.1\"\nmembers_file = \"/m\"\n[peer.members]\n\"10.0.0.2\" = \"{k1}\"\n")),
            Some("peer.members_file".into())
        );
        assert_eq!(
            key("[peer]\nnode = \"10.0.0.1\"\nmembers_file = \"m.toml\"\n"),
            Some("peer.members_file".into())
        );
    }

    #[test]
    fn empty_file_is_the_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
    }

    #[test]
    fn the_packaged_example_parses_to_the_defaults_it_documents() {
        let text = include_str!("../../../packaging/justitiad.toml");
        let c = parse(text).unwrap();
        assert_eq!(c.target, Target99::IdleMultiple(2.0));
        assert_eq!(c.ref_period, Duration::from_micros(500));
        assert_eq!(c.metrics.as_deref(), Some("127.0.0.1:9464"));
        assert_eq!(c.socket, PathBuf::from("/run/justitia/justitiad.sock"));
        assert_eq!(c.policy, PolicyKind::Justitia);
        assert_eq!(c.max_remote_ends_per_tenant, 16);
        assert_eq!(c.gid_index, crate::gid::GidChoice::Auto);
    }

    #[test]
    fn gid_index_is_auto_or_an_index() {
        use crate::gid::GidChoice;
        assert_eq!(parse("").unwrap().gid_index, GidChoice::Auto);
        assert_eq!(
            parse("gid_index = \"auto\"").unwrap().gid_index,
            GidChoice::Auto
        );
        assert_eq!(
            parse("gid_index = 3").unwrap().gid_index,
            GidChoice::Index(3)
        );
        for bad in ["gid_index = \"first\"", "gid_index = 256", "gid_index = -1"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("gid_index"), "{bad}: {e}");
        }
    }

    #[test]
    fn keys_are_read() {
        let c = parse(
            "device = \"rxe0\"\nport = 1\nprofile = \"roce-40\"\ntarget = \"150us\"\nprobe = \"synthetic\"\nsynthetic_latency_us = 30\nadmission = \"refuse\"\npolicy = \"adaptive\"\nmetrics = \"\"\ntenant = \"cgroup\"\nunshaped_scan_ms = 250\nmax_remote_ends_per_tenant = 3\n[weights]\n\"1000\" = 3\n",
        )
        .unwrap();
        assert_eq!(c.device.as_deref(), Some("rxe0"));
        assert_eq!(c.port, Some(1));
        assert_eq!(c.target, Target99::Absolute(Duration::from_micros(150)));
        assert_eq!(c.probe, ProbeKind::Synthetic(Duration::from_micros(30)));
        assert_eq!(c.admission, AdmissionPolicy::Refuse);
        assert_eq!(c.metrics, None);
        assert_eq!(c.weights.uids.get(&1000), Some(&3));
        assert_eq!(c.tenant, TenantBy::Cgroup);
        assert_eq!(c.policy, PolicyKind::Adaptive);
        assert_eq!(c.unshaped_scan, Some(Duration::from_millis(250)));
        assert_eq!(c.max_remote_ends_per_tenant, 3);
        assert_eq!(parse("unshaped_scan_ms = 0").unwrap().unshaped_scan, None);
        let c = parse("control_verbs_per_sec = 2000\ncontrol_verb_burst = 64").unwrap();
        assert_eq!((c.control_verbs_per_sec, c.control_verb_burst), (2000, 64));
        let c = parse("qp_turns = 256\nqp_turn_bytes = 262144").unwrap();
        assert_eq!((c.qp_turns, c.qp_turn_bytes), (256, Some(262_144)));
        assert_eq!(
            (Config::default().qp_turns, Config::default().qp_turn_bytes),
            (0, None)
        );
        for bad in [
            "control_verbs_per_sec = -1",
            "control_verbs_per_sec = 10000001",
            "control_verbs_per_sec = \"fast\"",
            "control_verb_burst = 0",
            "control_verb_burst = 65537",
            "qp_turns = -1",
            "qp_turns = 1048577",
            "qp_turn_bytes = 4095",
            "qp_turn_bytes = 1073741825",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad.split(' ').next().unwrap()), "{bad}: {e}");
        }
        assert_eq!(
            parse("").unwrap().unshaped_scan,
            Some(Duration::from_millis(100))
        );
        assert_eq!(
            parse("unshaped_scan_ms = 10").unwrap().unshaped_scan,
            Some(Duration::from_millis(10))
        );
    }

    #[test]
    fn bad_values_name_file_key_and_reason() {
        for (text, key, needle) in [
            ("port = 0", "port", "out of range"),
            (
                "max_remote_ends_per_tenant = 0",
                "max_remote_ends_per_tenant",
                "out of range",
            ),
            (
                "max_remote_ends_per_tenant = 1025",
                "max_remote_ends_per_tenant",
                "out of range",
            ),
            ("port = \"1\"", "port", "expected an integer"),
            ("target = \"150\"", "target", "no unit"),
            ("target = \"0.5x\"", "target", "at least 1"),
            ("profile = \"roce-7\"", "profile", "roce-7"),
            ("metrics = \"localhost\"", "metrics", "address:port"),
            ("socket = \"relative.sock\"", "socket", "absolute"),
            ("admission = \"maybe\"", "admission", "neither"),
            ("probe = \"magic\"", "probe", "neither"),
            (
                "tenant = \"user\"",
                "tenant",
                "neither `uid`, `cgroup`, `pod` nor `namespace`",
            ),
            (
                "unshaped_scan_ms = 9",
                "unshaped_scan_ms",
                "0 (off) or 10..=60000",
            ),
            (
                "unshaped_scan_ms = 60001",
                "unshaped_scan_ms",
                "out of range",
            ),
            ("unshaped_scan_ms = -1", "unshaped_scan_ms", "out of range"),
            (
                "policy = \"perf\"",
                "policy",
                "neither `justitia` nor `adaptive`",
            ),
            ("policy = 1", "policy", "expected a string"),
            ("[weights]\nalice = 2", "weights.alice", "numeric uid"),
            (
                "[weights]\n\"namespace/Team_A\" = 2",
                "weights.namespace/Team_A",
                "DNS names",
            ),
            (
                "[weights]\n\"pod/team-a\" = 2",
                "weights.pod/team-a",
                "DNS names",
            ),
            (
                "max_flows_per_uid = 3",
                "max_flows_per_uid",
                "renamed `max_flows_per_tenant`",
            ),
            (
                "max_connections_per_uid = 3",
                "max_connections_per_uid",
                "renamed `max_connections_per_tenant`",
            ),
            ("pod_logs_dir = \"pods\"", "pod_logs_dir", "absolute"),
            ("[weights]\n\"5\" = 0", "weights.5", "out of range"),
            ("tagret = \"2x\"", "tagret", "unknown key"),
            ("ref_period_us = 5000", "probe_timeout_ms", "must exceed"),
            ("port = ", "(syntax)", ""),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(e.reason.contains(needle), "{text}: {e}");
            assert!(
                e.to_string()
                    .starts_with("/etc/justitia/justitiad.toml: key `"),
                "{e}"
            );
        }
    }

    #[test]
    fn targets_parse() {
        assert_eq!(
            parse_target("2ms"),
            Ok(Target99::Absolute(Duration::from_millis(2)))
        );
        assert_eq!(
            parse_target("800ns"),
            Ok(Target99::Absolute(Duration::from_nanos(800)))
        );
        assert_eq!(parse_target("2.5x"), Ok(Target99::IdleMultiple(2.5)));
        assert!(parse_target("-3us").is_err());
        assert!(parse_target("20s").is_err());
    }

    #[test]
    fn absent_default_file_means_defaults_but_a_named_one_is_required() {
        let p = Path::new("/nonexistent/justitiad.toml");
        assert_eq!(Config::load(p, false).unwrap(), Config::default());
        assert_eq!(Config::load(p, true).unwrap_err().key, "(file)");
    }
}
