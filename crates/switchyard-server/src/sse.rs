//! Server-sent events on the proxy path, sans I/O: an incremental parser
//! for the worker's stream, a reader of the few OpenAI chunk fields
//! migration needs, and the rewriter that puts a resumed worker's chunks
//! into the shape of the client's original response.
//!
//! Memory: the parser holds at most one incomplete event plus the frame
//! that was just pushed; an event larger than its limit is refused
//! ([`SseError::EventTooLarge`]) rather than buffered.

use serde_json::{json, Value};

/// `data: [DONE]`, the terminator of an OpenAI stream.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// Why the stream could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew past the limit without ending.
    #[error("a streamed event exceeds {limit} bytes")]
    EventTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
}

/// An incremental SSE parser: push bytes as they arrive, take complete
/// events. Comment lines (`: keep-alive`) and fields other than `data` are
/// skipped; several `data` lines of one event are joined with `\n`.
#[derive(Debug)]
pub struct SseParser {
    buf: Vec<u8>,
    limit: usize,
}

impl SseParser {
    /// A parser that refuses events longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            limit,
        }
    }

    /// Appends bytes from the worker.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete event's data, if one is buffered. `Ok(None)`: more
    /// bytes are needed. Events without data (comments) are skipped.
    pub fn next_event(&mut self) -> Result<Option<String>, SseError> {
        loop {
            let Some((content_end, consumed)) = find_event_end(&self.buf) else {
                if self.buf.len() > self.limit {
                    return Err(SseError::EventTooLarge { limit: self.limit });
                }
                return Ok(None);
            };
            let data = event_data(&self.buf[..content_end]);
            self.buf.drain(..consumed);
            if let Some(data) = data {
                return Ok(Some(data));
            }
        }
    }

    /// Bytes of an incomplete event still held.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

/// End of the first event: (end of its content, bytes to consume), where an
/// event ends at an empty line (`\n\n`, `\r\n\r\n`, or mixed).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut line_start = 0;
    for (i, &b) in buf.iter().enumerate() {
        if b != b'\n' {
            continue;
        }
        let line = &buf[line_start..i];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return Some((line_start, i + 1));
        }
        line_start = i + 1;
    }
    None
}

fn event_data(event: &[u8]) -> Option<String> {
    let mut data: Option<String> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(value) = line.strip_prefix(b"data:") else {
            continue;
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        let value = String::from_utf8_lossy(value);
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(&value);
            }
            None => data = Some(value.into_owned()),
        }
    }
    data
}

/// Which OpenAI API the client called: decides the response's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`: `chat.completion.chunk` with `delta.content`.
    Chat,
    /// `/v1/completions`: `text_completion` with `text`.
    Completions,
}

/// What one streamed event says, as far as migration cares.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// `[DONE]`.
    Done,
    /// An `{"error": ...}` event: the worker gave up mid-stream.
    Error,
    /// A chunk with a choice (or a usage-only chunk).
    Delta(Delta),
    /// Not JSON, or JSON of an unknown shape: forwarded, not interpreted.
    Unknown,
}

/// The fields of one chunk's first choice that migration reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// New text (`text` or `delta.content`); `None` when the chunk has none.
    pub text: Option<String>,
    /// Token ids of the new text, when the worker sends them
    /// (`choices[0].token_ids`, vLLM's `return_token_ids`).
    pub token_ids: Option<Vec<u32>>,
    /// The choice's `finish_reason`, when set.
    pub finish_reason: Option<String>,
    /// A usage object (the `include_usage` chunk).
    pub usage: Option<Value>,
    /// The chunk's `id`, `model` and `created`.
    pub id: Option<String>,
    /// See `id`.
    pub model: Option<String>,
    /// See `id`.
    pub created: Option<u64>,
}

/// Reads one event's data.
pub fn classify(data: &str) -> Chunk {
    if data.trim() == "[DONE]" {
        return Chunk::Done;
    }
    let Ok(Value::Object(v)) = serde_json::from_str::<Value>(data) else {
        return Chunk::Unknown;
    };
    if v.contains_key("error") {
        return Chunk::Error;
    }
    let usage = v.get("usage").filter(|u| u.is_object()).cloned();
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return Chunk::Unknown;
    };
    let mut delta = Delta {
        usage,
        id: v.get("id").and_then(Value::as_str).map(str::to_owned),
        model: v.get("model").and_then(Value::as_str).map(str::to_owned),
        created: v.get("created").and_then(Value::as_u64),
        ..Delta::default()
    };
    if let Some(choice) = choices.first() {
        delta.text = choice
            .get("text")
            .or_else(|| choice.get("delta").and_then(|d| d.get("content")))
            .and_then(Value::as_str)
            .map(str::to_owned);
        delta.token_ids = choice
            .get("token_ids")
            .and_then(Value::as_array)
            .map(|ids| {
                ids.iter()
                    .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect()
            });
        delta.finish_reason = choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned);
    }
    Chunk::Delta(delta)
}

