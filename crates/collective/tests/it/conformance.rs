//! One conformance suite for every backend of `Collective`.
//!
//! A scenario is a function of one rank's collective; a "world maker" runs it on every rank:
//! threads of this process, or — for TCP — real processes: this very test binary,
//! re-executed with `DCKPT_TEST_CHILD` naming the scenario (see `child_entry`). Each rank
//! reports one line, and the parent checks every rank's outcome and timing.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::thread;
use std::time::{Duration, Instant};

use dckpt_collective::{
    Bytes, Collective, CollectiveExt, CollectiveOptions, Error, ReduceOp, TcpCollective, TcpConfig, TcpOptions,
    ThreadGroup, scatter_by_broadcast,
};

/// What a scenario returns on one rank: `Ok(detail)` when the rank saw what it should.
type Outcome = Result<String, String>;

/// How the victim of a loss scenario goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    /// Drops its handle in the middle of the others' call (threads).
    Drop,
    /// Panics while holding its handle (threads).
    Panic,
    /// Says READY and blocks; the parent kills the process (TCP).
    AwaitKill,
    /// Stays silent past the timeout, then drops.
    Silent,
}

impl Victim {
    fn parse(s: &str) -> Victim {
        match s {
            "drop" => Victim::Drop,
            "panic" => Victim::Panic,
            "kill" => Victim::AwaitKill,
            _ => Victim::Silent,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Victim::Drop => "drop",
            Victim::Panic => "panic",
            Victim::AwaitKill => "kill",
            Victim::Silent => "silent",
        }
    }
}

// ---------------------------------------------------------------- scenarios

/// Deterministic message of `len` bytes for (rank, call).
fn pattern(rank: usize, salt: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (rank * 31 + salt * 7 + i) as u8).collect()
}

/// Uneven sizes, with empty messages on every third rank.
fn uneven_len(rank: usize, salt: usize) -> usize {
    if rank % 3 == salt % 3 { 0 } else { (rank * 37 + salt * 11) % 300 + 1 }
}

fn expect_eq<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), String> {
    if got == want { Ok(()) } else { Err(format!("{what}: got {got:?}, want {want:?}")) }
}

