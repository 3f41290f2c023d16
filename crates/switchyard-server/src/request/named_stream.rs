//! The streaming body of a Responses or Messages request: the worker's
//! named events (`event: <name>` and `data:` lines) forwarded unchanged,
//! one whole event at a time, paced by the client by the same loop as
//! chat streams ([`crate::request::stream::paced_body`]: a task of its own
//! hands each event to the body and keeps the request timeout whether or
//! not the client reads).
//!
//! Read on the way: the first event (first-token time, the booking's
//! prefill done), text deltas (the booking's progress), a Responses
//! `response.created` (a stored response's id remembered with its
//! worker), and the end (`response.completed` / `response.incomplete`,
//! `message_stop`: the booking finished with its context length).
//!
//! A stream that breaks (the worker resets, goes silent past the
//! first-token timeout, sends an error event or ends before its last
//! event) is reported against the worker; a plain text stream is then
//! resumed on another worker as chat streams are
//! ([`crate::request::stream::move_stream`]), its completion chunks
//! rewritten into the API's events ([`switchyard_wire::resume::agentic`]),
//! and any other ends with an error event in the API's own shape saying
//! why it could not move ([`switchyard_wire::resume::agentic::resumable`]).
//! Per stream the router holds one incomplete event (at most
//! [`crate::request::MAX_EVENT_BYTES`] plus one frame), the
//! event being forwarded, the generated tokens as a chat stream does
//! ([`Progress::bounded`]) and, for Responses, the generated text (bounded
//! alike).

use crate::driver::booking::Booking;
use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::agentic::{AgenticDelivery, EventKind};
use crate::request::attempt::Attempts;
use crate::request::stream::{move_stream, Moved, PacedStream};
use crate::request::MAX_EVENT_BYTES;
use axum::body::Body;
use bytes::Bytes;
use hyper::body::Incoming;
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::dispatch::failure::{Failure, Progress};
use switchyard_wire::body_fields::Fields;
use switchyard_wire::resume::agentic::{self as agentic_resume, Resume};
use switchyard_wire::sse::{classify_ref, ChunkRef, NamedEvent, SseParser};

/// What the proxy hands over once the first event has arrived.
pub(crate) struct NamedStart {
    pub(crate) attempts: Attempts,
    pub(crate) booking: Booking,
    pub(crate) upstream: Incoming,
    pub(crate) parser: SseParser,
    pub(crate) first: NamedEvent,
    pub(crate) agentic: Arc<AgenticDelivery>,
    pub(crate) prompt_tokens: u64,
    /// The prompt's token ids as routed (the resumed prompt's start).
    pub(crate) prompt: Vec<u32>,
    /// The client's body (read again when the stream breaks).
    pub(crate) original: Bytes,
    pub(crate) arrival: Instant,
}

