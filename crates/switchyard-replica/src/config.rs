//! [`ReplicaConfig`]: one struct that the config file's `[replica]` table
//! and the flags fill (`switchyard serve`'s flags are
//! `server::replica::ReplicaArgs`, which override the file's values).

use crate::signing::BatchSigner;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A secret (password, token) from the config file or the environment:
/// never printed (`Debug` shows `"<redacted>"`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl Secret {
    /// The secret itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// A flag's or a variable's value (clap builds a `Secret` from it).
impl From<String> for Secret {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl From<&str> for Secret {
    fn from(text: &str) -> Self {
        Self(text.to_owned())
    }
}

/// How this replica proves itself to the NATS server, and how it checks
/// the server (TLS). At most one of user/password, token and credentials
/// file; TLS combines with any.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsAuth {
    /// User name (with a password).
    pub user: Option<String>,
    /// Password (prefer `password_file` or the environment).
    pub password: Option<Secret>,
    /// A file whose contents (trailing newline trimmed) are the password.
    pub password_file: Option<PathBuf>,
    /// Token (prefer `token_file` or the environment).
    pub token: Option<Secret>,
    /// A file whose contents (trailing newline trimmed) are the token.
    pub token_file: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: user JWT and NKey seed).
    pub creds_file: Option<PathBuf>,
    /// PEM file of the CA(s) that signed the server's certificate.
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (with
    /// `tls_key_file`).
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Refuse a server that does not speak TLS (implied by a `tls://` URL).
    pub require_tls: bool,
}

/// Settings of replica sync. Off unless `nats_url` is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Share bookings with peer replicas over NATS at this URL
    /// (`nats://HOST:PORT`); off when absent.
    pub nats_url: Option<String>,
    /// Replica-sync namespace (first subject level).
    pub namespace: String,
    /// Endpoint: replicas of different endpoints never see each other.
    pub endpoint: String,
    /// Events queued for publishing before the newest is dropped.
    pub queue_capacity: usize,
    /// Most events in one published batch.
    pub batch_max_events: usize,
    /// Longest wait for a batch to fill, in milliseconds.
    pub batch_max_delay_ms: f64,
    /// An idle publisher sends an empty batch this often, so peers keep its
    /// bookings.
    pub heartbeat_ms: f64,
    /// A peer silent this long has its bookings freed. Also the `Router`'s
    /// `remote.silence_expiry_ms`.
    pub silence_expiry_ms: f64,
    /// How often the subscriber checks for silent peers.
    pub expiry_check_ms: f64,
    /// How often this replica publishes a digest of its live bookings, so
    /// that peers drop bookings whose free was lost.
    pub digest_ms: f64,
    /// Live bookings held per peer; a peer's further bookings are dropped.
    /// The `Router`'s `remote.max_bookings_per_replica`.
    pub max_bookings_per_peer: usize,
    /// Session bindings remembered per peer; its oldest is forgotten. The
    /// `Router`'s `remote.max_sessions_per_replica`.
    pub max_sessions_per_peer: usize,
    /// Bytes of bookings held per peer (256 bytes a booking plus 8 a
    /// block); a peer's further bookings are dropped. The `Router`'s
    /// `remote.max_bytes_per_replica`.
    pub max_bytes_per_peer: usize,
    /// Bytes of bookings held across every peer; further bookings are
    /// dropped. The `Router`'s `remote.max_total_bytes`.
    pub max_peer_bytes_total: usize,
    /// Largest message this replica publishes or accepts, in bytes (its
    /// signature aside); a larger one received is refused and counted.
    pub max_batch_bytes: usize,
    /// Key shared by the plane's replicas, signing every batch (HMAC-SHA256,
    /// see [`crate::signing`]); at least 32 bytes. Prefer `signing_key_file`.
    pub signing_key: Option<Secret>,
    /// A file whose contents (trailing newline trimmed) are `signing_key`.
    pub signing_key_file: Option<PathBuf>,
    /// Authentication and TLS towards the NATS server.
    pub auth: NatsAuth,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            nats_url: None,
            namespace: "default".into(),
            endpoint: "generate".into(),
            queue_capacity: 100_000,
            batch_max_events: 128,
            batch_max_delay_ms: 1.0,
            heartbeat_ms: 1_000.0,
            silence_expiry_ms: 300_000.0,
            expiry_check_ms: 1_000.0,
            digest_ms: 2_000.0,
            max_bookings_per_peer: 262_144,
            max_sessions_per_peer: 65_536,
            max_bytes_per_peer: 128 << 20,
            max_peer_bytes_total: 512 << 20,
            max_batch_bytes: 1 << 20,
            signing_key: None,
            signing_key_file: None,
            auth: NatsAuth::default(),
        }
    }
}

