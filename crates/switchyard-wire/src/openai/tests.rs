use super::*;
use serde_json::{json, Value};
use std::borrow::Cow;

fn prompt(s: &str) -> Result<Prompt, String> {
    serde_json::from_str::<Prompt>(s).map_err(|e| e.to_string())
}

#[test]
fn every_prompt_shape_parses() {
    assert_eq!(prompt("\"hi\""), Ok(Prompt::Text("hi".into())));
    assert_eq!(prompt("[1, 2]"), Ok(Prompt::Tokens(vec![1, 2])));
    assert_eq!(
        prompt("[\"a\", \"b\"]"),
        Ok(Prompt::Texts(vec!["a".into(), "b".into()]))
    );
    assert_eq!(
        prompt("[[1], [2, 3]]"),
        Ok(Prompt::TokenBatches(vec![vec![1], vec![2, 3]]))
    );
}

#[test]
fn an_empty_list_is_an_empty_token_prompt_and_a_list_of_one_empty_list_a_batch_of_one() {
    assert_eq!(prompt("[]"), Ok(Prompt::Tokens(vec![])));
    assert_eq!(prompt("[[]]"), Ok(Prompt::TokenBatches(vec![vec![]])));
    assert_eq!(prompt("[\"\"]"), Ok(Prompt::Texts(vec![String::new()])));
}

#[test]
fn a_prompt_of_no_shape_is_refused_with_what_was_wrong() {
    for (body, says) in [
        ("{\"x\": 1}", "expected a prompt"),
        ("true", "expected a prompt"),
        ("null", "expected a prompt"),
        ("[1, \"a\"]", "expected u32"),
        ("[\"a\", 1]", "expected a string"),
        ("[[1], 2]", "expected a sequence"),
        ("[-1]", "token id"),
        ("[4294967296]", "token id"),
        ("[1, 4294967296]", "expected u32"),
        ("[1.5]", "expected a token id"),
        ("[[1, -2]]", "expected u32"),
        ("[{}]", "expected a token id"),
    ] {
        let error = prompt(body).expect_err(body);
        assert!(error.contains(says), "{body}: {error}");
    }
}

#[test]
fn a_prompt_writes_back_as_it_was_read() {
    for body in ["\"hi\"", "[1,2]", "[\"a\",\"b\"]", "[[1],[2,3]]"] {
        let parsed = prompt(body).unwrap();
        assert_eq!(serde_json::to_string(&parsed).unwrap(), body);
    }
}

#[test]
fn a_completion_request_reads_its_fields_and_ignores_the_rest() {
    let body: CompletionRequest = serde_json::from_value(json!({
        "model": "m", "prompt": [1, 2, 3], "stream": true,
        "stream_options": {"include_usage": true, "other": 1},
        "max_tokens": 7, "n": 1, "session_id": "s", "return_token_ids": true,
        "temperature": 0.5, "tools": [{"x": [1, {"y": null}]}],
    }))
    .unwrap();
    assert_eq!(body.model.as_deref(), Some("m"));
    assert_eq!(body.prompt, Prompt::Tokens(vec![1, 2, 3]));
    assert!(body.stream);
    assert_eq!(body.include_usage(), Ok(true));
    assert_eq!(body.max_tokens(), Ok(Some(7)));
    assert_eq!(body.n(), Ok(1));
    assert_eq!(body.session_id.as_deref(), Some("s"));
    assert_eq!(body.return_token_ids(), Ok(true));

    let bare: CompletionRequest = serde_json::from_value(json!({"prompt": "x"})).unwrap();
    assert_eq!(bare.model, None);
    assert!(!bare.stream);
    assert_eq!(bare.include_usage(), Ok(false));
    assert_eq!(bare.max_tokens(), Ok(None));
    assert_eq!(bare.n(), Ok(1));
    assert_eq!(bare.return_token_ids(), Ok(false));
}

#[test]
fn fields_a_worker_reads_are_kept_when_malformed_and_refused_by_name_when_read() {
    let body: CompletionRequest = serde_json::from_value(json!({
        "prompt": "x", "max_tokens": "ten", "n": -1,
        "stream_options": {"include_usage": "yes"}, "return_token_ids": 1,
    }))
    .expect("a router forwards what only a worker judges");
    for (error, field) in [
        (body.max_tokens().unwrap_err(), "max_tokens"),
        (body.n().unwrap_err(), "n"),
        (body.include_usage().unwrap_err(), "stream_options"),
        (body.return_token_ids().unwrap_err(), "return_token_ids"),
    ] {
        assert_eq!(error.status(), Some(400));
        assert_eq!(error.error.param.as_deref(), Some(field));
        assert!(error.error.message.contains(field), "{error:?}");
    }
    let huge: CompletionRequest =
        serde_json::from_value(json!({"prompt": "x", "max_tokens": 1u64 << 40})).unwrap();
    assert!(huge.max_tokens().is_err());
}