fn err(what: &str) -> impl Fn(Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Every call with empty, non-empty and uneven messages, several roots.
fn all_calls(c: Box<dyn Collective>) -> Outcome {
    let (me, w) = (c.rank(), c.world_size());
    c.barrier().map_err(err("barrier"))?;
    let roots: Vec<usize> = [0, 1 % w, w - 1].into_iter().collect();
    for (salt, &root) in roots.iter().enumerate() {
        for len in [0, 1 + root * 5 + salt, 70_000] {
            let msg = pattern(root, salt, len);
            let got = c.broadcast(root, (me == root).then_some(&msg[..])).map_err(err("broadcast"))?;
            expect_eq(&format!("broadcast root {root} len {len}"), got, msg)?;
        }
        let mine = pattern(me, salt, uneven_len(me, salt));
        let got = c.gather(root, mine).map_err(err("gather"))?;
        let want: Vec<Vec<u8>> = (0..w).map(|r| pattern(r, salt, uneven_len(r, salt))).collect();
        expect_eq(&format!("gather root {root}"), got, (me == root).then_some(want.clone()))?;
        let got = c.gather(root, Vec::new()).map_err(err("gather empty"))?;
        expect_eq("gather empty", got, (me == root).then(|| vec![Vec::new(); w]))?;
        let got = c.all_gather(pattern(me, salt, uneven_len(me, salt))).map_err(err("all_gather"))?;
        expect_eq("all_gather", got, want)?;
    }
    expect_eq("all_gather empty", c.all_gather(Vec::new()).map_err(err("all_gather"))?, vec![Vec::new(); w])?;
    let v = [me as u64, 100 - me as u64, 1];
    let n = w as u64;
    let sum = c.all_reduce_u64(&v, ReduceOp::Sum).map_err(err("sum"))?;
    expect_eq("sum", sum, vec![n * (n - 1) / 2, 100 * n - n * (n - 1) / 2, n])?;
    expect_eq("min", c.all_reduce_u64(&v, ReduceOp::Min).map_err(err("min"))?, vec![0, 101 - n, 1])?;
    expect_eq("max", c.all_reduce_u64(&v, ReduceOp::Max).map_err(err("max"))?, vec![n - 1, 100, 1])?;
    expect_eq("reduce empty", c.all_reduce_u64(&[], ReduceOp::Sum).map_err(err("reduce empty"))?, vec![])?;
    expect_eq("all ok", c.all_succeeded(true).map_err(err("all ok"))?, true)?;
    expect_eq("one fails", c.all_succeeded(me != w - 1).map_err(err("one fails"))?, false)?;
    scatters(c.as_ref(), &roots)?;
    exchanges(c.as_ref())?;
    c.barrier().map_err(err("barrier before the scatter by broadcast"))?;
    // The scatter a backend without a point-to-point path uses (NCCL).
    let c = BroadcastScatter(c);
    scatters(&c, &roots)?;
    c.barrier().map_err(err("final barrier"))?;
    Ok(format!("rank {me} ok"))
}

/// Scatters of uneven, empty and large parts from several roots.
fn scatters(c: &dyn Collective, roots: &[usize]) -> Result<(), String> {
    let (me, w) = (c.rank(), c.world_size());
    for (salt, &root) in roots.iter().enumerate() {
        for big in [false, true] {
            let len = |r: usize| if big && r == w - 1 { 70_000 } else { uneven_len(r, salt) };
            let parts: Vec<Vec<u8>> = (0..w).map(|r| pattern(r, salt + 100, len(r))).collect();
            let got = c.scatter(root, (me == root).then(|| parts.clone())).map_err(err("scatter"))?;
            expect_eq(&format!("scatter root {root}"), got, parts[me].clone())?;
        }
    }
    Ok(())
}

/// Who sends what to whom in [`exchanges`]: rank r sends `(r + 1) % w` two messages and
/// `(r + 2) % w` one (a 70 kB one from the last rank), none to itself, some empty.
fn exchange_plan(r: usize, w: usize, salt: usize) -> Vec<(usize, Bytes)> {
    let mut sends = Vec::new();
    for (k, step) in [1usize, 1, 2].into_iter().enumerate() {
        let to = (r + step) % w;
        if to != r {
            let len = if r == w - 1 && k == 2 { 70_000 } else { uneven_len(r + k, salt) };
            sends.push((to, Bytes::from(pattern(r, salt + 10 * k, len))));
        }
    }
    sends
}

/// Exchanges on rings with several messages per pair, an empty one, and one where only
/// the ranks of one pair take part.
fn exchanges(c: &dyn Collective) -> Result<(), String> {
    let (me, w) = (c.rank(), c.world_size());
    for salt in 0..3 {
        let mut want = Vec::new();
        let mut from = Vec::new();
        for r in (0..w).filter(|&r| r != me) {
            for (to, msg) in exchange_plan(r, w, salt) {
                if to == me {
                    from.push(r);
                    want.push(msg);
                }
            }
        }
        let got = c.exchange(exchange_plan(me, w, salt), &from).map_err(err("exchange"))?;
        expect_eq(&format!("exchange {salt} from {from:?}"), got, want)?;
    }
    expect_eq("empty exchange", c.exchange(Vec::new(), &[]).map_err(err("empty exchange"))?, Vec::<Bytes>::new())?;
    if w > 2 {
        // Only the last two ranks talk, both ways.
        let (a, b) = (w - 2, w - 1);
        let (sends, from) = match me {
            _ if me == a => (vec![(b, Bytes::from(pattern(a, 99, 5)))], vec![b]),
            _ if me == b => (vec![(a, Bytes::from(pattern(b, 99, 6)))], vec![a]),
            _ => (Vec::new(), Vec::new()),
        };
        let want: Vec<Bytes> = from.iter().map(|&r| Bytes::from(pattern(r, 99, if r == a { 5 } else { 6 }))).collect();
        expect_eq("pair exchange", c.exchange(sends, &from).map_err(err("pair exchange"))?, want)?;
    }
    Ok(())
}

/// A collective whose `scatter` is [`scatter_by_broadcast`] over its broadcast.
#[derive(Debug)]
struct BroadcastScatter(Box<dyn Collective>);

impl Collective for BroadcastScatter {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn barrier(&self) -> dckpt_collective::Result<()> {
        self.0.barrier()
    }
    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> dckpt_collective::Result<Vec<u8>> {
        self.0.broadcast(root, data)
    }
    fn gather(&self, root: usize, data: Vec<u8>) -> dckpt_collective::Result<Option<Vec<Vec<u8>>>> {
        self.0.gather(root, data)
    }
    fn all_gather(&self, data: Vec<u8>) -> dckpt_collective::Result<Vec<Vec<u8>>> {
        self.0.all_gather(data)
    }
    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> dckpt_collective::Result<Vec<u64>> {
        self.0.all_reduce_u64(values, op)
    }
    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> dckpt_collective::Result<Vec<u8>> {
        scatter_by_broadcast(self, root, parts)
    }
    fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> dckpt_collective::Result<Vec<Bytes>> {
        self.0.exchange(sends, from)
    }
}

/// How a traffic test scatters: the backend's own call, or a broadcast of the set.
type ScatterFn<C> = fn(&C, usize, Option<Vec<Vec<u8>>>) -> dckpt_collective::Result<Vec<u8>>;

/// Room for framing a scatter might add to a part (there is none today).
const PART_SLACK: u64 = 64;

/// Scatters from several roots, and the payload bytes this rank received for them
/// (`received`, the backend's counter), against what a scatter may cost it: a rank gets
/// its own part, and only rank 0 (the hub that forwards) also gets the set of a root other
/// than itself. The counter must also show at least this rank's own parts, so a counter
/// that counts nothing fails too.
fn scatter_traffic<C: Collective>(c: &C, received: fn(&C) -> u64, scatter: ScatterFn<C>) -> Outcome {
    let (me, w) = (c.rank(), c.world_size());
    let roots = [0, 1 % w, w - 1];
    // Barriers carry empty payloads, and each rank hears from the hub in order, so the
    // counter moves only by what the scatters between them send this rank.
    c.barrier().map_err(err("barrier before the scatters"))?;
    let before = received(c);
    let (mut allowed, mut needed) = (0u64, 0u64);
    for (salt, &root) in roots.iter().enumerate() {
        // Parts of 2 KiB and up, each rank's a different size.
        let parts: Vec<Vec<u8>> = (0..w).map(|r| pattern(r, salt, 2048 + 100 * r)).collect();
        let len = |r: usize| parts[r].len() as u64;
        if me != root {
            needed += len(me);
            allowed += if me == 0 {
                (0..w).filter(|&r| r != root).map(len).sum::<u64>() + PART_SLACK * w as u64
            } else {
                len(me) + PART_SLACK
            };
        }
        let got = scatter(c, root, (me == root).then(|| parts.clone())).map_err(err("scatter"))?;
        expect_eq(&format!("scatter root {root}"), got, parts[me].clone())?;
    }
    c.barrier().map_err(err("barrier after the scatters"))?;
    let got = received(c) - before;
    if got < needed || got > allowed {
        return Err(format!("rank {me} received {got} bytes in {} scatters: want {needed}..={allowed}", roots.len()));
    }
    Ok(format!("rank {me} received {got} bytes, {needed}..={allowed}"))
}

/// Ranks whose `scatter_traffic` failed, with why.
fn traffic_failures(outcomes: Vec<Outcome>) -> Vec<(usize, String)> {
    outcomes.into_iter().enumerate().filter_map(|(r, o)| o.err().map(|e| (r, e))).collect()
}

/// `scatter_traffic` on every rank of a thread world.
fn threads_scatter_traffic(world: usize, scatter: ScatterFn<dckpt_collective::ThreadCollective>) -> Vec<Outcome> {
    ThreadGroup::run(world, &opts(20_000), |_, c| scatter_traffic(&c, |c| c.bytes_received(), scatter)).expect("world")
}

/// `f` on every rank of a TCP world whose ranks are threads, each with its own sockets.
fn on_tcp_threads(
    world: usize,
    job: &str,
    f: impl Fn(&TcpCollective) -> Outcome + Copy + Send + 'static,
) -> Vec<Outcome> {
    let port = free_port();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let job = job.to_string();
            thread::spawn(move || {
                let c = intruder(port, rank, world, &job).map_err(|e| format!("rank {rank} joining: {e}"))?;
                f(&c)
            })
        })
        .collect();
    ranks.into_iter().map(|t| t.join().expect("no panic")).collect()
}

