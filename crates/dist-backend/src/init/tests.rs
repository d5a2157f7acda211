//! The launchers' variables, node lists, URLs and their errors.

use std::collections::HashMap;
use std::time::Duration;

use super::url::host_port;
use super::*;
use crate::Result;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k| m.get(k).cloned()
}

fn init_msg(r: Result<InitConfig>) -> String {
    match r {
        Err(Error::Init { what }) => what,
        other => panic!("expected Error::Init, got {other:?}"),
    }
}

#[test]
fn torchrun_variables() {
    let c = InitConfig::from_lookup(env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "host0"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap();
    assert_eq!(
        c,
        InitConfig {
            rank: 3,
            world_size: 8,
            local_rank: 1,
            local_world_size: 2,
            master_addr: Some("host0".into()),
            master_port: Some(29500),
            launcher: Launcher::Torchrun,
            agent_store: None,
        }
    );
}

#[test]
fn agent_store_variables() {
    let base = [("RANK", "0"), ("WORLD_SIZE", "2")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        InitConfig::from_lookup(env(&v))
    };
    assert_eq!(with(&[]).unwrap().agent_store, None);
    let c = with(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap();
    assert_eq!(c.agent_store, None);
    let c = with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]).unwrap();
    assert_eq!(c.agent_store, Some(0));
    let c = with(&[
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "3"),
    ])
    .unwrap();
    assert_eq!(c.agent_store, Some(3));
    let m = init_msg(with(&[
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "x"),
    ]));
    assert!(m.contains("TORCHELASTIC_RESTART_COUNT"), "{m}");
}

#[test]
fn contradictions_name_the_variable() {
    let m = init_msg(InitConfig::from_lookup(env(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
    ])));
    assert!(m.contains("RANK=4") && m.contains("WORLD_SIZE=4"), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[("RANK", "0")])));
    assert!(m.contains("WORLD_SIZE"), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[("WORLD_SIZE", "2")])));
    assert!(m.contains("RANK"), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[
        ("RANK", "x1"),
        ("WORLD_SIZE", "2"),
    ])));
    assert!(m.contains("RANK=\"x1\""), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "0"),
    ])));
    assert!(m.contains("WORLD_SIZE=0"), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
    ])));
    assert!(m.contains("LOCAL_RANK=2"), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("MASTER_PORT", "99999"),
    ])));
    assert!(m.contains("MASTER_PORT"), "{m}");
    let m = init_msg(InitConfig::from_lookup(env(&[])));
    assert!(m.contains("RANK"), "{m}");
}

#[test]
fn slurm_variables_and_nodelist() {
    let c = InitConfig::from_lookup(env(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "4(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[07-08,10],cpu1"),
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_STEP_ID", "0"),
    ]))
    .unwrap();
    assert_eq!(c.launcher, Launcher::Slurm);
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (5, 8, 1, 4)
    );
    assert_eq!(c.master_addr.as_deref(), Some("gpu07"));
    assert_eq!(c.master_port, Some(15000 + (123_456 % 20000) as u16));
    // MASTER_ADDR/PORT win over Slurm's.
    let c = InitConfig::from_lookup(env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_JOB_NODELIST", "n1"),
        ("MASTER_ADDR", "m"),
        ("MASTER_PORT", "1234"),
    ]))
    .unwrap();
    assert_eq!(c.master_addr.as_deref(), Some("m"));
    assert_eq!(c.master_port, Some(1234));
    let m = init_msg(InitConfig::from_lookup(env(&[
        ("SLURM_PROCID", "8"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_STEPID", "0"),
    ])));
    assert!(
        m.contains("SLURM_PROCID=8") && m.contains("SLURM_NTASKS=8"),
        "{m}"
    );
}

#[test]
fn mpi_and_pmi_variables() {
    let c = InitConfig::from_lookup(env(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]))
    .unwrap();
    assert_eq!(c.launcher, Launcher::OpenMpi);
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (2, 4, 0, 2)
    );
    let c = InitConfig::from_lookup(env(&[("PMI_RANK", "1"), ("PMI_SIZE", "3")])).unwrap();
    assert_eq!(c.launcher, Launcher::Pmi);
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (1, 3, 1, 3)
    );
    // torchrun's variables take precedence over a surrounding launcher's.
    let c = InitConfig::from_lookup(env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "3"),
    ]))
    .unwrap();
    assert_eq!(c.launcher, Launcher::Torchrun);
    assert_eq!((c.rank, c.world_size), (0, 2));
    // mpirun inside an sbatch script: every process inherits the batch step's Slurm
    // variables (rank 0 of 8), and Open MPI's own say which rank it is.
    let c = InitConfig::from_lookup(env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "0"),
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
    ]))
    .unwrap();
    assert_eq!(c.launcher, Launcher::OpenMpi);
    assert_eq!((c.rank, c.world_size), (5, 8));
}

