//! Prefill/decode disaggregation's bodies, sans I/O: what the router
//! sends each half and reads of their answers, per engine family.
//!
//! - vLLM: the prefill request is the client's body asking for a remote
//!   decode, one token, no stream ([`vllm_prefill_body`]); its answer's
//!   `kv_transfer_params` ([`transfer_params`], bounded) go whole into the
//!   decode request ([`vllm_decode_body`]).
//! - SGLang: the client's body plus the prefill worker's bootstrap host,
//!   port and a room, to both workers ([`sglang_body`]).
//! - A decode worker's error answer that says its KV transfer failed,
//!   rather than the worker ([`transfer_failed`]): the prefill is done
//!   again, the decode worker is not reported.
//!
//! Placement, sequencing and which half a failure retries are the core's
//! (`switchyard_core::dispatch::split`, `recovery`); the sockets are the
//! router's. The fixtures the tests compare against are the sim-worker's
//! (`crates/switchyard-sim-worker/tests/fixtures/disagg/`), written from
//! the engines' public code (its README says where).

use crate::body_fields::Fields;
use serde_json::value::RawValue;
use serde_json::Value;

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Largest `kv_transfer_params` object forwarded from a prefill answer,
/// serialized; a larger one is the prefill worker's failure.
pub const MAX_TRANSFER_PARAMS_BYTES: usize = 64 * 1024;

/// A body that is no JSON object: nothing to add fields to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotAnObject;

/// The client's body by field, without a JSON tree
/// ([`crate::body_fields`]): a 32 MiB prompt costs a slice, not a value
/// per token id.
fn object(body: &[u8]) -> Result<Fields<'_>, NotAnObject> {
    Fields::parse(body).map_err(|_| NotAnObject)
}

