//! `switchyard bench itl`: does a sim-worker keep its timing model's time?
//!
//! For each speed-up, one `switchyard sim-worker` child (default engine)
//! gets the same streaming requests one at a time, and the load generator
//! measures TTFT and inter-token latency. The model's figures come from the
//! same requests run through the same engine core in virtual time
//! ([`model_latencies`]): a step's tokens appear when its modeled duration
//! (divided by the speed-up) has passed.
//!
//! With `--workers N` (N > 1) the workers sit behind `switchyard serve`
//! (round-robin) and `--concurrency` streams load the machine; the model
//! column is then left out (batches depend on timing) and what tells
//! whether the machine keeps up is the workers' own account of step time
//! they fell too far behind to catch up on
//! (`switchyard_engine_pacing_dropped_seconds_total`).

use super::twin::serve::{paced_and_dropped_seconds, start_router, wait_for_workers};
use clap::Args;
use serde::Serialize;
use serde_json::json;
use std::path::PathBuf;
use switchyard_commands::demo::start_sim_workers;
use switchyard_commands::loadgen::{self, Pacing, PreparedRequest};
use switchyard_commands::stats::{write_json, Latency};
use switchyard_core::hashing::DEFAULT_SEED;
use switchyard_core::RequestId;
use switchyard_engine::{Engine, EngineConfig, NewRequest, StepReport, SyncDevice};

/// Options of `bench itl`.
#[derive(Debug, Clone, Args)]
pub struct ItlArgs {
    /// Speed-ups to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub speedups: Vec<f64>,
    /// Requests per speed-up.
    #[arg(long, default_value_t = 20)]
    pub requests: usize,
    /// Prompt tokens per request (distinct prompts: no cache hits).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: u32,
    /// Output tokens per request.
    #[arg(long, default_value_t = 256)]
    pub output_tokens: u32,
    /// Sim-workers; more than one puts `switchyard serve` in front.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Streams in flight.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Distinct prompts, `n` of `len` tokens.
fn prompts(n: usize, len: u32) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| (0..len).map(|t| 1 + (i * len + t) % 150_000).collect())
        .collect()
}

/// TTFT and inter-token latencies (wall ms at the engine's speed-up) of
/// `prompts` served one at a time, in order, by one engine core: each
/// request starts when the previous one ends, and a step's tokens appear at
/// the end of its modeled duration.
pub fn model_latencies(
    config: &EngineConfig,
    prompts: &[Vec<u32>],
    output_tokens: u32,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let mut engine = Engine::new(config.clone(), SyncDevice::new(config.timing.clone()))?;
    let mut report = StepReport::default();
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    for (i, prompt) in prompts.iter().enumerate() {
        engine
            .add_request(NewRequest {
                id: RequestId(i as u128),
                prompt: prompt.clone(),
                max_tokens: output_tokens,
                hash_seed: DEFAULT_SEED,
                lora_name: None,
            })
            .map_err(|e| anyhow::anyhow!("the model refused a request: {e}"))?;
        let (mut now, mut last) = (0.0, None);
        while engine.has_work() {
            engine.step(&mut report)?;
            anyhow::ensure!(!report.is_idle(), "the engine idled with work");
            now += config.timing.wall_ms(report.model_ms);
            if !report.tokens.is_empty() {
                match last {
                    None => ttft.push(now),
                    Some(l) => itl.push(now - l),
                }
                last = Some(now);
            }
        }
    }
    Ok((ttft, itl))
}

fn requests(prompts: &[Vec<u32>], output_tokens: u32) -> Vec<PreparedRequest> {
    prompts
        .iter()
        .map(|p| {
            let body = json!({"prompt": p, "max_tokens": output_tokens, "stream": true});
            PreparedRequest {
                tenant: None,
                path: "/v1/completions",
                body: serde_json::to_vec(&body).unwrap_or_default().into(),
                session: None,
                next_turn: None,
            }
        })
        .collect()
}

/// One speed-up's figures.
#[derive(Debug, Clone, Serialize)]
struct Row {
    speedup: f64,
    model_ttft_ms: Option<Latency>,
    model_itl_ms: Option<Latency>,
    ttft_ms: Latency,
    itl_ms: Latency,
    errors: usize,
    dropped_fraction: f64,
}