#[test]
fn explicit_arguments_override() {
    let c =
        InitConfig::resolve(&env(&[("RANK", "3"), ("WORLD_SIZE", "4")]), Some(1), None).unwrap();
    assert_eq!((c.rank, c.world_size), (1, 4));
    let c = InitConfig::resolve(&env(&[]), Some(0), Some(2)).unwrap();
    assert_eq!(c.launcher, Launcher::Explicit);
    assert_eq!((c.local_rank, c.local_world_size), (0, 2));
    let e = InitConfig::resolve(&env(&[]), Some(2), Some(2)).unwrap_err();
    assert!(e.to_string().contains("rank=2"), "{e}");
}

#[test]
fn nodelists() {
    assert_eq!(
        expand_nodelist("node[01-04,07],gpu1").unwrap(),
        ["node01", "node02", "node03", "node04", "node07", "gpu1"]
    );
    assert_eq!(
        expand_nodelist("r[1-2]n[8-9]").unwrap(),
        ["r1n8", "r1n9", "r2n8", "r2n9"]
    );
    assert_eq!(expand_nodelist("a,b").unwrap(), ["a", "b"]);
    assert_eq!(expand_nodelist("x[9-11]").unwrap(), ["x9", "x10", "x11"]);
    assert_eq!(first_host("node[001-999999],z").unwrap(), "node001");
    assert_eq!(first_host(" ,host-a.example").unwrap(), "host-a.example");
    for bad in ["n[1-", "n]", "n[4-2]", "n[a-b]", "", "n[-3]"] {
        assert!(expand_nodelist(bad).is_err(), "{bad}");
    }
}

#[test]
fn host_ports() {
    assert_eq!(host_port("h:1", "u").unwrap(), ("h".into(), 1));
    assert_eq!(
        host_port("[::1]:29500", "u").unwrap(),
        ("::1".into(), 29500)
    );
    assert!(host_port("h", "u").is_err());
    assert!(host_port(":5", "u").is_err());
    assert!(host_port("h:70000", "u").is_err());
}

