//! The streaming response body: the worker's SSE events on their way to the
//! client, resumed on another worker when the stream breaks.
//!
//! Pull-based: the worker's body is read only when the client asks for the
//! next chunk, one event at a time, so a slow client slows the read from
//! the worker (TCP back-pressure) instead of growing a buffer. Per stream
//! the router holds: one incomplete event (at most
//! [`super::proxy::MAX_EVENT_BYTES`] plus one frame), the event being
//! forwarded, the prompt's token ids and the client's body (both already
//! in memory for routing), and the generated tokens ([`Progress`]: 4 bytes
//! a token id, at most the migration sequence limit less the prompt, plus
//! not-yet-tokenized text capped at 32 bytes a token of the migration
//! sequence limit). Past those bounds the stream stops recording and can
//! no longer be resumed.
//!
//! Events of the first worker are forwarded byte for byte (only whole
//! events: a half event at a break is dropped). After a break the request
//! is re-issued as `/v1/completions` with the prompt plus the generated
//! ids ([`super::migration::resume_body`]), and the new worker's chunks are
//! rewritten into the original shape ([`StreamShape::rewrite`]). The client
//! sees one stream with one `[DONE]`, or an error event and the end when
//! the request cannot move (limit, length, no worker, request timeout).
//!
//! Dropping the body (the client went away) drops the upstream connection,
//! which cancels the worker's request, and frees the booking.

use super::error::ApiError;
use super::metrics::RequestStatus;
use super::migration::{self, Failure, Phase, Progress};
use super::proxy::{AttemptError, Attempts, MAX_EVENT_BYTES};
use super::state::Booking;
use super::tokenize::INLINE_CHARS;
use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use serde_json::Value;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;
use switchyard_wire::openai::{Api, Usage};
use switchyard_wire::sse::{
    classify, event_bytes, Chunk, Delta, SseParser, StreamShape, DONE_EVENT,
};

/// Bytes of generated text kept per token of the migration sequence limit.
const TEXT_BYTES_PER_TOKEN: u64 = 32;

/// What the proxy hands over once the first event has arrived.
pub(super) struct StreamStart {
    pub(super) attempts: Attempts,
    pub(super) api: Api,
    pub(super) booking: Booking,
    pub(super) upstream: Incoming,
    pub(super) parser: SseParser,
    pub(super) first: String,
    pub(super) prompt: Vec<u32>,
    pub(super) original: Bytes,
    pub(super) arrival: Instant,
}

/// One client stream across its workers. Owns the current [`Booking`]
/// (freed on drop) and the current upstream body (dropped: cancelled).
pub(super) struct MigratingStream {
    attempts: Attempts,
    api: Api,
    booking: Option<Booking>,
    upstream: Option<Incoming>,
    parser: SseParser,
    first: Option<String>,
    /// The current upstream is a resumed request: rewrite its chunks.
    resumed: bool,
    shape: Option<StreamShape>,
    progress: Progress,
    /// `progress.generated` when the current resume started.
    generated_at_resume: u64,
    prompt: Vec<u32>,
    original: Bytes,
    arrival: Instant,
    last_event: Option<Instant>,
    /// The response has ended (counted); nothing more is sent.
    ended: bool,
}

/// How a failure was handled.
enum Recovery {
    /// Another worker continues the stream.
    Resumed,
    /// Send these bytes, then end.
    End(Vec<u8>),
}

impl MigratingStream {
    /// Takes over a stream whose first event has arrived.
    pub(super) fn new(start: StreamStart) -> Self {
        let text_cap = start
            .attempts
            .state
            .migration
            .max_seq_len
            .saturating_mul(TEXT_BYTES_PER_TOKEN)
            .min(usize::MAX as u64) as usize;
        // Once prompt plus generated tokens pass the sequence limit the
        // stream cannot resume, so no more ids than that are worth keeping.
        let max_ids = start
            .attempts
            .state
            .migration
            .max_seq_len
            .saturating_sub(start.prompt.len() as u64)
            .min(usize::MAX as u64) as usize;
        Self {
            attempts: start.attempts,
            api: start.api,
            booking: Some(start.booking),
            upstream: Some(start.upstream),
            parser: start.parser,
            first: Some(start.first),
            resumed: false,
            shape: None,
            progress: Progress::bounded(text_cap, max_ids),
            generated_at_resume: 0,
            prompt: start.prompt,
            original: start.original,
            arrival: start.arrival,
            last_event: None,
            ended: false,
        }
    }

