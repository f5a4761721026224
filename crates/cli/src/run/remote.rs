//! The client's end of a connection to `justitia run-server` on another host: a [`Link`].
//!
//! One link per run-server serves every run of a `justitia run`: it is opened (and the
//! server's clock and idle mode learnt) before anything starts, so that an unreachable or
//! refusing server stops the command before any process runs. A reader thread routes the
//! server's messages to the [`Group`](super::procs::Group) whose kids they concern, and
//! a pinger keeps the server from taking the client for gone between runs. When the
//! server falls silent or the connection breaks, every kid still on it is said to have
//! closed and failed, so the runner's deadlines and errors apply as to a local child.

use std::collections::{HashMap, HashSet};
use std::io::BufReader;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::host_timing::RequesterClock;
use super::procs::Said;
use super::wire::{self, Exit, ReadError, ToClient, ToServer};

/// How long connecting to a run-server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the server may take to welcome the client: it may calibrate its TSC first.
const WELCOME_DEADLINE: Duration = Duration::from_secs(30);

/// How long one write to the server may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the server decided for its host, from its welcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Welcome {
    /// Its device (`None`: the first one).
    pub device: Option<String>,
    /// Its requesters' clock.
    pub clock: RequesterClock,
    /// Its idle mode.
    pub idle: String,
    /// Whether it can run requesters under the shaper.
    pub shaper: bool,
}

/// What the reader has learnt, shared with the callers.
#[derive(Default)]
struct State {
    /// Each kid's group index and the channel its lines go to.
    route: HashMap<u64, (usize, Sender<(usize, Said)>)>,
    /// Kids whose stdout closed.
    closed: HashSet<u64>,
    /// How kids exited.
    exits: HashMap<u64, Exit>,
    /// `ended` answers received.
    ended: u64,
    /// Why the connection is gone, once it is.
    lost: Option<String>,
}

/// A connection to one run-server.
pub struct Link {
    name: String,
    addr: SocketAddr,
    local_ip: IpAddr,
    welcome: Welcome,
    writer: Mutex<TcpStream>,
    state: Arc<(Mutex<State>, Condvar)>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Link {
    /// Connects to the run-server at `addr` for the scenario hosts `name` and says
    /// `hello`; fails, naming the host and address, if it cannot be reached or refuses.
    pub fn connect(name: &str, addr: SocketAddr, hello: &ToServer) -> Result<Arc<Link>> {
        let at = format!("run-server for host {name} at {addr}");
        let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
            .with_context(|| format!("{at}: connecting"))?;
        stream.set_nodelay(true).ok();
        stream
            .set_read_timeout(Some(wire::READ_TICK))
            .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
            .with_context(|| format!("{at}: socket options"))?;
        let local_ip = stream
            .local_addr()
            .with_context(|| format!("{at}: local address"))?
            .ip();
        let mut writer = stream.try_clone().context("socket")?;
        wire::send(&mut writer, hello).with_context(|| format!("{at}: saying hello"))?;
        let mut reader = BufReader::new(stream);
        let line = wire::read_line(&mut reader, Instant::now() + WELCOME_DEADLINE, &|| false)
            .map_err(|e| anyhow::anyhow!("{at}: waiting for its welcome: {e}"))?;
        let welcome = match serde_json::from_str::<ToClient>(&line)
            .with_context(|| format!("{at}: reading its welcome"))?
        {
            ToClient::Welcome {
                device,
                clock,
                idle,
                shaper,
            } => Welcome {
                device,
                clock,
                idle,
                shaper,
            },
            ToClient::Error(why) => bail!("{at}: {why}"),
            other => bail!("{at}: expected a welcome, got {other:?}"),
        };
        let link = Arc::new(Link {
            name: name.to_string(),
            addr,
            local_ip,
            welcome,
            writer: Mutex::new(writer),
            state: Arc::new((Mutex::new(State::default()), Condvar::new())),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
        });
        let reader_thread = {
            let state = Arc::clone(&link.state);
            let stop = Arc::clone(&link.stop);
            let at = at.clone();
            std::thread::spawn(move || read_loop(reader, &state, &stop, &at))
        };
        let pinger = {
            let weak = Arc::downgrade(&link);
            let stop = Arc::clone(&link.stop);
            std::thread::spawn(move || {
                let mut last = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.elapsed() < wire::PING_EVERY {
                        continue;
                    }
                    last = Instant::now();
                    let Some(link) = weak.upgrade() else { break };
                    if link.send(&ToServer::Ping {}).is_err() {
                        break;
                    }
                }
            })
        };
        lock(&link.threads).extend([reader_thread, pinger]);
        Ok(link)
    }

