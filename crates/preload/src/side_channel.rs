//! The process's side channels: one UD queue pair per device port its RC queue pairs use,
//! through which two shapers of a queue pair will agree on splitting its two-sided
//! requests (`justitia_core::two_sided`). `justitiad` pairs them ([`crate::pairing`]); the
//! follower opens a side channel when the first connection on its port is to be reported.
//!
//! Each side channel is the shaper's own: a device context opened for it, a protection
//! domain, a CQ and a UD queue pair, made through libibverbs with the shaper's hooks
//! passed through (the thread holds [`crate::ffi::Reentry`]), so neither the application's
//! objects nor its device context are touched, and the application closing its context
//! or freeing its protection domain cannot pull the side channel from under the shaper.
//! A process pays one device context per port, four objects (a protection domain, a CQ, a
//! UD queue pair, a memory region) and the CQ's completion channel, which the side thread
//! waits on.
//!
//! Under an rdma cgroup (`rdma.max`), those count against the application's limits. A
//! limit with no room left would make the creation fail, which is harmless (the queue
//! pairs are not paired: their requests go whole); a limit with room for exactly the
//! application's own objects is the risk: the side channel would take room the
//! application counts on. So a side channel is made only when the cgroup's limit, if it
//! has one, leaves [`CGROUP_ROOM`] beyond what is in use ([`cgroup_has_room`]).
//!
//! Invariants: opening never runs on a verb's path (only the follower thread opens), a
//! port's opening is tried once (a failure is said once and remembered), and at most one
//! side channel is held per port.

use std::collections::HashMap;
use std::sync::Arc;

use justitia_verbs::device::{
    CompletionChannel, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCaps, QueuePair,
    RecvRequest,
};
use justitia_verbs::loader::Ibverbs;
use justitia_verbs::sys::*;
use justitia_verbs::{grh_source_gid, AddressHandle, DatagramDest, GRH_BYTES};

use crate::ffi::Reentry;
use crate::log::log;
use crate::pairing::{Port, Source};

/// The side channels' Q_Key. Its top bit is clear: a controlled Q_Key (top bit set) is
/// one only privileged processes may send with, which the daemons refuse to pair.
pub const SIDE_QKEY: u32 = 0x4a55_5354;

/// Room a side channel needs under an rdma cgroup limit: device handles (one context) and
/// objects (protection domain, CQ, queue pair, and one more so that the application is
/// never brought to its last one by the shaper).
pub const CGROUP_ROOM: (u64, u64) = (1, 4);

/// The longest datagram a side channel carries.
pub const MAX_DATAGRAM: usize = 64;

/// Bytes of one receive slot of the ring: the network header a UD receive starts with
/// and the largest datagram any path carries (an MTU of 4096), so that no datagram,
/// whoever sends it, is longer than its receive (which Soft-RoCE answers by moving the
/// queue pair to the error state).
const RECV_SLOT: usize = GRH_BYTES + 4096;

/// Bytes of one send slot of the ring.
const SEND_SLOT: usize = MAX_DATAGRAM;

/// Receives kept posted on a side channel: datagrams beyond them before the next poll are
/// dropped by the device (UD does not wait), which the senders' retries make good. With
/// the send slots, the ring takes 267 KiB a port.
const RECV_SLOTS: usize = 64;

/// Sends in flight at once on a side channel; when all are, a send first reads the
/// completions that came (keeping the datagrams among them for the reader), and one
/// beyond is refused (the protocol repeats it).
const SEND_SLOTS: usize = 128;

/// The most address handles a side channel caches (one per remote port it talks to);
/// beyond, the cache starts afresh.
const MAX_ADDRESS_HANDLES: usize = 1024;

/// Completions read from a side channel's CQ in one poll call.
const POLL_BATCH: usize = 16;

/// One datagram received on a side channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Datagram {
    /// Where it came from.
    pub source: Source,
    /// Its bytes (at most [`MAX_DATAGRAM`]).
    pub bytes: Vec<u8>,
}

/// A side channel's address, as the daemon reports it to the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideAddress {
    /// The UD queue pair's number.
    pub qpn: u32,
    /// Its Q_Key.
    pub qkey: u32,
}

