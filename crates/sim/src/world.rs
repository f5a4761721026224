//! One run: the event loop that ties applications, policies and the fabric together.
//!
//! Every event is handled by exactly one model. Calls between models that happen at the
//! same instant (an application posting, the policy handing the request to the RNIC, a
//! completion being passed up to the application) go through two queues drained after
//! each event, in order, so no model ever holds a reference into another.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use justitia_core::flow::{FlowClass, FlowId, FlowSpec, TenantId, Weight};
use rand_core::SeedableRng;
use rand_pcg::Pcg64Mcg;

use crate::app::{AppIo, AppModel, Connection};
use crate::engine::EventQueue;
use crate::event::{Event, Notice};
use crate::metrics::{ChangedFlows, FlowMetrics};
use crate::policy::PolicyBuildError;
use crate::policy::{
    ControlCall, FlowInfo, Mailbox, Policy, PolicyContext, TenantOnHost, SIDE_CHANNEL_POLL,
};
use crate::report::{jain_index, FlowReport, RunReport};
use crate::rnic::{Completion, ControlVerb, Endpoint, Fabric, QpId, QpOwner, Upcall, WorkRequest};
use crate::scenario::{Experiment, ResolvedVariant, TopologyKind};
use crate::series::{self, ControlSeries, FlowSeries, RunSeries};
use crate::time::{self, Picos};
use crate::topology::{HostId, Topology};

struct FlowRuntime {
    name: String,
    class: FlowClass,
    app_kind: &'static str,
    /// (host, what that host's policy is told) for every host on which the flow posts.
    infos: Vec<(HostId, FlowInfo)>,
    /// The host its application runs on (where its control verbs go).
    host: HostId,
    /// The hosts it has a process on: its application's, and that of the far end of its
    /// connections when elsewhere (a benchmark's server runs there).
    process_hosts: Vec<HostId>,
    /// Its identity, tenant and weight.
    spec: FlowSpec,
}

/// The tenants with an application running on one host, as its daemon knows them from the
/// processes registered with it: what the host's control-verb budget is shared by.
///
/// Kept up to date one tenant at a time as applications start and stop: counting every
/// tenant of the host again at each start made starting a thousand flows quadratic.
#[derive(Default)]
struct HostTenants {
    /// Per tenant, its applications with a process on the host: where they run, and the
    /// far end of their connections (a benchmark's server runs there).
    apps: BTreeMap<TenantId, Vec<u32>>,
    /// Per tenant with one of them running: (its weight, the largest of its running
    /// applications', as the allotment takes it; its running applications).
    tenants: BTreeMap<TenantId, (u32, u32)>,
    /// The sum of their weights.
    total_weight: u64,
}

pub(crate) struct World {
    queue: EventQueue<Event>,
    fabric: Fabric,
    apps: Vec<Box<dyn AppModel>>,
    metrics: Vec<FlowMetrics>,
    policies: Vec<Box<dyn Policy>>,
    flows: Vec<FlowRuntime>,
    posts: Vec<(QpId, WorkRequest)>,
    controls: Vec<(u32, ControlVerb, u32)>,
    /// Whether each application runs (started and not stopped; a pause keeps its process).
    running: Vec<bool>,
    /// Per host, its tenants.
    host_tenants: Vec<HostTenants>,
    notices: VecDeque<Notice>,
    mailbox: Mailbox,
    completions: Vec<Completion>,
    poll: Picos,
    wakeup: Picos,
    app_rng: Pcg64Mcg,
    window: (Picos, Picos),
    max_rate_gbps: f64,
    variant: String,
    policy_name: String,
    sampler: Sampler,
}

/// Takes the time series' samples as simulated time passes.
///
/// A sample visits only the flows that may have changed since the previous one, and keeps
/// only what they got; every other flow got nothing, and the full columns are written
/// once at the end. With a thousand flows, most get nothing in a given interval, and
/// visiting all of them at every sample cost as much as the events themselves.
struct Sampler {
    interval: Picos,
    next: Picos,
    /// The series, with the flows' columns still empty until [`Sampler::finish`].
    series: RunSeries,
    /// Each flow's bytes and messages at the previous sample.
    last: Vec<(u64, u64)>,
    /// (flow, sample, Gb/s, M msgs/s) of each flow in each sample in which it got
    /// something, in the order taken: one list for all flows, appended to in turn, where a
    /// list per flow cost a thousand flows a cache miss each per sample and their lists'
    /// growing.
    got: Vec<(u32, u32, f64, f64)>,
    /// Flows whose application ran since the previous sample (it may have completed
    /// messages).
    apps_ran: ChangedFlows,
    /// Scratch list of the flows a sample visits.
    visit: Vec<u32>,
    /// Index into `series.controls` of each host, once it has reported a state.
    control_of_host: Vec<Option<usize>>,
}

