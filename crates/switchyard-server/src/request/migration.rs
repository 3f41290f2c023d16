//! Request migration, sans I/O: why an attempt failed, whether the request
//! may move to another worker, what has been generated so far, and the
//! request that resumes it.
//!
//! A failure before the first token (connection refused, reset, a 5xx, no
//! first byte in time) retries the client's own request on another worker.
//! A failure mid-stream re-issues the request as a `/v1/completions` call
//! whose prompt is the original prompt's token ids followed by the
//! generated tokens' ids, with `max_tokens` reduced by what was generated;
//! the stream module rewrites its chunks into the original response's
//! shape. [`decide`] is the one place that says whether to migrate.
//!
//! Generated tokens are recovered from the chunks' `token_ids` when the
//! worker sends them (vLLM's and the sim-worker's `return_token_ids`,
//! which the router asks of every worker it resumes on), otherwise from the
//! streamed text, re-tokenized with the router's tokenizer at migration
//! time. Memory per request: the ids (4 bytes a token, at most the
//! migration sequence limit less the prompt: [`Progress::bounded`]) plus at
//! most [`Progress::text_cap`] bytes of not yet tokenized text. Past either
//! bound the progress stops recording and the stream is no longer
//! resumable.
//!
//! A request can fail workers by itself (a prompt that crashes the engine,
//! a prefill slower than the first-token timeout). So that one such
//! request cannot open circuits across the fleet, the second "suspect"
//! failure of a request ([`Failure::request_may_cause`]: a 5xx, an error
//! event, a first-token timeout) on another worker is taken as the
//! request's fault ([`request_fault`]): that worker is not reported and
//! the request is not moved again.
//!
//! Whatever the failures, a prompt goes to at most
//! [`MigrationPolicy::max_workers`] (`--max-attempt-workers`, 2) workers
//! that received it: a prompt that failed on two workers is probably the
//! prompt's fault, and a third attempt would only spread the damage (a
//! prompt that crashes engines). A refused connection does not count: the
//! worker never saw the prompt.
//!
//! A resumed request is a different request (a token-id prompt on
//! `/v1/completions`), so it is sent only when it reproduces the original:
//! [`resumable`] accepts a body only when every field is on an allow-list
//! of fields the resume carries or rebuilds. Anything else — `tools`,
//! `response_format`, image parts, `chat_template_kwargs`, output
//! penalties, a field the router does not know — ends a broken stream with
//! an error event instead. Before the first token the client's own request
//! is retried unchanged, so that limit does not apply there.

use crate::request::body_fields::{self, Fields, PromptKind};
use serde_json::value::RawValue;
use switchyard_wire::openai::Api;

pub use crate::failure::{Failure, GiveUp};

/// Migration limits (`--migration-limit`, `--migration-max-seq-len`,
/// `--max-attempt-workers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationPolicy {
    /// Migrations allowed per request (0: none).
    pub limit: u32,
    /// Prompt plus generated tokens above which a stream is not resumed.
    pub max_seq_len: u64,
    /// Workers a request may fail on (after they received it) before it
    /// ends: the request is not sent to another one.
    pub max_workers: u32,
}

/// What to do after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Move the request to another worker.
    Migrate,
    /// Give up; the client gets this explanation.
    GiveUp(GiveUp),
}

/// Where a request was when its attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Nothing has reached the client: the request is retried as it came.
    BeforeFirstToken,
    /// Tokens have reached the client: the request is resumed.
    MidStream,
}

/// Whether a failure is the request's fault: `reason` is one the request
/// may cause ([`Failure::request_may_cause`]) and `earlier_suspects`
/// failures of that kind already happened on other workers. Then the
/// worker is not reported (its circuit stays closed) and the request is
/// answered with the error instead of moving on.
pub fn request_fault(reason: Failure, earlier_suspects: u32) -> bool {
    reason.request_may_cause() && earlier_suspects >= 1
}

