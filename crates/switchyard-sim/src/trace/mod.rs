//! Streaming trace readers.
//!
//! Each reader yields one record at a time from any `BufRead`, so memory does
//! not grow with the trace; a malformed line is an error naming its line
//! number, never a panic.

mod azure;
mod mooncake;
mod sharegpt;

pub use azure::{AzureReader, AzureRecord};
pub use mooncake::{synthetic_tokens, MooncakeReader, MooncakeRecord, MOONCAKE_BLOCK_TOKENS};
pub use sharegpt::{read_sharegpt, ShareGptOptions};

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
