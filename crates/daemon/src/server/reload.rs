//! SIGHUP: the configuration read again and applied to the running daemon.
//!
//! Inputs: the configuration file the daemon started with. Outputs: the running
//! configuration replaced, except the keys that take effect at the next start (each named
//! in a warning), and the control loop rebuilt when its settings changed.
//!
//! Invariants: a configuration that does not load is refused whole and the running one
//! kept; a rebuilt loop has every admitted flow registered again with its activity and its
//! READ responder, and takes no completion of a probe the old loop sent.

use std::time::Duration;

use justitia_agent::proto::AdmissionReply;
use justitia_core::control_loop::{ControlLoop, FlowRegistration};
use justitia_core::flow::{FlowId, FlowSpec, TenantId};
use tracing::{error, info, warn};

use crate::config::Config;

use super::{loop_config, now_ns, Daemon};

impl Daemon {
    /// Replaces the control loop (new weights, RefPeriod or probe timeout), registering
    /// every flow again with its activity. The controller starts afresh.
    fn rebuild_loop(&mut self) -> Result<(), String> {
        let now = Duration::from_nanos(now_ns());
        let mut lp = ControlLoop::new(loop_config(&self.config), &self.profile, now)
            .map_err(|e| e.to_string())?;
        for (&id, f) in &self.flows {
            if f.admission == AdmissionReply::NotAdmitted {
                continue;
            }
            let weight = self.config.weight_of(f.uid, f.pod.as_ref());
            let spec = FlowSpec {
                id: FlowId(id),
                tenant: TenantId(f.tenant),
                class: f.class,
                weight,
            };
            lp.register_flow(now, FlowRegistration { spec, qps: f.qps })
                .map_err(|e| e.to_string())?;
            if let Some((peer, justitia_peer::wire::Role::Read)) = f.remote {
                lp.set_flow_reads_from(now, FlowId(id), Some(crate::peer::responder_key(peer)))
                    .map_err(|e| e.to_string())?;
            }
            lp.set_flow_active(now, FlowId(id), f.active)
                .map_err(|e| e.to_string())?;
        }
        self.lp = lp;
        self.probe_base += 1 << 40;
        self.probes_in_flight.clear();
        Ok(())
    }

    pub(super) fn reload(&mut self) {
        let Some(path) = self.config_path.clone() else {
            warn!("SIGHUP: no configuration file to reload");
            return;
        };
        let new = match Config::load_with(&path, true, &self.overrides) {
            Ok(c) => c,
            Err(e) => {
                error!(error = %e, "SIGHUP: configuration refused, keeping the running one");
                return;
            }
        };
        let old = self.config.clone();
        let peer_taken = self.reload_peer(new.peer.as_ref());
        let new_peer = new.peer.clone();
        let restart_only = [
            ("device", new.device != old.device),
            ("port", new.port != old.port),
            ("gid_index", new.gid_index != old.gid_index),
            ("profile", new.profile != old.profile),
            ("probe", new.probe != old.probe),
            ("socket", new.socket != old.socket),
            ("admin_socket", new.admin_socket != old.admin_socket),
            ("metrics", new.metrics != old.metrics),
            ("slots", new.slots != old.slots),
            ("stale_after_ms", new.stale_after != old.stale_after),
            ("tenant", new.tenant != old.tenant),
            ("policy", new.policy != old.policy),
            ("peer", !peer_taken),
            ("unshaped_scan_ms", new.unshaped_scan != old.unshaped_scan),
        ];
        for (key, changed) in restart_only {
            if changed {
                warn!(key, "SIGHUP: this key takes effect at the next start");
            }
        }
        // A new target alone is set on the running loop; the other loop settings need a
        // new loop.
        let retargeted = new.target != old.target;
        let relooped = new.weights != old.weights
            || new.ref_period != old.ref_period
            || new.probe_timeout != old.probe_timeout;
        self.config = Config {
            device: old.device,
            port: old.port,
            gid_index: old.gid_index,
            profile: old.profile,
            probe: old.probe,
            socket: old.socket,
            admin_socket: old.admin_socket,
            metrics: old.metrics,
            slots: old.slots,
            stale_after: old.stale_after,
            tenant: old.tenant,
            policy: old.policy,
            peer: if peer_taken { new_peer } else { old.peer },
            unshaped_scan: old.unshaped_scan,
            ..new
        };
        // Weights may have changed: each tenant's is the largest among its connections.
        for p in self.pages.values_mut() {
            p.weight = 1;
        }
        for c in self.clients.values() {
            if let Some(p) = self.pages.get_mut(&c.tenant) {
                p.weight = p
                    .weight
                    .max(self.config.weight_of(c.uid, c.pod.as_ref()).get());
            }
        }
        self.tenant_budgets_stale = true;
        if relooped {
            if let Err(e) = self.rebuild_loop() {
                error!(error = %e, "SIGHUP: control loop not rebuilt");
            }
        } else if retargeted {
            if let Err(e) = self
                .lp
                .set_target(Duration::from_nanos(now_ns()), self.config.target)
            {
                error!(error = %e, "SIGHUP: Target99 not changed");
                self.config.target = old.target;
            }
        }
        if self.config.admin_group != old.admin_group {
            self.own_admin_socket();
        }
        info!(path = %path.display(), "configuration reloaded");
    }
}
