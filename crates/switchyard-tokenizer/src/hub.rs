//! A model's tokenizer from the Hugging Face Hub, by its `hub_id`
//! (`Qwen/Qwen3-8B`): [`tokenizer_dir_from_hub`] finds `tokenizer.json`
//! and `tokenizer_config.json` in the Hugging Face cache, or, when
//! allowed, downloads them into it (the `hf-hub` crate: its cache layout
//! and its blocking `ureq` client over rustls), and returns the directory
//! that holds them, for [`crate::Tokenizer::from_dir`].
//!
//! The cache is the one `huggingface-cli download` and Python's
//! `huggingface_hub` fill: `<cache>/models--ORG--NAME/refs/main` holds the
//! commit of `main`, and `snapshots/<commit>/` the files (symbolic links
//! into `blobs/`). A cache filled on another machine and copied here
//! serves an offline router.
//!
//! Nothing here runs on the request path: a caller loads tokenizers when
//! it starts (a download blocks the calling thread; call it from
//! `spawn_blocking` inside a runtime).

use crate::{HF_CONFIG, HF_TOKENIZER};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::Cache;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Where and whether [`tokenizer_dir_from_hub`] may fetch a tokenizer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HubOptions {
    /// Download files missing from the cache (`--allow-hub-download`);
    /// `false` (the default) reads the cache only and never opens a
    /// connection.
    pub allow_download: bool,
    /// The hub cache directory (the one holding `models--ORG--NAME`);
    /// `None`: the environment's, as `huggingface_hub` (Python,
    /// `huggingface-cli`) finds it: `$HF_HUB_CACHE`, else `$HF_HOME/hub`,
    /// else `$XDG_CACHE_HOME/huggingface/hub`, else
    /// `~/.cache/huggingface/hub`.
    pub cache_dir: Option<PathBuf>,
}

/// Why no tokenizer directory could be had for a hub id. Each message
/// names the hub id, the files and the cache directory, and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The hub id is not `NAME` or `ORG/NAME`.
    #[error(
        "{hub_id:?} is not a Hugging Face Hub model id (ORG/NAME, such as Qwen/Qwen3-8B): \
         fix the model's hub_id, or give it a tokenizer_dir"
    )]
    InvalidId {
        /// The id given.
        hub_id: String,
    },
    /// No cache directory was given and the environment names none.
    #[error(
        "no Hugging Face cache directory for the tokenizer of {hub_id}: HF_HUB_CACHE, HF_HOME, \
         XDG_CACHE_HOME and HOME are all unset; set one of them, or give the model a \
         tokenizer_dir"
    )]
    NoCacheDir {
        /// The model.
        hub_id: String,
    },
    /// The tokenizer is not in the cache and downloading is not allowed.
    #[error(
        "the tokenizer of {hub_id} is not in the Hugging Face cache {}: looked for {}; \
         downloading is not allowed: pass --allow-hub-download (or set allow_download) to \
         fetch {HF_TOKENIZER} and {HF_CONFIG} into that cache, fill it with \
         `huggingface-cli download {hub_id} {HF_TOKENIZER} {HF_CONFIG}`, or give the model \
         a tokenizer_dir",
        cache_dir.display(),
        looked_for.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" and ")
    )]
    NotAllowed {
        /// The model.
        hub_id: String,
        /// The cache searched.
        cache_dir: PathBuf,
        /// The paths a cached copy would have had.
        looked_for: Vec<PathBuf>,
    },
    /// The Hub could not be reached (no network, DNS, proxy, TLS).
    #[error(
        "downloading {file} of {hub_id} into the Hugging Face cache {}: the Hub could not be \
         reached ({reason}); this machine may be offline: check the network (HTTPS_PROXY, \
         HF_ENDPOINT), copy a cache holding {HF_TOKENIZER} and {HF_CONFIG} of {hub_id} into \
         that directory, or give the model a tokenizer_dir",
        cache_dir.display()
    )]
    Offline {
        /// The model.
        hub_id: String,
        /// The file being fetched.
        file: &'static str,
        /// The cache it was to go into.
        cache_dir: PathBuf,
        /// The transport error.
        reason: String,
    },
    /// The Hub answered that the model or the file is not there, or not
    /// for us (gated or private).
    #[error(
        "downloading {file} of {hub_id} into the Hugging Face cache {}: the Hub answered \
         HTTP {status} (no such model or file, or a gated or private model): check the \
         hub_id, set HF_TOKEN to a token with access, or give the model a tokenizer_dir",
        cache_dir.display()
    )]
    NotFound {
        /// The model.
        hub_id: String,
        /// The file asked for.
        file: &'static str,
        /// The cache it was to go into.
        cache_dir: PathBuf,
        /// The HTTP status.
        status: u16,
    },
    /// Any other failure of a download (the Hub's answer, writing the
    /// cache).
    #[error(
        "downloading {file} of {hub_id} into the Hugging Face cache {}: {reason}; retry, \
         check that the cache directory is writable, or give the model a tokenizer_dir",
        cache_dir.display()
    )]
    Download {
        /// The model.
        hub_id: String,
        /// The file being fetched.
        file: &'static str,
        /// The cache it was to go into.
        cache_dir: PathBuf,
        /// What failed.
        reason: String,
    },
}

