//! Rate limits per API key (`[rate_limits]`): requests per second and
//! tokens per minute, each a GCRA token bucket per key (the `governor`
//! crate). A request is checked against its key's request bucket as soon
//! as the key is known (before the body is read) and against its token
//! bucket once its prompt is tokenized; it is charged the core's
//! `switchyard_core::admission::ask::Asked::token_charge`:
//! the tokens of every prompt of a batch, plus, for each prompt, its
//! choices (`n`, or `best_of` when larger) times the output tokens each
//! may take (`max_tokens` or `max_completion_tokens`; when it gives
//! neither, `default_output_tokens`, [`DEFAULT_OUTPUT_TOKENS`] unless
//! set: an allowance, since the engine then decides).
//! Over a limit the client gets a 429 with `Retry-After`; a request larger
//! than a whole minute's budget gets a 429 that says so (no `Retry-After`:
//! waiting cannot help). Refusals are counted per key name and limit in
//! `switchyard_rate_limited_total`.
//!
//! State is bounded: one pair of buckets per configured key, made at
//! startup; nothing is added per request.

use crate::error::ApiError;
use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

/// The output tokens charged per choice of a request that names no output
/// limit (`[rate_limits] default_output_tokens` unset). An allowance, not
/// a bound: the engine decides how much such a request generates (vLLM's
/// and SGLang's completion requests default `max_tokens` to 16, their
/// chat requests to none).
pub(crate) const DEFAULT_OUTPUT_TOKENS: u32 = 1024;

/// The limits of one key, or the defaults of every key (`None`: no limit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Sustained requests per second.
    pub requests_per_second: Option<NonZeroU32>,
    /// Requests a key may send at once after being idle
    /// [default: `requests_per_second`].
    pub burst: Option<NonZeroU32>,
    /// Prompt plus requested completion tokens per minute; also the
    /// largest single request.
    pub tokens_per_minute: Option<NonZeroU32>,
}

impl Limits {
    /// `self`, with each limit it leaves unset taken from `defaults`.
    fn or(self, defaults: Limits) -> Limits {
        Limits {
            requests_per_second: self.requests_per_second.or(defaults.requests_per_second),
            burst: self.burst.or(defaults.burst),
            tokens_per_minute: self.tokens_per_minute.or(defaults.tokens_per_minute),
        }
    }
}

/// A named client key with its own limits (`[[rate_limits.keys]]`). It is
/// accepted like an `--api-key`; its name labels its metrics.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedKey {
    /// Label in metrics and logs: 1 to 64 of `A-Z a-z 0-9 _ . -`.
    pub name: String,
    /// The secret itself (prefer `key_file`).
    #[serde(default)]
    pub key: Option<String>,
    /// A file whose first non-empty, non-`#` line is the secret.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// This key's requests per second [default: `[rate_limits]`'s].
    #[serde(default)]
    pub requests_per_second: Option<NonZeroU32>,
    /// This key's burst [default: `[rate_limits]`'s].
    #[serde(default)]
    pub burst: Option<NonZeroU32>,
    /// This key's tokens per minute [default: `[rate_limits]`'s].
    #[serde(default)]
    pub tokens_per_minute: Option<NonZeroU32>,
}

impl NamedKey {
    /// Its own limits (unset: the defaults').
    pub fn limits(&self) -> Limits {
        Limits {
            requests_per_second: self.requests_per_second,
            burst: self.burst,
            tokens_per_minute: self.tokens_per_minute,
        }
    }
}

impl std::fmt::Debug for NamedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedKey")
            .field("name", &self.name)
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .field("key_file", &self.key_file)
            .field("limits", &self.limits())
            .finish()
    }
}

/// `[rate_limits]`: defaults for every key, and named keys with their own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Requests per second of every key that does not set its own.
    #[serde(default)]
    pub requests_per_second: Option<NonZeroU32>,
    /// Burst of every key that does not set its own
    /// [default: `requests_per_second`].
    #[serde(default)]
    pub burst: Option<NonZeroU32>,
    /// Tokens per minute of every key that does not set its own.
    #[serde(default)]
    pub tokens_per_minute: Option<NonZeroU32>,
    /// Output tokens charged per choice of a request that names no output
    /// limit [default: [`DEFAULT_OUTPUT_TOKENS`]].
    #[serde(default)]
    pub default_output_tokens: Option<u32>,
    /// Named keys.
    #[serde(default)]
    pub keys: Vec<NamedKey>,
}

impl RateLimitConfig {
    /// The limits of a key that sets none of its own.
    pub fn defaults(&self) -> Limits {
        Limits {
            requests_per_second: self.requests_per_second,
            burst: self.burst,
            tokens_per_minute: self.tokens_per_minute,
        }
    }

