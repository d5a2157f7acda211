//! What the operations that lend their inputs by reference through the group area share
//! (`alltoall::through_shared_memory`, `allgather::lent_through_shared_memory`,
//! `allreduce::lent_in_two_shots`): the words a lender publishes, how its publication says
//! how it holds its input, the first arrival, and the reads that follow once every
//! publication is in, closed by a last arrival (the second; all_reduce's third).

use dist_backend::{Error, Result};

use super::Op;
use crate::transport::{LentWords, StepCtx};

/// Words a lender publishes after its kind word ([`LentWords`]).
pub(crate) const LENT_WORDS: usize = 3;

/// How a rank's publication holds its input: the first word of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum Held {
    /// In the area, after the rank's table.
    Inline = 0,
    /// In the rank's own memory, lent by reference: the words to read it follow.
    Lent = 1,
    /// Nowhere: the rank goes on by messages, and so does every rank.
    Announced = 2,
}

impl Held {
    /// The kind a publication's first word (from another process) names, if any.
    pub(crate) fn from_word(word: u64) -> Option<Self> {
        [Self::Inline, Self::Lent, Self::Announced]
            .into_iter()
            .find(|k| *k as u64 == word)
    }
}

/// The lender's words from the `8 * LENT_WORDS` bytes of its publication that hold them
/// (little-endian, as [`LentWords::to_le`] wrote them); `None` for any other length.
pub(crate) fn words_of(data: &[u8]) -> Option<LentWords> {
    if data.len() != 8 * LENT_WORDS {
        return None;
    }
    let mut words = [0u64; LENT_WORDS];
    for (word, bytes) in words.iter_mut().zip(data.chunks_exact(8)) {
        *word = bytemuck::pod_read_unaligned::<u64>(bytes);
    }
    Some(LentWords::from_le(words))
}

/// The first word of a publication (from another process, little-endian), where it has one:
/// the kind word of lending's publications and of all_to_all's tables.
pub(crate) fn leading_word(theirs: &[u8]) -> Option<u64> {
    theirs
        .get(..8)
        .map(|w| u64::from_le(bytemuck::pod_read_unaligned::<u64>(w)))
}

/// A publication that holds nothing but its kind word, and the lender's words after it where
/// lent (all_gather's and all_reduce's): `None` for any other form.
pub(crate) fn publication(theirs: &[u8]) -> Option<(Held, Option<LentWords>)> {
    let kind = leading_word(theirs).and_then(Held::from_word)?;
    match kind {
        Held::Announced if theirs.len() == 8 => Some((kind, None)),
        Held::Lent => Some((kind, Some(words_of(&theirs[8..])?))),
        _ => None,
    }
}

/// The first arrival of an operation whose every rank lends its whole input (all_gather's,
/// all_reduce's): publishes `lent`'s words, or, with none (this rank does not or cannot
/// lend), announces so without waiting and returns `None`. Once every rank has published,
/// every rank's words in rank order, or `None` where some rank announced: every rank read the
/// same publications, so all go on by messages alike, having read nothing lent.
pub(crate) fn publish_all(o: &Op<'_>, lent: Option<LentWords>) -> Option<Result<Vec<LentWords>>> {
    // A rank that announces goes on by messages at once, while others may still wait in the
    // area for the last arrival: their wait keeps its frames.
    let ctx = StepCtx {
        area_then_messages: true,
        ..o.ctx
    };
    let Some(words) = lent else {
        let announced = [(Held::Announced as u64).to_le()];
        o.t.shared_memory_announce(&ctx, o.count, &[bytemuck::cast_slice(&announced)]);
        return None;
    };
    let [addr, len, offer] = words.to_le();
    let mine = [(Held::Lent as u64).to_le(), addr, len, offer];
    let mut lenders = vec![LentWords::default(); o.n()];
    let mut all_lent = true;
    let mut corrupt_seen = false;
    let exchanged = o.t.shared_memory_exchange(
        &ctx,
        o.count,
        &[bytemuck::cast_slice(&mine)],
        &mut |p, theirs| {
            match publication(theirs) {
                Some((Held::Announced, None)) => all_lent = false,
                Some((Held::Lent, Some(words))) => lenders[p] = words,
                _ => {
                    corrupt_seen = true;
                    return Err(corrupt(o, p, theirs.len()));
                }
            }
            Ok(())
        },
    )?;
    match exchanged {
        // A rank that announced went on by messages and waits for frames: the abort notice
        // tells it (the engine's failures have told it already).
        Err(e) if corrupt_seen => Some(Err(o.t.fail_with(&o.ctx, e))),
        Err(e) => Some(Err(e)),
        Ok(()) => all_lent.then_some(Ok(lenders)),
    }
}

/// Copies each of `reads` (a lender, its words, where its bytes for this rank start, and where
/// they go), then arrives in the area a second time: no rank may take its input back before
/// every rank is done reading it. Every rank that read the same publications calls this
/// alike, lender or not, so the second arrival is made by all.
pub(crate) fn read_then_close<'d>(
    o: &Op<'_>,
    reads: impl IntoIterator<Item = (usize, LentWords, usize, &'d mut [u8])>,
) -> Result<()> {
    for (p, words, at, dst) in reads {
        o.t.shared_memory_read(&o.ctx, p, words, at, dst)?;
    }
    // Refused, this rank would take its input back while the others read it: fail loudly.
    super::unwrap_area(
        o,
        o.t.shared_memory_exchange(&o.ctx, o.count, &[], &mut |_, _| Ok(())),
    )
}

/// Rank `p`'s publication of `len` bytes does not say how it holds its input, or not in a
/// form this rank reads: a corrupt area, reported rather than used.
pub(crate) fn corrupt(o: &Op<'_>, p: usize, len: usize) -> Error {
    Error::invalid(
        o.rank(),
        o.ctx.op.name(),
        format!(
            "rank {p} published {len} bytes in the shared-memory group area, which do not say \
             how it holds its input"
        ),
    )
}
