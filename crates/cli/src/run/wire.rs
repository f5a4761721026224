//! The protocol between `justitia run` and `justitia run-server`: one JSON object per line
//! over TCP, each line at most [`MAX_LINE`] bytes.
//!
//! The client opens with [`ToServer::Hello`]; the server answers [`ToClient::Welcome`]
//! (its device, the clock and idle mode its requesters will use) or [`ToClient::Error`]
//! and hangs up. Then the client sends [`ToServer::Spawn`] for each flow end that runs on
//! the server's host, [`ToServer::Tell`] for a line to a kid's stdin, [`ToServer::End`] at
//! the end of each run, and [`ToServer::Ping`] every [`PING_EVERY`]; the server sends each
//! kid's stdout lines ([`ToClient::Line`]), the end of its stdout ([`ToClient::Closed`]),
//! its exit ([`ToClient::Exited`]), [`ToClient::Ended`] once a run's kids are all gone and
//! [`ToClient::Pong`] for each ping.
//!
//! A spawn names no program and carries no argument list: the server builds the load
//! generator's command itself from typed fields, so a client can only start its own host's
//! configured `justitia-loadgen`, with a plan that parses, and hand it three variables of
//! the shaper ([`ALLOWED_ENV`]). Every type refuses unknown fields.

use std::collections::BTreeMap;
use std::io::{BufRead, ErrorKind, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use justitia_loadgen::clock::ClockChoice;
use justitia_loadgen::plan::FlowPlan;
use serde::{Deserialize, Serialize};

use super::host_timing::{IdleChoice, RequesterClock};

/// The protocol's version, in `hello`: a server refuses any other.
pub const VERSION: u32 = 1;

/// Longest line either side accepts, newline included: a plan or an outcome is a few KB,
/// and a load generator's stdout lines are cut at 64 KiB before they are wrapped here.
pub const MAX_LINE: usize = 256 * 1024;

/// How often the client pings; the server pongs each.
pub const PING_EVERY: Duration = Duration::from_secs(2);

/// How long either side waits for the next line from the other before it gives the
/// connection up (the server then ends every kid it started): several missed pings.
pub const SILENCE: Duration = Duration::from_secs(15);

/// How often a blocked read wakes to check its deadline.
pub const READ_TICK: Duration = Duration::from_millis(200);

/// The only variables a client may set in a kid's environment, and only in one that runs
/// under the shaper: the class and policy the shaper applies, and whether it splits
/// two-sided requests with the shaper at the other end (a responder runs under the
/// shaper only for that: see [`Spawn::check`]).
pub const ALLOWED_ENV: [&str; 3] = ["JUSTITIA_CLASS", "JUSTITIA_POLICY", "JUSTITIA_TWO_SIDED"];

/// Which end of a flow a kid is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// `justitia-loadgen respond --listen ADDR`.
    Respond,
    /// `justitia-loadgen request --connect ADDR`.
    Request,
}

/// What a client sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum ToServer {
    /// The first line: the protocol version and what the server decides for its host.
    Hello {
        /// [`VERSION`].
        version: u32,
        /// Whether requesters on this host will time latency samples (the server
        /// calibrates its TSC only then).
        latency: bool,
        /// The requesters' clock.
        clock: ClockChoice,
        /// The load generators' idle mode.
        idle: IdleChoice,
    },
    /// Start one end of a flow.
    Spawn(Spawn),
    /// Write `line` to kid `id`'s stdin.
    Tell {
        /// The kid.
        id: u64,
        /// The line, without its newline.
        line: String,
    },
    /// End every kid started on this connection; the server answers with the exits not
    /// yet said and then `ended`.
    End {},
    /// I am still here.
    Ping {},
}

