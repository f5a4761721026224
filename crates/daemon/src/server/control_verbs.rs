//! Control verbs: each tenant's budget published in its page, and what its shapers report.
//!
//! Inputs: the connections (a tenant's page counts its processes and holds the largest
//! weight among them), `control_verbs_per_sec` and `control_verb_burst`, and the shapers'
//! control-verb reports. Outputs: each tenant page's per-process budget
//! ([`tenant_budget`]), the tenants' counts in `justitia flows` and the metrics.
//!
//! Invariants: the budgets are recomputed once per pass after the connections or the
//! configuration changed, never per message; a page's budget is written only when it
//! changed; a report adds to its own connection's tenant only, and the counts saturate.
//! A tenant's counts outlive its connections (they are counters), but at most
//! [`MAX_TALLIES`] tenants are remembered: a new one then takes the place of a tenant with
//! no connection, whose series go.

use std::collections::{BTreeMap, BTreeSet};

use justitia_agent::admin::TenantReport;
use justitia_agent::proto::ControlVerbReport;
use justitia_core::control_verbs::{tenant_budget, ControlVerbBudget};

use crate::metrics::TenantKey;

use super::Daemon;

/// Tenants whose control-verb counts are remembered, connected or not.
pub(super) const MAX_TALLIES: usize = 1024;

/// A tenant's control verbs as its shapers reported them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct ControlVerbTally {
    /// Verbs issued.
    pub verbs: u64,
    /// Of them, those that waited.
    pub delayed: u64,
    /// The time they waited, ns.
    pub waited_ns: u64,
}

impl Daemon {
    /// Writes every tenant page's per-process budget when the connections or the
    /// configuration changed since the last time.
    pub(super) fn publish_control_budgets(&mut self) {
        if !self.control_budgets_stale {
            return;
        }
        self.control_budgets_stale = false;
        let host = f64::from(self.config.control_verbs_per_sec);
        let burst = self.config.control_verb_burst;
        let total = self.connected_weight(None);
        for p in self.pages.values_mut() {
            let processes = u32::try_from(p.clients).unwrap_or(u32::MAX);
            let budget = (processes > 0)
                .then(|| tenant_budget(host, burst, p.weight, total, processes))
                .flatten();
            if budget != p.control_budget {
                p.page.set_control_budget(budget);
                p.control_budget = budget;
            }
            self.metrics
                .tenant_control_verb_budget
                .get_or_create(&TenantKey {
                    tenant: p.name.clone(),
                })
                .set(budget.map_or(0.0, |b| b.per_sec * f64::from(processes)));
        }
    }

    /// The per-process budget of `tenant` once a connection of `weight` joins it: its
    /// processes one more, its weight the larger of its own and `weight`.
    pub(super) fn joining_control_budget(
        &self,
        tenant: u64,
        weight: u32,
    ) -> Option<ControlVerbBudget> {
        let (own, clients) = self
            .pages
            .get(&tenant)
            .filter(|p| p.clients > 0)
            .map_or((0, 0), |p| (p.weight, p.clients));
        let others = self.connected_weight(Some(tenant));
        let w = own.max(weight);
        tenant_budget(
            f64::from(self.config.control_verbs_per_sec),
            self.config.control_verb_burst,
            w,
            others + u64::from(w),
            u32::try_from(clients + 1).unwrap_or(u32::MAX),
        )
    }

    /// The weights of the tenants with a connected process, summed, leaving out `except`:
    /// the divisor of the host's control-verb budget.
    fn connected_weight(&self, except: Option<u64>) -> u64 {
        self.pages
            .iter()
            .filter(|(&t, p)| Some(t) != except && p.clients > 0)
            .map(|(_, p)| u64::from(p.weight))
            .sum()
    }

    /// Adds a shaper's report to its tenant's counts.
    pub(super) fn note_control_verbs(&mut self, client: u64, r: ControlVerbReport) {
        let Some(c) = self.clients.get(&client) else {
            return;
        };
        let name = c.tenant_name.clone();
        if !self.control_tallies.contains_key(&name) && self.control_tallies.len() >= MAX_TALLIES {
            self.evict_a_departed_tally();
        }
        let t = self.control_tallies.entry(name.clone()).or_default();
        t.verbs = t.verbs.saturating_add(r.verbs);
        t.delayed = t.delayed.saturating_add(r.delayed);
        t.waited_ns = t.waited_ns.saturating_add(r.waited_ns);
        let key = TenantKey { tenant: name };
        let m = &self.metrics;
        m.tenant_control_verbs.get_or_create(&key).inc_by(r.verbs);
        m.tenant_control_verbs_delayed
            .get_or_create(&key)
            .inc_by(r.delayed);
        m.tenant_control_verb_wait
            .get_or_create(&key)
            .inc_by(r.waited_ns as f64 / 1e9);
    }

    /// Forgets one remembered tenant with no connection, and its series. With every
    /// remembered tenant connected nothing goes: their number is bounded by the
    /// connections.
    fn evict_a_departed_tally(&mut self) {
        let connected: BTreeSet<&str> = self
            .pages
            .values()
            .filter(|p| p.clients > 0)
            .map(|p| p.name.as_str())
            .collect();
        let Some(gone) = self
            .control_tallies
            .keys()
            .find(|n| !connected.contains(n.as_str()))
            .cloned()
        else {
            return;
        };
        self.control_tallies.remove(&gone);
        let key = TenantKey { tenant: gone };
        let m = &self.metrics;
        m.tenant_control_verbs.remove(&key);
        m.tenant_control_verbs_delayed.remove(&key);
        m.tenant_control_verb_wait.remove(&key);
    }

    /// Drops a gone tenant's budget series (it has no budget without a connection).
    pub(super) fn forget_control_budget(&mut self, name: &str) {
        self.metrics.tenant_control_verb_budget.remove(&TenantKey {
            tenant: name.to_string(),
        });
    }

    /// The connected tenants, and those with control verbs remembered, for
    /// `justitia flows`.
    pub(super) fn tenant_reports(&self) -> Vec<TenantReport> {
        let mut out: BTreeMap<&str, TenantReport> = BTreeMap::new();
        for p in self.pages.values().filter(|p| p.clients > 0) {
            let processes = u32::try_from(p.clients).unwrap_or(u32::MAX);
            out.insert(
                &p.name,
                TenantReport {
                    tenant: p.name.clone(),
                    weight: p.weight,
                    processes,
                    control_verbs_per_sec: p
                        .control_budget
                        .map(|b| b.per_sec * f64::from(processes)),
                    control_verbs: 0,
                    control_verbs_delayed: 0,
                    control_verb_wait_seconds: 0.0,
                },
            );
        }
        for (name, t) in &self.control_tallies {
            let r = out.entry(name).or_insert_with(|| TenantReport {
                tenant: name.clone(),
                weight: 0,
                processes: 0,
                control_verbs_per_sec: None,
                control_verbs: 0,
                control_verbs_delayed: 0,
                control_verb_wait_seconds: 0.0,
            });
            r.control_verbs = t.verbs;
            r.control_verbs_delayed = t.delayed;
            r.control_verb_wait_seconds = t.waited_ns as f64 / 1e9;
        }
        out.into_values().collect()
    }
}
