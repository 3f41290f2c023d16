//! `switchyard calibrate`: profiles one live OpenAI-compatible engine (a
//! sim-worker, vLLM, SGLang) and writes an [`EngineProfile`] — the
//! simulator's timing model fitted to what the engine did — for
//! `replay`, `sim-worker` and `serve` (`--engine-profile`).
//!
//! What is measured, one request or one batch at a time, on an idle
//! engine:
//!
//! - **Prefill**: time to first token of fresh prompts (`/v1/completions`
//!   with token-id prompts drawn at random, so nothing is cached and the
//!   count is exact on any tokenizer) at `--prompt-sizes` sizes spread
//!   geometrically over `--min-prompt-tokens..=--max-prompt-tokens`,
//!   `--repeats` times each; the median of each size fitted as
//!   `a·T² + b·T + c` ms (a request the machine stalled does not bend the
//!   curve). The constant
//!   takes in what a client sees besides the engine's step (HTTP, the
//!   engine's scheduling). Keep the largest size within the engine's
//!   chunk (its `max_num_batched_tokens`): a longer prompt is prefilled in
//!   several steps, which the curve does not describe.
//! - **Decode**: inter-token latency of `--decode-batch` requests decoding
//!   together, at KV usages spread over `--usages` (prompt lengths chosen
//!   from the engine's KV capacity), the usage read from the engine's own
//!   gauge while they decode (`switchyard_wire::engine_metrics::
//!   kv_usage_fraction`: the sim-worker's, vLLM's, SGLang's) when it has
//!   one; the middle half of each
//!   stream's gaps (all requests decoding) averaged, and the median of the
//!   repeats fitted as `a·u² + b·u + c` ms. The floor is half the fastest step measured.
//! - **Capacity**: blocks and block size from the server information
//!   (`/server_info`, `/get_server_info`: the sim-worker's, SGLang's) or vLLM's `vllm:cache_config_info`, else
//!   `--num-blocks` and `--block-size`.
//!
//! Besides the profile it draws the fit against the samples (the same
//! path with `.svg`).
//!
//! Not measured yet: what a cached prefix saves (the model credits a hit
//! as no prefill work) and decode's dependence on the batch size apart
//! from the usage.

use crate::loadgen::{self, HttpClient, PreparedRequest};
use crate::stats::median;
use anyhow::Context as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use switchyard_core::engine_profile::{fit_quadratic, EngineProfile, ProfileFit};
use switchyard_wire::engine_metrics::{kv_usage_fraction, KvCapacity, ServerInfoCache};
use switchyard_wire::prometheus::Scrape;

/// Options of `switchyard calibrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateArgs {
    /// The engine's base URL (e.g. http://127.0.0.1:8000).
    #[arg(long)]
    pub worker: String,
    /// The model to send requests for [default: the first the engine
    /// lists at /v1/models].
    #[arg(long)]
    pub model: Option<String>,
    /// Write the profile here (TOML).
    #[arg(long, default_value = "engine.toml")]
    pub out: PathBuf,
    /// Times each prompt size and each usage is measured.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The smallest prompt of the prefill sweep, tokens.
    #[arg(long, default_value_t = 64)]
    pub min_prompt_tokens: usize,
    /// The largest prompt of the prefill sweep, tokens (within the
    /// engine's max_num_batched_tokens).
    #[arg(long, default_value_t = 4096)]
    pub max_prompt_tokens: usize,
    /// Prompt sizes in the prefill sweep.
    #[arg(long, default_value_t = 8)]
    pub prompt_sizes: usize,
    /// Requests decoding together in the decode sweep.
    #[arg(long, default_value_t = 4)]
    pub decode_batch: usize,
    /// Tokens each of them generates.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// KV usages the decode sweep aims at (0..1, comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.1,0.25,0.4,0.55,0.7,0.85"
    )]
    pub usages: Vec<f64>,
    /// The engine's KV blocks, when it does not report them.
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// The engine's tokens per KV block, when it does not report them.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Token ids the random prompts are drawn from: past the usual special
/// and byte tokens, within any vocabulary of 32k or more.
const PROMPT_IDS: std::ops::Range<u32> = 1_000..30_000;

