//! Tenants in `adaptive`: how they count, and how the bandwidth stream is split among them.
//!
//! **Counting.** As in Justitia's loop, a tenant counts once in each class in which it has
//! flows present, with its weight (the largest weight among its flows of that class):
//! [`TenantWeights`] holds, per class, the summed weights of those tenants. With unit
//! weights these are Justitia's L, B and T counted by tenant, so opening more applications
//! or queue pairs raises no count.
//!
//! **Splitting.** The host's bandwidth flows are paced as one stream of chunks; which
//! queue pair the next chunk comes from is [`TenantRoundRobin`]'s pick: deficit round
//! robin over the tenants by bytes, each tenant's quantum its weight times the chunk, then
//! round robin over the tenant's flows and over each flow's queue pairs. So a backlogged
//! tenant of weight `w` receives `w / sum(w)` of the stream's bytes whatever the number of
//! its flows and queue pairs, and a tenant with nothing to send is passed over at once: the
//! capacity it leaves goes to the others in the same pick (work conserving).
//!
//! Invariants: a pick returns only a queue the caller said is ready; a tenant's deficit is
//! zero whenever it is passed over with nothing ready, so idleness earns no credit; over
//! any span in which the tenants are always ready, each one's bytes are within two quanta
//! of its weight's share of the total (chunks no larger than the quantum).

use std::collections::BTreeMap;

use crate::flow::{FlowClass, FlowId, FlowSpec, TenantId};

/// Per class, the summed weights of the tenants with flows of that class present (a tenant
/// counts once per class, with the largest weight among those flows). Sums of u32 weights
/// in u64, so that large weights keep their ratios (two of 3e9 saturated a u32 sum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantWeights {
    /// L: the latency tenants' weights.
    pub latency: u64,
    /// B: the bandwidth tenants' weights.
    pub bandwidth: u64,
    /// T: the throughput tenants' weights.
    pub throughput: u64,
}

impl TenantWeights {
    /// The weights of the tenants of these present flows.
    pub fn of<'a>(flows: impl IntoIterator<Item = &'a FlowSpec>) -> Self {
        let mut largest: BTreeMap<(TenantId, FlowClass), u32> = BTreeMap::new();
        for f in flows {
            let w = largest.entry((f.tenant, f.class)).or_insert(0);
            *w = (*w).max(f.weight.get());
        }
        let mut out = TenantWeights::default();
        for ((_, class), w) in largest {
            let slot = match class {
                FlowClass::Latency => &mut out.latency,
                FlowClass::Bandwidth => &mut out.bandwidth,
                FlowClass::Throughput => &mut out.throughput,
            };
            *slot = slot.saturating_add(u64::from(w));
        }
        out
    }

    /// L + B + T.
    pub fn total(&self) -> u64 {
        self.latency
            .saturating_add(self.bandwidth)
            .saturating_add(self.throughput)
    }

    /// The bandwidth tenants' sharing-incentive share B/(L+B+T): what an equal split of the
    /// RNIC among every tenant (by weight) leaves them together; 1 with no tenants.
    pub fn bandwidth_share(&self) -> f64 {
        let all = self.total();
        if all == 0 {
            1.0
        } else {
            self.bandwidth as f64 / all as f64
        }
    }

    /// The resource-hungry tenants' share (B+T)/(L+B+T); 1 with no tenants.
    pub fn hungry_share(&self) -> f64 {
        let all = self.total();
        if all == 0 {
            1.0
        } else {
            self.bandwidth.saturating_add(self.throughput) as f64 / all as f64
        }
    }
}

/// How many queues each tenant is served from at a time, and for how long each
/// ([`TenantRoundRobin::set_queue_budget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueBudget {
    /// Open queues per unit of a tenant's weight (at least one).
    pub per_weight: u32,
    /// The most open queues any one tenant may hold, whatever its weight: the contexts the
    /// RNIC caches (at least one).
    pub most: u32,
    /// The bytes a queue is served while open before the next takes its place.
    pub turn_bytes: u64,
}

