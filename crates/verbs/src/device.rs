//! An owning layer over the verbs objects of RC connections: open a device, allocate a
//! protection domain, register memory, create completion queues and RC queue pairs, connect
//! them, post and poll. (Unreliable datagrams over the same objects: [`crate::datagram`].)
//!
//! Each object holds a reference-counted handle to its parent, so a parent is destroyed only
//! after its last child. Objects are destroyed on drop; a failure to destroy is ignored there
//! (there is nobody left to tell), every other failure is an [`VerbsError`] that names the
//! verb. Posting and polling go through the context's function pointers ([`crate::ops`]),
//! so a shaper loaded with `LD_PRELOAD` sees them as it sees any application's.

use std::ffi::{c_int, CStr};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::error::VerbsError;
use crate::loader::Ibverbs;
use crate::ops;
use crate::sys::*;

/// The local ACK timeout [`QueuePair::connect`] sets: 14, 4.096 us x 2^14 = 67 ms, as
/// perftest's tools set it.
pub const DEFAULT_ACK_TIMEOUT: u8 = 14;

/// The largest ACK timeout: the attribute is five bits (31: 4.096 us x 2^31, 2.4 hours).
pub const MAX_ACK_TIMEOUT: u8 = 31;

/// A device as `ibv_get_device_list` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The kernel name, e.g. `rxe0`.
    pub name: String,
}

/// The capacities of a queue pair's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send requests.
    pub max_send_wr: u32,
    /// Outstanding receive requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Bytes that a send request may carry inline.
    pub max_inline_data: u32,
}

impl QpCaps {
    fn to_raw(self) -> ibv_qp_cap {
        ibv_qp_cap {
            max_send_wr: self.max_send_wr,
            max_recv_wr: self.max_recv_wr,
            max_send_sge: self.max_send_sge,
            max_recv_sge: self.max_recv_sge,
            max_inline_data: self.max_inline_data,
        }
    }

    fn from_raw(cap: ibv_qp_cap) -> Self {
        QpCaps {
            max_send_wr: cap.max_send_wr,
            max_recv_wr: cap.max_recv_wr,
            max_send_sge: cap.max_send_sge,
            max_recv_sge: cap.max_recv_sge,
            max_inline_data: cap.max_inline_data,
        }
    }
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 0,
        }
    }
}

/// What the other side of an RC connection needs to know to connect to a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The QP number.
    pub qp_num: u32,
    /// The first packet sequence number the QP sends with.
    pub psn: u32,
    /// The port's LID (InfiniBand; zero on RoCE).
    pub lid: u16,
    /// The GID at the chosen index (RoCE needs it; InfiniBand may leave it zero).
    pub gid: [u8; 16],
}

/// One send request, in the terms of `struct ibv_send_wr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// `IBV_WR_*`.
    pub opcode: ibv_wr_opcode,
    /// The local buffers, in order.
    pub sges: Vec<ibv_sge>,
    /// Ask for a completion (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
    /// Extra `IBV_SEND_*` flags (fence, solicited, inline).
    pub extra_flags: u32,
    /// Remote address of an RDMA operation.
    pub remote_addr: u64,
    /// Remote key of an RDMA operation.
    pub rkey: u32,
    /// Immediate data in host order (sent in network order), for the `*_WITH_IMM` opcodes.
    pub imm_data: u32,
}

impl SendRequest {
    /// An RDMA WRITE of `sges` to `remote_addr`/`rkey`.
    pub fn write(wr_id: u64, sges: Vec<ibv_sge>, remote_addr: u64, rkey: u32) -> Self {
        SendRequest {
            wr_id,
            opcode: IBV_WR_RDMA_WRITE,
            sges,
            signaled: true,
            extra_flags: 0,
            remote_addr,
            rkey,
            imm_data: 0,
        }
    }

    /// An RDMA READ from `remote_addr`/`rkey` into `sges`.
    pub fn read(wr_id: u64, sges: Vec<ibv_sge>, remote_addr: u64, rkey: u32) -> Self {
        SendRequest {
            opcode: IBV_WR_RDMA_READ,
            ..Self::write(wr_id, sges, remote_addr, rkey)
        }
    }

    /// A SEND of `sges`.
    pub fn send(wr_id: u64, sges: Vec<ibv_sge>) -> Self {
        SendRequest {
            opcode: IBV_WR_SEND,
            ..Self::write(wr_id, sges, 0, 0)
        }
    }
}

/// One receive request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where the received bytes go, in order.
    pub sges: Vec<ibv_sge>,
}

