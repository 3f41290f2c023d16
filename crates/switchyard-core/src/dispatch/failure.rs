//! Failed attempts, sans I/O: why an attempt failed ([`Failure`]), what
//! a stream generated before it broke ([`Progress`]), and what the request
//! becomes — moved to another worker, resumed from its generated tokens, or
//! given up with a reason ([`GiveUp`]). [`FailureHistory::fail`] is the one
//! place that decides; the server and the simulator hold one history per
//! request and carry out its [`Failed`] verdict with the dispatcher's
//! [`Dispatcher::worker_failed`](super::Dispatcher::worker_failed) and
//! [`Dispatcher::migrate`](super::Dispatcher::migrate).
//!
//! A failure before the first token (connection refused, reset, a 5xx, no
//! first byte in time) retries the client's own request on another worker.
//! A failure mid-stream resumes it: the original prompt's token ids
//! followed by the generated tokens' ids, the output limit reduced by what
//! was generated.
//!
//! A request can fail workers by itself (a prompt that crashes the engine,
//! a prefill slower than the first-token timeout). So that one such
//! request cannot open circuits across the fleet, the second "suspect"
//! failure of a request ([`Failure::request_may_cause`]: a 5xx, an error
//! event, a first-token timeout) is taken as the request's fault
//! ([`request_fault`]): that worker is not reported and the request is
//! not moved again.
//!
//! Whatever the failures, a prompt goes to at most
//! [`MigrationPolicy::max_workers`] workers that received it: a prompt
//! that failed on two workers is probably the prompt's fault, and a third
//! attempt would only spread the damage. A refused connection does not
//! count: the worker never saw the prompt.
//!
//! Memory per request: [`Progress`] keeps the generated ids (4 bytes a
//! token, at most [`Progress::bounded`]'s bound) plus at most
//! [`Progress::text_cap`] bytes of text not yet tokenized; past either
//! bound it stops recording and the stream is no longer resumable.

use serde::{Deserialize, Serialize};

/// Why an attempt failed: the `reason` label of
/// `switchyard_migrations_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The worker refused the connection.
    Connect,
    /// The connection broke, or the body failed, before the first token.
    Reset,
    /// The worker answered 5xx (or an error event as its first event).
    Status5xx,
    /// No headers or first event within the first-token timeout (or a
    /// stream went silent that long).
    Timeout,
    /// The stream broke after tokens had reached the client.
    MidStream,
}

impl Failure {
    /// Every reason, in label order.
    pub const ALL: [Failure; 5] = [
        Failure::Connect,
        Failure::Reset,
        Failure::Status5xx,
        Failure::Timeout,
        Failure::MidStream,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Reset => "reset",
            Failure::Status5xx => "status_5xx",
            Failure::Timeout => "timeout",
            Failure::MidStream => "midstream",
        }
    }

    /// Whether the request itself may cause this failure (a prompt that
    /// makes the engine answer 5xx or an error event, or a prefill slower
    /// than the first-token timeout), as opposed to a refused or broken
    /// connection, which only the worker causes.
    pub fn request_may_cause(self) -> bool {
        matches!(self, Failure::Status5xx | Failure::Timeout)
    }

    /// Index into [`Failure::ALL`].
    pub fn index(self) -> usize {
        Failure::ALL.iter().position(|f| *f == self).unwrap_or(0)
    }

    /// Whether the worker received the prompt before failing: every
    /// failure but a refused connection. Those count toward
    /// `--max-attempt-workers`.
    pub fn reached_worker(self) -> bool {
        self != Failure::Connect
    }
}

