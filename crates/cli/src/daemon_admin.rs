//! `justitia status`, `justitia flows`, `justitia set target`: clients of justitiad's admin
//! socket (root, or the daemon's admin group).
//!
//! `justitia flows` prints the registered flows, then the unshaped processes (RDMA queue
//! pairs and no shaper registered) from a second request, which a daemon older than this
//! command does not know: it then says so under the flows. `--json` prints the flows alone,
//! as it always has; `--unshaped` the unshaped processes alone (with `--json`, the
//! daemon's report).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_agent::admin::{
    AdminReply, AdminRequest, FlowReport, ScanState, StatusReport, TenantReport, UnshapedReport,
};

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

/// Options of `justitia flows`.
#[derive(Args, Debug, Clone)]
pub struct FlowsArgs {
    #[command(flatten)]
    pub admin: AdminArgs,
    /// Only the unshaped processes: those holding RDMA queue pairs with no shaper
    /// registered, as the daemon's last scan found them (with --json, its report).
    #[arg(long)]
    pub unshaped: bool,
    /// Only the connected tenants: weight, processes, control-verb budget and the control
    /// verbs their shapers reported (with --json, the daemon's list).
    #[arg(long, conflicts_with = "unshaped")]
    pub tenants: bool,
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
         probes     {} completed, {} lost; {}\n\
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
        if s.probe_path.is_empty() {
            "path not said"
        } else {
            &s.probe_path
        },
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
             adaptive   pace {}  chunk {} B  fraction {:.3}  headroom {:.3}  decreases {}  others' load {:.2} Gb/s\n\
             tail       {} ({})  round trips reported {}  updates on them {}\n",
            a.pace_bytes_per_sec
                .map_or("unpaced".into(), |p| format!("{:.2} Gb/s", p * 8e-9)),
            a.chunk_bytes,
            a.fraction,
            a.headroom,
            a.decreases,
            a.other_bytes_per_sec * 8e-9,
            a.tail_ns
                .map_or("-".into(), |ns| format!("{:.1} us", ns as f64 / 1e3)),
            a.tail_source.name(),
            a.round_trips,
            a.applications_tail_updates,
        )),
    }
    out
}

/// `justitia flows`.
pub fn flows(args: &FlowsArgs) -> Result<()> {
    let socket = &args.admin.socket;
    if args.unshaped {
        let AdminReply::Unshaped(r) = ask(socket, &AdminRequest::Unshaped)? else {
            bail!("unexpected reply")
        };
        if args.admin.json {
            println!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            print!("{}", unshaped_table(&r, now_unix_ms()));
        }
        return Ok(());
    }
    if args.tenants {
        let AdminReply::Tenants(t) = ask(socket, &AdminRequest::Tenants)? else {
            bail!("unexpected reply")
        };
        if args.admin.json {
            println!("{}", serde_json::to_string_pretty(&t)?);
        } else {
            print!("{}", tenants_table(&t));
        }
        return Ok(());
    }
    let AdminReply::Flows(f) = ask(socket, &AdminRequest::Flows)? else {
        bail!("unexpected reply")
    };
    if args.admin.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
        return Ok(());
    }
    print!("{}", flows_table(&f));
    // The flows are printed whatever these answers are.
    match ask(socket, &AdminRequest::Tenants) {
        Ok(AdminReply::Tenants(t)) => print!("\n{}", tenants_table(&t)),
        Ok(_) => println!("\ntenants: not reported (an unexpected reply)"),
        Err(e) => println!("\ntenants: not reported by this daemon ({e})"),
    }
    match ask(socket, &AdminRequest::Unshaped) {
        Ok(AdminReply::Unshaped(r)) => print!("\n{}", unshaped_table(&r, now_unix_ms())),
        Ok(_) => println!("\nunshaped processes: not reported (an unexpected reply)"),
        Err(e) => println!("\nunshaped processes: not reported by this daemon ({e})"),
    }
    Ok(())
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Queue pairs shown per process in the table (`--json` has all the daemon lists).
const QPS_SHOWN: usize = 4;

