//! Loading a LoRA adapter on a worker before a request is forwarded
//! there (see [`crate::adapters`] for the catalogue and the rules): the
//! load the core's placement asked for, on its own task, or a wait for a
//! load already under way.

use crate::driver::booking::Booking;
use crate::error::ApiError;
use crate::state::AppState;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::time::Duration;
use switchyard_core::adapters::AdapterLoad;

/// Before forwarding a request for `adapter` to `booking`'s worker: load
/// the adapter there when the placement says so (after unloading the
/// coldest one when the worker is full), or wait for a load under way.
pub(crate) async fn ensure_loaded(
    state: &std::sync::Arc<AppState>,
    booking: &Booking,
    adapter: &str,
) -> Result<(), ApiError> {
    let adapters = &state.driver.adapters;
    let Some(load) = &booking.adapter_load else {
        if let Some(mut rx) = adapters.waiter(booking.worker, adapter) {
            adapters.count_wait();
            let done = tokio::time::timeout(
                state.upstream.first_token_timeout,
                rx.wait_for(|v| v.is_some()),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .and_then(|v| *v);
            if done == Some(false) {
                return Err(ApiError::bad_gateway(format!(
                    "the LoRA adapter `{adapter}` could not be loaded on {}",
                    state.disclosure().worker(&booking.name)
                )));
            }
        }
        return Ok(());
    };
    // On its own task: a client that goes away must not cancel the load
    // half-way (the requests waiting for it, and the table, need its end).
    let task = {
        let state = state.clone();
        let (worker, name, url) = (booking.worker, booking.name.clone(), booking.url.clone());
        let load = load.clone();
        tokio::spawn(async move {
            let adapters = &state.driver.adapters;
            let result = load_on(&state, &url, &name, &load).await;
            match &result {
                Ok(()) => {
                    state.driver.adapter_loaded(worker, &load.adapter);
                    adapters.count_load(true);
                    tracing::info!(worker = %name, adapter = %load.adapter, "LoRA adapter loaded on demand");
                }
                Err(message) => {
                    state.driver.adapter_unloaded(worker, &load.adapter);
                    adapters.count_load(false);
                    tracing::warn!(worker = %name, adapter = %load.adapter, %message, "LoRA adapter load failed");
                }
            }
            adapters.finish(worker, &load.adapter, result.is_ok());
            result
        })
    };
    match task.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(message)) => Err(ApiError::bad_gateway(format!(
            "could not load the LoRA adapter `{}` on {}: {message}",
            load.adapter,
            state.disclosure().worker(&booking.name)
        ))),
        Err(_) => Err(ApiError::internal("the adapter load task failed")),
    }
}

async fn load_on(
    state: &AppState,
    url: &str,
    worker: &str,
    load: &AdapterLoad,
) -> Result<(), String> {
    let adapters = &state.driver.adapters;
    let Some(path) = adapters.path_of(&load.adapter) else {
        return Err(
            "no [[adapters]] table gives its path (the router loads only configured adapters)"
                .into(),
        );
    };
    if let Some(victim) = &load.unload {
        let body = serde_json::json!({ "lora_name": &**victim });
        let (status, _) = post(state, url, "/v1/unload_lora_adapter", body).await?;
        // 404: already gone, which is what was wanted.
        let ok = status.is_success() || status == hyper::StatusCode::NOT_FOUND;
        adapters.count_unload(ok);
        if ok {
            tracing::info!(worker = %worker, adapter = %victim, "coldest LoRA adapter unloaded for a slot");
        }
    }
    let body = serde_json::json!({ "lora_name": &*load.adapter, "lora_path": &*path });
    let (status, text) = post(state, url, "/v1/load_lora_adapter", body).await?;
    if status.is_success() || (status == hyper::StatusCode::BAD_REQUEST && text.contains("already"))
    {
        Ok(())
    } else {
        Err(format!("the worker answered {}", status.as_u16()))
    }
}

/// POSTs JSON to a worker; its status and (bounded) body text.
async fn post(
    state: &AppState,
    url: &str,
    path: &str,
    body: serde_json::Value,
) -> Result<(hyper::StatusCode, String), String> {
    let mut request = hyper::Request::post(format!("{url}{path}"))
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(auth) = &state.upstream.worker_auth {
        request = request.header(hyper::header::AUTHORIZATION, auth.clone());
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|_| "cannot build the request".to_owned())?;
    let call = async {
        let response = state
            .upstream
            .client
            .request(request)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        Ok((status, body))
    };
    // A load waits for the weights; bounded by the first-token timeout
    // (the request waits for it before its first token).
    tokio::time::timeout(
        state
            .upstream
            .first_token_timeout
            .max(Duration::from_secs(1)),
        call,
    )
    .await
    .map_err(|_| "no answer in time".to_owned())?
}
