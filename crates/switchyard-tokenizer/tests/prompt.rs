//! The bundled tokenizer behind the router's seam ([`PromptTokenizer`])
//! has the `tokenizers` crate's ids: on ShareGPT text whole, in pieces and
//! within a budget, and on chats as the template renders them; and a
//! chat's estimated rendered size covers what the template renders.

use std::io::BufRead;
use std::sync::OnceLock;
use switchyard_tokenizer::prompt::{rendered_size_estimate, HfTokenizer, PromptTokenizer};
use switchyard_tokenizer::{ChatMessage, Tokenizer};

fn bundled() -> &'static HfTokenizer {
    static T: OnceLock<HfTokenizer> = OnceLock::new();
    T.get_or_init(|| HfTokenizer(Tokenizer::bundled().expect("bundled tokenizer loads")))
}

/// The `tokenizers` crate on the same vocabulary: the reference.
fn reference() -> &'static tokenizers::Tokenizer {
    static T: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::bundled_json()
            .parse()
            .expect("reference tokenizer loads")
    })
}

/// The ShareGPT fixture: a few conversations from the shared trace, as
/// `{"id", "conversations": [{"from", "value"}]}` lines (see
/// `tests/fixtures/README.md` for provenance).
fn sharegpt_texts() -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sharegpt_sample.jsonl"
    );
    let file = std::fs::File::open(path).expect("fixture exists");
    let mut texts = Vec::new();
    for line in std::io::BufReader::new(file).lines() {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        for turn in v["conversations"].as_array().unwrap() {
            texts.push(turn["value"].as_str().unwrap().to_owned());
        }
    }
    texts
}

#[test]
fn the_rendered_size_estimate_covers_the_bundled_template() {
    let message = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
        tool_calls: Vec::new(),
        reasoning: None,
    };
    for messages in [
        vec![message("user", "")],
        vec![message("user", ""); 100],
        vec![message("system", "be brief"), message("user", "hi")],
        vec![message("assistant", ""), message("user", "x")],
    ] {
        let rendered = bundled().0.apply_chat_template(&messages, true).unwrap();
        // The template's fixed text (the assistant opening) aside.
        let fixed = bundled()
            .0
            .apply_chat_template(&[], true)
            .unwrap_or_default()
            .len();
        assert!(
            rendered.len() <= rendered_size_estimate(&messages) + fixed.max(32),
            "{} bytes rendered, {} estimated",
            rendered.len(),
            rendered_size_estimate(&messages)
        );
    }
}

#[test]
fn router_token_ids_equal_the_tokenizers_crate_on_sharegpt_text() {
    let texts = sharegpt_texts();
    assert!(texts.len() >= 20, "fixture has {} texts", texts.len());
    for text in &texts {
        let ours = bundled().encode(text).unwrap();
        let theirs = reference().encode(text.as_str(), false).unwrap();
        assert_eq!(ours, theirs.get_ids(), "ids differ on a ShareGPT turn");
    }
}

#[test]
fn sharegpt_text_encoded_in_pieces_has_the_whole_texts_ids() {
    let texts = sharegpt_texts();
    let mut compared = 0;
    for text in &texts {
        let whole = bundled().encode(text).unwrap();
        let pieces: Vec<&str> = switchyard_tokenizer::pieces(text, 256).collect();
        // Only pieces cut where a word ends (not a forced cut of 256
        // bytes with no space or newline) must agree.
        let word_ends = pieces
            .windows(2)
            .all(|w| w[0].ends_with('\n') || w[1].starts_with(' '));
        if !word_ends {
            continue;
        }
        let mut ids = Vec::new();
        for piece in &pieces {
            ids.extend(bundled().encode(piece).unwrap());
        }
        assert_eq!(ids, whole, "a ShareGPT turn in {} pieces", pieces.len());
        compared += usize::from(pieces.len() > 1);
        let within = bundled()
            .encode_within(text, whole.len(), &mut |_| {})
            .unwrap();
        assert_eq!(within.as_ref(), Some(&whole));
    }
    assert!(compared >= 10, "only {compared} texts were cut");
}

#[test]
fn chat_ids_equal_the_tokenizers_crate_on_the_rendered_template() {
    let texts = sharegpt_texts();
    let messages: Vec<ChatMessage> = texts
        .iter()
        .take(6)
        .enumerate()
        .map(|(i, t)| ChatMessage {
            role: if i % 2 == 0 { "user" } else { "assistant" }.into(),
            content: t.clone(),
            tool_calls: Vec::new(),
            reasoning: None,
        })
        .collect();
    let ours = bundled().encode_chat(&messages[..5]).unwrap();
    let rendered = bundled()
        .0
        .apply_chat_template(&messages[..5], true)
        .unwrap();
    let theirs = reference().encode(rendered.as_str(), false).unwrap();
    assert_eq!(ours, theirs.get_ids());
    assert_eq!(
        *ours.last().unwrap(),
        198,
        "ends with the assistant opening's newline"
    );
}
