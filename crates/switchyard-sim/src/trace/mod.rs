//! Streaming trace readers.
//!
//! Each reader yields one record at a time from any `BufRead`, so memory does
//! not grow with the trace; a malformed line is an error naming its line
//! number, never a panic.

mod azure;
mod mooncake;

pub use azure::{AzureReader, AzureRecord};
pub use mooncake::{synthetic_tokens, MooncakeReader, MooncakeRecord, MOONCAKE_BLOCK_TOKENS};

/// A trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading the underlying file failed.
    #[error("reading trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a valid record.
    #[error("line {line}: {reason}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

/// Non-blank lines of a `BufRead` with their 1-based numbers, reusing one
/// buffer: the loop every line-oriented trace reader shares.
#[derive(Debug)]
pub(crate) struct Lines<R> {
    input: R,
    line: usize,
    buf: String,
}

impl<R: std::io::BufRead> Lines<R> {
    pub(crate) fn new(input: R) -> Self {
        Self {
            input,
            line: 0,
            buf: String::new(),
        }
    }

    /// The next non-blank line, trimmed, with its number; `None` at the end.
    pub(crate) fn next_line(&mut self) -> Option<Result<(usize, &str), TraceError>> {
        loop {
            self.buf.clear();
            match self.input.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => self.line += 1,
                Err(e) => return Some(Err(e.into())),
            }
            if !self.buf.trim().is_empty() {
                return Some(Ok((self.line, self.buf.trim())));
            }
        }
    }
}
