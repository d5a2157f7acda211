//! Handlers and helpers shared by the thread and process tests.

#![allow(dead_code, reason = "each test binary uses part of the helpers")]

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use dist_backend::store::HashStore;
use dist_rpc::{Handlers, RRef, Rpc, RpcOptions, init_rpc};
use serde::{Deserialize, Serialize};

/// A value kept by an RRef owner; drops of the owner's original (not of copies decoded by
/// `to_here`) are counted per tag, so a test sees how often the owner deleted it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Tracked {
    pub(crate) tag: String,
    pub(crate) data: Vec<u64>,
    #[serde(skip)]
    pub(crate) original: bool,
}

/// A result whose encoding panics (a `Serialize` impl with a bug), with this message: the
/// callee must still answer, and keep its pool thread.
#[derive(Debug, Deserialize)]
pub(crate) struct EncodePanics(pub(crate) String);

impl Serialize for EncodePanics {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("{}", self.0)
    }
}

static DROPS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
static DROPS_CV: Condvar = Condvar::new();

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.original {
            let mut d = DROPS.lock().unwrap();
            *d.get_or_insert_with(HashMap::new)
                .entry(self.tag.clone())
                .or_default() += 1;
            DROPS_CV.notify_all();
        }
    }
}

/// Waits until the owner's original of `tag` has been dropped `n` times (bounded).
pub(crate) fn wait_drops(tag: &str, n: usize) {
    let mut d = DROPS.lock().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while d.as_ref().and_then(|m| m.get(tag).copied()).unwrap_or(0) < n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "{tag} was not dropped {n} time(s)");
        d = DROPS_CV.wait_timeout(d, left).unwrap().0;
    }
}

/// A value kept by an RRef owner whose drop (of the owner's original) waits until the gate
/// of its key opens (bounded): holds the thread that deletes it at that point.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Gated {
    pub(crate) key: String,
    #[serde(skip)]
    pub(crate) original: bool,
}

impl Drop for Gated {
    fn drop(&mut self) {
        if self.original {
            wait_gate(&self.key);
        }
    }
}

/// How many times the owner's original of `tag` was dropped.
pub(crate) fn drops(tag: &str) -> usize {
    DROPS
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|d| d.get(tag).copied())
        .unwrap_or(0)
}

/// Gates that a `block` handler waits on until a `release` call opens them.
static GATES: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);
static GATE_CV: Condvar = Condvar::new();
/// How many `block` handlers entered, per key.
static ENTERED: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
static ENTERED_CV: Condvar = Condvar::new();

/// RRefs kept alive by the `stash` handler, per key.
static STASH: Mutex<Option<HashMap<String, Vec<RRef<Tracked>>>>> = Mutex::new(None);

/// Waits until `n` `block` handlers with `key` have started (bounded).
pub(crate) fn wait_entered(key: &str, n: usize) {
    let mut e = ENTERED.lock().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while e.as_ref().and_then(|m| m.get(key).copied()).unwrap_or(0) < n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "block({key}) handlers did not start");
        e = ENTERED_CV.wait_timeout(e, left).unwrap().0;
    }
}

/// Waits until the gate of `key` is open (bounded).
fn wait_gate(key: &str) {
    let mut g = GATES.lock().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !g
        .as_ref()
        .and_then(|m| m.get(key).copied())
        .unwrap_or(false)
    {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "the gate {key} never opened");
        g = GATE_CV.wait_timeout(g, left).unwrap().0;
    }
}

/// Opens the gate of `key` (what the `release` handler does).
pub(crate) fn open_gate(key: &str) {
    GATES
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(key.to_owned(), true);
    GATE_CV.notify_all();
}

