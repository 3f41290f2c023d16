//! `serve --disagg vllm|sglang` end to end (issue 17, part 3): a router in
//! front of prefill and decode sim-worker processes (`sim-worker --disagg
//! ...`), over real sockets. Each request's halves go to a worker of each
//! pool, the KV moves between the two workers, and the decode worker's
//! answer reaches the client; workers killed mid-run cost no request.

use crate::scripted_worker::{scripted_worker, Script};
use crate::support::{
    machine, metric, metric_sum, metrics_text, peak_resident_bytes, resident_bytes, router,
    sim_worker_with, wait_metrics, Proc,
};
use serde_json::{json, Value};

const TEXT: &str = "Disaggregated serving splits an inference fleet in two: prefill workers compute the prompt's key-value cache once, and decode workers receive it and generate the answer token by token. The router sends the prompt to a prefill worker first, takes the transfer parameters from its answer, and then sends the same request to a decode worker.";

/// A `--disagg` sim-worker with `flags` (its timing model's pace: prefills
/// take milliseconds, so a kill lands on requests in flight).
fn worker(flags: &[&str]) -> Proc {
    let mut all = vec!["--speedup", "1", "--num-blocks", "2048"];
    all.extend_from_slice(flags);
    sim_worker_with(0, &all)
}

fn vllm_worker() -> Proc {
    worker(&["--disagg", "vllm"])
}

fn sglang_prefill() -> Proc {
    sglang_prefill_with(&[])
}

/// An SGLang prefill worker (its bootstrap server on a free port) with
/// `flags`.
fn sglang_prefill_with(flags: &[&str]) -> Proc {
    let mut all = vec![
        "--disagg",
        "sglang",
        "--disagg-role",
        "prefill",
        "--bootstrap-port",
        "0",
    ];
    all.extend_from_slice(flags);
    worker(&all)
}

fn sglang_decode() -> Proc {
    sglang_decode_with(&[])
}

/// An SGLang decode worker with `flags`.
fn sglang_decode_with(flags: &[&str]) -> Proc {
    let mut all = vec!["--disagg", "sglang", "--disagg-role", "decode"];
    all.extend_from_slice(flags);
    worker(&all)
}

/// `--worker` specs: prefill workers `p0, p1, ...` and decode workers
/// `d0, d1, ...` (SGLang's prefill ones with their bootstrap ports).
fn specs(prefill: &[Proc], decode: &[Proc]) -> Vec<String> {
    let mut specs = Vec::new();
    for (i, p) in prefill.iter().enumerate() {
        let mut spec = format!("{},role=prefill", p.named(&format!("p{i}")));
        if let Some(port) = p.bootstrap {
            spec.push_str(&format!(",bootstrap-port={port}"));
        }
        specs.push(spec);
    }
    for (i, d) in decode.iter().enumerate() {
        specs.push(format!("{},role=decode", d.named(&format!("d{i}"))));
    }
    specs
}

/// A chat request of `TEXT` (a distinct prefix per `n`) for 16 tokens.
fn chat(n: usize, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": format!("{n}: {TEXT}")}],
        "max_tokens": 16,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// Sends `body` to the router; its answer's pieces of text and usage,
/// asserting a 200 and a stream that ended well.
async fn ask(client: &reqwest::Client, base: &str, body: &Value) -> (String, usize, Value) {
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let worker = response
        .headers()
        .get("x-switchyard-worker")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    if body["stream"] == true {
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let mut pieces = 0;
        let mut usage = Value::Null;
        for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                continue;
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            assert!(chunk.get("error").is_none(), "{chunk}");
            if let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) {
                if choice["delta"]["content"]
                    .as_str()
                    .is_some_and(|p| !p.is_empty())
                {
                    pieces += 1;
                }
            }
            if chunk["usage"].is_object() {
                usage = chunk["usage"].clone();
            }
        }
        (worker, pieces, usage)
    } else {
        let v: Value = serde_json::from_str(&text).unwrap();
        (worker, 16, v["usage"].clone())
    }
}

