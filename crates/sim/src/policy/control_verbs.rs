//! Control verbs under a policy: each application's verbs wait for its share of the host's
//! budget, as the shaper makes `ibv_reg_mr` and `ibv_create_qp` wait with the budget the
//! daemon hands it.
//!
//! Every decision is the core's: the share is [`tenant_budget`] of the host's
//! `control_verbs_per_sec` (the tenant's weight of the weights of the tenants with an
//! application running on the host, split among the tenant's applications there, each a
//! process), and when a verb may go is a [`ControlVerbPacer`]'s answer. This driver only
//! keeps one pacer per application, tells it the share in force, and hands the verb to the
//! RNIC after the wait. A share that changes (a tenant arrives or leaves) holds from the
//! next verb, as [`ControlVerbPacer::set_budget`] says.

use std::collections::BTreeMap;
use std::time::Duration;

use justitia_core::control_verbs::{tenant_budget, ControlVerbCounts, ControlVerbPacer};

use super::justitia::{core_time, picos, JustitiaParams};
use super::{ControlCall, PolicyContext, PolicyFigures};

/// One host's control verbs, paced per application.
#[derive(Debug)]
pub(crate) struct ControlVerbShaper {
    /// The host's budget, verbs/s.
    host_per_sec: f64,
    /// Each application's burst.
    burst: u32,
    /// One pacer per application, by its index: each process holds its own share, so one
    /// application's storm never waits on another's turns.
    pacers: BTreeMap<u32, ControlVerbPacer>,
}

impl ControlVerbShaper {
    /// The shaper `params` ask for; `None` when they give no budget (the verbs then go to
    /// the RNIC as issued).
    pub(crate) fn new(params: &JustitiaParams) -> Option<Self> {
        let (host_per_sec, burst) = params.control_verb_budget()?;
        Some(ControlVerbShaper {
            host_per_sec,
            burst,
            pacers: BTreeMap::new(),
        })
    }

    /// A verb issued now: handed to the RNIC when the application's pacer lets it go.
    pub(crate) fn on_control(&mut self, ctx: &mut PolicyContext<'_>, call: ControlCall) {
        let t = call.tenant;
        let budget = tenant_budget(
            self.host_per_sec,
            self.burst,
            t.weight,
            t.total_weight,
            t.processes,
        );
        let pacer = self
            .pacers
            .entry(call.app)
            .or_insert_with(|| ControlVerbPacer::new(budget));
        if pacer.budget() != budget {
            pacer.set_budget(budget);
        }
        let now = ctx.now();
        let wait = pacer.admit(core_time(now)).wait;
        ctx.control_at(now.saturating_add(picos(wait)), call);
    }

    /// The pacers' counts summed over the host's applications.
    pub(crate) fn counts(&self) -> ControlVerbCounts {
        self.pacers.values().map(ControlVerbPacer::counts).fold(
            ControlVerbCounts::default(),
            |a, c| ControlVerbCounts {
                admitted: a.admitted + c.admitted,
                delayed: a.delayed + c.delayed,
                waited: a.waited.saturating_add(c.waited),
            },
        )
    }

    /// Adds the host's counts to `f`: verbs admitted, those told to wait, and the waits'
    /// sum in ms; nothing on a host where no application issued one.
    pub(crate) fn figures(&self, f: &mut PolicyFigures) {
        let c = self.counts();
        if c.admitted == 0 {
            return;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        f.insert("control_verbs_admitted".into(), c.admitted as f64);
        f.insert("control_verbs_delayed".into(), c.delayed as f64);
        f.insert("control_verb_wait_ms".into(), ms(c.waited));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::policy::test_host::TestHost;
    use crate::policy::TenantOnHost;
    use crate::rnic::ControlVerb;
    use crate::time;

    fn call(app: u32, weight: u32, total_weight: u64, processes: u32) -> ControlCall {
        ControlCall {
            app,
            verb: ControlVerb::RegMr,
            pages: 1,
            issued: 0,
            tenant: TenantOnHost {
                weight,
                total_weight,
                processes,
            },
        }
    }

    fn shaper(per_sec: f64, burst: u32) -> ControlVerbShaper {
        ControlVerbShaper::new(&JustitiaParams {
            control_verbs_per_sec: Some(per_sec),
            control_verb_burst: Some(burst),
            ..JustitiaParams::default()
        })
        .unwrap()
    }

    /// No budget, no shaper; a shaper that admitted nothing reports nothing.
    #[test]
    fn without_a_budget_there_is_no_shaper() {
        let mut f = PolicyFigures::new();
        shaper(1000.0, 1).figures(&mut f);
        assert!(f.is_empty());
        assert!(ControlVerbShaper::new(&JustitiaParams::default()).is_none());
        let off = JustitiaParams {
            control_verbs_per_sec: Some(0.0),
            ..JustitiaParams::default()
        };
        assert!(ControlVerbShaper::new(&off).is_none());
    }

    /// Host budget 4000 verbs/s, burst 2. A tenant of weight 1 of 4 with one process gets
    /// 1000/s: its first two verbs go at once, the third at 1 ms, the fourth at 2 ms. A
    /// tenant of weight 3 with two processes gets 3000 / 2 = 1500/s each: its process's
    /// third verb goes at 1/1500 s (666.666 us, the core's whole nanoseconds). Each
    /// application has its own pacer.
    #[test]
    fn each_application_waits_for_its_share_of_the_host_budget() {
        let mut s = shaper(4000.0, 2);
        let mut host = TestHost::new();
        for _ in 0..4 {
            let mut ctx = host.ctx();
            s.on_control(&mut ctx, call(7, 1, 4, 1));
        }
        for _ in 0..3 {
            let mut ctx = host.ctx();
            s.on_control(&mut ctx, call(8, 3, 4, 2));
        }
        let at = host.control_issues();
        let ms = |x: f64| time::from_ns(x * 1e6);
        assert_eq!(at, vec![(8, 666_666_000), (7, ms(1.0)), (7, ms(2.0))]);
        let c = s.counts();
        assert_eq!((c.admitted, c.delayed), (7, 3));
        let mut f = PolicyFigures::new();
        s.figures(&mut f);
        assert_eq!(f["control_verbs_delayed"], 3.0);
    }
}
