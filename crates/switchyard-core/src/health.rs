//! Passive failure detection: one [`CircuitBreaker`] per worker.
//!
//! The driver reports what happened to requests on a worker — a success
//! (first token or completion), a failure (connect refused, reset, 5xx,
//! first-token timeout), a dispatch, or a request that ended with no verdict
//! — and the breaker answers whether the worker may take new requests.
//! Time is an argument (`now_ms`); nothing here reads a clock.
//!
//! ```text
//!            failure_threshold consecutive failures
//!   Closed ───────────────────────────────────────────► Open { until }
//!     ▲                                                  │ now ≥ until
//!     │ success                                          ▼
//!     └──────────────────────────────────────────── HalfOpen (one probe)
//!                         failure: Open again, cooldown doubled (capped)
//! ```
//!
//! - **Closed** admits everything; a success resets the failure streak.
//! - **Open** admits nothing for a cooldown of
//!   `min(cooldown_ms · 2^(opens − 1), max_cooldown_ms)`, where `opens`
//!   counts consecutive openings without a close in between. Late results
//!   of requests sent before the circuit opened change nothing.
//! - **Generations.** Every opening (and every [`CircuitBreaker::reset`])
//!   starts a new generation; a request remembers the generation it was
//!   dispatched in ([`CircuitBreaker::generation`]) and reports its result
//!   with it ([`CircuitBreaker::on_result`]). A result of an older
//!   generation changes nothing, whatever the state: it can neither close
//!   a half-open circuit nor free its probe slot, so only the probe's own
//!   verdict (the one request dispatched in the half-open generation)
//!   decides.
//! - **HalfOpen** admits a single probe request. Its success closes the
//!   circuit (and resets the backoff); its failure re-opens it with the next
//!   cooldown; if it ends with no verdict (the client went away) the probe
//!   slot is free again.

use serde::{Deserialize, Serialize};

/// Settings of every worker's breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitConfig {
    /// Consecutive failures (no success in between) that open the circuit.
    pub failure_threshold: u32,
    /// First cooldown, in milliseconds.
    pub cooldown_ms: u64,
    /// Longest cooldown, in milliseconds (the doubling stops there).
    pub max_cooldown_ms: u64,
}

impl Default for CircuitConfig {
    /// Three failures: one or two in a row are as often a bad request, a
    /// client reset or a single slow prefill as a sick worker, while three
    /// with no success between them arrive within milliseconds under load
    /// when the worker really is down. Five seconds, doubling to a minute:
    /// long enough for a restarting engine not to be hammered, short enough
    /// that a transient blip costs little capacity.
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            cooldown_ms: 5_000,
            max_cooldown_ms: 60_000,
        }
    }
}

/// Why a [`CircuitConfig`] was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CircuitConfigError {
    /// A threshold of zero would open on no evidence.
    #[error("circuit failure_threshold must be at least 1")]
    Threshold,
    /// A zero cooldown, or a cap below the first cooldown.
    #[error("circuit cooldown_ms ({cooldown_ms}) must be positive and at most max_cooldown_ms ({max_cooldown_ms})")]
    Cooldown {
        /// The first cooldown.
        cooldown_ms: u64,
        /// The cap.
        max_cooldown_ms: u64,
    },
}

impl CircuitConfig {
    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), CircuitConfigError> {
        if self.failure_threshold == 0 {
            return Err(CircuitConfigError::Threshold);
        }
        if self.cooldown_ms == 0 || self.max_cooldown_ms < self.cooldown_ms {
            return Err(CircuitConfigError::Cooldown {
                cooldown_ms: self.cooldown_ms,
                max_cooldown_ms: self.max_cooldown_ms,
            });
        }
        Ok(())
    }

    /// Cooldown after the `opens`-th consecutive opening (1-based).
    pub fn cooldown_for(&self, opens: u32) -> u64 {
        let doublings = opens.saturating_sub(1).min(63);
        self.cooldown_ms
            .saturating_mul(1u64 << doublings)
            .min(self.max_cooldown_ms)
    }
}

