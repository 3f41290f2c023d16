//! Request bodies of `/v1/completions` and `/v1/chat/completions`: the
//! fields a router or a worker reads. Every other field is ignored here
//! (the router forwards the client's bytes unchanged, so nothing is lost).

use super::lenient::{drain_seq, scalars_are, MaybeString};
use super::{ErrorBody, Lenient};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What a count field (`max_tokens`, `n`, ...) must be; see
/// [`Lenient`]'s reading of counts.
const COUNT: &str =
    "an integer from 0 to 4294967295 (a JSON integer, a number such as 64.0 or a string such as \"64\")";

/// The body of `/v1/completions`. Parsed field by field without a JSON
/// tree; [`CompletionRequest::from_json`] parses it within [`BodyLimits`].
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    /// The model asked for; `None` lets the server choose.
    pub model: Option<String>,
    /// The prompt, in any of its four shapes.
    pub prompt: Prompt,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// `stream_options` (`include_usage`); see [`Self::include_usage`].
    pub stream_options: Option<Lenient<StreamOptions>>,
    /// Output token limit; see [`Self::max_tokens`].
    pub max_tokens: Option<Lenient<u32>>,
    /// Choices asked for; see [`Self::n`].
    pub n: Option<Lenient<u32>>,
    /// Candidates generated per prompt to return the best `n` of (SGLang
    /// reads it; vLLM's current request has no such field).
    pub best_of: Option<Lenient<u32>>,
    /// Switchyard's session id (also accepted as the `x-session-id`
    /// header).
    pub session_id: Option<String>,
    /// vLLM's flag: each streamed choice carries the `token_ids` it adds;
    /// see [`Self::return_token_ids`].
    pub return_token_ids: Option<Lenient<bool>>,
    /// The prompts of a batch after its first, counted while parsing
    /// (kept in `prompt` too unless the parse kept the first prompt only).
    pub later_prompts: LaterPrompts,
}

/// The prompts of a batch after its first, as the parser counted them: a
/// router that keeps only the first prompt ([`BodyLimits`]'s
/// `first_prompt_only`) still knows what the rest of the batch asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaterPrompts {
    /// How many prompts follow the first.
    pub count: u64,
    /// Their token ids, all together (a batch of token-id prompts).
    pub token_ids: u64,
    /// Their text in bytes, as decoded, all together (a batch of texts).
    pub text_bytes: u64,
}

impl CompletionRequest {
    /// `max_tokens`, or a 400 when it is not a count.
    pub fn max_tokens(&self) -> Result<Option<u32>, ErrorBody> {
        count(&self.max_tokens, "max_tokens")
    }

    /// `n` (1 when absent), or a 400 when it is not a count.
    pub fn n(&self) -> Result<u32, ErrorBody> {
        Ok(count(&self.n, "n")?.unwrap_or(1))
    }

    /// `stream_options.include_usage`, or a 400 when `stream_options` is
    /// malformed.
    pub fn include_usage(&self) -> Result<bool, ErrorBody> {
        include_usage(&self.stream_options)
    }

    /// `return_token_ids`, or a 400 when it is not a boolean.
    pub fn return_token_ids(&self) -> Result<bool, ErrorBody> {
        flag(&self.return_token_ids, "return_token_ids")
    }
}

/// The body of `/v1/chat/completions`. Parsed field by field without a
/// JSON tree; [`ChatCompletionRequest::from_json`] parses it within
/// [`BodyLimits`].
#[derive(Clone, Debug, PartialEq)]
pub struct ChatCompletionRequest {
    /// The model asked for; `None` lets the server choose.
    pub model: Option<String>,
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// `stream_options` (`include_usage`); see [`Self::include_usage`].
    pub stream_options: Option<Lenient<StreamOptions>>,
    /// Output token limit (the older name); see [`Self::max_tokens`].
    pub max_tokens: Option<Lenient<u32>>,
    /// Output token limit (the newer name); see [`Self::max_tokens`].
    pub max_completion_tokens: Option<Lenient<u32>>,
    /// Choices asked for; see [`Self::n`].
    pub n: Option<Lenient<u32>>,
    /// Switchyard's session id (also accepted as the `x-session-id`
    /// header).
    pub session_id: Option<String>,
    /// vLLM's flag: each streamed choice carries the `token_ids` it adds;
    /// see [`Self::return_token_ids`].
    pub return_token_ids: Option<Lenient<bool>>,
    /// The tools it declares (the chat API's list, as a JSON tree for the
    /// chat template: [`super::tools`]); `None` for none.
    pub tools: Option<serde_json::Value>,
}

impl ChatCompletionRequest {
    /// The output token limit: `max_completion_tokens`, else `max_tokens`;
    /// a 400 when either is present and not a count.
    pub fn max_tokens(&self) -> Result<Option<u32>, ErrorBody> {
        let newer = count(&self.max_completion_tokens, "max_completion_tokens")?;
        let older = count(&self.max_tokens, "max_tokens")?;
        Ok(newer.or(older))
    }

    /// `n` (1 when absent), or a 400 when it is not a count.
    pub fn n(&self) -> Result<u32, ErrorBody> {
        Ok(count(&self.n, "n")?.unwrap_or(1))
    }

    /// `stream_options.include_usage`, or a 400 when `stream_options` is
    /// malformed.
    pub fn include_usage(&self) -> Result<bool, ErrorBody> {
        include_usage(&self.stream_options)
    }

    /// `return_token_ids`, or a 400 when it is not a boolean.
    pub fn return_token_ids(&self) -> Result<bool, ErrorBody> {
        flag(&self.return_token_ids, "return_token_ids")
    }
}

