//! Prefill/decode-disaggregated requests (`serve --disagg vllm|sglang`,
//! workers with `role=prefill|decode|both`): each request is two halves,
//! each placed by the dispatcher on a worker of its pool, and the engine
//! family's protocol between them.
//!
//! - Placement and sequencing are the dispatcher's
//!   (`switchyard_core::dispatch::split`): one admission
//!   ([`crate::driver::Driver::submit_split`]), each half over the
//!   workers of its pool (`prefill` or `decode`, and the `both` ones) by
//!   the same policy and booking as any request; vLLM's decode half is
//!   placed when its prefill half hands over
//!   ([`Booking::hand_over`]), SGLang's with its prefill half. The
//!   decode half carries the session (it is the turn whose answer the
//!   client reads); the prefill half none.
//! - vLLM: the prefill request (the client's body with
//!   `kv_transfer_params {do_remote_decode: true, ...}`, `stream: false`,
//!   `max_tokens: 1`) to the prefill worker; its answer's
//!   `kv_transfer_params`, forwarded whole, with the client's body to the
//!   decode worker, whose answer the client gets. Both with the client's
//!   request id as `x-request-id`.
//! - SGLang: the client's body plus `bootstrap_host` (the prefill
//!   worker's host), `bootstrap_port` (its `bootstrap-port`, default
//!   8998) and `bootstrap_room` (63 random bits) to both workers at once;
//!   the decode worker's answer goes to the client, the prefill worker's
//!   is read and discarded (a failure of it still counts).
//!
//! The bodies of both families, and whether a decode worker's error says
//! its transfer failed, are a wire format (`switchyard_wire::disagg`);
//! this module sends them.
//!
//! Failures follow the migration rules ([`crate::request::attempt::Attempts`]),
//! and which half a failure retries follows the dispatcher's table
//! (`switchyard_core::dispatch::recovery`): a prefill worker that fails
//! (refused, reset, 5xx, timeout) is reported and the prefill moves to
//! another prefill worker; a decode worker that fails before the first
//! token is reported and the decode moves to another decode worker (vLLM:
//! with the same transfer parameters, the lease being still held; SGLang:
//! the pair again under a new room); a decode worker that answers that the
//! transfer failed (its lease or room unknown or expired, its prefill
//! worker unreachable, the KV not the prompt's) is not reported: the
//! prefill is done again (`redo_prefill`, at most `--migration-limit`
//! times) and the decode resent; a stream broken mid-way is resumed on
//! another decode worker as today, which computes the prompt and the
//! tokens so far itself.

use crate::config::DisaggMode;
use crate::driver::booking::{Booking, WaitHandle};
use crate::error::ApiError;
use crate::metrics::{DisaggMetrics, DisaggOutcome as Outcome, DisaggReason as Reason};
use crate::request::answer::{deliver, Delivery};
use crate::request::attempt::{AttemptError, Attempts, PlaceError};
use crate::request::codec::{buffered, Answer, Codec};
use crate::roster::Role;
use crate::state::App;
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::Bytes;
use serde_json::value::RawValue;
use switchyard_core::admission::SessionKey;
use switchyard_core::dispatch::failure::Failure;
use switchyard_core::dispatch::{prefill_half, recovery, Half, HalfFailure, Pairing, SplitError};
use switchyard_core::RequestId;
use switchyard_wire::disagg::{
    sglang_body, transfer_failed, transfer_params, vllm_decode_body, vllm_prefill_body,
    NotAnObject, DEFAULT_BOOTSTRAP_PORT,
};

/// Largest error body of a decode worker read to judge whether its
/// transfer failed.
const MAX_ERROR_BYTES: usize = 64 * 1024;

/// The client's body with the engine family's fields
/// ([`switchyard_wire::disagg`]), or a 400 when it is no JSON object.
fn rewritten(body: Result<Vec<u8>, NotAnObject>) -> Result<Bytes, ApiError> {
    body.map(Bytes::from)
        .map_err(|_| ApiError::bad_request("the request body must be a JSON object", None))
}

