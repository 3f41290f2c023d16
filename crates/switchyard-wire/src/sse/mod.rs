//! Server-sent events, sans I/O: an incremental parser for any framing of
//! a stream ([`SseParser`]), the writer of one event ([`event_bytes`],
//! [`json_event`], [`DONE_EVENT`]), and what an OpenAI stream's events say
//! ([`classify`] into a [`Chunk`]; [`StreamShape::rewrite`] to put a chunk
//! into another response's shape).
//!
//! Data flow: bytes as they arrive → [`SseParser::push`] →
//! [`SseParser::next_event`] (one event's data) → [`classify`].

mod chunk;

pub use chunk::{classify, classify_ref, Chunk, ChunkRef, Delta, DeltaRef, StreamShape};

use serde::Serialize;

/// `data: [DONE]`, the terminator of an OpenAI stream.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// `data: <payload>\n\n`. `payload` must not contain a newline (JSON text
/// written by serde never does).
pub fn event_bytes(payload: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(payload.as_bytes());
    out.extend_from_slice(b"\n\n");
    out
}

/// `value` as JSON in one event. For the wire crate's own types, which
/// always serialize.
pub fn json_event<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut out, value)
        .expect("wire types are structs of strings, numbers and string-keyed maps: they serialize");
    out.extend_from_slice(b"\n\n");
    out
}

/// Why the stream cannot be parsed (any further).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event is longer than the parser's limit.
    #[error("a streamed event exceeds {limit} bytes")]
    EventTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
}

/// An incremental SSE parser: push bytes as they arrive, in frames of any
/// size and split anywhere; take whole events' data.
///
/// - An event ends at an empty line; lines end with `\n` or `\r\n` (a lone
///   `\r` is not a line end).
/// - `data` fields are kept: `data: x` and `data:x` both give `x`, a bare
///   `data` gives an empty line, and several `data` lines of one event are
///   joined with `\n`. Other fields (`event`, `id`, `retry`) and comment
///   lines (`: keep-alive`) are skipped; an event without data is skipped
///   whole. `[DONE]` is data like any other ([`classify`] reads it).
/// - An event longer than `limit` bytes (counted from its first byte
///   through the empty line that ends it) is an error however it was
///   framed, and the error is final: the parser then drops what it holds
///   and ignores further bytes. It holds at most one incomplete event
///   (never more than `limit` bytes) plus the events of the frame just
///   pushed that were not taken yet.
/// - Invalid UTF-8 in data is replaced (U+FFFD), never an error.
#[derive(Debug)]
pub struct SseParser {
    buf: Vec<u8>,
    /// Start of the first event not yet taken.
    start: usize,
    /// Start of the line being scanned.
    line_start: usize,
    /// Bytes before this have been scanned (no event end among them past
    /// `start`).
    scanned: usize,
    limit: usize,
    failed: Option<SseError>,
}

impl SseParser {
    /// A parser that refuses events longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            line_start: 0,
            scanned: 0,
            limit,
            failed: None,
        }
    }

    /// The largest event accepted, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Appends bytes from the stream (ignored once the parser has failed).
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        if self.start > 0 && self.start >= self.buf.len() / 2 {
            // Taken events are dropped in bulk, not one drain per event.
            self.buf.drain(..self.start);
            self.line_start -= self.start;
            self.scanned -= self.start;
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole event's data. `Ok(None)`: more bytes are needed.
    pub fn next_event(&mut self) -> Result<Option<String>, SseError> {
        self.next_with(event_data)
    }

    /// The next whole event as it is forwarded: [`Event`] holds
    /// `data: <data>\n\n` ([`event_bytes`] of what [`Self::next_event`]
    /// gives) built in one allocation of exactly its length, so a proxy
    /// forwards it (`Bytes::from(event.into_bytes())`) without copying it
    /// again.
    pub fn next_event_framed(&mut self) -> Result<Option<Event>, SseError> {
        self.next_with(event_framed)
    }

    /// The next whole event with every line kept (`event:`, `id:`,
    /// `data:`), as [`NamedEvent`]: what a proxy forwards of a stream
    /// whose events are named (the Responses API's, Anthropic's).
    pub fn next_event_named(&mut self) -> Result<Option<NamedEvent>, SseError> {
        self.next_with(event_named)
    }

    /// The next whole event with data, read by `read` (`None`: no data,
    /// skipped).
    fn next_with<T>(&mut self, read: fn(&[u8]) -> Option<T>) -> Result<Option<T>, SseError> {
        loop {
            if let Some(error) = &self.failed {
                return Err(error.clone());
            }
            let Some(end) = self.find_event_end() else {
                if self.buffered() > self.limit {
                    return Err(self.fail());
                }
                return Ok(None);
            };
            // `end` is one past the empty line's `\n`; `line_start` is the
            // start of that empty line, where the event's content ends.
            let (start, content_end) = (self.start, self.line_start);
            if end - start > self.limit {
                return Err(self.fail());
            }
            self.start = end;
            self.line_start = end;
            self.scanned = end;
            if let Some(data) = read(&self.buf[start..content_end]) {
                return Ok(Some(data));
            }
        }
    }

    /// Bytes held that no event taken so far used.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Scans on from where the last call stopped for the empty line ending
    /// the first held event; returns one past its `\n`.
    fn find_event_end(&mut self) -> Option<usize> {
        while let Some(offset) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            let newline = self.scanned + offset;
            self.scanned = newline + 1;
            let line = &self.buf[self.line_start..newline];
            if line.is_empty() || line == b"\r" {
                return Some(newline + 1);
            }
            self.line_start = newline + 1;
        }
        None
    }

    fn fail(&mut self) -> SseError {
        let error = SseError::EventTooLarge { limit: self.limit };
        self.failed = Some(error.clone());
        self.buf = Vec::new();
        self.start = 0;
        self.line_start = 0;
        self.scanned = 0;
        error
    }
}

