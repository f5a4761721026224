//! The state the shaper keeps for the extended interfaces of one object: an extended CQ's
//! poll pointers and the poll in progress, an extended QP's `ibv_wr_*` pointers and the
//! requests collected between `ibv_wr_start` and `ibv_wr_complete`. The functions that
//! use it are the hooks in [`crate::cq_ex`] and [`crate::qp_ex`].

use std::ffi::c_int;
use std::sync::Arc;

use justitia_verbs::sys::*;

use super::QpShared;

pub(crate) type ReadU32 = unsafe extern "C" fn(*mut ibv_cq_ex) -> u32;
pub(crate) type ReadU8 = unsafe extern "C" fn(*mut ibv_cq_ex) -> u8;

/// The provider's own poll pointers of one extended CQ.
#[derive(Clone, Copy)]
pub struct CqExOps {
    pub(crate) start_poll: unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_poll_cq_attr) -> c_int,
    pub(crate) next_poll: unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int,
    pub(crate) end_poll: unsafe extern "C" fn(*mut ibv_cq_ex),
    pub(crate) read_opcode: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> ibv_wc_opcode>,
    pub(crate) read_vendor_err: Option<ReadU32>,
    pub(crate) read_byte_len: Option<ReadU32>,
    pub(crate) read_imm_data: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> __be32>,
    pub(crate) read_qp_num: Option<ReadU32>,
    pub(crate) read_src_qp: Option<ReadU32>,
    pub(crate) read_wc_flags: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> std::ffi::c_uint>,
    pub(crate) read_slid: Option<ReadU32>,
    pub(crate) read_sl: Option<ReadU8>,
    pub(crate) read_dlid_path_bits: Option<ReadU8>,
    /// The CQ reports QP numbers (`IBV_WC_EX_WITH_QP_NUM`).
    pub(crate) has_qp_num: bool,
}

impl CqExOps {
    /// Saves the pointers of `cqx`, created with `wc_flags`; `None` when the provider
    /// lacks the poll verbs.
    pub fn save(cqx: &ibv_cq_ex, wc_flags: u64) -> Option<Self> {
        Some(CqExOps {
            start_poll: cqx.start_poll?,
            next_poll: cqx.next_poll?,
            end_poll: cqx.end_poll?,
            read_opcode: cqx.read_opcode,
            read_vendor_err: cqx.read_vendor_err,
            read_byte_len: cqx.read_byte_len,
            read_imm_data: cqx.read_imm_data,
            read_qp_num: cqx.read_qp_num,
            read_src_qp: cqx.read_src_qp,
            read_wc_flags: cqx.read_wc_flags,
            read_slid: cqx.read_slid,
            read_sl: cqx.read_sl,
            read_dlid_path_bits: cqx.read_dlid_path_bits,
            has_qp_num: wc_flags & u64::from(IBV_WC_EX_WITH_QP_NUM) != 0
                && cqx.read_qp_num.is_some(),
        })
    }
}

/// The poll in progress on one extended CQ.
#[derive(Default)]
pub struct Current {
    /// The provider's poll was started and not yet ended.
    pub(crate) provider_active: bool,
    /// The length to show for the provider's current entry (a split request's).
    pub(crate) byte_len: Option<u32>,
    /// The synthesized completion presented instead of a provider entry.
    pub(crate) synthetic: Option<ibv_wc>,
    /// QPs heard from in this poll, to let post more when it ends.
    pub(crate) touched: Vec<Arc<QpShared>>,
    /// QPs whose completions are held in this poll: their later ones are held behind them
    /// (see `CqShared::translate`).
    pub(crate) held_back: Vec<u32>,
    /// A completion whose QP is not known was held in this poll: every later one is held
    /// behind it.
    pub(crate) hold_all: bool,
    /// Destroyed or reset QPs (number, ring) whose completions left in the CQ the poll in
    /// progress drops as it goes; the CQ is polled for them when it ends.
    pub(crate) stale: Vec<(u32, Arc<crate::send_queue::QuickRing>)>,
}

/// The provider's own `ibv_wr_*` pointers of one QP.
#[derive(Clone, Copy)]
pub struct QpExOps(pub(crate) ibv_qp_ex);

impl QpExOps {
    /// Saves the pointers of `qpx`.
    pub fn save(qpx: &ibv_qp_ex) -> Self {
        QpExOps(*qpx)
    }
}

/// One request being collected.
#[derive(Default)]
pub(crate) struct Collected {
    pub(crate) wr: ibv_send_wr,
    pub(crate) sges: Vec<ibv_sge>,
    pub(crate) inline: Option<Vec<u8>>,
}

/// The requests between `ibv_wr_start` and `ibv_wr_complete`.
#[derive(Default)]
pub struct WrBatch {
    pub(crate) wrs: Vec<Collected>,
    /// A verb the shaper cannot express as a send request was used.
    pub(crate) unsupported: Option<&'static str>,
}
