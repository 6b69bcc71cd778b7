//! The metadata a save commits, built from the plan and where each piece landed.

use crate::format::{
    ChunkMeta, ChunkView, FORMAT_VERSION, FileMeta, Metadata, MetadataView, ObjectEntry, ObjectMeta, SafetensorsEntry,
    TensorMeta, TensorView, encode_view,
};
use crate::plan::{SavePlan, file_order};

use super::write::*;
use super::*;

/// The metadata a save of `plan` would commit to a store whose objects are at most
/// `file_bytes_max` bytes (the store's `object_bytes_max` hint): data files laid out exactly as the
/// save lays them, block checksum lists sized but holding placeholders (headers and their
/// checksums are real: they need no data). For sizing and inspection without any data.
pub fn planned_metadata(plan: &SavePlan, opts: &SaveOptions, save_id: &str, file_bytes_max: Option<u64>) -> Metadata {
    let results = planned_results(plan, opts, save_id, file_bytes_max);
    build_metadata(opts, plan, save_id, results).expect("a plan's own layout is consistent")
}

/// The write results a save of `plan` would gather, checksums left zero.
pub(super) fn planned_results(
    plan: &SavePlan,
    opts: &SaveOptions,
    save_id: &str,
    file_bytes_max: Option<u64>,
) -> Vec<WriteResult> {
    let (chunk_pos, object_pos) = file_order(plan);
    let mut placed: Vec<Vec<(usize, SafetensorsEntry)>> = vec![Vec::new(); plan.ranks.len()];
    for (c, &k) in plan.chunks.iter().zip(&chunk_pos) {
        placed[c.writer as usize].push((k, tensor_entry(&c.key, &c.region, c.dtype, c.nbytes)));
    }
    for (o, &k) in plan.objects.iter().zip(&object_pos) {
        placed[o.writer as usize].push((k, object_entry(&o.key, &o.grid_offset, o.nbytes)));
    }
    placed
        .into_iter()
        .enumerate()
        .map(|(rank, mut p)| {
            p.sort_unstable_by_key(|e| e.0);
            let entries: Vec<SafetensorsEntry> = p.into_iter().map(|e| e.1).collect();
            let mut result = WriteResult::default();
            for (fi, file) in cut_files(&entries, save_id, rank, file_bytes_max).into_iter().enumerate() {
                let mut pos = file.header.len() as u64;
                for x in &entries[file.pieces.clone()] {
                    let crcs = 4 * crate::format::blocks_in(x.len, opts.block_bytes) as usize;
                    let len = result.crcs.len() + crcs;
                    result.crcs.resize(len, 0);
                    result.pieces.push(PieceWritten { file: fi as u32, at: pos, crcs_end: result.crcs.len() as u64 });
                    pos += x.len;
                }
                result.files.push(file.meta(pos, save_id, rank, fi));
            }
            result
        })
        .collect()
}

/// Where every planned chunk and object landed, from the ranks' write results.
pub(super) struct Placed {
    /// Every rank's files, in rank order.
    pub(super) files: Vec<FileMeta>,
    /// For each of the plan's chunks, where it landed.
    pub(super) chunks: Vec<Placement>,
    /// Each rank's checksums, from its write result.
    pub(super) crcs: Vec<serde_bytes::ByteBuf>,
    pub(super) objects: Vec<ObjectMeta>,
}

/// Where one planned piece landed.
#[derive(Clone, Debug)]
pub(super) struct Placement {
    /// Its file, as an index into [`Placed::files`].
    pub(super) file: u32,
    /// Its byte offset there.
    pub(super) at: u64,
    /// The rank that wrote it, whose checksums hold the piece's ...
    pub(super) writer: u32,
    /// ... in this range of them.
    pub(super) crcs: std::ops::Range<usize>,
}

impl Placed {
    /// The block checksums of a placed piece.
    pub(super) fn crc32(&self, p: &Placement) -> &[u8] {
        &self.crcs[p.writer as usize][p.crcs.clone()]
    }
}

