//! Agent sessions: a seeded generator of the traffic tool-using agents
//! send.
//!
//! # The shape
//!
//! - Sessions arrive over time, a Poisson process of
//!   [`AgenticConfig::sessions_per_sec`].
//! - Each session belongs to one of a few agent kinds ([`AgentKind`]):
//!   the kind's system prompt and tool definitions, one system message of
//!   [`AgentKind::prefix_tokens`], open every session of the kind, which
//!   all share that prefix.
//! - A session is a chain of LLM calls. The first call's prompt is the
//!   system message and the session's task (a user message). Each call is
//!   answered by a short assistant turn (a tool call); the tool then runs
//!   for a tool gap and returns an output (a tool message, heavy-tailed in
//!   size), and the next call's prompt is the previous prompt, its answer
//!   and that output.
//! - A call (not a session's last) fans out with
//!   [`FanOut::probability`]: K sub-agents start at the same instant, when
//!   the call's answer ends, each from the parent's current context (the
//!   call's prompt and answer) and a sub-task of its own, and run short
//!   sessions of their own (they do not fan out again). The parent's next
//!   call waits until all of them have ended; its tool output stands for
//!   their results.
//! - No context (a prompt and its answer) passes
//!   [`AgenticConfig::context_cap_tokens`]: a session, or a sub-agent,
//!   ends before a call that would. (Real agents compact their context
//!   there; this generator does not model compaction.)
//!
//! # One generator, two renderings
//!
//! [`agent_sessions`] plans sessions ([`AgentSession`]: every message's
//! role, length and content seed, and where each call's prompt ends). An
//! [`AgentVocabulary`], made from a tokenizer, renders a plan as token ids
//! for the simulator ([`AgentVocabulary::session`], a [`Session`]) and as
//! chat messages for the load generator ([`AgentVocabulary::messages`]).
//! Contents are drawn from the tokenizer's word tokens
//! ([`switchyard_tokenizer::WordVocabulary`]), whose text re-tokenizes to
//! the same ids; the text the chat template puts between contents (the
//! glue: with Qwen3's, `<|im_end|>\n<|im_start|>user\n<tool_response>\n`
//! and the like) is taken from the template itself, rendered once around
//! markers. [`AgentVocabulary::from_tokenizer`] checks on a sample session
//! that every call's ids are exactly the tokenized rendering of its
//! messages — what the router and the engines compute for the chat
//! request — and refuses a template for which they are not.
//!
//! # The defaults, and where they come from
//!
//! No agent trace is bundled, so every default is a choice; three
//! published figures guide them (`docs/simulator.md`, "Agent workloads",
//! has the same table with the generated workload's own figures):
//!
//! - Azure's GitHub Copilot coding-agent dataset (2026): 301K sessions,
//!   9.3M LLM calls and 8.7M tool calls, with tool durations and cached
//!   tokens per call. Its files cannot be fetched here; its totals give
//!   about 31 LLM calls per session (9.3M / 301K) and a tool call after
//!   almost every LLM call (8.7M / 9.3M = 0.94), as here, where every
//!   call but a session's last is followed by a tool. The calls per
//!   session (log-normal, median 15, sigma 0.9, 1–300: mean 22.5) are
//!   chosen so that with the sub-agents' calls a session makes about 30
//!   (30.1 over the default 1,000 sessions).
//!   The tool gaps (log-normal, median 1 s, sigma 1.2, 0.05–120 s) are a
//!   choice: the dataset's tool durations were not available.
//! - Mooncake's tool-agent trace: 23,608 requests, mean input 8,596 and
//!   mean output 182 tokens. The assistant turns (log-normal, median 150,
//!   sigma 0.6, 16–2,000 tokens: mean 180) follow its output. Its mean
//!   input is not matched: with about 30 calls a session, each adding an
//!   answer and a tool output, this generator's mean prompt is some 32K
//!   tokens (`docs/simulator.md` has the distribution).
//! - GAIE issue #2928 reports 1.14 s TTFT at concurrency 150 with 220 KB
//!   prompts (some 55K tokens, at 4 bytes a token) through a gateway:
//!   prompts of tens of thousands of tokens, as here.
//!
//! Chosen outright (no published figure): 4 agent kinds with system
//! prefixes of 4,000, 6,000, 8,000 and 10,000 tokens, equally likely; the
//! session's task (log-normal, median 300, sigma 0.8, 20–4,000 tokens);
//! the tool outputs (log-normal, median 300, sigma 1.5 — p99/p50 about 33
//! — 1–32,000 tokens: most are short, a few are tens of thousands); a fan
//! out at 2% of calls into 2–4 sub-agents of median 5 calls (sigma 0.6,
//! 1–30) with tasks of median 200 tokens; the context cap of 200,000
//! tokens (the figure); the arrival rate
//! ([`DEFAULT_SESSIONS_PER_SEC`]).

