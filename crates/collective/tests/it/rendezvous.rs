//! Rank 0's rendezvous against connections that never say anything: they are dropped after
//! the handshake timeout, concurrently, so the job forms as soon as its real ranks are in.

use std::io::Read;
use std::net::{Ipv4Addr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use dckpt_collective::{Collective, TcpCollective, TcpConfig, TcpOptions};

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a free port");
    l.local_addr().expect("its address").port()
}

fn options(handshake: Duration) -> TcpOptions {
    let mut o = TcpOptions {
        rendezvous_timeout: Duration::from_secs(60),
        listen_addr: Some(Ipv4Addr::LOCALHOST.into()),
        handshake_timeout: handshake,
        ..TcpOptions::default()
    };
    o.collective.timeout = Duration::from_secs(30);
    o
}

/// Joins as `rank` and passes a barrier with the others.
fn rank(port: u16, rank: usize, world: usize, handshake: Duration) -> thread::JoinHandle<Result<(), String>> {
    thread::spawn(move || {
        let cfg = TcpConfig {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            job_id: "silent-peers".into(),
        };
        let c = TcpCollective::connect(&cfg, &options(handshake)).map_err(|e| format!("rank {rank} joining: {e}"))?;
        c.barrier().map_err(|e| format!("rank {rank}: barrier: {e}"))
    })
}

