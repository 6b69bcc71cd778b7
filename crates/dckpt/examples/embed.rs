//! A framework embedding dckpt: four ranks (threads here; processes under `dckpt launch`
//! with `TcpCollective::from_env()`) save a model split by tensor parallelism, plus each
//! rank's RNG state, then load it back at another tensor-parallel size.
//!
//! `cargo run -p dckpt --example embed [DIR]`

use std::sync::Arc;

use dckpt::{Checkpointer, DType, LoadOptions, LoadRequest, SaveOptions, SaveState, ShardedObject, ShardedTensor};

const ROWS: u64 = 64;
const COLS: u64 = 32;

/// Element (i, j) of the weight, as a training framework's tensor would hold it.
fn value(i: u64, j: u64) -> f32 {
    (i * COLS + j) as f32 * 0.5
}

fn rank_main(ckpt: &Checkpointer, dir: &str) -> dckpt::Result<()> {
    let (r, world) = (ckpt.rank() as u64, ckpt.world_size() as u64);
    // Save at tp = world: rank r holds a block of rows; the RNG state is one object per rank.
    let rows = ROWS / world;
    let mine: Vec<u8> =
        (r * rows..(r + 1) * rows).flat_map(|i| (0..COLS).flat_map(move |j| value(i, j).to_le_bytes())).collect();
    let rng = format!("rng of rank {r}").into_bytes();
    let state = SaveState::new()
        .tensor(ShardedTensor::chunk("decoder.weight", DType::F32, [ROWS, COLS], [r * rows, 0], [rows, COLS]), &mine)
        .object(ShardedObject::in_grid("rng", vec![world], vec![r]), &rng);
    let saved = ckpt.save(dir, &state, &SaveOptions::default().replace(true).layout_entry("tp", world))?;

    // Load at tp 2: ranks 0, 1 of each pair take column halves; the others are replicas.
    let half = COLS / 2;
    let (c0, mut buf) = ((r % 2) * half, vec![0u8; (ROWS * half * 4) as usize]);
    let piece = ShardedTensor::chunk("decoder.weight", DType::F32, [ROWS, COLS], [0, c0], [ROWS, half]);
    let mut req =
        LoadRequest::new().tensor(piece, &mut buf).object(ShardedObject::in_grid("rng", vec![world], vec![r]));
    ckpt.load(dir, &mut req, &LoadOptions::default())?;
    assert_eq!(req.object_data("rng"), Some(&rng[..]), "rank {r}: its RNG state");
    let got = req.tensors[0].data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()));
    let want = (0..ROWS).flat_map(|i| (c0..c0 + half).map(move |j| value(i, j)));
    assert!(got.eq(want), "rank {r}: every element of its half");
    println!("rank {r}: saved {} bytes as save {}, loaded its half back exactly", saved.rank_bytes, saved.save_id);
    Ok(())
}

fn main() -> dckpt::Result<()> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| std::env::temp_dir().join("dckpt-embed").display().to_string());
    let ranks = dckpt::ThreadGroup::new(4)?;
    std::thread::scope(|s| {
        let hs: Vec<_> =
            ranks.into_iter().map(|c| s.spawn(|| rank_main(&Checkpointer::new(Arc::new(c)), &dir))).collect();
        hs.into_iter().try_for_each(|h| h.join().expect("rank thread"))
    })
}