/// Why a failed request is not migrated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GiveUp {
    /// The request has used its migrations.
    LimitReached {
        /// The limit.
        limit: u32,
    },
    /// Resuming would prefill more than the limit.
    TooLong {
        /// Prompt plus generated tokens.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The request cannot be resumed mid-stream (several choices, a batch
    /// of prompts, or generated text too long to keep).
    NotResumable(&'static str),
    /// The request failed the same way on two workers: it is taken to be
    /// the request's fault ([`request_fault`]), not the workers'.
    RequestFault,
    /// The request failed on this many workers that received it
    /// (`--max-attempt-workers`): the prompt is the likely cause.
    WorkerLimit {
        /// Workers it failed on.
        workers: u32,
    },
}

impl GiveUp {
    /// The `reason` labels of `switchyard_migrations_refused_total`, in
    /// [`GiveUp::index`] order.
    pub const LABELS: [&'static str; 5] = [
        "limit",
        "too_long",
        "not_resumable",
        "request_fault",
        "worker_limit",
    ];

    /// Index into [`GiveUp::LABELS`].
    pub fn index(&self) -> usize {
        match self {
            GiveUp::LimitReached { .. } => 0,
            GiveUp::TooLong { .. } => 1,
            GiveUp::NotResumable(_) => 2,
            GiveUp::RequestFault => 3,
            GiveUp::WorkerLimit { .. } => 4,
        }
    }

    /// Its metric label.
    pub fn label(&self) -> &'static str {
        Self::LABELS[self.index()]
    }
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUp::LimitReached { limit } => {
                write!(f, "the request failed on {} workers (migration limit {limit})", limit.saturating_add(1))
            }
            GiveUp::TooLong { len, max } => write!(
                f,
                "the stream cannot be resumed: {len} prompt and generated tokens exceed the migration limit of {max}"
            ),
            GiveUp::NotResumable(why) => write!(f, "the stream cannot be resumed: {why}"),
            GiveUp::RequestFault => write!(
                f,
                "the request failed on two workers (5xx, error event or first-token timeout), so it is taken to be the request's fault and not retried"
            ),
            GiveUp::WorkerLimit { workers } => write!(
                f,
                "the request failed on {workers} workers, so it is taken to be the request's fault and not sent to another (--max-attempt-workers)"
            ),
        }
    }
}

/// Migration limits (`serve`'s `--migration-limit`,
/// `--migration-max-seq-len` and `--max-attempt-workers`; the simulator's
/// `migration`). The defaults are both drivers'.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationPolicy {
    /// Migrations allowed per request (0: none).
    pub limit: u32,
    /// Prompt plus generated tokens above which a stream is not resumed.
    pub max_seq_len: u64,
    /// Workers a request may fail on (after they received it) before it
    /// ends: the request is not sent to another one.
    pub max_workers: u32,
}

impl Default for MigrationPolicy {
    /// Three migrations, resumed streams up to 32,768 tokens, two workers
    /// that received the prompt.
    fn default() -> Self {
        Self {
            limit: 3,
            max_seq_len: 32_768,
            max_workers: 2,
        }
    }
}

impl MigrationPolicy {
    /// Whether these are the defaults (left out of a serialized config).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// What to do after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Move the request to another worker.
    Migrate,
    /// Give up; the client gets this explanation.
    GiveUp(GiveUp),
}

/// Where a request was when its attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Nothing has reached the client: the request is retried as it came.
    BeforeFirstToken,
    /// Tokens have reached the client: the request is resumed.
    MidStream,
}

/// Whether a failure is the request's fault: `reason` is one the request
/// may cause ([`Failure::request_may_cause`]) and `earlier_suspects`
/// failures of that kind already happened on other workers. Then the
/// worker is not reported (its circuit stays closed) and the request is
/// answered with the error instead of moving on.
pub fn request_fault(reason: Failure, earlier_suspects: u32) -> bool {
    reason.request_may_cause() && earlier_suspects >= 1
}

/// The migration decision: a pure function of the request's state.
/// `migrations` counts the migrations already made, `failed_workers` the
/// workers that received the request and failed it (this one included).
pub fn decide(
    policy: MigrationPolicy,
    migrations: u32,
    failed_workers: u32,
    phase: Phase,
    prompt_tokens: u64,
    progress: &Progress,
    resumable: Result<(), &'static str>,
) -> Verdict {
    if migrations >= policy.limit {
        return Verdict::GiveUp(GiveUp::LimitReached {
            limit: policy.limit,
        });
    }
    if failed_workers >= policy.max_workers {
        return Verdict::GiveUp(GiveUp::WorkerLimit {
            workers: failed_workers,
        });
    }
    if phase == Phase::MidStream {
        if let Err(why) = resumable {
            return Verdict::GiveUp(GiveUp::NotResumable(why));
        }
        let len = prompt_tokens.saturating_add(progress.generated);
        if len > policy.max_seq_len {
            return Verdict::GiveUp(GiveUp::TooLong {
                len,
                max: policy.max_seq_len,
            });
        }
        if progress.overflowed {
            return Verdict::GiveUp(GiveUp::NotResumable(
                "the generated text outgrew what the router keeps",
            ));
        }
    }
    Verdict::Migrate
}

