//! Scripted workers: small HTTP servers on loopback (a real socket, a
//! scripted reply) that fail the way engines fail. Healthy on `/health`,
//! serving the model `switchyard-sim`; generation requests get the script.
//!
//! Shared by this crate's tests and, through `#[path]`, by the `switchyard`
//! binary's (`crates/switchyard/tests/it/main.rs`): one copy for both test
//! binaries.

use serde_json::json;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How a scripted worker answers generation requests.
// Each test binary that includes this file plays some of the scripts.
#[allow(dead_code)]
#[derive(Clone, Copy)]
pub(crate) enum Script {
    /// `500` with an error body.
    Status500,
    /// A chat stream of three content chunks, then the connection drops.
    CutChatStream,
    /// A Messages (`/v1/messages`) or Responses (`/v1/responses`, by the
    /// path) stream of three text deltas, then the connection drops.
    CutAgenticStream,
    /// Nothing: the connection stays open and silent.
    Silent,
    /// A JSON answer cut before its announced length.
    CutJson,
    /// A completions stream with two choices: choice 0 finishes, choice 1
    /// is still generating when the connection drops.
    CutTwoChoiceStream,
    /// A vLLM prefill answer (`--disagg vllm`) whose `kv_transfer_params`
    /// name a lease the worker at `127.0.0.1:PORT` never issued: what a
    /// decode worker sees of an expired or released lease.
    StaleLease(u16),
    /// A worker whose engine tokenizes differently from the router: its
    /// `/tokenize` answers other ids; a generation is a whole one-token
    /// stream (chat or completions, by its path).
    ForeignTokenizer,
}

/// A scripted worker: healthy on `/health`, serves `switchyard-sim`, has
/// no `/tokenize` (but with [`Script::ForeignTokenizer`]), and answers
/// generation requests (`POST`s) by `script`. Returns its base URL.
pub(crate) async fn scripted_worker(script: Script) -> String {
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    scripted_worker_at(loopback, script).await.unwrap()
}

/// A scripted worker listening at `addr` (any loopback address, e.g.
/// `127.0.0.2:P`), or the bind error. Returns its base URL.
pub(crate) async fn scripted_worker_at(
    addr: std::net::SocketAddr,
    script: Script,
) -> std::io::Result<String> {
    let listener = TcpListener::bind(addr).await?;
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(serve_one(socket, script));
        }
    });
    Ok(base)
}

