//! Modeled remaining prefill work of one worker.
//!
//! Each active prefill carries its uncached token count and, when the driver
//! knows one, an expected duration (a hint computed at admission). Time is
//! measured from an **anchor**: the moment the oldest active prefill became
//! the front of the queue.
//!
//! - Remaining time is `max(0, Σ durations − (now − anchor))`: elapsed time
//!   spills over from the anchor into the prefills behind it.
//! - Token load decays at the anchor's rate over the whole backlog:
//!   `Σ tokens − ⌊anchor_tokens · elapsed / anchor_duration⌋`, floored at 0.
//! - Removing the anchor re-anchors the next prefill at the removal time.
//!   Removing a modeled prefill behind the anchor shifts the anchor forward by
//!   its duration (never past the removal time): the engine spent that time on
//!   it, not on the backlog.
//! - When any active prefill lacks a hint, the remaining time is
//!   [`MissingExpectedDuration`] and token load decays the anchor alone.

use crate::maps::{map_bytes, FxHashMap};
use crate::types::RequestId;
use std::collections::VecDeque;

/// The modeled remaining prefill time is unknown because an active prefill
/// came without an expected duration. An outcome, not a fault: callers fall
/// back to token load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("an active prefill has no expected duration")]
pub struct MissingExpectedDuration;

#[derive(Clone, Copy, Debug, PartialEq)]
struct PrefillState {
    tokens: u64,
    duration_ms: Option<f64>,
}

/// Active prefills of one worker, in arrival order.
#[derive(Clone, Debug, Default)]
pub(crate) struct PrefillTracker {
    /// Arrival order; may hold ids already removed from behind the front,
    /// skipped when they reach it.
    order: VecDeque<RequestId>,
    states: FxHashMap<RequestId, PrefillState>,
    tokens_sum: u64,
    modeled_ms_sum: f64,
    unmodeled: usize,
    anchor: Option<(RequestId, f64)>,
}

/// A copy of a worker's prefill backlog at one moment, enough to evaluate
/// the decay rules at any later `now_ms` without the tracker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillSummary {
    /// Active prefills.
    pub count: usize,
    /// Uncached prompt tokens of all active prefills.
    pub tokens_sum: u64,
    /// Sum of the expected durations that are known.
    pub modeled_ms_sum: f64,
    /// Active prefills without an expected duration.
    pub unmodeled: usize,
    /// Tokens of the anchor prefill.
    pub anchor_tokens: u64,
    /// Expected duration of the anchor prefill, if known.
    pub anchor_duration_ms: Option<f64>,
    /// When the anchor became the front.
    pub anchor_since_ms: f64,
}

impl PrefillSummary {
    /// Modeled remaining prefill time at `now_ms`, or
    /// [`MissingExpectedDuration`] when any active prefill lacks a hint.
    pub fn remaining_ms_at(&self, now_ms: f64) -> Result<f64, MissingExpectedDuration> {
        if self.count == 0 {
            return Ok(0.0);
        }
        if self.unmodeled > 0 {
            return Err(MissingExpectedDuration);
        }
        let elapsed = (now_ms - self.anchor_since_ms).max(0.0);
        Ok((self.modeled_ms_sum - elapsed).max(0.0))
    }

    /// Uncached prefill tokens still to compute at `now_ms`, by the decay
    /// rules in the module docs.
    pub fn active_tokens_at(&self, now_ms: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let elapsed = (now_ms - self.anchor_since_ms).max(0.0);
        let others = self.tokens_sum - self.anchor_tokens;
        match self.anchor_duration_ms {
            // An anchor with no hint does not decay.
            None => self.tokens_sum,
            // A zero-length anchor is done the moment it starts.
            Some(d) if d <= 0.0 => others,
            Some(d) if self.unmodeled == 0 => {
                let done = (self.anchor_tokens as f64 * elapsed / d).floor() as u64;
                self.tokens_sum.saturating_sub(done)
            }
            Some(d) => {
                let left = (1.0 - elapsed / d).clamp(0.0, 1.0);
                others + (self.anchor_tokens as f64 * left).ceil() as u64
            }
        }
    }
}

