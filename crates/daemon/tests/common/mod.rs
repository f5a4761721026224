//! The harness the daemon's process tests share: a `justitiad` with the synthetic probe
//! on sockets in a temporary directory, its admin socket and its metrics.

// Each test binary uses a different part of the harness.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use justitia_agent::admin::{AdminReply, AdminRequest};
use justitia_agent::client::AgentClient;

pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub metrics: Option<String>,
}

impl Daemon {
    pub fn start(extra: &str) -> Daemon {
        Self::start_with(extra, false)
    }

    pub fn start_with(extra: &str, metrics: bool) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let port = if metrics { free_port() } else { 0 };
        let metrics_line = if extra.contains("metrics =") {
            String::new()
        } else if metrics {
            format!("metrics = \"127.0.0.1:{port}\"")
        } else {
            "metrics = \"\"".into()
        };
        let latency = if extra.contains("synthetic_latency_us") {
            ""
        } else {
            "synthetic_latency_us = 20\n"
        };
        let config = format!(
            "probe = \"synthetic\"\n{latency}socket = \"{}/j.sock\"\nadmin_socket = \"{}/a.sock\"\n{metrics_line}\n{extra}\n",
            dir.path().display(),
            dir.path().display()
        );
        // Tests run in parallel on a busy machine: a 5 ms heartbeat limit would see the
        // daemon descheduled as gone, so only the staleness test asks for it.
        let config = if extra.contains("stale_after_ms") {
            config
        } else {
            format!("{config}stale_after_ms = 500\n")
        };
        let path = dir.path().join("justitiad.toml");
        std::fs::write(&path, config).unwrap();
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_justitiad"))
            .arg("--config")
            .arg(&path)
            .env("JUSTITIA_LOG", "debug")
            .stderr(log)
            .spawn()
            .unwrap();
        let d = Daemon {
            child,
            dir,
            metrics: metrics.then(|| format!("127.0.0.1:{port}")),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while AgentClient::connect(d.socket()).is_err() {
            assert!(
                Instant::now() < deadline,
                "daemon did not start: {}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // The metrics listener may come up after the registration socket: a scrape right
        // after the start was refused now and then on a busy machine.
        if let Some(addr) = &d.metrics {
            while std::net::TcpStream::connect(addr).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "the daemon's metrics listener on {addr} did not open: {}",
                    d.log()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        d
    }
    /// Opens the temporary directory to other uids and puts a copy of the running test
    /// binary in it, which a child under another uid runs: the checkout's own binary may
    /// lie under a directory only its owner may enter (a clone in `mktemp -d`).
    pub fn open_to_other_uids(&self) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(self.dir.path(), PermissionsExt::from_mode(0o755)).unwrap();
        let exe = self.dir.path().join("test-child");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        std::fs::set_permissions(&exe, PermissionsExt::from_mode(0o755)).unwrap();
        exe
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("j.sock")
    }
    /// Replaces `from` by `to` in the daemon's configuration file and sends it SIGHUP.
    pub fn reload(&self, from: &str, to: &str) {
        let path = self.dir.path().join("justitiad.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{text}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
        // SAFETY: kill(2) on the daemon this harness started.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGHUP) };
        assert_eq!(rc, 0);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
    pub fn admin(&self, req: &AdminRequest) -> AdminReply {
        let mut s = UnixStream::connect(self.dir.path().join("a.sock")).unwrap();
        let mut line = serde_json::to_string(req).unwrap();
        line.push('\n');
        s.write_all(line.as_bytes()).unwrap();
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    }
    pub fn flows(&self) -> Vec<justitia_agent::admin::FlowReport> {
        match self.admin(&AdminRequest::Flows) {
            AdminReply::Flows(f) => f,
            other => panic!("{other:?}"),
        }
    }
    pub fn scrape(&self) -> prometheus_parse::Scrape {
        let addr = self.metrics.as_ref().unwrap();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut s, &mut text).unwrap();
        parse_scrape(&text)
    }
    /// Scrapes a Unix-socket endpoint.
    pub fn scrape_unix(&self, path: &std::path::Path) -> prometheus_parse::Scrape {
        let mut s = UnixStream::connect(path).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut s, &mut text).unwrap();
        parse_scrape(&text)
    }
}

pub fn parse_scrape(text: &str) -> prometheus_parse::Scrape {
    let body = text.split("\r\n\r\n").nth(1).unwrap().to_string();
    let lines = body.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).unwrap()
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn metric(
    scrape: &prometheus_parse::Scrape,
    name: &str,
    label: Option<(&str, &str)>,
) -> Option<f64> {
    scrape.samples.iter().find_map(|s| {
        let ok = s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v));
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => return None,
        };
        ok.then_some(value)
    })
}

