//! What a KV transfer between sim-workers carries and how it fails: the
//! lease as it travels ([`LeaseHandle`]) and the transfer's errors
//! ([`TransferError`]). Shared by the disaggregation handshake
//! ([`crate::disagg`]) and the engine driver ([`crate::driver`]), which
//! hands transfers to the engine and reports their failures.

use crate::metrics::DisaggFailure;
use switchyard_engine::lease::{LeaseId, LeaseRef};

/// A lease as it travels between workers: `ID.TOKEN` (decimal id, 32 hex
/// digits of secret). Its `Debug` hides the secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LeaseHandle(pub LeaseRef);

impl std::fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl LeaseHandle {
    /// The wire text (holds the secret: never log it).
    pub fn to_wire(self) -> String {
        format!("{}.{:032x}", self.0.id.0, self.0.token)
    }

    /// Parses the wire text; `None` unless exactly `ID.TOKEN`.
    pub fn from_wire(text: &str) -> Option<Self> {
        let (id, token) = text.split_once('.')?;
        if id.is_empty() || id.len() > 20 || token.len() != 32 {
            return None;
        }
        if !id.bytes().all(|b| b.is_ascii_digit()) || !token.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return None;
        }
        Some(Self(LeaseRef {
            id: LeaseId(id.parse().ok()?),
            token: u128::from_str_radix(token, 16).ok()?,
        }))
    }
}

/// Why a transfer failed (each a metric reason and an HTTP answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferError {
    /// The peer holds no such lease or room (never, released, expired, or
    /// a wrong token: not told apart).
    UnknownLease,
    /// The peer could not be reached.
    Unreachable(String),
    /// The room did not become ready within the bootstrap timeout.
    Timeout,
    /// The peer answered something that is not a transfer of this
    /// engine's shape (another engine id, block size or block list).
    Invalid(String),
}

impl TransferError {
    /// Its metric reason.
    pub fn failure(&self) -> DisaggFailure {
        match self {
            TransferError::UnknownLease => DisaggFailure::UnknownLease,
            TransferError::Unreachable(_) => DisaggFailure::Unreachable,
            TransferError::Timeout => DisaggFailure::Timeout,
            TransferError::Invalid(_) => DisaggFailure::InvalidTransfer,
        }
    }

    /// Its answer to the client.
    pub fn error_body(&self) -> switchyard_wire::openai::ErrorBody {
        use switchyard_wire::openai::ErrorBody;
        match self {
            TransferError::UnknownLease => ErrorBody::not_found(
                "the prefill worker holds no such KV (unknown, released or expired lease or room)",
                Some("kv_transfer_params"),
            ),
            TransferError::Unreachable(why) => {
                ErrorBody::upstream(format!("the prefill worker is unreachable: {why}"))
            }
            TransferError::Timeout => {
                ErrorBody::timeout("the prefill worker did not hold the room in time")
            }
            TransferError::Invalid(why) => ErrorBody::upstream(format!(
                "the prefill worker's KV transfer is invalid: {why}"
            )),
        }
    }
}
