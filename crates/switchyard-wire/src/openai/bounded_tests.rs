//! The bounded parsers against a naive reference that reads the same body
//! as a `serde_json::Value` tree, and their bounds.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};

/// What the reference makes of a body.
#[derive(Debug, PartialEq)]
enum Outcome<T> {
    Ok(T),
    Over(Limit),
    Invalid,
}

fn outcome<T>(result: Result<T, BodyError>) -> Outcome<T> {
    match result {
        Ok(v) => Outcome::Ok(v),
        Err(BodyError::Over(o)) => Outcome::Over(o.limit),
        Err(BodyError::Json(_)) => Outcome::Invalid,
    }
}

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|id| u32::try_from(id).ok())
}

/// A token-id list read in order: a bad id before the bound is invalid, a
/// good one past it is over.
fn reference_ids(items: &[Value], limits: &BodyLimits) -> Result<Vec<u32>, Outcome<()>> {
    let mut ids = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let id = token_id(item).ok_or(Outcome::Invalid)?;
        if i >= limits.prompt_tokens {
            return Err(Outcome::Over(Limit::PromptTokens));
        }
        ids.push(id);
    }
    Ok(ids)
}

/// The prompt as the bounded parser must read it, from the JSON tree.
fn reference_prompt(v: &Value, limits: &BodyLimits) -> Outcome<Prompt> {
    let reference = || -> Result<Prompt, Outcome<()>> {
        match v {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(items) => match items.first() {
                None => Ok(Prompt::Tokens(Vec::new())),
                Some(Value::String(_)) => {
                    let mut texts = Vec::new();
                    for item in items {
                        texts.push(item.as_str().ok_or(Outcome::Invalid)?.to_owned());
                    }
                    if limits.first_prompt_only {
                        texts.truncate(1);
                    }
                    Ok(Prompt::Texts(texts))
                }
                Some(Value::Array(_)) => {
                    let mut batch = Vec::new();
                    for item in items {
                        let inner = item.as_array().ok_or(Outcome::Invalid)?;
                        batch.push(reference_ids(inner, limits)?);
                    }
                    if limits.first_prompt_only {
                        batch.truncate(1);
                    }
                    Ok(Prompt::TokenBatches(batch))
                }
                Some(_) => reference_ids(items, limits).map(Prompt::Tokens),
            },
            _ => Err(Outcome::Invalid),
        }
    };
    match reference() {
        Ok(p) => Outcome::Ok(p),
        Err(Outcome::Over(l)) => Outcome::Over(l),
        Err(_) => Outcome::Invalid,
    }
}

/// The messages as the bounded parser must read them. Keys reach it in
/// the text's order; `serde_json` writes a tree's keys sorted, so
/// `content` comes before `role`.
fn reference_messages(v: &Value, limits: &BodyLimits) -> Outcome<Vec<Message>> {
    let Some(items) = v.as_array() else {
        return Outcome::Invalid;
    };
    let mut parts_seen = 0usize;
    let mut messages = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let Some(object) = item.as_object() else {
            return Outcome::Invalid;
        };
        let content = match object.get("content") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(MessageContent::Text(s.clone())),
            Some(Value::Array(parts)) => {
                let mut read = Vec::new();
                for part in parts {
                    if parts_seen >= limits.content_parts {
                        return Outcome::Over(Limit::ContentParts);
                    }
                    parts_seen += 1;
                    read.push(serde_json::from_value::<ContentPart>(part.clone()).unwrap());
                }
                Some(MessageContent::Parts(read))
            }
            Some(_) => Some(MessageContent::Invalid),
        };
        let Some(Value::String(role)) = object.get("role") else {
            return Outcome::Invalid;
        };
        if i >= limits.messages {
            return Outcome::Over(Limit::Messages);
        }
        messages.push(Message {
            role: role.clone(),
            content,
            tool_calls: Vec::new(),
            reasoning: None,
        });
    }
    Outcome::Ok(messages)
}

/// A JSON value that is sometimes a token id and sometimes not.
fn token_like() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => (0u32..200_000).prop_map(Value::from),
        1 => Just(json!(u32::MAX)),
        1 => Just(json!(u64::from(u32::MAX) + 1)),
        1 => Just(json!(-1)),
        1 => Just(json!(1.5)),
        1 => "[a-z]{0,3}".prop_map(Value::from),
        1 => Just(Value::Null),
    ]
}