/// The directory holding the tokenizer of Hub model `hub_id`:
/// `<cache>/models--ORG--NAME/snapshots/<commit>/`, with `tokenizer.json`
/// and, when the model has one, `tokenizer_config.json` (its chat
/// template), ready for [`crate::Tokenizer::from_dir`].
///
/// The cache ([`HubOptions::cache_dir`]) is looked in
/// first, at the commit `refs/main` names: a cached `tokenizer.json` is
/// used without a connection (with a warning if its config is missing and
/// may not be downloaded). Otherwise, only when
/// [`HubOptions::allow_download`], the two files are downloaded from
/// `main` into the cache (`HF_ENDPOINT` replaces `https://huggingface.co`;
/// `HF_TOKEN`, else the cache's `token` file, authorises a gated model);
/// a model without `tokenizer_config.json` is served without a chat
/// template. Blocks the calling thread while it downloads.
///
/// Tested on caches laid out by hand in hf-hub's layout; the download
/// itself is not tested here (the tests run without network access).
pub fn tokenizer_dir_from_hub(hub_id: &str, options: &HubOptions) -> Result<PathBuf, HubError> {
    if !is_valid_hub_id(hub_id) {
        return Err(HubError::InvalidId {
            hub_id: hub_id.to_owned(),
        });
    }
    let cache_dir = match &options.cache_dir {
        Some(dir) => dir.clone(),
        None => cache_dir().ok_or_else(|| HubError::NoCacheDir {
            hub_id: hub_id.to_owned(),
        })?,
    };
    let cache = Cache::new(cache_dir.clone()).model(hub_id.to_owned());
    if let Some(tokenizer) = cache.get(HF_TOKENIZER) {
        let dir = parent(&tokenizer);
        let config_known = cache.get(HF_CONFIG).is_some() || known_absent(&dir, HF_CONFIG);
        if config_known || !options.allow_download {
            if !config_known {
                tracing::warn!(
                    hub_id,
                    dir = %dir.display(),
                    "hub: {HF_TOKENIZER} is cached without {HF_CONFIG}, and downloading is not \
                     allowed: no chat template (pass --allow-hub-download to fetch it)"
                );
            }
            tracing::info!(hub_id, dir = %dir.display(), "hub: tokenizer from the cache");
            return Ok(dir);
        }
    }
    if !options.allow_download {
        return Err(HubError::NotAllowed {
            hub_id: hub_id.to_owned(),
            looked_for: [HF_TOKENIZER, HF_CONFIG]
                .iter()
                .map(|file| snapshot_path(&cache_dir, hub_id, file))
                .collect(),
            cache_dir,
        });
    }
    download(hub_id, &cache_dir, env_string("HF_ENDPOINT"))
}

