//! One process per rank over TCP. Rank 0 listens; every other rank connects to it (a
//! star), retrying until the rendezvous timeout. Each connection starts with a handshake
//! (magic, version, world size, job id, rank, and the port where the rank listens for
//! direct connections) and then carries checksummed frames (see `wire.rs`). Rank 0 reads
//! each handshake on a thread of its own while it keeps accepting (`rendezvous.rs`), so
//! connections that never say anything cost the job at most one handshake timeout in all,
//! not one each. One reader thread per connection turns the stream into inbox events, so a
//! closed connection is noticed the moment it closes, whatever the rank is waiting for.
//! `exchange` dials peers directly (`peers.rs`).

use std::collections::HashMap;
use std::fmt;
use std::io::{self, ErrorKind};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::star::{Event, HUB, Link, Star};
use crate::wire::{self, Frame, ReadError, kind};
use crate::{CollectiveOptions, Error, Result};

mod peers;
mod rendezvous;

use peers::{PeerAccept, peer_listener, spawn_peer_acceptor};
use rendezvous::{hub_rendezvous, listen, read_hello, refuse};

/// Where this rank sits in a job: torchrun's environment, read by [`TcpConfig::from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_RANK` (0 when unset); informational, e.g. to pick a GPU.
    pub local_rank: usize,
    /// `MASTER_ADDR` (127.0.0.1 when unset): where the other ranks find rank 0.
    pub master_addr: String,
    /// `DCKPT_MASTER_PORT` (never `MASTER_PORT`: under torchrun, torch's store owns it).
    pub master_port: u16,
    /// `DCKPT_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else `"default"`. Connections from
    /// another job are refused at the handshake.
    pub job_id: String,
}

/// Bounds of a TCP world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpOptions {
    /// Per-call bounds.
    pub collective: CollectiveOptions,
    /// How long rank 0 waits for every rank to join, and the others retry connecting.
    pub rendezvous_timeout: Duration,
    /// The address the listeners bind (rank 0's, and each rank's for `exchange`); `None`
    /// binds the loopback where `MASTER_ADDR` is a loopback address (every rank on this
    /// host), else every interface (`0.0.0.0`). `DCKPT_TCP_LISTEN` sets it.
    pub listen_addr: Option<IpAddr>,
    /// How long rank 0 waits for a connection's handshake before dropping it (default 2 s).
    /// Handshakes are read concurrently, up to 256 at once, so silent or stray connections
    /// hold the rendezvous back by at most about this long in all (unless more than 256 of
    /// them are open at once).
    pub handshake_timeout: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            collective: CollectiveOptions::default(),
            rendezvous_timeout: Duration::from_secs(300),
            listen_addr: None,
            handshake_timeout: HANDSHAKE_TIMEOUT,
        }
    }
}

impl TcpOptions {
    /// Defaults, overridden by `DCKPT_COLLECTIVE_TIMEOUT_MS`, `DCKPT_RENDEZVOUS_TIMEOUT_MS`,
    /// `DCKPT_MESSAGE_BYTES_MAX` and `DCKPT_TCP_LISTEN` when set.
    pub fn from_env() -> Result<TcpOptions> {
        let mut o = TcpOptions::default();
        if let Some(ms) = env_parse::<u64>("DCKPT_COLLECTIVE_TIMEOUT_MS")? {
            o.collective.timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = env_parse::<u64>("DCKPT_RENDEZVOUS_TIMEOUT_MS")? {
            o.rendezvous_timeout = Duration::from_millis(ms);
        }
        if let Some(b) = env_parse::<u64>("DCKPT_MESSAGE_BYTES_MAX")? {
            o.collective.message_bytes_max = b;
        }
        o.listen_addr = env_parse::<IpAddr>("DCKPT_TCP_LISTEN")?;
        Ok(o)
    }
}

impl TcpConfig {
    /// Reads torchrun's environment (see the field docs for the variables).
    pub fn from_env() -> Result<TcpConfig> {
        let rank = env_parse::<usize>("RANK")?.ok_or(Error::Env { var: "RANK".into(), detail: "not set".into() })?;
        let world_size = env_parse::<usize>("WORLD_SIZE")?
            .ok_or(Error::Env { var: "WORLD_SIZE".into(), detail: "not set".into() })?;
        let local_rank = env_parse::<usize>("LOCAL_RANK")?.unwrap_or(0);
        let master_addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        // Never MASTER_PORT: under torchrun it is torch's store's, and rank 0 took it (or
        // failed to), while the others knocked on torch's store for minutes.
        let master_port = env_parse::<u16>("DCKPT_MASTER_PORT")?.ok_or(Error::Env {
            var: "DCKPT_MASTER_PORT".into(),
            detail: "not set: the port rank 0's dckpt listener takes, not MASTER_PORT (torch's store's under \
                     torchrun); `dckpt launch` sets it"
                .into(),
        })?;
        let job_id = std::env::var("DCKPT_JOB_ID")
            .or_else(|_| std::env::var("TORCHELASTIC_RUN_ID"))
            .unwrap_or_else(|_| "default".into());
        let cfg = TcpConfig { rank, world_size, local_rank, master_addr, master_port, job_id };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::invalid(format!("rank {} out of world of {}", self.rank, self.world_size)));
        }
        if self.job_id.len() > JOB_ID_BYTES_MAX {
            return Err(Error::invalid(format!("job id longer than {JOB_ID_BYTES_MAX} bytes")));
        }
        Ok(())
    }
}

