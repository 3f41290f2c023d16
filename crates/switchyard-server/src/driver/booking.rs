//! The guards a handler holds for its request: a [`WaitHandle`] while the
//! request waits for a worker, then a [`Booking`] while it runs there. Each
//! stands for the request's place in the dispatcher, and dropping it ends
//! that place — the client went away, the stream ended, the handler
//! panicked — so no path leaks a booking.
//!
//! - Dropping a `WaitHandle` before it resolves aborts the request (out of
//!   the queue, or freed if it was placed meanwhile).
//! - Dropping a `Booking` finishes the request when the response ended
//!   normally ([`Booking::completed`]), otherwise aborts it.
//! - [`Booking::migrate`] hands the request over to a new `WaitHandle`
//!   instead: the dispatcher keeps it (and its session's turn) while it
//!   moves to another worker.

use super::{Assignment, Driver, Request, SubmitError};
use std::sync::Arc;
use switchyard_core::admission::ProgressUpdater;
use switchyard_core::dispatch::{prefill_half, request_of, MigrateError, Pairing, SplitError};
use switchyard_core::{LocalHash, RequestId, WorkerId};
use tokio::sync::oneshot;

/// A request waiting for placement (see the module docs).
#[derive(Debug)]
pub struct WaitHandle {
    driver: Arc<Driver>,
    id: RequestId,
    rx: Option<oneshot::Receiver<Assignment>>,
}

impl WaitHandle {
    /// Admission for request `id`: queued, and placed at once when a worker
    /// can take it.
    pub fn submit(
        driver: &Arc<Driver>,
        id: RequestId,
        request: Request<'_>,
    ) -> Result<Self, SubmitError> {
        let rx = driver.submit(id, request)?;
        Ok(Self::new(driver.clone(), id, rx))
    }

    /// [`Self::submit`] to one pool of a disaggregated fleet.
    pub fn submit_in(
        driver: &Arc<Driver>,
        pool: crate::roster::Role,
        id: RequestId,
        request: Request<'_>,
    ) -> Result<Self, SubmitError> {
        let rx = driver.submit_in(id, request, pool)?;
        Ok(Self::new(driver.clone(), id, rx))
    }

    /// Admission of a disaggregated request `id`
    /// ([`Driver::submit_split`]): the handle of its prefill half,
    /// and with [`Pairing::Together`] of its decode half.
    pub fn submit_split(
        driver: &Arc<Driver>,
        id: RequestId,
        request: Request<'_>,
        pairing: Pairing,
        transfer_limit: u32,
    ) -> Result<(Self, Option<Self>), SubmitError> {
        let (prefill, decode) = driver.submit_split(id, request, pairing, transfer_limit)?;
        Ok((
            Self::new(driver.clone(), prefill_half(id), prefill),
            decode.map(|rx| Self::new(driver.clone(), id, rx)),
        ))
    }

    /// The prefill of disaggregated request `id` done again
    /// ([`Driver::redo_prefill`]): the new prefill half's handle.
    /// Every guard of the old prefill half must be dropped first.
    pub fn redo_prefill(
        driver: &Arc<Driver>,
        id: RequestId,
        transfer_failed: bool,
    ) -> Result<Self, SplitError> {
        let rx = driver.redo_prefill(id, transfer_failed)?;
        Ok(Self::new(driver.clone(), prefill_half(id), rx))
    }

    fn new(driver: Arc<Driver>, id: RequestId, rx: oneshot::Receiver<Assignment>) -> Self {
        Self {
            driver,
            id,
            rx: Some(rx),
        }
    }

    /// The request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Waits for placement; the booking is owned by the returned guard.
    /// `Err` when the request was not placed (it has ended).
    pub async fn placed(mut self) -> Result<Booking, Unplaced> {
        let rx = self
            .rx
            .as_mut()
            .expect("the receiver is present until resolved");
        let result = rx.await;
        self.rx = None;
        match result {
            Ok(Assignment::Dispatched {
                booking,
                worker,
                name,
                url,
                endpoint,
                overlap_blocks,
                waited_ms,
                progress,
                adapter_load,
            }) => Ok(Booking {
                driver: self.driver.clone(),
                id: self.id,
                booking,
                worker,
                name,
                url,
                endpoint,
                overlap_blocks,
                waited_ms,
                progress,
                adapter_load,
                first_token: false,
                completed: None,
                handed_over: false,
            }),
            Ok(Assignment::Shed {
                retry_after_ms,
                late,
            }) => Err(Unplaced::Shed {
                retry_after_ms,
                late,
            }),
            Ok(Assignment::NoWorkers) | Err(_) => Err(Unplaced::NoWorkers),
        }
    }
}

