//! A request's flow (tenant, priority band, TTFT deadline) from its key and
//! headers, resolved by the core's [`FlowPolicy`] so that `serve` and
//! `replay` mean the same by a scenario.
//!
//! | source | what | limit | bad value |
//! |---|---|---|---|
//! | the client key's name (keys on), else the `tenant_header` | tenant | 64 bytes | unknown: the default tenant |
//! | `x-priority` | band: a name or an index (`0` highest) | 64 bytes | 400 |
//! | `x-slo-ttft-ms` | TTFT budget, whole ms | 1 to 3,600,000 | 400 |
//!
//! A band above the tenant's ceiling is capped to it, not refused.

use crate::error::ApiError;
use crate::front::auth::ClientKey;
use crate::state::AppState;
use axum::http::HeaderMap;
use switchyard_core::admission::{Flow, FlowError, MAX_NAME_BYTES};

/// The header that asks for a priority band.
pub const BAND_HEADER: &str = "x-priority";
/// The header that carries a TTFT budget in milliseconds.
pub const DEADLINE_HEADER: &str = "x-slo-ttft-ms";

/// A header's text, bounded: `None` when absent; a 400 when it is not
/// visible ASCII or longer than `max` bytes.
fn header<'a>(
    headers: &'a HeaderMap,
    name: &'static str,
    max: usize,
) -> Result<Option<&'a str>, ApiError> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    if value.len() > max {
        return Err(ApiError::bad_request(
            format!(
                "the {name} header is {} bytes, over the limit of {max}",
                value.len()
            ),
            None,
        ));
    }
    value
        .to_str()
        .map(Some)
        .map_err(|_| ApiError::bad_request(format!("the {name} header is not visible ASCII"), None))
}

/// The request's flow, arriving at `now_ms` on the dispatcher's clock; a
/// 400 for a band that does not exist, a deadline out of range or an
/// oversized header. Its expected output is left 0: the body says it.
pub(crate) fn resolve(
    state: &AppState,
    headers: &HeaderMap,
    key: Option<ClientKey>,
    now_ms: f64,
) -> Result<Flow, ApiError> {
    let band = header(headers, BAND_HEADER, MAX_NAME_BYTES)?;
    let budget = header(headers, DEADLINE_HEADER, 16)?;
    let tenant = match key.and_then(|k| state.intake.credentials.key_name(k)) {
        Some(name) => Some(name),
        None => match &state.intake.tenant_header {
            // An unknown or unreadable tenant is the default one: the
            // header only ever picks among configured tenants.
            Some(h) => headers
                .get(h)
                .filter(|v| v.len() <= MAX_NAME_BYTES)
                .and_then(|v| v.to_str().ok()),
            None => None,
        },
    };
    state
        .intake
        .flows
        .resolve(tenant, band, budget, 0, now_ms)
        .map_err(|e| {
            let message = e.to_string();
            match e {
                FlowError::UnknownBand(..) | FlowError::Deadline(_) => {
                    ApiError::bad_request(message, None)
                }
            }
        })
}
