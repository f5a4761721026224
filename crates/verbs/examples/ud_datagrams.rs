//! Checks Unreliable Datagram support on a real device: two UD queue pairs A and B on port
//! 1 of one device, sharing one protection domain, one CQ and one registered buffer. A
//! sends 16 datagrams of 1 to 64 bytes to B, by GID index 0 (or `--gid-index`) when the
//! port has a GID there (RoCE always does), else by LID; every one must arrive whole, with
//! B's receive completion naming A's QP as its source and, when routed by GID, with a
//! network header whose source GID is A's port GID (by LID: with A's port LID as its
//! source LID). Then a datagram with the wrong Q_Key must not arrive within 200 ms, and
//! one sent after it with the right Q_Key must. The guest suite runs it on Soft-RoCE (GID
//! index 0, RoCE v2 over IPv6); a GID index whose GID is IPv4-mapped checks RoCE v2 over
//! IPv4, whose network header is an IPv4 header.
//!
//! ```text
//! ud_datagrams [--device NAME] [--gid-index N]
//! ```
//!
//! Prints one summary line; exits 1 with the first mismatch otherwise.

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_verbs::sys::{
    ibv_wc, IBV_ACCESS_LOCAL_WRITE, IBV_WC_GRH, IBV_WC_RECV, IBV_WC_SUCCESS,
};
use justitia_verbs::{
    gid_text, grh_source_gid, AddressHandle, CompletionQueue, Context, DatagramDest, Ibverbs,
    MemoryRegion, ProtectionDomain, QpCaps, QueuePair, RecvRequest, GRH_BYTES,
};

/// The port both queue pairs use.
const PORT: u8 = 1;
/// B's Q_Key (top bit clear: a controlled Q_Key needs privilege).
const QKEY: u32 = 0x1111_2222;
/// A Q_Key one off B's: B must drop what carries it.
const WRONG_QKEY: u32 = 0x1111_2223;
/// Datagrams sent and checked.
const DATAGRAMS: usize = 16;
/// The largest payload: the datagram endpoint's messages are this small.
const MAX_PAYLOAD: usize = 64;
/// A receive slot: the network header the device writes first, then the payload.
const SLOT: usize = GRH_BYTES + MAX_PAYLOAD;
/// Receive slots posted on B: the datagrams, the wrong-Q_Key one and the one after it,
/// with room to spare so that a stray arrival is seen rather than refused.
const RECV_SLOTS: usize = 32;
/// Send slots: one per datagram sent.
const SEND_SLOTS: usize = DATAGRAMS + 2;
/// Set in the work-request id of a send, so its completion is told from a receive's.
const SEND_TAG: u64 = 1 << 32;
/// How long the datagrams (and each later send) may take to complete.
const DEADLINE: Duration = Duration::from_secs(5);
/// How long a datagram with the wrong Q_Key is watched for after its send completed.
const DROP_WAIT: Duration = Duration::from_millis(200);

/// The command line: the device (default the first) and the GID index (default 0).
fn parse_args() -> Option<(Option<String>, u8)> {
    let mut device = None;
    let mut gid_index = 0;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--device" => device = Some(args.next()?),
            "--gid-index" => gid_index = args.next()?.parse().ok()?,
            _ => return None,
        }
    }
    Some((device, gid_index))
}

fn main() -> ExitCode {
    let Some((device, gid_index)) = parse_args() else {
        eprintln!("usage: ud_datagrams [--device NAME] [--gid-index N]");
        return ExitCode::from(2);
    };
    match check(device.as_deref(), gid_index) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("ud datagrams: mismatch: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The payload length of datagram `i`: 1 and 64 at the ends, spread over 1..=64 between.
fn payload_len(i: usize) -> usize {
    match i {
        0 => 1,
        i if i == DATAGRAMS - 1 => MAX_PAYLOAD,
        i => 1 + (i * 37) % MAX_PAYLOAD,
    }
}

/// The payload of datagram `tag`: its first byte is the tag, so that a datagram is known
/// by its content whatever order datagrams arrive in; the rest is a pattern of the tag.
fn payload(tag: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| {
            if j == 0 {
                tag
            } else {
                tag.wrapping_mul(31).wrapping_add((j as u8).wrapping_mul(7))
            }
        })
        .collect()
}

/// Completions read from the CQ in batches and handed out one at a time.
struct Poller<'a> {
    cq: &'a CompletionQueue,
    pending: VecDeque<ibv_wc>,
}

