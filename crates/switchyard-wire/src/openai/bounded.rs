//! Request bodies parsed within stated bounds.
//!
//! [`CompletionRequest::from_json`] and [`ChatCompletionRequest::from_json`]
//! read a body straight into its typed fields (no JSON tree) and stop at the
//! first element past a [`BodyLimits`] bound: the token id after the
//! `prompt_tokens`-th of a prompt, the message after the `messages`-th, the
//! content part after the `content_parts`-th. Memory for a refused body is
//! then the body plus at most the bounded part parsed so far, whatever the
//! body holds. The plain `Deserialize` impls of the request types are the
//! same parsers with no bounds (what a worker, which holds its own limits,
//! and the tests use).

use super::lenient::{drain_map, scalars_are};
use super::request::{ContentPart, LaterPrompts, Message, MessageContent, Prompt};
use super::{ChatCompletionRequest, CompletionRequest, Lenient, StreamOptions};
use serde::de::{
    self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Unexpected, Visitor,
};
use serde::Deserialize;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

/// Bounds on what one request body may hold, applied while it is parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodyLimits {
    /// Most token ids in one token-id prompt of `/v1/completions` (each
    /// prompt of a batch). Text prompts are not bounded here: only their
    /// tokenizer knows their length.
    pub prompt_tokens: usize,
    /// Most messages in a chat.
    pub messages: usize,
    /// Most content parts in all of a chat's messages together.
    pub content_parts: usize,
    /// Keep only the first prompt of a batch (a router routes a batch by
    /// its first prompt and forwards the body's bytes): the others are
    /// checked (shape and `prompt_tokens`) but not stored, so a batch of
    /// many tiny prompts costs no memory per prompt.
    pub first_prompt_only: bool,
}

impl BodyLimits {
    /// No bounds: everything is kept (the plain `Deserialize` impls).
    pub const NONE: BodyLimits = BodyLimits {
        prompt_tokens: usize::MAX,
        messages: usize::MAX,
        content_parts: usize::MAX,
        first_prompt_only: false,
    };
}

/// Which bound of [`BodyLimits`] a body went past.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    /// [`BodyLimits::prompt_tokens`].
    PromptTokens,
    /// [`BodyLimits::messages`].
    Messages,
    /// [`BodyLimits::content_parts`].
    ContentParts,
}

impl Limit {
    /// The request field to blame (an OpenAI error's `param`).
    pub fn param(self) -> &'static str {
        match self {
            Limit::PromptTokens => "prompt",
            Limit::Messages | Limit::ContentParts => "messages",
        }
    }
}

/// A body past a bound: which one, and its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverLimit {
    /// The bound.
    pub limit: Limit,
    /// Its value.
    pub max: usize,
}

/// Why a body was refused.
#[derive(Debug)]
pub enum BodyError {
    /// It went past a bound (parsing stopped there).
    Over(OverLimit),
    /// It is not JSON of the request's shape.
    Json(serde_json::Error),
}

impl CompletionRequest {
    /// Parses a `/v1/completions` body within `limits`.
    pub fn from_json(body: &[u8], limits: &BodyLimits) -> Result<Self, BodyError> {
        from_json(body, limits, |b, de| CompletionSeed(b).deserialize(de))
    }
}

impl ChatCompletionRequest {
    /// Parses a `/v1/chat/completions` body within `limits`.
    pub fn from_json(body: &[u8], limits: &BodyLimits) -> Result<Self, BodyError> {
        from_json(body, limits, |b, de| ChatSeed(b).deserialize(de))
    }
}

type JsonDe<'a> = serde_json::Deserializer<serde_json::de::SliceRead<'a>>;

fn from_json<'a, T>(
    body: &'a [u8],
    limits: &BodyLimits,
    parse: impl FnOnce(Bounds<'_>, &mut JsonDe<'a>) -> Result<T, serde_json::Error>,
) -> Result<T, BodyError> {
    let over = Cell::new(None);
    let parts = Cell::new(0);
    let later = Cell::new(LaterPrompts::default());
    let bounds = Bounds {
        limits,
        over: &over,
        parts: &parts,
        later: &later,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let result = parse(bounds, &mut de).and_then(|value| de.end().map(|()| value));
    match (result, over.get()) {
        (_, Some(over)) => Err(BodyError::Over(over)),
        (Ok(value), None) => Ok(value),
        (Err(e), None) => Err(BodyError::Json(e)),
    }
}

/// What the parsers share: the bounds, the first bound gone past (the
/// serde error that stops the parse carries no type of its own), the
/// content parts counted so far, and a batch's prompts after its first.
#[derive(Clone, Copy)]
struct Bounds<'a> {
    limits: &'a BodyLimits,
    over: &'a Cell<Option<OverLimit>>,
    parts: &'a Cell<usize>,
    later: &'a Cell<LaterPrompts>,
}

