//! `justitia`: the command-line front end.

use anyhow::Result;
use clap::{Parser, Subcommand};
use justitia_core::profile::RnicProfile;

mod demo;

/// Software performance isolation for shared RDMA NICs.
#[derive(Parser)]
#[command(name = "justitia", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the built-in RNIC profiles.
    Profiles,
    /// Walk through the policy engine's decisions on a built-in RNIC profile.
    Demo {
        /// Built-in RNIC profile to use.
        #[arg(long, default_value = "IB-56")]
        profile: String,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Profiles => {
            for p in RnicProfile::builtins() {
                println!(
                    "{:<10} {:>6.1} Gb/s {:>6.1} Mops/s  mtu {:>4}  chunk {} B / {} B",
                    p.name,
                    p.max_rate_gbps,
                    p.max_tput_mops,
                    p.mtu,
                    p.chunk_bytes_with_latency,
                    p.chunk_bytes_without_latency
                );
            }
        }
        Command::Demo { profile } => demo::run(&profile)?,
    }
    Ok(())
}
