//! Block checksums: a piece's bytes cut into `block_bytes` blocks counted from its first
//! byte, the last one possibly short, one CRC-32 per block, stored as little-endian `u32`s.

/// The CRC-32 of block `i` in a little-endian list of them, `None` past its end.
pub fn block_crc(crcs: &[u8], i: u64) -> Option<u32> {
    let at = usize::try_from(i).ok()?.checked_mul(4)?;
    let b = crcs.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Number of `block` blocks in `len` bytes (a block of 0 counts as 1).
pub fn blocks_in(len: u64, block: u64) -> u64 {
    len.div_ceil(block.max(1))
}

/// CRC-32 per fixed-size block of a byte stream fed in pieces of any size.
#[derive(Debug)]
pub struct BlockCrc {
    block_bytes: u64,
    filled: u64,
    hasher: crc32fast::Hasher,
    crcs: Vec<u8>,
}

impl BlockCrc {
    /// A stream cut into blocks of `block_bytes`; 0 counts as 1, as in [`blocks_in`] (a
    /// block of nothing would never fill).
    pub fn new(block_bytes: u64) -> BlockCrc {
        BlockCrc { block_bytes: block_bytes.max(1), filled: 0, hasher: crc32fast::Hasher::new(), crcs: Vec::new() }
    }

    /// Feeds the next bytes of the stream.
    pub fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            // What is left of the block; it fits `usize` when the data does.
            let room = usize::try_from(self.block_bytes - self.filled).unwrap_or(usize::MAX);
            let (now, rest) = data.split_at(room.min(data.len()));
            self.hasher.update(now);
            self.filled += now.len() as u64;
            data = rest;
            if self.filled == self.block_bytes {
                let h = std::mem::take(&mut self.hasher);
                self.crcs.extend_from_slice(&h.finalize().to_le_bytes());
                self.filled = 0;
            }
        }
    }

    /// The CRCs of every block, the last one possibly short, as little-endian u32s, appended
    /// to `out` (so the pieces of a file share one buffer).
    pub fn finish_into(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.crcs);
        if self.filled > 0 {
            out.extend_from_slice(&self.hasher.finalize().to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_crcs_match_a_one_shot_crc_per_block() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut b = BlockCrc::new(64);
        for piece in data.chunks(37) {
            b.update(piece);
        }
        let mut out = vec![9; 4];
        b.finish_into(&mut out);
        assert_eq!(out[..4], [9; 4], "appended after what was there");
        let crcs = &out[4..];
        assert_eq!(crcs.len() as u64, 4 * blocks_in(1000, 64));
        for (i, block) in data.chunks(64).enumerate() {
            assert_eq!(block_crc(crcs, i as u64), Some(crc32fast::hash(block)));
        }
        assert_eq!(block_crc(crcs, 16), None);
        assert_eq!(block_crc(crcs, u64::MAX), None);
    }

    #[test]
    fn a_stream_of_whole_blocks_has_no_short_one() {
        let mut b = BlockCrc::new(4);
        b.update(&[1; 8]);
        let mut out = Vec::new();
        b.finish_into(&mut out);
        assert_eq!(out.len(), 8);
        let mut out = Vec::new();
        BlockCrc::new(4).finish_into(&mut out);
        assert!(out.is_empty(), "an empty piece has no blocks");
        assert_eq!(blocks_in(0, 4), 0);
        assert_eq!(blocks_in(9, 0), 9);
    }
}