/// The migration decision: a pure function of the request's state.
/// `migrations` counts the migrations already made, `failed_workers` the
/// workers that received the request and failed it (this one included).
pub fn decide(
    policy: MigrationPolicy,
    migrations: u32,
    failed_workers: u32,
    phase: Phase,
    prompt_tokens: u64,
    progress: &Progress,
    resumable: Result<(), &'static str>,
) -> Verdict {
    if migrations >= policy.limit {
        return Verdict::GiveUp(GiveUp::LimitReached {
            limit: policy.limit,
        });
    }
    if failed_workers >= policy.max_workers {
        return Verdict::GiveUp(GiveUp::WorkerLimit {
            workers: failed_workers,
        });
    }
    if phase == Phase::MidStream {
        if let Err(why) = resumable {
            return Verdict::GiveUp(GiveUp::NotResumable(why));
        }
        let len = prompt_tokens.saturating_add(progress.generated);
        if len > policy.max_seq_len {
            return Verdict::GiveUp(GiveUp::TooLong {
                len,
                max: policy.max_seq_len,
            });
        }
        if progress.overflowed {
            return Verdict::GiveUp(GiveUp::NotResumable(
                "the generated text outgrew what the router keeps",
            ));
        }
    }
    Verdict::Migrate
}

/// What a stream has generated so far: all a resumed request needs.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Tokens generated (ids when the worker sent them, else one a chunk
    /// with text, as the engines stream one token a chunk).
    pub generated: u64,
    /// Generated token ids known so far, in order.
    ids: Vec<u32>,
    /// Generated text not yet turned into ids (from a worker that sends
    /// no ids); tokenized at the next migration.
    pending_text: String,
    /// Largest `pending_text`, in bytes.
    text_cap: usize,
    /// Most ids kept (`None`: unbounded).
    max_ids: Option<usize>,
    /// Text outgrew `text_cap` or ids outgrew `max_ids`: nothing more is
    /// recorded and the stream can no longer be resumed.
    overflowed: bool,
    /// A choice reported its `finish_reason`. Only the first choice of each
    /// chunk is read, so this means the whole generation is complete only
    /// for a single-choice (resumable) request.
    pub finished: bool,
}

/// Generated ids a stream first makes room for.
const GENERATED_IDS_HINT: usize = 64;

/// Bytes of generated text a stream first makes room for.
const GENERATED_TEXT_HINT: usize = 256;

impl Progress {
    /// Empty progress that keeps at most `text_cap` bytes of text.
    pub fn new(text_cap: usize) -> Self {
        Self {
            text_cap,
            ..Self::default()
        }
    }

    /// Empty progress that keeps at most `text_cap` bytes of text and
    /// `max_ids` token ids: a stream resumable only while prompt plus
    /// generated tokens fit the migration sequence limit needs no more
    /// than that limit less the prompt.
    pub fn bounded(text_cap: usize, max_ids: usize) -> Self {
        Self {
            text_cap,
            max_ids: Some(max_ids),
            ..Self::default()
        }
    }

    /// The bound on kept text, in bytes.
    pub fn text_cap(&self) -> usize {
        self.text_cap
    }

    /// Records one chunk's first choice.
    pub fn observe(&mut self, text: Option<&str>, token_ids: Option<&[u32]>, finish: bool) {
        match token_ids {
            Some(ids) if !ids.is_empty() => {
                self.generated = self.generated.saturating_add(ids.len() as u64);
                self.extend_ids(ids);
            }
            _ => {
                if let Some(text) = text.filter(|t| !t.is_empty()) {
                    self.generated = self.generated.saturating_add(1);
                    if self.pending_text.len().saturating_add(text.len()) > self.text_cap {
                        self.overflow();
                    } else if !self.overflowed {
                        if self.pending_text.capacity() == 0 {
                            // As for ids: room for a short answer at once.
                            let room = text.len().max(GENERATED_TEXT_HINT);
                            self.pending_text.reserve(room.min(self.text_cap));
                        }
                        self.pending_text.push_str(text);
                    }
                }
            }
        }
        self.finished |= finish;
    }

    /// Text still to be tokenized before resuming (taken).
    pub fn take_pending_text(&mut self) -> String {
        std::mem::take(&mut self.pending_text)
    }

    /// Appends ids (streamed, or obtained by tokenizing the pending text),
    /// unless that would pass the bound on kept ids.
    pub fn extend_ids(&mut self, ids: &[u32]) {
        if self.overflowed {
            return;
        }
        let within = self
            .max_ids
            .is_none_or(|max| self.ids.len().saturating_add(ids.len()) <= max);
        if within {
            if self.ids.capacity() == 0 {
                // Room for a short answer's ids at once (256 bytes), not
                // doublings from 4 as the stream goes.
                let room = ids.len().max(GENERATED_IDS_HINT);
                self.ids
                    .reserve(self.max_ids.map_or(room, |max| room.min(max)));
            }
            self.ids.extend_from_slice(ids);
        } else {
            self.overflow();
        }
    }

