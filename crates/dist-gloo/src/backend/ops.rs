//! The [`Backend`] operations: each validates its arguments, then runs the algorithm its
//! size and the group's shape choose (see the crate docs for which runs when).

use super::*;
use crate::algo::alltoall::AreaChoice;
use crate::options::HALVING_DOUBLING_MIN_BYTES;

impl Backend for GlooBackend {
    fn name(&self) -> &'static str {
        "gloo"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::HOST_ALL
    }

    fn all_reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::AllReduce;
        let data = self.host(name, buf)?;
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.check_reduce(name, op, dtype)?;
        // Rank 0, where it paces lending, decides for the group (the others lend whenever
        // they can, and follow its announcement by messages).
        let len = data.len();
        let pace = self.all_reduce_pace.as_ref();
        let lend = pace.is_none_or(|p| p.lends(len));
        let start = Instant::now();
        let mut lent = false;
        self.run(
            name,
            dtype,
            count,
            Some(op),
            None,
            None,
            opts,
            |o, scratch| {
                self.prepare(o, op, data)?;
                if let Some(done) =
                    allreduce::through_shared_memory(o, data, op, scratch).or_else(|| {
                        allreduce::in_two_shots(o, data, op, scratch, self.area_all_reduce_bytes)
                    })
                {
                    done?;
                    self.finalize(o, op, data)
                } else if let Some(done) = (len >= self.lent_all_reduce_bytes)
                    .then(|| allreduce::lent_in_two_shots(o, data, op, scratch, lend))
                    .flatten()
                {
                    done?;
                    lent = true;
                    self.finalize(o, op, data)
                } else if data.len() > HALVING_DOUBLING_MIN_BYTES
                    && data.len() <= self.halving_doubling_bytes
                    && count >= self.world_size
                {
                    allreduce::halving_doubling(o, data, op, scratch)
                } else if data.len() <= self.small_bytes || count < self.world_size {
                    if takes_star(self.world_size, data.len(), STAR_MAX_BYTES) {
                        allreduce::star(o, data, op, scratch)?;
                    } else {
                        allreduce::recursive_doubling(o, data, op, scratch)?;
                    }
                    self.finalize(o, op, data)
                } else {
                    allreduce::ring(o, data, op, scratch, self.ring_piece_bytes)
                }
            },
        )?;
        if let Some(p) = pace {
            p.record(len, lent, start.elapsed());
        }
        Ok(())
    }

    fn broadcast(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Broadcast;
        let data = self.host(name, buf)?;
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.check_rank(name, "root", root)?;
        self.run(name, dtype, count, None, Some(root), None, opts, |o, _| {
            if self.world_size == 1 {
                Ok(())
            } else if let Some(done) = bcast::through_shared_memory(
                o,
                data,
                root,
                self.area_broadcast_min_bytes,
                // Past it the area's slots are evicted too: 8 MiB at 4 ranks was even.
                data.len() > self.output_leaves_cache_bytes,
            ) {
                done
            } else {
                // The chain pays one chunk of latency per hop, so it wins once the buffer has
                // more chunks than there are hops; with two ranks the two are the same.
                let seg = self.transport.segment_bytes();
                let chunks = data.len().div_ceil(seg);
                if data.len() <= self.small_bytes
                    || (self.world_size > 2 && chunks < self.world_size)
                {
                    bcast::tree(o, data, root)
                } else if self.world_size > 2 && data.len() >= self.broadcast_scatter_bytes {
                    bcast::scatter_all_gather(o, data, root)
                } else {
                    bcast::chain(o, data, root, seg)
                }
            }
        })
    }

    fn reduce(
        &self,
        buf: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Reduce;
        let data = self.host(name, buf)?;
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.check_rank(name, "root", root)?;
        self.check_reduce(name, op, dtype)?;
        self.run(
            name,
            dtype,
            count,
            Some(op),
            Some(root),
            None,
            opts,
            |o, scratch| {
                self.prepare(o, op, data)?;
                if data.len() <= self.small_bytes || count < self.world_size {
                    rooted::reduce_tree(o, data, op, root, scratch)?;
                } else {
                    rooted::reduce_ring(o, data, op, root, scratch, self.reduce_piece_bytes)?;
                }
                if self.rank == root {
                    self.finalize(o, op, data)
                } else {
                    Ok(())
                }
            },
        )
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::AllGather;
        let (input, output) = (self.host_ref(name, input)?, self.host(name, output)?);
        let total = self.check_counts(name, "counts", counts)?;
        self.check_len(name, "the input", input.len(), dtype, counts[self.rank])?;
        self.check_len(name, "the output", output.len(), dtype, total)?;
        // Rank 0, where it paces lending, decides for the group (the others lend whenever
        // they can, and follow its announcement by messages).
        let pace = self.all_gather_pace.as_ref();
        let lend = pace.is_none_or(|p| p.lends(output.len()));
        let start = Instant::now();
        let mut lent = false;
        self.run(
            name,
            dtype,
            total,
            None,
            None,
            Some(counts),
            opts,
            |o, _| {
                let blocks = blocks_of(counts, dtype.size());
                let leaves_cache = output.len() >= self.output_leaves_cache_bytes;
                copy_into_output(&mut output[blocks[self.rank].clone()], input, leaves_cache);
                if let Some(done) = allgather::through_shared_memory(
                    o,
                    input,
                    output,
                    &blocks,
                    self.area_all_gather_bytes,
                ) {
                    done
                } else if let Some(done) = (output.len() >= self.lent_all_gather_bytes)
                    .then(|| allgather::lent_through_shared_memory(o, input, output, &blocks, lend))
                    .flatten()
                {
                    lent = done.is_ok();
                    done
                } else if output.len() <= self.small_bytes
                    && takes_star(self.world_size, output.len(), STAR_MAX_BYTES)
                {
                    allgather::star(o, input, output, &blocks)
                } else if output.len() <= self.small_bytes && self.pairs_over_sockets {
                    allgather::doubling(o, output, &blocks)
                } else if output.len() <= self.small_bytes {
                    allgather::direct(o, output, &blocks)
                } else {
                    allgather::ring_in_pieces(o, output, &blocks, self.all_gather_piece_bytes)
                }
            },
        )?;
        if let Some(p) = pace {
            p.record(output.len(), lent, start.elapsed());
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        op: ReduceOp,
        counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::ReduceScatter;
        let (input, output) = (self.host_ref(name, input)?, self.host(name, output)?);
        let total = self.check_counts(name, "counts", counts)?;
        self.check_len(name, "the input", input.len(), dtype, total)?;
        self.check_len(name, "the output", output.len(), dtype, counts[self.rank])?;
        self.check_reduce(name, op, dtype)?;
        self.run(
            name,
            dtype,
            total,
            Some(op),
            None,
            Some(counts),
            opts,
            |o, scratch| {
                let blocks = blocks_of(counts, dtype.size());
                let run = |input: &[u8], output: &mut [u8], scratch: &mut Vec<u64>| {
                    if let Some(done) =
                        reducescatter::through_shared_memory(o, input, output, &blocks, op)
                    {
                        done
                    } else if input.len() <= self.small_bytes
                        && takes_star(
                            self.world_size,
                            input.len(),
                            reducescatter::STAR_MAX_INBOUND_BYTES,
                        )
                    {
                        reducescatter::star(o, input, output, &blocks, op, scratch)
                    } else if input.len() <= self.small_bytes && self.pairs_over_sockets {
                        let mut work = self.halving_work.lock().unwrap_or_else(|e| e.into_inner());
                        reducescatter::halving(o, input, output, &blocks, op, scratch, &mut work)
                    } else if input.len() <= self.small_bytes {
                        reducescatter::direct(o, input, output, &blocks, op, scratch)
                    } else {
                        reducescatter::ring_in_pieces(
                            o,
                            input,
                            output,
                            &blocks,
                            op,
                            scratch,
                            self.ring_piece_bytes,
                        )
                    }
                };
                if dist_wire::prepare_changes_input(op, dtype) {
                    // The scale (or f16 Avg's first division) must be applied to a copy: the
                    // input is the caller's.
                    let mut work = input.to_vec();
                    self.prepare(o, op, &mut work)?;
                    run(&work, output, scratch)?;
                } else {
                    run(input, output, scratch)?;
                }
                self.finalize(o, op, output)
            },
        )
    }

    fn all_to_all(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
        opts: &OpOptions,
    ) -> Result<()> {
        self.any_all_to_all(input, output, dtype, send_counts, recv_counts, false, opts)
    }

    fn all_to_all_even(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        count: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let counts = vec![count; self.world_size];
        self.any_all_to_all(input, output, dtype, &counts, &counts, true, opts)
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Gather;
        let input = self.host_ref(name, input)?;
        self.check_rank(name, "root", root)?;
        let count = self.check_whole(name, "the input", input.len(), dtype)?;
        let output = match (output, self.rank == root) {
            (Some(b), true) => {
                let out = self.host(name, b)?;
                self.check_len(
                    name,
                    "the output",
                    out.len(),
                    dtype,
                    count.saturating_mul(self.world_size),
                )?;
                Some(out)
            }
            (None, true) => {
                return Err(self.invalid(name, "the root must pass an output buffer".into()));
            }
            (Some(_), false) => {
                return Err(self.invalid(
                    name,
                    format!("only the root (rank {root}) takes an output buffer"),
                ));
            }
            (None, false) => None,
        };
        self.run(name, dtype, count, None, Some(root), None, opts, |o, _| {
            rooted::gather(o, input, output, root, self.output_leaves_cache_bytes)
        })
    }

    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        dtype: DType,
        root: usize,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::Scatter;
        let output = self.host(name, output)?;
        self.check_rank(name, "root", root)?;
        let count = self.check_whole(name, "the output", output.len(), dtype)?;
        let input = match (input, self.rank == root) {
            (Some(b), true) => {
                let inp = self.host_ref(name, b)?;
                self.check_len(
                    name,
                    "the input",
                    inp.len(),
                    dtype,
                    count.saturating_mul(self.world_size),
                )?;
                Some(inp)
            }
            (None, true) => {
                return Err(self.invalid(name, "the root must pass an input buffer".into()));
            }
            (Some(_), false) => {
                return Err(self.invalid(
                    name,
                    format!("only the root (rank {root}) takes an input buffer"),
                ));
            }
            (None, false) => None,
        };
        self.run(name, dtype, count, None, Some(root), None, opts, |o, _| {
            rooted::scatter(o, input, output, root)
        })
    }

    fn barrier(&self, opts: &OpOptions) -> Result<()> {
        self.run(
            CollectiveOp::Barrier,
            DType::U8,
            0,
            None,
            None,
            None,
            opts,
            |o, _| rooted::barrier(o),
        )
    }

    fn send(&self, buf: BufRef<'_>, dtype: DType, dst: usize, opts: &OpOptions) -> Result<()> {
        let name = CollectiveOp::SendRecv;
        let data = self.host_ref(name, buf)?;
        self.check_rank(name, "destination", dst)?;
        if dst == self.rank {
            return Err(self.invalid(name, "a rank cannot send to itself".into()));
        }
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.run(name, dtype, count, None, None, None, opts, |o, _| {
            o.step(&[o.send(dst, data, opts.tag)], &mut [])
        })
    }

    fn recv(&self, buf: BufMut<'_>, dtype: DType, src: usize, opts: &OpOptions) -> Result<()> {
        let name = CollectiveOp::SendRecv;
        let data = self.host(name, buf)?;
        self.check_rank(name, "source", src)?;
        if src == self.rank {
            return Err(self.invalid(name, "a rank cannot receive from itself".into()));
        }
        let count = self.check_whole(name, "the buffer", data.len(), dtype)?;
        self.run(name, dtype, count, None, None, None, opts, |o, _| {
            o.step(&[], &mut [o.recv(src, data, opts.tag)])
        })
    }

    fn probe(&self, src: usize, tag: u32) -> Result<bool> {
        let name = CollectiveOp::SendRecv;
        self.check_rank(name, "source", src)?;
        if src == self.rank {
            return Err(self.invalid(name, "a rank cannot receive from itself".into()));
        }
        // A poisoned group fails the `recv` at once: it would not wait.
        if self
            .poisoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return Ok(true);
        }
        Ok(self.transport.probe(src, tag))
    }

    fn arrival_waker(&self) -> Option<std::task::Waker> {
        self.transport.arrival_waker()
    }

    fn wait_for_arrival(&self, timeout: Duration) -> Result<()> {
        if self.transport.arrival_waker().is_none() {
            return Err(Error::Unsupported {
                rank: self.rank,
                backend: self.name(),
                what: "waiting for arrivals over this transport".into(),
            });
        }
        self.transport.wait_for_arrival(timeout);
        Ok(())
    }

    fn close(&self) {
        // A root's last op may still owe its verification: a disagreement must not go
        // unreported because the group was destroyed right after it.
        let owed = self
            .deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(agree::Deferred::timeout)
            .max();
        let clean = self
            .poisoned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none();
        // And a root that ran operations without frames owed (`agree::repeats_silently`)
        // looks once more at what its peers sent.
        let blind = {
            let mut b = self.blind.lock().unwrap_or_else(|e| e.into_inner());
            b.last.take().map(|last| (last, b.run_from))
        };
        let owed_and_looked = || {
            if let Some(timeout) = owed {
                self.verify_deferred(0, dist_backend::deadline_after(Instant::now(), timeout))?;
            }
            match blind {
                Some(((ctx, count), from)) => self.transport.look(&ctx, count, from),
                None => Ok(()),
            }
        };
        if clean && let Err(e) = owed_and_looked() {
            tracing::error!(rank = self.rank, error = %e, "a rooted operation failed its agreement, found at close");
            self.fail(&e);
        }
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_none() {
            *p = Some("the group was destroyed".into());
        }
        // Also once aborted: closing then delivers the abort notices the failed step could not
        // write at once, rather than leave them to die with the process. Under the lock, so no
        // operation starts on connections being closed; a second close finds none left.
        self.transport.close();
    }
}

