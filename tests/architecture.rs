//! ARCHITECTURE.md stays true for every path it names: each backticked
//! file or folder (`tcp/proto/`, `reactor/source.rs`, `handshake.rs`)
//! exists in the repository (from its root, from a crate's `src/`, or, for
//! a bare file name, anywhere under the crates' sources).

use std::path::{Path, PathBuf};

const ROOTS: &[&str] = &[
    "",
    "src/",
    "cli/src/",
    "capi/src/",
    "python/",
    "nixl/",
    "cli/",
    "tests/",
];
const TREES: &[&str] = &["src", "cli", "capi", "python", "nixl", "tools", "benches"];

fn named_paths(doc: &str) -> Vec<String> {
    doc.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| !t.contains(char::is_whitespace))
        .map(|t| t.split(':').next().unwrap_or("").trim_end_matches(','))
        .filter(|t| t.ends_with(".rs") || (t.contains('/') && t.ends_with('/')))
        .map(str::to_owned)
        .collect()
}

fn found_anywhere(dir: &Path, name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p = e.path();
        if p.is_dir() {
            p.file_name().is_some_and(|n| n != "target") && found_anywhere(&p, name)
        } else {
            p.file_name().is_some_and(|n| n == name)
        }
    })
}

#[test]
fn every_path_architecture_names_exists() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let named = named_paths(&doc);
    assert!(
        named.len() > 20,
        "found only {} paths: {named:?}",
        named.len()
    );
    let missing: Vec<&String> = named
        .iter()
        .filter(|p| {
            let here = ROOTS.iter().any(|r| root.join(format!("{r}{p}")).exists());
            let bare = !p.contains('/')
                && TREES
                    .iter()
                    .any(|t| found_anywhere(&root.join(t), p.as_str()));
            !here && !bare
        })
        .collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
}
