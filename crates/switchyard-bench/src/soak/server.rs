//! The server soak: `switchyard serve` as a child process in front of
//! sim-workers (child processes publishing KV events over ZMQ, as in
//! `switchyard demo`), driven by the load generator for a fixed duration
//! while a sampler reads the router's resident set from
//! `/proc/PID/statm` and its index bytes from `/metrics`.
//!
//! The load is rounds of Mooncake-shaped token-id completions; each round
//! uses fresh hash ids, so the workers' caches and the router's index churn
//! for the whole run rather than settling on the trace's first prefixes.

use super::plateau::statm_rss_bytes;
use anyhow::Context as _;
use serde::Serialize;
use serde_json::json;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_commands::child::Children;
use switchyard_commands::demo::{free_port, start_fleet, DemoArgs};
use switchyard_commands::loadgen::{self, Pacing, PreparedRequest};
use switchyard_sim::trace::{synthetic_tokens, MooncakeRecord};
use switchyard_wire::prometheus::Scrape;

/// Settings of one server soak.
#[derive(Clone, Debug, Serialize)]
pub struct ServerSoakConfig {
    /// How long to drive load.
    pub duration: Duration,
    /// Between samples.
    pub sample_every: Duration,
    /// Sim-workers.
    pub workers: usize,
    /// Requests in flight.
    pub concurrency: usize,
    /// Requests per load round (fresh content each round).
    pub round_requests: usize,
    /// Sim-worker speed-up over the timing model.
    pub speedup: f64,
    /// KV blocks per sim-worker (small, so caches evict and events churn).
    pub num_blocks: usize,
    /// Output tokens per request at most.
    pub max_output_tokens: u32,
    /// Prompt tokens per request at most.
    pub max_prompt_tokens: u32,
}

/// One sample of the router process.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ServerSample {
    /// Seconds since the load started.
    pub seconds: f64,
    /// Requests completed or failed so far (whole rounds).
    pub requests: u64,
    /// The router's resident set.
    pub rss_bytes: Option<u64>,
    /// `switchyard_index_bytes` from its `/metrics`.
    pub index_bytes: Option<u64>,
}

/// What a server soak did.
#[derive(Clone, Debug, Serialize)]
pub struct ServerSoakOutcome {
    /// Samples in order.
    pub samples: Vec<ServerSample>,
    /// Requests sent.
    pub requests: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Load rounds run.
    pub rounds: u64,
    /// Wall seconds of load.
    pub wall_seconds: f64,
}

/// Round `round`'s requests: the records with hash ids made fresh.
fn round_requests(
    records: &[MooncakeRecord],
    round: u64,
    config: &ServerSoakConfig,
) -> anyhow::Result<Vec<PreparedRequest>> {
    let mut out = Vec::with_capacity(config.round_requests);
    let mut tokens = Vec::new();
    let start = (round as usize * config.round_requests) % records.len();
    for i in 0..config.round_requests {
        let record = &records[(start + i) % records.len()];
        let ids: Vec<u64> = record
            .hash_ids
            .iter()
            .map(|&h| h ^ ((round + 1) << 48))
            .collect();
        let len = record
            .input_length
            .min(config.max_prompt_tokens)
            .min(ids.len() as u32 * 512)
            .max(1);
        tokens.clear();
        synthetic_tokens(&ids, len as usize, &mut tokens);
        let body = json!({
            "prompt": tokens,
            "max_tokens": record.output_length.clamp(1, config.max_output_tokens),
            "stream": true,
        });
        out.push(PreparedRequest {
            tenant: None,
            path: "/v1/completions",
            body: serde_json::to_vec(&body)?.into(),
            session: None,
            next_turn: None,
        });
    }
    Ok(out)
}

/// `switchyard_index_bytes` from the router's `/metrics` text.
fn index_bytes(metrics: &str) -> Option<u64> {
    Scrape::parse(metrics)
        .value("switchyard_index_bytes", &[])
        .filter(|bytes| bytes.is_finite() && *bytes >= 0.0)
        .map(|bytes| bytes as u64)
}