impl GlooBackend {
    /// [`Backend::all_to_all`], and with `even` [`Backend::all_to_all_even`]: every rank
    /// called the even form, so every rank's counts are this rank's and every rank may go
    /// through rank 0 ([`alltoall::star`]).
    #[expect(
        clippy::too_many_arguments,
        reason = "the backend's all_to_all arguments and which form was called"
    )]
    fn any_all_to_all(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        dtype: DType,
        send_counts: &[usize],
        recv_counts: &[usize],
        even: bool,
        opts: &OpOptions,
    ) -> Result<()> {
        let name = CollectiveOp::AllToAll;
        let (input, output) = (self.host_ref(name, input)?, self.host(name, output)?);
        let sent = self.check_counts(name, "send_counts", send_counts)?;
        let received = self.check_counts(name, "recv_counts", recv_counts)?;
        self.check_len(name, "the input", input.len(), dtype, sent)?;
        self.check_len(name, "the output", output.len(), dtype, received)?;
        if send_counts[self.rank] != recv_counts[self.rank] {
            return Err(self.invalid(
                name,
                format!(
                    "this rank sends itself {} elements but expects to receive {} from itself",
                    send_counts[self.rank], recv_counts[self.rank]
                ),
            ));
        }
        // Rank 0, where it paces lending, decides for the group (the others lend whenever
        // their inputs allow, and follow its announcement by messages).
        let pace = self.all_to_all_pace.as_ref();
        let lend_from = match pace {
            Some(p) if !p.lends(input.len()) => usize::MAX,
            _ => self.lent_all_to_all_bytes,
        };
        // Every rank counts its calls for the area's pace, and rank 0 chooses for the group.
        let area_call = self
            .area_all_to_all_pace
            .as_ref()
            .map(|p| p.begin(input.len()));
        let area = AreaChoice {
            max_input: area_call.map_or(self.area_all_to_all_bytes, |c| c.max_input),
            lend_from,
            next_in_area: area_call.is_some_and(|c| c.next_in_area),
            last_took: area_call.map_or(Duration::ZERO, |c| c.last_took),
        };
        let start = Instant::now();
        let (mut lent, mut through_area) = (false, false);
        let mut heard = alltoall::Heard::default();
        self.run(name, dtype, 0, None, None, None, opts, |o, scratch| {
            if let Some(done) = alltoall::through_shared_memory(
                o,
                input,
                output,
                send_counts,
                recv_counts,
                area,
                &mut heard,
                scratch,
            ) {
                through_area = done.is_ok();
                lent = matches!(done, Ok(true));
                return done.map(|_| ());
            }
            // Every rank's input is as long as this one's in the even form, so all choose
            // alike; rank 0 receives and sends every other rank's whole input.
            if even
                && input.len() <= self.small_bytes
                && takes_star(self.world_size, input.len(), STAR_MAX_BYTES)
            {
                alltoall::star(o, input, output, scratch)?;
            } else {
                alltoall::by_messages(
                    o,
                    input,
                    output,
                    send_counts,
                    recv_counts,
                    self.all_to_all_pairwise_bytes,
                    self.output_leaves_cache_bytes,
                )?;
            }
            // A rank that went by messages without reading the tables reads those it needs.
            if area_call.is_some() {
                alltoall::hear_after_messages(o, &mut heard);
            }
            Ok(())
        })?;
        if let Some(p) = pace {
            p.record(input.len(), lent, start.elapsed());
        }
        if let (Some(p), Some(call)) = (&self.area_all_to_all_pace, area_call) {
            p.end(call, through_area, heard, start.elapsed());
        }
        Ok(())
    }
}
