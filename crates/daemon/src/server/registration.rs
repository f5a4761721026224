//! Registration: accepting shapers on the registration socket and serving their messages.
//!
//! Inputs: connections to the registration socket (any local user may connect) and the
//! messages they send: registrations, usage reports, unregistrations, remote ends,
//! pairings (see [`crate::pairing`]).
//! Outputs: connections held ([`Client`]), flows registered in the [`ControlLoop`](justitia_core::control_loop::ControlLoop) and
//! given a slot in their tenant's page ([`Flow`], [`TenantPage`]), replies, and the
//! reclaim of a connection's flows when it hangs up or its process exits.
//!
//! Identity is the kernel's: a connection's uid and pid come from `SO_PEERCRED` when it is
//! accepted, and a pidfd of its process (see [`crate::tenant`]) tells when the process is
//! gone even if a child inherited its socket. Each connection is greeted with two sealed
//! memfds: the shared control block (what every tenant may see) and the private page of
//! its tenant, created at the tenant's first connection and dropped after its last. No
//! connection is ever given another tenant's page.
//!
//! Invariants (see [`crate::limits`] for the caps):
//! - connections are capped per uid and in all; `accept` at the descriptor limit (EMFILE,
//!   ENFILE) or at the connection cap pauses the listener for [`LISTEN_PAUSE`] instead of
//!   spinning on a readable listener;
//! - a connection is served at most [`MESSAGES_PER_TURN`] messages per pass and never
//!   past the pass's deadline;
//! - flows are capped per uid, per tenant and in all; a message about a flow is taken only
//!   from the connection that registered it;
//! - a flow's reported remote end counts only when it names a member of the peer channel
//!   ([`PeerLink::is_member`](crate::peer::PeerLink::is_member)), and a tenant's flows name
//!   at most `max_remote_ends_per_tenant` distinct peers: so a local tenant neither fills
//!   the channel's table of peers nor aims its datagrams, and a refused flow stays paced
//!   here as a local flow;
//! - a pairing is held only for a flow the connection owns whose remote end is a member
//!   or this host, and only within [`crate::pairing`]'s caps; a side channel found is
//!   told only to the connection that reported the pairing;
//! - a claimed uid must be the kernel's; every refusal is counted under its reason, and
//!   every log line a peer can cause is rate-limited;
//! - a connection that hangs up, or whose process exits, has its flows reclaimed on that
//!   wake-up, so their share goes to the others at the next update.

use std::collections::BTreeSet;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use justitia_agent::block::BlockWriter;
use justitia_agent::proto::{
    AdmissionReply, LatencyReport, Paired, ParseError, QpPairing, RefuseReason, Register,
    RemoteEnd, Reply, Request, LATENCY_LONGEST, MAX_MESSAGE, NO_UID,
};
use justitia_core::control_loop::FlowRegistration;
use justitia_core::controller::Admission;
use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId};
use justitia_peer::NodeId;
use rustix::net::{RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags};
use tracing::{debug, error, info, warn};

use crate::config::{AdmissionPolicy, TenantBy};
use crate::kubepods::PodName;
use crate::limits::CapOwner;
use crate::limits::{LogKind, SlotCounts};
use crate::metrics::{Label, Tenant, TenantReason};
use crate::pairing::{Found, LocalPairing};

use super::{
    now_ns, Client, Daemon, Flow, TenantPage, EVENTS, LISTEN_PAUSE, MESSAGES_PER_TURN,
    NAMED_TENANT_BASE, TAG_LISTEN,
};

/// A remote end refused: it names no member of the peer channel.
const REMOTE_NOT_A_MEMBER: &str = "remote_not_a_member";
/// A remote end refused: its tenant names `max_remote_ends_per_tenant` peers already.
const TOO_MANY_REMOTE_ENDS: &str = "too_many_remote_ends";

impl Daemon {
    pub(super) fn listen_interest(&self, flags: rustix::event::epoll::EventFlags) {
        if let Err(e) = rustix::event::epoll::modify(
            &self.epoll,
            &self.listener,
            rustix::event::epoll::EventData::new_u64(TAG_LISTEN),
            flags,
        ) {
            error!(error = %e, "changing the registration socket's watch");
        }
    }

