//! `justitia oci-hook precreate`: gives a musl container the shaper's musl build, keeping
//! the image's own `LD_PRELOAD`.
//!
//! The CDI spec (`justitia cdi`) brings the shaper into glibc containers through a bound
//! `/etc/ld.so.preload`, which musl's dynamic linker does not read; musl reads only
//! `LD_PRELOAD`. A CDI `env` edit cannot add to that variable: runtimes replace a variable
//! by name, so the image's own preloads (allocators, profilers) would be lost. This hook
//! runs at the `precreate` stage of the OCI hooks configuration (`oci-hooks(5)`, run by
//! podman and buildah): it reads the container's proposed OCI configuration on standard
//! input, after the runtime has applied the CDI edits and with `root.path` naming the
//! mounted root file system, and writes it back on standard output. It changes the
//! configuration only when all of these hold:
//!
//! 1. the container was given a shaped device: a mount puts the musl build at
//!    [`CONTAINER_MUSL_LIBRARY`] (the `-unshaped` device and containers without a device
//!    carry none);
//! 2. the image is a musl image: its root holds musl's x86-64 dynamic linker and no glibc
//!    one (an image with both, such as Alpine with `gcompat`, is left alone: glibc programs
//!    there get the shaper from the list, and a musl build preloaded into them would not
//!    load);
//! 3. `LD_PRELOAD` does not list the musl build already.
//!
//! Then the musl build is appended to `LD_PRELOAD`, after whatever the image or the
//! container set there: their objects come first in the search order, as the list puts the
//! glibc build after them. Nothing else is touched, and the class stays the device's
//! default (`JUSTITIA_DEFAULT_CLASS`) unless the container sets `JUSTITIA_CLASS`.
//!
//! A runtime refuses to start a container whose precreate hook fails or prints something
//! that is not a configuration, so this hook never fails on what it reads: input it cannot
//! parse, or a configuration it does not change, is written back byte for byte, and the
//! reason goes to standard error in one line (which podman discards; run by hand, it
//! explains). It exits non-zero only when it cannot write its output.
//!
//! Runtimes that run no precreate hook (containerd, CRI-O: Kubernetes' nodes) get the same
//! edit from [`run_runtime`], a wrapper of the OCI runtime in the manner of
//! `nvidia-container-runtime`: `justitia` started under the name `justitia-runc` (a link
//! named so, which containerd's `BinaryName` or CRI-O's `runtime_path` names) edits the
//! bundle's `config.json` on `create` and `run` (whose `root.path` is relative to the
//! bundle, the root file system mounted there by then), then executes the real runtime
//! with the same arguments. Whatever it cannot read or write, it leaves, and the real
//! runtime runs as if called directly.
//!
//! Invariant: the output is the input unchanged, or the input's JSON with exactly one
//! `process.env` entry (`LD_PRELOAD`) added or extended.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde_json::Value;

use crate::cdi::CONTAINER_MUSL_LIBRARY;

/// The most of a configuration the hook parses; a larger one (OCI configurations are a few
/// KiB) passes through unread.
const MAX_CONFIG: u64 = 16 << 20;

/// Symbolic links followed while resolving one path inside the image, as the kernel's
/// limit for one lookup.
const MAX_LINKS: usize = 40;

/// musl's x86-64 dynamic linker, where every musl image has it.
const MUSL_LOADER: &str = "lib/ld-musl-x86_64.so.1";

/// glibc's x86-64 dynamic linker, at the paths distributions put it (the ABI's, Debian's
/// multiarch directory, and their merged-/usr twins).
const GLIBC_LOADERS: [&str; 5] = [
    "lib64/ld-linux-x86-64.so.2",
    "usr/lib64/ld-linux-x86-64.so.2",
    "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "lib/ld-linux-x86-64.so.2",
];

/// Arguments of `justitia oci-hook`.
#[derive(Args)]
pub struct OciHookArgs {
    /// The hook stage the runtime runs this at; only `precreate` edits a configuration.
    stage: Stage,
}

