//! The scan for unshaped processes against the running kernel: its RDMA netlink, and the
//! queue pairs of a reference flow this test opens. Needs an RDMA device with an active
//! port and `ib_core` loaded (Soft-RoCE will do), so it is ignored elsewhere; in the guest:
//!
//! ```sh
//! cargo test -p justitia-daemon --test unshaped --no-run
//! tests/vm/guest.sh -- target/debug/deps/unshaped-HASH --ignored
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use justitia_daemon::config::TenantBy;
use justitia_daemon::gid::GidChoice;
use justitia_daemon::probe::{Probe, VerbsProbe};
use justitia_daemon::rdma_netlink::{dump_queue_pairs, DeviceFilter, QpOwner, QpType};
use justitia_daemon::unshaped::{
    classify, look_up, unshaped_candidates, ScanTimes, MAX_QPS_PER_SCAN, RECONNECT_GRACE,
    REGISTRATION_GRACE, SCAN_TIMEOUT,
};

#[test]
#[ignore = "needs an RDMA device with an active port and RDMA netlink (ib_core): run in the Soft-RoCE guest"]
fn a_reference_flows_queue_pairs_are_this_processs_and_unshaped_without_a_shaper() {
    let probe = VerbsProbe::open(None, None, GidChoice::Auto, None)
        .expect("an RDMA device with an active port");
    let device = probe.info().device;
    let dump = dump_queue_pairs(
        &DeviceFilter::Named(vec![device.clone()]),
        MAX_QPS_PER_SCAN,
        SCAN_TIMEOUT,
    )
    .expect("the kernel's QP table");
    assert_eq!(dump.devices.len(), 1, "{dump:?}");
    assert_eq!(dump.devices[0].device.name, device);
    assert!(!dump.capped);
    // The reference flow: two RC queue pairs connected to each other, created by this
    // test's thread, which the kernel names (the harness runs tests off the main thread).
    let me = i32::try_from(std::process::id()).unwrap();
    // "<pid>/task/<tid>"
    let tid: i32 = std::fs::read_link("/proc/thread-self")
        .unwrap()
        .file_name()
        .and_then(|t| t.to_str()?.parse().ok())
        .unwrap();
    let mine: Vec<_> = dump.devices[0]
        .qps
        .iter()
        .filter(|q| q.owner == QpOwner::Process(tid))
        .collect();
    assert_eq!(mine.len(), 2, "{dump:?}");
    assert!(mine.iter().all(|q| q.qp_type == QpType::RC), "{mine:?}");

    // Seen as the daemon would see this process were it not the daemon: a candidate by
    // its thread, unshaped as its process once found for the registration grace, with
    // its command.
    let none = BTreeSet::new();
    let at = |known_at: Duration| ScanTimes {
        known_at,
        dumped_at: known_at + Duration::from_millis(1),
    };
    let start = RECONNECT_GRACE;
    let candidates = unshaped_candidates(&dump, &none, 0);
    assert!(candidates.contains(&tid), "{candidates:?}");
    let facts: BTreeMap<_, _> = candidates
        .iter()
        .map(|&pid| (pid, look_up(pid, TenantBy::Uid)))
        .collect();
    let first = classify(&dump, &none, 0, &facts, &BTreeMap::new(), at(start));
    assert!(first.table.processes.is_empty());
    assert!(first.found.contains_key(&me), "{:?}", first.found);
    let recheck = start + Duration::from_millis(1) + REGISTRATION_GRACE;
    assert_eq!(first.recheck_at, Some(recheck));
    let second = classify(&dump, &none, 0, &facts, &first.found, at(recheck));
    let listed = second
        .table
        .processes
        .iter()
        .find(|p| p.pid == me)
        .expect("this process listed");
    assert_eq!(listed.qps, 2);
    let comm = std::fs::read_to_string("/proc/self/comm").unwrap();
    assert_eq!(listed.comm, comm.trim_end());
    let euid = rustix::process::geteuid().as_raw();
    assert_eq!(listed.tenant.as_deref(), Some(euid.to_string().as_str()));
    // With a shaper connected under this pid it is not.
    let known: BTreeSet<i32> = [me].into();
    let registered = classify(&dump, &known, 0, &facts, &first.found, at(recheck));
    assert!(!registered.found.contains_key(&me));
    drop(probe);
}