/// The unshaped processes as `justitia flows` prints them, each row marked `unshaped`,
/// the scan's age taken at `now_unix_ms`.
fn unshaped_table(r: &UnshapedReport, now_unix_ms: u64) -> String {
    use std::fmt::Write as _;
    let error = r.error.as_deref().unwrap_or("no reason given");
    let age = r
        .scanned_unix_ms
        .map(|t| format!("{:.1} s ago", now_unix_ms.saturating_sub(t) as f64 / 1e3));
    let devices = if r.devices.is_empty() {
        "no device".to_string()
    } else {
        r.devices.join(", ")
    };
    let mut out = match (r.scan, age) {
        (ScanState::Off, _) => {
            return "unshaped processes: not looked for (unshaped_scan_ms = 0)\n".into()
        }
        (ScanState::Starting, _) => {
            return "unshaped processes: the first scan has not completed yet\n".into()
        }
        (_, None) => return format!("unshaped processes: unknown, no scan has completed: {error}\n"),
        (ScanState::Unavailable, Some(age)) => format!(
            "unshaped processes: the last scan failed ({error}); as of the last one, of {devices} {age}:\n"
        ),
        (_, Some(age)) => format!(
            "unshaped processes (RDMA queue pairs, no shaper registered): {devices} scanned {age}, every {} ms\n",
            r.interval_ms
        ),
    };
    if r.processes.is_empty() && r.unlisted_processes == 0 {
        out.push_str("none\n");
    } else {
        let _ = writeln!(
            out,
            "{:<8} {:>8} {:>6} {:<16} {:>5}  {:<40}  tenant",
            "", "pid", "uid", "comm", "qps", "queue pairs"
        );
    }
    for p in &r.processes {
        let mut qps: Vec<String> = p
            .listed
            .iter()
            .take(QPS_SHOWN)
            .map(|q| {
                format!(
                    "{}/{} {} {}",
                    q.device,
                    q.qpn,
                    q.qp_type,
                    q.state.as_deref().unwrap_or("?")
                )
            })
            .collect();
        let shown = qps.len() as u64;
        if p.qps > shown {
            qps.push(format!("+{}", p.qps - shown));
        }
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{:<8} {:>8} {:>6} {:<16} {:>5}  {:<40}  {}",
            "unshaped",
            p.pid,
            p.uid.map_or("-".into(), |u| u.to_string()),
            if p.comm.is_empty() { "-" } else { &p.comm },
            p.qps,
            qps.join(", "),
            p.tenant.as_deref().unwrap_or("-")
        );
    }
    if r.unlisted_processes > 0 {
        let _ = writeln!(
            out,
            "and {} more processes, not listed; {} queue pairs in all",
            r.unlisted_processes, r.qps
        );
    }
    if r.capped {
        out.push_str("the scan stopped at its cap of queue pairs: there may be more\n");
    }
    out
}

/// The flows as `justitia flows` prints them; the admission verdict as the daemon spells
/// it (the `justitia_registrations_total` metric's label); `guar Gb/s` the guarantee a
/// READ flow holds from the host it reads from; `weight` its tenant's share weight.
fn flows_table(f: &[FlowReport]) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "{:>6} {:>6} {:>8} {:<10} {:>4} {:>6} {:<21} {:>12} {:>10} {:>14} {:>6}  tenant\n",
        "flow",
        "uid",
        "pid",
        "class",
        "qps",
        "active",
        "admission",
        "allot Gb/s",
        "guar Gb/s",
        "bytes",
        "weight"
    );
    for r in f {
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{:>6} {:>6} {:>8} {:<10} {:>4} {:>6} {:<21} {:>12} {:>10} {:>14} {:>6}  {}",
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
            if r.weight == 0 {
                "-".to_string()
            } else {
                r.weight.to_string()
            },
            r.tenant
        );
    }
    out
}