/// `scatter_traffic` on a TCP world whose ranks are threads, each with its own sockets.
fn tcp_scatter_traffic(world: usize, job: &str, scatter: ScatterFn<TcpCollective>) -> Vec<Outcome> {
    on_tcp_threads(world, job, move |c| scatter_traffic(c, |c| c.bytes_received(), scatter))
}

// Each rank receives its own part, not the set: at 16,384 ranks a broadcast of the set
// would send every rank every rank's part.
#[test]
fn threads_scatter_sends_each_rank_only_its_part() {
    for world in [1, 2, 5] {
        let bad = traffic_failures(threads_scatter_traffic(world, |c, root, parts| c.scatter(root, parts)));
        assert!(bad.is_empty(), "world {world}: {bad:?}");
    }
}

#[test]
fn tcp_scatter_sends_each_rank_only_its_part() {
    let bad = traffic_failures(tcp_scatter_traffic(4, "scatter-own", |c, root, parts| c.scatter(root, parts)));
    assert!(bad.is_empty(), "{bad:?}");
}

// The bound above is real: a scatter by broadcast (the trait's default before scatter was
// required) exceeds it on every rank other than the hub (which gets the set either way).
#[test]
fn scatter_traffic_catches_a_broadcast_of_the_set() {
    let over_on_every_peer = |world: usize, bad: &[(usize, String)]| {
        assert!((1..world).all(|r| bad.iter().any(|f| f.0 == r && f.1.contains("received"))), "{bad:?}");
    };
    over_on_every_peer(5, &traffic_failures(threads_scatter_traffic(5, scatter_by_broadcast)));
    over_on_every_peer(4, &traffic_failures(tcp_scatter_traffic(4, "scatter-broadcast", scatter_by_broadcast)));
}

/// How a traffic test exchanges: the backend's own call, or a relay through an all-gather.
type ExchangeFn<C> = fn(&C, Vec<(usize, Bytes)>, &[usize]) -> dckpt_collective::Result<Vec<Bytes>>;

/// An exchange as a collective without a point-to-point path would do it: every rank's
/// messages all-gathered, each rank keeping those addressed to it. Every rank (and the
/// star's hub twice over) receives every byte.
fn exchange_by_all_gather<C: Collective>(
    c: &C,
    sends: Vec<(usize, Bytes)>,
    from: &[usize],
) -> dckpt_collective::Result<Vec<Bytes>> {
    let mut mine = Vec::new();
    for (to, msg) in sends {
        mine.extend((to as u64).to_le_bytes());
        mine.extend((msg.len() as u64).to_le_bytes());
        mine.extend_from_slice(&msg);
    }
    let all = c.all_gather(mine)?;
    // Per sender, the messages addressed to this rank, in the order sent.
    let mut inbox: Vec<std::collections::VecDeque<Vec<u8>>> = vec![Default::default(); all.len()];
    for (r, set) in all.iter().enumerate() {
        let mut at = 0;
        while at + 16 <= set.len() {
            let word = |i: usize| u64::from_le_bytes(set[i..i + 8].try_into().expect("8 bytes")) as usize;
            let (to, len) = (word(at), word(at + 8));
            if to == c.rank() {
                inbox[r].push_back(set[at + 16..at + 16 + len].to_vec());
            }
            at += 16 + len;
        }
    }
    Ok(from.iter().map(|&r| Bytes::from(inbox[r].pop_front().unwrap_or_default())).collect())
}

