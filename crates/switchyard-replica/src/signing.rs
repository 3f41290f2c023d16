//! Signed batches: an HMAC-SHA256 over the subject and the encoded batch,
//! with a key every replica of the plane shares (`signing_key` or
//! `signing_key_file`).
//!
//! Why a shared key rather than tying an origin to its NATS identity: NATS
//! core does not tell a subscriber who published a message, so a receiver
//! cannot check a declared origin against a NATS user; a key held only by
//! the replicas proves that a batch comes from one of them, whatever NATS
//! accounts the deployment uses, and costs one HMAC a message.
//!
//! A signed message is `SYH1`, the 32-byte tag, then the batch. The subject
//! is signed with the batch, so a batch cannot be moved to another
//! namespace or endpoint. What a key does not stop: a holder of the key can
//! still state any origin (the replicas trust each other), and a recorded
//! batch can be sent again (its `Add`s are duplicates of live bookings, and
//! anything it re-adds is freed by its origin's next digest).
//!
//! A replica without a key strips a signature unchecked and reads the
//! batch, so a plane can be moved to signing one replica at a time; a
//! replica with a key refuses unsigned batches and bad tags (counted).

use bytes::Bytes;
use ring::hmac;

/// The first bytes of a signed message. No batch starts with them: an
/// encoded batch starts with a msgpack array or map marker.
pub const SIGNED_MAGIC: &[u8; 4] = b"SYH1";

/// Bytes a signature adds to a message.
pub const SIGNATURE_BYTES: usize = SIGNED_MAGIC.len() + 32;

/// The shortest key accepted, in bytes (the HMAC-SHA256 output size).
pub const MIN_KEY_BYTES: usize = 32;

/// How this replica signs and checks batches.
#[derive(Debug)]
pub enum BatchSigner {
    /// No key: batches go out unsigned; a signed one is read unchecked.
    Unsigned,
    /// Signs every batch and refuses any batch without a valid tag.
    Key(hmac::Key),
    /// A key was configured but could not be read: nothing is sent and
    /// nothing is accepted (fail closed). Holds why.
    Unreadable(String),
}

/// Why a received message was refused before decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// This replica signs, and the message carries no signature.
    Unsigned,
    /// The tag does not match the subject and batch under this key.
    BadSignature,
}

impl BatchSigner {
    /// A signer with `key` (at least [`MIN_KEY_BYTES`] bytes).
    pub fn with_key(key: &[u8]) -> Result<Self, String> {
        if key.len() < MIN_KEY_BYTES {
            return Err(format!(
                "the replica signing key must be at least {MIN_KEY_BYTES} bytes, got {}",
                key.len()
            ));
        }
        Ok(Self::Key(hmac::Key::new(hmac::HMAC_SHA256, key)))
    }

    /// Whether batches are signed and checked.
    pub fn signs(&self) -> bool {
        !matches!(self, BatchSigner::Unsigned)
    }

    /// Bytes a signature adds to each message.
    pub fn overhead(&self) -> usize {
        if self.signs() {
            SIGNATURE_BYTES
        } else {
            0
        }
    }

    /// The message to publish for `batch` on `subject`; `None` when the
    /// key is unreadable.
    pub fn seal(&self, subject: &str, batch: Bytes) -> Option<Bytes> {
        match self {
            BatchSigner::Unsigned => Some(batch),
            BatchSigner::Unreadable(_) => None,
            BatchSigner::Key(key) => {
                let tag = sign(key, subject, &batch);
                let mut out = Vec::with_capacity(SIGNATURE_BYTES + batch.len());
                out.extend_from_slice(SIGNED_MAGIC);
                out.extend_from_slice(tag.as_ref());
                out.extend_from_slice(&batch);
                Some(Bytes::from(out))
            }
        }
    }

    /// The batch inside `message` received on `subject`, or why it is
    /// refused.
    pub fn open<'a>(&self, subject: &str, message: &'a [u8]) -> Result<&'a [u8], Refusal> {
        let signed = message.len() >= SIGNATURE_BYTES && message.starts_with(SIGNED_MAGIC);
        match self {
            BatchSigner::Unsigned if signed => Ok(&message[SIGNATURE_BYTES..]),
            BatchSigner::Unsigned => Ok(message),
            BatchSigner::Unreadable(_) => Err(Refusal::BadSignature),
            BatchSigner::Key(_) if !signed => Err(Refusal::Unsigned),
            BatchSigner::Key(key) => {
                let (tag, batch) = message[SIGNED_MAGIC.len()..].split_at(32);
                let mut signed_bytes = Vec::with_capacity(subject.len() + 1 + batch.len());
                signed_bytes.extend_from_slice(subject.as_bytes());
                signed_bytes.push(0);
                signed_bytes.extend_from_slice(batch);
                hmac::verify(key, &signed_bytes, tag)
                    .map(|()| batch)
                    .map_err(|_| Refusal::BadSignature)
            }
        }
    }
}

/// The tag of `batch` on `subject`: the subject, a zero byte, the batch.
fn sign(key: &hmac::Key, subject: &str, batch: &[u8]) -> hmac::Tag {
    let mut context = hmac::Context::with_key(key);
    context.update(subject.as_bytes());
    context.update(&[0]);
    context.update(batch);
    context.sign()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn a_sealed_batch_opens_under_the_same_key_and_subject_only() {
        let signer = BatchSigner::with_key(KEY).unwrap();
        let sealed = signer
            .seal("s.a", Bytes::from_static(b"\x93batch"))
            .unwrap();
        assert_eq!(sealed.len(), SIGNATURE_BYTES + 6);
        assert_eq!(signer.open("s.a", &sealed), Ok(&b"\x93batch"[..]));
        assert_eq!(signer.open("s.b", &sealed), Err(Refusal::BadSignature));
        let other = BatchSigner::with_key(b"another key of at least 32 bytes!").unwrap();
        assert_eq!(other.open("s.a", &sealed), Err(Refusal::BadSignature));
        let mut tampered = sealed.to_vec();
        *tampered.last_mut().unwrap() ^= 1;
        assert_eq!(signer.open("s.a", &tampered), Err(Refusal::BadSignature));
    }

    #[test]
    fn a_signing_replica_refuses_unsigned_batches_and_an_unsigned_one_reads_both() {
        let signer = BatchSigner::with_key(KEY).unwrap();
        assert_eq!(signer.open("s", b"\x93batch"), Err(Refusal::Unsigned));
        assert_eq!(signer.open("s", b""), Err(Refusal::Unsigned));
        let sealed = signer.seal("s", Bytes::from_static(b"\x93batch")).unwrap();
        let unsigned = BatchSigner::Unsigned;
        assert_eq!(unsigned.open("s", &sealed), Ok(&b"\x93batch"[..]));
        assert_eq!(unsigned.open("s", b"\x93batch"), Ok(&b"\x93batch"[..]));
    }

    #[test]
    fn short_keys_are_refused_and_an_unreadable_key_fails_closed() {
        assert!(BatchSigner::with_key(b"short").is_err());
        let broken = BatchSigner::Unreadable("no such file".into());
        assert_eq!(broken.seal("s", Bytes::from_static(b"x")), None);
        assert_eq!(broken.open("s", b"\x93"), Err(Refusal::BadSignature));
    }
}
