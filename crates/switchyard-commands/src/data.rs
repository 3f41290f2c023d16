//! The bundled data: what commands read when no file is named.
//!
//! The Mooncake conversation trace (`data/traces/mooncake_conversation.jsonl`,
//! the default of `replay`, `demo`, `loadgen` and the benchmarks that replay
//! a trace) is compiled into the binary, gzipped by `build.rs`, so an
//! installed `switchyard` reads no file for it; `$SWITCHYARD_DATA` names
//! another copy of `data/` to read instead ([`Trace`]). The tokenizer is
//! compiled into `switchyard-tokenizer` the same way. The ShareGPT
//! conversations (6.4 MB, the default of `bench tokenize` and `bench
//! versus` only) are not: [`data_path`] finds them on disk.

use anyhow::Context as _;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// The bundled trace's path under `data/`.
const MOONCAKE_CONVERSATION: &str = "traces/mooncake_conversation.jsonl";

/// The Mooncake conversation trace, gzipped from `data/` by `build.rs`
/// (0.8 MB in the binary instead of 3.0).
static MOONCAKE_CONVERSATION_GZ: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/mooncake_conversation.jsonl.gz"));

/// A trace to read: a file, or the copy compiled into this binary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trace {
    /// A file, read through gzip when its name ends in `.gz`.
    File(PathBuf),
    /// The compiled-in Mooncake conversation trace.
    Bundled,
}

impl Trace {
    /// `path` when one is given, else the Mooncake conversation trace:
    /// `$SWITCHYARD_DATA`'s copy when that is set, else the bundled one.
    pub fn or_bundled(path: Option<&Path>) -> Self {
        match (path, std::env::var_os("SWITCHYARD_DATA")) {
            (Some(path), _) => Self::File(path.to_owned()),
            (None, Some(dir)) => Self::File(PathBuf::from(dir).join(MOONCAKE_CONVERSATION)),
            (None, None) => Self::Bundled,
        }
    }

    /// The file's name, lowercase (what a trace's format is told by).
    pub fn file_name(&self) -> String {
        match self {
            Self::File(path) => path
                .file_name()
                .map(|n| n.to_string_lossy().to_ascii_lowercase())
                .unwrap_or_default(),
            Self::Bundled => "mooncake_conversation.jsonl".to_owned(),
        }
    }

    /// Opens it for reading.
    pub fn open(&self) -> anyhow::Result<Box<dyn BufRead + Send>> {
        let path = match self {
            Self::Bundled => {
                let gzip = flate2::read::GzDecoder::new(MOONCAKE_CONVERSATION_GZ);
                return Ok(Box::new(BufReader::new(gzip)));
            }
            Self::File(path) => path,
        };
        let file = File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
        Ok(if path.extension().is_some_and(|e| e == "gz") {
            Box::new(BufReader::new(flate2::read::GzDecoder::new(file)))
        } else {
            Box::new(BufReader::new(file))
        })
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => path.display().fmt(f),
            Self::Bundled => f.write_str("mooncake_conversation.jsonl (built in)"),
        }
    }
}

/// Path of a data file that is not compiled in, `relative` to the
/// repository's `data/`.
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
        "data file {relative} not found (looked in {}); it is not built into the binary: set SWITCHYARD_DATA to a copy of the repository's data/ directory",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read as _;

    #[test]
    fn the_bundled_trace_is_the_repositorys_file() {
        let mut bundled = String::new();
        Trace::Bundled
            .open()
            .unwrap()
            .read_to_string(&mut bundled)
            .unwrap();
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/",
            "traces/mooncake_conversation.jsonl"
        );
        assert!(
            bundled == std::fs::read_to_string(path).unwrap(),
            "the bundled trace differs from {path}"
        );
    }

    #[test]
    fn a_gzipped_file_is_read_through_gzip() {
        let path =
            std::env::temp_dir().join(format!("switchyard-data-{}.jsonl.gz", std::process::id()));
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gzip, b"line one\nline two\n").unwrap();
        std::fs::write(&path, gzip.finish().unwrap()).unwrap();
        let lines: Vec<String> = Trace::File(path.clone())
            .open()
            .unwrap()
            .lines()
            .map(Result::unwrap)
            .collect();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(lines, ["line one", "line two"]);
    }
}