impl Poller<'_> {
    /// The next completion, or `None` once `until` has passed without one.
    fn next(&mut self, until: Instant) -> Result<Option<ibv_wc>, String> {
        loop {
            if let Some(wc) = self.pending.pop_front() {
                return Ok(Some(wc));
            }
            let mut batch = [ibv_wc::default(); 16];
            let n = self.cq.poll(&mut batch).map_err(|e| e.to_string())?;
            self.pending.extend(&batch[..n]);
            if n == 0 {
                if Instant::now() >= until {
                    return Ok(None);
                }
                // Soft-RoCE completes on the same CPUs this loop runs on: give them way.
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

/// Sends from A to B out of the send slots of the registered buffer.
struct Sender<'a> {
    qp: &'a QueuePair,
    ah: &'a AddressHandle,
    /// The inline bytes the provider granted A.
    inline_max: usize,
    /// Datagrams sent inline so far.
    inlined: usize,
}

impl Sender<'_> {
    /// Sends `data` from send slot `slot` with Q_Key `qkey`, signaled, and inline on odd
    /// slots when the QP allows it, so that both ways of handing a payload over are used.
    fn send(
        &mut self,
        mr: &mut MemoryRegion,
        slot: usize,
        data: &[u8],
        qkey: u32,
    ) -> Result<(), String> {
        let at = RECV_SLOTS * SLOT + slot * MAX_PAYLOAD;
        mr.as_mut_slice()[at..at + data.len()].copy_from_slice(data);
        let sge = mr.sge(at, data.len() as u32).map_err(|e| e.to_string())?;
        let inline = slot % 2 == 1 && data.len() <= self.inline_max;
        self.qp
            .post_send_datagram(
                SEND_TAG | slot as u64,
                sge,
                self.ah,
                self.ah.dest().qpn,
                qkey,
                true,
                inline,
            )
            .map_err(|e| format!("datagram {slot}: {e}"))?;
        self.inlined += usize::from(inline);
        Ok(())
    }
}

/// What a receive completion must show of its source.
struct Source {
    qpn: u32,
    /// A's port GID when routed globally.
    gid: Option<[u8; 16]>,
    /// A's port LID when routed by LID.
    lid: u16,
}

/// Checks one receive completion against its source; returns the payload it delivered.
fn received<'m>(
    verbs: &Ibverbs,
    wc: &ibv_wc,
    mr: &'m MemoryRegion,
    source: &Source,
) -> Result<&'m [u8], String> {
    let slot = usize::try_from(wc.wr_id)
        .ok()
        .filter(|&s| s < RECV_SLOTS)
        .ok_or_else(|| format!("a receive completion with unknown id {:#x}", wc.wr_id))?;
    if wc.status != IBV_WC_SUCCESS {
        return Err(format!(
            "receive slot {slot}: status {}",
            verbs.status_str(wc.status)
        ));
    }
    if wc.opcode != IBV_WC_RECV {
        return Err(format!("receive slot {slot}: opcode {}", wc.opcode));
    }
    let len = wc.byte_len as usize;
    if !(GRH_BYTES..=SLOT).contains(&len) {
        return Err(format!(
            "receive slot {slot}: byte_len {len}, not {GRH_BYTES} + at most {MAX_PAYLOAD}"
        ));
    }
    if wc.src_qp != source.qpn {
        return Err(format!(
            "receive slot {slot}: source QPN {:#x}, not A's {:#x}",
            wc.src_qp, source.qpn
        ));
    }
    let buf = &mr.as_slice()[slot * SLOT..slot * SLOT + len];
    match source.gid {
        Some(want) => {
            if wc.wc_flags & IBV_WC_GRH == 0 {
                return Err(format!(
                    "receive slot {slot}: routed by GID, yet no IBV_WC_GRH (wc_flags {:#x})",
                    wc.wc_flags
                ));
            }
            match grh_source_gid(buf) {
                Some(got) if got == want => {}
                Some(got) => {
                    return Err(format!(
                        "receive slot {slot}: source GID {}, not A's {}",
                        gid_text(&got),
                        gid_text(&want)
                    ))
                }
                None => {
                    return Err(format!(
                        "receive slot {slot}: no source GID in the network header {:02x?}",
                        &buf[..GRH_BYTES]
                    ))
                }
            }
        }
        None => {
            if wc.slid != source.lid {
                return Err(format!(
                    "receive slot {slot}: source LID {}, not A's {}",
                    wc.slid, source.lid
                ));
            }
        }
    }
    Ok(&buf[GRH_BYTES..])
}

