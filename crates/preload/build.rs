//! Gives the shared library the symbol versions of the verbs it interposes.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    println!("cargo:rerun-if-changed=exports.map");
    // `--cfg loom`: the quick ring alone, model-checked (src/send_queue/ring.rs).
    println!("cargo::rustc-check-cfg=cfg(loom)");
    // The musl build defines no `dlsym`/`dlvsym` (src/dl.rs is glibc's), so its script
    // leaves out the glibc nodes: a linker refuses a version for a symbol not defined.
    let glibc = std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    let map = if glibc {
        format!("{dir}/exports.map")
    } else {
        let text = match std::fs::read_to_string(format!("{dir}/exports.map")) {
            Ok(text) => text,
            Err(e) => {
                println!("cargo::error=cannot read {dir}/exports.map: {e}");
                return;
            }
        };
        let out = std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into());
        let path = format!("{out}/exports-musl.map");
        if std::fs::write(&path, without_glibc_nodes(&text)).is_err() {
            println!("cargo::error=cannot write {path}");
        }
        path
    };
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={map}");
}

/// The version script without its `GLIBC_*` nodes (from a line that opens one to the line
/// that closes it) and the comment just before each.
fn without_glibc_nodes(text: &str) -> String {
    let mut kept: Vec<&str> = Vec::new();
    let mut in_node = false;
    for line in text.lines() {
        if line.starts_with("GLIBC_") {
            in_node = true;
            while kept
                .last()
                .is_some_and(|l| l.starts_with("/*") || l.starts_with("   "))
            {
                kept.pop();
            }
        }
        if !in_node {
            kept.push(line);
        }
        if in_node && line.starts_with('}') {
            in_node = false;
        }
    }
    kept.join("\n") + "\n"
}
