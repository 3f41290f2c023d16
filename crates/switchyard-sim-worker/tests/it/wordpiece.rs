//! A sim-worker serving a model whose tokenizer is WordPiece (BERT-style,
//! as embedding models such as all-MiniLM-L6-v2 have), from a Hugging
//! Face directory with no chat template: text prompts are served (with
//! fixed output words, as WordPiece has no word tokens that keep their
//! space), chat requests get a 400 that says why.

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
