//! Azure LLM inference traces (2023): CSV `TIMESTAMP,ContextTokens,GeneratedTokens`.
//!
//! Timestamps are wall-clock datetimes such as `2023-11-16 18:15:46.6805900`;
//! arrivals are taken relative to the first row. The trace carries no prefix
//! information: prompts are random tokens (a pure load trace).

use super::{Lines, TraceError};
use std::io::BufRead;

/// One request of an Azure trace.
#[derive(Clone, Debug, PartialEq)]
pub struct AzureRecord {
    /// Milliseconds since the first row.
    pub arrival_ms: f64,
    /// Prompt length in tokens.
    pub context_tokens: u32,
    /// Generated tokens.
    pub generated_tokens: u32,
}

/// Reads Azure records one line at a time; the header line is required.
#[derive(Debug)]
pub struct AzureReader<R> {
    lines: Lines<R>,
    origin_ms: Option<f64>,
}

impl<R: BufRead> AzureReader<R> {
    /// A reader over `input`.
    pub fn new(input: R) -> Self {
        Self {
            lines: Lines::new(input),
            origin_ms: None,
        }
    }
}

/// Milliseconds since midnight of 1970-01-01 for `YYYY-MM-DD HH:MM:SS[.frac]`.
fn parse_timestamp(text: &str) -> Option<f64> {
    let (date, time) = text.trim().split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.split(':');
    let (h, min) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let sec: f64 = t.next()?.parse().ok()?;
    if !(0..24).contains(&h) || !(0..60).contains(&min) || !(0.0..61.0).contains(&sec) {
        return None;
    }
    // Days from the civil date (proleptic Gregorian), Howard Hinnant's method.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + h * 3_600 + min * 60) as f64 + sec) * 1000.0)
}

impl<R: BufRead> Iterator for AzureReader<R> {
    type Item = Result<AzureRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (line, text) = match self.lines.next_line()? {
                Ok(l) => l,
                Err(e) => return Some(Err(e)),
            };
            let malformed = |reason: String| Some(Err(TraceError::Malformed { line, reason }));
            if line == 1 {
                if text.to_ascii_lowercase().starts_with("timestamp") {
                    continue;
                }
                return malformed(format!(
                    "expected the header TIMESTAMP,ContextTokens,GeneratedTokens, got {:?}",
                    text.chars().take(60).collect::<String>()
                ));
            }
            let fields: Vec<&str> = text.split(',').collect();
            if fields.len() != 3 {
                return malformed(format!(
                    "expected 3 comma-separated fields, got {}",
                    fields.len()
                ));
            }
            let Some(at) = parse_timestamp(fields[0]) else {
                return malformed(format!("bad timestamp {:?}", fields[0]));
            };
            let (Ok(context_tokens), Ok(generated_tokens)) = (
                fields[1].trim().parse::<u32>(),
                fields[2].trim().parse::<u32>(),
            ) else {
                return malformed("token counts must be non-negative integers".to_owned());
            };
            let origin = *self.origin_ms.get_or_insert(at);
            return Some(Ok(AzureRecord {
                arrival_ms: (at - origin).max(0.0),
                context_tokens,
                generated_tokens,
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rows_relative_to_the_first() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,396,109\n\
                    2023-11-17 00:00:00.0000000,1,1\n";
        let rows: Vec<AzureRecord> = AzureReader::new(text.as_bytes())
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].arrival_ms, 0.0);
        assert!((rows[1].arrival_ms - 4314.579).abs() < 1e-3);
        assert_eq!(rows[1].context_tokens, 396);
        assert_eq!(rows[1].generated_tokens, 109);
        // Across midnight.
        assert!(
            (rows[2].arrival_ms - (5.0 * 3600.0 + 44.0 * 60.0 + 13.31941) * 1000.0).abs() < 1.0
        );
    }

    #[test]
    fn malformed_rows_name_their_line() {
        for (text, wanted) in [
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12\n",
                "line 2: expected 3",
            ),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46,1,2\n",
                "line 2: bad timestamp",
            ),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-1,2\n",
                "line 2: token counts",
            ),
            ("1,2,3\n", "line 1: expected the header"),
        ] {
            let err = AzureReader::new(text.as_bytes())
                .find_map(Result::err)
                .expect("an error")
                .to_string();
            assert!(err.starts_with(wanted), "{err}");
        }
    }

    #[test]
    fn the_bundled_code_trace_reads_cleanly() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/traces/AzureLLMInferenceTrace_code_2023.csv"
        );
        let file = std::fs::File::open(path).unwrap();
        let rows: Vec<AzureRecord> = AzureReader::new(std::io::BufReader::new(file))
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows.len(), 8_819);
        assert!(rows
            .windows(2)
            .all(|w| w[0].arrival_ms <= w[1].arrival_ms + 1.0));
    }
}
