use super::*;
use crate::openai::{Api, Choice, ChoiceDelta, Completion, Usage};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::borrow::Cow;

fn all_events(p: &mut SseParser) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(e) = p.next_event().unwrap() {
        out.push(e);
    }
    out
}

/// Pushes `frames` one at a time, taking every event after each; the
/// events, or the first error.
fn parse_frames(limit: usize, frames: &[&[u8]]) -> Result<Vec<String>, SseError> {
    let mut parser = SseParser::new(limit);
    let mut out = Vec::new();
    for frame in frames {
        parser.push(frame);
        while let Some(e) = parser.next_event()? {
            out.push(e);
        }
    }
    Ok(out)
}

/// `bytes` cut at `cuts` (positions, any order, repeats allowed).
fn split_at<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    let mut frames = Vec::new();
    let mut from = 0;
    for cut in cuts {
        frames.push(&bytes[from..cut]);
        from = cut;
    }
    frames.push(&bytes[from..]);
    frames
}

#[test]
fn events_split_across_pushes_come_out_whole() {
    let mut p = SseParser::new(1024);
    p.push(b"data: {\"a\"");
    assert_eq!(p.next_event().unwrap(), None);
    p.push(b":1}\n");
    assert_eq!(p.next_event().unwrap(), None);
    p.push(b"\ndata: [DONE]\n\n");
    assert_eq!(all_events(&mut p), vec!["{\"a\":1}", "[DONE]"]);
    assert_eq!(p.buffered(), 0);
}

