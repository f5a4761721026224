//! The shaper's settings, from environment variables.
//!
//! | variable | values | default |
//! | --- | --- | --- |
//! | `JUSTITIA_CLASS` | `latency`, `throughput`, `bandwidth`, `auto` | `JUSTITIA_DEFAULT_CLASS` |
//! | `JUSTITIA_DEFAULT_CLASS` | the same; the class when `JUSTITIA_CLASS` is unset (what a deployment injects, so that the application's own setting wins) | unset: observe and count only |
//! | `JUSTITIA_POLICY` | `justitia` (split and pace), `preempt` (split, yield, no pacing) | `justitia` |
//! | `JUSTITIA_CHUNK` | bytes, binary suffixes `K`, `M` (`64K`) | the core profile's 5 KiB |
//! | `JUSTITIA_RATE` | `<bytes/s>[:<ops/s>]`, decimal suffixes `K`, `M`, `G` (`20M:50K`); at least `1K:1` | unset: unpaced |
//! | `JUSTITIA_CONTROL_RATE` | `<verbs/s>[:<burst>]`, decimal suffixes (`500`, `2K:64`): memory registrations and QP creations per second, and how many may go back to back; at least 1 verb/s | unset: the daemon's budget for the process, else unpaced |
//! | `JUSTITIA_QP_TURNS` | `<QPs>[:<turn bytes>]`, bytes with binary suffixes (`4`, `8:1M`): how many of the process's shaped QPs post at once, and how many bytes one posts in a turn while another waits | unset: every QP posts; turn 8 MiB |
//! | `JUSTITIA_SUBMSG` | sub-message bytes for `preempt`, binary suffixes | 16K |
//! | `JUSTITIA_YIELD_UNIT` | bytes of sub-message per yield, binary suffixes | 1K |
//! | `JUSTITIA_STATS` | path of a JSON file written at exit (`%p` becomes the pid) | none |
//! | `JUSTITIA_LOG` | `off`, `warn`, `info`, `debug` | `warn` |
//! | `JUSTITIA_DAEMON` | `auto` (follow `justitiad` when it answers), `on` (the same, and say so when it does not), `off` | `auto` (`on` when `JUSTITIA_SOCKET` is set) |
//! | `JUSTITIA_SOCKET` | path of `justitiad`'s registration socket | `/run/justitia/justitiad.sock` |
//! | `JUSTITIA_TWO_SIDED` | `whole` (SENDs and WRITEs with immediate go as posted), `split` (the process keeps a side channel per port, has `justitiad` pair its RC queue pairs with their peers' side channels, and splits them where the shaper at the other end agrees) | `whole` |
//!
//! With a daemon, `JUSTITIA_RATE` and `JUSTITIA_CHUNK` still win: a rate set here is kept
//! (the daemon's is not followed), and so is a chunk size set here. `JUSTITIA_CONTROL_RATE`
//! only lowers the daemon's control-verb budget: the lower of the two rates applies.
//!
//! A value that does not parse is an error naming the variable; the shaper then falls back
//! to passing everything through (it never aborts the application).

use std::fmt;
use std::path::PathBuf;

use justitia_core::control_verbs::ControlVerbBudget;
use justitia_core::flow::FlowClass;
use justitia_core::profile::DEFAULT_CHUNK_WITH_LATENCY;
use justitia_core::queue_turns::TurnBudget;
use justitia_core::yield_plan::{YieldConfig, DEFAULT_SUB_MESSAGE_BYTES, DEFAULT_YIELD_UNIT_BYTES};

use crate::log::LogLevel;

/// The smallest path MTU (`IBV_MTU_256`): chunks are floored at their QP's path MTU.
pub const MIN_CHUNK_BYTES: u32 = 256;

/// The lowest `JUSTITIA_RATE` in bytes per second: below it a single 64 KiB chunk would wait
/// over a minute, which is a stalled flow, not a paced one (and far lower rates are typos).
pub const MIN_BYTES_PER_SEC: f64 = 1e3;

/// The lowest `JUSTITIA_RATE` in operations per second, for the same reason.
pub const MIN_OPS_PER_SEC: f64 = 1.0;

