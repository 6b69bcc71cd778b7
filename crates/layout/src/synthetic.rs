//! Deterministic synthetic values: every element of every tensor gets bytes that depend
//! only on (seed, key, global element index), so any layout can fill its pieces and any
//! other layout can check what it loaded, without either knowing the other.
//!
//! The global element index is the row-major position in the tensor's global shape. Its
//! strides do not involve axis 0, so a tensor whose only change is a longer or shorter
//! axis 0 (a padded vocabulary at another tp) keeps the values of its common elements.

use dckpt_shard_spec::{Region, ShardedTensor, for_each_overlap_run};

/// A value generator for one seed.
#[derive(Debug, Clone, Copy)]
pub struct Synthetic {
    /// Different seeds give unrelated values for the same key and index.
    pub seed: u64,
}

impl Synthetic {
    /// The generator for `seed`.
    pub fn new(seed: u64) -> Synthetic {
        Synthetic { seed }
    }

    fn key_seed(&self, key: &str) -> u64 {
        // FNV-1a, then mixed with the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        splitmix64(h ^ self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// Fills `buf` with the piece's elements (`region.numel() * dtype.size()` bytes).
    pub fn fill(&self, t: &ShardedTensor, buf: &mut [u8]) {
        let (ks, esz) = (self.key_seed(&t.key), t.dtype.size() as usize);
        let full = Region::full(&t.global_shape);
        for_each_overlap_run(&t.region, &full, |run| {
            let out = &mut buf[run.a as usize * esz..(run.a + run.len) as usize * esz];
            // One branch per run on the element size, fixed-size copies inside.
            match esz {
                1 => fill_run::<1>(out, ks, run.b),
                2 => fill_run::<2>(out, ks, run.b),
                4 => fill_run::<4>(out, ks, run.b),
                _ => fill_run::<8>(out, ks, run.b),
            }
        });
    }

    /// Checks a loaded piece: elements inside `saved_shape` (the global shape the
    /// checkpoint holds) must carry their values, elements outside it must be zero.
    /// Returns the first wrong element's global index.
    pub fn check(&self, t: &ShardedTensor, saved_shape: &[u64], buf: &[u8]) -> Result<(), String> {
        let (ks, esz) = (self.key_seed(&t.key), t.dtype.size() as usize);
        let full = Region::full(&t.global_shape);
        let same = saved_shape == t.global_shape.as_slice();
        let mut err = None;
        for_each_overlap_run(&t.region, &full, |run| {
            if err.is_some() {
                return;
            }
            let got = &buf[run.a as usize * esz..(run.a + run.len) as usize * esz];
            // Fast path: every element inside the saved shape and equal to its value.
            if same {
                let bad = match esz {
                    1 => check_run::<1>(got, ks, run.b),
                    2 => check_run::<2>(got, ks, run.b),
                    4 => check_run::<4>(got, ks, run.b),
                    _ => check_run::<8>(got, ks, run.b),
                };
                if bad.is_none() {
                    return;
                }
            }
            for (i, e) in got.chunks_exact(esz).enumerate() {
                let g = run.b + i as u64;
                let inside = same || contains(saved_shape, &full.global_index(g));
                let want = if inside { splitmix64(ks.wrapping_add(g)).to_le_bytes() } else { [0; 8] };
                if e != &want[..esz] {
                    err = Some(format!(
                        "tensor {:?} element {:?}: got {:02x?}, expected {:02x?}",
                        t.key,
                        full.global_index(g),
                        e,
                        &want[..esz]
                    ));
                    return;
                }
            }
        });
        err.map_or(Ok(()), Err)
    }
}

fn fill_run<const N: usize>(out: &mut [u8], ks: u64, first: u64) {
    for (i, e) in out.chunks_exact_mut(N).enumerate() {
        let v = splitmix64(ks.wrapping_add(first + i as u64)).to_le_bytes();
        e.copy_from_slice(&v[..N]);
    }
}

/// The index in the run of the first element that differs from its value, if any.
fn check_run<const N: usize>(got: &[u8], ks: u64, first: u64) -> Option<usize> {
    got.chunks_exact(N).enumerate().position(|(i, e)| {
        let v = splitmix64(ks.wrapping_add(first + i as u64)).to_le_bytes();
        e != &v[..N]
    })
}

fn contains(shape: &[u64], idx: &[u64]) -> bool {
    shape.len() == idx.len() && idx.iter().zip(shape).all(|(i, s)| i < s)
}

/// The splitmix64 finalizer: a fast, well-mixed 64-bit hash of `x`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dckpt_shard_spec::{DType, ReplicaId};

    fn piece(shape: &[u64], region: Region) -> ShardedTensor {
        ShardedTensor {
            key: "w".into(),
            dtype: DType::Bf16,
            global_shape: shape.into(),
            region,
            replica_id: ReplicaId::MAIN,
        }
    }

    #[test]
    fn pieces_agree_with_the_whole_and_padding_is_zero() {
        let s = Synthetic::new(7);
        let whole = piece(&[6, 4], Region::full(&[6, 4]));
        let mut all = vec![0u8; 48];
        s.fill(&whole, &mut all);
        let part = piece(&[6, 4], Region::boxed(vec![2, 1], vec![3, 2]).narrowed(1, 5));
        let mut buf = vec![0u8; 8];
        s.fill(&part, &mut buf);
        // Local element 0 of the narrowed piece is box position 1: global (2, 2) = index 10.
        assert_eq!(&buf[..2], &all[20..22]);
        assert_eq!(s.check(&part, &[6, 4], &buf), Ok(()));
        buf[3] ^= 1;
        assert!(s.check(&part, &[6, 4], &buf).is_err());
        // A longer axis 0: rows beyond the saved 6 must be zero, the rest unchanged.
        let padded = piece(&[8, 4], Region::full(&[8, 4]));
        let mut p = vec![0u8; 64];
        p[..48].copy_from_slice(&all);
        assert_eq!(s.check(&padded, &[6, 4], &p), Ok(()));
        p[50] = 1;
        assert!(s.check(&padded, &[6, 4], &p).unwrap_err().contains("[6, 1]"));
        assert_ne!(Synthetic::new(8).key_seed("w"), s.key_seed("w"));
    }
}