/// One rank of a TCP world.
#[derive(Debug)]
pub struct TcpCollective {
    star: Star<TcpLink>,
}

impl TcpCollective {
    /// [`TcpConfig::from_env`] and [`TcpOptions::from_env`], then [`TcpCollective::connect`].
    pub fn from_env() -> Result<TcpCollective> {
        Self::connect(&TcpConfig::from_env()?, &TcpOptions::from_env()?)
    }

    /// Joins the world: rank 0 listens until every rank has joined, the others connect to
    /// it. Returns once this rank is part of the world (rank 0: once all are).
    pub fn connect(cfg: &TcpConfig, opts: &TcpOptions) -> Result<TcpCollective> {
        Self::connect_announcing(cfg, opts, |_| Ok(()))
    }

    /// [`TcpCollective::connect`] where rank 0 may listen on a port the system picks: with
    /// `master_port` 0 it binds an ephemeral port and calls `announce` with the port it got
    /// before waiting for the others, so the caller can publish it where they look (a
    /// job's key-value store); the others connect to the `master_port` they were given.
    /// `announce` is called on rank 0 of a world of more than one rank, and only there; its
    /// error ends the rendezvous.
    pub fn connect_announcing(
        cfg: &TcpConfig,
        opts: &TcpOptions,
        announce: impl FnOnce(u16) -> Result<()>,
    ) -> Result<TcpCollective> {
        cfg.validate()?;
        let opts = &TcpOptions { listen_addr: opts.listen_addr.or_else(|| loopback(&cfg.master_addr)), ..opts.clone() };
        let (tx, inbox) = sync_channel(INBOX_EVENTS_MAX);
        let deadline = crate::deadline_after(opts.rendezvous_timeout);
        let stop = Arc::new(AtomicBool::new(false));
        let frame_max = frame_bytes_max(cfg, opts);
        // Every rank but the hub (which already holds a connection to each) listens for the
        // direct connections of `exchange`, on a port the system picks; the hub learns it
        // from the hello and tells whoever asks.
        let peers = if cfg.rank == HUB { None } else { Some(peer_listener(opts)?) };
        if peers.is_some() {
            crate::fds::make_room_for_peers(cfg.world_size);
        }
        let peer_addr = match &peers {
            Some(l) => Some(l.local_addr().map_err(|e| Error::io("reading the peer listener's address", e))?),
            None => None,
        };
        let peer_port = peer_addr.map_or(0, |a| a.port());
        let hello = encode_hello(cfg, peer_port);
        let (streams, routes) = if cfg.world_size == 1 {
            (HashMap::new(), HashMap::new())
        } else if cfg.rank == HUB {
            let listener = listen(cfg, opts)?;
            let port = listener.local_addr().map_err(|e| Error::io("reading the listener's address", e))?.port();
            announce(port)?;
            let joined = hub_rendezvous(listener, cfg, opts, deadline, Arc::clone(&stop))?;
            let routes = joined.iter().map(|(&r, (_, addr))| (r, *addr)).collect();
            (joined.into_iter().map(|(r, (s, _))| (r, s)).collect(), routes)
        } else {
            (HashMap::from([(HUB, join(cfg, &hello, deadline)?)]), HashMap::new())
        };
        let incoming = Arc::new(Mutex::new(Vec::new()));
        if let Some(listener) = peers {
            let accept = PeerAccept {
                rank: cfg.rank,
                world_size: cfg.world_size,
                job_id: cfg.job_id.clone(),
                handshake_timeout: opts.handshake_timeout,
                write_timeout: opts.collective.timeout,
                frame_max,
                tx: tx.clone(),
                incoming: Arc::clone(&incoming),
                stop: Arc::clone(&stop),
            };
            spawn_peer_acceptor(listener, accept);
        }
        // Reader and writer share one descriptor (`&TcpStream` reads and writes): a clone
        // per peer would double what rank 0 holds.
        let streams: HashMap<usize, Arc<TcpStream>> = streams.into_iter().map(|(r, s)| (r, Arc::new(s))).collect();
        for (&peer, stream) in &streams {
            configure(stream, opts.collective.timeout)?;
            spawn_reader(peer, Arc::clone(stream), frame_max, tx.clone())?;
        }
        let link = TcpLink {
            rank: cfg.rank,
            world_size: cfg.world_size,
            streams,
            timeout: opts.collective.timeout,
            stop,
            last_header: None,
            hello,
            routes,
            peer_addr,
            incoming,
        };
        Ok(TcpCollective { star: Star::new(cfg.rank, cfg.world_size, opts.collective.clone(), link, inbox) })
    }
}