/// Runs `switchyard calibrate`.
pub fn run(args: CalibrateArgs) -> anyhow::Result<()> {
    check(&args)?;
    // The output's directory made first: a measurement is not lost to a
    // path that cannot be written.
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let calibration = runtime.block_on(calibrate(&args))?;
    std::fs::write(&args.out, calibration.profile.to_toml())
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    let svg = args.out.with_extension("svg");
    draw(&svg, &calibration).map_err(|e| anyhow::anyhow!("plotting {}: {e}", svg.display()))?;
    println!("wrote {}", svg.display());
    Ok(())
}

/// The fit against the samples: prefill (time to first token against
/// prompt tokens) and decode (inter-token latency against KV usage), a
/// panel each, every repeat a point and the fitted curve a line.
fn draw(
    path: &std::path::Path,
    calibration: &Calibration,
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1100, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let profile = &calibration.profile;
    let curves = [
        (
            "prefill: time to first token",
            "prompt tokens",
            &calibration.prefill_samples,
            profile.prefill,
        ),
        (
            "decode: inter-token latency",
            "KV usage",
            &calibration.decode_samples,
            profile.decode,
        ),
    ];
    for ((title, x_desc, samples, [a, b, c]), panel) in curves.into_iter().zip(panels.iter()) {
        let x_max = samples.iter().map(|p| p.0).fold(0.0, f64::max) * 1.05;
        let y_max = samples.iter().map(|p| p.1).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(34)
            .y_label_area_size(52)
            .build_cartesian_2d(0.0..x_max.max(1e-9), 0.0..y_max)?;
        chart.configure_mesh().x_desc(x_desc).y_desc("ms").draw()?;
        let blue = RGBColor(31, 119, 180);
        chart
            .draw_series(samples.iter().map(|&p| Circle::new(p, 3, blue.filled())))?
            .label("measured")
            .legend(move |(x, y)| Circle::new((x + 8, y), 3, blue.filled()));
        let orange = RGBColor(255, 127, 14);
        let line = (0..=100).map(|i| {
            let x = x_max * f64::from(i) / 100.0;
            (x, a * x * x + b * x + c)
        });
        chart
            .draw_series(LineSeries::new(line, orange.stroke_width(2)))?
            .label("fitted")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], orange));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

fn check(args: &CalibrateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.repeats > 0 && args.decode_batch > 0 && args.decode_tokens >= 8,
        "--repeats and --decode-batch must be positive and --decode-tokens at least 8"
    );
    anyhow::ensure!(
        args.prompt_sizes >= 3 && args.min_prompt_tokens > 0,
        "--prompt-sizes must be at least 3 (a quadratic has three coefficients) and --min-prompt-tokens positive"
    );
    anyhow::ensure!(
        args.max_prompt_tokens >= 2 * args.min_prompt_tokens,
        "--max-prompt-tokens must be at least twice --min-prompt-tokens"
    );
    let mut usages = args.usages.clone();
    usages.sort_by(f64::total_cmp);
    usages.dedup();
    anyhow::ensure!(
        usages.len() >= 3 && usages.iter().all(|u| *u > 0.0 && *u < 1.0),
        "--usages needs three distinct values in 0..1"
    );
    Ok(())
}

/// The prompt sizes of the prefill sweep: `n` spread geometrically over
/// `min..=max`, distinct.
fn prompt_sizes(min: usize, max: usize, n: usize) -> Vec<usize> {
    let ratio = (max as f64 / min as f64).powf(1.0 / (n - 1) as f64);
    let mut sizes: Vec<usize> = (0..n)
        .map(|i| (min as f64 * ratio.powi(i as i32)).round() as usize)
        .map(|t| t.clamp(min, max))
        .collect();
    sizes.dedup();
    sizes
}

/// A calibration: the profile fitted and every sample it was fitted to
/// (each repeat's), as `(x, ms)`.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The profile.
    pub profile: EngineProfile,
    /// Prompt tokens against time to first token.
    pub prefill_samples: Vec<(f64, f64)>,
    /// KV usage against inter-token latency.
    pub decode_samples: Vec<(f64, f64)>,
}

