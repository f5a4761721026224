//! From a scenario to the flows a real run starts: what the real backend refuses, and the
//! plan of each flow of each run.
//!
//! Everything refused is refused by name before any process starts: a policy only the
//! simulator has, virtual lanes, an application model without a real counterpart, pauses;
//! a run that would start more processes than allowed; a host without the RDMA device
//! asked for. A scenario's topology (its kind, its switch, how many hosts) is the model's:
//! on real verbs each host runs where `--host` places it and the hosts' own network joins
//! them.

use std::fs;
use std::io::ErrorKind;
use std::path::Path;

use anyhow::{bail, Context, Result};

use justitia_core::flow::FlowClass;
use justitia_loadgen::plan::{FlowPlan, LatencyMethod, Op, Polling, Workload};
use justitia_sim::app::latency::LatencyMode;
use justitia_sim::app::Polling as SimPolling;
use justitia_sim::policy::PolicySpec;
use justitia_sim::rnic::Opcode;
use justitia_sim::scenario::{AppSpec, ResolvedVariant};
use justitia_sim::Experiment;

/// One flow of a real run.
#[derive(Clone, Debug, PartialEq)]
pub struct RealFlow {
    /// What its processes do.
    pub plan: FlowPlan,
    /// The class the shaper is told.
    pub class: FlowClass,
    /// The application model's name in reports.
    pub app: &'static str,
    /// The scenario host its requester runs on (`from`).
    pub from: String,
    /// The scenario host its responder runs on (`to`).
    pub to: String,
}

/// One run (variant) of a scenario on real verbs.
#[derive(Clone, Debug, PartialEq)]
pub struct RealRun {
    /// The variant as the simulator resolves it.
    pub variant: ResolvedVariant,
    /// Its flows, in scenario order.
    pub flows: Vec<RealFlow>,
}

/// How long runs last on the device, which may differ from the scenario's simulated time:
/// a process needs far longer than a simulated 30 ms to say anything steady.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Each run, ms.
    pub duration_ms: f64,
    /// Its unmeasured start, ms.
    pub warmup_ms: f64,
}

/// The policies a real run can apply, through the shaper's `JUSTITIA_POLICY`. Under
/// `adaptive` the shaper paces at the allotments of a justitiad whose own policy is
/// `adaptive` (without one, as under `justitia`): the run names the shaper's side, the
/// host's daemon the law.
pub fn shaper_policy(policy: PolicySpec) -> Option<Option<&'static str>> {
    match policy {
        PolicySpec::Native => Some(None),
        PolicySpec::Justitia => Some(Some("justitia")),
        PolicySpec::Preempt => Some(Some("preempt")),
        PolicySpec::Adaptive => Some(Some("adaptive")),
        PolicySpec::Priority => None,
    }
}

/// Everything in `experiment` the real backend cannot run, each naming the field, flow or
/// run; empty when it can run all of it.
pub fn refusals(experiment: &Experiment) -> Vec<String> {
    let s = &experiment.scenario;
    let mut out = Vec::new();
    for (i, flow) in s.flows.iter().enumerate() {
        let at = format!("flows[{i}] ({})", flow.name);
        match flow.app() {
            Some(AppSpec::Rpc(_)) => out.push(format!(
                "{at}: an rpc service is a simulator-only application model"
            )),
            Some(AppSpec::Storage(_)) => out.push(format!(
                "{at}: a storage service is a simulator-only application model"
            )),
            Some(AppSpec::Control(_)) => out.push(format!(
                "{at}: a control-verb storm is a simulator-only application model"
            )),
            _ => {}
        }
        if flow.memory.is_some() {
            out.push(format!("{at}: memory is simulator-only"));
        }
        if !flow.post_receives {
            out.push(format!("{at}: post_receives = false is simulator-only"));
        }
        if flow.sl != 0 {
            out.push(format!(
                "{at}: sl = {}: service levels select a modelled switch's virtual lanes",
                flow.sl
            ));
        }
        if !flow.pauses_ms.is_empty() {
            out.push(format!("{at}: pauses_ms is simulator-only"));
        }
    }
    for v in s.variants() {
        if shaper_policy(v.policy).is_none() {
            out.push(format!(
                "run `{}`: policy {} is simulator-only (the shaper applies justitia, adaptive and preempt)",
                v.name,
                v.policy.as_str()
            ));
        }
    }
    out
}

