//! `justitia cdi`: a Container Device Interface (CDI) spec that hands a container the
//! host's RDMA device nodes together with the shaper.
//!
//! A container runtime that supports CDI (containerd, CRI-O, podman) applies a device's
//! `containerEdits` when the device is asked for by its fully qualified name,
//! `justitia.io/rdma=<name>`. This module lists the host's RDMA devices from sysfs (each
//! `class/infiniband_verbs/uverbsN/ibdev` names the device whose verbs node is
//! `/dev/infiniband/uverbsN`), or takes them as given, and writes one spec with, for each
//! device and for `all` (every device listed):
//!
//! | device | edits |
//! | --- | --- |
//! | `<name>` | its `uverbsN` node; the shaper's glibc and musl builds bound read-only under `/opt/justitia`; the preload list bound at `/etc/ld.so.preload`; the registration socket's directory (and `JUSTITIA_SOCKET` when the socket is not at the shaper's default path); `JUSTITIA_DEFAULT_CLASS` = the default class |
//! | `<name>-<class>` | the same with `JUSTITIA_DEFAULT_CLASS=<class>`, for each of `latency`, `throughput`, `bandwidth`, `auto` |
//! | `<name>-unshaped` | its `uverbsN` node only (the opt-out) |
//!
//! The spec-wide edits carry `/dev/infiniband/rdma_cm` when the host has it (sysfs
//! `class/misc/rdma_cm`, present once `rdma_ucm` is loaded); runtimes apply them with any
//! device of the spec.
//!
//! How the shaper gets into the container's processes: glibc's dynamic linker loads every
//! object `/etc/ld.so.preload` lists into every dynamically linked program, besides those
//! of `LD_PRELOAD`, so the spec binds a one-line list naming the glibc build
//! ([`CONTAINER_LIBRARY`], built for glibc 2.17 and later) there and sets no `LD_PRELOAD`.
//! A CDI `env` entry replaces a variable of the same name that the container sets itself
//! (the CDI library's OCI editor replaces by name, and runtimes apply CDI edits after the
//! container's own environment): an injected `LD_PRELOAD` would drop the image's own
//! (jemalloc, tcmalloc, profilers), and an injected `JUSTITIA_CLASS` the pod's. So the
//! image's `LD_PRELOAD` is kept (its objects come first in the search order, the shaper
//! after them), and the class the device name chooses is a default,
//! `JUSTITIA_DEFAULT_CLASS`, which the container's own `JUSTITIA_CLASS` overrides.
//!
//! musl's dynamic linker reads no preload list: the musl build is bound at
//! [`CONTAINER_MUSL_LIBRARY`], and `justitia oci-hook precreate` (podman's precreate hook)
//! or the runtime wrapper `justitia-runc` (containerd, CRI-O) adds it to a musl container's
//! `LD_PRELOAD`; without either a musl image runs unshaped unless it adds the musl build
//! itself, and justitiad lists its QPs as unshaped. Static programs load no shared object and are not shaped
//! either. The list also overrides an image's own `/etc/ld.so.preload`, which images do
//! not normally have. A set-user-ID program loads the shaper from the list too, and the
//! shaper then passes everything through without reading its variables.
//!
//! Device nodes carry only their path: runtimes read the type and numbers from the host's
//! node when they inject it.
//!
//! Invariants: every device name is a valid CDI device name and appears once; `all` lists
//! every device node of the per-device entries, in the same order; the spec is written
//! whole (a temporary file renamed over the target), because runtimes watch the spec
//! directories and would otherwise read a partial file.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

