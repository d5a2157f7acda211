//! Which local address a rank listens on, for every listener of the job (the Gloo mesh, the RPC
//! agent): one rule, so that all of a rank's listeners sit on the same interface.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::{Error, Result};

/// The address this rank listens on when none is given:
///
/// 1. the first address of the interface named by `DIST_SOCKET_IFNAME` (or Gloo's
///    `GLOO_SOCKET_IFNAME`);
/// 2. the local address of the route to `MASTER_ADDR`, when set (no packet is sent);
/// 3. the local address of the route to the host this process rendezvoused with
///    ([`note_rendezvous_host`]: the job's TCP store, wherever init found it: the first host
///    of a Slurm node list, a `tcp://host:port` URL);
/// 4. `127.0.0.1`.
pub fn local_ip(rank: usize) -> Result<IpAddr> {
    local_ip_with(rank, &|k| std::env::var(k).ok())
}

/// The host of the job's TCP store, as init reached it (see [`local_ip`]).
static RENDEZVOUS_HOST: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Records `host` as the one this process's job rendezvouses with, for [`local_ip`]. Why:
/// without it a rank whose master came from `SLURM_JOB_NODELIST` or a `tcp://` URL, with no
/// `MASTER_ADDR` set, listened on and published `127.0.0.1`, which no other host can reach.
pub fn note_rendezvous_host(host: &str) {
    *RENDEZVOUS_HOST.lock().unwrap_or_else(|e| e.into_inner()) = Some(host.to_owned());
}

/// [`local_ip`] reading variables through `env`.
pub fn local_ip_with(rank: usize, env: &dyn Fn(&str) -> Option<String>) -> Result<IpAddr> {
    let noted = RENDEZVOUS_HOST
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    local_ip_from(rank, env, noted.as_deref())
}

/// [`local_ip_with`] given the rendezvous host (see [`note_rendezvous_host`]).
fn local_ip_from(
    rank: usize,
    env: &dyn Fn(&str) -> Option<String>,
    rendezvous: Option<&str>,
) -> Result<IpAddr> {
    for var in ["DIST_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"] {
        if let Some(name) = env(var) {
            let ifs = if_addrs::get_if_addrs().map_err(|e| Error::Io {
                rank,
                context: "listing network interfaces".into(),
                source: e,
            })?;
            let mut mine: Vec<IpAddr> = ifs
                .iter()
                .filter(|i| i.name == name)
                .map(|i| i.ip())
                .collect();
            // Prefer IPv4, which every peer can reach when the interface has both.
            mine.sort_by_key(|ip| ip.is_ipv6());
            return mine.first().copied().ok_or_else(|| Error::Init {
                what: format!(
                    "{var}={name} names no interface with an address (interfaces: {})",
                    ifs.iter()
                        .map(|i| i.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
    if let Some(ip) = env("MASTER_ADDR").and_then(|m| route_to(&m)) {
        return Ok(ip);
    }
    if let Some(ip) = rendezvous.and_then(route_to) {
        return Ok(ip);
    }
    Ok(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn route_to(host: &str) -> Option<IpAddr> {
    let target = (host, 9).to_socket_addrs().ok()?.next()?;
    if target.ip().is_loopback() {
        return Some(target.ip());
    }
    let any: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(target).ok()?;
    Some(s.local_addr().ok()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn interface_name_picks_its_address_and_a_bad_name_is_an_error_naming_the_variable() {
        assert_eq!(
            local_ip_with(0, &env(&[("GLOO_SOCKET_IFNAME", "lo")])).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        let e = local_ip_with(3, &env(&[("DIST_SOCKET_IFNAME", "nosuch0")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("init: DIST_SOCKET_IFNAME=nosuch0 names no interface"),
            "{e}"
        );
    }

    #[test]
    fn master_addr_route_and_fallback() {
        assert_eq!(
            local_ip_with(0, &env(&[("MASTER_ADDR", "127.0.0.1")])).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(
            local_ip_from(0, &env(&[]), None).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
    }

    #[test]
    fn the_rendezvous_host_stands_in_for_master_addr() {
        // This host's own non-loopback address, where it has one: the route to it leaves
        // from it, where the fallback would have been 127.0.0.1.
        let Some(mine) = if_addrs::get_if_addrs()
            .unwrap()
            .into_iter()
            .map(|i| i.ip())
            .find(|ip| ip.is_ipv4() && !ip.is_loopback())
        else {
            eprintln!("skipped: no non-loopback IPv4 address on this host");
            return;
        };
        let host = mine.to_string();
        assert_eq!(local_ip_from(0, &env(&[]), Some(&host)).unwrap(), mine);
        // MASTER_ADDR, when set, still decides.
        assert_eq!(
            local_ip_from(0, &env(&[("MASTER_ADDR", "127.0.0.1")]), Some(&host)).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
    }
}
