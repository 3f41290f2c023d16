//! Data-parallel ranks on real vLLM: one vLLM server with
//! `--data-parallel-size 2` (vLLM 0.32's CPU build runs it: two engine
//! cores, one per core through `VLLM_CPU_OMP_THREADS_BIND=0|1`, each
//! publishing its KV events on the `events=` port plus its rank) behind
//! `serve` with `dp-size=2` on the worker spec. Every request runs on the
//! rank the router named in `x-switchyard-worker` (vLLM's own per-engine
//! counter of that rank, and only that one, counts it: vLLM honoured the
//! router's `X-data-parallel-rank`),
//! a prompt sent again goes to the rank that holds it and hits vLLM's cache
//! there, and every event batch a rank publishes names that rank
//! (`data_parallel_rank`, read from vLLM's replay sockets).

use crate::support::{serve, served_by, wait_metrics};
use crate::tier::{admin_workers, bounded, exclusive, metrics, sum, tier, ADMIN};
use serde_json::{json, Value};

/// Reads every buffered batch from each replay port given, from sequence
/// 0 (vLLM's replay protocol: an empty frame and the start sequence; then
/// `(topic, seq, payload)` frames until the end-of-sequence marker), and
/// prints each port's batches' `data_parallel_rank` (the third field of
/// the msgpack array; absent: null) as JSON.
const REPLAY: &str = r#"
import sys, json, zmq, msgspec
END = (-1).to_bytes(8, "big", signed=True)
context, ranks = zmq.Context(), {}
for port in sys.argv[1:]:
    socket = context.socket(zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{port}")
    socket.send_multipart([b"", (0).to_bytes(8, "big")])
    seen = []
    while socket.poll(60000):
        frames = socket.recv_multipart()
        if frames[-2] == END:
            break
        batch = msgspec.msgpack.decode(frames[-1])
        seen.append(batch[2] if len(batch) > 2 else None)
    else:
        raise SystemExit(f"no end of replay from port {port}")
    ranks[port] = seen
print(json.dumps(ranks))
"#;

/// Distinct prompts, each sent twice.
const PROMPTS: usize = 4;

/// A label's value on the sample of `name` labelled `engine="RANK"`.
fn engine_label(text: &str, name: &str, rank: usize, key: &str) -> Option<String> {
    let engine = format!("engine=\"{rank}\"");
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(&engine))?;
    let start = line.find(&format!("{key}=\""))? + key.len() + 2;
    let end = line[start..].find('"')? + start;
    Some(line[start..end].to_owned())
}

