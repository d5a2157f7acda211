//! One NCCL communicator: creation (unique id through the store, `ncclCommInitRank`), split,
//! and abort, which the watchdog may call from its thread while an operation hangs.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{OnceLock, RwLock};
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{
    self as nccl, ncclComm, ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId,
};
use dist_backend::Store;

use crate::types::result_name;
use crate::watchdog::CommProbe;
use crate::{Error, Result};

/// Maps an NCCL result to `Ok` or [`Error::Nccl`].
pub(crate) fn check(
    r: ncclResult_t,
    rank: usize,
    op: &'static str,
    seq: u64,
    call: &'static str,
) -> Result<()> {
    match r {
        ncclResult_t::ncclSuccess => Ok(()),
        other => Err(Error::Nccl {
            rank,
            op,
            seq,
            call,
            code: result_name(other),
        }),
    }
}

/// A reduce op handle as NCCL returns it: a plain `int`. cudarc declares `ncclRedOp_t` as a
/// Rust enum, which cannot hold the values `ncclRedOpCreatePreMulSum` makes, so the calls that
/// take an op are looked up with this signature instead.
pub(crate) type RedOp = c_int;

type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    RedOp,
    c_int,
    ncclComm_t,
    nccl::cudaStream_t,
) -> ncclResult_t;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    RedOp,
    ncclComm_t,
    nccl::cudaStream_t,
) -> ncclResult_t;
type CreatePreMulSumFn = unsafe extern "C" fn(
    *mut RedOp,
    *mut c_void,
    ncclDataType_t,
    nccl::ncclScalarResidence_t,
    ncclComm_t,
) -> ncclResult_t;
type DestroyOpFn = unsafe extern "C" fn(RedOp, ncclComm_t) -> ncclResult_t;

/// NCCL's entry points that take a reduce op, with the op as an `int`.
pub(crate) struct ReduceFns {
    pub(crate) all_reduce: AllReduceFn,
    pub(crate) reduce_scatter: AllReduceFn,
    pub(crate) reduce: ReduceFn,
    pub(crate) create_premul_sum: CreatePreMulSumFn,
    pub(crate) destroy_op: DestroyOpFn,
}

/// The reduce entry points (after [`crate::loader::ensure_loaded`] checked they exist).
pub(crate) fn reduce_fns() -> Result<&'static ReduceFns> {
    static FNS: OnceLock<ReduceFns> = OnceLock::new();
    crate::loader::ensure_loaded()?;
    Ok(FNS.get_or_init(|| {
        // SAFETY: `ensure_loaded` opened libnccl through this loader and found every symbol
        // below; the signatures are NCCL's (`ncclRedOp_t` is a C enum, passed as an int).
        unsafe {
            let lib = nccl::culib();
            let get = |name: &[u8]| -> *const c_void {
                lib.get::<*const c_void>(name)
                    .map(|s| *s)
                    .unwrap_or(std::ptr::null())
            };
            ReduceFns {
                all_reduce: std::mem::transmute::<*const c_void, AllReduceFn>(get(
                    b"ncclAllReduce",
                )),
                reduce_scatter: std::mem::transmute::<*const c_void, AllReduceFn>(get(
                    b"ncclReduceScatter",
                )),
                reduce: std::mem::transmute::<*const c_void, ReduceFn>(get(b"ncclReduce")),
                create_premul_sum: std::mem::transmute::<*const c_void, CreatePreMulSumFn>(get(
                    b"ncclRedOpCreatePreMulSum",
                )),
                destroy_op: std::mem::transmute::<*const c_void, DestroyOpFn>(get(
                    b"ncclRedOpDestroy",
                )),
            }
        }
    }))
}

