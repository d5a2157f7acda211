//! Our binaries run unchanged under Open MPI's `mpirun`: `dist_backend::init`'s `env://` path
//! reads the `OMPI_COMM_WORLD_*` variables, and rank 0 hosts the store at the exported
//! `MASTER_ADDR:MASTER_PORT`. Skipped (with a message) where `mpirun` is not installed; CI does
//! not install it (`apt-get install openmpi-bin` does).

use std::process::Command;
use std::time::Duration;

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
    // Keep rank 0 (the server) up until every rank has seen every key.
    info.store.add("done", 1).unwrap();
    if info.rank == 0 {
        while info.store.add("done", 0).unwrap() < info.world_size as i64 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", "MASTER_ADDR=127.0.0.1"])
        .arg("-x")
        .arg(format!("MASTER_PORT={port}"))
        .args(["-x", "DIST_MPI_TEST_WORKER=1"])
        .arg(exe)
        .args(["mpi_worker", "--exact", "--nocapture", "--test-threads=1"]);
    // torchrun's variables would take precedence over Open MPI's.
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_USE_AGENT_STORE",
    ] {
        cmd.env_remove(v);
    }
    let out = cmd.output().expect("run mpirun");
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
