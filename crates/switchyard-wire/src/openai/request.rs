//! Request bodies of `/v1/completions` and `/v1/chat/completions`: the
//! fields a router or a worker reads. Every other field is ignored here
//! (the router forwards the client's bytes unchanged, so nothing is lost).

use super::lenient::{drain_map, drain_seq, scalars_are, MaybeString};
use super::{ErrorBody, Lenient};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Unexpected, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What a count field (`max_tokens`, `n`) must be.
const COUNT: &str = "an integer from 0 to 4294967295";

/// The body of `/v1/completions`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct CompletionRequest {
    /// The model asked for; `None` lets the server choose.
    pub model: Option<String>,
    /// The prompt, in any of its four shapes.
    pub prompt: Prompt,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// `stream_options` (`include_usage`); see [`Self::include_usage`].
    pub stream_options: Option<Lenient<StreamOptions>>,
    /// Output token limit; see [`Self::max_tokens`].
    pub max_tokens: Option<Lenient<u32>>,
    /// Choices asked for; see [`Self::n`].
    pub n: Option<Lenient<u32>>,
    /// Switchyard's session id (also accepted as the `x-session-id`
    /// header).
    pub session_id: Option<String>,
    /// vLLM's flag: each streamed choice carries the `token_ids` it adds;
    /// see [`Self::return_token_ids`].
    pub return_token_ids: Option<Lenient<bool>>,
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

/// The body of `/v1/chat/completions`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model asked for; `None` lets the server choose.
    pub model: Option<String>,
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
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

fn count(field: &Option<Lenient<u32>>, name: &str) -> Result<Option<u32>, ErrorBody> {
    field
        .as_ref()
        .map(|v| v.check(name, COUNT).copied())
        .transpose()
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
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// `None` when absent or `null`.
    #[serde(default)]
    pub content: Option<MessageContent>,
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

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MessageContent, E> {
                Ok(MessageContent::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<MessageContent, E> {
                Ok(MessageContent::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MessageContent, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(MessageContent::Parts(parts))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<MessageContent, A::Error> {
                drain_map(map).map(|()| MessageContent::Invalid)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<MessageContent, D::Error> {
                MessageContent::deserialize(d)
            }
            scalars_are!(MessageContent::Invalid);
        }
        deserializer.deserialize_any(ContentVisitor)
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

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PromptVisitor;
        impl<'de> Visitor<'de> for PromptVisitor {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a prompt: a string, a list of token ids, a list of strings \
                     or a list of token-id lists",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                fn rest<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(
                    first: T,
                    mut seq: A,
                ) -> Result<Vec<T>, A::Error> {
                    let mut all = vec![first];
                    while let Some(next) = seq.next_element()? {
                        all.push(next);
                    }
                    Ok(all)
                }
                Ok(match seq.next_element::<FirstItem>()? {
                    None => Prompt::Tokens(Vec::new()),
                    Some(FirstItem::Token(id)) => Prompt::Tokens(rest(id, seq)?),
                    Some(FirstItem::Text(text)) => Prompt::Texts(rest(text, seq)?),
                    Some(FirstItem::Tokens(ids)) => Prompt::TokenBatches(rest(ids, seq)?),
                })
            }
        }
        deserializer.deserialize_any(PromptVisitor)
    }
}

/// The first element of a list prompt, which decides the list's shape.
enum FirstItem {
    Token(u32),
    Text(String),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for FirstItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        const TOKEN_ID: &str = "a token id (0 to 4294967295)";
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = FirstItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id, a string or a list of token ids")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<FirstItem, E> {
                u32::try_from(v)
                    .map(FirstItem::Token)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &TOKEN_ID))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<FirstItem, E> {
                u32::try_from(v)
                    .map(FirstItem::Token)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &TOKEN_ID))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<FirstItem, E> {
                Ok(FirstItem::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<FirstItem, E> {
                Ok(FirstItem::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FirstItem, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(FirstItem::Tokens(ids))
            }
        }
        deserializer.deserialize_any(ItemVisitor)
    }
}