/// The smallest `max_batch_bytes` accepted: one booking with a few blocks.
pub const MIN_BATCH_BYTES: usize = 4096;

/// Why a [`ReplicaConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ReplicaConfigError {
    /// Not a `nats://` or `tls://` URL.
    #[error("--replica-sync must be nats://HOST:PORT or tls://HOST:PORT, got {0:?}")]
    Url(String),
    /// Authentication settings that contradict each other.
    #[error("replica NATS authentication: {0}")]
    Auth(&'static str),
    /// A subject level that NATS would split or treat as a wildcard.
    #[error("replica {what} {value:?} must be nonempty without '.', '*', '>' or whitespace")]
    SubjectToken {
        /// `namespace` or `endpoint`.
        what: &'static str,
        /// The value.
        value: String,
    },
    /// Zero capacity or batch size.
    #[error("replica {0} must be at least 1")]
    Zero(&'static str),
    /// A message size limit too small for one booking.
    #[error("replica max_batch_bytes must be at least {MIN_BATCH_BYTES}, got {0}")]
    BatchBytes(usize),
    /// A duration that is not positive and finite.
    #[error("replica {what} must be positive and finite, got {value}")]
    Duration {
        /// Which.
        what: &'static str,
        /// The value.
        value: f64,
    },
    /// Heartbeats too rare to keep bookings alive.
    #[error(
        "replica heartbeat ({heartbeat_ms} ms) must be shorter than the expiry ({expiry_ms} ms)"
    )]
    Heartbeat {
        /// The heartbeat.
        heartbeat_ms: f64,
        /// The expiry.
        expiry_ms: f64,
    },
}

impl ReplicaConfig {
    /// Whether replica sync is on.
    pub fn enabled(&self) -> bool {
        self.nats_url.is_some()
    }

    /// How this replica signs and checks batches: from `signing_key`, or
    /// `signing_key_file` read now. `Err` says why a configured key cannot
    /// be used.
    pub fn signer(&self) -> Result<BatchSigner, String> {
        let key = secret(
            self.signing_key.as_ref(),
            self.signing_key_file.as_ref(),
            "signing key",
        )
        .map_err(|e| e.to_string())?;
        match key {
            None => Ok(BatchSigner::Unsigned),
            Some(key) => BatchSigner::with_key(key.as_bytes()),
        }
    }

    /// What an operator should hear at start-up about this plane's trust:
    /// empty when it is authenticated and signed.
    pub fn security_warnings(&self) -> Vec<&'static str> {
        if !self.enabled() {
            return Vec::new();
        }
        let signed = self.signing_key.is_some() || self.signing_key_file.is_some();
        let auth = &self.auth;
        let authenticated = auth.user.is_some()
            || auth.token.is_some()
            || auth.token_file.is_some()
            || auth.creds_file.is_some()
            || auth.tls_cert_file.is_some();
        let mut warnings = Vec::new();
        if !authenticated && !signed {
            warnings.push(
                "the replica plane is unauthenticated: anything that reaches the NATS server can publish bookings under any replica's name (set NATS credentials and --replica-signing-key-file)",
            );
        } else if !signed {
            warnings.push(
                "replica batches are not signed: any client with the NATS credentials can publish bookings under any replica's name (set --replica-signing-key-file)",
            );
        }
        warnings
    }

    /// The subject this replica publishes and subscribes on.
    pub fn subject(&self) -> String {
        format!(
            "switchyard.{}.{}.active_sequences",
            self.namespace, self.endpoint
        )
    }

    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), ReplicaConfigError> {
        if let Some(url) = &self.nats_url {
            let rest = url
                .strip_prefix("nats://")
                .or_else(|| url.strip_prefix("tls://"))
                .unwrap_or("");
            if rest.is_empty() || rest.contains('/') {
                return Err(ReplicaConfigError::Url(url.clone()));
            }
        }
        self.auth.validate()?;
        for (what, value) in [("namespace", &self.namespace), ("endpoint", &self.endpoint)] {
            if value.is_empty()
                || value
                    .chars()
                    .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace())
            {
                return Err(ReplicaConfigError::SubjectToken {
                    what,
                    value: value.clone(),
                });
            }
        }
        if self.queue_capacity == 0 {
            return Err(ReplicaConfigError::Zero("queue_capacity"));
        }
        if self.batch_max_events == 0 {
            return Err(ReplicaConfigError::Zero("batch_max_events"));
        }
        if self.max_bookings_per_peer == 0 {
            return Err(ReplicaConfigError::Zero("max_bookings_per_peer"));
        }
        if self.max_sessions_per_peer == 0 {
            return Err(ReplicaConfigError::Zero("max_sessions_per_peer"));
        }
        if self.max_batch_bytes < MIN_BATCH_BYTES {
            return Err(ReplicaConfigError::BatchBytes(self.max_batch_bytes));
        }
        if self.signing_key.is_some() && self.signing_key_file.is_some() {
            return Err(ReplicaConfigError::Auth(
                "give the signing key or a signing key file, not both",
            ));
        }
        if let Some(key) = &self.signing_key {
            BatchSigner::with_key(key.0.as_bytes()).map_err(|_| {
                ReplicaConfigError::Auth("the replica signing key must be at least 32 bytes")
            })?;
        }
        for (what, value) in [
            ("batch_max_delay_ms", self.batch_max_delay_ms),
            ("heartbeat_ms", self.heartbeat_ms),
            ("silence_expiry_ms", self.silence_expiry_ms),
            ("expiry_check_ms", self.expiry_check_ms),
            ("digest_ms", self.digest_ms),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(ReplicaConfigError::Duration { what, value });
            }
        }
        if self.heartbeat_ms >= self.silence_expiry_ms {
            return Err(ReplicaConfigError::Heartbeat {
                heartbeat_ms: self.heartbeat_ms,
                expiry_ms: self.silence_expiry_ms,
            });
        }
        Ok(())
    }
}

