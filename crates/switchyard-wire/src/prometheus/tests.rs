use super::*;
use proptest::prelude::*;

/// A real vLLM 0.32.0 page (CPU build, model `tiny`), captured whole.
const VLLM_PAGE: &str = include_str!("../../tests/fixtures/vllm_0.32_cpu_metrics.txt");

fn labels_of(sample: &Sample<'_>) -> Vec<(String, String)> {
    sample
        .labels()
        .map(|(n, v)| (n.to_owned(), v.into_owned()))
        .collect()
}

fn pairs(labels: &[(&str, &str)]) -> Vec<(String, String)> {
    labels
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

#[test]
fn a_real_vllm_page_reads_whole_with_no_malformed_line() {
    let scrape = Scrape::parse(VLLM_PAGE);
    assert_eq!(scrape.samples().len(), 475);
    assert_eq!(scrape.malformed_lines(), 0);
    assert!(!scrape.truncated());
    let engine = [("engine", "0"), ("model_name", "tiny")];
    assert_eq!(
        scrape.value("vllm:prefix_cache_queries_total", &engine),
        Some(75305.0)
    );
    assert_eq!(
        scrape.value("vllm:prefix_cache_hits_total", &[("engine", "0")]),
        Some(44416.0)
    );
    assert_eq!(
        scrape.value(
            "vllm:prompt_tokens_by_source_total",
            &[("source", "local_compute")]
        ),
        Some(30889.0)
    );
    assert_eq!(
        scrape.sum("vllm:prompt_tokens_by_source_total"),
        Some(75305.0),
        "local compute + local cache hits + external transfers"
    );
    let info = scrape.series("vllm:cache_config_info").next().unwrap();
    assert_eq!(info.labels().count(), 37);
    assert_eq!(info.label("num_gpu_blocks").as_deref(), Some("32768"));
    assert_eq!(
        info.label("kv_cache_dtype_skip_layers").as_deref(),
        Some("[]")
    );
    assert_eq!(
        scrape.value("vllm:prefix_cache_hits_created", &[]),
        Some(1.796314289122345e9)
    );
}

#[test]
fn a_series_is_read_by_its_exact_name_not_a_prefix() {
    let text = "# TYPE switchyard_index_bytes gauge\n\
                switchyard_index_bytes_total 9\n\
                switchyard_index_bytes 1234\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.value("switchyard_index_bytes", &[]), Some(1234.0));
    assert_eq!(scrape.value("switchyard_index", &[]), None);
    assert_eq!(scrape.value("switchyard_missing", &[]), None);
}

#[test]
fn names_with_colons_labels_and_no_labels_all_read() {
    let text = "vllm:num_requests_running{engine=\"0\"} 3\n\
                :leading:colon 1\n\
                plain 2\n\
                empty_set{} 4\n\
                spaced {a=\"1\"} 5\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.malformed_lines(), 0);
    let read: Vec<(&str, f64)> = scrape
        .samples()
        .iter()
        .map(|s| (s.name(), s.value()))
        .collect();
    assert_eq!(
        read,
        [
            ("vllm:num_requests_running", 3.0),
            (":leading:colon", 1.0),
            ("plain", 2.0),
            ("empty_set", 4.0),
            ("spaced", 5.0)
        ]
    );
    assert_eq!(scrape.samples()[2].labels().count(), 0);
    assert_eq!(scrape.samples()[3].labels().count(), 0);
}

#[test]
fn label_values_are_unescaped_and_may_hold_braces_commas_and_equals() {
    let text = r#"m{path="C:\\dir",quote="say \"hi\"",nl="a\nb",odd="},{=",utf8="ключ 🔑"} 1"#;
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.malformed_lines(), 0);
    assert_eq!(
        labels_of(&scrape.samples()[0]),
        pairs(&[
            ("path", "C:\\dir"),
            ("quote", "say \"hi\""),
            ("nl", "a\nb"),
            ("odd", "},{="),
            ("utf8", "ключ 🔑"),
        ])
    );
    assert_eq!(scrape.value("m", &[("odd", "},{=")]), Some(1.0));
    assert!(matches!(
        scrape.samples()[0].label("utf8"),
        Some(Cow::Borrowed(_))
    ));
}

