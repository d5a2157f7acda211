//! The TCP transport: one connection per pair of ranks, set up through the store.
//!
//! `mesh.rs` connects the pairs; `engine.rs` drives the peer protocol's [`Core`] over them
//! (or over the shared-memory rings a pair on one host moves onto, `link.rs`); `cma.rs` is the
//! single-copy path between processes on one host, which the core asks for through
//! [`crate::proto::CopyIn`], `read_helper.rs` the second thread that reads half of each large
//! broadcast, scatter or gather frame where the host has spare cores, and `by_reference.rs` the
//! sender's rule for which messages take it; `linger.rs` reads each connection after closing
//! until the peer closes its end; `arrival.rs` wakes a thread sleeping in the poller for
//! point-to-point arrivals.

mod arrival;
mod by_reference;
mod cma;
mod conn;
mod engine;
#[cfg(target_os = "linux")]
mod huge_pages;
mod idle;
#[cfg(not(target_os = "linux"))]
mod huge_pages {
    /// No page tables to ask outside Linux: never.
    pub(super) fn in_huge_pages(_: &[u8]) -> bool {
        false
    }
}
mod linger;
mod link;
mod mesh;
mod read_helper;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dist_backend::{Result, Store};
use dist_wire::{FrameHeader, HEADER_LEN};

pub use cma::cross_memory_available;
pub use dist_backend::net::{local_ip, local_ip_with};
pub use mesh::MeshOptions;
pub(crate) use mesh::group_id;

use super::{Incoming, Lent, LentWords, OnFrame, Outgoing, StepCtx, Transport, shm};
use crate::proto::Core;
use by_reference::{OverRings, SingleCopyRule};
use engine::Engine;

/// A full TCP mesh between the ranks of one group.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    segment: usize,
    one_host: bool,
    memory_shared_in_group: bool,
    /// Where every pair of the group talks through rings: rank 0's group area, through which
    /// barriers and small all_reduces run (`Engine::through_area`).
    group_area: Option<shm::group_area::GroupArea>,
    /// Ends [`Transport::wait_for_arrival`]'s sleep in the engine's poller from another thread
    /// (outside the engine's lock, which the sleeper holds).
    arrival: Arc<arrival::ArrivalWaker>,
    engine: Mutex<Engine>,
}

impl TcpTransport {
    /// Builds the mesh: listens, publishes this rank's address under `prefix` in `store`,
    /// connects to lower ranks and accepts higher ones, all within `opts.timeout`.
    pub fn connect(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: &MeshOptions,
    ) -> Result<Self> {
        let deadline = dist_backend::deadline_after(Instant::now(), opts.timeout);
        Self::connect_by(store, prefix, rank, world_size, opts, deadline)
    }