use super::{PromptSpec, Session, SessionFlow, SessionStream, Turn};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use switchyard_tokenizer::{ChatMessage, Tokenizer, TokenizerError, WordVocabularyError};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Default arrival rate of agent sessions, chosen: on the default
/// `replay` fleet (8 workers) every policy keeps up at 4 a second, where
/// the policies already part by how much of each session's context they
/// find cached; at 8 a second over 2,000 sessions the fleet falls behind
/// (`docs/simulator.md`, "Agent workloads", has both runs).
pub const DEFAULT_SESSIONS_PER_SEC: f64 = 4.0;

/// Word tokens contents are drawn from (the vocabulary's first, by id).
const WORDS: usize = 4096;
/// Fewest word tokens a tokenizer must have for contents to look random.
const MIN_WORDS: usize = 256;
/// Most tokens a chat template may put between two messages.
pub const MAX_GLUE_TOKENS: usize = 32;

/// A log-normal distribution clamped to `[min, max]`: `median ·
/// e^(sigma · Z)` with `Z` standard normal. Before clamping, `median` is
/// its median and `p99 / p50 = e^(2.326 · sigma)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogNormal {
    /// The median before clamping.
    pub median: f64,
    /// The standard deviation of the logarithm (0: always the median).
    pub sigma: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl LogNormal {
    /// Always `value`.
    pub fn fixed(value: f64) -> Self {
        Self {
            median: value,
            sigma: 0.0,
            min: value,
            max: value,
        }
    }

    /// One draw.
    pub fn sample(&self, rng: &mut impl Rng) -> f64 {
        // Box–Muller, with the first uniform in (0, 1] so its log is finite.
        let u1 = 1.0 - rng.gen::<f64>();
        let u2 = rng.gen::<f64>();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (self.median * (self.sigma * z).exp()).clamp(self.min, self.max)
    }

    /// One draw as a whole number (`min` is at least 1 for a count: see
    /// [`AgenticConfig::validate`]).
    fn count(&self, rng: &mut impl Rng) -> u32 {
        self.sample(rng).round().clamp(1.0, f64::from(u32::MAX)) as u32
    }

    /// The mean before clamping, `median · e^(sigma² / 2)`.
    pub fn unclamped_mean(&self) -> f64 {
        self.median * (self.sigma * self.sigma / 2.0).exp()
    }

    fn validate(&self, field: &'static str, least: f64) -> Result<(), AgenticConfigError> {
        let invalid = |reason: String| Err(AgenticConfigError::Invalid { field, reason });
        let all = [self.median, self.sigma, self.min, self.max];
        if all.iter().any(|v| !v.is_finite()) {
            return invalid("every value must be finite".to_owned());
        }
        if self.median <= 0.0 || self.sigma < 0.0 {
            return invalid(format!(
                "needs median > 0 and sigma >= 0, got median {} and sigma {}",
                self.median, self.sigma
            ));
        }
        if self.min < least || self.min > self.max {
            return invalid(format!(
                "needs {least} <= min <= max, got min {} and max {}",
                self.min, self.max
            ));
        }
        Ok(())
    }
}

/// One kind of agent: its shared prefix and how common it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentKind {
    /// Tokens of the kind's system message (its system prompt and tool
    /// definitions), the prefix every session of the kind opens with.
    pub prefix_tokens: u32,
    /// Its share of sessions, relative to the other kinds' weights.
    #[serde(default = "unit_weight")]
    pub weight: f64,
}

fn unit_weight() -> f64 {
    1.0
}

/// When and how wide calls fan out into sub-agents.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FanOut {
    /// Chance that a call other than a session's last fans out (0: never).
    pub probability: f64,
    /// Fewest sub-agents of a fan-out.
    pub min_agents: u32,
    /// Most sub-agents of a fan-out.
    pub max_agents: u32,
    /// LLM calls of each sub-agent.
    pub calls: LogNormal,
    /// Tokens of each sub-agent's task, the user message after the
    /// parent's context.
    pub task_tokens: LogNormal,
}

impl Default for FanOut {
    fn default() -> Self {
        Self {
            probability: 0.02,
            min_agents: 2,
            max_agents: 4,
            calls: LogNormal {
                median: 5.0,
                sigma: 0.6,
                min: 1.0,
                max: 30.0,
            },
            task_tokens: LogNormal {
                median: 200.0,
                sigma: 0.6,
                min: 20.0,
                max: 2_000.0,
            },
        }
    }
}

/// Most sub-agents of one fan-out.
pub const MAX_AGENTS: u32 = 64;

