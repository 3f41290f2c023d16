//! ShareGPT multi-turn conversations: one JSON object per line,
//! `{"id", "conversations": [{"from": "human"|"gpt", "value": text}]}`,
//! optionally gzip-compressed.
//!
//! Each conversation becomes a session: turn `k`'s prompt is the chat
//! template applied to every message before the `k`-th user message and that
//! message (with the assistant's opening), tokenized with the bundled real
//! tokenizer; its output length is the tokenized length of the assistant's
//! actual answer.

use super::{PromptSpec, Session, Turn};
use crate::trace::TraceError;
use serde::Deserialize;
use std::io::BufRead;
use switchyard_tokenizer::{ChatMessage, Tokenizer};

#[derive(Deserialize)]
struct Record {
    #[serde(default)]
    conversations: Vec<Message>,
}

#[derive(Deserialize)]
struct Message {
    from: String,
    value: String,
}

/// How conversations become sessions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareGptOptions {
    /// Mean session arrivals per second (Poisson; ShareGPT has no times).
    pub sessions_per_sec: f64,
    /// Pause between an answer and the next user turn, ms.
    pub think_time_ms: f64,
    /// Stop after this many sessions.
    pub max_sessions: Option<usize>,
    /// Longest prompt kept; later turns of a session past it are dropped.
    pub max_prompt_tokens: usize,
    /// Arrival seed.
    pub seed: u64,
}

impl Default for ShareGptOptions {
    fn default() -> Self {
        Self {
            sessions_per_sec: 2.0,
            think_time_ms: 5_000.0,
            max_sessions: None,
            max_prompt_tokens: 32_000,
            seed: 0,
        }
    }
}

/// The chat role of a ShareGPT speaker; `None` for speakers a chat has no
/// role for (they are skipped).
fn chat_role(from: &str) -> Option<&'static str> {
    match from {
        "human" | "user" => Some("user"),
        "gpt" | "assistant" | "chatgpt" | "bard" => Some("assistant"),
        "system" => Some("system"),
        _ => None,
    }
}

/// Reads conversations as chat messages, untokenized (roles as
/// [`read_sharegpt`] maps them); a malformed line is an error naming it.
pub fn read_conversations<R: BufRead>(input: R) -> Result<Vec<Vec<ChatMessage>>, TraceError> {
    let mut conversations = Vec::new();
    for (n, line) in input.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(&line).map_err(|e| TraceError::Malformed {
            line: n + 1,
            reason: format!("not a ShareGPT record: {e}"),
        })?;
        conversations.push(
            record
                .conversations
                .into_iter()
                .filter_map(|m| {
                    Some(ChatMessage {
                        role: chat_role(&m.from)?.to_owned(),
                        content: m.value,
                        tool_calls: Vec::new(),
                        reasoning: None,
                    })
                })
                .collect(),
        );
    }
    Ok(conversations)
}