impl Bounds<'_> {
    /// Records `limit` as gone past; the error stops the parse.
    fn refuse<E: de::Error>(self, limit: Limit, max: usize) -> E {
        self.over.set(Some(OverLimit { limit, max }));
        E::custom(format_args!("past the limit of {max} ({limit:?})"))
    }

    /// Counts one more prompt after a batch's first, of `token_ids` ids
    /// and `text_bytes` bytes of text.
    fn later_prompt(self, token_ids: usize, text_bytes: usize) {
        let mut later = self.later.get();
        later.count += 1;
        later.token_ids = later.token_ids.saturating_add(token_ids as u64);
        later.text_bytes = later.text_bytes.saturating_add(text_bytes as u64);
        self.later.set(later);
    }

    /// Appends the `count`-th token id of a prompt (1-based), or refuses.
    fn token<E: de::Error>(
        self,
        ids: Option<&mut Vec<u32>>,
        count: usize,
        id: u32,
    ) -> Result<(), E> {
        let max = self.limits.prompt_tokens;
        if count > max {
            return Err(self.refuse(Limit::PromptTokens, max));
        }
        if let Some(ids) = ids {
            ids.push(id);
        }
        Ok(())
    }
}

/// Runs `f` with no bounds.
fn unbounded<R>(f: impl FnOnce(Bounds<'_>) -> R) -> R {
    let over = Cell::new(None);
    let parts = Cell::new(0);
    let later = Cell::new(LaterPrompts::default());
    f(Bounds {
        limits: &BodyLimits::NONE,
        over: &over,
        parts: &parts,
        later: &later,
    })
}

/// A map key: its index in a list of field names (`None`: another key).
struct FieldIn(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for FieldIn {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for FieldIn {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|name| *name == v))
    }
}

/// Stores a field's next value (read by `seed`) in `slot`, refusing a
/// second occurrence as a derived `Deserialize` does.
fn read_once_seed<'de, A: MapAccess<'de>, S: DeserializeSeed<'de>>(
    map: &mut A,
    slot: &mut Option<S::Value>,
    name: &'static str,
    seed: S,
) -> Result<(), A::Error> {
    if slot.is_some() {
        return Err(de::Error::duplicate_field(name));
    }
    *slot = Some(map.next_value_seed(seed)?);
    Ok(())
}

/// [`read_once_seed`] of a plain `Deserialize` value.
fn read_once<'de, A: MapAccess<'de>, T: Deserialize<'de>>(
    map: &mut A,
    slot: &mut Option<T>,
    name: &'static str,
) -> Result<(), A::Error> {
    read_once_seed(map, slot, name, PhantomData)
}

/// The fields that completion and chat requests share ([`read_request`]
/// matches on their indices).
const SHARED_FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "session_id",
    "return_token_ids",
];

/// A request object's key: one of [`SHARED_FIELDS`], one of the
/// request's own fields (its index in their list), or another.
enum RequestKey {
    Shared(usize),
    Own(usize),
    Other,
}

