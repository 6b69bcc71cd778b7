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
    let by_file = pieces_by_file(&meta);
    for (f, pieces) in meta.files.iter().zip(&by_file) {
        if let Err(e) = verify_file(storage, &meta, f, pieces, &mut r, &mut progress) {
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
    f: &FileMeta,
    pieces: &[Stored<'_>],
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
    } else if let Err(p) = check_header(meta, f, pieces, &header) {
        r.problem(format!("{}: safetensors header: {p}", f.name));
    }
    // Every byte of the data section belongs to one piece (the metadata proves the tiling);
    // verify each piece's blocks, reading at most VERIFY_READ_BYTES at a time.
    let block = meta.block_bytes;
    let window = (VERIFY_READ_BYTES / block).max(1) * block;
    let mut buf = Vec::new();
    for &Stored { at, len, crcs, what } in pieces {
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
                        "{}: {}: block {b} (file bytes {start}..{}) fails its checksum",
                        f.name,
                        what.name(meta),
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

/// A stored chunk or object entry: where its bytes lie in its file, its checksums, and
/// which it is (named only in a problem).
#[derive(Clone, Copy)]
struct Stored<'m> {
    at: u64,
    len: u64,
    crcs: &'m [u8],
    what: What,
}

/// A chunk (tensor, chunk) or an object entry (object, entry) of the metadata.
#[derive(Clone, Copy)]
enum What {
    Chunk(usize, usize),
    Entry(usize, usize),
}

impl What {
    fn name(self, meta: &Metadata) -> String {
        match self {
            What::Chunk(t, c) => format!("tensor {:?} {}", meta.tensors[t].key, meta.tensors[t].chunks[c].region()),
            What::Entry(o, e) => {
                format!("object {:?} {:?}", meta.objects[o].key, meta.objects[o].entries[e].grid_offset)
            }
        }
    }
}

/// Every file's pieces in file order, from one pass over the metadata (a pass for each
/// file made verify files x chunks: minutes at 16,384 files).
fn pieces_by_file(meta: &Metadata) -> Vec<Vec<Stored<'_>>> {
    let mut out: Vec<Vec<Stored<'_>>> = vec![Vec::new(); meta.files.len()];
    for (ti, t) in meta.tensors.iter().enumerate() {
        for (ci, c) in t.chunks.iter().enumerate() {
            let len = c.region().numel() * t.dtype.size();
            let piece = Stored { at: c.at, len, crcs: &c.crc32, what: What::Chunk(ti, ci) };
            if let Some(v) = out.get_mut(c.file as usize) {
                v.push(piece);
            }
        }
    }
    for (oi, o) in meta.objects.iter().enumerate() {
        for (ei, e) in o.entries.iter().enumerate() {
            let piece = Stored { at: e.at, len: e.len, crcs: &e.crc32, what: What::Entry(oi, ei) };
            if let Some(v) = out.get_mut(e.file as usize) {
                v.push(piece);
            }
        }
    }
    for v in &mut out {
        v.sort_unstable_by_key(|p| p.at);
    }
    out
}

/// The safetensors header must describe exactly the metadata's chunks of this file.
fn check_header(
    meta: &Metadata,
    f: &FileMeta,
    pieces: &[Stored<'_>],
    header: &[u8],
) -> std::result::Result<(), String> {
    let n = header.get(..8).ok_or("shorter than 8 bytes")?;
    let len = u64::from_le_bytes(n.try_into().map_err(|_| "length")?);
    if len.checked_add(8) != Some(f.data_start) {
        return Err(format!("declares {len} header bytes, the metadata says {}", f.data_start - 8));
    }
    let parsed = parse_safetensors_header(header, &f.name).map_err(|e| format!("{}: {}", e.field(), e.kind()))?;
    check_header_metadata(meta, f, &parsed.metadata)?;
    let mut declared: Vec<(u64, u64)> = parsed.entries.iter().map(|e| (e.data_offsets[0], e.data_offsets[1])).collect();
    let mut expected: Vec<(u64, u64)> =
        pieces.iter().map(|p| (p.at - f.data_start, p.at - f.data_start + p.len)).collect();
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
