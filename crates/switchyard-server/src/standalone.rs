//! The router's HTTP app ([`crate::front_door`], as `serve` runs it) with no
//! workers, in-process: what the request-body property tests and the
//! `http_body` fuzz target drive. Every request the app can parse ends in
//! 503 (no worker); every other one in a 4xx. Nothing leaves the process
//! (no worker, no KV events, no health checks).

use super::fleet::Fleet;
use super::tokenize::PromptTokenizer;
use super::upstream::client as upstream_client;
use super::{build_driver, metrics::ServerMetrics, ServerConfig};
use crate::front::inflight::Inflight;
use crate::routes::front_door;
use crate::state::AppState;
use std::sync::Arc;
use std::time::Duration;

/// The app of a default-configured router with no workers and a body limit
/// of `max_body_bytes`. Call inside a tokio runtime.
pub fn app_without_workers(
    tokenizer: Arc<dyn PromptTokenizer>,
    max_body_bytes: usize,
) -> anyhow::Result<axum::Router> {
    let config = ServerConfig {
        max_body_bytes,
        ..ServerConfig::default()
    };
    let driver = Arc::new(build_driver(
        &config,
        Arc::new(ServerMetrics::new(config.policy.name())),
    )?);
    let client = upstream_client(Duration::from_millis(100));
    let fleet = Arc::new(Fleet::new(
        driver.clone(),
        client.clone(),
        false,
        config.block_size,
        config.health_failures,
        Duration::from_millis(100),
    ));
    let inflight = Inflight::new(config.max_inflight, driver.metrics().clone());
    let state = Arc::new(AppState::new(
        &config, driver, fleet, client, tokenizer, None,
    ));
    Ok(front_door(&state, inflight))
}

/// Checks one answer to a body the router cannot serve: 4xx, or 503 for a
/// body that parsed, with `{"error": {"message", "type", "code"}}` whose
/// code is the status. Returns why not.
pub fn check_error_answer(status: u16, body: &[u8]) -> Result<(), String> {
    if !((400..500).contains(&status) || status == 503) {
        return Err(format!("status {status}"));
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("a {status} answer that is not JSON: {e}"))?;
    let error = &value["error"];
    if !error["message"].is_string() || !error["type"].is_string() {
        return Err(format!("not an OpenAI error object: {value}"));
    }
    if error["code"] != status {
        return Err(format!("code differs from the status {status}: {value}"));
    }
    Ok(())
}
