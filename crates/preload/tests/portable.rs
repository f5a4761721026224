//! The shipped builds of `libjustitia.so` load wherever the README says they do.
//!
//! `LD_PRELOAD` reaches every process of a container, its entrypoint shell first; a library
//! that cannot be loaded there stops each of them before `main` (glibc's "version
//! `GLIBC_2.34' not found", exit 1; a missing `libgcc_s.so.1`, exit 127). So, as auditwheel
//! audits a manylinux wheel, the objects `scripts/build-shaper.sh` writes are read here:
//!
//! - the glibc build asks for nothing above `GLIBC_2.17` (the version needs of its
//!   `.gnu.version_r`) and needs only glibc's own libraries (`DT_NEEDED`): no `libgcc_s`,
//!   no `libstdc++`;
//! - the musl build needs only musl's `libc.so` and asks for no symbol version at all;
//! - each exports the verbs of `exports.map` and nothing else (the glibc build `dlsym` and
//!   `dlvsym` too): none of Rust's own symbols, which would interpose on other libraries'.
//!
//! The audit itself is checked against objects it must refuse: the ordinary (host-linked)
//! build, and each portable build held to the other C library's rules.
//!
//! And the musl build is loaded into a real musl program (`apps/libc_probe.c`, built with
//! Debian's `musl-gcc`): it runs as it does without the shaper, where the glibc build stops
//! it at load.
//!
//! The portable builds need zig (`scripts/setup.sh` installs it), so the tests that read
//! them are ignored by a plain `cargo test`; `scripts/test.sh` builds them and runs these.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use object::elf;
use object::read::elf::{Dyn, ElfFile64, FileHeader, Sym};
use object::Endianness;
use std::process::Command;

/// What a C library's build may need.
struct Baseline {
    /// Its name in messages.
    name: &'static str,
    /// The shared objects it may name in `DT_NEEDED`.
    libraries: &'static [&'static str],
    /// The newest `GLIBC_x.y` version it may ask for; `None`: no version needs at all.
    newest_glibc: Option<(u32, u32)>,
}

/// glibc 2.17 (CentOS 7, RHEL 7; manylinux2014's baseline) and its own libraries.
const GLIBC_2_17: Baseline = Baseline {
    name: "glibc 2.17",
    libraries: &[
        "libc.so.6",
        "libm.so.6",
        "libpthread.so.0",
        "libdl.so.2",
        "librt.so.1",
        "ld-linux-x86-64.so.2",
    ],
    newest_glibc: Some((2, 17)),
};

/// musl: one library, no symbol versions.
const MUSL: Baseline = Baseline {
    name: "musl",
    libraries: &["libc.so"],
    newest_glibc: None,
};

/// What an object needs and exports, as read from its dynamic section and tables.
#[derive(Debug, Default)]
struct Needs {
    /// `DT_NEEDED` entries.
    libraries: Vec<String>,
    /// Every version it asks for, as `file:version`.
    versions: Vec<(String, String)>,
    /// The names of the functions and objects it defines and exports.
    exports: BTreeSet<String>,
}