struct ContextInner {
    verbs: Arc<Ibverbs>,
    ctx: NonNull<ibv_context>,
    name: String,
}

// SAFETY: verbs objects may be used from any thread (rdma-core serialises inside).
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the context is open and every child holds this handle, so none is left.
        unsafe { (self.verbs.ibv_close_device)(self.ctx.as_ptr()) };
    }
}

/// An open device (`ibv_open_device`).
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

impl Context {
    /// The devices present.
    pub fn devices(verbs: &Ibverbs) -> Result<Vec<DeviceInfo>, VerbsError> {
        let (list, n) = device_list(verbs)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the list holds n live device pointers until it is freed below.
            out.push(DeviceInfo {
                name: unsafe { device_name(verbs, *list.add(i)) },
            });
        }
        // SAFETY: list came from ibv_get_device_list.
        unsafe { (verbs.ibv_free_device_list)(list) };
        Ok(out)
    }

    /// Opens the device called `name`, or the first device when `name` is `None`.
    pub fn open(verbs: Arc<Ibverbs>, name: Option<&str>) -> Result<Self, VerbsError> {
        let (list, n) = device_list(&verbs)?;
        let mut names = Vec::with_capacity(n);
        let mut chosen = None;
        for i in 0..n {
            // SAFETY: the list holds n live device pointers until it is freed below.
            let dev = unsafe { *list.add(i) };
            // SAFETY: as above.
            let dev_name = unsafe { device_name(&verbs, dev) };
            if chosen.is_none() && name.is_none_or(|want| want == dev_name) {
                chosen = Some((dev, dev_name.clone()));
            }
            names.push(dev_name);
        }
        let result = match chosen {
            None => Err(VerbsError::NoDevice {
                wanted: name.map_or_else(|| "at all".to_string(), |n| format!("named {n}")),
                found: if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                },
            }),
            Some((dev, dev_name)) => {
                // SAFETY: dev is a live device of the list, which is still allocated.
                let ctx = unsafe { (verbs.ibv_open_device)(dev) };
                match NonNull::new(ctx) {
                    None => Err(VerbsError::from_errno(format!(
                        "ibv_open_device({dev_name})"
                    ))),
                    Some(ctx) => Ok(Context {
                        inner: Arc::new(ContextInner {
                            verbs: Arc::clone(&verbs),
                            ctx,
                            name: dev_name,
                        }),
                    }),
                }
            }
        };
        // SAFETY: list came from ibv_get_device_list; an opened context outlives it.
        unsafe { (verbs.ibv_free_device_list)(list) };
        result
    }

    /// The raw context.
    pub fn as_ptr(&self) -> *mut ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The loaded verbs.
    pub fn verbs(&self) -> &Arc<Ibverbs> {
        &self.inner.verbs
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> Result<ibv_device_attr, VerbsError> {
        let mut attr = ibv_device_attr::default();
        // SAFETY: live context, writable attribute block.
        let rc = unsafe { (self.inner.verbs.ibv_query_device)(self.as_ptr(), &mut attr) };
        check(rc, "ibv_query_device").map(|()| attr)
    }

    /// The device's clock for completion time stamps, kHz (`hca_core_clock`), when it
    /// offers them (`completion_timestamp_mask` non-zero); `None` when it offers none, or
    /// has no extended query to say.
    pub fn completion_clock_khz(&self) -> Option<u64> {
        // SAFETY: every field of the attribute block is plain data; zero is a valid value.
        let mut attr: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        // SAFETY: live context, writable attribute block of the size passed.
        let rc = unsafe { ops::query_device_ex(self.as_ptr(), &mut attr) };
        (rc == 0 && attr.completion_timestamp_mask != 0 && attr.hca_core_clock != 0)
            .then_some(attr.hca_core_clock)
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<ibv_port_attr, VerbsError> {
        let mut attr = ibv_port_attr::default();
        // SAFETY: live context; the compat verb is libibverbs' ibv_query_port.
        let rc = unsafe {
            ops::query_port(
                self.as_ptr(),
                port,
                &mut attr,
                self.inner.verbs.ibv_query_port,
            )
        };
        check(rc, &format!("ibv_query_port(port {port})")).map(|()| attr)
    }

    /// The port's active MTU in bytes: the path MTU [`QueuePair::connect`] gives the
    /// queue pairs it connects on that port.
    pub fn active_mtu_bytes(&self, port: u8) -> Result<u32, VerbsError> {
        let mtu = self.query_port(port)?.active_mtu;
        mtu_bytes(mtu).ok_or_else(|| {
            VerbsError::InvalidArgument(format!("port {port} reports MTU code {mtu}"))
        })
    }

    /// `ibv_query_gid`: the GID at `index` of `port`.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], VerbsError> {
        let mut gid = ibv_gid::default();
        // SAFETY: live context, writable GID.
        let rc = unsafe {
            (self.inner.verbs.ibv_query_gid)(self.as_ptr(), port, c_int::from(index), &mut gid)
        };
        // SAFETY: every bit pattern of the union is a valid byte array.
        check(rc, &format!("ibv_query_gid(port {port}, index {index})"))
            .map(|()| unsafe { gid.raw })
    }
}

