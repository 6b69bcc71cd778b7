//! Two tiers in one manager: 8 ranks on 4 simulated nodes of 2, over threads and over TCP
//! (every rank its own sockets), the node-local directories under a temporary directory and
//! the run root counted. A lost node is restored from peers with no byte read from the run
//! root's data files; a lost node plus a damaged peer copy takes that part from the run
//! root's step, or, when the run root has no such step, the whole restore from its latest;
//! a new layout skips the local tier. Every restore is checked bit for bit.

use std::net::{Ipv4Addr, TcpListener};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dckpt::manager::{LocalTier, Restored, Sources};
use dckpt::storage::{Counting, MemoryStorage};
use dckpt::{
    CheckpointManager, Collective, CollectiveOptions, DType, LoadOptions, LoadRequest, RetentionPolicy, SaveOptions,
    SaveState, ShardedTensor, Storage, TcpCollective, TcpConfig, TcpOptions, ThreadGroup,
};

const WORLD: usize = 8;
const RPN: usize = 2;
const LEN: u64 = 4096;

/// Rank `rank`'s shard of step `step` (bytes differ per rank and step), and a replicated
/// tensor every rank holds.
fn state_of(rank: usize, step: u64) -> (Vec<u8>, Vec<u8>) {
    let shard = (0..LEN).map(|i| (i * 7 + rank as u64 * 131 + step * 17) as u8).collect();
    let shared = (0..64u64).map(|i| (i + step * 3) as u8).collect();
    (shard, shared)
}

fn pieces(rank: usize, world: usize) -> (ShardedTensor, ShardedTensor) {
    let per = WORLD as u64 * LEN / world as u64;
    let shard = ShardedTensor::chunk("w", DType::U8, [WORLD as u64 * LEN], [rank as u64 * per], [per]);
    (shard, ShardedTensor::whole("b", DType::U8, [64]).replica([0, 0, rank as u32]))
}

fn tier(nodes: &Path, persistent_every: u64) -> LocalTier {
    LocalTier {
        ranks_per_node: Some(RPN),
        persistent_every,
        ..LocalTier::new(nodes.join("{node}").to_str().expect("utf-8 path"))
    }
}

/// The ranks of one world, each with its collective: threads, or TCP (a rank per thread,
/// each with its own sockets on loopback).
fn world(kind: &str, n: usize) -> Vec<Arc<dyn Collective>> {
    match kind {
        "threads" => {
            ThreadGroup::new(n).expect("threads").into_iter().map(|c| Arc::new(c) as Arc<dyn Collective>).collect()
        }
        _ => {
            let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
            let joins: Vec<_> = (0..n)
                .map(|rank| {
                    std::thread::spawn(move || {
                        let cfg = TcpConfig {
                            rank,
                            world_size: n,
                            local_rank: rank % RPN,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            job_id: "tiers".into(),
                        };
                        let mut opts =
                            TcpOptions { listen_addr: Some(Ipv4Addr::LOCALHOST.into()), ..TcpOptions::default() };
                        opts.collective = CollectiveOptions { timeout: Duration::from_secs(60), ..opts.collective };
                        TcpCollective::connect(&cfg, &opts).expect("tcp world")
                    })
                })
                .collect();
            joins.into_iter().map(|j| Arc::new(j.join().expect("join")) as Arc<dyn Collective>).collect()
        }
    }
}