/// What a stream has generated so far: all a resumed request needs.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Tokens generated (ids when the worker sent them, else one a chunk
    /// with text, as the engines stream one token a chunk).
    pub generated: u64,
    /// Generated token ids known so far, in order.
    ids: Vec<u32>,
    /// Generated text not yet turned into ids (from a worker that sends
    /// no ids); tokenized at the next migration.
    pending_text: String,
    /// Largest `pending_text`, in bytes.
    text_cap: usize,
    /// Most ids kept (`None`: unbounded).
    max_ids: Option<usize>,
    /// Text outgrew `text_cap` or ids outgrew `max_ids`: nothing more is
    /// recorded and the stream can no longer be resumed.
    overflowed: bool,
    /// A choice reported its `finish_reason`. Only the first choice of each
    /// chunk is read, so this means the whole generation is complete only
    /// for a single-choice (resumable) request.
    pub finished: bool,
}

/// Generated ids a stream first makes room for.
const GENERATED_IDS_HINT: usize = 64;

/// Bytes of generated text a stream first makes room for.
const GENERATED_TEXT_HINT: usize = 256;

/// Bytes of not-yet-tokenized generated text kept per token of the
/// migration sequence limit.
pub const TEXT_BYTES_PER_TOKEN: u64 = 32;

impl Progress {
    /// Empty progress that keeps at most `text_cap` bytes of text.
    pub fn new(text_cap: usize) -> Self {
        Self {
            text_cap,
            ..Self::default()
        }
    }

    /// Empty progress that keeps at most `text_cap` bytes of text and
    /// `max_ids` token ids: a stream resumable only while prompt plus
    /// generated tokens fit the migration sequence limit needs no more
    /// than that limit less the prompt.
    pub fn bounded(text_cap: usize, max_ids: usize) -> Self {
        Self {
            text_cap,
            max_ids: Some(max_ids),
            ..Self::default()
        }
    }

    /// What a resumable stream keeps when its prompt has `prompt_len`
    /// tokens and the migration sequence limit is `max_seq_len`: text up
    /// to [`TEXT_BYTES_PER_TOKEN`] a token of the limit, and ids up to the
    /// limit less the prompt (past it the stream cannot resume, so no
    /// more are worth keeping).
    pub fn within_sequence(max_seq_len: u64, prompt_len: usize) -> Self {
        let text_cap = max_seq_len.saturating_mul(TEXT_BYTES_PER_TOKEN);
        let max_ids = max_seq_len.saturating_sub(prompt_len as u64);
        Self::bounded(
            usize::try_from(text_cap).unwrap_or(usize::MAX),
            usize::try_from(max_ids).unwrap_or(usize::MAX),
        )
    }

    /// The bound on kept text, in bytes.
    pub fn text_cap(&self) -> usize {
        self.text_cap
    }

    /// Records one chunk's first choice.
    pub fn observe(&mut self, text: Option<&str>, token_ids: Option<&[u32]>, finish: bool) {
        match token_ids {
            Some(ids) if !ids.is_empty() => {
                self.generated = self.generated.saturating_add(ids.len() as u64);
                self.extend_ids(ids);
            }
            _ => {
                if let Some(text) = text.filter(|t| !t.is_empty()) {
                    self.generated = self.generated.saturating_add(1);
                    if self.pending_text.len().saturating_add(text.len()) > self.text_cap {
                        self.overflow();
                    } else if !self.overflowed {
                        if self.pending_text.capacity() == 0 {
                            // As for ids: room for a short answer at once.
                            let room = text.len().max(GENERATED_TEXT_HINT);
                            self.pending_text.reserve(room.min(self.text_cap));
                        }
                        self.pending_text.push_str(text);
                    }
                }
            }
        }
        self.finished |= finish;
    }

    /// Text still to be tokenized before resuming (taken).
    pub fn take_pending_text(&mut self) -> String {
        std::mem::take(&mut self.pending_text)
    }

