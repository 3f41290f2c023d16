//! Compresses the bundled Qwen3 `tokenizer.json` (11 MB of JSON, 2 MB
//! gzipped) from the repository's `data/tokenizers/` into `OUT_DIR`, where
//! `src/lib.rs` embeds it with `include_bytes!`: a built binary carries its
//! tokenizer and needs no data directory at run time.

use std::io::Write;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let source = manifest.join("../../data/tokenizers/qwen3-tokenizer.json");
    println!("cargo:rerun-if-changed={}", source.display());
    let json = std::fs::read(&source)
        .unwrap_or_else(|e| panic!("reading the bundled tokenizer {}: {e}", source.display()));
    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gzip.write_all(&json).expect("gzip into memory");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"))
        .join("qwen3-tokenizer.json.gz");
    std::fs::write(&out, gzip.finish().expect("gzip into memory"))
        .unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
