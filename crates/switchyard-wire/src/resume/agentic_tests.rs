use super::*;
use serde_json::{json, Value};

fn judged(api: AgenticApi, body: &Value) -> Result<(), &'static str> {
    let bytes = serde_json::to_vec(body).unwrap();
    let fields = Fields::parse(&bytes).unwrap();
    resumable(api, &fields)
}

fn with(base: &Value, extra: Value) -> Value {
    let mut body = base.clone();
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The events in `bytes` as (name, data), read by the wire crate's parser.
fn events(bytes: &[u8]) -> Vec<(String, Value)> {
    let mut parser = crate::sse::SseParser::new(usize::MAX);
    parser.push(bytes);
    std::iter::from_fn(|| parser.next_event_named().unwrap())
        .map(|e| {
            let name = e.name().unwrap_or_default().to_owned();
            (name, serde_json::from_str(e.data()).unwrap())
        })
        .collect()
}

fn text(t: &str) -> Delta {
    Delta {
        text: Some(t.into()),
        ..Delta::default()
    }
}

fn finish(reason: &str) -> Delta {
    Delta {
        finish_reason: Some(reason.into()),
        ..Delta::default()
    }
}

#[test]
fn plain_text_messages_requests_are_resumable_and_tools_or_thinking_are_not() {
    let plain = json!({
        "model": "m", "max_tokens": 20, "stream": true, "system": "be brief",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            {"role": "user", "content": "again"},
        ],
        "temperature": 0.5, "top_p": 0.9, "top_k": 4, "stop_sequences": ["\n"],
        "metadata": {"user_id": "u"}, "tools": [],
    });
    assert_eq!(judged(AgenticApi::Messages, &plain), Ok(()));
    let cases = [
        (
            json!({"tools": [{"name": "f", "input_schema": {}}]}),
            "tools",
        ),
        (json!({"tool_choice": {"type": "auto"}}), "tools"),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 100}}),
            "thinking",
        ),
        (json!({"some_new_knob": 1}), "does not know"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "non-text",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "4"}]}]}),
            "non-text",
        ),
    ];
    for (extra, expected) in cases {
        let why = judged(AgenticApi::Messages, &with(&plain, extra.clone()))
            .expect_err(&extra.to_string());
        assert!(why.contains(expected), "{extra}: {why}");
    }
}

#[test]
fn only_unstored_plain_text_responses_requests_are_resumable() {
    let plain = json!({
        "model": "m", "input": "hi", "instructions": "be brief", "stream": true,
        "store": false, "max_output_tokens": 20, "temperature": 0.5,
        "text": {"format": {"type": "text"}}, "tools": [],
    });
    assert_eq!(judged(AgenticApi::Responses, &plain), Ok(()));
    let items = json!({"input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
    ]});
    assert_eq!(judged(AgenticApi::Responses, &with(&plain, items)), Ok(()));
    let mut stored = plain.clone();
    stored.as_object_mut().unwrap().remove("store");
    let why = judged(AgenticApi::Responses, &stored).unwrap_err();
    assert!(
        why.contains("stored") && why.contains("previous_response_id"),
        "{why}"
    );
    let cases = [
        (json!({"store": true}), "stored"),
        (
            json!({"tools": [{"type": "function", "name": "f", "parameters": {}}]}),
            "tools",
        ),
        (
            json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}),
            "text.format",
        ),
        (json!({"previous_response_id": "resp_1"}), "stored response"),
        (json!({"reasoning": {"effort": "low"}}), "reasoning"),
        (json!({"some_new_knob": 1}), "does not know"),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}),
            "other than text",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "non-text",
        ),
    ];
    for (extra, expected) in cases {
        let why = judged(AgenticApi::Responses, &with(&plain, extra.clone()))
            .expect_err(&extra.to_string());
        assert!(why.contains(expected), "{extra}: {why}");
    }
}

#[test]
fn the_resume_body_carries_sampling_fields_under_their_completion_names() {
    let original = json!({
        "model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "secret"}],
        "temperature": 0.5, "stop_sequences": ["\n"], "stream": true, "metadata": {},
    });
    let bytes = serde_json::to_vec(&original).unwrap();
    let fields = Fields::parse(&bytes).unwrap();
    assert_eq!(max_tokens(AgenticApi::Messages, &fields), Some(20));
    assert_eq!(max_tokens(AgenticApi::Responses, &fields), None);
    let body: Value = serde_json::from_slice(&resume_body(
        AgenticApi::Messages,
        &fields,
        &[1, 2],
        Some(5),
    ))
    .unwrap();
    assert_eq!(
        body,
        json!({"model": "m", "temperature": 0.5, "stop": ["\n"], "prompt": [1, 2],
               "max_tokens": 5, "stream": true, "return_token_ids": true})
    );
}