/// Parameters of the agent workload; every field of a file may be left
/// out (the default stands), a distribution is given whole. Where each
/// default comes from: the module documentation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgenticConfig {
    /// Sessions to generate (sub-agents not counted).
    pub sessions: usize,
    /// Mean session arrivals per second (Poisson).
    pub sessions_per_sec: f64,
    /// Seed of every draw. Not read from a file: the tools' `--seed`
    /// gives it, so that one flag names one workload everywhere.
    #[serde(skip)]
    pub seed: u64,
    /// The agent kinds (at least one).
    pub kinds: Vec<AgentKind>,
    /// Tokens of a session's task, the first user message.
    pub task_tokens: LogNormal,
    /// LLM calls of a session (before the context cap ends it).
    pub calls: LogNormal,
    /// Tokens of each assistant turn (a call's answer: a tool call).
    pub assistant_tokens: LogNormal,
    /// Tokens of each tool output.
    pub tool_output_tokens: LogNormal,
    /// Seconds a tool runs between a call's answer and the next call.
    pub tool_gap_s: LogNormal,
    /// Sub-agents.
    pub fan_out: FanOut,
    /// Longest context: no call's prompt and answer together are longer.
    pub context_cap_tokens: u32,
}

impl Default for AgenticConfig {
    fn default() -> Self {
        Self {
            sessions: 1_000,
            sessions_per_sec: DEFAULT_SESSIONS_PER_SEC,
            seed: 0,
            kinds: [4_000, 6_000, 8_000, 10_000]
                .into_iter()
                .map(|prefix_tokens| AgentKind {
                    prefix_tokens,
                    weight: 1.0,
                })
                .collect(),
            task_tokens: LogNormal {
                median: 300.0,
                sigma: 0.8,
                min: 20.0,
                max: 4_000.0,
            },
            calls: LogNormal {
                median: 15.0,
                sigma: 0.9,
                min: 1.0,
                max: 300.0,
            },
            assistant_tokens: LogNormal {
                median: 150.0,
                sigma: 0.6,
                min: 16.0,
                max: 2_000.0,
            },
            tool_output_tokens: LogNormal {
                median: 300.0,
                sigma: 1.5,
                min: 1.0,
                max: 32_000.0,
            },
            tool_gap_s: LogNormal {
                median: 1.0,
                sigma: 1.2,
                min: 0.05,
                max: 120.0,
            },
            fan_out: FanOut::default(),
            context_cap_tokens: 200_000,
        }
    }
}

/// A parameter out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AgenticConfigError {
    /// `field` is invalid, because `reason`.
    #[error("{field}: {reason}")]
    Invalid {
        /// The parameter.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// Room the context cap leaves for the template's text around a
/// session's first three messages (its system message, task and the
/// generation prompt): [`MAX_GLUE_TOKENS`] each.
const FIRST_CALL_GLUE: u64 = 3 * MAX_GLUE_TOKENS as u64;

impl AgenticConfig {
    /// Checks ranges and relations: positive rates and sizes, kinds with
    /// weight, and a cap every session's first call fits under.
    pub fn validate(&self) -> Result<(), AgenticConfigError> {
        let invalid = |field, reason: String| Err(AgenticConfigError::Invalid { field, reason });
        if !(self.sessions_per_sec.is_finite() && self.sessions_per_sec > 0.0) {
            return invalid(
                "sessions_per_sec",
                format!("must be positive, got {}", self.sessions_per_sec),
            );
        }
        if self.kinds.is_empty() {
            return invalid("kinds", "needs at least one kind".to_owned());
        }
        for kind in &self.kinds {
            if kind.prefix_tokens == 0 {
                return invalid("kinds", "prefix_tokens must be at least 1".to_owned());
            }
            if !(kind.weight.is_finite() && kind.weight >= 0.0) {
                return invalid(
                    "kinds",
                    format!("a weight must be 0 or more, got {}", kind.weight),
                );
            }
        }
        if self.kinds.iter().map(|k| k.weight).sum::<f64>() <= 0.0 {
            return invalid("kinds", "some kind needs a positive weight".to_owned());
        }
        self.task_tokens.validate("task_tokens", 1.0)?;
        self.calls.validate("calls", 1.0)?;
        self.assistant_tokens.validate("assistant_tokens", 1.0)?;
        self.tool_output_tokens
            .validate("tool_output_tokens", 1.0)?;
        self.tool_gap_s.validate("tool_gap_s", 0.0)?;
        let fan = &self.fan_out;
        if !(0.0..=1.0).contains(&fan.probability) {
            return invalid(
                "fan_out.probability",
                format!("must be within 0..=1, got {}", fan.probability),
            );
        }
        if fan.min_agents == 0 || fan.min_agents > fan.max_agents || fan.max_agents > MAX_AGENTS {
            return invalid(
                "fan_out",
                format!(
                    "needs 1 <= min_agents <= max_agents <= {MAX_AGENTS}, got {} and {}",
                    fan.min_agents, fan.max_agents
                ),
            );
        }
        fan.calls.validate("fan_out.calls", 1.0)?;
        fan.task_tokens.validate("fan_out.task_tokens", 1.0)?;
        let longest_prefix = self.kinds.iter().map(|k| k.prefix_tokens).max();
        let first_call = u64::from(longest_prefix.unwrap_or(0))
            + self.task_tokens.max.ceil() as u64
            + self.assistant_tokens.max.ceil() as u64
            + FIRST_CALL_GLUE;
        if u64::from(self.context_cap_tokens) < first_call {
            return invalid(
                "context_cap_tokens",
                format!(
                    "{} cannot hold a session's first call: the longest prefix, the longest task \
                     and the longest answer, with the template's text, are up to {first_call}",
                    self.context_cap_tokens
                ),
            );
        }
        Ok(())
    }
}

/// Who speaks a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The kind's system prompt and tool definitions.
    System,
    /// A task: the session's, or a sub-agent's.
    User,
    /// A call's answer: a tool call.
    Assistant,
    /// A tool's output.
    Tool,
}

