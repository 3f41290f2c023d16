//! The command line as an installed binary meets its user: `--version`,
//! shell completions, and `--help` that never prints a secret.

use crate::support::machine_blocking;
use std::process::Command;

fn switchyard(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("the switchyard binary starts");
    assert!(
        out.status.success(),
        "switchyard {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `git` in the source tree, when there is one.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[test]
fn version_names_the_release_and_the_commit_it_was_built_from() {
    let _machine = machine_blocking();
    let line = switchyard(&["--version"]);
    let rest = line
        .strip_prefix("switchyard ")
        .and_then(|r| r.strip_suffix(")\n"))
        .unwrap_or_else(|| panic!("{line:?} is not `switchyard VERSION (COMMIT)`"));
    let (version, commit) = rest.split_once(" (").expect("VERSION (COMMIT)");
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    if commit == "unknown" {
        assert!(
            git(&["rev-parse", "HEAD"]).is_none(),
            "built in a git checkout, yet the commit is unknown"
        );
        return;
    }
    let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
    assert!(
        hash.len() >= 7 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
        "{commit:?} is not a short hash, HASH-dirty or unknown"
    );
    if std::env::var_os("SWITCHYARD_BUILD_COMMIT").is_none() {
        if let Some(head) = git(&["rev-parse", "HEAD"]) {
            assert!(
                head.starts_with(hash),
                "--version names {hash}, the checkout is at {head}"
            );
        }
    }
}

#[test]
fn completions_cover_every_shell_and_bash_names_the_subcommands() {
    let _machine = machine_blocking();
    let bash = switchyard(&["completions", "bash"]);
    assert!(bash.contains("complete -F"), "not a bash completion script");
    for subcommand in ["serve", "sim-worker", "replay", "demo", "completions"] {
        assert!(
            bash.contains(subcommand),
            "the bash completions do not mention {subcommand}"
        );
    }
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        assert!(
            switchyard(&["completions", shell]).contains("sim-worker"),
            "{shell}"
        );
    }
}

/// `switchyard ARGS` with `vars` set: its standard output.
fn switchyard_with_env(args: &[&str], vars: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .envs(vars.iter().copied())
        .output()
        .expect("the switchyard binary starts");
    assert!(
        out.status.success(),
        "switchyard {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

#[test]
fn help_names_the_secret_variables_but_never_their_values() {
    let _machine = machine_blocking();
    let secrets = [
        ("SWITCHYARD_ADMIN_TOKEN", "adm-secret-0451"),
        ("SWITCHYARD_API_KEYS", "sk-secret-0452,sk-secret-0453"),
        ("SWITCHYARD_METRICS_KEY", "mk-secret-0454"),
        ("SWITCHYARD_WORKER_API_KEY", "wk-secret-0455"),
        ("SWITCHYARD_NATS_PASSWORD", "pw-secret-0456"),
        ("SWITCHYARD_NATS_TOKEN", "tok-secret-0457"),
        (
            "SWITCHYARD_REPLICA_SYNC",
            "nats://u:pw-secret-0458@nats:4222",
        ),
    ];
    let serve = switchyard_with_env(&["serve", "--help"], &secrets);
    let sim_worker = switchyard_with_env(&["sim-worker", "--help"], &secrets);
    for (name, value) in secrets {
        assert!(serve.contains(name), "serve --help names {name}");
        for part in value.split([',', ':', '@']) {
            if part.contains("secret") {
                assert!(!serve.contains(part), "serve --help shows {name}'s value");
                assert!(
                    !sim_worker.contains(part),
                    "sim-worker --help shows {name}'s value"
                );
            }
        }
    }
    // A variable that holds no secret still shows its value.
    let port = switchyard_with_env(&["serve", "--help"], &[("SWITCHYARD_PORT", "18080")]);
    assert!(port.contains("SWITCHYARD_PORT=18080"), "{port}");
}