/// How each queue pair's class is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClassSetting {
    /// Every QP has this class.
    Fixed(FlowClass),
    /// The core classifier infers each QP's class from its traffic.
    Auto,
}

/// What the shaper does to bandwidth flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Split into chunks and pace them with the rate pacer (Justitia).
    Justitia,
    /// Split into sub-messages with zero-length WRITE yields between them, unpaced (PeRF).
    Preempt,
    /// Split into chunks and pace them at the allotments of a `justitiad` running
    /// `policy = "adaptive"` (the chunk and rate its law plans); enforced as `Justitia`
    /// is, so without a daemon it is `Justitia` on the static settings.
    Adaptive,
}

/// Whether the shaper follows `justitiad`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DaemonSetting {
    /// Never: settings come from the environment only.
    Off,
    /// When a daemon answers at the socket; silently static when none does.
    Auto,
    /// As `Auto`, but a daemon that does not answer is said on stderr (once): the user
    /// asked for one.
    On,
}

/// A pacing rate: bytes per second, and optionally operations per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Bytes per second; finite and positive.
    pub bytes_per_sec: f64,
    /// Work requests per second; finite and positive when set.
    pub ops_per_sec: Option<f64>,
}

/// The shaper's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `None`: observe and count only.
    pub class: Option<ClassSetting>,
    /// Policy for bandwidth flows.
    pub policy: Policy,
    /// Largest chunk of a split request, in bytes (at least 1).
    pub chunk_bytes: u32,
    /// `None`: unpaced.
    pub rate: Option<Rate>,
    /// Sub-message size and yield unit for `preempt`.
    pub yields: YieldConfig,
    /// Where to write the counters at exit.
    pub stats_path: Option<PathBuf>,
    /// How much to say on stderr.
    pub log: LogLevel,
    /// Whether to follow `justitiad`.
    pub daemon: DaemonSetting,
    /// `justitiad`'s registration socket.
    pub socket: PathBuf,
    /// `JUSTITIA_CHUNK` was given: the daemon's chunk size is not followed.
    pub chunk_set: bool,
    /// `JUSTITIA_CONTROL_RATE`: the process's own control-verb budget (`None`: the
    /// daemon's, or unpaced).
    pub control_rate: Option<ControlVerbBudget>,
    /// `JUSTITIA_QP_TURNS`: turns among the process's shaped QPs (`None`: every QP posts
    /// when it has something to).
    pub qp_turns: Option<TurnBudget>,
    /// `JUSTITIA_TWO_SIDED`: whether two-sided requests may be split.
    pub two_sided: TwoSided,
}

/// What the shaper does with requests that consume a receive at the peer (SEND, SEND with
/// immediate, WRITE with immediate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TwoSided {
    /// They go as posted, whole.
    Whole,
    /// The process keeps a side channel on each port its RC queue pairs use, has the
    /// daemon pair each queue pair with the side channel at its other end
    /// ([`crate::pairing`]), and splits these requests where the shaper there agrees
    /// ([`crate::engine::two_sided`]). Needs a followed daemon.
    Split,
}

impl Default for Config {
    /// Observe and count only.
    fn default() -> Self {
        Config {
            class: None,
            policy: Policy::Justitia,
            chunk_bytes: DEFAULT_CHUNK_WITH_LATENCY,
            rate: None,
            yields: YieldConfig {
                sub_message_bytes: DEFAULT_SUB_MESSAGE_BYTES,
                yield_unit_bytes: DEFAULT_YIELD_UNIT_BYTES,
            },
            stats_path: None,
            log: LogLevel::Warn,
            daemon: DaemonSetting::Auto,
            socket: PathBuf::from(justitia_agent::client::DEFAULT_SOCKET),
            chunk_set: false,
            control_rate: None,
            qp_turns: None,
            two_sided: TwoSided::Whole,
        }
    }
}

/// A variable whose value does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{var}=`{value}` is not valid: {reason}")]
pub struct ConfigError {
    /// The variable's name.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What was expected.
    pub reason: String,
}

