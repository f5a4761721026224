//! The out-of-band channel: a TCP connection over which the two ends of a flow exchange
//! what connecting their queue pairs needs (QP numbers, PSNs, LIDs, GIDs, and the address
//! and key of each side's buffer), as perftest does, and whose closing tells the responder
//! that the requester is done.
//!
//! The peer is not trusted: every read has a deadline, every line a length cap, and the
//! number of queue pairs a peer may announce is capped by [`crate::plan::MAX_QPS`]; a peer
//! that announces a different number than the plan says is refused.
//!
//! The text format, one block per side:
//!
//! ```text
//! justitia-loadgen/1 QPS ADDR RKEY
//! QPN PSN LID GID     (QPS lines; GID as 32 hex digits)
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use justitia_verbs::Endpoint;

use crate::plan::MAX_QPS;

/// The first word of a block, with the format's version.
const MAGIC: &str = "justitia-loadgen/1";

/// Longest line a peer may send.
const MAX_LINE: u64 = 256;

/// How long a peer may take to send its block.
pub const EXCHANGE_DEADLINE: Duration = Duration::from_secs(20);

/// One side's half of a flow: its queue pairs and its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Side {
    /// Each wire queue pair's endpoint, in order.
    pub qps: Vec<Endpoint>,
    /// The buffer's address.
    pub addr: u64,
    /// The buffer's remote key.
    pub rkey: u32,
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// The connection failed, or the peer took too long.
    #[error("out-of-band channel: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something else than a block.
    #[error("out-of-band channel: the peer sent {0}")]
    Malformed(String),
}

impl Side {
    /// The block that says this side.
    pub fn encode(&self) -> String {
        let mut out = format!("{MAGIC} {} {} {}\n", self.qps.len(), self.addr, self.rkey);
        for e in &self.qps {
            let gid: String = e.gid.iter().map(|b| format!("{b:02x}")).collect();
            out.push_str(&format!("{} {} {} {gid}\n", e.qp_num, e.psn, e.lid));
        }
        out
    }

    /// Reads a block of `expected_qps` queue pairs from `reader`.
    pub fn decode(reader: &mut impl BufRead, expected_qps: u32) -> Result<Side, ExchangeError> {
        let header = read_line(reader)?;
        let words: Vec<&str> = header.split_whitespace().collect();
        let [magic, qps, addr, rkey] = words[..] else {
            return Err(ExchangeError::Malformed(format!(
                "a header of {} words",
                words.len()
            )));
        };
        if magic != MAGIC {
            return Err(ExchangeError::Malformed(format!(
                "`{magic}` where `{MAGIC}` was expected"
            )));
        }
        let qps: u32 = number(qps, "QP count")?;
        if qps > MAX_QPS || qps != expected_qps {
            return Err(ExchangeError::Malformed(format!(
                "{qps} queue pairs where the plan has {expected_qps}"
            )));
        }
        let addr = number(addr, "buffer address")?;
        let rkey = number(rkey, "remote key")?;
        let mut endpoints = Vec::with_capacity(qps as usize);
        for _ in 0..qps {
            let line = read_line(reader)?;
            let w: Vec<&str> = line.split_whitespace().collect();
            let [qpn, psn, lid, gid] = w[..] else {
                return Err(ExchangeError::Malformed(format!(
                    "a QP line of {} words",
                    w.len()
                )));
            };
            endpoints.push(Endpoint {
                qp_num: number(qpn, "QP number")?,
                psn: number(psn, "PSN")?,
                lid: number(lid, "LID")?,
                gid: parse_gid(gid)?,
            });
        }
        Ok(Side {
            qps: endpoints,
            addr,
            rkey,
        })
    }
}

fn read_line(reader: &mut impl BufRead) -> Result<String, ExchangeError> {
    let mut line = String::new();
    let n = reader.take(MAX_LINE).read_line(&mut line)?;
    if n == 0 {
        return Err(ExchangeError::Malformed("nothing (it hung up)".into()));
    }
    if !line.ends_with('\n') {
        return Err(ExchangeError::Malformed(format!(
            "a line longer than {MAX_LINE} bytes"
        )));
    }
    Ok(line)
}

fn number<T: std::str::FromStr>(word: &str, what: &str) -> Result<T, ExchangeError> {
    word.parse()
        .map_err(|_| ExchangeError::Malformed(format!("`{word}` as its {what}")))
}

fn parse_gid(hex: &str) -> Result<[u8; 16], ExchangeError> {
    let bad = || ExchangeError::Malformed(format!("`{hex}` as a GID"));
    if hex.len() != 32 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut gid = [0u8; 16];
    for (i, byte) in gid.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(gid)
}

/// Sends `ours` and reads the peer's block of `expected_qps` queue pairs, each read within
/// [`EXCHANGE_DEADLINE`].
pub fn exchange(
    stream: &mut TcpStream,
    ours: &Side,
    expected_qps: u32,
) -> Result<Side, ExchangeError> {
    stream.set_read_timeout(Some(EXCHANGE_DEADLINE))?;
    stream.set_write_timeout(Some(EXCHANGE_DEADLINE))?;
    stream.set_nodelay(true)?;
    stream.write_all(ours.encode().as_bytes())?;
    let mut reader = BufReader::new(stream.try_clone()?);
    Side::decode(&mut reader, expected_qps)
}

/// Blocks until the peer hangs up (or sends anything, or `poll_every` passes with `stop`
/// saying so); what it sent is discarded, a few bytes at a time.
pub fn wait_for_hang_up(stream: &mut TcpStream, mut stop: impl FnMut() -> bool) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
        if stop() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(n: u32) -> Side {
        Side {
            qps: (0..n)
                .map(|i| Endpoint {
                    qp_num: 17 + i,
                    psn: 0xabcdef - i,
                    lid: 0,
                    gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, i as u8],
                })
                .collect(),
            addr: 0x7f00_dead_beef,
            rkey: 4242,
        }
    }

    #[test]
    fn a_block_reads_back_as_written() {
        let s = side(3);
        let text = s.encode();
        let back = Side::decode(&mut text.as_bytes(), 3);
        assert_eq!(back.ok(), Some(s));
    }

    #[test]
    fn hostile_blocks_are_refused() {
        let text = side(2).encode();
        // Another count than the plan's.
        assert!(Side::decode(&mut text.as_bytes(), 3).is_err());
        // A count beyond the cap, even if the plan said so.
        let huge = format!("{MAGIC} 100000 1 1\n");
        assert!(Side::decode(&mut huge.as_bytes(), 100_000).is_err());
        // A line without end.
        let long = "x".repeat(10_000);
        let e = Side::decode(&mut long.as_bytes(), 1)
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("longer than")));
        // A short GID, a truncated block.
        let bad_gid = format!("{MAGIC} 1 1 1\n1 2 0 fe80\n");
        assert!(Side::decode(&mut bad_gid.as_bytes(), 1).is_err());
        let truncated = format!("{MAGIC} 2 1 1\n1 2 0 {}\n", "00".repeat(16));
        assert!(Side::decode(&mut truncated.as_bytes(), 2).is_err());
    }
}
