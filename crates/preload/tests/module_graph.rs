//! The shaper's modules depend on each other one way: the graph of `crate::` references
//! between the files of `src/` (a directory module counts as one node) has no cycle.
//! `docs/architecture.md` draws the graph this test finds.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The module a source file belongs to: its stem, or its directory under `src/`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    Some(first.trim_end_matches(".rs").to_string())
}

/// Every module named as `crate::<name>` outside comments and outside the file's test
/// module (tests may reach anything).
fn references(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        // What follows `//` is a comment (no shaper source names a module inside a string).
        let code = code.split("//").next().unwrap_or_default();
        assert!(
            !code.contains("crate::{"),
            "name each module on its own `use crate::` line: {line}"
        );
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "tests") {
                    dirs.push(path);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(module) = module_of(&src, &file) else {
            continue;
        };
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        let deps = graph.entry(module.clone()).or_default();
        deps.extend(references(&text).into_iter().filter(|d| *d != module));
    }
    graph
}

/// A cycle through `node`, if the depth-first search from it finds one.
fn cycle_from(
    node: &str,
    graph: &BTreeMap<String, BTreeSet<String>>,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|n| n == node) {
        let mut cycle = path[at..].to_vec();
        cycle.push(node.to_string());
        return Some(cycle);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_string());
    for next in graph.get(node).into_iter().flatten() {
        if let Some(c) = cycle_from(next, graph, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(node.to_string());
    None
}

#[test]
fn the_module_graph_has_no_cycle() {
    let graph = graph();
    assert!(graph.len() > 10, "found the modules: {graph:?}");
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = cycle_from(node, &graph, &mut Vec::new(), &mut done) {
            panic!(
                "modules depend on each other in a circle: {}",
                cycle.join(" -> ")
            );
        }
    }
    for (module, deps) in &graph {
        eprintln!(
            "{module} -> {}",
            deps.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
}

#[test]
fn the_state_never_names_a_hook_and_the_boundary_names_only_the_log() {
    let graph = graph();
    let hooks = ["hooks", "cq_ex", "qp_ex", "channel", "install", "exports"];
    for state in ["engine", "follow", "send_queue", "registry", "stats"] {
        let deps = &graph[state];
        assert!(
            hooks.iter().all(|h| !deps.contains(*h)),
            "{state} names a hook module: {deps:?}"
        );
    }
    let ffi: Vec<&String> = graph["ffi"].iter().collect();
    assert_eq!(ffi, ["log"], "the FFI boundary is a leaf");
}

#[test]
fn a_cycle_is_found_when_there_is_one() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.entry("a".into()).or_default().insert("b".into());
    graph.entry("b".into()).or_default().insert("c".into());
    graph.entry("c".into()).or_default().insert("a".into());
    let cycle = cycle_from("a", &graph, &mut Vec::new(), &mut BTreeSet::new());
    assert_eq!(
        cycle,
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(
        references("use crate::engine::Qp; // crate::hooks\n// crate::qp_ex\nx(crate::log::y)"),
        ["engine", "log"].iter().map(|s| s.to_string()).collect()
    );
}
