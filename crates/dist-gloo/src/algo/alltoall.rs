//! all_to_all: through the shared-memory group area where the options ask for it and every
//! rank's input fits it, else by messages, every block in flight at once or pairwise.

use std::time::Duration;

use dist_backend::{Error, OpDesc, Result};

use super::lent::{Held, LENT_WORDS, leading_word, read_then_close, words_of};
use super::{Op, blocks_of, split_blocks, tags};
use crate::output_copy::copy_into_output;
use crate::transport::{Incoming, LentWords, Outgoing, StepCtx};

/// Every rank's blocks to every other through memory the whole group maps
/// ([`crate::transport::Transport::shared_memory_exchange`]): each rank publishes a table of
/// its send and receive counts followed by its input, and copies its block out of every other
/// rank's publication. One arrival per rank instead of a message to and from every other, as
/// for the all_gather ([`super::allgather::through_shared_memory`]).
///
/// A rank whose input is larger than `max_input` or than the area but at least `lend_from`
/// bytes lends it instead ([`crate::transport::Transport::shared_memory_lend`]) where every
/// peer can read its memory: it publishes the three words a peer needs to read it by
/// reference, every rank copies its block straight out of that rank's input, and a second
/// arrival in the area, once every rank is done reading, ends the operation. So one
/// all_to_all of large blocks costs two arrivals and one copy of each block, where by
/// messages every block's offer and acknowledgement cost a frame each way, or each block is
/// copied twice through a ring. It pays where the ranks' cores share no cache, and loses
/// near, so by default rank 0 chooses by its pace and the others follow
/// ([`GlooOptions::auto_lent_all_to_all_bytes`](crate::GlooOptions::auto_lent_all_to_all_bytes)
/// has the figures).
/// Each rank chooses for its own input (the first word of its table says which), and every
/// reader follows each publication as it finds it, so ranks may differ.
///
/// Each rank's table also carries how long its previous all_to_all took, and rank 0's the way
/// of the group's next call ([`AreaChoice`]); what this rank reads of those goes into
/// `heard`: where rank 0 paces which inputs over the fixed limit go to the area, it times the
/// group's calls by them and the others follow its choice (`backend::area_pace`;
/// [`hear_after_messages`] reads them after a call by messages).
///
/// Every rank takes this path where `max_input` is not 0 and the area can hold the table
/// (those agree on every rank), whatever its own input. A rank whose input neither fits nor
/// is lent announces its table alone
/// ([`crate::transport::Transport::shared_memory_announce`]) and returns `None` at once, so
/// that the caller runs the operation by messages: a group whose every input is too large
/// pays no wait. The others, waiting in the area, find that table and return `None` too
/// before reading anything lent; every one of them reads every table, so they agree. The
/// tables also let every rank that waited compare every pair's counts (what q sends p
/// against what p expects from q), so that counts that disagree fail each of them alike,
/// naming the first such pair, as a mismatch; a rank that went on by messages hears of it
/// from their abort notices, or finds its own pair's counts in the frames' headers. `None`
/// without an exchange where the transport has no area, or on one rank.
///
/// Why: where the ranks outnumber the cores every message costs a wait for a peer's turn on
/// a core, and small all_to_alls take about two thirds of the time this way (4 ranks on 2
/// cores: 4 B 7.9 us against 12.0, 32 KiB 15.2 against 28.4); with a core per rank, the
/// smallest (2 ranks: 4 B 0.7 against 1.2). `GlooOptions::auto_area_all_to_all_bytes` has
/// the figures. `scratch` holds the tables, so that a call allocates nothing but the list of
/// output blocks.
#[expect(
    clippy::too_many_arguments,
    reason = "the backend's all_to_all arguments, its choice and what rank 0 said"
)]
pub(crate) fn through_shared_memory(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    send_counts: &[usize],
    recv_counts: &[usize],
    area: AreaChoice,
    heard: &mut Heard,
    scratch: &mut Vec<u64>,
) -> Option<Result<bool>> {
    let AreaChoice {
        max_input,
        lend_from,
        next_in_area,
        last_took,
    } = area;
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    let words = table_words(n);
    let room = o.t.shared_memory_bytes();
    if n == 1 || max_input == 0 || room < 8 * (words + LENT_WORDS) {
        return None;
    }
    // This rank's table, then every rank's as it is read, then every lender's words.
    scratch.clear();
    scratch.resize(words * (n + 1), 0);
    let (mine, tables) = scratch.split_at_mut(words);
    // Allocated at the first lender, so that a call of small inputs allocates nothing more.
    let mut lenders: Vec<LentWords> = Vec::new();
    let inline = input.len() <= max_input && input.len() <= input_room(room, n);
    let lent = (!inline && input.len() >= lend_from)
        .then(|| o.t.shared_memory_lend(input))
        .flatten();
    let kind = match (inline, &lent) {
        (true, _) => Held::Inline,
        (false, Some(_)) => Held::Lent,
        (false, None) => Held::Announced,
    };
    mine[0] = first_word(kind, next_in_area, last_took).to_le();
    for (word, &c) in mine[1..]
        .iter_mut()
        .zip(send_counts.iter().chain(recv_counts))
    {
        *word = (c as u64).to_le();
    }
    let table: &[u8] = bytemuck::cast_slice(mine);
    // A rank that finds a publication without its data goes on by messages at once, while
    // others may still wait in the area for the last arrival: their wait keeps its frames.
    let ctx = StepCtx {
        area_then_messages: true,
        ..o.ctx
    };
    if kind == Held::Announced {
        let announced = o.t.shared_memory_announce(&ctx, 0, &[table]);
        // The ranks waiting in the area would wait out their timeout for a table not there.
        debug_assert!(announced, "a table fits the area: `room` was checked above");
        return None;
    }
    let lent_words = lent.as_ref().map(|l| l.words.to_le()).unwrap_or_default();
    let data: &[u8] = match kind {
        Held::Lent => bytemuck::cast_slice(&lent_words),
        _ => input,
    };
    let rb = blocks_of(recv_counts, elem);
    let mut parts: Vec<&mut [u8]> = split_blocks(output, &rb);
    let mut all_fit = true;
    let mut any_lent = false;
    let exchanged =
        o.t.shared_memory_exchange(&ctx, 0, &[table, data], &mut |p, theirs| {
            let counts = &mut tables[p * words..(p + 1) * words];
            let data = read_table(o, p, theirs, counts)?;
            if p != r {
                heard.note(p, counts[0]);
            }
            let sends = &counts[1..=n];
            let total = sends.iter().try_fold(0usize, |acc, &c| {
                usize::try_from(c)
                    .ok()
                    .and_then(|c| c.checked_mul(elem))
                    .and_then(|b| acc.checked_add(b))
            });
            match (held(counts[0]), total) {
                (Some(Held::Announced), Some(_)) if data.is_empty() => all_fit = false,
                (Some(Held::Inline), Some(t)) if t == data.len() => {
                    // Counts of this pair that disagree are reported below, from the tables;
                    // this rank's own block is copied from its input below.
                    let at: usize = sends[..r].iter().map(|&c| c as usize * elem).sum();
                    let theirs_to_me = &data[at..at + sends[r] as usize * elem];
                    if p != r && all_fit && theirs_to_me.len() == parts[p].len() {
                        parts[p].copy_from_slice(theirs_to_me);
                    }
                }
                (Some(Held::Lent), Some(_)) if words_of(data).is_some() => {
                    // Read once every table is in, so that none is read where some rank
                    // announced and the whole group goes on by messages.
                    lenders.resize(n, LentWords::default());
                    lenders[p] = words_of(data).unwrap_or_default();
                    any_lent = true;
                }
                _ => return Err(corrupt(o, p, data.len())),
            }
            Ok(())
        });
    if let Err(e) = exchanged? {
        return Some(Err(e));
    }
    if let Some(e) = disagreeing_pair(o, tables) {
        return Some(Err(o.t.fail_with(&o.ctx, e)));
    }
    if !all_fit {
        return None;
    }
    let sb = blocks_of(send_counts, elem);
    parts[r].copy_from_slice(&input[sb[r].clone()]);
    if !any_lent {
        return Some(Ok(false));
    }
    let reads = parts.iter_mut().enumerate().filter_map(|(p, part)| {
        let counts = &tables[p * words..(p + 1) * words];
        let lender = p != r && held(counts[0]) == Some(Held::Lent);
        let at: usize = counts[1..=r].iter().map(|&c| c as usize * elem).sum();
        lender.then(|| (p, lenders[p], at, &mut **part))
    });
    let done = read_then_close(o, reads);
    drop(lent);
    Some(done.map(|()| true))
}

