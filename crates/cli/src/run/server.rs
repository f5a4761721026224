//! `justitia run-server`: the far host's half of a `justitia run` across hosts. It serves
//! one client at a time over TCP (see [`wire`] for the protocol), starting on request its
//! own host's `justitia-loadgen` with its own device, port and GID index, and its own
//! shaper for the kids that run shaped; it never runs another program, nor hands a kid
//! any variable but the shaper's class, policy and two-sided splitting.
//!
//! Every kid it starts ends with the client: when the client ends a run, hangs up, falls
//! silent past [`wire::SILENCE`] or sends anything that is not the protocol, the server
//! ends every kid it started for it (one process group per run, SIGTERM then SIGKILL, all
//! reaped, as `justitia run` does with its own).

use std::collections::{HashMap, HashSet};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use justitia_loadgen::flow::Idle;

use super::host_timing::{idle_name, RequesterClock};
use super::procs::{self, Group, Said};
use super::wire::{self, Exit, ReadError, Role, ToClient, ToServer};
use super::{beside_me, plan, DeviceArgs, DEFAULT_MAX_PROCESSES, SYSFS_INFINIBAND};

/// How long a new connection has to say hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);

/// How long a write to the client may block before the client is taken for gone.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the connection's loop looks at its kids and the client: also the most a
/// `tell` (the start signal) waits here.
const TICK: Duration = Duration::from_millis(2);

/// Arguments of `justitia run-server`.
#[derive(Args, Debug)]
#[command(after_help = "\
Serves one `justitia run` at a time: the client starts, on this host, the ends of its
flows that the scenario places here (`--host NAME=ADDR:PORT` on the client), and this
server runs them as its own justitia-loadgen on its own device, with its own shaper for
requesters of runs with a policy (and for a SEND stream's responder, whose shaper owns its
receives for split SENDs). Only the load generator is ever started, and only the shaper's
JUSTITIA_CLASS, JUSTITIA_POLICY and JUSTITIA_TWO_SIDED are taken from the client. Every process
started for a client is ended when it hangs up or is silent for 15 s.

Example (host B at 10.77.0.2; then on host A: justitia run SCENARIO -d rxe0 --host b=10.77.0.2:7771):
  justitia run-server --listen 10.77.0.2:7771 -d rxe0")]
pub struct RunServerArgs {
    /// Where to listen for `justitia run` (port 0: any; the address is printed).
    #[arg(long, value_name = "ADDR:PORT")]
    listen: SocketAddr,
    /// This host's device, port, GID index and ACK timeout, for every load generator it
    /// starts.
    #[command(flatten)]
    on: DeviceArgs,
    /// The shaper (default: libjustitia.so beside this program, if there is one).
    #[arg(long)]
    shaper: Option<PathBuf>,
    /// The load generator (default: justitia-loadgen beside this program).
    #[arg(long)]
    loadgen: Option<PathBuf>,
    /// The most processes a client may have running here at once.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_PROCESSES,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max_processes: u32,
    /// Where the kernel lists RDMA devices (for hosts and tests that mount it elsewhere).
    #[arg(long, value_name = "DIR", default_value = SYSFS_INFINIBAND, hide = true)]
    sysfs_infiniband: PathBuf,
}

/// What every connection needs of the server's configuration.
struct Config {
    on: DeviceArgs,
    loadgen: PathBuf,
    shaper: Option<PathBuf>,
    max_processes: usize,
    sysfs: PathBuf,
}