async fn serve_one(mut socket: TcpStream, script: Script) {
    // Read the head and the body (Content-Length) of one request.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let Ok(n) = socket.read(&mut chunk).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let mut words = head.split_whitespace();
    let method = words.next().unwrap_or("get").to_owned();
    let path = words.next().unwrap_or("/").to_owned();
    let reply = |status: &str, body: &str| {
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    // What the router reads of a worker is a GET (or its tokenizer check);
    // only a generation follows the script.
    let out = match (method.as_str(), path.as_str()) {
        ("get", "/health") => reply("200 OK", "{}"),
        ("get", "/v1/models") => reply(
            "200 OK",
            r#"{"object":"list","data":[{"id":"switchyard-sim"}]}"#,
        ),
        ("get", "/get_server_info") => reply("200 OK", "{}"),
        ("post", "/tokenize") if matches!(script, Script::ForeignTokenizer) => reply(
            "200 OK",
            r#"{"count":3,"max_model_len":4096,"tokens":[101,102,103]}"#,
        ),
        ("get", _) | ("post", "/tokenize") => reply("404 Not Found", r#"{"detail":"Not Found"}"#),
        _ => match script {
            Script::Silent => {
                // The script itself: an hour of silence (a fixed sleep is
                // what is specified, not a wait for something to happen).
                tokio::time::sleep(Duration::from_secs(3600)).await;
                return;
            }
            Script::StaleLease(port) => reply(
                "200 OK",
                &json!({
                    "id": "cmpl-stale", "object": "text_completion", "created": 1,
                    "model": "switchyard-sim",
                    "choices": [{"index": 0, "text": " x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    "kv_transfer_params": {
                        "do_remote_prefill": true, "do_remote_decode": false,
                        "remote_block_ids": [1],
                        "remote_engine_id": "switchyard-sim-00c0ffee00c0ffee",
                        "remote_request_id": "req-stale",
                        "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1,
                        "switchyard_lease": "1.000102030405060708090a0b0c0d0e0f"
                    }
                })
                .to_string(),
            ),
            Script::CutJson => String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n{\"id\": \"cmpl-cut\", \"choi",
            ),
            Script::ForeignTokenizer => {
                let event = if path == "/v1/chat/completions" {
                    json!({"id": "chatcmpl-foreign", "object": "chat.completion.chunk", "created": 2, "model": "switchyard-sim", "choices": [{"index": 0, "delta": {"role": "assistant", "content": " omega"}, "finish_reason": "stop"}]})
                } else {
                    json!({"id": "cmpl-foreign", "object": "text_completion", "created": 2, "model": "switchyard-sim", "choices": [{"index": 0, "text": " omega", "finish_reason": "stop"}]})
                };
                let mut out = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
                );
                for data in [format!("data: {event}\n\n"), "data: [DONE]\n\n".to_owned()] {
                    out.push_str(&format!("{:x}\r\n{data}\r\n", data.len()));
                }
                out.push_str("0\r\n\r\n");
                out
            }
            Script::Status500 => reply(
                "500 Internal Server Error",
                r#"{"error":{"message":"scripted failure","type":"internal_error","code":500}}"#,
            ),
            Script::CutTwoChoiceStream => {
                let mut out = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                let chunk = |index: u32, text: &str, finish: Option<&str>| {
                    json!({"id": "cmpl-two", "object": "text_completion", "created": 1, "model": "switchyard-sim", "choices": [{"index": index, "text": text, "finish_reason": finish}]})
                };
                for e in [
                    chunk(0, " a", None),
                    chunk(1, " b", None),
                    chunk(0, "", Some("stop")),
                    chunk(1, " c", None),
                ] {
                    let data = format!("data: {e}\n\n");
                    out.push_str(&format!("{:x}\r\n{data}\r\n", data.len()));
                }
                // The connection drops with choice 1 unfinished.
                out
            }
            Script::CutAgenticStream => {
                let mut out = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                let words = [" alpha", " beta", " gamma"];
                let mut events = Vec::new();
                if path == "/v1/messages" {
                    events.push(("message_start", json!({"type": "message_start", "message": {"id": "msg_scripted", "type": "message", "role": "assistant", "model": "switchyard-sim", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 5, "output_tokens": 0}}})));
                    events.push(("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                    for word in words {
                        events.push(("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}})));
                    }
                } else {
                    let response = json!({"id": "resp_scripted", "object": "response", "created_at": 1234, "model": "switchyard-sim", "status": "in_progress", "output": [], "usage": null, "error": null, "incomplete_details": null, "instructions": null, "metadata": {}, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0});
                    events.push(("response.created", json!({"type": "response.created", "sequence_number": 0, "response": response})));
                    events.push(("response.in_progress", json!({"type": "response.in_progress", "sequence_number": 1, "response": response})));
                    events.push(("response.output_item.added", json!({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": {"type": "message", "id": "msg_scripted", "status": "in_progress", "role": "assistant", "content": []}})));
                    events.push(("response.content_part.added", json!({"type": "response.content_part.added", "sequence_number": 3, "item_id": "msg_scripted", "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})));
                    for (i, word) in words.into_iter().enumerate() {
                        events.push(("response.output_text.delta", json!({"type": "response.output_text.delta", "sequence_number": 4 + i, "item_id": "msg_scripted", "output_index": 0, "content_index": 0, "delta": word, "logprobs": []})));
                    }
                }
                for (name, e) in events {
                    let data = format!("event: {name}\ndata: {e}\n\n");
                    out.push_str(&format!("{:x}\r\n{data}\r\n", data.len()));
                }
                // A half event, then the connection drops (no final chunk).
                out.push_str("10\r\nevent: content_\r\n");
                out
            }
            Script::CutChatStream => {
                let mut out = String::from(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                let mut events = vec![
                    json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1234, "model": "switchyard-sim", "choices": [{"index": 0, "delta": {"role": "assistant", "content": " alpha"}, "finish_reason": null}]}),
                ];
                for word in [" beta", " gamma"] {
                    events.push(json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1234, "model": "switchyard-sim", "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": null}]}));
                }
                for e in events {
                    let data = format!("data: {e}\n\n");
                    out.push_str(&format!("{:x}\r\n{data}\r\n", data.len()));
                }
                // A half event, then the connection drops (no final chunk).
                out.push_str("10\r\ndata: {\"id\": \"ch\r\n");
                out
            }
        },
    };
    let _ = socket.write_all(out.as_bytes()).await;
    let _ = socket.flush().await;
    // Dropping the socket closes the connection.
}
