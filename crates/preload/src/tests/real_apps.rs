//! The shaper under real applications: loaded through `dlopen`, destroying objects with
//! requests held, moving QPs to the error state, not polling, forking. Each test here
//! reproduces one way an application that runs without the shaper failed with it.

use crate::mock::MockDevice;

/// An application (NCCL, a ctypes binding) loads libibverbs with `dlopen(RTLD_LOCAL)` after
/// the shaper: the shaper must still reach the real verbs, found in the library actually
/// loaded; looking in the global scope after itself (`RTLD_NEXT`) finds nothing there.
#[test]
fn real_verbs_are_found_in_a_libibverbs_loaded_with_rtld_local() {
    // SAFETY: loading libibverbs runs its constructors, which only register providers.
    let handle = unsafe {
        libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        eprintln!("skipping: libibverbs.so.1 is not installed");
        return;
    }
    // SAFETY: the names are NUL-terminated; the address is not called.
    let (expected, next) = unsafe {
        (
            libc::dlvsym(
                handle,
                c"ibv_ack_cq_events".as_ptr(),
                c"IBVERBS_1.1".as_ptr(),
            ),
            justitia_verbs::loader::next_symbol(c"ibv_ack_cq_events", Some(c"IBVERBS_1.1")),
        )
    };
    assert!(!expected.is_null());
    assert!(
        next.is_none(),
        "a local library is outside the global scope"
    );
    // Through the export: libibverbs' own ibv_ack_cq_events counts the acknowledged event
    // in the CQ (a mock CQ; the shaper has none of its own events to take out).
    let dev = MockDevice::new();
    let cq = dev.create_cq();
    // SAFETY: a live CQ.
    unsafe { crate::exports::justitia_ibv_ack_cq_events_1_1(cq, 1) };
    // SAFETY: as above.
    assert_eq!(
        unsafe { (*cq).comp_events_completed },
        1,
        "the real verb was reached"
    );
}