/// Runs `justitia run-server` until interrupted.
pub fn run(args: &RunServerArgs) -> Result<()> {
    let loadgen = beside_me(args.loadgen.as_deref(), "justitia-loadgen")?;
    let shaper = match &args.shaper {
        Some(p) => Some(p.clone()),
        None => beside_me(None, "libjustitia.so").ok(),
    };
    let config = Arc::new(Config {
        on: args.on.clone(),
        loadgen,
        shaper,
        max_processes: args.max_processes as usize,
        sysfs: args.sysfs_infiniband.clone(),
    });
    let listener =
        TcpListener::bind(args.listen).with_context(|| format!("listening on {}", args.listen))?;
    let at = listener.local_addr().context("listening address")?;
    listener.set_nonblocking(true).context("listening socket")?;
    procs::catch_interrupts();
    // Said on stdout for whoever started the server with port 0.
    println!("listening {at}");
    eprintln!("justitia run-server: listening on {at}, one client at a time");
    let busy: Arc<Mutex<Option<SocketAddr>>> = Arc::new(Mutex::new(None));
    let mut serving = None;
    while !procs::interrupted() {
        let (stream, peer) = match listener.accept() {
            Ok(pair) => pair,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Err(e) => {
                eprintln!("justitia run-server: accepting: {e}");
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let mut current = busy.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = *current {
            drop(current);
            refuse(
                stream,
                &format!(
                    "run-server busy: serving the justitia run at {client}; one client at a time"
                ),
            );
            eprintln!("justitia run-server: refused {peer}: busy with {client}");
            continue;
        }
        *current = Some(peer);
        drop(current);
        eprintln!("justitia run-server: serving {peer}");
        let config = Arc::clone(&config);
        let busy = Arc::clone(&busy);
        // The kids die with the thread that started them (the load generator asks for
        // SIGTERM at its parent's end), so they are started by this connection's thread,
        // which ends them all before it returns.
        serving = Some(std::thread::spawn(move || {
            match serve(stream, &config) {
                Ok(()) => eprintln!("justitia run-server: {peer} is done"),
                Err(e) => eprintln!("justitia run-server: {peer}: {e:#}"),
            }
            *busy.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }));
    }
    if let Some(thread) = serving {
        let _ = thread.join();
    }
    Ok(())
}

/// Says `why` as an error line and hangs up.
fn refuse(mut stream: TcpStream, why: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = wire::send(&mut stream, &ToClient::Error(why.to_string()));
}

/// What the reader thread passes on: a message, or why the client is done with.
type FromClient = std::result::Result<ToServer, String>;

/// Reads the client's lines into a channel until it hangs up, falls silent or breaks the
/// protocol; the last thing sent is then the reason.
fn read_client(mut reader: BufReader<TcpStream>, stop: Arc<AtomicBool>) -> Receiver<FromClient> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || loop {
        let line = match wire::read_line(&mut reader, Instant::now() + wire::SILENCE, &|| {
            stop.load(Ordering::Relaxed)
        }) {
            Ok(line) => line,
            Err(ReadError::Closed) => {
                let _ = tx.send(Err("the client hung up".to_string()));
                break;
            }
            Err(e) => {
                let _ = tx.send(Err(format!("reading from the client: {e}")));
                break;
            }
        };
        let message = wire::parse_to_server(&line).map_err(|e| format!("bad request: {e:#}"));
        let bad = message.is_err();
        if tx.send(message).is_err() || bad {
            break;
        }
    });
    rx
}

/// The server's decisions for one client, from its hello: its requesters' clock and its
/// load generators' idle mode, by the rules `justitia run` decides its own host's with.
fn welcome(config: &Config, hello: &ToServer) -> Result<(RequesterClock, Idle)> {
    let ToServer::Hello {
        version,
        latency,
        clock,
        idle,
    } = hello
    else {
        bail!("expected hello first");
    };
    if *version != wire::VERSION {
        bail!(
            "protocol version {version}; this run-server speaks {}",
            wire::VERSION
        );
    }
    plan::check_device(&config.sysfs, config.on.device.as_deref())?;
    let clock = RequesterClock::decide(*latency, *clock)?;
    let idle = idle.decide(&config.sysfs, config.on.device.as_deref())?;
    Ok((clock, idle))
}

/// One kid of the connection.
struct Kid {
    /// The client's id.
    id: u64,
    /// Its stdout closed.
    closed: bool,
    /// Its exit was said.
    reported: bool,
}