/// The host of `url` (`http://HOST:PORT` or `https://`), brackets of an IPv6 address
/// removed.
fn url_host(url: &str) -> &str {
    let rest = crate::config::strip_scheme(url).unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

/// A random SGLang room: 63 bits.
fn random_room() -> u64 {
    use rand::Rng as _;
    rand::thread_rng().gen::<u64>() >> 1
}

// ---- Orchestration ---------------------------------------------------------

/// A half's answer other than a worker's answer to hand on.
enum HalfError {
    /// The worker failed it: report and move it.
    Retry(Failure, String),
    /// The decode worker could not take the KV: do the prefill again.
    Transfer(String),
    /// An error for the client.
    Fatal(ApiError),
}

impl From<AttemptError> for HalfError {
    fn from(e: AttemptError) -> Self {
        match e {
            AttemptError::Retry(reason, detail) => HalfError::Retry(reason, detail),
            AttemptError::Fatal(e) => HalfError::Fatal(e),
        }
    }
}

/// What one request shares across its halves.
struct Split<'a> {
    state: App,
    /// The client's id, told to both workers and to the client; its
    /// decode half's id in the dispatcher.
    id: RequestId,
    request: &'a Delivery,
    deadline: tokio::time::Instant,
    model: Option<String>,
}

/// A request given up: which part failed, and the client's error.
type Failed = (Reason, ApiError);

/// Serves one request as a prefill and a decode half under `mode`: the
/// dispatcher places the halves and says which failure retries which
/// ([`switchyard_core::dispatch::recovery`]); this module sends them and
/// reads their answers.
pub(crate) async fn serve(
    mode: DisaggMode,
    state: App,
    headers: &HeaderMap,
    request: Delivery,
    model: Option<String>,
    session: Option<SessionKey>,
) -> Result<Response, ApiError> {
    let metrics = state.apis.disagg_metrics.clone();
    metrics.requests.inc();
    let deadline = tokio::time::Instant::from_std(request.arrival) + state.upstream.request_timeout;
    let split = Split {
        id: state.driver.next_request_id(),
        state: state.clone(),
        request: &request,
        deadline,
        model,
    };
    let decode = Attempts::new(
        state.clone(),
        split.id,
        split.model.clone(),
        headers.get(axum::http::header::ACCEPT).cloned(),
        deadline,
    )
    .estimated_prompt(request.estimated_prompt_tokens)
    .half(Role::Decode, split.id)
    .passing_server_errors();
    let pairing = match mode {
        DisaggMode::Vllm => Pairing::AfterPrefill,
        DisaggMode::Sglang => Pairing::Together,
    };
    let prefill = prefill_attempts(&split);
    let result = match prefill.submit_split(&request.prompt, session, pairing) {
        Err(e) => Err((Reason::NoWorker, e)),
        Ok((prefill_wait, decode_wait)) => match mode {
            DisaggMode::Vllm => vllm(&split, prefill, prefill_wait, decode).await,
            DisaggMode::Sglang => {
                let decode_wait = decode_wait.expect("paired together, both halves wait");
                sglang(&split, (prefill, prefill_wait), (decode, decode_wait)).await
            }
        },
    };
    result.map_err(|(reason, e)| {
        metrics.failure(reason);
        e
    })
}

/// The attempts of a prefill half (its id in the dispatcher is
/// [`prefill_half`] of the request's).
fn prefill_attempts(split: &Split<'_>) -> Attempts {
    Attempts::new(
        split.state.clone(),
        prefill_half(split.id),
        split.model.clone(),
        None,
        split.deadline,
    )
    .estimated_prompt(split.request.estimated_prompt_tokens)
    .half(Role::Prefill, split.id)
}

/// The prefill done again ([`WaitHandle::redo_prefill`]; counted when its
/// transfer failed): fresh attempts for it and their handle, or why the
/// request is given up ([`not_redone`]).
fn redo_prefill(
    split: &Split<'_>,
    blocks: usize,
    transfer_failed: bool,
) -> Result<(Attempts, WaitHandle), SplitError> {
    let wait = WaitHandle::redo_prefill(&split.state.driver, split.id, transfer_failed)?;
    Ok((prefill_attempts(split).with_prompt_blocks(blocks), wait))
}