#[test]
fn fields_the_router_reads_are_strict() {
    for body in [
        json!({"prompt": "x", "model": 5}),
        json!({"prompt": "x", "stream": "yes"}),
        json!({"prompt": "x", "session_id": 5}),
        json!({"model": "m"}),
    ] {
        assert!(
            serde_json::from_value::<CompletionRequest>(body.clone()).is_err(),
            "{body}"
        );
    }
    assert!(serde_json::from_value::<ChatCompletionRequest>(json!({"messages": "hi"})).is_err());
    assert!(serde_json::from_value::<ChatCompletionRequest>(
        json!({"messages": [{"content": "no role"}]})
    )
    .is_err());
}

#[test]
fn chat_prefers_max_completion_tokens_and_refuses_either_when_malformed() {
    let chat = |v: Value| serde_json::from_value::<ChatCompletionRequest>(v).unwrap();
    let messages = json!([{"role": "user", "content": "x"}]);
    assert_eq!(
        chat(json!({"messages": messages, "max_tokens": 5, "max_completion_tokens": 3}))
            .max_tokens(),
        Ok(Some(3))
    );
    assert_eq!(
        chat(json!({"messages": messages, "max_tokens": 5})).max_tokens(),
        Ok(Some(5))
    );
    let bad = chat(json!({"messages": messages, "max_tokens": "x", "max_completion_tokens": 3}));
    assert_eq!(
        bad.max_tokens().unwrap_err().error.param.as_deref(),
        Some("max_tokens")
    );
}

#[test]
fn message_content_is_a_string_parts_nothing_or_invalid() {
    let body: ChatCompletionRequest = serde_json::from_value(json!({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            {"text": "b"},
            {"type": "text", "text": 5},
            7, "loose", null, [1],
        ]},
        {"role": "assistant", "content": null},
        {"role": "assistant"},
        {"role": "user", "content": 5},
        {"role": "user", "content": {"text": "x"}},
        {"role": "user", "content": true},
    ]}))
    .unwrap();
    let contents: Vec<Option<MessageContent>> =
        body.messages.into_iter().map(|m| m.content).collect();
    let text = |kind: Option<&str>, text: Option<&str>| ContentPart {
        kind: kind.map(str::to_owned),
        text: text.map(str::to_owned),
    };
    assert_eq!(
        contents,
        vec![
            Some(MessageContent::Text("be brief".into())),
            Some(MessageContent::Parts(vec![
                text(Some("text"), Some("a")),
                text(Some("image_url"), None),
                text(None, Some("b")),
                text(Some("text"), None),
                ContentPart::default(),
                ContentPart::default(),
                ContentPart::default(),
                ContentPart::default(),
            ])),
            None,
            None,
            Some(MessageContent::Invalid),
            Some(MessageContent::Invalid),
            Some(MessageContent::Invalid),
        ]
    );
    assert!(text(Some("text"), Some("a")).is_text());
    assert!(!text(None, Some("b")).is_text());
    assert!(!text(Some("text"), None).is_text());
    // A message's text parts render joined by a newline, as vLLM joins them.
    assert_eq!(joined_text(["Thanks.", "And next?"]), "Thanks.\nAnd next?");
    assert_eq!(joined_text(["one"]), "one");
    assert_eq!(
        joined_text(["a", "", "b"]),
        "a\nb",
        "an empty part is skipped"
    );
    assert_eq!(joined_text([]), "");
}

#[test]
fn an_error_body_is_the_openai_shape_with_the_status_as_code() {
    let body = ErrorBody::invalid_request("messages must not be empty", Some("messages"));
    assert_eq!(
        serde_json::to_value(&body).unwrap(),
        json!({"error": {
            "message": "messages must not be empty",
            "type": "invalid_request_error",
            "param": "messages",
            "code": 400,
        }})
    );
    assert_eq!(body.status(), Some(400));
    let parsed: Value = serde_json::from_str(&body.to_json()).unwrap();
    assert_eq!(parsed["error"]["code"], 400);
}