/// Measures the engine `args` name and fits its profile (what [`run`]
/// writes).
pub async fn calibrate(args: &CalibrateArgs) -> anyhow::Result<Calibration> {
    let client = loadgen::client();
    let base = args.worker.trim_end_matches('/').to_owned();
    let model = match &args.model {
        Some(m) => Some(m.clone()),
        None => first_model(&client, &base).await,
    };
    let (num_blocks, block_size) = capacity(&client, &base, args).await?;
    let capacity = num_blocks * block_size;
    println!(
        "calibrating {base}{}: {num_blocks} KV blocks of {block_size} tokens",
        model
            .as_deref()
            .map_or(String::new(), |m| format!(" ({m})"))
    );
    let mut rng = StdRng::seed_from_u64(args.seed);
    // Warm-up: the first requests of a fresh engine are slower.
    for _ in 0..2 {
        let request = completion(&model, &mut rng, args.min_prompt_tokens, 2);
        loadgen::timed(&client, &base, &request)
            .await
            .with_context(|| format!("a warm-up request to {base} failed"))?;
    }

    let sizes = prompt_sizes(
        args.min_prompt_tokens,
        args.max_prompt_tokens,
        args.prompt_sizes,
    );
    let (mut prefill, mut prefill_samples) = (Vec::new(), Vec::new());
    println!("prefill: time to first token, fresh prompts, one at a time");
    for &tokens in &sizes {
        let mut ttfts = Vec::new();
        for _ in 0..args.repeats {
            let request = completion(&model, &mut rng, tokens, 1);
            let (ttft, _) = loadgen::timed(&client, &base, &request)
                .await
                .with_context(|| format!("a {tokens}-token prompt to {base} failed"))?;
            ttfts.push(ttft);
            prefill_samples.push((tokens as f64, ttft));
        }
        println!("  {tokens:>7} tokens: {}", list_ms(&ttfts));
        prefill.push((tokens as f64, median(&ttfts)));
    }
    let (prefill_curve, prefill_fit) =
        fit_quadratic(&prefill).context("the prefill samples do not determine a curve")?;

    println!(
        "decode: inter-token latency of {} requests decoding together",
        args.decode_batch
    );
    let (mut decode, mut decode_samples) = (Vec::new(), Vec::new());
    let mut fastest = f64::INFINITY;
    for &target in &args.usages {
        // Prompts sized so that the batch holds `target` of the KV cache
        // half way through its decoding.
        let per_request = (target * capacity as f64 / args.decode_batch as f64) as usize;
        let prompt = per_request.saturating_sub(args.decode_tokens / 2).max(16);
        let (mut usages, mut itls) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            let (usage, itl) =
                decode_point(&client, &base, &model, &mut rng, args, prompt, capacity)
                    .await
                    .with_context(|| format!("the decode batch at usage {target} failed"))?;
            println!(
                "  usage {usage:.3} ({} × {prompt} prompt tokens): {itl:.2} ms",
                args.decode_batch
            );
            fastest = fastest.min(itl);
            usages.push(usage);
            decode_samples.push((usage, itl));
            itls.push(itl);
        }
        decode.push((median(&usages), median(&itls)));
    }
    let (decode_curve, decode_fit) = fit_quadratic(&decode)
        .context("the decode samples do not determine a curve (are the usages distinct?)")?;
    let profile = EngineProfile {
        model,
        prefill: prefill_curve,
        decode: decode_curve,
        decode_floor_ms: fastest / 2.0,
        block_size: Some(block_size),
        num_blocks: Some(num_blocks),
        fit: Some(ProfileFit {
            worker: base,
            prefill: prefill_fit,
            decode: decode_fit,
        }),
    };
    profile.validate()?;
    println!(
        "prefill ms = {:.4e}·T² + {:.4e}·T + {:.3} (rms error {:.2} ms, worst {:.1}%)",
        prefill_curve[0],
        prefill_curve[1],
        prefill_curve[2],
        prefill_fit.rms_error_ms,
        prefill_fit.max_relative_error * 100.0
    );
    println!(
        "decode ms = {:.3}·u² + {:.3}·u + {:.3} (rms error {:.2} ms, worst {:.1}%), floor {:.2} ms",
        decode_curve[0],
        decode_curve[1],
        decode_curve[2],
        decode_fit.rms_error_ms,
        decode_fit.max_relative_error * 100.0,
        profile.decode_floor_ms
    );
    Ok(Calibration {
        profile,
        prefill_samples,
        decode_samples,
    })
}

