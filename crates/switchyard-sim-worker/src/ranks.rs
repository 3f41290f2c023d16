//! `--dp-size N`: N attention data-parallel ranks behind one port, as one
//! vLLM server started with `--data-parallel-size N` holds them. Each rank
//! is an engine of its own (its own KV cache, scheduler and driver
//! thread) publishing its KV events on its own port (the `--kv-events`
//! port plus the rank, the rank in each batch). A request names its rank
//! with `X-data-parallel-rank` (what a rank-aware router sends); without
//! the header the worker's own balancer picks one, modelled on vLLM's
//! front end ([`RankBalancer`]: lowest `waiting * 4 + running`, its view
//! refreshed every 100 ms). `/metrics` carries every rank's series, each
//! labelled `rank`.

use super::driver::DriverHandle;
use super::metrics::Metrics;
use axum::http::HeaderMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use switchyard_sim::fleet::RankBalancer;
use switchyard_wire::openai::ErrorBody;

/// The header a request names its rank with (vLLM's; case-insensitive).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Most ranks one worker serves (each is an engine thread).
pub const MAX_DP_SIZE: usize = 64;

/// One rank: its engine's driver and its metrics.
#[derive(Clone)]
pub struct Rank {
    /// The rank's engine thread.
    pub driver: DriverHandle,
    /// The rank's series.
    pub metrics: Arc<Metrics>,
}

/// Every rank of a worker with `--dp-size` > 1.
pub struct Ranks {
    ranks: Vec<Rank>,
    balancer: Mutex<RankBalancer>,
    started: Instant,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranks")
            .field("ranks", &self.ranks.len())
            .finish()
    }
}

/// The rank a request's header names, checked against `size` ranks:
/// `Ok(None)` without the header.
pub fn requested_rank(headers: &HeaderMap, size: usize) -> Result<Option<usize>, ErrorBody> {
    let Some(value) = headers.get(DP_RANK_HEADER) else {
        return Ok(None);
    };
    let rank = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    match rank {
        Some(r) if r < size => Ok(Some(r)),
        _ => Err(ErrorBody::invalid_request(
            format!(
                "X-data-parallel-rank must be a rank of this worker, 0 to {}, got {:?}",
                size.saturating_sub(1),
                String::from_utf8_lossy(value.as_bytes())
            ),
            None,
        )),
    }
}

impl Ranks {
    /// The ranks, rank `r` at index `r`.
    pub fn new(ranks: Vec<Rank>) -> Self {
        Self {
            balancer: Mutex::new(RankBalancer::new(ranks.len())),
            ranks,
            started: Instant::now(),
        }
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// The rank a request runs on: the one its header names, else the
    /// balancer's; a 400 for a header naming no rank of this worker.
    pub fn choose(&self, headers: &HeaderMap) -> Result<&Rank, ErrorBody> {
        let index = match requested_rank(headers, self.ranks.len())? {
            Some(r) => r,
            None => {
                let now_ms = self.started.elapsed().as_secs_f64() * 1e3;
                let mut balancer = self.balancer.lock().unwrap_or_else(|p| p.into_inner());
                balancer.pick(now_ms, |r| self.ranks[r].metrics.queue())
            }
        };
        self.ranks
            .get(index)
            .ok_or_else(|| ErrorBody::internal("no such rank"))
    }

    /// Every rank's series in one exposition: each family once, its
    /// samples labelled `rank="r"`.
    pub fn encode_metrics(&self) -> String {
        let texts: Vec<String> = self.ranks.iter().map(|r| r.metrics.encode()).collect();
        merge_ranks(&texts)
    }
}

/// Merges the expositions of identical registries, one per rank: each
/// family's comment lines once (rank 0's), then its samples of every
/// rank with a `rank` label.
pub fn merge_ranks(texts: &[String]) -> String {
    // Families, in order: comment lines, then each rank's sample lines.
    let mut families: Vec<(Vec<&str>, Vec<String>)> = Vec::new();
    for (rank, text) in texts.iter().enumerate() {
        let mut family = 0usize;
        let mut in_samples = false;
        let mut first = true;
        for line in text.lines() {
            if line.starts_with('#') {
                if in_samples || first {
                    // A new family starts with its comments.
                    if !first {
                        family += 1;
                    }
                    first = false;
                    in_samples = false;
                }
                if rank == 0 {
                    if families.len() <= family {
                        families.push((Vec::new(), Vec::new()));
                    }
                    families[family].0.push(line);
                }
                continue;
            }
            if line.is_empty() {
                continue;
            }
            first = false;
            in_samples = true;
            if families.len() <= family {
                families.push((Vec::new(), Vec::new()));
            }
            families[family].1.push(with_rank(line, rank));
        }
    }
    let mut out = String::new();
    for (comments, samples) in families {
        for line in comments {
            out.push_str(line);
            out.push('\n');
        }
        for line in samples {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// A sample line with `rank="r"` as its first label.
fn with_rank(line: &str, rank: usize) -> String {
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    match rest.strip_prefix('{') {
        Some(labels) if labels.starts_with('}') => format!("{name}{{rank=\"{rank}\"{labels}"),
        Some(labels) => format!("{name}{{rank=\"{rank}\",{labels}"),
        None => format!("{name}{{rank=\"{rank}\"}}{rest}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_names_a_rank_of_this_worker_or_is_refused() {
        let mut headers = HeaderMap::new();
        assert_eq!(requested_rank(&headers, 4).unwrap(), None);
        headers.insert("X-Data-Parallel-Rank", "3".parse().unwrap());
        assert_eq!(requested_rank(&headers, 4).unwrap(), Some(3));
        for bad in ["4", "-1", "one", ""] {
            headers.insert(DP_RANK_HEADER, bad.parse().unwrap());
            let err = requested_rank(&headers, 4).unwrap_err();
            assert_eq!(err.status(), Some(400), "{bad}");
            assert!(err.error.message.contains("0 to 3"), "{bad}");
        }
    }

    #[test]
    fn merged_metrics_hold_each_family_once_with_every_ranks_samples_labelled() {
        let rank = |n: u32| {
            format!(
                "# HELP a_total A.\n# TYPE a_total counter\na_total {n}\n# HELP b B.\n# TYPE b gauge\nb{{kind=\"x\"}} {n}\n"
            )
        };
        let merged = merge_ranks(&[rank(1), rank(2)]);
        assert_eq!(
            merged,
            "# HELP a_total A.\n# TYPE a_total counter\na_total{rank=\"0\"} 1\na_total{rank=\"1\"} 2\n\
             # HELP b B.\n# TYPE b gauge\nb{rank=\"0\",kind=\"x\"} 1\nb{rank=\"1\",kind=\"x\"} 2\n"
        );
    }
}