fn check(device: Option<&str>, gid_index: u8) -> Result<String, String> {
    let verbs = Arc::new(Ibverbs::load().map_err(|e| format!("loading libibverbs: {e}"))?);
    let ctx = Context::open(Arc::clone(&verbs), device)
        .map_err(|e| format!("opening the device: {e}"))?;
    let pd = ProtectionDomain::new(&ctx).map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new(&ctx, 128, None).map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: MAX_PAYLOAD as u32,
    };
    let a = QueuePair::create_ud(&pd, &cq, &cq, caps).map_err(|e| format!("QP A: {e}"))?;
    let b = QueuePair::create_ud(&pd, &cq, &cq, caps).map_err(|e| format!("QP B: {e}"))?;
    a.activate_ud(PORT, QKEY, 0x00a0_0000)
        .map_err(|e| format!("QP A: {e}"))?;
    b.activate_ud(PORT, QKEY, 0x00b0_0000)
        .map_err(|e| format!("QP B: {e}"))?;

    let port_gid = ctx.query_gid(PORT, gid_index).map_err(|e| e.to_string())?;
    let port_lid = ctx.query_port(PORT).map_err(|e| e.to_string())?.lid;
    let dest = DatagramDest {
        gid: port_gid,
        lid: port_lid,
        qpn: b.qp_num(),
        qkey: QKEY,
    };
    let route = if dest.is_global() {
        format!("by GID {} (index {gid_index})", gid_text(&port_gid))
    } else {
        format!("by LID {port_lid}")
    };
    let ah = AddressHandle::new(&pd, &dest, PORT, gid_index).map_err(|e| e.to_string())?;
    let source = Source {
        qpn: a.qp_num(),
        gid: dest.is_global().then_some(port_gid),
        lid: port_lid,
    };

    let mut mr = MemoryRegion::new(
        &pd,
        RECV_SLOTS * SLOT + SEND_SLOTS * MAX_PAYLOAD,
        IBV_ACCESS_LOCAL_WRITE,
    )
    .map_err(|e| e.to_string())?;
    let recvs = (0..RECV_SLOTS)
        .map(|slot| {
            Ok(RecvRequest {
                wr_id: slot as u64,
                sges: vec![mr.sge(slot * SLOT, SLOT as u32)?],
            })
        })
        .collect::<Result<Vec<_>, justitia_verbs::VerbsError>>()
        .map_err(|e| e.to_string())?;
    b.post_recv(&recvs).map_err(|e| format!("QP B: {e}"))?;

    let mut sender = Sender {
        qp: &a,
        ah: &ah,
        inline_max: a.caps().max_inline_data as usize,
        inlined: 0,
    };

    let expected: Vec<Vec<u8>> = (0..DATAGRAMS)
        .map(|i| payload(i as u8, payload_len(i)))
        .collect();
    for (i, data) in expected.iter().enumerate() {
        sender.send(&mut mr, i, data, QKEY)?;
    }

    let mut poller = Poller {
        cq: &cq,
        pending: VecDeque::new(),
    };
    let until = Instant::now() + DEADLINE;
    let mut sent = [false; DATAGRAMS];
    let mut arrived = [false; DATAGRAMS];
    let mut arrivals = 0;
    while arrivals < DATAGRAMS || sent.contains(&false) {
        let Some(wc) = poller.next(until)? else {
            return Err(format!(
                "after {} s, {arrivals} of {DATAGRAMS} datagrams arrived and {} of their \
                 sends completed",
                DEADLINE.as_secs(),
                sent.iter().filter(|&&s| s).count()
            ));
        };
        if wc.wr_id & SEND_TAG != 0 {
            let slot = (wc.wr_id & !SEND_TAG) as usize;
            if slot >= DATAGRAMS || sent[slot] {
                return Err(format!("an unexpected send completion for slot {slot}"));
            }
            if wc.status != IBV_WC_SUCCESS {
                return Err(format!(
                    "datagram {slot}'s send completed with {}",
                    verbs.status_str(wc.status)
                ));
            }
            sent[slot] = true;
            continue;
        }
        let got = received(&verbs, &wc, &mr, &source)?;
        let tag = usize::from(*got.first().ok_or("an empty datagram arrived")?);
        let want = expected
            .get(tag)
            .ok_or_else(|| format!("a datagram tagged {tag} arrived, which was not sent"))?;
        if arrived[tag] {
            return Err(format!("datagram {tag} arrived twice"));
        }
        if got != want.as_slice() {
            return Err(format!(
                "datagram {tag}: {} payload bytes {:02x?}, sent {} bytes {:02x?}",
                got.len(),
                got,
                want.len(),
                want
            ));
        }
        arrived[tag] = true;
        arrivals += 1;
    }

    // The wrong Q_Key: its send completes (nothing on UD says whether anyone took it), and
    // B must drop it.
    let wrong = payload(0xe0, 24);
    sender.send(&mut mr, DATAGRAMS, &wrong, WRONG_QKEY)?;
    let until = Instant::now() + DEADLINE;
    let mut watch_until = None;
    loop {
        let limit = watch_until.unwrap_or(until);
        let Some(wc) = poller.next(limit)? else {
            if watch_until.is_some() {
                break;
            }
            return Err(format!(
                "the wrong Q_Key datagram's send did not complete within {} s",
                DEADLINE.as_secs()
            ));
        };
        if wc.wr_id == SEND_TAG | DATAGRAMS as u64 {
            if wc.status != IBV_WC_SUCCESS {
                return Err(format!(
                    "the wrong Q_Key datagram's send completed with {}",
                    verbs.status_str(wc.status)
                ));
            }
            watch_until = Some(Instant::now() + DROP_WAIT);
            continue;
        }
        return Err(format!(
            "a completion (id {:#x}, status {}, {} bytes) while the datagram with Q_Key \
             {WRONG_QKEY:#x} should have been dropped by B (Q_Key {QKEY:#x})",
            wc.wr_id,
            verbs.status_str(wc.status),
            wc.byte_len
        ));
    }

    // B still takes datagrams with its Q_Key: the next to arrive is this one, not a late
    // wrong one.
    let after = payload(0xf0, 40);
    sender.send(&mut mr, DATAGRAMS + 1, &after, QKEY)?;
    let until = Instant::now() + DEADLINE;
    let (mut after_sent, mut after_arrived) = (false, false);
    while !(after_sent && after_arrived) {
        let Some(wc) = poller.next(until)? else {
            return Err(format!(
                "the datagram after the wrong Q_Key one: sent {after_sent}, arrived \
                 {after_arrived} after {} s",
                DEADLINE.as_secs()
            ));
        };
        if wc.wr_id & SEND_TAG != 0 {
            if wc.status != IBV_WC_SUCCESS {
                return Err(format!(
                    "the datagram after the wrong Q_Key one: send completed with {}",
                    verbs.status_str(wc.status)
                ));
            }
            after_sent = true;
            continue;
        }
        let got = received(&verbs, &wc, &mr, &source)?;
        if got == wrong.as_slice() {
            return Err(format!(
                "the datagram with Q_Key {WRONG_QKEY:#x} arrived late, after {} ms",
                DROP_WAIT.as_millis()
            ));
        }
        if got != after.as_slice() {
            return Err(format!(
                "after the wrong Q_Key one, {} bytes {:02x?} arrived instead of the next \
                 datagram",
                got.len(),
                got
            ));
        }
        after_arrived = true;
    }

    Ok(format!(
        "ud datagrams: {arrivals} of {DATAGRAMS} arrived with their source checked; a wrong \
         Q_Key dropped ({} port {PORT}, {route}, {} of {} sent inline)",
        ctx.name(),
        sender.inlined,
        DATAGRAMS + 2
    ))
}
