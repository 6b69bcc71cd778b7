//! Coverage validation: exact-once proofs and the errors that name what is wrong.

use dckpt_shard_spec::{
    DType, ObjectPiece, Problem, Region, ReplicaId, ShardedObject, ShardedTensor, TensorDecl, TensorPiece, validate,
};
use proptest::prelude::*;

fn t(key: &str, shape: &[u64], region: Region, replica: ReplicaId) -> ShardedTensor {
    ShardedTensor {
        key: key.into(),
        dtype: DType::F32,
        global_shape: shape.to_vec().into(),
        region,
        replica_id: replica,
    }
}

fn main_t(key: &str, shape: &[u64], region: Region) -> ShardedTensor {
    t(key, shape, region, ReplicaId::MAIN)
}

/// Validates `(rank, tensor)` pairs; returns the problems (empty when valid).
fn check(pieces: &[(u32, ShardedTensor)]) -> Vec<Problem> {
    let p: Vec<TensorPiece> = pieces.iter().map(|(r, t)| TensorPiece { rank: *r, tensor: t }).collect();
    match validate(&p, &[], None) {
        Ok(_) => Vec::new(),
        Err(e) => e.problems,
    }
}

fn boxed(o: &[u64], s: &[u64]) -> Region {
    Region::boxed(o.to_vec(), s.to_vec())
}

#[test]
fn regular_grid_with_replicas_is_valid() {
    // [4, 8] split 2x2, each block replicated on two DP ranks (dp entry 1 not main).
    let mut pieces = Vec::new();
    for (i, (r0, c0)) in [(0, 0), (0, 4), (2, 0), (2, 4)].into_iter().enumerate() {
        let reg = boxed(&[r0, c0], &[2, 4]);
        pieces.push((i as u32, main_t("w", &[4, 8], reg.clone())));
        pieces.push((i as u32 + 4, t("w", &[4, 8], reg, ReplicaId::new(0, 0, 1))));
    }
    assert_eq!(check(&pieces), vec![]);
}

#[test]
fn irregular_boxes_are_valid() {
    // An L-shaped tiling of a [3, 3] tensor.
    let pieces = vec![
        (0, main_t("w", &[3, 3], boxed(&[0, 0], &[1, 3]))),
        (1, main_t("w", &[3, 3], boxed(&[1, 0], &[2, 1]))),
        (2, main_t("w", &[3, 3], boxed(&[1, 1], &[2, 2]))),
    ];
    assert_eq!(check(&pieces), vec![]);
}

#[test]
fn uneven_1d_split_with_empty_ranks_is_valid() {
    // Megatron's [15, 0, 0, ...] splits: empty pieces are ordinary.
    let mut pieces = vec![(0, main_t("w", &[15], boxed(&[0], &[15])))];
    for r in 1..8 {
        pieces.push((r, main_t("w", &[15], boxed(&[15], &[0]))));
    }
    assert_eq!(check(&pieces), vec![]);
}

#[test]
fn flat_ranges_tiling_tp_boxes_are_valid() {
    // ZeRO-1: each TP half [4, 2] split into flat ranges over 3 DP ranks, unevenly.
    let mut pieces = Vec::new();
    for tp in 0..2u64 {
        let bx = boxed(&[0, 2 * tp], &[4, 2]);
        for (dp, (s, e)) in [(0, 3), (3, 3), (3, 8)].into_iter().enumerate() {
            pieces.push(((tp * 3 + dp as u64) as u32, main_t("exp_avg", &[4, 4], bx.clone().narrowed(s, e))));
        }
    }
    assert_eq!(check(&pieces), vec![]);
}

