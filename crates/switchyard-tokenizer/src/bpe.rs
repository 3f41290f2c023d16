//! Byte-level BPE: a `tokenizer.json`'s vocabulary and merges, applied to
//! one pre-tokenized piece at a time.
//!
//! The model starts from one symbol per byte and repeatedly merges the
//! adjacent pair with the lowest merge rank, the leftmost on a tie, until
//! no adjacent pair has a merge: the rule the `tokenizers` crate applies
//! (without dropout). Short pieces (almost all of them) keep their symbols
//! in a small array and rescan it; long ones use a heap over a linked list,
//! so a megabyte of punctuation costs `n log n`, not `n²`. A property test
//! holds the two to the same answer.

use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Pieces up to this many bytes merge by rescanning an array.
const SHORT: usize = 48;

/// GPT-2's map from bytes to the printable characters byte-level
/// vocabularies are written in: printable Latin-1 bytes stand for
/// themselves, the others for 256, 257, … in byte order.
pub fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (b, c) in chars.iter_mut().enumerate() {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        *c = if printable {
            char::from(b as u8)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below the surrogates")
        };
    }
    chars
}

/// Why a vocabulary cannot be used by [`ByteLevelBpe`].
pub type Unsupported = String;

/// A byte-level BPE model.
#[derive(Debug)]
pub struct ByteLevelBpe {
    /// The id of each single byte.
    byte_ids: [u32; 256],
    /// `(left << 32) | right` → `(rank, merged id)`.
    merges: FxHashMap<u64, (u32, u32)>,
}

#[inline]
fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

impl ByteLevelBpe {
    /// Builds the model from a vocabulary (byte-level strings to ids) and
    /// merges in rank order. A later duplicate merge replaces an earlier
    /// one, as in the `tokenizers` crate.
    pub fn new<'a>(
        vocab: &FxHashMap<String, u32>,
        merges: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, Unsupported> {
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        for (id, c) in byte_ids.iter_mut().zip(chars) {
            *id = *vocab
                .get(c.encode_utf8(&mut [0; 4]) as &str)
                .ok_or_else(|| format!("the vocabulary lacks the byte-level character {c:?}"))?;
        }
        let mut table = FxHashMap::default();
        let mut joined = String::new();
        for (rank, (left, right)) in merges.into_iter().enumerate() {
            let id = |s: &str| {
                vocab
                    .get(s)
                    .copied()
                    .ok_or_else(|| format!("merge {rank} names {s:?}, not in the vocabulary"))
            };
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let rank = u32::try_from(rank).map_err(|_| "too many merges".to_owned())?;
            table.insert(pair(id(left)?, id(right)?), (rank, id(&joined)?));
        }
        Ok(Self {
            byte_ids,
            merges: table,
        })
    }

    #[inline]
    fn merge(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        self.merges.get(&pair(left, right)).copied()
    }

