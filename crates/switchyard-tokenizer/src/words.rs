//! Word tokens: the part of a vocabulary that text can be generated from
//! so that re-tokenizing the text gives back exactly the ids it came from.
//!
//! A word token decodes to one space followed by ASCII lowercase letters
//! (`" the"`, `" river"`), and encodes back to itself alone. Byte-level BPE
//! pre-tokenizers of the GPT-2/Qwen family split text before each such
//! space (`" ?\p{L}+"` is one piece), so every word of a concatenation is
//! encoded on its own and any sequence of word tokens round-trips.
//!
//! A WordPiece vocabulary (BERT, all-MiniLM-L6-v2) has no spaces in its
//! tokens: its whole-word tokens (`"the"`, `"river"`; not the `"##s"`
//! continuations) decode alone without one, and its decoder puts a space
//! between tokens. Its word text is the token with a space added in front
//! (`" the"`): the BERT pre-tokenizer splits at whitespace and drops it,
//! and WordPiece's longest-match-first encodes a piece that is a whole
//! vocabulary entry as that entry, so again any concatenation encodes to
//! its ids. Decoding the ids gives the concatenation without its first
//! space ([`WordVocabulary::space_added`]).
//!
//! [`Tokenizer::word_vocabulary`] does not take that on trust: it checks
//! the joined table in several orders with the fast path, and once with
//! the `tokenizers` crate (what Python clients count with), and refuses a
//! vocabulary that fails.

use crate::{Tokenizer, TokenizerError};
use tokenizers::models::ModelWrapper;

/// Word tokens of one tokenizer, sorted by id, each with its text.
///
/// Invariant (checked when built): any concatenation of the texts encodes
/// (without special tokens) to the sequence of their ids, and decoding
/// ids gives the concatenation, without its first space when
/// [`Self::space_added`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WordVocabulary {
    ids: Vec<u32>,
    texts: Vec<Box<str>>,
    space_added: bool,
}

/// Why a tokenizer yields no word vocabulary.
#[derive(Debug, thiserror::Error)]
pub enum WordVocabularyError {
    /// Decoding or encoding a candidate failed.
    #[error(transparent)]
    Codec(#[from] TokenizerError),
    /// The words round-trip one at a time but not joined: this
    /// tokenizer's pre-tokenizer does not split text at spaces.
    #[error("joined word tokens do not encode back to their ids ({order} order, first difference at token {at})")]
    NotSeparable {
        /// Which order of the table failed.
        order: &'static str,
        /// Index of the first differing id.
        at: usize,
    },
    /// The joined ids decode to other text than the joined words (a
    /// decoder that strips or adds spaces other than WordPiece's).
    #[error("joined word tokens decode to other text than the words joined ({order} order)")]
    DecodesDifferently {
        /// Which order of the table failed.
        order: &'static str,
    },
}

impl WordVocabulary {
    /// The ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The text of word token `id`; `None` when `id` is not one.
    pub fn text(&self, id: u32) -> Option<&str> {
        let at = self.ids.binary_search(&id).ok()?;
        Some(&self.texts[at])
    }

    /// How many word tokens there are.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Whether each text's leading space is not part of its token but
    /// added (a WordPiece vocabulary, whose whole-word tokens decode
    /// without one): then the tokenizer decodes a sequence of ids to the
    /// concatenation of their texts without its first space, `"the
    /// river"` for `" the river"`. The texts encode to the ids all the
    /// same. `false` for byte-level BPE, whose tokens hold their space.
    pub fn space_added(&self) -> bool {
        self.space_added
    }

    /// What the tokenizer decodes the ids of `text`, a concatenation of
    /// word texts, to: `text`, without its first space when
    /// [`Self::space_added`].
    pub fn decoded<'a>(&self, text: &'a str) -> &'a str {
        if self.space_added {
            text.strip_prefix(' ').unwrap_or(text)
        } else {
            text
        }
    }
}

/// Whether `text` is one space and one or more ASCII lowercase letters.
fn is_word(text: &str) -> bool {
    text.strip_prefix(' ')
        .is_some_and(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase()))
}

/// Whether `token`, a WordPiece token decoded alone, is a whole word worth
/// writing: two or more ASCII lowercase letters (not a `##` continuation,
/// a special token, which decodes to nothing, punctuation or `[unused0]`;
/// single letters, a block of their own in BERT vocabularies, read as
/// noise).
fn is_bare_word(token: &str) -> bool {
    token.len() >= 2 && token.bytes().all(|b| b.is_ascii_lowercase())
}

