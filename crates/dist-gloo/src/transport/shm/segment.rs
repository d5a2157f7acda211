//! The shared-memory segment of one rank: an anonymous `memfd` holding the rings its peers on
//! this host write to it, one slot per rank of the group.
//!
//! After the rings comes the group area (`group_area`), used in rank 0's segment only.
//!
//! A `memfd` has no name in `/dev/shm` or anywhere else: it lives exactly as long as some
//! process holds its descriptor or a mapping of it, so a group killed with `kill -9` leaves
//! nothing behind. A peer opens it through `/proc/<pid>/fd/<n>`, which needs the same access to
//! the owner that reading its `/proc` entries does (same user, same pid namespace), not the
//! ptrace attach right that cross-memory attach needs. The size is sealed once set, so a peer
//! cannot shrink it under this rank's mapping (which would turn reads into SIGBUS).

use std::fs::{File, OpenOptions};
use std::io;
use std::sync::Arc;

use memmap2::MmapRaw;
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

use super::group_area::{GroupArea, area_bytes};
use super::ring::{CONTROL_BYTES, RxRing, TxRing};

/// Bytes of one slot: a ring's control lines and its data.
fn slot_bytes(cap: usize) -> usize {
    CONTROL_BYTES + cap
}

/// Bytes of a segment of `world` rings of `cap` bytes and the group area.
fn segment_bytes(world: usize, cap: usize) -> io::Result<usize> {
    world
        .checked_mul(slot_bytes(cap))
        .and_then(|b| b.checked_add(area_bytes(world)))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "segment size overflows"))
}

/// The group area of the segment mapped as `map`, of `world` rings of `cap` bytes.
pub(crate) fn group_area(map: Arc<MmapRaw>, world: usize, cap: usize) -> io::Result<GroupArea> {
    GroupArea::new(map, world * slot_bytes(cap), world)
}

/// This rank's segment, and what peers need to find it.
#[derive(Debug)]
pub(crate) struct Segment {
    /// Kept open until every peer has opened its own descriptor (see `negotiate`).
    file: Option<File>,
    map: Arc<MmapRaw>,
    cap: usize,
}

impl Segment {
    /// A zeroed segment of `world` rings of `cap` bytes (a power of two) and the group area,
    /// sealed at that size.
    pub(crate) fn create(world: usize, cap: usize) -> io::Result<Self> {
        let fd = memfd_create(
            c"dist-gloo-shm",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(io::Error::from)?;
        let file = File::from(fd);
        file.set_len(segment_bytes(world, cap)? as u64)?;
        fcntl(
            &file,
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )
        .map_err(io::Error::from)?;
        let map = Arc::new(MmapRaw::map_raw(&file)?);
        Ok(Segment {
            file: Some(file),
            map,
            cap,
        })
    }

    /// What a peer passes to [`open_peer`]: this process and the segment's descriptor.
    pub(crate) fn locator(&self) -> Option<(u32, i32)> {
        use std::os::fd::AsRawFd;
        self.file
            .as_ref()
            .map(|f| (std::process::id(), f.as_raw_fd()))
    }

    /// Data bytes of each ring.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Closes the descriptor once every peer has its own (the mappings keep the memory).
    pub(crate) fn close_fd(&mut self) {
        self.file = None;
    }

    /// This segment's group area, for a group of `world` ranks.
    pub(crate) fn group_area(&self, world: usize) -> io::Result<GroupArea> {
        group_area(self.map.clone(), world, self.cap)
    }

    /// The reading end of the ring `peer` writes to this rank.
    pub(crate) fn rx_from(&self, peer: usize) -> io::Result<RxRing> {
        RxRing::new(self.map.clone(), peer * slot_bytes(self.cap), self.cap)
    }
}

/// Maps the segment of the rank with process `pid`, descriptor `fd`, `world` rings of `cap`
/// bytes, and returns the writing end of its ring from `rank`.
pub(crate) fn open_peer(
    pid: u32,
    fd: i32,
    world: usize,
    cap: usize,
    rank: usize,
) -> io::Result<TxRing> {
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = OpenOptions::new().read(true).write(true).open(&path)?;
    let want = segment_bytes(world, cap)?;
    let len = file.metadata()?.len();
    if len != want as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{path} holds {len} bytes, not the {want} of {world} rings of {cap} bytes and their group area"
            ),
        ));
    }
    // The owner sealed the size; a file that is not sealed is not the owner's segment.
    let seals = fcntl(&file, FcntlArg::F_GET_SEALS).map_err(io::Error::from)?;
    if seals & libc_seal_shrink() == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{path} is not a sealed dist-gloo segment"),
        ));
    }
    let map = Arc::new(MmapRaw::map_raw(&file)?);
    TxRing::new(map, rank * slot_bytes(cap), cap)
}

fn libc_seal_shrink() -> i32 {
    SealFlag::F_SEAL_SHRINK.bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    /// How many of the pages lying wholly inside `map[at..at + len]` are in memory (`mincore`),
    /// and how many there are.
    #[allow(
        unsafe_code,
        reason = "mincore only reads the page table of a mapping this test holds"
    )]
    fn resident_pages(map: &MmapRaw, at: usize, len: usize) -> (usize, usize) {
        let base = map.as_ptr() as usize;
        let first = (base + at).next_multiple_of(PAGE);
        let end = (base + at + len) / PAGE * PAGE;
        let pages = (end - first) / PAGE;
        let mut vec = vec![0u8; pages];
        // SAFETY: `first..end` lies inside the live mapping `map` and is page-aligned; `vec`
        // has one byte per page, as mincore writes.
        let r = unsafe { libc::mincore(first as *mut libc::c_void, end - first, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", io::Error::last_os_error());
        (vec.iter().filter(|&&b| b & 1 == 1).count(), pages)
    }

    #[test]
    fn a_ring_in_use_is_in_memory_from_the_start_and_an_unused_slot_is_not() {
        let probe = memmap2::MmapOptions::new().len(PAGE).map_anon().unwrap();
        if probe.advise(memmap2::Advice::PopulateWrite).is_err() {
            println!("skipped: this kernel has no MADV_POPULATE_WRITE (Linux 5.14)");
            return;
        }
        let cap = 1 << 20;
        let seg = Segment::create(3, cap).unwrap();
        let slot = slot_bytes(cap);
        assert_eq!(resident_pages(&seg.map, slot, slot).0, 0, "fresh segment");
        let _rx = seg.rx_from(1).unwrap();
        // Without populating, a ring's pages come in one fault at a time as data first passes.
        let (resident, pages) = resident_pages(&seg.map, slot, slot);
        assert!(pages > 200);
        assert_eq!(
            resident, pages,
            "the ring from rank 1, once its reading end exists"
        );
        // Slots of ranks on other hosts are never used: they must cost no memory.
        assert_eq!(
            resident_pages(&seg.map, 2 * slot, slot).0,
            0,
            "rank 2's slot"
        );
    }
}