crate::star::collective_via_star!(TcpCollective);

const INBOX_EVENTS_MAX: usize = 4096;
const JOB_ID_BYTES_MAX: usize = 1024;
const HELLO_BYTES_MAX: u64 = 16 + JOB_ID_BYTES_MAX as u64;
/// The default [`TcpOptions::handshake_timeout`]; also how long a refusal may take to send.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Handshakes rank 0 reads at once, each on its own thread. More connections wait in the
/// listener's backlog until one finishes, so only more than this many silent connections at
/// once could delay the job by a second handshake timeout; a rank's handshake takes one
/// round trip, so a large world joining at once never comes near it.
const HANDSHAKES_IN_FLIGHT_MAX: usize = 256;
const CONNECT_RETRY: Duration = Duration::from_millis(50);
const READER_STACK_BYTES: usize = 256 << 10;
/// How long sending a verdict ([`kind::ABORT`]) to one peer may block.
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(200);

struct TcpLink {
    rank: usize,
    world_size: usize,
    streams: HashMap<usize, Arc<TcpStream>>,
    timeout: Duration,
    /// Stops rank 0's late-connection acceptor.
    stop: Arc<AtomicBool>,
    /// Header of the last frame sent, keyed by (kind, seq, payload address, length), with
    /// the payload itself: holding it keeps its address from being reused by another payload
    /// of the same length (an exchange's next message) while the key stands for it.
    last_header: Option<(FrameKey, [u8; wire::HEADER_BYTES], Bytes)>,
    /// This rank's hello, sent again to each peer it dials for an exchange.
    hello: Vec<u8>,
    /// Hub only: where each rank listens for direct connections.
    routes: HashMap<usize, SocketAddr>,
    /// This rank's listener for direct connections, woken on close.
    peer_addr: Option<SocketAddr>,
    /// Direct connections peers opened to this rank, closed with the link.
    incoming: Arc<Mutex<Vec<Arc<TcpStream>>>>,
}

/// (kind, seq, payload address, payload length): the same frame sent to several peers.
type FrameKey = (u8, u64, usize, usize);

impl fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpLink").field("rank", &self.rank).field("peers", &self.streams.len()).finish_non_exhaustive()
    }
}

impl Link for TcpLink {
    const ROUTED: bool = true;

