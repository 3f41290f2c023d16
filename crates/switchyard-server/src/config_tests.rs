use super::*;

#[test]
fn a_worker_flag_with_every_option_parses() {
    let w = WorkerSpec::parse(
            "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,block-size=16,name=w1",
        )
        .unwrap();
    assert_eq!(w.url, "http://127.0.0.1:8001");
    assert_eq!(w.events.as_deref(), Some("tcp://127.0.0.1:5557"));
    assert_eq!(w.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
    assert_eq!(w.block_size, Some(16));
    assert_eq!(w.display_name(), "w1");
}

#[test]
fn input_limits_have_defaults_and_must_be_positive() {
    let c = ServerConfig::default();
    assert_eq!(
        (c.max_prompt_tokens, c.max_messages, c.max_content_parts),
        (None, 4096, 16_384)
    );
    assert_eq!((c.max_n, c.max_output_tokens), (16, None));
    let c = ServerConfig::from_toml(
            "max_prompt_tokens = 8192\nmax_messages = 10\nmax_content_parts = 20\nmax_n = 2\nmax_output_tokens = 100",
        )
        .unwrap();
    assert_eq!(c.max_prompt_tokens, Some(8192));
    assert_eq!(c.max_output_tokens, Some(100));
    for zero in [
        "max_prompt_tokens = 0",
        "max_messages = 0",
        "max_content_parts = 0",
        "max_n = 0",
        "max_output_tokens = 0",
    ] {
        let error = ServerConfig::from_toml(zero).unwrap_err().to_string();
        assert!(error.contains("must be positive"), "{zero}: {error}");
    }
}

#[test]
fn a_worker_without_a_name_is_named_by_host_and_port() {
    let w = WorkerSpec::parse("http://127.0.0.1:8001").unwrap();
    assert_eq!(w.display_name(), "127.0.0.1:8001");
}

#[test]
fn unknown_worker_options_and_bad_urls_are_refused() {
    assert!(WorkerSpec::parse("http://h:1,colour=red").is_err());
    let w = WorkerSpec::parse("http://h:1,role=prefill,bootstrap-port=8998").unwrap();
    assert_eq!((w.role, w.bootstrap_port), (Role::Prefill, Some(8998)));
    assert_eq!(WorkerSpec::parse("http://h:1").unwrap().role, Role::Both);
    assert!(WorkerSpec::parse("http://h:1,role=primary").is_err());
    assert!(WorkerSpec::parse("http://h:1,bootstrap-port=0").is_err());
    assert!(WorkerSpec::parse("http://h:1,bootstrap-port=70000").is_err());
    let toml = "disagg = \"sglang\"\n[[workers]]\nurl = \"http://h:1\"\nrole = \"decode\"\n[[workers]]\nurl = \"http://h:2\"\nrole = \"prefill\"\nbootstrap-port = 9000\n";
    let c: ServerConfig = toml::from_str(toml).unwrap();
    c.validate().unwrap();
    assert_eq!(c.disagg, Some(DisaggMode::Sglang));
    assert_eq!(c.workers[0].role, Role::Decode);
    assert_eq!(c.workers[1].bootstrap_port, Some(9000));
    let without = ServerConfig { disagg: None, ..c };
    assert!(without.validate().is_err(), "roles need --disagg");
    let file = WorkersFile::parse(
        "[[workers]]\nurl = \"http://h:1\"\nrole = \"decode\"\n",
        &[16],
        CacheMode::Auto,
    )
    .unwrap();
    assert_eq!(file.workers[0].role, Role::Decode);
    // https:// workers are reached over TLS ([`crate::front::tls`]); any other
    // scheme is refused.
    assert_eq!(WorkerSpec::parse("https://h:1").unwrap().authority(), "h:1");
    assert!(WorkerSpec::parse("ftp://h:1").is_err());
    assert!(WorkerSpec::parse("h:1").is_err());
    assert!(WorkerSpec::parse("http://h:1/v1").is_err());
    assert!(WorkerSpec::parse("http://h:1,replay=tcp://h:2").is_err());
}

#[test]
fn a_toml_file_fills_the_same_struct_and_refuses_unknown_keys() {
    let config = ServerConfig::from_toml(
        r#"
            port = 9000
            policy = "round-robin"
            [[workers]]
            url = "http://127.0.0.1:8001"
            events = "tcp://127.0.0.1:5557"
            "#,
    )
    .unwrap();
    assert_eq!(config.port, 9000);
    assert_eq!(config.policy, PolicyKind::RoundRobin);
    assert!(config.uses_events());
    assert!(ServerConfig::from_toml("colour = 1").is_err());
}

#[test]
fn serve_runs_the_cores_default_policy_when_none_is_named() {
    assert_eq!(ServerConfig::default().policy, PolicyKind::DEFAULT);
    assert_eq!(
        ServerConfig::from_toml("").unwrap().policy,
        PolicyKind::DEFAULT
    );
}

#[test]
fn the_ttft_policy_and_its_settings_come_from_the_policies_table() {
    let config = ServerConfig::from_toml(
        r#"
            policy = "ttft"
            [policies.ttft]
            locality_weight = 0.5
            pressure_weight = 4.0
            "#,
    )
    .unwrap();
    assert_eq!(config.policy, PolicyKind::Ttft);
    assert_eq!(config.policies.ttft.locality_weight, 0.5);
    assert_eq!(config.policies.ttft.pressure_weight, 4.0);
    let err = ServerConfig::from_toml("[policies.ttft]\nlocality_weight = -1.0").unwrap_err();
    assert!(err.to_string().contains("locality_weight"), "{err}");
}

#[test]
fn the_host_tier_restore_cost_comes_from_the_estimator_table_and_is_validated() {
    assert_eq!(
        ServerConfig::default().estimator.restore_ms_per_token,
        switchyard_core::estimate::default_restore_ms_per_token()
    );
    let config = ServerConfig::from_toml("[estimator]\nrestore_ms_per_token = 0.01").unwrap();
    assert_eq!(config.estimator.restore_ms_per_token, 0.01);
    let err = ServerConfig::from_toml("[estimator]\nrestore_ms_per_token = -1.0").unwrap_err();
    assert!(err.to_string().contains("restore_ms_per_token"), "{err}");
}

#[test]
fn timeouts_must_be_positive_and_finite() {
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let config = ServerConfig {
            request_timeout_secs: bad,
            ..ServerConfig::default()
        };
        assert!(config.validate().is_err(), "{bad}");
        let config = ServerConfig {
            first_token_timeout_secs: bad,
            ..ServerConfig::default()
        };
        assert!(config.validate().is_err(), "{bad}");
    }
    assert!(ServerConfig::from_toml("migration_limit = 0\nrequest_timeout_secs = 2.5").is_ok());
}

