//! The real-time side of `bench twin`: `switchyard serve` and its
//! sim-workers as child processes of this binary, the load generator here.
//!
//! Readiness is observed, never slept on: a sim-worker is up when it prints
//! its address (after binding), the router when it prints its own and its
//! `/metrics` shows every worker in selection. The children are killed
//! when their guards drop — on success, on error, on a panic, and on
//! Ctrl-C or SIGTERM, which end the run with an error.

use anyhow::Context as _;
use serde::Serialize;
use std::time::{Duration, Instant};
use switchyard_commands::child::Children;
use switchyard_commands::demo::{start_sim_workers, SimWorkers};
use switchyard_commands::loadgen::{self, Pacing, PreparedRequest, Report};
use switchyard_core::select::PolicyKind;
use switchyard_server::config::Role;
use switchyard_wire::prometheus::Scrape;

/// How long the router may take to list every worker as up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How faithfully one real-time run kept its clocks.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ServeHealth {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Wall seconds of the load.
    pub wall_seconds: f64,
    /// Step time the sim-workers' timing model asked for, seconds (all workers).
    pub paced_seconds: f64,
    /// Of which the sim-workers fell too far behind to catch up, seconds.
    pub dropped_seconds: f64,
    /// `dropped_seconds / paced_seconds`: 0 when the workers kept model time.
    pub dropped_fraction: f64,
    /// How late the load generator sent requests against their arrival
    /// times, 99th percentile, ms.
    pub send_lag_p99_ms: f64,
}

/// The KV transfers the decode workers made (disaggregated case).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Transfers {
    /// Transfers received.
    pub(super) count: u64,
    /// Modeled bytes moved.
    pub(super) bytes: u64,
}

/// What one policy's real-time run measured.
pub(super) struct ServeRun {
    /// The load generator's figures; its hit rate is over the workers
    /// [`hit_rate_workers`] names.
    pub(super) report: Report,
    pub(super) health: ServeHealth,
    pub(super) transfers: Transfers,
    /// Requests the router moved to another worker.
    pub(super) moved: Moved,
}

/// Requests the router moved to another worker, from its
/// `switchyard_migrations_total{reason}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Moved {
    /// Before their first token (every reason but `midstream`).
    pub(super) retried: u64,
    /// Streams resumed (`midstream`).
    pub(super) resumed: u64,
}

impl Moved {
    fn of(metrics: &str) -> Self {
        let scrape = Scrape::parse(metrics);
        let all = scrape.sum("switchyard_migrations_total").unwrap_or(0.0) as u64;
        let resumed = scrape
            .value("switchyard_migrations_total", &[("reason", "midstream")])
            .unwrap_or(0.0) as u64;
        Self {
            retried: all.saturating_sub(resumed),
            resumed,
        }
    }
}

/// Worker `index`'s role in a fleet whose first `prefill_workers` prefill
/// (the simulator's numbering, `DisaggConfig::prefill_workers`); `None`
/// when the fleet is aggregated.
pub(super) fn role_of(index: usize, prefill_workers: Option<usize>) -> Option<Role> {
    prefill_workers.map(|p| {
        if index < p {
            Role::Prefill
        } else {
            Role::Decode
        }
    })
}

/// The workers whose prompt-cache counters make the hit rate: every one,
/// or in the disaggregated case the prefill workers (the simulator counts
/// a split prompt's hit on its prefill half; a decode worker's "hits" are
/// the blocks it restored from the transfer).
pub(super) fn hit_rate_workers(urls: &[String], prefill_workers: Option<usize>) -> Vec<String> {
    urls.iter()
        .enumerate()
        .filter(|&(i, _)| role_of(i, prefill_workers) != Some(Role::Decode))
        .map(|(_, url)| url.clone())
        .collect()
}

/// `switchyard serve` flags for `policy` in front of `fleet`; with
/// `prefill_workers`, `--disagg vllm` and each worker's role.
fn serve_args(
    policy: PolicyKind,
    block_size: usize,
    fleet: &SimWorkers,
    prefill_workers: Option<usize>,
) -> Vec<String> {
    let specs = fleet
        .urls
        .iter()
        .zip(&fleet.events)
        .enumerate()
        .map(|(i, (url, events))| {
            let mut spec = format!("{url},name=worker-{i}");
            if let Some((events, replay)) = events {
                spec.push_str(&format!(",events={events},replay={replay}"));
            }
            if let Some(role) = role_of(i, prefill_workers) {
                spec.push_str(&format!(",role={}", role.label()));
            }
            spec
        });
    router_args(policy, block_size, specs, prefill_workers.is_some())
}

