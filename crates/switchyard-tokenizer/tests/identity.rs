//! The fast path's ids are the `tokenizers` crate's: on every conversation
//! of the bundled ShareGPT trace as the chat template renders it (so on
//! every message), on random Unicode; and the segment cache never
//! changes an id, turn after turn.

use proptest::prelude::*;
use std::io::BufRead;
use std::sync::OnceLock;
use switchyard_tokenizer::{ChatMessage, Tokenizer};

/// The bundled tokenizer without a segment cache: every call runs the
/// fast path end to end.
fn uncached() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let t = Tokenizer::bundled()
            .expect("bundled tokenizer loads")
            .with_segment_cache(0);
        assert_eq!(
            t.fast_path_unsupported(),
            None,
            "the bundled tokenizer takes the fast path"
        );
        t
    })
}

/// Every conversation of the bundled ShareGPT trace, as chat messages.
fn conversations() -> &'static [Vec<ChatMessage>] {
    static C: OnceLock<Vec<Vec<ChatMessage>>> = OnceLock::new();
    C.get_or_init(|| {
        let path = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/traces/sharegpt_multiturn_3000.jsonl.gz"
        ));
        let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let reader = std::io::BufReader::new(flate2::read::GzDecoder::new(file));
        reader
            .lines()
            .map(|line| {
                let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
                v["conversations"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|turn| ChatMessage {
                        role: if turn["from"] == "gpt" {
                            "assistant"
                        } else {
                            "user"
                        }
                        .into(),
                        content: turn["value"].as_str().unwrap().to_owned(),
                        tool_calls: Vec::new(),
                        reasoning: None,
                    })
                    .collect()
            })
            .collect()
    })
}

/// Where two id sequences first differ, for a failure message that shows
/// no text.
fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

/// Each conversation whole, as the chat template renders it: every
/// message of the trace goes through both tokenizers once, in the context
/// a chat request puts it in (after its role and a newline).
#[test]
fn every_rendered_sharegpt_conversation_has_the_reference_ids() {
    let t = uncached();
    let mut messages = 0;
    for (c, conversation) in conversations().iter().enumerate() {
        messages += conversation.len();
        let text = t.apply_chat_template(conversation, true).unwrap();
        let fast = t.encode(&text).unwrap();
        let reference = t.encode_reference(&text).unwrap();
        assert!(
            fast == reference,
            "conversation {c}: first difference at id {:?}",
            first_difference(&fast, &reference)
        );
    }
    assert_eq!(conversations().len(), 3000);
    assert!(messages > 20_000, "{messages} messages");
}

#[test]
fn cached_ids_equal_uncached_ids_on_every_turn_of_every_conversation() {
    let cached = Tokenizer::bundled().unwrap();
    let t = uncached();
    let mut turns = 0;
    for (c, conversation) in conversations().iter().enumerate() {
        for turn in (1..=conversation.len()).filter(|&n| conversation[n - 1].role == "user") {
            let text = t.apply_chat_template(&conversation[..turn], true).unwrap();
            let with_cache = cached.encode(&text).unwrap();
            let without = t.encode(&text).unwrap();
            assert!(
                with_cache == without,
                "conversation {c}, turn {turn}: first difference at id {:?}",
                first_difference(&with_cache, &without)
            );
            turns += 1;
        }
    }
    let stats = cached.segment_cache_stats();
    assert!(turns > 10_000, "{turns} turns");
    // Every turn after the first reuses the conversation's earlier
    // messages: most lookups hit.
    assert!(stats.hits * 2 > stats.lookups, "{stats:?}");
}

/// Text the way it is hard for a pre-tokenizer: scripts, emoji, combining
/// marks, every kind of space and line break, contractions in odd cases,
/// digits, and the special tokens themselves.
fn awkward_text() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        "[a-zA-Z]{1,8}",
        "[0-9]{1,5}",
        "[ \t\n\r]{1,4}",
        Just("\u{a0}".to_owned()),
        Just("\u{3000}\u{2028}\u{85}\u{b}\u{c}".to_owned()),
        "'(s|t|re|ve|m|ll|d|S|T|RE|Ve|M|LL|D|ſ|K|x)",
        "[!-/:-@\\[-`{-~]{1,4}",
        "[\u{0300}-\u{036f}]{1,3}",
        "[\u{4e00}-\u{4e40}\u{3040}-\u{30ff}\u{ac00}-\u{ac40}]{1,6}",
        "[\u{0400}-\u{04ff}\u{0590}-\u{05ff}\u{0600}-\u{06ff}\u{0900}-\u{097f}]{1,6}",
        "[\u{1f300}-\u{1f6ff}\u{1f900}-\u{1f9ff}\u{200d}\u{fe0f}]{1,4}",
        "[\u{2160}-\u{2188}\u{00b2}\u{00bc}\u{0660}-\u{0669}]{1,3}",
        any::<char>().prop_map(String::from),
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<think>".to_owned()),
        Just("<|im_start".to_owned()),
        Just("e\u{301}\u{327}A\u{30a}".to_owned()),
    ];
    proptest::collection::vec(fragment, 0..24).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn random_unicode_has_the_reference_ids(text in awkward_text()) {
        let t = uncached();
        prop_assert_eq!(t.encode(&text).unwrap(), t.encode_reference(&text).unwrap());
    }

    #[test]
    fn random_bytes_as_text_have_the_reference_ids(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let text = String::from_utf8_lossy(&bytes);
        let t = uncached();
        prop_assert_eq!(t.encode(&text).unwrap(), t.encode_reference(&text).unwrap());
    }
}
