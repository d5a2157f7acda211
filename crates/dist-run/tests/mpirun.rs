//! Our binaries run unchanged under Open MPI's `mpirun`: `dist_backend::init`'s `env://` path
//! reads the `OMPI_COMM_WORLD_*` variables and joins the store at the exported
//! `MASTER_ADDR:MASTER_PORT`. The test process serves that store itself, on a port it bound as
//! port 0 (so no other process can have taken it), and exports
//! `TORCHELASTIC_USE_AGENT_STORE=True` so that rank 0 joins it as a client, as under a launcher
//! that serves the store (rank 0 serving the store itself is covered in `dist-backend`'s
//! `tests/init.rs`). Skipped (with a message) where `mpirun` is not installed; CI does not
//! install it (`apt-get install openmpi-bin` does).

use std::process::Command;
use std::time::Duration;

use dist_backend::store::TcpStoreServer;

/// A rank under mpirun: this test binary re-run with `DIST_MPI_TEST_WORKER` set.
#[test]
fn mpi_worker() {
    if std::env::var_os("DIST_MPI_TEST_WORKER").is_none() {
        return;
    }
    let info = dist_backend::init::init_from_url("env://", None, None, Duration::from_secs(20))
        .expect("env:// init under mpirun");
    let keys: Vec<String> = (0..info.world_size).map(|r| format!("mpi/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    info.store.set(&keys[info.rank], b"here").unwrap();
    info.store.wait(&refs, Duration::from_secs(20)).unwrap();
    println!(
        "MPI rank={} world={} local_rank={} local_world={} launcher={}",
        info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher
    );
}

fn mpirun_installed() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn env_init_reads_open_mpi_variables_under_mpirun() {
    if !mpirun_installed() {
        eprintln!(
            "skipped: mpirun is not installed (apt-get install openmpi-bin to run this test)"
        );
        return;
    }
    // The store lives here until mpirun has returned, so no rank has to outlive the others.
    let server = TcpStoreServer::start(0).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", "MASTER_ADDR=127.0.0.1"])
        .arg("-x")
        .arg(format!("MASTER_PORT={}", server.port()))
        .args(["-x", "TORCHELASTIC_USE_AGENT_STORE=True"])
        .args(["-x", "TORCHELASTIC_RESTART_COUNT=0"])
        .args(["-x", "DIST_MPI_TEST_WORKER=1"])
        .arg(exe)
        .args(["mpi_worker", "--exact", "--nocapture", "--test-threads=1"]);
    // torchrun's variables would take precedence over Open MPI's.
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        cmd.env_remove(v);
    }
    let out = cmd.output().expect("run mpirun");
    drop(server);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{out:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..2 {
        let want = format!("MPI rank={r} world=2 local_rank={r} local_world=2 launcher=open-mpi");
        // libtest's "test mpi_worker ... " may precede it on the line.
        assert!(stdout.contains(&want), "{want}: {stdout}");
    }
}
