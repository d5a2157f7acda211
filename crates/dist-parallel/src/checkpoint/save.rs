//! Saving: each rank writes its file (in the background for [`save_async`]), then rank 0
//! checks that the pieces tile every tensor and commits the index.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use dist_collective::{Placement, ProcessGroup};
use safetensors::tensor::TensorView;

use super::index::{ChunkEntry, Index, TensorEntry, VERSION, Written, dtype_name, st_dtype};
use super::{INDEX_FILE, LocalTensor, chunk_of};
use crate::{Error, Result};

/// A save in progress ([`save_async`]): the local file is being written in the background.
/// [`wait`](SaveHandle::wait) commits the checkpoint; every rank must call it.
#[must_use = "the checkpoint is committed (and errors reported) by wait()"]
#[derive(Debug)]
pub struct SaveHandle {
    pg: ProcessGroup,
    dir: PathBuf,
    save_id: String,
    written: Vec<Written>,
    writer: Option<JoinHandle<Result<()>>>,
}

/// Saves `tensors` (this rank's slices) as a checkpoint in `dir` and returns once it is
/// committed. Every rank of `pg` calls it with its own slices of the same tensors.
pub fn save(pg: &ProcessGroup, dir: &Path, tensors: Vec<LocalTensor>) -> Result<()> {
    save_async(pg, dir, tensors)?.wait()
}

/// Starts a save: checks the slices, agrees on a save id with the other ranks, and writes this
/// rank's file on a background thread, returning at once (the slices are already a copy in
/// host memory). Training may go on; [`SaveHandle::wait`] finishes the save. It issues its
/// collectives on the caller's thread (here and in `wait`), so they stay in order with the
/// caller's other collectives on `pg`.
pub fn save_async(pg: &ProcessGroup, dir: &Path, tensors: Vec<LocalTensor>) -> Result<SaveHandle> {
    let rank = pg.rank();
    let written = plan(rank, &tensors);
    // Agree on the id before anything can fail locally, so every rank takes part in it.
    let id = (rank == 0).then(fresh_id);
    let save_id: String = pg.broadcast_object(id.as_ref(), 0)?;
    let file = format!("{save_id}.rank{rank}.safetensors");
    let (written, writer) = match written {
        Ok(w) => {
            let w: Vec<Written> = w
                .into_iter()
                .map(|mut e| {
                    e.chunk.file = file.clone();
                    e
                })
                .collect();
            let (bg_dir, bg_file) = (dir.to_path_buf(), file.clone());
            let writer = std::thread::Builder::new()
                .name(format!("dist-ckpt-save-{rank}"))
                .spawn(move || write_file(rank, &bg_dir, &bg_file, tensors))
                .map_err(|e| Error::CheckpointIo {
                    rank,
                    op: "save",
                    tensor: String::new(),
                    path: dir.join(&file),
                    source: e,
                })?;
            (w, Some(writer))
        }
        // Reported in wait(), after the other ranks have been told, so nobody hangs.
        Err(e) => (Vec::new(), Some(std::thread::spawn(move || Err(e)))),
    };
    Ok(SaveHandle {
        pg: pg.clone(),
        dir: dir.to_path_buf(),
        save_id,
        written,
        writer,
    })
}

impl SaveHandle {
    /// Waits for this rank's file, then commits: rank 0 checks that the pieces of every rank
    /// tile each tensor exactly and writes the index (temporary name, then renamed). Returns
    /// the first error of any rank, on every rank.
    pub fn wait(mut self) -> Result<()> {
        let rank = self.pg.rank();
        let local = match self.writer.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) | None => Err(Error::Checkpoint {
                rank,
                op: "save",
                tensor: String::new(),
                reason: "the background writer panicked".into(),
            }),
        };
        let report: std::result::Result<Vec<Written>, String> = match &local {
            Ok(()) => Ok(std::mem::take(&mut self.written)),
            Err(e) => Err(e.to_string()),
        };
        let reports = self.pg.all_gather_object(&report)?;
        local?;
        if let Some((r, e)) = reports
            .iter()
            .enumerate()
            .find_map(|(r, x)| x.as_ref().err().map(|e| (r, e)))
        {
            return Err(Error::Checkpoint {
                rank,
                op: "save",
                tensor: String::new(),
                reason: format!("rank {r} could not write its file, so nothing was committed: {e}"),
            });
        }
        let committed: std::result::Result<(), String> = if rank == 0 {
            let all = reports.into_iter().flat_map(|r| r.unwrap_or_default());
            commit(&self.dir, &self.save_id, self.pg.world_size(), all).map_err(|e| e.to_string())
        } else {
            Ok(())
        };
        let committed: std::result::Result<(), String> = self
            .pg
            .broadcast_object((rank == 0).then_some(&committed), 0)?;
        committed.map_err(|reason| Error::Checkpoint {
            rank,
            op: "save",
            tensor: String::new(),
            reason: if rank == 0 {
                reason
            } else {
                format!("rank 0 could not commit the index: {reason}")
            },
        })
    }
}

