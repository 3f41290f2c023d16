//! Disaggregated requests: one request, two halves, each placed on a worker
//! of its pool — its *prefill* half computes the prompt's KV, its *decode*
//! half reads that KV and generates the answer the client gets.
//!
//! The dispatcher sequences the halves; a driver (the server, the
//! simulator) carries out what each call returns, as for any request:
//!
//! ```text
//! submit_split ─► prefill half placed ─► (driver sends it) ─► handed_over
//!      │                                                         │
//!      │ Pairing::Together: the decode half too, at once          ▼
//!      └────────────────────────────────────────────► decode half placed
//!                                                     (AfterPrefill: now)
//! a half's worker fails it ─► recovery(pairing, half, failure):
//!      move that half (migrate) and/or redo the prefill (redo_prefill)
//! a half no worker can take ─► both halves end (Effects::no_worker)
//! ```
//!
//! - Ids: the request's id is its decode half's (the answer the client
//!   reads, the admission and session identity); the prefill half's is
//!   [`prefill_half`] of it. Drivers keep bit 126 of their request ids
//!   clear for it.
//! - The session: the decode half carries it (a session's turn ends when
//!   its answer ends); the prefill half carries none.
//! - Both halves have the prompt's blocks: the prefill half is routed by
//!   its overlap (what its worker need not compute), the decode half by
//!   its overlap too (what its worker need not pull) and by the decodes
//!   booked on each worker.
//! - A split is forgotten once neither half is known here; while it
//!   lives it holds its prompt's blocks (for a decode half placed after
//!   the prefill, and for a prefill done again), so splits are bounded by
//!   the request table.

use super::{Admitted, Dispatcher, Effects, Refused, Submission};
use crate::types::{Eligible, RequestId};

/// The bit that marks a request id as a prefill half.
pub const PREFILL_HALF_BIT: u128 = 1 << 126;

/// The id of the prefill half of request `id`.
pub fn prefill_half(id: RequestId) -> RequestId {
    RequestId(id.0 | PREFILL_HALF_BIT)
}

/// The request a half belongs to: `id` itself for a decode half (or a
/// whole request).
pub fn request_of(id: RequestId) -> RequestId {
    RequestId(id.0 & !PREFILL_HALF_BIT)
}

/// One half of a disaggregated request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    /// Computes the prompt's KV and hands it over.
    Prefill,
    /// Reads the KV and generates the answer.
    Decode,
}

impl Half {
    /// Its label (metrics, logs).
    pub fn label(self) -> &'static str {
        match self {
            Half::Prefill => "prefill",
            Half::Decode => "decode",
        }
    }
}

/// How the halves meet: the engine family's protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// The decode half is placed once the prefill half has answered and
    /// its KV is held for the decode (vLLM's connectors, the simulator).
    AfterPrefill,
    /// Both halves are placed and sent at once and meet on their own (an
    /// SGLang bootstrap room).
    Together,
}

/// What a disaggregated request may use.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitPlan {
    /// How its halves meet.
    pub pairing: Pairing,
    /// Workers that may run its prefill half.
    pub prefill_pool: Eligible,
    /// Workers that may run its decode half.
    pub decode_pool: Eligible,
    /// Failed KV transfers after which the request is given up: the
    /// prefill is done at most `transfer_limit + 1` times.
    pub transfer_limit: u32,
}

/// How a half's worker failed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfFailure {
    /// The worker itself: refused, reset, 5xx, timeout.
    Worker,
    /// The decode worker could not take the prefill's KV: its lease or
    /// room unknown or expired, the prefill worker unreachable.
    Transfer,
}

/// What a failed half leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// The failed half moves to another worker of its pool (its worker
    /// reported: [`Dispatcher::worker_failed`], then
    /// [`Dispatcher::migrate`]); otherwise it stays where it is.
    pub move_half: bool,
    /// The prefill is done again ([`Dispatcher::redo_prefill`]).
    pub redo_prefill: bool,
}

