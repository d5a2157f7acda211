//! Opening a connection: retries with exponential backoff and jitter until the deadline,
//! then the handshake torch's server expects.

use super::*;

/// A small xorshift generator seeded from the pid and the clock, for backoff jitter.
struct Jitter(u64);

impl Jitter {
    pub(super) fn new() -> Self {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Jitter((u64::from(std::process::id()) << 32 ^ t) | 1)
    }

    /// A factor in [0.5, 1.5).
    fn factor(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        0.5 + (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Connects and handshakes, retrying with backoff until `deadline` (`None`: for ever). Every
/// attempt, the TCP connect and the VALIDATE/PING exchange, ends by the deadline: a stopped
/// server's kernel still completes the TCP handshake, but nobody answers the PING.
pub(super) fn connect_with_retry(
    host: &str,
    port: u16,
    addr: &str,
    deadline: Option<Instant>,
) -> Result<Conn, StoreError> {
    let start = Instant::now();
    let mut jitter = Jitter::new();
    let mut delay = Duration::from_millis(10);
    let mut attempts = 0u32;
    let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    loop {
        attempts += 1;
        // An attempt with no time left still gets a moment, so that a deadline that passed
        // while queueing for the pool reports why connecting failed.
        let budget = left().map(|l| l.max(Duration::from_millis(10)));
        let err = match try_connect(host, port, budget) {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let waited = start.elapsed();
        if left().is_some_and(|l| l.is_zero()) {
            return Err(StoreError::Connect {
                addr: addr.to_owned(),
                attempts,
                waited,
                source: err,
            });
        }
        let sleep = delay.mul_f64(jitter.factor());
        let sleep = left().map_or(sleep, |l| sleep.min(l));
        tracing::debug!(
            "failed to connect/validate to host {addr} - retrying (try={attempts}, \
             waited={waited:?}, delay={sleep:?}): {err}"
        );
        std::thread::sleep(sleep);
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// One attempt: TCP connect, VALIDATE, PING with our pid, all within `timeout` (`None`: no
/// limit).
fn try_connect(host: &str, port: u16, timeout: Option<Duration>) -> io::Result<Conn> {
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolved to no address");
    for a in addrs {
        let stream = match timeout {
            Some(t) => TcpStream::connect_timeout(&a, t),
            None => TcpStream::connect(a),
        };
        match stream {
            Ok(stream) => match handshake(stream, timeout) {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            },
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn handshake(mut stream: TcpStream, timeout: Option<Duration>) -> io::Result<Conn> {
    stream.set_nodelay(true)?;
    let timeout = timeout.map(|t| t.max(Duration::from_millis(1)));
    stream.set_write_timeout(timeout)?;
    let nonce = std::process::id();
    let mut hello = Request::Validate {
        magic: VALIDATION_MAGIC,
    }
    .to_bytes();
    Request::Ping { nonce }.encode(&mut hello);
    stream.write_all(&hello)?;
    stream.set_read_timeout(timeout)?;
    let mut pong = [0u8; 4];
    stream.read_exact(&mut pong).map_err(|e| {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            // The kernel of a stopped host still completes the TCP handshake.
            io::Error::new(
                io::ErrorKind::TimedOut,
                "the server accepted the connection but did not answer its PING \
                 (its host may be stopped or hung)",
            )
        } else {
            e
        }
    })?;
    if u32::from_le_bytes(pong) != nonce {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "PING answered {} instead of our nonce {nonce}",
                u32::from_le_bytes(pong)
            ),
        ));
    }
    Ok(Conn {
        stream,
        buf: Vec::new(),
    })
}
