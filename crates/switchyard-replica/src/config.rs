//! [`ReplicaConfig`]: one struct that the config file's `[replica]` table
//! and the flags fill (`switchyard serve`'s flags are
//! `server::replica::ReplicaArgs`, which override the file's values).

use serde::{Deserialize, Serialize};

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
        }
    }
}

/// Why a [`ReplicaConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ReplicaConfigError {
    /// Not a `nats://` URL.
    #[error("--replica-sync must be nats://HOST:PORT, got {0:?}")]
    Url(String),
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
            let rest = url.strip_prefix("nats://").unwrap_or("");
            if rest.is_empty() || rest.contains('/') {
                return Err(ReplicaConfigError::Url(url.clone()));
            }
        }
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
        for (what, value) in [
            ("batch_max_delay_ms", self.batch_max_delay_ms),
            ("heartbeat_ms", self.heartbeat_ms),
            ("silence_expiry_ms", self.silence_expiry_ms),
            ("expiry_check_ms", self.expiry_check_ms),
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn a_config_file_fills_the_same_struct_and_rejects_unknown_keys() {
        let c: ReplicaConfig =
            serde_json::from_str(r#"{"nats_url": "nats://127.0.0.1:4222", "endpoint": "chat"}"#)
                .unwrap();
        assert!(c.enabled());
        assert_eq!(c.queue_capacity, 100_000);
        assert!(serde_json::from_str::<ReplicaConfig>(r#"{"queue": 1}"#).is_err());
    }
}
