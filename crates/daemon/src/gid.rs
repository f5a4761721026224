//! Which GID the reference flow's loopback connection uses.
//!
//! On RoCE the kernel resolves the destination MAC address of a connected QP when it moves
//! to RTR (`ib_resolve_eth_dmac` in `drivers/infiniband/core/verbs.c`): for a RoCE v2 GID,
//! and for a RoCE v1 GID that is not link-local, through the IP stack (`rdma_resolve_ip`
//! in `addr.c`, with a 1 s limit). The probe connects a port to itself, so that lookup
//! only answers at once when the GID is an address the GID's network device holds (the
//! route is then local). A GID that is no address of its device becomes a neighbour
//! solicitation nobody answers, and `ibv_modify_qp(RTR)` fails after that second with
//! `ETIMEDOUT`.
//!
//! That is what GID index 0 is on every RoCE port whose interface does not derive its
//! IPv6 link-local address from its MAC: index 0 (and 1, one per GID type) is the port's
//! *default* GID, `fe80::` + the EUI-64 of the MAC (`make_default_gid` in `cache.c`),
//! there whatever the interface's addresses are. NetworkManager's `stable-privacy` mode
//! and the `random` mode (`net.ipv6.conf.<if>.addr_gen_mode` 2 and 3) give the interface
//! another link-local address; on a port whose index 0 is RoCE v2 (Soft-RoCE, which has
//! no RoCE v1; others by their configuration) the probe then cannot connect. An address
//! still tentative (duplicate address detection in progress, the first second or two
//! after the link comes up) fails the same way, since the kernel installs its local route
//! only once detection ends.
//!
//! So the default (`gid_index = "auto"`) is the first GID of the port whose address is
//! configured and no longer tentative on its network device ([`choose`]), and an index
//! given in the configuration is checked the same way ([`resolve`]), so that a GID the
//! connection cannot use stops the daemon at start with the index, the GID, the device
//! and the fix, rather than with `ETIMEDOUT` from `ibv_modify_qp`.
//!
//! The table comes from sysfs (`/sys/class/infiniband/<dev>/ports/<port>/gids/<i>`,
//! `gid_attrs/types/<i>`, `gid_attrs/ndevs/<i>`), the IPv6 addresses with their flags from
//! `/proc/net/if_inet6`, the IPv4 addresses from `getifaddrs(3)`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

/// The configured GID index: chosen at start, or given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GidChoice {
    /// The first usable GID of the port ([`choose`]).
    #[default]
    Auto,
    /// This index, checked ([`resolve`]).
    Index(u8),
}

impl fmt::Display for GidChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidChoice::Auto => f.write_str("auto"),
            GidChoice::Index(i) => write!(f, "{i}"),
        }
    }
}

/// A GID entry's type (`gid_attrs/types/<i>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// `IB/RoCE v1`: InfiniBand, or RoCE v1 on an Ethernet port.
    IbOrRoceV1,
    /// `RoCE v2` (RoCE over UDP/IP).
    RoceV2,
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidType::IbOrRoceV1 => "IB/RoCE v1",
            GidType::RoceV2 => "RoCE v2",
        })
    }
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index.
    pub index: u8,
    /// The GID, as the IPv6 address it is written as.
    pub gid: Ipv6Addr,
    /// Its type.
    pub kind: GidType,
    /// Its network device (RoCE); `None` on InfiniBand.
    pub ndev: Option<String>,
}

impl GidEntry {
    /// The IP address the kernel resolves this GID as: IPv4 for an IPv4-mapped GID.
    pub fn ip(&self) -> IpAddr {
        match self.gid.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(self.gid),
        }
    }
}

impl fmt::Display for GidEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "index {} = {} ({}", self.index, self.ip(), self.kind)?;
        if let Some(ndev) = &self.ndev {
            write!(f, " on {ndev}")?;
        }
        f.write_str(")")
    }
}

/// An address configured on a network device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetAddr {
    /// The device's name.
    pub ifname: String,
    /// The address.
    pub addr: IpAddr,
    /// Duplicate address detection has not finished (or failed): IPv6 only.
    pub tentative: bool,
}

