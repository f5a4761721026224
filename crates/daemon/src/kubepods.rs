//! Pods as tenants: the Kubernetes pod a process runs in, from its cgroup path, and the
//! pod's namespace and name, from kubelet's log directories.
//!
//! kubelet puts every container of a pod under the pod's cgroup, whose name carries the
//! pod's UID: with the cgroupfs driver `/kubepods[/burstable|/besteffort]/pod<UID>/<id>`,
//! with the systemd driver `/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<UID>.slice/<runtime>-<id>.scope`,
//! the UID's dashes written as underscores (systemd reserves the dash). Both hold under
//! cgroup v1 (the `name=systemd` hierarchy) and v2, whatever the runtime (containerd,
//! CRI-O, cri-dockerd), and below a prefix when kubelet itself runs in a cgroup (kind,
//! k3s). The path is the kernel's: a process cannot choose its pod.
//!
//! The namespace is not in the path. kubelet keeps each pod's logs in
//! `/var/log/pods/<namespace>_<name>_<UID>` (its `BuildPodLogsDirectory`; namespaces and
//! pod names are DNS names, which hold no underscore), a directory only kubelet writes:
//! [`PodDirectory`] reads it to name a UID's pod, so the daemon needs no API server.
//!
//! Invariants: [`pod_of_cgroup`] returns only a UID in its canonical form (36 characters,
//! lower-case hex and dashes); [`PodDirectory`] holds at most [`MAX_PODS`] pods, reads the
//! directory at most once per [`RESCAN`], and reads at most [`MAX_PODS`] entries of it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

/// Pods a [`PodDirectory`] names at most (kubelet runs at most 110 by default).
pub const MAX_PODS: usize = 16_384;
/// How long a [`PodDirectory`] waits after a read before reading the directory again for
/// a UID it does not know.
pub const RESCAN: Duration = Duration::from_secs(1);

/// The UID of the pod whose cgroup `path` is in, if it is one's.
pub fn pod_of_cgroup(path: &str) -> Option<String> {
    // The last pod segment: a pod's cgroup is never inside another's.
    path.split('/').rev().find_map(|segment| {
        let systemd = segment.strip_suffix(".slice").and_then(|s| {
            let (prefix, uid) = s.rsplit_once("-pod")?;
            // kubepods[-<qos>], or below kubelet's own slice kubelet-kubepods[-<qos>].
            prefix.split('-').any(|w| w == "kubepods").then_some(uid)
        });
        let uid = systemd.or_else(|| segment.strip_prefix("pod"))?;
        canonical_uid(&uid.replace('_', "-"))
    })
}

/// `uid` if it is a UUID in canonical form (8-4-4-4-12 lower-case hex digits), else
/// `None`.
fn canonical_uid(uid: &str) -> Option<String> {
    let groups: Vec<&str> = uid.split('-').collect();
    let lengths = groups.iter().map(|g| g.len()).collect::<Vec<_>>();
    let hex = |g: &&str| {
        g.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    (lengths == [8, 4, 4, 4, 12] && groups.iter().all(hex)).then(|| uid.to_string())
}

/// A pod's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodName {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// The pod a kubelet log directory's name (`<namespace>_<name>_<UID>`) belongs to.
pub fn parse_log_dir(dir: &str) -> Option<(String, PodName)> {
    let mut parts = dir.split('_');
    let (namespace, name, uid) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !valid_namespace(namespace) || !valid_pod_name(name) {
        return None;
    }
    let uid = canonical_uid(uid)?;
    Some((
        uid,
        PodName {
            namespace: namespace.into(),
            name: name.into(),
        },
    ))
}

/// A namespace's name: a DNS label (RFC 1123), at most 63 lower-case letters, digits and
/// dashes, starting and ending with a letter or digit.
pub fn valid_namespace(s: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| alnum(b) || b == b'-')
        && s.bytes().next().is_some_and(alnum)
        && s.bytes().last().is_some_and(alnum)
}

/// A pod's name: a DNS subdomain (RFC 1123), dot-separated labels, at most 253 bytes.
pub fn valid_pod_name(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(valid_namespace)
}

/// The pods kubelet's log directory names, read again when asked for a UID it does not
/// hold (at most once per [`RESCAN`]).
#[derive(Debug)]
pub struct PodDirectory {
    dir: PathBuf,
    pods: HashMap<String, PodName>,
    /// When it was last read, on the caller's clock.
    read_at: Option<Duration>,
}

impl PodDirectory {
    /// Reads nothing yet.
    pub fn new(dir: PathBuf) -> PodDirectory {
        PodDirectory {
            dir,
            pods: HashMap::new(),
            read_at: None,
        }
    }

