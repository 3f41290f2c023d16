//! Mid-stream resume of the Responses and Messages APIs, sans I/O: which
//! requests a broken stream may be resumed for ([`resumable`], one
//! allow-list per API), the `/v1/completions` body that resumes them
//! ([`resume_body`]), and the rewrite of the resumed worker's completion
//! chunks into events that continue the client's stream ([`Resume`]).
//!
//! The migration itself is chat's ([`crate::resume`], and in the router
//! the same decision, progress bounds, limits and stream mover): the
//! prompt's token ids as the router rendered them, followed by the
//! generated tokens' ids (the streamed text, re-tokenized at migration),
//! sent as `/v1/completions` with the output limit reduced.
//!
//! Resumed: plain text streams. A Messages request whose every field is
//! on [`MESSAGES_FIELDS`] (no `tools`, `tool_choice` or `thinking`) and
//! whose messages are text; a Responses request with `store: false`, text
//! input, no tools and no `text.format` other than text. Everything else
//! ends a broken stream with the API's error event saying why: a stored
//! response resumed on another worker would be stored nowhere (its
//! `previous_response_id` chain would break), tools and structured output
//! cannot be reproduced by a token-id completion.
//!
//! The client sees one coherent answer: a Messages stream goes on with
//! `content_block_delta` events of the same block, then
//! `content_block_stop`, `message_delta` (its `stop_reason` from the
//! completion's `finish_reason`, `usage.output_tokens` the whole answer's)
//! and `message_stop`; a Responses stream goes on with
//! `response.output_text.delta` events of the same item, part and
//! continuing `sequence_number`, then `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done` and
//! `response.completed` (or `response.incomplete` at the output limit)
//! with the whole text and usage. Memory: a Responses stream keeps its
//! generated text (for the closing events), bounded by the migration's
//! text cap; past it the stream is no longer resumable.

use crate::agentic::AgenticApi;
use crate::agentic_events::{messages, response_usage, AgenticEvent, ResponsesEvents, TextItem};
use crate::body_fields::{self, Fields};
use crate::resume as migration;
use crate::sse::{Delta, NamedEvent};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::borrow::Cow;

/// Fields of a Messages request the resume carries or rebuilds
/// (`metadata` and `service_tier` change nothing generated).
const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
    "service_tier",
];

/// Fields of a Responses request the resume carries or rebuilds (`store`,
/// `text` and the tools' fields are judged apart; `truncation` is not
/// here: a worker that truncated the input generated from another prompt
/// than the routed one).
const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "stream",
    "temperature",
    "top_p",
    "user",
    "metadata",
    "session_id",
    "service_tier",
];

const TOOLS: &str =
    "it uses tools (`tools` or `tool_choice`), which a resumed request cannot reproduce";