/// Gets the device list and its length.
fn device_list(verbs: &Ibverbs) -> Result<(*mut *mut ibv_device, usize), VerbsError> {
    let mut n: c_int = 0;
    // SAFETY: writes the count into n.
    let list = unsafe { (verbs.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return Err(VerbsError::from_errno("ibv_get_device_list"));
    }
    Ok((list, usize::try_from(n).unwrap_or(0)))
}

/// A device's name.
///
/// # Safety
/// `dev` must be a live device.
unsafe fn device_name(verbs: &Ibverbs, dev: *mut ibv_device) -> String {
    // SAFETY: guaranteed by the caller; the name is a NUL-terminated string in the device.
    unsafe {
        let name = (verbs.ibv_get_device_name)(dev);
        if name.is_null() {
            String::new()
        } else {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        }
    }
}

/// A verb's integer result as a `Result` (rdma-core returns the error number itself).
fn check(rc: c_int, verb: &str) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(VerbsError::from_code(verb, rc))
    }
}

struct PdInner {
    ctx: Arc<ContextInner>,
    pd: NonNull<ibv_pd>,
}

// SAFETY: see ContextInner.
unsafe impl Send for PdInner {}
// SAFETY: see ContextInner.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: no child is left (each holds this handle).
        unsafe { (self.ctx.verbs.ibv_dealloc_pd)(self.pd.as_ptr()) };
    }
}

/// A protection domain (`ibv_alloc_pd`).
#[derive(Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Context) -> Result<Self, VerbsError> {
        // SAFETY: live context.
        let pd = unsafe { (ctx.inner.verbs.ibv_alloc_pd)(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsError::from_errno("ibv_alloc_pd"))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                ctx: Arc::clone(&ctx.inner),
                pd,
            }),
        })
    }

    /// The raw protection domain.
    pub fn as_ptr(&self) -> *mut ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// The loaded verbs of the domain's device.
    pub(crate) fn verbs(&self) -> &Ibverbs {
        &self.inner.ctx.verbs
    }
}

/// A registered buffer that owns its memory (`ibv_reg_mr` over a zeroed allocation).
pub struct MemoryRegion {
    pd: Arc<PdInner>,
    mr: NonNull<ibv_mr>,
    buf: Box<[u8]>,
}

// SAFETY: the region's memory is owned; the MR handle may be used from any thread.
unsafe impl Send for MemoryRegion {}

