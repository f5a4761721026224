//! The bandwidth an RDMA WRITE stream gets, by the monotonic clock: two RC QPs of one
//! device connected to each other (on Soft-RoCE the traffic loops back inside rxe), `COUNT`
//! signaled WRITEs of `SIZE` bytes with `DEPTH` outstanding, timed from the first post to
//! the last completion. Run it under the shaper with `JUSTITIA_RATE` to see whether the
//! pacing holds the rate; perftest reports in units of its own cycle-counter calibration,
//! which is unreliable under emulation.
//!
//! Usage: `rate_probe [DEVICE] [SIZE] [COUNT] [DEPTH]` (defaults: first device, 1 MiB, 64,
//! 16). Prints `rate_probe: <count> writes of <size> bytes in <s> s = <MB/s> MB/s`.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use justitia_verbs::sys::*;
use justitia_verbs::{
    CompletionQueue, Context, Ibverbs, MemoryRegion, ProtectionDomain, QpCaps, QueuePair,
    SendRequest,
};

fn arg(n: usize, default: u64) -> Result<u64> {
    match std::env::args().nth(n) {
        Some(v) => v
            .parse()
            .with_context(|| format!("argument {n} `{v}` is not a number")),
        None => Ok(default),
    }
}

fn main() -> Result<()> {
    let device = std::env::args().nth(1).filter(|d| d != "-");
    let size = arg(2, 1 << 20)?;
    let count = arg(3, 64)?;
    let depth = arg(4, 16)?.max(1);
    let len = u32::try_from(size).context("SIZE must fit in 32 bits")?;

    let verbs = Arc::new(Ibverbs::load()?);
    let ctx = Context::open(verbs, device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    let src = MemoryRegion::new(&pd, len as usize, access)?;
    let dst = MemoryRegion::new(&pd, len as usize, access)?;
    let caps = QpCaps {
        max_send_wr: u32::try_from(depth)?,
        ..QpCaps::default()
    };
    let cq = CompletionQueue::new(&ctx, caps.max_send_wr * 2 + 2, None)?;
    let a = QueuePair::create_rc(&pd, &cq, &cq, caps)?;
    let b = QueuePair::create_rc(&pd, &cq, &cq, caps)?;
    let (port, gid) = (1, 0);
    let (ea, eb) = (
        a.endpoint(port, gid, 0x1111)?,
        b.endpoint(port, gid, 0x2222)?,
    );
    a.connect(port, gid, 0x1111, &eb)?;
    b.connect(port, gid, 0x2222, &ea)?;

    let write = |id: u64| -> Result<()> {
        let sge = src.sge(0, len)?;
        a.post_send(&[SendRequest::write(id, vec![sge], dst.addr(), dst.rkey())])?;
        Ok(())
    };
    let start = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut wc = [ibv_wc::default(); 16];
    while done < count {
        while posted < count && posted - done < depth {
            write(posted)?;
            posted += 1;
        }
        let n = cq.poll(&mut wc)?;
        for w in &wc[..n] {
            if w.status != IBV_WC_SUCCESS {
                bail!("WRITE {} completed with status {}", w.wr_id, w.status);
            }
            done += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "rate_probe: {count} writes of {size} bytes in {secs:.3} s = {:.3} MB/s",
        (count * size) as f64 / secs / 1e6
    );
    Ok(())
}
