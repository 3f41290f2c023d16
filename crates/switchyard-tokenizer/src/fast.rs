//! The fast path: a `tokenizer.json` of the byte-level BPE family the
//! Qwen2/Qwen3 models use, encoded without the `tokenizers` crate's
//! general machinery, with the same ids.
//!
//! The pipeline is the `tokenizers` crate's, step for step:
//!
//! 1. added tokens (`<|im_start|>` …) are found in the raw text, leftmost
//!    longest first, and map to their ids;
//! 2. the text between them is NFC-normalized (text below U+0300 is
//!    already NFC and skips this; the rest is normalized by the
//!    `tokenizers` crate itself, so the Unicode tables agree);
//! 3. pre-tokenized by [`QwenSplit`](crate::pretokenize::QwenSplit);
//! 4. each piece's bytes run through [`ByteLevelBpe`].
//!
//! Short pieces (words, mostly) are looked up first in a per-thread cache
//! of their ids ([`WORD_CACHE_ENTRIES`] a thread, emptied when full): the
//! merge table is megabytes, and a cold lookup costs a cache miss per
//! merge, where a common word's ids are a lookup in a small hot table.
//!
//! [`FastBpe::from_json`] accepts only what it reproduces exactly and
//! names the first thing it does not, so the caller can fall back to the
//! `tokenizers` crate and say why.

use crate::bpe::{byte_chars, ByteLevelBpe, Unsupported};
use crate::pretokenize::{Classes, QwenSplit, QWEN_PATTERN};
use aho_corasick::{AhoCorasick, MatchKind};
use rustc_hash::FxHashMap;
use serde::Deserialize;
use serde_json::{json, Value};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Entries of each thread's word cache before it is emptied.
pub const WORD_CACHE_ENTRIES: usize = 16 * 1024;

/// Pieces up to this many bytes go through the word cache.
const WORD_BYTES: usize = 15;

/// Ids a cached word may have.
const WORD_IDS: usize = 4;

/// Times a thread's word cache was emptied because it was full, over the
/// process.
static WORD_CACHE_CLEARS: AtomicU64 = AtomicU64::new(0);

/// Gives each [`FastBpe`] its own key space in the word caches.
static NEXT_MODEL: AtomicU64 = AtomicU64::new(0);

/// A word's ids: count and up to [`WORD_IDS`] ids.
type WordIds = (u8, [u32; WORD_IDS]);

thread_local! {
    /// (model, word packed with its length) → ids.
    static WORDS: RefCell<FxHashMap<(u64, u128), WordIds>> = RefCell::new(FxHashMap::default());
}

/// How many times a thread's word cache was emptied, process-wide.
pub fn word_cache_clears() -> u64 {
    WORD_CACHE_CLEARS.load(Relaxed)
}

/// A piece of at most [`WORD_BYTES`] bytes and its length as one number.
fn pack(piece: &[u8]) -> u128 {
    let mut bytes = [0u8; 16];
    bytes[..piece.len()].copy_from_slice(piece);
    bytes[15] = piece.len() as u8;
    u128::from_le_bytes(bytes)
}

#[derive(Deserialize)]
struct TokenizerJson {
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    normalizer: Option<Value>,
    pre_tokenizer: Option<Value>,
    truncation: Option<Value>,
    padding: Option<Value>,
    model: Model,
}

#[derive(Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    normalized: bool,
}

#[derive(Deserialize)]
struct Model {
    #[serde(rename = "type")]
    kind: Option<String>,
    dropout: Option<f64>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    ignore_merges: bool,
    vocab: FxHashMap<String, u32>,
    merges: Vec<Merge>,
}

/// A merge as written: `"a b"` (older files) or `["a", "b"]`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Merge {
    Pair(String, String),
    Joined(String),
}

/// A piece of text after the added tokens are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment<'t> {
    /// An added token, by id.
    Added(u32),
    /// Text between added tokens.
    Text(&'t str),
}

/// The fast encoder of one `tokenizer.json`.
#[derive(Debug)]
pub struct FastBpe {
    model: u64,
    classes: Classes,
    bpe: ByteLevelBpe,
    nfc: bool,
    /// The added tokens' contents, matched leftmost-longest.
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
}

impl FastBpe {
    /// Parses a `tokenizer.json`; `Err` names what the fast path does
    /// not reproduce.
    pub fn from_json(text: &str) -> Result<Self, Unsupported> {
        let json: TokenizerJson =
            serde_json::from_str(text).map_err(|e| format!("unreadable tokenizer.json: {e}"))?;
        Self::new(json)
    }

