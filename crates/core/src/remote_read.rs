//! The utilisation guarantee a host gives to the machines that READ from it.
//!
//! An RDMA READ issued by machine A against machine B moves data out of B's RNIC, so it
//! competes with B's own WRITEs and SENDs, yet it is posted, and can only be paced, on A.
//! Rather than ship tokens from B to A, Justitia has B send each remote reader its
//! guaranteed share after every update, 1/(L'+B'+T') of MaxRate, where L', B', T' count
//! B's local flows together with the remote READ flows it serves; A enforces that rate
//! locally (§4.4). Like the paper, this may leave capacity idle when remote readers use
//! less than their share.
//!
//! One counting rule for local and remote flows: B counts a remote READ requester's
//! flows per (requester host, tenant, class), once however many flows, as it counts its
//! own tenants ([`RemoteReadUnit`]); and weights apply. So the guarantee is per unit of
//! weight: 1 over the sum, over the counted units, of 1 for a latency unit and the
//! tenant's weight for a resource-hungry one (1/(L'+B'+T') when every weight is one). A
//! requester tenant of weight w gets w times it, divided among its flows of that class
//! reading from B.
//!
//! [`ReadGuaranteeSender`] stamps every [`ReadGuarantee`] with the sender's epoch (a number
//! that grows each time the sender starts, e.g. its start time) and a sequence number that
//! grows with every message of that epoch. [`ReadGuaranteeReceiver`] keeps the newest one
//! by (epoch, sequence), so messages reordered or replayed by the network never roll a
//! reader back to an older rate, while a restarted sender is believed at once.
//!
//! Invariants: the fraction is in (0, 1] (a host with no counted flow guarantees the whole
//! RNIC); bytes/s and ops/s are the fraction of MaxRate and MaxTput; a receiver's current
//! guarantee only ever moves to a strictly newer (epoch, sequence), and it never holds a
//! message whose figures are out of range.

use serde::{Deserialize, Serialize};

use crate::flow::{FlowClass, Weight};
use crate::profile::RnicProfile;

/// The share a host guarantees per unit of weight: 1 over its weighted count of units
/// (L'+B'+T' when every weight is 1), or the whole RNIC when none is counted.
pub fn read_guarantee_fraction(weighted_units: u64) -> f64 {
    1.0 / weighted_units.max(1) as f64
}

/// One remote requester's tenant and class whose READ flows a host serves: it counts once
/// in L', B' or T', at its weight, however many flows it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteReadUnit {
    /// The class of its READ flows.
    pub class: FlowClass,
    /// The tenant's weight on its host.
    pub weight: Weight,
}

impl RemoteReadUnit {
    /// What it adds to the weighted count: 1 for a latency unit (never shaped, it has no
    /// weight in a division), its weight for a resource-hungry one.
    pub fn weighted(&self) -> u64 {
        if self.class.is_resource_hungry() {
            u64::from(self.weight.get())
        } else {
            1
        }
    }
}

/// The message a host sends to each remote reader.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReadGuarantee {
    /// The sender's incarnation; a larger epoch supersedes every message of a smaller one.
    pub epoch: u64,
    /// Position of this message within its epoch.
    pub sequence: u64,
    /// The fraction per unit of weight, 1/(L'+B'+T') when every weight is 1; in (0, 1].
    pub fraction: f64,
    /// The guaranteed rate in bytes/s: fraction x the sender's MaxRate.
    pub bytes_per_sec: f64,
    /// The guaranteed rate in operations/s: fraction x the sender's MaxTput.
    pub ops_per_sec: f64,
    /// The size READs from the sender are cut to: the sender's chunk (§5.1: 5 KB while it
    /// counts a latency flow of its own), because a READ's data leaves the sender's RNIC,
    /// where a long response would hold up the sender's latency flows.
    pub chunk_bytes: u32,
}

impl ReadGuarantee {
    /// True if this message is newer than `other` by (epoch, sequence).
    pub fn is_newer_than(&self, other: &ReadGuarantee) -> bool {
        (self.epoch, self.sequence) > (other.epoch, other.sequence)
    }
}