#[test]
fn blanks_tabs_trailing_commas_and_crlf_line_ends_are_accepted() {
    let text = "m{ a = \"1\" ,\tb=\"2\", } \t 7 \r\nn 8\r\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.malformed_lines(), 0);
    assert_eq!(
        labels_of(&scrape.samples()[0]),
        pairs(&[("a", "1"), ("b", "2")])
    );
    assert_eq!(scrape.value("m", &[("b", "2")]), Some(7.0));
    assert_eq!(scrape.value("n", &[]), Some(8.0));
}

#[test]
fn nan_infinities_exponents_and_timestamps_read() {
    let text = "a NaN\nb +Inf\nc -Inf\nd 1.5e+09 1700000000000\ne -2 -5\nf Inf\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.malformed_lines(), 0);
    assert!(scrape.value("a", &[]).unwrap().is_nan());
    assert_eq!(scrape.value("b", &[]), Some(f64::INFINITY));
    assert_eq!(scrape.value("c", &[]), Some(f64::NEG_INFINITY));
    assert_eq!(scrape.value("f", &[]), Some(f64::INFINITY));
    let d = scrape.series("d").next().unwrap();
    assert_eq!(
        (d.value(), d.timestamp_ms()),
        (1.5e9, Some(1_700_000_000_000))
    );
    assert_eq!(scrape.series("e").next().unwrap().timestamp_ms(), Some(-5));
    assert_eq!(scrape.series("a").next().unwrap().timestamp_ms(), None);
}

#[test]
fn comments_help_type_and_empty_lines_are_skipped_not_counted() {
    let text = "# HELP m The m.\n# TYPE m counter\n#bare comment\n\n   \n  # indented\nm 1\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.samples().len(), 1);
    assert_eq!(scrape.malformed_lines(), 0);
}

/// Lines none of which is a sample; each counted once.
const MALFORMED: [&str; 16] = [
    "9starts_with_a_digit 1",
    "m",
    "m notanumber",
    "m 1 2 3",
    "m 1 1.5",
    "m-x 1",
    "m{a=\"unterminated} 1",
    "m{a=\"1\" b=\"2\"} 1",
    "m{a=1} 1",
    "m{1a=\"x\"} 1",
    "m{a=\"\\q\"} 1",
    "m{a=\"1\"",
    "m{,} 1",
    "{\"utf8.name\"} 1",
    "m{a=\"1\"}} 1",
    "m{a=\"1\"} ",
];

#[test]
fn malformed_lines_are_skipped_and_counted_and_the_rest_still_read() {
    let mut text = String::from("good 1\n");
    for line in MALFORMED {
        text.push_str(line);
        text.push('\n');
    }
    text.push_str("also_good{a=\"x\"} 2\n");
    let scrape = Scrape::parse(&text);
    assert_eq!(scrape.malformed_lines(), MALFORMED.len());
    assert_eq!(scrape.value("good", &[]), Some(1.0));
    assert_eq!(scrape.value("also_good", &[("a", "x")]), Some(2.0));
    assert_eq!(scrape.samples().len(), 2);
}

#[test]
fn a_line_that_is_not_utf8_is_malformed_and_the_others_read() {
    let bytes = b"a 1\nb{x=\"\xff\"} 2\nc 3\n";
    let scrape = Scrape::parse_bytes(bytes);
    assert_eq!(scrape.malformed_lines(), 1);
    assert_eq!(scrape.value("c", &[]), Some(3.0));
}

#[test]
fn more_labels_than_the_limit_make_a_sample_malformed() {
    let set = |n: usize| {
        (0..n)
            .map(|i| format!("l{i}=\"v\""))
            .collect::<Vec<_>>()
            .join(",")
    };
    let text = format!(
        "ok{{{}}} 1\ntoo_many{{{}}} 1\n",
        set(MAX_LABELS),
        set(MAX_LABELS + 1)
    );
    let scrape = Scrape::parse(&text);
    assert_eq!(scrape.value("ok", &[]), Some(1.0));
    assert_eq!(scrape.value("too_many", &[]), None);
    assert_eq!(scrape.malformed_lines(), 1);
}

