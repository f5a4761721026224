//! Where a run's processes go: each scenario host either here or on a `justitia
//! run-server`, from `--host NAME=ADDR:PORT` and `--hosts FILE`.
//!
//! Everything here is checked before any process starts: a name the scenario lacks, an
//! address that does not parse or resolve.

use std::collections::BTreeMap;
use std::fs;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// `--hosts FILE`: `[hosts] b = "10.77.0.2:7771"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostsFile {
    hosts: BTreeMap<String, String>,
}

/// Each scenario host mapped to a run-server, with the address as given (for messages).
pub type HostMap = BTreeMap<String, (String, SocketAddr)>;

/// Resolves `ADDR:PORT` (a name or an IP address) to its first address.
fn resolve(text: &str, what: &str) -> Result<SocketAddr> {
    text.to_socket_addrs()
        .with_context(|| format!("{what}: `{text}` is not ADDR:PORT"))?
        .next()
        .with_context(|| format!("{what}: `{text}` resolves to no address"))
}

/// The mappings of `--hosts FILE` and then `--host NAME=ADDR:PORT` (which win over the
/// file's for the same name), each name checked against the scenario's `hosts`.
pub fn host_map(
    flags: &[String],
    file: Option<&Path>,
    scenario_hosts: &[String],
) -> Result<HostMap> {
    let mut given: Vec<(String, String, String)> = Vec::new();
    if let Some(path) = file {
        let text = fs::read_to_string(path)
            .with_context(|| format!("reading --hosts {}", path.display()))?;
        let parsed: HostsFile =
            toml::from_str(&text).with_context(|| format!("reading --hosts {}", path.display()))?;
        for (name, addr) in parsed.hosts {
            given.push((name, addr, format!("--hosts {}", path.display())));
        }
    }
    let mut seen = Vec::new();
    for flag in flags {
        let Some((name, addr)) = flag.split_once('=') else {
            bail!("--host {flag}: expected NAME=ADDR:PORT, e.g. b=10.77.0.2:7771");
        };
        let name = name.trim();
        if seen.contains(&name) {
            bail!("--host {name} is given twice");
        }
        seen.push(name);
        given.retain(|(n, _, _)| n != name);
        given.push((
            name.to_string(),
            addr.trim().to_string(),
            format!("--host {flag}"),
        ));
    }
    let mut map = HostMap::new();
    for (name, addr, what) in given {
        if !scenario_hosts.contains(&name) {
            bail!(
                "{what}: the scenario has no host `{name}` (its hosts: {})",
                scenario_hosts.join(", ")
            );
        }
        let resolved = resolve(&addr, &what)?;
        map.insert(name, (addr, resolved));
    }
    Ok(map)
}

/// The run-servers: each one's address and the scenario hosts it serves.
pub type Servers = Vec<(SocketAddr, Vec<String>)>;

/// Where a scenario host's processes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// On this host's device.
    Here,
    /// On the run-server of link `n`.
    Server(usize),
}

/// Each scenario host's place, and the run-servers' addresses with the hosts each serves
/// (two hosts mapped to one address share one server, and so one device).
pub fn places(scenario_hosts: &[String], map: &HostMap) -> (BTreeMap<String, Place>, Servers) {
    let mut servers: Servers = Vec::new();
    let mut out = BTreeMap::new();
    for host in scenario_hosts {
        let place = match map.get(host) {
            None => Place::Here,
            Some((_, addr)) => match servers.iter().position(|(a, _)| a == addr) {
                Some(n) => {
                    servers[n].1.push(host.clone());
                    Place::Server(n)
                }
                None => {
                    servers.push((*addr, vec![host.clone()]));
                    Place::Server(servers.len() - 1)
                }
            },
        };
        out.insert(host.clone(), place);
    }
    (out, servers)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn hosts() -> Vec<String> {
        vec!["a".into(), "b".into()]
    }

    #[test]
    fn flags_and_files_map_scenario_hosts_and_refuse_others_by_name() {
        let map = host_map(&["b=127.0.0.1:7771".into()], None, &hosts()).unwrap();
        assert_eq!(map["b"].1, "127.0.0.1:7771".parse().unwrap());
        let err = host_map(&["c=127.0.0.1:7771".into()], None, &hosts())
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--host c=127.0.0.1:7771: the scenario has no host `c` (its hosts: a, b)"
        );
        let err = host_map(&["b".into()], None, &hosts())
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected NAME=ADDR:PORT"), "{err}");
        let err = host_map(&["b=nowhere".into()], None, &hosts())
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not ADDR:PORT"), "{err}");
        let twice = ["b=127.0.0.1:1".into(), "b=127.0.0.1:2".into()];
        assert!(host_map(&twice, None, &hosts()).is_err());

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hosts.toml");
        fs::write(
            &file,
            "[hosts]\nb = \"127.0.0.1:7771\"\na = \"127.0.0.1:7772\"\n",
        )
        .unwrap();
        let map = host_map(&["a=127.0.0.1:9".into()], Some(&file), &hosts()).unwrap();
        assert_eq!(map["a"].1.port(), 9, "the flag wins over the file");
        assert_eq!(map["b"].1.port(), 7771);
        fs::write(&file, "[hosts]\nz = \"127.0.0.1:1\"\n").unwrap();
        let err = host_map(&[], Some(&file), &hosts())
            .unwrap_err()
            .to_string();
        assert!(err.contains("no host `z`"), "{err}");
        fs::write(&file, "[servers]\nb = \"127.0.0.1:1\"\n").unwrap();
        assert!(host_map(&[], Some(&file), &hosts()).is_err());
    }

    #[test]
    fn hosts_on_one_address_share_one_server_and_unmapped_ones_stay_here() {
        let map = host_map(&[], None, &hosts()).unwrap();
        let (places_, servers) = places(&hosts(), &map);
        assert!(places_.values().all(|p| *p == Place::Here));
        assert!(servers.is_empty());
        let map = host_map(
            &["a=127.0.0.1:5".into(), "b=127.0.0.1:5".into()],
            None,
            &hosts(),
        )
        .unwrap();
        let (places_, servers) = places(&hosts(), &map);
        assert_eq!(places_["a"], Place::Server(0));
        assert_eq!(places_["b"], Place::Server(0));
        assert_eq!(servers[0].1, vec!["a".to_string(), "b".to_string()]);
    }
}
