//! Object collectives: any `serde` value, as JSON bytes over the typed collectives.
//!
//! These are the **slow path** (as in torch): every call serialises to JSON, exchanges lengths
//! in an extra collective, then the bytes. Use them for configuration, metadata and small
//! results, never for tensors.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::group::ProcessGroup;
use crate::{Error, Result};

/// The length word a rank sends in place of its object's length when it has no object to
/// send (the root's call was wrong, or the object would not encode): the others fail at
/// once naming it, rather than wait out their timeout for bytes that never come.
const NO_OBJECT: u64 = u64::MAX;

impl ProcessGroup {
    /// The error of a rank that met `from`'s [`NO_OBJECT`] word.
    fn peer_had_no_object(&self, op: &'static str, from: usize) -> Error {
        Error::invalid(
            self.rank(),
            op,
            format!("rank {from} failed to provide its object (its own error says why)"),
        )
    }

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
        self.check_root(op, root)?;
        if self.rank() != root {
            self.check_object_root(op, root, obj.is_some())?;
        }
        // A root that cannot send still sends the length word, so the others fail with it.
        let mine = (self.rank() == root).then(|| {
            self.check_object_root(op, root, obj.is_some())
                .and_then(|()| self.encode(op, obj.expect("checked: the root passes it")))
        });
        let mut len = [match &mine {
            Some(Ok(b)) => b.len() as u64,
            Some(Err(_)) => NO_OBJECT,
            None => 0,
        }];
        self.broadcast(&mut len, root)?;
        let mut bytes = match mine {
            Some(r) => r?,
            None => {
                if len[0] == NO_OBJECT {
                    return Err(self.peer_had_no_object(op, root));
                }
                vec![0u8; len[0] as usize]
            }
        };
        self.broadcast(&mut bytes, root)?;
        self.decode(op, &bytes)
    }

    /// Gathers every rank's object on every rank, in rank order (torch's
    /// `all_gather_object`). Slow path.
    pub fn all_gather_object<O: Serialize + DeserializeOwned>(&self, obj: &O) -> Result<Vec<O>> {
        let op = "all_gather_object";
        let (bytes, lens) = self.object_lens(op, self.encode(op, obj))?;
        let mut out = vec![0u8; lens.iter().sum()];
        self.all_gather_into_uneven(&bytes, &mut out, &lens)?;
        crate::group::split_by(&out, &lens)
            .iter()
            .map(|b| self.decode(op, b))
            .collect()
    }

    /// Every rank's object length, all-gathered; a rank whose object did not encode (`mine`
    /// is its error) sends [`NO_OBJECT`] and returns its own error after the exchange, and
    /// every other rank fails naming the first such rank.
    fn object_lens(
        &self,
        op: &'static str,
        mine: Result<Vec<u8>>,
    ) -> Result<(Vec<u8>, Vec<usize>)> {
        let word = mine.as_ref().map_or(NO_OBJECT, |b| b.len() as u64);
        let lens = self.all_gather(&[word])?;
        let bytes = mine?;
        if let Some(r) = lens.iter().position(|l| l[0] == NO_OBJECT) {
            return Err(self.peer_had_no_object(op, r));
        }
        Ok((bytes, lens.iter().map(|l| l[0] as usize).collect()))
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
        let (bytes, lens) = self.object_lens(op, self.encode(op, obj))?;
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
        self.check_root(op, root)?;
        if self.rank() != root {
            self.check_object_root(op, root, objs.is_some())?;
        }
        let w = self.world_size();
        // A root that cannot send still sends the lengths, all NO_OBJECT, so the others fail
        // with it.
        let mine = (self.rank() == root).then(|| {
            self.check_object_root(op, root, objs.is_some())?;
            let objs = objs.expect("checked: the root passes them");
            if objs.len() != w {
                return Err(Error::size(self.rank(), op, "objects", w, objs.len()));
            }
            let enc: Vec<Vec<u8>> = objs
                .iter()
                .map(|o| self.encode(op, o))
                .collect::<Result<_>>()?;
            let lens: Vec<u64> = enc.iter().map(|b| b.len() as u64).collect();
            Ok((enc.concat(), lens))
        });
        let (flat, mut lens) = match &mine {
            Some(Ok((flat, lens))) => (flat.as_slice(), lens.clone()),
            Some(Err(_)) => (&[][..], vec![NO_OBJECT; w]),
            None => (&[][..], vec![0u64; w]),
        };
        self.broadcast(&mut lens, root)?;
        match mine {
            Some(Err(e)) => return Err(e),
            Some(Ok(_)) => {}
            None => {
                if lens[self.rank()] == NO_OBJECT {
                    return Err(self.peer_had_no_object(op, root));
                }
            }
        }
        let send: Vec<usize> = if self.rank() == root {
            lens.iter().map(|&l| l as usize).collect()
        } else {
            vec![0; w]
        };
        let mut recv = vec![0; w];
        recv[root] = lens[self.rank()] as usize;
        let mut out = vec![0u8; recv[root]];
        self.all_to_all_single(&mut out, flat, Some(&recv), Some(&send))?;
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