async fn metrics_of(client: &reqwest::Client, p: &Proc) -> String {
    metrics_text(client, &p.base).await
}

/// The router's bookings are back to zero on every worker, and every
/// lease the prefill workers captured was released.
async fn settled(client: &reqwest::Client, router: &Proc, prefill: &[&Proc]) {
    wait_metrics(client, &router.base, "no booking left", |t| {
        metric_sum(t, "switchyard_worker_active_requests") == 0.0
    })
    .await;
    for p in prefill {
        wait_metrics(client, &p.base, "every lease released", |t| {
            metric(t, "switchyard_engine_leases_held") == Some(0.0)
        })
        .await;
    }
}

/// `--worker` specs for a scripted prefill worker at `scripted` (`p0`)
/// beside the sound prefill worker `p1` and the decode worker `d0`; both
/// prefill workers name the sound one's bootstrap port, if it has one.
fn specs_with_scripted_prefill(scripted: &str, sound: &Proc, decode: &Proc) -> Vec<String> {
    let bootstrap = sound
        .bootstrap
        .map(|port| format!(",bootstrap-port={port}"))
        .unwrap_or_default();
    vec![
        format!("{scripted},name=p0,role=prefill{bootstrap}"),
        format!("{},role=prefill{bootstrap}", sound.named("p1")),
        format!("{},role=decode", decode.named("d0")),
    ]
}

/// Sends `requests` chats through the router, streamed and not in turn;
/// asserts that the decode worker `d0` answered each in full (16 pieces).
async fn each_answered_by_d0(client: &reqwest::Client, router: &Proc, requests: usize) {
    for n in 0..requests {
        let (worker, pieces, _) = ask(client, &router.base, &chat(n, n % 2 == 0)).await;
        assert_eq!((worker.as_str(), pieces), ("d0", 16));
    }
}

/// Asserts that the router's metrics `r` show a prefill done again for a
/// failed transfer, and no decode half counted as failed for it.
fn assert_prefill_redone_decode_not_blamed(r: &str) {
    assert!(
        metric(r, "switchyard_disagg_retries_total{reason=\"transfer\"}") >= Some(1.0),
        "{r}"
    );
    assert_eq!(
        metric(
            r,
            "switchyard_disagg_halves_total{role=\"decode\",outcome=\"failed\"}"
        ),
        Some(0.0),
        "a failed transfer is not the decode worker's failure"
    );
}

/// Asserts that the decode worker `decode` counted at least one failed
/// transfer for `reason`.
async fn assert_decode_counted_failure(client: &reqwest::Client, decode: &Proc, reason: &str) {
    let d = metrics_of(client, decode).await;
    let series = format!("switchyard_engine_disagg_failures_total{{reason=\"{reason}\"}}");
    assert!(metric(&d, &series) >= Some(1.0), "{d}");
}

