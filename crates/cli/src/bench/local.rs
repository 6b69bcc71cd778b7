//! `dckpt bench local`: the node-local tier against the plain work it stands for.
//!
//! A world of 4 thread ranks forming 2 simulated nodes of 2 ranks, each rank's part copied
//! to the rank at its place on the other node (`Placement { ranks_per_node: 2, copies: 2 }`),
//! every node's directory under one root (a fresh directory under /dev/shm where there is
//! one, else under the temp dir; under --dir when it is given), removed afterwards. Each
//! rank holds a quarter of the state in four tensors. Every figure is a median over
//! alternating rounds, each side's time that of its slowest rank; one round of each side
//! first, not counted, checks what it restored byte for byte.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use dckpt::collective::{Collective, CollectiveOptions, ThreadGroup};
use dckpt::spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt::storage::Storage;
use dckpt::{
    Checkpointer, LoadOptions, LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, Location, Placement,
    SaveOptions,
};
use dckpt_reference::RankState;

use super::{BenchArgs, Figure, alternating, each_on_a_thread, gbps, median};
use crate::fmt;

const WORLD: usize = 4;
const PLACEMENT: Placement = Placement { ranks_per_node: 2, copies: 2 };
/// The most state the figures use: `--bytes` above it is cut to it (in `all` to
/// [`ALL_MAX_BYTES`]): the other figures' default of 2 GiB would take minutes here, every
/// round a save of each part and its copy.
const MAX_BYTES: u64 = 1 << 30;
const ALL_MAX_BYTES: u64 = 256 << 20;
const GB: f64 = 1e9;

/// The root of the node directories; removed with everything under it when dropped.
#[derive(Debug)]
struct Root {
    path: PathBuf,
}

impl Root {
    fn new(a: &BenchArgs) -> Result<Root> {
        let path = match &a.dir {
            Some(_) => a.dir().join("local"),
            None => {
                let shm = Path::new("/dev/shm");
                let base = if shm.is_dir() && can_make_dir(shm) { shm.to_path_buf() } else { std::env::temp_dir() };
                let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos();
                base.join(format!("dckpt-bench-local-{}-{nanos}", std::process::id()))
            }
        };
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Root { path })
    }

    /// The directory of `rank`'s node.
    fn node_dir(&self, rank: usize) -> PathBuf {
        self.path.join(format!("node-{}", PLACEMENT.node_of(rank)))
    }

    fn node(&self, rank: usize) -> Result<Arc<dyn Storage>> {
        let dir = self.node_dir(rank);
        Ok(crate::store::open(dir.to_str().context("non-UTF-8 directory")?)?)
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Whether a directory can be made in `dir`.
fn can_make_dir(dir: &Path) -> bool {
    let probe = dir.join(format!(".dckpt-bench-probe-{}", std::process::id()));
    let ok = std::fs::create_dir(&probe).is_ok();
    let _ = std::fs::remove_dir(&probe);
    ok
}

/// `rank`'s part: four f32 tensors of a half, a quarter and two eighths of `per_rank`
/// bytes, each a slice of a tensor split over the ranks; filled with `rank`'s values, or
/// zeroed (`fill: false`) to restore into.
fn rank_state(rank: usize, per_rank: u64, fill: bool) -> RankState {
    let elems = per_rank / 4;
    let sizes = [elems / 2, elems / 4, elems / 8, elems - elems / 2 - elems / 4 - elems / 8];
    let tensors: Vec<ShardedTensor> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| ShardedTensor {
            key: format!("local.t{i}").into(),
            dtype: DType::F32,
            global_shape: vec![n * WORLD as u64].into(),
            region: Region::boxed(vec![n * rank as u64], vec![n]),
            replica_id: ReplicaId::MAIN,
        })
        .collect();
    let buffers = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut b = vec![0u8; (n * 4) as usize];
            if fill {
                let seed = (rank * 4 + i) as u64;
                for (j, x) in b.iter_mut().enumerate() {
                    *x = ((j as u64).wrapping_mul(0x9E37_79B9).wrapping_add(seed) >> 11) as u8;
                }
            }
            b
        })
        .collect();
    RankState { tensors, buffers }
}

