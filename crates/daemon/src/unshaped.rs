//! Unshaped processes: those holding RDMA queue pairs on the daemon's devices with no
//! shaper registered.
//!
//! The shaper can be escaped: a program linked statically against rdma-core, a musl
//! container that does not preload the musl build, a process started without
//! `LD_PRELOAD` on a host, a device handed out without the shaper (the CDI `-unshaped`
//! devices), a child forked after its parent's shaper started. Such a process's traffic
//! loads the RNIC the daemon shares without the control loop knowing. Every
//! `unshaped_scan_ms` a thread of its own lists the queue pairs the kernel holds on the
//! daemon's devices ([`crate::rdma_netlink`]) and compares them with the shapers connected:
//!
//! - A queue pair counts when it is a process's (not the kernel's), of a transport that
//!   carries traffic (RC, UC, UD), and its process is neither the daemon nor one with a
//!   shaper connected. The kernel names the thread that created a queue pair; its process
//!   is that thread's thread group (`Tgid:` of `/proc/<pid>/status`).
//! - A process is unshaped once scans have found it so for [`REGISTRATION_GRACE`]: a
//!   shaper connects within milliseconds of its process's first queue pair, and a scan
//!   may fall in between. A scan that finds a process for the first time looks again after
//!   that grace rather than after the interval, so a process is listed within about one
//!   interval and the grace of its first queue pair. After the daemon starts, none is
//!   listed before [`RECONNECT_GRACE`], the time its shapers take to reconnect.
//! - A scan's share of the thread's time is bounded: the wait after a scan is at least
//!   [`IDLE_PER_SCAN`] times the scan's duration ([`next_wait`]).
//! - Its command (`/proc/<pid>/comm`), effective uid and tenant (its uid, or with
//!   `tenant = "cgroup"` its cgroup, as for a registering process) are read at each scan,
//!   each file read bounded; a process gone meanwhile is left out.
//!
//! Limits: a scan reads at most [`MAX_QPS_PER_SCAN`] queue pairs, within
//! [`SCAN_TIMEOUT`]; the table lists at most [`MAX_PROCESSES`] processes (the rest are
//! counted) and [`MAX_QPS_LISTED`] queue pairs of each (all are counted); the per-tenant
//! series name at most [`MAX_TENANT_SERIES`] tenants. A process is logged once, when it is
//! first listed, at most [`crate::limits::LOG_BURST`] lines a second. A scan that fails
//! (no RDMA netlink: an old kernel, no RDMA subsystem, a sandbox) is said once; scans are
//! tried again meanwhile at a doubling interval up to [`MAX_BACKOFF`] (opening the socket
//! can make the kernel look for a module each time).
//!
//! The decision is pure ([`unshaped_candidates`], [`classify`], [`tenant_series`]); the
//! thread does the reading around it. The control loop never waits on this module: it
//! hands over the pids of its connected shapers and takes the encoded answer for
//! `justitia flows` through `try_lock`s of locks the thread holds only to swap an `Arc`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use justitia_agent::admin::{AdminReply, ScanState, UnshapedProcess, UnshapedQp, UnshapedReport};
use tracing::{info, warn};

use crate::config::TenantBy;
use crate::limits::{LogKind, LogLimiter};
use crate::metrics::{Label, Metrics, TenantKey};
use crate::rdma_netlink::{dump_queue_pairs, DeviceFilter, QpDump, QpEntry, QpOwner, QpType};

/// Queue pairs read per scan at most.
pub const MAX_QPS_PER_SCAN: usize = 65_536;
/// Processes the table lists at most (and whose `/proc` files a scan reads).
pub const MAX_PROCESSES: usize = 4096;
/// Queue pairs listed per process at most.
pub const MAX_QPS_LISTED: usize = 64;
/// Tenants named in the per-tenant series at most; the others are summed under
/// [`OTHER_TENANTS`].
pub const MAX_TENANT_SERIES: usize = 64;
/// The label of the tenants beyond [`MAX_TENANT_SERIES`] and of the processes not
/// listed.
pub const OTHER_TENANTS: &str = "(other)";
/// The label of the processes whose tenant could not be read.
pub const UNKNOWN_TENANT: &str = "(unknown)";
/// A scan's time limit: the kernel queries each queue pair (on some RNICs a firmware
/// command each), so a table of tens of thousands takes a while.
pub const SCAN_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest wait between scans while they fail.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long a process must have held its queue pairs with no shaper connected before it
/// is listed. A shaper connects from a thread it starts when its process creates its
/// first shaped queue pair (milliseconds on a host); the daemon greets it as it accepts
/// it and hands the new pid to the scan on the same pass of its loop. A scan that finds a
/// process for the first time looks again this long after its dump (sooner than the
/// interval would), and lists it then if it still has no shaper.
pub const REGISTRATION_GRACE: Duration = Duration::from_millis(100);
/// How long after the scan starts (with the daemon) a process may be listed at the
/// earliest: the shapers of a daemon that restarted reconnect at their next attempt,
/// which their backoff puts at most 1 s after the last one failed.
pub const RECONNECT_GRACE: Duration = Duration::from_millis(1500);
/// What bounds the scan's share of its thread's time: after a scan that took `t`, the
/// next starts no sooner than `t × IDLE_PER_SCAN` later (a minute at most), whatever the
/// interval. The daemon's own work is about 0.2 ms per scan with 1,000 queue pairs
/// (`benches/unshaped_scan.rs`), but a table of tens of thousands, or an RNIC that the
/// kernel queries queue pair by queue pair, takes far longer.
pub const IDLE_PER_SCAN: u32 = 50;
/// Bytes read of `/proc/<pid>/status` (its `Tgid:` and `Uid:` lines come early).
const STATUS_BYTES: u64 = 4096;
/// Bytes read of `/proc/<pid>/comm` (`TASK_COMM_LEN` is 16).
const COMM_BYTES: u64 = 64;
/// Bytes read of `/proc/<pid>/cgroup`.
const CGROUP_BYTES: u64 = 16 * 1024;

