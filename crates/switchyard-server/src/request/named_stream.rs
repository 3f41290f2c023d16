//! The streams of the Responses and Messages APIs as the relay runs them
//! ([`crate::request::stream`], as chat streams): the worker's named
//! events (`event: <name>` and `data:` lines) forwarded unchanged, one
//! whole event at a time.
//!
//! Read on the way: the first event (first-token time, the booking's
//! prefill done), text deltas (the booking's progress), a Responses
//! `response.created` (a stored response's id remembered with its
//! worker), and the end (`response.completed` / `response.incomplete`,
//! `message_stop`: the booking finished with its context length).
//!
//! A worker's own error event is passed on and ends the stream. A stream
//! that breaks is resumed on another worker as chat streams are
//! ([`crate::request::stream::move_stream`]) when it is plain text, its
//! completion chunks
//! rewritten into the API's events ([`switchyard_wire::resume::agentic`]),
//! and any other ends with an error event in the API's own shape saying
//! why it could not move ([`switchyard_wire::resume::agentic::resumable`]).
//! Beside what the relay holds, a stream keeps the generated text
//! (bounded as the relay's progress is) when it may be resumed.

use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::agentic::{AgenticDelivery, EventKind};
use crate::request::stream::{Prompt, Seen, Step, StreamApi};
use std::sync::Arc;
use switchyard_core::dispatch::failure::Progress;
use switchyard_wire::body_fields::Fields;
use switchyard_wire::resume::agentic::{self as agentic_resume, Resume};
use switchyard_wire::sse::{Delta, NamedEvent, SseError, SseParser};

/// A Responses or Messages stream.
pub(crate) struct Named {
    agentic: Arc<AgenticDelivery>,
    /// What the client has seen, and the rewrite of a resumed worker's
    /// chunks.
    resume: Resume,
    /// Events forwarded (the next Responses `sequence_number`).
    forwarded: u64,
}

impl Named {
    /// The stream of `agentic`'s request, its generated text kept up to
    /// `progress`'s bound (none for a stored response: it is never
    /// resumed).
    pub(crate) fn new(
        agentic: Arc<AgenticDelivery>,
        progress: &Progress,
        client: impl std::fmt::Display,
    ) -> Self {
        let text_cap = match agentic.remember {
            Some(_) => 0,
            None => progress.text_cap(),
        };
        let resume = Resume::new(agentic.api, text_cap, client);
        Self {
            agentic,
            resume,
            forwarded: 0,
        }
    }

    /// The next Responses `sequence_number`.
    fn sequence(&self) -> u64 {
        self.resume.sequence().max(self.forwarded)
    }
}

impl StreamApi for Named {
    type Event = NamedEvent;
    const ENDED_EARLY: &'static str = "the worker's stream ended before its last event";

    fn read(parser: &mut SseParser) -> Result<Option<NamedEvent>, SseError> {
        parser.next_event_named()
    }

    fn data(event: &NamedEvent) -> &str {
        event.data()
    }

    fn first_worker(&mut self, event: NamedEvent, seen: &mut Seen<'_>) -> Step {
        seen.output = true;
        let text = self.resume.observe(event.data());
        let end = match self.agentic.classify(event.data()) {
            EventKind::Created(id) => {
                if let Some(remember) = &self.agentic.remember {
                    remember.record(&id, seen.worker);
                }
                None
            }
            EventKind::Delta => {
                // One token an event, as the engines stream them; a
                // delta without text (another block's) counts none.
                seen.progress.observe(text.as_deref(), None, false);
                None
            }
            EventKind::End => Some(RequestStatus::Ok),
            // The worker's own error, passed on as it sent it.
            EventKind::Error => Some(RequestStatus::WorkerError),
            EventKind::Other => None,
        };
        self.forwarded += 1;
        match end {
            Some(status) => Step::End(status, event.into_bytes()),
            None => Step::Send(event.into_bytes()),
        }
    }

    fn resumed(&mut self, delta: &Delta, progress: &Progress, at: &Prompt) -> Step {
        let bytes = self.resume.rewrite(delta, progress.generated, at.tokens);
        if delta.finish_reason.is_some() {
            // The rest of the worker's stream (usage, `[DONE]`) adds
            // nothing the client is shown.
            return Step::End(RequestStatus::Ok, bytes);
        }
        if bytes.is_empty() {
            return Step::Skip;
        }
        self.forwarded += 1;
        Step::Send(bytes)
    }

    fn close(&mut self, reason: &str, progress: &Progress, at: &Prompt) -> Vec<u8> {
        self.resume.finish(reason, progress.generated, at.tokens)
    }

    fn error_event(&self, error: &ApiError) -> Vec<u8> {
        self.agentic
            .error_event(&error.body().error.message, self.sequence())
    }

    fn resumable(&self, body: &Fields<'_>) -> Result<(), &'static str> {
        agentic_resume::resumable(self.agentic.api, body)?;
        match self.resume.overflowed() {
            true => Err("the generated text outgrew what the router keeps"),
            false => Ok(()),
        }
    }

    fn max_tokens(&self, body: &Fields<'_>) -> Option<u64> {
        agentic_resume::max_tokens(self.agentic.api, body)
    }

    fn resume_body(&self, body: &Fields<'_>, prompt: &[u32], remaining: Option<u64>) -> Vec<u8> {
        agentic_resume::resume_body(self.agentic.api, body, prompt, remaining)
    }

    fn all_arrived(&self, _progress: &Progress) -> bool {
        self.resume.closed()
    }

    fn ended(&self, status: RequestStatus) {
        self.agentic.metrics.count(self.agentic.api, status);
    }
}