/// Whether the loopback connection can use a GID entry now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usability {
    /// Its address is configured on its device (or it needs none).
    Ready,
    /// Its address is on its device but still tentative.
    Tentative,
    /// Its address is not an address of its device.
    Absent,
}

/// Whether `entry` can carry the loopback connection, given the host's addresses.
///
/// An entry without a network device (InfiniBand) needs no address, and neither does a
/// RoCE v1 entry with a link-local GID (the kernel derives the MAC from the GID itself);
/// every other entry resolves through the IP stack and needs its address on its device,
/// out of duplicate address detection.
pub fn usability(entry: &GidEntry, addrs: &[NetAddr]) -> Usability {
    let Some(ndev) = &entry.ndev else {
        return Usability::Ready;
    };
    let ip = entry.ip();
    if entry.kind == GidType::IbOrRoceV1 && is_link_local(&ip) {
        return Usability::Ready;
    }
    match addrs.iter().find(|a| &a.ifname == ndev && a.addr == ip) {
        Some(a) if a.tentative => Usability::Tentative,
        Some(_) => Usability::Ready,
        None => Usability::Absent,
    }
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
        IpAddr::V4(_) => false,
    }
}

/// The order of preference among usable entries, lowest first: RoCE v2 before RoCE v1
/// (v2 is what RDMA-CM applications use on a port that has it), and among RoCE v2 entries
/// an IPv4 address before an IPv6 one (UCX's automatic choice, and an IPv4 address has no
/// tentative phase); then the lower index.
fn rank(entry: &GidEntry) -> (u8, u8) {
    let class = match (entry.kind, entry.ip()) {
        (GidType::RoceV2, IpAddr::V4(_)) => 0,
        (GidType::RoceV2, IpAddr::V6(_)) => 1,
        (GidType::IbOrRoceV1, _) => 2,
    };
    (class, entry.index)
}

/// Why no GID was chosen, or why the given one was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GidError {
    /// The port's GID table could not be read.
    #[error("cannot read the GID table of {device} port {port} in {path}: {reason}")]
    Table {
        /// The RDMA device.
        device: String,
        /// Its port.
        port: u8,
        /// The directory read.
        path: String,
        /// What failed.
        reason: String,
    },
    /// The given index holds no GID.
    #[error("gid_index {index}: {device} port {port} has no GID at that index (populated: {populated}); remove gid_index (automatic) or set one of those")]
    Empty {
        /// The index given.
        index: u8,
        /// The RDMA device.
        device: String,
        /// Its port.
        port: u8,
        /// The indexes that hold a GID.
        populated: String,
    },
    /// The given index's GID is not an address of its device.
    #[error("gid_index {index}: {device} port {port}'s GID {gid} ({kind}) is not an address of {ndev} (its addresses: {held}), so the loopback connection would fail in ibv_modify_qp(RTR) with ETIMEDOUT (the kernel's neighbour lookup for it goes unanswered). A GID fe80::... at index 0 or 1 is the port's default GID, made from the MAC address; {ndev} has another link-local address when its net.ipv6.conf.{ndev}.addr_gen_mode is stable-privacy (2) or random (3), as NetworkManager's profiles usually make it. Fix: {fix}")]
    NotAnAddress {
        /// The index given.
        index: u8,
        /// The RDMA device.
        device: String,
        /// Its port.
        port: u8,
        /// The GID there.
        gid: IpAddr,
        /// Its type.
        kind: GidType,
        /// Its network device.
        ndev: String,
        /// The addresses the device holds.
        held: String,
        /// What to do.
        fix: String,
    },
    /// The GID's address is still tentative (duplicate address detection).
    #[error("{device} port {port}: the address of GID {entry} is still tentative (duplicate address detection has not finished)")]
    Tentative {
        /// The RDMA device.
        device: String,
        /// Its port.
        port: u8,
        /// The entry waited for.
        entry: GidEntry,
    },
    /// No entry of the port is usable.
    #[error("{device} port {port}: no GID is usable for the loopback connection (none is an address configured on its device, out of duplicate address detection): {table}. Fix: give the device an address (its IPv6 link-local address, or an IPv4 address for the RoCE v2 GID), or set gid_index")]
    NoneUsable {
        /// The RDMA device.
        device: String,
        /// Its port.
        port: u8,
        /// The table, each entry with what is wrong with it.
        table: String,
    },
}

