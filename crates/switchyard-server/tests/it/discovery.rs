//! Live discovery, end to end: the router in-process on a real socket,
//! workers that are real HTTP listeners, a workers file the test rewrites,
//! and a DNS server on loopback whose answers the test changes. Adding and
//! removing a worker at the source takes effect without a restart; what
//! the router holds is read from its admin API and `/metrics`.

use crate::scripted_worker::{scripted_worker, scripted_worker_at, Script};
use crate::support::{metric, metrics_text, scratch_file, wait_for, PATIENCE};
use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use switchyard_server::config::DiscoveryConfig;
use switchyard_server::{config::WorkerSpec, ServerConfig};
use tokio::net::UdpSocket;

const ADMIN: &str = "discovery-admin";

/// Every worker the router lists (`GET /admin/workers`; none when the
/// router does not answer).
async fn workers(client: &reqwest::Client, base: &str) -> Vec<serde_json::Value> {
    let Ok(response) = client
        .get(format!("{base}/admin/workers"))
        .bearer_auth(ADMIN)
        .send()
        .await
    else {
        return Vec::new();
    };
    let mut body: serde_json::Value = response.json().await.unwrap_or_default();
    match body["workers"].take() {
        serde_json::Value::Array(workers) => workers,
        _ => Vec::new(),
    }
}

/// The workers in selection, by name, from `GET /admin/workers`.
async fn in_selection(client: &reqwest::Client, base: &str) -> BTreeSet<String> {
    workers(client, base)
        .await
        .iter()
        .filter(|w| w["in_selection"] == true && w["draining"] == false)
        .filter_map(|w| w["name"].as_str().map(str::to_owned))
        .collect()
}

async fn wait_workers(client: &reqwest::Client, base: &str, expected: &[&str]) {
    let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    let what = format!("the workers in selection to be {expected:?}");
    wait_for(&what, PATIENCE, async || {
        in_selection(client, base).await == expected
    })
    .await;
}

