//! `cargo xtask test`: the multi-rank suites as real processes, launched through `distrun`.
//!
//! Builds the launcher and the rank programs once, then for each world size runs each program
//! under `distrun --nproc-per-node N`, which fails the whole job (and this command) on the first
//! rank that fails. The programs check their own results: the collective examples assert them,
//! `gloo_bench -c 1` exits non-zero on any wrong element, and `ddp-train` verifies that every
//! rank ends with identical parameters.

use crate::util::{build_release, cargo, project_root, run};

pub(crate) const HELP: &str = "\
cargo xtask test [--world-size N[,N..]]
cargo xtask test --netns
cargo xtask test --gpu

--gpu: the GPU suite of dist-nccl (every op, dtype and size class against a host reference,
a silent rank aborted by the watchdog, split; one rank per GPU), then dist-collective's
device-buffer tests (host staging over Gloo on 1-4 ranks of one GPU, NCCL beside Gloo in one
group, two NCCL ranks on one GPU refused on both), each printing \"skipped: ...\" where no
CUDA driver and NCCL load, then the GPU benchmark's smoke run.

Runs the multi-rank programs as real processes through distrun, default world sizes 2,3,4:
    hello_all_reduce, subgroups (even sizes), ping_pong (size 2),
    gloo_bench (every op at 4 B, 4 KiB + 4, 1 MiB + 4, results checked),
    ddp-train (20 steps, parameters checked identical),
    final_broadcast (1 MiB broadcast, then every rank returns from main without teardown),
    param_server (dist-rpc: 1 server, n - 1 trainers, convergence checked)

--netns: two simulated hosts instead (network, pid and UTS namespaces joined by a veth pair
with netem delay and a rate limit; needs root, skipped with a message otherwise), 2 ranks
each: every collective across them, single-copy transfers only within a host, and a killed
rank named by every survivor.
";

/// One multi-rank program: its path, arguments and extra environment.
struct Job {
    prog: String,
    args: Vec<String>,
    env: Vec<(&'static str, &'static str)>,
}

pub(crate) fn run_tests(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--gpu") {
        return run_gpu();
    }
    let mut sizes = vec![2usize, 3, 4];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--netns" => return crate::netns::run_netns(),
            "--world-size" => {
                let v = it.next().ok_or("--world-size needs a value")?;
                sizes = v
                    .split(',')
                    .map(|s| s.parse().map_err(|_| format!("bad world size `{s}`")))
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unknown argument `{other}`\n\n{HELP}")),
        }
    }
    build_release(
        &[
            "dist-run",
            "ddp-train",
            "dist-collective",
            "dist-gloo",
            "dist-rpc",
        ],
        &["*"],
    )?;
    let bin = project_root().join("target/release");
    let ex = bin.join("examples");
    for &n in &sizes {
        let job =
            |prog: std::path::PathBuf, args: &[&str], env: Vec<(&'static str, &'static str)>| Job {
                prog: prog.display().to_string(),
                args: args.iter().map(|a| a.to_string()).collect(),
                env,
            };
        let mut jobs = vec![
            job(ex.join("hello_all_reduce"), &[], vec![]),
            job(
                ex.join("gloo_bench"),
                &[
                    "--ops",
                    "barrier,allreduce_4B,all_reduce,broadcast,all_gather,reduce_scatter,all_to_all",
                    "--sizes",
                    "4,4100,1048580",
                    "-n",
                    "3",
                    "-w",
                    "1",
                    "-c",
                    "1",
                ],
                vec![],
            ),
            job(bin.join("ddp-train"), &[], vec![("DDP_TRAIN_STEPS", "20")]),
            // Ranks return from main with no teardown call, as soon as their part is done.
            job(ex.join("final_broadcast"), &[], vec![]),
            // RPC: a parameter server and n - 1 trainers; it checks that training converged.
            job(ex.join("param_server"), &[], vec![]),
        ];
        if n % 2 == 0 {
            jobs.push(job(ex.join("subgroups"), &[], vec![]));
        }
        if n == 2 {
            jobs.push(job(ex.join("ping_pong"), &[], vec![]));
        }
        for Job { prog, args, env } in jobs {
            let name = prog.rsplit('/').next().unwrap_or(&prog).to_string();
            println!("==> world size {n}: {name}");
            let mut cmd = std::process::Command::new(bin.join("distrun"));
            cmd.args(["--nproc-per-node", &n.to_string(), "--"])
                .arg(&prog)
                .args(&args);
            for (k, v) in env {
                cmd.env(k, v);
            }
            run(&mut cmd).map_err(|e| format!("world size {n}, {name}: {e}"))?;
        }
    }
    println!("xtask test: all multi-rank programs passed for world sizes {sizes:?}");
    Ok(())
}

/// `--gpu`: dist-nccl's GPU suite and dist-collective's device-buffer tests, one test at a
/// time (they share the GPUs), output shown.
fn run_gpu() -> Result<(), String> {
    run(cargo().args([
        "test",
        "--release",
        "-p",
        "dist-nccl",
        "--test",
        "gpu",
        "--",
        "--test-threads=1",
        "--nocapture",
    ]))?;
    run(cargo().args([
        "test",
        "--release",
        "-p",
        "dist-collective",
        "--features",
        "nccl",
        "--test",
        "gpu_device",
        "--",
        "--test-threads=1",
        "--nocapture",
    ]))?;
    run(cargo().args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "dist-nccl",
        "--example",
        "nccl_perf",
        "--",
        "all_reduce",
        "-b",
        "8",
        "-e",
        "1M",
        "-f",
        "32",
        "-n",
        "3",
    ]))?;
    println!("xtask test --gpu: done (see above whether it ran or was skipped)");
    Ok(())
}
