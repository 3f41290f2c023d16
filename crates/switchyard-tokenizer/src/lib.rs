//! A real tokenizer for Switchyard: a Hugging Face `tokenizer.json` and the
//! chat template of its `tokenizer_config.json`.
//!
//! - [`Tokenizer::encode`] turns text into token ids: on the fast path
//!   ([`fast`]) for the byte-level BPE family of the bundled Qwen3
//!   tokenizer, with the `tokenizers` crate's ids (tested on every message
//!   of the bundled ShareGPT trace and on random Unicode); through the
//!   `tokenizers` crate itself (pure Rust with `fancy-regex`; no C build)
//!   for any other `tokenizer.json`, with a log line saying why.
//! - [`segment_cache`] keeps the ids of text between special tokens, so a
//!   conversation's earlier messages are tokenized once, not every turn.
//! - [`Tokenizer::apply_chat_template`] renders OpenAI-style messages with the
//!   model's Jinja template (`minijinja` plus `minijinja-contrib`'s Python
//!   method compatibility, which templates rely on for `.startswith`,
//!   `.split`, `.strip` and friends).
//! - [`Tokenizer::word_vocabulary`] ([`words`]) picks the vocabulary's word
//!   tokens (`" the"`, `" river"`; a WordPiece vocabulary's whole words
//!   `"the"`, `"river"`, written with a space in front) that any sequence
//!   of re-encodes to itself: what the simulated engine generates, so a
//!   client counting the text's tokens counts the ids the engine reported.
//!
//! The router and the simulated engine share this crate so that both hash
//! the same token ids for the same prompt. The repository bundles the Qwen3
//! tokenizer under `data/tokenizers/`; `build.rs` compiles it into this
//! crate, so [`Tokenizer::bundled`] reads no file unless
//! [`Tokenizer::override_dir`] names another copy.

#![warn(missing_docs)]

// Loading: `Tokenizer::bundled` (compiled in, or `override_dir`),
// `Tokenizer::from_dir` (a model directory, HF or bundled file names),
// `Tokenizer::from_files`.
//
// Modules:
// - `bpe`: byte-level BPE merges over one pre-tokenized piece.
// - `pretokenize`: the Qwen2/Qwen3 split pattern, without a regex engine.
// - `fast`: the fast path's pipeline (added tokens, NFC, split, BPE) and
//   what it accepts.
// - `segment_cache`: bounded cache of segments' ids.
// - `words`: word tokens that round-trip in any sequence.
// - `render`: a conversation as vLLM hands it to the template (tool-call
//   arguments parsed, Claude Code's billing-header line dropped);
//   `pyjson`: the template's `tojson` as Python's `json.dumps` writes it.
// - `prompt`: the router's seam (`PromptTokenizer`: ids within a budget,
//   pausing between pieces) on this crate's `Tokenizer`, and a chat
//   prompt's rendered size, estimated (`ChatPrompt`).
// - `hub` (feature `hub`): a tokenizer's directory from the Hugging Face
//   Hub cache, downloaded into it when allowed.
pub mod bpe;
pub mod fast;
#[cfg(feature = "hub")]
pub mod hub;
pub mod pretokenize;
pub mod prompt;
pub mod pyjson;
pub mod render;
pub mod segment_cache;
pub mod words;

use fast::{FastBpe, Segment};
use segment_cache::{SegmentCache, SegmentCacheStats};
pub use words::{WordVocabulary, WordVocabularyError};

use serde::{Deserialize, Serialize};
use std::io::Read as _;
use std::path::{Path, PathBuf};

/// File name of the bundled vocabulary.
pub const BUNDLED_TOKENIZER: &str = "qwen3-tokenizer.json";
/// File name of the bundled tokenizer config (chat template).
pub const BUNDLED_CONFIG: &str = "qwen3-tokenizer_config.json";
/// File name of the vocabulary in a Hugging Face model directory.
pub const HF_TOKENIZER: &str = "tokenizer.json";
/// File name of the tokenizer config (chat template) in a Hugging Face
/// model directory.
pub const HF_CONFIG: &str = "tokenizer_config.json";

/// The bundled `tokenizer.json`, gzipped from `data/tokenizers/` by
/// `build.rs` (2 MB in the binary instead of 11).
static EMBEDDED_TOKENIZER_GZ: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/qwen3-tokenizer.json.gz"));
/// The bundled tokenizer config as it is in `data/tokenizers/` (10 kB).
static EMBEDDED_CONFIG: &str = include_str!("../../../data/tokenizers/qwen3-tokenizer_config.json");
/// How errors and logs name the compiled-in copies.
const EMBEDDED_TOKENIZER_NAME: &str = "(built in) qwen3-tokenizer.json";
const EMBEDDED_CONFIG_NAME: &str = "(built in) qwen3-tokenizer_config.json";

