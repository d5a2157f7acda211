//! The mesh: one TCP connection per pair of workers, each opened by a `Hello` naming the
//! dialer and the job.

use super::*;

/// Builds the full mesh: this worker dials every lower rank and accepts every higher one,
/// each connection opened by a `Hello` naming the dialer and the job.
pub(super) fn connect_mesh(
    label: &str,
    rank: usize,
    published: &[Published],
    listener: &TcpListener,
    job: &str,
    name: &str,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let world = published.len();
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let io = |peer: String, op: &'static str| {
        let label = label.to_owned();
        move |source| Error::Io {
            worker: label,
            peer,
            op,
            source,
        }
    };
    for (r, p) in published.iter().enumerate().take(rank) {
        let who = format!("{} (rank {r})", p.name);
        let ip: IpAddr = p.host.parse().map_err(|_| Error::InvalidArgument {
            worker: label.to_owned(),
            op: "init_rpc",
            what: format!("{who} published the address {:?}, not an IP", p.host),
        })?;
        let addr = SocketAddr::new(ip, p.port);
        let stream = loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(io(who, "connecting")(e)),
                // A listener's backlog may be full for a moment while a big job starts.
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        stream
            .set_nodelay(true)
            .map_err(io(who.clone(), "setting TCP_NODELAY"))?;
        let meta = encode_meta(&HelloMeta {
            rank,
            name: name.to_owned(),
            job: job.to_owned(),
        });
        let h = Header {
            kind: Kind::Hello,
            call_id: 0,
            meta_len: meta.len() as u32,
            body_len: 0,
            blob_len: 0,
        };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(&meta);
        (&stream)
            .write_all(&frame)
            .map_err(io(who, "sending hello"))?;
        streams[r] = Some(stream);
    }
    let mut missing = world - rank - 1;
    listener
        .set_nonblocking(true)
        .map_err(io("listener".into(), "setting non-blocking"))?;
    while missing > 0 {
        let (stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<usize> = (rank + 1..world)
                        .filter(|&r| streams[r].is_none())
                        .collect();
                    return Err(Error::InvalidArgument {
                        worker: label.to_owned(),
                        op: "init_rpc",
                        what: format!("ranks {waiting:?} did not connect before the init timeout"),
                    });
                }
                // Init only: a short poll keeps the listener owned by this thread alone.
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(io("listener".into(), "accepting")(e)),
        };
        let peer = from.to_string();
        stream
            .set_nonblocking(false)
            .map_err(io(peer.clone(), "setting blocking"))?;
        stream
            .set_nodelay(true)
            .map_err(io(peer.clone(), "setting TCP_NODELAY"))?;
        // A stranger that connects and says nothing holds init up for a bounded time only.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), Duration::from_secs(30));
        stream
            .set_read_timeout(Some(left))
            .map_err(io(peer.clone(), "setting a read timeout"))?;
        let hello = read_hello(&stream, &Limits::default());
        let stranger = |why: String| {
            tracing::warn!(worker = label, %peer, %why, "refusing a connection");
        };
        match hello {
            Ok(h) if h.job != job => stranger(format!("it belongs to another job ({})", h.job)),
            Ok(h) if h.rank <= rank || h.rank >= world => {
                stranger(format!("rank {} does not dial this worker", h.rank))
            }
            Ok(h) if streams[h.rank].is_some() => {
                stranger(format!("rank {} is already connected", h.rank))
            }
            Ok(h) => {
                stream
                    .set_read_timeout(None)
                    .map_err(io(peer.clone(), "clearing the read timeout"))?;
                streams[h.rank] = Some(stream);
                missing -= 1;
            }
            Err(e) => stranger(e),
        }
    }
    Ok(streams)
}

fn read_hello(mut s: &TcpStream, limits: &Limits) -> std::result::Result<HelloMeta, String> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).map_err(|e| e.to_string())?;
    let h = Header::decode(&hb, limits).map_err(|e| e.to_string())?;
    if h.kind != Kind::Hello || h.body_len != 0 || h.blob_len != 0 || h.meta_len > 4096 {
        return Err(format!("expected a Hello frame, got {:?}", h.kind));
    }
    let mut meta = vec![0u8; h.meta_len as usize];
    s.read_exact(&mut meta).map_err(|e| e.to_string())?;
    decode_meta(Kind::Hello, &meta).map_err(|e| e.to_string())
}
