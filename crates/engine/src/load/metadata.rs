//! Stage 1: the metadata, read once per rank and validated once per job.

use dckpt_collective::Collective;
use dckpt_storage::Storage;

use crate::format::{META_NAME, Metadata, check_meta_bytes};
use crate::protocol::{COORDINATOR, agree, gather_decide};
use crate::{Error, ErrorKind, Result};

/// The whole metadata on every rank, for a caller that asks for it
/// ([`crate::Engine::read_metadata`]; a load reads it on the coordinator alone): the
/// coordinator validates it fully and shares its digest (length and CRC-32), against which
/// every other rank checks the bytes it read. Storage serves the file to every rank, so the
/// coordinator does not send it world-size times; decoding is all the others do. Every rank
/// returns the same outcome.
pub(crate) fn read_metadata(storage: &dyn Storage, coll: &dyn Collective) -> Result<Metadata> {
    let mut mine = None;
    let digest: Result<(u64, u32)> = gather_decide(coll, (), "metadata", |_| {
        fetch_metadata(storage)
            .map(|(bytes, meta)| {
                mine = Some(meta);
                digest(&bytes)
            })
            .map_err(|e| e.on_rank(COORDINATOR as u32))
    })?;
    let (len, crc) = digest?;
    let (meta, check) = match mine.map_or_else(|| fetch_matching(storage, len, crc), Ok) {
        Ok(meta) => (Some(meta), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree(coll, check, "metadata")?;
    Ok(meta.expect("agreed that every rank read the metadata"))
}

/// Length and CRC-32 of a metadata file, its CRC trailer left out: the CRC of bytes followed
/// by their own CRC is the same constant for every file.
pub(super) fn digest(bytes: &[u8]) -> (u64, u32) {
    (bytes.len() as u64, crc32fast::hash(&bytes[..bytes.len().saturating_sub(4)]))
}

/// The metadata as this rank reads it, if its bytes are the ones the coordinator validated.
pub(super) fn fetch_matching(storage: &dyn Storage, len: u64, crc: u32) -> Result<Metadata> {
    let location = storage.location(META_NAME);
    // The size first, so that a file that is no longer the one the coordinator validated
    // (and may now be of any size) is not read.
    let size = storage.size(META_NAME)?;
    let here = if size == len {
        let bytes = storage.get(META_NAME)?;
        let actual = digest(&bytes);
        if actual == (len, crc) {
            return Ok(Metadata::decode_unvalidated(&bytes, &location)?);
        }
        format!("{} bytes with crc32 {:08x}", actual.0, actual.1)
    } else {
        format!("{size} bytes")
    };
    Err(Error::from(ErrorKind::Checksum {
        file: location,
        offset: 0,
        detail: format!(
            "{here} here, {len} bytes with crc32 {crc:08x} on the coordinator: \
             the checkpoint changed during the load, or the ranks were given different locations"
        ),
    }))
}

/// Reads and fully validates the metadata on this process alone.
pub fn read_metadata_local(storage: &dyn Storage) -> Result<Metadata> {
    fetch_metadata(storage).map(|(_, m)| m)
}

pub(super) fn fetch_metadata(storage: &dyn Storage) -> Result<(bytes::Bytes, Metadata)> {
    let location = storage.location(META_NAME);
    let not_found = |e| match e {
        dckpt_storage::Error::NotFound { .. } => Error::from(ErrorKind::NotACheckpoint { location: location.clone() }),
        e => e.into(),
    };
    // The size before the bytes: an oversized (or sparse) file is refused without reading it.
    check_meta_bytes(storage.size(META_NAME).map_err(not_found)?, &location)?;
    let bytes = storage.get(META_NAME).map_err(not_found)?;
    let meta = Metadata::decode(&bytes, &location)?;
    Ok((bytes, meta))
}