#[test]
fn past_the_line_limit_nothing_is_read_and_the_scrape_says_truncated() {
    let mut text = "# filler\n".repeat(MAX_LINES - 1);
    text.push_str("last_read 1\nfirst_unread 2\n");
    let scrape = Scrape::parse(&text);
    assert_eq!(scrape.value("last_read", &[]), Some(1.0));
    assert_eq!(scrape.value("first_unread", &[]), None);
    assert!(scrape.truncated());
    let exactly = "# filler\n".repeat(MAX_LINES - 1) + "last_read 1\n";
    assert!(
        !Scrape::parse(&exactly).truncated(),
        "a final newline is not a line"
    );
}

#[test]
fn past_the_byte_limit_nothing_is_read_not_even_a_cut_line() {
    let filler = format!("# {}\n", "x".repeat(1 << 20));
    let mut text = format!("first 1\n{}", filler.repeat(3));
    // The next sample straddles the byte limit: it is not read, not counted.
    let pad = MAX_INPUT_BYTES - text.len() - 4;
    text.push_str(&format!("#{}\n", " ".repeat(pad)));
    text.push_str("cut 123456789\nafter 2\n");
    let scrape = Scrape::parse(&text);
    assert_eq!(scrape.value("first", &[]), Some(1.0));
    assert_eq!(scrape.value("cut", &[]), None);
    assert_eq!(scrape.value("after", &[]), None);
    assert_eq!(scrape.malformed_lines(), 0);
    assert!(scrape.truncated());
}

#[test]
fn the_sum_adds_every_label_set_and_is_none_without_a_series() {
    let text = "x{engine=\"0\"} 1.5\nx{engine=\"1\"} 2\nx_total 100\ny 0\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.sum("x"), Some(3.5));
    assert_eq!(scrape.sum("y"), Some(0.0));
    assert_eq!(scrape.sum("z"), None);
}

#[test]
fn matchers_need_every_label_with_exactly_that_value() {
    let text = "r{status=\"ok\",policy=\"kv\"} 1\nr{status=\"error\",policy=\"kv\"} 2\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.value("r", &[]), Some(1.0), "no matchers: the first");
    assert_eq!(scrape.value("r", &[("status", "error")]), Some(2.0));
    assert_eq!(
        scrape.value("r", &[("status", "error"), ("policy", "kv")]),
        Some(2.0)
    );
    assert_eq!(scrape.value("r", &[("status", "err")]), None);
    assert_eq!(scrape.value("r", &[("missing", "")]), None);
}

#[test]
fn a_series_written_as_on_a_page_needs_exactly_its_labels_in_any_order() {
    let text = "w_up{worker=\"a\"} 1\n\
                w_up{worker=\"b\",zone=\"z\"} 0\n\
                w_up 7\n\
                q{v=\"say \\\"hi\\\"\"} 3\n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.series_value("w_up{worker=\"a\"}"), Some(1.0));
    assert_eq!(
        scrape.series_value("w_up{zone=\"z\",worker=\"b\"}"),
        Some(0.0)
    );
    assert_eq!(
        scrape.series_value("w_up{worker=\"b\"}"),
        None,
        "a label short"
    );
    assert_eq!(
        scrape.series_value("w_up"),
        Some(7.0),
        "no labels: the unlabelled one"
    );
    assert_eq!(scrape.series_value(" w_up{} "), Some(7.0));
    assert_eq!(scrape.series_value("q{v=\"say \\\"hi\\\"\"}"), Some(3.0));
    assert_eq!(scrape.series_value("w_up{worker="), None, "not a series");
    assert_eq!(scrape.series_value("w_u"), None);
}

// ---------------------------------------------------------------------------
// Property tests.