/// `switchyard serve` flags for `policy` in front of the workers `specs`
/// (`--worker` values); with `disagg`, `--disagg vllm`.
pub(super) fn router_args(
    policy: PolicyKind,
    block_size: usize,
    specs: impl IntoIterator<Item = String>,
    disagg: bool,
) -> Vec<String> {
    let mut args: Vec<String> = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--policy",
        policy.name(),
        "--block-size",
        &block_size.to_string(),
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    if disagg {
        args.extend(["--disagg".to_owned(), "vllm".to_owned()]);
    }
    for spec in specs {
        args.extend(["--worker".to_owned(), spec]);
    }
    args
}

/// Starts `switchyard serve` with `args` (which must include `--port 0`)
/// and returns it (killed on drop) with its base URL once it has printed it.
pub(crate) fn start_router(args: &[String]) -> anyhow::Result<(Children, String)> {
    let mut command = switchyard_commands::child::this_binary()?;
    command.args(args).env("RUST_LOG", "warn");
    let (child, url) = switchyard_commands::child::spawn_printing_url(command, "the router")?;
    Ok((Children(vec![child]), url))
}

/// Workers the router's `/metrics` lists as in selection.
fn workers_up(metrics: &str) -> usize {
    Scrape::parse(metrics)
        .series("switchyard_worker_up")
        .filter(|s| s.value() == 1.0)
        .count()
}

/// The step time a sim-worker's timing model asked for and the part of it
/// the worker fell too far behind to keep, seconds, from its `/metrics`
/// (0 for what it does not export).
pub(crate) fn paced_and_dropped_seconds(metrics: &str) -> (f64, f64) {
    let scrape = Scrape::parse(metrics);
    let seconds = |name| scrape.value(name, &[]).unwrap_or(0.0);
    (
        seconds("switchyard_engine_paced_seconds_total"),
        seconds("switchyard_engine_pacing_dropped_seconds_total"),
    )
}

/// The KV transfers a sim-worker received, from its `/metrics` (none for
/// what it does not export).
fn transfers_received(metrics: &str) -> Transfers {
    let scrape = Scrape::parse(metrics);
    let count = |name| scrape.value(name, &[]).unwrap_or(0.0) as u64;
    Transfers {
        count: count("switchyard_engine_disagg_transfers_total"),
        bytes: count("switchyard_engine_disagg_transfer_bytes_total"),
    }
}

/// Ends when this process gets Ctrl-C or SIGTERM.
pub(super) async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// The serve side's fixed inputs: the fleet's shape and the load.
pub(super) struct ServeSetup {
    pub(super) workers: usize,
    /// The disaggregated case: the first this many workers prefill, the
    /// rest decode (`None`: every worker serves whole requests).
    pub(super) prefill_workers: Option<usize>,
    pub(super) block_size: usize,
    pub(super) worker_args: Vec<String>,
    /// Extra `serve` flags (the prefill estimator's settings).
    pub(super) router_args: Vec<String>,
    pub(super) requests: Vec<PreparedRequest>,
    /// When each request is sent.
    pub(super) pacing: Pacing,
    /// The last arrival, seconds after the first.
    pub(super) span_s: f64,
    /// The failure case: this long into the load, kill this worker.
    pub(super) fail: Option<(Duration, usize)>,
}

/// Runs every policy, one fresh fleet each, calling `on_run` after each.
/// One runtime for all of them, so Ctrl-C or SIGTERM at any point —
/// starting a fleet, waiting for it, under load — ends the run and drops
/// (kills) whatever children are alive.
pub(super) fn run_all(
    setup: &ServeSetup,
    policies: &[PolicyKind],
    mut on_run: impl FnMut(PolicyKind, ServeRun),
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let all = async {
            for &policy in policies {
                let run = run(policy, setup).await?;
                on_run(policy, run);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            done = all => done,
            () = interrupted() => Err(anyhow::anyhow!("interrupted: stopped the router and the sim-workers")),
        }
    })
}

/// One policy on a fresh fleet: starts the sim-workers and the router
/// (their guards kill them when this future ends or is dropped), waits
/// until every worker is in selection, sends the requests at their arrival
/// times and reads the engines' counters.
async fn run(policy: PolicyKind, setup: &ServeSetup) -> anyhow::Result<ServeRun> {
    eprintln!(
        "serve {}: {} requests over {:.0} s",
        policy.name(),
        setup.requests.len(),
        setup.span_s
    );
    let mut fleet = start_sim_workers(setup.workers, &setup.worker_args, true)?;
    let mut args = serve_args(policy, setup.block_size, &fleet, setup.prefill_workers);
    args.extend(setup.router_args.iter().cloned());
    let (router, base) = start_router(&args)?;
    let kill = match setup.fail {
        // Out of the fleet's guard: the timer kills it (and its drop
        // reaps it, whenever the run ends).
        Some((after, worker)) => Some(Kill {
            after,
            worker: Children(vec![fleet.children.0.remove(worker)]),
        }),
        None => None,
    };
    // What the surviving workers' counters say: the killed one's are gone.
    let counted: Vec<String> = fleet
        .urls
        .iter()
        .enumerate()
        .filter(|&(i, _)| setup.fail.is_none_or(|(_, dead)| dead != i))
        .map(|(_, url)| url.clone())
        .collect();
    let run = drive_failing(
        &base,
        &fleet.urls,
        &counted,
        &hit_rate_workers(&counted, setup.prefill_workers),
        setup.requests.clone(),
        setup.pacing.clone(),
        kill,
    )
    .await;
    drop(router);
    drop(fleet);
    run
}

