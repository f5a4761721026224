//! The checker across two hosts: a *server* process holds the responder QP and the remote
//! regions, a *client* process on another host holds the requester and READs from them.
//!
//! The two exchange what connecting needs over one TCP connection, as perftest does out
//! of band: the client sends [`Hello`] (its QP's endpoint, the seed, the regions it
//! wants), the server creates the regions, fills region `r` wholly with the pattern of
//! [`region_seed`]`(seed, r)` and answers with its endpoint and each region's address and
//! rkey; both then connect their QPs. Every transfer the client's plan draws is posted as
//! an RDMA READ, so its bytes cross the link from the server's RNIC to the client's, and
//! the client checks each destination against the pattern at the remote offset it came
//! from, the guard bytes around it and every completion, as the one-process checker
//! does. The client sends one byte after every batch, and [`DONE`] at the end; the server
//! then checks that no READ changed its regions and answers with one verdict byte.
//!
//! The server trusts nothing it is sent: every field of [`Hello`] is range-checked (at
//! most [`MAX_REGIONS`] regions of at most [`MAX_REGION_LEN`] bytes), and every read of
//! the connection has a deadline, so a client that goes silent ends the server's run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use justitia_verbs::sys::*;
use justitia_verbs::{
    CompletionQueue, Context, Endpoint, Ibverbs, MemoryRegion, ProtectionDomain, QpCaps, QueuePair,
    SendRequest, VerbsError,
};

use crate::checker::{
    check_send_completion, local_sges, queue_depth, wait_for, CheckError, Report,
};
use crate::pattern;
use crate::plan::{Batch, Operation, Placement, PlanConfig, GUARD};

/// Regions a client may ask for at most.
pub const MAX_REGIONS: u32 = 8;
/// Bytes a region may have at most (the checker's largest transfer and its slack).
pub const MAX_REGION_LEN: u64 = (1 << 30) + crate::plan::REGION_SLACK as u64;
/// The byte a client sends after its last batch.
pub const DONE: u8 = 0xff;
/// The byte a client sends after every other batch (keeps the server's deadline).
const PROGRESS: u8 = 0x01;
const MAGIC: [u8; 4] = *b"JIX1";
const HELLO_LEN: usize = 4 + ENDPOINT_LEN + 8 + 8 + 4;
const ENDPOINT_LEN: usize = 4 + 4 + 2 + 16;
const REGION_LEN: usize = 8 + 4;

/// Why a run across two hosts stopped.
#[derive(Debug, thiserror::Error)]
pub enum AcrossError {
    /// The checker's own checks or the verbs failed.
    #[error(transparent)]
    Check(#[from] CheckError),
    /// The TCP connection failed or timed out.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The peer sent something that is not this protocol or is out of range.
    #[error("the other process sent {0}")]
    Protocol(String),
}

impl From<VerbsError> for AcrossError {
    fn from(e: VerbsError) -> Self {
        AcrossError::Check(CheckError::Verbs(e))
    }
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> AcrossError {
    move |source| AcrossError::Io { what, source }
}

/// The seed of the pattern region `region` of a run seeded with `seed` holds.
pub fn region_seed(seed: u64, region: usize) -> u64 {
    seed ^ (region as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93)
}

/// What the client tells the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The client's QP.
    pub endpoint: Endpoint,
    /// The run's seed (the regions' patterns derive from it).
    pub seed: u64,
    /// Bytes per region.
    pub region_len: u64,
    /// Regions.
    pub regions: u32,
}

fn put_endpoint(out: &mut Vec<u8>, e: &Endpoint) {
    out.extend_from_slice(&e.qp_num.to_be_bytes());
    out.extend_from_slice(&e.psn.to_be_bytes());
    out.extend_from_slice(&e.lid.to_be_bytes());
    out.extend_from_slice(&e.gid);
}

fn get_endpoint(b: &[u8]) -> Endpoint {
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[10..26]);
    Endpoint {
        qp_num: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        psn: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
        lid: u16::from_be_bytes([b[8], b[9]]),
        gid,
    }
}