/// Text made of the format's own tokens, to reach the reader's every branch.
fn token_soup() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("m".to_owned()),
        Just("vllm:x_total".to_owned()),
        Just("{".to_owned()),
        Just("}".to_owned()),
        Just("=".to_owned()),
        Just(",".to_owned()),
        Just("\"".to_owned()),
        Just("\\".to_owned()),
        Just(" ".to_owned()),
        Just("\t".to_owned()),
        Just("\n".to_owned()),
        Just("\r".to_owned()),
        Just("#".to_owned()),
        Just("NaN".to_owned()),
        Just("+Inf".to_owned()),
        Just("-1.5e3".to_owned()),
        Just("42".to_owned()),
        Just("é🔑".to_owned()),
        "[a-z_:0-9]{1,4}",
    ];
    prop::collection::vec(token, 0..64).prop_map(|t| t.concat())
}

fn check_invariants(scrape: &Scrape<'_>, line_count: usize) {
    assert!(scrape.samples().len() + scrape.malformed_lines() <= line_count);
    for sample in scrape.samples() {
        assert!(!sample.name().is_empty());
        assert!(sample.labels().count() <= MAX_LABELS);
        for (name, _value) in sample.labels() {
            assert!(!name.is_empty());
        }
        let _ = scrape.value(sample.name(), &[("a", "b")]);
        let _ = scrape.sum(sample.name());
    }
}

/// The naive writer's escaping, as the format states it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One series as a reference holds it.
#[derive(Debug, Clone)]
struct Series {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
    timestamp_ms: Option<i64>,
}

/// Label values: any text (`any::<String>()` never holds a newline), and
/// short ones dense in what must be escaped or could confuse a reader.
fn label_value() -> impl Strategy<Value = String> {
    prop_oneof![any::<String>(), "[ab\\\\\"\n{},=# \té]{0,8}"]
}

fn value_strategy() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(0.0),
        -1e15..1e15f64,
        any::<f64>(),
    ]
}

fn series_strategy() -> impl Strategy<Value = Series> {
    (
        "[a-zA-Z_:][a-zA-Z0-9_:]{0,12}",
        prop::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,6}", label_value(), 0..5),
        value_strategy(),
        prop::option::of(any::<i64>()),
    )
        .prop_map(|(name, labels, value, timestamp_ms)| Series {
            name,
            labels: labels.into_iter().collect(),
            value,
            timestamp_ms,
        })
}

/// How the naive writer spaces one line's tokens.
#[derive(Debug, Clone, Copy)]
struct Layout {
    blank: &'static str,
    trailing_comma: bool,
    plus_inf: bool,
    crlf: bool,
}

fn layout_strategy() -> impl Strategy<Value = Layout> {
    (
        prop_oneof![Just(""), Just(" "), Just("\t"), Just(" \t ")],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(blank, trailing_comma, plus_inf, crlf)| Layout {
            blank,
            trailing_comma,
            plus_inf,
            crlf,
        })
}

fn write_line(series: &Series, layout: Layout) -> String {
    let b = layout.blank;
    let mut line = series.name.clone();
    if !series.labels.is_empty() || layout.trailing_comma {
        line.push_str(b);
        line.push('{');
        let pairs: Vec<String> = series
            .labels
            .iter()
            .map(|(n, v)| format!("{b}{n}{b}={b}\"{}\"{b}", escape(v)))
            .collect();
        line.push_str(&pairs.join(","));
        if layout.trailing_comma && !series.labels.is_empty() {
            line.push(',');
        }
        line.push_str(b);
        line.push('}');
    }
    let value = match series.value {
        v if v == f64::INFINITY && layout.plus_inf => "+Inf".to_owned(),
        v => format!("{v:?}"),
    };
    line.push_str(&format!(" {b}{value}"));
    if let Some(ts) = series.timestamp_ms {
        line.push_str(&format!(" {b}{ts}"));
    }
    line.push_str(b);
    line.push_str(if layout.crlf { "\r\n" } else { "\n" });
    line
}

