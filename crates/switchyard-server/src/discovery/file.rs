//! The file source (`--workers-file PATH`): a TOML file of `[[workers]]`
//! tables, the config file's format and parser ([`WorkersFile`]), read on
//! an interval.
//!
//! Each poll reads the file (at most [`MAX_FILE_BYTES`]) and compares a
//! hash of its bytes with the last one seen; only a change is parsed.
//! Modification times are not trusted alone: a file rewritten twice within
//! the file system's timestamp granularity keeps its mtime. A file that
//! cannot be read, is missing, or does not parse and validate keeps the
//! last good set; each such state is logged and counted once when it
//! begins, not at every poll.

use crate::config::{CacheMode, ConfigError, WorkerSpec, WorkersFile};
use std::hash::{Hash, Hasher};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest workers file read; a larger one is an error (the last good
/// set stays).
pub(crate) const MAX_FILE_BYTES: u64 = 1 << 20;

/// What one poll of the file found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Poll {
    /// The same bytes as last time (or the same failure): nothing to do.
    Unchanged,
    /// New contents that parsed: the file's workers.
    Changed(Vec<WorkerSpec>),
    /// A new failure: the last good set stays.
    Failed(FileError),
}

/// Why the file's workers could not be read; the `reason` label of
/// `switchyard_discovery_errors_total`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FileError {
    /// The file is not there.
    #[error("{}: not found; keeping the last set of workers", .0.display())]
    Missing(PathBuf),
    /// It cannot be read, or is too large.
    #[error("{}: cannot be read ({}); keeping the last set of workers", .0.display(), .1)]
    Read(PathBuf, String),
    /// It does not parse, or its table does not validate.
    #[error("{}: {}; keeping the last set of workers", .0.display(), .1)]
    Invalid(PathBuf, String),
}

impl FileError {
    /// Its metric label.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            FileError::Missing(_) => "missing",
            FileError::Read(..) => "read",
            FileError::Invalid(..) => "invalid",
        }
    }
}

/// Watches one workers file. Owns the hash of the last contents seen and
/// whether the last poll failed; the driver calls [`FileWatch::poll`]
/// (blocking file I/O: off the async threads).
#[derive(Debug)]
pub(crate) struct FileWatch {
    path: PathBuf,
    /// The block sizes a worker may name (the router's, then its
    /// `[[models]]` tables').
    block_sizes: Vec<u32>,
    cache: CacheMode,
    /// Hash of the last bytes read (parsed or not); `None` before the first
    /// read and after a failed read.
    last_hash: Option<u64>,
    /// The reason of the last poll's failure (a repeat is not news).
    failing: Option<&'static str>,
}

impl FileWatch {
    /// A watch of `path` for a router hashing at `block_sizes` (its own
    /// first) in `cache` mode.
    pub(crate) fn new(path: &Path, block_sizes: Vec<u32>, cache: CacheMode) -> Self {
        Self {
            path: path.to_owned(),
            block_sizes,
            cache,
            last_hash: None,
            failing: None,
        }
    }

    /// Reads the file and says what changed.
    pub(crate) fn poll(&mut self) -> Poll {
        match read_bounded(&self.path) {
            Ok(bytes) => self.contents(&bytes),
            Err(error) => {
                self.last_hash = None;
                if self.failing == Some(error.reason()) {
                    return Poll::Unchanged;
                }
                self.failing = Some(error.reason());
                Poll::Failed(error)
            }
        }
    }

    /// A poll's outcome for the file's bytes.
    pub(crate) fn contents(&mut self, bytes: &[u8]) -> Poll {
        let hash = content_hash(bytes);
        if self.last_hash == Some(hash) {
            return Poll::Unchanged;
        }
        self.last_hash = Some(hash);
        let parsed = std::str::from_utf8(bytes)
            .map_err(|_| "not UTF-8 text".to_owned())
            .and_then(|text| {
                WorkersFile::parse(text, &self.block_sizes, self.cache).map_err(|e| match e {
                    ConfigError::File { reason, .. } => reason,
                    other => other.to_string(),
                })
            });
        match parsed {
            Ok(file) => {
                self.failing = None;
                Poll::Changed(file.workers)
            }
            Err(reason) => {
                let error = FileError::Invalid(self.path.clone(), reason);
                self.failing = Some(error.reason());
                Poll::Failed(error)
            }
        }
    }
}