/// The identity of the client's response, kept from its first chunk so
/// that a resumed stream continues under the same `id`, `model` and
/// `created`.
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
    /// A shape from the first chunk, with defaults for missing fields.
    pub fn from_delta(api: Api, delta: &Delta) -> Self {
        Self {
            api,
            id: delta.id.clone().unwrap_or_default(),
            model: delta.model.clone().unwrap_or_default(),
            created: delta.created.unwrap_or(0),
        }
    }

    /// A resumed worker's chunk as an event of the original response.
    /// `usage` (already adjusted by the caller) replaces the chunk's own.
    pub fn rewrite(&self, delta: &Delta, usage: Option<Value>) -> Vec<u8> {
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        };
        let choices = if usage.is_some() && delta.text.is_none() && delta.finish_reason.is_none() {
            json!([])
        } else {
            let text = delta.text.as_deref();
            match self.api {
                Api::Chat => {
                    let content = match text {
                        Some(t) => json!({ "content": t }),
                        None => json!({}),
                    };
                    json!([{"index": 0, "delta": content, "logprobs": null, "finish_reason": delta.finish_reason}])
                }
                Api::Completions => {
                    json!([{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": delta.finish_reason}])
                }
            }
        };
        let mut chunk = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        event_bytes(&chunk.to_string())
    }
}

/// `data: <payload>\n\n`.
pub fn event_bytes(payload: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(payload.as_bytes());
    out.extend_from_slice(b"\n\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_events(p: &mut SseParser) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(e) = p.next_event().unwrap() {
            out.push(e);
        }
        out
    }

    #[test]
    fn events_split_across_pushes_come_out_whole() {
        let mut p = SseParser::new(1024);
        p.push(b"data: {\"a\"");
        assert_eq!(p.next_event().unwrap(), None);
        p.push(b":1}\n");
        assert_eq!(p.next_event().unwrap(), None);
        p.push(b"\ndata: [DONE]\n\n");
        assert_eq!(all_events(&mut p), vec!["{\"a\":1}", "[DONE]"]);
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn comments_and_other_fields_are_skipped_and_crlf_is_accepted() {
        let mut p = SseParser::new(1024);
        p.push(b": keep-alive\n\nevent: x\r\nid: 3\r\ndata:one\r\ndata: two\r\n\r\n");
        assert_eq!(all_events(&mut p), vec!["one\ntwo"]);
    }

    #[test]
    fn an_event_over_the_limit_is_an_error_not_a_buffer() {
        let mut p = SseParser::new(16);
        p.push(&[b'x'; 17]);
        assert_eq!(p.next_event(), Err(SseError::EventTooLarge { limit: 16 }));
    }

    #[test]
    fn garbage_is_unknown_and_never_panics() {
        for data in ["", "{", "[1,2]", "null", "{\"choices\": 3}", "\u{0}"] {
            let _ = classify(data);
        }
        assert_eq!(classify("not json"), Chunk::Unknown);
        assert_eq!(classify("{\"error\": {\"message\": \"x\"}}"), Chunk::Error);
        assert_eq!(classify(" [DONE]"), Chunk::Done);
    }

    #[test]
    fn chat_and_completion_chunks_yield_text_ids_and_finish() {
        let Chunk::Delta(d) = classify(
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" hi"},"token_ids":[5],"finish_reason":null}]}"#,
        ) else {
            panic!()
        };
        assert_eq!(d.text.as_deref(), Some(" hi"));
        assert_eq!(d.token_ids, Some(vec![5]));
        assert_eq!(d.finish_reason, None);
        assert_eq!(
            (d.id.as_deref(), d.model.as_deref(), d.created),
            (Some("chatcmpl-1"), Some("m"), Some(7))
        );
        let Chunk::Delta(d) =
            classify(r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#)
        else {
            panic!()
        };
        assert_eq!(d.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn a_resumed_completion_chunk_is_rewritten_into_the_chat_shape() {
        let shape = StreamShape {
            api: Api::Chat,
            id: "chatcmpl-orig".into(),
            model: "m".into(),
            created: 42,
        };
        let Chunk::Delta(d) = classify(
            r#"{"id":"cmpl-new","object":"text_completion","created":99,"model":"other","choices":[{"index":0,"text":" yard","token_ids":[2],"finish_reason":null}]}"#,
        ) else {
            panic!()
        };
        let bytes = shape.rewrite(&d, None);
        let text = std::str::from_utf8(&bytes).unwrap();
        let payload = text.strip_prefix("data: ").unwrap().trim_end();
        let v: Value = serde_json::from_str(payload).unwrap();
        assert_eq!(v["id"], "chatcmpl-orig");
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["created"], 42);
        assert_eq!(v["model"], "m");
        assert_eq!(v["choices"][0]["delta"]["content"], " yard");
        assert!(v["choices"][0].get("token_ids").is_none());
        assert!(text.ends_with("\n\n"));
    }

    #[test]
    fn a_usage_chunk_keeps_empty_choices_in_the_completions_shape() {
        let shape = StreamShape {
            api: Api::Completions,
            id: "cmpl-1".into(),
            model: "m".into(),
            created: 1,
        };
        let d = Delta {
            usage: Some(json!({"completion_tokens": 3})),
            ..Delta::default()
        };
        let bytes = shape.rewrite(&d, Some(json!({"completion_tokens": 9})));
        let v: Value = serde_json::from_slice(&bytes[6..bytes.len() - 2]).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"], json!([]));
        assert_eq!(v["usage"]["completion_tokens"], 9);
    }
}
