use super::*;
use std::borrow::Cow;
use switchyard_wire::engine_metrics::EngineFamily;
use switchyard_wire::openai::{Api, Choice, Completion, Usage};
use switchyard_wire::sse::{json_event, DONE_EVENT};

/// A completions chunk adding `text` (and `ids`, when given).
fn chunk(text: &str, ids: Option<Vec<u32>>, finish: Option<&str>) -> Vec<u8> {
    json_event(&Completion {
        id: "cmpl-1".into(),
        object: Cow::Borrowed(Api::Completions.chunk_object()),
        created: 1,
        model: "m".into(),
        choices: vec![Choice {
            text: Some(text.into()),
            token_ids: ids,
            finish_reason: finish.map(Cow::Borrowed),
            ..Choice::default()
        }],
        usage: None,
    })
}

fn usage_chunk() -> Vec<u8> {
    json_event(&Completion {
        choices: Vec::<Choice<'_>>::new(),
        usage: Some(Usage::new(4, 0, 3)),
        ..Completion::default()
    })
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn a_frame_split_mid_event_is_counted_when_the_event_completes() {
    let t0 = Instant::now();
    let mut tally = StreamTally::new(t0);
    let second = chunk(" b", None, None);
    let (head, tail) = second.split_at(second.len() / 2);
    let mut frame = chunk(" a", None, None);
    frame.extend_from_slice(head);
    tally.frame(&frame, t0 + ms(10));
    assert_eq!(tally.tokens, 1, "half an event is not a token yet");
    assert_eq!(tally.ttft_ms, Some(10.0));
    tally.frame(tail, t0 + ms(30));
    assert_eq!(tally.tokens, 2);
    assert_eq!(tally.itl_ms, vec![20.0]);
    let mut rest = chunk("", None, Some("length"));
    rest.extend_from_slice(&usage_chunk());
    rest.extend_from_slice(DONE_EVENT);
    tally.frame(&rest, t0 + ms(40));
    assert_eq!(tally.tokens, 2, "finish and usage chunks add no token");
    assert_eq!(tally.itl_ms, vec![20.0]);
    assert!(tally.done && !tally.failed);
}

#[test]
fn the_counts_do_not_depend_on_the_framing() {
    let mut stream = Vec::new();
    for word in [" a", " b", " c"] {
        stream.extend_from_slice(&chunk(word, None, None));
    }
    stream.extend_from_slice(&chunk(" d e", Some(vec![7, 8]), None));
    stream.extend_from_slice(&chunk("", None, Some("length")));
    stream.extend_from_slice(DONE_EVENT);
    let t0 = Instant::now();
    for size in [1, 7, 64, stream.len()] {
        let mut tally = StreamTally::new(t0);
        for (i, frame) in stream.chunks(size).enumerate() {
            tally.frame(frame, t0 + ms(i as u64 + 1));
        }
        assert_eq!(tally.tokens, 5, "frames of {size} bytes");
        assert!(tally.done && !tally.failed, "frames of {size} bytes");
    }
}

#[test]
fn an_error_event_or_an_oversized_event_fails_the_stream() {
    let t0 = Instant::now();
    let mut tally = StreamTally::new(t0);
    tally.frame(&chunk(" a", None, None), t0);
    tally.frame(b"data: {\"error\": {\"message\": \"gone\"}}\n\n", t0);
    assert!(tally.failed);
    let mut tally = StreamTally::new(t0);
    tally.frame(&vec![b'x'; MAX_EVENT_BYTES + 1], t0);
    assert!(tally.failed && !tally.done);
}

use switchyard_sim::workload::{PromptSpec, Turn};

fn session(id: u64, arrival_ms: f64, turns: usize) -> Session {
    Session {
        id,
        arrival_ms,
        think_time_ms: 0.0,
        turns: (0..turns)
            .map(|_| Turn {
                prompt: PromptSpec::Mooncake {
                    hash_ids: vec![id].into(),
                    tokens: 20,
                },
                output_tokens: 7,
                pause_ms: None,
                spawn: Vec::new(),
            })
            .collect(),
        flow: switchyard_sim::workload::SessionFlow::default(),
    }
}

#[test]
fn sessions_become_token_id_completions_with_their_arrival_times() {
    let sessions = [session(3, 0.0, 1), session(4, 250.5, 1)];
    let (requests, arrivals) = session_requests(&sessions, Some("m")).unwrap();
    assert_eq!(arrivals, vec![0.0, 250.5]);
    let body: Value = serde_json::from_slice(&requests[1].body).unwrap();
    assert_eq!(requests[1].path, "/v1/completions");
    assert_eq!(body["max_tokens"], 7);
    assert_eq!(body["stream"], true);
    assert_eq!(body["model"], "m");
    let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
    assert_eq!(prompt, sessions[1].turns[0].prompt.tokens());
    assert!(session_requests(&[session(5, 0.0, 2)], None).is_err());
}

/// Three conversations (2, 3 and 1 user turns) as a ShareGPT file in
/// the temporary directory, named for the test.
fn sharegpt_file(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "switchyard-loadgen-{}-{name}.jsonl",
        std::process::id()
    ));
    let mut file = std::fs::File::create(&path).unwrap();
    for (id, turns) in [("a", 2), ("b", 3), ("c", 1)] {
        let conversations: Vec<Value> = (0..turns)
            .flat_map(|k| {
                [
                    json!({"from": "human", "value": format!("{id} asks {k}")}),
                    json!({"from": "gpt", "value": format!("{id} answers {k}")}),
                ]
            })
            .collect();
        let line = json!({"id": id, "conversations": conversations});
        std::io::Write::write_all(&mut file, format!("{line}\n").as_bytes()).unwrap();
    }
    path
}

