//! Backend strings (`"gloo"`, `"nccl"`, `"cpu:gloo,cuda:nccl"`) at init, with the `nccl`
//! feature on and off, and what a group does with device buffers it cannot serve.

use std::sync::Arc;
use std::time::Duration;

use dist_backend::DeviceBuffer;
use dist_backend::store::HashStore;
use dist_collective::testing::run_world_opts;
use dist_collective::{DType, Error, InitOptions, ReduceOp, new_process_group};

fn one_rank(backend: &str) -> InitOptions {
    InitOptions::new()
        .backend(backend)
        .store(Arc::new(HashStore::new(Duration::from_secs(10))))
        .rank(0)
        .world_size(1)
        .timeout(Duration::from_secs(10))
}

#[test]
fn a_malformed_string_is_refused_before_any_rendezvous() {
    let e = new_process_group(one_rank("mpi")).unwrap_err();
    assert!(
        matches!(&e, Error::UnknownBackend { name, .. } if name == "mpi"),
        "{e:?}"
    );
    for (s, what) in [
        ("cpu:gloo,cpu:gloo", "named twice"),
        ("cpu:nccl", "nccl cannot serve cpu buffers"),
    ] {
        let e = new_process_group(one_rank(s)).unwrap_err();
        assert!(matches!(e, Error::InvalidBackend { .. }), "{s}: {e:?}");
        assert!(e.to_string().contains(what), "{s}: {e}");
    }
}

#[cfg(not(feature = "nccl"))]
#[test]
fn without_the_feature_nccl_is_unknown_and_says_what_this_build_has() {
    for (s, name) in [
        ("nccl", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl (needs nccl)"),
        ("cuda:gloo", "cuda:gloo (needs nccl)"),
    ] {
        let e = new_process_group(one_rank(s)).unwrap_err();
        match &e {
            Error::UnknownBackend { name: n, available } => {
                assert_eq!(n, name);
                assert!(!available.contains(&"nccl"));
            }
            other => panic!("{s}: expected UnknownBackend, got {other:?}"),
        }
        assert!(
            e.to_string().contains("is not available (compiled in:"),
            "{e}"
        );
    }
}

#[cfg(feature = "nccl")]
#[test]
fn with_the_feature_a_machine_without_cuda_gets_unavailable_naming_the_library() {
    if dist_nccl::ensure_loaded().is_ok() {
        println!("skipped: libcuda and libnccl load here");
        return;
    }
    assert!(dist_collective::AVAILABLE_BACKENDS.contains(&"nccl"));
    for s in ["nccl", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"] {
        let e = new_process_group(one_rank(s)).unwrap_err();
        let Error::Backend(dist_backend::Error::Unavailable {
            backend: "nccl",
            library,
            ..
        }) = &e
        else {
            panic!("{s}: expected Unavailable, got {e:?}");
        };
        assert!(
            e.to_string()
                .contains(&format!("{library} could not be loaded")),
            "{e}"
        );
    }
}

#[test]
fn cpu_gloo_serves_the_typed_api_on_every_rank() {
    for world in [1, 3] {
        let out = run_world_opts(world, InitOptions::new().backend("cpu:gloo"), |pg| {
            let mut v = vec![pg.rank() as u32 + 1; 5];
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
            assert_eq!(pg.backend(), "cpu:gloo");
            Ok(v)
        })
        .unwrap();
        let want = (1..=world as u32).sum::<u32>();
        assert_eq!(out, vec![vec![want; 5]; world]);
    }
}

#[test]
fn a_host_only_group_refuses_device_buffers_clearly_on_every_rank() {
    let out = run_world_opts(2, InitOptions::new().backend("gloo"), |pg| {
        let e = pg
            .all_reduce_device(DeviceBuffer::empty(0), DType::F32, ReduceOp::Sum)
            .unwrap_err();
        Ok(e.to_string())
    })
    .unwrap();
    for (r, e) in out.iter().enumerate() {
        assert!(e.contains(&format!("rank {r}")), "{e}");
        assert!(e.contains("gloo does not support"), "{e}");
    }
}

#[test]
fn device_collectives_check_their_arguments_before_the_backend() {
    let out = run_world_opts(2, InitOptions::new().backend("gloo"), |pg| {
        let e1 = pg
            .broadcast_device(DeviceBuffer::empty(0), DType::F32, 5)
            .unwrap_err();
        let e2 = pg
            .all_reduce_device(DeviceBuffer::empty(0), DType::F16, ReduceOp::BitAnd)
            .unwrap_err();
        let e3 = pg
            .all_to_all_device(
                DeviceBuffer::empty(0),
                DeviceBuffer::empty(0),
                DType::U8,
                &[0],
                &[0, 0],
            )
            .unwrap_err();
        Ok([e1, e2, e3].map(|e| e.to_string()))
    })
    .unwrap();
    for [e1, e2, e3] in out {
        assert!(e1.contains("root 5 is not a rank"), "{e1}");
        assert!(e2.contains("reduce op"), "{e2}");
        assert!(e3.contains("send_counts has 1 entries for 2 ranks"), "{e3}");
    }
}