impl Hello {
    /// Its bytes on the connection.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(&MAGIC);
        put_endpoint(&mut out, &self.endpoint);
        out.extend_from_slice(&self.seed.to_be_bytes());
        out.extend_from_slice(&self.region_len.to_be_bytes());
        out.extend_from_slice(&self.regions.to_be_bytes());
        out
    }

    /// Parses and range-checks a hello.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, AcrossError> {
        if b[..4] != MAGIC {
            return Err(AcrossError::Protocol(format!(
                "no checker greeting (first bytes {:02x?})",
                &b[..4]
            )));
        }
        let at = 4 + ENDPOINT_LEN;
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(w)
        };
        let hello = Hello {
            endpoint: get_endpoint(&b[4..at]),
            seed: word(at),
            region_len: word(at + 8),
            regions: u32::from_be_bytes([b[at + 16], b[at + 17], b[at + 18], b[at + 19]]),
        };
        if hello.regions == 0 || hello.regions > MAX_REGIONS {
            return Err(AcrossError::Protocol(format!(
                "regions {} (1 to {MAX_REGIONS})",
                hello.regions
            )));
        }
        if hello.region_len < 2 * GUARD as u64 || hello.region_len > MAX_REGION_LEN {
            return Err(AcrossError::Protocol(format!(
                "region_len {} ({} to {MAX_REGION_LEN})",
                hello.region_len,
                2 * GUARD
            )));
        }
        Ok(hello)
    }
}

/// How both ends set up their device.
#[derive(Clone, Debug)]
pub struct AcrossOptions {
    /// Device name (`None`: the first device).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID index (on RoCE v2 across a routed link, the IPv4-mapped GID's).
    pub gid_index: u8,
    /// How long to wait for one batch's completions, and for the other process.
    pub timeout: Duration,
}

/// The first PSN each side sends with.
const CLIENT_PSN: u32 = 0x2468;
const SERVER_PSN: u32 = 0x1357;

/// What the server saw: the client's run's end and whether its regions were intact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerReport {
    /// Batches the client said it ran.
    pub batches: u64,
    /// Regions whose bytes differ from their pattern at the end (READs must change none).
    pub changed_regions: usize,
    /// The client said it was done (not gone midway).
    pub done: bool,
}