/// Why a waiting request was not placed; it has ended either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unplaced {
    /// No worker can take it (HTTP 503).
    NoWorkers,
    /// Admission shed it (HTTP 429 with `Retry-After`).
    Shed {
        /// Suggested `Retry-After`.
        retry_after_ms: u64,
        /// Its TTFT deadline could not be met.
        late: bool,
    },
}

impl Drop for WaitHandle {
    fn drop(&mut self) {
        if self.rx.take().is_some() {
            // Out of the queue, or freed if it was placed meanwhile.
            self.driver.abort(self.id);
        }
    }
}

/// A request booked on a worker (see the module docs).
#[derive(Debug)]
pub struct Booking {
    driver: Arc<Driver>,
    id: RequestId,
    booking: RequestId,
    /// The worker.
    pub worker: WorkerId,
    /// Its name.
    pub name: Arc<str>,
    /// Its base URL.
    pub url: Arc<str>,
    /// Its name and URL as requests use them.
    pub endpoint: Arc<crate::roster::Endpoint>,
    /// Blocks the router predicted cached.
    pub overlap_blocks: u32,
    /// Time queued before placement.
    pub waited_ms: f64,
    /// Load the request's LoRA adapter on the worker first.
    pub adapter_load: Option<switchyard_core::adapters::AdapterLoad>,
    progress: Option<ProgressUpdater>,
    first_token: bool,
    /// The response ended normally with this context length.
    completed: Option<u64>,
    /// Migrated: the request lives on in another guard.
    handed_over: bool,
}

impl Booking {
    /// The request (the id the client sees).
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// This booking's id: the request id for a first placement, a fresh
    /// one for each migration. What the worker is told.
    pub fn booking_id(&self) -> RequestId {
        self.booking
    }

    /// The first token arrived: prefill is done (once).
    pub fn mark_first_token(&mut self) {
        if std::mem::replace(&mut self.first_token, true) {
            return;
        }
        self.driver.first_token(self.id);
    }

    /// Live progress: `generated` tokens so far (no lock, no allocation).
    pub fn progress(&mut self, generated: u64) {
        if let Some(updater) = self.progress.as_mut() {
            updater.set(generated);
        }
    }

    /// The response ended normally with `context_tokens` (prompt plus
    /// generated); the drop then finishes rather than aborts.
    pub fn completed(&mut self, context_tokens: u64) {
        self.completed = Some(context_tokens);
    }

    /// The worker failed this request (connect refused, reset, 5xx,
    /// first-token timeout, broken stream): one failure for its circuit
    /// breaker, which takes it out of selection after `failure_threshold`
    /// in a row. The breaker hears it once per booking however often it is
    /// called — also after the first token: a stream that breaks mid-way
    /// counted a success at its first token and now counts a failure too,
    /// since a worker killed mid-stream is a failing worker. A failure of a
    /// request dispatched before the circuit last opened changes nothing.
    pub fn worker_failed(&self) {
        self.driver.metrics().upstream_failures.inc();
        self.driver.worker_failed(self.id);
    }

    /// This booking is a disaggregated request's prefill half, which
    /// answered and holds its KV for the decode
    /// ([`Driver::handed_over`]): the dispatcher ends it, and the
    /// handle of the decode half comes back when the dispatcher places
    /// that now (`None`: it is placed or waited for already).
    pub fn hand_over(mut self) -> Option<WaitHandle> {
        self.handed_over = true;
        let id = request_of(self.id);
        let rx = self.driver.handed_over(id)?;
        Some(WaitHandle::new(self.driver.clone(), id, rx))
    }

    /// Moves the request off this worker (report its failure first): its
    /// booking here is freed, this worker is never chosen for it again, and
    /// it waits for another under a new booking id — with `prompt` (its
    /// blocks and length) when the prompt changed, as for a stream resumed
    /// with its generated tokens. The request stays its session's current
    /// turn throughout.
    pub fn migrate(
        mut self,
        prompt: Option<(Vec<LocalHash>, u32)>,
    ) -> Result<WaitHandle, MigrateError> {
        let booking = self.driver.next_request_id();
        self.handed_over = true;
        let driver = self.driver.clone();
        match driver.migrate(self.id, booking, prompt) {
            Ok(rx) => Ok(WaitHandle::new(driver, self.id, rx)),
            Err(e) => {
                // Ended meanwhile (expired, or its worker left and it was
                // aborted): nothing to hand over.
                self.handed_over = false;
                Err(e)
            }
        }
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        if self.handed_over {
            return;
        }
        match self.completed {
            Some(context_tokens) => self.driver.finish(self.id, context_tokens),
            None => self.driver.abort(self.id),
        }
    }
}
