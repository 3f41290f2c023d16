//! What the server's integration tests share: `/metrics` and waits that
//! poll a condition up to a deadline instead of sleeping a fixed time.

use std::time::{Duration, Instant};

/// How long a condition that a healthy run meets in a second or two may
/// take before the test fails: a slow or shared machine makes a test
/// slower, never red.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// `GET base/metrics` as text ("" when unreachable).
pub(crate) async fn metrics_text(client: &reqwest::Client, base: &str) -> String {
    match client.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// One sample of a Prometheus text, by its exact series name.
pub(crate) fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Polls `condition` every 10 ms until it holds; panics naming `what` when
/// `within` passes first.
pub(crate) async fn wait_for(
    what: &str,
    within: Duration,
    mut condition: impl AsyncFnMut() -> bool,
) {
    let start = Instant::now();
    while !condition().await {
        assert!(
            start.elapsed() < within,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
