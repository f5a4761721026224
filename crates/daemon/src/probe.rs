//! The reference flow: where probe latencies come from.
//!
//! [`Probe`] is the daemon's only view of it, so the event loop runs the same way on a real
//! port ([`VerbsProbe`]) and in host tests ([`SyntheticProbe`]). A probe is sent with the
//! id the control loop handed out and completes (or fails) later; each collected
//! completion carries the time it happened ([`Completion::at_ns`]), so the loop measures
//! post-to-completion without having to wake up at the moment of the completion: the
//! daemon wakes once per RefPeriod while probes are due, posts the probe on that wake, and takes its
//! completion either on the same wake ([`Probe::await_completion`], a bounded poll of the
//! CQ for a probe that completes within microseconds) or on a later one.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use justitia_peer::wire::ProbeEndpoint;
use justitia_peer::NodeId;
use justitia_verbs::sys::{
    ibv_wc, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_LINK_LAYER_INFINIBAND,
    IBV_PORT_ACTIVE, IBV_WC_SUCCESS,
};
use justitia_verbs::{
    CompletionChannel, CompletionQueue, Context, Ibverbs, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, SendRequest,
};
use tracing::{info, warn};

use crate::gid::{self, GidChoice};
use crate::wire_probe::{Answered, Requester, Responders, Site, TARGET_OFFSET};

/// What the probe runs on.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeInfo {
    /// Device name (`synthetic` for the synthetic probe).
    pub device: String,
    /// Port number.
    pub port: u8,
    /// The port's line rate, bits/s (0 when unknown).
    pub line_rate_bps: f64,
    /// The built-in profile that matches the port, if any.
    pub profile_hint: Option<String>,
}

/// One collected completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The probe's id.
    pub id: u64,
    /// Completed successfully.
    pub ok: bool,
    /// When it completed (`CLOCK_MONOTONIC` ns): the time a poll first saw it, or the
    /// synthetic probe's due time; never later than its collection.
    pub at_ns: u64,
}

/// How long [`Probe::await_completion`] polls for a probe it has just posted before
/// leaving it to the completion channel: a probe on an idle RNIC completes in a few
/// microseconds, far less than what a second wake-up costs (about 18 us of CPU on a
/// virtual machine), and a contended one that takes longer is still seen, one wake-up
/// later.
pub const AWAIT_LIMIT: std::time::Duration = std::time::Duration::from_micros(30);

/// A source of reference-flow probes.
pub trait Probe {
    /// What it runs on.
    fn info(&self) -> ProbeInfo;
    /// Posts probe `id` now.
    fn send(&mut self, id: u64, now_ns: u64) -> Result<(), String>;
    /// A descriptor that becomes readable when a completion arrives that
    /// [`await_completion`](Self::await_completion) did not see.
    fn fd(&self) -> Option<RawFd>;
    /// Right after a [`send`](Self::send): collects the completions that arrive before
    /// `deadline_ns`, returning at the first; what arrives later raises the descriptor.
    fn await_completion(&mut self, deadline_ns: u64, out: &mut Vec<Completion>);
    /// Collects the completions available at `now_ns`; `signalled` says the descriptor
    /// was found readable (its event is then acknowledged).
    fn collect(&mut self, now_ns: u64, signalled: bool, out: &mut Vec<Completion>);
    /// Probes sent and not yet collected.
    fn outstanding(&self) -> usize;
    /// Where the probes go now.
    fn path(&self) -> ReferencePath {
        ReferencePath::Loopback
    }
    /// The offer to keep before the reference peer's daemon (see [`crate::wire_probe`]),
    /// when one is configured.
    fn offer(&mut self, _now_ns: u64) -> Option<(NodeId, ProbeEndpoint)> {
        None
    }
    /// A peer's answer to this host's offer. True when the probes now cross the wire for
    /// the first time: the loop must measure the new path.
    fn answered(&mut self, _peer: NodeId, _answer: ProbeEndpoint) -> bool {
        false
    }
    /// A member's offer of its requester: a responder is made for it
    /// ([`Probe::take_answers`] hands out the answer).
    fn serve_offer(&mut self, _peer: NodeId, _offer: ProbeEndpoint) {}
    /// The answers to send members whose offers were served since the last call.
    fn take_answers(&mut self, _now_ns: u64, _out: &mut Vec<(NodeId, ProbeEndpoint)>) {}
}

/// Where the reference flow's probes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReferencePath {
    /// In loopback on this host's port: no reference peer configured, or its daemon has
    /// not answered yet.
    Loopback,
    /// Across the wire to a peer daemon's queue pair.
    Wire(NodeId),
}

