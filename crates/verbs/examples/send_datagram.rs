//! Sends a datagram (or `--count` of them) from a UD queue pair of its own to a queue pair
//! named on the command line, and waits for each send to complete: what a host on the fabric that is not the
//! one a receiver expects can do. The guest suite uses it to send a shaper's side channel
//! a hello from a queue pair the daemons never paired, which the shaper must refuse.
//!
//! ```text
//! send_datagram --device NAME [--gid-index N] --to GID --qpn QPN --qkey QKEY --hex BYTES [--size N] [--count N]
//! ```
//!
//! `GID` is a GID in the sysfs form (`0000:0000:0000:0000:0000:ffff:0a4d:0001`) or an
//! IPv4 address (its IPv4-mapped GID); `QPN` and `QKEY` are numbers (`0x` for hex);
//! `BYTES` is the payload in hex, at most 64 bytes; `--size` pads it with zeros to `N`
//! bytes (at most 1024: one packet at the smallest RoCE MTU), to send a receiver more
//! than its receive holds. Prints one line; exits 1 on failure.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_verbs::sys::{ibv_wc, IBV_ACCESS_LOCAL_WRITE, IBV_WC_SUCCESS};
use justitia_verbs::{
    gid_text, AddressHandle, CompletionQueue, Context, DatagramDest, Ibverbs, MemoryRegion,
    ProtectionDomain, QpCaps, QueuePair,
};

/// The port the queue pair uses.
const PORT: u8 = 1;
/// The sender's own Q_Key (what it would receive with; irrelevant to what it sends).
const OWN_QKEY: u32 = 0x0bad_0001;
/// The longest payload given in hex.
const MAX_PAYLOAD: usize = 64;
/// The longest datagram sent (padded with `--size`).
const MAX_SIZE: usize = 1024;
/// How long the send may take to complete.
const DEADLINE: Duration = Duration::from_secs(5);

/// What the command line asks for.
struct Args {
    device: String,
    gid_index: u8,
    to: [u8; 16],
    qpn: u32,
    qkey: u32,
    payload: Vec<u8>,
    count: u32,
}

/// The payload padded with zeros to `size` bytes, if it fits [`MAX_SIZE`].
fn padded(mut payload: Vec<u8>, size: Option<usize>) -> Option<Vec<u8>> {
    if let Some(n) = size {
        if n < payload.len() || n > MAX_SIZE {
            return None;
        }
        payload.resize(n, 0);
    }
    Some(payload)
}

fn number(text: &str) -> Option<u32> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn gid(text: &str) -> Option<[u8; 16]> {
    if let Ok(v4) = text.parse::<std::net::Ipv4Addr>() {
        return Some(v4.to_ipv6_mapped().octets());
    }
    let hex: String = text.chars().filter(|c| *c != ':').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn bytes(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || text.len() > 2 * MAX_PAYLOAD {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn parse_args() -> Option<Args> {
    let (mut device, mut gid_index, mut to, mut qpn, mut qkey, mut payload, mut size) =
        (None, 0, None, None, None, None, None);
    let mut count = 1;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next()?;
        match arg.as_str() {
            "--device" => device = Some(value),
            "--gid-index" => gid_index = value.parse().ok()?,
            "--to" => to = gid(&value),
            "--qpn" => qpn = number(&value),
            "--qkey" => qkey = number(&value),
            "--hex" => payload = bytes(&value),
            "--size" => size = Some(value.parse().ok()?),
            "--count" => count = value.parse().ok().filter(|n| (1..=10_000).contains(n))?,
            _ => return None,
        }
    }
    Some(Args {
        device: device?,
        gid_index,
        to: to?,
        qpn: qpn?,
        qkey: qkey?,
        payload: padded(payload.filter(|p| !p.is_empty())?, size)?,
        count,
    })
}

fn main() -> ExitCode {
    let Some(args) = parse_args() else {
        eprintln!(
            "usage: send_datagram --device NAME [--gid-index N] --to GID --qpn QPN --qkey QKEY --hex BYTES (1 to {MAX_PAYLOAD} bytes) [--size N (at most {MAX_SIZE})] [--count N (at most 10000)]"
        );
        return ExitCode::from(2);
    };
    match send(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("send_datagram: {e}");
            ExitCode::from(1)
        }
    }
}

fn send(args: &Args) -> Result<String, String> {
    let verbs = Arc::new(Ibverbs::load().map_err(|e| e.to_string())?);
    let ctx = Context::open(verbs, Some(&args.device)).map_err(|e| e.to_string())?;
    let pd = ProtectionDomain::new(&ctx).map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new(&ctx, 4, None).map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = QueuePair::create_ud(&pd, &cq, &cq, caps).map_err(|e| e.to_string())?;
    qp.activate_ud(PORT, OWN_QKEY, 0)
        .map_err(|e| e.to_string())?;
    let mut buf =
        MemoryRegion::new(&pd, MAX_SIZE, IBV_ACCESS_LOCAL_WRITE).map_err(|e| e.to_string())?;
    buf.as_mut_slice()[..args.payload.len()].copy_from_slice(&args.payload);
    let dest = DatagramDest {
        gid: args.to,
        lid: 0,
        qpn: args.qpn,
        qkey: args.qkey,
    };
    let ah = AddressHandle::new(&pd, &dest, PORT, args.gid_index).map_err(|e| e.to_string())?;
    let len = u32::try_from(args.payload.len()).map_err(|e| e.to_string())?;
    let sge = buf.sge(0, len).map_err(|e| e.to_string())?;
    for _ in 0..args.count {
        qp.post_send_datagram(1, sge, &ah, args.qpn, args.qkey, true, false)
            .map_err(|e| e.to_string())?;
        wait_sent(&cq)?;
    }
    Ok(format!(
        "sent {} x {} bytes from UD queue pair {:#x} to {} queue pair {:#x} Q_Key {:#x}",
        args.count,
        args.payload.len(),
        qp.qp_num(),
        gid_text(&args.to),
        args.qpn,
        args.qkey
    ))
}

/// Waits for the one send in flight to complete, successfully, within [`DEADLINE`].
fn wait_sent(cq: &CompletionQueue) -> Result<(), String> {
    let deadline = Instant::now() + DEADLINE;
    let mut wc = [ibv_wc::default(); 1];
    loop {
        if cq.poll(&mut wc).map_err(|e| e.to_string())? == 1 {
            if wc[0].status != IBV_WC_SUCCESS {
                return Err(format!("a send completed with status {}", wc[0].status));
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("a send did not complete within 5 s".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