/// Which failures retry which half:
///
/// | pairing | half | failure | moves | prefill again |
/// |---|---|---|---|---|
/// | any | prefill | any | the prefill | — |
/// | after prefill | decode | worker | the decode (its KV still held) | no |
/// | together | decode | worker | the decode | yes (a new room) |
/// | any | decode | transfer | — (the decode stays) | yes (counted) |
pub fn recovery(pairing: Pairing, half: Half, failure: HalfFailure) -> Recovery {
    match (half, failure) {
        (Half::Prefill, _) => Recovery {
            move_half: true,
            redo_prefill: false,
        },
        (Half::Decode, HalfFailure::Worker) => Recovery {
            move_half: true,
            redo_prefill: pairing == Pairing::Together,
        },
        (Half::Decode, HalfFailure::Transfer) => Recovery {
            move_half: false,
            redo_prefill: true,
        },
    }
}

/// Why [`Dispatcher::redo_prefill`] did nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// Not a disaggregated request known here.
    #[error("unknown disaggregated request")]
    Unknown,
    /// Its KV transfer failed more often than its plan allows: give it up.
    #[error("the KV transfer failed {0} times")]
    Transfers(u32),
}

/// A disaggregated request while either half lives.
#[derive(Debug)]
pub(super) struct Split {
    plan: SplitPlan,
    /// Its prompt, session, class, adapter and model (`eligible` unused:
    /// each half has its pool).
    submission: Submission,
    transfers_failed: u32,
}

impl Split {
    fn half(&self, half: Half) -> Submission {
        let (session, eligible) = match half {
            Half::Prefill => (None, self.plan.prefill_pool.clone()),
            Half::Decode => (self.submission.session, self.plan.decode_pool.clone()),
        };
        Submission {
            blocks: self.submission.blocks.clone(),
            prompt_tokens: self.submission.prompt_tokens,
            session,
            eligible,
            class: self.submission.class,
            adapter: self.submission.adapter.clone(),
            model: self.submission.model,
            flow: self.submission.flow,
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.submission.blocks.capacity() * std::mem::size_of::<crate::types::LocalHash>()
            + self.plan.prefill_pool.heap_bytes()
            + self.plan.decode_pool.heap_bytes()
    }
}

impl Dispatcher {
    /// A disaggregated request `id` arrives: its prefill half is submitted
    /// to the prefill pool (and with [`Pairing::Together`] its decode half
    /// to the decode pool); either may be dispatched at once. The
    /// submission's `eligible` is ignored. Refused: nothing retained.
    pub fn submit_split(
        &mut self,
        id: RequestId,
        submission: Submission,
        plan: SplitPlan,
        now_ms: f64,
    ) -> Result<(Admitted, Effects), Refused> {
        if id.0 & PREFILL_HALF_BIT != 0 || self.splits.contains_key(&id) {
            return Err(Refused::Duplicate);
        }
        let split = Split {
            plan,
            submission,
            transfers_failed: 0,
        };
        let prefill = split.half(Half::Prefill);
        let decode = (split.plan.pairing == Pairing::Together).then(|| split.half(Half::Decode));
        // Both halves are admitted before either is offered to a worker:
        // a refusal retains nothing and loses no other request's effects.
        let admitted = self.admit(prefill_half(id), prefill, now_ms)?;
        if let Some(decode) = decode {
            if let Err(refused) = self.admit(id, decode, now_ms) {
                self.requests.remove(&prefill_half(id));
                let _ = self.admission.cancel(prefill_half(id), now_ms);
                return Err(refused);
            }
        }
        self.splits.insert(id, split);
        let mut fx = Effects::default();
        self.poll_into(now_ms, &mut fx);
        Ok((admitted, fx))
    }