/// The CDI specification versions a spec may declare, oldest first: the releases the
/// CDI project's readers know (0.1.0 and 0.2.0 predate what they still accept).
pub const CDI_VERSIONS: [&str; 8] = [
    "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
];
/// Where the glibc build of `libjustitia.so` is bound inside the container: the one path
/// the preload list names (`packaging/ld.so.preload` holds exactly this line).
pub const CONTAINER_LIBRARY: &str = "/opt/justitia/libjustitia.so";
/// Where the musl build of `libjustitia.so` is bound inside the container.
pub const CONTAINER_MUSL_LIBRARY: &str = "/opt/justitia/musl/libjustitia.so";
/// The preload list glibc's dynamic linker reads in the container.
pub const CONTAINER_PRELOAD_LIST: &str = "/etc/ld.so.preload";
/// Where the DaemonSet copies the glibc build of `libjustitia.so` on the host; the musl
/// build and the preload list are beside it (`musl/libjustitia.so`, `ld.so.preload`).
pub const DEFAULT_HOST_LIBRARY: &str = "/var/lib/justitia/libjustitia.so";
/// justitiad's registration socket, as `packaging/justitiad.toml` has it.
pub const DEFAULT_SOCKET: &str = "/run/justitia/justitiad.sock";
/// The verbs devices' directory on the host and in the container.
const DEV_DIR: &str = "/dev/infiniband";
/// Largest `ibdev` file read from sysfs: a device name is at most 64 bytes (IB_DEVICE_NAME_MAX).
const IBDEV_MAX: u64 = 256;
/// Most devices the spec lists: each is a directory the host's sysfs gave, and a runaway
/// tree must not make a runaway spec.
const MAX_DEVICES: usize = 256;
/// Suffix of the opt-out devices: their device nodes only, no shaper.
const UNSHAPED: &str = "unshaped";

/// The class the shaper gives a container's flow unless the container sets its own
/// (`JUSTITIA_DEFAULT_CLASS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Class {
    /// Left untouched; probes the NIC's latency.
    Latency,
    /// Paced by operations.
    Throughput,
    /// Split into chunks and paced by bytes.
    Bandwidth,
    /// The core classifier decides per QP.
    Auto,
}

impl Class {
    const ALL: [Class; 4] = [
        Class::Latency,
        Class::Throughput,
        Class::Bandwidth,
        Class::Auto,
    ];

    /// The name `JUSTITIA_CLASS` takes.
    fn name(self) -> &'static str {
        match self {
            Class::Latency => "latency",
            Class::Throughput => "throughput",
            Class::Bandwidth => "bandwidth",
            Class::Auto => "auto",
        }
    }
}

/// Options of `justitia cdi`.
#[derive(Args, Debug, Clone)]
pub struct CdiArgs {
    /// Root of the sysfs tree the RDMA devices are listed from.
    #[arg(long, default_value = "/sys")]
    pub sysfs: PathBuf,
    /// An RDMA device to list: NAME (its uverbs node looked up in sysfs) or NAME=uverbsN
    /// (as given, sysfs not read for it). Repeatable. Default: every device sysfs lists.
    #[arg(long = "device", value_name = "NAME[=uverbsN]")]
    pub devices: Vec<String>,
    /// The spec's kind (vendor/class): devices are asked for as KIND=NAME.
    #[arg(long, default_value = "justitia.io/rdma")]
    pub kind: String,
    /// Where the glibc build of libjustitia.so is on the host (bound read-only into the
    /// container).
    #[arg(long, default_value = DEFAULT_HOST_LIBRARY)]
    pub library: PathBuf,
    /// Where the musl build of libjustitia.so is on the host [default: musl/libjustitia.so
    /// beside --library].
    #[arg(long)]
    pub musl_library: Option<PathBuf>,
    /// Where the preload list (one line: /opt/justitia/libjustitia.so, as
    /// packaging/ld.so.preload) is on the host, bound at /etc/ld.so.preload in the
    /// container [default: ld.so.preload beside --library].
    #[arg(long)]
    pub preload_list: Option<PathBuf>,
    /// justitiad's registration socket on the host; its directory is bound at the same
    /// path in the container.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// JUSTITIA_DEFAULT_CLASS of the devices without a class suffix.
    #[arg(long, value_enum, default_value = "auto")]
    pub class: Class,
    /// The cdiVersion the spec declares [default: the oldest its content allows, so that
    /// every runtime reads it]. A runtime refuses a spec whose version is newer than its
    /// CDI library knows (podman 4.3.1 knows up to 0.5.0, containerd 1.7 up to 0.8.0).
    #[arg(long)]
    pub cdi_version: Option<String>,
    /// Write the spec to this file (replaced whole) instead of standard output.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
}

/// One RDMA device: its name and its verbs node's name under `/dev/infiniband`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    /// The device's name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its verbs node (`uverbs0`).
    pub uverbs: String,
}