/// The request given up because its prefill cannot be done again (after
/// the failure `detail`).
fn not_redone(e: SplitError, detail: &str) -> Failed {
    match e {
        SplitError::Transfers(n) => (
            Reason::Transfer,
            ApiError::bad_gateway(format!("{detail}; the prefill was done {n} times")),
        ),
        SplitError::Unknown => (
            Reason::NoWorker,
            ApiError::no_workers("the request ended while its prefill was to be done again"),
        ),
    }
}

/// Waits for a half's placement: a booking in its pool, or the client's
/// error.
async fn placed(attempts: &mut Attempts, wait: WaitHandle) -> Result<Booking, Failed> {
    attempts
        .place_from(wait)
        .await
        .map_err(|e| failed(e, Reason::NoWorker))
}

/// A placement that ended the request, counted as `reason` unless the
/// request timed out.
fn failed(e: PlaceError, reason: Reason) -> Failed {
    match e {
        PlaceError::Timeout(e) => (Reason::Timeout, e),
        PlaceError::NoWorker(e) | PlaceError::GaveUp(e) => (reason, e),
    }
}

/// A half's worker failed it: reported, and the half moved to another
/// worker of its pool (or the request given up, counted as `reason`).
async fn move_half(
    split: &Split<'_>,
    attempts: &mut Attempts,
    booking: Booking,
    (failure, detail): (Failure, String),
    half: Half,
) -> Result<Booking, Failed> {
    let metrics = &split.state.apis.disagg_metrics;
    let (role, reason) = match half {
        Half::Prefill => (Role::Prefill, Reason::Prefill),
        Half::Decode => (Role::Decode, Reason::Decode),
    };
    metrics.half(role, Outcome::Failed);
    tracing::warn!(request = %split.id, worker = %booking.name, role = role.label(), reason = failure.label(), %detail, "disaggregated half failed");
    let prompt_tokens = split.request.prompt.len() as u64;
    let moved = attempts
        .move_on(booking, failure, &detail, prompt_tokens)
        .await;
    if !matches!(moved, Err(PlaceError::GaveUp(_))) {
        metrics.retry(reason);
    }
    moved.map_err(|e| failed(e, reason))
}

/// Sends a half and reads its answer: a stream to its first event, any
/// other answer whole; an error answer (a decode's 5xx is handed back by
/// [`Attempts::passing_server_errors`]) judged here: a transfer failure,
/// a worker failure (5xx), or the client's answer (4xx, buffered).
async fn send_half(
    attempts: &Attempts,
    booking: &Booking,
    codec: &Codec,
    body: Bytes,
    stream: bool,
) -> Result<Answer, HalfError> {
    let response = attempts
        .send(booking, codec.api().path(), body, stream)
        .await?;
    let status = response.status();
    if status.is_success() {
        return Ok(if stream {
            codec.first_event(attempts, &booking.name, response).await?
        } else {
            buffered(attempts, response).await?
        });
    }
    let (parts, upstream) = response.into_parts();
    let worker = attempts.state.disclosure().worker(&booking.name);
    let bytes = match crate::front::upload::read_whole(upstream, MAX_ERROR_BYTES).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return Err(HalfError::Retry(
                Failure::Reset,
                format!("{worker}'s error answer broke or was too long"),
            ))
        }
    };
    if transfer_failed(status.as_u16(), &bytes) {
        return Err(HalfError::Transfer(format!(
            "{worker} answered {}: its KV transfer failed",
            status.as_u16()
        )));
    }
    if status.is_server_error() {
        return Err(HalfError::Retry(
            Failure::Status5xx,
            format!("{worker} answered {}", status.as_u16()),
        ));
    }
    Ok(Answer::Buffered(parts, bytes))
}

