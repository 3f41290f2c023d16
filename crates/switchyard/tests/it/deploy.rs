//! The Grafana dashboard and the Prometheus alert rules in `deploy/`: every
//! PromQL expression in them selects only metrics the router exports, with
//! labels and label values it exports them with; the dashboard has the
//! panels an operator needs on day one, each with a unit, and every alert a
//! duration, a severity and a summary.
//!
//! What "exported" means is read, not listed: the `/metrics` of a real
//! `serve` process (KV events on, session-aware admission, after a few
//! requests, so that every family has samples), the replica plane's
//! families registered as `serve --replica-sync` registers them (no NATS
//! server needed), and a sim-worker's `/metrics` for the engine-side hit
//! rate. The few names that are not Switchyard's are listed in
//! [`FOREIGN`] with who exports them.

use crate::support::{
    machine, metric, metric_sum, metrics_text, router, sim_worker_with, wait_metrics,
};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use switchyard_wire::prometheus::Scrape;

/// Metrics the files name that no Switchyard process exports, and who does.
const FOREIGN: [(&str, &str); 3] = [
    ("up", "Prometheus, for every scrape target"),
    (
        "vllm:prefix_cache_hits_total",
        "vLLM engines (prompt tokens found in the prefix cache)",
    ),
    (
        "vllm:prefix_cache_queries_total",
        "vLLM engines (prompt tokens looked up)",
    ),
];

/// Labels Prometheus attaches to every series it scrapes.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// Panel titles the dashboard keeps: what an operator looks at first.
const DAY_ONE_PANELS: [&str; 11] = [
    "Request rate by status",
    "Error ratio by status",
    "Time to first token (TTFT)",
    "Routing decision latency",
    "Engine prefix-cache hit rate",
    "Tokenizer segment cache hit ratio",
    "Queue depth",
    "Active requests per worker",
    "Circuit state",
    "KV events dropped and stale",
    "Replica drops",
];

fn deploy_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

fn dashboard() -> Value {
    serde_json::from_str(&deploy_file("grafana/switchyard.json")).expect("the dashboard is JSON")
}

