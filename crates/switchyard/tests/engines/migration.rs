//! A vLLM worker killed mid-stream: the stream goes on from the other
//! worker with the tokens generated so far as its prompt, ends whole, and
//! the router's bookings return to zero. The router's tokenizer is not
//! named: it resumes by token ids because vLLM's `/tokenize` agreed with it.

use crate::support::{metric, metric_sum, wait_metrics};
use crate::tier::{bounded, exclusive, metrics, serve_in_front, sum, tier};
use futures_util::StreamExt as _;
use serde_json::{json, Value};

/// Tokens the stream asks for (`ignore_eos`: a random model may end early).
const MAX_TOKENS: u64 = 240;
/// Tokens read before the serving worker is killed.
const KILL_AFTER: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_a_killed_vllm_worker_completes_on_the_other() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let mut workers = tier
            .start(
                "migration",
                vec![("v0", tier.qwen3()), ("v1", tier.qwen3())],
            )
            .await;
        let client = reqwest::Client::new();
        let flags = ["--block-size", "32", "--health-interval-ms", "500"];
        let router =
            serve_in_front(&client, &workers, flags.map(str::to_owned).to_vec()).await;
        // The router's tokenizer was not named: vLLM's own `/tokenize`
        // agreed with it on the probe, which is what lets the stream be
        // resumed by token ids below.
        let text = metrics(&client, &router.base).await;
        assert_eq!(
            metric(
                &text,
                "switchyard_model_tokenizer_checked{model=\"default\"}"
            ),
            Some(1.0),
            "{text}"
        );

        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&json!({
                "model": "tiny",
                "messages": [{"role": "user", "content": "Tell me a very long story about freight yards."}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": true,
                "stream": true,
                "stream_options": {"include_usage": true},
            }))
            .send()
            .await
            .expect("the router answers");
        assert_eq!(response.status(), 200);
        let first = response.headers()["x-switchyard-worker"]
            .to_str()
            .expect("an ASCII worker name")
            .to_owned();
        let victim = if first == "v0" { 0 } else { 1 };

        let mut body = response.bytes_stream();
        let mut text = String::new();
        let mut killed = false;
        while let Some(chunk) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.expect("the stream goes on")));
            if !killed && text.matches("\"delta\"").count() >= KILL_AFTER {
                workers[victim].kill();
                killed = true;
            }
        }
        assert!(killed, "the stream was long enough to kill its worker mid-way:\n{text}");

        let events: Vec<&str> = text
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data: "))
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "the stream ends whole:\n{text}");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap_or_else(|_| panic!("not JSON: {e}")))
            .collect();
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "no error event:\n{text}"
        );
        let finish = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0)?["finish_reason"].as_str())
            .next_back();
        assert_eq!(finish, Some("length"), "it ran to max_tokens:\n{text}");
        let usage = chunks
            .iter()
            .rev()
            .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
            .expect("a usage chunk");
        assert_eq!(
            usage["completion_tokens"].as_u64(),
            Some(MAX_TOKENS),
            "the tokens of both workers count once each: {usage}"
        );

        let text = metrics(&client, &router.base).await;
        assert_eq!(
            metric(&text, "switchyard_migrations_total{reason=\"midstream\"}"),
            Some(1.0),
            "{text}"
        );
        // The survivor served the rest: its own counter says so.
        let survivor = metrics(&client, &workers[1 - victim].base).await;
        assert!(
            metric_sum(&survivor, "vllm:request_success_total") >= 1.0,
            "the other worker finished the resumed request:\n{survivor}"
        );
        wait_metrics(&client, &router.base, "bookings back to zero", |t| {
            metric(t, "switchyard_active_requests") == Some(0.0)
                && sum(t, "switchyard_worker_active_requests") == 0.0
        })
        .await;
    })
    .await;
}
