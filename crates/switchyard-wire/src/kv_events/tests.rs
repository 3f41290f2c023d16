use super::*;
use proptest::prelude::*;
use rmpv::Value;

fn write(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).unwrap();
    out
}

#[test]
fn the_encoder_writes_a_three_element_batch_of_type_tagged_maps() {
    let batch = KvEventBatch {
        ts: 1.5,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: Some(0),
    };
    let bytes = encode_batch(&batch);
    let value = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
    let Value::Array(items) = value else {
        panic!("batch is not an array")
    };
    assert_eq!(items.len(), 3);
    assert_eq!(items[0], Value::F64(1.5));
    assert_eq!(items[2], Value::from(0));
    let Value::Array(events) = &items[1] else {
        panic!("events is not an array")
    };
    assert_eq!(
        events[0],
        Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared"))])
    );
}

#[test]
fn a_batch_without_a_rank_is_two_elements_long_and_decodes_to_none() {
    let batch = KvEventBatch {
        ts: 2.0,
        events: vec![],
        data_parallel_rank: None,
    };
    let bytes = encode_batch(&batch);
    assert_eq!(bytes[0], 0x92);
    assert_eq!(decode_batch(&bytes, Format::Auto).unwrap(), batch);
}

#[test]
fn negative_integer_hashes_are_reinterpreted_as_twos_complement() {
    let payload = write(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![
                Value::from(-1i64),
                Value::from(-2i64),
                Value::from(7u8),
            ]),
        ])]),
    ]));
    let batch = decode_batch(&payload, Format::Sglang).unwrap();
    let KvEvent::BlockRemoved(removed) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        removed.block_hashes,
        vec![
            EngineHash(u64::MAX),
            EngineHash(u64::MAX - 1),
            EngineHash(7)
        ]
    );
}

#[test]
fn byte_hashes_use_their_last_eight_bytes_big_endian() {
    let mut hash = vec![0xAAu8; 24];
    hash.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let payload = write(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::Binary(hash)]),
            ),
            (Value::from("medium"), Value::Nil),
        ])]),
    ]));
    let batch = decode_batch(&payload, Format::Vllm).unwrap();
    let KvEvent::BlockRemoved(removed) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        removed.block_hashes,
        vec![EngineHash(0x0102_0304_0506_0708)]
    );
    assert!(decode_batch(&payload, Format::Sglang).is_err());
}

#[test]
fn unknown_keys_and_extra_trailing_elements_are_ignored() {
    let payload = write(&Value::Array(vec![
        Value::F64(3.0),
        Value::Array(vec![
            Value::Map(vec![
                (Value::from("type"), Value::from("BlockRemoved")),
                (
                    Value::from("block_hashes"),
                    Value::Array(vec![Value::from(5)]),
                ),
                (Value::from("future_field"), Value::from("x")),
            ]),
            Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![Value::from(6)]),
                Value::from("GPU"),
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::from("an element from a future release"),
            ]),
        ]),
        Value::from(1),
        Value::from("a trailing batch element from a future release"),
    ]));
    let batch = decode_batch(&payload, Format::Auto).unwrap();
    assert_eq!(batch.events.len(), 2);
    assert_eq!(batch.data_parallel_rank, Some(1));
}

#[test]
fn a_map_shaped_batch_decodes_like_an_array_shaped_one() {
    let payload = write(&Value::Map(vec![
        (Value::from("ts"), Value::F64(4.0)),
        (Value::from("events"), Value::Array(vec![])),
        (Value::from("data_parallel_rank"), Value::from(2)),
    ]));
    let batch = decode_batch(&payload, Format::Vllm).unwrap();
    assert_eq!(batch.data_parallel_rank, Some(2));
    assert_eq!(
        decode_batch(&payload, Format::Sglang),
        Err(DecodeError::FormatMismatch(Format::Sglang))
    );
}

#[test]
fn one_bad_event_is_reported_without_losing_the_others() {
    let payload = write(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared"))]),
            Value::Map(vec![
                (Value::from("type"), Value::from("BlockStored")),
                (
                    Value::from("block_hashes"),
                    Value::Array(vec![Value::from("nope")]),
                ),
            ]),
            Value::Map(vec![(Value::from("type"), Value::from("SomethingNew"))]),
        ]),
    ]));
    let (batch, errors) = decode_batch_lossy(&payload, Format::Auto).unwrap();
    assert_eq!(batch.events.len(), 2);
    assert_eq!(
        batch.events[1],
        KvEvent::Unknown {
            tag: "SomethingNew".into()
        }
    );
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].index, 1);
    assert_eq!(errors[0].error.reason(), "invalid_field");
    assert!(decode_batch(&payload, Format::Auto).is_err());
}