fn alerts() -> Vec<AlertRule> {
    alert_rules(&deploy_file("prometheus/alerts.yml"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_name_is_one_the_router_exports() {
    let _machine = machine().await;
    let flags = [
        "--speedup",
        "20",
        "--num-blocks",
        "1024",
        "--kv-events",
        "tcp://127.0.0.1:*",
        "--kv-replay",
        "tcp://127.0.0.1:*",
    ];
    let workers = [sim_worker_with(0, &flags), sim_worker_with(0, &flags)];
    let specs: Vec<String> = workers
        .iter()
        .zip(["w0", "w1"])
        .map(|(worker, name)| {
            let (events, replay) = worker
                .kv
                .clone()
                .expect("the worker prints its KV endpoints");
            format!("{},events={events},replay={replay}", worker.named(name))
        })
        .collect();
    let router = router(&specs, &["--admission", "session-aware"]);
    let client = reqwest::Client::new();
    // Two turns of one conversation: routed, KV events published, and the
    // first message found in the tokenizer's segment cache the second time.
    let system = "You answer questions about railway switchyards, briefly and precisely.";
    for turn in 0..2 {
        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .header("x-session-id", "dashboards")
            .json(&json!({
                "model": "switchyard-sim",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": format!("Question {turn}: how many tracks?")},
                ],
                "max_tokens": 4,
                "stream": true,
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    wait_metrics(
        &client,
        &router.base,
        "KV events, the workers' KV usage and the tokenizer's counts",
        |text| {
            metric_sum(text, "switchyard_kv_event_batches_total") > 0.0
                && text.contains("switchyard_worker_kv_usage_ratio{")
                && metric(text, "switchyard_tokenizer_segment_cache_hits_total") > Some(0.0)
        },
    )
    .await;

    let mut exported = Exported::parse(&metrics_text(&client, &router.base).await);
    exported.extend(Exported::parse(&replica_metrics_text()));
    exported.extend(Exported::parse(
        &metrics_text(&client, &workers[0].base).await,
    ));

    let mut found = Vec::new();
    let mut checked = BTreeSet::new();
    for (place, expr, legend) in dashboard_expressions(&dashboard()) {
        for problem in check(&expr, &legend, &exported) {
            found.push(format!("{place}: {problem}\n  {expr}"));
        }
        checked.extend(selectors(&expr).into_iter().map(|s| s.metric));
    }
    for rule in alerts() {
        for problem in check(&rule.expr, "", &exported) {
            found.push(format!("alert {}: {problem}\n  {}", rule.name, rule.expr));
        }
        checked.extend(selectors(&rule.expr).into_iter().map(|s| s.metric));
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
    // Not vacuous: the files name most of what the router exports.
    assert!(
        checked.len() >= 60,
        "{} metrics checked: {checked:?}",
        checked.len()
    );
}

#[test]
fn the_dashboard_has_the_day_one_panels_each_with_a_unit_and_the_datasource_variable() {
    let dashboard = dashboard();
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    assert!(
        variables.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "a Prometheus datasource variable named `datasource`"
    );
    assert!(
        dashboard["schemaVersion"].as_u64() >= Some(36),
        "Grafana 9.4+ schema"
    );
    let panels = all_panels(&dashboard);
    let titles: BTreeSet<&str> = panels.iter().filter_map(|p| p["title"].as_str()).collect();
    for title in DAY_ONE_PANELS {
        assert!(
            titles.contains(title),
            "no panel titled {title:?}: {titles:?}"
        );
    }
    let mut ids = BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("(untitled)");
        assert!(
            ids.insert(panel["id"].as_u64()),
            "{title}: a duplicate panel id"
        );
        if panel["type"] == "row" {
            continue;
        }
        let unit = panel["fieldConfig"]["defaults"]["unit"].as_str();
        assert!(unit.is_some_and(|u| !u.is_empty()), "{title}: no unit");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            assert!(
                target["expr"].as_str().is_some_and(|e| !e.is_empty()),
                "{title}"
            );
        }
    }
}

#[test]
fn every_alert_has_a_duration_a_severity_and_a_summary() {
    let text = deploy_file("prometheus/alerts.yml");
    let rules = alert_rules(&text);
    let declared = text
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert_eq!(rules.len(), declared, "the reader found every rule");
    assert!(rules.len() >= 15, "{} rules", rules.len());
    let mut names = BTreeSet::new();
    for rule in &rules {
        let name = &rule.name;
        assert!(names.insert(name.clone()), "{name}: declared twice");
        assert!(name.starts_with("Switchyard"), "{name}");
        assert!(!rule.expr.trim().is_empty(), "{name}: no expr");
        let duration = rule
            .duration
            .as_deref()
            .unwrap_or_else(|| panic!("{name}: no `for`"));
        assert!(
            duration.ends_with(['s', 'm', 'h'])
                && duration[..duration.len() - 1].parse::<u32>().is_ok(),
            "{name}: `for: {duration}`"
        );
        let severity = rule.severity.as_deref();
        assert!(
            matches!(severity, Some("critical" | "warning" | "info")),
            "{name}: severity {severity:?}"
        );
        assert!(
            rule.summary.as_ref().is_some_and(|s| !s.is_empty()),
            "{name}: no summary"
        );
        assert!(
            rule.description.as_ref().is_some_and(|s| !s.is_empty()),
            "{name}: no description"
        );
    }
}

#[test]
fn a_made_up_metric_a_wrong_label_and_a_wrong_value_are_reported() {
    let exported = Exported::parse(concat!(
        "# HELP switchyard_requests_total Requests.\n",
        "# TYPE switchyard_requests_total counter\n",
        "switchyard_requests_total{policy=\"ttft\",status=\"ok\"} 3\n",
        "switchyard_requests_total{policy=\"ttft\",status=\"unavailable\"} 0\n",
        "# TYPE switchyard_tokenize_seconds histogram\n",
        "switchyard_tokenize_seconds_sum 0.5\n",
        "switchyard_tokenize_seconds_count 1\n",
        "switchyard_tokenize_seconds_bucket{le=\"+Inf\"} 1\n",
    ));
    let good = "sum by (status) (rate(switchyard_requests_total{status=~\"ok|unavailable\",instance=~\"$instance\"}[$__rate_interval])) / sum(rate(switchyard_tokenize_seconds_count[5m]))";
    assert_eq!(
        check(good, "{{status}} {{instance}}", &exported),
        Vec::<String>::new()
    );
    assert_eq!(
        check(
            "sum(rate(switchyard_not_a_metric_total[5m])) / sum(rate(switchyard_requests_total[5m]))",
            "",
            &exported
        ),
        ["`switchyard_not_a_metric_total` is not exported"]
    );
    assert_eq!(
        check("switchyard_requests_total{state=\"ok\"}", "", &exported),
        ["`switchyard_requests_total` has no label `state`"]
    );
    assert_eq!(
        check(
            "switchyard_requests_total{status!~\"ok|timeout\"}",
            "",
            &exported
        ),
        ["`switchyard_requests_total` never has `status=\"timeout\"`"]
    );
    assert_eq!(
        check(
            "rate(switchyard_requests_total[5m])",
            "{{worker}}",
            &exported
        ),
        ["the legend names `worker`, which no selected metric has"]
    );
    // A histogram is selected by its series, not by its family's name.
    assert_eq!(
        check("switchyard_tokenize_seconds", "", &exported),
        ["`switchyard_tokenize_seconds` is not exported"]
    );
    assert_eq!(
        check("node_cpu_seconds_total", "", &exported),
        ["`node_cpu_seconds_total` is neither exported by Switchyard nor listed in FOREIGN"]
    );
}

#[test]
fn the_expression_reader_skips_functions_keywords_labels_strings_and_variables() {
    let expr = r#"histogram_quantile(0.9, sum by (le, instance) (rate(switchyard_a_bucket{instance=~"$instance", le!="x}, y"}[$__rate_interval])))
        / ignoring (status) group_left sum without (policy) (switchyard_b_total offset 5m)
        or vector(0) and on (worker) max_over_time(up[5m]) > 2e-3 unless count(vllm:hits_total) > ${threshold}"#;
    let found = selectors(expr);
    let names: Vec<&str> = found.iter().map(|s| s.metric.as_str()).collect();
    assert_eq!(
        names,
        [
            "switchyard_a_bucket",
            "switchyard_b_total",
            "up",
            "vllm:hits_total"
        ]
    );
    let matchers: Vec<(&str, &str, &str)> = found[0]
        .matchers
        .iter()
        .map(|m| (m.label.as_str(), m.op.as_str(), m.value.as_str()))
        .collect();
    assert_eq!(
        matchers,
        [("instance", "=~", "$instance"), ("le", "!=", "x}, y")]
    );
}

#[test]
fn the_rules_reader_reads_plain_quoted_and_block_values() {
    let text = r#"
# a comment
groups:
  - name: g
    rules:
      - alert: A
        expr: |-
          sum(x)
            > 1
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "a \"quoted\" {{ $labels.worker }}"
          description: >-
            folded
            lines
      - alert: B
        expr: up == 0
        for: 1m
        labels:
          severity: critical
        annotations:
          summary: plain text
          description: d
"#;
    let rules = alert_rules(text);
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0].name, "A");
    assert_eq!(rules[0].expr, "sum(x)\n  > 1");
    assert_eq!(rules[0].duration.as_deref(), Some("5m"));
    assert_eq!(rules[0].severity.as_deref(), Some("warning"));
    assert_eq!(
        rules[0].summary.as_deref(),
        Some("a \"quoted\" {{ $labels.worker }}")
    );
    assert_eq!(rules[0].description.as_deref(), Some("folded lines"));
    assert_eq!(rules[1].expr, "up == 0");
    assert_eq!(rules[1].summary.as_deref(), Some("plain text"));
}

/// The replica plane's families, registered as `serve --replica-sync`
/// registers them ([`switchyard_replica::ReplicaMetrics::register`]).
fn replica_metrics_text() -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    switchyard_replica::ReplicaMetrics::default().register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
        .expect("writing to a String cannot fail");
    text
}

// ---------------------------------------------------------------------------
// What a Prometheus text exports.

/// The series of a Prometheus text by the names PromQL selects them with
/// (a histogram's `_bucket`, `_sum` and `_count`, a counter's `_total`
/// name as encoded), each with the label names and values seen on it.
#[derive(Debug, Default)]
struct Exported {
    series: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

impl Exported {
    fn parse(text: &str) -> Self {
        let mut exported = Self::default();
        // The names `# TYPE` declares (the reader skips comments): a
        // histogram's and a summary's series are selected by suffix.
        for typed in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (name, kind) = typed.split_once(' ').expect("`# TYPE name kind`");
            let suffixes: &[&str] = match kind {
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                _ => &[""],
            };
            for suffix in suffixes {
                exported
                    .series
                    .entry(format!("{name}{suffix}"))
                    .or_default();
            }
        }
        let scrape = Scrape::parse(text);
        assert_eq!(
            scrape.malformed_lines(),
            0,
            "every line our exporters write reads:\n{text}"
        );
        for sample in scrape.samples() {
            let labels = exported.series.entry(sample.name().to_owned()).or_default();
            for (label, value) in sample.labels() {
                labels
                    .entry(label.to_owned())
                    .or_default()
                    .insert(value.into_owned());
            }
        }
        exported
    }

    fn extend(&mut self, other: Exported) {
        for (name, labels) in other.series {
            let mine = self.series.entry(name).or_default();
            for (label, values) in labels {
                mine.entry(label).or_default().extend(values);
            }
        }
    }
}

/// What is wrong with `expr` (and the legend shown for it) against
/// `exported`: metrics that are not exported, labels they do not have,
/// label values they never take (for plain values and `a|b|c`
/// alternatives), legend labels no selected metric has. Empty when
/// nothing is.
fn check(expr: &str, legend: &str, exported: &Exported) -> Vec<String> {
    let mut problems = Vec::new();
    let mut legend_labels: BTreeSet<String> = TARGET_LABELS.iter().map(|l| l.to_string()).collect();
    for selector in selectors(expr) {
        let name = selector.metric.as_str();
        if !name.starts_with("switchyard_") {
            if !FOREIGN.iter().any(|(foreign, _)| *foreign == name) {
                problems.push(format!(
                    "`{name}` is neither exported by Switchyard nor listed in FOREIGN"
                ));
            }
            continue;
        }
        let Some(labels) = exported.series.get(name) else {
            problems.push(format!("`{name}` is not exported"));
            continue;
        };
        legend_labels.extend(labels.keys().cloned());
        for m in &selector.matchers {
            if TARGET_LABELS.contains(&m.label.as_str()) {
                continue;
            }
            let Some(seen) = labels.get(&m.label) else {
                problems.push(format!("`{name}` has no label `{}`", m.label));
                continue;
            };
            for value in plain_values(m) {
                if !seen.contains(value) {
                    problems.push(format!("`{name}` never has `{}=\"{value}\"`", m.label));
                }
            }
        }
    }
    for label in legend_placeholders(legend) {
        if !legend_labels.contains(label) {
            problems.push(format!(
                "the legend names `{label}`, which no selected metric has"
            ));
        }
    }
    problems
}

/// The values a matcher compares with, when they can be checked: a plain
/// value, or `a|b|c` for a regex matcher; none for a variable or any other
/// regex.
fn plain_values(m: &Matcher) -> Vec<&str> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | ':' | '|');
    if m.value.is_empty() || !m.value.chars().all(plain) {
        return Vec::new();
    }
    if m.op.ends_with('~') {
        m.value.split('|').collect()
    } else if m.value.contains('|') {
        Vec::new()
    } else {
        vec![m.value.as_str()]
    }
}