/// The sum of `name`'s samples labelled `engine="RANK"` in vLLM's text.
fn engine_sum(text: &str, name: &str, rank: usize) -> f64 {
    let label = format!("engine=\"{rank}\"");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dp_size_2_vllm_runs_each_request_on_the_routers_rank_and_its_events_name_their_rank() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let mut options = tier.qwen3();
        options
            .extra_args
            .extend(["--data-parallel-size".into(), "2".into()]);
        // One core per rank (vLLM splits the list by data-parallel rank);
        // it replaces the one core the tier binds a server to.
        options
            .extra_env
            .push(("VLLM_CPU_OMP_THREADS_BIND".into(), "0|1".into()));
        let workers = tier.start("data-parallel", vec![("dp", options)]).await;
        let vllm = &workers[0];
        let router = serve(&[
            "--block-size".to_owned(),
            "32".to_owned(),
            "--worker".to_owned(),
            format!("{},dp-size=2", vllm.worker_spec("d")),
            "--health-interval-ms".to_owned(),
            "500".to_owned(),
            "--admin-token".to_owned(),
            ADMIN.to_owned(),
        ]);
        let client = reqwest::Client::new();
        wait_metrics(&client, &router.base, "both ranks in selection", |t| {
            sum(t, "switchyard_worker_up") == 2.0
        })
        .await;

        // Each rank holds one engine's KV cache: vLLM's page has a
        // `cache_config_info` series per engine, and a rank's capacity is
        // its engine's `num_gpu_blocks`, not the sum over both.
        let engines = metrics(&client, &vllm.base).await;
        let list: Value = admin_workers(&client, &router.base).await;
        for rank in 0..2 {
            let blocks = engine_label(&engines, "vllm:cache_config_info", rank, "num_gpu_blocks")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("engine {rank}'s KV blocks:\n{engines}"));
            let name = format!("d/{rank}");
            let worker = list["workers"]
                .as_array()
                .and_then(|ws| ws.iter().find(|w| w["name"] == name.as_str()))
                .unwrap_or_else(|| panic!("{name} listed: {list}"));
            assert_eq!(
                worker["capacity"]["kv_blocks"].as_u64(),
                Some(blocks),
                "{name}'s capacity is engine {rank}'s num_gpu_blocks: {list}"
            );
        }

        // Each prompt twice: a new prompt goes to the rank holding fewer
        // blocks, so they alternate once the index has heard each one's
        // blocks; the second time to the rank that holds it.
        let mut on = [0usize; 2];
        for i in 0..PROMPTS {
            let prompt = format!(
                "Prompt {i}: the yard master counts the cars on the hump at dawn and writes each one in the ledger. "
            )
            .repeat(4);
            let mut ranks = Vec::new();
            for _ in 0..2 {
                let index = sum(&metrics(&client, &router.base).await, "switchyard_index_blocks");
                let engines = metrics(&client, &vllm.base).await;
                let ran_before = [0, 1].map(|r| engine_sum(&engines, "vllm:request_success_total", r));
                let response = client
                    .post(format!("{}/v1/chat/completions", router.base))
                    .json(&json!({"model": "tiny", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": prompt}]}))
                    .send()
                    .await
                    .expect("the router answers");
                assert_eq!(response.status(), 200);
                let worker = served_by(&response);
                let answer: Value = response.json().await.expect("a JSON answer");
                assert!(answer["choices"].is_array(), "{answer}");
                let rank = match worker.as_str() {
                    "d/0" => 0,
                    "d/1" => 1,
                    other => panic!("a rank of d, not {other}"),
                };
                on[rank] += 1;
                // vLLM's engine of that rank, and no other, ran it.
                let mut ran = [0.0; 2];
                wait_metrics(&client, &vllm.base, "vLLM counted the request", |t| {
                    let now = [0, 1].map(|r| engine_sum(t, "vllm:request_success_total", r));
                    now[0] + now[1] > ran_before[0] + ran_before[1]
                })
                .await;
                let engines = metrics(&client, &vllm.base).await;
                for (r, before) in ran_before.iter().enumerate() {
                    ran[r] = engine_sum(&engines, "vllm:request_success_total", r) - before;
                }
                let mut expected = [0.0; 2];
                expected[rank] = 1.0;
                assert_eq!(ran, expected, "the request named d/{rank} ran on vLLM's engine {rank}");
                if ranks.is_empty() {
                    wait_metrics(&client, &router.base, "the prompt's blocks in the index", |t| {
                        sum(t, "switchyard_index_blocks") > index
                    })
                    .await;
                }
                ranks.push(rank);
            }
            assert_eq!(ranks[0], ranks[1], "prompt {i} again on the rank that holds it");
        }
        println!("data-parallel: requests by rank {on:?}");
        assert!(on[0] > 0 && on[1] > 0, "both ranks served: {on:?}");

        // In all, vLLM's engines ran what the router sent each rank.
        let text = metrics(&client, &vllm.base).await;
        for (rank, &n) in on.iter().enumerate() {
            assert_eq!(
                engine_sum(&text, "vllm:request_success_total", rank),
                n as f64,
                "vLLM's engine {rank} ran the requests the router sent to d/{rank}"
            );
            assert!(
                engine_sum(&text, "vllm:prefix_cache_hits_total", rank) > 0.0,
                "the prompts sent again hit engine {rank}'s cache"
            );
        }

        // The router read each rank's events from its own port, none
        // refused (a batch naming another rank than its port's would be).
        let text = metrics(&client, &router.base).await;
        assert_eq!(sum(&text, "switchyard_kv_events_dropped_total"), 0.0, "{text}");
        for rank in ["d/0", "d/1"] {
            assert!(
                crate::support::metric(
                    &text,
                    &format!("switchyard_kv_events_applied_total{{worker=\"{rank}\",tier=\"device\"}}")
                )
                .is_some_and(|n| n > 0.0),
                "{rank}'s events applied:\n{text}"
            );
        }

        // And vLLM's batches name their rank themselves.
        let ports: Vec<String> = (0..2)
            .map(|r| (vllm.ports.replay + r).to_string())
            .collect();
        let python = tier.python.clone();
        let output = tokio::task::spawn_blocking(move || {
            std::process::Command::new(python)
                .arg("-c")
                .arg(REPLAY)
                .args(&ports)
                .output()
                .expect("python runs")
        })
        .await
        .expect("the script's thread");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "stdout: {stdout}\nstderr: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let ranks: Value = serde_json::from_str(stdout.trim()).expect("the ranks as JSON");
        for r in 0..2u16 {
            let seen = ranks[(vllm.ports.replay + r).to_string()]
                .as_array()
                .expect("the port's batches")
                .clone();
            println!("data-parallel: rank {r}'s replay: {} batches", seen.len());
            assert!(!seen.is_empty(), "rank {r} published batches");
            assert!(
                seen.iter().all(|v| v.as_u64() == Some(u64::from(r))),
                "every batch of rank {r}'s publisher names rank {r}: {seen:?}"
            );
        }
    })
    .await;
}