/// Polls the router at `base` until its `/metrics` lists `workers` workers
/// in selection.
pub(crate) async fn wait_for_workers(base: &str, workers: usize) -> anyhow::Result<()> {
    let client = loadgen::client();
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let metrics = loadgen::get_text(&client, &format!("{base}/metrics")).await;
        if metrics.as_deref().map(workers_up) == Some(workers) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the router did not list all {workers} workers as up within {READY_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A worker process to kill this long into the load.
pub(super) struct Kill {
    after: Duration,
    worker: Children,
}

/// Sends `requests` to the router at `base` once it lists every one of
/// `urls` in selection, and reads the workers' pacing and transfer
/// counters after (zero for what a worker does not export: vLLM).
pub(super) async fn drive(
    base: &str,
    urls: &[String],
    hit_rate_workers: &[String],
    requests: Vec<PreparedRequest>,
    pacing: Pacing,
) -> anyhow::Result<ServeRun> {
    drive_failing(base, urls, urls, hit_rate_workers, requests, pacing, None).await
}

/// [`drive`], with `kill` done that long into the load; the counters are
/// read from the workers `counted` (the survivors).
async fn drive_failing(
    base: &str,
    urls: &[String],
    counted: &[String],
    hit_rate_workers: &[String],
    requests: Vec<PreparedRequest>,
    pacing: Pacing,
    kill: Option<Kill>,
) -> anyhow::Result<ServeRun> {
    let client = loadgen::client();
    wait_for_workers(base, urls.len()).await?;
    let timer = kill.map(|mut kill| {
        tokio::spawn(async move {
            tokio::time::sleep(kill.after).await;
            for child in &mut kill.worker.0 {
                let _ = child.kill();
            }
            kill.worker
        })
    });
    let report = loadgen::run_load(base, requests, pacing, true, hit_rate_workers, true).await;
    if let Some(timer) = timer {
        // Killed before the load ended, or now.
        timer.abort();
    }
    let moved = loadgen::get_text(&client, &format!("{base}/metrics"))
        .await
        .map_or_else(Moved::default, |text| Moved::of(&text));
    let (mut paced, mut dropped) = (0.0, 0.0);
    let mut transfers = Transfers::default();
    for url in counted {
        let text = loadgen::get_text(&client, &format!("{url}/metrics"))
            .await
            .with_context(|| format!("reading {url}/metrics"))?;
        let (worker_paced, worker_dropped) = paced_and_dropped_seconds(&text);
        paced += worker_paced;
        dropped += worker_dropped;
        let received = transfers_received(&text);
        transfers.count += received.count;
        transfers.bytes += received.bytes;
    }
    let health = ServeHealth {
        requests: report.requests,
        errors: report.errors,
        wall_seconds: report.wall_seconds,
        paced_seconds: paced,
        dropped_seconds: dropped,
        dropped_fraction: if paced > 0.0 { dropped / paced } else { 0.0 },
        send_lag_p99_ms: report.send_lag_ms.map_or(0.0, |l| l.p99),
    };
    Ok(ServeRun {
        report,
        health,
        transfers,
        moved,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_in_selection_are_counted_from_the_routers_metrics() {
        let text = "# HELP switchyard_worker_up 1 while the worker is in selection.\n\
                    # TYPE switchyard_worker_up gauge\n\
                    switchyard_worker_up{worker=\"worker-0\"} 1\n\
                    switchyard_worker_up{worker=\"worker-1\"} 0\n\
                    switchyard_worker_up{worker=\"worker-2\"} 1\n\
                    switchyard_worker_up_total 1\n";
        assert_eq!(workers_up(text), 2);
    }

    #[test]
    fn paced_and_dropped_seconds_are_read_by_exact_name() {
        let text = "switchyard_engine_paced_seconds 99\n\
                    switchyard_engine_paced_seconds_total 12.5\n\
                    switchyard_engine_pacing_dropped_seconds_total 0.25\n";
        assert_eq!(paced_and_dropped_seconds(text), (12.5, 0.25));
        assert_eq!(paced_and_dropped_seconds("other 1\n"), (0.0, 0.0));
    }

    #[test]
    fn the_router_gets_every_worker_with_its_event_endpoints_and_the_block_size() {
        let fleet = SimWorkers {
            children: Children::default(),
            urls: vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
            events: vec![
                Some(("tcp://127.0.0.1:3".into(), "tcp://127.0.0.1:4".into())),
                Some(("tcp://127.0.0.1:5".into(), "tcp://127.0.0.1:6".into())),
            ],
        };
        let args = serve_args(PolicyKind::CacheAware, 64, &fleet, None);
        let joined = args.join(" ");
        assert!(joined
            .starts_with("serve --host 127.0.0.1 --port 0 --policy cache-aware --block-size 64"));
        assert!(joined.contains(
            "--worker http://127.0.0.1:2,name=worker-1,events=tcp://127.0.0.1:5,replay=tcp://127.0.0.1:6"
        ));
        let config = serve_config(&args);
        assert_eq!(config.disagg, None);
        assert!(config.workers.iter().all(|w| w.role == Role::Both));
    }

    fn fake_fleet(workers: u16) -> SimWorkers {
        SimWorkers {
            children: Children::default(),
            urls: (0..workers)
                .map(|i| format!("http://127.0.0.1:{}", 100 + i))
                .collect(),
            events: (0..workers)
                .map(|i| {
                    Some((
                        format!("tcp://127.0.0.1:{}", 200 + i),
                        format!("tcp://127.0.0.1:{}", 300 + i),
                    ))
                })
                .collect(),
        }
    }

    /// `args` (as `serve_args` makes them) through `serve`'s own options.
    fn serve_config(args: &[String]) -> switchyard_server::ServerConfig {
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            args: switchyard_server::ServeArgs,
        }
        let serve = <Serve as clap::Parser>::try_parse_from(args).unwrap();
        serve.args.to_config().unwrap()
    }

    /// The router of the disaggregated case speaks vLLM's protocol and
    /// knows the first P workers as prefill and the rest as decode — the
    /// simulator's numbering — and the hit rate is read from exactly the
    /// workers it knows as prefill.
    #[test]
    fn the_disaggregated_router_gets_vllms_protocol_and_the_simulators_roles() {
        use switchyard_server::config::DisaggMode;
        let fleet = fake_fleet(4);
        for prefill in [1, 2, 3] {
            let args = serve_args(PolicyKind::Kv, 64, &fleet, Some(prefill));
            let config = serve_config(&args);
            assert_eq!(config.disagg, Some(DisaggMode::Vllm));
            config.validate().unwrap();
            let roles: Vec<Role> = config.workers.iter().map(|w| w.role).collect();
            let expected: Vec<Role> = (0..4)
                .map(|i| {
                    if i < prefill {
                        Role::Prefill
                    } else {
                        Role::Decode
                    }
                })
                .collect();
            assert_eq!(roles, expected);
            let urls: Vec<&str> = config.workers.iter().map(|w| w.url.as_str()).collect();
            assert_eq!(urls, fleet.urls);
            assert!(config
                .workers
                .iter()
                .all(|w| w.events.is_some() && w.replay.is_some()));
            let prefill_urls: Vec<String> = config
                .workers
                .iter()
                .filter(|w| w.role == Role::Prefill)
                .map(|w| w.url.clone())
                .collect();
            assert_eq!(hit_rate_workers(&fleet.urls, Some(prefill)), prefill_urls);
        }
        assert_eq!(hit_rate_workers(&fleet.urls, None), fleet.urls);
    }

    #[test]
    fn moved_requests_are_read_by_reason_from_the_routers_metrics() {
        let text = "switchyard_migrations_total{reason=\"connect\"} 3\n\
                    switchyard_migrations_total{reason=\"reset\"} 2\n\
                    switchyard_migrations_total{reason=\"midstream\"} 7\n\
                    switchyard_migrations_exhausted_total 1\n";
        assert_eq!(
            Moved::of(text),
            Moved {
                retried: 5,
                resumed: 7
            }
        );
        assert_eq!(Moved::of(""), Moved::default());
    }

    #[test]
    fn transfers_are_read_from_a_decode_workers_counters() {
        let text = "switchyard_engine_disagg_transfers_total 12\n\
                    switchyard_engine_disagg_transfer_bytes_total 3.5e9\n\
                    switchyard_engine_disagg_transfers 99\n";
        assert_eq!(
            transfers_received(text),
            Transfers {
                count: 12,
                bytes: 3_500_000_000
            }
        );
        assert_eq!(transfers_received("other 1\n"), Transfers::default());
    }
}