#[test]
fn each_sharegpt_turn_names_its_sessions_next_turn() {
    let file = sharegpt_file("chain");
    let requests = sharegpt_requests(&file, 100, 8, None).unwrap();
    let order: Vec<_> = requests
        .iter()
        .map(|r| r.session.as_deref().unwrap())
        .collect();
    assert_eq!(order, ["a", "b", "c", "a", "b", "b"]);
    let next: Vec<_> = requests.iter().map(|r| r.next_turn).collect();
    assert_eq!(next, [Some(3), Some(4), None, None, Some(5), None]);
    assert_eq!(first_turns(&requests), [0, 1, 2]);
    // Cut after five turns, b's third turn is gone and nothing names it.
    let cut = sharegpt_requests(&file, 5, 8, None).unwrap();
    std::fs::remove_file(file).unwrap();
    assert_eq!(cut.len(), 5);
    assert_eq!(cut[4].next_turn, None);
}

/// Closed-loop pacing never has two turns of one session in flight, and
/// sends each session's turns in order (a user waits for the answer).
#[tokio::test]
async fn closed_loop_sends_a_sessions_next_turn_only_after_its_answer() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // (session, turn text) in the order answered, and whether any
    // session ever had two requests in flight.
    let seen = Arc::new(Mutex::new((
        Vec::<String>::new(),
        BTreeMap::<String, u32>::new(),
        false,
    )));
    let server_seen = seen.clone();
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            let seen = server_seen.clone();
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut read = BufReader::new(read);
                loop {
                    let (mut session, mut length) = (String::new(), 0usize);
                    loop {
                        let mut line = String::new();
                        if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("x-session-id:") {
                            session = v.trim().to_owned();
                        } else if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap();
                        } else if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    read.read_exact(&mut body).await.unwrap();
                    {
                        let mut s = seen.lock().unwrap();
                        let running = s.1.entry(session.clone()).or_insert(0);
                        *running += 1;
                        if *running > 1 {
                            s.2 = true;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let body: Value = serde_json::from_slice(&body).unwrap();
                    {
                        let mut s = seen.lock().unwrap();
                        *s.1.get_mut(&session).unwrap() -= 1;
                        let last = body["messages"].as_array().unwrap().last().unwrap().clone();
                        s.0.push(last["content"].as_str().unwrap().to_owned());
                    }
                    let event = "data: [DONE]\n\n";
                    let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
                            event.len()
                        );
                    write.write_all(head.as_bytes()).await.unwrap();
                    write.write_all(event.as_bytes()).await.unwrap();
                }
            });
        }
    });
    let file = sharegpt_file("closed-loop");
    let requests = sharegpt_requests(&file, 100, 8, None).unwrap();
    std::fs::remove_file(file).unwrap();
    let report = run_load(&url, requests, Pacing::Concurrency(8), true, &[], false).await;
    assert_eq!((report.requests, report.errors), (6, 0));
    let (answered, _, overlapped) = std::mem::take(&mut *seen.lock().unwrap());
    assert!(
        !overlapped,
        "two turns of one session were in flight at once"
    );
    let of = |id: &str| -> Vec<String> {
        answered
            .iter()
            .filter(|t| t.starts_with(id))
            .cloned()
            .collect()
    };
    assert_eq!(of("b"), ["b asks 0", "b asks 1", "b asks 2"]);
    assert_eq!(of("a"), ["a asks 0", "a asks 1"]);
}

