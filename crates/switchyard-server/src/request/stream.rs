//! The streaming response body of every API: the worker's SSE events on
//! their way to the client, resumed on another worker when the stream
//! breaks. One relay ([`Relay`]) runs every stream; what differs by API
//! (how its events are read and what they mean, how a resumed worker's
//! chunks are shown, how it closes or says it failed) is the API's codec,
//! a [`StreamCodec`] of `switchyard_wire::stream_codec`: the chat API's
//! chunks and the Responses and Messages APIs' named events. What the
//! router does beside (counting by API, remembering a stored response)
//! is the request's [`Codec`]'s.
//!
//! Paced by the client: the stream runs in a task of its own that reads
//! the worker one event at a time and hands each to the client's body
//! through a one-event channel, so the worker is read at most one event
//! ahead of the client and a slow client slows the read from the worker
//! (TCP back-pressure) instead of growing a buffer. The task, not the
//! client's polling, keeps the request timeout: a client that stops
//! reading still has its worker's request cancelled and its booking
//! freed at the timeout. Per stream the router holds: one incomplete
//! event (at most [`crate::request::MAX_EVENT_BYTES`] plus one frame), the
//! event being forwarded, the prompt's token ids and the client's body
//! (both already in memory for routing), and the generated tokens
//! ([`Progress`]: 4 bytes a token id, at most the migration sequence limit
//! less the prompt, plus not-yet-tokenized text capped at 32 bytes a token
//! of the migration sequence limit). Past those bounds the stream stops
//! recording and can no longer be resumed.
//!
//! Events of the first worker are forwarded byte for byte (only whole
//! events: a half event at a break is dropped). After a break (the worker
//! resets, goes silent past the first-token timeout, sends an error
//! chunk, or ends before its last event) the worker is reported and the
//! request re-issued as `/v1/completions` with the prompt plus the
//! generated ids ([`move_stream`]), and the new worker's chunks are
//! rewritten into the API's own shape. The client sees one stream, or an
//! error event in its API's shape and the end when the request cannot
//! move (limit, length, no worker, a request the resume cannot reproduce,
//! the request timeout).
//!
//! A stream is one worker's *leg* at a time (its booking, its response
//! body and parser). A migration replaces the leg: the failed leg's
//! booking moves on with the request (still its session's turn). Dropping
//! the body (the client went away) stops the task, which drops the
//! upstream connection, cancelling the worker's request, and aborts the
//! request.

use crate::driver::booking::Booking;
use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::attempt::{AttemptError, Attempts};
use crate::request::codec::Codec;
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
use switchyard_wire::sse::SseParser;
use switchyard_wire::stream_codec::{Ending, Prompt, Seen, Step, StreamCodec};
use tokio::sync::{mpsc, oneshot};

/// What the proxy hands over once the first event has arrived.
pub(crate) struct RelayStart {
    pub(crate) attempts: Attempts,
    pub(crate) booking: Booking,
    pub(crate) upstream: Incoming,
    pub(crate) parser: SseParser,
    /// The prompt's token ids as routed (a resumed prompt's start).
    pub(crate) prompt: Vec<u32>,
    /// The prompt's tokens, counted or estimated.
    pub(crate) prompt_tokens: u64,
    /// The client's body (read again when the stream breaks).
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
}

/// One client stream across its workers.
pub(crate) struct Relay<A: StreamCodec> {
    /// The API's own reading and writing of the stream's events.
    events: A,
    /// The request's API, as the router counts it and keeps its stored
    /// responses.
    codec: Codec,
    attempts: Attempts,
    /// `None` once the response has ended (counted).
    leg: Option<Leg>,
    /// The first worker's first event, not yet forwarded.
    first: Option<A::Event>,
    /// The worker read now answers a resumed `/v1/completions` request.
    resumed: bool,
    progress: Progress,
    prompt: Prompt,
    original: Bytes,
    arrival: Instant,
    last_event: Option<Instant>,
}