/// Every rank sends 32 KiB to the next rank (ring) and the payload bytes each rank
/// receives are counted: its own message plus the route round's few bytes, on the hub too,
/// which relays nothing.
fn exchange_traffic<C: Collective>(c: &C, received: fn(&C) -> u64, exchange: ExchangeFn<C>) -> Outcome {
    let (me, w) = (c.rank(), c.world_size());
    const BYTES: usize = 32 << 10;
    // Routes: a few bytes per rank asked, and the hub gets every rank's (empty) ask.
    let slack = 64 * w as u64;
    // Counted from before the barrier: a peer out of it first may send its message while
    // this rank still waits there, and the frame is counted when it is taken, early.
    let before = received(c);
    c.barrier().map_err(err("barrier before the exchange"))?;
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    let sends = if next == me { Vec::new() } else { vec![(next, Bytes::from(pattern(me, 1, BYTES)))] };
    let from = if prev == me { Vec::new() } else { vec![prev] };
    let got = exchange(c, sends, &from).map_err(err("exchange"))?;
    c.barrier().map_err(err("barrier after the exchange"))?;
    let got_bytes = received(c) - before;
    let needed: u64 = got.iter().map(|m| m.len() as u64).sum();
    if got_bytes < needed || got_bytes > (from.len() * BYTES) as u64 + slack {
        return Err(format!("rank {me} received {got_bytes} bytes in an exchange of {BYTES}-byte messages"));
    }
    Ok(format!("rank {me} received {got_bytes} bytes"))
}

fn tcp_exchange_traffic(world: usize, job: &str, exchange: ExchangeFn<TcpCollective>) -> Vec<Outcome> {
    on_tcp_threads(world, job, move |c| exchange_traffic(c, |c| c.bytes_received(), exchange))
}

// Peer copies and fanned-out reads move gigabytes between ranks: the hub must carry none.
#[test]
fn exchange_goes_rank_to_rank_not_through_the_hub() {
    for world in [1, 2, 5] {
        let outcomes = ThreadGroup::run(world, &opts(20_000), |_, c| {
            exchange_traffic(&c, |c| c.bytes_received(), |c, s, f| c.exchange(s, f))
        })
        .expect("world");
        let bad = traffic_failures(outcomes);
        assert!(bad.is_empty(), "threads, world {world}: {bad:?}");
    }
    let bad = traffic_failures(tcp_exchange_traffic(4, "exchange-direct", |c, s, f| c.exchange(s, f)));
    assert!(bad.is_empty(), "tcp: {bad:?}");
}

// The bound is real: relaying through an all-gather exceeds it on every rank.
#[test]
fn exchange_traffic_catches_a_relay() {
    let outcomes =
        ThreadGroup::run(5, &opts(20_000), |_, c| exchange_traffic(&c, |c| c.bytes_received(), exchange_by_all_gather))
            .expect("world");
    let bad = traffic_failures(outcomes);
    assert_eq!(bad.len(), 5, "{bad:?}");
    let bad = traffic_failures(tcp_exchange_traffic(4, "exchange-relay", exchange_by_all_gather));
    assert_eq!(bad.len(), 4, "{bad:?}");
}

/// Quick calls for large worlds.
fn quick(c: Box<dyn Collective>) -> Outcome {
    let (me, w) = (c.rank(), c.world_size());
    let sum = c.all_reduce_u64(&[1, me as u64], ReduceOp::Sum).map_err(err("sum"))?;
    expect_eq("sum", sum, vec![w as u64, (w * (w - 1) / 2) as u64])?;
    let got = c.gather(0, (me as u64).to_le_bytes().to_vec()).map_err(err("gather"))?;
    if let Some(all) = got {
        let ranks: Vec<u64> = all.iter().map(|b| u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]))).collect();
        expect_eq("gather", ranks, (0..w as u64).collect())?;
    }
    let decision = c.broadcast(0, (me == 0).then_some(&b"commit"[..])).map_err(err("broadcast"))?;
    expect_eq("broadcast", decision, b"commit".to_vec())?;
    let all = c.all_gather(vec![me as u8; me % 3]).map_err(err("all_gather"))?;
    expect_eq("all_gather", all.len(), w)?;
    Ok(String::new())
}

/// The victim goes away while the others are inside an all-gather; every survivor must
/// fail, naming the victim.
fn survive_loss(c: Box<dyn Collective>, victim: usize, how: Victim) -> Outcome {
    c.barrier().map_err(err("barrier before the loss"))?;
    if c.rank() == victim {
        match how {
            Victim::Drop => {
                thread::sleep(Duration::from_millis(200));
                drop(c);
            }
            Victim::Panic => {
                thread::sleep(Duration::from_millis(200));
                panic!("victim rank {victim} panics on purpose (the test expects this)");
            }
            Victim::AwaitKill => {
                println!("DCKPT_TEST READY");
                thread::sleep(Duration::from_secs(60));
            }
            Victim::Silent => {
                thread::sleep(Duration::from_millis(1500));
            }
        }
        return Ok("victim".into());
    }
    match c.all_gather(vec![c.rank() as u8; 10]) {
        Ok(_) => Err("all_gather succeeded without the victim".into()),
        Err(e) => {
            let named = matches!(e, Error::PeerDead { rank, .. } | Error::Timeout { rank, .. } if rank == victim);
            if !named {
                return Err(format!("error does not name victim {victim}: {e}"));
            }
            // A poisoned instance stays failed.
            match c.barrier() {
                Err(Error::Poisoned { .. }) => Ok(e.to_string()),
                other => Err(format!("after {e}, barrier gave {other:?}")),
            }
        }
    }
}

fn run_scenario(name: &str, c: Box<dyn Collective>, victim: usize, how: Victim) -> Outcome {
    match name {
        "all_calls" => all_calls(c),
        "quick" => quick(c),
        "guarded" => {
            // Joined; stay running a while so the parent can knock on rank 0's port.
            c.barrier().map_err(err("barrier"))?;
            if c.rank() == 0 {
                println!("DCKPT_TEST READY");
            }
            thread::sleep(Duration::from_millis(700));
            all_calls(c)
        }
        "loss" => survive_loss(c, victim, how),
        other => Err(format!("unknown scenario {other}")),
    }
}

