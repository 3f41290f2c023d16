//! `switchyard bench tokenize-gate`: a light tenant's time to first token
//! beside a noisy tenant's long prompts, through `serve` with its
//! tokenizing gate (long prompts take one of a slot per core, in band and
//! fair-share order: `switchyard_server::tokenize_gate`) and with
//! `--tokenize-slots 512` (as many at once as tokio's blocking pool holds:
//! the router before the gate), and the light tenant alone — side by side
//! in one invocation, each on a fresh router and sim-worker.
//!
//! The tenants are named by `x-tenant` (equal weights, one band). Every
//! prompt is a chat of one user message of random words of the bundled
//! tokenizer, streamed with `max_tokens` 1, open loop: the light tenant
//! sends `--light-requests` prompts of `--light-kb` KB at `--light-rate` a
//! second, the noisy tenant `--noisy-kb` KB prompts at `--noisy-ratio`
//! times that rate until the light tenant is done.
//! The router runs with `--token-cache-ids 0`, so each prompt is tokenized
//! whole, as a fresh prompt is (the noisy prompts cycle through
//! `--noisy-distinct` texts, which the sim-worker's own cache keeps, so
//! its tokenizing takes less of the shared machine than the router's). The
//! sim-worker runs at `--speedup` (100: its engine time is small beside
//! tokenizing). Figures: the light tenant's TTFT p50/p90 per run and over
//! alone, and the noisy tenant's requests per second.
//!
//! With `--pin-router` the router runs on a core of its own (the first
//! this process may use; its tokenizing gate then has one slot) and the
//! client and the sim-worker on the others, as on a deployment, where
//! engines and clients are other machines: what is measured is then the
//! router's own order of work, not the sim-worker's tokenizing and the
//! client's writing on the router's cores.

use crate::twin::serve::{start_router, wait_for_workers};
use anyhow::Context as _;
use hyper::header::{HeaderName, HeaderValue};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use switchyard_commands::child::{pin_this_thread, start_on, CoreSplit};
use switchyard_commands::demo::start_sim_workers;
use switchyard_commands::loadgen::{self, Pacing, PreparedRequest, Report, TenantSend};
use switchyard_commands::stats::write_json;
use switchyard_tokenizer::WordVocabulary;

/// Options of `bench tokenize-gate`.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct TokenizeGateArgs {
    /// The light tenant's requests per run.
    #[arg(long, default_value_t = 100)]
    pub light_requests: usize,
    /// The light tenant's requests per second (open loop).
    #[arg(long, default_value_t = 5.0)]
    pub light_rate: f64,
    /// The noisy tenant's rate over the light one's (open loop).
    #[arg(long, default_value_t = 10.0)]
    pub noisy_ratio: f64,
    /// The light tenant's prompt size, KB (over 8 KB: tokenized through
    /// the gate).
    #[arg(long, default_value_t = 20)]
    pub light_kb: usize,
    /// The noisy tenant's prompt size, KB.
    #[arg(long, default_value_t = 200)]
    pub noisy_kb: usize,
    /// Distinct noisy prompts, sent in turn.
    #[arg(long, default_value_t = 32)]
    pub noisy_distinct: usize,
    /// The sim-worker's speed-up over its timing model.
    #[arg(long, default_value_t = 100.0)]
    pub speedup: f64,
    /// Run the router on a core of its own, the client and the sim-worker
    /// on the others (two cores at least).
    #[arg(long)]
    pub pin_router: bool,
    /// Rounds of the three runs.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Distinct words the prompts are drawn from.
const WORDS: usize = 20_000;

/// The header the generated configuration names tenants by.
const TENANT_HEADER: &str = "x-tenant";

/// The router's configuration: two tenants of equal weight, named by
/// [`TENANT_HEADER`].
const SERVE_CONFIG: &str = r#"tenant_header = "x-tenant"

[[flow.tenants]]
name = "light"

[[flow.tenants]]
name = "noisy"
"#;

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct GateRun {
    /// `alone`, `gated` or `ungated`.
    pub run: String,
    /// Round, from 1.
    pub round: usize,
    /// The light tenant's load report.
    pub light: Report,
    /// The noisy tenant's requests answered while the light one ran.
    pub noisy_requests: usize,
    /// Of them, failed.
    pub noisy_errors: usize,
    /// The noisy tenant's requests per second.
    pub noisy_rps: f64,
}