/// Agent sessions small enough to read: every call's answer, tool output
/// and fan-out fixed, half the calls fanning out into two sub-agents.
fn small_agents() -> AgenticConfig {
    use switchyard_sim::workload::agentic::{AgentKind, FanOut, LogNormal};
    AgenticConfig {
        sessions: 12,
        seed: 1,
        kinds: vec![AgentKind {
            prefix_tokens: 50,
            weight: 1.0,
        }],
        task_tokens: LogNormal::fixed(10.0),
        calls: LogNormal::fixed(4.0),
        assistant_tokens: LogNormal::fixed(6.0),
        tool_output_tokens: LogNormal::fixed(8.0),
        tool_gap_s: LogNormal::fixed(0.2),
        fan_out: FanOut {
            probability: 0.5,
            min_agents: 2,
            max_agents: 2,
            calls: LogNormal::fixed(2.0),
            task_tokens: LogNormal::fixed(3.0),
        },
        ..AgenticConfig::default()
    }
}

fn messages_of(request: &PreparedRequest) -> Vec<Value> {
    let body: Value = serde_json::from_slice(&request.body).unwrap();
    body["messages"].as_array().unwrap().clone()
}

#[test]
fn agent_sessions_become_chat_calls_with_their_pauses_and_sub_agents() {
    let vocabulary = crate::agentic::vocabulary().unwrap();
    let plans: Vec<AgentSession> = agent_sessions(small_agents(), &vocabulary).collect();
    let (requests, plan) =
        agentic_requests(small_agents(), &vocabulary, usize::MAX, 5, 2.0, Some("m")).unwrap();
    let calls = |s: &AgentSession| -> usize {
        fn count(s: &AgentSession) -> usize {
            s.calls.len()
                + s.calls
                    .iter()
                    .flat_map(|c| &c.spawn)
                    .map(count)
                    .sum::<usize>()
        }
        count(s)
    };
    assert_eq!(requests.len(), plans.iter().map(calls).sum::<usize>());
    assert_eq!(plan.pause_ms.len(), requests.len());
    // Each session opens at its arrival, divided by the rate scale.
    let starts: Vec<f64> = plan.starts.iter().map(|s| s.1).collect();
    let arrivals: Vec<f64> = plans.iter().map(|p| p.arrival_ms / 2.0).collect();
    assert_eq!(starts, arrivals);
    let mut fan_outs = 0;
    for (session, &(head, _)) in plans.iter().zip(&plan.starts) {
        // The session's calls, in order along `next_turn`.
        let mut at = Some(head);
        for (k, call) in session.calls.iter().enumerate() {
            let i = at.expect("a request for every call");
            let request = &requests[i];
            assert_eq!(request.path, "/v1/chat/completions");
            let id = format!("agent-{}", session.id);
            assert_eq!(request.session.as_deref(), Some(id.as_str()));
            let body: Value = serde_json::from_slice(&request.body).unwrap();
            assert_eq!(
                (body["max_tokens"].as_u64(), &body["model"]),
                (Some(5), &json!("m"))
            );
            let expected: Vec<Value> = vocabulary
                .messages(session, k)
                .iter()
                .enumerate()
                .map(|(at, m)| agent_message(at, m))
                .collect();
            assert_eq!(messages_of(request), expected);
            // Every tool output names a call, as the chat API requires.
            for m in &expected {
                assert_eq!(m["role"] == "tool", m.get("tool_call_id").is_some(), "{m}");
            }
            assert_eq!(plan.pause_ms[i], call.pause_ms);
            // Sub-agents open with this call's messages and its answer.
            assert_eq!(plan.spawns[i].len(), call.spawn.len());
            for &child in &plan.spawns[i] {
                fan_outs += 1;
                let child = messages_of(&requests[child]);
                assert_eq!(child[..expected.len()], expected[..]);
                let answer = vocabulary.content_text(&session.messages[call.prompt_messages]);
                assert_eq!(
                    child[expected.len()],
                    json!({"role": "assistant", "content": answer})
                );
                assert_eq!(child[expected.len() + 1]["role"], "user");
            }
            at = request.next_turn;
        }
        assert_eq!(at, None);
    }
    assert!(fan_outs >= 4, "{fan_outs}");
    // A budget takes whole sessions, sub-agents included.
    let (one, plan) = agentic_requests(small_agents(), &vocabulary, 1, 5, 1.0, None).unwrap();
    assert_eq!((one.len(), plan.starts.len()), (calls(&plans[0]), 1));
}

