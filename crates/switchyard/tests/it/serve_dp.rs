//! Data-parallel ranks end to end: the router in front of a sim-worker
//! serving two ranks behind one port (`--worker URL,dp-size=2,events=...`
//! against `sim-worker --dp-size 2`), real processes on loopback. Each
//! rank is a target of its own: its KV events (on the events port plus
//! the rank) fill its own index entries, the route names the rank with
//! `X-data-parallel-rank`, and the worker runs the request on that rank.

use crate::support::{machine, metric, metrics_text, poll, served_by, sim_worker_with, PATIENCE};
use serde_json::json;

/// Prompt tokens the worker's rank `rank` admitted.
async fn rank_tokens(client: &reqwest::Client, worker: &str, rank: u32) -> f64 {
    let text = metrics_text(client, worker).await;
    metric(
        &text,
        &format!("switchyard_engine_prompt_tokens_total{{rank=\"{rank}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Sends `prompt`; the target the router named (`w/r`).
async fn send(client: &reqwest::Client, base: &str, prompt: &[u32]) -> String {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "switchyard-sim", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    served_by(&response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_is_a_target_with_its_own_events_and_the_route_names_the_rank() {
    let _machine = machine().await;
    let worker = sim_worker_with(
        0,
        &[
            "--speedup",
            "0",
            "--num-blocks",
            "1024",
            "--dp-size",
            "2",
            "--kv-events",
            "tcp://127.0.0.1:*",
        ],
    );
    let (events, _) = worker
        .kv
        .clone()
        .expect("the worker prints its KV endpoints");
    let spec = format!("{},dp-size=2,events={events}", worker.named("w"));
    let router = crate::support::serve(&[
        "--worker",
        &spec,
        "--policy",
        "kv",
        "--health-interval-ms",
        "200",
    ]);
    let base = router.base.clone();
    let client = reqwest::Client::new();

    // Both ranks enter selection as targets of their own.
    let up = poll(PATIENCE, async || {
        let text = metrics_text(&client, &base).await;
        metric(&text, "switchyard_worker_up{worker=\"w/0\"}") == Some(1.0)
            && metric(&text, "switchyard_worker_up{worker=\"w/1\"}") == Some(1.0)
    })
    .await;
    assert!(up.is_some(), "{}", metrics_text(&client, &base).await);

    // A prompt runs on the rank the router named.
    let prompt: Vec<u32> = (0..512).map(|t| 2000 + t).collect();
    let first = send(&client, &base, &prompt).await;
    let rank: u32 = first.strip_prefix("w/").unwrap().parse().unwrap();
    assert_eq!(rank_tokens(&client, &worker.base, rank).await, 512.0);
    assert_eq!(rank_tokens(&client, &worker.base, 1 - rank).await, 0.0);

    // That rank's events reach its own index entries (the other rank's
    // port is subscribed too, and has published nothing).
    let indexed = poll(PATIENCE, async || {
        let text = metrics_text(&client, &base).await;
        metric(&text, "switchyard_index_blocks").unwrap_or(0.0) >= 8.0
    })
    .await;
    assert!(indexed.is_some(), "{}", metrics_text(&client, &base).await);

    // The same prompt again follows its cache to the same rank, and the
    // worker runs it there (the header honoured).
    for _ in 0..3 {
        assert_eq!(send(&client, &base, &prompt).await, first);
    }
    assert_eq!(rank_tokens(&client, &worker.base, rank).await, 4.0 * 512.0);
    assert_eq!(rank_tokens(&client, &worker.base, 1 - rank).await, 0.0);
}