/// The process's side channels, opened on first use per port.
pub trait SideChannels: Send + std::fmt::Debug {
    /// The side channel on `port`, opened now if it is not yet; an error (said by the
    /// caller, once) when it cannot be.
    fn open(&mut self, port: &Port) -> Result<SideAddress, String>;

    /// Side channels open.
    fn count(&self) -> u32;

    /// Sends `bytes` (at most [`MAX_DATAGRAM`]) from the side channel on `port` to `to`,
    /// routed from source GID index `sgid_index`. An error when the port has no side
    /// channel, its sends are all in flight, or the device refuses: datagrams may be lost
    /// anyway, and the protocol's retries make either good.
    fn send(
        &mut self,
        port: &Port,
        sgid_index: u8,
        to: &DatagramDest,
        bytes: &[u8],
    ) -> Result<(), String>;

    /// Up to `max` datagrams received on any side channel since the last call; without
    /// waiting. It takes the events pending on the side channels' completion channels
    /// and asks for the next ones first, so a datagram arriving after it returns makes
    /// one of [`SideChannels::event_fds`] readable.
    fn receive(&mut self, max: usize) -> Vec<Datagram>;

    /// File descriptors that turn readable when a datagram may have arrived (the side
    /// channels' completion channels), for the thread that reads them to wait on with
    /// poll(2) outside the lock that shares the side channels; none for side channels
    /// that can only be polled (then the thread looks every millisecond).
    fn event_fds(&self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }
}

/// The process's side channels, shared by the thread that reads them and sends what the
/// verbs leave it (`justitia-side`) and the follower that opens them. The lock is a leaf:
/// nothing else is taken under it, it is never held while waiting, and no verb takes it.
pub type SharedSideChannels = Arc<parking_lot::Mutex<Box<dyn SideChannels>>>;

/// One open side channel. Its fields are dropped in order: the address handles and the
/// queue pair before the ring, the CQ and the domain they use, the context last.
struct Open {
    /// The port it serves.
    port: Port,
    handles: HashMap<([u8; 16], u16, u8), AddressHandle>,
    qp: QueuePair,
    ring: MemoryRegion,
    cq: CompletionQueue,
    /// The CQ's completion channel (non-blocking): readable when a completion came.
    channel: CompletionChannel,
    pd: ProtectionDomain,
    _ctx: Context,
    /// Send slots not in flight.
    free_sends: Vec<usize>,
    /// Datagrams a send read off the CQ while it looked for a free slot, for the next
    /// [`SideChannels::receive`] (at most [`RECV_SLOTS`]: each took a receive slot).
    pending: Vec<Datagram>,
    /// Times the queue pair was brought back from the error state (the first is said).
    recoveries: u64,
}

impl std::fmt::Debug for Open {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Open")
            .field("qpn", &self.qp.qp_num())
            .finish()
    }
}

impl Open {
    /// Posts the receive of ring slot `slot` (below [`RECV_SLOTS`]).
    fn post_receive(&self, slot: usize) -> Result<(), String> {
        let sge = self
            .ring
            .sge(slot * RECV_SLOT, RECV_SLOT as u32)
            .map_err(|e| e.to_string())?;
        self.qp
            .post_recv(&[RecvRequest {
                wr_id: slot as u64,
                sges: vec![sge],
            }])
            .map_err(|e| e.to_string())
    }

    fn send(
        &mut self,
        port: u8,
        sgid_index: u8,
        to: &DatagramDest,
        bytes: &[u8],
    ) -> Result<(), String> {
        if bytes.len() > MAX_DATAGRAM {
            return Err(format!("{} bytes is over a datagram", bytes.len()));
        }
        let key = (to.gid, to.lid, sgid_index);
        if !self.handles.contains_key(&key) {
            if self.handles.len() >= MAX_ADDRESS_HANDLES {
                self.handles.clear();
            }
            let ah =
                AddressHandle::new(&self.pd, to, port, sgid_index).map_err(|e| e.to_string())?;
            self.handles.insert(key, ah);
        }
        if self.free_sends.is_empty() {
            let mut read = std::mem::take(&mut self.pending);
            self.receive(RECV_SLOTS, &mut read);
            self.pending = read;
        }
        let slot = self.free_sends.pop().ok_or("every send is in flight")?;
        let offset = RECV_SLOTS * RECV_SLOT + slot * SEND_SLOT;
        self.ring.as_mut_slice()[offset..offset + bytes.len()].copy_from_slice(bytes);
        let sent = (|| {
            let ah = self.handles.get(&key).ok_or("no address handle")?;
            let sge = self
                .ring
                .sge(offset, bytes.len() as u32)
                .map_err(|e| e.to_string())?;
            self.qp
                .post_send_datagram(
                    (RECV_SLOTS + slot) as u64,
                    sge,
                    ah,
                    to.qpn,
                    to.qkey,
                    true,
                    false,
                )
                .map_err(|e| e.to_string())
        })();
        if sent.is_err() {
            self.free_sends.push(slot);
        }
        sent
    }