/// Reads a [`RequestKey`], given the request's own field names.
struct RequestKeyIn(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for RequestKeyIn {
    type Value = RequestKey;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RequestKey, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for RequestKeyIn {
    type Value = RequestKey;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<RequestKey, E> {
        let position = |names: &[&str]| names.iter().position(|name| *name == v);
        Ok(match (position(SHARED_FIELDS), position(self.0)) {
            (Some(i), _) => RequestKey::Shared(i),
            (None, Some(i)) => RequestKey::Own(i),
            (None, None) => RequestKey::Other,
        })
    }
}

/// The shared fields as read, each `None` until its key is seen (so that
/// a second occurrence, even after a `null`, is refused).
#[derive(Default)]
struct SharedSlots {
    model: Option<Option<String>>,
    stream: Option<bool>,
    stream_options: Option<Option<Lenient<StreamOptions>>>,
    max_tokens: Option<Option<Lenient<u32>>>,
    n: Option<Option<Lenient<u32>>>,
    session_id: Option<Option<String>>,
    return_token_ids: Option<Option<Lenient<bool>>>,
}

/// The shared fields' values: absent and `null` alike are `None`
/// (`stream`: `false`).
struct SharedFields {
    model: Option<String>,
    stream: bool,
    stream_options: Option<Lenient<StreamOptions>>,
    max_tokens: Option<Lenient<u32>>,
    n: Option<Lenient<u32>>,
    session_id: Option<String>,
    return_token_ids: Option<Lenient<bool>>,
}

/// Reads a request object: the shared fields here, each of the request's
/// `own` fields through `read_own` (with its index in `own`), and skips
/// every other key's value.
fn read_request<'de, A: MapAccess<'de>>(
    mut map: A,
    own: &'static [&'static str],
    mut read_own: impl FnMut(&mut A, usize) -> Result<(), A::Error>,
) -> Result<SharedFields, A::Error> {
    let mut s = SharedSlots::default();
    while let Some(key) = map.next_key_seed(RequestKeyIn(own))? {
        match key {
            RequestKey::Shared(0) => read_once(&mut map, &mut s.model, "model")?,
            RequestKey::Shared(1) => read_once(&mut map, &mut s.stream, "stream")?,
            RequestKey::Shared(2) => read_once(&mut map, &mut s.stream_options, "stream_options")?,
            RequestKey::Shared(3) => read_once(&mut map, &mut s.max_tokens, "max_tokens")?,
            RequestKey::Shared(4) => read_once(&mut map, &mut s.n, "n")?,
            RequestKey::Shared(5) => read_once(&mut map, &mut s.session_id, "session_id")?,
            RequestKey::Shared(6) => {
                read_once(&mut map, &mut s.return_token_ids, "return_token_ids")?
            }
            RequestKey::Own(i) => read_own(&mut map, i)?,
            RequestKey::Shared(_) | RequestKey::Other => {
                map.next_value::<IgnoredAny>()?;
            }
        }
    }
    Ok(SharedFields {
        model: s.model.flatten(),
        stream: s.stream.unwrap_or(false),
        stream_options: s.stream_options.flatten(),
        max_tokens: s.max_tokens.flatten(),
        n: s.n.flatten(),
        session_id: s.session_id.flatten(),
        return_token_ids: s.return_token_ids.flatten(),
    })
}

struct CompletionSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for CompletionSeed<'_> {
    type Value = CompletionRequest;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<CompletionRequest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for CompletionSeed<'_> {
    type Value = CompletionRequest;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a completion request (a JSON object)")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<CompletionRequest, A::Error> {
        let mut prompt: Option<Prompt> = None;
        let mut best_of: Option<Option<Lenient<u32>>> = None;
        let SharedFields {
            model,
            stream,
            stream_options,
            max_tokens,
            n,
            session_id,
            return_token_ids,
        } = read_request(map, &["prompt", "best_of"], |map, own| match own {
            0 => read_once_seed(map, &mut prompt, "prompt", PromptSeed(self.0)),
            _ => read_once(map, &mut best_of, "best_of"),
        })?;
        Ok(CompletionRequest {
            model,
            prompt: prompt.ok_or_else(|| de::Error::missing_field("prompt"))?,
            stream,
            stream_options,
            max_tokens,
            n,
            best_of: best_of.flatten(),
            session_id,
            return_token_ids,
            later_prompts: self.0.later.get(),
        })
    }
}

impl<'de> Deserialize<'de> for CompletionRequest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        unbounded(|b| CompletionSeed(b).deserialize(d))
    }
}

