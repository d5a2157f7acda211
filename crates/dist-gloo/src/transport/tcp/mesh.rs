//! Building the full mesh: listen, publish, connect to lower ranks, accept higher ones.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use dist_backend::{Error, Result, Store};
use mio::{Interest, Poll, Token};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::conn::Conn;
use crate::transport::shm::TransportMode;

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"DSTH");

/// How the mesh is built.
#[derive(Clone, Debug)]
pub struct MeshOptions {
    /// Address to listen on and publish; `None` picks one (see [`dist_backend::net::local_ip`]).
    pub ip: Option<IpAddr>,
    /// How long building the mesh may take, from [`TcpTransport::connect`]'s call (the `_by`
    /// forms take the caller's deadline instead), and how long closing it lingers for each
    /// peer to read what it was sent.
    ///
    /// [`TcpTransport::connect`]: super::TcpTransport::connect
    pub timeout: Duration,
    /// Largest frame payload.
    pub segment_bytes: usize,
    /// Busy-poll time before sleeping. Where the whole spin busy-waits (`busy_spin` unset and
    /// resolved so), it is the least: a sleep that ends within a millisecond doubles the next waits' spin, up
    /// to a millisecond, and a longer one halves it again, so that ranks whose wake-ups
    /// take longer than the spin do not take turns waking each other (see `idle.rs`).
    pub spin: Duration,
    /// The first part of `spin` that does not even yield the core; `None` picks the whole of
    /// `spin` when this host's ranks of the group (those reached through shared memory, and
    /// this one) are no more than its CPUs, else zero. Open MPI polls the same way when not
    /// oversubscribed: a yield on a core shared with a busy process hands it over for a whole
    /// time slice (a 1 MiB all_gather on 2 ranks bound to the 2 cores of a loaded host took
    /// 2.7 ms yielding after 2 us, 0.13 ms never yielding), while spinning on a core a peer
    /// needs only delays the peer.
    pub busy_spin: Option<Duration>,
    /// Kernel socket buffer sizes; `None` keeps Linux's autotuning.
    pub socket_buffer: Option<usize>,
    /// The TCP congestion control of connections that never leave this host (both ends on one
    /// address: ranks of one host joined over TCP, as with `DIST_GLOO_TRANSPORT=tcp` or
    /// cross-memory attach refused). `None`, the default, sets reno (which every user may)
    /// where the kernel takes it, and keeps the system's where it does not (a sandbox without
    /// the option): that is only slower. `Some(name)` insists on `name`, and the mesh fails
    /// naming it if the kernel refuses; `Some("")` keeps the system's, as connections between
    /// hosts always do. Why: a pacing one such as BBR
    /// spaces a stream for a bottleneck that loopback does not have, and its pacing timer
    /// cannot send while a long write holds the socket, so the data arrives in bursts with
    /// the receiver asleep between them. 2 ranks over TCP only, gloo_bench, 5 runs alternated
    /// against the host's BBR (us): broadcast 4 MiB 646 against 806, 16 MiB 2701 against 3841;
    /// all_to_all 4 MiB 468 against 863, 16 MiB 3212 against 4652 (cubic read the same as
    /// reno).
    pub same_host_congestion: Option<String>,
    /// Copy large collective messages between ranks on one host straight out of the sender's
    /// memory (Linux cross-memory attach) instead of through TCP, where the ranks can read
    /// each other (probed when the mesh is built).
    pub cross_memory: bool,
    /// Smallest message sent that way. `None` picks 256 KiB (below, the acknowledgement's
    /// round trip costs more than the copy saved), and 64 KiB for all_to_all between ranks
    /// joined by shared-memory rings when this host's ranks outnumber its CPUs and
    /// `cross_memory_over_rings` is unset (its messages are all in flight at once, and every
    /// copy saved gives a core back to a rank that shares it).
    pub cross_memory_min_bytes: Option<usize>,
    /// Whether large messages to a peer reached through shared-memory rings go that way too
    /// (broadcast and scatter only where receivers split their copies, see
    /// [`MeshOptions::copy_helper`]). `None` decides by whether this host's ranks of the
    /// group outnumber its CPUs: the rings' two copies run at once on two cores and beat one
    /// copy by reference, unless the ranks must share cores (even there reduce_scatter's
    /// messages stay on the rings); where they do not, the large messages of all_gather,
    /// all_to_all, reduce_scatter and all_reduce (of buffers up to 32 MiB) still go by
    /// reference when their bytes lie wholly in huge pages, which the kernel pins cheaply (see
    /// `by_reference` for the sizes).
    pub cross_memory_over_rings: Option<bool>,
    /// Whether a second thread per rank reads half of each large message received by
    /// reference (from 256 KiB a frame), so that two cores copy it. `None` starts it where
    /// this host has at least two CPUs per rank of the group it can read: one core's copy does
    /// not reach some machines' memory bandwidth (a lent 16-core VM: 64 MiB in 9.6 ms by one
    /// thread, 4.0-4.5 by two), and while a broadcast's root waits its core is free. Only
    /// broadcast's, scatter's and gather's frames are split (their senders only wait), and
    /// there those ops send their large messages by reference over shared-memory rings too
    /// (see `by_reference`).
    pub copy_helper: Option<bool>,
    /// Whether large messages (from two ring-fulls) to a peer that is reached through
    /// shared-memory rings and can read this rank's memory go the way their pace to that
    /// peer has shown faster, rings or by reference, each rank learning from its own sends
    /// (`path_pace`); only where `cross_memory_over_rings` is unset and this host's ranks of
    /// the group fit its CPUs. On by default: a virtual machine's vCPUs move near and far
    /// apart, and far apart the rings slow 7-14x where a copy by reference slows at most 1.1x
    /// from 16 MiB.
    pub adaptive_path: bool,
    /// Shared-memory rings between ranks on one host, TCP between hosts, or one of the two
    /// for every pair (see [`crate::transport::shm`]).
    pub transport: TransportMode,
    /// Data bytes of each shared-memory ring (rounded up to a power of two).
    pub shm_ring_bytes: usize,
    /// Overrides the host id that decides which ranks share memory
    /// ([`crate::transport::shm::host_id`]); for tests that play several hosts in one
    /// process. Ranks with different ids never use shared memory between them.
    pub host_id: Option<String>,
    /// An unreadable `DIST_GLOO_TRANSPORT` seen by `GlooOptions::from_env`, reported when
    /// the mesh is built.
    pub(crate) transport_error: Option<String>,
}