    fn new(json: TokenizerJson) -> Result<Self, Unsupported> {
        let model = json.model;
        if model.kind.as_deref().is_some_and(|k| k != "BPE") {
            return Err(format!("model type {:?} is not BPE", model.kind));
        }
        if model.dropout.is_some_and(|d| d > 0.0) {
            return Err("BPE dropout".into());
        }
        if model.byte_fallback || model.ignore_merges {
            return Err("byte_fallback or ignore_merges".into());
        }
        if !model
            .continuing_subword_prefix
            .unwrap_or_default()
            .is_empty()
            || !model.end_of_word_suffix.unwrap_or_default().is_empty()
        {
            return Err("a subword prefix or suffix".into());
        }
        if json.truncation.is_some_and(|v| !v.is_null())
            || json.padding.is_some_and(|v| !v.is_null())
        {
            return Err("truncation or padding".into());
        }
        let nfc = match json.normalizer {
            None | Some(Value::Null) => false,
            Some(v) if v == json!({"type": "NFC"}) => true,
            Some(v) => return Err(format!("normalizer {}", kind(&v))),
        };
        let expected = json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            ],
        });
        let mut pre = json.pre_tokenizer.unwrap_or(Value::Null);
        // `trim_offsets` moves offsets only, never ids.
        if let Some(byte_level) = pre.pointer_mut("/pretokenizers/1/trim_offsets") {
            *byte_level = Value::Bool(false);
        }
        if pre != expected {
            return Err(format!(
                "pre-tokenizer {} (the fast path knows the Qwen2/Qwen3 split and byte-level only)",
                kind(&pre)
            ));
        }
        for token in &json.added_tokens {
            if token.single_word || token.lstrip || token.rstrip || token.normalized {
                return Err(format!(
                    "added token {} is single_word, lstrip, rstrip or normalized",
                    token.id
                ));
            }
            if token.content.is_empty() {
                return Err(format!("added token {} is empty", token.id));
            }
        }
        let merges = model
            .merges
            .iter()
            .map(|merge| match merge {
                Merge::Pair(l, r) => Ok((l.as_str(), r.as_str())),
                Merge::Joined(s) => {
                    let mut parts = s.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(l), Some(r), None) => Ok((l, r)),
                        _ => Err(format!("merge {s:?} is not two tokens")),
                    }
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Every vocabulary entry must be byte-level text.
        let byte_level: rustc_hash::FxHashSet<char> = byte_chars().into_iter().collect();
        if let Some(token) = model
            .vocab
            .keys()
            .find(|t| !t.chars().all(|c| byte_level.contains(&c)))
        {
            return Err(format!("vocabulary entry {token:?} is not byte-level"));
        }
        let bpe = ByteLevelBpe::new(&model.vocab, merges)?;
        let added = if json.added_tokens.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(json.added_tokens.iter().map(|t| &t.content))
                    .map_err(|e| format!("added tokens: {e}"))?,
            )
        };
        Ok(Self {
            model: NEXT_MODEL.fetch_add(1, Relaxed),
            classes: Classes::new(),
            bpe,
            nfc,
            added,
            added_ids: json.added_tokens.iter().map(|t| t.id).collect(),
        })
    }

    /// `text` cut at its added tokens, in order.
    pub fn segments<'t>(&'t self, text: &'t str) -> impl Iterator<Item = Segment<'t>> + 't {
        let mut matches = self.added.as_ref().map(|ac| ac.find_iter(text));
        let mut at = 0;
        let mut pending: Option<Segment<'t>> = None;
        std::iter::from_fn(move || {
            if let Some(segment) = pending.take() {
                return Some(segment);
            }
            match matches.as_mut().and_then(Iterator::next) {
                Some(m) => {
                    let added = Segment::Added(self.added_ids[m.pattern().as_usize()]);
                    let before = &text[at..m.start()];
                    at = m.end();
                    if before.is_empty() {
                        Some(added)
                    } else {
                        pending = Some(added);
                        Some(Segment::Text(before))
                    }
                }
                None if at < text.len() => {
                    let rest = &text[at..];
                    at = text.len();
                    Some(Segment::Text(rest))
                }
                None => None,
            }
        })
    }

    /// Appends the ids of text holding no added token to `out`.
    pub fn encode_text(&self, text: &str, out: &mut Vec<u32>) {
        // Lead bytes from 0xCC start U+0300 and above: below, text is NFC.
        let normalized;
        let text = if self.nfc && text.bytes().any(|b| b >= 0xCC) {
            let mut n = tokenizers::NormalizedString::from(text);
            n.nfc();
            normalized = n.get().to_owned();
            normalized.as_str()
        } else {
            text
        };
        WORDS.with_borrow_mut(|words| {
            for piece in QwenSplit::new(text, &self.classes) {
                self.encode_word(piece.as_bytes(), words, out);
            }
        });
    }

    /// One piece, through the word cache when it is short.
    fn encode_word(
        &self,
        piece: &[u8],
        words: &mut FxHashMap<(u64, u128), WordIds>,
        out: &mut Vec<u32>,
    ) {
        if piece.len() > WORD_BYTES || piece.len() < 2 {
            return self.bpe.encode_piece(piece, out);
        }
        let key = (self.model, pack(piece));
        if let Some((n, ids)) = words.get(&key) {
            out.extend_from_slice(&ids[..usize::from(*n)]);
            return;
        }
        let start = out.len();
        self.bpe.encode_piece(piece, out);
        let new = &out[start..];
        if new.len() <= WORD_IDS {
            if words.len() >= WORD_CACHE_ENTRIES {
                words.clear();
                WORD_CACHE_CLEARS.fetch_add(1, Relaxed);
            }
            let mut ids = [0; WORD_IDS];
            ids[..new.len()].copy_from_slice(new);
            words.insert(key, (new.len() as u8, ids));
        }
    }
}