impl NatsAuth {
    /// Checks that the settings name one way to authenticate.
    pub fn validate(&self) -> Result<(), ReplicaConfigError> {
        use ReplicaConfigError::Auth;
        if self.password.is_some() && self.password_file.is_some() {
            return Err(Auth("give the password or a password file, not both"));
        }
        if self.token.is_some() && self.token_file.is_some() {
            return Err(Auth("give the token or a token file, not both"));
        }
        let password = self.password.is_some() || self.password_file.is_some();
        if self.user.is_some() != password {
            return Err(Auth("a user needs a password and a password needs a user"));
        }
        let token = self.token.is_some() || self.token_file.is_some();
        let ways = [self.user.is_some(), token, self.creds_file.is_some()];
        if ways.iter().filter(|&&w| w).count() > 1 {
            return Err(Auth(
                "choose one of user and password, token, or credentials file",
            ));
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(Auth(
                "a TLS client certificate needs its key, and a key its certificate",
            ));
        }
        Ok(())
    }

    /// The password, from the setting or its file.
    pub fn password(&self) -> std::io::Result<Option<String>> {
        secret(
            self.password.as_ref(),
            self.password_file.as_ref(),
            "password",
        )
    }

    /// The token, from the setting or its file.
    pub fn token(&self) -> std::io::Result<Option<String>> {
        secret(self.token.as_ref(), self.token_file.as_ref(), "token")
    }
}

