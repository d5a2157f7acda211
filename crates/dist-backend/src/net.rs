//! Which local address a rank listens on, for every listener of the job (the Gloo mesh, the RPC
//! agent): one rule, so that all of a rank's listeners sit on the same interface.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::{Error, Result};

/// The address this rank listens on when none is given:
///
/// 1. the first address of the interface named by `DIST_SOCKET_IFNAME` (or Gloo's
///    `GLOO_SOCKET_IFNAME`);
/// 2. the local address of the route to `MASTER_ADDR`, when set (no packet is sent);
/// 3. `127.0.0.1`.
pub fn local_ip(rank: usize) -> Result<IpAddr> {
    local_ip_with(rank, &|k| std::env::var(k).ok())
}

/// [`local_ip`] reading variables through `env`.
pub fn local_ip_with(rank: usize, env: &dyn Fn(&str) -> Option<String>) -> Result<IpAddr> {
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
            local_ip_with(0, &env(&[])).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
    }
}
