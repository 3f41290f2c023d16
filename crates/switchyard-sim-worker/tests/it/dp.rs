//! `--dp-size N` over a real socket: N ranks behind one port, a request
//! running on the rank its `X-data-parallel-rank` names, a header naming
//! no rank of the worker refused with a 400, `/metrics` labelled by rank.

use crate::support::{metric, serve_worker};
use serde_json::{json, Value};

async fn complete(base: &str, rank: Option<&str>, prompt: Vec<u32>) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 2}));
    if let Some(rank) = rank {
        request = request.header("X-Data-Parallel-Rank", rank);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

fn prompt(n: u32) -> Vec<u32> {
    (0..n).map(|t| 1000 + t).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_runs_on_the_rank_its_header_names() {
    let w = serve_worker(&["--dp-size", "3"]).await;
    let tokens = |rank: u32| {
        let base = w.base.clone();
        async move {
            metric(
                &base,
                &format!("switchyard_engine_prompt_tokens_total{{rank=\"{rank}\"}}"),
            )
            .await
        }
    };
    let info: Value = reqwest::get(format!("{}/get_server_info", w.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["dp_size"], 3);
    let (status, body) = complete(&w.base, Some("2"), prompt(40)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (tokens(0).await, tokens(1).await, tokens(2).await),
        (0.0, 0.0, 40.0)
    );
    // The same prompt on rank 2 again finds its blocks; on rank 1 it does not.
    let (status, _) = complete(&w.base, Some("1"), prompt(40)).await;
    assert_eq!(status, 200);
    assert_eq!(tokens(1).await, 40.0);
    let hits = |rank: u32| {
        let base = w.base.clone();
        async move {
            metric(
                &base,
                &format!("switchyard_engine_prefix_hit_tokens_total{{rank=\"{rank}\"}}"),
            )
            .await
        }
    };
    assert_eq!(hits(1).await, 0.0);
    let (status, _) = complete(&w.base, Some("2"), prompt(40)).await;
    assert_eq!(status, 200);
    assert!(hits(2).await > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_naming_no_rank_of_the_worker_is_a_400_and_no_header_is_the_balancers_choice() {
    let w = serve_worker(&["--dp-size", "2"]).await;
    for bad in ["2", "-1", "rank0"] {
        let (status, body) = complete(&w.base, Some(bad), prompt(8)).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("X-data-parallel-rank must be a rank of this worker, 0 to 1"),
            "{body}"
        );
    }
    // Without the header every request is served, on some rank.
    for i in 0..4 {
        let (status, _) = complete(&w.base, None, prompt(8 + i)).await;
        assert_eq!(status, 200);
    }
    let total = metric(&w.base, "switchyard_engine_prompt_tokens_total{rank=\"0\"}").await
        + metric(&w.base, "switchyard_engine_prompt_tokens_total{rank=\"1\"}").await;
    assert_eq!(total, (8 + 9 + 10 + 11) as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_one_rank_takes_rank_zero_and_refuses_others() {
    let w = serve_worker(&[]).await;
    assert_eq!(complete(&w.base, Some("0"), prompt(8)).await.0, 200);
    assert_eq!(complete(&w.base, Some("1"), prompt(8)).await.0, 400);
    // Its metrics carry no rank label.
    assert_eq!(
        metric(&w.base, "switchyard_engine_prompt_tokens_total").await,
        8.0
    );
}