    /// Brings the queue pair back from the error state (same number, so its pairings hold):
    /// reset, up again, every send slot free and every receive posted anew.
    fn recover(&mut self, port: u8) -> Result<(), String> {
        self.qp.reset().map_err(|e| e.to_string())?;
        self.qp
            .activate_ud(port, SIDE_QKEY, 0)
            .map_err(|e| e.to_string())?;
        self.free_sends = (0..SEND_SLOTS).collect();
        (0..RECV_SLOTS).try_for_each(|slot| self.post_receive(slot))
    }

    /// Reads completions: frees the slots of sends done, and returns the datagrams that
    /// arrived (their receives posted again). A flushed completion means the queue pair
    /// went to the error state: once the completions are read, it is brought back, at most
    /// once a call.
    fn receive(&mut self, max: usize, out: &mut Vec<Datagram>) {
        let port = self.port.clone();
        // Events taken and the CQ armed again before it is polled, so that a completion
        // arriving after the poll raises the next event (none is lost between the two).
        while let Ok(Some(_)) = self.channel.try_wait() {}
        let _ = self.cq.req_notify(false);
        let mut wc = [ibv_wc::default(); POLL_BATCH];
        let mut flushed = false;
        while out.len() < max {
            let n = match self.cq.poll(&mut wc) {
                // Empty: on to the recovery, if a flush was read.
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            for c in &wc[..n] {
                flushed |= c.status == IBV_WC_WR_FLUSH_ERR;
                let Ok(slot) = usize::try_from(c.wr_id) else {
                    continue;
                };
                if slot >= RECV_SLOTS {
                    self.free_sends.push(slot - RECV_SLOTS);
                    continue;
                }
                let start = slot * RECV_SLOT;
                let len = c.byte_len as usize;
                // One longer than any message is dropped here, uncounted, as the device
                // drops one with another Q_Key: neither is a message to judge.
                if c.status == IBV_WC_SUCCESS
                    && (GRH_BYTES..=GRH_BYTES + MAX_DATAGRAM).contains(&len)
                {
                    let buf = &self.ring.as_slice()[start..start + len];
                    out.push(Datagram {
                        source: Source {
                            port: port.clone(),
                            gid: if c.wc_flags & IBV_WC_GRH != 0 {
                                grh_source_gid(&buf[..GRH_BYTES])
                            } else {
                                None
                            },
                            lid: c.slid,
                            qpn: c.src_qp,
                        },
                        bytes: buf[GRH_BYTES..].to_vec(),
                    });
                }
                // Posted again after anything but a flush (the queue pair in error, where a
                // receive posted again would only flush again: all are posted at the
                // recovery).
                if c.status != IBV_WC_WR_FLUSH_ERR {
                    let _ = self.post_receive(slot);
                }
            }
        }
        if flushed {
            let recovered = self.recover(port.number);
            self.recoveries += 1;
            if self.recoveries == 1 {
                match recovered {
                    Ok(()) => log!(
                        Info,
                        "side channel on {} port {}: its queue pair went to the error state and was brought back",
                        port.device,
                        port.number
                    ),
                    Err(e) => log!(
                        Warn,
                        "side channel on {} port {}: its queue pair went to the error state and could not be brought back ({e}); its queue pairs' SENDs and WRITEs with immediate go whole",
                        port.device,
                        port.number
                    ),
                }
            }
        }
    }
}

/// Side channels made through the real libibverbs.
#[derive(Debug, Default)]
pub struct VerbsSideChannels {
    verbs: Option<Arc<Ibverbs>>,
    open: HashMap<Port, Result<Open, String>>,
}

impl VerbsSideChannels {
    /// None open yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn make(&mut self, port: &Port) -> Result<Open, String> {
        if !cgroup_has_room(&port.device) {
            return Err(format!(
                "the rdma cgroup's limit for {} leaves no room for it",
                port.device
            ));
        }
        let verbs = match &self.verbs {
            Some(v) => Arc::clone(v),
            None => {
                let v = Arc::new(Ibverbs::load().map_err(|e| e.to_string())?);
                self.verbs = Some(Arc::clone(&v));
                v
            }
        };
        let ctx = Context::open(verbs, Some(&port.device)).map_err(|e| e.to_string())?;
        let pd = ProtectionDomain::new(&ctx).map_err(|e| e.to_string())?;
        let channel = CompletionChannel::new(&ctx).map_err(|e| e.to_string())?;
        channel.set_nonblocking().map_err(|e| e.to_string())?;
        let cq = CompletionQueue::new(&ctx, (RECV_SLOTS + SEND_SLOTS) as u32, Some(&channel))
            .map_err(|e| e.to_string())?;
        cq.req_notify(false).map_err(|e| e.to_string())?;
        let caps = QpCaps {
            max_send_wr: SEND_SLOTS as u32,
            max_recv_wr: RECV_SLOTS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = QueuePair::create_ud(&pd, &cq, &cq, caps).map_err(|e| e.to_string())?;
        qp.activate_ud(port.number, SIDE_QKEY, 0)
            .map_err(|e| e.to_string())?;
        let ring = MemoryRegion::new(
            &pd,
            RECV_SLOTS * RECV_SLOT + SEND_SLOTS * SEND_SLOT,
            IBV_ACCESS_LOCAL_WRITE,
        )
        .map_err(|e| e.to_string())?;
        let open = Open {
            port: port.clone(),
            handles: HashMap::new(),
            qp,
            ring,
            cq,
            channel,
            pd,
            _ctx: ctx,
            free_sends: (0..SEND_SLOTS).collect(),
            pending: Vec::new(),
            recoveries: 0,
        };
        for slot in 0..RECV_SLOTS {
            open.post_receive(slot)?;
        }
        Ok(open)
    }
}

impl SideChannels for VerbsSideChannels {
    fn open(&mut self, port: &Port) -> Result<SideAddress, String> {
        if !self.open.contains_key(port) {
            // The shaper's own objects: its hooks pass these verbs through.
            let _inside = Reentry::enter();
            let made = self.make(port);
            match &made {
                Ok(o) => log!(
                    Debug,
                    "side channel on {} port {}: UD queue pair {:#x}",
                    port.device,
                    port.number,
                    o.qp.qp_num()
                ),
                Err(e) => log!(
                    Warn,
                    "no side channel on {} port {} ({e}); its queue pairs' SENDs and WRITEs with immediate go whole",
                    port.device,
                    port.number
                ),
            }
            self.open.insert(port.clone(), made);
        }
        match self.open.get(port) {
            Some(Ok(o)) => Ok(SideAddress {
                qpn: o.qp.qp_num(),
                qkey: SIDE_QKEY,
            }),
            Some(Err(e)) => Err(e.clone()),
            None => Err("not opened".to_string()),
        }
    }

