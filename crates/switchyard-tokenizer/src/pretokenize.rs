//! The pre-tokenizer of the Qwen2/Qwen3 family, without a regex engine.
//!
//! Their `tokenizer.json` splits text with this pattern (Split, behaviour
//! `Isolated`), then maps each piece's bytes to byte-level characters:
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! [`QwenSplit`] finds the same pieces as the backtracking engine the
//! `tokenizers` crate runs (`fancy-regex`): at each position the first
//! alternative that matches, in order. Every character starts a match of
//! some alternative (a letter the second, a number the third, any other
//! non-space the fourth, a space the last), so the pieces tile the text.
//!
//! The character classes come from `regex-syntax`, the tables the
//! reference engine itself is built from, so `\p{L}`, `\p{N}`, `\s` and the
//! case folds of `(?i)` agree with it character for character.

use regex_syntax::hir::{Class, HirKind};

/// The split pattern this module implements, as `tokenizer.json` spells it.
pub const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const SPACE: u8 = 4;

/// A set of characters: sorted, disjoint inclusive ranges.
#[derive(Debug, Clone)]
struct CharSet(Vec<(char, char)>);

impl CharSet {
    /// The class a one-class regex denotes (`\p{L}`, `(?i)s`, …).
    fn of(pattern: &str) -> Self {
        let hir = regex_syntax::Parser::new()
            .parse(pattern)
            .expect("the built-in class patterns parse");
        let ranges = match hir.kind() {
            HirKind::Class(Class::Unicode(class)) => class
                .ranges()
                .iter()
                .map(|r| (r.start(), r.end()))
                .collect(),
            HirKind::Literal(lit) => {
                let c = std::str::from_utf8(&lit.0)
                    .ok()
                    .and_then(|s| s.chars().next())
                    .expect("a one-character literal");
                vec![(c, c)]
            }
            other => panic!("{pattern} is not a class: {other:?}"),
        };
        Self(ranges)
    }