/// One decode point: the batch's requests at once; the KV usage while
/// they decode (the engine's gauge, else estimated from the tokens held)
/// and their mean inter-token latency over the middle half of each
/// stream.
async fn decode_point(
    client: &HttpClient,
    base: &str,
    model: &Option<String>,
    rng: &mut StdRng,
    args: &CalibrateArgs,
    prompt: usize,
    capacity: usize,
) -> anyhow::Result<(f64, f64)> {
    let requests: Vec<PreparedRequest> = (0..args.decode_batch)
        .map(|_| completion(model, rng, prompt, args.decode_tokens))
        .collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = tokio::spawn({
        let (client, url, done) = (client.clone(), format!("{base}/metrics"), done.clone());
        async move {
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(usage) = loadgen::get_text(&client, &url)
                    .await
                    .and_then(|text| kv_usage_fraction(&Scrape::parse(&text)))
                {
                    seen.push((std::time::Instant::now(), usage));
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            seen
        }
    });
    let started = std::time::Instant::now();
    let answers = futures_join(client, base, &requests).await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = sampler.await.unwrap_or_default();
    let (mut gaps, mut last_first_token_ms) = (Vec::new(), 0.0f64);
    for answer in answers {
        let (ttft, itl) = answer.context("a request failed")?;
        last_first_token_ms = last_first_token_ms.max(ttft);
        let quarter = itl.len() / 4;
        gaps.extend_from_slice(&itl[quarter..itl.len() - quarter]);
    }
    anyhow::ensure!(
        !gaps.is_empty(),
        "the answers streamed no tokens after the first"
    );
    let itl = gaps.iter().sum::<f64>() / gaps.len() as f64;
    // The gauge's samples once every request was decoding (its median is
    // about half way through): not while prompts were still prefilled.
    let decoding = started + std::time::Duration::from_secs_f64(last_first_token_ms / 1e3);
    let held: Vec<f64> = seen
        .into_iter()
        .filter(|(at, u)| *at >= decoding && *u > 0.0)
        .map(|(_, u)| u)
        .collect();
    let usage = if held.is_empty() {
        (args.decode_batch * (prompt + args.decode_tokens / 2)) as f64 / capacity as f64
    } else {
        median(&held)
    };
    Ok((usage, itl))
}

/// Sends `requests` at once and waits for every answer.
async fn futures_join(
    client: &HttpClient,
    base: &str,
    requests: &[PreparedRequest],
) -> Vec<Option<(f64, Vec<f64>)>> {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, request) in requests.iter().enumerate() {
        let (client, base, request) = (client.clone(), base.to_owned(), request.clone());
        tasks.spawn(async move { (i, loadgen::timed(&client, &base, &request).await) });
    }
    let mut answers = vec![None; requests.len()];
    while let Some(joined) = tasks.join_next().await {
        if let Ok((i, answer)) = joined {
            answers[i] = answer;
        }
    }
    answers
}

/// A streamed completion of a fresh random prompt of `tokens` token ids,
/// generating exactly `max_tokens` (end of sequence ignored).
fn completion(
    model: &Option<String>,
    rng: &mut StdRng,
    tokens: usize,
    max_tokens: usize,
) -> PreparedRequest {
    let ids: Vec<u32> = (0..tokens).map(|_| rng.gen_range(PROMPT_IDS)).collect();
    let mut body = serde_json::json!({
        "prompt": ids,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": true,
        "stream": true,
        "temperature": 0.0,
    });
    if let Some(model) = model {
        body["model"] = model.clone().into();
    }
    PreparedRequest {
        path: "/v1/completions",
        body: serde_json::to_vec(&body)
            .expect("a JSON value serializes")
            .into(),
        session: None,
        next_turn: None,
        tenant: None,
    }
}