#[test]
fn flat_ranges_straddling_boxes_are_checked_exactly() {
    // Rows 0..1.5 as a flat range of the whole box, the rest as a flat range of rows 1..4.
    let ok = vec![
        (0, main_t("w", &[4, 4], Region::full(&[4, 4]).narrowed(0, 6))),
        (1, main_t("w", &[4, 4], boxed(&[1, 0], &[3, 4]).narrowed(2, 12))),
    ];
    assert_eq!(check(&ok), vec![]);
    let overlapping = vec![
        (0, main_t("w", &[4, 4], Region::full(&[4, 4]).narrowed(0, 7))),
        (1, main_t("w", &[4, 4], boxed(&[1, 0], &[3, 4]).narrowed(2, 12))),
    ];
    assert!(matches!(&check(&overlapping)[..], [Problem::Overlap { key, .. }] if key == "w"));
    let gap = vec![
        (0, main_t("w", &[4, 4], Region::full(&[4, 4]).narrowed(0, 5))),
        (1, main_t("w", &[4, 4], boxed(&[1, 0], &[3, 4]).narrowed(2, 12))),
    ];
    let p = check(&gap);
    assert!(
        matches!(&p[..], [Problem::Gap { covered: 15, total: 16, missing: Some(m), .. }] if m.flat.map(|f| (f.start, f.stop)) == Some((5, 6))),
        "{p:?}"
    );
}

#[test]
fn duplicate_main_names_key_region_and_ranks() {
    // Every ETP rank claiming the same region as main: the dropped-coordinate bug.
    let reg = boxed(&[0, 0], &[4, 4]);
    let pieces = vec![(2, main_t("experts.fc1", &[4, 8], reg.clone())), (3, main_t("experts.fc1", &[4, 8], reg))];
    let p = check(&pieces);
    assert_eq!(
        p,
        vec![Problem::DuplicateMain { key: "experts.fc1".into(), region: boxed(&[0, 0], &[4, 4]), ranks: vec![2, 3] }]
    );
    assert!(p[0].to_string().contains("experts.fc1") && p[0].to_string().contains("[2, 3]"));
}

#[test]
fn non_main_shards_leave_a_gap() {
    // ETP rank 1 marked non-main: half the expert weight would silently not be written.
    let pieces = vec![
        (0, main_t("experts.fc2", &[2, 8], boxed(&[0, 0], &[2, 4]))),
        (1, t("experts.fc2", &[2, 8], boxed(&[0, 4], &[2, 4]), ReplicaId::new(0, 1, 0))),
    ];
    let p = check(&pieces);
    assert_eq!(
        p,
        vec![Problem::Gap { key: "experts.fc2".into(), covered: 8, total: 16, missing: Some(boxed(&[0, 4], &[2, 4])) }]
    );
}

#[test]
fn overlap_and_bounds_and_disagreement() {
    let overlap = vec![(0, main_t("w", &[4], boxed(&[0], &[3]))), (1, main_t("w", &[4], boxed(&[2], &[2])))];
    assert!(
        matches!(&check(&overlap)[..], [Problem::Overlap { ranks_a, ranks_b, .. }] if ranks_a == &[0] && ranks_b == &[1])
    );

    let oob = vec![(5, main_t("w", &[4], boxed(&[2], &[3])))];
    assert!(matches!(&check(&oob)[..], [Problem::BadRegion { rank: 5, .. }]));

    let mut other = main_t("w", &[4], boxed(&[2], &[2]));
    other.dtype = DType::Bf16;
    let dtype = vec![(0, main_t("w", &[4], boxed(&[0], &[2]))), (1, other)];
    assert!(matches!(&check(&dtype)[..], [Problem::DtypeMismatch { rank_a: 0, rank_b: 1, .. }]));

    let shape = vec![(0, main_t("w", &[4], boxed(&[0], &[2]))), (1, main_t("w", &[5], boxed(&[2], &[2])))];
    assert!(matches!(&check(&shape)[..], [Problem::ShapeMismatch { .. }]));

    let huge = vec![(0, main_t("w", &[u64::MAX, 4], boxed(&[0, 0], &[1, 1])))];
    assert!(matches!(&check(&huge)[..], [Problem::TooLarge { .. }]));
}

