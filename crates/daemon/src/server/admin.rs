//! The admin socket: `justitia status`, `flows`, `unshaped` and `set target`.
//!
//! Inputs: connections to the admin socket (mode 0660, its group `admin_group`) and one
//! JSON request line each. Outputs: one JSON answer line each; `set target` changes the
//! running loop's Target99.
//!
//! Invariants: only root, the daemon's own user and members of the admin group are
//! answered (anyone else gets the refusal, and no request is read); a connection is served
//! without blocking, as its socket becomes ready, within [`ADMIN_DEADLINE`] overall, and
//! at most [`MAX_ADMIN_CONNECTIONS`] at once; a request is read up to
//! [`MAX_ADMIN_REQUEST`] bytes. The `unshaped` answer is encoded by the scanning thread
//! and only referenced here, never copied.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use justitia_agent::admin::{
    AdminReply, AdminRequest, FlowReport, StatusReport, MAX_ADMIN_REQUEST,
};
use justitia_core::control_loop::Target99;
use justitia_core::controller::ControlMode;
use rustix::net::{RecvFlags, SendFlags, SocketFlags};
use tracing::{info, warn};

use crate::config::{group_id, parse_target};
use crate::limits::LogKind;

use super::{
    now_ns, own_admin_socket, AdminConn, Daemon, ADMIN_DEADLINE, MAX_ADMIN_CONNECTIONS,
    TAG_ADMIN_CONN,
};