impl World {
    /// Builds the run `variant` of `experiment`.
    pub(crate) fn build(
        experiment: &Experiment,
        variant: &ResolvedVariant,
    ) -> Result<Self, PolicyBuildError> {
        let scenario = &experiment.scenario;
        let profile = &experiment.profile;
        let end = time::from_ms(scenario.duration_ms);
        let window = (time::from_ms(scenario.warmup_ms), end);
        let spec = &scenario.topology;
        let h = &spec.hosts;
        let cable = || {
            let mut link = profile.link.clone();
            if let Some(sw) = &profile.switch {
                link.propagation_ns = sw.cable_ns;
            }
            link
        };
        let topology = match spec.kind {
            TopologyKind::BackToBack => {
                Topology::back_to_back([h[0].as_str(), h[1].as_str()], &profile.link)
            }
            TopologyKind::Switch => {
                let hosts: Vec<(&str, usize)> = h.iter().map(|n| (n.as_str(), 0)).collect();
                Topology::switched(&hosts, 1, &cable())
            }
            TopologyKind::TwoSwitches => {
                let hosts: Vec<(&str, usize)> = h
                    .iter()
                    .map(|n| (n.as_str(), usize::from(spec.downstream.contains(n))))
                    .collect();
                Topology::switched(&hosts, 2, &cable())
            }
        };
        let hosts = topology.host_count();
        let mut fabric = Fabric::new(topology, profile, scenario.seed, window);
        let mut queue = EventQueue::new();
        let mut apps: Vec<Box<dyn AppModel>> = Vec::new();
        let mut metrics = Vec::new();
        let mut flows = Vec::new();
        let mut host_tenants: Vec<HostTenants> =
            (0..hosts).map(|_| HostTenants::default()).collect();
        for (index, flow_ref) in variant.flows.iter().enumerate() {
            let spec = &scenario.flows[flow_ref.spec];
            let Some(app_spec) = spec.app() else {
                continue;
            };
            let (from, to) = scenario.endpoints(spec);
            let (Some(a), Some(b)) = (
                fabric.topology().host_by_name(&from),
                fabric.topology().host_by_name(&to),
            ) else {
                continue;
            };
            let app_index = index as u32;
            let server_posts = app_spec.server_posts();
            let conns: Vec<Connection> = (0..app_spec.connections())
                .map(|_| {
                    let end = |host| Endpoint {
                        host,
                        owner: QpOwner::App(app_index),
                        deliver: server_posts,
                    };
                    let (client, server) = fabric.connect(end(a), end(b), Some(app_index));
                    fabric.set_lane(client, spec.sl);
                    Connection { client, server }
                })
                .collect();
            let clients: Vec<QpId> = conns.iter().map(|c| c.client).collect();
            if let Some(m) = &spec.memory {
                fabric.set_memory(
                    &clients,
                    m.mrs,
                    m.mr_size.map_or(0, |s| s.bytes()),
                    m.page.bytes(),
                    m.offset.bytes(),
                );
            }
            if !spec.post_receives {
                for c in &conns {
                    fabric.post_no_receives(c.server);
                }
            }
            let app = app_spec.build(conns.clone());
            apps.push(app);
            metrics.push(FlowMetrics::new(window));
            let core_spec = FlowSpec {
                id: FlowId(u64::from(app_index)),
                // Without a tenant, every flow (and every copy) is an application of its own.
                tenant: TenantId(spec.tenant.unwrap_or(1_000_000 + u64::from(app_index))),
                class: spec.class(),
                weight: spec.weight.unwrap_or(Weight::ONE),
            };
            let mut infos = vec![(
                a,
                FlowInfo {
                    spec: core_spec,
                    name: flow_ref.name.clone(),
                    qps: conns.iter().map(|c| c.client).collect(),
                    peer: b,
                    reads: app_spec.reads(),
                },
            )];
            if conns.is_empty() {
                // A control-verb storm posts no work requests: it is no flow of the policy's
                // loop. Its verbs reach the policy one by one (`Policy::on_control`).
                infos.clear();
            }
            if server_posts {
                infos.push((
                    b,
                    FlowInfo {
                        spec: core_spec,
                        name: flow_ref.name.clone(),
                        qps: conns.iter().map(|c| c.server).collect(),
                        peer: a,
                        reads: false,
                    },
                ));
            }
            let mut process_hosts = vec![a];
            if !conns.is_empty() && b != a {
                process_hosts.push(b);
            }
            for host in &process_hosts {
                host_tenants[usize::from(host.0)]
                    .apps
                    .entry(core_spec.tenant)
                    .or_default()
                    .push(app_index);
            }
            flows.push(FlowRuntime {
                name: flow_ref.name.clone(),
                class: spec.class(),
                app_kind: app_spec.kind(),
                infos,
                host: a,
                process_hosts,
                spec: core_spec,
            });
            queue.schedule(time::from_ms(spec.start_ms), Event::FlowStart(app_index));
            if let Some(stop) = spec.stop_ms {
                queue.schedule(time::from_ms(stop), Event::FlowStop(app_index));
            }
            for [from, to] in &spec.pauses_ms {
                queue.schedule(time::from_ms(*from), Event::AppPause(app_index));
                queue.schedule(time::from_ms(*to), Event::AppResume(app_index));
            }
        }
        let policies = (0..hosts)
            .map(|_| {
                variant
                    .policy
                    .build(profile, &variant.justitia, &variant.preempt)
            })
            .collect::<Result<Vec<_>, PolicyBuildError>>()?;
        let interval_ms = series::interval_ms(scenario.duration_ms, scenario.series_ms);
        let interval = time::from_ms(interval_ms).max(1);
        let sampler = Sampler {
            interval,
            next: interval,
            series: RunSeries {
                interval_ms,
                t_ms: Vec::new(),
                flows: flows
                    .iter()
                    .map(|f| FlowSeries {
                        name: f.name.clone(),
                        class: f.class,
                        gbps: Vec::new(),
                        mops: Vec::new(),
                    })
                    .collect(),
                controls: Vec::new(),
            },
            last: vec![(0, 0); flows.len()],
            got: Vec::new(),
            apps_ran: ChangedFlows::default(),
            visit: Vec::new(),
            control_of_host: vec![None; hosts],
        };
        let running = vec![false; flows.len()];
        Ok(World {
            queue,
            fabric,
            apps,
            metrics,
            policies,
            flows,
            posts: Vec::new(),
            controls: Vec::new(),
            running,
            host_tenants,
            notices: VecDeque::new(),
            mailbox: Mailbox::default(),
            completions: Vec::new(),
            poll: time::from_ns(profile.host.poll_ns),
            wakeup: profile.wakeup(),
            // A stream of its own, so that application timing does not shift the fabric's.
            app_rng: Pcg64Mcg::seed_from_u64(scenario.seed ^ 0x5EED_A995),
            window,
            max_rate_gbps: profile.policy.max_rate_gbps,
            variant: variant.name.clone(),
            policy_name: variant.policy.as_str().to_string(),
            sampler,
        })
    }

