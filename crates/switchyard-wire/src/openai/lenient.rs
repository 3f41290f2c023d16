//! Lenient reading: fields whose wrong-typed value is kept as "invalid" or
//! read as "absent" instead of failing the whole body, in one pass: no
//! value is copied into a JSON tree, not even a wrong-typed one (a list of
//! millions of numbers sent as `n` costs nothing to judge).

use super::{ErrorBody, StreamOptions};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::marker::PhantomData;

/// A field that the router forwards without reading and a worker reads:
/// [`Lenient::Valid`] when it has its documented type, [`Lenient::Invalid`]
/// otherwise. One request type serves both servers: the router passes a
/// wrong-typed value on for the engine to judge (as it did before it
/// parsed the field at all), and a worker refuses it naming the field
/// ([`Lenient::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lenient<T> {
    /// The value, of the documented type.
    Valid(T),
    /// Present, but not of the documented type (its value is not kept).
    Invalid,
}

impl<T> Lenient<T> {
    /// The value if valid.
    pub fn valid(self) -> Option<T> {
        match self {
            Lenient::Valid(v) => Some(v),
            Lenient::Invalid => None,
        }
    }

    /// The value, or a 400 naming `field` and what it must be.
    pub fn check(&self, field: &str, expected: &str) -> Result<&T, ErrorBody> {
        match self {
            Lenient::Valid(v) => Ok(v),
            Lenient::Invalid => Err(ErrorBody::invalid_request(
                format!("`{field}` must be {expected}"),
                Some(field),
            )),
        }
    }
}

/// A type a [`Lenient`] field can hold: it judges a value as valid or not
/// in one pass, without buffering it (an untagged retry would copy the
/// value into a generic tree first: some 32 bytes per element of a list
/// sent where a number belongs).
pub trait Judged: Sized {
    /// Reads a value: `Valid` when of this type, `Invalid` (the value read
    /// and dropped) otherwise.
    fn judge<'de, D: Deserializer<'de>>(d: D) -> Result<Lenient<Self>, D::Error>;
}

impl<'de, T: Judged> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::judge(deserializer)
    }
}

/// A scalar type a [`Lenient`] field can hold, by the JSON scalars it
/// takes: `Some` for a value of the type, `None` (invalid) otherwise.
/// Every other value (list, object, null, and whatever a type's methods
/// leave at `None`) is invalid.
trait Scalar: Sized {
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_f64(_: f64) -> Option<Self> {
        None
    }
    fn from_str(_: &str) -> Option<Self> {
        None
    }
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
}

/// A count (`n`, `max_tokens`, ...) is read as the engines read it, so
/// that a limit checked on it binds whatever JSON form it takes: vLLM and
/// SGLang declare these fields `int` in pydantic models, whose default
/// (lax) mode takes an integral float (`64.0`, `1e8`) or a string of an
/// integer (`"64"`, `"64.0"`) as that integer and refuses a fraction
/// (`1.5`). Here: a JSON integer, a float with no fractional part, or a
/// string of ASCII digits optionally followed by `.` and zeros, each from
/// 0 to `u32::MAX`; anything else is invalid (refused by name, never read
/// as another number). Strings pydantic also takes (signs, `_`
/// separators, surrounding spaces) are invalid here: refused, so never
/// read differently from the engine.
impl Scalar for u32 {
    fn from_u64(v: u64) -> Option<u32> {
        u32::try_from(v).ok()
    }
    fn from_i64(v: i64) -> Option<u32> {
        u32::try_from(v).ok()
    }
    fn from_f64(v: f64) -> Option<u32> {
        // NaN and the infinities fail the range test; -0.0 is 0.
        let integral = v.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&v);
        integral.then_some(v as u32)
    }
    fn from_str(v: &str) -> Option<u32> {
        let digits = match v.split_once('.') {
            Some((digits, zeros)) if zeros.bytes().all(|b| b == b'0') => digits,
            Some(_) => return None,
            None => v,
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    }
}

impl Scalar for bool {
    fn from_bool(v: bool) -> Option<bool> {
        Some(v)
    }
}

/// Judges any value as a [`Scalar`] `T`.
struct ScalarVisitor<T>(PhantomData<T>);

