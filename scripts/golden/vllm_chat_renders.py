"""Writes data/golden/vllm-0.32-chat-renders.jsonl: how vLLM renders
requests of each API into the prompt its engine caches, for the router's
test that it renders (and so hashes) the same prompt
(`switchyard-server`, `request::prompt` tests).

Each case is a request body and the text vLLM's own code renders from it
with the bundled Qwen3 chat template: its API's conversion to chat
messages (chat: as sent; Anthropic Messages:
`AnthropicServingMessages.to_chat_completion_request`; Responses:
`construct_input_messages` and `construct_tool_dicts`), then
`parse_chat_messages` (content parts, tool-call arguments, Claude Code's
billing header), then transformers' `apply_chat_template`. No engine is
started: only the conversion and the template run.

Run it with the Python of vLLM's environment (the real-engine tier's,
`~/.cache/switchyard/engines/vllm-*`), from the repository root:

    ~/.cache/switchyard/engines/vllm-0.32.0-*/bin/python scripts/golden/vllm_chat_renders.py
"""

import json
import pathlib
import shutil
import tempfile
import types

import vllm
from transformers import AutoTokenizer
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import (
    construct_input_messages,
    construct_tool_dicts,
)
from vllm.renderers import chat_utils

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "data" / "golden" / "vllm-0.32-chat-renders.jsonl"

CLAUDE_HEADER = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=9f2a1;"

