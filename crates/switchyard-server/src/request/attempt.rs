//! One request's attempts on workers: placing it, sending it to its
//! worker, and when that worker fails it, deciding whether it moves on
//! ([`FailureHistory::fail`], the core's) and moving it ([`Booking::migrate`]).
//!
//! The placement loop plain and disaggregated requests share is
//! [`Attempts::place`], [`Attempts::send`], and on a failure before the
//! first token [`Attempts::move_on`], each bounded by the request's
//! deadline.
//!
//! The handlers ([`crate::request::handlers`]), the disaggregated halves
//! ([`crate::request::disagg`]) and the streaming body
//! ([`crate::request::stream`]) share one [`Attempts`] per request.

use crate::driver::booking::{Booking, WaitHandle};
use crate::driver::{Request, SubmitError};
use crate::error::ApiError;
use crate::roster::Role;
use crate::state::AppState;
use crate::upstream::{Post, PostError};
use axum::http::HeaderValue;
use bytes::Bytes;
use hyper::body::Incoming;
use std::sync::Arc;
use switchyard_core::admission::{Flow, SessionKey};
use switchyard_core::dispatch::failure::{
    AttemptFailure, Failure, FailureHistory, GiveUp, Phase, Progress, Verdict,
};
use switchyard_core::dispatch::{MigrateError, Pairing};
use switchyard_core::{LocalHash, RequestId, WorkerId};

/// Why placing a request (or moving it) ended it; each carries the
/// client's error.
pub(crate) enum PlaceError {
    /// No worker can take it: refused at admission, its model unknown,
    /// the queue full, or no worker left to move to.
    NoWorker(ApiError),
    /// The request timeout passed while it waited for a worker (counted).
    Timeout(ApiError),
    /// Its worker failed it and it is not moved on (counted, logged).
    GaveUp(ApiError),
}

impl From<PlaceError> for ApiError {
    fn from(e: PlaceError) -> Self {
        match e {
            PlaceError::NoWorker(e) | PlaceError::Timeout(e) | PlaceError::GaveUp(e) => e,
        }
    }
}

/// A failed attempt.
pub(crate) enum AttemptError {
    /// The worker failed: move the request (reason, detail for logs and
    /// the client's error; never prompt text).
    Retry(Failure, String),
    /// The request itself cannot be served: answer this.
    Fatal(ApiError),
}

/// What every attempt of one request shares: where it may go, what failed
/// it so far, and its deadline.
pub(crate) struct Attempts {
    pub(crate) state: Arc<AppState>,
    /// The request's id: what the client sees (`x-request-id`), the
    /// admission and session identity, and the first attempt's booking.
    pub(crate) client_id: RequestId,
    model: Option<String>,
    /// How `model` routes: the adapter it names and the model whose
    /// workers may serve it ([`crate::adapters`]).
    adapter: crate::adapters::Resolved,
    /// Its model's routing state (tokenizer, block size, policy, hit
    /// counters: [`crate::models`]).
    pub(crate) routing: Arc<crate::models::ModelRouting>,
    /// The prompt's length when its model has no tokenizer here (the
    /// request then carries no token ids: routed by load).
    estimated_prompt_tokens: Option<u32>,
    /// Tokens the engine renders beyond the prompt's ids (estimated:
    /// [`crate::request::prompt::PromptIds::unrendered`]), counted in the
    /// prompt's size as the load view and the fair share see it.
    unrendered_prompt_tokens: u32,
    /// Full blocks of the prompt last submitted (for the model's hit
    /// counters at its first placement).
    prompt_blocks: std::sync::atomic::AtomicUsize,
    accept: Option<HeaderValue>,
    /// When the request timeout cancels it.
    pub(crate) deadline: tokio::time::Instant,
    /// Its failures so far and the decision on the next (a migration
    /// decided is counted in `migrations_total{reason}` once a worker
    /// takes the request).
    pub(crate) failures: FailureHistory,
    /// The pool it is placed in (a disaggregated request's half), or
    /// `Both`: any worker.
    pool: Role,
    /// The `x-request-id` sent upstream instead of the booking's id (the
    /// two halves of a disaggregated request share the client's id, as
    /// the engines' own proxies send it).
    upstream_id: Option<RequestId>,
    /// Its tenant, band and deadline.
    flow: Flow,
    /// A 5xx answer is handed back as a response rather than judged a
    /// worker failure (a decode worker's 5xx may name its prefill
    /// worker's failure: the caller judges it).
    pass_server_errors: bool,
    /// The one worker the request may go to ([`Self::pinned_to`]).
    pinned: Option<WorkerId>,
}