/// A JSON component's `type`, for messages.
fn kind(v: &Value) -> String {
    v.get("type")
        .and_then(Value::as_str)
        .map_or_else(|| v.to_string().chars().take(80).collect(), str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn bundled_json() -> &'static Value {
        static J: OnceLock<Value> = OnceLock::new();
        J.get_or_init(|| serde_json::from_str(&crate::Tokenizer::bundled_json()).unwrap())
    }

    fn bundled() -> &'static FastBpe {
        static T: OnceLock<FastBpe> = OnceLock::new();
        T.get_or_init(|| FastBpe::from_json(&bundled_json().to_string()).unwrap())
    }

    /// The bundled file with one change at `pointer`.
    fn changed(pointer: &str, value: Value) -> Result<FastBpe, Unsupported> {
        let mut json = bundled_json().clone();
        *json.pointer_mut(pointer).expect("the pointer exists") = value;
        FastBpe::from_json(&json.to_string())
    }

    #[test]
    fn text_splits_at_added_tokens_leftmost_longest() {
        let segments: Vec<Segment<'_>> = bundled()
            .segments("a<|im_start|>user\n<think><|im_end|><|im_end")
            .collect();
        assert_eq!(
            segments,
            [
                Segment::Text("a"),
                Segment::Added(151_644),
                Segment::Text("user\n"),
                Segment::Added(151_667),
                Segment::Added(151_645),
                Segment::Text("<|im_end"),
            ]
        );
        assert_eq!(bundled().segments("").count(), 0);
    }

    #[test]
    fn anything_the_fast_path_does_not_reproduce_is_refused_by_name() {
        let cases = [
            (
                "/pre_tokenizer/pretokenizers/0/pattern/Regex",
                json!("\\p{N}{1,3}"),
                "pre-tokenizer",
            ),
            ("/normalizer", json!({"type": "NFKC"}), "normalizer NFKC"),
            ("/model/byte_fallback", json!(true), "byte_fallback"),
            ("/model/dropout", json!(0.1), "dropout"),
            ("/model/continuing_subword_prefix", json!("##"), "prefix"),
            ("/added_tokens/0/lstrip", json!(true), "added token 151643"),
            ("/truncation", json!({"max_length": 8}), "truncation"),
            ("/model/type", json!("WordPiece"), "not BPE"),
        ];
        for (pointer, value, reason) in cases {
            let err = changed(pointer, value).expect_err(pointer);
            assert!(err.contains(reason), "{pointer}: {err}");
        }
        // Offsets only: still the fast path.
        assert!(changed("/pre_tokenizer/pretokenizers/1/trim_offsets", json!(true)).is_ok());
    }

    #[test]
    fn a_refused_file_still_loads_on_the_tokenizers_crate() {
        let mut json = bundled_json().clone();
        *json.pointer_mut("/normalizer").unwrap() = json!({"type": "NFKC"});
        let dir = std::env::temp_dir().join(format!("switchyard-fast-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let t = crate::Tokenizer::from_files(&path, None).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(t.fast_path_unsupported().unwrap().contains("NFKC"));
        let text = "ﬁne ① <|im_start|>x";
        assert_eq!(t.encode(text).unwrap(), t.encode_reference(text).unwrap());
        assert_eq!(t.segment_cache_stats().lookups, 0);
    }
}