/// The OCI hook stages this command serves.
#[derive(Clone, Copy, ValueEnum)]
enum Stage {
    /// Before the runtime creates the container: configuration in, configuration out.
    Precreate,
}

/// What the hook did with one configuration.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Written back as read, for the reason given.
    Unchanged(String),
    /// The musl build appended to `LD_PRELOAD`: the new configuration, and `LD_PRELOAD`'s
    /// new value.
    Preloaded(Vec<u8>, String),
}

/// The C library an image's root file system provides its dynamically linked programs.
#[derive(Debug, PartialEq, Clone, Copy)]
enum ImageLibc {
    Musl,
    Glibc,
    Both,
    Neither,
}

/// Runs the hook on standard input and output.
pub fn run(args: &OciHookArgs) -> Result<()> {
    let Stage::Precreate = args.stage;
    let mut input = Vec::new();
    io::stdin()
        .take(MAX_CONFIG)
        .read_to_end(&mut input)
        .context("reading the OCI configuration from standard input")?;
    let mut stdout = io::stdout().lock();
    if input.len() as u64 >= MAX_CONFIG {
        // Too large to be a configuration this hook edits: pass it, and the rest, through.
        stdout
            .write_all(&input)
            .context("writing standard output")?;
        io::copy(&mut io::stdin(), &mut stdout).context("copying standard input")?;
        eprintln!("justitia oci-hook: a configuration over {MAX_CONFIG} bytes, passed through");
        return stdout.flush().context("writing standard output");
    }
    match precreate(&input) {
        Outcome::Unchanged(reason) => {
            stdout
                .write_all(&input)
                .context("writing standard output")?;
            eprintln!("justitia oci-hook: unchanged: {reason}");
        }
        Outcome::Preloaded(output, preload) => {
            stdout
                .write_all(&output)
                .context("writing standard output")?;
            eprintln!("justitia oci-hook: a musl image: LD_PRELOAD={preload}");
        }
    }
    stdout.flush().context("writing standard output")
}

/// The precreate decision for one configuration (module docs: when it changes one).
pub fn precreate(input: &[u8]) -> Outcome {
    edit(input, None)
}

/// The decision for one configuration whose `root.path` may be relative to `bundle` (a
/// runtime's `create` reads it so); without a bundle it must be absolute.
fn edit(input: &[u8], bundle: Option<&Path>) -> Outcome {
    let mut config: Value = match serde_json::from_slice(input) {
        Ok(config) => config,
        Err(err) => return Outcome::Unchanged(format!("not a JSON configuration: {err}")),
    };
    if !mounts_musl_build(&config) {
        return Outcome::Unchanged(format!("no mount at {CONTAINER_MUSL_LIBRARY}"));
    }
    let Some(root) = config.pointer("/root/path").and_then(Value::as_str) else {
        return Outcome::Unchanged("no root.path".into());
    };
    let root = match (Path::new(root), bundle) {
        (root, _) if root.is_absolute() => root.to_path_buf(),
        (root, Some(bundle)) => bundle.join(root),
        // Relative to a bundle directory the hook is not told of.
        (root, None) => {
            return Outcome::Unchanged(format!("root.path {} is not absolute", root.display()))
        }
    };
    match image_libc(&root) {
        ImageLibc::Musl => {}
        other => return Outcome::Unchanged(format!("the image's C library: {other:?}")),
    }
    let Some(process) = config.get_mut("process").and_then(Value::as_object_mut) else {
        return Outcome::Unchanged("no process".into());
    };
    let env = process
        .entry("env")
        .or_insert_with(|| Value::Array(Vec::new()));
    let Some(env) = env.as_array_mut() else {
        return Outcome::Unchanged("process.env is not a list".into());
    };
    // The last definition is the one a process gets.
    let existing = env.iter().rposition(|entry| {
        entry
            .as_str()
            .is_some_and(|entry| entry.starts_with("LD_PRELOAD="))
    });
    let preload = match existing.and_then(|at| env[at].as_str()) {
        Some(entry) => {
            let current = &entry["LD_PRELOAD=".len()..];
            // musl and glibc both split the list at colons and white space.
            let listed = current
                .split(|c: char| c == ':' || c.is_ascii_whitespace())
                .any(|object| object == CONTAINER_MUSL_LIBRARY);
            if listed {
                return Outcome::Unchanged("LD_PRELOAD lists the musl build already".into());
            }
            if current.trim().is_empty() {
                CONTAINER_MUSL_LIBRARY.to_string()
            } else {
                format!("{current}:{CONTAINER_MUSL_LIBRARY}")
            }
        }
        None => CONTAINER_MUSL_LIBRARY.to_string(),
    };
    let entry = Value::String(format!("LD_PRELOAD={preload}"));
    match existing {
        Some(at) => env[at] = entry,
        None => env.push(entry),
    }
    match serde_json::to_vec(&config) {
        Ok(output) => Outcome::Preloaded(output, preload),
        Err(err) => Outcome::Unchanged(format!("cannot serialise the configuration: {err}")),
    }
}

