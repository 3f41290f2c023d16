//! Workloads: what the simulated clients send, as sessions of turns.
//!
//! Every trace becomes a stream of [`Session`]s in first-arrival order. A
//! single-turn trace (Mooncake, Azure) yields one-turn sessions with fixed
//! arrival times (open loop); a multi-turn workload yields sessions whose
//! turn `k + 1` arrives a think time after turn `k` finishes (closed loop
//! within a session), which is how chat users and agents behave.
//!
//! Prompts are kept compact ([`PromptSpec`]) and expanded into token ids only
//! when a request is dispatched, so memory stays bounded by what is in
//! flight, not by the trace.
//!
//! ShareGPT conversations become sessions in `sharegpt` (tokenized with
//! the real tokenizer and chat template); agent sessions — tool outputs,
//! tool gaps, sub-agents fanned out from the parent's context — are
//! generated in `agentic`, the one generator both the simulator and the
//! load generator read.

pub mod agentic;
mod sharegpt;
pub mod tenants;

pub use agentic::{agentic, AgentVocabulary, AgenticConfig};
pub use sharegpt::{read_conversations, read_sharegpt, ShareGptOptions};
pub use tenants::SessionFlow;

use crate::trace::{synthetic_tokens, AzureReader, MooncakeReader, TraceError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::BufRead;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Vocabulary size synthetic tokens are drawn from.
const VOCAB: u64 = 151_643;

/// How a prompt's token ids are made when the request is dispatched.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptSpec {
    /// Mooncake hash ids, 512 synthetic tokens each, truncated to `tokens`.
    Mooncake {
        /// The prefix-chained hash ids.
        hash_ids: Box<[u64]>,
        /// Prompt length.
        tokens: u32,
    },
    /// Random tokens: no prefix shared with anything.
    Random {
        /// Seed of this prompt's tokens.
        seed: u64,
        /// Prompt length.
        tokens: u32,
    },
    /// Literal token ids.
    Tokens(Arc<[u32]>),
    /// The concatenation of shared pieces: the turns of an agent session
    /// (and the sessions of one agent kind) hold their common prefix once.
    Pieces {
        /// The pieces, in order.
        pieces: Arc<[Arc<[u32]>]>,
        /// Their total length.
        tokens: u32,
    },
}

impl PromptSpec {
    /// Prompt length in tokens.
    pub fn len(&self) -> u32 {
        match self {
            PromptSpec::Mooncake { tokens, .. }
            | PromptSpec::Random { tokens, .. }
            | PromptSpec::Pieces { tokens, .. } => *tokens,
            PromptSpec::Tokens(t) => t.len() as u32,
        }
    }

    /// Whether the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token ids.
    pub fn tokens(&self) -> Vec<u32> {
        match self {
            PromptSpec::Mooncake { hash_ids, tokens } => {
                let mut out = Vec::new();
                synthetic_tokens(hash_ids, *tokens as usize, &mut out);
                out
            }
            PromptSpec::Random { seed, tokens } => (0..u64::from(*tokens))
                .map(|i| (xxh3_64_with_seed(&i.to_le_bytes(), *seed) % VOCAB) as u32)
                .collect(),
            PromptSpec::Tokens(t) => t.to_vec(),
            PromptSpec::Pieces { pieces, tokens } => {
                let mut out = Vec::with_capacity(*tokens as usize);
                for piece in pieces.iter() {
                    out.extend_from_slice(piece);
                }
                out
            }
        }
    }
}

/// One turn of a session.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// The whole prompt of this turn (for chats: the conversation so far).
    pub prompt: PromptSpec,
    /// Tokens the answer has.
    pub output_tokens: u32,
    /// The pause between this turn's answer and the session's next turn,
    /// ms (`None`: the session's [`Session::think_time_ms`]). After a turn
    /// that spawns sessions, the pause starts when the last of them ends.
    pub pause_ms: Option<f64>,
    /// Sessions (sub-agents) this turn starts when its answer ends, each
    /// its own [`Session::arrival_ms`] later; the session's next turn
    /// waits until every one of them has ended.
    pub spawn: Vec<Session>,
}

impl Turn {
    /// A turn followed by the session's think time, spawning nothing.
    pub fn new(prompt: PromptSpec, output_tokens: u32) -> Self {
        Self {
            prompt,
            output_tokens,
            pause_ms: None,
            spawn: Vec::new(),
        }
    }
}

