//! Build-time input of the commands' library: the bundled Mooncake
//! conversation trace, gzipped from the repository's `data/` into
//! `OUT_DIR` for `include_bytes!` (`src/data.rs`), so that an installed
//! binary replays it with no data directory.

use std::io::Write;
use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    gzip_into(
        &manifest.join("../../data/traces/mooncake_conversation.jsonl"),
        &out.join("mooncake_conversation.jsonl.gz"),
    );
}

/// Writes `source` gzipped to `target`; rebuilt when `source` changes.
fn gzip_into(source: &Path, target: &Path) {
    println!("cargo:rerun-if-changed={}", source.display());
    let bytes = std::fs::read(source)
        .unwrap_or_else(|e| panic!("reading bundled data {}: {e}", source.display()));
    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gzip.write_all(&bytes).expect("gzip into memory");
    std::fs::write(target, gzip.finish().expect("gzip into memory"))
        .unwrap_or_else(|e| panic!("writing {}: {e}", target.display()));
}
