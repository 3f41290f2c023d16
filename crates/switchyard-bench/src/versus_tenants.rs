//! `bench versus --tenants FILE [--tenants-alone FILE]`: a tenant mix
//! (`loadgen --tenants`'s scenario file) through Switchyard and through
//! SGLang's gateway, each in front of its own fresh engines.
//!
//! - Switchyard runs with a generated `serve` configuration: the mix's
//!   bands, `reserve_for_top_band` and tenants (weight, band, ceiling, cap)
//!   as `[flow]`, the tenant named by the `x-tenant` header loadgen sends
//!   (`tenant_header`; client keys stay off so the warm-up request and the
//!   peer see the same requests), and `--busy-threshold` (flow control
//!   only orders what the router holds back).
//! - smg (1.13) runs with its priority scheduler on
//!   (`--priority-scheduler-enabled`, tenants' ceiling
//!   `--priority-scheduler-default-max-class interactive` so no band is
//!   clamped below what it asks), and each request carries
//!   `x-smg-priority`: the mix's top band as `interactive`, a sheddable
//!   band as `bulk`, any other as `default`.
//!
//! Each tenant's requests carry the headers `loadgen --tenants` sends
//! (key, `x-priority`, `x-slo-ttft-ms`, `x-tenant`); a tenant whose key
//! variable (`key_env`) is unset gets a placeholder, since neither router
//! checks keys here. Figures per router per tenant: requests, 429s, other
//! errors, TTFT p50/p90; with `--tenants-alone`, the same for the alone
//! file and, for each tenant in both, TTFT p90 in the mix over alone.

use super::{contenders, find_peers, one_run, Contender, Peer, RunLoad, Variant, VersusArgs};
use clap::Parser;
use hyper::header::{HeaderName, HeaderValue};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use switchyard_commands::loadgen::{self, Pacing, PreparedRequest, Report, TenantSend};
use switchyard_commands::stats::write_json;
use switchyard_commands::tenants::TenantMix;
use switchyard_core::admission::FlowConfig;
use switchyard_tokenizer::Tokenizer;

/// smg's request header naming a priority class.
pub(crate) const SMG_PRIORITY_HEADER: &str = "x-smg-priority";

/// The header Switchyard's generated configuration names tenants by.
const TENANT_HEADER: &str = "x-tenant";

/// smg's flags for its priority scheduler.
fn smg_flags() -> Vec<String> {
    [
        "--priority-scheduler-enabled",
        "--priority-scheduler-default-max-class",
        "interactive",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

/// smg's class for band `index` of `flow`'s bands: the top band is
/// `interactive` (the highest class smg means for clients), a sheddable
/// band `bulk`, any other `default`.
pub(crate) fn smg_class(flow: &FlowConfig, band: &str) -> &'static str {
    match flow.bands.iter().position(|b| b.name == band) {
        Some(0) => "interactive",
        Some(i) if flow.bands[i].sheddable => "bulk",
        _ => "default",
    }
}

/// The `serve` configuration file for `mix`: its flow settings, tenants
/// named by `x-tenant`, and the busy threshold.
pub(crate) fn serve_config(mix: &TenantMix, busy_threshold: f64) -> anyhow::Result<String> {
    #[derive(Serialize)]
    struct ServeConfig {
        busy_threshold: f64,
        tenant_header: &'static str,
        flow: FlowConfig,
    }
    Ok(toml::to_string(&ServeConfig {
        busy_threshold,
        tenant_header: TENANT_HEADER,
        flow: mix.flow_config(true),
    })?)
}

/// `requests` with each tenant's smg priority header added (the band its
/// `x-priority` names, else the mix's default band).
pub(crate) fn with_smg_priority(
    requests: &[PreparedRequest],
    mix: &TenantMix,
) -> anyhow::Result<Vec<PreparedRequest>> {
    let flow = mix.flow_config(true);
    let mut sends: BTreeMap<String, Arc<TenantSend>> = BTreeMap::new();
    for t in &mix.tenants {
        let band = t.band.as_deref().unwrap_or(&flow.default_band);
        let Some(old) = requests
            .iter()
            .filter_map(|r| r.tenant.as_ref())
            .find(|s| s.name == t.name)
        else {
            continue;
        };
        let mut headers = old.headers.clone();
        headers.push((
            HeaderName::from_static(SMG_PRIORITY_HEADER),
            HeaderValue::from_static(smg_class(&flow, band)),
        ));
        sends.insert(
            t.name.clone(),
            Arc::new(TenantSend {
                name: t.name.clone(),
                headers,
            }),
        );
    }
    Ok(requests
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(t) = &r.tenant {
                if let Some(s) = sends.get(&t.name) {
                    r.tenant = Some(s.clone());
                }
            }
            r
        })
        .collect())
}

