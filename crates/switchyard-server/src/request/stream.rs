//! The streaming response body: the worker's SSE events on their way to the
//! client, resumed on another worker when the stream breaks.
//!
//! Paced by the client: the stream runs in a task of its own that reads
//! the worker one event at a time and hands each to the client's body
//! through a one-event channel, so the worker is read at most one event
//! ahead of the client and a slow client slows the read from the worker
//! (TCP back-pressure) instead of growing a buffer. The task, not the
//! client's polling, keeps the request timeout: a client that stops
//! reading still has its worker's request cancelled and its booking
//! freed at the timeout. Per stream the router holds: one incomplete
//! event (at most
//! [`crate::request::MAX_EVENT_BYTES`] plus one frame), the event being
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
//! ids ([`switchyard_wire::resume::resume_body`]), and the new worker's chunks are
//! rewritten into the original shape ([`StreamShape::rewrite`]). The client
//! sees one stream with one `[DONE]`, or an error event and the end when
//! the request cannot move (limit, length, no worker, a request the
//! resume cannot reproduce — [`switchyard_wire::resume::resumable`] —, the
//! request timeout).
//!
//! The migration loop itself ([`move_stream`]) is shared with the
//! Responses and Messages streams ([`crate::request::named_stream`]),
//! which rewrite the resumed chunks into their own events.
//!
//! The stream is a small state machine ([`State`]): its first event
//! waiting to be forwarded, then forwarding one worker's *leg* (its
//! booking, its response body and parser), then ended. A migration
//! replaces the leg: the failed leg's booking moves on with the request
//! (still its session's turn) and a resumed leg's chunks are rewritten.
//!
//! Dropping the body (the client went away) stops the task, which drops
//! the upstream connection, cancelling the worker's request, and aborts
//! the request.

use crate::driver::booking::Booking;
use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::attempt::{AttemptError, Attempts};
use crate::request::MAX_EVENT_BYTES;
use crate::tokenize::INLINE_CHARS;
use axum::body::Body;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use switchyard_core::dispatch::failure::{Failure, Phase, Progress};
use switchyard_wire::body_fields::Fields;
use switchyard_wire::openai::{Api, Usage};
use switchyard_wire::resume as migration;
use switchyard_wire::sse::{
    classify_ref, event_bytes, ChunkRef, Delta, Event, SseParser, StreamShape, DONE_EVENT,
};
use tokio::sync::{mpsc, oneshot};

/// What the proxy hands over once the first event has arrived.
pub(crate) struct StreamStart {
    pub(crate) attempts: Attempts,
    pub(crate) api: Api,
    pub(crate) booking: Booking,
    pub(crate) upstream: Incoming,
    pub(crate) parser: SseParser,
    pub(crate) first: Event,
    pub(crate) prompt: Vec<u32>,
    pub(crate) original: Bytes,
    pub(crate) arrival: Instant,
}

/// One worker's part of the stream.
struct Leg {
    /// The request's booking on the worker (its drop ends the request
    /// unless it moved on).
    booking: Booking,
    /// The worker's response body (its drop cancels the worker's request).
    upstream: Incoming,
    parser: SseParser,
    /// A resumed request: its chunks are rewritten into the original shape.
    resumed: bool,
}

/// Where the stream is.
enum State {
    /// The first worker's first event, not yet forwarded.
    First {
        /// The leg it came from.
        leg: Leg,
        /// The event, as it is forwarded.
        event: Event,
    },
    /// Forwarding the leg's events.
    Streaming(Leg),
    /// The response has ended (counted); nothing more is sent.
    Ended,
}

/// One client stream across its workers.
pub(crate) struct MigratingStream {
    attempts: Attempts,
    api: Api,
    state: State,
    shape: Option<StreamShape>,
    progress: Progress,
    /// `progress.generated` when the current leg started.
    generated_at_resume: u64,
    prompt: Vec<u32>,
    original: Bytes,
    arrival: Instant,
    last_event: Option<Instant>,
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
    pub(crate) fn new(start: StreamStart) -> Self {
        let progress = bounded_progress(&start.attempts, start.prompt.len());
        Self {
            attempts: start.attempts,
            api: start.api,
            state: State::First {
                leg: Leg {
                    booking: start.booking,
                    upstream: start.upstream,
                    parser: start.parser,
                    resumed: false,
                },
                event: start.first,
            },
            shape: None,
            progress,
            generated_at_resume: 0,
            prompt: start.prompt,
            original: start.original,
            arrival: start.arrival,
            last_event: None,
        }
    }