impl Attempts {
    /// The attempts of request `client_id`.
    pub(crate) fn new(
        state: Arc<AppState>,
        client_id: RequestId,
        model: Option<String>,
        accept: Option<HeaderValue>,
        deadline: tokio::time::Instant,
    ) -> Self {
        let adapter = state.driver.adapters.resolve(model.as_deref());
        let routing = state
            .prompts
            .models
            .get(adapter.eligible_model.as_deref())
            .clone();
        Self {
            state,
            client_id,
            model,
            adapter,
            routing,
            estimated_prompt_tokens: None,
            unrendered_prompt_tokens: 0,
            prompt_blocks: std::sync::atomic::AtomicUsize::new(0),
            accept,
            deadline,
            failures: FailureHistory::default(),
            pool: Role::Both,
            upstream_id: None,
            pass_server_errors: false,
            flow: Flow::default(),
            pinned: None,
        }
    }

    /// Placed on `worker` only (a Responses turn continuing a response
    /// that worker stores): never moved to another.
    pub(crate) fn pinned_to(mut self, worker: Option<WorkerId>) -> Self {
        self.pinned = worker;
        self
    }

    /// Placed in `pool` only, telling workers `upstream_id` as the
    /// request's id (one half of a disaggregated request).
    pub(crate) fn half(mut self, pool: Role, upstream_id: RequestId) -> Self {
        self.pool = pool;
        self.upstream_id = Some(upstream_id);
        self
    }

    /// A prompt of `tokens` tokens, as estimated for a model without a
    /// tokenizer here (its token ids are unknown).
    pub(crate) fn estimated_prompt(mut self, tokens: Option<u32>) -> Self {
        self.estimated_prompt_tokens = tokens;
        self
    }

    /// `tokens` more the engine renders than the prompt's ids carry.
    pub(crate) fn unrendered_prompt(mut self, tokens: u32) -> Self {
        self.unrendered_prompt_tokens = tokens;
        self
    }

    /// The request's tenant, band and deadline ([`crate::request::flow`]).
    pub(crate) fn flow(mut self, flow: Flow) -> Self {
        self.flow = flow;
        self
    }