/// A chat server on loopback that answers each request with `[DONE]`
/// after `delay`, and logs each request's last message's content when it
/// arrives and when it is answered. Returns its base URL and the log.
async fn logging_chat_server(
    delay: Duration,
) -> (String, Arc<Mutex<Vec<(String, Instant, Instant)>>>) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let server_log = log.clone();
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            let log = server_log.clone();
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut read = BufReader::new(read);
                loop {
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap();
                        } else if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    read.read_exact(&mut body).await.unwrap();
                    let arrived = Instant::now();
                    tokio::time::sleep(delay).await;
                    let body: Value = serde_json::from_slice(&body).unwrap();
                    let last = body["messages"].as_array().unwrap().last().unwrap().clone();
                    let text = last["content"].as_str().unwrap().to_owned();
                    log.lock().unwrap().push((text, arrived, Instant::now()));
                    let event = "data: [DONE]\n\n";
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
                        event.len()
                    );
                    write.write_all(head.as_bytes()).await.unwrap();
                    write.write_all(event.as_bytes()).await.unwrap();
                }
            });
        }
    });
    (url, log)
}

/// Session pacing sends a call's sub-sessions together once it is
/// answered, and the session's next call only after they have all ended
/// and its pause has passed.
#[tokio::test]
async fn session_pacing_starts_sub_sessions_together_and_waits_for_them() {
    let (url, log) = logging_chat_server(Duration::from_millis(20)).await;
    let call = |text: &str, session: &str, next_turn: Option<usize>| PreparedRequest {
        tenant: None,
        path: "/v1/chat/completions",
        body: serde_json::to_vec(&json!({
            "messages": [{"role": "user", "content": text}],
            "stream": true,
        }))
        .unwrap()
        .into(),
        session: Some(session.to_owned()),
        next_turn,
    };
    // p0 starts a (a0, a1) and b (b0); p1 follows them all, 100 ms on.
    let requests = vec![
        call("p0", "p", Some(4)),
        call("a0", "a", Some(2)),
        call("a1", "a", None),
        call("b0", "b", None),
        call("p1", "p", None),
    ];
    let plan = SessionPlan {
        starts: vec![(0, 0.0)],
        pause_ms: vec![100.0, 10.0, 10.0, 10.0, 0.0],
        spawns: vec![vec![1, 3], vec![], vec![], vec![], vec![]],
    };
    let report = run_load(
        &url,
        requests,
        Pacing::Sessions(Arc::new(plan)),
        true,
        &[],
        false,
    )
    .await;
    assert_eq!((report.requests, report.errors), (5, 0));
    let log = std::mem::take(&mut *log.lock().unwrap());
    let at = |text: &str| log.iter().find(|l| l.0 == text).expect(text).clone();
    let (p0, a0, a1, b0, p1) = (at("p0"), at("a0"), at("a1"), at("b0"), at("p1"));
    // Together, once p0 is answered.
    assert!(a0.1 >= p0.2 && b0.1 >= p0.2);
    assert!(a0.1.max(b0.1) - a0.1.min(b0.1) < Duration::from_millis(15));
    // a's second call after a's first answer and its pause.
    assert!(a1.1 >= a0.2 + Duration::from_millis(10));
    // p1 after the last sub-session ended and p0's pause.
    assert!(p1.1 >= a1.2 + Duration::from_millis(100), "{log:?}");
}

