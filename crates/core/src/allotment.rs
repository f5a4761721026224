//! Dividing SafeUtil among the resource-hungry flows.
//!
//! Justitia enforces SafeUtil with multi-resource tokens (§4.2.3): one token of TokenBytes
//! and TokenOps is generated every tau = TokenBytes / SafeUtil and handed to the active
//! resource-hungry flows in round-robin order, a flow of weight w receiving w tokens per
//! round. TokenOps = TokenBytes x MaxTput / MaxRate, because that ratio is fixed for an RNIC
//! (a bandwidth flow exhausts a token's bytes, a throughput flow its operations). Flows of
//! one tenant count as one logical flow: the tenant is the unit of the round, and its
//! tokens rotate among its flows, so opening more queue pairs wins no larger share.
//!
//! Two forms are offered:
//! - [`TokenStream`], the paper-faithful token generator, for the simulator: the caller
//!   drives it with `now` and the current tau, and it hands out at most one token per call;
//! - [`allot_rates`], per-flow rates (bytes/s and ops/s) for the daemon, which grants each
//!   flow a rate every control interval and lets the shapers enforce it locally: the
//!   decoupling of token generation from token enforcement of App. D. Shares are weighted
//!   max-min fair across tenants (water-filling), then split equally among a tenant's
//!   flows, with optional per-flow demand caps whose unused share goes to the others.
//!
//! Invariants: only resource-hungry flows receive anything (latency flows are never
//! shaped); the rates handed out sum to at most SafeUtil (up to floating-point rounding),
//! and to exactly min(SafeUtil, total demand); every tenant gets at least
//! min(its demand, w_t / sum(w) x SafeUtil); the token stream's long-run shares follow the
//! tenants' weights, and within a tenant its flows take turns.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::time::Duration;

use crate::flow::{FlowId, FlowSpec, TenantId};
use crate::profile::RnicProfile;

/// The size of one multi-resource token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token {
    /// TokenBytes: bytes a bandwidth-sensitive flow may send on this token.
    pub bytes: u64,
    /// TokenOps: operations a throughput-sensitive flow may post on this token.
    pub ops: u64,
}

impl Token {
    /// A token of `bytes`, with TokenOps = bytes x MaxTput / MaxRate rounded to the nearest
    /// operation and at least one, so every token lets some work through.
    pub fn for_profile(bytes: u64, profile: &RnicProfile) -> Token {
        let ops = (bytes as f64 * profile.ops_per_byte()).round();
        // `as` saturates, so a non-finite ratio from a hand-built profile cannot panic.
        Token {
            bytes,
            ops: (ops as u64).max(1),
        }
    }
}

/// One token handed to one flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenGrant {
    /// The flow that receives the token.
    pub flow: FlowId,
    /// The tenant that owns the flow.
    pub tenant: TenantId,
    /// Bytes the token is worth.
    pub bytes: u64,
    /// Operations the token is worth.
    pub ops: u64,
}

/// The paper's token generator: one token every tau, weighted round-robin over tenants.
///
/// The caller asks [`next_token_due`](Self::next_token_due) when to call next and then
/// calls [`issue`](Self::issue) with the active flows. tau is passed on every call because
/// SafeUtil moves between tokens; a halving of SafeUtil lengthens the wait for the very
/// next token. Tokens do not accumulate: a token that falls due while no resource-hungry
/// flow is active is discarded, and a caller late by more than tau loses the missed ticks
/// rather than receiving a burst. A caller late by less than tau keeps the original phase,
/// so the long-run rate is exact for a simulator whose events land on the due times.
#[derive(Debug, Clone)]
pub struct TokenStream {
    token: Token,
    start: Duration,
    last_tick: Option<Duration>,
    /// The tenant whose turn it is and how many tokens it has had in this turn.
    turn: Option<(TenantId, u32)>,
    /// The flow of each tenant that received the tenant's latest token.
    last_flow: BTreeMap<TenantId, FlowId>,
}

/// A tenant's view for one round: its weight and its active resource-hungry flows.
struct TenantFlows {
    weight: u32,
    flows: Vec<FlowId>,
}

impl TokenStream {
    /// A stream of `token`s whose first token falls due at `start`.
    pub fn new(token: Token, start: Duration) -> Self {
        TokenStream {
            token,
            start,
            last_tick: None,
            turn: None,
            last_flow: BTreeMap::new(),
        }
    }