    fn count(&self) -> u32 {
        let n = self.open.values().filter(|o| o.is_ok()).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    fn send(
        &mut self,
        port: &Port,
        sgid_index: u8,
        to: &DatagramDest,
        bytes: &[u8],
    ) -> Result<(), String> {
        let _inside = Reentry::enter();
        match self.open.get_mut(port) {
            Some(Ok(o)) => o.send(port.number, sgid_index, to, bytes),
            _ => Err(format!(
                "no side channel on {} port {}",
                port.device, port.number
            )),
        }
    }

    fn receive(&mut self, max: usize) -> Vec<Datagram> {
        let _inside = Reentry::enter();
        let mut out = Vec::new();
        for o in self.open.values_mut().filter_map(|o| o.as_mut().ok()) {
            out.append(&mut o.pending);
            o.receive(max, &mut out);
        }
        out
    }

    fn event_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.open
            .values()
            .filter_map(|o| o.as_ref().ok())
            .map(|o| o.channel.fd())
            .collect()
    }
}

/// Whether the process's rdma cgroup leaves [`CGROUP_ROOM`] on `device`: true without a
/// cgroup v2 rdma controller, without a limit for the device, or when the files cannot be
/// read (then the creation itself is the test).
pub fn cgroup_has_room(device: &str) -> bool {
    let Some(dir) = own_cgroup_dir() else {
        return true;
    };
    let (Ok(max), Ok(current)) = (
        std::fs::read_to_string(dir.join("rdma.max")),
        std::fs::read_to_string(dir.join("rdma.current")),
    ) else {
        return true;
    };
    leaves_room(&max, &current, device)
}

/// Whether limits `max` (`rdma.max`'s text) leave [`CGROUP_ROOM`] on `device` beyond
/// usage `current` (`rdma.current`'s).
pub fn leaves_room(max: &str, current: &str, device: &str) -> bool {
    room_left(max, current, device)
        .is_none_or(|(handles, objects)| handles >= CGROUP_ROOM.0 && objects >= CGROUP_ROOM.1)
}

/// The process's cgroup v2 directory (`0::/path` in `/proc/self/cgroup`).
fn own_cgroup_dir() -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')))
}

