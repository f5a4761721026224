//! Tenant-fair shares: what each tenant keeps in a run against what a weighted equal split
//! of the RNIC among the run's tenants leaves it, as the comparison suite reports it.
//!
//! The unit is a tenant's flows of one class (counted once, as the policies count them),
//! with the tenant's weight (the largest among those flows). A flow without a tenant in
//! the scenario is a tenant of its own, and so is each of its copies. Rates are in the
//! class's measure: messages per second for latency and throughput flows; for bandwidth
//! flows the Gb/s of MaxRate their use of the RNIC amounts to ([`rnic_gbps`]): their
//! goodput, or more where their messages' wire headers or their message rate take a larger
//! part of the RNIC than their payload does, so that a tenant of small messages is fair at
//! an equal part of what it uses (the wire, the processing units), not of bytes it cannot
//! move. For messages of a few KB and more this is the goodput.
//!
//! For a unit `u` of weight `w_u` in a run whose units weigh `W` together:
//!
//! - its **alone figure** `A_u` is its flows' rates summed, each taken in the first
//!   reference run (a variant named `alone ...`) that holds the flow;
//! - its class's **capacity** `C` is the largest total rate the class reached in any one
//!   reference run: what the RNIC gives that class with nothing else;
//! - its **tenant-fair share** is `min(A_u, w_u / W x C)`: its weighted equal share of the
//!   class's capacity, or what it uses alone when that is less;
//! - its **ratio** is its rate in the run over its tenant-fair share.

use std::collections::BTreeMap;

use justitia_core::flow::FlowClass;

use crate::model_profile::ModelProfile;
use crate::report::{FlowReport, RunReport, ScenarioReport};
use crate::scenario::Scenario;

/// Each flow's tenant (a label) and weight, by the flow's name in reports.
pub type TenantMap = BTreeMap<String, (String, u32)>;

/// The tenants of a scenario's flows, copies expanded (`name#n`).
pub fn tenants(scenario: &Scenario) -> TenantMap {
    let mut map = TenantMap::new();
    for flow in &scenario.flows {
        let weight = flow.weight.map_or(1, |w| w.get());
        for copy in 0..flow.copies {
            let name = if flow.copies > 1 {
                format!("{}#{}", flow.name, copy + 1)
            } else {
                flow.name.clone()
            };
            let tenant = flow
                .tenant
                .map_or_else(|| name.clone(), |t| format!("tenant {t}"));
            map.insert(name, (tenant, weight));
        }
    }
    map
}

/// One tenant's flows of one class in a run.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantShare {
    /// The tenant's label.
    pub tenant: String,
    /// The class of these flows.
    pub class: FlowClass,
    /// Their rate together in the run.
    pub rate: f64,
    /// Their alone figure.
    pub alone: f64,
    /// Their tenant-fair share.
    pub fair: f64,
}

impl TenantShare {
    /// The rate over the tenant-fair share.
    pub fn ratio(&self) -> f64 {
        if self.fair > 0.0 {
            self.rate / self.fair
        } else {
            f64::INFINITY
        }
    }
}

/// A flow's rate in its class's measure.
pub fn rate(class: FlowClass, gbps: f64, msgs_per_sec: f64) -> f64 {
    match class {
        FlowClass::Bandwidth => gbps,
        _ => msgs_per_sec,
    }
}

