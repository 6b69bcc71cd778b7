//! Writing what PyTorch reads: DCP's `.metadata` pickle and `torch.save` archives.
//!
//! [`encode_dcp_metadata`] pickles a [`DcpMetadata`] the way
//! `torch.distributed.checkpoint` does: `Metadata`, `TensorStorageMetadata`,
//! `ChunkStorageMetadata`, `MetadataIndex`, `_StorageInfo` and `StorageMeta` as `NEWOBJ` of
//! the class and a `BUILD` of their field dict, `TensorProperties` with the tuple its
//! `__getstate__` returns (the five fields every release reads; `strides` is absent, which
//! releases after 2.9 read as `None`), `torch.Size` as a `REDUCE` of a tuple, dtypes and
//! `torch.strided` as bare globals. Protocol 2, no memo: every release's `pickle.load`
//! reads it, and so does this crate's restricted reader ([`DcpMetadata::decode`]).
//!
//! [`TensorArchive`] is the zip archive `torch.save(tensor)` writes for a contiguous
//! tensor, cut around the tensor's bytes so that a writer streams them (computing their
//! CRC-32 on the way) between [`TensorArchive::head`] and [`TensorArchive::tail`]: entries
//! `archive/data.pkl` (`_rebuild_tensor_v2` of a persistent storage id, `_v3` with an
//! untyped storage for the float8 dtypes, as PyTorch writes them), `.format_version`,
//! `.storage_alignment`, `byteorder`, `data/0` (its data 64-byte aligned within the
//! archive, as `torch.save` aligns it, by padding the local header's extra field), and
//! `version`; every entry stored with its real CRC-32, sizes in a data descriptor after
//! the data, zip64 records where a size or offset needs them. [`torch_save_archive`] is
//! the same container held whole, for small pickles such as Megatron's `common.pt`.
//!
//! Nothing here does IO.

mod archive;

use dckpt_shard_spec::DType;

use crate::dcp::{DcpMetadata, StateEntry};

pub use archive::{TensorArchive, empty_dict_archive, torch_save_archive};

/// The alignment of storage data within an archive, as `torch.save` writes it.
pub const STORAGE_ALIGNMENT: u64 = 64;
/// The top-level folder of every archive entry (what `torch.save` into a buffer names it).
pub const ARCHIVE_PREFIX: &str = "archive";

/// A pickle under construction: opcodes of protocol 2, appended.
#[derive(Debug, Default)]
pub struct Pickler {
    out: Vec<u8>,
}

impl Pickler {
    /// A pickle that starts with `PROTO 2`.
    pub fn new() -> Pickler {
        Pickler { out: vec![0x80, 2] }
    }