/// The file's bytes, at most [`MAX_FILE_BYTES`].
fn read_bounded(path: &Path) -> Result<Vec<u8>, FileError> {
    let read_error = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => FileError::Missing(path.to_owned()),
        _ => FileError::Read(path.to_owned(), e.to_string()),
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(FileError::Read(
            path.to_owned(),
            format!("larger than {MAX_FILE_BYTES} bytes"),
        ));
    }
    Ok(bytes)
}

/// A hash of the file's bytes (SipHash with fixed keys: the same bytes
/// hash the same in every poll).
fn content_hash(bytes: &[u8]) -> u64 {
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> FileWatch {
        FileWatch::new(Path::new("/workers.toml"), vec![16], CacheMode::Auto)
    }

    const TWO: &str = "[[workers]]\nurl = \"http://10.0.0.1:8000\"\nname = \"a\"\n\n[[workers]]\nurl = \"http://10.0.0.2:8000\"\n";

    #[test]
    fn new_contents_are_parsed_with_the_config_files_parser_once() {
        let mut w = watch();
        let Poll::Changed(specs) = w.contents(TWO.as_bytes()) else {
            panic!("the first read is a change")
        };
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].display_name(), "a");
        assert_eq!(specs[1].display_name(), "10.0.0.2:8000");
        assert_eq!(w.contents(TWO.as_bytes()), Poll::Unchanged);
        assert_eq!(
            w.contents(b""),
            Poll::Changed(vec![]),
            "an empty file is no workers"
        );
    }

    #[test]
    fn a_bad_file_is_reported_once_and_a_fixed_one_is_read_again() {
        let mut w = watch();
        assert!(matches!(w.contents(TWO.as_bytes()), Poll::Changed(_)));
        for bad in [
            "[[workers]]\nurl = \"http://a:1\"\nname = \"x\"\n[[workers]]\nurl = \"http://b:1\"\nname = \"x\"\n",
            "[[workers]]\nurl = \"ftp://a:1\"\n",
            "[[workers]]\nurl = \"http://a:1\"\nblock-size = 64\n",
            "[[workers]]\nurl = \"http://a:1\"\ncolour = \"red\"\n",
            "policy = \"kv\"\n",
            "[[workers]\n",
        ] {
            let Poll::Failed(error) = w.contents(bad.as_bytes()) else {
                panic!("{bad:?} is refused")
            };
            assert_eq!(error.reason(), "invalid", "{bad:?}");
            assert_eq!(w.contents(bad.as_bytes()), Poll::Unchanged, "once");
        }
        assert!(matches!(w.contents(TWO.as_bytes()), Poll::Changed(_)));
        assert!(matches!(
            w.contents(&[0xff, 0xfe]),
            Poll::Failed(FileError::Invalid(..))
        ));
    }

    #[test]
    fn a_missing_file_is_reported_once_until_it_returns() {
        let dir =
            std::env::temp_dir().join(format!("switchyard-file-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("workers.toml");
        let _ = std::fs::remove_file(&path);
        let mut w = FileWatch::new(&path, vec![16], CacheMode::Auto);
        assert!(matches!(w.poll(), Poll::Failed(FileError::Missing(_))));
        assert_eq!(w.poll(), Poll::Unchanged);
        std::fs::write(&path, TWO).unwrap();
        assert!(matches!(w.poll(), Poll::Changed(_)));
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(w.poll(), Poll::Failed(FileError::Missing(_))));
        std::fs::write(&path, vec![b'#'; MAX_FILE_BYTES as usize + 1]).unwrap();
        assert!(matches!(w.poll(), Poll::Failed(FileError::Read(..))));
        std::fs::remove_file(&path).unwrap();
    }
}