/// The Gb/s of MaxRate a bandwidth flow of `gbps` goodput in `msgs_per_sec` messages
/// uses of the RNIC: the most of its goodput, its wire bit rate (payload, each packet's
/// headers and each message's first-packet extra, at the messages' mean size) scaled from
/// the link's rate to MaxRate, and its message rate scaled from MaxTput to MaxRate.
pub fn rnic_gbps(profile: &ModelProfile, gbps: f64, msgs_per_sec: f64) -> f64 {
    let max_rate = profile.policy.max_rate_gbps;
    if msgs_per_sec <= 0.0 {
        return gbps;
    }
    let mean_bytes = gbps * 1e9 / 8.0 / msgs_per_sec;
    let packets = (mean_bytes / f64::from(profile.mtu())).ceil().max(1.0);
    let header_bits = (packets * f64::from(profile.link.header_bytes)
        + f64::from(profile.link.first_packet_extra_bytes))
        * 8.0
        * msgs_per_sec;
    let wire = (gbps + header_bits / 1e9) * max_rate / profile.link.gbps;
    let messages = msgs_per_sec / (profile.policy.max_tput_mops * 1e6) * max_rate;
    gbps.max(wire).max(messages)
}

/// A flow's rate in its class's measure for the tenant-fair shares (see the module).
fn use_of(profile: &ModelProfile, f: &FlowReport) -> f64 {
    match f.class {
        FlowClass::Bandwidth => rnic_gbps(profile, f.gbps, f.msgs_per_sec),
        _ => f.msgs_per_sec,
    }
}

/// The largest total rate each class reached in one reference run of the report.
pub fn capacity(report: &ScenarioReport) -> BTreeMap<FlowClass, f64> {
    capacity_in(report, |f| rate(f.class, f.gbps, f.msgs_per_sec))
}

/// The largest total each class reached in one reference run, flows measured by `measure`.
fn capacity_in(
    report: &ScenarioReport,
    measure: impl Fn(&FlowReport) -> f64,
) -> BTreeMap<FlowClass, f64> {
    let mut out = BTreeMap::new();
    for r in report
        .runs
        .iter()
        .filter(|r| r.variant.starts_with("alone"))
    {
        let mut totals: BTreeMap<FlowClass, f64> = BTreeMap::new();
        for f in &r.flows {
            *totals.entry(f.class).or_insert(0.0) += measure(f);
        }
        for (class, total) in totals {
            let c = out.entry(class).or_insert(0.0_f64);
            *c = c.max(total);
        }
    }
    out
}

