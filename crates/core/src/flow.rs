//! The flow model: what kind of traffic a queue pair carries and who owns it.
//!
//! Justitia (§2.1) sorts flows by what they care about. A *latency-sensitive* flow sends
//! small messages and cares about each one's completion time; a *throughput-sensitive* flow
//! sends batches of small messages and cares about messages per second; a
//! *bandwidth-sensitive* flow sends large messages and cares about bytes per second. The
//! latter two are *resource-hungry*: they are the ones Justitia shapes (§3).
//!
//! Flows belong to tenants. Flows of one tenant count as one logical flow when shares are
//! computed, so an application cannot win a larger share by opening more queue pairs
//! (the anomaly N7 of the validation targets).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The class of a flow, which decides how the shaper treats it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlowClass {
    /// Small messages where each completion time matters; never shaped.
    Latency,
    /// Batches of small messages where the message rate matters; paced by operations.
    Throughput,
    /// Large messages where bytes per second matter; split into chunks and paced by bytes.
    Bandwidth,
}

impl FlowClass {
    /// All classes, in a fixed order.
    pub const ALL: [FlowClass; 3] = [
        FlowClass::Latency,
        FlowClass::Throughput,
        FlowClass::Bandwidth,
    ];

    /// True for the classes Justitia shapes (throughput and bandwidth).
    pub fn is_resource_hungry(self) -> bool {
        !matches!(self, FlowClass::Latency)
    }

    /// The lowercase name used in configuration files and environment variables.
    pub fn as_str(self) -> &'static str {
        match self {
            FlowClass::Latency => "latency",
            FlowClass::Throughput => "throughput",
            FlowClass::Bandwidth => "bandwidth",
        }
    }
}

impl fmt::Display for FlowClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A flow class name that is not one of `latency`, `throughput`, `bandwidth`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown flow class `{0}` (expected latency, throughput or bandwidth)")]
pub struct UnknownFlowClass(pub String);

impl FromStr for FlowClass {
    type Err = UnknownFlowClass;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "latency" | "lat" => Ok(FlowClass::Latency),
            "throughput" | "tput" => Ok(FlowClass::Throughput),
            "bandwidth" | "bw" => Ok(FlowClass::Bandwidth),
            _ => Err(UnknownFlowClass(s.to_string())),
        }
    }
}

/// Identifies one flow (in practice one queue pair) on a host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FlowId(pub u64);

/// Identifies the tenant (application) that owns flows; flows of one tenant share its share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TenantId(pub u64);

/// A relative share. A tenant of weight 2 is entitled to twice the share of a tenant of
/// weight 1. Invariant: never zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Weight(u32);

/// A weight of zero was given; every flow is entitled to some share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("weight must be at least 1")]
pub struct ZeroWeight;

impl Weight {
    /// The default weight.
    pub const ONE: Weight = Weight(1);

    /// A weight, refusing zero.
    pub fn new(value: u32) -> Result<Self, ZeroWeight> {
        if value == 0 {
            Err(ZeroWeight)
        } else {
            Ok(Weight(value))
        }
    }

    /// The weight as a number (at least 1).
    pub fn get(self) -> u32 {
        self.0
    }
}

impl Default for Weight {
    fn default() -> Self {
        Weight::ONE
    }
}

impl TryFrom<u32> for Weight {
    type Error = ZeroWeight;

    fn try_from(value: u32) -> Result<Self, Self::Error> {
        Weight::new(value)
    }
}

impl From<Weight> for u32 {
    fn from(w: Weight) -> u32 {
        w.0
    }
}

/// Counts of active flows by class: the L, B and T of Justitia's Pseudocode 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FlowCounts {
    /// L: active latency-sensitive flows.
    pub latency: u32,
    /// B: active bandwidth-sensitive flows.
    pub bandwidth: u32,
    /// T: active throughput-sensitive flows.
    pub throughput: u32,
}

impl FlowCounts {
    /// B + T: the resource-hungry flows.
    pub fn resource_hungry(&self) -> u32 {
        self.bandwidth + self.throughput
    }

