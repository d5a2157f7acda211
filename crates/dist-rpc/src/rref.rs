//! Remote references: `RRef<T>`, the owner's table of values, and the serde context through
//! which an RRef travels inside arguments and results (see the crate docs for the protocol).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::agent::Agent;
use crate::frame::{FailKind, ForkToken, GlobalId};
use crate::handler::ErasedValue;
use crate::{Result, WorkerInfo};

/// A reference to a value that lives on its owner, the worker that ran the `remote` call
/// that made it (torch's `RRef`).
///
/// Cloning is cheap and shares one registration with the owner; the owner deletes the value
/// once every clone on every worker is dropped (or their workers shut down). An `RRef` can be
/// passed to any worker inside the arguments or the result of a call (it implements
/// `Serialize`/`Deserialize` for that purpose only; serialising it anywhere else fails).
pub struct RRef<T> {
    pub(crate) fork: Arc<ForkShared>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        RRef {
            fork: self.fork.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RRef")
            .field("rref", &self.fork.token.rref)
            .field("fork", &self.fork.token.fork)
            .field("owner", &self.fork.token.owner)
            .finish()
    }
}

/// One fork: this worker's counted reference to an RRef. Dropping it (the last clone of an
/// [`RRef`]) tells the owner.
pub(crate) struct ForkShared {
    pub(crate) agent: Arc<Agent>,
    pub(crate) token: ForkToken,
    pub(crate) released: AtomicBool,
}

impl Drop for ForkShared {
    fn drop(&mut self) {
        self.agent.release_fork(self.token, &self.released);
    }
}

impl<T> RRef<T> {
    pub(crate) fn from_fork(fork: Arc<ForkShared>) -> Self {
        RRef {
            fork,
            _t: PhantomData,
        }
    }

    /// The worker that owns the value.
    pub fn owner(&self) -> WorkerInfo {
        self.fork.agent.worker(self.fork.token.owner)
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.fork.token.owner == self.fork.agent.rank()
    }

    /// The RRef's id (the creating worker's rank and counter), the same on every worker.
    pub fn id(&self) -> GlobalId {
        self.fork.token.rref
    }
}

impl<T: DeserializeOwned + 'static> RRef<T> {
    /// A copy of the value, fetched from the owner (or encoded and decoded locally on the
    /// owner), within the default RPC timeout. Fails with the owner's error if the function
    /// that made the value failed.
    pub fn to_here(&self) -> Result<T> {
        self.to_here_timeout(self.fork.agent.default_timeout())
    }

    /// [`to_here`](Self::to_here) with an explicit timeout (`Duration::MAX`: none).
    pub fn to_here_timeout(&self, timeout: Duration) -> Result<T> {
        self.fork.agent.fetch(self.fork.token, timeout)
    }
}

impl<T: Send + Sync + 'static> RRef<T> {
    /// The value itself, on its owner: waits (up to the default RPC timeout) until the function
    /// that makes it has finished. Fails on any other worker, and when the value has another
    /// type than `T`.
    pub fn local_value(&self) -> Result<Arc<T>> {
        let agent = &self.fork.agent;
        let v = agent.local_value(self.fork.token, agent.default_timeout())?;
        v.into_any().downcast::<T>().map_err(|_| {
            agent.rref_error(
                self.fork.token,
                format!(
                    "local_value: the value is not a {}",
                    std::any::type_name::<T>()
                ),
            )
        })
    }
}

// ---- the serde context ---------------------------------------------------------------------

/// What serialising or deserialising an RRef needs to know, set around the encoding of a
/// call's arguments or result and the decoding of the same.
enum Ctx {
    Encode {
        agent: Arc<Agent>,
        dest: usize,
        forks: Vec<ForkToken>,
    },
    Decode {
        adopted: HashMap<GlobalId, Arc<ForkShared>>,
    },
}