/// Runs `f(manager, rank)` on every rank of a new world; the results in rank order.
fn on_ranks<T: Send>(
    kind: &str,
    n: usize,
    root: &Arc<dyn Storage>,
    tier: Option<&LocalTier>,
    f: impl Fn(&CheckpointManager, usize) -> T + Sync,
) -> Vec<T> {
    let ranks = world(kind, n);
    std::thread::scope(|s| {
        let joins: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                let f = &f;
                s.spawn(move || {
                    let m = CheckpointManager::new(c, root, RetentionPolicy::KEEP_ALL).expect("manager");
                    let m = match tier {
                        Some(t) => m.with_local_tier(t.clone()).expect("local tier"),
                        None => m,
                    };
                    f(&m, rank)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().expect("rank")).collect()
    })
}

fn save_steps(kind: &str, root: &Arc<dyn Storage>, tier: &LocalTier, steps: std::ops::RangeInclusive<u64>) {
    on_ranks(kind, WORLD, root, Some(tier), |m, rank| {
        let (w, b) = pieces(rank, WORLD);
        for step in steps.clone() {
            let (wd, bd) = state_of(rank, step);
            let state = SaveState::new().tensor(w.clone(), &wd).tensor(b.clone(), &bd);
            if step % 2 == 0 {
                m.save_async(step, &state, &SaveOptions::default()).expect("async save");
            } else {
                let out = m.save(step, &state, &SaveOptions::default()).expect("save");
                assert_eq!(out.local.is_some(), tier.local_due(step));
                assert_eq!(out.outcome.is_some(), tier.persistent_due(step));
            }
        }
        m.finish_pending().expect("last step");
    });
}

/// Restores on every rank of a world of `n` and checks every byte against the step it
/// restored; the outcome of each rank.
fn restore(kind: &str, n: usize, root: &Arc<dyn Storage>, tier: Option<&LocalTier>) -> Vec<Restored> {
    on_ranks(kind, n, root, tier, |m, rank| {
        let (w, b) = pieces(rank, n);
        let (mut wd, mut bd) = (vec![0u8; w.nbytes() as usize], vec![0u8; 64]);
        let mut req = LoadRequest::new().tensor(w.clone(), &mut wd).tensor(b, &mut bd);
        let r = m.load_latest(&mut req, &LoadOptions::default()).expect("restore").expect("a step");
        drop(req);
        let per = w.nbytes() as usize;
        let want: Vec<u8> = (0..WORLD).flat_map(|q| state_of(q, r.step).0).skip(rank * per).take(per).collect();
        assert!(wd == want, "rank {rank}: step {}'s shard differs", r.step);
        assert_eq!(bd, state_of(0, r.step).1, "rank {rank}: step {}'s replicated tensor", r.step);
        r
    })
}

fn data_reads(root: &Counting) -> u64 {
    root.counts().bytes_read
}

/// The run root, counting only its data files' reads.
fn counted_root() -> (Arc<Counting>, Arc<dyn Storage>) {
    let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let is_data = |p: &str| p.rsplit('/').next().is_some_and(dckpt::format::is_data_file_name);
    let counting = Arc::new(Counting::only(inner, is_data));
    (counting.clone(), counting)
}

fn lose(nodes: &Path, node: usize) {
    std::fs::remove_dir_all(nodes.join(node.to_string())).expect("remove the node's directory");
}

fn flip_byte(nodes: &Path, node: usize, step: u64, part: usize) {
    let file = nodes.join(node.to_string()).join(format!("step-{step:012}")).join(format!("part-{part}.data"));
    let mut bytes = std::fs::read(&file).expect("the copy");
    bytes[100] ^= 0x01;
    std::fs::write(&file, bytes).expect("damaged");
}

fn same_everywhere(all: &[Restored]) -> (u64, Sources) {
    for r in all {
        assert_eq!((r.step, r.sources), (all[0].step, all[0].sources));
    }
    (all[0].step, all[0].sources)
}

fn a_lost_node_restores_from_peers(kind: &str) {
    let nodes = tempfile::tempdir().unwrap();
    let (counting, root) = counted_root();
    let t = tier(nodes.path(), 5);
    save_steps(kind, &root, &t, 1..=6);
    lose(nodes.path(), 1);
    let before = data_reads(&counting);
    let all = restore(kind, WORLD, &root, Some(&t));
    assert_eq!(same_everywhere(&all), (6, Sources { own: 6, peer: 2, persistent: 0 }), "{:?}", all[0].fallbacks);
    assert_eq!(data_reads(&counting), before, "the run root's data files were read");
    assert!(all[0].fallbacks.iter().any(|f| f.contains("[2, 3]")), "{:?}", all[0].fallbacks);
}

#[test]
fn threads_a_lost_node_restores_from_peers_reading_nothing_of_the_run_root() {
    a_lost_node_restores_from_peers("threads");
}

#[test]
fn tcp_a_lost_node_restores_from_peers_reading_nothing_of_the_run_root() {
    a_lost_node_restores_from_peers("tcp");
}

#[test]
fn a_damaged_peer_copy_takes_that_part_from_the_run_roots_same_step() {
    let nodes = tempfile::tempdir().unwrap();
    let (counting, root) = counted_root();
    let t = tier(nodes.path(), 5);
    save_steps("threads", &root, &t, 1..=5);
    lose(nodes.path(), 1);
    // Rank 2's only other copy is on node 2.
    flip_byte(nodes.path(), 2, 5, 2);
    let before = data_reads(&counting);
    let all = restore("threads", WORLD, &root, Some(&t));
    assert_eq!(same_everywhere(&all), (5, Sources { own: 6, peer: 1, persistent: 1 }), "{:?}", all[0].fallbacks);
    let why = all[0].fallbacks.join("\n");
    assert!(why.contains("rank 2") && why.contains("checksum") && why.contains("run root's step 5"), "{why}");
    assert!(data_reads(&counting) > before, "rank 2's part came from the run root");
}

#[test]
fn a_local_step_that_is_not_whole_falls_back_to_the_run_roots_latest() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = tier(nodes.path(), 5);
    save_steps("threads", &root, &t, 1..=6);
    lose(nodes.path(), 1);
    flip_byte(nodes.path(), 2, 6, 2);
    let all = restore("threads", WORLD, &root, Some(&t));
    assert_eq!(same_everywhere(&all), (5, Sources { own: 0, peer: 0, persistent: 8 }), "{:?}", all[0].fallbacks);
    assert!(all[0].fallbacks.iter().any(|f| f.contains("run root has no step 6")), "{:?}", all[0].fallbacks);
}

