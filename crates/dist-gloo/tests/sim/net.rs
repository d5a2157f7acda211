//! The simulated network: one byte stream per ordered pair of ranks, with a bounded window,
//! per-chunk delays (so deliveries on different connections reorder while each connection
//! stays in order, as TCP), writes and reads cut at random boundaries, and TCP's endings: FIN
//! (EOF after the bytes in flight), reset (what is in flight is lost, the reader gets an error)
//! and a reader gone (the writer's next write fails).

use std::collections::VecDeque;
use std::time::Duration;

/// A small seeded generator (SplitMix64): the whole run is a function of the seed.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    /// True with probability `pct` percent.
    pub(crate) fn chance(&mut self, pct: u64) -> bool {
        self.next() % 100 < pct
    }
}

/// What a read found.
pub(crate) enum Got {
    Bytes(usize),
    Empty,
    Eof,
    Error(&'static str),
}

#[derive(Debug, Default)]
struct Link {
    window: usize,
    /// Written, not yet arrived: (arrival time, bytes), arrival times non-decreasing.
    flight: VecDeque<(Duration, Vec<u8>)>,
    flight_bytes: usize,
    /// Arrived, not yet read.
    arrived: VecDeque<u8>,
    /// The writer closed: EOF once everything before is read.
    fin: bool,
    /// The writer's end was reset: the reader gets an error.
    reset: bool,
    /// The reader's end is gone: writes fail.
    reader_gone: bool,
}

/// Every connection of a world of `n` ranks.
pub(crate) struct Net {
    n: usize,
    links: Vec<Link>,
    /// Longest delay of one chunk.
    pub(crate) max_delay: Duration,
}

impl Net {
    pub(crate) fn new(n: usize, rng: &mut Rng) -> Self {
        let links = (0..n * n)
            .map(|_| Link {
                window: [1, 7, 64, 200, 4096, 1 << 16][rng.range(0, 5)],
                ..Link::default()
            })
            .collect();
        Net {
            n,
            links,
            max_delay: Duration::from_micros([0, 10, 500][rng.range(0, 2)]),
        }
    }

    fn link(&mut self, src: usize, dst: usize) -> &mut Link {
        &mut self.links[src * self.n + dst]
    }

    /// Writes a random prefix of what fits of `parts` from `src` to `dst`.
    pub(crate) fn write(
        &mut self,
        rng: &mut Rng,
        now: Duration,
        src: usize,
        dst: usize,
        parts: [&[u8]; 2],
    ) -> Result<usize, &'static str> {
        let max_delay = self.max_delay;
        let l = self.link(src, dst);
        if l.reader_gone {
            return Err("connection reset by peer");
        }
        let room = l.window.saturating_sub(l.flight_bytes + l.arrived.len());
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let n = total.min(room);
        if n == 0 {
            return Ok(0);
        }
        let n = if rng.chance(50) { n } else { rng.range(1, n) };
        let mut bytes = Vec::with_capacity(n);
        for p in parts {
            let k = p.len().min(n - bytes.len());
            bytes.extend_from_slice(&p[..k]);
        }
        let delay = Duration::from_nanos(rng.range(0, max_delay.as_nanos() as usize) as u64);
        let at = l
            .flight
            .back()
            .map_or(now + delay, |(t, _)| (*t).max(now + delay));
        l.flight_bytes += n;
        l.flight.push_back((at, bytes));
        Ok(n)
    }

    /// Reads a random prefix of what has arrived from `src` at `dst` into `buf`.
    pub(crate) fn read(&mut self, rng: &mut Rng, src: usize, dst: usize, buf: &mut [u8]) -> Got {
        let l = self.link(src, dst);
        if l.reset {
            return Got::Error("connection reset by peer");
        }
        if l.arrived.is_empty() {
            return if l.fin && l.flight.is_empty() {
                Got::Eof
            } else {
                Got::Empty
            };
        }
        let n = buf.len().min(l.arrived.len());
        let n = if rng.chance(50) { n } else { rng.range(1, n) };
        for (d, b) in buf[..n].iter_mut().zip(l.arrived.drain(..n)) {
            *d = b;
        }
        Got::Bytes(n)
    }

    /// Moves every chunk due by `now` to its reader.
    pub(crate) fn deliver(&mut self, now: Duration) {
        for l in &mut self.links {
            while l.flight.front().is_some_and(|(t, _)| *t <= now) {
                let (_, bytes) = l.flight.pop_front().expect("checked");
                l.flight_bytes -= bytes.len();
                if !l.reader_gone {
                    l.arrived.extend(bytes);
                }
            }
        }
    }

    /// When the next chunk arrives.
    pub(crate) fn next_arrival(&self) -> Option<Duration> {
        self.links
            .iter()
            .filter_map(|l| l.flight.front().map(|(t, _)| *t))
            .min()
    }

    /// `src` closes its stream to `dst` in order (FIN after what it wrote).
    pub(crate) fn fin(&mut self, src: usize, dst: usize) {
        self.link(src, dst).fin = true;
    }

    /// `rank` dies: with `reset`, its outgoing bytes in flight or unread are lost and its
    /// peers' reads fail; without, they read what was sent, then EOF. Either way its peers'
    /// writes to it fail.
    pub(crate) fn kill(&mut self, rank: usize, reset: bool) {
        for p in 0..self.n {
            if p == rank {
                continue;
            }
            let out = self.link(rank, p);
            out.fin = true;
            if reset {
                out.reset = true;
                out.flight.clear();
                out.flight_bytes = 0;
                out.arrived.clear();
            }
            let inp = self.link(p, rank);
            inp.reader_gone = true;
            inp.arrived.clear();
        }
    }

    /// Throws away what has arrived at `rank` (a closed rank lingering until its peers close).
    pub(crate) fn discard_input(&mut self, rank: usize) {
        for p in 0..self.n {
            if p != rank {
                self.link(p, rank).arrived.clear();
            }
        }
    }
}
