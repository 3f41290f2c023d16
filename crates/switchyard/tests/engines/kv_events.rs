//! vLLM's KV events, live and replayed: the router applies every one (none
//! dropped), predicts vLLM's own prefix-cache hits over a multi-turn run,
//! and a router started after the run learns the workers' history from
//! vLLM's replay endpoint.

use crate::support::{metric, serve, wait_metrics};
use crate::tier::{bounded, exclusive, metrics, sum, tier, vllm_prefix_cache};
use serde_json::{json, Value};
use switchyard_commands::loadgen::{self, Pacing};

/// Conversation turns of the multi-turn run.
const TURNS: usize = 300;
/// How far the router's predicted hit tokens may be from vLLM's, as a
/// share of vLLM's.
const TOLERANCE: f64 = 0.05;

/// Every KV-event drop the router counts, by reason, summed.
fn dropped(text: &str) -> f64 {
    sum(text, "switchyard_kv_events_dropped_total") + sum(text, "switchyard_kv_events_stale_total")
}

/// The router's predicted hit tokens: the blocks it expected the chosen
/// workers to hold, in tokens.
fn predicted_hit_tokens(text: &str, block_size: f64) -> f64 {
    sum(text, "switchyard_model_expected_hit_blocks_total") * block_size
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_kv_events_are_applied_and_replayed_and_the_router_predicts_vllms_hit_rate() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let workers = tier
            .start(
                "kv-events",
                vec![("v0", tier.qwen3()), ("v1", tier.qwen3())],
            )
            .await;
        let flags = |workers: &[switchyard_commands::engines::vllm::VllmWorker]| {
            let mut f = vec!["--block-size".to_owned(), "32".to_owned()];
            for (i, w) in workers.iter().enumerate() {
                f.extend(["--worker".to_owned(), w.worker_spec(&format!("v{i}"))]);
            }
            f.extend(["--health-interval-ms".into(), "500".into()]);
            f
        };
        let client = reqwest::Client::new();
        let router = serve(&flags(&workers));
        wait_metrics(&client, &router.base, "both vLLM workers in selection", |t| {
            sum(t, "switchyard_worker_up") == 2.0
        })
        .await;

        // The multi-turn run: ShareGPT conversations, each turn the whole
        // conversation so far, four users at a time.
        let sharegpt = switchyard_commands::data::data_path("traces/sharegpt_multiturn_3000.jsonl.gz")
            .expect("the bundled ShareGPT conversations");
        let requests = loadgen::sharegpt_requests(&sharegpt, TURNS, 16, Some("tiny"))
            .expect("reading the conversations");
        let engines: Vec<String> = workers.iter().map(|w| w.base.clone()).collect();
        let report = loadgen::run_load(
            &router.base,
            requests,
            Pacing::Concurrency(4),
            true,
            &engines,
            false,
        )
        .await;
        assert_eq!(report.requests, TURNS);
        assert_eq!(report.errors, 0, "every turn is answered");

        let text = metrics(&client, &router.base).await;
        let stored = metric(&text, "switchyard_kv_events_total{worker=\"v0\",type=\"BlockStored\"}")
            .unwrap_or(0.0)
            + metric(&text, "switchyard_kv_events_total{worker=\"v1\",type=\"BlockStored\"}")
                .unwrap_or(0.0);
        assert!(stored > 0.0, "vLLM's BlockStored events reached the router:\n{text}");
        assert_eq!(dropped(&text), 0.0, "no event was dropped:\n{text}");
        assert_eq!(
            sum(&text, "switchyard_kv_events_applied_total"),
            sum(&text, "switchyard_kv_events_total"),
            "every event received was applied:\n{text}"
        );

        // The router's prediction against vLLM's own counters.
        let (hits, queries) = vllm_prefix_cache(&client, &workers.iter().collect::<Vec<_>>()).await;
        let predicted = predicted_hit_tokens(&text, 32.0);
        assert!(hits > 0.0 && queries > 0.0, "vLLM counted hits: {hits} of {queries}");
        let off = (predicted - hits).abs() / hits;
        println!(
            "kv-events: {TURNS} turns, {stored} BlockStored applied; vLLM hit rate {:.4} ({hits} of {queries} tokens), the router's predicted {:.4} ({predicted} tokens), {:.2}% apart",
            hits / queries,
            predicted / queries,
            off * 100.0
        );
        assert!(
            off <= TOLERANCE,
            "predicted hit tokens {predicted} are {:.1}% from vLLM's {hits}",
            off * 100.0
        );
        // The load generator reads the same counters from vLLM's names.
        let measured = report.hit_rate.expect("loadgen read vLLM's prefix-cache counters");
        assert!(
            (measured - hits / queries).abs() < 1e-9,
            "loadgen's engine hit rate {measured} is vLLM's {}",
            hits / queries
        );

        // A router started now knows nothing until a worker publishes
        // again; the first new event from each worker makes it replay that
        // worker's history from sequence 0 through vLLM's replay socket.
        let index_before = sum(&text, "switchyard_index_blocks");
        drop(router);
        let router = serve(&flags(&workers));
        wait_metrics(&client, &router.base, "both vLLM workers in selection", |t| {
            sum(t, "switchyard_worker_up") == 2.0
        })
        .await;
        // Fresh prompts (no prefix in common with the run) until both
        // workers have published since the restart.
        let mut fresh = 0;
        loop {
            let text = metrics(&client, &router.base).await;
            let replayed = ["v0", "v1"].iter().all(|w| {
                metric(&text, &format!("switchyard_kv_event_replays_total{{worker=\"{w}\"}}"))
                    .is_some_and(|n| n >= 1.0)
            });
            if replayed {
                break;
            }
            assert!(fresh < 40, "both workers replayed within 40 fresh prompts:\n{text}");
            let prompt = format!("{fresh} fresh words that no conversation of the run began with: ").repeat(24);
            let answer: Value = client
                .post(format!("{}/v1/completions", router.base))
                .json(&json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .expect("the router answers")
                .json()
                .await
                .expect("a JSON completion");
            assert!(answer["choices"].is_array(), "{answer}");
            fresh += 1;
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        let text = metrics(&client, &router.base).await;
        assert_eq!(dropped(&text), 0.0, "no replayed event was dropped:\n{text}");
        let index_after = sum(&text, "switchyard_index_blocks");
        assert!(
            index_after >= index_before,
            "the restarted router holds the run's {index_before} blocks again (it holds {index_after}):\n{text}"
        );

        // And predicts from that history: the run's turns sent again hit
        // vLLM's cache as the new router expects.
        let (hits_before, _) = vllm_prefix_cache(&client, &workers.iter().collect::<Vec<_>>()).await;
        let predicted_before = predicted_hit_tokens(&text, 32.0);
        let again = loadgen::sharegpt_requests(&sharegpt, 24, 1, Some("tiny")).expect("conversations");
        let report = loadgen::run_load(&router.base, again, Pacing::Concurrency(2), true, &[], false).await;
        assert_eq!(report.errors, 0);
        let text = metrics(&client, &router.base).await;
        let (hits_after, _) = vllm_prefix_cache(&client, &workers.iter().collect::<Vec<_>>()).await;
        let hits = hits_after - hits_before;
        let predicted = predicted_hit_tokens(&text, 32.0) - predicted_before;
        println!("kv-events: after the restart, 24 earlier turns again: vLLM hit {hits} tokens, the router predicted {predicted}");
        assert!(hits > 0.0, "the earlier turns hit vLLM's cache");
        assert!(
            (predicted - hits).abs() <= TOLERANCE * hits,
            "the restarted router predicted {predicted} hit tokens, vLLM hit {hits}"
        );
    })
    .await;
}