    /// The size of the tokens this stream hands out.
    pub fn token(&self) -> Token {
        self.token
    }

    /// When the next token falls due, given the current tau.
    pub fn next_token_due(&self, tau: Duration) -> Duration {
        self.last_tick
            .map_or(self.start, |tick| tick.saturating_add(tau))
    }

    /// Generates the token due at `now`, if one is due, and hands it to the next flow in
    /// weighted round-robin order among the resource-hungry flows of `active`. Returns
    /// `None` when no token is due yet, or when one was due but nobody could take it.
    pub fn issue(
        &mut self,
        now: Duration,
        tau: Duration,
        active: &[FlowSpec],
    ) -> Option<TokenGrant> {
        let due = self.next_token_due(tau);
        if now < due {
            return None;
        }
        self.last_tick = Some(if now - due < tau { due } else { now });

        let tenants = group_by_tenant(active);
        self.last_flow
            .retain(|tenant, _| tenants.contains_key(tenant));
        let (tenant, issued) = match self.turn {
            Some((tenant, issued)) if tenants.get(&tenant).is_some_and(|t| issued < t.weight) => {
                (tenant, issued + 1)
            }
            Some((tenant, _)) => {
                let next = tenants
                    .range((Bound::Excluded(tenant), Bound::Unbounded))
                    .next()
                    .or_else(|| tenants.iter().next())
                    .map(|(id, _)| *id)?;
                (next, 1)
            }
            None => (*tenants.keys().next()?, 1),
        };
        self.turn = Some((tenant, issued));

        let flows = &tenants.get(&tenant)?.flows;
        let flow = match self.last_flow.get(&tenant) {
            Some(last) => flows.iter().find(|f| *f > last).or_else(|| flows.first()),
            None => flows.first(),
        }
        .copied()?;
        self.last_flow.insert(tenant, flow);
        Some(TokenGrant {
            flow,
            tenant,
            bytes: self.token.bytes,
            ops: self.token.ops,
        })
    }
}

/// The resource-hungry flows of `active` by tenant, each tenant with the largest weight
/// among its flows and its flows sorted and deduplicated.
fn group_by_tenant(active: &[FlowSpec]) -> BTreeMap<TenantId, TenantFlows> {
    let mut tenants: BTreeMap<TenantId, TenantFlows> = BTreeMap::new();
    for spec in active.iter().filter(|s| s.class.is_resource_hungry()) {
        let entry = tenants.entry(spec.tenant).or_insert(TenantFlows {
            weight: 0,
            flows: Vec::new(),
        });
        entry.weight = entry.weight.max(spec.weight.get());
        entry.flows.push(spec.id);
    }
    for tenant in tenants.values_mut() {
        tenant.flows.sort_unstable();
        tenant.flows.dedup();
    }
    tenants
}

/// How much a flow would use if it were not limited.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Demand {
    /// As much as it is given (a backlogged flow).
    #[default]
    Unbounded,
    /// At most this many bytes per second.
    BytesPerSec(f64),
    /// At most this many operations per second (converted to bytes with MaxRate/MaxTput).
    OpsPerSec(f64),
}

impl Demand {
    /// The demand in bytes/s, `f64::INFINITY` when unbounded. Demands come from tenants'
    /// counters, so a NaN or negative value counts as no demand and an infinite one as
    /// unbounded.
    fn bytes_per_sec(self, ops_per_byte: f64) -> f64 {
        let bytes = match self {
            Demand::Unbounded => f64::INFINITY,
            Demand::BytesPerSec(bytes) => bytes,
            Demand::OpsPerSec(ops) => ops / ops_per_byte,
        };
        if bytes.is_nan() {
            0.0
        } else {
            bytes.max(0.0)
        }
    }
}

/// A flow asking for a share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowDemand {
    /// The flow, its tenant, class and weight.
    pub spec: FlowSpec,
    /// How much it would use.
    pub demand: Demand,
}

/// The rate granted to one flow, in both resources: a bandwidth flow is paced by the bytes,
/// a throughput flow by the operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowRate {
    /// The flow.
    pub flow: FlowId,
    /// Its tenant.
    pub tenant: TenantId,
    /// Granted bytes per second.
    pub bytes_per_sec: f64,
    /// Granted operations per second (bytes/s x MaxTput / MaxRate).
    pub ops_per_sec: f64,
}

