//! Rank 0 hands an opaque blob (the NCCL unique id) to every rank over TCP; the connections then stay open for
//! heartbeats, barriers and failure notices, so that a rank that dies or freezes is named to all the others.
//!
//! Wire format (little-endian). Hello, rank k -> rank 0: `RNRV`, version u32, rank u32, world size u32.
//! Reply, rank 0 -> rank k: `RNRV`, status u8 (0: ok, 1: this rank rejected, 2: rendezvous aborted because of
//! another rank), length u32, then the payload (or the message). Afterwards both sides exchange frames: kind u8,
//! argument u32, length u32, bytes (heartbeat, barrier n, release n, rank r failed + why, goodbye clean/dropped).
//! After any error (a failed rank, a barrier timeout) the group is unusable: stop the process.

use super::env::DistEnv;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const MAGIC: [u8; 4] = *b"RNRV";
pub const VERSION: u32 = 1;
/// Size of an NCCL unique id (`ncclUniqueId`), the payload this exists to carry.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
const MAX_PAYLOAD: usize = 1 << 20;
/// A connection that sends no hello within this long is not a rank (a port scanner, a health check): dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

const HEARTBEAT: u8 = 1;
const BARRIER: u8 = 2;
const RELEASE: u8 = 3;
const FAILED: u8 = 4;
const BYE: u8 = 5;
/// Argument of BYE: the group was closed (0), or dropped without closing, as on an error (1).
const BYE_CLEAN: u32 = 0;
const BYE_DROPPED: u32 = 1;

/// Timeouts of the rendezvous and of the group it leaves behind.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// How long rank 0 waits for every rank, and the others for rank 0's payload.
    pub timeout: Duration,
    /// Interval of heartbeats on every connection.
    pub heartbeat: Duration,
    /// A peer silent for this long (no heartbeat: frozen, or the network is gone) counts as failed.
    pub peer_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            heartbeat: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(30),
        }
    }
}

/// A failed rendezvous or group operation; the message is one line naming the address and/or rank(s).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RendezvousError {
    #[error("rendezvous: rank 0 cannot listen on {addr}: {msg}")]
    Bind { addr: String, msg: String },
    #[error("rendezvous at {addr}: timed out after {secs:.1}s waiting for rank(s) {missing} of world size {world}")]
    MissingRanks { addr: String, secs: f64, missing: String, world: usize },
    #[error("rendezvous: rank {rank} cannot reach rank 0 at {addr} within {secs:.1}s (last error: {msg})")]
    Unreachable { addr: String, rank: usize, secs: f64, msg: String },
    #[error("rendezvous at {addr}: rank {rank} rejected: {msg}")]
    Rejected { addr: String, rank: usize, msg: String },
    #[error("rendezvous: {addr} is not a trainer rendezvous ({msg})")]
    Protocol { addr: String, msg: String },
    #[error("rendezvous: rank 0 at {addr} {msg}")]
    Lost { addr: String, msg: String },
    #[error("rank {rank} failed: {msg}")]
    RankFailed { rank: usize, msg: String },
    #[error("barrier: timed out after {secs:.1}s waiting for rank(s) {missing}")]
    BarrierTimeout { secs: f64, missing: String },
}

type Result<T> = std::result::Result<T, RendezvousError>;

/// Ranks as a short list: `1, 3-5, 9`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j == i { ranks[i].to_string() } else { format!("{}-{}", ranks[i], ranks[j]) });
        i = j + 1;
    }
    out.join(", ")
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// A socket timeout of at least 1 ms (zero means "no timeout" to the OS).
fn at_least_1ms(d: Duration) -> Option<Duration> {
    Some(d.max(Duration::from_millis(1)))
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

struct Hello {
    version: u32,
    rank: u32,
    world: u32,
}

fn write_hello(s: &mut TcpStream, rank: usize, world: usize) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&MAGIC);
    for v in [VERSION, rank as u32, world as u32] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&b)
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<Option<Hello>> {
    let mut b = [0u8; 16];
    s.read_exact(&mut b)?;
    if b[..4] != MAGIC {
        return Ok(None);
    }
    let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    Ok(Some(Hello { version: u(4), rank: u(8), world: u(12) }))
}

fn write_reply(s: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(9 + body.len());
    b.extend_from_slice(&MAGIC);
    b.push(status);
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    s.write_all(&b)
}