    fn contains(&self, c: char) -> bool {
        self.0
            .binary_search_by(|&(lo, hi)| {
                if hi < c {
                    std::cmp::Ordering::Less
                } else if lo > c {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .is_ok()
    }
}

/// The character classes of [`QWEN_PATTERN`].
#[derive(Debug, Clone)]
pub struct Classes {
    ascii: [u8; 128],
    letter: CharSet,
    number: CharSet,
    space: CharSet,
    /// `(?i)` folds of the contraction letters, indexed as [`FOLDED`].
    folds: Vec<CharSet>,
}

/// The letters of the contractions `'s 't 're 've 'm 'll 'd`.
const FOLDED: [char; 8] = ['s', 't', 'r', 'e', 'v', 'm', 'l', 'd'];

impl Classes {
    /// Builds the tables (a few hundred microseconds; once per tokenizer).
    pub fn new() -> Self {
        let letter = CharSet::of(r"\p{L}");
        let number = CharSet::of(r"\p{N}");
        let space = CharSet::of(r"\s");
        let mut ascii = [0u8; 128];
        let folds = FOLDED
            .iter()
            .map(|c| CharSet::of(&format!("(?i){c}")))
            .collect();
        let mut classes = Self {
            ascii: [0; 128],
            letter,
            number,
            space,
            folds,
        };
        for (b, flags) in ascii.iter_mut().enumerate() {
            *flags = classes.lookup(char::from(b as u8));
        }
        classes.ascii = ascii;
        classes
    }

    /// The flags of `c` from the range tables.
    fn lookup(&self, c: char) -> u8 {
        let flag = |set: &CharSet, flag: u8| if set.contains(c) { flag } else { 0 };
        flag(&self.letter, LETTER) | flag(&self.number, NUMBER) | flag(&self.space, SPACE)
    }

    #[inline]
    fn flags(&self, c: char) -> u8 {
        if c.is_ascii() {
            self.ascii[c as usize]
        } else {
            self.lookup(c)
        }
    }

    fn folds_to(&self, c: char, letter: char) -> bool {
        if c.is_ascii() {
            return c.eq_ignore_ascii_case(&letter);
        }
        let i = FOLDED
            .iter()
            .position(|&l| l == letter)
            .expect("a contraction letter");
        self.folds[i].contains(c)
    }
}

impl Default for Classes {
    fn default() -> Self {
        Self::new()
    }
}

/// The pieces of `text` under [`QWEN_PATTERN`], in order; they tile it.
pub struct QwenSplit<'t, 'c> {
    text: &'t str,
    at: usize,
    classes: &'c Classes,
}

impl<'t, 'c> QwenSplit<'t, 'c> {
    /// Splits `text`.
    pub fn new(text: &'t str, classes: &'c Classes) -> Self {
        Self {
            text,
            at: 0,
            classes,
        }
    }

    fn char_at(&self, at: usize) -> Option<(char, u8)> {
        self.text[at..]
            .chars()
            .next()
            .map(|c| (c, self.classes.flags(c)))
    }

    /// The end of the run of characters from `at` whose flags pass `keep`.
    fn run_end(&self, mut at: usize, keep: impl Fn(char, u8) -> bool) -> usize {
        for c in self.text[at..].chars() {
            if !keep(c, self.classes.flags(c)) {
                break;
            }
            at += c.len_utf8();
        }
        at
    }

    /// The end of the match that starts at `at` (a character boundary
    /// before the end of the text).
    fn match_end(&self, at: usize) -> usize {
        let (c, flags) = self.char_at(at).expect("not at the end");
        let after = at + c.len_utf8();
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == '\'' {
            let mut rest = self.text[after..].chars();
            let first = rest.next();
            let second = rest.next();
            let folds = |c: Option<char>, l| c.is_some_and(|c| self.classes.folds_to(c, l));
            let len = |c: Option<char>| c.map_or(0, char::len_utf8);
            if folds(first, 's') || folds(first, 't') || folds(first, 'm') || folds(first, 'd') {
                return after + len(first);
            }
            if (folds(first, 'r') || folds(first, 'v')) && folds(second, 'e')
                || folds(first, 'l') && folds(second, 'l')
            {
                return after + len(first) + len(second);
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        let letters = |from| self.run_end(from, |_, f| f & LETTER != 0);
        if flags & LETTER != 0 {
            return letters(after);
        }
        if flags & NUMBER == 0 && c != '\r' && c != '\n' {
            if let Some((_, next)) = self.char_at(after).filter(|_| after < self.text.len()) {
                if next & LETTER != 0 {
                    return letters(after);
                }
            }
        }
        // \p{N}
        if flags & NUMBER != 0 {
            return after;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let other = |f: u8| f & (LETTER | NUMBER | SPACE) == 0;
        let symbols_from = if c == ' ' && after < self.text.len() {
            self.char_at(after)
                .filter(|&(_, f)| other(f))
                .map(|_| after)
        } else if other(flags) {
            Some(at)
        } else {
            None
        };
        if let Some(from) = symbols_from {
            let end = self.run_end(from, |_, f| other(f));
            return self.run_end(end, |c, _| c == '\r' || c == '\n');
        }
        // `c` is a space from here on.
        let spaces_end = self.run_end(at, |_, f| f & SPACE != 0);
        let spaces = &self.text[at..spaces_end];
        // \s*[\r\n]+ : up to the last line break of the run.
        if let Some(last_break) = spaces.rfind(['\r', '\n']) {
            return at + last_break + 1;
        }
        // \s+(?!\S) : the run, less its last character when a non-space
        // follows (and the run is longer than one character).
        if spaces_end == self.text.len() {
            return spaces_end;
        }
        let last = spaces.chars().next_back().map_or(0, char::len_utf8);
        if spaces_end - last > at {
            return spaces_end - last;
        }
        // \s+
        spaces_end
    }
}

impl<'t> Iterator for QwenSplit<'t, '_> {
    type Item = &'t str;

    fn next(&mut self) -> Option<&'t str> {
        if self.at >= self.text.len() {
            return None;
        }
        let start = self.at;
        self.at = self.match_end(start);
        Some(&self.text[start..self.at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let classes = Classes::new();
        QwenSplit::new(text, &classes).collect()
    }

    #[test]
    fn words_take_one_leading_non_letter() {
        assert_eq!(split("Hello, world!"), ["Hello", ",", " world", "!"]);
        assert_eq!(split("\tfoo (bar)"), ["\tfoo", " (", "bar", ")"]);
    }

    #[test]
    fn contractions_split_off_in_any_case() {
        assert_eq!(
            split("it's WE'LL you'Re"),
            ["it", "'s", " WE", "'LL", " you", "'Re"]
        );
        assert_eq!(split("'x"), ["'x"]);
    }

    #[test]
    fn numbers_are_one_digit_each() {
        assert_eq!(split("x 123"), ["x", " ", "1", "2", "3"]);
    }

    #[test]
    fn space_runs_leave_their_last_space_to_the_next_word() {
        assert_eq!(split("a   b"), ["a", "  ", " b"]);
        assert_eq!(split("a \n\n  b"), ["a", " \n\n", " ", " b"]);
        assert_eq!(split("end   "), ["end", "   "]);
        assert_eq!(split("!!! \r\n"), ["!!!", " \r\n"]);
        assert_eq!(split("x\n!"), ["x", "\n", "!"]);
    }

    #[test]
    fn symbols_keep_their_trailing_line_breaks() {
        assert_eq!(split("a.\n\nb"), ["a", ".\n\n", "b"]);
    }
}
