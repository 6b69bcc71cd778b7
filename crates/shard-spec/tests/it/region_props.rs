//! The region algebra agrees with a brute-force, element-by-element model.

use dckpt_shard_spec::{Dims, Region, Run, overlap_numel, overlap_runs};
use proptest::prelude::*;

/// Every shared element as (position in a's buffer, position in b's buffer), then maximal runs.
fn brute_force(a: &Region, b: &Region) -> Vec<Run> {
    let mut pairs = Vec::new();
    for la in 0..a.numel() {
        let g = a.global_index(la);
        if let Some(lb) = local_position(b, &g) {
            pairs.push((la, lb));
        }
    }
    let mut runs: Vec<Run> = Vec::new();
    for (la, lb) in pairs {
        match runs.last_mut() {
            Some(r) if r.a + r.len == la && r.b + r.len == lb => r.len += 1,
            _ => runs.push(Run { a: la, b: lb, len: 1 }),
        }
    }
    runs
}

fn local_position(r: &Region, g: &[u64]) -> Option<u64> {
    let mut pos = 0u64;
    for ((&x, &o), &s) in g.iter().zip(&r.offset).zip(&r.shape) {
        if x < o || x >= o + s {
            return None;
        }
        pos = pos * s + (x - o);
    }
    let f = r.flat_range();
    (pos >= f.start && pos < f.stop).then(|| pos - f.start)
}

fn region_in(global: Vec<u64>) -> impl Strategy<Value = Region> {
    let dims: Vec<_> = global.iter().map(|&g| (0..g).prop_flat_map(move |o| (Just(o), 1..=g - o))).collect();
    (dims, any::<bool>(), any::<(u16, u16)>()).prop_map(|(d, narrow, (x, y))| {
        let r = Region::boxed(d.iter().map(|x| x.0).collect::<Dims>(), d.iter().map(|x| x.1).collect::<Dims>());
        if narrow {
            let n = r.box_numel();
            let (mut s, mut e) = (x as u64 % (n + 1), y as u64 % (n + 1));
            if s > e {
                std::mem::swap(&mut s, &mut e);
            }
            r.narrowed(s, e)
        } else {
            r
        }
    })
}

fn two_regions() -> impl Strategy<Value = (Region, Region)> {
    prop::collection::vec(1u64..6, 0..4).prop_flat_map(|g| (region_in(g.clone()), region_in(g)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Boxes of more dimensions than are intersected on the stack take the allocating path.
    #[test]
    fn runs_match_brute_force_beyond_the_inline_dims(
        (a, b) in prop::collection::vec(1u64..3, 9..11).prop_flat_map(|g| (region_in(g.clone()), region_in(g)))
    ) {
        prop_assert_eq!(overlap_runs(&a, &b), brute_force(&a, &b), "{} ∩ {}", a, b);
    }

    #[test]
    fn runs_match_brute_force((a, b) in two_regions()) {
        let runs = overlap_runs(&a, &b);
        prop_assert_eq!(&runs, &brute_force(&a, &b), "{} ∩ {}", a, b);
        prop_assert_eq!(overlap_numel(&a, &b), runs.iter().map(|r| r.len).sum::<u64>());
        // Symmetry: swapping sides swaps the run coordinates.
        let swapped: Vec<Run> = overlap_runs(&b, &a);
        let back: Vec<Run> = runs.iter().map(|r| Run { a: r.b, b: r.a, len: r.len }).collect();
        prop_assert_eq!(swapped, back);
    }

    #[test]
    fn box_intersection_is_the_shared_box((a, b) in two_regions()) {
        let (a, b) = (a.box_only(), b.box_only());
        let n = overlap_numel(&a, &b);
        match a.box_intersection(&b) {
            Some(i) => {
                prop_assert_eq!(i.box_numel(), n);
                prop_assert_eq!(overlap_numel(&i, &a), n);
            }
            None => prop_assert_eq!(n, 0),
        }
    }
}