/// A client's sequence of turns.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    /// Unique within the workload, spawned sessions included.
    pub id: u64,
    /// When the first turn arrives: ms from the start, or for a spawned
    /// session ms after the answer of the turn that spawns it.
    pub arrival_ms: f64,
    /// Pause between one turn's end and the next turn's arrival.
    pub think_time_ms: f64,
    /// The turns, in order (at least one).
    pub turns: Vec<Turn>,
    /// Who sends it and how urgent it is (flow control).
    pub flow: SessionFlow,
}

impl Session {
    /// Every turn of this session and of the sessions it spawns, depth
    /// first: a turn, then the sessions it spawns, then the next turn (the
    /// order they arrive in when spawned sessions run one at a time).
    pub fn all_turns(&self) -> Vec<&Turn> {
        let mut out = Vec::with_capacity(self.turns.len());
        self.collect_turns(&mut out);
        out
    }

    fn collect_turns<'a>(&'a self, out: &mut Vec<&'a Turn>) {
        for turn in &self.turns {
            out.push(turn);
            for child in &turn.spawn {
                child.collect_turns(out);
            }
        }
    }

    /// Calls `f` on every turn of this session and of the sessions it
    /// spawns.
    pub fn for_each_turn_mut(&mut self, f: &mut impl FnMut(&mut Turn)) {
        for turn in &mut self.turns {
            f(turn);
            for child in &mut turn.spawn {
                child.for_each_turn_mut(f);
            }
        }
    }

    /// Numbers this session `*next` and the sessions it spawns after it,
    /// depth first, advancing `next` past them all (ids stay unique when
    /// streams are merged).
    pub fn renumber(&mut self, next: &mut u64) {
        self.id = *next;
        *next += 1;
        for turn in &mut self.turns {
            for child in &mut turn.spawn {
                child.renumber(next);
            }
        }
    }
}

/// Time and length controls applied to any workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadLimits {
    /// Arrival-rate multiplier: 2 halves every arrival time, 0.5 doubles it.
    pub rate_scale: f64,
    /// Stop after this many sessions.
    pub max_sessions: Option<usize>,
    /// Stop at the first session arriving after this (ms, after scaling).
    pub duration_ms: Option<f64>,
    /// Skip sessions with a longer prompt in any turn (an engine would
    /// refuse them); a skipped session leaves its arrival gap.
    pub max_prompt_tokens: Option<u32>,
    /// Cap on each turn's output tokens (at least 1).
    pub max_output_tokens: Option<u32>,
}

impl Default for WorkloadLimits {
    fn default() -> Self {
        Self {
            rate_scale: 1.0,
            max_sessions: None,
            duration_ms: None,
            max_prompt_tokens: None,
            max_output_tokens: None,
        }
    }
}

/// A stream of sessions in first-arrival order.
pub type SessionStream = Box<dyn Iterator<Item = Result<Session, TraceError>> + Send>;

/// Applies [`WorkloadLimits`] to a stream.
pub fn limited(stream: SessionStream, limits: WorkloadLimits) -> SessionStream {
    let scale = if limits.rate_scale > 0.0 {
        limits.rate_scale
    } else {
        1.0
    };
    let stream = stream
        .filter(move |s| match (s, limits.max_prompt_tokens) {
            (Ok(s), Some(max)) => s.all_turns().iter().all(|t| t.prompt.len() <= max),
            _ => true,
        })
        .map(move |s| {
            s.map(|mut s| {
                // Spawned sessions arrive relative to their parent's turn:
                // only the session's own arrival scales.
                s.arrival_ms /= scale;
                if let Some(cap) = limits.max_output_tokens {
                    s.for_each_turn_mut(&mut |t| {
                        t.output_tokens = t.output_tokens.min(cap.max(1));
                    });
                }
                s
            })
        })
        .take_while(move |s| match (s, limits.duration_ms) {
            (Ok(s), Some(d)) => s.arrival_ms <= d,
            _ => true,
        });
    match limits.max_sessions {
        Some(n) => Box::new(stream.take(n)),
        None => Box::new(stream),
    }
}

/// How far [`mooncake`] spreads records sharing a timestamp: the
/// conversation trace logs in ~3 s steps.
pub const MOONCAKE_MAX_SPREAD_MS: f64 = 3_000.0;

