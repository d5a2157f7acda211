//! The shared-memory transport between ranks on one host.
//!
//! Each ordered pair of ranks on one host gets a single-producer, single-consumer byte ring
//! (`ring`) in the receiver's `memfd` segment (`segment`); the frames, their headers and
//! the whole peer protocol run over it unchanged (the engine sees a byte stream, `link`).
//! The pair's TCP connection stays: it is the doorbell that wakes a sleeping side (one byte,
//! sent only when the other side said it sleeps) and the liveness signal (its EOF means the
//! peer is gone), so the engine still sleeps in one poll over every peer, TCP or not. Large
//! collective messages keep the single-copy path, whose offers and acknowledgements now travel
//! through the ring.
//!
//! Which pairs use it is decided when the mesh is built (`negotiate`): every rank publishes
//! a host id (the kernel's boot id and the network and pid namespaces, so two containers on
//! one machine with separate namespaces are two hosts) and where its segment is; two ranks with
//! the same host id that can both open each other's segment use rings, all others TCP, in one
//! group. `DIST_GLOO_TRANSPORT=tcp` keeps every pair on TCP, `=shm` makes a pair that cannot
//! use rings an error naming it.

pub(crate) mod group_area;
pub(crate) mod link;
pub(crate) mod ring;
pub(crate) mod segment;

use std::io;
use std::str::FromStr;
use std::time::Instant;

use dist_backend::{Error, Result, Store};

use group_area::GroupArea;
use ring::{RxRing, TxRing};
use segment::Segment;

/// Which transport carries the frames between two ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportMode {
    /// Shared memory between ranks on one host, TCP between hosts.
    #[default]
    Auto,
    /// TCP between every pair.
    Tcp,
    /// Shared memory between every pair; a pair that cannot (other hosts, no access to the
    /// peer's segment) fails the mesh with an error naming it.
    Shm,
}

impl FromStr for TransportMode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportMode::Auto),
            "tcp" => Ok(TransportMode::Tcp),
            "shm" => Ok(TransportMode::Shm),
            other => Err(format!(
                "DIST_GLOO_TRANSPORT={other:?}: expected auto, tcp or shm"
            )),
        }
    }
}

/// Data bytes of each ring: room for a full default segment and its header, so a sender
/// rarely waits for its reader (a power of two).
pub const DEFAULT_RING_BYTES: usize = 2 << 20;

/// The least data bytes of a ring: each ring's slot (its control block and data) must keep
/// the next rank's ring at a multiple of 128 bytes, which smaller powers of two did not (with
/// 64, every odd rank's ring was refused, and its pairs went over TCP or failed under
/// `DIST_GLOO_TRANSPORT=shm`).
const MIN_RING_BYTES: usize = 128;

/// The data bytes of each ring for a requested `bytes` (`DIST_GLOO_SHM_RING_BYTES`): the
/// next power of two, at least [`MIN_RING_BYTES`]; an error past the largest power of two.
pub(crate) fn ring_capacity(bytes: usize) -> io::Result<usize> {
    bytes
        .max(MIN_RING_BYTES)
        .checked_next_power_of_two()
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a shared-memory ring of {bytes} bytes (DIST_GLOO_SHM_RING_BYTES) is past any power of two"),
            )
        })
}

/// CPUs online on this machine (not this process's affinity, which a launcher may have
/// narrowed to one core per rank), from `/sys/devices/system/cpu/online` ("0-3,8-11").
pub fn online_cpus() -> Option<usize> {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    let mut n = 0;
    for part in list.trim().split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().ok()?.checked_sub(a.parse().ok()?)? + 1,
            None => part.parse::<usize>().map(|_| 1).ok()?,
        };
    }
    Some(n)
}

/// This machine and kernel namespaces, as far as sharing memory goes: the boot id (one per
/// running kernel) and the network and pid namespaces (the pid in a segment's locator is only
/// meaningful in the pid namespace that issued it; the network namespace is what the multi-
/// host tests separate). Hostnames are not enough: containers share them across machines.
pub fn host_id() -> io::Result<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let net = std::fs::read_link("/proc/self/ns/net")?;
    let pid = std::fs::read_link("/proc/self/ns/pid")?;
    Ok(
        format!("{}/{}/{}", boot.trim(), net.display(), pid.display())
            .replace(char::is_whitespace, ""),
    )
}

