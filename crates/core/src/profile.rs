//! RNIC profiles: the per-device constants the policy needs.
//!
//! Justitia pre-determines, per RNIC model, the application-level line rate (MaxRate) and
//! the highest message rate (MaxTput) with benchmark flows (§4.2.2), and keeps a small
//! dictionary of chunk sizes (§5.1): 1 MB when no latency-sensitive flow is present, and
//! the smallest chunk that still saturates most of the line rate otherwise (5 KB by
//! default). A profile carries exactly these; models of the RNIC's internals (used by the
//! simulator) live elsewhere.
//!
//! Profiles are built in for the hardware of the papers' measurements
//! ([`RnicProfile::builtin`]) and can be loaded from TOML ([`RnicProfile::from_toml`]):
//!
//! ```toml
//! name = "IB-56"
//! max_rate_gbps = 48.0        # application-level bytes on the wire, Gb/s
//! max_tput_mops = 30.0        # million operations per second
//! mtu = 4096                  # bytes
//! chunk_bytes_with_latency = 5120
//! chunk_bytes_without_latency = 1048576
//! ```
//!
//! Invariants of a valid profile: rates are finite and positive; the MTU is a power of two
//! between 256 and 4096 (the RDMA path MTUs); chunk sizes are positive and the chunk used
//! with latency flows is no larger than the one used without.

use serde::{Deserialize, Serialize};

/// Bytes in one kibibyte.
pub const KIB: u32 = 1024;
/// Bytes in one mebibyte.
pub const MIB: u32 = 1024 * 1024;

/// The chunk size used while latency-sensitive flows are present (§5.1: 5 KB).
pub const DEFAULT_CHUNK_WITH_LATENCY: u32 = 5 * KIB;
/// The chunk size used while no latency-sensitive flow is present (§5.1: 1 MB).
pub const DEFAULT_CHUNK_WITHOUT_LATENCY: u32 = MIB;

/// What the policy knows about one RNIC model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RnicProfile {
    /// A short name, e.g. `IB-56`.
    pub name: String,
    /// MaxRate: the application-level bandwidth the RNIC sustains, in Gb/s (10^9 bits/s).
    pub max_rate_gbps: f64,
    /// MaxTput: the highest message rate the RNIC sustains, in millions of operations/s.
    pub max_tput_mops: f64,
    /// Path MTU in bytes.
    pub mtu: u32,
    /// Chunk size in bytes while latency-sensitive flows are present.
    #[serde(default = "default_chunk_with_latency")]
    pub chunk_bytes_with_latency: u32,
    /// Chunk size in bytes while no latency-sensitive flow is present.
    #[serde(default = "default_chunk_without_latency")]
    pub chunk_bytes_without_latency: u32,
}

fn default_chunk_with_latency() -> u32 {
    DEFAULT_CHUNK_WITH_LATENCY
}

fn default_chunk_without_latency() -> u32 {
    DEFAULT_CHUNK_WITHOUT_LATENCY
}

/// Why a profile was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// The TOML text did not parse or had a field of the wrong type.
    #[error("RNIC profile: {0}")]
    Parse(String),
    /// A field parsed but its value is out of range.
    #[error("RNIC profile `{profile}`: field `{field}` {reason}")]
    Invalid {
        /// The profile's name.
        profile: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No built-in profile has that name.
    #[error("no built-in RNIC profile named `{0}` (known: {known})", known = RnicProfile::BUILTIN_NAMES.join(", "))]
    UnknownBuiltin(String),
}

/// The profile files of `profiles/`, compiled in: `(name, TOML text)`, in the order of
/// [`RnicProfile::BUILTIN_NAMES`]. A file's `[policy]` table is the policy's view of the RNIC
/// ([`RnicProfile`]); its other tables model the hardware for the simulator. Compiling the
/// files in keeps one source for both and lets every tool work from any directory.
pub const BUILTIN_PROFILE_FILES: [(&str, &str); 8] = [
    ("IB-56", include_str!("../../../profiles/ib-56.toml")),
    ("RoCE-40", include_str!("../../../profiles/roce-40.toml")),
    ("RoCE-10", include_str!("../../../profiles/roce-10.toml")),
    ("IB-100", include_str!("../../../profiles/ib-100.toml")),
    ("RoCE-100", include_str!("../../../profiles/roce-100.toml")),
    (
        "IB-56-switch",
        include_str!("../../../profiles/ib-56-switch.toml"),
    ),
    (
        "RoCE-100-switch",
        include_str!("../../../profiles/roce-100-switch.toml"),
    ),
    (
        "SoftRoCE-wire",
        include_str!("../../../profiles/softroce-wire.toml"),
    ),
];