/// The request timeout passed while `booking`'s worker had a half.
fn half_timed_out(attempts: &Attempts, booking: Booking, sent_at: tokio::time::Instant) -> Failed {
    (Reason::Timeout, attempts.timed_out_since(booking, sent_at))
}

/// How a prefill worker's answer other than a success ends its half.
enum PrefillEnd {
    /// The worker failed it: move it.
    Move(Failure, String),
    /// The worker refused the request: the client's answer.
    Refused(Answer),
    /// An error for the client.
    Fatal(ApiError),
}

fn prefill_end(sent: Result<Answer, HalfError>) -> PrefillEnd {
    match sent {
        Ok(answer @ Answer::Buffered(..)) => PrefillEnd::Refused(answer),
        Ok(Answer::Stream(..)) => PrefillEnd::Move(
            Failure::Status5xx,
            "the prefill worker streamed its answer".to_owned(),
        ),
        Err(HalfError::Retry(failure, detail)) => PrefillEnd::Move(failure, detail),
        Err(HalfError::Transfer(detail)) => PrefillEnd::Move(Failure::Status5xx, detail),
        Err(HalfError::Fatal(e)) => PrefillEnd::Fatal(e),
    }
}

/// How vLLM's prefill half ended well: its booking (to hand over) and its
/// transfer parameters, or a client error the prefill worker answered
/// (the client's answer).
enum Prefilled {
    Params(Booking, Option<Box<RawValue>>),
    Refused(Box<(Attempts, Booking, Answer)>),
}

/// vLLM's prefill half: sent and moved until a prefill worker answers.
async fn vllm_prefill(
    split: &Split<'_>,
    mut attempts: Attempts,
    mut booking: Booking,
    prefill_body: &Bytes,
) -> Result<Prefilled, Failed> {
    let metrics = &split.state.apis.disagg_metrics;
    loop {
        let sent_at = tokio::time::Instant::now();
        let sent = send_half(
            &attempts,
            &booking,
            &split.request.codec,
            prefill_body.clone(),
            false,
        );
        let answer = match tokio::time::timeout_at(split.deadline, sent).await {
            Err(_) => return Err(half_timed_out(&attempts, booking, sent_at)),
            Ok(answer) => answer,
        };
        let failure = match answer {
            Ok(Answer::Buffered(parts, bytes)) if parts.status.is_success() => {
                match transfer_params(&bytes) {
                    Ok(params) => {
                        metrics.half(Role::Prefill, Outcome::Ok);
                        metrics
                            .prefill_seconds
                            .observe(split.request.arrival.elapsed().as_secs_f64());
                        return Ok(Prefilled::Params(booking, params));
                    }
                    Err(why) => (Failure::Status5xx, why),
                }
            }
            answer => match prefill_end(answer) {
                PrefillEnd::Move(failure, detail) => (failure, detail),
                PrefillEnd::Fatal(e) => return Err((Reason::Prefill, e)),
                PrefillEnd::Refused(answer) => {
                    metrics.half(Role::Prefill, Outcome::Refused);
                    return Ok(Prefilled::Refused(Box::new((attempts, booking, answer))));
                }
            },
        };
        // A prefill half moves on its own (`recovery`'s first row).
        booking = move_half(split, &mut attempts, booking, failure, Half::Prefill).await?;
    }
}

