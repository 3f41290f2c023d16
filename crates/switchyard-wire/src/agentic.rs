//! The request bodies of the agentic APIs vLLM serves beside chat:
//! OpenAI's Responses API (`/v1/responses`, [`ResponsesRequest`]) and
//! Anthropic's Messages API (`/v1/messages` and
//! `/v1/messages/count_tokens`, [`MessagesRequest`]).
//!
//! Both are read as the chat conversation they are equivalent to
//! ([`ResponsesRequest::chat`], [`MessagesRequest::chat`]): a list of
//! [`Message`]s with text content, in the chat API's roles, so that a
//! router renders them with the model's chat template exactly as it
//! renders the equivalent `/v1/chat/completions` request (the same
//! prompt, the same block hashes). The mapping, one rule per item:
//!
//! | item | chat equivalent |
//! |---|---|
//! | Responses `instructions`, Anthropic `system` | a first `system` message (Anthropic: its text blocks glued, Claude Code's `x-anthropic-billing-header` block dropped; none when empty) |
//! | Responses `input` as a string | one `user` message |
//! | a message item / message (`role`, text or text parts) | that message, its non-empty text parts one a line; a Responses assistant item: its first part's text only |
//! | Responses `function_call`, Anthropic `tool_use` block | a tool call (its name and arguments) of the assistant message before it (Responses: a new one when the last message is not an assistant's) |
//! | Responses `reasoning` item, Anthropic `thinking` blocks | the assistant message's reasoning (a Responses item: of the assistant message before it, or of one of its own; its first content part's text, else its first summary's), which the template renders after the last user query; their bytes counted as well |
//! | Responses `function_call_output`, Anthropic `tool_result` block | a `tool` message with its output's text (Anthropic: its text items one a line), before the user message's own text |
//! | an Anthropic user message with no text or media left (tool results only) | none |
//! | Responses `tools`, Anthropic `tools` | the chat API's tool list as vLLM dumps it (`{"type": "function", "function": {name, description, parameters, strict?}}`: [`crate::openai::tools::engine_function`]); Responses tools of other types dropped, every Anthropic tool a function |
//! | images, files, audio | no text (the engine's encoder gives them their tokens) |
//! | any other item or block | no text; their JSON bytes are counted in [`ResponsesRequest::unrendered_bytes`] |
//!
//! The rules are vLLM 0.32's, read in its source: the Responses items in
//! `entrypoints/openai/responses/utils.py`, the Anthropic conversion in
//! `entrypoints/anthropic/serving.py` and content parts in
//! `renderers/chat_utils.py`; a message the router builds differently
//! from the engine renders another prompt, and its blocks miss the
//! engine's cache in the index.
//!
//! Everything an engine renders into the prompt is thus either rendered
//! by the router's chat template (text, tools, tool calls) or counted as
//! bytes for an estimate (reasoning and other items the template does not
//! see), so a client's prompt size, quota charge and fair share include
//! its tools ([`crate::openai::tools`]).
//!
//! Parsed within [`BodyLimits`] before any other work: items (messages)
//! against `messages`, content blocks of all messages together against
//! `content_parts`; a list is read an element at a time and parsing stops
//! at the first element past its bound. Every other field is ignored
//! (a router forwards the client's bytes unchanged).

use crate::openai::tools::json_text;
use crate::openai::{
    BodyError, BodyLimits, Lenient, Limit, Message, MessageContent, OverLimit, ToolCall,
};
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

/// Longest `previous_response_id` (and response id in a path) read, in
/// bytes: the core's response affinity's bound (vLLM's ids are `resp_` and
/// 32 hex digits).
pub use switchyard_core::admission::responses::MAX_RESPONSE_ID_BYTES;

/// Which of the agentic APIs a request came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AgenticApi {
    /// OpenAI's Responses API.
    Responses,
    /// Anthropic's Messages API.
    Messages,
}

impl AgenticApi {
    /// Its name in metric labels and logs.
    pub fn label(self) -> &'static str {
        match self {
            AgenticApi::Responses => "responses",
            AgenticApi::Messages => "messages",
        }
    }

    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            AgenticApi::Responses => "/v1/responses",
            AgenticApi::Messages => "/v1/messages",
        }
    }
}

/// The body of `/v1/responses`, as far as routing reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponsesRequest {
    /// The model asked for.
    pub model: Option<String>,
    /// Stream the answer as Responses events.
    pub stream: bool,
    /// Output token limit.
    pub max_output_tokens: Option<Lenient<u32>>,
    /// The response this one continues (stored on the worker that
    /// answered it).
    pub previous_response_id: Option<String>,
    /// `store` (default true): whether the worker keeps the response for
    /// a later `previous_response_id` or `GET`.
    pub store: bool,
    /// Switchyard's session id (also the `x-session-id` header).
    pub session_id: Option<String>,
    /// The conversation as chat messages (instructions first).
    pub messages: Vec<Message>,
    /// The tools it declares, as the chat API's list; `None` for none.
    pub tools: Option<serde_json::Value>,
    /// Bytes of items the engine renders that the chat conversation does
    /// not carry (reasoning, other tool items): counted by estimate.
    pub unrendered_bytes: usize,
    /// Whether it constrains the output (`text.format` other than text).
    pub constrained: bool,
}

