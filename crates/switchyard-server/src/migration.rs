//! Request migration, sans I/O: why an attempt failed, whether the request
//! may move to another worker, what has been generated so far, and the
//! request that resumes it.
//!
//! A failure before the first token (connection refused, reset, a 5xx, no
//! first byte in time) retries the client's own request on another worker.
//! A failure mid-stream re-issues the request as a `/v1/completions` call
//! whose prompt is the original prompt's token ids followed by the
//! generated tokens' ids, with `max_tokens` reduced by what was generated;
//! the stream module rewrites its chunks into the original response's
//! shape. [`decide`] is the one place that says whether to migrate.
//!
//! Generated tokens are recovered from the chunks' `token_ids` when the
//! worker sends them (vLLM's and the sim-worker's `return_token_ids`,
//! which the router asks of every worker it resumes on), otherwise from the
//! streamed text, re-tokenized with the router's tokenizer at migration
//! time. Memory per request: the ids (4 bytes a token, at most the
//! migration sequence limit less the prompt: [`Progress::bounded`]) plus at
//! most [`Progress::text_cap`] bytes of not yet tokenized text. Past either
//! bound the progress stops recording and the stream is no longer
//! resumable.
//!
//! A request can fail workers by itself (a prompt that crashes the engine,
//! a prefill slower than the first-token timeout). So that one such
//! request cannot open circuits across the fleet, the second "suspect"
//! failure of a request ([`Failure::request_may_cause`]: a 5xx, an error
//! event, a first-token timeout) on another worker is taken as the
//! request's fault ([`request_fault`]): that worker is not reported and
//! the request is not moved again.

use serde_json::{Map, Value};

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
}

/// Migration limits (`--migration-limit`, `--migration-max-seq-len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationPolicy {
    /// Migrations allowed per request (0: none).
    pub limit: u32,
    /// Prompt plus generated tokens above which a stream is not resumed.
    pub max_seq_len: u64,
}

/// What to do after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Move the request to another worker.
    Migrate,
    /// Give up; the client gets this explanation.
    GiveUp(GiveUp),
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
        }
    }
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
/// `migrations` counts the migrations already made.
pub fn decide(
    policy: MigrationPolicy,
    migrations: u32,
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

/// Why a request cannot be resumed mid-stream, judged from its body.
pub fn resumable(body: &Value) -> Result<(), &'static str> {
    if body.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1)
        || body
            .get("best_of")
            .and_then(Value::as_u64)
            .is_some_and(|n| n > 1)
    {
        return Err("it asks for several choices");
    }
    if let Some(Value::Array(prompts)) = body.get("prompt") {
        if prompts
            .first()
            .is_some_and(|p| p.is_string() || p.is_array())
        {
            return Err("it has a batch of prompts");
        }
    }
    if body
        .get("logprobs")
        .is_some_and(|l| !l.is_null() && l != &Value::Bool(false))
    {
        return Err("it asks for logprobs");
    }
    Ok(())
}

/// The original request's `max_tokens` (`max_completion_tokens` first for
/// chat), if it set one.
pub fn max_tokens(body: &Value) -> Option<u64> {
    body.get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64))
}

/// Sampling fields carried from the original request into a resumed one;
/// everything else (messages, tools, n, echo, ...) stays behind.
const CARRIED: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "ignore_eos",
    "user",
    "stream_options",
    "session_id",
];