    fn pause_listener(&mut self, now: u64) {
        if self.listen_paused_until == 0 {
            self.listen_interest(rustix::event::epoll::EventFlags::empty());
        }
        self.listen_paused_until = now.saturating_add(LISTEN_PAUSE.as_nanos() as u64);
    }

    /// Accepts the pending connections (at most [`EVENTS`] per pass): caps per uid and in
    /// all, the peer's identity and pidfd, its tenant, and the greeting with the shared
    /// block and the tenant's page.
    pub(super) fn accept(&mut self, now: u64) {
        for _ in 0..EVENTS {
            if self.clients.len() >= self.max_clients {
                if self.log_ok(LogKind::Accept, now) {
                    warn!(
                        connections = self.clients.len(),
                        "connection cap reached: registration socket paused"
                    );
                }
                self.pause_listener(now);
                return;
            }
            let sock = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(
                    e @ (rustix::io::Errno::MFILE
                    | rustix::io::Errno::NFILE
                    | rustix::io::Errno::NOBUFS
                    | rustix::io::Errno::NOMEM),
                ) => {
                    // The listener stays readable: waiting on it again would spin.
                    if self.log_ok(LogKind::Accept, now) {
                        warn!(error = %e, pause_ms = LISTEN_PAUSE.as_millis() as u64,
                              "accept on the registration socket: out of descriptors, paused");
                    }
                    self.pause_listener(now);
                    return;
                }
                Err(e) => {
                    if self.log_ok(LogKind::Accept, now) {
                        warn!(error = %e, "accept on the registration socket");
                    }
                    continue;
                }
            };
            self.admit(now, sock);
        }
    }

    fn refuse_connection(&mut self, now: u64, reason: &str, detail: std::fmt::Arguments<'_>) {
        self.metrics
            .refused
            .get_or_create(&Label {
                value: reason.into(),
            })
            .inc();
        if self.log_ok(LogKind::Accept, now) {
            warn!(reason, detail = %detail, "connection dropped");
        }
    }

    /// The tenant of a connecting process, by `tenant`: its uid; its cgroup; the pod that
    /// cgroup is of (named `pod/<namespace>/<pod>`, or `pod/<UID>` until kubelet's log
    /// directory names it); that pod's namespace (`namespace/<namespace>`; the pod while
    /// the namespace is not found), the names the weights take. A peer whose pid the daemon cannot see (another pid
    /// namespace) has no cgroup to read: it is its uid's tenant. The pod's name, when
    /// found, is kept for its weight whatever `tenant` says.
    fn identify(
        &mut self,
        now: u64,
        uid: u32,
        pid: i32,
        pidfd: Option<&OwnedFd>,
    ) -> Result<Identity, String> {
        if self.config.tenant == TenantBy::Uid || pid == 0 {
            return Ok(Identity {
                tenant: u64::from(uid),
                name: uid.to_string(),
                owner: CapOwner::Uid(uid),
                pod: None,
            });
        }
        let path = crate::tenant::peer_cgroup(pid, pidfd)?;
        let pod_uid = crate::kubepods::pod_of_cgroup(&path);
        let pod = pod_uid
            .as_deref()
            .and_then(|u| self.pods.lookup(Duration::from_nanos(now), u).cloned());
        let by_pod = matches!(self.config.tenant, TenantBy::Pod | TenantBy::Namespace);
        let (key, name) = match (&pod_uid, &pod) {
            (Some(_), Some(p)) if self.config.tenant == TenantBy::Namespace => (
                format!("namespace:{}", p.namespace),
                format!("namespace/{}", p.namespace),
            ),
            (Some(u), _) if by_pod => {
                if self.config.tenant == TenantBy::Namespace && self.log_ok(LogKind::Flows, now) {
                    warn!(
                        pod = %u,
                        dir = %self.config.pod_logs_dir.display(),
                        "the pod's namespace is not in kubelet's log directory: its tenant is the pod"
                    );
                }
                let name = pod.as_ref().map_or_else(
                    || format!("pod/{u}"),
                    |p| format!("pod/{}/{}", p.namespace, p.name),
                );
                (format!("pod:{u}"), name)
            }
            _ => (path.clone(), path),
        };
        let id = match self.named_tenants.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.next_named_tenant;
                self.next_named_tenant += 1;
                self.named_tenants.insert(key, id);
                id
            }
        };
        let owner = if by_pod && pod_uid.is_some() {
            CapOwner::Tenant(id)
        } else {
            CapOwner::Uid(uid)
        };
        Ok(Identity {
            tenant: id,
            name,
            owner,
            pod,
        })
    }

    fn admit(&mut self, now: u64, sock: OwnedFd) {
        let cred = match crate::tenant::peer_cred(sock.as_fd()) {
            Ok(c) => c,
            Err(e) => {
                return self.refuse_connection(
                    now,
                    "no_credentials",
                    format_args!("SO_PEERCRED: {e}"),
                )
            }
        };
        let (uid, pid) = (cred.uid, cred.pid);
        let (pidfd, _kernel) = crate::tenant::peer_pidfd(sock.as_fd(), pid);
        let who = match self.identify(now, uid, pid, pidfd.as_ref()) {
            Ok(who) => who,
            Err(e) => {
                return self.refuse_connection(
                    now,
                    "no_cgroup",
                    format_args!("uid {uid} pid {pid}: {e}"),
                )
            }
        };
        let held = self.owner_clients.get(&who.owner).copied().unwrap_or(0);
        if held >= self.config.max_connections_per_tenant {
            return self.refuse_connection(
                now,
                "too_many_connections",
                format_args!(
                    "{} holds {held} connections",
                    owner_text(who.owner, uid, &who.name)
                ),
            );
        }
        let Identity {
            tenant,
            name: tenant_name,
            owner,
            pod,
        } = who;
        let hello = Reply::Hello {
            boot_id: self.boot_id,
        }
        .encode();
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        // This tenant's budgets counting this connection, published before the greeting:
        // the shaper reads them as soon as it has the page, so its first control verbs
        // are paced already and its QPs take turns from the first. The other tenants' follow at the end of the
        // pass.
        let weight = self.config.weight_of(uid, pod.as_ref()).get();
        let joining = self.joining_budgets(tenant, weight);
        // Whether this connection is taken or refused below, the pass ends by publishing
        // every tenant's budget from the connections it has.
        self.tenant_budgets_stale = true;
        // The tenant's page is created with its first connection and handed only to
        // its connections.
        let page = match self.pages.entry(tenant) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                match BlockWriter::create_tenant_page(self.config.slots, self.boot_id) {
                    Ok(page) => e.insert(TenantPage {
                        page,
                        free: (0..self.config.slots).rev().collect(),
                        clients: 0,
                        name: tenant_name.clone(),
                        weight: 1,
                        budgets: Default::default(),
                    }),
                    Err(err) => {
                        self.release_page(tenant);
                        return self.refuse_connection(
                            now,
                            "no_page",
                            format_args!("uid {uid} pid {pid}: tenant page not created: {err}"),
                        );
                    }
                }
            }
        };
        page.publish(joining);
        let fds = [self.block.fd(), page.page.fd()];
        control.push(SendAncillaryMessage::ScmRights(&fds));
        if let Err(e) = rustix::net::sendmsg(
            &sock,
            &[IoSlice::new(&hello)],
            &mut control,
            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        ) {
            self.release_page(tenant);
            return self.refuse_connection(
                now,
                "greeting_not_sent",
                format_args!("uid {uid} pid {pid}: {e}"),
            );
        }
        let id = self.next_client;
        self.next_client += 1;
        if let Err(e) = self.watch(&sock, id << 1) {
            self.release_page(tenant);
            return self.refuse_connection(
                now,
                "not_watched",
                format_args!("uid {uid} pid {pid}: {e}"),
            );
        }
        if let Some(p) = &pidfd {
            // Without it the hang-up of the socket still reclaims the flows.
            if let Err(e) = self.watch(p, (id << 1) | 1) {
                debug!(error = %e, pid, "process exit not watched");
            }
        }
        if self.log_ok(LogKind::Flows, now) {
            debug!(
                client = id,
                uid,
                pid,
                pidfd = pidfd.is_some(),
                "shaper connected"
            );
        }
        if let Some(p) = self.pages.get_mut(&tenant) {
            p.clients += 1;
            p.weight = p.weight.max(weight);
        }
        *self.owner_clients.entry(owner).or_default() += 1;
        self.known_changed = true;
        self.tenant_budgets_stale = true;
        self.clients.insert(
            id,
            Client {
                sock,
                uid,
                pid,
                tenant,
                tenant_name,
                owner,
                pod,
                _pidfd: pidfd,
                flows: BTreeSet::new(),
            },
        );
    }

    fn refuse_message(&mut self, client: u64, reason: &str, detail: &str) {
        let (uid, pid) = self.clients.get(&client).map_or((0, 0), |c| (c.uid, c.pid));
        if self.log_ok(LogKind::Refused, now_ns()) {
            warn!(uid, pid, reason, detail, "message refused");
        }
        self.metrics
            .refused
            .get_or_create(&Label {
                value: reason.into(),
            })
            .inc();
    }

    /// Whether `client`'s connection owns `flow`; if not, the message (`what` flow) is
    /// refused as `not_owner`.
    fn owns(&mut self, client: u64, flow: u64, what: &str) -> bool {
        let owned = self
            .clients
            .get(&client)
            .is_some_and(|c| c.flows.contains(&flow));
        if !owned {
            self.refuse_message(
                client,
                "not_owner",
                &format!("{what} flow {flow} it does not own"),
            );
        }
        owned
    }

    /// A latency flow's round trips, for the adaptive law's tail (the `justitia` policy
    /// reads its reference flow's alone, and drops them). Only the flow's owner reports
    /// them, and only for a flow registered as a latency flow: a tenant's reports count
    /// under its own tenant, where they can make the law more careful and never less
    /// careful about another tenant's flows (see the core's `latency_tail`).
    fn latency_reported(&mut self, client: u64, r: LatencyReport) {
        if !self.owns(client, r.flow, "latency report for") {
            return;
        }
        let Some(f) = self.flows.get(&r.flow) else {
            return;
        };
        if f.class != FlowClass::Latency {
            let detail = format!(
                "latency report for flow {}, registered as a {} flow",
                r.flow,
                f.class.as_str()
            );
            self.refuse_message(client, "not_latency", &detail);
            return;
        }
        let tenant = TenantId(f.tenant);
        let Some(driver) = &mut self.adaptive else {
            return;
        };
        let named = LATENCY_LONGEST.min(r.count as usize);
        let mut longest = [Duration::ZERO; LATENCY_LONGEST];
        for (d, &ns) in longest.iter_mut().zip(&r.longest_ns[..named]) {
            *d = Duration::from_nanos(u64::from(ns));
        }
        driver.record_latency(tenant, u64::from(r.count), &longest[..named]);
        self.metrics.round_trips_reported.inc_by(u64::from(r.count));
    }

    /// Sends `reply` on `client`'s connection without waiting; false when it did not go
    /// (the connection is gone or its socket full).
    fn send_reply(&self, client: u64, reply: Reply) -> bool {
        self.clients.get(&client).is_some_and(|c| {
            rustix::net::send(
                &c.sock,
                &reply.encode(),
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            )
            .is_ok()
        })
    }

    pub(super) fn read_client(&mut self, now: u64, client: u64) {
        let mut buf = [0u8; MAX_MESSAGE + 1];
        // Bounded so that one busy client cannot starve the others, and by the pass's
        // budget (a message costs microseconds: a ready list of 64 connections of 16
        // messages each would take milliseconds).
        for _ in 0..MESSAGES_PER_TURN {
            if now_ns() > self.pass_deadline {
                return;
            }
            let Some(c) = self.clients.get(&client) else {
                return;
            };
            match rustix::net::recv(&c.sock, &mut buf, RecvFlags::DONTWAIT | RecvFlags::TRUNC) {
                Ok((_, 0)) => {
                    self.reclaim(now, client, "socket hang-up");
                    return;
                }
                Ok((n, total)) => {
                    let msg = &buf[..n.min(buf.len())];
                    let parsed = if total > MAX_MESSAGE {
                        Err(ParseError::Oversized { got: total })
                    } else {
                        Request::parse(msg)
                    };
                    match parsed {
                        Ok(req) => self.handle(now, client, req),
                        Err(e) => {
                            let kind = match e {
                                ParseError::Oversized { .. } => "oversized",
                                ParseError::NoHeader { .. } | ParseError::BadLength { .. } => {
                                    "truncated_or_bad_length"
                                }
                                _ => "malformed",
                            };
                            self.refuse_message(client, kind, &e.to_string());
                            self.send_reply(
                                client,
                                Reply::Refused {
                                    client_ref: 0,
                                    reason: RefuseReason::Malformed,
                                },
                            );
                        }
                    }
                }
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    self.reclaim(now, client, &format!("socket error {e}"));
                    return;
                }
            }
        }
    }

    fn handle(&mut self, now: u64, client: u64, req: Request) {
        let now_d = Duration::from_nanos(now);
        match req {
            Request::Register(r) => self.register(now_d, client, r),
            Request::Usage(u) => {
                if !self.owns(client, u.flow, "usage for") {
                    return;
                }
                if let Some(f) = self.flows.get_mut(&u.flow) {
                    f.active = u.active;
                    f.bytes = f.bytes.saturating_add(u.bytes);
                    f.ops = f.ops.saturating_add(u.ops);
                    if let Some(p) = self.pages.get(&f.tenant) {
                        p.page.set_usage(f.slot, f.bytes);
                    }
                    self.metrics
                        .tenant_usage
                        .get_or_create(&Tenant {
                            uid: f.uid.to_string(),
                        })
                        .inc_by(u.bytes);
                    if f.admission != AdmissionReply::NotAdmitted {
                        let _ = self.lp.set_flow_active(now_d, FlowId(u.flow), u.active);
                    }
                }
            }
            Request::Unregister { flow } => {
                let owned = self
                    .clients
                    .get_mut(&client)
                    .is_some_and(|c| c.flows.remove(&flow));
                if owned {
                    self.drop_flow(now_d, flow);
                } else {
                    self.refuse_message(
                        client,
                        "not_owner",
                        &format!("unregister of flow {flow} it does not own"),
                    );
                }
            }
            Request::Remote(r) => {
                if self.owns(client, r.flow, "remote end of") {
                    self.remote_reported(now_d, client, r);
                }
            }
            Request::Pairing(p) => {
                if self.owns(client, p.flow, "pairing of") {
                    self.pairing_reported(client, p);
                }
            }
            Request::Unpairing { flow, local_qpn } => {
                if self.owns(client, flow, "unpairing of") {
                    self.pairings.remove(flow, local_qpn);
                }
            }
            Request::ControlVerbs(r) => self.note_control_verbs(client, r),
            Request::QpTurns(r) => self.note_qp_turns(client, r),
            Request::Latency(r) => self.latency_reported(client, r),
            Request::UnknownLayout { found, known } => {
                // Said once per connection attempt of a shaper older or newer than this
                // daemon (its backoff reaches 1 s): counted, and logged within the limit
                // with the tenant, which names the pod.
                self.metrics
                    .shapers_unserved
                    .get_or_create(&Label {
                        value: "layout".into(),
                    })
                    .inc();
                let who = self
                    .clients
                    .get(&client)
                    .map(|c| (c.uid, c.pid, c.tenant_name.clone()));
                if let Some((uid, pid, tenant)) = who {
                    if self.log_ok(LogKind::Refused, now_ns()) {
                        warn!(
                            uid,
                            pid,
                            tenant = %tenant,
                            found,
                            known,
                            "a shaper cannot read this daemon's control block (layout {found}, it reads {known}): its flows run on static settings until one side is upgraded"
                        );
                    }
                }
            }
        }
    }

    fn register(&mut self, now: Duration, client: u64, r: Register) {
        let Some((uid, pid, tenant, tenant_name, owner, pod)) =
            self.clients.get(&client).map(|c| {
                (
                    c.uid,
                    c.pid,
                    c.tenant,
                    c.tenant_name.clone(),
                    c.owner,
                    c.pod.clone(),
                )
            })
        else {
            return;
        };
        let counts = SlotCounts {
            total: self.flows.len(),
            of_owner: self.owner_flows.get(&owner).copied().unwrap_or(0),
            of_tenant: self
                .pages
                .get(&tenant)
                .map_or(0, |p| self.config.slots as usize - p.free.len()),
        };
        let refuse = |this: &mut Self, reason: RefuseReason, why: &str, detail: String| {
            this.refuse_message(client, why, &detail);
            this.metrics
                .registrations
                .get_or_create(&Label {
                    value: "refused".into(),
                })
                .inc();
            this.send_reply(
                client,
                Reply::Refused {
                    client_ref: r.client_ref,
                    reason,
                },
            );
        };
        if r.claimed_uid != NO_UID && r.claimed_uid != uid {
            return refuse(
                self,
                RefuseReason::WrongUid,
                "wrong_uid",
                format!("claims uid {} but the kernel says {uid}", r.claimed_uid),
            );
        }
        match crate::limits::slot_verdict(
            counts,
            r.class,
            self.config.slots as usize,
            self.config.max_flows_per_tenant,
        ) {
            Ok(()) => {}
            Err(RefuseReason::TooManyFlows) => {
                return refuse(
                    self,
                    RefuseReason::TooManyFlows,
                    "too_many_flows",
                    format!(
                        "{} holds {} flows already",
                        owner_text(owner, uid, &tenant_name),
                        counts.of_owner
                    ),
                )
            }
            Err(reason) => {
                return refuse(
                    self,
                    reason,
                    "full",
                    format!(
                        "{} flows of {} slots, {} of this tenant",
                        counts.total, self.config.slots, counts.of_tenant
                    ),
                )
            }
        }
        let Some(slot) = self.pages.get_mut(&tenant).and_then(|p| p.free.pop()) else {
            return refuse(
                self,
                RefuseReason::Full,
                "full",
                format!("the tenant's page is full ({} slots)", self.config.slots),
            );
        };
        let id = self.next_flow;
        self.next_flow += 1;
        let weight = self.config.weight_of(uid, pod.as_ref());
        let spec = FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class: r.class,
            weight,
        };
        let verdict = match self
            .lp
            .register_flow(now, FlowRegistration { spec, qps: r.qps })
        {
            Ok(v) => v,
            Err(e) => {
                self.free_slot(tenant, slot);
                error!(error = %e, "control loop refused a registration");
                return refuse(self, RefuseReason::Malformed, "loop_refused", e.to_string());
            }
        };
        let admission = match verdict {
            Admission::Admitted => AdmissionReply::Admitted,
            Admission::TargetAtRisk {
                current_p99,
                target_p99,
            } => {
                let refuse_it = self.config.admission == AdmissionPolicy::Refuse;
                warn!(
                    uid,
                    pid,
                    flow = id,
                    current_p99_us = current_p99.as_secs_f64() * 1e6,
                    target_p99_us = target_p99.as_secs_f64() * 1e6,
                    admitted = !refuse_it,
                    "latency flow registered while Current99 exceeds Target99"
                );
                if refuse_it {
                    let _ = self.lp.remove_flow(now, FlowId(id));
                    AdmissionReply::NotAdmitted
                } else {
                    AdmissionReply::AdmittedWithWarning
                }
            }
        };
        let verdict_label = admission.as_str();
        self.metrics
            .registrations
            .get_or_create(&Label {
                value: verdict_label.into(),
            })
            .inc();
        if admission == AdmissionReply::NotAdmitted {
            self.free_slot(tenant, slot);
            self.send_reply(
                client,
                Reply::Registered {
                    client_ref: r.client_ref,
                    flow: id,
                    slot: 0,
                    admission,
                },
            );
            return;
        }
        let flow = Flow {
            uid,
            pid,
            tenant,
            tenant_name,
            owner,
            pod,
            class: r.class,
            qps: r.qps,
            slot,
            active: false,
            bytes: 0,
            ops: 0,
            admission,
            remote: None,
        };
        if let Some(p) = self.pages.get(&tenant) {
            // No remote end is known yet: no incast cap.
            p.page.set_slot(slot, self.slot_of(id, &flow, None));
        }
        self.flows.insert(id, flow);
        *self.owner_flows.entry(owner).or_default() += 1;
        if let Some(c) = self.clients.get_mut(&client) {
            c.flows.insert(id);
        }
        if self.log_ok(LogKind::Flows, now_ns()) {
            info!(uid, pid, flow = id, class = %r.class, qps = r.qps, verdict = verdict_label, "flow registered");
        }
        self.send_reply(
            client,
            Reply::Registered {
                client_ref: r.client_ref,
                flow: id,
                slot,
                admission,
            },
        );
    }

    /// A shaper told where a flow's QP goes. The remote end counts (`peering.rs`: the
    /// flow declared to that peer, a READ requester's flow paced at its guarantee) only
    /// when it names a member of the peer channel and the flow's tenant names fewer than
    /// `max_remote_ends_per_tenant` other peers; otherwise the report's remote part is
    /// refused, counted (by reason, and by uid on the per-tenant endpoint), logged within
    /// the rate limit, and the flow counts as a local flow: registered, and paced by this
    /// host's loop, never left unpaced waiting for a guarantee no member will send.
    fn remote_reported(&mut self, now: Duration, client: u64, r: RemoteEnd) {
        let Err((reason, node)) = self.remote_verdict(&r) else {
            return self.remote_end(now, r);
        };
        let Some(f) = self.flows.get_mut(&r.flow) else {
            return;
        };
        let uid = f.uid;
        if f.remote.take().is_some() {
            self.remote_ends += 1;
            // Refused only for a flow the loop does not hold (not admitted): nothing to undo.
            let _ = self.lp.set_flow_reads_from(now, FlowId(r.flow), None);
            self.publish_allotments();
        }
        self.metrics
            .tenant_remote_ends_refused
            .get_or_create(&TenantReason {
                uid: uid.to_string(),
                reason: reason.into(),
            })
            .inc();
        let detail = match reason {
            REMOTE_NOT_A_MEMBER => format!(
                "flow {} names {node}, not a member of the peer channel: counted as local",
                r.flow
            ),
            _ => format!(
                "flow {} names {node}: its tenant names {} peers already: counted as local",
                r.flow, self.config.max_remote_ends_per_tenant
            ),
        };
        self.refuse_message(client, reason, &detail);
    }

    /// A shaper's queue pair reached RTR with its side channel: held for the rendezvous
    /// when its remote end is a member (sent there by the next pass, `peering.rs`) or
    /// this host (matched here at once: both shapers are local); refused, counted and
    /// logged within the limit otherwise (no channel, another host, or a cap reached):
    /// the queue pair's requests then go whole, as natively.
    fn pairing_reported(&mut self, client: u64, p: QpPairing) {
        let Some(tenant) = self.flows.get(&p.flow).map(|f| f.tenant) else {
            return;
        };
        let node = match &self.peer {
            None => None,
            Some(link) if p.remote_gid == [0; 16] => {
                link.settings().lids.get(&p.remote_lid).copied()
            }
            Some(_) => Some(NodeId(p.remote_gid)),
        };
        let this_host = self.peer.as_ref().map(|l| l.settings().node);
        let member =
            |n: NodeId| Some(n) == this_host || self.peer.as_ref().is_some_and(|l| l.is_member(n));
        let Some(peer) = node.filter(|&n| member(n)) else {
            let detail = match (&self.peer, node) {
                (None, _) => format!(
                    "pairing of flow {} queue pair {}: the peer channel is off",
                    p.flow, p.local_qpn
                ),
                (Some(_), Some(n)) => format!(
                    "pairing of flow {} queue pair {} names {n}, not a member",
                    p.flow, p.local_qpn
                ),
                (Some(_), None) => format!(
                    "pairing of flow {} queue pair {} names LID {}, which no member has",
                    p.flow, p.local_qpn, p.remote_lid
                ),
            };
            return self.refuse_message(client, "pairing_not_a_member", &detail);
        };
        let local = LocalPairing {
            client,
            flow: p.flow,
            tenant,
            local_qpn: p.local_qpn,
            peer,
            remote_qpn: p.remote_qpn,
            side: (p.side_qpn, p.side_qkey),
        };
        if let Err(reason) = self.pairings.insert(local) {
            let detail = format!(
                "pairing of flow {} queue pair {}: {reason}",
                p.flow, p.local_qpn
            );
            return self.refuse_message(client, reason.as_str(), &detail);
        }
        if Some(peer) == this_host {
            // Both ends on this host: no member to ask.
            let found = self.pairings.matched_here(&local);
            self.tell_found(&found);
        }
    }

    /// Tells each shaper the side channels found for its queue pairs.
    /// A side channel its shaper's socket would not take now (full) is forgotten as told,
    /// so that the member's next refresh of the pairing tells it again.
    pub(super) fn tell_found(&mut self, found: &[Found]) {
        for f in found {
            let sent = self.send_reply(
                f.client,
                Reply::Paired(Paired {
                    flow: f.flow,
                    local_qpn: f.local_qpn,
                    side_qpn: f.side.0,
                    side_qkey: f.side.1,
                }),
            );
            if sent {
                self.metrics.pairings_found.inc();
            } else {
                self.pairings.untell(f.flow, f.local_qpn);
            }
        }
    }

    /// Whether flow `r.flow`'s remote end may count; the refusal's reason and the node
    /// named if not. With the channel off, or an end on this host or at an unknown LID,
    /// it may: [`Daemon::remote_end`] then counts the flow as local by itself.
    fn remote_verdict(&self, r: &RemoteEnd) -> Result<(), (&'static str, NodeId)> {
        let Some(link) = &self.peer else {
            return Ok(());
        };
        // The node the end names: its GID, or the GID configured for its LID.
        let node = if r.gid == [0; 16] {
            match link.settings().lids.get(&r.lid) {
                Some(&node) => node,
                None => return Ok(()),
            }
        } else {
            NodeId(r.gid)
        };
        if node == link.settings().node {
            return Ok(());
        }
        if !link.is_member(node) {
            return Err((REMOTE_NOT_A_MEMBER, node));
        }
        let Some(tenant) = self.flows.get(&r.flow).map(|f| f.tenant) else {
            return Ok(());
        };
        // The distinct peers the tenant's other flows name (at most the cap of them: the
        // flows' remote ends passed this check): O(n log cap) in the n flows held.
        let cap = self.config.max_remote_ends_per_tenant;
        let mut named: BTreeSet<NodeId> = BTreeSet::new();
        let others = self
            .flows
            .iter()
            .filter(|&(&id, f)| id != r.flow && f.tenant == tenant);
        for (_, f) in others {
            let Some((peer, _)) = f.remote else { continue };
            if peer == node {
                return Ok(());
            }
            named.insert(peer);
        }
        if named.len() >= cap {
            return Err((TOO_MANY_REMOTE_ENDS, node));
        }
        Ok(())
    }

    fn drop_flow(&mut self, now: Duration, id: u64) {
        self.pairings.remove_flow(id);
        if let Some(f) = self.flows.remove(&id) {
            if let std::collections::hash_map::Entry::Occupied(mut e) =
                self.owner_flows.entry(f.owner)
            {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
            let _ = self.lp.remove_flow(now, FlowId(id));
            if let Some(p) = self.pages.get(&f.tenant) {
                p.page.clear_slot(f.slot);
            }
            self.free_slot(f.tenant, f.slot);
        }
    }

    fn free_slot(&mut self, tenant: u64, slot: u32) {
        if let Some(p) = self.pages.get_mut(&tenant) {
            p.free.push(slot);
        }
    }

    /// Drops a tenant's page once it has no connection and no flow left: its next
    /// connection gets a new one. A cgroup's, pod's or namespace's tenant id goes with
    /// it, so the map of named tenants holds only tenants that are connected.
    fn release_page(&mut self, tenant: u64) {
        let slots = self.config.slots as usize;
        let unused = self
            .pages
            .get(&tenant)
            .is_none_or(|p| p.clients == 0 && p.free.len() == slots);
        if unused {
            if let Some(p) = self.pages.remove(&tenant) {
                self.forget_tenant_budgets(&p.name);
            }
            if tenant >= NAMED_TENANT_BASE {
                self.named_tenants.retain(|_, &mut id| id != tenant);
            }
        }
    }

    pub(super) fn reclaim(&mut self, now: u64, client: u64, why: &str) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        self.known_changed = true;
        self.tenant_budgets_stale = true;
        let n = c.flows.len();
        for id in c.flows {
            self.drop_flow(Duration::from_nanos(now), id);
        }
        if let Some(p) = self.pages.get_mut(&c.tenant) {
            p.clients = p.clients.saturating_sub(1);
        }
        self.release_page(c.tenant);
        if let std::collections::hash_map::Entry::Occupied(mut e) =
            self.owner_clients.entry(c.owner)
        {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
        self.metrics.reclaims.inc_by(n as u64);
        if self.log_ok(LogKind::Flows, now) {
            if n > 0 {
                info!(uid = c.uid, pid = c.pid, flows = n, why, "flows reclaimed");
            } else {
                debug!(uid = c.uid, pid = c.pid, why, "shaper disconnected");
            }
        }
    }
}

/// Who a connecting process is, for tenancy and caps.
struct Identity {
    tenant: u64,
    name: String,
    owner: CapOwner,
    pod: Option<PodName>,
}

/// A cap owner as a log line names it.
fn owner_text(owner: CapOwner, uid: u32, tenant_name: &str) -> String {
    match owner {
        CapOwner::Uid(_) => format!("uid {uid}"),
        CapOwner::Tenant(_) => format!("tenant {tenant_name}"),
    }
}