/// Reads and tokenizes conversations into sessions (materialized: the
/// tokenization is the expensive part, done once and shared). Conversations
/// with no user turn are skipped; a malformed line is an error naming it.
pub fn read_sharegpt<R: BufRead>(
    input: R,
    tokenizer: &Tokenizer,
    options: ShareGptOptions,
) -> Result<Vec<Session>, TraceError> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed);
    let mut clock = 0.0;
    let mut sessions = Vec::new();
    for (n, line) in input.lines().enumerate() {
        if options
            .max_sessions
            .is_some_and(|max| sessions.len() >= max)
        {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let malformed = |reason: String| TraceError::Malformed {
            line: n + 1,
            reason,
        };
        let record: Record = serde_json::from_str(&line)
            .map_err(|e| malformed(format!("not a ShareGPT record: {e}")))?;
        let mut messages: Vec<ChatMessage> = Vec::new();
        let mut turns = Vec::new();
        let convo = &record.conversations;
        for (i, m) in convo.iter().enumerate() {
            let Some(role) = chat_role(&m.from) else {
                continue;
            };
            messages.push(ChatMessage {
                role: role.to_owned(),
                content: m.value.clone(),
                tool_calls: Vec::new(),
                reasoning: None,
            });
            if role != "user" {
                continue;
            }
            let text = tokenizer
                .apply_chat_template(&messages, true)
                .map_err(|e| malformed(e.to_string()))?;
            let prompt = tokenizer
                .encode(&text)
                .map_err(|e| malformed(e.to_string()))?;
            if prompt.len() > options.max_prompt_tokens {
                break;
            }
            let answer = convo
                .get(i + 1)
                .filter(|next| next.from != "human" && next.from != "user")
                .map(|next| tokenizer.encode(&next.value).map(|t| t.len()))
                .transpose()
                .map_err(|e| malformed(e.to_string()))?
                .unwrap_or(256);
            turns.push(Turn::new(
                PromptSpec::Tokens(prompt.into()),
                answer.clamp(1, 4096) as u32,
            ));
        }
        if turns.is_empty() {
            continue;
        }
        clock += -(1.0 - rng.gen::<f64>()).ln() / options.sessions_per_sec.max(1e-9) * 1000.0;
        sessions.push(Session {
            id: sessions.len() as u64,
            arrival_ms: clock,
            think_time_ms: options.think_time_ms,
            turns,
            flow: crate::workload::SessionFlow::default(),
        });
    }
    Ok(sessions)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        Tokenizer::bundled().expect("the bundled tokenizer loads")
    }

    #[test]
    fn each_user_turn_prompts_with_the_conversation_so_far() {
        let text = r#"{"id": "a", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi! How can I help?"}, {"from": "human", "value": "Tell me a joke"}, {"from": "gpt", "value": "Why did the chicken cross the road?"}]}"#;
        let t = tokenizer();
        let sessions = read_sharegpt(text.as_bytes(), &t, ShareGptOptions::default()).unwrap();
        assert_eq!(sessions.len(), 1);
        let turns = &sessions[0].turns;
        assert_eq!(turns.len(), 2);
        let (first, second) = (turns[0].prompt.tokens(), turns[1].prompt.tokens());
        assert!(second.len() > first.len());
        // The answer's length in tokens is the first turn's output.
        assert_eq!(
            turns[0].output_tokens as usize,
            t.encode("Hi! How can I help?").unwrap().len()
        );
        // The first user message's tokens open the second prompt too.
        let hello = t.encode("Hello there").unwrap();
        assert!(second.windows(hello.len()).any(|w| w == hello.as_slice()));
    }

    #[test]
    fn conversations_read_as_chat_messages_with_their_roles() {
        let text = "{\"conversations\": [{\"from\": \"system\", \"value\": \"s\"}, {\"from\": \"human\", \"value\": \"q\"}, {\"from\": \"narrator\", \"value\": \"n\"}, {\"from\": \"gpt\", \"value\": \"a\"}]}\n\n{oops\n";
        let err = read_conversations(text.as_bytes()).unwrap_err();
        assert!(err.to_string().starts_with("line 3:"), "{err}");
        let first_line = text.lines().next().unwrap();
        let conversations = read_conversations(first_line.as_bytes()).unwrap();
        let roles: Vec<(&str, &str)> = conversations[0]
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(roles, [("system", "s"), ("user", "q"), ("assistant", "a")]);
    }

    #[test]
    fn a_malformed_line_names_its_number() {
        let text = "{\"id\": \"a\", \"conversations\": []}\n{oops\n";
        let err =
            read_sharegpt(text.as_bytes(), &tokenizer(), ShareGptOptions::default()).unwrap_err();
        assert!(
            err.to_string().starts_with("line 2: not a ShareGPT record"),
            "{err}"
        );
    }

    #[test]
    fn the_bundled_trace_reads_into_multi_turn_sessions() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/traces/sharegpt_multiturn_3000.jsonl.gz"
        );
        let file = std::fs::File::open(path).unwrap();
        let input = std::io::BufReader::new(flate2::read::GzDecoder::new(file));
        let options = ShareGptOptions {
            max_sessions: Some(20),
            ..Default::default()
        };
        let sessions = read_sharegpt(input, &tokenizer(), options).unwrap();
        assert_eq!(sessions.len(), 20);
        assert!(sessions.iter().all(|s| s.turns.len() >= 2));
    }
}
