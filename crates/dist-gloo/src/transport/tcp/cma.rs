//! Single-copy transfers between ranks on one host, through Linux cross-memory attach
//! (`process_vm_readv`).
//!
//! Over loopback TCP every byte is copied twice (into the sender's socket buffer, out of the
//! receiver's) and the kernel's networking path runs for each segment; with several ranks on
//! few cores those copies are most of a collective's time. For large messages between ranks
//! that can read each other's memory, the TCP connection carries only headers and
//! [`PayloadRef`]s and the receiver copies the data straight out of the sender's buffer, the
//! one copy Open MPI's shared-memory transport makes with CMA.
//!
//! Safety of the protocol, which the sender's buffer depends on:
//! * the sender keeps the buffer borrowed until the receiver acknowledges the whole message
//!   (an `ACK` frame), so a successful step never leaves a reader behind;
//! * while a step offers buffers to a peer, the sender publishes the step's offer id in a
//!   word the peer reads *after* copying; the sender withdraws it (stores 0) before the step
//!   returns, on success and on error, so a copy that raced with a sender that gave up (a
//!   timeout) sees the withdrawal and fails instead of using stale bytes.
//!
//! Where the host has spare cores, a helper thread reads half of each large frame of a
//! broadcast, scatter or gather (`read_helper`); the offer word is checked once both halves
//! are in.
//!
//! Where the kernel's own copy would run slow, at some distances between the two buffers'
//! offsets within their pages, a read goes through a bounce buffer instead (see
//! `kernel_copy_slow`).
//!
//! Which peers can be read is decided by experiment when the mesh is built: each rank
//! publishes its pid and the address of a random token, every rank tries to read every
//! peer's token and publishes what it managed. Ranks on other hosts, in other pid namespaces,
//! or under a ptrace policy that forbids it simply fail the probe and keep plain TCP.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::Instant;

use dist_backend::{Result, Store};
use dist_wire::{CollectiveOp, PayloadRef};

use super::read_helper::{ReadHelper, SPLIT_MIN_BYTES};
use crate::proto::CopyIn;
use crate::transport::LentWords;

/// Where to read one peer's memory.
#[derive(Clone, Copy, Debug)]
struct Source {
    pid: i32,
    /// Address, in the peer's memory, of the offer word the peer publishes for this rank.
    offer_word: u64,
}

/// Cross-memory-attach state of one rank's mesh.
#[derive(Debug)]
pub(super) struct Cma {
    /// Per peer: how to read its memory, when this rank can.
    sources: Vec<Option<Source>>,
    /// Per peer: whether it can read this rank's memory (so large messages to it go by
    /// reference).
    readers: Vec<bool>,
    /// Per peer: the offer this rank currently publishes to it, 0 for none. Peers read these
    /// words from their own processes, so they never move (one allocation) and are only
    /// written atomically.
    offers: Arc<[AtomicU64]>,
    /// The probe token peers read when the mesh is built; kept alive with the mesh.
    _probe: Box<u64>,
    /// This rank, to name the helper thread.
    rank: usize,
    /// Large frames are read half by a helper thread ([`Cma::split_reads`]).
    split: bool,
    /// That thread, started at the first split read (`None` inside if it could not start).
    helper: OnceLock<Option<ReadHelper>>,
    /// Frames read half by the helper so far.
    splits: AtomicU64,
}