    fn send(&mut self, to: usize, frame: &Frame, op: &'static str) -> Result<()> {
        let mut stream: &TcpStream =
            self.streams.get(&to).ok_or_else(|| Error::invalid(format!("no connection to rank {to}")))?;
        if frame.kind == kind::ABORT {
            // A verdict is the last thing sent on a poisoned link: a peer that does not
            // take it soon must not hold the rank that gives up past its own timeout.
            let _ = stream.set_write_timeout(Some(self.timeout.min(ABORT_WRITE_TIMEOUT)));
        }
        // The hub sends one frame to every peer: checksum it once.
        let key = (frame.kind, frame.seq, frame.payload.as_ptr() as usize, frame.payload.len());
        let header = match &self.last_header {
            Some((k, h, _)) if *k == key => *h,
            _ => {
                let h = wire::frame_header(frame.kind, frame.seq, &frame.payload);
                self.last_header = Some((key, h, frame.payload.clone()));
                h
            }
        };
        wire::write_with_header(&mut stream, &header, &frame.payload).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                Error::Timeout { rank: to, op: op.into(), timeout: self.timeout }
            }
            _ => Error::PeerDead { rank: to, op: op.into() },
        })
    }

    fn needs_route(&self, to: usize) -> bool {
        !self.streams.contains_key(&to)
    }

    fn route(&self, _asker: usize, to: usize) -> Option<Vec<u8>> {
        // Every rank reaches the hub over its star connection, so only other ranks are asked.
        Some(self.routes.get(&to)?.to_string().into_bytes())
    }

    fn connect(&mut self, to: usize, route: &[u8], deadline: Instant) -> Result<()> {
        let stream = peers::dial(to, route, &self.hello, self.timeout, deadline, self.world_size)?;
        // Only this rank writes on it; the peer's side has the reader.
        self.streams.insert(to, Arc::new(stream));
        Ok(())
    }

    fn close(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for stream in self.streams.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for stream in self.incoming.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        if let Some(mut addr) = self.peer_addr {
            if addr.ip().is_unspecified() {
                addr.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
            }
            // The acceptor sees `stop` once its accept returns.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        }
    }
}

/// The handshake a connecting rank sends.
#[derive(Debug, PartialEq, Eq)]
struct Hello {
    rank: usize,
    world_size: usize,
    /// Where the rank listens for direct connections (0: it does not).
    peer_port: u16,
    job_id: String,
}

fn encode_hello(cfg: &TcpConfig, peer_port: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + cfg.job_id.len());
    b.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    b.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
    b.extend_from_slice(&peer_port.to_le_bytes());
    b.extend_from_slice(&(cfg.job_id.len() as u16).to_le_bytes());
    b.extend_from_slice(cfg.job_id.as_bytes());
    b
}

fn decode_hello(b: &[u8]) -> Option<Hello> {
    let u32_at = |at: usize| b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize);
    let u16_at = |at: usize| b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]]));
    let len = u16_at(10)? as usize;
    let job = b.get(12..12 + len)?;
    if b.len() != 12 + len {
        return None;
    }
    Some(Hello {
        rank: u32_at(0)?,
        world_size: u32_at(4)?,
        peer_port: u16_at(8)?,
        job_id: String::from_utf8(job.to_vec()).ok()?,
    })
}

/// Connects to rank 0 and completes the handshake, retrying until `deadline` while rank 0
/// is not up yet.
fn join(cfg: &TcpConfig, hello: &[u8], deadline: Instant) -> Result<TcpStream> {
    let target = format!("{}:{}", cfg.master_addr, cfg.master_port);
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        match try_join(hello, &target, deadline) {
            Ok(stream) => return Ok(stream),
            Err(JoinError::Refused(reason)) => {
                return Err(Error::Handshake { rank: cfg.rank, detail: format!("rank 0 refused: {reason}") });
            }
            Err(JoinError::Retry(why)) => last = why,
        }
        thread::sleep(CONNECT_RETRY);
    }
    Err(Error::Handshake { rank: cfg.rank, detail: format!("could not join rank 0 at {target} in time: {last}") })
}

enum JoinError {
    Refused(String),
    Retry(String),
}

fn try_join(hello: &[u8], target: &str, deadline: Instant) -> Result<TcpStream, JoinError> {
    let retry = |e: io::Error| JoinError::Retry(e.to_string());
    let addr = target
        .to_socket_addrs()
        .map_err(retry)?
        .next()
        .ok_or(JoinError::Retry(format!("{target} resolves to nothing")))?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut stream = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))).map_err(retry)?;
    stream.set_read_timeout(Some(left)).map_err(retry)?;
    wire::write_frame(&mut stream, kind::HELLO, 0, hello).map_err(retry)?;
    let reply = wire::read_frame(&mut stream, HELLO_BYTES_MAX).map_err(|e| JoinError::Retry(describe(&e)))?;
    match reply.kind {
        kind::WELCOME => Ok(stream),
        kind::REJECT => Err(JoinError::Refused(String::from_utf8_lossy(&reply.payload).into_owned())),
        other => Err(JoinError::Refused(format!("unexpected reply kind {other}"))),
    }
}

