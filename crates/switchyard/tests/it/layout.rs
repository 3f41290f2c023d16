//! The workspace's shape, as the README states it: the crate graph it draws
//! is the manifests', and no module of any crate imports another in a
//! circle (a circle means one of them owns a piece of the other).
//!
//! Both read the source tree, so they run from any checkout.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every crate directory under `crates/`.
fn crates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .expect("crates/")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// The `switchyard-*` crates a manifest's `[dependencies]` names.
fn manifest_dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).expect("a manifest");
    let mut in_dependencies = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
        } else if in_dependencies && line.starts_with("switchyard") {
            let name = line.split(['.', ' ', '=']).next().unwrap_or_default();
            out.insert(name.to_owned());
        }
    }
    out
}

/// The README's crate graph: the lines of the block between
/// `<!-- crate-graph -->` and `<!-- /crate-graph -->` that read
/// `- \`crate\` → \`dep\`, \`dep\`` (or `→ (none)`).
fn readme_graph() -> BTreeMap<String, BTreeSet<String>> {
    let text = std::fs::read_to_string(workspace().join("README.md")).expect("README.md");
    let start = text
        .find("<!-- crate-graph -->")
        .expect("the README marks its crate graph");
    let end = text.find("<!-- /crate-graph -->").expect("and its end");
    let mut graph = BTreeMap::new();
    for line in text[start..end].lines() {
        let Some((krate, deps)) = line.split_once('→') else {
            continue;
        };
        let deps = deps
            .split(',')
            .map(|d| d.trim().trim_matches('`').to_owned())
            .filter(|d| d.starts_with("switchyard"))
            .collect();
        let krate = krate
            .trim()
            .trim_start_matches('-')
            .trim()
            .trim_matches('`');
        graph.insert(krate.to_owned(), deps);
    }
    graph
}

#[test]
fn the_readme_crate_graph_is_the_manifests() {
    let manifests: BTreeMap<String, BTreeSet<String>> = crates()
        .iter()
        .map(|dir| {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            (name, manifest_dependencies(&dir.join("Cargo.toml")))
        })
        .collect();
    assert_eq!(readme_graph(), manifests);
}

/// A crate's modules by path (`a::b`), from its `src/` files.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("a source directory") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    files
        .into_iter()
        .filter_map(|file| {
            let rel = file.strip_prefix(src).ok()?.with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("lib" | "main" | "mod")
            ) {
                parts.pop();
            }
            // Test-only modules in files of their own.
            if parts
                .last()
                .is_some_and(|p| p == "tests" || p.ends_with("_tests"))
            {
                return None;
            }
            Some((parts.join("::"), file))
        })
        .collect()
}

/// The code of a file with comments and inline test modules cut off.
fn code(file: &Path) -> String {
    let text = std::fs::read_to_string(file).expect("a source file");
    let text = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    text.lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Edges between the modules directly under `parent` (`""`: the crate's
/// top level): `a → b` when code in `a` (or below it) names `crate::…b…`
/// or reaches `b` (or below it) through `super::`.
fn edges_under(
    modules: &BTreeMap<String, PathBuf>,
    parent: &str,
) -> BTreeMap<String, BTreeSet<String>> {
    let depth = if parent.is_empty() {
        0
    } else {
        parent.split("::").count()
    };
    // The child of `parent` that `m` is or lies under.
    let child = |m: &str| -> Option<String> {
        let parts: Vec<&str> = m.split("::").filter(|s| !s.is_empty()).collect();
        let under = parent.is_empty() || m.starts_with(&format!("{parent}::"));
        (under && parts.len() > depth).then(|| parts[depth].to_owned())
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in modules {
        let Some(from) = child(module) else { continue };
        let text = code(file);
        for (kind, rest) in [("crate::", 0usize), ("super::", 1)]
            .iter()
            .flat_map(|&(p, k)| text.match_indices(p).map(move |(i, _)| (k, i + p.len())))
        {
            // The path after `crate::`/`super::`: identifiers and `::`.
            let tail: String = text[rest..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let mut path: Vec<String> = if kind == 0 {
                Vec::new()
            } else {
                let mut base: Vec<String> = module.split("::").map(str::to_owned).collect();
                if module.is_empty() {
                    base.clear();
                }
                base.pop();
                base
            };
            path.extend(
                tail.split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            );
            // The longest prefix that is a module.
            let target = (1..=path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|p| modules.contains_key(p));
            let Some(to) = target.as_deref().and_then(child) else {
                continue;
            };
            if from != to {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    edges
}

/// Every module that has modules under it (`""`: the crate root).
fn parents(modules: &BTreeMap<String, PathBuf>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for module in modules.keys().filter(|m| !m.is_empty()) {
        let parts: Vec<&str> = module.split("::").collect();
        for n in 0..parts.len() {
            out.insert(parts[..n].join("::"));
        }
    }
    out
}

/// A cycle in `edges`, if there is one.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|n| n == node) {
            let mut circle = stack[i..].to_vec();
            circle.push(node.to_owned());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|n| visit(n, edges, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_of_any_crate_imports_another_in_a_circle() {
    let (mut checked, mut nested) = (0, 0);
    for dir in crates() {
        let modules = modules(&dir.join("src"));
        // The top level, and the modules side by side in every folder
        // module (`request::answer` and `request::codec`, say).
        for parent in parents(&modules) {
            let edges = edges_under(&modules, &parent);
            checked += edges.len();
            nested += usize::from(!parent.is_empty() && !edges.is_empty());
            assert_eq!(
                cycle(&edges),
                None,
                "{}: modules under `{parent}` import each other in a circle",
                dir.display()
            );
        }
    }
    assert!(checked > 10, "the scan found the crates' modules");
    assert!(nested > 5, "and modules inside folder modules");
}

#[test]
fn the_cycle_check_finds_a_circle() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(
        cycle(&edges),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}

#[test]
fn a_circle_between_modules_of_one_folder_is_found() {
    let src = std::env::temp_dir().join(format!("switchyard-layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(src.join("request")).unwrap();
    let write = |file: &str, text: &str| std::fs::write(src.join(file), text).unwrap();
    write("lib.rs", "mod request;\nmod state;\n");
    write("state.rs", "pub struct AppState;\n");
    write(
        "request/mod.rs",
        "mod answer;\nmod codec;\nuse crate::state::AppState;\n",
    );
    write("request/answer.rs", "use crate::request::codec::Codec;\n");
    write(
        "request/codec.rs",
        "// crate::request::answer in a comment\nuse super::answer::Answer;\n",
    );
    let modules = modules(&src);
    assert_eq!(cycle(&edges_under(&modules, "")), None);
    assert_eq!(
        cycle(&edges_under(&modules, "request")),
        Some(vec!["answer".into(), "codec".into(), "answer".into()])
    );
    assert_eq!(
        parents(&modules),
        ["".to_owned(), "request".to_owned()].into_iter().collect()
    );
    let _ = std::fs::remove_dir_all(&src);
}
