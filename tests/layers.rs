//! The module layering, checked from the source: every `crate::<module>`
//! path in library code must point to a lower layer, so the import graph
//! has no cycles, transports never import each other, `region`, `wire` and
//! `gpu` import no transport, and test helpers are not in the library.
//!
//! Files are checked too: no two files of the library or of the CLI import
//! each other, directly or round a longer circle.
//!
//! Unit-test modules (`#[cfg(test)] mod …` at the end of a file) are left
//! out: a test may reach anywhere.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Layers, lowest first. A module may import only modules of a strictly
/// lower layer (modules of one layer never import each other).
const LAYERS: &[&[&str]] = &[
    // Pure formats: the wire's, and the compressed frames' codec.
    &["wire", "codec"],
    &["error"],
    // The shards' counters and their snapshot (metrics), beside the model
    // checker's atomics.
    &["sync", "metrics"],
    &["sys", "auth"],
    // Diagnostics the transports and the shard stamp (feature `stage-trace`).
    &["stage_trace"],
    &["gpu"],
    &["region"],
    &["xfer"],
    // The transports and the control path: none imports another.
    &["tcp", "shm", "verbs", "oob"],
    &["reactor"],
    &["endpoint"],
    // Off the data path: names in etcd (feature `directory`); the rogue
    // test peers the faces' tests fail connections against.
    &["directory", "rogue"],
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
            // A re-export at the crate root (`crate::Shard`) is an arrow up
            // to the root, whatever module it comes from: name the module.
            let to = if to.starts_with(char::is_uppercase) {
                "the crate root".to_string()
            } else {
                to
            };
            if to == module {
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
        if to == "the crate root" {
            bad.push(format!(
                "{from} -> a crate-root re-export in {files:?}: import it from its module"
            ));
            continue;
        }
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

/// The paths a piece of code names under `crate::`, `super::` or `self::`,
/// with `{..}` groups expanded: (prefix, segments), e.g. ("super",
/// ["bell", "RemoteBell"]).
fn rooted_paths(code: &str) -> Vec<(&'static str, Vec<String>)> {
    fn ident(s: &[u8], i: &mut usize) -> Option<String> {
        let start = *i;
        while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_') {
            *i += 1;
        }
        (*i > start).then(|| String::from_utf8_lossy(&s[start..*i]).into_owned())
    }
    fn skip_ws(s: &[u8], i: &mut usize) {
        while *i < s.len() && s[*i].is_ascii_whitespace() {
            *i += 1;
        }
    }
    /// A path tree after `prefix::`: idents joined by `::`, a group `{..}`
    /// at the end; every leaf path goes to `out`.
    fn tree(s: &[u8], i: &mut usize, base: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut path = base;
        loop {
            skip_ws(s, i);
            if *i < s.len() && s[*i] == b'{' {
                *i += 1;
                loop {
                    skip_ws(s, i);
                    if *i >= s.len() || s[*i] == b'}' {
                        *i += 1;
                        return;
                    }
                    tree(s, i, path.clone(), out);
                    skip_ws(s, i);
                    if *i < s.len() && s[*i] == b',' {
                        *i += 1;
                    }
                }
            }
            match ident(s, i) {
                Some(id) => path.push(id),
                None => {
                    out.push(path);
                    return;
                }
            }
            if s[*i..].starts_with(b"::") {
                *i += 2;
            } else {
                out.push(path);
                return;
            }
        }
    }
    let s = code.as_bytes();
    let mut out = Vec::new();
    for prefix in ["crate", "super", "self"] {
        let pat = format!("{prefix}::");
        let mut from = 0;
        while let Some(k) = code[from..].find(&pat) {
            let at = from + k;
            from = at + pat.len();
            // `crate::` inside a longer name (`ferry_crate::`) is not one.
            if at > 0 && (s[at - 1].is_ascii_alphanumeric() || s[at - 1] == b'_') {
                continue;
            }
            let mut leaves = Vec::new();
            let mut i = from;
            tree(s, &mut i, Vec::new(), &mut leaves);
            out.extend(leaves.into_iter().map(|l| (prefix, l)));
        }
    }
    out
}

/// The file a rooted path leads to: the deepest module file of its
/// segments (`crate::shm::ring::Header` -> src/shm/ring.rs), or the module
/// the path starts from when its first segment is an item.
fn resolve(root: &Path, file: &Path, prefix: &str, segs: &[String]) -> Option<PathBuf> {
    // The directory whose modules `prefix::x` names.
    let dir_of = |f: &Path| -> PathBuf {
        let parent = f.parent().unwrap().to_path_buf();
        let stem = f.file_stem().unwrap();
        if stem == "mod" || stem == "lib" || stem == "main" {
            parent
        } else {
            parent.join(stem)
        }
    };
    let (mut dir, mut found) = match prefix {
        "crate" => (root.to_path_buf(), None),
        "self" => (dir_of(file), Some(file.to_path_buf())),
        _ => {
            // super: the module above this file's module.
            let own = dir_of(file);
            let up = own.parent()?.to_path_buf();
            let up_file = if up == root {
                None
            } else {
                let named = up.with_extension("rs");
                Some(if named.exists() {
                    named
                } else {
                    up.join("mod.rs")
                })
            };
            (up, up_file)
        }
    };
    for s in segs {
        let as_file = dir.join(format!("{s}.rs"));
        let as_dir = dir.join(s).join("mod.rs");
        if as_file.exists() {
            found = Some(as_file);
        } else if as_dir.exists() {
            found = Some(as_dir);
        } else {
            break;
        }
        dir = dir.join(s);
    }
    found
}

/// file -> the files of the same crate it imports (library code only).
fn file_graph(root: &Path) -> BTreeMap<PathBuf, std::collections::BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let mut g: BTreeMap<PathBuf, std::collections::BTreeSet<PathBuf>> = BTreeMap::new();
    for f in files {
        let code = code_of(&std::fs::read_to_string(&f).unwrap());
        let mut to = std::collections::BTreeSet::new();
        for (prefix, segs) in rooted_paths(&code) {
            if let Some(t) = resolve(root, &f, prefix, &segs) {
                if t != f {
                    to.insert(t);
                }
            }
        }
        g.insert(f, to);
    }
    g
}

