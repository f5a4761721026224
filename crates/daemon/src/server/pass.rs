//! The loop's pass: one wake-up of the daemon's thread, from the sleep to the next sleep.
//!
//! Inputs: the descriptors epoll found ready (the registration and admin sockets and their
//! connections, pidfds, the peer socket), the probe's completions, and the clock. Outputs:
//! calls into the [`ControlLoop`](justitia_core::control_loop::ControlLoop) (completions, updates) and the adaptive driver, the
//! events the loop raises carried out (a probe posted, allotments and the READ guarantee
//! handed on), and the heartbeat.
//!
//! The thread sleeps in epoll on every descriptor it serves (registered once, not per
//! wake-up) and on an absolute CLOCK_MONOTONIC timerfd armed for the earliest of
//! [`ControlLoop::poll_timeout`](justitia_core::control_loop::ControlLoop::poll_timeout) (the next update or a probe's timeout), the heartbeat, a
//! paused listener's resumption, an admin connection's deadline, the watchdog and the peer
//! channel's timer ([`Daemon::wait`]). The timer has nanosecond resolution and no timer
//! slack (a sleep with a timeout under the normal policy may end 50 us late), so an update
//! runs when it is due, and the daemon sleeps between updates instead of spinning a core.
//! While a latency flow is counted it wakes once per RefPeriod; without one the loop runs
//! at its quiet cadence ([`justitia_core::control_loop::QUIET_PERIODS`] RefPeriods) and
//! the daemon wakes for that or for the heartbeat (every third of `stale_after_ms`),
//! whichever comes first. The loop's deadline is read again before every sleep, so an
//! input is acted on at the next RefPeriod tick whatever the cadence. An update's wake-up
//! posts the probe and polls briefly for its completion
//! ([`crate::probe::Probe::await_completion`]); one not seen then is collected on the
//! next wake-up, and every completion carries the time it happened.
//!
//! Invariants (what a local user or a peer sends never holds the loop):
//! - a pass serves sockets for at most [`PASS_BUDGET_DIVISOR`]th of `stale_after_ms`;
//!   what is left stays readable (epoll is level-triggered) and is served on the next
//!   pass, after the update and the heartbeat, so the heartbeat is written on time
//!   whatever arrives;
//! - a pass that spent its budget is followed by a rest as long, so serving never takes
//!   more than half the loop's time (at SCHED_FIFO, a loop busy all the time is stopped by
//!   real-time throttling);
//! - a wake-up allocates nothing (under `policy = "adaptive"`, except one that plans: see
//!   [`crate::adaptive`]); the heartbeat is written at the start and the end of every pass.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use justitia_core::adaptive::allotments::{ChargedFlow, HostFlow};
use justitia_core::adaptive::Resource;
use justitia_core::control_loop::{Event, ProbeId};
use justitia_core::flow::{FlowId, FlowSpec, TenantId};
use tracing::{error, info, warn};

use crate::adaptive::DriverFlow;
use crate::limits::LogKind;
use crate::peer::PeerLink;

use super::{
    now_ns, Daemon, Signals, ADMIN_DEADLINE, PASS_BUDGET_DIVISOR, TAG_ADMIN, TAG_ADMIN_CONN,
    TAG_LISTEN, TAG_PEER, TAG_PROBE, TAG_TIMER,
};

impl Daemon {
    /// Runs until `signals.stop` is raised.
    pub fn run(&mut self, signals: &Signals) {
        // The sockets are bound: shapers can connect from now on.
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        let mut usec = 0;
        if sd_notify::watchdog_enabled(false, &mut usec) {
            self.watchdog_ns = Some(usec.saturating_mul(1000) / 2);
        }
        let mut probe_ready = false;
        while !signals.stop.load(Ordering::Relaxed) {
            if signals.reload.swap(false, Ordering::Relaxed) {
                self.reload();
            }
            self.turn(probe_ready);
            probe_ready = self.wait();
        }
        let _ = std::fs::remove_file(&self.config.socket);
        let _ = std::fs::remove_file(&self.config.admin_socket);
        info!("justitiad stopped");
    }

