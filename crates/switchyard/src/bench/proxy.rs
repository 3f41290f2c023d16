//! `switchyard bench proxy`: the router's added latency and its request
//! rate, side by side with the same load sent to one sim-worker directly.
//!
//! One sim-worker (`--speedup 0`: every engine step instant) and one router
//! (`serve`, policy `kv`) run as child processes of this binary; the load
//! generator runs here. Phase 1: concurrency 1, non-streaming, direct then
//! through the router, alternating rounds; the added latency is the
//! difference of medians. Phase 2: high concurrency, requests per second
//! both ways. Prompts are token ids (no tokenization) and, separately, a
//! 465-character chat message the router tokenizes every time.

use crate::child::Children;
use crate::loadgen::{run_load, Pacing, PreparedRequest, Report};
use crate::stats::write_json;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

/// Options of `bench proxy`.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Requests per latency round (concurrency 1).
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Requests in flight for the throughput phase.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Requests in the throughput phase.
    #[arg(long, default_value_t = 40_000)]
    pub throughput_requests: usize,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn spawn(children: &mut Children, args: &[&str]) -> anyhow::Result<String> {
    let mut command = crate::child::this_binary()?;
    command.args(args).env("RUST_LOG", "warn");
    let (child, url) = crate::child::spawn_printing_url(command, args[0])?;
    children.0.push(child);
    Ok(url)
}

fn requests(n: usize, chat: bool) -> Vec<PreparedRequest> {
    let text = "Switchyard routes each request to the worker that will serve it soonest and cheapest. \
        It knows which prompt prefixes every worker holds in its KV cache, how loaded each worker is, \
        and which session a turn belongs to. Please summarise in one sentence why a cache-aware router \
        lowers time to first token for multi-turn chats, and name one risk of routing by cache alone.";
    (0..n)
        .map(|i| {
            let (path, body) = if chat {
                (
                    "/v1/chat/completions",
                    json!({"messages": [{"role": "user", "content": format!("{i} {text}")}], "max_tokens": 1}),
                )
            } else {
                let prompt: Vec<u32> = (0..128u32).map(|t| t + (i as u32 % 64) * 7).collect();
                ("/v1/completions", json!({"prompt": prompt, "max_tokens": 1}))
            };
            PreparedRequest {
                path,
                body: serde_json::to_vec(&body).unwrap_or_default().into(),
                session: None,
            }
        })
        .collect()
}

/// Runs `bench proxy`.
pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let mut children = Children(Vec::new());
    let worker = spawn(
        &mut children,
        &[
            "sim-worker",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--speedup",
            "0",
        ],
    )?;
    let router = spawn(
        &mut children,
        &[
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--worker",
            &format!("{worker},name=w0"),
        ],
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let lat = |base: &str, chat: bool, n: usize| {
        runtime.block_on(run_load(
            base,
            requests(n, chat),
            Pacing::Concurrency(1),
            false,
            &[],
            false,
        ))
    };
    // Warm both paths (connections, caches).
    lat(&worker, false, 200);
    lat(&router, false, 200);
    lat(&router, true, 200);
    let mut rows = Vec::new();
    for (label, chat) in [("token ids", false), ("chat text (tokenized)", true)] {
        let mut direct = Vec::new();
        let mut routed = Vec::new();
        for _ in 0..2 {
            direct.push(lat(&worker, chat, args.requests / 2));
            routed.push(lat(&router, chat, args.requests / 2));
        }
        let p50 = |r: &[Report]| r.iter().map(|r| r.e2e_ms.p50).sum::<f64>() / r.len() as f64;
        let p99 = |r: &[Report]| r.iter().map(|r| r.e2e_ms.p99).sum::<f64>() / r.len() as f64;
        let row = json!({
            "prompt": label,
            "direct_p50_ms": p50(&direct),
            "router_p50_ms": p50(&routed),
            "added_p50_ms": p50(&routed) - p50(&direct),
            "direct_p99_ms": p99(&direct),
            "router_p99_ms": p99(&routed),
        });
        println!(
            "concurrency 1, {label}: direct p50 {:.3} ms, through the router p50 {:.3} ms, added {:.3} ms (p99 {:.3} vs {:.3})",
            p50(&direct), p50(&routed), p50(&routed) - p50(&direct), p99(&direct), p99(&routed)
        );
        rows.push(row);
    }
    let tput = |base: &str| {
        runtime.block_on(run_load(
            base,
            requests(args.throughput_requests, false),
            Pacing::Concurrency(args.concurrency),
            false,
            &[],
            false,
        ))
    };
    let direct = tput(&worker);
    let routed = tput(&router);
    println!(
        "concurrency {}, token ids: direct {:.0} req/s, through the router {:.0} req/s (errors {} / {})",
        args.concurrency, direct.throughput_rps, routed.throughput_rps, direct.errors, routed.errors
    );
    if let Some(path) = &args.json {
        write_json(
            path,
            &json!({
                "latency": rows,
                "concurrency": args.concurrency,
                "direct_rps": direct.throughput_rps,
                "router_rps": routed.throughput_rps,
            }),
        )?;
    }
    Ok(())
}
