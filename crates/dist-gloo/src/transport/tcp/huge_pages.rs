//! Whether a buffer lies wholly in huge pages, asked of this process's page tables through
//! `PAGEMAP_SCAN` on `/proc/self/pagemap` (Linux 6.7 and later; elsewhere the answer is no).
//!
//! Why: a copy by reference (`process_vm_readv`) makes the kernel pin every page of the
//! sender's buffer for the copy. In 2 MiB pages that is a handful of pins per message and the
//! one copy beats the shared-memory rings' two for the data-movement collectives; in 4 KiB
//! pages the pinning costs more than the copy it saves (docs/BENCHMARKS.md, "Ring all_reduce
//! in pieces"). Whether a buffer got huge pages depends on the allocator, `madvise` and the
//! kernel's supply of free huge pages at the time, so the sender asks per message.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// `struct page_region` of `<linux/fs.h>`.
#[repr(C)]
#[derive(Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg` of `<linux/fs.h>`; the kernel checks `size` against its own.
#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `PAGE_IS_HUGE`: a page mapped by a huge (PMD or hugetlb) entry.
const PAGE_IS_HUGE: u64 = 1 << 6;
/// `_IOWR('f', 16, struct pm_scan_arg)`: read-write (3 << 30), 96 bytes of argument, type
/// `'f'`, number 16.
const PAGEMAP_SCAN: u32 = (3 << 30) | (96 << 16) | ((b'f' as u32) << 8) | 16;
/// The alignment the scan asks of its range: the smallest base page size.
const BASE_PAGE: u64 = 4096;

/// Whether every page under `buf` is present and huge. `false` for an empty buffer, and
/// wherever the kernel cannot say (an older kernel, no `/proc`, another OS).
pub(super) fn in_huge_pages(buf: &[u8]) -> bool {
    static PAGEMAP: OnceLock<Option<File>> = OnceLock::new();
    if buf.is_empty() {
        return false;
    }
    let Some(pagemap) = PAGEMAP.get_or_init(|| File::open("/proc/self/pagemap").ok()) else {
        return false;
    };
    let at = buf.as_ptr() as u64;
    let (start, end) = (
        at & !(BASE_PAGE - 1),
        (at + buf.len() as u64).next_multiple_of(BASE_PAGE),
    );
    // Zero regions of pages that are *not* huge (the category inverted), and the walk reached
    // the end.
    scan(pagemap, start, end, PAGE_IS_HUGE)
        .is_some_and(|(regions, walked_to)| regions == 0 && walked_to >= end)
}

/// One PAGEMAP_SCAN of `start..end` (page-aligned) for at most one region of pages whose
/// categories, with `inverted` flipped, include every bit of `inverted` (all pages when it is
/// 0): the number of regions found and where the walk stopped, or `None` when the kernel
/// refuses the call.
fn scan(pagemap: &File, start: u64, end: u64, inverted: u64) -> Option<(i32, u64)> {
    let mut found = PageRegion::default();
    let mut arg = PmScanArg {
        size: size_of::<PmScanArg>() as u64,
        flags: 0,
        start,
        end,
        walk_end: 0,
        vec: std::ptr::from_mut(&mut found) as u64,
        vec_len: 1,
        max_pages: 0,
        category_inverted: inverted,
        category_mask: inverted,
        category_anyof_mask: 0,
        return_mask: PAGE_IS_HUGE,
    };
    // SAFETY: `pagemap` is an open file for the duration of the call. PAGEMAP_SCAN reads
    // `arg` (a live, exclusively borrowed `PmScanArg` of the layout and `size` the kernel
    // expects) and writes back only into `arg` and into at most `vec_len` (1) `PageRegion`s at
    // `vec`, which points at `found`, live and exclusively borrowed until the call returns.
    // It reads this process's page tables and changes no memory of ours otherwise.
    let regions = unsafe {
        libc::ioctl(
            pagemap.as_raw_fd(),
            PAGEMAP_SCAN as libc::Ioctl,
            std::ptr::from_mut(&mut arg),
        )
    };
    (regions >= 0).then_some((regions, arg.walk_end))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AnonHugePages, in bytes, of the mapping `at..at + len`, from /proc/self/smaps: an
    /// account of the same fact kept apart from the page walk. `None` unless smaps has an area
    /// that is exactly that mapping.
    fn smaps_huge_bytes(at: usize, len: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let area = format!("{:x}-{:x} ", at, at + len);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&area)).skip(1);
        let kb = lines.find_map(|l| l.strip_prefix("AnonHugePages:"))?;
        kb.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()
            .map(|k| k << 10)
    }

    #[test]
    fn small_pages_are_not_huge_and_advised_ones_are_as_smaps_accounts_them() {
        let len = 8 << 20;
        let mut small = memmap2::MmapMut::map_anon(len).unwrap();
        small.advise(memmap2::Advice::NoHugePage).unwrap();
        small.fill(1);
        assert!(!in_huge_pages(&small));
        assert!(!in_huge_pages(&[]));

        // 4 KiB short of 2 MiB extra, cut at a 2 MiB boundary: the only whole 2 MiB stretches
        // of the mapping are those of `huge`, so smaps's count is `huge`'s. The kernel backs
        // them with huge pages only while it has free ones, hence the comparison, not a
        // fixed answer.
        let mut big = memmap2::MmapMut::map_anon(len + (2 << 20) - 4096).unwrap();
        let skip = (big.as_ptr() as usize).next_multiple_of(2 << 20) - big.as_ptr() as usize;
        let _ = big.advise(memmap2::Advice::HugePage);
        big.fill(1);
        let accounted = smaps_huge_bytes(big.as_ptr() as usize, big.len());
        let huge = &big[skip..skip + len];
        if scan_supported() {
            let accounted = accounted.expect("smaps lists the mapping");
            assert_eq!(
                in_huge_pages(huge),
                accounted == len as u64,
                "smaps has {accounted} huge bytes of {len}"
            );
        } else {
            assert!(!in_huge_pages(huge));
        }
    }

    /// Whether this kernel knows PAGEMAP_SCAN: `/proc/self/pagemap` answers it on some memory.
    fn scan_supported() -> bool {
        let Ok(f) = File::open("/proc/self/pagemap") else {
            return false;
        };
        let probe = [0u8; 1];
        let at = probe.as_ptr() as u64 & !(BASE_PAGE - 1);
        scan(&f, at, at + BASE_PAGE, 0).is_some()
    }
}
