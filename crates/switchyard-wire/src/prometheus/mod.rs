//! The Prometheus text exposition format (version 0.0.4), read: one
//! bounded, lossy reader for the `/metrics` pages of engines (vLLM,
//! SGLang, the sim-worker) and of Switchyard's own processes, and the two
//! queries the tools ask of a page — one series' value, and the sum of a
//! metric over all its label sets.
//!
//! What a line may be:
//!
//! - a sample, `name{label="value",...} value [timestamp]`: the metric name
//!   `[a-zA-Z_:][a-zA-Z0-9_:]*` (vLLM's `vllm:` and SGLang's `sglang:`
//!   names included), an optional label set (label names
//!   `[a-zA-Z_][a-zA-Z0-9_]*`; values any UTF-8 with `\\`, `\"` and `\n`
//!   escaped; blanks around `=` and `,`; a trailing comma), the value in
//!   Go's float syntax (`NaN`, `+Inf`, `-Inf`, `1.5e+09`), and an optional
//!   integer timestamp in milliseconds; blanks and tabs between tokens;
//! - a comment (`#` first, `# HELP` and `# TYPE` included) or an empty
//!   line, skipped;
//! - anything else — a broken label set, an unknown escape, a value that is
//!   not a number, a trailing token, invalid UTF-8, more than
//!   [`MAX_LABELS`] labels, OpenMetrics' quoted UTF-8 names — is malformed:
//!   skipped and counted ([`Scrape::malformed_lines`]).
//!
//! Lines end at `\n` (a `\r` before it is dropped). Nothing panics on any
//! input.
//!
//! Bounds, whatever the page: [`Scrape::parse`] looks at the first
//! [`MAX_INPUT_BYTES`] bytes (a line cut by that limit is not read), at the
//! first [`MAX_LINES`] lines of those, and at most [`MAX_LABELS`] labels of
//! one sample; whether a limit left something unread is
//! [`Scrape::truncated`]. Samples borrow the text: a scrape holds one
//! `Vec` of at most [`MAX_LINES`] samples, and a label value is unescaped
//! into a new string only when it has an escape and is asked for.
//!
//! Why our own reader and not a crate: `prometheus-parse` (0.2.5, the
//! most used) matches metric names with the regex `\w+`, which has no
//! `:`, so it skips every `vllm:` and `sglang:` series; it splits label
//! sets on `,` and `=` without unescaping, stamps samples with the clock,
//! and brings `regex`, `chrono`, `itertools` and `once_cell`.
//! `openmetrics-parser` is LGPL-3.0 and built on `pest`.
//! `prom_text_format_parser` has had one release (0.1.0, on `winnow` 0.5,
//! `derive_more` 0.99 and `strum`) and answers one `Result` for a whole
//! page. The workspace's `prometheus-client` only encodes. A sample line
//! is small enough to read in a page of code without dependencies; the
//! tests hold this reader to `prometheus-client`'s encoder and to a naive
//! reference (property tests) and to a real vLLM page.
//!
//! Data flow: `/metrics` body → [`Scrape::parse_bytes`] (or
//! [`Scrape::parse`]) → [`Scrape::value`] (by name and label matchers),
//! [`Scrape::sum`] (over label sets), [`Scrape::series_value`] (a series
//! as written), [`Scrape::series`] → [`Sample::labels`].

#[cfg(test)]
mod tests;

use std::borrow::Cow;

/// Bytes of a page [`Scrape::parse`] looks at (4 MiB; a real vLLM page
/// is about 55 KB).
pub const MAX_INPUT_BYTES: usize = 4 << 20;

/// Lines of a page [`Scrape::parse`] looks at, comments included (a real
/// vLLM page has about 660).
pub const MAX_LINES: usize = 100_000;

/// Labels one sample may have; one with more is malformed (vLLM's
/// `vllm:cache_config_info` has 37).
pub const MAX_LABELS: usize = 128;

/// One sample line: a series (name and label set) and its value.
///
/// Its label set is kept as the text it was read from (checked when
/// read), so a sample is four words and copying it allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    name: &'a str,
    /// The label set's text after `{`, up to and including `}`; empty
    /// without a label set.
    labels: &'a str,
    value: f64,
    timestamp_ms: Option<i64>,
}

impl<'a> Sample<'a> {
    /// The metric name, e.g. `vllm:prefix_cache_hits_total`.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The value (any `f64`: `NaN` and infinities as written).
    pub fn value(&self) -> f64 {
        self.value
    }