impl QueueBudget {
    /// The open queues a tenant of `weight` may hold: `per_weight x weight`, at most
    /// `most` (a tenant of weight 1000 on a 256-context RNIC holds 256, not 1000), at least
    /// one.
    pub fn for_weight(&self, weight: u32) -> usize {
        let open = (u64::from(self.per_weight.max(1)) * u64::from(weight.max(1)))
            .min(u64::from(self.most.max(1)));
        usize::try_from(open).unwrap_or(usize::MAX)
    }
}

/// One flow's queues in the round robin.
#[derive(Clone, Debug)]
struct FlowQueues<Q> {
    flow: FlowId,
    queues: Vec<Q>,
    /// The queue to try first next time.
    next: usize,
}

/// One tenant's flows in the round robin.
#[derive(Clone, Debug)]
struct TenantQueues<Q> {
    tenant: TenantId,
    weight: u32,
    /// Bytes it may still be given in its present turn.
    deficit: u64,
    flows: Vec<FlowQueues<Q>>,
    /// The flow to try first next time.
    next: usize,
    /// With a queue budget: its open queues (flow index, queue index, bytes given since
    /// opened), the only ones it is served from.
    open: Vec<(usize, usize, u64)>,
}

impl<Q: Copy + PartialEq> TenantQueues<Q> {
    /// Its first ready queue in round-robin order, passing over those `skip` names:
    /// (flow index, queue index, queue, bytes).
    fn ready(
        &self,
        ready: &mut impl FnMut(Q) -> Option<u64>,
        skip: &[(usize, usize, u64)],
    ) -> Option<(usize, usize, Q, u64)> {
        let n = self.flows.len();
        for i in 0..n {
            let fi = (self.next + i) % n;
            let f = &self.flows[fi];
            let m = f.queues.len();
            for j in 0..m {
                let qi = (f.next + j) % m;
                if skip.iter().any(|&(a, b, _)| (a, b) == (fi, qi)) {
                    continue;
                }
                let q = f.queues[qi];
                if let Some(bytes) = ready(q) {
                    return Some((fi, qi, q, bytes));
                }
            }
        }
        None
    }

    /// Under a budget of `budget` open queues, each open for at most `turn` bytes: open
    /// queues whose turn is spent are closed; then the first ready open queue, oldest
    /// first; with none ready, the next ready queue in round-robin order is opened, in
    /// place of the oldest open one if the budget is full. So an open queue that waits
    /// for its application's next message keeps its place (and its context on the RNIC)
    /// while another open queue has something to send, and the tenant is never passed
    /// over while one of its queues is ready. Closing a queue each time it was found not
    /// ready opened a cold queue every few hundred KB where a closed-loop application
    /// keeps a few messages posted per queue pair (4 x 64 KB on each of 512 queue pairs on
    /// a 256-context RNIC: x1.21 of alone and 91% of the link, against x1.19 and 95%).
    fn ready_within(
        &mut self,
        ready: &mut impl FnMut(Q) -> Option<u64>,
        budget: usize,
        turn: u64,
    ) -> Option<(usize, usize, Q, u64)> {
        self.open.retain(|&(_, _, given)| given < turn);
        for &(fi, qi, _) in &self.open {
            let q = self.flows[fi].queues[qi];
            if let Some(bytes) = ready(q) {
                return Some((fi, qi, q, bytes));
            }
        }
        let found = self.ready(ready, &self.open)?;
        if self.open.len() >= budget.max(1) {
            self.open.remove(0);
        }
        self.open.push((found.0, found.1, 0));
        Some(found)
    }
}

/// Weighted deficit round robin over tenants, then round robin over each tenant's flows
/// and each flow's queues (see the module documentation).
#[derive(Clone, Debug)]
pub struct TenantRoundRobin<Q> {
    /// Ordered by tenant id.
    tenants: Vec<TenantQueues<Q>>,
    /// The tenant whose turn it is.
    turn: usize,
    /// Bytes per unit of weight per turn.
    quantum: u64,
    /// The queues a tenant is served from at a time; `None`: every queue in turn.
    queue_budget: Option<QueueBudget>,
}

impl<Q: Copy + PartialEq> Default for TenantRoundRobin<Q> {
    fn default() -> Self {
        Self::new()
    }
}

