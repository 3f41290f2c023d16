//! The streams of the Responses and Messages APIs: the worker's named
//! events (`event: <name>` and `data:` lines) forwarded unchanged, one
//! whole event at a time.
//!
//! Read on the way: the first event (the client is shown output), text
//! deltas (one token each), a Responses `response.created` (a stored
//! response's id, for the relay to remember with its worker), and the end
//! (`response.completed` / `response.incomplete`, `message_stop`). A
//! worker's own error event is passed on and ends the stream.
//!
//! A stream that breaks is resumed on another worker as chat streams are
//! when it is plain text, its completion chunks rewritten into the API's
//! events ([`crate::resume::agentic::Resume`]); any other ends with an
//! error event in the API's own shape saying why it could not move
//! ([`crate::resume::agentic::resumable`]). Beside what the relay holds, a
//! stream keeps the generated text (bounded as the relay's progress is)
//! when it may be resumed.

use super::{Ending, Prompt, Seen, Step, StreamCodec};
use crate::agentic::AgenticApi;
use crate::agentic_events::{self, EventKind};
use crate::body_fields::Fields;
use crate::openai::ErrorBody;
use crate::resume::agentic::{self as agentic_resume, Resume};
use crate::sse::{Delta, NamedEvent, SseError, SseParser};
use switchyard_core::dispatch::failure::Progress;

/// A Responses or Messages stream.
pub struct Named {
    api: AgenticApi,
    /// The worker stores the response: its id is told to the relay, and
    /// the stream is never resumed (it would be stored nowhere).
    stored: bool,
    /// What the client has seen, and the rewrite of a resumed worker's
    /// chunks.
    resume: Resume,
    /// Events forwarded (the next Responses `sequence_number`).
    forwarded: u64,
}

impl Named {
    /// The stream of an `api` request whose client knows it as `client`;
    /// `stored` when its worker stores the response. Its generated text is
    /// kept up to `progress`'s bound (none for a stored response).
    pub fn new(
        api: AgenticApi,
        stored: bool,
        progress: &Progress,
        client: impl std::fmt::Display,
    ) -> Self {
        let text_cap = if stored { 0 } else { progress.text_cap() };
        Self {
            api,
            stored,
            resume: Resume::new(api, text_cap, client),
            forwarded: 0,
        }
    }

    /// The next Responses `sequence_number`.
    fn sequence(&self) -> u64 {
        self.resume.sequence().max(self.forwarded)
    }
}

impl StreamCodec for Named {
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
        let end = match agentic_events::classify(self.api, event.data()) {
            EventKind::Created(id) => {
                if self.stored {
                    seen.stored = Some(id);
                }
                None
            }
            EventKind::Delta => {
                // One token an event, as the engines stream them; a
                // delta without text (another block's) counts none.
                seen.progress.observe(text.as_deref(), None, false);
                None
            }
            EventKind::End => Some(Ending::Ok),
            EventKind::Error => Some(Ending::WorkerError),
            EventKind::Other => None,
        };
        self.forwarded += 1;
        match end {
            Some(ending) => Step::End(ending, event.into_bytes()),
            None => Step::Send(event.into_bytes()),
        }
    }

    fn resumed(&mut self, delta: &Delta, progress: &Progress, at: &Prompt) -> Step {
        let bytes = self.resume.rewrite(delta, progress.generated, at.tokens);
        if delta.finish_reason.is_some() {
            // The rest of the worker's stream (usage, `[DONE]`) adds
            // nothing the client is shown.
            return Step::End(Ending::Ok, bytes);
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

    fn error_event(&self, error: &ErrorBody) -> Vec<u8> {
        agentic_events::error_event(self.api, &error.error.message, self.sequence())
    }

    fn resumable(&self, body: &Fields<'_>) -> Result<(), &'static str> {
        agentic_resume::resumable(self.api, body)?;
        match self.resume.overflowed() {
            true => Err("the generated text outgrew what the router keeps"),
            false => Ok(()),
        }
    }

    fn max_tokens(&self, body: &Fields<'_>) -> Option<u64> {
        agentic_resume::max_tokens(self.api, body)
    }

    fn resume_body(&self, body: &Fields<'_>, prompt: &[u32], remaining: Option<u64>) -> Vec<u8> {
        agentic_resume::resume_body(self.api, body, prompt, remaining)
    }

    fn all_arrived(&self, _progress: &Progress) -> bool {
        self.resume.closed()
    }
}