    /// Takes every sample due at or before `now`: the state after all events before it.
    /// Inlined into the event loop, which calls it at every event, while the sampling,
    /// due at few of them, stays out of line.
    #[inline]
    fn sample_until(&mut self, now: Picos) {
        if self.sampler.next <= now {
            self.take_samples_until(now);
        }
    }

    #[inline(never)]
    fn take_samples_until(&mut self, now: Picos) {
        while self.sampler.next <= now {
            let at = self.sampler.next;
            self.take_sample(at);
            self.sampler.next = at.saturating_add(self.sampler.interval);
        }
    }

    fn take_sample(&mut self, at: Picos) {
        let s = &mut self.sampler;
        let seconds = time::to_secs(s.interval);
        let sample = s.series.t_ms.len();
        s.series.t_ms.push(time::to_secs(at) * 1e3);
        s.visit.clear();
        self.fabric.take_changed_flows(&mut s.visit);
        s.apps_ran.drain_into(&mut s.visit);
        // A flow listed twice is unchanged the second time, and skipped.
        for &flow in &s.visit {
            let i = flow as usize;
            let Some(metrics) = self.metrics.get(i) else {
                continue;
            };
            let bytes = self.fabric.flow_bytes_total(flow);
            let messages = metrics.all_messages();
            let (last_bytes, last_messages) = s.last[i];
            if (bytes, messages) == (last_bytes, last_messages) {
                continue;
            }
            s.got.push((
                flow,
                sample as u32,
                (bytes - last_bytes) as f64 * 8.0 / seconds / 1e9,
                (messages - last_messages) as f64 / seconds / 1e6,
            ));
            s.last[i] = (bytes, messages);
        }
        let first = s.series.t_ms.len() == 1;
        for (h, policy) in self.policies.iter().enumerate() {
            let Some(state) = policy.control_state() else {
                continue;
            };
            // A policy reports from its start or never (the flows of its host are known at
            // start), so every control series has one value per sample.
            if first {
                let host = &self.fabric.topology().host_names()[h];
                s.control_of_host[h] = Some(s.series.controls.len());
                s.series.controls.push(ControlSeries::new(host));
            }
            if let Some(index) = s.control_of_host[h] {
                s.series.controls[index].push(&state);
            }
        }
    }
}