// ---------------------------------------------------------------- threads

/// A port that was free a moment ago (a race with another program is possible and shows as
/// rank 0 failing to listen).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).expect("a free port");
    l.local_addr().expect("its address").port()
}

struct RankResult {
    outcome: Outcome,
    elapsed: Duration,
}

fn on_threads(
    n: usize,
    opts: &CollectiveOptions,
    f: impl Fn(Box<dyn Collective>) -> Outcome + Send + Sync + Copy + 'static,
) -> Vec<RankResult> {
    let handles = ThreadGroup::with_options(n, opts).expect("world");
    let threads: Vec<_> = handles
        .into_iter()
        .map(|c| {
            thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    let start = Instant::now();
                    let outcome = f(Box::new(c));
                    (outcome, start.elapsed())
                })
                .expect("spawn")
        })
        .collect();
    threads
        .into_iter()
        .map(|t| match t.join() {
            Ok((outcome, elapsed)) => RankResult { outcome, elapsed },
            Err(_) => RankResult { outcome: Err("panicked".into()), elapsed: Duration::ZERO },
        })
        .collect()
}

fn opts(timeout_ms: u64) -> CollectiveOptions {
    CollectiveOptions { timeout: Duration::from_millis(timeout_ms), message_bytes_max: 1 << 20 }
}

fn assert_all_ok(results: &[RankResult]) {
    let bad: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.outcome.as_ref().err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(bad.is_empty(), "{} ranks failed: {:#?}", bad.len(), &bad[..bad.len().min(10)]);
}

/// Survivors all failed, naming the victim, within `bound`.
fn assert_survivors_failed(results: &[RankResult], victim: usize, bound: Duration) {
    for (r, x) in results.iter().enumerate().filter(|(r, _)| *r != victim) {
        let detail = x.outcome.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(x.elapsed < bound, "rank {r} took {:?} (bound {bound:?}) to see: {detail}", x.elapsed);
    }
}

#[test]
fn threads_all_calls_small_worlds() {
    for n in [1, 2, 3, 5] {
        assert_all_ok(&on_threads(n, &opts(20_000), all_calls));
    }
}

#[test]
fn threads_all_calls_64_ranks() {
    assert_all_ok(&on_threads(64, &opts(20_000), all_calls));
}

#[test]
fn threads_quick_1024_ranks() {
    let start = Instant::now();
    assert_all_ok(&on_threads(1024, &opts(20_000), quick));
    assert!(start.elapsed() < Duration::from_secs(10), "1,024 ranks took {:?}", start.elapsed());
}

// The timeout is long: the survivors must notice the dead peer at once, not time out.
#[test]
fn threads_dropped_or_panicked_rank_fails_every_survivor_at_once() {
    for (victim, how) in [(3, Victim::Drop), (0, Victim::Drop), (5, Victim::Panic), (0, Victim::Panic)] {
        let results = on_threads(8, &opts(20_000), move |c| survive_loss(c, victim, how));
        assert_survivors_failed(&results, victim, Duration::from_secs(3));
    }
}

#[test]
fn threads_silent_rank_fails_every_survivor_after_the_timeout() {
    for victim in [2, 0] {
        let results = on_threads(6, &opts(400), move |c| survive_loss(c, victim, Victim::Silent));
        assert_survivors_failed(&results, victim, Duration::from_millis(1200));
        assert!(results.iter().enumerate().all(|(r, x)| r == victim || x.elapsed >= Duration::from_millis(350)));
    }
}

#[test]
fn threads_mismatched_calls_are_protocol_errors_not_hangs() {
    let results = on_threads(4, &opts(5_000), |c| {
        // Rank 2 disagrees about the all-reduce length; everyone must fail fast.
        let n = if c.rank() == 2 { 2 } else { 1 };
        match c.all_reduce_u64(&vec![1; n], ReduceOp::Sum) {
            Ok(v) => Err(format!("succeeded with {v:?}")),
            Err(e) => Ok(e.to_string()),
        }
    });
    assert_survivors_failed(&results, usize::MAX, Duration::from_secs(2));
}