    /// One pass of the loop after a wake-up: probe completions, the sockets found ready
    /// (within the pass budget), the control loop's update, the heartbeat, the status.
    pub fn turn(&mut self, probe_ready: bool) {
        // Completions first, so that the update on this wake-up counts them; each is
        // stamped with the time it completed, not the time it is collected.
        let now = now_ns();
        self.block.beat(now);
        if probe_ready || self.probe.outstanding() > 0 {
            self.completions.clear();
            self.probe.collect(now, probe_ready, &mut self.completions);
            self.take_completions();
        }
        self.serve_ready(now);
        self.expire(now_ns());
        self.hand_known_pids();
        let now_d = Duration::from_nanos(now_ns());
        if self.lp.poll_timeout().is_some_and(|t| t <= now_d) {
            self.lp.handle_timeout(now_d);
        }
        self.drain_events();
        self.drive_adaptive();
        self.flush_peer();
        let now = now_ns();
        self.block.beat(now);
        self.last_beat = now;
        if let Some(every) = self.watchdog_ns {
            if now.saturating_sub(self.last_watchdog) >= every {
                self.last_watchdog = now;
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            }
        }
        self.publish_status();
        self.publish_tenant_budgets();
    }

    /// Hands the pids of the connections to the scan for unshaped processes when they
    /// changed (allocating then only); tried again on the next pass if the scan held them.
    fn hand_known_pids(&mut self) {
        if !self.known_changed {
            return;
        }
        let Some(scanner) = &self.unshaped else {
            self.known_changed = false;
            return;
        };
        let pids: Arc<[i32]> = self
            .clients
            .values()
            .map(|c| c.pid)
            .filter(|&p| p > 0)
            .collect();
        if scanner.set_known(pids) {
            self.known_changed = false;
        }
    }

    /// Resumes a paused listener when its pause is over, and closes admin connections
    /// past their deadline.
    fn expire(&mut self, now: u64) {
        if self.listen_paused_until != 0 && now >= self.listen_paused_until {
            self.listen_paused_until = 0;
            self.listen_interest(rustix::event::epoll::EventFlags::IN);
        }
        let late: Vec<u64> = self
            .admins
            .iter()
            .filter(|(_, a)| a.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            self.admins.remove(&id);
            if self.log_ok(LogKind::Admin, now) {
                warn!(
                    deadline_ms = ADMIN_DEADLINE.as_millis() as u64,
                    "admin connection closed: not done by its deadline"
                );
            }
        }
    }

    /// The pass budget: sockets are served for at most this long per pass.
    fn pass_budget_ns(&self) -> u64 {
        (self.config.stale_after.as_nanos() as u64 / PASS_BUDGET_DIVISOR).max(100_000)
    }

    /// Hands the collected completions to the control loop.
    fn take_completions(&mut self) {
        for i in 0..self.completions.len() {
            let c = self.completions[i];
            self.probe_done(c.at_ns, c.id, c.ok);
        }
        self.completions.clear();
    }

    /// The next time the loop must run without any descriptor waking it: the control
    /// loop's deadline (the next update, which also collects the last probe, or a probe's
    /// timeout) or the heartbeat. A probe's completion is not one: it is collected on
    /// the wake-up that posted it or on the next, stamped with the time it happened.
    fn next_wake(&self) -> u64 {
        let mut wake = self
            .last_beat
            .saturating_add((self.config.stale_after.as_nanos() as u64 / 3).max(100_000));
        if let Some(t) = self.lp.poll_timeout() {
            wake = wake.min(t.as_nanos() as u64);
        }
        if self.listen_paused_until != 0 {
            wake = wake.min(self.listen_paused_until);
        }
        if let Some(a) = self.admins.values().map(|a| a.deadline).min() {
            wake = wake.min(a);
        }
        if let Some(every) = self.watchdog_ns {
            wake = wake.min(self.last_watchdog.saturating_add(every));
        }
        if let Some(t) = self.peer.as_ref().and_then(PeerLink::poll_timeout) {
            wake = wake.min(t.as_nanos() as u64);
        }
        wake
    }

