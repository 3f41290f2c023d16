//! `switchyard bench proxy`: the router's added latency and the requests
//! it carries, side by side with the same load sent to one sim-worker
//! directly and, with `--peer smg|sglang`, through SGLang's routers.
//!
//! One sim-worker (`--speedup 0`: every engine step instant) runs as a
//! child process of this binary; in front of it, also children, the
//! router (`serve`, its default policy), a TCP relay that only copies
//! bytes ([`super::relay`]: what one more hop costs on the machine, the
//! floor under any proxy's added latency) and each peer (installed with
//! pip like `bench versus` does, started with `--policy cache_aware`). The load
//! generator runs here. Two phases, each in rounds that run every target
//! once, the order rotating from round to round so no target always goes
//! first:
//!
//! - latency: concurrency 1, non-streaming, a fresh ~470-character chat
//!   message every request (nothing is cached anywhere, every router
//!   reads the whole message); a target's added latency in a round is its
//!   median minus the direct median of the same round;
//! - throughput: concurrency `--concurrency` (64), one fixed ~470-character
//!   text completion prompt; requests carried per second, and the router
//!   process's CPU time per request.
//!
//! The summary gives medians over rounds and the ratios the issue asks
//! for: our added latency over each peer's, our requests per second over
//! the direct rate and over each peer's.

use super::peer::{
    cpu_seconds, for_peer, launch, median, peer_program, wait_ready, Peer, SIM_MODEL,
};
use anyhow::Context as _;
use clap::Args;
use serde::Serialize;
use serde_json::json;
use std::path::PathBuf;
use switchyard_commands::child::Children;
use switchyard_commands::loadgen::{run_load, Pacing, PreparedRequest, Report};
use switchyard_commands::stats::write_json;

/// Options of `bench proxy`.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Requests per target per latency round (concurrency 1).
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Requests in flight for the throughput phase.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Requests per target per throughput round.
    #[arg(long, default_value_t = 20_000)]
    pub throughput_requests: usize,
    /// Rounds of each phase (each runs every target once).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// SGLang routers to compare with (repeat or comma-separate: smg, sglang).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub peer: Vec<Peer>,
    /// Run this installed peer program instead of installing one:
    /// PEER=PATH (`smg=/venv/bin/smg`; a `python3` with `sglang_router` for
    /// sglang), or PATH when there is one `--peer`; repeat.
    #[arg(long)]
    pub peer_bin: Vec<String>,
    /// Virtual environment for a peer: PEER=DIR, or DIR when there is one
    /// `--peer`; repeat [default: TMPDIR/switchyard-versus-REQUIREMENT];
    /// reused when it already has the peer.
    #[arg(long)]
    pub venv: Vec<String>,
    /// Also measure another build of switchyard: NAME=PATH (its `serve`, in
    /// front of the same worker, as one more target; `before=/tmp/old`
    /// compares a change side by side in one run); repeat.
    #[arg(long, value_name = "NAME=PATH")]
    pub router_bin: Vec<String>,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The 459-character text every prompt is built from (a chat message is
/// this after an 8-digit number: 468 characters).
const TEXT: &str =
    "Switchyard routes each request to the worker that will serve it soonest and cheapest. \
    It knows which prompt prefixes every worker holds in its KV cache, how loaded each worker is, \
    and which session a turn belongs to. Please summarise in one sentence why a cache-aware router \
    lowers time to first token for multi-turn chats, and name one risk of routing by cache alone. \
    Answer plainly, in words that a new operator of a fleet of inference servers would follow.";

/// `n` one-token chat requests, each message new (numbered from `first`).
fn fresh_chats(first: usize, n: usize) -> Vec<PreparedRequest> {
    (first..first + n)
        .map(|i| {
            let body = json!({
                "model": "switchyard-sim",
                "messages": [{"role": "user", "content": format!("{i:08} {TEXT}")}],
                "max_tokens": 1,
            });
            PreparedRequest {
                tenant: None,
                path: "/v1/chat/completions",
                body: serde_json::to_vec(&body).unwrap_or_default().into(),
                session: None,
                next_turn: None,
            }
        })
        .collect()
}

/// `n` copies of one one-token text completion request.
fn fixed_completions(n: usize) -> Vec<PreparedRequest> {
    let body = json!({"model": "switchyard-sim", "prompt": TEXT, "max_tokens": 1});
    let request = PreparedRequest {
        tenant: None,
        path: "/v1/completions",
        body: serde_json::to_vec(&body).unwrap_or_default().into(),
        session: None,
        next_turn: None,
    };
    vec![request; n]
}

/// What a target is, for the ratios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Role {
    /// The sim-worker itself.
    Direct,
    /// `switchyard serve`.
    Ours,
    /// The byte-copying relay: the floor of an extra hop.
    Relay,
    /// An SGLang router.
    Peer,
    /// Another build of switchyard (`--router-bin`).
    Build,
}