    /// The response body ([`paced_body`]: the stream runs in a task of
    /// its own, so its request timeout fires whether or not the client
    /// reads).
    pub(crate) fn into_body(self) -> Body {
        paced_body(self)
    }

    /// The current leg's next event: the waiting first one, or one read
    /// from the worker.
    async fn read(&mut self, idle: Duration) -> Result<Event, (Failure, String)> {
        if matches!(self.state, State::First { .. }) {
            if let State::First { leg, event } = std::mem::replace(&mut self.state, State::Ended) {
                self.state = State::Streaming(leg);
                return Ok(event);
            }
        }
        match &mut self.state {
            State::Streaming(leg) => read_event(leg, idle).await,
            State::First { .. } | State::Ended => {
                Err((Failure::MidStream, "the stream has no worker".into()))
            }
        }
    }

    /// The current leg, while there is one.
    fn leg(&mut self) -> Option<&mut Leg> {
        match &mut self.state {
            State::First { leg, .. } | State::Streaming(leg) => Some(leg),
            State::Ended => None,
        }
    }

    async fn next_event(&mut self) -> Option<Bytes> {
        let idle = self.attempts.state.upstream.first_token_timeout;
        loop {
            let event = match self.read(idle).await {
                Ok(event) => event,
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
            let resumed = self.leg().is_some_and(|leg| leg.resumed);
            // The chunk borrows the event's data; a first worker's event is
            // then forwarded as the bytes it was parsed into (no copy).
            match classify_ref(event.data()) {
                ChunkRef::Done => {
                    return Some(self.end_with(RequestStatus::Ok, DONE_EVENT.to_vec()));
                }
                ChunkRef::Error => {
                    let detail = "the worker sent an error event mid-stream".to_owned();
                    match self.recover(Failure::MidStream, detail).await {
                        Recovery::Resumed => continue,
                        Recovery::End(bytes) => {
                            return Some(self.end_with(RequestStatus::Unavailable, bytes))
                        }
                    }
                }
                ChunkRef::Unknown if resumed => continue,
                ChunkRef::Unknown => {
                    self.observe_event();
                    return Some(Bytes::from(event.into_bytes()));
                }
                ChunkRef::Delta(delta) => {
                    self.observe_event();
                    self.progress.observe(
                        delta.text.as_deref(),
                        delta.token_ids.as_deref(),
                        delta.finish_reason.is_some(),
                    );
                    let generated = self.progress.generated;
                    if let Some(leg) = self.leg() {
                        leg.booking.progress(generated);
                    }
                    if !resumed {
                        if self.shape.is_none() && delta.usage.is_none() {
                            self.shape =
                                Some(StreamShape::from_delta(self.api, &delta.into_owned()));
                        }
                        return Some(Bytes::from(event.into_bytes()));
                    }
                    let delta: Delta = delta.into_owned();
                    let usage = delta.usage.as_ref().map(|u| self.adjust_usage(u));
                    let shape = self.shape();
                    return Some(Bytes::from(shape.rewrite(&delta, usage)));
                }
            }
        }
    }

    /// Moves the request to another worker after `reason`, until one
    /// accepts it or it cannot move.
    async fn recover(&mut self, reason: Failure, detail: String) -> Recovery {
        // The failed leg's body is dropped here (the worker's request is
        // cancelled); its booking goes on with the request.
        let failed = match std::mem::replace(&mut self.state, State::Ended) {
            State::First { leg, .. } | State::Streaming(leg) => Some(leg.booking),
            State::Ended => None,
        };
        // Read by field, without a JSON tree ([`switchyard_wire::body_fields`]).
        let original_body = self.original.clone();
        let (original, parsed) = match Fields::parse(&original_body) {
            Ok(fields) => (fields, Ok(())),
            Err(_) => (Fields::default(), Err("its body is not a JSON object")),
        };
        // What the request asks for first (a client learns that its own
        // request cannot be reproduced), then whether its ids are the
        // engine's.
        let resumable = parsed
            .and_then(|()| migration::resumable(self.api, &original))
            .and_then(|()| self.attempts.resume_by_ids());
        let context = (self.prompt.len() as u64).saturating_add(self.progress.generated);
        // Only the first choice of each chunk is read: a finish means the
        // whole generation is complete only for a single-choice request. A
        // request with several choices (or prompts) falls through to an
        // error event, as it cannot be resumed.
        if self.progress.finished && resumable.is_ok() {
            // Every token arrived; only the terminator was lost.
            if let Some(mut booking) = failed {
                booking.completed(context);
            }
            return Recovery::End(DONE_EVENT.to_vec());
        }
        let max_tokens = migration::max_tokens(&original);
        let moved = move_stream(
            &mut self.attempts,
            failed,
            (reason, detail),
            &mut self.progress,
            &self.prompt,
            resumable,
            max_tokens,
            |prompt, remaining| migration::resume_body(&original, prompt, remaining),
        )
        .await;
        match moved {
            Moved::Resumed(booking, upstream) => {
                self.state = State::Streaming(Leg {
                    booking,
                    upstream,
                    parser: SseParser::new(MAX_EVENT_BYTES),
                    resumed: true,
                });
                self.generated_at_resume = self.progress.generated;
                Recovery::Resumed
            }
            Moved::AllArrived => {
                let finish = Delta {
                    finish_reason: Some("length".into()),
                    ..Delta::default()
                };
                let mut bytes = self.shape().rewrite(&finish, None);
                bytes.extend_from_slice(DONE_EVENT);
                Recovery::End(bytes)
            }
            Moved::Failed(e) => Recovery::End(error_event(&e)),
        }
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
        let metrics = self.attempts.state.driver.metrics();
        match self.last_event {
            None => metrics.ttft.observe((now - self.arrival).as_secs_f64()),
            Some(last) => metrics.itl.observe((now - last).as_secs_f64()),
        }
        self.last_event = Some(now);
        if let Some(leg) = self.leg() {
            leg.booking.mark_first_token();
        }
    }

    /// Ends the response with `bytes` as its last chunk: a normal end
    /// finishes the request with its context length, any other aborts it;
    /// the worker's body is dropped either way.
    fn end_with(&mut self, status: RequestStatus, bytes: Vec<u8>) -> Bytes {
        let context = (self.prompt.len() as u64).saturating_add(self.progress.generated);
        if let State::First { mut leg, .. } | State::Streaming(mut leg) =
            std::mem::replace(&mut self.state, State::Ended)
        {
            if status == RequestStatus::Ok {
                leg.booking.completed(context);
            }
        }
        self.attempts.state.driver.metrics().count_request(status);
        Bytes::from(bytes)
    }
}

impl PacedStream for MigratingStream {
    fn attempts(&self) -> &Attempts {
        &self.attempts
    }

