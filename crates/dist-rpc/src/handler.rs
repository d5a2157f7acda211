//! Functions callable by name: the registry, and the type erasure that turns a typed
//! `Fn(A) -> Result<R, String>` into bytes in, bytes (or a kept value) out.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Rpc;

/// A handler's result kept as a value (for `remote`, whose result stays on the owner) that can
/// still be encoded on demand (for `to_here`) and downcast (for `local_value`).
pub(crate) trait ErasedValue: Send + Sync {
    /// The value as JSON.
    fn encode(&self) -> serde_json::Result<Vec<u8>>;
    /// The value as `Any`, to downcast to the caller's type.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

impl<T: Serialize + Send + Sync + 'static> ErasedValue for T {
    fn encode(&self) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(self)
    }
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

/// The arguments as they arrived.
pub(crate) struct Input {
    /// JSON arguments (typed calls).
    pub(crate) body: Vec<u8>,
    /// Raw-byte arguments (byte calls).
    pub(crate) blob: Vec<u8>,
    /// Whether the caller sent raw bytes.
    pub(crate) raw: bool,
}

/// What a handler produced.
pub(crate) enum Output {
    /// A typed value (encoded for a reply, kept for `remote`).
    Value(Arc<dyn ErasedValue>),
    /// Raw bytes (the reply's blob).
    Bytes(Vec<u8>),
}

/// Why a handler produced nothing.
pub(crate) enum Failure {
    /// The arguments did not decode.
    BadArguments(String),
    /// The handler returned an error.
    User(String),
}

/// A registered function, type-erased.
pub(crate) type Erased = Arc<dyn Fn(&Rpc, Input) -> Result<Output, Failure> + Send + Sync>;

/// The functions a worker serves, by name. Cloning shares the table, so handlers registered
/// after `init_rpc` through [`Rpc::register`] are seen by calls that arrive later.
///
/// Register every function a peer may call before `init_rpc` (through
/// [`RpcOptions::handlers`](crate::RpcOptions::handlers)): a peer may call as soon as its own
/// init returns, and a call to a name not yet registered fails with
/// [`Error::UnknownFunction`](crate::Error::UnknownFunction).
#[derive(Clone, Default)]
pub struct Handlers {
    table: Arc<RwLock<HashMap<String, Erased>>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<&String> = table.keys().collect();
        names.sort();
        f.debug_struct("Handlers").field("names", &names).finish()
    }
}

fn decode_args<A: DeserializeOwned>(input: &Input) -> Result<A, Failure> {
    if input.raw {
        return Err(Failure::BadArguments(
            "it takes serde arguments but was called with raw bytes (rpc_*_bytes)".into(),
        ));
    }
    serde_json::from_slice(&input.body)
        .map_err(|e| Failure::BadArguments(format!("expected {}: {e}", std::any::type_name::<A>())))
}

impl Handlers {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `f` under `name` (replacing any handler of that name): a call decodes its
    /// arguments into `A`, and the `Ok` value is sent back (or kept, for `remote`); an `Err`
    /// reaches the caller as [`Error::Remote`](crate::Error::Remote) with this message.
    pub fn register<A, R, F>(&self, name: &str, f: F) -> &Self
    where
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(A) -> Result<R, String> + Send + Sync + 'static,
    {
        self.register_with(name, move |_: &Rpc, a: A| f(a))
    }

    /// [`register`](Self::register) for a handler that needs the worker it runs on, e.g. to
    /// call other workers or to pass on an RRef it received.
    pub fn register_with<A, R, F>(&self, name: &str, f: F) -> &Self
    where
        A: DeserializeOwned + 'static,
        R: Serialize + Send + Sync + 'static,
        F: Fn(&Rpc, A) -> Result<R, String> + Send + Sync + 'static,
    {
        let erased: Erased = Arc::new(move |rpc: &Rpc, input: Input| {
            let a: A = decode_args(&input)?;
            match f(rpc, a) {
                Ok(r) => Ok(Output::Value(Arc::new(r))),
                Err(e) => Err(Failure::User(e)),
            }
        });
        self.insert(name, erased);
        self
    }

    /// Registers a raw-bytes handler: the caller's bytes arrive as one `Vec<u8>` read straight
    /// from the socket (no serde pass), and the returned bytes go back the same way. The fast
    /// path for large tensors (`bytemuck` casts them to and from bytes).
    pub fn register_bytes<F>(&self, name: &str, f: F) -> &Self
    where
        F: Fn(&Rpc, Vec<u8>) -> Result<Vec<u8>, String> + Send + Sync + 'static,
    {
        let erased: Erased = Arc::new(move |rpc: &Rpc, input: Input| {
            if !input.raw {
                return Err(Failure::BadArguments(
                    "it takes raw bytes (rpc_*_bytes) but was called with serde arguments".into(),
                ));
            }
            f(rpc, input.blob).map(Output::Bytes).map_err(Failure::User)
        });
        self.insert(name, erased);
        self
    }

    /// Whether a function of this name is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name)
    }

    fn insert(&self, name: &str, h: Erased) {
        self.table
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), h);
    }

    pub(crate) fn get(&self, name: &str) -> Option<Erased> {
        self.table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }
}