/// A constant latency, no device: for hosts without RDMA and for tests. A probe completes
/// `latency` after it is sent and is collected at the daemon's next wake-up, stamped with
/// its due time, so the synthetic probe never wakes the daemon.
#[derive(Debug)]
pub struct SyntheticProbe {
    latency_ns: u64,
    pending: VecDeque<(u64, u64)>,
}

impl SyntheticProbe {
    /// Probes that complete `latency` after they are sent.
    pub fn new(latency: Duration) -> Self {
        SyntheticProbe {
            latency_ns: latency.as_nanos() as u64,
            pending: VecDeque::new(),
        }
    }
}

impl Probe for SyntheticProbe {
    fn info(&self) -> ProbeInfo {
        ProbeInfo {
            device: "synthetic".into(),
            port: 1,
            line_rate_bps: 0.0,
            profile_hint: None,
        }
    }
    fn send(&mut self, id: u64, now_ns: u64) -> Result<(), String> {
        self.pending.push_back((id, now_ns + self.latency_ns));
        Ok(())
    }
    fn fd(&self) -> Option<RawFd> {
        None
    }
    fn await_completion(&mut self, _deadline_ns: u64, _out: &mut Vec<Completion>) {
        // Nothing to poll: the completion's time is known, it is collected later.
    }
    fn collect(&mut self, now_ns: u64, _signalled: bool, out: &mut Vec<Completion>) {
        while let Some(&(id, due)) = self.pending.front() {
            if due > now_ns {
                break;
            }
            self.pending.pop_front();
            out.push(Completion {
                id,
                ok: true,
                at_ns: due,
            });
        }
    }
    fn outstanding(&self) -> usize {
        self.pending.len()
    }
}

/// A port's line rate from `ibv_port_attr`'s active width and speed codes, bits/s.
pub fn line_rate_bps(active_width: u8, active_speed: u8) -> Option<f64> {
    let lanes = match active_width {
        1 => 1.0,
        2 => 4.0,
        4 => 8.0,
        8 => 12.0,
        16 => 2.0,
        _ => return None,
    };
    let gbps_per_lane = match active_speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0625,
        32 => 25.78125,
        64 => 53.125,
        128 => 106.25,
        _ => return None,
    };
    Some(lanes * gbps_per_lane * 1e9)
}

/// The built-in profile nearest a port: `ib-*` or `roce-*` by link layer, the nearest
/// speed among the built-ins.
pub fn profile_for(infiniband: bool, line_rate_bps: f64) -> String {
    let candidates: &[(&str, f64)] = if infiniband {
        &[("ib-56", 56e9), ("ib-100", 100e9)]
    } else {
        &[("roce-10", 10e9), ("roce-40", 40e9), ("roce-100", 100e9)]
    };
    let mut best = candidates[0];
    for &c in candidates {
        if (c.1 - line_rate_bps).abs() < (best.1 - line_rate_bps).abs() {
            best = c;
        }
    }
    best.0.to_string()
}

/// The reference flow on real verbs: two RC QPs on one port connected to each other,
/// 10 B RDMA WRITEs from one to the other. Right after the post the daemon polls the CQ
/// for at most [`AWAIT_LIMIT`]; only a probe that takes longer arms the CQ's completion
/// channel, so the daemon sleeps in epoll instead of spinning a core and is woken for it.
/// The CQ is armed only then: a completion seen by the poll raises no event and costs no
/// second wake-up. The measured time is post to the poll that saw the completion (or
/// to the wake-up the channel caused, for a slow probe).
///
/// With a reference peer (`probe_peer`), the probes go in loopback until that peer's
/// daemon has answered this host's offer, and across the wire to its queue pair from then
/// on ([`crate::wire_probe`]); every verbs probe also answers members' offers.
pub struct VerbsProbe {
    info: ProbeInfo,
    channel: CompletionChannel,
    site: Site,
    sender: QueuePair,
    _target: QueuePair,
    _ctx: Context,
    requester: Option<Requester>,
    responders: Responders,
    /// Probes failed at their post across a broken wire path, to be collected as lost.
    failed: Vec<u64>,
    wc: Vec<ibv_wc>,
    /// Probes posted and not yet collected.
    outstanding: usize,
    /// The CQ is armed: an event is due on the channel for the next completion.
    armed: bool,
}