/// What a rank's all_to_all puts in the group area, as its backend chose.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AreaChoice {
    /// Inputs up to this many bytes (and that fit) go in the area; 0 keeps the operation out
    /// of it.
    pub(crate) max_input: usize,
    /// Larger inputs of at least this many bytes are lent, where this rank can lend.
    pub(crate) lend_from: usize,
    /// Published in the table: the way of the group's next call, which rank 0 chooses for
    /// all (`backend::area_pace`); false on the others.
    pub(crate) next_in_area: bool,
    /// Published in the table: how long this rank's previous all_to_all took (up to about 2
    /// s; longer reads as that).
    pub(crate) last_took: Duration,
}

/// What a rank read of the others' tables in an all_to_all ([`AreaChoice`]'s words).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Heard {
    /// The way of the group's next call that rank 0 published.
    pub(crate) rank_zero_next_in_area: Option<bool>,
    /// The longest of the other ranks' previous all_to_alls, as they published them.
    pub(crate) slowest_last: Duration,
    /// How many other ranks' tables were read.
    pub(crate) ranks: usize,
}

impl Heard {
    /// Takes in the first word of rank `p`'s table, another rank's.
    fn note(&mut self, p: usize, word: u64) {
        if p == 0 {
            self.rank_zero_next_in_area = Some(word & NEXT_IN_AREA != 0);
        }
        let took = Duration::from_nanos(word >> TOOK_SHIFT);
        self.slowest_last = self.slowest_last.max(took);
        self.ranks += 1;
    }
}