/// The connected tenants as `justitia flows` prints them after the flows: each one's
/// control-verb budget (verbs/s for all its processes, `-`: unpaced) and the control
/// verbs its shapers reported, with how many waited and for how long in all; then the QP
/// turns of each of its processes (`-`: none) and how often its QPs waited for one and
/// gave a spent one up.
fn tenants_table(t: &[TenantReport]) -> String {
    use std::fmt::Write as _;
    if t.is_empty() {
        return "tenants: none connected\n".into();
    }
    let mut out = format!(
        "{:>6} {:>9} {:>12} {:>14} {:>10} {:>10} {:>8} {:>10} {:>10}  tenant\n",
        "weight",
        "processes",
        "ctl budget/s",
        "control verbs",
        "delayed",
        "waited s",
        "QP turns",
        "turn waits",
        "yields"
    );
    for r in t {
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{:>6} {:>9} {:>12} {:>14} {:>10} {:>10.3} {:>8} {:>10} {:>10}  {}",
            r.weight,
            r.processes,
            r.control_verbs_per_sec
                .map_or("-".into(), |b| format!("{b:.1}")),
            r.control_verbs,
            r.control_verbs_delayed,
            r.control_verb_wait_seconds,
            r.qp_turns.map_or("-".into(), |t| t.to_string()),
            r.qp_turn_waits,
            r.qp_turn_yields,
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
            probe_path: "loopback".into(),
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
                tail_ns: Some(12_345),
                tail_source: justitia_agent::admin::TailSource::Applications,
                round_trips: 900,
                applications_tail_updates: 3,
            })),
            ..report(None)
        };
        let table = status_table(&s);
        assert!(table.contains("policy     adaptive\n"), "{table}");
        assert!(
            table.contains("adaptive   pace 23.40 Gb/s  chunk 2400 B  fraction 0.900"),
            "{table}"
        );
        assert!(
            table.contains(
                "tail       12.3 us (applications)  round trips reported 900  updates on them 3\n"
            ),
            "{table}"
        );
        let json: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(json["adaptive"]["chunk_bytes"], 2400, "{json}");
        assert_eq!(json["adaptive"]["tail_source"], "applications", "{json}");
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
    fn the_tenants_table_shows_the_budgets_or_a_dash_and_the_counts() {
        let paced = TenantReport {
            tenant: "pod/ml/attacker".into(),
            weight: 2,
            processes: 3,
            control_verbs_per_sec: Some(666.666),
            control_verbs: 12_000,
            control_verbs_delayed: 11_950,
            control_verb_wait_seconds: 17.25,
            qp_turns: Some(96),
            qp_turn_waits: 6,
            qp_turn_yields: 776,
        };
        let unpaced = TenantReport {
            tenant: "1000".into(),
            weight: 1,
            processes: 1,
            control_verbs_per_sec: None,
            control_verbs: 5,
            control_verbs_delayed: 0,
            control_verb_wait_seconds: 0.0,
            qp_turns: None,
            qp_turn_waits: 0,
            qp_turn_yields: 0,
        };
        let table = tenants_table(&[paced, unpaced]);
        let rows: Vec<Vec<&str>> = table
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows,
            [
                vec![
                    "2",
                    "3",
                    "666.7",
                    "12000",
                    "11950",
                    "17.250",
                    "96",
                    "6",
                    "776",
                    "pod/ml/attacker"
                ],
                vec!["1", "1", "-", "5", "0", "0.000", "-", "0", "0", "1000"],
            ],
            "{table}"
        );
        assert_eq!(tenants_table(&[]), "tenants: none connected\n");
    }

    #[test]
    fn the_flows_table_prints_the_admission_as_the_metric_labels_it() {
        let flow = FlowReport {
            flow: 3,
            uid: 1000,
            tenant: "1000".into(),
            weight: 2,
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
                "2",
                "1000"
            ]
        );
    }

    fn unshaped_report(scan: ScanState) -> UnshapedReport {
        UnshapedReport {
            scan,
            error: None,
            interval_ms: 1000,
            scanned_unix_ms: Some(10_000),
            devices: vec!["rxe0".into()],
            processes: Vec::new(),
            unlisted_processes: 0,
            qps: 0,
            capped: false,
        }
    }

    #[test]
    fn the_unshaped_table_marks_each_process_and_says_how_old_it_is() {
        let qp = |qpn: u32| justitia_agent::admin::UnshapedQp {
            device: "rxe0".into(),
            qpn,
            qp_type: "RC".into(),
            state: Some("RTS".into()),
        };
        let r = UnshapedReport {
            processes: vec![justitia_agent::admin::UnshapedProcess {
                pid: 4242,
                uid: Some(0),
                comm: "ib_write_bw".into(),
                tenant: Some("0".into()),
                qps: 7,
                listed: (17..23).map(qp).collect(),
            }],
            unlisted_processes: 2,
            qps: 9,
            ..unshaped_report(ScanState::Scanning)
        };
        let table = unshaped_table(&r, 12_500);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "unshaped processes (RDMA queue pairs, no shaper registered): rxe0 scanned 2.5 s ago, every 1000 ms"
        );
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(&cells[..5], ["unshaped", "4242", "0", "ib_write_bw", "7"]);
        // Four of the seven shown, the rest counted; the tenant last.
        assert!(
            lines[2].contains("rxe0/17 RC RTS, rxe0/18 RC RTS, rxe0/19 RC RTS, rxe0/20 RC RTS, +3"),
            "{table}"
        );
        assert_eq!(cells.last(), Some(&"0"));
        assert_eq!(
            lines[3],
            "and 2 more processes, not listed; 9 queue pairs in all"
        );
        let none = unshaped_table(&unshaped_report(ScanState::Scanning), 10_000);
        assert!(none.ends_with("0.0 s ago, every 1000 ms\nnone\n"), "{none}");
    }

    #[test]
    fn the_unshaped_table_says_why_there_is_none() {
        assert!(unshaped_table(&unshaped_report(ScanState::Off), 0).contains("not looked for"));
        assert!(unshaped_table(&unshaped_report(ScanState::Starting), 0).contains("not completed"));
        let never = UnshapedReport {
            error: Some("no NETLINK_RDMA socket: Protocol not supported (os error 93)".into()),
            scanned_unix_ms: None,
            ..unshaped_report(ScanState::Unavailable)
        };
        assert_eq!(
            unshaped_table(&never, 0),
            "unshaped processes: unknown, no scan has completed: no NETLINK_RDMA socket: Protocol not supported (os error 93)\n"
        );
        let failed = UnshapedReport {
            error: Some("RDMA_NLDEV_CMD_GET: no complete answer within 5s".into()),
            capped: true,
            ..unshaped_report(ScanState::Unavailable)
        };
        let table = unshaped_table(&failed, 11_000);
        assert!(table.starts_with("unshaped processes: the last scan failed (RDMA_NLDEV_CMD_GET: no complete answer within 5s); as of the last one, of rxe0 1.0 s ago:\nnone\n"), "{table}");
        assert!(table.ends_with("there may be more\n"), "{table}");
    }

    #[test]
    fn the_flows_table_shows_the_guarantee_a_read_flow_holds() {
        let flow = FlowReport {
            flow: 4,
            uid: 1000,
            tenant: "1000".into(),
            weight: 2,
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