/// A CDI spec, as much of the format as this generator writes.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    cdi_version: String,
    kind: String,
    devices: Vec<Device>,
    #[serde(skip_serializing_if = "ContainerEdits::is_empty")]
    container_edits: ContainerEdits,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    container_edits: ContainerEdits,
}

#[derive(Debug, Default, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
struct ContainerEdits {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    device_nodes: Vec<DeviceNode>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    mounts: Vec<Mount>,
}

impl ContainerEdits {
    fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

#[derive(Debug, Clone, Serialize)]
struct DeviceNode {
    path: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
struct Mount {
    host_path: String,
    container_path: String,
    options: Vec<&'static str>,
}

/// `justitia cdi`.
pub fn run(args: &CdiArgs) -> Result<()> {
    let text = generate(args)?;
    match &args.output {
        Some(path) => write_whole(path, &text)?,
        None => print!("{text}"),
    }
    Ok(())
}

/// The spec `args` ask for, as JSON text ending in a newline.
pub fn generate(args: &CdiArgs) -> Result<String> {
    check_kind(&args.kind)?;
    if let Some(v) = &args.cdi_version {
        check_version(v)?;
    }
    let library = absolute("--library", &args.library)?;
    let beside_library = |name: &str| args.library.parent().map(|d| d.join(name));
    let musl_library = absolute(
        "--musl-library",
        &args
            .musl_library
            .clone()
            .or_else(|| beside_library("musl/libjustitia.so"))
            .context("--library names no file")?,
    )?;
    let preload_list = absolute(
        "--preload-list",
        &args
            .preload_list
            .clone()
            .or_else(|| beside_library("ld.so.preload"))
            .context("--library names no file")?,
    )?;
    let socket = absolute("--socket", &args.socket)?;
    let socket_dir = args
        .socket
        .parent()
        .filter(|d| *d != Path::new("/"))
        .with_context(|| format!("--socket {socket}: the socket must be inside a directory other than /, which is bound into the container"))?
        .to_string_lossy()
        .into_owned();
    let devices = if args.devices.is_empty() {
        list_devices(&args.sysfs)?
    } else {
        args.devices
            .iter()
            .map(|d| given_device(&args.sysfs, d))
            .collect::<Result<Vec<_>>>()?
    };
    ensure!(
        !devices.is_empty(),
        "no RDMA devices in {} (is the ib_uverbs module loaded?)",
        args.sysfs.join("class/infiniband_verbs").display()
    );
    let rdma_cm = args.sysfs.join("class/misc/rdma_cm").exists();
    let shaper = Shaper {
        library,
        musl_library,
        preload_list,
        socket,
        socket_dir,
        class: args.class,
    };
    let mut spec = build(&args.kind, &devices, rdma_cm, &shaper)?;
    let needed = minimum_version(&spec);
    if let Some(asked) = &args.cdi_version {
        ensure!(
            version_index(asked) >= version_index(needed),
            "--cdi-version {asked}: the spec needs {needed} or newer ({})",
            why_version(&spec)
        );
        spec.cdi_version.clone_from(asked);
    } else {
        spec.cdi_version = needed.into();
    }
    let mut text = serde_json::to_string_pretty(&spec)?;
    text.push('\n');
    Ok(text)
}

/// What every shaped device adds to its device nodes.
struct Shaper {
    library: String,
    musl_library: String,
    preload_list: String,
    socket: String,
    socket_dir: String,
    /// The class of the devices without a class suffix.
    class: Class,
}

impl Shaper {
    fn edits(&self, nodes: &[DeviceNode], class: Class) -> ContainerEdits {
        let mut env = vec![format!("JUSTITIA_DEFAULT_CLASS={}", class.name())];
        // The shaper looks for the daemon at the default path unless told otherwise.
        if self.socket != DEFAULT_SOCKET {
            env.push(format!("JUSTITIA_SOCKET={}", self.socket));
        }
        ContainerEdits {
            env,
            device_nodes: nodes.to_vec(),
            mounts: vec![
                Mount {
                    host_path: self.library.clone(),
                    container_path: CONTAINER_LIBRARY.into(),
                    options: vec!["ro", "nosuid", "nodev", "bind"],
                },
                Mount {
                    host_path: self.musl_library.clone(),
                    container_path: CONTAINER_MUSL_LIBRARY.into(),
                    options: vec!["ro", "nosuid", "nodev", "bind"],
                },
                Mount {
                    host_path: self.preload_list.clone(),
                    container_path: CONTAINER_PRELOAD_LIST.into(),
                    options: vec!["ro", "nosuid", "nodev", "noexec", "bind"],
                },
                // Read-only is enough: connecting to a Unix socket needs write permission
                // on the socket, which a read-only mount does not take away.
                Mount {
                    host_path: self.socket_dir.clone(),
                    container_path: self.socket_dir.clone(),
                    options: vec!["ro", "nosuid", "nodev", "noexec", "bind"],
                },
            ],
        }
    }
}

fn build(kind: &str, devices: &[RdmaDevice], rdma_cm: bool, shaper: &Shaper) -> Result<Spec> {
    let node = |d: &RdmaDevice| DeviceNode {
        path: format!("{DEV_DIR}/{}", d.uverbs),
    };
    let mut targets: Vec<(String, Vec<DeviceNode>)> = devices
        .iter()
        .map(|d| (d.name.clone(), vec![node(d)]))
        .collect();
    targets.push(("all".into(), devices.iter().map(node).collect()));
    let mut out = Vec::with_capacity(targets.len() * (Class::ALL.len() + 2));
    for (name, nodes) in &targets {
        out.push(Device {
            name: name.clone(),
            container_edits: shaper.edits(nodes, shaper.class),
        });
        for class in Class::ALL {
            out.push(Device {
                name: format!("{name}-{}", class.name()),
                container_edits: shaper.edits(nodes, class),
            });
        }
        out.push(Device {
            name: format!("{name}-{UNSHAPED}"),
            container_edits: ContainerEdits {
                device_nodes: nodes.clone(),
                ..ContainerEdits::default()
            },
        });
    }
    let mut seen = std::collections::HashSet::new();
    for d in &out {
        check_device_name(&d.name)?;
        if !seen.insert(d.name.as_str()) {
            bail!("device name `{}` would appear twice in the spec (a device named like another's variant?)", d.name);
        }
    }
    let container_edits = ContainerEdits {
        device_nodes: if rdma_cm {
            vec![DeviceNode {
                path: format!("{DEV_DIR}/rdma_cm"),
            }]
        } else {
            Vec::new()
        },
        ..ContainerEdits::default()
    };
    Ok(Spec {
        // Set by the caller from what the content needs.
        cdi_version: String::new(),
        kind: kind.into(),
        devices: out,
        container_edits,
    })
}

/// Every device the sysfs tree under `sysfs` lists, by verbs node number.
fn list_devices(sysfs: &Path) -> Result<Vec<RdmaDevice>> {
    let dir = sysfs.join("class/infiniband_verbs");
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        // No verbs devices at all: said by the caller, naming the directory.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        let uverbs = entry.file_name().to_string_lossy().into_owned();
        // The directory also holds `abi_version`.
        if uverbs_number(&uverbs).is_none() {
            continue;
        }
        ensure!(
            found.len() < MAX_DEVICES,
            "more than {MAX_DEVICES} verbs devices in {}",
            dir.display()
        );
        let name = read_ibdev(&entry.path().join("ibdev"))?;
        found.push(RdmaDevice { name, uverbs });
    }
    found.sort_by_key(|d| uverbs_number(&d.uverbs));
    Ok(found)
}

/// A device given on the command line: `NAME=uverbsN` as is, `NAME` looked up in sysfs.
fn given_device(sysfs: &Path, given: &str) -> Result<RdmaDevice> {
    if let Some((name, uverbs)) = given.split_once('=') {
        ensure!(
            uverbs_number(uverbs).is_some(),
            "--device {given}: `{uverbs}` is not a verbs node name (uverbsN)"
        );
        check_device_name(name).with_context(|| format!("--device {given}"))?;
        return Ok(RdmaDevice {
            name: name.into(),
            uverbs: uverbs.into(),
        });
    }
    check_device_name(given).with_context(|| format!("--device {given}"))?;
    let listed = list_devices(sysfs)?;
    let names: Vec<&str> = listed.iter().map(|d| d.name.as_str()).collect();
    listed
        .iter()
        .find(|d| d.name == given)
        .cloned()
        .with_context(|| {
            format!(
                "--device {given}: no such RDMA device in {} (found: {}); give NAME=uverbsN to name its node",
                sysfs.join("class/infiniband_verbs").display(),
                if names.is_empty() { "none".into() } else { names.join(", ") }
            )
        })
}

/// N of `uverbsN`, or `None` for any other name.
fn uverbs_number(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("uverbs")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The device name in an `ibdev` file, checked as a CDI device name.
fn read_ibdev(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut text = String::new();
    fs::File::open(path)
        .and_then(|f| f.take(IBDEV_MAX).read_to_string(&mut text))
        .with_context(|| format!("reading {}", path.display()))?;
    let name = text.trim().to_string();
    check_device_name(&name).with_context(|| format!("{}", path.display()))?;
    Ok(name)
}

/// A CDI device name: letters, digits, `_`, `-`, `.`, `:`, starting and ending with a
/// letter or digit.
fn check_device_name(name: &str) -> Result<()> {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    ensure!(
        edge(name.chars().next())
            && edge(name.chars().last())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c)),
        "`{name}` is not a CDI device name (letters, digits, _ - . : inside, a letter or digit at each end)"
    );
    Ok(())
}