impl Cma {
    /// Finds out which peers can read each other's memory. Every rank must call it (with
    /// `enabled` false it still publishes that it takes no part). Also returns whether some
    /// rank of the group can read another's memory, which every rank reads from the same
    /// published records.
    pub(super) fn negotiate(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world: usize,
        enabled: bool,
        deadline: Instant,
    ) -> Result<(Option<Cma>, bool)> {
        let enabled = enabled && cfg!(target_os = "linux") && world > 1;
        let offers: Arc<[AtomicU64]> = (0..world).map(|_| AtomicU64::new(0)).collect();
        let probe = Box::new(random_token());
        let me = if enabled {
            format!(
                "{} {} {} {}",
                std::process::id(),
                offers.as_ptr() as u64,
                std::ptr::from_ref::<u64>(&probe) as u64,
                *probe
            )
        } else {
            "off".to_string()
        };
        store.set_by(&format!("{prefix}/cma/{rank}"), me.as_bytes(), deadline)?;
        let mut sources = vec![None; world];
        for (peer, source) in sources.iter_mut().enumerate() {
            if peer == rank {
                continue;
            }
            let theirs = store.get_by(&format!("{prefix}/cma/{peer}"), deadline)?;
            if enabled && let Some((src, probe_addr, token)) = parse(&theirs, rank) {
                let mut got = [0u8; 8];
                if read_remote(src.pid, probe_addr, &mut got).is_ok()
                    && u64::from_le_bytes(got) == token
                {
                    *source = Some(src);
                }
            }
        }
        let can: String = sources
            .iter()
            .map(|s| if s.is_some() { '1' } else { '0' })
            .collect();
        store.set_by(&format!("{prefix}/cma-ok/{rank}"), can.as_bytes(), deadline)?;
        let mut readers = vec![false; world];
        let mut in_group = can.contains('1');
        for (peer, reader) in readers.iter_mut().enumerate() {
            if peer != rank {
                let theirs = store.get_by(&format!("{prefix}/cma-ok/{peer}"), deadline)?;
                *reader = theirs.get(rank) == Some(&b'1');
                in_group |= theirs.contains(&b'1');
            }
        }
        if !enabled || (sources.iter().all(Option::is_none) && !readers.contains(&true)) {
            return Ok((None, in_group));
        }
        tracing::debug!(rank, readable = %can, "cross-memory attach negotiated");
        Ok((
            Some(Cma {
                sources,
                readers,
                offers,
                _probe: probe,
                rank,
                split: false,
                helper: OnceLock::new(),
                splits: AtomicU64::new(0),
            }),
            in_group,
        ))
    }

    /// Has a helper thread read the second half of every frame from
    /// [`SPLIT_MIN_BYTES`] this rank copies by reference, while this rank's thread reads the
    /// first (see `read_helper`).
    pub(super) fn split_reads(mut self, on: bool) -> Self {
        self.split = on;
        self
    }

    /// The peers whose memory this rank can read (this rank excluded).
    pub(super) fn readable_peers(&self) -> usize {
        self.sources.iter().flatten().count()
    }

    /// Whether large frames are read half by a helper thread.
    pub(super) fn split_copies_on(&self) -> bool {
        self.split
    }

    /// Frames read half by the helper thread so far.
    pub(super) fn split_copies(&self) -> u64 {
        self.splits.load(Ordering::Relaxed)
    }

    /// The helper thread, started on first use; `None` when reads are not split or it could
    /// not start (then each frame is read by this thread alone).
    fn helper(&self) -> Option<&ReadHelper> {
        if !self.split {
            return None;
        }
        self.helper
            .get_or_init(|| {
                ReadHelper::spawn(self.rank, read_remote)
                    .inspect_err(|e| {
                        tracing::warn!(rank = self.rank, error = %e, "no copy helper thread; copies stay whole");
                    })
                    .ok()
            })
            .as_ref()
    }

    /// Whether `peer` can read this rank's memory, so that messages to it may go by reference
    /// (which ones do is `SingleCopyRule::pays`).
    pub(super) fn peer_reads(&self, peer: usize) -> bool {
        self.readers.get(peer).copied().unwrap_or(false)
    }

    /// The offer id of a new step: unique in this process (across meshes too, and starting
    /// from a random value), so a stale reference can never match a later offer, even one
    /// published by a mesh that reuses a dropped mesh's memory.
    pub(super) fn next_step_offer() -> u64 {
        static NEXT: OnceLock<AtomicU64> = OnceLock::new();
        NEXT.get_or_init(|| AtomicU64::new(random_token()))
            .fetch_add(1, Ordering::Relaxed)
            .max(1)
    }

    /// Publishes `offer` to `peer`: its reads of this rank's buffers are valid until
    /// the step's [`Cma::withdrawal`] guard drops.
    pub(super) fn publish(&self, peer: usize, offer: u64) {
        if let Some(w) = self.offers.get(peer) {
            w.store(offer, Ordering::SeqCst);
        }
    }

    /// A guard that withdraws every offer when dropped: held for the whole of a step, so no
    /// peer can use bytes this rank's caller may overwrite next, whether the step returns or
    /// unwinds.
    pub(super) fn withdrawal(&self) -> Withdrawal {
        Withdrawal(self.offers.clone())
    }