    /// The timestamp, milliseconds since the Unix epoch, when the line
    /// has one.
    pub fn timestamp_ms(&self) -> Option<i64> {
        self.timestamp_ms
    }

    /// The labels, `(name, value)` in the order written, values unescaped.
    pub fn labels(&self) -> Labels<'a> {
        Labels {
            text: self.labels,
            at: 0,
        }
    }

    /// The value of label `name` (the first, should the line name it
    /// twice).
    pub fn label(&self, name: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// Whether every matcher's label is present with exactly that value;
    /// no matchers match every sample.
    pub fn matches(&self, matchers: &[(&str, &str)]) -> bool {
        matchers
            .iter()
            .all(|(name, value)| self.label(name).is_some_and(|v| v == *value))
    }
}

/// The labels of a [`Sample`], in the order written: `(name, value)`,
/// the value unescaped (borrowed unless it has an escape).
#[derive(Debug, Clone)]
pub struct Labels<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        match label_step(self.text.as_bytes(), self.at) {
            Some(Step::Label { name, value, next }) => {
                self.at = next;
                let name = self.text.get(name.0..name.1)?;
                let value = self.text.get(value.0..value.1)?;
                Some((name, unescape(value)))
            }
            Some(Step::End(_)) | None => {
                self.at = self.text.len();
                None
            }
        }
    }
}

/// One page of Prometheus text, read: its samples in page order, and how
/// many lines were malformed.
#[derive(Debug, Clone, Default)]
pub struct Scrape<'a> {
    samples: Vec<Sample<'a>>,
    malformed: usize,
    truncated: bool,
}

impl<'a> Scrape<'a> {
    /// Reads `text` (within the module's bounds).
    pub fn parse(text: &'a str) -> Self {
        Self::parse_bytes(text.as_bytes())
    }

    /// Reads `bytes`, an HTTP body as it came: a line that is not UTF-8 is
    /// malformed, the others are read.
    pub fn parse_bytes(bytes: &'a [u8]) -> Self {
        let mut scrape = Scrape::default();
        let mut rest = bytes;
        if rest.len() > MAX_INPUT_BYTES {
            scrape.truncated = true;
            let head = &rest[..MAX_INPUT_BYTES];
            rest = match head.iter().rposition(|&b| b == b'\n') {
                Some(end) => &head[..end],
                None => &[],
            };
        }
        let mut lines = 0;
        while !rest.is_empty() {
            if lines == MAX_LINES {
                scrape.truncated = true;
                break;
            }
            lines += 1;
            let line = match rest.iter().position(|&b| b == b'\n') {
                Some(end) => {
                    let line = &rest[..end];
                    rest = &rest[end + 1..];
                    line
                }
                None => std::mem::take(&mut rest),
            };
            let Ok(line) = std::str::from_utf8(line) else {
                scrape.malformed += 1;
                continue;
            };
            let line = line.trim_matches([' ', '\t', '\r']);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match parse_sample(line) {
                Some(sample) => scrape.samples.push(sample),
                None => scrape.malformed += 1,
            }
        }
        scrape
    }

    /// Every sample, in page order.
    pub fn samples(&self) -> &[Sample<'a>] {
        &self.samples
    }

    /// Lines skipped as malformed (not comments, not empty, not samples).
    pub fn malformed_lines(&self) -> usize {
        self.malformed
    }

    /// Whether the page went past [`MAX_INPUT_BYTES`] or [`MAX_LINES`]:
    /// its rest was not read.
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// The samples of metric `name` (exactly that name), every label set.
    pub fn series<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s Sample<'a>> + 's {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The value of the first series of `name` whose labels match
    /// `matchers` ([`Sample::matches`]; none: the first series of `name`).
    pub fn value(&self, name: &str, matchers: &[(&str, &str)]) -> Option<f64> {
        self.series(name)
            .find(|s| s.matches(matchers))
            .map(Sample::value)
    }

    /// The value of one series written as on a page — `name` or
    /// `name{label="value",...}` — with exactly those labels, in any order
    /// (the first such sample); `None` when the page has none or `series`
    /// is not written as a series.
    pub fn series_value(&self, series: &str) -> Option<f64> {
        let line = format!("{} 0", series.trim());
        let wanted = parse_sample(&line)?;
        let labels: Vec<(&str, Cow<'_, str>)> = wanted.labels().collect();
        let matchers: Vec<(&str, &str)> = labels.iter().map(|(n, v)| (*n, v.as_ref())).collect();
        self.samples
            .iter()
            .find(|s| {
                s.name == wanted.name
                    && s.labels().count() == matchers.len()
                    && s.matches(&matchers)
            })
            .map(Sample::value)
    }

    /// The sum of `name` over all its label sets (vLLM exports one series
    /// per engine and model); `None` when the page has no series of it.
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.series(name).map(Sample::value).reduce(|a, b| a + b)
    }
}

/// One sample line, already trimmed and neither empty nor a comment.
fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let b = line.as_bytes();
    let name_end = metric_name_end(b)?;
    let mut at = skip_blanks(b, name_end);
    let mut labels = "";
    if b.get(at) == Some(&b'{') {
        let close = label_set_end(b, at + 1)?;
        labels = line.get(at + 1..close + 1)?;
        at = close + 1;
    } else if at == name_end {
        // The name runs into something that is neither a blank nor `{`.
        return None;
    }
    let mut fields = line
        .get(at..)?
        .split([' ', '\t'])
        .filter(|field| !field.is_empty());
    let value = fields.next()?.parse::<f64>().ok()?;
    let timestamp_ms = match fields.next() {
        Some(field) => Some(field.parse::<i64>().ok()?),
        None => None,
    };
    if fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name: line.get(..name_end)?,
        labels,
        value,
        timestamp_ms,
    })
}

