//! A `previous_response_id` chain of 20 turns through three router
//! replicas (`--replica-sync` over a private `nats-server`) in front of
//! four sim-workers, each turn sent to the next replica in turn: every
//! turn lands on the worker that stores its previous response, and the
//! chain's engine hit rate is at least 95% of what the same chain gets
//! on one worker alone (its ceiling: the new input of each turn is never
//! cached anywhere). Real processes on loopback; skipped, with the
//! reason printed, when no `nats-server` binary is installed.

use crate::support::{machine, router, sim_worker_with, Proc};
use serde_json::{json, Value};
use switchyard_replica::nats_server::nats_server_binary;
use switchyard_replica::LocalNatsServer;

const TURNS: usize = 20;

fn worker() -> Proc {
    sim_worker_with(0, &["--num-blocks", "4096", "--no-delay"])
}

/// Runs the chain, turn `i` through `bases[i % len]`: the worker of
/// every turn and the chain's cached and prompt tokens after its first
/// turn.
async fn chain(client: &reqwest::Client, bases: &[String]) -> (Vec<String>, u64, u64) {
    let mut previous: Option<String> = None;
    let (mut cached, mut prompt) = (0u64, 0u64);
    let mut workers = Vec::new();
    for turn in 0..TURNS {
        let base = &bases[turn % bases.len()];
        let mut body = json!({
            "model": "switchyard-sim",
            "input": [{"role": "user", "content": format!("Turn {turn}: what does the yard do with the request of this turn? ")}],
            "max_output_tokens": 16,
        });
        match &previous {
            Some(id) => body["previous_response_id"] = json!(id),
            None => {
                body["instructions"] =
                    json!("You route requests to the worker holding their prefix. ".repeat(30))
            }
        }
        let response = client
            .post(format!("{base}/v1/responses"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let worker = response
            .headers()
            .get("x-switchyard-worker")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let answer: Value = response.json().await.unwrap();
        assert_eq!(status, 200, "turn {turn}: {answer}");
        if turn > 0 {
            cached += answer["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            prompt += answer["usage"]["input_tokens"].as_u64().unwrap();
        }
        previous = Some(answer["id"].as_str().unwrap().to_owned());
        workers.push(worker);
    }
    (workers, cached, prompt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twenty_turn_chain_through_three_replicas_stays_on_its_worker_and_hits_its_cache() {
    let _machine = machine().await;
    if nats_server_binary().is_none() {
        eprintln!(
            "skipping: no nats-server binary (install it: apt-get install -y nats-server, or set NATS_SERVER)"
        );
        return;
    }
    let client = reqwest::Client::new();
    // The ceiling: the same chain on one worker alone.
    let alone = worker();
    let (_, ceiling_cached, ceiling_prompt) =
        chain(&client, std::slice::from_ref(&alone.base)).await;
    let ceiling = ceiling_cached as f64 / ceiling_prompt as f64;

    let nats = LocalNatsServer::start().expect("nats-server starts");
    let url = nats.url();
    let sims: Vec<Proc> = (0..4).map(|_| worker()).collect();
    let specs: Vec<String> = sims
        .iter()
        .enumerate()
        .map(|(i, w)| w.named(&format!("w{i}")))
        .collect();
    let replicas: Vec<Proc> = (0..3)
        .map(|_| {
            router(
                &specs,
                &["--replica-sync", &url, "--replica-endpoint", "chain"],
            )
        })
        .collect();
    let bases: Vec<String> = replicas.iter().map(|r| r.base.clone()).collect();
    let (workers, cached, prompt) = chain(&client, &bases).await;
    assert!(
        workers.iter().all(|w| *w == workers[0] && !w.is_empty()),
        "every turn on the chain's worker: {workers:?}"
    );
    let rate = cached as f64 / prompt as f64;
    println!(
        "chain hit rate {rate:.3} ({cached}/{prompt} tokens) vs one worker's {ceiling:.3} ({ceiling_cached}/{ceiling_prompt}): {:.1}% of the ceiling",
        100.0 * rate / ceiling
    );
    assert!(
        rate >= 0.95 * ceiling,
        "hit rate {rate:.3} under 95% of the ceiling {ceiling:.3}"
    );
}