fn read_needs(path: &Path) -> Needs {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = ElfFile64::<Endianness>::parse(&*data).unwrap();
    let endian = file.endian();
    let sections = file
        .elf_header()
        .sections(endian, &*data)
        .expect("section table");
    let mut needs = Needs::default();
    if let Some((entries, link)) = sections.dynamic(endian, &*data).unwrap() {
        let strings = sections.strings(endian, &*data, link).unwrap();
        for entry in entries {
            if entry.d_tag(endian) == u64::from(elf::DT_NEEDED) {
                let name = entry.string(endian, strings).unwrap();
                needs
                    .libraries
                    .push(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    if let Some((mut verneed, link)) = sections.gnu_verneed(endian, &*data).unwrap() {
        let strings = sections.strings(endian, &*data, link).unwrap();
        while let Some((need, mut auxes)) = verneed.next().unwrap() {
            let library = String::from_utf8_lossy(need.file(endian, strings).unwrap());
            while let Some(aux) = auxes.next().unwrap() {
                let version = String::from_utf8_lossy(aux.name(endian, strings).unwrap());
                needs
                    .versions
                    .push((library.clone().into_owned(), version.into_owned()));
            }
        }
    }
    let symbols = sections
        .symbols(endian, &*data, elf::SHT_DYNSYM)
        .expect("dynamic symbols");
    for sym in symbols.iter() {
        let global = matches!(sym.st_bind(), elf::STB_GLOBAL | elf::STB_WEAK);
        if global && sym.st_shndx(endian) != elf::SHN_UNDEF {
            let name = symbols.symbol_name(endian, sym).unwrap();
            needs
                .exports
                .insert(String::from_utf8_lossy(name).into_owned());
        }
    }
    needs
}

/// `GLIBC_2.17` as (2, 17); `GLIBC_2.3.4` as (2, 3). `None` for other names.
fn glibc_version(name: &str) -> Option<(u32, u32)> {
    let mut parts = name.strip_prefix("GLIBC_")?.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Every way the object at `path` breaks `baseline`, one line each.
fn audit(path: &Path, baseline: &Baseline) -> Vec<String> {
    let needs = read_needs(path);
    let mut problems = Vec::new();
    for library in &needs.libraries {
        if !baseline.libraries.contains(&library.as_str()) {
            problems.push(format!(
                "needs {library}, which {} images may lack",
                baseline.name
            ));
        }
    }
    for (library, version) in &needs.versions {
        let allowed = match (baseline.newest_glibc, glibc_version(version)) {
            (Some(newest), Some(v)) => v <= newest,
            // GLIBC_PRIVATE, GCC_*, GLIBCXX_*, or any version under musl.
            _ => false,
        };
        if !allowed {
            problems.push(format!(
                "asks {library} for {version}, which {} does not have",
                baseline.name
            ));
        }
    }
    problems
}

/// The names `exports.map` makes global, and with glibc's nodes or without them.
fn exports_of_the_map(glibc: bool) -> BTreeSet<String> {
    let map = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/exports.map")).unwrap();
    let mut names = BTreeSet::new();
    let mut node_is_glibc = false;
    for line in map.lines() {
        if let Some(node) = line
            .split_whitespace()
            .next()
            .filter(|_| line.ends_with('{'))
        {
            node_is_glibc = node.starts_with("GLIBC_");
        }
        let listing = line.starts_with("    ") && !line.trim_start().starts_with("global:");
        if listing && (glibc || !node_is_glibc) {
            names.extend(
                line.split(';')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(String::from),
            );
        }
    }
    names
}

/// The directory `scripts/build-shaper.sh` writes to.
fn shipped(variant: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    let path = target.join("shaper").join(variant).join("libjustitia.so");
    assert!(
        path.is_file(),
        "{} is not built: run scripts/build-shaper.sh",
        path.display()
    );
    path
}

/// The ordinary build cargo made beside this test (linked against the build machine's
/// glibc).
fn host_build() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps.join("libjustitia.so"), deps.join("../libjustitia.so")]
        .into_iter()
        .find(|p| p.is_file())
        .expect("cargo builds libjustitia.so with the crate")
}

#[test]
#[ignore = "needs the portable builds: scripts/build-shaper.sh (zig), run by scripts/test.sh"]
fn the_glibc_build_loads_into_glibc_2_17_and_later() {
    let lib = shipped("glibc");
    assert_eq!(
        audit(&lib, &GLIBC_2_17),
        Vec::<String>::new(),
        "{}",
        lib.display()
    );
    let needs = read_needs(&lib);
    assert_eq!(needs.exports, exports_of_the_map(true), "{}", lib.display());
}

#[test]
#[ignore = "needs the portable builds: scripts/build-shaper.sh (zig), run by scripts/test.sh"]
fn the_musl_build_loads_into_musl() {
    let lib = shipped("musl");
    assert_eq!(
        audit(&lib, &MUSL),
        Vec::<String>::new(),
        "{}",
        lib.display()
    );
    let needs = read_needs(&lib);
    assert_eq!(
        needs.exports,
        exports_of_the_map(false),
        "{}",
        lib.display()
    );
}

/// Each build held to the other C library's rules is refused: the audit reads what it
/// says it reads.
#[test]
#[ignore = "needs the portable builds: scripts/build-shaper.sh (zig), run by scripts/test.sh"]
fn each_portable_build_is_refused_under_the_other_c_library() {
    let glibc = audit(&shipped("glibc"), &MUSL);
    assert!(
        glibc
            .iter()
            .any(|p| p == "needs libc.so.6, which musl images may lack"),
        "{glibc:?}"
    );
    assert!(
        glibc.iter().any(|p| p.contains("for GLIBC_2.17")),
        "{glibc:?}"
    );
    let musl = audit(&shipped("musl"), &GLIBC_2_17);
    assert_eq!(musl, ["needs libc.so, which glibc 2.17 images may lack"]);
}

/// The ordinary build is what an image older than the build machine refuses: the audit
/// names the versions it asks for above 2.17 (the build machine's glibc is 2.34 or newer:
/// `dlsym` has lived in libc since).
#[test]
fn the_ordinary_build_is_refused_for_glibc_2_17() {
    let problems = audit(&host_build(), &GLIBC_2_17);
    assert!(
        problems
            .iter()
            .any(|p| p == "asks libc.so.6 for GLIBC_2.34, which glibc 2.17 does not have"),
        "{problems:?}"
    );
}

/// The version names the audit compares.
#[test]
fn glibc_versions_compare_by_number() {
    assert_eq!(glibc_version("GLIBC_2.17"), Some((2, 17)));
    assert_eq!(glibc_version("GLIBC_2.3.4"), Some((2, 3)));
    assert_eq!(glibc_version("GLIBC_PRIVATE"), None);
    assert_eq!(glibc_version("GCC_3.0"), None);
    assert!(glibc_version("GLIBC_2.9") < glibc_version("GLIBC_2.17"));
}

/// `apps/libc_probe.c` built with `musl-gcc` into `dir`.
fn musl_program(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/apps/libc_probe.c");
    let program = dir.join("libc_probe");
    let built = Command::new("musl-gcc")
        .args(["-O2", "-Wall", "-Werror", "-pthread", "-o"])
        .arg(&program)
        .arg(&source)
        .status()
        .expect("musl-gcc (Debian's musl-tools; scripts/setup.sh installs it)");
    assert!(built.success(), "musl-gcc failed on {}", source.display());
    program
}

/// Runs `program` with `preload` (if any) as a container's process would get it, with a
/// class set so that the shaper is not in its observe-only mode.
fn run_preloaded(program: &Path, preload: Option<&Path>) -> std::process::Output {
    let mut command = Command::new(program);
    command.env_clear().env("JUSTITIA_CLASS", "bandwidth");
    if let Some(lib) = preload {
        command.env("LD_PRELOAD", lib);
    }
    command.output().unwrap()
}

#[test]
#[ignore = "needs the portable builds and musl-gcc: scripts/build-shaper.sh, run by scripts/test.sh"]
fn a_musl_program_runs_under_the_musl_build_and_not_under_the_glibc_build() {
    let dir = tempfile::tempdir().unwrap();
    let program = musl_program(dir.path());
    let plain = run_preloaded(&program, None);
    let musl = run_preloaded(&program, Some(&shipped("musl")));
    let glibc = run_preloaded(&program, Some(&shipped("glibc")));
    let said = |o: &std::process::Output| {
        format!(
            "exit {:?}, stdout {:?}, stderr {:?}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    assert!(
        plain.status.success(),
        "without the shaper: {}",
        said(&plain)
    );
    assert!(
        musl.status.success(),
        "under the musl build: {}",
        said(&musl)
    );
    let out = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        out(&plain),
        "libc_probe: thread, fork, libibverbs absent, shaper not mapped\n"
    );
    assert_eq!(
        out(&musl),
        "libc_probe: thread, fork, libibverbs absent, shaper mapped\n",
        "under the musl build: {}",
        said(&musl)
    );
    assert!(
        musl.stderr.is_empty(),
        "the musl build says nothing here: {}",
        said(&musl)
    );
    // The mechanism matters: the glibc build cannot be loaded by musl's dynamic linker.
    assert!(
        !glibc.status.success(),
        "under the glibc build: {}",
        said(&glibc)
    );
}