pub(super) fn place_all(
    plan: &SavePlan,
    block_bytes: u64,
    results: Vec<WriteResult>,
) -> std::result::Result<Placed, String> {
    // Files in rank order; remember the index of each rank's first file.
    let mut files = Vec::new();
    let mut file_of = vec![0u32; results.len()];
    for (r, res) in results.iter().enumerate() {
        file_of[r] = files.len() as u32;
        files.extend(res.files.iter().cloned());
    }
    // Each chunk's position among its writer's pieces, as the writer laid them out.
    let (chunk_pos, object_pos) = file_order(plan);
    let place = |writer: u32, k: usize, nbytes: u64| -> std::result::Result<Placement, String> {
        let w = writer as usize;
        let r = results.get(w).ok_or_else(|| format!("no write result from rank {w}"))?;
        let &PieceWritten { file, at, crcs_end: end } =
            r.pieces.get(k).ok_or_else(|| format!("rank {w} reported fewer chunks than planned"))?;
        if file as usize >= r.files.len() {
            return Err(format!("rank {w} reported a chunk in its file {file} of {}", r.files.len()));
        }
        let start = if k == 0 { 0 } else { r.pieces[k - 1].crcs_end };
        if start > end || end > r.crcs.len() as u64 {
            return Err(format!("rank {w} reported checksums {start}..{end} of its {} bytes of them", r.crcs.len()));
        }
        let want = 4 * crate::format::blocks_in(nbytes, block_bytes);
        if end - start != want {
            return Err(format!(
                "rank {w} reported {} bytes of checksums for a piece of {nbytes} bytes, not {want}",
                end - start
            ));
        }
        Ok(Placement { file: file_of[w] + file, at, writer, crcs: start as usize..end as usize })
    };
    let chunks = plan
        .chunks
        .iter()
        .zip(&chunk_pos)
        .map(|(c, &k)| place(c.writer, k, c.nbytes))
        .collect::<std::result::Result<_, _>>()?;
    let mut objects: Vec<ObjectMeta> = Vec::new();
    for (o, &k) in plan.objects.iter().zip(&object_pos) {
        let Placement { file, at, writer, crcs } = place(o.writer, k, o.nbytes)?;
        let crc32 = results[writer as usize].crcs[crcs].to_vec();
        if objects.last().is_none_or(|m| m.key != o.key) {
            objects.push(ObjectMeta { key: o.key.to_string(), grid_shape: o.grid_shape.clone(), entries: Vec::new() });
        }
        let entry = ObjectEntry { grid_offset: o.grid_offset.clone(), file, at, len: o.nbytes, crc32 };
        objects.last_mut().expect("pushed").entries.push(entry);
    }
    let crcs = results.into_iter().map(|r| r.crcs).collect();
    Ok(Placed { files, chunks, crcs, objects })
}

/// Each declared tensor's run of the plan's chunks (both are in key order; a tensor without
/// elements has none).
pub(super) fn chunk_runs(plan: &SavePlan) -> std::result::Result<Vec<std::ops::Range<usize>>, String> {
    let mut next = 0;
    let runs = plan
        .tensors
        .iter()
        .map(|d| {
            let start = next;
            while plan.chunks.get(next).is_some_and(|c| c.key == d.key) {
                next += 1;
            }
            start..next
        })
        .collect();
    match plan.chunks.get(next) {
        None => Ok(runs),
        Some(c) => {
            Err(format!("the plan's chunk {:?} {} is not under a declared tensor in key order", c.key, c.region))
        }
    }
}

pub(super) fn writer_name() -> String {
    format!("dckpt {}", env!("CARGO_PKG_VERSION"))
}

/// Each declared tensor with its chunks and where they landed, borrowed from the plan: the
/// one pairing of declarations, chunks and placements that both the encoded metadata and
/// the [`Metadata`] value are made from.
pub(super) fn tensor_views<'a>(
    plan: &'a SavePlan,
    placed: &'a Placed,
) -> std::result::Result<
    impl ExactSizeIterator<Item = TensorView<'a, impl ExactSizeIterator<Item = ChunkView<'a>> + 'a>> + 'a,
    String,