impl PrefillTracker {
    /// Starts tracking a prefill; a duplicate id is ignored. Returns whether
    /// it was added.
    pub(crate) fn insert(
        &mut self,
        id: RequestId,
        tokens: u64,
        duration_ms: Option<f64>,
        now_ms: f64,
    ) -> bool {
        if self.states.contains_key(&id) {
            return false;
        }
        // A negative or non-finite hint is no hint.
        let duration_ms = duration_ms.filter(|d| d.is_finite() && *d >= 0.0);
        self.states.insert(
            id,
            PrefillState {
                tokens,
                duration_ms,
            },
        );
        self.order.push_back(id);
        self.tokens_sum += tokens;
        match duration_ms {
            Some(d) => self.modeled_ms_sum += d,
            None => self.unmodeled += 1,
        }
        if self.anchor.is_none() {
            self.anchor = Some((id, now_ms));
        }
        true
    }

    /// Stops tracking a prefill (completed or freed) at `now_ms`; unknown ids
    /// are ignored. Returns whether it was tracked.
    pub(crate) fn remove(&mut self, id: RequestId, now_ms: f64) -> bool {
        let Some(state) = self.states.remove(&id) else {
            return false;
        };
        self.tokens_sum -= state.tokens;
        match state.duration_ms {
            Some(d) => self.modeled_ms_sum -= d,
            None => self.unmodeled -= 1,
        }
        if self.states.is_empty() {
            // Exact zero, free of float drift, and no stale order.
            self.modeled_ms_sum = 0.0;
            self.order.clear();
            self.anchor = None;
            return true;
        }
        match self.anchor {
            Some((anchor, _)) if anchor == id => {
                while let Some(front) = self.order.front() {
                    if self.states.contains_key(front) {
                        break;
                    }
                    self.order.pop_front();
                }
                self.anchor = self.order.front().map(|&front| (front, now_ms));
            }
            Some((anchor, since)) => {
                if let Some(d) = state.duration_ms {
                    self.anchor = Some((anchor, (since + d).min(now_ms).max(since)));
                }
            }
            None => {}
        }
        if self.order.len() > 2 * self.states.len() + 16 {
            let states = &self.states;
            self.order.retain(|id| states.contains_key(id));
        }
        true
    }

    pub(crate) fn summary(&self) -> PrefillSummary {
        let (anchor_tokens, anchor_duration_ms, anchor_since_ms) = match self.anchor {
            Some((id, since)) => {
                let s = self.states[&id];
                (s.tokens, s.duration_ms, since)
            }
            None => (0, None, 0.0),
        };
        PrefillSummary {
            count: self.states.len(),
            tokens_sum: self.tokens_sum,
            modeled_ms_sum: self.modeled_ms_sum,
            unmodeled: self.unmodeled,
            anchor_tokens,
            anchor_duration_ms,
            anchor_since_ms,
        }
    }