impl Sampler {
    /// The series, each flow's columns written out: zero where it got nothing.
    fn finish(mut self) -> RunSeries {
        let samples = self.series.t_ms.len();
        for flow in &mut self.series.flows {
            flow.gbps = vec![0.0; samples];
            flow.mops = vec![0.0; samples];
        }
        for &(flow, sample, gbps, mops) in &self.got {
            let (flow, sample) = (flow as usize, sample as usize);
            self.series.flows[flow].gbps[sample] = gbps;
            self.series.flows[flow].mops[sample] = mops;
        }
        self.series
    }
}

impl World {
    fn host_flow_infos(&self, host: HostId) -> Vec<FlowInfo> {
        self.flows
            .iter()
            .flat_map(|f| f.infos.iter())
            .filter(|(h, _)| *h == host)
            .map(|(_, info)| info.clone())
            .collect()
    }

    /// Runs to the end of the window; `progress` is told the simulated time now and then.
    pub(crate) fn run(mut self, progress: &mut dyn FnMut(Picos)) -> RunReport {
        let started = Instant::now();
        for h in 0..self.policies.len() {
            let host = HostId(h as u16);
            let infos = self.host_flow_infos(host);
            let mut ctx = PolicyContext {
                host,
                fabric: &mut self.fabric,
                queue: &mut self.queue,
                notices: &mut self.notices,
                mailbox: &mut self.mailbox,
            };
            self.policies[h].on_start(&mut ctx, &infos);
        }
        self.drain();
        let end = self.window.1;
        while let Some((at, event)) = self.queue.pop_until(end) {
            self.sample_until(at.saturating_sub(1));
            self.dispatch(event);
            self.drain();
            if self.queue.popped().is_multiple_of(1 << 16) {
                progress(self.queue.now());
            }
        }
        self.queue.advance_to(end);
        self.sample_until(end);
        progress(end);
        self.report(started.elapsed().as_secs_f64())
    }

    fn app_io(&mut self, app: u32) -> (&mut Box<dyn AppModel>, AppIo<'_>) {
        let i = app as usize;
        self.sampler.apps_ran.mark(app);
        let io = AppIo {
            now: self.queue.now(),
            app,
            queue: &mut self.queue,
            posts: &mut self.posts,
            controls: &mut self.controls,
            metrics: &mut self.metrics[i],
            poll: self.poll,
            wakeup: self.wakeup,
            rng: &mut self.app_rng,
            wire_rtt: None,
        };
        (&mut self.apps[i], io)
    }

    fn policy_ctx(&mut self, host: HostId) -> (&mut Box<dyn Policy>, PolicyContext<'_>) {
        let ctx = PolicyContext {
            host,
            fabric: &mut self.fabric,
            queue: &mut self.queue,
            notices: &mut self.notices,
            mailbox: &mut self.mailbox,
        };
        (&mut self.policies[usize::from(host.0)], ctx)
    }