/// Mooncake records as one-turn sessions. Records sharing a timestamp (the
/// conversation trace logs in ~3 s steps) are spread evenly over the gap to
/// the next distinct timestamp, at most `max_spread_ms`.
pub fn mooncake<R: BufRead + Send + 'static>(input: R, max_spread_ms: f64) -> SessionStream {
    let records = MooncakeReader::new(input).map(|r| {
        r.map(|r| {
            (
                r.timestamp,
                Turn::new(
                    PromptSpec::Mooncake {
                        hash_ids: r.hash_ids.into_boxed_slice(),
                        tokens: r.input_length,
                    },
                    r.output_length.max(1),
                ),
            )
        })
    });
    Box::new(Spread::new(records, max_spread_ms))
}

/// Which part of a Mooncake trace to replay, and how fast.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceSlice {
    /// Requests to take, from the start.
    pub requests: usize,
    /// Records with longer prompts are skipped (an engine would refuse them).
    pub max_prompt_tokens: u32,
    /// Cap on each request's output tokens (`None`: the trace's).
    pub max_output_tokens: Option<u32>,
    /// Arrival-rate multiplier, as [`WorkloadLimits::rate_scale`].
    pub rate_scale: f64,
}

/// The first `slice.requests` servable records of a Mooncake trace as
/// one-turn sessions: arrivals spread within equal timestamps by
/// [`mooncake`] (over all records, so a skipped record leaves its gap),
/// then divided by the rate scale as [`limited`] does. One function for
/// every side of a comparison (the simulator, the load generator), so they
/// replay identical requests at identical times.
pub fn mooncake_slice<R: BufRead + Send + 'static>(
    input: R,
    slice: &TraceSlice,
) -> Result<Vec<Session>, TraceError> {
    let limits = WorkloadLimits {
        rate_scale: slice.rate_scale,
        max_sessions: Some(slice.requests),
        duration_ms: None,
        max_prompt_tokens: Some(slice.max_prompt_tokens),
        max_output_tokens: slice.max_output_tokens,
    };
    limited(mooncake(input, MOONCAKE_MAX_SPREAD_MS), limits).collect()
}

/// Azure rows as one-turn sessions with random prompts (seeded by `seed`).
pub fn azure<R: BufRead + Send + 'static>(input: R, seed: u64) -> SessionStream {
    let mut n = 0u64;
    Box::new(AzureReader::new(input).map(move |r| {
        r.map(|r| {
            n += 1;
            Session {
                id: n - 1,
                arrival_ms: r.arrival_ms,
                think_time_ms: 0.0,
                turns: vec![Turn::new(
                    PromptSpec::Random {
                        seed: seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                        tokens: r.context_tokens.max(1),
                    },
                    r.generated_tokens.max(1),
                )],
                flow: SessionFlow::default(),
            }
        })
    }))
}

/// Spreads groups of equal timestamps, with one group of lookahead.
struct Spread<I> {
    inner: I,
    max_spread_ms: f64,
    pending: Option<(f64, Turn)>,
    out: VecDeque<Session>,
    next_id: u64,
    failed: Option<TraceError>,
}

impl<I: Iterator<Item = Result<(f64, Turn), TraceError>>> Spread<I> {
    fn new(inner: I, max_spread_ms: f64) -> Self {
        Self {
            inner,
            max_spread_ms,
            pending: None,
            out: VecDeque::new(),
            next_id: 0,
            failed: None,
        }
    }

    fn fill(&mut self) {
        let first = match self.pending.take() {
            Some(p) => p,
            None => match self.inner.next() {
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    self.failed = Some(e);
                    return;
                }
                None => return,
            },
        };
        let t = first.0;
        let mut group = vec![first.1];
        let gap = loop {
            match self.inner.next() {
                Some(Ok((ts, turn))) if ts == t => group.push(turn),
                Some(Ok(next)) => {
                    let gap = next.0 - t;
                    self.pending = Some(next);
                    break gap;
                }
                Some(Err(e)) => {
                    self.failed = Some(e);
                    break 0.0;
                }
                None => break self.max_spread_ms,
            }
        };
        let span = gap.clamp(0.0, self.max_spread_ms);
        let n = group.len() as f64;
        for (i, turn) in group.into_iter().enumerate() {
            self.out.push_back(Session {
                id: self.next_id,
                arrival_ms: t + span * i as f64 / n,
                think_time_ms: 0.0,
                turns: vec![turn],
                flow: SessionFlow::default(),
            });
            self.next_id += 1;
        }
    }
}

