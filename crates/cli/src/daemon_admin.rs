//! `justitia status`, `justitia flows`, `justitia set target`: clients of justitiad's admin
//! socket (root, or the daemon's admin group).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_agent::admin::{AdminReply, AdminRequest, FlowReport, StatusReport};

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

/// A time in microseconds, `-` when absent (Current99 before any probe sample, or after
/// the window restarted when the last latency flow left; Target99 while an idle multiple
/// waits for its measurement).
fn us(ns: Option<u64>) -> String {
    ns.map_or("-".into(), |v| format!("{:.1} us", v as f64 / 1e3))
}

/// `justitia status`.
pub fn status(args: &AdminArgs) -> Result<()> {
    let AdminReply::Status(s) = ask(&args.socket, &AdminRequest::Status)? else {
        bail!("unexpected reply")
    };
    if args.json {
        // An absent Current99 or Target99 is `null`.
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", status_table(&s));
    }
    Ok(())
}

/// The status as `justitia status` prints it.
fn status_table(s: &StatusReport) -> String {
    let mut out = format!(
        "device     {}  profile {}  boot {:#x}\n\
         SafeUtil   {:.2} Gb/s of {:.2} Gb/s\n\
         Current99  {}\n\
         Target99   {}  (idle p99 {})\n\
         probes     {} completed, {} lost\n\
         flows      {} registered; active L {} B {} T {}; mode {}\n\
         tenants    {} ({} by cgroup)\n",
        s.device,
        s.profile,
        s.boot_id,
        s.safe_util * 8e-9,
        s.max_rate * 8e-9,
        us(s.current_p99_ns),
        us(s.target_p99_ns),
        us(s.idle_p99_ns),
        s.probes,
        s.probes_lost,
        s.flows,
        s.latency,
        s.bandwidth,
        s.throughput,
        s.mode,
        s.tenants,
        s.cgroups
    );
    match &s.adaptive {
        None => out.push_str("policy     justitia\n"),
        Some(a) => out.push_str(&format!(
            "policy     adaptive\n\
             adaptive   pace {}  chunk {} B  fraction {:.3}  headroom {:.3}  decreases {}  others' load {:.2} Gb/s\n",
            a.pace_bytes_per_sec
                .map_or("unpaced".into(), |p| format!("{:.2} Gb/s", p * 8e-9)),
            a.chunk_bytes,
            a.fraction,
            a.headroom,
            a.decreases,
            a.other_bytes_per_sec * 8e-9
        )),
    }
    out
}

/// `justitia flows`.
pub fn flows(args: &AdminArgs) -> Result<()> {
    let AdminReply::Flows(f) = ask(&args.socket, &AdminRequest::Flows)? else {
        bail!("unexpected reply")
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        print!("{}", flows_table(&f));
    }
    Ok(())
}