/// Replaces the file's contents in one step (a rename), as deploy tools
/// do: the router never reads a half-written file.
fn replace(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn table(workers: &[(&str, &str)]) -> String {
    workers
        .iter()
        .map(|(name, url)| format!("[[workers]]\nurl = \"{url}\"\nname = \"{name}\"\n\n"))
        .collect()
}

fn router_config(manual: &str, discovery: DiscoveryConfig) -> ServerConfig {
    ServerConfig {
        port: 0,
        admin_token: Some(ADMIN.into()),
        workers: vec![WorkerSpec::parse(&format!("{manual},name=manual")).unwrap()],
        health_interval_ms: 100,
        discovery,
        ..ServerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_added_to_and_removed_from_the_watched_file_come_and_go_without_a_restart() {
    let manual = scripted_worker(Script::Status500).await;
    let a = scripted_worker(Script::Status500).await;
    let b = scripted_worker(Script::Status500).await;
    let path = scratch_file("discovery-workers.toml", table(&[("a", &a)]).as_bytes());
    let config = router_config(
        &manual,
        DiscoveryConfig {
            workers_file: Some(path.clone()),
            workers_file_interval_ms: 50,
            ..DiscoveryConfig::default()
        },
    );
    let running = switchyard_server::start(config).await.unwrap();
    let base = format!("http://{}", running.addr);
    let client = reqwest::Client::new();
    wait_workers(&client, &base, &["a", "manual"]).await;

    replace(&path, &table(&[("a", &a), ("b", &b)]));
    wait_workers(&client, &base, &["a", "b", "manual"]).await;

    // A bad file (two workers of one name) changes nothing; it is counted.
    replace(&path, &table(&[("a", &a), ("a", &b)]));
    let errors = r#"switchyard_discovery_errors_total{source="file",reason="invalid"}"#;
    wait_for("the bad file to be counted", PATIENCE, async || {
        metric(&metrics_text(&client, &base).await, errors) == Some(1.0)
    })
    .await;
    assert_eq!(
        in_selection(&client, &base).await,
        BTreeSet::from(["a", "b", "manual"].map(String::from)),
        "a bad file keeps the last good set"
    );

    replace(&path, &table(&[("b", &b)]));
    wait_workers(&client, &base, &["b", "manual"]).await;

    // A deleted file keeps the last set too.
    std::fs::remove_file(&path).unwrap();
    let missing = r#"switchyard_discovery_errors_total{source="file",reason="missing"}"#;
    wait_for("the missing file to be counted", PATIENCE, async || {
        metric(&metrics_text(&client, &base).await, missing) == Some(1.0)
    })
    .await;
    assert_eq!(
        in_selection(&client, &base).await,
        BTreeSet::from(["b", "manual"].map(String::from))
    );

    // Emptied, the file takes its own workers away and never `manual`,
    // even when it names it.
    replace(&path, &table(&[("manual", &b)]));
    wait_workers(&client, &base, &["manual"]).await;
    let text = metrics_text(&client, &base).await;
    assert_eq!(
        metric(&text, r#"switchyard_discovery_workers{source="file"}"#),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"switchyard_discovery_changes_total{source="file",change="added"}"#
        ),
        Some(2.0)
    );
    running.shutdown().await.unwrap();
}

/// Every worker the router lists, by name, and whether it is draining.
async fn listed(client: &reqwest::Client, base: &str) -> Vec<(String, bool)> {
    workers(client, base)
        .await
        .iter()
        .filter_map(|w| Some((w["name"].as_str()?.to_owned(), w["draining"] == true)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_removed_from_the_file_drains_its_requests_in_flight_before_it_goes() {
    let silent = scripted_worker(Script::Silent).await;
    let path = scratch_file(
        "discovery-drain-workers.toml",
        table(&[("slow", &silent)]).as_bytes(),
    );
    let config = ServerConfig {
        port: 0,
        admin_token: Some(ADMIN.into()),
        health_interval_ms: 100,
        discovery: DiscoveryConfig {
            workers_file: Some(path.clone()),
            workers_file_interval_ms: 50,
            ..DiscoveryConfig::default()
        },
        ..ServerConfig::default()
    };
    let running = switchyard_server::start(config).await.unwrap();
    let base = format!("http://{}", running.addr);
    let client = reqwest::Client::new();
    wait_workers(&client, &base, &["slow"]).await;
    // A request the silent worker holds open.
    let request = tokio::spawn(
        client
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"prompt": "x", "max_tokens": 4}))
            .send(),
    );
    wait_for("the request to be booked", PATIENCE, async || {
        metric(
            &metrics_text(&client, &base).await,
            "switchyard_active_requests",
        ) == Some(1.0)
    })
    .await;

    replace(&path, "");
    wait_for("the worker to be draining", PATIENCE, async || {
        listed(&client, &base).await == [("slow".to_owned(), true)]
    })
    .await;
    // Drained once; listed (draining) while its request is in flight.
    let passes = r#"switchyard_discovery_changes_total{source="file",change="drained"}"#;
    assert_eq!(
        metric(&metrics_text(&client, &base).await, passes),
        Some(1.0)
    );
    assert_eq!(listed(&client, &base).await, [("slow".to_owned(), true)]);

    // The client gives up: its request ends, and the worker goes.
    request.abort();
    wait_for("the drained worker to be removed", PATIENCE, async || {
        listed(&client, &base).await.is_empty()
    })
    .await;
    running.shutdown().await.unwrap();
}

/// A DNS server on a loopback UDP socket answering A queries for any name
/// with `records` (the test changes them) and AAAA queries with none. An
/// empty `records` is "no data" (NOERROR, no answers).
async fn dns_server(records: Arc<Mutex<Vec<Ipv4Addr>>>) -> SocketAddr {
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                return;
            };
            let ips = records.lock().unwrap().clone();
            if let Some(reply) = dns_answer(&buf[..n], &ips) {
                let _ = socket.send_to(&reply, from).await;
            }
        }
    });
    addr
}

