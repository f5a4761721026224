//! The two-host server (`--serve`) against clients it must not trust: it reads the hello
//! before it opens the device, so these run on a machine without one. A stranger's bytes,
//! an older checker's greeting, an unknown mode and a hello asking for more than the caps
//! (in READ mode or two-sided) end the server with an error naming what was wrong, never a
//! panic and never an allocation of what was asked; a client that never comes ends it at
//! its deadline.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `--serve` on a port the kernel picks (no other test can take it between a probe
/// and the server's bind), sends it `bytes` (`None`: never connects) and returns its status
/// and stderr. The server
/// is killed if it has not ended within 60 s, so a server that waits for ever fails the
/// test rather than hanging it.
fn serve_and_send(bytes: Option<&[u8]>) -> (Option<i32>, String) {
    let Ok(mut child) = Command::new(env!("CARGO_BIN_EXE_justitia-integrity"))
        .args(["--serve", "127.0.0.1:0", "--timeout", "5"])
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        panic!("cannot run the checker binary");
    };
    let Some(stdout) = child.stdout.take() else {
        panic!("no stdout pipe");
    };
    // Kept open until the server ends: its later lines must not meet a closed pipe.
    let mut stdout = BufReader::new(stdout);
    let mut first = String::new();
    let _ = stdout.read_line(&mut first);
    let Some(addr) = first
        .split_whitespace()
        .find_map(|w| w.trim_end_matches(',').parse::<SocketAddr>().ok())
    else {
        let _ = child.kill();
        panic!("the server said no address: {first:?}");
    };
    if let Some(bytes) = bytes {
        let Ok(mut conn) = TcpStream::connect(addr) else {
            let _ = child.kill();
            panic!("cannot connect to the server at {addr}");
        };
        let _ = conn.write_all(bytes);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the server did not end within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let Ok(out) = child.wait_with_output() else {
        panic!("the server could not be waited for");
    };
    drop(stdout);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The two-sided part of a hello: mode (0 READ, 1 SEND, 2 WRITE with immediate), largest
/// message, SGEs, messages per batch, boundary (0: none).
struct Mode {
    mode: u8,
    max_size: u64,
    max_sges: u32,
    max_batch: u32,
    boundary: u64,
}

/// READ mode: every two-sided field 0.
const READ: Mode = Mode {
    mode: 0,
    max_size: 0,
    max_sges: 0,
    max_batch: 0,
    boundary: 0,
};

/// The client's hello as `--connect` sends it: magic, endpoint (QP number, PSN, LID,
/// GID), seed, bytes per region, regions, then the mode and the two-sided fields;
/// big-endian.
fn hello_with(region_len: u64, regions: u32, mode: &Mode) -> Vec<u8> {
    let mut b = b"JIX2".to_vec();
    b.extend_from_slice(&0x11u32.to_be_bytes());
    b.extend_from_slice(&0x2468u32.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&[0; 16]);
    b.extend_from_slice(&7u64.to_be_bytes());
    b.extend_from_slice(&region_len.to_be_bytes());
    b.extend_from_slice(&regions.to_be_bytes());
    b.push(mode.mode);
    b.extend_from_slice(&mode.max_size.to_be_bytes());
    b.extend_from_slice(&mode.max_sges.to_be_bytes());
    b.extend_from_slice(&mode.max_batch.to_be_bytes());
    b.extend_from_slice(&mode.boundary.to_be_bytes());
    b
}

/// A READ hello.
fn hello(region_len: u64, regions: u32) -> Vec<u8> {
    hello_with(region_len, regions, &READ)
}

#[test]
fn a_stranger_is_refused_naming_what_it_sent() {
    let (code, stderr) = serve_and_send(Some(&[b'G'; 50]));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no checker greeting"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_hello_beyond_the_caps_is_refused_before_anything_is_allocated() {
    let (code, stderr) = serve_and_send(Some(&hello(1 << 20, 1000)));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("regions 1000"), "{stderr}");
    // 16 TiB per region: refused by its field, not attempted.
    let (code, stderr) = serve_and_send(Some(&hello(1 << 44, 2)));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("region_len"), "{stderr}");
}

#[test]
fn a_client_that_says_nothing_ends_the_server_at_its_deadline() {
    let start = Instant::now();
    let (code, stderr) = serve_and_send(Some(&[]));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("reading the client's hello"), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// No client at all: the server ends at its deadline (5 s) naming the wait, where it used
/// to wait in accept(2) for ever.
#[test]
fn a_client_that_never_comes_ends_the_server_at_its_deadline() {
    let start = Instant::now();
    let (code, stderr) = serve_and_send(None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("accepting the client"), "{stderr}");
    assert!(stderr.contains("no client within 5s"), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// A mode byte the server does not know is refused by its value, before any device is
/// opened or anything allocated.
#[test]
fn a_hello_with_an_unknown_mode_is_refused_naming_it() {
    let (code, stderr) = serve_and_send(Some(&hello_with(
        1 << 20,
        1,
        &Mode {
            mode: 7,
            max_size: 1 << 20,
            max_sges: 4,
            max_batch: 4,
            boundary: 0,
        },
    )));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("mode 7"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A two-sided hello whose settings exceed the caps is refused naming the field.
#[test]
fn a_two_sided_hello_beyond_the_caps_is_refused_naming_the_field() {
    let (code, stderr) = serve_and_send(Some(&hello_with(
        1 << 20,
        1,
        &Mode {
            mode: 1,
            max_size: 1 << 20,
            max_sges: 1000,
            max_batch: 4,
            boundary: 0,
        },
    )));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("max_sges 1000"), "{stderr}");
    // 16 TiB messages: refused by their field, not attempted.
    let (code, stderr) = serve_and_send(Some(&hello_with(
        1 << 20,
        1,
        &Mode {
            mode: 2,
            max_size: 1 << 44,
            max_sges: 4,
            max_batch: 4,
            boundary: 0,
        },
    )));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("max_size"), "{stderr}");
}

/// A checker from before the hello had a mode is told to match versions.
#[test]
fn an_older_checker_is_refused_naming_the_mismatch() {
    let mut old = hello(1 << 20, 2);
    old[..4].copy_from_slice(b"JIX1");
    old.truncate(50);
    let (code, stderr) = serve_and_send(Some(&old));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("older checker"), "{stderr}");
}