/// With two local steps kept, a newest one that cannot be restored whole (one part has no
/// good copy) and is not in the run root gives way to the older local step, not to the run
/// root's older step: the older local step's markers were dropped with the newer one's, and
/// its progress lost. Where the run root holds no step at all, the failing step is named and
/// kept.
#[test]
fn a_local_step_that_is_not_whole_falls_back_to_an_older_whole_local_step() {
    let nodes = tempfile::tempdir().unwrap();
    let (counting, root) = counted_root();
    let t = LocalTier { keep: 2, ..tier(nodes.path(), 5) };
    save_steps("threads", &root, &t, 1..=7);
    lose(nodes.path(), 1);
    flip_byte(nodes.path(), 2, 7, 2);
    let before = data_reads(&counting);
    // Resumed from step 6, step 7 is an abandoned branch: a second restore takes 6 again.
    for first in [true, false] {
        let all = restore("threads", WORLD, &root, Some(&t));
        let f = &all[0].fallbacks;
        assert_eq!(same_everywhere(&all), (6, Sources { own: 6, peer: 2, persistent: 0 }), "{f:?}");
        let told = f.iter().any(|w| w.contains("local step 7 is not whole and the run root has no step 7"));
        assert_eq!(told, first, "{f:?}");
    }
    assert_eq!(data_reads(&counting), before, "the run root's data files were read");

    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = LocalTier { keep: 2, ..tier(nodes.path(), 0) };
    save_steps("threads", &root, &t, 1..=2);
    lose(nodes.path(), 1);
    flip_byte(nodes.path(), 2, 2, 2);
    flip_byte(nodes.path(), 2, 1, 2);
    for _ in 0..2 {
        let failed = on_ranks("threads", WORLD, &root, Some(&t), |m, rank| {
            let (w, b) = pieces(rank, WORLD);
            let (mut wd, mut bd) = (vec![0u8; w.nbytes() as usize], vec![0u8; 64]);
            let mut req = LoadRequest::new().tensor(w, &mut wd).tensor(b, &mut bd);
            m.load_latest(&mut req, &LoadOptions::default()).map(|r| r.map(|r| r.step))
        });
        for r in failed {
            let e = r.expect_err("nothing restores whole");
            assert!(e.to_string().contains("local step 2 cannot be restored whole"), "{e}");
        }
    }
}