impl MemoryRegion {
    /// Allocates `len` zeroed bytes and registers them with `access` (`IBV_ACCESS_*`).
    pub fn new(pd: &ProtectionDomain, len: usize, access: u32) -> Result<Self, VerbsError> {
        if len == 0 {
            return Err(VerbsError::InvalidArgument(
                "a memory region needs at least one byte".into(),
            ));
        }
        let mut buf = vec![0u8; len].into_boxed_slice();
        let access = c_int::try_from(access).map_err(|_| {
            VerbsError::InvalidArgument(format!("access flags {access:#x} out of range"))
        })?;
        // SAFETY: the buffer is live and owned by the region, which deregisters before
        // freeing it (Drop below).
        let mr = unsafe {
            (pd.inner.ctx.verbs.ibv_reg_mr)(pd.as_ptr(), buf.as_mut_ptr().cast(), len, access)
        };
        let mr = NonNull::new(mr)
            .ok_or_else(|| VerbsError::from_errno(format!("ibv_reg_mr({len} bytes)")))?;
        Ok(MemoryRegion {
            pd: Arc::clone(&pd.inner),
            mr,
            buf,
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// The bytes, writable. The device may read or write them while requests that name
    /// them are outstanding; callers keep to the usual verbs discipline.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Never true: a region has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The address of the first byte, as the device sees it.
    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// A scatter/gather entry for `len` bytes at `offset`, refused if it leaves the region.
    pub fn sge(&self, offset: usize, len: u32) -> Result<ibv_sge, VerbsError> {
        let end = offset.checked_add(len as usize);
        if end.is_none_or(|end| end > self.buf.len()) {
            return Err(VerbsError::InvalidArgument(format!(
                "SGE of {len} bytes at offset {offset} leaves a region of {} bytes",
                self.buf.len()
            )));
        }
        Ok(ibv_sge {
            addr: self.addr() + offset as u64,
            length: len,
            lkey: self.lkey(),
        })
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: the MR is live; the buffer is freed only after this returns.
        unsafe { (self.pd.ctx.verbs.ibv_dereg_mr)(self.mr.as_ptr()) };
    }
}

struct ChannelInner {
    ctx: Arc<ContextInner>,
    channel: NonNull<ibv_comp_channel>,
}

// SAFETY: see ContextInner.
unsafe impl Send for ChannelInner {}
// SAFETY: see ContextInner.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds this handle, so none is left.
        unsafe { (self.ctx.verbs.ibv_destroy_comp_channel)(self.channel.as_ptr()) };
    }
}

/// A completion channel (`ibv_create_comp_channel`), for event-driven polling.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl CompletionChannel {
    /// Creates a completion channel on `ctx`.
    pub fn new(ctx: &Context) -> Result<Self, VerbsError> {
        // SAFETY: live context.
        let ch = unsafe { (ctx.inner.verbs.ibv_create_comp_channel)(ctx.as_ptr()) };
        let channel =
            NonNull::new(ch).ok_or_else(|| VerbsError::from_errno("ibv_create_comp_channel"))?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ctx: Arc::clone(&ctx.inner),
                channel,
            }),
        })
    }

    /// The channel's file descriptor: readable while a completion event is pending, so an
    /// event loop can wait for completions with poll(2) instead of blocking in
    /// [`CompletionChannel::wait`].
    pub fn fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the channel is live while self is; `fd` is set by ibv_create_comp_channel
        // and never changed.
        unsafe { (*self.inner.channel.as_ptr()).fd }
    }

    /// Makes [`CompletionChannel::try_wait`] return at once when no event is pending
    /// (the channel's file descriptor gets `O_NONBLOCK`, as rdma-core documents for
    /// event loops); [`CompletionChannel::wait`] then returns `EAGAIN` instead of
    /// blocking.
    pub fn set_nonblocking(&self) -> Result<(), VerbsError> {
        let fd = self.fd();
        // SAFETY: fcntl on the channel's own descriptor, which is live while self is.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(VerbsError::from_errno(
                "fcntl(O_NONBLOCK) on a completion channel",
            ));
        }
        Ok(())
    }

    /// The next completion event if one is pending, acknowledged, on a channel made
    /// non-blocking ([`CompletionChannel::set_nonblocking`]): `None` when none is.
    pub fn try_wait(&self) -> Result<Option<*mut ibv_cq>, VerbsError> {
        match self.wait() {
            Ok(cq) => Ok(Some(cq)),
            Err(VerbsError::Verb { source, .. }) if source.raw_os_error() == Some(libc::EAGAIN) => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The next completion event, acknowledged, on a channel made non-blocking
    /// ([`CompletionChannel::set_nonblocking`]), waiting up to `timeout` for one to be
    /// pending: `None` when none came.
    pub fn wait_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<*mut ibv_cq>, VerbsError> {
        let mut pfd = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
        // SAFETY: one valid pollfd for the call. Its result is not needed: an event
        // pending or not is what `try_wait` finds.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        self.try_wait()
    }

    /// Blocks until the next completion event (`ibv_get_cq_event`), acknowledges it and
    /// returns the CQ it was for.
    pub fn wait(&self) -> Result<*mut ibv_cq, VerbsError> {
        let mut cq: *mut ibv_cq = ptr::null_mut();
        let mut cq_context = ptr::null_mut();
        let verbs = &self.inner.ctx.verbs;
        // SAFETY: live channel; the out-pointers are writable.
        let rc = unsafe {
            (verbs.ibv_get_cq_event)(self.inner.channel.as_ptr(), &mut cq, &mut cq_context)
        };
        if rc != 0 {
            return Err(VerbsError::from_errno("ibv_get_cq_event"));
        }
        // SAFETY: cq is the live CQ the event was for.
        unsafe { (verbs.ibv_ack_cq_events)(cq, 1) };
        Ok(cq)
    }
}

struct CqInner {
    ctx: Arc<ContextInner>,
    cq: NonNull<ibv_cq>,
    /// The extended CQ, when made with NIC completion time stamps: the same object
    /// (`ibv_cq_ex_to_cq` is a cast), polled through its own functions.
    ex: Option<NonNull<ibv_cq_ex>>,
    _channel: Option<Arc<ChannelInner>>,
}

// SAFETY: see ContextInner.
unsafe impl Send for CqInner {}
// SAFETY: see ContextInner.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using the CQ holds this handle, so none is left.
        unsafe { (self.ctx.verbs.ibv_destroy_cq)(self.cq.as_ptr()) };
    }
}

