//! Objects: the objects of a key sit on distinct positions of one grid and fill it.

use super::{ObjectPiece, Problems};
use crate::Problem;
use crate::region::checked_numel;

/// One object key: one grid shape, every position inside it, one main object at each.
pub(super) fn check_objects(key: &str, pieces: &[ObjectPiece<'_>], problems: &mut Problems) {
    let first = pieces[0];
    let grid = &first.object.grid_shape;
    for p in pieces {
        if &p.object.grid_shape != grid {
            problems.push(Problem::ObjectGridMismatch {
                key: key.into(),
                rank_a: first.rank,
                grid_a: grid.clone(),
                rank_b: p.rank,
                grid_b: p.object.grid_shape.clone(),
            });
            return;
        }
        let o = &p.object.grid_offset;
        if o.len() != grid.len() || o.iter().zip(grid).any(|(a, g)| a >= g) {
            problems.push(Problem::ObjectOutOfBounds {
                key: key.into(),
                rank: p.rank,
                offset: o.clone(),
                grid: grid.clone(),
            });
            return;
        }
    }
    let mut mains: Vec<(&Vec<u64>, u32)> =
        pieces.iter().filter(|p| p.object.is_main()).map(|p| (&p.object.grid_offset, p.rank)).collect();
    mains.sort_unstable();
    for w in mains.chunk_by(|a, b| a.0 == b.0) {
        if w.len() > 1 {
            let ranks = w.iter().map(|x| x.1).collect();
            problems.push(Problem::ObjectDuplicate { key: key.into(), offset: w[0].0.clone(), ranks });
            return;
        }
    }
    let total = checked_numel(grid).unwrap_or(u64::MAX);
    let found = mains.len() as u64;
    if found < total {
        // Positions are sorted row-major; the first one out of step is missing.
        let mut pos = vec![0u64; grid.len()];
        for (o, _) in &mains {
            if *o != &pos {
                break;
            }
            for d in (0..grid.len()).rev() {
                pos[d] += 1;
                if pos[d] < grid[d] {
                    break;
                }
                pos[d] = 0;
            }
        }
        // Who holds that position as a replica only: where a value is common state saved
        // from one rank, a rank that alone holds it is the cause.
        let mut replicas: Vec<u32> = pieces.iter().filter(|p| p.object.grid_offset == pos).map(|p| p.rank).collect();
        replicas.sort_unstable();
        replicas.dedup();
        problems.push(Problem::ObjectMissing { key: key.into(), offset: pos, missing: total - found, total, replicas });
    }
}
