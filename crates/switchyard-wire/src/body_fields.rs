//! A request body's top-level fields without a JSON tree.
//!
//! The disaggregated path rewrites a few top-level fields of the client's
//! body (`kv_transfer_params`, `max_tokens`, SGLang's bootstrap fields),
//! and a stream resumed on another worker reads its original request
//! again (which fields it sets, its `max_tokens`, its sampling fields).
//! Neither needs the body as a tree of values: a 32 MiB prompt of token
//! ids would become some 0.5 GiB of `serde_json::Value`s. [`Fields`] keeps
//! each top-level field as its JSON text, borrowed from the body
//! (serde_json's `RawValue`): a body costs its fields' names and a slice
//! each. What must be looked into (a chat's messages, a prompt's kind) is
//! read in one pass by [`messages_are_plain`] and [`prompt_kind`], which
//! keep nothing of a message's text or a prompt's ids.

use crate::openai::Lenient;
use serde::de::{Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A JSON object's top-level fields, each its JSON text (a duplicated
/// name keeps its last value, as a JSON tree does).
#[derive(Debug, Default)]
pub struct Fields<'a> {
    map: BTreeMap<String, Cow<'a, RawValue>>,
}

impl<'a> Fields<'a> {
    /// The fields of `body`, which must be one JSON object.
    pub fn parse(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        let map: BTreeMap<String, &'a RawValue> = serde_json::from_slice(body)?;
        Ok(Self {
            map: map
                .into_iter()
                .map(|(k, v)| (k, Cow::Borrowed(v)))
                .collect(),
        })
    }

    /// Field `name`'s JSON text, when present and not `null`.
    pub fn get(&self, name: &str) -> Option<&RawValue> {
        self.map
            .get(name)
            .map(|v| &**v)
            .filter(|v| v.get() != "null")
    }

    /// Whether field `name` is present and not `null`.
    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Every field that is not `null`, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &RawValue)> {
        self.map
            .iter()
            .map(|(k, v)| (k.as_str(), &**v))
            .filter(|(_, v)| v.get() != "null")
    }

    /// Sets field `name` to `value`.
    pub fn set(&mut self, name: &str, value: &impl serde::Serialize) {
        if let Ok(raw) = serde_json::value::to_raw_value(value) {
            self.map.insert(name.to_owned(), Cow::Owned(raw));
        }
    }

    /// Sets field `name` to JSON text `raw`.
    pub fn set_raw(&mut self, name: &str, raw: Box<RawValue>) {
        self.map.insert(name.to_owned(), Cow::Owned(raw));
    }

    /// Removes field `name`.
    pub fn remove(&mut self, name: &str) {
        self.map.remove(name);
    }

    /// Field `name` read as a count the way the engines read one (see
    /// [`Lenient`]): `None` when absent, `null` or no count.
    pub fn count(&self, name: &str) -> Option<u32> {
        let raw = self.get(name)?;
        serde_json::from_str::<Lenient<u32>>(raw.get())
            .ok()
            .and_then(Lenient::valid)
    }

    /// The object's JSON text.
    pub fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(&self.map).unwrap_or_default()
    }
}

/// Whether JSON text `raw` is a string.
pub fn is_string(raw: &RawValue) -> bool {
    raw.get().trim_start().starts_with('"')
}

/// Whether JSON text `raw` is an object.
pub fn is_object(raw: &RawValue) -> bool {
    raw.get().trim_start().starts_with('{')
}

/// The kind of a completion's `prompt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptKind {
    /// One text.
    Text,
    /// One list of token ids.
    Ids,
    /// A list of several prompts (texts or lists of ids).
    Batch,
    /// Anything else.
    Other,
}

/// The kind of `raw`, a `prompt`'s JSON text, read in one pass that keeps
/// nothing.
pub fn prompt_kind(raw: &RawValue) -> PromptKind {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    de.deserialize_any(KindVisitor).unwrap_or(PromptKind::Other)
}

struct KindVisitor;

