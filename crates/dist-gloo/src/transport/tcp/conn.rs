//! One peer connection: a non-blocking stream, a staging buffer and the stash of frames that
//! arrived before the step that wants them.

use std::collections::VecDeque;
use std::io::{self, Read, Write};

use super::link::Link;
use crate::transport::shm::{Rings, link::ShmLink};
use dist_wire::{
    CloseReason, CollectiveOp, FrameHeader, HEADER_LEN, PAYLOAD_REF_LEN, PayloadRef, WireError,
};

/// Staging buffer size: small frames and headers are read through it, many per syscall.
const STAGING: usize = 64 << 10;
/// Largest frame kept in the stash; a bigger length is taken as corruption, not allocated.
const MAX_STASHED_FRAME: u64 = 256 << 20;

/// What is known of the peer's side of the connection. The first thing learnt sticks: a peer
/// that aborted and then exited is remembered for its abort notice, not for the EOF after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PeerState {
    /// Connected.
    Open,
    /// Sent `Close`: left the group cleanly.
    Left,
    /// The connection ended without `Close`, or broke.
    Lost(String),
    /// The peer aborted the group and said why in its `Close` (never
    /// [`CloseReason::Goodbye`]).
    Aborted(CloseReason),
}

/// The payload of a stashed frame.
#[derive(Debug)]
pub(super) enum Payload {
    /// The bytes, read off the socket.
    Inline(Vec<u8>),
    /// Where the bytes lie in the sender's memory (a [`FrameHeader::REMOTE`] frame).
    Remote(PayloadRef),
}

/// A frame's start as read off the socket: its header, and for a [`FrameHeader::REMOTE`]
/// frame where its payload lies.
pub(super) type FrameStart = (FrameHeader, Option<PayloadRef>);

/// Outcome of a non-blocking attempt.
pub(super) enum Io<T> {
    Ready(T),
    WouldBlock,
}

#[derive(Debug)]
pub(super) struct Conn {
    /// The peer's byte stream: the TCP connection, or shared-memory rings.
    pub(super) link: Link,
    staging: Box<[u8]>,
    start: usize,
    end: usize,
    /// A stashed frame still being read: header and the payload so far.
    partial: Option<(FrameHeader, Vec<u8>)>,
    pub(super) stash: VecDeque<(FrameHeader, Payload)>,
    pub(super) state: PeerState,
    /// Messages this rank has sent by reference on this connection, and how many of them the
    /// peer has acknowledged (acknowledgements arrive in order).
    pub(super) offered: u64,
    pub(super) acked: u64,
    /// Acknowledgements waiting to be written, and how much of them is written.
    out: Vec<u8>,
    out_done: usize,
    /// An abort notice was queued for the peer: closing must not reset the connection before
    /// the peer has read it (see `Engine::close`).
    pub(super) notified: bool,
}

impl Conn {
    pub(super) fn new(stream: mio::net::TcpStream) -> Self {
        Conn {
            link: Link::Tcp(stream),
            staging: vec![0u8; STAGING].into_boxed_slice(),
            start: 0,
            end: 0,
            partial: None,
            stash: VecDeque::new(),
            state: PeerState::Open,
            offered: 0,
            acked: 0,
            out: Vec::new(),
            out_done: 0,
            notified: false,
        }
    }

    pub(super) fn staged(&self) -> usize {
        self.end - self.start
    }