impl GidError {
    /// Waiting can cure it: the address is only tentative.
    pub fn is_tentative(&self) -> bool {
        matches!(self, GidError::Tentative { .. })
    }
}

/// The GID the automatic setting takes: the best-ranked [`Usability::Ready`] entry. With
/// none ready, a tentative one (if any) is reported as [`GidError::Tentative`] so that the
/// caller can wait for it.
pub fn choose(
    device: &str,
    port: u8,
    table: &[GidEntry],
    addrs: &[NetAddr],
) -> Result<GidEntry, GidError> {
    let best = |wanted: Usability| {
        table
            .iter()
            .filter(|e| usability(e, addrs) == wanted)
            .min_by_key(|e| rank(e))
            .cloned()
    };
    if let Some(e) = best(Usability::Ready) {
        return Ok(e);
    }
    if let Some(entry) = best(Usability::Tentative) {
        return Err(GidError::Tentative {
            device: device.into(),
            port,
            entry,
        });
    }
    let table = if table.is_empty() {
        "the table is empty".to_string()
    } else {
        table
            .iter()
            .map(|e| format!("{e}: not an address of its device"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    Err(GidError::NoneUsable {
        device: device.into(),
        port,
        table,
    })
}

/// The index to connect through for `choice`: [`choose`]'s for [`GidChoice::Auto`]; for a
/// given index, that index if its entry is usable, otherwise why not and what to set.
pub fn resolve(
    choice: GidChoice,
    device: &str,
    port: u8,
    table: &[GidEntry],
    addrs: &[NetAddr],
) -> Result<GidEntry, GidError> {
    let index = match choice {
        GidChoice::Auto => return choose(device, port, table, addrs),
        GidChoice::Index(i) => i,
    };
    let Some(entry) = table.iter().find(|e| e.index == index) else {
        return Err(GidError::Empty {
            index,
            device: device.into(),
            port,
            populated: table
                .iter()
                .map(|e| e.index.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    match usability(entry, addrs) {
        Usability::Ready => Ok(entry.clone()),
        Usability::Tentative => Err(GidError::Tentative {
            device: device.into(),
            port,
            entry: entry.clone(),
        }),
        Usability::Absent => {
            let ndev = entry.ndev.clone().unwrap_or_default();
            let held: Vec<String> = addrs
                .iter()
                .filter(|a| a.ifname == ndev)
                .map(|a| {
                    let t = if a.tentative { " tentative" } else { "" };
                    format!("{}{t}", a.addr)
                })
                .collect();
            let fix = match choose(device, port, table, addrs) {
                Ok(e) => format!(
                    "remove gid_index (the automatic choice is {e}), or set gid_index = {}",
                    e.index
                ),
                Err(_) => format!(
                    "give {ndev} an address whose GID is usable, then remove gid_index (automatic)"
                ),
            };
            Err(GidError::NotAnAddress {
                index,
                device: device.into(),
                port,
                gid: entry.ip(),
                kind: entry.kind,
                held: if held.is_empty() {
                    "none".into()
                } else {
                    held.join(", ")
                },
                ndev,
                fix,
            })
        }
    }
}

/// Most entries read from a port's GID table (indexes are 8 bits in the verbs' address
/// vector).
const MAX_GIDS: usize = 256;

/// The populated entries of `device` port `port`'s GID table under `sysfs` (normally
/// `/sys`): every index whose GID is not all zeros, by index. An entry whose type cannot
/// be read counts as `IB/RoCE v1`, one whose network device cannot be read has none (as
/// on InfiniBand, where the kernel refuses to read it).
pub fn read_table(sysfs: &Path, device: &str, port: u8) -> Result<Vec<GidEntry>, GidError> {
    let dir = sysfs
        .join("class/infiniband")
        .join(device)
        .join("ports")
        .join(port.to_string());
    let err = |reason: String| GidError::Table {
        device: device.into(),
        port,
        path: dir.display().to_string(),
        reason,
    };
    let listing = std::fs::read_dir(dir.join("gids")).map_err(|e| err(format!("gids: {e}")))?;
    let mut indexes: Vec<u8> = listing
        .filter_map(|d| d.ok())
        .filter_map(|d| d.file_name().to_str().and_then(|n| n.parse::<u8>().ok()))
        .take(MAX_GIDS)
        .collect();
    indexes.sort_unstable();
    let mut table = Vec::new();
    for index in indexes {
        // An entry being rewritten, or one the kernel will not show, is skipped.
        let Ok(text) = std::fs::read_to_string(dir.join("gids").join(index.to_string())) else {
            continue;
        };
        let Some(gid) = parse_gid(text.trim()) else {
            continue;
        };
        if gid.is_unspecified() {
            continue;
        }
        let read = |what: &str| {
            std::fs::read_to_string(dir.join("gid_attrs").join(what).join(index.to_string()))
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let kind = match read("types").as_deref() {
            Some(t) if t.eq_ignore_ascii_case("RoCE v2") => GidType::RoceV2,
            _ => GidType::IbOrRoceV1,
        };
        table.push(GidEntry {
            index,
            gid,
            kind,
            ndev: read("ndevs"),
        });
    }
    Ok(table)
}

/// A GID as sysfs writes it: eight groups of four hex digits, colon-separated (which the
/// IPv6 parser takes as it is).
pub fn parse_gid(text: &str) -> Option<Ipv6Addr> {
    text.parse().ok()
}

/// `IFA_F_TENTATIVE`: duplicate address detection in progress.
const IFA_F_TENTATIVE: u32 = 0x40;
/// `IFA_F_DADFAILED`: duplicate address detection found the address in use.
const IFA_F_DADFAILED: u32 = 0x08;

/// The IPv6 addresses of `/proc/net/if_inet6` (`ADDRESS IFINDEX PREFIXLEN SCOPE FLAGS
/// NAME`, hexadecimal without separators), tentative when detection is in progress or
/// failed. Lines that do not parse are skipped.
pub fn parse_if_inet6(text: &str) -> Vec<NetAddr> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [hex, _ifindex, _plen, _scope, flags, name] = fields[..] else {
                return None;
            };
            if hex.len() != 32 {
                return None;
            }
            let bits = u128::from_str_radix(hex, 16).ok()?;
            let flags = u32::from_str_radix(flags, 16).ok()?;
            Some(NetAddr {
                ifname: name.to_string(),
                addr: IpAddr::V6(Ipv6Addr::from(bits)),
                tentative: flags & (IFA_F_TENTATIVE | IFA_F_DADFAILED) != 0,
            })
        })
        .collect()
}

/// The host's addresses: IPv6 from `if_inet6` (normally `/proc/net/if_inet6`, which
/// carries the tentative flag), IPv4 from `getifaddrs(3)`. What cannot be read is left out.
pub fn read_addresses(if_inet6: &Path) -> Vec<NetAddr> {
    let mut addrs = std::fs::read_to_string(if_inet6)
        .map(|t| parse_if_inet6(&t))
        .unwrap_or_default();
    addrs.extend(ipv4_addresses());
    addrs
}

/// Every IPv4 address of every interface, by `getifaddrs(3)`.
fn ipv4_addresses() -> Vec<NetAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list it allocated, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family says its type.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        // SAFETY: ifa_name is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        out.push(NetAddr {
            ifname: name.to_string_lossy().into_owned(),
            addr: IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
            tentative: false,
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GID fe80::5054:ff:fe12:3456 of a port whose MAC is 52:54:00:12:34:56.
    const DEFAULT_GID: &str = "fe80:0000:0000:0000:5054:00ff:fe12:3456";
    /// A stable-privacy link-local address of the same interface.
    const PRIVATE_LL: &str = "fe80:0000:0000:0000:9c3e:41a7:0b2d:77e1";
    const V4_GID: &str = "0000:0000:0000:0000:0000:ffff:0a00:0001";

    fn entry(index: u8, gid: &str, kind: GidType, ndev: Option<&str>) -> GidEntry {
        GidEntry {
            index,
            gid: parse_gid(gid).unwrap_or(Ipv6Addr::UNSPECIFIED),
            kind,
            ndev: ndev.map(str::to_string),
        }
    }

    fn v6(ifname: &str, gid: &str, tentative: bool) -> NetAddr {
        NetAddr {
            ifname: ifname.into(),
            addr: IpAddr::V6(parse_gid(gid).unwrap_or(Ipv6Addr::UNSPECIFIED)),
            tentative,
        }
    }

    fn v4(ifname: &str, a: [u8; 4]) -> NetAddr {
        NetAddr {
            ifname: ifname.into(),
            addr: IpAddr::V4(Ipv4Addr::from(a)),
            tentative: false,
        }
    }

    /// A fake sysfs port: (index, gid, type, ndev) per populated entry, plus `zeros` empty
    /// entries after them, as the kernel lists the whole table.
    fn fake_sysfs(entries: &[(u8, &str, &str, Option<&str>)], zeros: u8) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let port = root.path().join("class/infiniband/rxe0/ports/1");
        for d in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
            std::fs::create_dir_all(port.join(d)).unwrap_or_else(|e| panic!("{d}: {e}"));
        }
        let write = |p: std::path::PathBuf, s: &str| {
            std::fs::write(&p, s).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        };
        let next = entries.iter().map(|e| e.0 + 1).max().unwrap_or(0);
        for (i, gid, kind, ndev) in entries {
            write(port.join(format!("gids/{i}")), &format!("{gid}\n"));
            write(
                port.join(format!("gid_attrs/types/{i}")),
                &format!("{kind}\n"),
            );
            if let Some(n) = ndev {
                write(port.join(format!("gid_attrs/ndevs/{i}")), &format!("{n}\n"));
            }
        }
        for i in next..next + zeros {
            write(
                port.join(format!("gids/{i}")),
                "0000:0000:0000:0000:0000:0000:0000:0000\n",
            );
        }
        root
    }

    #[test]
    fn reads_the_populated_entries_of_a_fake_sysfs() {
        let root = fake_sysfs(
            &[
                (0, DEFAULT_GID, "RoCE v2", Some("veth0")),
                (1, PRIVATE_LL, "RoCE v2", Some("veth0")),
            ],
            14,
        );
        let table = read_table(root.path(), "rxe0", 1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            table,
            vec![
                entry(0, DEFAULT_GID, GidType::RoceV2, Some("veth0")),
                entry(1, PRIVATE_LL, GidType::RoceV2, Some("veth0")),
            ]
        );
        let missing = read_table(root.path(), "rxe1", 1);
        assert!(
            matches!(missing, Err(GidError::Table { .. })),
            "{missing:?}"
        );
    }

    #[test]
    fn parses_if_inet6_with_its_tentative_flag() {
        let text = "fe80000000000000505400fffe123456 03 40 20 80    veth0\n\
                    fe800000000000009c3e41a70b2d77e1 03 40 20 80    veth0\n\
                    fe800000000000005054000000000001 04 40 20 c0    veth1\n\
                    00000000000000000000000000000001 01 80 10 80       lo\n\
                    garbage\n";
        let addrs = parse_if_inet6(text);
        assert_eq!(
            addrs,
            vec![
                v6("veth0", DEFAULT_GID, false),
                v6("veth0", PRIVATE_LL, false),
                v6("veth1", "fe80::5054:0:0:1", true),
                v6("lo", "::1", false),
            ]
        );
    }

    #[test]
    fn the_default_gid_is_refused_when_the_link_local_address_is_not_made_from_the_mac() {
        // Soft-RoCE with addr_gen_mode stable-privacy: index 0 is the default GID, index 1
        // the interface's real link-local address.
        let table = vec![
            entry(0, DEFAULT_GID, GidType::RoceV2, Some("veth0")),
            entry(1, PRIVATE_LL, GidType::RoceV2, Some("veth0")),
        ];
        let addrs = vec![v6("veth0", PRIVATE_LL, false)];
        assert_eq!(usability(&table[0], &addrs), Usability::Absent);
        assert_eq!(
            resolve(GidChoice::Auto, "rxe0", 1, &table, &addrs),
            Ok(table[1].clone())
        );
        let refused = resolve(GidChoice::Index(0), "rxe0", 1, &table, &addrs);
        let Err(e @ GidError::NotAnAddress { .. }) = &refused else {
            panic!("{refused:?}");
        };
        let text = e.to_string();
        for part in [
            "gid_index 0",
            "fe80::5054:ff:fe12:3456",
            "not an address of veth0",
            "fe80::9c3e:41a7:b2d:77e1",
            "ETIMEDOUT",
            "set gid_index = 1",
        ] {
            assert!(text.contains(part), "{part:?} missing from: {text}");
        }
        assert_eq!(
            resolve(GidChoice::Index(1), "rxe0", 1, &table, &addrs),
            Ok(table[1].clone())
        );
    }

    #[test]
    fn with_an_eui64_link_local_address_index_0_is_chosen_as_before() {
        let table = vec![entry(0, DEFAULT_GID, GidType::RoceV2, Some("veth0"))];
        let addrs = vec![v6("veth0", DEFAULT_GID, false), v6("lo", "::1", false)];
        assert_eq!(
            resolve(GidChoice::Auto, "rxe0", 1, &table, &addrs),
            Ok(table[0].clone())
        );
        assert_eq!(
            resolve(GidChoice::Index(0), "rxe0", 1, &table, &addrs),
            Ok(table[0].clone())
        );
    }

    #[test]
    fn a_tentative_address_is_waited_for_not_taken() {
        let table = vec![entry(0, DEFAULT_GID, GidType::RoceV2, Some("veth0"))];
        let addrs = vec![v6("veth0", DEFAULT_GID, true)];
        let auto = resolve(GidChoice::Auto, "rxe0", 1, &table, &addrs);
        assert!(auto.as_ref().is_err_and(GidError::is_tentative), "{auto:?}");
        let given = resolve(GidChoice::Index(0), "rxe0", 1, &table, &addrs);
        assert!(
            given.as_ref().is_err_and(GidError::is_tentative),
            "{given:?}"
        );
        // An address on another device does not count.
        let elsewhere = vec![v6("veth1", DEFAULT_GID, false)];
        let none = resolve(GidChoice::Auto, "rxe0", 1, &table, &elsewhere);
        assert!(
            matches!(&none, Err(GidError::NoneUsable { table, .. }) if table.contains("index 0")),
            "{none:?}"
        );
    }

    #[test]
    fn roce_v2_ipv4_is_preferred_then_v2_ipv6_then_v1() {
        // mlx5's layout: v1 and v2 of the default GID, then v1 and v2 of the IPv4 address.
        let table = vec![
            entry(0, DEFAULT_GID, GidType::IbOrRoceV1, Some("eth0")),
            entry(1, DEFAULT_GID, GidType::RoceV2, Some("eth0")),
            entry(2, V4_GID, GidType::IbOrRoceV1, Some("eth0")),
            entry(3, V4_GID, GidType::RoceV2, Some("eth0")),
        ];
        let all = vec![v6("eth0", DEFAULT_GID, false), v4("eth0", [10, 0, 0, 1])];
        let pick = |addrs: &[NetAddr]| resolve(GidChoice::Auto, "mlx5_0", 1, &table, addrs);
        assert_eq!(pick(&all).map(|e| e.index), Ok(3));
        assert_eq!(pick(&all[..1]).map(|e| e.index), Ok(1));
        // No address at all: the RoCE v1 link-local GID needs none.
        assert_eq!(pick(&[]).map(|e| e.index), Ok(0));
        // The IPv4 address on another device: its GIDs are not usable.
        assert_eq!(pick(&[v4("eth1", [10, 0, 0, 1])]).map(|e| e.index), Ok(0));
    }

    #[test]
    fn infiniband_entries_need_no_address() {
        let table = vec![entry(
            0,
            "fe80:0000:0000:0000:0002:c903:0001:2345",
            GidType::IbOrRoceV1,
            None,
        )];
        assert_eq!(
            resolve(GidChoice::Auto, "mlx4_0", 1, &table, &[]),
            Ok(table[0].clone())
        );
        let empty = resolve(GidChoice::Index(4), "mlx4_0", 1, &table, &[]);
        assert!(
            matches!(&empty, Err(GidError::Empty { populated, .. }) if populated == "0"),
            "{empty:?}"
        );
    }
}