/// The wire bytes of the packets a host's messages make another host send back or this
/// one send besides their payload ([`RnicFacts::packets`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketBytes {
    /// An acknowledgement: the responder sends one for each message a requester WRITEs
    /// or SENDs to it (`ack_bytes`).
    pub ack: u32,
    /// A READ request: one header-only packet with a RETH, which the requester sends
    /// (`header_bytes + first_packet_extra_bytes`).
    pub read_request: u32,
}

/// What a built-in profile's model tables (`[link]`, `[pcie]`, `[rnic]`) say of the wire
/// and of the RNIC's hidden resources, beyond what its `[policy]` table ([`RnicProfile`])
/// gives the policy: the figures the `adaptive` law charges by
/// ([`AdaptiveConfig::for_model`](crate::adaptive::AdaptiveConfig::for_model)), read from
/// the same file the simulator's model is built from, so that a daemon and the simulator
/// plan with the same numbers. Each figure's source is stated beside it in the file.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RnicFacts {
    /// The link's rate, Gb/s of wire bytes (`[link] gbps`).
    pub wire_gbps: f64,
    /// Wire bytes every packet carries besides its payload (`[link] header_bytes`).
    pub header_bytes: u32,
    /// Wire bytes the first packet of a request carries besides those, a RETH
    /// (`[link] first_packet_extra_bytes`).
    pub first_packet_extra_bytes: u32,
    /// An acknowledgement's wire bytes (`[link] ack_bytes`).
    pub ack_bytes: u32,
    /// A DMA read of host memory, ns (`[pcie] read_latency_ns`): what a context or
    /// translation entry the RNIC does not hold costs to fetch.
    pub pcie_read_latency_ns: f64,
    /// The units the RNIC starts messages on (`[rnic] processing_units`).
    pub processing_units: u32,
    /// Millions of messages/s one queue pair sustains (`[rnic] qp_mops`).
    pub qp_mops: f64,
    /// QP contexts the RNIC caches; 0: not bounded (`[rnic] qp_cache_entries`).
    pub qp_cache_entries: u32,
    /// MPT entries (one per memory region) it caches; 0: not bounded.
    pub mpt_cache_entries: u32,
    /// MTT entries (one per page) it caches; 0: not bounded.
    pub mtt_cache_entries: u32,
    /// What a translation entry it does not cache holds a unit for, ns; 0: not modelled.
    pub translation_miss_ns: f64,
}

impl RnicFacts {
    /// The facts of the built-in profile of that name (as [`builtin_profile_text`] finds
    /// it); `None` when there is no such profile or its tables lack a figure the model
    /// requires (the cache sizes and the miss cost may be absent: not bounded).
    pub fn builtin(name: &str) -> Option<RnicFacts> {
        #[derive(Deserialize)]
        struct Link {
            gbps: f64,
            header_bytes: u32,
            #[serde(default)]
            first_packet_extra_bytes: u32,
            ack_bytes: u32,
        }
        #[derive(Deserialize)]
        struct Pcie {
            read_latency_ns: f64,
        }
        #[derive(Deserialize)]
        struct Rnic {
            processing_units: u32,
            qp_mops: f64,
            #[serde(default)]
            qp_cache_entries: u32,
            #[serde(default)]
            mpt_cache_entries: u32,
            #[serde(default)]
            mtt_cache_entries: u32,
            #[serde(default)]
            translation_miss_ns: f64,
        }
        #[derive(Deserialize)]
        struct File {
            link: Link,
            pcie: Pcie,
            rnic: Rnic,
        }
        let (_, text) = builtin_profile_text(name)?;
        let file: File = toml::from_str(text).ok()?;
        Some(RnicFacts {
            wire_gbps: file.link.gbps,
            header_bytes: file.link.header_bytes,
            first_packet_extra_bytes: file.link.first_packet_extra_bytes,
            ack_bytes: file.link.ack_bytes,
            pcie_read_latency_ns: file.pcie.read_latency_ns,
            processing_units: file.rnic.processing_units,
            qp_mops: file.rnic.qp_mops,
            qp_cache_entries: file.rnic.qp_cache_entries,
            mpt_cache_entries: file.rnic.mpt_cache_entries,
            mtt_cache_entries: file.rnic.mtt_cache_entries,
            translation_miss_ns: file.rnic.translation_miss_ns,
        })
    }