/// Downloads what the cache lacks of the tokenizer of `hub_id` from
/// `endpoint` (`None`: `https://huggingface.co`).
fn download(hub_id: &str, cache_dir: &Path, endpoint: Option<String>) -> Result<PathBuf, HubError> {
    let error = |file: &'static str, err: ApiError| match classify(err) {
        Failure::Status(status) => HubError::NotFound {
            hub_id: hub_id.to_owned(),
            file,
            cache_dir: cache_dir.to_owned(),
            status,
        },
        Failure::Transport(reason) => HubError::Offline {
            hub_id: hub_id.to_owned(),
            file,
            cache_dir: cache_dir.to_owned(),
            reason,
        },
        Failure::Other(reason) => HubError::Download {
            hub_id: hub_id.to_owned(),
            file,
            cache_dir: cache_dir.to_owned(),
            reason,
        },
    };
    let mut builder = ApiBuilder::from_cache(Cache::new(cache_dir.to_owned()))
        .with_progress(false)
        .with_user_agent("switchyard", env!("CARGO_PKG_VERSION"));
    if let Some(endpoint) = endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    if let Some(token) = env_string("HF_TOKEN") {
        builder = builder.with_token(Some(token));
    }
    let api = builder.build().map_err(|e| error(HF_TOKENIZER, e))?;
    let repo = api.model(hub_id.to_owned());
    tracing::info!(hub_id, cache_dir = %cache_dir.display(), "hub: downloading the tokenizer");
    // The config first: each download moves `refs/main` to the commit it
    // came from, and `get` looks in that commit's snapshot, so the
    // vocabulary fetched second lands beside the config.
    let config = match repo.get(HF_CONFIG) {
        Ok(path) => Some(path),
        Err(err) => match classify_ref(&err) {
            Some(404) => {
                tracing::info!(
                    hub_id,
                    "hub: the model has no {HF_CONFIG}: no chat template (text prompts only)"
                );
                None
            }
            _ => return Err(error(HF_CONFIG, err)),
        },
    };
    let tokenizer = repo.get(HF_TOKENIZER).map_err(|e| error(HF_TOKENIZER, e))?;
    let dir = parent(&tokenizer);
    match config {
        Some(config) if parent(&config) != dir => tracing::warn!(
            hub_id,
            dir = %dir.display(),
            "hub: {HF_CONFIG} came from another commit than {HF_TOKENIZER} (main moved during \
             the download); the tokenizer is served without it: start again to fetch it"
        ),
        Some(_) => {}
        None => mark_absent(&dir, HF_CONFIG),
    }
    tracing::info!(hub_id, dir = %dir.display(), "hub: tokenizer downloaded");
    Ok(dir)
}

/// The Hugging Face hub cache directory the environment names, as
/// `huggingface_hub` (Python, `huggingface-cli`) finds it:
/// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
/// (hf-hub's own `Cache::from_env` reads `HF_HOME` only, and panics
/// without a home directory; this reads the same places plus those
/// Python reads, so a cache filled by `huggingface-cli` is found.) `None`
/// when none of the variables is set.
fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|name| std::env::var_os(name))
}

/// [`cache_dir`] with the environment given.
fn cache_dir_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name| {
        var(name)
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = set("HF_HUB_CACHE") {
        return Some(dir);
    }
    if let Some(home) = set("HF_HOME") {
        return Some(home.join("hub"));
    }
    let cache = set("XDG_CACHE_HOME").or_else(|| set("HOME").map(|home| home.join(".cache")))?;
    Some(cache.join("huggingface").join("hub"))
}

/// Whether `id` is `NAME` or `ORG/NAME`, each part letters, digits, `-`,
/// `_` and `.`, not starting or ending with `-` or `.`, with no `..`
/// (the Hub's own rule; it also keeps the id from naming a path).
fn is_valid_hub_id(id: &str) -> bool {
    let part_ok = |part: &str| {
        !part.is_empty()
            && part.len() <= 96
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && !part.starts_with(['-', '.'])
            && !part.ends_with(['-', '.'])
            && !part.contains("..")
    };
    let mut parts = id.split('/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(name), None, None) => part_ok(name),
        (Some(org), Some(name), None) => part_ok(org) && part_ok(name),
        _ => false,
    }
}

/// Where `file` of `hub_id`'s `main` would be in the cache (the commit as
/// `refs/main` names it, or `<commit of main>` when there is none).
fn snapshot_path(cache_dir: &Path, hub_id: &str, file: &str) -> PathBuf {
    let repo = repo_dir(cache_dir, hub_id);
    let commit = std::fs::read_to_string(repo.join("refs").join("main"))
        .map(|commit| commit.trim().to_owned())
        .unwrap_or_else(|_| "<commit of main>".to_owned());
    repo.join("snapshots").join(commit).join(file)
}

/// `<cache>/models--ORG--NAME`.
fn repo_dir(cache_dir: &Path, hub_id: &str) -> PathBuf {
    cache_dir.join(format!("models--{}", hub_id.replace('/', "--")))
}

/// The snapshot directory a cached file is in.
fn parent(file: &Path) -> PathBuf {
    file.parent().map(Path::to_owned).unwrap_or_default()
}

/// Whether the cache records that the snapshot `dir` has no `file`
/// (`huggingface_hub`'s `.no_exist/<commit>/<file>` marker, which
/// [`mark_absent`] writes too), so it is not asked for again.
fn known_absent(snapshot: &Path, file: &str) -> bool {
    no_exist_path(snapshot, file).is_some_and(|marker| marker.exists())
}

/// Records that the snapshot `dir` has no `file` (best effort: a cache
/// that cannot take the marker asks again next time).
fn mark_absent(snapshot: &Path, file: &str) {
    if let Some(marker) = no_exist_path(snapshot, file) {
        let written = marker
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&marker, b""));
        if let Err(err) = written {
            tracing::debug!(marker = %marker.display(), %err, "hub: no .no_exist marker");
        }
    }
}