    /// The full blocks of the prompt last submitted.
    pub(crate) fn prompt_blocks(&self) -> usize {
        self.prompt_blocks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The attempts of a prompt of `blocks` full blocks submitted by
    /// another (a prefill done again: counted as its first was).
    pub(crate) fn with_prompt_blocks(self, blocks: usize) -> Self {
        self.prompt_blocks
            .store(blocks, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Whether a broken stream may be resumed on another worker by its
    /// token ids: they must be known, and known to be the engine's
    /// ([`crate::models::ModelRouting::resume_by_ids`]); `Err` says why not.
    pub(crate) fn resume_by_ids(&self) -> Result<(), &'static str> {
        if self.estimated_prompt_tokens.is_some() {
            return Err("its model has no tokenizer here, so its prompt's token ids are unknown");
        }
        self.routing.resume_by_ids()
    }

    /// Hands 5xx answers back to the caller (see `pass_server_errors`).
    pub(crate) fn passing_server_errors(mut self) -> Self {
        self.pass_server_errors = true;
        self
    }

    /// Judges 5xx answers again (a stream resumed on another worker
    /// retries on a 5xx as any request does).
    pub(crate) fn judging_server_errors(mut self) -> Self {
        self.pass_server_errors = false;
        self
    }

    fn blocks(&self, tokens: &[u32]) -> Vec<LocalHash> {
        switchyard_core::hashing::local_block_hashes(
            tokens,
            self.routing.block_size as usize,
            match &self.adapter.adapter {
                // An adapter's blocks are its own (vLLM's events carry
                // its name as `lora_name`).
                Some(name) => switchyard_core::hashing::seed_for(Some(name), None),
                None => self.state.prompts.hash_seed,
            },
        )
    }

    /// What admission is given for the request's prompt `tokens`.
    fn request(&self, tokens: &[u32], session: Option<SessionKey>) -> Request<'_> {
        let blocks = self.blocks(tokens);
        self.prompt_blocks
            .store(blocks.len(), std::sync::atomic::Ordering::Relaxed);
        Request {
            blocks,
            prompt_tokens: self
                .estimated_prompt_tokens
                .unwrap_or_else(|| u32::try_from(tokens.len()).unwrap_or(u32::MAX))
                .saturating_add(self.unrendered_prompt_tokens),
            session,
            model: self.adapter.eligible_model.as_deref(),
            adapter: self.adapter.adapter.as_deref(),
            settings: self.routing.settings,
            flow: self.flow,
            pinned: self.pinned,
        }
    }

    /// The client's error for a refused submission.
    fn refused(&self, e: SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull { retry_after_ms } => ApiError::queue_full(retry_after_ms),
            SubmitError::Duplicate => ApiError::internal("the request id is already in use"),
            SubmitError::UnknownModel => ApiError::not_found(
                format!(
                    "the model `{}` is not served by any worker",
                    self.model.as_deref().unwrap_or_default()
                ),
                Some("model"),
            ),
        }
    }

    /// Admission for the request's prompt `tokens`.
    pub(crate) fn submit(
        &self,
        tokens: &[u32],
        session: Option<SessionKey>,
    ) -> Result<WaitHandle, ApiError> {
        WaitHandle::submit_in(
            &self.state.driver,
            self.pool,
            self.client_id,
            self.request(tokens, session),
        )
        .map_err(|e| self.refused(e))
    }

    /// Admission of this request as a disaggregated one, its halves paired
    /// as `pairing` ([`WaitHandle::submit_split`]): the prefill half's
    /// handle, and the decode half's when paired together. Called on the
    /// prefill half's attempts (whose first placement is the request's,
    /// for the model's hit counters).
    pub(crate) fn submit_split(
        &self,
        tokens: &[u32],
        session: Option<SessionKey>,
        pairing: Pairing,
    ) -> Result<(WaitHandle, Option<WaitHandle>), ApiError> {
        WaitHandle::submit_split(
            &self.state.driver,
            switchyard_core::dispatch::request_of(self.client_id),
            self.request(tokens, session),
            pairing,
            self.state.upstream.migration.limit,
        )
        .map_err(|e| self.refused(e))
    }

    /// Waits for the request's placement on a worker not yet tried.
    pub(crate) async fn placed(&mut self, wait: WaitHandle) -> Result<Booking, ApiError> {
        let placed = wait.placed().await;
        let pending = self.failures.take_pending();
        let metrics = self.state.driver.metrics();
        match placed {
            Ok(booking) => {
                match pending {
                    Some(reason) => metrics.count_migration(reason),
                    // The request's first placement (a disaggregated
                    // request's prefill half; its decode half brings
                    // nothing cached to count).
                    None if self.failures.migrations() == 0 && self.pool != Role::Decode => {
                        self.routing.record_placement(
                            self.prompt_blocks
                                .load(std::sync::atomic::Ordering::Relaxed),
                            booking.overlap_blocks,
                        );
                    }
                    None => {}
                }
                Ok(booking)
            }
            Err(crate::driver::booking::Unplaced::Shed {
                retry_after_ms,
                late,
            }) => Err(ApiError::shed(retry_after_ms, late)),
            Err(crate::driver::booking::Unplaced::NoWorkers) if self.failures.migrations() == 0 => {
                Err(ApiError::no_workers("no worker can take the request"))
            }
            Err(crate::driver::booking::Unplaced::NoWorkers) => {
                metrics.migrations_exhausted.inc();
                Err(ApiError::no_workers(format!(
                    "{} worker(s) failed the request and no other worker can take it",
                    self.failures.migrations()
                )))
            }
        }
    }