impl Default for MeshOptions {
    fn default() -> Self {
        MeshOptions {
            ip: None,
            timeout: Duration::from_secs(300),
            segment_bytes: crate::transport::DEFAULT_SEGMENT_BYTES,
            spin: Duration::from_micros(50),
            busy_spin: None,
            socket_buffer: None,
            same_host_congestion: None,
            cross_memory: true,
            cross_memory_min_bytes: None,
            cross_memory_over_rings: None,
            copy_helper: None,
            adaptive_path: true,
            transport: TransportMode::Auto,
            shm_ring_bytes: crate::transport::shm::DEFAULT_RING_BYTES,
            host_id: None,
            transport_error: None,
        }
    }
}

fn io(rank: usize, context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io {
        rank,
        context,
        source,
    }
}

fn tune(s: &TcpStream, opts: &MeshOptions, rank: usize) -> Result<()> {
    s.set_nodelay(true)
        .map_err(io(rank, "setting TCP_NODELAY".into()))?;
    if stays_on_host(s) {
        let sock = socket2::SockRef::from(s);
        match opts.same_host_congestion.as_deref() {
            // Best effort: where the kernel refuses, the system's control only paces.
            None => drop(sock.set_tcp_congestion(b"reno")),
            Some("") => {}
            Some(cc) => sock.set_tcp_congestion(cc.as_bytes()).map_err(io(
                rank,
                format!("setting TCP congestion control {cc:?} (DIST_GLOO_SAME_HOST_CONGESTION)"),
            ))?,
        }
    }
    if let Some(b) = opts.socket_buffer {
        let sock = socket2::SockRef::from(s);
        sock.set_send_buffer_size(b)
            .map_err(io(rank, "setting SO_SNDBUF".into()))?;
        sock.set_recv_buffer_size(b)
            .map_err(io(rank, "setting SO_RCVBUF".into()))?;
    }
    Ok(())
}

