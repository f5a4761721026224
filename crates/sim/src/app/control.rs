//! The control-verb storm: an application that registers memory regions or creates queue
//! pairs over and over, as Husky's control-verb attackers do (NSDI'23, §4). It moves no
//! data: each verb goes through its host's policy (which may hold it to the tenant's share
//! of a budget, `policy::control_verbs`), runs on the host's RNIC control path
//! (`rnic::control`), and what it creates takes entries in the RNIC's caches. Back to back
//! (`interval_us = 0`) it issues the next verb when the last completes; otherwise one every
//! `interval_us`, whether the last completed or not. Every verb's issue-to-completion time
//! (a policy's wait included) is a latency sample and a message.

use serde::{Deserialize, Serialize};

use super::{AppIo, AppModel};
use crate::rnic::{ControlVerb, QpId, DEFAULT_PAGE_BYTES};
use crate::time::{self, Picos};
use crate::units::ByteSize;

/// Parameters of a control-verb storm.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlParams {
    /// The verb: `reg-mr` or `create-qp`.
    #[serde(with = "verb_name")]
    pub verb: ControlVerb,
    /// Size of each region registered (`reg-mr`), in 4 KB pages rounded up.
    #[serde(default = "page")]
    pub mr_size: ByteSize,
    /// Time between verbs in us; 0 (the default): the next as soon as the last completes.
    #[serde(default)]
    pub interval_us: f64,
}

/// The verb as scenarios name it. The core's type carries no names of its own (the core
/// has no file format), so they are given here, where scenario files are read.
mod verb_name {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    use crate::rnic::ControlVerb;

    /// The names, in the order the error lists them.
    const NAMES: &[&str] = &["reg-mr", "create-qp"];

    /// Writes the verb's name.
    pub(super) fn serialize<S: Serializer>(verb: &ControlVerb, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match verb {
            ControlVerb::RegMr => "reg-mr",
            ControlVerb::CreateQp => "create-qp",
        })
    }

    /// Reads a verb's name, refusing any other as serde refuses an unknown variant.
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ControlVerb, D::Error> {
        let name = String::deserialize(d)?;
        match name.as_str() {
            "reg-mr" => Ok(ControlVerb::RegMr),
            "create-qp" => Ok(ControlVerb::CreateQp),
            _ => Err(D::Error::unknown_variant(&name, NAMES)),
        }
    }
}

fn page() -> ByteSize {
    ByteSize(DEFAULT_PAGE_BYTES)
}

/// Timer tag of the next verb of an open-loop storm.
const NEXT: u64 = 0;

/// A control-verb storm.
pub(crate) struct ControlApp {
    verb: ControlVerb,
    pages: u32,
    /// Between verbs (0: closed loop).
    interval: Picos,
    running: bool,
}

impl ControlApp {
    pub(crate) fn new(p: &ControlParams) -> Self {
        let pages = p.mr_size.bytes().div_ceil(DEFAULT_PAGE_BYTES).max(1);
        ControlApp {
            verb: p.verb,
            pages: u32::try_from(pages).unwrap_or(u32::MAX),
            interval: time::from_ns(p.interval_us * 1e3),
            running: false,
        }
    }

    fn issue(&mut self, io: &mut AppIo<'_>) {
        io.control(self.verb, self.pages);
        if self.interval > 0 {
            io.timer(io.now() + self.interval, NEXT);
        }
    }
}

impl AppModel for ControlApp {
    fn start(&mut self, io: &mut AppIo<'_>) {
        self.running = true;
        self.issue(io);
    }

    fn stop(&mut self) {
        self.running = false;
    }

    fn on_timer(&mut self, io: &mut AppIo<'_>, tag: u64) {
        if tag == NEXT && self.running {
            self.issue(io);
        }
    }

    fn on_completion(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _tag: u64) {}

    fn on_delivery(&mut self, _io: &mut AppIo<'_>, _qp: QpId, _bytes: u32) {}

    fn on_control_done(&mut self, io: &mut AppIo<'_>, issued: Picos) {
        let now = io.now();
        io.record_latency(now, now - issued);
        io.record_message(now);
        if self.running && self.interval == 0 {
            self.issue(io);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Scenarios name the core's verbs `reg-mr` and `create-qp`, both ways, and any other
    /// name is refused with the names it could have been.
    #[test]
    fn verbs_are_named_as_scenarios_name_them() {
        for (name, verb) in [
            ("reg-mr", ControlVerb::RegMr),
            ("create-qp", ControlVerb::CreateQp),
        ] {
            let p: ControlParams = toml::from_str(&format!("verb = \"{name}\"")).unwrap();
            assert_eq!(p.verb, verb);
            let back = toml::to_string(&p).unwrap();
            assert!(back.contains(&format!("verb = \"{name}\"")), "{back}");
        }
        let e = toml::from_str::<ControlParams>("verb = \"dereg-mr\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown variant `dereg-mr`, expected `reg-mr` or `create-qp`"),
            "{e}"
        );
    }
}
