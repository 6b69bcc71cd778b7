//! `torch_dist_to_dckpt` and `dckpt_to_torch_dist` on the fixtures PyTorch and Megatron
//! wrote: every tensor loads bit-exact through the engine after the conversion to dckpt,
//! every object keeps its bytes, and the way back is a checkpoint this crate's reader and
//! validator accept with the same values. The PyTorch and Megatron readers of the way back
//! are `python/tests/test_convert.py`'s.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use bytes::Bytes;
use dckpt::storage::{Storage, StorageExt};
use dckpt_convert::torch_dist::{
    COMMON_OBJECT, Checkpoint, DATA_FILE, dckpt_to_torch_dist, read_chunk, torch_dist_to_dckpt, validate,
};
use dckpt_convert::{ConvertError, DckptSource, TensorSource};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torch").join(name)
}

fn open(name: &str) -> Arc<dyn Storage> {
    dckpt::storage::open(fixture(name).to_str().unwrap()).unwrap()
}

fn memory(name: &str) -> Arc<dyn Storage> {
    dckpt::storage::open(&format!("memory://{name}-{}", std::process::id())).unwrap()
}

fn expected(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("expected.json")).unwrap()).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// A copy of a fixture in memory, to damage.
fn copy(name: &str) -> Arc<dyn Storage> {
    let src = open(name);
    let dst = memory(&format!("copy-{name}"));
    for o in src.list("").unwrap() {
        dst.put(&o.path, src.get(&o.path).unwrap()).unwrap();
    }
    dst
}

const FIXTURES: [&str; 4] = ["dcp-2.15", "dcp-2.3", "megatron-0.16.1", "etp-ok"];

#[test]
fn every_fixture_converted_to_dckpt_loads_bit_exact_through_the_engine() {
    for name in FIXTURES {
        let src = open(name);
        let ckpt = Checkpoint::open(src.as_ref()).unwrap();
        let dst = memory(&format!("to-dckpt-{name}"));
        let read = AtomicU64::new(0);
        let report = torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &read).unwrap();
        let exp = expected(name);
        let tensors = exp["tensors"].as_object().unwrap();
        assert_eq!(report.tensors, tensors.len(), "{name}");
        let want_bytes: usize = tensors.values().map(|e| e["hex"].as_str().unwrap().len() / 2).sum();
        assert_eq!(read.load(std::sync::atomic::Ordering::Relaxed), want_bytes as u64, "{name}: every byte read once");
        let source = DckptSource::open(dst.clone()).unwrap();
        for (key, e) in tensors {
            let want = unhex(e["hex"].as_str().unwrap());
            let mut got = vec![0u8; want.len()];
            source.read_range(key, 0, &mut got).unwrap();
            assert_eq!(got, want, "{name}: {key}");
        }
        // Every bytes item is an object of its bytes; Megatron's common state one more.
        let objects = source.stored_objects();
        let common = ckpt.common_bytes.is_some();
        assert_eq!(objects.len(), ckpt.objects().count() + usize::from(common), "{name}: {objects:?}");
        for key in ckpt.objects() {
            let info = ckpt.item(key, None).unwrap();
            let raw = src.get_range(&info.relative_path, info.offset..info.offset + info.length).unwrap();
            let (k, shape, offset) = match dckpt_convert::torch_dist::sharded_object(key) {
                Some(s) => (s.key, s.shape, s.offset),
                None => (key.to_string(), vec![], vec![]),
            };
            assert_eq!(source.read_object(&k, &shape, &offset).unwrap(), raw.to_vec(), "{name}: object {key}");
        }
        if common {
            assert_eq!(source.read_object(COMMON_OBJECT, &[], &[]).unwrap(), src.get("common.pt").unwrap().to_vec());
        }
    }
}

