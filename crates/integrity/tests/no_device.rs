//! The checker's behaviour on a machine without a usable RDMA device (such as a build host
//! whose kernel has no InfiniBand support): a clear error and a failing exit status, never
//! a panic. Where a device does exist, the checker must instead pass a short run.

use std::process::{Command, Output};

/// Runs the checker with `args`, never under the shaper.
fn checker(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_justitia-integrity"))
        .args(args)
        .env_remove("LD_PRELOAD")
        .output();
    let Ok(out) = out else {
        panic!("cannot run the checker binary");
    };
    out
}

#[test]
fn without_a_device_the_error_says_what_is_missing() {
    let out = checker(&["--transfers", "20", "--max-size", "64K", "--seed", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("seed 1 (replay with --seed 1)"), "{stdout}");
    if out.status.success() {
        assert!(stdout.contains("PASS: 2"), "{stdout}");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
        assert!(stderr.contains("needs an RDMA device"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn the_wr_post_api_fails_as_clearly_without_a_device() {
    let out = checker(&[
        "--transfers",
        "20",
        "--max-size",
        "64K",
        "--seed",
        "1",
        "--post-api",
        "wr",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("seed 1 (replay with --seed 1 --post-api wr)"),
        "{stdout}"
    );
    if out.status.success() {
        assert!(stdout.contains("PASS: 2"), "{stdout}");
        assert!(stdout.contains("ibv_create_qp_ex"), "{stdout}");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
        // No device at all, or a device without the extended send interface: either way
        // the error says so, and the checker did not quietly use ibv_post_send.
        assert!(
            stderr.contains("needs an RDMA device") || stderr.contains("--post-api wr needs"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn an_unknown_post_api_is_refused() {
    let out = checker(&["--post-api", "ibv_post_send"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("post-send") && stderr.contains("wr"),
        "{stderr}"
    );
}
