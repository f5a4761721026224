//! The host's justitiad seen during a run (`justitia run --daemon-metrics ADDR:PORT`): its
//! Prometheus endpoint read every [`EVERY`] while a run with a policy measures, so that
//! the report carries SafeUtil, Current99 and Target99 over time (the real-stack analogue
//! of the simulator's control series, drawn by the same figure) and the decreases the loop
//! made while the run went.
//!
//! The endpoint is the daemon's text exposition; only four unlabelled samples are read
//! from it. A read has a deadline and a cap on what it takes, and a daemon that does not
//! answer leaves the run's series short, never the run failed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use justitia_sim::series::{ControlSeries, ControlState, Mode, RunSeries};

/// How often the endpoint is read.
pub const EVERY: Duration = Duration::from_millis(100);

/// How long one read may take, connection and the whole response included.
const DEADLINE: Duration = Duration::from_secs(1);

/// The most of a response read: the daemon's exposition is tens of KB.
const MAX_RESPONSE: usize = 4 << 20;

/// What one read found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    /// When, ms from the run's start.
    pub t_ms: f64,
    /// SafeUtil, bytes/s.
    pub safe_util_bytes_per_sec: f64,
    /// Current99, s (`None`: no estimate, NaN in the exposition).
    pub current99_s: Option<f64>,
    /// Target99, s (`None`: not yet known).
    pub target99_s: Option<f64>,
    /// The loop's decreases so far (`justitia_safe_util_decreases_total`).
    pub decreases: f64,
}

/// What a [`Recorder`] read over a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recorded {
    /// Every read that found SafeUtil, in order.
    pub readings: Vec<Reading>,
    /// Reads that found nothing (no answer in time, not 200, no SafeUtil).
    pub failed: usize,
}

/// Reads the endpoint in a thread of its own until [`Recorder::finish`].
pub struct Recorder {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Recorded>,
}

impl Recorder {
    /// Starts reading `addr` now; times are from now.
    pub fn start(addr: SocketAddr) -> Recorder {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let begun = Instant::now();
            let mut recorded = Recorded::default();
            while !flag.load(Ordering::Relaxed) {
                let at = begun.elapsed();
                match scrape(addr).and_then(|text| parse(&text)) {
                    Some(mut r) => {
                        r.t_ms = at.as_secs_f64() * 1e3;
                        recorded.readings.push(r);
                    }
                    None => recorded.failed += 1,
                }
                std::thread::sleep(EVERY.saturating_sub(begun.elapsed() - at));
            }
            recorded
        });
        Recorder { stop, thread }
    }

    /// Stops reading; returns what was read.
    pub fn finish(self) -> Recorded {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// One GET of `/metrics`: the body, or `None` when the endpoint does not answer 200
/// within [`DEADLINE`], connection and the whole response included (an endpoint that
/// trickles its answer byte by byte holds the recorder no longer than one that is silent).
fn scrape(addr: SocketAddr) -> Option<String> {
    let deadline = Instant::now() + DEADLINE;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    };
    let mut s = TcpStream::connect_timeout(&addr, left()?).ok()?;
    s.set_write_timeout(Some(left()?)).ok()?;
    // One write: a request in pieces may meet a server that answers the first.
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).ok()?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        s.set_read_timeout(Some(left()?)).ok()?;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) if raw.len() + n <= MAX_RESPONSE => raw.extend_from_slice(&buf[..n]),
            Ok(_) => return None,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    let text = String::from_utf8(raw).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.")
        .then(|| head.split_whitespace().nth(1) == Some("200"))
        .filter(|&ok| ok)?;
    Some(body.to_string())
}

/// The four samples from an exposition; `None` without SafeUtil.
pub fn parse(text: &str) -> Option<Reading> {
    let value = |name: &str| {
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.trim().parse::<f64>().ok())
    };
    let finite = |v: Option<f64>| v.filter(|x| x.is_finite());
    Some(Reading {
        t_ms: 0.0,
        safe_util_bytes_per_sec: finite(value("justitia_safe_util_bytes_per_second"))?,
        current99_s: finite(value("justitia_current_p99_seconds")),
        target99_s: finite(value("justitia_target_p99_seconds")).filter(|&t| t > 0.0),
        decreases: finite(value("justitia_safe_util_decreases_total")).unwrap_or(0.0),
    })
}

/// The readings as a run's control series of `host` (the simulator's units: Gb/s and
/// us), sampled every [`EVERY`]. The mode is not in the exposition: every sample is
/// drawn as normal.
pub fn series(readings: &[Reading], host: &str) -> RunSeries {
    let mut control = ControlSeries::new(host);
    for r in readings {
        control.push(&ControlState {
            safe_util_gbps: r.safe_util_bytes_per_sec * 8.0 / 1e9,
            current99_us: r.current99_s.map(|s| s * 1e6),
            target99_us: r.target99_s.map(|s| s * 1e6),
            mode: Mode::Normal,
        });
    }
    RunSeries {
        interval_ms: EVERY.as_secs_f64() * 1e3,
        t_ms: readings.iter().map(|r| r.t_ms).collect(),
        flows: Vec::new(),
        controls: vec![control],
    }
}