#[test]
fn dckpt_to_torch_dist_reads_back_the_same_values_and_validates() {
    for name in FIXTURES {
        let src = open(name);
        let ckpt = Checkpoint::open(src.as_ref()).unwrap();
        let mid = memory(&format!("mid-{name}"));
        torch_dist_to_dckpt(src.as_ref(), &ckpt, &mid, &AtomicU64::new(0)).unwrap();
        let out = memory(&format!("back-{name}"));
        let progress = AtomicU64::new(0);
        let report = dckpt_to_torch_dist(&DckptSource::open(mid).unwrap(), out.as_ref(), &progress).unwrap();
        assert_eq!(report.files, [DATA_FILE]);
        assert_eq!(report.common_from_source, ckpt.common_bytes.is_some(), "{name}");
        let back = Checkpoint::open(out.as_ref()).unwrap();
        let v = validate(out.as_ref(), &back, |_| {});
        assert!(v.ok(), "{name}: {:?}", v.problems);
        let exp = expected(name);
        for (key, e) in exp["tensors"].as_object().unwrap() {
            let loc = back.locate_chunk(out.as_ref(), key, 0).unwrap();
            let mut got = vec![0u8; loc.nbytes() as usize];
            read_chunk(out.as_ref(), &loc, &mut got).unwrap();
            assert_eq!(got, unhex(e["hex"].as_str().unwrap()), "{name}: {key}");
        }
        // The same object keys, bytes for bytes, and common.pt as it was.
        let mut keys: Vec<&str> = back.objects().collect();
        let mut want: Vec<&str> = ckpt.objects().collect();
        keys.sort();
        want.sort();
        assert_eq!(keys, want, "{name}");
        for key in want {
            let (a, b) = (ckpt.item(key, None).unwrap(), back.item(key, None).unwrap());
            let read = |s: &Arc<dyn Storage>, i: &dckpt_torch_format::dcp::StorageInfo| {
                s.get_range(&i.relative_path, i.offset..i.offset + i.length).unwrap()
            };
            assert_eq!(read(&src, a), read(&out, b), "{name}: {key}");
        }
        if ckpt.common_bytes.is_some() {
            assert_eq!(out.get("common.pt").unwrap(), src.get("common.pt").unwrap());
        }
        assert_eq!(back.megatron.as_ref().unwrap()["sharded_backend"], "torch_dist");
    }
}

#[test]
fn a_damaged_chunk_fails_the_conversion_on_its_crc_and_writes_nothing() {
    let src = copy("dcp-2.15");
    let ckpt = Checkpoint::open(src.as_ref()).unwrap();
    let loc = ckpt.locate_chunk(src.as_ref(), "uneven.weight", 0).unwrap();
    let mut file = src.get(&loc.file).unwrap().to_vec();
    file[loc.data.start as usize + 1] ^= 0x40;
    src.put(&loc.file, Bytes::from(file)).unwrap();
    let dst = memory("damaged");
    let e = torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &AtomicU64::new(0)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(&e, ConvertError::Engine(e) if matches!(e.kind(), dckpt::ErrorKind::Checksum { .. })), "{msg}");
    assert!(msg.contains("uneven.weight") && msg.contains(&loc.file) && msg.contains("CRC-32"), "{msg}");
    assert!(dst.list("").unwrap().is_empty(), "{:?}", dst.list("").unwrap());
}

#[test]
fn a_checkpoint_with_a_coverage_hole_is_refused_by_the_engine() {
    let src = open("etp-bug");
    let ckpt = Checkpoint::open(src.as_ref()).unwrap();
    let dst = memory("etp-bug");
    let e = torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &AtomicU64::new(0)).unwrap_err();
    assert!(e.to_string().contains("decoder.experts.fc1.weight"), "{e}");
    assert!(dst.list("").unwrap().is_empty());
}

#[test]
fn torch_dist_output_is_never_written_over_a_checkpoint() {
    let src = open("dcp-2.15");
    let ckpt = Checkpoint::open(src.as_ref()).unwrap();
    let mid = memory("over-mid");
    torch_dist_to_dckpt(src.as_ref(), &ckpt, &mid, &AtomicU64::new(0)).unwrap();
    let source = DckptSource::open(mid).unwrap();
    // Nor over any file it writes: another's common.pt or metadata.json was overwritten.
    for (i, name) in [".metadata", "common.pt", "metadata.json"].into_iter().enumerate() {
        let out = memory(&format!("over-out-{i}"));
        out.put(name, Bytes::from_static(b"x")).unwrap();
        let e = dckpt_to_torch_dist(&source, out.as_ref(), &AtomicU64::new(0)).unwrap_err();
        assert!(matches!(&e, ConvertError::Exists { location } if location.ends_with(name)), "{name}: {e}");
        assert_eq!(out.list("").unwrap().len(), 1);
        assert_eq!(out.get(name).unwrap().as_ref(), b"x");
    }
}