impl<'de> Visitor<'de> for KindVisitor {
    type Value = PromptKind;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_str<E>(self, _: &str) -> Result<PromptKind, E> {
        Ok(PromptKind::Text)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptKind, A::Error> {
        let mut kind = PromptKind::Ids;
        while let Some(item) = seq.next_element::<Item>()? {
            if item == Item::Other {
                kind = PromptKind::Batch;
            }
        }
        Ok(kind)
    }

    fn visit_u64<E>(self, _: u64) -> Result<PromptKind, E> {
        Ok(PromptKind::Other)
    }

    fn visit_i64<E>(self, _: i64) -> Result<PromptKind, E> {
        Ok(PromptKind::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<PromptKind, E> {
        Ok(PromptKind::Other)
    }

    fn visit_bool<E>(self, _: bool) -> Result<PromptKind, E> {
        Ok(PromptKind::Other)
    }

    fn visit_unit<E>(self) -> Result<PromptKind, E> {
        Ok(PromptKind::Other)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<PromptKind, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(PromptKind::Other)
    }
}

/// One element of a prompt list: a token id, or anything else (skipped
/// without being kept).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Item {
    Id,
    Other,
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Item;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a prompt element")
            }
            fn visit_u64<E>(self, _: u64) -> Result<Item, E> {
                Ok(Item::Id)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Item, E> {
                Ok(Item::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Item, E> {
                Ok(Item::Other)
            }
            fn visit_str<E>(self, _: &str) -> Result<Item, E> {
                Ok(Item::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Item, E> {
                Ok(Item::Other)
            }
            fn visit_unit<E>(self) -> Result<Item, E> {
                Ok(Item::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Item::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Item::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// One chat message as its fields' JSON text (borrowed from the body).
type Message<'a> = BTreeMap<Cow<'a, str>, &'a RawValue>;

/// Whether every chat message in `raw` (a `messages` field) is one the
/// router's chat template renders as the engine does: a `system`, `user`
/// or `assistant` role and text content (a string, nothing, or exactly
/// one text part). `Err` says what is not, naming no content.
pub fn messages_are_plain(raw: &RawValue) -> Result<(), &'static str> {
    let Ok(messages) = serde_json::from_str::<Vec<&RawValue>>(raw.get()) else {
        return Err("its messages are not a list");
    };
    for message in messages {
        let Ok(fields) = serde_json::from_str::<Message<'_>>(message.get()) else {
            return Err("its messages are not objects");
        };
        for (key, value) in &fields {
            match key.as_ref() {
                "role" => match serde_json::from_str::<Cow<'_, str>>(value.get()).as_deref() {
                    Ok("system" | "user" | "assistant") => {}
                    _ => {
                        return Err("it has a message whose role is not system, user or assistant (a tool result, say)")
                    }
                },
                "content" => plain_content(value)?,
                _ if value.get() == "null" => {}
                _ => {
                    return Err("it has a message with more than a role and text content (a name or tool calls)")
                }
            }
        }
    }
    Ok(())
}

/// Text content: a string, nothing, or a list of exactly one text part
/// (several parts are joined by the engine in ways the router does not
/// repeat).
pub fn plain_content(content: &RawValue) -> Result<(), &'static str> {
    let text = content.get().trim_start();
    if text == "null" || is_string(content) {
        return Ok(());
    }
    if !text.starts_with('[') {
        return Err("it has message content that is not text");
    }
    let Ok(parts) = serde_json::from_str::<Vec<Message<'_>>>(text) else {
        return Err("it has image, audio or other non-text content parts");
    };
    let text_part = |p: &Message<'_>| {
        p.len() == 2
            && p.get("type").map(|t| t.get()) == Some("\"text\"")
            && p.get("text").is_some_and(|t| is_string(t))
    };
    if !parts.iter().all(text_part) {
        Err("it has image, audio or other non-text content parts")
    } else if parts.len() > 1 {
        Err("it has a message made of several text parts")
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).unwrap()
    }

    #[test]
    fn fields_are_read_set_and_written_without_a_tree() {
        let body = br#"{"prompt": [1, 2, 3], "stream": true, "n": null, "max_tokens": "64", "stream": false}"#;
        let mut fields = Fields::parse(body).unwrap();
        assert_eq!(fields.get("prompt").unwrap().get(), "[1, 2, 3]");
        assert_eq!(
            fields.get("stream").unwrap().get(),
            "false",
            "the last wins"
        );
        assert!(!fields.has("n"), "null is absent");
        assert_eq!(fields.count("max_tokens"), Some(64));
        fields.set("max_tokens", &1);
        fields.set_raw("kv_transfer_params", raw(r#"{"a": 1}"#));
        fields.remove("prompt");
        let written: serde_json::Value = serde_json::from_slice(&fields.to_vec()).unwrap();
        assert_eq!(
            written,
            serde_json::json!({"stream": false, "n": null, "max_tokens": 1, "kv_transfer_params": {"a": 1}})
        );
        for not_an_object in [&b"[1]"[..], b"12", b"{", b""] {
            assert!(Fields::parse(not_an_object).is_err());
        }
    }

    #[test]
    fn a_prompts_kind_is_read_in_one_pass() {
        for (text, kind) in [
            (r#""hello""#, PromptKind::Text),
            ("[1, 2, 3]", PromptKind::Ids),
            ("[]", PromptKind::Ids),
            (r#"["a", "b"]"#, PromptKind::Batch),
            ("[[1, 2], [3]]", PromptKind::Batch),
            ("[1, -2]", PromptKind::Batch),
            ("12", PromptKind::Other),
            (r#"{"a": 1}"#, PromptKind::Other),
        ] {
            assert_eq!(prompt_kind(&raw(text)), kind, "{text}");
        }
    }

    #[test]
    fn plain_messages_are_a_role_and_text() {
        let ok = [
            r#"[{"role": "user", "content": "hi"}]"#,
            r#"[{"role": "system", "content": null, "name": null}]"#,
            r#"[{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]"#,
        ];
        for text in ok {
            assert_eq!(messages_are_plain(&raw(text)), Ok(()), "{text}");
        }
        let refused = [
            (r#"{"role": "user"}"#, "not a list"),
            ("[1]", "not objects"),
            (r#"[{"role": "tool", "content": "x"}]"#, "role"),
            (
                r#"[{"role": "user", "content": "x", "name": "bob"}]"#,
                "more than",
            ),
            (r#"[{"role": "user", "content": 3}]"#, "not text"),
            (
                r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]"#,
                "non-text",
            ),
            (
                r#"[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]"#,
                "several text parts",
            ),
        ];
        for (text, why) in refused {
            let err = messages_are_plain(&raw(text)).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
    }
}