/// One rank's caller failed to make its part: a step due on both tiers fails on every rank
/// in the local save's first round, naming it (before, the local step was saved with that
/// rank's part empty and marked complete); so does a restore, in the local restore's.
#[test]
fn a_callers_failure_on_one_rank_fails_both_tiers_on_every_rank() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = tier(nodes.path(), 5);
    save_steps("threads", &root, &t, 1..=4);
    let why = |rank: usize| (rank == 3).then(|| "TypeError: a set is not a plain value".to_string());
    let saved = on_ranks("threads", WORLD, &root, Some(&t), |m, rank| {
        let (w, b) = pieces(rank, WORLD);
        let (wd, bd) = state_of(rank, 5);
        let mut state = SaveState::new();
        if why(rank).is_none() {
            state = state.tensor(w, &wd).tensor(b, &bd);
        }
        m.save(5, &state, &SaveOptions { caller_failed: why(rank), ..SaveOptions::default() }).map(drop)
    });
    let restored = on_ranks("threads", WORLD, &root, Some(&t), |m, rank| {
        let (w, b) = pieces(rank, WORLD);
        let (mut wd, mut bd) = (vec![0u8; w.nbytes() as usize], vec![0u8; 64]);
        let mut req = LoadRequest::new().tensor(w, &mut wd).tensor(b, &mut bd);
        m.load_latest(&mut req, &LoadOptions { caller_failed: why(rank), ..LoadOptions::default() }).map(drop)
    });
    for (rank, r) in saved.into_iter().chain(restored).enumerate() {
        let e = r.expect_err("every rank fails");
        assert_eq!(e.rank(), Some(3), "{rank}: {e}");
        assert!(e.to_string().contains("a set is not a plain value"), "{rank}: {e}");
    }
    // Step 4 stays the newest whole step of both tiers.
    assert_eq!(same_everywhere(&restore("threads", WORLD, &root, Some(&t))).0, 4);
}

#[test]
fn a_new_layout_skips_the_local_tier_and_reshards_the_run_root() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = tier(nodes.path(), 5);
    save_steps("threads", &root, &t, 1..=6);
    // 4 ranks (2 nodes of 2), each holding twice the shard.
    let all = restore("threads", 4, &root, Some(&t));
    assert_eq!(same_everywhere(&all), (5, Sources { own: 0, peer: 0, persistent: 4 }), "{:?}", all[0].fallbacks);
    assert!(all[0].fallbacks.iter().any(|f| f.contains("new layout")), "{:?}", all[0].fallbacks);
}

#[test]
fn gc_removes_local_steps_retention_does_not_keep() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = LocalTier { keep: 3, ..tier(nodes.path(), 5) };
    save_steps("threads", &root, &t, 1..=6);
    let listed = |node: usize| {
        let mut names: Vec<String> = std::fs::read_dir(nodes.path().join(node.to_string()))
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_dir(e.path()).map(|d| d.count() > 0).unwrap_or(false))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(listed(0), ["step-000000000004", "step-000000000005", "step-000000000006"]);
    let keep_one = LocalTier { keep: 1, ..t };
    let removed = on_ranks("threads", WORLD, &root, Some(&keep_one), |m, _| m.gc().expect("gc").local_steps);
    assert!(removed.iter().all(|r| r == &[4, 5]), "{removed:?}");
    assert_eq!(listed(3), ["step-000000000006"]);
    let all = restore("threads", WORLD, &root, Some(&keep_one));
    assert_eq!(same_everywhere(&all), (6, Sources { own: 8, peer: 0, persistent: 0 }));
}

// ---------------------------------------------------------------- TCP, real processes

const CHILD_ENV: &str = "DCKPT_TIERS_CHILD";