impl Config {
    /// Reads the settings through `lookup` (the environment, or a table in tests). An empty
    /// value counts as unset.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let get = |var: &'static str| {
            lookup(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .map(|v| (var, v))
        };
        let mut config = Config::default();
        if let Some((var, v)) = get("JUSTITIA_LOG") {
            config.log = v
                .parse()
                .map_err(|()| error(var, &v, "expected off, warn, info or debug"))?;
        }
        config.stats_path = get("JUSTITIA_STATS").map(|(_, v)| PathBuf::from(v));
        // The application's own class first; the deployment's default only without one.
        if let Some((var, v)) = get("JUSTITIA_CLASS").or_else(|| get("JUSTITIA_DEFAULT_CLASS")) {
            config.class = Some(match v.to_ascii_lowercase().as_str() {
                "auto" => ClassSetting::Auto,
                other => ClassSetting::Fixed(other.parse().map_err(|_| {
                    error(var, &v, "expected latency, throughput, bandwidth or auto")
                })?),
            });
        }
        if let Some((var, v)) = get("JUSTITIA_POLICY") {
            config.policy = match v.to_ascii_lowercase().as_str() {
                "justitia" => Policy::Justitia,
                "preempt" => Policy::Preempt,
                "adaptive" => Policy::Adaptive,
                _ => return Err(error(var, &v, "expected justitia, adaptive or preempt")),
            };
        }
        if let Some((var, v)) = get("JUSTITIA_CHUNK") {
            config.chunk_bytes = parse_binary_size(&v).ok_or_else(|| {
                error(
                    var,
                    &v,
                    "expected a size in bytes from 1 to 4G-1, e.g. 5120 or 64K",
                )
            })?;
            config.chunk_set = true;
        }
        if let Some((_, v)) = get("JUSTITIA_SOCKET") {
            config.socket = PathBuf::from(v);
            config.daemon = DaemonSetting::On;
        }
        if let Some((var, v)) = get("JUSTITIA_DAEMON") {
            config.daemon = match v.to_ascii_lowercase().as_str() {
                "off" => DaemonSetting::Off,
                "auto" => DaemonSetting::Auto,
                "on" => DaemonSetting::On,
                _ => return Err(error(var, &v, "expected auto, on or off")),
            };
        }
        if let Some((var, v)) = get("JUSTITIA_RATE") {
            let rate = parse_rate(&v).ok_or_else(|| {
                error(var, &v, "expected <bytes/s>[:<ops/s>], e.g. 20M or 20M:50K")
            })?;
            if rate.bytes_per_sec < MIN_BYTES_PER_SEC
                || rate.ops_per_sec.is_some_and(|o| o < MIN_OPS_PER_SEC)
            {
                return Err(error(
                    var,
                    &v,
                    "expected at least 1K bytes/s and 1 op/s, e.g. 20M or 20M:50K",
                ));
            }
            config.rate = Some(rate);
        }
        if let Some((var, v)) = get("JUSTITIA_CONTROL_RATE") {
            config.control_rate = Some(parse_control_rate(&v).ok_or_else(|| {
                error(
                    var,
                    &v,
                    "expected <verbs/s>[:<burst>], at least 1 verb/s and a burst from 1 to 65536, e.g. 500 or 2K:64",
                )
            })?);
        }
        if let Some((var, v)) = get("JUSTITIA_QP_TURNS") {
            config.qp_turns = Some(parse_qp_turns(&v).ok_or_else(|| {
                error(
                    var,
                    &v,
                    "expected <QPs>[:<turn bytes>], at least 1 QP, e.g. 4 or 8:1M",
                )
            })?);
        }
        if let Some((var, v)) = get("JUSTITIA_TWO_SIDED") {
            config.two_sided = match v.to_ascii_lowercase().as_str() {
                "whole" => TwoSided::Whole,
                "split" => TwoSided::Split,
                _ => return Err(error(var, &v, "expected whole or split")),
            };
        }
        if let Some((var, v)) = get("JUSTITIA_SUBMSG") {
            config.yields.sub_message_bytes = parse_binary_size(&v)
                .ok_or_else(|| error(var, &v, "expected a size in bytes, e.g. 16K"))?;
        }
        if let Some((var, v)) = get("JUSTITIA_YIELD_UNIT") {
            config.yields.yield_unit_bytes = parse_binary_size(&v)
                .ok_or_else(|| error(var, &v, "expected a size in bytes, e.g. 1K"))?;
        }
        if let Err(e) = config.yields.validate() {
            let v = format!(
                "{}/{}",
                config.yields.sub_message_bytes, config.yields.yield_unit_bytes
            );
            return Err(error("JUSTITIA_YIELD_UNIT", &v, &e.to_string()));
        }
        Ok(config)
    }

    /// Settings that are valid but do not do what they may seem to, one line each, to be
    /// said when the shaper starts.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.chunk_bytes < MIN_CHUNK_BYTES {
            notes.push(format!(
                "JUSTITIA_CHUNK={} is below the smallest path MTU; chunks are never smaller than their QP's path MTU",
                self.chunk_bytes
            ));
        }
        if self.policy == Policy::Preempt && self.rate.is_some() {
            notes.push(
                "JUSTITIA_RATE has no effect with JUSTITIA_POLICY=preempt, which yields instead of pacing"
                    .to_string(),
            );
        }
        if self.two_sided == TwoSided::Split && self.daemon == DaemonSetting::Off {
            notes.push(
                "JUSTITIA_TWO_SIDED=split has no effect with JUSTITIA_DAEMON=off: the daemons pair the side channels"
                    .to_string(),
            );
        }
        notes
    }

    /// The stats path with `%p` replaced by `pid`, so that the two sides of a test (or any
    /// processes sharing one environment) write separate files.
    pub fn stats_path_for(&self, pid: u32) -> Option<PathBuf> {
        self.stats_path
            .as_ref()
            .map(|p| PathBuf::from(p.to_string_lossy().replace("%p", &pid.to_string())))
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.class {
            None => write!(f, "class unset (observe only)")?,
            Some(ClassSetting::Auto) => write!(f, "class auto")?,
            Some(ClassSetting::Fixed(c)) => write!(f, "class {c}")?,
        }
        write!(
            f,
            ", policy {:?}, chunk {} B",
            self.policy, self.chunk_bytes
        )?;
        match self.rate {
            None => write!(f, ", unpaced")?,
            Some(r) => {
                write!(f, ", rate {} B/s", r.bytes_per_sec)?;
                if let Some(ops) = r.ops_per_sec {
                    write!(f, " and {ops} ops/s")?;
                }
            }
        }
        if let Some(c) = self.control_rate {
            write!(f, ", control verbs at {}/s (burst {})", c.per_sec, c.burst)?;
        }
        if let Some(t) = self.qp_turns {
            write!(
                f,
                ", {} QPs post at a time ({} B a turn)",
                t.open, t.turn_bytes
            )?;
        }
        write!(
            f,
            ", sub-message {} B, yield unit {} B",
            self.yields.sub_message_bytes, self.yields.yield_unit_bytes
        )?;
        match self.daemon {
            DaemonSetting::Off => write!(f, ", daemon off"),
            DaemonSetting::Auto | DaemonSetting::On => {
                write!(f, ", daemon at {}", self.socket.display())
            }
        }
    }
}

