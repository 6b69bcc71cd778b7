//! Rank 0's side of joining a job: its listener, the handshakes read concurrently, the
//! ranks admitted, and the refusals of whatever comes later.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;
use std::time::{Duration, Instant};

use super::{
    HANDSHAKE_TIMEOUT, HANDSHAKES_IN_FLIGHT_MAX, HELLO_BYTES_MAX, Hello, READER_STACK_BYTES, TcpConfig, TcpOptions,
    decode_hello, describe,
};
use crate::star::HUB;
use crate::wire::{self, kind};
use crate::{Error, Result};

/// Rank 0's listener on `master_port` (0: one the system picks).
pub(super) fn listen(cfg: &TcpConfig, opts: &TcpOptions) -> Result<TcpListener> {
    let ip = opts.listen_addr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let addr = SocketAddr::new(ip, cfg.master_port);
    crate::fds::fit_fd_limit(cfg.world_size, HANDSHAKES_IN_FLIGHT_MAX)?;
    let listener = TcpListener::bind(addr).map_err(|e| Error::io(format!("rank 0 listening on {addr}"), e))?;
    listener.set_nonblocking(true).map_err(|e| Error::io("configuring the listener", e))?;
    Ok(listener)
}

pub(super) fn hub_rendezvous(
    listener: TcpListener,
    cfg: &TcpConfig,
    opts: &TcpOptions,
    deadline: Instant,
    stop: Arc<AtomicBool>,
) -> Result<HashMap<usize, (TcpStream, SocketAddr)>> {
    let (done_tx, done_rx) = mpsc::channel();
    let mut in_flight = 0usize;
    let mut joined: HashMap<usize, (TcpStream, SocketAddr)> = HashMap::new();
    loop {
        // Finished handshakes first: a rank is in as soon as its hello is.
        while let Ok(h) = done_rx.try_recv() {
            in_flight -= 1;
            settle(h, &mut joined);
        }
        if joined.len() + 1 == cfg.world_size {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..cfg.world_size).filter(|r| !joined.contains_key(r)).collect();
            let detail = format!("ranks {missing:?} did not join within {:?}", opts.rendezvous_timeout);
            return Err(Error::Handshake { rank: HUB, detail });
        }
        if in_flight < HANDSHAKES_IN_FLIGHT_MAX {
            match listener.accept() {
                Ok((stream, peer)) => {
                    if spawn_handshake(cfg, opts.handshake_timeout, stream, peer, done_tx.clone()) {
                        in_flight += 1;
                    }
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accepting a connection", e)),
            }
        }
        // Nothing to accept, or enough handshakes under way: wait briefly for one to end.
        if let Ok(h) = done_rx.recv_timeout(Duration::from_millis(5)) {
            in_flight -= 1;
            settle(h, &mut joined);
        }
    }
    spawn_late_acceptor(listener, done_rx, cfg.job_id.clone(), stop);
    Ok(joined)
}

/// Admits a connection whose hello checked out (`Some`), unless its rank is already in.
fn settle(h: Option<Greeted>, joined: &mut HashMap<usize, (TcpStream, SocketAddr)>) {
    let Some(h) = h else { return };
    if joined.contains_key(&h.rank) {
        refuse(h.stream, h.peer, &format!("rank {} already joined", h.rank));
        return;
    }
    let mut s = &h.stream;
    match wire::write_frame(&mut s, kind::WELCOME, 0, &[]) {
        Ok(()) => {
            // Its direct connections go to the address it came from, at its peer port.
            joined.insert(h.rank, (h.stream, SocketAddr::new(h.peer.ip(), h.peer_port)));
        }
        // It went away after its hello; a rank that still runs connects again.
        Err(e) => log::warn!("collective: rank {} from {} left during its handshake: {e}", h.rank, h.peer),
    }
}

/// A connection whose hello checked out, from a handshake thread to the rendezvous.
struct Greeted {
    rank: usize,
    peer_port: u16,
    stream: TcpStream,
    peer: SocketAddr,
}