impl Tokenizer {
    /// The first `max` word tokens by id (the lowest ids of a BPE
    /// vocabulary are its most frequent merges; of a BERT WordPiece
    /// vocabulary, after the special, unused and single-character ids,
    /// its most frequent words), checked to round-trip alone and joined.
    /// May hold fewer than `max`, or none; the caller decides how few is
    /// too few. Decodes ids one by one until `max` are found: some tens of
    /// milliseconds for the bundled tokenizer.
    pub fn word_vocabulary(&self, max: usize) -> Result<WordVocabulary, WordVocabularyError> {
        let mut ids = Vec::new();
        let mut texts: Vec<Box<str>> = Vec::new();
        // WordPiece tokens hold no space: a whole word gets one in front.
        let space_added = matches!(self.inner.get_model(), ModelWrapper::WordPiece(_));
        let vocab_size = u32::try_from(self.vocab_size()).unwrap_or(u32::MAX);
        for id in 0..vocab_size {
            if ids.len() >= max {
                break;
            }
            // An id that fails to decode or encode is no word; only the
            // joined check below can refuse the whole table.
            let Ok(mut text) = self.decode(&[id]) else {
                continue;
            };
            if space_added {
                if !is_bare_word(&text) {
                    continue;
                }
                text.insert(0, ' ');
            }
            if !is_word(&text) {
                continue;
            }
            // The fast path alone: the reference encoder (some 10 us a
            // word) sees every word in the joined check.
            if !self.encode(&text).is_ok_and(|ids| ids == [id]) {
                continue;
            }
            ids.push(id);
            texts.push(text.into_boxed_str());
        }
        let vocabulary = WordVocabulary {
            ids,
            texts,
            space_added,
        };
        vocabulary.check_joined(self)?;
        Ok(vocabulary)
    }
}

impl WordVocabulary {
    /// Checks that the whole table, joined in ascending, descending and a
    /// strided order, encodes to those ids and decodes back to the joined
    /// text (without its first space when [`Self::space_added`]). The
    /// fast path encodes all three; the reference encoder, ten
    /// times slower, the first, which holds every word once (so every
    /// word round-trips there too, next to others): the two split text
    /// the same way (the crate's identity tests), so the other orders
    /// would tell it nothing new.
    fn check_joined(&self, tokenizer: &Tokenizer) -> Result<(), WordVocabularyError> {
        let n = self.ids.len();
        if n == 0 {
            return Ok(());
        }
        let orders: [(&'static str, Vec<usize>); 3] = [
            ("ascending", (0..n).collect()),
            ("descending", (0..n).rev().collect()),
            ("strided", strided_order(n)),
        ];
        for (k, (order, positions)) in orders.into_iter().enumerate() {
            let ids: Vec<u32> = positions.iter().map(|&i| self.ids[i]).collect();
            let text: String = positions.iter().map(|&i| &*self.texts[i]).collect();
            let mut encodings = vec![tokenizer.encode(&text)?];
            if k == 0 {
                encodings.push(tokenizer.encode_reference(&text)?);
            }
            for encoded in encodings {
                if encoded != ids {
                    let at = encoded
                        .iter()
                        .zip(&ids)
                        .position(|(a, b)| a != b)
                        .unwrap_or(encoded.len().min(ids.len()));
                    return Err(WordVocabularyError::NotSeparable { order, at });
                }
            }
            if tokenizer.decode(&ids)? != self.decoded(&text) {
                return Err(WordVocabularyError::DecodesDifferently { order });
            }
        }
        Ok(())
    }
}

/// `0..n` in an order that puts entries far apart in id order next to
/// each other: steps of a stride coprime with `n` (so each entry once).
fn strided_order(n: usize) -> Vec<usize> {
    let stride = (1..n)
        .rev()
        .find(|&s| s > n / 3 && gcd(s, n) == 1)
        .unwrap_or(1);
    (0..n).map(|i| i * stride % n).collect()
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_is_one_space_then_lowercase_ascii_letters() {
        assert!(is_word(" the"));
        assert!(is_word(" a"));
        for not in [
            "the",
            " ",
            "  the",
            " The",
            " the.",
            " caf\u{e9}",
            " two words",
            "\n",
        ] {
            assert!(!is_word(not), "{not:?}");
        }
    }

    #[test]
    fn a_bare_word_is_two_or_more_lowercase_ascii_letters() {
        assert!(is_bare_word("the"));
        assert!(is_bare_word("of"));
        for not in [
            "a",
            "",
            " the",
            "##s",
            "The",
            "[CLS]",
            "[unused0]",
            "don't",
            ",",
            "caf\u{e9}",
        ] {
            assert!(!is_bare_word(not), "{not:?}");
        }
    }

    #[test]
    fn a_stride_visits_every_entry_once() {
        for n in [1usize, 2, 3, 10, 4096] {
            let mut seen = strided_order(n);
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
    }
}