/// Runs `bench itl`.
pub fn run(args: ItlArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.requests > 0 && args.workers > 0 && args.concurrency > 0);
    anyhow::ensure!(
        args.speedups.iter().all(|s| s.is_finite() && *s > 0.0),
        "--speedups must be positive"
    );
    let single = args.workers == 1 && args.concurrency == 1;
    let prompts = prompts(args.requests, args.prompt_tokens);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    println!(
        "bench itl: {} requests of {} prompt + {} output tokens, {} worker(s), concurrency {}",
        args.requests, args.prompt_tokens, args.output_tokens, args.workers, args.concurrency
    );
    println!(
        "{:>8} {:>22} {:>22} {:>22} {:>22} {:>8}",
        "speedup",
        "model ITL mean/p50",
        "measured ITL mean/p50",
        "model TTFT mean/p50",
        "measured TTFT mean/p50",
        "dropped"
    );
    for &speedup in &args.speedups {
        let mut engine = EngineConfig::default();
        engine.timing.speedup = speedup;
        let (model_ttft, model_itl) = if single {
            let (mut t, mut i) = model_latencies(&engine, &prompts, args.output_tokens)?;
            (Some(Latency::of(&mut t)), Some(Latency::of(&mut i)))
        } else {
            (None, None)
        };
        let worker_args = vec!["--speedup".to_owned(), speedup.to_string()];
        let fleet = start_sim_workers(args.workers, &worker_args, false)?;
        let router = if single {
            None
        } else {
            let mut serve = vec![
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--policy",
                "round-robin",
            ]
            .into_iter()
            .map(str::to_owned)
            .collect::<Vec<_>>();
            for (i, url) in fleet.urls.iter().enumerate() {
                serve.extend(["--worker".to_owned(), format!("{url},name=worker-{i}")]);
            }
            Some(start_router(&serve)?)
        };
        let base = router
            .as_ref()
            .map_or_else(|| fleet.urls[0].clone(), |(_, url)| url.clone());
        let report = runtime.block_on(async {
            if router.is_some() {
                wait_for_workers(&base, fleet.urls.len()).await?;
            }
            let report = loadgen::run_load(
                &base,
                requests(&prompts, args.output_tokens),
                Pacing::Concurrency(args.concurrency),
                true,
                &[],
                false,
            )
            .await;
            let client = loadgen::client();
            let (mut paced, mut dropped) = (0.0, 0.0);
            for url in &fleet.urls {
                if let Some(text) = loadgen::get_text(&client, &format!("{url}/metrics")).await {
                    let (worker_paced, worker_dropped) = paced_and_dropped_seconds(&text);
                    paced += worker_paced;
                    dropped += worker_dropped;
                }
            }
            anyhow::Ok((report, if paced > 0.0 { dropped / paced } else { 0.0 }))
        })?;
        drop(router);
        drop(fleet);
        let (report, dropped_fraction) = report;
        let pair = |l: Option<&Latency>| {
            l.map_or_else(|| "-".to_owned(), |l| format!("{:.3}/{:.3}", l.mean, l.p50))
        };
        println!(
            "{:>8} {:>22} {:>22} {:>22} {:>22} {:>7.2}%",
            speedup,
            pair(model_itl.as_ref()),
            pair(Some(&report.itl_ms)),
            pair(model_ttft.as_ref()),
            pair(Some(&report.ttft_ms)),
            dropped_fraction * 100.0
        );
        rows.push(Row {
            speedup,
            model_ttft_ms: model_ttft,
            model_itl_ms: model_itl,
            ttft_ms: report.ttft_ms,
            itl_ms: report.itl_ms,
            errors: report.errors,
            dropped_fraction,
        });
    }
    if let Some(path) = &args.json {
        write_json(path, &json!({ "rows": rows }))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_gives_one_prefill_then_one_decode_step_per_token() {
        let mut config = EngineConfig::default();
        config.timing.speedup = 4.0;
        let (ttft, itl) = model_latencies(&config, &prompts(2, 128), 5).unwrap();
        assert_eq!((ttft.len(), itl.len()), (2, 8));
        let prefill = config.timing.prefill_ms(128) / 4.0;
        assert!((ttft[0] - prefill).abs() < 1e-9, "{}", ttft[0]);
        // Decode steps at almost-empty KV usage: about 5.74 model ms each.
        assert!(
            itl.iter().all(|&i| (5.74 / 4.0..5.8 / 4.0).contains(&i)),
            "{itl:?}"
        );
    }

    #[test]
    fn prompts_are_distinct() {
        let p = prompts(3, 16);
        assert_ne!(p[0], p[1]);
        assert_eq!(p[2].len(), 16);
    }
}