fn write_frame(s: &mut TcpStream, kind: u8, arg: u32, body: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(9 + body.len());
    b.push(kind);
    b.extend_from_slice(&arg.to_le_bytes());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    s.write_all(&b)
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, u32, Vec<u8>)> {
    let mut h = [0u8; 9];
    s.read_exact(&mut h)?;
    let arg = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
    let len = u32::from_le_bytes([h[5], h[6], h[7], h[8]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok((h[0], arg, body))
}

/// Rank 0's listening socket, bound before the other ranks start so that tests can use port 0.
pub struct Server {
    listener: TcpListener,
    addr: String,
}

impl Server {
    /// Listens on `addr` (`0.0.0.0:29500`; port 0 picks a free one).
    pub fn bind(addr: &str) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| RendezvousError::Bind { addr: addr.to_string(), msg: e.to_string() })?;
        // The address actually bound (port 0 resolved), for messages.
        let addr = listener.local_addr().map_or_else(|_| addr.to_string(), |a| a.to_string());
        Ok(Self { listener, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Waits for ranks 1..world, checks each arrives once with the same world size and protocol version, sends
    /// them `payload`, and returns the group. On a timeout the error names the ranks that never arrived.
    pub fn serve(self, world: usize, payload: &[u8], opts: &Options) -> Result<Group> {
        let t0 = Instant::now();
        let deadline = t0 + opts.timeout;
        let addr = self.addr.clone();
        let io = |e: std::io::Error| RendezvousError::Bind { addr: addr.clone(), msg: e.to_string() };
        self.listener.set_nonblocking(true).map_err(io)?;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut arrived = 1;
        while arrived < world {
            let (mut s, _) = match self.listener.accept() {
                Ok(c) => c,
                // WouldBlock: nobody yet; anything else (a connection reset before accept): keep waiting.
                Err(_) => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
                        return Err(RendezvousError::MissingRanks {
                            addr: addr.clone(),
                            secs: t0.elapsed().as_secs_f64(),
                            missing: rank_list(&missing),
                            world,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
            };
            let hello = s
                .set_nonblocking(false)
                .and_then(|_| s.set_read_timeout(at_least_1ms(HELLO_TIMEOUT.min(remaining(deadline)))))
                .and_then(|_| s.set_nodelay(true))
                .and_then(|_| read_hello(&mut s));
            // Not a rank (no hello, wrong magic): drop it and keep waiting.
            let Ok(Some(h)) = hello else { continue };
            let rank = h.rank as usize;
            let reject = if h.version != VERSION {
                Some(format!("protocol version {}, rank 0 speaks {VERSION} (mixed trainer builds?)", h.version))
            } else if h.world as usize != world {
                Some(format!("world size {}, rank 0 has {world}", h.world))
            } else if rank == 0 || rank >= world {
                Some(format!("rank {rank} is not in 1..{world} (rank 0 is this server)"))
            } else if peers[rank].is_some() {
                Some(format!("rank {rank} connected twice (two processes with the same RANK?)"))
            } else {
                None
            };
            if let Some(msg) = reject {
                let _ = write_reply(&mut s, 1, msg.as_bytes());
                let note = format!("rank {rank} was rejected: {msg}");
                for p in peers.iter_mut().flatten() {
                    let _ = write_reply(p, 2, note.as_bytes());
                }
                return Err(RendezvousError::Rejected { addr: addr.clone(), rank, msg });
            }
            peers[rank] = Some(s);
            arrived += 1;
        }
        for (rank, p) in peers.iter_mut().enumerate() {
            if let Some(s) = p {
                s.set_write_timeout(at_least_1ms(opts.peer_timeout))
                    .and_then(|_| write_reply(s, 0, payload))
                    .map_err(|e| RendezvousError::RankFailed { rank, msg: format!("cannot send it the id: {e}") })?;
            }
        }
        let links: Vec<(usize, TcpStream)> =
            peers.into_iter().enumerate().filter_map(|(r, s)| s.map(|s| (r, s))).collect();
        Group::start(0, world, links, opts)
    }
}

/// Rank `rank` (not 0) joins rank 0 at `addr`, retrying the connection until the timeout, and gets the payload.
pub fn join(addr: &str, rank: usize, world: usize, opts: &Options) -> Result<(Vec<u8>, Group)> {
    let t0 = Instant::now();
    let deadline = t0 + opts.timeout;
    let mut last = String::from("no attempt");
    let mut stream = 'connect: loop {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    let wait = remaining(deadline).min(Duration::from_secs(2));
                    match TcpStream::connect_timeout(&a, wait.max(Duration::from_millis(1))) {
                        Ok(s) => break 'connect s,
                        Err(e) => last = e.to_string(),
                    }
                }
            }
            Err(e) => last = format!("cannot resolve: {e}"),
        }
        if Instant::now() >= deadline {
            return Err(RendezvousError::Unreachable {
                addr: addr.into(),
                rank,
                secs: t0.elapsed().as_secs_f64(),
                msg: last,
            });
        }
        std::thread::sleep(Duration::from_millis(50).min(remaining(deadline)));
    };
    let lost = |msg: String| RendezvousError::Lost { addr: addr.to_string(), msg };
    let io_lost = |e: std::io::Error| {
        if is_timeout(&e) {
            lost(format!(
                "sent no id within {:.1}s of rank {rank} starting (rank 0 still waiting for other ranks?)",
                t0.elapsed().as_secs_f64()
            ))
        } else if e.kind() == ErrorKind::UnexpectedEof {
            lost("closed the connection before sending the id (rank 0 failed?)".into())
        } else {
            lost(format!("connection failed: {e}"))
        }
    };
    stream
        .set_nodelay(true)
        .and_then(|_| stream.set_write_timeout(at_least_1ms(remaining(deadline))))
        .and_then(|_| write_hello(&mut stream, rank, world))
        .and_then(|_| stream.set_read_timeout(at_least_1ms(remaining(deadline))))
        .map_err(io_lost)?;
    let mut head = [0u8; 9];
    stream.read_exact(&mut head).map_err(io_lost)?;
    if head[..4] != MAGIC {
        return Err(RendezvousError::Protocol { addr: addr.into(), msg: "unexpected reply to the hello".into() });
    }
    let len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(RendezvousError::Protocol { addr: addr.into(), msg: format!("reply of {len} bytes") });
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).map_err(io_lost)?;
    match head[4] {
        0 => {}
        1 => {
            let msg = String::from_utf8_lossy(&body).into_owned();
            return Err(RendezvousError::Rejected { addr: addr.into(), rank, msg });
        }
        _ => return Err(lost(format!("aborted the rendezvous: {}", String::from_utf8_lossy(&body)))),
    }
    let group = Group::start(rank, world, vec![(0, stream)], opts)?;
    Ok((body, group))
}