/// The pid the kernel gives a queue pair (a thread's: see [`unshaped_candidates`]) when
/// the queue pair counts: a user queue pair of a transport that carries traffic.
fn counted_pid(qp: &QpEntry) -> Option<i32> {
    match qp.owner {
        QpOwner::Process(pid)
            if pid > 0 && matches!(qp.qp_type, QpType::RC | QpType::UC | QpType::UD) =>
        {
            Some(pid)
        }
        _ => None,
    }
}

/// The pids (as the kernel gives them: thread ids for queue pairs created off a main
/// thread) of the counted queue pairs whose pid is neither `own` nor `known`: those whose
/// `/proc` files a scan reads.
pub fn unshaped_candidates(dump: &QpDump, known: &BTreeSet<i32>, own: i32) -> BTreeSet<i32> {
    dump.devices
        .iter()
        .flat_map(|d| d.qps.iter())
        .filter_map(counted_pid)
        .filter(|pid| *pid != own && !known.contains(pid))
        .collect()
}

/// What `/proc` says of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessFacts {
    /// Its thread group (the pid itself when not a thread, or not readable).
    pub tgid: i32,
    /// Its effective uid.
    pub uid: Option<u32>,
    /// Its command, printable; empty when not readable.
    pub comm: String,
    /// Its tenant's key.
    pub tenant: Option<String>,
}

/// A pid looked up in `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// It runs (or ran when its files were read).
    Found(ProcessFacts),
    /// It is gone.
    Gone,
}

/// The unshaped processes a scan found.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UnshapedTable {
    /// The processes listed, by pid.
    pub processes: Vec<UnshapedProcess>,
    /// Unshaped processes not listed (beyond [`MAX_PROCESSES`]).
    pub unlisted: u64,
    /// The queue pairs of all of them.
    pub qps: u64,
}

/// What [`classify`] decides.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Classified {
    /// The table: the processes found unshaped by this scan and by one that read its
    /// dump at least [`REGISTRATION_GRACE`] before this scan took the shapers' pids.
    pub table: UnshapedTable,
    /// The thread groups this scan found unshaped, each with the time of the first dump
    /// of an unbroken run of scans that found it: the next scan's `seen`.
    pub found: BTreeMap<i32, Duration>,
    /// The earliest time at which a process found but not listed yet will have been
    /// unshaped for [`REGISTRATION_GRACE`]: when a scan should look again.
    pub recheck_at: Option<Duration>,
}

/// The times of a scan, since the scanning thread started (the daemon's start, when
/// shapers connected to a daemon before it reconnect): [`classify`]'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanTimes {
    /// When the scan took the pids of the connected shapers (before its dump).
    pub known_at: Duration,
    /// When its dump was complete: the queue pairs it read all existed by then.
    pub dumped_at: Duration,
}

#[derive(Default)]
struct Group<'a> {
    facts: Option<&'a ProcessFacts>,
    listed: Vec<UnshapedQp>,
    qps: u64,
}

/// The unshaped processes of `dump`: see the module documentation. `known` holds the
/// pids of the connected shapers, `own` the daemon's, `facts` what `/proc` said of each
/// candidate ([`unshaped_candidates`]; a candidate without an entry was not looked up,
/// and is counted but not listed), `seen` what the previous scan found (its
/// [`Classified::found`]), `at` this scan's times.
///
/// A process is listed when it was found unshaped by every scan since one whose dump
/// was complete at least [`REGISTRATION_GRACE`] before this scan took `known`: its queue
/// pairs existed then, so a shaper of its own would have connected by now. None is
/// listed before [`RECONNECT_GRACE`].
pub fn classify(
    dump: &QpDump,
    known: &BTreeSet<i32>,
    own: i32,
    facts: &BTreeMap<i32, Lookup>,
    seen: &BTreeMap<i32, Duration>,
    at: ScanTimes,
) -> Classified {
    let mut groups: BTreeMap<i32, Group<'_>> = BTreeMap::new();
    for d in &dump.devices {
        for qp in &d.qps {
            let Some(pid) = counted_pid(qp) else {
                continue;
            };
            if pid == own || known.contains(&pid) {
                continue;
            }
            let found = match facts.get(&pid) {
                Some(Lookup::Gone) => continue,
                Some(Lookup::Found(f)) => Some(f),
                None => None,
            };
            let tgid = found.map_or(pid, |f| f.tgid);
            if tgid == own || known.contains(&tgid) {
                continue;
            }
            let group = groups.entry(tgid).or_default();
            group.qps += 1;
            // The main thread's facts when there are several: threads may name themselves.
            if group.facts.is_none() || pid == tgid {
                group.facts = found.or(group.facts);
            }
            if group.listed.len() < MAX_QPS_LISTED {
                group.listed.push(UnshapedQp {
                    device: d.device.name.clone(),
                    qpn: qp.qpn,
                    qp_type: qp.qp_type.to_string(),
                    state: qp.state.map(|s| s.to_string()),
                });
            }
        }
    }
    let mut out = Classified::default();
    for (tgid, g) in groups {
        let first = seen.get(&tgid).copied().unwrap_or(at.dumped_at);
        out.found.insert(tgid, first);
        let due = first
            .saturating_add(REGISTRATION_GRACE)
            .max(RECONNECT_GRACE);
        if at.known_at < due {
            out.recheck_at = Some(out.recheck_at.map_or(due, |r| r.min(due)));
            continue;
        }
        out.table.qps += g.qps;
        match g.facts {
            Some(f) if out.table.processes.len() < MAX_PROCESSES => {
                out.table.processes.push(UnshapedProcess {
                    pid: tgid,
                    uid: f.uid,
                    comm: f.comm.clone(),
                    tenant: f.tenant.clone(),
                    qps: g.qps,
                    listed: g.listed,
                })
            }
            _ => out.table.unlisted += 1,
        }
    }
    out
}