    /// Stops recording for good and frees what was kept.
    fn overflow(&mut self) {
        self.overflowed = true;
        self.ids = Vec::new();
        self.pending_text = String::new();
    }

    /// Whether recording stopped at a bound (the stream cannot resume).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The generated ids known so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// Why a request cannot be resumed mid-stream, judged from its body: `Ok`
/// only when every field is one the resume reproduces. An allow-list, not
/// a deny-list: a field the router does not know may change what the
/// model generates, so it makes the request not resumable. A `null` field
/// is as good as absent. Accepted:
///
/// - the fields [`resume_body`] carries as they are ([`CARRIED`]: `model`,
///   `temperature`, `top_p`, `seed`, `stop`, ...);
/// - the fields it rebuilds: `stream`, `max_tokens`,
///   `max_completion_tokens`, and the prompt — for chat, `messages` whose
///   every message is a `system`, `user` or `assistant` role with text
///   content (a string, or one text part: what the router's chat template
///   renders as the engine does); for completions, one text or token-id
///   `prompt`;
/// - fields at their neutral value: `n` and `best_of` 1, `echo` and
///   `logprobs` false, `frequency_penalty` and `presence_penalty` 0 (they
///   apply to generated tokens, which a resumed request sees as prompt).
///
/// Everything else — `tools`, `tool_choice`, `response_format`, guided
/// decoding, `chat_template_kwargs`, image or audio parts, message names
/// and tool calls, several choices, logprobs, `echo`, `suffix`, ... — is
/// an `Err` naming what cannot be reproduced (field names only, never
/// content).
pub fn resumable(api: Api, body: &Fields<'_>) -> Result<(), &'static str> {
    for (key, value) in body.iter() {
        match key {
            k if CARRIED.contains(&k) => {}
            "stream" | "max_tokens" | "max_completion_tokens" => {}
            "messages" if api == Api::Chat => body_fields::messages_are_plain(value)?,
            "prompt" if api == Api::Completions => single_prompt(value)?,
            "n" | "best_of" if body.count(key) == Some(1) => {}
            "n" | "best_of" => return Err("it asks for several choices"),
            "echo" | "logprobs" if value.get() == "false" => {}
            "frequency_penalty" | "presence_penalty"
                if serde_json::from_str::<f64>(value.get()).ok() == Some(0.0) => {}
            other => return Err(not_reproduced(other)),
        }
    }
    Ok(())
}

/// Why a request with field `key` (set, not at a neutral value) cannot be
/// resumed.
fn not_reproduced(key: &str) -> &'static str {
    match key {
        "tools" | "tool_choice" | "parallel_tool_calls" | "functions" | "function_call" => {
            "it uses tools (`tools`, `tool_choice` or `functions`), which a resumed request cannot reproduce"
        }
        "response_format" | "structured_outputs" | "guided_json" | "guided_regex"
        | "guided_choice" | "guided_grammar" | "guided_decoding_backend" => {
            "it constrains the output (`response_format` or guided decoding), which a resumed request cannot reproduce"
        }
        "chat_template" | "chat_template_kwargs" | "add_generation_prompt"
        | "continue_final_message" | "documents" | "add_special_tokens"
        | "mm_processor_kwargs" => {
            "it changes how the prompt is rendered (`chat_template_kwargs` or the like), which a resumed prompt cannot reproduce"
        }
        "logprobs" | "top_logprobs" | "prompt_logprobs" => "it asks for logprobs",
        "echo" => "it asks for the prompt to be echoed",
        "frequency_penalty" | "presence_penalty" => {
            "it sets frequency or presence penalties, which a resumed request would apply to the tokens generated so far as prompt"
        }
        "messages" | "prompt" => "its prompt is not of its endpoint's kind",
        _ => "it sets a field the router does not know how to carry to another worker",
    }
}

/// One prompt: text or token ids, not a batch.
fn single_prompt(prompt: &RawValue) -> Result<(), &'static str> {
    match body_fields::prompt_kind(prompt) {
        PromptKind::Text | PromptKind::Ids => Ok(()),
        PromptKind::Batch => Err("it has a batch of prompts"),
        PromptKind::Other => Err("its prompt is neither text nor token ids"),
    }
}

/// The original request's `max_tokens` (`max_completion_tokens` first for
/// chat), if it set one, read as the engines read a count.
pub fn max_tokens(body: &Fields<'_>) -> Option<u64> {
    body.count("max_completion_tokens")
        .or_else(|| body.count("max_tokens"))
        .map(u64::from)
}

