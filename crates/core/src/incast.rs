//! The receiver's share of its link in an incast (§6.7), and the senders' pacing to it.
//!
//! In an incast the contended resource is the receiver's link, yet only the senders can
//! pace what goes into it. So the receiver B counts the flows it sees coming in (each
//! sender's daemon declares them), one *incast unit* per (sending host, tenant, class),
//! however many flows, as a host counts its own tenants: a latency unit at 1, a
//! resource-hungry one at its tenant's weight, L'+B'+T' as for the READ guarantee of §4.4.
//! It grants every unit of weight the same share of its link ([`incast_share`]):
//! `link / Σ weights`, so n units of weight 1 get 1/n each (the sharing incentive), and a
//! latency flow coming in keeps its 1/n of the link free of bandwidth flows, as a local
//! latency flow does in L/(L+B+T). Like the READ guarantee, the share is static: capacity
//! a sender leaves unused is not handed to the others (B does not know the senders'
//! demands, only their flows).
//!
//! Only an incast is divided: while every unit comes from one host, that host's own
//! uplink carries all of it and its own loop already divides it (and keeps the work
//! conservation a relaxed target gives, which a static share would take away), so B
//! grants no share.
//!
//! A sender A keeps the newest share each receiver granted it ([`IncastLimits`]), and a
//! bandwidth flow of tenant t (weight w) into B is paced at no more than `w x share`
//! divided among t's active incast flows into B ([`IncastLimits::cap`]), taken as the
//! minimum with the flow's local allotment ([`paced`]): the receiver's view only ever
//! lowers a rate. A share not renewed for the limits' lapse no longer constrains, nor does
//! one from a receiver that said it is gone ([`IncastLimits::lapsed`]): fail-open, so a
//! dead or partitioned receiver's daemon never holds a sender below its local allotment
//! for longer than the lapse.
//!
//! Invariants:
//! - [`incast_share`] is positive and finite whenever units of two hosts or more are
//!   counted, and the shares it grants sum to at most the link: `Σ wᵢ x share <= link`,
//!   each unit getting at least `wᵢ / Σ w` of it less a rounding (1/n when all weights
//!   are 1);
//! - a tenant's caps into one receiver sum to `w x share`, however many flows it has;
//! - [`paced`] and [`paced_plan`] never raise a rate, and leave an allotment with no cap
//!   as it is;
//! - a share older than the lapse at `now` is never applied, and nothing here reads a
//!   clock: `now` is handed in.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::adaptive::allotments::FlowAllotment;
use crate::control_loop::Allotment;
use crate::flow::{FlowClass, TenantId, Weight};

/// One (sending host, tenant, class) whose flows come into this host: it counts once,
/// however many flows it has: 1 for a latency unit, its tenant's weight otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IncastUnit {
    /// The sending host, in the driver's numbering (unique per host).
    pub host: u64,
    /// The tenant on that host.
    pub tenant: TenantId,
    /// The class of its flows.
    pub class: FlowClass,
    /// The tenant's weight on its host.
    pub weight: Weight,
}

impl IncastUnit {
    /// What it adds to the division: 1 for a latency unit (never shaped, it has no weight
    /// in a division), its weight for a resource-hungry one.
    pub fn weighted(&self) -> u32 {
        if self.class.is_resource_hungry() {
            self.weight.get()
        } else {
            1
        }
    }
}

/// The share of `link_bytes_per_sec` the receiver grants per unit of weight of the incast
/// units it sees: `link / Σ weights` (see [`IncastUnit::weighted`]), counting a (host,
/// tenant, class) named twice once at its larger weight. `None` when the units come from
/// fewer than two hosts (no incast: see the module documentation) or the link is not a
/// positive rate.
///
/// The result is rounded down where needed so that the granted shares never sum to more
/// than the link (see the module's invariants).
pub fn incast_share(link_bytes_per_sec: f64, units: &[IncastUnit]) -> Option<f64> {
    if !(link_bytes_per_sec.is_finite() && link_bytes_per_sec > 0.0) {
        return None;
    }
    let mut weights: BTreeMap<(u64, TenantId, FlowClass), u32> = BTreeMap::new();
    for u in units {
        let w = weights.entry((u.host, u.tenant, u.class)).or_insert(0);
        *w = (*w).max(u.weighted());
    }
    let mut hosts = weights.keys().map(|k| k.0);
    let first = hosts.next()?;
    if hosts.all(|h| h == first) {
        return None;
    }
    let total: f64 = weights.values().map(|&w| f64::from(w)).sum();
    let mut share = link_bytes_per_sec / total;
    // Division rounds to nearest: step down until the whole grant fits in the link.
    while share * total > link_bytes_per_sec {
        share = share.next_down();
    }
    Some(share)
}