CASES = [
    ("chat-tools-and-calls", "chat", {
        "model": "m",
        "messages": [
            {"role": "system", "content": [
                {"type": "text", "text": CLAUDE_HEADER},
                {"type": "text", "text": "You run the yard."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Move car <42> & report."},
                {"type": "text", "text": ""},
                {"type": "text", "text": "Then stop."}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {
                    "name": "move", "arguments": "{\"car\":42,\"to\":\"track é\",\"speed\":1.50,\"eta\":1e-7}"}},
                {"id": "b", "type": "function", "function": {"name": "report", "arguments": ""}},
                {"id": "c", "type": "function", "function": {"name": "bad", "arguments": "{oops"}}]},
            {"role": "tool", "tool_call_id": "a", "content": [
                {"type": "text", "text": "moved"}, {"type": "text", "text": "at 5 km/h"}]},
            {"role": "tool", "tool_call_id": "b", "content": "ok"},
            {"role": "assistant", "content": "Done: <b>moved</b>."},
            {"role": "user", "content": "Thanks."},
        ],
        "tools": [
            {"type": "function", "extra": 1, "function": {
                "name": "move", "strict": True, "x": 2,
                "description": "Moves a car \"now\".\nCarefully.",
                "parameters": {"type": "object", "properties": {
                    "to": {"type": "string"}, "car": {"type": "integer"}},
                    "required": ["car"]}}},
            {"type": "function", "defer_loading": True, "function": {"name": "report"}},
        ],
    }),
    ("messages-agent-turn", "messages", {
        "model": "m", "max_tokens": 8,
        "system": [
            {"type": "text", "text": CLAUDE_HEADER},
            {"type": "text", "text": "You are the yard's agent."},
            {"type": "text", "text": " Use the tools."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<reminder>track 4 is closed</reminder>"},
                {"type": "text", "text": "Which cars wait on track 7?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Reading the ledger."},
                {"type": "tool_use", "id": "toolu_1", "name": "ledger",
                 "input": {"track": 7, "fields": ["car", "cargo"], "ratio": 0.25}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "car 1101: grain"},
                    {"type": "text", "text": "car 1102: coal"}]},
                {"type": "text", "text": "Summarize."}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_2", "name": "ledger", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "empty"}]},
        ],
        "tools": [
            {"name": "ledger", "description": "Reads the ledger.",
             "input_schema": {"properties": {"track": {"type": "integer"}}}},
            {"name": "whistle", "input_schema": {"type": "object"}, "strict": True},
        ],
    }),
    ("messages-string-system", "messages", {
        "model": "m", "max_tokens": 8,
        "system": CLAUDE_HEADER + "\nYou keep the yard's ledger.",
        "messages": [{"role": "user", "content": "Hi"}],
    }),
    ("responses-agent-items", "responses", {
        "model": "m",
        "instructions": "You run the yard.",
        "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "Plan the shunting."},
                {"type": "input_text", "text": "Then act."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Two moves."}]},
            {"type": "function_call", "call_id": "c1", "name": "move",
             "arguments": "{\"car\":1}"},
            {"type": "function_call", "call_id": "c2", "name": "move",
             "arguments": "{\"car\":2,\"to\":\"t\u00e9\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "moved 1"},
            {"type": "function_call_output", "call_id": "c2", "output": "moved 2"},
            {"type": "function_call", "call_id": "c3", "name": "report", "arguments": "{}"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Both moved.", "annotations": []}]},
            {"role": "user", "content": "Good."},
        ],
        "tools": [
            {"type": "function", "name": "move", "description": "Moves a car.",
             "parameters": {"type": "object", "properties": {"car": {"type": "integer"}}},
             "strict": True},
            {"type": "function", "name": "report", "parameters": None, "strict": False},
            {"type": "web_search"},
        ],
    }),
    # An agent loop after its user query: Qwen3's template renders each
    # assistant turn's reasoning there (vLLM hands it over as
    # `reasoning_content`).
    ("chat-reasoning-loop", "chat", {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Fix the failing test."},
            {"role": "assistant", "content": "", "reasoning": "Read the test first.",
             "tool_calls": [{"id": "a", "type": "function", "function": {
                 "name": "read", "arguments": "{\"path\":\"tests/a.rs\"}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "assert_eq!(f(), 2);"},
        ],
    }),
    ("messages-thinking-loop", "messages", {
        "model": "m", "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Fix the failing test."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Read the test ", "signature": "s"},
                {"type": "thinking", "thinking": "first.", "signature": "t"},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "tests/a.rs"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "assert_eq!(f(), 2);"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "f returns 1.", "signature": "u"},
                {"type": "text", "text": "Found it."},
                {"type": "tool_use", "id": "toolu_2", "name": "edit", "input": {"path": "src/f.rs"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "ok"}]},
        ],
    }),
    ("responses-reasoning-loop", "responses", {
        "model": "m",
        "input": [
            {"role": "user", "content": "Fix the failing test."},
            {"type": "reasoning", "id": "rs_1", "summary": [
                {"type": "summary_text", "text": "Read the test first."}]},
            {"type": "function_call", "call_id": "c1", "name": "read",
             "arguments": "{\"path\": \"tests/a.rs\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "assert_eq!(f(), 2);"},
            {"type": "reasoning", "id": "rs_2", "summary": [],
             "content": [{"type": "reasoning_text", "text": "f returns 1."}]},
            {"type": "function_call", "call_id": "c2", "name": "edit", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c2", "output": "ok"},
        ],
    }),
]


def tokenizer():
    directory = tempfile.mkdtemp()
    shutil.copy(ROOT / "data/tokenizers/qwen3-tokenizer.json", f"{directory}/tokenizer.json")
    shutil.copy(ROOT / "data/tokenizers/qwen3-tokenizer_config.json",
                f"{directory}/tokenizer_config.json")
    return AutoTokenizer.from_pretrained(directory)


def render(tok, messages, tools):
    # Only what parse_chat_messages reads of the model's config.
    model_config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)
    conversation, _, _ = chat_utils.parse_chat_messages(messages, model_config, "string")
    return tok.apply_chat_template(conversation, tools=tools, tokenize=False,
                                   add_generation_prompt=True)


def chat_inputs(api, body):
    if api == "messages":
        body = AnthropicServingMessages.to_chat_completion_request(
            AnthropicMessagesRequest(**body)).model_dump(exclude_none=True)
        api = "chat"
    if api == "chat":
        request = ChatCompletionRequest(**body)
        tools = None if request.tools is None else [t.model_dump() for t in request.tools]
        return request.messages, tools
    request = ResponsesRequest(**body)
    messages = construct_input_messages(request_instructions=request.instructions,
                                        request_input=request.input)
    return messages, construct_tool_dicts(request.tools, request.tool_choice)


def main():
    tok = tokenizer()
    with OUT.open("w") as out:
        for name, api, body in CASES:
            messages, tools = chat_inputs(api, body)
            text = render(tok, messages, tools)
            out.write(json.dumps({"name": name, "api": api, "body": body, "rendered": text,
                                  "vllm": vllm.__version__}) + "\n")
    print(f"wrote {len(CASES)} cases to {OUT}")


if __name__ == "__main__":
    main()
