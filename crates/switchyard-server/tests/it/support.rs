//! What the router's integration tests share, whether the router runs
//! in-process (this crate's tests) or as the `switchyard` binary (whose
//! `tests/it/support.rs` includes this file by `#[path]`): `/metrics`, waits
//! that poll a condition up to a deadline instead of sleeping a fixed time,
//! OpenAI error bodies, scratch files.
//!
//! Deadlines are generous: they bound how long a broken run takes to fail,
//! so a slow or shared machine makes a test slower, never red.

// Two test binaries include this file; each uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};
use switchyard_wire::prometheus::Scrape;

/// How long a condition that a healthy run meets in a second or two may
/// take before the test fails.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// A file named `name` holding `contents` in this test binary's scratch
/// directory (under `target/`), for `--config` and the like.
pub(crate) fn scratch_file(name: &str, contents: &[u8]) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, contents).expect("writing a scratch file");
    path
}

/// The directory of the bundled Qwen3 tokenizer (`data/tokenizers`), for
/// `--tokenizer-dir`: a router told it is the engines' tokenizer resumes
/// streams by token ids without asking the workers.
pub(crate) fn bundled_tokenizer_dir() -> String {
    format!("{}/../../data/tokenizers", env!("CARGO_MANIFEST_DIR"))
}

/// The body of an answer the router gave itself: an OpenAI-style error
/// object with a message and a type (the status is the caller's to check).
pub(crate) async fn openai_error(response: reqwest::Response) -> serde_json::Value {
    let body: serde_json::Value = response.json().await.expect("a JSON error body");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
    body
}

/// `GET base/metrics` as text ("" when unreachable).
pub(crate) async fn metrics_text(client: &reqwest::Client, base: &str) -> String {
    match client.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// One sample of a Prometheus text, by its series as written there
/// (`name` or `name{label="value",...}`, exactly those labels).
pub(crate) fn metric(text: &str, series: &str) -> Option<f64> {
    Scrape::parse(text).series_value(series)
}

/// Sum of every sample of a metric (every label set; 0 without one).
pub(crate) fn metric_sum(text: &str, name: &str) -> f64 {
    Scrape::parse(text).sum(name).unwrap_or(0.0)
}

/// Polls `condition` every 10 ms until it holds, for at most `within`:
/// how long it took, or `None`.
pub(crate) async fn poll(
    within: Duration,
    mut condition: impl AsyncFnMut() -> bool,
) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if condition().await {
            return Some(start.elapsed());
        }
        if start.elapsed() >= within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `condition` holds; panics naming `what` when `within`
/// passes first. Returns how long it took.
pub(crate) async fn wait_for(
    what: &str,
    within: Duration,
    condition: impl AsyncFnMut() -> bool,
) -> Duration {
    poll(within, condition)
        .await
        .unwrap_or_else(|| panic!("timed out after {within:?} waiting for {what}"))
}

/// Waits (up to [`PATIENCE`]) until `check` holds on `base`'s `/metrics`;
/// panics naming `what`, with the last text seen.
pub(crate) async fn wait_metrics(
    client: &reqwest::Client,
    base: &str,
    what: &str,
    check: impl Fn(&str) -> bool,
) {
    let mut last = String::new();
    let met = poll(PATIENCE, async || {
        last = metrics_text(client, base).await;
        check(&last)
    })
    .await;
    assert!(
        met.is_some(),
        "timed out after {PATIENCE:?} waiting for {what}; {base}/metrics:\n{last}"
    );
}