#[test]
fn a_tensor_of_several_slabs_goes_to_torch_dist_whole_with_its_crc() {
    // Three slabs of the writer (32 MiB each, the last short), so both reused buffers and
    // a short last read are exercised.
    let n: u64 = (64 << 20) + 4096 + 3;
    let data: Vec<u8> = (0..n).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8).collect();
    let small = [1u8, 2, 3, 4, 5, 6, 7, 8];
    let ckpt = memory("slabs");
    let state = dckpt::SaveState::new()
        .tensor(dckpt_shard_spec::ShardedTensor::whole("big", dckpt_shard_spec::DType::U8, [n]), &data)
        .tensor(dckpt_shard_spec::ShardedTensor::whole("small", dckpt_shard_spec::DType::F32, [2]), &small);
    dckpt::Checkpointer::local().save(&ckpt, &state, &dckpt::SaveOptions::default()).unwrap();
    let out = memory("slabs-out");
    let progress = AtomicU64::new(0);
    let r = dckpt_to_torch_dist(&DckptSource::open(ckpt).unwrap(), out.as_ref(), &progress).unwrap();
    assert_eq!((r.tensors, r.bytes), (2, n + 8));
    assert_eq!(progress.load(std::sync::atomic::Ordering::Relaxed), n + 8);
    let back = Checkpoint::open(out.as_ref()).unwrap();
    let v = validate(out.as_ref(), &back, |_| {});
    assert!(v.ok(), "{:?}", v.problems);
    for (key, want) in [("big", &data[..]), ("small", &small[..])] {
        let loc = back.locate_chunk(out.as_ref(), key, 0).unwrap();
        let mut got = vec![0u8; loc.nbytes() as usize];
        read_chunk(out.as_ref(), &loc, &mut got).unwrap();
        assert!(got == want, "{key}");
        assert_eq!((loc.data.start - loc.item.start) % 64, 0, "{key}: data 64-byte aligned in its archive");
    }
}

/// The tensors of a safetensors file: key -> bytes.
fn safetensors_tensors(bytes: &[u8]) -> std::collections::BTreeMap<String, Vec<u8>> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = v["data_offsets"].as_array().unwrap();
            (k.clone(), data[o[0].as_u64().unwrap() as usize..o[1].as_u64().unwrap() as usize].to_vec())
        })
        .collect()
}

#[test]
fn every_fixture_exports_from_torch_dist_bit_exact_whatever_the_budget() {
    use dckpt_convert::torch_dist::TorchDistSource;
    use dckpt_convert::{ExportOptions, export};
    for name in FIXTURES {
        let source = TorchDistSource::open(open(name)).unwrap();
        assert_eq!(source.objects().len(), Checkpoint::open(open(name).as_ref()).unwrap().objects().count());
        // 64 bytes: slabs of a few elements, cutting rows and chunks anywhere.
        for budget in [64u64, 256 << 20] {
            let out = memory(&format!("export-{name}-{budget}"));
            let opts = ExportOptions { buffer_size: budget, ..ExportOptions::default() };
            let r = export(&source, out.as_ref(), &opts, &AtomicU64::new(0)).unwrap();
            let got = safetensors_tensors(&out.get(&r.files[0].name).unwrap());
            let exp = expected(name);
            let tensors = exp["tensors"].as_object().unwrap();
            assert_eq!(got.len(), tensors.len(), "{name}");
            for (key, e) in tensors {
                assert_eq!(got[key], unhex(e["hex"].as_str().unwrap()), "{name} {budget}: {key}");
            }
        }
    }
}

#[test]
fn an_export_of_a_checkpoint_with_a_hole_names_the_tensor() {
    use dckpt_convert::torch_dist::TorchDistSource;
    use dckpt_convert::{ExportOptions, export};
    let source = TorchDistSource::open(open("etp-bug")).unwrap();
    let out = memory("export-etp-bug");
    let e = export(&source, out.as_ref(), &ExportOptions::default(), &AtomicU64::new(0)).unwrap_err();
    assert!(e.to_string().contains("decoder.experts.fc") && e.to_string().contains("dckpt validate"), "{e}");
    assert!(out.list("").unwrap().is_empty());
}

#[test]
fn hostile_metadata_fails_the_conversion_by_name_and_writes_nothing() {
    for (file, says) in [
        ("offset-past-end.metadata", "past the file's end"),
        ("offset-overflow.metadata", "overflow"),
        (
            "size-overflow.metadata",
            "state_dict_metadata[counts].size: [1099511627776, 1099511627776] of i64 holds more than 2^64 bytes",
        ),
    ] {
        let src = copy("dcp-2.15");
        let bytes = std::fs::read(fixture("hostile").join(file)).unwrap();
        src.put(".metadata", Bytes::from(bytes)).unwrap();
        let dst = memory(&format!("hostile-{file}"));
        // Some are refused when the metadata is read, the rest when a chunk is located.
        let e = match Checkpoint::open(src.as_ref()) {
            Err(e) => e.to_string(),
            Ok(ckpt) => {
                torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &AtomicU64::new(0)).map(|_| ()).unwrap_err().to_string()
            }
        };
        assert!(e.contains(says), "{file}: {e}");
        assert!(dst.list("").unwrap().is_empty(), "{file}");
    }
}