/// The pieces this rank writes: one per tensor, unless a replica with a lower coordinate
/// writes the same piece. Checks the slices on the way.
fn plan(rank: usize, tensors: &[LocalTensor]) -> Result<Vec<Written>> {
    let bad = |t: &LocalTensor, reason: String| Error::Checkpoint {
        rank,
        op: "save",
        tensor: t.name.clone(),
        reason,
    };
    let mut names = HashSet::new();
    let mut out = Vec::new();
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(bad(t, "appears twice among this rank's tensors".into()));
        }
        if st_dtype(t.dtype).is_none() {
            return Err(bad(
                t,
                format!("dtype {:?} has no safetensors name", t.dtype),
            ));
        }
        if let Some(p) = t
            .layout
            .placements()
            .iter()
            .find(|p| matches!(p, Placement::Partial(_)))
        {
            return Err(bad(
                t,
                format!("placement {p} holds partial values; reduce it before saving"),
            ));
        }
        let chunk = chunk_of(rank, "save", &t.name, &t.layout, &t.coord)?;
        let want = chunk.numel() * t.dtype.size();
        if t.data.len() != want {
            return Err(bad(
                t,
                format!(
                    "its slice {chunk:?} of global shape {:?} needs {want} bytes of {:?}, the data has {}",
                    t.layout.global_shape(),
                    t.dtype,
                    t.data.len()
                ),
            ));
        }
        // Replicated mesh dimensions: only coordinate 0 of each writes.
        let writer = t
            .layout
            .placements()
            .iter()
            .zip(&t.coord)
            .all(|(p, &c)| p.is_shard() || c == 0);
        if writer {
            out.push(Written {
                name: t.name.clone(),
                dtype: dtype_name(t.dtype).to_string(),
                global_shape: t.layout.global_shape().to_vec(),
                chunk: ChunkEntry {
                    file: String::new(),
                    chunk,
                },
            });
        }
    }
    Ok(out)
}

/// A save id no earlier save in the directory has used: time and process, in hex.
fn fresh_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("ckpt-{nanos:x}-{:x}", std::process::id())
}

/// Writes this rank's pieces as `file` in `dir`: a temporary name, synced, then renamed.
fn write_file(rank: usize, dir: &Path, file: &str, tensors: Vec<LocalTensor>) -> Result<()> {
    let io = |path: &Path, tensor: &str, source| Error::CheckpointIo {
        rank,
        op: "save",
        tensor: tensor.to_string(),
        path: path.to_path_buf(),
        source,
    };
    fs::create_dir_all(dir).map_err(|e| io(dir, "", e))?;
    let mut views = Vec::new();
    for t in &tensors {
        let writes = t
            .layout
            .placements()
            .iter()
            .zip(&t.coord)
            .all(|(p, &c)| p.is_shard() || c == 0);
        if !writes {
            continue;
        }
        let chunk = t.layout.local_chunk(&t.coord);
        let dtype = st_dtype(t.dtype).unwrap_or(safetensors::Dtype::U8);
        let view = TensorView::new(dtype, chunk.shape.clone(), &t.data).map_err(|source| {
            Error::Safetensors {
                rank,
                path: dir.join(file),
                source,
            }
        })?;
        views.push((t.name.clone(), view));
    }
    let tmp = dir.join(format!("{file}.tmp"));
    let bytes = safetensors::serialize(views, None).map_err(|source| Error::Safetensors {
        rank,
        path: tmp.clone(),
        source,
    })?;
    let mut f = File::create(&tmp).map_err(|e| io(&tmp, "", e))?;
    f.write_all(&bytes).map_err(|e| io(&tmp, "", e))?;
    f.sync_all().map_err(|e| io(&tmp, "", e))?;
    let dst = dir.join(file);
    fs::rename(&tmp, &dst).map_err(|e| io(&dst, "", e))?;
    Ok(())
}

