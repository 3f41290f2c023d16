//! What the tests of this binary share: a sim-worker served in-process.

use clap::Parser;
use std::net::SocketAddr;
use switchyard_sim_worker::{bind, BoundWorker, SimWorkerArgs};
use switchyard_tokenizer::Tokenizer;
use switchyard_wire::prometheus::Scrape;

/// A worker served until the test's runtime ends.
pub(crate) struct Worker {
    /// Its base URL, `http://` and the bound address.
    pub(crate) base: String,
    pub(crate) port: u16,
    /// The SGLang bootstrap server's address, when it serves one.
    pub(crate) bootstrap: Option<SocketAddr>,
}

/// A sim-worker with the bundled tokenizer on a free loopback port, no
/// simulated delay, 1024 KV blocks and model `m`, with `flags` after
/// those; served until the test's runtime ends.
pub(crate) async fn serve_worker(flags: &[&str]) -> Worker {
    serve_worker_with(flags, Tokenizer::bundled().unwrap()).await
}

/// [`serve_worker`] with `tokenizer` for prompts and output text.
pub(crate) async fn serve_worker_with(flags: &[&str], tokenizer: Tokenizer) -> Worker {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimWorkerArgs,
    }
    let common = [
        "sim-worker",
        "--port",
        "0",
        "--no-delay",
        "--num-blocks",
        "1024",
        "--model",
        "m",
    ];
    let args = Cli::parse_from(common.iter().chain(flags)).args;
    let BoundWorker {
        listener,
        app,
        bootstrap,
    } = bind(&args, tokenizer).await.expect("the worker starts");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Worker {
        base: format!("http://{addr}"),
        port: addr.port(),
        bootstrap,
    }
}

/// The value of the `/metrics` series named `series` (with its labels) of
/// the worker at `base`, 0 when absent.
pub(crate) async fn metric(base: &str, series: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    Scrape::parse(&text).series_value(series).unwrap_or(0.0)
}
