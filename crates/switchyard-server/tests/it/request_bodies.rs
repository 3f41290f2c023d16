//! Property tests over the request bodies of `/v1/chat/completions` and
//! `/v1/completions`: whatever the bytes, the router's real axum app never
//! panics and answers every request it cannot serve with an OpenAI-style
//! error object. The app runs in-process with the real tokenizer and no
//! worker, so a body that parses ends in 503 "no worker" and every other
//! one in a 4xx; nothing leaves the process. (`fuzz/` has the same check as
//! a cargo-fuzz target for longer runs.)

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::sync::{Arc, OnceLock};
use switchyard_server::standalone::{app_without_workers, check_error_answer};
use switchyard_server::tokenize::HfTokenizer;
use tower::ServiceExt;

const MAX_BODY: usize = 64 * 1024;

struct Rig {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

/// One app for every case: building the tokenizer is the slow part.
fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let tokenizer = Arc::new(HfTokenizer(
            switchyard_tokenizer::Tokenizer::bundled().unwrap(),
        ));
        let app = runtime
            .block_on(async { app_without_workers(tokenizer, MAX_BODY) })
            .unwrap();
        Rig { runtime, app }
    })
}

/// POSTs `body` to `path`; returns the status and the parsed JSON body.
fn post(path: &str, body: Vec<u8>) -> (StatusCode, Value) {
    let rig = rig();
    rig.runtime.block_on(async {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let response = rig.app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        if let Err(why) = check_error_answer(status.as_u16(), &bytes) {
            panic!("{why}");
        }
        (status, serde_json::from_slice(&bytes).unwrap())
    })
}

/// The contract ([`check_error_answer`], which [`post`] already applies):
/// an OpenAI error object, 4xx for the client's mistakes, 503 only for a
/// body that parsed.
fn assert_openai_error(status: StatusCode, body: &Value) {
    if let Err(why) = check_error_answer(status.as_u16(), body.to_string().as_bytes()) {
        panic!("{why}");
    }
}

const PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// Any JSON value, nested a few levels, numbers of every size.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(".{0,12}", inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A field's value: usually the right type, often a wrong one.
fn text_or_junk() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => "[a-zA-Z ]{0,60}".prop_map(Value::String),
        1 => any_json(),
    ]
}

fn token_ids() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::collection::vec(0u32..200_000, 0..300).prop_map(|v| json!(v)),
        // Out of u32 range, negative, fractional, mixed.
        prop::collection::vec(
            prop_oneof![
                any::<i64>().prop_map(|n| json!(n)),
                Just(json!(u64::MAX)),
                Just(json!(1e300)),
                Just(json!(-0.5)),
                Just(json!("7")),
            ],
            1..20
        )
        .prop_map(Value::Array),
    ]
}

/// Chat bodies close to valid: right keys, values sometimes of the wrong
/// type, extra keys, huge numbers.
fn near_chat() -> impl Strategy<Value = Value> {
    let message = (
        prop_oneof![
            4 => prop_oneof![Just("user"), Just("system"), Just("assistant"), Just("tool")]
                .prop_map(|r| json!(r)),
            1 => any_json(),
        ],
        prop_oneof![
            3 => text_or_junk(),
            1 => prop::collection::vec(
                prop_oneof![
                    "[a-z ]{0,20}".prop_map(|t| json!({"type": "text", "text": t})),
                    Just(json!({"type": "image_url", "image_url": {"url": "http://x/y.png"}})),
                    any_json(),
                ],
                0..4
            )
            .prop_map(Value::Array),
        ],
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    (
        prop_oneof![
            3 => prop::collection::vec(message, 0..5).prop_map(Value::Array),
            1 => any_json(),
        ],
        prop::option::of(text_or_junk()),
        prop::option::of(any_json()),
        prop::option::of(prop_oneof![any::<u64>().prop_map(|n| json!(n)), any_json()]),
        prop::option::of(any_json()),
    )
        .prop_map(|(messages, model, stream, max_tokens, extra)| {
            let mut body = json!({ "messages": messages });
            if let Some(model) = model {
                body["model"] = model;
            }
            if let Some(stream) = stream {
                body["stream"] = stream;
            }
            if let Some(max_tokens) = max_tokens {
                body["max_tokens"] = max_tokens;
            }
            if let Some(extra) = extra {
                body["session_id"] = extra;
            }
            body
        })
}

/// Completion bodies close to valid, in every prompt shape.
fn near_completion() -> impl Strategy<Value = Value> {
    (
        prop_oneof![
            text_or_junk(),
            token_ids(),
            prop::collection::vec("[a-z ]{0,30}", 0..4).prop_map(|v| json!(v)),
            prop::collection::vec(token_ids(), 0..3).prop_map(Value::Array),
            any_json(),
        ],
        prop::option::of(text_or_junk()),
        prop::option::of(any_json()),
    )
        .prop_map(|(prompt, model, stream)| {
            let mut body = json!({ "prompt": prompt });
            if let Some(model) = model {
                body["model"] = model;
            }
            if let Some(stream) = stream {
                body["stream"] = stream;
            }
            body
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_get_an_openai_error(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        path in prop::sample::select(&PATHS[..]),
    ) {
        let parses = serde_json::from_slice::<Value>(&bytes).is_ok();
        let (status, body) = post(path, bytes);
        assert_openai_error(status, &body);
        if !parses {
            prop_assert_eq!(status, StatusCode::BAD_REQUEST, "{}", body);
        }
    }

    #[test]
    fn arbitrary_json_values_get_an_openai_error(
        value in any_json(),
        path in prop::sample::select(&PATHS[..]),
    ) {
        let is_object = value.is_object();
        let (status, body) = post(path, value.to_string().into_bytes());
        assert_openai_error(status, &body);
        if !is_object {
            prop_assert_eq!(status, StatusCode::BAD_REQUEST, "{}", body);
        }
    }

    #[test]
    fn near_valid_chat_bodies_get_an_openai_error(value in near_chat()) {
        let (status, body) = post("/v1/chat/completions", value.to_string().into_bytes());
        assert_openai_error(status, &body);
        let messages_ok = value["messages"].as_array().is_some_and(|m| !m.is_empty());
        if !messages_ok {
            prop_assert_eq!(status, StatusCode::BAD_REQUEST, "{}", body);
        }
    }

    #[test]
    fn near_valid_completion_bodies_get_an_openai_error(value in near_completion()) {
        let (status, body) = post("/v1/completions", value.to_string().into_bytes());
        assert_openai_error(status, &body);
        let ids_out_of_range = value["prompt"].as_array().is_some_and(|a| {
            a.iter().any(|x| x.is_number() && x.as_u64().is_none_or(|n| n > u64::from(u32::MAX)))
        });
        if ids_out_of_range {
            prop_assert_eq!(status, StatusCode::BAD_REQUEST, "{}", body);
        }
    }
}

#[test]
fn bodies_over_the_limit_get_413_and_a_valid_body_without_workers_gets_503() {
    let (status, body) = post("/v1/completions", vec![b' '; MAX_BODY + 1]);
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_openai_error(status, &body);
    let (status, body) = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .into_bytes(),
    );
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_openai_error(status, &body);
}
