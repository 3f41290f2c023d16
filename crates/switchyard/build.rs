//! Build-time input of the `switchyard` binary (the bundled trace is the
//! commands' library's, `crates/switchyard-commands/build.rs`):
//! `SWITCHYARD_COMMIT`, the commit `--version` names: `$SWITCHYARD_BUILD_COMMIT`
//! when set (a build without `.git`, such as the Docker image's, passes it
//! in), else `git rev-parse --short HEAD` with `-dirty` when tracked files
//! differ from it, else `unknown` (a source tarball, or no `git`).
//!
//! The commit is read again when `HEAD`, the branch it names, the reflog or
//! the index change (a commit, a checkout, `git add`), and when what the
//! binary is built from changes (the crates' sources and manifests, the
//! lockfile): so `-dirty` is exact for any change that reaches the binary,
//! while an edit to docs or tests alone shows at the next build after a git
//! command.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    println!("cargo:rustc-env=SWITCHYARD_COMMIT={}", commit(&manifest));
}

/// The commit this build is made from (see the module comment).
fn commit(manifest: &Path) -> String {
    println!("cargo:rerun-if-env-changed=SWITCHYARD_BUILD_COMMIT");
    if let Some(given) = std::env::var("SWITCHYARD_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
    {
        return given.trim().to_owned();
    }
    let git = |args: &[&str]| -> Option<String> {
        let output = Command::new("git")
            .args(args)
            .current_dir(manifest)
            .output()
            .ok()?;
        let text = String::from_utf8(output.stdout).ok()?;
        output.status.success().then(|| text.trim().to_owned())
    };
    let Some(hash) = git(&["rev-parse", "--short", "HEAD"]) else {
        return "unknown".to_owned();
    };
    watch_git(manifest, &git);
    watch_sources(&manifest.join("../.."));
    // Tracked files only: a stray untracked file does not make a build dirty.
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .is_none_or(|changes| !changes.is_empty());
    if dirty {
        format!("{hash}-dirty")
    } else {
        hash
    }
}

/// Asks cargo to run this script again when the workspace's manifests,
/// lockfile or any crate's sources, manifest or build script change.
fn watch_sources(workspace: &Path) {
    let mut watched = vec![workspace.join("Cargo.toml"), workspace.join("Cargo.lock")];
    if let Ok(crates) = std::fs::read_dir(workspace.join("crates")) {
        for dir in crates.flatten().map(|entry| entry.path()) {
            watched.extend(["src", "Cargo.toml", "build.rs"].map(|part| dir.join(part)));
        }
    }
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// Asks cargo to run this script again when the checkout's commit or index
/// changes. In a worktree `.git` is a file: `HEAD`, the reflog and the index
/// are in the worktree's own git directory, branches in the common one.
fn watch_git(manifest: &Path, git: &dyn Fn(&[&str]) -> Option<String>) {
    let absolute = |dir: String| {
        let dir = PathBuf::from(dir);
        if dir.is_absolute() {
            dir
        } else {
            manifest.join(dir)
        }
    };
    let Some(git_dir) = git(&["rev-parse", "--git-dir"]).map(absolute) else {
        return;
    };
    let common_dir = git(&["rev-parse", "--git-common-dir"])
        .map(absolute)
        .unwrap_or_else(|| git_dir.clone());
    let mut watched = vec![
        git_dir.join("HEAD"),
        git_dir.join("logs/HEAD"),
        git_dir.join("index"),
        common_dir.join("packed-refs"),
    ];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(common_dir.join(branch));
    }
    // A path that does not exist would make cargo rerun this every build.
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