/// `<repo>/.no_exist/<commit>/<file>` for `snapshot` =
/// `<repo>/snapshots/<commit>`.
fn no_exist_path(snapshot: &Path, file: &str) -> Option<PathBuf> {
    let commit = snapshot.file_name()?;
    let repo = snapshot.parent()?.parent()?;
    Some(repo.join(".no_exist").join(commit).join(file))
}

/// A download's failure, as the error messages tell it.
enum Failure {
    /// The Hub answered with this HTTP status.
    Status(u16),
    /// No answer: connection, DNS, TLS, proxy.
    Transport(String),
    /// Anything else.
    Other(String),
}

fn classify(err: ApiError) -> Failure {
    match err {
        ApiError::RequestError(err) => match *err {
            ureq::Error::Status(status, _) => Failure::Status(status),
            ureq::Error::Transport(transport) => Failure::Transport(transport.to_string()),
        },
        ApiError::TooManyRetries(err) => classify(*err),
        other => Failure::Other(other.to_string()),
    }
}

/// The HTTP status of a failed download, if the Hub answered.
fn classify_ref(err: &ApiError) -> Option<u16> {
    match err {
        ApiError::RequestError(err) => match &**err {
            ureq::Error::Status(status, _) => Some(*status),
            ureq::Error::Transport(_) => None,
        },
        ApiError::TooManyRetries(err) => classify_ref(err),
        _ => None,
    }
}