/// The import circles of a graph (each as its files in order), by DFS.
fn circles(g: &BTreeMap<PathBuf, std::collections::BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    fn visit(
        n: &PathBuf,
        g: &BTreeMap<PathBuf, std::collections::BTreeSet<PathBuf>>,
        state: &mut BTreeMap<PathBuf, u8>,
        stack: &mut Vec<PathBuf>,
        out: &mut Vec<Vec<PathBuf>>,
    ) {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                0 => visit(m, g, state, stack, out),
                1 => {
                    let at = stack.iter().position(|x| x == m).unwrap();
                    out.push(stack[at..].to_vec());
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
    }
    let mut state = BTreeMap::new();
    let mut out = Vec::new();
    for n in g.keys() {
        if state.get(n).copied().unwrap_or(0) == 0 {
            visit(n, g, &mut state, &mut Vec::new(), &mut out);
        }
    }
    out
}

#[test]
fn no_two_files_import_each_other() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    for root in [here.join("src"), here.join("cli/src")] {
        let g = file_graph(&root);
        assert!(g.len() > 5, "read only {} files under {root:?}", g.len());
        let found = circles(&g);
        assert!(
            found.is_empty(),
            "files that import each other (in a circle) under {root:?}:\n{found:#?}"
        );
    }
}