/// Builds the guarantees one host sends, numbering them.
#[derive(Debug, Clone)]
pub struct ReadGuaranteeSender {
    epoch: u64,
    next_sequence: u64,
}

impl ReadGuaranteeSender {
    /// A sender for one incarnation of the host; `epoch` must exceed that of any earlier
    /// incarnation (a start timestamp will do).
    pub fn new(epoch: u64) -> Self {
        ReadGuaranteeSender {
            epoch,
            next_sequence: 0,
        }
    }

    /// The guarantee for the current flows: `weighted_units` is the weighted count of this
    /// host's own active units and the remote READ units it serves (see the module
    /// documentation), `local_latency` whether it counts a latency flow of its own.
    pub fn announce(
        &mut self,
        weighted_units: u64,
        local_latency: bool,
        profile: &RnicProfile,
    ) -> ReadGuarantee {
        let fraction = read_guarantee_fraction(weighted_units);
        let sequence = self.next_sequence;
        self.next_sequence = self.next_sequence.saturating_add(1);
        ReadGuarantee {
            epoch: self.epoch,
            sequence,
            fraction,
            bytes_per_sec: fraction * profile.max_rate_bytes_per_sec(),
            ops_per_sec: fraction * profile.max_ops_per_sec(),
            chunk_bytes: profile.chunk_bytes(local_latency),
        }
    }
}

/// A guarantee message a receiver refused because its figures are out of range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error(
    "read guarantee (epoch {epoch}, sequence {sequence}) refused: {field} = {value} is out of range"
)]
pub struct InvalidReadGuarantee {
    /// The message's epoch.
    pub epoch: u64,
    /// The message's sequence.
    pub sequence: u64,
    /// The offending field.
    pub field: &'static str,
    /// Its value.
    pub value: f64,
}

/// What a receiver did with a valid message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// The message was newer and is now the current guarantee.
    Applied,
    /// The message was not newer than the current guarantee and was ignored.
    Stale,
}

/// Keeps the newest guarantee received from one host.
#[derive(Debug, Clone, Default)]
pub struct ReadGuaranteeReceiver {
    current: Option<ReadGuarantee>,
}

impl ReadGuaranteeReceiver {
    /// A receiver that has heard nothing yet.
    pub fn new() -> Self {
        ReadGuaranteeReceiver::default()
    }