/// Runs `f(rank, collective)` on the 4 thread ranks; the results in rank order, the first
/// failure naming its rank.
fn run_world<T: Send>(f: impl Fn(usize, Arc<dyn Collective>) -> Result<T> + Sync) -> Result<Vec<T>> {
    let out = ThreadGroup::run(WORLD, &CollectiveOptions::default(), |r, c| f(r, Arc::new(c)))?;
    out.into_iter().enumerate().map(|(r, o)| o.with_context(|| format!("rank {r}"))).collect()
}

fn slowest(secs: Vec<f64>) -> f64 {
    secs.into_iter().fold(0.0, f64::max)
}

/// The steps of the local saves, one new step each.
#[derive(Debug, Default)]
struct Steps(Cell<u64>);

impl Steps {
    fn next(&self) -> LocalSaveOptions {
        self.0.set(self.0.get() + 1);
        LocalSaveOptions::new(self.0.get(), PLACEMENT)
    }
}

/// Seconds of a whole `save_local` (the part written, its copy sent and written by the
/// peer, every rank's marker), from a barrier to the slowest rank's return.
fn save_local(root: &Root, states: &[RankState], opts: &LocalSaveOptions) -> Result<f64> {
    let secs = run_world(|r, c| {
        let dir = root.node(r)?;
        c.barrier()?;
        let t = Instant::now();
        let out = Checkpointer::new(c).save_local(Location::Storage(dir), &states[r].save_state(), opts)?;
        let s = t.elapsed().as_secs_f64();
        if out.bytes != states[r].bytes() || out.received_bytes != states[r].bytes() {
            bail!("the save wrote {} bytes and received {}, not {}", out.bytes, out.received_bytes, states[r].bytes());
        }
        Ok(s)
    })?;
    Ok(slowest(secs))
}

/// Seconds `save_tiers_async` of the local tier alone blocks its caller (the slowest rank);
/// the save is waited for after the clock stopped.
fn save_blocking(root: &Root, states: &[RankState], opts: &LocalSaveOptions) -> Result<f64> {
    let blocked = run_world(|r, c| {
        let dir = root.node(r)?;
        c.barrier()?;
        let ckpt = Checkpointer::new(c);
        let t = Instant::now();
        let h = ckpt.save_tiers_async(&states[r].save_state(), Some((Location::Storage(dir), opts.clone())), None)?;
        let s = t.elapsed().as_secs_f64();
        h.wait_tiers()?.local.context("the local tier was not saved")?;
        Ok(s)
    })?;
    Ok(slowest(blocked))
}

/// Seconds of a plain copy of each rank's state into fresh buffers (the slowest rank).
fn memcpy(states: &[RankState]) -> Result<f64> {
    let secs = run_world(|r, c| {
        c.barrier()?;
        let t = Instant::now();
        let fresh: Vec<Vec<u8>> = states[r].buffers.iter().map(|b| b.to_vec()).collect();
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(&fresh);
        Ok(s)
    })?;
    Ok(slowest(secs))
}

/// Seconds of a plain write of every rank's bytes to one file with fsync (file and
/// directory), plus those of sending the same bytes over loopback TCP, one thread sending
/// and one receiving.
fn write_and_copy(file: &Path, states: &[RankState], listener: &TcpListener) -> Result<f64> {
    let _ = std::fs::remove_file(file);
    let t = Instant::now();
    let mut f = File::create(file)?;
    for b in states.iter().flat_map(|s| &s.buffers) {
        f.write_all(b)?;
    }
    f.sync_all()?;
    File::open(file.parent().context("a file in a directory")?)?.sync_all()?;
    let written = t.elapsed().as_secs_f64();
    std::fs::remove_file(file)?;
    let total: u64 = states.iter().map(|s| s.bytes()).sum();
    let addr = listener.local_addr()?;
    let t = Instant::now();
    let received = std::thread::scope(|s| -> Result<u64> {
        let receiver = s.spawn(|| -> Result<u64> {
            let (mut conn, _) = listener.accept()?;
            let mut buf = vec![0u8; 4 << 20];
            let mut got = 0u64;
            while got < total {
                let n = conn.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                got += n as u64;
            }
            Ok(got)
        });
        let sent = (|| -> Result<()> {
            let mut conn = TcpStream::connect(addr)?;
            for b in states.iter().flat_map(|s| &s.buffers) {
                conn.write_all(b)?;
            }
            Ok(())
        })();
        let got = receiver.join().map_err(|_| anyhow::anyhow!("the receiving thread panicked"))?;
        sent?;
        got
    })?;
    if received != total {
        bail!("loopback copy: {received} of {total} bytes arrived");
    }
    Ok(written + t.elapsed().as_secs_f64())
}