/// A share a receiver sent that cannot be a rate.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("incast share from host {receiver} refused: {bytes_per_sec} bytes/s is not a rate")]
pub struct InvalidIncastShare {
    /// The receiver, in the driver's numbering.
    pub receiver: u64,
    /// The share it sent.
    pub bytes_per_sec: f64,
}

/// The shares the receivers of this host's incast flows granted it, each with when it was
/// heard (see the module documentation).
#[derive(Debug, Clone)]
pub struct IncastLimits {
    lapse: Duration,
    /// Receiver -> (bytes/s per unit of weight, when heard).
    shares: BTreeMap<u64, (f64, Duration)>,
}

impl IncastLimits {
    /// Limits whose shares lapse when not renewed for `lapse` (the peer channel's silence:
    /// the channel drops a silent peer's grant at the same time).
    pub fn new(lapse: Duration) -> Self {
        IncastLimits {
            lapse,
            shares: BTreeMap::new(),
        }
    }

    /// Takes the share `receiver` granted per unit of weight at `now`; 0 means it grants
    /// none (it counts no incast flow, e.g. not yet this host's): nothing constrains.
    /// Returns whether the share in force changed.
    pub fn grant_received(
        &mut self,
        now: Duration,
        receiver: u64,
        bytes_per_sec: f64,
    ) -> Result<bool, InvalidIncastShare> {
        if !(bytes_per_sec.is_finite() && bytes_per_sec >= 0.0) {
            return Err(InvalidIncastShare {
                receiver,
                bytes_per_sec,
            });
        }
        if bytes_per_sec == 0.0 {
            return Ok(self.shares.remove(&receiver).is_some());
        }
        let before = self.shares.insert(receiver, (bytes_per_sec, now));
        Ok(before.is_none_or(|(b, _)| b != bytes_per_sec))
    }

    /// `receiver` is gone (its daemon went silent, or this host stopped sending to it):
    /// its share no longer constrains. Returns whether one was held.
    pub fn lapsed(&mut self, receiver: u64) -> bool {
        self.shares.remove(&receiver).is_some()
    }

    /// Drops the shares not renewed within the lapse by `now`. Returns whether any was.
    pub fn expire(&mut self, now: Duration) -> bool {
        let lapse = self.lapse;
        let before = self.shares.len();
        self.shares
            .retain(|_, (_, heard)| now.saturating_sub(*heard) < lapse);
        self.shares.len() != before
    }

    /// When the oldest share lapses, if any is held: call [`expire`](Self::expire) then.
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.shares
            .values()
            .map(|&(_, heard)| heard.saturating_add(self.lapse))
            .min()
    }

    /// The share `receiver` grants per unit of weight, if one holds at `now`.
    pub fn share(&self, now: Duration, receiver: u64) -> Option<f64> {
        let &(share, heard) = self.shares.get(&receiver)?;
        (now.saturating_sub(heard) < self.lapse).then_some(share)
    }

    /// The most a flow into `receiver` may send, bytes/s: its tenant's weight times the
    /// receiver's share, divided among the tenant's `flows` active incast flows into that
    /// receiver (at least one: the flow itself). `None` when no share holds: unconstrained.
    /// A share held is positive, and so is the cap: a tiny (subnormal) share divided
    /// among flows would round to 0 B/s, which a pacer takes for a 60 s pause; it is the
    /// smallest normal rate instead, which paces slowly.
    pub fn cap(&self, now: Duration, receiver: u64, weight: Weight, flows: u32) -> Option<f64> {
        let share = self.share(now, receiver)?;
        Some((share * f64::from(weight.get()) / f64::from(flows.max(1))).max(f64::MIN_POSITIVE))
    }
}

/// The allotment a flow is paced at: its local `allotment`, lowered to `cap` bytes/s (its
/// operations in proportion) when the cap is lower; as it is without a cap. A positive
/// cap keeps positive operations positive (scaled down, they could underflow to 0, a
/// pause).
pub fn paced(allotment: Allotment, cap: Option<f64>) -> Allotment {
    match cap {
        Some(cap) if cap < allotment.bytes_per_sec => {
            let scale = cap.max(0.0) / allotment.bytes_per_sec;
            let ops_per_sec = allotment.ops_per_sec * scale;
            Allotment {
                bytes_per_sec: cap.max(0.0),
                ops_per_sec: if cap > 0.0 && allotment.ops_per_sec > 0.0 {
                    ops_per_sec.max(f64::MIN_POSITIVE)
                } else {
                    ops_per_sec
                },
                ..allotment
            }
        }
        _ => allotment,
    }
}

