//! Completions (step 6): once the CQE of an acknowledged message is visible, the work
//! requests up to it complete in order.

use super::{Fabric, QpId};

/// A completion that the world hands to the policy of the queue pair's host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Completion {
    /// The queue pair.
    pub(crate) qp: QpId,
    /// The tag of the completed work request.
    pub(crate) tag: u64,
}

impl Fabric {
    /// Handles [`Event::CqeVisible`]: the completions of all messages up to `upto`, in
    /// order, appended to `out`.
    pub(crate) fn take_completions(&mut self, qp: QpId, upto: u32, out: &mut Vec<Completion>) {
        let entry = &mut self.qps[qp.index()];
        while let Some(u) = entry.unacked.front() {
            // Sequence numbers wrap; "at or before" is a small forward distance.
            if upto.wrapping_sub(u.msn) > u32::MAX / 2 {
                break;
            }
            out.push(Completion { qp, tag: u.tag });
            entry.unacked.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Unacked;
    use super::*;
    use crate::rnic::testing::{end, quiet_profile, two_hosts};

    #[test]
    fn completions_come_in_order_up_to_the_acknowledged_message_across_the_wrap() {
        let profile = quiet_profile();
        let mut f = two_hosts(&profile);
        let (a, _) = f.connect(end(0, false), end(1, false), None);
        for (msn, tag) in [(u32::MAX - 1, 10), (u32::MAX, 11), (0, 12), (1, 13)] {
            f.qps[a.index()].unacked.push_back(Unacked {
                msn,
                tag,
                sent_at: 0,
                bytes: 0,
                dma: false,
            });
        }
        let mut out = Vec::new();
        f.take_completions(a, u32::MAX, &mut out);
        let tags = |out: &[Completion]| out.iter().map(|c| c.tag).collect::<Vec<_>>();
        assert_eq!(tags(&out), [10, 11], "the two before the wrap");
        out.clear();
        f.take_completions(a, u32::MAX, &mut out);
        assert!(out.is_empty(), "an ACK seen again completes nothing more");
        f.take_completions(a, 1, &mut out);
        assert_eq!(tags(&out), [12, 13], "past the wrap");
        assert_eq!(f.outstanding(a), 0);
    }
}
