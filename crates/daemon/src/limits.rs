//! What one local user may take of the daemon: slots, connections, log lines.
//!
//! Every local user can reach the registration socket, so every resource a connection can
//! grow has a cap here, decided by pure functions over counts the server keeps.
//!
//! Invariants:
//! - **No set of tenants locks out another.** The slot table (`slots` flows) has an open
//!   part and a reserve of a quarter of it ([`reserve`]). Any flow may take an open slot
//!   while its cap owner ([`CapOwner`]) is under `max_flows_per_tenant`. A slot of the reserve goes only to a
//!   tenant holding fewer than [`RESERVED_PER_TENANT`] flows: a latency flow may take any
//!   slot of the reserve, a resource-hungry flow only its first half. So however many
//!   flows the other tenants hold, a tenant with few flows finds room for its latency
//!   flows while fewer than `reserve / RESERVED_PER_TENANT` tenants crowd the reserve (32
//!   with 1024 slots), and for its first hungry flows while fewer than half as many do.
//! - **A connection costs at most two descriptors** (its socket and its process's
//!   pidfd); the daemon holds at most [`max_clients`] of them, leaving room for the
//!   admin socket, the metrics thread, the probe and the tenant pages, and one cap owner
//!   at most `max_connections_per_tenant`.
//! - **A log line a peer can cause is rate-limited** ([`LogLimiter`]): a burst of at most
//!   [`LOG_BURST`] lines per kind per second, then one line saying how many were dropped.

use justitia_agent::proto::RefuseReason;
use justitia_core::flow::FlowClass;

/// Whose caps a connection and its flows count against: a pod's or a namespace's tenant
/// (with `tenant = "pod"` or `"namespace"`, for processes in a pod), else the uid. A
/// cgroup tenant's caps are its uid's: a user with a delegated cgroup subtree could
/// otherwise make tenants, and caps, at will, where a pod is made by kubelet only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CapOwner {
    /// A uid.
    Uid(u32),
    /// A pod's or a namespace's tenant id.
    Tenant(u64),
}

/// Flows a tenant may always hold in the reserve of the slot table.
pub const RESERVED_PER_TENANT: usize = 8;
/// Log lines of one kind per second before the rest are counted instead of written.
pub const LOG_BURST: u32 = 20;
/// Descriptors kept back from connections for everything else the daemon opens.
pub const SPARE_FDS: u64 = 64;

/// Slots of a table of `slots` kept back for tenants with few flows: a quarter.
pub fn reserve(slots: usize) -> usize {
    slots / 4
}

/// What the daemon holds when a registration arrives.
#[derive(Debug, Clone, Copy)]
pub struct SlotCounts {
    /// Flows registered in all.
    pub total: usize,
    /// Flows of the registering flow's cap owner.
    pub of_owner: usize,
    /// Flows of the registering tenant (the uid, or its cgroup).
    pub of_tenant: usize,
}

/// Whether a flow of `class` may have a slot, or why not.
pub fn slot_verdict(
    c: SlotCounts,
    class: FlowClass,
    slots: usize,
    max_flows_per_tenant: usize,
) -> Result<(), RefuseReason> {
    if c.of_owner >= max_flows_per_tenant {
        return Err(RefuseReason::TooManyFlows);
    }
    if c.total >= slots {
        return Err(RefuseReason::Full);
    }
    let reserve = reserve(slots);
    if c.total < slots - reserve {
        return Ok(());
    }
    // In the reserve: only tenants with few flows, latency flows first.
    let hungry_limit = slots - reserve / 2;
    let room = class == FlowClass::Latency || c.total < hungry_limit;
    if c.of_tenant < RESERVED_PER_TENANT && room {
        Ok(())
    } else {
        Err(RefuseReason::Full)
    }
}

/// Connections the daemon serves at most with a descriptor limit of `nofile`: two
/// descriptors each, after [`SPARE_FDS`].
pub fn max_clients(nofile: u64) -> usize {
    (nofile.saturating_sub(SPARE_FDS) / 2).max(1) as usize
}