    /// Lends `bytes` to every peer at once: publishes one new offer to each and returns what
    /// a peer needs to read them ([`LentWords`], to be published in the group area) with the
    /// guard that withdraws the offer. `None` unless every peer can read this rank's memory.
    pub(super) fn lend(&self, bytes: &[u8]) -> Option<(LentWords, Withdrawal)> {
        let all_read = (0..self.readers.len()).all(|p| p == self.rank || self.readers[p]);
        if !all_read {
            return None;
        }
        // The guard first: an offer is never published without one that withdraws it.
        let guard = self.withdrawal();
        let offer = Self::next_step_offer();
        for peer in (0..self.offers.len()).filter(|&p| p != self.rank) {
            self.publish(peer, offer);
        }
        Some((
            LentWords {
                addr: bytes.as_ptr() as u64,
                len: bytes.len() as u64,
                offer,
            },
            guard,
        ))
    }

    /// Copies bytes `at..at + dst.len()` of what `peer` lent ([`Cma::lend`]) into `dst`, then
    /// checks the offer still stands. The words come from another process: a range outside
    /// what they say was lent is refused, and a wrong address can only fail the read or read
    /// the peer's own memory, never this rank's. The error says why, for a `PeerLost`.
    pub(super) fn read_lent(
        &self,
        peer: usize,
        lent: LentWords,
        at: usize,
        dst: &mut [u8],
    ) -> std::result::Result<(), String> {
        let within = (at as u64)
            .checked_add(dst.len() as u64)
            .is_some_and(|end| end <= lent.len);
        if !within {
            return Err(format!(
                "this rank asked for bytes {at}..{} of the {} it lent",
                at + dst.len(),
                lent.len
            ));
        }
        if dst.is_empty() {
            return Ok(());
        }
        let Some(Some(src)) = self.sources.get(peer) else {
            return Err("it lent a buffer by reference, which this rank cannot read".into());
        };
        let now = read_remote_then_word(
            src.pid,
            lent.addr.wrapping_add(at as u64),
            dst,
            src.offer_word,
        )
        .map_err(|e| {
            format!(
                "copying {} bytes of what it lent and then its offer word: {e}",
                dst.len()
            )
        })?;
        if now != lent.offer {
            return Err(format!(
                "it withdrew its offer {} (now {now}) while this rank copied it: it gave up on the operation",
                lent.offer
            ));
        }
        Ok(())
    }
}

/// The engine keeps the mesh's `Cma` for its offers while the core copies through it.
impl CopyIn for Arc<Cma> {
    /// Copies a frame `peer` offered by reference into `dst`, then checks the offer still
    /// stands. The error says why, for a `PeerLost`.
    fn copy_in(
        &self,
        peer: usize,
        op: CollectiveOp,
        at: PayloadRef,
        dst: &mut [u8],
    ) -> std::result::Result<(), String> {
        let Some(Some(src)) = self.sources.get(peer) else {
            return Err("it offered a buffer by reference, which this rank cannot read".into());
        };
        // Asked only for frames it would take, so that a mesh that copies none never starts it.
        let helper = (dst.len() >= SPLIT_MIN_BYTES && splits(op))
            .then(|| self.helper())
            .flatten();
        let now = match helper {
            Some(h) => {
                self.splits.fetch_add(1, Ordering::Relaxed);
                h.read(src.pid, at.addr, dst)
                    .map_err(|e| format!("copying {} bytes out of its memory: {e}", dst.len()))?;
                // The offer word must be read after the data (the syscalls already order
                // them; this states it for weakly ordered CPUs).
                fence(Ordering::Acquire);
                let mut word = [0u8; 8];
                read_remote(src.pid, src.offer_word, &mut word)
                    .map_err(|e| format!("reading its offer word: {e}"))?;
                u64::from_le_bytes(word)
            }
            None => read_remote_then_word(src.pid, at.addr, dst, src.offer_word).map_err(|e| {
                format!(
                    "copying {} bytes and then its offer word out of its memory: {e}",
                    dst.len()
                )
            })?,
        };
        if now != at.offer {
            return Err(format!(
                "it withdrew its offer {} (now {now}) while this rank copied it: it gave up on the operation",
                at.offer
            ));
        }
        Ok(())
    }
}