    /// POSTs `body` to the booked worker ([`crate::upstream::Upstream::post`]:
    /// a refused or broken connection, a 5xx or, when `streaming`, no
    /// headers within the first-token timeout is a [`AttemptError::Retry`]).
    /// A worker still silent at the request timeout is reported then
    /// ([`Self::timed_out_on`]).
    pub(crate) async fn send(
        &self,
        booking: &Booking,
        path: &'static str,
        body: Bytes,
        streaming: bool,
    ) -> Result<hyper::Response<Incoming>, AttemptError> {
        if let Some(adapter) = &self.adapter.adapter {
            crate::request::adapter_load::ensure_loaded(&self.state, booking, adapter)
                .await
                .map_err(AttemptError::Fatal)?;
        }
        let to = Post {
            endpoint: &booking.endpoint,
            url: &booking.url,
            worker: self.state.disclosure().worker(&booking.name),
            path,
            id: self.upstream_id.unwrap_or(booking.booking_id()),
            accept: self.accept.as_ref(),
        };
        let upstream = &self.state.upstream;
        match upstream
            .post(to, body, streaming, self.pass_server_errors)
            .await
        {
            Ok(response) => Ok(response),
            Err(PostError::Failed(failure, detail)) => Err(AttemptError::Retry(failure, detail)),
            Err(PostError::Build) => Err(AttemptError::Fatal(ApiError::internal(
                "cannot build the upstream request",
            ))),
        }
    }

    /// A worker failed this request: the core decides
    /// ([`FailureHistory::fail`]) whether its worker is reported and
    /// whether it may move on. `Ok` hands back the booking to
    /// [`Self::migrate`] (the migration is counted once placed); `Err`
    /// gives up, the booking dropped (the request aborted) and the give-up
    /// counted.
    pub(crate) fn fail(
        &mut self,
        booking: Booking,
        reason: Failure,
        phase: Phase,
        prompt_tokens: u64,
        progress: &Progress,
        resumable: Result<(), &'static str>,
    ) -> Result<Booking, GiveUp> {
        let failed = self.failures.fail(
            self.state.upstream.migration,
            AttemptFailure {
                reason,
                phase,
                prompt_tokens,
                progress,
                resumable,
            },
        );
        if failed.report_worker {
            booking.worker_failed();
        }
        match failed.verdict {
            Verdict::Migrate => Ok(booking),
            Verdict::GiveUp(why) => {
                drop(booking);
                Err(self.give_up(reason, why))
            }
        }
    }

    /// Counts and logs a request that is not moved on after `reason`.
    fn give_up(&self, reason: Failure, why: GiveUp) -> GiveUp {
        let metrics = self.state.driver.metrics();
        metrics.migrations_exhausted.inc();
        metrics.count_refused(&why);
        tracing::warn!(request = %self.client_id, reason = reason.label(), "request not migrated: {why}");
        why
    }

    /// The request timeout passed while `booking`'s worker had the request
    /// and had not answered it (no headers or first event, or for a
    /// non-streaming request not its whole body). When `fair` (the worker
    /// had it for at least the first-token timeout) that is the worker's
    /// failure for its circuit breaker — a worker that accepts requests
    /// and never answers must not stay selectable — unless an earlier
    /// suspect failure makes it the request's fault. The booking is
    /// dropped (the request aborted, the upstream request cancelled); the
    /// timeout is counted and the client's error returned.
    fn timed_out_on(&self, booking: Booking, fair: bool) -> ApiError {
        let reported = self.failures.timeout_reported(fair);
        if reported {
            booking.worker_failed();
        }
        tracing::info!(request = %self.client_id, worker = %booking.name, reported, "request timed out waiting for its worker's answer: upstream cancelled");
        drop(booking);
        self.timed_out()
    }