/// The answer to one query (RFC 1035 §4): its id and question echoed,
/// one A record per address (TTL 0) when it asks for A, none otherwise.
/// `None` for a message that is not a one-question query.
fn dns_answer(query: &[u8], ips: &[Ipv4Addr]) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 || query[4..6] != [0, 1] {
        return None;
    }
    // The question: labels up to the root, then type and class.
    let mut end = 12;
    loop {
        let len = *query.get(end)? as usize;
        end += 1;
        if len == 0 {
            break;
        }
        end += len;
    }
    let question = query.get(12..end + 4)?;
    let qtype = u16::from_be_bytes([question[question.len() - 4], question[question.len() - 3]]);
    let answers: &[Ipv4Addr] = if qtype == 1 { ips } else { &[] };
    let mut reply = Vec::with_capacity(512);
    reply.extend_from_slice(&query[0..2]);
    // QR, AA, RD (as asked), RA; NOERROR.
    reply.extend_from_slice(&[0x84 | (query[2] & 0x01), 0x80]);
    reply.extend_from_slice(&[0, 1]);
    reply.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    reply.extend_from_slice(&[0, 0, 0, 0]);
    reply.extend_from_slice(question);
    for ip in answers {
        // The question's name (a pointer to offset 12), A, IN, TTL 0.
        reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
        reply.extend_from_slice(&ip.octets());
    }
    Some(reply)
}

/// Two scripted workers on one port, at 127.0.0.1 and 127.0.0.2: the
/// port. Tries a few ports in case the second address's is taken.
async fn two_workers_on_one_port() -> u16 {
    for _ in 0..20 {
        let first = scripted_worker(Script::Status500).await;
        let port: u16 = first.rsplit(':').next().unwrap().parse().unwrap();
        let second = SocketAddr::from(([127, 0, 0, 2], port));
        if scripted_worker_at(second, Script::Status500).await.is_ok() {
            return port;
        }
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_whose_dns_records_appear_and_vanish_come_and_go_without_a_restart() {
    let port = two_workers_on_one_port().await;
    let records = Arc::new(Mutex::new(vec![Ipv4Addr::new(127, 0, 0, 1)]));
    let nameserver = dns_server(records.clone()).await;
    let manual = scripted_worker(Script::Status500).await;
    let target = format!("workers.switchyard.test:{port}");
    let config = router_config(
        &manual,
        DiscoveryConfig {
            workers_dns: vec![target.clone()],
            workers_dns_interval_ms: 50,
            dns_servers: vec![nameserver],
            ..DiscoveryConfig::default()
        },
    );
    let running = switchyard_server::start(config).await.unwrap();
    let base = format!("http://{}", running.addr);
    let client = reqwest::Client::new();
    let one = format!("127.0.0.1:{port}");
    let two = format!("127.0.0.2:{port}");
    wait_workers(&client, &base, &[&one, "manual"]).await;

    records.lock().unwrap().push(Ipv4Addr::new(127, 0, 0, 2));
    wait_workers(&client, &base, &[&one, &two, "manual"]).await;

    records.lock().unwrap().remove(0);
    wait_workers(&client, &base, &[&two, "manual"]).await;

    // No records at all: a failure, not "no workers"; the last set stays.
    records.lock().unwrap().clear();
    let empty =
        format!(r#"switchyard_discovery_errors_total{{source="dns:{target}",reason="empty"}}"#);
    wait_for("an empty answer to be counted", PATIENCE, async || {
        metric(&metrics_text(&client, &base).await, &empty).is_some_and(|n| n >= 1.0)
    })
    .await;
    assert_eq!(
        in_selection(&client, &base).await,
        BTreeSet::from([two.clone(), "manual".to_owned()])
    );
    let gauge = format!(r#"switchyard_discovery_workers{{source="dns:{target}"}}"#);
    assert_eq!(
        metric(&metrics_text(&client, &base).await, &gauge),
        Some(1.0)
    );
    running.shutdown().await.unwrap();
}