    async fn next(&mut self) -> Option<(Bytes, bool)> {
        let bytes = self.next_event().await?;
        Some((bytes, matches!(self.state, State::Ended)))
    }

    fn time_out(mut self) -> Bytes {
        let error = ApiError::timeout(self.attempts.state.upstream.request_timeout);
        // Ending drops the leg: the worker's request is cancelled and the
        // booking freed, now, whether or not the client reads.
        self.end_with(RequestStatus::Unavailable, error_event(&error))
    }
}

impl Drop for MigratingStream {
    fn drop(&mut self) {
        if !matches!(self.state, State::Ended) {
            self.attempts
                .state
                .driver
                .metrics()
                .count_request(RequestStatus::Cancelled);
            tracing::debug!(request = %self.attempts.client_id, "client went away: upstream cancelled");
        }
    }
}

/// The progress of a stream whose prompt has `prompt_len` tokens, bounded
/// by the migration sequence limit (the core's
/// [`Progress::within_sequence`]): what any resumable stream keeps.
pub(crate) fn bounded_progress(attempts: &Attempts, prompt_len: usize) -> Progress {
    Progress::within_sequence(attempts.state.upstream.migration.max_seq_len, prompt_len)
}

/// How [`move_stream`] ended.
pub(crate) enum Moved {
    /// Another worker continues the stream: its booking and body (a
    /// `/v1/completions` stream of token ids, to be rewritten).
    Resumed(Booking, Incoming),
    /// Every token the client asked for had arrived (the booking is
    /// completed): the caller closes the stream at the output limit.
    AllArrived,
    /// The stream cannot move: the client's error.
    Failed(ApiError),
}

/// Moves a broken stream to another worker, until one accepts it or it
/// cannot move: the one migration loop of every resumed stream (chat,
/// completions, Responses, Messages). `failed` is the broken leg's
/// booking, `why` the failure and its detail, `resumable` whether the
/// request may be resumed at all, `max_tokens` its output limit and
/// `body` builds the `/v1/completions` body from the prompt (original
/// prompt then generated ids) and the remaining tokens. The decision is
/// the core's ([`Attempts::fail`]: `FailureHistory::fail`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn move_stream(
    attempts: &mut Attempts,
    mut failed: Option<Booking>,
    why: (Failure, String),
    progress: &mut Progress,
    prompt: &[u32],
    resumable: Result<(), &'static str>,
    max_tokens: Option<u64>,
    body: impl Fn(&[u32], Option<u64>) -> Vec<u8>,
) -> Moved {
    let (mut reason, mut detail) = why;
    let prompt_tokens = prompt.len() as u64;
    loop {
        let client = attempts.client_id;
        let worker = failed.as_ref().map(|b| b.name.clone());
        tracing::warn!(request = %client, worker = worker.as_deref().unwrap_or("-"), reason = reason.label(), %detail, generated = progress.generated, "stream failed");
        let Some(booking) = failed.take() else {
            return Moved::Failed(ApiError::bad_gateway(detail));
        };
        let mut moving = match attempts.fail(
            booking,
            reason,
            Phase::MidStream,
            prompt_tokens,
            progress,
            resumable,
        ) {
            Ok(moving) => moving,
            Err(why) => return Moved::Failed(ApiError::bad_gateway(format!("{detail}; {why}"))),
        };
        if let Err(e) = tokenize_pending(attempts, progress).await {
            return Moved::Failed(e);
        }
        if progress.overflowed() {
            // Re-tokenized text passed the bound on kept ids: what
            // was generated is no longer known, so it cannot resume.
            return Moved::Failed(ApiError::bad_gateway(format!(
                "{detail}; the stream cannot be resumed: the generated text outgrew what the router keeps"
            )));
        }
        let remaining = max_tokens.map(|m| m.saturating_sub(progress.generated));
        if remaining == Some(0) {
            // Every token the client asked for has arrived.
            moving.completed(prompt_tokens.saturating_add(progress.generated));
            return Moved::AllArrived;
        }
        let mut ids = Vec::with_capacity(prompt.len().saturating_add(progress.ids().len()));
        ids.extend_from_slice(prompt);
        ids.extend_from_slice(progress.ids());
        let request = body(&ids, remaining);
        let booking = match attempts.migrate(moving, Some(&ids)).await {
            Ok(b) => b,
            Err(e) => return Moved::Failed(e),
        };
        let sent = attempts
            .send(&booking, "/v1/completions", Bytes::from(request), true)
            .await;
        match sent {
            Ok(response) if response.status().is_success() => {
                tracing::info!(request = %client, worker = %booking.name, resumed_at = progress.generated, "stream resumed on another worker");
                return Moved::Resumed(booking, response.into_body());
            }
            Ok(response) => {
                return Moved::Failed(ApiError::bad_gateway(format!(
                    "{} refused the resumed request with status {}",
                    attempts.state.disclosure().worker(&booking.name),
                    response.status().as_u16()
                )))
            }
            Err(AttemptError::Fatal(e)) => return Moved::Failed(e),
            Err(AttemptError::Retry(r, d)) => {
                reason = r;
                detail = d;
                failed = Some(booking);
            }
        }
    }
}

