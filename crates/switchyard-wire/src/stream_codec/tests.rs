//! The codecs as the relay drives them: what a first worker's events
//! become, what a resumed worker's chunks become, and what each API sends
//! when a stream cannot go on.

use super::chat::Chunks;
use super::named::Named;
use super::{Ending, Prompt, Seen, Step, StreamCodec};
use crate::agentic::AgenticApi;
use crate::openai::{Api, ErrorBody};
use crate::sse::{Event, NamedEvent};
use serde_json::{json, Value};
use switchyard_core::dispatch::failure::Progress;

fn chunk(value: Value) -> Event {
    Event::from_data(&value.to_string())
}

fn sent(step: Step) -> String {
    match step {
        Step::Send(bytes) => String::from_utf8(bytes).unwrap(),
        other => panic!("expected bytes to send, got {other:?}"),
    }
}

/// The JSON of each `data:` line in `text` but `[DONE]`.
fn data_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn a_first_workers_chunk_is_forwarded_byte_for_byte_and_its_tokens_recorded() {
    let mut codec = Chunks::new(Api::Chat, "req-1");
    let mut progress = Progress::new(1024);
    let event = chunk(json!({
        "id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 5, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]
    }));
    let bytes = event.clone().into_bytes();
    let mut seen = Seen::new(&mut progress);
    let step = codec.first_worker(event, &mut seen);
    assert!(seen.output);
    assert_eq!(seen.stored, None);
    assert_eq!(step, Step::Send(bytes));
    assert_eq!(progress.generated, 1);
}

#[test]
fn a_first_workers_done_ends_the_stream_and_an_error_chunk_breaks_it() {
    let mut codec = Chunks::new(Api::Chat, "req-1");
    let mut progress = Progress::new(1024);
    let done = Event::from_data("[DONE]");
    let step = codec.first_worker(done, &mut Seen::new(&mut progress));
    assert_eq!(step, Step::End(Ending::Ok, b"data: [DONE]\n\n".to_vec()));
    let error =
        chunk(json!({"error": {"message": "engine died", "type": "internal", "code": 500}}));
    let step = codec.first_worker(error, &mut Seen::new(&mut progress));
    assert!(matches!(step, Step::Broken(_)), "{step:?}");
}

