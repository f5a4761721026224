//! The two-host server (`--serve`) against clients it must not trust: it reads the hello
//! before it opens the device, so these run on a machine without one. A stranger's bytes
//! and a hello asking for more than the caps end the server with an error naming what was
//! wrong, never a panic and never an allocation of what was asked.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on the loopback address.
fn free_addr() -> SocketAddr {
    let Ok(l) = TcpListener::bind("127.0.0.1:0") else {
        panic!("no loopback port");
    };
    let Ok(addr) = l.local_addr() else {
        panic!("no local address");
    };
    addr
}

/// Starts `--serve` on a free port, sends it `bytes` and returns its status and stderr.
fn serve_and_send(bytes: &[u8]) -> (Option<i32>, String) {
    let addr = free_addr();
    let Ok(child) = Command::new(env!("CARGO_BIN_EXE_justitia-integrity"))
        .args(["--serve", &addr.to_string(), "--timeout", "5"])
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
    else {
        panic!("cannot run the checker binary");
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut conn = loop {
        match TcpStream::connect(addr) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("the server never listened on {addr}: {e}"),
        }
    };
    let _ = conn.write_all(bytes);
    let Ok(out) = child.wait_with_output() else {
        panic!("the server could not be waited for");
    };
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The client's hello as `--connect` sends it: magic, endpoint (QP number, PSN, LID,
/// GID), seed, bytes per region, regions; big-endian.
fn hello(region_len: u64, regions: u32) -> Vec<u8> {
    let mut b = b"JIX1".to_vec();
    b.extend_from_slice(&0x11u32.to_be_bytes());
    b.extend_from_slice(&0x2468u32.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&[0; 16]);
    b.extend_from_slice(&7u64.to_be_bytes());
    b.extend_from_slice(&region_len.to_be_bytes());
    b.extend_from_slice(&regions.to_be_bytes());
    b
}

#[test]
fn a_stranger_is_refused_naming_what_it_sent() {
    let (code, stderr) = serve_and_send(&[b'G'; 50]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no checker greeting"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_hello_beyond_the_caps_is_refused_before_anything_is_allocated() {
    let (code, stderr) = serve_and_send(&hello(1 << 20, 1000));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("regions 1000"), "{stderr}");
    // 16 TiB per region: refused by its field, not attempted.
    let (code, stderr) = serve_and_send(&hello(1 << 44, 2));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("region_len"), "{stderr}");
}

#[test]
fn a_client_that_says_nothing_ends_the_server_at_its_deadline() {
    let start = Instant::now();
    let (code, stderr) = serve_and_send(&[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("reading the client's hello"), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}