> {
    let runs = chunk_runs(plan)?;
    Ok(plan.tensors.iter().zip(runs).map(|(d, run)| TensorView {
        key: &d.key,
        dtype: d.dtype,
        global_shape: &d.global_shape,
        chunks: plan.chunks[run.clone()].iter().zip(&placed.chunks[run]).map(|(c, p)| ChunkView {
            offset: &c.region.offset,
            shape: &c.region.shape,
            flat: c.region.flat.map(|f| [f.start, f.stop]),
            file: p.file,
            at: p.at,
            crc32: placed.crc32(p),
        }),
    }))
}

/// The metadata file a save commits: encoded straight from the plan and where its chunks
/// landed, the same bytes as [`build_metadata`]'s [`Metadata::encode`] without copying the
/// plan's keys and shapes (a save can hold hundreds of thousands of chunks).
pub(super) fn encode_metadata(
    opts: &SaveOptions,
    plan: &SavePlan,
    save_id: &str,
    placed: &Placed,
) -> std::result::Result<Vec<u8>, String> {
    let writer = writer_name();
    let view = MetadataView {
        save_id,
        writer: &writer,
        block_bytes: opts.block_bytes,
        layout: &opts.layout,
        files: &placed.files,
        tensors: tensor_views(plan, placed)?,
        objects: &placed.objects,
    };
    Ok(encode_view(FORMAT_VERSION, view, plan.chunks.len()))
}

/// The metadata a save commits, as a value (for [`planned_metadata`]).
pub(super) fn build_metadata(
    opts: &SaveOptions,
    plan: &SavePlan,
    save_id: &str,
    results: Vec<WriteResult>,
) -> std::result::Result<Metadata, String> {
    let placed = place_all(plan, opts.block_bytes, results)?;
    let tensors = tensor_views(plan, &placed)?
        .map(|t| TensorMeta {
            key: t.key.to_string(),
            dtype: t.dtype,
            global_shape: t.global_shape.into(),
            chunks: t
                .chunks
                .map(|c| ChunkMeta {
                    offset: c.offset.into(),
                    shape: c.shape.into(),
                    flat: c.flat,
                    file: c.file,
                    at: c.at,
                    crc32: c.crc32.to_vec(),
                })
                .collect(),
        })
        .collect();
    Ok(Metadata {
        format_version: FORMAT_VERSION,
        save_id: save_id.to_string(),
        writer: writer_name(),
        block_bytes: opts.block_bytes,
        layout: opts.layout.clone(),
        files: placed.files,
        tensors,
        objects: placed.objects,
    })
}

#[cfg(test)]
mod tests {
    use crate::plan::{LocalPlan, ObjectItem, plan_save};
    use dckpt_layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
    use dckpt_shard_spec::{DType, Region, ReplicaId};

    use super::*;