#[test]
fn a_resumed_workers_completion_chunk_takes_the_chat_responses_shape_and_whole_usage() {
    let mut codec = Chunks::new(Api::Chat, "req-1");
    let mut progress = Progress::new(1024);
    let first = chunk(json!({
        "id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 5, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]
    }));
    codec.first_worker(first, &mut Seen::new(&mut progress));
    // Resumed after 1 token, on a prompt of 3 ids.
    let at = Prompt {
        ids: vec![1, 2, 3],
        tokens: 3,
        generated_at_resume: progress.generated,
    };
    let resumed = chunk(json!({
        "id": "cmpl-other", "object": "text_completion", "created": 9, "model": "m",
        "choices": [{"index": 0, "text": " there", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    }));
    let mut seen = Seen::new(&mut progress);
    let text = sent(codec.resumed_event(&resumed, &mut seen, &at));
    assert!(seen.output);
    let lines = data_lines(&text);
    let last = lines.last().unwrap();
    assert_eq!(last["id"], "chatcmpl-7");
    assert_eq!(last["object"], "chat.completion.chunk");
    assert_eq!(last["choices"][0]["delta"]["content"], " there");
    // Usage is the whole request's: the original prompt, every token.
    assert_eq!(last["usage"]["prompt_tokens"], 3);
    assert_eq!(last["usage"]["completion_tokens"], 2);
    assert_eq!(progress.generated, 2);
    // The resumed worker's [DONE]: one [DONE] in all.
    let done = Event::from_data("[DONE]");
    let step = codec.resumed_event(&done, &mut Seen::new(&mut progress), &at);
    assert_eq!(step, Step::End(Ending::Ok, b"data: [DONE]\n\n".to_vec()));
}

#[test]
fn a_chat_stream_that_cannot_move_ends_with_an_openai_error_event() {
    let codec = Chunks::new(Api::Completions, "req-1");
    let bytes = codec.error_event(&ErrorBody::upstream("no worker left"));
    let text = String::from_utf8(bytes).unwrap();
    let lines = data_lines(&text);
    assert_eq!(lines[0]["error"]["message"], "no worker left");
}

#[test]
fn a_stored_responses_id_is_told_to_the_relay_and_an_unstored_ones_is_not() {
    let created = json!({"type": "response.created", "sequence_number": 0,
        "response": {"id": "resp_1", "object": "response", "status": "in_progress"}});
    for (stored, told) in [(true, Some("resp_1".to_owned())), (false, None)] {
        let mut progress = Progress::new(1024);
        let mut codec = Named::new(AgenticApi::Responses, stored, &progress, "req-1");
        let event = NamedEvent::new(Some("response.created"), &created.to_string());
        let bytes = event.clone().into_bytes();
        let mut seen = Seen::new(&mut progress);
        let step = codec.first_worker(event, &mut seen);
        assert_eq!(seen.stored, told, "stored: {stored}");
        assert_eq!(step, Step::Send(bytes));
    }
}

#[test]
fn a_named_streams_last_event_ends_it_and_a_workers_error_event_ends_it_as_the_workers() {
    let mut progress = Progress::new(1024);
    let mut codec = Named::new(AgenticApi::Messages, false, &progress, "req-1");
    let delta = json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": "Hi"}});
    let step = codec.first_worker(
        NamedEvent::new(Some("content_block_delta"), &delta.to_string()),
        &mut Seen::new(&mut progress),
    );
    assert!(matches!(step, Step::Send(_)));
    assert_eq!(progress.generated, 1);
    let stop = NamedEvent::new(Some("message_stop"), r#"{"type":"message_stop"}"#);
    let step = codec.first_worker(stop, &mut Seen::new(&mut progress));
    assert!(matches!(step, Step::End(Ending::Ok, _)), "{step:?}");
    let error = json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}});
    let step = codec.first_worker(
        NamedEvent::new(Some("error"), &error.to_string()),
        &mut Seen::new(&mut progress),
    );
    assert!(
        matches!(step, Step::End(Ending::WorkerError, _)),
        "{step:?}"
    );
}

#[test]
fn a_named_stream_that_cannot_move_ends_with_its_apis_error_event() {
    let progress = Progress::new(1024);
    let codec = Named::new(AgenticApi::Messages, false, &progress, "req-1");
    let text = String::from_utf8(codec.error_event(&ErrorBody::upstream("gone"))).unwrap();
    assert!(text.starts_with("event: error\n"), "{text}");
    let data = data_lines(&text);
    assert_eq!(data[0]["type"], "error");
    assert_eq!(data[0]["error"]["message"], "gone");
}

#[test]
fn a_stored_response_keeps_no_text_and_is_never_resumed_for_its_text() {
    let progress = Progress::new(1024);
    let mut stored = Named::new(AgenticApi::Responses, true, &progress, "req-1");
    let kept = Named::new(AgenticApi::Responses, false, &progress, "req-1");
    let body = br#"{"model":"m","input":"hi","stream":true,"store":false}"#;
    let fields = crate::body_fields::Fields::parse(body).unwrap();
    assert_eq!(kept.resumable(&fields), Ok(()));
    // Nothing kept: any text at all overflows what the stream keeps.
    let mut p = Progress::new(1024);
    let delta = json!({"type": "response.output_text.delta", "item_id": "msg_1",
        "output_index": 0, "content_index": 0, "delta": "Hi", "sequence_number": 3});
    stored.first_worker(
        NamedEvent::new(Some("response.output_text.delta"), &delta.to_string()),
        &mut Seen::new(&mut p),
    );
    assert!(stored.resumable(&fields).is_err());
}