/// Turns generated text the worker sent without ids into ids, with its
/// model's tokenizer (on a blocking thread when long).
async fn tokenize_pending(attempts: &Attempts, progress: &mut Progress) -> Result<(), ApiError> {
    let text = progress.take_pending_text();
    if text.is_empty() {
        return Ok(());
    }
    let Some(tokenizer) = attempts.routing.tokenizer.clone() else {
        return Err(ApiError::bad_gateway(
            "the stream cannot be resumed: its model has no tokenizer here",
        ));
    };
    let ids = if text.len() <= INLINE_CHARS {
        tokenizer.encode(&text)
    } else {
        tokio::task::spawn_blocking(move || tokenizer.encode(&text))
            .await
            .map_err(|_| ApiError::internal("the tokenizer task failed"))?
    }
    .map_err(|e| ApiError::internal(format!("cannot tokenize the generated text: {e}")))?;
    progress.extend_ids(&ids);
    Ok(())
}

/// Reads `leg`'s worker up to its next complete event. A break, an end
/// without `[DONE]`, an oversized event or silence longer than `idle` is a
/// failure.
async fn read_event(leg: &mut Leg, idle: Duration) -> Result<Event, (Failure, String)> {
    loop {
        match leg.parser.next_event_framed() {
            Ok(Some(event)) => return Ok(event),
            Ok(None) => {}
            Err(e) => return Err((Failure::MidStream, e.to_string())),
        }
        pull_frame(
            &mut leg.upstream,
            &mut leg.parser,
            idle,
            "the worker's stream ended without [DONE]",
        )
        .await?;
    }
}

