//! Init from `env://`, `tcp://` and `file://` with several ranks on threads.

use std::collections::HashMap;
use std::thread;
use std::time::Duration;

use dist_backend::init::{InitConfig, Launcher, init_from_url_with};
use dist_backend::store::TcpStoreServer;

const T: Duration = Duration::from_secs(10);

#[test]
fn env_init_rank0_hosts_the_store() {
    // Rank 0 serves the store on a server bound to port 0, whose port the others get as
    // MASTER_PORT (binding a port found free earlier could race with another process).
    let mut server = Some(TcpStoreServer::start(0).unwrap());
    let port = server.as_ref().unwrap().port();
    let world = 4;
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let server = if rank == 0 { server.take() } else { None };
            thread::spawn(move || {
                let vars: HashMap<&str, String> = HashMap::from([
                    ("MASTER_ADDR", "127.0.0.1".to_owned()),
                    ("MASTER_PORT", port.to_string()),
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_RANK", (rank % 2).to_string()),
                    ("LOCAL_WORLD_SIZE", "2".to_owned()),
                ]);
                let env = |k: &str| vars.get(k).cloned();
                let info = match server {
                    Some(server) => InitConfig::from_lookup(env)
                        .unwrap()
                        .connect_with_server(server, T)
                        .unwrap(),
                    None => init_from_url_with("env://", None, None, T, &env).unwrap(),
                };
                assert_eq!(info.rank, rank);
                assert_eq!(info.world_size, world);
                assert_eq!(info.local_rank, rank % 2);
                assert_eq!(info.local_world_size, 2);
                assert_eq!(info.launcher, Launcher::Torchrun);
                info.store.set(&format!("hello/{rank}"), b"hi").unwrap();
                let keys: Vec<String> = (0..world).map(|r| format!("hello/{r}")).collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                info.store.wait(&refs, T).unwrap();
                let seen = info.store.multi_get(&refs).unwrap();
                // Keep rank 0 (the server) alive until everyone is done reading: the last
                // reader says so, and rank 0 waits for it.
                if info.store.add("done", 1).unwrap() == world as i64 {
                    info.store.set("all_done", b"").unwrap();
                }
                if rank == 0 {
                    info.store.wait(&["all_done"], T).unwrap();
                }
                seen
            })
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), vec![b"hi".to_vec(); world]);
    }
}

#[test]
fn tcp_init_with_query_arguments() {
    let server = TcpStoreServer::start(0).unwrap();
    let port = server.port();
    let none = |_: &str| None;
    let h = thread::spawn(move || {
        let url = format!("tcp://127.0.0.1:{port}?rank=1&world_size=2");
        let info = init_from_url_with(&url, None, None, T, &none).unwrap();
        assert_eq!((info.rank, info.world_size), (1, 2));
        assert_eq!(info.store.get("from0").unwrap(), b"x");
        info.store.set("from1", b"y").unwrap();
    });
    // Rank 0 serves the store on the server bound to port 0.
    let mut cfg = InitConfig::resolve(&none, Some(0), Some(2)).unwrap();
    cfg.master_addr = Some("localhost".to_owned());
    let info = cfg.connect_with_server(server, T).unwrap();
    assert_eq!(info.launcher, Launcher::Explicit);
    info.store.set("from0", b"x").unwrap();
    assert_eq!(info.store.get("from1").unwrap(), b"y");
    h.join().unwrap();
}

#[test]
fn file_init() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("rdzv").display());
    let none = |_: &str| None;
    let hs: Vec<_> = (0..3)
        .map(|rank| {
            let url = url.clone();
            thread::spawn(move || {
                let info = init_from_url_with(&url, Some(rank), Some(3), T, &none).unwrap();
                let n = info.store.add("arrived", 1).unwrap();
                if n == 3 {
                    info.store.set("go", b"").unwrap();
                }
                info.store.wait(&["go"], T).unwrap();
                info.store.get("arrived").unwrap()
            })
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), b"3");
    }
}

#[test]
fn env_init_fails_without_master() {
    let vars = HashMap::from([("RANK", "1"), ("WORLD_SIZE", "2")]);
    let e = init_from_url_with("env://", None, None, T, &|k| {
        vars.get(k).map(|v| (*v).to_owned())
    })
    .unwrap_err();
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
}

#[test]
fn env_init_with_agent_store_makes_every_rank_a_client() {
    // The launcher (torchrun's agent, distrun) already serves the store on the master port:
    // rank 0 must connect to it rather than fail to bind.
    let server = TcpStoreServer::start(0).unwrap();
    let port = server.port();
    let world = 3;
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            thread::spawn(move || {
                let vars: HashMap<&str, String> = HashMap::from([
                    ("MASTER_ADDR", "127.0.0.1".to_owned()),
                    ("MASTER_PORT", port.to_string()),
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("TORCHELASTIC_USE_AGENT_STORE", "True".to_owned()),
                    ("TORCHELASTIC_RESTART_COUNT", "2".to_owned()),
                ]);
                let info =
                    init_from_url_with("env://", None, None, T, &|k| vars.get(k).cloned()).unwrap();
                assert_eq!(info.rank, rank);
                info.store.set(&format!("r{rank}"), b"x").unwrap();
                info.store.wait(&["r0", "r1", "r2"], T).unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    // Keys live under the attempt's namespace, as in torch.
    let raw = dist_backend::store::TcpStore::connect("127.0.0.1", port, T).unwrap();
    use dist_backend::store::Store;
    assert_eq!(raw.get("/worker/attempt_2/r1").unwrap(), b"x");
    assert!(!raw.check(&["r1"]).unwrap());
}