#[test]
fn urls_need_rank_and_world_size() {
    let none = |_: &str| None;
    let t = Duration::from_millis(100);
    let e = init_from_url_with("tcp://127.0.0.1:1", None, Some(2), t, &none).unwrap_err();
    assert!(e.to_string().contains("rank"), "{e}");
    let e = init_from_url_with("bogus://x", Some(0), Some(1), t, &none).unwrap_err();
    assert!(e.to_string().contains("bogus"), "{e}");
    let e = init_from_url_with("no-scheme", Some(0), Some(1), t, &none).unwrap_err();
    assert!(matches!(e, Error::Init { .. }), "{e}");
    let e = init_from_url_with(
        "env://",
        None,
        None,
        t,
        &env(&[("RANK", "0"), ("WORLD_SIZE", "1")]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
}

#[test]
fn the_local_rank_alone_comes_from_the_launcher_that_set_the_ranks() {
    let lr = |vars: &[(&str, &str)]| local_rank_from_lookup(&env(vars));
    assert_eq!(lr(&[("RANK", "5"), ("LOCAL_RANK", "1")]), Some(1));
    // mpirun inside sbatch: Open MPI's local rank, not the batch step's SLURM_LOCALID.
    assert_eq!(
        lr(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
        ]),
        Some(3)
    );
    assert_eq!(
        lr(&[("SLURM_PROCID", "7"), ("SLURM_LOCALID", "2")]),
        Some(2)
    );
    assert_eq!(lr(&[("PMI_RANK", "1"), ("PMI_LOCAL_RANK", "1")]), Some(1));
    // No launcher, none of its local rank, or one that is not a number.
    assert_eq!(lr(&[("LOCAL_RANK", "1")]), None);
    assert_eq!(lr(&[("RANK", "1")]), None);
    assert_eq!(lr(&[("RANK", "1"), ("LOCAL_RANK", "one")]), None);
}

/// Slurm's tasks per node is read for this node (`2(x3),1`: node 3 runs 1 task, the others 2),
/// where its leading count was taken on every node and init refused local rank 1 on a node
/// of 3 tasks behind a node of 1; a step's store is on the step's first node, on a port of its
/// own.
#[test]
fn slurm_tasks_per_node_and_the_steps_nodes_and_port() {
    let base = [
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_JOB_NODELIST", "n[1-8]"),
        ("SLURM_STEP_NUM_TASKS", "7"),
    ];
    let with = |more: &[(&'static str, &'static str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(more);
        InitConfig::from_lookup(env(&v))
    };
    let c = with(&[
        ("SLURM_TASKS_PER_NODE", "1,3(x2)"),
        ("SLURM_NODEID", "1"),
        ("SLURM_LOCALID", "1"),
    ])
    .unwrap();
    assert_eq!((c.local_rank, c.local_world_size), (1, 3));
    let c = with(&[
        ("SLURM_TASKS_PER_NODE", "2(x3),1"),
        ("SLURM_NODEID", "3"),
        ("SLURM_LOCALID", "0"),
    ])
    .unwrap();
    assert_eq!(c.local_world_size, 1);
    let m = with(&[("SLURM_TASKS_PER_NODE", "2(x3),1"), ("SLURM_NODEID", "4")])
        .unwrap_err()
        .to_string();
    assert!(m.contains("lists 4 nodes, but SLURM_NODEID=4"), "{m}");
    let m = with(&[("SLURM_TASKS_PER_NODE", "2(x")])
        .unwrap_err()
        .to_string();
    assert!(m.contains("not a Slurm tasks-per-node list"), "{m}");
    // The step's node list and id choose the store's host and port.
    let c = with(&[("SLURM_STEP_NODELIST", "n[5-6]"), ("SLURM_STEP_ID", "1")]).unwrap();
    assert_eq!(c.master_addr.as_deref(), Some("n5"));
    let job_port = 15000 + (123_456 % 20000) as u16;
    assert_eq!(c.master_port, Some(15000 + 3456 + 4999));
    assert_ne!(c.master_port, Some(job_port));
    let c = with(&[("SLURM_STEP_ID", "batch")]).unwrap();
    assert_eq!(
        (c.master_addr.as_deref(), c.master_port),
        (Some("n1"), Some(job_port))
    );
}

/// A program run straight from an `sbatch` script (no `srun`) reads the batch step's
/// variables, rank 0 of the job's tasks: it is refused at once, where it waited out its timeout
/// for ranks nothing starts. A job of one task may still run there.
#[test]
fn the_batch_script_is_not_a_rank_of_a_step() {
    let batch = [
        ("SLURM_JOB_ID", "200505"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_PROCID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "0"),
        ("SLURM_TASKS_PER_NODE", "1(x4)"),
        ("SLURM_JOB_NODELIST", "gnode[10,20,25,37]"),
    ];
    let m = init_msg(InitConfig::from_lookup(env(&batch)));
    assert!(
        m.contains("SLURM_NTASKS=4") && m.contains("not a task of an srun step"),
        "{m}"
    );
    for step_var in [
        "SLURM_STEP_ID",
        "SLURM_STEPID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_NODELIST",
    ] {
        let mut v = batch.to_vec();
        v.push((step_var, "4"));
        let c = InitConfig::from_lookup(env(&v)).unwrap();
        assert_eq!((c.rank, c.world_size), (0, 4), "{step_var}");
    }
    let mut one = batch.to_vec();
    one[1] = ("SLURM_NTASKS", "1");
    one[5] = ("SLURM_TASKS_PER_NODE", "1");
    let c = InitConfig::from_lookup(env(&one)).unwrap();
    assert_eq!((c.rank, c.world_size), (0, 1));
    // Rank and world size given: the batch script knows what it asks for.
    let c = InitConfig::resolve(&env(&batch), Some(0), Some(1)).unwrap();
    assert_eq!((c.rank, c.world_size), (0, 1));
}

/// `srun --mpi=pmi2` sets `PMI_RANK` and `PMI_SIZE` but no PMI local rank: Slurm's own local
/// rank and tasks per node are used, where the global rank was taken as the local one. An
/// `mpirun` inside an `sbatch` script, whose batch-step Slurm variables number no step, is not
/// taken in.
#[test]
fn under_srun_with_pmi2_the_local_rank_is_slurms() {
    let pmi2 = [
        ("PMI_RANK", "5"),
        ("PMI_SIZE", "8"),
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_STEP_ID", "0"),
    ];
    let c = InitConfig::from_lookup(env(&pmi2)).unwrap();
    assert_eq!(c.launcher, Launcher::Pmi);
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (5, 8, 1, 4)
    );
    assert_eq!(local_rank_from_lookup(&env(&pmi2)), Some(1));
    // MPICH's hydra inside an sbatch script: the batch step's SLURM_PROCID=0 is not this rank.
    let hydra = [
        ("PMI_RANK", "5"),
        ("PMI_SIZE", "8"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "0"),
    ];
    let c = InitConfig::from_lookup(env(&hydra)).unwrap();
    assert_eq!((c.local_rank, c.local_world_size), (5, 8));
    assert_eq!(local_rank_from_lookup(&env(&hydra)), None);
}
