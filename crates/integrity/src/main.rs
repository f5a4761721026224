//! `justitia-integrity`: runs seeded random RDMA WRITE, READ and WRITE_WITH_IMM transfers
//! between two RC queue pairs of one device and verifies every byte and every completion.
//! Run it plainly, or under the shaper (`LD_PRELOAD=.../libjustitia.so` with `JUSTITIA_*`
//! settings) to prove that splitting and pacing are invisible to the application.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use justitia_integrity::checker::{CheckError, Report, Rig, RigOptions};
use justitia_integrity::plan::{PlanConfig, Planner};

/// Verify RDMA transfers byte by byte and completion by completion.
#[derive(Parser, Debug)]
#[command(name = "justitia-integrity", version)]
struct Args {
    /// RDMA device (default: the first one).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Port number.
    #[arg(long, default_value_t = 1)]
    port: u8,
    /// GID index (0 is the IPv6 link-local GID on Soft-RoCE).
    #[arg(long, short = 'x', default_value_t = 0)]
    gid_index: u8,
    /// Transfers (work requests) to run at least.
    #[arg(long, short = 'n', default_value_t = 300)]
    transfers: u64,
    /// Seed of the random plan (default: from the clock); printed so a run can be replayed.
    #[arg(long)]
    seed: Option<u64>,
    /// Largest transfer, in bytes (suffixes K and M are binary).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    max_size: usize,
    /// Most SGEs per request.
    #[arg(long, default_value_t = 6)]
    max_sges: usize,
    /// Most requests per batch (all but the last may be unsignaled).
    #[arg(long, default_value_t = 4)]
    max_batch: usize,
    /// Draw a quarter of the sizes within a byte of multiples of this (the shaper's chunk).
    #[arg(long, value_parser = parse_size)]
    boundary: Option<usize>,
    /// Draw no RDMA WRITE_WITH_IMM requests.
    #[arg(long)]
    no_imm: bool,
    /// Seconds to wait for the completions of one batch.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// Bytes with an optional binary suffix: `4096`, `64K`, `16M`.
fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let (digits, scale) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1usize << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{text}` is not a positive size (bytes, or with K, M or G)"))
}

fn clock_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

/// The shaper settings in effect, for the log (a run without them is a baseline).
fn shaper_environment() -> String {
    let mut vars: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("JUSTITIA_") || k == "LD_PRELOAD")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    vars.sort();
    if vars.is_empty() {
        "none (no LD_PRELOAD, no JUSTITIA_* variables)".to_string()
    } else {
        vars.join(" ")
    }
}

fn summary(r: &Report) -> String {
    format!(
        "{} transfers ({} WRITE, {} READ, {} WRITE_WITH_IMM; {} unsignaled), {} bytes, {} send + {} receive completions checked, {} mismatched, {} overruns, {} bad completions",
        r.transfers,
        r.writes,
        r.reads,
        r.writes_with_imm,
        r.unsignaled,
        r.bytes,
        r.send_completions,
        r.recv_completions,
        r.mismatched_transfers,
        r.overruns,
        r.bad_completions
    )
}

fn run(args: &Args) -> Result<bool> {
    if args.max_sges == 0 || args.max_batch == 0 {
        bail!("--max-sges and --max-batch must be at least 1");
    }
    // Every region holds a whole batch, and an SGE's length is a 32-bit field.
    if args.max_size > 1 << 30 {
        bail!(
            "--max-size {} is above the checker's limit of 1G",
            args.max_size
        );
    }
    let seed = args.seed.unwrap_or_else(clock_seed);
    println!("justitia-integrity: seed {seed} (replay with --seed {seed})");
    println!(
        "justitia-integrity: shaper settings: {}",
        shaper_environment()
    );
    let plan = PlanConfig {
        max_size: args.max_size,
        max_sges: args.max_sges,
        max_batch: args.max_batch,
        local_regions: 3,
        remote_regions: 2,
        boundary: args.boundary,
        with_imm: !args.no_imm,
    };
    let options = RigOptions {
        device: args.device.clone(),
        port: args.port,
        gid_index: args.gid_index,
        completion_timeout: Duration::from_secs(args.timeout),
    };
    let mut rig = Rig::open(&options, &plan).map_err(|e| match e {
        // The verbs error's text already names its cause; a chained context would repeat it.
        CheckError::Verbs(v) => anyhow::anyhow!(
            "cannot set up two connected RC queue pairs; this needs an RDMA device \
             (hardware, or Soft-RoCE: `rdma link add rxe0 type rxe netdev <if>`): {v}"
        ),
        other => other.into(),
    })?;
    println!(
        "justitia-integrity: device {}, port {}, GID index {}, up to {} bytes per transfer",
        rig.device(),
        args.port,
        args.gid_index,
        args.max_size
    );
    let mut planner = Planner::new(seed, plan);
    let mut report = Report::default();
    while report.transfers < args.transfers {
        let batch = planner.next_batch();
        rig.run_batch(&batch, &mut report).with_context(|| {
            format!(
                "after {} good transfers (seed {seed}): {}",
                report.transfers,
                summary(&report)
            )
        })?;
    }
    rig.finish()
        .with_context(|| format!("after the last batch (seed {seed})"))?;
    for p in &report.problems {
        println!("justitia-integrity: PROBLEM {p}");
    }
    let verdict = if report.clean() { "PASS" } else { "FAIL" };
    println!(
        "justitia-integrity: {verdict}: {}; seed {seed}",
        summary(&report)
    );
    Ok(report.clean())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("justitia-integrity: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("1"), Ok(1));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("12Q").is_err());
    }
}