/// The flows as `justitia flows` prints them; the admission verdict as the daemon spells
/// it (the `justitia_registrations_total` metric's label); `guar Gb/s` the guarantee a
/// READ flow holds from the host it reads from.
fn flows_table(f: &[FlowReport]) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "{:>6} {:>6} {:>8} {:<10} {:>4} {:>6} {:<21} {:>12} {:>10} {:>14}  tenant\n",
        "flow",
        "uid",
        "pid",
        "class",
        "qps",
        "active",
        "admission",
        "allot Gb/s",
        "guar Gb/s",
        "bytes"
    );
    for r in f {
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{:>6} {:>6} {:>8} {:<10} {:>4} {:>6} {:<21} {:>12} {:>10} {:>14}  {}",
            r.flow,
            r.uid,
            r.pid,
            r.class,
            r.qps,
            r.active,
            r.admission,
            r.allot_bytes_per_sec
                .map_or("-".into(), |a| format!("{:.3}", a * 8e-9)),
            r.read_guarantee_bytes_per_sec
                .map_or("-".into(), |g| format!("{:.3}", g * 8e-9)),
            r.bytes,
            r.tenant
        );
    }
    out
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn report(current_p99_ns: Option<u64>) -> StatusReport {
        StatusReport {
            boot_id: 0x1f,
            device: "rxe0:1".into(),
            profile: "roce-10".into(),
            max_rate: 1.25e9,
            safe_util: 1.25e9,
            current_p99_ns,
            target_p99_ns: Some(40_000),
            idle_p99_ns: Some(20_000),
            probes: 7,
            probes_lost: 0,
            latency: 0,
            bandwidth: 1,
            throughput: 0,
            flows: 1,
            tenants: 1,
            cgroups: 0,
            mode: "normal".into(),
            adaptive: None,
        }
    }

    /// The policy's line, and adaptive's state under it: 2.925e9 B/s is 23.40 Gb/s.
    #[test]
    fn the_table_names_the_policy_and_adaptives_state() {
        assert!(status_table(&report(None)).contains("policy     justitia\n"));
        let s = StatusReport {
            adaptive: Some(Box::new(justitia_agent::admin::AdaptiveStatus {
                pace_bytes_per_sec: Some(2.925e9),
                chunk_bytes: 2400,
                fraction: 0.9,
                headroom: 0.975,
                decreases: 4,
                other_bytes_per_sec: 0.0,
            })),
            ..report(None)
        };
        let table = status_table(&s);
        assert!(table.contains("policy     adaptive\n"), "{table}");
        assert!(
            table.contains("adaptive   pace 23.40 Gb/s  chunk 2400 B  fraction 0.900"),
            "{table}"
        );
        let json: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(json["adaptive"]["chunk_bytes"], 2400, "{json}");
    }

    #[test]
    fn an_absent_current99_is_a_dash_in_the_table_and_null_in_json() {
        let table = status_table(&report(None));
        assert!(table.contains("Current99  -\n"), "{table}");
        assert!(
            !table
                .split(|c: char| !c.is_ascii_alphanumeric())
                .any(|w| w.eq_ignore_ascii_case("nan")),
            "{table}"
        );
        assert!(
            table.contains("Target99   40.0 us  (idle p99 20.0 us)"),
            "{table}"
        );
        let json: serde_json::Value = serde_json::to_value(report(None)).unwrap();
        assert!(json["current_p99_ns"].is_null(), "{json}");
        let table = status_table(&report(Some(31_500)));
        assert!(table.contains("Current99  31.5 us\n"), "{table}");
        assert!(table.contains("tenants    1 (0 by cgroup)\n"), "{table}");
    }

    #[test]
    fn the_flows_table_prints_the_admission_as_the_metric_labels_it() {
        let flow = FlowReport {
            flow: 3,
            uid: 1000,
            tenant: "1000".into(),
            pid: 42,
            class: "latency".into(),
            qps: 1,
            active: true,
            admission: "admitted_with_warning".into(),
            allot_bytes_per_sec: None,
            bytes: 16,
            remote: None,
            read_guarantee_bytes_per_sec: None,
        };
        let table = flows_table(&[flow]);
        let row = table.lines().nth(1).unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "3",
                "1000",
                "42",
                "latency",
                "1",
                "true",
                "admitted_with_warning",
                "-",
                "-",
                "16",
                "1000"
            ]
        );
    }

    #[test]
    fn the_flows_table_shows_the_guarantee_a_read_flow_holds() {
        let flow = FlowReport {
            flow: 4,
            uid: 1000,
            tenant: "1000".into(),
            pid: 42,
            class: "bandwidth".into(),
            qps: 1,
            active: true,
            admission: "admitted".into(),
            allot_bytes_per_sec: Some(6.25e9),
            bytes: 1 << 20,
            remote: Some("reads from 10.0.0.2".into()),
            read_guarantee_bytes_per_sec: Some(6.25e9),
        };
        let table = flows_table(&[flow]);
        assert!(table.lines().next().unwrap().contains("guar Gb/s"));
        let cells: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            &cells[7..9],
            ["50.000", "50.000"],
            "allotment and guarantee"
        );
    }
}