    /// L + B + T.
    pub fn total(&self) -> u32 {
        self.latency + self.resource_hungry()
    }

    /// (B+T)/(L+B+T): the fraction of the RNIC that the resource-hungry flows are
    /// guaranteed together (sharing incentive, §4.2.2). 1.0 when there are no flows at all.
    pub fn resource_hungry_fraction(&self) -> f64 {
        if self.total() == 0 {
            1.0
        } else {
            f64::from(self.resource_hungry()) / f64::from(self.total())
        }
    }

    /// Adds one flow of the given class.
    pub fn add(&mut self, class: FlowClass) {
        match class {
            FlowClass::Latency => self.latency += 1,
            FlowClass::Throughput => self.throughput += 1,
            FlowClass::Bandwidth => self.bandwidth += 1,
        }
    }
}

/// A flow as the allotment sees it: who it is, whose it is, what it is and how much it weighs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowSpec {
    /// The flow.
    pub id: FlowId,
    /// The tenant that owns it.
    pub tenant: TenantId,
    /// Its class.
    pub class: FlowClass,
    /// The tenant's weight (flows of one tenant should carry the same weight; the
    /// allotment uses the largest it sees for a tenant).
    pub weight: Weight,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Classes print as their names; a weight converts back to its value; counts add one
    /// flow to its class only.
    #[test]
    fn classes_print_weights_convert_and_counts_add_by_class() {
        assert_eq!(FlowClass::Bandwidth.to_string(), "bandwidth");
        assert_eq!(FlowClass::Throughput.to_string(), "throughput");
        assert_eq!(u32::from(Weight::new(7).unwrap()), 7);
        let mut counts = FlowCounts::default();
        counts.add(FlowClass::Latency);
        counts.add(FlowClass::Bandwidth);
        counts.add(FlowClass::Bandwidth);
        counts.add(FlowClass::Throughput);
        counts.add(FlowClass::Throughput);
        counts.add(FlowClass::Throughput);
        assert_eq!(
            counts,
            FlowCounts {
                latency: 1,
                bandwidth: 2,
                throughput: 3
            }
        );
    }

    #[test]
    fn class_names_round_trip() {
        for class in FlowClass::ALL {
            assert_eq!(class.as_str().parse::<FlowClass>(), Ok(class));
        }
        assert_eq!(" BW ".parse::<FlowClass>(), Ok(FlowClass::Bandwidth));
        assert!("elephant".parse::<FlowClass>().is_err());
    }

    #[test]
    fn only_latency_is_not_resource_hungry() {
        assert!(!FlowClass::Latency.is_resource_hungry());
        assert!(FlowClass::Throughput.is_resource_hungry());
        assert!(FlowClass::Bandwidth.is_resource_hungry());
    }

    #[test]
    fn zero_weight_is_refused() {
        assert_eq!(Weight::new(0), Err(ZeroWeight));
        assert_eq!(Weight::new(3).map(Weight::get), Ok(3));
        assert_eq!(Weight::default(), Weight::ONE);
    }

    #[test]
    fn resource_hungry_fraction_matches_pseudocode_floor() {
        let counts = FlowCounts {
            latency: 1,
            bandwidth: 1,
            throughput: 0,
        };
        assert_eq!(counts.resource_hungry_fraction(), 0.5);
        let counts = FlowCounts {
            latency: 2,
            bandwidth: 1,
            throughput: 1,
        };
        assert_eq!(counts.resource_hungry_fraction(), 0.5);
        assert_eq!(FlowCounts::default().resource_hungry_fraction(), 1.0);
    }

    #[test]
    fn weight_deserializes_with_validation() {
        #[derive(Deserialize)]
        struct W {
            w: Weight,
        }
        assert!(toml::from_str::<W>("w = 0").is_err());
        assert_eq!(
            toml::from_str::<W>("w = 2").map(|w| w.w.get()).ok(),
            Some(2)
        );
    }
}