#[test]
fn token_pairs_keep_both_columns() {
    let payload = write(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(1)]),
            ),
            (Value::from("parent_block_hash"), Value::Nil),
            (
                Value::from("token_ids"),
                Value::Array(vec![
                    Value::Array(vec![Value::from(10), Value::from(11)]),
                    Value::Array(vec![Value::from(11), Value::from(12)]),
                ]),
            ),
            (Value::from("block_size"), Value::from(2)),
        ])]),
    ]));
    let batch = decode_batch(&payload, Format::Auto).unwrap();
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.token_ids, vec![10, 11]);
    assert_eq!(s.token_pair_next_ids, Some(vec![11, 12]));
    let again = decode_batch(&encode_batch(&batch), Format::Auto).unwrap();
    assert_eq!(again, batch);
}

#[test]
fn garbage_gets_a_typed_error() {
    assert!(matches!(
        decode_batch(b"", Format::Auto),
        Err(DecodeError::Msgpack(_))
    ));
    assert!(matches!(
        decode_batch(&[0xc0], Format::Auto),
        Err(DecodeError::BatchShape)
    ));
    assert!(matches!(
        decode_batch(&[0x90, 0x00], Format::Auto),
        Err(DecodeError::TrailingBytes(1))
    ));
    let negative_token = write(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(1)]),
            Value::Nil,
            Value::Array(vec![Value::from(-3)]),
            Value::from(1),
        ])]),
    ]));
    assert_eq!(
        decode_batch(&negative_token, Format::Auto),
        Err(DecodeError::InvalidField {
            event: "BlockStored",
            field: "token_ids"
        })
    );
}

fn arb_opt_string() -> impl Strategy<Value = Option<String>> {
    proptest::option::of("[a-zA-Z0-9_]{0,8}")
}

fn arb_hashes() -> impl Strategy<Value = Vec<EngineHash>> {
    proptest::collection::vec(any::<u64>().prop_map(EngineHash), 0..6)
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    let stored = (
        arb_hashes(),
        proptest::option::of(any::<u64>().prop_map(EngineHash)),
        proptest::collection::vec(any::<u32>(), 0..40),
        any::<bool>(),
        any::<u32>(),
        proptest::option::of(any::<i64>()),
        arb_opt_string(),
        arb_opt_string(),
        (
            proptest::option::of(any::<i64>()),
            arb_opt_string(),
            proptest::option::of(any::<i64>()),
            arb_opt_string(),
            arb_opt_string(),
            arb_opt_string(),
            arb_opt_string(),
            proptest::option::of(any::<u32>().prop_map(|t| Value::Array(vec![Value::from(t)]))),
        ),
    )
        .prop_map(
            |(hashes, parent, tokens, pairs, block_size, lora_id, medium, lora_name, rest)| {
                let (group, kind, window, locality, ownership, session, salt, extra) = rest;
                KvEvent::BlockStored(Box::new(BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    // Zero pairs are indistinguishable from zero tokens.
                    token_pair_next_ids: (pairs && !tokens.is_empty())
                        .then(|| tokens.iter().map(|t| t.wrapping_add(1)).collect()),
                    token_ids: tokens,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys: extra,
                    group_idx: group,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: window,
                    locality,
                    ownership,
                    session_id: session,
                    lookahead_token_ids: None,
                    cache_salt: salt,
                }))
            },
        );
    let removed = (
        arb_hashes(),
        arb_opt_string(),
        proptest::option::of(any::<i64>()),
        arb_opt_string(),
        arb_opt_string(),
    )
        .prop_map(|(hashes, medium, group_idx, locality, ownership)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes,
                medium,
                group_idx,
                locality,
                ownership,
            })
        });
    prop_oneof![stored, removed, Just(KvEvent::AllBlocksCleared)]
}

fn arb_batch() -> impl Strategy<Value = KvEventBatch> {
    (
        -1e12f64..1e12,
        proptest::collection::vec(arb_event(), 0..6),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, rank)| KvEventBatch {
            ts,
            events,
            data_parallel_rank: rank,
        })
}

