//! Checking one CRC-32 from parts that different ranks read.
//!
//! When a load splits a stored chunk between ranks along its columns, each rank needs every
//! other stretch of each checksum block. Rather than have every rank read (and checksum)
//! the whole block, each rank checksums only its own bytes, as if every byte it did not
//! read were zero, and the coordinator combines the parts.
//!
//! CRC-32 without its initial value and final XOR (the *raw* CRC, `R(r, x)` for a register
//! `r` and bytes `x`) is linear over GF(2): for blocks `a` and `b` of equal length,
//! `R(0, a ^ b) = R(0, a) ^ R(0, b)`; and `R(r, x) = Z_len(x)(r) ^ R(0, x)` where `Z_n` is
//! the register's evolution over `n` zero bytes. So a block that is the disjoint union of
//! parts `p_i` (each zero elsewhere) has
//!
//! ```text
//! crc32(block) = crc32(zeros of its length) ^ R(0, p_1) ^ R(0, p_2) ^ ...
//! ```
//!
//! [`Part`] computes `R(0, p)` from the [`raw`] CRCs of a rank's stretches, each taken as
//! the stretch is read: `R(r, x) = Z_len(x)(r) ^ R(0, x)`, so the register moves over the
//! gap and the stretch (four table lookups per set bit of their length) and takes the
//! stretch's own CRC.

use std::sync::OnceLock;

/// The reflected CRC-32 polynomial (IEEE 802.3), as `crc32fast` and zlib use it.
const POLY: u32 = 0xEDB8_8320;

/// Powers of two of zero-byte shifts up to 2^(SHIFTS - 1) bytes; gaps are inside one
/// checksum block, at most 2^30 bytes.
const SHIFTS: usize = 40;

type Table = [[u32; 256]; 4];

/// `tables()[k]` applies `Z_(2^k)` byte by byte of the register.
fn tables() -> &'static [Table] {
    static TABLES: OnceLock<Vec<Table>> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut out: Vec<Table> = Vec::with_capacity(SHIFTS);
        let one_byte = |mut r: u32| {
            for _ in 0..8 {
                r = (r >> 1) ^ (POLY & (r & 1).wrapping_neg());
            }
            r
        };
        let mut t = [[0u32; 256]; 4];
        for (j, row) in t.iter_mut().enumerate() {
            for (v, e) in row.iter_mut().enumerate() {
                *e = one_byte((v as u32) << (8 * j));
            }
        }
        out.push(t);
        for _ in 1..SHIFTS {
            let prev = out.last().expect("one table at least");
            let mut t = [[0u32; 256]; 4];
            for (j, row) in t.iter_mut().enumerate() {
                for (v, e) in row.iter_mut().enumerate() {
                    *e = apply(prev, apply(prev, (v as u32) << (8 * j)));
                }
            }
            out.push(t);
        }
        out
    })
}

fn apply(t: &Table, r: u32) -> u32 {
    t[0][(r & 0xff) as usize]
        ^ t[1][((r >> 8) & 0xff) as usize]
        ^ t[2][((r >> 16) & 0xff) as usize]
        ^ t[3][(r >> 24) as usize]
}

/// `Z_n(r)`: the raw register after `n` more zero bytes.
pub fn shift_zeros(mut r: u32, n: u64) -> u32 {
    let t = tables();
    let mut rest = n;
    while rest != 0 && r != 0 {
        let k = rest.trailing_zeros() as usize;
        assert!(k < SHIFTS, "a zero run of {n} bytes is beyond any checksum block");
        r = apply(&t[k], r);
        rest &= rest - 1;
    }
    r
}

/// `R(r, bytes)`: the raw register after `bytes`.
pub(crate) fn raw_update(r: u32, bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial(!r);
    h.update(bytes);
    !h.finalize()
}

/// `R(0, bytes)`: the raw CRC of a stretch on its own, for [`Part::add_raw`].
pub fn raw(bytes: &[u8]) -> u32 {
    raw_update(0, bytes)
}

/// The CRC-32 of a block from the XOR of its parts' [`Part::finish`] values.
pub fn combine(parts_xor: u32, block_len: u64) -> u32 {
    !shift_zeros(!0, block_len) ^ parts_xor
}

/// One rank's part of a checksum block of `len` bytes: its stretches, given in increasing
/// order, every other byte taken as zero.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    r: u32,
    pos: u64,
    len: u64,
    bytes: u64,
}

