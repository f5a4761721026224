//! Each tenant's budgets published in its page (control verbs and QP turns), and what its
//! shapers report of them.
//!
//! Inputs: the connections (a tenant's page counts its processes and holds the largest
//! weight among them), `control_verbs_per_sec`, `control_verb_burst`, `qp_turns` and
//! `qp_turn_bytes` (under `adaptive`, the law's context turns where they are unset), and
//! the shapers' control-verb and QP-turn reports. Outputs: each
//! tenant page's per-process budgets ([`tenant_budget`], [`tenant_turn_budget`]), the
//! tenants' counts in `justitia flows` and the metrics.
//!
//! Invariants: the budgets are recomputed once per pass after the connections or the
//! configuration changed, never per message; a page's budget is written only when it
//! changed; a report adds to its own connection's tenant only, and the counts saturate.
//! A tenant's counts outlive its connections (they are counters), but at most
//! [`MAX_TALLIES`] tenants are remembered: a new one then takes the place of a tenant with
//! no connection, whose series go.

use std::collections::{BTreeMap, BTreeSet};

use justitia_agent::admin::TenantReport;
use justitia_agent::proto::{ControlVerbReport, QpTurnReport};
use justitia_core::control_verbs::{tenant_budget, ControlVerbBudget};
use justitia_core::queue_turns::{tenant_turn_budget, TurnBudget};

use crate::config::DEFAULT_QP_TURN_BYTES;
use crate::metrics::TenantKey;

use super::Daemon;

/// Tenants whose counts are remembered, connected or not.
pub(super) const MAX_TALLIES: usize = 1024;

/// A tenant's control verbs and QP turns as its shapers reported them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct TenantTally {
    /// Control verbs issued.
    pub verbs: u64,
    /// Of them, those that waited.
    pub delayed: u64,
    /// The time they waited, ns.
    pub waited_ns: u64,
    /// Times one of its QPs waited in line for a turn.
    pub turn_waits: u64,
    /// Times one of its QPs gave a spent turn up to a waiting one.
    pub turn_yields: u64,
}

/// The budgets of each of a tenant's processes, as published in its page.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct ProcessBudgets {
    /// Control verbs (`None`: unpaced).
    pub control: Option<ControlVerbBudget>,
    /// QP turns (`None`: no turns).
    pub turns: Option<TurnBudget>,
}

impl Daemon {
    /// Writes every tenant page's per-process budgets when the connections or the
    /// configuration changed since the last time.
    pub(super) fn publish_tenant_budgets(&mut self) {
        if !self.tenant_budgets_stale {
            return;
        }
        self.tenant_budgets_stale = false;
        let total = self.connected_weight(None);
        let budgets: Vec<(u64, ProcessBudgets)> = self
            .pages
            .iter()
            .map(|(&t, p)| {
                let processes = u32::try_from(p.clients).unwrap_or(u32::MAX);
                let b = if processes > 0 {
                    self.process_budgets(p.weight, total, processes)
                } else {
                    ProcessBudgets::default()
                };
                (t, b)
            })
            .collect();
        for (t, b) in budgets {
            let Some(p) = self.pages.get_mut(&t) else {
                continue;
            };
            p.publish(b);
            let processes = u32::try_from(p.clients).unwrap_or(u32::MAX);
            let key = TenantKey {
                tenant: p.name.clone(),
            };
            self.metrics
                .tenant_control_verb_budget
                .get_or_create(&key)
                .set(b.control.map_or(0.0, |b| b.per_sec * f64::from(processes)));
            self.metrics.tenant_qp_turns.get_or_create(&key).set(
                b.turns
                    .map_or(0, |t| i64::try_from(t.open).unwrap_or(i64::MAX)),
            );
        }
    }

    /// The budgets of each of `processes` processes of a tenant of `weight` among tenants
    /// weighing `total` together.
    fn process_budgets(&self, weight: u32, total: u64, processes: u32) -> ProcessBudgets {
        ProcessBudgets {
            control: tenant_budget(
                f64::from(self.config.control_verbs_per_sec),
                self.config.control_verb_burst,
                weight,
                total,
                processes,
            ),
            turns: {
                let (host_open, turn_bytes) = self.host_qp_turns();
                tenant_turn_budget(host_open, turn_bytes, weight, total, processes)
            },
        }
    }

    /// The host's QP turns and the bytes of one: the operator's `qp_turns`, and
    /// `qp_turn_bytes` if set, else under `adaptive` the law's context turn
    /// ([`context_turn_bytes`](justitia_core::adaptive::AdaptiveLaw::context_turn_bytes):
    /// long enough that the context read opening the next turn disturbs the latency
    /// flows' tail little, as the simulator's driver serves its queue pairs), else
    /// [`DEFAULT_QP_TURN_BYTES`].
    fn host_qp_turns(&self) -> (u32, u64) {
        let bytes = self.config.qp_turn_bytes.unwrap_or_else(|| {
            self.adaptive
                .as_ref()
                .map_or(DEFAULT_QP_TURN_BYTES, |d| d.context_turn_bytes())
        });
        (self.config.qp_turns, bytes)
    }

