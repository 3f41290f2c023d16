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
//!   "parameters"}}]`, kept as a JSON tree for the template, each function
//!   tool as vLLM hands it over ([`engine_function`]). Before the tree is
//!   built the list's JSON text is bounded by [`MAX_BYTES_PER_TOKEN`] ×
//!   the prompt token limit: a tool list longer than that cannot fit the
//!   limit (JSON takes 3 to 4 bytes a token), so it is refused as a
//!   prompt past the limit without being parsed;
//! - a message's `tool_calls`: `[{"function": {"name", "arguments"}}]`,
//!   each kept as its name and its arguments' JSON text (a string as it
//!   is, any other value as its JSON).

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

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

/// A function tool as vLLM 0.32 hands it to the chat template: its
/// `ChatCompletionToolsParam`, dumped (`model_dump`), which every API's
/// tools become. `fields` are the function's (`parameters_key` names its
/// schema: `parameters`, or Anthropic's `input_schema`) and `defer_loading`
/// the tool's own. What the template then renders, in this order:
/// `type`, `function` with `name`, `description` and `parameters` (`null`
/// when absent) and `strict` and `defer_loading` when set, and the tool's
/// `defer_loading` when set; nothing else of the tool's.
/// `fields` are moved, not copied (a tool's schema can be long).
pub fn engine_function(
    mut fields: Map<String, Value>,
    parameters_key: &str,
    defer_loading: Option<Value>,
) -> Value {
    let mut field = |key: &str| fields.remove(key).filter(|v| !v.is_null());
    let defer_loading = defer_loading.filter(|v| !v.is_null());
    let mut function = Map::new();
    function.insert("name".into(), field("name").unwrap_or(Value::Null));
    function.insert(
        "description".into(),
        field("description").unwrap_or(Value::Null),
    );
    function.insert(
        "parameters".into(),
        field(parameters_key).unwrap_or(Value::Null),
    );
    if let Some(strict) = field("strict") {
        function.insert("strict".into(), strict);
    }
    // The tool's own `defer_loading` is its function's too, unless set there.
    if let Some(defer) = field("defer_loading").or_else(|| defer_loading.clone()) {
        function.insert("defer_loading".into(), defer);
    }
    let mut tool = Map::new();
    tool.insert("type".into(), Value::from("function"));
    tool.insert("function".into(), Value::Object(function));
    if let Some(defer) = defer_loading {
        tool.insert("defer_loading".into(), defer);
    }
    Value::Object(tool)
}

/// A chat API tool as the engine renders it: a function tool
/// ([`engine_function`] of its `function`), anything else as it is (vLLM
/// refuses other types).
pub fn chat_tool(tool: Value) -> Value {
    let is_function = tool
        .get("type")
        .is_none_or(|t| t.as_str() == Some("function"));
    match tool {
        Value::Object(mut tool) if is_function => match tool.remove("function") {
            Some(Value::Object(function)) => {
                engine_function(function, "parameters", tool.remove("defer_loading"))
            }
            // Not a function's shape (vLLM refuses it): as it was.
            other => {
                if let Some(other) = other {
                    tool.insert("function".into(), other);
                }
                Value::Object(tool)
            }
        },
        tool => tool,
    }
}

/// The tool list `raw` as a JSON tree of tools as the engine renders
/// them ([`chat_tool`]), when it has any tool: `None` for `null` or `[]`;
/// refused when it is past [`max_tools_bytes`] or is not a list.
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
    match serde_json::from_str::<Value>(raw.get()) {
        Ok(Value::Array(list)) if list.is_empty() => Ok(None),
        Ok(Value::Array(list)) => Ok(Some(Value::Array(
            list.into_iter().map(chat_tool).collect(),
        ))),
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

    /// vLLM 0.32's dump of each tool (printed by its own
    /// `ChatCompletionToolsParam(...).model_dump()`): fields in its order,
    /// absent ones `null`, unknown ones gone, `strict` and `defer_loading`
    /// only when set.
    #[test]
    fn a_chat_tool_is_what_vllm_hands_the_template() {
        let tool = serde_json::json!({"type": "function", "extra": 1, "function": {
            "parameters": {"z": 1, "a": 2}, "x": 2, "strict": true, "name": "f"}});
        assert_eq!(
            serde_json::to_string(&chat_tool(tool)).unwrap(),
            r#"{"type":"function","function":{"name":"f","description":null,"parameters":{"z":1,"a":2},"strict":true}}"#
        );
        let deferred = serde_json::json!({"type": "function", "defer_loading": true, "function": {"name": "g"}});
        assert_eq!(
            serde_json::to_string(&chat_tool(deferred)).unwrap(),
            r#"{"type":"function","function":{"name":"g","description":null,"parameters":null,"defer_loading":true},"defer_loading":true}"#
        );
        let other = serde_json::json!({"type": "web_search"});
        assert_eq!(chat_tool(other.clone()), other);
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