pub fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `tests/attack/tenant.py` (the hostile or well-behaved tenant other uids run), copied to
/// a directory every uid may read: the checkout may lie under one only its owner may
/// enter (a clone in `mktemp -d`).
pub fn tenant_script() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), PermissionsExt::from_mode(0o755)).unwrap();
        let script = d.path().join("tenant.py");
        std::fs::copy(
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/attack/tenant.py"),
            &script,
        )
        .unwrap();
        std::fs::set_permissions(&script, PermissionsExt::from_mode(0o644)).unwrap();
        d
    });
    dir.path().join("tenant.py")
}

/// Key files (mode 0600) and the `[peer]` table of daemons on 127.0.0.1 to 127.0.0.n
/// joined by the peer channel on one UDP port: every host a member with its own key.
pub struct PeerCluster {
    pub dir: tempfile::TempDir,
    pub port: u16,
    hosts: u8,
    /// Hosts whose key was rotated, and how often.
    generations: std::collections::BTreeMap<u8, u8>,
}

impl PeerCluster {
    pub fn new(hosts: u8) -> PeerCluster {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let cluster = PeerCluster {
            dir,
            port: free_port(),
            hosts,
            generations: Default::default(),
        };
        for host in 1..=hosts {
            let path = cluster.key_file(host);
            std::fs::write(&path, format!("{}\n", Self::key(host).to_base64())).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        cluster
    }

    /// Host `host`'s private key: fixed bytes, so that runs repeat.
    pub fn key(host: u8) -> justitia_peer::keys::PrivateKey {
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = host.wrapping_mul(41).wrapping_add(i as u8);
        }
        justitia_peer::keys::PrivateKey::from_bytes(bytes).unwrap()
    }

    pub fn node(host: u8) -> String {
        format!("127.0.0.{host}")
    }

    pub fn key_file(&self, host: u8) -> PathBuf {
        self.dir.path().join(format!("peer{host}.key"))
    }

    /// Gives host `host` a new key pair (generation `generation` of its key), written to its
    /// key file; `config` then lists the new public key.
    pub fn rotate(&mut self, host: u8, generation: u8) {
        use std::os::unix::fs::PermissionsExt;
        self.generations.insert(host, generation);
        let path = self.key_file(host);
        std::fs::write(&path, format!("{}\n", self.key_now(host).to_base64())).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    fn key_now(&self, host: u8) -> justitia_peer::keys::PrivateKey {
        let generation = self.generations.get(&host).copied().unwrap_or(0);
        let mut bytes = Self::key(host).bytes().to_owned();
        // Not byte 0 whose low bits X25519 clears: another key, not the same one clamped.
        bytes[1] ^= generation;
        justitia_peer::keys::PrivateKey::from_bytes(bytes).unwrap()
    }

    /// The `[peer]` table (last in the file, `stale_after_ms = 500` before it, so that the
    /// harness adds nothing after it; more `[peer]` keys may follow).
    pub fn config(&self, host: u8) -> String {
        let members: Vec<String> = (1..=self.hosts)
            .map(|h| format!("\"{}\" = \"{}\"", Self::node(h), self.key_now(h).public()))
            .collect();
        format!(
            "stale_after_ms = 500\n[peer]\nnode = \"{node}\"\nkey_file = \"{key}\"\nlisten = \"{node}:{port}\"\nport = {port}\nmembers = {{ {members} }}\n",
            node = Self::node(host),
            key = self.key_file(host).display(),
            port = self.port,
            members = members.join(", "),
        )
    }
}