/// A CDI kind, `vendor/class`: the vendor a domain-like name, the class a name.
fn check_kind(kind: &str) -> Result<()> {
    let Some((vendor, class)) = kind.split_once('/') else {
        bail!("--kind {kind}: expected vendor/class, e.g. justitia.io/rdma");
    };
    let word = |s: &str, extra: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || extra.contains(c))
    };
    ensure!(
        word(vendor, "_-.") && word(class, "_-"),
        "--kind {kind}: the vendor takes letters, digits, _ - . and the class letters, digits, _ -, each starting with a letter and ending with a letter or digit"
    );
    Ok(())
}

/// A version the CDI specification released.
fn check_version(version: &str) -> Result<()> {
    ensure!(
        CDI_VERSIONS.contains(&version),
        "--cdi-version {version}: not a CDI specification version (one of {})",
        CDI_VERSIONS.join(", ")
    );
    Ok(())
}

/// The position of a known version in [`CDI_VERSIONS`] (0 for anything else, which
/// [`check_version`] has refused before).
fn version_index(version: &str) -> usize {
    CDI_VERSIONS.iter().position(|v| *v == version).unwrap_or(0)
}

/// The oldest CDI version whose readers accept the spec's content, by the rules of the
/// specification's changelog for what this generator can write: a device name starting
/// with a digit needs 0.5.0 (older readers want a letter first). The generator writes
/// none of the later features (mount types 0.4.0, host paths of device nodes 0.5.0,
/// annotations and dotted classes 0.6.0, additional GIDs and Intel RDT 0.7.0, network
/// devices 1.1.0; [`check_kind`] refuses a dotted class), so anything else reads as 0.3.0.
fn minimum_version(spec: &Spec) -> &'static str {
    if spec.devices.iter().any(|d| starts_with_digit(&d.name)) {
        "0.5.0"
    } else {
        "0.3.0"
    }
}