impl Part {
    pub fn new(len: u64) -> Part {
        Part { r: 0, pos: 0, len, bytes: 0 }
    }

    /// Adds the stretch at byte `at` of the block; stretches come in order, not overlapping.
    #[cfg(test)]
    pub fn add(&mut self, at: u64, data: &[u8]) {
        self.add_raw(at, data.len() as u64, raw(data));
    }

    /// Adds the stretch of `len` bytes at byte `at` of the block, given as its [`raw`] CRC
    /// (computed when it was read, while in cache); stretches come in order, not overlapping.
    /// `R(r, x) = Z_len(x)(r) ^ R(0, x)`: the register so far moves over the gap and the
    /// stretch, then takes the stretch's own CRC.
    pub fn add_raw(&mut self, at: u64, len: u64, raw: u32) {
        debug_assert!(at >= self.pos && at + len <= self.len, "stretches in order, inside the block");
        self.r = shift_zeros(self.r, at - self.pos + len) ^ raw;
        self.pos = at + len;
        self.bytes += len;
    }

    /// Bytes added so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// `R(0, part)` over the whole block.
    pub fn finish(self) -> u32 {
        shift_zeros(self.r, self.len - self.pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_part_that_is_the_whole_block_is_its_crc() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 + 7) as u8).collect();
        let mut p = Part::new(data.len() as u64);
        p.add(0, &data);
        assert_eq!(combine(p.finish(), data.len() as u64), crc32fast::hash(&data));
    }

    #[test]
    fn zeros_shift_matches_hashing_zeros() {
        for n in [0u64, 1, 2, 3, 7, 8, 255, 4096, 65_537, 1 << 20] {
            let zeros = vec![0u8; n as usize];
            assert_eq!(combine(0, n), crc32fast::hash(&zeros), "{n} zero bytes");
            assert_eq!(shift_zeros(0x1234_5678, n), raw_update(0x1234_5678, &zeros), "{n} zero bytes");
        }
    }

    #[test]
    fn a_stretch_added_by_its_raw_crc_equals_hashing_it_after_the_gap() {
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 13 + 5) as u8).collect();
        let mut p = Part::new(10_000);
        p.add_raw(100, 1000, raw(&data[..1000]));
        p.add_raw(4000, 2000, raw(&data[1000..]));
        // The block with only those stretches and zeros elsewhere, hashed directly.
        let mut block = vec![0u8; 10_000];
        block[100..1100].copy_from_slice(&data[..1000]);
        block[4000..6000].copy_from_slice(&data[1000..]);
        assert_eq!(p.bytes(), 3000);
        assert_eq!(p.finish(), raw_update(0, &block));
    }

    proptest! {
        /// Any split of a block into stretches dealt to any number of ranks combines to
        /// the block's CRC; changing one byte of one part breaks it.
        #[test]
        fn parts_dealt_to_ranks_combine_to_the_crc(
            data in proptest::collection::vec(any::<u8>(), 1..5000),
            cuts in proptest::collection::vec(any::<u16>(), 0..20),
            owners in proptest::collection::vec(0usize..4, 21),
            flip in any::<u16>(),
        ) {
            let len = data.len();
            let mut bounds: Vec<usize> = cuts.iter().map(|c| *c as usize % len).collect();
            bounds.push(0);
            bounds.push(len);
            bounds.sort_unstable();
            bounds.dedup();
            let mut parts = [Part::new(len as u64); 4];
            for (i, w) in bounds.windows(2).enumerate() {
                parts[owners[i]].add(w[0] as u64, &data[w[0]..w[1]]);
            }
            prop_assert_eq!(parts.iter().map(|p| p.bytes()).sum::<u64>(), len as u64);
            let xor = parts.iter().fold(0, |x, p| x ^ p.finish());
            prop_assert_eq!(combine(xor, len as u64), crc32fast::hash(&data));

            let mut bad = data.clone();
            bad[flip as usize % len] ^= 1;
            let mut parts = [Part::new(len as u64); 4];
            for (i, w) in bounds.windows(2).enumerate() {
                parts[owners[i]].add(w[0] as u64, &bad[w[0]..w[1]]);
            }
            let xor = parts.iter().fold(0, |x, p| x ^ p.finish());
            prop_assert_ne!(combine(xor, len as u64), crc32fast::hash(&data));
        }
    }
}
