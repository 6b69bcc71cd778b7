//! Save in one layout, load in another, every element checked: the cross-layout matrix on
//! the `tiny` model family (ranks as threads, in-memory storage and local disk read in
//! place), covering every parallel
//! dimension, optimizer-mode changes, DP sizes that do not divide evenly, vocabulary
//! padding that changes with tp, tied embeddings and biases.

use dckpt_layout::{ModelSpec, OptimizerMode, OptimizerMode::*};
use dckpt_tests::{Setup, in_place, memory, objects_of_at_most, reshard, windowed};

fn s(world: u32, tp: u32, pp: u32, cp: u32, ep: u32, etp: u32, opt: OptimizerMode) -> Setup {
    Setup::new(world, tp, pp, cp, ep, etp, opt)
}

/// `tiny` with a vocabulary whose padding differs at tp 1, 2 and 4 (1152, 1280, 1536 rows).
fn padded_tiny() -> ModelSpec {
    ModelSpec { vocab_size: 1100, ..ModelSpec::preset("tiny").unwrap() }
}

/// `tiny` with tied embeddings, biases, no GLU and MoE on every other layer.
fn variant_tiny() -> ModelSpec {
    ModelSpec { tie_embeddings: true, add_bias: true, glu: false, moe_layer_freq: 2, ..padded_tiny() }
}

fn run(pairs: &[(Setup, Setup)], spec: &ModelSpec) {
    for (i, (from, to)) in pairs.iter().enumerate() {
        // Loads read 1000 bytes at a time: many windows, shared blocks across them. Every
        // other pair saves into data files of at most 4000 bytes: several per rank.
        let store = if i % 2 == 0 { memory() } else { objects_of_at_most(memory(), 4000) };
        let n = reshard(&windowed(store, 1000), spec, *from, *to, 100 + i as u64);
        assert!(n > 0, "{from:?} -> {to:?} checked nothing");
        // Again on local disk read in place, as the CLI reads: every partial block picked.
        let dir = tempfile::tempdir().expect("a temporary directory");
        let n = reshard(&in_place(dir.path()), spec, *from, *to, 200 + i as u64);
        assert!(n > 0, "{from:?} -> {to:?} in place checked nothing");
    }
}

#[test]
fn tensor_and_pipeline_parallel_changes() {
    run(
        &[
            (s(1, 1, 1, 1, 1, 1, None), s(1, 1, 1, 1, 1, 1, None)),
            (s(2, 2, 1, 1, 1, 1, None), s(1, 1, 1, 1, 1, 1, None)),
            (s(1, 1, 1, 1, 1, 1, None), s(4, 4, 1, 1, 1, 1, None)),
            (s(4, 2, 2, 1, 1, 1, Adam), s(4, 1, 4, 1, 1, 1, Adam)),
            (s(4, 1, 4, 1, 1, 1, Adam), s(2, 2, 1, 1, 1, 1, Adam)),
            (s(8, 2, 2, 1, 1, 1, Distributed), s(8, 4, 2, 1, 1, 1, Distributed)),
            (s(8, 4, 2, 1, 1, 1, Layerwise), s(2, 1, 2, 1, 1, 1, Layerwise)),
        ],
        &padded_tiny(),
    );
}

#[test]
fn context_and_data_parallel_changes() {
    run(
        &[
            (s(4, 1, 1, 2, 1, 1, Distributed), s(4, 1, 1, 1, 1, 1, Distributed)),
            (s(8, 2, 1, 2, 1, 1, Distributed), s(2, 1, 1, 2, 1, 1, Distributed)),
            (s(8, 1, 1, 1, 1, 1, Distributed), s(2, 1, 1, 1, 1, 1, Distributed)),
            (s(2, 1, 1, 1, 1, 1, Distributed), s(8, 1, 1, 1, 1, 1, Distributed)),
            // DP sizes that leave padding in the flat buffers.
            (s(6, 2, 1, 1, 1, 1, Distributed), s(5, 1, 1, 1, 1, 1, Distributed)),
            (s(12, 2, 1, 1, 1, 1, Distributed), s(3, 1, 1, 1, 1, 1, Layerwise)),
            (s(4, 1, 1, 4, 1, 1, Layerwise), s(4, 2, 2, 1, 1, 1, Adam)),
        ],
        &padded_tiny(),
    );
}

#[test]
fn expert_parallel_changes() {
    run(
        &[
            (s(4, 1, 1, 1, 4, 1, None), s(1, 1, 1, 1, 1, 1, None)),
            (s(4, 1, 1, 1, 1, 4, None), s(4, 1, 1, 1, 4, 1, None)),
            (s(8, 1, 1, 1, 4, 2, Distributed), s(8, 1, 1, 1, 2, 4, Distributed)),
            (s(8, 1, 1, 1, 1, 8, Distributed), s(2, 2, 1, 1, 2, 1, Layerwise)),
            (s(8, 1, 2, 1, 4, 1, Adam), s(8, 2, 2, 1, 2, 2, Layerwise)),
            (s(16, 2, 2, 1, 2, 4, Distributed), s(4, 4, 1, 1, 4, 1, Distributed)),
            (s(16, 4, 2, 2, 2, 2, Distributed), s(16, 1, 4, 1, 2, 2, Layerwise)),
        ],
        &padded_tiny(),
    );
}

#[test]
fn optimizer_mode_changes() {
    run(
        &[
            (s(4, 1, 1, 1, 1, 1, Adam), s(4, 1, 1, 1, 1, 1, Distributed)),
            (s(4, 1, 1, 1, 1, 1, Distributed), s(4, 1, 1, 1, 1, 1, Layerwise)),
            (s(4, 1, 1, 1, 1, 1, Layerwise), s(4, 1, 1, 1, 1, 1, Adam)),
            (s(8, 2, 2, 1, 2, 2, Layerwise), s(4, 1, 1, 1, 4, 1, Distributed)),
            (s(8, 2, 1, 1, 2, 2, Distributed), s(8, 4, 2, 1, 1, 1, Adam)),
            (s(16, 4, 1, 1, 4, 4, Layerwise), s(1, 1, 1, 1, 1, 1, None)),
        ],
        &padded_tiny(),
    );
}

#[test]
fn tied_embeddings_biases_and_plain_mlp() {
    run(
        &[
            (s(4, 2, 2, 1, 1, 1, None), s(2, 1, 2, 1, 1, 1, None)),
            (s(8, 2, 2, 1, 1, 1, Distributed), s(4, 1, 1, 1, 1, 1, Layerwise)),
            (s(8, 2, 2, 1, 2, 2, Adam), s(4, 4, 1, 1, 4, 1, Distributed)),
            (s(8, 1, 4, 1, 2, 1, Layerwise), s(8, 2, 2, 2, 1, 2, Distributed)),
        ],
        &variant_tiny(),
    );
}