/// The three states, as the `switchyard_circuit_state` gauge exports them
/// (`as u8`: 0 closed, 1 open, 2 half-open).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitState {
    /// Requests flow.
    Closed = 0,
    /// No requests until the cooldown ends.
    Open = 1,
    /// One probe request at a time.
    HalfOpen = 2,
}

impl CircuitState {
    /// Every state, in gauge order.
    pub const ALL: [CircuitState; 3] = [
        CircuitState::Closed,
        CircuitState::Open,
        CircuitState::HalfOpen,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }
}

/// What the driver observed about one request on the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CircuitEvent {
    /// A request was sent to the worker (a probe, when half-open).
    Dispatched,
    /// A request's first token or completion arrived.
    Success,
    /// A request failed because of the worker.
    Failure,
    /// A request ended with neither a success nor a failure reported
    /// (cancelled by its client).
    Released,
}

/// The state changes one call caused, oldest first (at most two: the
/// cooldown's end, then the event's own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transitions([Option<CircuitState>; 2]);

impl Transitions {
    fn push(&mut self, to: CircuitState) {
        if let Some(slot) = self.0.iter_mut().find(|s| s.is_none()) {
            *slot = Some(to);
        }
    }

    /// The states entered, in order.
    pub fn iter(&self) -> impl Iterator<Item = CircuitState> + '_ {
        self.0.iter().flatten().copied()
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.0[0].is_none()
    }
}

/// One worker's breaker. Pure: every method takes the time and returns
/// what changed; [`CircuitBreaker::admits`] is the only question the
/// selector needs answered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CircuitBreaker {
    state: CircuitState,
    /// Consecutive failures while closed.
    failures: u32,
    /// Consecutive openings without a close (drives the backoff).
    opens: u32,
    /// When an open circuit turns half-open.
    open_until_ms: f64,
    /// A half-open probe is in flight.
    probing: bool,
    /// Bumped at every opening and reset: results of requests dispatched
    /// in an earlier generation are late and ignored.
    generation: u64,
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        Self::new()
    }
}

impl CircuitBreaker {
    /// A closed circuit with no history.
    pub const fn new() -> Self {
        Self {
            state: CircuitState::Closed,
            failures: 0,
            opens: 0,
            open_until_ms: 0.0,
            probing: false,
            generation: 0,
        }
    }

    /// The current generation: a request dispatched now reports its
    /// result with it ([`Self::on_result`]).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Starts afresh: closed, no history, and a new generation so that
    /// results of requests dispatched before the reset change nothing.
    pub fn reset(&mut self) {
        *self = Self {
            generation: self.generation.wrapping_add(1),
            ..Self::new()
        };
    }

    /// The current state (as of the last call; see [`Self::poll`]).
    pub fn state(&self) -> CircuitState {
        self.state
    }

    /// Consecutive failures counted while closed.
    pub fn consecutive_failures(&self) -> u32 {
        self.failures
    }

    /// When an open circuit turns half-open, if it is open.
    pub fn open_until_ms(&self) -> Option<f64> {
        (self.state == CircuitState::Open).then_some(self.open_until_ms)
    }

    /// Whether the worker may take a new request now (call [`Self::poll`]
    /// first for the cooldown to end on time).
    pub fn admits(&self) -> bool {
        match self.state {
            CircuitState::Closed => true,
            CircuitState::Open => false,
            CircuitState::HalfOpen => !self.probing,
        }
    }

    /// Ends the cooldown if it is over.
    pub fn poll(&mut self, now_ms: f64) -> Transitions {
        let mut changed = Transitions::default();
        if self.state == CircuitState::Open && now_ms >= self.open_until_ms {
            self.state = CircuitState::HalfOpen;
            self.probing = false;
            changed.push(CircuitState::HalfOpen);
        }
        changed
    }

