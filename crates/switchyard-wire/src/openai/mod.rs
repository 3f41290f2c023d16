//! The OpenAI HTTP API as our servers and clients speak it: request bodies
//! ([`CompletionRequest`], [`ChatCompletionRequest`]), answers and streamed
//! chunks ([`Completion`]), and the error body ([`ErrorBody`]). Plain serde
//! types: the router, the simulated worker and the load generator each wrap
//! them in their own HTTP framework.
//!
//! Reading is lenient where a reader must not judge (unknown fields are
//! ignored everywhere; fields only a worker interprets are [`Lenient`]) and
//! typed everywhere else: a prompt is parsed straight into token ids or
//! strings, never through a generic JSON tree, and a router parses a body
//! within [`BodyLimits`] (prompt tokens, messages, content parts), stopping
//! at the first element past a bound.

mod bounded;
mod error;
pub(crate) mod lenient;
mod request;
mod response;
pub mod tools;

pub use bounded::{BodyError, BodyLimits, Limit, OverLimit};
pub use error::{ErrorBody, ErrorCode, ErrorDetail};
pub use lenient::Lenient;
pub use request::{
    joined_text, ChatCompletionRequest, CompletionRequest, ContentPart, LaterPrompts, Message,
    MessageContent, Prompt, StreamOptions,
};
pub use response::{
    completion_tokens, Choice, ChoiceDelta, ChoiceMessage, Completion, PromptTokensDetails, Usage,
};
pub use tools::ToolCall;

/// Which OpenAI endpoint a request came through: it decides the shape of
/// the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `/v1/chat/completions`: `message` (whole) or `delta` (streamed)
    /// choices.
    Chat,
    /// `/v1/completions`: `text` choices.
    Completions,
}

impl Api {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }

    /// The `object` of a whole answer.
    pub fn object(self) -> &'static str {
        match self {
            Api::Chat => "chat.completion",
            Api::Completions => "text_completion",
        }
    }

    /// The `object` of a streamed chunk.
    pub fn chunk_object(self) -> &'static str {
        match self {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        }
    }

    /// The prefix of answer ids (`chatcmpl-…`, `cmpl-…`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl",
            Api::Completions => "cmpl",
        }
    }
}

#[cfg(test)]
mod bounded_tests;
#[cfg(test)]
mod tests;
