//! `switchyard calibrate`: profiles live OpenAI-compatible engines (a
//! sim-worker, vLLM, SGLang) and writes an [`EngineProfile`] — the
//! simulator's timing model fitted to what the engines did — for
//! `replay`, `sim-worker` and `serve` (`--engine-profile`).
//!
//! What is measured, one request or one batch at a time on each engine,
//! from idle. Given several `--worker`s (one configuration: the same KV
//! capacity), every one is measured at once, each sample of each worker
//! a point of the one fit: engines that share a host's cores and memory
//! bandwidth (CPU engines, several per machine) run slower side by side
//! than alone, and a fleet's profile should say how they run in the fleet.
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
//! - **Decode**: inter-token latency of requests decoding together, in
//!   two sweeps: `--batch-sizes` requests of short prompts (the step
//!   against the sequences it runs), and `--decode-batch` requests at KV
//!   usages spread over `--usages` (prompt lengths chosen from the
//!   engine's KV capacity). The usage is read from the engine's own gauge
//!   while they decode (`switchyard_wire::engine_metrics::
//!   kv_usage_fraction`: the sim-worker's, vLLM's, SGLang's) when it has
//!   one; the middle half of each stream's gaps (all requests decoding)
//!   averaged; each point's medians over the repeats fitted together as
//!   `a·u² + b·u + c + s·n` ms (`s`: the profile's
//!   `decode_per_sequence_ms`), since a bigger batch holds more of the
//!   cache too. The floor is half the fastest step measured.
//! - **Capacity**: blocks and block size from the server information
//!   (`/server_info`, `/get_server_info`: the sim-worker's, SGLang's) or vLLM's `vllm:cache_config_info`, else
//!   `--num-blocks` and `--block-size`. A decode batch's prompts are kept
//!   within the model's length (`max_model_len` at `/v1/models`, vLLM's and
//!   SGLang's); a usage they cannot reach with `--decode-batch` requests is
//!   reached with more (up to [`MAX_DECODE_BATCH`]), else left out.
//!
//! Besides the profile it draws the fit against the samples (the same
//! path with `.svg`).
//!
//! Not measured yet: what a cached prefix saves (the model credits a hit
//! as no prefill work).

use crate::loadgen::{self, HttpClient, PreparedRequest};
use crate::stats::median;
use anyhow::Context as _;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use switchyard_core::engine_profile::{fit_decode, fit_quadratic, EngineProfile, ProfileFit};
use switchyard_wire::engine_metrics::{kv_usage_fraction, KvCapacity, ServerInfoCache};
use switchyard_wire::prometheus::Scrape;

/// Options of `switchyard calibrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateArgs {
    /// The engine's base URL (e.g. http://127.0.0.1:8000); repeat for
    /// several engines of one configuration, measured side by side.
    #[arg(long = "worker", required = true)]
    pub workers: Vec<String>,
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
    /// Sequences decoding together in the batch sweep (short prompts; the
    /// slope of the step against them is the per-sequence cost).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    pub batch_sizes: Vec<usize>,
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

