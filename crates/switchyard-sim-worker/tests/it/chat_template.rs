//! A chat request's prompt is rendered as the router renders it (and as
//! vLLM does): with the tools it declares and its assistant turns' tool
//! calls. The router hashes its own rendering of the prompt; the worker's
//! KV events must carry the same ids.

use crate::support::serve_worker;
use serde_json::{json, Value};
use switchyard_tokenizer::{ChatMessage, Tokenizer, ToolCall};

/// The worker's JSON answer to `body` POSTed to `path`.
async fn post(base: &str, path: &str, body: &Value) -> Value {
    reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The prompt's token count the worker reports for `body`.
async fn prompt_tokens(base: &str, body: &Value) -> u64 {
    let reply = post(base, "/v1/chat/completions", body).await;
    reply["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage in {reply}"))
}

/// The token count of `messages` as the router renders them: the bundled
/// template, with `tools`, then the tokenizer.
fn rendered(messages: &[ChatMessage], tools: Option<&Value>) -> u64 {
    let tokenizer = Tokenizer::bundled().unwrap();
    let text = tokenizer
        .apply_chat_template_with_tools(messages, tools, true)
        .unwrap();
    tokenizer.encode(&text).unwrap().len() as u64
}

#[tokio::test]
async fn tools_and_tool_calls_are_in_the_prompt_as_the_router_renders_them() {
    let worker = serve_worker(&[]).await;
    let tools = json!([{
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}
        }
    }]);
    let body = json!({
        "model": "m",
        "max_tokens": 1,
        "tools": tools,
        "messages": [
            {"role": "user", "content": "What does the README say?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\": \"README.md\"}"}
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "# Switchyard"},
        ],
    });
    // The router's rendering: the bundled template with the tools, the
    // assistant turn with its call.
    let tokenizer = Tokenizer::bundled().unwrap();
    let message = |role: &str, content: &str, calls: Vec<ToolCall>| ChatMessage {
        role: role.into(),
        content: content.into(),
        tool_calls: calls,
        reasoning: None,
    };
    let messages = [
        message("user", "What does the README say?", vec![]),
        message(
            "assistant",
            "",
            vec![ToolCall::function("read_file", "{\"path\": \"README.md\"}")],
        ),
        message("tool", "# Switchyard", vec![]),
    ];
    let expected = rendered(&messages, Some(&tools));
    assert_eq!(prompt_tokens(&worker.base, &body).await, expected);
    // Both parts count: the template renders the tools and the call.
    assert!(tokenizer.renders_tools() && tokenizer.renders_tool_calls());
    let bare: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage {
            tool_calls: vec![],
            ..m.clone()
        })
        .collect();
    assert!(rendered(&messages, None) < expected);
    assert!(rendered(&bare, Some(&tools)) < expected);
}

#[tokio::test]
async fn a_messages_requests_tools_are_in_its_prompt_as_the_router_renders_them() {
    use switchyard_wire::agentic::MessagesRequest;
    use switchyard_wire::openai::{BodyLimits, MessageContent};
    let worker = serve_worker(&[]).await;
    let body = json!({
        "model": "m",
        "max_tokens": 1,
        "tools": [{
            "name": "read_file",
            "description": "Read a file of the repository",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}
        }],
        "messages": [{"role": "user", "content": "What does the README say?"}],
    });
    // The router reads the body as its equivalent chat with the wire
    // crate, and renders it with the tools.
    let request =
        MessagesRequest::from_json(body.to_string().as_bytes(), &BodyLimits::NONE).unwrap();
    let messages: Vec<ChatMessage> = request
        .chat()
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: match &m.content {
                Some(MessageContent::Text(t)) => t.clone(),
                _ => String::new(),
            },
            tool_calls: vec![],
            reasoning: None,
        })
        .collect();
    let expected = rendered(&messages, request.tools.as_ref());
    assert!(
        rendered(&messages, None) < expected,
        "the tools are rendered"
    );
    let counted = post(&worker.base, "/v1/messages/count_tokens", &body).await;
    assert_eq!(counted["input_tokens"].as_u64(), Some(expected));
}

#[tokio::test]
async fn a_messages_text_parts_are_joined_by_a_newline_as_vllm_joins_them() {
    let worker = serve_worker(&[]).await;
    let body = |content: Value| json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}]});
    let parts = json!([{"type": "text", "text": "Thanks."}, {"type": "text", "text": "And next?"}]);
    let by_parts = prompt_tokens(&worker.base, &body(parts)).await;
    let user = |content: &str| {
        let message = ChatMessage {
            role: "user".into(),
            content: content.into(),
            tool_calls: vec![],
            reasoning: None,
        };
        rendered(&[message], None)
    };
    assert_eq!(by_parts, user("Thanks.\nAnd next?"));
    assert_ne!(user("Thanks.\nAnd next?"), user("Thanks.And next?"));
}