thread_local! {
    /// A stack: a handler that decodes its arguments may encode a nested call's.
    static CTX: RefCell<Vec<Ctx>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` (an encoding for `dest`) with RRef serialisation enabled; returns its result and
/// the forks it created, which the caller must send with the frame (or release on failure).
pub(crate) fn encoding<R>(
    agent: &Arc<Agent>,
    dest: usize,
    f: impl FnOnce() -> R,
) -> (R, Vec<ForkToken>) {
    CTX.with(|c| {
        c.borrow_mut().push(Ctx::Encode {
            agent: agent.clone(),
            dest,
            forks: Vec::new(),
        })
    });
    let out = f();
    let forks = CTX.with(|c| match c.borrow_mut().pop() {
        Some(Ctx::Encode { forks, .. }) => forks,
        _ => Vec::new(),
    });
    (out, forks)
}

/// Runs `f` (a decoding) with the forks that arrived with the frame available to the RRefs
/// inside; forks no RRef claimed are released when this returns.
pub(crate) fn decoding<R>(adopted: Vec<Arc<ForkShared>>, f: impl FnOnce() -> R) -> R {
    let adopted = adopted.into_iter().map(|a| (a.token.fork, a)).collect();
    CTX.with(|c| c.borrow_mut().push(Ctx::Decode { adopted }));
    let out = f();
    // Dropped outside the borrow: releasing a fork may run code that looks at the context.
    let left = CTX.with(|c| c.borrow_mut().pop());
    drop(left);
    out
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let token = CTX.with(|c| {
            let mut stack = c.borrow_mut();
            match stack.last_mut() {
                Some(Ctx::Encode { agent, dest, forks }) => {
                    if self.fork.released.load(Ordering::SeqCst) {
                        // Its owner may already have deleted the value (shutdown released it).
                        return Err("this RRef was released at shutdown".to_owned());
                    }
                    if !Arc::ptr_eq(agent, &self.fork.agent) {
                        return Err(
                            "an RRef of another RPC agent cannot be sent by this one".to_owned()
                        );
                    }
                    let t = agent
                        .fork_for(self.fork.token, *dest)
                        .map_err(|e| e.to_string())?;
                    forks.push(t);
                    Ok(t)
                }
                _ => Err(
                    "an RRef can only be serialised as part of an RPC's arguments or result"
                        .to_owned(),
                ),
            }
        });
        token.map_err(S::Error::custom)?.serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let token = ForkToken::deserialize(d)?;
        let fork = CTX.with(|c| {
            let mut stack = c.borrow_mut();
            match stack.last_mut() {
                Some(Ctx::Decode { adopted, .. }) => adopted.remove(&token.fork).ok_or_else(|| {
                    format!(
                        "RRef fork {} did not arrive with the message (or was decoded twice)",
                        token.fork
                    )
                }),
                _ => Err(
                    "an RRef can only be deserialised from an RPC's arguments or result".to_owned(),
                ),
            }
        });
        fork.map(RRef::from_fork).map_err(D::Error::custom)
    }
}

// ---- the owner's table ---------------------------------------------------------------------

/// The state of an owned value.
pub(crate) enum CellState {
    /// Being made; fetches that arrived meanwhile wait here (peer, call id).
    Pending(Vec<(usize, u64)>),
    /// Made: the value, or the maker's failure.
    Ready(std::result::Result<Arc<dyn ErasedValue>, (FailKind, String)>),
    /// Deleted: every user has released it.
    Gone,
}

/// An owned value and its waiters.
pub(crate) struct ValueCell {
    pub(crate) state: Mutex<CellState>,
    pub(crate) ready: Condvar,
}

impl ValueCell {
    fn new() -> Self {
        ValueCell {
            state: Mutex::new(CellState::Pending(Vec::new())),
            ready: Condvar::new(),
        }
    }

    /// Waits until the value is made or gone, up to `deadline`.
    pub(crate) fn wait(
        &self,
        deadline: Instant,
    ) -> Option<std::result::Result<Arc<dyn ErasedValue>, (FailKind, String)>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*st {
                CellState::Ready(r) => return Some(r.clone()),
                CellState::Gone => {
                    return Some(Err((FailKind::RRefGone, "the RRef was deleted".into())));
                }
                CellState::Pending(_) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self
                .ready
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One owned RRef: its value and who holds it.
struct OwnerEntry {
    cell: Arc<ValueCell>,
    /// Whether the `remote` call that makes it has arrived (until then the entry is a
    /// placeholder made by a fork notice or fetch that overtook it).
    created: bool,
    /// Forks the owner knows to be alive.
    forks: HashSet<GlobalId>,
    /// Forks deleted before their notice arrived (the two travel on different connections).
    tombstones: HashSet<GlobalId>,
}

/// What a change to the table asks the caller to do (outside the table's lock).
pub(crate) struct Deleted {
    /// The cell, now `Gone`; fetches that were waiting must be failed.
    pub(crate) waiters: Vec<(usize, u64)>,
    /// The value, dropped by the caller once no lock is held: it may hold RRefs, whose
    /// release takes the table's lock again.
    pub(crate) _value: CellState,
}

/// The owner's table of values, keyed by RRef id.
#[derive(Default)]
pub(crate) struct Owners {
    map: Mutex<HashMap<GlobalId, OwnerEntry>>,
    deleted: std::sync::atomic::AtomicU64,
}

impl Owners {
    fn entry(map: &mut HashMap<GlobalId, OwnerEntry>, rref: GlobalId) -> &mut OwnerEntry {
        map.entry(rref).or_insert_with(|| OwnerEntry {
            cell: Arc::new(ValueCell::new()),
            created: false,
            forks: HashSet::new(),
            tombstones: HashSet::new(),
        })
    }

    /// The `remote` call making `rref` arrived with its creator's fork.
    pub(crate) fn create(&self, t: ForkToken) -> (Arc<ValueCell>, Option<Deleted>) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let e = Self::entry(&mut map, t.rref);
        e.created = true;
        let cell = e.cell.clone();
        Self::add(e, t.fork);
        let d = self.maybe_delete(&mut map, t.rref);
        (cell, d)
    }

    /// A fork notice (or the owner forking itself).
    pub(crate) fn add_fork(&self, t: ForkToken) -> Option<Deleted> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        Self::add(Self::entry(&mut map, t.rref), t.fork);
        self.maybe_delete(&mut map, t.rref)
    }

    fn add(e: &mut OwnerEntry, fork: GlobalId) {
        if !e.tombstones.remove(&fork) {
            e.forks.insert(fork);
        }
    }

    /// A fork is gone.
    pub(crate) fn del_fork(&self, t: ForkToken) -> Option<Deleted> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let e = Self::entry(&mut map, t.rref);
        if !e.forks.remove(&t.fork) {
            e.tombstones.insert(t.fork);
        }
        self.maybe_delete(&mut map, t.rref)
    }

    fn maybe_delete(
        &self,
        map: &mut HashMap<GlobalId, OwnerEntry>,
        rref: GlobalId,
    ) -> Option<Deleted> {
        let e = map.get(&rref)?;
        if !(e.created && e.forks.is_empty() && e.tombstones.is_empty()) {
            return None;
        }
        let e = map.remove(&rref)?;
        self.deleted.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%rref, "owner deletes an RRef no user holds");
        let mut st = e.cell.state.lock().unwrap_or_else(|p| p.into_inner());
        let (waiters, value) = match std::mem::replace(&mut *st, CellState::Gone) {
            CellState::Pending(w) => (w, CellState::Gone),
            other => (Vec::new(), other),
        };
        drop(st);
        e.cell.ready.notify_all();
        Some(Deleted {
            waiters,
            _value: value,
        })
    }

    /// The cell of `rref` for a fetch. When the table lacks it: a placeholder if the fetch
    /// may have overtaken the creation, `None` if the creation is known to have arrived
    /// (`creation_arrived`), so the value was deleted and a placeholder would never be filled.
    pub(crate) fn cell_for_fetch(
        &self,
        rref: GlobalId,
        creation_arrived: bool,
    ) -> Option<Arc<ValueCell>> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if creation_arrived {
            return map.get(&rref).map(|e| e.cell.clone());
        }
        Some(Self::entry(&mut map, rref).cell.clone())
    }

    /// The cell of `rref` if the owner has it.
    pub(crate) fn existing(&self, rref: GlobalId) -> Option<Arc<ValueCell>> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&rref).map(|e| e.cell.clone())
    }

    /// Live owned values.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Values deleted so far.
    pub(crate) fn deleted(&self) -> u64 {
        self.deleted.load(Ordering::Relaxed)
    }
}

/// Fails with the error for a fetch answered by `kind`.
pub(crate) fn fail_kind_what(kind: FailKind) -> &'static str {
    match kind {
        FailKind::RRefGone => "the owner has deleted it",
        _ => "the function that makes it failed",
    }
}