/// The body of `/v1/messages` (and `/v1/messages/count_tokens`), as far
/// as routing reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct MessagesRequest {
    /// The model asked for.
    pub model: Option<String>,
    /// Stream the answer as Anthropic events.
    pub stream: bool,
    /// Output token limit (required by Anthropic; the worker judges its
    /// absence).
    pub max_tokens: Option<Lenient<u32>>,
    /// The conversation as chat messages (`system` first).
    pub messages: Vec<Message>,
    /// The tools it declares, as the chat API's list; `None` for none.
    pub tools: Option<serde_json::Value>,
    /// Bytes of blocks the engine renders that the chat conversation does
    /// not carry (thinking, other blocks): counted by estimate.
    pub unrendered_bytes: usize,
}

/// Why an item cannot be read (the refusal's message; never content).
fn invalid(what: &str) -> BodyError {
    BodyError::Json(de::Error::custom(what))
}

#[derive(Deserialize)]
struct ResponsesTop<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<Lenient<u32>>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default, borrow)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tools: Option<&'a RawValue>,
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MessagesTop<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<Lenient<u32>>,
    #[serde(default, borrow)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tools: Option<&'a RawValue>,
}

/// One Responses input item or Anthropic message: its kind, role and
/// the raw parts that carry text.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    /// A `function_call_output`'s output.
    #[serde(default, borrow)]
    output: Option<&'a RawValue>,
    /// A `function_call`'s function.
    #[serde(default)]
    name: Option<String>,
    /// A `function_call`'s arguments (JSON text in a string).
    #[serde(default, borrow)]
    arguments: Option<&'a RawValue>,
    /// A `reasoning` item's summary parts.
    #[serde(default, borrow)]
    summary: Option<&'a RawValue>,
}

/// One content block or part: its type, its text, a `tool_result`'s
/// content.
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
    /// A `thinking` block's thinking.
    #[serde(default)]
    thinking: Option<String>,
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    /// A `tool_use` block's tool.
    #[serde(default)]
    name: Option<String>,
    /// A `tool_use` block's input.
    #[serde(default, borrow)]
    input: Option<&'a RawValue>,
    /// The block's JSON length (set after parsing).
    #[serde(skip)]
    bytes: usize,
}

/// Reads a JSON list of `T` an element at a time, stopping at the first
/// element past `max` (then `over` names `limit`).
struct BoundedList<'c, T> {
    max: usize,
    limit: Limit,
    over: &'c Cell<Option<OverLimit>>,
    _t: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for BoundedList<'_, T> {
    type Value = Vec<T>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for BoundedList<'_, T> {
    type Value = Vec<T>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut out = Vec::new();
        while let Some(item) = seq.next_element::<T>()? {
            if out.len() >= self.max {
                self.over.set(Some(OverLimit {
                    limit: self.limit,
                    max: self.max,
                }));
                return Err(de::Error::custom("over a bound"));
            }
            out.push(item);
        }
        Ok(out)
    }
}

/// `raw` as a list of at most `max` elements.
fn bounded_list<'a, T: Deserialize<'a>>(
    raw: &'a RawValue,
    max: usize,
    limit: Limit,
) -> Result<Vec<T>, BodyError> {
    let over = Cell::new(None);
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let seed = BoundedList {
        max,
        limit,
        over: &over,
        _t: PhantomData,
    };
    match seed.deserialize(&mut de) {
        Ok(list) => Ok(list),
        Err(e) => Err(match over.get() {
            Some(over) => BodyError::Over(over),
            None => BodyError::Json(e),
        }),
    }
}

fn parse_top<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, BodyError> {
    serde_json::from_slice(body).map_err(BodyError::Json)
}

fn is_null(raw: Option<&RawValue>) -> bool {
    raw.is_none_or(|r| r.get() == "null")
}

fn as_string(raw: &RawValue) -> Option<String> {
    if raw.get().starts_with('"') {
        serde_json::from_str(raw.get()).ok()
    } else {
        None
    }
}

/// What is left of the content-parts bound across a request's messages,
/// and the bytes of blocks read that no message carries.
struct Parts {
    left: usize,
    max: usize,
    unrendered: usize,
}

impl Parts {
    fn new(limits: &BodyLimits) -> Self {
        Self {
            left: limits.content_parts,
            max: limits.content_parts,
            unrendered: 0,
        }
    }