    /// The response body: polled by the client's connection, one event per
    /// poll.
    pub(super) fn into_body(self) -> Body {
        let events = futures_util::stream::unfold(self, |mut s| async move {
            let chunk = s.next().await?;
            Some((Ok::<Bytes, Infallible>(chunk), s))
        });
        Body::from_stream(events)
    }

    async fn next(&mut self) -> Option<Bytes> {
        if self.ended {
            return None;
        }
        let deadline = self.attempts.deadline;
        match tokio::time::timeout_at(deadline, self.next_event()).await {
            Ok(bytes) => bytes,
            Err(_) => {
                // Dropping the upstream cancels the worker's request.
                self.upstream = None;
                self.booking = None;
                let metrics = &self.attempts.state.shared.metrics;
                metrics.request_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(request = %self.attempts.client_id, "stream timed out: upstream cancelled");
                let error = ApiError::timeout(self.attempts.state.request_timeout);
                Some(self.end_with(RequestStatus::Unavailable, error_event(&error)))
            }
        }
    }

    async fn next_event(&mut self) -> Option<Bytes> {
        loop {
            let read = match self.first.take() {
                Some(first) => Ok(first),
                None => self.read_event().await,
            };
            let data = match read {
                Ok(data) => data,
                Err((reason, detail)) => match self.recover(reason, detail).await {
                    Recovery::Resumed => continue,
                    Recovery::End(bytes) => {
                        let status = if bytes.ends_with(DONE_EVENT) {
                            RequestStatus::Ok
                        } else {
                            RequestStatus::Unavailable
                        };
                        return Some(self.end_with(status, bytes));
                    }
                },
            };
            match classify(&data) {
                Chunk::Done => {
                    return Some(self.end_with(RequestStatus::Ok, DONE_EVENT.to_vec()));
                }
                Chunk::Error => {
                    let detail = "the worker sent an error event mid-stream".to_owned();
                    match self.recover(Failure::MidStream, detail).await {
                        Recovery::Resumed => continue,
                        Recovery::End(bytes) => {
                            return Some(self.end_with(RequestStatus::Unavailable, bytes))
                        }
                    }
                }
                Chunk::Unknown if self.resumed => continue,
                Chunk::Unknown => {
                    self.observe_event();
                    return Some(Bytes::from(event_bytes(&data)));
                }
                Chunk::Delta(delta) => {
                    self.observe_event();
                    self.progress.observe(
                        delta.text.as_deref(),
                        delta.token_ids.as_deref(),
                        delta.finish_reason.is_some(),
                    );
                    if let Some(booking) = self.booking.as_mut() {
                        booking.progress(self.progress.generated);
                    }
                    if !self.resumed {
                        if self.shape.is_none() && delta.usage.is_none() {
                            self.shape = Some(StreamShape::from_delta(self.api, &delta));
                        }
                        return Some(Bytes::from(event_bytes(&data)));
                    }
                    let usage = delta.usage.as_ref().map(|u| self.adjust_usage(u));
                    let shape = self.shape();
                    return Some(Bytes::from(shape.rewrite(&delta, usage)));
                }
            }
        }
    }