/// An NCCL communicator. Operations enqueue under a read lock; [`Comm::abort`] takes the
/// write lock, so it never frees the communicator under a call in progress (NCCL allows
/// `ncclCommAbort` from another thread only between calls on the others).
pub(crate) struct Comm {
    rank: usize,
    ptr: AtomicPtr<ncclComm>,
    lock: RwLock<()>,
    abort_wait: Duration,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm").field("rank", &self.rank).finish()
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; `Comm` serialises them (the backend's issue lock, and the read/write lock against
// abort). `ncclCommGetAsyncError` and `ncclCommAbort` are documented as callable from another
// thread.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

/// The store key of a communicator's unique id.
fn id_key(prefix: &str) -> String {
    format!("{prefix}/nccl/unique_id")
}

impl Comm {
    fn from_raw(rank: usize, ptr: ncclComm_t, abort_wait: Duration) -> Comm {
        Comm {
            rank,
            ptr: AtomicPtr::new(ptr),
            lock: RwLock::new(()),
            abort_wait,
        }
    }

    /// Creates the communicator of `rank` in `world_size`: rank 0 makes the unique id and
    /// publishes it in `store` under `prefix`; every rank waits until all have arrived, so
    /// `ncclCommInitRank`, which has no timeout, is only entered once every peer is entering
    /// it too. Every store call ends by one deadline, `timeout` from now, so a silent store
    /// cannot give each call a timeout of its own. The device must be bound on this thread.
    pub(crate) fn init(
        store: &dyn Store,
        prefix: &str,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Comm> {
        let store_err = |what: &'static str| {
            move |e: dist_backend::StoreError| Error::Nccl {
                rank,
                op: "init",
                seq: 0,
                call: what,
                code: e.to_string(),
            }
        };
        let deadline = dist_backend::deadline_after(Instant::now(), timeout);
        let key = id_key(prefix);
        let id = if rank == 0 {
            let mut id = ncclUniqueId { internal: [0; 128] };
            // SAFETY: `id` is a valid out-pointer for the call.
            let r = unsafe { nccl::ncclGetUniqueId(&mut id) };
            check(r, rank, "init", 0, "ncclGetUniqueId")?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store
                .set_by(&key, &bytes, deadline)
                .map_err(store_err("publishing the unique id"))?;
            id
        } else {
            let bytes = store
                .get_by(&key, deadline)
                .map_err(store_err("waiting for rank 0's unique id"))?;
            if bytes.len() != 128 {
                return Err(Error::Nccl {
                    rank,
                    op: "init",
                    seq: 0,
                    call: "reading the unique id",
                    code: format!("the store holds {} bytes, not 128", bytes.len()),
                });
            }
            let mut id = ncclUniqueId { internal: [0; 128] };
            for (d, s) in id.internal.iter_mut().zip(bytes) {
                *d = s as std::ffi::c_char;
            }
            id
        };
        let arrived = format!("{prefix}/nccl/arrived/{rank}");
        store
            .set_by(&arrived, b"1", deadline)
            .map_err(store_err("announcing arrival"))?;
        let keys: Vec<String> = (0..world_size)
            .map(|r| format!("{prefix}/nccl/arrived/{r}"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        store
            .wait_by(&keys, deadline)
            .map_err(store_err("waiting for every rank to arrive"))?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer, `id` a unique id shared by all ranks; the
        // device is bound on this thread (the caller's duty).
        let r =
            unsafe { nccl::ncclCommInitRank(&mut comm, world_size as c_int, id, rank as c_int) };
        check(r, rank, "init", 0, "ncclCommInitRank")?;
        Ok(Comm::from_raw(rank, comm, timeout))
    }

    /// `ncclCommSplit`: the communicator of the ranks that pass the same `color` (`None`: this
    /// rank joins none), ordered by `key`. Every rank of this communicator must call it.
    pub(crate) fn split(
        &self,
        color: Option<u32>,
        key: usize,
    ) -> Result<Option<(Comm, usize, usize)>> {
        // `NcclBackend::split` refused colors and keys past `c_int`; -1 is NCCL_SPLIT_NOCOLOR.
        let color = color.map_or(-1, |c| c_int::try_from(c).unwrap_or(c_int::MAX));
        let key = c_int::try_from(key).unwrap_or(c_int::MAX);
        let mut new: ncclComm_t = std::ptr::null_mut();
        self.with("split", 0, |c| {
            // SAFETY: `c` is live (held under the read lock); `new` is a valid out-pointer;
            // a null config asks for the parent's.
            let r = unsafe { nccl::ncclCommSplit(c, color, key, &mut new, std::ptr::null_mut()) };
            check(r, self.rank, "split", 0, "ncclCommSplit")
        })?;
        if new.is_null() {
            return Ok(None);
        }
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `new` is a live communicator just created; the out-pointers are valid.
        let r = unsafe { nccl::ncclCommUserRank(new, &mut rank) };
        check(r, self.rank, "split", 0, "ncclCommUserRank")?;
        // SAFETY: as above.
        let r = unsafe { nccl::ncclCommCount(new, &mut size) };
        check(r, self.rank, "split", 0, "ncclCommCount")?;
        Ok(Some((
            Comm::from_raw(rank as usize, new, self.abort_wait),
            rank as usize,
            size as usize,
        )))
    }

    /// Runs `f` with the live handle, or fails if the communicator was aborted.
    pub(crate) fn with<R>(
        &self,
        op: &'static str,
        seq: u64,
        f: impl FnOnce(ncclComm_t) -> Result<R>,
    ) -> Result<R> {
        let _guard = self.lock.read().unwrap_or_else(|e| e.into_inner());
        let c = self.ptr.load(Ordering::Acquire);
        if c.is_null() {
            return Err(Error::Nccl {
                rank: self.rank,
                op,
                seq,
                call: "the communicator",
                code: "already aborted".into(),
            });
        }
        f(c)
    }
}

impl CommProbe for Comm {
    fn async_error(&self) -> Option<String> {
        let _guard = self.lock.read().unwrap_or_else(|e| e.into_inner());
        let c = self.ptr.load(Ordering::Acquire);
        if c.is_null() {
            return None;
        }
        let mut err = ncclResult_t::ncclSuccess;
        // SAFETY: `c` is live under the read lock; NCCL allows this call concurrently with
        // operations on other threads.
        let r = unsafe { nccl::ncclCommGetAsyncError(c, &mut err) };
        match (r, err) {
            (
                ncclResult_t::ncclSuccess,
                ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress,
            ) => None,
            (ncclResult_t::ncclSuccess, e) => Some(result_name(e)),
            (e, _) => Some(result_name(e)),
        }
    }

    fn abort(&self) {
        let deadline = dist_backend::deadline_after(Instant::now(), self.abort_wait);
        loop {
            if let Ok(_guard) = self.lock.try_write() {
                let c = self.ptr.swap(std::ptr::null_mut(), Ordering::AcqRel);
                if !c.is_null() {
                    // SAFETY: `c` was live and no call holds it (write lock); swapping in null
                    // first makes this the only abort, and every later use fails instead.
                    let r = unsafe { nccl::ncclCommAbort(c) };
                    if r != ncclResult_t::ncclSuccess {
                        tracing::warn!(rank = self.rank, code = %result_name(r), "dist-nccl: ncclCommAbort failed");
                    }
                }
                return;
            }
            if Instant::now() >= deadline {
                // A call is stuck inside NCCL holding the communicator; freeing it under that
                // call would be unsound, so it is leaked and the failure is reported instead.
                tracing::error!(
                    rank = self.rank,
                    "dist-nccl: could not abort the communicator: a call on it did not return; it is leaked"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let c = *self.ptr.get_mut();
        if !c.is_null() {
            // SAFETY: `&mut self`: no call can hold the communicator. The owner drained (or
            // gave up on) its operations before dropping it; abort releases it without
            // waiting for peers, which `ncclCommDestroy` would.
            let r = unsafe { nccl::ncclCommAbort(c) };
            if r != ncclResult_t::ncclSuccess {
                tracing::warn!(rank = self.rank, code = %result_name(r), "dist-nccl: ncclCommAbort at drop failed");
            }
        }
    }
}
