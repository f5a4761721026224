//! `justitia status`, `justitia flows`, `justitia set target`: clients of justitiad's admin
//! socket (root, or the daemon's admin group).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_agent::admin::{AdminReply, AdminRequest};

/// The admin socket's default path.
pub const DEFAULT_ADMIN_SOCKET: &str = "/run/justitia/justitiad-admin.sock";

/// Options shared by the admin commands.
#[derive(Args, Debug, Clone)]
pub struct AdminArgs {
    /// justitiad's admin socket.
    #[arg(long, default_value = DEFAULT_ADMIN_SOCKET)]
    pub socket: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn ask(socket: &Path, req: &AdminRequest) -> Result<AdminReply> {
    let mut s = UnixStream::connect(socket)
        .with_context(|| format!("connecting to justitiad at {}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    s.write_all(line.as_bytes())
        .context("sending the request")?;
    let mut reply = String::new();
    BufReader::new(s)
        .read_line(&mut reply)
        .context("reading the reply")?;
    let reply: AdminReply = serde_json::from_str(&reply)
        .with_context(|| format!("unreadable reply `{}`", reply.trim()))?;
    if let AdminReply::Error(e) = reply {
        bail!("justitiad: {e}");
    }
    Ok(reply)
}

fn us(ns: Option<u64>) -> String {
    ns.map_or("-".into(), |v| format!("{:.1} us", v as f64 / 1e3))
}

/// `justitia status`.
pub fn status(args: &AdminArgs) -> Result<()> {
    let AdminReply::Status(s) = ask(&args.socket, &AdminRequest::Status)? else {
        bail!("unexpected reply")
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!(
        "device     {}  profile {}  boot {:#x}",
        s.device, s.profile, s.boot_id
    );
    println!(
        "SafeUtil   {:.2} Gb/s of {:.2} Gb/s",
        s.safe_util * 8e-9,
        s.max_rate * 8e-9
    );
    println!("Current99  {}", us(s.current_p99_ns));
    println!(
        "Target99   {}  (idle p99 {})",
        us(s.target_p99_ns),
        us(s.idle_p99_ns)
    );
    println!("probes     {} completed, {} lost", s.probes, s.probes_lost);
    println!(
        "flows      {} registered; active L {} B {} T {}; mode {}",
        s.flows, s.latency, s.bandwidth, s.throughput, s.mode
    );
    Ok(())
}

/// `justitia flows`.
pub fn flows(args: &AdminArgs) -> Result<()> {
    let AdminReply::Flows(f) = ask(&args.socket, &AdminRequest::Flows)? else {
        bail!("unexpected reply")
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
        return Ok(());
    }
    println!(
        "{:>6} {:>6} {:>8} {:<10} {:>4} {:>6} {:<20} {:>12} {:>14}  tenant",
        "flow", "uid", "pid", "class", "qps", "active", "admission", "allot Gb/s", "bytes"
    );
    for r in f {
        println!(
            "{:>6} {:>6} {:>8} {:<10} {:>4} {:>6} {:<20} {:>12} {:>14}  {}",
            r.flow,
            r.uid,
            r.pid,
            r.class,
            r.qps,
            r.active,
            r.admission,
            r.allot_bytes_per_sec
                .map_or("-".into(), |a| format!("{:.3}", a * 8e-9)),
            r.bytes,
            r.tenant
        );
    }
    Ok(())
}

/// `justitia set target VALUE`.
pub fn set_target(args: &AdminArgs, target: &str) -> Result<()> {
    if let AdminReply::Done(msg) = ask(
        &args.socket,
        &AdminRequest::SetTarget {
            target: target.into(),
        },
    )? {
        println!("{msg}");
    }
    Ok(())
}
