//! Any request body POSTed to `/v1/chat/completions` or `/v1/completions`
//! (the first input byte chooses) must get an OpenAI-style error from the
//! router's real axum app — 4xx, or 503 when it parsed but no worker
//! exists — and never a panic. Same contract as the proptests in
//! `crates/switchyard-server/tests/it/request_bodies.rs`, for longer runs.
#![no_main]

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use switchyard_server::standalone::{app_without_workers, check_error_answer};
use switchyard_server::tokenize::HfTokenizer;
use tower::ServiceExt;

struct Rig {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let tokenizer = Arc::new(HfTokenizer(
            switchyard_tokenizer::Tokenizer::bundled().expect("the bundled tokenizer"),
        ));
        let app = runtime
            .block_on(async { app_without_workers(tokenizer, 1 << 20) })
            .expect("the app");
        Rig { runtime, app }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let path = if selector % 2 == 0 {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let rig = rig();
    rig.runtime.block_on(async {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec()))
            .expect("a request");
        let response = rig.app.clone().oneshot(request).await.expect("infallible");
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("an in-memory body")
            .to_bytes();
        if let Err(why) = check_error_answer(status, &bytes) {
            panic!("{path}: {why}");
        }
    });
});