    /// Checks names and that each named key has exactly one secret source.
    pub fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::HashSet::new();
        for key in &self.keys {
            let valid = !key.name.is_empty()
                && key.name.len() <= 64
                && key
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
            if !valid {
                return Err(format!(
                    "rate_limits.keys: name {:?} must be 1 to 64 of A-Z a-z 0-9 _ . -",
                    key.name
                ));
            }
            if !names.insert(key.name.as_str()) {
                return Err(format!(
                    "rate_limits.keys: two keys are named {:?}",
                    key.name
                ));
            }
            if key.key.is_some() == key.key_file.is_some() {
                return Err(format!(
                    "rate_limits.keys {:?}: give exactly one of key and key_file",
                    key.name
                ));
            }
        }
        Ok(())
    }

    /// The output tokens charged per choice of a request that names none.
    pub fn output_allowance(&self) -> u32 {
        self.default_output_tokens.unwrap_or(DEFAULT_OUTPUT_TOKENS)
    }

    /// Whether any limit is set at all.
    pub fn any(&self) -> bool {
        let set = |l: &Limits| l.requests_per_second.is_some() || l.tokens_per_minute.is_some();
        set(&self.defaults()) || self.keys.iter().any(|k| set(&k.limits()))
    }
}

/// Which bucket refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per second.
    Requests,
    /// Tokens per minute.
    Tokens,
}

impl LimitKind {
    const ALL: [LimitKind; 2] = [LimitKind::Requests, LimitKind::Tokens];

    fn label(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
        }
    }
}

/// A refusal: which limit, its value, and when to retry (`None`: never, the
/// request alone is larger than the bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limited {
    /// The bucket.
    pub kind: LimitKind,
    /// Its limit (per second or per minute).
    pub limit: u32,
    /// What this request asked of it.
    pub requested: u64,
    /// How long until it would pass.
    pub retry_after: Option<Duration>,
}

impl From<Limited> for ApiError {
    fn from(l: Limited) -> Self {
        match (l.kind, l.retry_after) {
            (LimitKind::Requests, wait) => ApiError::rate_limited(
                format!(
                    "rate limit of {} requests per second for this API key reached; retry later",
                    l.limit
                ),
                wait,
            ),
            (LimitKind::Tokens, Some(wait)) => ApiError::rate_limited(
                format!(
                    "rate limit of {} tokens per minute for this API key reached ({} requested); retry later",
                    l.limit, l.requested
                ),
                Some(wait),
            ),
            (LimitKind::Tokens, None) => ApiError::rate_limited(
                format!(
                    "this request needs {} tokens (its prompts, plus its output tokens for each choice), more than this API key's limit of {} tokens per minute",
                    l.requested, l.limit
                ),
                None,
            ),
        }
    }
}

type Bucket<C> = RateLimiter<NotKeyed, InMemoryState, C, NoOpMiddleware<<C as Clock>::Instant>>;

struct KeyBuckets<C: Clock> {
    requests: Option<(Bucket<C>, u32)>,
    tokens: Option<(Bucket<C>, u32)>,
    /// Refusals, indexed by `LimitKind as usize`.
    refused: [Counter; 2],
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    key: String,
    limit: &'static str,
}

/// The buckets of every key the router accepts, indexed by the key's
/// position (its `KeyId`, [`crate::front::auth`]).
pub struct RateLimits<C: Clock = DefaultClock> {
    keys: Vec<KeyBuckets<C>>,
    clock: C,
    refused: Family<RefusalLabels, Counter>,
}

impl RateLimits<DefaultClock> {
    /// The buckets of keys named `names` (in `KeyId` order), each with its
    /// own limits or, where it has none, `defaults`.
    pub fn new<'a>(keys: impl IntoIterator<Item = (&'a str, Limits)>, defaults: Limits) -> Self {
        Self::with_clock(keys, defaults, DefaultClock::default())
    }
}