/// Which content raised [`minimum_version`] above 0.3.0, for an error message.
fn why_version(spec: &Spec) -> String {
    match spec.devices.iter().find(|d| starts_with_digit(&d.name)) {
        Some(d) => format!("device name `{}` starts with a digit", d.name),
        None => "its content".into(),
    }
}

/// A name whose first character is a digit (allowed by CDI 0.5.0 and later only).
fn starts_with_digit(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| b.is_ascii_digit())
}

/// `path` as text, which must be absolute (the runtime resolves it on the host).
fn absolute(option: &str, path: &Path) -> Result<String> {
    ensure!(
        path.is_absolute(),
        "{option} {}: must be an absolute path",
        path.display()
    );
    Ok(path.to_string_lossy().into_owned())
}

/// Writes `text` to `path` through a temporary file in the same directory renamed over it,
/// so a runtime watching the directory never reads half a spec. The temporary name ends
/// in `.tmp`, which CDI's spec scan ignores.
fn write_whole(path: &Path, text: &str) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .with_context(|| format!("--output {}: not a file name", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp", file_name.to_string_lossy()));
    let result = (|| -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::Value;

    /// A sysfs tree with the given (uverbs, ibdev) pairs and, if asked, rdma_cm.
    fn fake_sysfs(devices: &[(&str, &str)], rdma_cm: bool) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let verbs = root.path().join("class/infiniband_verbs");
        fs::create_dir_all(&verbs).unwrap();
        fs::write(verbs.join("abi_version"), "6\n").unwrap();
        for (uverbs, ibdev) in devices {
            fs::create_dir_all(verbs.join(uverbs)).unwrap();
            fs::write(verbs.join(uverbs).join("ibdev"), format!("{ibdev}\n")).unwrap();
        }
        if rdma_cm {
            fs::create_dir_all(root.path().join("class/misc/rdma_cm")).unwrap();
        }
        root
    }

    fn args(sysfs: &Path) -> CdiArgs {
        CdiArgs {
            sysfs: sysfs.into(),
            devices: Vec::new(),
            kind: "justitia.io/rdma".into(),
            library: DEFAULT_HOST_LIBRARY.into(),
            musl_library: None,
            preload_list: None,
            socket: DEFAULT_SOCKET.into(),
            class: Class::Auto,
            cdi_version: None,
            output: None,
        }
    }

    fn spec(args: &CdiArgs) -> Value {
        serde_json::from_str(&generate(args).unwrap()).unwrap()
    }

    fn device<'a>(spec: &'a Value, name: &str) -> &'a Value {
        spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("no device {name} in {spec}"))
    }

    fn strings(v: &Value) -> Vec<&str> {
        v.as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap()).collect())
            .unwrap_or_default()
    }

    fn nodes(d: &Value) -> Vec<&str> {
        d["containerEdits"]["deviceNodes"]
            .as_array()
            .map(|a| a.iter().map(|n| n["path"].as_str().unwrap()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn every_sysfs_device_gets_its_node_the_shaper_and_the_default_class() {
        // uverbs10 sorts after uverbs2 by number, not by text.
        let sys = fake_sysfs(&[("uverbs10", "rxe0"), ("uverbs2", "mlx5_0")], true);
        let s = spec(&args(sys.path()));
        // Nothing in this content needs more than the oldest version runtimes read.
        assert_eq!(s["cdiVersion"], "0.3.0");
        assert_eq!(s["kind"], "justitia.io/rdma");
        let names: Vec<&str> = s["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.len(), 3 * 6, "{names:?}");
        assert_eq!(
            &names[..6],
            [
                "mlx5_0",
                "mlx5_0-latency",
                "mlx5_0-throughput",
                "mlx5_0-bandwidth",
                "mlx5_0-auto",
                "mlx5_0-unshaped"
            ]
        );
        assert_eq!(nodes(device(&s, "mlx5_0")), ["/dev/infiniband/uverbs2"]);
        assert_eq!(nodes(device(&s, "rxe0")), ["/dev/infiniband/uverbs10"]);
        assert_eq!(
            nodes(device(&s, "all")),
            ["/dev/infiniband/uverbs2", "/dev/infiniband/uverbs10"]
        );
        assert_eq!(
            s["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/infiniband/rdma_cm"
        );
        let rxe = &device(&s, "rxe0")["containerEdits"];
        // No LD_PRELOAD and no JUSTITIA_CLASS: those the container's own stay.
        assert_eq!(strings(&rxe["env"]), ["JUSTITIA_DEFAULT_CLASS=auto"]);
        let mounts = rxe["mounts"].as_array().unwrap();
        let pairs: Vec<(&str, &str)> = mounts
            .iter()
            .map(|m| {
                assert!(strings(&m["options"]).contains(&"ro"), "{m}");
                (
                    m["hostPath"].as_str().unwrap(),
                    m["containerPath"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            pairs,
            [
                (
                    "/var/lib/justitia/libjustitia.so",
                    "/opt/justitia/libjustitia.so"
                ),
                (
                    "/var/lib/justitia/musl/libjustitia.so",
                    "/opt/justitia/musl/libjustitia.so"
                ),
                ("/var/lib/justitia/ld.so.preload", "/etc/ld.so.preload"),
                ("/run/justitia", "/run/justitia"),
            ]
        );
        assert_eq!(
            strings(&device(&s, "all-latency")["containerEdits"]["env"]),
            ["JUSTITIA_DEFAULT_CLASS=latency"]
        );
    }

    #[test]
    fn the_unshaped_devices_carry_device_nodes_only() {
        let sys = fake_sysfs(&[("uverbs0", "rxe0")], false);
        let s = spec(&args(sys.path()));
        for name in ["rxe0-unshaped", "all-unshaped"] {
            let edits = device(&s, name)["containerEdits"].as_object().unwrap();
            assert_eq!(edits.keys().collect::<Vec<_>>(), ["deviceNodes"], "{name}");
            assert_eq!(nodes(device(&s, name)), ["/dev/infiniband/uverbs0"]);
        }
        // Without rdma_cm in sysfs there are no spec-wide edits at all.
        assert!(s.get("containerEdits").is_none(), "{s}");
    }

    #[test]
    fn the_version_is_the_oldest_the_content_allows_and_an_older_one_is_refused() {
        // A device whose name starts with a digit needs CDI 0.5.0: readers before it want
        // a letter first.
        let sys = fake_sysfs(&[("uverbs0", "0rxe")], false);
        let s = spec(&args(sys.path()));
        assert_eq!(s["cdiVersion"], "0.5.0");
        let mut a = args(sys.path());
        a.cdi_version = Some("0.4.0".into());
        let e = format!("{:#}", generate(&a).unwrap_err());
        assert!(
            e.contains("--cdi-version 0.4.0") && e.contains("needs 0.5.0") && e.contains("`0rxe`"),
            "{e}"
        );
        // Asking for a newer version than needed is the operator's choice.
        a.cdi_version = Some("1.1.0".into());
        assert_eq!(spec(&a)["cdiVersion"], "1.1.0");
    }

    #[test]
    fn the_default_class_and_paths_follow_the_options() {
        let sys = fake_sysfs(&[("uverbs0", "rxe0")], false);
        let mut a = args(sys.path());
        a.class = Class::Bandwidth;
        a.library = "/opt/lib/libjustitia.so".into();
        a.socket = "/var/run/jd/reg.sock".into();
        a.cdi_version = Some("0.6.0".into());
        let s = spec(&a);
        assert_eq!(s["cdiVersion"], "0.6.0");
        let edits = &device(&s, "rxe0")["containerEdits"];
        assert_eq!(
            strings(&edits["env"]),
            [
                "JUSTITIA_DEFAULT_CLASS=bandwidth",
                "JUSTITIA_SOCKET=/var/run/jd/reg.sock"
            ]
        );
        assert_eq!(edits["mounts"][0]["hostPath"], "/opt/lib/libjustitia.so");
        assert_eq!(
            edits["mounts"][1]["hostPath"],
            "/opt/lib/musl/libjustitia.so"
        );
        assert_eq!(edits["mounts"][2]["hostPath"], "/opt/lib/ld.so.preload");
        assert_eq!(edits["mounts"][3]["hostPath"], "/var/run/jd");
        assert_eq!(edits["mounts"][3]["containerPath"], "/var/run/jd");
        a.musl_library = Some("/srv/musl.so".into());
        a.preload_list = Some("/srv/preload".into());
        let s = spec(&a);
        let edits = &device(&s, "rxe0")["containerEdits"];
        assert_eq!(edits["mounts"][1]["hostPath"], "/srv/musl.so");
        assert_eq!(edits["mounts"][2]["hostPath"], "/srv/preload");
    }

    /// The list the DaemonSet installs names the path the spec binds the glibc build at,
    /// and nothing else: glibc would try to load every word of it into every process.
    #[test]
    fn the_packaged_preload_list_names_the_bound_library() {
        let list = include_str!("../../../packaging/ld.so.preload");
        assert_eq!(list, format!("{CONTAINER_LIBRARY}\n"));
    }

    #[test]
    fn given_devices_restrict_the_list_or_name_their_node() {
        let sys = fake_sysfs(&[("uverbs0", "rxe0"), ("uverbs1", "mlx5_0")], false);
        let mut a = args(sys.path());
        a.devices = vec!["mlx5_0".into(), "siw0=uverbs7".into()];
        let s = spec(&a);
        assert_eq!(s["devices"].as_array().unwrap().len(), 3 * 6);
        assert_eq!(nodes(device(&s, "mlx5_0")), ["/dev/infiniband/uverbs1"]);
        assert_eq!(nodes(device(&s, "siw0")), ["/dev/infiniband/uverbs7"]);
        assert!(s["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["name"] != "rxe0"));
        // NAME=uverbsN needs no sysfs at all.
        let mut a = args(Path::new("/nonexistent"));
        a.devices = vec!["rxe0=uverbs0".into()];
        assert_eq!(nodes(device(&spec(&a), "all")), ["/dev/infiniband/uverbs0"]);
    }

    #[test]
    fn bad_input_is_refused_naming_what_is_wrong() {
        let sys = fake_sysfs(&[("uverbs0", "rxe0")], false);
        let err = |f: &dyn Fn(&mut CdiArgs)| {
            let mut a = args(sys.path());
            f(&mut a);
            format!("{:#}", generate(&a).unwrap_err())
        };
        let e = err(&|a| a.devices = vec!["mlx5_9".into()]);
        assert!(
            e.contains("--device mlx5_9") && e.contains("found: rxe0"),
            "{e}"
        );
        let e = err(&|a| a.devices = vec!["rxe0=verbs0".into()]);
        assert!(e.contains("uverbsN"), "{e}");
        let e = err(&|a| a.devices = vec!["bad/name=uverbs0".into()]);
        assert!(e.contains("not a CDI device name"), "{e}");
        let e = err(&|a| a.kind = "rdma".into());
        assert!(e.contains("--kind rdma"), "{e}");
        let e = err(&|a| a.kind = "justitia.io/rd.ma".into());
        assert!(e.contains("--kind"), "{e}");
        let e = err(&|a| a.cdi_version = Some("1.1".into()));
        assert!(
            e.contains("--cdi-version 1.1") && e.contains("0.3.0, 0.4.0"),
            "{e}"
        );
        let e = err(&|a| a.cdi_version = Some("1.2.0".into()));
        assert!(e.contains("not a CDI specification version"), "{e}");
        let e = err(&|a| a.library = "libjustitia.so".into());
        assert!(e.contains("--library") && e.contains("absolute"), "{e}");
        let e = err(&|a| a.musl_library = Some("musl.so".into()));
        assert!(
            e.contains("--musl-library") && e.contains("absolute"),
            "{e}"
        );
        let e = err(&|a| a.preload_list = Some("ld.so.preload".into()));
        assert!(
            e.contains("--preload-list") && e.contains("absolute"),
            "{e}"
        );
        let e = err(&|a| a.socket = "/justitiad.sock".into());
        assert!(e.contains("--socket"), "{e}");
        // A device whose name is another's variant would make a name appear twice.
        let e = err(&|a| a.devices = vec!["rxe0=uverbs0".into(), "rxe0-unshaped=uverbs1".into()]);
        assert!(e.contains("`rxe0-unshaped` would appear twice"), "{e}");
        let empty = fake_sysfs(&[], false);
        let e = format!("{:#}", generate(&args(empty.path())).unwrap_err());
        assert!(
            e.contains("no RDMA devices") && e.contains("ib_uverbs"),
            "{e}"
        );
        let bad = fake_sysfs(&[("uverbs0", "rxe 0")], false);
        let e = format!("{:#}", generate(&args(bad.path())).unwrap_err());
        assert!(e.contains("ibdev") && e.contains("`rxe 0`"), "{e}");
    }

    #[test]
    fn the_output_file_is_replaced_whole() {
        let sys = fake_sysfs(&[("uverbs0", "rxe0")], true);
        let out = tempfile::tempdir().unwrap();
        let path = out.path().join("justitia.json");
        fs::write(&path, "stale").unwrap();
        let mut a = args(sys.path());
        a.output = Some(path.clone());
        run(&a).unwrap();
        let written: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(written, spec(&a));
        let left: Vec<_> = fs::read_dir(out.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["justitia.json"]);
    }
}