/// `loadgen`'s settings for sending `file`'s mix for `duration` seconds.
#[derive(Parser)]
struct LoadgenCli {
    #[command(flatten)]
    args: loadgen::LoadgenArgs,
}

/// One scenario file: its mix and its requests with arrival times.
struct Scenario {
    label: &'static str,
    file: PathBuf,
    mix: TenantMix,
    requests: Vec<PreparedRequest>,
    arrivals: Arc<[f64]>,
}

fn scenario(
    args: &VersusArgs,
    prompts: &WordPrompts,
    tokenizer: &Tokenizer,
    label: &'static str,
    file: &Path,
) -> anyhow::Result<Scenario> {
    let mix = TenantMix::load(file)?;
    for t in &mix.tenants {
        if let Some(var) = &t.key_env {
            if std::env::var_os(var).is_none() {
                // Neither router checks keys in this benchmark.
                std::env::set_var(var, format!("bench-versus-{}", t.name));
            }
        }
    }
    let cli = LoadgenCli::try_parse_from([
        "loadgen".to_owned(),
        "--url".to_owned(),
        "http://unused".to_owned(),
        "--tenants".to_owned(),
        file.display().to_string(),
        "--duration".to_owned(),
        args.duration.to_string(),
        "--max-output-tokens".to_owned(),
        args.max_output_tokens.to_string(),
        "--max-requests".to_owned(),
        usize::MAX.to_string(),
        "--model".to_owned(),
        args.model().to_owned(),
    ])?;
    let (requests, arrivals) = loadgen::tenant_requests(&cli.args, file, None)?;
    if args.prompt_ids {
        eprintln!("{label}: prompts as token ids (--prompt-ids)");
        return Ok(Scenario {
            label,
            file: file.to_owned(),
            mix,
            requests,
            arrivals: arrivals.into(),
        });
    }
    let (n, ids, tokens) = token_ratio(prompts, tokenizer, &requests, 50)?;
    eprintln!(
        "{label}: prompts as text, one of {} words per id; {n} sampled prompts: {ids} ids, {tokens} tokens encoded again ({:.4} tokens per id)",
        prompts.len(),
        tokens as f64 / ids.max(1) as f64
    );
    let requests = requests
        .into_iter()
        .map(|r| prompts.request(r))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Scenario {
        label,
        file: file.to_owned(),
        mix,
        requests,
        arrivals: arrivals.into(),
    })
}

/// Token-id prompts written as text that the sim-workers' tokenizer
/// reads back as one token per id: smg 1.13 refuses a prompt of token ids
/// (400, "data did not match any variant of untagged enum
/// StringOrArray"), so both routers get the same text prompts.
///
/// Each id becomes one word of the bundled tokenizer's vocabulary (the
/// tokenizer the sim-workers load): a token that decodes to a space and
/// ASCII letters only, and that encodes back to itself alone. The
/// pre-tokenizer cuts text at each such word (a space then letters), so
/// the text of `n` ids encodes to those `n` words' ids. Id `i` is word
/// `i % words`, a function of the id alone, so equal id prefixes give
/// equal text prefixes; ids that differ may share a word (there are fewer
/// words than ids), which only makes different prompts alike at a
/// position, never shorter or longer.
pub(crate) struct WordPrompts {
    words: Vec<String>,
}