    /// `GLOBAL module name`.
    pub fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        self
    }

    /// A `str` (`BINUNICODE`).
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.out.push(b'X');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
        self
    }

    /// An `int`: `BININT1`, `BININT2`, `BININT`, or `LONG1` for anything wider.
    pub fn int(&mut self, v: i128) -> &mut Self {
        match v {
            0..=0xff => self.out.extend_from_slice(&[b'K', v as u8]),
            0x100..=0xffff => {
                self.out.push(b'M');
                self.out.extend_from_slice(&(v as u16).to_le_bytes());
            }
            _ if i32::try_from(v).is_ok() => {
                self.out.push(b'J');
                self.out.extend_from_slice(&(v as i32).to_le_bytes());
            }
            _ => {
                // Two's complement, little-endian, as few bytes as keep the sign.
                let bytes = v.to_le_bytes();
                let mut n = bytes.len();
                while n > 1 {
                    let (top, next) = (bytes[n - 1], bytes[n - 2]);
                    if (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0) {
                        n -= 1;
                    } else {
                        break;
                    }
                }
                self.out.extend_from_slice(&[0x8a, n as u8]);
                self.out.extend_from_slice(&bytes[..n]);
            }
        }
        self
    }

    /// `None`.
    pub fn none(&mut self) -> &mut Self {
        self.out.push(b'N');
        self
    }

    /// `True` or `False`.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.out.push(if v { 0x88 } else { 0x89 });
        self
    }

    /// A `float` (`BINFLOAT`, big-endian).
    pub fn float(&mut self, v: f64) -> &mut Self {
        self.out.push(b'G');
        self.out.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// A `bytes` (`BINBYTES`, an opcode of protocol 3 that every Python 3 unpickler reads
    /// whatever protocol the pickle names).
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.out.push(b'B');
        self.out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.out.extend_from_slice(b);
        self
    }

    /// `MARK`.
    pub fn mark(&mut self) -> &mut Self {
        self.out.push(b'(');
        self
    }

    /// `TUPLE`: the values since the last mark.
    pub fn tuple(&mut self) -> &mut Self {
        self.out.push(b't');
        self
    }

    /// A tuple of ints.
    pub fn int_tuple(&mut self, v: &[u64]) -> &mut Self {
        self.mark();
        for &x in v {
            self.int(i128::from(x));
        }
        self.tuple()
    }

    /// `EMPTY_DICT`.
    pub fn empty_dict(&mut self) -> &mut Self {
        self.out.push(b'}');
        self
    }

    /// `EMPTY_LIST`.
    pub fn empty_list(&mut self) -> &mut Self {
        self.out.push(b']');
        self
    }

    /// `APPENDS`: the values since the last mark onto the list below it.
    pub fn appends(&mut self) -> &mut Self {
        self.out.push(b'e');
        self
    }

    /// `SETITEMS`: the pairs since the last mark into the dict below it.
    pub fn setitems(&mut self) -> &mut Self {
        self.out.push(b'u');
        self
    }

    /// `REDUCE`: the callable below called with the tuple on top.
    pub fn reduce(&mut self) -> &mut Self {
        self.out.push(b'R');
        self
    }

    /// `EMPTY_TUPLE NEWOBJ`: `cls.__new__(cls)` of the class on top.
    pub fn new_object(&mut self) -> &mut Self {
        self.out.extend_from_slice(&[b')', 0x81]);
        self
    }

    /// `BUILD`: the state on top set on the object below.
    pub fn build(&mut self) -> &mut Self {
        self.out.push(b'b');
        self
    }

    /// `BINPERSID`: the value on top as a persistent id.
    pub fn persistent_id(&mut self) -> &mut Self {
        self.out.push(b'Q');
        self
    }

    /// `STOP`, and the bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.push(b'.');
        self.out
    }
}

/// The name of `d` in the `torch` module (`torch.bfloat16` is `bfloat16`).
pub fn torch_dtype_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::Bf16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F8E4m3 => "float8_e4m3fn",
        DType::F8E5m2 => "float8_e5m2",
    }
}

/// The legacy typed storage class `torch.save` names for `d`, or `None` where it writes an
/// untyped storage and `_rebuild_tensor_v3` with the dtype (the float8 dtypes).
fn storage_class(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::Bool => "BoolStorage",
        DType::U8 => "ByteStorage",
        DType::I8 => "CharStorage",
        DType::I16 => "ShortStorage",
        DType::I32 => "IntStorage",
        DType::I64 => "LongStorage",
        DType::F16 => "HalfStorage",
        DType::Bf16 => "BFloat16Storage",
        DType::F32 => "FloatStorage",
        DType::F64 => "DoubleStorage",
        DType::F8E4m3 | DType::F8E5m2 => return None,
    })
}

/// Row-major strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut out = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        out[i] = out[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    out
}

/// The `data.pkl` of `torch.save(t)` for a contiguous CPU tensor `t` of `dtype` and
/// `shape` whose storage is the archive's `data/0`.
pub fn tensor_data_pkl(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let numel: u64 = shape.iter().product();
    let mut p = Pickler::new();
    let class = storage_class(dtype);
    p.global("torch._utils", if class.is_some() { "_rebuild_tensor_v2" } else { "_rebuild_tensor_v3" });
    p.mark();
    // The storage: ('storage', type, key, location, numel) as a persistent id; an untyped
    // storage counts bytes.
    p.mark().str("storage");
    match class {
        Some(c) => p.global("torch", c).str("0").str("cpu").int(i128::from(numel)),
        None => p.global("torch.storage", "UntypedStorage").str("0").str("cpu").int(i128::from(numel * dtype.size())),
    };
    p.tuple().persistent_id();
    p.int(0).int_tuple(shape).int_tuple(&contiguous_strides(shape)).bool(false);
    p.global("collections", "OrderedDict").mark().tuple().reduce();
    if class.is_none() {
        p.global("torch", torch_dtype_name(dtype));
    }
    p.tuple().reduce();
    p.finish()
}