/// The end of the metric name at the start of `b`.
fn metric_name_end(b: &[u8]) -> Option<usize> {
    let first = *b.first()?;
    if !(first.is_ascii_alphabetic() || first == b'_' || first == b':') {
        return None;
    }
    Some(
        b.iter()
            .position(|&c| !(c.is_ascii_alphanumeric() || c == b'_' || c == b':'))
            .unwrap_or(b.len()),
    )
}

/// The index of the `}` closing the label set whose text starts at `at`
/// (just after `{`), when the set is well formed and has at most
/// [`MAX_LABELS`] labels.
fn label_set_end(b: &[u8], mut at: usize) -> Option<usize> {
    let mut labels = 0;
    loop {
        match label_step(b, at)? {
            Step::End(close) => return Some(close),
            Step::Label { next, .. } => {
                labels += 1;
                if labels > MAX_LABELS {
                    return None;
                }
                at = next;
            }
        }
    }
}

/// What comes next in a label set: its end, or one label (byte ranges of
/// its name and of its value's escaped text) and where the next step starts.
enum Step {
    End(usize),
    Label {
        name: (usize, usize),
        value: (usize, usize),
        next: usize,
    },
}

/// Reads one step of a label set at `at` (after `{` or `,`); `None` when
/// the text there is not a label set.
fn label_step(b: &[u8], at: usize) -> Option<Step> {
    let start = skip_blanks(b, at);
    let first = *b.get(start)?;
    if first == b'}' {
        return Some(Step::End(start));
    }
    if !(first.is_ascii_alphabetic() || first == b'_') {
        return None;
    }
    let name_end = b[start..]
        .iter()
        .position(|&c| !(c.is_ascii_alphanumeric() || c == b'_'))
        .map_or(b.len(), |n| start + n);
    let equals = skip_blanks(b, name_end);
    if *b.get(equals)? != b'=' {
        return None;
    }
    let quote = skip_blanks(b, equals + 1);
    if *b.get(quote)? != b'"' {
        return None;
    }
    let value_start = quote + 1;
    let value_end = closing_quote(b, value_start)?;
    let after = skip_blanks(b, value_end + 1);
    let next = match *b.get(after)? {
        b',' => after + 1,
        b'}' => after,
        _ => return None,
    };
    Some(Step::Label {
        name: (start, name_end),
        value: (value_start, value_end),
        next,
    })
}

/// The index of the `"` ending a label value that starts at `at`; `None`
/// for an unknown escape or no end. Byte-wise is sound: UTF-8 continuation
/// bytes are never `"` or `\`.
fn closing_quote(b: &[u8], mut at: usize) -> Option<usize> {
    loop {
        match *b.get(at)? {
            b'"' => return Some(at),
            b'\\' => match *b.get(at + 1)? {
                b'\\' | b'"' | b'n' => at += 2,
                _ => return None,
            },
            _ => at += 1,
        }
    }
}

fn skip_blanks(b: &[u8], at: usize) -> usize {
    b.get(at..)
        .and_then(|rest| rest.iter().position(|&c| c != b' ' && c != b'\t'))
        .map_or(b.len(), |n| at + n)
}

/// A label value's escaped text, unescaped (`\\`, `\"`, `\n`).
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(escaped) => out.push(escaped),
            None => {}
        }
    }
    Cow::Owned(out)
}