/// The two rings of a pair, seen from this rank.
#[derive(Debug)]
pub(crate) struct Rings {
    pub(crate) rx: RxRing,
    pub(crate) tx: TxRing,
}

/// What a rank publishes about itself.
struct Record {
    /// It asked for shared memory with every peer (`DIST_GLOO_TRANSPORT=shm`): a pair with it
    /// that cannot use rings fails on both sides.
    strict: bool,
    /// Its segment, `None` when it takes no part (`DIST_GLOO_TRANSPORT=tcp`, or it could not
    /// make one).
    seg: Option<Locator>,
}

/// Where a rank's segment is: ring bytes, process, descriptor, host id.
struct Locator {
    cap: usize,
    pid: u32,
    fd: i32,
    host: String,
}

impl Record {
    fn encode(&self) -> String {
        let strict = u8::from(self.strict);
        match &self.seg {
            None => format!("{strict} off"),
            Some(Locator { cap, pid, fd, host }) => {
                format!("{strict} shm {cap} {pid} {fd} {host}")
            }
        }
    }

    fn decode(b: &[u8]) -> Option<Record> {
        let s = std::str::from_utf8(b).ok()?;
        let mut it = s.split(' ');
        let strict = match it.next()? {
            "0" => false,
            "1" => true,
            _ => return None,
        };
        let seg = match it.next()? {
            "off" => None,
            "shm" => Some(Locator {
                cap: it.next()?.parse().ok()?,
                pid: it.next()?.parse().ok()?,
                fd: it.next()?.parse().ok()?,
                host: it.next()?.to_string(),
            }),
            _ => return None,
        };
        Some(Record { strict, seg })
    }
}

/// How one rank takes part in choosing shared memory.
#[derive(Clone, Debug)]
pub(crate) struct ShmOptions {
    pub(crate) mode: TransportMode,
    /// Overrides [`host_id`] (tests that play several hosts in one process).
    pub(crate) host_id: Option<String>,
    pub(crate) ring_bytes: usize,
}

/// What [`negotiate`] settled.
#[derive(Debug)]
pub(crate) struct Negotiated {
    /// Per peer, its rings, or `None` for TCP.
    pub(crate) rings: Vec<Option<Rings>>,
    /// Every rank of the group published a segment on one host. Every rank computes it from
    /// the same records, so all agree (even where one pair could not open the other's segment
    /// and uses TCP); algorithm settings may depend on it.
    pub(crate) one_host: bool,
    /// Some two ranks of the group published segments with one host id, so some pairs may
    /// talk through rings. Every rank computes it from the same records, like `one_host`.
    pub(crate) rings_in_group: bool,
    /// Rank 0's group area, mapped, when every pair of the group talks through rings (every
    /// rank computes that from the same records, so all have an area or none has).
    pub(crate) group_area: Option<GroupArea>,
}

