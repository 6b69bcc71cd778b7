//! The direct connections of `exchange`: every rank but the hub listens on a port the
//! system picks, the hub tells a rank where a peer listens, and the rank dials it once and
//! keeps the connection for its sends to that peer.

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::{HELLO_BYTES_MAX, READER_STACK_BYTES, configure, describe, read_hello, refuse, spawn_reader};
use crate::star::{Event, HUB};
use crate::wire::{self, kind};
use crate::{Error, Result, TcpOptions};

/// Dials `to` at the address the hub's `route` gives, says hello and waits for the welcome,
/// by `deadline`: the connection this rank sends `to` its exchanges on. Out of descriptors,
/// the error names the limit (`world_size`: what it may need).
pub(super) fn dial(
    to: usize,
    route: &[u8],
    hello: &[u8],
    timeout: Duration,
    deadline: Instant,
    world_size: usize,
) -> Result<TcpStream> {
    let addr: SocketAddr = std::str::from_utf8(route)
        .ok()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| Error::Protocol { rank: HUB, detail: format!("malformed route to rank {to}") })?;
    let handshake =
        |detail: String| Error::Handshake { rank: to, detail: format!("direct connection to {addr}: {detail}") };
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut stream = TcpStream::connect_timeout(&addr, left).map_err(|e| match e.raw_os_error() {
        Some(libc::EMFILE) => handshake(crate::fds::out_of_fds(world_size)),
        _ => handshake(e.to_string()),
    })?;
    stream.set_read_timeout(Some(left)).map_err(|e| handshake(e.to_string()))?;
    wire::write_frame(&mut stream, kind::HELLO, 0, hello).map_err(|e| handshake(e.to_string()))?;
    let reply = wire::read_frame(&mut stream, HELLO_BYTES_MAX).map_err(|e| handshake(describe(&e)))?;
    match reply.kind {
        kind::WELCOME => {}
        kind::REJECT => return Err(handshake(format!("refused: {}", String::from_utf8_lossy(&reply.payload)))),
        other => return Err(handshake(format!("unexpected reply kind {other}"))),
    }
    configure(&stream, timeout)?;
    Ok(stream)
}

/// This rank's listener for the direct connections of `exchange`: the job's listen
/// address when one is set, every interface otherwise, on a port the system picks.
pub(super) fn peer_listener(opts: &TcpOptions) -> Result<TcpListener> {
    let ip = opts.listen_addr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let listener =
        TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| Error::io(format!("listening for peers on {ip}"), e))?;
    Ok(listener)
}

/// What the peer acceptor needs to admit a direct connection.
pub(super) struct PeerAccept {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) job_id: String,
    pub(super) handshake_timeout: Duration,
    pub(super) write_timeout: Duration,
    pub(super) frame_max: u64,
    pub(super) tx: SyncSender<Event>,
    pub(super) incoming: Arc<Mutex<Vec<Arc<TcpStream>>>>,
    pub(super) stop: Arc<AtomicBool>,
}

/// Admits direct connections until the link closes (which wakes its blocking accept by
/// connecting once more): each hello is read on a thread of its own (so a silent connection
/// holds up no other), checked like rank 0 checks them, and a good one gets a reader that
/// delivers its frames to this rank's inbox. Blocking, so an idle rank costs no wakeups.
pub(super) fn spawn_peer_acceptor(listener: TcpListener, accept: PeerAccept) {
    let accept = Arc::new(accept);
    let body = move || {
        loop {
            let accepted = listener.accept();
            if accept.stop.load(Ordering::Relaxed) {
                return;
            }
            match accepted {
                Ok((stream, peer)) => {
                    let a = Arc::clone(&accept);
                    let admit = move || a.admit(stream, peer);
                    let spawned = thread::Builder::new()
                        .name("dckpt-peer-handshake".into())
                        .stack_size(READER_STACK_BYTES)
                        .spawn(admit);
                    // Without a thread the connection closes, and its dialer fails naming this rank.
                    drop(spawned);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Out of descriptors or buffers for now, or a connection gone before it was
                // accepted: the listener stays, where every later dial to this rank failed
                // naming it for the rest of the job. A pause, so a lasting shortage does not
                // spin.
                Err(e) if transient(&e) => {
                    log::warn!("collective: rank {} could not accept a direct connection: {e}", accept.rank);
                    thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(_) => return,
            }
        }
    };
    let spawned = thread::Builder::new().name("dckpt-peer-acceptor".into()).stack_size(READER_STACK_BYTES).spawn(body);
    // Without it, direct connections to this rank fail at the dialer, naming this rank.
    drop(spawned);
}

/// An accept error that passes: ENFILE, EMFILE, ENOMEM, ENOBUFS, or a connection aborted or
/// broken before it was accepted.
fn transient(e: &std::io::Error) -> bool {
    const PASSING: [i32; 6] =
        [libc::ENFILE, libc::EMFILE, libc::ENOMEM, libc::ENOBUFS, libc::ECONNABORTED, libc::EPROTO];
    e.kind() == ErrorKind::ConnectionAborted || e.raw_os_error().is_some_and(|c| PASSING.contains(&c))
}

impl PeerAccept {
    fn admit(&self, stream: TcpStream, peer: SocketAddr) {
        let hello = match read_hello(&stream, &self.job_id, self.world_size, self.rank, self.handshake_timeout) {
            Ok(h) => h,
            Err(reason) => return refuse(stream, peer, &reason),
        };
        let mut s = &stream;
        if wire::write_frame(&mut s, kind::WELCOME, 0, &[]).is_err() || configure(&stream, self.write_timeout).is_err()
        {
            return;
        }
        let stream = Arc::new(stream);
        self.incoming.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::clone(&stream));
        if let Err(e) = spawn_reader(hello.rank, stream, self.frame_max, self.tx.clone()) {
            log::warn!("collective: rank {} dropped rank {}'s direct connection: {e}", self.rank, hello.rank);
        }
    }
}

#[cfg(test)]
mod tests {
    /// A shortage of descriptors or buffers passes, and the acceptor waits it out (it once
    /// ended at the first, and the rank took no direct connection for the rest of the job);
    /// a listener that is no more ends it.
    #[test]
    fn shortages_pass_and_a_dead_listener_does_not() {
        let os = std::io::Error::from_raw_os_error;
        for e in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ECONNABORTED] {
            assert!(super::transient(&os(e)), "{e}");
        }
        for e in [libc::EBADF, libc::EINVAL, libc::ENOTSOCK] {
            assert!(!super::transient(&os(e)), "{e}");
        }
    }
}