/// One kid to start: its id (the client's, unique on the connection), role and plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spawn {
    /// The client's name for the kid in later messages.
    pub id: u64,
    /// The flow end.
    pub role: Role,
    /// The flow's plan, handed to the load generator as `--plan`.
    pub plan: FlowPlan,
    /// A responder's `--listen`.
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// A requester's `--connect`.
    #[serde(default)]
    pub connect: Option<SocketAddr>,
    /// The kid's shaper variables: when present, it runs under this host's shaper.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

impl Spawn {
    /// The spawn of flow end `role` with `plan`, at `addr` (a responder's `listen`, a
    /// requester's `connect`), under this host's shaper with `env` when it is not empty;
    /// id 0, which the client sets to its own.
    pub fn of_end(
        role: Role,
        plan: FlowPlan,
        addr: SocketAddr,
        env: BTreeMap<String, String>,
    ) -> Self {
        let (listen, connect) = match role {
            Role::Respond => (Some(addr), None),
            Role::Request => (None, Some(addr)),
        };
        Spawn {
            id: 0,
            role,
            plan,
            listen,
            connect,
            env,
        }
    }

    /// Refuses what a well-behaved client never sends: a role without its address, a plan
    /// that does not validate, variables outside [`ALLOWED_ENV`], or a responder under the
    /// shaper for anything but owning its receives for split SENDs
    /// (`JUSTITIA_TWO_SIDED=split`).
    pub fn check(&self) -> Result<()> {
        match (self.role, self.listen, self.connect) {
            (Role::Respond, Some(_), None) | (Role::Request, None, Some(_)) => {}
            (Role::Respond, _, _) => bail!("spawn {}: a responder needs `listen` only", self.id),
            (Role::Request, _, _) => bail!("spawn {}: a requester needs `connect` only", self.id),
        }
        self.plan.validate()?;
        let splits = self.env.get("JUSTITIA_TWO_SIDED").map(String::as_str) == Some("split");
        if !self.env.is_empty() && self.role == Role::Respond && !splits {
            bail!(
                "spawn {}: a responder runs under the shaper only to split SENDs (JUSTITIA_TWO_SIDED=split)",
                self.id
            );
        }
        for (key, value) in &self.env {
            if !ALLOWED_ENV.contains(&key.as_str()) {
                bail!(
                    "spawn {}: variable {key} is not allowed (only {})",
                    self.id,
                    ALLOWED_ENV.join(", ")
                );
            }
            if value.is_empty()
                || value.len() > 32
                || !value.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            {
                bail!(
                    "spawn {}: {key} must be a short word, got {value:?}",
                    self.id
                );
            }
        }
        Ok(())
    }
}

/// How a kid ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exit {
    /// It exited with status 0.
    pub ok: bool,
    /// `exited with exit status: 1`, `could not start: ...`.
    pub status: String,
    /// The last lines of its stderr.
    pub stderr: Vec<String>,
}

/// What a server sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum ToClient {
    /// The answer to `hello`.
    Welcome {
        /// The device its load generators open (`None`: the first one).
        device: Option<String>,
        /// Its requesters' clock.
        clock: RequesterClock,
        /// Its load generators' idle mode, `spin` or `yield`.
        idle: String,
        /// Whether it has a shaper to run shaped requesters under.
        shaper: bool,
    },
    /// A line kid `id` wrote on stdout.
    Line {
        /// The kid.
        id: u64,
        /// The line, without its newline.
        text: String,
    },
    /// Kid `id`'s stdout closed.
    Closed {
        /// The kid.
        id: u64,
    },
    /// Kid `id` exited (always after its `closed`).
    Exited {
        /// The kid.
        id: u64,
        /// How.
        exit: Exit,
    },
    /// Every kid started before the client's `end` is gone.
    Ended {},
    /// The answer to a ping.
    Pong {},
    /// The request was refused; the server hangs up after it.
    Error(String),
}

/// Writes `message` as one line and flushes it.
pub fn send<W: Write, M: Serialize>(out: &mut W, message: &M) -> Result<()> {
    let mut line = serde_json::to_vec(message)?;
    line.push(b'\n');
    out.write_all(&line)?;
    out.flush()?;
    Ok(())
}