/// vLLM: the prefill half, then (handed over) the decode half with its
/// transfer parameters; a decode whose transfer failed gets a new prefill
/// and keeps its worker.
async fn vllm(
    split: &Split<'_>,
    mut prefill: Attempts,
    prefill_wait: WaitHandle,
    mut decode: Attempts,
) -> Result<Response, Failed> {
    let metrics = &split.state.apis.disagg_metrics;
    let original = &split.request.original;
    let blocks = prefill.prompt_blocks();
    let prefill_body = rewritten(vllm_prefill_body(original)).map_err(|e| (Reason::Prefill, e))?;
    let mut booking: Option<Booking> = None;
    let mut next_prefill = Some(prefill_wait);
    loop {
        let wait = next_prefill
            .take()
            .expect("a prefill half waits each round");
        let prefill_booking = placed(&mut prefill, wait).await?;
        let (prefill_booking, params) =
            match vllm_prefill(split, prefill, prefill_booking, &prefill_body).await? {
                Prefilled::Params(booking, params) => (booking, params),
                Prefilled::Refused(refused) => {
                    let (attempts, booking, answer) = *refused;
                    return Ok(deliver(attempts, booking, answer, split.request.clone()));
                }
            };
        let body = rewritten(vllm_decode_body(original, params.as_deref()))
            .map_err(|e| (Reason::Decode, e))?;
        // Handed over: the dispatcher ends the prefill half and places the
        // decode half, unless it kept its worker.
        let handed = prefill_booking.hand_over();
        let mut current = match (booking.take(), handed) {
            (Some(kept), _) => kept,
            (None, Some(wait)) => placed(&mut decode, wait).await?,
            (None, None) => {
                return Err((
                    Reason::NoWorker,
                    ApiError::no_workers("the request ended before its decode half was placed"),
                ))
            }
        };
        // The decode half, moved to other decode workers until one
        // answers or its transfer fails.
        loop {
            let sent_at = tokio::time::Instant::now();
            let sent = send_half(
                &decode,
                &current,
                &split.request.codec,
                body.clone(),
                split.request.stream,
            );
            let answer = match tokio::time::timeout_at(split.deadline, sent).await {
                Err(_) => return Err(half_timed_out(&decode, current, sent_at)),
                Ok(answer) => answer,
            };
            let (failure, detail) = match answer {
                Ok(answer) => {
                    metrics.half(Role::Decode, decode_outcome(&answer));
                    return Ok(deliver(
                        decode.judging_server_errors(),
                        current,
                        answer,
                        split.request.clone(),
                    ));
                }
                Err(e) => decode_failure(e, metrics).map_err(|e| (Reason::Decode, e))?,
            };
            let next = recovery(Pairing::AfterPrefill, Half::Decode, failure);
            if next.move_half {
                current =
                    move_half(split, &mut decode, current, detail.clone(), Half::Decode).await?;
            }
            if next.redo_prefill {
                let (attempts, wait) =
                    redo_prefill(split, blocks, failure == HalfFailure::Transfer)
                        .map_err(|e| not_redone(e, &detail.1))?;
                tracing::info!(request = %split.id, worker = %current.name, detail = %detail.1, "decode transfer failed: prefill again");
                metrics.retry(Reason::Transfer);
                prefill = attempts;
                next_prefill = Some(wait);
                booking = Some(current);
                break;
            }
        }
    }
}

/// A decode half's failure as the dispatcher's table reads it, with what
/// its worker did (a failed transfer counted); `Err`: the client's error.
fn decode_failure(
    e: HalfError,
    metrics: &DisaggMetrics,
) -> Result<(HalfFailure, (Failure, String)), ApiError> {
    match e {
        HalfError::Fatal(e) => Err(e),
        HalfError::Retry(failure, detail) => Ok((HalfFailure::Worker, (failure, detail))),
        HalfError::Transfer(detail) => {
            metrics.half(Role::Decode, Outcome::TransferFailed);
            Ok((HalfFailure::Transfer, (Failure::Status5xx, detail)))
        }
    }
}

/// A decode answer's outcome label: ok, or refused (a client error).
fn decode_outcome(answer: &Answer) -> Outcome {
    match answer {
        Answer::Buffered(parts, _) if !parts.status.is_success() => Outcome::Refused,
        _ => Outcome::Ok,
    }
}

/// What a prefill half's task hands back.
type PrefillRun = (Attempts, Booking, Result<Answer, HalfError>);

/// How SGLang's pair of sends ended first (one short-lived value per
/// attempt: its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Race {
    /// The decode answered (or failed, or the request timed out).
    Decoded(Result<Result<Answer, HalfError>, tokio::time::error::Elapsed>),
    /// The prefill failed before the decode answered.
    PrefillFailed(Box<PrefillRun>),
}

