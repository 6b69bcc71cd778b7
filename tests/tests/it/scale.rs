//! The protocol's work grows linearly with the world: counted in bytes (what the ranks
//! exchange, what each decodes of the metadata), not seconds, at two world sizes four times
//! apart. The state grows with the world (the data-parallel ranks split the optimizer
//! state), so the chunks and the metadata grow four times too; anything that costs the
//! world times the metadata, or the world squared, grows sixteen times.

use std::sync::Arc;
use std::time::Duration;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::{Engine, LoadOptions};
use dckpt_layout::{ModelSpec, OptimizerMode, Synthetic};
use dckpt_reference::{RankState, save_options, saved_shapes};
use dckpt_tests::{Setup, memory};

/// What one save and load of the tiny model at `world` ranks (loaded at half of it) cost.
#[derive(Debug, Clone, Copy)]
struct Work {
    /// Metadata bytes decoded, summed over the loading ranks.
    metadata_total: u64,
    /// The most metadata bytes one rank other than the coordinator decoded.
    metadata_max_other: u64,
    /// Bytes the coordinator received and sent, save and load together.
    coordinator: u64,
    /// The most bytes any other rank received, in the save or the load.
    other_max: u64,
    /// Chunks stored.
    chunks: u64,
}

fn work(world: u32) -> Work {
    let spec = ModelSpec::preset("tiny").expect("preset");
    let save = Setup::new(world, 2, 4, 1, 4, 1, OptimizerMode::Distributed).model(&spec);
    let load = Setup::new(world / 2, 4, 2, 1, 4, 1, OptimizerMode::Distributed).model(&spec);
    let (storage, values) = (memory(), Synthetic::new(7));
    let opts = CollectiveOptions { timeout: Duration::from_secs(120), ..CollectiveOptions::default() };
    let saved = ThreadGroup::run(world as usize, &opts, |r, c| {
        let c = Arc::new(c);
        let state = RankState::filled(&save, r as u32, values);
        let o = Engine::new(c.clone()).save(storage.as_ref(), &state.save_state(), &save_options(&save));
        (o.expect("save").chunks as u64, c.bytes_received())
    })
    .expect("threads");
    let shapes = saved_shapes(&save);
    let loaded = ThreadGroup::run(load.layout.world_size as usize, &opts, |r, c| {
        let c = Arc::new(c);
        let mut state = RankState::empty(&load, r as u32);
        let o = state.load(&Engine::new(c.clone()), storage.as_ref(), &LoadOptions::default()).expect("load");
        state.check(values, &shapes).expect("every element");
        (o.metadata_bytes, c.bytes_received())
    })
    .expect("threads");
    // Every message of the star goes through the coordinator: what the others received, it sent.
    let sent = |ranks: &[u64]| ranks[1..].iter().sum::<u64>();
    let (save_rx, load_rx): (Vec<u64>, Vec<u64>) =
        (saved.iter().map(|s| s.1).collect(), loaded.iter().map(|l| l.1).collect());
    Work {
        metadata_total: loaded.iter().map(|l| l.0).sum(),
        metadata_max_other: loaded[1..].iter().map(|l| l.0).max().unwrap_or(0),
        coordinator: save_rx[0] + sent(&save_rx) + load_rx[0] + sent(&load_rx),
        other_max: save_rx[1..].iter().chain(&load_rx[1..]).copied().max().unwrap_or(0),
        chunks: saved[0].0,
    }
}

/// The old load had every rank read and decode the whole metadata, which at four times the
/// world is sixteen times the bytes; here the totals grow about four times, and what a rank
/// other than the coordinator receives stays about the same.
#[test]
fn protocol_bytes_grow_linearly_with_the_world() {
    let (small, large) = (work(64), work(256));
    let ratio = |f: fn(&Work) -> u64| f(&large) as f64 / f(&small).max(1) as f64;
    let chunks = ratio(|w| w.chunks);
    assert!(chunks > 2.5, "the state should grow with the world: {small:?} {large:?}");
    // "About linearly": within half again of the growth of the chunks.
    for (what, f) in [
        ("metadata decoded, all ranks", (|w| w.metadata_total) as fn(&Work) -> u64),
        ("the coordinator's traffic", |w| w.coordinator),
    ] {
        assert!(ratio(f) <= 1.5 * chunks, "{what}: x{:.1} for x{chunks:.1} chunks: {small:?} {large:?}", ratio(f));
    }
    for (what, f) in [
        ("metadata one other rank decoded", (|w| w.metadata_max_other) as fn(&Work) -> u64),
        ("what one other rank received", |w| w.other_max),
    ] {
        assert!(ratio(f) <= 1.5, "{what}: x{:.2} at four times the world: {small:?} {large:?}", ratio(f));
    }
}