/// The most requests one decode batch sends (to reach a KV usage whose
/// prompts would not fit the model's length with `--decode-batch`).
pub const MAX_DECODE_BATCH: usize = 64;

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
    let root = SVGBackend::new(path, (1500, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    let profile = &calibration.profile;
    let curves = [
        (
            "prefill: time to first token",
            "prompt tokens",
            &calibration.prefill_samples,
            profile.prefill,
        ),
        (
            "decode: inter-token latency, less the sequences' cost",
            "KV usage",
            &calibration.decode_samples,
            profile.decode,
        ),
        (
            "decode: inter-token latency by sequences",
            "sequences decoding",
            &calibration.sequence_samples,
            [
                0.0,
                profile.decode_per_sequence_ms,
                line_intercept(
                    &calibration.sequence_samples,
                    profile.decode_per_sequence_ms,
                ),
            ],
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

/// The intercept of the line of slope `slope` through the middle of
/// `samples` (what the per-sequence panel draws).
fn line_intercept(samples: &[(f64, f64)], slope: f64) -> f64 {
    let n = samples.len().max(1) as f64;
    let (sx, sy) = samples
        .iter()
        .fold((0.0, 0.0), |(sx, sy), p| (sx + p.0, sy + p.1));
    sy / n - slope * sx / n
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
    let mut sizes = args.batch_sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    anyhow::ensure!(
        sizes.len() >= 2 && sizes.iter().all(|&n| (1..=MAX_DECODE_BATCH).contains(&n)),
        "--batch-sizes needs two distinct sizes in 1..={MAX_DECODE_BATCH}"
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
    /// KV usage against inter-token latency, the per-sequence cost taken
    /// out.
    pub decode_samples: Vec<(f64, f64)>,
    /// Sequences decoding against inter-token latency.
    pub sequence_samples: Vec<(f64, f64)>,
}

/// Measures the engines `args` names and fits their profile (what [`run`]
/// writes).
pub async fn calibrate(args: &CalibrateArgs) -> anyhow::Result<Calibration> {
    let client = loadgen::client();
    let bases: Vec<String> = args
        .workers
        .iter()
        .map(|w| w.trim_end_matches('/').to_owned())
        .collect();
    let first = &bases[0];
    let listed = listed_model(&client, first).await;
    let model = args
        .model
        .clone()
        .or_else(|| listed.as_ref().map(|(name, _)| name.clone()));
    let max_model_len = listed.and_then(|(_, len)| len);
    let (num_blocks, block_size) = capacity(&client, first, args).await?;
    for other in &bases[1..] {
        let theirs = capacity(&client, other, args).await?;
        anyhow::ensure!(
            theirs == (num_blocks, block_size),
            "{other} has {} KV blocks of {} tokens and {first} {num_blocks} of {block_size}: calibrate engines of one configuration together",
            theirs.0,
            theirs.1
        );
    }
    let capacity = num_blocks * block_size;
    println!(
        "calibrating {}{}: {num_blocks} KV blocks of {block_size} tokens{}",
        bases.join(", "),
        model
            .as_deref()
            .map_or(String::new(), |m| format!(" ({m})")),
        max_model_len.map_or(String::new(), |l| format!(", {l} tokens a sequence"))
    );
    if bases.len() > 1 {
        println!("  the {} engines measured side by side", bases.len());
    }
    let mut rng = StdRng::seed_from_u64(args.seed);
    // Warm-up: the first requests of a fresh engine are slower.
    for _ in 0..2 {
        let requests = each(&bases, || {
            completion(&model, &mut rng, args.min_prompt_tokens, 2)
        });
        for (base, answer) in at_once(&client, &requests).await {
            answer.with_context(|| format!("a warm-up request to {base} failed"))?;
        }
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
            let requests = each(&bases, || completion(&model, &mut rng, tokens, 1));
            for (base, answer) in at_once(&client, &requests).await {
                let (ttft, _) =
                    answer.with_context(|| format!("a {tokens}-token prompt to {base} failed"))?;
                ttfts.push(ttft);
                prefill_samples.push((tokens as f64, ttft));
            }
        }
        println!("  {tokens:>7} tokens: {}", list_ms(&ttfts));
        prefill.push((tokens as f64, median(&ttfts)));
    }
    let (prefill_curve, prefill_fit) =
        fit_quadratic(&prefill).context("the prefill samples do not determine a curve")?;

    println!(
        "decode: inter-token latency of {}-token prompts decoding together, by their number",
        args.min_prompt_tokens
    );
    // Each sweep point's medians: (KV usage, sequences, inter-token ms).
    let mut points = Vec::new();
    let mut sequence_samples = Vec::new();
    let mut fastest = f64::INFINITY;
    for &n in &args.batch_sizes {
        let (mut usages, mut itls) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            let batch = futures_util::future::join_all(bases.iter().map(|base| {
                let requests: Vec<PreparedRequest> = (0..n)
                    .map(|_| {
                        completion(&model, &mut rng, args.min_prompt_tokens, args.decode_tokens)
                    })
                    .collect();
                decode_point(
                    &client,
                    base,
                    requests,
                    args.min_prompt_tokens,
                    args,
                    capacity,
                )
            }))
            .await;
            for (base, point) in bases.iter().zip(batch) {
                let (usage, itl) =
                    point.with_context(|| format!("the decode batch of {n} on {base} failed"))?;
                fastest = fastest.min(itl);
                usages.push(usage);
                itls.push(itl);
                sequence_samples.push((n as f64, itl));
            }
        }
        println!("  {n:>3} sequences: {}", list_ms(&itls));
        points.push((median(&usages), n as f64, median(&itls)));
    }
    println!(
        "decode: inter-token latency of {} requests decoding together, by KV usage",
        args.decode_batch
    );
    let mut usage_samples = Vec::new();
    let mut usage_points = 0;
    for &target in &args.usages {
        let Some(batch) = decode_batch(args, target, capacity, max_model_len) else {
            println!(
                "  usage {target}: left out (its prompts do not fit {} tokens a sequence in {MAX_DECODE_BATCH} requests)",
                max_model_len.unwrap_or(0)
            );
            continue;
        };
        let (mut usages, mut itls) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            let points = futures_util::future::join_all(bases.iter().map(|base| {
                let requests: Vec<PreparedRequest> = (0..batch.requests)
                    .map(|_| completion(&model, &mut rng, batch.prompt, args.decode_tokens))
                    .collect();
                decode_point(&client, base, requests, batch.prompt, args, capacity)
            }))
            .await;
            for (base, point) in bases.iter().zip(points) {
                let (usage, itl) = point.with_context(|| {
                    format!("the decode batch at usage {target} on {base} failed")
                })?;
                println!(
                    "  usage {usage:.3} ({} × {} prompt tokens): {itl:.2} ms",
                    batch.requests, batch.prompt
                );
                fastest = fastest.min(itl);
                usages.push(usage);
                usage_samples.push((usage, batch.requests as f64, itl));
                itls.push(itl);
            }
        }
        points.push((median(&usages), batch.requests as f64, median(&itls)));
        usage_points += 1;
    }
    anyhow::ensure!(
        usage_points >= 3,
        "only {usage_points} of the --usages can be reached within the model's length ({} tokens a sequence, {MAX_DECODE_BATCH} requests): give lower --usages",
        max_model_len.unwrap_or(0)
    );
    let decode_fit = fit_decode(&points)
        .context("the decode samples do not determine a step (are the usages distinct?)")?;
    let (decode_curve, per_sequence) = (decode_fit.curve, decode_fit.per_sequence_ms);
    let decode_samples: Vec<(f64, f64)> = usage_samples
        .iter()
        .map(|&(u, n, itl)| (u, itl - per_sequence * n))
        .collect();
    let profile = EngineProfile {
        model,
        prefill: prefill_curve,
        decode: decode_curve,
        decode_floor_ms: fastest / 2.0,
        decode_per_sequence_ms: per_sequence,
        block_size: Some(block_size),
        num_blocks: Some(num_blocks),
        fit: Some(ProfileFit {
            worker: bases.join(","),
            prefill: prefill_fit,
            decode: decode_fit.usage,
            sequences: Some(decode_fit.sequences),
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
        "decode ms = {:.3}·u² + {:.3}·u + {:.3} + {per_sequence:.3}·n (rms error {:.2} ms, worst {:.1}%), floor {:.2} ms",
        decode_curve[0],
        decode_curve[1],
        decode_curve[2],
        decode_fit.usage.rms_error_ms,
        decode_fit.usage.max_relative_error * 100.0,
        profile.decode_floor_ms
    );
    Ok(Calibration {
        profile,
        prefill_samples,
        decode_samples,
        sequence_samples,
    })
}

/// One request per engine: `make()` for each of `bases`.
fn each(
    bases: &[String],
    mut make: impl FnMut() -> PreparedRequest,
) -> Vec<(String, PreparedRequest)> {
    bases.iter().map(|b| (b.clone(), make())).collect()
}

/// One engine's answer: its base URL and the request's timing (time to
/// first token and the gaps, ms), `None` when it failed.
type Answer = (String, Option<(f64, Vec<f64>)>);

/// Sends each request to its engine at once; the answers (time to first
/// token and the gaps, ms) in the same order.
async fn at_once(client: &HttpClient, requests: &[(String, PreparedRequest)]) -> Vec<Answer> {
    // Each on a task of its own, so that a batch's streams are read in
    // parallel (their gaps are what is measured).
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (base, request)) in requests.iter().enumerate() {
        let (client, base, request) = (client.clone(), base.clone(), request.clone());
        tasks.spawn(async move { (i, loadgen::timed(&client, &base, &request).await) });
    }
    let mut answers: Vec<Answer> = requests
        .iter()
        .map(|(base, _)| (base.clone(), None))
        .collect();
    while let Some(joined) = tasks.join_next().await {
        if let Ok((i, answer)) = joined {
            answers[i].1 = answer;
        }
    }
    answers
}

/// A decode batch's shape: how many requests, each with a prompt of how
/// many tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DecodeBatch {
    requests: usize,
    prompt: usize,
}

/// The batch that holds `target` of the KV capacity half way through its
/// decoding: `--decode-batch` requests when their prompts fit the model's
/// length, else as many more as they need to (`None` past
/// [`MAX_DECODE_BATCH`]).
fn decode_batch(
    args: &CalibrateArgs,
    target: f64,
    capacity: usize,
    max_model_len: Option<usize>,
) -> Option<DecodeBatch> {
    let held = (target * capacity as f64) as usize;
    let half = args.decode_tokens / 2;
    let longest = max_model_len.map_or(usize::MAX, |len| len.saturating_sub(args.decode_tokens));
    let per_request = |n: usize| (held / n).saturating_sub(half).max(16);
    let requests = (args.decode_batch..=MAX_DECODE_BATCH.max(args.decode_batch))
        .find(|&n| per_request(n) <= longest)?;
    Some(DecodeBatch {
        requests,
        prompt: per_request(requests),
    })
}

/// One decode point: the batch's requests at once; the KV usage while
/// they decode (the engine's gauge, else estimated from the tokens held)
/// and their mean inter-token latency over the middle half of each
/// stream.
async fn decode_point(
    client: &HttpClient,
    base: &str,
    requests: Vec<PreparedRequest>,
    prompt: usize,
    args: &CalibrateArgs,
    capacity: usize,
) -> anyhow::Result<(f64, f64)> {
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
    let batch: Vec<(String, PreparedRequest)> =
        requests.into_iter().map(|r| (base.to_owned(), r)).collect();
    let answers = at_once(client, &batch).await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = sampler.await.unwrap_or_default();
    let (mut gaps, mut last_first_token_ms) = (Vec::new(), 0.0f64);
    for (_, answer) in answers {
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
        (batch.len() * (prompt + args.decode_tokens / 2)) as f64 / capacity as f64
    } else {
        median(&held)
    };
    Ok((usage, itl))
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

/// The first model the engine lists at `/v1/models`, with its length
/// (`max_model_len`) when the engine says it (vLLM and SGLang do).
async fn listed_model(client: &HttpClient, base: &str) -> Option<(String, Option<usize>)> {
    let text = loadgen::get_text(client, &format!("{base}/v1/models")).await?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let model = &v["data"][0];
    let len = model["max_model_len"]
        .as_u64()
        .and_then(|l| usize::try_from(l).ok());
    Some((model["id"].as_str()?.to_owned(), len))
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