impl<'de, T: Scalar> Visitor<'de> for ScalarVisitor<T> {
    type Value = Lenient<T>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Lenient<T>, E> {
        Ok(T::from_u64(v).map_or(Lenient::Invalid, Lenient::Valid))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Lenient<T>, E> {
        Ok(T::from_i64(v).map_or(Lenient::Invalid, Lenient::Valid))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Lenient<T>, E> {
        Ok(T::from_bool(v).map_or(Lenient::Invalid, Lenient::Valid))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Lenient<T>, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Lenient<T>, A::Error> {
        drain_seq(seq).map(|()| Lenient::Invalid)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Lenient<T>, A::Error> {
        drain_map(map).map(|()| Lenient::Invalid)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Lenient<T>, E> {
        Ok(T::from_str(v).map_or(Lenient::Invalid, Lenient::Valid))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Lenient<T>, E> {
        Ok(T::from_f64(v).map_or(Lenient::Invalid, Lenient::Valid))
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Lenient<T>, E> {
        Ok(Lenient::Invalid)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Lenient<T>, E> {
        Ok(Lenient::Invalid)
    }
    fn visit_none<E: de::Error>(self) -> Result<Lenient<T>, E> {
        Ok(Lenient::Invalid)
    }
}

impl Judged for u32 {
    fn judge<'de, D: Deserializer<'de>>(d: D) -> Result<Lenient<u32>, D::Error> {
        d.deserialize_any(ScalarVisitor(PhantomData))
    }
}

impl Judged for bool {
    fn judge<'de, D: Deserializer<'de>>(d: D) -> Result<Lenient<bool>, D::Error> {
        d.deserialize_any(ScalarVisitor(PhantomData))
    }
}

impl Judged for StreamOptions {
    /// An object whose `include_usage` (default false) is a boolean, once;
    /// other keys ignored.
    fn judge<'de, D: Deserializer<'de>>(d: D) -> Result<Lenient<StreamOptions>, D::Error> {
        struct OptionsVisitor;
        impl<'de> Visitor<'de> for OptionsVisitor {
            type Value = Lenient<StreamOptions>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut include_usage: Option<Lenient<bool>> = None;
                let mut valid = true;
                while let Some(key) = map.next_key::<MaybeString>()? {
                    if key.0.as_deref() == Some("include_usage") {
                        let value = map.next_value::<Lenient<bool>>()?;
                        valid &= include_usage.is_none();
                        include_usage = Some(value);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(match include_usage {
                    _ if !valid => Lenient::Invalid,
                    None => Lenient::Valid(StreamOptions::default()),
                    Some(Lenient::Valid(include_usage)) => {
                        Lenient::Valid(StreamOptions { include_usage })
                    }
                    Some(Lenient::Invalid) => Lenient::Invalid,
                })
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                StreamOptions::judge(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                drain_seq(seq).map(|()| Lenient::Invalid)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Lenient::Invalid)
            }
            scalars_are!(Lenient::Invalid);
        }
        d.deserialize_any(OptionsVisitor)
    }
}

/// `visit_*` for every scalar (and null), each returning `$value`.
macro_rules! scalars_are {
    ($value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}
pub(super) use scalars_are;

/// Reads and drops the rest of a sequence.
pub(super) fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Reads and drops the rest of a map.
pub(super) fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A string, or `None` for a value of any other type.
pub(super) struct MaybeString(pub(super) Option<String>);

impl<'de> Deserialize<'de> for MaybeString {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StrOrAnything;
        impl<'de> Visitor<'de> for StrOrAnything {
            type Value = MaybeString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(v)))
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<MaybeString, D::Error> {
                MaybeString::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<MaybeString, A::Error> {
                drain_seq(seq).map(|()| MaybeString(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<MaybeString, A::Error> {
                drain_map(map).map(|()| MaybeString(None))
            }
            scalars_are!(MaybeString(None));
        }
        deserializer.deserialize_any(StrOrAnything)
    }
}

/// `Some(T)` from an object, `None` from a value of any other type: for
/// fields where a wrong-typed value means "absent", not "broken".
pub(crate) fn object_or_none<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct ObjectOrAnything<T>(PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectOrAnything<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any value")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<T>, A::Error> {
            T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Some)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<T>, A::Error> {
            drain_seq(seq).map(|()| None)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
            d.deserialize_any(self)
        }
        scalars_are!(None);
    }
    deserializer.deserialize_any(ObjectOrAnything(PhantomData))
}
