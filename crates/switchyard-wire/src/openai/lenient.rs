//! Lenient reading: fields whose wrong-typed value is kept as "invalid" or
//! read as "absent" instead of failing the whole body, without building a
//! JSON tree for the values that are fine.

use super::ErrorBody;
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

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // The value is buffered only to retry it as "anything": these
        // fields are scalars or small objects, never prompt text.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr<T> {
            Valid(T),
            Invalid(IgnoredAny),
        }
        Ok(match Repr::<T>::deserialize(deserializer)? {
            Repr::Valid(v) => Lenient::Valid(v),
            Repr::Invalid(_) => Lenient::Invalid,
        })
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
pub(super) fn object_or_none<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
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