    /// The metadata a save commits is encoded from the plan without building a [`Metadata`];
    /// it must be byte for byte what encoding the value gives (replicas, flat regions, a
    /// tensor without elements, objects, one file per rank or several).
    #[test]
    fn a_save_encodes_the_bytes_of_its_metadata_value() {
        let c = ParallelConfig { tp: 2, pp: 2, ..Default::default() };
        let layout = Layout::new(c, 8).unwrap();
        let model =
            ReferenceModel::new(ModelSpec::preset("tiny").unwrap(), layout, OptimizerMode::Distributed).unwrap();
        let mut locals: Vec<LocalPlan> =
            (0..8).map(|r| LocalPlan { tensors: model.rank_state(r), objects: Vec::new() }).collect();
        assert!(locals.iter().flat_map(|l| &l.tensors).any(|t| t.region.flat.is_some()), "no flat region");
        locals[3].tensors.push(ShardedTensor {
            key: "a.empty".into(),
            dtype: DType::F32,
            global_shape: vec![0, 4].into(),
            region: Region::full(&[0, 4]),
            replica_id: ReplicaId::MAIN,
        });
        for (r, l) in locals.iter_mut().enumerate() {
            let object = |key: &str, grid_shape: Vec<u64>, grid_offset: Vec<u64>, main: bool| ObjectItem {
                object: ShardedObject {
                    key: key.into(),
                    grid_shape,
                    grid_offset,
                    replica_id: if main { ReplicaId::MAIN } else { ReplicaId::new(0, 0, 1) },
                },
                nbytes: 10 + r as u64,
                compared: true,
            };
            l.objects.push(object("rng", vec![8], vec![r as u64], true));
            l.objects.push(object("args", vec![], vec![], r == 0));
        }
        let opts = SaveOptions { layout: BTreeMap::from([("tp".into(), "2".into())]), ..SaveOptions::default() };
        let plan = plan_save(&locals, None, opts.assignment).unwrap();
        for max in [None, Some(3000)] {
            let results = planned_results(&plan, &opts, "0123456789abcdef", max);
            let placed = place_all(&plan, opts.block_bytes, results.clone()).unwrap();
            let value = build_metadata(&opts, &plan, "0123456789abcdef", results).unwrap();
            assert!(value.tensors.iter().any(|t| t.key == "a.empty" && t.chunks.is_empty()));
            assert_eq!(value.objects.len(), 2);
            let bytes = encode_metadata(&opts, &plan, "0123456789abcdef", &placed).unwrap();
            assert_eq!(bytes, value.encode(), "files of at most {max:?}");
            // Independently of the view both go through: the body is what the value's own
            // serde encoding writes.
            let body = &bytes[crate::format::META_PREFIX_BYTES..bytes.len() - 4];
            assert_eq!(body, &rmp_serde::to_vec_named(&value).unwrap()[..], "files of at most {max:?}");
        }
        // A chunk outside the declarations is refused, not dropped.
        let mut broken = plan.clone();
        broken.tensors.retain(|d| d.key != broken.chunks[0].key);
        let placed =
            place_all(&broken, opts.block_bytes, planned_results(&broken, &opts, "0123456789abcdef", None)).unwrap();
        let err = encode_metadata(&opts, &broken, "0123456789abcdef", &placed).unwrap_err();
        assert!(err.contains(&*broken.chunks[0].key), "{err}");
    }

    /// Write results arrive from other ranks: offsets into their checksums that run
    /// backwards, past the end, or cover the wrong number of blocks are refused, not sliced.
    #[test]
    fn write_results_with_bad_checksum_offsets_are_refused() {
        let t = |key: &str, n: u64| ShardedTensor {
            key: key.into(),
            dtype: DType::U8,
            global_shape: [n].into(),
            region: Region::full(&[n]),
            replica_id: ReplicaId::MAIN,
        };
        let opts = SaveOptions { block_bytes: 4, ..SaveOptions::default() };
        let local = LocalPlan { tensors: vec![t("a", 10), t("b", 3)], objects: Vec::new() };
        let plan = plan_save(&[local], None, opts.assignment).unwrap();
        let good = planned_results(&plan, &opts, "0123456789abcdef", None);
        assert_eq!(good[0].pieces.iter().map(|p| p.crcs_end).collect::<Vec<_>>(), [12, 16], "3 blocks, then 1");
        place_all(&plan, opts.block_bytes, good.clone()).unwrap();
        for (ends, crcs, why) in [
            ([12, 8], 16, "checksums 12..8"),
            ([12, 20], 16, "checksums 12..20 of its 16"),
            ([8, 16], 16, "8 bytes of checksums for a piece of 10 bytes, not 12"),
            ([12, 16], 12, "checksums 12..16 of its 12"),
        ] {
            let mut bad = good.clone();
            for (p, end) in bad[0].pieces.iter_mut().zip(ends) {
                p.crcs_end = end;
            }
            bad[0].crcs.truncate(crcs);
            let err = place_all(&plan, opts.block_bytes, bad).err().expect(why);
            assert!(err.contains(why), "{err}");
        }
    }
}
