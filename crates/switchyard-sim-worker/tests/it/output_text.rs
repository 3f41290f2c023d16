//! A client that re-tokenizes a sim-worker's answers counts what the
//! worker reported: a worker served in-process over a real socket,
//! completions and chat, streamed and not, with the bundled tokenizer.

use crate::support::{metric, serve_worker};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::OnceLock;
use switchyard_tokenizer::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::bundled().expect("bundled tokenizer loads"))
}

/// A sim-worker with no flags beyond the common ones; its base URL.
async fn worker() -> String {
    serve_worker(&[]).await.base
}

/// One answer as a client sees it.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) text: String,
    /// `None` when the reply carried none.
    pub(crate) token_ids: Option<Vec<u32>>,
    pub(crate) completion_tokens: usize,
    pub(crate) cached_tokens: usize,
}

fn ids(value: &Value) -> Option<Vec<u32>> {
    value
        .as_array()
        .map(|a| a.iter().map(|v| v.as_u64().unwrap() as u32).collect())
}

/// Posts `body` to `path`; streamed with usage when `stream`, else whole
/// (the streamed chunks' texts concatenated).
pub(crate) async fn ask(base: &str, path: &str, mut body: Value, stream: bool) -> Answer {
    body["stream"] = json!(stream);
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let usage_of = |usage: &Value| {
        (
            usage["completion_tokens"].as_u64().unwrap() as usize,
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0) as usize,
        )
    };
    if !stream {
        let reply: Value = response.json().await.unwrap();
        let choice = &reply["choices"][0];
        let text = choice["text"]
            .as_str()
            .or(choice["message"]["content"].as_str())
            .unwrap()
            .to_owned();
        let (completion_tokens, cached_tokens) = usage_of(&reply["usage"]);
        return Answer {
            text,
            token_ids: ids(&choice["token_ids"]),
            completion_tokens,
            cached_tokens,
        };
    }
    let mut sse = String::new();
    let mut bytes = response.bytes_stream();
    while let Some(chunk) = bytes.next().await {
        sse.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    let mut answer = Answer {
        text: String::new(),
        token_ids: None,
        completion_tokens: 0,
        cached_tokens: 0,
    };
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        if let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) {
            if let Some(text) = choice["text"]
                .as_str()
                .or(choice["delta"]["content"].as_str())
            {
                answer.text.push_str(text);
            }
            if let Some(ids) = ids(&choice["token_ids"]) {
                answer.token_ids.get_or_insert_with(Vec::new).extend(ids);
            }
        }
        if chunk["usage"].is_object() {
            (answer.completion_tokens, answer.cached_tokens) = usage_of(&chunk["usage"]);
        }
    }
    answer
}

#[tokio::test]
async fn re_tokenized_answers_count_usage_and_equal_the_returned_ids() {
    let base = worker().await;
    let mut asked = 0;
    for (path, prompt) in [
        ("/v1/completions", json!({"prompt": "The river"})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me about rivers."}]}),
        ),
    ] {
        for stream in [false, true] {
            for return_token_ids in [true, false] {
                for max_tokens in [1, 7, 200] {
                    let mut body = prompt.clone();
                    body["max_tokens"] = json!(max_tokens);
                    body["return_token_ids"] = json!(return_token_ids);
                    let answer = ask(&base, path, body, stream).await;
                    let what = format!("{path} stream={stream} max_tokens={max_tokens}");
                    assert_eq!(answer.completion_tokens, max_tokens, "{what}");
                    let counted = tokenizer().encode(&answer.text).unwrap();
                    assert_eq!(
                        counted.len(),
                        answer.completion_tokens,
                        "{what}: {answer:?}"
                    );
                    assert_eq!(
                        tokenizer().encode_reference(&answer.text).unwrap(),
                        counted,
                        "{what}"
                    );
                    if return_token_ids {
                        assert_eq!(answer.token_ids.as_ref(), Some(&counted), "{what}");
                    } else {
                        assert_eq!(answer.token_ids, None, "{what}");
                    }
                    asked += 1;
                }
            }
        }
    }
    assert_eq!(asked, 24);
}

/// The next turn of a conversation holds the previous answer as text; the
/// worker re-tokenizes it to the ids it generated, so the blocks computed
/// while answering are hit.
#[tokio::test]
async fn a_conversations_next_turn_hits_the_blocks_of_the_previous_answer() {
    let base = worker().await;
    let first_turn = json!([{"role": "user", "content": "Name a few rivers, please."}]);
    let body = json!({"messages": first_turn, "max_tokens": 100, "return_token_ids": true});
    let answer = ask(&base, "/v1/chat/completions", body, false).await;
    let messages = [switchyard_tokenizer::ChatMessage {
        role: "user".into(),
        content: "Name a few rivers, please.".into(),
        tool_calls: Vec::new(),
        reasoning: None,
    }];
    let prompt = tokenizer()
        .encode(&tokenizer().apply_chat_template(&messages, true).unwrap())
        .unwrap();
    // The tokens computed while answering: the prompt and every output
    // token but the last (it was sampled, never fed back).
    let computed = prompt.len() + answer.completion_tokens - 1;
    let block = 16;
    assert!(
        computed / block > prompt.len() / block,
        "the answer fills blocks of its own"
    );

    let mut second_turn = first_turn.as_array().unwrap().clone();
    second_turn.push(json!({"role": "assistant", "content": answer.text}));
    second_turn.push(json!({"role": "user", "content": "And a few more?"}));
    let body = json!({"messages": second_turn, "max_tokens": 4});
    let next = ask(&base, "/v1/chat/completions", body, false).await;
    assert_eq!(next.cached_tokens, computed / block * block, "{answer:?}");
}

/// With `--spec-decode` a decode step emits a request's accepted drafts
/// too: every draft accepted, four a step, a 100-token answer takes about
/// a fifth of the steps, and still has exactly `max_tokens` that read back
/// as its ids, streamed or not.
#[tokio::test]
async fn speculative_decoding_takes_fewer_steps_for_the_same_answer() {
    let base = serve_worker(&["--spec-decode", "1.0", "--spec-draft-tokens", "4"])
        .await
        .base;
    let steps = "switchyard_engine_steps_total";
    for stream in [false, true] {
        let before = metric(&base, steps).await;
        let body = json!({"prompt": "The river", "max_tokens": 100, "return_token_ids": true});
        let answer = ask(&base, "/v1/completions", body, stream).await;
        let taken = metric(&base, steps).await - before;
        assert_eq!(answer.completion_tokens, 100, "stream={stream}");
        let counted = tokenizer().encode(&answer.text).unwrap();
        assert_eq!(answer.token_ids.as_ref(), Some(&counted), "stream={stream}");
        // One prefill step, then 99 tokens five a step.
        assert!(
            (1.0..=25.0).contains(&taken),
            "stream={stream}: {taken} steps"
        );
    }
}