#[test]
fn a_resumed_messages_stream_goes_on_in_the_same_block_and_ends_once() {
    let mut r = Resume::new(AgenticApi::Messages, 1024, 7);
    r.observe(r#"{"type":"message_start","message":{"id":"msg_1","content":[]}}"#);
    r.observe(
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    assert_eq!(
        r.observe(
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}"#
        )
        .as_deref(),
        Some("a")
    );
    let out = events(&r.rewrite(&text(" b"), 2, 10));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, "content_block_delta");
    assert_eq!(
        out[0].1,
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " b"}})
    );
    let end = events(&r.rewrite(&finish("length"), 3, 10));
    let names: Vec<&str> = end.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert_eq!(end[0].1["index"], 0);
    assert_eq!(end[1].1["delta"]["stop_reason"], "max_tokens");
    assert_eq!(end[1].1["usage"]["output_tokens"], 3);
    assert!(
        r.finish("stop", 3, 10).is_empty(),
        "the closing events are sent once"
    );
    // A stop is the end of the turn.
    let mut r = Resume::new(AgenticApi::Messages, 1024, 7);
    r.observe(
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    let end = events(&r.rewrite(&finish("stop"), 1, 10));
    assert_eq!(end[1].1["delta"]["stop_reason"], "end_turn");
}

#[test]
fn a_messages_stream_broken_before_its_block_gets_one_from_the_router() {
    let mut r = Resume::new(AgenticApi::Messages, 1024, 7);
    r.observe(r#"{"type":"message_start","message":{"id":"msg_1","content":[]}}"#);
    let out = events(&r.rewrite(&text("a"), 1, 10));
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["content_block_start", "content_block_delta"]);
    assert_eq!(out[0].1["index"], 0);
}

#[test]
fn a_resumed_responses_stream_continues_its_item_and_sequence_and_completes_with_the_whole_text() {
    let mut r = Resume::new(AgenticApi::Responses, 1024, 7);
    let created = r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","output":[],"usage":null,"model":"m"}}"#;
    r.observe(created);
    r.observe(r#"{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"type":"message","id":"msg_1"}}"#);
    r.observe(r#"{"type":"response.content_part.added","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"part":{"type":"output_text","text":""}}"#);
    r.observe(r#"{"type":"response.output_text.delta","sequence_number":3,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"a","logprobs":[]}"#);
    let out = events(&r.rewrite(&text(" b"), 2, 10));
    assert_eq!(out[0].0, "response.output_text.delta");
    assert_eq!(
        out[0].1,
        json!({"type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_1",
               "output_index": 0, "content_index": 0, "delta": " b", "logprobs": []})
    );
    let end = events(&r.rewrite(&finish("stop"), 2, 10));
    let names: Vec<&str> = end.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    let sequence: Vec<u64> = end
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(sequence, [5, 6, 7, 8]);
    assert_eq!(end[0].1["text"], "a b");
    assert_eq!(end[1].1["part"]["text"], "a b");
    assert_eq!(end[2].1["item"]["content"][0]["text"], "a b");
    assert_eq!(end[2].1["item"]["id"], "msg_1");
    let response = &end[3].1["response"];
    assert_eq!(response["id"], "resp_1");
    assert_eq!(response["status"], "completed");
    assert_eq!(response["output"][0]["content"][0]["text"], "a b");
    assert_eq!(response["usage"]["output_tokens"], 2);
    assert_eq!(response["usage"]["input_tokens"], 10);
    assert_eq!(response["usage"]["total_tokens"], 12);
}

#[test]
fn a_responses_stream_at_its_output_limit_is_incomplete() {
    let mut r = Resume::new(AgenticApi::Responses, 1024, 7);
    r.observe(r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","output":[]}}"#);
    let end = events(&r.finish("length", 1, 1));
    let names: Vec<&str> = end.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete"
        ],
        "an item the first worker never began is begun by the router"
    );
    assert_eq!(end[0].1["sequence_number"], 1);
    assert_eq!(end[5].1["response"]["status"], "incomplete");
    assert_eq!(
        end[5].1["response"]["incomplete_details"]["reason"],
        "max_output_tokens"
    );
}

#[test]
fn responses_text_past_the_cap_is_dropped_and_the_stream_not_resumable() {
    let mut r = Resume::new(AgenticApi::Responses, 4, 7);
    r.observe(r#"{"type":"response.output_text.delta","item_id":"m","delta":"abc"}"#);
    assert!(!r.overflowed());
    r.observe(r#"{"type":"response.output_text.delta","item_id":"m","delta":"de"}"#);
    assert!(r.overflowed());
    assert!(r.text.is_empty(), "what was kept is freed");
}

#[test]
fn a_closed_text_block_means_every_token_arrived() {
    let mut r = Resume::new(AgenticApi::Messages, 64, 7);
    r.observe(
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    r.observe(r#"{"type":"content_block_stop","index":0}"#);
    assert!(r.closed());
    let end = events(&r.finish("stop", 1, 1));
    let names: Vec<&str> = end.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["message_delta", "message_stop"],
        "the block is not closed twice"
    );
    // Garbage is read as nothing.
    assert_eq!(r.observe("not json"), None);
}