/// An adaptive plan's allotment for a flow ([`FlowAllotment`]) paced as [`paced`] paces the
/// loop's: lowered to `cap` bytes/s (its operations bound, if any, in proportion) when the
/// cap is lower, its chunk kept; as it is without a cap.
pub fn paced_plan(allotment: FlowAllotment, cap: Option<f64>) -> FlowAllotment {
    match cap {
        Some(cap) if cap < allotment.bytes_per_sec => {
            let scale = cap.max(0.0) / allotment.bytes_per_sec;
            FlowAllotment {
                bytes_per_sec: cap.max(0.0),
                ops_per_sec: allotment.ops_per_sec.map(|ops| ops * scale),
                ..allotment
            }
        }
        _ => allotment,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::allotment::Token;
    use crate::pacer::ReleasePhase;
    use proptest::prelude::*;

    fn unit(host: u64, tenant: u64, weight: u32) -> IncastUnit {
        IncastUnit {
            host,
            tenant: TenantId(tenant),
            class: FlowClass::Bandwidth,
            weight: Weight::new(weight).unwrap(),
        }
    }

    fn latency(host: u64, tenant: u64, weight: u32) -> IncastUnit {
        IncastUnit {
            class: FlowClass::Latency,
            ..unit(host, tenant, weight)
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn allotment(bytes_per_sec: f64) -> Allotment {
        Allotment {
            bytes_per_sec,
            ops_per_sec: bytes_per_sec / 1000.0,
            chunk_bytes: 5120,
            token: Token {
                bytes: 1 << 20,
                ops: 1000,
            },
            phase: ReleasePhase {
                offset: 0.25,
                epoch: 3,
            },
            generation: 9,
        }
    }

    /// Fig. 25's receiver: eight bandwidth senders of weight 1 and a ninth host's latency
    /// flow are nine units: a ninth of the link each, the latency flow's ninth left free.
    /// One sending host, however many flows and classes, is no incast: no share.
    #[test]
    fn n_senders_of_weight_one_get_one_nth_of_the_link() {
        let link = 9e9;
        let mut units: Vec<_> = (1..=8).map(|h| unit(h, 1000, 1)).collect();
        assert_eq!(incast_share(link, &units), Some(link / 8.0));
        units.push(latency(9, 1000, 5));
        assert_eq!(incast_share(link, &units), Some(1e9), "latency counts 1");
        assert_eq!(incast_share(link, &units[..1]), None);
        let one_host = [unit(1, 1, 1), unit(1, 2, 1), latency(1, 3, 1)];
        assert_eq!(incast_share(link, &one_host), None);
        assert_eq!(incast_share(link, &[]), None);
        assert_eq!(incast_share(0.0, &units), None);
        assert_eq!(incast_share(f64::NAN, &units), None);
    }

    /// One unit per (host, tenant, class): a tenant's second flow, or the same tenant named
    /// twice, adds nothing; the same tenant id on another host, or its latency flow, is
    /// another unit; weights add.
    #[test]
    fn units_count_per_sending_host_tenant_and_class_at_their_weight() {
        let link = 12e9;
        let twice = [unit(1, 5, 1), unit(1, 5, 3), unit(2, 5, 1)];
        // (1, 5) at its larger weight 3, and (2, 5) at 1: a quarter per unit of weight.
        assert_eq!(incast_share(link, &twice), Some(3e9));
        let weighted = [unit(1, 1, 1), unit(2, 1, 3)];
        assert_eq!(incast_share(link, &weighted), Some(3e9));
        let with_latency = [
            unit(1, 1, 1),
            latency(1, 1, 1),
            unit(2, 1, 1),
            unit(2, 1, 1),
        ];
        assert_eq!(incast_share(link, &with_latency), Some(4e9));
    }

    #[test]
    fn a_tenants_flows_split_its_share_and_paced_only_lowers() {
        let mut limits = IncastLimits::new(ms(20));
        assert_eq!(limits.grant_received(ms(1), 7, 2e9), Ok(true));
        assert_eq!(limits.grant_received(ms(2), 7, 2e9), Ok(false), "renewed");
        let w3 = Weight::new(3).unwrap();
        assert_eq!(limits.cap(ms(2), 7, w3, 2), Some(3e9));
        assert_eq!(limits.cap(ms(2), 7, w3, 0), Some(6e9), "the flow itself");
        assert_eq!(limits.cap(ms(2), 8, w3, 1), None, "no share from host 8");

        let a = allotment(5e9);
        let p = paced(a, Some(2.5e9));
        assert_eq!((p.bytes_per_sec, p.ops_per_sec), (2.5e9, 2.5e6));
        assert_eq!((p.chunk_bytes, p.phase, p.generation), (5120, a.phase, 9));
        assert_eq!(paced(a, Some(9e9)), a, "a cap above the allotment");
        assert_eq!(paced(a, None), a);
        assert_eq!(paced(allotment(0.0), Some(1e9)), allotment(0.0), "idle");

        // An adaptive plan's allotment the same way: 8e9 B/s and 4e6 ops/s capped at 2e9
        // is a quarter of each; its chunk kept; a bound on bytes alone stays none.
        let plan = FlowAllotment {
            bytes_per_sec: 8e9,
            ops_per_sec: Some(4e6),
            chunk_bytes: 94_208,
            charge: crate::message_charge::MessageCharge::NONE,
        };
        let p = paced_plan(plan, Some(2e9));
        assert_eq!((p.bytes_per_sec, p.ops_per_sec), (2e9, Some(1e6)));
        assert_eq!(p.chunk_bytes, 94_208);
        let bytes_only = FlowAllotment {
            ops_per_sec: None,
            ..plan
        };
        assert_eq!(paced_plan(bytes_only, Some(2e9)).ops_per_sec, None);
        assert_eq!(
            paced_plan(plan, Some(9e9)),
            plan,
            "a cap above the allotment"
        );
        assert_eq!(paced_plan(plan, Some(8e9)), plan, "a cap at the allotment");
        assert_eq!(paced_plan(plan, None), plan);
    }

    /// Fail-open: a share not renewed holds until just before the lapse and not at it; a
    /// receiver that grants 0, or that the channel declares gone, stops constraining at
    /// once; out-of-range shares are refused and change nothing.
    #[test]
    fn a_share_not_renewed_lapses_and_bad_shares_are_refused() {
        let mut limits = IncastLimits::new(ms(20));
        limits.grant_received(ms(10), 1, 1e9).unwrap();
        limits.grant_received(ms(15), 2, 1e9).unwrap();
        assert_eq!(limits.poll_timeout(), Some(ms(30)));
        let just_before = ms(30) - Duration::from_nanos(1);
        assert_eq!(limits.share(just_before, 1), Some(1e9));
        assert_eq!(limits.share(ms(30), 1), None, "lapsed at 10 + 20 ms");
        assert!(!limits.expire(just_before));
        assert!(limits.expire(ms(30)));
        assert_eq!(limits.poll_timeout(), Some(ms(35)));
        assert_eq!(limits.grant_received(ms(16), 2, 0.0), Ok(true));
        assert_eq!(limits.share(ms(16), 2), None, "a zero share releases");
        limits.grant_received(ms(40), 3, 1e9).unwrap();
        assert!(limits.lapsed(3));
        assert!(!limits.lapsed(3));
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(limits.grant_received(ms(41), 4, bad).is_err());
        }
        assert_eq!(limits.poll_timeout(), None);
    }

    /// Units of at least two hosts (one host is no incast).
    fn arb_units() -> impl Strategy<Value = Vec<IncastUnit>> {
        (
            proptest::collection::vec((0u64..6, 0u64..4, any::<bool>(), 1u32..=1_000_000), 1..40),
            1u32..=1_000_000,
        )
            .prop_map(|(v, w)| {
                let mut units: Vec<_> = v
                    .into_iter()
                    .map(|(host, tenant, lat, weight)| {
                        if lat {
                            latency(host, tenant, weight)
                        } else {
                            unit(host, tenant, weight)
                        }
                    })
                    .collect();
                units.push(unit(6, 0, w));
                units
            })
    }

    proptest! {
        /// The shares granted, each distinct (host, tenant) at its largest weight, sum to no
        /// more than the link and to all of it but rounding; each unit gets at least its
        /// weighted part of the link (1/n at weight 1) less a rounding.
        #[test]
        fn shares_never_exceed_the_link_and_every_unit_gets_its_part(
            units in arb_units(),
            link in 1e3f64..1e12,
        ) {
            let share = incast_share(link, &units).unwrap();
            prop_assert!(share > 0.0 && share.is_finite());
            let mut distinct: BTreeMap<(u64, TenantId, FlowClass), u32> = BTreeMap::new();
            for u in &units {
                let w = distinct.entry((u.host, u.tenant, u.class)).or_insert(0);
                let weighted = if u.class == FlowClass::Latency { 1 } else { u.weight.get() };
                *w = (*w).max(weighted);
            }
            let total: f64 = distinct.values().map(|&w| f64::from(w)).sum();
            let granted: f64 = distinct.values().map(|&w| f64::from(w) * share).sum();
            prop_assert!(granted <= link * (1.0 + 1e-12), "{granted} > {link}");
            prop_assert!(share * total <= link);
            prop_assert!(granted >= link * (1.0 - 1e-9));
            for &w in distinct.values() {
                let part = f64::from(w) / total * link;
                prop_assert!(f64::from(w) * share >= part * (1.0 - 1e-12));
            }
        }

        /// With every weight 1 each of the n units gets 1/n of the link.
        #[test]
        fn unit_weights_give_each_of_n_senders_one_nth(n in 2u64..200, link in 1e3f64..1e12) {
            let units: Vec<_> = (0..n).map(|h| unit(h, 1, 1)).collect();
            let share = incast_share(link, &units).unwrap();
            prop_assert!(share <= link / n as f64);
            prop_assert!(share >= link / n as f64 * (1.0 - 1e-15));
        }

        /// A tenant's flows into one receiver never together exceed its weight times the
        /// share, and paced allotments never exceed the local one nor the cap.
        #[test]
        fn caps_split_a_tenants_share_and_pacing_only_lowers(
            share in 1.0f64..1e11,
            weight in 1u32..1000,
            flows in 1u32..64,
            local in 0.0f64..1e11,
        ) {
            let mut limits = IncastLimits::new(ms(20));
            limits.grant_received(ms(0), 1, share).unwrap();
            let w = Weight::new(weight).unwrap();
            let cap = limits.cap(ms(1), 1, w, flows).unwrap();
            prop_assert!(cap * f64::from(flows) <= share * f64::from(weight) * (1.0 + 1e-12));
            let p = paced(allotment(local), Some(cap));
            prop_assert!(p.bytes_per_sec <= local && p.bytes_per_sec <= cap);
            prop_assert!(p.ops_per_sec <= allotment(local).ops_per_sec);
            prop_assert_eq!(limits.cap(ms(20), 1, w, flows), None);
        }
    }

    /// A receiver's share that changes is reported as a change (the driver paces the
    /// flows again only then): 2e9, then 1e9 when a third sender halves it, then 1e9 again
    /// (no change), then 0 (none: unconstrained, a change).
    #[test]
    fn a_changed_share_is_reported_and_an_unchanged_one_is_not() {
        let mut limits = IncastLimits::new(Duration::from_millis(20));
        let ms = Duration::from_millis;
        assert_eq!(
            limits.grant_received(ms(0), 3, 2e9),
            Ok(true),
            "first share"
        );
        assert_eq!(
            limits.grant_received(ms(1), 3, 1e9),
            Ok(true),
            "halved: 2e9 -> 1e9"
        );
        assert_eq!(limits.grant_received(ms(2), 3, 1e9), Ok(false), "1e9 again");
        assert_eq!(limits.grant_received(ms(3), 3, 0.0), Ok(true), "withdrawn");
        assert_eq!(
            limits.grant_received(ms(4), 3, 0.0),
            Ok(false),
            "still none"
        );
    }

    /// The smallest positive share the wire admits (5e-324 B/s, subnormal), split between
    /// two flows, underflows to 0 B/s: a cap of 0 would pause the flow for the pacer's
    /// MAX_WAIT (60 s) at a time. A positive share caps at a positive rate, and the flow
    /// is paced slowly: its first chunk goes at once.
    #[test]
    fn a_subnormal_share_caps_at_a_positive_rate_and_never_pauses_for_60_s() {
        let mut limits = IncastLimits::new(Duration::from_millis(20));
        let now = Duration::ZERO;
        assert_eq!(limits.grant_received(now, 3, 5e-324), Ok(true));
        let cap = limits.cap(now, 3, Weight::ONE, 2).unwrap();
        assert!(
            cap > 0.0,
            "a share of 5e-324 B/s over two flows capped at {cap} B/s"
        );
        let capped = paced(allotment(1e9), Some(cap));
        assert!(
            capped.bytes_per_sec > 0.0 && capped.ops_per_sec > 0.0,
            "{capped:?}"
        );
        let mut pacer = crate::pacer::Pacer::new(capped.pace_rate(), now);
        assert_eq!(pacer.try_release(now, 5120, 1), Ok(()), "paused for 60 s");
    }
}