    /// Arms the timer for the next wake-up and sleeps in epoll until it fires or a
    /// descriptor is ready. The timer is absolute on CLOCK_MONOTONIC with nanosecond
    /// resolution, and only re-armed when the deadline moves (a timer left expired keeps
    /// its descriptor readable, which is right: its deadline has passed). Returns whether
    /// the probe's descriptor was ready (for [`Self::turn`]); socket events are kept for
    /// the pass. [`Self::run`] alternates the two; a benchmark may drive them itself.
    pub fn wait(&mut self) -> bool {
        let wake = self.next_wake();
        if wake != self.armed {
            let spec = rustix::time::Itimerspec {
                it_interval: rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
                it_value: rustix::time::Timespec {
                    tv_sec: (wake / 1_000_000_000) as i64,
                    // A zero it_value would disarm the timer; 1 ns is already past.
                    tv_nsec: ((wake % 1_000_000_000) as i64).max(i64::from(wake == 0)) as _,
                },
            };
            match rustix::time::timerfd_settime(
                &self.timer,
                rustix::time::TimerfdTimerFlags::ABSTIME,
                &spec,
            ) {
                Ok(_) => self.armed = wake,
                Err(e) => {
                    error!(error = %e, "arming the loop timer");
                    self.armed = 0;
                }
            }
        }
        // A pass that spent its budget left sockets readable, so epoll would return at
        // once: rest first. Serving then takes at most half of the loop's time however
        // much arrives, so a daemon at SCHED_FIFO never holds its core long enough for
        // the kernel's real-time throttling (950 ms of every second) to stop it, which
        // under a flood left the heartbeat 40-50 ms old.
        let rest = std::mem::take(&mut self.rest_until).min(wake);
        let now = now_ns();
        if rest > now {
            std::thread::sleep(Duration::from_nanos(rest - now));
        }
        self.ready.clear();
        let n = match rustix::event::epoll::wait(&self.epoll, &mut self.events[..], None) {
            Ok(n) => n,
            Err(_) => return false, // EINTR: a signal; the loop looks at its flags.
        };
        let mut probe_ready = false;
        for ev in &self.events[..n] {
            match ev.data.u64() {
                TAG_TIMER => {}
                TAG_PROBE => probe_ready = true,
                tag => self.ready.push(tag),
            }
        }
        probe_ready
    }

    /// Serves the sockets the last wait found ready, until the pass budget is spent: the
    /// rest stay readable (epoll is level-triggered and puts a descriptor it reported at
    /// the back of its ready list) and are served on the next pass.
    fn serve_ready(&mut self, start: u64) {
        self.pass_deadline = start.saturating_add(self.pass_budget_ns());
        for i in 0..self.ready.len() {
            let now = now_ns();
            if now > self.pass_deadline {
                break;
            }
            match self.ready[i] {
                TAG_LISTEN => self.accept(now),
                TAG_ADMIN => self.accept_admin(now),
                TAG_PEER => self.serve_peer(),
                tag if tag & TAG_ADMIN_CONN != 0 => self.serve_admin(tag & !TAG_ADMIN_CONN),
                tag if tag & 1 == 1 => self.reclaim(now, tag >> 1, "process exited"),
                tag => self.read_client(now, tag >> 1),
            }
        }
        self.ready.clear();
        let end = now_ns();
        if end > self.pass_deadline {
            self.rest_until = end.saturating_add(self.pass_budget_ns());
        }
    }

    /// A probe completed (or failed) at `at` (ns).
    fn probe_done(&mut self, at: u64, wr_id: u64, ok: bool) {
        let Some(sent) = self.probes_in_flight.remove(&wr_id) else {
            return;
        };
        let id = ProbeId(wr_id - self.probe_base);
        let now_d = Duration::from_nanos(now_ns());
        let at = at.max(sent);
        if ok {
            if self
                .lp
                .probe_completed_at(now_d, id, Duration::from_nanos(at))
            {
                self.probes_ok += 1;
                self.metrics
                    .probe_latency
                    .observe(at.saturating_sub(sent) as f64 * 1e-9);
                if !self.probe_running {
                    self.probe_running = true;
                    info!(
                        latency_us = at.saturating_sub(sent) as f64 / 1e3,
                        "reference flow running"
                    );
                }
            }
        } else if self.lp.probe_lost(now_d, id) {
            self.probes_lost += 1;
            self.metrics.probes_lost.inc();
        }
    }