impl<A: StreamCodec> Relay<A> {
    /// The response body of a stream whose `first` event has arrived,
    /// read as `events` makes of it from what the stream will keep
    /// ([`paced_body`]: the stream runs in a task of its own, so its
    /// request timeout fires whether or not the client reads).
    pub(crate) fn body(
        codec: Codec,
        events: impl FnOnce(&Progress) -> A,
        start: RelayStart,
        first: A::Event,
    ) -> Body {
        // What any resumable stream keeps: bounded by the migration
        // sequence limit (the core's [`Progress::within_sequence`]).
        let max_seq_len = start.attempts.state.upstream.migration.max_seq_len;
        let progress = Progress::within_sequence(max_seq_len, start.prompt.len());
        paced_body(Self {
            events: events(&progress),
            codec,
            attempts: start.attempts,
            leg: Some(Leg {
                booking: start.booking,
                upstream: start.upstream,
                parser: start.parser,
            }),
            first: Some(first),
            resumed: false,
            progress,
            prompt: Prompt {
                ids: start.prompt,
                tokens: start.prompt_tokens,
                generated_at_resume: 0,
            },
            original: start.original,
            arrival: start.arrival,
            last_event: None,
        })
    }

    /// The next event: the waiting first one, or one read from the
    /// current leg's worker. A break, an end before the last event, an
    /// oversized event or silence longer than `idle` is a failure.
    async fn read(&mut self, idle: Duration) -> Result<A::Event, (Failure, String)> {
        if let Some(first) = self.first.take() {
            return Ok(first);
        }
        let Some(leg) = self.leg.as_mut() else {
            return Err((Failure::MidStream, "the stream has no worker".into()));
        };
        loop {
            match A::read(&mut leg.parser) {
                Ok(Some(event)) => return Ok(event),
                Ok(None) => {}
                Err(e) => return Err((Failure::MidStream, e.to_string())),
            }
            pull_frame(&mut leg.upstream, &mut leg.parser, idle, A::ENDED_EARLY).await?;
        }
    }

    /// The client's next bytes and whether the response ended with them.
    async fn next(&mut self) -> (Bytes, bool) {
        let idle = self.attempts.state.upstream.first_token_timeout;
        loop {
            let (step, reason) = match self.read(idle).await {
                Err((reason, detail)) => (Step::Broken(detail), reason),
                Ok(event) if self.resumed => (self.resumed_event(event), Failure::MidStream),
                Ok(event) => (self.first_worker_event(event), Failure::MidStream),
            };
            match step {
                Step::Send(bytes) => return (Bytes::from(bytes), false),
                Step::End(ending, bytes) => {
                    let status = match ending {
                        Ending::Ok => RequestStatus::Ok,
                        Ending::WorkerError => RequestStatus::WorkerError,
                    };
                    return (self.end(status, bytes), true);
                }
                Step::Skip => {}
                Step::Broken(detail) => {
                    if let Some((status, bytes)) = self.recover(reason, detail).await {
                        return (self.end(status, bytes), true);
                    }
                }
            }
        }
    }

    /// An event of the first worker, as its API reads it.
    fn first_worker_event(&mut self, event: A::Event) -> Step {
        let Some(worker) = self.leg.as_ref().map(|leg| leg.booking.worker) else {
            return Step::Skip;
        };
        let mut seen = Seen::new(&mut self.progress);
        let step = self.events.first_worker(event, &mut seen);
        let (output, stored) = (seen.output, seen.stored);
        if let Some(id) = stored {
            self.codec.stored(&id, worker);
        }
        if output {
            self.observe();
        }
        step
    }

    /// A resumed worker's event (a `/v1/completions` chunk) as the
    /// client's.
    fn resumed_event(&mut self, event: A::Event) -> Step {
        let mut seen = Seen::new(&mut self.progress);
        let step = self.events.resumed_event(&event, &mut seen, &self.prompt);
        if seen.output {
            self.observe();
        }
        step
    }