    /// The sizes of the packets the reverse load counts.
    pub fn packets(&self) -> PacketBytes {
        PacketBytes {
            ack: self.ack_bytes,
            read_request: self
                .header_bytes
                .saturating_add(self.first_packet_extra_bytes),
        }
    }
}

/// The built-in profile file of that name, case-insensitive (`RoCE-10-DCQCN` names
/// `RoCE-10`, the same testbed): its canonical name and TOML text.
pub fn builtin_profile_text(name: &str) -> Option<(&'static str, &'static str)> {
    let name = name.trim();
    let name = if name.eq_ignore_ascii_case("RoCE-10-DCQCN") {
        "RoCE-10"
    } else {
        name
    };
    BUILTIN_PROFILE_FILES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .copied()
}

impl RnicProfile {
    /// Names of the built-in profiles: the hardware of `validation-targets.md`, in its order,
    /// RPerf's switched testbed, and the RoCE-100 hosts on a switch with PFC.
    pub const BUILTIN_NAMES: [&'static str; 8] = [
        "IB-56",
        "RoCE-40",
        "RoCE-10",
        "IB-100",
        "RoCE-100",
        "IB-56-switch",
        "RoCE-100-switch",
        "SoftRoCE-wire",
    ];

    /// A built-in profile by name (case-insensitive; `RoCE-10-DCQCN` is `RoCE-10`): the
    /// `[policy]` table of its file in `profiles/` (see [`builtin_profile_text`]), where each
    /// figure names the measurement it comes from.
    pub fn builtin(name: &str) -> Result<Self, ProfileError> {
        let (canonical, text) = builtin_profile_text(name)
            .ok_or_else(|| ProfileError::UnknownBuiltin(name.to_string()))?;
        let broken =
            |reason: String| ProfileError::Parse(format!("built-in {canonical}: {reason}"));
        let mut file: toml::Table = toml::from_str(text).map_err(|e| broken(e.to_string()))?;
        let policy = file
            .remove("policy")
            .ok_or_else(|| broken("no [policy] table".to_string()))?;
        let profile: RnicProfile = policy
            .try_into()
            .map_err(|e: toml::de::Error| broken(e.to_string()))?;
        profile.validate()?;
        Ok(profile)
    }

    /// All built-in profiles.
    pub fn builtins() -> Vec<Self> {
        Self::BUILTIN_NAMES
            .iter()
            .filter_map(|n| Self::builtin(n).ok())
            .collect()
    }