/// Whether large frames of `op` are read half by the helper thread: those of broadcast,
/// scatter and gather, whose senders only wait while the receiver copies. In all_gather and
/// all_to_all
/// every rank copies at once and a second thread each only adds contention (a lent 16-core
/// VM, 4 ranks, all_gather of 4 MiB by reference: 3.0-3.4 ms with one thread, 5.4-6.4 with
/// two).
fn splits(op: CollectiveOp) -> bool {
    matches!(
        op,
        CollectiveOp::Broadcast | CollectiveOp::Scatter | CollectiveOp::Gather
    )
}

/// Withdraws every offer of a mesh when dropped (see [`Cma::withdrawal`]).
pub(super) struct Withdrawal(Arc<[AtomicU64]>);

impl Drop for Withdrawal {
    fn drop(&mut self) {
        for w in &*self.0 {
            if w.load(Ordering::Relaxed) != 0 {
                w.store(0, Ordering::SeqCst);
            }
        }
        // Nothing the caller writes into its buffers next may become visible before the
        // withdrawal does.
        fence(Ordering::SeqCst);
    }
}

/// Whether this process may read its own memory through cross-memory attach: false where the
/// OS or a sandbox (seccomp) forbids the system call. Ranks that are threads of one process
/// use single-copy transfers exactly when this holds; between processes the mesh's probe also
/// needs the ptrace policy to allow it.
pub fn cross_memory_available() -> bool {
    let token = random_token();
    let mut got = [0u8; 8];
    read_remote(
        std::process::id() as i32,
        std::ptr::from_ref(&token) as u64,
        &mut got,
    )
    .is_ok()
        && u64::from_le_bytes(got) == token
}

/// Parses a peer's `pid offers probe token` record; `None` when it takes no part.
fn parse(bytes: &[u8], rank: usize) -> Option<(Source, u64, u64)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut it = text.split(' ');
    let pid: i32 = it.next()?.parse().ok()?;
    let offers: u64 = it.next()?.parse().ok()?;
    let probe: u64 = it.next()?.parse().ok()?;
    let token: u64 = it.next()?.parse().ok()?;
    let offer_word = offers.checked_add(8 * rank as u64)?;
    Some((Source { pid, offer_word }, probe, token))
}

/// A token a peer cannot guess, so that reading it proves the right process was read.
fn random_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish() | 1
}

/// Reads `dst.len()` bytes at `addr` in process `pid`: in one system call where the kernel's
/// copy runs at full speed, through a bounce buffer where it does not (see
/// [`kernel_copy_slow`]).
#[cfg(target_os = "linux")]
pub(super) fn read_remote(pid: i32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    if dst.len() < BOUNCE_MIN_BYTES || !kernel_copy_slow(addr, dst) {
        return read_remote_direct(pid, addr, dst);
    }
    BOUNCE.with_borrow_mut(|bounce| {
        if bounce.is_empty() {
            *bounce = vec![0u8; BOUNCE_CHUNK_BYTES + 4096];
        }
        for (i, piece) in dst.chunks_mut(BOUNCE_CHUNK_BYTES).enumerate() {
            let from = addr.wrapping_add((i * BOUNCE_CHUNK_BYTES) as u64);
            // The bounce slice starts at the source's page offset: distance 0, full speed.
            let start = (from as usize).wrapping_sub(bounce.as_ptr() as usize) % 4096;
            let staged = &mut bounce[start..start + piece.len()];
            read_remote_direct(pid, from, staged)?;
            dist_simd::copy::cached(piece, staged);
        }
        Ok(())
    })
}