    /// Reads the current worker up to its next complete event. A break, an
    /// end without `[DONE]`, an oversized event or silence longer than the
    /// first-token timeout is a failure.
    async fn read_event(&mut self) -> Result<String, (Failure, String)> {
        let idle = self.attempts.state.first_token_timeout;
        loop {
            match self.parser.next_event() {
                Ok(Some(event)) => return Ok(event),
                Ok(None) => {}
                Err(e) => return Err((Failure::MidStream, e.to_string())),
            }
            let Some(upstream) = self.upstream.as_mut() else {
                return Err((Failure::MidStream, "no upstream".into()));
            };
            match tokio::time::timeout(idle, upstream.frame()).await {
                Err(_) => {
                    return Err((
                        Failure::Timeout,
                        format!("the worker sent nothing for {:.1} s", idle.as_secs_f64()),
                    ))
                }
                Ok(None) => {
                    return Err((
                        Failure::MidStream,
                        "the worker's stream ended without [DONE]".into(),
                    ))
                }
                Ok(Some(Err(_))) => {
                    return Err((Failure::MidStream, "the worker's stream broke".into()))
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.parser.push(&data);
                    }
                }
            }
        }
    }

    /// Moves the request to another worker after `reason`, until one
    /// accepts it or it cannot move.
    async fn recover(&mut self, mut reason: Failure, mut detail: String) -> Recovery {
        self.upstream = None;
        self.parser = SseParser::new(MAX_EVENT_BYTES);
        let mut failed = self.booking.take();
        let original: Value = serde_json::from_slice(&self.original).unwrap_or(Value::Null);
        let resumable = migration::resumable(&original);
        // Only the first choice of each chunk is read: a finish means the
        // whole generation is complete only for a single-choice request. A
        // request with several choices (or prompts) falls through to an
        // error event, as it cannot be resumed.
        if self.progress.finished && resumable.is_ok() {
            // Every token arrived; only the terminator was lost.
            return Recovery::End(DONE_EVENT.to_vec());
        }
        let prompt_tokens = self.prompt.len() as u64;
        loop {
            let client = self.attempts.client_id;
            let worker = failed.as_ref().map(|b| b.name.clone());
            tracing::warn!(request = %client, worker = worker.as_deref().unwrap_or("-"), reason = reason.label(), %detail, generated = self.progress.generated, "stream failed");
            if let Some(booking) = failed.take() {
                if let Err(why) = self.attempts.fail(
                    booking,
                    reason,
                    Phase::MidStream,
                    prompt_tokens,
                    &self.progress,
                    resumable,
                ) {
                    return Recovery::End(error_event(&ApiError::bad_gateway(format!(
                        "{detail}; {why}"
                    ))));
                }
            }
            if let Err(e) = self.tokenize_pending().await {
                return Recovery::End(error_event(&e));
            }
            if self.progress.overflowed() {
                // Re-tokenized text passed the bound on kept ids: what
                // was generated is no longer known, so it cannot resume.
                return Recovery::End(error_event(&ApiError::bad_gateway(format!(
                    "{detail}; the stream cannot be resumed: the generated text outgrew what the router keeps"
                ))));
            }
            let remaining =
                migration::max_tokens(&original).map(|m| m.saturating_sub(self.progress.generated));
            if remaining == Some(0) {
                let finish = Delta {
                    finish_reason: Some("length".into()),
                    ..Delta::default()
                };
                let mut bytes = self.shape().rewrite(&finish, None);
                bytes.extend_from_slice(DONE_EVENT);
                return Recovery::End(bytes);
            }
            let mut prompt =
                Vec::with_capacity(self.prompt.len().saturating_add(self.progress.ids().len()));
            prompt.extend_from_slice(&self.prompt);
            prompt.extend_from_slice(self.progress.ids());
            let body = migration::resume_body(&original, &prompt, remaining);
            let booking = match self.attempts.book(&prompt, None).await {
                Ok(b) => b,
                Err(e) => return Recovery::End(error_event(&e)),
            };
            let sent = self
                .attempts
                .send(
                    &booking,
                    "/v1/completions",
                    Bytes::from(body.to_string()),
                    true,
                )
                .await;
            match sent {
                Ok(response) if response.status().is_success() => {
                    tracing::info!(request = %client, worker = %booking.name, resumed_at = self.progress.generated, "stream resumed on another worker");
                    self.upstream = Some(response.into_body());
                    self.booking = Some(booking);
                    self.resumed = true;
                    self.generated_at_resume = self.progress.generated;
                    return Recovery::Resumed;
                }
                Ok(response) => {
                    return Recovery::End(error_event(&ApiError::bad_gateway(format!(
                        "worker {} refused the resumed request with status {}",
                        booking.name,
                        response.status().as_u16()
                    ))))
                }
                Err(AttemptError::Fatal(e)) => return Recovery::End(error_event(&e)),
                Err(AttemptError::Retry(r, d)) => {
                    reason = r;
                    detail = d;
                    failed = Some(booking);
                }
            }
        }
    }

    /// Turns generated text the worker sent without ids into ids, with the
    /// router's tokenizer (on a blocking thread when long).
    async fn tokenize_pending(&mut self) -> Result<(), ApiError> {
        let text = self.progress.take_pending_text();
        if text.is_empty() {
            return Ok(());
        }
        let tokenizer = self.attempts.state.tokenizer.clone();
        let ids = if text.len() <= INLINE_CHARS {
            tokenizer.encode(&text)
        } else {
            tokio::task::spawn_blocking(move || tokenizer.encode(&text))
                .await
                .map_err(|_| ApiError::internal("the tokenizer task failed"))?
        }
        .map_err(|e| ApiError::internal(format!("cannot tokenize the generated text: {e}")))?;
        self.progress.extend_ids(&ids);
        Ok(())
    }

    /// The original response's identity (a made-up one if the first worker
    /// never sent a chunk with it).
    fn shape(&mut self) -> StreamShape {
        let api = self.api;
        let client = self.attempts.client_id;
        self.shape
            .get_or_insert_with(|| {
                let prefix = match api {
                    Api::Chat => "chatcmpl",
                    Api::Completions => "cmpl",
                };
                StreamShape {
                    api,
                    id: format!("{prefix}-{client}"),
                    model: String::new(),
                    created: 0,
                }
            })
            .clone()
    }

    /// A resumed worker's usage, as the whole request's: the original
    /// prompt, and the tokens generated by every worker.
    fn adjust_usage(&self, usage: &Usage) -> Usage {
        let completion = usage
            .completion_tokens
            .saturating_add(self.generated_at_resume);
        usage.with_counts(self.prompt.len() as u64, completion)
    }

    /// Latency metrics and the booking's first token.
    fn observe_event(&mut self) {
        let now = Instant::now();
        let metrics = &self.attempts.state.shared.metrics;
        match self.last_event {
            None => metrics.ttft.observe((now - self.arrival).as_secs_f64()),
            Some(last) => metrics.itl.observe((now - last).as_secs_f64()),
        }
        self.last_event = Some(now);
        if let Some(booking) = self.booking.as_mut() {
            booking.mark_first_token();
        }
    }

    /// Ends the response with `bytes` as its last chunk.
    fn end_with(&mut self, status: RequestStatus, bytes: Vec<u8>) -> Bytes {
        self.ended = true;
        if let Some(mut booking) = self.booking.take() {
            if status == RequestStatus::Ok {
                booking
                    .completed((self.prompt.len() as u64).saturating_add(self.progress.generated));
            }
        }
        self.upstream = None;
        self.attempts.state.shared.metrics.count_request(status);
        Bytes::from(bytes)
    }
}

impl Drop for MigratingStream {
    fn drop(&mut self) {
        if !self.ended {
            self.attempts
                .state
                .shared
                .metrics
                .count_request(RequestStatus::Cancelled);
            tracing::debug!(request = %self.attempts.client_id, "client went away: upstream cancelled");
        }
    }
}

/// An OpenAI-style error as an SSE event.
fn error_event(error: &ApiError) -> Vec<u8> {
    event_bytes(&error.body().to_json())
}