/// The soft descriptor limit of this process.
pub fn nofile_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(1024)
}

/// Kinds of log line a peer can cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogKind {
    /// A message refused (malformed, not the owner, refused registration).
    Refused,
    /// A flow registered, reclaimed or a shaper connected or left.
    Flows,
    /// A connection refused or dropped at accept.
    Accept,
    /// An admin request refused or cut off.
    Admin,
    /// A process found holding RDMA queue pairs with no shaper registered (any local user
    /// can start as many as the kernel lets it).
    Unshaped,
}

const KINDS: usize = 5;

/// A per-kind budget of [`LOG_BURST`] lines per second. See the module documentation.
#[derive(Debug, Default)]
pub struct LogLimiter {
    window_start_ns: [u64; KINDS],
    written: [u32; KINDS],
    dropped: [u64; KINDS],
}

impl LogLimiter {
    /// Whether a line of `kind` may be written at `now_ns`. When a new window opens after
    /// lines were dropped, returns how many, for the caller to say so once.
    pub fn allow(&mut self, kind: LogKind, now_ns: u64) -> (bool, u64) {
        let k = kind as usize;
        let mut dropped_before = 0;
        if now_ns.saturating_sub(self.window_start_ns[k]) >= 1_000_000_000 {
            self.window_start_ns[k] = now_ns;
            self.written[k] = 0;
            dropped_before = std::mem::take(&mut self.dropped[k]);
        }
        if self.written[k] < LOG_BURST {
            self.written[k] += 1;
            (true, dropped_before)
        } else {
            self.dropped[k] += 1;
            (false, dropped_before)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn counts(total: usize, of_owner: usize, of_tenant: usize) -> SlotCounts {
        SlotCounts {
            total,
            of_owner,
            of_tenant,
        }
    }

    #[test]
    fn four_tenants_at_their_cap_leave_room_for_a_fifth() {
        // 1024 slots, 256 per uid: four uids of 192 flows fill the open part (768); the
        // reserve refuses them, as it refuses any tenant holding 8 flows or more.
        let open = 1024 - reserve(1024);
        assert_eq!(open, 768);
        assert_eq!(
            slot_verdict(counts(768, 192, 192), FlowClass::Bandwidth, 1024, 256),
            Err(RefuseReason::Full)
        );
        // A newcomer gets both kinds of flow.
        for class in [FlowClass::Latency, FlowClass::Bandwidth] {
            assert_eq!(slot_verdict(counts(768, 0, 0), class, 1024, 256), Ok(()));
        }
        // Deep in the reserve only latency flows still get in.
        assert_eq!(
            slot_verdict(counts(1000, 0, 0), FlowClass::Bandwidth, 1024, 256),
            Err(RefuseReason::Full)
        );
        assert_eq!(
            slot_verdict(counts(1000, 0, 0), FlowClass::Latency, 1024, 256),
            Ok(())
        );
        assert_eq!(
            slot_verdict(counts(1024, 0, 0), FlowClass::Latency, 1024, 256),
            Err(RefuseReason::Full)
        );
        assert_eq!(
            slot_verdict(counts(10, 256, 256), FlowClass::Latency, 1024, 256),
            Err(RefuseReason::TooManyFlows)
        );
    }

    #[test]
    fn descriptors_bound_connections() {
        assert_eq!(max_clients(1024), 480);
        assert_eq!(max_clients(10), 1);
    }

    #[test]
    fn a_burst_is_written_then_counted_then_reported() {
        let mut l = LogLimiter::default();
        let t = 5_000_000_000;
        for _ in 0..LOG_BURST {
            assert_eq!(l.allow(LogKind::Refused, t), (true, 0));
        }
        assert_eq!(l.allow(LogKind::Refused, t + 1), (false, 0));
        assert_eq!(l.allow(LogKind::Refused, t + 2), (false, 0));
        // Other kinds have their own budget.
        assert_eq!(l.allow(LogKind::Accept, t), (true, 0));
        assert_eq!(l.allow(LogKind::Refused, t + 1_000_000_000), (true, 2));
    }
}
