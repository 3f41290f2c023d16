//! What the engine hands back: each step's report, the requests that left,
//! and the observations a driver exports.

use crate::lease::LeaseId;
use crate::restore::{RestoreDecision, RestoreError};
use crate::timing::StepShape;
use switchyard_core::RequestId;

/// Why a request left the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated `max_tokens` (or hit the model length).
    Length,
    /// It was cancelled.
    Cancelled,
    /// A published restore failed; the request was cancelled.
    RestoreFailed,
}

/// A request that left the engine. Lengths only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request: RequestId,
    /// Why.
    pub reason: FinishReason,
    /// Its prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache (device hit plus restore) at first admission.
    pub cached_tokens: usize,
    /// Output tokens generated.
    pub output_tokens: usize,
}

/// One synthetic output token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenOutput {
    /// The request.
    pub request: RequestId,
    /// The token id.
    pub token: u32,
    /// 0-based output position.
    pub index: u32,
}

/// What a step did. The buffers are reused from step to step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Model milliseconds the step took (0 when idle).
    pub model_ms: f64,
    /// What it computed.
    pub shape: StepShape,
    /// Sequences scheduled.
    pub scheduled: usize,
    /// Tokens sampled this step.
    pub tokens: Vec<TokenOutput>,
    /// Requests that finished this step.
    pub finished: Vec<Finished>,
}

impl StepReport {
    /// Whether the step computed nothing.
    pub fn is_idle(&self) -> bool {
        self.scheduled == 0
    }

    pub(super) fn clear(&mut self) {
        self.model_ms = 0.0;
        self.shape = StepShape::default();
        self.scheduled = 0;
        self.tokens.clear();
        self.finished.clear();
    }
}

/// Something worth exporting that happened inside the core. Lengths only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// A restore decision was taken (`Restore` is only an intent).
    RestoreDecided {
        /// The request.
        request: RequestId,
        /// The decision.
        decision: RestoreDecision,
    },
    /// A restore was installed and acknowledged.
    Restored {
        /// The request.
        request: RequestId,
        /// Tokens restored.
        candidate_prefix_tokens: usize,
    },
    /// A published restore failed; the request was cancelled.
    RestoreFailed {
        /// The request.
        request: RequestId,
        /// Why, when the output was invalid or its acknowledgement refused
        /// (`None`: the device failed the restore itself).
        error: Option<RestoreError>,
    },
    /// A request restoring from a rendezvous no longer needs its lease
    /// (restored, failed, recomputing instead, or gone): the driver
    /// releases it at the source. Exactly one per rendezvous request.
    RendezvousDone {
        /// The request.
        request: RequestId,
        /// The lease it was given.
        lease: LeaseId,
        /// Whether its blocks were restored from the lease.
        restored: bool,
    },
    /// A running request was preempted (recompute, or spill when followed
    /// by `Spilled`).
    Preempted {
        /// The request.
        request: RequestId,
    },
    /// A preempted request's computed KV was saved to the host; it is
    /// loaded back on resume, or dropped if the request is cancelled first.
    Spilled {
        /// The request.
        request: RequestId,
        /// Tokens saved.
        tokens: usize,
    },
}