/// Reads the handshake of `stream` on a thread of its own, refusing it there when it does
/// not check out; sends `Some` with a good one, `None` once done otherwise. Returns whether
/// the thread started (if not, the connection is dropped, and a rank behind it retries).
fn spawn_handshake(
    cfg: &TcpConfig,
    timeout: Duration,
    stream: TcpStream,
    peer: SocketAddr,
    done: Sender<Option<Greeted>>,
) -> bool {
    let (job_id, world_size) = (cfg.job_id.clone(), cfg.world_size);
    let body = move || {
        let result = match read_hello(&stream, &job_id, world_size, HUB, timeout) {
            Ok(h) => Some(Greeted { rank: h.rank, peer_port: h.peer_port, stream, peer }),
            Err(reason) => {
                refuse(stream, peer, &reason);
                None
            }
        };
        // After the rendezvous the late acceptor takes over the channel; should it be gone
        // too, the connection closes with the thread.
        let _ = done.send(result);
    };
    match thread::Builder::new().name("dckpt-handshake".into()).stack_size(READER_STACK_BYTES).spawn(body) {
        Ok(_) => true,
        Err(e) => {
            log::warn!("collective: rank 0 dropped a connection from {peer}: no thread for its handshake: {e}");
            false
        }
    }
}

/// Reads and checks a handshake within `timeout`; `Ok` is the rank it claims, `Err` the
/// reason to refuse it. Whether that rank already joined is for the rendezvous to decide.
/// `me` is the listening rank, which no hello may claim to be.
pub(super) fn read_hello(
    stream: &TcpStream,
    job_id: &str,
    world_size: usize,
    me: usize,
    timeout: Duration,
) -> Result<Hello, String> {
    let mut s = stream;
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))).map_err(|e| e.to_string())?;
    // The welcome is sent from the rendezvous thread: never let it wait on a stuck peer.
    s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| e.to_string())?;
    let frame = wire::read_frame(&mut s, HELLO_BYTES_MAX).map_err(|e| format!("bad handshake: {}", describe(&e)))?;
    if frame.kind != kind::HELLO {
        return Err(format!("expected hello, got frame kind {}", frame.kind));
    }
    let hello = decode_hello(&frame.payload).ok_or("malformed hello")?;
    if hello.job_id != job_id {
        return Err(format!("job id {:?} is not this job's ({job_id:?})", hello.job_id));
    }
    if hello.world_size != world_size {
        return Err(format!("world size {} is not this job's ({world_size})", hello.world_size));
    }
    if hello.rank == me || hello.rank >= world_size {
        return Err(format!("rank {} out of range 0..{world_size} or this rank ({me})", hello.rank));
    }
    Ok(hello)
}

pub(super) fn refuse(stream: TcpStream, peer: SocketAddr, reason: &str) {
    log::warn!("collective: rank 0 refused a connection from {peer}: {reason}");
    let mut s = &stream;
    let _ = s.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = wire::write_frame(&mut s, kind::REJECT, 0, reason.as_bytes());
    let _ = stream.shutdown(Shutdown::Both);
}

/// After the rendezvous, keeps refusing newcomers (with a reason, so a late or duplicate
/// rank learns why) until the link closes, and the good hellos of handshakes that were
/// still under way (`pending`). Never touches the running job's connections.
fn spawn_late_acceptor(
    listener: TcpListener,
    pending: Receiver<Option<Greeted>>,
    job_id: String,
    stop: Arc<AtomicBool>,
) {
    // The thread ends (closing the port) when the link closes or the listener fails.
    let spawned =
        thread::Builder::new().name("dckpt-late-acceptor".into()).stack_size(READER_STACK_BYTES).spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for h in pending.try_iter().flatten() {
                    refuse(h.stream, h.peer, &format!("job {job_id:?} already running; rendezvous is over"));
                }
                match listener.accept() {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nonblocking(false);
                        let reason = format!("job {job_id:?} already running; rendezvous is over");
                        refuse(stream, peer, &reason);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                        thread::sleep(Duration::from_millis(50));
                    }
                    Err(_) => return,
                }
            }
        });
    // Without the thread the port simply stops answering, which disturbs no one.
    drop(spawned);
}
