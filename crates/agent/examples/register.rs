//! Registers one flow with `justitiad`, reports it active and holds it for a while, so the
//! daemon runs the reference flow (for a latency flow) or hands out an allotment (for a
//! resource-hungry one) without any shaper loaded.
//!
//! `cargo run -p justitia-agent --example register -- [SOCKET] [CLASS] [SECONDS]`
//! (defaults: the daemon's default socket, `latency`, 30 s). Prints one line when the
//! daemon answers, and exits 0 after the hold, 1 if the flow was not registered, 2 on a
//! bad argument.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use justitia_agent::block::monotonic_ns;
use justitia_agent::client::{AgentClient, FlowState, DEFAULT_SOCKET};
use justitia_core::flow::FlowClass;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let socket = args.first().map_or(DEFAULT_SOCKET, String::as_str);
    let class = match args.get(1).map_or("latency", String::as_str) {
        "latency" => FlowClass::Latency,
        "bandwidth" => FlowClass::Bandwidth,
        "throughput" => FlowClass::Throughput,
        other => {
            eprintln!("register: unknown class `{other}` (latency, bandwidth or throughput)");
            return ExitCode::from(2);
        }
    };
    let hold = match args.get(2).map(|s| s.parse::<u64>()) {
        None => Duration::from_secs(30),
        Some(Ok(s)) => Duration::from_secs(s),
        Some(Err(e)) => {
            eprintln!("register: hold time `{}`: {e}", args[2]);
            return ExitCode::from(2);
        }
    };
    let mut client = match AgentClient::connect(socket) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("register: {e}");
            return ExitCode::from(1);
        }
    };
    let flow = client.register(class, 1, 0);
    match client.wait_registered(flow, Duration::from_secs(5)) {
        FlowState::Registered {
            flow: id,
            admission,
        } => {
            println!("registered {class} flow {id} ({admission:?}), holding it for {hold:?}");
        }
        other => {
            eprintln!("register: {class} flow not registered: {other:?}");
            return ExitCode::from(1);
        }
    }
    let start = Instant::now();
    // Report activity now and then, as a shaper would, and keep the connection serviced.
    while start.elapsed() < hold {
        client.tick(monotonic_ns());
        client.report_usage(flow, true, 10, 1);
        std::thread::sleep(Duration::from_millis(100));
    }
    client.unregister(flow);
    ExitCode::SUCCESS
}
