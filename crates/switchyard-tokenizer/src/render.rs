//! A conversation as vLLM 0.32 hands it to a chat template: the view of
//! [`ChatMessage`]s the template reads, and the `tojson` it renders tools
//! and arguments with ([`crate::pyjson`]).
//!
//! What vLLM changes in a chat's messages before its template sees them
//! (`renderers/chat_utils.py`), done here so that the router renders, and
//! hashes, the prompt the engine caches:
//!
//! - an assistant's tool-call `arguments` are parsed into an object (JSON
//!   text that is not an object, or no text, is `{}`), which templates
//!   then write with `tojson`: `{"a":1}` and `{"a": 1}` render alike;
//! - an assistant's reasoning is `reasoning_content` (and `reasoning`):
//!   Qwen3's template renders it in the turns after the last user query;
//! - a system message's leading Claude Code attribution line
//!   (`x-anthropic-billing-header: ...`, whose hash changes every request)
//!   is dropped, with the rest of its text kept.

use crate::{ChatMessage, ToolCall};
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use switchyard_wire::openai::{Message, MessageContent};

pub use switchyard_wire::agentic::BILLING_HEADER;

/// `content` of a system message without its leading billing-header line.
pub fn without_billing_header(content: &str) -> &str {
    if content.starts_with(BILLING_HEADER) {
        content.split_once('\n').map_or("", |(_, rest)| rest)
    } else {
        content
    }
}

/// Why chat messages cannot be read ([`chat_messages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// No message at all.
    #[error("messages must not be empty")]
    Empty,
    /// A message's content is neither a string nor a list of parts.
    #[error("message content must be a string or a list of content parts")]
    Content,
}

/// The chat API's `messages` as a template reads them: each one's content
/// as vLLM reads it ([`MessageContent::template_text`]: text parts one a
/// line, other parts no text), its tool calls and its reasoning. The
/// router and the sim-worker both read a chat so.
pub fn chat_messages(messages: Vec<Message>) -> Result<Vec<ChatMessage>, Unreadable> {
    if messages.is_empty() {
        return Err(Unreadable::Empty);
    }
    messages
        .into_iter()
        .map(|m| {
            Ok(ChatMessage {
                role: m.role,
                content: MessageContent::template_text(m.content).ok_or(Unreadable::Content)?,
                tool_calls: m
                    .tool_calls
                    .into_iter()
                    .map(|c| ToolCall::function(c.name, c.arguments))
                    .collect(),
                reasoning: m.reasoning,
            })
        })
        .collect()
}

/// A tool call's arguments as the template sees them: the object the
/// JSON text holds, or `{}`.
pub fn arguments_object(text: &str) -> serde_json::Value {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(object @ serde_json::Value::Object(_)) => object,
        _ => serde_json::Value::Object(serde_json::Map::new()),
    }
}

/// The messages as the template reads them.
pub(crate) struct TemplateMessages<'a>(pub(crate) &'a [ChatMessage]);

impl Serialize for TemplateMessages<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for message in self.0 {
            seq.serialize_element(&TemplateMessage(message))?;
        }
        seq.end()
    }
}

struct TemplateMessage<'a>(&'a ChatMessage);

impl Serialize for TemplateMessage<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let m = self.0;
        let calls = !m.tool_calls.is_empty();
        let fields = 2 + usize::from(calls) + 2 * usize::from(m.reasoning.is_some());
        let mut map = serializer.serialize_map(Some(fields))?;
        map.serialize_entry("role", &m.role)?;
        let content = match m.role.as_str() {
            "system" => without_billing_header(&m.content),
            _ => &m.content,
        };
        map.serialize_entry("content", content)?;
        if calls {
            let calls: Vec<TemplateCall<'_>> = m.tool_calls.iter().map(TemplateCall).collect();
            map.serialize_entry("tool_calls", &calls)?;
        }
        if let Some(reasoning) = &m.reasoning {
            map.serialize_entry("reasoning", reasoning)?;
            map.serialize_entry("reasoning_content", reasoning)?;
        }
        map.end()
    }
}

struct TemplateCall<'a>(&'a crate::ToolCall);

impl Serialize for TemplateCall<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Function<'a> {
            name: &'a str,
            arguments: serde_json::Value,
        }
        let mut map = serializer.serialize_map(Some(2))?;
        map.serialize_entry("type", &self.0.kind)?;
        map.serialize_entry(
            "function",
            &Function {
                name: &self.0.function.name,
                arguments: arguments_object(&self.0.function.arguments),
            },
        )?;
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_an_object_or_empty() {
        assert_eq!(
            arguments_object(r#"{"b":1,"a":2}"#).to_string(),
            r#"{"b":1,"a":2}"#,
            "in their order"
        );
        for text in ["", "[1]", "42", "{bad", "null"] {
            assert_eq!(arguments_object(text), serde_json::json!({}), "{text:?}");
        }
    }

    #[test]
    fn only_a_leading_billing_header_line_is_dropped() {
        assert_eq!(
            without_billing_header("x-anthropic-billing-header: cch=1;\nYou are"),
            "You are"
        );
        assert_eq!(without_billing_header("x-anthropic-billing-header: a"), "");
        assert_eq!(
            without_billing_header("You are\nx-anthropic-billing-header: a"),
            "You are\nx-anthropic-billing-header: a"
        );
    }

    #[test]
    fn chat_messages_are_read_as_vllm_reads_them() {
        assert_eq!(chat_messages(Vec::new()), Err(Unreadable::Empty));
        let body: Vec<Message> = serde_json::from_str(
            r#"[{"role": "user", "content": [{"type": "text", "text": "a"},
                 {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "reasoning": "think",
                 "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "f", "arguments": "{}"}}]}]"#,
        )
        .expect("a chat");
        let read = chat_messages(body).expect("readable");
        assert_eq!(
            read[0],
            ChatMessage::text("user", "a\nb"),
            "text parts a line each"
        );
        assert_eq!(read[1].content, "");
        assert_eq!(read[1].tool_calls, vec![ToolCall::function("f", "{}")]);
        assert_eq!(read[1].reasoning.as_deref(), Some("think"));
        let bad: Vec<Message> =
            serde_json::from_str(r#"[{"role": "user", "content": 7}]"#).expect("parsed leniently");
        assert_eq!(chat_messages(bad), Err(Unreadable::Content));
    }
}