/// SGLang: both halves placed and sent at once under one room; the decode
/// worker's answer goes to the client, the prefill worker's is read in
/// the background and discarded (a failure of it still reported).
async fn sglang(
    split: &Split<'_>,
    (first_prefill, prefill_wait): (Attempts, WaitHandle),
    (mut decode, decode_wait): (Attempts, WaitHandle),
) -> Result<Response, Failed> {
    let state = &split.state;
    let metrics = state.apis.disagg_metrics.clone();
    let original = &split.request.original;
    let blocks = first_prefill.prompt_blocks();
    let mut next_prefill = Some((first_prefill, prefill_wait));
    let mut prefill: Option<(Attempts, Booking)> = None;
    let mut decode_booking = Some(placed(&mut decode, decode_wait).await?);
    loop {
        let (p_attempts, p_booking) = match prefill.take() {
            Some(p) => p,
            None => {
                let (mut attempts, wait) = next_prefill
                    .take()
                    .expect("a prefill half waits each round");
                let booking = placed(&mut attempts, wait).await?;
                (attempts, booking)
            }
        };
        let d_booking = decode_booking
            .take()
            .expect("the decode half is placed each round");
        let port = state
            .driver
            .role_of(p_booking.worker)
            .and_then(|(_, port)| port)
            .unwrap_or(DEFAULT_BOOTSTRAP_PORT);
        let body = rewritten(sglang_body(
            original,
            url_host(&p_booking.url),
            port,
            random_room(),
        ))
        .map_err(|e| (Reason::Prefill, e))?;
        // The prefill half runs as a task of its own: it may outlive the
        // handler (read to its end after the decode answered), bounded by
        // the request's deadline.
        let codec = split.request.codec.clone();
        let deadline = split.deadline;
        let prefill_body = body.clone();
        let mut prefill_task = tokio::spawn(async move {
            let sent = send_half(&p_attempts, &p_booking, &codec, prefill_body, false);
            let sent = match tokio::time::timeout_at(deadline, sent).await {
                Ok(sent) => sent,
                Err(_) => Err(HalfError::Retry(
                    Failure::Timeout,
                    "the prefill worker did not answer by the request's deadline".into(),
                )),
            };
            (p_attempts, p_booking, sent)
        });
        let sent_at = tokio::time::Instant::now();
        let mut decode_sent = Box::pin(tokio::time::timeout_at(
            deadline,
            send_half(
                &decode,
                &d_booking,
                &split.request.codec,
                body,
                split.request.stream,
            ),
        ));
        // Both at once: a prefill that fails first cancels the decode
        // (it would wait for a room that never comes).
        let mut prefill_ok: Option<(Attempts, Booking)> = None;
        let race = loop {
            tokio::select! {
                joined = &mut prefill_task, if prefill_ok.is_none() => {
                    let Ok((attempts, booking, sent)) = joined else {
                        return Err((Reason::Prefill, ApiError::internal("the prefill task failed")));
                    };
                    match sent {
                        Ok(Answer::Buffered(ref parts, _)) if parts.status.is_success() => {
                            prefill_ok = Some((attempts, booking));
                        }
                        sent => break Race::PrefillFailed(Box::new((attempts, booking, sent))),
                    }
                }
                answer = &mut decode_sent => break Race::Decoded(answer),
            }
        };
        drop(decode_sent);
        let answer = match race {
            Race::PrefillFailed(failed) => {
                let (mut attempts, booking, sent) = *failed;
                // The decode was cancelled (dropped): not its worker's
                // failure; the prefill moves on, or the client gets the
                // prefill worker's refusal.
                decode_booking = Some(d_booking);
                let failure = match prefill_end(sent) {
                    PrefillEnd::Move(failure, detail) => (failure, detail),
                    PrefillEnd::Fatal(e) => return Err((Reason::Prefill, e)),
                    PrefillEnd::Refused(answer) => {
                        metrics.half(Role::Prefill, Outcome::Refused);
                        drop(decode_booking.take());
                        return Ok(deliver(attempts, booking, answer, split.request.clone()));
                    }
                };
                let moved =
                    move_half(split, &mut attempts, booking, failure, Half::Prefill).await?;
                prefill = Some((attempts, moved));
                continue;
            }
            Race::Decoded(Err(_)) => {
                prefill_task.abort();
                return Err(half_timed_out(&decode, d_booking, sent_at));
            }
            Race::Decoded(Ok(answer)) => answer,
        };
        let (failure, detail) = match answer {
            Ok(answer) => {
                metrics.half(Role::Decode, decode_outcome(&answer));
                settle_prefill(prefill_ok, prefill_task, metrics.clone());
                return Ok(deliver(
                    decode.judging_server_errors(),
                    d_booking,
                    answer,
                    split.request.clone(),
                ));
            }
            Err(e) => decode_failure(e, &metrics).map_err(|e| (Reason::Decode, e))?,
        };
        // The pair again under a new room: the prefill worker did
        // nothing wrong; an answer of it still coming is dropped, and its
        // guard is gone before the prefill is done again.
        match prefill_ok {
            Some((_, booking)) => {
                metrics.half(Role::Prefill, Outcome::Ok);
                drop(booking.hand_over());
            }
            None => {
                prefill_task.abort();
                // Its guard dropped with it (a join, never a second one).
                let _ = prefill_task.await;
            }
        }
        let next = recovery(Pairing::Together, Half::Decode, failure);
        let mut d_booking = d_booking;
        if next.move_half {
            d_booking =
                move_half(split, &mut decode, d_booking, detail.clone(), Half::Decode).await?;
        }
        if next.redo_prefill {
            if failure == HalfFailure::Transfer {
                metrics.retry(Reason::Transfer);
            }
            next_prefill = Some(
                redo_prefill(split, blocks, failure == HalfFailure::Transfer)
                    .map_err(|e| not_redone(e, &detail.1))?,
            );
        }
        decode_booking = Some(d_booking);
    }
}