#[test]
fn many_pieces_use_the_sweep_and_still_find_overlaps() {
    // A staircase: row i split at column i + 1. Its boundary grid has n^2 cells, too many
    // to mark, so the sweep runs.
    let n = 2100u64;
    let shape = [n, n];
    let mut pieces: Vec<(u32, ShardedTensor)> = Vec::new();
    for i in 0..n {
        pieces.push((i as u32, main_t("w", &shape, boxed(&[i, 0], &[1, i + 1]))));
        pieces.push((i as u32, main_t("w", &shape, boxed(&[i, i + 1], &[1, n - i - 1]))));
    }
    assert_eq!(check(&pieces), vec![]);
    pieces.push((7, main_t("w", &shape, boxed(&[n - 2, 5], &[2, 1]))));
    assert!(matches!(&check(&pieces)[..], [Problem::Overlap { .. }]));
    pieces.pop();
    pieces.remove(10);
    assert!(matches!(&check(&pieces)[..], [Problem::Gap { covered, .. }] if *covered == n * n - 6));
}

#[test]
fn objects_unique_and_complete() {
    let obj = |o: &[u64], replica: ReplicaId| ShardedObject {
        key: "rng".into(),
        grid_shape: vec![2, 2],
        grid_offset: o.to_vec(),
        replica_id: replica,
    };
    let run = |objs: &[(u32, ShardedObject)]| {
        let p: Vec<ObjectPiece> = objs.iter().map(|(r, o)| ObjectPiece { rank: *r, object: o }).collect();
        validate(&[], &p, None).err().map(|e| e.problems).unwrap_or_default()
    };
    let all = |skip: usize| -> Vec<(u32, ShardedObject)> {
        [[0, 0], [0, 1], [1, 0], [1, 1]]
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != skip)
            .map(|(i, o)| (i as u32, obj(o, ReplicaId::MAIN)))
            .collect()
    };
    assert_eq!(run(&all(99)), vec![]);
    assert_eq!(
        run(&all(2)),
        vec![Problem::ObjectMissing { key: "rng".into(), offset: vec![1, 0], missing: 1, total: 4, replicas: vec![] }]
    );
    // Held only as replicas (a common value that only later ranks hold): they are named.
    let mut only_replicas = all(2);
    only_replicas.push((7, obj(&[1, 0], ReplicaId::new(0, 0, 1))));
    only_replicas.push((5, obj(&[1, 0], ReplicaId::new(0, 0, 2))));
    let got = run(&only_replicas);
    assert_eq!(
        got,
        vec![Problem::ObjectMissing {
            key: "rng".into(),
            offset: vec![1, 0],
            missing: 1,
            total: 4,
            replicas: vec![5, 7]
        }]
    );
    assert!(got[0].to_string().contains("ranks [5, 7] hold it as a replica only"), "{}", got[0]);
    let mut dup = all(99);
    dup.push((9, obj(&[0, 1], ReplicaId::MAIN)));
    dup.push((10, obj(&[0, 1], ReplicaId::new(0, 0, 1))));
    assert_eq!(run(&dup), vec![Problem::ObjectDuplicate { key: "rng".into(), offset: vec![0, 1], ranks: vec![1, 9] }]);
    let mut oob = all(99);
    oob.push((4, obj(&[2, 0], ReplicaId::new(0, 0, 1))));
    assert!(matches!(&run(&oob)[..], [Problem::ObjectOutOfBounds { rank: 4, .. }]));
}

#[test]
fn declared_tensors_must_match_exactly() {
    let a = main_t("a", &[4], Region::full(&[4]));
    let b = main_t("b", &[2], Region::full(&[2]));
    let p = [TensorPiece { rank: 0, tensor: &a }, TensorPiece { rank: 0, tensor: &b }];
    let decl = |k: &str, s: &[u64]| TensorDecl { key: k.into(), dtype: DType::F32, global_shape: s.to_vec().into() };
    assert!(validate(&p, &[], Some(&[decl("a", &[4]), decl("b", &[2])])).is_ok());
    let e = validate(&p, &[], Some(&[decl("a", &[8]), decl("c", &[1])])).unwrap_err();
    assert_eq!(
        e.problems,
        vec![
            Problem::DeclarationMismatch {
                key: "a".into(),
                declared_dtype: DType::F32,
                declared_shape: vec![8].into(),
                dtype: DType::F32,
                shape: vec![4].into()
            },
            Problem::UndeclaredTensor { key: "b".into(), rank: 0 },
            Problem::MissingTensor { key: "c".into() },
        ]
    );
}