/// Whether a broken stream of this request may be resumed on another
/// worker: `Ok` only when every field is one the resume reproduces. The
/// one place that says so per API; `Err` names fields, never content.
pub fn resumable(api: AgenticApi, body: &Fields<'_>) -> Result<(), &'static str> {
    match api {
        AgenticApi::Messages => messages_resumable(body),
        AgenticApi::Responses => responses_resumable(body),
    }
}

fn messages_resumable(body: &Fields<'_>) -> Result<(), &'static str> {
    for (key, value) in body.iter() {
        match key {
            "messages" => body_fields::messages_are_plain(value)?,
            "system" => body_fields::plain_content(value)?,
            "tool_choice" => return Err(TOOLS),
            "tools" if value.get().trim() == "[]" => {}
            "tools" => return Err(TOOLS),
            "thinking" => return Err(
                "it asks for extended thinking (`thinking`), which a resumed request cannot reproduce",
            ),
            k if MESSAGES_FIELDS.contains(&k) => {}
            _ => return Err(UNKNOWN),
        }
    }
    Ok(())
}

const UNKNOWN: &str = "it sets a field the router does not know how to carry to another worker";

fn responses_resumable(body: &Fields<'_>) -> Result<(), &'static str> {
    // `store` defaults to true: a stored response lives on the worker
    // that answers it, so a resumed one would be stored nowhere.
    if body.get("store").map(|v| v.get().trim()) != Some("false") {
        return Err("it is stored (`store` is not false): a response resumed on another worker would be stored nowhere and break its `previous_response_id` chain; send `store: false` to have broken streams resumed");
    }
    for (key, value) in body.iter() {
        match key {
            "store" => {}
            "input" => responses_input_is_plain(value)?,
            "instructions" if body_fields::is_string(value) => {}
            "instructions" => return Err("its instructions are not text"),
            "tool_choice" | "parallel_tool_calls" if !body.has("tools") => {}
            "tools" if value.get().trim() == "[]" => {}
            "tools" | "tool_choice" => return Err(TOOLS),
            "text" if text_is_plain(value) => {}
            "text" => return Err("it constrains the output (`text.format`), which a resumed request cannot reproduce"),
            "previous_response_id" => {
                return Err("it continues a stored response, which only its worker has")
            }
            "reasoning" => return Err("it asks for reasoning (`reasoning`), which a resumed request cannot reproduce"),
            k if RESPONSES_FIELDS.contains(&k) => {}
            _ => return Err(UNKNOWN),
        }
    }
    Ok(())
}

/// `text` without a format, or with `{"type": "text"}`.
fn text_is_plain(text: &RawValue) -> bool {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Text<'a> {
        #[serde(default, borrow)]
        format: Option<&'a RawValue>,
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Format<'a> {
        #[serde(rename = "type", borrow)]
        kind: Cow<'a, str>,
    }
    match serde_json::from_str::<Text<'_>>(text.get()) {
        Ok(Text { format: None }) => true,
        Ok(Text { format: Some(f) }) => {
            f.get().trim() == "null"
                || serde_json::from_str::<Format<'_>>(f.get()).is_ok_and(|f| f.kind == "text")
        }
        Err(_) => false,
    }
}

/// `input` as text: a string, or message items of a system, user or
/// assistant role whose content is a string or one text part.
fn responses_input_is_plain(input: &RawValue) -> Result<(), &'static str> {
    if body_fields::is_string(input) {
        return Ok(());
    }
    // Fields read only to be allowed (`deny_unknown_fields`).
    #[allow(dead_code)]
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Item<'a> {
        #[serde(default, rename = "type", borrow)]
        kind: Option<Cow<'a, str>>,
        #[serde(borrow)]
        role: Cow<'a, str>,
        #[serde(borrow)]
        content: &'a RawValue,
        #[serde(default, borrow)]
        status: Option<&'a RawValue>,
        #[serde(default, borrow)]
        id: Option<&'a RawValue>,
    }
    #[allow(dead_code)]
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Part<'a> {
        #[serde(rename = "type", borrow)]
        kind: Cow<'a, str>,
        #[serde(borrow)]
        text: Cow<'a, str>,
        #[serde(default, borrow)]
        annotations: Option<&'a RawValue>,
    }
    let Ok(items) = serde_json::from_str::<Vec<Item<'_>>>(input.get()) else {
        return Err("its input has items other than text messages (function calls, images, ...)");
    };
    for item in items {
        if item.kind.as_deref().is_some_and(|k| k != "message") {
            return Err(
                "its input has items other than text messages (function calls, images, ...)",
            );
        }
        if !matches!(item.role.as_ref(), "system" | "user" | "assistant") {
            return Err("its input has a message whose role is not system, user or assistant");
        }
        if body_fields::is_string(item.content) {
            continue;
        }
        match serde_json::from_str::<Vec<Part<'_>>>(item.content.get()) {
            Ok(parts)
                if parts.len() == 1
                    && matches!(
                        parts[0].kind.as_ref(),
                        "input_text" | "output_text" | "text"
                    ) => {}
            Ok(parts) if parts.len() > 1 => {
                return Err("it has a message made of several text parts")
            }
            _ => return Err("it has image, file or other non-text content parts"),
        }
    }
    Ok(())
}

/// The request's output limit (`max_tokens`, `max_output_tokens`).
pub fn max_tokens(api: AgenticApi, body: &Fields<'_>) -> Option<u64> {
    let name = match api {
        AgenticApi::Messages => "max_tokens",
        AgenticApi::Responses => "max_output_tokens",
    };
    body.count(name).map(u64::from)
}

