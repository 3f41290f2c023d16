//! What the engine renders into a prompt besides message text: a
//! request's tool definitions and an assistant's tool calls.
//!
//! Engines render both with the model's chat template (a tool list in the
//! system turn, a call as `<tool_call>` JSON), so they take prompt tokens
//! like any text, and a router that counts only message text lets a client
//! send a large prompt for free. The router reads them as the chat API
//! spells them:
//!
//! - `tools`: `[{"type": "function", "function": {"name", "description",
//!   "parameters"}}]`, kept as a JSON tree for the template. Before the
//!   tree is built the list's JSON text is bounded by
//!   [`MAX_BYTES_PER_TOKEN`] × the prompt token limit: a tool list longer
//!   than that cannot fit the limit (JSON takes 3 to 4 bytes a token), so
//!   it is refused as a prompt past the limit without being parsed;
//! - a message's `tool_calls`: `[{"function": {"name", "arguments"}}]`,
//!   each kept as its name and its arguments' JSON text (a string as it
//!   is, any other value as its JSON).

use serde::Deserialize;
use serde_json::value::RawValue;

/// The most bytes of tool definitions read per token of the prompt token
/// limit.
pub const MAX_BYTES_PER_TOKEN: usize = 16;

/// One tool call of an assistant message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The size the template renders it at, about (name and arguments).
    pub fn len(&self) -> usize {
        self.name.len() + self.arguments.len()
    }

    /// Whether it has neither a name nor arguments.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Deserialize)]
struct WireCall {
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<Box<RawValue>>,
}

/// A JSON value's text for a template: a string's content, anything else
/// as its JSON.
pub fn json_text(raw: &RawValue) -> String {
    if raw.get().starts_with('"') {
        if let Ok(s) = serde_json::from_str::<String>(raw.get()) {
            return s;
        }
    }
    raw.get().to_owned()
}

impl<'de> Deserialize<'de> for ToolCall {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let call = WireCall::deserialize(d)?;
        let function = call.function;
        Ok(ToolCall {
            name: function
                .as_ref()
                .and_then(|f| f.name.clone())
                .unwrap_or_default(),
            arguments: function
                .and_then(|f| f.arguments)
                .map(|a| json_text(&a))
                .unwrap_or_default(),
        })
    }
}

/// Why a tool list was not read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolsError {
    /// Longer than [`MAX_BYTES_PER_TOKEN`] × the prompt token limit.
    TooLong,
    /// Not a list.
    NotAList,
}

/// The bytes of tool definitions that may be read for a prompt token
/// limit of `prompt_tokens`.
pub fn max_tools_bytes(prompt_tokens: usize) -> usize {
    prompt_tokens.saturating_mul(MAX_BYTES_PER_TOKEN)
}

/// The tool list `raw` as a JSON tree, when it has any tool: `None` for
/// `null` or `[]`; refused when it is past [`max_tools_bytes`] or is not
/// a list.
pub fn tools_within(
    raw: Option<&RawValue>,
    prompt_tokens: usize,
) -> Result<Option<serde_json::Value>, ToolsError> {
    let Some(raw) = raw.filter(|r| r.get() != "null") else {
        return Ok(None);
    };
    if raw.get().len() > max_tools_bytes(prompt_tokens) {
        return Err(ToolsError::TooLong);
    }
    match serde_json::from_str::<serde_json::Value>(raw.get()) {
        Ok(serde_json::Value::Array(list)) if list.is_empty() => Ok(None),
        Ok(list @ serde_json::Value::Array(_)) => Ok(Some(list)),
        _ => Err(ToolsError::NotAList),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).unwrap()
    }

    #[test]
    fn a_tool_call_keeps_its_name_and_arguments_text() {
        let call: ToolCall = serde_json::from_str(
            r#"{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}"#,
        )
        .unwrap();
        assert_eq!(call.name, "f");
        assert_eq!(call.arguments, r#"{"a": 1}"#);
        let object: ToolCall =
            serde_json::from_str(r#"{"function":{"name":"g","arguments":{"b":[1,2]}}}"#).unwrap();
        assert_eq!(object.arguments, r#"{"b":[1,2]}"#);
        let bare: ToolCall = serde_json::from_str(r#"{"id":"x"}"#).unwrap();
        assert!(bare.is_empty());
    }

    #[test]
    fn tools_are_bounded_before_they_are_parsed() {
        assert_eq!(tools_within(None, 10), Ok(None));
        assert_eq!(tools_within(Some(&raw("null")), 10), Ok(None));
        assert_eq!(tools_within(Some(&raw("[]")), 10), Ok(None));
        let list = r#"[{"type":"function","function":{"name":"f"}}]"#;
        assert!(tools_within(Some(&raw(list)), 10).unwrap().is_some());
        assert_eq!(
            tools_within(Some(&raw(list)), 2),
            Err(ToolsError::TooLong),
            "{} bytes over 2 × {MAX_BYTES_PER_TOKEN}",
            list.len()
        );
        assert_eq!(
            tools_within(Some(&raw(r#"{"a":1}"#)), 10),
            Err(ToolsError::NotAList)
        );
    }
}
