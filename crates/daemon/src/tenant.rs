//! Tenants by cgroup: the cgroup a registering process belongs to, from
//! `/proc/<pid>/cgroup`.
//!
//! With `tenant = "cgroup"` two flows are one tenant's when their processes were in the
//! same cgroup when they connected, whatever their uids: the containers or services of
//! one user count apart, and one service's processes count once. The path is read once,
//! on accept, with the pid the kernel gave for the connection (`SO_PEERCRED`); a process
//! that moves afterwards keeps the tenant it connected as.

/// The cgroup a `/proc/<pid>/cgroup` text names: the unified (v2) hierarchy's path, from
/// its `0::/path` line, or where there is none (a v1-only host) the `name=systemd`
/// hierarchy's, which systemd keeps in step with its units. `None` when neither is there
/// or the path is not absolute.
pub fn cgroup_of(text: &str) -> Option<&str> {
    let path_of = |controllers: &str| {
        text.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_id, c, path) = (f.next()?, f.next()?, f.next()?);
            (c == controllers && path.starts_with('/')).then_some(path)
        })
    };
    text.lines()
        .find_map(|l| l.strip_prefix("0::").filter(|p| p.starts_with('/')))
        .or_else(|| path_of("name=systemd"))
}

/// The cgroup of process `pid`, or why it could not be read.
pub fn read_cgroup(pid: i32) -> Result<String, String> {
    let file = format!("/proc/{pid}/cgroup");
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{file}: {e}"))?;
    cgroup_of(&text)
        .map(str::to_string)
        .ok_or_else(|| format!("{file}: no cgroup v2 line and no name=systemd hierarchy"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_unified_hierarchy_is_preferred() {
        let hybrid = "12:memory:/user.slice\n1:name=systemd:/user.slice/user-1000.slice/app.scope\n0::/user.slice/user-1000.slice/app.scope\n";
        assert_eq!(
            cgroup_of(hybrid),
            Some("/user.slice/user-1000.slice/app.scope")
        );
        assert_eq!(cgroup_of("0::/\n"), Some("/"));
    }

    #[test]
    fn a_v1_only_host_uses_the_systemd_hierarchy() {
        let v1 = "4:memory:/docker/abc\n1:name=systemd:/docker/abc\n";
        assert_eq!(cgroup_of(v1), Some("/docker/abc"));
    }

    #[test]
    fn nothing_usable_is_none() {
        assert_eq!(cgroup_of(""), None);
        assert_eq!(cgroup_of("4:memory:/docker/abc\n"), None);
        assert_eq!(cgroup_of("0::relative\n"), None);
    }

    #[test]
    fn our_own_cgroup_is_read() {
        let text = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let ours = read_cgroup(std::process::id() as i32).unwrap();
        assert!(text.contains(&format!(":{ours}\n")), "{ours} in {text}");
        assert!(read_cgroup(-1).unwrap_err().contains("/proc/-1/cgroup"));
    }
}