/// Nothing listens on the port: every request fails at once, which is
/// enough to see which requests the schedule sent.
#[tokio::test]
async fn arrivals_pacing_sends_only_the_scheduled_requests_and_records_lateness() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (requests, _) = session_requests(
        &[session(1, 0.0, 1), session(2, 0.0, 1), session(3, 0.0, 1)],
        None,
    )
    .unwrap();
    let report = run_load(
        &format!("http://127.0.0.1:{port}"),
        requests,
        Pacing::Arrivals(vec![0.0, 1.0].into()),
        true,
        &[],
        false,
    )
    .await;
    assert_eq!((report.requests, report.errors), (2, 2));
    assert!(report.send_lag_ms.is_some());
    let closed = run_load(
        &format!("http://127.0.0.1:{port}"),
        Vec::new(),
        Pacing::Concurrency(1),
        true,
        &[],
        false,
    )
    .await;
    assert!(closed.send_lag_ms.is_none());
}

/// A `/metrics` server on loopback whose n-th answer (from 0) is
/// `page(n)`: a `200` with that page, or a `404` for `None`. Returns
/// its base URL.
async fn metrics_server(page: impl Fn(usize) -> Option<String> + Send + Sync + 'static) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let page = Arc::new(page);
    let served = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (page, served) = (page.clone(), served.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let (status, body) = match page(served.fetch_add(1, Ordering::SeqCst)) {
                    Some(body) => ("200 OK", body),
                    None => ("404 Not Found", String::new()),
                };
                let reply = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(reply.as_bytes()).await;
            });
        }
    });
    base
}

/// vLLM's prefix-cache counters as its page shows them, two engines.
fn vllm_page(queries: u64, hits: u64) -> String {
    format!(
        "# TYPE vllm:prefix_cache_queries_total counter\n\
             vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"tiny\"}} {queries}.0\n\
             vllm:prefix_cache_queries_total{{engine=\"1\",model_name=\"tiny\"}} 0.0\n\
             vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"tiny\"}} {hits}.0\n\
             vllm:prefix_cache_hits_total{{engine=\"1\",model_name=\"tiny\"}} 0.0\n"
    )
}

fn closed_port() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("http://127.0.0.1:{port}")
}

#[tokio::test]
async fn the_hit_rate_comes_from_vllms_own_counters_over_the_run() {
    // 75,303 queried and 44,416 hit before; 1,000 and 600 more after.
    let vllm = metrics_server(|n| {
        Some(vllm_page(
            75_303 + 1_000 * n as u64,
            44_416 + 600 * n as u64,
        ))
    })
    .await;
    let report = run_load(
        &vllm,
        Vec::new(),
        Pacing::Concurrency(1),
        true,
        &[format!("{vllm}/")],
        false,
    )
    .await;
    assert_eq!(report.hit_rate, Some(0.6));
    assert_eq!(report.hit_rate_unavailable, None);
}

#[tokio::test]
async fn workers_whose_counters_cannot_be_read_are_named_with_the_reason() {
    let vllm = metrics_server(|n| Some(vllm_page(1_000 * (n as u64 + 1), 500))).await;
    let foreign = metrics_server(|_| Some("process_cpu_seconds_total 1.5\n".to_owned())).await;
    let missing = metrics_server(|_| None).await;
    let closed = closed_port();
    let workers = [vllm, foreign.clone(), missing.clone(), closed.clone()];
    let report = run_load(
        &workers[0],
        Vec::new(),
        Pacing::Concurrency(1),
        true,
        &workers,
        false,
    )
    .await;
    assert_eq!(report.hit_rate, None);
    let why = report.hit_rate_unavailable.clone().unwrap();
    assert!(
        why.contains(&format!("{foreign}: no prefix-cache counters in /metrics")),
        "{why}"
    );
    assert!(
        why.contains(&format!("{missing}: /metrics answered 404 Not Found")),
        "{why}"
    );
    assert!(
        why.contains(&format!("{closed}: cannot read /metrics: ")),
        "{why}"
    );
    assert!(!why.contains("--worker-metrics"), "{why}");
    assert_eq!(
        why.matches("; ").count(),
        2,
        "three workers named, the good one not: {why}"
    );
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["hit_rate"], Value::Null);
    assert_eq!(json["hit_rate_unavailable"], why.as_str());
}

fn reading(family: EngineFamily, queried: f64, hit: f64) -> CounterReading {
    Ok(Some(PrefixCacheCounters {
        family,
        queried_tokens: queried,
        hit_tokens: hit,
    }))
}