/// The `{{label}}` placeholders of a Grafana legend.
fn legend_placeholders(legend: &str) -> Vec<&str> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|rest| Some(rest.split_once("}}")?.0.trim()))
        .collect()
}

// ---------------------------------------------------------------------------
// The files' expressions.

/// Every PromQL expression of the dashboard, with where it is and its
/// legend: each panel's targets (rows' nested panels included) and the
/// template variables' queries (`label_values(EXPR, label)` read as EXPR).
fn dashboard_expressions(dashboard: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for panel in all_panels(dashboard) {
        let title = panel["title"].as_str().unwrap_or("(untitled)");
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_default().to_owned();
            let legend = target["legendFormat"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let place = format!("panel {title:?} target {}", target["refId"]);
            out.push((place, expr, legend));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] != "query" {
            continue;
        }
        let query = variable["query"]["query"]
            .as_str()
            .or(variable["query"].as_str())
            .unwrap_or_default();
        let expr = match query.strip_prefix("label_values(") {
            Some(args) => args.rsplit_once(',').map_or(args, |(expr, _label)| expr),
            None => query,
        };
        out.push((
            format!("variable {}", variable["name"]),
            expr.to_owned(),
            String::new(),
        ));
    }
    out
}

/// Every panel, those inside rows included.
fn all_panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        out.push(panel);
        out.extend(panel["panels"].as_array().into_iter().flatten());
    }
    out
}