/// The functions every test worker serves.
pub(crate) fn handlers() -> Handlers {
    let h = Handlers::new();
    h.register("add", |(a, b): (i64, i64)| Ok(a + b));
    h.register("fail", |msg: String| -> Result<(), String> { Err(msg) });
    h.register("panic", |msg: String| -> Result<(), String> {
        panic!("{msg}")
    });
    // Returns (or, for `remote`, keeps) a value whose encoding panics.
    h.register("encode_panics", |msg: String| Ok(EncodePanics(msg)));
    h.register("slow_add", |(a, b, ms): (i64, i64, u64)| {
        // Keeps a call in flight (tests of shutdown), not a synchronisation.
        std::thread::sleep(Duration::from_millis(ms));
        Ok(a + b)
    });
    h.register("block", |key: String| {
        {
            let mut e = ENTERED.lock().unwrap();
            *e.get_or_insert_with(HashMap::new)
                .entry(key.clone())
                .or_default() += 1;
            ENTERED_CV.notify_all();
        }
        let mut g = GATES.lock().unwrap();
        while !g
            .as_ref()
            .and_then(|m| m.get(&key).copied())
            .unwrap_or(false)
        {
            g = GATE_CV.wait(g).unwrap();
        }
        Ok(key)
    });
    h.register("release", |key: String| {
        open_gate(&key);
        Ok(())
    });
    h.register("make_gated", |key: String| {
        Ok(Gated {
            key,
            original: true,
        })
    });
    h.register_bytes("inc_bytes", |_rpc: &Rpc, mut b: Vec<u8>| {
        for x in &mut b {
            *x = x.wrapping_add(1);
        }
        Ok(b)
    });
    h.register_bytes("len_bytes", |_rpc: &Rpc, b: Vec<u8>| {
        Ok((b.len() as u64).to_le_bytes().to_vec())
    });
    h.register("make_tracked", |(tag, n): (String, u64)| {
        Ok(Tracked {
            tag,
            data: (0..n).collect(),
            original: true,
        })
    });
    h.register("sum_rref", |r: RRef<Tracked>| {
        let t = r.to_here().map_err(|e| e.to_string())?;
        Ok(t.data.iter().sum::<u64>())
    });
    // Passes the RRef on to worker `next` (a fork of a fork) and returns what it summed.
    h.register_with(
        "forward_rref",
        |rpc: &Rpc, (r, next): (RRef<Tracked>, usize)| {
            rpc.rpc_sync::<_, u64>(next, "sum_rref", &r)
                .map_err(|e| e.to_string())
        },
    );
    h.register("stash", |(key, r): (String, RRef<Tracked>)| {
        STASH
            .lock()
            .unwrap()
            .get_or_insert_with(HashMap::new)
            .entry(key)
            .or_default()
            .push(r);
        Ok(())
    });
    h.register("unstash_sum", |key: String| {
        let taken = STASH
            .lock()
            .unwrap()
            .get_or_insert_with(HashMap::new)
            .remove(&key)
            .unwrap_or_default();
        let mut sum = 0u64;
        for r in &taken {
            sum += r
                .to_here()
                .map_err(|e| e.to_string())?
                .data
                .iter()
                .sum::<u64>();
        }
        Ok(sum)
    });
    // Passes the RRef along `path` (each hop a new fork), the last hop fetches the value;
    // every hop returns the sum and the RRef it was given (an RRef inside a result).
    h.register_with(
        "relay",
        |rpc: &Rpc, (r, path): (RRef<Tracked>, Vec<usize>)| {
            let sum = match path.split_first() {
                None => r
                    .to_here()
                    .map_err(|e| e.to_string())?
                    .data
                    .iter()
                    .sum::<u64>(),
                Some((next, rest)) => {
                    let (sum, _back): (u64, RRef<Tracked>) = rpc
                        .rpc_sync(*next, "relay", &(r.clone(), rest.to_vec()))
                        .map_err(|e| e.to_string())?;
                    sum
                }
            };
            Ok((sum, r))
        },
    );
    // Returns an RRef it received (an RRef travelling inside a result).
    h.register("bounce_rref", |r: RRef<Tracked>| Ok(r));
    h.register("pid", |(): ()| Ok(std::process::id()));
    // A handler may not shut down the agent that runs it: the error comes back as its result.
    h.register_with("shutdown_inside", |rpc: &Rpc, (): ()| {
        Ok(rpc
            .shutdown()
            .map_err(|e| e.to_string())
            .err()
            .unwrap_or_default())
    });
    h
}

/// Runs `f` on `n` workers, each a thread with its own `init_rpc` (its own listener, sockets,
/// pool and threads) over one in-memory store, and returns their results in rank order.
pub(crate) fn thread_world<R: Send>(
    n: usize,
    opts: RpcOptions,
    f: impl Fn(Rpc) -> R + Sync,
) -> Vec<R> {
    let store = Arc::new(HashStore::new(Duration::from_secs(60)));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let store = store.clone();
                let opts = opts.clone();
                let f = &f;
                s.spawn(move || {
                    let rpc = init_rpc(
                        &format!("w{r}"),
                        Some(r),
                        Some(n),
                        opts.store(store).handlers(handlers()),
                    )
                    .unwrap_or_else(|e| panic!("init of w{r}: {e}"));
                    f(rpc)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("worker thread panicked"))
            .collect()
    })
}
