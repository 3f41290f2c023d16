//! Mooncake traces: one JSON object per line,
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int]}`,
//! each hash id standing for one 512-token block, prefix-chained.

use super::{Lines, TraceError};
use serde::Deserialize;
use std::io::BufRead;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens each Mooncake hash id stands for.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Vocabulary the synthetic token ids are drawn from (Qwen3's size, so the
/// ids look like a real model's).
const SYNTHETIC_VOCAB: u64 = 151_643;

/// One request of a Mooncake trace.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MooncakeRecord {
    /// Arrival time in milliseconds from the trace's start.
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block (the last may be partial).
    pub hash_ids: Vec<u64>,
}

/// Reads Mooncake records one line at a time; blank lines are skipped.
#[derive(Debug)]
pub struct MooncakeReader<R> {
    lines: Lines<R>,
}

impl<R: BufRead> MooncakeReader<R> {
    /// A reader over `input`.
    pub fn new(input: R) -> Self {
        Self {
            lines: Lines::new(input),
        }
    }
}

impl<R: BufRead> Iterator for MooncakeReader<R> {
    type Item = Result<MooncakeRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        let (line, text) = match self.lines.next_line()? {
            Ok(l) => l,
            Err(e) => return Some(Err(e)),
        };
        let malformed = |reason: String| TraceError::Malformed { line, reason };
        let record: MooncakeRecord = match serde_json::from_str(text) {
            Ok(r) => r,
            Err(e) => return Some(Err(malformed(format!("not a Mooncake record: {e}")))),
        };
        if !(record.timestamp.is_finite() && record.timestamp >= 0.0) {
            return Some(Err(malformed(format!(
                "timestamp must be a non-negative number, got {}",
                record.timestamp
            ))));
        }
        let covered = record.hash_ids.len() * MOONCAKE_BLOCK_TOKENS;
        if record.input_length as usize > covered {
            return Some(Err(malformed(format!(
                "input_length {} exceeds the {} tokens its {} hash ids cover",
                record.input_length,
                covered,
                record.hash_ids.len()
            ))));
        }
        Some(Ok(record))
    }
}

/// Expands hash ids into `input_length` deterministic synthetic token ids,
/// 512 per id, appended to `out`. The same id always yields the same tokens,
/// so prompts sharing ids share token prefixes at any router block size.
pub fn synthetic_tokens(hash_ids: &[u64], input_length: usize, out: &mut Vec<u32>) {
    out.reserve(input_length);
    let mut left = input_length;
    for &id in hash_ids {
        if left == 0 {
            break;
        }
        let n = left.min(MOONCAKE_BLOCK_TOKENS);
        out.extend(
            (0..n as u64)
                .map(|j| (xxh3_64_with_seed(&j.to_le_bytes(), id) % SYNTHETIC_VOCAB) as u32),
        );
        left -= n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<Result<MooncakeRecord, TraceError>> {
        MooncakeReader::new(text.as_bytes()).collect()
    }

    #[test]
    fn reads_records_and_skips_blank_lines() {
        let records = read(
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
             {\"timestamp\": 3000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n",
        );
        assert_eq!(records.len(), 2);
        let first = records[0].as_ref().unwrap();
        assert_eq!(first.input_length, 600);
        assert_eq!(first.hash_ids, vec![0, 1]);
        assert_eq!(records[1].as_ref().unwrap().timestamp, 3000.0);
    }

    #[test]
    fn a_malformed_line_is_an_error_naming_its_line() {
        let records = read(
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\
             {\"timestamp\": 0, \"input_length\": 1\n",
        );
        let err = records[1].as_ref().unwrap_err().to_string();
        assert!(err.starts_with("line 2: not a Mooncake record"), "{err}");
    }

    #[test]
    fn a_prompt_longer_than_its_hash_ids_is_refused() {
        let records = read(
            "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [0]}\n",
        );
        let err = records[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("exceeds"), "{err}");
        let records = read(
            "{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n",
        );
        assert!(records[0].is_err());
    }

    #[test]
    fn shared_hash_ids_expand_to_shared_token_prefixes() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        synthetic_tokens(&[7, 8], 700, &mut a);
        synthetic_tokens(&[7, 9], 600, &mut b);
        assert_eq!(a.len(), 700);
        assert_eq!(b.len(), 600);
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..600], b[512..600]);
        let mut again = Vec::new();
        synthetic_tokens(&[7, 8], 700, &mut again);
        assert_eq!(a, again);
    }

    #[test]
    fn the_bundled_conversation_trace_reads_cleanly() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/traces/mooncake_conversation.jsonl"
        );
        let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
        let records: Vec<MooncakeRecord> = MooncakeReader::new(file).map(Result::unwrap).collect();
        assert_eq!(records.len(), 12_031);
        assert!(records.iter().all(|r| r.hash_ids.first() == Some(&0)));
    }
}