/// The `.metadata` pickle of `md` (see the module docs). `planner_data`, when set, is
/// written as the flattening map of a flat state dict (every key its own one-element path),
/// which is what DCP's planner records for a state dict without nesting.
pub fn encode_dcp_metadata(md: &DcpMetadata) -> Vec<u8> {
    const META: &str = "torch.distributed.checkpoint.metadata";
    let mut p = Pickler::new();
    p.global(META, "Metadata").new_object();
    p.empty_dict().mark();
    p.str("state_dict_metadata").empty_dict().mark();
    for (key, entry) in &md.state_dict_metadata {
        p.str(key);
        match entry {
            StateEntry::Bytes => {
                p.global(META, "BytesStorageMetadata").new_object();
            }
            StateEntry::Tensor(t) => {
                p.global(META, "TensorStorageMetadata").new_object().empty_dict().mark();
                p.str("properties").global(META, "TensorProperties").new_object();
                p.mark().global("torch", torch_dtype_name(t.dtype)).global("torch", "strided").bool(false);
                p.global(META, "_MEM_FORMAT_ENCODING").mark().int(0).tuple().reduce();
                p.bool(false).tuple().build();
                p.str("size");
                torch_size(&mut p, &t.size);
                p.str("chunks").empty_list().mark();
                for c in &t.chunks {
                    p.global(META, "ChunkStorageMetadata").new_object().empty_dict().mark();
                    p.str("offsets");
                    torch_size(&mut p, &c.offsets);
                    p.str("sizes");
                    torch_size(&mut p, &c.sizes);
                    p.setitems().build();
                }
                p.appends();
                p.setitems().build();
            }
        }
    }
    p.setitems();
    p.str("planner_data");
    if md.planner_data {
        p.empty_dict().mark();
        for (key, _) in &md.state_dict_metadata {
            p.str(key).mark().str(key).tuple();
        }
        p.setitems();
    } else {
        p.none();
    }
    p.str("storage_data").empty_dict().mark();
    for (index, info) in &md.storage_data {
        p.global(META, "MetadataIndex").new_object().empty_dict().mark();
        p.str("fqn").str(&index.fqn);
        p.str("offset");
        match &index.offset {
            Some(o) => torch_size(&mut p, o),
            None => {
                p.none();
            }
        }
        p.str("index");
        match index.index {
            Some(i) => p.int(i128::from(i)),
            None => p.none(),
        };
        p.setitems().build();
        p.global("torch.distributed.checkpoint.filesystem", "_StorageInfo").new_object().empty_dict().mark();
        p.str("relative_path").str(&info.relative_path);
        p.str("offset").int(i128::from(info.offset));
        p.str("length").int(i128::from(info.length));
        p.setitems().build();
    }
    p.setitems();
    if let Some(id) = &md.save_id {
        p.str("storage_meta").global(META, "StorageMeta").new_object().empty_dict().mark();
        p.str("checkpoint_id").none().str("save_id").str(id).str("load_id").none().str("modules").empty_list();
        p.setitems().build();
    }
    if let Some(v) = &md.version {
        p.str("version").str(v);
    }
    p.setitems().build();
    p.finish()
}

