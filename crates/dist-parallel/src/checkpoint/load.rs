//! Loading: every rank reads the index, then, for each of its slices, only the byte ranges of
//! the stored pieces that overlap it.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use dist_collective::Chunk;
use serde::Deserialize;

use super::index::{Index, VERSION, dtype_name};
use super::{INDEX_FILE, LocalTensorMut, chunk_of};
use crate::{Error, Result};

/// Loads the checkpoint in `dir` into `targets` (this rank's slices; any layout and world
/// size, whatever the checkpoint was saved with). `rank` only labels errors: loading needs no
/// communication. Fails, naming the tensor, when a target is not in the checkpoint, its shape
/// or dtype differs, or a file is missing or does not hold what the index says.
pub fn load(dir: &Path, rank: usize, targets: &mut [LocalTensorMut<'_>]) -> Result<()> {
    load_holding(dir, rank, targets, MAX_OPEN_FILES)
}

/// Shard files held open at once while loading. A checkpoint saved by more ranks than the
/// process may open files (1024 by default on Linux) has as many files; keeping each open
/// from its first read to the end failed with EMFILE, and a process that holds sockets to
/// its peers has fewer descriptors to spare still.
const MAX_OPEN_FILES: usize = 64;

/// [`load`], holding at most `max_open` shard files open at once.
fn load_holding(
    dir: &Path,
    rank: usize,
    targets: &mut [LocalTensorMut<'_>],
    max_open: usize,
) -> Result<()> {
    let index = read_index(dir, rank)?;
    let mut files = ShardFiles::new(max_open);
    for t in targets.iter_mut() {
        load_one(dir, rank, &index, &mut files, t)?;
    }
    Ok(())
}

fn read_index(dir: &Path, rank: usize) -> Result<Index> {
    let path = dir.join(INDEX_FILE);
    let bytes = std::fs::read(&path).map_err(|source| Error::CheckpointIo {
        rank,
        op: "load",
        tensor: String::new(),
        path: path.clone(),
        source,
    })?;
    let index: Index = serde_json::from_slice(&bytes).map_err(|e| Error::Checkpoint {
        rank,
        op: "load",
        tensor: String::new(),
        reason: format!("{} is not a checkpoint index: {e}", path.display()),
    })?;
    if index.version != VERSION {
        return Err(Error::Checkpoint {
            rank,
            op: "load",
            tensor: String::new(),
            reason: format!(
                "index version {} (this build reads {VERSION})",
                index.version
            ),
        });
    }
    Ok(index)
}

fn load_one(
    dir: &Path,
    rank: usize,
    index: &Index,
    files: &mut ShardFiles,
    t: &mut LocalTensorMut<'_>,
) -> Result<()> {
    let name = t.name.clone();
    let bad = |reason: String| Error::Checkpoint {
        rank,
        op: "load",
        tensor: name.clone(),
        reason,
    };
    let entry = index.tensors.get(&t.name).ok_or_else(|| {
        let some: Vec<&String> = index.tensors.keys().take(8).collect();
        bad(format!(
            "not in the checkpoint (it holds {} tensors: {some:?}{})",
            index.tensors.len(),
            if index.tensors.len() > 8 { ", ..." } else { "" }
        ))
    })?;
    let want_dtype = dtype_name(t.dtype);
    if entry.dtype != want_dtype || entry.global_shape != t.layout.global_shape() {
        return Err(bad(format!(
            "the checkpoint holds {} {:?}, the model wants {want_dtype} {:?}",
            entry.dtype,
            entry.global_shape,
            t.layout.global_shape()
        )));
    }
    let mine = chunk_of(rank, "load", &t.name, &t.layout, &t.coord)?;
    let elem = t.dtype.size();
    if t.data.len() != mine.numel() * elem {
        return Err(bad(format!(
            "its slice {mine:?} needs {} bytes, the destination has {}",
            mine.numel() * elem,
            t.data.len()
        )));
    }
    let mut covered = 0;
    // The parts of this rank's slice copied so far: pieces that overlap (a hand-merged index)
    // would count some elements twice and leave others unloaded while the count came out right.
    let mut copied: Vec<(Chunk, &str)> = Vec::new();
    for piece in &entry.chunks {
        // The index comes from a file: a box that is not inside the tensor is corruption,
        // to report rather than index with.
        let c = &piece.chunk;
        let inside = c.offsets.len() == entry.global_shape.len()
            && c.shape.len() == entry.global_shape.len()
            && c.offsets
                .iter()
                .zip(&c.shape)
                .zip(&entry.global_shape)
                .all(|((&o, &n), &g)| o.checked_add(n).is_some_and(|end| end <= g));
        if !inside {
            return Err(bad(format!(
                "the index places a piece in {} at offsets {:?} shape {:?}, outside the tensor's {:?}",
                piece.file, c.offsets, c.shape, entry.global_shape
            )));
        }
        let Some(overlap) = mine.intersect(&piece.chunk) else {
            continue;
        };
        if let Some((_, other)) = copied.iter().find(|(c, _)| c.intersect(&overlap).is_some()) {
            return Err(bad(format!(
                "the index has pieces in {other} and {} that overlap",
                piece.file
            )));
        }
        // A file name the index gives is joined to the checkpoint's directory: one that
        // names a path (absolute, or through `..`) would read outside it.
        let plain = {
            let mut parts = Path::new(&piece.file).components();
            matches!(
                (parts.next(), parts.next()),
                (Some(std::path::Component::Normal(_)), None)
            )
        };
        if !plain {
            return Err(bad(format!(
                "the index names the file {:?}, which is not a file name in the checkpoint's \
                 directory",
                piece.file
            )));
        }
        let file = files.get(dir, &piece.file, rank, &t.name)?;
        let stored = file.tensors.get(&t.name).ok_or_else(|| {
            bad(format!(
                "{} holds no tensor of this name, though the index says it does",
                piece.file
            ))
        })?;
        if stored.dtype != entry.dtype || stored.shape != piece.chunk.shape {
            return Err(bad(format!(
                "{} holds it as {} {:?}, the index says {} {:?}",
                piece.file, stored.dtype, stored.shape, entry.dtype, piece.chunk.shape
            )));
        }
        let (start, end) = (stored.data_offsets[0], stored.data_offsets[1]);
        if end.checked_sub(start) != Some(piece.chunk.numel() * elem) {
            return Err(bad(format!(
                "{}: data offsets {start}..{end} do not fit its shape",
                piece.file
            )));
        }
        if end as u64 > file.data_len {
            return Err(bad(format!(
                "{}: data offsets {start}..{end} run past its {} bytes of data",
                piece.file, file.data_len
            )));
        }
        // The byte span of the stored piece that the overlap touches: exact for dim-0 slices.
        let first = row_major_offset(&piece.chunk, &overlap.offsets);
        let last_corner: Vec<usize> = overlap
            .offsets
            .iter()
            .zip(&overlap.shape)
            .map(|(o, s)| o + s - 1)
            .collect();
        let last = row_major_offset(&piece.chunk, &last_corner);
        let span = file.read(
            start + first * elem,
            (last + 1 - first) * elem,
            rank,
            &t.name,
        )?;
        copy_box(&overlap, &piece.chunk, first, &span, &mine, t.data, elem);
        covered += overlap.numel();
        copied.push((overlap, &piece.file));
    }
    if covered != mine.numel() {
        return Err(bad(format!(
            "the checkpoint's pieces cover {covered} of the {} elements of slice {mine:?}",
            mine.numel()
        )));
    }
    Ok(())
}

/// Element offset of global index `at` inside box `c` (row-major).
fn row_major_offset(c: &Chunk, at: &[usize]) -> usize {
    c.shape
        .iter()
        .zip(&c.offsets)
        .zip(at)
        .fold(0, |off, ((n, o), a)| off * n + (a - o))
}

/// Copies box `overlap` from `src` (the stored piece `from`, starting at element `base`) into
/// `dst` (the box `to`), one innermost run at a time.
fn copy_box(
    overlap: &Chunk,
    from: &Chunk,
    base: usize,
    src: &[u8],
    to: &Chunk,
    dst: &mut [u8],
    elem: usize,
) {
    let nd = overlap.shape.len();
    if nd == 0 {
        dst[..elem].copy_from_slice(&src[..elem]);
        return;
    }
    let run = overlap.shape[nd - 1] * elem;
    let outer: usize = overlap.shape[..nd - 1].iter().product();
    let mut idx = overlap.offsets.clone();
    for _ in 0..outer {
        let s = (row_major_offset(from, &idx) - base) * elem;
        let d = row_major_offset(to, &idx) * elem;
        dist_wire::copy::bulk(&mut dst[d..d + run], &src[s..s + run]);
        // Next index over every dimension but the last.
        for k in (0..nd - 1).rev() {
            idx[k] += 1;
            if idx[k] < overlap.offsets[k] + overlap.shape[k] {
                break;
            }
            idx[k] = overlap.offsets[k];
        }
    }
}

#[derive(Deserialize)]
struct StoredTensor {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// The shard files a load has read headers from, at most `max_open` of them holding a file
/// descriptor; the others are opened again when next read.
struct ShardFiles {
    by_name: HashMap<String, ShardFile>,
    /// Names of the files holding a descriptor, the one opened longest ago first.
    open: VecDeque<String>,
    max_open: usize,
}

impl ShardFiles {
    fn new(max_open: usize) -> Self {
        ShardFiles {
            by_name: HashMap::new(),
            open: VecDeque::new(),
            max_open: max_open.max(1),
        }
    }

    /// The file `name` of `dir`, its header read, open for reading; closes the file opened
    /// longest ago where that makes one too many open.
    fn get(&mut self, dir: &Path, name: &str, rank: usize, tensor: &str) -> Result<&mut ShardFile> {
        let holds_descriptor = self.by_name.get(name).map(|f| f.file.is_some());
        if holds_descriptor != Some(true) {
            if self.open.len() >= self.max_open
                && let Some(oldest) = self.open.pop_front()
                && let Some(f) = self.by_name.get_mut(&oldest)
            {
                f.file = None;
            }
            match self.by_name.get_mut(name) {
                Some(f) => f.reopen(rank, tensor)?,
                None => {
                    let f = ShardFile::open(dir.join(name), rank, tensor)?;
                    self.by_name.insert(name.to_string(), f);
                }
            }
            self.open.push_back(name.to_string());
        }
        Ok(self.by_name.get_mut(name).expect("read or opened above"))
    }

    #[cfg(test)]
    fn open_now(&self) -> usize {
        self.by_name.values().filter(|f| f.file.is_some()).count()
    }
}

/// A shard file whose safetensors header has been read (and nothing else yet); `file` is
/// `None` while it is closed to stay within [`MAX_OPEN_FILES`].
struct ShardFile {
    path: PathBuf,
    file: Option<File>,
    data_start: u64,
    /// Bytes after the header: where every tensor's data offsets must end.
    data_len: u64,
    tensors: HashMap<String, StoredTensor>,
}

impl ShardFile {
    fn open(path: PathBuf, rank: usize, tensor: &str) -> Result<Self> {
        let io = |source| Error::CheckpointIo {
            rank,
            op: "load",
            tensor: tensor.to_string(),
            path: path.clone(),
            source,
        };
        let mut file = File::open(&path).map_err(io)?;
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(io)?;
        let n = u64::from_le_bytes(n);
        let len = file.metadata().map_err(io)?.len();
        if n > len.saturating_sub(8) {
            return Err(Error::Checkpoint {
                rank,
                op: "load",
                tensor: tensor.to_string(),
                reason: format!(
                    "{} is not a safetensors file (header of {n} bytes)",
                    path.display()
                ),
            });
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io)?;
        let mut raw: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| Error::Checkpoint {
                rank,
                op: "load",
                tensor: tensor.to_string(),
                reason: format!("{}: bad safetensors header: {e}", path.display()),
            })?;
        raw.remove("__metadata__");
        let mut tensors = HashMap::new();
        for (k, v) in raw {
            let t: StoredTensor = serde_json::from_value(v).map_err(|e| Error::Checkpoint {
                rank,
                op: "load",
                tensor: tensor.to_string(),
                reason: format!("{}: bad header entry {k:?}: {e}", path.display()),
            })?;
            tensors.insert(k, t);
        }
        Ok(ShardFile {
            path,
            file: Some(file),
            data_start: 8 + n,
            data_len: len - 8 - n,
            tensors,
        })
    }

    /// An I/O error on this file, naming the rank and the tensor being loaded.
    fn io_error(&self, rank: usize, tensor: &str, source: std::io::Error) -> Error {
        ShardFile::io_error_at(&self.path, rank, tensor, source)
    }

    fn io_error_at(path: &Path, rank: usize, tensor: &str, source: std::io::Error) -> Error {
        Error::CheckpointIo {
            rank,
            op: "load",
            tensor: tensor.to_string(),
            path: path.to_path_buf(),
            source,
        }
    }

    /// Opens the file again after it was closed, checking that it still has the length its
    /// header was read with (a file replaced meanwhile would be read with another's offsets).
    fn reopen(&mut self, rank: usize, tensor: &str) -> Result<()> {
        let file = File::open(&self.path).map_err(|e| self.io_error(rank, tensor, e))?;
        let len = file
            .metadata()
            .map_err(|e| self.io_error(rank, tensor, e))?
            .len();
        if len != self.data_start + self.data_len {
            return Err(Error::Checkpoint {
                rank,
                op: "load",
                tensor: tensor.to_string(),
                reason: format!(
                    "{} changed while loading ({} bytes, {} when its header was read)",
                    self.path.display(),
                    len,
                    self.data_start + self.data_len
                ),
            });
        }
        self.file = Some(file);
        Ok(())
    }

    /// Reads `len` bytes at `offset` of the data section; the file is open
    /// ([`ShardFiles::get`]).
    fn read(&mut self, offset: usize, len: usize, rank: usize, tensor: &str) -> Result<Vec<u8>> {
        let ShardFile {
            path,
            file,
            data_start,
            ..
        } = self;
        let io = |source| ShardFile::io_error_at(path, rank, tensor, source);
        let Some(file) = file.as_mut() else {
            return Err(io(std::io::Error::other(
                "read from a shard file closed to stay within the open-file bound",
            )));
        };
        let mut buf = vec![0u8; len];
        file.seek(SeekFrom::Start(*data_start + offset as u64))
            .map_err(io)?;
        file.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use dist_collective::testing::run_world;
    use dist_collective::{Placement, ShardLayout};

    use super::*;
    use crate::checkpoint::{LocalTensor, save};

    /// A checkpoint of more files than may be open at once loads whole, in an order that
    /// comes back to files closed meanwhile, and never holds more open than the bound.
    #[test]
    fn a_load_holds_at_most_its_bound_of_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let world = 4;
        let a: Vec<f32> = (0..40).map(|x| x as f32).collect();
        let b: Vec<i32> = (0..12).map(|x| -x).collect();
        run_world(world, |pg| {
            let (la, lb) = (
                ShardLayout::shard_dim0(&[8, 5], world).unwrap(),
                ShardLayout::shard_dim0(&[12], world).unwrap(),
            );
            let (ca, cb) = (la.local_chunk(&[pg.rank()]), lb.local_chunk(&[pg.rank()]));
            let mine_a = &a[ca.offsets[0] * 5..][..ca.numel()];
            let mine_b = &b[cb.offsets[0]..][..cb.numel()];
            let t = vec![
                LocalTensor::new("a", la, &[pg.rank()], mine_a),
                LocalTensor::new("b", lb, &[pg.rank()], mine_b),
            ];
            save(&pg, dir.path(), t).unwrap();
            Ok(())
        })
        .unwrap();
        let whole = |s: &[usize]| ShardLayout::new(s, &[1], &[Placement::Replicate]).unwrap();
        for bound in [1, 2, world, world + 1] {
            let (mut a2, mut b2) = (vec![0f32; 40], vec![0i32; 12]);
            load_holding(
                dir.path(),
                0,
                &mut [
                    LocalTensorMut::new("a", whole(&[8, 5]), &[0], &mut a2),
                    LocalTensorMut::new("b", whole(&[12]), &[0], &mut b2),
                ],
                bound,
            )
            .unwrap();
            assert_eq!((&a2, &b2), (&a, &b), "at most {bound} files open");
        }
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        assert_eq!(names.len(), world);
        let mut files = ShardFiles::new(2);
        for name in names.iter().chain(&names) {
            let f = files.get(dir.path(), name, 0, "a").unwrap();
            assert!(f.file.is_some(), "{name} is open once got");
            assert!(files.open_now() <= 2, "{} open", files.open_now());
        }
    }
}