    /// Parses and validates a profile from TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ProfileError> {
        let profile: RnicProfile = toml::from_str(text)
            .map_err(|e| ProfileError::Parse(e.to_string().trim().to_string()))?;
        profile.validate()?;
        Ok(profile)
    }

    /// Checks the invariants listed in the module documentation.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let invalid = |field: &'static str, reason: String| ProfileError::Invalid {
            profile: self.name.clone(),
            field,
            reason,
        };
        if self.name.trim().is_empty() {
            return Err(invalid("name", "must not be empty".into()));
        }
        if !(self.max_rate_gbps.is_finite() && self.max_rate_gbps > 0.0) {
            return Err(invalid(
                "max_rate_gbps",
                format!(
                    "must be a positive number of Gb/s, got {}",
                    self.max_rate_gbps
                ),
            ));
        }
        if !(self.max_tput_mops.is_finite() && self.max_tput_mops > 0.0) {
            return Err(invalid(
                "max_tput_mops",
                format!(
                    "must be a positive number of M ops/s, got {}",
                    self.max_tput_mops
                ),
            ));
        }
        if !(self.mtu.is_power_of_two() && (256..=4096).contains(&self.mtu)) {
            return Err(invalid(
                "mtu",
                format!("must be 256, 512, 1024, 2048 or 4096, got {}", self.mtu),
            ));
        }
        if self.chunk_bytes_with_latency == 0 {
            return Err(invalid(
                "chunk_bytes_with_latency",
                "must be positive".into(),
            ));
        }
        if self.chunk_bytes_without_latency < self.chunk_bytes_with_latency {
            return Err(invalid(
                "chunk_bytes_without_latency",
                format!(
                    "({}) must be at least chunk_bytes_with_latency ({})",
                    self.chunk_bytes_without_latency, self.chunk_bytes_with_latency
                ),
            ));
        }
        Ok(())
    }

    /// MaxRate in bytes per second.
    pub fn max_rate_bytes_per_sec(&self) -> f64 {
        self.max_rate_gbps * 1e9 / 8.0
    }

    /// MaxTput in operations per second.
    pub fn max_ops_per_sec(&self) -> f64 {
        self.max_tput_mops * 1e6
    }

    /// Operations that one byte of allotted bandwidth is worth: MaxTput / MaxRate. The
    /// ratio is fixed for an RNIC, which is why the controller reasons in bytes alone
    /// (§4.2.2) and derives operations from bytes.
    pub fn ops_per_byte(&self) -> f64 {
        self.max_ops_per_sec() / self.max_rate_bytes_per_sec()
    }

    /// The chunk size for bandwidth flows, given whether latency flows are present (§5.1).
    pub fn chunk_bytes(&self, latency_flows_present: bool) -> u32 {
        if latency_flows_present {
            self.chunk_bytes_with_latency
        } else {
            self.chunk_bytes_without_latency
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RoCE-100's tables as its file states them: a 100 Gb/s wire, packets of 82 header
    /// bytes and a 16 B RETH, a 600 ns DMA read, 16 units, 13 M messages/s a queue pair,
    /// no bounded cache; so an acknowledgement of 86 wire bytes and a READ request of 82 +
    /// 16. SoftRoCE-wire's, as its bucket counts them: 62 and 58 + 16.
    #[test]
    fn the_facts_come_from_the_profiles_model_tables() {
        let roce = RnicFacts::builtin("roce-100")
            .unwrap_or_else(|| panic!("RoCE-100 has its model tables"));
        assert_eq!(
            roce,
            RnicFacts {
                wire_gbps: 100.0,
                header_bytes: 82,
                first_packet_extra_bytes: 16,
                ack_bytes: 86,
                pcie_read_latency_ns: 600.0,
                processing_units: 16,
                qp_mops: 13.0,
                qp_cache_entries: 0,
                mpt_cache_entries: 0,
                mtt_cache_entries: 0,
                translation_miss_ns: 0.0,
            }
        );
        assert_eq!(
            roce.packets(),
            PacketBytes {
                ack: 86,
                read_request: 98
            }
        );
        let soft =
            RnicFacts::builtin("SoftRoCE-wire").unwrap_or_else(|| panic!("SoftRoCE-wire has them"));
        assert_eq!(
            soft.packets(),
            PacketBytes {
                ack: 62,
                read_request: 74
            }
        );
        assert_eq!(soft.wire_gbps, 0.008);
        assert_eq!(RnicFacts::builtin("roce-7"), None);
    }

    /// The paper's chunk sizes (§5.1): 5 KB beside latency flows, 1 MB without.
    #[test]
    fn the_default_chunks_are_the_papers() {
        assert_eq!(DEFAULT_CHUNK_WITH_LATENCY, 5120);
        assert_eq!(DEFAULT_CHUNK_WITHOUT_LATENCY, 1_048_576);
    }

    #[test]
    fn every_builtin_is_valid() {
        let all = RnicProfile::builtins();
        assert_eq!(all.len(), RnicProfile::BUILTIN_NAMES.len());
        for (p, name) in all.iter().zip(RnicProfile::BUILTIN_NAMES) {
            assert_eq!(
                p.name, name,
                "the file's [policy] name is the name it is built in as"
            );
            assert_eq!(p.validate(), Ok(()), "{}", p.name);
        }
        let files: Vec<&str> = BUILTIN_PROFILE_FILES.iter().map(|(n, _)| *n).collect();
        assert_eq!(files, RnicProfile::BUILTIN_NAMES);
        assert_eq!(
            RnicProfile::builtin("roce-10-dcqcn").map(|p| p.name).ok(),
            Some("RoCE-10".to_string())
        );
    }

    #[test]
    fn builtin_lookup_is_case_insensitive_and_rejects_unknown() {
        assert_eq!(
            RnicProfile::builtin("ib-56").map(|p| p.name).ok(),
            Some("IB-56".to_string())
        );
        let err = RnicProfile::builtin("cx9").err();
        assert!(matches!(err, Some(ProfileError::UnknownBuiltin(_))));
        assert!(err
            .map(|e| e.to_string())
            .unwrap_or_default()
            .contains("RoCE-100"));
    }

    #[test]
    fn ib56_token_ratio_matches_paper_example() {
        // §4.2.3: 48 Gb/s and 30 M ops/s with 1 MB tokens gives about 5000 ops per token.
        let p = RnicProfile::builtin("IB-56").ok();
        let ops = p.map(|p| p.ops_per_byte() * f64::from(MIB)).unwrap_or(0.0);
        assert!(
            (ops - 5000.0).abs() / 5000.0 < 0.06,
            "ops per 1 MB token = {ops}"
        );
    }

    #[test]
    fn chunk_size_depends_on_latency_flows() {
        let p = RnicProfile::builtin("RoCE-100").ok();
        assert_eq!(p.as_ref().map(|p| p.chunk_bytes(true)), Some(5 * KIB));
        assert_eq!(p.as_ref().map(|p| p.chunk_bytes(false)), Some(MIB));
    }

    #[test]
    fn toml_round_trip_and_defaults() {
        let text = "name = \"lab\"\nmax_rate_gbps = 25\nmax_tput_mops = 20\nmtu = 1024\n";
        let p = RnicProfile::from_toml(text);
        assert_eq!(
            p,
            Ok(RnicProfile {
                name: "lab".into(),
                max_rate_gbps: 25.0,
                max_tput_mops: 20.0,
                mtu: 1024,
                chunk_bytes_with_latency: DEFAULT_CHUNK_WITH_LATENCY,
                chunk_bytes_without_latency: DEFAULT_CHUNK_WITHOUT_LATENCY,
            })
        );
    }

    #[test]
    fn bad_values_name_the_field() {
        let cases = [
            ("max_rate_gbps = -1", "max_rate_gbps"),
            ("max_rate_gbps = 0", "max_rate_gbps"),
            ("max_tput_mops = 0", "max_tput_mops"),
            ("mtu = 1500", "mtu"),
            ("chunk_bytes_with_latency = 0", "chunk_bytes_with_latency"),
            (
                "chunk_bytes_without_latency = 100",
                "chunk_bytes_without_latency",
            ),
        ];
        for (line, field) in cases {
            let mut fields = vec![
                ("name", "\"x\"".to_string()),
                ("max_rate_gbps", "10".to_string()),
                ("max_tput_mops", "10".to_string()),
                ("mtu", "1024".to_string()),
            ];
            let (key, value) = line.split_once(" = ").unwrap_or((line, ""));
            fields.retain(|(k, _)| *k != key);
            fields.push((key, value.to_string()));
            let text: String = fields.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
            match RnicProfile::from_toml(&text) {
                Err(ProfileError::Invalid { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{line}: expected an error on {field}, got {other:?}"),
            }
        }
    }

    /// One chunk for both cases is a profile that never changes its chunk: accepted.
    #[test]
    fn equal_chunks_with_and_without_latency_flows_are_accepted() {
        let text = "name = \"x\"\nmax_rate_gbps = 10\nmax_tput_mops = 10\nmtu = 1024\n\
                    chunk_bytes_with_latency = 65536\nchunk_bytes_without_latency = 65536\n";
        let p = RnicProfile::from_toml(text);
        assert_eq!(p.map(|p| p.chunk_bytes(true)), Ok(65536));
    }

    #[test]
    fn unknown_and_mistyped_fields_are_parse_errors() {
        let text =
            "name = \"x\"\nmax_rate_gbps = 10\nmax_tput_mops = 10\nmtu = 1024\nmax_rate = 3\n";
        let err = RnicProfile::from_toml(text)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("max_rate"), "{err}");
        let text = "name = \"x\"\nmax_rate_gbps = \"fast\"\nmax_tput_mops = 10\nmtu = 1024\n";
        let err = RnicProfile::from_toml(text);
        assert!(matches!(err, Err(ProfileError::Parse(_))), "{err:?}");
        let message = err.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("max_rate_gbps"), "{message}");
        assert!(message.contains("line 2"), "{message}");
    }
}
