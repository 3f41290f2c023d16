//! What the KV-event plane's integration tests share: waits that poll a
//! condition up to a deadline instead of sleeping a fixed time.

use std::time::{Duration, Instant};

/// How long a condition that a healthy run meets in well under a second
/// may take before the test fails: a slow or shared machine makes a test
/// slower, never red.
pub(crate) const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `condition` every 10 ms until it holds; panics naming `what` when
/// [`PATIENCE`] passes first.
pub(crate) fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(
            start.elapsed() < PATIENCE,
            "timed out after {PATIENCE:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