fn torch_size(p: &mut Pickler, v: &[u64]) {
    p.global("torch", "Size").mark().int_tuple(v).tuple().reduce();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dcp::{ChunkMeta, MetadataIndex, StorageInfo, TensorMeta, TorchSaveTensor};
    use crate::pickle::{Value, unpickle};
    use crate::zip;

    #[test]
    fn ints_of_every_width_read_back() {
        for v in [0i128, 1, 255, 256, 65535, 65536, -1, -129, i32::MAX as i128, 1 << 40, u64::MAX as i128, -(1 << 63)] {
            let mut p = Pickler::new();
            p.int(v);
            let got = unpickle(&p.finish(), &[]).unwrap();
            let back = match got {
                Value::Int(i) => i128::from(i),
                Value::BigInt(b) => {
                    // Sign-extend the little-endian two's complement bytes.
                    let fill = if b.last().is_some_and(|x| x & 0x80 != 0) { 0xff } else { 0 };
                    let mut full = [fill; 16];
                    full[..b.len()].copy_from_slice(&b);
                    i128::from_le_bytes(full)
                }
                other => panic!("{v}: {other:?}"),
            };
            assert_eq!(back, v);
        }
    }

    fn sample() -> DcpMetadata {
        DcpMetadata {
            state_dict_metadata: vec![
                (
                    "w".into(),
                    StateEntry::Tensor(TensorMeta {
                        dtype: DType::Bf16,
                        size: vec![4, 6],
                        chunks: vec![
                            ChunkMeta { offsets: vec![0, 0], sizes: vec![2, 6] },
                            ChunkMeta { offsets: vec![2, 0], sizes: vec![2, 6] },
                        ],
                    }),
                ),
                ("step".into(), StateEntry::Bytes),
                (
                    "big".into(),
                    StateEntry::Tensor(TensorMeta {
                        dtype: DType::F8E4m3,
                        size: vec![1 << 33],
                        chunks: vec![ChunkMeta { offsets: vec![0], sizes: vec![1 << 33] }],
                    }),
                ),
            ],
            storage_data: vec![
                (
                    MetadataIndex { fqn: "w".into(), offset: Some(vec![0, 0]), index: Some(0) },
                    StorageInfo { relative_path: "__0_0.distcp".into(), offset: 0, length: 100, transformed: false },
                ),
                (
                    MetadataIndex { fqn: "w".into(), offset: Some(vec![2, 0]), index: Some(1) },
                    StorageInfo { relative_path: "__0_0.distcp".into(), offset: 100, length: 100, transformed: false },
                ),
                (
                    MetadataIndex { fqn: "step".into(), offset: None, index: None },
                    StorageInfo { relative_path: "__0_0.distcp".into(), offset: 200, length: 7, transformed: false },
                ),
                (
                    MetadataIndex { fqn: "big".into(), offset: Some(vec![0]), index: Some(0) },
                    StorageInfo {
                        relative_path: "__0_0.distcp".into(),
                        offset: 207,
                        length: (1 << 33) + 900,
                        transformed: false,
                    },
                ),
            ],
            planner_data: true,
            version: Some("1.0.0".into()),
            save_id: Some("abc".into()),
            extra_attributes: vec![],
            reformulated: vec![],
        }
    }

    #[test]
    fn metadata_written_here_reads_back_the_same() {
        let md = sample();
        let bytes = encode_dcp_metadata(&md);
        let back = DcpMetadata::decode(&bytes, "m").unwrap();
        assert_eq!(back, md);
        let plain = DcpMetadata { planner_data: false, version: None, save_id: None, ..md };
        assert_eq!(DcpMetadata::decode(&encode_dcp_metadata(&plain), "m").unwrap(), plain);
    }

    /// Sizes every reader trusts are checked where they are read: a tensor of more than
    /// 2^64 bytes (its size wrapped to a few bytes in the converter's arithmetic) and a
    /// chunk outside its tensor are refused, naming the entry.
    #[test]
    fn a_tensor_past_2_64_bytes_or_a_chunk_outside_its_tensor_is_refused() {
        let with = |size: Vec<u64>, offsets: Vec<u64>, sizes: Vec<u64>| {
            let mut md = sample();
            md.state_dict_metadata[0].1 =
                StateEntry::Tensor(TensorMeta { dtype: DType::F32, size, chunks: vec![ChunkMeta { offsets, sizes }] });
            DcpMetadata::decode(&encode_dcp_metadata(&md), "m").map(drop).map_err(|e| e.to_string())
        };
        let e = with(vec![1 << 31, 1 << 31], vec![0, 0], vec![1 << 31, 1 << 31]).unwrap_err();
        assert!(e.contains("state_dict_metadata[w].size") && e.contains("more than 2^64 bytes"), "{e}");
        for (offsets, sizes) in [(vec![3, 0], vec![2, 6]), (vec![0, u64::MAX], vec![4, 2])] {
            let e = with(vec![4, 6], offsets, sizes).unwrap_err();
            assert!(e.contains("state_dict_metadata[w].chunks[0]") && e.contains("reach outside"), "{e}");
        }
        with(vec![1 << 30, 1 << 30], vec![0, 0], vec![1 << 30, 1 << 30]).unwrap();
        with(vec![4, 6], vec![2, 0], vec![2, 6]).unwrap();
    }

    #[test]
    fn a_tensor_archive_reads_back_with_its_crcs() {
        for (dtype, shape) in
            [(DType::Bf16, vec![2u64, 3]), (DType::F8E5m2, vec![5]), (DType::I64, vec![]), (DType::F32, vec![0, 4])]
        {
            let a = TensorArchive::new(dtype, &shape);
            let data: Vec<u8> = (0..a.data_len()).map(|i| (i * 7 + 3) as u8).collect();
            let mut bytes = a.head().to_vec();
            assert_eq!(bytes.len() as u64 % STORAGE_ALIGNMENT, 0, "{dtype} data aligned");
            bytes.extend_from_slice(&data);
            bytes.extend_from_slice(&a.tail(crc32fast::hash(&data)));
            assert_eq!(bytes.len() as u64, a.len());
            let entries = zip::entries(&bytes, "a").unwrap();
            let names: Vec<&str> = entries.iter().map(|e| e.record.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "archive/data.pkl",
                    "archive/.format_version",
                    "archive/.storage_alignment",
                    "archive/byteorder",
                    "archive/data/0",
                    "archive/version"
                ]
            );
            for e in &entries {
                e.verify_crc(e.stored_data(&bytes, "a").unwrap(), "a").unwrap();
            }
            assert_eq!(entries[4].stored_data(&bytes, "a").unwrap(), &data[..]);
            assert_eq!(entries[4].data_offset, a.data_offset());
            let t = TorchSaveTensor::decode(entries[0].stored_data(&bytes, "a").unwrap(), "a").unwrap();
            assert_eq!((t.dtype, t.size.clone(), t.storage_offset), (dtype, shape.clone(), 0));
            assert_eq!(t.stride, contiguous_strides(&shape));
            t.check_storage(a.data_len(), "a").unwrap();
        }
    }

    #[test]
    fn a_wrong_crc_is_caught_by_the_reader() {
        let a = TensorArchive::new(DType::F32, &[2]);
        let mut bytes = a.head().to_vec();
        bytes.extend_from_slice(&[1; 8]);
        bytes.extend_from_slice(&a.tail(crc32fast::hash(&[1; 8]) ^ 1));
        let entries = zip::entries(&bytes, "a").unwrap();
        assert!(entries[4].verify_crc(entries[4].stored_data(&bytes, "a").unwrap(), "a").is_err());
    }

    #[test]
    fn a_tensor_over_4_gib_gets_zip64_records() {
        // Only the records are built; the data is never materialised.
        let a = TensorArchive::new(DType::U8, &[(1 << 32) + 5]);
        let tail = a.tail(0x1234_5678);
        let len = a.len();
        let found = zip::find_central_directory(&tail, len, "big").unwrap();
        let zip::TailLookup::Found(dir) = found else { panic!("the tail holds the end records") };
        assert!(dir.zip64);
        let start = dir.range.start - (len - tail.len() as u64);
        let end = dir.range.end - (len - tail.len() as u64);
        let records = zip::parse_central_directory(&tail[start as usize..end as usize], &dir, "big").unwrap();
        let data = records.iter().find(|r| r.name == "archive/data/0").unwrap();
        assert_eq!((data.compressed_size, data.crc32), ((1 << 32) + 5, 0x1234_5678));
        let version = records.iter().find(|r| r.name == "archive/version").unwrap();
        assert!(version.local_header_offset > 1 << 32);
    }

    #[test]
    fn the_empty_dict_archive_is_a_dict() {
        let bytes = empty_dict_archive();
        let entries = zip::entries(&bytes, "c").unwrap();
        let pkl = entries[0].stored_data(&bytes, "c").unwrap();
        assert_eq!(unpickle(pkl, &[]).unwrap(), Value::Dict(vec![]));
    }
}
