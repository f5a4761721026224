//! `justitia`: the command-line front end.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use justitia_core::profile::RnicProfile;

mod backend;
mod cdi;
mod control_plot;
mod daemon_admin;
mod demo;
mod export;
mod oci_hook;
mod plot;
mod progress;
mod run;
mod simulate;
mod suite;
mod table;
mod validate;

/// Software performance isolation for shared RDMA NICs.
#[derive(Parser)]
#[command(name = "justitia", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve `justitia run` clients from another host: start the ends of their flows that
    /// the scenario places on this host, on this host's device (one client at a time).
    RunServer(run::server::RunServerArgs),
    /// Run simulated experiments (scenario files) and report, export and plot the results.
    Sim(simulate::SimArgs),
    /// Run a scenario file on real verbs (each flow its own processes, under the shaper in
    /// runs with a policy) and report as `sim` does; `--compare` puts the model beside it.
    Run(Box<run::RunArgs>),
    /// Run every validation target's scenario and compare the model with the papers' figures.
    Validate(validate::ValidateArgs),
    /// Run a comparison suite (scenario files, one workload on one profile each) and print
    /// one table of every policy against the flows alone, with an optional SVG.
    Suite(suite::SuiteArgs),
    /// List the built-in RNIC profiles.
    Profiles,
    /// Walk through the policy engine's decisions on a built-in RNIC profile.
    Demo {
        /// Built-in RNIC profile to use.
        #[arg(long, default_value = "IB-56")]
        profile: String,
    },
    /// justitiad's status: SafeUtil, Current99, Target99, flow counts.
    Status(daemon_admin::AdminArgs),
    /// The flows registered with justitiad, then the processes holding RDMA queue pairs
    /// with no shaper registered (unshaped).
    Flows(daemon_admin::FlowsArgs),
    /// Write a CDI spec that hands containers the host's RDMA devices with the shaper.
    Cdi(cdi::CdiArgs),
    /// An OCI hook for podman's hooks directory: at `precreate`, adds the shaper's musl
    /// build to a musl container's `LD_PRELOAD`, keeping the image's own preloads.
    OciHook(oci_hook::OciHookArgs),
    /// Change a setting of the running justitiad.
    Set {
        #[command(subcommand)]
        what: SetCommand,
    },
}

#[derive(Subcommand)]
enum SetCommand {
    /// Target99: `150us`, `2ms`, `800ns`, or `2.5x` the probe's idle p99.
    Target {
        /// The new target.
        value: String,
        #[command(flatten)]
        admin: daemon_admin::AdminArgs,
    },
}

fn main() -> ExitCode {
    // Started as the OCI runtime wrapper (a link of that name), it speaks runc's command
    // line, not this one's.
    let mut args = std::env::args_os();
    let invoked = args.next().unwrap_or_default();
    if std::path::Path::new(&invoked)
        .file_name()
        .is_some_and(|name| name == oci_hook::RUNTIME_WRAPPER_NAME)
    {
        let args: Vec<_> = args.collect();
        if let Err(err) = oci_hook::run_runtime(&args) {
            eprintln!("justitia-runc: {}", describe(&err));
        }
        return ExitCode::from(127);
    }
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", describe(&err));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes, outermost first, each said once: some errors repeat their
/// cause's text in their own message, and a reader needs it only once.
fn describe(err: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if !parts
            .last()
            .is_some_and(|previous| previous.contains(&text))
        {
            parts.push(text);
        }
    }
    parts.join(": ")
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Sim(args) => simulate::run(&args)?,
        Command::Run(args) => run::run(&args)?,
        Command::RunServer(args) => run::server::run(&args)?,
        Command::Validate(args) => validate::run(&args)?,
        Command::Suite(args) => suite::run(&args)?,
        Command::Profiles => {
            let profiles = RnicProfile::builtins();
            let width = profiles.iter().map(|p| p.name.len()).max().unwrap_or(0);
            for p in profiles {
                // At least three significant figures, so that a testbed's wire of
                // megabits shows as more than zero.
                let figure = |v: f64| {
                    let decimals = if v > 0.0 {
                        (2 - v.log10().floor() as i32).clamp(1, 9) as usize
                    } else {
                        1
                    };
                    format!("{v:.decimals$}")
                };
                println!(
                    "{:<width$}  {:>7} Gb/s {:>7} Mops/s  mtu {:>4}  chunk {} B / {} B",
                    p.name,
                    figure(p.max_rate_gbps),
                    figure(p.max_tput_mops),
                    p.mtu,
                    p.chunk_bytes_with_latency,
                    p.chunk_bytes_without_latency
                );
            }
        }
        Command::Demo { profile } => demo::run(&profile)?,
        Command::Status(args) => daemon_admin::status(&args)?,
        Command::Flows(args) => daemon_admin::flows(&args)?,
        Command::Cdi(args) => cdi::run(&args)?,
        Command::OciHook(args) => oci_hook::run(&args)?,
        Command::Set {
            what: SetCommand::Target { value, admin },
        } => daemon_admin::set_target(&admin, &value)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use anyhow::Context;

    #[test]
    fn describe_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let repeated = anyhow::Error::new(io)
            .context("reading x.toml: no such file")
            .context("loading scenario file x.toml");
        assert_eq!(
            describe(&repeated),
            "loading scenario file x.toml: reading x.toml: no such file"
        );
        let plain: Result<(), std::io::Error> =
            Err(std::io::Error::new(std::io::ErrorKind::NotFound, "gone"));
        let err = plain.context("opening y").err().map(|e| describe(&e));
        assert_eq!(err.as_deref(), Some("opening y: gone"));
    }

    /// The packaged hook configuration (`oci-hooks(5)`, version 1.0.0) runs this binary's
    /// `oci-hook precreate` at the precreate stage only.
    #[test]
    fn the_packaged_hook_runs_the_precreate_hook() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../packaging/oci-hooks.d/justitia-musl.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let hook: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(hook["version"], "1.0.0");
        assert_eq!(hook["stages"], serde_json::json!(["precreate"]));
        assert_eq!(hook["when"], serde_json::json!({"always": true}));
        assert_eq!(hook["hook"]["path"], "/usr/bin/justitia");
        let timeout = hook["hook"]["timeout"].as_u64().unwrap();
        assert!((1..=30).contains(&timeout), "timeout {timeout} s");
        let args: Vec<String> = serde_json::from_value(hook["hook"]["args"].clone()).unwrap();
        assert_eq!(args[0], "justitia");
        match Cli::try_parse_from(&args).map(|cli| cli.command) {
            Ok(Command::OciHook(_)) => {}
            Ok(_) => panic!("{args:?} is not the oci-hook command"),
            Err(err) => panic!("{args:?} does not parse: {err}"),
        }
    }
}
