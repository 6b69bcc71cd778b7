//! The semantic checks of a decoded metadata file (`docs/format.md`, section 4, items 8 to
//! 17): everything a reader must refuse although it decodes.

use std::collections::HashSet;

use dckpt_shard_spec::{
    Dims, Key, ObjectPiece, Region, ShardedObject, ShardedTensor, TensorPiece, checked_numel, numel, validate,
};

use crate::checksum::blocks_in;
use crate::error::{FormatError, FormatErrorKind};
use crate::grid::{Cover, grid_cover};
use crate::meta::{BLOCK_BYTES_MAX, Metadata, TensorMeta};
use crate::names::{META_NAME, SAVE_ID_DIGITS, check_plain_name, is_save_id, parse_data_file_name};

impl Metadata {
    /// Semantic checks: plain unique file names, sane sizes, every chunk and object inside
    /// its file's data section, and exact-once coverage of every tensor.
    pub fn validate(&self, file: &str) -> Result<(), FormatError> {
        self.check_block_and_id(file)?;
        self.check_files(file)?;
        check_key_order(file, "tensors", self.tensors.iter().map(|t| t.key.as_str()))?;
        check_key_order(file, "objects", self.objects.iter().map(|o| o.key.as_str()))?;
        let spans = self.piece_spans(file)?;
        self.check_tiling(file, spans)?;
        for (ti, t) in self.tensors.iter().enumerate() {
            self.check_tensor_coverage(file, ti, t)?;
        }
        self.check_object_coverage(file)
    }

    /// The checksum block's size is within bounds, and the save id has its shape.
    fn check_block_and_id(&self, file: &str) -> Result<(), FormatError> {
        if self.block_bytes == 0 {
            return Err(FormatError::invalid(file, "block_bytes", format!("0 is outside 1..={BLOCK_BYTES_MAX}")));
        }
        if self.block_bytes > BLOCK_BYTES_MAX {
            let kind = FormatErrorKind::LimitExceeded {
                what: "bytes per block".into(),
                found: self.block_bytes,
                limit: BLOCK_BYTES_MAX,
            };
            return Err(FormatError::new(file, "block_bytes", kind));
        }
        if !is_save_id(&self.save_id) {
            return Err(FormatError::invalid(
                file,
                "save_id",
                format!("{:?} is not {SAVE_ID_DIGITS} lower-case hexadecimal digits", self.save_id),
            ));
        }
        Ok(())
    }

    /// Each file's name is a data file name of this save, unique, in rank order, and its
    /// data section starts within the file, past the 8 bytes of its header length.
    fn check_files(&self, file: &str) -> Result<(), FormatError> {
        let mut names = HashSet::new();
        // (rank, number) of the file before: files come in rank order, each rank's numbered
        // from 0 up, so a data file's name says which rank wrote it and where it is listed.
        let mut prev: Option<(u64, u64)> = None;
        for (i, f) in self.files.iter().enumerate() {
            let field = |n: &str| format!("files[{i}].{n}");
            check_plain_name(&f.name).map_err(|d| FormatError::invalid(file, field("name"), d))?;
            if f.name == META_NAME || !names.insert(f.name.as_str()) {
                return Err(FormatError::invalid(file, field("name"), format!("{:?} is used twice", f.name)));
            }
            let Some(d) = parse_data_file_name(&f.name) else {
                return Err(FormatError::invalid(
                    file,
                    field("name"),
                    format!(
                        "{:?} is not a data file name (<save_id>-<rank>.safetensors or <save_id>-<rank>.<n>.safetensors)",
                        f.name
                    ),
                ));
            };
            if d.save_id != self.save_id {
                return Err(FormatError::invalid(
                    file,
                    field("name"),
                    format!("{:?} belongs to save {}, not to this checkpoint's {}", f.name, d.save_id, self.save_id),
                ));
            }
            let follows = match prev {
                None => d.file == 0,
                Some((rank, n)) => (d.rank == rank && d.file == n + 1) || (d.rank > rank && d.file == 0),
            };
            if !follows {
                let after = prev.map_or("the start of the list".to_string(), |(r, n)| format!("rank {r}'s file {n}"));
                return Err(FormatError::invalid(
                    file,
                    field("name"),
                    format!(
                        "{:?} (rank {}, file {}) cannot follow {after}: files are listed in rank order, each rank's from its file 0 up",
                        f.name, d.rank, d.file
                    ),
                ));
            }
            prev = Some((d.rank, d.file));
            // The header's length is safetensors' own bound: a load sizes buffers by it
            // (a header read whole), so a small metadata file could ask for terabytes.
            let most = f.bytes.min(8 + crate::safetensors::SAFETENSORS_HEADER_BYTES_MAX);
            if f.data_start < 8 || f.data_start > most {
                return Err(FormatError::invalid(
                    file,
                    field("data_start"),
                    format!("{} is outside 8..={most}", f.data_start),
                ));
            }
        }
        Ok(())
    }

