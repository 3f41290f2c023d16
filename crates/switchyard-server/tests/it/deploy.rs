//! The deployment files under `deploy/` against the router they deploy:
//! every example config and the Helm chart's config load with the router's
//! own loader (unknown keys refused, values validated), and the chart's
//! probes ask routes the router serves. An example cannot drift from the
//! config schema without failing here.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use switchyard_server::config::ServerConfig;
use switchyard_server::standalone::app_without_workers;
use switchyard_server::tokenize::HfTokenizer;
use tower::ServiceExt;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn chart_values() -> String {
    let path = deploy().join("helm/switchyard/values.yaml");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of `values.yaml`'s top-level literal block `key: |`: the lines
/// after it that are indented, less two spaces (blank lines kept).
fn block_scalar(yaml: &str, key: &str) -> String {
    let header = format!("{key}: |");
    let mut text = String::new();
    for line in yaml.lines().skip_while(|l| *l != header).skip(1) {
        if line.trim().is_empty() {
            text.push('\n');
        } else if let Some(inner) = line.strip_prefix("  ") {
            text.push_str(inner);
            text.push('\n');
        } else {
            break;
        }
    }
    assert!(
        !text.trim().is_empty(),
        "values.yaml has no `{header}` block"
    );
    text
}

#[test]
fn every_example_config_loads_and_follows_its_workers_kv_events() {
    let dir = deploy().join("examples");
    let mut loaded = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let config = ServerConfig::from_toml_file(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(!config.workers.is_empty(), "{}: no workers", path.display());
        for worker in &config.workers {
            assert!(
                worker.events.is_some() && worker.replay.is_some(),
                "{}: {} subscribes to no KV events or no replay",
                path.display(),
                worker.url
            );
        }
        loaded.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    loaded.sort();
    assert_eq!(
        loaded,
        [
            "multi-model-fleet.toml",
            "sglang-fleet.toml",
            "vllm-fleet.toml"
        ]
    );
}

#[test]
fn the_helm_charts_config_loads() {
    let toml = block_scalar(&chart_values(), "config");
    let config =
        ServerConfig::from_toml(&toml).unwrap_or_else(|e| panic!("values.yaml config: {e}"));
    assert!(!config.workers.is_empty());
}

#[test]
fn the_helm_charts_probes_ask_routes_the_router_serves() {
    let values = chart_values();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tokenizer = Arc::new(HfTokenizer(
        switchyard_tokenizer::Tokenizer::bundled().unwrap(),
    ));
    let app = runtime
        .block_on(async { app_without_workers(tokenizer, 1024) })
        .unwrap();
    // Without a worker the router is alive but not ready.
    for (path, status) in [
        ("/health", StatusCode::OK),
        ("/ready", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        assert!(
            values.contains(&format!("path: {path}\n")),
            "values.yaml has no probe on {path}"
        );
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = runtime.block_on(app.clone().oneshot(request)).unwrap();
        assert_eq!(response.status(), status, "GET {path}");
    }
}
