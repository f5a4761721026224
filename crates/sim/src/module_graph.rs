//! The simulator's modules depend on each other one way: among the files of `src/` (a
//! folder counts as one module), the `crate::<module>` references outside comments and
//! test modules form a graph without a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The modules `text` names as `crate::<module>`, up to its test module.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let mut code = line.split("//").next().unwrap_or_default();
        while let Some(at) = code.find("crate::") {
            code = &code[at + "crate::".len()..];
            let end = code
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(code.len());
            if end > 0 {
                named.insert(code[..end].to_string());
            }
        }
    }
    named
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("listing {dir:?}: {e}"))
            .path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Module -> the other modules it names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap_or(&file);
        let first = rel
            .components()
            .next()
            .map(|c| c.as_os_str().to_string_lossy());
        let module = first
            .unwrap_or_default()
            .trim_end_matches(".rs")
            .to_string();
        if module == "lib" || module == "module_graph" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        let mut named = named_modules(&text);
        named.remove(&module);
        graph.entry(module).or_default().extend(named);
    }
    graph
}

/// A cycle of `graph` as a path from a module back to itself, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
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
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn finds_a_cycle_when_there_is_one() {
    let edges = |list: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in list {
            g.entry(a.to_string()).or_default().insert(b.to_string());
        }
        g
    };
    let cyclic = edges(&[("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]);
    assert_eq!(
        find_cycle(&cyclic),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(
        find_cycle(&edges(&[("a", "b"), ("a", "c"), ("b", "c")])),
        None
    );
    // Comments and test modules do not count.
    let named =
        named_modules("use crate::link::Packet; // crate::world\n#[cfg(test)]\nuse crate::app;");
    assert_eq!(
        named.into_iter().collect::<Vec<_>>(),
        vec!["link".to_string()]
    );
}

#[test]
fn the_simulator_modules_have_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = graph(&src);
    // The graph is read, not empty: the run depends on the models.
    assert!(graph
        .get("world")
        .is_some_and(|d| d.contains("policy") && d.contains("app")));
    assert_eq!(find_cycle(&graph), None, "module graph: {graph:#?}");
}