    /// Every chunk inside its tensor and its file, every object entry inside its file, and
    /// no listed tensor or object without pieces; returns each piece's `(file, at, len)`.
    fn piece_spans(&self, file: &str) -> Result<Vec<(u32, u64, u64)>, FormatError> {
        // Every byte of every data section belongs to exactly one checksummed piece.
        // Reserved exactly: this list is one of the few things validation holds per chunk.
        let pieces = self.tensors.iter().map(|t| t.chunks.len()).chain(self.objects.iter().map(|o| o.entries.len()));
        let mut spans: Vec<(u32, u64, u64)> = Vec::with_capacity(pieces.sum());
        // One region, refilled for each chunk.
        let mut region = Region { offset: Dims::new(), shape: Dims::new(), flat: None };
        for (ti, t) in self.tensors.iter().enumerate() {
            // Coverage below only sees keys that have chunks; a listed tensor without any
            // would load as zeros.
            if t.chunks.is_empty() && numel(&t.global_shape) != 0 {
                return Err(FormatError::invalid(
                    file,
                    format!("tensors[{ti}] ({}).chunks", t.key),
                    format!("none stored for a tensor of shape {:?}", t.global_shape),
                ));
            }
            for (ci, c) in t.chunks.iter().enumerate() {
                // Named only when something is wrong: this loop runs once per stored chunk.
                let field = || format!("tensors[{ti}] ({}).chunks[{ci}]", t.key);
                c.region_into(&mut region);
                region.check(&t.global_shape).map_err(|e| FormatError::invalid(file, field(), e.to_string()))?;
                let len = region
                    .numel()
                    .checked_mul(t.dtype.size())
                    .ok_or_else(|| FormatError::invalid(file, field(), "size overflows"))?;
                self.check_span(file, field, c.file, c.at, len, &c.crc32)?;
                spans.push((c.file, c.at, len));
            }
        }
        for (oi, o) in self.objects.iter().enumerate() {
            if o.entries.is_empty() && numel(&o.grid_shape) != 0 {
                return Err(FormatError::invalid(
                    file,
                    format!("objects[{oi}] ({}).entries", o.key),
                    format!("none stored for a grid of shape {:?}", o.grid_shape),
                ));
            }
            for (ei, e) in o.entries.iter().enumerate() {
                let field = || format!("objects[{oi}] ({}).entries[{ei}]", o.key);
                self.check_span(file, field, e.file, e.at, e.len, &e.crc32)?;
                spans.push((e.file, e.at, e.len));
            }
        }
        Ok(spans)
    }

    /// Exact-once coverage of every object's grid by its entries.
    fn check_object_coverage(&self, file: &str) -> Result<(), FormatError> {
        // Objects key by key, so that what the check builds is one key's at a time. The
        // stored pieces are all main replicas; "ranks" here are file indices.
        let mut objects: Vec<ShardedObject> = Vec::new();
        for o in &self.objects {
            let key = Key::new(&o.key);
            objects.clear();
            objects.extend(o.entries.iter().map(|e| ShardedObject {
                key: key.clone(),
                grid_shape: o.grid_shape.clone(),
                grid_offset: e.grid_offset.clone(),
                replica_id: Default::default(),
            }));
            let op: Vec<ObjectPiece> =
                objects.iter().zip(&o.entries).map(|(ob, e)| ObjectPiece { rank: e.file, object: ob }).collect();
            validate(&[], &op, None).map_err(|e| {
                FormatError::invalid(file, "coverage", format!("stored objects (ranks are file indices): {e}"))
            })?;
        }
        Ok(())
    }

