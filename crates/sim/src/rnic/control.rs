//! The RNIC's control path: control verbs (registering a memory region, creating a queue
//! pair) run one at a time as firmware commands, each taking `rnic.reg_mr_us` or
//! `rnic.create_qp_us`. A verb that completes leaves its entries in the RNIC's caches: a
//! registered region's MPT entry and its pages' MTT entries, a created queue pair's
//! context, each evicting the least recently used. Husky (NSDI'23, §4) finds storms of
//! control verbs slowing other tenants' data verbs through these evictions: here a storm
//! of regions or queue pairs that are never used again pushes the victims' entries out.
//!
//! Invariant: `free` is when the control path finished the last verb it took, and never
//! decreases.

use crate::time::Picos;

/// A control verb: the policy core's own type, so that the verb an application issues,
/// the one a policy paces ([`justitia_core::control_verbs::ControlVerbPacer`]) and the one
/// this path runs are one thing. `RegMr` is `ibv_reg_mr` of a region of some pages;
/// `CreateQp` is `ibv_create_qp` and its transitions to ready-to-send.
pub use justitia_core::control_verbs::ControlVerb;

/// One RNIC's control path.
#[derive(Clone, Copy, Debug)]
pub(super) struct ControlPath {
    reg_mr: Picos,
    create_qp: Picos,
    /// When it finished the last verb it took.
    free: Picos,
}

impl ControlPath {
    /// A path taking `reg_mr` per region registered and `create_qp` per queue pair created.
    pub(super) fn new(reg_mr: Picos, create_qp: Picos) -> Self {
        ControlPath {
            reg_mr,
            create_qp,
            free: 0,
        }
    }

    /// A verb issued at `now`: when it completes.
    pub(super) fn take(&mut self, now: Picos, verb: ControlVerb) -> Picos {
        let cost = match verb {
            ControlVerb::RegMr => self.reg_mr,
            ControlVerb::CreateQp => self.create_qp,
        };
        let done = self.free.max(now) + cost;
        self.free = done;
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time;

    /// reg_mr 50 us, create_qp 200 us. Issued at 0: a reg_mr done at 50 us, a create_qp
    /// behind it at 250 us; at 1 ms, idle again: a reg_mr done at 1.05 ms.
    #[test]
    fn verbs_run_one_at_a_time() {
        let us = |x: f64| time::from_ns(x * 1e3);
        let mut c = ControlPath::new(us(50.0), us(200.0));
        assert_eq!(c.take(0, ControlVerb::RegMr), us(50.0));
        assert_eq!(c.take(0, ControlVerb::CreateQp), us(250.0));
        assert_eq!(c.take(us(1000.0), ControlVerb::RegMr), us(1050.0));
    }
}