/// Reads the worker's next frame into `parser`. Silence longer than
/// `idle`, the stream's end (`ended` says why that is a failure) or a
/// break is a failure.
pub(crate) async fn pull_frame(
    upstream: &mut Incoming,
    parser: &mut SseParser,
    idle: Duration,
    ended: &str,
) -> Result<(), (Failure, String)> {
    match tokio::time::timeout(idle, upstream.frame()).await {
        Err(_) => Err((
            Failure::Timeout,
            format!("the worker sent nothing for {:.1} s", idle.as_secs_f64()),
        )),
        Ok(None) => Err((Failure::MidStream, ended.to_owned())),
        Ok(Some(Err(_))) => Err((Failure::MidStream, "the worker's stream broke".into())),
        Ok(Some(Ok(frame))) => {
            if let Ok(data) = frame.into_data() {
                parser.push(&data);
            }
            Ok(())
        }
    }
}

/// A response stream the client reads at its own pace: chat and
/// completions ([`MigratingStream`]) and the Responses and Messages APIs
/// ([`crate::request::named_stream`]), run by one loop ([`paced_body`]).
pub(crate) trait PacedStream: Send + Sized + 'static {
    /// The request's attempts (its deadline, id and state).
    fn attempts(&self) -> &Attempts;

    /// The client's next bytes and whether the response ended with them;
    /// `None`: nothing more to send.
    fn next(&mut self) -> impl std::future::Future<Output = Option<(Bytes, bool)>> + Send;

    /// Ends the stream at the request timeout — the worker's request
    /// cancelled, the booking freed, the end counted — and gives the
    /// client's last bytes (the API's error event).
    fn time_out(self) -> Bytes;
}

/// The response body of `stream`. The stream runs in a task of its own
/// that hands events to the body through a one-event channel, so its
/// request timeout fires whether or not the client reads: a client that
/// stops reading stops polling the body, and a deadline checked only when
/// the body is polled would never fire, holding the booking and the
/// worker's request for as long as the client keeps the connection open.
pub(crate) fn paced_body<S: PacedStream>(stream: S) -> Body {
    let (tx, gone, body) = events_body();
    tokio::spawn(run_paced(stream, tx, gone));
    body
}

/// Forwards events to `tx` until the response ends, the client goes away
/// (`gone` resolves when the body is dropped) or the request timeout
/// passes, whichever comes first. At the timeout the stream is ended at
/// once and the client gets its error event once it reads again. A
/// response that has ended waits for the client to take its last bytes,
/// with no deadline left to count.
async fn run_paced<S: PacedStream>(
    mut stream: S,
    tx: mpsc::Sender<Bytes>,
    mut gone: oneshot::Receiver<()>,
) {
    let deadline = tokio::time::sleep_until(stream.attempts().deadline);
    tokio::pin!(deadline);
    loop {
        let next = tokio::select! {
            biased;
            () = &mut deadline => break,
            // The client went away (counted by the stream's drop).
            _ = &mut gone => return,
            next = stream.next() => next,
        };
        let Some((bytes, ended)) = next else {
            return;
        };
        if ended {
            drop(stream);
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
    let attempts = stream.attempts();
    attempts.state.driver.metrics().request_timeouts.inc();
    tracing::info!(request = %attempts.client_id, "stream timed out: upstream cancelled");
    let last = stream.time_out();
    // Delivered when the client reads on; fails once it is gone.
    let _ = tx.send(last).await;
}

/// A streaming body fed by a task: the sender the task forwards events
/// to, the signal that the body was dropped (the client went away), and
/// the body ([`paced_body`]).
fn events_body() -> (mpsc::Sender<Bytes>, oneshot::Receiver<()>, Body) {
    let (tx, rx) = mpsc::channel(1);
    let (alive, gone) = oneshot::channel();
    (tx, gone, Body::new(Events { rx, _alive: alive }))
}

/// The client's side of a stream: the events its task forwards
/// ([`MigratingStream::into_body`]).
struct Events {
    rx: mpsc::Receiver<Bytes>,
    /// Dropped with the body (the client went away, or shutdown cut the
    /// response): the stream's task stops at once.
    _alive: oneshot::Sender<()>,
}

impl http_body::Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx
            .poll_recv(cx)
            .map(|event| event.map(|bytes| Ok(Frame::data(bytes))))
    }
}

/// An OpenAI-style error as an SSE event.
fn error_event(error: &ApiError) -> Vec<u8> {
    event_bytes(&error.body().to_json())
}