/// Where a load goes.
struct Target {
    name: String,
    role: Role,
    url: String,
    /// The router process (none for the worker itself).
    pid: Option<u32>,
}

/// One target's figures in one round.
#[derive(Debug, Clone, Serialize)]
struct RoundFigures {
    target: String,
    round: usize,
    report: Report,
    /// The router process's CPU time per request, ms (throughput phase).
    cpu_ms_per_request: Option<f64>,
}

/// One target's medians over the rounds.
#[derive(Debug, Clone, Serialize)]
struct Summary {
    target: String,
    role: Role,
    p50_ms: f64,
    p99_ms: f64,
    /// Median over rounds of (this p50 − the direct p50 of that round).
    added_p50_ms: f64,
    requests_per_s: f64,
    /// Requests per second over the direct rate.
    of_direct: f64,
    cpu_ms_per_request: Option<f64>,
    errors: usize,
}

/// Runs `bench proxy`.
pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.requests > 0
            && args.concurrency > 0
            && args.throughput_requests > 0
            && args.rounds > 0,
        "--requests, --concurrency, --throughput-requests and --rounds must be positive"
    );
    let mut peers = args.peer.clone();
    peers.dedup();
    let mut children = Children(Vec::new());
    let mut builds = Vec::new();
    for spec in &args.router_bin {
        let (name, path) = spec
            .split_once('=')
            .filter(|(n, p)| !n.is_empty() && !p.is_empty())
            .with_context(|| format!("--router-bin {spec:?}: give NAME=PATH"))?;
        anyhow::ensure!(
            std::path::Path::new(path).is_file(),
            "--router-bin {name}: no program at {path}"
        );
        builds.push((name.to_owned(), PathBuf::from(path)));
    }
    let spawn_program = |children: &mut Children,
                         program: Option<&std::path::Path>,
                         a: &[&str]|
     -> anyhow::Result<(String, u32)> {
        let mut command = match program {
            Some(path) => std::process::Command::new(path),
            None => switchyard_commands::child::this_binary()?,
        };
        command.args(a).env("RUST_LOG", "warn");
        let (child, url) = switchyard_commands::child::spawn_printing_url(command, a[0])?;
        let pid = child.id();
        children.0.push(child);
        Ok((url, pid))
    };
    let spawn = |children: &mut Children, a: &[&str]| spawn_program(children, None, a);
    let (worker, _) = spawn(
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut targets = vec![Target {
        name: "direct (sim-worker)".into(),
        role: Role::Direct,
        url: worker.clone(),
        pid: None,
    }];
    let worker_spec = format!("{worker},name=w0");
    let serve = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--worker",
        &worker_spec,
    ];
    let (router, pid) = spawn(&mut children, &serve)?;
    wait_ready(
        &runtime,
        &router,
        SIM_MODEL,
        &mut children,
        "switchyard serve",
    )?;
    targets.push(Target {
        // `serve` runs the core's default policy: name it, not a guess.
        name: format!(
            "switchyard ({})",
            switchyard_core::select::PolicyKind::DEFAULT.name()
        ),
        role: Role::Ours,
        url: router,
        pid: Some(pid),
    });
    for (name, path) in &builds {
        let (url, pid) = spawn_program(&mut children, Some(path), &serve)?;
        let what = format!("switchyard {name} ({})", path.display());
        wait_ready(&runtime, &url, SIM_MODEL, &mut children, &what)?;
        targets.push(Target {
            name: format!("switchyard {name}"),
            role: Role::Build,
            url,
            pid: Some(pid),
        });
    }
    let worker_address = worker.trim_start_matches("http://").trim_end_matches('/');
    let (relay, pid) = spawn(&mut children, &["bench", "relay", "--to", worker_address])?;
    wait_ready(&runtime, &relay, SIM_MODEL, &mut children, "the TCP relay")?;
    targets.push(Target {
        name: "tcp relay (copies bytes)".into(),
        role: Role::Relay,
        url: relay,
        pid: Some(pid),
    });
    for &peer in &peers {
        let bin = for_peer(&args.peer_bin, peer, peers.len())?;
        let venv = for_peer(&args.venv, peer, peers.len())?;
        let program = match peer_program(peer, bin.as_deref(), venv.as_deref()) {
            Ok(p) => p,
            Err(why) => {
                eprintln!("skipping {}: {why}", peer.requirement());
                continue;
            }
        };
        let url = launch(
            peer,
            &program,
            std::slice::from_ref(&worker),
            &[],
            &mut children,
        )?;
        let pid = children.0.last().map(std::process::Child::id);
        let name = format!("{} (cache_aware)", peer.requirement());
        wait_ready(&runtime, &url, SIM_MODEL, &mut children, &name)
            .with_context(|| format!("{} ({})", name, program.display()))?;
        targets.push(Target {
            name,
            role: Role::Peer,
            url,
            pid,
        });
    }
    let load = |url: &str, requests: Vec<PreparedRequest>, concurrency: usize| {
        runtime.block_on(run_load(
            url,
            requests,
            Pacing::Concurrency(concurrency),
            false,
            &[],
            false,
        ))
    };
    // Warm every path (connections, caches, the routers' first requests).
    let mut next = 0;
    for t in &targets {
        load(&t.url, fresh_chats(next, 200), 1);
        next += 200;
        load(&t.url, fixed_completions(200), 1);
    }
    let order = |round: usize| {
        let mut o: Vec<usize> = (0..targets.len()).collect();
        o.rotate_left(round % targets.len());
        o
    };
    let mut latency = Vec::new();
    for round in 0..args.rounds {
        for i in order(round) {
            let t = &targets[i];
            eprintln!("latency round {}: {}...", round + 1, t.name);
            let report = load(&t.url, fresh_chats(next, args.requests), 1);
            next += args.requests;
            latency.push(RoundFigures {
                target: t.name.clone(),
                round: round + 1,
                report,
                cpu_ms_per_request: None,
            });
        }
    }
    let mut throughput = Vec::new();
    for round in 0..args.rounds {
        for i in order(round) {
            let t = &targets[i];
            eprintln!("throughput round {}: {}...", round + 1, t.name);
            let before = t.pid.and_then(cpu_seconds);
            let report = load(
                &t.url,
                fixed_completions(args.throughput_requests),
                args.concurrency,
            );
            let cpu = match (before, t.pid.and_then(cpu_seconds)) {
                (Some(b), Some(a)) if report.requests > 0 => {
                    Some((a - b) * 1e3 / report.requests as f64)
                }
                _ => None,
            };
            throughput.push(RoundFigures {
                target: t.name.clone(),
                round: round + 1,
                report,
                cpu_ms_per_request: cpu,
            });
        }
    }
    let summaries = summarise(&targets, &latency, &throughput, args.rounds);
    print_table(&args, &summaries);
    if let Some(path) = &args.json {
        write_json(
            path,
            &json!({
                "cores": std::thread::available_parallelism().map_or(0, usize::from),
                "requests_per_latency_round": args.requests,
                "concurrency": args.concurrency,
                "requests_per_throughput_round": args.throughput_requests,
                "rounds": args.rounds,
                "latency_prompt": "fresh ~470-character chat message, max_tokens 1, non-streaming",
                "throughput_prompt": "fixed ~470-character text completion, max_tokens 1, non-streaming",
                "summary": summaries,
                "comparisons": comparisons(&summaries),
                "latency_rounds": latency,
                "throughput_rounds": throughput,
            }),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn summarise(
    targets: &[Target],
    latency: &[RoundFigures],
    throughput: &[RoundFigures],
    rounds: usize,
) -> Vec<Summary> {
    let of = |rows: &[RoundFigures], name: &str, f: &dyn Fn(&RoundFigures) -> Option<f64>| {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r.target == name)
            .filter_map(f)
            .collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let direct = &targets[0].name;
    let direct_p50 = |round: usize| {
        latency
            .iter()
            .find(|r| &r.target == direct && r.round == round)
            .map_or(f64::NAN, |r| r.report.e2e_ms.p50)
    };
    let direct_rps = of(throughput, direct, &|r| Some(r.report.throughput_rps)).unwrap_or(f64::NAN);
    targets
        .iter()
        .map(|t| {
            let added: Vec<f64> = (1..=rounds)
                .filter_map(|round| {
                    let r = latency
                        .iter()
                        .find(|r| r.target == t.name && r.round == round)?;
                    Some(r.report.e2e_ms.p50 - direct_p50(round))
                })
                .collect();
            let rps =
                of(throughput, &t.name, &|r| Some(r.report.throughput_rps)).unwrap_or(f64::NAN);
            Summary {
                target: t.name.clone(),
                role: t.role,
                p50_ms: of(latency, &t.name, &|r| Some(r.report.e2e_ms.p50)).unwrap_or(f64::NAN),
                p99_ms: of(latency, &t.name, &|r| Some(r.report.e2e_ms.p99)).unwrap_or(f64::NAN),
                added_p50_ms: median(&added),
                requests_per_s: rps,
                of_direct: rps / direct_rps,
                cpu_ms_per_request: of(throughput, &t.name, &|r| r.cpu_ms_per_request),
                errors: latency
                    .iter()
                    .chain(throughput)
                    .filter(|r| r.target == t.name)
                    .map(|r| r.report.errors)
                    .sum(),
            }
        })
        .collect()
}

/// Ours against one other target.
#[derive(Debug, Clone, Serialize)]
struct Comparison {
    against: String,
    role: Role,
    /// Our added median over theirs (peers).
    #[serde(skip_serializing_if = "Option::is_none")]
    added_p50_ours_over_theirs: Option<f64>,
    /// Our added median minus theirs (the relay, whose added median is
    /// about zero: a ratio to it would be noise over noise).
    #[serde(skip_serializing_if = "Option::is_none")]
    added_p50_ms_ours_minus_theirs: Option<f64>,
    requests_per_s_ours_over_theirs: f64,
}

/// Ours against direct (requests per second), the relay and each peer;
/// empty without our row. The table and `--json` both print these.
fn comparisons(summaries: &[Summary]) -> Vec<Comparison> {
    let Some(ours) = summaries.iter().find(|s| s.role == Role::Ours) else {
        return Vec::new();
    };
    summaries
        .iter()
        .filter(|s| s.role != Role::Ours)
        .map(|s| Comparison {
            against: s.target.clone(),
            role: s.role,
            added_p50_ours_over_theirs: matches!(s.role, Role::Peer | Role::Build)
                .then(|| ours.added_p50_ms / s.added_p50_ms),
            added_p50_ms_ours_minus_theirs: (s.role == Role::Relay)
                .then_some(ours.added_p50_ms - s.added_p50_ms),
            requests_per_s_ours_over_theirs: ours.requests_per_s / s.requests_per_s,
        })
        .collect()
}

fn print_table(args: &ProxyArgs, summaries: &[Summary]) {
    println!(
        "one sim-worker (--speedup 0); latency: concurrency 1, {} fresh ~470-char chat messages per target per round; \
         throughput: concurrency {}, {} fixed ~470-char text completions per target per round; {} rounds, medians",
        args.requests, args.concurrency, args.throughput_requests, args.rounds
    );
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>6}",
        "target", "p50 ms", "added ms", "p99 ms", "req/s", "of direct", "cpu ms/rq", "errors"
    );
    for (i, s) in summaries.iter().enumerate() {
        let added = if i == 0 {
            "-".to_owned()
        } else {
            format!("{:.3}", s.added_p50_ms)
        };
        let cpu = s
            .cpu_ms_per_request
            .map_or_else(|| "-".to_owned(), |c| format!("{c:.3}"));
        println!(
            "{:<34} {:>9.3} {:>9} {:>9.3} {:>10.0} {:>9.2} {:>9} {:>6}",
            s.target, s.p50_ms, added, s.p99_ms, s.requests_per_s, s.of_direct, cpu, s.errors
        );
    }
    for c in comparisons(summaries) {
        let added = match (
            c.added_p50_ours_over_theirs,
            c.added_p50_ms_ours_minus_theirs,
        ) {
            (Some(ratio), _) => format!("added latency {ratio:.2}x, "),
            (_, Some(difference)) => format!("added latency {difference:+.3} ms more, "),
            _ => String::new(),
        };
        println!(
            "switchyard against {}: {added}requests per second {:.2}x",
            c.against, c.requests_per_s_ours_over_theirs
        );
    }
    println!("(latency end to end at the client; added = the target's p50 minus the direct p50 of the same round; cpu ms/rq = the router process's CPU time per request in the throughput phase; the tcp relay only copies bytes: what the extra hop alone adds here)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ours_is_compared_by_ratio_with_peers_by_difference_with_the_relay() {
        let row = |target: &str, role, added_p50_ms, requests_per_s| Summary {
            target: target.into(),
            role,
            p50_ms: 0.0,
            p99_ms: 0.0,
            added_p50_ms,
            requests_per_s,
            of_direct: 0.0,
            cpu_ms_per_request: None,
            errors: 0,
        };
        let rows = [
            row("direct", Role::Direct, f64::NAN, 40_000.0),
            row("relay", Role::Relay, 0.01, 40_000.0),
            row("ours", Role::Ours, 0.13, 20_000.0),
            row("peer", Role::Peer, 0.26, 10_000.0),
        ];
        let c = comparisons(&rows);
        let against: Vec<&str> = c.iter().map(|c| c.against.as_str()).collect();
        assert_eq!(against, ["direct", "relay", "peer"]);
        assert_eq!(c[0].requests_per_s_ours_over_theirs, 0.5);
        assert_eq!(c[0].added_p50_ours_over_theirs, None);
        assert!((c[1].added_p50_ms_ours_minus_theirs.unwrap() - 0.12).abs() < 1e-12);
        assert_eq!(c[1].added_p50_ours_over_theirs, None);
        assert_eq!(c[2].added_p50_ours_over_theirs, Some(0.5));
        assert_eq!(c[2].requests_per_s_ours_over_theirs, 2.0);
        assert!(
            comparisons(&rows[..2]).is_empty(),
            "nothing without our row"
        );
    }

    #[test]
    fn every_latency_prompt_is_new_and_about_470_characters() {
        let chats = fresh_chats(5, 3);
        let contents: Vec<String> = chats
            .iter()
            .map(|r| {
                let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
                v["messages"][0]["content"].as_str().unwrap().to_owned()
            })
            .collect();
        assert!(contents[0] != contents[1] && contents[1] != contents[2]);
        assert_eq!(contents[0].len(), 468);
        let fixed = fixed_completions(2);
        assert_eq!(fixed[0].body, fixed[1].body);
    }
}