/// Device handles and objects left on `device` under the limits of `rdma.max` given what
/// `rdma.current` says is in use; `None` when the device has no limit (no line, or both
/// `max`). A limit given without a usage line counts nothing in use.
pub fn room_left(max: &str, current: &str, device: &str) -> Option<(u64, u64)> {
    let (max_handles, max_objects) = limits_of(max, device)?;
    if max_handles.is_none() && max_objects.is_none() {
        return None;
    }
    let (used_handles, used_objects) = limits_of(current, device).unwrap_or((Some(0), Some(0)));
    let left = |max: Option<u64>, used: Option<u64>| {
        max.map_or(u64::MAX, |m| m.saturating_sub(used.unwrap_or(0)))
    };
    Some((
        left(max_handles, used_handles),
        left(max_objects, used_objects),
    ))
}

/// The `hca_handle` and `hca_object` values of `device`'s line (`None` for `max`).
fn limits_of(text: &str, device: &str) -> Option<(Option<u64>, Option<u64>)> {
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(device))?;
    let mut handles = None;
    let mut objects = None;
    for field in line.split_whitespace().skip(1) {
        let Some((key, value)) = field.split_once('=') else {
            continue;
        };
        let value = value.parse::<u64>().ok();
        match key {
            "hca_handle" => handles = value,
            "hca_object" => objects = value,
            _ => {}
        }
    }
    Some((handles, objects))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_without_a_limit_leaves_room_and_a_limit_counts_what_is_in_use() {
        let max = "rxe0 hca_handle=max hca_object=max\nmlx5_0 hca_handle=2 hca_object=10\n";
        let current = "rxe0 hca_handle=1 hca_object=7\nmlx5_0 hca_handle=1 hca_object=7\n";
        assert_eq!(room_left(max, current, "rxe0"), None, "both max");
        assert_eq!(room_left(max, current, "other"), None, "no line");
        assert_eq!(room_left(max, current, "mlx5_0"), Some((1, 3)));
        assert_eq!(room_left(max, "", "mlx5_0"), Some((2, 10)));
        let used_up = "mlx5_0 hca_handle=3 hca_object=12\n";
        assert_eq!(room_left(max, used_up, "mlx5_0"), Some((0, 0)));
        let objects_only = "mlx5_0 hca_handle=max hca_object=6\n";
        assert_eq!(
            room_left(objects_only, current, "mlx5_0"),
            Some((u64::MAX, 0))
        );
        assert!(leaves_room(max, current, "rxe0"));
        assert!(
            !leaves_room(max, current, "mlx5_0"),
            "3 objects left, 4 needed"
        );
        assert!(leaves_room(max, "", "mlx5_0"));
        assert!(!leaves_room(objects_only, current, "mlx5_0"));
    }

    #[test]
    fn the_side_channels_qkey_is_not_a_controlled_one() {
        assert_eq!(SIDE_QKEY & 0x8000_0000, 0);
    }
}