    /// The per-process budgets of `tenant` once a connection of `weight` joins it: its
    /// processes one more, its weight the larger of its own and `weight`.
    pub(super) fn joining_budgets(&self, tenant: u64, weight: u32) -> ProcessBudgets {
        let (own, clients) = self
            .pages
            .get(&tenant)
            .filter(|p| p.clients > 0)
            .map_or((0, 0), |p| (p.weight, p.clients));
        let others = self.connected_weight(Some(tenant));
        let w = own.max(weight);
        self.process_budgets(
            w,
            others + u64::from(w),
            u32::try_from(clients + 1).unwrap_or(u32::MAX),
        )
    }

    /// The weights of the tenants with a connected process, summed, leaving out `except`:
    /// the divisor of the host's budgets.
    fn connected_weight(&self, except: Option<u64>) -> u64 {
        self.pages
            .iter()
            .filter(|(&t, p)| Some(t) != except && p.clients > 0)
            .map(|(_, p)| u64::from(p.weight))
            .sum()
    }

    /// The tally of the tenant of `client`'s connection, made room for; `None` for a
    /// connection gone.
    fn tally_of(&mut self, client: u64) -> Option<(&mut TenantTally, TenantKey)> {
        let name = self.clients.get(&client)?.tenant_name.clone();
        if !self.tenant_tallies.contains_key(&name) && self.tenant_tallies.len() >= MAX_TALLIES {
            self.evict_a_departed_tally();
        }
        let key = TenantKey {
            tenant: name.clone(),
        };
        Some((self.tenant_tallies.entry(name).or_default(), key))
    }

    /// Adds a shaper's QP-turn report to its tenant's counts.
    pub(super) fn note_qp_turns(&mut self, client: u64, r: QpTurnReport) {
        let Some((t, key)) = self.tally_of(client) else {
            return;
        };
        t.turn_waits = t.turn_waits.saturating_add(r.waits);
        t.turn_yields = t.turn_yields.saturating_add(r.yields);
        let m = &self.metrics;
        m.tenant_qp_turn_waits.get_or_create(&key).inc_by(r.waits);
        m.tenant_qp_turn_yields.get_or_create(&key).inc_by(r.yields);
    }

    /// Adds a shaper's report to its tenant's counts.
    pub(super) fn note_control_verbs(&mut self, client: u64, r: ControlVerbReport) {
        let Some((t, key)) = self.tally_of(client) else {
            return;
        };
        t.verbs = t.verbs.saturating_add(r.verbs);
        t.delayed = t.delayed.saturating_add(r.delayed);
        t.waited_ns = t.waited_ns.saturating_add(r.waited_ns);
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
            .tenant_tallies
            .keys()
            .find(|n| !connected.contains(n.as_str()))
            .cloned()
        else {
            return;
        };
        self.tenant_tallies.remove(&gone);
        let key = TenantKey { tenant: gone };
        let m = &self.metrics;
        m.tenant_control_verbs.remove(&key);
        m.tenant_control_verbs_delayed.remove(&key);
        m.tenant_control_verb_wait.remove(&key);
        m.tenant_qp_turn_waits.remove(&key);
        m.tenant_qp_turn_yields.remove(&key);
    }

    /// Drops a gone tenant's budget series (it has no budget without a connection).
    pub(super) fn forget_tenant_budgets(&mut self, name: &str) {
        let key = TenantKey {
            tenant: name.to_string(),
        };
        self.metrics.tenant_control_verb_budget.remove(&key);
        self.metrics.tenant_qp_turns.remove(&key);
    }

    /// The connected tenants, and those with counts remembered, for
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
                        .budgets
                        .control
                        .map(|b| b.per_sec * f64::from(processes)),
                    control_verbs: 0,
                    control_verbs_delayed: 0,
                    control_verb_wait_seconds: 0.0,
                    qp_turns: p
                        .budgets
                        .turns
                        .map(|t| u32::try_from(t.open).unwrap_or(u32::MAX)),
                    qp_turn_waits: 0,
                    qp_turn_yields: 0,
                },
            );
        }
        for (name, t) in &self.tenant_tallies {
            let r = out.entry(name).or_insert_with(|| TenantReport {
                tenant: name.clone(),
                weight: 0,
                processes: 0,
                control_verbs_per_sec: None,
                control_verbs: 0,
                control_verbs_delayed: 0,
                control_verb_wait_seconds: 0.0,
                qp_turns: None,
                qp_turn_waits: 0,
                qp_turn_yields: 0,
            });
            r.control_verbs = t.verbs;
            r.control_verbs_delayed = t.delayed;
            r.control_verb_wait_seconds = t.waited_ns as f64 / 1e9;
            r.qp_turn_waits = t.turn_waits;
            r.qp_turn_yields = t.turn_yields;
        }
        out.into_values().collect()
    }
}