/// One chat message. Contents never leave the request path.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant's tool calls (rendered by templates that read
    /// `message.tool_calls`); left out of the template's view when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// An assistant's reasoning, handed to the template as
    /// `reasoning_content` (and `reasoning`), as vLLM hands it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A message of text alone.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            reasoning: None,
        }
    }
}

/// One tool call of an assistant message, in the chat API's shape
/// (`{"type": "function", "function": {"name", "arguments"}}`), the
/// shape chat templates read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function called.
    pub function: FunctionCall,
}

impl ToolCall {
    /// A call of function `name` with `arguments` (JSON text).
    pub fn function(name: impl Into<String>, arguments: impl Into<String>) -> Self {
        Self {
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// A tool call's function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments, as JSON text (rendered as they are).
    pub arguments: String,
}

/// Loading or using the tokenizer failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or parsed.
    #[error("loading {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A directory holds none of the vocabulary files
    /// [`Tokenizer::from_dir`] looks for.
    #[error("no tokenizer in {dir}: looked for {}", .looked_for.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" and "))]
    NotFound {
        /// The directory.
        dir: PathBuf,
        /// Every path tried, in order.
        looked_for: Vec<PathBuf>,
    },
    /// The tokenizer has no chat template: a chat request cannot be
    /// rendered (a text prompt can).
    #[error(
        "this model's tokenizer has no chat template (no chat_template in its \
         tokenizer_config.json, or no tokenizer_config.json): send a text prompt \
         to /v1/completions instead"
    )]
    NoChatTemplate,
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
    /// The chat template failed to render (bad messages, usually).
    #[error("chat template: {0}")]
    Template(String),
}

/// A tokenizer with its chat template. Cheap to share behind an `Arc`;
/// every method takes `&self`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The fast path, or why this vocabulary cannot take it.
    fast: Result<FastBpe, String>,
    cache: SegmentCache,
    env: minijinja::Environment<'static>,
    has_template: bool,
    /// The template reads `tools` / `message.tool_calls` (else a caller
    /// must count what it would not render some other way).
    renders_tools: bool,
    renders_tool_calls: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("has_template", &self.has_template)
            .field("fast_path", &self.fast.is_ok())
            .field("segment_cache", &self.cache.stats())
            .finish()
    }
}

#[derive(Deserialize)]
struct TokenizerConfig {
    chat_template: Option<ChatTemplate>,
}

/// A config's `chat_template`: one template, or named ones (of which
/// transformers renders `default` when no name is asked for).
#[derive(Deserialize)]
#[serde(untagged)]
enum ChatTemplate {
    One(String),
    Named(Vec<NamedChatTemplate>),
}

#[derive(Deserialize)]
struct NamedChatTemplate {
    name: String,
    template: String,
}

impl ChatTemplate {
    /// The template chat requests render.
    fn into_default(self) -> Option<String> {
        match self {
            Self::One(template) => Some(template),
            Self::Named(named) => named
                .into_iter()
                .find(|t| t.name == "default")
                .map(|t| t.template),
        }
    }
}

