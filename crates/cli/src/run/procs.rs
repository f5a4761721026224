//! The processes of a real run: one responder and one requester per flow, all in one
//! process group of their own, so that a Ctrl-C at the terminal reaches only the runner,
//! which then ends the whole group and reaps every child; no process, and so no queue
//! pair (the kernel destroys a process's verbs objects with it), outlives the run.
//!
//! Each child's stdout lines arrive on one channel, tagged with the child's index; its
//! stderr is kept, the last [`STDERR_LINES`] lines, for the error that names the flow.
//!
//! A child may also run on another host, started there by `justitia run-server` over a
//! [`Link`]: its lines arrive on the same channel (the link's reader routes them), and the
//! same calls tell it, wait for it and end it, so that the runner has one code path
//! whichever host each end of a flow runs on.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::remote::Link;
use super::wire::{self, Exit};

/// Lines of a child's stderr kept for its error message.
pub const STDERR_LINES: usize = 12;

/// Longest stdout line read from a child (an outcome's JSON is well under it).
const MAX_LINE: u64 = 64 * 1024;

/// How long the group has to end after SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(3);

/// Set by SIGINT and SIGTERM while a run is in progress.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Makes Ctrl-C and SIGTERM set a flag that the runner's loops check, instead of ending
/// the runner before it has ended its children.
pub fn catch_interrupts() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Whether Ctrl-C or SIGTERM arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// What a child said on stdout.
pub enum Said {
    /// One line, without its newline.
    Line(String),
    /// Its stdout closed (it exited, or is about to).
    Closed,
}

/// One child: what it is, and where it runs.
pub struct Kid {
    /// `flow NAME (requester)` or `flow NAME (responder on b)`: every error about it
    /// starts so.
    pub label: String,
    how: How,
}

/// Where a child runs.
enum How {
    /// Here: the process, its stdin, its kept stderr.
    Local(Local),
    /// On a run-server's host, known there by `id`.
    Remote { link: Arc<Link>, id: u64 },
}

/// A child on this host.
struct Local {
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    readers: Vec<JoinHandle<()>>,
}

/// The children of one run, in one process group.
pub struct Group {
    pgid: Option<i32>,
    /// [`Group::end_all`] ran: every child is gone.
    ended: bool,
    kids: Vec<Kid>,
    said_tx: Sender<(usize, Said)>,
    said_rx: Receiver<(usize, Said)>,
}

impl Group {
    /// An empty group.
    pub fn new() -> Group {
        let (said_tx, said_rx) = mpsc::channel();
        Group {
            pgid: None,
            ended: false,
            kids: Vec::new(),
            said_tx,
            said_rx,
        }
    }

