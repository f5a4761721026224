//! The two ways the checker posts its requests: the classic `ibv_post_send`, or the
//! extended send interface of a QP created with `ibv_create_qp_ex` and send-ops flags
//! (`ibv_wr_start`, `ibv_wr_rdma_write`, `ibv_wr_set_sge_list`, ..., `ibv_wr_complete`),
//! which is what perftest uses by default on Soft-RoCE. The shaper intercepts the two
//! separately, so each needs its own byte-level check.
//!
//! Both post the same [`SendRequest`]s: the planner, the verification and the report do not
//! depend on the interface, so one seed gives the same transfers with either.
//!
//! Known provider bug: rxe's `ibv_wr_set_sge_list` in rdma-core before the fix of PR #1744
//! (Debian bookworm ships rdma-core 44) takes `num_sge` times the *first* SGE's length as the
//! request's length, so on rxe's own `ibv_wr_*` verbs (no shaper, or a shaper that only
//! observes) a request of several SGEs of different lengths completes with a local
//! protection or QP operation error. `--max-sges 1` avoids it there. Posting the same seed
//! with `post-send` tells such a failure from one of the checker.

use std::ffi::c_int;
use std::io;
use std::ptr::NonNull;

use justitia_verbs::sys::*;
use justitia_verbs::{
    CompletionQueue, ProtectionDomain, QpCaps, QueuePair, SendRequest, VerbsError,
};

/// How the requester's work requests are posted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum PostApi {
    /// `ibv_post_send` on a QP from `ibv_create_qp`: one linked list per batch posted as a
    /// list, one call per request otherwise.
    #[default]
    PostSend,
    /// The extended send interface on a QP from `ibv_create_qp_ex` with send-ops flags:
    /// `wr_id` and `wr_flags` set on the `ibv_qp_ex` before each request, one
    /// `ibv_wr_start` ... `ibv_wr_complete` wherever `post-send` makes one `ibv_post_send`
    /// call.
    Wr,
}

impl PostApi {
    /// The option value that selects this interface (`post-send` or `wr`).
    pub fn as_str(self) -> &'static str {
        match self {
            PostApi::PostSend => "post-send",
            PostApi::Wr => "wr",
        }
    }

    /// A description for the log.
    pub fn describe(self) -> &'static str {
        match self {
            PostApi::PostSend => "ibv_post_send on a QP from ibv_create_qp",
            PostApi::Wr => {
                "ibv_wr_start / ibv_wr_rdma_* / ibv_wr_set_sge_list / ibv_wr_complete \
                 on a QP from ibv_create_qp_ex"
            }
        }
    }
}

/// The send-ops flags (`IBV_QP_EX_WITH_*`) the requester needs: RDMA WRITE and READ, and
/// WRITE_WITH_IMM when the plan draws it.
pub fn send_ops_flags(with_imm: bool) -> u64 {
    let mut flags = u64::from(IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ);
    if with_imm {
        flags |= u64::from(IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM);
    }
    flags
}

/// The names of the `IBV_QP_EX_WITH_*` flags in `flags` that the checker may ask for.
pub fn send_ops_names(flags: u64) -> String {
    let names = [
        (IBV_QP_EX_WITH_RDMA_WRITE, "RDMA_WRITE"),
        (IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM, "RDMA_WRITE_WITH_IMM"),
        (IBV_QP_EX_WITH_RDMA_READ, "RDMA_READ"),
    ];
    names
        .iter()
        .filter(|(bit, _)| flags & u64::from(*bit) != 0)
        .map(|(_, name)| *name)
        .collect::<Vec<_>>()
        .join("|")
}