    /// The prefill half of `id` answered and its KV is held for the
    /// decode: the prefill half ends (its first token and its one
    /// generated token), and with [`Pairing::AfterPrefill`] the decode
    /// half is submitted to the decode pool unless it is known here
    /// already (kept on its worker while the prefill was done again).
    pub fn handed_over(&mut self, id: RequestId, now_ms: f64) -> Effects {
        let prefill = prefill_half(id);
        let mut fx = self.first_token(prefill, now_ms);
        let context = self.requests.get(&prefill).map(|r| r.prompt_tokens);
        if let Some(prompt) = context {
            // Not `finish`: the split stays for its decode half.
            fx.append(self.end(prefill, Some(u64::from(prompt) + 1), now_ms));
        }
        let Some(split) = self.splits.get(&id) else {
            return fx;
        };
        if split.plan.pairing == Pairing::AfterPrefill && !self.requests.contains_key(&id) {
            let decode = split.half(Half::Decode);
            match self.submit(id, decode, now_ms) {
                Ok((_, more)) => fx.append(more),
                Err(_) => {
                    // The queue is full (or the id taken): the request
                    // ends here, as one no worker can take.
                    self.splits.remove(&id);
                    fx.no_worker.push(id);
                }
            }
        }
        // Together, its decode may have ended first.
        self.forget_split_if_over(id);
        fx
    }

    /// The prefill of `id` is done again (a failed KV transfer, counted
    /// when `transfer_failed`; or a decode moved under a new room): a
    /// prefill half still known here ends, and a fresh one is submitted.
    /// `Err(Transfers)`: the transfers failed more often than the plan
    /// allows — the driver gives the request up.
    pub fn redo_prefill(
        &mut self,
        id: RequestId,
        transfer_failed: bool,
        now_ms: f64,
    ) -> Result<Effects, SplitError> {
        let split = self.splits.get_mut(&id).ok_or(SplitError::Unknown)?;
        if transfer_failed {
            split.transfers_failed += 1;
            if split.transfers_failed > split.plan.transfer_limit {
                return Err(SplitError::Transfers(split.transfers_failed));
            }
        }
        let prefill = split.half(Half::Prefill);
        // Not `abort`: the split stays for the prefill submitted again.
        let mut fx = self.end(prefill_half(id), None, now_ms);
        match self.submit(prefill_half(id), prefill, now_ms) {
            Ok((_, more)) => fx.append(more),
            Err(_) => fx.no_worker.push(prefill_half(id)),
        }
        self.forget_split_if_over(id);
        Ok(fx)
    }

    /// The pairing of disaggregated request `id`, while either half lives.
    pub fn pairing_of(&self, id: RequestId) -> Option<Pairing> {
        self.splits.get(&request_of(id)).map(|s| s.plan.pairing)
    }

    /// Disaggregated requests known here.
    pub fn splits(&self) -> usize {
        self.splits.len()
    }

    /// Which half a dispatched id is, if it is one.
    pub(super) fn half_of(&self, id: RequestId) -> Option<Half> {
        if self.splits.is_empty() {
            return None;
        }
        let half = if id.0 & PREFILL_HALF_BIT != 0 {
            Half::Prefill
        } else {
            Half::Decode
        };
        self.splits.contains_key(&request_of(id)).then_some(half)
    }

    /// A half no worker can take ends the request: its other half ends
    /// too, and both ids are told to the driver.
    pub(super) fn half_found_no_worker(&mut self, id: RequestId, now_ms: f64, fx: &mut Effects) {
        let request = request_of(id);
        if !self.splits.contains_key(&request) {
            return;
        }
        let other = if id == request {
            prefill_half(request)
        } else {
            request
        };
        self.splits.remove(&request);
        if self.requests.contains_key(&other) {
            let more = self.end(other, None, now_ms);
            fx.append(more);
            // Placed in this same call: never to be sent.
            fx.dispatch.retain(|d| d.id != other);
            fx.no_worker.push(other);
        }
    }

    /// Forgets the split of `id` once neither half is known here.
    pub(super) fn forget_split_if_over(&mut self, id: RequestId) {
        if self.splits.is_empty() {
            return;
        }
        let request = request_of(id);
        if !self.requests.contains_key(&request)
            && !self.requests.contains_key(&prefill_half(request))
        {
            self.splits.remove(&request);
        }
    }
}
