//! Full verification of a stored checkpoint: structure, coverage, every checksum over
//! every byte, safetensors headers that agree with the metadata, and leftovers.

use std::collections::BTreeMap;

use dckpt_storage::{Storage, StorageExt};
use serde::Serialize;

use crate::Result;
use crate::format::{FileMeta, Metadata, block_crc, parse_data_file_name, parse_safetensors_header};
use crate::leftovers;
use crate::load::read_metadata_local;

/// Problems listed in full; more are counted.
const PROBLEMS_MAX: usize = 100;
/// Bytes verified per read.
const VERIFY_READ_BYTES: u64 = 32 << 20;

/// What [`verify`] found. `problems` empty means the checkpoint is sound.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// The id of the save that wrote the checkpoint.
    pub save_id: String,
    /// Data files the metadata names.
    pub files: usize,
    /// Global tensors stored.
    pub tensors: usize,
    /// Their stored chunks.
    pub chunks: usize,
    /// Stored objects (each place in each grid).
    pub objects: usize,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// What is wrong, one line each, the first 100.
    pub problems: Vec<String>,
    /// How many more were found and not listed.
    pub problems_more: usize,
    /// What lies under the root that the committed checkpoint does not name: data files of
    /// failed or replaced saves, unfinished writes of dead processes, other objects.
    pub leftovers: Vec<Leftover>,
}

impl VerifyReport {
    /// Whether the checkpoint is sound (leftovers beside it do not count).
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    fn problem(&mut self, p: String) {
        if self.problems.len() < PROBLEMS_MAX {
            self.problems.push(p);
        } else {
            self.problems_more += 1;
        }
    }
}

/// Verifies the checkpoint at the storage root. `progress` is called with the bytes
/// checked so far. Fails only when there is no checkpoint at all or the metadata is
/// unreadable; everything else is a problem in the report.
pub fn verify(storage: &dyn Storage, mut progress: impl FnMut(u64)) -> Result<VerifyReport> {
    let meta = read_metadata_local(storage)?;
    let mut r = VerifyReport {
        save_id: meta.save_id.clone(),
        files: meta.files.len(),
        tensors: meta.tensors.len(),
        chunks: meta.tensors.iter().map(|t| t.chunks.len()).sum(),
        objects: meta.objects.iter().map(|o| o.entries.len()).sum(),
        ..Default::default()
    };
    for (fi, f) in meta.files.iter().enumerate() {
        if let Err(e) = verify_file(storage, &meta, fi as u32, f, &mut r, &mut progress) {
            r.problem(format!("{}: {e}", f.name));
        }
    }
    match leftovers::list(storage, &meta) {
        Ok(found) => r.leftovers = found,
        Err(e) => r.problem(format!("listing the checkpoint: {e}")),
    }
    Ok(r)
}

fn verify_file(
    storage: &dyn Storage,
    meta: &Metadata,
    fi: u32,
    f: &FileMeta,
    r: &mut VerifyReport,
    progress: &mut impl FnMut(u64),
) -> Result<()> {
    let size = storage.size(&f.name)?;
    if size != f.bytes {
        r.problem(format!("{}: {size} bytes, the metadata says {}", f.name, f.bytes));
        return Ok(());
    }
    let header = storage.get_range(&f.name, 0..f.data_start)?;
    r.bytes_checked += header.len() as u64;
    let crc = crc32fast::hash(&header);
    if crc != f.header_crc32 {
        r.problem(format!("{}: header checksum {crc:08x}, stored {:08x}", f.name, f.header_crc32));
    } else if let Err(p) = check_header(meta, fi, f, &header) {
        r.problem(format!("{}: safetensors header: {p}", f.name));
    }
    // Every byte of the data section belongs to one piece (the metadata proves the tiling);
    // verify each piece's blocks, reading at most VERIFY_READ_BYTES at a time.
    let block = meta.block_bytes;
    let window = (VERIFY_READ_BYTES / block).max(1) * block;
    let mut buf = Vec::new();
    for (name, at, len, crcs) in pieces_of(meta, fi) {
        let mut lo = 0;
        while lo < len {
            let hi = (lo + window).min(len);
            buf.resize((hi - lo) as usize, 0);
            storage.read_into(&f.name, &mut [(at + lo, &mut buf[..])])?;
            for (k, piece) in buf.chunks(block as usize).enumerate() {
                let b = lo / block + k as u64;
                let actual = crc32fast::hash(piece);
                if block_crc(crcs, b) != Some(actual) {
                    let start = at + b * block;
                    r.problem(format!(
                        "{}: {name}: block {b} (file bytes {start}..{}) fails its checksum",
                        f.name,
                        start + piece.len() as u64
                    ));
                }
            }
            r.bytes_checked += hi - lo;
            progress(r.bytes_checked);
            lo = hi;
        }
    }
    Ok(())
}