    /// `raw` (a string or a list of blocks) as its blocks, within what is
    /// left of the bound.
    fn blocks<'a>(&mut self, raw: &'a RawValue) -> Result<Vec<Block<'a>>, BodyError> {
        let raws: Vec<&'a RawValue> =
            bounded_list(raw, self.left, Limit::ContentParts).map_err(|e| match e {
                BodyError::Over(_) => BodyError::Over(OverLimit {
                    limit: Limit::ContentParts,
                    max: self.max,
                }),
                e => e,
            })?;
        self.left -= raws.len();
        raws.into_iter()
            .map(|raw| {
                let mut block: Block<'a> =
                    serde_json::from_str(raw.get()).map_err(BodyError::Json)?;
                block.bytes = raw.get().len();
                Ok(block)
            })
            .collect()
    }

    /// Counts `block` as rendered by the engine but carried by no message
    /// (media excepted: the engine's encoder gives them their tokens).
    fn unrendered(&mut self, block: &Block<'_>) {
        if !is_media_kind(block.kind.as_deref()) {
            self.unrendered = self.unrendered.saturating_add(block.bytes);
        }
    }

    /// The text of `raw`: a string as it is, a list's text blocks joined
    /// by `join`'s rule (other blocks add no text), `null` as empty.
    fn text(
        &mut self,
        raw: Option<&RawValue>,
        what: &str,
        join: Join,
    ) -> Result<String, BodyError> {
        let Some(raw) = raw.filter(|r| r.get() != "null") else {
            return Ok(String::new());
        };
        if let Some(s) = as_string(raw) {
            return Ok(s);
        }
        if !raw.get().starts_with('[') {
            return Err(invalid(what));
        }
        let mut texts = Vec::new();
        for block in self.blocks(raw)? {
            if is_text_kind(block.kind.as_deref()) {
                texts.push(block.text.unwrap_or_default());
            } else {
                self.unrendered(&block);
            }
        }
        Ok(join.joined(texts))
    }

    /// An assistant message item's text as vLLM reads it: a string as it
    /// is, a list's first part's text (vLLM keeps no other part of an
    /// assistant's output), or, when that part has none, every text part
    /// joined; `None` for no content.
    fn assistant_text(&mut self, raw: Option<&RawValue>) -> Result<Option<String>, BodyError> {
        let Some(raw) = raw.filter(|r| r.get() != "null") else {
            return Ok(None);
        };
        if let Some(s) = as_string(raw) {
            return Ok(Some(s));
        }
        if !raw.get().starts_with('[') {
            return Err(invalid(
                "a message's content must be a string or a list of content parts",
            ));
        }
        let blocks = self.blocks(raw)?;
        for block in blocks.iter().skip(1) {
            if !is_text_kind(block.kind.as_deref()) {
                self.unrendered(block);
            }
        }
        let mut blocks = blocks.into_iter();
        let first = blocks.next();
        if let Some(text) = first.as_ref().and_then(|b| b.text.clone()) {
            return Ok(Some(text));
        }
        if let Some(first) = &first {
            self.unrendered(first);
        }
        let texts = blocks.filter(|b| is_text_kind(b.kind.as_deref()));
        Ok(Some(
            Join::Parts.joined(texts.filter_map(|b| b.text).collect()),
        ))
    }
}

/// A Responses conversation as vLLM 0.32 builds it from input items
/// (`entrypoints/openai/responses/utils.py`): an assistant's turn spans
/// items, its reasoning, tool calls and text merging into the assistant
/// message before them, so the template renders one assistant message
/// where the items are several.
#[derive(Default)]
struct Turns {
    messages: Vec<Message>,
}

impl Turns {
    fn last_assistant(&mut self) -> Option<&mut Message> {
        self.messages.last_mut().filter(|m| m.role == "assistant")
    }

    fn empty_assistant() -> Message {
        Message {
            role: "assistant".to_owned(),
            content: None,
            tool_calls: Vec::new(),
            reasoning: None,
        }
    }

    /// A `function_call`: the last assistant message's next tool call.
    fn tool_call(&mut self, call: ToolCall) {
        match self.last_assistant() {
            Some(last) => last.tool_calls.push(call),
            None => self.messages.push(Message {
                tool_calls: vec![call],
                ..Self::empty_assistant()
            }),
        }
    }

    /// An assistant message item: the last assistant message's text when
    /// it has none yet.
    fn assistant_text(&mut self, text: Option<String>) {
        let Some(text) = text else {
            return self.messages.push(Self::empty_assistant());
        };
        match self.last_assistant().filter(|m| m.content.is_none()) {
            Some(last) => last.content = Some(MessageContent::Text(text)),
            None => self.messages.push(message("assistant", text)),
        }
    }

    /// A reasoning item's `text`: the last assistant message's reasoning
    /// when it has none yet, else an assistant message of its own.
    fn reasoning(&mut self, text: String) {
        match self.last_assistant().filter(|m| m.reasoning.is_none()) {
            Some(last) => last.reasoning = Some(text),
            None => self.messages.push(Message {
                reasoning: Some(text),
                ..Self::empty_assistant()
            }),
        }
    }
}

/// How an engine joins a list's text blocks into one message's text
/// (vLLM 0.32: its chat messages' content parts in
/// `renderers/chat_utils.py`, its Anthropic conversion in
/// `entrypoints/anthropic/serving.py`).
#[derive(Clone, Copy)]
enum Join {
    /// A message's content parts: the non-empty ones, one a line.
    Parts,
    /// An Anthropic `tool_result`'s text items: every one, one a line.
    Lines,
    /// Anthropic's `system` blocks: the non-empty ones glued together,
    /// without Claude Code's `x-anthropic-billing-header` block (a
    /// per-request hash vLLM drops so the prefix can be cached).
    System,
}