    /// Applies one observation of a request dispatched in the current
    /// generation at `now_ms` (after ending a cooldown that is over); a
    /// dispatch is always of the current generation.
    pub fn on_event(
        &mut self,
        event: CircuitEvent,
        now_ms: f64,
        config: &CircuitConfig,
    ) -> Transitions {
        self.on_result(event, self.generation, now_ms, config)
    }

    /// Applies one observation of a request dispatched in `generation`
    /// at `now_ms` (after ending a cooldown that is over). An observation
    /// of an earlier generation is late: it changes nothing.
    pub fn on_result(
        &mut self,
        event: CircuitEvent,
        generation: u64,
        now_ms: f64,
        config: &CircuitConfig,
    ) -> Transitions {
        let mut changed = self.poll(now_ms);
        if generation != self.generation {
            return changed;
        }
        match (self.state, event) {
            (CircuitState::Closed, CircuitEvent::Success) => self.failures = 0,
            (CircuitState::Closed, CircuitEvent::Failure) => {
                self.failures = self.failures.saturating_add(1);
                if self.failures >= config.failure_threshold {
                    self.open(now_ms, config);
                    changed.push(CircuitState::Open);
                }
            }
            (CircuitState::HalfOpen, CircuitEvent::Dispatched) => self.probing = true,
            (CircuitState::HalfOpen, CircuitEvent::Released) => self.probing = false,
            (CircuitState::HalfOpen, CircuitEvent::Success) => {
                // Closed with no history; the generation goes on (only the
                // probe was dispatched in it).
                *self = Self {
                    generation: self.generation,
                    ..Self::new()
                };
                changed.push(CircuitState::Closed);
            }
            (CircuitState::HalfOpen, CircuitEvent::Failure) => {
                self.open(now_ms, config);
                changed.push(CircuitState::Open);
            }
            (CircuitState::Closed, CircuitEvent::Dispatched | CircuitEvent::Released)
            | (CircuitState::Open, _) => {}
        }
        changed
    }

    fn open(&mut self, now_ms: f64, config: &CircuitConfig) {
        self.opens = self.opens.saturating_add(1);
        self.generation = self.generation.wrapping_add(1);
        self.state = CircuitState::Open;
        self.failures = 0;
        self.probing = false;
        self.open_until_ms = now_ms + config.cooldown_for(self.opens) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use CircuitEvent::*;

    const CONFIG: CircuitConfig = CircuitConfig {
        failure_threshold: 3,
        cooldown_ms: 100,
        max_cooldown_ms: 350,
    };

    fn states(t: Transitions) -> Vec<CircuitState> {
        t.iter().collect()
    }

    fn opened_at(now: f64) -> CircuitBreaker {
        let mut b = CircuitBreaker::new();
        for _ in 0..3 {
            b.on_event(Failure, now, &CONFIG);
        }
        assert_eq!(b.state(), CircuitState::Open);
        b
    }

    #[test]
    fn a_closed_circuit_admits_and_fewer_failures_than_the_threshold_keep_it_closed() {
        let mut b = CircuitBreaker::new();
        assert!(b.admits());
        assert!(b.on_event(Failure, 0.0, &CONFIG).is_empty());
        assert!(b.on_event(Failure, 1.0, &CONFIG).is_empty());
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.admits());
    }

    #[test]
    fn a_success_resets_the_failure_streak() {
        let mut b = CircuitBreaker::new();
        b.on_event(Failure, 0.0, &CONFIG);
        b.on_event(Failure, 0.0, &CONFIG);
        b.on_event(Success, 0.0, &CONFIG);
        assert_eq!(b.consecutive_failures(), 0);
        b.on_event(Failure, 0.0, &CONFIG);
        b.on_event(Failure, 0.0, &CONFIG);
        assert_eq!(b.state(), CircuitState::Closed);
    }

