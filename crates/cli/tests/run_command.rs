//! `justitia run` as a user meets it on a host where the run cannot start: everything
//! refused here is refused before any load generator is spawned, so these tests need no
//! RDMA device (the load generator named does not even exist).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A load generator that cannot be started: reaching a spawn fails with "starting".
const NO_LOADGEN: &str = "/nonexistent/justitia-loadgen";

fn justitia_run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_justitia"))
        .arg("run")
        .args(args)
        .args([
            "--loadgen",
            NO_LOADGEN,
            "--shaper",
            "/nonexistent/libjustitia.so",
        ])
        .output()
        .expect("the justitia binary runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn data(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn a_run_over_the_process_cap_is_refused_before_anything_starts() {
    let out = justitia_run(&[&data("copies-300.toml"), "--duration-ms", "100"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    // 1 latency flow + 300 copies = 301 flows, two processes each.
    assert!(
        err.contains("run `native` would start 602 processes (a responder and a requester for each of its 301 flows), more than --max-processes 64"),
        "{err}"
    );
    assert!(!err.contains("starting"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // A cap of 602 lets it past this check (to the device check or the spawn).
    let out = justitia_run(&[
        &data("copies-300.toml"),
        "--duration-ms",
        "100",
        "--max-processes",
        "602",
    ]);
    assert!(
        !stderr(&out).contains("--max-processes"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_missing_rdma_device_is_refused_once_before_anything_starts() {
    let sysfs = Path::new("/sys/class/infiniband");
    let has_devices = sysfs.read_dir().is_ok_and(|mut d| d.next().is_some());
    let out = justitia_run(&[&data("tiny.toml"), "-d", "no-such-device0"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    let expected = if has_devices {
        "RDMA device no-such-device0 not found in /sys/class/infiniband (devices here: "
    } else {
        "no RDMA device (/sys/class/infiniband is empty or missing)"
    };
    assert_eq!(err.matches(expected).count(), 1, "{err}");
    assert!(!err.contains("os error 38"), "{err}");
    assert!(!err.contains("starting"), "{err}");
}

#[test]
fn repeat_and_max_processes_refuse_nonsense() {
    for args in [["--repeat", "0"], ["--max-processes", "1"]] {
        let out = justitia_run(&[&data("tiny.toml"), args[0], args[1]]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(args[0]) && err.contains("not in"), "{err}");
    }
}