/// Restores the newest whole local step into `targets` on every rank; the slowest rank's
/// seconds and rank 0's outcome.
fn restore(root: &Root, targets: &mut [RankState]) -> Result<(f64, LocalRestoreOutcome)> {
    let cells: Vec<Mutex<&mut RankState>> = targets.iter_mut().map(Mutex::new).collect();
    let out = run_world(|r, c| {
        let dir = root.node(r)?;
        let mut target = cells[r].lock().map_err(|_| anyhow::anyhow!("a bench lock was poisoned"))?;
        let mut req = target.request();
        c.barrier()?;
        let t = Instant::now();
        let o =
            Checkpointer::new(c).restore_local(Location::Storage(dir), &mut req, &LocalRestoreOptions::default())?;
        Ok((t.elapsed().as_secs_f64(), o))
    })?;
    let secs = slowest(out.iter().map(|o| o.0).collect());
    let first = out.into_iter().next().context("a rank")?.1;
    if first.step.is_none() || !first.failed.is_empty() {
        bail!("the local restore found no whole step: {:?}", first.reasons);
    }
    Ok((secs, first))
}

/// Loads the persistent checkpoint into `targets`; the slowest rank's seconds.
fn load(store: &Arc<dyn Storage>, targets: &mut [RankState]) -> Result<f64> {
    let cells: Vec<Mutex<&mut RankState>> = targets.iter_mut().map(Mutex::new).collect();
    let secs = run_world(|r, c| {
        let mut target = cells[r].lock().map_err(|_| anyhow::anyhow!("a bench lock was poisoned"))?;
        let mut req = target.request();
        c.barrier()?;
        let t = Instant::now();
        Checkpointer::new(c).load(Location::Storage(store.clone()), &mut req, &LoadOptions::default())?;
        Ok(t.elapsed().as_secs_f64())
    })?;
    Ok(slowest(secs))
}

/// Each rank's own part file of the newest step in its node's directory.
fn part_files(root: &Root) -> Result<Vec<PathBuf>> {
    (0..WORLD)
        .map(|r| {
            let dir = root.node_dir(r);
            let newest = std::fs::read_dir(&dir)?
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    name.strip_prefix("step-")?.parse::<u64>().ok().map(|n| (n, e.path()))
                })
                .max()
                .with_context(|| format!("no local step under {}", dir.display()))?;
            Ok(newest.1.join(format!("part-{r}.data")))
        })
        .collect()
}

