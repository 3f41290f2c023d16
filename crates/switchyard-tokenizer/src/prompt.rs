//! A prompt as the router tokenizes it for routing: the
//! [`PromptTokenizer`] seam (text and chats to token ids within a budget,
//! pausing between pieces of a long text), its implementation on this
//! crate's [`Tokenizer`] ([`HfTokenizer`]), and a chat prompt's size as
//! rendered, estimated without rendering ([`ChatPrompt`]): what decides
//! where a prompt is tokenized, and what a model without a tokenizer is
//! routed by.
//!
//! The router's ids must equal the engine's so that its block hashes
//! match the engine's KV events: a chat is rendered with the model's
//! template, its declared tools and an assistant's tool calls included
//! where the template reads them; what the template does not render is
//! counted by its bytes ([`ChatPrompt::unrendered_by`]).

use crate::{ChatMessage, Tokenizer, TokenizerError};

/// What a chat template adds to each message, at least as much as the
/// bundled ChatML template does: `<|im_start|>`, the role, a newline,
/// `<|im_end|>` and a newline are 25 bytes besides the role.
pub const TEMPLATE_BYTES_PER_MESSAGE: usize = 32;

/// The size of `messages` as a chat template renders them, estimated
/// without rendering: contents, roles and [`TEMPLATE_BYTES_PER_MESSAGE`]
/// each. A million empty messages are tens of megabytes of template text
/// to render and tokenize: sized so, they are treated as the long prompt
/// they are.
pub fn rendered_size_estimate(messages: &[ChatMessage]) -> usize {
    messages.iter().fold(0usize, |size, m| {
        size.saturating_add(m.content.len())
            .saturating_add(m.reasoning.as_ref().map_or(0, String::len))
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

/// A chat prompt as the engine renders it: its messages (with their tool
/// calls), the tools it declares, and the bytes of what it carries that
/// no message does (reasoning, other items).
#[derive(Clone, Debug, Default)]
pub struct ChatPrompt {
    /// The messages, in order.
    pub messages: Vec<ChatMessage>,
    /// The tools it declares (the chat API's list), if any.
    pub tools: Option<serde_json::Value>,
    /// Bytes the engine renders that no message carries.
    pub unrendered_bytes: usize,
}

impl ChatPrompt {
    /// The tools' JSON size (0 for none).
    fn tools_size(&self) -> usize {
        self.tools
            .as_ref()
            .and_then(|t| serde_json::to_vec(t).ok())
            .map_or(0, |t| t.len())
    }

    /// Its size as rendered, estimated (messages, tool calls and tools):
    /// what decides where it is tokenized, and a model without a
    /// tokenizer's estimate.
    pub fn rendered_size(&self) -> usize {
        rendered_size_estimate(&self.messages).saturating_add(self.tools_size())
    }

    /// The bytes `tokenizer` will not render into ids: what no message
    /// carries, and the tools and tool calls its template does not read.
    pub fn unrendered_by(&self, tokenizer: &dyn PromptTokenizer) -> usize {
        let mut bytes = self.unrendered_bytes;
        if !tokenizer.renders_tools() {
            bytes = bytes.saturating_add(self.tools_size());
        }
        if !tokenizer.renders_tool_calls() {
            let calls = self.messages.iter().map(tool_calls_size);
            bytes = calls.fold(bytes, usize::saturating_add);
        }
        bytes
    }

    /// Its ids with `tokenizer` when at most `max_tokens`, `None` when
    /// longer ([`PromptTokenizer::encode_chat_with_tools_within`]).
    pub fn encode_within(
        &self,
        tokenizer: &dyn PromptTokenizer,
        max_tokens: usize,
        pause: Pause<'_>,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        tokenizer.encode_chat_with_tools_within(
            &self.messages,
            self.tools.as_ref(),
            max_tokens,
            pause,
        )
    }
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
    pub segments: crate::segment_cache::SegmentCacheStats,
    /// Times a thread's word cache was emptied when full.
    pub word_cache_clears: u64,
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
            word_cache_clears: crate::fast::word_cache_clears(),
        })
    }
}