#[test]
fn silent_connections_cost_the_rendezvous_one_handshake_timeout_at_most() {
    const SILENT: usize = 16;
    let world = 3;
    let handshake = Duration::from_secs(1);
    let port = free_port();
    let hub = rank(port, 0, world, handshake);
    // Silent connections first, so that they are ahead of the real ranks in the backlog.
    let start = Instant::now();
    let mut silent: Vec<TcpStream> = Vec::new();
    while silent.is_empty() {
        match TcpStream::connect((Ipv4Addr::LOCALHOST, port)) {
            Ok(s) => silent.push(s),
            Err(_) if start.elapsed() < Duration::from_secs(20) => thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    }
    let opened = Instant::now();
    while silent.len() < SILENT {
        silent.push(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect("connecting silently"));
    }
    let joining = Instant::now();
    let others: Vec<_> = (1..world).map(|r| rank(port, r, world, handshake)).collect();
    for (r, t) in std::iter::once(hub).chain(others).enumerate() {
        t.join().expect("no panic").unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let formed = joining.elapsed();
    // One after another they would take SILENT handshake timeouts; concurrently, the real
    // ranks need not wait for any of them.
    assert!(
        formed < handshake * 2,
        "the job formed {formed:?} after its ranks connected, behind {SILENT} silent peers"
    );
    // And each silent peer was let go (refused and closed) after about one timeout.
    for (i, mut s) in silent.into_iter().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut sink = Vec::new();
        let r = s.read_to_end(&mut sink);
        assert!(r.is_ok(), "silent connection {i} was never closed: {r:?}");
        assert!(!sink.is_empty(), "silent connection {i} was closed without a refusal");
    }
    let released = opened.elapsed();
    assert!(released < handshake * 3, "the silent peers were released after {released:?}");
}

/// Rank 0 on an ephemeral port, announced before it waits: the others learn the port only
/// from the announcement (as they would from a job's key-value store) and join.
#[test]
fn rank_zero_announces_the_ephemeral_port_it_listens_on() {
    let world = 3;
    let (tx, rx) = std::sync::mpsc::channel::<u16>();
    let cfg = move |rank, master_port| TcpConfig {
        rank,
        world_size: world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port,
        job_id: "ephemeral".into(),
    };
    let hub = thread::spawn(move || {
        let c = TcpCollective::connect_announcing(&cfg(0, 0), &options(Duration::from_secs(2)), |port| {
            // Once for the whole world, with the port really bound.
            for _ in 1..world {
                tx.send(port).expect("the others are listening for the port");
            }
            Ok(())
        })
        .map_err(|e| format!("rank 0: {e}"))?;
        c.all_gather(vec![0]).map_err(|e| format!("rank 0: {e}"))
    });
    let mut others = Vec::new();
    for r in 1..world {
        let port = rx.recv_timeout(Duration::from_secs(30)).expect("rank 0 announced its port");
        assert_ne!(port, 0);
        others.push(thread::spawn(move || {
            // A rank other than 0 never calls `announce`.
            let c = TcpCollective::connect_announcing(&cfg(r, port), &options(Duration::from_secs(2)), |_| {
                panic!("rank {r} was asked to announce")
            })
            .map_err(|e| format!("rank {r}: {e}"))?;
            c.all_gather(vec![r as u8]).map_err(|e| format!("rank {r}: {e}"))
        }));
    }
    let expected: Vec<Vec<u8>> = (0..world as u8).map(|r| vec![r]).collect();
    assert_eq!(hub.join().expect("rank 0 ran"), Ok(expected.clone()));
    for o in others {
        assert_eq!(o.join().expect("a rank ran"), Ok(expected.clone()));
    }
}

/// An announcement that fails ends rank 0's rendezvous with its error at once.
#[test]
fn a_failed_announcement_ends_the_rendezvous() {
    let cfg = TcpConfig {
        rank: 0,
        world_size: 2,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        job_id: "ephemeral-fail".into(),
    };
    let start = Instant::now();
    let err = TcpCollective::connect_announcing(&cfg, &options(Duration::from_secs(2)), |port| {
        Err(dckpt_collective::Error::InvalidArgument { detail: format!("the store refused port {port}") })
    })
    .expect_err("the announcement failed");
    assert!(err.to_string().contains("the store refused port"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "rank 0 waited for the others anyway");
}

/// Child side of `rank_zero_names_a_descriptor_limit_too_low_for_the_world`: runs only
/// when started by it, in a process whose descriptor limit that test lowered.
#[test]
fn fd_limit_child() {
    if std::env::var("DCKPT_TEST_FD_LIMIT_CHILD").is_err() {
        return;
    }
    let cfg = TcpConfig {
        rank: 0,
        world_size: 4096,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        job_id: "fd-limit".into(),
    };
    match TcpCollective::connect(&cfg, &options(Duration::from_secs(1))) {
        Ok(_) => println!("joined?"),
        Err(e) => println!("refused: {e}"),
    }
}

/// Rank 0 of a world larger than its hard descriptor limit allows fails before it listens,
/// naming the limit and the number needed, instead of failing to accept halfway through.
#[test]
fn rank_zero_names_a_descriptor_limit_too_low_for_the_world() {
    let exe = std::env::current_exe().expect("this test binary");
    let script = r#"ulimit -n 256 && exec "$0" --exact rendezvous::fd_limit_child --nocapture -q"#;
    let out = std::process::Command::new("sh")
        .args(["-c", script])
        .arg(&exe)
        .env("DCKPT_TEST_FD_LIMIT_CHILD", "1")
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.starts_with("refused: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("4096 ranks needs 4416 open files"), "{line}");
    assert!(line.contains("RLIMIT_NOFILE is 256 (hard limit 256)"), "{line}");
}

/// Child side of `every_rank_makes_room_for_two_connections_a_peer`: rank 1 of a world of
/// 1,000 tries to join a hub that is not there, then prints its soft descriptor limit.
#[test]
fn peer_fd_limit_child() {
    if std::env::var("DCKPT_TEST_PEER_FD_LIMIT_CHILD").is_err() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = TcpConfig {
        rank: 1,
        world_size: 1000,
        local_rank: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_id: "peer-fd-limit".into(),
    };
    let mut opts = options(Duration::from_millis(200));
    opts.rendezvous_timeout = Duration::from_millis(300);
    let _ = TcpCollective::connect(&cfg, &opts);
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    println!("soft: {}", line.split_whitespace().nth(3).unwrap());
}

/// A rank other than 0 may hold a direct connection to and from every peer (the fan-out of
/// a load among a large data-parallel group): it raises its soft descriptor limit to two a
/// peer where the hard limit allows, as rank 0 does for its one a peer. Only rank 0 did, and
/// at 1,024 a rank's dials failed once about 480 peers had connected to it.
#[test]
fn every_rank_makes_room_for_two_connections_a_peer() {
    let exe = std::env::current_exe().expect("this test binary");
    let script = r#"ulimit -S -n 256 && exec "$0" --exact rendezvous::peer_fd_limit_child --nocapture -q"#;
    let out = std::process::Command::new("sh")
        .args(["-c", script])
        .arg(&exe)
        .env("DCKPT_TEST_PEER_FD_LIMIT_CHILD", "1")
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let soft = stdout.lines().find_map(|l| l.strip_prefix("soft: ")).unwrap_or_else(|| panic!("{stdout}"));
    let hard = std::fs::read_to_string("/proc/self/limits").unwrap();
    let hard: u64 = hard
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .nth(4)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(soft.parse::<u64>().unwrap(), hard.min(2064), "{stdout}");
}