fn env_string(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    /// A fresh empty directory under the system's temp directory.
    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("switchyard-hub-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Lays `files` of `hub_id` out in `cache` as hf-hub and
    /// `huggingface_hub` do: the content in `blobs/`, a symbolic link to
    /// it in `snapshots/<commit>/`, the commit in `refs/main`.
    fn cache_files(cache: &Path, hub_id: &str, files: &[(&str, &str)]) -> PathBuf {
        let repo = cache.join(format!("models--{}", hub_id.replace('/', "--")));
        let snapshot = repo.join("snapshots").join(COMMIT);
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::write(repo.join("refs").join("main"), COMMIT).unwrap();
        for (i, (file, content)) in files.iter().enumerate() {
            let blob = repo.join("blobs").join(format!("blob{i}"));
            std::fs::write(&blob, content).unwrap();
            link(&blob, &snapshot.join(file));
        }
        snapshot
    }

    #[cfg(unix)]
    fn link(target: &Path, at: &Path) {
        std::os::unix::fs::symlink(target, at).unwrap();
    }

    #[cfg(not(unix))]
    fn link(target: &Path, at: &Path) {
        std::fs::copy(target, at).unwrap();
    }

    fn offline(cache: &Path) -> HubOptions {
        HubOptions {
            allow_download: false,
            cache_dir: Some(cache.to_owned()),
        }
    }

    #[test]
    fn a_cached_tokenizer_is_found_without_a_download() {
        let cache = temp_dir("hit");
        let snapshot = cache_files(
            &cache,
            "Org/Model-1.5B",
            &[
                (HF_TOKENIZER, "{\"tokenizer\": 1}"),
                (HF_CONFIG, "{\"chat_template\": \"t\"}"),
            ],
        );
        let dir = tokenizer_dir_from_hub("Org/Model-1.5B", &offline(&cache)).unwrap();
        assert_eq!(dir, snapshot);
        assert_eq!(
            std::fs::read_to_string(dir.join(HF_TOKENIZER)).unwrap(),
            "{\"tokenizer\": 1}"
        );
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn a_cached_tokenizer_loads_with_from_dir() {
        let cache = temp_dir("load");
        cache_files(
            &cache,
            "Qwen/Qwen3-0.6B",
            &[(HF_TOKENIZER, &crate::Tokenizer::bundled_json())],
        );
        let dir = tokenizer_dir_from_hub("Qwen/Qwen3-0.6B", &offline(&cache)).unwrap();
        let tokenizer = crate::Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tokenizer.vocab_size(), 151_669);
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn without_download_a_missing_tokenizer_names_the_files_cache_and_fix() {
        let cache = temp_dir("miss");
        // Another model is cached; this one is not.
        cache_files(&cache, "Org/Other", &[(HF_TOKENIZER, "{}")]);
        let err = tokenizer_dir_from_hub("Org/Model", &offline(&cache)).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, HubError::NotAllowed { .. }), "{err:?}");
        for needle in [
            "Org/Model",
            HF_TOKENIZER,
            HF_CONFIG,
            "--allow-hub-download",
            "tokenizer_dir",
            &cache.display().to_string(),
            &cache
                .join("models--Org--Model")
                .join("snapshots")
                .display()
                .to_string(),
        ] {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn a_cached_tokenizer_without_its_config_is_served_when_download_is_not_allowed() {
        let cache = temp_dir("no-config");
        let snapshot = cache_files(&cache, "bert-base-uncased", &[(HF_TOKENIZER, "{}")]);
        let dir = tokenizer_dir_from_hub("bert-base-uncased", &offline(&cache)).unwrap();
        assert_eq!(dir, snapshot);
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn a_config_known_absent_is_not_downloaded_again() {
        let cache = temp_dir("no-exist");
        let snapshot = cache_files(&cache, "Org/Embedder", &[(HF_TOKENIZER, "{}")]);
        mark_absent(&snapshot, HF_CONFIG);
        assert!(known_absent(&snapshot, HF_CONFIG));
        // Allowed to download, yet no connection is needed: the cache
        // says the model has no config.
        let options = HubOptions {
            allow_download: true,
            cache_dir: Some(cache.clone()),
        };
        assert_eq!(
            tokenizer_dir_from_hub("Org/Embedder", &options).unwrap(),
            snapshot
        );
        std::fs::remove_dir_all(cache).unwrap();
    }

    /// An endpoint that answers every request with HTTP `status`, on a
    /// thread that serves until the test process ends.
    fn answering(status: &'static str) -> String {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut head = [0u8; 4096];
                let _ = stream.read(&mut head);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn a_model_the_hub_does_not_have_is_not_found_naming_the_file() {
        let cache = temp_dir("404");
        let err = download("Org/Missing", &cache, Some(answering("404 Not Found"))).unwrap_err();
        // The config's 404 means "no chat template"; the vocabulary's is
        // the error.
        assert!(
            matches!(err, HubError::NotFound { status: 404, file, .. } if file == HF_TOKENIZER),
            "{err:?}"
        );
        let message = err.to_string();
        for needle in ["Org/Missing", HF_TOKENIZER, "HF_TOKEN", "tokenizer_dir"] {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn a_gated_model_stops_at_its_config() {
        let cache = temp_dir("401");
        let err = download("Org/Gated", &cache, Some(answering("401 Unauthorized"))).unwrap_err();
        assert!(
            matches!(err, HubError::NotFound { status: 401, file, .. } if file == HF_CONFIG),
            "{err:?}"
        );
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn an_unreachable_hub_is_offline_naming_the_cache_and_the_fix() {
        let cache = temp_dir("offline");
        // A port nothing listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let err = download("Org/Model", &cache, Some(endpoint)).unwrap_err();
        assert!(matches!(err, HubError::Offline { .. }), "{err:?}");
        let message = err.to_string();
        for needle in [
            "Org/Model",
            HF_TOKENIZER,
            "offline",
            "tokenizer_dir",
            &cache.display().to_string(),
        ] {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        std::fs::remove_dir_all(cache).unwrap();
    }

    #[test]
    fn ids_that_are_not_org_slash_name_are_refused_before_any_lookup() {
        for id in ["Org/Model", "gpt2", "Qwen/Qwen3-0.6B", "a_b/c.d"] {
            assert!(is_valid_hub_id(id), "{id}");
        }
        for id in [
            "",
            "/",
            "Org/",
            "/Model",
            "a/b/c",
            "../x",
            "Org/..",
            "Org/a..b",
            "Org/Model ",
            "-x/y",
            "Org/Model.",
        ] {
            assert!(!is_valid_hub_id(id), "{id:?}");
            let err = tokenizer_dir_from_hub(id, &HubOptions::default()).unwrap_err();
            assert!(matches!(err, HubError::InvalidId { .. }), "{id:?}: {err}");
        }
    }

    #[test]
    fn the_cache_directory_follows_huggingface_hubs_variables() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let all = &[
            ("HF_HUB_CACHE", "/hub-cache"),
            ("HF_HOME", "/hf-home"),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/home/u"),
        ];
        assert_eq!(cache_dir_from(env(all)), Some("/hub-cache".into()));
        assert_eq!(cache_dir_from(env(&all[1..])), Some("/hf-home/hub".into()));
        assert_eq!(
            cache_dir_from(env(&all[2..])),
            Some("/xdg/huggingface/hub".into())
        );
        assert_eq!(
            cache_dir_from(env(&all[3..])),
            Some("/home/u/.cache/huggingface/hub".into())
        );
        assert_eq!(cache_dir_from(env(&[("HF_HOME", "")])), None);
    }
}
