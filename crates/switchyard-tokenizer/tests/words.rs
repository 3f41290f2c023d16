//! The bundled tokenizer's word tokens round-trip in any sequence: text
//! generated from them re-encodes to exactly the ids it was made from, on
//! the fast path and in the `tokenizers` crate (what a Python client such
//! as aiperf counts with).

use proptest::prelude::*;
use std::sync::OnceLock;
use switchyard_tokenizer::{Tokenizer, WordVocabulary};

/// The table a sim-worker builds (its cap).
const MAX_WORDS: usize = 4096;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::bundled().expect("bundled tokenizer loads"))
}

fn words() -> &'static WordVocabulary {
    static W: OnceLock<WordVocabulary> = OnceLock::new();
    W.get_or_init(|| {
        tokenizer()
            .word_vocabulary(MAX_WORDS)
            .expect("the bundled tokenizer's words round-trip")
    })
}

#[test]
fn the_bundled_tokenizer_fills_the_table_with_sorted_single_space_words() {
    let words = words();
    assert_eq!(words.len(), MAX_WORDS);
    assert!(words.ids().windows(2).all(|w| w[0] < w[1]));
    for &id in words.ids() {
        let text = words.text(id).unwrap();
        assert_eq!(tokenizer().decode(&[id]).unwrap(), text);
        assert!(text.starts_with(' ') && text[1..].bytes().all(|b| b.is_ascii_lowercase()));
    }
    assert_eq!(words.text(151_644), None, "<|im_start|> is not a word");
    // Deterministic: the same table every time it is built.
    assert_eq!(&tokenizer().word_vocabulary(MAX_WORDS).unwrap(), words);
}

#[test]
fn a_table_may_be_capped_below_what_the_vocabulary_holds() {
    let few = tokenizer().word_vocabulary(10).unwrap();
    assert_eq!(few.ids(), &words().ids()[..10]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any sequence of word tokens: its text encodes to its ids with both
    /// encoders, and its ids decode to its text.
    #[test]
    fn any_sequence_of_words_re_encodes_to_its_ids(
        picks in prop::collection::vec(any::<prop::sample::Index>(), 1..300)
    ) {
        let words = words();
        let ids: Vec<u32> = picks.iter().map(|p| words.ids()[p.index(words.len())]).collect();
        let text: String = ids.iter().map(|&id| words.text(id).unwrap()).collect();
        prop_assert_eq!(&tokenizer().encode(&text).unwrap(), &ids);
        prop_assert_eq!(&tokenizer().encode_reference(&text).unwrap(), &ids);
        prop_assert_eq!(tokenizer().decode(&ids).unwrap(), text);
    }

    /// The same, for a few words repeated (" a a a", " the the"): runs of
    /// one word are where a merge across a space would show first.
    #[test]
    fn repeated_words_re_encode_to_their_ids(
        picks in prop::collection::vec((any::<prop::sample::Index>(), 1usize..6), 1..40)
    ) {
        let words = words();
        let ids: Vec<u32> = picks
            .iter()
            .flat_map(|(p, n)| std::iter::repeat_n(words.ids()[p.index(words.len())], *n))
            .collect();
        let text: String = ids.iter().map(|&id| words.text(id).unwrap()).collect();
        prop_assert_eq!(&tokenizer().encode(&text).unwrap(), &ids);
        prop_assert_eq!(&tokenizer().encode_reference(&text).unwrap(), &ids);
    }
}
