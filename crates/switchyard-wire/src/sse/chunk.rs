//! What one event of an OpenAI stream says, read with the [`openai`] types,
//! and the rewriter that puts a chunk into another response's shape.
//!
//! [`openai`]: crate::openai

use super::json_event;
use crate::openai::{Api, Choice, ChoiceDelta, Completion, Usage};
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

/// What one event's data is.
#[derive(Debug, Clone, PartialEq)]
// A chunk is read and dropped per event, on the stack: boxing its delta
// (larger since JSON maps keep their order) would allocate per event.
#[allow(clippy::large_enum_variant)]
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

/// Reads one event's data. Never fails: what it cannot read is
/// [`Chunk::Unknown`]. [`classify_ref`], with the strings copied.
pub fn classify(data: &str) -> Chunk {
    match classify_ref(data) {
        ChunkRef::Done => Chunk::Done,
        ChunkRef::Error => Chunk::Error,
        ChunkRef::Delta(delta) => Chunk::Delta(delta.into_owned()),
        ChunkRef::Unknown => Chunk::Unknown,
    }
}

/// What one event's data is, its strings borrowed from the data: what a
/// proxy reads from every event of a stream without copying them.
#[derive(Debug, Clone, PartialEq)]
// A chunk is read and dropped per event, on the stack: boxing its delta
// (larger since JSON maps keep their order) would allocate per event.
#[allow(clippy::large_enum_variant)]
pub enum ChunkRef<'a> {
    /// `[DONE]`: the stream is complete.
    Done,
    /// An object with an `error` key: the server gave up mid-stream.
    Error,
    /// A chunk with its first choice read.
    Delta(DeltaRef<'a>),
    /// Not JSON, or JSON of another shape: forwarded, not interpreted.
    Unknown,
}

/// [`Delta`] borrowing its strings from the event's data (a string with
/// JSON escapes is unescaped into its own copy).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeltaRef<'a> {
    /// New text (`text` or `delta.content`).
    pub text: Option<Cow<'a, str>>,
    /// Token ids of the new text, when the server sends them.
    pub token_ids: Option<Vec<u32>>,
    /// The choice's `finish_reason`, when set.
    pub finish_reason: Option<Cow<'a, str>>,
    /// The usage (the `include_usage` chunk).
    pub usage: Option<Usage>,
    /// The chunk's `id` (`""` when absent).
    pub id: Cow<'a, str>,
    /// The chunk's `model` (`""` when absent).
    pub model: Cow<'a, str>,
    /// The chunk's `created` (0 when absent).
    pub created: u64,
}

impl DeltaRef<'_> {
    /// The same delta owning its strings.
    pub fn into_owned(self) -> Delta {
        Delta {
            text: self.text.map(Cow::into_owned),
            token_ids: self.token_ids,
            finish_reason: self.finish_reason.map(Cow::into_owned),
            usage: self.usage,
            id: self.id.into_owned(),
            model: self.model.into_owned(),
            created: self.created,
        }
    }
}

/// [`classify`] without copying the chunk's strings. A chunk is read as a
/// [`Completion`] (every field of every choice type-checked; a wrong type
/// makes it [`ChunkRef::Unknown`]) that keeps only its first choice and
/// borrows its strings (only one with escapes is copied, unescaped).
pub fn classify_ref(data: &str) -> ChunkRef<'_> {
    let trimmed = data.trim();
    if trimmed == "[DONE]" {
        return ChunkRef::Done;
    }
    if !trimmed.starts_with('{') {
        return ChunkRef::Unknown;
    }
    // A JSON string cannot hold an unescaped `"`, so a top-level `error`
    // key shows as this substring; only then is the key looked for.
    if data.contains("\"error\"") && has_error_key(data) {
        return ChunkRef::Error;
    }
    match serde_json::from_str::<Completion<'_, FirstChoice<'_>>>(data) {
        Ok(chunk) => ChunkRef::Delta(chunk.into()),
        Err(_) => ChunkRef::Unknown,
    }
}

/// `choices` as [`classify_ref`] holds it: the first choice (`None` when
/// empty). The others are read as [`Choice`]s too, so that a wrong type
/// anywhere fails the chunk as it fails a whole [`Completion`], and
/// dropped.
struct FirstChoice<'a>(Option<Choice<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct First<'a>(PhantomData<Choice<'a>>);
        impl<'de: 'a, 'a> Visitor<'de> for First<'a> {
            type Value = FirstChoice<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Choice<'a>>()?;
                while seq.next_element::<Choice<'a>>()?.is_some() {}
                Ok(FirstChoice(first))
            }
        }
        deserializer.deserialize_seq(First(PhantomData))
    }
}

impl<'a> From<Completion<'a, FirstChoice<'a>>> for DeltaRef<'a> {
    fn from(chunk: Completion<'a, FirstChoice<'a>>) -> Self {
        let (text, token_ids, finish_reason) = match chunk.choices.0 {
            Some(choice) => (
                choice.text.or_else(|| choice.delta?.content),
                choice.token_ids,
                choice.finish_reason,
            ),
            None => (None, None, None),
        };
        DeltaRef {
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
            let text = delta.text.as_deref().map(Cow::Borrowed);
            let mut choice = Choice {
                finish_reason: delta.finish_reason.as_deref().map(Cow::Borrowed),
                ..Choice::default()
            };
            match self.api {
                Api::Chat => {
                    choice.delta = Some(ChoiceDelta {
                        role: None,
                        content: text,
                    })
                }
                Api::Completions => choice.text = Some(text.unwrap_or_default()),
            }
            vec![choice]
        };
        json_event(&Completion {
            id: Cow::Borrowed(&self.id),
            object: Cow::Borrowed(self.api.chunk_object()),
            created: self.created,
            model: Cow::Borrowed(&self.model),
            choices,
            usage,
        })
    }
}