impl<Q: Copy + PartialEq> TenantRoundRobin<Q> {
    /// An empty round robin with a quantum of one byte (set it with
    /// [`set_quantum`](Self::set_quantum)).
    pub fn new() -> Self {
        TenantRoundRobin {
            tenants: Vec::new(),
            turn: 0,
            quantum: 1,
            queue_budget: None,
        }
    }

    /// Adds queue `queue` of flow `spec.id` of tenant `spec.tenant`; the tenant's weight is
    /// the largest among its flows added.
    pub fn insert(&mut self, spec: &FlowSpec, queue: Q) {
        let at = match self
            .tenants
            .binary_search_by_key(&spec.tenant, |t| t.tenant)
        {
            Ok(at) => at,
            Err(at) => {
                self.tenants.insert(
                    at,
                    TenantQueues {
                        tenant: spec.tenant,
                        weight: 0,
                        deficit: 0,
                        flows: Vec::new(),
                        next: 0,
                        open: Vec::new(),
                    },
                );
                // `turn` is the tenant served last: one joining at or before it moves it
                // one on, or the last served would be served again with a fresh quantum.
                if at <= self.turn {
                    self.turn += 1;
                }
                at
            }
        };
        let t = &mut self.tenants[at];
        t.weight = t.weight.max(spec.weight.get());
        match t.flows.iter_mut().find(|f| f.flow == spec.id) {
            Some(f) if !f.queues.contains(&queue) => f.queues.push(queue),
            Some(_) => {}
            None => t.flows.push(FlowQueues {
                flow: spec.id,
                queues: vec![queue],
                next: 0,
            }),
        }
    }

    /// Bytes per unit of weight a tenant is given per turn: the chunk size, so that each
    /// tenant of weight 1 sends about one chunk per turn.
    pub fn set_quantum(&mut self, bytes: u64) {
        self.quantum = bytes.max(1);
    }

    /// Bounds the queues each tenant is served from at a time to
    /// [`QueueBudget::for_weight`] of its weight, each served for at most `turn_bytes`
    /// before the next of the tenant's ready queues takes its place (`None`: no bound). Where the RNIC caches a bounded number of
    /// queue-pair contexts, dealing chunks round a tenant's hundreds of queue pairs would
    /// evict every context, the other tenants' too; with a budget a tenant's contexts
    /// change once per turn, not once per chunk.
    pub fn set_queue_budget(&mut self, budget: Option<QueueBudget>) {
        self.queue_budget = budget;
        if budget.is_none() {
            for t in &mut self.tenants {
                t.open.clear();
            }
        }
    }

    /// Tenants in the round robin.
    pub fn tenants(&self) -> usize {
        self.tenants.len()
    }

