//! Answers of both endpoints, whole or streamed: what a worker writes and
//! what the router and the load generator read.
//!
//! The types borrow their strings: a writer points them at what it already
//! holds, a reader at the JSON text it reads (a string with escapes is
//! unescaped into its own copy). A reader picks how `choices` is held (see
//! [`Completion`]), so the router's stream reader, with the types a worker
//! writes, keeps one choice and copies nothing.

use super::lenient::object_or_none;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use std::borrow::Cow;

/// One answer, whole or one streamed chunk: a `text_completion`,
/// `chat.completion` or `chat.completion.chunk` object (`object` says
/// which). Writers fill what their shape has; a reader gets defaults for
/// what a chunk lacks, and an error for fields of the wrong type (a chunk
/// it cannot read). `choices` is the one required field.
///
/// `C` holds `choices`: every [`Choice`] by default; a reader that needs
/// fewer gives its own sequence type (it must still read every element as
/// a [`Choice`] for the same errors). A value read borrows from the text:
/// read it with `serde_json::from_str` or `from_slice` (`from_value` and
/// `from_reader` need a type that owns its strings).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Completion<'a, C = Vec<Choice<'a>>> {
    /// `cmpl-…` or `chatcmpl-…`; the same in every chunk of a stream.
    #[serde(default, borrow)]
    pub id: Cow<'a, str>,
    /// `text_completion`, `chat.completion` or `chat.completion.chunk`.
    #[serde(default, borrow)]
    pub object: Cow<'a, str>,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model that answered.
    #[serde(default, borrow)]
    pub model: Cow<'a, str>,
    /// One choice per `n` (and per prompt of a batch); empty in the usage
    /// chunk of a stream.
    pub choices: C,
    /// Token counts: in a whole answer, and in the last chunk of a stream
    /// that asked for `include_usage`. A value that is not an object reads
    /// as `None`.
    #[serde(
        default,
        deserialize_with = "object_or_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub usage: Option<Usage>,
}

impl<C: Serialize> Completion<'_, C> {
    /// The answer as JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self)
            .expect("an answer is strings, numbers and string-keyed maps: it serializes")
    }
}

/// One choice. A completion choice has `text`; a whole chat answer has
/// `message`; a chat chunk has `delta`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice<'a> {
    /// Which choice (of `n`) this is.
    #[serde(default)]
    pub index: u32,
    /// New text (completions).
    #[serde(
        default,
        borrow,
        deserialize_with = "optional_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub text: Option<Cow<'a, str>>,
    /// The whole answer (chat, not streamed).
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    pub message: Option<ChoiceMessage<'a>>,
    /// New text (chat, streamed).
    #[serde(default, borrow, skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChoiceDelta<'a>>,
    /// Written as `null`: no log-probabilities are produced. Ignored when
    /// read.
    #[serde(skip_deserializing)]
    pub logprobs: (),
    /// `length`, `stop`, ... once the choice is complete; `null` before.
    #[serde(default, borrow, deserialize_with = "optional_text")]
    pub finish_reason: Option<Cow<'a, str>>,
    /// Token ids of the new text, when asked for (vLLM's
    /// `return_token_ids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

impl Choice<'_> {
    /// The choice's new text, whichever shape carries it (`text`,
    /// `delta.content`, `message.content`).
    pub fn content(&self) -> Option<&str> {
        self.text
            .as_deref()
            .or_else(|| self.delta.as_ref()?.content.as_deref())
            .or_else(|| self.message.as_ref()?.content.as_deref())
    }
}

/// A whole chat answer's message.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChoiceMessage<'a> {
    /// `assistant`.
    #[serde(default, borrow)]
    pub role: Cow<'a, str>,
    /// The text; `null` when the answer is something else (a tool call).
    #[serde(default, borrow, deserialize_with = "optional_text")]
    pub content: Option<Cow<'a, str>>,
}

/// What one chat chunk adds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChoiceDelta<'a> {
    /// `assistant`, in the first chunk.
    #[serde(
        default,
        borrow,
        deserialize_with = "optional_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub role: Option<Cow<'a, str>>,
    /// New text.
    #[serde(
        default,
        borrow,
        deserialize_with = "optional_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub content: Option<Cow<'a, str>>,
}

/// A string or `null`, borrowed from the input when it has no escapes.
/// (`#[serde(borrow)]` alone borrows a bare `Cow<str>`, not one inside an
/// `Option`, which it would always copy.)
fn optional_text<'de: 'a, 'a, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Cow<'a, str>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(transparent)]
    struct Text<'a>(#[serde(borrow)] Cow<'a, str>);
    Ok(Option::<Text<'a>>::deserialize(deserializer)?.map(|Text(text)| text))
}

/// Token counts of a request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Their sum.
    #[serde(default)]
    pub total_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// Fields this type does not name (an engine's own counts), kept so
    /// that a usage read, adjusted and written again passes them on.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl Usage {
    /// The counts of a request of `prompt_tokens` that generated
    /// `completion_tokens`, `cached_tokens` of its prompt from the cache.
    pub fn new(prompt_tokens: u64, cached_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
            other: Map::new(),
        }
    }

    /// This usage with the prompt and completion counts replaced (and the
    /// total their saturating sum); everything else kept.
    pub fn with_counts(&self, prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            ..self.clone()
        }
    }
}

/// `usage.completion_tokens` of a whole (not streamed) answer's JSON text;
/// 0 when it has no usage or cannot be read (not JSON, or `usage` or the
/// count of another type). Only that count is read: the rest of the
/// answer is skipped, nothing copied.
pub fn completion_tokens(answer: &[u8]) -> u64 {
    #[derive(Deserialize)]
    struct Counts {
        #[serde(default)]
        completion_tokens: u64,
    }
    #[derive(Deserialize)]
    struct Answer {
        usage: Option<Counts>,
    }
    serde_json::from_slice::<Answer>(answer)
        .ok()
        .and_then(|answer| answer.usage)
        .map_or(0, |usage| usage.completion_tokens)
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: u64,
}