/// Creates the requester's RC queue pair for the extended send interface: with
/// `ibv_create_qp_ex` and the send ops of [`send_ops_flags`], completions on `send_cq` and
/// `recv_cq`, and every `ibv_wr_*` verb the checker calls present. Returns the QP and its
/// `ibv_qp_ex`, or why the provider cannot give one (there is no fallback to
/// `ibv_post_send`).
pub(crate) fn create_wr_requester(
    pd: &ProtectionDomain,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    caps: QpCaps,
    with_imm: bool,
) -> Result<(QueuePair, NonNull<ibv_qp_ex>), String> {
    let qp = QueuePair::create_rc_ex(pd, send_cq, recv_cq, caps, send_ops_flags(with_imm))
        .map_err(|e| e.to_string())?;
    let qpx = qp
        .extended()
        .ok_or("ibv_qp_to_qp_ex returned NULL: the QP has no extended send interface")?;
    // SAFETY: qpx is the live QP's extended form, held alive by qp.
    let missing = missing_verbs(unsafe { qpx.as_ref() }, with_imm);
    if !missing.is_empty() {
        return Err(format!(
            "the QP's extended send interface lacks {}",
            missing.join(", ")
        ));
    }
    Ok((qp, qpx))
}

/// The `ibv_wr_*` verbs the checker calls that `qpx` lacks, by name (`ibv_wr_abort` is
/// only a courtesy and not required).
fn missing_verbs(qpx: &ibv_qp_ex, with_imm: bool) -> Vec<&'static str> {
    let have = [
        ("ibv_wr_start", qpx.wr_start.is_some()),
        ("ibv_wr_complete", qpx.wr_complete.is_some()),
        ("ibv_wr_rdma_write", qpx.wr_rdma_write.is_some()),
        ("ibv_wr_rdma_read", qpx.wr_rdma_read.is_some()),
        (
            "ibv_wr_rdma_write_imm",
            !with_imm || qpx.wr_rdma_write_imm.is_some(),
        ),
        ("ibv_wr_set_sge_list", qpx.wr_set_sge_list.is_some()),
    ];
    have.iter()
        .filter(|(_, present)| !present)
        .map(|(name, _)| *name)
        .collect()
}

/// A verb's integer result as a `Result` (rdma-core returns the error number itself).
fn verb_result(rc: c_int, verb: &str) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(VerbsError::Verb {
            verb: verb.to_string(),
            source: io::Error::from_raw_os_error(rc.abs()),
        })
    }
}

/// The error for a needed `ibv_wr_*` pointer that is empty.
fn absent(verb: &str) -> VerbsError {
    VerbsError::Verb {
        verb: verb.to_string(),
        source: io::Error::new(
            io::ErrorKind::Unsupported,
            "the QP's extended send interface has no such verb",
        ),
    }
}

