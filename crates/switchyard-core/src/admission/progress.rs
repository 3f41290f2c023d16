//! Live progress: tokens generated so far, written by the response path and
//! read by strategies, with no message and no allocation per update.
//!
//! One [`ProgressUpdater`] (not `Clone`: the writer is unique by
//! construction) and any number of [`ProgressReader`]s share one
//! `AtomicU64`. Because the writer is unique, monotonicity is checked on its
//! own copy of the last value and the atomic is written with a plain store,
//! not `fetch_max`: on x86-64 a relaxed store is an ordinary `mov`, where
//! `fetch_max` would be a locked compare-and-swap loop several times dearer.
//!
//! Ordering: `Relaxed` on both sides. The counter publishes no other memory
//! (a reader never dereferences anything based on it), so all it needs is
//! atomicity and per-location coherence, which every ordering gives: a
//! reader sees the values in the order they were written, never a torn or
//! decreasing one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The writing half. Unique: it is neither `Clone` nor `Copy`.
#[derive(Debug)]
pub struct ProgressUpdater {
    cell: Arc<AtomicU64>,
    last: u64,
}

/// A reading half; clone it freely.
#[derive(Clone, Debug)]
pub struct ProgressReader {
    cell: Arc<AtomicU64>,
}

/// A fresh pair at zero (one allocation).
pub fn progress_pair() -> (ProgressUpdater, ProgressReader) {
    let cell = Arc::new(AtomicU64::new(0));
    (
        ProgressUpdater {
            cell: Arc::clone(&cell),
            last: 0,
        },
        ProgressReader { cell },
    )
}

impl ProgressUpdater {
    /// Records `generated` tokens so far; a smaller value than the last one
    /// is ignored, so readers only ever see the count grow.
    #[inline]
    pub fn set(&mut self, generated: u64) {
        if generated > self.last {
            self.last = generated;
            self.cell.store(generated, Ordering::Relaxed);
        }
    }

    /// Adds `tokens` to the count (saturating).
    #[inline]
    pub fn advance(&mut self, tokens: u64) {
        self.set(self.last.saturating_add(tokens));
    }

    /// The last value written.
    #[inline]
    pub fn get(&self) -> u64 {
        self.last
    }

    /// Another reader of this updater's counter.
    pub fn reader(&self) -> ProgressReader {
        ProgressReader {
            cell: Arc::clone(&self.cell),
        }
    }
}

impl ProgressReader {
    /// Tokens generated so far.
    #[inline]
    pub fn read(&self) -> u64 {
        self.cell.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_see_the_updaters_count_and_it_never_decreases() {
        let (mut up, reader) = progress_pair();
        let other = reader.clone();
        assert_eq!(reader.read(), 0);
        up.set(5);
        up.advance(2);
        assert_eq!(reader.read(), 7);
        up.set(3);
        assert_eq!(other.read(), 7);
        assert_eq!(up.get(), 7);
        assert_eq!(up.reader().read(), 7);
    }

    #[test]
    fn a_reader_on_another_thread_sees_a_monotonic_count() {
        let (mut up, reader) = progress_pair();
        let handle = std::thread::spawn(move || {
            let mut last = 0;
            for _ in 0..100_000 {
                let v = reader.read();
                assert!(v >= last);
                last = v;
            }
        });
        for i in 0..100_000 {
            up.set(i);
        }
        handle.join().unwrap();
    }
}
