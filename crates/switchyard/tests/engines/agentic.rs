//! The Responses API (`/v1/responses`, chained by `previous_response_id`,
//! retrieved, cancelled) and Anthropic's Messages API (`/v1/messages`,
//! `/v1/messages/count_tokens`) through `serve` in front of two real vLLM
//! workers, driven by the official `openai` and `anthropic` Python clients
//! (vLLM's environment pins both), and the routing truth behind them: the
//! same conversation sent as chat, as Responses and as Messages, a tool
//! declared as each API declares it, is one prompt to vLLM too — it hits
//! the blocks the chat request left in vLLM's prefix cache, on the worker
//! the router sends it to, exactly as many tokens as the router predicted;
//! and a Claude Code-shaped Messages turn (billing header, several text
//! blocks, a tool call and its result) is counted by the router as vLLM
//! counts it.
//!
//! What vLLM 0.32 does, found here (and asserted as it is):
//!
//! - it stores no response unless started with
//!   `VLLM_ENABLE_RESPONSES_API_STORE=1` (`store: true` is then silently
//!   dropped, and every `previous_response_id` is a 404): the workers here
//!   are started with it;
//! - a chained turn's prompt is the stored conversation *without its
//!   system message* (`instructions` do not carry over, as OpenAI
//!   specifies), then the previous output, then the new input: a chain that
//!   sends `instructions` only on its first turn shares no prefix with that
//!   turn in the engine's cache. The chain below sends them on every turn,
//!   and then every turn hits the previous one's blocks; its last turn,
//!   without them, hits none (on the right worker all the same);
//! - a Messages answer's `usage.input_tokens` is the whole prompt, cached
//!   tokens included, and `cache_read_input_tokens` is absent even when
//!   vLLM's prefix cache hit (Anthropic's own API counts cache reads apart;
//!   vLLM does only with `--enable-prompt-tokens-details`, not set here);
//! - cancelling a response that was not made in the background is vLLM's
//!   400 ("Cannot cancel a synchronous response").

use crate::support::{metric, served_by, wait_metrics};
use crate::tier::{bounded, exclusive, metrics, serve_in_front, sum, tier, vllm_prefix_cache};
use serde_json::{json, Value};
use std::path::Path;
use switchyard_commands::engines::vllm::VllmWorker;

/// vLLM's tokens per block, and the router's.
const BLOCK: u64 = 32;

/// The official `openai` client's Responses API through the router:
/// non-streaming and streaming turns of one `previous_response_id` chain,
/// every turn on the worker that stores the previous response (the router's
/// `x-switchyard-worker`) and hitting vLLM's cache there (the engine's own
/// `cached_tokens`), retrieve, cancel (a background response, cancelled;
/// a finished one, vLLM's 400: both reached the holder, another worker
/// would say 404) and unknown ids as the client's `NotFoundError`.
/// Prints only ids, workers and counts.
const RESPONSES: &str = r#"
import sys
import openai
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-test", max_retries=0)
INSTRUCTIONS = "Answer in one short line about freight yards."
worker = lambda raw: raw.headers.get("x-switchyard-worker")

raw = client.responses.with_raw_response.create(
    model="tiny", instructions=INSTRUCTIONS,
    input="Describe the hump yard at night, its retarders and its signal box. " * 12,
    max_output_tokens=8)
holder, first = worker(raw), raw.parse()
assert holder in ("v0", "v1"), raw.headers
assert first.id.startswith("resp_"), first.id
assert first.status in ("completed", "incomplete"), first.status
assert first.usage.output_tokens >= 1 and first.output_text, first.usage

previous, workers, cached, streamed = first.id, [], [], 0
for turn in range(4):
    if turn % 2 == 0:
        raw = client.responses.with_raw_response.create(
            model="tiny", instructions=INSTRUCTIONS,
            input=[{"role": "user", "content": f"And on turn {turn}?"}],
            previous_response_id=previous, max_output_tokens=8)
        workers.append(worker(raw))
        r = raw.parse()
        assert r.previous_response_id == previous, r.previous_response_id
        last = r
    else:
        raw = client.responses.with_raw_response.create(
            model="tiny", instructions=INSTRUCTIONS, input=f"Streamed turn {turn}",
            previous_response_id=previous, max_output_tokens=8, stream=True)
        workers.append(worker(raw))
        events = list(raw.parse())
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created", kinds
        assert kinds[-1] == "response.completed", kinds
        assert "response.output_text.delta" in kinds, kinds
        last = events[-1].response
        assert events[0].response.id == last.id, (events[0].response.id, last.id)
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas and deltas == last.output_text, "the deltas are the final text"
        streamed += 1
    cached.append(last.usage.input_tokens_details.cached_tokens)
    previous = last.id