#[test]
fn threads_bad_arguments_are_errors() {
    let results = on_threads(2, &opts(5_000), |c| {
        // The root forgets its data: an argument error there, an abort on the others.
        match c.broadcast(0, None) {
            Err(Error::InvalidArgument { .. }) if c.rank() == 0 => Ok(String::new()),
            Err(_) if c.rank() == 1 => Ok(String::new()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_all_ok(&results);
    let results = on_threads(2, &opts(5_000), |c| match c.all_gather(vec![0; (1 << 20) + 1]) {
        Err(Error::MessageTooLarge { .. }) | Err(Error::Aborted { .. }) => Ok(String::new()),
        other => Err(format!("{other:?}")),
    });
    assert_all_ok(&results);
    // A scatter with a part too few: an argument error at the root, an abort elsewhere.
    let results = on_threads(3, &opts(5_000), |c| match c.scatter(1, (c.rank() == 1).then(|| vec![Vec::new(); 2])) {
        Err(Error::InvalidArgument { .. }) if c.rank() == 1 => Ok(String::new()),
        Err(_) if c.rank() != 1 => Ok(String::new()),
        other => Err(format!("{other:?}")),
    });
    assert_all_ok(&results);
    // An exchange with itself: an argument error there; the other rank, which had nothing
    // to exchange, learns at its next call.
    let results = on_threads(2, &opts(5_000), |c| {
        let got = c.exchange(if c.rank() == 0 { vec![(0, Bytes::from(vec![1]))] } else { Vec::new() }, &[]);
        match (c.rank(), got) {
            (0, Err(Error::InvalidArgument { .. })) => Ok(String::new()),
            (1, Ok(_)) => match c.barrier() {
                Err(Error::Aborted { rank: 0, .. }) => Ok(String::new()),
                other => Err(format!("barrier after: {other:?}")),
            },
            (_, other) => Err(format!("{other:?}")),
        }
    });
    assert_all_ok(&results);
    assert!(matches!(ThreadGroup::new(0), Err(Error::InvalidArgument { .. })));
}

// Ranks as threads share memory: a message arrives as the sender's buffer, one buffer for
// all its receivers, and once they drop it the sender holds it alone again, to reuse.
#[test]
fn threads_exchange_hands_over_the_buffer_itself() {
    let sent = Bytes::from(vec![7u8; 4096]);
    let results = ThreadGroup::run(3, &opts(5_000), |r, c| -> Result<(), String> {
        if r == 0 {
            let sends = vec![(1, sent.clone()), (2, sent.clone())];
            c.exchange(sends, &[]).map_err(err("exchange"))?;
            c.barrier().map_err(err("barrier"))?;
            return if sent.is_unique() { Ok(()) } else { Err("a receiver still holds the message".into()) };
        }
        let got = c.exchange(Vec::new(), &[0]).map_err(err("exchange"))?;
        let same = got[0].as_ptr() == sent.as_ptr() && got[0] == sent;
        drop(got);
        c.barrier().map_err(err("barrier"))?;
        if same { Ok(()) } else { Err(format!("rank {r} received a copy")) }
    })
    .expect("world");
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
}

// A rank waiting in an exchange for a peer that sends nothing fails at the timeout naming
// that peer, not the hub (which takes no part in the data).
#[test]
fn threads_exchange_with_a_silent_sender_names_it() {
    let results = on_threads(3, &opts(1_000), |c| {
        let from: &[usize] = if c.rank() == 1 { &[2] } else { &[] };
        match (c.rank(), c.exchange(Vec::new(), from)) {
            (1, Err(Error::Timeout { rank: 2, .. })) | (0 | 2, Ok(_)) => Ok(String::new()),
            (r, other) => Err(format!("rank {r}: {other:?}")),
        }
    });
    assert_all_ok(&results);
}

// ---------------------------------------------------------------- TCP, real processes

const CHILD_ENV: &str = "DCKPT_TEST_CHILD";

/// Entry point of the child processes of the TCP tests: this test binary re-executes
/// itself with `DCKPT_TEST_CHILD` set and runs only this test. In the parent (variable
/// unset) it has nothing to do.
#[test]
fn child_entry() {
    let Ok(scenario) = std::env::var(CHILD_ENV) else { return };
    let victim = std::env::var("DCKPT_TEST_VICTIM").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX);
    let how = Victim::parse(&std::env::var("DCKPT_TEST_HOW").unwrap_or_default());
    let start = Instant::now();
    let outcome = child_world().and_then(|c| run_scenario(&scenario, c, victim, how));
    let ms = start.elapsed().as_millis();
    match outcome {
        Ok(d) => println!("DCKPT_TEST OK {ms} {d}"),
        Err(e) => println!("DCKPT_TEST ERR {ms} {e}"),
    }
}

/// The child's collective: TCP, or NCCL bootstrapped over TCP when `DCKPT_TEST_BACKEND=nccl`.
fn child_world() -> Result<Box<dyn Collective>, String> {
    let backend = std::env::var("DCKPT_TEST_BACKEND").unwrap_or_default();
    match backend.as_str() {
        #[cfg(feature = "nccl")]
        "nccl" => dckpt_collective::NcclCollective::from_env()
            .map(|c| Box::new(c) as Box<dyn Collective>)
            .map_err(|e| format!("joining NCCL: {e}")),
        "" | "tcp" => {
            TcpCollective::from_env().map(|c| Box::new(c) as Box<dyn Collective>).map_err(|e| format!("joining: {e}"))
        }
        other => Err(format!("backend {other} not compiled in")),
    }
}

struct TcpWorld {
    port: u16,
    job: String,
    children: Vec<(usize, Child)>,
    lines: Receiver<(usize, String)>,
    tx: std::sync::mpsc::Sender<(usize, String)>,
}

impl TcpWorld {
    fn new(job: &str) -> TcpWorld {
        let (tx, lines) = channel();
        let port = free_port();
        TcpWorld { port, job: job.into(), children: Vec::new(), lines, tx }
    }

    fn spawn(&mut self, rank: usize, world: usize, scenario: &str, env: &[(&str, String)]) {
        let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
        cmd.args(["--exact", "conformance::child_entry", "--nocapture", "--test-threads=1", "-q"])
            .env(CHILD_ENV, scenario)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("DCKPT_MASTER_PORT", self.port.to_string())
            .env("DCKPT_JOB_ID", &self.job)
            .env("DCKPT_RENDEZVOUS_TIMEOUT_MS", "20000")
            .env("DCKPT_MESSAGE_BYTES_MAX", (1 << 20).to_string())
            .env_remove("MASTER_PORT")
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child");
        let out = child.stdout.take().expect("stdout");
        let tx = self.tx.clone();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("DCKPT_TEST ") {
                    let _ = tx.send((rank, rest.to_string()));
                }
            }
        });
        self.children.push((rank, child));
    }

    fn spawn_all(&mut self, world: usize, scenario: &str, env: &[(&str, String)]) {
        for rank in 0..world {
            self.spawn(rank, world, scenario, env);
        }
    }

    fn wait_line(&self, bound: Duration) -> (usize, String) {
        self.lines.recv_timeout(bound).expect("a child line in time")
    }

    fn kill(&mut self, rank: usize) {
        let (_, child) = self.children.iter_mut().find(|(r, _)| *r == rank).expect("rank");
        child.kill().expect("kill");
    }

    /// Every rank's result line (except `skip`), as (elapsed, ok, detail).
    fn results(mut self, skip: Option<usize>, bound: Duration) -> Vec<(usize, Outcome, Duration)> {
        let want = self.children.len() - usize::from(skip.is_some());
        let deadline = Instant::now() + bound;
        let mut out = Vec::new();
        while out.len() < want {
            let left = deadline.saturating_duration_since(Instant::now());
            let (rank, line) = self.lines.recv_timeout(left).unwrap_or_else(|_| panic!("results so far: {out:?}"));
            let mut parts = line.splitn(3, ' ');
            let (status, ms, detail) = (parts.next(), parts.next(), parts.next().unwrap_or("").to_string());
            let elapsed = Duration::from_millis(ms.and_then(|m| m.parse().ok()).unwrap_or(u64::MAX / 4));
            match status {
                Some("OK") => out.push((rank, Ok(detail), elapsed)),
                Some("ERR") => out.push((rank, Err(detail), elapsed)),
                _ => {}
            }
        }
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        out.sort_by_key(|x| x.0);
        out
    }
}