    /// [`TcpTransport::connect`] within `deadline`: every store call of the rendezvous (the
    /// addresses, the shared-memory and single-copy negotiations) ends by it, so building the
    /// mesh never takes longer than the call it serves, however many store calls it makes.
    /// `opts.timeout` still bounds the linger of each connection when the mesh is closed.
    pub fn connect_by(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world_size: usize,
        opts: &MeshOptions,
        deadline: Instant,
    ) -> Result<Self> {
        // Its store errors name the rank and the task (the stores' own name only the call).
        let ranked = |e: dist_backend::Error| {
            e.in_store_call(rank, || {
                format!("group {prefix}: building the connection mesh")
            })
        };
        if let Some(why) = &opts.transport_error {
            return Err(dist_backend::Error::invalid(rank, "connect", why.clone()));
        }
        let (poll, mut conns) =
            mesh::build(store, prefix, rank, world_size, opts, deadline).map_err(ranked)?;
        let arrival = arrival::ArrivalWaker::new(poll.registry()).map_err(|source| {
            dist_backend::Error::Io {
                rank,
                context: format!("group {prefix}: creating the poller's waker"),
                source,
            }
        })?;
        let shm::Negotiated {
            rings,
            one_host,
            rings_in_group,
            group_area,
        } = shm::negotiate(
            store,
            prefix,
            rank,
            world_size,
            &shm::ShmOptions {
                mode: opts.transport,
                host_id: opts.host_id.clone(),
                ring_bytes: opts.shm_ring_bytes,
            },
            deadline,
        )
        .map_err(ranked)?;
        let mut local_ranks = 1;
        for (slot, rings) in conns.iter_mut().zip(rings) {
            if let Some(rings) = rings {
                *slot = slot.take().map(|c| c.use_rings(rings));
                local_ranks += 1;
            }
        }
        let single_copy_over_rings = match opts.cross_memory_over_rings {
            Some(false) => OverRings::Never,
            Some(true) => OverRings::Always,
            None if shm::online_cpus().is_some_and(|n| local_ranks > n) => OverRings::SharedCores,
            None => OverRings::FromHugePages,
        };
        let busy_spin = match opts.busy_spin {
            Some(d) => idle::Busy::First(d),
            None if local_ranks > 1 && shm::online_cpus().is_some_and(|n| local_ranks <= n) => {
                idle::Busy::Whole
            }
            None => idle::Busy::First(Duration::ZERO),
        };
        let (cma, cma_in_group) =
            cma::Cma::negotiate(store, prefix, rank, world_size, opts.cross_memory, deadline)
                .map_err(ranked)?;
        // A helper thread per rank takes half of each large broadcast, scatter or gather frame
        // it copies where the host has two CPUs for each of its ranks: one core cannot stream
        // some machines' memory.
        let cma = cma.map(|c| {
            let local = c.readable_peers() + 1;
            let split = opts
                .copy_helper
                .unwrap_or_else(|| local > 1 && shm::online_cpus().is_some_and(|n| n >= 2 * local));
            Arc::new(c.split_reads(split))
        });
        let split_reads = cma.as_ref().is_some_and(|c| c.split_copies_on());
        // Only where this host's ranks fit its CPUs: where they share cores, a message's time
        // is mostly its peer's wait for a turn on one, and the pace misled (4 ranks on 2
        // cores, near: all_to_all 16 MiB 0.61x, all_gather 4 MiB 0.73x the rule's speed);
        // the rule there already sends most large messages by reference. Nor where the rule is
        // the user's (`cross_memory_over_rings` set).
        let pace = (opts.adaptive_path
            && single_copy_over_rings == OverRings::FromHugePages
            && cma.is_some()
            && local_ranks > 1)
            .then(|| {
                let ring = shm::ring_capacity(opts.shm_ring_bytes).unwrap_or(opts.shm_ring_bytes);
                crate::path_pace::PathPace::new(world_size, ring)
            });
        let mut core = Core::new(rank, world_size, opts.segment_bytes);
        if let Some(cma) = &cma {
            core.set_copier(Box::new(Arc::clone(cma)));
        }
        for (peer, c) in conns.iter().enumerate() {
            if c.as_ref().is_some_and(conn::Conn::is_shm) {
                core.set_exact_reads(peer);
            }
        }
        Ok(TcpTransport {
            rank,
            world_size,
            segment: core.segment_bytes(),
            one_host,
            memory_shared_in_group: rings_in_group || cma_in_group,
            group_area,
            arrival,
            engine: Mutex::new(Engine {
                poll,
                events: mio::Events::with_capacity(64),
                core,
                conns,
                spin: idle::SpinWindow::new(opts.spin, busy_spin),
                cma,
                linger: opts.timeout,
                read_since_wait: false,
                single_copy: SingleCopyRule {
                    over_rings: single_copy_over_rings,
                    min_bytes: opts.cross_memory_min_bytes,
                    split_reads,
                },
                pace,
            }),
        })
    }

    /// Changes how long a step busy-polls before sleeping.
    pub fn set_spin(&self, spin: Duration) {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .spin
            .set_base(spin);
    }
}