/// The bit of a table's first word by which rank 0 publishes that the group's next call goes
/// through the area ([`AreaChoice::next_in_area`]); how the rank holds its input ([`Held`])
/// is in the bits below it, and the nanoseconds of its previous call
/// ([`AreaChoice::last_took`]) in those above.
const NEXT_IN_AREA: u64 = 1 << 32;

/// Where the previous call's nanoseconds begin in a table's first word.
const TOOK_SHIFT: u32 = 33;

/// A table's first word: how the rank holds its input, rank 0's choice of the next call's
/// way, and the rank's previous call's time.
fn first_word(kind: Held, next_in_area: bool, last_took: Duration) -> u64 {
    let took = u64::try_from(last_took.as_nanos())
        .unwrap_or(u64::MAX)
        .min(u64::MAX >> TOOK_SHIFT);
    let next = if next_in_area { NEXT_IN_AREA } else { 0 };
    kind as u64 | next | took << TOOK_SHIFT
}

/// How a table's first word (from another process) says its rank holds its input.
fn held(word: u64) -> Option<Held> {
    Held::from_word(word & (NEXT_IN_AREA - 1))
}

/// What a rank that went by messages without reading the tables hears of those it needs once
/// its messages are done (`Transport::shared_memory_peek`): a follower rank 0's, rank 0 every
/// other rank's. By then each of those ranks has published, since it publishes before it
/// sends; one that has not (its table shows for another call, or not yet) goes unheard.
pub(crate) fn hear_after_messages(o: &Op<'_>, heard: &mut Heard) {
    // A rank that waited in the area read every table there.
    if heard.ranks > 0 {
        return;
    }
    let r = o.rank();
    let from = if r == 0 { 1..o.n() } else { 0..1 };
    for p in from {
        o.t.shared_memory_peek(&o.ctx, p, &mut |theirs| {
            if let Some(word) = leading_word(theirs) {
                heard.note(p, word);
            }
        });
    }
}

/// The largest input of `n` ranks' all_to_all that an area of `room` bytes per rank holds
/// after its table.
pub(crate) fn input_room(room: usize, n: usize) -> usize {
    room.saturating_sub(8 * table_words(n))
}

/// Words of a rank's table: how it holds its input ([`Held`]), what it sends each of `n`
/// ranks, then what it expects from each.
fn table_words(n: usize) -> usize {
    1 + 2 * n
}