impl WordPrompts {
    /// The words of `tokenizer`'s vocabulary, in id order.
    pub(crate) fn new(tokenizer: &Tokenizer) -> anyhow::Result<Self> {
        let mut words = Vec::new();
        for id in 0..tokenizer.vocab_size() as u32 {
            let Ok(text) = tokenizer.decode(&[id]) else {
                continue;
            };
            let Some(letters) = text.strip_prefix(' ') else {
                continue;
            };
            if letters.is_empty() || !letters.bytes().all(|b| b.is_ascii_alphabetic()) {
                continue;
            }
            if tokenizer.encode(&text)? == [id] {
                words.push(text);
            }
        }
        anyhow::ensure!(
            !words.is_empty(),
            "the tokenizer has no word tokens (a space then letters)"
        );
        Ok(Self { words })
    }

    /// How many words the ids are written with.
    pub(crate) fn len(&self) -> usize {
        self.words.len()
    }

    /// The text of `ids`: one word each.
    pub(crate) fn text(&self, ids: impl IntoIterator<Item = u64>) -> String {
        let mut out = String::new();
        for id in ids {
            out.push_str(&self.words[(id % self.words.len() as u64) as usize]);
        }
        out
    }

    /// `request` with a token-id prompt written as text; any other body
    /// stays as it is.
    fn request(&self, mut request: PreparedRequest) -> anyhow::Result<PreparedRequest> {
        let mut body: serde_json::Value = serde_json::from_slice(&request.body)?;
        if let Some(ids) = body.get("prompt").and_then(|p| p.as_array()) {
            let ids = ids
                .iter()
                .map(|id| {
                    id.as_u64()
                        .ok_or_else(|| anyhow::anyhow!("a prompt token id is not a number: {id}"))
                })
                .collect::<anyhow::Result<Vec<u64>>>()?;
            body["prompt"] = serde_json::Value::String(self.text(ids));
            request.body = serde_json::to_vec(&body)?.into();
        }
        Ok(request)
    }
}

/// The ids of `request`'s token-id prompt (the body's `prompt` array),
/// if it has one.
fn prompt_ids(request: &PreparedRequest) -> Option<Vec<u64>> {
    let body: serde_json::Value = serde_json::from_slice(&request.body).ok()?;
    body.get("prompt")?
        .as_array()?
        .iter()
        .map(serde_json::Value::as_u64)
        .collect()
}

/// Tokens over ids when the text prompts of up to `sample` of `requests`
/// (evenly spread) are encoded again by `tokenizer`, with the ids and the
/// tokens counted.
fn token_ratio(
    prompts: &WordPrompts,
    tokenizer: &Tokenizer,
    requests: &[PreparedRequest],
    sample: usize,
) -> anyhow::Result<(usize, u64, u64)> {
    let with_ids: Vec<Vec<u64>> = requests.iter().filter_map(prompt_ids).collect();
    let step = (with_ids.len() / sample.max(1)).max(1);
    let (mut n, mut ids, mut tokens) = (0, 0u64, 0u64);
    for p in with_ids.iter().step_by(step).take(sample) {
        n += 1;
        ids += p.len() as u64;
        tokens += tokenizer.encode(&prompts.text(p.iter().copied()))?.len() as u64;
    }
    Ok((n, ids, tokens))
}

/// One router's figures for one scenario.
#[derive(Debug, Clone, Serialize)]
struct TenantRun {
    router: String,
    round: usize,
    /// `mixed` or `alone`.
    scenario: &'static str,
    file: PathBuf,
    report: Report,
}