/// Entry point of the processes of `tcp_processes_a_lost_node_restores_from_peers`: this
/// test binary re-executed with `DCKPT_TIERS_CHILD` = `save` or `restore` and torchrun's
/// environment; in the parent it does nothing. A rank prints `RESULT <step> <own> <peer>
/// <persistent> <bit-exact>` after a restore.
#[test]
fn child_entry() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    let nodes = std::path::PathBuf::from(std::env::var("DCKPT_TIERS_NODES").unwrap());
    let root = dckpt::open(&std::env::var("DCKPT_TIERS_ROOT").unwrap()).unwrap();
    let c: Arc<dyn Collective> = Arc::new(TcpCollective::from_env().expect("tcp world"));
    let rank = c.rank();
    let t = LocalTier { ranks_per_node: None, ..tier(&nodes, 5) };
    let m = CheckpointManager::new(c, &root, RetentionPolicy::KEEP_ALL).unwrap().with_local_tier(t).unwrap();
    let (w, b) = pieces(rank, WORLD);
    if mode == "save" {
        for step in 1..=6 {
            let (wd, bd) = state_of(rank, step);
            m.save(step, &SaveState::new().tensor(w.clone(), &wd).tensor(b.clone(), &bd), &SaveOptions::default())
                .unwrap();
        }
        println!("RESULT saved");
        return;
    }
    let (mut wd, mut bd) = (vec![0u8; w.nbytes() as usize], vec![0u8; 64]);
    let mut req = LoadRequest::new().tensor(w, &mut wd).tensor(b, &mut bd);
    let r = m.load_latest(&mut req, &LoadOptions::default()).unwrap().unwrap();
    drop(req);
    let (want_w, want_b) = state_of(rank, r.step);
    let s = r.sources;
    println!("RESULT {} {} {} {} {}", r.step, s.own, s.peer, s.persistent, wd == want_w && bd == want_b);
}

/// Runs `mode` on 8 processes (torchrun's environment, `LOCAL_WORLD_SIZE` 2); each one's
/// result line.
fn on_processes(mode: &str, nodes: &Path, root: &Path) -> Vec<String> {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
    let children: Vec<_> = (0..WORLD)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_entry", "--nocapture", "--test-threads=1", "-q"])
                .env(CHILD_ENV, mode)
                .env("DCKPT_TIERS_NODES", nodes)
                .env("DCKPT_TIERS_ROOT", root)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", (rank % RPN).to_string())
                .env("LOCAL_WORLD_SIZE", RPN.to_string())
                .env("GROUP_RANK", (rank / RPN).to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("DCKPT_MASTER_PORT", port.to_string())
                .env("DCKPT_JOB_ID", format!("tiers-{mode}"))
                .env("DCKPT_COLLECTIVE_TIMEOUT_MS", "60000")
                .env_remove("MASTER_PORT")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(rank, child)| {
            let out = child.wait_with_output().expect("a rank's output");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(out.status.success(), "rank {rank}: {:?}\n{text}", out.status);
            let line =
                text.lines().find_map(|l| l.strip_prefix("RESULT ")).unwrap_or_else(|| panic!("rank {rank}: {text}"));
            line.to_string()
        })
        .collect()
}

#[test]
fn tcp_processes_a_lost_node_restores_from_peers() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, root) = (dir.path().join("nodes"), dir.path().join("run"));
    std::fs::create_dir_all(&root).unwrap();
    assert!(on_processes("save", &nodes, &root).iter().all(|l| l == "saved"));
    lose(&nodes, 3);
    for (rank, line) in on_processes("restore", &nodes, &root).into_iter().enumerate() {
        assert_eq!(line, "6 6 2 0 true", "rank {rank}: step, own, peer, persistent, bit-exact");
    }
}

/// A run whose only checkpoints are local steps keeps them when a launch cannot restore
/// them (here a new layout): every rank fails, naming the steps, rather than unmarking them
/// and starting afresh; the launch with the layout they were saved with restores them.
#[test]
fn local_steps_that_are_the_runs_only_checkpoints_are_kept() {
    let nodes = tempfile::tempdir().unwrap();
    let root: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let t = tier(nodes.path(), 100);
    save_steps("threads", &root, &t, 1..=3);
    let refused = on_ranks("threads", WORLD / 2, &root, Some(&t), |m, rank| {
        let (w, b) = pieces(rank, WORLD / 2);
        let (mut wd, mut bd) = (vec![0u8; w.nbytes() as usize], vec![0u8; 64]);
        let mut req = LoadRequest::new().tensor(w, &mut wd).tensor(b, &mut bd);
        m.load_latest(&mut req, &LoadOptions::default()).map(|r| r.map(|r| r.step))
    });
    for (rank, r) in refused.into_iter().enumerate() {
        let e = r.expect_err("no step to restore, and local steps kept").to_string();
        assert!(e.contains("local steps [3] of this run") && e.contains("new layout"), "rank {rank}: {e}");
    }
    let back = restore("threads", WORLD, &root, Some(&t));
    assert!(back.iter().all(|r| r.step == 3), "{:?}", back.iter().map(|r| r.step).collect::<Vec<_>>());
}