/// Reads `dst.len()` bytes at `addr` in process `pid` as [`read_remote`] does, then the 8-byte
/// word at `word_addr`, and returns the word: one system call instead of two where the read
/// goes straight into `dst` and the CPU keeps loads in program order.
///
/// Why that is enough: `process_vm_readv` copies its remote ranges in the order given, so the
/// word is read after the data, and x86-64 never lets a load pass an earlier load. On other
/// architectures, or for a bounced read, the word is read by a second call after an Acquire
/// fence. A 4-rank all_to_all of 1 MiB read 3 offer words per operation, each a system call
/// that pins a page.
#[cfg(target_os = "linux")]
fn read_remote_then_word(
    pid: i32,
    addr: u64,
    dst: &mut [u8],
    word_addr: u64,
) -> std::io::Result<u64> {
    let mut word = [0u8; 8];
    if !cfg!(target_arch = "x86_64")
        || (dst.len() >= BOUNCE_MIN_BYTES && kernel_copy_slow(addr, dst))
    {
        read_remote(pid, addr, dst)?;
        fence(Ordering::Acquire);
        read_remote_direct(pid, word_addr, &mut word)?;
        return Ok(u64::from_le_bytes(word));
    }
    read_remote_direct_then(pid, addr, dst, Some((word_addr, &mut word)))?;
    Ok(u64::from_le_bytes(word))
}

#[cfg(not(target_os = "linux"))]
fn read_remote_then_word(
    _pid: i32,
    _addr: u64,
    _dst: &mut [u8],
    _word_addr: u64,
) -> std::io::Result<u64> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "cross-memory attach needs Linux",
    ))
}

/// Reads at or above this size go through the bounce buffer at a slow distance; the
/// probe's and offer words' 8-byte reads never do.
#[cfg(target_os = "linux")]
const BOUNCE_MIN_BYTES: usize = 4096;

/// How much of a bounced read is staged at a time: it stays in the core's L2 (512 KiB to
/// 1 MiB on the CPUs measured) between the kernel's write and the copy out. In a C probe of
/// the same reads, 256 KiB pieces read 4 MiB in 727 us, 64 KiB in 927 and 16 KiB in 1163
/// (one system call per piece).
#[cfg(target_os = "linux")]
const BOUNCE_CHUNK_BYTES: usize = 256 << 10;