impl Role {
    /// The chat API's name of the role.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Row of [`Glue`] for the text before a conversation's first message.
const START: usize = 4;
/// Column of [`Glue`] for the text before the generation prompt's end.
const GENERATE: usize = 4;

/// The chat template's tokens between contents: `[after][before]`, where
/// `after` is the previous message's role (or [`START`]) and `before` the
/// next message's (or [`GENERATE`]: the end of a prompt, the assistant's
/// opening included). Only the transitions agent conversations use are
/// filled.
type Glue = [[Option<Arc<[u32]>>; 5]; 5];

/// The transitions of agent conversations: [`Glue`] holds these.
const TRANSITIONS: [(usize, usize); 8] = [
    (START, 0),    // system
    (0, 1),        // system → task
    (1, 2),        // task → answer
    (2, 3),        // answer → tool output
    (3, 2),        // tool output → answer
    (2, 1),        // answer → a sub-agent's task
    (1, GENERATE), // a prompt ending in a task
    (3, GENERATE), // a prompt ending in a tool output
];

/// One message of a planned conversation: its role, and `tokens` word
/// tokens drawn with `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Content {
    /// Who speaks it.
    pub role: Role,
    /// Its length in tokens.
    pub tokens: u32,
    /// The seed of its words.
    pub seed: u64,
}

/// One planned session, before it is rendered as tokens or text.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSession {
    /// Unique within the workload, sub-agents included.
    pub id: u64,
    /// ms from the start; for a sub-agent, ms after the answer of the call
    /// that spawns it (0: at once, with its siblings).
    pub arrival_ms: f64,
    /// Its agent kind, an index into [`AgenticConfig::kinds`].
    pub kind: usize,
    /// Every message, the system message first; a sub-agent's opens with
    /// its parent's messages up to the spawning call's answer.
    pub messages: Vec<Content>,
    /// Its LLM calls, in order (at least one).
    pub calls: Vec<AgentCall>,
}

impl AgentSession {
    /// Its calls and its sub-agents', all of them.
    pub fn total_calls(&self) -> usize {
        self.calls.len()
            + self
                .calls
                .iter()
                .flat_map(|c| &c.spawn)
                .map(AgentSession::total_calls)
                .sum::<usize>()
    }
}

/// One planned LLM call.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentCall {
    /// Its prompt is `messages[..prompt_messages]` and the generation
    /// prompt.
    pub prompt_messages: usize,
    /// The prompt's length in tokens, the template's text included.
    pub prompt_tokens: u32,
    /// Its answer's length: `messages[prompt_messages]` is the answer.
    pub output_tokens: u32,
    /// The tool gap after the answer, ms (0 after a fan-out: the
    /// sub-agents are the tool).
    pub pause_ms: f64,
    /// Sub-agents that start when the answer ends.
    pub spawn: Vec<AgentSession>,
}