impl<I: Iterator<Item = Result<(f64, Turn), TraceError>>> Iterator for Spread<I> {
    type Item = Result<Session, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.out.is_empty() && self.failed.is_none() {
            self.fill();
        }
        match self.out.pop_front() {
            Some(s) => Some(Ok(s)),
            None => self.failed.take().map(Err),
        }
    }
}

/// Parameters of the synthetic multi-turn generator.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SyntheticConfig {
    /// Sessions to generate.
    pub sessions: usize,
    /// Mean session arrivals per second (Poisson).
    pub sessions_per_sec: f64,
    /// Fewest turns per session.
    pub min_turns: u32,
    /// Most turns per session.
    pub max_turns: u32,
    /// Distinct system prompts; sessions share them round-robin.
    pub system_prompts: u32,
    /// Tokens of each system prompt.
    pub system_tokens: u32,
    /// Tokens of each user message.
    pub user_tokens: u32,
    /// Tokens of each answer.
    pub output_tokens: u32,
    /// Think time between turns, ms.
    pub think_time_ms: f64,
    /// Seed.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            sessions: 1000,
            sessions_per_sec: 4.0,
            min_turns: 2,
            max_turns: 8,
            system_prompts: 8,
            system_tokens: 1024,
            user_tokens: 128,
            output_tokens: 256,
            think_time_ms: 5000.0,
            seed: 7,
        }
    }
}

