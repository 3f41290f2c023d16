//! The streaming body of a Responses or Messages request: the worker's
//! named events (`event: <name>` and `data:` lines) forwarded unchanged,
//! one whole event at a time, paced by the client as chat streams are
//! (a task of its own hands each event to the body through a one-event
//! channel, and keeps the request timeout whether or not the client
//! reads: [`crate::request::stream::events_body`]).
//!
//! Read on the way: the first event (first-token time, the booking's
//! prefill done), text deltas (the booking's progress), a Responses
//! `response.created` (a stored response's id remembered with its
//! worker), and the end (`response.completed` / `response.incomplete`,
//! `message_stop`: the booking finished with its context length).
//!
//! Not resumed: a stream that breaks (the worker resets, goes silent past
//! the first-token timeout, sends an error event or ends before its last
//! event) is reported against the worker and ends with an error event in
//! the API's own shape saying why it could not move
//! ([`crate::request::agentic::not_resumable`]). Per stream the router
//! holds one incomplete event (at most
//! [`crate::request::context::MAX_EVENT_BYTES`] plus one frame) and the
//! event being forwarded.

use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::agentic::{AgenticDelivery, EventKind};
use crate::request::attempt::Attempts;
use crate::request::booking::Booking;
use crate::request::migration::{Failure, Phase, Progress};
use axum::body::Body;
use bytes::Bytes;
use hyper::body::Incoming;
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_wire::sse::{NamedEvent, SseParser};
use tokio::sync::{mpsc, oneshot};

/// What the proxy hands over once the first event has arrived.
pub(crate) struct NamedStart {
    pub(crate) attempts: Attempts,
    pub(crate) booking: Booking,
    pub(crate) upstream: Incoming,
    pub(crate) parser: SseParser,
    pub(crate) first: NamedEvent,
    pub(crate) agentic: Arc<AgenticDelivery>,
    pub(crate) prompt_tokens: u64,
    pub(crate) arrival: Instant,
}

/// The response body of a stream whose first event has arrived.
pub(crate) fn into_body(start: NamedStart) -> Body {
    let (tx, gone, body) = crate::request::stream::events_body();
    tokio::spawn(run(
        NamedStream {
            attempts: start.attempts,
            booking: Some(start.booking),
            upstream: start.upstream,
            parser: start.parser,
            first: Some(start.first),
            agentic: start.agentic,
            prompt_tokens: start.prompt_tokens,
            arrival: start.arrival,
            generated: 0,
            forwarded: 0,
            last_event: None,
        },
        tx,
        gone,
    ));
    body
}

struct NamedStream {
    attempts: Attempts,
    /// `None` once the response has ended (counted).
    booking: Option<Booking>,
    upstream: Incoming,
    parser: SseParser,
    first: Option<NamedEvent>,
    agentic: Arc<AgenticDelivery>,
    prompt_tokens: u64,
    arrival: Instant,
    generated: u64,
    /// Events forwarded (the next Responses `sequence_number`).
    forwarded: u64,
    last_event: Option<Instant>,
}

impl Drop for NamedStream {
    fn drop(&mut self) {
        if self.booking.is_some() {
            self.count(RequestStatus::Cancelled);
            tracing::debug!(request = %self.attempts.client_id, "client went away: upstream cancelled");
        }
    }
}

impl NamedStream {
    fn count(&self, status: RequestStatus) {
        self.attempts.state.shared.metrics().count_request(status);
        self.agentic.state.count(self.agentic.api, status);
    }

    /// Ends the response: a normal end finishes the booking with its
    /// context length, any other drops it (the request aborted).
    fn end(&mut self, status: RequestStatus) {
        if let Some(mut booking) = self.booking.take() {
            if status == RequestStatus::Ok {
                booking.completed(self.prompt_tokens.saturating_add(self.generated));
            }
        }
        self.count(status);
    }

    /// The next event: the waiting first one, or one read from the worker.
    async fn read(&mut self, idle: Duration) -> Result<NamedEvent, (Failure, String)> {
        if let Some(first) = self.first.take() {
            return Ok(first);
        }
        loop {
            match self.parser.next_event_named() {
                Ok(Some(event)) => return Ok(event),
                Ok(None) => {}
                Err(e) => return Err((Failure::MidStream, e.to_string())),
            }
            super::stream::pull_frame(
                &mut self.upstream,
                &mut self.parser,
                idle,
                "the worker's stream ended before its last event",
            )
            .await?;
        }
    }