#[test]
fn a_request_goes_to_two_workers_by_default_and_at_least_one() {
    assert_eq!(ServerConfig::default().max_attempt_workers, 2);
    let config = ServerConfig::from_toml("max_attempt_workers = 3").unwrap();
    assert_eq!(config.max_attempt_workers, 3);
    let err = ServerConfig::from_toml("max_attempt_workers = 0").unwrap_err();
    assert!(err.to_string().contains("max_attempt_workers"), "{err}");
}

#[test]
fn a_worker_block_size_that_differs_from_the_routers_is_refused() {
    let config = ServerConfig {
        workers: vec![WorkerSpec::parse("http://h:1,block-size=64").unwrap()],
        ..ServerConfig::default()
    };
    assert!(config.validate().is_err());
}

#[test]
fn overload_and_circuit_settings_are_validated() {
    let zero_inflight = ServerConfig {
        max_inflight: 0,
        ..ServerConfig::default()
    };
    assert!(zero_inflight.validate().is_err());
    let config = ServerConfig::from_toml(
            "max_inflight = 64\nshutdown_grace_ms = 500\n[circuit]\nfailure_threshold = 5\ncooldown_ms = 100\nmax_cooldown_ms = 1000\n",
        )
        .unwrap();
    assert_eq!(config.max_inflight, 64);
    assert_eq!(config.circuit.failure_threshold, 5);
    assert!(ServerConfig::from_toml("[circuit]\nfailure_threshold = 0\n").is_err());
    assert!(ServerConfig::from_toml("[circuit]\ncooldown_ms = 10\nmax_cooldown_ms = 1\n").is_err());
}

#[test]
fn a_worker_without_events_makes_auto_mode_approximate() {
    let config = ServerConfig {
        workers: vec![
            WorkerSpec::parse("http://h:1,events=tcp://h:2").unwrap(),
            WorkerSpec::parse("http://h:3").unwrap(),
        ],
        ..ServerConfig::default()
    };
    assert!(!config.uses_events());
}