/// The name `justitia` answers to as the runtime wrapper.
pub const RUNTIME_WRAPPER_NAME: &str = "justitia-runc";

/// Where the real runtime is looked for when `JUSTITIA_RUNTIME` does not name it.
const RUNTIMES: [&str; 4] = [
    "/usr/sbin/runc",
    "/usr/bin/runc",
    "/usr/local/sbin/runc",
    "/usr/local/bin/runc",
];

/// Runs as the OCI runtime wrapper: `args` are the runtime's (without the program name).
/// Edits the bundle's configuration on `create` or `run`, then executes the real runtime
/// (`JUSTITIA_RUNTIME`, or runc where distributions install it); returns only when that
/// cannot be executed.
pub fn run_runtime(args: &[OsString]) -> Result<()> {
    if let Some(bundle) = bundle_of(args) {
        let config = bundle.join("config.json");
        match std::fs::read(&config) {
            Ok(input) => match edit(&input, Some(&bundle)) {
                Outcome::Preloaded(output, preload) => {
                    if let Err(err) = replace_file(&config, &output) {
                        eprintln!(
                            "justitia-runc: cannot write {}: {err}; the container starts unshaped",
                            config.display()
                        );
                    } else {
                        eprintln!("justitia-runc: a musl image: LD_PRELOAD={preload}");
                    }
                }
                Outcome::Unchanged(_) => {}
            },
            Err(err) => eprintln!("justitia-runc: cannot read {}: {err}", config.display()),
        }
    }
    let runtime = std::env::var_os("JUSTITIA_RUNTIME")
        .map(PathBuf::from)
        .or_else(|| {
            RUNTIMES
                .iter()
                .map(PathBuf::from)
                .find(|path| path.is_file())
        })
        .context("no OCI runtime: set JUSTITIA_RUNTIME or install runc")?;
    let err =
        std::os::unix::process::CommandExt::exec(std::process::Command::new(&runtime).args(args));
    Err(err).with_context(|| format!("executing {}", runtime.display()))
}

/// The bundle directory of a runtime command that creates a container (`create` or
/// `run`): its `--bundle`/`-b` value, else the working directory; `None` for any other
/// command.
fn bundle_of(args: &[OsString]) -> Option<PathBuf> {
    let command = args
        .iter()
        .position(|arg| arg == "create" || arg == "run")?;
    let rest = &args[command + 1..];
    for (i, arg) in rest.iter().enumerate() {
        let Some(text) = arg.to_str() else {
            continue;
        };
        if let Some(value) = text
            .strip_prefix("--bundle=")
            .or_else(|| text.strip_prefix("-b="))
        {
            return Some(PathBuf::from(value));
        }
        if text == "--bundle" || text == "-b" {
            return rest.get(i + 1).map(PathBuf::from);
        }
    }
    std::env::current_dir().ok()
}