    /// Exact-once coverage of tensor `ti` by its chunks: decided on the grid of its chunks'
    /// boxes where it can be, by the general check of shard-spec, on this tensor's chunks
    /// alone, where it cannot (irregular boxes, flat ranges that straddle them).
    fn check_tensor_coverage(&self, file: &str, ti: usize, t: &TensorMeta) -> Result<(), FormatError> {
        if t.chunks.len() == 1 && checked_numel(&t.global_shape) == Some(t.chunks[0].region().numel()) {
            // One chunk holding every element: exactly once by itself.
            return Ok(());
        }
        match grid_cover(&t.global_shape, &t.chunks) {
            Cover::Exact => return Ok(()),
            Cover::Wrong(why) => {
                return Err(FormatError::invalid(file, format!("tensors[{ti}] ({}).coverage", t.key), why));
            }
            Cover::Undecided => {}
        }
        let key = Key::new(&t.key);
        let pieces: Vec<ShardedTensor> = t
            .chunks
            .iter()
            .map(|c| ShardedTensor {
                key: key.clone(),
                dtype: t.dtype,
                global_shape: t.global_shape.clone(),
                region: c.region(),
                replica_id: Default::default(),
            })
            .collect();
        let tp: Vec<TensorPiece> =
            pieces.iter().zip(&t.chunks).map(|(p, c)| TensorPiece { rank: c.file, tensor: p }).collect();
        validate(&tp, &[], None).map_err(|e| {
            FormatError::invalid(file, "coverage", format!("stored chunks (ranks are file indices): {e}"))
        })?;
        Ok(())
    }

    /// The pieces of each file, sorted, must run back to back from `data_start` to the end.
    fn check_tiling(&self, file: &str, mut spans: Vec<(u32, u64, u64)>) -> Result<(), FormatError> {
        spans.retain(|s| s.2 > 0);
        spans.sort_unstable();
        let mut next: Vec<u64> = self.files.iter().map(|f| f.data_start).collect();
        for (fi, at, len) in spans {
            let f = &self.files[fi as usize];
            if at != next[fi as usize] {
                let what =
                    if at < next[fi as usize] { "overlaps the previous piece" } else { "leaves a gap before it" };
                return Err(FormatError::invalid(
                    file,
                    format!("files[{fi}] ({})", f.name),
                    format!("the piece at byte {at} {what}"),
                ));
            }
            next[fi as usize] = at + len;
        }
        for (fi, f) in self.files.iter().enumerate() {
            if next[fi] != f.bytes {
                return Err(FormatError::invalid(
                    file,
                    format!("files[{fi}] ({})", f.name),
                    format!("pieces end at byte {} but the file has {}", next[fi], f.bytes),
                ));
            }
        }
        Ok(())
    }

    fn check_span(
        &self,
        file: &str,
        field: impl Fn() -> String,
        fi: u32,
        at: u64,
        len: u64,
        crcs: &[u8],
    ) -> Result<(), FormatError> {
        let blocks = blocks_in(len, self.block_bytes);
        if crcs.len() as u64 != blocks.saturating_mul(4) {
            return Err(FormatError::invalid(
                file,
                format!("{}.crc32", field()),
                format!("{} bytes for {blocks} blocks", crcs.len()),
            ));
        }
        let f = self.files.get(fi as usize).ok_or_else(|| {
            FormatError::invalid(file, format!("{}.file", field()), format!("file index {fi} of {}", self.files.len()))
        })?;
        let end = at
            .checked_add(len)
            .ok_or_else(|| FormatError::invalid(file, format!("{}.at", field()), "offset overflows"))?;
        if at < f.data_start || end > f.bytes {
            return Err(FormatError::invalid(
                file,
                format!("{}.at", field()),
                format!("bytes {at}..{end} are outside the data section {}..{} of {}", f.data_start, f.bytes, f.name),
            ));
        }
        Ok(())
    }
}

/// The keys of `list` (`tensors` or `objects`) sorted and unique: each after the one before.
fn check_key_order<'a>(file: &str, list: &str, keys: impl Iterator<Item = &'a str>) -> Result<(), FormatError> {
    let mut prev: Option<&str> = None;
    for (i, key) in keys.enumerate() {
        if let Some(p) = prev
            && p >= key
        {
            let what = if p == key {
                "appears twice".to_string()
            } else {
                format!("is out of order ({list} are sorted by key)")
            };
            return Err(FormatError::invalid(file, format!("{list}[{i}].key"), format!("{key:?} {what}")));
        }
        prev = Some(key);
    }
    Ok(())
}