/// Sampling fields carried from the original request into a resumed one
/// as they are; the prompt, `stream` and `max_tokens` are rebuilt, and a
/// request with any other field is not resumed ([`resumable`]).
/// `repetition_penalty` applies to prompt and generated tokens alike, so
/// it means the same on a resumed prompt; frequency and presence
/// penalties apply to generated tokens only and are not carried.
const CARRIED: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "ignore_eos",
    "user",
    "stream_options",
    "session_id",
];

/// The `/v1/completions` body that resumes `original`: its sampling
/// fields as they were written, `prompt` = `prompt_ids` (original prompt
/// then generated ids), `max_tokens` = `remaining` (absent when the
/// original set none), streaming, with token ids requested.
pub fn resume_body(original: &Fields<'_>, prompt_ids: &[u32], remaining: Option<u64>) -> Vec<u8> {
    let mut body = Fields::default();
    for key in CARRIED {
        if let Some(v) = original.get(key) {
            body.set_raw(key, v.to_owned());
        }
    }
    body.set("prompt", &prompt_ids);
    if let Some(remaining) = remaining {
        body.set("max_tokens", &remaining);
    }
    body.set("stream", &true);
    body.set("return_token_ids", &true);
    body.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// [`super::resumable`] of a body written as `body` (what the stream
    /// says of a body that is no object).
    fn resumable(api: Api, body: &Value) -> Result<(), &'static str> {
        let bytes = serde_json::to_vec(body).unwrap();
        let fields = Fields::parse(&bytes).map_err(|_| "its body is not a JSON object")?;
        super::resumable(api, &fields)
    }

    const POLICY: MigrationPolicy = MigrationPolicy {
        limit: 3,
        max_seq_len: 100,
        max_workers: 10,
    };

    #[test]
    fn a_request_migrates_until_its_limit() {
        let p = Progress::new(64);
        for done in 0..3 {
            assert_eq!(
                decide(POLICY, done, 1, Phase::BeforeFirstToken, 10, &p, Ok(())),
                Verdict::Migrate
            );
        }
        assert_eq!(
            decide(POLICY, 3, 1, Phase::MidStream, 10, &p, Ok(())),
            Verdict::GiveUp(GiveUp::LimitReached { limit: 3 })
        );
        let off = MigrationPolicy { limit: 0, ..POLICY };
        assert!(matches!(
            decide(off, 0, 1, Phase::BeforeFirstToken, 10, &p, Ok(())),
            Verdict::GiveUp(_)
        ));
    }

    #[test]
    fn a_stream_longer_than_the_sequence_limit_is_not_resumed() {
        let mut p = Progress::new(64);
        for _ in 0..11 {
            p.observe(None, Some(&[1]), false);
        }
        assert_eq!(
            decide(POLICY, 0, 1, Phase::MidStream, 90, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { len: 101, max: 100 })
        );
        // Before the first token the sequence limit does not apply.
        assert_eq!(
            decide(
                POLICY,
                0,
                1,
                Phase::BeforeFirstToken,
                200,
                &Progress::new(8),
                Ok(())
            ),
            Verdict::Migrate
        );
    }

    #[test]
    fn a_request_that_cannot_be_resumed_gives_up_mid_stream_only() {
        let p = Progress::new(64);
        let why = resumable(Api::Completions, &json!({"prompt": [1], "n": 2}));
        assert!(why.is_err());
        assert!(matches!(
            decide(POLICY, 0, 1, Phase::MidStream, 1, &p, why),
            Verdict::GiveUp(GiveUp::NotResumable(_))
        ));
        assert_eq!(
            decide(POLICY, 0, 1, Phase::BeforeFirstToken, 1, &p, why),
            Verdict::Migrate,
            "before the first token the request is retried as it came"
        );
    }

    #[test]
    fn plain_text_requests_with_sampling_fields_are_resumable() {
        let chat = json!({
            "model": "m", "stream": true, "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "hello", "name": null},
                {"role": "user", "content": "again"},
            ],
            "max_completion_tokens": 20, "max_tokens": null, "temperature": 0.7,
            "top_p": 0.9, "top_k": 40, "min_p": 0.0, "seed": 1, "stop": ["\n"],
            "stop_token_ids": [2], "logit_bias": {"5": -1}, "repetition_penalty": 1.1,
            "ignore_eos": false, "user": "u", "session_id": "s", "n": 1, "best_of": 1,
            "logprobs": false, "echo": false, "frequency_penalty": 0, "presence_penalty": 0.0,
            "tools": null, "response_format": null,
        });
        assert_eq!(resumable(Api::Chat, &chat), Ok(()));
        for prompt in [json!("text"), json!([1, 2, 3]), json!([])] {
            let completion =
                json!({"model": "m", "prompt": prompt, "max_tokens": 5, "stream": true});
            assert_eq!(
                resumable(Api::Completions, &completion),
                Ok(()),
                "{completion}"
            );
        }
    }

    #[test]
    fn anything_the_resume_cannot_reproduce_makes_a_request_not_resumable() {
        let chat = |extra: serde_json::Value| {
            let mut body = json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            resumable(Api::Chat, &body)
        };
        let cases = [
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
                "tools",
            ),
            (json!({"tools": []}), "tools"),
            (json!({"tool_choice": "none"}), "tools"),
            (json!({"functions": [{"name": "f"}]}), "tools"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "constrains",
            ),
            (json!({"guided_json": {}}), "constrains"),
            (
                json!({"chat_template_kwargs": {"enable_thinking": false}}),
                "rendered",
            ),
            (json!({"add_generation_prompt": false}), "rendered"),
            (json!({"n": 2}), "several choices"),
            (json!({"best_of": 3}), "several choices"),
            (json!({"logprobs": true}), "logprobs"),
            (json!({"top_logprobs": 2}), "logprobs"),
            (json!({"echo": true}), "echoed"),
            (json!({"frequency_penalty": 0.5}), "penalties"),
            (json!({"presence_penalty": -1}), "penalties"),
            (json!({"prompt": "wrong endpoint"}), "endpoint"),
            (json!({"some_new_engine_knob": 1}), "does not know"),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]}),
                "non-text",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]}),
                "non-text",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
                "several text parts",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]}),
                "non-text",
            ),
            (
                json!({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c"}]}),
                "role",
            ),
            (
                json!({"messages": [{"role": "developer", "content": "x"}]}),
                "role",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x", "name": "bob"}]}),
                "more than a role",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": null, "tool_calls": []}]}),
                "more than a role",
            ),
            (
                json!({"messages": [{"role": "user", "content": 7}]}),
                "not text",
            ),
            (json!({"messages": "hi"}), "not a list"),
            (json!({"messages": ["hi"]}), "not objects"),
        ];
        for (extra, expected) in cases {
            let why = chat(extra.clone()).expect_err(&extra.to_string());
            assert!(why.contains(expected), "{extra}: {why}");
            assert!(!why.contains("secret"), "no content in the reason");
        }
        let completion = |body: serde_json::Value| resumable(Api::Completions, &body);
        assert!(completion(json!({"prompt": ["a", "b"]}))
            .unwrap_err()
            .contains("batch"));
        assert!(completion(json!({"prompt": [[1], [2]]}))
            .unwrap_err()
            .contains("batch"));
        assert!(completion(json!({"prompt": [1], "suffix": "x"}))
            .unwrap_err()
            .contains("does not know"));
        assert!(completion(json!({"prompt": [1], "logprobs": 0}))
            .unwrap_err()
            .contains("logprobs"));
        assert!(completion(json!({"prompt": 5})).is_err());
        assert!(completion(json!({"prompt": [1], "messages": []})).is_err());
        assert!(completion(json!("junk")).is_err());
        assert!(completion(json!([1, 2])).is_err());
    }

    #[test]
    fn a_request_is_not_sent_to_more_workers_than_the_limit() {
        let policy = MigrationPolicy {
            max_workers: 2,
            ..POLICY
        };
        let p = Progress::new(64);
        assert_eq!(
            decide(policy, 0, 1, Phase::BeforeFirstToken, 1, &p, Ok(())),
            Verdict::Migrate
        );
        for phase in [Phase::BeforeFirstToken, Phase::MidStream] {
            assert_eq!(
                decide(policy, 1, 2, phase, 1, &p, Ok(())),
                Verdict::GiveUp(GiveUp::WorkerLimit { workers: 2 }),
                "{phase:?}"
            );
        }
        // Refused connections (the worker never had the prompt) do not
        // count: migrations beyond the worker limit are still allowed.
        assert_eq!(
            decide(policy, 2, 1, Phase::BeforeFirstToken, 1, &p, Ok(())),
            Verdict::Migrate
        );
        assert!(!Failure::Connect.reached_worker());
        for reason in [
            Failure::Reset,
            Failure::Status5xx,
            Failure::Timeout,
            Failure::MidStream,
        ] {
            assert!(reason.reached_worker(), "{reason:?}");
        }
        let why = GiveUp::WorkerLimit { workers: 2 }.to_string();
        assert!(why.contains("failed on 2 workers"), "{why}");
        assert_eq!(GiveUp::WorkerLimit { workers: 2 }.label(), "worker_limit");
        assert_eq!(GiveUp::NotResumable("x").label(), "not_resumable");
    }

    #[test]
    fn progress_counts_ids_and_text_chunks_and_bounds_text() {
        let mut p = Progress::new(8);
        p.observe(Some(" a"), None, false);
        p.observe(Some(""), None, false);
        p.observe(Some(" b"), Some(&[7, 8]), false);
        assert_eq!(p.generated, 3);
        assert_eq!(p.ids(), &[7, 8]);
        assert_eq!(p.take_pending_text(), " a");
        p.observe(Some("123456789"), None, true);
        assert!(p.finished);
        assert!(matches!(
            decide(POLICY, 0, 1, Phase::MidStream, 1, &p, Ok(())),
            Verdict::GiveUp(GiveUp::NotResumable(_))
        ));
    }

    #[test]
    fn ids_past_the_sequence_limit_are_not_kept_and_the_stream_is_not_resumable() {
        // Prompt of 90 under a limit of 100: at most 10 generated ids.
        let mut p = Progress::bounded(64, 10);
        for _ in 0..10 {
            p.observe(None, Some(&[1]), false);
        }
        assert!(!p.overflowed());
        assert_eq!(p.ids().len(), 10);
        p.observe(None, Some(&[2, 3]), false);
        assert!(p.overflowed(), "the eleventh id passes the bound");
        assert!(p.ids().is_empty(), "what was kept is freed");
        p.observe(None, Some(&[4]), false);
        assert!(p.ids().is_empty(), "nothing more is recorded");
        assert_eq!(p.generated, 13, "generated tokens are still counted");
        assert_eq!(
            decide(POLICY, 0, 1, Phase::MidStream, 90, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { len: 103, max: 100 })
        );
    }

    #[test]
    fn worker_sent_counts_never_overflow() {
        let mut p = Progress::new(8);
        p.generated = u64::MAX;
        p.observe(None, Some(&[1]), false);
        p.observe(Some("x"), None, false);
        assert_eq!(p.generated, u64::MAX);
        assert!(matches!(
            decide(POLICY, 0, 1, Phase::MidStream, u64::MAX, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { .. })
        ));
    }

    #[test]
    fn a_second_failure_the_request_may_cause_is_the_requests_fault() {
        // The first 5xx or timeout may be the worker's: it is reported.
        assert!(!request_fault(Failure::Status5xx, 0));
        assert!(!request_fault(Failure::Timeout, 0));
        // The second, on another worker, is taken to be the request's.
        assert!(request_fault(Failure::Status5xx, 1));
        assert!(request_fault(Failure::Timeout, 1));
        // Refused and broken connections are always the worker's.
        for reason in [Failure::Connect, Failure::Reset, Failure::MidStream] {
            assert!(!request_fault(reason, 5), "{reason:?}");
        }
    }

    #[test]
    fn the_resume_body_carries_sampling_fields_and_drops_the_rest() {
        let original = json!({
            "model": "m", "messages": [{"role": "user", "content": "secret"}],
            "temperature": 0.5, "max_completion_tokens": 20, "tools": [], "n": 1,
            "stream": true, "stream_options": {"include_usage": true},
        });
        let bytes = serde_json::to_vec(&original).unwrap();
        let original = Fields::parse(&bytes).unwrap();
        assert_eq!(max_tokens(&original), Some(20));
        let body: Value =
            serde_json::from_slice(&resume_body(&original, &[1, 2, 3], Some(12))).unwrap();
        assert_eq!(
            body,
            json!({
                "model": "m", "temperature": 0.5, "stream_options": {"include_usage": true},
                "prompt": [1, 2, 3], "max_tokens": 12, "stream": true, "return_token_ids": true,
            })
        );
        let bare: Value =
            serde_json::from_slice(&resume_body(&Fields::default(), &[1], None)).unwrap();
        assert!(bare.get("max_tokens").is_none());
        // A count in another form the engines read is still the count.
        let counted =
            Fields::parse(br#"{"max_tokens": "30", "max_completion_tokens": 40.0}"#).unwrap();
        assert_eq!(max_tokens(&counted), Some(40));
    }
}