    /// The name of the pod of `uid`, reading the directory again if it does not hold it
    /// and the last read is older than [`RESCAN`] (`now` on any monotonic clock). An
    /// unreadable directory names no pod.
    pub fn lookup(&mut self, now: Duration, uid: &str) -> Option<&PodName> {
        let stale = self.read_at.is_none_or(|t| now.saturating_sub(t) >= RESCAN);
        if !self.pods.contains_key(uid) && stale {
            self.read_at = Some(now);
            self.pods = self.read();
        }
        self.pods.get(uid)
    }

    fn read(&self) -> HashMap<String, PodName> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return HashMap::new();
        };
        entries
            .take(MAX_PODS)
            .flatten()
            .filter_map(|e| parse_log_dir(e.file_name().to_str()?))
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const UID: &str = "5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60";

    #[test]
    fn the_pod_uid_is_read_from_every_drivers_path() {
        for path in [
            // cgroupfs, v2 and v1, each QoS class.
            "/kubepods/besteffort/pod5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60/2cb4053789594843",
            "/kubepods/burstable/pod5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60/2cb4053789594843",
            "/kubepods/pod5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60/2cb4053789594843",
            // systemd, containerd and CRI-O, guaranteed and burstable.
            "/kubepods.slice/kubepods-pod5f0c6a2e_7d1b_4c39_9e0a_3b2d1c4e5f60.slice/cri-containerd-2cb40537.scope",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5f0c6a2e_7d1b_4c39_9e0a_3b2d1c4e5f60.slice/crio-2cb40537.scope",
            // kubelet in a cgroup of its own (kind, k3s).
            "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod5f0c6a2e_7d1b_4c39_9e0a_3b2d1c4e5f60.slice/cri-containerd-2cb4.scope",
            "/k3s/kubepods/besteffort/pod5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60/2cb4053789594843",
        ] {
            assert_eq!(pod_of_cgroup(path).as_deref(), Some(UID), "{path}");
        }
    }

    #[test]
    fn paths_of_no_pod_name_none() {
        for path in [
            "/",
            "/system.slice/justitiad.service",
            "/user.slice/user-1000.slice/session-3.scope",
            "/libpod_parent/libpod-d79c06fc4b82",
            // Not a UUID, upper-case, a group too short, an extra group.
            "/kubepods/besteffort/podnotauid/2cb4",
            "/kubepods/besteffort/pod5F0C6A2E-7D1B-4C39-9E0A-3B2D1C4E5F60/2cb4",
            "/kubepods/besteffort/pod5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f6/2cb4",
            "/kubepods/besteffort/pod5f0c6a2e-7d1b-4c39-9e0a-3b2d1c4e5f60-00/2cb4",
            // A slice that only looks like one.
            "/system.slice/notkubepods-pod5f0c6a2e_7d1b_4c39_9e0a_3b2d1c4e5f60.slice",
        ] {
            assert_eq!(pod_of_cgroup(path), None, "{path}");
        }
    }

    #[test]
    fn log_directories_name_their_pods_and_others_are_skipped() {
        assert_eq!(
            parse_log_dir(&format!("team-a_writer-0_{UID}")),
            Some((
                UID.to_string(),
                PodName {
                    namespace: "team-a".into(),
                    name: "writer-0".into()
                }
            ))
        );
        assert_eq!(
            parse_log_dir(&format!("kube-system_coredns.x-1_{UID}"))
                .unwrap()
                .1
                .name,
            "coredns.x-1"
        );
        for bad in [
            format!("team-a_writer_{UID}_x"),
            format!("Team-A_writer_{UID}"),
            format!("team-a__{UID}"),
            "team-a_writer_notauid".to_string(),
            format!("-team_writer_{UID}"),
            format!("{}_writer_{UID}", "a".repeat(64)),
        ] {
            assert_eq!(parse_log_dir(&bad), None, "{bad}");
        }
    }

    #[test]
    fn the_directory_is_read_again_for_an_unknown_uid_at_most_once_a_rescan() {
        let dir = tempfile::tempdir().unwrap();
        let mut pods = PodDirectory::new(dir.path().into());
        let t0 = Duration::from_secs(100);
        assert_eq!(pods.lookup(t0, UID), None);
        std::fs::create_dir(dir.path().join(format!("team-a_writer_{UID}"))).unwrap();
        // Within RESCAN of the last read the directory is not read again.
        assert_eq!(pods.lookup(t0 + RESCAN / 2, UID), None);
        let found = pods.lookup(t0 + RESCAN, UID).cloned();
        assert_eq!(found.map(|p| p.namespace), Some("team-a".to_string()));
        // A known UID is answered without reading, even once its directory is gone.
        std::fs::remove_dir(dir.path().join(format!("team-a_writer_{UID}"))).unwrap();
        assert!(pods.lookup(t0 + RESCAN * 3, UID).is_some());
        // An unreadable directory names nothing.
        let mut none = PodDirectory::new(dir.path().join("absent"));
        assert_eq!(none.lookup(t0, UID), None);
    }
}
