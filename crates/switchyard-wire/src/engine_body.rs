//! What of a client's body the engine is not told: the fields an engine
//! reads that would let one client act outside its tenant.
//!
//! | field | engine's meaning | forwarded as |
//! |---|---|---|
//! | `priority` | vLLM's and SGLang's scheduling priority (lower first, with `--scheduling-policy priority`) | the value the request's band maps to (`engine_priority` of its `[[flow.bands]]`), else removed |
//! | `request_id` | vLLM's request id, and a Responses request's response id | removed: the engine makes its own |
//!
//! A client's band is decided by the router (its key's tenant, capped by
//! the tenant's ceiling); an engine-side priority in the
//! body would let a sheddable tenant jump every queue the router keeps,
//! so the band alone speaks for it. A client-chosen `request_id` would let
//! a key answer under another key's response id; the engine's own ids
//! are random.
//!
//! Cost when unused: a body that names neither field, with no band
//! mapped, is forwarded as the same buffer (one `memchr` scan for each
//! name); only a body that names one (anywhere: a top-level check needs
//! a parse) is read into its top-level fields and written again
//! ([`crate::body_fields::Fields`], no JSON tree).

use crate::body_fields::Fields;
use memchr::memmem;

/// The body's `priority` field.
const PRIORITY: &str = "priority";
/// The body's `request_id` field.
const REQUEST_ID: &str = "request_id";

/// `body` as the engine gets it: `request_id` removed, `priority` set to
/// `priority` (the request's band's mapping) or removed when none;
/// `Ok(None)` when there is nothing to change (the same buffer goes), an
/// error when a body that names either is no JSON object.
pub fn engine_body(body: &[u8], priority: Option<i64>) -> Result<Option<Vec<u8>>, String> {
    let names = |quoted: &[u8]| memmem::find(body, quoted).is_some();
    if priority.is_none() && !names(b"\"priority\"") && !names(b"\"request_id\"") {
        return Ok(None);
    }
    let mut fields = Fields::parse(body).map_err(|e| e.to_string())?;
    let had = fields.has(PRIORITY) || fields.has(REQUEST_ID);
    fields.remove(REQUEST_ID);
    match priority {
        Some(p) => fields.set(PRIORITY, &p),
        None if had => fields.remove(PRIORITY),
        None => return Ok(None),
    }
    Ok(Some(fields.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn rewritten(body: &Value, priority: Option<i64>) -> Value {
        let bytes = serde_json::to_vec(body).unwrap();
        let out = engine_body(&bytes, priority).unwrap().unwrap_or(bytes);
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn a_clients_priority_is_replaced_by_its_bands_or_removed() {
        let body = json!({"model": "m", "prompt": "x", "priority": -100});
        assert_eq!(
            rewritten(&body, Some(5)),
            json!({"model": "m", "prompt": "x", "priority": 5})
        );
        assert_eq!(rewritten(&body, None), json!({"model": "m", "prompt": "x"}));
        // A band's mapping is set even when the client named none.
        assert_eq!(
            rewritten(&json!({"prompt": "x"}), Some(-1)),
            json!({"prompt": "x", "priority": -1})
        );
    }

    #[test]
    fn a_clients_request_id_never_reaches_the_engine() {
        let body = json!({"input": "hi", "request_id": "resp_of_another_key"});
        assert_eq!(rewritten(&body, None), json!({"input": "hi"}));
        assert_eq!(
            rewritten(&body, Some(0)),
            json!({"input": "hi", "priority": 0})
        );
    }

    #[test]
    fn a_body_naming_neither_is_left_as_it_is() {
        let body = br#"{"model":"m","messages":[]}"#;
        assert_eq!(engine_body(body, None), Ok(None));
        // Named only inside content: parsed, nothing to change, unchanged.
        let inner = br#"{"messages":[{"role":"user","content":"\"priority\""}]}"#;
        assert_eq!(engine_body(inner, None), Ok(None));
    }

    #[test]
    fn the_last_of_duplicated_fields_is_the_one_removed_with_the_rest() {
        // An engine's JSON reader keeps the last of duplicated names; the
        // rewrite drops every one.
        let body = br#"{"priority": 1, "prompt": "x", "priority": -9}"#;
        let out: Value =
            serde_json::from_slice(&engine_body(body, None).unwrap().unwrap()).unwrap();
        assert_eq!(out, json!({"prompt": "x"}));
    }
}