    /// `b (10.77.0.2:7771)`: the scenario hosts it serves and the server's address.
    pub fn name(&self) -> String {
        format!("{} ({})", self.name, self.addr)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This host's address as the server sees it: where a requester on the server's host
    /// reaches a responder on this one.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// What the server decided for its host.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// A fresh id for a kid.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn send(&self, message: &ToServer) -> Result<()> {
        let mut writer = lock(&self.writer);
        wire::send(&mut *writer, message)
    }

    /// Starts `spawn` there; its lines go to `tx` tagged with `index`.
    pub fn spawn(&self, index: usize, tx: Sender<(usize, Said)>, spawn: wire::Spawn) -> Result<()> {
        let id = spawn.id;
        {
            let mut state = lock(&self.state.0);
            if let Some(why) = &state.lost {
                bail!("{why}");
            }
            state.route.insert(id, (index, tx));
        }
        self.send(&ToServer::Spawn(spawn))
    }

    /// Writes `line` to kid `id`'s stdin there.
    pub fn tell(&self, id: u64, line: &str) -> Result<()> {
        if let Some(why) = &lock(&self.state.0).lost {
            bail!("{why}");
        }
        self.send(&ToServer::Tell {
            id,
            line: line.to_string(),
        })
    }

    /// How kid `id` exited, waiting up to `wait` to hear it.
    pub fn exit(&self, id: u64, wait: Duration) -> Option<Exit> {
        let (state, changed) = &*self.state;
        let started = Instant::now();
        let mut state = lock(state);
        loop {
            if let Some(exit) = state.exits.get(&id) {
                return Some(exit.clone());
            }
            let left = wait.saturating_sub(started.elapsed());
            if left.is_zero() {
                return None;
            }
            state = changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Has the server end every kid it started for this client and waits up to `wait` for
    /// it to say so; then forgets the kids `ids`.
    pub fn end(&self, ids: &[u64], wait: Duration) {
        let (state, changed) = &*self.state;
        let before = lock(state).ended;
        if self.send(&ToServer::End {}).is_ok() {
            let started = Instant::now();
            let mut s = lock(state);
            while s.ended == before && s.lost.is_none() {
                let left = wait.saturating_sub(started.elapsed());
                if left.is_zero() {
                    break;
                }
                s = changed
                    .wait_timeout(s, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        let mut s = lock(state);
        for id in ids {
            s.route.remove(id);
            s.closed.remove(id);
            s.exits.remove(id);
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Hanging up is itself the order to end every kid still there.
        let _ = lock(&self.writer).shutdown(Shutdown::Both);
        let me = std::thread::current().id();
        for thread in lock(&self.threads).drain(..) {
            // The pinger may hold the last reference and so run this drop itself.
            if thread.thread().id() != me {
                let _ = thread.join();
            }
        }
    }
}

/// The reader thread: routes the server's messages until the connection ends, then says
/// every kid still there has failed.
fn read_loop(
    mut reader: BufReader<TcpStream>,
    state: &(Mutex<State>, Condvar),
    stop: &AtomicBool,
    at: &str,
) {
    let why = loop {
        let line = match wire::read_line(&mut reader, Instant::now() + wire::SILENCE, &|| {
            stop.load(Ordering::Relaxed)
        }) {
            Ok(line) => line,
            Err(ReadError::Closed) => break format!("{at} hung up"),
            Err(e) => break format!("{at}: {e}"),
        };
        let message = match serde_json::from_str::<ToClient>(&line) {
            Ok(message) => message,
            Err(e) => break format!("{at} sent what is not its protocol ({e})"),
        };
        let mut s = lock(&state.0);
        match message {
            ToClient::Line { id, text } => {
                if let Some((index, tx)) = s.route.get(&id) {
                    let _ = tx.send((*index, Said::Line(text)));
                }
            }
            ToClient::Closed { id } => {
                if let Some((index, tx)) = s.route.get(&id) {
                    let _ = tx.send((*index, Said::Closed));
                }
                s.closed.insert(id);
            }
            ToClient::Exited { id, exit } => {
                s.exits.insert(id, exit);
            }
            ToClient::Ended {} => s.ended += 1,
            ToClient::Pong {} => {}
            ToClient::Error(why) => break format!("{at}: {why}"),
            ToClient::Welcome { .. } => break format!("{at} welcomed twice"),
        }
        drop(s);
        state.1.notify_all();
    };
    let mut s = lock(&state.0);
    let s = &mut *s;
    for (id, (index, tx)) in &s.route {
        if !s.exits.contains_key(id) {
            s.exits.insert(
                *id,
                Exit {
                    ok: false,
                    status: format!("lost: {why}"),
                    stderr: Vec::new(),
                },
            );
        }
        if s.closed.insert(*id) {
            let _ = tx.send((*index, Said::Closed));
        }
    }
    s.lost = Some(why);
    state.1.notify_all();
}
