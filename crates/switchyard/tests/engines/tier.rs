//! What the tier's tests share: the engines' environment and models (found
//! or made once per run), vLLM servers started side by side, one test at a
//! time, a time bound per test, and reading engines' and the router's
//! `/metrics`.

use std::future::Future;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use switchyard_commands::engines::env::VllmEnv;
use switchyard_commands::engines::models::TinyModels;
use switchyard_commands::engines::vllm::{VllmOptions, VllmWorker, READY_TIMEOUT};
use tokio::sync::{Mutex, MutexGuard};

/// How long one test may run, start-up of its servers included.
pub(crate) const TEST_BOUND: Duration = Duration::from_secs(900);

/// The environment and the models, for the whole run.
pub(crate) struct Tier {
    pub(crate) python: PathBuf,
    pub(crate) models: TinyModels,
    logs: PathBuf,
}

static TIER: OnceLock<Result<Tier, String>> = OnceLock::new();
static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// Whether a missing environment fails the tests.
fn required() -> bool {
    std::env::var("SWITCHYARD_REQUIRE_ENGINES").is_ok_and(|v| v == "1")
}

fn prepare() -> Result<Tier, String> {
    let env = VllmEnv::find().map_err(|e| e.to_string())?;
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let models = TinyModels::make(&env.python(), &scratch.join("engine-models"))
        .map_err(|e| format!("making the tiny models: {e:#}"))?;
    Ok(Tier {
        python: env.python(),
        models,
        logs: scratch.join("engine-logs"),
    })
}

/// The tier, or `None` (printed) when vLLM's environment is not installed
/// and not required. Panics when it is required and missing, or when the
/// models cannot be made.
pub(crate) fn tier() -> Option<&'static Tier> {
    match TIER.get_or_init(prepare) {
        Ok(tier) => Some(tier),
        Err(why) if !required() && why.contains("not installed") => {
            println!("skipping the real-engine test: {why}");
            None
        }
        Err(why) => panic!("the real-engine tier cannot run: {why}"),
    }
}

/// Holds the machine for one test: the others wait.
pub(crate) async fn exclusive() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().await
}

/// Runs `test` within [`TEST_BOUND`]; past it, panics (the test's servers
/// are dropped, so stopped, as the future is).
pub(crate) async fn bounded(test: impl Future<Output = ()>) {
    if tokio::time::timeout(TEST_BOUND, test).await.is_err() {
        panic!("the test ran past its bound of {TEST_BOUND:?}");
    }
}

impl Tier {
    /// Starts one vLLM server per `(name, options)`, side by side, each
    /// bound to its own core, and waits until all serve. Their output is
    /// in `target/tmp/engine-logs/TEST-NAME.log`. A server that exits
    /// before serving is started once more on fresh ports, its errors
    /// printed: vLLM's CPU build now and then fails its engine core's
    /// start on a loaded machine, and the tests are about what it does
    /// once it serves. A second failure fails the test.
    pub(crate) async fn start(
        &self,
        test: &str,
        servers: Vec<(&str, VllmOptions)>,
    ) -> Vec<VllmWorker> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let servers: Vec<(String, VllmOptions)> = servers
            .into_iter()
            .enumerate()
            .map(|(i, (name, mut options))| {
                options.cpu.get_or_insert(i % cores);
                (name.to_owned(), options)
            })
            .collect();
        let spawn = |name: &str, options: &VllmOptions| {
            let log = self.logs.join(format!("{test}-{name}.log"));
            VllmWorker::spawn(&self.python, options, &log)
                .unwrap_or_else(|e| panic!("starting vLLM {name}: {e:#}"))
        };
        let mut workers: Vec<VllmWorker> = servers.iter().map(|(name, o)| spawn(name, o)).collect();
        let ready =
            futures_util::future::join_all(workers.iter_mut().map(|w| w.ready(READY_TIMEOUT)))
                .await;
        for (i, outcome) in ready.into_iter().enumerate() {
            let Err(e) = outcome else { continue };
            if !workers[i].exited() {
                panic!("{e:#}");
            }
            let (name, options) = &servers[i];
            println!("vLLM {name} of {test} failed to start; starting it once more: {e:#}");
            workers[i] = spawn(name, options);
            if let Err(e) = workers[i].ready(READY_TIMEOUT).await {
                panic!("{e:#}");
            }
        }
        workers
    }

    /// The Qwen3 model's options: served as `tiny`, 32 tokens a block.
    pub(crate) fn qwen3(&self) -> VllmOptions {
        let mut options = VllmOptions::new(&self.models.qwen3(), "tiny");
        options.max_model_len = 8192;
        options
    }
}

/// The sum of every sample of `name` in an engine's or the router's
/// Prometheus text (vLLM exports one series per engine and model).
pub(crate) fn sum(text: &str, name: &str) -> f64 {
    crate::support::metric_sum(text, name)
}

/// `serve` with `flags` in front of `workers` (named `v0`, `v1`, … in
/// order), once every one of them is in selection.
pub(crate) async fn serve_in_front(
    client: &reqwest::Client,
    workers: &[VllmWorker],
    mut flags: Vec<String>,
) -> crate::support::Proc {
    for (i, w) in workers.iter().enumerate() {
        flags.extend(["--worker".to_owned(), w.worker_spec(&format!("v{i}"))]);
    }
    let router = crate::support::serve(&flags);
    let n = workers.len() as f64;
    crate::support::wait_metrics(
        client,
        &router.base,
        "every vLLM worker in selection",
        |t| sum(t, "switchyard_worker_up") == n,
    )
    .await;
    router
}

/// The admin token the tier's routers are started with.
pub(crate) const ADMIN: &str = "engines-admin-token";

/// `GET base/admin/workers` with [`ADMIN`]: the router's worker list.
pub(crate) async fn admin_workers(client: &reqwest::Client, base: &str) -> serde_json::Value {
    client
        .get(format!("{base}/admin/workers"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("the admin API answers")
        .json()
        .await
        .expect("JSON")
}

/// `GET url/metrics` ("" when unreachable).
pub(crate) async fn metrics(client: &reqwest::Client, base: &str) -> String {
    crate::support::metrics_text(client, base).await
}

/// vLLM's own prefix-cache counters over `workers`: (hit tokens, queried
/// tokens).
pub(crate) async fn vllm_prefix_cache(
    client: &reqwest::Client,
    workers: &[&VllmWorker],
) -> (f64, f64) {
    let mut hits = 0.0;
    let mut queries = 0.0;
    for w in workers {
        let text = metrics(client, &w.base).await;
        hits += sum(&text, "vllm:prefix_cache_hits_total");
        queries += sum(&text, "vllm:prefix_cache_queries_total");
    }
    (hits, queries)
}
