//! The DNS source (`--workers-dns NAME:PORT`): the A and AAAA records of a
//! name are the workers, each `http://IP:PORT`, named `IP:PORT` (the name
//! a `--worker` URL gets by default, so the same address is the same
//! worker whichever way it came). Kubernetes' headless Services answer
//! this way: one record per ready pod.
//!
//! The resolver is `hickory-resolver` over the system's configuration
//! (`/etc/resolv.conf`) or the nameservers `--dns-server` names, with its
//! cache off: every pass asks the nameserver, so a record's TTL never
//! hides a change for longer than the interval.

use crate::config::WorkerSpec;
use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::TokioResolver;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Why a resolution gave no workers; the `reason` label of
/// `switchyard_discovery_errors_total`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DnsError {
    /// The name has no A or AAAA records (NXDOMAIN or no data). Treated as
    /// a failure, not as "no workers": a name that vanishes for a moment
    /// must not drain the fleet. A fleet scaled to zero is left to the
    /// health checks, which take dead workers out of selection.
    #[error("{0}: no A or AAAA records; keeping the last set of workers")]
    Empty(String),
    /// The lookup failed (timeout, refused, server failure).
    #[error("{0}: cannot resolve ({1}); keeping the last set of workers")]
    Resolve(String, String),
}

impl DnsError {
    /// Its metric label.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            DnsError::Empty(_) => "empty",
            DnsError::Resolve(..) => "resolve",
        }
    }
}

/// A resolver for the discovery sources: the system's configuration, or
/// `servers` (UDP, then TCP on a truncated or failed answer) when given.
pub(crate) fn resolver(servers: &[SocketAddr], timeout: Duration) -> Result<TokioResolver, String> {
    let mut builder = if servers.is_empty() {
        TokioResolver::builder_tokio()
            .map_err(|e| format!("reading the system's DNS configuration: {e}"))?
    } else {
        let mut config = ResolverConfig::new();
        for server in servers {
            config.add_name_server(NameServerConfig::new(*server, Protocol::Udp));
            config.add_name_server(NameServerConfig::new(*server, Protocol::Tcp));
        }
        TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
    };
    let options = builder.options_mut();
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    options.cache_size = 0;
    options.positive_max_ttl = Some(Duration::ZERO);
    options.negative_max_ttl = Some(Duration::ZERO);
    options.timeout = timeout;
    options.attempts = 1;
    Ok(builder.build())
}

/// The addresses `name` resolves to now.
pub(crate) async fn lookup(resolver: &TokioResolver, name: &str) -> Result<Vec<IpAddr>, DnsError> {
    match resolver.lookup_ip(name).await {
        Ok(found) => {
            let ips: Vec<IpAddr> = found.iter().collect();
            if ips.is_empty() {
                Err(DnsError::Empty(name.to_owned()))
            } else {
                Ok(ips)
            }
        }
        Err(e) if e.is_no_records_found() => Err(DnsError::Empty(name.to_owned())),
        Err(e) => Err(DnsError::Resolve(name.to_owned(), e.to_string())),
    }
}

/// The workers at `ips` on `port`: `http://IP:PORT` named `IP:PORT`
/// (IPv6 in brackets), in address order, each address once.
pub(crate) fn workers_at(ips: &[IpAddr], port: u16) -> Vec<WorkerSpec> {
    let mut addrs: Vec<SocketAddr> = ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
        .into_iter()
        .map(|addr| WorkerSpec {
            url: format!("http://{addr}"),
            name: None,
            events: None,
            replay: None,
            block_size: None,
            role: Default::default(),
            bootstrap_port: None,
            dp_size: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_is_one_worker_named_by_its_address() {
        let ips: Vec<IpAddr> = ["10.0.0.2", "::1", "10.0.0.1", "10.0.0.2"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let specs = workers_at(&ips, 8000);
        let names: Vec<String> = specs.iter().map(WorkerSpec::display_name).collect();
        assert_eq!(names, ["10.0.0.1:8000", "10.0.0.2:8000", "[::1]:8000"]);
        assert_eq!(specs[2].url, "http://[::1]:8000");
        for spec in &specs {
            spec.validate().unwrap();
        }
    }
}
