//! [`NatsAuthArgs`]: the command-line flags (and `SWITCHYARD_NATS_*`
//! variables) of [`NatsAuth`], one declaration for every binary that
//! connects to the replica plane (`switchyard serve` and `switchyard
//! sim-worker` flatten it into their own flags).

use crate::config::{NatsAuth, Secret};
use clap::Args;
use std::path::PathBuf;

/// NATS authentication and TLS flags; each also reads its `SWITCHYARD_*`
/// variable, and each set one overrides the [`NatsAuth`] it is applied to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct NatsAuthArgs {
    /// NATS user name (with --nats-password-file or SWITCHYARD_NATS_PASSWORD).
    #[arg(long, env = "SWITCHYARD_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password (prefer --nats-password-file: a flag shows in `ps`).
    #[arg(long, env = "SWITCHYARD_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<Secret>,
    /// File holding the NATS password (trailing newline ignored).
    #[arg(long, env = "SWITCHYARD_NATS_PASSWORD_FILE", value_name = "PATH")]
    pub nats_password_file: Option<PathBuf>,
    /// NATS token (prefer --nats-token-file: a flag shows in `ps`).
    #[arg(long, env = "SWITCHYARD_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<Secret>,
    /// File holding the NATS token (trailing newline ignored).
    #[arg(long, env = "SWITCHYARD_NATS_TOKEN_FILE", value_name = "PATH")]
    pub nats_token_file: Option<PathBuf>,
    /// NATS credentials file (.creds: user JWT and NKey seed).
    #[arg(long, env = "SWITCHYARD_NATS_CREDS", value_name = "PATH")]
    pub nats_creds: Option<PathBuf>,
    /// PEM CA file to verify the NATS server's TLS certificate.
    #[arg(long, env = "SWITCHYARD_NATS_TLS_CA", value_name = "PATH")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate for NATS TLS (with --nats-tls-key).
    #[arg(long, env = "SWITCHYARD_NATS_TLS_CERT", value_name = "PATH")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert.
    #[arg(long, env = "SWITCHYARD_NATS_TLS_KEY", value_name = "PATH")]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse a NATS server without TLS (implied by a tls:// URL).
    #[arg(long, env = "SWITCHYARD_NATS_REQUIRE_TLS")]
    pub nats_require_tls: bool,
}

impl NatsAuthArgs {
    /// Overrides the settings given on the command line or in the
    /// environment (validation is the whole config's).
    pub fn apply(&self, auth: &mut NatsAuth) {
        if let Some(v) = &self.nats_user {
            auth.user = Some(v.clone());
        }
        // A secret given here replaces the file's secret of either form,
        // so a flag never collides with the config file's other form.
        if let Some(v) = &self.nats_password {
            auth.password = Some(v.clone());
            auth.password_file = None;
        }
        if let Some(v) = &self.nats_password_file {
            auth.password_file = Some(v.clone());
            auth.password = None;
        }
        if let Some(v) = &self.nats_token {
            auth.token = Some(v.clone());
            auth.token_file = None;
        }
        if let Some(v) = &self.nats_token_file {
            auth.token_file = Some(v.clone());
            auth.token = None;
        }
        if let Some(v) = &self.nats_creds {
            auth.creds_file = Some(v.clone());
        }
        if let Some(v) = &self.nats_tls_ca {
            auth.tls_ca_file = Some(v.clone());
        }
        if let Some(v) = &self.nats_tls_cert {
            auth.tls_cert_file = Some(v.clone());
        }
        if let Some(v) = &self.nats_tls_key {
            auth.tls_key_file = Some(v.clone());
        }
        if self.nats_require_tls {
            auth.require_tls = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::path::Path;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        nats: NatsAuthArgs,
    }

    #[test]
    fn no_flags_change_nothing() {
        let mut auth = NatsAuth {
            user: Some("file-user".into()),
            password: Some(Secret("from-file".into())),
            ..NatsAuth::default()
        };
        let before = auth.clone();
        NatsAuthArgs::default().apply(&mut auth);
        assert_eq!(auth, before);
    }

    #[test]
    fn a_secret_flag_replaces_the_other_form_and_the_rest_fill_their_field() {
        let cli = Cli::try_parse_from([
            "x",
            "--nats-token",
            "t",
            "--nats-tls-ca",
            "/ca.pem",
            "--nats-tls-cert",
            "/c.pem",
            "--nats-tls-key",
            "/k.pem",
            "--nats-require-tls",
        ])
        .unwrap();
        let mut auth = NatsAuth {
            token_file: Some("/from/file".into()),
            ..NatsAuth::default()
        };
        cli.nats.apply(&mut auth);
        assert_eq!(auth.token, Some(Secret("t".into())));
        assert_eq!(auth.token_file, None);
        assert_eq!(auth.tls_ca_file.as_deref(), Some(Path::new("/ca.pem")));
        assert_eq!(auth.tls_cert_file.as_deref(), Some(Path::new("/c.pem")));
        assert_eq!(auth.tls_key_file.as_deref(), Some(Path::new("/k.pem")));
        assert!(auth.require_tls);
        assert_eq!(auth.validate(), Ok(()));
    }

    #[test]
    fn debug_never_shows_a_secret_flag() {
        let cli = Cli::try_parse_from([
            "x",
            "--nats-password",
            "pw-secret-1",
            "--nats-token",
            "tok-secret-2",
        ])
        .unwrap();
        let shown = format!("{:?}", cli.nats);
        assert!(!shown.contains("pw-secret-1"), "{shown}");
        assert!(!shown.contains("tok-secret-2"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }
}
