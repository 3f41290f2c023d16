//! LoRA adapters on the simulated engine, with vLLM's runtime endpoints.
//!
//! vLLM (started with `--enable-lora` and
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) serves adapters as extra models:
//! `GET /v1/models` lists each with `"parent"` (the base model) and
//! `"root"` (its path); a request names an adapter as its `model`;
//! `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` loads one and
//! answers `200` with the text `Success: LoRA adapter 'NAME' added
//! successfully.` once it is loaded; a missing name or path, or a name
//! already loaded, is a `400` (`InvalidUserInput`);
//! `POST /v1/unload_lora_adapter {"lora_name"}` answers `200`
//! `Success: LoRA adapter 'NAME' removed successfully.`, or `404`
//! (`NotFoundError`) for an adapter it does not have (vLLM's
//! `serving_models.py`). A request for a model that is neither the base
//! nor a loaded adapter is a `404`.
//!
//! The simulated engine's adapters: at most `--max-loras` loaded (0, the
//! default, turns LoRA off: loads are refused); a load takes
//! `--lora-load-ms` of model time (divided by `--speedup`, like the
//! engine's steps; instant at speed-up 0) and counts as loaded from its
//! start (a second load of the same name is refused); a load into a full
//! table evicts the least recently used adapter (the simulated engine's
//! slots, [`switchyard_engine::adapters`]), counted — vLLM keeps
//! evicted adapters registered and reloads them from disk on the next
//! request, while the sim-worker forgets them, so its `/v1/models` is
//! always what it holds. Adapters do not change the simulated compute; a
//! request for an adapter hashes its blocks with the adapter's seed
//! (`switchyard_core::hashing::seed_for`), so its cached blocks are its
//! own, as in vLLM.

use crate::metrics::Metrics;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use switchyard_engine::adapters::AdapterSlots;
use switchyard_wire::openai::ErrorBody;

/// Longest adapter name or path accepted (bytes).
pub const MAX_FIELD_BYTES: usize = 4096;

/// Most adapters any sim-worker holds, whatever `--max-loras` says.
pub const MAX_LORAS_CAP: usize = 1024;

/// The worker's adapters.
#[derive(Debug)]
pub struct Adapters {
    max_loras: usize,
    load_time: Duration,
    base: Arc<str>,
    metrics: Arc<Metrics>,
    inner: Mutex<Inner>,
}

/// The loaded adapters (the simulated engine's slots, each with its path)
/// and the recency clock (a counter, bumped by each use).
#[derive(Debug)]
struct Inner {
    loaded: AdapterSlots<Arc<str>>,
    clock: u64,
}

impl Inner {
    /// The next recency stamp.
    fn tick(&mut self) -> f64 {
        self.clock += 1;
        self.clock as f64
    }
}

