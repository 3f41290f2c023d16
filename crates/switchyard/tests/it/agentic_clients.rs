//! The official `openai` client's Responses API (`responses.create`,
//! streaming and not, chained by `previous_response_id`) and the official
//! `anthropic` client's `messages.create` and `messages.stream`, against
//! `serve` in front of sim-workers. Skipped, with the reason printed, when
//! python3 or pip cannot install the clients.

use crate::openai_client::venv;
use crate::scripted_worker::{scripted_worker, Script};
use crate::support::{machine, machine_blocking, router, sim_worker, sim_worker_with, Proc};
use std::process::Command;

const RESPONSES: &str = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-test")
first = client.responses.with_raw_response.create(
    model="switchyard-sim", instructions="Answer briefly.",
    input="Tell me about the yard. " * 20, max_output_tokens=6)
holder = first.headers.get("x-switchyard-worker")
first = first.parse()
assert first.id.startswith("resp_"), first
assert first.output_text, first
previous, cached = first.id, []
for turn in range(6):
    if turn % 2 == 0:
        raw = client.responses.with_raw_response.create(
            model="switchyard-sim", input=[{"role": "user", "content": f"And turn {turn}?"}],
            previous_response_id=previous, max_output_tokens=4)
        assert raw.headers.get("x-switchyard-worker") == holder, (turn, raw.headers, holder)
        r = raw.parse()
        cached.append(r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens)
        previous = r.id
    else:
        events = list(client.responses.create(
            model="switchyard-sim", input=f"Streamed turn {turn}", previous_response_id=previous,
            max_output_tokens=4, stream=True))
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created", kinds
        assert kinds.count("response.output_text.delta") == 4, kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        previous = events[0].response.id
got = client.responses.retrieve(previous)
assert got.id == previous, got
assert min(cached) > 0.8, cached
try:
    client.responses.create(model="switchyard-sim", input="x", previous_response_id="resp_missing")
    raise SystemExit("expected NotFoundError")
except Exception as e:
    assert type(e).__name__ == "NotFoundError", repr(e)
print("RESPONSES-OK", ["%.2f" % c for c in cached])
"#;

const MESSAGES: &str = r#"
import sys
import anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-test")
msg = client.messages.create(
    model="switchyard-sim", max_tokens=6, system="Answer briefly.",
    messages=[{"role": "user", "content": "Hello there"}])
assert msg.type == "message" and msg.content[0].type == "text" and msg.content[0].text, msg
assert msg.usage.output_tokens == 6, msg.usage
tools = client.messages.create(
    model="switchyard-sim", max_tokens=4,
    tools=[{"name": "lookup", "description": "Look up", "input_schema": {"type": "object"}}],
    messages=[
        {"role": "user", "content": "Which worker?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "w0"}]},
    ])
assert tools.content[0].text, tools
with client.messages.stream(model="switchyard-sim", max_tokens=5,
        messages=[{"role": "user", "content": "Stream please"}]) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text and final.usage.output_tokens == 5, (text, final)
count = client.messages.count_tokens(model="switchyard-sim",
    messages=[{"role": "user", "content": "Hello there"}], system="Answer briefly.")
assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0), (count, msg.usage)
try:
    client.messages.create(model="switchyard-sim", max_tokens=4, messages=[])
    raise SystemExit("expected BadRequestError")
except anthropic.BadRequestError as e:
    assert e.body["type"] == "error", e.body
print("MESSAGES-OK")
"#;

/// Streams cut mid-way on the scripted worker named `cutting`: a plain
/// Messages stream and a `store: false` Responses stream reach the client
/// as one coherent answer of the full length asked; a tools request and a
/// stored response end with the error event saying why.
const RESUMED: &str = r#"
import sys
import anthropic
from openai import OpenAI
base = sys.argv[1]
claude = anthropic.Anthropic(base_url=base, api_key="sk-test", max_retries=0)
def on_cutting(start):
    for _ in range(6):
        result = start()
        if result is not None:
            return result
    raise SystemExit("no stream started on the cutting worker")
def message(**extra):
    def start():
        with claude.messages.stream(model="switchyard-sim", max_tokens=10,
                messages=[{"role": "user", "content": "tell me about yards"}], **extra) as stream:
            if stream.response.headers.get("x-switchyard-worker") != "cutting":
                stream.get_final_message()
                return None
            try:
                kinds = [e.type for e in stream]
                return kinds, stream.get_final_message(), None
            except anthropic.APIStatusError as e:
                return None, None, e
    return on_cutting(start)
kinds, final, error = message()
assert error is None, error
assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds
assert len(final.content) == 1 and final.content[0].type == "text", final
assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens", final
assert final.content[0].text.startswith(" alpha beta gamma"), final
_, _, error = message(tools=[{"name": "lookup", "input_schema": {"type": "object"}}])
assert error is not None and "tools" in str(error), error
openai = OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)
def response(**extra):
    def start():
        stream = openai.responses.create(model="switchyard-sim", input="tell me about yards",
            max_output_tokens=10, stream=True, **extra)
        events = list(stream)
        if stream.response.headers.get("x-switchyard-worker") != "cutting":
            return None
        return events
    return on_cutting(start)
events = response(store=False)
kinds = [e.type for e in events]
assert "error" not in kinds, events[-1]
assert [e.sequence_number for e in events] == list(range(len(events))), kinds
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert kinds.count("response.output_text.delta") == 10, kinds
last = events[-1]
assert last.type in ("response.completed", "response.incomplete"), kinds
assert last.response.output_text == deltas and deltas.startswith(" alpha beta gamma"), last
assert last.response.usage.output_tokens == 10, last.response.usage
events = response(store=True)
assert events[-1].type == "error" and "store: false" in events[-1].message, events[-1]
print("RESUMED-OK")
"#;

fn run(script: &str, router: &Proc, marker: &str) {
    let python = match venv() {
        Ok(p) => p,
        Err(reason) => {
            println!("skipping: {reason}");
            return;
        }
    };
    let output = Command::new(python)
        .args(["-c", script, &router.base])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.contains(marker),
        "stdout: {stdout}\nstderr: {stderr}"
    );
}

fn workers(n: usize) -> Vec<Proc> {
    (0..n)
        .map(|_| sim_worker_with(0, &["--num-blocks", "2048", "--no-delay"]))
        .collect()
}

#[test]
fn the_official_openai_client_chains_responses_through_the_router_on_their_worker() {
    let _machine = machine_blocking();
    let workers = workers(3);
    let specs: Vec<String> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| w.named(&format!("w{i}")))
        .collect();
    let router = router(&specs, &[]);
    run(RESPONSES, &router, "RESPONSES-OK");
}

#[test]
fn the_official_anthropic_client_creates_and_streams_messages_through_the_router() {
    let _machine = machine_blocking();
    let workers = workers(2);
    let specs: Vec<String> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| w.named(&format!("w{i}")))
        .collect();
    let router = router(&specs, &[]);
    run(MESSAGES, &router, "MESSAGES-OK");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_clients_see_one_whole_answer_when_a_plain_stream_is_resumed_mid_way() {
    let _machine = machine().await;
    let cutting = scripted_worker(Script::CutAgenticStream).await;
    let good = sim_worker("0");
    let router = router(
        &[format!("{cutting},name=cutting"), good.named("good")],
        &["--policy", "round-robin"],
    );
    tokio::task::spawn_blocking(move || run(RESUMED, &router, "RESUMED-OK"))
        .await
        .unwrap();
}
