//! The request bodies of a mid-stream resume, sans I/O: whether a broken
//! chat or completions stream may be resumed ([`resumable`], an
//! allow-list of the fields a resume reproduces), the original's output
//! limit ([`max_tokens`]) and the `/v1/completions` body that resumes it
//! ([`resume_body`]); [`agentic`] — the same for the Responses and
//! Messages APIs, with the rewrite of the resumed worker's chunks into
//! their events. What a failed attempt becomes — moved, resumed or given
//! up — is the core's ([`switchyard_core::dispatch::failure`]); the
//! router's streaming body rewrites a resumed chat stream's chunks into
//! the original response's shape ([`crate::sse::StreamShape::rewrite`]).
//!
//! Generated tokens are recovered from the chunks' `token_ids` when the
//! worker sends them (vLLM's and the sim-worker's `return_token_ids`,
//! which the router asks of every worker it resumes on), otherwise from the
//! streamed text, re-tokenized with the router's tokenizer at migration
//! time (the core's `Progress`).
//!
//! A resumed request is a different request (a token-id prompt on
//! `/v1/completions`), so it is sent only when it reproduces the original:
//! [`resumable`] accepts a body only when every field is on an allow-list
//! of fields the resume carries or rebuilds. Anything else — `tools`,
//! `response_format`, image parts, `chat_template_kwargs`, output
//! penalties, a field the router does not know — ends a broken stream with
//! an error event instead. Before the first token the client's own request
//! is retried unchanged, so that limit does not apply there.

use crate::body_fields::{self, Fields, PromptKind};
use crate::openai::Api;
use serde_json::value::RawValue;

pub mod agentic;

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
