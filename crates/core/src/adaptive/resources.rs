//! Costs by resource: which of the RNICs' send paths a bandwidth flow's bytes use, so that
//! flows are paced, and share, only against flows that use the same one.
//!
//! A WRITE or a SEND carries its payload out of this host's RNIC: its bytes are charged to
//! this host's send path ([`Resource::SendPath`]), where the latency flows' own requests
//! wait behind them. A READ requester's data leaves the responder's RNIC: its bytes are
//! charged to that peer's send path ([`Resource::Responder`]), which this host's WRITEs
//! and SENDs never touch. Paced in one stream with the SENDs, a READ tenant takes half of
//! the stream, and a SEND tenant that could have had the whole link keeps half of it (0.72
//! of its tenant-fair share in the comparison suite's `read-beside-send`).
//!
//! So the driver keeps one paced stream per resource, each with its own tenants' round
//! robin, and plans each from an observation of the flows charged to it
//! ([`charged_to`]): L as on the host (the latency flows' round trip crosses both send
//! paths, their requests this host's and their acknowledgements the peer's, and it is
//! their tail the stream is paced for), B the bandwidth tenants charged to the resource,
//! T and the other flows' wire load only on this host's send path (a throughput flow's
//! small messages leave from here). Each stream is paced by the same law, from the one
//! measured tail, in chunks of the same size: left unpaced, the READ responses fill the
//! responder's transmitter, where the latency flow's acknowledgements wait (x2.3 of alone
//! in the suite), and charged to a stream the responder paces for its own latency flows
//! (it has none) they go unpaced there too.
//!
//! Invariants: every bandwidth flow is charged to exactly one resource; a flow that is not
//! a READ requester is charged to [`Resource::SendPath`]; with no READ requester present
//! the send path's observation is the host's, so the plan is the one-stream plan.

use std::collections::BTreeSet;

use super::{Observation, TenantWeights};
use crate::flow::{FlowClass, FlowSpec};

/// The send path a bandwidth flow's payload leaves by; `P` names a peer host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource<P> {
    /// This host's RNIC: WRITE and SEND payload, READ responses this host serves.
    SendPath,
    /// The RNIC of the peer a READ requester reads from: the responses leave there.
    Responder(P),
}

impl<P> Resource<P> {
    /// What a flow whose requests go to `peer` is charged to: the peer's send path if they
    /// are READs, this host's otherwise.
    pub fn of(reads: bool, peer: P) -> Self {
        if reads {
            Resource::Responder(peer)
        } else {
            Resource::SendPath
        }
    }
}

/// The observation for the bandwidth flows charged to `resource`, from the host's
/// observation and the present flows, each with what it is charged to (latency and
/// throughput flows' resource is not used): the host's L, target, tail; the bandwidth
/// tenants charged to `resource` as B; on this host's send path the host's T; and
/// `other_bytes_per_sec`, the wire bytes/s the resource carried lately besides the
/// stream's own chunks (on this host's send path the host's observation's; on a
/// responder's, the acknowledgements of this host's messages to it).
pub fn charged_to<'a, P: PartialEq + 'a>(
    resource: &Resource<P>,
    host: &Observation,
    flows: impl IntoIterator<Item = (&'a FlowSpec, &'a Resource<P>)>,
    other_bytes_per_sec: f64,
) -> Observation {
    let bandwidth = TenantWeights::of(
        flows
            .into_iter()
            .filter(|(f, r)| f.class == FlowClass::Bandwidth && *r == resource)
            .map(|(f, _)| f),
    )
    .bandwidth;
    let send_path = *resource == Resource::SendPath;
    Observation {
        tenants: TenantWeights {
            latency: host.tenants.latency,
            bandwidth,
            throughput: if send_path {
                host.tenants.throughput
            } else {
                0
            },
        },
        other_bytes_per_sec,
        ..*host
    }
}