/// The whole exchange for this process: rank 0 listens on MASTER_PORT (all interfaces) and sends `make_payload()`;
/// the others connect to MASTER_ADDR:MASTER_PORT. World size 1 returns the payload and an empty group at once.
pub fn rendezvous(env: &DistEnv, make_payload: impl FnOnce() -> Vec<u8>, opts: &Options) -> Result<(Vec<u8>, Group)> {
    if env.rank == 0 {
        let payload = make_payload();
        if env.world_size == 1 {
            return Ok((payload, Group::start(0, 1, Vec::new(), opts)?));
        }
        // Listen on the family MASTER_ADDR resolves to (the other ranks connect there).
        let v6 = env.master_endpoint().to_socket_addrs().ok().and_then(|mut a| a.next()).is_some_and(|a| a.is_ipv6());
        let bind = if v6 { format!("[::]:{}", env.master_port) } else { format!("0.0.0.0:{}", env.master_port) };
        let server = Server::bind(&bind).map_err(|e| match e {
            RendezvousError::Bind { msg, .. } => {
                RendezvousError::Bind { addr: format!("{bind} (MASTER_PORT={})", env.master_port), msg }
            }
            e => e,
        })?;
        let group = Server { addr: env.master_endpoint(), ..server }.serve(env.world_size, &payload, opts)?;
        Ok((payload, group))
    } else {
        join(&env.master_endpoint(), env.rank, env.world_size, opts)
    }
}