fn string_like() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => "[a-zé\"\\\\ ]{0,6}".prop_map(Value::from),
        1 => (0u32..9).prop_map(Value::from),
        1 => Just(json!([])),
    ]
}

fn prompt_like() -> impl Strategy<Value = Value> {
    prop_oneof![
        2 => "[a-z ]{0,8}".prop_map(Value::from),
        4 => prop::collection::vec(token_like(), 0..10).prop_map(Value::from),
        3 => prop::collection::vec(string_like(), 1..6).prop_map(Value::from),
        4 => prop::collection::vec(
            prop_oneof![
                8 => prop::collection::vec(token_like(), 0..8).prop_map(Value::from),
                1 => token_like(),
            ],
            1..6
        )
        .prop_map(Value::from),
        1 => Just(json!({"x": 1})),
        1 => Just(Value::Null),
        1 => Just(json!(true)),
    ]
}

fn part_like() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => "[a-z]{0,4}".prop_map(|t| json!({"type": "text", "text": t})),
        1 => Just(json!({"type": "image_url", "image_url": {"url": "http://x/y.png"}})),
        1 => Just(json!({})),
        1 => Just(json!(7)),
    ]
}

fn message_like() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        4 => "[a-z ]{0,6}".prop_map(Value::from),
        3 => prop::collection::vec(part_like(), 0..4).prop_map(Value::from),
        1 => Just(Value::Null),
        1 => Just(json!(5)),
        1 => Just(json!({"text": "x"})),
    ];
    let role = prop_oneof![
        8 => prop_oneof![Just("user"), Just("assistant"), Just("system")].prop_map(Value::from),
        1 => Just(json!(5)),
        1 => Just(Value::Null),
    ];
    (role, content, any::<bool>(), any::<bool>()).prop_map(
        |(role, content, has_role, has_content)| {
            // Keys in one order (the bounded reader meets them in the
            // body's order): content, name, role.
            let mut m = serde_json::Map::new();
            if has_content {
                m.insert("content".into(), content);
            }
            m.insert("name".into(), json!("x"));
            if has_role || role.is_null() {
                m.insert("role".into(), role);
            }
            Value::Object(m)
        },
    )
}

fn limits() -> impl Strategy<Value = BodyLimits> {
    (1usize..10, 1usize..8, 0usize..10, any::<bool>()).prop_map(
        |(prompt_tokens, messages, content_parts, first_prompt_only)| BodyLimits {
            prompt_tokens,
            messages,
            content_parts,
            first_prompt_only,
        },
    )
}

proptest! {
    #[test]
    fn a_bounded_prompt_agrees_with_the_json_tree(prompt in prompt_like(), limits in limits()) {
        let body = json!({"model": "m", "prompt": prompt, "n": 2}).to_string();
        let ours = outcome(CompletionRequest::from_json(body.as_bytes(), &limits).map(|r| r.prompt));
        prop_assert_eq!(ours, reference_prompt(&prompt, &limits));
        // Unbounded, it agrees with the plain impl, from text and from a tree.
        let unbounded = outcome(CompletionRequest::from_json(body.as_bytes(), &BodyLimits::NONE).map(|r| r.prompt));
        prop_assert_eq!(&unbounded, &reference_prompt(&prompt, &BodyLimits::NONE));
        let plain = serde_json::from_str::<CompletionRequest>(&body).map(|r| r.prompt).ok();
        let tree = serde_json::from_value::<CompletionRequest>(serde_json::from_str(&body).unwrap()).map(|r| r.prompt).ok();
        let expected = match unbounded { Outcome::Ok(p) => Some(p), _ => None };
        prop_assert_eq!(&plain, &expected);
        prop_assert_eq!(&tree, &expected);
    }

    #[test]
    fn bounded_messages_agree_with_the_json_tree(
        messages in prop::collection::vec(message_like(), 0..10),
        limits in limits(),
    ) {
        let messages = Value::from(messages);
        let body = json!({"messages": messages, "stream": true}).to_string();
        let ours = outcome(ChatCompletionRequest::from_json(body.as_bytes(), &limits).map(|r| r.messages));
        prop_assert_eq!(ours, reference_messages(&messages, &limits));
        let plain = serde_json::from_str::<ChatCompletionRequest>(&body).map(|r| r.messages).ok();
        let expected = match reference_messages(&messages, &BodyLimits::NONE) {
            Outcome::Ok(m) => Some(m),
            _ => None,
        };
        prop_assert_eq!(plain, expected);
    }
}

