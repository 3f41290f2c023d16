//! The replica plane's trust boundary end to end: a `switchyard serve`
//! with `--replica-sync` on a private `nats-server` that requires a user
//! and password, one sim-worker, and a forger that holds the credentials
//! (an authenticated but lying peer) and one that does not.
//!
//! Skips (with a printed reason) only when no `nats-server` is installed.

use crate::support::{
    machine, metric, metrics_text, router, scratch_file, served_by, sim_worker_with, wait_metrics,
    PATIENCE,
};
use bytes::Bytes;
use futures_util::StreamExt as _;
use serde_json::json;
use std::time::Duration;
use switchyard_core::admission::SessionKey;
use switchyard_core::replica::{DIGEST_GRACE_MS, MAX_REMOTE_PROMPT_TOKENS};
use switchyard_core::sequences::{AddRequest, SequenceEvent};
use switchyard_core::{LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_replica::nats_server::nats_server_binary;
use switchyard_replica::{
    worker_id_for_name, LocalNatsServer, NatsAuth, NatsTransport, ReplicaConfig, Secret,
    Transport as _,
};
use switchyard_wire::replica::{
    decode_batch, encode_batch, ActiveSequenceData, ActiveSequenceEvent, DigestPart, ReplicaBatch,
    SessionBinding,
};

const USER: &str = "router";
const PASSWORD: &str = "pw-for-tests-only";

fn add(id: u128, worker: WorkerId, prompt_tokens: u32) -> AddRequest {
    AddRequest {
        request: RequestId(id),
        worker,
        prompt_tokens,
        blocks: vec![LocalHash(11), LocalHash(12)],
        overlap_blocks: u32::MAX,
        expected_prefill_ms: Some(f64::MAX),
    }
}

fn batch(sender: ReplicaId, events: Vec<ActiveSequenceEvent>) -> ReplicaBatch {
    ReplicaBatch {
        events,
        ..ReplicaBatch::heartbeat(sender)
    }
}

fn series(text: &str, name: &str) -> f64 {
    metric(text, name).unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_replica_messages_change_nothing_beyond_the_clamps_and_the_unauthenticated_nothing_at_all(
) {
    let _machine = machine().await;
    if nats_server_binary().is_none() {
        eprintln!("skipping: no nats-server binary (apt-get install -y nats-server)");
        return;
    }
    let nats = LocalNatsServer::start_with_config(&format!(
        "authorization {{ user: {USER}, password: {PASSWORD} }}"
    ))
    .expect("nats-server starts");
    let url = nats.url();
    let password_file = scratch_file(
        "replica-security-password",
        format!("{PASSWORD}\n").as_bytes(),
    );
    // The worker marks its prefills on the plane, authenticated too.
    let worker = sim_worker_with(
        0,
        &[
            "--speedup",
            "1",
            "--num-blocks",
            "1024",
            "--replica-sync",
            &url,
            "--nats-user",
            USER,
            "--nats-password-file",
            password_file.to_str().unwrap(),
        ],
    );
    let w0 = worker_id_for_name("w0");
    let serve = router(
        &[worker.named("w0")],
        &[
            "--admission",
            "session-aware",
            "--replica-sync",
            &url,
            "--nats-user",
            USER,
            "--nats-password-file",
            password_file.to_str().unwrap(),
            "--replica-heartbeat-ms",
            "100",
            "--replica-digest-ms",
            "200",
        ],
    );
    let client = reqwest::Client::new();
    let auth = NatsAuth {
        user: Some(USER.into()),
        password: Some(Secret(PASSWORD.into())),
        ..NatsAuth::default()
    };
    let subject = ReplicaConfig::default().subject();
    let forger = NatsTransport::connect_with(&url, &auth)
        .await
        .expect("an authenticated peer connects");
    // The router's own id, from its heartbeats on the bus. The sim-worker
    // publishes on the same subject (its marks' heartbeats, every second),
    // so the router is the sender heard 8 times first: it heartbeats every
    // 100 ms and sends a digest every 200 ms.
    let mut heard = forger.subscribe(&subject).await.unwrap();
    let mut counts = std::collections::HashMap::new();
    let own = tokio::time::timeout(PATIENCE, async {
        loop {
            let payload = heard.next().await.expect("the bus stays up");
            let sender = decode_batch(&payload).unwrap().router_id;
            let n = counts.entry(sender).or_insert(0);
            *n += 1;
            if *n == 8 {
                return sender;
            }
        }
    })
    .await
    .expect("the router heartbeats");
    drop(heard);
    let send = async |batch: ReplicaBatch| {
        forger
            .publish(&subject, Bytes::from(encode_batch(&batch)))
            .await
            .unwrap();
        forger.flush().await.unwrap();
    };

    // An unauthenticated publisher cannot even connect.
    let refused = NatsTransport::connect(&url).await.unwrap_err().to_string();
    assert!(refused.contains("authorization"), "{refused}");

    let liar = ReplicaId(0x5151);
    let victim = ReplicaId(0x7777);
    // A victim replica's booking, then the liar frees it in the victim's
    // name; a batch in the router's own name; an unknown worker; maximal
    // numbers; a session binding of maximal context.
    send(batch(
        victim,
        vec![ActiveSequenceEvent::add(victim, &add(1, w0, 64), None)],
    ))
    .await;
    send(batch(
        liar,
        vec![ActiveSequenceEvent::from_sequence_event(
            victim,
            w0,
            &SequenceEvent::Free(RequestId(1)),
            None,
        )],
    ))
    .await;
    send(batch(
        own,
        vec![ActiveSequenceEvent::add(own, &add(2, w0, 64), None)],
    ))
    .await;
    send(batch(
        liar,
        vec![
            ActiveSequenceEvent::add(liar, &add(3, WorkerId::new(0xdead), 64), None),
            ActiveSequenceEvent::add(liar, &add(4, w0, u32::MAX), None),
        ],
    ))
    .await;
    send(ReplicaBatch {
        sessions: vec![SessionBinding {
            session: SessionKey(42),
            worker: w0,
            context_tokens: u64::MAX,
        }],
        ..ReplicaBatch::heartbeat(liar)
    })
    .await;
    send(ReplicaBatch::heartbeat(liar)).await;

    let base = serve.base.clone();
    wait_metrics(&client, &base, "every forgery counted", |text| {
        metric(text, "switchyard_replica_dropped_total{reason=\"origin_mismatch\"}") == Some(1.0)
            && metric(text, "switchyard_replica_dropped_total{reason=\"unknown_worker\"}")
                == Some(1.0)
            // The victim's and the liar's bookings (maximal overlap and
            // prefill time, the liar's also maximal tokens) and the binding.
            && metric(text, "switchyard_replica_clamped_total") == Some(3.0)
            && metric(text, "switchyard_replica_batches_total{direction=\"own\"}") >= Some(1.0)
            && metric(
                text,
                "switchyard_replica_session_bindings_total{direction=\"applied\"}",
            ) == Some(1.0)
    })
    .await;
    let text = metrics_text(&client, &base).await;
    // The victim's booking and the liar's clamped one; nothing in the
    // router's name, nothing on the unknown worker.
    let remote = "switchyard_worker_active_requests_by_origin{worker=\"w0\",origin=\"remote\"}";
    assert_eq!(series(&text, remote), 2.0);
    let local = "switchyard_worker_active_requests_by_origin{worker=\"w0\",origin=\"local\"}";
    assert_eq!(series(&text, local), 0.0);
    let prefill = series(
        &text,
        "switchyard_worker_active_prefill_tokens{worker=\"w0\"}",
    );
    assert!(
        prefill <= f64::from(MAX_REMOTE_PROMPT_TOKENS) + 64.0,
        "{prefill} prefill tokens"
    );

    // Routing still works, in front of the clamped load; the worker's mark
    // of it names the router as the booking's origin.
    let mut plane = forger.subscribe(&subject).await.unwrap();
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "switchyard-sim", "prompt": [1, 2, 3], "max_tokens": 4}))
        .send()
        .await
        .expect("the router answers");
    assert_eq!(response.status(), 200);
    assert_eq!(served_by(&response), "w0");
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let request_id = RequestId(u128::from_str_radix(&request_id, 16).unwrap());
    let _ = response.bytes().await;
    let marked_by_worker = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(payload) = plane.next().await {
            let batch = decode_batch(&payload).unwrap();
            if batch.router_id != own
                && batch.events.iter().any(|e| {
                    e.request_id == request_id
                        && e.router_id == own
                        && e.data == ActiveSequenceData::MarkPrefillCompleted
                })
            {
                return;
            }
        }
    })
    .await;
    assert!(marked_by_worker.is_ok(), "the worker's mark never came");
    drop(plane);

    // The liar's booking 4 lost its free: its digest (every id, none
    // live) drops it once past the grace; the victim's stays.
    tokio::time::sleep(Duration::from_secs_f64(DIGEST_GRACE_MS / 1e3)).await;
    for part in DigestPart::split(Vec::new(), 1) {
        send(ReplicaBatch {
            digest: Some(part),
            ..ReplicaBatch::heartbeat(liar)
        })
        .await;
    }
    wait_metrics(
        &client,
        &base,
        "the digest frees the stale booking",
        |text| {
            metric(
                text,
                "switchyard_replica_events_total{direction=\"digest_freed\"}",
            ) == Some(1.0)
                && metric(text, remote) == Some(1.0)
        },
    )
    .await;
}
