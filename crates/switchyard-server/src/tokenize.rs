//! Prompt to token ids, for routing only: the worker receives the client's
//! JSON unchanged and tokenizes it itself; the router's ids must equal the
//! worker's so that block hashes match the engine's KV events.
//!
//! [`PromptTokenizer`] is the seam: the server holds an
//! `Arc<dyn PromptTokenizer>`, the bundled Hugging Face implementation is
//! [`HfTokenizer`], and tests check any implementation against the
//! `tokenizers` crate. Callers run it on a blocking thread when the prompt
//! is long (see [`INLINE_CHARS`]); a chat's length is its estimated
//! rendered size ([`rendered_size_estimate`]), not its contents' alone.

use crate::metrics::{encode_const_counters, encode_const_gauges};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::Arc;
use switchyard_tokenizer::{ChatMessage, Tokenizer, TokenizerError};

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

/// What a chat template adds to each message, at least as much as the
/// bundled ChatML template does: `<|im_start|>`, the role, a newline,
/// `<|im_end|>` and a newline are 25 bytes besides the role.
pub const TEMPLATE_BYTES_PER_MESSAGE: usize = 32;

/// The size of `messages` as a chat template renders them, estimated
/// without rendering: contents, roles and [`TEMPLATE_BYTES_PER_MESSAGE`]
/// each. A million empty messages are tens of megabytes of template text
/// to render and tokenize: they go to a blocking thread like a long
/// prompt does.
pub fn rendered_size_estimate(messages: &[ChatMessage]) -> usize {
    messages.iter().fold(0usize, |size, m| {
        size.saturating_add(m.content.len())
            .saturating_add(m.role.len())
            .saturating_add(TEMPLATE_BYTES_PER_MESSAGE)
            .saturating_add(tool_calls_size(m))
    })
}

/// The size of a message's tool calls as rendered, about: their names and
/// arguments, and a template's framing of each.
pub fn tool_calls_size(message: &ChatMessage) -> usize {
    message.tool_calls.iter().fold(0usize, |size, c| {
        size.saturating_add(c.function.name.len())
            .saturating_add(c.function.arguments.len())
            .saturating_add(TEMPLATE_BYTES_PER_MESSAGE)
    })
}

/// Called between pieces of a long prompt with the bytes tokenized so far.
pub type Pause<'a> = &'a mut dyn FnMut(usize);

/// Text to token ids, with the model's chat template.
pub trait PromptTokenizer: Send + Sync + 'static {
    /// Token ids of `text` (special tokens in the text map to their ids).
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError>;

    /// Token ids of `messages` rendered with the chat template, ending with
    /// the assistant turn's opening, as engines do for a chat request.
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError>;

    /// [`Self::encode`] when the text is at most `max_tokens` long, `None`
    /// when longer; an implementation stops counting soon after the
    /// budget is passed (this default does not). It may call `pause`
    /// between pieces of a long text with the bytes done (the tokenizing
    /// gate's chance to let another prompt go first); this default does
    /// not.
    fn encode_within(
        &self,
        text: &str,
        max_tokens: usize,
        pause: Pause<'_>,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        let _ = pause;
        Ok(Some(self.encode(text)?).filter(|ids| ids.len() <= max_tokens))
    }

    /// [`Self::encode_chat`] within `max_tokens`, as [`Self::encode_within`].
    fn encode_chat_within(
        &self,
        messages: &[ChatMessage],
        max_tokens: usize,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        Ok(Some(self.encode_chat(messages)?).filter(|ids| ids.len() <= max_tokens))
    }

    /// [`Self::encode_chat_within`] of a chat that declares `tools` (the
    /// chat API's list), rendered as the engine renders them where the
    /// template does ([`Self::renders_tools`]); this default leaves them
    /// out (the caller counts what is not rendered). `pause` as in
    /// [`Self::encode_within`].
    fn encode_chat_with_tools_within(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        max_tokens: usize,
        pause: Pause<'_>,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        let _ = (tools, pause);
        self.encode_chat_within(messages, max_tokens)
    }

    /// Whether [`Self::encode_chat_with_tools_within`] renders the tools.
    fn renders_tools(&self) -> bool {
        false
    }

    /// Whether a chat's tool calls are rendered into its ids.
    fn renders_tool_calls(&self) -> bool {
        false
    }

    /// What `/metrics` shows of the tokenizer; `None` shows nothing.
    fn stats(&self) -> Option<TokenizerStats> {
        None
    }
}

/// The tokenizer's state for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TokenizerStats {
    /// On the fast path (else the `tokenizers` crate).
    pub fast_path: bool,
    /// The segment cache's counts.
    pub segments: switchyard_tokenizer::segment_cache::SegmentCacheStats,
    /// Times a thread's word cache was emptied when full.
    pub word_cache_clears: u64,
}

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

/// The `switchyard-tokenizer` crate (Hugging Face `tokenizer.json` plus the
/// Jinja chat template).
#[derive(Debug)]
pub struct HfTokenizer(pub Tokenizer);

