//! `switchyard bench tokenize`: the router's tokenizer against the
//! `tokenizers` crate, side by side in one run, ids checked equal on every
//! call.
//!
//! - fresh prompt: a 465-character English prompt, different every call
//!   (a number in front), encoded by the fast path (no segment cache), by
//!   the `tokenizers` crate, and rendered as a one-message chat and
//!   encoded with the segment cache (what the router does for a fresh
//!   chat);
//! - last turn: a ShareGPT conversation of at least 20 messages, cut to
//!   end on a user message, the earlier turns sent before (the segment
//!   cache has seen every message but the last); the last message is
//!   different every call. Encode only (the rendered text given), render
//!   plus encode, the fast path without the cache, and the `tokenizers`
//!   crate.
//!
//! - agent turn: the same conversation with eight tools declared and a
//!   tool call in every assistant turn, rendered only (tools and
//!   arguments written by the template's `tojson`, arguments parsed, as
//!   vLLM renders them), beside the plain conversation rendered only: what
//!   tools add to a render.
//!
//! Calls of the cases alternate, so the machine's noise falls on all of
//! them alike; each call is timed alone (one `Instant` pair each).

use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;
use switchyard_commands::stats::{write_json, Latency};
use switchyard_tokenizer::{ChatMessage, Tokenizer};

/// Options of `bench tokenize`.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// Timed calls per case.
    #[arg(long, default_value_t = 3000)]
    pub iterations: usize,
    /// Messages in the conversation whose last turn is encoded.
    #[arg(long, default_value_t = 20)]
    pub turns: usize,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A case's timings, in microseconds.
#[derive(Debug, Serialize)]
struct Case {
    name: &'static str,
    micros: Latency,
}

const PROMPT: &str = "Switchyard routes each request to the worker that will serve it soonest and cheapest. \
    It knows which prompt prefixes every worker holds in its KV cache, how loaded each worker is, \
    and which session a turn belongs to. Please summarise in one sentence why a cache-aware router \
    lowers time to first token for multi-turn chats, and name one risk of routing by cache alone. Thanks!";

fn fresh_prompt(i: usize) -> String {
    let mut text = format!("{i} {PROMPT}");
    text.truncate(465);
    text
}

/// The first bundled ShareGPT conversation with at least `turns` messages
/// and 10,000 to 14,000 characters in its first `turns`, cut to `turns`
/// messages or one fewer, so that it ends on a user turn.
fn long_conversation(turns: usize) -> anyhow::Result<Vec<ChatMessage>> {
    let path = switchyard_commands::data::data_path("traces/sharegpt_multiturn_3000.jsonl.gz")?;
    let file = std::fs::File::open(&path)?;
    let reader = std::io::BufReader::new(flate2::read::GzDecoder::new(file));
    for messages in switchyard_sim::workload::read_conversations(reader)? {
        if messages.len() < turns {
            continue;
        }
        let mut cut = messages[..turns].to_vec();
        while cut.last().is_some_and(|m| m.role != "user") {
            cut.pop();
        }
        let chars: usize = cut.iter().map(|m| m.content.chars().count()).sum();
        if cut.len() + 1 >= turns && (10_000..=14_000).contains(&chars) {
            return Ok(cut);
        }
    }
    anyhow::bail!(
        "no conversation of {turns} messages and 10,000 to 14,000 characters in {}",
        path.display()
    )
}

/// Eight tools of a coding agent, in the chat API's shape.
fn agent_tools() -> serde_json::Value {
    let tools: Vec<serde_json::Value> = ["read", "write", "grep", "glob", "bash", "edit", "test", "fetch"]
        .iter()
        .map(|name| {
            serde_json::json!({"type": "function", "function": {
                "name": name,
                "description": format!("The agent's {name} tool: runs it in the workspace and returns its output."),
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": "A file or folder of the workspace."},
                    "pattern": {"type": "string"},
                    "context": {"type": "integer", "minimum": 0},
                    "timeout": {"type": "number"}},
                    "required": ["path"]}}})
        })
        .collect();
    serde_json::Value::Array(tools)
}

fn timed<T>(samples: &mut Vec<f64>, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    samples.push(start.elapsed().as_secs_f64() * 1e6);
    out
}

