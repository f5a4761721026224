//! Topology: nodes joined by links.
//!
//! Hosts and switches are nodes; every node port sends on one [`Link`]. A packet names its
//! destination host and moves node to node: a host sends on its single uplink, and a
//! switch picks an output port from its routing table. Three shapes are built: two hosts
//! back to back, hosts around one switch, and hosts around a chain of switches joined by
//! inter-switch links (RPerf's two-hop setup is a chain of two).

pub use crate::ids::{HostId, LinkId, NodeId};
use crate::link::Link;
use crate::model_profile::LinkParams;

/// Index of a switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SwitchId(pub u16);

/// What a node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// A host with one RNIC port.
    Host(HostId),
    /// A switch.
    Switch(SwitchId),
}

/// One port of a switch: the link it receives on and the link it sends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwitchPort {
    /// From the neighbour into the switch.
    pub input: LinkId,
    /// From the switch to the neighbour.
    pub output: LinkId,
}

/// A switch's ports and where each host is reached.
#[derive(Clone, Debug)]
pub struct SwitchPorts {
    /// The ports, in the order they were cabled.
    pub ports: Vec<SwitchPort>,
    /// For each host, the port that leads to it.
    pub route: Vec<u8>,
}

/// Nodes, links and the hosts' names.
#[derive(Clone, Debug)]
pub struct Topology {
    nodes: Vec<NodeKind>,
    links: Vec<Link>,
    host_names: Vec<String>,
    host_nodes: Vec<NodeId>,
    host_uplinks: Vec<LinkId>,
    switches: Vec<SwitchPorts>,
    /// For each link that ends at a switch, the port it enters by.
    input_port: Vec<Option<u8>>,
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
            switches: Vec::new(),
            input_port: vec![None, None],
        }
    }

    /// Hosts around a chain of switches: `hosts` are (name, index of the switch it is
    /// cabled to); switch `i` is joined to switch `i + 1` by one full-duplex inter-switch
    /// link. Every cable uses `params`.
    pub fn switched(hosts: &[(&str, usize)], switches: usize, params: &LinkParams) -> Self {
        let switches = switches.max(1);
        let mut nodes: Vec<NodeKind> = (0..hosts.len())
            .map(|h| NodeKind::Host(HostId(h as u16)))
            .collect();
        let switch_node = |s: usize| NodeId((hosts.len() + s) as u32);
        nodes.extend((0..switches).map(|s| NodeKind::Switch(SwitchId(s as u16))));
        let mut links = Vec::new();
        let mut input_port = Vec::new();
        let mut ports: Vec<Vec<SwitchPort>> = vec![Vec::new(); switches];
        let cable = |a: NodeId, b: NodeId, links: &mut Vec<Link>| {
            links.push(Link::new(a, b, params));
            links.push(Link::new(b, a, params));
            (
                LinkId(links.len() as u32 - 2),
                LinkId(links.len() as u32 - 1),
            )
        };
        let mut host_uplinks = Vec::new();
        let mut host_port = Vec::new();
        for (h, &(_, s)) in hosts.iter().enumerate() {
            let s = s.min(switches - 1);
            let (up, down) = cable(NodeId(h as u32), switch_node(s), &mut links);
            host_uplinks.push(up);
            host_port.push((s, ports[s].len() as u8));
            ports[s].push(SwitchPort {
                input: up,
                output: down,
            });
        }
        // Ports towards the next and the previous switch of the chain.
        let mut towards_next = vec![0u8; switches];
        let mut towards_prev = vec![0u8; switches];
        for s in 0..switches.saturating_sub(1) {
            let (forward, back) = cable(switch_node(s), switch_node(s + 1), &mut links);
            towards_next[s] = ports[s].len() as u8;
            ports[s].push(SwitchPort {
                input: back,
                output: forward,
            });
            towards_prev[s + 1] = ports[s + 1].len() as u8;
            ports[s + 1].push(SwitchPort {
                input: forward,
                output: back,
            });
        }
        input_port.resize(links.len(), None);
        let switches: Vec<SwitchPorts> = ports
            .into_iter()
            .enumerate()
            .map(|(s, ports)| {
                for (p, port) in ports.iter().enumerate() {
                    input_port[port.input.0 as usize] = Some(p as u8);
                }
                let route = host_port
                    .iter()
                    .map(|&(hs, hp)| match hs.cmp(&s) {
                        std::cmp::Ordering::Equal => hp,
                        std::cmp::Ordering::Greater => towards_next[s],
                        std::cmp::Ordering::Less => towards_prev[s],
                    })
                    .collect();
                SwitchPorts { ports, route }
            })
            .collect();
        Topology {
            nodes,
            links,
            host_names: hosts.iter().map(|(n, _)| n.to_string()).collect(),
            host_nodes: (0..hosts.len()).map(|h| NodeId(h as u32)).collect(),
            host_uplinks,
            switches,
            input_port,
        }
    }

    /// The switches, by [`SwitchId`].
    pub fn switches(&self) -> &[SwitchPorts] {
        &self.switches
    }

    /// The port by which `link` enters a switch (`None` when it ends at a host).
    pub fn input_port(&self, link: LinkId) -> Option<u8> {
        self.input_port[link.0 as usize]
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

    #[test]
    fn two_switch_chain_routes_across_the_inter_switch_link() {
        let params = LinkParams {
            gbps: 56.0,
            propagation_ns: 5.0,
            header_bytes: 26,
            first_packet_extra_bytes: 16,
            ack_bytes: 30,
        };
        let t = Topology::switched(&[("a", 0), ("b", 0), ("d", 1)], 2, &params);
        assert_eq!(t.switches().len(), 2);
        let up = &t.switches()[0];
        let down = &t.switches()[1];
        // Switch 0: ports a, b, then the inter-switch port; switch 1: d, then inter-switch.
        assert_eq!(up.route, vec![0, 1, 2]);
        assert_eq!(down.route, vec![1, 1, 0]);
        let isl = up.ports[2].output;
        assert_eq!(t.node(t.link(isl).to), NodeKind::Switch(SwitchId(1)));
        assert_eq!(t.input_port(isl), Some(1));
        assert_eq!(t.input_port(t.uplink(HostId(2))), Some(0));
        assert_eq!(t.input_port(down.ports[0].output), None);
    }
}
