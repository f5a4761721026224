//! Tenants by cgroup: the cgroup a registering process belongs to, from
//! `/proc/<pid>/cgroup`.
//!
//! With `tenant = "cgroup"` two flows are one tenant's when their processes were in the
//! same cgroup when they connected, whatever their uids: the containers or services of
//! one user count apart, and one service's processes count once. The path is read once,
//! on accept; a process that moves afterwards keeps the tenant it connected as.
//!
//! Identity without a pid-reuse race: the peer's process is held by a pidfd the kernel
//! takes at `connect(2)` (`SO_PEERPIDFD`, Linux 6.5+), or where the kernel lacks it by
//! `pidfd_open(2)` of `SO_PEERCRED`'s pid. The cgroup file is read by pid and the pidfd
//! asked afterwards whether its process still runs ([`pidfd_alive`]): while it runs, its
//! pid cannot have been given to another process, so the file read was its own. (With the
//! fallback a process that exited before `pidfd_open` and whose pid was reused at once
//! would still be mistaken; `SO_PEERPIDFD` closes that window.) A peer in a pid namespace
//! the daemon cannot see has pid 0 ([`PeerCred::pid`]): it has no pidfd and no cgroup
//! to read, and is served as the tenant of its uid.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `SO_PEERPIDFD` (asm-generic value; the architectures this builds for use it).
const SO_PEERPIDFD: libc::c_int = 77;

/// The peer's credentials as `SO_PEERCRED` gives them, the pid raw: 0 for a process in a
/// pid namespace this one cannot see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Pid in the daemon's namespace, 0 when not visible.
    pub pid: i32,
    /// Uid.
    pub uid: u32,
    /// Primary gid.
    pub gid: u32,
}

/// `SO_PEERCRED` of a connected Unix socket.
pub fn peer_cred(sock: BorrowedFd<'_>) -> std::io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a ucred-sized buffer and its length for SO_PEERCRED on a live descriptor.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// A pidfd of the peer's process: the kernel's (`SO_PEERPIDFD`) where it has it, else
/// `pidfd_open` of `pid`; `None` for pid 0 or when neither works (the process is gone).
/// The second value says whether the kernel's was used.
///
/// `pidfd_open` is tried only when the kernel does not know `SO_PEERPIDFD`
/// ([`falls_back_to_pidfd_open`]). A kernel that knows it but refuses (some refuse for a
/// peer already reaped) has told the daemon the peer is gone: opening the pid then would
/// hold whatever process was given the pid since, and read that one's cgroup.
pub fn peer_pidfd(sock: BorrowedFd<'_>, pid: i32) -> (Option<OwnedFd>, bool) {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int-sized buffer and its length for SO_PEERPIDFD on a live descriptor.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // It comes without close-on-exec.
        let _ = rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC);
        return (Some(owned), true);
    }
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    if !falls_back_to_pidfd_open(errno) {
        return (None, false);
    }
    let fallback = rustix::process::Pid::from_raw(pid)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    (fallback, false)
}

/// Whether `SO_PEERPIDFD` failing with `errno` leaves `pidfd_open` of the pid to try: only
/// when the kernel does not have the option (before Linux 6.5). Any other failure is the
/// kernel's answer about the peer's process.
pub fn falls_back_to_pidfd_open(errno: i32) -> bool {
    errno == libc::ENOPROTOOPT
}

/// Whether the process a pidfd holds still runs (a pidfd becomes readable at its exit).
pub fn pidfd_alive(pidfd: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        pidfd,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(0))
}

/// The cgroup of the peer behind `pidfd` (pid `pid`), read so that a reused pid cannot
/// be mistaken for it: see the module documentation.
pub fn peer_cgroup(pid: i32, pidfd: Option<&OwnedFd>) -> Result<String, String> {
    let Some(pidfd) = pidfd else {
        return Err(format!("pid {pid}: no pidfd, the process is gone"));
    };
    let path = read_cgroup(pid)?;
    if !pidfd_alive(pidfd) {
        return Err(format!("pid {pid} exited while its cgroup was read"));
    }
    Ok(path)
}

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
    use std::os::fd::AsFd;

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
    fn a_socket_pairs_peer_is_this_process_and_its_pidfd_live() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let cred = peer_cred(a.as_fd()).unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        assert_eq!(cred.uid, rustix::process::geteuid().as_raw());
        let (pidfd, _) = peer_pidfd(a.as_fd(), cred.pid);
        let pidfd = pidfd.unwrap();
        assert!(pidfd_alive(&pidfd));
        assert!(!peer_cgroup(cred.pid, Some(&pidfd)).unwrap().is_empty());
        assert!(peer_cgroup(cred.pid, None).is_err());
    }

    #[test]
    fn a_pidfd_of_an_exited_process_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
        child.wait().unwrap();
        assert!(!pidfd_alive(&pidfd));
        assert!(peer_cgroup(child.id() as i32, Some(&pidfd)).is_err());
    }

    #[test]
    fn only_a_kernel_without_so_peerpidfd_falls_back_to_the_pid() {
        assert!(falls_back_to_pidfd_open(libc::ENOPROTOOPT));
        // What kernels with the option answer for a peer that is gone.
        for gone in [libc::ESRCH, libc::EINVAL, libc::ENODATA] {
            assert!(!falls_back_to_pidfd_open(gone), "errno {gone}");
        }
    }

    #[test]
    fn our_own_cgroup_is_read() {
        let text = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let ours = read_cgroup(std::process::id() as i32).unwrap();
        assert!(text.contains(&format!(":{ours}\n")), "{ours} in {text}");
        assert!(read_cgroup(-1).unwrap_err().contains("/proc/-1/cgroup"));
    }
}