/// The runs named in `only` (all of them when it is empty), in the scenario's order; a
/// name that is no run of the scenario is refused, naming those it has.
pub fn only(runs: Vec<RealRun>, only: &[String]) -> Result<Vec<RealRun>> {
    if only.is_empty() {
        return Ok(runs);
    }
    let names: Vec<&str> = runs.iter().map(|r| r.variant.name.as_str()).collect();
    if let Some(unknown) = only.iter().find(|n| !names.contains(&n.trim())) {
        bail!(
            "--only {unknown:?}: the scenario has no run of that name (its runs: {})",
            names.join(", ")
        );
    }
    Ok(runs
        .into_iter()
        .filter(|r| only.iter().any(|n| n.trim() == r.variant.name))
        .collect())
}

/// Processes a run starts: a responder and a requester for each flow.
pub fn processes(run: &RealRun) -> usize {
    2 * run.flows.len()
}

/// Refuses, naming the run and its flows, any run that would start more than
/// `max_processes` processes.
pub fn check_processes(runs: &[RealRun], max_processes: usize) -> Result<()> {
    for run in runs {
        let n = processes(run);
        if n > max_processes {
            bail!(
                "run `{}` would start {n} processes (a responder and a requester for each of its {} flows), more than --max-processes {max_processes}; raise it if this host can take them",
                run.variant.name,
                run.flows.len()
            );
        }
    }
    Ok(())
}

/// The RDMA devices the kernel lists in `sysfs_dir` (`/sys/class/infiniband`), sorted;
/// empty when the folder is missing.
pub fn rdma_devices(sysfs_dir: &Path) -> Result<Vec<String>> {
    let entries = match fs::read_dir(sysfs_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", sysfs_dir.display())),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", sysfs_dir.display()))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// Refuses a p99 verdict (`max_p99_ratio` given) on a latency flow timed by RPerf's method
