//! Finding libcuda and libnccl before anything touches cudarc's lazily loaded symbols.
//!
//! cudarc opens each library on first use and panics when it, or any symbol, is missing. So
//! every entry point of this crate calls [`ensure_loaded`] first: it opens both libraries
//! through cudarc's own loader (the same search list) only after checking they can be found,
//! looks up every symbol this crate calls, and initialises the driver. Failures are
//! [`Error::Unavailable`] naming the library, never a panic.

use std::sync::OnceLock;

use crate::{Error, Result};

/// CUDA driver symbols this crate calls (the versioned names cudarc resolves).
pub(crate) const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventQuery",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuGetErrorName",
];

/// NCCL symbols this crate calls. `ncclCommSplit` needs NCCL 2.18 or newer.
pub(crate) const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommSplit",
    "ncclCommAbort",
    "ncclCommDestroy",
    "ncclCommGetAsyncError",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclGetErrorString",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclRedOpCreatePreMulSum",
    "ncclRedOpDestroy",
];

/// What one library probe found: present, and which symbols it lacks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Probe<'a> {
    /// Short name used in errors (`"libcuda"`, `"libnccl"`).
    pub(crate) library: &'static str,
    /// Whether any candidate file could be opened.
    pub(crate) present: bool,
    /// The file names that were tried (for the message).
    pub(crate) candidates: &'a [String],
}

/// Turns the probes of both libraries and their missing symbols into the first error, in
/// load order (the driver first: without it NCCL cannot run either). Pure, so it is tested
/// without a GPU.
pub(crate) fn judge(probes: &[Probe<'_>], missing: &[(&'static str, Vec<&str>)]) -> Result<()> {
    for p in probes {
        if !p.present {
            return Err(Error::Unavailable {
                library: p.library,
                reason: format!(
                    "none of {:?} was found (set LD_LIBRARY_PATH to the directory holding it{})",
                    p.candidates,
                    // cudarc's list has no `.so.2`, the name NCCL's runtime packages ship.
                    if p.library == "libnccl" {
                        "; a libnccl.so.2 alone is not found: add a libnccl.so symlink to it"
                    } else {
                        ""
                    }
                ),
            });
        }
        if let Some((_, syms)) = missing
            .iter()
            .find(|(l, s)| *l == p.library && !s.is_empty())
        {
            return Err(Error::Unavailable {
                library: p.library,
                reason: format!("it lacks {syms:?} (NCCL 2.18+ and a CUDA 12 driver are needed)"),
            });
        }
    }
    Ok(())
}

fn probe_once() -> Result<()> {
    let cuda_names = unique(cudarc::get_lib_name_candidates("cuda"));
    let nccl_names = unique(cudarc::get_lib_name_candidates("nccl"));
    // SAFETY: `is_culib_present` only tries `dlopen` on each candidate name and closes it;
    // loading the driver or NCCL runs their initialisers, which is what using them needs.
    let cuda_present = unsafe { cudarc::driver::sys::is_culib_present() };
    let nccl_present = cuda_present
        // SAFETY: as above, for NCCL's candidate names.
        && unsafe { cudarc::nccl::sys::is_culib_present() };
    let probes = [
        Probe {
            library: "libcuda",
            present: cuda_present,
            candidates: &cuda_names,
        },
        Probe {
            library: "libnccl",
            present: nccl_present,
            candidates: &nccl_names,
        },
    ];
    let mut missing = Vec::new();
    if cuda_present {
        // SAFETY: the probe above found a loadable candidate, so `culib` opens it instead of
        // panicking; looking a symbol up calls nothing.
        let lib = unsafe { cudarc::driver::sys::culib() };
        missing.push(("libcuda", lookup(lib, DRIVER_SYMBOLS)));
    }
    if nccl_present {
        // SAFETY: as above, for NCCL.
        let lib = unsafe { cudarc::nccl::sys::culib() };
        missing.push(("libnccl", lookup(lib, NCCL_SYMBOLS)));
    }
    judge(&probes, &missing)?;
    // SAFETY: every driver symbol was found above, so cudarc's lazy loader cannot panic.
    unsafe { cudarc::driver::sys::cuInit(0) }
        .result()
        .map_err(|e| Error::Unavailable {
            library: "libcuda",
            reason: format!("cuInit failed: {}", crate::cuda::driver_error_name(e)),
        })
}

/// The names in their order, each once (cudarc's list repeats some).
fn unique(mut names: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

fn lookup<'a>(lib: &libloading::Library, names: &[&'a str]) -> Vec<&'a str> {
    names
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up as an opaque pointer, never called or read.
        .filter(|n| unsafe { lib.get::<*const std::ffi::c_void>(n.as_bytes()) }.is_err())
        .collect()
}

/// Checks once per process that libcuda and libnccl load, have every symbol this crate calls,
/// and that the driver initialises; later calls return the first answer.
pub fn ensure_loaded() -> Result<()> {
    static RESULT: OnceLock<Result<()>> = OnceLock::new();
    RESULT.get_or_init(probe_once).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["libx.so".into()]
    }

    #[test]
    fn a_missing_driver_is_named_before_nccl() {
        let n = names();
        let probes = [
            Probe {
                library: "libcuda",
                present: false,
                candidates: &n,
            },
            Probe {
                library: "libnccl",
                present: false,
                candidates: &n,
            },
        ];
        let e = judge(&probes, &[]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Unavailable {
                    library: "libcuda",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("libcuda could not be loaded"), "{e}");
        assert!(e.to_string().contains("libx.so"), "{e}");
    }

    #[test]
    fn a_missing_symbol_names_the_library_and_the_symbol() {
        let n = names();
        let probes = [
            Probe {
                library: "libcuda",
                present: true,
                candidates: &n,
            },
            Probe {
                library: "libnccl",
                present: true,
                candidates: &n,
            },
        ];
        let missing = [("libcuda", vec![]), ("libnccl", vec!["ncclCommSplit"])];
        let e = judge(&probes, &missing).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Unavailable {
                    library: "libnccl",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("ncclCommSplit"), "{e}");
        assert!(judge(&probes, &[("libnccl", vec![])]).is_ok());
    }
}
