//! `[peer] members_file`: the peer channel's members read from a file of their own, and
//! read again when it changes.
//!
//! The file holds the entries of a `[peer.members]` table and nothing else:
//!
//! ```toml
//! "10.0.0.1" = "<justitiad pubkey of 10.0.0.1>"
//! "fe80::2" = { key = "<its public key>", address = "192.168.1.7:7471" }
//! ```
//!
//! On Kubernetes it is a ConfigMap's key (`deploy/kubernetes/peer-members.sh` renders it
//! from the nodes' addresses and the public keys their pods published), mounted as a
//! directory: kubelet replaces the files by swapping a symbolic link, so the path names a
//! new file (a new inode) after every update. [`MembersWatch`] looks at the file's identity
//! at most once every [`POLL`] and reads it only when that changed; the server applies a
//! list that reads and parses, and refuses one that does not (logged, counted in
//! `justitia_peer_member_lists_refused_total`), keeping the running members. SIGHUP reads
//! it too, with the rest of the configuration.
//!
//! Inputs: the file. Outputs: [`Members`], or an error naming the file, the entry and the
//! reason. Bounds: a read is at most [`MAX_MEMBERS_FILE`] bytes, of a regular file opened
//! without blocking; the entries are at most `max_peers` others, as in `[peer.members]`.
//! An absent file lists no member (the channel waits for one to appear, as on a first
//! install before the list is rendered).

use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use justitia_peer::keys::PublicKey;
use justitia_peer::NodeId;

use crate::config::ConfigError;

/// The largest members file read: 4097 entries of a GID, a key and an address each take
/// well under half of it.
pub const MAX_MEMBERS_FILE: u64 = 1 << 20;

/// How often the file's identity is looked at, at most.
pub const POLL: Duration = Duration::from_secs(1);

/// A members file's content.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    /// Node id to public key (this host among them, if listed).
    pub members: BTreeMap<NodeId, PublicKey>,
    /// The addresses entries gave (`{ key, address }`), this host's own left out.
    pub hosts: BTreeMap<NodeId, SocketAddr>,
}

/// A members file that could not be read or was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MembersFileError {
    /// The file could not be read, or is no regular file, or is too large.
    #[error("peer members file {path}: {why}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// An entry (or the file's syntax) is refused.
    #[error("peer members file {path}: entry `{entry}`: {reason}")]
    Entry {
        /// The file.
        path: PathBuf,
        /// The entry (`(syntax)` for the file's syntax, `(members)` for their number).
        entry: String,
        /// Why.
        reason: String,
    },
}

impl MembersFileError {
    /// The error as a configuration error naming the members file.
    pub fn into_config_error(self) -> ConfigError {
        match self {
            MembersFileError::Read { path, why } => ConfigError {
                file: path,
                key: "(file)".into(),
                reason: why,
            },
            MembersFileError::Entry {
                path,
                entry,
                reason,
            } => ConfigError {
                file: path,
                key: entry,
                reason,
            },
        }
    }
}

/// Reads the file's text: `None` when it does not exist.
fn read_text(path: &Path) -> Result<Option<String>, MembersFileError> {
    let fail = |why: String| MembersFileError::Read {
        path: path.to_path_buf(),
        why,
    };
    // O_NONBLOCK: a FIFO put there does not hold the loop.
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(fail(e.to_string())),
    };
    let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
    if !meta.is_file() {
        return Err(fail("not a regular file".into()));
    }
    let mut text = String::new();
    let read = file
        .take(MAX_MEMBERS_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| fail(e.to_string()))?;
    if read as u64 > MAX_MEMBERS_FILE {
        return Err(fail(format!("larger than {MAX_MEMBERS_FILE} bytes")));
    }
    Ok(Some(text))
}

/// Parses a members file's text (see the module documentation) for host `node`.
pub fn parse(
    path: &Path,
    text: &str,
    node: NodeId,
    max_peers: usize,
) -> Result<Members, MembersFileError> {
    let entry = |entry: String, reason: String| MembersFileError::Entry {
        path: path.to_path_buf(),
        entry,
        reason,
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| entry("(syntax)".into(), e.message().to_string()))?;
    let (members, hosts) = crate::config::parse_members(table, "", node, max_peers)
        .map_err(|(key, reason)| entry(key, reason))?;
    Ok(Members { members, hosts })
}

/// Reads and parses the members file at `path` for host `node`; an absent file lists no
/// member.
pub fn read(path: &Path, node: NodeId, max_peers: usize) -> Result<Members, MembersFileError> {
    match read_text(path)? {
        Some(text) => parse(path, &text, node, max_peers),
        None => Ok(Members::default()),
    }
}

