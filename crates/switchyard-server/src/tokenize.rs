//! Prompt to token ids, for routing only: the worker receives the client's
//! JSON unchanged and tokenizes it itself; the router's ids must equal the
//! worker's so that block hashes match the engine's KV events.
//!
//! The seam is the tokenizer crate's [`PromptTokenizer`] (with its
//! implementation, [`HfTokenizer`], and a chat's estimated rendered size,
//! [`switchyard_tokenizer::prompt::ChatPrompt`]); the server holds an
//! `Arc<dyn PromptTokenizer>`. What is the server's: where a prompt is
//! tokenized (on the async thread up to [`INLINE_CHARS`] as rendered, on
//! a blocking thread past it) and the tokenizer's series on `/metrics`
//! ([`TokenizerCollector`]).

use crate::metrics::{encode_const_counters, encode_const_gauges};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::Arc;

pub use switchyard_tokenizer::prompt::{
    rendered_size_estimate, HfTokenizer, Pause, PromptTokenizer, TokenizerStats,
};

/// Prompts up to this many characters (a chat's as rendered) are
/// tokenized on the async worker thread; longer ones go to
/// `spawn_blocking`. The hand-off to the blocking pool and back is two
/// cross-thread wake-ups, which on the 2-core VM cost more than the work
/// below this size: rendering a chat takes about 6 ns a character and
/// tokenizing its new text about 13 (a seen message's ids come from the
/// segment cache), so 8 KiB is at most about 150 µs uncached and about
/// 60 µs for a chat whose earlier turns were seen. The threshold was 2
/// KiB: the bundled ShareGPT conversations through one sim-worker
/// (`loadgen --sharegpt … --no-stream --max-output-tokens 1`) then went
/// through the blocking pool for most turns, and at concurrency 16 its
/// threads crowded the two cores: 4,145–4,266 requests a second, TTFT
/// mean 2.58–2.65 ms, tokenizing (the wait for a blocking thread
/// included) 773–877 µs a request. At 8 KiB, same runs: 5,920–6,607
/// requests a second, 1.46–1.59 ms, 150–161 µs (at concurrency 1 the
/// tokenizing went from 124–140 to 111–113 µs).
pub const INLINE_CHARS: usize = 8 * 1024;

/// The tokenizer's series, read at scrape time.
pub struct TokenizerCollector(pub Arc<dyn PromptTokenizer>);

impl std::fmt::Debug for TokenizerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerCollector").finish_non_exhaustive()
    }
}

impl Collector for TokenizerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let Some(stats) = self.0.stats() else {
            return Ok(());
        };
        let s = stats.segments;
        encode_const_counters(
            &mut encoder,
            &[
                (
                    "switchyard_tokenizer_segment_cache_lookups",
                    "Lookups of text segments (between special tokens, at least 64 bytes) in the token-id cache.",
                    s.lookups,
                ),
                (
                    "switchyard_tokenizer_segment_cache_hits",
                    "Segment lookups answered from the cache (not tokenized again).",
                    s.hits,
                ),
                (
                    "switchyard_tokenizer_segment_cache_evictions",
                    "Segments evicted from the cache (or refused as larger than it).",
                    s.evictions,
                ),
                (
                    "switchyard_tokenizer_word_cache_clears",
                    "Times a thread's word cache was emptied because it was full.",
                    stats.word_cache_clears,
                ),
            ],
        )?;
        encode_const_gauges(
            &mut encoder,
            &[
                (
                    "switchyard_tokenizer_fast_path",
                    "1 when the tokenizer runs on Switchyard's fast byte-level BPE path, 0 on the tokenizers crate (see the startup log for why).",
                    i64::from(stats.fast_path),
                ),
                (
                    "switchyard_tokenizer_segment_cache_entries",
                    "Segments held in the token-id cache.",
                    s.entries as i64,
                ),
                (
                    "switchyard_tokenizer_segment_cache_ids",
                    "Token ids held in the segment cache.",
                    s.ids as i64,
                ),
            ],
        )?;
        let ratio = if s.lookups == 0 {
            0.0
        } else {
            s.hits as f64 / s.lookups as f64
        };
        ConstGauge::new(ratio).encode(encoder.encode_descriptor(
            "switchyard_tokenizer_segment_cache_hit_ratio",
            "Segment cache hits over lookups since start.",
            None,
            MetricType::Gauge,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_tokenizer::ChatMessage;

    /// Many empty messages render long: tokenized off the async thread.
    #[test]
    fn many_empty_messages_are_tokenized_off_the_async_thread() {
        let empty = ChatMessage {
            role: "user".into(),
            content: String::new(),
            tool_calls: Vec::new(),
            reasoning: None,
        };
        assert!(rendered_size_estimate(&vec![empty; 1000]) > INLINE_CHARS);
    }
}