/// Rank 0: checks that every tensor's pieces agree on dtype and shape and tile it exactly,
/// writes the index under a temporary name, renames it into place, then removes the files of
/// earlier saves.
fn commit(
    dir: &Path,
    save_id: &str,
    world: usize,
    written: impl Iterator<Item = Written>,
) -> Result<()> {
    let bad = |tensor: &str, reason: String| Error::Checkpoint {
        rank: 0,
        op: "save",
        tensor: tensor.to_string(),
        reason,
    };
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for w in written {
        let e = tensors
            .entry(w.name.clone())
            .or_insert_with(|| TensorEntry {
                dtype: w.dtype.clone(),
                global_shape: w.global_shape.clone(),
                chunks: Vec::new(),
            });
        if e.dtype != w.dtype || e.global_shape != w.global_shape {
            return Err(bad(
                &w.name,
                format!(
                    "ranks disagree: {} {:?} in one file, {} {:?} in {}",
                    e.dtype, e.global_shape, w.dtype, w.global_shape, w.chunk.file
                ),
            ));
        }
        e.chunks.push(w.chunk);
    }
    for (name, e) in &tensors {
        let total: usize = e.global_shape.iter().product();
        let covered: usize = e.chunks.iter().map(|c| c.chunk.numel()).sum();
        if let Some((a, b)) = first_overlap(&e.chunks) {
            return Err(bad(
                name,
                format!(
                    "pieces overlap: {:?} in {} and {:?} in {}",
                    a.chunk, a.file, b.chunk, b.file
                ),
            ));
        }
        if covered != total {
            return Err(bad(
                name,
                format!("the ranks' pieces hold {covered} of its {total} elements"),
            ));
        }
    }
    let index = Index {
        version: VERSION,
        save_id: save_id.to_string(),
        world_size: world,
        tensors,
    };
    let io = |path: &Path, source| Error::CheckpointIo {
        rank: 0,
        op: "save",
        tensor: String::new(),
        path: path.to_path_buf(),
        source,
    };
    // Every file the index names must be there: an index naming a file some other save
    // removed would be committed unloadable, in place of the checkpoint before it.
    let files: HashSet<&str> = index
        .tensors
        .values()
        .flat_map(|t| t.chunks.iter().map(|c| c.file.as_str()))
        .collect();
    if let Some(missing) = files.iter().find(|f| !dir.join(f).is_file()) {
        return Err(bad(
            "",
            format!(
                "{missing}, written by this save, is gone from {}",
                dir.display()
            ),
        ));
    }
    let json = serde_json::to_vec_pretty(&index).map_err(|e| bad("", e.to_string()))?;
    let tmp = dir.join(format!("{INDEX_FILE}.{save_id}.tmp"));
    let mut f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(&json).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    let dst = dir.join(INDEX_FILE);
    fs::rename(&tmp, &dst).map_err(|e| io(&dst, e))?;
    // The rename is durable once the directory is synced.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))?;
    remove_stale(dir, save_id);
    Ok(())
}

/// Two pieces that overlap, if any. A sweep along dimension 0: pieces in order of their first
/// row, each compared only with the earlier ones whose rows reach it (for dim-0 sharding, one
/// or none), where comparing every pair cost rank 0 billions of comparisons on thousands of
/// ranks' pieces of a thousand tensors while the others waited.
fn first_overlap(pieces: &[ChunkEntry]) -> Option<(&ChunkEntry, &ChunkEntry)> {
    let start = |p: &ChunkEntry| p.chunk.offsets.first().copied().unwrap_or(0);
    let end = |p: &ChunkEntry| start(p) + p.chunk.shape.first().copied().unwrap_or(1);
    let mut order: Vec<&ChunkEntry> = pieces.iter().collect();
    order.sort_by_key(|p| start(p));
    let mut reaching: Vec<&ChunkEntry> = Vec::new();
    for b in order {
        reaching.retain(|a| end(a) > start(b));
        if let Some(a) = reaching
            .iter()
            .find(|a| a.chunk.intersect(&b.chunk).is_some())
        {
            return Some((a, b));
        }
        reaching.push(b);
    }
    None
}