assert all(w == holder for w in workers), (holder, workers)
assert min(cached) > 0, cached

# vLLM drops the system message of a chained turn's history: without
# `instructions` again, the turn's prompt starts with the first user message
# and shares no block with the chain's cached prompts, on the right worker.
raw = client.responses.with_raw_response.create(
    model="tiny", input="And without instructions?", previous_response_id=previous,
    max_output_tokens=4)
assert worker(raw) == holder, (holder, worker(raw))
bare = raw.parse()
assert bare.usage.input_tokens_details.cached_tokens == 0, bare.usage

got = client.responses.retrieve(previous)
assert got.id == previous and got.output_text == last.output_text, got.id
assert client.responses.retrieve(first.id).id == first.id

try:
    client.responses.cancel(first.id)
    raise SystemExit("expected BadRequestError")
except openai.BadRequestError as e:
    assert "synchronous" in e.message, e.message
background = client.responses.create(
    model="tiny", input="A long story, please.", max_output_tokens=4000, background=True,
    extra_body={"ignore_eos": True})
assert background.status in ("queued", "in_progress"), background.status
cancelled = client.responses.cancel(background.id)
assert cancelled.status == "cancelled", cancelled.status
assert client.responses.retrieve(background.id).status == "cancelled"

for call in (lambda: client.responses.retrieve("resp_missing"),
             lambda: client.responses.create(model="tiny", input="x", previous_response_id="resp_missing")):
    try:
        call()
        raise SystemExit("expected NotFoundError")
    except openai.NotFoundError as e:
        assert e.status_code == 404
print("RESPONSES-OK holder", holder, "turns", len(workers), "streamed", streamed, "cached", cached,
      "without instructions", bare.usage.input_tokens_details.cached_tokens)
"#;

/// The official `anthropic` client's Messages API through the router:
/// `messages.create` (system and user text), `messages.stream` (its text
/// is the final message's), `messages.count_tokens` (the router's own
/// count equals vLLM's, argv[2]), a request the router refuses itself
/// (`messages` empty: no worker named) and one vLLM refuses, both
/// Anthropic-shaped errors; and an agent's turn (billing header, several
/// text blocks, tool use and result) counted by the router as vLLM counts
/// it. Prints only counts.
const MESSAGES: &str = r#"
import sys
import anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-test", max_retries=0)
engine = anthropic.Anthropic(base_url=sys.argv[2], api_key="sk-test", max_retries=0)
SYSTEM = "Answer briefly, as a yard master would."
MESSAGES = [{"role": "user", "content": "How are the cars sorted over the hump? " * 8}]

raw = client.messages.with_raw_response.create(
    model="tiny", max_tokens=6, system=SYSTEM, messages=MESSAGES)
assert raw.headers.get("x-switchyard-worker") in ("v0", "v1"), raw.headers
msg = raw.parse()
assert msg.type == "message" and msg.role == "assistant", msg.type
assert msg.content[0].type == "text" and msg.content[0].text, msg.content
assert 1 <= msg.usage.output_tokens <= 6 and msg.stop_reason in ("max_tokens", "end_turn"), msg.usage

with client.messages.stream(model="tiny", max_tokens=6, system=SYSTEM,
        messages=[{"role": "user", "content": "Stream the answer, please."}]) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text and text == "".join(b.text for b in final.content if b.type == "text"), "streamed text is the final text"
assert final.usage.output_tokens >= 1, final.usage

counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
by_engine = engine.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
assert counted.input_tokens == by_engine.input_tokens == msg.usage.input_tokens, (
    counted.input_tokens, by_engine.input_tokens, msg.usage.input_tokens)

# An agent's turn as Claude Code sends it: a system list led by its
# billing header, several text blocks in a message, a tool call and a tool
# result of several text items. The router's count is vLLM's, so it reads
# the conversation as vLLM renders it (joins, dropped header, no user
# message left by a tool result alone).
AGENT_SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=5e1f;"},
    {"type": "text", "text": "You are the yard's agent."},
    {"type": "text", "text": " Use the tools."}]
AGENT = [
    {"role": "user", "content": [
        {"type": "text", "text": "<reminder>track 4 is closed</reminder>"},
        {"type": "text", "text": "Which cars wait on track 7?"}]},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Reading the ledger."},
        {"type": "tool_use", "id": "toolu_1", "name": "ledger", "input": {"track": 7}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "car 1101: grain"}, {"type": "text", "text": "car 1102: coal"}]}]},
]
counted = client.messages.count_tokens(model="tiny", system=AGENT_SYSTEM, messages=AGENT)
by_engine = engine.messages.count_tokens(model="tiny", system=AGENT_SYSTEM, messages=AGENT)
assert counted.input_tokens == by_engine.input_tokens, (counted.input_tokens, by_engine.input_tokens)