/// One completion read from a CQ with NIC completion time stamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// Its status (`IBV_WC_*`).
    pub status: ibv_wc_status,
    /// When the NIC completed it, in ticks of `hca_core_clock`.
    pub nic_ticks: u64,
}

/// A completion queue (`ibv_create_cq`).
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

impl CompletionQueue {
    /// Creates a CQ of at least `cqe` entries, reporting events on `channel` if given.
    pub fn new(
        ctx: &Context,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<Self, VerbsError> {
        let n = c_int::try_from(cqe)
            .map_err(|_| VerbsError::InvalidArgument(format!("CQ size {cqe} out of range")))?;
        let ch = channel.map_or(ptr::null_mut(), |c| c.inner.channel.as_ptr());
        // SAFETY: live context and channel.
        let cq =
            unsafe { (ctx.inner.verbs.ibv_create_cq)(ctx.as_ptr(), n, ptr::null_mut(), ch, 0) };
        let cq = NonNull::new(cq)
            .ok_or_else(|| VerbsError::from_errno(format!("ibv_create_cq({cqe} entries)")))?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: Arc::clone(&ctx.inner),
                cq,
                ex: None,
                _channel: channel.map(|c| Arc::clone(&c.inner)),
            }),
        })
    }

    /// Creates a CQ of at least `cqe` entries whose completions carry the NIC's
    /// completion time stamp (`ibv_create_cq_ex` with
    /// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`), in ticks of the device's `hca_core_clock`
    /// ([`Context::completion_clock_khz`]). Read them with
    /// [`CompletionQueue::poll_timestamped`]; [`CompletionQueue::poll`] works on it too.
    /// Refused by a device that offers no time stamps (Soft-RoCE: `EOPNOTSUPP` or
    /// `EINVAL`).
    pub fn new_timestamped(
        ctx: &Context,
        cqe: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<Self, VerbsError> {
        let mut attr = ibv_cq_init_attr_ex {
            cqe,
            cq_context: ptr::null_mut(),
            channel: channel.map_or(ptr::null_mut(), |c| c.inner.channel.as_ptr()),
            comp_vector: 0,
            wc_flags: u64::from(IBV_WC_EX_WITH_COMPLETION_TIMESTAMP),
            comp_mask: 0,
            flags: 0,
            parent_domain: ptr::null_mut(),
        };
        // SAFETY: live context and channel; attr is initialised, comp_mask 0 (no optional
        // field is read).
        let ex = unsafe { ops::create_cq_ex(ctx.as_ptr(), &mut attr) };
        let ex = NonNull::new(ex).ok_or_else(|| {
            VerbsError::from_errno(format!(
                "ibv_create_cq_ex({cqe} entries, with completion time stamps)"
            ))
        })?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: Arc::clone(&ctx.inner),
                cq: ex.cast(),
                ex: Some(ex),
                _channel: channel.map(|c| Arc::clone(&c.inner)),
            }),
        })
    }

    /// The CQ carries NIC completion time stamps ([`CompletionQueue::new_timestamped`]).
    pub fn is_timestamped(&self) -> bool {
        self.inner.ex.is_some()
    }

    /// Polls one completion with its NIC time stamp (`ibv_start_poll`,
    /// `ibv_wc_read_completion_ts`, `ibv_end_poll`); `None` when the CQ is empty. Only on
    /// a CQ made by [`CompletionQueue::new_timestamped`].
    pub fn poll_timestamped(&self) -> Result<Option<TimedCompletion>, VerbsError> {
        let ex = self.inner.ex.ok_or_else(|| {
            VerbsError::InvalidArgument("the CQ was made without completion time stamps".into())
        })?;
        let ex = ex.as_ptr();
        // SAFETY: a live extended CQ made by this type; its function pointers are the
        // provider's, set at creation; a poll is started and ended on this one thread.
        unsafe {
            let (Some(start), Some(end), Some(read_ts)) =
                ((*ex).start_poll, (*ex).end_poll, (*ex).read_completion_ts)
            else {
                return Err(VerbsError::InvalidArgument(
                    "the provider's extended CQ has no poll functions".into(),
                ));
            };
            let mut attr = ibv_poll_cq_attr { comp_mask: 0 };
            match start(ex, &mut attr) {
                0 => {}
                rc if rc == libc::ENOENT => return Ok(None),
                rc => return Err(VerbsError::from_code("ibv_start_poll", rc)),
            }
            let done = TimedCompletion {
                wr_id: (*ex).wr_id,
                status: (*ex).status,
                nic_ticks: read_ts(ex),
            };
            end(ex);
            Ok(Some(done))
        }
    }

    /// The raw CQ.
    pub fn as_ptr(&self) -> *mut ibv_cq {
        self.inner.cq.as_ptr()
    }

    /// Polls up to `wc.len()` completions (`ibv_poll_cq`); returns how many were written.
    pub fn poll(&self, wc: &mut [ibv_wc]) -> Result<usize, VerbsError> {
        let n = c_int::try_from(wc.len()).unwrap_or(c_int::MAX);
        // SAFETY: live CQ; wc has room for n entries.
        let got = unsafe { ops::poll_cq(self.as_ptr(), n, wc.as_mut_ptr()) };
        usize::try_from(got).map_err(|_| VerbsError::from_code("ibv_poll_cq", got))
    }

    /// Asks for an event on the channel at the next completion (`ibv_req_notify_cq`).
    pub fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError> {
        // SAFETY: live CQ.
        let rc = unsafe { ops::req_notify_cq(self.as_ptr(), c_int::from(solicited_only)) };
        check(rc, "ibv_req_notify_cq")
    }
}