/// Divides `safe_util` (bytes/s) among the resource-hungry flows of `flows`: weighted
/// max-min across tenants, then max-min with equal weights among each tenant's flows.
///
/// Returns one [`FlowRate`] per resource-hungry entry of `flows`, in input order; latency
/// flows are skipped. A tenant's weight is the largest among its flows. A non-finite or
/// negative `safe_util` counts as nothing to share.
pub fn allot_rates(safe_util: f64, profile: &RnicProfile, flows: &[FlowDemand]) -> Vec<FlowRate> {
    let capacity = if safe_util.is_finite() {
        safe_util.max(0.0)
    } else {
        0.0
    };
    let ops_per_byte = profile.ops_per_byte();
    let hungry: Vec<&FlowDemand> = flows
        .iter()
        .filter(|f| f.spec.class.is_resource_hungry())
        .collect();
    let demands: Vec<f64> = hungry
        .iter()
        .map(|f| f.demand.bytes_per_sec(ops_per_byte))
        .collect();

    // Tenants in order of first appearance, with the indices of their flows in `hungry`.
    let mut tenant_index: BTreeMap<TenantId, usize> = BTreeMap::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut tenant_claims: Vec<Claim> = Vec::new();
    for (i, f) in hungry.iter().enumerate() {
        let t = *tenant_index.entry(f.spec.tenant).or_insert_with(|| {
            members.push(Vec::new());
            tenant_claims.push(Claim {
                weight: 0.0,
                demand: 0.0,
            });
            members.len() - 1
        });
        members[t].push(i);
        let claim = &mut tenant_claims[t];
        claim.weight = claim.weight.max(f64::from(f.spec.weight.get()));
        claim.demand += demands[i];
    }

    let tenant_shares = water_fill(capacity, &tenant_claims);
    let mut bytes = vec![0.0; hungry.len()];
    for (flow_indices, share) in members.iter().zip(tenant_shares) {
        let claims: Vec<Claim> = flow_indices
            .iter()
            .map(|&i| Claim {
                weight: 1.0,
                demand: demands[i],
            })
            .collect();
        for (&i, flow_share) in flow_indices.iter().zip(water_fill(share, &claims)) {
            bytes[i] = flow_share;
        }
    }

    hungry
        .iter()
        .zip(bytes)
        .map(|(f, bytes_per_sec)| FlowRate {
            flow: f.spec.id,
            tenant: f.spec.tenant,
            bytes_per_sec,
            ops_per_sec: bytes_per_sec * ops_per_byte,
        })
        .collect()
}

/// One claimant of a water-filling: a positive weight and a demand (possibly infinite).
#[derive(Debug, Clone, Copy)]
struct Claim {
    weight: f64,
    demand: f64,
}