/// Why a tokenizer cannot render the agent workload.
#[derive(Debug, thiserror::Error)]
pub enum AgentTextError {
    /// Rendering or encoding failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The vocabulary's word tokens do not round-trip.
    #[error(transparent)]
    Words(#[from] WordVocabularyError),
    /// Too few word tokens to draw contents from.
    #[error("the tokenizer has {0} word tokens; the agent workload needs at least {MIN_WORDS}")]
    TooFewWords(usize),
    /// The chat template does something the workload cannot follow.
    #[error("the chat template {0}")]
    Template(String),
}

/// What a tokenizer gives the agent workload: word tokens to write
/// contents with, and its chat template's text between messages. Shared
/// behind an `Arc`; rendering takes `&self`.
#[derive(Debug)]
pub struct AgentVocabulary {
    word_ids: Arc<[u32]>,
    word_texts: Arc<[Box<str>]>,
    glue: Glue,
}

/// A private-use marker that stands for message `i`'s content.
fn marker(i: usize) -> String {
    format!("\u{E000}{i}\u{E001}")
}

impl AgentVocabulary {
    /// Reads `tokenizer`'s word tokens and its chat template's text
    /// between messages, then checks a sample session: every call's ids
    /// must be the tokenized rendering of its messages.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, AgentTextError> {
        let words = tokenizer.word_vocabulary(WORDS)?;
        if words.len() < MIN_WORDS {
            return Err(AgentTextError::TooFewWords(words.len()));
        }
        let word_texts: Vec<Box<str>> = words
            .ids()
            .iter()
            .map(|&id| Box::from(words.text(id).expect("an id of the table")))
            .collect();
        let vocabulary = Self {
            word_ids: words.ids().into(),
            word_texts: word_texts.into(),
            glue: template_glue(tokenizer)?,
        };
        let sample = agent_sessions(sample_config(), &vocabulary)
            .next()
            .expect("the sample config plans one session");
        vocabulary.check(tokenizer, &sample)?;
        Ok(vocabulary)
    }

    /// Checks that every call of `plan` and of its sub-agents, rendered
    /// as chat messages with `tokenizer`'s template and tokenized, gives
    /// exactly the ids [`Self::session`] gives its prompt.
    pub fn check(&self, tokenizer: &Tokenizer, plan: &AgentSession) -> Result<(), AgentTextError> {
        let session = self.session(plan);
        self.check_rendered(tokenizer, plan, &session)
    }

    fn check_rendered(
        &self,
        tokenizer: &Tokenizer,
        plan: &AgentSession,
        session: &Session,
    ) -> Result<(), AgentTextError> {
        for (i, (call, turn)) in plan.calls.iter().zip(&session.turns).enumerate() {
            let text = tokenizer.apply_chat_template(&self.messages(plan, i), true)?;
            let rendered = tokenizer.encode(&text)?;
            let composed = turn.prompt.tokens();
            if rendered != composed {
                let at = rendered
                    .iter()
                    .zip(&composed)
                    .position(|(a, b)| a != b)
                    .unwrap_or(rendered.len().min(composed.len()));
                return Err(AgentTextError::Template(format!(
                    "renders call {i} of a sample session to other ids than its parts \
                     ({} against {} tokens, first difference at {at}): it does not leave \
                     message contents and the text between them apart",
                    rendered.len(),
                    composed.len()
                )));
            }
            for (child, rendered_child) in call.spawn.iter().zip(&turn.spawn) {
                self.check_rendered(tokenizer, child, rendered_child)?;
            }
        }
        Ok(())
    }

    /// The glue between a message of role `after` (`None`: the start)
    /// and one of role `before` (`None`: the generation prompt).
    fn glue(&self, after: Option<Role>, before: Option<Role>) -> &Arc<[u32]> {
        let row = after.map_or(START, Role::index);
        let column = before.map_or(GENERATE, Role::index);
        self.glue[row][column]
            .as_ref()
            .expect("agent conversations use only the transitions of TRANSITIONS")
    }

    fn glue_lengths(&self) -> [[u32; 5]; 5] {
        let mut lengths = [[0; 5]; 5];
        for (row, column) in TRANSITIONS {
            if let Some(glue) = &self.glue[row][column] {
                lengths[row][column] = glue.len() as u32;
            }
        }
        lengths
    }

    fn word(&self, content: &Content, i: u32) -> usize {
        (xxh3_64_with_seed(&i.to_le_bytes(), content.seed) % self.word_ids.len() as u64) as usize
    }

    /// The token ids of a message's content.
    pub fn content_ids(&self, content: &Content) -> Vec<u32> {
        (0..content.tokens)
            .map(|i| self.word_ids[self.word(content, i)])
            .collect()
    }

    /// The text of a message's content: its words, each with its leading
    /// space, which tokenizes back to [`Self::content_ids`].
    pub fn content_text(&self, content: &Content) -> String {
        let mut text = String::with_capacity(content.tokens as usize * 6);
        for i in 0..content.tokens {
            text.push_str(&self.word_texts[self.word(content, i)]);
        }
        text
    }