/// Writes `bytes` over `path` whole (a temporary file beside it, renamed), keeping its
/// permissions, so that the runtime never reads a partial configuration.
fn replace_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let permissions = std::fs::metadata(path)?.permissions();
    let mut temporary = path.as_os_str().to_os_string();
    temporary.push(".justitia");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, bytes)?;
    std::fs::set_permissions(&temporary, permissions)?;
    std::fs::rename(&temporary, path)
}

/// Whether one of the configuration's mounts puts something at the musl build's path.
fn mounts_musl_build(config: &Value) -> bool {
    config
        .get("mounts")
        .and_then(Value::as_array)
        .is_some_and(|mounts| {
            mounts.iter().any(|mount| {
                mount.get("destination").and_then(Value::as_str) == Some(CONTAINER_MUSL_LIBRARY)
            })
        })
}

/// Which dynamic linkers the image's root holds.
fn image_libc(root: &Path) -> ImageLibc {
    let musl = exists_in_root(root, Path::new(MUSL_LOADER));
    let glibc = GLIBC_LOADERS
        .iter()
        .any(|loader| exists_in_root(root, Path::new(loader)));
    match (musl, glibc) {
        (true, false) => ImageLibc::Musl,
        (false, true) => ImageLibc::Glibc,
        (true, true) => ImageLibc::Both,
        (false, false) => ImageLibc::Neither,
    }
}

/// Whether `path` (relative to the image's root) names a file there, with symbolic links
/// resolved inside the root: an absolute link target is the image's path, never the
/// host's, and `..` stops at the root.
fn exists_in_root(root: &Path, path: &Path) -> bool {
    let mut pending: Vec<OsString> = components(path).into_iter().rev().collect();
    let mut resolved = PathBuf::new();
    let mut links = 0;
    while let Some(component) = pending.pop() {
        if component == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&component);
        let Ok(meta) = root.join(&candidate).symlink_metadata() else {
            return false;
        };
        if !meta.file_type().is_symlink() {
            resolved = candidate;
            continue;
        }
        links += 1;
        if links > MAX_LINKS {
            return false;
        }
        let Ok(target) = root.join(&candidate).read_link() else {
            return false;
        };
        if target.is_absolute() {
            resolved = PathBuf::new();
        }
        pending.extend(components(&target).into_iter().rev());
    }
    !resolved.as_os_str().is_empty() && root.join(&resolved).is_file()
}

