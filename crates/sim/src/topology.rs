//! Topology: nodes joined by links.
//!
//! Hosts (and, in a later phase, switches) are nodes; every node port sends on one
//! [`Link`]. A packet names its destination host and moves node to node: a host sends on
//! its single uplink, and a switch would pick an output link from its routing table. The
//! topology of phase 1 is two hosts back to back.

use crate::link::Link;
use crate::model_profile::LinkParams;

/// Index of a node in a [`Topology`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// Index of a host (a node with an RNIC).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostId(pub u16);

/// Index of a link in a [`Topology`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(pub u32);

/// What a node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// A host with one RNIC port.
    Host(HostId),
}

/// Nodes, links and the hosts' names.
#[derive(Clone, Debug)]
pub struct Topology {
    nodes: Vec<NodeKind>,
    links: Vec<Link>,
    host_names: Vec<String>,
    host_nodes: Vec<NodeId>,
    host_uplinks: Vec<LinkId>,
}

impl Topology {
    /// Two hosts joined by one full-duplex cable (one link each way).
    pub fn back_to_back(names: [&str; 2], params: &LinkParams) -> Self {
        let nodes = vec![NodeKind::Host(HostId(0)), NodeKind::Host(HostId(1))];
        let links = vec![
            Link::new(NodeId(0), NodeId(1), params),
            Link::new(NodeId(1), NodeId(0), params),
        ];
        Topology {
            nodes,
            links,
            host_names: names.iter().map(|n| n.to_string()).collect(),
            host_nodes: vec![NodeId(0), NodeId(1)],
            host_uplinks: vec![LinkId(0), LinkId(1)],
        }
    }

    /// The hosts' names, in host order.
    pub fn host_names(&self) -> &[String] {
        &self.host_names
    }

    /// A host by name.
    pub fn host_by_name(&self, name: &str) -> Option<HostId> {
        self.host_names
            .iter()
            .position(|n| n == name)
            .and_then(|i| u16::try_from(i).ok())
            .map(HostId)
    }

    /// Number of hosts.
    pub fn host_count(&self) -> usize {
        self.host_names.len()
    }

    /// A link.
    pub fn link(&self, id: LinkId) -> &Link {
        &self.links[id.0 as usize]
    }

    /// All links.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// The link a host's RNIC transmits on.
    pub fn uplink(&self, host: HostId) -> LinkId {
        self.host_uplinks[usize::from(host.0)]
    }

    /// The node a host sits on.
    pub fn host_node(&self, host: HostId) -> NodeId {
        self.host_nodes[usize::from(host.0)]
    }

    /// What a node is.
    pub fn node(&self, id: NodeId) -> NodeKind {
        self.nodes[id.0 as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_to_back_links_point_at_each_other() {
        let params = LinkParams {
            gbps: 56.0,
            propagation_ns: 100.0,
            header_bytes: 26,
            first_packet_extra_bytes: 16,
            ack_bytes: 30,
        };
        let t = Topology::back_to_back(["a", "b"], &params);
        let a = t.host_by_name("a");
        let b = t.host_by_name("b");
        assert_eq!((a, b), (Some(HostId(0)), Some(HostId(1))));
        assert_eq!(t.host_by_name("c"), None);
        let up = t.link(t.uplink(HostId(0)));
        assert_eq!(up.to, t.host_node(HostId(1)));
        assert_eq!(t.node(up.to), NodeKind::Host(HostId(1)));
    }
}