/// The `/v1/completions` body that resumes `original` (a resumable
/// request of `api`): its sampling fields under their completion names,
/// then chat's [`migration::resume_body`].
pub fn resume_body(
    api: AgenticApi,
    original: &Fields<'_>,
    prompt_ids: &[u32],
    remaining: Option<u64>,
) -> Vec<u8> {
    let mut carried = Fields::default();
    let names: &[(&str, &str)] = match api {
        AgenticApi::Messages => &[
            ("model", "model"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("stop_sequences", "stop"),
        ],
        AgenticApi::Responses => &[
            ("model", "model"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("user", "user"),
            ("session_id", "session_id"),
        ],
    };
    for (from, to) in names {
        if let Some(v) = original.get(from) {
            carried.set_raw(to, v.to_owned());
        }
    }
    migration::resume_body(&carried, prompt_ids, remaining)
}

/// What the client's stream has shown so far, and the rewrite of a
/// resumed worker's completion chunks into its continuation.
#[derive(Debug)]
pub struct Resume {
    api: AgenticApi,
    /// Messages: the open text block's index.
    block: Option<u64>,
    /// Messages: the index a new block would get.
    next_block: u64,
    /// Responses: the text item, part and output index.
    item: Option<TextItem>,
    /// Responses: the event writer (its next `sequence_number`).
    events: ResponsesEvents,
    /// Responses: the response object of `response.created` (bounded by
    /// the event size limit).
    response: Option<Value>,
    /// Responses: the text so far (for the closing events).
    text: String,
    text_cap: usize,
    overflowed: bool,
    /// The text block (part) was closed: the generation is complete.
    closed: bool,
    /// The closing events were sent.
    ended: bool,
    /// Fallback id of a Responses item begun by the router.
    fallback_id: String,
}

#[derive(Deserialize)]
struct Seen<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(default, borrow)]
    item_id: Option<Cow<'a, str>>,
    #[serde(default)]
    output_index: Option<u64>,
    #[serde(default)]
    content_index: Option<u64>,
    #[serde(default, borrow)]
    delta: Option<&'a RawValue>,
    #[serde(default, borrow)]
    content_block: Option<&'a RawValue>,
    #[serde(default, borrow)]
    part: Option<&'a RawValue>,
    #[serde(default)]
    response: Option<Value>,
}

#[derive(Deserialize)]
struct Typed<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

impl Resume {
    /// A stream of `api` not yet begun; `text_cap` bounds kept text,
    /// `client` names an item the router has to begin.
    pub fn new(api: AgenticApi, text_cap: usize, client: impl std::fmt::Display) -> Self {
        Self {
            api,
            block: None,
            next_block: 0,
            item: None,
            events: ResponsesEvents::default(),
            response: None,
            text: String::new(),
            text_cap,
            overflowed: false,
            closed: false,
            ended: false,
            fallback_id: format!("msg_{client}"),
        }
    }

    /// The next Responses `sequence_number`.
    pub fn sequence(&self) -> u64 {
        self.events.sequence()
    }