/// vLLM's prefill request for the client's `body`: asks for a remote
/// decode, one token, no stream (see the sim-worker's fixtures,
/// `vllm_prefill_request.json`).
pub fn vllm_prefill_body(body: &[u8]) -> Result<Vec<u8>, NotAnObject> {
    let mut fields = object(body)?;
    fields.set(
        "kv_transfer_params",
        &serde_json::json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    fields.set("stream", &false);
    fields.set("max_tokens", &1);
    if fields.has("max_completion_tokens") {
        fields.set("max_completion_tokens", &1);
    }
    fields.remove("stream_options");
    fields.remove("min_tokens");
    Ok(fields.to_vec())
}

/// vLLM's decode request: the client's `body` with the prefill answer's
/// `kv_transfer_params` (none: the decode worker computes the prompt).
pub fn vllm_decode_body(body: &[u8], params: Option<&RawValue>) -> Result<Vec<u8>, NotAnObject> {
    let mut fields = object(body)?;
    match params {
        Some(p) => fields.set_raw("kv_transfer_params", p.to_owned()),
        None => fields.remove("kv_transfer_params"),
    }
    Ok(fields.to_vec())
}

/// SGLang's request to both workers: the client's `body` with the
/// prefill worker's bootstrap address and the room.
pub fn sglang_body(body: &[u8], host: &str, port: u16, room: u64) -> Result<Vec<u8>, NotAnObject> {
    let mut fields = object(body)?;
    fields.set("bootstrap_host", &host);
    fields.set("bootstrap_port", &port);
    fields.set("bootstrap_room", &room);
    Ok(fields.to_vec())
}

/// The `kv_transfer_params` of a prefill worker's whole answer, as its
/// JSON text: `None` when absent or null (nothing captured: the decode
/// computes the prompt); `Err` when it is not an object or past
/// [`MAX_TRANSFER_PARAMS_BYTES`] (the worker's failure). The object is
/// forwarded as written: the decode worker validates its fields.
pub fn transfer_params(answer: &[u8]) -> Result<Option<Box<RawValue>>, String> {
    let Ok(answer) = Fields::parse(answer) else {
        return Err("the prefill answer is not a JSON object".to_owned());
    };
    let Some(params) = answer.get("kv_transfer_params") else {
        return Ok(None);
    };
    if !crate::body_fields::is_object(params) {
        return Err("the prefill answer's kv_transfer_params is not an object".into());
    }
    let size = params.get().len();
    if size > MAX_TRANSFER_PARAMS_BYTES {
        return Err(format!(
            "the prefill answer's kv_transfer_params ({size} bytes) exceed {MAX_TRANSFER_PARAMS_BYTES}"
        ));
    }
    Ok(Some(params.to_owned()))
}

/// Whether a decode worker's error answer says its KV transfer failed
/// rather than the worker itself: a 404 naming `kv_transfer_params` (the
/// lease or room is unknown, released or expired), or a 502/504 whose
/// message names the prefill worker or the transferred KV (unreachable,
/// the room never held, an invalid or wrong transfer) — the sim-worker's
/// answers (docs/disaggregation.md, "Failures").
pub fn transfer_failed(status: u16, body: &[u8]) -> bool {
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let Some(error) = map.get("error") else {
        return false;
    };
    let param = error.get("param").and_then(Value::as_str);
    let message = error.get("message").and_then(Value::as_str).unwrap_or("");
    match status {
        404 => param == Some("kv_transfer_params"),
        502 | 504 => {
            param == Some("kv_transfer_params")
                || message.contains("prefill worker")
                || message.contains("transferred KV")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURES: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../switchyard-sim-worker/tests/fixtures/disagg/"
    );

    fn fixture(name: &str) -> Value {
        let text = std::fs::read_to_string(format!("{FIXTURES}{name}")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn the_vllm_bodies_are_the_fixtures() {
        let client = serde_json::to_vec(&fixture("vllm_client_request.json")).unwrap();
        let prefill: Value = serde_json::from_slice(&vllm_prefill_body(&client).unwrap()).unwrap();
        assert_eq!(prefill, fixture("vllm_prefill_request.json"));
        let answer = serde_json::to_vec(&fixture("vllm_prefill_response.json")).unwrap();
        let params = transfer_params(&answer).unwrap();
        let decode: Value =
            serde_json::from_slice(&vllm_decode_body(&client, params.as_deref()).unwrap()).unwrap();
        assert_eq!(decode, fixture("vllm_decode_request.json"));
        // With max_completion_tokens, both are 1.
        let chat = br#"{"messages":[],"max_completion_tokens":9,"stream":true}"#;
        let prefill: Value = serde_json::from_slice(&vllm_prefill_body(chat).unwrap()).unwrap();
        assert_eq!(prefill["max_completion_tokens"], 1);
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["stream"], false);
    }

    #[test]
    fn the_sglang_body_is_the_fixture() {
        let mut expected = fixture("sglang_request.json");
        let room = expected["bootstrap_room"].as_u64().unwrap();
        let client = {
            let map = expected.as_object_mut().unwrap();
            let mut c = map.clone();
            for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
                c.remove(k);
            }
            serde_json::to_vec(&c).unwrap()
        };
        let body: Value =
            serde_json::from_slice(&sglang_body(&client, "127.0.0.1", 8998, room).unwrap())
                .unwrap();
        assert_eq!(body, expected);
    }

    #[test]
    fn transfer_params_are_an_object_or_nothing_and_bounded() {
        assert!(matches!(transfer_params(br#"{"choices":[]}"#), Ok(None)));
        assert!(matches!(
            transfer_params(br#"{"kv_transfer_params":null}"#),
            Ok(None)
        ));
        assert!(transfer_params(br#"{"kv_transfer_params":[1]}"#).is_err());
        assert!(transfer_params(b"[]").is_err());
        assert!(transfer_params(b"not json").is_err());
        let big = format!(
            r#"{{"kv_transfer_params":{{"x":"{}"}}}}"#,
            "a".repeat(MAX_TRANSFER_PARAMS_BYTES)
        );
        assert!(transfer_params(big.as_bytes()).is_err());
    }

    #[test]
    fn a_transfer_failure_is_told_from_a_worker_failure() {
        let lease = br#"{"error":{"message":"the prefill worker holds no such KV","type":"not_found_error","param":"kv_transfer_params","code":null}}"#;
        assert!(transfer_failed(404, lease));
        let model = br#"{"error":{"message":"the model `x` does not exist","param":"model"}}"#;
        assert!(!transfer_failed(404, model));
        let unreachable =
            br#"{"error":{"message":"the prefill worker is unreachable: refused","param":null}}"#;
        assert!(transfer_failed(502, unreachable));
        assert!(transfer_failed(
            504,
            br#"{"error":{"message":"the prefill worker did not hold the room in time"}}"#
        ));
        assert!(!transfer_failed(500, unreachable));
        assert!(!transfer_failed(502, b"oops"));
    }
}