impl VerbsProbe {
    /// Opens `device` (or the first with an active port) on `port` (or its first active
    /// port) and connects the loopback pair through the GID `gid` selects
    /// ([`select_gid`]); with `peer`, makes the requester to offer that member.
    pub fn open(
        device: Option<&str>,
        port: Option<u8>,
        gid: GidChoice,
        peer: Option<NodeId>,
    ) -> Result<Self, String> {
        let verbs = Arc::new(Ibverbs::load().map_err(|e| format!("loading libibverbs: {e}"))?);
        let names: Vec<String> = match device {
            Some(d) => vec![d.to_string()],
            None => Context::devices(&verbs)
                .map_err(|e| format!("listing RDMA devices: {e}"))?
                .into_iter()
                .map(|d| d.name)
                .collect(),
        };
        let mut chosen = None;
        for name in &names {
            let ctx = Context::open(Arc::clone(&verbs), Some(name))
                .map_err(|e| format!("opening {name}: {e}"))?;
            let ports = ctx
                .query_device()
                .map_err(|e| format!("querying {name}: {e}"))?
                .phys_port_cnt;
            let candidates: Vec<u8> = match port {
                Some(p) => vec![p],
                None => (1..=ports).collect(),
            };
            for p in candidates {
                let attr = ctx
                    .query_port(p)
                    .map_err(|e| format!("querying {name} port {p}: {e}"))?;
                if attr.state == IBV_PORT_ACTIVE {
                    chosen = Some((ctx, p, attr));
                    break;
                }
            }
            if chosen.is_some() {
                break;
            }
        }
        let (ctx, port, attr) = chosen.ok_or_else(|| {
            format!(
                "no active port on {} (port {})",
                if names.is_empty() {
                    "any device".into()
                } else {
                    names.join(", ")
                },
                port.map_or("any".into(), |p| p.to_string())
            )
        })?;
        let rate = line_rate_bps(attr.active_width, attr.active_speed).unwrap_or(0.0);
        let ib = u32::from(attr.link_layer) == IBV_LINK_LAYER_INFINIBAND;
        let info = ProbeInfo {
            device: ctx.name().to_string(),
            port,
            line_rate_bps: rate,
            profile_hint: (rate > 0.0).then(|| profile_for(ib, rate)),
        };
        let gid_index = select_gid(ctx.name(), port, gid, ib)?;
        let e = |what: &'static str| {
            move |err: justitia_verbs::VerbsError| format!("{what} on {}: {err}", info_name(port))
        };
        let pd = ProtectionDomain::new(&ctx).map_err(e("allocating a PD"))?;
        let channel = CompletionChannel::new(&ctx).map_err(e("creating a completion channel"))?;
        // SAFETY: the channel's descriptor is live while `channel` is, which outlives this use.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(channel.fd()) };
        let flags = rustix::fs::fcntl_getfl(fd).map_err(|err| format!("F_GETFL: {err}"))?;
        rustix::fs::fcntl_setfl(fd, flags | rustix::fs::OFlags::NONBLOCK)
            .map_err(|err| format!("making the completion channel non-blocking: {err}"))?;
        let cq = CompletionQueue::new(&ctx, 256, Some(&channel)).map_err(e("creating the CQ"))?;
        let quiet_cq = CompletionQueue::new(&ctx, 16, None).map_err(e("creating the CQ"))?;
        let caps = QpCaps {
            max_send_wr: 128,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let sender =
            QueuePair::create_rc(&pd, &cq, &cq, caps).map_err(e("creating the probe QP"))?;
        let target = QueuePair::create_rc(&pd, &quiet_cq, &quiet_cq, caps)
            .map_err(e("creating the target QP"))?;
        let mr = MemoryRegion::new(&pd, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
            .map_err(e("registering the probe buffer"))?;
        let (psn_a, psn_b) = (0x1234, 0x5678);
        let ea = sender
            .endpoint(port, gid_index, psn_a)
            .map_err(e("reading the endpoint"))?;
        let eb = target
            .endpoint(port, gid_index, psn_b)
            .map_err(e("reading the endpoint"))?;
        sender
            .connect(port, gid_index, psn_a, &eb)
            .map_err(e("connecting the probe QP"))?;
        target
            .connect(port, gid_index, psn_b, &ea)
            .map_err(e("connecting the target QP"))?;
        let site = Site {
            pd,
            cq,
            quiet_cq,
            mr,
            port,
            gid_index,
        };
        let requester = match peer {
            Some(peer) => Some(Requester::new(peer, &site, now_ns())?),
            None => None,
        };
        Ok(VerbsProbe {
            info,
            channel,
            site,
            sender,
            _target: target,
            _ctx: ctx,
            requester,
            responders: Responders::default(),
            failed: Vec::new(),
            wc: vec![ibv_wc::default(); 32],
            outstanding: 0,
            armed: false,
        })
    }

    /// Polls the CQ empty, stamping what it finds `now_ns`; returns how many it found.
    fn drain(&mut self, now_ns: u64, out: &mut Vec<Completion>) -> usize {
        let mut found = self.failed.len();
        out.extend(self.failed.drain(..).map(|id| Completion {
            id,
            ok: false,
            at_ns: now_ns,
        }));
        let looped = self.sender.qp_num();
        while let Ok(n) = self.site.cq.poll(&mut self.wc) {
            for wc in &self.wc[..n] {
                let ok = wc.status == IBV_WC_SUCCESS;
                let current = wc.qp_num == looped
                    || self
                        .requester
                        .as_mut()
                        .is_some_and(|r| r.completed(wc.qp_num, ok));
                // A completion of a requester since made again was taken off the count
                // when it was (see `offer`): it is handed on, not counted twice.
                if current {
                    found += 1;
                }
                out.push(Completion {
                    id: wc.wr_id,
                    ok,
                    at_ns: now_ns,
                });
            }
            if n < self.wc.len() {
                break;
            }
        }
        self.outstanding = self.outstanding.saturating_sub(found);
        found
    }

    /// Arms the CQ while probes are outstanding, then drains once more: a completion
    /// that arrived between the last poll and the arming raised no event.
    fn arm_if_waiting(&mut self, out: &mut Vec<Completion>) {
        if self.outstanding > 0 && !self.armed {
            self.armed = self.site.cq.req_notify(false).is_ok();
            self.drain(now_ns(), out);
        }
    }
}

fn now_ns() -> u64 {
    justitia_agent::block::monotonic_ns()
}

/// How long the daemon waits at start for a GID's address to leave duplicate address
/// detection (one to two seconds after the link comes up with the kernel's defaults);
/// well within the unit's TimeoutStartSec.
pub const GID_TENTATIVE_WAIT: Duration = Duration::from_secs(10);

/// The GID index the probe connects through on `device` port `port`: [`crate::gid::resolve`]
/// over the port's GID table in `/sys` and the host's addresses, waiting up to
/// [`GID_TENTATIVE_WAIT`] while its address is tentative. On InfiniBand, and where sysfs
/// has no table for the port, the index is taken as given (0 for automatic), with a
/// warning in the second case.
pub fn select_gid(device: &str, port: u8, choice: GidChoice, ib: bool) -> Result<u8, String> {
    let given = match choice {
        GidChoice::Auto => 0,
        GidChoice::Index(i) => i,
    };
    if ib {
        return Ok(given);
    }
    let deadline = std::time::Instant::now() + GID_TENTATIVE_WAIT;
    let mut waited = false;
    loop {
        let table = match gid::read_table(Path::new("/sys"), device, port) {
            Ok(t) => t,
            Err(e) => {
                warn!(error = %e, gid_index = given, "GID not checked: using gid_index {given}");
                return Ok(given);
            }
        };
        let addrs = gid::read_addresses(Path::new("/proc/net/if_inet6"));
        match gid::resolve(choice, device, port, &table, &addrs) {
            Ok(entry) => {
                info!(device, port, gid_index = entry.index, gid = %entry.ip(), gid_type = %entry.kind,
                    netdev = entry.ndev.as_deref().unwrap_or("-"), setting = %choice,
                    "reference flow GID");
                return Ok(entry.index);
            }
            Err(e) if e.is_tentative() && std::time::Instant::now() < deadline => {
                if !waited {
                    info!(error = %e, "waiting for duplicate address detection");
                    waited = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("choosing the reference flow's GID: {e}")),
        }
    }
}

fn info_name(port: u8) -> String {
    format!("port {port}")
}

impl Probe for VerbsProbe {
    fn info(&self) -> ProbeInfo {
        self.info.clone()
    }
    fn send(&mut self, id: u64, _now_ns: u64) -> Result<(), String> {
        if let Some(r) = self.requester.as_mut().filter(|r| r.adopted()) {
            // The path is the wire's for good: a probe that cannot cross it now (its
            // queue pair is being made again) is lost, as the loop counts one that
            // vanished, not a loopback sample of another quantity.
            if !r.ready() || r.post(&self.site, id).is_err() {
                self.failed.push(id);
            }
            self.outstanding += 1;
            return Ok(());
        }
        let sge = self.site.mr.sge(0, 10).map_err(|e| e.to_string())?;
        let wr = SendRequest::write(
            id,
            vec![sge],
            self.site.mr.addr() + TARGET_OFFSET,
            self.site.mr.rkey(),
        );
        self.sender
            .post_send(&[wr])
            .map_err(|e| format!("posting a probe: {e}"))?;
        self.outstanding += 1;
        Ok(())
    }
    fn fd(&self) -> Option<RawFd> {
        Some(self.channel.fd())
    }
    fn await_completion(&mut self, deadline_ns: u64, out: &mut Vec<Completion>) {
        loop {
            let now = now_ns();
            if self.drain(now, out) > 0 || now >= deadline_ns {
                break;
            }
            std::hint::spin_loop();
        }
        self.arm_if_waiting(out);
    }
    fn collect(&mut self, now_ns: u64, signalled: bool, out: &mut Vec<Completion>) {
        if signalled {
            // The descriptor is non-blocking: `wait` acknowledges the pending event, and
            // the CQ is no longer armed.
            let _ = self.channel.wait();
            self.armed = false;
        }
        self.drain(now_ns, out);
        self.arm_if_waiting(out);
    }
    fn outstanding(&self) -> usize {
        self.outstanding
    }
    fn path(&self) -> ReferencePath {
        match &self.requester {
            Some(r) if r.adopted() => ReferencePath::Wire(r.peer()),
            _ => ReferencePath::Loopback,
        }
    }
    fn offer(&mut self, now_ns: u64) -> Option<(NodeId, ProbeEndpoint)> {
        let r = self.requester.as_mut()?;
        let (offer, dropped) = r.offer(&self.site, now_ns);
        // The old queue pair's probes will never complete: the loop times them out.
        self.outstanding = self.outstanding.saturating_sub(dropped);
        Some((r.peer(), offer))
    }
    fn answered(&mut self, peer: NodeId, answer: ProbeEndpoint) -> bool {
        let Some(r) = self.requester.as_mut().filter(|r| r.peer() == peer) else {
            return false;
        };
        let host = crate::peer::host_name(peer);
        match r.answered(&self.site, answer) {
            Ok(Answered::First) => true,
            Ok(Answered::Again) => {
                info!(peer = %host, "reference flow connected across the wire again");
                false
            }
            Ok(Answered::Broken) => {
                info!(peer = %host, "the reference peer made its queue pair again: so does this host");
                false
            }
            Ok(Answered::Unchanged) => false,
            Err(e) => {
                warn!(peer = %host, error = %e, "the reference peer's answer not taken");
                false
            }
        }
    }
    fn serve_offer(&mut self, peer: NodeId, offer: ProbeEndpoint) {
        self.responders.offered(peer, offer);
    }
    fn take_answers(&mut self, now_ns: u64, out: &mut Vec<(NodeId, ProbeEndpoint)>) {
        self.responders.answers(&self.site, now_ns, out);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn line_rates_from_port_codes() {
        assert_eq!(line_rate_bps(2, 32), Some(4.0 * 25.78125e9)); // 4x EDR
        assert_eq!(line_rate_bps(1, 1), Some(2.5e9));
        assert_eq!(line_rate_bps(3, 1), None);
    }

    #[test]
    fn profiles_from_link_layer_and_rate() {
        assert_eq!(profile_for(false, 103.125e9), "roce-100");
        assert_eq!(profile_for(false, 2.5e9), "roce-10");
        assert_eq!(profile_for(false, 40e9), "roce-40");
        assert_eq!(profile_for(true, 4.0 * 14.0625e9), "ib-56");
    }

    #[test]
    fn synthetic_probes_complete_after_their_latency_in_order_stamped_when_due() {
        let mut p = SyntheticProbe::new(Duration::from_micros(20));
        p.send(1, 1_000).unwrap();
        p.send(2, 2_000).unwrap();
        let mut out = Vec::new();
        p.await_completion(1_000_000, &mut out);
        p.collect(20_999, false, &mut out);
        assert!(out.is_empty());
        assert_eq!(p.outstanding(), 2);
        // Collected late, stamped with the time each was due.
        p.collect(500_000, false, &mut out);
        assert_eq!(
            out,
            vec![
                Completion {
                    id: 1,
                    ok: true,
                    at_ns: 21_000
                },
                Completion {
                    id: 2,
                    ok: true,
                    at_ns: 22_000
                }
            ]
        );
        assert_eq!(p.outstanding(), 0);
    }
}