/// Synthetic chat sessions: each starts with one of a few shared system
/// prompts, and turn `k`'s prompt is the system prompt, every earlier user
/// message and answer, and the new user message.
pub fn synthetic(config: SyntheticConfig) -> SessionStream {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut clock = 0.0;
    let tokens = move |seed: u64, n: u32| -> Vec<u32> {
        (0..u64::from(n))
            .map(|i| (xxh3_64_with_seed(&i.to_le_bytes(), seed) % VOCAB) as u32)
            .collect()
    };
    Box::new((0..config.sessions as u64).map(move |id| {
        let rate = config.sessions_per_sec.max(1e-9);
        clock += -(1.0 - rng.gen::<f64>()).ln() / rate * 1000.0;
        let turns_n =
            rng.gen_range(config.min_turns.max(1)..=config.max_turns.max(config.min_turns.max(1)));
        let system = u64::from(id as u32 % config.system_prompts.max(1));
        let mut context = tokens(0x5157_0000 ^ system, config.system_tokens);
        let mut turns = Vec::with_capacity(turns_n as usize);
        for k in 0..u64::from(turns_n) {
            context.extend(tokens(id << 20 ^ k << 1, config.user_tokens));
            turns.push(Turn::new(
                PromptSpec::Tokens(context.clone().into()),
                config.output_tokens.max(1),
            ));
            context.extend(tokens(id << 20 ^ k << 1 ^ 1, config.output_tokens));
        }
        Ok(Session {
            id,
            arrival_ms: clock,
            think_time_ms: config.think_time_ms,
            turns,
            flow: SessionFlow::default(),
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(stream: SessionStream) -> Vec<Session> {
        stream.map(Result::unwrap).collect()
    }

    #[test]
    fn equal_timestamps_are_spread_over_the_gap_to_the_next() {
        let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}\n\
                    {\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n\
                    {\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [2]}\n\
                    {\"timestamp\": 3000, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [3]}\n";
        let s = collect(mooncake(text.as_bytes(), 3000.0));
        let arrivals: Vec<f64> = s.iter().map(|s| s.arrival_ms).collect();
        assert_eq!(arrivals, vec![0.0, 1000.0, 2000.0, 3000.0]);
        assert_eq!(s.iter().map(|s| s.id).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        // A zero output length still asks for one token.
        assert_eq!(s[3].turns[0].output_tokens, 1);
    }

    #[test]
    fn a_malformed_record_surfaces_after_the_good_ones_before_it() {
        let text =
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}\n\
                    garbage\n";
        let items: Vec<_> = mooncake(text.as_bytes(), 3000.0).collect();
        assert_eq!(items.len(), 2);
        assert!(items[0].is_ok());
        assert!(items[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .starts_with("line 2"));
    }

    #[test]
    fn limits_scale_time_and_stop_early() {
        let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}\n\
                    {\"timestamp\": 4000, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n\
                    {\"timestamp\": 8000, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [2]}\n";
        let limits = WorkloadLimits {
            rate_scale: 2.0,
            duration_ms: Some(2500.0),
            ..Default::default()
        };
        let s = collect(limited(mooncake(text.as_bytes(), 3000.0), limits));
        assert_eq!(
            s.iter().map(|s| s.arrival_ms).collect::<Vec<_>>(),
            vec![0.0, 2000.0]
        );
        let limits = WorkloadLimits {
            max_sessions: Some(1),
            ..Default::default()
        };
        assert_eq!(
            collect(limited(mooncake(text.as_bytes(), 3000.0), limits)).len(),
            1
        );
    }

    #[test]
    fn a_slice_skips_long_prompts_keeps_their_gaps_scales_and_caps() {
        let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 500, \"hash_ids\": [0]}\n\
                    {\"timestamp\": 0, \"input_length\": 900, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
                    {\"timestamp\": 0, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [3]}\n\
                    {\"timestamp\": 3000, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [4]}\n\
                    {\"timestamp\": 6000, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [5]}\n";
        let slice = TraceSlice {
            requests: 3,
            max_prompt_tokens: 512,
            max_output_tokens: Some(64),
            rate_scale: 2.0,
        };
        let s = mooncake_slice(text.as_bytes(), &slice).unwrap();
        // The 900-token record is skipped; the step's three records were
        // spread over 3 s before it was (0, 1000, 2000), then halved.
        assert_eq!(
            s.iter().map(|s| s.arrival_ms).collect::<Vec<_>>(),
            vec![0.0, 1000.0, 1500.0]
        );
        assert_eq!(s.iter().map(|s| s.id).collect::<Vec<_>>(), vec![0, 2, 3]);
        assert_eq!(
            s.iter()
                .map(|s| s.turns[0].output_tokens)
                .collect::<Vec<_>>(),
            vec![64, 1, 5]
        );
        // Without a cap the trace's lengths stand.
        let uncapped = TraceSlice {
            max_output_tokens: None,
            ..slice
        };
        assert_eq!(
            mooncake_slice(text.as_bytes(), &uncapped).unwrap()[0].turns[0].output_tokens,
            500
        );
        // A malformed record is an error, not a shorter slice.
        let bad = format!("{text}garbage\n");
        let all = TraceSlice {
            requests: 10,
            ..slice
        };
        assert!(mooncake_slice(std::io::Cursor::new(bad.into_bytes()), &all).is_err());
    }

    #[test]
    fn prompts_expand_deterministically() {
        let a = PromptSpec::Random {
            seed: 1,
            tokens: 50,
        };
        assert_eq!(a.tokens(), a.tokens());
        assert_eq!(a.tokens().len(), 50);
        assert_ne!(
            a.tokens(),
            PromptSpec::Random {
                seed: 2,
                tokens: 50
            }
            .tokens()
        );
        let m = PromptSpec::Mooncake {
            hash_ids: vec![3, 4].into(),
            tokens: 700,
        };
        assert_eq!(m.len(), 700);
        assert_eq!(m.tokens().len(), 700);
    }

    #[test]
    fn synthetic_turns_extend_the_conversation_so_far() {
        let config = SyntheticConfig {
            sessions: 20,
            ..Default::default()
        };
        let sessions = collect(synthetic(config));
        assert_eq!(sessions.len(), 20);
        assert!(sessions
            .windows(2)
            .all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        for s in &sessions {
            assert!((2..=8).contains(&s.turns.len()));
            for pair in s.turns.windows(2) {
                let (a, b) = (pair[0].prompt.tokens(), pair[1].prompt.tokens());
                assert_eq!(b.len(), a.len() + 256 + 128);
                assert_eq!(b[..a.len()], a[..]);
            }
        }
        // Sessions on the same system prompt share its tokens.
        let (a, b) = (
            sessions[0].turns[0].prompt.tokens(),
            sessions[8].turns[0].prompt.tokens(),
        );
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..], b[1024..]);
        assert_eq!(collect(synthetic(config)), sessions);
    }

    #[test]
    fn azure_rows_become_random_prompts() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.0,100,5\n2023-11-16 18:15:47.0,100,0\n";
        let s = collect(azure(text.as_bytes(), 1));
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].arrival_ms, 1000.0);
        assert_ne!(s[0].turns[0].prompt.tokens(), s[1].turns[0].prompt.tokens());
        assert_eq!(s[1].turns[0].output_tokens, 1);
    }
}