/// Removes what earlier (or killed) saves left: their shard files and temporary files, those
/// whose save id ([`fresh_id`]) was taken before `save_id`. A later save's files stay: it may be
/// in progress (`save_async` twice, then `wait` on the first), and removing them made its
/// commit name files that were gone. Failing to remove one is harmless (the index does not
/// name it), so errors are logged only.
fn remove_stale(dir: &Path, save_id: &str) {
    let Some(ours) = id_time(save_id) else {
        return;
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let id = name
            .strip_prefix(&format!("{INDEX_FILE}."))
            .unwrap_or(&name);
        if id_time(id).is_some_and(|t| t < ours)
            && let Err(err) = fs::remove_file(e.path())
        {
            tracing::warn!("checkpoint: could not remove stale {name}: {err}");
        }
    }
}

/// When the save whose id (or file name) `id` starts was started, from [`fresh_id`]'s
/// `ckpt-<nanoseconds, hex>-<pid, hex>`; `None` for any other name.
fn id_time(id: &str) -> Option<u128> {
    let hex = id.strip_prefix("ckpt-")?.split('-').next()?;
    u128::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use dist_collective::Chunk;

    use super::*;

    fn piece(file: &str, offsets: &[usize], shape: &[usize]) -> ChunkEntry {
        ChunkEntry {
            file: file.into(),
            chunk: Chunk {
                offsets: offsets.to_vec(),
                shape: shape.to_vec(),
            },
        }
    }

    /// The sweep finds what comparing every pair finds, on tilings and on overlaps.
    #[test]
    fn the_sweep_finds_overlaps_as_every_pair_does() {
        let pairwise = |ps: &[ChunkEntry]| {
            ps.iter().enumerate().any(|(i, a)| {
                ps[i + 1..]
                    .iter()
                    .any(|b| a.chunk.intersect(&b.chunk).is_some())
            })
        };
        let rows: Vec<ChunkEntry> = (0..6)
            .map(|r| piece(&format!("r{r}"), &[r * 3, 0], &[3, 4]))
            .collect();
        let grid: Vec<ChunkEntry> = (0..4)
            .flat_map(|i| (0..3).map(move |j| piece("g", &[i * 2, j * 5], &[2, 5])))
            .collect();
        let mut cases: Vec<(&str, Vec<ChunkEntry>)> = vec![
            ("rows", rows.clone()),
            ("rows, reversed", rows.iter().rev().cloned().collect()),
            ("grid", grid.clone()),
            (
                "empty pieces",
                vec![
                    piece("a", &[0, 0], &[4, 2]),
                    piece("b", &[4, 0], &[0, 2]),
                    piece("c", &[4, 0], &[0, 2]),
                ],
            ),
            ("scalars", vec![piece("a", &[], &[]), piece("b", &[], &[])]),
            ("one scalar", vec![piece("a", &[], &[])]),
        ];
        let mut overlapping = grid.clone();
        overlapping.push(piece("x", &[3, 9], &[1, 2]));
        cases.push(("grid and a box inside it", overlapping));
        let mut late = rows.clone();
        late.insert(0, piece("long", &[0, 2], &[18, 1]));
        cases.push(("a column across the rows", late));
        let mut far = rows;
        far.push(piece("tail", &[16, 3], &[2, 1]));
        cases.push(("a box in the last rows", far));
        for (what, ps) in &cases {
            assert_eq!(
                first_overlap(ps).is_some(),
                pairwise(ps),
                "{what}: {:?}",
                first_overlap(ps).map(|(a, b)| (&a.file, &b.file))
            );
        }
        assert!(first_overlap(&cases[2].1).is_none());
        assert!(first_overlap(&cases[6].1).is_some());
    }

    #[test]
    fn save_ids_order_by_when_they_were_taken() {
        let id = fresh_id();
        assert!(id_time(&id).is_some(), "{id}");
        assert_eq!(
            id_time(&format!("{id}.rank3.safetensors")),
            id_time(&id),
            "a file's name starts with its save's id"
        );
        // Hex, not text: `ff` was taken after `100` as text sorts it before.
        assert!(id_time("ckpt-ff-7") < id_time("ckpt-100-1"));
        assert_eq!(id_time("index.json"), None);
        assert_eq!(id_time("ckpt-zz-1"), None);
        assert_eq!(id_time("notes.txt"), None);
    }
}
