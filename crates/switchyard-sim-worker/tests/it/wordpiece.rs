//! A sim-worker serving a model whose tokenizer is WordPiece (BERT-style,
//! as embedding models such as all-MiniLM-L6-v2 have), from a Hugging
//! Face directory with no chat template: text prompts are served, with
//! output text made of the vocabulary's whole words (each written with a
//! space in front) that a client re-tokenizing it counts as `usage`; chat
//! requests get a 400 that says why.

use crate::output_text::ask;
use crate::support::serve_worker_with;
use serde_json::{json, Value};
use std::path::Path;
use switchyard_tokenizer::Tokenizer;

fn wordpiece() -> Tokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wordpiece");
    Tokenizer::from_dir(&dir).expect("the WordPiece fixture loads")
}

#[tokio::test]
async fn a_wordpiece_model_answers_text_prompts_and_refuses_chat_clearly() {
    let tokenizer = wordpiece();
    assert!(tokenizer.fast_path_unsupported().is_some());
    // Saved padding (to 32) and truncation (to 8) do not apply to prompts.
    let prompt = "The river runs to the sea, the river runs to the sea.";
    assert_eq!(tokenizer.encode(prompt).unwrap().len(), 16);
    let base = serve_worker_with(&[], tokenizer).await.base;
    let client = reqwest::Client::new();

    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let reply: Value = response.json().await.unwrap();
    assert_eq!(reply["usage"]["prompt_tokens"], 16, "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 5, "{reply}");
    assert!(
        !reply["choices"][0]["text"].as_str().unwrap().is_empty(),
        "{reply}"
    );

    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let reply: Value = response.json().await.unwrap();
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("no chat template"), "{reply}");
    assert!(message.contains("/v1/completions"), "{reply}");
}

#[tokio::test]
async fn a_wordpiece_models_answers_re_tokenize_to_usage_and_the_returned_ids() {
    let tokenizer = wordpiece();
    let base = serve_worker_with(&[], wordpiece()).await.base;
    let mut asked = 0;
    for stream in [false, true] {
        for return_token_ids in [true, false] {
            for max_tokens in [1, 7, 200] {
                let body = json!({
                    "model": "m",
                    "prompt": "The river runs to the sea.",
                    "max_tokens": max_tokens,
                    "return_token_ids": return_token_ids,
                });
                let answer = ask(&base, "/v1/completions", body, stream).await;
                let what = format!("stream={stream} max_tokens={max_tokens}");
                assert_eq!(answer.completion_tokens, max_tokens, "{what}");
                // Counted as a client counts output text: without [CLS]
                // and [SEP] (the tokenizers crate, add_special_tokens off).
                let counted = tokenizer.encode(&answer.text).unwrap();
                assert_eq!(
                    counted.len(),
                    answer.completion_tokens,
                    "{what}: {answer:?}"
                );
                // Every word is written with its space, the first too.
                assert!(answer.text.starts_with(' '), "{what}: {answer:?}");
                assert_eq!(
                    tokenizer.decode(&counted).unwrap(),
                    answer.text[1..],
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
    assert_eq!(asked, 12);
}