/// One request each way through one prefill and one decode worker: the
/// decode worker answers, restored from the prefill worker's capture.
async fn through_one_prefill_and_one_decode(mode: &str, prefill: Proc, decode: Proc) {
    let router = router(
        &specs(
            std::slice::from_ref(&prefill),
            std::slice::from_ref(&decode),
        ),
        &["--disagg", mode],
    );
    let client = reqwest::Client::new();
    for (n, stream) in [(0, true), (1, false)] {
        let (worker, pieces, usage) = ask(&client, &router.base, &chat(n, stream)).await;
        assert_eq!(worker, "d0", "the decode worker answers");
        assert_eq!(pieces, 16);
        assert_eq!(usage["completion_tokens"], 16);
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(
            cached,
            prompt / 16 * 16,
            "the decode restored every full block"
        );
    }
    let d = metrics_of(&client, &decode).await;
    assert_eq!(
        metric(&d, "switchyard_engine_disagg_transfers_total"),
        Some(2.0),
        "{d}"
    );
    assert!(metric(&d, "switchyard_engine_disagg_transfer_bytes_total") > Some(0.0));
    assert_eq!(
        metric(
            &d,
            "switchyard_engine_restores_total{decision=\"restored\"}"
        ),
        Some(2.0)
    );
    let p = metrics_of(&client, &prefill).await;
    assert_eq!(
        metric(&p, "switchyard_engine_leases_total{event=\"captured\"}"),
        Some(2.0),
        "{p}"
    );
    settled(&client, &router, &[&prefill]).await;
    let r = metrics_of(&client, &router).await;
    for (series, value) in [
        ("switchyard_disagg_requests_total", 2.0),
        (
            "switchyard_disagg_halves_total{role=\"prefill\",outcome=\"ok\"}",
            2.0,
        ),
        (
            "switchyard_disagg_halves_total{role=\"decode\",outcome=\"ok\"}",
            2.0,
        ),
        (
            "switchyard_requests_total{policy=\"ttft\",status=\"ok\"}",
            2.0,
        ),
    ] {
        assert_eq!(metric(&r, series), Some(value), "{series}\n{r}");
    }
    assert_eq!(metric_sum(&r, "switchyard_disagg_failures_total"), 0.0);
    assert_eq!(metric_sum(&r, "switchyard_disagg_retries_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_a_request_is_prefilled_on_one_worker_and_decoded_on_another() {
    let _machine = machine().await;
    through_one_prefill_and_one_decode("vllm", vllm_worker(), vllm_worker()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_request_is_prefilled_on_one_worker_and_decoded_on_another() {
    let _machine = machine().await;
    through_one_prefill_and_one_decode("sglang", sglang_prefill(), sglang_decode()).await;
}

/// Two prefill and two decode workers; requests four at a time; the
/// prefill worker that served the most so far is killed, later a decode
/// worker: every request still succeeds (its half retried on the other
/// worker of the pool, or a broken stream resumed there), and at the end
/// no booking is left and every lease is released.
async fn kill_one_of_each_pool_mid_run(mode: &str, mut prefill: Vec<Proc>, mut decode: Vec<Proc>) {
    let router = router(
        &specs(&prefill, &decode),
        &["--disagg", mode, "--circuit-failures", "1"],
    );
    let client = reqwest::Client::new();
    let base = router.base.clone();
    let requests = 48;
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = 0;
    let mut done = 0;
    let mut killed_prefill = false;
    let mut killed_decode = false;
    while done < requests {
        while sent < requests && tasks.len() < 4 {
            let (client, base) = (client.clone(), base.clone());
            let body = chat(sent % 6, sent % 2 == 0);
            tasks.spawn(async move { ask(&client, &base, &body).await });
            sent += 1;
        }
        let (_, pieces, _) = tasks.join_next().await.unwrap().unwrap();
        assert_eq!(pieces, 16);
        done += 1;
        if done == 8 && !killed_prefill {
            // The busier prefill worker (the one holding the prefixes).
            let mut captured = Vec::new();
            for p in &prefill {
                let t = metrics_of(&client, p).await;
                captured.push(
                    metric(&t, "switchyard_engine_leases_total{event=\"captured\"}").unwrap_or(0.0),
                );
            }
            let busiest = usize::from(captured[1] > captured[0]);
            prefill[busiest].kill();
            prefill.swap_remove(busiest);
            killed_prefill = true;
        }
        if done == 24 && !killed_decode {
            decode[0].kill();
            decode.swap_remove(0);
            killed_decode = true;
        }
    }
    settled(&client, &router, &[&prefill[0]]).await;
    let r = metrics_of(&client, &router).await;
    assert_eq!(
        metric(
            &r,
            "switchyard_requests_total{policy=\"ttft\",status=\"ok\"}"
        ),
        Some(requests as f64),
        "{r}"
    );
    assert_eq!(
        metric_sum(&r, "switchyard_disagg_failures_total"),
        0.0,
        "{r}"
    );
    let retried = metric_sum(&r, "switchyard_disagg_retries_total")
        + metric_sum(&r, "switchyard_migrations_total");
    eprintln!(
        "{mode}: retries {:?} {:?}, migrations {}",
        metric(&r, "switchyard_disagg_retries_total{reason=\"prefill\"}"),
        metric(&r, "switchyard_disagg_retries_total{reason=\"decode\"}"),
        metric_sum(&r, "switchyard_migrations_total")
    );
    assert!(retried >= 1.0, "a killed worker cost a retry\n{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_killed_workers_lose_no_request() {
    let _machine = machine().await;
    kill_one_of_each_pool_mid_run(
        "vllm",
        vec![vllm_worker(), vllm_worker()],
        vec![vllm_worker(), vllm_worker()],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_killed_workers_lose_no_request() {
    let _machine = machine().await;
    kill_one_of_each_pool_mid_run(
        "sglang",
        vec![sglang_prefill(), sglang_prefill()],
        vec![sglang_decode(), sglang_decode()],
    )
    .await;
}

/// A prefill worker whose KV no decode worker can pull (it wants a key
/// the decode workers do not send), beside a sound one, round-robin over
/// the prefill pool: the decode worker answers that its transfer failed
/// (502 naming the prefill worker), and the router does the prefill again
/// — on the other worker — instead of failing the request or blaming the
/// decode worker. (A 404 for an expired or unknown lease takes the same
/// path: `switchyard_wire::disagg::tests::a_transfer_failure_is_told_from_a_worker_failure`.)
async fn a_failed_transfer_gets_a_new_prefill(mode: &str, prefill: [Proc; 2], decode: Proc) {
    let router = router(
        &specs(&prefill, std::slice::from_ref(&decode)),
        &[
            "--disagg",
            mode,
            "--policy",
            "round-robin",
            "--worker-api-key",
            "wk",
        ],
    );
    let client = reqwest::Client::new();
    each_answered_by_d0(&client, &router, 6).await;
    settled(&client, &router, &[&prefill[1]]).await;
    let r = metrics_of(&client, &router).await;
    assert_prefill_redone_decode_not_blamed(&r);
    assert_eq!(metric_sum(&r, "switchyard_disagg_failures_total"), 0.0);
    assert_decode_counted_failure(&client, &decode, "unreachable").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_a_failed_transfer_gets_a_new_prefill() {
    let _machine = machine().await;
    let locked = worker(&["--disagg", "vllm", "--api-key", "wk"]);
    a_failed_transfer_gets_a_new_prefill("vllm", [locked, vllm_worker()], vllm_worker()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_failed_transfer_gets_a_new_prefill() {
    let _machine = machine().await;
    let locked = sglang_prefill_with(&["--api-key", "wk"]);
    a_failed_transfer_gets_a_new_prefill("sglang", [locked, sglang_prefill()], sglang_decode())
        .await;
}

/// vLLM: a prefill worker whose answers name a lease its peer never
/// issued (a scripted worker; to the decode worker no different from an
/// expired or released lease) beside a sound one, round-robin: the decode
/// worker answers 404 for the lease, and the router does the prefill again
/// instead of failing the request or blaming the decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_an_unknown_or_expired_lease_gets_a_new_prefill() {
    let _machine = machine().await;
    let sound = vllm_worker();
    let decode = vllm_worker();
    let stale = scripted_worker(Script::StaleLease(sound.port())).await;
    let router = router(
        &specs_with_scripted_prefill(&stale, &sound, &decode),
        &["--disagg", "vllm", "--policy", "round-robin"],
    );
    let client = reqwest::Client::new();
    each_answered_by_d0(&client, &router, 6).await;
    settled(&client, &router, &[&sound]).await;
    let r = metrics_of(&client, &router).await;
    assert_prefill_redone_decode_not_blamed(&r);
    assert_decode_counted_failure(&client, &decode, "unknown_lease").await;
    let p = metrics_of(&client, &sound).await;
    assert!(metric(&p, "switchyard_engine_disagg_pulls_unknown_total") >= Some(1.0));
}

/// SGLang: a prefill worker that answers but never holds the room (a
/// scripted worker; its bootstrap port is a sound prefill worker's, which
/// does not hold that room either) beside the sound one, round-robin: the
/// decode worker gives up on the room (504 after its
/// `--bootstrap-timeout-ms`), and the router sends the pair again under a
/// new room instead of failing the request or blaming the decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_room_never_held_gets_a_new_pair() {
    let _machine = machine().await;
    let sound = sglang_prefill();
    let decode = sglang_decode_with(&["--bootstrap-timeout-ms", "300"]);
    assert!(
        sound.bootstrap.is_some(),
        "the prefill printed its bootstrap port"
    );
    let stale = scripted_worker(Script::StaleLease(sound.port())).await;
    let router = router(
        &specs_with_scripted_prefill(&stale, &sound, &decode),
        &["--disagg", "sglang", "--policy", "round-robin"],
    );
    let client = reqwest::Client::new();
    each_answered_by_d0(&client, &router, 4).await;
    settled(&client, &router, &[&sound]).await;
    let r = metrics_of(&client, &router).await;
    assert_prefill_redone_decode_not_blamed(&r);
    assert_decode_counted_failure(&client, &decode, "timeout").await;
}

/// Roles need `--disagg`, and the admin API shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_are_listed_and_need_disagg() {
    let _machine = machine().await;
    let p = vllm_worker();
    let d = vllm_worker();
    let router = router(
        &specs(std::slice::from_ref(&p), std::slice::from_ref(&d)),
        &["--disagg", "vllm", "--admin-token", "adm"],
    );
    let client = reqwest::Client::new();
    let list: Value = client
        .get(format!("{}/admin/workers", router.base))
        .bearer_auth("adm")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let roles: Vec<(String, String)> = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["name"].as_str().unwrap().to_owned(),
                w["role"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        roles,
        [
            ("d0".into(), "decode".into()),
            ("p0".into(), "prefill".into())
        ]
    );
    // A worker added with a role through the admin API.
    let q = vllm_worker();
    let added = client
        .post(format!("{}/admin/workers", router.base))
        .bearer_auth("adm")
        .json(&json!({"url": q.base, "name": "p1", "role": "prefill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), 201);
    let bad = client
        .post(format!("{}/admin/workers", router.base))
        .bearer_auth("adm")
        .json(&json!({"url": q.base, "name": "x", "role": "primary"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // Without --disagg a role is refused at startup.
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--port", "0", "--worker"])
        .arg(format!("{},role=prefill", p.base))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
}

/// A body near the 32 MiB limit made of numbers (in a field the router
/// does not read, so every front-door check passes) goes through `--disagg`
/// without becoming a JSON tree: the router rewrites its top-level fields
/// as text. The router's peak resident memory stays less than 256 MiB
/// over its warmed-up baseline (the body, the halves' copies, the
/// allocator's slack). Measured here: 61 MiB; with the body parsed into a
/// tree as the router once did, 718 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_32_mib_of_numbers_crosses_disagg_without_a_json_tree() {
    const MIB: u64 = 1 << 20;
    const BOUND: u64 = 256 * MIB;
    let _machine = machine().await;
    let (prefill, decode) = (vllm_worker(), vllm_worker());
    let router = router(
        &specs(
            std::slice::from_ref(&prefill),
            std::slice::from_ref(&decode),
        ),
        &["--disagg", "vllm"],
    );
    let client = reqwest::Client::new();
    // Warm up: the halves, the pools, the first request's allocations.
    let (worker, _, _) = ask(&client, &router.base, &chat(0, false)).await;
    assert_eq!(worker, "d0");
    let baseline = resident_bytes(&router);
    let mut body = String::from(r#"{"prompt": [1, 2, 3, 4], "max_tokens": 2, "padding": [0"#);
    while body.len() < 31 * MIB as usize {
        body.push_str(",0");
    }
    body.push_str("]}");
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    // Whatever the workers make of it (a sim-worker refuses a body this
    // large), the router answers.
    let _ = response.bytes().await;
    let grown = peak_resident_bytes(&router).saturating_sub(baseline);
    assert!(
        grown < BOUND,
        "the router's peak resident memory grew by {} MiB (bound {} MiB)",
        grown / MIB,
        BOUND / MIB
    );
    // And it still serves.
    let (worker, _, _) = ask(&client, &router.base, &chat(1, false)).await;
    assert_eq!(worker, "d0");
}