struct QpInner {
    pd: Arc<PdInner>,
    qp: NonNull<ibv_qp>,
    caps: QpCaps,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
}

// SAFETY: see ContextInner.
unsafe impl Send for QpInner {}
// SAFETY: see ContextInner.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: the QP is live; its CQs and PD outlive it (held above).
        unsafe { (self.pd.ctx.verbs.ibv_destroy_qp)(self.qp.as_ptr()) };
    }
}

/// A queue pair (`ibv_create_qp`): reliable-connected ([`QueuePair::create_rc`]) or
/// unreliable-datagram ([`QueuePair::create_ud`]).
#[derive(Clone)]
pub struct QueuePair {
    inner: Arc<QpInner>,
}

impl QueuePair {
    /// Creates an RC QP whose completions go to `send_cq` and `recv_cq`, with requests
    /// signaled only when they ask to be (`sq_sig_all = 0`).
    pub fn create_rc(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<Self, VerbsError> {
        Self::create(pd, send_cq, recv_cq, caps, IBV_QPT_RC, "RC")
    }

    /// Creates a QP of type `qp_type` (`IBV_QPT_*`, called `kind` in errors) with
    /// `ibv_create_qp`, requests signaled only when they ask to be (`sq_sig_all = 0`).
    pub(crate) fn create(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
        qp_type: ibv_qp_type,
        kind: &str,
    ) -> Result<Self, VerbsError> {
        let mut attr = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: caps.to_raw(),
            qp_type,
            sq_sig_all: 0,
        };
        // SAFETY: live PD and CQs; attr is fully initialised.
        let qp = unsafe { (pd.inner.ctx.verbs.ibv_create_qp)(pd.as_ptr(), &mut attr) };
        let qp = NonNull::new(qp)
            .ok_or_else(|| VerbsError::from_errno(format!("ibv_create_qp({kind}, {caps:?})")))?;
        Ok(Self::adopt(pd, qp, attr.cap, send_cq, recv_cq))
    }

    /// As [`QueuePair::create_rc`], with `ibv_create_qp_ex` and the send-ops flags
    /// `send_ops` (`IBV_QP_EX_WITH_*`), so that the QP can also be posted to through its
    /// extended send interface ([`QueuePair::extended`]).
    pub fn create_rc_ex(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
        send_ops: u64,
    ) -> Result<Self, VerbsError> {
        let mut attr = ibv_qp_init_attr_ex {
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            cap: caps.to_raw(),
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
            comp_mask: IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
            pd: pd.as_ptr(),
            send_ops_flags: send_ops,
            ..Default::default()
        };
        // SAFETY: live context, PD and CQs; attr is initialised for every bit of comp_mask.
        let qp = unsafe { ops::create_qp_ex(pd.inner.ctx.ctx.as_ptr(), &mut attr) };
        let qp = NonNull::new(qp).ok_or_else(|| {
            VerbsError::from_errno(format!(
                "ibv_create_qp_ex(RC, {caps:?}, send ops {send_ops:#x})"
            ))
        })?;
        Ok(Self::adopt(pd, qp, attr.cap, send_cq, recv_cq))
    }