try:
    client.messages.create(model="tiny", max_tokens=4, messages=[])
    raise SystemExit("expected BadRequestError")
except anthropic.BadRequestError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
    assert e.response.headers.get("x-switchyard-worker") is None, "the router refused it itself"
try:
    client.messages.create(model="tiny", max_tokens=9000, messages=MESSAGES)
    raise SystemExit("expected BadRequestError")
except anthropic.BadRequestError as e:
    assert e.body["type"] == "error" and e.body["error"]["message"], e.body
print("MESSAGES-OK input_tokens", counted.input_tokens, "streamed", final.usage.output_tokens)
"#;

/// Runs `script` with vLLM's Python (which has both clients) and `args`;
/// its output must end well and name `marker`.
async fn run(python: &Path, script: &'static str, args: Vec<String>, marker: &'static str) {
    let python = python.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg("-c")
            .arg(script)
            .args(args)
            .output()
            .expect("python runs")
    })
    .await
    .expect("the script's thread");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{}", stdout.trim());
    assert!(
        output.status.success() && stdout.contains(marker),
        "stdout: {stdout}\nstderr: {stderr}"
    );
}

/// POSTs `body` to `base` + `path`: the worker the router named ("" when
/// none) and the JSON answer (status 200 required).
async fn post(client: &reqwest::Client, base: &str, path: &str, body: &Value) -> (String, Value) {
    let response = client
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .expect("an answer");
    let status = response.status();
    let worker = if response.headers().contains_key("x-switchyard-worker") {
        served_by(&response)
    } else {
        String::new()
    };
    let answer: Value = response.json().await.expect("a JSON answer");
    assert_eq!(status, 200, "{path}: {answer}");
    (worker, answer)
}