#[test]
fn every_error_kind_has_its_status_and_type() {
    for (body, status, kind) in [
        (
            ErrorBody::invalid_request("x", None),
            400,
            "invalid_request_error",
        ),
        (ErrorBody::authentication("x"), 401, "authentication_error"),
        (
            ErrorBody::not_found("x", Some("model")),
            404,
            "not_found_error",
        ),
        (ErrorBody::too_large(10), 413, "invalid_request_error"),
        (ErrorBody::rate_limited("x"), 429, "rate_limit_error"),
        (ErrorBody::internal("x"), 500, "internal_error"),
        (ErrorBody::upstream("x"), 502, "upstream_error"),
        (ErrorBody::unavailable("x"), 503, "service_unavailable"),
        (ErrorBody::overloaded("x"), 503, "server_overloaded"),
        (ErrorBody::timeout("x"), 504, "timeout"),
    ] {
        assert_eq!(body.status(), Some(status), "{kind}");
        assert_eq!(body.error.kind, kind);
        let v = serde_json::to_value(&body).unwrap();
        assert_eq!(v["error"]["code"], status);
        assert!(v["error"]["message"].is_string());
        assert!(
            v["error"].get("param").is_some(),
            "param is written, null or not"
        );
    }
    assert!(ErrorBody::too_large(10).error.message.contains("10 bytes"));
}

#[test]
fn an_error_from_another_server_reads_whatever_its_code() {
    let named: ErrorBody = serde_json::from_value(json!({"error": {
        "message": "no", "type": "invalid_request_error", "param": null, "code": "model_not_found"
    }}))
    .unwrap();
    assert_eq!(
        named.error.code,
        Some(ErrorCode::Name("model_not_found".into()))
    );
    assert_eq!(named.status(), None);
    let bare: ErrorBody =
        serde_json::from_value(json!({"error": {"message": "no", "type": "x"}})).unwrap();
    assert_eq!((bare.error.param, bare.error.code), (None, None));
}

#[test]
fn a_usage_with_new_counts_keeps_the_rest_and_its_total_saturates() {
    let usage: Usage = serde_json::from_value(json!({
        "prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 1},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }))
    .unwrap();
    let adjusted = usage.with_counts(5, u64::MAX);
    assert_eq!(adjusted.prompt_tokens, 5);
    assert_eq!(adjusted.completion_tokens, u64::MAX);
    assert_eq!(adjusted.total_tokens, u64::MAX);
    let v = serde_json::to_value(&adjusted).unwrap();
    assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 1);
    assert_eq!(v["completion_tokens_details"]["reasoning_tokens"], 0);
}

#[test]
fn a_whole_chat_answer_has_a_message_and_usage() {
    let answer = Completion {
        id: "chatcmpl-1".into(),
        object: Api::Chat.object().into(),
        created: 1,
        model: "m".into(),
        choices: vec![Choice {
            message: Some(ChoiceMessage {
                role: "assistant".into(),
                content: Some("hi".into()),
            }),
            finish_reason: Some("length".into()),
            ..Choice::default()
        }],
        usage: Some(Usage::new(4, 0, 1)),
    };
    let v = serde_json::to_value(&answer).unwrap();
    assert_eq!(
        v,
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
                      "prompt_tokens_details": {"cached_tokens": 0}},
        })
    );
    let text = v.to_string();
    let back: Completion<'_> = serde_json::from_str(&text).unwrap();
    assert_eq!(back, answer);
    assert_eq!(back.choices[0].content(), Some("hi"));
    let message = back.choices[0].message.as_ref().unwrap();
    assert!(matches!(message.content, Some(Cow::Borrowed("hi"))));
}

#[test]
fn a_whole_answers_completion_tokens_are_read_from_usage_and_default_to_zero() {
    assert_eq!(
        completion_tokens(br#"{"usage":{"completion_tokens":9}}"#),
        9
    );
    assert_eq!(
        completion_tokens(br#"{"choices":"not read","usage":{"completion_tokens":9,"x":[1]}}"#),
        9
    );
    assert_eq!(completion_tokens(br#"{"choices":[]}"#), 0);
    assert_eq!(completion_tokens(br#"{"usage":null}"#), 0);
    assert_eq!(completion_tokens(br#"{"usage":"9"}"#), 0);
    assert_eq!(completion_tokens(b"not json"), 0);
    assert_eq!(
        completion_tokens(br#"{"usage":{"completion_tokens":-1}}"#),
        0
    );
}

/// An assistant's `reasoning` is read (vLLM renders it); one that is not
/// text is refused, saying so, not dropped.
#[test]
fn a_messages_reasoning_is_read_and_must_be_text() {
    let body = br#"{"messages":[{"role":"assistant","content":"","reasoning":"Read first."},{"role":"user","content":"Go"}]}"#;
    let chat = ChatCompletionRequest::from_json(body, &BodyLimits::NONE).unwrap();
    assert_eq!(chat.messages[0].reasoning.as_deref(), Some("Read first."));
    assert_eq!(chat.messages[1].reasoning, None);
    let bad = br#"{"messages":[{"role":"assistant","content":"","reasoning":5}]}"#;
    let error = ChatCompletionRequest::from_json(bad, &BodyLimits::NONE).unwrap_err();
    let text = match error {
        BodyError::Json(e) => e.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(text.contains("expected a string"), "{text}");
}