/// Seconds of a plain read of each rank's own part file into its buffers, read_exact
/// piece after piece, the 4 ranks' reads on threads of their own at once; with `check`,
/// in 128 KiB reads, each one's CRC-32 taken as it lands (what checking every byte costs
/// a read, with nothing else of the restore).
fn plain_read(files: &[PathBuf], targets: &mut [RankState], check: bool) -> Result<f64> {
    const WINDOW: usize = 128 << 10;
    let t = Instant::now();
    each_on_a_thread(files.iter().zip(targets.iter_mut()).collect(), |(p, target)| {
        let mut f = File::open(p).with_context(|| p.display().to_string())?;
        if f.metadata()?.len() != target.bytes() {
            bail!("{} does not hold {} bytes", p.display(), target.bytes());
        }
        for b in &mut target.buffers {
            if !check {
                f.read_exact(b)?;
                continue;
            }
            let mut crc = crc32fast::Hasher::new();
            for w in b.chunks_mut(WINDOW) {
                f.read_exact(w)?;
                crc.update(w);
            }
            std::hint::black_box(crc.finalize());
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Zeroes `targets`, runs `restore` into them (a round not counted) and checks that they
/// hold `states` byte for byte.
fn checked<T>(
    states: &[RankState],
    targets: &RefCell<Vec<RankState>>,
    what: &str,
    restore: impl FnOnce() -> Result<T>,
) -> Result<T> {
    for b in targets.borrow_mut().iter_mut().flat_map(|t| &mut t.buffers) {
        b.fill(0);
    }
    let out = restore()?;
    if targets.borrow().iter().zip(states).any(|(t, s)| t.buffers != s.buffers) {
        bail!("{what} did not restore the bytes that were saved");
    }
    Ok(out)
}

/// "median a s (b GB/s) vs c s (d GB/s)" of seconds rounds.
fn absolute(bytes: f64, rounds: &[(f64, f64)]) -> String {
    let (d, c) = (median(rounds.iter().map(|r| r.0).collect()), median(rounds.iter().map(|r| r.1).collect()));
    format!("medians {d:.4} s ({:.2} GB/s) vs {c:.4} s ({:.2} GB/s)", bytes / d / GB, bytes / c / GB)
}

pub fn figures(a: &BenchArgs, all: bool) -> Result<Vec<Figure>> {
    let cap = if all { ALL_MAX_BYTES } else { MAX_BYTES };
    let per_rank = (a.bytes.min(cap) / WORLD as u64).max(4096) / 32 * 32;
    let root = Root::new(a)?;
    eprintln!(
        "dckpt bench local: {} of state, {} per rank, {WORLD} thread ranks on 2 nodes, 2 copies, in {}",
        fmt::bytes(per_rank * WORLD as u64),
        fmt::bytes(per_rank),
        root.path.display()
    );
    let states: Vec<RankState> = (0..WORLD).map(|r| rank_state(r, per_rank, true)).collect();
    let steps = Steps::default();
    let mut figs = save_figures(a, &root, &states, &steps)?;
    figs.extend(restore_figures(a, &root, &states, &steps)?);
    Ok(figs)
}

/// `local_save_blocking_vs_memcpy` and `local_save_vs_write_and_copy`.
fn save_figures(a: &BenchArgs, root: &Root, states: &[RankState], steps: &Steps) -> Result<Vec<Figure>> {
    let bytes = states.iter().map(|s| s.bytes()).sum::<u64>() as f64;
    // One of each first, not counted: the first writes into fresh memory or disk.
    save_blocking(root, states, &steps.next())?;
    memcpy(states)?;
    let blocking = alternating(a.rounds, || save_blocking(root, states, &steps.next()), || memcpy(states))?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let plain = root.path.join("plain.data");
    save_local(root, states, &steps.next())?;
    write_and_copy(&plain, states, &listener)?;
    let whole = alternating(
        a.rounds,
        || save_local(root, states, &steps.next()),
        || write_and_copy(&plain, states, &listener),
    )?;
    Ok(vec![
        Figure::paired(
            "local_save_blocking_vs_memcpy",
            &blocking,
            format!(
                "seconds save_tiers_async (local tier alone) blocks the caller vs a plain copy of the state into \
                 fresh buffers (lower is better), slowest of 4 ranks; {}",
                absolute(bytes, &blocking)
            ),
        ),
        Figure::paired(
            "local_save_vs_write_and_copy",
            &whole,
            format!(
                "seconds of a whole save_local (each part written on its node, sent to its peer on the other node \
                 and written there, markers) vs one plain write + fsync of the same {} to a file beside the node \
                 directories plus a loopback TCP copy of them, one thread sending and one receiving (lower is \
                 better); {}",
                fmt::bytes(bytes as u64),
                absolute(bytes, &whole)
            ),
        ),
    ])
}

/// Seconds of a restore with node 1's directory lost: moved aside for the restore, so that
/// ranks 2 and 3 find nothing there and receive their parts from the copies on node 0, then
/// put back (the restore writes nothing), which spares a save of every part each round.
fn restore_lost_node(root: &Root, targets: &mut [RankState]) -> Result<f64> {
    let (node1, aside) = (root.path.join("node-1"), root.path.join("node-1.aside"));
    std::fs::rename(&node1, &aside)?;
    let restored = restore(root, targets);
    // Opening the storage of ranks 2 and 3 made the directory again, empty.
    let _ = std::fs::remove_dir_all(&node1);
    std::fs::rename(&aside, &node1)?;
    let (s, o) = restored?;
    if o.own != 2 || o.peer != 2 {
        bail!("with node 1 lost, {} parts came from their own copy and {} from peers", o.own, o.peer);
    }
    Ok(s)
}

/// `local_restore_own_vs_plain_read`, `local_restore_own_vs_checked_read`,
/// `local_restore_lost_node_vs_own` and `local_restore_vs_persistent`.
fn restore_figures(a: &BenchArgs, root: &Root, states: &[RankState], steps: &Steps) -> Result<Vec<Figure>> {
    let bytes = states.iter().map(|s| s.bytes()).sum::<u64>() as f64;
    let targets = RefCell::new((0..WORLD).map(|r| rank_state(r, states[r].bytes(), false)).collect::<Vec<_>>());
    save_local(root, states, &steps.next())?;
    let files = part_files(root)?;
    let own = || restore(root, &mut targets.borrow_mut()).map(|(s, _)| s);
    let (_, o) = checked(states, &targets, "the own-copy restore", || restore(root, &mut targets.borrow_mut()))?;
    if o.own != WORLD as u64 || o.peer != 0 {
        bail!("with every copy in place, {} parts came from their own copy and {} from peers", o.own, o.peer);
    }
    checked(states, &targets, "the plain read", || plain_read(&files, &mut targets.borrow_mut(), false))?;
    let vs_read = alternating(a.rounds, own, || plain_read(&files, &mut targets.borrow_mut(), false))?;
    checked(states, &targets, "the checked read", || plain_read(&files, &mut targets.borrow_mut(), true))?;
    let vs_checked = alternating(a.rounds, own, || plain_read(&files, &mut targets.borrow_mut(), true))?;

    let lost = || restore_lost_node(root, &mut targets.borrow_mut());
    checked(states, &targets, "the restore of a lost node", lost)?;
    let vs_own = alternating(a.rounds, lost, own)?;

    // The same state as a persistent checkpoint beside the node directories.
    let ckpt_dir = root.path.join("persistent");
    let store = crate::store::open(ckpt_dir.to_str().context("non-UTF-8 directory")?)?;
    run_world(|r, c| Ok(Checkpointer::new(c).save(&store, &states[r].save_state(), &SaveOptions::default())?))?;
    checked(states, &targets, "the persistent load", || load(&store, &mut targets.borrow_mut()))?;
    let vs_persistent = alternating(a.rounds, own, || load(&store, &mut targets.borrow_mut()))?;
    drop(store);
    let _ = std::fs::remove_dir_all(&ckpt_dir);

    Ok(vec![
        Figure::paired(
            "local_restore_own_vs_plain_read",
            &gbps(bytes, &vs_read),
            format!(
                "GB/s: restore_local from every rank's own copy (every byte checked) vs a plain read_exact of the \
                 same part files into the same buffers, a thread per rank; {}",
                absolute(bytes, &vs_read)
            ),
        ),
        Figure::paired(
            "local_restore_own_vs_checked_read",
            &gbps(bytes, &vs_checked),
            format!(
                "GB/s: restore_local from every rank's own copy vs the same plain read with the CRC-32 of each \
                 128 KiB read taken as it lands (the check alone, nothing else of the restore); {}",
                absolute(bytes, &vs_checked)
            ),
        ),
        Figure::paired(
            "local_restore_lost_node_vs_own",
            &gbps(bytes, &vs_own),
            format!(
                "GB/s: restore_local with node 1's directory gone (ranks 2 and 3 receive their parts from node 0) \
                 vs from every own copy; {}",
                absolute(bytes, &vs_own)
            ),
        ),
        Figure::paired(
            "local_restore_vs_persistent",
            &gbps(bytes, &vs_persistent),
            format!(
                "GB/s: restore_local from own copies vs Checkpointer::load of the same state saved as a persistent \
                 checkpoint beside it; {}",
                absolute(bytes, &vs_persistent)
            ),
        ),
    ])
}