/// (tenant, processes, queue pairs) for the per-tenant series: the [`MAX_TENANT_SERIES`]
/// tenants with the most queue pairs by name, the rest and the unlisted processes summed
/// under [`OTHER_TENANTS`], those of no known tenant under [`UNKNOWN_TENANT`]. Sorted by
/// label.
pub fn tenant_series(table: &UnshapedTable) -> Vec<(String, u64, u64)> {
    let mut by_tenant: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for p in &table.processes {
        let t = by_tenant
            .entry(p.tenant.as_deref().unwrap_or(UNKNOWN_TENANT))
            .or_default();
        t.0 += 1;
        t.1 += p.qps;
    }
    let mut ranked: Vec<(&str, (u64, u64))> = by_tenant.into_iter().collect();
    // Most queue pairs first; names break ties, so the choice is the same every scan.
    ranked.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(b.0)));
    let listed_qps: u64 = table.processes.iter().map(|p| p.qps).sum();
    let mut other = (table.unlisted, table.qps.saturating_sub(listed_qps));
    let mut series = Vec::new();
    for (i, (tenant, (procs, qps))) in ranked.into_iter().enumerate() {
        if i < MAX_TENANT_SERIES {
            series.push((tenant.to_string(), procs, qps));
        } else {
            other.0 += procs;
            other.1 += qps;
        }
    }
    if other != (0, 0) {
        series.push((OTHER_TENANTS.to_string(), other.0, other.1));
    }
    series.sort();
    series
}

/// `text` for a report or a log line: invalid UTF-8 and control characters replaced,
/// a trailing newline dropped, at most `max` characters.
pub fn printable(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.strip_suffix('\n')
        .unwrap_or(&text)
        .chars()
        .take(max)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// The thread group and the effective uid a `/proc/<pid>/status` text gives.
pub fn status_ids(status: &str) -> (Option<i32>, Option<u32>) {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::split_whitespace)
    };
    let tgid = field("Tgid:").and_then(|mut f| f.next()?.parse().ok());
    // Real, effective, saved, filesystem: SO_PEERCRED gives a shaper's effective uid.
    let uid = field("Uid:").and_then(|mut f| f.nth(1)?.parse().ok());
    (tgid, uid)
}

/// At most `limit` bytes of `path`.
fn read_bounded(path: &str, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(limit)
        .read_to_end(&mut out)?;
    Ok(out)
}

/// What `/proc` says of `pid` now; its tenant as `tenant` makes tenants.
pub fn look_up(pid: i32, tenant: TenantBy) -> Lookup {
    let status = match read_bounded(&format!("/proc/{pid}/status"), STATUS_BYTES) {
        Ok(s) => s,
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ESRCH) =>
        {
            return Lookup::Gone
        }
        // Readable by everyone unless /proc is mounted to hide other users' processes:
        // the process is still listed, with what is known.
        Err(_) => {
            return Lookup::Found(ProcessFacts {
                tgid: pid,
                uid: None,
                comm: String::new(),
                tenant: None,
            })
        }
    };
    let (tgid, uid) = status_ids(&String::from_utf8_lossy(&status));
    let tgid = tgid.filter(|&t| t > 0).unwrap_or(pid);
    let comm = read_bounded(&format!("/proc/{tgid}/comm"), COMM_BYTES)
        .map(|b| printable(&b, 64))
        .unwrap_or_default();
    let tenant = match tenant {
        TenantBy::Uid => uid.map(|u| u.to_string()),
        TenantBy::Cgroup | TenantBy::Pod | TenantBy::Namespace => {
            read_bounded(&format!("/proc/{tgid}/cgroup"), CGROUP_BYTES)
                .ok()
                .and_then(|b| {
                    crate::tenant::cgroup_of(&String::from_utf8_lossy(&b))
                        .map(|p| printable(p.as_bytes(), 4096))
                })
        }
    };
    Lookup::Found(ProcessFacts {
        tgid,
        uid,
        comm,
        tenant,
    })
}

/// What the scan is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanSettings {
    /// The time between scans.
    pub interval: Duration,
    /// The devices read.
    pub devices: DeviceFilter,
    /// What a tenant is.
    pub tenant: TenantBy,
}

/// What the loop and the scanning thread share.
struct Shared {
    /// The pids of the connected shapers.
    known: Mutex<Arc<[i32]>>,
    /// The answer to `justitia flows`' request, encoded, newline-terminated.
    answer: Mutex<Arc<[u8]>>,
    stop: AtomicBool,
}