/// A random exact tiling of a 2-d tensor: cuts per axis, and each cell either a box or
/// its flat ranges over a few ranks.
fn tiling() -> impl Strategy<Value = (Vec<u64>, Vec<(u32, Region)>)> {
    (1u64..7, 1u64..7)
        .prop_flat_map(|(h, w)| {
            (
                Just(vec![h, w]),
                prop::collection::btree_set(1..h.max(2), 0..3),
                prop::collection::btree_set(1..w.max(2), 0..3),
                prop::collection::vec((any::<bool>(), 0u64..5, 0u64..5), 16),
            )
        })
        .prop_map(|(shape, rc, cc, flats)| {
            let cuts = |set: std::collections::BTreeSet<u64>, n: u64| {
                let mut v: Vec<u64> = std::iter::once(0).chain(set.into_iter().filter(|&x| x < n)).collect();
                v.push(n);
                v
            };
            let (rows, cols) = (cuts(rc, shape[0]), cuts(cc, shape[1]));
            let mut out = Vec::new();
            let mut k = 0;
            for r in rows.windows(2) {
                for c in cols.windows(2) {
                    let bx = Region::boxed(vec![r[0], c[0]], vec![r[1] - r[0], c[1] - c[0]]);
                    let (flat, x, y) = flats[k % flats.len()];
                    k += 1;
                    if flat {
                        let n = bx.box_numel();
                        let (mut s, mut e) = (x % (n + 1), y % (n + 1));
                        if s > e {
                            std::mem::swap(&mut s, &mut e);
                        }
                        out.push((k as u32, bx.clone().narrowed(0, s)));
                        out.push((k as u32 + 100, bx.clone().narrowed(s, e)));
                        out.push((k as u32 + 200, bx.narrowed(e, n)));
                    } else {
                        out.push((k as u32, bx));
                    }
                }
            }
            (shape, out)
        })
}

proptest! {
    #[test]
    fn exact_tilings_validate_and_mutations_do_not((shape, tiles) in tiling(), victim in any::<prop::sample::Index>()) {
        let pieces: Vec<(u32, ShardedTensor)> = tiles.iter().map(|(r, reg)| (*r, main_t("w", &shape, reg.clone()))).collect();
        prop_assert_eq!(check(&pieces), vec![]);

        let nonempty: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i].1.region.numel() > 0).collect();
        let i = nonempty[victim.index(nonempty.len())];
        // Dropping a non-empty piece leaves a gap (or, if it was the only one, a declared
        // tensor that nobody holds).
        let mut dropped = pieces.clone();
        dropped.remove(i);
        let decl = [TensorDecl { key: "w".into(), dtype: DType::F32, global_shape: shape.clone().into() }];
        let refs: Vec<TensorPiece> = dropped.iter().map(|(r, t)| TensorPiece { rank: *r, tensor: t }).collect();
        let p = validate(&refs, &[], Some(&decl)).unwrap_err().problems;
        prop_assert!(matches!(&p[..], [Problem::Gap { .. }] | [Problem::MissingTensor { .. }]), "{:?}", p);
        // Marking it non-main does too.
        let mut demoted = pieces.clone();
        demoted[i].1.replica_id = ReplicaId::new(0, 1, 0);
        let p = check(&demoted);
        prop_assert!(matches!(&p[..], [Problem::Gap { .. }]), "{:?}", p);
        // Adding it again as main on another rank is a duplicate main.
        let mut doubled = pieces.clone();
        doubled.push((999, pieces[i].1.clone()));
        let p = check(&doubled);
        prop_assert!(matches!(&p[..], [Problem::DuplicateMain { .. }]), "{:?}", p);
        // Adding the whole tensor as one more main piece overlaps.
        let mut over = pieces.clone();
        over.push((999, main_t("w", &shape, Region::full(&shape))));
        let p = check(&over);
        prop_assert!(matches!(&p[..], [Problem::Overlap { .. }] | [Problem::DuplicateMain { .. }]), "{:?}", p);
    }
}