fn error(var: &'static str, value: &str, reason: &str) -> ConfigError {
    ConfigError {
        var,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// `123`, `64K`, `1M` (binary multiples), as a positive `u32`.
fn parse_binary_size(text: &str) -> Option<u32> {
    let t = text.trim();
    let (digits, mult) = match t.char_indices().last()? {
        (i, 'k' | 'K') => (&t[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&t[..i], 1 << 20),
        (i, 'g' | 'G') => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = digits.trim().parse().ok()?;
    let bytes = n.checked_mul(mult)?;
    u32::try_from(bytes).ok().filter(|&b| b > 0)
}

/// The burst of `JUSTITIA_CONTROL_RATE` when it names none: verbs an application may
/// issue back to back, enough for one that registers its buffers at start-up.
pub const DEFAULT_CONTROL_BURST: u32 = 16;

/// The largest control-verb burst `JUSTITIA_CONTROL_RATE` admits.
pub const MAX_CONTROL_BURST: u32 = 65_536;

/// `500`, `2K:64`: verbs per second (at least 1) and an optional burst (1 to
/// [`MAX_CONTROL_BURST`], else [`DEFAULT_CONTROL_BURST`]).
fn parse_control_rate(text: &str) -> Option<ControlVerbBudget> {
    let (rate, burst) = match text.split_once(':') {
        Some((r, b)) => (r, b.trim().parse::<u32>().ok()?),
        None => (text, DEFAULT_CONTROL_BURST),
    };
    let per_sec = parse_decimal_rate(rate)?;
    (per_sec >= 1.0 && (1..=MAX_CONTROL_BURST).contains(&burst))
        .then_some(ControlVerbBudget { per_sec, burst })
}

/// The bytes of a turn of `JUSTITIA_QP_TURNS` when it names none: a few milliseconds of a
/// 25 to 100 Gb/s link, so that the RNIC reads a QP's context once per several
/// milliseconds, not once per message.
pub const DEFAULT_TURN_BYTES: u32 = 8 << 20;

/// `4`, `8:1M`: QPs that post at once (at least 1) and an optional turn in bytes (binary
/// suffixes, else [`DEFAULT_TURN_BYTES`]).
fn parse_qp_turns(text: &str) -> Option<TurnBudget> {
    let (open, turn) = match text.split_once(':') {
        Some((o, t)) => (o, parse_binary_size(t)?),
        None => (text, DEFAULT_TURN_BYTES),
    };
    let open: usize = open.trim().parse().ok()?;
    (open >= 1).then_some(TurnBudget {
        open,
        turn_bytes: u64::from(turn),
    })
}

/// `20M`, `1.5G`, `500` (decimal multiples), as a finite positive number.
fn parse_decimal_rate(text: &str) -> Option<f64> {
    let t = text.trim();
    let (digits, mult) = match t.char_indices().last()? {
        (i, 'k' | 'K') => (&t[..i], 1e3),
        (i, 'm' | 'M') => (&t[..i], 1e6),
        (i, 'g' | 'G') => (&t[..i], 1e9),
        _ => (t, 1.0),
    };
    let n: f64 = digits.trim().parse().ok()?;
    let v = n * mult;
    (v.is_finite() && v > 0.0).then_some(v)
}

/// `<bytes/s>[:<ops/s>]`.
fn parse_rate(text: &str) -> Option<Rate> {
    let (bytes, ops) = match text.split_once(':') {
        Some((b, o)) => (b, Some(parse_decimal_rate(o)?)),
        None => (text, None),
    };
    Some(Rate {
        bytes_per_sec: parse_decimal_rate(bytes)?,
        ops_per_sec: ops,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn nothing_set_is_observe_only_with_paper_defaults() {
        let c = parse(&[]).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.class, None);
        assert_eq!(c.chunk_bytes, 5 * 1024);
        assert_eq!(c.yields.sub_message_bytes, 16 * 1024);
        assert_eq!(c.yields.yield_unit_bytes, 1024);
        assert_eq!(c.log, LogLevel::Warn);
    }

    #[test]
    fn the_applications_class_wins_over_the_injected_default() {
        let class = |vars: &[(&str, &str)]| parse(vars).map(|c| c.class);
        let bandwidth = Some(ClassSetting::Fixed(FlowClass::Bandwidth));
        let latency = Some(ClassSetting::Fixed(FlowClass::Latency));
        assert_eq!(
            class(&[("JUSTITIA_DEFAULT_CLASS", "bandwidth")]),
            Ok(bandwidth)
        );
        assert_eq!(
            class(&[
                ("JUSTITIA_DEFAULT_CLASS", "bandwidth"),
                ("JUSTITIA_CLASS", "latency")
            ]),
            Ok(latency)
        );
        // Set but empty is unset, as for every variable.
        assert_eq!(
            class(&[
                ("JUSTITIA_DEFAULT_CLASS", "bandwidth"),
                ("JUSTITIA_CLASS", "")
            ]),
            Ok(bandwidth)
        );
        // A bad default is named as such: the deployment's mistake, not the application's.
        assert_eq!(
            class(&[("JUSTITIA_DEFAULT_CLASS", "elephant")]).map_err(|e| e.var),
            Err("JUSTITIA_DEFAULT_CLASS")
        );
    }

    #[test]
    fn every_variable_parses() {
        let c = parse(&[
            ("JUSTITIA_CLASS", "bandwidth"),
            ("JUSTITIA_POLICY", "preempt"),
            ("JUSTITIA_CHUNK", "64K"),
            ("JUSTITIA_RATE", "20M:50K"),
            ("JUSTITIA_SUBMSG", "32K"),
            ("JUSTITIA_YIELD_UNIT", "2K"),
            ("JUSTITIA_STATS", "/tmp/s-%p.json"),
            ("JUSTITIA_LOG", "debug"),
        ])
        .unwrap();
        assert_eq!(c.class, Some(ClassSetting::Fixed(FlowClass::Bandwidth)));
        assert_eq!(c.policy, Policy::Preempt);
        assert_eq!(c.chunk_bytes, 65_536);
        assert_eq!(
            c.rate,
            Some(Rate {
                bytes_per_sec: 20e6,
                ops_per_sec: Some(50e3)
            })
        );
        assert_eq!(c.yields.sub_message_bytes, 32 * 1024);
        assert_eq!(c.yields.yield_unit_bytes, 2048);
        assert_eq!(c.stats_path_for(42), Some(PathBuf::from("/tmp/s-42.json")));
        assert_eq!(c.log, LogLevel::Debug);
        assert_eq!(
            parse(&[("JUSTITIA_CLASS", "AUTO")]).unwrap().class,
            Some(ClassSetting::Auto)
        );
        assert_eq!(
            parse(&[("JUSTITIA_RATE", "1.5G")]).unwrap().rate,
            Some(Rate {
                bytes_per_sec: 1.5e9,
                ops_per_sec: None
            })
        );
    }

    /// Issue 10, item 9: `JUSTITIA_CHUNK=1` and a rate under `preempt` were accepted
    /// silently.
    #[test]
    fn a_chunk_below_the_mtu_and_a_rate_under_preempt_are_said() {
        let notes = parse(&[("JUSTITIA_CHUNK", "1")]).unwrap().notes();
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("JUSTITIA_CHUNK=1"), "{notes:?}");
        let notes = parse(&[("JUSTITIA_POLICY", "preempt"), ("JUSTITIA_RATE", "20M")])
            .unwrap()
            .notes();
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("JUSTITIA_RATE"), "{notes:?}");
        assert!(
            parse(&[("JUSTITIA_CHUNK", "64K"), ("JUSTITIA_RATE", "20M")])
                .unwrap()
                .notes()
                .is_empty()
        );
    }

    #[test]
    fn the_daemon_is_followed_at_its_default_socket_unless_turned_off() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.daemon, DaemonSetting::Auto);
        assert_eq!(c.socket, PathBuf::from("/run/justitia/justitiad.sock"));
        assert!(!c.chunk_set);
        // Naming a socket asks for the daemon: its absence is then said.
        let c = parse(&[("JUSTITIA_SOCKET", "/tmp/j.sock")]).unwrap();
        assert_eq!(
            (c.daemon, c.socket),
            (DaemonSetting::On, PathBuf::from("/tmp/j.sock"))
        );
        let c = parse(&[
            ("JUSTITIA_SOCKET", "/tmp/j.sock"),
            ("JUSTITIA_DAEMON", "OFF"),
        ])
        .unwrap();
        assert_eq!(c.daemon, DaemonSetting::Off);
        assert_eq!(
            parse(&[("JUSTITIA_DAEMON", "on")]).unwrap().daemon,
            DaemonSetting::On
        );
        assert!(parse(&[("JUSTITIA_CHUNK", "64K")]).unwrap().chunk_set);
    }

    #[test]
    fn adaptive_is_a_policy_and_an_unknown_one_is_refused_by_name() {
        let c = parse(&[("JUSTITIA_POLICY", "Adaptive")]).unwrap();
        assert_eq!(c.policy, Policy::Adaptive);
        let err = parse(&[("JUSTITIA_POLICY", "perf")]).unwrap_err();
        assert!(
            err.to_string().contains("justitia, adaptive or preempt"),
            "{err}"
        );
    }

    #[test]
    fn two_sided_requests_go_whole_unless_split_is_asked_for_under_a_daemon() {
        assert_eq!(parse(&[]).unwrap().two_sided, TwoSided::Whole);
        let split = parse(&[("JUSTITIA_TWO_SIDED", "Split")]).unwrap();
        assert_eq!(split.two_sided, TwoSided::Split);
        assert!(split.notes().is_empty());
        let off = parse(&[("JUSTITIA_TWO_SIDED", "split"), ("JUSTITIA_DAEMON", "off")]).unwrap();
        assert!(off.notes().iter().any(|n| n.contains("JUSTITIA_TWO_SIDED")));
    }

    #[test]
    fn bad_values_name_their_variable() {
        let cases = [
            ("JUSTITIA_CLASS", "elephant"),
            ("JUSTITIA_POLICY", "fast"),
            ("JUSTITIA_CHUNK", "0"),
            ("JUSTITIA_CHUNK", "64Q"),
            ("JUSTITIA_CHUNK", "8G"),
            ("JUSTITIA_QP_TURNS", "0"),
            ("JUSTITIA_QP_TURNS", "4:0"),
            ("JUSTITIA_QP_TURNS", "four"),
            ("JUSTITIA_RATE", "-5M"),
            ("JUSTITIA_RATE", "20M:"),
            ("JUSTITIA_RATE", "inf"),
            ("JUSTITIA_RATE", "1e-12"),
            ("JUSTITIA_RATE", "999"),
            ("JUSTITIA_RATE", "20M:0.5"),
            ("JUSTITIA_SUBMSG", "x"),
            ("JUSTITIA_YIELD_UNIT", "1"),
            ("JUSTITIA_LOG", "loud"),
            ("JUSTITIA_DAEMON", "maybe"),
            ("JUSTITIA_CONTROL_RATE", "0.5"),
            ("JUSTITIA_CONTROL_RATE", "500:0"),
            ("JUSTITIA_CONTROL_RATE", "500:65537"),
            ("JUSTITIA_CONTROL_RATE", "500:x"),
            ("JUSTITIA_CONTROL_RATE", "fast"),
            ("JUSTITIA_TWO_SIDED", "halves"),
        ];
        for (var, value) in cases {
            let err = parse(&[(var, value)]).unwrap_err();
            assert_eq!(err.var, var, "{var}={value}");
            let text = err.to_string();
            assert!(text.contains(var) && text.contains(value), "{text}");
            assert!(!text.contains('\n'), "{text}");
        }
    }

    #[test]
    fn the_lowest_rates_accepted_are_1k_bytes_and_1_op_per_second() {
        assert_eq!(
            parse(&[("JUSTITIA_RATE", "1K:1")]).unwrap().rate,
            Some(Rate {
                bytes_per_sec: 1e3,
                ops_per_sec: Some(1.0)
            })
        );
        let err = parse(&[("JUSTITIA_RATE", "1e-12")]).unwrap_err();
        assert!(err.to_string().contains("1K bytes/s"), "{err}");
    }

    #[test]
    fn the_control_rate_takes_a_burst_or_the_default_one() {
        let budget = |v: &str| parse(&[("JUSTITIA_CONTROL_RATE", v)]).unwrap().control_rate;
        assert_eq!(
            budget("500"),
            Some(ControlVerbBudget {
                per_sec: 500.0,
                burst: DEFAULT_CONTROL_BURST
            })
        );
        assert_eq!(
            budget("2K:64"),
            Some(ControlVerbBudget {
                per_sec: 2000.0,
                burst: 64
            })
        );
        assert_eq!(budget("1:65536").map(|b| b.burst), Some(65_536));
    }

    #[test]
    fn qp_turns_take_a_turn_or_the_default_one() {
        let turns = |v: &str| parse(&[("JUSTITIA_QP_TURNS", v)]).unwrap().qp_turns;
        assert_eq!(
            turns("4"),
            Some(TurnBudget {
                open: 4,
                turn_bytes: 8 << 20
            })
        );
        assert_eq!(
            turns("2:256K"),
            Some(TurnBudget {
                open: 2,
                turn_bytes: 256 << 10
            })
        );
    }

    #[test]
    fn empty_values_count_as_unset() {
        assert_eq!(
            parse(&[("JUSTITIA_CLASS", " "), ("JUSTITIA_RATE", "")]).unwrap(),
            Config::default()
        );
    }
}