/// A step saved again: one the local tier holds whole and the run root is due too (its save
/// to the run root failed after the local tier's, here its step removed) is kept on the
/// local tier and committed to the run root; one due on the local tier alone is refused, as
/// a committed step is, and stays whole. On the old code both were unmarked and rewritten,
/// so a failure midway lost the run's newest step.
#[test]
fn a_whole_local_step_saved_again_is_kept_for_the_run_root_and_refused_alone() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = LocalTier { keep: 2, ..tier(nodes.path(), 5) };
    save_steps("threads", &root, &t, 4..=5);
    for info in root.list(&dckpt::manager::step_dir(5)).unwrap() {
        root.delete(&info.path).unwrap();
    }
    let again = |step: u64| {
        on_ranks("threads", WORLD, &root, Some(&t), |m, rank| {
            let (w, b) = pieces(rank, WORLD);
            let (wd, bd) = state_of(rank, step);
            m.save(step, &SaveState::new().tensor(w, &wd).tensor(b, &bd), &SaveOptions::default())
        })
    };
    for (rank, out) in again(5).into_iter().enumerate() {
        let out = out.expect("saved to the run root");
        assert!(out.local.as_ref().is_some_and(|l| l.kept), "rank {rank}: {:?}", out.local);
        assert!(out.outcome.is_some(), "rank {rank}");
    }
    let latest = on_ranks("threads", 1, &root, None, |m, _| m.latest().unwrap());
    assert_eq!(latest[0].step, Some(5), "the run root committed step 5");
    // Step 4's files on every node, byte for byte: its markers and parts.
    let step4 = || -> Vec<(std::path::PathBuf, Vec<u8>)> {
        let mut all: Vec<_> = (0..WORLD / RPN)
            .flat_map(|n| std::fs::read_dir(nodes.path().join(n.to_string()).join("step-000000000004")).unwrap())
            .map(|e| e.unwrap().path())
            .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
            .collect();
        all.sort();
        all
    };
    let before = step4();
    assert_eq!(before.iter().filter(|(p, _)| p.to_string_lossy().contains("/done-")).count(), WORLD);
    for (rank, out) in again(4).into_iter().enumerate() {
        let e = out.expect_err("refused");
        assert!(matches!(e.kind(), dckpt::ErrorKind::AlreadyExists { .. }), "rank {rank}: {e}");
    }
    assert!(step4() == before, "step 4 stays whole, as it was");
    lose(nodes.path(), 3);
    assert_eq!(same_everywhere(&restore("threads", WORLD, &root, Some(&t))).0, 5);
}