    /// Appends the ids of one pre-tokenized piece (raw bytes) to `out`.
    pub fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        match piece.len() {
            0 => {}
            1 => out.push(self.byte_ids[usize::from(piece[0])]),
            n if n <= SHORT => self.encode_short(piece, out),
            _ => self.encode_long(piece, out),
        }
    }

    /// Rescans an array of symbols for the lowest-ranked pair.
    fn encode_short(&self, piece: &[u8], out: &mut Vec<u32>) {
        let mut symbols = [0u32; SHORT];
        let mut ranks = [(u32::MAX, 0u32); SHORT];
        let mut n = piece.len();
        for (s, &b) in symbols.iter_mut().zip(piece) {
            *s = self.byte_ids[usize::from(b)];
        }
        let rank_of = |l, r| self.merge(l, r).unwrap_or((u32::MAX, 0));
        for i in 0..n - 1 {
            ranks[i] = rank_of(symbols[i], symbols[i + 1]);
        }
        loop {
            let mut best = u32::MAX;
            let mut at = 0;
            for (i, &(rank, _)) in ranks[..n - 1].iter().enumerate() {
                if rank < best {
                    best = rank;
                    at = i;
                }
            }
            if best == u32::MAX {
                break;
            }
            symbols[at] = ranks[at].1;
            symbols.copy_within(at + 2..n, at + 1);
            ranks.copy_within(at + 1..n - 1, at);
            n -= 1;
            if at > 0 {
                ranks[at - 1] = rank_of(symbols[at - 1], symbols[at]);
            }
            if at + 1 < n {
                ranks[at] = rank_of(symbols[at], symbols[at + 1]);
            }
            if n == 1 {
                break;
            }
        }
        out.extend_from_slice(&symbols[..n]);
    }

    /// A heap of candidate merges over a doubly linked list of symbols;
    /// stale candidates are skipped when popped.
    fn encode_long(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let n = piece.len();
        let mut id: Vec<u32> = piece
            .iter()
            .map(|&b| self.byte_ids[usize::from(b)])
            .collect();
        let mut alive = vec![true; n];
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        // (rank, position of the left symbol, the merged id).
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some((rank, merged)) = self.merge(id[i], id[i + 1]) {
                heap.push(Reverse((rank, i, merged)));
            }
        }
        while let Some(Reverse((rank, left, merged))) = heap.pop() {
            let right = next[left];
            if !alive[left] || right == NONE {
                continue;
            }
            // Still the pair the candidate was made for?
            if self.merge(id[left], id[right]) != Some((rank, merged)) {
                continue;
            }
            id[left] = merged;
            alive[right] = false;
            next[left] = next[right];
            if next[left] != NONE {
                prev[next[left]] = left;
            }
            if prev[left] != NONE {
                let p = prev[left];
                if let Some((rank, merged)) = self.merge(id[p], id[left]) {
                    heap.push(Reverse((rank, p, merged)));
                }
            }
            if next[left] != NONE {
                if let Some((rank, merged)) = self.merge(id[left], id[next[left]]) {
                    heap.push(Reverse((rank, left, merged)));
                }
            }
        }
        let mut at = 0;
        while at != NONE {
            out.push(id[at]);
            at = next[at];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MERGES: [(&str, &str); 7] = [
        ("a", "b"),
        ("b", "c"),
        ("ab", "c"),
        ("c", "c"),
        ("a", "a"),
        ("aa", "aa"),
        ("cc", "ab"),
    ];

    /// Every byte, plus the merges over `a b c` (which overlap).
    fn toy_vocab() -> FxHashMap<String, u32> {
        let mut vocab: FxHashMap<String, u32> = byte_chars()
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        for (l, r) in MERGES {
            let next = vocab.len() as u32;
            vocab.entry(format!("{l}{r}")).or_insert(next);
        }
        vocab
    }

    /// The rule written plainly: strings, the lowest-ranked adjacent
    /// pair, the leftmost on a tie.
    fn reference(piece: &str, vocab: &FxHashMap<String, u32>) -> Vec<u32> {
        let mut symbols: Vec<String> = piece.chars().map(String::from).collect();
        loop {
            let best = (0..symbols.len().saturating_sub(1))
                .filter_map(|i| {
                    let rank = MERGES
                        .iter()
                        .position(|&(l, r)| l == symbols[i] && r == symbols[i + 1])?;
                    Some((rank, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        symbols.iter().map(|s| vocab[s]).collect()
    }

    #[test]
    fn the_lowest_ranked_pair_merges_first() {
        let vocab = toy_vocab();
        let bpe = ByteLevelBpe::new(&vocab, MERGES).unwrap();
        let mut ids = Vec::new();
        // "ab" (rank 0) before "bc" (rank 1), then "ab"+"c" (rank 2).
        bpe.encode_piece(b"abc", &mut ids);
        assert_eq!(ids, [vocab["abc"]]);
        ids.clear();
        // "ab" (rank 0), then "cc" (rank 3), then "cc"+"ab" (rank 6).
        bpe.encode_piece(b"ccab", &mut ids);
        assert_eq!(ids, [vocab["ccab"]]);
    }

    #[test]
    fn a_merge_naming_an_unknown_token_is_unsupported() {
        let vocab = toy_vocab();
        let err = ByteLevelBpe::new(&vocab, [("a", "z")]).unwrap_err();
        assert!(err.contains("az"), "{err}");
    }

    #[test]
    fn byte_chars_are_a_bijection_onto_printable_characters() {
        let chars = byte_chars();
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(chars[b'a' as usize], 'a');
        assert_eq!(chars[b' ' as usize], '\u{120}');
        assert!(chars.iter().all(|c| !c.is_whitespace() && !c.is_control()));
    }

    fn abc(max: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(prop_oneof![Just('a'), Just('b'), Just('c')], 1..max)
            .prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        /// Both paths give the reference's ids.
        #[test]
        fn both_paths_follow_the_reference(piece in abc(3 * SHORT)) {
            let vocab = toy_vocab();
            let bpe = ByteLevelBpe::new(&vocab, MERGES).unwrap();
            let expected = reference(&piece, &vocab);
            let mut long = Vec::new();
            bpe.encode_long(piece.as_bytes(), &mut long);
            prop_assert_eq!(&long, &expected);
            if piece.len() <= SHORT {
                let mut short = Vec::new();
                bpe.encode_short(piece.as_bytes(), &mut short);
                prop_assert_eq!(&short, &expected);
            }
        }
    }
}