impl<C: Clock + Clone> RateLimits<C> {
    /// [`RateLimits::new`] on `clock`.
    pub fn with_clock<'a>(
        keys: impl IntoIterator<Item = (&'a str, Limits)>,
        defaults: Limits,
        clock: C,
    ) -> Self {
        let refused = Family::<RefusalLabels, Counter>::default();
        let keys = keys
            .into_iter()
            .map(|(name, own)| {
                let limits = own.or(defaults);
                let requests = limits.requests_per_second.map(|rps| {
                    let quota = Quota::per_second(rps).allow_burst(limits.burst.unwrap_or(rps));
                    (
                        RateLimiter::direct_with_clock(quota, clock.clone()),
                        rps.get(),
                    )
                });
                let tokens = limits.tokens_per_minute.map(|tpm| {
                    (
                        RateLimiter::direct_with_clock(Quota::per_minute(tpm), clock.clone()),
                        tpm.get(),
                    )
                });
                let refused = LimitKind::ALL.map(|kind| {
                    refused
                        .get_or_create(&RefusalLabels {
                            key: name.to_owned(),
                            limit: kind.label(),
                        })
                        .clone()
                });
                KeyBuckets {
                    requests,
                    tokens,
                    refused,
                }
            })
            .collect();
        Self {
            keys,
            clock,
            refused,
        }
    }

    /// Takes one request from key `key`'s bucket. An unknown key (no keys
    /// configured) is never limited.
    pub fn check_request(&self, key: usize) -> Result<(), Limited> {
        let Some(buckets) = self.keys.get(key) else {
            return Ok(());
        };
        let Some((bucket, limit)) = &buckets.requests else {
            return Ok(());
        };
        bucket.check().map_err(|not_until| {
            buckets.refused[LimitKind::Requests as usize].inc();
            Limited {
                kind: LimitKind::Requests,
                limit: *limit,
                requested: 1,
                retry_after: Some(not_until.wait_time_from(self.clock.now())),
            }
        })
    }