/// The element-exact check is bounded before it walks: a flat range over a one-column box of
/// 2^40 rows (a rank's plan, or a crafted metadata file) was walked row by row, for hours,
/// before the bound on intervals refused it. Refused at once now, naming the key.
#[test]
fn the_exact_check_refuses_a_region_of_too_many_rows_before_walking_it() {
    let rows = 1u64 << 40;
    let mut p = main_t("w", &[rows, 2], boxed(&[0, 0], &[rows, 1]).narrowed(0, rows - 1));
    p.dtype = DType::U8;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(check(&[(0, p)]));
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("validation walked 2^40 rows");
    assert!(matches!(&got[..], [Problem::TooFragmented { key, .. }] if key == "w"), "{got:?}");
}

/// The sweep over boxes too many for the grid is bounded: a staircase of 20,000 column strips,
/// each cut at its own row (valid, but every box starting at row 0 shares rows with every
/// other), compared every pair, quadratic in the boxes. Refused now, naming the key.
#[test]
fn the_sweep_refuses_boxes_whose_rows_overlap_too_much() {
    let n = 20_000u64;
    let mut pieces = Vec::new();
    for i in 0..n {
        let cut = i + 1;
        pieces.push((0, main_t("w", &[n + 1, n], boxed(&[0, i], &[cut, 1]))));
        pieces.push((0, main_t("w", &[n + 1, n], boxed(&[cut, i], &[n + 1 - cut, 1]))));
    }
    let got = check(&pieces);
    assert!(matches!(&got[..], [Problem::TooManyOverlaps { key, .. }] if key == "w"), "{got:?}");
}

/// The element each position of `r`'s buffer is, row-major in a tensor of `width` columns.
fn elements(r: &Region, width: u64) -> Vec<u64> {
    let (o, s) = (&r.offset, &r.shape);
    let f = r.flat_range();
    (f.start..f.stop).map(|i| (o[0] + i / s[1]) * width + o[1] + i % s[1]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Flat ranges over boxes of whole rows that they do not fill (the element-exact check),
    /// a tensor cut anywhere, then a piece dropped, widened or left: valid exactly when every
    /// element is held once, as counted element by element; a gap at the start, in the
    /// middle or at the end is named with what is covered.
    #[test]
    fn straddling_flat_ranges_are_checked_element_by_element(
        cuts in prop::collection::btree_set(1u64..24, 1..6),
        edit in 0..3u8,
        which in any::<prop::sample::Index>(),
    ) {
        let (rows, width) = (4u64, 6u64);
        let total = rows * width;
        let mut bounds: Vec<u64> = std::iter::once(0).chain(cuts).chain(std::iter::once(total)).collect();
        bounds.dedup();
        let mut spans: Vec<(u64, u64)> = bounds.windows(2).map(|w| (w[0], w[1])).collect();
        let k = which.index(spans.len());
        match edit {
            0 => { spans.remove(k); }
            1 => spans[k].1 = (spans[k].1 + 1).min(total),
            _ => {}
        }
        let pieces: Vec<(u32, ShardedTensor)> = spans
            .iter()
            .enumerate()
            .map(|(r, &(a, b))| {
                let (r0, r1) = (a / width, b.div_ceil(width));
                let bx = boxed(&[r0, 0], &[r1 - r0, width]).narrowed(a - r0 * width, b - r0 * width);
                (r as u32, main_t("w", &[rows, width], bx))
            })
            .collect();
        let mut held = vec![0u32; total as usize];
        for (_, t) in &pieces {
            for e in elements(&t.region, width) {
                held[e as usize] += 1;
            }
        }
        let problems = check(&pieces);
        let once = held.iter().all(|&n| n == 1);
        prop_assert_eq!(problems.is_empty(), once, "{:?}: {:?}", spans, problems);
        if held.iter().all(|&n| n <= 1) && !once {
            let covered = held.iter().filter(|&&n| n == 1).count() as u64;
            let gap = matches!(&problems[..], [Problem::Gap { covered: c, total: t, .. }] if *c == covered && *t == total);
            prop_assert!(gap, "{:?}: {:?}", spans, problems);
        }
    }
}