    /// The chat messages of call `call`'s prompt (the generation prompt is
    /// the template's, as a chat request asks for).
    pub fn messages(&self, plan: &AgentSession, call: usize) -> Vec<ChatMessage> {
        plan.messages[..plan.calls[call].prompt_messages]
            .iter()
            .map(|m| ChatMessage::text(m.role.as_str(), self.content_text(m)))
            .collect()
    }

    /// `plan` as the simulator's session: each call a turn whose prompt
    /// is the template's tokens and the contents' ids, in shared pieces;
    /// sub-agents as spawned sessions.
    pub fn session(&self, plan: &AgentSession) -> Session {
        self.render(plan, &mut FxHashMap::default())
    }

    /// [`Self::session`] with `pieces`, message pieces already made, by
    /// content seed and previous role (a sub-agent reuses its parent's;
    /// sessions of one kind, their system message's).
    fn render(
        &self,
        plan: &AgentSession,
        pieces: &mut FxHashMap<(u64, usize), Arc<[u32]>>,
    ) -> Session {
        let mut previous = None;
        let message_pieces: Vec<Arc<[u32]>> = plan
            .messages
            .iter()
            .map(|m| {
                let after = previous.replace(m.role);
                let key = (m.seed, after.map_or(START, Role::index));
                pieces
                    .entry(key)
                    .or_insert_with(|| {
                        let mut piece = self.glue(after, Some(m.role)).to_vec();
                        piece.extend(self.content_ids(m));
                        piece.into()
                    })
                    .clone()
            })
            .collect();
        let turns = plan
            .calls
            .iter()
            .map(|call| {
                let n = call.prompt_messages;
                let last = plan.messages[n - 1].role;
                let mut prompt: Vec<Arc<[u32]>> = message_pieces[..n].to_vec();
                prompt.push(self.glue(Some(last), None).clone());
                let tokens: usize = prompt.iter().map(|p| p.len()).sum();
                debug_assert_eq!(tokens, call.prompt_tokens as usize);
                Turn {
                    prompt: PromptSpec::Pieces {
                        pieces: prompt.into(),
                        tokens: tokens as u32,
                    },
                    output_tokens: call.output_tokens,
                    pause_ms: Some(call.pause_ms),
                    spawn: call.spawn.iter().map(|s| self.render(s, pieces)).collect(),
                }
            })
            .collect();
        Session {
            id: plan.id,
            arrival_ms: plan.arrival_ms,
            think_time_ms: 0.0,
            turns,
            flow: SessionFlow::default(),
        }
    }

    /// A vocabulary without a tokenizer, for tests of the plans alone:
    /// `words` made-up word ids and glue of 1 to 8 made-up ids (into a
    /// prompt as the Qwen3 template's: a task's or a tool output's glue
    /// into an answer is the generation prompt's).
    #[cfg(test)]
    pub(crate) fn synthetic(words: u32) -> Self {
        let word_ids: Vec<u32> = (0..words).map(|i| 1_000 + i).collect();
        let word_texts: Vec<Box<str>> = (0..words).map(|i| format!(" w{i}").into()).collect();
        let mut glue: Glue = Default::default();
        for (n, (row, column)) in TRANSITIONS.into_iter().enumerate() {
            let len = 1 + (n as u32 * 5) % 8;
            glue[row][column] = Some((0..len).map(|j| 100 * n as u32 + j).collect());
        }
        glue[1][2] = glue[1][GENERATE].clone();
        glue[3][2] = glue[3][GENERATE].clone();
        Self {
            word_ids: word_ids.into(),
            word_texts: word_texts.into(),
            glue,
        }
    }
}

/// Renders two conversations of markers with `tokenizer`'s template and
/// reads the text between markers: the glue of every transition of
/// [`TRANSITIONS`], tokenized.
fn template_glue(tokenizer: &Tokenizer) -> Result<Glue, AgentTextError> {
    use Role::{Assistant, System, Tool, User};
    let shapes: [&[Role]; 2] = [
        &[System, User, Assistant, Tool, Assistant, User],
        &[System, User, Assistant, Tool],
    ];
    let mut glue: Glue = Default::default();
    let mut set = |row: usize, column: usize, text: &str| -> Result<(), AgentTextError> {
        let ids: Arc<[u32]> = tokenizer.encode(text)?.into();
        if ids.len() > MAX_GLUE_TOKENS {
            return Err(AgentTextError::Template(format!(
                "puts {} tokens between two messages (at most {MAX_GLUE_TOKENS})",
                ids.len()
            )));
        }
        match &glue[row][column] {
            Some(seen) if *seen != ids => Err(AgentTextError::Template(
                "puts different text between messages of the same roles in different \
                 conversations"
                    .to_owned(),
            )),
            _ => {
                glue[row][column] = Some(ids);
                Ok(())
            }
        }
    };
    for roles in shapes {
        let messages: Vec<ChatMessage> = roles
            .iter()
            .enumerate()
            .map(|(i, role)| ChatMessage::text(role.as_str(), marker(i)))
            .collect();
        let text = tokenizer.apply_chat_template(&messages, true)?;
        let mut rest = text.as_str();
        let mut row = START;
        for (i, role) in roles.iter().enumerate() {
            let m = marker(i);
            let at = rest.find(&m).ok_or_else(|| {
                AgentTextError::Template("drops, reorders or rewrites message contents".to_owned())
            })?;
            set(row, role.index(), &rest[..at])?;
            rest = &rest[at + m.len()..];
            row = role.index();
        }
        set(row, GENERATE, rest)?;
    }
    debug_assert!(TRANSITIONS.iter().all(|&(r, c)| glue[r][c].is_some()));
    Ok(glue)
}