/// One event, held as the bytes that forward it: `data: <data>\n\n`
/// ([`SseParser::next_event_framed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event(String);

impl Event {
    /// An event of `data` (which must not contain a newline to be read
    /// back as one data line).
    pub fn from_data(data: &str) -> Self {
        let mut framed = String::with_capacity(data.len() + FRAMING);
        framed.push_str("data: ");
        framed.push_str(data);
        framed.push_str("\n\n");
        Self(framed)
    }

    /// The event's data (what [`SseParser::next_event`] gives).
    pub fn data(&self) -> &str {
        // The framing is ASCII, so both ends are character boundaries.
        &self.0["data: ".len()..self.0.len() - "\n\n".len()]
    }

    /// The event's bytes, `data: <data>\n\n` ([`event_bytes`] of its data).
    pub fn into_bytes(self) -> Vec<u8> {
        self.0.into_bytes()
    }
}

/// One event with all its lines, as it came (its line ends made `\n`):
/// `event: <name>` and `data: <data>` lines are both forwarded
/// ([`SseParser::next_event_named`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedEvent {
    text: String,
    /// The joined `data` lines.
    data: String,
}

impl NamedEvent {
    /// An event named `name` (when given) of `data` (no newline in it).
    pub fn new(name: Option<&str>, data: &str) -> Self {
        let mut text = String::with_capacity(data.len() + 32);
        if let Some(name) = name {
            text.push_str("event: ");
            text.push_str(name);
            text.push('\n');
        }
        text.push_str("data: ");
        text.push_str(data);
        text.push_str("\n\n");
        Self {
            text,
            data: data.to_owned(),
        }
    }

    /// Its `event:` name, if it has one.
    pub fn name(&self) -> Option<&str> {
        self.text.lines().find_map(|l| {
            l.strip_prefix("event:")
                .map(|n| n.strip_prefix(' ').unwrap_or(n))
        })
    }

    /// Its data (the `data` lines joined by `\n`).
    pub fn data(&self) -> &str {
        &self.data
    }

    /// The event's bytes, every line as it came, ending in an empty line.
    pub fn into_bytes(self) -> Vec<u8> {
        self.text.into_bytes()
    }
}

fn event_named(event: &[u8]) -> Option<NamedEvent> {
    let data = event_data(event)?;
    let mut text = String::with_capacity(event.len() + 2);
    // The content ends with its last line's `\n`: no empty line after it.
    let content = event.strip_suffix(b"\n").unwrap_or(event);
    for line in content.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        text.push_str(&String::from_utf8_lossy(line));
        text.push('\n');
    }
    text.push('\n');
    Some(NamedEvent { text, data })
}

/// Bytes of `data: ` and the ending `\n\n`.
const FRAMING: usize = 8;

/// The `data` lines' values of one event's content, each as it is
/// written (`data: x` and `data:x` give `x`, a bare `data` gives "").
fn data_values(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    event.split(|&b| b == b'\n').filter_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line == b"data" {
            Some(&[][..])
        } else {
            let value = line.strip_prefix(b"data:")?;
            Some(value.strip_prefix(b" ").unwrap_or(value))
        }
    })
}

/// [`event_data`] framed as [`Event`]: sized exactly (for valid UTF-8)
/// before it is written, so it is one allocation whose length is its
/// capacity.
fn event_framed(event: &[u8]) -> Option<Event> {
    let (lines, bytes) =
        data_values(event).fold((0usize, 0usize), |(n, b), v| (n + 1, b + v.len()));
    if lines == 0 {
        return None;
    }
    let mut framed = String::with_capacity(FRAMING + bytes + (lines - 1));
    framed.push_str("data: ");
    for (i, value) in data_values(event).enumerate() {
        if i > 0 {
            framed.push('\n');
        }
        framed.push_str(&String::from_utf8_lossy(value));
    }
    framed.push_str("\n\n");
    Some(Event(framed))
}

/// The joined `data` lines of one event's content (its lines without the
/// ending empty line), or `None` when it has none.
fn event_data(event: &[u8]) -> Option<String> {
    let mut data: Option<String> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let value = if line == b"data" {
            &[][..]
        } else if let Some(value) = line.strip_prefix(b"data:") {
            value.strip_prefix(b" ").unwrap_or(value)
        } else {
            continue;
        };
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

#[cfg(test)]
mod tests;
