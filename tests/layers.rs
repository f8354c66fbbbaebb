//! The module layering, checked from the source: every `crate::<module>`
//! path in library code must point to a lower layer, so the import graph
//! has no cycles, transports never import each other, `region`, `wire` and
//! `gpu` import no transport, and test helpers are not in the library.
//!
//! Unit-test modules (`#[cfg(test)] mod …` at the end of a file) are left
//! out: a test may reach anywhere.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Layers, lowest first. A module may import only modules of a strictly
/// lower layer (modules of one layer never import each other).
const LAYERS: &[&[&str]] = &[
    &["wire"],
    &["error"],
    &["sys", "auth"],
    &["gpu"],
    &["region"],
    &["xfer"],
    // The transports and the control path: none imports another.
    &["tcp", "shm", "verbs", "oob"],
    &["reactor"],
    &["endpoint"],
    // Off the data path: names in etcd (feature `directory`).
    &["directory"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().unwrap() != "bin" {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The library code of a file: up to its unit-test module, comments removed.
fn code_of(text: &str) -> String {
    let end = text.find("#[cfg(test)]\nmod ").unwrap_or(text.len());
    text[..end]
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules a piece of code names as `crate::<module>`.
fn crate_refs(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
        rest = after;
    }
    out
}

/// (importing module, imported module) -> the files where it happens.
fn import_graph() -> BTreeMap<(String, String), Vec<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut edges: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = top.trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&f).unwrap());
        for to in crate_refs(&code) {
            // Re-exports at the crate root (`crate::Result`) are not modules.
            if to == module || to.starts_with(char::is_uppercase) {
                continue;
            }
            edges
                .entry((module.clone(), to))
                .or_default()
                .push(rel.display().to_string());
        }
    }
    edges
}

#[test]
fn every_import_points_down_a_layer() {
    let mut bad = Vec::new();
    for ((from, to), files) in import_graph() {
        let (Some(a), Some(b)) = (layer_of(&from), layer_of(&to)) else {
            bad.push(format!("{from} -> {to}: module not in LAYERS ({files:?})"));
            continue;
        };
        if b >= a {
            bad.push(format!(
                "{from} (layer {a}) -> {to} (layer {b}) in {files:?}"
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "imports against the layering:\n{}",
        bad.join("\n")
    );
}

#[test]
fn transports_do_not_know_each_other() {
    let g = import_graph();
    let transports = ["tcp", "shm", "verbs"];
    for from in ["tcp", "shm", "verbs", "region", "wire", "gpu", "xfer"] {
        for to in transports {
            if from != to {
                assert!(
                    !g.contains_key(&(from.to_string(), to.to_string())),
                    "{from} imports {to}: {:?}",
                    g[&(from.to_string(), to.to_string())]
                );
            }
        }
    }
}

#[test]
fn test_helpers_are_not_in_the_library() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    assert!(!src.join("testkit.rs").exists());
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    assert!(!lib.contains("mod testkit"), "lib.rs declares a testkit");
    for ((from, to), files) in import_graph() {
        assert!(to != "testkit", "{from} imports testkit in {files:?}");
    }
}

#[test]
fn the_checker_sees_imports() {
    // Guards against a checker that passes because it reads nothing.
    let g = import_graph();
    assert!(g.contains_key(&("tcp".into(), "xfer".into())));
    assert!(g.contains_key(&("endpoint".into(), "reactor".into())));
    assert_eq!(
        crate_refs("use crate::a::b; x = crate::c(1);"),
        vec!["a".to_string(), "c".to_string()]
    );
    assert_eq!(code_of("a // crate::x\nb"), "a \nb");
}