/// A secret given directly or as a file (its contents without the
/// trailing line break); an empty one is an error.
fn secret(
    value: Option<&Secret>,
    file: Option<&PathBuf>,
    what: &str,
) -> std::io::Result<Option<String>> {
    let text = match (value, file) {
        (Some(v), _) => v.0.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("reading the NATS {what} file {}: {e}", path.display()),
                )
            })?
            .trim_end_matches(['\n', '\r'])
            .to_owned(),
        (None, None) => return Ok(None),
    };
    if text.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("the NATS {what} is empty"),
        ));
    }
    Ok(Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unauthenticated_or_unsigned_plane_is_warned_about_and_a_signed_one_is_not() {
        let mut config = ReplicaConfig {
            nats_url: Some("nats://127.0.0.1:4222".into()),
            ..ReplicaConfig::default()
        };
        assert!(config.security_warnings()[0].contains("unauthenticated"));
        config.auth.creds_file = Some("/run/replica.creds".into());
        assert!(config.security_warnings()[0].contains("not signed"));
        config.signing_key_file = Some("/run/replica.key".into());
        assert!(config.security_warnings().is_empty());
        assert!(
            ReplicaConfig::default().security_warnings().is_empty(),
            "sync off"
        );
    }

    #[test]
    fn a_signing_key_is_read_from_its_file_and_a_short_or_doubled_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("sy-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "0123456789abcdef0123456789abcdef\n").unwrap();
        let mut config = ReplicaConfig {
            signing_key_file: Some(file.clone()),
            ..ReplicaConfig::default()
        };
        assert_eq!(config.validate(), Ok(()));
        assert!(config.signer().unwrap().signs());
        config.signing_key_file = Some(dir.join("missing"));
        assert!(config.signer().is_err());
        config.signing_key_file = Some(file);
        config.signing_key = Some(Secret("0123456789abcdef0123456789abcdef".into()));
        assert!(config.validate().is_err());
        config.signing_key_file = None;
        config.signing_key = Some(Secret("short".into()));
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("32 bytes"));
        assert!(!ReplicaConfig::default().signer().unwrap().signs());
        assert!(ReplicaConfig {
            max_batch_bytes: 100,
            ..ReplicaConfig::default()
        }
        .validate()
        .is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_defaults_validate_and_sync_is_off() {
        let config = ReplicaConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert!(!config.enabled());
        assert_eq!(
            config.subject(),
            "switchyard.default.generate.active_sequences"
        );
    }

    #[test]
    fn bad_values_are_refused_with_their_name() {
        let bad = |f: fn(&mut ReplicaConfig)| {
            let mut c = ReplicaConfig::default();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(bad(|c| c.nats_url = Some("http://x:1".into())).contains("nats://"));
        assert!(bad(|c| c.endpoint = "a.b".into()).contains("endpoint"));
        assert!(bad(|c| c.namespace = "*".into()).contains("namespace"));
        assert!(bad(|c| c.queue_capacity = 0).contains("queue_capacity"));
        assert!(bad(|c| c.batch_max_delay_ms = 0.0).contains("batch_max_delay_ms"));
        assert!(bad(|c| c.heartbeat_ms = 400_000.0).contains("heartbeat"));
        assert!(bad(|c| c.digest_ms = f64::NAN).contains("digest_ms"));
        assert!(bad(|c| c.max_bookings_per_peer = 0).contains("max_bookings_per_peer"));
        assert!(bad(|c| c.max_sessions_per_peer = 0).contains("max_sessions_per_peer"));
    }

    #[test]
    fn authentication_names_one_way_and_tls_urls_are_accepted() {
        let with = |f: fn(&mut NatsAuth)| {
            let mut c = ReplicaConfig {
                nats_url: Some("tls://nats.internal:4222".into()),
                ..ReplicaConfig::default()
            };
            f(&mut c.auth);
            c.validate().map_err(|e| e.to_string())
        };
        assert_eq!(with(|_| {}), Ok(()));
        assert_eq!(
            with(|a| {
                a.user = Some("router".into());
                a.password_file = Some("/run/secrets/nats".into());
            }),
            Ok(())
        );
        assert!(with(|a| a.user = Some("router".into()))
            .unwrap_err()
            .contains("needs a password"));
        assert!(with(|a| {
            a.user = Some("router".into());
            a.password = Some(Secret("p".into()));
            a.token = Some(Secret("t".into()));
        })
        .unwrap_err()
        .contains("choose one"));
        assert!(with(|a| {
            a.token = Some(Secret("t".into()));
            a.token_file = Some("/x".into());
        })
        .unwrap_err()
        .contains("not both"));
        assert!(with(|a| a.tls_cert_file = Some("/c.pem".into()))
            .unwrap_err()
            .contains("key"));
        assert!(with(|a| {
            a.creds_file = Some("/r.creds".into());
            a.tls_ca_file = Some("/ca.pem".into());
            a.tls_cert_file = Some("/c.pem".into());
            a.tls_key_file = Some("/k.pem".into());
            a.require_tls = true;
        })
        .is_ok());
    }

    #[test]
    fn secrets_come_from_files_without_their_line_break_and_never_print() {
        let dir = std::env::temp_dir().join(format!("sy-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        let auth = NatsAuth {
            token_file: Some(file.clone()),
            password: Some(Secret("hunter2".into())),
            ..NatsAuth::default()
        };
        assert_eq!(auth.token().unwrap().as_deref(), Some("s3cret"));
        assert_eq!(auth.password().unwrap().as_deref(), Some("hunter2"));
        assert!(!format!("{auth:?}").contains("hunter2"));
        let missing = NatsAuth {
            password_file: Some(dir.join("absent")),
            ..NatsAuth::default()
        };
        let err = missing.password().unwrap_err().to_string();
        assert!(
            err.contains("password file") && err.contains("absent"),
            "{err}"
        );
        std::fs::write(&file, "\n").unwrap();
        assert!(auth.token().unwrap_err().to_string().contains("empty"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_config_file_fills_the_same_struct_and_rejects_unknown_keys() {
        let c: ReplicaConfig = serde_json::from_str(
            r#"{"nats_url": "nats://127.0.0.1:4222", "endpoint": "chat",
                "auth": {"user": "router", "password_file": "/run/secrets/nats"}}"#,
        )
        .unwrap();
        assert_eq!(c.auth.user.as_deref(), Some("router"));
        assert!(c.enabled());
        assert_eq!(c.queue_capacity, 100_000);
        assert!(serde_json::from_str::<ReplicaConfig>(r#"{"queue": 1}"#).is_err());
    }
}