    /// Takes a message from the peer: refuses it if its figures are out of range (it comes
    /// off the network), ignores it if stale, applies it otherwise.
    pub fn accept(&mut self, message: ReadGuarantee) -> Result<Receipt, InvalidReadGuarantee> {
        let invalid = |field: &'static str, value: f64| InvalidReadGuarantee {
            epoch: message.epoch,
            sequence: message.sequence,
            field,
            value,
        };
        if !(message.fraction > 0.0 && message.fraction <= 1.0) {
            return Err(invalid("fraction", message.fraction));
        }
        if !(message.bytes_per_sec.is_finite() && message.bytes_per_sec > 0.0) {
            return Err(invalid("bytes_per_sec", message.bytes_per_sec));
        }
        if !(message.ops_per_sec.is_finite() && message.ops_per_sec > 0.0) {
            return Err(invalid("ops_per_sec", message.ops_per_sec));
        }
        if message.chunk_bytes == 0 {
            return Err(invalid("chunk_bytes", 0.0));
        }
        match &self.current {
            Some(current) if !message.is_newer_than(current) => Ok(Receipt::Stale),
            _ => {
                self.current = Some(message);
                Ok(Receipt::Applied)
            }
        }
    }

    /// The newest valid guarantee received, if any; the reader paces its READs to it.
    pub fn current(&self) -> Option<&ReadGuarantee> {
        self.current.as_ref()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn ib56() -> RnicProfile {
        RnicProfile::builtin("IB-56").unwrap()
    }

    #[test]
    fn fraction_counts_every_unit_and_never_divides_by_zero() {
        assert_eq!(read_guarantee_fraction(4), 0.25);
        assert_eq!(read_guarantee_fraction(0), 1.0);
        let unit = |class, weight| RemoteReadUnit {
            class,
            weight: Weight::new(weight).unwrap(),
        };
        assert_eq!(unit(FlowClass::Bandwidth, 3).weighted(), 3);
        assert_eq!(
            unit(FlowClass::Latency, 3).weighted(),
            1,
            "latency is never weighted"
        );
    }

    #[test]
    fn announcement_includes_remote_reads_and_counts_up() {
        let profile = ib56();
        let mut sender = ReadGuaranteeSender::new(7);
        // Two local bandwidth flows and one latency flow, plus one remote READ flow.
        let first = sender.announce(4, true, &profile);
        assert_eq!((first.epoch, first.sequence), (7, 0));
        assert_eq!(first.fraction, 0.25);
        assert!((first.bytes_per_sec - 1.5e9).abs() < 1.0);
        assert!((first.ops_per_sec - 7.5e6).abs() < 1e-3);
        let second = sender.announce(1, false, &profile);
        assert_eq!(second.sequence, 1);
        assert_eq!(second.fraction, 1.0);
        assert!(second.is_newer_than(&first));
    }

    #[test]
    fn receiver_ignores_stale_and_duplicate_messages() {
        let profile = ib56();
        let mut sender = ReadGuaranteeSender::new(1);
        let old = sender.announce(2, false, &profile);
        let new = sender.announce(4, false, &profile);
        let mut receiver = ReadGuaranteeReceiver::new();
        assert_eq!(receiver.current(), None);
        assert_eq!(receiver.accept(new), Ok(Receipt::Applied));
        assert_eq!(receiver.accept(old), Ok(Receipt::Stale));
        assert_eq!(receiver.accept(new), Ok(Receipt::Stale));
        assert_eq!(receiver.current().map(|g| g.fraction), Some(0.25));
    }

    #[test]
    fn a_restarted_sender_supersedes_its_previous_incarnation() {
        let profile = ib56();
        let mut before = ReadGuaranteeSender::new(1);
        let mut receiver = ReadGuaranteeReceiver::new();
        for _ in 0..5 {
            let m = before.announce(2, false, &profile);
            assert_eq!(receiver.accept(m), Ok(Receipt::Applied));
        }
        let mut after = ReadGuaranteeSender::new(2);
        let m = after.announce(1, false, &profile);
        assert_eq!(m.sequence, 0);
        assert_eq!(receiver.accept(m), Ok(Receipt::Applied));
        assert_eq!(receiver.current().map(|g| g.epoch), Some(2));
    }

    #[test]
    fn out_of_range_figures_are_refused_and_not_applied() {
        let good = ReadGuaranteeSender::new(1).announce(2, false, &ib56());
        let mut receiver = ReadGuaranteeReceiver::new();
        let cases = [
            (
                ReadGuarantee {
                    fraction: 0.0,
                    ..good
                },
                "fraction",
            ),
            (
                ReadGuarantee {
                    fraction: 1.5,
                    ..good
                },
                "fraction",
            ),
            (
                ReadGuarantee {
                    fraction: f64::NAN,
                    ..good
                },
                "fraction",
            ),
            (
                ReadGuarantee {
                    bytes_per_sec: f64::INFINITY,
                    ..good
                },
                "bytes_per_sec",
            ),
            (
                ReadGuarantee {
                    bytes_per_sec: -1.0,
                    ..good
                },
                "bytes_per_sec",
            ),
            (
                ReadGuarantee {
                    bytes_per_sec: 0.0,
                    ..good
                },
                "bytes_per_sec",
            ),
            (
                ReadGuarantee {
                    ops_per_sec: 0.0,
                    ..good
                },
                "ops_per_sec",
            ),
            (
                ReadGuarantee {
                    chunk_bytes: 0,
                    ..good
                },
                "chunk_bytes",
            ),
        ];
        for (message, field) in cases {
            let error = receiver.accept(message).err().map(|e| e.field);
            assert_eq!(error, Some(field));
        }
        assert_eq!(receiver.current(), None);
    }

    #[test]
    fn message_round_trips_through_serde() {
        let message = ReadGuaranteeSender::new(3).announce(4, true, &ib56());
        let text = toml::to_string(&message).unwrap();
        let back: ReadGuarantee = toml::from_str(&text).unwrap();
        assert_eq!(back, message);
        assert!(text.contains("epoch = 3"), "{text}");
    }
}