    /// The request timeout passed: counted, and the client's error.
    pub(crate) fn timed_out(&self) -> ApiError {
        self.state.driver.metrics().request_timeouts.inc();
        ApiError::timeout(self.state.upstream.request_timeout)
    }

    /// Moves the request off `failed`'s worker (see [`Booking::migrate`])
    /// and waits for its next placement; `prompt` replaces the prompt (a
    /// resumed stream's prompt plus generated tokens).
    pub(crate) async fn migrate(
        &mut self,
        failed: Booking,
        prompt: Option<&[u32]>,
    ) -> Result<Booking, ApiError> {
        let prompt = prompt.map(|tokens| {
            (
                self.blocks(tokens),
                u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            )
        });
        match failed.migrate(prompt) {
            Ok(wait) => self.placed(wait).await,
            Err(MigrateError::Unknown | MigrateError::NotPlaced) => {
                self.state.driver.metrics().migrations_exhausted.inc();
                Err(ApiError::no_workers(
                    "the request ended while it was moving to another worker",
                ))
            }
        }
    }

    /// Places the request's prompt `tokens`: admitted, routed and booked
    /// before the request's deadline (the first step of the placement
    /// loop plain and disaggregated requests share).
    pub(crate) async fn place(
        &mut self,
        tokens: &[u32],
        session: Option<SessionKey>,
    ) -> Result<Booking, PlaceError> {
        let wait = self.submit(tokens, session).map_err(PlaceError::NoWorker)?;
        self.place_from(wait).await
    }

    /// Waits for an admitted request's placement before its deadline.
    pub(crate) async fn place_from(&mut self, wait: WaitHandle) -> Result<Booking, PlaceError> {
        match tokio::time::timeout_at(self.deadline, self.placed(wait)).await {
            Ok(placed) => {
                let booking = placed.map_err(PlaceError::NoWorker)?;
                self.state
                    .intake
                    .flow_metrics
                    .observe_wait(&self.flow, booking.waited_ms);
                Ok(booking)
            }
            Err(_) => Err(PlaceError::Timeout(self.queue_timeout())),
        }
    }

    /// `booking`'s worker failed the request before its first token
    /// (`failure`, `detail`): reported ([`Self::fail`]) and the request
    /// moved to another worker before its deadline, or given up.
    pub(crate) async fn move_on(
        &mut self,
        booking: Booking,
        failure: Failure,
        detail: &str,
        prompt_tokens: u64,
    ) -> Result<Booking, PlaceError> {
        let failed = self
            .fail(
                booking,
                failure,
                Phase::BeforeFirstToken,
                prompt_tokens,
                &Progress::default(),
                Ok(()),
            )
            .map_err(|why| PlaceError::GaveUp(ApiError::bad_gateway(format!("{detail}; {why}"))))?;
        match tokio::time::timeout_at(self.deadline, self.migrate(failed, None)).await {
            Ok(moved) => moved.map_err(PlaceError::NoWorker),
            Err(_) => Err(PlaceError::Timeout(self.queue_timeout())),
        }
    }

    /// The request timeout passed while it waited for a worker.
    fn queue_timeout(&self) -> ApiError {
        tracing::info!(request = %self.client_id, "request timed out waiting for a worker");
        self.timed_out()
    }

    /// The request timeout passed while `booking`'s worker had the request,
    /// sent to it at `sent_at` ([`Self::timed_out_on`]: reported when it
    /// had it for at least the first-token timeout).
    pub(crate) fn timed_out_since(
        &self,
        booking: Booking,
        sent_at: tokio::time::Instant,
    ) -> ApiError {
        let fair = sent_at.elapsed() >= self.state.upstream.first_token_timeout;
        self.timed_out_on(booking, fair)
    }

    /// The worker's response head as the client gets it
    /// ([`crate::upstream::Upstream::client_parts`]).
    pub(crate) fn client_parts(
        &self,
        parts: hyper::http::response::Parts,
        booking: &Booking,
    ) -> hyper::http::response::Parts {
        let disclosure = self.state.disclosure();
        (self.state.upstream).client_parts(parts, &booking.endpoint, self.client_id, disclosure)
    }
}