/// The decode answered: the prefill half ends — at once when its answer
/// came already, otherwise in the background, a failure of it reported
/// to its worker's circuit breaker and counted.
fn settle_prefill(
    done: Option<(Attempts, Booking)>,
    task: tokio::task::JoinHandle<PrefillRun>,
    metrics: std::sync::Arc<DisaggMetrics>,
) {
    let finish = move |booking: Booking, ok: bool| {
        if ok {
            metrics.half(Role::Prefill, Outcome::Ok);
            // Paired together, nothing waits for this hand-over.
            drop(booking.hand_over());
        } else {
            booking.worker_failed();
            metrics.half(Role::Prefill, Outcome::Failed);
        }
    };
    match done {
        Some((_attempts, booking)) => finish(booking, true),
        None => {
            tokio::spawn(async move {
                if let Ok((_attempts, booking, sent)) = task.await {
                    let ok = matches!(sent, Ok(Answer::Buffered(ref parts, _)) if parts.status.is_success());
                    if !ok {
                        tracing::warn!(worker = %booking.name, "the prefill half failed after its decode answered");
                    }
                    finish(booking, ok);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn a_room_is_63_random_bits() {
        for _ in 0..100 {
            assert!(random_room() < 1 << 63);
        }
    }

    #[test]
    fn a_url_host_is_its_address() {
        assert_eq!(url_host("http://127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(url_host("http://[::1]:8000"), "::1");
        assert_eq!(url_host("http://worker"), "worker");
    }

    #[test]
    fn every_label_set_is_exported_from_the_start() {
        let m = DisaggMetrics::new();
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains(
                r#"switchyard_disagg_halves_total{role="decode",outcome="transfer_failed"} 0"#
            ),
            "{out}"
        );
        assert!(out.contains(r#"switchyard_disagg_retries_total{reason="prefill"} 0"#));
        assert!(out.contains(r#"switchyard_disagg_failures_total{reason="no_worker"} 0"#));
        m.half(Role::Decode, Outcome::Ok);
        assert_eq!(m.halves(Role::Decode, Outcome::Ok), 1);
    }
}