/// What starts the line vLLM drops from a system message (an Anthropic
/// `system` text block, or a chat system message's first line): Claude
/// Code's attribution, whose hash changes on every request.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header";

impl Join {
    fn joined(self, texts: Vec<String>) -> String {
        match self {
            Join::Parts => crate::openai::joined_text(texts.iter().map(String::as_str)),
            Join::Lines => texts.join("\n"),
            Join::System => texts
                .into_iter()
                .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
                .collect(),
        }
    }
}

/// The block and part types whose `text` is prompt text.
fn is_text_kind(kind: Option<&str>) -> bool {
    matches!(kind, Some("text" | "input_text" | "output_text") | None)
}

/// The block and part types of media (images, files, audio).
fn is_media_kind(kind: Option<&str>) -> bool {
    matches!(
        kind,
        Some(
            "image"
                | "document"
                | "input_image"
                | "input_file"
                | "input_audio"
                | "image_url"
                | "file"
        )
    )
}

/// Which API's tool list [`chat_tools`] reads.
#[derive(Clone, Copy)]
enum ToolShape {
    /// `{"type": "function", "name", "description", "parameters"}`.
    Responses,
    /// `{"name", "description", "input_schema"}`.
    Messages,
}

/// A request's `tools` as the chat API's list, as engines hand them to
/// the chat template; bounded before parsing
/// ([`crate::openai::tools::tools_within`]).
fn chat_tools(
    raw: Option<&RawValue>,
    limits: &BodyLimits,
    shape: ToolShape,
) -> Result<Option<serde_json::Value>, BodyError> {
    use crate::openai::tools::{chat_tool, engine_function, tools_within, ToolsError};
    use serde_json::Value;
    let list = match tools_within(raw, limits.prompt_tokens) {
        Ok(Some(Value::Array(list))) => list,
        Ok(_) => return Ok(None),
        Err(ToolsError::TooLong) => {
            return Err(BodyError::Over(OverLimit {
                limit: Limit::PromptTokens,
                max: limits.prompt_tokens,
            }))
        }
        Err(ToolsError::NotAList) => return Err(invalid("`tools` must be a list of tools")),
    };
    // vLLM 0.32 hands a Responses request's function tools to the
    // template (the others it drops) and makes every Anthropic tool a
    // function; both as the chat API's, dumped ([`engine_function`]).
    let chat: Vec<Value> = list
        .into_iter()
        .filter_map(|tool| match (shape, tool) {
            (ToolShape::Responses, Value::Object(fields))
                if fields.get("type").and_then(Value::as_str) == Some("function") =>
            {
                Some(match fields.contains_key("function") {
                    true => chat_tool(Value::Object(fields)),
                    false => engine_function(fields, "parameters", None),
                })
            }
            (ToolShape::Responses, _) => None,
            (ToolShape::Messages, Value::Object(mut fields)) => {
                // A schema without a `type` is an object's (vLLM adds it,
                // last). A tool without a schema vLLM refuses.
                if let Some(Value::Object(schema)) = fields.get_mut("input_schema") {
                    if !schema.contains_key("type") {
                        schema.insert("type".into(), Value::from("object"));
                    }
                }
                Some(engine_function(fields, "input_schema", None))
            }
            (ToolShape::Messages, tool) => Some(tool),
        })
        .collect();
    Ok((!chat.is_empty()).then_some(Value::Array(chat)))
}