/// The loop's decreases between the first and the last reading, and the time between
/// them, s.
pub fn decreases(readings: &[Reading]) -> Option<(f64, f64)> {
    let (first, last) = (readings.first()?, readings.last()?);
    Some((
        (last.decreases - first.decreases).max(0.0),
        (last.t_ms - first.t_ms) / 1e3,
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const EXPOSITION: &str = "# HELP justitia_safe_util_bytes_per_second SafeUtil.\n\
        # TYPE justitia_safe_util_bytes_per_second gauge\n\
        justitia_safe_util_bytes_per_second 473125.0\n\
        justitia_safe_util_decreases_total 7\n\
        justitia_current_p99_seconds NaN\n\
        justitia_target_p99_seconds 0.000907776\n\
        justitia_flows_counted{value=\"latency\"} 1\n";

    #[test]
    fn the_four_samples_are_read_and_nan_is_no_estimate() {
        let r = parse(EXPOSITION).unwrap();
        assert_eq!(r.safe_util_bytes_per_sec, 473_125.0);
        assert_eq!(r.current99_s, None);
        assert_eq!(r.target99_s, Some(0.000_907_776));
        assert_eq!(r.decreases, 7.0);
        // A labelled series of another name with the same prefix is not SafeUtil.
        assert!(parse("justitia_safe_util_bytes_per_second_x 1\n").is_none());
        assert!(parse("").is_none());
        assert!(parse("justitia_safe_util_bytes_per_second oops\n").is_none());
    }

    #[test]
    fn readings_become_the_simulators_units_and_decreases_a_difference() {
        let at = |t_ms: f64, decreases: f64, current: Option<f64>| Reading {
            t_ms,
            safe_util_bytes_per_sec: 125e6,
            current99_s: current,
            target99_s: Some(2e-6),
            decreases,
        };
        let rs = [
            at(0.0, 3.0, None),
            at(100.0, 3.0, Some(1.5e-6)),
            at(2100.0, 9.0, Some(3e-6)),
        ];
        let s = series(&rs, "a");
        assert_eq!(s.t_ms, vec![0.0, 100.0, 2100.0]);
        let c = &s.controls[0];
        assert_eq!(c.host, "a");
        assert_eq!(c.safe_util_gbps, vec![1.0; 3]);
        assert_eq!(c.current99_us, vec![None, Some(1.5), Some(3.0)]);
        assert_eq!(c.target99_us, vec![Some(2.0); 3]);
        assert_eq!(decreases(&rs), Some((6.0, 2.1)));
        assert_eq!(decreases(&[]), None);
    }

    /// Reads a request's head, so that closing after the answer never resets the
    /// connection under the client's read of it.
    fn read_request(c: &mut std::net::TcpStream) {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && c.read(&mut byte).unwrap_or(0) == 1 {
            head.push(byte[0]);
        }
    }

    /// A server that answers `reply` to the first request on a loopback port.
    fn answering(reply: &'static [u8]) -> (SocketAddr, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            read_request(&mut c);
            c.write_all(reply).unwrap();
        });
        (addr, server)
    }

    #[test]
    fn an_endpoint_that_answers_200_gives_its_body() {
        let (addr, server) =
            answering(b"HTTP/1.1 200 OK\r\n\r\njustitia_safe_util_bytes_per_second 1\n");
        assert_eq!(
            scrape(addr).as_deref(),
            Some("justitia_safe_util_bytes_per_second 1\n")
        );
        server.join().unwrap();
    }

    /// A daemon that answers nothing in time, or not 200, leaves no reading.
    #[test]
    fn an_endpoint_that_does_not_answer_200_gives_nothing() {
        let (addr, server) =
            answering(b"HTTP/1.0 404 Not Found\r\n\r\njustitia_safe_util_bytes_per_second 1\n");
        assert_eq!(scrape(addr), None);
        server.join().unwrap();
    }

    /// A well-formed answer that arrives slower than the deadline, each byte well within
    /// it, is given up: the deadline is the whole read's, not each socket read's.
    #[test]
    fn an_endpoint_that_trickles_its_answer_gives_nothing() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            read_request(&mut c);
            let answer = b"HTTP/1.0 200 OK\r\n\r\njustitia_safe_util_bytes_per_second 1\n";
            // 62 bytes 40 ms apart: 2.5 s in all, past the 1 s deadline.
            for byte in answer {
                if c.write_all(&[*byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        assert_eq!(scrape(addr), None);
        server.join().unwrap();
    }
}