    #[test]
    fn the_threshold_th_consecutive_failure_opens_the_circuit_for_the_cooldown() {
        let mut b = CircuitBreaker::new();
        b.on_event(Failure, 0.0, &CONFIG);
        b.on_event(Failure, 0.0, &CONFIG);
        let t = b.on_event(Failure, 10.0, &CONFIG);
        assert_eq!(states(t), vec![CircuitState::Open]);
        assert!(!b.admits());
        assert_eq!(b.open_until_ms(), Some(110.0));
        assert!(b.poll(109.9).is_empty());
        assert!(!b.admits());
    }

    #[test]
    fn an_open_circuit_ignores_late_results() {
        let mut b = opened_at(0.0);
        assert!(b.on_event(Success, 50.0, &CONFIG).is_empty());
        assert!(b.on_event(Failure, 50.0, &CONFIG).is_empty());
        assert!(b.on_event(Released, 50.0, &CONFIG).is_empty());
        assert_eq!(
            b.open_until_ms(),
            Some(100.0),
            "the cooldown is not extended"
        );
    }

    #[test]
    fn after_the_cooldown_the_circuit_is_half_open_and_admits_one_probe() {
        let mut b = opened_at(0.0);
        assert_eq!(states(b.poll(100.0)), vec![CircuitState::HalfOpen]);
        assert!(b.admits());
        b.on_event(Dispatched, 101.0, &CONFIG);
        assert!(
            !b.admits(),
            "a second request waits for the probe's verdict"
        );
    }

    #[test]
    fn a_probe_that_ends_without_a_verdict_frees_the_probe_slot() {
        let mut b = opened_at(0.0);
        b.poll(100.0);
        b.on_event(Dispatched, 101.0, &CONFIG);
        assert!(b.on_event(Released, 102.0, &CONFIG).is_empty());
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert!(b.admits());
    }

    #[test]
    fn a_successful_probe_closes_the_circuit_and_resets_the_backoff() {
        let mut b = opened_at(0.0);
        b.poll(100.0);
        b.on_event(Dispatched, 101.0, &CONFIG);
        assert_eq!(
            states(b.on_event(Success, 150.0, &CONFIG)),
            vec![CircuitState::Closed]
        );
        assert!(b.admits());
        assert_eq!(b.consecutive_failures(), 0);
        // The next opening starts from the first cooldown again.
        let b = opened_at(1000.0);
        assert_eq!(b.open_until_ms(), Some(1100.0));
    }

    #[test]
    fn a_failed_probe_reopens_with_a_doubled_cooldown_up_to_the_cap() {
        let mut b = opened_at(0.0);
        let mut now = 0.0;
        for expected in [200.0, 350.0, 350.0] {
            now = b.open_until_ms().unwrap();
            b.poll(now);
            b.on_event(Dispatched, now, &CONFIG);
            assert_eq!(
                states(b.on_event(Failure, now, &CONFIG)),
                vec![CircuitState::Open]
            );
            assert_eq!(b.open_until_ms(), Some(now + expected));
        }
        assert!(now > 0.0);
    }

    #[test]
    fn an_event_after_the_cooldown_first_ends_it_then_applies() {
        let mut b = opened_at(0.0);
        // No poll: the failure at 200 finds the circuit half-open first.
        let t = b.on_event(Failure, 200.0, &CONFIG);
        assert_eq!(states(t), vec![CircuitState::HalfOpen, CircuitState::Open]);
        assert_eq!(b.open_until_ms(), Some(400.0));
    }

    #[test]
    fn dispatches_and_releases_do_nothing_to_a_closed_circuit() {
        let mut b = CircuitBreaker::new();
        b.on_event(Failure, 0.0, &CONFIG);
        assert!(b.on_event(Dispatched, 0.0, &CONFIG).is_empty());
        assert!(b.on_event(Released, 0.0, &CONFIG).is_empty());
        assert_eq!(b.consecutive_failures(), 1);
    }

