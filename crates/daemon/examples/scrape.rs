//! Fetches justitiad's metrics endpoint and parses it with a Prometheus text parser, so a
//! test can check the exposition is valid and read values from it without a Prometheus.
//!
//! `cargo run -p justitia-daemon --example scrape -- HOST:PORT` (or `unix:/path`, the
//! endpoint that carries the per-tenant series)
//!
//! Prints one line per sample, `name{label="value",...} value`, with labels sorted and a
//! histogram as one `name_bucket{le="..."}` per bucket (its `_sum` and `_count` are
//! samples of their own).
//! Exits 1 when the endpoint cannot be read, answers other than 200, or its body does not
//! parse or holds no sample.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

/// A connection to `addr`, TCP or `unix:/path`, with 10 s deadlines each way.
fn connect(addr: &str) -> std::io::Result<Box<dyn ReadWrite>> {
    let timeout = Some(Duration::from_secs(10));
    if let Some(path) = addr.strip_prefix("unix:") {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(timeout)?;
        s.set_write_timeout(timeout)?;
        return Ok(Box::new(s));
    }
    let s = TcpStream::connect(addr)?;
    s.set_read_timeout(timeout)?;
    s.set_write_timeout(timeout)?;
    Ok(Box::new(s))
}

/// A byte stream both ways.
trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn fetch(addr: &str) -> Result<String, String> {
    let mut s = connect(addr).map_err(|e| format!("connecting to {addr}: {e}"))?;
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("sending the request: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .map_err(|e| format!("reading the response: {e}"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no header/body separator in {} bytes", text.len()))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!("status line `{status}`"));
    }
    Ok(body.to_string())
}

fn labels(l: &prometheus_parse::Labels, extra: Option<(&str, String)>) -> String {
    let mut pairs: Vec<(String, String)> = l
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .chain(extra.map(|(k, v)| (k.to_string(), v)))
        .collect();
    if pairs.is_empty() {
        return String::new();
    }
    pairs.sort();
    let inner: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{{{}}}", inner.join(","))
}

fn main() -> ExitCode {
    let Some(addr) = std::env::args().nth(1) else {
        eprintln!("usage: scrape HOST:PORT | unix:/path");
        return ExitCode::from(2);
    };
    let body = match fetch(&addr) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("scrape: {e}");
            return ExitCode::from(1);
        }
    };
    let scrape = match prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("scrape: the exposition does not parse: {e}");
            return ExitCode::from(1);
        }
    };
    if scrape.samples.is_empty() {
        eprintln!("scrape: no sample in {} bytes", body.len());
        return ExitCode::from(1);
    }
    for s in &scrape.samples {
        match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => {
                println!("{}{} {v}", s.metric, labels(&s.labels, None));
            }
            prometheus_parse::Value::Histogram(buckets) => {
                for b in buckets {
                    println!(
                        "{}_bucket{} {}",
                        s.metric,
                        labels(&s.labels, Some(("le", b.less_than.to_string()))),
                        b.count
                    );
                }
            }
            prometheus_parse::Value::Summary(q) => {
                for c in q {
                    println!(
                        "{}{} {}",
                        s.metric,
                        labels(&s.labels, Some(("quantile", c.quantile.to_string()))),
                        c.count
                    );
                }
            }
        }
    }
    ExitCode::SUCCESS
}