/// Why no line was read.
#[derive(Debug)]
pub enum ReadError {
    /// The other side hung up (at a line's start).
    Closed,
    /// Nothing complete came before the deadline.
    Silent,
    /// A line longer than [`MAX_LINE`].
    TooLong,
    /// The connection failed, or hung up mid-line.
    Io(std::io::Error),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Closed => write!(f, "the connection was closed"),
            ReadError::Silent => write!(f, "nothing was heard for {} s", SILENCE.as_secs()),
            ReadError::TooLong => write!(f, "a line longer than {MAX_LINE} bytes"),
            ReadError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Reads one line (without its newline) by `deadline`, at most [`MAX_LINE`] bytes. The
/// stream must have a read timeout (of [`READ_TICK`]) so that a silent peer is noticed;
/// `stop` ends the wait early (as [`ReadError::Closed`]).
pub fn read_line<R: BufRead>(
    reader: &mut R,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
) -> Result<String, ReadError> {
    let mut line: Vec<u8> = Vec::new();
    loop {
        if stop() {
            return Err(ReadError::Closed);
        }
        let (used, done) = match reader.fill_buf() {
            Ok([]) if line.is_empty() => return Err(ReadError::Closed),
            Ok([]) => {
                return Err(ReadError::Io(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the connection was closed mid-line",
                )))
            }
            Ok(bytes) => match bytes.iter().position(|&b| b == b'\n') {
                Some(at) => {
                    line.extend_from_slice(&bytes[..at]);
                    (at + 1, true)
                }
                None => {
                    line.extend_from_slice(bytes);
                    (bytes.len(), false)
                }
            },
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if Instant::now() >= deadline {
                    return Err(ReadError::Silent);
                }
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        };
        reader.consume(used);
        if line.len() >= MAX_LINE {
            return Err(ReadError::TooLong);
        }
        if done {
            return String::from_utf8(line).map_err(|_| {
                ReadError::Io(std::io::Error::new(
                    ErrorKind::InvalidData,
                    "a line that is not UTF-8",
                ))
            });
        }
        if Instant::now() >= deadline {
            return Err(ReadError::Silent);
        }
    }
}