impl PromptTokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.0.encode(text)
    }

    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        let text = self.0.apply_chat_template(messages, true)?;
        self.0.encode(&text)
    }

    /// Piece by piece: a text far over the budget costs about the
    /// budget's work ([`Tokenizer::encode_within`]).
    fn encode_within(
        &self,
        text: &str,
        max_tokens: usize,
        pause: Pause<'_>,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        self.0.encode_within_pausing(text, max_tokens, pause)
    }

    /// The rendered chat, piece by piece (rendering costs about the
    /// rendered text; tokenizing it whole, a hundred times that).
    fn encode_chat_within(
        &self,
        messages: &[ChatMessage],
        max_tokens: usize,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        self.encode_chat_with_tools_within(messages, None, max_tokens, &mut |_| {})
    }

    fn encode_chat_with_tools_within(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        max_tokens: usize,
        pause: Pause<'_>,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        let text = self
            .0
            .apply_chat_template_with_tools(messages, tools, true)?;
        self.0.encode_within_pausing(&text, max_tokens, pause)
    }

    fn renders_tools(&self) -> bool {
        self.0.renders_tools()
    }

    fn renders_tool_calls(&self) -> bool {
        self.0.renders_tool_calls()
    }

    fn stats(&self) -> Option<TokenizerStats> {
        Some(TokenizerStats {
            fast_path: self.0.fast_path_unsupported().is_none(),
            segments: self.0.segment_cache_stats(),
            word_cache_clears: switchyard_tokenizer::fast::word_cache_clears(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::sync::OnceLock;

    fn bundled() -> &'static HfTokenizer {
        static T: OnceLock<HfTokenizer> = OnceLock::new();
        T.get_or_init(|| HfTokenizer(Tokenizer::bundled().expect("bundled tokenizer loads")))
    }

    /// The `tokenizers` crate on the same vocabulary: the reference.
    fn reference() -> &'static tokenizers::Tokenizer {
        static T: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
        T.get_or_init(|| {
            Tokenizer::bundled_json()
                .parse()
                .expect("reference tokenizer loads")
        })
    }

    /// The ShareGPT fixture: a few conversations from the shared trace, as
    /// `{"id", "conversations": [{"from", "value"}]}` lines (see
    /// `tests/fixtures/README.md` for provenance).
    fn sharegpt_texts() -> Vec<String> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sharegpt_sample.jsonl"
        );
        let file = std::fs::File::open(path).expect("fixture exists");
        let mut texts = Vec::new();
        for line in std::io::BufReader::new(file).lines() {
            let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
            for turn in v["conversations"].as_array().unwrap() {
                texts.push(turn["value"].as_str().unwrap().to_owned());
            }
        }
        texts
    }

    #[test]
    fn the_rendered_size_estimate_covers_the_bundled_template() {
        let message = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
        };
        for messages in [
            vec![message("user", "")],
            vec![message("user", ""); 100],
            vec![message("system", "be brief"), message("user", "hi")],
            vec![message("assistant", ""), message("user", "x")],
        ] {
            let rendered = bundled().0.apply_chat_template(&messages, true).unwrap();
            // The template's fixed text (the assistant opening) aside.
            let fixed = bundled()
                .0
                .apply_chat_template(&[], true)
                .unwrap_or_default()
                .len();
            assert!(
                rendered.len() <= rendered_size_estimate(&messages) + fixed.max(32),
                "{} bytes rendered, {} estimated",
                rendered.len(),
                rendered_size_estimate(&messages)
            );
        }
        // Many empty messages render long: off the async thread.
        let empty = vec![message("user", ""); 1000];
        assert!(rendered_size_estimate(&empty) > INLINE_CHARS);
    }

    #[test]
    fn router_token_ids_equal_the_tokenizers_crate_on_sharegpt_text() {
        let texts = sharegpt_texts();
        assert!(texts.len() >= 20, "fixture has {} texts", texts.len());
        for text in &texts {
            let ours = bundled().encode(text).unwrap();
            let theirs = reference().encode(text.as_str(), false).unwrap();
            assert_eq!(ours, theirs.get_ids(), "ids differ on a ShareGPT turn");
        }
    }

    #[test]
    fn sharegpt_text_encoded_in_pieces_has_the_whole_texts_ids() {
        let texts = sharegpt_texts();
        let mut compared = 0;
        for text in &texts {
            let whole = bundled().encode(text).unwrap();
            let pieces: Vec<&str> = switchyard_tokenizer::pieces(text, 256).collect();
            // Only pieces cut where a word ends (not a forced cut of 256
            // bytes with no space or newline) must agree.
            let word_ends = pieces
                .windows(2)
                .all(|w| w[0].ends_with('\n') || w[1].starts_with(' '));
            if !word_ends {
                continue;
            }
            let mut ids = Vec::new();
            for piece in &pieces {
                ids.extend(bundled().encode(piece).unwrap());
            }
            assert_eq!(ids, whole, "a ShareGPT turn in {} pieces", pieces.len());
            compared += usize::from(pieces.len() > 1);
            let within = bundled()
                .encode_within(text, whole.len(), &mut |_| {})
                .unwrap();
            assert_eq!(within.as_ref(), Some(&whole));
        }
        assert!(compared >= 10, "only {compared} texts were cut");
    }

    #[test]
    fn chat_ids_equal_the_tokenizers_crate_on_the_rendered_template() {
        let texts = sharegpt_texts();
        let messages: Vec<ChatMessage> = texts
            .iter()
            .take(6)
            .enumerate()
            .map(|(i, t)| ChatMessage {
                role: if i % 2 == 0 { "user" } else { "assistant" }.into(),
                content: t.clone(),
                tool_calls: Vec::new(),
            })
            .collect();
        let ours = bundled().encode_chat(&messages[..5]).unwrap();
        let rendered = bundled()
            .0
            .apply_chat_template(&messages[..5], true)
            .unwrap();
        let theirs = reference().encode(rendered.as_str(), false).unwrap();
        assert_eq!(ours, theirs.get_ids());
        assert_eq!(
            *ours.last().unwrap(),
            198,
            "ends with the assistant opening's newline"
        );
    }
}
