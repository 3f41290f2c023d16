//! The lifecycle of one tracked request and the ticket that carries its
//! cancellation past dispatch.
//!
//! ```text
//! pending ──► selected ──► dispatched ──► completed
//!    ▲ │           │         │    │
//!    │ └───────────┴─────────┼────┴─────► aborted
//!    └───────────────────────┘ migrated (its worker failed it)
//! ```
//!
//! Until selection the scheduling side owns cancellation
//! ([`super::AdmissionController::cancel`] by id). At selection the
//! controller hands out a [`ResponseTicket`]; from then on only its holder —
//! the response stream — can end the request, by passing the ticket to
//! `complete` or `abort`, which consume it. A record exists only for
//! requests a strategy tracks; with no strategy there are none.

use super::progress::ProgressUpdater;
use crate::types::{RequestId, WorkerId};

/// Where a tracked request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Waiting in the ready queue or deferred.
    Pending,
    /// A worker was chosen; the ticket is out.
    Selected,
    /// Sent to the worker; the response stream owns it.
    Dispatched,
    /// Finished with a result.
    Completed,
    /// Ended without one.
    Aborted,
}

impl Stage {
    /// Whether `self → to` is a legal step.
    pub fn can_become(self, to: Stage) -> bool {
        use Stage::*;
        matches!(
            (self, to),
            (Pending, Selected)
                | (Selected, Dispatched)
                | (Dispatched, Completed)
                | (Dispatched, Pending)
                | (Pending | Selected | Dispatched, Aborted)
        )
    }
}

/// What a lifecycle call did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransitionOutcome {
    /// The step was taken.
    Applied,
    /// Already in that stage: nothing changed.
    Duplicate,
    /// No record: a bypassed request, or no strategy configured.
    Untracked,
    /// The record is gone (ended, or never existed here).
    Unknown,
}

/// A step the lifecycle forbids (say, completing a request that was never
/// dispatched). The ticket comes back so its holder can still abort.
#[derive(Debug)]
#[must_use = "the ticket must still be completed or aborted"]
pub struct InvalidTransition {
    /// The stage the request is in.
    pub from: Stage,
    /// The stage asked for.
    pub to: Stage,
    /// The caller's ticket, returned.
    pub ticket: ResponseTicket,
}

impl std::fmt::Display for InvalidTransition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "request {} cannot go from {:?} to {:?}",
            self.ticket.id, self.from, self.to
        )
    }
}

/// The right to end a selected request. Not `Clone`: whoever holds it owns
/// the request's cancellation; `complete` and `abort` consume it. A driver
/// whose response path is dropped (client gone) must abort the ticket.
#[derive(Debug)]
#[must_use = "a selected request must be completed or aborted with its ticket"]
pub struct ResponseTicket {
    pub(super) id: RequestId,
    pub(super) worker: WorkerId,
    pub(super) tracked: bool,
    pub(super) progress: Option<ProgressUpdater>,
}

impl ResponseTicket {
    /// The request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The chosen worker.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Whether a strategy tracks the request.
    pub fn is_tracked(&self) -> bool {
        self.tracked
    }

    /// The live-progress updater, when a strategy tracks the request; the
    /// response path calls `set`/`advance` on it per token.
    pub fn progress(&mut self) -> Option<&mut ProgressUpdater> {
        self.progress.as_mut()
    }

    /// Takes the live-progress updater out, for a response path that
    /// updates progress without holding the ticket.
    pub fn take_progress(&mut self) -> Option<ProgressUpdater> {
        self.progress.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_documented_steps_are_legal() {
        use Stage::*;
        let all = [Pending, Selected, Dispatched, Completed, Aborted];
        let legal: Vec<(Stage, Stage)> = all
            .iter()
            .flat_map(|&a| all.iter().map(move |&b| (a, b)))
            .filter(|&(a, b)| a.can_become(b))
            .collect();
        assert_eq!(
            legal,
            vec![
                (Pending, Selected),
                (Pending, Aborted),
                (Selected, Dispatched),
                (Selected, Aborted),
                (Dispatched, Pending),
                (Dispatched, Completed),
                (Dispatched, Aborted),
            ]
        );
    }
}