impl Tokenizer {
    /// The directory that replaces the bundled tokenizer:
    /// `$SWITCHYARD_TOKENIZER_DIR`, else `$SWITCHYARD_DATA/tokenizers`;
    /// `None` when neither is set.
    pub fn override_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("SWITCHYARD_TOKENIZER_DIR") {
            return Some(PathBuf::from(dir));
        }
        std::env::var_os("SWITCHYARD_DATA").map(|data| PathBuf::from(data).join("tokenizers"))
    }

    /// Loads the bundled Qwen3 tokenizer: from [`Self::override_dir`] when
    /// one is set, else the copy compiled into this crate (so a built
    /// binary needs no data directory at run time).
    pub fn bundled() -> Result<Self, TokenizerError> {
        match Self::override_dir() {
            Some(dir) => Self::from_files(
                &dir.join(BUNDLED_TOKENIZER),
                Some(&dir.join(BUNDLED_CONFIG)),
            ),
            None => Self::from_json(
                &Self::bundled_json(),
                Path::new(EMBEDDED_TOKENIZER_NAME),
                Some((EMBEDDED_CONFIG, Path::new(EMBEDDED_CONFIG_NAME))),
            ),
        }
    }

    /// The text of the compiled-in `tokenizer.json` (inflated on each call;
    /// some 11 MB), e.g. to load the `tokenizers` crate on the same
    /// vocabulary.
    pub fn bundled_json() -> String {
        let mut json = String::with_capacity(12 << 20);
        flate2::read::GzDecoder::new(EMBEDDED_TOKENIZER_GZ)
            .read_to_string(&mut json)
            .expect("the embedded tokenizer is gzipped UTF-8 (build.rs)");
        json
    }

    /// The text of the compiled-in `tokenizer_config.json` (the Qwen3 chat
    /// template), e.g. to lay the bundled tokenizer out as a model
    /// directory beside [`Self::bundled_json`].
    pub fn bundled_config_json() -> &'static str {
        EMBEDDED_CONFIG
    }

    /// Loads the tokenizer of a model directory: Hugging Face's names,
    /// [`HF_TOKENIZER`] with [`HF_CONFIG`], else the bundled names,
    /// [`BUNDLED_TOKENIZER`] with [`BUNDLED_CONFIG`] (a directory laid out
    /// like `data/tokenizers/`). A config goes with the vocabulary of its
    /// own naming, and may be missing: then there is no chat template
    /// ([`TokenizerError::NoChatTemplate`] on chat requests, text prompts
    /// work). No vocabulary under either name is
    /// [`TokenizerError::NotFound`], naming the paths looked for.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let (tokenizer_json, config_json) = Self::dir_files(dir)?;
        if config_json.is_none() {
            tracing::info!(
                dir = %dir.display(),
                "tokenizer: no tokenizer config beside {}; no chat template",
                tokenizer_json.display()
            );
        }
        Self::from_files(&tokenizer_json, config_json.as_deref())
    }

    /// The files [`Self::from_dir`] loads from `dir`: the vocabulary and,
    /// when present, its config.
    pub fn dir_files(dir: &Path) -> Result<(PathBuf, Option<PathBuf>), TokenizerError> {
        let pairs = [
            (HF_TOKENIZER, HF_CONFIG),
            (BUNDLED_TOKENIZER, BUNDLED_CONFIG),
        ];
        for (tokenizer, config) in pairs {
            let tokenizer = dir.join(tokenizer);
            if tokenizer.is_file() {
                let config = Some(dir.join(config)).filter(|path| path.is_file());
                return Ok((tokenizer, config));
            }
        }
        Err(TokenizerError::NotFound {
            dir: dir.to_owned(),
            looked_for: pairs.iter().map(|(t, _)| dir.join(t)).collect(),
        })
    }

    /// Loads `tokenizer.json` and, when given, the chat template of
    /// `tokenizer_config.json` (a config without `chat_template` leaves
    /// the tokenizer without one, as a missing config does).
    pub fn from_files(
        tokenizer_json: &Path,
        config_json: Option<&Path>,
    ) -> Result<Self, TokenizerError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|e| TokenizerError::Load {
                path: path.to_owned(),
                reason: e.to_string(),
            })
        };
        let json = read(tokenizer_json)?;
        let config = config_json.map(|path| read(path).map(|text| (text, path)));
        let config = config.transpose()?;
        Self::from_json(
            &json,
            tokenizer_json,
            config.as_ref().map(|(text, path)| (text.as_str(), *path)),
        )
    }

    /// Loads a `tokenizer.json`'s text and, when given, the chat template
    /// of a `tokenizer_config.json`'s text; the paths name them in errors
    /// and logs.
    fn from_json(
        json: &str,
        tokenizer_json: &Path,
        config: Option<(&str, &Path)>,
    ) -> Result<Self, TokenizerError> {
        let load_error = |reason: String| TokenizerError::Load {
            path: tokenizer_json.to_owned(),
            reason,
        };
        let mut inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e: tokenizers::Error| load_error(e.to_string()))?;
        // Prompts are counted and hashed as they are: a `tokenizer.json`
        // saved with padding or truncation (an embedding model's, such as
        // a BERT's padded to 128) would pad short prompts and cut long
        // ones. Clients (transformers) encode without them unless asked.
        if inner.get_padding().is_some() || inner.get_truncation().is_some() {
            tracing::info!(
                path = %tokenizer_json.display(),
                "tokenizer: ignoring the padding and truncation saved in tokenizer.json"
            );
            inner.with_padding(None);
            inner
                .with_truncation(None)
                .map_err(|e| load_error(e.to_string()))?;
        }
        let fast = FastBpe::from_json(json);
        match &fast {
            Ok(_) => {
                tracing::debug!(path = %tokenizer_json.display(), "tokenizer: fast byte-level BPE path")
            }
            Err(reason) => tracing::warn!(
                path = %tokenizer_json.display(),
                %reason,
                "tokenizer: the fast path does not support this tokenizer.json; using the tokenizers crate (slower)"
            ),
        }
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // `tojson` as transformers (and so vLLM) defines it.
        env.add_filter("tojson", pyjson::tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let mut has_template = false;
        let (mut renders_tools, mut renders_tool_calls) = (false, false);
        if let Some((text, path)) = config {
            let config: TokenizerConfig =
                serde_json::from_str(text).map_err(|e| TokenizerError::Load {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
            match config.chat_template.and_then(ChatTemplate::into_default) {
                Some(template) => {
                    renders_tools = template.contains("tools");
                    renders_tool_calls = template.contains("tool_calls");
                    env.add_template_owned("chat", template)
                        .map_err(|e| TokenizerError::Template(e.to_string()))?;
                    has_template = true;
                }
                None => tracing::info!(
                    path = %path.display(),
                    "tokenizer: the config has no (default) chat_template; chat requests will be refused"
                ),
            }
        }
        Ok(Self {
            inner,
            fast,
            cache: SegmentCache::new(segment_cache::DEFAULT_CAPACITY_IDS),
            env,
            has_template,
            renders_tools,
            renders_tool_calls,
        })
    }

    /// Replaces the segment cache with one of `capacity_ids` ids (`0`:
    /// none).
    pub fn with_segment_cache(mut self, capacity_ids: u64) -> Self {
        self.cache = SegmentCache::new(capacity_ids);
        self
    }

    /// Why this tokenizer runs on the `tokenizers` crate rather than the
    /// fast path; `None` on the fast path.
    pub fn fast_path_unsupported(&self) -> Option<&str> {
        self.fast.as_ref().err().map(String::as_str)
    }

    /// What the segment cache has done (all zero off the fast path).
    pub fn segment_cache_stats(&self) -> SegmentCacheStats {
        self.cache.stats()
    }

    /// Token ids of `text`. Special tokens written in the text (such as
    /// `<|im_start|>`) map to their ids; no BOS is added. On the fast
    /// path, text between special tokens that was seen before comes from
    /// the segment cache.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, &mut ids)?;
        Ok(ids)
    }

    /// [`Self::encode`], appending the ids to `ids`.
    fn encode_into(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let Ok(fast) = &self.fast else {
            ids.extend(self.encode_reference(text)?);
            return Ok(());
        };
        for segment in fast.segments(text) {
            match segment {
                Segment::Added(id) => ids.push(id),
                Segment::Text(text) => self
                    .cache
                    .encode_with(text, ids, |t, out| fast.encode_text(t, out)),
            }
        }
        Ok(())
    }

    /// Token ids of `text` from the `tokenizers` crate, whatever the path:
    /// the reference the fast path is held to.
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// [`Self::encode`] within a budget: the ids of `text` when it is at
    /// most `max_tokens` long, `None` when longer. A long text is encoded
    /// piece by piece ([`pieces`], [`PIECE_BYTES`] at a time) and the
    /// count stops at the first piece past the budget, so the memory and
    /// time spent on a text far over it are those of the budget, not of
    /// the text (encoding costs some 100 bytes per byte of text at once).
    /// The pieces end where the pre-tokenizer ends a word, so their ids
    /// are the whole text's; only a run of [`PIECE_BYTES`] with no space
    /// or newline is cut elsewhere (there, ids may differ from an
    /// engine's: the router's prefix hashes, not the count, are affected).
    pub fn encode_within(
        &self,
        text: &str,
        max_tokens: usize,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        encode_pieces(text, PIECE_BYTES, max_tokens, &mut |_| {}, |piece, ids| {
            self.encode_into(piece, ids)
        })
    }

    /// [`Self::encode_within`], calling `pause` between pieces with the
    /// bytes of `text` encoded so far: where a caller sharing the CPU in
    /// turn can let another job go first ([`PAUSE_BYTES`] at a time).
    pub fn encode_within_pausing(
        &self,
        text: &str,
        max_tokens: usize,
        pause: &mut dyn FnMut(usize),
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        encode_pieces(text, PAUSE_BYTES, max_tokens, pause, |piece, ids| {
            self.encode_into(piece, ids)
        })
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Renders `messages` with the chat template, ending with the assistant
    /// turn's opening when `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// Whether the chat template renders a request's tool definitions
    /// (it reads `tools`).
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    /// Whether the chat template renders an assistant's tool calls (it
    /// reads `tool_calls`).
    pub fn renders_tool_calls(&self) -> bool {
        self.renders_tool_calls
    }

    /// [`Self::apply_chat_template`] with the request's tool definitions
    /// (a list in the chat API's shape, `{"type": "function", "function":
    /// {...}}`), as engines render a chat request that declares tools.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        if !self.has_template {
            return Err(TokenizerError::NoChatTemplate);
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        // Rendered into a buffer sized for the whole text up front: grown
        // by doubling, a 200 KB prompt's buffer was copied about five times
        // into fresh pages the kernel zeroes first (about 3% of the
        // router's CPU on agent sessions, in a `perf` profile of `serve`).
        let mut out = Vec::with_capacity(rendered_size_hint(messages, tools));
        template
            .render_captured_to(
                minijinja::context! {
                    messages => render::TemplateMessages(messages),
                    add_generation_prompt => add_generation_prompt,
                    tools => tools.map_or(minijinja::Value::from(()), minijinja::Value::from_serialize),
                },
                &mut out,
            )
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        String::from_utf8(out).map_err(|e| TokenizerError::Template(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// About how many bytes a chat template renders `messages` and `tools`
/// to: their texts plus a little markup for each message and call, and
/// 512 bytes a tool definition (guessed, not serialized to measure it;
/// at most `TOOLS_HINT_MAX` in all, so that a list of many empty tools
/// cannot reserve far more than its bytes). A hint for a buffer's
/// capacity, nothing more.
fn rendered_size_hint(messages: &[ChatMessage], tools: Option<&serde_json::Value>) -> usize {
    const MARKUP: usize = 64;
    const TOOLS_HINT_MAX: usize = 256 * 1024;
    let texts: usize = messages
        .iter()
        .map(|m| {
            m.content.len()
                + MARKUP
                + m.tool_calls
                    .iter()
                    .map(|c| c.function.name.len() + c.function.arguments.len() + MARKUP)
                    .sum::<usize>()
        })
        .sum();
    let tools = tools
        .and_then(serde_json::Value::as_array)
        .map_or(0, |list| list.len().saturating_mul(512).min(TOOLS_HINT_MAX));
    texts + tools + 1024
}

/// The size of the pieces [`Tokenizer::encode_within`] encodes at a time.
pub const PIECE_BYTES: usize = 64 * 1024;

/// The size of the pieces between the pauses of
/// [`Tokenizer::encode_within_pausing`]: about 0.1 ms of tokenizing on
/// the 2-core VM (200 KB of fresh words took 1.5 ms), the longest a light
/// tenant's prompt waits for a noisy one's under way. Pieces end where
/// words do ([`pieces`]), so the ids are the whole text's whatever the
/// size, but for a run this long without a space or a newline.
pub const PAUSE_BYTES: usize = 16 * 1024;

/// `encode` (which appends a piece's ids to the list) over the [`pieces`]
/// of `text`, stopping at the first piece that takes the count past
/// `max_tokens` (`None`).
fn encode_pieces(
    text: &str,
    piece_bytes: usize,
    max_tokens: usize,
    pause: &mut dyn FnMut(usize),
    mut encode: impl FnMut(&str, &mut Vec<u32>) -> Result<(), TokenizerError>,
) -> Result<Option<Vec<u32>>, TokenizerError> {
    // About 4 bytes a token in English and code; sized once, so that a long
    // text's ids are not copied into ever larger fresh buffers.
    let mut ids = Vec::with_capacity((text.len() / 4).min(max_tokens.saturating_add(1)));
    let mut done = 0;
    for piece in pieces(text, piece_bytes) {
        if done > 0 {
            pause(done);
        }
        done += piece.len();
        encode(piece, &mut ids)?;
        if ids.len() > max_tokens {
            return Ok(None);
        }
    }
    Ok(Some(ids))
}

/// `text` cut into pieces of at most `max_bytes` (at least one character)
/// where a byte-level BPE pre-tokenizer of the GPT-2/Qwen family ends a
/// word, so that encoding the pieces one by one gives the whole text's ids:
/// after a newline followed by a non-space, or before a single space
/// between two non-spaces. A stretch of `max_bytes` with neither is cut at
/// a character boundary. No special token holds a space or a newline, so
/// none is cut.
pub fn pieces(text: &str, max_bytes: usize) -> impl Iterator<Item = &str> {
    let max_bytes = max_bytes.max(8);
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        if rest.len() <= max_bytes {
            return Some(std::mem::take(&mut rest));
        }
        let mut limit = max_bytes;
        while !rest.is_char_boundary(limit) {
            limit -= 1;
        }
        let cut = word_end_before(rest, limit).unwrap_or(if limit > 0 {
            limit
        } else {
            rest.chars().next().map_or(rest.len(), char::len_utf8)
        });
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// The last place at or before `limit` (a char boundary, not 0) where a
/// word ends in `text`; see [`pieces`].
fn word_end_before(text: &str, limit: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let starts_non_space = |at: usize| {
        text[at..]
            .chars()
            .next()
            .is_some_and(|c| !c.is_whitespace())
    };
    let ends_non_space = |at: usize| {
        text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| !c.is_whitespace())
    };
    (1..=limit).rev().find(|&at| {
        if !text.is_char_boundary(at) || at >= text.len() {
            return false;
        }
        let after_newline = bytes[at - 1] == b'\n' && starts_non_space(at);
        let single_space = bytes[at] == b' ' && ends_non_space(at) && starts_non_space(at + 1);
        after_newline || single_space
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn tokenizer() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::bundled().expect("bundled tokenizer loads"))
    }

    #[test]
    fn the_built_in_tokenizer_is_the_repositorys_file() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/tokenizers/qwen3-tokenizer.json"
        );
        assert!(
            Tokenizer::bundled_json() == std::fs::read_to_string(path).unwrap(),
            "the built-in tokenizer differs from {path}"
        );
    }

    #[test]
    fn the_bundled_vocabulary_has_qwen3s_size() {
        assert_eq!(tokenizer().vocab_size(), 151_669);
    }

    #[test]
    fn text_round_trips_through_encode_and_decode() {
        let t = tokenizer();
        let ids = t
            .encode("Hello, world! Switchyard routes requests.")
            .unwrap();
        assert!(!ids.is_empty());
        assert_eq!(
            t.decode(&ids).unwrap(),
            "Hello, world! Switchyard routes requests."
        );
    }

    #[test]
    fn special_tokens_in_text_map_to_their_ids() {
        let ids = tokenizer().encode("<|im_start|>user").unwrap();
        assert_eq!(ids[0], 151_644);
    }

    #[test]
    fn the_chat_template_renders_system_user_and_generation_prompt() {
        let messages = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
                tool_calls: Vec::new(),
                reasoning: None,
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
                tool_calls: Vec::new(),
                reasoning: None,
            },
        ];
        let text = tokenizer().apply_chat_template(&messages, true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tools_and_tool_calls_render_as_the_template_spells_them() {
        let t = tokenizer();
        assert!(t.renders_tools() && t.renders_tool_calls());
        let messages = vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Weather?"),
            ChatMessage {
                // Compact, as a JavaScript client writes it: the template
                // writes the object as Python does, as vLLM renders it.
                tool_calls: vec![ToolCall::function("weather", r#"{"city":"Oslo"}"#)],
                ..ChatMessage::text("assistant", "")
            },
            ChatMessage::text("tool", "rain"),
        ];
        let tools = serde_json::json!([{"type": "function", "function": {"name": "weather"}}]);
        let text = t
            .apply_chat_template_with_tools(&messages, Some(&tools), true)
            .unwrap();
        assert!(
            text.starts_with("<|im_start|>system\nBe brief.\n\n# Tools\n"),
            "{text}"
        );
        assert!(
            text.contains(r#"{"type": "function", "function": {"name": "weather"}}"#),
            "{text}"
        );
        assert!(
            text.contains("<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
            "{text}"
        );
        assert!(
            text.contains("<tool_response>\nrain\n</tool_response>"),
            "{text}"
        );
        // Without tools the system turn is as before.
        let plain = t.apply_chat_template(&messages, true).unwrap();
        assert!(plain.starts_with("<|im_start|>system\nBe brief.<|im_end|>"));
    }

    #[test]
    fn assistant_turns_with_thinking_use_python_string_methods() {
        let messages = vec![
            ChatMessage {
                role: "user".into(),
                content: "Q".into(),
                tool_calls: Vec::new(),
                reasoning: None,
            },
            ChatMessage {
                role: "assistant".into(),
                content: "<think>\nhmm\n</think>\n\nA".into(),
                tool_calls: Vec::new(),
                reasoning: None,
            },
            ChatMessage {
                role: "user".into(),
                content: "Q2".into(),
                tool_calls: Vec::new(),
                reasoning: None,
            },
        ];
        let text = tokenizer().apply_chat_template(&messages, false).unwrap();
        assert!(
            text.contains("<|im_start|>assistant\nA<|im_end|>"),
            "{text}"
        );
    }

    #[test]
    fn pieces_cut_where_words_end_and_encode_as_the_whole_text() {
        let t = tokenizer();
        let texts = [
            "Hello, world! Switchyard routes requests.\nA second line,  with  two spaces.\n\n\tTabbed: 12 345 6789.",
            "def f(x):\n    return x  # comment\n\nclass A:\n    pass\n",
            "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
            "naïve café 東京 タワー 🙂 emoji\u{301} e\u{301} ...!!! ''s 'll",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbbb",
            "                                     spaces       and\r\nCRLF\r\n lines",
        ];
        for text in texts {
            let whole = t.encode(text).unwrap();
            for max in [8, 13, 21, 40] {
                let pieces: Vec<&str> = pieces(text, max).collect();
                assert_eq!(pieces.concat(), text);
                let mut ids = Vec::new();
                for piece in &pieces {
                    ids.extend(t.encode(piece).unwrap());
                }
                // A stretch of `max` bytes with no word end is cut
                // anywhere: only texts without one may differ.
                let clean = pieces.iter().all(|p| p.len() < max)
                    || pieces
                        .windows(2)
                        .all(|w| w[0].ends_with('\n') || w[1].starts_with(' '));
                if clean {
                    assert_eq!(ids, whole, "{text:?} in pieces of {max}: {pieces:?}");
                }
            }
            assert_eq!(
                t.encode_within(text, whole.len()).unwrap(),
                Some(whole.clone())
            );
            assert_eq!(t.encode_within(text, whole.len() - 1).unwrap(), None);
        }
    }

    #[test]
    fn a_text_far_over_the_budget_is_refused_after_the_piece_that_passes_it() {
        let t = tokenizer();
        // 8 MiB of words: about two million tokens, 128 pieces.
        let text = "lorem ipsum dolor sit amet ".repeat(8 * 1024 * 1024 / 27);
        let mut encoded = Vec::new();
        let within = encode_pieces(&text, PIECE_BYTES, 10_000, &mut |_| {}, |piece, ids| {
            encoded.push(piece.len());
            ids.extend(t.encode(piece)?);
            Ok(())
        })
        .unwrap();
        assert_eq!(within, None);
        // A 64 KiB piece of these words is some 12 000 tokens: one or
        // two pieces of the 128 are encoded.
        assert!(encoded.len() <= 2, "{encoded:?}");
        assert!(encoded.iter().all(|&n| n <= PIECE_BYTES));
    }

    #[test]
    fn a_long_text_pauses_between_pieces_with_the_bytes_done_and_encodes_as_whole() {
        let t = tokenizer();
        let text = "the quick brown fox jumps over the lazy dog\n".repeat(200_000 / 44);
        let mut paused = Vec::new();
        let ids = t
            .encode_within_pausing(&text, usize::MAX, &mut |done| paused.push(done))
            .unwrap();
        assert_eq!(ids, Some(t.encode(&text).unwrap()));
        assert!(paused.len() >= text.len() / PAUSE_BYTES, "{paused:?}");
        assert!(
            paused.windows(2).all(|w| w[0] < w[1]) && paused.iter().all(|&d| d < text.len()),
            "{paused:?}"
        );
        assert!(paused[0] <= PAUSE_BYTES);
        let mut none = 0;
        t.encode_within_pausing("short", 10, &mut |_| none += 1)
            .unwrap();
        assert_eq!(none, 0, "one piece: no pause");
    }

    /// A fresh empty directory under the system's temp directory.
    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "switchyard-tokenizer-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A WordPiece (BERT) `tokenizer.json` of seven tokens, saved with
    /// truncation to 4 and padding to 8 as embedding models' are.
    const WORDPIECE: &str = r###"{
        "version": "1.0",
        "truncation": {"max_length": 4, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
                    "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
        "added_tokens": [
            {"id": 0, "special": true, "content": "[PAD]", "single_word": false,
             "lstrip": false, "rstrip": false, "normalized": false},
            {"id": 1, "special": true, "content": "[UNK]", "single_word": false,
             "lstrip": false, "rstrip": false, "normalized": false}
        ],
        "normalizer": {"type": "BertNormalizer", "clean_text": true,
                       "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100,
                  "vocab": {"[PAD]": 0, "[UNK]": 1, "the": 2, "river": 3, "run": 4, "##s": 5, ",": 6}}
    }"###;

    #[test]
    fn a_directory_with_hugging_faces_names_loads_with_its_chat_template() {
        let dir = temp_dir("hf-names");
        std::fs::write(dir.join(HF_TOKENIZER), Tokenizer::bundled_json()).unwrap();
        std::fs::write(dir.join(HF_CONFIG), EMBEDDED_CONFIG).unwrap();
        let t = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(t.vocab_size(), 151_669);
        assert!(t.fast_path_unsupported().is_none());
        let hi = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            tool_calls: Vec::new(),
            reasoning: None,
        }];
        assert_eq!(
            t.apply_chat_template(&hi, true).unwrap(),
            tokenizer().apply_chat_template(&hi, true).unwrap()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_directory_with_the_bundled_names_loads_when_hugging_faces_are_absent() {
        let dir = temp_dir("bundled-names");
        std::fs::write(dir.join(BUNDLED_TOKENIZER), Tokenizer::bundled_json()).unwrap();
        std::fs::write(dir.join(BUNDLED_CONFIG), EMBEDDED_CONFIG).unwrap();
        assert_eq!(
            Tokenizer::dir_files(&dir).unwrap(),
            (dir.join(BUNDLED_TOKENIZER), Some(dir.join(BUNDLED_CONFIG)))
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_directory_without_a_vocabulary_names_every_path_looked_for() {
        let dir = temp_dir("empty");
        // A config alone is no tokenizer.
        std::fs::write(dir.join(HF_CONFIG), EMBEDDED_CONFIG).unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, TokenizerError::NotFound { .. }), "{err:?}");
        for name in [HF_TOKENIZER, BUNDLED_TOKENIZER] {
            let path = dir.join(name).display().to_string();
            assert!(message.contains(&path), "{message} lacks {path}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_wordpiece_tokenizer_without_config_encodes_prompts_unpadded_and_uncut() {
        let dir = temp_dir("wordpiece");
        std::fs::write(dir.join(HF_TOKENIZER), WORDPIECE).unwrap();
        let t = Tokenizer::from_dir(&dir).unwrap();
        // Off the fast path (not byte-level BPE), on the tokenizers crate.
        assert!(t.fast_path_unsupported().is_some());
        let ids = t.encode("The river runs, the river").unwrap();
        assert_eq!(ids, [2, 3, 4, 5, 6, 2, 3]);
        assert_eq!(t.encode("river").unwrap(), [3]);
        assert_eq!(t.decode(&ids).unwrap(), "the river runs, the river");
        let hi = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            tool_calls: Vec::new(),
            reasoning: None,
        }];
        assert!(matches!(
            t.apply_chat_template(&hi, true),
            Err(TokenizerError::NoChatTemplate)
        ));
        // WordPiece decodes a word without its leading space: the word
        // tokens are its whole words of two letters or more, written with
        // a space in front, which its pre-tokenizer drops.
        let words = t.word_vocabulary(64).unwrap();
        assert!(words.space_added());
        assert_eq!(words.ids(), [2, 3, 4]);
        assert_eq!(words.text(3), Some(" river"));
        assert_eq!(words.text(5), None, "##s is no word");
        assert_eq!(t.encode(" river the run").unwrap(), [3, 2, 4]);
        assert_eq!(t.decode(&[3, 2, 4]).unwrap(), "river the run");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_config_without_chat_template_loads_without_one() {
        let dir = temp_dir("no-template");
        std::fs::write(dir.join(HF_TOKENIZER), WORDPIECE).unwrap();
        std::fs::write(
            dir.join(HF_CONFIG),
            r#"{"do_lower_case": true, "tokenizer_class": "BertTokenizer"}"#,
        )
        .unwrap();
        let t = Tokenizer::from_dir(&dir).unwrap();
        let err = t.apply_chat_template(&[], true).unwrap_err();
        assert!(err.to_string().contains("/v1/completions"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn of_named_chat_templates_the_default_one_is_rendered() {
        let config = r#"{"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
        ]}"#;
        let t = Tokenizer::from_json(
            WORDPIECE,
            Path::new("tokenizer.json"),
            Some((config, Path::new("tokenizer_config.json"))),
        )
        .unwrap();
        let hi = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            tool_calls: Vec::new(),
            reasoning: None,
        }];
        assert_eq!(t.apply_chat_template(&hi, true).unwrap(), "Hi");
    }

    #[test]
    fn a_missing_file_is_a_load_error() {
        let err =
            Tokenizer::from_files(Path::new("/nonexistent/tokenizer.json"), None).unwrap_err();
        assert!(matches!(err, TokenizerError::Load { .. }));
    }
}
