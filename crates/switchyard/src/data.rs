//! Finding the bundled data files (traces, tokenizer).

use std::path::PathBuf;

/// Path of a bundled data file, `relative` to the repository's `data/`.
///
/// Looked up, in order: `$SWITCHYARD_DATA/relative`, `./data/relative`, and
/// the `data/` of the source tree this binary was built from.
pub fn data_path(relative: &str) -> anyhow::Result<PathBuf> {
    let mut tried = Vec::new();
    if let Some(dir) = std::env::var_os("SWITCHYARD_DATA") {
        tried.push(PathBuf::from(dir).join(relative));
    }
    tried.push(PathBuf::from("data").join(relative));
    tried.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data")).join(relative));
    for path in &tried {
        if path.is_file() {
            return Ok(path.clone());
        }
    }
    anyhow::bail!(
        "bundled data file {relative} not found (looked in {}); set SWITCHYARD_DATA to the repository's data/ directory",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}