    #[test]
    fn a_late_success_from_before_the_opening_does_not_close_a_half_open_circuit() {
        let mut b = CircuitBreaker::new();
        let before = b.generation();
        b.on_event(Dispatched, 0.0, &CONFIG);
        for _ in 0..3 {
            b.on_event(Failure, 0.0, &CONFIG);
        }
        b.poll(100.0);
        b.on_event(Dispatched, 100.0, &CONFIG);
        assert!(b.on_result(Success, before, 101.0, &CONFIG).is_empty());
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert!(!b.admits(), "the probe is still in flight");
        assert_eq!(
            states(b.on_result(Success, b.generation(), 102.0, &CONFIG)),
            vec![CircuitState::Closed],
            "the probe's own verdict decides"
        );
    }

    #[test]
    fn a_late_release_from_before_the_opening_does_not_free_the_probe_slot() {
        let before = CircuitBreaker::new().generation();
        let mut b = opened_at(0.0);
        assert_ne!(b.generation(), before, "an opening starts a generation");
        b.poll(100.0);
        b.on_event(Dispatched, 100.0, &CONFIG);
        assert!(b.on_result(Released, before, 101.0, &CONFIG).is_empty());
        assert!(!b.admits(), "one probe at a time");
        assert!(b.on_result(Failure, before, 101.0, &CONFIG).is_empty());
        assert_eq!(b.state(), CircuitState::HalfOpen);
    }