fn configure(stream: &TcpStream, timeout: Duration) -> Result<()> {
    let set = |r: io::Result<()>| r.map_err(|e| Error::io("configuring a socket", e));
    set(stream.set_nonblocking(false))?;
    set(stream.set_nodelay(true))?;
    set(stream.set_read_timeout(None))?;
    // A peer that stops reading makes our send fail at the call timeout, not block forever.
    set(stream.set_write_timeout(Some(timeout.max(Duration::from_millis(1)))))
}

/// Largest frame a rank may receive: rank 0 gets one message per frame, the others get a
/// whole set (all-gather) at most.
fn frame_bytes_max(cfg: &TcpConfig, opts: &TcpOptions) -> u64 {
    let part = opts.collective.message_bytes_max.saturating_add(8);
    let world = cfg.world_size as u64;
    part.saturating_mul(world).saturating_add(64 << 10)
}

fn spawn_reader(peer: usize, stream: Arc<TcpStream>, frame_max: u64, tx: SyncSender<Event>) -> Result<()> {
    let body = move || {
        let mut s: &TcpStream = &stream;
        loop {
            let corrupt = match wire::read_frame(&mut s, frame_max) {
                Ok(frame) => {
                    if tx.send(Event::Frame { from: peer, frame }).is_err() {
                        return; // This rank's collective is gone.
                    }
                    continue;
                }
                Err(ReadError::Closed) | Err(ReadError::Io(_)) => None,
                Err(e) => Some(describe(&e)),
            };
            let _ = stream.shutdown(Shutdown::Both);
            let _ = tx.send(Event::Gone { from: peer, corrupt });
            return;
        }
    };
    thread::Builder::new()
        .name(format!("dckpt-reader-{peer}"))
        .stack_size(READER_STACK_BYTES)
        .spawn(body)
        .map(drop)
        .map_err(|e| Error::io("spawning a reader thread", e))
}

fn describe(e: &ReadError) -> String {
    match e {
        ReadError::Closed => "connection closed".into(),
        ReadError::Io(e) => e.to_string(),
        ReadError::Corrupt(d) => d.clone(),
        ReadError::TooLarge { len } => format!("frame of {len} bytes exceeds the limit"),
    }
}

/// Where the listeners bind when no address is given and rank 0 is this host's loopback:
/// every rank is on this host, and nothing need listen on the other interfaces.
fn loopback(master_addr: &str) -> Option<IpAddr> {
    let ip: Option<IpAddr> =
        if master_addr == "localhost" { Some(Ipv4Addr::LOCALHOST.into()) } else { master_addr.parse().ok() };
    ip.filter(IpAddr::is_loopback)
}

fn env_parse<T: std::str::FromStr>(var: &'static str) -> Result<Option<T>> {
    match std::env::var(var) {
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| Error::Env { var: var.into(), detail: format!("cannot parse {v:?}") }),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(Error::Env { var: var.into(), detail: e.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_rejects_truncation() {
        let cfg = TcpConfig {
            rank: 3,
            world_size: 8,
            local_rank: 3,
            master_addr: "x".into(),
            master_port: 1,
            job_id: "job-7".into(),
        };
        let b = encode_hello(&cfg, 4242);
        assert_eq!(decode_hello(&b), Some(Hello { rank: 3, world_size: 8, peer_port: 4242, job_id: "job-7".into() }));
        assert_eq!(decode_hello(&b[..b.len() - 1]), None);
        assert_eq!(decode_hello(b"garbage"), None);
    }

    /// A job whose rank 0 is this host's loopback listens there only; any other address
    /// (a node's, a name) keeps every interface, where the other nodes' ranks connect.
    #[test]
    fn a_loopback_master_keeps_the_listeners_on_the_loopback() {
        for (addr, want) in [("127.0.0.1", Some("127.0.0.1")), ("localhost", Some("127.0.0.1")), ("::1", Some("::1"))] {
            assert_eq!(loopback(addr), want.map(|w| w.parse().unwrap()), "{addr}");
        }
        for addr in ["10.1.2.3", "node-7", "0.0.0.0", ""] {
            assert_eq!(loopback(addr), None, "{addr}");
        }
    }
}