#[derive(Default)]
struct State {
    /// The first failure seen: (rank, what happened).
    failure: Option<(usize, String)>,
    /// Rank 0: the last barrier number each rank reached. Other ranks: index 0 holds the last released barrier.
    reached: Vec<u32>,
    /// Ranks that said goodbye (their connection closing is not a failure).
    left: Vec<bool>,
    closing: bool,
    /// Each peer's progress (how many collectives it has arrived at, from its heartbeats) and since when it has
    /// been behind the furthest rank this one knows of (None: not behind).
    progress: Vec<u32>,
    behind_since: Vec<Option<Instant>>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    /// This rank's progress, sent with every heartbeat ([`Group::progress`]).
    mine: Arc<AtomicU64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

type Link = (usize, Arc<Mutex<TcpStream>>);

fn send(link: &Link, kind: u8, arg: u32, body: &[u8]) -> std::io::Result<()> {
    let mut s = link.1.lock().unwrap_or_else(|p| p.into_inner());
    write_frame(&mut s, kind, arg, body)
}

/// The ranks after a rendezvous: rank 0 holds a connection to every rank, the others one to rank 0. Background
/// threads send heartbeats and watch the connections; a rank whose connection drops or falls silent for
/// `peer_timeout` is reported (rank 0 forwards the report to everyone). Dropping the group says goodbye.
pub struct Group {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    links: Arc<Vec<Link>>,
    threads: Vec<JoinHandle<()>>,
    barriers: u32,
    closed: bool,
}

impl Group {
    fn start(rank: usize, world: usize, streams: Vec<(usize, TcpStream)>, opts: &Options) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                reached: vec![0; world],
                left: vec![false; world],
                progress: vec![0; world],
                behind_since: vec![None; world],
                ..Default::default()
            }),
            cv: Condvar::new(),
            mine: Arc::new(AtomicU64::new(0)),
        });
        let mut links = Vec::new();
        let mut readers = Vec::new();
        for (peer, s) in streams {
            let fail = |e: std::io::Error| RendezvousError::RankFailed { rank: peer, msg: format!("connection: {e}") };
            let r = s.try_clone().map_err(fail)?;
            r.set_read_timeout(at_least_1ms(opts.peer_timeout)).map_err(fail)?;
            s.set_write_timeout(at_least_1ms(opts.peer_timeout)).map_err(fail)?;
            links.push((peer, Arc::new(Mutex::new(s))));
            readers.push((peer, r));
        }
        let links = Arc::new(links);
        let mut threads = Vec::new();
        for (peer, r) in readers {
            let (shared, links) = (shared.clone(), links.clone());
            let secs = opts.peer_timeout.as_secs_f64();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("dist-watch-{peer}"))
                    .spawn(move || watch(rank, peer, r, &shared, &links, secs))
                    .map_err(|e| RendezvousError::RankFailed { rank, msg: format!("cannot start a thread: {e}") })?,
            );
        }
        if !links.is_empty() {
            let (shared, links, every) = (shared.clone(), links.clone(), opts.heartbeat);
            threads.push(
                std::thread::Builder::new()
                    .name("dist-heartbeat".into())
                    .spawn(move || {
                        let mut st = shared.lock();
                        while !st.closing {
                            drop(st);
                            let mine = shared.mine.load(Ordering::Relaxed) as u32;
                            for l in links.iter() {
                                // A dead peer is reported by its watch thread.
                                let _ = send(l, HEARTBEAT, mine, &[]);
                            }
                            st = shared.lock();
                            if st.closing {
                                break;
                            }
                            st = shared.cv.wait_timeout(st, every).unwrap_or_else(|p| p.into_inner()).0;
                        }
                    })
                    .map_err(|e| RendezvousError::RankFailed { rank, msg: format!("cannot start a thread: {e}") })?,
            );
        }
        Ok(Self { rank, world, shared, links, threads, barriers: 0, closed: false })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The first rank failure seen so far, if any.
    pub fn failure(&self) -> Option<RendezvousError> {
        self.shared.lock().failure.clone().map(|(rank, msg)| RendezvousError::RankFailed { rank, msg })
    }

    /// Waits up to `timeout` for a rank failure: `Some` as soon as one is seen, `None` if all stayed healthy.
    pub fn wait_failure(&self, timeout: Duration) -> Option<RendezvousError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while st.failure.is_none() && Instant::now() < deadline {
            st = self.shared.cv.wait_timeout(st, remaining(deadline)).unwrap_or_else(|p| p.into_inner()).0;
        }
        st.failure.clone().map(|(rank, msg)| RendezvousError::RankFailed { rank, msg })
    }

    /// This rank's progress counter: the training loop adds 1 each time it arrives at a collective, and the
    /// heartbeats carry it to the peers (see [`Group::on_failure`]'s `stall`).
    pub fn progress(&self) -> Arc<AtomicU64> {
        self.shared.mine.clone()
    }

    /// Runs `f` on a background thread as soon as a rank failure is seen (never, if the group closes first).
    /// The training loop uses it to exit while its own thread may be blocked inside a collective that the failed
    /// rank will never join. With `stall`, a peer whose progress ([`Group::progress`]) stays behind the furthest
    /// rank's for that long counts as failed too (hung): rank 0 watches every rank, the others rank 0.
    pub fn on_failure(
        &mut self,
        stall: Option<Duration>,
        f: impl FnOnce(RendezvousError) + Send + 'static,
    ) -> Result<()> {
        let (shared, links, me) = (self.shared.clone(), self.links.clone(), self.rank);
        let tick = stall.map(|s| (s / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)));
        let t = std::thread::Builder::new()
            .name("dist-watchdog".into())
            .spawn(move || {
                let mut st = shared.lock();
                while st.failure.is_none() && !st.closing {
                    st = match tick {
                        Some(t) => shared.cv.wait_timeout(st, t).unwrap_or_else(|p| p.into_inner()).0,
                        None => shared.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
                    };
                    if let (Some(stall), None, false) = (stall, &st.failure, st.closing) {
                        let mine = shared.mine.load(Ordering::Relaxed) as u32;
                        if let Some(failure) = stalled(me, &mut st, mine, stall) {
                            report(me, &mut st, failure, &links);
                            shared.cv.notify_all();
                        }
                    }
                }
                let failure = if st.closing { None } else { st.failure.clone() };
                drop(st);
                if let Some((rank, msg)) = failure {
                    f(RendezvousError::RankFailed { rank, msg });
                }
            })
            .map_err(|e| RendezvousError::RankFailed { rank: self.rank, msg: format!("cannot start a thread: {e}") })?;
        self.threads.push(t);
        Ok(())
    }

    /// Returns when every rank has called `barrier` as often as this one; fails naming a failed rank, or on a
    /// timeout naming the ranks that did not arrive.
    pub fn barrier(&mut self, timeout: Duration) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.barriers += 1;
        let seq = self.barriers;
        let deadline = Instant::now() + timeout;
        if self.rank != 0 {
            send(&self.links[0], BARRIER, seq, &[])
                .map_err(|e| RendezvousError::RankFailed { rank: 0, msg: format!("connection: {e}") })?;
        }
        let mut st = self.shared.lock();
        loop {
            if let Some((rank, msg)) = st.failure.clone() {
                return Err(RendezvousError::RankFailed { rank, msg });
            }
            let missing: Vec<usize> = if self.rank == 0 {
                (1..self.world).filter(|&r| st.reached[r] < seq).collect()
            } else if st.reached[0] < seq {
                vec![0]
            } else {
                vec![]
            };
            if missing.is_empty() {
                break;
            }
            if let Some(&r) = missing.iter().find(|&&r| st.left[r]) {
                return Err(RendezvousError::RankFailed { rank: r, msg: "left the group before the barrier".into() });
            }
            if Instant::now() >= deadline {
                return Err(RendezvousError::BarrierTimeout {
                    secs: timeout.as_secs_f64(),
                    missing: rank_list(&missing),
                });
            }
            st = self.shared.cv.wait_timeout(st, remaining(deadline)).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(st);
        if self.rank == 0 {
            for l in self.links.iter() {
                send(l, RELEASE, seq, &[])
                    .map_err(|e| RendezvousError::RankFailed { rank: l.0, msg: format!("connection: {e}") })?;
            }
        }
        Ok(())
    }

    /// Says goodbye to the peers and joins the background threads. Dropping a group without closing it (on an
    /// error) tells the peers that this rank stopped, which they report as its failure.
    pub fn close(mut self) {
        self.shutdown(Some(BYE_CLEAN));
    }

    /// Drops the connections without a goodbye, as a crash would.
    #[cfg(test)]
    fn abort(mut self) {
        self.shutdown(None);
    }

    fn shutdown(&mut self, goodbye: Option<u32>) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.shared.lock().closing = true;
        self.shared.cv.notify_all();
        for l in self.links.iter() {
            if let Some(how) = goodbye {
                let _ = send(l, BYE, how, &[]);
            }
            let _ = l.1.lock().unwrap_or_else(|p| p.into_inner()).shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.shutdown(Some(BYE_DROPPED));
    }
}