/// A line of the page: a sample, a comment, or one known to be malformed.
#[derive(Debug, Clone)]
enum Line {
    Sample(Series, Layout),
    Comment(String),
    Malformed(usize),
}

fn line_strategy() -> impl Strategy<Value = Line> {
    prop_oneof![
        6 => (series_strategy(), layout_strategy()).prop_map(|(s, l)| Line::Sample(s, l)),
        1 => "[ -~]{0,20}".prop_map(|c| Line::Comment(format!("# {c}"))),
        1 => (0..MALFORMED.len()).prop_map(Line::Malformed),
    ]
}

fn same_value(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let scrape = Scrape::parse_bytes(&bytes);
        check_invariants(&scrape, bytes.split(|&b| b == b'\n').count());
    }

    #[test]
    fn text_made_of_the_formats_tokens_never_panics(text in token_soup()) {
        let scrape = Scrape::parse(&text);
        check_invariants(&scrape, text.split('\n').count());
    }

    /// Against a naive writer of the format: every sample comes back with
    /// its name, labels (unescaped, in order), value and timestamp, in page
    /// order, and exactly the malformed lines are counted.
    #[test]
    fn what_a_naive_writer_writes_reads_back(lines in prop::collection::vec(line_strategy(), 0..24)) {
        let mut text = String::new();
        let mut expected = Vec::new();
        let mut malformed = 0;
        for line in &lines {
            match line {
                Line::Sample(series, layout) => {
                    text.push_str(&write_line(series, *layout));
                    expected.push(series.clone());
                }
                Line::Comment(comment) => {
                    text.push_str(comment);
                    text.push('\n');
                }
                Line::Malformed(i) => {
                    text.push_str(MALFORMED[*i]);
                    text.push('\n');
                    malformed += 1;
                }
            }
        }
        let scrape = Scrape::parse(&text);
        prop_assert_eq!(scrape.malformed_lines(), malformed, "{}", text);
        prop_assert_eq!(scrape.samples().len(), expected.len(), "{}", text);
        for (sample, want) in scrape.samples().iter().zip(&expected) {
            prop_assert_eq!(sample.name(), want.name.as_str());
            prop_assert_eq!(labels_of(sample), want.labels.clone());
            prop_assert!(same_value(sample.value(), want.value), "{} vs {}", sample.value(), want.value);
            prop_assert_eq!(sample.timestamp_ms(), want.timestamp_ms);
        }
    }

    /// Against `prometheus-client`'s own text encoder (what every
    /// Switchyard `/metrics` is written with): every series of every
    /// family reads back with its labels and value.
    #[test]
    fn what_prometheus_client_encodes_reads_back(
        families in prop::collection::btree_map(
            "[a-zA-Z_:][a-zA-Z0-9_:]{0,12}",
            prop::collection::btree_map(
                prop::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,6}", label_value(), 1..4),
                value_strategy(),
                1..4,
            ),
            1..4,
        )
    ) {
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        use std::sync::atomic::AtomicU64;
        type Labels = Vec<(String, String)>;

        let mut registry = prometheus_client::registry::Registry::default();
        let mut expected = Vec::new();
        for (name, series) in &families {
            let family = Family::<Labels, Gauge<f64, AtomicU64>>::default();
            for (labels, value) in series {
                let labels: Labels = labels.clone().into_iter().collect();
                family.get_or_create(&labels).set(*value);
                expected.push((name.clone(), labels, *value));
            }
            registry.register(name.clone(), "help", family);
        }
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();

        let scrape = Scrape::parse(&text);
        prop_assert_eq!(scrape.malformed_lines(), 0, "{}", text);
        prop_assert_eq!(scrape.samples().len(), expected.len(), "{}", text);
        for (name, labels, value) in &expected {
            let found = scrape
                .series(name)
                .find(|s| labels_of(s) == *labels)
                .map(Sample::value);
            prop_assert!(found.is_some_and(|v| same_value(v, *value)), "{} {:?} = {} in\n{}", name, labels, value, text);
        }
    }
}