#[test]
fn the_file_checker_sees_imports_and_circles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = file_graph(&src);
    let edge = |a: &str, b: &str| g[&src.join(a)].contains(&src.join(b));
    assert!(edge("shm/bell.rs", "shm/object.rs"), "super::object");
    assert!(
        edge("reactor/shard/mod.rs", "reactor/spin.rs"),
        "super::spin::{{..}}"
    );
    assert!(
        edge("reactor/shard/mod.rs", "region.rs"),
        "crate::region::{{..}}"
    );
    assert!(
        edge("reactor/shard/glue.rs", "reactor/shard/mod.rs"),
        "use super::*"
    );
    assert!(edge("shm/named_ring.rs", "shm/ring.rs"));
    assert!(!edge("shm/ring.rs", "shm/bell.rs"));
    assert_eq!(
        rooted_paths("use super::{a::{B, c::D}, e};\nlet x = crate::f::g(1);"),
        vec![
            ("crate", vec!["f".to_string(), "g".to_string()]),
            ("super", vec!["a".into(), "B".into()]),
            ("super", vec!["a".into(), "c".into(), "D".into()]),
            ("super", vec!["e".into()]),
        ]
    );
    // A circle is found, a chain is not.
    let p = |s: &str| PathBuf::from(s);
    let mut g2 = BTreeMap::new();
    g2.insert(p("a"), [p("b")].into_iter().collect());
    g2.insert(p("b"), [p("c")].into_iter().collect());
    g2.insert(p("c"), Default::default());
    assert!(circles(&g2).is_empty());
    g2.get_mut(&p("c")).unwrap().insert(p("a"));
    assert_eq!(circles(&g2), vec![vec![p("a"), p("b"), p("c")]]);
}

/// A file says what it takes from its parent: no glob import of the
/// parent module at a file's top level (a test module's `use super::*`
/// is the one kept: tests see everything of what they test).
#[test]
fn no_file_takes_all_of_its_parent() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 50, "found only {} files", files.len());
    let globbing: Vec<_> = files
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n != "tests.rs"))
        .filter(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .lines()
                .any(|l| l == "use super::*;")
        })
        .collect();
    assert!(globbing.is_empty(), "`use super::*` in {globbing:?}");
}

/// errno is read in one place: `sys::cvt` (which `syscall!` calls), and
/// `sys/`'s own calls with other conventions (mmap's MAP_FAILED, an ioctl
/// whose ENOENT is an answer).
#[test]
fn errno_is_read_in_one_place() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let reading: Vec<_> = files
        .iter()
        .filter(|f| !f.starts_with(src.join("sys")) && !f.ends_with("tests.rs"))
        .filter(|f| code_of(&std::fs::read_to_string(f).unwrap()).contains("last_os_error"))
        .collect();
    assert!(reading.is_empty(), "errno read outside sys/: {reading:?}");
}

/// Failures are typed where the engine finds them: no function of the
/// transports, the shard or the endpoint fails with a bare string (the
/// faces map a cause to a code; a string cannot be matched).
#[test]
fn no_failure_is_a_string() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for dir in ["tcp", "shm", "reactor", "verbs", "endpoint"] {
        rust_files(&src.join(dir), &mut files);
    }
    assert!(files.len() > 40, "found only {} files", files.len());
    let mut found = Vec::new();
    for f in files.iter().filter(|f| !f.ends_with("tests.rs")) {
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        for line in code.lines() {
            let l = line.replace(' ', "");
            if let Some(at) = l.find("Result<") {
                let rest = &l[at..];
                // The error type: what follows the first top-level comma.
                let mut depth = 0;
                for (i, c) in rest.char_indices() {
                    match c {
                        '<' => depth += 1,
                        '>' => depth -= 1,
                        ',' if depth == 1 => {
                            if rest[i + 1..].starts_with("String>") {
                                found.push(format!("{}: {}", f.display(), line.trim()));
                            }
                            break;
                        }
                        _ => {}
                    }
                    if depth == 0 && c == '>' {
                        break;
                    }
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "failures as strings:\n{}",
        found.join("\n")
    );
}

/// A file a newcomer reads whole: none in src/ is over 700 lines (tests
/// live in files of their own).
#[test]
fn no_file_is_over_700_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let long: Vec<_> = files
        .iter()
        .map(|f| (f, std::fs::read_to_string(f).unwrap().lines().count()))
        .filter(|&(_, n)| n > 700)
        .collect();
    assert!(long.is_empty(), "files over 700 lines: {long:?}");
}
