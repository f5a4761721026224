//! The daemon's Prometheus metrics and the small HTTP server that exposes them.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A label of one value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Label {
    /// The class, verdict, reason or uid.
    pub value: String,
}

/// A tenant's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Tenant {
    /// The tenant's uid.
    pub uid: String,
}

/// Every metric the daemon exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// SafeUtil, bytes/s.
    pub safe_util: Gauge<f64, AtomicU64>,
    /// MaxRate, bytes/s.
    pub max_rate: Gauge<f64, AtomicU64>,
    /// Current99, seconds; NaN while there is no estimate (see [`Metrics::registry`]).
    pub current_p99: Gauge<f64, AtomicU64>,
    /// Target99, seconds.
    pub target_p99: Gauge<f64, AtomicU64>,
    /// L, B, T by class.
    pub flows_counted: Family<Label, Gauge>,
    /// Registered flows.
    pub flows_registered: Gauge,
    /// Per-tenant allotment, bytes/s.
    pub tenant_allotment: Family<Tenant, Gauge<f64, AtomicU64>>,
    /// Per-tenant reported usage, bytes.
    pub tenant_usage: Family<Tenant, Counter>,
    /// Probe latency.
    pub probe_latency: Histogram,
    /// Probes lost.
    pub probes_lost: Counter,
    /// Registrations by verdict.
    pub registrations: Family<Label, Counter>,
    /// Flows reclaimed after their process went away.
    pub reclaims: Counter,
    /// Messages refused, by reason.
    pub refused: Family<Label, Counter>,
    /// Times the daemon could not keep the reference flow running.
    pub fail_open: Counter,
    /// The daemon's CPU time.
    pub cpu_seconds: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Fresh metrics (the probe histogram spans 1 us to about 16 s).
    pub fn new() -> Self {
        Metrics {
            safe_util: Gauge::default(),
            max_rate: Gauge::default(),
            current_p99: Gauge::default(),
            target_p99: Gauge::default(),
            flows_counted: Family::default(),
            flows_registered: Gauge::default(),
            tenant_allotment: Family::default(),
            tenant_usage: Family::default(),
            probe_latency: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
            probes_lost: Counter::default(),
            registrations: Family::default(),
            reclaims: Counter::default(),
            refused: Family::default(),
            fail_open: Counter::default(),
            cpu_seconds: Gauge::default(),
        }
    }

    /// A registry holding them.
    ///
    /// Current99 and Target99 can be undefined: Current99 before the first probe sample
    /// and from the update at which the last latency flow leaves (its window restarts and
    /// no probe runs without a latency flow) until a probe completes again, Target99 while
    /// an idle multiple waits for its measurement. Their samples are then NaN, as
    /// Prometheus' own client libraries expose a summary quantile without observations and
    /// as PromQL's `histogram_quantile` answers over no observations: the series stays
    /// present (a missing series reads as a scrape or target problem), a comparison with
    /// NaN is false so no alert fires on it, and dashboards show it as no value.
    /// `justitia status` shows the same absence as `-` (`null` with `--json`).
    pub fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix("justitia");
        r.register(
            "safe_util_bytes_per_second",
            "SafeUtil",
            self.safe_util.clone(),
        );
        r.register(
            "max_rate_bytes_per_second",
            "MaxRate of the profile",
            self.max_rate.clone(),
        );
        r.register(
            "current_p99_seconds",
            "Current99: p99 of the reference flow's post-to-completion time (NaN: no estimate)",
            self.current_p99.clone(),
        );
        r.register(
            "target_p99_seconds",
            "Target99 in effect (NaN: an idle multiple not yet measured)",
            self.target_p99.clone(),
        );
        r.register(
            "flows_counted",
            "Active flows counted by class (L, B, T)",
            self.flows_counted.clone(),
        );
        r.register(
            "flows_registered",
            "Flows registered",
            self.flows_registered.clone(),
        );
        r.register(
            "tenant_allotment_bytes_per_second",
            "Sum of a tenant's allotments",
            self.tenant_allotment.clone(),
        );
        r.register(
            "tenant_usage_bytes",
            "Bytes a tenant's shapers reported posting",
            self.tenant_usage.clone(),
        );
        r.register(
            "probe_latency_seconds",
            "Reference flow post-to-completion time",
            self.probe_latency.clone(),
        );
        r.register(
            "probes_lost",
            "Probes lost (timed out or failed)",
            self.probes_lost.clone(),
        );
        r.register(
            "registrations",
            "Flow registrations by verdict",
            self.registrations.clone(),
        );
        r.register(
            "reclaims",
            "Flows reclaimed after their process hung up or exited",
            self.reclaims.clone(),
        );
        r.register(
            "messages_refused",
            "Registration-socket messages refused, by reason",
            self.refused.clone(),
        );
        r.register("fail_open_events", "Times the reference flow could not be run (shapers keep their last allotment until the heartbeat goes stale)", self.fail_open.clone());
        r.register(
            "process_cpu_seconds",
            "CPU time (user + system) the daemon has used",
            self.cpu_seconds.clone(),
        );
        r
    }
}

/// The daemon's CPU time so far (user + system, all threads), seconds.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Serves `GET /metrics` on `addr` from a thread of its own.
pub fn serve(addr: &str, metrics: Metrics) -> Result<std::thread::JoinHandle<()>, String> {
    let server =
        tiny_http::Server::http(addr).map_err(|e| format!("metrics endpoint {addr}: {e}"))?;
    let registry = Arc::new(metrics.registry());
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let response = if request.url() == "/metrics" {
                    metrics.cpu_seconds.set(cpu_seconds());
                    let mut body = String::new();
                    match prometheus_client::encoding::text::encode(&mut body, &registry) {
                        Ok(()) => {
                            let mut r = tiny_http::Response::from_string(body);
                            if let Ok(h) = "Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8"
                                .parse::<tiny_http::Header>()
                            {
                                r.add_header(h);
                            }
                            r
                        }
                        Err(e) => tiny_http::Response::from_string(format!("encoding: {e}")).with_status_code(500),
                    }
                } else {
                    tiny_http::Response::from_string("not found: try /metrics\n").with_status_code(404)
                };
                let _ = request.respond(response);
            }
        })
        .map_err(|e| format!("starting the metrics thread: {e}"))
}