impl Adapters {
    /// `max_loras` slots (0: LoRA off; clamped to [`MAX_LORAS_CAP`]), each
    /// load taking `load_time` of wall time, adapters of base model `base`.
    pub fn new(
        max_loras: usize,
        load_time: Duration,
        base: Arc<str>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            max_loras: max_loras.min(MAX_LORAS_CAP),
            load_time,
            base,
            metrics,
            inner: Mutex::new(Inner {
                loaded: AdapterSlots::new(max_loras.min(MAX_LORAS_CAP)),
                clock: 0,
            }),
        }
    }

    /// Slots (`--max-loras`).
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `name` is loaded; a use refreshes its recency.
    pub fn touch(&self, name: &str) -> bool {
        let mut inner = self.lock();
        let now = inner.tick();
        inner.loaded.touch(name, now).is_some()
    }

    /// `(name, path)` of every loaded adapter, in load order.
    pub fn list(&self) -> Vec<(Arc<str>, Arc<str>)> {
        self.lock()
            .loaded
            .iter()
            .map(|(name, path)| (Arc::from(name), path.clone()))
            .collect()
    }

    fn refuse(&self, body: ErrorBody) -> ErrorBody {
        self.metrics.lora_load_failures.inc();
        body
    }

    /// vLLM's `/v1/load_lora_adapter`: checks, takes a slot (evicting the
    /// least recently used adapter when full), waits the load time, and
    /// answers vLLM's success text.
    pub async fn load(&self, name: Option<&str>, path: Option<&str>) -> Result<String, ErrorBody> {
        if self.max_loras == 0 {
            return Err(self.refuse(invalid_input(
                "LoRA is not enabled on this worker; start it with --max-loras N",
            )));
        }
        let (Some(name), Some(path)) = (
            name.filter(|n| !n.is_empty()),
            path.filter(|p| !p.is_empty()),
        ) else {
            return Err(self.refuse(invalid_input(
                "Both 'lora_name' and 'lora_path' must be provided.",
            )));
        };
        if name.len() > MAX_FIELD_BYTES || path.len() > MAX_FIELD_BYTES {
            return Err(self.refuse(invalid_input(format!(
                "lora_name and lora_path are limited to {MAX_FIELD_BYTES} bytes"
            ))));
        }
        if name == &*self.base {
            return Err(self.refuse(invalid_input(format!("'{name}' is the base model's name"))));
        }
        {
            let mut inner = self.lock();
            if inner.loaded.contains(name) {
                drop(inner);
                return Err(self.refuse(invalid_input(format!(
                    "The lora adapter '{name}' has already been loaded."
                ))));
            }
            let now = inner.tick();
            let evicted = inner.loaded.load(name, Arc::from(path), now);
            self.metrics.lora_evictions.inc_by(evicted.len() as u64);
            self.metrics.lora_adapters.set(inner.loaded.len() as i64);
        }
        if !self.load_time.is_zero() {
            tokio::time::sleep(self.load_time).await;
        }
        self.metrics.lora_loads.inc();
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// vLLM's `/v1/unload_lora_adapter`.
    pub fn unload(&self, name: Option<&str>) -> Result<String, ErrorBody> {
        let Some(name) = name.filter(|n| !n.is_empty()) else {
            return Err(invalid_input(
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
            ));
        };
        let mut inner = self.lock();
        if inner.loaded.unload(name).is_none() {
            return Err(ErrorBody::new(
                404,
                "NotFoundError",
                format!("The lora adapter '{name}' cannot be found."),
            ));
        }
        self.metrics.lora_adapters.set(inner.loaded.len() as i64);
        self.metrics.lora_unloads.inc();
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }
}

fn invalid_input(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(400, "InvalidUserInput", message)
}

/// `NAME=PATH` of `--lora-modules`.
pub fn parse_module(spec: &str) -> Result<(String, String), String> {
    match spec.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_owned(), path.to_owned()))
        }
        _ => Err(format!("expected NAME=PATH, got `{spec}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapters(max: usize) -> Adapters {
        Adapters::new(max, Duration::ZERO, "base".into(), Arc::new(Metrics::new()))
    }

    #[tokio::test]
    async fn loads_and_unloads_answer_as_vllm_does_and_a_full_table_evicts_the_coldest() {
        let a = adapters(2);
        assert_eq!(
            a.load(Some("x"), Some("/p/x")).await.unwrap(),
            "Success: LoRA adapter 'x' added successfully."
        );
        let again = a.load(Some("x"), Some("/p/x")).await.unwrap_err();
        assert_eq!(again.status(), Some(400));
        assert_eq!(
            a.load(Some("y"), None).await.unwrap_err().status(),
            Some(400)
        );
        a.load(Some("y"), Some("/p/y")).await.unwrap();
        assert!(a.touch("x"));
        a.load(Some("z"), Some("/p/z")).await.unwrap();
        let names: Vec<String> = a.list().iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(names, ["x", "z"], "y was the least recently used");
        assert_eq!(a.metrics.lora_evictions.get(), 1);
        assert_eq!(a.unload(Some("y")).unwrap_err().status(), Some(404));
        assert_eq!(
            a.unload(Some("x")).unwrap(),
            "Success: LoRA adapter 'x' removed successfully."
        );
        assert_eq!(a.metrics.lora_loads.get(), 3);
        assert_eq!(a.metrics.lora_unloads.get(), 1);
        assert_eq!(a.metrics.lora_load_failures.get(), 2);
        assert_eq!(a.metrics.lora_adapters.get(), 1);
        assert_eq!(
            adapters(0)
                .load(Some("x"), Some("/p"))
                .await
                .unwrap_err()
                .status(),
            Some(400)
        );
    }

    #[test]
    fn lora_modules_are_name_equals_path() {
        assert_eq!(parse_module("a=/x").unwrap(), ("a".into(), "/x".into()));
        assert!(parse_module("a").is_err() && parse_module("=x").is_err());
    }
}