    /// Whether the kept text outgrew its bound (not resumable).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Whether the answer's text was closed by the first worker (every
    /// token arrived; only the last events were lost).
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Records one event forwarded to the client; returns its text delta.
    pub fn observe(&mut self, data: &str) -> Option<String> {
        let seen = serde_json::from_str::<Seen<'_>>(data).ok()?;
        if let Some(n) = seen.sequence_number {
            self.events.seen(n);
        }
        match (self.api, seen.kind.as_ref()) {
            (AgenticApi::Messages, "content_block_start") => {
                let index = seen.index.unwrap_or(self.next_block);
                self.next_block = self.next_block.max(index.saturating_add(1));
                let text = seen
                    .content_block
                    .and_then(|b| serde_json::from_str::<Typed<'_>>(b.get()).ok())
                    .is_some_and(|b| b.kind == "text");
                self.block = text.then_some(index);
                None
            }
            (AgenticApi::Messages, "content_block_delta") => {
                let delta = serde_json::from_str::<Typed<'_>>(seen.delta?.get()).ok()?;
                (delta.kind == "text_delta").then(|| delta.text.unwrap_or_default().into_owned())
            }
            (AgenticApi::Messages, "content_block_stop") => {
                if seen.index == self.block {
                    self.closed = true;
                }
                None
            }
            (AgenticApi::Responses, "response.created" | "response.in_progress") => {
                if seen.response.is_some() {
                    self.response = seen.response;
                }
                None
            }
            (AgenticApi::Responses, "response.content_part.added") => {
                let text = seen
                    .part
                    .and_then(|p| serde_json::from_str::<Typed<'_>>(p.get()).ok())
                    .is_some_and(|p| p.kind == "output_text");
                if text {
                    self.item = Some(TextItem {
                        item_id: seen.item_id.unwrap_or_default().into_owned(),
                        output_index: seen.output_index.unwrap_or(0),
                        content_index: seen.content_index.unwrap_or(0),
                    });
                }
                None
            }
            (AgenticApi::Responses, "response.output_text.delta") => {
                let delta = serde_json::from_str::<Cow<'_, str>>(seen.delta?.get()).ok()?;
                self.item = Some(TextItem {
                    item_id: seen.item_id.unwrap_or_default().into_owned(),
                    output_index: seen.output_index.unwrap_or(0),
                    content_index: seen.content_index.unwrap_or(0),
                });
                self.keep(&delta);
                Some(delta.into_owned())
            }
            (AgenticApi::Responses, "response.output_text.done") => {
                self.closed = true;
                None
            }
            _ => None,
        }
    }

    /// Keeps a Responses stream's text, within the cap.
    fn keep(&mut self, text: &str) {
        if self.overflowed {
            return;
        }
        if self.text.len().saturating_add(text.len()) > self.text_cap {
            self.overflowed = true;
            self.text = String::new();
        } else {
            self.text.push_str(text);
        }
    }

    /// Events as the bytes of the client's stream.
    fn write(out: &mut Vec<u8>, events: impl IntoIterator<Item = AgenticEvent>) {
        for e in events {
            out.extend(NamedEvent::new(Some(e.name), &e.data_text()).into_bytes());
        }
    }

    /// The text item, begun by the router when the first worker never
    /// began one (events appended to `out`).
    fn text_item(&mut self, out: &mut Vec<u8>) -> TextItem {
        if let Some(item) = &self.item {
            return item.clone();
        }
        let item = TextItem::first(self.fallback_id.clone());
        Self::write(out, self.events.text_begins(&item));
        self.item = Some(item.clone());
        item
    }

    /// A resumed worker's chunk as the client's events. `generated` is
    /// the whole answer's output tokens so far (this chunk's included),
    /// `prompt_tokens` its prompt's.
    pub fn rewrite(&mut self, delta: &Delta, generated: u64, prompt_tokens: u64) -> Vec<u8> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        if let Some(text) = delta.text.as_deref().filter(|t| !t.is_empty()) {
            match self.api {
                AgenticApi::Messages => {
                    let index = match self.block {
                        Some(index) => index,
                        None => {
                            let index = self.next_block;
                            self.next_block = index.saturating_add(1);
                            self.block = Some(index);
                            Self::write(&mut out, [messages::text_block_start(index)]);
                            index
                        }
                    };
                    Self::write(&mut out, [messages::text_delta(index, text)]);
                }
                AgenticApi::Responses => {
                    let item = self.text_item(&mut out);
                    self.keep(text);
                    Self::write(&mut out, [self.events.text_delta(&item, text)]);
                }
            }
        }
        if let Some(reason) = delta.finish_reason.as_deref() {
            out.extend(self.finish(reason, generated, prompt_tokens));
        }
        out
    }

    /// The closing events: `reason` is the completion's `finish_reason`
    /// (`length`: the output limit was reached).
    pub fn finish(&mut self, reason: &str, generated: u64, prompt_tokens: u64) -> Vec<u8> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        self.ended = true;
        let length = reason == "length";
        match self.api {
            AgenticApi::Messages => {
                if let Some(index) = self.block.filter(|_| !self.closed) {
                    Self::write(&mut out, [messages::block_stop(index)]);
                }
                let usage = json!({"output_tokens": generated});
                Self::write(&mut out, [messages::delta(length, usage), messages::stop()]);
            }
            AgenticApi::Responses => {
                let item = self.text_item(&mut out);
                let text = std::mem::take(&mut self.text);
                if !self.closed {
                    Self::write(&mut out, self.events.text_done(&item, &text));
                }
                let done = self.events.item_done(&item, &text);
                let mut response = self.response.take().unwrap_or_else(|| json!({}));
                response["status"] = json!(if length { "incomplete" } else { "completed" });
                response["output"] = json!([done.data["item"]]);
                response["incomplete_details"] = if length {
                    json!({"reason": "max_output_tokens"})
                } else {
                    Value::Null
                };
                response["usage"] = response_usage(prompt_tokens, 0, generated);
                let ended = self.events.ended(&response, length);
                Self::write(&mut out, [done, ended]);
            }
        }
        out
    }
}

#[cfg(test)]
#[path = "agentic_tests.rs"]
mod tests;