/// The scanning thread, from the loop's side. Dropping it stops the thread at its next
/// wake-up (a scan in progress finishes first, within [`SCAN_TIMEOUT`]).
pub struct Scanner {
    shared: Arc<Shared>,
    thread: std::thread::Thread,
}

/// The admin answer, encoded as the admin socket sends it.
fn encode(reply: &AdminReply) -> Arc<[u8]> {
    let mut text = serde_json::to_vec(reply)
        .unwrap_or_else(|e| format!("{{\"error\":\"answer not encoded: {e}\"}}").into_bytes());
    text.push(b'\n');
    text.into()
}

/// The answer when no scan runs (`unshaped_scan_ms = 0`).
pub fn off_answer() -> Arc<[u8]> {
    encode(&AdminReply::Unshaped(UnshapedReport {
        scan: ScanState::Off,
        error: None,
        interval_ms: 0,
        scanned_unix_ms: None,
        devices: Vec::new(),
        processes: Vec::new(),
        unlisted_processes: 0,
        qps: 0,
        capped: false,
    }))
}

impl Scanner {
    /// Starts the scanning thread.
    pub fn start(settings: ScanSettings, metrics: Metrics) -> std::io::Result<Scanner> {
        for result in ["completed", "failed"] {
            // Both series from the start, at zero, so that a rate over them is defined.
            let _ = metrics.unshaped_scans.get_or_create(&Label {
                value: result.into(),
            });
        }
        let mut scans = ScanThread::new(settings, metrics);
        let shared = Arc::new(Shared {
            known: Mutex::new(Arc::from(Vec::new())),
            answer: Mutex::new(scans.answer(ScanState::Starting)),
            stop: AtomicBool::new(false),
        });
        let theirs = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("unshaped-scan".into())
            .spawn(move || scans.run(&theirs))?;
        Ok(Scanner {
            shared,
            thread: handle.thread().clone(),
        })
    }

