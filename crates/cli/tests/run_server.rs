//! `justitia run` across two hosts, on loopback: a `justitia run-server` started as a child
//! process stands for host B, and a fake load generator (a shell script that speaks the
//! load generator's lines: `listening PORT`, `ready`, `go`, `outcome {json}`) stands for
//! `justitia-loadgen` on both sides, so no RDMA device is needed. Each fake logs its pid,
//! role, device and flow, which tells where each end ran: here with `-d dev-a`, on the
//! run-server with its own `-d dev-b`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Two flows between hosts a and b, one each way.
const SCENARIO: &str = r#"description = "two hosts"
profile = "IB-56"
duration_ms = 10
warmup_ms = 1

[[flows]]
name = "fwd"
from = "a"
to = "b"
[flows.latency]
size = 16
mode = "ping-pong"

[[flows]]
name = "rev"
from = "b"
to = "a"
[flows.bandwidth]
size = "64KB"
"#;

/// The fake load generator; `DIR` is replaced by the test's folder. A responder makes up
/// a port and waits for its requester to leave `done-PORT`; a requester says `ready`,
/// waits for `go`, logs it and says an outcome (or, with `DIR/hang`, waits on stdin).
const FAKE: &str = r#"#!/bin/bash
dir=DIR
dev=none; role=; addr=; name=
while [ $# -gt 0 ]; do
  case "$1" in
    --device) dev=$2; shift 2;;
    --plan) name=$(printf '%s' "$2" | sed -n 's/^{"name":"\([^"]*\)".*/\1/p'); shift 2;;
    respond) role=responder; shift;;
    request) role=requester; shift;;
    --listen|--connect) addr=$2; shift 2;;
    *) shift;;
  esac
done
echo "$$ $role $dev $name $addr ${JUSTITIA_CLASS:-unshaped}" >> "$dir/log"
if [ "$role" = responder ]; then
  port=$(( $$ % 50000 + 10000 ))
  echo "listening $port"
  for i in $(seq 600); do [ -e "$dir/done-$port" ] && exit 0; sleep 0.1; done
  exit 1