/// Accepts one connection on `listener`, waiting at most `timeout`: a client that never
/// comes ends the server with an error, as one that says nothing does.
fn accept_within(
    listener: &TcpListener,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr), AcrossError> {
    listener
        .set_nonblocking(true)
        .map_err(io("making the checker's TCP port non-blocking"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok(accepted) => return Ok(accepted),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(io("accepting the client")(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no client within {timeout:?}"),
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io("accepting the client")(e)),
        }
    }
}

/// Serves one client on `listen` (port 0: a free port, printed): answers its hello, holds the regions while it READs,
/// and checks them when it is done.
pub fn serve(listen: SocketAddr, options: &AcrossOptions) -> Result<ServerReport, AcrossError> {
    let listener = TcpListener::bind(listen).map_err(io("binding the checker's TCP port"))?;
    // The bound address: port 0 asks the kernel for a free one, which the caller reads here.
    let bound = listener
        .local_addr()
        .map_err(io("reading the checker's TCP port"))?;
    println!("justitia-integrity: serving on {bound}, waiting for one client");
    let (mut conn, from) = accept_within(&listener, options.timeout)?;
    conn.set_nonblocking(false)
        .map_err(io("making the client's connection blocking"))?;
    conn.set_read_timeout(Some(options.timeout))
        .map_err(io("setting the read deadline"))?;
    conn.set_write_timeout(Some(options.timeout))
        .map_err(io("setting the write deadline"))?;
    let mut b = [0u8; HELLO_LEN];
    conn.read_exact(&mut b)
        .map_err(io("reading the client's hello"))?;
    let hello = Hello::decode(&b)?;
    println!(
        "justitia-integrity: client {from}: QP {:#x}, {} regions of {} bytes, seed {}",
        hello.endpoint.qp_num, hello.regions, hello.region_len, hello.seed
    );

    let verbs = Arc::new(Ibverbs::load()?);
    let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, 64, None)?;
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = QueuePair::create_rc(&pd, &cq, &cq, caps)?;
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
    let len = usize::try_from(hello.region_len)
        .map_err(|_| AcrossError::Protocol(format!("region_len {}", hello.region_len)))?;
    let mut regions = (0..hello.regions)
        .map(|_| MemoryRegion::new(&pd, len, access))
        .collect::<Result<Vec<_>, _>>()?;
    for (r, mr) in regions.iter_mut().enumerate() {
        pattern::fill(region_seed(hello.seed, r), 0, mr.as_mut_slice());
    }
    let own = qp.endpoint(options.port, options.gid_index, SERVER_PSN)?;
    qp.connect(options.port, options.gid_index, SERVER_PSN, &hello.endpoint)?;
    let mut reply = Vec::with_capacity(4 + ENDPOINT_LEN + regions.len() * REGION_LEN);
    reply.extend_from_slice(&MAGIC);
    put_endpoint(&mut reply, &own);
    for mr in &regions {
        reply.extend_from_slice(&mr.addr().to_be_bytes());
        reply.extend_from_slice(&mr.rkey().to_be_bytes());
    }
    conn.write_all(&reply).map_err(io("answering the client"))?;

    let mut report = ServerReport {
        batches: 0,
        changed_regions: 0,
        done: false,
    };
    let mut byte = [0u8; 1];
    loop {
        match conn.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == DONE => {
                report.done = true;
                break;
            }
            Ok(_) => report.batches += 1,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io("waiting for the client's next batch")(e)),
        }
    }
    report.changed_regions = regions
        .iter()
        .enumerate()
        .filter(|(r, mr)| pattern::check(region_seed(hello.seed, *r), 0, mr.as_slice()).is_some())
        .count();
    if report.done {
        let verdict = u8::from(report.changed_regions == 0);
        // The client may already be gone; its own verdict stands then.
        let _ = conn.write_all(&[verdict]);
    }
    Ok(report)
}

/// The client's end: the requester QP, its local regions and the server's regions.
pub struct Client {
    verbs: Arc<Ibverbs>,
    ctx: Context,
    conn: TcpStream,
    qp: QueuePair,
    cq: CompletionQueue,
    local: Vec<MemoryRegion>,
    /// The server's regions: address and rkey.
    remote: Vec<(u64, u32)>,
    seed: u64,
    timeout: Duration,
    // Kept alive for the objects above.
    _pd: ProtectionDomain,
    _unused_cq: CompletionQueue,
}