/// The chunks and objects stored in file `fi`: (name, byte offset, length, checksums).
fn pieces_of(meta: &Metadata, fi: u32) -> Vec<(String, u64, u64, &[u8])> {
    let mut out: Vec<(String, u64, u64, &[u8])> = Vec::new();
    for t in &meta.tensors {
        for c in t.chunks.iter().filter(|c| c.file == fi) {
            let region = c.region();
            out.push((format!("tensor {:?} {region}", t.key), c.at, region.numel() * t.dtype.size(), &c.crc32));
        }
    }
    for o in &meta.objects {
        for e in o.entries.iter().filter(|e| e.file == fi) {
            out.push((format!("object {:?} {:?}", o.key, e.grid_offset), e.at, e.len, &e.crc32));
        }
    }
    out.sort_unstable_by_key(|p| p.1);
    out
}

/// The safetensors header must describe exactly the metadata's chunks of this file.
fn check_header(meta: &Metadata, fi: u32, f: &FileMeta, header: &[u8]) -> std::result::Result<(), String> {
    let n = header.get(..8).ok_or("shorter than 8 bytes")?;
    let len = u64::from_le_bytes(n.try_into().map_err(|_| "length")?);
    if len.checked_add(8) != Some(f.data_start) {
        return Err(format!("declares {len} header bytes, the metadata says {}", f.data_start - 8));
    }
    let parsed = parse_safetensors_header(header, &f.name).map_err(|e| format!("{}: {}", e.field(), e.kind()))?;
    check_header_metadata(meta, f, &parsed.metadata)?;
    let mut declared: Vec<(u64, u64)> = parsed.entries.iter().map(|e| (e.data_offsets[0], e.data_offsets[1])).collect();
    let mut expected: Vec<(u64, u64)> = meta
        .tensors
        .iter()
        .flat_map(|t| {
            t.chunks.iter().filter(|c| c.file == fi).map(move |c| (c.at, c.region().numel() * t.dtype.size()))
        })
        .chain(meta.objects.iter().flat_map(|o| o.entries.iter().filter(|e| e.file == fi).map(|e| (e.at, e.len))))
        .map(|(at, len)| (at - f.data_start, at - f.data_start + len))
        .collect();
    declared.sort_unstable();
    expected.sort_unstable();
    if declared != expected {
        return Err(format!(
            "{} entries do not match the metadata's {} chunks of this file",
            declared.len(),
            expected.len()
        ));
    }
    Ok(())
}

/// The header's `__metadata__` must say whose file it is: dckpt's, of this save, written by
/// the rank the file's name gives. A file of another save renamed into this one's place, with
/// a metadata file crafted to fit it, fails here.
fn check_header_metadata(
    meta: &Metadata,
    f: &FileMeta,
    fields: &BTreeMap<String, String>,
) -> std::result::Result<(), String> {
    let field = |name: &str| fields.get(name).map(String::as_str);
    if field("format") != Some("dckpt") {
        return Err(format!("__metadata__.format is {:?}, not \"dckpt\"", field("format")));
    }
    if field("save_id") != Some(meta.save_id.as_str()) {
        return Err(format!(
            "__metadata__.save_id is {:?}, not this checkpoint's {:?}",
            field("save_id"),
            meta.save_id
        ));
    }
    // Validation held every name to the data file pattern; the header writes the rank bare.
    let rank = parse_data_file_name(&f.name).map(|d| d.rank.to_string());
    if field("rank") != rank.as_deref() {
        return Err(format!("__metadata__.rank is {:?}, not the rank {:?} the file's name gives", field("rank"), rank));
    }
    Ok(())
}

/// Whether `name` is a data file name dckpt makes (the format's rule, here for the callers
/// of [`remove_leftovers`]).
pub use crate::format::is_data_file_name;
pub use crate::leftovers::{Leftover, LeftoverKind, remove_leftovers, remove_unfinished_writes, unfinished_writes};
