//! `justitiad`: see the crate documentation of `justitia-daemon`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use std::io::{Read, Write};

use anyhow::Context;
use clap::{Parser, Subcommand};
use justitia_daemon::config::{Config, Overrides, ProbeKind, DEFAULT_PATH};
use justitia_daemon::metrics::{self, Metrics};
use justitia_daemon::probe::{Probe, SyntheticProbe, VerbsProbe};
use justitia_daemon::server::{Daemon, Signals};

/// Justitia's per-host daemon.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Configuration file (default /etc/justitia/justitiad.toml, optional at that path).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Check the configuration (and the peer channel's key file and members file, if
    /// set), print the settings a deployment must agree with (`key=value` lines), and exit.
    #[arg(long)]
    check: bool,
    /// The metrics endpoint, over the file's `metrics` and checked as it is: a DaemonSet
    /// gives `--metrics $(HOST_IP):9464`, the node's own address alone.
    #[arg(long, value_name = "ADDRESS:PORT")]
    metrics: Option<String>,
    /// This host's node id, over the file's `[peer] node` and checked as it is (a GID, or
    /// on RoCE v2 an IPv4 address): a DaemonSet gives `--peer-node $(HOST_IP)`. Refused
    /// when the file has no `[peer]` table.
    #[arg(long, value_name = "GID_OR_IPV4")]
    peer_node: Option<String>,
    /// A key tool instead of the daemon.
    #[command(subcommand)]
    command: Option<Command>,
}

/// The peer channel's key tools (as `wg genkey` and `wg pubkey`).
#[derive(Subcommand, Debug)]
enum Command {
    /// Write a new private key for this host's peer channel to stdout (base64); keep it
    /// mode 0600: `(umask 077; justitiad genkey > /etc/justitia/peer.key)`.
    Genkey,
    /// Read a private key on stdin and write its public key to stdout, for the other
    /// hosts' `[peer.members]`.
    Pubkey,
}

/// The most `justitiad pubkey` reads: a key file's bound.
const STDIN_LIMIT: u64 = justitia_daemon::peer::MAX_KEY_FILE;

fn key_tool(command: Command) -> anyhow::Result<()> {
    let line = match command {
        Command::Genkey => justitia_daemon::peer::generate_key()?.to_base64(),
        Command::Pubkey => {
            let mut text = String::new();
            std::io::stdin()
                .take(STDIN_LIMIT + 1)
                .read_to_string(&mut text)
                .context("reading the private key on stdin")?;
            anyhow::ensure!(
                text.len() as u64 <= STDIN_LIMIT,
                "stdin: larger than {STDIN_LIMIT} bytes: not a key"
            );
            justitia_peer::keys::PrivateKey::parse(&text)
                .context("stdin")?
                .public()
                .to_string()
        }
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

/// `--check`: reads the key file as the daemon will (its mode, size and contents; a
/// systemd credential exists only inside the service, so it is not), and prints the
/// settings in effect that a deployment must agree with, one `key=value` a line.
fn check(path: &std::path::Path, config: &Config) -> anyhow::Result<()> {
    let mut out = vec![format!("{}: ok", path.display())];
    out.push(format!(
        "metrics={}",
        config.metrics.as_deref().unwrap_or("")
    ));
    if let Some(peer) = &config.peer {
        let own = match &peer.key {
            justitia_daemon::peer::KeySource::File(key) => {
                out.push(format!("peer.key_file={}", key.display()));
                Some(justitia_daemon::peer::read_key_file(key)?.public())
            }
            justitia_daemon::peer::KeySource::Credential(name) => {
                out.push(format!("peer.key_credential={name}"));
                None
            }
        };
        out.push(format!("peer.node={}", peer.node));
        out.push(format!("peer.listen={}", peer.listen));
        out.push(format!("peer.port={}", peer.port));
        if let Some(file) = &peer.members_file {
            out.push(format!("peer.members_file={}", file.display()));
        }
        out.push(format!("peer.members={}", peer.members.len()));
        // Whether the list names this host with its own key: the other hosts reach it
        // under this node id and check it by that key.
        let listed = match (peer.members.get(&peer.node), own) {
            (None, _) => "no",
            (Some(p), Some(own)) if *p != own => "with another key than key_file's",
            (Some(_), _) => "yes",
        };
        out.push(format!("peer.self_listed={listed}"));
    }
    let mut stdout = std::io::stdout().lock();
    for line in out {
        writeln!(stdout, "{line}")?;
    }
    Ok(())
}

static SIGNALS: OnceLock<Signals> = OnceLock::new();

extern "C" fn on_signal(sig: libc::c_int) {
    // Only atomic stores: async-signal-safe.
    if let Some(s) = SIGNALS.get() {
        if sig == libc::SIGHUP {
            s.reload.store(true, Ordering::Relaxed);
        } else {
            s.stop.store(true, Ordering::Relaxed);
        }
    }
}

fn install_handlers() {
    for sig in [libc::SIGHUP, libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a handler that only stores atomics; no SA_RESTART,
        // so epoll_wait(2) returns EINTR and the loop sees the flag at once.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Log lines held for the writer thread at most; beyond them lines are dropped (and
/// counted), so a log reader that stalls never stalls the loop.
const LOG_LINES_BUFFERED: usize = 4096;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(command) = args.command {
        return key_tool(command);
    }
    // The loop runs at real-time priority and must never wait on its log: stderr is the
    // journal's stream (a pipe that fills when journald is slow) or a file (whose writes
    // wait under the kernel's dirty-page throttling on a busy disk). Lines go to a writer
    // thread through a bounded buffer instead, and are dropped when it is full.
    let (writer, _flush_at_exit) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_LINES_BUFFERED)
        .thread_name("justitiad-log")
        .finish(std::io::stderr());
    let log_drops = writer.error_counter();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("JUSTITIA_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(writer)
        // Colour codes only on a terminal: the journal and log files get plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let (path, required) = match args.config {
        Some(p) => (p, true),
        None => (PathBuf::from(DEFAULT_PATH), false),
    };
    let overrides = Overrides {
        metrics: args.metrics,
        peer_node: args.peer_node,
    };
    let config = Config::load_with(&path, required, &overrides)?;
    if args.check {
        return check(&path, &config);
    }
    let probe: Box<dyn Probe> = match config.probe {
        ProbeKind::Synthetic(latency) => Box::new(SyntheticProbe::new(latency)),
        ProbeKind::Verbs => Box::new(
            VerbsProbe::open(
                config.device.as_deref(),
                config.port,
                config.gid_index,
                config.peer.as_ref().and_then(|p| p.probe_to),
            )
            .map_err(anyhow::Error::msg)?,
        ),
    };
    let metrics = Metrics::new();
    metrics.watch_log_drops(log_drops);
    if let Some(endpoint) = &config.metrics {
        let endpoint = metrics::Endpoint::parse(endpoint).map_err(anyhow::Error::msg)?;
        let group = config
            .admin_group
            .as_deref()
            .and_then(justitia_daemon::config::group_id);
        metrics::serve(endpoint, metrics.clone(), group).map_err(anyhow::Error::msg)?;
    }
    let signals = SIGNALS.get_or_init(Signals::default);
    install_handlers();
    let config_path = (required || path.exists()).then_some(path);
    let mut daemon = Daemon::new(config, config_path, probe, metrics)?.with_overrides(overrides);
    daemon.run(signals);
    Ok(())
}
