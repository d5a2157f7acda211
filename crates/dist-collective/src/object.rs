//! Object collectives: any `serde` value, as JSON bytes over the typed collectives.
//!
//! These are the **slow path** (as in torch): every call serialises to JSON, exchanges lengths
//! in an extra collective, then the bytes. Use them for configuration, metadata and small
//! results, never for tensors.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::group::ProcessGroup;
use crate::{Error, Result};

impl ProcessGroup {
    fn encode<O: Serialize>(&self, op: &'static str, obj: &O) -> Result<Vec<u8>> {
        serde_json::to_vec(obj).map_err(|source| Error::Object {
            rank: self.rank(),
            op,
            source,
        })
    }

    fn decode<O: DeserializeOwned>(&self, op: &'static str, bytes: &[u8]) -> Result<O> {
        serde_json::from_slice(bytes).map_err(|source| Error::Object {
            rank: self.rank(),
            op,
            source,
        })
    }

    fn check_object_root(&self, op: &'static str, root: usize, has: bool) -> Result<()> {
        if root >= self.world_size() {
            return Err(Error::invalid(
                self.rank(),
                op,
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        match (self.rank() == root, has) {
            (true, false) => Err(Error::invalid(
                self.rank(),
                op,
                "the root must pass the object",
            )),
            (false, true) => Err(Error::invalid(
                self.rank(),
                op,
                format!("only the root (rank {root}) passes an object"),
            )),
            _ => Ok(()),
        }
    }

    /// Sends `root`'s object to every rank (torch's `broadcast_object_list`, one object).
    /// `obj` is `Some` on the root, `None` elsewhere; every rank gets the value. Slow path.
    pub fn broadcast_object<O: Serialize + DeserializeOwned>(
        &self,
        obj: Option<&O>,
        root: usize,
    ) -> Result<O> {
        let op = "broadcast_object";
        self.check_object_root(op, root, obj.is_some())?;
        let mut bytes = match obj {
            Some(o) => self.encode(op, o)?,
            None => Vec::new(),
        };
        let mut len = [bytes.len() as u64];
        self.broadcast(&mut len, root)?;
        bytes.resize(len[0] as usize, 0);
        self.broadcast(&mut bytes, root)?;
        self.decode(op, &bytes)
    }

    /// Gathers every rank's object on every rank, in rank order (torch's
    /// `all_gather_object`). Slow path.
    pub fn all_gather_object<O: Serialize + DeserializeOwned>(&self, obj: &O) -> Result<Vec<O>> {
        let op = "all_gather_object";
        let bytes = self.encode(op, obj)?;
        self.all_gather_uneven(&bytes)?
            .iter()
            .map(|b| self.decode(op, b))
            .collect()
    }

    /// Gathers every rank's object on `root`, in rank order (torch's `gather_object`): `Some`
    /// on the root, `None` elsewhere. Slow path.
    pub fn gather_object<O: Serialize + DeserializeOwned>(
        &self,
        obj: &O,
        root: usize,
    ) -> Result<Option<Vec<O>>> {
        let op = "gather_object";
        if root >= self.world_size() {
            return Err(Error::invalid(
                self.rank(),
                op,
                format!(
                    "root {root} is not a rank of this group of {}",
                    self.world_size()
                ),
            ));
        }
        let bytes = self.encode(op, obj)?;
        let lens: Vec<usize> = self
            .all_gather(&[bytes.len() as u64])?
            .iter()
            .map(|l| l[0] as usize)
            .collect();
        let w = self.world_size();
        let mut send = vec![0; w];
        send[root] = bytes.len();
        let recv = if self.rank() == root {
            lens.clone()
        } else {
            vec![0; w]
        };
        let mut out = vec![0u8; recv.iter().sum()];
        self.all_to_all_single(&mut out, &bytes, Some(&recv), Some(&send))?;
        if self.rank() != root {
            return Ok(None);
        }
        crate::group::split_by(&out, &lens)
            .iter()
            .map(|b| self.decode(op, b))
            .collect::<Result<Vec<O>>>()
            .map(Some)
    }

    /// Scatters `root`'s objects, one per rank (torch's `scatter_object_list`): `objs` is
    /// `Some` (world-size objects) on the root and `None` elsewhere; each rank gets its own.
    /// Slow path.
    pub fn scatter_object<O: Serialize + DeserializeOwned>(
        &self,
        objs: Option<&[O]>,
        root: usize,
    ) -> Result<O> {
        let op = "scatter_object";
        self.check_object_root(op, root, objs.is_some())?;
        let w = self.world_size();
        let (flat, mut lens) = match objs {
            Some(objs) => {
                if objs.len() != w {
                    return Err(Error::size(self.rank(), op, "objects", w, objs.len()));
                }
                let enc: Vec<Vec<u8>> = objs
                    .iter()
                    .map(|o| self.encode(op, o))
                    .collect::<Result<_>>()?;
                let lens: Vec<u64> = enc.iter().map(|b| b.len() as u64).collect();
                (enc.concat(), lens)
            }
            None => (Vec::new(), vec![0u64; w]),
        };
        self.broadcast(&mut lens, root)?;
        let send: Vec<usize> = if self.rank() == root {
            lens.iter().map(|&l| l as usize).collect()
        } else {
            vec![0; w]
        };
        let mut recv = vec![0; w];
        recv[root] = lens[self.rank()] as usize;
        let mut out = vec![0u8; recv[root]];
        self.all_to_all_single(&mut out, &flat, Some(&recv), Some(&send))?;
        self.decode(op, &out)
    }

    /// Sends an object to `dst` (its length, then its bytes, both with `tag`). Slow path.
    pub fn send_object<O: Serialize>(&self, obj: &O, dst: usize, tag: u32) -> Result<()> {
        let bytes = self.encode("send_object", obj)?;
        let len = self.isend(vec![bytes.len() as u64], dst, tag)?;
        let data = self.isend(bytes, dst, tag)?;
        len.wait()?;
        data.wait().map(drop)
    }

    /// Receives an object sent with [`send_object`](ProcessGroup::send_object) from `src`.
    pub fn recv_object<O: DeserializeOwned>(&self, src: usize, tag: u32) -> Result<O> {
        let mut len = [0u64];
        self.recv(&mut len, src, tag)?;
        let mut bytes = vec![0u8; len[0] as usize];
        self.recv(&mut bytes, src, tag)?;
        self.decode("recv_object", &bytes)
    }
}