struct ChatSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for ChatSeed<'_> {
    type Value = ChatCompletionRequest;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<ChatCompletionRequest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ChatSeed<'_> {
    type Value = ChatCompletionRequest;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a chat completion request (a JSON object)")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ChatCompletionRequest, A::Error> {
        let mut messages: Option<Vec<Message>> = None;
        let mut max_completion_tokens: Option<Option<Lenient<u32>>> = None;
        let mut tools: Option<Option<Box<serde_json::value::RawValue>>> = None;
        let SharedFields {
            model,
            stream,
            stream_options,
            max_tokens,
            n,
            session_id,
            return_token_ids,
        } = read_request(
            map,
            &["messages", "max_completion_tokens", "tools"],
            |map, own| match own {
                0 => read_once_seed(map, &mut messages, "messages", MessagesSeed(self.0)),
                1 => read_once(map, &mut max_completion_tokens, "max_completion_tokens"),
                _ => read_once(map, &mut tools, "tools"),
            },
        )?;
        let max = self.0.limits.prompt_tokens;
        let tools = match super::tools::tools_within(tools.flatten().as_deref(), max) {
            Ok(tools) => tools,
            Err(super::tools::ToolsError::TooLong) => {
                return Err(self.0.refuse(Limit::PromptTokens, max))
            }
            Err(super::tools::ToolsError::NotAList) => {
                return Err(de::Error::custom("`tools` must be a list of tools"))
            }
        };
        Ok(ChatCompletionRequest {
            model,
            messages: messages.ok_or_else(|| de::Error::missing_field("messages"))?,
            stream,
            stream_options,
            max_tokens,
            max_completion_tokens: max_completion_tokens.flatten(),
            n,
            session_id,
            return_token_ids,
            tools,
        })
    }
}

impl<'de> Deserialize<'de> for ChatCompletionRequest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        unbounded(|b| ChatSeed(b).deserialize(d))
    }
}

/// `messages`: at most `limits.messages` of them.
struct MessagesSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = Vec<Message>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Message>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_> {
    type Value = Vec<Message>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of messages")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Message>, A::Error> {
        let max = self.0.limits.messages;
        let mut messages = Vec::new();
        while let Some(message) = seq.next_element_seed(MessageSeed(self.0))? {
            if messages.len() >= max {
                return Err(self.0.refuse(Limit::Messages, max));
            }
            messages.push(message);
        }
        Ok(messages)
    }
}

const MESSAGE_FIELDS: &[&str] = &["role", "content", "tool_calls", "reasoning"];

/// One message; its content parts count towards `limits.content_parts`.
struct MessageSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = Message;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Message, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = Message;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message (an object with a role)")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message, A::Error> {
        let mut role: Option<String> = None;
        let mut content: Option<Option<MessageContent>> = None;
        let mut tool_calls: Option<Option<Vec<super::ToolCall>>> = None;
        let mut reasoning: Option<Option<String>> = None;
        while let Some(key) = map.next_key_seed(FieldIn(MESSAGE_FIELDS))? {
            match key {
                Some(0) => read_once(&mut map, &mut role, "role")?,
                Some(1) => read_once_seed(
                    &mut map,
                    &mut content,
                    "content",
                    OptionalContentSeed(self.0),
                )?,
                Some(2) => read_once(&mut map, &mut tool_calls, "tool_calls")?,
                Some(3) => read_once(&mut map, &mut reasoning, "reasoning")?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Message {
            role: role.ok_or_else(|| de::Error::missing_field("role"))?,
            content: content.flatten(),
            tool_calls: tool_calls.flatten().unwrap_or_default(),
            reasoning: reasoning.flatten(),
        })
    }
}

impl<'de> Deserialize<'de> for Message {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        unbounded(|b| MessageSeed(b).deserialize(d))
    }
}

/// `content`: `None` for `null`.
struct OptionalContentSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for OptionalContentSeed<'_> {
    type Value = Option<MessageContent>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for OptionalContentSeed<'_> {
    type Value = Option<MessageContent>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a list of content parts or null")
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        ContentSeed(self.0).deserialize(d).map(Some)
    }
}

/// A message's `content`; see [`MessageContent`].
struct ContentSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for ContentSeed<'_> {
    type Value = MessageContent;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<MessageContent, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_> {
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
        let max = self.0.limits.content_parts;
        let mut parts = Vec::new();
        while let Some(part) = seq.next_element::<ContentPart>()? {
            let counted = self.0.parts.get();
            if counted >= max {
                return Err(self.0.refuse(Limit::ContentParts, max));
            }
            self.0.parts.set(counted + 1);
            parts.push(part);
        }
        Ok(MessageContent::Parts(parts))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<MessageContent, A::Error> {
        drain_map(map).map(|()| MessageContent::Invalid)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<MessageContent, D::Error> {
        self.deserialize(d)
    }
    scalars_are!(MessageContent::Invalid);
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        unbounded(|b| ContentSeed(b).deserialize(d))
    }
}