fn limits_of(prompt_tokens: usize, messages: usize, content_parts: usize) -> BodyLimits {
    BodyLimits {
        prompt_tokens,
        messages,
        content_parts,
        first_prompt_only: true,
    }
}

#[test]
fn a_prompt_past_its_bound_is_refused_naming_the_bound() {
    let limits = limits_of(3, 10, 10);
    let over = |body: &str| match CompletionRequest::from_json(body.as_bytes(), &limits) {
        Err(BodyError::Over(o)) => Some(o),
        _ => None,
    };
    let expected = Some(OverLimit {
        limit: Limit::PromptTokens,
        max: 3,
    });
    assert_eq!(over(r#"{"prompt": [1, 2, 3, 4]}"#), expected);
    assert_eq!(over(r#"{"prompt": [[1], [1, 2, 3, 4]]}"#), expected);
    // Refused where the bound is passed: what follows is never read.
    assert_eq!(over(r#"{"prompt": [1, 2, 3, 4, "#), expected);
    assert_eq!(over(r#"{"prompt": [1, 2, 3]}"#), None);
    assert_eq!(Limit::PromptTokens.param(), "prompt");
}

#[test]
fn a_router_keeps_only_the_first_prompt_of_a_batch_and_checks_the_rest() {
    let limits = limits_of(3, 10, 10);
    let parse = |body: &str| CompletionRequest::from_json(body.as_bytes(), &limits);
    let batch = parse(r#"{"prompt": [[1, 2], [3], [4, 5, 6]]}"#).unwrap();
    assert_eq!(batch.prompt, Prompt::TokenBatches(vec![vec![1, 2]]));
    let texts = parse(r#"{"prompt": ["a", "b\n"]}"#).unwrap();
    assert_eq!(texts.prompt, Prompt::Texts(vec!["a".into()]));
    assert!(matches!(
        parse(r#"{"prompt": ["a", 1]}"#),
        Err(BodyError::Json(_))
    ));
    assert!(matches!(
        parse(r#"{"prompt": [[1], [2, -1]]}"#),
        Err(BodyError::Json(_))
    ));
}

#[test]
fn a_chat_past_its_bounds_is_refused_before_the_rest_is_read() {
    let limits = limits_of(10, 2, 3);
    let chat = |body: &str| match ChatCompletionRequest::from_json(body.as_bytes(), &limits) {
        Err(BodyError::Over(o)) => Some(o),
        Ok(_) => None,
        Err(BodyError::Json(e)) => panic!("{body}: {e}"),
    };
    let m = r#"{"role": "user", "content": ""}"#;
    assert_eq!(chat(&format!(r#"{{"messages": [{m}, {m}]}}"#)), None);
    assert_eq!(
        chat(&format!(r#"{{"messages": [{m}, {m}, {m}, "#)),
        Some(OverLimit {
            limit: Limit::Messages,
            max: 2
        })
    );
    let parts = r#"{"role": "user", "content": [{"text": "a"}, {"text": "b"}]}"#;
    assert_eq!(
        chat(&format!(r#"{{"messages": [{parts}, {parts}]}}"#)),
        Some(OverLimit {
            limit: Limit::ContentParts,
            max: 3
        })
    );
    assert_eq!(Limit::Messages.param(), "messages");
    assert_eq!(Limit::ContentParts.param(), "messages");
}

#[test]
fn fields_keep_their_derived_rules() {
    let parse = |v: Value| serde_json::from_str::<CompletionRequest>(&v.to_string());
    let duplicate = r#"{"prompt": "a", "prompt": "b"}"#;
    let error = serde_json::from_str::<CompletionRequest>(duplicate).unwrap_err();
    assert!(
        error.to_string().contains("duplicate field `prompt`"),
        "{error}"
    );
    let error = parse(json!({"model": "m"})).unwrap_err();
    assert!(
        error.to_string().contains("missing field `prompt`"),
        "{error}"
    );
    let error = serde_json::from_str::<ChatCompletionRequest>("{}").unwrap_err();
    assert!(
        error.to_string().contains("missing field `messages`"),
        "{error}"
    );
    let error = serde_json::from_str::<ChatCompletionRequest>(r#"{"messages": [{}]}"#).unwrap_err();
    assert!(
        error.to_string().contains("missing field `role`"),
        "{error}"
    );
    assert!(parse(json!({"prompt": "x", "stream": null})).is_err());
    let nulls =
        parse(json!({"prompt": "x", "model": null, "n": null, "session_id": null})).unwrap();
    assert_eq!((nulls.model, nulls.n, nulls.session_id), (None, None, None));
    // Trailing bytes after the object are refused.
    assert!(matches!(
        CompletionRequest::from_json(br#"{"prompt": "x"} x"#, &BodyLimits::NONE),
        Err(BodyError::Json(_))
    ));
}

/// The untagged retry `Lenient` was before it judged in one pass: the
/// reference (it buffers the value into a generic tree).
fn untagged<T: serde::de::DeserializeOwned>(v: &Value) -> Lenient<T> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Repr<T> {
        Valid(T),
        Invalid(serde::de::IgnoredAny),
    }
    match serde_json::from_value::<Repr<T>>(v.clone()).unwrap() {
        Repr::Valid(v) => Lenient::Valid(v),
        Repr::Invalid(_) => Lenient::Invalid,
    }
}

/// A count as the engines' lax integer parsing reads it, the naive way:
/// an integer, an integral float or a string of digits (optionally `.`
/// and zeros), within `u32`.
fn count_reference(v: &Value) -> Lenient<u32> {
    let number = match v {
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(u), _) => Some(u as f64),
            (None, Some(f)) if f.fract() == 0.0 => Some(f),
            _ => None,
        },
        Value::String(s) => {
            let re_digits = |d: &str| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit());
            let (digits, zeros) = s.split_once('.').unwrap_or((s, ""));
            (re_digits(digits) && zeros.chars().all(|c| c == '0'))
                .then(|| digits.parse::<f64>().unwrap())
        }
        _ => None,
    };
    match number {
        Some(n) if (0.0..=f64::from(u32::MAX)).contains(&n) => Lenient::Valid(n as u32),
        _ => Lenient::Invalid,
    }
}

fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..5).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e10f64..1e10).prop_map(Value::from),
        (0u32..10_000).prop_map(|n| Value::from(f64::from(n))),
        "[a-z_]{0,14}".prop_map(Value::from),
        "[0-9]{0,12}(\\.[0-9]{0,2})?".prop_map(Value::from),
        Just(json!("include_usage")),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::vec(
                (
                    prop_oneof![Just("include_usage".to_owned()), "[a-z]{1,3}"],
                    inner
                ),
                0..3
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn a_lenient_field_judges_as_the_untagged_retry_did(v in any_value()) {
        let text = v.to_string();
        prop_assert_eq!(serde_json::from_str::<Lenient<u32>>(&text).unwrap(), count_reference(&v));
        prop_assert_eq!(serde_json::from_str::<Lenient<bool>>(&text).unwrap(), untagged::<bool>(&v));
        // An array was read as the struct's fields in order; no client
        // sends one, and it is now invalid.
        let options = serde_json::from_str::<Lenient<StreamOptions>>(&text).unwrap();
        if v.is_array() {
            prop_assert_eq!(options, Lenient::Invalid);
        } else {
            prop_assert_eq!(options, untagged::<StreamOptions>(&v));
        }
    }
}

#[test]
fn a_list_where_a_count_belongs_is_invalid_and_a_duplicate_option_too() {
    // 200 000 elements (the untagged retry held them as a tree first).
    let body = format!(r#"{{"prompt": [1], "n": [{}0]}}"#, "0,".repeat(200_000));
    let parsed = CompletionRequest::from_json(body.as_bytes(), &BodyLimits::NONE).unwrap();
    assert_eq!(parsed.n, Some(Lenient::Invalid));
    let options = serde_json::from_str::<Lenient<StreamOptions>>(
        r#"{"include_usage": true, "include_usage": true}"#,
    )
    .unwrap();
    assert_eq!(options, Lenient::Invalid, "a duplicate key");
}

#[test]
fn a_count_in_any_form_the_engines_read_as_an_integer_is_that_integer() {
    for (text, expected) in [
        ("64", Lenient::Valid(64)),
        ("64.0", Lenient::Valid(64)),
        ("1e8", Lenient::Valid(100_000_000)),
        ("-0.0", Lenient::Valid(0)),
        ("4294967295.0", Lenient::Valid(u32::MAX)),
        (r#""64""#, Lenient::Valid(64)),
        (r#""64.00""#, Lenient::Valid(64)),
        (r#""100000000""#, Lenient::Valid(100_000_000)),
        (r#""\u0036\u0034""#, Lenient::Valid(64)),
        // Fractions, out of range, and strings not plainly an integer.
        ("1.5", Lenient::Invalid),
        ("4294967296.0", Lenient::Invalid),
        ("1e300", Lenient::Invalid),
        ("-1", Lenient::Invalid),
        ("-1.0", Lenient::Invalid),
        (r#""1.5""#, Lenient::Invalid),
        (r#""1e8""#, Lenient::Invalid),
        (r#""-1""#, Lenient::Invalid),
        (r#""+64""#, Lenient::Invalid),
        (r#"" 64""#, Lenient::Invalid),
        (r#""1_000""#, Lenient::Invalid),
        (r#""""#, Lenient::Invalid),
        (r#"".0""#, Lenient::Invalid),
        (r#""4294967296""#, Lenient::Invalid),
        (r#""many""#, Lenient::Invalid),
        ("true", Lenient::Invalid),
    ] {
        let judged = serde_json::from_str::<Lenient<u32>>(text).unwrap();
        assert_eq!(judged, expected, "{text}");
    }
    // A string of millions of digits is judged in one pass and refused.
    let long = format!("\"{}\"", "9".repeat(1 << 20));
    assert_eq!(
        serde_json::from_str::<Lenient<u32>>(&long).unwrap(),
        Lenient::Invalid
    );
    // Flags stay strict: only a boolean is a boolean.
    for text in ["1", "1.0", r#""true""#] {
        assert_eq!(
            serde_json::from_str::<Lenient<bool>>(text).unwrap(),
            Lenient::Invalid,
            "{text}"
        );
    }
}

#[test]
fn every_count_field_is_read_in_every_form() {
    let body = br#"{"prompt": [1], "n": 64.0, "max_tokens": "100000000", "best_of": "3"}"#;
    let parsed = CompletionRequest::from_json(body, &BodyLimits::NONE).unwrap();
    assert_eq!(parsed.n, Some(Lenient::Valid(64)));
    assert_eq!(parsed.max_tokens, Some(Lenient::Valid(100_000_000)));
    assert_eq!(parsed.best_of, Some(Lenient::Valid(3)));
    let body = br#"{"messages": [], "max_completion_tokens": 1e8, "max_tokens": "7", "n": "2"}"#;
    let parsed = ChatCompletionRequest::from_json(body, &BodyLimits::NONE).unwrap();
    assert_eq!(
        parsed.max_completion_tokens,
        Some(Lenient::Valid(100_000_000))
    );
    assert_eq!(parsed.max_tokens, Some(Lenient::Valid(7)));
    assert_eq!(parsed.n, Some(Lenient::Valid(2)));
    assert_eq!(parsed.max_tokens(), Ok(Some(100_000_000)));
    let twice = br#"{"prompt": [1], "best_of": 1, "best_of": 2}"#;
    assert!(CompletionRequest::from_json(twice, &BodyLimits::NONE).is_err());
}

#[test]
fn a_batch_counts_the_prompts_after_its_first_whether_or_not_it_keeps_them() {
    let first_only = BodyLimits {
        first_prompt_only: true,
        ..BodyLimits::NONE
    };
    for limits in [BodyLimits::NONE, first_only] {
        let ids =
            CompletionRequest::from_json(br#"{"prompt": [[1, 2], [3], [4, 5, 6], []]}"#, &limits)
                .unwrap();
        assert_eq!(
            ids.later_prompts,
            LaterPrompts {
                count: 3,
                token_ids: 4,
                text_bytes: 0
            },
            "{limits:?}"
        );
        let texts = CompletionRequest::from_json(
            r#"{"prompt": ["first", "ab", "\u00e9", ""]}"#.as_bytes(),
            &limits,
        )
        .unwrap();
        assert_eq!(
            texts.later_prompts,
            LaterPrompts {
                count: 3,
                token_ids: 0,
                text_bytes: 4
            },
            "{limits:?}"
        );
        for single in [
            r#"{"prompt": [1, 2]}"#,
            r#"{"prompt": "x"}"#,
            r#"{"prompt": [[1, 2]]}"#,
        ] {
            let parsed = CompletionRequest::from_json(single.as_bytes(), &limits).unwrap();
            assert_eq!(parsed.later_prompts, LaterPrompts::default(), "{single}");
        }
    }
}