/// Rank `p`'s publication split: its table (how it holds its input, what it sends each rank
/// then what it expects from each) into `counts`, and the rest, returned. The table is
/// checked for length only; its values come from another process and are checked where used.
fn read_table<'d>(o: &Op<'_>, p: usize, theirs: &'d [u8], counts: &mut [u64]) -> Result<&'d [u8]> {
    let len = 8 * counts.len();
    if theirs.len() < len {
        return Err(corrupt(o, p, theirs.len()));
    }
    let (table, data) = theirs.split_at(len);
    for (word, bytes) in counts.iter_mut().zip(table.chunks_exact(8)) {
        *word = u64::from_le(bytemuck::pod_read_unaligned::<u64>(bytes));
    }
    Ok(data)
}

/// Rank `p`'s publication does not hold what its table says: a corrupt area, reported rather
/// than indexed with.
fn corrupt(o: &Op<'_>, p: usize, len: usize) -> Error {
    Error::invalid(
        o.rank(),
        o.ctx.op.name(),
        format!(
            "rank {p} published {len} bytes in the shared-memory group area, which its table \
             of counts does not account for"
        ),
    )
}

/// The first pair, in order of sender then receiver, whose sender's count for the receiver
/// differs from the receiver's count for the sender, as a mismatch between the two. `tables`
/// holds every rank's table in rank order (how it holds its input, what it sends each rank,
/// then what it expects from each). Every rank reads the same tables, so every rank names the
/// same pair.
fn disagreeing_pair(o: &Op<'_>, tables: &[u64]) -> Option<Error> {
    let n = o.n();
    let desc = |rank: usize, count: u64| OpDesc {
        rank,
        count,
        ..o.ctx.desc(0)
    };
    let words = table_words(n);
    for (q, sender) in tables.chunks_exact(words).enumerate() {
        for (p, receiver) in tables.chunks_exact(words).enumerate() {
            let (sent, expected) = (sender[1 + p], receiver[1 + n + q]);
            if sent != expected {
                return Some(Error::Mismatch {
                    ours: desc(p, expected),
                    theirs: desc(q, sent),
                });
            }
        }
    }
    None
}

/// Exchange of blocks with every peer: all in flight at once in one step, or, on more than two
/// ranks with a block to or from another rank of at least `pairwise_from` bytes
/// (`GlooOptions::all_to_all_pairwise_bytes`), in n − 1
/// steps, step k sending to rank + k and receiving from rank − k, so that (when every rank
/// runs it) each rank feeds one peer and is fed by one at a time. Each frame announces the
/// element count of its block, so split sizes that disagree between two ranks are caught.
/// Ranks may choose differently (their blocks differ): every block carries the same tag, and
/// one that arrives before the step that takes it is kept.
///
/// The engine writes a step's sends in list order, so the lists are staggered: rank r sends to
/// r+1, r+2, ... and receives from r-1, r-2, ... If every rank listed its peers in rank order,
/// all of them would first fill rank 0's socket, then rank 1's: incast on one receiver while
/// the others sit idle. Staggered, each receiver is fed by a different sender at every moment.
///
/// The own block bypasses the cache where the output is at least `output_leaves_cache_from`
/// bytes (`output_copy::output_leaves_cache_bytes`).
pub(crate) fn by_messages(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    send_counts: &[usize],
    recv_counts: &[usize],
    pairwise_from: usize,
    output_leaves_cache_from: usize,
) -> Result<()> {
    let (n, r, elem) = (o.n(), o.rank(), o.dtype().size());
    let sb = blocks_of(send_counts, elem);
    let rb = blocks_of(recv_counts, elem);
    // This rank's own block is a copy, not an exchange.
    let largest = (0..n)
        .filter(|&p| p != r)
        .map(|p| sb[p].len().max(rb[p].len()))
        .max()
        .unwrap_or(0);
    let leaves_cache = output.len() >= output_leaves_cache_from;
    let mut parts: Vec<Option<&mut [u8]>> =
        split_blocks(output, &rb).into_iter().map(Some).collect();
    if let Some(mine) = parts[r].take() {
        copy_into_output(mine, &input[sb[r].clone()], leaves_cache);
    }
    // Index k - 1 holds the send to r + k and the receive from r - k.
    let sends: Vec<_> = (1..n)
        .map(|k| (r + k) % n)
        .map(|p| Outgoing {
            peer: p,
            data: &input[sb[p].clone()],
            count: send_counts[p] as u64,
            tag: tags::DIRECT,
        })
        .collect();
    let mut recvs: Vec<_> = (1..n)
        .map(|k| (r + n - k) % n)
        .map(|p| Incoming {
            peer: p,
            // Only this rank's own part was taken.
            buf: parts[p].take().unwrap_or_default(),
            count: recv_counts[p] as u64,
            tag: tags::DIRECT,
            streamed: None,
            seq_ahead: 0,
        })
        .collect();
    if n > 2 && largest >= pairwise_from {
        for (send, recv) in sends.chunks(1).zip(recvs.chunks_mut(1)) {
            o.step(send, recv)?;
        }
        return Ok(());
    }
    o.step(&sends, &mut recvs)
}

