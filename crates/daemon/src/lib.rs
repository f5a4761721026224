//! # justitia-daemon
//!
//! `justitiad`, the per-host control plane: it runs justitia-core's
//! [`ControlLoop`](justitia_core::control_loop::ControlLoop) on real verbs, takes
//! registrations from shapers over a Unix socket (identity from the kernel), and publishes
//! their allotments in a sealed control block (see `justitia-agent`).
//!
//! | module | what it owns |
//! | --- | --- |
//! | [`adaptive`] | `policy = "adaptive"`: the core's adaptive law driven on the host |
//! | [`config`] | `justitiad.toml`: keys, defaults, checks |
//! | [`gid`] | the reference flow's GID: chosen, or the given one checked, against the port's table and its device's addresses |
//! | [`kubepods`] | pods as tenants: a process's pod from its cgroup, the pod's namespace from kubelet's log directories |
//! | [`members_file`] | `[peer] members_file`: the peer channel's members from a file of their own, re-read when it changes |
//! | [`limits`] | what one local user may take: slots, connections, log lines |
//! | [`pairing`] | the rendezvous of side channels: shapers' queue pairs paired with their members' ends |
//! | [`probe`] | the reference flow (verbs loopback, or synthetic) |
//! | [`server`] | the event loop: sockets, loop, probe, control block, admin |
//! | [`metrics`] | Prometheus metrics and their HTTP endpoint |
//! | [`peer`] | the peer channel's socket, discovery and metrics (`justitia-peer` on UDP) |
//! | [`tenant`] | peer identity (pidfd, pid 0) and tenants by cgroup |
//! | [`rdma_netlink`] | the RDMA queue pairs the kernel tracks, read over `NETLINK_RDMA` |
//! | [`unshaped`] | processes holding queue pairs with no shaper registered: the scan, its table and metrics |

pub mod adaptive;
pub mod config;
pub mod gid;
pub mod kubepods;
pub mod limits;
pub mod members_file;
pub mod metrics;
pub mod pairing;
pub mod peer;
pub mod probe;
pub mod rdma_netlink;
pub mod server;
pub mod tenant;
pub mod unshaped;
pub mod wire_probe;