/// The text of a list's first part (a reasoning item's first content or
/// summary part), when it has one.
fn first_text(raw: Option<&RawValue>) -> Option<String> {
    #[derive(Deserialize)]
    struct Part {
        #[serde(default)]
        text: Option<String>,
    }
    /// The first element, the rest skipped unread into memory.
    struct First;
    impl<'de> Visitor<'de> for First {
        type Value = Option<Part>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of parts")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let first = seq.next_element::<Part>()?;
            while seq.next_element::<de::IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    let mut reader = serde_json::Deserializer::from_str(raw?.get());
    reader.deserialize_seq(First).ok()??.text
}

fn message(role: &str, content: String) -> Message {
    Message::text(role, content)
}

impl ResponsesRequest {
    /// Parses a `/v1/responses` body within `limits`.
    pub fn from_json(body: &[u8], limits: &BodyLimits) -> Result<Self, BodyError> {
        let top: ResponsesTop<'_> = parse_top(body)?;
        let mut parts = Parts::new(limits);
        let mut turns = Turns::default();
        if !is_null(top.instructions) {
            let text = top
                .instructions
                .and_then(as_string)
                .ok_or_else(|| invalid("`instructions` must be a string"))?;
            turns.messages.push(message("system", text));
        }
        let Some(input) = top.input.filter(|r| r.get() != "null") else {
            return Err(invalid("`input` is required"));
        };
        if let Some(text) = as_string(input) {
            turns.messages.push(message("user", text));
        } else if input.get().starts_with('[') {
            let budget = limits.messages.saturating_sub(turns.messages.len());
            let items: Vec<&RawValue> =
                bounded_list(input, budget, Limit::Messages).map_err(|e| match e {
                    BodyError::Over(_) => BodyError::Over(OverLimit {
                        limit: Limit::Messages,
                        max: limits.messages,
                    }),
                    e => e,
                })?;
            for raw in items {
                let item: Item<'_> = serde_json::from_str(raw.get()).map_err(BodyError::Json)?;
                match (item.kind.as_deref(), item.role.as_deref()) {
                    (Some("message") | None, Some("assistant")) => {
                        let text = parts.assistant_text(item.content)?;
                        turns.assistant_text(text);
                    }
                    (Some("message") | None, Some(role)) => {
                        let text = parts.text(
                            item.content,
                            "a message's content must be a string or a list of content parts",
                            Join::Parts,
                        )?;
                        turns.messages.push(message(role, text));
                    }
                    (Some("function_call"), _) => turns.tool_call(ToolCall {
                        name: item.name.unwrap_or_default(),
                        arguments: item.arguments.map(json_text).unwrap_or_default(),
                    }),
                    (Some("function_call_output"), _) => {
                        let text = parts.text(item.output, "a function_call_output's output must be a string or a list of content parts", Join::Parts)?;
                        turns.messages.push(message("tool", text));
                    }
                    (None | Some("message"), None) => {
                        return Err(invalid("an input message needs a `role`"))
                    }
                    // Reasoning is an assistant turn's: its first content
                    // part's text, else its first summary's, as vLLM reads
                    // it. Its bytes are counted as well: the template
                    // renders it only after the last user query.
                    (Some("reasoning"), _) => {
                        parts.unrendered = parts.unrendered.saturating_add(raw.get().len());
                        turns.reasoning(
                            first_text(item.content)
                                .or_else(|| first_text(item.summary))
                                .unwrap_or_default(),
                        );
                    }
                    // Other items add no message: counted.
                    (kind, _) if !is_media_kind(kind) => {
                        parts.unrendered = parts.unrendered.saturating_add(raw.get().len());
                    }
                    _ => {}
                }
            }
        } else {
            return Err(invalid("`input` must be a string or a list of input items"));
        }
        if let Some(id) = &top.previous_response_id {
            if id.len() > MAX_RESPONSE_ID_BYTES {
                return Err(invalid("`previous_response_id` is longer than 128 bytes"));
            }
        }
        let constrained = top.text.is_some_and(|t| {
            #[derive(Deserialize)]
            struct Text<'a> {
                #[serde(default, borrow)]
                format: Option<&'a RawValue>,
            }
            #[derive(Deserialize)]
            struct Format {
                #[serde(default, rename = "type")]
                kind: Option<String>,
            }
            serde_json::from_str::<Text<'_>>(t.get())
                .ok()
                .and_then(|t| t.format)
                .and_then(|f| serde_json::from_str::<Format>(f.get()).ok())
                .and_then(|f| f.kind)
                .is_some_and(|k| k != "text")
        });
        Ok(Self {
            model: top.model,
            stream: top.stream.unwrap_or(false),
            max_output_tokens: top.max_output_tokens,
            previous_response_id: top.previous_response_id.filter(|s| !s.is_empty()),
            store: top.store.unwrap_or(true),
            session_id: top.session_id,
            messages: turns.messages,
            tools: chat_tools(top.tools, limits, ToolShape::Responses)?,
            unrendered_bytes: parts.unrendered,
            constrained,
        })
    }

    /// The conversation as the equivalent chat request's messages.
    pub fn chat(&self) -> &[Message] {
        &self.messages
    }
}

