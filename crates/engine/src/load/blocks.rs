//! Checksums of what was read: a data file's length and header, and its blocks.

use dckpt_storage::ObjectReader;

use super::overlay::Overlay;

use crate::format::{FileMeta, block_crc};
use crate::{Error, ErrorKind, Result};

/// Reads of one data file, opened with the length the metadata records, so that a load
/// asks the store for no size (on S3 a HEAD per file and rank): a file of another length
/// fails the load as damage by its first read at the latest (local disk and memory when it
/// is opened, an object store from the first answer, which carries the object's size).
pub(super) struct FileReader<'a> {
    inner: Box<dyn ObjectReader + 'a>,
    file: &'a FileMeta,
}

impl<'a> FileReader<'a> {
    pub(super) fn open(storage: &'a Overlay<'_>, file: &'a FileMeta) -> Result<FileReader<'a>> {
        let inner = storage.reader_sized(&file.name, file.bytes).map_err(|e| damage(file, e))?;
        Ok(FileReader { inner, file })
    }

    pub(super) fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.inner.read_into(reads).map_err(|e| damage(self.file, e))
    }

    /// [`ObjectReader::read_into_inspected`].
    pub(super) fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.inner.read_into_inspected(reads, inspect).map_err(|e| damage(self.file, e))
    }

    /// [`ObjectReader::read_picked_inspected`].
    pub(super) fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        self.inner.read_picked_inspected(range, picks, inspect).map_err(|e| damage(self.file, e))
    }
}

/// A file whose length is not the recorded one is damage in it; any other failure is the
/// store's.
fn damage(f: &FileMeta, e: dckpt_storage::Error) -> Error {
    match e {
        dckpt_storage::Error::SizeMismatch { size, .. } => Error::from(ErrorKind::Checksum {
            file: f.name.clone(),
            offset: size.min(f.bytes),
            detail: format!("the file has {size} bytes, the metadata records {}", f.bytes),
        }),
        e => Error::from(e),
    }
}

/// The header of a data file, as read, must match its checksum.
pub(super) fn verify_header(f: &FileMeta, header: &[u8]) -> Result<()> {
    let crc = crc32fast::hash(header);
    if crc != f.header_crc32 {
        return Err(Error::from(ErrorKind::Checksum {
            file: f.name.clone(),
            offset: 0,
            detail: format!("header: stored crc32 {:08x}, computed {crc:08x}", f.header_crc32),
        }));
    }
    Ok(())
}

/// Verifies `buf`, which holds a piece's blocks from `first_block` on (read at file byte
/// `at`), against the piece's stored block checksums.
pub(super) fn verify_blocks(file: &str, at: u64, crcs: &[u8], block: u64, first_block: u64, buf: &[u8]) -> Result<()> {
    let mut check = BlockCheck::new(file, at, crcs, block, first_block);
    check.update(buf)?;
    check.finish()
}

/// Checks a piece's bytes from the start of its block `first_block` on (file byte `at`),
/// given in order a slice at a time, against the piece's stored block checksums: each block
/// as soon as its last byte is in, a short last block at [`BlockCheck::finish`].
pub(super) struct BlockCheck<'c> {
    pub(super) file: &'c str,
    pub(super) at: u64,
    pub(super) crcs: &'c [u8],
    pub(super) block: u64,
    pub(super) first_block: u64,
    /// Blocks checked so far.
    pub(super) done: u64,
    /// Bytes of the current block hashed so far.
    pub(super) filled: u64,
    pub(super) hasher: crc32fast::Hasher,
}

impl<'c> BlockCheck<'c> {
    pub(super) fn new(file: &'c str, at: u64, crcs: &'c [u8], block: u64, first_block: u64) -> BlockCheck<'c> {
        BlockCheck { file, at, crcs, block, first_block, done: 0, filled: 0, hasher: crc32fast::Hasher::new() }
    }

    pub(super) fn update(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let n = ((self.block - self.filled) as usize).min(data.len());
            self.hasher.update(&data[..n]);
            self.filled += n as u64;
            data = &data[n..];
            if self.filled == self.block {
                self.check()?;
            }
        }
        Ok(())
    }

    /// Checks the block hashed so far.
    pub(super) fn check(&mut self) -> Result<()> {
        let b = self.first_block + self.done;
        let offset = self.at + self.done * self.block;
        let actual = std::mem::take(&mut self.hasher).finalize();
        let bytes = std::mem::take(&mut self.filled);
        self.done += 1;
        let Some(stored) = block_crc(self.crcs, b) else {
            return Err(Error::from(ErrorKind::Checksum {
                file: self.file.to_string(),
                offset,
                detail: format!("no checksum for block {b}"),
            }));
        };
        if stored != actual {
            return Err(Error::from(ErrorKind::Checksum {
                file: self.file.to_string(),
                offset,
                detail: format!("{bytes} bytes: stored crc32 {stored:08x}, computed {actual:08x}"),
            }));
        }
        Ok(())
    }

    /// Checks the last, short block, if any.
    pub(super) fn finish(mut self) -> Result<()> {
        if self.filled > 0 { self.check() } else { Ok(()) }
    }
}