/// A tensor listed with no chunk at all. With elements, it is nowhere: `validate` named no
/// problem (its coverage check saw only the chunks there were) and a conversion dropped the
/// key and reported success; now the one names it short and the other's plan, which
/// declares every listed tensor, refuses it. Without
/// elements there is nothing to store, and it converts, declared.
#[test]
fn a_tensor_listed_without_chunks_is_a_gap_or_an_empty_tensor() {
    use dckpt_shard_spec::DType;
    use dckpt_torch_format::dcp::{DcpMetadata, StateEntry, TensorMeta};
    use dckpt_torch_format::write::encode_dcp_metadata;
    let with = |size: Vec<u64>, name: &str| {
        let src = open("dcp-2.15");
        let dst = memory(&format!("chunkless-{name}"));
        for o in src.list("").unwrap() {
            dst.put(&o.path, src.get(&o.path).unwrap()).unwrap();
        }
        let mut md = DcpMetadata::decode(&dst.get(".metadata").unwrap(), ".metadata").unwrap();
        let t = TensorMeta { dtype: DType::F32, size, chunks: vec![] };
        md.state_dict_metadata.push(("zz.ghost".into(), StateEntry::Tensor(t)));
        dst.put(".metadata", Bytes::from(encode_dcp_metadata(&md))).unwrap();
        dst
    };
    let src = with(vec![4, 4], "full");
    let ckpt = Checkpoint::open(src.as_ref()).unwrap();
    let problems = validate(src.as_ref(), &ckpt, |_| {}).problems;
    assert!(problems.iter().any(|p| p.contains("zz.ghost: covered 0.0% (0 of 16 elements)")), "{problems:?}");
    let dst = memory("chunkless-full-out");
    let e = torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &AtomicU64::new(0)).unwrap_err();
    assert!(e.to_string().contains("zz.ghost") && e.to_string().contains("no rank holds it"), "{e}");
    assert!(dst.list("").unwrap().is_empty());

    let src = with(vec![0, 4], "empty");
    let ckpt = Checkpoint::open(src.as_ref()).unwrap();
    assert_eq!(validate(src.as_ref(), &ckpt, |_| {}).problems, Vec::<String>::new());
    let dst = memory("chunkless-empty-out");
    torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &AtomicU64::new(0)).unwrap();
    let meta = dckpt::Checkpointer::local().metadata(&dst).unwrap();
    let ghost = meta.tensors.iter().find(|t| t.key == "zz.ghost").expect("declared");
    assert_eq!((ghost.global_shape.to_vec(), ghost.chunks.len()), (vec![0, 4], 0));
}

/// `.metadata`, the last write, marks the output whole: one whose reply was lost landed, so
/// the conversion succeeded (its cleanup deleted the data under a `.metadata` that had
/// landed); one that never landed leaves nothing behind.
#[test]
fn a_lost_reply_to_the_last_write_of_a_torch_dist_output_is_settled_by_what_is_there() {
    use dckpt::storage::{FaultConfig, FaultStorage, MemoryStorage};
    let src = open("dcp-2.15");
    let ckpt = Checkpoint::open(src.as_ref()).unwrap();
    let mid = memory("lost-reply-mid");
    torch_dist_to_dckpt(src.as_ref(), &ckpt, &mid, &AtomicU64::new(0)).unwrap();
    let source = DckptSource::open(mid).unwrap();
    let faulty = |config: FaultConfig| {
        let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
        (FaultStorage::new(inner.clone(), config), inner)
    };
    let (dry, _) = faulty(FaultConfig::default());
    dckpt_to_torch_dist(&source, &dry, &AtomicU64::new(0)).unwrap();
    let last = dry.ops() - 1;
    for landed in [true, false] {
        let (out, inner) = faulty(FaultConfig { fail_op: Some(last), fail_after_effect: landed, ..Default::default() });
        let got = dckpt_to_torch_dist(&source, &out, &AtomicU64::new(0));
        let fault = out.injected();
        assert!(matches!(&fault[..], [f] if f.path.ends_with(".metadata")), "{fault:?}");
        if landed {
            got.unwrap_or_else(|e| panic!("a write that landed: {e}"));
            let back = Checkpoint::open(inner.as_ref()).unwrap();
            let v = validate(inner.as_ref(), &back, |_| {});
            assert!(v.ok(), "{:?}", v.problems);
        } else {
            assert!(got.is_err());
            assert_eq!(inner.list("").unwrap(), vec![], "a conversion that did not land leaves nothing");
        }
    }
}