/// The response body of a stream whose first event has arrived.
pub(crate) fn into_body(start: NamedStart) -> Body {
    let progress = crate::request::stream::bounded_progress(&start.attempts, start.prompt.len());
    // A stored response is never resumed: its text is not kept.
    let text_cap = match start.agentic.remember {
        Some(_) => 0,
        None => progress.text_cap(),
    };
    let resume = Resume::new(start.agentic.api, text_cap, start.attempts.client_id);
    crate::request::stream::paced_body(NamedStream {
        attempts: start.attempts,
        booking: Some(start.booking),
        upstream: start.upstream,
        parser: start.parser,
        first: Some(start.first),
        agentic: start.agentic,
        prompt_tokens: start.prompt_tokens,
        prompt: start.prompt,
        original: start.original,
        arrival: start.arrival,
        progress,
        resume,
        resumed: false,
        forwarded: 0,
        last_event: None,
    })
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
    prompt: Vec<u32>,
    original: Bytes,
    arrival: Instant,
    /// What has been generated (what a resumed request needs).
    progress: Progress,
    /// What the client has seen, and the rewrite of a resumed worker's
    /// chunks.
    resume: Resume,
    /// The worker read now answers a resumed `/v1/completions` request.
    resumed: bool,
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
        self.attempts.state.driver.metrics().count_request(status);
        self.agentic.metrics.count(self.agentic.api, status);
    }

    /// Ends the response: a normal end finishes the booking with its
    /// context length, any other drops it (the request aborted).
    fn end(&mut self, status: RequestStatus) {
        if let Some(mut booking) = self.booking.take() {
            if status == RequestStatus::Ok {
                booking.completed(self.prompt_tokens.saturating_add(self.progress.generated));
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
    async fn next_bytes(&mut self) -> (Bytes, bool) {
        let idle = self.attempts.state.upstream.first_token_timeout;
        loop {
            let event = match self.read(idle).await {
                Ok(event) => event,
                Err((reason, detail)) => match self.broken(reason, detail).await {
                    Some(bytes) => return (Bytes::from(bytes), true),
                    None => continue,
                },
            };
            if self.resumed {
                match self.rewrite(event).await {
                    Some(next) => return next,
                    None => continue,
                }
            }
            self.observe();
            let text = self.resume.observe(event.data());
            let kind = self.agentic.classify(event.data());
            let ended = match kind {
                EventKind::Created(id) => {
                    if let (Some(remember), Some(booking)) = (&self.agentic.remember, &self.booking)
                    {
                        remember.record(&id, booking.worker);
                    }
                    false
                }
                EventKind::Delta => {
                    // One token an event, as the engines stream them; a
                    // delta without text (another block's) counts none.
                    self.progress.observe(text.as_deref(), None, false);
                    let generated = self.progress.generated;
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
            return (Bytes::from(event.into_bytes()), ended);
        }
    }

    /// A resumed worker's event as the client's: `None` when it shows the
    /// client nothing (read on).
    async fn rewrite(&mut self, event: NamedEvent) -> Option<(Bytes, bool)> {
        let prompt_tokens = self.prompt_tokens;
        match classify_ref(event.data()) {
            ChunkRef::Done => {
                let bytes = self
                    .resume
                    .finish("stop", self.progress.generated, prompt_tokens);
                self.end(RequestStatus::Ok);
                Some((Bytes::from(bytes), true))
            }
            ChunkRef::Error => {
                let detail = "the worker sent an error event mid-stream".to_owned();
                self.broken(Failure::MidStream, detail)
                    .await
                    .map(|bytes| (Bytes::from(bytes), true))
            }
            ChunkRef::Unknown => None,
            ChunkRef::Delta(delta) => {
                self.observe();
                self.progress.observe(
                    delta.text.as_deref(),
                    delta.token_ids.as_deref(),
                    delta.finish_reason.is_some(),
                );
                let generated = self.progress.generated;
                if let Some(booking) = self.booking.as_mut() {
                    booking.progress(generated);
                }
                let finished = delta.finish_reason.is_some();
                let bytes = self
                    .resume
                    .rewrite(&delta.into_owned(), generated, prompt_tokens);
                if finished {
                    // The rest of the worker's stream (usage, `[DONE]`)
                    // adds nothing the client is shown.
                    self.end(RequestStatus::Ok);
                    return Some((Bytes::from(bytes), true));
                }
                (!bytes.is_empty()).then(|| {
                    self.forwarded += 1;
                    (Bytes::from(bytes), false)
                })
            }
        }
    }

    /// The stream broke: the worker is reported and the request resumed
    /// on another worker (`None`: read on) when it may be; otherwise the
    /// client is told why in the API's error event, or given the closing
    /// events when every token had arrived.
    async fn broken(&mut self, reason: Failure, detail: String) -> Option<Vec<u8>> {
        let Some(failed) = self.booking.take() else {
            self.count(RequestStatus::Unavailable);
            return Some(self.agentic.error_event(&detail, self.resume_sequence()));
        };
        let api = self.agentic.api;
        // Read by field, without a JSON tree, as chat's resume does.
        let original_body = self.original.clone();
        let (original, parsed) = match Fields::parse(&original_body) {
            Ok(fields) => (fields, Ok(())),
            Err(_) => (Fields::default(), Err("its body is not a JSON object")),
        };
        let resumable = parsed
            .and_then(|()| agentic_resume::resumable(api, &original))
            .and_then(|()| self.attempts.resume_by_ids())
            .and_then(|()| match self.resume.overflowed() {
                true => Err("the generated text outgrew what the router keeps"),
                false => Ok(()),
            });
        let prompt_tokens = self.prompt_tokens;
        if self.resume.closed() && resumable.is_ok() {
            // Every token arrived; only the closing events were lost.
            let mut booking = failed;
            booking.completed(prompt_tokens.saturating_add(self.progress.generated));
            let bytes = self
                .resume
                .finish("stop", self.progress.generated, prompt_tokens);
            self.count(RequestStatus::Ok);
            return Some(bytes);
        }
        let worker = failed.name.clone();
        let moved = move_stream(
            &mut self.attempts,
            Some(failed),
            (reason, detail),
            &mut self.progress,
            &self.prompt,
            resumable,
            agentic_resume::max_tokens(api, &original),
            |prompt, remaining| agentic_resume::resume_body(api, &original, prompt, remaining),
        )
        .await;
        match moved {
            Moved::Resumed(booking, upstream) => {
                self.booking = Some(booking);
                self.upstream = upstream;
                self.parser = SseParser::new(MAX_EVENT_BYTES);
                self.resumed = true;
                None
            }
            Moved::AllArrived => {
                let bytes = self
                    .resume
                    .finish("length", self.progress.generated, prompt_tokens);
                self.count(RequestStatus::Ok);
                Some(bytes)
            }
            Moved::Failed(e) => {
                tracing::warn!(request = %self.attempts.client_id, %worker, reason = reason.label(), "stream broke; not resumed");
                self.count(RequestStatus::Unavailable);
                let message = e.body().error.message.clone();
                Some(self.agentic.error_event(&message, self.resume_sequence()))
            }
        }
    }

    /// The next Responses `sequence_number`.
    fn resume_sequence(&self) -> u64 {
        self.resume.sequence().max(self.forwarded)
    }

    /// Latency metrics and the booking's first token.
    fn observe(&mut self) {
        let now = Instant::now();
        let metrics = self.attempts.state.driver.metrics();
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

impl PacedStream for NamedStream {
    fn attempts(&self) -> &Attempts {
        &self.attempts
    }

    async fn next(&mut self) -> Option<(Bytes, bool)> {
        Some(self.next_bytes().await)
    }

    /// The API's error event; the worker's request is cancelled and the
    /// booking dropped with the stream.
    fn time_out(mut self) -> Bytes {
        let error = ApiError::timeout(self.attempts.state.upstream.request_timeout);
        let bytes = self
            .agentic
            .error_event(&error.body().error.message, self.resume_sequence());
        self.booking = None;
        self.count(RequestStatus::Unavailable);
        Bytes::from(bytes)
    }
}