/// whose two ends run on one device (`one_device` says which do): the "wire" SEND is then
/// itself a loopback inside the NIC and T_W - T_L subtracts the very queueing in the shared
/// NIC that the verdict is about (the model shows it: RPerf's p99 is the same alone,
/// beside a bandwidth flow and under Justitia, where ping-pong's grows and shrinks). With
/// the ends on two hosts the wire SEND crosses the wire, as RPerf means it to. RPerf
/// figures are still measured and shown; only the judgement is refused.
pub fn check_rperf_verdict(
    runs: &[RealRun],
    max_p99_ratio: Option<f64>,
    one_device: &dyn Fn(&RealFlow) -> bool,
) -> Result<()> {
    if max_p99_ratio.is_none() {
        return Ok(());
    }
    let rperf: Vec<&str> = runs
        .iter()
        .flat_map(|r| &r.flows)
        .filter(|f| {
            one_device(f)
                && matches!(
                    f.plan.workload,
                    Workload::Latency {
                        method: LatencyMethod::Rperf,
                        ..
                    }
                )
        })
        .map(|f| f.plan.name.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if let Some(first) = rperf.first() {
        bail!(
            "--max-p99-ratio on RPerf figures taken on one device: flow {first}{} is timed by \
             RPerf (T_W - T_L), whose wire SEND here is a loopback inside the same NIC, so the \
             difference cancels the NIC queueing a verdict judges; time it with \
             --latency-method ping-pong or post-poll for a verdict, or drop --max-p99-ratio \
             to see the RPerf figures",
            if rperf.len() > 1 {
                format!(" (and {} more)", rperf.len() - 1)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// Whether the device the load generators open (`wanted`, else every device listed, as a
/// load generator without `--device` may open any) is a software RNIC: Soft-RoCE or siw,
/// which the kernel runs on the host's CPUs. Known by the `parent` attribute both give
/// their device (the network interface they run over), or by their drivers' default names.
pub fn software_rnic(sysfs_dir: &Path, wanted: Option<&str>) -> Result<bool> {
    let devices = match wanted {
        Some(name) => vec![name.to_string()],
        None => rdma_devices(sysfs_dir)?,
    };
    Ok(!devices.is_empty()
        && devices.iter().all(|d| {
            d.starts_with("rxe")
                || d.starts_with("siw")
                || sysfs_dir.join(d).join("parent").exists()
        }))
}

/// Refuses a host with no RDMA device in `sysfs_dir`, or without the device `wanted`,
/// before any load generator starts: each would fail on its own, with the verbs library's
/// less telling error.
pub fn check_device(sysfs_dir: &Path, wanted: Option<&str>) -> Result<()> {
    let devices = rdma_devices(sysfs_dir)?;
    if devices.is_empty() {
        bail!(
            "no RDMA device ({} is empty or missing): load the driver, or add a Soft-RoCE device with `rdma link add rxe0 type rxe netdev <interface>`",
            sysfs_dir.display()
        );
    }
    if let Some(name) = wanted {
        if !devices.iter().any(|d| d == name) {
            bail!(
                "RDMA device {name} not found in {} (devices here: {})",
                sysfs_dir.display(),
                devices.join(", ")
            );
        }
    }
    Ok(())
}

fn op(opcode: Opcode) -> Op {
    match opcode {
        Opcode::Write => Op::Write,
        Opcode::Read => Op::Read,
        Opcode::Send => Op::Send,
    }
}

fn polling(p: SimPolling) -> Polling {
    match p {
        SimPolling::Busy => Polling::Busy,
        SimPolling::Event => Polling::Event,
    }
}

/// The plans of every run, with times scaled from the scenario's duration to `timing`'s
/// and latency flows timed by `method` when given (else as the scenario says).
/// Call only on experiments without [`refusals`].
pub fn runs(
    experiment: &Experiment,
    timing: Timing,
    method: Option<LatencyMethod>,
) -> Vec<RealRun> {
    let s = &experiment.scenario;
    let scale = timing.duration_ms / s.duration_ms;
    s.variants()
        .into_iter()
        .map(|variant| {
            let flows = variant
                .flows
                .iter()
                .filter_map(|r| {
                    let spec = &s.flows[r.spec];
                    let app = spec.app()?;
                    let (from, to) = s.endpoints(spec);
                    let workload = match app {
                        AppSpec::Latency(p) => Workload::Latency {
                            size: p.size.bytes(),
                            op: op(p.opcode),
                            method: method.unwrap_or(match p.mode {
                                LatencyMode::PostPoll => LatencyMethod::PostPoll,
                                LatencyMode::PingPong => LatencyMethod::PingPong,
                                LatencyMode::Rperf => LatencyMethod::Rperf,
                            }),
                            inline: p.inline,
                            interval_us: p.interval_us,
                        },
                        AppSpec::Bandwidth(p) => Workload::Stream {
                            size: p.size.bytes(),
                            qps: p.qps,
                            depth: p.depth,
                            batch: 1,
                            op: op(p.opcode),
                            inline: false,
                            polling: polling(p.polling),
                        },
                        AppSpec::Throughput(p) => Workload::Stream {
                            size: p.size.bytes(),
                            qps: p.qps,
                            depth: p.depth.unwrap_or(p.batch).max(p.batch),
                            batch: p.batch,
                            op: op(p.opcode),
                            inline: p.inline,
                            polling: polling(p.polling),
                        },
                        AppSpec::Rpc(_) | AppSpec::Storage(_) | AppSpec::Control(_) => return None,
                    };
                    Some(RealFlow {
                        plan: FlowPlan {
                            name: r.name.clone(),
                            workload,
                            start_ms: spec.start_ms * scale,
                            stop_ms: spec.stop_ms.unwrap_or(s.duration_ms).min(s.duration_ms)
                                * scale,
                            window_from_ms: timing.warmup_ms,
                            window_to_ms: timing.duration_ms,
                        },
                        class: spec.class(),
                        app: app.kind(),
                        from,
                        to,
                    })
                })
                .collect();
            RealRun { variant, flows }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use justitia_sim::Scenario;

    #[test]
    fn a_run_over_the_process_cap_is_refused_by_name() {
        // 300 copies of one bandwidth flow beside a latency flow: 301 flows, 602 processes.
        let e = experiment(&format!(
            "{HEAD}[[flows]]\nname = \"lat\"\n[flows.latency]\nsize = 16\n\
             [[flows]]\nname = \"bw\"\ncopies = 300\n[flows.bandwidth]\nsize = \"1MB\"\n"
        ));
        let timing = Timing {
            duration_ms: 1000.0,
            warmup_ms: 100.0,
        };
        let runs = runs(&e, timing, None);
        assert_eq!(processes(&runs[0]), 602);
        let err = check_processes(&runs, 64).unwrap_err().to_string();
        assert!(
            err.contains("would start 602 processes (a responder and a requester for each of its 301 flows), more than --max-processes 64"),
            "{err}"
        );
        assert!(check_processes(&runs, 602).is_ok());
    }

    #[test]
    fn a_host_without_the_device_is_refused_once_by_name() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let sysfs = dir.path().join("infiniband");
        let missing = check_device(&sysfs, None).unwrap_err().to_string();
        let expected = format!("no RDMA device ({} is empty or missing)", sysfs.display());
        assert!(missing.starts_with(&expected), "{missing}");
        assert_eq!(missing.matches("no RDMA device").count(), 1);
        fs::create_dir(&sysfs).unwrap_or_else(|e| panic!("{e}"));
        let empty = check_device(&sysfs, Some("rxe0")).unwrap_err().to_string();
        assert!(empty.starts_with(&expected), "{empty}");
        for name in ["rxe0", "mlx5_0"] {
            fs::create_dir(sysfs.join(name)).unwrap_or_else(|e| panic!("{e}"));
        }
        assert!(check_device(&sysfs, None).is_ok());
        assert!(check_device(&sysfs, Some("rxe0")).is_ok());
        let other = check_device(&sysfs, Some("mlx4_0"))
            .unwrap_err()
            .to_string();
        assert!(other.ends_with("(devices here: mlx5_0, rxe0)"), "{other}");
    }

    /// A p99 verdict on RPerf figures from one device is refused before anything starts,
    /// naming the flow; RPerf without a p99 limit, and ping-pong with one, are not.
    #[test]
    fn a_p99_verdict_on_rperf_figures_from_one_device_is_refused() {
        let e = experiment(&format!(
            "{HEAD}[[flows]]\nname = \"lat\"\n[flows.latency]\nsize = 16\n\
             [[flows]]\nname = \"bw\"\n[flows.bandwidth]\nsize = \"1MB\"\n"
        ));
        let timing = Timing {
            duration_ms: 1000.0,
            warmup_ms: 100.0,
        };
        let rperf = runs(&e, timing, Some(LatencyMethod::Rperf));
        let err = check_rperf_verdict(&rperf, Some(1.2), &|_| true)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(
                "--max-p99-ratio on RPerf figures taken on one device: flow lat is timed by RPerf"
            ),
            "{err}"
        );
        assert!(check_rperf_verdict(&rperf, None, &|_| true).is_ok());
        let ping_pong = runs(&e, timing, Some(LatencyMethod::PingPong));
        assert!(check_rperf_verdict(&ping_pong, Some(1.2), &|_| true).is_ok());
        // With the flow's ends on two hosts the wire SEND crosses a wire: judged.
        assert!(check_rperf_verdict(&rperf, Some(1.2), &|f| f.from == f.to).is_ok());
        assert_eq!(
            (
                rperf[0].flows[0].from.as_str(),
                rperf[0].flows[0].to.as_str()
            ),
            ("a", "b")
        );
    }

    /// Soft-RoCE and siw are known by name or by the `parent` attribute they give their
    /// device; a hardware RNIC has neither, and a host of both kinds spins unless the
    /// device named is a software one.
    #[test]
    fn a_software_rnic_is_known_by_its_parent_or_its_drivers_name() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let sysfs = dir.path().join("infiniband");
        assert!(!software_rnic(&sysfs, None).unwrap(), "no device at all");
        for name in ["mlx5_0", "rxe0", "roce_a"] {
            fs::create_dir_all(sysfs.join(name)).unwrap_or_else(|e| panic!("{e}"));
        }
        fs::write(sysfs.join("roce_a").join("parent"), "eth1\n").unwrap_or_else(|e| panic!("{e}"));
        assert!(software_rnic(&sysfs, Some("rxe0")).unwrap());
        assert!(
            software_rnic(&sysfs, Some("roce_a")).unwrap(),
            "a renamed rxe device"
        );
        assert!(!software_rnic(&sysfs, Some("mlx5_0")).unwrap());
        assert!(
            !software_rnic(&sysfs, None).unwrap(),
            "any device may be opened"
        );
        fs::remove_dir(sysfs.join("mlx5_0")).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            software_rnic(&sysfs, None).unwrap(),
            "only software ones left"
        );
    }

    fn experiment(text: &str) -> Experiment {
        let scenario = Scenario::from_toml(text, "test").unwrap_or_else(|e| panic!("{e}"));
        Experiment {
            name: "t".into(),
            scenario,
            profile: justitia_sim::ModelProfile::builtin("IB-56").unwrap_or_else(|e| panic!("{e}")),
        }
    }

    const HEAD: &str =
        "description = \"d\"\nprofile = \"IB-56\"\nduration_ms = 10\nwarmup_ms = 1\n";

    #[test]
    fn only_keeps_the_named_runs_in_order_and_refuses_an_unknown_name() {
        let e = experiment(&format!(
            "{HEAD}[[flows]]\nname = \"lat\"\n[flows.latency]\nsize = 16\n\
             [[flows]]\nname = \"bw\"\n[flows.bandwidth]\nsize = \"1MB\"\n\
             [[variants]]\nname = \"alone\"\nflows = [\"lat\"]\n\
             [[variants]]\nname = \"with bw\"\n"
        ));
        let timing = Timing {
            duration_ms: 1000.0,
            warmup_ms: 100.0,
        };
        let all = || runs(&e, timing, None);
        let names = |rs: &[RealRun]| {
            rs.iter()
                .map(|r| r.variant.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&only(all(), &[]).unwrap()), names(&all()));
        let picked = only(all(), &["with bw".to_string(), " alone".to_string()]).unwrap();
        assert_eq!(names(&picked), vec!["alone", "with bw"]);
        let err = only(all(), &["native".to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"native\"") && err.contains("alone, with bw"),
            "{err}"
        );
    }

    #[test]
    fn a_switched_scenario_of_three_hosts_plans_each_flow_between_its_hosts() {
        let mut e = experiment(&format!(
            "{HEAD}[topology]\nkind = \"switch\"\nhosts = [\"a\", \"b\", \"c\"]\n\
             [[flows]]\nname = \"wa\"\nfrom = \"a\"\nto = \"b\"\n[flows.bandwidth]\nsize = \"64KB\"\n\
             [[flows]]\nname = \"wc\"\nfrom = \"c\"\nto = \"b\"\n[flows.bandwidth]\nsize = \"64KB\"\n"
        ));
        e.profile =
            justitia_sim::ModelProfile::builtin("IB-56-switch").unwrap_or_else(|e| panic!("{e}"));
        assert!(refusals(&e).is_empty(), "{:?}", refusals(&e));
        let runs = runs(
            &e,
            Timing {
                duration_ms: 1000.0,
                warmup_ms: 100.0,
            },
            None,
        );
        let ends: Vec<(&str, &str)> = runs[0]
            .flows
            .iter()
            .map(|f| (f.from.as_str(), f.to.as_str()))
            .collect();
        assert_eq!(ends, [("a", "b"), ("c", "b")]);
    }

    #[test]
    fn simulator_only_features_are_refused_by_name() {
        let e = experiment(&format!(
            "{HEAD}[[flows]]\nname = \"lat\"\nsl = 1\n[flows.latency]\nsize = 16\n\
             [[flows]]\nname = \"svc\"\n[flows.rpc]\nrequest_size = 64\nbatch = 8\n\
             [[variants]]\nname = \"prio\"\npolicy = \"priority\"\n"
        ));
        let r = refusals(&e);
        assert!(
            r.iter().any(|m| m.contains("flows[0] (lat): sl = 1")),
            "{r:?}"
        );
        assert!(
            r.iter()
                .any(|m| m.contains("flows[1] (svc): an rpc service")),
            "{r:?}"
        );
        assert!(
            r.iter().any(|m| m.contains("run `prio`: policy priority")),
            "{r:?}"
        );
    }

    #[test]
    fn plans_follow_the_scenario_scaled_to_the_real_duration() {
        let e = experiment(&format!(
            "{HEAD}[[flows]]\nname = \"lat\"\n[flows.latency]\nsize = 16\nmode = \"ping-pong\"\n\
             [[flows]]\nname = \"bw\"\nstart_ms = 2\n[flows.bandwidth]\nsize = \"1MB\"\ndepth = 8\nopcode = \"read\"\n\
             [[flows]]\nname = \"tput\"\n[flows.throughput]\nsize = 16\nbatch = 32\nqps = 2\n"
        ));
        assert!(refusals(&e).is_empty());
        let runs = runs(
            &e,
            Timing {
                duration_ms: 1000.0,
                warmup_ms: 100.0,
            },
            None,
        );
        assert_eq!(runs.len(), 1);
        let flows = &runs[0].flows;
        assert_eq!(flows.len(), 3);
        assert!(matches!(
            flows[0].plan.workload,
            Workload::Latency {
                size: 16,
                method: LatencyMethod::PingPong,
                ..
            }
        ));
        // 2 ms of 10 ms simulated is 200 ms of 1000 ms measured.
        assert_eq!(flows[1].plan.start_ms, 200.0);
        assert_eq!(flows[1].plan.stop_ms, 1000.0);
        assert!(matches!(
            flows[1].plan.workload,
            Workload::Stream {
                size: 1_048_576,
                depth: 8,
                batch: 1,
                op: Op::Read,
                polling: Polling::Event,
                ..
            }
        ));
        assert!(matches!(
            flows[2].plan.workload,
            Workload::Stream {
                qps: 2,
                depth: 32,
                batch: 32,
                ..
            }
        ));
        assert_eq!(flows[2].class, FlowClass::Throughput);
        let forced = super::runs(
            &e,
            Timing {
                duration_ms: 1000.0,
                warmup_ms: 100.0,
            },
            Some(LatencyMethod::Rperf),
        );
        assert!(matches!(
            forced[0].flows[0].plan.workload,
            Workload::Latency {
                method: LatencyMethod::Rperf,
                ..
            }
        ));
    }
}