/// The `/v1/completions` body that resumes `original`: its sampling
/// fields, `prompt` = `prompt_ids` (original prompt then generated ids),
/// `max_tokens` = `remaining` (absent when the original set none),
/// streaming, with token ids requested.
pub fn resume_body(original: &Value, prompt_ids: &[u32], remaining: Option<u64>) -> Value {
    let mut body = Map::new();
    if let Some(fields) = original.as_object() {
        for key in CARRIED {
            if let Some(v) = fields.get(*key) {
                body.insert((*key).to_owned(), v.clone());
            }
        }
    }
    body.insert("prompt".into(), Value::from(prompt_ids.to_vec()));
    if let Some(remaining) = remaining {
        body.insert("max_tokens".into(), Value::from(remaining));
    }
    body.insert("stream".into(), Value::Bool(true));
    body.insert("return_token_ids".into(), Value::Bool(true));
    Value::Object(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const POLICY: MigrationPolicy = MigrationPolicy {
        limit: 3,
        max_seq_len: 100,
    };

    #[test]
    fn a_request_migrates_until_its_limit() {
        let p = Progress::new(64);
        for done in 0..3 {
            assert_eq!(
                decide(POLICY, done, Phase::BeforeFirstToken, 10, &p, Ok(())),
                Verdict::Migrate
            );
        }
        assert_eq!(
            decide(POLICY, 3, Phase::MidStream, 10, &p, Ok(())),
            Verdict::GiveUp(GiveUp::LimitReached { limit: 3 })
        );
        let off = MigrationPolicy { limit: 0, ..POLICY };
        assert!(matches!(
            decide(off, 0, Phase::BeforeFirstToken, 10, &p, Ok(())),
            Verdict::GiveUp(_)
        ));
    }

    #[test]
    fn a_stream_longer_than_the_sequence_limit_is_not_resumed() {
        let mut p = Progress::new(64);
        for _ in 0..11 {
            p.observe(None, Some(&[1]), false);
        }
        assert_eq!(
            decide(POLICY, 0, Phase::MidStream, 90, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { len: 101, max: 100 })
        );
        // Before the first token the sequence limit does not apply.
        assert_eq!(
            decide(
                POLICY,
                0,
                Phase::BeforeFirstToken,
                200,
                &Progress::new(8),
                Ok(())
            ),
            Verdict::Migrate
        );
    }

    #[test]
    fn a_request_that_cannot_be_resumed_gives_up_mid_stream_only() {
        let p = Progress::new(64);
        let why = resumable(&json!({"n": 2}));
        assert!(why.is_err());
        assert!(matches!(
            decide(POLICY, 0, Phase::MidStream, 1, &p, why),
            Verdict::GiveUp(GiveUp::NotResumable(_))
        ));
        assert_eq!(
            decide(POLICY, 0, Phase::BeforeFirstToken, 1, &p, why),
            Verdict::Migrate
        );
        assert!(resumable(&json!({"prompt": ["a", "b"]})).is_err());
        assert!(resumable(&json!({"prompt": [[1], [2]]})).is_err());
        assert!(resumable(&json!({"prompt": [1, 2]})).is_ok());
        assert!(resumable(&json!({"messages": [], "n": 1, "logprobs": false})).is_ok());
    }

    #[test]
    fn progress_counts_ids_and_text_chunks_and_bounds_text() {
        let mut p = Progress::new(8);
        p.observe(Some(" a"), None, false);
        p.observe(Some(""), None, false);
        p.observe(Some(" b"), Some(&[7, 8]), false);
        assert_eq!(p.generated, 3);
        assert_eq!(p.ids(), &[7, 8]);
        assert_eq!(p.take_pending_text(), " a");
        p.observe(Some("123456789"), None, true);
        assert!(p.finished);
        assert!(matches!(
            decide(POLICY, 0, Phase::MidStream, 1, &p, Ok(())),
            Verdict::GiveUp(GiveUp::NotResumable(_))
        ));
    }

    #[test]
    fn ids_past_the_sequence_limit_are_not_kept_and_the_stream_is_not_resumable() {
        // Prompt of 90 under a limit of 100: at most 10 generated ids.
        let mut p = Progress::bounded(64, 10);
        for _ in 0..10 {
            p.observe(None, Some(&[1]), false);
        }
        assert!(!p.overflowed());
        assert_eq!(p.ids().len(), 10);
        p.observe(None, Some(&[2, 3]), false);
        assert!(p.overflowed(), "the eleventh id passes the bound");
        assert!(p.ids().is_empty(), "what was kept is freed");
        p.observe(None, Some(&[4]), false);
        assert!(p.ids().is_empty(), "nothing more is recorded");
        assert_eq!(p.generated, 13, "generated tokens are still counted");
        assert_eq!(
            decide(POLICY, 0, Phase::MidStream, 90, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { len: 103, max: 100 })
        );
    }

    #[test]
    fn worker_sent_counts_never_overflow() {
        let mut p = Progress::new(8);
        p.generated = u64::MAX;
        p.observe(None, Some(&[1]), false);
        p.observe(Some("x"), None, false);
        assert_eq!(p.generated, u64::MAX);
        assert!(matches!(
            decide(POLICY, 0, Phase::MidStream, u64::MAX, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { .. })
        ));
    }

    #[test]
    fn a_second_failure_the_request_may_cause_is_the_requests_fault() {
        // The first 5xx or timeout may be the worker's: it is reported.
        assert!(!request_fault(Failure::Status5xx, 0));
        assert!(!request_fault(Failure::Timeout, 0));
        // The second, on another worker, is taken to be the request's.
        assert!(request_fault(Failure::Status5xx, 1));
        assert!(request_fault(Failure::Timeout, 1));
        // Refused and broken connections are always the worker's.
        for reason in [Failure::Connect, Failure::Reset, Failure::MidStream] {
            assert!(!request_fault(reason, 5), "{reason:?}");
        }
    }

    #[test]
    fn the_resume_body_carries_sampling_fields_and_drops_the_rest() {
        let original = json!({
            "model": "m", "messages": [{"role": "user", "content": "secret"}],
            "temperature": 0.5, "max_completion_tokens": 20, "tools": [], "n": 1,
            "stream": true, "stream_options": {"include_usage": true},
        });
        assert_eq!(max_tokens(&original), Some(20));
        let body = resume_body(&original, &[1, 2, 3], Some(12));
        assert_eq!(
            body,
            json!({
                "model": "m", "temperature": 0.5, "stream_options": {"include_usage": true},
                "prompt": [1, 2, 3], "max_tokens": 12, "stream": true, "return_token_ids": true,
            })
        );
        assert!(resume_body(&json!("junk"), &[1], None)
            .get("max_tokens")
            .is_none());
    }
}