/// vLLM's hit and queried tokens over `workers` once they have counted at
/// least `queried` more tokens than `before` (its counters are updated
/// as the engine steps, not when the answer leaves).
async fn hits_after(
    client: &reqwest::Client,
    workers: &[&VllmWorker],
    before: (f64, f64),
    queried: u64,
) -> (f64, f64) {
    let mut now = vllm_prefix_cache(client, workers).await;
    let mut tries = 0;
    while now.1 - before.1 < queried as f64 {
        tries += 1;
        assert!(
            tries < 300,
            "vLLM counted {} queried tokens, at least {queried} expected",
            now.1 - before.1
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        now = vllm_prefix_cache(client, workers).await;
    }
    (now.0 - before.0, now.1 - before.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_and_messages_through_serve_on_vllm_with_the_official_clients() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let options = || {
            let mut o = tier.qwen3();
            o.extra_env
                .push(("VLLM_ENABLE_RESPONSES_API_STORE".into(), "1".into()));
            o
        };
        let workers = tier
            .start("agentic", vec![("v0", options()), ("v1", options())])
            .await;
        let client = reqwest::Client::new();
        let flags = ["--block-size", &BLOCK.to_string(), "--health-interval-ms", "500"];
        let router =
            serve_in_front(&client, &workers, flags.map(str::to_owned).to_vec()).await;
        let all: Vec<&VllmWorker> = workers.iter().collect();

        // 1. Responses, with the official openai client.
        run(
            &tier.python,
            RESPONSES,
            vec![router.base.clone()],
            "RESPONSES-OK",
        )
        .await;
        let text = metrics(&client, &router.base).await;
        assert!(
            metric(
                &text,
                "switchyard_api_requests_total{api=\"responses\",status=\"ok\"}"
            )
            .is_some_and(|n| n >= 6.0),
            "the turns are counted as Responses requests:\n{text}"
        );
        assert!(
            sum(&text, "switchyard_response_map_entries") >= 6.0,
            "the router remembers every stored response's worker:\n{text}"
        );

        // 2. Messages, with the official anthropic client.
        run(
            &tier.python,
            MESSAGES,
            vec![router.base.clone(), workers[0].base.clone()],
            "MESSAGES-OK",
        )
        .await;
        let text = metrics(&client, &router.base).await;
        assert!(
            metric(
                &text,
                "switchyard_api_requests_total{api=\"messages\",status=\"ok\"}"
            )
            .is_some_and(|n| n >= 2.0),
            "{text}"
        );

        // 3. Routing truth: one conversation as chat, then as Messages,
        // then as Responses. The router renders the latter two as the chat
        // request, so it routes them to the chat's worker expecting its
        // cached blocks; vLLM renders them as chat too, so it hits them.
        // With a tool declared as each API declares it: vLLM renders the
        // three alike (its tool model, dumped; Python's `json.dumps`),
        // and so must the router, or it hashes another prompt from the
        // system turn on. `tool_choice` none: the workers run without a
        // tool-call parser (vLLM refuses `auto` then), and vLLM renders
        // the tools all the same.
        let system = "You keep the yard's ledger of arrivals and departures.";
        let user = "Log the arrival of the night freight from the coast, forty cars, two locomotives. "
            .repeat(9);
        let schema = json!({"type": "object", "properties": {
            "train": {"type": "string", "description": "The train's name, e.g. <coast freight>."},
            "cars": {"type": "integer"}}, "required": ["train"]});
        let description = "Writes one line in the ledger.";
        let (_, counted) = post(
            &client,
            &router.base,
            "/v1/messages/count_tokens",
            &json!({"model": "tiny", "system": system,
                    "messages": [{"role": "user", "content": user}],
                    "tools": [{"name": "ledger", "description": description, "input_schema": schema}],
                    "tool_choice": {"type": "none"}}),
        )
        .await;
        let n = counted["input_tokens"].as_u64().expect("a count");
        let cacheable = (n - 1) / BLOCK * BLOCK;
        assert!(cacheable >= 4 * BLOCK, "a prompt of several blocks ({n} tokens)");

        let index_before = sum(&metrics(&client, &router.base).await, "switchyard_index_blocks");
        let (chat_worker, chat) = post(
            &client,
            &router.base,
            "/v1/chat/completions",
            &json!({"model": "tiny", "max_tokens": 1, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}],
                "tools": [{"type": "function", "function": {
                    "name": "ledger", "description": description, "parameters": schema}}],
                "tool_choice": "none"}),
        )
        .await;
        assert_eq!(
            chat["usage"]["prompt_tokens"].as_u64(),
            Some(n),
            "vLLM's chat prompt is the router's count"
        );
        // The router has heard the chat's blocks from vLLM's KV events.
        wait_metrics(&client, &router.base, "the chat's blocks in the index", |t| {
            sum(t, "switchyard_index_blocks") >= index_before + (n / BLOCK) as f64
        })
        .await;

        let agentic: [(&str, &str, Value); 2] = [
            (
                "messages",
                "/v1/messages",
                json!({"model": "tiny", "max_tokens": 1, "system": system,
                       "messages": [{"role": "user", "content": user}],
                       "tools": [{"name": "ledger", "description": description, "input_schema": schema}],
                       "tool_choice": {"type": "none"}}),
            ),
            (
                "responses",
                "/v1/responses",
                json!({"model": "tiny", "max_output_tokens": 1, "store": false,
                       "instructions": system, "input": user,
                       "tools": [{"type": "function", "name": "ledger",
                                  "description": description, "parameters": schema}],
                       "tool_choice": "none"}),
            ),
        ];
        for (api, path, body) in agentic {
            let before = vllm_prefix_cache(&client, &all).await;
            let predicted_before = sum(
                &metrics(&client, &router.base).await,
                "switchyard_model_expected_hit_blocks_total",
            );
            let (worker, answer) = post(&client, &router.base, path, &body).await;
            let (hits, _) = hits_after(&client, &all, before, n).await;
            let predicted = (sum(
                &metrics(&client, &router.base).await,
                "switchyard_model_expected_hit_blocks_total",
            ) - predicted_before)
                * BLOCK as f64;
            println!(
                "agentic: {api}: {n} prompt tokens on {worker} (chat on {chat_worker}); vLLM hit {hits} tokens, the router predicted {predicted}"
            );
            assert_eq!(worker, chat_worker, "{api} goes where the chat left its blocks");
            assert_eq!(
                answer["usage"]["input_tokens"].as_u64(),
                Some(n),
                "vLLM's {api} prompt is the chat prompt's length"
            );
            assert_eq!(
                hits, cacheable as f64,
                "vLLM hit every full block of the chat's prompt for {api}"
            );
            assert_eq!(predicted, hits, "the router predicted vLLM's hits for {api}");
            if api == "messages" {
                assert!(
                    answer["usage"].get("cache_read_input_tokens").is_none(),
                    "vLLM leaves Anthropic's cache fields out without --enable-prompt-tokens-details: {}",
                    answer["usage"]
                );
            }
            if api == "responses" {
                assert_eq!(
                    answer["usage"]["input_tokens_details"]["cached_tokens"].as_u64(),
                    Some(cacheable),
                    "vLLM says so in the Responses usage"
                );
            }
        }
        let text = metrics(&client, &router.base).await;
        assert_eq!(
            sum(&text, "switchyard_kv_events_dropped_total"),
            0.0,
            "no KV event was dropped:\n{text}"
        );
    })
    .await;
}