    /// Starts `command` in the group; returns its index.
    pub fn spawn(&mut self, label: String, mut command: Command) -> Result<usize> {
        if self.ended {
            bail!("{label}: the group has ended");
        }
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(self.pgid.unwrap_or(0));
        let mut child = command
            .spawn()
            .with_context(|| format!("{label}: starting {:?}", command.get_program()))?;
        let pid = i32::try_from(child.id()).context("process id")?;
        self.pgid.get_or_insert(pid);
        let index = self.kids.len();
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            let tx = self.said_tx.clone();
            readers.push(std::thread::spawn(move || {
                let mut reader = BufReader::new(out);
                loop {
                    let mut line = String::new();
                    match std::io::Read::take(&mut reader, MAX_LINE).read_line(&mut line) {
                        Ok(n) if n > 0 => {
                            let _ = tx.send((index, Said::Line(line.trim_end().to_string())));
                        }
                        _ => break,
                    }
                }
                let _ = tx.send((index, Said::Closed));
            }));
        }
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(err) = child.stderr.take() {
            let kept = Arc::clone(&stderr);
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
                    if kept.len() == STDERR_LINES {
                        kept.pop_front();
                    }
                    kept.push_back(line.chars().take(400).collect());
                }
            }));
        }
        let stdin = child.stdin.take();
        self.kids.push(Kid {
            label,
            how: How::Local(Local {
                child,
                stdin,
                stderr,
                readers,
            }),
        });
        Ok(index)
    }

    /// Starts `spawn` (its id set here) on `link`'s host; returns its index. Its lines
    /// arrive through [`Group::next`] like a local child's.
    pub fn spawn_remote(
        &mut self,
        label: String,
        link: &Arc<Link>,
        mut spawn: wire::Spawn,
    ) -> Result<usize> {
        if self.ended {
            bail!("{label}: the group has ended");
        }
        let index = self.kids.len();
        spawn.id = link.next_id();
        let id = spawn.id;
        link.spawn(index, self.said_tx.clone(), spawn)
            .with_context(|| format!("{label}: starting it on {}", link.name()))?;
        self.kids.push(Kid {
            label,
            how: How::Remote {
                link: Arc::clone(link),
                id,
            },
        });
        Ok(index)
    }

    /// How the local child at `index` exited, if it has (without waiting); `None` for a
    /// child still running or on another host.
    pub fn exit(&mut self, index: usize) -> Option<Exit> {
        let How::Local(local) = &mut self.kids[index].how else {
            return None;
        };
        let status = match local.child.try_wait() {
            Ok(Some(status)) => status,
            Ok(None) => return None,
            Err(e) => {
                return Some(Exit {
                    ok: false,
                    status: format!("cannot be waited for: {e}"),
                    stderr: Vec::new(),
                })
            }
        };
        // Give the stderr reader a moment to take the last lines.
        std::thread::sleep(Duration::from_millis(50));
        let kept = local.stderr.lock().unwrap_or_else(PoisonError::into_inner);
        Some(Exit {
            ok: status.success(),
            status: format!("exited with {status}"),
            stderr: kept.iter().cloned().collect(),
        })
    }

    /// The child at `index`.
    pub fn kid(&self, index: usize) -> &Kid {
        &self.kids[index]
    }

    /// The next line any child says, within `timeout`; `None` when nothing came.
    pub fn next(&self, timeout: Duration) -> Result<Option<(usize, Said)>> {
        if interrupted() {
            bail!("interrupted");
        }
        match self.said_rx.recv_timeout(timeout) {
            Ok(said) => Ok(Some(said)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => bail!("every child's output closed"),
        }
    }

    /// Writes `line` to the child's stdin.
    pub fn tell(&mut self, index: usize, line: &str) -> Result<()> {
        let kid = &mut self.kids[index];
        let label = kid.label.clone();
        match &mut kid.how {
            How::Local(local) => {
                let stdin = local
                    .stdin
                    .as_mut()
                    .with_context(|| format!("{label}: no stdin"))?;
                writeln!(stdin, "{line}")
                    .and_then(|()| stdin.flush())
                    .with_context(|| format!("{label}: writing to its stdin"))
            }
            How::Remote { link, id } => link
                .tell(*id, line)
                .with_context(|| format!("{label}: writing to its stdin")),
        }
    }

    /// Why the child at `index` failed: its exit status (waited for up to `wait`) and the
    /// last lines of its stderr.
    pub fn failure(&mut self, index: usize, wait: Duration) -> String {
        let kid = &mut self.kids[index];
        let (status, tail) = match &mut kid.how {
            How::Local(local) => {
                let started = Instant::now();
                let status = loop {
                    match local.child.try_wait() {
                        Ok(Some(status)) => break format!("exited with {status}"),
                        Ok(None) if started.elapsed() < wait => {
                            std::thread::sleep(Duration::from_millis(20))
                        }
                        Ok(None) => break "still running".to_string(),
                        Err(e) => break format!("cannot be waited for: {e}"),
                    }
                };
                // Give the stderr reader a moment to take the last lines.
                std::thread::sleep(Duration::from_millis(50));
                let kept = local.stderr.lock().unwrap_or_else(PoisonError::into_inner);
                (status, kept.iter().cloned().collect::<Vec<_>>())
            }
            How::Remote { link, id } => match link.exit(*id, wait) {
                Some(exit) => (exit.status, exit.stderr),
                None => ("still running".to_string(), Vec::new()),
            },
        };
        if tail.is_empty() {
            format!("{} {status}", kid.label)
        } else {
            format!("{} {status}: {}", kid.label, tail.join(" | "))
        }
    }

    /// Whether the child at `index` exited successfully, waiting up to `wait` for it;
    /// `false` if it failed or still runs.
    pub fn exited_ok(&mut self, index: usize, wait: Duration) -> bool {
        let local = match &mut self.kids[index].how {
            How::Local(local) => local,
            How::Remote { link, id } => return link.exit(*id, wait).is_some_and(|e| e.ok),
        };
        let started = Instant::now();
        loop {
            match local.child.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if started.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => return false,
            }
        }
    }

    /// Waits for every child to exit by itself within `timeout`, then ends the rest.
    /// Returns the labels and statuses of those that failed.
    pub fn finish(mut self, timeout: Duration) -> Vec<String> {
        let started = Instant::now();
        let mut failed = Vec::new();
        let mut pending: Vec<usize> = (0..self.kids.len()).collect();
        while !pending.is_empty() && started.elapsed() < timeout && !interrupted() {
            pending.retain(|&i| match &mut self.kids[i].how {
                How::Local(local) => match local.child.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() {
                            failed.push(i);
                        }
                        false
                    }
                    Ok(None) => true,
                    Err(_) => false,
                },
                How::Remote { link, id } => match link.exit(*id, Duration::ZERO) {
                    Some(exit) => {
                        if !exit.ok {
                            failed.push(i);
                        }
                        false
                    }
                    None => true,
                },
            });
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut messages: Vec<String> = failed
            .into_iter()
            .map(|i| self.failure(i, Duration::ZERO))
            .collect();
        for i in pending {
            messages.push(format!(
                "{} did not exit within {} s",
                self.kids[i].label,
                timeout.as_secs()
            ));
        }
        self.end_all();
        messages
    }

    /// SIGTERM to the group, SIGKILL after [`TERM_GRACE`] to whoever is left, and every
    /// child reaped; every run-server used is told to do the same with its children, and
    /// waited for. The group takes no more children after it.
    pub fn end_all(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let mut links: Vec<(Arc<Link>, Vec<u64>)> = Vec::new();
        for kid in &self.kids {
            if let How::Remote { link, id } = &kid.how {
                match links.iter_mut().find(|(l, _)| Arc::ptr_eq(l, link)) {
                    Some((_, ids)) => ids.push(*id),
                    None => links.push((Arc::clone(link), vec![*id])),
                }
            }
        }
        // The remote hosts end their children while this one ends its own.
        let waits: Vec<JoinHandle<()>> = links
            .into_iter()
            .map(|(link, ids)| {
                std::thread::spawn(move || link.end(&ids, TERM_GRACE + Duration::from_secs(2)))
            })
            .collect();
        self.end_local();
        for wait in waits {
            let _ = wait.join();
        }
    }

    fn end_local(&mut self) {
        let Some(pgid) = self.pgid.take() else {
            return;
        };
        // SAFETY: kill(2) on our own children's group.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let started = Instant::now();
        for kid in &mut self.kids {
            let How::Local(local) = &mut kid.how else {
                continue;
            };
            local.stdin = None;
            loop {
                match local.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if started.elapsed() < TERM_GRACE => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Ok(None) => {
                        let _ = local.child.kill();
                        let _ = local.child.wait();
                        break;
                    }
                }
            }
        }
        // A grandchild (none today) would still be in the group: the group gets SIGKILL.
        // SAFETY: as above; ESRCH when the group is empty is fine.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        for kid in &mut self.kids {
            if let How::Local(local) = &mut kid.how {
                for reader in local.readers.drain(..) {
                    let _ = reader.join();
                }
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.end_all();
    }
}
