//! `native`: no isolation. Every request goes to the RNIC as posted.

use super::{Policy, PolicyContext};
use crate::rnic::{QpId, WorkRequest};

/// The RNIC as the applications find it.
#[derive(Debug, Default)]
pub struct NativePolicy;

impl Policy for NativePolicy {
    fn name(&self) -> &str {
        "native"
    }

    fn on_post(&mut self, ctx: &mut PolicyContext<'_>, qp: QpId, wr: WorkRequest) {
        ctx.post(qp, wr);
    }
}