/// Whether a publication in `parts` fits a slot of the group area.
fn fits_area(parts: &[&[u8]]) -> bool {
    parts.iter().map(|p| p.len()).sum::<usize>() <= shm::group_area::AREA_DATA_BYTES
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn segment_bytes(&self) -> usize {
        self.segment
    }

    fn exchange(
        &self,
        ctx: &StepCtx,
        sends: &[Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
        on_frame: &mut OnFrame<'_>,
    ) -> Result<()> {
        let mut eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        eng.run(ctx, sends, recvs, on_frame, self.group_area.as_ref())
    }

    fn shared_memory_bytes(&self) -> usize {
        match self.group_area {
            Some(_) => shm::group_area::AREA_DATA_BYTES,
            None => 0,
        }
    }

    fn shared_memory_exchange(
        &self,
        ctx: &StepCtx,
        count: u64,
        mine: &[&[u8]],
        each: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Option<Result<()>> {
        let area = self.group_area.as_ref().filter(|_| fits_area(mine))?;
        let mut eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        Some(eng.through_area(ctx, area, count, mine, each))
    }

    fn shared_memory_announce(&self, ctx: &StepCtx, count: u64, mine: &[&[u8]]) -> bool {
        let Some(area) = self.group_area.as_ref().filter(|_| fits_area(mine)) else {
            return false;
        };
        let mut eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        eng.arrive_in_area(ctx, area, count, mine);
        true
    }

    fn shared_memory_peek(&self, ctx: &StepCtx, from: usize, f: &mut dyn FnMut(&[u8])) -> bool {
        let Some(area) = self.group_area.as_ref() else {
            return false;
        };
        // This rank's last operation in the area, which `ctx` announced.
        let mark = area.next_mark(self.rank) - 1;
        if mark == 0 || from >= self.world_size || !area.has_arrived(from, mark) {
            return false;
        }
        let mut theirs = [0u8; HEADER_LEN];
        area.read_header(from, mark, &mut theirs);
        match FrameHeader::decode(&theirs) {
            Ok(h)
                if h.seq == ctx.seq
                    && h.op == ctx.op
                    && h.payload_len as usize <= shm::group_area::AREA_DATA_BYTES =>
            {
                area.with_data(from, mark, h.payload_len as usize, |d| f(d));
                true
            }
            _ => false,
        }
    }

    fn shared_memory_lend<'a>(&self, bytes: &'a [u8]) -> Option<Lent<'a>> {
        self.group_area.as_ref()?;
        let eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        let (words, withdraw) = eng.cma.as_ref()?.lend(bytes)?;
        Some(Lent::new(words, Box::new(withdraw)))
    }

    fn shared_memory_lend_mut<'a>(&self, bytes: &'a mut [u8]) -> Option<(Lent<'a>, &'a mut [u8])> {
        let lent = self.shared_memory_lend(bytes)?;
        // Only its words and guard: no borrow of the bytes lives on in the `Lent`.
        let lent = Lent::new(lent.words, lent.into_guard());
        Some((lent, bytes))
    }

    fn shared_memory_read(
        &self,
        ctx: &StepCtx,
        peer: usize,
        words: LentWords,
        at: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        // The copy runs outside the engine's lock: it reads another process, not the links.
        let cma = self
            .engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cma
            .clone();
        let read = match cma {
            Some(cma) => cma.read_lent(peer, words, at, dst),
            None => Err("it lent a buffer by reference, which this rank cannot read".into()),
        };
        read.map_err(|reason| {
            let mut eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
            // A lender that gave up aborted the group before it withdrew its offer: its notice
            // is on the link now and names the rank it lost, which this rank reports too,
            // rather than the lender.
            match eng.look(ctx, 0, None) {
                Err(noticed) => noticed,
                Ok(()) => eng.fail_with(ctx, ctx.peer_lost(peer, reason)),
            }
        })
    }

    fn look(&self, ctx: &StepCtx, count: u64, run_from: Option<u64>) -> Result<()> {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .look(ctx, count, run_from)
    }

    fn probe(&self, peer: usize, tag: u32) -> bool {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .probe(peer, tag)
    }

    fn arrival_waker(&self) -> Option<std::task::Waker> {
        Some(self.arrival.waker())
    }

    fn wait_for_arrival(&self, timeout: Duration) {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .wait_for_arrival(timeout);
    }

    /// True when the group has an area (every pair talks through rings, so every rank is on
    /// this host) and the host's online CPUs, which every rank reads from the same kernel,
    /// are fewer than its ranks.
    fn cores_shared(&self) -> bool {
        self.group_area.is_some() && shm::online_cpus().is_some_and(|n| self.world_size > n)
    }

    fn shared_memory_exchanges(&self) -> u64 {
        self.group_area
            .as_ref()
            .map_or(0, |a| a.next_mark(self.rank) - 1)
    }

    /// True when every rank published a shared-memory segment with the same host id when the
    /// mesh was built: every rank reads the same records, so all agree, even where one pair
    /// could not open the other's segment and talks over TCP.
    fn one_host(&self) -> bool {
        self.one_host
    }

    /// True when, as the mesh was built, some two ranks published shared-memory segments with
    /// one host id or some rank found it could read another's memory (read from the same
    /// records on every rank).
    fn memory_shared_in_group(&self) -> bool {
        self.memory_shared_in_group
    }

    fn shared_memory_peers(&self) -> Vec<bool> {
        let eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        eng.conns
            .iter()
            .map(|c| c.as_ref().is_some_and(conn::Conn::is_shm))
            .collect()
    }

    fn messages_by_reference_per_peer(&self) -> Vec<u64> {
        let eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        (0..self.world_size).map(|p| eng.core.offered(p)).collect()
    }

    fn copies_split(&self) -> u64 {
        let eng = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        eng.cma.as_ref().map_or(0, |c| c.split_copies())
    }

    fn fail_with(&self, ctx: &StepCtx, e: dist_backend::Error) -> dist_backend::Error {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fail_with(ctx, e)
    }

    fn abort(&self) {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .core
            .abort();
    }

    fn close(&self) {
        self.engine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .close(self.rank);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dist_backend::Error;
    use dist_backend::store::HashStore;

    use super::*;

    /// `GlooOptions::from_env` keeps an unreadable `DIST_GLOO_TRANSPORT` for the mesh to refuse,
    /// naming the rank and the value, before it touches the store.
    #[test]
    fn an_unreadable_transport_choice_fails_the_mesh_naming_it() {
        let store = HashStore::new(Duration::from_secs(1));
        let opts = MeshOptions {
            transport_error: "udp".parse::<shm::TransportMode>().err(),
            ..MeshOptions::default()
        };
        let e = TcpTransport::connect(&store, "t", 1, 2, &opts).expect_err("refused");
        assert!(
            matches!(&e, Error::InvalidArgument { rank: 1, reason, .. } if reason.contains("DIST_GLOO_TRANSPORT=\"udp\"")),
            "{e}"
        );
    }
}
