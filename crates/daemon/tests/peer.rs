//! Two `justitiad` processes joined by the peer channel on loopback (127.0.0.1 and
//! 127.0.0.2, each its own node), driven through the registration socket as shapers do:
//! a READ flow on A against B is paced at B's guarantee, shown in `justitia flows` and
//! the metrics; datagrams without the sender's key are refused and counted; when B dies,
//! A's flow is unconstrained again within the silence bound. Each host has its own key
//! and lists the others' public keys (`common::PeerCluster`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use justitia_agent::client::{AgentClient, FlowHandle, FlowState};
use justitia_agent::proto::{Paired, QpPairing, Register, RemoteEnd, Reply, Request, Usage};
use justitia_core::flow::{FlowClass, TenantId};
use justitia_peer::channel::{Channel, ChannelConfig, Member};
use justitia_peer::wire::{DemandEntry, Role};
use justitia_peer::NodeId;

use common::{eventually, metric, Daemon, PeerCluster};

fn seqpacket(path: &Path) -> std::os::fd::OwnedFd {
    use rustix::net::*;
    let s = socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    connect(&s, &SocketAddrUnix::new(path).unwrap()).unwrap();
    rustix::net::sockopt::set_socket_timeout(
        &s,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_secs(2)),
    )
    .unwrap();
    let mut buf = [0u8; 128];
    rustix::net::recv(&s, &mut buf, rustix::net::RecvFlags::empty()).unwrap();
    s
}

/// Registers an active bandwidth flow; returns the connection (which holds it) and its id.
fn bandwidth_flow(path: &Path) -> (std::os::fd::OwnedFd, u64) {
    bandwidth_flow_with(path, true)
}

/// Registers a bandwidth flow, active (with work) or idle.
fn bandwidth_flow_with(path: &Path, active: bool) -> (std::os::fd::OwnedFd, u64) {
    let s = seqpacket(path);
    let msg = Request::Register(Register {
        client_ref: 1,
        class: FlowClass::Bandwidth,
        qps: 1,
        demand_bytes_per_sec: 0,
        claimed_uid: rustix::process::getuid().as_raw(),
    })
    .encode();
    rustix::net::send(&s, &msg, rustix::net::SendFlags::empty()).unwrap();
    let mut buf = [0u8; 128];
    let (n, _) = rustix::net::recv(&s, &mut buf, rustix::net::RecvFlags::empty()).unwrap();
    let Ok(Reply::Registered { flow, .. }) = Reply::parse(&buf[..n]) else {
        panic!("not registered")
    };
    send(
        &s,
        Request::Usage(Usage {
            flow,
            active,
            bytes: 1 << 20,
            ops: 1,
        }),
    );
    (s, flow)
}

fn send(s: &std::os::fd::OwnedFd, r: Request) {
    rustix::net::send(s, &r.encode(), rustix::net::SendFlags::empty()).unwrap();
}

fn gid(v4: [u8; 4]) -> [u8; 16] {
    std::net::Ipv4Addr::from(v4).to_ipv6_mapped().octets()
}