/// The tenants' shares in `run` of `report` on `profile`, in each class's measure for
/// the shares (see the module); a flow not in `tenants` is a tenant of its own of weight
/// 1, and one without a reference run is left out.
pub fn tenant_shares(
    report: &ScenarioReport,
    run: &RunReport,
    tenants: &TenantMap,
    profile: &ModelProfile,
) -> Vec<TenantShare> {
    let capacity = capacity_in(report, |f| use_of(profile, f));
    let reference = |name: &str| {
        report
            .runs
            .iter()
            .filter(|r| r.variant.starts_with("alone"))
            .find_map(|r| r.flow(name))
    };
    // (tenant, class) -> (weight, rate, alone)
    let mut units: BTreeMap<(String, FlowClass), (u32, f64, f64)> = BTreeMap::new();
    for f in &run.flows {
        let Some(base) = reference(&f.name) else {
            continue;
        };
        let (tenant, weight) = tenants
            .get(&f.name)
            .cloned()
            .unwrap_or_else(|| (f.name.clone(), 1));
        let u = units.entry((tenant, f.class)).or_insert((0, 0.0, 0.0));
        u.0 = u.0.max(weight);
        u.1 += use_of(profile, f);
        u.2 += use_of(profile, base);
    }
    let all: u32 = units.values().map(|u| u.0).sum();
    units
        .into_iter()
        .map(|((tenant, class), (weight, rate, alone))| {
            let c = capacity.get(&class).copied().unwrap_or(alone);
            let equal = f64::from(weight) / f64::from(all.max(1)) * c;
            TenantShare {
                tenant,
                class,
                rate,
                alone,
                fair: alone.min(equal),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;
    use crate::report::FlowReport;
    use crate::series::RunSeries;

    fn flow(name: &str, class: FlowClass, gbps: f64) -> FlowReport {
        FlowReport {
            name: name.into(),
            class,
            app: "x".into(),
            messages: 1,
            msgs_per_sec: 1000.0,
            gbps,
            latency: None,
        }
    }

    fn run(variant: &str, flows: Vec<FlowReport>) -> RunReport {
        RunReport {
            variant: variant.into(),
            policy: "native".into(),
            flows,
            utilisation: 0.0,
            jain_bandwidth: None,
            policy_figures: Default::default(),
            fabric_figures: Default::default(),
            events: 0,
            series: RunSeries::default(),
            wall_seconds: 0.0,
        }
    }

    /// Tenant A with one flow, B with four (weight 1 each) and a latency tenant: three
    /// units. The link gives 90 Gb/s alone; A's fair share is 30, B's 30, and a run where A
    /// keeps 9 and B 81 leaves A at 0.3 of it; the latency tenant, demanding 1000 msgs/s
    /// alone, is fair at a third of that.
    #[test]
    fn shares_by_tenant_and_weight() {
        let mut tenants = TenantMap::new();
        tenants.insert("A".into(), ("tenant 2".into(), 1));
        for i in 1..=4 {
            tenants.insert(format!("B#{i}"), ("tenant 3".into(), 1));
        }
        let b = |g| (1..=4).map(move |i| flow(&format!("B#{i}"), FlowClass::Bandwidth, g));
        let report = ScenarioReport {
            scenario: "s".into(),
            description: String::new(),
            profile: "p".into(),
            seed: 1,
            duration_ms: 1.0,
            warmup_ms: 0.0,
            runs: vec![
                run("alone lat", vec![flow("lat", FlowClass::Latency, 0.0)]),
                run("alone A", vec![flow("A", FlowClass::Bandwidth, 90.0)]),
                run("alone B", b(22.5).collect()),
                run(
                    "unfair",
                    std::iter::once(flow("A", FlowClass::Bandwidth, 9.0))
                        .chain(b(20.25))
                        .chain(std::iter::once(flow("lat", FlowClass::Latency, 0.0)))
                        .collect(),
                ),
            ],
        };
        let profile = ModelProfile::builtin("RoCE-100").expect("built in");
        let shares = tenant_shares(&report, &report.runs[3], &tenants, &profile);
        assert_eq!(shares.len(), 3);
        let of = |t: &str| shares.iter().find(|s| s.tenant == t).expect("tenant");
        assert!((of("tenant 2").fair - 30.0).abs() < 1e-9);
        assert!((of("tenant 2").ratio() - 0.3).abs() < 1e-9);
        assert!((of("tenant 3").ratio() - 2.7).abs() < 1e-9);
        assert!((of("lat").fair - 1000.0 / 3.0).abs() < 1e-9);
    }

    /// A bandwidth flow's use of the RNIC on RoCE-100 (MaxRate 97 Gb/s, 100 Gb/s of wire,
    /// 82 B a packet and a 16 B RETH, 105 M messages/s), by hand: 36.5 M 64 B WRITEs/s are
    /// 18.69 Gb/s of goodput, 36.5e6 x 162 x 8 = 47.30 Gb/s of wire, 45.89 at MaxRate,
    /// and 36.5 / 105 x 97 = 33.72 by message rate: the wire's 45.89. 1 MB messages at 90
    /// Gb/s are their goodput.
    #[test]
    fn small_messages_count_by_what_they_use_of_the_rnic() {
        let profile = ModelProfile::builtin("RoCE-100").expect("built in");
        let gbps = 36.5e6 * 64.0 * 8.0 / 1e9;
        let used = rnic_gbps(&profile, gbps, 36.5e6);
        assert!(
            (used - 36.5e6 * 162.0 * 8.0 / 1e9 * 0.97).abs() < 1e-6,
            "{used}"
        );
        assert!((rnic_gbps(&profile, 90.0, 90e9 / 8.0 / 1048576.0) - 90.0).abs() < 1e-9);
        assert!((rnic_gbps(&profile, 5.0, 0.0) - 5.0).abs() < 1e-12);
    }
}
