//! The router renders each API's request into the prompt vLLM renders,
//! byte for byte, so that its block hashes are the ones vLLM's KV events
//! carry: checked on `data/golden/vllm-0.32-chat-renders.jsonl`, the texts
//! vLLM 0.32's own conversion and template code rendered from the same
//! bodies (`scripts/golden/vllm_chat_renders.py`): tools and tool-call
//! arguments as `json.dumps` writes them, content parts one a line,
//! Claude Code's billing header dropped, a Responses assistant turn's
//! items merged, Anthropic tool results before the user's text, and an
//! agent loop's reasoning (chat `reasoning`, Anthropic thinking,
//! Responses reasoning items) rendered after the last user query.

use super::TokenizeJob;
use switchyard_tokenizer::Tokenizer;
use switchyard_wire::agentic::{MessagesRequest, ResponsesRequest};
use switchyard_wire::openai::{BodyLimits, ChatCompletionRequest};

const GOLDEN: &str = include_str!("../../../../data/golden/vllm-0.32-chat-renders.jsonl");

/// The chat prompt the router reads from a body of `api`.
fn read(api: &str, body: &[u8]) -> TokenizeJob {
    let limits = BodyLimits::NONE;
    let (messages, tools, unrendered) = match api {
        "chat" => {
            let r = ChatCompletionRequest::from_json(body, &limits).expect("a chat body");
            (r.messages, r.tools, 0)
        }
        "messages" => {
            let r = MessagesRequest::from_json(body, &limits).expect("a Messages body");
            (r.messages, r.tools, r.unrendered_bytes)
        }
        "responses" => {
            let r = ResponsesRequest::from_json(body, &limits).expect("a Responses body");
            (r.messages, r.tools, r.unrendered_bytes)
        }
        other => panic!("unknown api {other}"),
    };
    TokenizeJob::chat(messages, tools, unrendered).unwrap_or_else(|_| panic!("readable"))
}

#[test]
fn every_api_renders_the_prompt_vllm_renders() {
    let tokenizer = Tokenizer::bundled().expect("bundled tokenizer");
    let mut cases = 0;
    for line in GOLDEN.lines() {
        let case: serde_json::Value = serde_json::from_str(line).expect("a golden case");
        let (name, api) = (
            case["name"].as_str().unwrap(),
            case["api"].as_str().unwrap(),
        );
        let body = serde_json::to_vec(&case["body"]).unwrap();
        let TokenizeJob::Chat(chat) = read(api, &body) else {
            panic!("{name}: not a chat")
        };
        let ours = tokenizer
            .apply_chat_template_with_tools(&chat.messages, chat.tools.as_ref(), true)
            .expect("renders");
        let vllm = case["rendered"].as_str().unwrap();
        let first = ours
            .char_indices()
            .zip(vllm.chars())
            .find(|((_, a), b)| a != b)
            .map_or(ours.len().min(vllm.len()), |((i, _), _)| i);
        assert_eq!(
            ours, vllm,
            "{name}: the router's prompt leaves vLLM's at byte {first}"
        );
        cases += 1;
    }
    assert!(cases >= 7, "{cases} golden cases");
}
