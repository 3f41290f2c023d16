//! The bundled tokenizer's word tokens round-trip in any sequence: text
//! generated from them re-encodes to exactly the ids it was made from, on
//! the fast path and in the `tokenizers` crate (what a Python client such
//! as aiperf counts with). So do a WordPiece tokenizer's whole words,
//! written with a space in front: the sim-worker's hand-made BERT-style
//! fixture, and any WordPiece directory named by
//! `SWITCHYARD_TEST_WORDPIECE_DIR` (such as all-MiniLM-L6-v2's).

use proptest::prelude::*;
use std::path::{Path, PathBuf};
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

/// The sim-worker's WordPiece fixture (uncased BERT-style, 371 ids).
fn wordpiece() -> &'static (Tokenizer, WordVocabulary) {
    static T: OnceLock<(Tokenizer, WordVocabulary)> = OnceLock::new();
    T.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../switchyard-sim-worker/tests/fixtures/wordpiece");
        let tokenizer = Tokenizer::from_dir(&dir).expect("the WordPiece fixture loads");
        let words = tokenizer
            .word_vocabulary(MAX_WORDS)
            .expect("the WordPiece fixture's words round-trip");
        (tokenizer, words)
    })
}

/// The tokenizer of `$SWITCHYARD_TEST_WORDPIECE_DIR` with its words, when
/// the variable is set (a real WordPiece vocabulary is not in the repo).
fn wordpiece_from_env() -> Option<&'static (Tokenizer, WordVocabulary)> {
    static T: OnceLock<Option<(Tokenizer, WordVocabulary)>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(std::env::var_os("SWITCHYARD_TEST_WORDPIECE_DIR")?);
        let tokenizer = Tokenizer::from_dir(&dir).expect("$SWITCHYARD_TEST_WORDPIECE_DIR loads");
        let words = tokenizer
            .word_vocabulary(MAX_WORDS)
            .expect("the words of $SWITCHYARD_TEST_WORDPIECE_DIR round-trip");
        Some((tokenizer, words))
    })
    .as_ref()
}

/// The ids of `words` at `picks`, and their text.
fn sequence(words: &WordVocabulary, picks: &[prop::sample::Index]) -> (Vec<u32>, String) {
    let ids: Vec<u32> = picks
        .iter()
        .map(|p| words.ids()[p.index(words.len())])
        .collect();
    let text = ids.iter().map(|&id| words.text(id).unwrap()).collect();
    (ids, text)
}

#[test]
fn the_wordpiece_fixtures_words_are_its_whole_words_with_a_space_added() {
    let (tokenizer, words) = wordpiece();
    assert!(words.space_added());
    assert!(
        !self::words().space_added(),
        "byte-level BPE tokens hold their space"
    );
    // Every entry of two or more lowercase letters: not [PAD] [UNK] [CLS]
    // [SEP] , . ##s ##ing ##ed [unused0] ' nor the single letters a i t.
    assert_eq!(words.len(), 357);
    assert_eq!(&words.ids()[..6], [4, 5, 6, 9, 10, 19]);
    for &id in words.ids() {
        let text = words.text(id).unwrap();
        assert_eq!(format!(" {}", tokenizer.decode(&[id]).unwrap()), text);
        assert!(text.len() >= 3 && text[1..].bytes().all(|b| b.is_ascii_lowercase()));
        assert_eq!(tokenizer.encode(text).unwrap(), [id]);
    }
    let (ids, text) = ([4, 5, 6, 9, 4, 10], " the river run to the sea".to_owned());
    let joined: String = ids.iter().map(|&id| words.text(id).unwrap()).collect();
    assert_eq!(joined, text);
    assert_eq!(tokenizer.encode(&text).unwrap(), ids);
    assert_eq!(tokenizer.decode(&ids).unwrap(), "the river run to the sea");
    assert_eq!(words.decoded(&text), "the river run to the sea");
}

#[test]
fn a_real_wordpiece_vocabularys_table_fills_when_one_is_given() {
    let Some((tokenizer, words)) = wordpiece_from_env() else {
        eprintln!("SWITCHYARD_TEST_WORDPIECE_DIR is not set: nothing to check");
        return;
    };
    assert!(words.space_added());
    assert_eq!(words.len(), MAX_WORDS);
    for &id in words.ids() {
        let text = words.text(id).unwrap();
        assert_eq!(tokenizer.encode(text).unwrap(), [id], "{text:?}");
    }
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

    /// Any sequence of the WordPiece fixture's words re-encodes to its ids
    /// and decodes to its text without the first space.
    #[test]
    fn any_sequence_of_wordpiece_words_re_encodes_to_its_ids(
        picks in prop::collection::vec(any::<prop::sample::Index>(), 1..300)
    ) {
        let (tokenizer, words) = wordpiece();
        let (ids, text) = sequence(words, &picks);
        prop_assert_eq!(&tokenizer.encode(&text).unwrap(), &ids);
        prop_assert_eq!(&tokenizer.encode_reference(&text).unwrap(), &ids);
        prop_assert_eq!(tokenizer.decode(&ids).unwrap(), words.decoded(&text));
    }

    /// The same for `$SWITCHYARD_TEST_WORDPIECE_DIR`'s words, when set.
    #[test]
    fn any_sequence_of_a_real_wordpiece_vocabularys_words_re_encodes_to_its_ids(
        picks in prop::collection::vec(any::<prop::sample::Index>(), 1..300)
    ) {
        if let Some((tokenizer, words)) = wordpiece_from_env() {
            let (ids, text) = sequence(words, &picks);
            prop_assert_eq!(&tokenizer.encode(&text).unwrap(), &ids);
            prop_assert_eq!(tokenizer.decode(&ids).unwrap(), words.decoded(&text));
        }
    }
}