    #[test]
    fn a_reset_closes_the_circuit_and_makes_every_earlier_result_late() {
        let mut b = opened_at(0.0);
        let before = b.generation();
        b.reset();
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.admits());
        for _ in 0..5 {
            assert!(b.on_result(Failure, before, 1.0, &CONFIG).is_empty());
        }
        assert_eq!(b.consecutive_failures(), 0);
    }

    #[test]
    fn bad_settings_are_refused() {
        let zero = CircuitConfig {
            failure_threshold: 0,
            ..CircuitConfig::default()
        };
        assert_eq!(zero.validate(), Err(CircuitConfigError::Threshold));
        let inverted = CircuitConfig {
            cooldown_ms: 10,
            max_cooldown_ms: 5,
            ..CircuitConfig::default()
        };
        assert!(inverted.validate().is_err());
        assert!(CircuitConfig::default().validate().is_ok());
        assert_eq!(CircuitConfig::default().cooldown_for(u32::MAX), 60_000);
    }

    /// The specification written as literally as possible: the state is
    /// recomputed from the whole history of observations.
    #[derive(Debug, Default)]
    struct Reference {
        /// Each observation with the generation of the request it is about:
        /// the number of openings before that request was dispatched.
        history: Vec<(CircuitEvent, f64, u64)>,
    }

    #[derive(Debug, PartialEq)]
    enum RefState {
        Closed { streak: u32 },
        Open { until: f64, opens: u32 },
        HalfOpen { opens: u32, probing: bool },
    }

    impl Reference {
        /// The state at `now` and the generation (openings so far).
        fn replay(&self, now: f64, c: &CircuitConfig) -> (RefState, u64) {
            let mut s = RefState::Closed { streak: 0 };
            let mut openings = 0u64;
            let end_cooldown = |s: RefState, t: f64| match s {
                RefState::Open { until, opens } if t >= until => RefState::HalfOpen {
                    opens,
                    probing: false,
                },
                other => other,
            };
            for &(event, t, generation) in &self.history {
                s = end_cooldown(s, t);
                if generation != openings {
                    // About a request dispatched before the last opening.
                    continue;
                }
                let was_open = matches!(s, RefState::Open { .. });
                s = match (s, event) {
                    (RefState::Closed { streak }, Failure) if streak + 1 >= c.failure_threshold => {
                        RefState::Open {
                            until: t + c.cooldown_for(1) as f64,
                            opens: 1,
                        }
                    }
                    (RefState::Closed { streak }, Failure) => {
                        RefState::Closed { streak: streak + 1 }
                    }
                    (RefState::Closed { .. }, Success) => RefState::Closed { streak: 0 },
                    (RefState::HalfOpen { .. }, Success) => RefState::Closed { streak: 0 },
                    (RefState::HalfOpen { opens, .. }, Failure) => RefState::Open {
                        until: t + c.cooldown_for(opens + 1) as f64,
                        opens: opens + 1,
                    },
                    (RefState::HalfOpen { opens, .. }, Dispatched) => RefState::HalfOpen {
                        opens,
                        probing: true,
                    },
                    (RefState::HalfOpen { opens, .. }, Released) => RefState::HalfOpen {
                        opens,
                        probing: false,
                    },
                    (other, _) => other,
                };
                if !was_open && matches!(s, RefState::Open { .. }) {
                    openings += 1;
                }
            }
            (end_cooldown(s, now), openings)
        }

        fn state(&self, now: f64, c: &CircuitConfig) -> RefState {
            self.replay(now, c).0
        }

        fn admits(&self, now: f64, c: &CircuitConfig) -> bool {
            match self.state(now, c) {
                RefState::Closed { .. } => true,
                RefState::Open { .. } => false,
                RefState::HalfOpen { probing, .. } => !probing,
            }
        }
    }

    fn event() -> impl Strategy<Value = CircuitEvent> {
        prop_oneof![
            3 => Just(Failure),
            2 => Just(Success),
            2 => Just(Dispatched),
            1 => Just(Released),
        ]
    }

    /// How many openings late a result is (mostly not late).
    fn age() -> impl Strategy<Value = u64> {
        prop_oneof![3 => Just(0u64), 1 => 1u64..3]
    }

    proptest! {
        #[test]
        fn the_breaker_matches_the_reference_model(
            threshold in 1u32..5,
            cooldown in 1u64..200,
            cap_factor in 1u64..6,
            steps in prop::collection::vec((event(), 0u32..150, any::<bool>(), age()), 0..200),
        ) {
            let config = CircuitConfig {
                failure_threshold: threshold,
                cooldown_ms: cooldown,
                max_cooldown_ms: cooldown * cap_factor,
            };
            let mut breaker = CircuitBreaker::new();
            let mut reference = Reference::default();
            let mut now = 0.0;
            let mut last_state = CircuitState::Closed;
            for (event, dt, poll_first, age) in steps {
                now += f64::from(dt);
                if poll_first {
                    for to in breaker.poll(now).iter() {
                        prop_assert_ne!(to, last_state);
                        last_state = to;
                    }
                }
                // A result `age` openings late (a dispatch is never late).
                let current = reference.replay(now, &config).1;
                let generation = match event {
                    Dispatched => current,
                    _ => current.saturating_sub(age),
                };
                prop_assert_eq!(breaker.generation(), current);
                for to in breaker.on_result(event, generation, now, &config).iter() {
                    prop_assert_ne!(to, last_state, "a transition changes the state");
                    last_state = to;
                }
                reference.history.push((event, now, generation));
                prop_assert_eq!(breaker.state(), last_state, "transitions report every change");
                prop_assert_eq!(breaker.admits(), reference.admits(now, &config));
                let expected = match reference.state(now, &config) {
                    RefState::Closed { .. } => CircuitState::Closed,
                    RefState::Open { .. } => CircuitState::Open,
                    RefState::HalfOpen { .. } => CircuitState::HalfOpen,
                };
                prop_assert_eq!(breaker.state(), expected);
                if let (Some(until), RefState::Open { until: r, .. }) =
                    (breaker.open_until_ms(), reference.state(now, &config))
                {
                    prop_assert_eq!(until, r);
                    prop_assert!(until - now <= config.max_cooldown_ms as f64);
                }
            }
        }
    }
}