/// Reads one peer's frames until it leaves, fails or the group closes.
fn watch(me: usize, peer: usize, mut s: TcpStream, shared: &Shared, links: &[Link], secs: f64) {
    loop {
        let frame = read_frame(&mut s);
        let mut st = shared.lock();
        if st.closing {
            return;
        }
        let failure = match frame {
            Ok((HEARTBEAT, progress, _)) => {
                st.progress[peer] = progress;
                continue;
            }
            Ok((BARRIER, seq, _)) if me == 0 => {
                st.reached[peer] = seq;
                shared.cv.notify_all();
                continue;
            }
            Ok((RELEASE, seq, _)) if me != 0 => {
                st.reached[0] = seq;
                shared.cv.notify_all();
                continue;
            }
            Ok((BYE, how, _)) => {
                st.left[peer] = true;
                shared.cv.notify_all();
                if how == BYE_CLEAN {
                    return;
                }
                (peer, "left the group without closing it (stopped on an error)".to_string())
            }
            Ok((FAILED, rank, body)) if me != 0 => {
                (rank as usize, format!("{} (seen by rank 0)", String::from_utf8_lossy(&body)))
            }
            Ok((kind, _, _)) => (peer, format!("sent an unexpected message (kind {kind})")),
            Err(e) if is_timeout(&e) => {
                (peer, format!("sent no heartbeat for {secs:.1}s (frozen, or the network to it is down)"))
            }
            Err(e) if e.kind() == ErrorKind::UnexpectedEof || e.kind() == ErrorKind::ConnectionReset => {
                (peer, "its connection closed (the process exited or crashed)".to_string())
            }
            Err(e) => (peer, format!("connection error: {e}")),
        };
        report(me, &mut st, failure, links);
        shared.cv.notify_all();
        return;
    }
}

/// Records the first failure; rank 0 tells every other rank who failed before its own code can learn of it (and,
/// say, exit): the notice must leave before this rank's goodbye.
fn report(me: usize, st: &mut State, failure: (usize, String), links: &[Link]) {
    if st.failure.is_some() {
        return;
    }
    if me == 0 {
        for l in links.iter().filter(|l| l.0 != failure.0) {
            let _ = send(l, FAILED, failure.0 as u32, failure.1.as_bytes());
        }
    }
    st.failure = Some(failure);
}