#[test]
fn replica_sync_is_off_by_default_and_a_replica_table_turns_it_on() {
    assert!(!ServerConfig::default().replica.enabled());
    let config = ServerConfig::from_toml(
        r#"
            [replica]
            nats_url = "nats://10.0.0.9:4222"
            endpoint = "chat"
            silence_expiry_ms = 2000.0
            "#,
    )
    .unwrap();
    assert!(config.replica.enabled());
    assert_eq!(
        config.replica.subject(),
        "switchyard.default.chat.active_sequences"
    );
}

#[test]
fn bad_replica_settings_are_refused_with_a_clear_error() {
    let err = ServerConfig::from_toml("[replica]\nnats_url = \"http://h:4222\"")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--replica-sync must be nats://HOST:PORT"),
        "{err}"
    );
    let err = ServerConfig::from_toml("[replica]\nendpoint = \"a.b\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("endpoint"), "{err}");
    assert!(ServerConfig::from_toml("[replica]\nnats = 1").is_err());
}

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_config_error_names_the_line_but_never_echoes_a_secret() {
    for (text, line, secret) in [
        (
            "port = 1\nadmin_token = \"adm-secret-1\n",
            2,
            "adm-secret-1",
        ),
        ("admin_token = adm-secret-2\n", 1, "adm-secret-2"),
        ("\n\napi_keys = \"sk-secret-3\"\n", 3, "sk-secret-3"),
        ("api_keys = [\"sk-secret-4\", 5]\n", 1, "sk-secret-4"),
        (
            "[[rate_limits.keys]]\nname = \"a\"\nkey = [\"nk-secret-5\"]\n",
            3,
            "nk-secret-5",
        ),
        ("worker_api_key = \"wk-secret-6\" \"x\"\n", 1, "wk-secret-6"),
    ] {
        let error = ServerConfig::from_toml(text).unwrap_err().to_string();
        assert!(!error.contains(secret), "{text:?}: {error}");
        assert!(!error.contains('\n'), "one line: {error}");
        assert!(error.contains(&format!("line {line}")), "{text:?}: {error}");
    }
    // The fault itself is kept, only quoted values go.
    let error = ServerConfig::from_toml("api_keys = \"sk-secret-7\"\n")
        .unwrap_err()
        .to_string();
    assert!(error.contains("invalid type: string \"…\""), "{error}");
    let error = ServerConfig::from_toml("colour = 1\n")
        .unwrap_err()
        .to_string();
    assert!(error.contains("unknown field `colour`"), "{error}");
    assert_eq!(without_quoted_values(r#"a "b\"c" d "e"#), r#"a "…" d "…"#);
    assert_eq!(
        without_quoted_values(r#"expected `"`, got "x""#),
        r#"expected `"`, got "…""#
    );
}

#[test]
fn a_key_file_adds_one_key_a_line_skipping_blanks_and_comments() {
    let path = write("keys", "# team a\n  sk-a  \n\n#sk-commented\nsk-b\n");
    let mut config = ServerConfig {
        api_keys: vec!["sk-inline".into()],
        api_key_file: Some(path),
        ..ServerConfig::default()
    };
    config.load_secret_files().unwrap();
    let keys: Vec<&str> = config.api_keys.iter().map(Secret::expose).collect();
    assert_eq!(keys, ["sk-inline", "sk-a", "sk-b"]);
    assert_eq!(config.api_key_file, None, "read once");
    config.load_secret_files().unwrap();
    assert_eq!(config.api_keys.len(), 3, "loading again adds nothing");
}

#[test]
fn a_named_rate_limited_key_is_read_from_its_file_and_requires_client_keys() {
    let mut config = ServerConfig::from_toml(&format!(
        "[[rate_limits.keys]]\nname = \"batch\"\nkey_file = {:?}\nrequests_per_second = 2\n",
        write("batch", "# batch jobs\nsk-batch\n"),
    ))
    .unwrap();
    assert!(config.requires_client_key());
    config.load_secret_files().unwrap();
    let key = &config.rate_limits.keys[0];
    assert_eq!(key.key.as_deref(), Some("sk-batch"));
    assert_eq!(key.key_file, None, "read once");
    let mut two = ServerConfig::from_toml(&format!(
        "[[rate_limits.keys]]\nname = \"b\"\nkey_file = {:?}\n",
        write("two", "sk-1\nsk-2\n"),
    ))
    .unwrap();
    assert!(
        two.load_secret_files().is_err(),
        "a named key's file holds one secret"
    );
}

#[test]
fn single_secret_files_fill_their_settings() {
    let mut config = ServerConfig::from_toml(&format!(
        "admin_token_file = {:?}\nworker_api_key_file = {:?}\nmetrics_key_file = {:?}\n",
        write("admin", "# admin\nadm-1\n"),
        write("worker", "wk-1"),
        write("metrics", "mk-1\n"),
    ))
    .unwrap();
    config.load_secret_files().unwrap();
    assert_eq!(config.admin_token, Some("adm-1".into()));
    assert_eq!(config.worker_api_key, Some("wk-1".into()));
    assert_eq!(config.metrics_key, Some("mk-1".into()));
}

#[test]
fn unreadable_empty_or_ambiguous_secret_files_are_clear_errors() {
    let missing = std::env::temp_dir().join("switchyard-no-such-key-file");
    let mut config = ServerConfig {
        api_key_file: Some(missing.clone()),
        ..ServerConfig::default()
    };
    let err = config.load_secret_files().unwrap_err().to_string();
    assert!(err.contains("switchyard-no-such-key-file"), "{err}");

    let mut config = ServerConfig {
        api_key_file: Some(write("empty", "\n# nothing here\n  \n")),
        ..ServerConfig::default()
    };
    let err = config.load_secret_files().unwrap_err().to_string();
    assert!(err.contains("holds no secret"), "{err}");

    let mut config = ServerConfig {
        admin_token_file: Some(write("two-tokens", "a\nb\n")),
        ..ServerConfig::default()
    };
    let err = config.load_secret_files().unwrap_err().to_string();
    assert!(err.contains("expected one"), "{err}");

    let mut config = ServerConfig {
        api_key_file: Some(write("spaced", "sk a\n")),
        ..ServerConfig::default()
    };
    let err = config.load_secret_files().unwrap_err().to_string();
    assert!(err.contains("secret 1"), "{err}");
    assert!(
        !err.contains("sk a"),
        "the error never quotes a secret: {err}"
    );

    let both = ServerConfig {
        admin_token: Some("t".into()),
        admin_token_file: Some(write("admin2", "t2")),
        ..ServerConfig::default()
    };
    assert!(both
        .validate()
        .unwrap_err()
        .to_string()
        .contains("both set"));
}

#[test]
fn front_door_limits_must_be_positive() {
    for bad in [
        "max_connections = 0",
        "header_read_timeout_ms = 0",
        "body_read_timeout_ms = 0",
        "send_timeout_ms = 0",
        "api_keys = [\"\"]",
        "admin_token = \"has space\"",
    ] {
        assert!(ServerConfig::from_toml(bad).is_err(), "{bad}");
    }
    let config = ServerConfig::from_toml("request_timeout_secs = 2.5").unwrap();
    assert_eq!(
        config.send_timeout(),
        std::time::Duration::from_millis(2_500),
        "the request timeout caps the send timeout"
    );
    let config =
        ServerConfig::from_toml("max_connections = 5\nbody_read_timeout_ms = 100\n").unwrap();
    assert_eq!(config.max_connections, 5);
    assert_eq!(config.body_read_timeout_ms, 100);
}

#[test]
fn the_body_budget_is_four_bodies_unless_set_and_never_below_one_body() {
    let config = ServerConfig::default();
    assert_eq!(config.body_bytes_total(), 4 * 32 * 1024 * 1024);
    let scaled = ServerConfig::from_toml("max_body_bytes = 1000").unwrap();
    assert_eq!(scaled.body_bytes_total(), 4000, "it follows the size limit");
    let set =
        ServerConfig::from_toml("max_body_bytes = 1000\nmax_body_bytes_total = 1000").unwrap();
    assert_eq!(set.body_bytes_total(), 1000, "one body at a time");
    let err = ServerConfig::from_toml("max_body_bytes = 1000\nmax_body_bytes_total = 999")
        .unwrap_err()
        .to_string();
    assert!(err.contains("max_body_bytes_total"), "{err}");
    assert!(err.contains("at least max_body_bytes"), "{err}");
}

#[test]
fn discovery_settings_load_from_the_config_file_and_are_checked() {
    let config = ServerConfig::from_toml(
            "[discovery]\nworkers_file = \"/etc/switchyard/workers.toml\"\nworkers_dns = [\"workers.ns.svc.cluster.local:8000\"]\ndns_servers = [\"127.0.0.1:5353\"]\nworkers_dns_interval_ms = 2000\n",
        )
        .unwrap();
    assert!(config.discovery.enabled());
    assert_eq!(config.discovery.workers_file_interval_ms, 1000, "default");
    assert_eq!(config.discovery.workers_dns_interval_ms, 2000);
    assert!(!ServerConfig::default().discovery.enabled());
    for (bad, why) in [
        ("[discovery]\nworkers_dns = [\"workers\"]", "NAME:PORT"),
        ("[discovery]\nworkers_dns = [\"workers:0\"]", "port"),
        ("[discovery]\nworkers_dns = [\"a b:80\"]", "DNS name"),
        ("[discovery]\nworkers_dns = [\"a:80\", \"a:80\"]", "twice"),
        ("[discovery]\nworkers_file_interval_ms = 0", "at least 10"),
        (
            "[discovery]\nmax_workers_per_source = 0",
            "max_workers_per_source",
        ),
        ("[discovery]\nwatch = true", "unknown field"),
        (
            "cache = \"events\"\n[discovery]\nworkers_dns = [\"a:80\"]",
            "no KV-event endpoints",
        ),
    ] {
        let error = ServerConfig::from_toml(bad).unwrap_err().to_string();
        assert!(error.contains(why), "{bad:?}: {error}");
    }
}

#[test]
fn dns_targets_split_at_the_last_colon() {
    assert_eq!(
        parse_dns_target("workers.default.svc:8000"),
        Ok(("workers.default.svc".to_owned(), 8000))
    );
    assert!(parse_dns_target(":8000").is_err());
    assert!(parse_dns_target("workers:http").is_err());
}

#[test]
fn a_workers_file_is_worker_tables_and_nothing_else() {
    let file = WorkersFile::parse(
        "[[workers]]\nurl = \"http://10.0.0.1:8000\"\nevents = \"tcp://10.0.0.1:5557\"\n",
        &[16],
        CacheMode::Events,
    )
    .unwrap();
    assert_eq!(file.workers.len(), 1);
    assert_eq!(
        WorkersFile::parse("", &[16], CacheMode::Auto)
            .unwrap()
            .workers,
        []
    );
    let error = WorkersFile::parse(
        "[[workers]]\nurl = \"http://a:1\"\n",
        &[16],
        CacheMode::Events,
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("events="), "{error}");
    assert!(WorkersFile::parse("port = 1", &[16], CacheMode::Auto).is_err());
    let error = WorkersFile::parse("\n\nnot toml [", &[16], CacheMode::Auto)
        .unwrap_err()
        .to_string();
    assert!(error.contains("line 3: "), "{error}");
    assert!(
        !error.contains("not toml") && !error.contains('\n'),
        "{error}"
    );
}

#[test]
fn a_worker_declares_its_data_parallel_ranks_on_the_command_line_or_in_the_file() {
    let w = WorkerSpec::parse("http://h:1,dp-size=8,events=tcp://h:5557").unwrap();
    assert_eq!((w.dp_size, w.ranks()), (Some(8), 8));
    assert_eq!(WorkerSpec::parse("http://h:1").unwrap().ranks(), 1);
    let c: ServerConfig =
        toml::from_str("[[workers]]\nurl = \"http://h:1\"\ndp-size = 4\n").unwrap();
    c.validate().unwrap();
    assert_eq!(c.workers[0].dp_size, Some(4));
    // Sizes out of range, and endpoints that cannot give a port per rank.
    for bad in [
        "http://h:1,dp-size=0",
        "http://h:1,dp-size=257",
        "http://h:1,dp-size=two",
        "http://h:1,dp-size=2,events=ipc:///tmp/kv",
        "http://h:1,dp-size=4,events=tcp://h:65534",
    ] {
        let err = WorkerSpec::parse(bad).unwrap_err().to_string();
        assert!(err.contains("dp-size"), "{bad}: {err}");
    }
    // Rank r's events are on the port plus r, as vLLM publishes them.
    assert_eq!(
        crate::config::rank_endpoint("tcp://10.0.0.5:5557", 3).as_deref(),
        Some("tcp://10.0.0.5:5560")
    );
    assert_eq!(crate::config::rank_endpoint("tcp://h:65535", 1), None);
}

#[test]
fn tokenize_slots_are_one_to_the_blocking_pools_size_or_one_per_core_when_unset() {
    assert_eq!(ServerConfig::default().tokenize_slots, None);
    for (slots, ok) in [
        (0, false),
        (1, true),
        (MAX_TOKENIZE_SLOTS, true),
        (MAX_TOKENIZE_SLOTS + 1, false),
    ] {
        let config = ServerConfig {
            tokenize_slots: Some(slots),
            ..ServerConfig::default()
        };
        assert_eq!(config.validate().is_ok(), ok, "{slots}");
    }
    let config = ServerConfig::from_toml("tokenize_slots = 3\n").unwrap();
    assert_eq!(config.tokenize_slots, Some(3));
}