#[test]
fn several_events_in_one_frame_come_out_one_by_one() {
    let mut p = SseParser::new(1024);
    p.push(b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4");
    assert_eq!(all_events(&mut p), vec!["1", "2", "3"]);
    assert_eq!(p.buffered(), b"data: 4".len());
    p.push(b"\n\n");
    assert_eq!(all_events(&mut p), vec!["4"]);
}

#[test]
fn comments_and_other_fields_are_skipped_and_crlf_is_accepted() {
    let mut p = SseParser::new(1024);
    p.push(b": keep-alive\n\nevent: x\r\nid: 3\r\ndata:one\r\ndata: two\r\n\r\n");
    assert_eq!(all_events(&mut p), vec!["one\ntwo"]);
}

#[test]
fn a_bare_data_line_is_an_empty_line_of_data() {
    let mut p = SseParser::new(1024);
    p.push(b"data\ndata: x\n\ndata:\n\n");
    assert_eq!(all_events(&mut p), vec!["\nx", ""]);
}

#[test]
fn only_one_space_after_the_colon_is_dropped() {
    let mut p = SseParser::new(1024);
    p.push(b"data:  two spaces\n\n");
    assert_eq!(all_events(&mut p), vec![" two spaces"]);
}

#[test]
fn invalid_utf8_is_replaced_not_an_error() {
    let mut p = SseParser::new(1024);
    p.push(b"data: a\xffb\n\n");
    assert_eq!(all_events(&mut p), vec!["a\u{fffd}b"]);
}

#[test]
fn an_incomplete_event_over_the_limit_is_an_error_not_a_buffer() {
    let mut p = SseParser::new(16);
    p.push(&[b'x'; 17]);
    assert_eq!(p.next_event(), Err(SseError::EventTooLarge { limit: 16 }));
    assert_eq!(p.buffered(), 0, "what was held is dropped");
}

#[test]
fn a_whole_event_over_the_limit_is_refused_even_in_one_frame() {
    // "data: 0123456789\n\n" is 18 bytes.
    assert_eq!(
        parse_frames(18, &[b"data: 0123456789\n\n"]),
        Ok(vec!["0123456789".to_owned()])
    );
    assert_eq!(
        parse_frames(17, &[b"data: 0123456789\n\n"]),
        Err(SseError::EventTooLarge { limit: 17 })
    );
}

#[test]
fn the_error_is_final() {
    let mut p = SseParser::new(4);
    p.push(b"data: too long\n\n");
    assert!(p.next_event().is_err());
    p.push(b"data: 1\n\n");
    assert!(p.next_event().is_err());
    assert_eq!(p.buffered(), 0);
}

#[test]
fn taken_events_do_not_accumulate_in_the_buffer() {
    let mut p = SseParser::new(64);
    for i in 0..10_000 {
        p.push(format!("data: {i}\n\n").as_bytes());
        assert_eq!(p.next_event().unwrap(), Some(i.to_string()));
    }
    assert!(p.buf.capacity() < 1024, "{}", p.buf.capacity());
}

/// One line of a generated event.
#[derive(Debug, Clone)]
enum Line {
    /// `data: text` (or `data:text`).
    Data(String, bool),
    /// `: text`.
    Comment(String),
    /// `event: text`, `id: text` or `retry: text`.
    Field(&'static str, String),
}

fn text() -> impl Strategy<Value = String> {
    "[^\r\n]{0,24}"
}

fn line() -> impl Strategy<Value = Line> {
    prop_oneof![
        4 => (text(), any::<bool>()).prop_map(|(t, spaced)| Line::Data(t, spaced)),
        1 => text().prop_map(Line::Comment),
        1 => (prop::sample::select(vec!["event", "id", "retry"]), "[a-z0-9]{0,8}")
            .prop_map(|(name, value)| Line::Field(name, value)),
    ]
}

/// An event's bytes (`\n` or `\r\n` per line) and the data it carries.
fn event() -> impl Strategy<Value = (Vec<u8>, Option<String>)> {
    (
        prop::collection::vec((line(), any::<bool>()), 0..5),
        any::<bool>(),
    )
        .prop_map(|(lines, crlf_end)| {
            let mut bytes = Vec::new();
            let mut data: Option<String> = None;
            for (line, crlf) in lines {
                match line {
                    Line::Data(t, spaced) => {
                        // `data:text` only when the text cannot lose a
                        // leading space to the optional one.
                        if spaced || t.starts_with(' ') {
                            bytes.extend_from_slice(b"data: ");
                        } else {
                            bytes.extend_from_slice(b"data:");
                        }
                        bytes.extend_from_slice(t.as_bytes());
                        match &mut data {
                            Some(d) => {
                                d.push('\n');
                                d.push_str(&t);
                            }
                            None => data = Some(t),
                        }
                    }
                    Line::Comment(t) => {
                        bytes.push(b':');
                        bytes.extend_from_slice(t.as_bytes());
                    }
                    Line::Field(name, value) => {
                        bytes.extend_from_slice(format!("{name}: {value}").as_bytes());
                    }
                }
                bytes.extend_from_slice(if crlf { b"\r\n" } else { b"\n" });
            }
            bytes.extend_from_slice(if crlf_end { b"\r\n" } else { b"\n" });
            (bytes, data)
        })
}

proptest! {
    #[test]
    fn any_framing_of_a_stream_yields_exactly_its_events(
        events in prop::collection::vec(event(), 0..12),
        cuts in prop::collection::vec(any::<usize>(), 0..24),
    ) {
        let stream: Vec<u8> = events.iter().flat_map(|(b, _)| b.clone()).collect();
        let expected: Vec<String> = events.into_iter().filter_map(|(_, d)| d).collect();
        let frames = split_at(&stream, &cuts);
        prop_assert_eq!(parse_frames(1 << 20, &frames), Ok(expected.clone()));
        // The whole stream as one frame, and one byte per frame.
        prop_assert_eq!(parse_frames(1 << 20, &[&stream]), Ok(expected.clone()));
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        prop_assert_eq!(parse_frames(1 << 20, &bytes), Ok(expected));
    }

    #[test]
    fn an_event_over_the_limit_is_refused_however_it_is_framed(
        before in prop::collection::vec("[a-z]{0,8}", 0..4),
        long in "[a-z]{0,64}",
        limit in 8usize..48,
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let mut stream = Vec::new();
        let mut fitting = Vec::new();
        for short in &before {
            let event = format!("data: {short}\n\n");
            stream.extend_from_slice(event.as_bytes());
            fitting.push(event.len() <= limit);
        }
        let event = format!("data: {long}\n\n");
        stream.extend_from_slice(event.as_bytes());
        fitting.push(event.len() <= limit);
        let frames = split_at(&stream, &cuts);
        let parsed = parse_frames(limit, &frames);
        if fitting.iter().all(|f| *f) {
            let mut expected = before.clone();
            expected.push(long);
            prop_assert_eq!(parsed, Ok(expected));
        } else {
            prop_assert_eq!(parsed, Err(SseError::EventTooLarge { limit }));
        }
    }

    #[test]
    fn classify_never_panics(data in ".{0,64}") {
        let _ = classify(&data);
    }
}

#[test]
fn garbage_is_unknown_and_never_panics() {
    for data in ["", "{", "[1,2]", "null", "{\"choices\": 3}", "\u{0}"] {
        assert_eq!(classify(data), Chunk::Unknown, "{data:?}");
    }
    assert_eq!(classify("not json"), Chunk::Unknown);
    assert_eq!(classify("{\"error\": {\"message\": \"x\"}}"), Chunk::Error);
    assert_eq!(classify(" [DONE]"), Chunk::Done);
}

#[test]
fn an_error_key_makes_an_error_event_and_the_word_in_text_does_not() {
    assert_eq!(
        classify(r#"{"choices": [], "error": {"message": "x"}}"#),
        Chunk::Error
    );
    assert_eq!(classify(r#"{"error": null}"#), Chunk::Error);
    let Chunk::Delta(d) = classify(r#"{"choices": [{"text": "\"error\": 1"}]}"#) else {
        panic!("text that mentions an error is a delta")
    };
    assert_eq!(d.text.as_deref(), Some("\"error\": 1"));
    assert!(matches!(
        classify(r#"{"choices": [{"text": "x", "logprobs": {"error": 1}}]}"#),
        Chunk::Delta(_)
    ));
}

#[test]
fn a_chunk_with_a_field_of_the_wrong_type_is_unknown() {
    assert_eq!(classify(r#"{"choices": [{"text": 5}]}"#), Chunk::Unknown);
    assert_eq!(
        classify(r#"{"choices": [], "created": "now"}"#),
        Chunk::Unknown
    );
    assert_eq!(
        classify(r#"{"choices": [{"token_ids": [-1]}]}"#),
        Chunk::Unknown
    );
}

#[test]
fn chat_and_completion_chunks_yield_text_ids_and_finish() {
    let Chunk::Delta(d) = classify(
        r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" hi"},"token_ids":[5],"finish_reason":null}]}"#,
    ) else {
        panic!()
    };
    assert_eq!(d.text.as_deref(), Some(" hi"));
    assert_eq!(d.token_ids, Some(vec![5]));
    assert_eq!(d.finish_reason, None);
    assert_eq!(
        (d.id.as_str(), d.model.as_str(), d.created),
        ("chatcmpl-1", "m", 7)
    );
    let Chunk::Delta(d) =
        classify(r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#)
    else {
        panic!()
    };
    assert_eq!(d.finish_reason.as_deref(), Some("length"));
    assert_eq!(
        (d.id.as_str(), d.created),
        ("", 0),
        "absent fields read empty"
    );
}

#[test]
fn a_usage_that_is_not_an_object_reads_as_no_usage() {
    let Chunk::Delta(d) = classify(r#"{"choices": [], "usage": 3}"#) else {
        panic!()
    };
    assert_eq!(d.usage, None);
}

#[test]
fn a_chunk_counts_its_token_ids_else_one_token_for_text() {
    let count = |data: &str| match classify(data) {
        Chunk::Delta(d) => d.tokens(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        count(r#"{"choices":[{"text":" a b","token_ids":[1,2]}]}"#),
        2
    );
    assert_eq!(count(r#"{"choices":[{"delta":{"content":" a"}}]}"#), 1);
    assert_eq!(count(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#), 0);
    assert_eq!(
        count(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#),
        0
    );
    assert_eq!(
        count(r#"{"choices":[],"usage":{"completion_tokens":9}}"#),
        0
    );
}

#[test]
fn what_a_worker_writes_a_reader_reads_back() {
    let chunk = Completion {
        id: "chatcmpl-9".into(),
        object: Cow::Borrowed(Api::Chat.chunk_object()),
        created: 3,
        model: "m".into(),
        choices: vec![Choice {
            delta: Some(ChoiceDelta {
                role: Some("assistant".into()),
                content: Some(" yard".into()),
            }),
            token_ids: Some(vec![2]),
            ..Choice::default()
        }],
        usage: None,
    };
    let bytes = json_event(&chunk);
    let events = parse_frames(1024, &[&bytes]).unwrap();
    let Chunk::Delta(d) = classify(&events[0]) else {
        panic!()
    };
    assert_eq!(d.text.as_deref(), Some(" yard"));
    assert_eq!(d.token_ids, Some(vec![2]));
    assert_eq!(d.id, "chatcmpl-9");
    let v: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert!(v["choices"][0].get("text").is_none());
    assert!(v.get("usage").is_none());
}

#[test]
fn a_resumed_completion_chunk_is_rewritten_into_the_chat_shape() {
    let shape = StreamShape {
        api: Api::Chat,
        id: "chatcmpl-orig".into(),
        model: "m".into(),
        created: 42,
    };
    let Chunk::Delta(d) = classify(
        r#"{"id":"cmpl-new","object":"text_completion","created":99,"model":"other","choices":[{"index":0,"text":" yard","token_ids":[2],"finish_reason":null}]}"#,
    ) else {
        panic!()
    };
    let bytes = shape.rewrite(&d, None);
    let text = std::str::from_utf8(&bytes).unwrap();
    let payload = text.strip_prefix("data: ").unwrap().trim_end();
    let v: Value = serde_json::from_str(payload).unwrap();
    assert_eq!(v["id"], "chatcmpl-orig");
    assert_eq!(v["object"], "chat.completion.chunk");
    assert_eq!(v["created"], 42);
    assert_eq!(v["model"], "m");
    assert_eq!(v["choices"][0]["delta"]["content"], " yard");
    assert!(v["choices"][0].get("token_ids").is_none());
    assert!(text.ends_with("\n\n"));
}

#[test]
fn a_usage_chunk_keeps_empty_choices_in_the_completions_shape() {
    let shape = StreamShape {
        api: Api::Completions,
        id: "cmpl-1".into(),
        model: "m".into(),
        created: 1,
    };
    let d = Delta {
        usage: Some(Usage {
            completion_tokens: 3,
            ..Usage::default()
        }),
        ..Delta::default()
    };
    let usage = Usage {
        completion_tokens: 9,
        ..Usage::default()
    };
    let bytes = shape.rewrite(&d, Some(usage));
    let v: Value = serde_json::from_slice(&bytes[6..bytes.len() - 2]).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"], json!([]));
    assert_eq!(v["usage"]["completion_tokens"], 9);
}

#[test]
fn a_finish_without_text_is_rewritten_with_empty_text_or_an_empty_delta() {
    let finish = Delta {
        finish_reason: Some("length".into()),
        ..Delta::default()
    };
    for (api, choice) in [
        (
            Api::Completions,
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}),
        ),
        (
            Api::Chat,
            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}),
        ),
    ] {
        let shape = StreamShape {
            api,
            id: "x".into(),
            model: "m".into(),
            created: 1,
        };
        let bytes = shape.rewrite(&finish, None);
        let v: Value = serde_json::from_slice(&bytes[6..bytes.len() - 2]).unwrap();
        assert_eq!(v["choices"], json!([choice]));
        assert!(v.get("usage").is_none());
    }
}

/// A whole chunk's first choice, as `classify` read it before
/// `classify_ref` existed (the reference model below).
impl From<Completion<'_>> for Delta {
    fn from(chunk: Completion<'_>) -> Self {
        let first = chunk.choices.into_iter().next();
        let (text, token_ids, finish_reason) = match first {
            Some(choice) => {
                let text = match (choice.text, choice.delta) {
                    (Some(text), _) => Some(text),
                    (None, Some(delta)) => delta.content,
                    (None, None) => None,
                };
                (text, choice.token_ids, choice.finish_reason)
            }
            None => (None, None, None),
        };
        Delta {
            text: text.map(Cow::into_owned),
            token_ids,
            finish_reason: finish_reason.map(Cow::into_owned),
            usage: chunk.usage,
            id: chunk.id.into_owned(),
            model: chunk.model.into_owned(),
            created: chunk.created,
        }
    }
}

/// What `classify` read before `classify_ref` existed: the whole chunk as
/// a [`Completion`], then its first choice. The borrowed reader must agree
/// with it on every input.
fn classify_by_completion(data: &str) -> Chunk {
    let trimmed = data.trim();
    if trimmed == "[DONE]" {
        return Chunk::Done;
    }
    if !trimmed.starts_with('{') {
        return Chunk::Unknown;
    }
    if data.contains("\"error\"") && has_error_key_for_test(data) {
        return Chunk::Error;
    }
    match serde_json::from_str::<Completion<'_>>(data) {
        Ok(chunk) => Chunk::Delta(chunk.into()),
        Err(_) => Chunk::Unknown,
    }
}

fn has_error_key_for_test(data: &str) -> bool {
    serde_json::from_str::<Value>(data).is_ok_and(|v| v.get("error").is_some())
}

/// A JSON value of one of the types a chunk's fields may (wrongly) have.
fn any_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!("plain")),
        Just(json!("esc\"aped\n")),
        Just(json!(7)),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!(true)),
        Just(json!([1, 2])),
        Just(json!(["a"])),
        Just(json!({"content": "x"})),
        Just(json!({"role": "assistant", "content": "y"})),
        Just(json!({"prompt_tokens": 1, "completion_tokens": 2, "extra": 3})),
    ]
}

fn any_object(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    prop::collection::vec((prop::sample::select(keys), any_value()), 0..5).prop_map(|fields| {
        Value::Object(fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    })
}

fn any_chunk() -> impl Strategy<Value = String> {
    let choice = any_object(&[
        "index",
        "text",
        "message",
        "delta",
        "finish_reason",
        "token_ids",
        "logprobs",
        "other",
    ]);
    (
        any_object(&["id", "object", "created", "model", "usage", "other"]),
        prop_oneof![
            prop::collection::vec(choice, 0..3).prop_map(Value::Array),
            any_value()
        ],
        any::<bool>(),
    )
        .prop_map(|(mut chunk, choices, with_choices)| {
            if with_choices {
                chunk["choices"] = choices;
            }
            chunk.to_string()
        })
}

proptest! {
    #[test]
    fn the_borrowed_reader_agrees_with_reading_a_whole_completion(data in any_chunk()) {
        prop_assert_eq!(classify(&data), classify_by_completion(&data));
    }

    #[test]
    fn a_framed_event_is_the_event_bytes_of_its_data_in_one_exact_allocation(
        events in prop::collection::vec(event(), 0..12),
    ) {
        let stream: Vec<u8> = events.iter().flat_map(|(b, _)| b.clone()).collect();
        let expected: Vec<String> = events.into_iter().filter_map(|(_, d)| d).collect();
        let mut parser = SseParser::new(1 << 20);
        parser.push(&stream);
        let mut framed = Vec::new();
        while let Some(e) = parser.next_event_framed().unwrap() {
            prop_assert_eq!(Event::from_data(e.data()), e.clone());
            let bytes = e.into_bytes();
            prop_assert_eq!(bytes.len(), bytes.capacity());
            framed.push(bytes);
        }
        let want: Vec<Vec<u8>> = expected.iter().map(|d| event_bytes(d)).collect();
        prop_assert_eq!(framed, want);
    }
}

#[test]
fn a_plain_chunks_strings_are_borrowed_not_copied() {
    let data = r#"{"id":"cmpl-1","model":"m","choices":[{"text":" w","finish_reason":"length"},{"text":"other"}]}"#;
    let ChunkRef::Delta(delta) = classify_ref(data) else {
        panic!("a chunk");
    };
    assert!(matches!(delta.text, Some(Cow::Borrowed(" w"))));
    assert!(matches!(delta.finish_reason, Some(Cow::Borrowed("length"))));
    assert!(matches!(delta.id, Cow::Borrowed("cmpl-1")));
    let ChunkRef::Delta(chat) = classify_ref(r#"{"choices":[{"delta":{"content":" w"}}]}"#) else {
        panic!("a chunk");
    };
    assert!(matches!(chat.text, Some(Cow::Borrowed(" w"))));
    let ChunkRef::Delta(escaped) = classify_ref(r#"{"choices":[{"text":"a\nb"}]}"#) else {
        panic!("a chunk");
    };
    assert!(
        matches!(escaped.text, Some(Cow::Owned(ref text)) if text == "a\nb"),
        "a string with escapes is unescaped into a copy"
    );
    assert_eq!(
        classify_ref(r#"{"choices":[{"text":"a"},{"text":5}]}"#),
        ChunkRef::Unknown,
        "a later choice is type-checked like the first"
    );
}

#[test]
fn a_named_event_keeps_its_event_line_and_reads_its_data() {
    let mut parser = SseParser::new(1024);
    parser.push(b"event: message_start\r\ndata: {\"type\":\"message_start\"}\r\n\r\n: ping\n\nevent: message_st");
    let first = parser.next_event_named().unwrap().unwrap();
    assert_eq!(first.name(), Some("message_start"));
    assert_eq!(first.data(), "{\"type\":\"message_start\"}");
    assert_eq!(
        first.into_bytes(),
        b"event: message_start\ndata: {\"type\":\"message_start\"}\n\n"
    );
    // A comment-only event has no data: skipped; a half event waits.
    assert_eq!(parser.next_event_named().unwrap(), None);
    parser.push(b"op\ndata: {}\n\n");
    let second = parser.next_event_named().unwrap().unwrap();
    assert_eq!(second.name(), Some("message_stop"));
    let built = NamedEvent::new(Some("error"), "{}");
    assert_eq!(built.into_bytes(), b"event: error\ndata: {}\n\n");
}