    /// The queue the next chunk comes from, among those for which `ready` gives the next
    /// chunk's bytes (`None`: nothing that may go now); the chunk is charged to its tenant.
    pub fn pick(&mut self, mut ready: impl FnMut(Q) -> Option<u64>) -> Option<Q> {
        let n = self.tenants.len();
        if n == 0 {
            return None;
        }
        self.turn %= n;
        let mut idle = 0;
        // A ready tenant's deficit grows by at least one quantum each time its turn comes,
        // so a chunk of b bytes waits at most ceil(b / quantum) rounds.
        loop {
            let t = &mut self.tenants[self.turn];
            let found = match self.queue_budget {
                Some(budget) => t.ready_within(
                    &mut ready,
                    budget.for_weight(t.weight),
                    budget.turn_bytes.max(1),
                ),
                None => t.ready(&mut ready, &[]),
            };
            match found {
                Some((fi, qi, q, bytes)) if t.deficit >= bytes => {
                    t.deficit -= bytes;
                    if let Some(open) = t.open.iter_mut().find(|o| (o.0, o.1) == (fi, qi)) {
                        open.2 = open.2.saturating_add(bytes);
                    }
                    let f = &mut t.flows[fi];
                    f.next = (qi + 1) % f.queues.len();
                    t.next = (fi + 1) % t.flows.len();
                    return Some(q);
                }
                Some(_) => idle = 0,
                None => {
                    // Passed over with nothing to send: no credit for idleness.
                    t.deficit = 0;
                    idle += 1;
                    if idle >= n {
                        return None;
                    }
                }
            }
            self.turn = (self.turn + 1) % n;
            let next = &mut self.tenants[self.turn];
            next.deficit = next
                .deficit
                .saturating_add(self.quantum.saturating_mul(u64::from(next.weight)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Weight;
    use proptest::prelude::*;

    /// A budget of `per_weight` queues per unit of weight, no cache to bound it.
    fn budget(per_weight: u32, turn_bytes: u64) -> QueueBudget {
        QueueBudget {
            per_weight,
            most: u32::MAX,
            turn_bytes,
        }
    }

    fn spec(id: u64, tenant: u64, class: FlowClass, weight: u32) -> FlowSpec {
        FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class,
            weight: Weight::new(weight).unwrap_or(Weight::ONE),
        }
    }

    /// A tenant counts once per class with its largest weight: one latency flow (tenant 1),
    /// sixteen bandwidth flows of tenant 2, one of tenant 3 of weight 2, and a throughput
    /// flow of tenant 3: L = 1, B = 1 + 2, T = 2.
    #[test]
    fn tenants_count_once_per_class_with_their_weight() {
        let mut flows = vec![spec(0, 1, FlowClass::Latency, 1)];
        flows.extend((1..=16).map(|i| spec(i, 2, FlowClass::Bandwidth, 1)));
        flows.push(spec(17, 3, FlowClass::Bandwidth, 2));
        flows.push(spec(18, 3, FlowClass::Throughput, 1));
        flows.push(spec(19, 3, FlowClass::Throughput, 2));
        let w = TenantWeights::of(&flows);
        assert_eq!(
            w,
            TenantWeights {
                latency: 1,
                bandwidth: 3,
                throughput: 2
            }
        );
        assert!((w.bandwidth_share() - 0.5).abs() < 1e-12);
        assert!((w.hungry_share() - 5.0 / 6.0).abs() < 1e-12);
        assert_eq!(TenantWeights::default().bandwidth_share(), 1.0);
    }

    /// Bytes each tenant is given over `picks` picks, every queue always ready with
    /// `chunk`-byte chunks except those `idle` says are not.
    fn served(
        rr: &mut TenantRoundRobin<u32>,
        owner: &dyn Fn(u32) -> u64,
        picks: usize,
        chunk: u64,
        idle: &dyn Fn(u32) -> bool,
    ) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        for _ in 0..picks {
            if let Some(q) = rr.pick(|q| (!idle(q)).then_some(chunk)) {
                *out.entry(owner(q)).or_insert(0) += chunk;
            }
        }
        out
    }

    /// A flow's queues take turns, each once however often it is inserted; a queue not
    /// ready is passed over for the flow's next one; tenants are counted once.
    #[test]
    fn a_flows_queues_take_turns_once_each() {
        let mut rr = TenantRoundRobin::new();
        rr.set_quantum(4096);
        let flow = spec(1, 1, FlowClass::Bandwidth, 1);
        rr.insert(&flow, 10u32);
        rr.insert(&flow, 10);
        rr.insert(&flow, 11);
        assert_eq!(rr.tenants(), 1);
        let order: Vec<Option<u32>> = (0..4).map(|_| rr.pick(|_| Some(4096))).collect();
        assert_eq!(order, [Some(10), Some(11), Some(10), Some(11)]);
        // Queue 10 not ready: 11 goes, whichever is next.
        for _ in 0..2 {
            assert_eq!(rr.pick(|q| (q == 11).then_some(4096)), Some(11));
        }
        // A second flow of the tenant: with the first's queues not ready, it goes.
        rr.insert(&spec(3, 1, FlowClass::Bandwidth, 1), 30);
        for _ in 0..2 {
            assert_eq!(rr.pick(|q| (q == 30).then_some(4096)), Some(30));
        }
        rr.insert(&spec(2, 2, FlowClass::Bandwidth, 1), 20);
        assert_eq!(rr.tenants(), 2);
    }

    /// A tenant that joins ahead of the one served last (in the tenants' order) leaves it
    /// served last: tenants 5 and 7, 7 served first (5 has no credit yet); then tenant 1
    /// joins ahead of both, or tenant 6 between them, and 7 is not served again before
    /// the others: 1, 5, 7 and 5, 6, 7.
    #[test]
    fn a_tenant_joining_ahead_of_the_last_served_does_not_give_it_another_turn() {
        for (joins, want) in [(1u32, [1, 5, 7]), (6, [5, 6, 7])] {
            let mut rr = TenantRoundRobin::new();
            rr.set_quantum(4096);
            rr.insert(&spec(5, 5, FlowClass::Bandwidth, 1), 5u32);
            rr.insert(&spec(7, 7, FlowClass::Bandwidth, 1), 7);
            assert_eq!(rr.pick(|_| Some(4096)), Some(7));
            let id = u64::from(joins);
            rr.insert(&spec(id, id, FlowClass::Bandwidth, 1), joins);
            let order: Vec<Option<u32>> = (0..3).map(|_| rr.pick(|_| Some(4096))).collect();
            assert_eq!(order, want.map(Some), "tenant {joins} joins");
        }
    }

    /// Tenant A with one queue, tenant B with sixteen flows: the stream goes half and half,
    /// chunk by chunk; B's flows take turns within B's half.
    #[test]
    fn one_flow_against_sixteen_gets_half() {
        let mut rr = TenantRoundRobin::new();
        rr.set_quantum(4096);
        rr.insert(&spec(0, 1, FlowClass::Bandwidth, 1), 0u32);
        for i in 1..=16 {
            rr.insert(&spec(u64::from(i), 2, FlowClass::Bandwidth, 1), i);
        }
        let owner = |q: u32| if q == 0 { 1 } else { 2 };
        let mut order = Vec::new();
        for _ in 0..34 {
            order.push(rr.pick(|_| Some(4096)).unwrap_or(u32::MAX));
        }
        let a = order.iter().filter(|&&q| q == 0).count();
        assert_eq!(a, 17, "{order:?}");
        let b: std::collections::BTreeSet<u32> =
            order.iter().copied().filter(|&q| q != 0).collect();
        assert_eq!(b.len(), 16, "each of B's flows once: {order:?}");
        let s = served(&mut rr, &owner, 1000, 4096, &|_| false);
        assert_eq!(s.get(&1), s.get(&2));
    }

    /// Weights apply: 2 against 1 gives two thirds.
    #[test]
    fn weights_split_the_stream() {
        let mut rr = TenantRoundRobin::new();
        rr.set_quantum(1000);
        rr.insert(&spec(0, 1, FlowClass::Bandwidth, 2), 0u32);
        rr.insert(&spec(1, 2, FlowClass::Bandwidth, 1), 1u32);
        rr.insert(&spec(2, 2, FlowClass::Bandwidth, 1), 2u32);
        let owner = |q: u32| if q == 0 { 1 } else { 2 };
        let s = served(&mut rr, &owner, 3000, 1000, &|_| false);
        assert_eq!((s[&1], s[&2]), (2_000_000, 1_000_000));
    }

    /// Work conserving: a tenant with nothing ready is passed over in the same pick, and
    /// earns nothing for it; with nothing ready anywhere, no pick.
    #[test]
    fn an_idle_tenants_share_goes_to_the_others() {
        let mut rr = TenantRoundRobin::new();
        rr.set_quantum(1000);
        for t in 0..3u32 {
            rr.insert(
                &spec(u64::from(t), u64::from(t), FlowClass::Bandwidth, 1),
                t,
            );
        }
        let owner = |q: u32| u64::from(q);
        let s = served(&mut rr, &owner, 100, 1000, &|q| q == 1);
        assert_eq!(
            (s.get(&0), s.get(&1), s.get(&2)),
            (Some(&50_000), None, Some(&50_000))
        );
        // Back: an equal third from the next picks, no burst from saved credit.
        let s = served(&mut rr, &owner, 99, 1000, &|_| false);
        assert_eq!(s.values().collect::<Vec<_>>(), vec![&33_000; 3]);
        assert_eq!(rr.pick(|_| None), None);
    }

    /// A budget of 4 open queues of 8 KB each: a tenant of 64 queues is served from 4 at a
    /// time, each for two 4 KB chunks, then the next 4; the tenant's share is unchanged.
    #[test]
    fn a_queue_budget_bounds_the_queues_in_use() {
        let mut rr = TenantRoundRobin::new();
        rr.set_quantum(4096);
        rr.set_queue_budget(Some(budget(4, 8192)));
        rr.insert(&spec(0, 1, FlowClass::Bandwidth, 1), 1000u32);
        for i in 0..64 {
            rr.insert(&spec(1, 2, FlowClass::Bandwidth, 1), i);
        }
        let picks: Vec<u32> = (0..64)
            .filter_map(|_| rr.pick(|_| Some(4096)))
            .filter(|&q| q != 1000)
            .collect();
        assert_eq!(picks.len(), 32, "half the stream: {picks:?}");
        // Each queue twice in a row (its turn), one queue open at a time while it is ready.
        let expected: Vec<u32> = (0..16).flat_map(|q| [q, q]).collect();
        assert_eq!(picks, expected);
        // With only queue 0 ready, it is served for its turn, closed, and opened again at
        // once: no other queue waits for it.
        let mut only = TenantRoundRobin::new();
        only.set_quantum(4096);
        only.set_queue_budget(Some(budget(1, 8192)));
        only.insert(&spec(1, 2, FlowClass::Bandwidth, 1), 0u32);
        only.insert(&spec(1, 2, FlowClass::Bandwidth, 1), 1u32);
        let served: Vec<u32> = (0..6)
            .filter_map(|_| only.pick(|q| (q == 0).then_some(4096)))
            .collect();
        assert_eq!(served, vec![0; 6]);
    }

    /// A queue whose application has nothing posted for a moment keeps its place while
    /// another open queue is ready: with a budget of 2 and queues 0, 1 and 2 open in that
    /// order, queue 0 not ready at one pick is not closed, and when it is ready again it
    /// is served, not queue 2 (a cold context on the RNIC). With neither open queue ready,
    /// the oldest gives its place to queue 2 at once, so the tenant is not passed over.
    #[test]
    fn a_queue_waiting_for_its_next_message_keeps_its_place() {
        let mut rr = TenantRoundRobin::new();
        rr.set_quantum(4096);
        rr.set_queue_budget(Some(budget(2, 1 << 20)));
        for q in 0..3u32 {
            rr.insert(&spec(1, 2, FlowClass::Bandwidth, 1), q);
        }
        assert_eq!(rr.pick(|q| (q == 0).then_some(4096)), Some(0));
        assert_eq!(rr.pick(|q| (q == 1).then_some(4096)), Some(1));
        // Queue 0 waits for its application while queue 1 is served.
        assert_eq!(rr.pick(|q| (q != 0).then_some(4096)), Some(1));
        // Queue 0 is back: it is served; queue 2 stays closed.
        assert_eq!(rr.pick(|q| (q != 1).then_some(4096)), Some(0));
        // Neither open queue ready: queue 2 takes the oldest's place (queue 0's) at once.
        assert_eq!(rr.pick(|q| (q == 2).then_some(4096)), Some(2));
        assert_eq!(rr.pick(|q| (q != 2).then_some(4096)), Some(1));
    }

    proptest! {
        /// Any tenants, weights, flows and chunk sizes, all backlogged: each tenant's bytes
        /// are its weight's share of the total within two chunks.
        #[test]
        fn backlogged_tenants_share_by_weight(
            tenants in proptest::collection::vec((1u32..5, 1usize..20), 1..6),
            chunk in 1u64..10_000,
            picks in 200usize..800,
        ) {
            let mut rr = TenantRoundRobin::new();
            rr.set_quantum(chunk);
            let mut owner = Vec::new();
            let mut id = 0u64;
            for (t, &(w, flows)) in tenants.iter().enumerate() {
                for _ in 0..flows {
                    rr.insert(&spec(id, t as u64, FlowClass::Bandwidth, w), id as u32);
                    owner.push(t as u64);
                    id += 1;
                }
            }
            let s = served(&mut rr, &|q| owner[q as usize], picks, chunk, &|_| false);
            let total: u64 = s.values().sum();
            prop_assert_eq!(total, picks as u64 * chunk);
            let weights: u32 = tenants.iter().map(|t| t.0).sum();
            for (t, &(w, _)) in tenants.iter().enumerate() {
                let got = s.get(&(t as u64)).copied().unwrap_or(0) as f64;
                let fair = total as f64 * f64::from(w) / f64::from(weights);
                prop_assert!((got - fair).abs() <= 2.0 * chunk as f64 * f64::from(w), "tenant {} got {} of fair {}", t, got, fair);
            }
        }
    }

    /// Weights of 3e9 for a latency and a bandwidth tenant: B/(L+B+T) is 1/2 and so is
    /// (B+T)/(L+B+T); the sums do not saturate at u32::MAX (which gave 0.698).
    #[test]
    fn weights_of_3e9_and_3e9_keep_their_ratio_of_one_half() {
        let flows = [
            spec(1, 1, FlowClass::Latency, 3_000_000_000),
            spec(2, 2, FlowClass::Bandwidth, 3_000_000_000),
        ];
        let w = TenantWeights::of(flows.iter());
        assert_eq!(w.bandwidth_share(), 0.5, "bandwidth share");
        assert_eq!(w.hungry_share(), 0.5, "resource-hungry share");
    }

    /// Queue 12 added to a flow after queue 10 was picked: the next pick is queue 11, the
    /// one after 10, not 10 again (the flow's next queue is kept within its queues, so
    /// a longer list does not move it).
    #[test]
    fn a_queue_added_after_a_pick_leaves_the_next_queue_where_it_was() {
        let s = spec(1, 1, FlowClass::Bandwidth, 1);
        let mut rr: TenantRoundRobin<u32> = TenantRoundRobin::new();
        rr.set_quantum(1 << 20);
        rr.insert(&s, 10);
        rr.insert(&s, 11);
        assert_eq!(rr.pick(|_| Some(4096)), Some(10));
        rr.insert(&s, 12);
        let next: Vec<u32> = (0..4).filter_map(|_| rr.pick(|_| Some(4096))).collect();
        assert_eq!(
            next,
            vec![11, 12, 10, 11],
            "10 served twice, 11 passed over"
        );
    }

    /// Flow 3 added to a tenant after flow 1 was picked: flow 2 is next, not flow 1
    /// again.
    #[test]
    fn a_flow_added_after_a_pick_leaves_the_next_flow_where_it_was() {
        let mut rr: TenantRoundRobin<u32> = TenantRoundRobin::new();
        rr.set_quantum(1 << 20);
        rr.insert(&spec(1, 1, FlowClass::Bandwidth, 1), 10);
        rr.insert(&spec(2, 1, FlowClass::Bandwidth, 1), 20);
        assert_eq!(rr.pick(|_| Some(4096)), Some(10));
        rr.insert(&spec(3, 1, FlowClass::Bandwidth, 1), 30);
        let next: Vec<u32> = (0..4).filter_map(|_| rr.pick(|_| Some(4096))).collect();
        assert_eq!(
            next,
            vec![20, 30, 10, 20],
            "flow 1 served twice, flow 2 passed over"
        );
    }

    /// A tenant of weight 1000 on a 256-context RNIC, one queue pair per unit of weight:
    /// it may hold 256 queues open, not 1000. Queues 0 to 299 opened one at a time (each
    /// served one chunk of a 1 MB turn, so each stays open); then with queues 0 and 299
    /// ready, queue 0 was closed to make room (the 256 open are 44 to 299), so 299 is
    /// served; with 1000 open, queue 0 would be.
    #[test]
    fn a_weight_1000_tenant_holds_at_most_256_queues_open_on_a_256_context_rnic() {
        let mut rr: TenantRoundRobin<u32> = TenantRoundRobin::new();
        rr.set_quantum(4096);
        rr.set_queue_budget(Some(QueueBudget {
            per_weight: 1,
            most: 256,
            turn_bytes: 1 << 20,
        }));
        let heavy = spec(1, 1, FlowClass::Bandwidth, 1000);
        for q in 0..300u32 {
            rr.insert(&heavy, q);
        }
        for q in 0..300u32 {
            assert_eq!(rr.pick(|r| (r == q).then_some(4096)), Some(q));
        }
        assert_eq!(
            rr.pick(|r| (r == 0 || r == 299).then_some(4096)),
            Some(299),
            "queue 0 still open: more than 256 queues held open"
        );
    }
}