fn assert_tcp_ok(results: &[(usize, Outcome, Duration)]) {
    for (rank, outcome, _) in results {
        assert!(outcome.is_ok(), "rank {rank}: {outcome:?}");
    }
}

#[test]
fn tcp_all_calls_on_processes() {
    for world in [1, 4] {
        let mut w = TcpWorld::new(&format!("calls-{world}"));
        w.spawn_all(world, "all_calls", &[("DCKPT_COLLECTIVE_TIMEOUT_MS", "20000".into())]);
        assert_tcp_ok(&w.results(None, Duration::from_secs(30)));
    }
}

// The timeout is long: a killed process must be noticed at once through its closed socket.
#[test]
fn tcp_killed_process_fails_every_survivor_at_once() {
    for victim in [2, 0] {
        let mut w = TcpWorld::new(&format!("kill-{victim}"));
        let env = [
            ("DCKPT_COLLECTIVE_TIMEOUT_MS", "20000".to_string()),
            ("DCKPT_TEST_VICTIM", victim.to_string()),
            ("DCKPT_TEST_HOW", Victim::AwaitKill.name().to_string()),
        ];
        w.spawn_all(4, "loss", &env);
        let (rank, line) = w.wait_line(Duration::from_secs(20));
        assert_eq!((rank, line.as_str()), (victim, "READY"));
        thread::sleep(Duration::from_millis(300)); // the survivors are now inside all_gather
        let killed_at = Instant::now();
        w.kill(victim);
        let results = w.results(Some(victim), Duration::from_secs(10));
        assert!(killed_at.elapsed() < Duration::from_secs(3), "survivors took {:?}", killed_at.elapsed());
        assert_eq!(results.len(), 3);
        for (rank, outcome, _) in &results {
            let detail = outcome.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert!(detail.contains(&format!("rank {victim}")), "rank {rank}: {detail}");
        }
    }
}

#[test]
fn tcp_silent_process_fails_every_survivor_after_the_timeout() {
    let victim = 1;
    let mut w = TcpWorld::new("silent");
    let env = [
        ("DCKPT_COLLECTIVE_TIMEOUT_MS", "500".to_string()),
        ("DCKPT_TEST_VICTIM", victim.to_string()),
        ("DCKPT_TEST_HOW", Victim::Silent.name().to_string()),
    ];
    w.spawn_all(3, "loss", &env);
    for (rank, outcome, elapsed) in w.results(None, Duration::from_secs(20)) {
        assert!(outcome.is_ok(), "rank {rank}: {outcome:?}");
        if rank != victim {
            // The child's clock includes the rendezvous and the barrier.
            assert!(elapsed < Duration::from_millis(1500 + 1000), "rank {rank} took {elapsed:?}");
        }
    }
}

/// Many sockets on rank 0: ranks are threads here (each with its own TCP connection), so a
/// big world costs no process start-up.
#[test]
fn tcp_quick_128_ranks_as_threads() {
    let world = 128;
    let port = free_port();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    let c = intruder(port, rank, world, "many").map_err(|e| format!("rank {rank} joining: {e}"))?;
                    quick(Box::new(c))
                })
                .expect("spawn")
        })
        .collect();
    for (rank, t) in ranks.into_iter().enumerate() {
        let outcome = t.join().expect("no panic");
        assert!(outcome.is_ok(), "rank {rank}: {outcome:?}");
    }
}

#[test]
fn tcp_rendezvous_without_rank_0_fails_in_time() {
    let port = free_port();
    let cfg = TcpConfig {
        rank: 1,
        world_size: 2,
        local_rank: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_id: "alone".into(),
    };
    let opts = TcpOptions { rendezvous_timeout: Duration::from_millis(300), ..TcpOptions::default() };
    let start = Instant::now();
    assert!(matches!(TcpCollective::connect(&cfg, &opts), Err(Error::Handshake { rank: 1, .. })));
    assert!(start.elapsed() < Duration::from_secs(3));
    let bad = TcpConfig { rank: 2, ..cfg };
    assert!(matches!(TcpCollective::connect(&bad, &opts), Err(Error::InvalidArgument { .. })));
}

/// Connects to rank 0's port and sends bytes that are not a handshake.
fn send_garbage(port: u16, bytes: &[u8]) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let _ = s.read_to_end(&mut sink);
    true
}