proptest! {
    #[test]
    fn encoding_then_decoding_gives_back_the_batch(batch in arb_batch()) {
        prop_assert_eq!(decode_batch(&encode_batch(&batch), Format::Auto).unwrap(), batch.clone());
        prop_assert_eq!(decode_batch(&encode_batch(&batch), Format::Vllm).unwrap(), batch);
    }

    #[test]
    fn byte_hashes_round_trip_like_integer_hashes(batch in arb_batch()) {
        let bytes = encode_batch_with(&batch, HashEncoding::Bytes32);
        prop_assert_eq!(decode_batch(&bytes, Format::Auto).unwrap(), batch);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for format in [Format::Auto, Format::Vllm, Format::Sglang] {
            let _ = decode_batch_lossy(&bytes, format);
        }
    }

    #[test]
    fn mutated_valid_batches_never_panic_the_decoder(
        batch in arb_batch(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = encode_batch(&batch);
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        let _ = decode_batch_lossy(&bytes, Format::Auto);
        let _ = decode_batch_lossy(&bytes[..bytes.len() / 2], Format::Auto);
    }
}

/// Values in a decoded tree, each counted once (a map entry is two).
fn values_in(value: &Value) -> usize {
    1 + match value {
        Value::Array(items) => items.iter().map(values_in).sum(),
        Value::Map(entries) => entries
            .iter()
            .map(|(k, v)| values_in(k) + values_in(v))
            .sum(),
        _ => 0,
    }
}

#[test]
fn a_payload_of_nils_is_refused_before_its_tree_is_built() {
    // `[0.0, [nil; 4 Mi]]`: 4 MiB on the wire, over 128 MiB as a tree.
    let nils = 4 << 20;
    let mut payload = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    payload.extend_from_slice(&(nils as u32).to_be_bytes());
    payload.resize(payload.len() + nils, 0xc0);
    assert_eq!(
        decode_batch_lossy(&payload, Format::Auto),
        Err(DecodeError::OverBudget {
            budget: DecodeLimits::default().max_tree_bytes
        })
    );
    assert_eq!(
        DecodeError::OverBudget { budget: 0 }.reason(),
        "over_decode_budget"
    );
}

#[test]
fn a_budget_is_checked_against_what_the_payload_would_build() {
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![KvEvent::AllBlocksCleared; 100],
        data_parallel_rank: None,
    };
    let bytes = encode_batch(&batch);
    let tree = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
    let needed = values_in(&tree) * std::mem::size_of::<Value>();
    let tight = DecodeLimits {
        max_tree_bytes: needed - 1,
        ..DecodeLimits::default()
    };
    assert!(matches!(
        decode_batch_lossy_within(&bytes, Format::Auto, &tight),
        Err(DecodeError::OverBudget { .. })
    ));
    let roomy = DecodeLimits {
        max_tree_bytes: needed * 2,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_batch_lossy_within(&bytes, Format::Auto, &roomy)
            .unwrap()
            .0,
        batch
    );
}

#[test]
fn a_batch_with_more_events_than_the_cap_is_refused_whole() {
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![KvEvent::AllBlocksCleared; 6],
        data_parallel_rank: None,
    };
    let limits = DecodeLimits {
        max_events: 5,
        ..DecodeLimits::default()
    };
    let bytes = encode_batch(&batch);
    assert_eq!(
        decode_batch_lossy_within(&bytes, Format::Auto, &limits),
        Err(DecodeError::TooManyEvents(6))
    );
    assert_eq!(DecodeError::TooManyEvents(6).reason(), "too_many_events");
    let limits = DecodeLimits {
        max_events: 6,
        ..limits
    };
    assert!(decode_batch_lossy_within(&bytes, Format::Auto, &limits).is_ok());
}

#[test]
fn a_length_past_the_end_is_truncated_msgpack_not_an_allocation() {
    // An array header claiming 4 Gi elements, with none behind it.
    let payload = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    assert!(matches!(
        decode_batch_lossy(&payload, Format::Auto),
        Err(DecodeError::Msgpack(_))
    ));
    // The reserved marker is one value, as `rmpv` reads it (nil).
    assert!(super::decode::tree_cost(&[0xc1], usize::MAX).is_ok());
}

proptest! {
    #[test]
    fn the_tree_cost_covers_every_value_the_decoder_builds(batch in arb_batch()) {
        for bytes in [encode_batch(&batch), encode_batch_with(&batch, HashEncoding::Bytes32)] {
            let tree = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
            let cost = super::decode::tree_cost(&bytes, usize::MAX).unwrap();
            prop_assert!(cost >= values_in(&tree) * std::mem::size_of::<Value>());
            prop_assert!(cost <= values_in(&tree) * std::mem::size_of::<Value>() + bytes.len());
        }
    }

    #[test]
    fn the_walk_accepts_whatever_msgpack_decodes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if rmpv::decode::read_value_with_max_depth(&mut bytes.as_slice(), 32).is_ok() {
            prop_assert!(super::decode::tree_cost(&bytes, usize::MAX).is_ok());
        }
    }
}

/// The direct reader against the tree decoder on the same bytes: where the
/// reader answers, the tree gives the same batch and no event error.
fn direct_agrees_with_the_tree(bytes: &[u8], format: Format) -> Result<bool, TestCaseError> {
    let limits = DecodeLimits::default();
    let Some(direct) = direct::decode(bytes, format, limits.max_events) else {
        return Ok(false);
    };
    let tree = decode::decode_tree(bytes, format, &limits);
    prop_assert_eq!(tree, Ok((direct, Vec::new())));
    Ok(true)
}

