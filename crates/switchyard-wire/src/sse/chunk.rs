//! What one event of an OpenAI stream says, read with the [`openai`] types,
//! and the rewriter that puts a chunk into another response's shape.
//!
//! [`openai`]: crate::openai

use super::json_event;
use crate::openai::{Api, Choice, ChoiceDelta, Completion, Usage};
use serde::de::IgnoredAny;
use serde::Deserialize;
use std::borrow::Cow;

/// What one event's data is.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// `[DONE]`: the stream is complete.
    Done,
    /// An object with an `error` key: the server gave up mid-stream.
    Error,
    /// A chunk ([`Completion`]) with its first choice read (or none, as in
    /// the usage chunk).
    Delta(Delta),
    /// Not JSON, or JSON of another shape (including a chunk with a field
    /// of the wrong type): forwarded, not interpreted.
    Unknown,
}

/// One chunk's identity, usage and first choice: what a reader of the
/// stream acts on. Only the first choice is read; a request with several
/// choices has to be read as [`Completion`]s.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// New text (`text` or `delta.content`); `None` when the chunk has none.
    pub text: Option<String>,
    /// Token ids of the new text, when the server sends them
    /// (`choices[0].token_ids`, vLLM's `return_token_ids`).
    pub token_ids: Option<Vec<u32>>,
    /// The choice's `finish_reason`, when set.
    pub finish_reason: Option<String>,
    /// The usage (the `include_usage` chunk).
    pub usage: Option<Usage>,
    /// The chunk's `id` (`""` when absent).
    pub id: String,
    /// The chunk's `model` (`""` when absent).
    pub model: String,
    /// The chunk's `created` (0 when absent).
    pub created: u64,
}

impl Delta {
    /// Tokens this chunk adds: its token ids when it carries them, else
    /// one for nonempty text, else none (a role-only, finish or usage
    /// chunk).
    pub fn tokens(&self) -> usize {
        match (&self.token_ids, &self.text) {
            (Some(ids), _) => ids.len(),
            (None, Some(text)) if !text.is_empty() => 1,
            (None, _) => 0,
        }
    }
}

impl From<Completion> for Delta {
    fn from(chunk: Completion) -> Self {
        let first = chunk.choices.into_iter().next();
        let (text, token_ids, finish_reason) = match first {
            Some(choice) => {
                let text = match (choice.text, choice.delta) {
                    (Some(text), _) => Some(text),
                    (None, Some(delta)) => delta.content,
                    (None, None) => None,
                };
                (text, choice.token_ids, choice.finish_reason)
            }
            None => (None, None, None),
        };
        Delta {
            text,
            token_ids,
            finish_reason,
            usage: chunk.usage,
            id: chunk.id,
            model: chunk.model,
            created: chunk.created,
        }
    }
}

/// Reads one event's data. Never fails: what it cannot read is
/// [`Chunk::Unknown`].
pub fn classify(data: &str) -> Chunk {
    let trimmed = data.trim();
    if trimmed == "[DONE]" {
        return Chunk::Done;
    }
    if !trimmed.starts_with('{') {
        return Chunk::Unknown;
    }
    // A JSON string cannot hold an unescaped `"`, so a top-level `error`
    // key shows as this substring; only then is the key looked for.
    if data.contains("\"error\"") && has_error_key(data) {
        return Chunk::Error;
    }
    match serde_json::from_str::<Completion>(data) {
        Ok(chunk) => Chunk::Delta(chunk.into()),
        Err(_) => Chunk::Unknown,
    }
}

/// Whether the object in `data` has a top-level `error` key.
fn has_error_key(data: &str) -> bool {
    #[derive(Deserialize)]
    struct Probe {
        #[serde(default, deserialize_with = "present")]
        error: bool,
    }
    fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
        IgnoredAny::deserialize(deserializer).map(|_| true)
    }
    serde_json::from_str::<Probe>(data).is_ok_and(|p| p.error)
}

/// The identity of the client's response, kept from its first chunk so
/// that chunks from another server continue it under the same `id`,
/// `model` and `created`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamShape {
    /// Chat or completions.
    pub api: Api,
    /// The response id.
    pub id: String,
    /// The model name.
    pub model: String,
    /// Unix seconds.
    pub created: u64,
}

impl StreamShape {
    /// A shape from the first chunk (missing fields read as `""` and 0).
    pub fn from_delta(api: Api, delta: &Delta) -> Self {
        Self {
            api,
            id: delta.id.clone(),
            model: delta.model.clone(),
            created: delta.created,
        }
    }

    /// `delta` as an event of this response: its text and finish reason in
    /// a choice of this shape (token ids dropped), and `usage` (already
    /// adjusted by the caller) instead of the chunk's own. A usage chunk
    /// with no text and no finish keeps its empty `choices`.
    pub fn rewrite(&self, delta: &Delta, usage: Option<Usage>) -> Vec<u8> {
        let choices = if usage.is_some() && delta.text.is_none() && delta.finish_reason.is_none() {
            Vec::new()
        } else {
            let mut choice = Choice {
                finish_reason: delta.finish_reason.clone(),
                ..Choice::default()
            };
            match self.api {
                Api::Chat => {
                    choice.delta = Some(ChoiceDelta {
                        role: None,
                        content: delta.text.clone(),
                    })
                }
                Api::Completions => choice.text = Some(delta.text.clone().unwrap_or_default()),
            }
            vec![choice]
        };
        json_event(&Completion {
            id: self.id.clone(),
            object: Cow::Borrowed(self.api.chunk_object()),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
    }
}