/// Runs a server soak over `records`, calling `on_sample` per sample.
pub fn run_server(
    config: &ServerSoakConfig,
    records: &[MooncakeRecord],
    on_sample: impl Fn(&ServerSample) + Send + Sync + 'static,
) -> anyhow::Result<ServerSoakOutcome> {
    anyhow::ensure!(!records.is_empty(), "the trace has no records");
    anyhow::ensure!(config.workers > 0, "--server-workers must be at least 1");
    anyhow::ensure!(
        config.round_requests > 0,
        "--round-requests must be at least 1"
    );
    let fleet = start_fleet(&DemoArgs {
        workers: config.workers,
        requests: 0,
        concurrency: config.concurrency,
        max_output_tokens: config.max_output_tokens,
        speedup: config.speedup,
        num_blocks: config.num_blocks,
        trace: None,
        policy: switchyard_core::select::PolicyKind::Kv,
        approximate: false,
        json: None,
    })?;
    let port = free_port()?;
    let exe = std::env::current_exe().context("locating the switchyard binary")?;
    let mut command = Command::new(exe);
    command.args([
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--policy",
        "kv",
    ]);
    for (i, (url, events)) in fleet.urls.iter().zip(&fleet.events).enumerate() {
        let mut spec = format!("{url},name=worker-{i}");
        if let Some((events, replay)) = events {
            spec.push_str(&format!(",events={events},replay={replay}"));
        }
        command.args(["--worker", &spec]);
    }
    let router = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the router")?;
    let pid = router.id();
    // Killed on drop.
    let router = Children(vec![router]);
    let base = format!("http://127.0.0.1:{port}");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let outcome = runtime.block_on(async {
        let client = loadgen::client();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if loadgen::get_text(&client, &format!("{base}/ready"))
                .await
                .is_some()
            {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the router did not become ready within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let started = Instant::now();
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let sampler = {
            let (client, base, done, samples) =
                (client.clone(), base.clone(), done.clone(), samples.clone());
            let every = config.sample_every;
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(every);
                ticker.tick().await;
                loop {
                    ticker.tick().await;
                    let index_bytes = loadgen::get_text(&client, &format!("{base}/metrics"))
                        .await
                        .and_then(|t| index_bytes(&t));
                    let sample = ServerSample {
                        seconds: started.elapsed().as_secs_f64(),
                        requests: done.load(std::sync::atomic::Ordering::Relaxed),
                        rss_bytes: statm_rss_bytes(Some(pid)),
                        index_bytes,
                    };
                    on_sample(&sample);
                    samples.lock().expect("not poisoned").push(sample);
                }
            })
        };
        let (mut requests, mut errors, mut rounds) = (0u64, 0u64, 0u64);
        while started.elapsed() < config.duration {
            let batch = round_requests(records, rounds, config)?;
            let report = loadgen::run_load(
                &base,
                batch,
                Pacing::Concurrency(config.concurrency),
                true,
                &[],
                false,
            )
            .await;
            requests += report.requests as u64;
            errors += report.errors as u64;
            rounds += 1;
            done.store(requests, std::sync::atomic::Ordering::Relaxed);
        }
        sampler.abort();
        let samples = samples.lock().expect("not poisoned").clone();
        anyhow::Ok(ServerSoakOutcome {
            samples,
            requests,
            errors,
            rounds,
            wall_seconds: started.elapsed().as_secs_f64(),
        })
    })?;
    drop(router);
    drop(fleet);
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_bytes_gauge_is_read_by_exact_name() {
        let text = "# TYPE switchyard_index_bytes gauge\nswitchyard_index_bytes_total 9\nswitchyard_index_bytes 1234\n";
        assert_eq!(index_bytes(text), Some(1234));
        assert_eq!(index_bytes("switchyard_index_bytes_total 9\n"), None);
        assert_eq!(index_bytes("switchyard_index_bytes NaN\n"), None);
    }

    #[test]
    fn each_round_uses_fresh_content() {
        let records = vec![MooncakeRecord {
            timestamp: 0.0,
            input_length: 600,
            output_length: 100,
            hash_ids: vec![1, 2],
        }];
        let config = ServerSoakConfig {
            duration: Duration::from_secs(1),
            sample_every: Duration::from_secs(1),
            workers: 1,
            concurrency: 1,
            round_requests: 2,
            speedup: 1.0,
            num_blocks: 64,
            max_output_tokens: 8,
            max_prompt_tokens: 512,
        };
        let first = round_requests(&records, 0, &config).unwrap();
        let second = round_requests(&records, 1, &config).unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!(first[0].body, first[1].body);
        assert_ne!(first[0].body, second[0].body);
        let body: serde_json::Value = serde_json::from_slice(&first[0].body).unwrap();
        assert_eq!(body["prompt"].as_array().unwrap().len(), 512);
        assert_eq!(body["max_tokens"], 8);
    }
}
