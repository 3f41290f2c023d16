//! What each API makes of a relayed stream, sans I/O: one codec per API
//! that reads a worker's events, says what the client is sent, and, once
//! the stream has moved to another worker, writes that worker's
//! `/v1/completions` chunks in the API's own shape. The router's relay
//! (its socket reads, timeouts, bookings and metrics) drives a
//! [`StreamCodec`] and names no API:
//!
//! - [`chat::Chunks`] — the chat API (`/v1/chat/completions`,
//!   `/v1/completions`): the first worker's chunks byte for byte, a
//!   resumed worker's rewritten into the original response's shape.
//! - [`named::Named`] — the Responses and Messages APIs: the worker's
//!   named events unchanged, a resumed worker's chunks rewritten into the
//!   API's events ([`crate::resume::agentic::Resume`]).
//!
//! Which requests may be resumed at all, and the body that resumes them,
//! are [`crate::resume`]'s; the progress a resume needs (tokens so far,
//! bounded) is the core's [`Progress`].

pub mod chat;
pub mod named;

use crate::body_fields::Fields;
use crate::openai::ErrorBody;
use crate::sse::{classify_ref, ChunkRef, Delta, SseError, SseParser};
use switchyard_core::dispatch::failure::Progress;

/// What one API makes of a relayed stream.
pub trait StreamCodec: Send + Sync + Sized + 'static {
    /// One whole event as this API's streams are read.
    type Event: Send + 'static;
    /// Why a worker's stream that ends before its last event failed.
    const ENDED_EARLY: &'static str;

    /// The parser's next whole event (`Ok(None)`: more bytes needed).
    fn read(parser: &mut SseParser) -> Result<Option<Self::Event>, SseError>;

    /// The event's data.
    fn data(event: &Self::Event) -> &str;

    /// What the relay does with an event of the first worker. Sets
    /// `seen.output` when the client is shown output and records tokens
    /// in `seen.progress`.
    fn first_worker(&mut self, event: Self::Event, seen: &mut Seen<'_>) -> Step;

    /// A resumed worker's delta (its tokens already in `progress`) as the
    /// client's bytes.
    fn resumed(&mut self, delta: &Delta, progress: &Progress, at: &Prompt) -> Step;

    /// The closing bytes of a stream whose tokens have all arrived,
    /// finished for `reason` (`stop`, `length`).
    fn close(&mut self, reason: &str, progress: &Progress, at: &Prompt) -> Vec<u8>;

    /// The event telling the client the stream failed with `error`.
    fn error_event(&self, error: &ErrorBody) -> Vec<u8>;

    /// Whether the request may be resumed at all, from the client's body.
    fn resumable(&self, body: &Fields<'_>) -> Result<(), &'static str>;

    /// The client's output limit, from its body.
    fn max_tokens(&self, body: &Fields<'_>) -> Option<u64>;

    /// The `/v1/completions` body that resumes the request: `prompt` (the
    /// prompt's ids and the generated ones), at most `remaining` tokens.
    fn resume_body(&self, body: &Fields<'_>, prompt: &[u32], remaining: Option<u64>) -> Vec<u8>;

    /// Every token had arrived when the stream broke (only its closing
    /// events were lost).
    fn all_arrived(&self, progress: &Progress) -> bool;

    /// An event of a resumed worker (a `/v1/completions` chunk) as the
    /// client's: its tokens recorded in `seen.progress` (and
    /// `seen.output` set) when it carries a delta.
    fn resumed_event(&mut self, event: &Self::Event, seen: &mut Seen<'_>, at: &Prompt) -> Step {
        match classify_ref(Self::data(event)) {
            ChunkRef::Done => Step::End(Ending::Ok, self.close("stop", seen.progress, at)),
            ChunkRef::Error => Step::Broken("the worker sent an error event mid-stream".into()),
            ChunkRef::Unknown => Step::Skip,
            ChunkRef::Delta(delta) => {
                seen.progress.observe(
                    delta.text.as_deref(),
                    delta.token_ids.as_deref(),
                    delta.finish_reason.is_some(),
                );
                seen.output = true;
                self.resumed(&delta.into_owned(), seen.progress, at)
            }
        }
    }
}

/// An event as the codec reads it: what it recorded, and what the relay
/// is to do beside forwarding.
pub struct Seen<'a> {
    /// The tokens generated so far (the codec records an event's).
    pub progress: &'a mut Progress,
    /// The client is shown output (the relay observes timing and tells
    /// the booking its progress).
    pub output: bool,
    /// A stored response's id the worker announced (Responses
    /// `response.created`, when the request is stored): the relay
    /// remembers it with the worker.
    pub stored: Option<String>,
}

impl<'a> Seen<'a> {
    /// Nothing seen yet, tokens recorded in `progress`.
    pub fn new(progress: &'a mut Progress) -> Self {
        Self {
            progress,
            output: false,
            stored: None,
        }
    }
}

/// The prompt of a relayed request, as counts: its token ids (what a
/// resumed prompt starts with), and its tokens (counted or estimated).
#[derive(Clone, Debug, Default)]
pub struct Prompt {
    /// The prompt's token ids as routed.
    pub ids: Vec<u32>,
    /// The prompt's tokens, counted or estimated.
    pub tokens: u64,
    /// `progress.generated` when the current worker's part started.
    pub generated_at_resume: u64,
}

/// What the relay does next.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Forward these bytes.
    Send(Vec<u8>),
    /// Forward these bytes, the response's last: it ended so.
    End(Ending, Vec<u8>),
    /// The worker failed the stream (an error event): resume it.
    Broken(String),
    /// Nothing for the client: read on.
    Skip,
}

/// How a stream's last event ended it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The answer is whole.
    Ok,
    /// The worker's own error event, passed on as it sent it.
    WorkerError,
}

#[cfg(test)]
mod tests;