/// An even all_to_all (every rank sends every rank `input.len() / n` bytes, and every rank
/// called [`dist_backend::Backend::all_to_all_even`]) through rank 0: every other rank sends
/// rank 0 its whole input, rank 0 sorts the blocks by destination and sends every rank its
/// whole output. Each rank but rank 0 waits once, where the direct exchange has every rank
/// wait for every other; over TCP each message also costs a system call and a wake-up, and
/// the star sends 2(n − 1) messages where the direct exchange sends n(n − 1). Where ranks
/// share cores every wait is a turn on a core, as for the other stars
/// ([`super::STAR_MAX_RANKS`]). Taken from 3 ranks where rank 0 receives at most
/// [`super::STAR_MAX_BYTES`] in all, as for all_gather's star. TCP only, 2-core host,
/// gloo_bench alternated with the direct exchange (medians, us, input per rank): 3 ranks 4 B
/// 25-27 against 52-59, 32 KiB 36-39 against 58-99, 64 KiB (128 KiB to rank 0) even, 128 KiB
/// 113-118 against 89-90; 4 ranks 4 B 34-41 against 79-92, 16 KiB 41-49 against 75-90, 32
/// KiB 50-61 against 79-83, 64 KiB 102-106 against 91-93; 8 ranks 64 B 89-98 against
/// 268-274, 8 KiB 98-102 against 242-250, 16 KiB 115-125 against 237-268. Past the bound on
/// 3 and 4 ranks rank 0's transfers, one after another, outweigh the waits they save; between
/// hosts, where each rank has a link of its own, they would outweigh them sooner.
///
/// Only the even form may take it: in the uneven one a rank knows only its own counts, so rank
/// 0 could not tell how long another rank's input is.
///
/// Its frames announce the elements per block, as the direct exchange's do, so that a rank
/// that called the uneven form meets this one with its counts alike and the mismatch names
/// the two algorithms.
pub(crate) fn star(
    o: &Op<'_>,
    input: &[u8],
    output: &mut [u8],
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (n, len) = (o.n(), input.len());
    debug_assert!(len.is_multiple_of(n) && output.len() == len);
    debug_assert!(
        o.agree.borrow().is_none(),
        "all_to_all runs no argument agreement"
    );
    let block = len / n;
    // The same operation, its frames announcing the elements per block.
    let o = &Op::new(o.t, o.ctx, (block / o.dtype().size()) as u64);
    if o.rank() != 0 {
        return super::star_leaf(o, input, output);
    }
    let (inbound, outbound) =
        super::scratch_bytes(scratch, 2 * (n - 1) * len).split_at_mut((n - 1) * len);
    super::star_receive(o, inbound, len)?;
    let input_of = |p: usize| {
        if p == 0 {
            input
        } else {
            &inbound[(p - 1) * len..p * len]
        }
    };
    let part = |p: usize, q: usize| &input_of(p)[q * block..(q + 1) * block];
    for p in 0..n {
        output[p * block..(p + 1) * block].copy_from_slice(part(p, 0));
    }
    for (q, theirs) in outbound
        .chunks_exact_mut(len.max(1))
        .enumerate()
        .take(n - 1)
    {
        for p in 0..n {
            theirs[p * block..(p + 1) * block].copy_from_slice(part(p, q + 1));
        }
    }
    super::star_release(o, |q| &outbound[(q - 1) * len..q * len])
}