    /// Appends ids (streamed, or obtained by tokenizing the pending text),
    /// unless that would pass the bound on kept ids.
    pub fn extend_ids(&mut self, ids: &[u32]) {
        if self.overflowed {
            return;
        }
        let within = self
            .max_ids
            .is_none_or(|max| self.ids.len().saturating_add(ids.len()) <= max);
        if within {
            if self.ids.capacity() == 0 {
                // Room for a short answer's ids at once (256 bytes), not
                // doublings from 4 as the stream goes.
                let room = ids.len().max(GENERATED_IDS_HINT);
                self.ids
                    .reserve(self.max_ids.map_or(room, |max| room.min(max)));
            }
            self.ids.extend_from_slice(ids);
        } else {
            self.overflow();
        }
    }

    /// Stops recording for good and frees what was kept.
    fn overflow(&mut self) {
        self.overflowed = true;
        self.ids = Vec::new();
        self.pending_text = String::new();
    }

    /// Whether recording stopped at a bound (the stream cannot resume).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The generated ids known so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// What one request's failures so far add up to, and the decision on the
/// next ([`Self::fail`]). The driver keeps one per request for its life
/// (across migrations).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailureHistory {
    migrations: u32,
    /// A migration decided and not yet placed: counted once a worker
    /// takes the request ([`Self::take_pending`]).
    pending: Option<Failure>,
    /// Failures so far the request itself may have caused
    /// ([`Failure::request_may_cause`]).
    suspect_failures: u32,
    /// Workers that received the request and failed it
    /// ([`Failure::reached_worker`]).
    failed_workers: u32,
}

/// A failed attempt, as the driver saw it.
#[derive(Debug, Clone, Copy)]
pub struct AttemptFailure<'a> {
    /// Why it failed.
    pub reason: Failure,
    /// Whether tokens had reached the client.
    pub phase: Phase,
    /// The prompt's length in tokens.
    pub prompt_tokens: u64,
    /// What the stream generated before it broke.
    pub progress: &'a Progress,
    /// Whether a resumed request would reproduce this one (mid-stream
    /// only); `Err` says why not, naming fields, never content.
    pub resumable: Result<(), &'static str>,
}

/// What a failed attempt becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    /// Report the failure to the worker's circuit breaker
    /// ([`Dispatcher::worker_failed`](super::Dispatcher::worker_failed)):
    /// not when the failure is taken to be the request's fault.
    pub report_worker: bool,
    /// Move the request, or give up (the driver then aborts it).
    pub verdict: Verdict,
}

impl FailureHistory {
    /// Migrations decided so far.
    pub fn migrations(&self) -> u32 {
        self.migrations
    }

    /// The decision on a failed attempt, recorded: a second failure the
    /// request may have caused is the request's fault (not reported, not
    /// moved); otherwise the worker is reported and [`decide`] says
    /// whether the request moves. A move is pending until
    /// [`Self::take_pending`].
    pub fn fail(&mut self, policy: MigrationPolicy, attempt: AttemptFailure<'_>) -> Failed {
        let reason = attempt.reason;
        if request_fault(reason, self.suspect_failures) {
            return Failed {
                report_worker: false,
                verdict: Verdict::GiveUp(GiveUp::RequestFault),
            };
        }
        if reason.request_may_cause() {
            self.suspect_failures = self.suspect_failures.saturating_add(1);
        }
        if reason.reached_worker() {
            self.failed_workers = self.failed_workers.saturating_add(1);
        }
        let verdict = decide(
            policy,
            self.migrations,
            self.failed_workers,
            attempt.phase,
            attempt.prompt_tokens,
            attempt.progress,
            attempt.resumable,
        );
        if verdict == Verdict::Migrate {
            self.migrations = self.migrations.saturating_add(1);
            self.pending = Some(reason);
        }
        Failed {
            report_worker: true,
            verdict,
        }
    }

    /// The request timed out while a worker had it: whether that is the
    /// worker's failure for its breaker. `fair`: the worker had it for at
    /// least the first-token timeout; not after an earlier suspect
    /// failure (then the request is the likely cause).
    pub fn timeout_reported(&self, fair: bool) -> bool {
        fair && !request_fault(Failure::Timeout, self.suspect_failures)
    }

    /// The reason of the migration decided last, once (count it when a
    /// worker takes the request).
    pub fn take_pending(&mut self) -> Option<Failure> {
        self.pending.take()
    }
}

#[cfg(test)]
#[path = "failure_tests.rs"]
mod tests;