/// Serves one client until it is done; every kid started for it is gone when this returns.
fn serve(stream: TcpStream, config: &Config) -> Result<()> {
    stream.set_nodelay(true).ok();
    stream
        .set_read_timeout(Some(wire::READ_TICK))
        .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
        .context("socket options")?;
    let mut out = stream.try_clone().context("socket")?;
    let mut reader = BufReader::new(stream.try_clone().context("socket")?);
    let hello = wire::read_line(&mut reader, Instant::now() + HELLO_DEADLINE, &|| false)
        .map_err(|e| anyhow::anyhow!("waiting for hello: {e}"))
        .and_then(|line| wire::parse_to_server(&line));
    let decided = hello.and_then(|hello| welcome(config, &hello));
    let (clock, idle) = match decided {
        Ok(d) => d,
        Err(e) => {
            refuse(out, &format!("{e:#}"));
            return Err(e);
        }
    };
    wire::send(
        &mut out,
        &ToClient::Welcome {
            device: config.on.device.clone(),
            clock,
            idle: idle_name(idle).to_string(),
            shaper: config.shaper.is_some(),
        },
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let from_client = read_client(reader, Arc::clone(&stop));
    let mut session = Session {
        config,
        clock,
        idle,
        group: Group::new(),
        kids: Vec::new(),
        by_id: HashMap::new(),
        used: HashSet::new(),
        out,
    };
    let result = session.run(&from_client);
    stop.store(true, Ordering::Relaxed);
    session.group.end_all();
    if let Err(e) = &result {
        // The client may still be there to read why (a bad request, too many kids).
        let _ = wire::send(&mut session.out, &ToClient::Error(format!("{e:#}")));
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    result
}

/// One client's connection after the welcome.
struct Session<'a> {
    config: &'a Config,
    clock: RequesterClock,
    idle: Idle,
    /// The kids of the client's current run.
    group: Group,
    /// Each group index's kid.
    kids: Vec<Kid>,
    /// Group index of each id in the current run.
    by_id: HashMap<u64, usize>,
    /// Every id the client has used: an id names one kid for the whole connection.
    used: HashSet<u64>,
    out: TcpStream,
}

impl Session<'_> {
    fn send(&mut self, message: &ToClient) -> Result<()> {
        wire::send(&mut self.out, message).context("writing to the client")
    }

    /// Until the client is done: its requests carried out, its kids' lines and exits
    /// passed on.
    fn run(&mut self, from_client: &Receiver<FromClient>) -> Result<()> {
        loop {
            loop {
                match from_client.try_recv() {
                    Ok(Ok(message)) => self.handle(message)?,
                    Ok(Err(why)) if why == "the client hung up" => return Ok(()),
                    Ok(Err(why)) => bail!("{why}"),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => bail!("the client's reader stopped"),
                }
            }
            let mut wait = TICK;
            while let Some((index, said)) = self.group.next(wait)? {
                wait = Duration::ZERO;
                let id = self.kids[index].id;
                match said {
                    Said::Line(text) => self.send(&ToClient::Line { id, text })?,
                    Said::Closed => {
                        self.kids[index].closed = true;
                        self.send(&ToClient::Closed { id })?;
                    }
                }
            }
            for index in 0..self.kids.len() {
                let kid = &self.kids[index];
                if kid.closed && !kid.reported {
                    if let Some(exit) = self.group.exit(index) {
                        self.kids[index].reported = true;
                        let id = self.kids[index].id;
                        self.send(&ToClient::Exited { id, exit })?;
                    }
                }
            }
        }
    }

    fn handle(&mut self, message: ToServer) -> Result<()> {
        match message {
            ToServer::Hello { .. } => bail!("bad request: hello twice"),
            ToServer::Ping {} => self.send(&ToClient::Pong {}),
            ToServer::Tell { id, line } => {
                let Some(&index) = self.by_id.get(&id) else {
                    bail!("bad request: tell to unknown kid {id}");
                };
                if line.contains('\n') {
                    bail!("bad request: a tell of more than one line");
                }
                // A kid that has exited cannot be told; the client hears of its exit.
                let _ = self.group.tell(index, &line);
                Ok(())
            }
            ToServer::End {} => {
                self.group.end_all();
                for index in 0..self.kids.len() {
                    if !self.kids[index].reported {
                        let id = self.kids[index].id;
                        if !self.kids[index].closed {
                            self.send(&ToClient::Closed { id })?;
                        }
                        let exit = self.group.exit(index).unwrap_or(Exit {
                            ok: false,
                            status: "ended".to_string(),
                            stderr: Vec::new(),
                        });
                        self.send(&ToClient::Exited { id, exit })?;
                    }
                }
                self.group = Group::new();
                self.kids.clear();
                self.by_id.clear();
                self.send(&ToClient::Ended {})
            }
            ToServer::Spawn(spawn) => self.spawn(spawn),
        }
    }

    fn spawn(&mut self, spawn: wire::Spawn) -> Result<()> {
        if !self.used.insert(spawn.id) {
            bail!("bad request: kid id {} used twice", spawn.id);
        }
        let running = self.kids.iter().filter(|k| !k.reported).count();
        if running >= self.config.max_processes {
            bail!(
                "refused: more than --max-processes {} processes at once on this host",
                self.config.max_processes
            );
        }
        let shaped = !spawn.env.is_empty();
        if shaped && self.config.shaper.is_none() {
            bail!("refused: a kid to run under the shaper, and this run-server has no shaper");
        }
        let c = self.command(&spawn)?;
        let role = match spawn.role {
            Role::Respond => "responder",
            Role::Request => "requester",
        };
        let label = format!("flow {} ({role})", spawn.plan.name);
        let index = self.kids.len();
        match self.group.spawn(label, c) {
            Ok(i) => {
                debug_assert_eq!(i, index);
                self.kids.push(Kid {
                    id: spawn.id,
                    closed: false,
                    reported: false,
                });
                self.by_id.insert(spawn.id, index);
                Ok(())
            }
            // Not the client's fault: it hears that this kid failed, as of a local one.
            Err(e) => {
                self.send(&ToClient::Closed { id: spawn.id })?;
                self.send(&ToClient::Exited {
                    id: spawn.id,
                    exit: Exit {
                        ok: false,
                        status: format!("could not start: {e:#}"),
                        stderr: Vec::new(),
                    },
                })
            }
        }
    }

    /// The load generator's command for `spawn`, from this host's configuration.
    fn command(&self, spawn: &wire::Spawn) -> Result<Command> {
        let config = self.config;
        let mut c = Command::new(&config.loadgen);
        config.on.add_to(&mut c);
        c.args(["--idle", idle_name(self.idle)]);
        c.args(["--plan", &serde_json::to_string(&spawn.plan)?]);
        match (spawn.role, spawn.listen, spawn.connect) {
            (Role::Respond, Some(listen), _) => {
                c.args(["respond", "--listen", &listen.to_string()]);
            }
            (Role::Request, _, Some(connect)) => {
                c.args(["request", "--connect", &connect.to_string()]);
                self.clock.add_to(&mut c);
            }
            _ => bail!("bad request: spawn {} without its address", spawn.id),
        }
        // Nothing of this server's own environment that the shaper reads leaks in; only
        // the two variables checked against the allow-list are set.
        for key in wire::ALLOWED_ENV {
            c.env_remove(key);
        }
        c.env_remove("LD_PRELOAD");
        if !spawn.env.is_empty() {
            if let Some(lib) = &config.shaper {
                c.env("LD_PRELOAD", lib);
            }
            for (key, value) in &spawn.env {
                c.env(key, value);
            }
        }
        Ok(c)
    }
}
