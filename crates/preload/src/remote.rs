//! Where the process's flow goes: the remote end of its RC queue pairs, learnt when one
//! moves to RTR, and whether it posts READs. The follower reports both to `justitiad`,
//! which tells the peer host's daemon (remote READs are counted, and paced, by the host
//! whose RNIC sends their data).
//!
//! `ibv_modify_qp` to RTR carries the address vector (`IBV_QP_AV`: the destination GID
//! when the route is global, as on RoCE, else the destination LID) and the remote QP
//! number (`IBV_QP_DEST_QPN`); rdma_cm connects through `ibv_modify_qp` too, so both ways
//! are seen here. The process's flow is one (see `follow`): the end recorded is that of the
//! latest RC QP connected, the peer of an application that talks to one host.
//!
//! Invariants: recording never fails a verb and never blocks one for longer than a
//! poisoned-tolerant mutex held for a 24-byte copy; [`saw_read`] is one relaxed load (and
//! a store the first time).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use justitia_verbs::sys::*;

/// A QP's remote end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct End {
    /// The destination GID (all zero when addressed by LID alone).
    pub gid: [u8; 16],
    /// The destination LID (0 when a GID is given).
    pub lid: u16,
    /// The remote QP number.
    pub qpn: u32,
}

/// What the process has seen: the latest remote end and whether a READ was posted.
#[derive(Debug, Default)]
pub struct Seen {
    end: Mutex<Option<End>>,
    reads: AtomicBool,
}

/// The process's record.
static SEEN: Seen = Seen::new();

/// The remote end an RC queue pair's successful move to RTR with `attr` and `mask` gives
/// it (its GID when routed globally, else its LID, and its QP number); `None` for any
/// other move, another QP type, or an end with neither GID nor LID.
pub fn end_of(qp: &ibv_qp, attr: &ibv_qp_attr, mask: u32) -> Option<End> {
    let wanted = IBV_QP_STATE | IBV_QP_AV | IBV_QP_DEST_QPN;
    if qp.qp_type != IBV_QPT_RC || mask & wanted != wanted || attr.qp_state != IBV_QPS_RTR {
        return None;
    }
    let ah = &attr.ah_attr;
    let end = if ah.is_global != 0 {
        End {
            // SAFETY: every bit pattern of the union is a valid byte array.
            gid: unsafe { ah.grh.dgid.raw },
            lid: 0,
            qpn: attr.dest_qp_num,
        }
    } else {
        End {
            gid: [0; 16],
            lid: ah.dlid,
            qpn: attr.dest_qp_num,
        }
    };
    (end.gid != [0; 16] || end.lid != 0).then_some(end)
}

impl Seen {
    /// Nothing seen yet.
    pub const fn new() -> Self {
        Seen {
            end: Mutex::new(None),
            reads: AtomicBool::new(false),
        }
    }

    /// See [`on_modify`].
    pub fn modified(&self, qp: &ibv_qp, attr: &ibv_qp_attr, mask: u32) {
        let Some(end) = end_of(qp, attr, mask) else {
            return;
        };
        match self.end.lock() {
            Ok(mut g) => *g = Some(end),
            Err(poisoned) => *poisoned.into_inner() = Some(end),
        }
    }

    /// See [`saw_read`].
    #[inline]
    pub fn read(&self) {
        if !self.reads.load(Ordering::Relaxed) {
            self.reads.store(true, Ordering::Relaxed);
        }
    }

    /// See [`snapshot`].
    pub fn snapshot(&self) -> Option<(End, bool)> {
        let end = match self.end.lock() {
            Ok(g) => *g,
            Err(poisoned) => *poisoned.into_inner(),
        }?;
        Some((end, self.reads.load(Ordering::Relaxed)))
    }
}

/// A successful `ibv_modify_qp` of `qp` with `attr` and `mask`: records the remote end of
/// an RC QP moving to RTR.
pub fn on_modify(qp: &ibv_qp, attr: &ibv_qp_attr, mask: u32) {
    SEEN.modified(qp, attr, mask);
}

/// A READ was posted. The process's one flow is then reported as a READ requester (a
/// process that WRITEs and READs is counted as its READs are: at the peer).
#[inline]
pub fn saw_read() {
    SEEN.read();
}

/// The remote end and whether READs were posted, for the follower.
pub fn snapshot() -> Option<(End, bool)> {
    SEEN.snapshot()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_rc_qp_moving_to_rtr_records_its_remote_end_and_others_do_not() {
        // Its own record: the process's is the other tests' (the mock provider's QPs).
        let seen = Seen::new();
        // SAFETY: plain C structs, all zero is valid.
        let mut qp: ibv_qp = unsafe { std::mem::zeroed() };
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        qp.qp_type = IBV_QPT_UD;
        attr.qp_state = IBV_QPS_RTR;
        attr.dest_qp_num = 0x42;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid.raw = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];
        let mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_DEST_QPN;
        seen.modified(&qp, &attr, mask);
        assert_eq!(seen.snapshot(), None, "UD: no remote end");
        qp.qp_type = IBV_QPT_RC;
        seen.modified(&qp, &attr, IBV_QP_STATE | IBV_QP_AV);
        assert_eq!(seen.snapshot(), None, "no destination QPN in the mask");
        seen.modified(&qp, &attr, mask);
        let (end, reads) = seen.snapshot().unwrap();
        assert_eq!(end.gid[12..], [10, 0, 0, 2]);
        assert_eq!((end.lid, end.qpn), (0, 0x42));
        assert!(!reads);
        // InfiniBand without a global route: the LID.
        attr.ah_attr.is_global = 0;
        attr.ah_attr.dlid = 12;
        seen.modified(&qp, &attr, mask);
        assert_eq!(seen.snapshot().unwrap().0.lid, 12);
        seen.read();
        assert!(seen.snapshot().unwrap().1);
    }
}