impl Daemon {
    /// Root, the daemon's own user, the admin group as primary group, or (for a peer whose
    /// pid the daemon can see) as a supplementary group.
    fn admin_allowed(&self, uid: u32, gid: u32, pid: i32) -> bool {
        if uid == 0 || uid == rustix::process::geteuid().as_raw() {
            return true;
        }
        let Some(admin) = self.config.admin_group.as_deref().and_then(group_id) else {
            return false;
        };
        if gid == admin {
            return true;
        }
        if pid <= 0 {
            return false;
        }
        // Supplementary groups are not in SO_PEERCRED; /proc has them for a live pid.
        std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(admin)))
        })
    }

    /// Accepts admin connections, at most [`MAX_ADMIN_CONNECTIONS`] at once: each is
    /// then served as its socket becomes ready, never waited on.
    pub(super) fn accept_admin(&mut self, now: u64) {
        for _ in 0..MAX_ADMIN_CONNECTIONS {
            let sock = match rustix::net::accept_with(
                &self.admin,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    if self.log_ok(LogKind::Admin, now) {
                        warn!(error = %e, "accept on the admin socket");
                    }
                    return;
                }
            };
            if self.admins.len() >= MAX_ADMIN_CONNECTIONS {
                if self.log_ok(LogKind::Admin, now) {
                    warn!(
                        open = self.admins.len(),
                        "admin connection closed: too many at once"
                    );
                }
                continue;
            }
            let Ok(cred) = crate::tenant::peer_cred(sock.as_fd()) else {
                continue;
            };
            let allowed = self.admin_allowed(cred.uid, cred.gid, cred.pid);
            let id = self.next_admin;
            self.next_admin += 1;
            let tag = TAG_ADMIN_CONN | id;
            if self.watch(&sock, tag).is_err() {
                continue;
            }
            let mut conn = AdminConn {
                sock,
                allowed,
                input: Vec::new(),
                output: Arc::from(Vec::new()),
                sent: 0,
                deadline: now.saturating_add(ADMIN_DEADLINE.as_nanos() as u64),
            };
            if !allowed {
                if self.log_ok(LogKind::Admin, now) {
                    warn!(
                        uid = cred.uid,
                        "admin request refused: not root nor in the admin group"
                    );
                }
                conn.output = Self::encode_admin(&AdminReply::Error(
                    "permission denied: root or the admin group only".into(),
                ))
                .into();
            }
            self.admins.insert(id, conn);
            // The refusal is written at once; a request is read when it arrives.
            if !allowed {
                self.serve_admin(id);
            }
        }
    }

    fn encode_admin(reply: &AdminReply) -> Vec<u8> {
        let mut text = serde_json::to_string(reply)
            .unwrap_or_else(|e| format!("{{\"error\":\"answer not encoded: {e}\"}}"));
        text.push('\n');
        text.into_bytes()
    }

    /// Reads what an admin connection has sent without waiting, answers once its line is
    /// complete, and writes what the socket takes; closes it when the answer is out.
    pub(super) fn serve_admin(&mut self, id: u64) {
        let Some(mut conn) = self.admins.remove(&id) else {
            return;
        };
        if conn.allowed && conn.output.is_empty() {
            let mut chunk = [0u8; 512];
            let mut ended = false;
            while !conn.input.contains(&b'\n') && conn.input.len() <= MAX_ADMIN_REQUEST {
                match rustix::net::recv(&conn.sock, &mut chunk, RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        ended = true;
                        break;
                    }
                    Ok((n, _)) => conn.input.extend_from_slice(&chunk[..n]),
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => return,
                }
            }
            let complete = conn.input.contains(&b'\n') || conn.input.len() > MAX_ADMIN_REQUEST;
            if !complete && !ended {
                self.admins.insert(id, conn);
                return;
            }
            let line = conn.input.split(|&b| b == b'\n').next().unwrap_or_default();
            conn.output = if conn.input.len() > MAX_ADMIN_REQUEST && !conn.input.contains(&b'\n') {
                Self::encode_admin(&AdminReply::Error(format!(
                    "request longer than {MAX_ADMIN_REQUEST} bytes"
                )))
                .into()
            } else {
                match serde_json::from_slice::<AdminRequest>(line) {
                    Ok(req) => self.admin_request(req),
                    Err(e) => {
                        Self::encode_admin(&AdminReply::Error(format!("bad request: {e}"))).into()
                    }
                }
            };
        }
        while conn.sent < conn.output.len() {
            match rustix::net::send(
                &conn.sock,
                &conn.output[conn.sent..],
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            ) {
                Ok(n) => conn.sent += n,
                Err(rustix::io::Errno::AGAIN) => {
                    let _ = rustix::event::epoll::modify(
                        &self.epoll,
                        &conn.sock,
                        rustix::event::epoll::EventData::new_u64(TAG_ADMIN_CONN | id),
                        rustix::event::epoll::EventFlags::OUT,
                    );
                    self.admins.insert(id, conn);
                    return;
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return,
            }
        }
    }

    /// The encoded answer to `req`.
    fn admin_request(&mut self, req: AdminRequest) -> Arc<[u8]> {
        let reply = match req {
            // Encoded by the scanning thread: the loop only takes a reference.
            AdminRequest::Unshaped => {
                return match &self.unshaped {
                    None => crate::unshaped::off_answer(),
                    Some(scanner) => scanner.answer().unwrap_or_else(|| {
                        Self::encode_admin(&AdminReply::Error(
                            "the table of unshaped processes was being replaced: ask again".into(),
                        ))
                        .into()
                    }),
                }
            }
            AdminRequest::Status => AdminReply::Status(self.status()),
            AdminRequest::Flows => {
                let caps = self.incast_caps();
                AdminReply::Flows(
                    self.flows
                        .iter()
                        .map(|(&id, f)| FlowReport {
                            flow: id,
                            uid: f.uid,
                            tenant: f.tenant_name.clone(),
                            weight: self.config.weight_of(f.uid, f.pod.as_ref()).get(),
                            pid: f.pid,
                            class: f.class.to_string(),
                            qps: f.qps,
                            active: f.active,
                            admission: f.admission.as_str().into(),
                            allot_bytes_per_sec: self.allotted_bytes(id, self.incast_cap(&caps, f)),
                            remote: f
                                .remote
                                .map(|(peer, role)| super::peering::describe_remote(peer, role)),
                            read_guarantee_bytes_per_sec: self
                                .flow_guarantee(id)
                                .map(|g| g.bytes_per_sec),
                            bytes: f.bytes,
                        })
                        .collect(),
                )
            }
            AdminRequest::Tenants => AdminReply::Tenants(self.tenant_reports()),
            AdminRequest::SetTarget { target } => match parse_target(&target) {
                // The running loop keeps SafeUtil, the flows and the probe window: a
                // new target must not throw away what the controller has learnt.
                Ok(t) => match self.lp.set_target(Duration::from_nanos(now_ns()), t) {
                    Ok(()) => {
                        self.config.target = t;
                        info!(?t, "Target99 set over the admin socket");
                        AdminReply::Done(format!("target set to {}", describe_target(t)))
                    }
                    Err(e) => AdminReply::Error(format!("target refused: {e}")),
                },
                Err(e) => AdminReply::Error(e),
            },
        };
        Self::encode_admin(&reply).into()
    }

    /// The status as the admin socket reports it.
    pub fn status(&self) -> StatusReport {
        let t = self.lp.target();
        let c = self.lp.counts();
        let info = self.probe.info();
        StatusReport {
            boot_id: self.boot_id,
            device: format!("{}:{}", info.device, info.port),
            profile: self.profile.name.clone(),
            max_rate: self.lp.max_rate(),
            safe_util: self.lp.safe_util(),
            current_p99_ns: self.lp.current_p99().map(|d| d.as_nanos() as u64),
            target_p99_ns: t.value.map(|d| d.as_nanos() as u64),
            idle_p99_ns: t.idle_p99.map(|d| d.as_nanos() as u64),
            probes: self.probes_ok,
            probes_lost: self.probes_lost,
            probe_path: match self.probe.path() {
                crate::probe::ReferencePath::Loopback => "loopback".into(),
                crate::probe::ReferencePath::Wire(peer) => {
                    format!("wire to {}", crate::peer::host_name(peer))
                }
            },
            latency: c.latency,
            bandwidth: c.bandwidth,
            throughput: c.throughput,
            flows: self.flows.len(),
            tenants: self.pages.len(),
            cgroups: self.named_tenants.len(),
            mode: match self.lp.mode() {
                ControlMode::Normal => "normal".into(),
                ControlMode::Unattainable { .. } => "unattainable".into(),
            },
            adaptive: self.adaptive.as_ref().map(|d| Box::new(d.state())),
        }
    }

    pub(super) fn own_admin_socket(&self) {
        own_admin_socket(&self.config);
    }
}

fn describe_target(t: Target99) -> String {
    match t {
        Target99::Absolute(d) => format!("{} us", d.as_secs_f64() * 1e6),
        Target99::IdleMultiple(m) => format!("{m} x the idle p99"),
    }
}