impl Client {
    /// Opens the device, connects to the server at `server` and connects the QPs, for a
    /// run of `plan` seeded with `seed`.
    pub fn connect(
        server: SocketAddr,
        options: &AcrossOptions,
        plan: &PlanConfig,
        seed: u64,
    ) -> Result<Self, AcrossError> {
        let regions = u32::try_from(plan.remote_regions.max(1))
            .ok()
            .filter(|&n| n <= MAX_REGIONS)
            .ok_or_else(|| AcrossError::Protocol("too many remote regions".into()))?;
        let verbs = Arc::new(Ibverbs::load()?);
        let ctx = Context::open(Arc::clone(&verbs), options.device.as_deref())?;
        let pd = ProtectionDomain::new(&ctx)?;
        let depth = queue_depth(plan);
        // Room for every request the send queue holds and more: a shaper that finds a CQ
        // smaller than its QPs' send queues leaves those QPs unshaped.
        let cq = CompletionQueue::new(&ctx, 2 * depth, None)?;
        let unused_cq = CompletionQueue::new(&ctx, 16, None)?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: 16,
            max_send_sge: u32::try_from(plan.max_sges.max(1)).unwrap_or(u32::MAX),
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = QueuePair::create_rc(&pd, &cq, &unused_cq, caps)?;
        let access = IBV_ACCESS_LOCAL_WRITE;
        let local = (0..plan.local_regions.max(1))
            .map(|_| MemoryRegion::new(&pd, plan.region_len(), access))
            .collect::<Result<Vec<_>, _>>()?;

        let mut conn = TcpStream::connect_timeout(&server, options.timeout)
            .map_err(io("connecting to the server"))?;
        conn.set_read_timeout(Some(options.timeout))
            .map_err(io("setting the read deadline"))?;
        conn.set_write_timeout(Some(options.timeout))
            .map_err(io("setting the write deadline"))?;
        let hello = Hello {
            endpoint: qp.endpoint(options.port, options.gid_index, CLIENT_PSN)?,
            seed,
            region_len: plan.region_len() as u64,
            regions,
        };
        conn.write_all(&hello.encode())
            .map_err(io("sending the hello"))?;
        let mut head = [0u8; 4 + ENDPOINT_LEN];
        conn.read_exact(&mut head)
            .map_err(io("reading the server's answer"))?;
        if head[..4] != MAGIC {
            return Err(AcrossError::Protocol("no checker answer".into()));
        }
        let theirs = get_endpoint(&head[4..]);
        let mut remote = Vec::with_capacity(regions as usize);
        for _ in 0..regions {
            let mut r = [0u8; REGION_LEN];
            conn.read_exact(&mut r)
                .map_err(io("reading the server's regions"))?;
            let mut addr = [0u8; 8];
            addr.copy_from_slice(&r[..8]);
            remote.push((
                u64::from_be_bytes(addr),
                u32::from_be_bytes([r[8], r[9], r[10], r[11]]),
            ));
        }
        qp.connect(options.port, options.gid_index, CLIENT_PSN, &theirs)?;
        Ok(Client {
            verbs,
            conn,
            qp,
            cq,
            local,
            remote,
            seed,
            timeout: options.timeout,
            _pd: pd,
            _unused_cq: unused_cq,
            ctx,
        })
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        self.ctx.name()
    }

    fn local_bytes(&self, at: &Placement) -> &[u8] {
        &self.local[at.region].as_slice()[at.offset..at.offset + at.len]
    }

    /// Posts `batch` with every transfer an RDMA READ from the server's regions, checks
    /// its completions, every destination byte and the guards around each, adding to
    /// `report`.
    pub fn run_batch(&mut self, batch: &Batch, report: &mut Report) -> Result<(), AcrossError> {
        let mut transfers = batch.transfers.clone();
        for t in &mut transfers {
            t.op = Operation::Read;
        }
        // Destinations hold the complement of what must arrive, so a byte never written
        // differs; the guard bytes around each are kept to compare after.
        let mut guards = Vec::new();
        for t in &transfers {
            let seed = region_seed(self.seed, t.remote.region);
            let mut offset = t.remote.offset;
            for p in &t.local {
                let mem = self.local[p.region].as_mut_slice();
                pattern::fill_complement(seed, offset, &mut mem[p.offset..p.offset + p.len]);
                offset += p.len;
                let end = p.offset + p.len;
                guards.push((
                    *p,
                    mem[p.offset - GUARD..p.offset].to_vec(),
                    mem[end..end + GUARD].to_vec(),
                ));
            }
        }
        let requests = transfers
            .iter()
            .map(|t| {
                let sges = local_sges(&self.local, t)?;
                let (addr, rkey) = self.remote[t.remote.region];
                let mut r = SendRequest::read(t.wr_id, sges, addr + t.remote.offset as u64, rkey);
                r.signaled = t.signaled;
                Ok(r)
            })
            .collect::<Result<Vec<_>, VerbsError>>()?;
        if batch.post_as_list {
            self.qp.post_send(&requests)?;
        } else {
            for r in &requests {
                self.qp.post_send(std::slice::from_ref(r))?;
            }
        }
        let signaled: Vec<_> = transfers.iter().filter(|t| t.signaled).collect();
        let qpn = self.qp.qp_num();
        let verbs = Arc::clone(&self.verbs);
        let cq = &self.cq;
        wait_for(
            |wc| cq.poll(wc),
            "send",
            &signaled,
            self.timeout,
            report,
            |wc, t| check_send_completion(&verbs, wc, t, qpn),
        )?;
        let mut wc = [ibv_wc::default(); 4];
        let extra = self.cq.poll(&mut wc)?;
        if extra > 0 {
            return Err(CheckError::Completion {
                queue: "send",
                detail: format!(
                    "{extra} completion(s) beyond one per signaled request, first wr_id {:#x}",
                    wc[0].wr_id
                ),
            }
            .into());
        }
        report.send_completions += signaled.len() as u64;
        for t in &transfers {
            let seed = region_seed(self.seed, t.remote.region);
            let mut offset = t.remote.offset;
            let mut bad = Vec::new();
            for p in &t.local {
                if let Some(m) = pattern::check(seed, offset, self.local_bytes(p)) {
                    bad.push(format!(
                        "{} bytes differ from remote offset {} (expected {:#04x}, found {:#04x})",
                        m.bytes, m.first_offset, m.expected, m.found
                    ));
                }
                offset += p.len;
            }
            if !bad.is_empty() {
                report.mismatched_transfers += 1;
                report.problem(format!(
                    "READ of {} bytes from region {} offset {} in {} SGE(s), wr_id {:#x}: {}",
                    t.len(),
                    t.remote.region,
                    t.remote.offset,
                    t.local.len(),
                    t.wr_id,
                    bad.join("; ")
                ));
            }
            report.transfers += 1;
            report.reads += 1;
            report.bytes += t.len() as u64;
            report.unsignaled += u64::from(!t.signaled);
        }
        for (p, before, after) in guards {
            let mem = self.local[p.region].as_slice();
            let end = p.offset + p.len;
            if mem[p.offset - GUARD..p.offset] != before[..] || mem[end..end + GUARD] != after[..] {
                report.overruns += 1;
                report.problem(format!("bytes next to the local range {p:?} changed"));
            }
        }
        self.conn
            .write_all(&[PROGRESS])
            .map_err(io("telling the server a batch ended"))?;
        Ok(())
    }