    /// Heap bytes: the arrival-order queue and the per-request states.
    pub(crate) fn estimated_bytes(&self) -> usize {
        self.order.capacity() * std::mem::size_of::<RequestId>() + map_bytes(&self.states)
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.states.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: f64 = 1000.0;

    fn r(n: u128) -> RequestId {
        RequestId(n)
    }

    #[test]
    fn remaining_time_is_the_backlog_minus_time_since_the_anchor() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 60, Some(6.0 * S), 2.0 * S);
        let s = t.summary();
        assert_eq!(s.remaining_ms_at(2.0 * S), Ok(14_000.0));
        // Past the anchor's own 10 s the elapsed time spills into r2.
        assert_eq!(s.remaining_ms_at(12.0 * S), Ok(4_000.0));
        assert_eq!(s.remaining_ms_at(17.0 * S), Ok(0.0));
    }

    #[test]
    fn token_load_decays_over_the_backlog_at_the_anchors_rate() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 60, Some(6.0 * S), 0.0);
        let s = t.summary();
        assert_eq!(s.active_tokens_at(2.0 * S), 140);
        assert_eq!(s.active_tokens_at(5.0 * S), 110);
        assert_eq!(s.active_tokens_at(12.0 * S), 40);
        assert_eq!(s.active_tokens_at(100.0 * S), 0);
    }

    #[test]
    fn removing_the_anchor_re_anchors_the_next_prefill_at_removal_time() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 40, Some(8.0 * S), 0.0);
        t.remove(r(1), 3.0 * S);
        let s = t.summary();
        assert_eq!(s.active_tokens_at(3.0 * S), 40);
        assert_eq!(s.active_tokens_at(5.0 * S), 30);
        assert_eq!(s.remaining_ms_at(5.0 * S), Ok(6_000.0));
    }

    #[test]
    fn removing_a_prefill_behind_the_anchor_shifts_the_anchor_by_its_duration() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 40, Some(4.0 * S), 0.0);
        t.remove(r(2), 5.0 * S);
        let s = t.summary();
        assert_eq!(s.anchor_since_ms, 4.0 * S);
        assert_eq!(s.active_tokens_at(5.0 * S), 90);
        assert_eq!(s.remaining_ms_at(5.0 * S), Ok(9_000.0));
    }

    #[test]
    fn the_anchor_shift_is_capped_at_removal_time() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 40, Some(4.0 * S), 0.0);
        t.remove(r(2), 2.0 * S);
        let s = t.summary();
        assert_eq!(s.anchor_since_ms, 2.0 * S);
        assert_eq!(s.active_tokens_at(2.0 * S), 100);
        assert_eq!(s.remaining_ms_at(2.0 * S), Ok(10_000.0));
    }

    #[test]
    fn removing_an_unmodeled_prefill_behind_the_anchor_does_not_shift_it() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 40, None, 0.0);
        t.remove(r(2), 5.0 * S);
        assert_eq!(t.summary().anchor_since_ms, 0.0);
    }

    #[test]
    fn a_prefill_without_a_hint_makes_remaining_time_unknown() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 60, None, 0.0);
        assert_eq!(
            t.summary().remaining_ms_at(1.0),
            Err(MissingExpectedDuration)
        );
        t.remove(r(2), 1.0);
        assert!(t.summary().remaining_ms_at(1.0).is_ok());
    }

    #[test]
    fn without_hints_only_the_anchor_decays() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(10.0 * S), 0.0);
        t.insert(r(2), 60, None, 0.0);
        let s = t.summary();
        assert_eq!(s.active_tokens_at(5.0 * S), 110);
        assert_eq!(s.active_tokens_at(12.0 * S), 60);
    }

    #[test]
    fn an_anchor_without_a_hint_does_not_decay() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, None, 0.0);
        t.insert(r(2), 60, Some(1.0), 0.0);
        assert_eq!(t.summary().active_tokens_at(1e9), 160);
    }

    #[test]
    fn a_zero_duration_anchor_counts_only_itself_as_done() {
        let mut t = PrefillTracker::default();
        t.insert(r(1), 100, Some(0.0), 0.0);
        t.insert(r(2), 60, Some(5.0 * S), 0.0);
        let s = t.summary();
        assert_eq!(s.active_tokens_at(0.0), 60);
        assert_eq!(s.active_tokens_at(1e9), 60);
    }

    #[test]
    fn duplicates_and_unknown_removals_are_harmless() {
        let mut t = PrefillTracker::default();
        assert!(t.insert(r(1), 100, Some(1.0), 0.0));
        assert!(!t.insert(r(1), 999, Some(1.0), 0.0));
        assert!(!t.remove(r(2), 0.0));
        assert!(t.remove(r(1), 0.0));
        assert!(!t.remove(r(1), 0.0));
        assert!(t.is_empty());
        assert_eq!(t.summary(), PrefillSummary::default());
    }

    #[test]
    fn an_empty_backlog_has_nothing_remaining() {
        let s = PrefillTracker::default().summary();
        assert_eq!(s.remaining_ms_at(5.0), Ok(0.0));
        assert_eq!(s.active_tokens_at(5.0), 0);
    }
}