#[test]
fn counters_that_appear_during_the_run_count_from_zero() {
    // SGLang creates its counters' series at the first request.
    let workers = ["http://sglang".to_owned(), "http://sim".to_owned()];
    let before = [Ok(None), reading(EngineFamily::SimWorker, 100.0, 0.0)];
    let after = [
        reading(EngineFamily::Sglang, 300.0, 100.0),
        reading(EngineFamily::SimWorker, 200.0, 100.0),
    ];
    assert_eq!(hit_rate_over(&workers, &before, &after), Ok(0.5));
}

#[test]
fn no_hit_rate_without_workers_prompts_or_with_counters_that_went_down() {
    assert_eq!(
        hit_rate_over(&[], &[], &[]),
        Err("no --worker-metrics".to_owned())
    );
    let one = ["http://w".to_owned()];
    let same = [reading(EngineFamily::Vllm, 10.0, 5.0)];
    assert_eq!(
        hit_rate_over(&one, &same, &same),
        Err("the engines counted no prompt tokens during the run".to_owned())
    );
    let restarted = [reading(EngineFamily::Vllm, 4.0, 1.0)];
    let why = hit_rate_over(&one, &same, &restarted).unwrap_err();
    assert!(why.starts_with("http://w: its counters went down"), "{why}");
    let other = [reading(EngineFamily::Sglang, 20.0, 5.0)];
    let why = hit_rate_over(&one, &same, &other).unwrap_err();
    assert!(why.contains("from vLLM's to SGLang's names"), "{why}");
}

/// `loadgen`'s arguments as the command line gives them.
fn loadgen_args(extra: &[&str]) -> LoadgenArgs {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: LoadgenArgs,
    }
    let mut argv = vec!["loadgen", "--url", "http://127.0.0.1:1"];
    argv.extend_from_slice(extra);
    <Cli as clap::Parser>::try_parse_from(argv).unwrap().args
}

#[test]
fn a_tenant_mix_sends_each_tenant_at_its_rate_with_its_headers() {
    let dir = std::env::temp_dir().join(format!("switchyard-loadgen-mix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mix = dir.join("mix.toml");
    std::fs::write(
        &mix,
        "[[tenants]]\nname = \"chat\"\nrate_scale = 1\nslo_ttft_ms = 800\nkey_env = \"SWITCHYARD_TEST_CHAT_KEY\"\n\
         [[tenants]]\nname = \"batch\"\nband = \"sheddable\"\nrate_scale = 4\n",
    )
    .unwrap();
    std::env::set_var("SWITCHYARD_TEST_CHAT_KEY", "sk-chat");
    let args = loadgen_args(&[
        "--tenants",
        mix.to_str().unwrap(),
        "--duration",
        "120",
        "--max-requests",
        "100000",
    ]);
    let (requests, arrivals) = tenant_requests(&args, &mix, None).unwrap();
    assert_eq!(requests.len(), arrivals.len());
    assert!(arrivals.windows(2).all(|w| w[0] <= w[1]), "arrival order");
    assert!(arrivals.iter().all(|&t| t <= 120_000.0));
    let of = |name: &str| {
        requests
            .iter()
            .filter(|r| r.tenant.as_ref().is_some_and(|t| t.name == name))
            .collect::<Vec<_>>()
    };
    let (chat, batch) = (of("chat"), of("batch"));
    assert_eq!(chat.len() + batch.len(), requests.len());
    // The same trace at four times the rate: four times the requests
    // within the same window (up to the records sharing a timestamp).
    let ratio = batch.len() as f64 / chat.len() as f64;
    assert!(
        (3.5..=4.5).contains(&ratio),
        "{} vs {}",
        batch.len(),
        chat.len()
    );
    let header = |r: &PreparedRequest, name: &str| {
        r.tenant
            .as_ref()
            .unwrap()
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.to_str().unwrap().to_owned())
    };
    assert_eq!(
        header(chat[0], "authorization").as_deref(),
        Some("Bearer sk-chat")
    );
    assert_eq!(header(chat[0], "x-slo-ttft-ms").as_deref(), Some("800"));
    assert_eq!(header(chat[0], "x-priority"), None);
    assert_eq!(header(batch[0], "x-priority").as_deref(), Some("sheddable"));
    assert_eq!(header(batch[0], "authorization"), None);
    assert_eq!(header(batch[0], "x-tenant").as_deref(), Some("batch"));
    // Tenants' prompts differ even though they replay one trace.
    assert_ne!(chat[0].body, batch[0].body);
}