/// A peer this rank can see that has stayed behind the furthest known progress for longer than `stall`: it has
/// not arrived at a collective that the others have been waiting in.
fn stalled(me: usize, st: &mut State, mine: u32, stall: Duration) -> Option<(usize, String)> {
    let peers: Vec<usize> = if me == 0 { (1..st.progress.len()).collect() } else { vec![0] };
    let furthest = peers.iter().map(|&p| st.progress[p]).chain([mine]).max().unwrap_or(0);
    for &p in &peers {
        if st.left[p] || st.progress[p] >= furthest {
            st.behind_since[p] = None;
            continue;
        }
        let since = *st.behind_since[p].get_or_insert_with(Instant::now);
        if since.elapsed() > stall {
            return Some((
                p,
                format!(
                    "made no progress for {:.1}s: it has not arrived at collective #{}, where the other rank(s) \
                     have been waiting (hung; train.stall_timeout_s)",
                    stall.as_secs_f64(),
                    st.progress[p] + 1
                ),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast(timeout_ms: u64) -> Options {
        Options {
            timeout: Duration::from_millis(timeout_ms),
            heartbeat: Duration::from_millis(50),
            peer_timeout: Duration::from_millis(3000),
        }
    }

    fn payload() -> Vec<u8> {
        (0..NCCL_UNIQUE_ID_BYTES).map(|i| (i * 7 + 3) as u8).collect()
    }

    /// Starts rank 0 on a free port; returns its address and the thread serving `world` ranks.
    fn server(world: usize, opts: Options) -> (String, JoinHandle<Result<Group>>) {
        let s = Server::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().to_string();
        (addr, std::thread::spawn(move || s.serve(world, &payload(), &opts)))
    }

    type Joining = JoinHandle<Result<(Vec<u8>, Group)>>;

    fn joiners(addr: &str, ranks: &[usize], world: usize, opts: Options) -> Vec<Joining> {
        ranks
            .iter()
            .map(|&r| {
                let addr = addr.to_string();
                std::thread::spawn(move || join(&addr, r, world, &opts))
            })
            .collect()
    }

    #[test]
    fn every_rank_gets_the_payload_and_passes_barriers() {
        let opts = fast(10_000);
        let (addr, root) = server(4, opts);
        let leaves = joiners(&addr, &[3, 1, 2], 4, opts);
        let mut root = root.join().unwrap().unwrap();
        let mut groups: Vec<Group> = leaves
            .into_iter()
            .map(|h| {
                let (p, g) = h.join().unwrap().unwrap();
                assert_eq!(p, payload());
                g
            })
            .collect();
        // Two barriers, every rank on its own thread.
        for _ in 0..2 {
            let hs: Vec<_> = groups
                .drain(..)
                .map(|mut g| {
                    std::thread::spawn(move || {
                        g.barrier(Duration::from_secs(10)).unwrap();
                        g
                    })
                })
                .collect();
            root.barrier(Duration::from_secs(10)).unwrap();
            groups = hs.into_iter().map(|h| h.join().unwrap()).collect();
        }
        assert!(root.failure().is_none());
        assert!(groups.iter().all(|g| g.failure().is_none()));
        for g in groups {
            g.close();
        }
        root.close();
    }

    #[test]
    fn the_failure_callback_runs_on_a_crash_and_not_on_a_clean_close() {
        let (addr, root) = server(3, fast(10_000));
        let mut leaves = joiners(&addr, &[1, 2], 3, fast(10_000));
        let mut root = root.join().unwrap().unwrap();
        let (_, g2) = leaves.pop().unwrap().join().unwrap().unwrap();
        let (_, mut g1) = leaves.pop().unwrap().join().unwrap().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx0 = tx.clone();
        root.on_failure(None, move |e| tx0.send((0, e.to_string())).unwrap()).unwrap();
        g1.on_failure(None, move |e| tx.send((1, e.to_string())).unwrap()).unwrap();
        g2.abort();
        let mut got: Vec<(usize, String)> = (0..2).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        got.sort();
        assert_eq!(got[0].0, 0);
        assert_eq!(got[1].0, 1);
        assert!(got.iter().all(|(_, e)| e.starts_with("rank 2 ")), "{got:?}");
        // A group that closes cleanly never calls back.
        let (addr, root) = server(2, fast(10_000));
        let leaf = joiners(&addr, &[1], 2, fast(10_000)).pop().unwrap();
        let mut root = root.join().unwrap().unwrap();
        let (_, g1) = leaf.join().unwrap().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        root.on_failure(None, move |e| tx.send(e.to_string()).unwrap()).unwrap();
        root.close();
        g1.close();
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    }

    #[test]
    fn a_rank_that_stops_arriving_is_named_as_hung() {
        let (addr, root) = server(3, fast(10_000));
        let mut leaves = joiners(&addr, &[1, 2], 3, fast(10_000));
        let mut root = root.join().unwrap().unwrap();
        let (_, mut g2) = leaves.pop().unwrap().join().unwrap().unwrap();
        let (_, g1) = leaves.pop().unwrap().join().unwrap().unwrap();
        let stall = Some(Duration::from_millis(400));
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        root.on_failure(stall, move |e| tx.send((0, e.to_string())).unwrap()).unwrap();
        g2.on_failure(stall, move |e| tx2.send((2, e.to_string())).unwrap()).unwrap();
        // All at the same progress for longer than the stall limit: nobody is behind, nothing happens (the
        // others waiting on rank 0's validation looks the same until one of them arrives first).
        std::thread::sleep(Duration::from_millis(700));
        assert!(rx.try_recv().is_err());
        // Ranks 0 and 2 arrive at the next collective; rank 1 never does.
        root.progress().fetch_add(1, Ordering::Relaxed);
        g2.progress().fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let mut got: Vec<(usize, String)> = (0..2).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        got.sort();
        assert!(t0.elapsed() >= Duration::from_millis(400), "{:?}", t0.elapsed());
        assert_eq!((got[0].0, got[1].0), (0, 2));
        for (_, e) in &got {
            assert!(
                e.starts_with("rank 1 failed: made no progress for 0.4s: it has not arrived at collective #1,"),
                "{e}"
            );
        }
        drop(g1);
    }

    #[test]
    fn rank_0_times_out_naming_the_missing_ranks() {
        let t0 = Instant::now();
        let (addr, root) = server(4, fast(1500));
        let leaves = joiners(&addr, &[2], 4, fast(5000));
        let e = root.join().unwrap().err().unwrap().to_string();
        assert!(e.starts_with(&format!("rendezvous at {addr}: timed out after")), "{e}");
        assert!(e.ends_with("waiting for rank(s) 1, 3 of world size 4"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(6));
        // Rank 2 learns that rank 0 is gone.
        let e = leaves.into_iter().next().unwrap().join().unwrap().err().unwrap().to_string();
        assert!(e.starts_with(&format!("rendezvous: rank 0 at {addr} closed the connection")), "{e}");
    }

    #[test]
    fn wrong_port_times_out_naming_the_address() {
        // A port that was free a moment ago: nothing listens there.
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let t0 = Instant::now();
        let e = join(&addr, 1, 2, &fast(300)).err().unwrap().to_string();
        assert!(e.starts_with(&format!("rendezvous: rank 1 cannot reach rank 0 at {addr} within")), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(300) && t0.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn a_foreign_server_is_named() {
        // Something that answers, but not a rendezvous.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            let mut b = [0u8; 16];
            let _ = s.read_exact(&mut b);
        });
        let e = join(&addr, 1, 2, &fast(2000)).err().unwrap().to_string();
        assert_eq!(e, format!("rendezvous: {addr} is not a trainer rendezvous (unexpected reply to the hello)"));
        h.join().unwrap();
        // And a silent one: the rank times out waiting for the id.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let e = join(&addr, 1, 2, &fast(300)).err().unwrap().to_string();
        assert!(e.starts_with(&format!("rendezvous: rank 0 at {addr} sent no id within")), "{e}");
    }

    #[test]
    fn mismatched_world_sizes_and_duplicate_ranks_are_rejected() {
        let (addr, root) = server(3, fast(5000));
        let good = joiners(&addr, &[2], 3, fast(5000)).pop().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let bad = joiners(&addr, &[1], 2, fast(5000)).pop().unwrap().join().unwrap();
        let e = root.join().unwrap().err().unwrap().to_string();
        assert_eq!(e, format!("rendezvous at {addr}: rank 1 rejected: world size 2, rank 0 has 3"));
        assert_eq!(bad.err().unwrap().to_string(), e);
        let e = good.join().unwrap().err().unwrap().to_string();
        assert!(
            e.starts_with(&format!("rendezvous: rank 0 at {addr} aborted the rendezvous: rank 1 was rejected")),
            "{e}"
        );

        let (addr, root) = server(3, fast(5000));
        let first = joiners(&addr, &[1], 3, fast(5000)).pop().unwrap();
        // Let the first rank 1 arrive before the second.
        std::thread::sleep(Duration::from_millis(200));
        let second = joiners(&addr, &[1], 3, fast(5000)).pop().unwrap();
        let e = root.join().unwrap().err().unwrap().to_string();
        assert_eq!(
            e,
            format!(
                "rendezvous at {addr}: rank 1 rejected: rank 1 connected twice (two processes with the same RANK?)"
            )
        );
        assert!(second.join().unwrap().err().unwrap().to_string().contains("connected twice"));
        // Whichever came first learns that the rendezvous was aborted.
        assert!(first.join().unwrap().err().unwrap().to_string().contains("connected twice"));
    }

    #[test]
    fn a_crashed_rank_is_named_to_everyone() {
        let opts = fast(10_000);
        let (addr, root) = server(3, opts);
        let mut leaves: Vec<_> =
            joiners(&addr, &[1, 2], 3, opts).into_iter().map(|h| h.join().unwrap().unwrap().1).collect();
        let root = root.join().unwrap().unwrap();
        let t0 = Instant::now();
        leaves.pop().unwrap().abort(); // rank 2 dies without a goodbye
        let e = root.wait_failure(Duration::from_secs(10)).unwrap().to_string();
        assert_eq!(e, "rank 2 failed: its connection closed (the process exited or crashed)");
        let e = leaves[0].wait_failure(Duration::from_secs(10)).unwrap().to_string();
        assert_eq!(e, "rank 2 failed: its connection closed (the process exited or crashed) (seen by rank 0)");
        assert!(t0.elapsed() < Duration::from_secs(5));
        // A barrier now fails at once, naming rank 2.
        let mut g = leaves.pop().unwrap();
        assert!(g.barrier(Duration::from_secs(10)).unwrap_err().to_string().starts_with("rank 2 failed"));
        g.close();
        root.close();
    }

    #[test]
    fn rank_0_crashing_is_seen_by_the_others() {
        let opts = fast(10_000);
        let (addr, root) = server(2, opts);
        let leaf = joiners(&addr, &[1], 2, opts).pop().unwrap().join().unwrap().unwrap().1;
        root.join().unwrap().unwrap().abort();
        let e = leaf.wait_failure(Duration::from_secs(10)).unwrap().to_string();
        assert_eq!(e, "rank 0 failed: its connection closed (the process exited or crashed)");
    }

    #[test]
    fn a_silent_rank_is_reported_after_the_peer_timeout() {
        // Rank 1 is a bare socket: it says hello, then never sends a heartbeat (a frozen process).
        let opts = Options { peer_timeout: Duration::from_millis(300), ..fast(5000) };
        let (addr, root) = server(2, opts);
        let mut s = TcpStream::connect(&addr).unwrap();
        write_hello(&mut s, 1, 2).unwrap();
        let root = root.join().unwrap().unwrap();
        let t0 = Instant::now();
        let e = root.wait_failure(Duration::from_secs(10)).unwrap().to_string();
        assert_eq!(e, "rank 1 failed: sent no heartbeat for 0.3s (frozen, or the network to it is down)");
        assert!(t0.elapsed() < Duration::from_secs(3));
        root.close();
    }

    #[test]
    fn barrier_timeout_names_the_late_rank_and_clean_exit_is_not_a_failure() {
        let opts = fast(10_000);
        let (addr, root) = server(3, opts);
        let leaves: Vec<_> =
            joiners(&addr, &[1, 2], 3, opts).into_iter().map(|h| h.join().unwrap().unwrap().1).collect();
        let mut root = root.join().unwrap().unwrap();
        let mut leaves = leaves.into_iter();
        let (mut one, two) = (leaves.next().unwrap(), leaves.next().unwrap());
        let h = std::thread::spawn(move || {
            let r = one.barrier(Duration::from_secs(10));
            (one, r)
        });
        let e = root.barrier(Duration::from_millis(300)).unwrap_err().to_string();
        assert_eq!(e, "barrier: timed out after 0.3s waiting for rank(s) 2");
        // Rank 2 leaves cleanly: not a failure, but the barrier now names it.
        two.close();
        std::thread::sleep(Duration::from_millis(100));
        assert!(root.failure().is_none());
        let e = root.barrier(Duration::from_secs(10)).unwrap_err().to_string();
        assert_eq!(e, "rank 2 failed: left the group before the barrier");
        // Rank 0 dropped without closing (as on an error): rank 1, waiting in its barrier, is told.
        drop(root);
        let (one, r) = h.join().unwrap();
        assert_eq!(
            r.unwrap_err().to_string(),
            "rank 0 failed: left the group without closing it (stopped on an error)"
        );
        one.close();
    }

    #[test]
    fn a_busy_port_is_named() {
        let busy = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = busy.local_addr().unwrap().port();
        let env =
            DistEnv { world_size: 2, master_addr: Some("127.0.0.1".into()), master_port: port, ..DistEnv::single() };
        let e = rendezvous(&env, payload, &fast(100)).err().unwrap().to_string();
        assert!(
            e.starts_with(&format!("rendezvous: rank 0 cannot listen on 0.0.0.0:{port} (MASTER_PORT={port}): ")),
            "{e}"
        );
    }

    #[test]
    fn single_process_needs_no_network() {
        let (p, mut g) = rendezvous(&DistEnv::single(), payload, &fast(100)).unwrap();
        assert_eq!(p, payload());
        g.barrier(Duration::from_millis(1)).unwrap();
        assert!(g.wait_failure(Duration::from_millis(1)).is_none());
    }

    #[test]
    fn rank_lists_are_compact() {
        assert_eq!(rank_list(&[1, 3, 4, 5, 9]), "1, 3-5, 9");
        assert_eq!(rank_list(&[]), "");
        assert_eq!(rank_list(&[0, 1]), "0-1");
    }
}
