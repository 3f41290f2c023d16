//! JSON text as Python's `json.dumps` writes it: what a Hugging Face chat
//! template's `tojson` renders under `transformers` (and so under vLLM),
//! where templates put a request's tool list and an assistant's tool-call
//! arguments into the prompt.
//!
//! `transformers` replaces Jinja's `tojson` with `json.dumps(x,
//! ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//! That differs from minijinja's own `tojson` (compact, `<`, `>`, `&` and
//! `'` escaped as `\u003c`...) in every byte a template renders from it, so
//! a router rendering tools with minijinja's filter hashes another prompt
//! than the engine caches. The differences written here:
//!
//! - separators `", "` and `": "` (with `indent`, `","` and newlines);
//! - strings: `"`, `\`, and the control characters escaped (`\b`, `\f`,
//!   `\n`, `\r`, `\t`, others `\u00XX`), nothing else (`ensure_ascii`:
//!   every non-ASCII character as `\uXXXX`, by UTF-16 units);
//! - numbers: integers as they are; floats as Python's `repr` (`1.0`,
//!   `1e-07`, `1e+16`, `-0.0`);
//! - maps in their order (keys sorted with `sort_keys`).
//!
//! Integers past 64 bits (Python keeps them whole; they reach the template
//! as floats here) are the known difference.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};
use std::fmt::Write as _;

/// How to write: `json.dumps`'s keyword arguments.
struct Style {
    ensure_ascii: bool,
    sort_keys: bool,
    /// Spaces per level, or one line.
    indent: Option<usize>,
    item_separator: String,
    key_separator: String,
}

/// The `tojson` filter as `transformers` defines it (its first positional
/// argument is `ensure_ascii`; `indent`, `separators` and `sort_keys` by
/// keyword too).
pub(crate) fn tojson(
    value: &Value,
    ensure_ascii: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let ensure_ascii = match ensure_ascii {
        Some(flag) => flag,
        None => kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    let indent = kwargs
        .get::<Option<Value>>("indent")?
        .filter(|v| !v.is_none() && !v.is_undefined())
        .map(|v| {
            v.as_usize()
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "indent must be a count"))
        })
        .transpose()?;
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let (item_separator, key_separator) = match separators {
        Some(pair) if pair.len() == 2 => (pair[0].clone(), pair[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "separators must be a pair",
            ))
        }
        // Python's defaults: `", "` on one line, `","` when indented.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let style = Style {
        ensure_ascii,
        sort_keys,
        indent,
        item_separator,
        key_separator,
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

/// `value` as `json.dumps` writes it.
pub fn dumps(value: &serde_json::Value) -> String {
    let style = Style {
        ensure_ascii: false,
        sort_keys: false,
        indent: None,
        item_separator: ", ".to_owned(),
        key_separator: ": ".to_owned(),
    };
    let mut out = String::new();
    // A JSON tree has nothing `json.dumps` refuses.
    let _ = write_value(&mut out, &Value::from_serialize(value), &style, 0);
    out
}

fn not_serializable(kind: ValueKind) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("a {kind} is not JSON serializable"),
    )
}

fn write_value(out: &mut String, value: &Value, style: &Style, level: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => {
            let n = i128::try_from(value.clone())?;
            let _ = write!(out, "{n}");
        }
        ValueKind::Number => out.push_str(&py_float(f64::try_from(value.clone())?)),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), items.len(), style, level, |out, i| {
                write_value(out, &items[i], style, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut pairs: Vec<(Value, Value)> = match value.as_object() {
                Some(object) => object
                    .try_iter_pairs()
                    .ok_or_else(|| not_serializable(ValueKind::Map))?
                    .collect(),
                None => return Err(not_serializable(ValueKind::Map)),
            };
            if style.sort_keys {
                pairs.sort_by_cached_key(|(key, _)| key_text(key));
            }
            write_container(out, ('{', '}'), pairs.len(), style, level, |out, i| {
                let (key, item) = &pairs[i];
                match key.as_str() {
                    Some(text) => write_string(out, text, style),
                    None => write_string(out, &key_text(key), style),
                }
                out.push_str(&style.key_separator);
                write_value(out, item, style, level + 1)
            })?;
        }
        kind => return Err(not_serializable(kind)),
    }
    Ok(())
}

/// A map key as Python writes it: a string as it is, `true`, `false`,
/// `null` and numbers as their JSON text.
fn key_text(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None | ValueKind::Undefined => "null".to_owned(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_owned(),
        ValueKind::Number if !key.is_integer() => {
            py_float(f64::try_from(key.clone()).unwrap_or(0.0))
        }
        _ => key.to_string(),
    }
}

/// `[...]` or `{...}` of `len` items written by `item`, one line or
/// indented.
fn write_container(
    out: &mut String,
    (open, close): (char, char),
    len: usize,
    style: &Style,
    level: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(indent) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', indent * depth));
        }
    };
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_separator);
        }
        newline(out, level + 1);
        item(out, i)?;
    }
    newline(out, level);
    out.push(close);
    Ok(())
}