/// `prompt`: its shape decided by the first element of a list.
struct PromptSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
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
        let b = self.0;
        let keep_rest = !b.limits.first_prompt_only;
        Ok(match seq.next_element_seed(FirstItemSeed(b))? {
            None => Prompt::Tokens(Vec::new()),
            Some(FirstItem::Token(id)) => {
                let mut ids = Vec::with_capacity(PROMPT_IDS_HINT.min(b.limits.prompt_tokens));
                b.token(Some(&mut ids), 1, id)?;
                while let Some(id) = seq.next_element::<u32>()? {
                    let count = ids.len() + 1;
                    b.token(Some(&mut ids), count, id)?;
                }
                Prompt::Tokens(ids)
            }
            Some(FirstItem::Text(text)) => {
                let mut texts = vec![text];
                if keep_rest {
                    while let Some(text) = seq.next_element::<String>()? {
                        b.later_prompt(0, text.len());
                        texts.push(text);
                    }
                } else {
                    while let Some(AnyString(len)) = seq.next_element()? {
                        b.later_prompt(0, len);
                    }
                }
                Prompt::Texts(texts)
            }
            Some(FirstItem::Tokens((ids, _))) => {
                let mut batch = vec![ids];
                let rest = TokensSeed { b, keep: keep_rest };
                while let Some((ids, count)) = seq.next_element_seed(rest)? {
                    b.later_prompt(count, 0);
                    if keep_rest {
                        batch.push(ids);
                    }
                }
                Prompt::TokenBatches(batch)
            }
        })
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        unbounded(|b| PromptSeed(b).deserialize(d))
    }
}

/// The first element of a list prompt, which decides the list's shape.
enum FirstItem {
    Token(u32),
    Text(String),
    /// The ids and their count.
    Tokens((Vec<u32>, usize)),
}

struct FirstItemSeed<'a>(Bounds<'a>);

impl<'de> DeserializeSeed<'de> for FirstItemSeed<'_> {
    type Value = FirstItem;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<FirstItem, D::Error> {
        d.deserialize_any(self)
    }
}

const TOKEN_ID: &str = "a token id (0 to 4294967295)";

/// Room for this many ids is made before a token-id prompt is read (1 KiB;
/// JSON gives no length up front): a prompt of up to this many ids is one
/// allocation, a longer one a few doublings from here rather than from 4.
const PROMPT_IDS_HINT: usize = 256;

impl<'de> Visitor<'de> for FirstItemSeed<'_> {
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
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<FirstItem, A::Error> {
        TokensSeed {
            b: self.0,
            keep: true,
        }
        .visit_seq(seq)
        .map(FirstItem::Tokens)
    }
}

/// One token-id prompt of a batch, at most `limits.prompt_tokens` long:
/// its ids (stored only when `keep`) and how many there are.
#[derive(Clone, Copy)]
struct TokensSeed<'a> {
    b: Bounds<'a>,
    keep: bool,
}

impl<'de> DeserializeSeed<'de> for TokensSeed<'_> {
    type Value = (Vec<u32>, usize);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for TokensSeed<'_> {
    type Value = (Vec<u32>, usize);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a sequence of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut ids = if self.keep {
            Vec::with_capacity(PROMPT_IDS_HINT.min(self.b.limits.prompt_tokens))
        } else {
            Vec::new()
        };
        let mut count = 0;
        while let Some(id) = seq.next_element::<u32>()? {
            count += 1;
            self.b.token(self.keep.then_some(&mut ids), count, id)?;
        }
        Ok((ids, count))
    }
}

/// A string, checked, measured (its length in bytes) and dropped (a
/// batch's later prompts in a router).
struct AnyString(usize);

impl<'de> Deserialize<'de> for AnyString {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct StringVisitor;
        impl Visitor<'_> for StringVisitor {
            type Value = AnyString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<AnyString, E> {
                Ok(AnyString(v.len()))
            }
        }
        d.deserialize_str(StringVisitor)
    }
}