/// The first model the engine lists at `/v1/models`.
async fn first_model(client: &HttpClient, base: &str) -> Option<String> {
    let text = loadgen::get_text(client, &format!("{base}/v1/models")).await?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["data"][0]["id"].as_str().map(str::to_owned)
}

/// The engine's KV blocks and block size: the flags, else its server
/// information (`/server_info`, `/get_server_info`), else vLLM's
/// `vllm:cache_config_info`.
async fn capacity(
    client: &HttpClient,
    base: &str,
    args: &CalibrateArgs,
) -> anyhow::Result<(usize, usize)> {
    let (mut blocks, mut block_size) = (args.num_blocks, args.block_size);
    if blocks.is_none() || block_size.is_none() {
        let info = match loadgen::get_text(client, &format!("{base}/server_info")).await {
            Some(text) => Some(text),
            None => loadgen::get_text(client, &format!("{base}/get_server_info")).await,
        };
        if let Some(text) = info {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            let cache = ServerInfoCache::read(&v);
            blocks = blocks.or(cache.blocks.map(|b| b as usize));
            block_size = block_size.or(cache.page_size.map(|b| b as usize));
        }
    }
    if blocks.is_none() || block_size.is_none() {
        if let Some(text) = loadgen::get_text(client, &format!("{base}/metrics")).await {
            if let Some(kv) = KvCapacity::from_vllm(&Scrape::parse(&text)) {
                blocks = blocks.or(Some(kv.blocks as usize));
                block_size = block_size.or(Some(kv.block_size as usize));
            }
        }
    }
    match (blocks, block_size) {
        (Some(b), Some(s)) if b > 0 && s > 0 => Ok((b, s)),
        _ => anyhow::bail!(
            "no KV capacity from {base} (no /server_info, /get_server_info or vllm:cache_config_info answered; is it up?): give --num-blocks and --block-size"
        ),
    }
}

fn list_ms(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
        + " ms"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_sizes_spread_geometrically_between_the_bounds() {
        assert_eq!(
            prompt_sizes(64, 4096, 7),
            [64, 128, 256, 512, 1024, 2048, 4096]
        );
        let sizes = prompt_sizes(100, 200, 8);
        assert!(sizes.windows(2).all(|w| w[0] < w[1]), "{sizes:?}");
        assert_eq!((sizes[0], *sizes.last().unwrap()), (100, 200));
    }

    #[test]
    fn the_kv_usage_is_read_from_the_sim_workers_or_vllms_gauge() {
        let kv_usage = |text: &str| kv_usage_fraction(&Scrape::parse(text));
        assert_eq!(
            kv_usage("switchyard_engine_kv_usage_ratio 0.25\n"),
            Some(0.25)
        );
        assert_eq!(
            kv_usage(
                "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n"
            ),
            Some(0.5),
            "the fullest engine's"
        );
        assert_eq!(kv_usage("other 1\n"), None);
    }

    #[test]
    fn bad_sweeps_are_refused_with_why() {
        let args = |extra: &[&str]| {
            #[derive(clap::Parser)]
            struct Cli {
                #[command(flatten)]
                c: CalibrateArgs,
            }
            <Cli as clap::Parser>::try_parse_from(
                ["calibrate", "--worker", "http://x"].iter().chain(extra),
            )
            .unwrap()
            .c
        };
        assert!(check(&args(&[])).is_ok());
        for (extra, why) in [
            (&["--prompt-sizes", "2"][..], "at least 3"),
            (&["--max-prompt-tokens", "100"][..], "twice"),
            (&["--usages", "0.1,0.1,0.5"][..], "three distinct"),
            (&["--usages", "0.1,0.5,1.5"][..], "in 0..1"),
            (&["--repeats", "0"][..], "positive"),
        ] {
            let err = check(&args(extra)).unwrap_err().to_string();
            assert!(err.contains(why), "{extra:?}: {err}");
        }
    }
}