fn write_string(out: &mut String, s: &str, style: &Style) {
    out.push('"');
    // Runs of characters written as they are go in whole.
    let plain =
        |c: char| c >= ' ' && c != '"' && c != '\\' && (c.is_ascii() || !style.ensure_ascii);
    let mut rest = s;
    while let Some(at) = rest.find(|c: char| !plain(c)) {
        out.push_str(&rest[..at]);
        let c = rest[at..].chars().next().unwrap_or_default();
        rest = &rest[at + c.len_utf8()..];
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if style.ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push_str(rest);
    out.push('"');
}

/// A float as Python's `repr` writes it: the shortest digits that read
/// back as the same float, in exponent form below 1e-4 and from 1e16 on
/// (`1e-05`, `1e+16`), else with a fraction (`1.0`, `-0.0`).
pub(crate) fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .and_then(|(m, e)| Some((m, e.parse::<i32>().ok()?)))
        .unwrap_or((&scientific, 0));
    if x != 0.0 && !(-4..16).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs());
    }
    let plain = format!("{x}");
    if plain.contains('.') {
        plain
    } else {
        plain + ".0"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python 3.11's `repr` of each float, as `json.dumps` writes it.
    #[test]
    fn floats_read_as_pythons_repr() {
        for (x, python) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (1e-7, "1e-07"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1e20, "1e+20"),
            (123456789.125, "123456789.125"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (9999999999999998.0, "9999999999999998.0"),
            (-2.5e-300, "-2.5e-300"),
            (4.3754999232668e-310, "4.3754999232668e-310"),
            (5e-324, "5e-324"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(py_float(x), python, "{x:e}");
        }
    }

    /// What `json.dumps` writes, key order and all, with every escape.
    #[test]
    fn a_tree_is_written_as_json_dumps_writes_it() {
        let tree: serde_json::Value = serde_json::from_str(
            r#"{"z": 1, "a": [true, null, -3, 2.50, "<é> & 'q' \"\\ \n\t\u0001\u007f"], "e": {}, "l": []}"#,
        )
        .unwrap();
        assert_eq!(
            dumps(&tree),
            r#"{"z": 1, "a": [true, null, -3, 2.5, "<é> & 'q' \"\\ \n\t\u0001"#.to_owned()
                + "\u{7f}"
                + r#""], "e": {}, "l": []}"#
        );
    }

    fn json_tree() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            // Normal floats: serde_json's reader (the check's, not the
            // writer's) is inexact on subnormals; their digits are checked
            // in `floats_read_as_pythons_repr`.
            any::<f64>()
                .prop_filter("finite and normal", |x| x.is_normal() || *x == 0.0)
                .prop_map(serde_json::Value::from),
            any::<String>().prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                proptest::collection::vec((any::<String>(), inner), 0..6)
                    .prop_map(|pairs| serde_json::Value::Object(pairs.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Whatever the tree, the text reads back as the same tree, its
        /// keys in their order.
        #[test]
        fn what_is_written_reads_back_as_the_tree(tree in json_tree()) {
            let text = dumps(&tree);
            let back: serde_json::Value = serde_json::from_str(&text).unwrap();
            proptest::prop_assert!(same(&back, &tree), "{text}");
        }
    }

    /// The same tree, keys in the same order; floats within a few ulps
    /// (serde_json's reader, without `float_roundtrip`, may miss the last
    /// digits of the shortest form written: by two ulps at 1.86e146; the
    /// written digits themselves are checked exactly in
    /// `floats_read_as_pythons_repr`).
    fn same(a: &serde_json::Value, b: &serde_json::Value) -> bool {
        use serde_json::Value as J;
        match (a, b) {
            (J::Number(x), J::Number(y)) if x.is_f64() || y.is_f64() => {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                (x - y).abs() <= 8.0 * f64::EPSILON * x.abs().max(y.abs())
            }
            (J::Array(x), J::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
            }
            (J::Object(x), J::Object(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .zip(y)
                        .all(|((kx, vx), (ky, vy))| kx == ky && same(vx, vy))
            }
            (x, y) => x == y,
        }
    }

    #[test]
    fn the_filter_takes_transformers_arguments() {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        let render = |template: &str| {
            env.render_str(
                template,
                minijinja::context! { x => serde_json::json!({"b": ["é", 1], "a": {}}) },
            )
            .unwrap()
        };
        assert_eq!(render("{{ x | tojson }}"), r#"{"b": ["é", 1], "a": {}}"#);
        assert_eq!(
            render("{{ x | tojson(ensure_ascii=True) }}"),
            r#"{"b": ["\u00e9", 1], "a": {}}"#
        );
        assert_eq!(
            render("{{ x | tojson(sort_keys=True, separators=[',', ':']) }}"),
            r#"{"a":{},"b":["é",1]}"#
        );
        assert_eq!(
            render("{{ x | tojson(indent=2) }}"),
            "{\n  \"b\": [\n    \"é\",\n    1\n  ],\n  \"a\": {}\n}"
        );
    }
}