/// Whether `s` never leaves this host: its two ends share an address, or it is on loopback.
fn stays_on_host(s: &TcpStream) -> bool {
    matches!(
        (s.local_addr(), s.peer_addr()),
        (Ok(a), Ok(b)) if a.ip() == b.ip() || b.ip().is_loopback()
    )
}

fn hello(group: u32, rank: usize) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&group.to_le_bytes());
    b[8..].copy_from_slice(&(rank as u32).to_le_bytes());
    b
}

/// 32-bit FNV-1a of the group's store prefix: the group id in every frame header.
pub(crate) fn group_id(prefix: &str) -> u32 {
    prefix.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

pub(super) fn build(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    world: usize,
    opts: &MeshOptions,
    deadline: Instant,
) -> Result<(Poll, Vec<Option<Conn>>)> {
    let poll = Poll::new().map_err(io(rank, "creating the poller".into()))?;
    let mut conns: Vec<Option<Conn>> = (0..world).map(|_| None).collect();
    if world == 1 {
        return Ok((poll, conns));
    }
    let group = group_id(prefix);
    let ip = match opts.ip {
        Some(ip) => ip,
        None => dist_backend::net::local_ip(rank)?,
    };
    let listener = listen(ip, world, rank)?;
    let addr = listener
        .local_addr()
        .map_err(io(rank, "reading the listener's address".into()))?;
    store.set_by(
        &format!("{prefix}/addr/{rank}"),
        addr.to_string().as_bytes(),
        deadline,
    )?;

    // Accept the higher ranks on a helper thread while connecting to the lower ones here.
    let expected = world - 1 - rank;
    let acceptor = thread::Builder::new()
        .name(format!("dist-gloo-accept-{rank}"))
        .spawn(move || accept_all(listener, expected, group, world, rank, deadline))
        .map_err(io(rank, "spawning the accept thread".into()))?;

    let mut streams: Vec<(usize, TcpStream)> = Vec::new();
    let mut first_err = None;
    for peer in 0..rank {
        match connect_to(store, prefix, peer, group, rank, deadline) {
            Ok(s) => streams.push((peer, s)),
            Err(e) => {
                first_err = Some(e);
                break;
            }
        }
    }
    let accepted = acceptor.join().unwrap_or_else(|_| {
        Err(Error::invalid(
            rank,
            "connect",
            "the accept thread panicked",
        ))
    });
    if let Some(e) = first_err {
        return Err(e);
    }
    streams.extend(accepted?);
    for (peer, s) in streams {
        tune(&s, opts, rank)?;
        s.set_nonblocking(true).map_err(io(
            rank,
            format!("making the connection to rank {peer} non-blocking"),
        ))?;
        let mut ms = mio::net::TcpStream::from_std(s);
        poll.registry()
            .register(
                &mut ms,
                Token(peer),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(io(
                rank,
                format!("registering the connection to rank {peer}"),
            ))?;
        conns[peer] = Some(Conn::new(ms));
    }
    Ok((poll, conns))
}

fn listen(ip: IpAddr, world: usize, rank: usize) -> Result<TcpListener> {
    let addr = SocketAddr::new(ip, 0);
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(io(rank, format!("creating a socket for {addr}")))?;
    sock.set_reuse_address(true)
        .map_err(io(rank, "setting SO_REUSEADDR".into()))?;
    sock.bind(&SockAddr::from(addr))
        .map_err(io(rank, format!("binding {addr}")))?;
    sock.listen(world.clamp(16, 4096) as i32)
        .map_err(io(rank, format!("listening on {addr}")))?;
    Ok(sock.into())
}

/// A connection accepted whose 12-byte hello has not all arrived yet.
struct Unnamed {
    stream: TcpStream,
    from: SocketAddr,
    hello: [u8; 12],
    got: usize,
}

/// What reading an [`Unnamed`] connection's hello came to.
enum Hello {
    /// Whole: the peer rank it names, if the hello is this group's and names a rank still
    /// expected.
    Whole(Option<usize>),
    /// Not all here yet.
    Partial,
    /// The connection closed or failed before its hello was whole.
    Gone,
}

impl Unnamed {
    /// Reads what has arrived of the hello without blocking.
    fn read(
        &mut self,
        group: u32,
        world: usize,
        rank: usize,
        named: &[(usize, TcpStream)],
    ) -> Hello {
        while self.got < self.hello.len() {
            match self.stream.read(&mut self.hello[self.got..]) {
                Ok(0) => return Hello::Gone,
                Ok(k) => self.got += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Hello::Partial,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Hello::Gone,
            }
        }
        let b = &self.hello;
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let their_group = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let peer = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
        let fits = magic == HELLO_MAGIC
            && their_group == group
            && peer > rank
            && peer < world
            && !named.iter().any(|(p, _)| *p == peer);
        Hello::Whole(fits.then_some(peer))
    }
}

/// Accepts the `expected` higher ranks' connections, each named by the hello it sends first.
/// Hellos are read without blocking, beside the accepting: a connection that sends nothing (a
/// port scanner, a health probe, a client of an earlier job) waited in a blocking read for the
/// whole deadline while the ranks queued behind it, and the mesh failed naming them.
fn accept_all(
    listener: TcpListener,
    expected: usize,
    group: u32,
    world: usize,
    rank: usize,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut out: Vec<(usize, TcpStream)> = Vec::with_capacity(expected);
    let mut unnamed: Vec<Unnamed> = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(io(rank, "making the listener non-blocking".into()))?;
    while out.len() < expected {
        let mut moved = false;
        match listener.accept() {
            Ok((stream, from)) => {
                stream
                    .set_nonblocking(true)
                    .map_err(io(rank, "configuring an accepted connection".into()))?;
                unnamed.push(Unnamed {
                    stream,
                    from,
                    hello: [0; 12],
                    got: 0,
                });
                moved = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                return Err(Error::Io {
                    rank,
                    context: "accepting peer connections".into(),
                    source: e,
                });
            }
        }
        let mut i = 0;
        while i < unnamed.len() {
            let before = unnamed[i].got;
            let hello = unnamed[i].read(group, world, rank, &out);
            moved |= unnamed[i].got != before;
            match hello {
                Hello::Partial => i += 1,
                Hello::Gone => {
                    let u = unnamed.swap_remove(i);
                    tracing::warn!(rank, from = %u.from, "dropping a connection that sent no hello");
                }
                Hello::Whole(None) => {
                    let u = unnamed.swap_remove(i);
                    tracing::warn!(rank, from = %u.from, "dropping a connection with a bad hello");
                }
                Hello::Whole(Some(peer)) => {
                    let u = unnamed.swap_remove(i);
                    u.stream
                        .set_nonblocking(false)
                        .map_err(io(rank, "configuring an accepted connection".into()))?;
                    out.push((peer, u.stream));
                }
            }
        }
        if out.len() == expected || moved {
            continue;
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (rank + 1..world)
                .filter(|p| !out.iter().any(|(q, _)| q == p))
                .collect();
            return Err(Error::Io {
                rank,
                context: format!(
                    "building the connection mesh: rank(s) {missing:?} did not connect in time"
                ),
                source: std::io::ErrorKind::TimedOut.into(),
            });
        }
        thread::sleep(Duration::from_millis(1));
    }
    Ok(out)
}

fn connect_to(
    store: &dyn Store,
    prefix: &str,
    peer: usize,
    group: u32,
    rank: usize,
    deadline: Instant,
) -> Result<TcpStream> {
    // The lookup is bounded by the mesh's deadline, not the store's own timeout, which may be
    // longer (a user's store) or have begun earlier.
    let key = format!("{prefix}/addr/{peer}");
    let raw = store.get_by(&key, deadline)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let addr: SocketAddr = text.parse().map_err(|_| Error::Init {
        what: format!(
            "rank {peer} published an unreadable address {text:?} under {prefix}/addr/{peer}"
        ),
    })?;
    let mut delay = Duration::from_millis(1);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(mut s) => {
                s.write_all(&hello(group, rank))
                    .map_err(io(rank, format!("greeting rank {peer} at {addr}")))?;
                return Ok(s);
            }
            Err(e) if dist_backend::deadline_after(Instant::now(), delay) < deadline => {
                tracing::debug!(rank, peer, %addr, error = %e, "connect failed, retrying");
                thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(Error::Io {
                    rank,
                    context: format!("connecting to rank {peer} at {addr}"),
                    source: e,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn congestion(s: &TcpStream) -> Vec<u8> {
        let mut cc = socket2::SockRef::from(s).tcp_congestion().unwrap();
        cc.retain(|&c| c != 0);
        cc
    }

    /// Connections that say nothing, say half a hello, send a wrong one or hang up come first;
    /// the ranks (one sending its hello in two writes) are accepted all the same, long before
    /// the deadline. Before, the first silent connection held the accepting thread in a
    /// blocking read until the deadline.
    #[test]
    fn strangers_that_connect_first_do_not_hold_up_the_ranks() {
        use std::io::Write;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let group = group_id("g");
        let started = Instant::now();
        let deadline = started + Duration::from_secs(120);
        let acceptor = thread::spawn(move || accept_all(l, 2, group, 3, 0, deadline));
        let silent = TcpStream::connect(at).unwrap();
        let mut half = TcpStream::connect(at).unwrap();
        half.write_all(&hello(group, 1)[..5]).unwrap();
        let mut wrong = TcpStream::connect(at).unwrap();
        wrong.write_all(&hello(group ^ 1, 1)).unwrap();
        drop(TcpStream::connect(at).unwrap());
        let mut one = TcpStream::connect(at).unwrap();
        one.write_all(&hello(group, 1)[..7]).unwrap();
        let mut two = TcpStream::connect(at).unwrap();
        two.write_all(&hello(group, 2)).unwrap();
        one.write_all(&hello(group, 1)[7..]).unwrap();
        let mut peers: Vec<usize> = acceptor
            .join()
            .unwrap()
            .unwrap()
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        peers.sort_unstable();
        assert_eq!(peers, [1, 2]);
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "accepting took {:?}",
            started.elapsed()
        );
        drop((silent, half, wrong));
    }

    #[test]
    fn a_connection_within_the_host_takes_the_same_host_congestion_control_and_a_refused_one_is_named()
     {
        let (a, b) = loopback_pair();
        assert!(stays_on_host(&a) && stays_on_host(&b));
        if socket2::SockRef::from(&a).tcp_congestion().is_err() {
            eprintln!("skipped: this kernel does not report TCP_CONGESTION");
            return;
        }
        let system = congestion(&a);
        let keep = MeshOptions {
            same_host_congestion: Some(String::new()),
            ..MeshOptions::default()
        };
        tune(&a, &keep, 0).unwrap();
        assert_eq!(congestion(&a), system);
        tune(&b, &MeshOptions::default(), 1).unwrap();
        assert_eq!(congestion(&b), b"reno");
        let bogus = MeshOptions {
            same_host_congestion: Some("no-such-control".into()),
            ..MeshOptions::default()
        };
        let e = tune(&a, &bogus, 0).unwrap_err().to_string();
        assert!(
            e.contains("rank 0") && e.contains("DIST_GLOO_SAME_HOST_CONGESTION"),
            "{e}"
        );
    }
}