/// Runs the benchmark.
pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let cached = Tokenizer::bundled()?;
    let uncached = Tokenizer::bundled()?.with_segment_cache(0);
    if let Some(reason) = cached.fast_path_unsupported() {
        anyhow::bail!("the bundled tokenizer is off the fast path: {reason}");
    }
    let n = args.iterations.max(1);

    // Fresh prompts.
    let (mut fast, mut reference, mut chat) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let text = fresh_prompt(i);
        let ours = timed(&mut fast, || uncached.encode(&text))?;
        let theirs = timed(&mut reference, || uncached.encode_reference(&text))?;
        anyhow::ensure!(ours == theirs, "ids differ on fresh prompt {i}");
        let message = [ChatMessage {
            role: "user".into(),
            content: text,
            tool_calls: Vec::new(),
            reasoning: None,
        }];
        timed(&mut chat, || {
            cached
                .apply_chat_template(&message, true)
                .and_then(|t| cached.encode(&t))
        })?;
    }

    // The last turn of a long conversation.
    let conversation = long_conversation(args.turns)?;
    let chars: usize = conversation.iter().map(|m| m.content.chars().count()).sum();
    for turn in (1..conversation.len()).filter(|&t| conversation[t - 1].role == "user") {
        let text = cached.apply_chat_template(&conversation[..turn], true)?;
        cached.encode(&text)?;
    }
    let last = conversation.len() - 1;
    let (mut encode, mut render_encode, mut last_fast, mut last_reference) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut messages = conversation.clone();
    for i in 0..n {
        messages[last].content = format!("{i} {}", conversation[last].content);
        let text = cached.apply_chat_template(&messages, true)?;
        let ours = timed(&mut encode, || cached.encode(&text))?;
        timed(&mut render_encode, || {
            cached
                .apply_chat_template(&messages, true)
                .and_then(|t| cached.encode(&t))
        })?;
        let plain = timed(&mut last_fast, || uncached.encode(&text))?;
        anyhow::ensure!(ours == plain, "cached ids differ on call {i}");
        if i % 10 == 0 {
            let theirs = timed(&mut last_reference, || uncached.encode_reference(&text))?;
            anyhow::ensure!(ours == theirs, "ids differ from the reference on call {i}");
        }
    }

    // The agent turn: tools and a call an assistant turn, rendered only.
    let tools = agent_tools();
    let mut agent = messages.clone();
    for (i, m) in agent
        .iter_mut()
        .enumerate()
        .filter(|(_, m)| m.role == "assistant")
    {
        m.tool_calls = vec![switchyard_tokenizer::ToolCall::function(
            "grep",
            format!(
                r#"{{"path":"src/module_{i}.rs","pattern":"fn route","context":3,"timeout":1.5}}"#
            ),
        )];
    }
    let (mut agent_render, mut plain_render) = (Vec::new(), Vec::new());
    for _ in 0..n {
        timed(&mut agent_render, || {
            cached.apply_chat_template_with_tools(&agent, Some(&tools), true)
        })?;
        timed(&mut plain_render, || {
            cached.apply_chat_template(&messages, true)
        })?;
    }

    let cases = [
        Case {
            name: "fresh 465-char prompt, fast path",
            micros: Latency::of(&mut fast),
        },
        Case {
            name: "fresh 465-char prompt, tokenizers crate",
            micros: Latency::of(&mut reference),
        },
        Case {
            name: "fresh 465-char chat message, render + encode (cache)",
            micros: Latency::of(&mut chat),
        },
        Case {
            name: "last turn, encode (cache)",
            micros: Latency::of(&mut encode),
        },
        Case {
            name: "last turn, render + encode (cache)",
            micros: Latency::of(&mut render_encode),
        },
        Case {
            name: "last turn, fast path without cache",
            micros: Latency::of(&mut last_fast),
        },
        Case {
            name: "last turn, tokenizers crate (1 call in 10)",
            micros: Latency::of(&mut last_reference),
        },
        Case {
            name: "agent turn (8 tools, a call a turn), render only",
            micros: Latency::of(&mut agent_render),
        },
        Case {
            name: "last turn, render only",
            micros: Latency::of(&mut plain_render),
        },
    ];
    println!(
        "conversation: {} messages, {chars} characters of content, the last {}; {n} calls per case",
        conversation.len(),
        conversation[last].content.chars().count()
    );
    println!("{:<56} {:>9} {:>9} {:>9}", "case (µs)", "p50", "p90", "p99");
    for case in &cases {
        println!(
            "{:<56} {:>9.1} {:>9.1} {:>9.1}",
            case.name, case.micros.p50, case.micros.p90, case.micros.p99
        );
    }
    println!(
        "agent turn / plain turn, render only: {:.2}x",
        cases[7].micros.p50 / cases[8].micros.p50
    );
    let stats = cached.segment_cache_stats();
    println!(
        "tokenizers crate / fast path, fresh prompt: {:.1}x; last turn with cache: {:.1}x; segment cache hit ratio {:.3}",
        cases[1].micros.p50 / cases[0].micros.p50,
        cases[6].micros.p50 / cases[3].micros.p50,
        stats.hits as f64 / stats.lookups.max(1) as f64
    );
    if let Some(path) = &args.json {
        write_json(
            path,
            &serde_json::json!({
                "iterations": n,
                "conversation_messages": conversation.len(),
                "conversation_chars": chars,
                "cases": cases,
                "segment_cache": {"lookups": stats.lookups, "hits": stats.hits, "entries": stats.entries},
            }),
        )?;
    }
    Ok(())
}