/// Posts `requests` in order through the extended send interface of `qpx`, as the
/// inline `ibv_wr_*` functions of `<infiniband/verbs.h>` do: one `ibv_wr_start`, then for
/// each request its `wr_id` and `wr_flags` (`IBV_SEND_SIGNALED` when it asks for a
/// completion, plus its extra flags) stored in the object, the opcode's verb
/// (`ibv_wr_rdma_write`, `ibv_wr_rdma_write_imm` with the immediate in network order, or
/// `ibv_wr_rdma_read`) and `ibv_wr_set_sge_list`, then one `ibv_wr_complete`. Each
/// function pointer is read from the object when it is called.
///
/// Requests are checked before `ibv_wr_start` (known opcode, SGE count, every needed verb
/// present), so a refusal posts nothing; a failed `ibv_wr_complete` is reported with its
/// error number and, per rdma-core, posted nothing of the batch either. An empty slice
/// calls nothing.
///
/// # Safety
/// `qpx` must point to the live extended form of a QP, not used by another thread during
/// the call; the SGEs must name registered memory.
pub(crate) unsafe fn post_wr(
    qpx: *mut ibv_qp_ex,
    requests: &[SendRequest],
) -> Result<(), VerbsError> {
    if requests.is_empty() {
        return Ok(());
    }
    // SAFETY: guaranteed by the caller.
    let q = unsafe { &*qpx };
    for (i, r) in requests.iter().enumerate() {
        let (present, verb) = match r.opcode {
            IBV_WR_RDMA_WRITE => (q.wr_rdma_write.is_some(), "ibv_wr_rdma_write"),
            IBV_WR_RDMA_WRITE_WITH_IMM => (q.wr_rdma_write_imm.is_some(), "ibv_wr_rdma_write_imm"),
            IBV_WR_RDMA_READ => (q.wr_rdma_read.is_some(), "ibv_wr_rdma_read"),
            other => {
                return Err(VerbsError::InvalidArgument(format!(
                    "request {i} of {} has opcode {other}, which the checker does not post \
                     through ibv_wr_*",
                    requests.len()
                )))
            }
        };
        if !present {
            return Err(absent(verb));
        }
        if r.sges.is_empty() {
            return Err(VerbsError::InvalidArgument(format!(
                "request {i} of {} has no SGE",
                requests.len()
            )));
        }
    }
    for (present, verb) in [
        (q.wr_start.is_some(), "ibv_wr_start"),
        (q.wr_complete.is_some(), "ibv_wr_complete"),
        (q.wr_set_sge_list.is_some(), "ibv_wr_set_sge_list"),
    ] {
        if !present {
            return Err(absent(verb));
        }
    }

    // SAFETY: qpx is live and ours for the call (caller); each pointer is read from it
    // just before its call, as the header's inline verbs do, and was checked present
    // above; every SGE list lives until the call that reads it returns.
    let rc = unsafe {
        if let Some(start) = (*qpx).wr_start {
            start(qpx);
        }
        for r in requests {
            (*qpx).wr_id = r.wr_id;
            (*qpx).wr_flags = r.extra_flags | if r.signaled { IBV_SEND_SIGNALED } else { 0 };
            let op_verb = match r.opcode {
                IBV_WR_RDMA_WRITE => (*qpx).wr_rdma_write.map(|f| f(qpx, r.rkey, r.remote_addr)),
                IBV_WR_RDMA_WRITE_WITH_IMM => (*qpx)
                    .wr_rdma_write_imm
                    .map(|f| f(qpx, r.rkey, r.remote_addr, r.imm_data.to_be())),
                _ => (*qpx).wr_rdma_read.map(|f| f(qpx, r.rkey, r.remote_addr)),
            };
            let sge_verb = op_verb
                .and_then(|()| (*qpx).wr_set_sge_list)
                .map(|f| f(qpx, r.sges.len(), r.sges.as_ptr()));
            if sge_verb.is_none() {
                // A pointer was cleared after the checks: the batch cannot be posted as asked.
                if let Some(abort) = (*qpx).wr_abort {
                    abort(qpx);
                }
                return Err(absent(
                    "ibv_wr_* (a verb pointer was cleared during the batch)",
                ));
            }
        }
        match (*qpx).wr_complete {
            Some(complete) => complete(qpx),
            None => {
                if let Some(abort) = (*qpx).wr_abort {
                    abort(qpx);
                }
                return Err(absent("ibv_wr_complete"));
            }
        }
    };
    verb_result(rc, &format!("ibv_wr_complete({} requests)", requests.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// One call the fake extended QP received, with the `wr_id` and `wr_flags` it held when
    /// a request was started (as a provider reads them).
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Call {
        Start,
        Write {
            wr_id: u64,
            flags: u32,
            rkey: u32,
            addr: u64,
        },
        WriteImm {
            wr_id: u64,
            flags: u32,
            rkey: u32,
            addr: u64,
            imm_be: u32,
        },
        Read {
            wr_id: u64,
            flags: u32,
            rkey: u32,
            addr: u64,
        },
        Sges(Vec<(u64, u32, u32)>),
        Complete,
        Abort,
    }

    thread_local! {
        static CALLS: RefCell<Vec<Call>> = const { RefCell::new(Vec::new()) };
        static COMPLETE_RC: RefCell<c_int> = const { RefCell::new(0) };
    }

    fn record(call: Call) {
        CALLS.with(|c| c.borrow_mut().push(call));
    }

    fn take_calls() -> Vec<Call> {
        CALLS.with(|c| std::mem::take(&mut *c.borrow_mut()))
    }

    fn ids(qp: *mut ibv_qp_ex) -> (u64, u32) {
        // SAFETY: the tests pass their own live fake.
        unsafe { ((*qp).wr_id, (*qp).wr_flags) }
    }

    unsafe extern "C" fn start(_: *mut ibv_qp_ex) {
        record(Call::Start);
    }
    unsafe extern "C" fn complete(_: *mut ibv_qp_ex) -> c_int {
        record(Call::Complete);
        COMPLETE_RC.with(|rc| *rc.borrow())
    }
    unsafe extern "C" fn abort(_: *mut ibv_qp_ex) {
        record(Call::Abort);
    }
    unsafe extern "C" fn write(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
        let (wr_id, flags) = ids(qp);
        record(Call::Write {
            wr_id,
            flags,
            rkey,
            addr,
        });
    }
    unsafe extern "C" fn write_imm(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, imm_be: __be32) {
        let (wr_id, flags) = ids(qp);
        record(Call::WriteImm {
            wr_id,
            flags,
            rkey,
            addr,
            imm_be,
        });
    }
    unsafe extern "C" fn read(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
        let (wr_id, flags) = ids(qp);
        record(Call::Read {
            wr_id,
            flags,
            rkey,
            addr,
        });
    }
    unsafe extern "C" fn sge_list(_: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
        // SAFETY: post_wr passes n readable entries.
        let sges = unsafe { std::slice::from_raw_parts(list, n) };
        record(Call::Sges(
            sges.iter().map(|s| (s.addr, s.length, s.lkey)).collect(),
        ));
    }

    fn fake() -> ibv_qp_ex {
        ibv_qp_ex {
            wr_start: Some(start),
            wr_complete: Some(complete),
            wr_abort: Some(abort),
            wr_rdma_write: Some(write),
            wr_rdma_write_imm: Some(write_imm),
            wr_rdma_read: Some(read),
            wr_set_sge_list: Some(sge_list),
            ..Default::default()
        }
    }

    fn sge(addr: u64, length: u32) -> ibv_sge {
        ibv_sge {
            addr,
            length,
            lkey: 0x77,
        }
    }

    fn post(qpx: &mut ibv_qp_ex, requests: &[SendRequest]) -> Result<(), VerbsError> {
        take_calls();
        // SAFETY: a live fake whose verbs only record.
        unsafe { post_wr(qpx, requests) }
    }

    #[test]
    fn a_batch_is_one_start_and_one_complete_with_ids_and_flags_set_per_request() {
        let mut write = SendRequest::write(1, vec![sge(0x1000, 10), sge(0x2000, 5)], 0xa000, 9);
        write.signaled = false;
        let mut imm = SendRequest::write(u64::MAX, vec![sge(0x3000, 7)], 0xb000, 8);
        imm.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        imm.imm_data = 0x1122_3344;
        imm.signaled = false;
        let read = SendRequest::read(0, vec![sge(0x4000, 1)], 0xc000, 7);
        let mut qpx = fake();
        assert!(post(&mut qpx, &[write, imm, read]).is_ok());
        let s = IBV_SEND_SIGNALED;
        assert_eq!(
            take_calls(),
            vec![
                Call::Start,
                Call::Write {
                    wr_id: 1,
                    flags: 0,
                    rkey: 9,
                    addr: 0xa000
                },
                Call::Sges(vec![(0x1000, 10, 0x77), (0x2000, 5, 0x77)]),
                Call::WriteImm {
                    wr_id: u64::MAX,
                    flags: 0,
                    rkey: 8,
                    addr: 0xb000,
                    imm_be: 0x1122_3344u32.to_be(),
                },
                Call::Sges(vec![(0x3000, 7, 0x77)]),
                Call::Read {
                    wr_id: 0,
                    flags: s,
                    rkey: 7,
                    addr: 0xc000
                },
                Call::Sges(vec![(0x4000, 1, 0x77)]),
                Call::Complete,
            ]
        );
    }

    #[test]
    fn a_failed_complete_is_reported_with_its_error() {
        let mut qpx = fake();
        COMPLETE_RC.with(|rc| *rc.borrow_mut() = 12); // ENOMEM
        let result = post(&mut qpx, &[SendRequest::write(3, vec![sge(1, 1)], 2, 3)]);
        COMPLETE_RC.with(|rc| *rc.borrow_mut() = 0);
        let text = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("ibv_wr_complete(1 requests)"), "{text}");
        assert!(text.contains("os error 12"), "{text}");
        assert_eq!(take_calls().last(), Some(&Call::Complete));
    }

    #[test]
    fn refused_batches_call_nothing() {
        let mut qpx = fake();
        // Nothing to post.
        assert!(post(&mut qpx, &[]).is_ok());
        assert_eq!(take_calls(), vec![]);
        // An opcode the checker never posts this way.
        let ok = SendRequest::write(1, vec![sge(1, 1)], 2, 3);
        let send = SendRequest::send(2, vec![sge(1, 1)]);
        let text = post(&mut qpx, &[ok.clone(), send])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(text.contains("request 1 of 2"), "{text}");
        assert_eq!(take_calls(), vec![]);
        // No SGE.
        let empty = SendRequest::read(4, Vec::new(), 2, 3);
        assert!(post(&mut qpx, &[empty]).is_err());
        assert_eq!(take_calls(), vec![]);
        // A verb the provider left out.
        qpx.wr_rdma_read = None;
        let read = SendRequest::read(5, vec![sge(1, 1)], 2, 3);
        let text = post(&mut qpx, &[ok.clone(), read])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(text.contains("ibv_wr_rdma_read"), "{text}");
        assert_eq!(take_calls(), vec![]);
        // But a batch that does not need it still goes.
        assert!(post(&mut qpx, &[ok]).is_ok());
        assert_eq!(take_calls().len(), 4);
    }

    #[test]
    fn extra_flags_are_kept_next_to_signaled() {
        let mut qpx = fake();
        let mut r = SendRequest::write(6, vec![sge(1, 1)], 2, 3);
        r.extra_flags = IBV_SEND_FENCE;
        assert!(post(&mut qpx, &[r]).is_ok());
        assert!(take_calls().contains(&Call::Write {
            wr_id: 6,
            flags: IBV_SEND_FENCE | IBV_SEND_SIGNALED,
            rkey: 3,
            addr: 2
        }));
    }

    #[test]
    fn the_qp_asks_only_for_the_operations_it_posts() {
        let all = send_ops_flags(true);
        let no_imm = send_ops_flags(false);
        assert_eq!(
            all,
            u64::from(
                IBV_QP_EX_WITH_RDMA_WRITE
                    | IBV_QP_EX_WITH_RDMA_READ
                    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
            )
        );
        assert_eq!(no_imm & u64::from(IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM), 0);
        assert_eq!(
            send_ops_names(all),
            "RDMA_WRITE|RDMA_WRITE_WITH_IMM|RDMA_READ"
        );
        assert_eq!(send_ops_names(no_imm), "RDMA_WRITE|RDMA_READ");
    }

    #[test]
    fn a_qp_lacking_a_needed_verb_is_refused() {
        let full = fake();
        assert!(missing_verbs(&full, true).is_empty());
        let bare = ibv_qp_ex {
            wr_rdma_write_imm: None,
            wr_abort: None,
            ..fake()
        };
        assert!(missing_verbs(&bare, false).is_empty());
        assert_eq!(missing_verbs(&bare, true), vec!["ibv_wr_rdma_write_imm"]);
        let none = ibv_qp_ex::default();
        assert_eq!(missing_verbs(&none, false).len(), 5);
    }

    #[test]
    fn post_api_names_match_the_option_values() {
        use clap::ValueEnum;
        for api in [PostApi::PostSend, PostApi::Wr] {
            let value = api.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(value.as_deref(), Some(api.as_str()));
        }
        assert_eq!(PostApi::default(), PostApi::PostSend);
    }
}