/// Runs the tenant scenarios.
pub(super) fn run(args: &VersusArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.engine == super::Engine::Sim,
        "--tenants runs with sim-workers (--engine sim)"
    );
    anyhow::ensure!(
        args.duration.is_finite() && args.duration > 0.0,
        "--duration must be positive"
    );
    anyhow::ensure!(
        args.busy_threshold > 0.0 && args.busy_threshold.is_finite(),
        "--busy-threshold must be positive"
    );
    anyhow::ensure!(
        !args.prompt_ids || args.no_peer,
        "--prompt-ids needs --no-peer: smg refuses a prompt of token ids"
    );
    // The sim-workers' tokenizer (`sim-worker` without `--tokenizer-dir`).
    let tokenizer = Tokenizer::bundled()?;
    let prompts = WordPrompts::new(&tokenizer)?;
    let mut scenarios = Vec::new();
    if let Some(file) = &args.tenants {
        scenarios.push(scenario(args, &prompts, &tokenizer, "mixed", file)?);
    }
    if let Some(file) = &args.tenants_alone {
        scenarios.push(scenario(args, &prompts, &tokenizer, "alone", file)?);
    }
    let variants = Variant::all(&args.policy, &args.admission);
    let peers: Vec<(Peer, PathBuf)> = find_peers(args)?
        .into_iter()
        .filter(|(p, _)| {
            let keep = *p == Peer::Smg;
            if !keep {
                eprintln!(
                    "skipping {}: --tenants compares with smg's priority scheduler only",
                    p.requirement()
                );
            }
            keep
        })
        .collect();
    let scratch =
        std::env::temp_dir().join(format!("switchyard-versus-tenants-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let mut runs = Vec::new();
    for round in 0..args.rounds {
        for sc in &scenarios {
            let config = scratch.join(format!("{}.toml", sc.label));
            std::fs::write(&config, serve_config(&sc.mix, args.busy_threshold)?)?;
            let smg_requests = with_smg_priority(&sc.requests, &sc.mix)?;
            for (i, (name, contender)) in contenders(args, &variants, &peers, round)
                .into_iter()
                .enumerate()
            {
                let name = match contender {
                    Contender::Ours(_) => name,
                    Contender::Peer(p, _) => format!("{} (priority)", p.requirement()),
                };
                eprintln!("round {}, {}: {name}...", round + 1, sc.label);
                let (requests, load) = match contender {
                    Contender::Ours(_) => (
                        sc.requests.clone(),
                        RunLoad {
                            pacing: Pacing::Arrivals(sc.arrivals.clone()),
                            ours: vec!["--config".into(), config.display().to_string()],
                            peer: Vec::new(),
                        },
                    ),
                    Contender::Peer(..) => (
                        smg_requests.clone(),
                        RunLoad {
                            pacing: Pacing::Arrivals(sc.arrivals.clone()),
                            ours: Vec::new(),
                            peer: smg_flags(),
                        },
                    ),
                };
                let run = format!("round{}-{}-{i}", round + 1, sc.label);
                let (report, _) = one_run(args, None, contender, requests, &run, load)?;
                runs.push(TenantRun {
                    router: name,
                    round: round + 1,
                    scenario: sc.label,
                    file: sc.file.clone(),
                    report,
                });
            }
        }
    }
    print_table(args, &runs);
    if let Some(path) = &args.json {
        write_json(path, &runs)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn print_table(args: &VersusArgs, runs: &[TenantRun]) {
    println!(
        "tenant mix {}{}, {} s of arrivals, {} sim-workers (--speedup {} --num-blocks {}) per router, Switchyard --busy-threshold {}, prompts as {}",
        args.tenants.as_deref().map(Path::display).map(|d| d.to_string()).unwrap_or_default(),
        args.tenants_alone
            .as_deref()
            .map(|f| format!(" (alone: {})", f.display()))
            .unwrap_or_default(),
        args.duration,
        args.workers(),
        args.speedup,
        args.num_blocks,
        args.busy_threshold,
        if args.prompt_ids { "token ids" } else { "text" },
    );
    println!(
        "{:<32} {:>5} {:<6} {:<12} {:>6} {:>5} {:>6} {:>10} {:>10}",
        "router", "round", "run", "tenant", "reqs", "429", "errors", "TTFT p50", "TTFT p90"
    );
    for r in runs {
        for (tenant, t) in &r.report.tenants {
            println!(
                "{:<32} {:>5} {:<6} {:<12} {:>6} {:>5} {:>6} {:>10.1} {:>10.1}",
                r.router,
                r.round,
                r.scenario,
                tenant,
                t.requests,
                t.shed,
                t.errors,
                t.ttft_ms.p50,
                t.ttft_ms.p90
            );
        }
    }
    for (router, round, tenant, ratio) in ratios(runs) {
        println!("{router} round {round}: {tenant} TTFT p90 mixed / alone = {ratio:.2}");
    }
    println!("(TTFT in ms at the client, of the completed requests; 429 = refused at once; errors = other failures)");
}

/// For each router and round with both runs, each tenant of the alone run:
/// its TTFT p90 in the mix over alone.
fn ratios(runs: &[TenantRun]) -> Vec<(String, usize, String, f64)> {
    let mut out = Vec::new();
    for alone in runs.iter().filter(|r| r.scenario == "alone") {
        let Some(mixed) = runs
            .iter()
            .find(|r| r.scenario == "mixed" && r.router == alone.router && r.round == alone.round)
        else {
            continue;
        };
        for (tenant, a) in &alone.report.tenants {
            if let Some(m) = mixed.report.tenants.get(tenant) {
                out.push((
                    alone.router.clone(),
                    alone.round,
                    tenant.clone(),
                    m.ttft_ms.p90 / a.ttft_ms.p90,
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(text: &str) -> TenantMix {
        let mix: TenantMix = toml::from_str(text).unwrap();
        mix.validate().unwrap();
        mix
    }

    const PRIORITY: &str = r#"
[flow]
reserve_for_top_band = 0.6

[[tenants]]
name = "checkout"
band = "critical"
rate_scale = 14

[[tenants]]
name = "batch"
band = "sheddable"
rate_scale = 14

[[tenants]]
name = "chat"
weight = 3
rate_scale = 1
"#;

    fn versus(argv: &[&str]) -> VersusArgs {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: VersusArgs,
        }
        Cli::try_parse_from(std::iter::once("versus").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn prompt_ids_are_sent_as_ids_and_only_without_a_peer() {
        let file = std::env::temp_dir().join(format!("versus-ids-{}.toml", std::process::id()));
        std::fs::write(&file, PRIORITY).unwrap();
        let file_arg = file.display().to_string();
        let err = run(&versus(&["--tenants", &file_arg, "--prompt-ids"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--prompt-ids needs --no-peer"), "{err}");
        let tokenizer = Tokenizer::bundled().unwrap();
        let prompts = WordPrompts::new(&tokenizer).unwrap();
        let as_ids = versus(&[
            "--tenants",
            &file_arg,
            "--prompt-ids",
            "--no-peer",
            "--duration",
            "5",
        ]);
        let as_text = versus(&["--tenants", &file_arg, "--no-peer", "--duration", "5"]);
        let ids = scenario(&as_ids, &prompts, &tokenizer, "mixed", &file).unwrap();
        let text = scenario(&as_text, &prompts, &tokenizer, "mixed", &file).unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(!ids.requests.is_empty());
        assert_eq!(ids.requests.len(), text.requests.len());
        assert_eq!(ids.arrivals, text.arrivals);
        assert!(ids.requests.iter().all(|r| prompt_ids(r).is_some()));
        assert!(text.requests.iter().all(|r| prompt_ids(r).is_none()));
    }

    #[test]
    fn token_id_prompts_become_text_of_one_token_per_id_and_prefixes_stay_prefixes() {
        let tokenizer = Tokenizer::bundled().unwrap();
        let prompts = WordPrompts::new(&tokenizer).unwrap();
        assert!(prompts.len() > 10_000, "{} words", prompts.len());
        // Ids spread over the synthetic vocabulary, as Mooncake's prompts.
        let ids: Vec<u64> = (0..2_000u64)
            .map(|i| i.wrapping_mul(2_654_435_761) % 151_643)
            .collect();
        let text = prompts.text(ids.iter().copied());
        assert_eq!(tokenizer.encode(&text).unwrap().len(), ids.len());
        for cut in [1, 17, 512, 1_999] {
            let prefix = prompts.text(ids[..cut].iter().copied());
            assert!(text.starts_with(&prefix));
            assert_eq!(tokenizer.encode(&prefix).unwrap().len(), cut);
        }
        let request = PreparedRequest {
            path: "/v1/completions",
            body: serde_json::to_vec(&serde_json::json!({"prompt": [7, 8, 9], "max_tokens": 4}))
                .unwrap()
                .into(),
            session: None,
            next_turn: None,
            tenant: None,
        };
        let out = prompts.request(request).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"prompt": prompts.text([7, 8, 9]), "max_tokens": 4})
        );
        let chat = PreparedRequest {
            path: "/v1/chat/completions",
            body: bytes::Bytes::from_static(b"{\"messages\":[]}"),
            session: None,
            next_turn: None,
            tenant: None,
        };
        assert_eq!(
            &prompts.request(chat).unwrap().body[..],
            b"{\"messages\":[]}"
        );
    }

    #[test]
    fn bands_map_to_smg_classes_top_interactive_sheddable_bulk() {
        let flow = mix(PRIORITY).flow_config(true);
        assert_eq!(smg_class(&flow, "critical"), "interactive");
        assert_eq!(smg_class(&flow, "standard"), "default");
        assert_eq!(smg_class(&flow, "sheddable"), "bulk");
        assert_eq!(smg_class(&flow, "nonesuch"), "default");
    }

    #[test]
    fn the_serve_config_carries_the_mix_tenants_and_threshold() {
        let text = serve_config(&mix(PRIORITY), 0.6).unwrap();
        let config: switchyard_server::config::ServerConfig = toml::from_str(&text).unwrap();
        assert_eq!(config.busy_threshold, Some(0.6));
        assert_eq!(config.tenant_header.as_deref(), Some("x-tenant"));
        assert_eq!(config.flow.reserve_for_top_band, 0.6);
        let names: Vec<&str> = config
            .flow
            .tenants
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["checkout", "batch", "chat"]);
        assert_eq!(config.flow.tenants[2].weight, 3.0);
        assert_eq!(config.flow.tenants[1].band.as_deref(), Some("sheddable"));
    }

    #[test]
    fn smg_requests_carry_their_tenants_class_besides_the_mix_headers() {
        let mix = mix(PRIORITY);
        let send = |name: &str| {
            Arc::new(TenantSend {
                name: name.to_owned(),
                headers: vec![(
                    HeaderName::from_static("x-tenant"),
                    HeaderValue::from_str(name).unwrap(),
                )],
            })
        };
        let request = |tenant: Option<Arc<TenantSend>>| PreparedRequest {
            path: "/v1/completions",
            body: bytes::Bytes::from_static(b"{}"),
            session: None,
            next_turn: None,
            tenant,
        };
        let requests = vec![
            request(Some(send("checkout"))),
            request(Some(send("batch"))),
            request(Some(send("chat"))),
            request(None),
        ];
        let out = with_smg_priority(&requests, &mix).unwrap();
        let class = |r: &PreparedRequest| {
            r.tenant.as_ref().map(|t| {
                assert_eq!(t.headers[0].0, "x-tenant");
                t.headers
                    .iter()
                    .find(|(n, _)| n == SMG_PRIORITY_HEADER)
                    .map(|(_, v)| v.to_str().unwrap().to_owned())
            })
        };
        assert_eq!(class(&out[0]), Some(Some("interactive".to_owned())));
        assert_eq!(class(&out[1]), Some(Some("bulk".to_owned())));
        assert_eq!(class(&out[2]), Some(Some("default".to_owned())));
        assert_eq!(class(&out[3]), None);
    }
}
