//! The built `libjustitia.so` exports every verb of `exports.map` at the version the map
//! lists it under, as libibverbs does: `name@@IBVERBS_1.1`, the default that programs
//! linked against rdma-core bind to, and `name@IBVERBS_1.0`, the compatibility version
//! that programs linked against the old libibverbs bind to. A verb missing at a version
//! would let those programs bypass the shaper without a word.
//!
//! The library is the crate's cdylib, which cargo emits with the rlib it links this test
//! against, into this test executable's directory (`target/<profile>/deps`). Its versions
//! are read from its ELF dynamic symbol table here, so the test needs no tool and no crate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// The version libibverbs makes the default for its current verbs.
const DEFAULT_VERSION: &str = "IBVERBS_1.1";
/// The version glibc makes the default for `dlsym` and `dlvsym` (since libdl moved into
/// libc).
const DEFAULT_GLIBC_VERSION: &str = "GLIBC_2.34";

/// The cdylib beside this test executable (or one directory up, where cargo copies it for
/// `cargo build`).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let candidates = [
        deps.join("libjustitia.so"),
        deps.parent().unwrap().join("libjustitia.so"),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "libjustitia.so is not beside {}: cargo should have built it with the library",
                exe.display()
            )
        })
}

/// The version nodes of a linker version script, each with the names it exports.
fn version_script(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut clean = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        clean.push_str(&rest[..start]);
        let end = rest[start..].find("*/").expect("an unclosed comment");
        rest = &rest[start + end + 2..];
    }
    clean.push_str(rest);
    let mut tokens = Vec::new();
    let mut word = String::new();
    for c in clean.chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '*') {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            tokens.push(std::mem::take(&mut word));
        }
        if matches!(c, '{' | '}' | ':' | ';') {
            tokens.push(c.to_string());
        }
    }
    let token = |i: usize| tokens.get(i).map_or("", String::as_str);
    let mut nodes = BTreeMap::new();
    let mut i = 0;
    while i < tokens.len() {
        let node = token(i).to_string();
        assert_eq!(token(i + 1), "{", "version node {node}");
        i += 2;
        let mut global = true;
        let mut names = Vec::new();
        while token(i) != "}" {
            assert!(i < tokens.len(), "version node {node} is not closed");
            if token(i + 1) == ":" {
                global = token(i) == "global";
                i += 2;
                continue;
            }
            if global && token(i) != ";" {
                names.push(token(i).to_string());
            }
            i += 1;
        }
        // `}`, the node it inherits from if any, `;`.
        while token(i) != ";" {
            assert!(i < tokens.len(), "version node {node} is not ended");
            i += 1;
        }
        i += 1;
        nodes.insert(node, names);
    }
    nodes
}

const SHT_DYNSYM: u32 = 11;
const SHT_GNU_VERDEF: u32 = 0x6fff_fffd;
const SHT_GNU_VERSYM: u32 = 0x6fff_ffff;
const STT_FUNC: u8 = 2;
const VER_FLG_BASE: u16 = 1;
const VERSYM_HIDDEN: u16 = 0x8000;

fn u16_at(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(d[at..at + 2].try_into().unwrap())
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap())
}

fn u64_at(d: &[u8], at: usize) -> usize {
    usize::try_from(u64::from_le_bytes(d[at..at + 8].try_into().unwrap())).unwrap()
}

fn c_string(d: &[u8], at: usize) -> String {
    let len = d[at..].iter().position(|&b| b == 0).unwrap();
    String::from_utf8_lossy(&d[at..at + len]).into_owned()
}

/// One ELF64 section header.
struct Section {
    kind: u32,
    offset: usize,
    size: usize,
    link: usize,
    info: u32,
    entsize: usize,
}