/// A session small enough to check every call against the template:
/// every transition, and a fan-out.
fn sample_config() -> AgenticConfig {
    AgenticConfig {
        sessions: 1,
        sessions_per_sec: 1.0,
        seed: 0,
        kinds: vec![AgentKind {
            prefix_tokens: 12,
            weight: 1.0,
        }],
        task_tokens: LogNormal::fixed(5.0),
        calls: LogNormal::fixed(3.0),
        assistant_tokens: LogNormal::fixed(4.0),
        tool_output_tokens: LogNormal::fixed(6.0),
        tool_gap_s: LogNormal::fixed(1.0),
        fan_out: FanOut {
            probability: 1.0,
            min_agents: 2,
            max_agents: 2,
            calls: LogNormal::fixed(2.0),
            task_tokens: LogNormal::fixed(3.0),
        },
        context_cap_tokens: 10_000,
    }
}

/// A seed from parts, each hashed in turn.
fn seed_of(parts: &[u64]) -> u64 {
    let bytes: Vec<u8> = parts.iter().flat_map(|p| p.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

/// Domain tags of [`seed_of`]: sessions, contents and kinds draw from
/// separate seeds.
const SESSION_SEED: u64 = 1;
const CONTENT_SEED: u64 = 2;
const KIND_SEED: u64 = 3;
const ARRIVAL_SEED: u64 = 4;

/// A conversation being planned: its messages and the tokens they render
/// to with the template's text between them.
#[derive(Clone)]
struct Conversation {
    messages: Vec<Content>,
    tokens: u64,
}

impl Conversation {
    fn push(&mut self, glue: &[[u32; 5]; 5], content: Content) {
        let row = self.messages.last().map_or(START, |m| m.role.index());
        self.tokens += u64::from(glue[row][content.role.index()]) + u64::from(content.tokens);
        self.messages.push(content);
    }

    /// Tokens of a prompt of every message so far.
    fn prompt_tokens(&self, glue: &[[u32; 5]; 5]) -> u64 {
        let row = self.messages.last().map_or(START, |m| m.role.index());
        self.tokens + u64::from(glue[row][GENERATE])
    }
}

/// The planned sessions of a config, in arrival order: what
/// [`agent_sessions`] returns.
#[derive(Clone)]
pub struct AgentSessions {
    config: AgenticConfig,
    glue: [[u32; 5]; 5],
    kind_cdf: Vec<f64>,
    arrivals: StdRng,
    clock_ms: f64,
    planned: usize,
    next_id: u64,
}

/// Plans `config`'s sessions (it should be [validated]), with
/// `vocabulary`'s template text counted in every prompt's length. The one
/// generator behind both renderings: the simulator's sessions
/// ([`agentic`]) and the load generator's chat messages.
///
/// [validated]: AgenticConfig::validate
pub fn agent_sessions(config: AgenticConfig, vocabulary: &AgentVocabulary) -> AgentSessions {
    let total: f64 = config.kinds.iter().map(|k| k.weight).sum();
    let mut acc = 0.0;
    let kind_cdf = config
        .kinds
        .iter()
        .map(|k| {
            acc += k.weight / total;
            acc
        })
        .collect();
    AgentSessions {
        arrivals: StdRng::seed_from_u64(seed_of(&[ARRIVAL_SEED, config.seed])),
        glue: vocabulary.glue_lengths(),
        kind_cdf,
        clock_ms: 0.0,
        planned: 0,
        next_id: 0,
        config,
    }
}

impl AgentSessions {
    fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    fn content(&self, role: Role, tokens: u32, session: u64, message: usize) -> Content {
        Content {
            role,
            tokens,
            seed: seed_of(&[CONTENT_SEED, self.config.seed, session, message as u64]),
        }
    }

    /// Plans up to `calls` calls of session `id` on `conversation`, its
    /// prompt so far; sub-agents when `fan_out`. Ends before a call that
    /// would pass the cap; leaves the conversation at the last call's
    /// answer.
    fn run(
        &mut self,
        rng: &mut StdRng,
        id: u64,
        kind: usize,
        conversation: &mut Conversation,
        calls: u32,
        fan_out: bool,
    ) -> Vec<AgentCall> {
        let cap = u64::from(self.config.context_cap_tokens);
        let mut planned = Vec::new();
        for n in 0..calls {
            let output = self.config.assistant_tokens.count(rng);
            let prompt_tokens = conversation.prompt_tokens(&self.glue);
            if prompt_tokens + u64::from(output) > cap {
                break;
            }
            let prompt_messages = conversation.messages.len();
            let answer = self.content(Role::Assistant, output, id, prompt_messages);
            conversation.push(&self.glue, answer);
            let mut call = AgentCall {
                prompt_messages,
                prompt_tokens: prompt_tokens as u32,
                output_tokens: output,
                pause_ms: 0.0,
                spawn: Vec::new(),
            };
            if n + 1 == calls {
                planned.push(call);
                break;
            }
            let fan = self.config.fan_out;
            if fan_out && rng.gen::<f64>() < fan.probability {
                for _ in 0..rng.gen_range(fan.min_agents..=fan.max_agents) {
                    let child = self.take_id();
                    let mut context = conversation.clone();
                    let task = self.content(
                        Role::User,
                        fan.task_tokens.count(rng),
                        child,
                        context.messages.len(),
                    );
                    context.push(&self.glue, task);
                    let child_calls = fan.calls.count(rng);
                    let calls = self.run(rng, child, kind, &mut context, child_calls, false);
                    if !calls.is_empty() {
                        call.spawn.push(AgentSession {
                            id: child,
                            arrival_ms: 0.0,
                            kind,
                            messages: context.messages,
                            calls,
                        });
                    }
                }
            }
            if call.spawn.is_empty() {
                call.pause_ms = self.config.tool_gap_s.sample(rng) * 1_000.0;
            }
            planned.push(call);
            let output = self.config.tool_output_tokens.count(rng);
            let tool = self.content(Role::Tool, output, id, conversation.messages.len());
            conversation.push(&self.glue, tool);
        }
        // Messages after the last call's answer are in no prompt.
        if let Some(last) = planned.last() {
            conversation.messages.truncate(last.prompt_messages + 1);
        }
        planned
    }
}

impl Iterator for AgentSessions {
    type Item = AgentSession;

    fn next(&mut self) -> Option<AgentSession> {
        if self.planned >= self.config.sessions {
            return None;
        }
        let rate = self.config.sessions_per_sec.max(1e-9);
        self.clock_ms += -(1.0 - self.arrivals.gen::<f64>()).ln() / rate * 1_000.0;
        let mut rng = StdRng::seed_from_u64(seed_of(&[
            SESSION_SEED,
            self.config.seed,
            self.planned as u64,
        ]));
        self.planned += 1;
        let u = rng.gen::<f64>();
        let kind = self
            .kind_cdf
            .iter()
            .position(|&c| u < c)
            .unwrap_or(self.kind_cdf.len() - 1);
        let id = self.take_id();
        let mut conversation = Conversation {
            messages: Vec::new(),
            tokens: 0,
        };
        conversation.push(
            &self.glue,
            Content {
                role: Role::System,
                tokens: self.config.kinds[kind].prefix_tokens,
                seed: seed_of(&[KIND_SEED, self.config.seed, kind as u64]),
            },
        );
        let task = self.content(Role::User, self.config.task_tokens.count(&mut rng), id, 1);
        conversation.push(&self.glue, task);
        let calls = self.config.calls.count(&mut rng);
        let calls = self.run(&mut rng, id, kind, &mut conversation, calls, true);
        Some(AgentSession {
            id,
            arrival_ms: self.clock_ms,
            kind,
            messages: conversation.messages,
            calls,
        })
    }
}

/// The agent workload as the simulator's sessions, in arrival order:
/// [`agent_sessions`] rendered with [`AgentVocabulary::session`] (the
/// system messages' pieces shared between sessions).
pub fn agentic(config: AgenticConfig, vocabulary: Arc<AgentVocabulary>) -> SessionStream {
    let plans = agent_sessions(config, &vocabulary);
    let mut pieces = FxHashMap::default();
    Box::new(plans.map(move |plan| {
        let session = vocabulary.render(&plan, &mut pieces);
        // Only system messages recur across sessions.
        pieces.retain(|&(_, after), _| after == START);
        Ok(session)
    }))
}

#[cfg(test)]
#[path = "agentic_tests.rs"]
mod tests;