    fn dispatch(&mut self, event: Event) {
        match event {
            Event::Rnic(event) => match self.fabric.handle(event, &mut self.queue) {
                None => {}
                Some(Upcall::Completions { qp, upto }) => {
                    let mut done = std::mem::take(&mut self.completions);
                    done.clear();
                    self.fabric.take_completions(qp, upto, &mut done);
                    let host = self.fabric.host_of(qp);
                    for c in &done {
                        let (policy, mut ctx) = self.policy_ctx(host);
                        policy.on_completion(&mut ctx, c.qp, c.tag);
                    }
                    self.completions = done;
                }
                Some(Upcall::Deliver { qp, bytes }) => {
                    let host = self.fabric.host_of(qp);
                    match self.fabric.owner(qp) {
                        QpOwner::App(app) => {
                            let (policy, mut ctx) = self.policy_ctx(host);
                            if let Some(bytes) = policy.on_delivery(&mut ctx, qp, bytes) {
                                let (model, mut io) = self.app_io(app);
                                model.on_delivery(&mut io, qp, bytes);
                            }
                        }
                        QpOwner::Policy => {
                            self.mailbox
                                .delivered(qp, SIDE_CHANNEL_POLL, &mut self.queue, host);
                        }
                    }
                }
                Some(Upcall::ControlDone { app, issued }) => {
                    let (model, mut io) = self.app_io(app);
                    model.on_control_done(&mut io, issued);
                }
            },
            Event::Switch(event) => self.fabric.handle_switch(event, &mut self.queue),
            Event::AppTimer { app, tag } => {
                let (model, mut io) = self.app_io(app);
                model.on_timer(&mut io, tag);
            }
            Event::PolicyTimer { host, tag } => {
                let (policy, mut ctx) = self.policy_ctx(host);
                policy.on_timer(&mut ctx, tag);
            }
            Event::PolicyMessage { host, slot } => {
                if let Some((from, message)) = self.mailbox.take(slot) {
                    let (policy, mut ctx) = self.policy_ctx(host);
                    policy.on_message(&mut ctx, from, message);
                }
            }
            Event::FlowStart(app) => self.set_flow_active(app, true),
            Event::FlowStop(app) => self.set_flow_active(app, false),
            Event::AppPause(app) => self.apps[app as usize].stop(),
            Event::AppResume(app) => {
                let (model, mut io) = self.app_io(app);
                model.start(&mut io);
            }
            Event::ControlIssue {
                host,
                app,
                verb,
                pages,
                issued,
            } => self
                .fabric
                .control(host, app, verb, pages, issued, &mut self.queue),
        }
    }

    fn set_flow_active(&mut self, app: u32, active: bool) {
        let i = app as usize;
        self.running[i] = active;
        let tenant = self.flows[i].spec.tenant;
        for h in 0..self.flows[i].process_hosts.len() {
            let host = self.flows[i].process_hosts[h];
            self.count_tenant(usize::from(host.0), tenant);
        }
        // Lent out and put back, not cloned: the policies are told without copying the
        // flow's queue pairs at every start and stop.
        let infos = std::mem::take(&mut self.flows[i].infos);
        for (host, info) in &infos {
            let (policy, mut ctx) = self.policy_ctx(*host);
            policy.on_flow_active(&mut ctx, info, active);
        }
        self.flows[i].infos = infos;
        let (model, mut io) = self.app_io(app);
        if active {
            model.start(&mut io);
        } else {
            model.stop();
        }
    }

    /// Counts again the running applications of `tenant` on host `h` (the others' counts
    /// cannot have changed).
    fn count_tenant(&mut self, h: usize, tenant: TenantId) {
        let ht = &mut self.host_tenants[h];
        let mut counted: Option<(u32, u32)> = None;
        for &app in ht.apps.get(&tenant).map_or(&[][..], Vec::as_slice) {
            if !self.running[app as usize] {
                continue;
            }
            let weight = self.flows[app as usize].spec.weight.get();
            let t = counted.get_or_insert((0, 0));
            t.0 = t.0.max(weight);
            t.1 += 1;
        }
        let old = match counted {
            Some(t) => ht.tenants.insert(tenant, t),
            None => ht.tenants.remove(&tenant),
        };
        ht.total_weight -= old.map_or(0, |t| u64::from(t.0));
        ht.total_weight += counted.map_or(0, |t| u64::from(t.0));
    }