#[test]
fn a_read_flow_is_paced_at_its_responders_guarantee_until_the_responder_dies() {
    let cluster = PeerCluster::new(2);
    let port = cluster.port;
    let a = Daemon::start_with(&cluster.config(1), true);
    let b = Daemon::start_with(&cluster.config(2), true);

    // B has a bandwidth flow of its own; A READs from B.
    let (_b_conn, _) = bandwidth_flow(&b.socket());
    let (a_conn, read) = bandwidth_flow(&a.socket());
    send(
        &a_conn,
        Request::Remote(RemoteEnd {
            flow: read,
            gid: gid([127, 0, 0, 2]),
            lid: 0,
            qpn: 0x42,
            reads: true,
        }),
    );
    // B counts its flow and A's READ unit: 1/2 of its MaxRate, and A's flow is paced at it.
    let max_rate = metric(&b.scrape(), "justitia_max_rate_bytes_per_second", None).unwrap();
    let half = Some(max_rate / 2.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    // The guarantee is shown as soon as it arrives; the allotment paced to it at the
    // loop's next publication (a moment later on a busy machine): both are awaited.
    let shown = loop {
        let f = a.flows().remove(0);
        if f.read_guarantee_bytes_per_sec == half && f.allot_bytes_per_sec == half {
            break f;
        }
        assert!(
            Instant::now() < deadline,
            "no guarantee at A: {f:?}\nA: {}\nB: {}",
            a.log(),
            b.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(shown.allot_bytes_per_sec, half, "paced at the guarantee");
    assert_eq!(shown.remote.as_deref(), Some("reads from 127.0.0.2"));
    let sa = a.scrape();
    let sb = b.scrape();
    for (who, s) in [("A", &sa), ("B", &sb)] {
        let sent = metric(s, "justitia_peer_messages_sent_total", None).unwrap();
        let got = metric(s, "justitia_peer_messages_received_total", None).unwrap();
        assert!(
            sent >= 1.0 && got >= 1.0,
            "{who}: sent {sent}, received {got}"
        );
    }

    // A member with the wrong key (a host claiming to be A, with a key of its own), and a
    // datagram that is no message at all.
    let members: Vec<Member> = (1..=2)
        .map(|h| Member {
            node: NodeId(gid([127, 0, 0, h])),
            public: PeerCluster::key(h).public(),
        })
        .collect();
    let mut forger = Channel::new(
        ChannelConfig::default(),
        NodeId(gid([127, 0, 0, 1])),
        PeerCluster::key(9),
        &members,
        [3; 32],
        Duration::ZERO,
    )
    .unwrap();
    forger
        .set_demand(
            Duration::ZERO,
            NodeId(gid([127, 0, 0, 2])),
            &[DemandEntry {
                tenant: TenantId(1),
                class: FlowClass::Bandwidth,
                role: Role::Read,
                flows: 100,
                weight: 1000,
            }],
        )
        .unwrap();
    let forged = forger.poll_transmit(Duration::ZERO).unwrap().bytes;
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let b_addr = format!("127.0.0.2:{port}");
    udp.send_to(&forged, &b_addr).unwrap();
    udp.send_to(b"hello", &b_addr).unwrap();
    let refused = |reason: &str| {
        metric(
            &b.scrape(),
            "justitia_peer_messages_refused_total",
            Some(("value", reason)),
        )
        .unwrap_or(0.0)
    };
    eventually("the refusals counted", Duration::from_secs(5), || {
        refused("authentication") == 1.0 && refused("truncated") == 1.0
    });
    // No rate changed: the forged demand (100 flows of weight 1000) would have cut B's
    // guarantee to 1/1001. A holds 1/2, or none for a moment where this busy machine held
    // B's refresh back past the silence.
    for _ in 0..20 {
        let g = a.flows()[0].read_guarantee_bytes_per_sec;
        assert!(g == half || g.is_none(), "{g:?}");
        std::thread::sleep(Duration::from_millis(5));
    }

    // B dies: A's READ flow is no longer constrained once the guarantee lapses (20 ms at
    // the default RefPeriod and silence; a busy test machine gets a second).
    let killed = Instant::now();
    drop(b);
    eventually("fail-open at A", Duration::from_secs(1), || {
        let f = &a.flows()[0];
        f.read_guarantee_bytes_per_sec.is_none() && f.allot_bytes_per_sec == Some(max_rate)
    });
    eprintln!("fail-open after {:?}", killed.elapsed());
}

/// Incast (§6.7): A and C each send a bandwidth flow into B. B counts two incast units of
/// weight 1 from two hosts and grants each half its MaxRate; A's and C's flows, alone on
/// their hosts (their own loops would give them all of MaxRate), are published to their
/// shapers at that half. When B dies, A's flow is back at its own allotment within the
/// silence bound (20 ms by default; a busy test machine gets a second).
#[test]
fn a_bandwidth_flow_into_a_peer_is_paced_at_its_incast_share_until_the_receiver_dies() {
    let cluster = PeerCluster::new(3);
    let a = Daemon::start_with(&cluster.config(1), true);
    let b = Daemon::start_with(&cluster.config(2), true);
    let c = Daemon::start_with(&cluster.config(3), true);
    let mut conns = Vec::new();
    for sender in [&a, &c] {
        let (conn, flow) = bandwidth_flow(&sender.socket());
        send(
            &conn,
            Request::Remote(RemoteEnd {
                flow,
                gid: gid([127, 0, 0, 2]),
                lid: 0,
                qpn: 0x42,
                reads: false,
            }),
        );
        conns.push(conn);
    }
    let max_rate = metric(&b.scrape(), "justitia_max_rate_bytes_per_second", None).unwrap();
    let half = Some(max_rate / 2.0);
    for (who, sender) in [("A", &a), ("C", &c)] {
        let deadline = Instant::now() + Duration::from_secs(10);
        let shown = loop {
            let f = sender.flows().remove(0);
            if f.allot_bytes_per_sec == half {
                break f;
            }
            assert!(
                Instant::now() < deadline,
                "{who} not paced at B's share: {f:?}\n{who}: {}\nB: {}",
                sender.log(),
                b.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(shown.remote.as_deref(), Some("sends to 127.0.0.2"));
        assert_eq!(shown.read_guarantee_bytes_per_sec, None, "not a READ");
    }

    let killed = Instant::now();
    drop(b);
    eventually("fail-open at A", Duration::from_secs(1), || {
        a.flows()[0].allot_bytes_per_sec == Some(max_rate)
    });
    eprintln!("fail-open after {:?}", killed.elapsed());
}

/// Which flows a receiver's share caps, and how its tenant's share is split: A holds two
/// active bandwidth flows into B, an idle one into B and an active one that goes nowhere
/// (a local peer); C one into B. B counts two units (A's tenant, C's tenant) from two hosts
/// and grants each half its MaxRate. A's own loop divides A's MaxRate among its tenant's
/// three active bandwidth flows, a third each; the two into B are capped at the tenant's
/// half split between its two active flows there, a quarter of MaxRate each (below the
/// third); the flow that goes nowhere keeps its third, and the idle one is not counted
/// (counted, the two would get a sixth). When the second active flow into B goes idle, the
/// first is alone there and capped at the half, above A's own split, now a half each for
/// the two active flows: the half.
#[test]
fn a_tenants_share_is_split_among_its_active_bandwidth_flows_into_the_receiver_only() {
    let cluster = PeerCluster::new(3);
    let a = Daemon::start_with(&cluster.config(1), true);
    let b = Daemon::start_with(&cluster.config(2), true);
    let c = Daemon::start_with(&cluster.config(3), true);
    let into_b = |conn: &std::os::fd::OwnedFd, flow: u64| {
        send(
            conn,
            Request::Remote(RemoteEnd {
                flow,
                gid: gid([127, 0, 0, 2]),
                lid: 0,
                qpn: 0x42,
                reads: false,
            }),
        )
    };
    let (c_conn, c_flow) = bandwidth_flow(&c.socket());
    into_b(&c_conn, c_flow);
    let (conn1, first) = bandwidth_flow(&a.socket());
    let (conn2, second) = bandwidth_flow(&a.socket());
    let (conn3, idle) = bandwidth_flow_with(&a.socket(), false);
    let (_conn4, local) = bandwidth_flow(&a.socket());
    for (conn, flow) in [(&conn1, first), (&conn2, second), (&conn3, idle)] {
        into_b(conn, flow);
    }
    let max_rate = metric(&b.scrape(), "justitia_max_rate_bytes_per_second", None).unwrap();
    assert_eq!(
        metric(&a.scrape(), "justitia_max_rate_bytes_per_second", None),
        Some(max_rate),
        "one profile on every host"
    );
    let allotted = |id: u64| {
        a.flows()
            .into_iter()
            .find(|f| f.flow == id)
            .and_then(|f| f.allot_bytes_per_sec)
    };
    let near = |got: Option<f64>, want: f64| got.is_some_and(|g| (g / want - 1.0).abs() < 1e-9);
    eventually(
        "A's flows into B at a quarter",
        Duration::from_secs(10),
        || {
            near(allotted(first), max_rate / 4.0)
                && near(allotted(second), max_rate / 4.0)
                && near(allotted(local), max_rate / 3.0)
        },
    );

    send(
        &conn2,
        Request::Usage(Usage {
            flow: second,
            active: false,
            bytes: 1 << 20,
            ops: 1,
        }),
    );
    eventually(
        "A's flow alone into B at the half",
        Duration::from_secs(10),
        || near(allotted(first), max_rate / 2.0) && near(allotted(local), max_rate / 2.0),
    );
}

/// A flow that turns toward a receiver whose share is already held splits its tenant's
/// share there at once, in the slots its shapers read and in `justitia flows`, though
/// neither the share (B counts A's tenant once, however many flows) nor A's own
/// allotments change. A holds two active bandwidth flows (half of MaxRate each from its
/// own loop); A's first, C's and D's flows go into B, which grants each of the three units
/// a third of MaxRate, below the first flow's half. When A's second flow goes into B too,
/// the tenant's third is split between them: a sixth each. Under either policy on A:
/// `adaptive` with no latency flow splits A's MaxRate between its tenant's two flows as
/// Justitia does.
fn a_flow_turning_toward_a_receiver_splits_its_tenants_share_at_once(policy: &str) {
    let cluster = PeerCluster::new(4);
    // A share that lapsed and came back would be published anew with the flows counted
    // then: a silence bound no busy machine misses keeps B's share in force throughout.
    let config = |host: u8| format!("{}silence_ms = 60000\n", cluster.config(host));
    let a = Daemon::start_with(&format!("policy = \"{policy}\"\n{}", config(1)), true);
    let b = Daemon::start_with(&config(2), true);
    let c = Daemon::start_with(&config(3), true);
    let d = Daemon::start_with(&config(4), true);
    let receiver = gid([127, 0, 0, 2]);
    let mut clients = Vec::new();
    for sender in [&c, &d] {
        let mut client = AgentClient::connect(sender.socket()).unwrap();
        let h = active_flow(&mut client);
        assert!(client.report_remote(h, receiver, 0, 0x42, false));
        clients.push(client);
    }
    let mut on_a = AgentClient::connect(a.socket()).unwrap();
    let first = active_flow(&mut on_a);
    let second = active_flow(&mut on_a);
    assert!(on_a.report_remote(first, receiver, 0, 0x43, false));
    let max_rate = metric(&b.scrape(), "justitia_max_rate_bytes_per_second", None).unwrap();
    assert_eq!(
        metric(&a.scrape(), "justitia_max_rate_bytes_per_second", None),
        Some(max_rate),
        "one profile on every host"
    );
    // Within one byte per second: the slot holds whole bytes.
    let near = |got: u64, want: f64| (got as f64 - want).abs() <= 1.0;
    let mut paced = |h: FlowHandle, want: f64| {
        on_a.tick(justitia_agent::block::monotonic_ns());
        on_a.allotment(h)
            .is_some_and(|x| near(x.bytes_per_sec, want))
    };
    eventually("B's third held at A", Duration::from_secs(10), || {
        paced(first, max_rate / 3.0) && paced(second, max_rate / 2.0)
    });
    assert!(on_a.report_remote(second, receiver, 0, 0x44, false));
    let mut paced = |h: FlowHandle, want: f64| {
        on_a.tick(justitia_agent::block::monotonic_ns());
        on_a.allotment(h)
            .is_some_and(|x| near(x.bytes_per_sec, want))
    };
    eventually(
        "the tenant's third split at once",
        Duration::from_secs(2),
        || paced(first, max_rate / 6.0) && paced(second, max_rate / 6.0),
    );
    for f in a.flows() {
        let shown = f.allot_bytes_per_sec.unwrap();
        assert!((shown / (max_rate / 6.0) - 1.0).abs() < 1e-9, "{f:?}");
    }
}

/// Registers an active bandwidth flow through the shaper's client.
fn active_flow(c: &mut AgentClient) -> FlowHandle {
    let h = c.register(FlowClass::Bandwidth, 1, 0);
    c.wait_registered(h, Duration::from_secs(2));
    assert!(c.report_usage(h, true, 1 << 20, 1));
    h
}

#[test]
fn a_flow_turning_toward_a_receiver_splits_its_tenants_share_at_once_under_justitia() {
    a_flow_turning_toward_a_receiver_splits_its_tenants_share_at_once("justitia");
}

/// The adaptive law plans again when a flow's peer changes, but its allotments stay as
/// they were: only the count of flows into B changes the caps.
#[test]
fn a_flow_turning_toward_a_receiver_splits_its_tenants_share_at_once_under_adaptive() {
    a_flow_turning_toward_a_receiver_splits_its_tenants_share_at_once("adaptive");
}

/// Issue 36: an unprivileged user who bound the peer port first stopped justitiad from
/// starting. Now the daemon serves a local shaper with the port taken, reports the channel
/// down, and binds the port once it is free.
#[test]
fn a_taken_peer_port_does_not_stop_the_daemon_and_the_bind_is_retried() {
    let cluster = PeerCluster::new(2);
    let squatter = std::net::UdpSocket::bind(("127.0.0.1", cluster.port)).unwrap();
    let a = Daemon::start_with(&cluster.config(1), true);
    let (_conn, flow) = bandwidth_flow(&a.socket());
    eventually("the local flow served", Duration::from_secs(5), || {
        a.flows()
            .iter()
            .any(|f| f.flow == flow && f.allot_bytes_per_sec.is_some())
    });
    assert_eq!(
        metric(&a.scrape(), "justitia_peer_socket_up", None),
        Some(0.0),
        "the channel down while the port is taken"
    );
    drop(squatter);
    eventually("the port bound on a retry", Duration::from_secs(5), || {
        metric(&a.scrape(), "justitia_peer_socket_up", None) == Some(1.0)
    });
}

/// Issue 36: a local tenant's 64 flows declared as reading from 127.1.0.k made its daemon
/// send 12,749 datagrams/s to addresses the tenant chose. A remote end that names no member
/// counts as a local flow: nothing is sent there.
#[test]
fn a_remote_end_naming_a_non_member_steers_no_datagram() {
    let cluster = PeerCluster::new(2);
    let target = std::net::UdpSocket::bind(("127.1.0.9", cluster.port)).unwrap();
    target
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let a = Daemon::start_with(&cluster.config(1), true);
    let mut conns = Vec::new();
    for _ in 0..4 {
        let (conn, flow) = bandwidth_flow(&a.socket());
        send(
            &conn,
            Request::Remote(RemoteEnd {
                flow,
                gid: gid([127, 1, 0, 9]),
                lid: 0,
                qpn: 0x42,
                reads: true,
            }),
        );
        conns.push(conn);
    }
    eventually("the flows counted", Duration::from_secs(5), || {
        a.flows().len() == 4
    });
    let mut buf = [0u8; 2048];
    let got = target.recv_from(&mut buf);
    assert!(
        got.is_err(),
        "a datagram reached the address a tenant named: {got:?}"
    );
    assert!(
        a.flows().iter().all(|f| f.remote.is_none()),
        "{:?}",
        a.flows()
    );
}

/// `justitiad genkey` writes a new key (base64, one line), different each time;
/// `justitiad pubkey` prints its public key, and refuses what is not a key, naming stdin.
#[test]
fn genkey_and_pubkey_make_and_show_a_key_pair() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let bin = env!("CARGO_BIN_EXE_justitiad");
    let genkey = || {
        let out = Command::new(bin).arg("genkey").output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let (k1, k2) = (genkey(), genkey());
    assert_ne!(k1, k2);
    let private = justitia_peer::keys::PrivateKey::parse(&k1).unwrap();
    let pubkey = |input: &[u8]| {
        let mut child = Command::new(bin)
            .arg("pubkey")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("RUST_BACKTRACE", "0")
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap()
    };
    let out = pubkey(k1.as_bytes());
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        private.public().to_string()
    );
    let out = pubkey(b"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n");
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("stdin") && err.contains("degenerate"), "{err}");
}

/// Key rotation on SIGHUP: B gets a new key pair; A is told B's new public key and reloads,
/// then B reads its new key and reloads. The guarantee comes back over a session made with
/// the new key, and B's old key no longer speaks for B at A.
#[test]
fn a_key_rotated_on_sighup_takes_over_and_the_old_key_is_refused() {
    let mut cluster = PeerCluster::new(2);
    let port = cluster.port;
    let a = Daemon::start_with(&cluster.config(1), true);
    let b = Daemon::start_with(&cluster.config(2), true);
    let (_b_conn, _) = bandwidth_flow(&b.socket());
    let (a_conn, read) = bandwidth_flow(&a.socket());
    send(
        &a_conn,
        Request::Remote(RemoteEnd {
            flow: read,
            gid: gid([127, 0, 0, 2]),
            lid: 0,
            qpn: 0x42,
            reads: true,
        }),
    );
    let max_rate = metric(&b.scrape(), "justitia_max_rate_bytes_per_second", None).unwrap();
    let half = Some(max_rate / 2.0);
    eventually("B's guarantee at A", Duration::from_secs(10), || {
        a.flows()[0].read_guarantee_bytes_per_sec == half
    });
    let (old_a, old_b) = (cluster.config(1), cluster.config(2));
    cluster.rotate(2, 1);
    a.reload(&old_a, &cluster.config(1));
    b.reload(&old_b, &cluster.config(2));
    eventually("B reloaded its key", Duration::from_secs(5), || {
        b.log().contains("peer key and members reloaded")
    });
    eventually(
        "B's guarantee at A under the new key",
        Duration::from_secs(10),
        || a.flows()[0].read_guarantee_bytes_per_sec == half,
    );
    // B's old key, claiming B: refused by A, which knows only the new one.
    let refused = || {
        metric(
            &a.scrape(),
            "justitia_peer_messages_refused_total",
            Some(("value", "authentication")),
        )
        .unwrap_or(0.0)
    };
    let before = refused();
    let members: Vec<Member> = [(1, PeerCluster::key(1)), (2, PeerCluster::key(2))]
        .into_iter()
        .map(|(h, k)| Member {
            node: NodeId(gid([127, 0, 0, h])),
            public: k.public(),
        })
        .collect();
    let mut old_b_channel = Channel::new(
        ChannelConfig::default(),
        NodeId(gid([127, 0, 0, 2])),
        PeerCluster::key(2),
        &members,
        [4; 32],
        Duration::ZERO,
    )
    .unwrap();
    old_b_channel.greet(Duration::ZERO);
    let greeting = old_b_channel.poll_transmit(Duration::ZERO).unwrap().bytes;
    let udp = std::net::UdpSocket::bind("127.0.0.3:0").unwrap();
    udp.send_to(&greeting, format!("127.0.0.1:{port}")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while refused() < before + 1.0 {
        assert!(
            Instant::now() < deadline,
            "the old key not refused at A ({before} before): {:?}\nA: {}\nB: {}",
            [
                "authentication",
                "rate_limited",
                "replayed",
                "not_member",
                "length",
                "truncated"
            ]
            .map(|r| (
                r,
                metric(
                    &a.scrape(),
                    "justitia_peer_messages_refused_total",
                    Some(("value", r))
                )
            )),
            a.log(),
            b.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(a.flows()[0].read_guarantee_bytes_per_sec, half);
}

/// A pairing of `c`'s flow `h`: its queue pair `local_qpn` connected to `remote_qpn` on
/// host `remote`, its side channel `side`.
fn report_pairing(
    c: &mut AgentClient,
    h: FlowHandle,
    local_qpn: u32,
    remote: [u8; 4],
    remote_qpn: u32,
    side: (u32, u32),
) {
    let p = QpPairing {
        flow: 0,
        local_qpn,
        remote_gid: gid(remote),
        remote_lid: 0,
        remote_qpn,
        side_qpn: side.0,
        side_qkey: side.1,
    };
    assert!(c.report_pairing(h, p));
}

/// Ticks `c` until the daemon tells it a side channel, for up to `within`.
fn paired_within(c: &mut AgentClient, within: Duration) -> Option<Paired> {
    let deadline = Instant::now() + within;
    loop {
        c.tick(justitia_agent::block::monotonic_ns());
        if let Some(p) = c.take_paired() {
            return Some(p);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Issue 38's rendezvous: a shaper on A and one on B, whose RC queue pairs 0x100 (A) and
/// 0x200 (B) are connected to each other, each learn the other's side channel through
/// their daemons, whichever reports first (A does, and its pairing reaches B before B's
/// shaper reported: B's daemon finds it on the rotation). A pairing naming a queue pair
/// connected elsewhere finds nothing, and one naming a host that is no member is refused.
#[test]
fn two_shapers_whose_queue_pairs_are_connected_learn_each_others_side_channel() {
    let cluster = PeerCluster::new(2);
    let a = Daemon::start_with(&cluster.config(1), true);
    let b = Daemon::start_with(&cluster.config(2), true);
    let mut on_a = AgentClient::connect(a.socket()).unwrap();
    let mut on_b = AgentClient::connect(b.socket()).unwrap();
    let fa = active_flow(&mut on_a);
    let fb = active_flow(&mut on_b);
    report_pairing(&mut on_a, fa, 0x100, [127, 0, 0, 2], 0x200, (0x300, 0x1234));
    // Queue pair 0x101 is connected to B's 0x201, which B's shaper never reports; B's
    // 0x202 names A's 0x100 but A's 0x100 is connected to 0x200: neither finds anything.
    report_pairing(&mut on_a, fa, 0x101, [127, 0, 0, 2], 0x201, (0x300, 0x1234));
    eventually("A's pairings sent", Duration::from_secs(5), || {
        metric(&a.scrape(), "justitia_pairings_held", None) == Some(2.0)
    });
    std::thread::sleep(Duration::from_millis(300));
    report_pairing(&mut on_b, fb, 0x202, [127, 0, 0, 1], 0x100, (0x400, 0x5678));
    report_pairing(&mut on_b, fb, 0x200, [127, 0, 0, 1], 0x100, (0x400, 0x5678));
    let on_a_found = paired_within(&mut on_a, Duration::from_secs(5)).expect("A told");
    let on_b_found = paired_within(&mut on_b, Duration::from_secs(5)).expect("B told");
    let flow_of = |c: &AgentClient, h| match c.state(h) {
        FlowState::Registered { flow, .. } => flow,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        on_a_found,
        Paired {
            flow: flow_of(&on_a, fa),
            local_qpn: 0x100,
            side_qpn: 0x400,
            side_qkey: 0x5678
        }
    );
    assert_eq!(
        on_b_found,
        Paired {
            flow: flow_of(&on_b, fb),
            local_qpn: 0x200,
            side_qpn: 0x300,
            side_qkey: 0x1234
        }
    );
    // Nothing more: the rotation's refreshes tell nothing again, and the pairings that
    // match nothing stay unmatched.
    assert_eq!(paired_within(&mut on_a, Duration::from_millis(600)), None);
    assert_eq!(paired_within(&mut on_b, Duration::from_millis(100)), None);
    assert_eq!(
        metric(&a.scrape(), "justitia_pairings_found_total", None),
        Some(1.0)
    );
    assert_eq!(
        metric(&b.scrape(), "justitia_pairings_found_total", None),
        Some(1.0)
    );

    report_pairing(&mut on_a, fa, 0x102, [127, 0, 0, 9], 0x200, (0x300, 0x1234));
    eventually("a non-member refused", Duration::from_secs(5), || {
        metric(
            &a.scrape(),
            "justitia_messages_refused_total",
            Some(("value", "pairing_not_a_member")),
        ) == Some(1.0)
    });
    assert_eq!(
        metric(&a.scrape(), "justitia_pairings_held", None),
        Some(2.0)
    );
}

/// Both ends on one host (two processes connected through one device): their daemon
/// pairs them itself, with no member to ask.
#[test]
fn two_shapers_on_one_host_connected_to_each_other_are_paired_by_their_daemon() {
    let cluster = PeerCluster::new(2);
    let a = Daemon::start_with(&cluster.config(1), true);
    let mut one = AgentClient::connect(a.socket()).unwrap();
    let mut two = AgentClient::connect(a.socket()).unwrap();
    let f1 = active_flow(&mut one);
    let f2 = active_flow(&mut two);
    report_pairing(&mut one, f1, 0x10, [127, 0, 0, 1], 0x20, (0x30, 7));
    assert_eq!(paired_within(&mut one, Duration::from_millis(200)), None);
    report_pairing(&mut two, f2, 0x20, [127, 0, 0, 1], 0x10, (0x40, 8));
    let got_one = paired_within(&mut one, Duration::from_secs(2)).expect("one told");
    let got_two = paired_within(&mut two, Duration::from_secs(2)).expect("two told");
    assert_eq!(
        (got_one.local_qpn, got_one.side_qpn, got_one.side_qkey),
        (0x10, 0x40, 8)
    );
    assert_eq!(
        (got_two.local_qpn, got_two.side_qpn, got_two.side_qkey),
        (0x20, 0x30, 7)
    );
    // The queue pair destroyed: its pairing goes.
    assert!(two.withdraw_pairing(f2, 0x20));
    eventually("the pairing withdrawn", Duration::from_secs(5), || {
        metric(&a.scrape(), "justitia_pairings_held", None) == Some(1.0)
    });
}
