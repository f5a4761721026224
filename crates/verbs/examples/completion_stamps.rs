//! Checks NIC completion time stamps on a real device: a CQ made with them
//! (`CompletionQueue::new_timestamped`) exactly where the device offers them
//! (`hca_core_clock`), refused where it does not, and a plain CQ refusing the stamped
//! poll. The guest suite runs it on Soft-RoCE, which offers none.
//!
//! ```text
//! completion_stamps [DEVICE]
//! ```
//!
//! Prints what it found on one line; exits 1 when the device and the CQ disagree.

use std::process::ExitCode;
use std::sync::Arc;

use justitia_verbs::{CompletionQueue, Context, Ibverbs};

fn main() -> ExitCode {
    match check(std::env::args().nth(1).as_deref()) {
        Ok(found) => {
            println!("{found}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("mismatch: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(device: Option<&str>) -> Result<String, String> {
    let verbs = Arc::new(Ibverbs::load().map_err(|e| format!("loading libibverbs: {e}"))?);
    let ctx = Context::open(verbs, device).map_err(|e| format!("opening the device: {e}"))?;
    let plain = CompletionQueue::new(&ctx, 16, None).map_err(|e| format!("a plain CQ: {e}"))?;
    if plain.is_timestamped() || plain.poll_timestamped().is_ok() {
        return Err("a plain CQ took a stamped poll".into());
    }
    let made = CompletionQueue::new_timestamped(&ctx, 16, None);
    match (ctx.completion_clock_khz(), made) {
        (Some(khz), Ok(cq)) => {
            let empty = cq
                .poll_timestamped()
                .map_err(|e| format!("offered at {khz} kHz, the stamped poll failed: {e}"))?;
            if empty.is_some() {
                return Err("a completion on a CQ nothing was posted to".into());
            }
            Ok(format!(
                "offered at {khz} kHz: a stamped CQ made and polled empty"
            ))
        }
        (Some(khz), Err(e)) => Err(format!(
            "offered at {khz} kHz, yet the stamped CQ was refused: {e}"
        )),
        (None, Ok(_)) => Err("no clock offered, yet a stamped CQ was made".into()),
        (None, Err(e)) => Ok(format!("none offered: a stamped CQ refused ({e})")),
    }
}