    /// The tenant of application `app` on `host`.
    fn tenant_on(&self, host: HostId, app: u32) -> TenantOnHost {
        let ht = &self.host_tenants[usize::from(host.0)];
        let spec = &self.flows[app as usize].spec;
        // An application stopped since it issued the verb counts as its tenant's only
        // process, its own weight (the budget of a process that is leaving matters little).
        let (weight, processes) = ht
            .tenants
            .get(&spec.tenant)
            .copied()
            .unwrap_or((spec.weight.get(), 1));
        TenantOnHost {
            weight,
            total_weight: ht.total_weight.max(u64::from(weight)),
            processes,
        }
    }

    /// Passes same-instant calls along until nothing is left. Inlined into the event loop,
    /// which calls it after every event, while passing calls along, which most events
    /// leave nothing to do for, stays out of line.
    #[inline]
    fn drain(&mut self) {
        if !self.posts.is_empty() || !self.notices.is_empty() || !self.controls.is_empty() {
            self.pass_calls();
        }
    }

    #[inline(never)]
    fn pass_calls(&mut self) {
        let mut posts = Vec::new();
        loop {
            if !self.posts.is_empty() {
                std::mem::swap(&mut posts, &mut self.posts);
                for (qp, wr) in posts.drain(..) {
                    let host = self.fabric.host_of(qp);
                    let (policy, mut ctx) = self.policy_ctx(host);
                    policy.on_post(&mut ctx, qp, wr);
                }
                continue;
            }
            if !self.controls.is_empty() {
                // Control verbs go through the host's policy, which decides when each
                // reaches the RNIC (at once unless it paces them).
                let issued = self.queue.now();
                for (app, verb, pages) in std::mem::take(&mut self.controls) {
                    let host = self.flows[app as usize].host;
                    let call = ControlCall {
                        app,
                        verb,
                        pages,
                        issued,
                        tenant: self.tenant_on(host, app),
                    };
                    let (policy, mut ctx) = self.policy_ctx(host);
                    policy.on_control(&mut ctx, call);
                }
                continue;
            }
            let Some(notice) = self.notices.pop_front() else {
                break;
            };
            let wire_rtt = self.fabric.last_wire_rtt(notice.qp);
            let (model, mut io) = self.app_io(notice.app);
            io.wire_rtt = wire_rtt;
            model.on_completion(&mut io, notice.qp, notice.tag);
        }
    }

    fn report(self, wall_seconds: f64) -> RunReport {
        let seconds = time::to_secs(self.window.1 - self.window.0);
        let flows: Vec<FlowReport> = self
            .flows
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let m = &self.metrics[i];
                let bytes = self.fabric.flow_bytes(i as u32);
                FlowReport {
                    name: f.name.clone(),
                    class: f.class,
                    app: f.app_kind.to_string(),
                    messages: m.messages(),
                    msgs_per_sec: m.messages() as f64 / seconds,
                    gbps: bytes as f64 * 8.0 / seconds / 1e9,
                    latency: m.latency(),
                }
            })
            .collect();
        let busiest = self
            .fabric
            .host_payload_bytes()
            .into_iter()
            .max()
            .unwrap_or(0);
        let utilisation = busiest as f64 * 8.0 / seconds / 1e9 / self.max_rate_gbps;
        let bandwidth: Vec<f64> = flows
            .iter()
            .filter(|f| f.class == FlowClass::Bandwidth)
            .map(|f| f.gbps)
            .collect();
        let mut policy_figures = std::collections::BTreeMap::new();
        for (h, p) in self.policies.iter().enumerate() {
            let host = &self.fabric.topology().host_names()[h];
            for (k, v) in p.figures() {
                policy_figures.insert(format!("{host}.{k}"), v);
            }
        }
        RunReport {
            variant: self.variant,
            policy: self.policy_name,
            flows,
            utilisation,
            jain_bandwidth: jain_index(&bandwidth),
            policy_figures,
            fabric_figures: self.fabric.flow_control_figures(),
            events: self.queue.popped(),
            series: self.sampler.finish(),
            wall_seconds,
        }
    }
}