/// Runs `switchyard bench tokenize-gate`.
pub fn run(args: TokenizeGateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.light_requests > 0 && args.noisy_distinct > 0 && args.rounds > 0,
        "--light-requests, --noisy-distinct and --rounds must be positive"
    );
    anyhow::ensure!(
        args.light_rate.is_finite()
            && args.light_rate > 0.0
            && args.noisy_ratio.is_finite()
            && args.noisy_ratio > 0.0,
        "--light-rate and --noisy-ratio must be positive"
    );
    anyhow::ensure!(
        args.speedup.is_finite() && args.speedup > 0.0,
        "--speedup must be positive"
    );
    // Pinned before the runtime starts, so that its threads and the
    // sim-workers inherit the cores left to them.
    let split = if args.pin_router {
        let split = CoreSplit::of_this_thread()?;
        pin_this_thread(&split.rest)?;
        Some(split)
    } else {
        None
    };
    let words = switchyard_tokenizer::Tokenizer::bundled()
        .map_err(|e| anyhow::anyhow!("loading the bundled tokenizer: {e}"))?
        .word_vocabulary(WORDS)
        .map_err(|e| anyhow::anyhow!("the bundled tokenizer's words: {e}"))?;
    anyhow::ensure!(
        !words.is_empty(),
        "the bundled tokenizer has no word tokens"
    );
    let mut rng = StdRng::seed_from_u64(7);
    let light: Vec<PreparedRequest> = (0..args.light_requests)
        .map(|_| {
            request(
                "light",
                &random_text(&words, &mut rng, args.light_kb * 1000),
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let noisy_texts: Vec<PreparedRequest> = (0..args.noisy_distinct)
        .map(|_| {
            request(
                "noisy",
                &random_text(&words, &mut rng, args.noisy_kb * 1000),
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let config = std::env::temp_dir().join(format!(
        "switchyard-tokenize-gate-{}.toml",
        std::process::id()
    ));
    std::fs::write(&config, SERVE_CONFIG).context("writing the router's configuration")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        for (name, slots, noisy) in [
            ("alone", None, false),
            ("gated", None, true),
            ("ungated", Some(512), true),
        ] {
            eprintln!("round {round}: {name}...");
            let run = runtime.block_on(one_run(
                &args,
                &config,
                split.as_ref(),
                slots,
                light.clone(),
                noisy.then_some(&noisy_texts),
            ))?;
            runs.push(GateRun {
                run: name.to_owned(),
                round,
                ..run
            });
        }
    }
    let _ = std::fs::remove_file(&config);
    print_table(&args, &runs);
    if let Some(path) = &args.json {
        write_json(path, &serde_json::json!({"args": args, "runs": runs}))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One fresh sim-worker and router; the light load, and beside it the
/// noisy one until the light one ends.
async fn one_run(
    args: &TokenizeGateArgs,
    config: &std::path::Path,
    split: Option<&CoreSplit>,
    slots: Option<usize>,
    light: Vec<PreparedRequest>,
    noisy: Option<&Vec<PreparedRequest>>,
) -> anyhow::Result<GateRun> {
    let worker_args: Vec<String> = [
        "--speedup",
        &args.speedup.to_string(),
        "--max-model-len",
        "262144",
        "--num-blocks",
        "131072",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    let fleet = start_sim_workers(1, &worker_args, false)?;
    let mut serve: Vec<String> = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--config",
        &config.display().to_string(),
        "--token-cache-ids",
        "0",
        "--max-prompt-tokens",
        "262144",
        "--worker",
        &fleet.urls[0],
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    if let Some(slots) = slots {
        serve.extend(["--tokenize-slots".to_owned(), slots.to_string()]);
    }
    let (router, base) = match split {
        Some(split) => start_on(&split.router, || start_router(&serve))?,
        None => start_router(&serve)?,
    };
    wait_for_workers(&base, 1).await?;
    // The noisy tenant, open loop at its rate until the light load ends.
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let noisy_task = noisy.map(|texts| {
        let texts = Arc::new(texts.clone());
        let every = std::time::Duration::from_secs_f64(1.0 / (args.light_rate * args.noisy_ratio));
        let (base, stop, answered, failed) =
            (base.clone(), stop.clone(), answered.clone(), failed.clone());
        tokio::spawn(async move {
            let client = loadgen::client();
            let mut tick = tokio::time::interval(every);
            let mut sends = tokio::task::JoinSet::new();
            for i in 0.. {
                tick.tick().await;
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let (client, base, texts) = (client.clone(), base.clone(), texts.clone());
                let (answered, failed) = (answered.clone(), failed.clone());
                sends.spawn(async move {
                    let ok = loadgen::send(&client, &base, &texts[i % texts.len()]).await;
                    let counter = if ok { &answered } else { &failed };
                    counter.fetch_add(1, Ordering::Relaxed);
                });
                while sends.try_join_next().is_some() {}
            }
        })
    });
    if noisy_task.is_some() {
        // The noisy load under way before the light one starts.
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    let noisy_before = answered.load(Ordering::Relaxed);
    let started = Instant::now();
    let report = loadgen::run_load(
        &base,
        light,
        Pacing::Rate(args.light_rate),
        true,
        &[],
        false,
    )
    .await;
    let wall = started.elapsed().as_secs_f64();
    let noisy_requests = answered.load(Ordering::Relaxed) - noisy_before;
    stop.store(true, Ordering::Relaxed);
    if let Some(task) = noisy_task {
        task.abort();
    }
    drop(router);
    drop(fleet);
    Ok(GateRun {
        run: String::new(),
        round: 0,
        light: report,
        noisy_requests,
        noisy_errors: failed.load(Ordering::Relaxed),
        noisy_rps: noisy_requests as f64 / wall.max(1e-9),
    })
}

/// A streamed chat request of one user message, `tenant`'s.
fn request(tenant: &str, text: &str) -> anyhow::Result<PreparedRequest> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "stream": true,
    });
    Ok(PreparedRequest {
        tenant: Some(Arc::new(TenantSend {
            name: tenant.to_owned(),
            headers: vec![(
                HeaderName::from_static(TENANT_HEADER),
                HeaderValue::from_str(tenant)?,
            )],
        })),
        path: "/v1/chat/completions",
        body: serde_json::to_vec(&body)?.into(),
        session: None,
        next_turn: None,
    })
}

/// Words of the bundled tokenizer that are one token each, drawn at
/// random until the text is `bytes` long (or a word more).
fn random_text(words: &WordVocabulary, rng: &mut StdRng, bytes: usize) -> String {
    let ids = words.ids();
    let mut out = String::with_capacity(bytes + 32);
    while out.len() < bytes {
        out.push_str(words.text(ids[rng.gen_range(0..ids.len())]).unwrap_or(" x"));
    }
    out
}

fn print_table(args: &TokenizeGateArgs, runs: &[GateRun]) {
    println!(
        "light tenant: {} prompts of {} KB at {}/s; noisy tenant: {} KB prompts at {}/s; router tokenizing uncached",
        args.light_requests,
        args.light_kb,
        args.light_rate,
        args.noisy_kb,
        args.light_rate * args.noisy_ratio
    );
    println!(
        "{:<6} {:<8} {:>10} {:>10} {:>8} {:>12} {:>10}",
        "round", "run", "TTFT p50", "TTFT p90", "p90/alone", "noisy req/s", "errors"
    );
    for r in runs {
        let alone = runs
            .iter()
            .find(|a| a.round == r.round && a.run == "alone")
            .map_or(f64::NAN, |a| a.light.ttft_ms.p90);
        println!(
            "{:<6} {:<8} {:>10.1} {:>10.1} {:>8.2}× {:>12.1} {:>10}",
            r.round,
            r.run,
            r.light.ttft_ms.p50,
            r.light.ttft_ms.p90,
            r.light.ttft_ms.p90 / alone,
            r.noisy_rps,
            r.light.errors + r.noisy_errors
        );
    }
    println!(
        "(TTFT of the light tenant, ms, at the client{})",
        if args.pin_router {
            "; the router on a core of its own"
        } else {
            ""
        }
    );
}