/// What identifies one version of the file: kubelet's update makes a new file, and an
/// edit in place changes its size or times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn identity(path: &Path) -> Option<Identity> {
    std::fs::metadata(path).ok().map(|m| Identity {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// Watches a members file (see the module documentation).
#[derive(Debug)]
pub struct MembersWatch {
    path: PathBuf,
    node: NodeId,
    max_peers: usize,
    /// The identity last seen; `None` before the first look (or while absent).
    seen: Option<Option<Identity>>,
    next_poll: Duration,
}

impl MembersWatch {
    /// Watches `path` for host `node`. The first [`poll`](Self::poll) reads the file.
    pub fn new(path: PathBuf, node: NodeId, max_peers: usize) -> Self {
        MembersWatch {
            path,
            node,
            max_peers,
            seen: None,
            next_poll: Duration::ZERO,
        }
    }

    /// The file watched.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// At most once every [`POLL`]: the file's list if the file changed (appeared, was
    /// replaced or edited, or went: an empty list) since the last look, else `None`. A
    /// file refused is not read again until it changes.
    pub fn poll(&mut self, now: Duration) -> Option<Result<Members, MembersFileError>> {
        if now < self.next_poll {
            return None;
        }
        self.next_poll = now.saturating_add(POLL);
        let id = identity(&self.path);
        if self.seen == Some(id) {
            return None;
        }
        self.seen = Some(id);
        Some(read(&self.path, self.node, self.max_peers))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::peer::parse_gid;

    const K1: &str = "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=";
    const K2: &str = "IB8eHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=";

    /// Writes `text` as kubelet updates a ConfigMap volume: a new file, renamed over.
    fn publish(path: &Path, text: &str) {
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    #[test]
    fn entries_are_read_and_each_refusal_names_the_file_and_the_entry() {
        let node = parse_gid("10.0.0.1").unwrap();
        let path = Path::new("/etc/justitia-peer/members.toml");
        let m = parse(
            path,
            &format!(
                "\"10.0.0.1\" = {{ key = \"{K1}\", address = \"10.0.0.1:7471\" }}\n\"fe80::2\" = {{ key = \"{K2}\", address = \"192.168.0.2:7471\" }}\n"
            ),
            node,
            64,
        )
        .unwrap();
        assert_eq!(m.members.len(), 2);
        let ib = parse_gid("fe80::2").unwrap();
        assert_eq!(m.hosts.len(), 1, "this host's own address is not taken");
        assert_eq!(m.hosts[&ib], "192.168.0.2:7471".parse().unwrap());
        for (text, entry, needle) in [
            ("\"10.0.0.2\" = \"AAAA\"\n".to_string(), "10.0.0.2", ""),
            (
                format!("\"host-b\" = \"{K1}\"\n"),
                "host-b",
                "neither a GID",
            ),
            (
                format!("\"10.0.0.2\" = \"{K1}\"\n\"10.0.0.3\" = \"{K1}\"\n"),
                "10.0.0.3",
                "same public key",
            ),
            (format!("\"10.0.0.2\" = \"{K1}\n"), "(syntax)", ""),
            (
                format!("\"10.0.0.2\" = \"{K1}\"\n\"10.0.0.3\" = \"{K2}\"\n"),
                "(members)",
                "max_peers is 1",
            ),
        ] {
            let e = parse(path, &text, node, 1).unwrap_err();
            let MembersFileError::Entry {
                entry: got, reason, ..
            } = &e
            else {
                panic!("{e}");
            };
            assert_eq!(got, entry, "{text}: {e}");
            assert!(reason.contains(needle), "{text}: {e}");
            assert!(
                e.to_string()
                    .starts_with("peer members file /etc/justitia-peer/members.toml: entry `"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_file_too_large_or_not_regular_is_refused_and_an_absent_one_lists_nobody() {
        let dir = tempfile::tempdir().unwrap();
        let node = parse_gid("10.0.0.1").unwrap();
        let path = dir.path().join("members.toml");
        assert_eq!(read(&path, node, 64).unwrap(), Members::default());
        std::fs::write(&path, vec![b'#'; MAX_MEMBERS_FILE as usize + 1]).unwrap();
        let e = read(&path, node, 64).unwrap_err();
        assert!(e.to_string().contains("larger than"), "{e}");
        let e = read(dir.path(), node, 64).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn the_watch_reads_a_changed_file_once_and_not_more_than_once_a_second() {
        let dir = tempfile::tempdir().unwrap();
        let node = parse_gid("10.0.0.1").unwrap();
        let path = dir.path().join("members.toml");
        let mut watch = MembersWatch::new(path.clone(), node, 64);
        let s = Duration::from_secs;
        // Absent at first: no member.
        assert_eq!(watch.poll(s(0)).unwrap().unwrap(), Members::default());
        assert!(watch.poll(s(1)).is_none(), "unchanged");
        publish(&path, &format!("\"10.0.0.2\" = \"{K1}\"\n"));
        assert!(
            watch.poll(s(1) + Duration::from_millis(500)).is_none(),
            "polled within the second"
        );
        let m = watch.poll(s(2)).unwrap().unwrap();
        assert_eq!(m.members.len(), 1);
        assert!(watch.poll(s(3)).is_none(), "read once");
        publish(&path, "\"10.0.0.2\" = \"not a key\"\n");
        assert!(watch.poll(s(4)).unwrap().is_err());
        assert!(
            watch.poll(s(5)).is_none(),
            "a refused file is not read again"
        );
        publish(
            &path,
            &format!("\"10.0.0.2\" = \"{K1}\"\n\"10.0.0.3\" = \"{K2}\"\n"),
        );
        assert_eq!(watch.poll(s(6)).unwrap().unwrap().members.len(), 2);
    }
}
