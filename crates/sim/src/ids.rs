//! The indices that name hosts, nodes and links. They live apart from the topology that
//! hands them out, so that links (which the topology stores) can name their ends without
//! depending on the topology; [`crate::topology`] re-exports them.

/// Index of a node in a [`Topology`](crate::topology::Topology).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// Index of a host (a node with an RNIC).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostId(pub u16);

/// Index of a link in a [`Topology`](crate::topology::Topology).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LinkId(pub u32);