    /// Moves the request to another worker after `reason`, until one
    /// accepts it (`None`: read on) or it cannot move: then the response's
    /// last bytes and how it ended (the closing events when every token
    /// had arrived, else the API's error event).
    async fn recover(
        &mut self,
        reason: Failure,
        detail: String,
    ) -> Option<(RequestStatus, Vec<u8>)> {
        // The failed leg's body is dropped here (the worker's request is
        // cancelled); its booking goes on with the request.
        let failed = self.leg.take().map(|leg| leg.booking);
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
            .and_then(|()| self.events.resumable(&original))
            .and_then(|()| self.attempts.resume_by_ids());
        if self.events.all_arrived(&self.progress) && resumable.is_ok() {
            // Every token arrived; only the closing events were lost.
            if let Some(mut booking) = failed {
                booking.completed(self.context());
            }
            let bytes = self.events.close("stop", &self.progress, &self.prompt);
            return Some((RequestStatus::Ok, bytes));
        }
        let events = &self.events;
        let moved = move_stream(
            &mut self.attempts,
            failed,
            (reason, detail),
            &mut self.progress,
            &self.prompt.ids,
            resumable,
            events.max_tokens(&original),
            |prompt, remaining| events.resume_body(&original, prompt, remaining),
        )
        .await;
        match moved {
            Moved::Resumed(booking, upstream) => {
                self.leg = Some(Leg {
                    booking,
                    upstream,
                    parser: SseParser::new(MAX_EVENT_BYTES),
                });
                self.resumed = true;
                self.prompt.generated_at_resume = self.progress.generated;
                None
            }
            Moved::AllArrived => {
                let bytes = self.events.close("length", &self.progress, &self.prompt);
                Some((RequestStatus::Ok, bytes))
            }
            Moved::Failed(e) => Some((
                RequestStatus::Unavailable,
                self.events.error_event(e.body()),
            )),
        }
    }

    /// The request's context: its prompt and what was generated.
    fn context(&self) -> u64 {
        self.prompt.tokens.saturating_add(self.progress.generated)
    }

    /// Latency metrics, the booking's first token and its progress.
    fn observe(&mut self) {
        let now = Instant::now();
        let metrics = self.attempts.state.driver.metrics();
        match self.last_event {
            None => metrics.ttft.observe((now - self.arrival).as_secs_f64()),
            Some(last) => metrics.itl.observe((now - last).as_secs_f64()),
        }
        self.last_event = Some(now);
        let generated = self.progress.generated;
        if let Some(leg) = self.leg.as_mut() {
            leg.booking.mark_first_token();
            leg.booking.progress(generated);
        }
    }

    /// Ends the response with `bytes` as its last: a normal end finishes
    /// the request with its context length, any other aborts it; the
    /// worker's body is dropped either way.
    fn end(&mut self, status: RequestStatus, bytes: Vec<u8>) -> Bytes {
        let context = self.context();
        if let Some(mut leg) = self.leg.take() {
            if status == RequestStatus::Ok {
                leg.booking.completed(context);
            }
        }
        self.count(status);
        Bytes::from(bytes)
    }

    fn count(&self, status: RequestStatus) {
        self.codec.api().count(&self.attempts.state, status);
    }

    /// Ends the stream at the request timeout: the worker's request
    /// cancelled and the booking freed now, whether or not the client
    /// reads; the client's last bytes are the API's error event.
    fn time_out(mut self) -> Bytes {
        let error = ApiError::timeout(self.attempts.state.upstream.request_timeout);
        let bytes = self.events.error_event(error.body());
        self.end(RequestStatus::Unavailable, bytes)
    }
}

impl<A: StreamCodec> Drop for Relay<A> {
    fn drop(&mut self) {
        if self.leg.is_some() {
            self.count(RequestStatus::Cancelled);
            tracing::debug!(request = %self.attempts.client_id, "client went away: upstream cancelled");
        }
    }
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

/// The response body of `stream`. The stream runs in a task of its own
/// that hands events to the body through a one-event channel, so its
/// request timeout fires whether or not the client reads: a client that
/// stops reading stops polling the body, and a deadline checked only when
/// the body is polled would never fire, holding the booking and the
/// worker's request for as long as the client keeps the connection open.
fn paced_body<A: StreamCodec>(stream: Relay<A>) -> Body {
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
async fn run_paced<A: StreamCodec>(
    mut stream: Relay<A>,
    tx: mpsc::Sender<Bytes>,
    mut gone: oneshot::Receiver<()>,
) {
    let deadline = tokio::time::sleep_until(stream.attempts.deadline);
    tokio::pin!(deadline);
    loop {
        let next = tokio::select! {
            biased;
            () = &mut deadline => break,
            // The client went away (counted by the stream's drop).
            _ = &mut gone => return,
            next = stream.next() => next,
        };
        let (bytes, ended) = next;
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
    let attempts = &stream.attempts;
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
/// ([`paced_body`]).
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