/// Decides, with every peer, which pairs use rings, and sets them up. Every rank of the group
/// must call it (in two store rounds under `prefix`): a rank that fails still publishes both
/// rounds first, so that its peers fail by naming it rather than by waiting for the store.
pub(crate) fn negotiate(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    world: usize,
    o: &ShmOptions,
    deadline: Instant,
) -> Result<Negotiated> {
    let mut out: Vec<Option<Rings>> = (0..world).map(|_| None).collect();
    if world == 1 {
        return Ok(Negotiated {
            rings: out,
            one_host: true,
            rings_in_group: false,
            group_area: None,
        });
    }
    let shm = o.mode == TransportMode::Shm;
    // This rank's own failure, reported after the rounds.
    let mut own_err: Option<Error> = None;
    let mut seg = None;
    let mut host = String::new();
    if o.mode != TransportMode::Tcp {
        let made = o
            .host_id
            .as_ref()
            // Whitespace would split the published record (as `host_id` strips it too).
            .map(|h| h.replace(char::is_whitespace, ""))
            .map_or_else(host_id, Ok)
            .map_err(|e| (e, "reading the host id from /proc"))
            .and_then(|h| {
                ring_capacity(o.ring_bytes)
                    .and_then(|cap| Segment::create(world, cap))
                    .map(|s| (h, s))
                    .map_err(|e| (e, "creating a shared-memory segment (memfd)"))
            });
        match made {
            Ok((h, s)) => {
                host = h;
                seg = Some(s);
            }
            Err((source, what)) if shm => {
                own_err = Some(Error::Io {
                    rank,
                    context: format!("DIST_GLOO_TRANSPORT=shm: {what}"),
                    source,
                });
            }
            Err((e, what)) => {
                tracing::debug!(rank, error = %e, "{what} failed: TCP to every peer");
            }
        }
    }
    let me = Record {
        strict: shm,
        seg: seg
            .as_ref()
            .and_then(|s| s.locator().map(|(pid, fd)| (s.cap(), pid, fd)))
            .map(|(cap, pid, fd)| Locator {
                cap,
                pid,
                fd,
                host: host.clone(),
            }),
    };
    store.set_by(
        &format!("{prefix}/shm/{rank}"),
        me.encode().as_bytes(),
        deadline,
    )?;

    // Round 1: open the segment of every peer on this host; for the others, why not.
    let mut txs: Vec<Option<TxRing>> = (0..world).map(|_| None).collect();
    let mut why_not: Vec<Option<Error>> = (0..world).map(|_| None).collect();
    let mut strict: Vec<bool> = vec![shm; world];
    // Rank 0's group area, which every rank uses when all pairs use rings.
    let mut leader_area = match (rank, seg.as_ref()) {
        (0, Some(s)) => Some(s.group_area(world)),
        _ => None,
    };
    // Judged on the records as every rank reads them (this rank's own decoded as the peers
    // decode it), so that the answer depends on the records alone, not on who reads them.
    let host_of = |r: Option<&Record>| r.and_then(|r| r.seg.as_ref()).map(|l| l.host.clone());
    let own_host = host_of(Record::decode(me.encode().as_bytes()).as_ref());
    let mut one_host = own_host.is_some();
    let mut hosts: Vec<String> = own_host.iter().cloned().collect();
    for peer in (0..world).filter(|&p| p != rank) {
        let raw = store.get_by(&format!("{prefix}/shm/{peer}"), deadline)?;
        let theirs = Record::decode(&raw);
        let their_host = host_of(theirs.as_ref());
        one_host &= their_host == own_host;
        hosts.extend(their_host);
        let unsupported = |what: String| {
            let who = match &theirs {
                Some(t) if t.strict && !shm => format!("rank {peer} asked for"),
                _ => "this rank asked for".to_string(),
            };
            Error::Unsupported {
                rank,
                backend: "gloo",
                what: format!(
                    "shared memory with rank {peer} ({who} DIST_GLOO_TRANSPORT=shm): {what}"
                ),
            }
        };
        strict[peer] |= theirs.as_ref().is_some_and(|t| t.strict);
        why_not[peer] = match (&me.seg, theirs.as_ref().map(|t| &t.seg)) {
            (_, None) => Some(unsupported(format!(
                "it published an unreadable record {:?}",
                String::from_utf8_lossy(&raw)
            ))),
            (None, _) => Some(unsupported(
                "this rank takes no part in shared memory (DIST_GLOO_TRANSPORT=tcp, or it could not make its segment)".into(),
            )),
            (_, Some(None)) => Some(unsupported(
                "it takes no part in shared memory (DIST_GLOO_TRANSPORT=tcp, or it could not make its segment)".into(),
            )),
            (_, Some(Some(Locator { host: h, .. }))) if *h != host => Some(unsupported(format!(
                "it runs on another host or in other namespaces (host id {h}, this rank's {host})"
            ))),
            (_, Some(Some(Locator { cap, pid, fd, .. }))) => {
                match segment::open_peer(*pid, *fd, world, *cap, rank) {
                    Ok(tx) => {
                        if peer == 0 {
                            leader_area = Some(segment::group_area(tx.mapping(), world, *cap));
                        }
                        txs[peer] = Some(tx);
                        None
                    }
                    Err(source) => Some(Error::Io {
                        rank,
                        context: format!(
                            "opening rank {peer}'s shared-memory segment /proc/{pid}/fd/{fd}"
                        ),
                        source,
                    }),
                }
            }
        };
    }

    // Round 2: a pair uses rings only when both of its ranks opened the other's segment.
    let can: String = (0..world)
        .map(|p| if txs[p].is_some() { '1' } else { '0' })
        .collect();
    store.set_by(&format!("{prefix}/shm-ok/{rank}"), can.as_bytes(), deadline)?;
    // Every rank opened every other's segment: all pairs use rings (read from the records
    // alone, so every rank reaches the same answer).
    let opened_all = |r: usize, record: &[u8]| {
        record.len() == world && record.iter().enumerate().all(|(p, &c)| p == r || c == b'1')
    };
    let mut all_rings = opened_all(rank, can.as_bytes());
    for peer in (0..world).filter(|&p| p != rank) {
        let theirs = store.get_by(&format!("{prefix}/shm-ok/{peer}"), deadline)?;
        all_rings &= opened_all(peer, &theirs);
        let both = txs[peer].is_some() && theirs.get(rank) == Some(&b'1');
        if both && let (Some(seg), Some(tx)) = (seg.as_ref(), txs[peer].take()) {
            let rx = seg.rx_from(peer).map_err(|source| Error::Io {
                rank,
                context: format!("mapping the ring from rank {peer}"),
                source,
            })?;
            out[peer] = Some(Rings { rx, tx });
        } else if strict[peer] && own_err.is_none() {
            // Both sides of the pair know that one of them is strict and that not both opened
            // the other's segment, so both fail, each naming the other.
            own_err = Some(why_not[peer].take().unwrap_or_else(|| Error::Unsupported {
                rank,
                backend: "gloo",
                what: format!(
                    "shared memory with rank {peer} (DIST_GLOO_TRANSPORT=shm): it could not open this rank's segment (its error says why)"
                ),
            }));
        }
    }
    // Every peer has opened its own descriptor of the segment by now (it published round 2
    // after round 1); the mappings keep the memory.
    if let Some(s) = seg.as_mut() {
        s.close_fd();
    }
    let group_area = match leader_area.filter(|_| all_rings && own_err.is_none()) {
        Some(area) => Some(area.map_err(|source| Error::Io {
            rank,
            context: "mapping the group area of rank 0's shared-memory segment".into(),
            source,
        })?),
        None => None,
    };
    match own_err {
        Some(e) => Err(e),
        None => Ok(Negotiated {
            group_area,
            rings: out,
            one_host,
            rings_in_group: {
                hosts.sort_unstable();
                hosts.windows(2).any(|w| w[0] == w[1])
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's ring opens at the smallest size asked for (with 64 data bytes, odd ranks'
    /// rings sat off the 128-byte alignment and were refused), and a size past every power of
    /// two is an error, where it panicked (debug) or became 0 (release).
    #[test]
    fn small_and_huge_ring_sizes_give_rings_every_rank_can_open_or_an_error() {
        for asked in [0, 1, 64, 100, 128, 129] {
            let cap = ring_capacity(asked).unwrap();
            assert!(
                cap.is_power_of_two() && cap >= 128 && cap >= asked,
                "{asked}: {cap}"
            );
            let seg = Segment::create(3, cap).unwrap();
            for peer in 0..3 {
                seg.rx_from(peer)
                    .unwrap_or_else(|e| panic!("{asked} bytes, ring of rank {peer}: {e}"));
            }
        }
        let e = ring_capacity(usize::MAX).unwrap_err().to_string();
        assert!(e.contains("DIST_GLOO_SHM_RING_BYTES"), "{e}");
    }
}