/// Weighted max-min division of `capacity`: claims are served in order of demand per
/// weight, each capped one taking its demand, until the first claim whose demand reaches
/// its weighted part of what is left. That part, per unit of weight, is the water level:
/// it stays the same for every later claim, whose demand per weight is at least as large,
/// so each of them gets its weight times the level, computed from the same two numbers.
/// Claims of equal weight above the level thus get equal shares to the last bit, and the
/// shares of unbounded claims need no running sum (the control loop computes them the
/// same way, one division per claim, none waiting on another).
fn water_fill(capacity: f64, claims: &[Claim]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..claims.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&claims[a], &claims[b]);
        (a.demand / a.weight).total_cmp(&(b.demand / b.weight))
    });
    let mut remaining = capacity;
    let mut weight_left: f64 = claims.iter().map(|c| c.weight).sum();
    let mut shares = vec![0.0; claims.len()];
    let mut level_reached = false;
    for i in order {
        let claim = claims[i];
        let fair = remaining * claim.weight / weight_left;
        if level_reached || claim.demand >= fair {
            // Rounding may put a later demand a hair under its part: never exceed it.
            level_reached = true;
            shares[i] = claim.demand.min(fair);
        } else {
            shares[i] = claim.demand;
            remaining = (remaining - claim.demand).max(0.0);
            weight_left -= claim.weight;
        }
    }
    shares
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::flow::{FlowClass, Weight};

    fn ib56() -> RnicProfile {
        RnicProfile::builtin("IB-56").unwrap()
    }

    fn spec(id: u64, tenant: u64, class: FlowClass, weight: u32) -> FlowSpec {
        FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class,
            weight: Weight::new(weight).unwrap(),
        }
    }

    fn bw(id: u64, tenant: u64) -> FlowSpec {
        spec(id, tenant, FlowClass::Bandwidth, 1)
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn paper_token_example_ib56() {
        // §4.2.3: 48 Gb/s and 30 M ops/s with 1 MB tokens: 5000 ops per token, tau 167 us.
        let profile = ib56();
        let token = Token::for_profile(1_000_000, &profile);
        assert_eq!(token.ops, 5_000);
        let tau = token.bytes as f64 / profile.max_rate_bytes_per_sec();
        assert!((tau - 167e-6).abs() < 1e-6, "tau = {tau} s");
    }

    #[test]
    fn token_has_at_least_one_op() {
        assert_eq!(Token::for_profile(1, &ib56()).ops, 1);
    }

    #[test]
    fn first_token_is_due_at_start_then_every_tau() {
        let mut stream = TokenStream::new(Token { bytes: 10, ops: 1 }, us(100));
        let active = [bw(1, 1)];
        assert_eq!(stream.next_token_due(us(10)), us(100));
        assert_eq!(stream.issue(us(99), us(10), &active), None);
        assert!(stream.issue(us(100), us(10), &active).is_some());
        assert_eq!(stream.issue(us(100), us(10), &active), None);
        assert_eq!(stream.next_token_due(us(10)), us(110));
        // A caller a little late keeps the phase.
        assert!(stream.issue(us(113), us(10), &active).is_some());
        assert_eq!(stream.next_token_due(us(10)), us(120));
        // A caller very late loses the missed ticks instead of getting a burst.
        assert!(stream.issue(us(500), us(10), &active).is_some());
        assert_eq!(stream.issue(us(500), us(10), &active), None);
        assert_eq!(stream.next_token_due(us(10)), us(510));
        // A longer tau applies to the very next token.
        assert_eq!(stream.next_token_due(us(20)), us(520));
    }

    /// A caller one whole tau late has missed a tick: the stream takes a new phase from
    /// that call rather than handing out the missed token at once.
    #[test]
    fn a_caller_a_whole_tau_late_takes_a_new_phase() {
        let mut stream = TokenStream::new(Token { bytes: 10, ops: 1 }, us(0));
        let active = [bw(1, 1)];
        assert!(stream.issue(us(0), us(10), &active).is_some());
        // Due at 10, called at 20: late by exactly tau.
        assert!(stream.issue(us(20), us(10), &active).is_some());
        assert_eq!(stream.next_token_due(us(10)), us(30));
        assert_eq!(stream.issue(us(20), us(10), &active), None);
    }

    /// Claims are served in order of demand per unit of weight, not of demand times weight:
    /// of 5, a claim of weight 4 wanting 2 (0.5 per unit) is served first and takes its 2,
    /// and the claim of weight 1 wanting 3 takes the 3 left. Served the other way round, the
    /// first would be cut to its part 1 and the second given 4, twice what it asked.
    #[test]
    fn water_fill_serves_the_least_demand_per_weight_first() {
        let shares = water_fill(
            5.0,
            &[
                Claim {
                    weight: 1.0,
                    demand: 3.0,
                },
                Claim {
                    weight: 4.0,
                    demand: 2.0,
                },
            ],
        );
        assert_eq!(shares, vec![3.0, 2.0]);
        // Both sides of the comparison per unit of weight: of 4, a claim of weight 2 wanting
        // 2 (1 per unit) is served before one of weight 1 wanting 3, and each gets 2; the
        // other way round the first would get 8/3, more than it asked.
        let shares = water_fill(
            4.0,
            &[
                Claim {
                    weight: 2.0,
                    demand: 2.0,
                },
                Claim {
                    weight: 1.0,
                    demand: 3.0,
                },
            ],
        );
        assert_eq!(shares, vec![2.0, 2.0]);
    }

    #[test]
    fn tokens_due_with_no_hungry_flow_are_discarded() {
        let mut stream = TokenStream::new(Token { bytes: 10, ops: 1 }, us(0));
        let latency_only = [spec(9, 9, FlowClass::Latency, 1)];
        assert_eq!(stream.issue(us(0), us(10), &latency_only), None);
        assert_eq!(stream.issue(us(5), us(10), &[bw(1, 1)]), None);
        assert!(stream.issue(us(10), us(10), &[bw(1, 1)]).is_some());
    }

    #[test]
    fn grant_carries_the_token_size() {
        let token = Token::for_profile(1_000_000, &ib56());
        let mut stream = TokenStream::new(token, us(0));
        let grant = stream.issue(us(0), us(167), &[bw(7, 3)]).unwrap();
        assert_eq!(
            grant,
            TokenGrant {
                flow: FlowId(7),
                tenant: TenantId(3),
                bytes: 1_000_000,
                ops: 5_000
            }
        );
    }

    /// Issues `n` tokens on consecutive ticks and returns the receiving flows.
    fn drive(stream: &mut TokenStream, from: u64, n: u64, active: &[FlowSpec]) -> Vec<u64> {
        (from..from + n)
            .filter_map(|t| stream.issue(us(t), us(1), active))
            .map(|g| g.flow.0)
            .collect()
    }

    #[test]
    fn weighted_round_robin_over_tenants_then_flows() {
        let mut stream = TokenStream::new(Token { bytes: 1, ops: 1 }, us(0));
        let active = [
            spec(10, 1, FlowClass::Bandwidth, 2),
            spec(11, 1, FlowClass::Throughput, 2),
            spec(20, 2, FlowClass::Bandwidth, 1),
            spec(30, 3, FlowClass::Latency, 5),
        ];
        let flows = drive(&mut stream, 0, 6, &active);
        assert_eq!(flows, [10, 11, 20, 10, 11, 20]);
    }

    #[test]
    fn stream_survives_the_active_set_changing() {
        let mut stream = TokenStream::new(Token { bytes: 1, ops: 1 }, us(0));
        let both = [bw(1, 1), bw(2, 2)];
        assert_eq!(drive(&mut stream, 0, 1, &both), [1]);
        // The tenant whose turn it was leaves: the next tenant is served.
        assert_eq!(drive(&mut stream, 1, 2, &[bw(2, 2)]), [2, 2]);
        // A newcomer with a lower id joins after the current tenant's turn.
        assert_eq!(drive(&mut stream, 3, 3, &[bw(1, 1), bw(2, 2)]), [1, 2, 1]);
        assert_eq!(drive(&mut stream, 6, 1, &[]), Vec::<u64>::new());
        assert_eq!(drive(&mut stream, 7, 2, &[bw(5, 4)]), [5, 5]);
    }

    fn demand(spec: FlowSpec, demand: Demand) -> FlowDemand {
        FlowDemand { spec, demand }
    }

    fn rates(safe_util: f64, flows: &[FlowDemand]) -> Vec<f64> {
        allot_rates(safe_util, &ib56(), flows)
            .iter()
            .map(|r| r.bytes_per_sec)
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    fn all_close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| close(*x, *y))
    }

    #[test]
    fn unbounded_flows_share_equally() {
        let flows = [
            demand(bw(1, 1), Demand::Unbounded),
            demand(bw(2, 2), Demand::Unbounded),
        ];
        assert!(all_close(&rates(100.0, &flows), &[50.0, 50.0]));
    }

    #[test]
    fn tenant_flows_split_their_tenants_share() {
        let flows = [
            demand(bw(1, 1), Demand::Unbounded),
            demand(bw(2, 1), Demand::Unbounded),
            demand(bw(3, 1), Demand::Unbounded),
            demand(bw(4, 2), Demand::Unbounded),
        ];
        let r = rates(120.0, &flows);
        assert!(all_close(&r, &[20.0, 20.0, 20.0, 60.0]), "{r:?}");
    }

    #[test]
    fn equal_claims_get_equal_shares_to_the_bit() {
        // Served each from what the one before left, three equal flows of 100 got
        // 33.333333333333336, 33.33333333333333, 33.33333333333333, and five of 1 had
        // one at 0.20000000000000004; at the water level all get the same.
        let unbounded = |spec| demand(spec, Demand::Unbounded);
        let across = [bw(1, 1), bw(2, 2), bw(3, 3)].map(unbounded);
        let within = [bw(1, 1), bw(2, 1), bw(3, 1)].map(unbounded);
        for flows in [across, within] {
            let r = rates(100.0, &flows);
            assert!(
                r.iter().all(|b| b.to_bits() == (100.0f64 / 3.0).to_bits()),
                "{r:?}"
            );
        }
        let five = [bw(1, 1), bw(2, 1), bw(3, 1), bw(4, 1), bw(5, 1)].map(unbounded);
        let r = rates(1.0, &five);
        assert!(r.iter().all(|&b| b == 0.2), "{r:?}");
        // Behind a capped claim the level is what it leaves, shared by weight.
        let flows = [
            demand(bw(1, 1), Demand::BytesPerSec(10.0)),
            demand(spec(2, 2, FlowClass::Bandwidth, 2), Demand::Unbounded),
            unbounded(bw(3, 3)),
            unbounded(bw(4, 4)),
        ];
        let r = rates(101.0, &flows);
        let level = 91.0f64 / 4.0;
        assert_eq!(r, [10.0, 91.0 * 2.0 / 4.0, level, level]);
    }

    #[test]
    fn weights_scale_shares() {
        let flows = [
            demand(spec(1, 1, FlowClass::Bandwidth, 3), Demand::Unbounded),
            demand(spec(2, 2, FlowClass::Throughput, 1), Demand::Unbounded),
        ];
        assert!(all_close(&rates(100.0, &flows), &[75.0, 25.0]));
    }

    #[test]
    fn unused_share_is_redistributed() {
        let flows = [
            demand(bw(1, 1), Demand::BytesPerSec(10.0)),
            demand(bw(2, 2), Demand::Unbounded),
            demand(bw(3, 3), Demand::BytesPerSec(0.0)),
            demand(bw(4, 4), Demand::BytesPerSec(50.0)),
        ];
        let r = rates(100.0, &flows);
        assert!(all_close(&r, &[10.0, 45.0, 0.0, 45.0]), "{r:?}");
        // Within a tenant too.
        let flows = [
            demand(bw(1, 1), Demand::BytesPerSec(10.0)),
            demand(bw(2, 1), Demand::Unbounded),
            demand(bw(3, 2), Demand::Unbounded),
        ];
        assert!(all_close(&rates(100.0, &flows), &[10.0, 40.0, 50.0]));
    }

    #[test]
    fn ops_demand_converts_with_the_profile_ratio() {
        let profile = ib56();
        // 5 M ops/s on IB-56 is worth 1 GB/s.
        let flows = [
            demand(spec(1, 1, FlowClass::Throughput, 1), Demand::OpsPerSec(5e6)),
            demand(bw(2, 2), Demand::Unbounded),
        ];
        let r = allot_rates(profile.max_rate_bytes_per_sec(), &profile, &flows);
        assert!(close(r[0].bytes_per_sec, 1e9));
        assert!(close(r[0].ops_per_sec, 5e6));
        assert!(close(r[1].bytes_per_sec, 5e9));
        assert!(close(r[1].ops_per_sec, 25e6));
    }

    #[test]
    fn latency_flows_and_bad_inputs_get_nothing() {
        let flows = [
            demand(spec(1, 1, FlowClass::Latency, 1), Demand::Unbounded),
            demand(bw(2, 2), Demand::BytesPerSec(f64::NAN)),
            demand(bw(3, 3), Demand::BytesPerSec(-5.0)),
            demand(bw(4, 4), Demand::BytesPerSec(f64::INFINITY)),
        ];
        let r = allot_rates(100.0, &ib56(), &flows);
        let ids: Vec<u64> = r.iter().map(|f| f.flow.0).collect();
        assert_eq!(ids, [2, 3, 4]);
        assert!(all_close(
            &r.iter().map(|f| f.bytes_per_sec).collect::<Vec<_>>(),
            &[0.0, 0.0, 100.0]
        ));
        assert!(rates(f64::NAN, &flows).iter().all(|&b| b == 0.0));
        assert!(rates(-1.0, &flows).iter().all(|&b| b == 0.0));
        assert!(allot_rates(100.0, &ib56(), &[]).is_empty());
    }
}