impl MessagesRequest {
    /// Parses a `/v1/messages` (or `/v1/messages/count_tokens`) body
    /// within `limits`.
    pub fn from_json(body: &[u8], limits: &BodyLimits) -> Result<Self, BodyError> {
        let top: MessagesTop<'_> = parse_top(body)?;
        let mut parts = Parts::new(limits);
        let mut messages = Vec::new();
        if !is_null(top.system) {
            let text = parts.text(
                top.system,
                "`system` must be a string or a list of text blocks",
                Join::System,
            )?;
            // An empty system is none (vLLM adds no system message).
            if !text.is_empty() {
                messages.push(message("system", text));
            }
        }
        let Some(list) = top.messages.filter(|r| r.get().starts_with('[')) else {
            return Err(invalid("`messages` must be a list of messages"));
        };
        let budget = limits.messages.saturating_sub(messages.len());
        let items: Vec<Item<'_>> =
            bounded_list(list, budget, Limit::Messages).map_err(|e| match e {
                BodyError::Over(_) => BodyError::Over(OverLimit {
                    limit: Limit::Messages,
                    max: limits.messages,
                }),
                e => e,
            })?;
        if items.is_empty() {
            return Err(invalid("`messages` must not be empty"));
        }
        for item in items {
            let role = item
                .role
                .ok_or_else(|| invalid("a message needs a `role`"))?;
            let Some(content) = item.content.filter(|r| r.get() != "null") else {
                return Err(invalid("a message needs `content`"));
            };
            if let Some(text) = as_string(content) {
                messages.push(message(&role, text));
                continue;
            }
            if !content.get().starts_with('[') {
                return Err(invalid(
                    "a message's content must be a string or a list of content blocks",
                ));
            }
            // Tool results become `tool` messages (before the message's
            // own text, as the chat equivalent orders them); tool uses are
            // the assistant message's tool calls. A user message with no
            // text or media left (tool results only) is none, as vLLM
            // converts it; an assistant's stays, without content.
            let mut texts = Vec::new();
            let mut calls = Vec::new();
            let mut media = false;
            let mut thinking: Option<String> = None;
            for block in parts.blocks(content)? {
                match block.kind.as_deref() {
                    Some("tool_result") => {
                        let output = parts.text(
                            block.content,
                            "a tool_result's content must be a string or a list of content blocks",
                            Join::Lines,
                        )?;
                        messages.push(message("tool", output));
                    }
                    Some("tool_use") => calls.push(ToolCall {
                        name: block.name.unwrap_or_default(),
                        arguments: block.input.map(|i| i.get().to_owned()).unwrap_or_default(),
                    }),
                    kind if is_text_kind(kind) => texts.extend(block.text),
                    // Its thinking is the message's reasoning (its bytes
                    // counted as well: rendered only after the last query).
                    Some("thinking") if block.thinking.is_some() => {
                        parts.unrendered(&block);
                        let reasoning = thinking.get_or_insert_with(String::new);
                        reasoning.push_str(block.thinking.as_deref().unwrap_or_default());
                    }
                    kind => {
                        media |= is_media_kind(kind);
                        parts.unrendered(&block);
                    }
                }
            }
            let has_text = texts.iter().any(|t| !t.is_empty());
            if has_text || media {
                messages.push(Message {
                    tool_calls: calls,
                    reasoning: thinking,
                    ..message(&role, Join::Parts.joined(texts))
                });
            } else if role == "assistant" {
                messages.push(Message {
                    role,
                    content: None,
                    tool_calls: calls,
                    reasoning: thinking,
                });
            }
        }
        Ok(Self {
            model: top.model,
            stream: top.stream.unwrap_or(false),
            max_tokens: top.max_tokens,
            messages,
            tools: chat_tools(top.tools, limits, ToolShape::Messages)?,
            unrendered_bytes: parts.unrendered,
        })
    }

    /// The conversation as the equivalent chat request's messages.
    pub fn chat(&self) -> &[Message] {
        &self.messages
    }
}