/// Every function an ELF64 little-endian shared object defines with a symbol version, as
/// readelf prints it: `name@@VERSION` for the default, `name@VERSION` for a hidden one.
fn versioned_functions(d: &[u8]) -> BTreeSet<String> {
    assert_eq!(&d[..4], b"\x7fELF");
    assert_eq!((d[4], d[5]), (2, 1), "ELF64, little-endian");
    let shoff = u64_at(d, 0x28);
    let shentsize = usize::from(u16_at(d, 0x3a));
    let shnum = usize::from(u16_at(d, 0x3c));
    let sections: Vec<Section> = (0..shnum)
        .map(|i| {
            let h = shoff + i * shentsize;
            Section {
                kind: u32_at(d, h + 4),
                offset: u64_at(d, h + 24),
                size: u64_at(d, h + 32),
                link: usize::try_from(u32_at(d, h + 40)).unwrap(),
                info: u32_at(d, h + 44),
                entsize: u64_at(d, h + 56),
            }
        })
        .collect();
    let find = |kind: u32| sections.iter().find(|s| s.kind == kind).unwrap();
    let (dynsym, versym, verdef) = (find(SHT_DYNSYM), find(SHT_GNU_VERSYM), find(SHT_GNU_VERDEF));
    let mut versions = BTreeMap::new();
    let mut at = verdef.offset;
    for _ in 0..verdef.info {
        let (flags, index) = (u16_at(d, at + 2), u16_at(d, at + 4));
        let aux = usize::try_from(u32_at(d, at + 12)).unwrap();
        let name = u32_at(d, at + aux);
        // The base definition names the file itself, not a version.
        if flags & VER_FLG_BASE == 0 {
            let strings = sections[verdef.link].offset;
            versions.insert(index, c_string(d, strings + name as usize));
        }
        match u32_at(d, at + 16) {
            0 => break,
            next => at += next as usize,
        }
    }
    let strings = sections[dynsym.link].offset;
    let mut out = BTreeSet::new();
    for i in 1..dynsym.size / dynsym.entsize {
        let sym = dynsym.offset + i * dynsym.entsize;
        let defined = u16_at(d, sym + 6) != 0;
        if !defined || d[sym + 4] & 0xf != STT_FUNC {
            continue;
        }
        let version = u16_at(d, versym.offset + 2 * i);
        if let Some(v) = versions.get(&(version & !VERSYM_HIDDEN)) {
            let at = if version & VERSYM_HIDDEN != 0 {
                "@"
            } else {
                "@@"
            };
            let name = c_string(d, strings + u32_at(d, sym) as usize);
            out.insert(format!("{name}{at}{v}"));
        }
    }
    out
}

#[test]
fn every_interposed_verb_is_exported_at_the_versions_of_the_map() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/exports.map");
    let nodes = version_script(&std::fs::read_to_string(script).unwrap());
    assert_eq!(
        nodes.keys().map(String::as_str).collect::<Vec<_>>(),
        [
            "GLIBC_2.2.5",
            "GLIBC_2.34",
            "IBVERBS_1.0",
            "IBVERBS_1.1",
            "IBVERBS_1.12",
            "IBVERBS_1.8",
            "JUSTITIA_LOCAL"
        ]
    );
    // Every memory registration of libibverbs goes through ibv_reg_mr_iova2, at its one
    // version.
    assert_eq!(nodes["IBVERBS_1.8"], ["ibv_reg_mr_iova2"]);
    // A dma-buf's registration has its own entry, at its one version.
    assert_eq!(nodes["IBVERBS_1.12"], ["ibv_reg_dmabuf_mr"]);
    // dlsym and dlvsym (src/dl.rs) at glibc's x86-64 base version and at its default.
    for node in ["GLIBC_2.2.5", "GLIBC_2.34"] {
        assert_eq!(nodes[node], ["dlsym", "dlvsym"]);
    }
    // A verb at the compatibility version and not at the default would be missed by
    // every program built against rdma-core.
    for name in &nodes["IBVERBS_1.0"] {
        assert!(nodes[DEFAULT_VERSION].contains(name), "{name}");
    }
    let expected: BTreeSet<String> = nodes
        .iter()
        .flat_map(|(version, names)| {
            let at = if version == DEFAULT_VERSION
                || version == DEFAULT_GLIBC_VERSION
                || version == "IBVERBS_1.8"
                || version == "IBVERBS_1.12"
            {
                "@@"
            } else {
                "@"
            };
            names.iter().map(move |n| format!("{n}{at}{version}"))
        })
        .collect();
    assert_eq!(
        expected.len(),
        22,
        "7 verbs at both versions, 2 at 1.1 only, 1 at 1.8, 1 at 1.12, dlsym and dlvsym at two versions"
    );
    let lib = library();
    let exported = versioned_functions(&std::fs::read(&lib).unwrap());
    // Exactly these: a verb at a version the map leaves out (ibv_get_cq_event@IBVERBS_1.0
    // takes old-layout CQs) must stay libibverbs' own.
    assert_eq!(exported, expected, "in {}", lib.display());
}