    /// Hands over the pids of the connected shapers; `false` when the thread held the
    /// lock at that instant (the caller tries again on its next pass).
    pub fn set_known(&self, pids: Arc<[i32]>) -> bool {
        // A lock poisoned by a panic while held holds an Arc all the same.
        let mut known = match self.shared.known.try_lock() {
            Ok(k) => k,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        *known = pids;
        true
    }

    /// The encoded answer of the last scan; `None` when the thread held the lock at that
    /// instant.
    pub fn answer(&self) -> Option<Arc<[u8]>> {
        match self.shared.answer.try_lock() {
            Ok(a) => Some(Arc::clone(&a)),
            Err(TryLockError::Poisoned(p)) => Some(Arc::clone(&p.into_inner())),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

impl Drop for Scanner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.thread.unpark();
    }
}

/// The last completed scan, as reported.
struct LastScan {
    table: UnshapedTable,
    devices: Vec<String>,
    unix_ms: u64,
    capped: bool,
}

/// The scanning thread's state between scans.
struct ScanThread {
    settings: ScanSettings,
    metrics: Metrics,
    own: i32,
    /// The origin of the scan's times ([`ScanTimes`]).
    epoch: Instant,
    /// The thread groups the previous scan found unshaped, with when they were first
    /// found.
    seen: BTreeMap<i32, Duration>,
    /// When a process found but not listed yet is due for another look.
    recheck_at: Option<Duration>,
    last: Option<LastScan>,
    /// The last scan's error, while scans fail.
    failing: Option<String>,
    logs: LogLimiter,
}

impl ScanThread {
    fn new(settings: ScanSettings, metrics: Metrics) -> ScanThread {
        ScanThread {
            settings,
            metrics,
            own: i32::try_from(std::process::id()).unwrap_or(0),
            epoch: Instant::now(),
            seen: BTreeMap::new(),
            recheck_at: None,
            last: None,
            failing: None,
            logs: LogLimiter::default(),
        }
    }

    fn answer(&self, scan: ScanState) -> Arc<[u8]> {
        let last = self.last.as_ref();
        let table = last.map(|l| &l.table);
        encode(&AdminReply::Unshaped(UnshapedReport {
            scan,
            error: self.failing.clone(),
            interval_ms: u64::try_from(self.settings.interval.as_millis()).unwrap_or(u64::MAX),
            scanned_unix_ms: last.map(|l| l.unix_ms),
            devices: last.map(|l| l.devices.clone()).unwrap_or_default(),
            processes: table.map(|t| t.processes.clone()).unwrap_or_default(),
            unlisted_processes: table.map_or(0, |t| t.unlisted),
            qps: table.map_or(0, |t| t.qps),
            capped: last.is_some_and(|l| l.capped),
        }))
    }

    fn run(&mut self, shared: &Shared) {
        leave_real_time();
        let mut wait = self.settings.interval;
        while !shared.stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            let known: BTreeSet<i32> = match shared.known.lock() {
                Ok(k) => k.iter().copied().collect(),
                Err(poisoned) => poisoned.into_inner().iter().copied().collect(),
            };
            let state = if self.scan(&known, started) {
                let now = Instant::now();
                let took = now.saturating_duration_since(started);
                self.metrics.unshaped_scan_seconds.set(took.as_secs_f64());
                let recheck_in = self
                    .recheck_at
                    .map(|at| at.saturating_sub(now.saturating_duration_since(self.epoch)));
                wait = next_wait(self.settings.interval, recheck_in, took);
                ScanState::Scanning
            } else {
                wait = (wait * 2).min(MAX_BACKOFF.max(self.settings.interval));
                ScanState::Unavailable
            };
            let answer = self.answer(state);
            match shared.answer.lock() {
                Ok(mut a) => *a = answer,
                Err(poisoned) => *poisoned.into_inner() = answer,
            }
            let until = Instant::now() + wait;
            while !shared.stop.load(Ordering::Relaxed) {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::park_timeout(left);
            }
        }
    }

    /// One scan: the dump, the lookups, the decision, then the log lines, the metrics
    /// and the table kept for the answer; whether it completed. A failure is said when
    /// scans start failing.
    fn scan(&mut self, known: &BTreeSet<i32>, known_at: Instant) -> bool {
        let scans = |result: &str| {
            self.metrics
                .unshaped_scans
                .get_or_create(&Label {
                    value: result.into(),
                })
                .inc();
        };
        let dump = match dump_queue_pairs(&self.settings.devices, MAX_QPS_PER_SCAN, SCAN_TIMEOUT) {
            Ok(d) => d,
            Err(e) => {
                scans("failed");
                let error = e.to_string();
                if self.failing.is_none() {
                    warn!(error = %error, retry_max_s = MAX_BACKOFF.as_secs(),
                          "unshaped processes cannot be listed (RDMA netlink); the daemon carries on without, and tries again");
                }
                self.failing = Some(error);
                return false;
            }
        };
        let dumped_at = Instant::now();
        scans("completed");
        if self.failing.take().is_some() {
            info!("unshaped processes are listed again (RDMA netlink answers)");
        }
        let facts: BTreeMap<i32, Lookup> = unshaped_candidates(&dump, known, self.own)
            .into_iter()
            .take(MAX_PROCESSES)
            .map(|pid| (pid, look_up(pid, self.settings.tenant)))
            .collect();
        let at = ScanTimes {
            known_at: known_at.saturating_duration_since(self.epoch),
            dumped_at: dumped_at.saturating_duration_since(self.epoch),
        };
        let decided = classify(&dump, known, self.own, &facts, &self.seen, at);
        self.seen = decided.found;
        self.recheck_at = decided.recheck_at;
        let table = decided.table;
        self.log_new(&table, dump.capped, at.dumped_at);
        self.publish_metrics(&table);
        self.last = Some(LastScan {
            devices: dump.devices.iter().map(|d| d.device.name.clone()).collect(),
            unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            capped: dump.capped,
            table,
        });
        true
    }

    /// One line per process when it is first listed, rate-limited, with how long after
    /// the first dump that found it (`dumped_at` is this scan's); one when the scan first
    /// reaches its cap.
    fn log_new(&mut self, table: &UnshapedTable, capped: bool, dumped_at: Duration) {
        let listed_before: BTreeSet<i32> = self
            .last
            .as_ref()
            .map(|l| l.table.processes.iter().map(|p| p.pid).collect())
            .unwrap_or_default();
        for p in &table.processes {
            if listed_before.contains(&p.pid) {
                continue;
            }
            let now = justitia_agent::block::monotonic_ns();
            let (ok, dropped) = self.logs.allow(LogKind::Unshaped, now);
            if dropped > 0 {
                warn!(
                    dropped,
                    "unshaped process lines dropped by the rate limit in the last second"
                );
            }
            if ok {
                let uid = p.uid.map_or_else(|| "-".to_string(), |u| u.to_string());
                let first = p
                    .listed
                    .first()
                    .map_or_else(String::new, |q| format!("{}/{}", q.device, q.qpn));
                let found_ms = self.seen.get(&p.pid).map_or(0, |&f| {
                    u64::try_from(dumped_at.saturating_sub(f).as_millis()).unwrap_or(u64::MAX)
                });
                warn!(pid = p.pid, comm = %p.comm, uid = %uid, tenant = p.tenant.as_deref().unwrap_or(UNKNOWN_TENANT),
                      qps = p.qps, first_qp = %first, found_ms,
                      "unshaped process: RDMA queue pairs with no shaper registered");
            }
        }
        let was_capped = self.last.as_ref().is_some_and(|l| l.capped);
        if capped && !was_capped {
            warn!(
                max = MAX_QPS_PER_SCAN,
                "the scan for unshaped processes stopped at its cap of queue pairs: there may be more"
            );
        }
    }

    fn publish_metrics(&self, table: &UnshapedTable) {
        let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let processes = (table.processes.len() as u64).saturating_add(table.unlisted);
        self.metrics.unshaped_processes.set(gauge(processes));
        self.metrics.unshaped_qps.set(gauge(table.qps));
        self.metrics.tenant_unshaped_processes.clear();
        self.metrics.tenant_unshaped_qps.clear();
        for (tenant, procs, qps) in tenant_series(table) {
            let label = TenantKey { tenant };
            self.metrics
                .tenant_unshaped_processes
                .get_or_create(&label)
                .set(gauge(procs));
            self.metrics
                .tenant_unshaped_qps
                .get_or_create(&label)
                .set(gauge(qps));
        }
    }
}

/// The wait after a scan that took `took`: the interval, or less when a process found
/// unshaped is due for another look in `recheck_in`, but never less than
/// [`IDLE_PER_SCAN`] times the scan (its share of the thread's time stays below
/// 1/[`IDLE_PER_SCAN`]) unless that is longer than [`MAX_BACKOFF`] and the interval: a
/// scan runs at least that often.
pub fn next_wait(interval: Duration, recheck_in: Option<Duration>, took: Duration) -> Duration {
    let wanted = recheck_in.map_or(interval, |r| r.min(interval));
    let floor = took
        .saturating_mul(IDLE_PER_SCAN)
        .min(MAX_BACKOFF.max(interval));
    wanted.max(floor)
}

/// Puts the calling thread under the normal scheduling policy: a daemon started at a
/// real-time priority (by a launcher that does not reset it for new threads, as systemd's
/// `CPUSchedulingResetOnFork=` does) would otherwise scan at the loop's own priority, and
/// a loop woken on a busy core waits for a running thread of equal priority to yield.
fn leave_real_time() {
    // SAFETY: all-zero is a valid sched_param (priority 0, the only one SCHED_OTHER
    // takes), passed for this thread. A refusal (a seccomp filter without the call) leaves
    // the policy as it was, which is all that can be done.
    unsafe {
        let param: libc::sched_param = std::mem::zeroed();
        libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_OTHER, &param);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::rdma_netlink::{DeviceQps, QpState, RdmaDevice};

    fn qp(qpn: u32, qp_type: QpType, owner: QpOwner) -> QpEntry {
        QpEntry {
            qpn,
            qp_type,
            state: Some(QpState(3)),
            owner,
        }
    }

    fn dump(devices: &[(&str, Vec<QpEntry>)]) -> QpDump {
        QpDump {
            devices: devices
                .iter()
                .enumerate()
                .map(|(i, (name, qps))| DeviceQps {
                    device: RdmaDevice {
                        index: i as u32,
                        name: (*name).into(),
                    },
                    qps: qps.clone(),
                })
                .collect(),
            capped: false,
        }
    }

    fn facts(pid: i32, tgid: i32, uid: u32, comm: &str) -> (i32, Lookup) {
        (
            pid,
            Lookup::Found(ProcessFacts {
                tgid,
                uid: Some(uid),
                comm: comm.into(),
                tenant: Some(uid.to_string()),
            }),
        )
    }

    fn set(pids: &[i32]) -> BTreeSet<i32> {
        pids.iter().copied().collect()
    }

    /// Found at `at` ms since the scan started.
    fn seen(pids: &[i32], at: u64) -> BTreeMap<i32, Duration> {
        pids.iter().map(|&p| (p, ms(at))).collect()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A scan that took the pids at `known_at` ms and read its dump 5 ms later.
    fn at(known_at: u64) -> ScanTimes {
        ScanTimes {
            known_at: ms(known_at),
            dumped_at: ms(known_at + 5),
        }
    }

    /// Well after the daemon's start.
    const T: u64 = 10_000;

    const OWN: i32 = 10;
    use QpOwner::{Kernel, Process, Unnamed};

    /// The host of the guest check: the daemon's probe (2 RC QPs, pid 10), a shaped
    /// ib_write_bw pair (pids 20 and 21, connected), a plain pair (30 and 31, not), the
    /// kernel's GSI QP, a UD QP of a process the kernel does not name, and a RAW_PACKET QP
    /// of pid 40.
    fn host() -> QpDump {
        dump(&[(
            "rxe0",
            vec![
                qp(1, QpType(1), Kernel("ib_core".into())),
                qp(17, QpType::RC, Process(OWN)),
                qp(18, QpType::RC, Process(OWN)),
                qp(19, QpType::RC, Process(20)),
                qp(20, QpType::RC, Process(21)),
                qp(21, QpType::RC, Process(30)),
                qp(22, QpType::RC, Process(31)),
                qp(23, QpType::UD, Unnamed),
                qp(24, QpType(8), Process(40)),
            ],
        )])
    }

    #[test]
    fn only_user_qps_of_traffic_transports_without_a_shaper_are_candidates() {
        assert_eq!(
            unshaped_candidates(&host(), &set(&[20, 21]), OWN),
            set(&[30, 31])
        );
        assert_eq!(
            unshaped_candidates(&host(), &set(&[]), OWN),
            set(&[20, 21, 30, 31])
        );
    }

    #[test]
    fn a_process_is_listed_once_found_for_the_registration_grace() {
        let known = set(&[20, 21]);
        let f: BTreeMap<i32, Lookup> = [
            facts(30, 30, 0, "ib_write_bw"),
            facts(31, 31, 0, "ib_write_bw"),
        ]
        .into_iter()
        .collect();
        let first = classify(&host(), &known, OWN, &f, &BTreeMap::new(), at(T));
        assert_eq!(first.found, seen(&[30, 31], T + 5));
        assert_eq!(first.table, UnshapedTable::default());
        // Looked at again once the grace after the first dump is over, not at the interval.
        let due = ms(T + 5) + REGISTRATION_GRACE;
        assert_eq!(first.recheck_at, Some(due));
        // A scan before then (a shorter interval) still waits.
        let early = classify(&host(), &known, OWN, &f, &first.found, at(T + 50));
        assert_eq!(early.table, UnshapedTable::default());
        assert_eq!(
            (early.found.clone(), early.recheck_at),
            (first.found.clone(), Some(due))
        );
        let second = classify(&host(), &known, OWN, &f, &early.found, at(T + 105));
        assert_eq!(second.recheck_at, None);
        let t = &second.table;
        assert_eq!((t.qps, t.unlisted), (2, 0));
        assert_eq!(
            t.processes[0],
            UnshapedProcess {
                pid: 30,
                uid: Some(0),
                comm: "ib_write_bw".into(),
                tenant: Some("0".into()),
                qps: 1,
                listed: vec![UnshapedQp {
                    device: "rxe0".into(),
                    qpn: 21,
                    qp_type: "RC".into(),
                    state: Some("RTS".into()),
                }],
            }
        );
        assert_eq!(t.processes[1].pid, 31);
        // Registered between the scans: gone from the table at once.
        let third = classify(
            &host(),
            &set(&[20, 21, 31]),
            OWN,
            &f,
            &second.found,
            at(T + 205),
        );
        assert_eq!(third.table.processes.len(), 1);
        assert_eq!(third.found, seen(&[30], T + 5));
    }

    #[test]
    fn a_shaper_that_connects_within_the_grace_is_never_listed() {
        // Process 40 creates its queue pair just before a scan's dump and connects 60 ms
        // later, after the scan took the pids: the re-check finds it registered.
        let d = dump(&[("rxe0", vec![qp(30, QpType::RC, Process(40))])]);
        let f: BTreeMap<i32, Lookup> = [facts(40, 40, 1000, "trainer")].into_iter().collect();
        let first = classify(&d, &set(&[]), OWN, &f, &BTreeMap::new(), at(T));
        assert!(first.table.processes.is_empty());
        let recheck = first.recheck_at.unwrap();
        let again = classify(
            &d,
            &set(&[40]),
            OWN,
            &f,
            &first.found,
            at(recheck.as_millis() as u64),
        );
        assert_eq!(again.table, UnshapedTable::default());
        assert!(again.found.is_empty() && again.recheck_at.is_none());
        // Gone for one scan (its shaper connected, then left): found anew, a new grace.
        let back = classify(&d, &set(&[]), OWN, &f, &again.found, at(T + 300));
        assert!(back.table.processes.is_empty());
        assert_eq!(back.recheck_at, Some(ms(T + 305) + REGISTRATION_GRACE));
    }

    #[test]
    fn after_the_start_shapers_have_time_to_reconnect() {
        let f: BTreeMap<i32, Lookup> = [
            facts(30, 30, 0, "ib_write_bw"),
            facts(31, 31, 0, "ib_write_bw"),
        ]
        .into_iter()
        .collect();
        let known = set(&[20, 21]);
        let first = classify(&host(), &known, OWN, &f, &BTreeMap::new(), at(0));
        assert_eq!(first.recheck_at, Some(RECONNECT_GRACE));
        let soon = classify(&host(), &known, OWN, &f, &first.found, at(200));
        assert!(soon.table.processes.is_empty());
        let ready = RECONNECT_GRACE.as_millis() as u64;
        let later = classify(&host(), &known, OWN, &f, &soon.found, at(ready));
        assert_eq!(later.table.processes.len(), 2);
    }

    #[test]
    fn the_wait_is_the_interval_or_a_recheck_and_bounds_the_scans_share() {
        let second = Duration::from_secs(1);
        assert_eq!(next_wait(second, None, ms(1)), second);
        assert_eq!(next_wait(second, Some(ms(80)), ms(1)), ms(80));
        assert_eq!(next_wait(ms(50), Some(ms(80)), ms(1)), ms(50));
        // A recheck due already, and a scan of 10 ms: at least 50 times that.
        assert_eq!(next_wait(ms(50), Some(ms(0)), Duration::ZERO), ms(0));
        assert_eq!(next_wait(ms(100), Some(ms(20)), ms(10)), ms(500));
        // A scan of 5 s (its time limit): the next one a minute later, not 250 s.
        assert_eq!(next_wait(second, None, Duration::from_secs(5)), MAX_BACKOFF);
        assert_eq!(
            next_wait(Duration::from_secs(600), None, Duration::from_secs(5)),
            Duration::from_secs(600)
        );
    }

    #[test]
    fn threads_count_for_their_process_and_a_gone_process_is_left_out() {
        // Pid 30 is exiting; thread 52 of process 50 (connected) and thread 61 of
        // process 60 (not) created QPs, as did 60's main thread.
        let d = dump(&[
            (
                "mlx5_0",
                vec![
                    qp(5, QpType::RC, Process(30)),
                    qp(6, QpType::UC, Process(52)),
                ],
            ),
            (
                "mlx5_1",
                vec![
                    qp(7, QpType::RC, Process(61)),
                    qp(8, QpType::UD, Process(60)),
                ],
            ),
        ]);
        let f: BTreeMap<i32, Lookup> = [
            (30, Lookup::Gone),
            facts(52, 50, 1000, "worker"),
            facts(61, 60, 1000, "worker"),
            facts(60, 60, 1000, "trainer"),
        ]
        .into_iter()
        .collect();
        let known = set(&[50]);
        let c = classify(&d, &known, OWN, &f, &seen(&[60], T - 200), at(T));
        assert_eq!(c.found, seen(&[60], T - 200));
        let p = &c.table.processes[..];
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].pid, p[0].comm.as_str(), p[0].qps), (60, "trainer", 2));
        let qpns: Vec<(&str, u32)> = p[0]
            .listed
            .iter()
            .map(|q| (q.device.as_str(), q.qpn))
            .collect();
        assert_eq!(qpns, [("mlx5_1", 7), ("mlx5_1", 8)]);
        // A thread of the daemon itself.
        let own_thread: BTreeMap<i32, Lookup> =
            [facts(11, OWN, 0, "justitiad")].into_iter().collect();
        let d = dump(&[("rxe0", vec![qp(9, QpType::RC, Process(11))])]);
        assert!(
            classify(&d, &set(&[]), OWN, &own_thread, &seen(&[OWN, 11], 0), at(T))
                .found
                .is_empty()
        );
    }

    #[test]
    fn the_caps_bound_the_table_and_every_queue_pair_is_counted() {
        let n = MAX_PROCESSES + 3;
        let mut qps = Vec::new();
        for pid in 100..100 + n as i32 {
            qps.push(qp(pid as u32, QpType::RC, Process(pid)));
        }
        // One process with more queue pairs than are listed.
        for i in 0..(MAX_QPS_LISTED + 5) as u32 {
            qps.push(qp(100_000 + i, QpType::RC, Process(100)));
        }
        let d = dump(&[("rxe0", qps)]);
        let candidates = unshaped_candidates(&d, &set(&[]), OWN);
        // The scan looks up the first MAX_PROCESSES; the others are counted unlisted.
        let f: BTreeMap<i32, Lookup> = candidates
            .iter()
            .take(MAX_PROCESSES)
            .map(|&p| facts(p, p, 1000, "x"))
            .collect();
        let before: BTreeMap<i32, Duration> = candidates.iter().map(|&p| (p, ms(0))).collect();
        let c = classify(&d, &set(&[]), OWN, &f, &before, at(T));
        assert_eq!(c.table.processes.len(), MAX_PROCESSES);
        assert_eq!(c.table.unlisted, 3);
        assert_eq!(c.table.qps, (n + MAX_QPS_LISTED + 5) as u64);
        let first = &c.table.processes[0];
        assert_eq!(
            (first.qps, first.listed.len()),
            ((MAX_QPS_LISTED + 6) as u64, MAX_QPS_LISTED)
        );
        // One tenant of 4096 listed processes, and the unlisted summed apart.
        assert_eq!(
            tenant_series(&c.table),
            [
                (OTHER_TENANTS.to_string(), 3, 3),
                (
                    "1000".to_string(),
                    MAX_PROCESSES as u64,
                    (MAX_PROCESSES + MAX_QPS_LISTED + 5) as u64
                )
            ]
        );
    }

    #[test]
    fn the_tenant_series_are_capped_by_queue_pairs() {
        let process = |pid: i32, tenant: Option<&str>, qps: u64| UnshapedProcess {
            pid,
            uid: None,
            comm: String::new(),
            tenant: tenant.map(str::to_string),
            qps,
            listed: Vec::new(),
        };
        let mut processes: Vec<UnshapedProcess> = (0..MAX_TENANT_SERIES as i32 + 2)
            .map(|i| process(i, Some(&format!("/t/{i:03}")), 10 + i as u64))
            .collect();
        processes.push(process(500, None, 1));
        let qps = processes.iter().map(|p| p.qps).sum();
        let table = UnshapedTable {
            processes,
            unlisted: 0,
            qps,
        };
        let series = tenant_series(&table);
        // 67 tenants (66 cgroups and the unknown one): the 64 with the most queue pairs
        // by name; /t/000 (10), /t/001 (11) and the unknown (1) summed: 3 processes, 22.
        assert_eq!(series.len(), MAX_TENANT_SERIES + 1);
        assert_eq!(series[0], (OTHER_TENANTS.to_string(), 3, 22));
        assert_eq!(series[1].0, "/t/002");
        assert!(!series.iter().any(|s| s.0 == UNKNOWN_TENANT));
        let total: u64 = series.iter().map(|s| s.2).sum();
        assert_eq!(total, table.qps);
    }

    #[test]
    fn proc_text_is_read_with_care() {
        let status = "Name:\tib_write_bw\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4243\nPPid:\t1\nUid:\t1000\t2000\t1000\t1000\nGid:\t100\t100\t100\t100\n";
        assert_eq!(status_ids(status), (Some(4242), Some(2000)));
        assert_eq!(status_ids("Uid:\t1000\n"), (None, None));
        assert_eq!(status_ids(""), (None, None));
        assert_eq!(printable(b"ib_write_bw\n", 64), "ib_write_bw");
        assert_eq!(printable(b"a\x1b[31mb\tc\xff", 64), "a?[31mb?c\u{fffd}");
        assert_eq!(printable(b"abcdef", 3), "abc");
    }

    #[test]
    fn this_process_is_looked_up_and_a_gone_one_is_gone() {
        let me = i32::try_from(std::process::id()).unwrap();
        let Lookup::Found(f) = look_up(me, TenantBy::Uid) else {
            panic!("this process is gone")
        };
        let euid = rustix::process::geteuid().as_raw();
        assert_eq!(
            (f.tgid, f.uid, f.tenant.clone()),
            (me, Some(euid), Some(euid.to_string()))
        );
        assert!(!f.comm.is_empty());
        let Lookup::Found(c) = look_up(me, TenantBy::Cgroup) else {
            panic!("this process is gone")
        };
        assert_eq!(c.tenant, crate::tenant::read_cgroup(me).ok());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        child.wait().unwrap();
        assert_eq!(look_up(pid, TenantBy::Uid), Lookup::Gone);
    }

    #[test]
    fn the_off_answer_says_off() {
        let text = off_answer();
        let reply: AdminReply = serde_json::from_slice(&text).unwrap();
        let AdminReply::Unshaped(r) = reply else {
            panic!("{reply:?}")
        };
        assert_eq!((r.scan, r.interval_ms), (ScanState::Off, 0));
        assert_eq!(text.last(), Some(&b'\n'));
    }
}