/// Megatron's common state reaches torch_dist from wherever dckpt holds it: the file
/// Megatron's own save wrote beside a dckpt checkpoint (it was replaced by an empty dict), or
/// the object a conversion from torch_dist kept it as. An object that merely has that name
/// (a DCP item "common.pt") stays an item (it became the common state, and the key was lost).
#[test]
fn megatron_common_state_comes_from_its_file_or_its_object_and_no_other() {
    let w = [0u8; 8];
    let tensor = || dckpt_shard_spec::ShardedTensor::whole("w", dckpt_shard_spec::DType::F32, [2]);
    let common_pt = dckpt_torch_format::write::empty_dict_archive();
    let seven = b"J7".to_vec();
    // A dckpt save with the file beside it, as dckpt's Megatron strategy leaves one.
    let ckpt = memory("common-file");
    let state = dckpt::SaveState::new()
        .tensor(tensor(), &w)
        .object(dckpt_shard_spec::ShardedObject::single("common.pt"), &seven);
    dckpt::Checkpointer::local().save(&ckpt, &state, &dckpt::SaveOptions::default()).unwrap();
    let mut megatron_common = common_pt.clone();
    megatron_common.extend_from_slice(b"-megatron");
    ckpt.put("common.pt", Bytes::from(megatron_common.clone())).unwrap();
    let out = memory("common-file-out");
    let r = dckpt_to_torch_dist(&DckptSource::open(ckpt).unwrap(), out.as_ref(), &AtomicU64::new(0)).unwrap();
    assert!(r.common_from_source);
    assert_eq!(out.get("common.pt").unwrap().to_vec(), megatron_common);
    let back = Checkpoint::open(out.as_ref()).unwrap();
    assert_eq!(back.objects().collect::<Vec<_>>(), ["common.pt"], "the object is an item of its own");
    // A plain DCP item named common.pt, through dckpt and back: an item still, and the
    // common state an empty dict.
    let mid = memory("common-item");
    let state = dckpt::SaveState::new()
        .tensor(tensor(), &w)
        .object(dckpt_shard_spec::ShardedObject::single("common.pt"), &seven);
    let opts = dckpt::SaveOptions::default().layout_entry("converted_from", "dcp");
    dckpt::Checkpointer::local().save(&mid, &state, &opts).unwrap();
    let out = memory("common-item-out");
    let r = dckpt_to_torch_dist(&DckptSource::open(mid).unwrap(), out.as_ref(), &AtomicU64::new(0)).unwrap();
    assert!(!r.common_from_source);
    assert_eq!(out.get("common.pt").unwrap().to_vec(), common_pt);
    assert_eq!(Checkpoint::open(out.as_ref()).unwrap().objects().collect::<Vec<_>>(), ["common.pt"]);
}

/// A tensor and an object of one name, or a grid object's `key/shard_...` and a single
/// object named so, would be one DCP key, the last written the only one read: refused,
/// naming both, with nothing written.
#[test]
fn names_that_would_be_one_dcp_key_are_refused() {
    let w = [0u8; 8];
    let j = b"J1".to_vec();
    let tensor = dckpt_shard_spec::ShardedTensor::whole("a", dckpt_shard_spec::DType::F32, [2]);
    let one = dckpt::SaveState::new().tensor(tensor, &w).object(dckpt_shard_spec::ShardedObject::single("a"), &j);
    let grid = |at: u64| dckpt_shard_spec::ShardedObject::in_grid("x", vec![2], vec![at]);
    let two = dckpt::SaveState::new()
        .object(grid(0), &j)
        .object(grid(1), &j)
        .object(dckpt_shard_spec::ShardedObject::single("x/shard_0_2"), &j);
    for (i, (state, names)) in
        [(one, ["tensor \"a\"", "object \"a\""]), (two, ["object \"x\" at [0]", "object \"x/shard_0_2\""])]
            .into_iter()
            .enumerate()
    {
        let ckpt = memory(&format!("collide-{i}"));
        dckpt::Checkpointer::local().save(&ckpt, &state, &dckpt::SaveOptions::default()).unwrap();
        let out = memory(&format!("collide-{i}-out"));
        let e = dckpt_to_torch_dist(&DckptSource::open(ckpt).unwrap(), out.as_ref(), &AtomicU64::new(0)).unwrap_err();
        let e = e.to_string();
        assert!(names.iter().all(|n| e.contains(n)), "{e}");
        assert!(out.list("").unwrap().is_empty(), "{e}");
    }
}