    /// The bytes to send next, and whether they end the response.
    async fn next(&mut self) -> (Bytes, bool) {
        let idle = self.attempts.state.first_token_timeout;
        match self.read(idle).await {
            Ok(event) => {
                self.observe();
                let kind = self.agentic.classify(event.data());
                let ended = match kind {
                    EventKind::Created(id) => {
                        if let (Some(remember), Some(booking)) =
                            (&self.agentic.remember, &self.booking)
                        {
                            remember.record(&id, booking.worker);
                        }
                        false
                    }
                    EventKind::Delta => {
                        self.generated += 1;
                        let generated = self.generated;
                        if let Some(booking) = self.booking.as_mut() {
                            booking.progress(generated);
                        }
                        false
                    }
                    EventKind::End => {
                        self.end(RequestStatus::Ok);
                        true
                    }
                    EventKind::Error => {
                        // The worker's own error, passed on as it sent it.
                        self.end(RequestStatus::WorkerError);
                        true
                    }
                    EventKind::Other => false,
                };
                self.forwarded += 1;
                (Bytes::from(event.into_bytes()), ended)
            }
            Err((reason, detail)) => (Bytes::from(self.broken(reason, &detail)), true),
        }
    }

    /// The stream broke: the worker is reported, the request not moved,
    /// and the client told why in the API's error event.
    fn broken(&mut self, reason: Failure, detail: &str) -> Vec<u8> {
        let why = self.agentic.not_resumable;
        let message = match self.booking.take() {
            Some(booking) => {
                let worker = booking.name.clone();
                let progress = Progress::default();
                let gave_up = self
                    .attempts
                    .fail(
                        booking,
                        reason,
                        Phase::MidStream,
                        self.prompt_tokens,
                        &progress,
                        Err(why),
                    )
                    .err();
                tracing::warn!(request = %self.attempts.client_id, %worker, reason = reason.label(), %detail, "stream broke; not resumed");
                match gave_up {
                    Some(give_up) => format!("the worker's stream broke ({detail}); {give_up}"),
                    None => format!("the worker's stream broke ({detail}); {why}"),
                }
            }
            None => detail.to_owned(),
        };
        self.count(RequestStatus::Unavailable);
        self.agentic.error_event(&message, self.forwarded)
    }

    /// Latency metrics and the booking's first token.
    fn observe(&mut self) {
        let now = Instant::now();
        let metrics = self.attempts.state.shared.metrics();
        match self.last_event {
            None => metrics.ttft.observe((now - self.arrival).as_secs_f64()),
            Some(last) => metrics.itl.observe((now - last).as_secs_f64()),
        }
        self.last_event = Some(now);
        if let Some(booking) = self.booking.as_mut() {
            booking.mark_first_token();
        }
    }
}

/// Forwards events to `tx` until the response ends, the client goes away
/// or the request timeout passes (then the worker's request is cancelled,
/// the booking dropped, and the client gets an error event when it reads
/// on).
async fn run(mut s: NamedStream, tx: mpsc::Sender<Bytes>, mut gone: oneshot::Receiver<()>) {
    let deadline = tokio::time::sleep_until(s.attempts.deadline);
    tokio::pin!(deadline);
    loop {
        let (bytes, ended) = tokio::select! {
            biased;
            () = &mut deadline => break,
            _ = &mut gone => return,
            next = s.next() => next,
        };
        if ended {
            drop(s);
            let _ = tx.send(bytes).await;
            return;
        }
        tokio::select! {
            biased;
            () = &mut deadline => break,
            sent = tx.send(bytes) => {
                if sent.is_err() {
                    return;
                }
            }
        }
    }
    s.attempts.state.shared.metrics().request_timeouts.inc();
    tracing::info!(request = %s.attempts.client_id, "stream timed out: upstream cancelled");
    let error = ApiError::timeout(s.attempts.state.request_timeout);
    let bytes = s
        .agentic
        .error_event(&error.body().error.message, s.forwarded);
    s.booking = None;
    s.count(RequestStatus::Unavailable);
    drop(s);
    let _ = tx.send(Bytes::from(bytes)).await;
}