#[cfg(target_os = "linux")]
thread_local! {
    /// Each reading thread's bounce buffer (the engine's and the read helper's), allocated at
    /// its first bounced read.
    static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether the kernel's copy into `dst` from `addr` in another process runs slow: when the
/// destination's offset within its 4 KiB page lies 1 to 31 bytes past the source's.
///
/// `process_vm_readv` copies a page at a time with `copy_to_user`, which on CPUs with fast
/// short `rep movsb` (FSRM) is that instruction, and on the AMD EPYC this project is measured
/// on `rep movsb` ran 4-6x slower at those distances at every size (1 MiB: 426-617 us against
/// 89-118 at distances 0 and 32 to 4095; the same behaviour of `rep movsb` as glibc's bug
/// 30994 reports, which `dist_simd::copy::bulk` avoids in user space). Two ranks' buffers sit at such distances
/// when one comes from `malloc` (16-byte chunk headers) and the other is page-aligned, or
/// both from a heap. A bounced read costs one more copy from L2 and still ran 2.8x faster
/// there (4 MiB: 727 us against 2082; 488 at a good distance).
#[cfg(target_os = "linux")]
fn kernel_copy_slow(addr: u64, dst: &[u8]) -> bool {
    let distance = dist_simd::copy::page_distance(dst.as_ptr() as usize, addr as usize);
    (1..32).contains(&distance)
}

/// Reads `dst.len()` bytes at `addr` in process `pid`, straight into `dst`.
#[cfg(target_os = "linux")]
fn read_remote_direct(pid: i32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    read_remote_direct_then(pid, addr, dst, None)
}

/// [`read_remote_direct`], then, where `word` is given, the 8 bytes at its address into it,
/// after the data in the same system calls (the kernel copies the ranges in order).
#[cfg(target_os = "linux")]
fn read_remote_direct_then(
    pid: i32,
    addr: u64,
    dst: &mut [u8],
    mut word: Option<(u64, &mut [u8; 8])>,
) -> std::io::Result<()> {
    use nix::sys::uio::{RemoteIoVec, process_vm_readv};
    use nix::unistd::Pid;
    let mut done = 0;
    loop {
        let left = dst.len() - done;
        // No word: an empty second range, which the kernel skips.
        let (word_at, word_buf): (u64, &mut [u8]) = match word.as_mut() {
            Some((at, w)) => (*at, &mut w[..]),
            None => (0, &mut []),
        };
        let wanted = left + word_buf.len();
        if wanted == 0 {
            return Ok(());
        }
        let remote = [
            RemoteIoVec {
                base: (addr as usize).wrapping_add(done),
                len: left,
            },
            RemoteIoVec {
                base: word_at as usize,
                len: word_buf.len(),
            },
        ];
        let mut local = [
            std::io::IoSliceMut::new(&mut dst[done..]),
            std::io::IoSliceMut::new(word_buf),
        ];
        match process_vm_readv(Pid::from_raw(pid), &mut local, &remote) {
            Ok(k) if k == wanted => return Ok(()),
            // A partial read stops at an unreadable page; zero means nothing more is readable.
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the remote range ended early",
                ));
            }
            // The data is in but the word was cut short: the next call reads it whole.
            Ok(k) => done += k.min(left),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn read_remote(_pid: i32, _addr: u64, _dst: &mut [u8]) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "cross-memory attach is Linux-only",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_own_memory_and_rejects_a_bad_address() {
        let src: Vec<u8> = (0..=255u8).cycle().take(3 << 20).collect();
        let mut dst = vec![0u8; src.len()];
        read_remote(std::process::id() as i32, src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(src, dst);
        assert!(read_remote(std::process::id() as i32, 8, &mut dst[..8]).is_err());
    }

    /// Every distance around the bounced range, at sizes below, at and between its pieces,
    /// reads exactly the source's bytes (and nothing past the destination).
    #[cfg(target_os = "linux")]
    #[test]
    fn reads_at_every_page_distance() {
        let pid = std::process::id() as i32;
        let src: Vec<u8> = (0..(3 * BOUNCE_CHUNK_BYTES + 8192))
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        let mut dst = vec![0u8; src.len()];
        for len in [
            4095,
            4096,
            10_000,
            BOUNCE_CHUNK_BYTES,
            2 * BOUNCE_CHUNK_BYTES + 4099,
        ] {
            for distance in (0..70).chain([4064, 4095]) {
                let src_at = 5;
                let dst_at = (src.as_ptr() as usize + src_at + distance)
                    .wrapping_sub(dst.as_ptr() as usize)
                    % 4096;
                dst.fill(0xEE);
                let from = &src[src_at..src_at + len];
                read_remote(pid, from.as_ptr() as u64, &mut dst[dst_at..dst_at + len]).unwrap();
                assert_eq!(
                    kernel_copy_slow(from.as_ptr() as u64, &dst[dst_at..dst_at + len]),
                    (1..32).contains(&distance),
                    "distance {distance}"
                );
                assert!(
                    dst[dst_at..dst_at + len] == *from,
                    "len {len}, distance {distance}"
                );
                assert!(dst[..dst_at].iter().all(|&b| b == 0xEE));
                assert!(dst[dst_at + len..].iter().all(|&b| b == 0xEE));
            }
        }
    }

    /// The data then the word, in one call or (at a slow distance) two: both arrive whole,
    /// and an unreadable data range or word is an error, not a short read.
    #[cfg(target_os = "linux")]
    #[test]
    fn reads_data_then_its_offer_word() {
        let pid = std::process::id() as i32;
        let src: Vec<u8> = (0..300_000usize)
            .map(|i| (i * 13 + i / 509) as u8)
            .collect();
        let word = Box::new(0x1234_5678_9abc_def0u64);
        let word_at = &raw const *word as u64;
        let mut dst = vec![0u8; src.len() + 4096];
        for (distance, len) in [(0, 300_000), (7, 300_000), (64, 1), (0, 0)] {
            let dst_at =
                (src.as_ptr() as usize + distance).wrapping_sub(dst.as_ptr() as usize) % 4096;
            dst.fill(0xEE);
            let into = &mut dst[dst_at..dst_at + len];
            let got = read_remote_then_word(pid, src.as_ptr() as u64, into, word_at).unwrap();
            assert_eq!(got, *word, "distance {distance}, len {len}");
            assert!(
                dst[dst_at..dst_at + len] == src[..len],
                "distance {distance}, len {len}"
            );
            assert!(dst[dst_at + len..].iter().all(|&b| b == 0xEE));
        }
        assert!(read_remote_then_word(pid, 8, &mut dst[..4096], word_at).is_err());
        assert!(read_remote_then_word(pid, src.as_ptr() as u64, &mut dst[..4096], 8).is_err());
    }
}