    /// Takes ownership of a QP just created on `pd` with the capacities the provider
    /// wrote back (at least those asked for).
    fn adopt(
        pd: &ProtectionDomain,
        qp: NonNull<ibv_qp>,
        granted: ibv_qp_cap,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> Self {
        QueuePair {
            inner: Arc::new(QpInner {
                pd: Arc::clone(&pd.inner),
                qp,
                caps: QpCaps::from_raw(granted),
                _send_cq: Arc::clone(&send_cq.inner),
                _recv_cq: Arc::clone(&recv_cq.inner),
            }),
        }
    }

    /// The QP's extended send interface (`ibv_qp_to_qp_ex`): its `ibv_wr_*` verbs are
    /// usable when the QP was made by [`QueuePair::create_rc_ex`] with their send ops.
    /// `None` when the provider gives none.
    pub fn extended(&self) -> Option<NonNull<ibv_qp_ex>> {
        // SAFETY: the QP is live.
        NonNull::new(unsafe { (self.inner.pd.ctx.verbs.ibv_qp_to_qp_ex)(self.as_ptr()) })
    }

    /// The raw QP.
    pub fn as_ptr(&self) -> *mut ibv_qp {
        self.inner.qp.as_ptr()
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is live.
        unsafe { (*self.as_ptr()).qp_num }
    }

    /// The capacities the provider granted.
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// This QP's endpoint on `port`, with the GID at `gid_index` and first PSN `psn`.
    pub fn endpoint(&self, port: u8, gid_index: u8, psn: u32) -> Result<Endpoint, VerbsError> {
        let ctx = Context {
            inner: Arc::clone(&self.inner.pd.ctx),
        };
        let port_attr = ctx.query_port(port)?;
        Ok(Endpoint {
            qp_num: self.qp_num(),
            psn: psn & 0xff_ffff,
            lid: port_attr.lid,
            gid: ctx.query_gid(port, gid_index)?,
        })
    }

    /// Moves the QP through INIT, RTR and RTS to talk to `remote`, using `port`, the local
    /// GID at `gid_index`, first PSN `local_psn`, and the port's active MTU. Remote WRITE,
    /// READ and atomics are allowed on this QP. The local ACK timeout is
    /// [`DEFAULT_ACK_TIMEOUT`].
    pub fn connect(
        &self,
        port: u8,
        gid_index: u8,
        local_psn: u32,
        remote: &Endpoint,
    ) -> Result<(), VerbsError> {
        self.connect_with_ack_timeout(port, gid_index, local_psn, remote, DEFAULT_ACK_TIMEOUT)
    }

    /// [`QueuePair::connect`] with the local ACK timeout `ack_timeout` (the RTS attribute
    /// `timeout`: 4.096 us x 2^`ack_timeout` before a request unacknowledged is sent again;
    /// 0 waits forever). A path whose queue holds a request longer than that makes the
    /// sender retransmit what was never lost.
    pub fn connect_with_ack_timeout(
        &self,
        port: u8,
        gid_index: u8,
        local_psn: u32,
        remote: &Endpoint,
        ack_timeout: u8,
    ) -> Result<(), VerbsError> {
        if ack_timeout > MAX_ACK_TIMEOUT {
            return Err(VerbsError::InvalidArgument(format!(
                "ACK timeout {ack_timeout} is above {MAX_ACK_TIMEOUT} (a 5-bit field)"
            )));
        }
        let ctx = Context {
            inner: Arc::clone(&self.inner.pd.ctx),
        };
        let mtu = ctx.query_port(port)?.active_mtu;

        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: IBV_ACCESS_LOCAL_WRITE
                | IBV_ACCESS_REMOTE_WRITE
                | IBV_ACCESS_REMOTE_READ
                | IBV_ACCESS_REMOTE_ATOMIC,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;

        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: mtu,
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = port;
        if remote.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = gid_index;
            attr.ah_attr.grh.hop_limit = 1;
        }
        self.modify(
            &mut attr,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;

        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            sq_psn: local_psn & 0xff_ffff,
            timeout: ack_timeout,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            IBV_QP_STATE
                | IBV_QP_SQ_PSN
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// One state transition (`ibv_modify_qp`) with the attributes in `mask`; `state` names
    /// the target state in the error.
    pub(crate) fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: u32,
        state: &str,
    ) -> Result<(), VerbsError> {
        let mask = c_int::try_from(mask).map_err(|_| {
            VerbsError::InvalidArgument(format!("QP attribute mask {mask:#x} out of range"))
        })?;
        // SAFETY: live QP; the caller initialised attr for every bit in mask.
        let rc = unsafe { (self.inner.pd.ctx.verbs.ibv_modify_qp)(self.as_ptr(), attr, mask) };
        check(rc, &format!("ibv_modify_qp({state})"))
    }

    /// Posts `requests` in order as one list (`ibv_post_send`). On failure nothing from
    /// the failing request on was posted; the error says which one failed.
    pub fn post_send(&self, requests: &[SendRequest]) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<Vec<ibv_sge>> = requests.iter().map(|r| r.sges.clone()).collect();
        let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(requests.len());
        for (r, sg) in requests.iter().zip(sges.iter_mut()) {
            let num_sge = c_int::try_from(sg.len()).map_err(|_| {
                VerbsError::InvalidArgument(format!("{} SGEs in one request", sg.len()))
            })?;
            let mut wr = ibv_send_wr {
                wr_id: r.wr_id,
                sg_list: if sg.is_empty() {
                    ptr::null_mut()
                } else {
                    sg.as_mut_ptr()
                },
                num_sge,
                opcode: r.opcode,
                send_flags: r.extra_flags | if r.signaled { IBV_SEND_SIGNALED } else { 0 },
                ..Default::default()
            };
            wr.__bindgen_anon_1.imm_data = r.imm_data.to_be();
            wr.wr.rdma.remote_addr = r.remote_addr;
            wr.wr.rdma.rkey = r.rkey;
            wrs.push(wr);
        }
        let base = wrs.as_mut_ptr();
        for i in 1..wrs.len() {
            // SAFETY: i - 1 and i are in bounds; the vector is not resized below.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the list and its SGEs live until the call returns.
        let rc = unsafe { ops::post_send(self.as_ptr(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let index = if bad.is_null() {
            0
        } else {
            // SAFETY: bad points into the list just posted.
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        Err(VerbsError::from_code(
            format!("ibv_post_send(request {index} of {})", requests.len()),
            rc,
        ))
    }

    /// Posts receive requests in order (`ibv_post_recv`).
    pub fn post_recv(&self, requests: &[RecvRequest]) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<Vec<ibv_sge>> = requests.iter().map(|r| r.sges.clone()).collect();
        let mut wrs: Vec<ibv_recv_wr> = Vec::with_capacity(requests.len());
        for (r, sg) in requests.iter().zip(sges.iter_mut()) {
            let num_sge = c_int::try_from(sg.len()).map_err(|_| {
                VerbsError::InvalidArgument(format!("{} SGEs in one request", sg.len()))
            })?;
            wrs.push(ibv_recv_wr {
                wr_id: r.wr_id,
                next: ptr::null_mut(),
                sg_list: if sg.is_empty() {
                    ptr::null_mut()
                } else {
                    sg.as_mut_ptr()
                },
                num_sge,
            });
        }
        let base = wrs.as_mut_ptr();
        for i in 1..wrs.len() {
            // SAFETY: i - 1 and i are in bounds; the vector is not resized below.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; the list and its SGEs live until the call returns.
        let rc = unsafe { ops::post_recv(self.as_ptr(), base, &mut bad) };
        check(rc, &format!("ibv_post_recv({} requests)", requests.len()))
    }
}

/// An `ibv_mtu` code in bytes (`IBV_MTU_256` is 256, each code after it doubles); `None`
/// for a code verbs does not define.
pub fn mtu_bytes(mtu: ibv_mtu) -> Option<u32> {
    (IBV_MTU_256..=IBV_MTU_4096)
        .contains(&mtu)
        .then(|| 256 << (mtu - IBV_MTU_256))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_codes_are_bytes() {
        assert_eq!(mtu_bytes(IBV_MTU_256), Some(256));
        assert_eq!(mtu_bytes(IBV_MTU_1024), Some(1024));
        assert_eq!(mtu_bytes(IBV_MTU_4096), Some(4096));
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(IBV_MTU_4096 + 1), None);
    }
}