fi
port=${addr##*:}
echo ready
read -r go || exit 3
echo "$$ go $dev $name" >> "$dir/log"
if [ -e "$dir/hang" ]; then read -r never; exit 4; fi
echo 'outcome {"name":"'"$name"'","messages":1000,"bytes":16000,"window_s":0.5,"latency":null,"loopback":null,"wire":null,"negative_samples":0,"clock":"monotonic"}'
touch "$dir/done-$port"
"#;

struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("fake-loadgen");
        std::fs::write(
            &fake,
            FAKE.replace("DIR", &dir.path().display().to_string()),
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.path().join("two-hosts.toml"), SCENARIO).unwrap();
        // Each side's sysfs lists its device, as /sys/class/infiniband would.
        for dev in ["dev-a", "dev-b"] {
            std::fs::create_dir_all(dir.path().join("sys").join(dev)).unwrap();
        }
        Setup { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn log(&self) -> Vec<Vec<String>> {
        std::fs::read_to_string(self.path("log"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .collect()
    }

    /// A run-server for host b on a free loopback port; returns it and its address.
    fn server(&self) -> (Server, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_justitia"))
            .args(["run-server", "--listen", "127.0.0.1:0", "-d", "dev-b"])
            .arg("--loadgen")
            .arg(self.path("fake-loadgen"))
            .arg("--shaper")
            .arg("/nonexistent/libjustitia.so")
            .arg("--sysfs-infiniband")
            .arg(self.path("sys"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().strip_prefix("listening ").unwrap().to_string();
        (Server(child), addr)
    }

    fn client(&self, addr: &str, extra: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_justitia"));
        c.arg("run")
            .arg(self.path("two-hosts.toml"))
            .args([
                "-d",
                "dev-a",
                "--clock",
                "monotonic",
                "--duration-ms",
                "300",
            ])
            .args(["--host", &format!("b={addr}")])
            .arg("--loadgen")
            .arg(self.path("fake-loadgen"))
            .arg("--sysfs-infiniband")
            .arg(self.path("sys"))
            .args(extra);
        c
    }
}

/// The run-server, killed when the test ends however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_two_host_run_places_each_end_by_from_and_to_and_collects_remote_outcomes() {
    let setup = Setup::new();
    let (_server, addr) = setup.server();
    let out_dir = setup.path("out");
    let out = setup
        .client(&addr, &["--out", &out_dir.display().to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let log = setup.log();
    let started: Vec<(&str, &str, &str, &str)> = log
        .iter()
        .filter(|l| l[1] != "go")
        .map(|l| (l[1].as_str(), l[2].as_str(), l[3].as_str(), l[4].as_str()))
        .collect();
    // fwd: a -> b, so its requester here (dev-a) and its responder on the server (dev-b);
    // rev: b -> a, the other way round. A responder whose requester is on the other host
    // listens on every address; a requester reaches a responder on B at the server's
    // address, and one here at the address B's server sees this host at.
    let host_ip = addr.rsplit_once(':').unwrap().0;
    for (role, dev, flow, at) in [
        ("responder", "dev-b", "fwd", "0.0.0.0:0"),
        ("responder", "dev-a", "rev", "0.0.0.0:0"),
    ] {
        assert!(
            started.contains(&(role, dev, flow, at)),
            "{role} of {flow} on {dev} listening on {at}: {started:?}"
        );
    }
    for (role, dev, flow) in [("requester", "dev-a", "fwd"), ("requester", "dev-b", "rev")] {
        assert!(
            started
                .iter()
                .any(|s| (s.0, s.1, s.2) == (role, dev, flow) && s.3.starts_with(host_ip)),
            "{role} of {flow} on {dev} connecting to {host_ip}: {started:?}"
        );
    }
    assert_eq!(started.len(), 4, "{started:?}");
    // Both outcomes arrived, the remote one through the server, and the report says where
    // each end ran.
    assert!(stdout.contains("fwd"), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "rev: requester on b (run-server {addr}), responder on a (here)"
        )),
        "{stdout}"
    );
    let outcomes: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("two-hosts-outcomes.json")).unwrap(),
    )
    .unwrap();
    let run = &outcomes[0];
    let names: Vec<&str> = run["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["fwd", "rev"]);
    assert_eq!(run["flows"][1]["messages"], 1000);
    assert_eq!(run["ends"][0]["requester"]["on"], "here");
    assert_eq!(run["ends"][0]["responder"]["on"], addr.as_str());
    assert_eq!(run["ends"][1]["requester"]["host"], "b");
    assert_eq!(run["servers"][0]["device"], "dev-b");
    assert_eq!(run["servers"][0]["idle"], "spin");
}

#[test]
fn killing_the_client_kills_the_kids_it_started_on_the_server() {
    let setup = Setup::new();
    std::fs::write(setup.path("hang"), "").unwrap();
    let (_server, addr) = setup.server();
    let mut client = setup
        .client(&addr, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Both requesters have been told to go: every process is running.
    wait_for("both requesters going", Duration::from_secs(30), || {
        setup.log().iter().filter(|l| l[1] == "go").count() == 2
    });
    let remote: Vec<String> = setup
        .log()
        .iter()
        .filter(|l| l[1] != "go" && l[2] == "dev-b")
        .map(|l| l[0].clone())
        .collect();
    let local: Vec<String> = setup
        .log()
        .iter()
        .filter(|l| l[1] != "go" && l[2] == "dev-a")
        .map(|l| l[0].clone())
        .collect();
    assert_eq!(remote.len(), 2);
    assert!(remote.iter().all(|p| alive(p)));
    // No chance to clean up: the server sees only the connection drop.
    client.kill().unwrap();
    client.wait().unwrap();
    wait_for("the server's kids gone", Duration::from_secs(10), || {
        remote.iter().all(|p| !alive(p))
    });
    // The fakes here outlive a client killed outright (a real load generator does not:
    // it asks for SIGTERM when its parent dies); they are no part of what is tested.
    for pid in &local {
        let _ = Command::new("kill").arg(pid).status();
    }
    // The server is free for the next client.
    let mut stream = TcpStream::connect(&addr).unwrap();
    writeln!(
        stream,
        r#"{{"hello":{{"version":1,"latency":false,"clock":"monotonic","idle":"auto"}}}}"#
    )
    .unwrap();
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    assert!(line.starts_with(r#"{"welcome":"#), "{line}");
}

/// Says `lines` to a fresh connection and returns everything the server answers before
/// it hangs up.
fn exchange(addr: &str, lines: &[&[u8]]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    for line in lines {
        // The server may hang up mid-way through an over-long line.
        let _ = stream.write_all(line);
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

const HELLO: &[u8] =
    b"{\"hello\":{\"version\":1,\"latency\":false,\"clock\":\"monotonic\",\"idle\":\"spin\"}}\n";

#[test]
fn the_server_answers_bad_input_with_an_error_and_hangs_up_and_takes_one_client_at_a_time() {
    let setup = Setup::new();
    let (mut server, addr) = setup.server();
    let answer = exchange(&addr, &[b"this is not json\n"]);
    assert!(answer.starts_with(r#"{"error":"#), "{answer}");
    assert_eq!(answer.lines().count(), 1, "{answer}");
    let long = vec![b'x'; 1024 * 1024];
    let answer = exchange(&addr, &[HELLO, &long]);
    assert!(answer.contains("a line longer than"), "{answer}");
    let answer = exchange(
        &addr,
        &[HELLO, b"{\"spawn\":{\"id\":1,\"program\":\"/bin/sh\"}}\n"],
    );
    assert!(answer.contains("unknown field `program`"), "{answer}");
    let plan = r#"{"name":"x","workload":{"latency":{"size":16,"op":"send","method":"ping-pong","inline":true,"interval_us":0.0}},"start_ms":0.0,"stop_ms":100.0,"window_from_ms":10.0,"window_to_ms":100.0}"#;
    let env = format!(
        "{{\"spawn\":{{\"id\":1,\"role\":\"request\",\"plan\":{plan},\"connect\":\"127.0.0.1:9\",\"env\":{{\"LD_PRELOAD\":\"/tmp/x.so\"}}}}}}\n"
    );
    let answer = exchange(&addr, &[HELLO, env.as_bytes()]);
    assert!(
        answer.contains("variable LD_PRELOAD is not allowed"),
        "{answer}"
    );
    // A second client while one is served is refused in one line.
    let mut first = TcpStream::connect(&addr).unwrap();
    first.write_all(HELLO).unwrap();
    let mut welcome = String::new();
    let mut reader = BufReader::new(first.try_clone().unwrap());
    reader.read_line(&mut welcome).unwrap();
    assert!(welcome.starts_with(r#"{"welcome":"#), "{welcome}");
    let answer = exchange(&addr, &[HELLO]);
    assert!(
        answer.starts_with(r#"{"error":"run-server busy: serving the justitia run at 127.0.0.1:"#),
        "{answer}"
    );
    assert_eq!(answer.lines().count(), 1);
    drop(reader);
    drop(first);
    // The server lived through all of it.
    assert!(server.0.try_wait().unwrap().is_none());
}

#[test]
fn unknown_hosts_and_unreachable_servers_are_refused_before_anything_starts() {
    let setup = Setup::new();
    let unknown = setup
        .client("127.0.0.1:1", &["--host", "c=127.0.0.1:2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success());
    assert!(
        err.contains("--host c=127.0.0.1:2: the scenario has no host `c` (its hosts: a, b)"),
        "{err}"
    );
    // Nothing listens on port 1.
    let unreachable = setup.client("127.0.0.1:1", &[]).output().unwrap();
    let err = String::from_utf8_lossy(&unreachable.stderr);
    assert!(!unreachable.status.success());
    assert!(
        err.contains("run-server for host b at 127.0.0.1:1: connecting"),
        "{err}"
    );
    assert!(setup.log().is_empty(), "{:?}", setup.log());
}
