//! Without libcuda or libnccl (CI, this project's machines) every entry point fails with a
//! clear `Unavailable` naming the library, and nothing panics.

use std::sync::Arc;
use std::time::Duration;

use dist_backend::store::HashStore;
use dist_nccl::{DeviceAlloc, Error, HostStaging, NcclBackend, NcclOptions};

/// True (and says so) when this machine has a loadable driver and NCCL, where this suite has
/// nothing to show.
fn libraries_present() -> bool {
    if dist_nccl::ensure_loaded().is_ok() {
        println!("skipped: libcuda and libnccl load here (the GPU suite covers this machine)");
        return true;
    }
    false
}

#[test]
fn creating_a_backend_without_cuda_is_unavailable_naming_the_library() {
    if libraries_present() {
        return;
    }
    let store = Arc::new(HashStore::new(Duration::from_secs(5)));
    let e = NcclBackend::new(store, "g", 0, 1, NcclOptions::default()).unwrap_err();
    let Error::Unavailable { library, reason } = &e else {
        panic!("expected Unavailable, got {e:?}");
    };
    // The driver is checked first: without it NCCL cannot run either.
    assert!(*library == "libcuda" || *library == "libnccl", "{library}");
    let msg = e.to_string();
    assert!(msg.starts_with("backend nccl is unavailable: lib"), "{msg}");
    assert!(msg.contains(library), "{msg}");
    assert!(!reason.is_empty());
    // Through the Backend contract (what dist-collective reports), field by field.
    let lib = *library;
    match e.clone().into_backend(0) {
        dist_backend::Error::Unavailable {
            backend: "nccl",
            library,
            reason: r,
        } => {
            assert_eq!(library, lib);
            assert_eq!(&r, reason);
        }
        other => panic!("expected dist_backend::Error::Unavailable, got {other:?}"),
    }
    println!("{msg}");
}

#[test]
fn every_entry_point_says_the_same_and_none_panics() {
    if libraries_present() {
        return;
    }
    let first = dist_nccl::ensure_loaded().unwrap_err().to_string();
    // Asked again (the answer is cached), through each public way in.
    assert_eq!(dist_nccl::ensure_loaded().unwrap_err().to_string(), first);
    assert_eq!(dist_nccl::device_count(0).unwrap_err().to_string(), first);
    assert_eq!(DeviceAlloc::new(0, 16).unwrap_err().to_string(), first);
    let host: Box<dyn dist_backend::Backend> = Box::new(Dummy);
    assert_eq!(HostStaging::new(host).unwrap_err().to_string(), first);
}

/// A host backend that is never called (staging fails before wrapping it).
struct Dummy;

impl dist_backend::Backend for Dummy {
    fn name(&self) -> &'static str {
        "dummy"
    }
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn capabilities(&self) -> dist_backend::Capabilities {
        dist_backend::Capabilities::HOST_ALL
    }
    fn all_reduce(
        &self,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: dist_wire::ReduceOp,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn broadcast(
        &self,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: usize,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn reduce(
        &self,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: dist_wire::ReduceOp,
        _: usize,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn all_gather(
        &self,
        _: dist_backend::BufRef<'_>,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: &[usize],
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn reduce_scatter(
        &self,
        _: dist_backend::BufRef<'_>,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: dist_wire::ReduceOp,
        _: &[usize],
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn all_to_all(
        &self,
        _: dist_backend::BufRef<'_>,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: &[usize],
        _: &[usize],
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn gather(
        &self,
        _: dist_backend::BufRef<'_>,
        _: Option<dist_backend::BufMut<'_>>,
        _: dist_wire::DType,
        _: usize,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn scatter(
        &self,
        _: Option<dist_backend::BufRef<'_>>,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: usize,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn barrier(&self, _: &dist_backend::OpOptions) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn send(
        &self,
        _: dist_backend::BufRef<'_>,
        _: dist_wire::DType,
        _: usize,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
    fn recv(
        &self,
        _: dist_backend::BufMut<'_>,
        _: dist_wire::DType,
        _: usize,
        _: &dist_backend::OpOptions,
    ) -> dist_backend::Result<()> {
        unreachable!("never called")
    }
}