/// `event` in the array form: the tag, then its fields in declaration
/// order (all of them, nil where unset; a cache salt, which this form
/// carries in a `metadata` map, left out).
fn array_event_value(event: &KvEvent) -> Value {
    let s = |v: &Option<String>| v.clone().map_or(Value::Nil, Value::from);
    let i = |v: Option<i64>| v.map_or(Value::Nil, Value::from);
    match event {
        KvEvent::BlockStored(b) => Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(b.block_hashes.iter().map(|h| Value::from(h.0)).collect()),
            b.parent_block_hash.map_or(Value::Nil, |h| Value::from(h.0)),
            Value::Array(match &b.token_pair_next_ids {
                None => b.token_ids.iter().map(|&t| Value::from(t)).collect(),
                Some(next) => b
                    .token_ids
                    .iter()
                    .zip(next)
                    .map(|(&t, &n)| Value::Array(vec![Value::from(t), Value::from(n)]))
                    .collect(),
            }),
            Value::from(b.block_size),
            i(b.lora_id),
            s(&b.medium),
            s(&b.lora_name),
            b.extra_keys.clone().unwrap_or(Value::Nil),
            i(b.group_idx),
            s(&b.kv_cache_spec_kind),
            i(b.kv_cache_spec_sliding_window),
            s(&b.locality),
            s(&b.ownership),
            s(&b.session_id),
        ]),
        KvEvent::BlockRemoved(r) => Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(r.block_hashes.iter().map(|h| Value::from(h.0)).collect()),
            s(&r.medium),
            i(r.group_idx),
            s(&r.locality),
            s(&r.ownership),
        ]),
        KvEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
        KvEvent::Unknown { tag } => Value::Array(vec![Value::from(tag.as_str())]),
    }
}

/// Whether the direct reader is meant to take `batch` whole: no opaque
/// `extra_keys` and no token pairs (those are the tree decoder's).
fn direct_takes(batch: &KvEventBatch) -> bool {
    batch.events.iter().all(|event| match event {
        KvEvent::BlockStored(b) => b.extra_keys.is_none() && b.token_pair_next_ids.is_none(),
        _ => true,
    })
}

proptest! {
    #[test]
    fn the_direct_reader_reads_map_events_as_the_tree_does(batch in arb_batch()) {
        for (bytes, format) in [
            (encode_batch(&batch), Format::Auto),
            (encode_batch(&batch), Format::Sglang),
            (encode_batch_with(&batch, HashEncoding::Bytes32), Format::Vllm),
        ] {
            let taken = direct_agrees_with_the_tree(&bytes, format)?;
            // SGLang never sends byte hashes; otherwise the plain shapes are
            // the reader's to take.
            prop_assert_eq!(taken, direct_takes(&batch));
        }
    }

    #[test]
    fn the_direct_reader_reads_array_events_as_the_tree_does(batch in arb_batch()) {
        let mut fields = vec![
            Value::F64(batch.ts),
            Value::Array(batch.events.iter().map(array_event_value).collect()),
        ];
        if let Some(rank) = batch.data_parallel_rank {
            fields.push(Value::from(rank));
        }
        let bytes = write(&Value::Array(fields));
        let taken = direct_agrees_with_the_tree(&bytes, Format::Auto)?;
        prop_assert_eq!(taken, direct_takes(&batch));
    }

    #[test]
    fn on_mutated_bytes_the_direct_reader_answers_only_as_the_tree_does(
        batch in arb_batch(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode_batch(&batch);
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        for format in [Format::Auto, Format::Vllm, Format::Sglang] {
            direct_agrees_with_the_tree(&bytes, format)?;
            direct_agrees_with_the_tree(&bytes[..cut.index(bytes.len() + 1)], format)?;
        }
    }
}

#[test]
fn the_direct_reader_takes_the_engines_own_payloads_as_the_tree_does() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut taken = 0;
    for sub in ["", "captured", "made"] {
        for entry in std::fs::read_dir(dir.join(sub)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "msgpack") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let format = if path.to_string_lossy().contains("sglang") {
                Format::Sglang
            } else {
                Format::Vllm
            };
            let result: Result<bool, TestCaseError> = direct_agrees_with_the_tree(&bytes, format);
            taken += usize::from(result.unwrap_or_else(|e| panic!("{}: {e}", path.display())));
        }
    }
    // Every vLLM 0.32 and SGLang 0.5.23 capture is a plain shape.
    assert!(taken >= 10, "the direct reader took {taken} fixtures");
}