    /// Ends the run: tells the server, and returns whether it found its regions intact.
    pub fn finish(mut self) -> Result<bool, AcrossError> {
        self.conn
            .write_all(&[DONE])
            .map_err(io("telling the server the run ended"))?;
        let mut verdict = [0u8; 1];
        self.conn
            .read_exact(&mut verdict)
            .map_err(io("reading the server's verdict"))?;
        Ok(verdict[0] == 1)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn hello() -> Hello {
        Hello {
            endpoint: Endpoint {
                qp_num: 0x11,
                psn: 0x2468,
                lid: 0,
                gid: [7; 16],
            },
            seed: 42,
            region_len: 1 << 20,
            regions: 2,
        }
    }

    #[test]
    fn a_hello_survives_the_wire() {
        let bytes: [u8; HELLO_LEN] = hello().encode().try_into().unwrap();
        assert_eq!(Hello::decode(&bytes).unwrap(), hello());
    }

    /// The server allocates what the hello asks for: counts and sizes beyond the caps,
    /// and a stranger's bytes, are refused naming the field.
    #[test]
    fn a_hello_out_of_range_is_refused_naming_the_field() {
        for (h, field) in [
            (
                Hello {
                    regions: 0,
                    ..hello()
                },
                "regions",
            ),
            (
                Hello {
                    regions: MAX_REGIONS + 1,
                    ..hello()
                },
                "regions",
            ),
            (
                Hello {
                    region_len: MAX_REGION_LEN + 1,
                    ..hello()
                },
                "region_len",
            ),
            (
                Hello {
                    region_len: 1,
                    ..hello()
                },
                "region_len",
            ),
        ] {
            let bytes: [u8; HELLO_LEN] = h.encode().try_into().unwrap();
            let e = Hello::decode(&bytes).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let mut bytes: [u8; HELLO_LEN] = hello().encode().try_into().unwrap();
        bytes[0] = b'G';
        assert!(Hello::decode(&bytes).is_err());
    }

    #[test]
    fn regions_of_one_run_hold_different_patterns() {
        let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
        pattern::fill(region_seed(5, 0), 0, &mut a);
        pattern::fill(region_seed(5, 1), 0, &mut b);
        assert_ne!(a, b, "a READ from the wrong region must not pass");
    }
}