/// Managers made otherwise on one rank (its local tier saved every other step, as where a
/// node's directory or interval comes from its own environment) are refused on every rank
/// at the step's start, with nothing written: on the old code that rank passed over the
/// local save the others began, and they waited for it until their collective's timeout.
#[test]
fn managers_made_otherwise_on_one_rank_are_refused_on_every_rank() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = tier(nodes.path(), 5);
    let errors: Vec<String> = std::thread::scope(|s| {
        let joins: Vec<_> = world("threads", WORLD)
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                let (root, t) = (&root, &t);
                s.spawn(move || {
                    let t = LocalTier { every: if rank == 3 { 2 } else { 1 }, ..t.clone() };
                    let m = CheckpointManager::new(c, root, RetentionPolicy::KEEP_ALL).unwrap();
                    let m = m.with_local_tier(t).unwrap();
                    let (w, b) = pieces(rank, WORLD);
                    let (wd, bd) = state_of(rank, 1);
                    let state = SaveState::new().tensor(w, &wd).tensor(b, &bd);
                    let saved = m.save(1, &state, &SaveOptions::default()).unwrap_err().to_string();
                    // A restore is refused too, so a job so made fails at its start.
                    let (mut w, mut b) = (vec![0u8; wd.len()], vec![0u8; bd.len()]);
                    let (wt, bt) = pieces(rank, WORLD);
                    let mut req = LoadRequest::new().tensor(wt, &mut w).tensor(bt, &mut b);
                    let loaded = m.load_latest(&mut req, &LoadOptions::default()).unwrap_err().to_string();
                    format!("{saved}\n{loaded}")
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().expect("rank")).collect()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert_eq!(e.matches("the ranks' managers differ").count(), 2, "rank {rank}: {e}");
    }
    assert!(root.list("").unwrap().is_empty(), "nothing under the run root");
    // Each node's directory is made with its manager, and stays empty.
    for node in std::fs::read_dir(nodes.path()).unwrap() {
        let node = node.unwrap().path();
        assert!(std::fs::read_dir(&node).unwrap().next().is_none(), "{} holds something", node.display());
    }
}

/// `unmark_local_newer` is not collective, as its docs say: one rank calling it alone with a
/// path returns at once. It opened the path on every rank, and waited out the collective's
/// timeout for ranks that never came.
#[test]
fn unmarking_newer_local_steps_is_one_ranks_call() {
    let dir = tempfile::tempdir().unwrap();
    let opts = CollectiveOptions { timeout: Duration::from_secs(20), ..CollectiveOptions::default() };
    let results = ThreadGroup::run(2, &opts, |rank, c| {
        let ckpt = dckpt::Checkpointer::new(Arc::new(c));
        match rank {
            0 => ckpt.unmark_local_newer(dir.path().to_str().unwrap(), Some(3), "run").map(|v| v.len()),
            _ => Ok(0),
        }
    })
    .expect("threads");
    assert_eq!(results.into_iter().map(|r| r.expect("unmarked")).collect::<Vec<_>>(), [0, 0]);
}

/// A node-local disk that fails (here a file where node 1's directory of the step goes)
/// costs the local step only: the run root's save goes on, in the foreground and in the
/// background, on every rank, and the outcome says why; the step then restores from the run
/// root. A step due on the local tier alone fails on every rank, as before.
#[test]
fn a_failing_local_disk_does_not_stop_the_run_roots_save() {
    let nodes = tempfile::tempdir().unwrap();
    let (_, root) = counted_root();
    let t = tier(nodes.path(), 2);
    save_steps("threads", &root, &t, 1..=2);
    for step in [3, 4, 6] {
        std::fs::write(nodes.path().join("1").join(format!("step-{step:012}")), b"not a directory").unwrap();
    }
    let saved = on_ranks("threads", WORLD, &root, Some(&t), |m, rank| {
        let (w, b) = pieces(rank, WORLD);
        let save = |step: u64| {
            let (wd, bd) = state_of(rank, step);
            let state = SaveState::new().tensor(w.clone(), &wd).tensor(b.clone(), &bd);
            match step {
                6 => m.save_async(step, &state, &SaveOptions::default()).and_then(|p| p.wait()),
                _ => m.save(step, &state, &SaveOptions::default()),
            }
        };
        (3..=6).map(save).collect::<Vec<_>>()
    });
    for (rank, outs) in saved.iter().enumerate() {
        let e = outs[0].as_ref().expect_err("step 3 is due on the local tier alone");
        assert!(matches!(e.rank(), Some(2 | 3)), "rank {rank}: {e}");
        assert!(outs[2].as_ref().is_ok_and(|o| o.local.is_some()), "rank {rank}: step 5 is saved");
        for step in [4, 6] {
            let out = outs[step - 3].as_ref().unwrap_or_else(|e| panic!("rank {rank}, step {step}: {e}"));
            assert!(out.local.is_none() && out.outcome.is_some(), "rank {rank}, step {step}: {out:?}");
            let why = out.local_error.as_deref().unwrap_or_default();
            assert!(why.contains("rank 2") || why.contains("rank 3"), "rank {rank}, step {step}: {why}");
        }
    }
    let restored = restore("threads", WORLD, &root, Some(&t));
    assert_eq!(same_everywhere(&restored), (6, Sources { persistent: WORLD as u64, ..Sources::default() }));
}