/// Anthropic's error `type` for an HTTP status, as its API documents them
/// (400 `invalid_request_error`, also for a 4XX it does not list; 401
/// `authentication_error`; 403 `permission_error`; 404 `not_found_error`;
/// 413 `request_too_large`; 429 `rate_limit_error`; 500 `api_error`; 529
/// `overloaded_error`). Ours beside those: 410 (a stored response that
/// has expired) is `not_found_error`, 503 (no worker can take it now)
/// `overloaded_error`, any other status `api_error`. The one map of the
/// router and the sim-worker.
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 | 410 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's error body for an error of `status` with `message`:
/// `{"type": "error", "error": {"type", "message"}}` (also the `data` of
/// a Messages stream's `error` event).
pub fn anthropic_error(status: u16, message: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "error",
        "error": {"type": anthropic_error_type(status), "message": message},
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn anthropic_error_types_follow_the_documented_table() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (422, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (529, "overloaded_error"),
        ] {
            assert_eq!(super::anthropic_error_type(status), kind, "{status}");
        }
        let body = super::anthropic_error(413, "too big");
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "request_too_large");
        assert_eq!(body["error"]["message"], "too big");
    }

    use super::*;
    use crate::openai::MessageContent;

    fn roles_and_text(messages: &[Message]) -> Vec<(String, String)> {
        messages
            .iter()
            .map(|m| {
                let text = match &m.content {
                    Some(MessageContent::Text(t)) => t.clone(),
                    None => "(none)".to_owned(),
                    _ => panic!("not text"),
                };
                (m.role.clone(), text)
            })
            .collect()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(r, t)| ((*r).to_owned(), (*t).to_owned()))
            .collect()
    }

    #[test]
    fn a_responses_request_reads_as_its_chat_conversation() {
        let body = br#"{"model":"m","instructions":"Be brief.","input":[
            {"role":"user","content":"Hi"},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Hello"},{"type":"output_text","text":"!"}]},
            {"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},
            {"type":"function_call_output","call_id":"c1","output":"42"},
            {"type":"reasoning","summary":[]},
            {"role":"user","content":[{"type":"input_text","text":"More"},{"type":"input_image","image_url":"x"}]}
        ],"previous_response_id":"resp_1","stream":true,"tools":[{"type":"function"}]}"#;
        let r = ResponsesRequest::from_json(body, &BodyLimits::NONE).unwrap();
        assert_eq!(
            roles_and_text(r.chat()),
            pairs(&[
                ("system", "Be brief."),
                ("user", "Hi"),
                // vLLM reads an assistant item's first part only, and the
                // function call that follows is that message's.
                ("assistant", "Hello"),
                ("tool", "42"),
                // A reasoning item after a tool's output: an assistant
                // turn of its own, without text.
                ("assistant", "(none)"),
                ("user", "More"),
            ])
        );
        assert!(r.stream && r.tools.is_some() && r.store && !r.constrained);
        assert_eq!(
            r.chat()[2].tool_calls,
            vec![ToolCall {
                name: "f".into(),
                arguments: "{}".into()
            }]
        );
        let reasoning = r#"{"type":"reasoning","summary":[]}"#;
        assert_eq!(
            r.unrendered_bytes,
            reasoning.len(),
            "the reasoning item, not the image"
        );
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        let text = ResponsesRequest::from_json(
            br#"{"input":"Hi","text":{"format":{"type":"json_schema"}}}"#,
            &BodyLimits::NONE,
        )
        .unwrap();
        assert_eq!(roles_and_text(text.chat()), pairs(&[("user", "Hi")]));
        assert!(text.constrained);
    }

    #[test]
    fn a_messages_request_reads_as_its_chat_conversation() {
        let body = br#"{"model":"m","max_tokens":16,"system":[{"type":"text","text":"Be brief."}],"messages":[
            {"role":"user","content":"Hi"},
            {"role":"assistant","content":[{"type":"text","text":"Hello"},{"type":"tool_use","id":"t","name":"f","input":{}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"42"}]}]},
            {"role":"assistant","content":[{"type":"tool_use","id":"u","name":"f","input":{}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"u","content":"7"},{"type":"text","text":"More"}]}
        ]}"#;
        let r = MessagesRequest::from_json(body, &BodyLimits::NONE).unwrap();
        assert_eq!(
            roles_and_text(r.chat()),
            pairs(&[
                ("system", "Be brief."),
                ("user", "Hi"),
                ("assistant", "Hello"),
                ("tool", "42"),
                ("assistant", "(none)"),
                ("tool", "7"),
                ("user", "More"),
            ])
        );
        assert!(!r.stream && r.tools.is_none());
        assert_eq!(
            r.chat()[2].tool_calls,
            vec![ToolCall {
                name: "f".into(),
                arguments: "{}".into()
            }]
        );
        assert_eq!(r.unrendered_bytes, 0);
    }

    /// The prompt vLLM renders: a message's text parts one a line (empty
    /// ones skipped), a `tool_result`'s items one a line, `system` blocks
    /// glued without Claude Code's billing header, no user message left
    /// by tool results alone, no system message for an empty one.
    #[test]
    fn anthropic_blocks_join_as_vllm_joins_them() {
        let body = br#"{"max_tokens":8,"system":[
            {"type":"text","text":"x-anthropic-billing-header: cc_version=2.1; cch=0f3a;"},
            {"type":"text","text":"You are a coding agent."},
            {"type":"text","text":" Be careful."}],
            "messages":[
            {"role":"user","content":[{"type":"text","text":"<reminder>"},{"type":"text","text":""},{"type":"text","text":"Fix the bug."}]},
            {"role":"assistant","content":[{"type":"text","text":""},{"type":"tool_use","id":"t","name":"read","input":{"path":"a.rs"}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"fn a() {}"},{"type":"text","text":""},{"type":"text","text":"fn b() {}"}]},{"type":"text","text":""}]}
        ]}"#;
        let r = MessagesRequest::from_json(body, &BodyLimits::NONE).unwrap();
        assert_eq!(
            roles_and_text(r.chat()),
            pairs(&[
                ("system", "You are a coding agent. Be careful."),
                ("user", "<reminder>\nFix the bug."),
                ("assistant", "(none)"),
                ("tool", "fn a() {}\n\nfn b() {}"),
            ])
        );
        assert_eq!(r.chat()[2].tool_calls[0].name, "read");
        for system in [
            r#""""#,
            r#"[{"type":"text","text":"x-anthropic-billing-header: a"}]"#,
        ] {
            let body = format!(
                r#"{{"max_tokens":8,"system":{system},"messages":[{{"role":"user","content":"Hi"}}]}}"#
            );
            let r = MessagesRequest::from_json(body.as_bytes(), &BodyLimits::NONE).unwrap();
            assert_eq!(
                roles_and_text(r.chat()),
                pairs(&[("user", "Hi")]),
                "{system}"
            );
        }
    }

    /// An assistant's turn spans Responses items; vLLM merges them into one
    /// assistant message (text, reasoning, every tool call), and a user
    /// message's parts are one a line.
    #[test]
    fn responses_items_of_one_assistant_turn_are_one_message() {
        let body = br#"{"input":[
            {"role":"user","content":[{"type":"input_text","text":"Plan"},{"type":"input_text","text":""},{"type":"input_text","text":"then act."}]},
            {"type":"reasoning","summary":[]},
            {"type":"function_call","call_id":"a","name":"ls","arguments":"{}"},
            {"type":"function_call","call_id":"b","name":"cat","arguments":"{\"f\":1}"},
            {"type":"function_call_output","call_id":"a","output":"x"},
            {"type":"function_call_output","call_id":"b","output":"y"},
            {"type":"function_call","call_id":"c","name":"ls","arguments":"{}"},
            {"type":"message","role":"assistant","content":[{"type":"output_text","text":"Done."}]},
            {"type":"reasoning","summary":[]},
            {"type":"reasoning","summary":[]}
        ]}"#;
        let r = ResponsesRequest::from_json(body, &BodyLimits::NONE).unwrap();
        assert_eq!(
            roles_and_text(r.chat()),
            pairs(&[
                ("user", "Plan\nthen act."),
                ("assistant", "(none)"),
                ("tool", "x"),
                ("tool", "y"),
                // The text after a tool call-only turn is that turn's.
                ("assistant", "Done."),
                // A second reasoning item is a turn of its own.
                ("assistant", "(none)"),
            ])
        );
        let names = |i: usize| -> Vec<String> {
            r.chat()[i]
                .tool_calls
                .iter()
                .map(|c| c.name.clone())
                .collect()
        };
        assert_eq!(names(1), ["ls", "cat"]);
        assert_eq!(names(4), ["ls"]);
        assert!(r.chat()[5].tool_calls.is_empty());
    }

    #[test]
    fn tools_read_as_the_chat_apis_list_and_thinking_is_counted() {
        let body = br#"{"max_tokens":8,"tools":[{"name":"grep","description":"search","input_schema":{"type":"object"}},{"name":"ls","input_schema":{"properties":{}},"strict":true},{"type":"web_search_20250305","name":"web"}],
            "messages":[{"role":"user","content":"Hi"},
            {"role":"assistant","content":[{"type":"thinking","thinking":"hmm","signature":"s"},{"type":"tool_use","id":"t","name":"grep","input":{"q":"x"}}]},
            {"role":"user","content":[{"type":"image","source":{"type":"base64","data":"AAAA"}},{"type":"text","text":"this"}]}]}"#;
        let r = MessagesRequest::from_json(body, &BodyLimits::NONE).unwrap();
        assert_eq!(
            r.tools,
            Some(serde_json::json!([
                {"type": "function", "function": {"name": "grep", "description": "search", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "ls", "description": null, "parameters": {"properties": {}, "type": "object"}, "strict": true}},
                // vLLM refuses a tool without a schema; read as it reads it.
                {"type": "function", "function": {"name": "web", "description": null, "parameters": null}}
            ]))
        );
        assert_eq!(r.chat()[1].tool_calls[0].arguments, r#"{"q":"x"}"#);
        let thinking = r#"{"type":"thinking","thinking":"hmm","signature":"s"}"#;
        assert_eq!(
            r.unrendered_bytes,
            thinking.len(),
            "thinking counted, the image not"
        );
        let responses = br#"{"input":"Hi","tools":[{"type":"function","name":"f","description":"d","parameters":{"type":"object"},"strict":true}]}"#;
        let r = ResponsesRequest::from_json(responses, &BodyLimits::NONE).unwrap();
        assert_eq!(
            r.tools,
            Some(serde_json::json!([
                {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true}}
            ]))
        );
    }

    #[test]
    fn tools_past_the_prompt_limit_are_refused_unparsed() {
        let limits = BodyLimits {
            prompt_tokens: 4,
            ..BodyLimits::NONE
        };
        let body = format!(
            r#"{{"input":"x","tools":[{{"type":"function","name":"{}"}}]}}"#,
            "n".repeat(100)
        );
        match ResponsesRequest::from_json(body.as_bytes(), &limits) {
            Err(BodyError::Over(o)) => assert_eq!((o.limit, o.max), (Limit::PromptTokens, 4)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn lists_past_their_bounds_are_refused_naming_the_bound() {
        let limits = BodyLimits {
            messages: 2,
            content_parts: 2,
            ..BodyLimits::NONE
        };
        let three = br#"{"input":[{"role":"user","content":"a"},{"role":"user","content":"b"},{"role":"user","content":"c"}]}"#;
        match ResponsesRequest::from_json(three, &limits) {
            Err(BodyError::Over(o)) => assert_eq!((o.limit, o.max), (Limit::Messages, 2)),
            other => panic!("{other:?}"),
        }
        let parts = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user","content":[{"type":"text","text":"c"}]}]}"#;
        match MessagesRequest::from_json(parts, &limits) {
            Err(BodyError::Over(o)) => assert_eq!((o.limit, o.max), (Limit::ContentParts, 2)),
            other => panic!("{other:?}"),
        }
        let long = format!(
            r#"{{"input":"x","previous_response_id":"{}"}}"#,
            "a".repeat(200)
        );
        assert!(matches!(
            ResponsesRequest::from_json(long.as_bytes(), &BodyLimits::NONE),
            Err(BodyError::Json(_))
        ));
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        for body in [
            &b"{}"[..],
            b"[]",
            br#"{"input":5}"#,
            br#"{"input":[{"content":"no role"}]}"#,
            br#"{"input":"x","instructions":[1]}"#,
            br#"{"messages":[]}"#,
            br#"{"messages":[{"role":"user"}]}"#,
            br#"{"messages":[{"role":"user","content":7}]}"#,
            br#"{"messages":"x"}"#,
        ] {
            let r = ResponsesRequest::from_json(body, &BodyLimits::NONE).map(|_| ());
            let m = MessagesRequest::from_json(body, &BodyLimits::NONE).map(|_| ());
            assert!(
                r.is_err() || m.is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