// ---------------------------------------------------------------------------
// A reader of PromQL's metric selectors.

/// A metric an expression selects, with its label matchers.
#[derive(Debug)]
struct Selector {
    metric: String,
    matchers: Vec<Matcher>,
}

/// `label op "value"` inside a selector's braces.
#[derive(Debug)]
struct Matcher {
    label: String,
    op: String,
    value: String,
}

/// Words that are PromQL operators, modifiers or aggregations, not metrics
/// (an aggregation may be followed by `by (...)` before its parenthesis).
const KEYWORDS: [&str; 27] = [
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
];

/// Keywords followed by a parenthesized list of label names.
const LABEL_LISTS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric selectors of a PromQL expression, in order: every name that
/// is not a function (a name followed by `(`), a keyword, a label inside
/// braces or a label list, part of a string, a duration in brackets, a
/// number, or a Grafana variable (`$name`, `${name}`).
fn selectors(expr: &str) -> Vec<Selector> {
    let chars: Vec<char> = expr.chars().collect();
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '"' | '\'' | '`' => i = past_string(&chars, i),
            '[' | '{' => i = past_group(&chars, i),
            '$' => {
                i += 1;
                if chars.get(i) == Some(&'{') {
                    i = past_group(&chars, i);
                } else {
                    while i < chars.len() && name_char(chars[i]) {
                        i += 1;
                    }
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len() && name_char(chars[i]) {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut next = i;
                while chars.get(next).is_some_and(|c| c.is_whitespace()) {
                    next += 1;
                }
                let lower = word.to_ascii_lowercase();
                if LABEL_LISTS.contains(&lower.as_str()) {
                    if chars.get(next) == Some(&'(') {
                        i = past_group(&chars, next);
                    }
                } else if KEYWORDS.contains(&lower.as_str()) || chars.get(next) == Some(&'(') {
                    // An operator or a function call: its arguments are read
                    // on.
                } else if chars.get(next) == Some(&'{') {
                    let end = past_group(&chars, next);
                    let inner: String = chars[next + 1..end - 1].iter().collect();
                    out.push(Selector {
                        metric: word,
                        matchers: matchers(&inner),
                    });
                    i = end;
                } else {
                    out.push(Selector {
                        metric: word,
                        matchers: Vec::new(),
                    });
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// The index just past the string that opens at `open` (backslash escapes;
/// a backtick string has none).
fn past_string(chars: &[char], open: usize) -> usize {
    let quote = chars[open];
    let mut i = open + 1;
    while i < chars.len() {
        if chars[i] == '\\' && quote != '`' {
            i += 2;
        } else if chars[i] == quote {
            return i + 1;
        } else {
            i += 1;
        }
    }
    panic!(
        "an unterminated string in {:?}",
        chars.iter().collect::<String>()
    )
}

/// The index just past the bracket that closes the one at `open` (`(`,
/// `[` or `{`), strings inside skipped.
fn past_group(chars: &[char], open: usize) -> usize {
    let close = match chars[open] {
        '(' => ')',
        '[' => ']',
        '{' => '}',
        other => panic!("{other:?} opens no group"),
    };
    let mut i = open + 1;
    while i < chars.len() {
        match chars[i] {
            '"' | '\'' | '`' => i = past_string(chars, i),
            c if c == close => return i + 1,
            _ => i += 1,
        }
    }
    panic!(
        "an unclosed {:?} in {:?}",
        chars[open],
        chars.iter().collect::<String>()
    )
}

/// The matchers of a label set's inside (`a="x", b=~"y|z"`), values
/// unescaped. Reads a sample's labels in the exposition format as well.
fn matchers(inner: &str) -> Vec<Matcher> {
    let chars: Vec<char> = inner.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        while i < chars.len() && (chars[i].is_whitespace() || chars[i] == ',') {
            i += 1;
        }
        if i == chars.len() {
            return out;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
            i += 1;
        }
        let label: String = chars[start..i].iter().collect();
        while chars.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        let op_start = i;
        while chars.get(i).is_some_and(|c| matches!(c, '=' | '!' | '~')) {
            i += 1;
        }
        let op: String = chars[op_start..i].iter().collect();
        assert!(
            matches!(op.as_str(), "=" | "!=" | "=~" | "!~") && !label.is_empty(),
            "a matcher `{label}{op}` in {{{inner}}}"
        );
        while chars.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        let end = past_string(&chars, i);
        let mut value = String::new();
        let mut escaped = false;
        for &c in &chars[i + 1..end - 1] {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (true, 'n') => {
                    value.push('\n');
                    escaped = false;
                }
                (_, c) => {
                    value.push(c);
                    escaped = false;
                }
            }
        }
        out.push(Matcher { label, op, value });
        i = end;
    }
}

// ---------------------------------------------------------------------------
// A reader of the rules file.

/// One alerting rule.
#[derive(Debug, Default)]
struct AlertRule {
    name: String,
    expr: String,
    duration: Option<String>,
    severity: Option<String>,
    summary: Option<String>,
    description: Option<String>,
}

/// A node of the YAML subset [`yaml`] reads.
#[derive(Debug)]
enum Yaml {
    Scalar(String),
    Map(Vec<(String, Yaml)>),
    List(Vec<Yaml>),
}

impl Yaml {
    fn get(&self, key: &str) -> Option<&Yaml> {
        match self {
            Yaml::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    fn text(&self) -> Option<String> {
        match self {
            Yaml::Scalar(s) => Some(s.clone()),
            _ => None,
        }
    }

    fn items(&self) -> &[Yaml] {
        match self {
            Yaml::List(items) => items,
            _ => &[],
        }
    }
}

/// The alerting rules of a Prometheus rules file (`groups[].rules[]`).
fn alert_rules(text: &str) -> Vec<AlertRule> {
    let root = yaml(text);
    let mut out = Vec::new();
    for group in root.get("groups").map(Yaml::items).unwrap_or_default() {
        for rule in group.get("rules").map(Yaml::items).unwrap_or_default() {
            let field = |key: &str| rule.get(key).and_then(Yaml::text);
            let labels = rule.get("labels");
            let annotations = rule.get("annotations");
            let nested = |map: Option<&Yaml>, key: &str| map?.get(key)?.text();
            out.push(AlertRule {
                name: field("alert").expect("a rule with `alert:` (no recording rules here)"),
                expr: field("expr").unwrap_or_default(),
                duration: field("for"),
                severity: nested(labels, "severity"),
                summary: nested(annotations, "summary"),
                description: nested(annotations, "description"),
            });
        }
    }
    out
}

/// Reads the YAML subset the rules file is written in, without a YAML
/// library (none is in the workspace's lock file, and a test is not worth
/// adding one): block maps and lists by indentation, `key: value` with
/// plain or double-quoted values, and `|`, `|-`, `>`, `>-` block scalars;
/// `#` comment lines and blank lines. Anything else (flow collections,
/// anchors, a comment after a value) panics, so the file cannot drift into
/// a style this reads wrongly; `promtool check rules` checks the real
/// YAML.
fn yaml(text: &str) -> Yaml {
    // Logical lines: (indent, content), with each block scalar folded into
    // its key's line as a double-quoted value.
    let raw: Vec<&str> = text.lines().collect();
    let mut lines: Vec<(usize, String)> = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let line = raw[i];
        i += 1;
        let content = line.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let indent = line.len() - content.len();
        let Some(key) = ["|", "|-", ">", ">-"]
            .iter()
            .find_map(|style| Some((content.strip_suffix(style)?.strip_suffix(": ")?, style)))
        else {
            lines.push((indent, content.to_owned()));
            continue;
        };
        let (key, style) = key;
        // The key's own indent, past a list item's dash.
        let key_indent = indent + (content.len() - content.trim_start_matches("- ").len());
        let mut block = Vec::new();
        while i < raw.len() {
            let next = raw[i];
            let next_content = next.trim_start();
            if !next_content.is_empty() && next.len() - next_content.len() <= key_indent {
                break;
            }
            block.push(next);
            i += 1;
        }
        while block.last().is_some_and(|l| l.trim().is_empty()) {
            block.pop();
        }
        let block_indent = block
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.len() - l.trim_start().len())
            .min()
            .unwrap_or(0);
        let body: Vec<&str> = block
            .iter()
            .map(|l| l.get(block_indent..).unwrap_or(""))
            .collect();
        let mut value = if style.starts_with('|') {
            body.join("\n")
        } else {
            body.join(" ")
        };
        if !style.ends_with('-') {
            value.push('\n');
        }
        let quoted = value
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        lines.push((indent, format!("{key}: \"{quoted}\"")));
    }
    let mut at = 0;
    let root = yaml_node(&mut lines, &mut at, 0);
    assert_eq!(
        at,
        lines.len(),
        "a line outside the document: {:?}",
        lines.get(at)
    );
    root
}

/// The node whose lines start at `lines[*at]`, all at `indent`.
fn yaml_node(lines: &mut [(usize, String)], at: &mut usize, indent: usize) -> Yaml {
    if lines[*at].1.starts_with("- ") {
        let mut items = Vec::new();
        while *at < lines.len() && lines[*at].0 == indent && lines[*at].1.starts_with("- ") {
            // An item is a map whose first key sits on the dash's line.
            let (item_indent, content) = &mut lines[*at];
            *content = content[2..].to_owned();
            *item_indent += 2;
            items.push(yaml_node(lines, at, indent + 2));
        }
        return Yaml::List(items);
    }
    let mut entries = Vec::new();
    while *at < lines.len() && lines[*at].0 == indent && !lines[*at].1.starts_with("- ") {
        let content = lines[*at].1.clone();
        *at += 1;
        let (key, value) = match content.split_once(": ") {
            Some((key, value)) => (key, value.trim()),
            None => (
                content
                    .strip_suffix(':')
                    .unwrap_or_else(|| panic!("not `key: value`: {content:?}")),
                "",
            ),
        };
        let node = if !value.is_empty() {
            Yaml::Scalar(scalar(value))
        } else {
            let child_indent = lines.get(*at).map(|(i, _)| *i).unwrap_or(0);
            assert!(child_indent > indent, "`{key}:` holds nothing");
            yaml_node(lines, at, child_indent)
        };
        entries.push((key.to_owned(), node));
    }
    if let Some((deeper, content)) = lines.get(*at) {
        assert!(*deeper <= indent, "an unexpected indent at {content:?}");
    }
    Yaml::Map(entries)
}

/// A plain or double-quoted scalar's value.
fn scalar(value: &str) -> String {
    let Some(quoted) = value.strip_prefix('"') else {
        assert!(
            !value.contains(" #") && !value.starts_with(['{', '[', '&', '*', '\'', '|', '>']),
            "a plain value this reader cannot read: {value:?}"
        );
        return value.to_owned();
    };
    let inner = quoted
        .strip_suffix('"')
        .unwrap_or_else(|| panic!("an unterminated string: {value:?}"));
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => panic!("a trailing backslash in {value:?}"),
            },
            c => out.push(c),
        }
    }
    out
}