    fn drain_events(&mut self) {
        while let Some(ev) = self.lp.poll_event() {
            match ev {
                Event::ProbeDue => {
                    // Stamped just before the post, so the time the update took is not
                    // counted in the probe's latency.
                    let now = now_ns();
                    let now_d = Duration::from_nanos(now);
                    let id = self.lp.probe_sent(now_d);
                    let wr_id = self.probe_base + id.0;
                    match self.probe.send(wr_id, now) {
                        Ok(()) => {
                            self.probes_in_flight.insert(wr_id, now);
                            // A probe that completes within microseconds is taken on
                            // this wake-up instead of costing another.
                            self.completions.clear();
                            self.probe.await_completion(
                                now.saturating_add(crate::probe::AWAIT_LIMIT.as_nanos() as u64),
                                &mut self.completions,
                            );
                            self.take_completions();
                        }
                        Err(e) => {
                            self.metrics.fail_open.inc();
                            warn!(error = %e, "probe not sent");
                            self.lp.probe_lost(now_d, id);
                            self.probes_lost += 1;
                            self.metrics.probes_lost.inc();
                        }
                    }
                }
                Event::ProbeLost(id) => {
                    self.probes_in_flight.remove(&(self.probe_base + id.0));
                    self.probes_lost += 1;
                    self.metrics.probes_lost.inc();
                }
                // Under `adaptive` the driver publishes its own allotments.
                Event::AllotmentsChanged { .. } if self.adaptive.is_none() => {
                    self.publish_allotments()
                }
                Event::AllotmentsChanged { .. } => {}
                Event::TargetMeasured { idle_p99, target } => {
                    info!(
                        idle_p99_us = idle_p99.as_secs_f64() * 1e6,
                        target_us = target.as_secs_f64() * 1e6,
                        "Target99 measured"
                    );
                }
                Event::ModeChanged(mode) => warn!(?mode, "control mode changed"),
                // Announced only while peers' READ flows are counted: to them.
                Event::ReadGuarantee(g) => self.peer_grant(&g),
            }
        }
    }

    /// With `policy = "adaptive"`, after the loop's update or a change of flows: the law
    /// takes feedback or plans for the new counts, and the allotments are published when
    /// they changed. Nothing is done (nor allocated) when neither happened.
    fn drive_adaptive(&mut self) {
        let Some(driver) = &mut self.adaptive else {
            return;
        };
        let seen = (
            self.lp.updates(),
            self.lp.generation(),
            self.flows.len(),
            self.flows.values().filter(|f| f.active).count(),
            self.remote_ends,
        );
        if seen == self.adaptive_seen {
            return;
        }
        let updated = seen.0 != self.adaptive_seen.0;
        self.adaptive_seen = seen;
        let config = &self.config;
        let flows = self.flows.iter().map(|(&id, f)| DriverFlow {
            flow: ChargedFlow {
                flow: HostFlow {
                    spec: FlowSpec {
                        id: FlowId(id),
                        tenant: TenantId(f.tenant),
                        class: f.class,
                        weight: config.weight_of(f.uid, f.pod.as_ref()),
                    },
                    qps: f.qps,
                },
                charged: f.remote.map_or(Resource::SendPath, |(peer, role)| {
                    Resource::of(role == justitia_peer::wire::Role::Read, peer)
                }),
                peer: f.remote.map(|(peer, _)| peer),
            },
            active: f.active,
            bytes: f.bytes,
            ops: f.ops,
        });
        let target = self.lp.target().value;
        let changed = if updated {
            let now = Duration::from_nanos(now_ns());
            driver.update(now, flows, target, self.lp.current_p99())
        } else {
            driver.flows_changed(flows, target)
        };
        if changed {
            self.publish_allotments();
        }
    }
}
