//! Two models behind one router, each with its own tokenizer and block
//! size (Qwen3's at 32 tokens a block; a byte-level BPE of its own at 64),
//! each served by its own vLLM: every request goes to its model's worker,
//! each worker's KV events are read at its model's block size (none
//! dropped), and each model's predicted hits match its vLLM's counters.

use crate::support::{metric, scratch_file, serve, wait_metrics};
use crate::tier::{bounded, exclusive, metrics, sum, tier, vllm_prefix_cache};
use switchyard_commands::engines::vllm::VllmOptions;
use switchyard_commands::loadgen::{self, Pacing};

/// Conversation turns sent for each model.
const TURNS: usize = 80;
const TOLERANCE: f64 = 0.05;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_route_each_on_its_own_tokenizer_block_size_and_index() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let mut bpe = VllmOptions::new(&tier.models.bpe(), "bpe");
        bpe.block_size = 64;
        bpe.max_model_len = 8192;
        let workers = tier
            .start("two-models", vec![("q", tier.qwen3()), ("b", bpe)])
            .await;
        let config = scratch_file(
            "engines-two-models.toml",
            format!(
                "[[models]]\nname = \"tiny\"\ntokenizer_dir = \"{}\"\nblock_size = 32\n\n\
                 [[models]]\nname = \"bpe\"\ntokenizer_dir = \"{}\"\nblock_size = 64\n",
                tier.models.qwen3().display(),
                tier.models.bpe().display()
            )
            .as_bytes(),
        );
        let router = serve(&[
            "--config",
            &config.display().to_string(),
            "--worker",
            &workers[0].worker_spec("q"),
            "--worker",
            &workers[1].worker_spec("b"),
            "--health-interval-ms",
            "500",
        ]);
        let client = reqwest::Client::new();
        wait_metrics(&client, &router.base, "both vLLM workers in selection", |t| {
            sum(t, "switchyard_worker_up") == 2.0
        })
        .await;

        let sharegpt = switchyard_commands::data::data_path("traces/sharegpt_multiturn_3000.jsonl.gz")
            .expect("the bundled ShareGPT conversations");
        for (model, worker, block_size) in [("tiny", 0, 32.0), ("bpe", 1, 64.0)] {
            let name = ["q", "b"][worker];
            let requests = loadgen::sharegpt_requests(&sharegpt, TURNS, 8, Some(model))
                .expect("reading the conversations");
            let report = loadgen::run_load(
                &router.base,
                requests,
                Pacing::Concurrency(2),
                true,
                &[],
                false,
            )
            .await;
            assert_eq!(report.errors, 0, "{model}: every turn is answered");
            assert_eq!(
                report.worker_share.get(name).copied(),
                Some(TURNS),
                "{model}: every request went to its model's worker: {:?}",
                report.worker_share
            );
            let text = metrics(&client, &router.base).await;
            let (hits, queries) = vllm_prefix_cache(&client, &[&workers[worker]]).await;
            let predicted = metric(
                &text,
                &format!("switchyard_model_expected_hit_blocks_total{{model=\"{model}\"}}"),
            )
            .unwrap_or(0.0)
                * block_size;
            println!(
                "two-models: {model} ({block_size} a block): vLLM hit {hits} of {queries} tokens, the router predicted {predicted}"
            );
            assert!(hits > 0.0, "{model}: the conversations hit vLLM's cache");
            assert!(
                (predicted - hits).abs() <= TOLERANCE * hits,
                "{model}: predicted {predicted} hit tokens, vLLM hit {hits}"
            );
            assert!(
                metric(
                    &text,
                    &format!("switchyard_kv_events_applied_total{{worker=\"{name}\",tier=\"device\"}}")
                ) > Some(0.0),
                "{model}: its worker's events were applied:\n{text}"
            );
        }
        let text = metrics(&client, &router.base).await;
        assert_eq!(
            sum(&text, "switchyard_kv_events_dropped_total"),
            0.0,
            "no event dropped (a block size mismatch would be):\n{text}"
        );
    })
    .await;
}