fn intruder(port: u16, rank: usize, world: usize, job: &str) -> dckpt_collective::Result<TcpCollective> {
    joined(port, rank, world, job, Duration::from_secs(20))
}

/// Rank `rank` of a TCP world on loopback, `timeout` for the rendezvous and every call.
fn joined(
    port: u16,
    rank: usize,
    world: usize,
    job: &str,
    timeout: Duration,
) -> dckpt_collective::Result<TcpCollective> {
    let cfg = TcpConfig {
        rank,
        world_size: world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_id: job.into(),
    };
    let mut opts = TcpOptions { rendezvous_timeout: timeout, ..TcpOptions::default() };
    opts.listen_addr = Some(std::net::Ipv4Addr::LOCALHOST.into());
    opts.collective.timeout = timeout;
    TcpCollective::connect(&cfg, &opts)
}

/// A timeout longer than an `Instant` can reach (`DCKPT_COLLECTIVE_TIMEOUT_MS` at
/// `u64::MAX`, Python's `timeout_s=1e19`) means wait: every call runs, none panics adding
/// it to the clock.
#[test]
fn timeouts_past_what_the_clock_holds_mean_wait() {
    let forever = CollectiveOptions { timeout: Duration::MAX, message_bytes_max: 1 << 20 };
    assert_all_ok(&on_threads(3, &forever, all_calls));
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            thread::spawn(move || {
                let c = joined(port, rank, 2, "forever", Duration::MAX).map_err(|e| format!("rank {rank}: {e}"))?;
                all_calls(Box::new(c))
            })
        })
        .collect();
    for (rank, r) in ranks.into_iter().enumerate() {
        r.join().unwrap_or_else(|_| panic!("rank {rank} panicked")).unwrap();
    }
}

// Refused connections (garbage, another job, a taken rank) must neither crash rank 0 nor
// disturb the job, during the rendezvous or while it runs.
#[test]
fn tcp_bad_handshakes_are_refused_without_disturbing_the_job() {
    let world = 3;
    let mut w = TcpWorld::new("guarded");
    let env = [("DCKPT_COLLECTIVE_TIMEOUT_MS", "20000".to_string())];
    w.spawn(0, world, "guarded", &env);
    let start = Instant::now();
    while !send_garbage(w.port, &[0xAB; 64]) {
        assert!(start.elapsed() < Duration::from_secs(10), "rank 0 never listened");
        thread::sleep(Duration::from_millis(20));
    }
    assert!(send_garbage(w.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
    let wrong_job = intruder(w.port, 1, world, "another-job");
    assert!(matches!(&wrong_job, Err(Error::Handshake { .. })), "{wrong_job:?}");
    let wrong_world = intruder(w.port, 1, world + 1, &w.job.clone());
    assert!(matches!(&wrong_world, Err(Error::Handshake { .. })), "{wrong_world:?}");
    let job = w.job.clone();
    w.spawn(1, world, "guarded", &env);
    // Rank 1 is in (or about to be); a second rank 1 must be refused.
    thread::sleep(Duration::from_millis(300));
    let twice = intruder(w.port, 1, world, &job);
    assert!(matches!(&twice, Err(Error::Handshake { .. })), "{twice:?}");
    w.spawn(2, world, "guarded", &env);
    assert_eq!(w.wait_line(Duration::from_secs(20)), (0, "READY".to_string()));
    // While the job runs, garbage and newcomers are refused too.
    assert!(send_garbage(w.port, &[0u8; 100]));
    let late = intruder(w.port, 2, world, &job);
    assert!(matches!(&late, Err(Error::Handshake { .. })), "{late:?}");
    assert_tcp_ok(&w.results(None, Duration::from_secs(30)));
}

// ---------------------------------------------------------------- NCCL (GPU machines only)

// These exist only with `--features nccl`, which CI compiles (`cargo check`) but never
// runs: without a GPU they fail, loudly. `scripts/gpu-check.sh` runs them on a GPU machine.
#[cfg(feature = "nccl")]
mod nccl {
    use super::*;
    use dckpt_collective::NcclCollective;

    /// One rank on GPU 0 exercises every call: lengths, padding, empty messages.
    #[test]
    fn nccl_all_calls_world_1() {
        let boot = ThreadGroup::new(1).expect("world").pop().expect("rank 0");
        let c = NcclCollective::with_bootstrap(Box::new(boot), 0, &opts(60_000))
            .expect("an NCCL world of one (needs a GPU, libcuda and libnccl.so)");
        println!("nccl libraries: {:?}", c.libraries());
        all_calls(Box::new(c)).expect("all calls on NCCL");
    }

    /// Two processes, one GPU each, the NCCL id shipped over TCP. Runs when
    /// `DCKPT_NCCL_TEST_WORLD` >= 2 (the GPU script sets it when it sees 2 GPUs or more).
    #[test]
    fn nccl_all_calls_on_processes() {
        let world: usize = std::env::var("DCKPT_NCCL_TEST_WORLD").ok().and_then(|w| w.parse().ok()).unwrap_or(1);
        if world < 2 {
            eprintln!("nccl_all_calls_on_processes: DCKPT_NCCL_TEST_WORLD < 2, nothing to run");
            return;
        }
        let mut w = TcpWorld::new("nccl");
        let env = [("DCKPT_COLLECTIVE_TIMEOUT_MS", "60000".to_string()), ("DCKPT_TEST_BACKEND", "nccl".to_string())];
        w.spawn_all(world, "all_calls", &env);
        assert_tcp_ok(&w.results(None, Duration::from_secs(120)));
    }
}
