//! The Responses and Anthropic Messages APIs' stream events, written: the
//! one writer the simulated worker's streams and the router's resumed
//! streams share, so both send the same events in the same shapes (names,
//! `type`, Responses' `sequence_number`, items, parts, stop reasons and
//! usage).
//!
//! A Responses stream of text is `response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`...,
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`, then `response.completed` (or
//! `response.incomplete` at the output limit), numbered from 0 by
//! `sequence_number` ([`ResponsesEvents`]). A Messages stream of text is
//! `message_start`, `content_block_start`, `content_block_delta`...,
//! `content_block_stop`, `message_delta` (the stop reason and usage),
//! `message_stop` ([`messages`]). Names and shapes follow vLLM's
//! `/v1/responses` and Anthropic's streaming documentation.
//!
//! Read, for a router relaying them: what an event means ([`classify`]:
//! a stored response's id, generated text, the end, an error), a whole
//! answer's output tokens and response id ([`output_tokens`],
//! [`response_id`]), and the event that ends a broken stream in the API's
//! own shape ([`error_event`]).

use crate::agentic::AgenticApi;
use serde::Deserialize;
use serde_json::{json, Value};

/// One event: its name (the SSE `event:` line) and its data, whose `type`
/// is the name too.
#[derive(Clone, Debug, PartialEq)]
pub struct AgenticEvent {
    /// The event's name.
    pub name: &'static str,
    /// Its JSON data.
    pub data: Value,
}

impl AgenticEvent {
    fn new(name: &'static str, mut data: Value) -> Self {
        data["type"] = json!(name);
        Self { name, data }
    }

    /// The data line's text.
    pub fn data_text(&self) -> String {
        self.data.to_string()
    }
}

/// Where a Responses stream's text goes: its message item and the text
/// part in it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextItem {
    /// The message item's id (`msg_...`).
    pub item_id: String,
    /// The item's index in the response's output.
    pub output_index: u64,
    /// The text part's index in the item's content.
    pub content_index: u64,
}

impl TextItem {
    /// The first item of a response, its first part.
    pub fn first(item_id: impl Into<String>) -> Self {
        Self {
            item_id: item_id.into(),
            output_index: 0,
            content_index: 0,
        }
    }
}

/// A text part of a Responses message.
pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// A Responses message item: in progress and empty, or completed with
/// `text`.
pub fn response_message(item_id: &str, text: Option<&str>) -> Value {
    match text {
        Some(text) => {
            json!({"type": "message", "id": item_id, "status": "completed", "role": "assistant", "content": [output_text(text)]})
        }
        None => {
            json!({"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
        }
    }
}

/// A response's `usage`.
pub fn response_usage(prompt_tokens: u64, cached_tokens: u64, output_tokens: u64) -> Value {
    json!({
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens.saturating_add(output_tokens),
    })
}

/// A Responses stream's events, each numbered by `sequence_number` in the
/// order written.
#[derive(Clone, Debug, Default)]
pub struct ResponsesEvents {
    next: u64,
}

impl ResponsesEvents {
    /// A stream whose next event is numbered `sequence`.
    pub fn from_sequence(sequence: u64) -> Self {
        Self { next: sequence }
    }

    /// The next event's number.
    pub fn sequence(&self) -> u64 {
        self.next
    }

    /// Event `sequence` was sent by someone else (a worker whose stream
    /// this one continues): the next is numbered after it.
    pub fn seen(&mut self, sequence: u64) {
        self.next = self.next.max(sequence.saturating_add(1));
    }

    /// Any event of the stream, numbered.
    pub fn event(&mut self, name: &'static str, mut data: Value) -> AgenticEvent {
        data["sequence_number"] = json!(self.next);
        self.next = self.next.saturating_add(1);
        AgenticEvent::new(name, data)
    }

    /// `response.created` with the response as it begins.
    pub fn created(&mut self, response: &Value) -> AgenticEvent {
        self.event("response.created", json!({"response": response}))
    }

    /// `response.in_progress`.
    pub fn in_progress(&mut self, response: &Value) -> AgenticEvent {
        self.event("response.in_progress", json!({"response": response}))
    }

    /// The text item and its part begin: `response.output_item.added`,
    /// `response.content_part.added`.
    pub fn text_begins(&mut self, item: &TextItem) -> [AgenticEvent; 2] {
        [
            self.event(
                "response.output_item.added",
                json!({"output_index": item.output_index, "item": response_message(&item.item_id, None)}),
            ),
            self.event(
                "response.content_part.added",
                json!({"item_id": item.item_id, "output_index": item.output_index, "content_index": item.content_index, "part": output_text("")}),
            ),
        ]
    }

    /// `response.output_text.delta`.
    pub fn text_delta(&mut self, item: &TextItem, delta: &str) -> AgenticEvent {
        self.event(
            "response.output_text.delta",
            json!({"item_id": item.item_id, "output_index": item.output_index, "content_index": item.content_index, "delta": delta, "logprobs": []}),
        )
    }

    /// The text is whole: `response.output_text.done`,
    /// `response.content_part.done`.
    pub fn text_done(&mut self, item: &TextItem, text: &str) -> [AgenticEvent; 2] {
        [
            self.event(
                "response.output_text.done",
                json!({"item_id": item.item_id, "output_index": item.output_index, "content_index": item.content_index, "text": text, "logprobs": []}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": item.item_id, "output_index": item.output_index, "content_index": item.content_index, "part": output_text(text)}),
            ),
        ]
    }

    /// `response.output_item.done`: the completed message item.
    pub fn item_done(&mut self, item: &TextItem, text: &str) -> AgenticEvent {
        self.event(
            "response.output_item.done",
            json!({"output_index": item.output_index, "item": response_message(&item.item_id, Some(text))}),
        )
    }

    /// `error`: the stream ends without an answer (a server error).
    pub fn error(&mut self, message: &str) -> AgenticEvent {
        self.event(
            "error",
            json!({"code": "server_error", "message": message, "param": null}),
        )
    }

    /// The last event: `response.completed`, or `response.incomplete` when
    /// the output limit ended the answer (`at_limit`).
    pub fn ended(&mut self, response: &Value, at_limit: bool) -> AgenticEvent {
        let name = if at_limit {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.event(name, json!({"response": response}))
    }
}

/// Messages stream events (no numbering).
pub mod messages {
    use super::AgenticEvent;
    use serde_json::{json, Value};

    /// The stop reason of an answer that ended at the output limit
    /// (`at_limit`) or by itself.
    pub fn stop_reason(at_limit: bool) -> &'static str {
        if at_limit {
            "max_tokens"
        } else {
            "end_turn"
        }
    }

    /// `message_start` with the message as it begins.
    pub fn start(message: &Value) -> AgenticEvent {
        AgenticEvent::new("message_start", json!({"message": message}))
    }

    /// `content_block_start` of text block `index`.
    pub fn text_block_start(index: u64) -> AgenticEvent {
        AgenticEvent::new(
            "content_block_start",
            json!({"index": index, "content_block": {"type": "text", "text": ""}}),
        )
    }

    /// `content_block_delta` of text to block `index`.
    pub fn text_delta(index: u64, text: &str) -> AgenticEvent {
        AgenticEvent::new(
            "content_block_delta",
            json!({"index": index, "delta": {"type": "text_delta", "text": text}}),
        )
    }

    /// `content_block_stop` of block `index`.
    pub fn block_stop(index: u64) -> AgenticEvent {
        AgenticEvent::new("content_block_stop", json!({"index": index}))
    }

    /// `message_delta`: the stop reason and the answer's `usage`.
    pub fn delta(at_limit: bool, usage: Value) -> AgenticEvent {
        AgenticEvent::new(
            "message_delta",
            json!({"delta": {"stop_reason": stop_reason(at_limit), "stop_sequence": null}, "usage": usage}),
        )
    }

    /// `message_stop`.
    pub fn stop() -> AgenticEvent {
        AgenticEvent::new("message_stop", json!({}))
    }

    /// `error`: the stream ends without an answer (Anthropic's
    /// `api_error`).
    pub fn error(message: &str) -> AgenticEvent {
        AgenticEvent::new("error", crate::agentic::anthropic_error(500, message))
    }
}

/// What one streamed event of either API means to a router relaying it.
#[derive(Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `response.created`: the response's id.
    Created(String),
    /// Generated text.
    Delta,
    /// The last event of a complete answer.
    End,
    /// An error event (the stream ends after it).
    Error,
    /// Anything else (forwarded, nothing to note).
    Other,
}

#[derive(Deserialize)]
struct Typed<'a> {
    #[serde(default, borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Created {
    response: Identified,
}

#[derive(Deserialize)]
struct Identified {
    #[serde(default)]
    id: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    usage: Option<OutputTokens>,
}

#[derive(Deserialize)]
struct OutputTokens {
    #[serde(default)]
    output_tokens: Option<u64>,
}

/// An event's meaning in `api`'s stream, from its data's `type`.
pub fn classify(api: AgenticApi, data: &str) -> EventKind {
    let Ok(Typed { kind: Some(kind) }) = serde_json::from_str::<Typed<'_>>(data) else {
        return EventKind::Other;
    };
    match (api, kind.as_ref()) {
        (_, "error") => EventKind::Error,
        (AgenticApi::Responses, "response.created") => {
            match serde_json::from_str::<Created>(data) {
                Ok(Created {
                    response: Identified { id: Some(id) },
                }) => EventKind::Created(id),
                _ => EventKind::Other,
            }
        }
        (AgenticApi::Responses, "response.output_text.delta")
        | (AgenticApi::Messages, "content_block_delta") => EventKind::Delta,
        (AgenticApi::Responses, "response.completed" | "response.incomplete")
        | (AgenticApi::Messages, "message_stop") => EventKind::End,
        (AgenticApi::Responses, "response.failed") => EventKind::Error,
        _ => EventKind::Other,
    }
}

/// A whole answer's output tokens (`usage.output_tokens` in both APIs; 0
/// when absent or unreadable).
pub fn output_tokens(answer: &[u8]) -> u64 {
    serde_json::from_slice::<Usage>(answer)
        .ok()
        .and_then(|u| u.usage)
        .and_then(|u| u.output_tokens)
        .unwrap_or(0)
}

/// A whole answer's top-level `id` (a Responses answer's response id).
pub fn response_id(answer: &[u8]) -> Option<String> {
    serde_json::from_slice::<Identified>(answer).ok()?.id
}

/// The event that ends a broken stream of `api`, in its own shape, as SSE
/// bytes; `sequence` numbers a Responses event.
pub fn error_event(api: AgenticApi, message: &str, sequence: u64) -> Vec<u8> {
    let e = match api {
        AgenticApi::Messages => messages::error(message),
        AgenticApi::Responses => ResponsesEvents::from_sequence(sequence).error(message),
    };
    crate::sse::NamedEvent::new(Some(e.name), &e.data_text()).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_responses_stream_is_numbered_in_order_and_continues_after_what_was_seen() {
        let mut w = ResponsesEvents::default();
        let item = TextItem::first("msg_1");
        let created = w.created(&json!({"id": "resp_1"}));
        assert_eq!(created.name, "response.created");
        assert_eq!(created.data["type"], "response.created");
        assert_eq!(created.data["sequence_number"], 0);
        let [added, part] = w.text_begins(&item);
        assert_eq!(
            (
                added.data["sequence_number"].as_u64(),
                part.data["sequence_number"].as_u64()
            ),
            (Some(1), Some(2))
        );
        assert_eq!(added.data["item"]["status"], "in_progress");
        assert_eq!(part.data["part"]["type"], "output_text");
        // A worker's events up to 7 went by: the next is 8.
        w.seen(7);
        w.seen(3);
        let delta = w.text_delta(&item, "hi");
        assert_eq!(delta.data["sequence_number"], 8);
        assert_eq!(delta.data["delta"], "hi");
        let [done, part_done] = w.text_done(&item, "hi there");
        assert_eq!(done.data["text"], "hi there");
        assert_eq!(part_done.data["part"]["text"], "hi there");
        let item_done = w.item_done(&item, "hi there");
        assert_eq!(item_done.data["item"]["status"], "completed");
        assert_eq!(item_done.data["item"]["content"][0]["text"], "hi there");
        assert_eq!(w.ended(&json!({}), true).name, "response.incomplete");
        assert_eq!(w.ended(&json!({}), false).name, "response.completed");
        assert_eq!(w.sequence(), 14);
        let error = ResponsesEvents::from_sequence(5).error("gone");
        assert_eq!(
            (error.name, error.data["sequence_number"].as_u64()),
            ("error", Some(5))
        );
        assert_eq!(error.data["code"], "server_error");
    }

    #[test]
    fn a_messages_stream_names_its_blocks_and_stop_reason() {
        let start = messages::text_block_start(2);
        assert_eq!(start.name, "content_block_start");
        assert_eq!(start.data["index"], 2);
        assert_eq!(start.data["content_block"]["type"], "text");
        let delta = messages::text_delta(2, "x");
        assert_eq!(
            (
                delta.data["type"].as_str(),
                delta.data["delta"]["text"].as_str()
            ),
            (Some("content_block_delta"), Some("x"))
        );
        let end = messages::delta(true, json!({"output_tokens": 3}));
        assert_eq!(end.data["delta"]["stop_reason"], "max_tokens");
        assert_eq!(end.data["usage"]["output_tokens"], 3);
        assert_eq!(
            messages::delta(false, json!({})).data["delta"]["stop_reason"],
            "end_turn"
        );
        assert_eq!(messages::stop().data_text(), r#"{"type":"message_stop"}"#);
        assert!(delta.data.get("sequence_number").is_none());
        let error = messages::error("gone");
        assert_eq!(
            (error.name, &error.data["error"]["type"]),
            ("error", &json!("api_error"))
        );
    }

    #[test]
    fn usage_totals_prompt_and_output() {
        let u = response_usage(10, 4, 3);
        assert_eq!(u["total_tokens"], 13);
        assert_eq!(u["input_tokens_details"]["cached_tokens"], 4);
    }

    #[test]
    fn relayed_events_are_read_by_their_type() {
        let r = AgenticApi::Responses;
        assert_eq!(
            classify(
                r,
                r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","output":[]}}"#
            ),
            EventKind::Created("resp_1".into())
        );
        assert_eq!(
            classify(r, r#"{"type":"response.output_text.delta","delta":"x"}"#),
            EventKind::Delta
        );
        assert_eq!(
            classify(r, r#"{"type":"response.completed","response":{}}"#),
            EventKind::End
        );
        assert_eq!(
            classify(r, r#"{"type":"response.failed","response":{}}"#),
            EventKind::Error
        );
        assert_eq!(classify(r, "not json"), EventKind::Other);
        let m = AgenticApi::Messages;
        assert_eq!(
            classify(m, r#"{"type":"content_block_delta","index":0,"delta":{}}"#),
            EventKind::Delta
        );
        assert_eq!(classify(m, r#"{"type":"message_stop"}"#), EventKind::End);
        assert_eq!(
            classify(m, r#"{"type":"error","error":{}}"#),
            EventKind::Error
        );
        assert_eq!(classify(m, r#"{"type":"ping"}"#), EventKind::Other);
        // The writer's own events read as what they are.
        let mut events = ResponsesEvents::default();
        let delta = events.text_delta(&TextItem::first("msg_1"), "hi");
        assert_eq!(classify(r, &delta.data_text()), EventKind::Delta);
        assert_eq!(classify(m, &messages::stop().data_text()), EventKind::End);
    }

    #[test]
    fn a_whole_answer_gives_its_output_tokens_and_its_id() {
        let body =
            br#"{"id":"resp_9","object":"response","usage":{"input_tokens":5,"output_tokens":7}}"#;
        assert_eq!(output_tokens(body), 7);
        assert_eq!(output_tokens(b"garbage"), 0);
        assert_eq!(response_id(body).as_deref(), Some("resp_9"));
        assert_eq!(response_id(br#"{"object":"response"}"#), None);
    }

    #[test]
    fn a_broken_stream_ends_with_an_error_event_of_its_api() {
        let m = String::from_utf8(error_event(AgenticApi::Messages, "gone", 0)).unwrap();
        assert!(m.starts_with("event: error\ndata: {"), "{m}");
        assert!(m.contains(r#""type":"error""#) && m.contains(r#""message":"gone""#));
        let r = String::from_utf8(error_event(AgenticApi::Responses, "gone", 4)).unwrap();
        assert!(r.contains(r#""sequence_number":4"#), "{r}");
    }
}