    /// Takes `tokens` from key `key`'s token bucket, all or nothing.
    pub fn check_tokens(&self, key: usize, tokens: u64) -> Result<(), Limited> {
        let Some(buckets) = self.keys.get(key) else {
            return Ok(());
        };
        let Some((bucket, limit)) = &buckets.tokens else {
            return Ok(());
        };
        let refuse = |retry_after| {
            buckets.refused[LimitKind::Tokens as usize].inc();
            Limited {
                kind: LimitKind::Tokens,
                limit: *limit,
                requested: tokens,
                retry_after,
            }
        };
        let Some(n) = u32::try_from(tokens).ok().and_then(NonZeroU32::new) else {
            return match tokens {
                0 => Ok(()),
                _ => Err(refuse(None)),
            };
        };
        match bucket.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(refuse(Some(not_until.wait_time_from(self.clock.now())))),
            Err(_insufficient_capacity) => Err(refuse(None)),
        }
    }

    /// Puts `switchyard_rate_limited_total{key, limit}` into `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_rate_limited",
            "Requests refused by a per-key rate limit, by key name and limit",
            self.refused.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    fn nz(n: u32) -> Option<NonZeroU32> {
        NonZeroU32::new(n)
    }

    fn limits(rps: u32, burst: u32, tpm: u32) -> Limits {
        Limits {
            requests_per_second: nz(rps),
            burst: nz(burst),
            tokens_per_minute: nz(tpm),
        }
    }

    fn two_keys(clock: &FakeRelativeClock) -> RateLimits<FakeRelativeClock> {
        RateLimits::with_clock(
            [("team-a", limits(2, 2, 0)), ("team-b", Limits::default())],
            limits(10, 0, 1000),
            clock.clone(),
        )
    }

    #[test]
    fn a_key_gets_its_burst_then_waits_one_period_per_request() {
        let clock = FakeRelativeClock::default();
        let limits = two_keys(&clock);
        assert_eq!(limits.check_request(0), Ok(()));
        assert_eq!(limits.check_request(0), Ok(()));
        let refused = limits.check_request(0).unwrap_err();
        assert_eq!(refused.kind, LimitKind::Requests);
        assert_eq!(refused.limit, 2);
        assert_eq!(refused.retry_after, Some(Duration::from_millis(500)));
        clock.advance(Duration::from_millis(500));
        assert_eq!(limits.check_request(0), Ok(()));
        assert!(limits.check_request(0).is_err());
    }

    #[test]
    fn one_keys_limit_does_not_touch_another_key() {
        let clock = FakeRelativeClock::default();
        let limits = two_keys(&clock);
        while limits.check_request(0).is_ok() {}
        // team-b has the defaults: 10 per second, burst 10.
        for _ in 0..10 {
            assert_eq!(limits.check_request(1), Ok(()));
        }
        assert!(limits.check_request(1).is_err());
    }

    #[test]
    fn tokens_are_taken_all_or_nothing_and_refilled_over_the_minute() {
        let clock = FakeRelativeClock::default();
        let limits = two_keys(&clock);
        // team-a sets no token limit of its own: the default 1000 per minute.
        assert_eq!(limits.check_tokens(0, 600), Ok(()));
        let refused = limits.check_tokens(0, 600).unwrap_err();
        assert_eq!(refused.kind, LimitKind::Tokens);
        assert_eq!((refused.limit, refused.requested), (1000, 600));
        // 200 more tokens are due after 12 s (1000 per 60 s).
        assert_eq!(refused.retry_after, Some(Duration::from_secs(12)));
        assert_eq!(limits.check_tokens(0, 400), Ok(()));
        clock.advance(Duration::from_secs(12));
        assert_eq!(limits.check_tokens(0, 200), Ok(()));
    }

    #[test]
    fn a_request_larger_than_a_minutes_budget_is_refused_without_a_retry_time() {
        let clock = FakeRelativeClock::default();
        let limits = two_keys(&clock);
        for tokens in [1001, u64::from(u32::MAX) + 1] {
            let refused = limits.check_tokens(1, tokens).unwrap_err();
            assert_eq!(refused.retry_after, None);
            assert_eq!(refused.requested, tokens);
        }
        // Nothing was taken by the refusals.
        assert_eq!(limits.check_tokens(1, 1000), Ok(()));
    }

    #[test]
    fn the_output_allowance_is_configurable_and_defaults_to_1024() {
        assert_eq!(RateLimitConfig::default().output_allowance(), 1024);
        let set: RateLimitConfig = toml::from_str("default_output_tokens = 256\n").unwrap();
        assert_eq!(set.output_allowance(), 256);
    }

    #[test]
    fn no_limits_and_unknown_keys_pass() {
        let clock = FakeRelativeClock::default();
        let limits = RateLimits::with_clock([("k", Limits::default())], Limits::default(), clock);
        for _ in 0..10_000 {
            assert_eq!(limits.check_request(0), Ok(()));
        }
        assert_eq!(limits.check_tokens(0, u64::MAX), Ok(()));
        assert_eq!(limits.check_request(7), Ok(()));
    }

    #[test]
    fn refusals_are_counted_by_key_name_and_limit() {
        let clock = FakeRelativeClock::default();
        let limits = two_keys(&clock);
        let mut registry = Registry::default();
        limits.register(&mut registry);
        while limits.check_request(0).is_ok() {}
        let _ = limits.check_tokens(1, 5000);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"switchyard_rate_limited_total{key="team-a",limit="requests"} 1"#));
        assert!(text.contains(r#"switchyard_rate_limited_total{key="team-b",limit="tokens"} 1"#));
        assert!(text.contains(r#"switchyard_rate_limited_total{key="team-b",limit="requests"} 0"#));
    }

    #[test]
    fn a_refusal_is_a_429_naming_the_limit_with_retry_after_rounded_up() {
        let err = ApiError::from(Limited {
            kind: LimitKind::Requests,
            limit: 5,
            requested: 1,
            retry_after: Some(Duration::from_millis(200)),
        });
        assert_eq!(err.status.as_u16(), 429);
        assert_eq!(err.retry_after_secs, Some(1));
        let too_big = ApiError::from(Limited {
            kind: LimitKind::Tokens,
            limit: 100,
            requested: 500,
            retry_after: None,
        });
        assert_eq!(too_big.status.as_u16(), 429);
        assert_eq!(too_big.retry_after_secs, None);
    }

    #[test]
    fn the_config_refuses_bad_names_duplicates_and_ambiguous_secrets() {
        let parse = |text: &str| -> Result<RateLimitConfig, String> {
            let c: RateLimitConfig = toml::from_str(text).map_err(|e| e.to_string())?;
            c.validate().map(|()| c)
        };
        let ok = parse(
            "requests_per_second = 5\ntokens_per_minute = 1000\n[[keys]]\nname = \"team-a\"\nkey = \"s\"\nrequests_per_second = 1\n",
        )
        .unwrap();
        assert_eq!(ok.defaults().requests_per_second, nz(5));
        assert_eq!(ok.keys[0].limits().requests_per_second, nz(1));
        assert!(ok.any());
        assert!(!format!("{:?}", ok.keys[0]).contains("\"s\""));
        assert!(parse("[[keys]]\nname = \"a b\"\nkey = \"s\"\n").is_err());
        assert!(parse("[[keys]]\nname = \"a\"\n").is_err());
        assert!(parse("[[keys]]\nname = \"a\"\nkey = \"s\"\nkey_file = \"f\"\n").is_err());
        assert!(parse(
            "[[keys]]\nname = \"a\"\nkey = \"s\"\n[[keys]]\nname = \"a\"\nkey = \"t\"\n"
        )
        .is_err());
        assert!(parse("requests_per_second = 0\n").is_err());
        assert!(parse("request_per_second = 1\n").is_err());
    }
}