/// The send paths a latency message's round trip crosses that carry bandwidth flows, the
/// `paths` [`AdaptiveLaw::plan_charged`](super::AdaptiveLaw::plan_charged) splits the
/// chunk among: this host's, and the responder's of a peer a latency flow goes to, each
/// when a bandwidth flow present is charged to it; at least one. `flows` are the present
/// flows, each with what it is charged to and the peer its queue pairs go to (`None`:
/// not known, so its round trip is counted on this host's send path only).
pub fn latency_paths<'a, P: Ord + 'a>(
    flows: impl IntoIterator<Item = (&'a FlowSpec, &'a Resource<P>, Option<&'a P>)> + Clone,
) -> u32 {
    let latency_peers: BTreeSet<&P> = flows
        .clone()
        .into_iter()
        .filter(|(f, _, _)| f.class == FlowClass::Latency)
        .filter_map(|(_, _, peer)| peer)
        .collect();
    let crossed: BTreeSet<&Resource<P>> = flows
        .into_iter()
        .filter(|(f, _, _)| f.class == FlowClass::Bandwidth)
        .map(|(_, charged, _)| charged)
        .filter(|charged| match charged {
            Resource::SendPath => true,
            Resource::Responder(peer) => latency_peers.contains(peer),
        })
        .collect();
    u32::try_from(crossed.len()).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{FlowId, TenantId, Weight};
    use std::time::Duration;

    fn spec(id: u64, tenant: u64, class: FlowClass) -> FlowSpec {
        FlowSpec {
            id: FlowId(id),
            tenant: TenantId(tenant),
            class,
            weight: Weight::ONE,
        }
    }

    /// The suite's `read-beside-send`: a latency tenant, tenant 2 reading from host 7 and
    /// tenant 3 sending. On the send path the SEND tenant is the only bandwidth tenant (B
    /// = 1 of L+B = 2, where one stream made it 2 of 3); on the responder the READ tenant
    /// is, with no throughput or other load there.
    #[test]
    fn reads_are_charged_to_the_responder_and_sends_to_the_send_path() {
        let flows = [
            (spec(1, 1, FlowClass::Latency), Resource::of(false, 7)),
            (spec(2, 2, FlowClass::Bandwidth), Resource::of(true, 7)),
            (spec(3, 3, FlowClass::Bandwidth), Resource::of(false, 7)),
            (spec(4, 4, FlowClass::Throughput), Resource::of(false, 7)),
        ];
        let host = Observation {
            tenants: TenantWeights::of(flows.iter().map(|(f, _)| f)),
            target99: Some(Duration::from_micros(2)),
            current99: Some(Duration::from_micros(1)),
            other_bytes_per_sec: 1e9,
        };
        assert_eq!(
            host.tenants,
            TenantWeights {
                latency: 1,
                bandwidth: 2,
                throughput: 1
            }
        );
        let pairs = || flows.iter().map(|(f, r)| (f, r));
        let send = charged_to(
            &Resource::SendPath,
            &host,
            pairs(),
            host.other_bytes_per_sec,
        );
        assert_eq!(
            send.tenants,
            TenantWeights {
                latency: 1,
                bandwidth: 1,
                throughput: 1
            }
        );
        assert_eq!(send.other_bytes_per_sec, 1e9);
        assert_eq!(send.target99, host.target99);
        let read = charged_to(&Resource::Responder(7), &host, pairs(), 2e8);
        assert_eq!(
            read.tenants,
            TenantWeights {
                latency: 1,
                bandwidth: 1,
                throughput: 0
            }
        );
        assert_eq!(read.other_bytes_per_sec, 2e8);
        assert_eq!(read.current99, host.current99);
        // A responder nobody reads from has no bandwidth tenant.
        let none = charged_to(&Resource::Responder(8), &host, pairs(), 0.0);
        assert_eq!(none.tenants.bandwidth, 0);
    }

    /// A latency flow to host 7 beside a SEND tenant and READ tenants reading from hosts 7
    /// and 8: its round trip crosses this host's send path and host 7's, both carrying
    /// bandwidth flows (2); host 8's is not on it. Without the SEND tenant only host 7's
    /// (1); without a latency flow's peer known, only this host's, which carries none
    /// then: still 1, the least.
    #[test]
    fn the_latency_round_trip_crosses_this_hosts_path_and_its_peers() {
        let flows = [
            (
                spec(1, 1, FlowClass::Latency),
                Resource::of(false, 7),
                Some(7),
            ),
            (
                spec(2, 2, FlowClass::Bandwidth),
                Resource::of(true, 7),
                Some(7),
            ),
            (
                spec(3, 2, FlowClass::Bandwidth),
                Resource::of(true, 8),
                Some(8),
            ),
            (
                spec(4, 3, FlowClass::Bandwidth),
                Resource::of(false, 7),
                Some(7),
            ),
            (
                spec(5, 4, FlowClass::Throughput),
                Resource::of(false, 8),
                Some(8),
            ),
        ];
        let all = flows.iter().map(|(f, r, p)| (f, r, p.as_ref()));
        assert_eq!(latency_paths(all.clone()), 2);
        assert_eq!(
            latency_paths(all.clone().filter(|(f, _, _)| f.id.0 != 4)),
            1
        );
        let unknown = all
            .filter(|(f, _, _)| f.id.0 != 4)
            .map(|(f, r, p)| (f, r, p.filter(|_| f.class != FlowClass::Latency)));
        assert_eq!(latency_paths(unknown), 1);
    }

    /// Without READ requesters the send path's observation is the host's.
    #[test]
    fn without_reads_the_send_path_is_the_host() {
        let flows = [
            (spec(1, 1, FlowClass::Latency), Resource::<u16>::SendPath),
            (spec(2, 2, FlowClass::Bandwidth), Resource::SendPath),
            (spec(3, 2, FlowClass::Bandwidth), Resource::SendPath),
        ];
        let host = Observation {
            tenants: TenantWeights::of(flows.iter().map(|(f, _)| f)),
            target99: None,
            current99: None,
            other_bytes_per_sec: 5.0,
        };
        let send = charged_to(
            &Resource::SendPath,
            &host,
            flows.iter().map(|(f, r)| (f, r)),
            host.other_bytes_per_sec,
        );
        assert_eq!(send, host);
    }
}