/// A path's names and `..`s, without the root, `.` or empty components.
fn components(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|component| match component {
            Component::Normal(name) => Some(name.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    /// An image root with the files given (relative paths), each a small regular file.
    fn image(files: &[&str]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for file in files {
            let path = root.path().join(file);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, b"\x7fELF").unwrap();
        }
        root
    }

    /// A configuration as podman proposes it for a container given a shaped device.
    fn config(root: &Path, env: &[&str], musl_mount: bool) -> Vec<u8> {
        let mut mounts = vec![serde_json::json!({
            "destination": "/etc/ld.so.preload", "type": "bind",
            "source": "/var/lib/justitia/ld.so.preload", "options": ["ro", "bind"]
        })];
        if musl_mount {
            mounts.push(serde_json::json!({
                "destination": CONTAINER_MUSL_LIBRARY, "type": "bind",
                "source": "/var/lib/justitia/musl/libjustitia.so", "options": ["ro", "bind"]
            }));
        }
        serde_json::to_vec(&serde_json::json!({
            "ociVersion": "1.0.2-dev",
            "process": {"args": ["/usr/bin/app"], "env": env, "cwd": "/",
                        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576u64, "soft": 1048576u64}]},
            "root": {"path": root.to_str().unwrap()},
            "mounts": mounts,
            "linux": {"devices": [{"path": "/dev/infiniband/uverbs0", "type": "c", "major": 231, "minor": 192}]},
            "annotations": {"io.container.manager": "libpod"}
        }))
        .unwrap()
    }

    fn env_of(output: &[u8]) -> Vec<String> {
        let config: Value = serde_json::from_slice(output).unwrap();
        serde_json::from_value(config["process"]["env"].clone()).unwrap()
    }

    #[test]
    fn a_musl_image_gets_the_musl_build_after_its_own_preloads() {
        let root = image(&[MUSL_LOADER]);
        let input = config(
            root.path(),
            &["PATH=/usr/bin", "LD_PRELOAD=/usr/lib/libjemalloc.so.2"],
            true,
        );
        let Outcome::Preloaded(output, preload) = precreate(&input) else {
            panic!("a musl image with the musl build mounted was left alone");
        };
        assert_eq!(
            preload,
            "/usr/lib/libjemalloc.so.2:/opt/justitia/musl/libjustitia.so"
        );
        assert_eq!(
            env_of(&output),
            [
                "PATH=/usr/bin",
                "LD_PRELOAD=/usr/lib/libjemalloc.so.2:/opt/justitia/musl/libjustitia.so"
            ]
        );
        // Everything else is as it came: only process.env differs.
        let mut before: Value = serde_json::from_slice(&input).unwrap();
        let mut after: Value = serde_json::from_slice(&output).unwrap();
        before["process"]["env"] = Value::Null;
        after["process"]["env"] = Value::Null;
        assert_eq!(before, after);
    }

    #[test]
    fn without_a_preload_of_its_own_the_musl_build_is_the_whole_list() {
        let root = image(&[MUSL_LOADER]);
        for env in [
            &["PATH=/usr/bin"][..],
            &["PATH=/usr/bin", "LD_PRELOAD="][..],
        ] {
            let Outcome::Preloaded(output, preload) = precreate(&config(root.path(), env, true))
            else {
                panic!("left alone with env {env:?}");
            };
            assert_eq!(preload, CONTAINER_MUSL_LIBRARY);
            assert_eq!(
                env_of(&output),
                [
                    "PATH=/usr/bin",
                    "LD_PRELOAD=/opt/justitia/musl/libjustitia.so"
                ]
            );
        }
        // No process.env at all: one is made.
        let mut bare: Value = serde_json::from_slice(&config(root.path(), &[], true)).unwrap();
        bare["process"].as_object_mut().unwrap().remove("env");
        let Outcome::Preloaded(output, _) = precreate(&serde_json::to_vec(&bare).unwrap()) else {
            panic!("a configuration without process.env was left alone");
        };
        assert_eq!(
            env_of(&output),
            ["LD_PRELOAD=/opt/justitia/musl/libjustitia.so"]
        );
    }

    #[test]
    fn what_is_not_a_shaped_musl_container_passes_unchanged() {
        let musl = image(&[MUSL_LOADER]);
        let glibc = image(&["lib64/ld-linux-x86-64.so.2"]);
        let multiarch = image(&["usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"]);
        let both = image(&[MUSL_LOADER, "lib/ld-linux-x86-64.so.2"]);
        let neither = image(&["usr/bin/static_app"]);
        let cases: [(&str, Vec<u8>); 7] = [
            ("unshaped device", config(musl.path(), &[], false)),
            ("glibc image", config(glibc.path(), &[], true)),
            ("multiarch glibc image", config(multiarch.path(), &[], true)),
            ("both loaders", config(both.path(), &[], true)),
            ("no loader", config(neither.path(), &[], true)),
            (
                "already preloaded",
                config(
                    musl.path(),
                    &["LD_PRELOAD=/a.so /opt/justitia/musl/libjustitia.so"],
                    true,
                ),
            ),
            ("not JSON", b"{\"process\": ".to_vec()),
        ];
        for (case, input) in cases {
            assert!(
                matches!(precreate(&input), Outcome::Unchanged(_)),
                "{case}: changed"
            );
        }
        let mut relative: Value = serde_json::from_slice(&config(musl.path(), &[], true)).unwrap();
        relative["root"]["path"] = Value::from("rootfs");
        assert!(matches!(
            precreate(&serde_json::to_vec(&relative).unwrap()),
            Outcome::Unchanged(reason) if reason.contains("not absolute")
        ));
    }

    /// As a runtime's `create` sees it: `root.path` relative to the bundle.
    #[test]
    fn a_bundle_relative_root_is_read_in_the_bundle() {
        let bundle = image(&["rootfs/lib/ld-musl-x86_64.so.1"]);
        let mut config: Value =
            serde_json::from_slice(&config(&bundle.path().join("rootfs"), &[], true)).unwrap();
        config["root"]["path"] = Value::from("rootfs");
        let input = serde_json::to_vec(&config).unwrap();
        assert!(matches!(
            edit(&input, Some(bundle.path())),
            Outcome::Preloaded(_, preload) if preload == CONTAINER_MUSL_LIBRARY
        ));
        assert!(matches!(precreate(&input), Outcome::Unchanged(_)));
    }

    #[test]
    fn the_bundle_is_found_as_runc_is_called() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        let bundle = |list: &[&str]| bundle_of(&args(list));
        assert_eq!(
            bundle(&[
                "--root",
                "/run/runc",
                "--log",
                "/x/log.json",
                "create",
                "--bundle",
                "/b/1",
                "--pid-file",
                "/b/1/pid",
                "id1"
            ]),
            Some(PathBuf::from("/b/1"))
        );
        assert_eq!(
            bundle(&["create", "--bundle=/b/2", "id2"]),
            Some(PathBuf::from("/b/2"))
        );
        assert_eq!(
            bundle(&["run", "-b", "/b/3", "id3"]),
            Some(PathBuf::from("/b/3"))
        );
        assert_eq!(bundle(&["create", "id4"]), std::env::current_dir().ok());
        for other in [
            &["start", "id"][..],
            &["delete", "--force", "id"],
            &["state", "id"],
        ] {
            assert_eq!(bundle(other), None, "{other:?}");
        }
    }

    /// The file is replaced whole, with its permissions.
    #[test]
    fn the_configuration_is_replaced_whole() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        fs::write(&path, b"{}").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        replace_file(&path, b"{\"a\":1}").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"{\"a\":1}");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn links_resolve_inside_the_image_never_on_the_host() {
        // Merged /usr with a relative link, as Debian 12 and Fedora lay it out.
        let merged = image(&["usr/lib64/ld-linux-x86-64.so.2", MUSL_LOADER]);
        symlink("usr/lib64", merged.path().join("lib64")).unwrap();
        assert_eq!(image_libc(merged.path()), ImageLibc::Both);
        // An absolute link is the image's path: /lib64 -> /usr/lib64 inside the root.
        let absolute = image(&["usr/lib64/ld-linux-x86-64.so.2"]);
        symlink("/usr/lib64", absolute.path().join("lib64")).unwrap();
        assert!(exists_in_root(
            absolute.path(),
            Path::new("lib64/ld-linux-x86-64.so.2")
        ));
        // A link to the host's loader, absolute, does not count when the image lacks it;
        // nor does `..` climb out of the root.
        let escaping = image(&[MUSL_LOADER]);
        fs::create_dir_all(escaping.path().join("lib")).unwrap();
        symlink(
            "/lib64/ld-linux-x86-64.so.2",
            escaping.path().join("lib/ld-linux-x86-64.so.2"),
        )
        .unwrap();
        symlink("../../../../../../lib64", escaping.path().join("lib64")).unwrap();
        assert_eq!(image_libc(escaping.path()), ImageLibc::Musl);
        // A loop of links ends.
        let looping = image(&[MUSL_LOADER]);
        symlink("usr", looping.path().join("lib64")).unwrap();
        symlink("lib64", looping.path().join("usr")).unwrap();
        assert_eq!(image_libc(looping.path()), ImageLibc::Musl);
    }
}