    /// Reads into the staging buffer until it holds `n` bytes. `Ok(Ready(false))` on EOF.
    fn fill(&mut self, n: usize) -> io::Result<Io<bool>> {
        debug_assert!(n <= STAGING);
        if self.staged() >= n {
            return Ok(Io::Ready(true));
        }
        if self.start > 0 {
            self.staging.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        // A socket is read for all it has (one system call for many small frames); a ring
        // only for what is needed, so that a payload that follows is copied straight into its
        // destination by `read_payload` rather than through the staging buffer.
        let room = if self.is_shm() { n } else { STAGING };
        while self.end < n {
            match self.link.read(&mut self.staging[self.end..room]) {
                Ok(0) => return Ok(Io::Ready(false)),
                Ok(k) => self.end += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Io::WouldBlock),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Io::Ready(true))
    }

    /// Reads the start of the next data frame: its header and, for a frame sent by
    /// reference, the [`PayloadRef`] that follows it. Acknowledgements met on the way are
    /// counted in [`Conn::acked`], never returned. `Ok(Ready(None))` on EOF.
    pub(super) fn read_header(&mut self) -> io::Result<Io<Option<Result<FrameStart, WireError>>>> {
        loop {
            match self.fill(HEADER_LEN)? {
                Io::WouldBlock => return Ok(Io::WouldBlock),
                Io::Ready(false) => return Ok(Io::Ready(None)),
                Io::Ready(true) => {}
            }
            let h = match FrameHeader::decode(&self.staging[self.start..self.end]) {
                Ok(h) => h,
                Err(e) => return Ok(Io::Ready(Some(Err(e)))),
            };
            if h.flags & FrameHeader::ACK != 0 {
                self.start += HEADER_LEN;
                self.acked += 1;
                continue;
            }
            if h.op == CollectiveOp::Close {
                // Read whole (its payload is at most `MAX_CLOSE_PAYLOAD` bytes, which the
                // decoder checked), so that the reason is known the moment the frame is.
                let len = HEADER_LEN + h.payload_len as usize;
                match self.fill(len)? {
                    Io::WouldBlock => return Ok(Io::WouldBlock),
                    Io::Ready(false) => return Ok(Io::Ready(None)),
                    Io::Ready(true) => {}
                }
                let payload = &self.staging[self.start + HEADER_LEN..self.start + len];
                let reason = CloseReason::decode(&h, payload);
                self.start += len;
                return Ok(Io::Ready(Some(reason.map(|r| {
                    self.closed(r);
                    (h, None)
                }))));
            }
            if h.flags & FrameHeader::REMOTE == 0 {
                self.start += HEADER_LEN;
                return Ok(Io::Ready(Some(Ok((h, None)))));
            }
            // Consume the header only together with its reference, so a partial read leaves
            // the frame whole for the next attempt.
            match self.fill(HEADER_LEN + PAYLOAD_REF_LEN)? {
                Io::WouldBlock => return Ok(Io::WouldBlock),
                Io::Ready(false) => return Ok(Io::Ready(None)),
                Io::Ready(true) => {}
            }
            let at = PayloadRef::decode(&self.staging[self.start + HEADER_LEN..self.end]);
            self.start += HEADER_LEN + PAYLOAD_REF_LEN;
            return Ok(Io::Ready(Some(at.map(|r| (h, Some(r))))));
        }
    }

    /// Reads payload bytes into `dst`, first from staging, then (for large remainders) straight
    /// from the socket. Returns bytes read; `Ready(0)` with a non-empty `dst` means EOF.
    pub(super) fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<Io<usize>> {
        if dst.is_empty() {
            return Ok(Io::Ready(0));
        }
        if self.staged() == 0 {
            // A ring is read straight into `dst` at any size (see `fill`).
            if dst.len() >= STAGING / 2 || self.is_shm() {
                return loop {
                    match self.link.read(dst) {
                        Ok(k) => break Ok(Io::Ready(k)),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            break Ok(Io::WouldBlock);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => break Err(e),
                    }
                };
            }
            match self.fill(1)? {
                Io::WouldBlock => return Ok(Io::WouldBlock),
                Io::Ready(false) => return Ok(Io::Ready(0)),
                Io::Ready(true) => {}
            }
        }
        let k = self.staged().min(dst.len());
        dst[..k].copy_from_slice(&self.staging[self.start..self.start + k]);
        self.start += k;
        Ok(Io::Ready(k))
    }

    /// The headers of every frame stashed, the one still being read included (its header
    /// says what it is before its payload is in).
    pub(super) fn stashed_headers(&self) -> impl Iterator<Item = &FrameHeader> {
        let partial = self.partial.as_ref().map(|(h, _)| h);
        self.stash.iter().map(|(h, _)| h).chain(partial)
    }

    /// Starts stashing a frame whose header (and reference) has been read.
    pub(super) fn begin_stash(&mut self, (h, at): FrameStart) -> Result<(), String> {
        if let Some(at) = at {
            self.stash.push_back((h, Payload::Remote(at)));
            return Ok(());
        }
        if h.payload_len > MAX_STASHED_FRAME {
            return Err(format!(
                "frame of {} bytes exceeds the {MAX_STASHED_FRAME}-byte limit (corrupt stream?)",
                h.payload_len
            ));
        }
        self.partial = Some((h, Vec::with_capacity(h.payload_len as usize)));
        Ok(())
    }

    /// Continues reading a stashed frame. `Ready(true)` when none is pending any more,
    /// `Ready(false)` on EOF mid-frame.
    pub(super) fn finish_stash(&mut self) -> io::Result<Io<bool>> {
        while let Some((h, mut v)) = self.partial.take() {
            let want = h.payload_len as usize;
            if v.len() == want {
                self.stash.push_back((h, Payload::Inline(v)));
                break;
            }
            let at = v.len();
            v.resize(want, 0);
            let r = self.read_payload(&mut v[at..]);
            match r {
                Ok(Io::Ready(0)) => {
                    v.truncate(at);
                    self.partial = Some((h, v));
                    return Ok(Io::Ready(false));
                }
                Ok(Io::Ready(k)) => {
                    v.truncate(at + k);
                    self.partial = Some((h, v));
                }
                Ok(Io::WouldBlock) => {
                    v.truncate(at);
                    self.partial = Some((h, v));
                    return Ok(Io::WouldBlock);
                }
                Err(e) => {
                    v.truncate(at);
                    self.partial = Some((h, v));
                    return Err(e);
                }
            }
        }
        Ok(Io::Ready(true))
    }

    /// Reads every complete frame the socket has into the stash, noting `Close` and EOF in
    /// [`Conn::state`]. Used on connections the current step does not receive from.
    pub(super) fn drain(&mut self) {
        loop {
            match self.finish_stash() {
                Ok(Io::Ready(true)) => {}
                Ok(Io::Ready(false)) => return self.eof(),
                Ok(Io::WouldBlock) => return,
                Err(e) => return self.broken(&e),
            }
            match self.read_header() {
                Ok(Io::WouldBlock) => return,
                Ok(Io::Ready(None)) => return self.eof(),
                // `read_header` noted why in `state`; nothing follows a `Close` but the EOF.
                Ok(Io::Ready(Some(Ok((h, _))))) if h.op == CollectiveOp::Close => {}
                Ok(Io::Ready(Some(Ok(frame)))) => {
                    if let Err(why) = self.begin_stash(frame) {
                        self.state = PeerState::Lost(why);
                        return;
                    }
                }
                Ok(Io::Ready(Some(Err(e)))) => {
                    return self.lose(format!("it sent bytes that are not a frame: {e}"));
                }
                Err(e) => return self.broken(&e),
            }
        }
    }

    /// Notes the reason of the peer's `Close` frame, unless something was learnt before.
    pub(super) fn closed(&mut self, reason: CloseReason) {
        if self.state == PeerState::Open {
            self.state = match reason {
                CloseReason::Goodbye => PeerState::Left,
                other => PeerState::Aborted(other),
            };
        }
    }

    /// Notes that the connection is unusable for `why`, unless something was learnt before.
    pub(super) fn lose(&mut self, why: String) {
        if self.state == PeerState::Open {
            self.state = PeerState::Lost(why);
        }
    }

    pub(super) fn eof(&mut self) {
        self.lose("its connection closed without a goodbye (the process exited or crashed)".into());
    }

    pub(super) fn broken(&mut self, e: &io::Error) {
        self.lose(format!("connection error: {e}"));
    }

    pub(super) fn has_partial(&self) -> bool {
        self.partial.is_some()
    }

    /// Queues the acknowledgement of a message received by reference (`h` is its last frame).
    pub(super) fn queue_ack(&mut self, h: &FrameHeader) {
        let ack = FrameHeader {
            flags: FrameHeader::ACK,
            payload_len: 0,
            ..*h
        };
        self.out.extend_from_slice(&ack.encode());
    }

    /// Queues an abort notice: after `rest`, the unwritten remainder of the data frame this
    /// rank was in the middle of sending (a frame cut short would make the peer read the
    /// notice as payload), and after the acknowledgements already queued, in wire order.
    pub(super) fn queue_notice(&mut self, rest: &[u8], notice: &[u8]) {
        let pending = &self.out[self.out_done..];
        // A half-written acknowledgement and a half-written data frame exclude each other: a
        // frame starts only once the acknowledgements are out.
        let (first, second) = if self.out_mid_frame() {
            (pending, rest)
        } else {
            (rest, pending)
        };
        let mut out = Vec::with_capacity(first.len() + second.len() + notice.len());
        out.extend_from_slice(first);
        out.extend_from_slice(second);
        out.extend_from_slice(notice);
        self.out = out;
        self.out_done = 0;
        self.notified = true;
    }

    /// Moves the peer's frames onto shared-memory `rings`, keeping the connection as their
    /// doorbell (when the mesh is built, before any frame).
    pub(super) fn use_rings(mut self, rings: Rings) -> Self {
        self.link = match self.link {
            Link::Tcp(stream) => Link::Shm(Box::new(ShmLink::new(stream, rings))),
            shm @ Link::Shm(_) => shm,
        };
        self
    }

    /// Whether the peer's frames travel through shared memory.
    pub(super) fn is_shm(&self) -> bool {
        matches!(self.link, Link::Shm(_))
    }

    /// The link and the bytes queued for it but not yet written (when closing).
    pub(super) fn into_parts(self) -> (Link, Vec<u8>) {
        let pending = self.out[self.out_done..].to_vec();
        (self.link, pending)
    }

    /// Whether acknowledgements wait to be written.
    pub(super) fn has_out(&self) -> bool {
        self.out_done < self.out.len()
    }

    /// Whether an acknowledgement is half written (no other frame may start on the stream).
    pub(super) fn out_mid_frame(&self) -> bool {
        !self.out_done.is_multiple_of(HEADER_LEN)
    }

    /// Writes queued acknowledgements. `Ok(true)` when none is left.
    pub(super) fn flush_out(&mut self) -> io::Result<bool> {
        while self.has_out() {
            match self.link.write(&self.out[self.out_done..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => self.out_done += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.out.clear();
        self.out_done = 0;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};

    use dist_wire::{DType, NO_ROOT};

    use super::*;

    /// A connected pair over loopback: this side as a `Conn`, the other as a blocking stream.
    fn pair() -> (Conn, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let other = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (mine, _) = l.accept().expect("accept");
        mine.set_nonblocking(true).expect("nonblocking");
        (Conn::new(mio::net::TcpStream::from_std(mine)), other)
    }

    fn header(seq: u64) -> FrameHeader {
        FrameHeader {
            op: CollectiveOp::AllReduce,
            dtype: DType::F32,
            reduce: 0,
            group: 1,
            sender: 0,
            seq,
            count: 4,
            root: NO_ROOT,
            tag: 0,
            offset: 0,
            payload_len: 16,
            flags: 0,
            splits: 0,
            reduce_arg: 0,
        }
    }

    /// Reads exactly `n` bytes from `s`.
    fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).expect("read");
        b
    }

    #[test]
    fn a_notice_goes_after_the_rest_of_a_half_sent_frame_and_the_queued_acks() {
        let (mut c, mut other) = pair();
        c.queue_ack(&header(1));
        let rest = b"rest of a frame".to_vec();
        let notice = CloseReason::Lost { culprit: 3 }.encode(0);
        c.queue_notice(&rest, &notice);
        assert!(c.flush_out().expect("flush"));
        let got = read_n(&mut other, rest.len() + HEADER_LEN + notice.len());
        assert_eq!(&got[..rest.len()], &rest[..]);
        let ack = FrameHeader::decode(&got[rest.len()..]).expect("an ack");
        assert_eq!((ack.flags, ack.seq), (FrameHeader::ACK, 1));
        assert_eq!(&got[rest.len() + HEADER_LEN..], &notice[..]);
    }

    #[test]
    fn a_half_written_ack_is_finished_before_the_notice() {
        let (mut c, mut other) = pair();
        c.queue_ack(&header(1));
        // As if the socket had taken 10 bytes of the ack.
        c.out_done = 10;
        let notice = CloseReason::Goodbye.encode(0);
        c.queue_notice(&[], &notice);
        assert!(c.flush_out().expect("flush"));
        let got = read_n(&mut other, HEADER_LEN - 10 + notice.len());
        assert_eq!(&got[..HEADER_LEN - 10], &header_ack(1)[10..]);
        assert_eq!(&got[HEADER_LEN - 10..], &notice[..]);
    }

    fn header_ack(seq: u64) -> [u8; HEADER_LEN] {
        FrameHeader {
            flags: FrameHeader::ACK,
            payload_len: 0,
            ..header(seq)
        }
        .encode()
    }

    #[test]
    fn what_a_peer_said_first_sticks_over_its_eof_and_later_frames() {
        let (mut c, mut other) = pair();
        let found = header(7);
        let met = FrameHeader {
            sender: 2,
            count: 5,
            ..found
        };
        let notice = CloseReason::Mismatch {
            culprit: 2,
            found,
            met,
        };
        other.write_all(&notice.encode(1)).expect("write");
        other
            .write_all(&CloseReason::Goodbye.encode(1))
            .expect("write");
        drop(other);
        // The whole notice may take a few reads to arrive; the EOF comes after it.
        for _ in 0..1_000_000 {
            c.drain();
            if c.state != PeerState::Open {
                break;
            }
            std::thread::yield_now();
        }
        assert_eq!(c.state, PeerState::Aborted(notice));
        c.drain();
        c.eof();
        assert_eq!(c.state, PeerState::Aborted(notice));
    }
}
