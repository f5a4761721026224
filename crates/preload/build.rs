//! Gives the shared library the symbol versions of the verbs it interposes.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    println!("cargo:rerun-if-changed=exports.map");
    // `--cfg loom`: the quick ring alone, model-checked (src/send_queue/ring.rs).
    println!("cargo::rustc-check-cfg=cfg(loom)");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
}
