//! The vocabulary of failed attempts, shared by the request path and the
//! metrics: why an attempt failed ([`Failure`], the `reason` label of
//! `switchyard_migrations_total`) and why a request is not moved on
//! ([`GiveUp`], the `reason` label of `switchyard_migrations_refused_total`).
//! The decision that uses them is `request::migration`'s.

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
    /// the request's fault (`request::migration::request_fault`), not the workers'.
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