/// Parses a client's line.
pub fn parse_to_server(line: &str) -> Result<ToServer> {
    let message: ToServer = serde_json::from_str(line)?;
    if let ToServer::Spawn(spawn) = &message {
        spawn.check()?;
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::io::BufReader;

    const PLAN: &str = r#"{"name":"lat","workload":{"latency":{"size":16,"op":"send","method":"ping-pong","inline":true,"interval_us":0.0}},"start_ms":0.0,"stop_ms":100.0,"window_from_ms":10.0,"window_to_ms":100.0}"#;

    fn spawn(extra: &str) -> String {
        format!(
            r#"{{"spawn":{{"id":1,"role":"request","plan":{PLAN},"connect":"10.0.0.2:4000"{extra}}}}}"#
        )
    }

    #[test]
    fn a_well_formed_spawn_parses_and_round_trips() {
        let line = spawn(r#","env":{"JUSTITIA_CLASS":"latency","JUSTITIA_POLICY":"justitia"}"#);
        let message = parse_to_server(&line).unwrap();
        let ToServer::Spawn(s) = &message else {
            panic!("{message:?}")
        };
        assert_eq!(s.role, Role::Request);
        assert_eq!(s.env.len(), 2);
        let again = serde_json::to_string(&message).unwrap();
        assert_eq!(parse_to_server(&again).unwrap(), message);
    }

    /// Each end gets its own address field, and passes the server's check.
    #[test]
    fn a_spawn_of_either_end_carries_its_address_only() {
        let plan: FlowPlan = serde_json::from_str(PLAN).unwrap();
        let addr: SocketAddr = "10.0.0.2:4000".parse().unwrap();
        let respond = Spawn::of_end(Role::Respond, plan.clone(), addr, BTreeMap::new());
        assert_eq!((respond.listen, respond.connect), (Some(addr), None));
        let request = Spawn::of_end(Role::Request, plan, addr, BTreeMap::new());
        assert_eq!((request.listen, request.connect), (None, Some(addr)));
        for s in [respond, request] {
            assert!(s.check().is_ok(), "{s:?}");
        }
    }

    #[test]
    fn bad_json_unknown_programs_and_unknown_variables_are_refused() {
        let err = |line: &str| parse_to_server(line).unwrap_err().to_string();
        assert!(err("{\"spawn\":").contains("EOF"), "{}", err("{\"spawn\":"));
        assert!(err("not json").contains("expected"));
        assert!(err(r#"{"exec":{"program":"/bin/sh"}}"#).contains("unknown variant `exec`"));
        // A spawn names no program: the field is refused, not ignored.
        let program = err(&spawn(r#","program":"/bin/sh""#));
        assert!(program.contains("unknown field `program`"), "{program}");
        let args = err(&spawn(r#","args":["-c","id"]"#));
        assert!(args.contains("unknown field `args`"), "{args}");
        let preload = err(&spawn(r#","env":{"LD_PRELOAD":"/tmp/evil.so"}"#));
        assert!(
            preload.contains(
                "variable LD_PRELOAD is not allowed (only JUSTITIA_CLASS, JUSTITIA_POLICY, JUSTITIA_TWO_SIDED)"
            ),
            "{preload}"
        );
        let value = err(&spawn(r#","env":{"JUSTITIA_CLASS":"a b;rm"}"#));
        assert!(value.contains("must be a short word"), "{value}");
        let role = err(&spawn(r#","listen":"0.0.0.0:0""#));
        assert!(role.contains("a requester needs `connect` only"), "{role}");
        let plan = spawn("").replace("\"stop_ms\":100.0", "\"stop_ms\":-1.0");
        assert!(parse_to_server(&plan).is_err());
        // A responder runs under the shaper only to own its receives for split SENDs.
        let responder = |env: &str| {
            format!(
                r#"{{"spawn":{{"id":2,"role":"respond","plan":{PLAN},"listen":"0.0.0.0:0","env":{{{env}}}}}}}"#
            )
        };
        let shaped = err(&responder(r#""JUSTITIA_CLASS":"bandwidth""#));
        assert!(
            shaped.contains("a responder runs under the shaper only to split SENDs"),
            "{shaped}"
        );
        let whole = err(&responder(
            r#""JUSTITIA_CLASS":"bandwidth","JUSTITIA_TWO_SIDED":"whole""#,
        ));
        assert!(whole.contains("only to split SENDs"), "{whole}");
        let splits = responder(
            r#""JUSTITIA_CLASS":"bandwidth","JUSTITIA_POLICY":"justitia","JUSTITIA_TWO_SIDED":"split""#,
        );
        assert!(parse_to_server(&splits).is_ok());
        assert!(parse_to_server(&responder("")).is_ok());
    }

    #[test]
    fn an_over_long_line_is_refused_without_reading_it_all() {
        let long = vec![b'x'; MAX_LINE * 4];
        let mut reader = BufReader::new(&long[..]);
        let far = Instant::now() + Duration::from_secs(5);
        assert!(matches!(
            read_line(&mut reader, far, &|| false),
            Err(ReadError::TooLong)
        ));
        let text = b"{\"ping\":{}}\nrest";
        let mut reader = BufReader::new(&text[..]);
        assert_eq!(
            read_line(&mut reader, far, &|| false).unwrap(),
            "{\"ping\":{}}"
        );
        assert!(matches!(
            read_line(&mut reader, far, &|| false),
            Err(ReadError::Io(_))
        ));
        let mut empty = BufReader::new(&b""[..]);
        assert!(matches!(
            read_line(&mut empty, far, &|| false),
            Err(ReadError::Closed)
        ));
    }
}
