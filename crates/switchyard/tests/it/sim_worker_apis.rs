//! The sim-worker's Responses and Anthropic Messages APIs, as a real
//! process on loopback driven by a real HTTP client.

use crate::support::{machine, sim_worker_with};
use serde_json::{json, Value};

fn worker() -> crate::support::Proc {
    sim_worker_with(0, &["--num-blocks", "1024", "--no-delay"])
}

async fn post(client: &reqwest::Client, url: String, body: &Value) -> (u16, Value) {
    let response = client.post(url).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

/// The `event:` names and data of a server-sent event stream (events
/// whose data is not JSON, such as `[DONE]`, left out), read by the wire
/// crate's parser.
pub(crate) fn events(text: &str) -> Vec<(String, Value)> {
    let mut parser = switchyard_wire::sse::SseParser::new(usize::MAX);
    parser.push(text.as_bytes());
    std::iter::from_fn(|| parser.next_event_named().unwrap())
        .filter_map(|e| {
            let data = serde_json::from_str(e.data()).ok()?;
            Some((e.name().unwrap_or_default().to_owned(), data))
        })
        .collect()
}

#[tokio::test]
async fn a_stored_response_is_continued_by_previous_response_id_from_its_cache() {
    let _machine = machine().await;
    let w = worker();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/responses", w.base);
    let long = "The yard routes every request to the worker that holds its prefix. ".repeat(20);
    let (status, first) = post(
        &client,
        url.clone(),
        &json!({"model": "switchyard-sim", "instructions": "Be brief.", "input": long, "max_output_tokens": 8}),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("resp_"), "{id}");
    assert_eq!(first["object"], "response");
    assert_eq!(first["usage"]["output_tokens"], 8);
    assert!(!first["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .is_empty());
    let first_input = first["usage"]["input_tokens"].as_u64().unwrap();

    let (status, second) = post(
        &client,
        url.clone(),
        &json!({"input": [{"role": "user", "content": "And then?"}], "previous_response_id": id, "max_output_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{second}");
    let input = second["usage"]["input_tokens"].as_u64().unwrap();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        input > first_input + 8,
        "the stored conversation is the prompt's prefix: {second}"
    );
    assert!(
        cached >= first_input / 16 * 16 - 16,
        "the chain hits its cache: {cached} of {input}"
    );
    assert_eq!(second["previous_response_id"], id.as_str());

    let got: Value = client
        .get(format!("{}/v1/responses/{id}", w.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["id"], id.as_str());
    let cancel = client
        .post(format!("{}/v1/responses/{id}/cancel", w.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        cancel.status(),
        400,
        "a finished response cannot be cancelled"
    );

    let (status, missing) = post(
        &client,
        url.clone(),
        &json!({"input": "x", "previous_response_id": "resp_nope"}),
    )
    .await;
    assert_eq!(status, 404, "{missing}");
    assert_eq!(missing["error"]["param"], "previous_response_id");
    let gone = client
        .get(format!("{}/v1/responses/resp_nope", w.base))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
}

#[tokio::test]
async fn a_streamed_response_sends_the_responses_events_and_is_stored() {
    let _machine = machine().await;
    let w = worker();
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/responses", w.base))
        .json(&json!({"input": "Hello there", "max_output_tokens": 5, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let events = events(&response.text().await.unwrap());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[0], "response.created");
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "response.output_text.delta")
            .count(),
        5
    );
    assert!(matches!(
        names.last(),
        Some(&("response.completed" | "response.incomplete"))
    ));
    for (name, data) in &events {
        assert_eq!(
            data["type"],
            name.as_str(),
            "each event's data names its event"
        );
    }
    let id = events[0].1["response"]["id"].as_str().unwrap();
    let stored = client
        .get(format!("{}/v1/responses/{id}", w.base))
        .send()
        .await
        .unwrap();
    assert_eq!(stored.status(), 200);
}

#[tokio::test]
async fn messages_answer_whole_and_streamed_and_count_their_tokens() {
    let _machine = machine().await;
    let w = worker();
    let client = reqwest::Client::new();
    let body = json!({"model": "switchyard-sim", "max_tokens": 6, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]});
    let (status, answer) = post(&client, format!("{}/v1/messages", w.base), &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["type"], "message");
    assert_eq!(answer["content"][0]["type"], "text");
    assert_eq!(answer["usage"]["output_tokens"], 6);
    let prompt = answer["usage"]["input_tokens"].as_u64().unwrap()
        + answer["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let (status, counted) = post(
        &client,
        format!("{}/v1/messages/count_tokens", w.base),
        &body,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(counted["input_tokens"].as_u64(), Some(prompt));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = client
        .post(format!("{}/v1/messages", w.base))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let names: Vec<String> = events(&text).into_iter().map(|(n, _)| n).collect();
    let deltas = names.iter().filter(|n| *n == "content_block_delta").count();
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(deltas, 6);
    assert_eq!(names.last().map(String::as_str), Some("message_stop"));

    let (status, refused) = post(
        &client,
        format!("{}/v1/messages", w.base),
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        refused["type"], "error",
        "an Anthropic error body: {refused}"
    );
    assert_eq!(refused["error"]["type"], "invalid_request_error");
}