impl Lenient<u32> {
    /// The count, or a 400 naming `field` and the forms a count may take.
    pub fn count(&self, field: &str) -> Result<u32, ErrorBody> {
        self.check(field, COUNT).copied()
    }
}

fn count(field: &Option<Lenient<u32>>, name: &str) -> Result<Option<u32>, ErrorBody> {
    field.as_ref().map(|v| v.count(name)).transpose()
}

fn flag(field: &Option<Lenient<bool>>, name: &str) -> Result<bool, ErrorBody> {
    Ok(field
        .as_ref()
        .map(|v| v.check(name, "a boolean").copied())
        .transpose()?
        .unwrap_or(false))
}

fn include_usage(options: &Option<Lenient<StreamOptions>>) -> Result<bool, ErrorBody> {
    Ok(options
        .as_ref()
        .map(|o| {
            o.check(
                "stream_options",
                "an object such as {\"include_usage\": true}",
            )
        })
        .transpose()?
        .is_some_and(|o| o.include_usage))
}

/// `stream_options`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the whole request's `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// One message of a chat request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// `None` when absent or `null`.
    pub content: Option<MessageContent>,
    /// An assistant's tool calls (empty when it made none).
    pub tool_calls: Vec<super::ToolCall>,
    /// An assistant's reasoning (the chat API's `reasoning`, an Anthropic
    /// message's thinking, a Responses reasoning item), which vLLM hands
    /// the template as `reasoning_content`: Qwen3's renders it in the
    /// turns after the last user query.
    pub reasoning: Option<String>,
}

impl Message {
    /// A message of `role` with text `content`.
    pub fn text(role: &str, content: String) -> Self {
        Self {
            role: role.to_owned(),
            content: Some(MessageContent::Text(content)),
            tool_calls: Vec::new(),
            reasoning: None,
        }
    }
}

/// A message's `content`: a string or a list of content parts. Parsed
/// without a JSON tree; a value of another type is kept as
/// [`MessageContent::Invalid`] so that each server refuses it in its own
/// words, naming `messages`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts (text, images, ...).
    Parts(Vec<ContentPart>),
    /// Neither a string nor a list (a number, a boolean, an object).
    Invalid,
}

impl MessageContent {
    /// The text a chat template renders of a message's `content`, as vLLM
    /// reads it: none as empty, a string as it is, parts as their
    /// non-empty texts one a line ([`joined_text`]; other parts add no
    /// text); `None` for [`MessageContent::Invalid`]. The router and the
    /// sim-worker both read a message so.
    pub fn template_text(content: Option<Self>) -> Option<String> {
        match content {
            None => Some(String::new()),
            Some(Self::Text(text)) => Some(text),
            Some(Self::Parts(parts)) => {
                Some(joined_text(parts.iter().filter_map(|p| p.text.as_deref())))
            }
            Some(Self::Invalid) => None,
        }
    }
}

/// One content part, as far as text goes: its `type` and its `text`, each
/// `None` when absent or not a string. Other keys (`image_url`, ...) and
/// parts that are not objects read as an empty part.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContentPart {
    /// `type`: `text`, `image_url`, ...
    pub kind: Option<String>,
    /// `text`.
    pub text: Option<String>,
}

impl ContentPart {
    /// A `{"type": "text", "text": ...}` part.
    pub fn is_text(&self) -> bool {
        self.kind.as_deref() == Some("text") && self.text.is_some()
    }
}

/// The text a chat message's content parts render as: their non-empty
/// texts joined by a newline, as vLLM joins a message's text parts for a
/// chat template that reads `content` as a string (its `chat_utils`, for
/// every API; an empty part it skips). The router and the sim-worker both
/// read a message's parts so.
pub fn joined_text<'a>(texts: impl IntoIterator<Item = &'a str>) -> String {
    let mut joined = String::new();
    for text in texts.into_iter().filter(|t| !t.is_empty()) {
        if !joined.is_empty() {
            joined.push('\n');
        }
        joined.push_str(text);
    }
    joined
}

impl<'de> Deserialize<'de> for ContentPart {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        enum Key {
            Type,
            Text,
            Other,
        }
        impl<'de> Deserialize<'de> for Key {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct KeyVisitor;
                impl Visitor<'_> for KeyVisitor {
                    type Value = Key;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a key")
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                        Ok(match v {
                            "type" => Key::Type,
                            "text" => Key::Text,
                            _ => Key::Other,
                        })
                    }
                }
                deserializer.deserialize_identifier(KeyVisitor)
            }
        }
        struct PartVisitor;
        impl<'de> Visitor<'de> for PartVisitor {
            type Value = ContentPart;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content part")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ContentPart, A::Error> {
                let mut part = ContentPart::default();
                while let Some(key) = map.next_key()? {
                    match key {
                        Key::Type => part.kind = map.next_value::<MaybeString>()?.0,
                        Key::Text => part.text = map.next_value::<MaybeString>()?.0,
                        Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(part)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<ContentPart, A::Error> {
                drain_seq(seq).map(|()| ContentPart::default())
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<ContentPart, E> {
                Ok(ContentPart::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<ContentPart, D::Error> {
                ContentPart::deserialize(d)
            }
            scalars_are!(ContentPart::default());
        }
        deserializer.deserialize_any(PartVisitor)
    }
}

/// The `prompt` of a `/v1/completions` request: text, token ids, or a batch
/// of either. Parsed straight into its shape (the first element of a list
/// decides it), never through a JSON tree; `[]` is an empty token list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of text prompts.
    Texts(Vec<String>),
    /// A batch of token-id prompts.
    TokenBatches(Vec<Vec<u32>>),
}
