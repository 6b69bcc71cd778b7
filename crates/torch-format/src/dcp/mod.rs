//! PyTorch DCP's metadata and the `torch.save` items of its data files, as typed values.
//!
//! [`DcpMetadata::decode`] reads a `.metadata` file (a pickled
//! `torch.distributed.checkpoint.metadata.Metadata`) through the restricted unpickler: what
//! each key is (a tensor with its dtype, global size and chunks, or opaque bytes) and where
//! each item lies (`storage_data`: file, offset, length). The releases differ, and each
//! difference is read here: `TensorProperties` is pickled as a tuple that gained `strides`
//! after 2.9 (and as the sharded tensor's class before DCP had its own), chunk indexes carry
//! `index=None` or a number, `Metadata` gained `storage_meta` and `version`, `_StorageInfo`
//! gained `transform_descriptors`, and Megatron adds `all_local_plans` (its planner's
//! `SavePlan`s, not needed to read the data and kept out of the typed value).
//!
//! [`TorchSaveTensor::decode`] reads an item's `data.pkl`: the tensor `torch.save` rebuilds
//! with `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`, its storage a
//! persistent id `('storage', storage_type, key, location, numel)` whose bytes are the zip
//! entry `<archive>/data/<key>`. Nothing here does IO.

use std::collections::HashMap;

use dckpt_shard_spec::{DType, checked_numel};

use crate::pickle::{DCP_METADATA_GLOBALS, Object, Value, unpickle};
use dckpt_format::FormatError;

mod torch_save;
pub use torch_save::{TORCH_SAVE_GLOBALS, TorchSaveTensor};

/// A decoded DCP `.metadata` file.
#[derive(Clone, Debug, PartialEq)]
pub struct DcpMetadata {
    /// Every key of the saved state dict, in the pickle's order.
    pub state_dict_metadata: Vec<(String, StateEntry)>,
    /// Where each item's bytes are.
    pub storage_data: Vec<(MetadataIndex, StorageInfo)>,
    /// Whether the metadata carries planner data (the flattening map of the state dict).
    pub planner_data: bool,
    /// `Metadata.version` (e.g. `1.0.0`), absent in older releases.
    pub version: Option<String>,
    /// `StorageMeta.save_id`, absent in older releases.
    pub save_id: Option<String>,
    /// Attributes beyond the dataclass's fields (e.g. Megatron's `all_local_plans`).
    pub extra_attributes: Vec<String>,
    /// Keys whose entry in Megatron's `mcore_data` names an `nd_reformulated_orig_global_shape`:
    /// optimizer state that Megatron up to 0.15 stored under another shape than the tensor's.
    pub reformulated: Vec<String>,
}

/// What one key of the state dict is.
#[derive(Clone, Debug, PartialEq)]
pub enum StateEntry {
    /// A tensor, stored as chunks.
    Tensor(TensorMeta),
    /// A plain Python value, stored as one opaque item (`BytesStorageMetadata`).
    Bytes,
}

/// A tensor of the state dict (`TensorStorageMetadata`).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Its dtype.
    pub dtype: DType,
    /// Its global size.
    pub size: Vec<u64>,
    /// The chunks saved (`ChunkStorageMetadata`).
    pub chunks: Vec<ChunkMeta>,
}

/// One saved chunk of a tensor: a box of the global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkMeta {
    /// Where the box starts in the global tensor.
    pub offsets: Vec<u64>,
    /// Its extent along each dimension.
    pub sizes: Vec<u64>,
}

/// The key of an item in `storage_data`: the state dict key, and for a tensor chunk its
/// offsets (`index` is only a lookup hint).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MetadataIndex {
    /// The state dict key.
    pub fqn: String,
    /// The chunk's offsets, `None` for a bytes item.
    pub offset: Option<Vec<u64>>,
    /// The chunk's place in the tensor's chunks, when recorded.
    pub index: Option<u64>,
}

/// Where an item lies (`_StorageInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageInfo {
    /// The data file, relative to the checkpoint directory.
    pub relative_path: String,
    /// Where the item starts in it.
    pub offset: u64,
    /// Its bytes.
    pub length: u64,
    /// Whether the writer recorded transforms (compression, ...) applied to the item; this
    /// reader reads only untransformed items.
    pub transformed: bool,
}

impl DcpMetadata {
    /// Decodes the `.metadata` pickle `bytes`; `file` names it in errors. A global outside
    /// [`DCP_METADATA_GLOBALS`] is refused by name and never called.
    pub fn decode(bytes: &[u8], file: &str) -> Result<DcpMetadata, FormatError> {
        let root = unpickle(bytes, DCP_METADATA_GLOBALS).map_err(|e| e.into_format_error(file))?;
        let md = expect_object(&root, "Metadata", file, "metadata")?;
        let fields = fields_of(md, file, "metadata")?;
        let mut out = DcpMetadata {
            state_dict_metadata: Vec::new(),
            storage_data: Vec::new(),
            planner_data: false,
            version: None,
            save_id: None,
            extra_attributes: Vec::new(),
            reformulated: Vec::new(),
        };
        for (name, v) in fields {
            match name {
                "state_dict_metadata" => {
                    let Value::Dict(items) = v else {
                        return Err(FormatError::invalid(file, "state_dict_metadata", "not a dict"));
                    };
                    for (k, v) in items {
                        let key = k.as_str().ok_or_else(|| {
                            FormatError::invalid(file, "state_dict_metadata", "a key that is not a str")
                        })?;
                        let field = format!("state_dict_metadata[{key}]");
                        out.state_dict_metadata.push((key.to_string(), state_entry(v, file, &field)?));
                    }
                }
                "storage_data" => match v {
                    Value::Dict(items) => {
                        for (i, (k, v)) in items.iter().enumerate() {
                            let field = format!("storage_data[{i}]");
                            out.storage_data.push((metadata_index(k, file, &field)?, storage_info(v, file, &field)?));
                        }
                    }
                    Value::None => {}
                    _ => return Err(FormatError::invalid(file, "storage_data", "not a dict")),
                },
                "planner_data" => out.planner_data = !matches!(v, Value::None),
                "version" => out.version = v.as_str().map(str::to_string),
                "storage_meta" => {
                    if let Value::Object(o) = v {
                        out.save_id = fields_of(o, file, "storage_meta")?
                            .into_iter()
                            .find(|(n, _)| *n == "save_id")
                            .and_then(|(_, v)| v.as_str().map(str::to_string));
                    }
                }
                "mcore_data" => {
                    out.reformulated = reformulated_keys(v);
                    out.extra_attributes.push(name.to_string())
                }
                other => out.extra_attributes.push(other.to_string()),
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (k, _) in &out.state_dict_metadata {
            if !seen.insert(k.as_str()) {
                return Err(FormatError::invalid(file, "state_dict_metadata", format!("key {k:?} appears twice")));
            }
        }
        Ok(out)
    }

    /// The entry of `key`, if the state dict has it.
    pub fn entry(&self, key: &str) -> Option<&StateEntry> {
        self.state_dict_metadata.iter().find(|(k, _)| k == key).map(|(_, e)| e)
    }

    /// A lookup from `(fqn, offsets)` to the item's storage, as DCP's reader keys it.
    pub fn storage_index(&self) -> HashMap<(&str, Option<&[u64]>), &StorageInfo> {
        self.storage_data.iter().map(|(k, v)| ((k.fqn.as_str(), k.offset.as_deref()), v)).collect()
    }
}

/// The keys of `mcore_data` (a dict of key to a dict) whose dict names an
/// `nd_reformulated_orig_global_shape`.
fn reformulated_keys(mcore_data: &Value) -> Vec<String> {
    let Value::Dict(items) = mcore_data else { return Vec::new() };
    let names = |v: &Value| match v {
        Value::Dict(fields) => fields.iter().any(|(k, _)| k.as_str() == Some("nd_reformulated_orig_global_shape")),
        _ => false,
    };
    items.iter().filter(|(_, v)| names(v)).filter_map(|(k, _)| k.as_str().map(str::to_string)).collect()
}

fn expect_object<'a>(v: &'a Value, name: &str, file: &str, field: &str) -> Result<&'a Object, FormatError> {
    match v {
        Value::Object(o) if o.name == name => Ok(o),
        Value::Object(o) => {
            Err(FormatError::invalid(file, field, format!("a {}.{} where a {name} belongs", o.module, o.name)))
        }
        other => Err(FormatError::invalid(file, field, format!("{} where a {name} belongs", kind(other)))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::BigInt(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) => "a str",
        Value::Bytes(_) | Value::ByteArray(_) => "bytes",
        Value::Tuple(_) => "a tuple",
        Value::List(_) => "a list",
        Value::Dict(_) => "a dict",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Global { .. } => "a global",
        Value::Object(_) => "an object",
        Value::PersistentId(_) => "a persistent id",
    }
}

/// A dataclass's fields: the dict its `BUILD` set (a slotted dataclass pickles
/// `(None, slots)`, and both halves are read).
fn fields_of<'a>(o: &'a Object, file: &str, field: &str) -> Result<Vec<(&'a str, &'a Value)>, FormatError> {
    let mut out = Vec::new();
    let mut add = |d: &'a Value| -> Result<(), FormatError> {
        match d {
            Value::Dict(items) => {
                for (k, v) in items {
                    let k = k
                        .as_str()
                        .ok_or_else(|| FormatError::invalid(file, field, "a field name that is not a str"))?;
                    out.push((k, v));
                }
                Ok(())
            }
            Value::None => Ok(()),
            other => Err(FormatError::invalid(file, field, format!("{} as the state of a {}", kind(other), o.name))),
        }
    };
    match &o.state {
        Some(Value::Tuple(parts)) if parts.len() == 2 => {
            add(&parts[0])?;
            add(&parts[1])?;
        }
        Some(s) => add(s)?,
        None => {}
    }
    Ok(out)
}

fn field<'a>(fields: &[(&str, &'a Value)], name: &str) -> Option<&'a Value> {
    fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

fn required<'a>(fields: &[(&str, &'a Value)], name: &str, file: &str, at: &str) -> Result<&'a Value, FormatError> {
    field(fields, name).ok_or_else(|| FormatError::invalid(file, at, format!("no field `{name}`")))
}

fn state_entry(v: &Value, file: &str, at: &str) -> Result<StateEntry, FormatError> {
    let Value::Object(o) = v else {
        return Err(FormatError::invalid(file, at, format!("{} where a storage metadata belongs", kind(v))));
    };
    match o.name.as_str() {
        "BytesStorageMetadata" => Ok(StateEntry::Bytes),
        "TensorStorageMetadata" => {
            let f = fields_of(o, file, at)?;
            let dtype = properties_dtype(required(&f, "properties", file, at)?, file, &format!("{at}.properties"))?;
            let size = size_of(required(&f, "size", file, at)?, file, &format!("{at}.size"))?;
            // Every consumer sizes buffers and reads from these numbers: a tensor whose
            // bytes overflow 64 bits, or a chunk outside its tensor, is refused here.
            if checked_numel(&size).and_then(|n| n.checked_mul(dtype.size())).is_none() {
                return Err(FormatError::invalid(
                    file,
                    format!("{at}.size"),
                    format!("{size:?} of {dtype} holds more than 2^64 bytes"),
                ));
            }
            let Value::List(chunks) = required(&f, "chunks", file, at)? else {
                return Err(FormatError::invalid(file, format!("{at}.chunks"), "not a list"));
            };
            let mut out = Vec::with_capacity(chunks.len());
            for (i, c) in chunks.iter().enumerate() {
                let cat = format!("{at}.chunks[{i}]");
                let co = expect_object(c, "ChunkStorageMetadata", file, &cat)?;
                let cf = fields_of(co, file, &cat)?;
                let offsets = size_of(required(&cf, "offsets", file, &cat)?, file, &format!("{cat}.offsets"))?;
                let sizes = size_of(required(&cf, "sizes", file, &cat)?, file, &format!("{cat}.sizes"))?;
                if offsets.len() != size.len() || sizes.len() != size.len() {
                    let what =
                        format!("offsets {offsets:?} and sizes {sizes:?} for a tensor of {} dimensions", size.len());
                    return Err(FormatError::invalid(file, cat, what));
                }
                let inside = offsets
                    .iter()
                    .zip(&sizes)
                    .zip(&size)
                    .all(|((&o, &n), &d)| o.checked_add(n).is_some_and(|e| e <= d));
                if !inside {
                    let what = format!("offsets {offsets:?} and sizes {sizes:?} reach outside the tensor's {size:?}");
                    return Err(FormatError::invalid(file, cat, what));
                }
                out.push(ChunkMeta { offsets, sizes });
            }
            Ok(StateEntry::Tensor(TensorMeta { dtype, size, chunks: out }))
        }
        other => {
            Err(FormatError::invalid(file, at, format!("a {}.{other} where a storage metadata belongs", o.module)))
        }
    }
}

/// The dtype of a `TensorProperties`: its `__getstate__` tuple starts with the dtype in
/// every release (`(dtype, layout, requires_grad, memory_format, pin_memory)`, plus
/// `strides` after 2.9); a dataclass dict (no custom state) is read by name.
fn properties_dtype(v: &Value, file: &str, at: &str) -> Result<DType, FormatError> {
    let o = expect_object(v, "TensorProperties", file, at)?;
    let d = match &o.state {
        Some(Value::Tuple(t)) if !t.is_empty() => &t[0],
        Some(Value::Dict(_)) => required(&fields_of(o, file, at)?, "dtype", file, at)?,
        _ => return Err(FormatError::invalid(file, at, "a TensorProperties without a dtype")),
    };
    torch_dtype(d, file, &format!("{at}.dtype"))
}

/// A `torch.<dtype>` global as a [`DType`].
pub fn torch_dtype(v: &Value, file: &str, at: &str) -> Result<DType, FormatError> {
    let Some(("torch", name)) = v.as_global() else {
        return Err(FormatError::invalid(file, at, format!("{} where a torch dtype belongs", kind(v))));
    };
    let d = match name {
        "bool" => DType::Bool,
        "uint8" => DType::U8,
        "int8" => DType::I8,
        "int16" => DType::I16,
        "int32" => DType::I32,
        "int64" => DType::I64,
        "float16" => DType::F16,
        "bfloat16" => DType::Bf16,
        "float32" => DType::F32,
        "float64" => DType::F64,
        "float8_e4m3fn" => DType::F8E4m3,
        "float8_e5m2" => DType::F8E5m2,
        other => return Err(FormatError::invalid(file, at, format!("dtype torch.{other} is not supported"))),
    };
    Ok(d)
}

/// A `torch.Size` (a `REDUCE` of `torch.Size` with a tuple of ints), or a plain tuple or
/// list of non-negative ints.
fn size_of(v: &Value, file: &str, at: &str) -> Result<Vec<u64>, FormatError> {
    let items = match v {
        Value::Object(o) if o.module == "torch" && o.name == "Size" => match o.args.first() {
            Some(Value::Tuple(t) | Value::List(t)) if o.args.len() == 1 => t,
            None => return Ok(Vec::new()),
            _ => return Err(FormatError::invalid(file, at, "a torch.Size whose argument is not a tuple")),
        },
        Value::Tuple(t) | Value::List(t) => t,
        other => return Err(FormatError::invalid(file, at, format!("{} where a torch.Size belongs", kind(other)))),
    };
    items
        .iter()
        .map(|x| as_u64(x).ok_or_else(|| FormatError::invalid(file, at, format!("{x:?} is not a size"))))
        .collect()
}

/// A non-negative int that fits in 64 bits: a pickle writes those above `i64::MAX` as a
/// `LONG1` of little-endian two's complement bytes.
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::BigInt(b) => {
            // A trailing zero byte only carries the sign; a set top bit is negative.
            let body = match b.split_last() {
                Some((&0, rest)) => rest,
                Some((&last, _)) if last & 0x80 != 0 => return None,
                _ => b.as_slice(),
            };
            if body.len() > 8 {
                return None;
            }
            let mut le = [0u8; 8];
            le[..body.len()].copy_from_slice(body);
            Some(u64::from_le_bytes(le))
        }
        other => other.as_i64().and_then(|n| u64::try_from(n).ok()),
    }
}

fn metadata_index(v: &Value, file: &str, at: &str) -> Result<MetadataIndex, FormatError> {
    let o = expect_object(v, "MetadataIndex", file, at)?;
    let f = fields_of(o, file, at)?;
    let fqn = required(&f, "fqn", file, at)?
        .as_str()
        .ok_or_else(|| FormatError::invalid(file, at, "an fqn that is not a str"))?
        .to_string();
    let offset = match field(&f, "offset") {
        None | Some(Value::None) => None,
        Some(s) => Some(size_of(s, file, &format!("{at} ({fqn}).offset"))?),
    };
    let index = match field(&f, "index") {
        None | Some(Value::None) => None,
        Some(i) => match i.as_i64() {
            Some(n) if n >= 0 => Some(n as u64),
            _ => return Err(FormatError::invalid(file, format!("{at} ({fqn}).index"), "not a non-negative int")),
        },
    };
    Ok(MetadataIndex { fqn, offset, index })
}

fn storage_info(v: &Value, file: &str, at: &str) -> Result<StorageInfo, FormatError> {
    let o = expect_object(v, "_StorageInfo", file, at)?;
    let f = fields_of(o, file, at)?;
    let relative_path = required(&f, "relative_path", file, at)?
        .as_str()
        .ok_or_else(|| FormatError::invalid(file, at, "a relative_path that is not a str"))?
        .to_string();
    let num = |name: &str| -> Result<u64, FormatError> {
        as_u64(required(&f, name, file, at)?).ok_or_else(|| {
            FormatError::invalid(file, format!("{at} ({relative_path}).{name}"), "not a non-negative int")
        })
    };
    let offset = num("offset")?;
    let length = num("length")?;
    let transformed = match field(&f, "transform_descriptors") {
        None | Some(Value::None) => false,
        Some(Value::List(l) | Value::Tuple(l)) => !l.is_empty(),
        Some(_) => true,
    };
    Ok(StorageInfo { relative_path, offset, length, transformed })
}

/// A Megatron `ShardedObject` key, `key/shard_<offsets>_<shape>` (each `.`-joined), split
/// into its parts; `None` for any other key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardedObjectKey {
    /// The object's key.
    pub key: String,
    /// Its position in the object grid.
    pub offset: Vec<u64>,
    /// The grid's shape.
    pub shape: Vec<u64>,
}

impl ShardedObjectKey {
    /// Parses `unique_key`.
    pub fn parse(unique_key: &str) -> Option<ShardedObjectKey> {
        let (key, rest) = unique_key.rsplit_once("/shard_")?;
        let (offset, shape) = rest.split_once('_')?;
        let nums = |s: &str| s.split('.').map(|x| x.parse::<u64>().ok()).collect::<Option<Vec<u64>>>();
        let (offset, shape) = (nums(offset)?, nums(shape)?);
        if key.is_empty() || offset.len() != shape.len() {
            return None;
        }
        Some(ShardedObjectKey { key: key.to_string(), offset, shape })
    }
}

/// Megatron's key of the object at `offset` of a grid of `shape` under `key`, the
/// spelling [`ShardedObjectKey::parse`] reads (`key/shard_0.1_1.2`).
pub fn megatron_key(key: &str, offset: &[u64], shape: &[u64]) -> String {
    let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
    format!("{key}/shard_{}_{}", join(offset), join(shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DCP_2_15: &[u8] = include_bytes!("../../../../tests/fixtures/torch/dcp-2.15/.metadata");
    const DCP_2_3: &[u8] = include_bytes!("../../../../tests/fixtures/torch/dcp-2.3/.metadata");
    const MEGATRON: &[u8] = include_bytes!("../../../../tests/fixtures/torch/megatron-0.16.1/.metadata");
    const ITEMS_2_15: &[u8] = include_bytes!("../../../../tests/fixtures/torch/dcp-2.15/__1_0.distcp");

    #[test]
    fn every_release_decodes_to_the_same_tensors() {
        let new = DcpMetadata::decode(DCP_2_15, "2.15").unwrap();
        let old = DcpMetadata::decode(DCP_2_3, "2.3").unwrap();
        let tensors = |m: &DcpMetadata| {
            let mut t: Vec<(String, TensorMeta)> = m
                .state_dict_metadata
                .iter()
                .filter_map(|(k, e)| match e {
                    StateEntry::Tensor(t) => Some((k.clone(), t.clone())),
                    StateEntry::Bytes => None,
                })
                .collect();
            t.sort_by(|a, b| a.0.cmp(&b.0));
            t
        };
        assert_eq!(tensors(&new), tensors(&old));
        let row = new.entry("row.weight").unwrap();
        let StateEntry::Tensor(row) = row else { panic!("{row:?}") };
        assert_eq!((row.dtype, row.size.clone(), row.chunks.len()), (DType::Bf16, vec![4, 6], 2));
        assert_eq!(row.chunks[1], ChunkMeta { offsets: vec![2, 0], sizes: vec![2, 6] });
        // 2.15 records a version and a save id; 2.3 neither.
        assert_eq!((new.version.as_deref(), new.save_id.is_some()), (Some("1.0.0"), true));
        assert_eq!((old.version.as_deref(), old.save_id.is_some()), (None, false));
        assert!(new.storage_data.iter().any(|(k, _)| k.index == Some(0)));
        assert_eq!(new.storage_data.len(), 11 + 4);
        let m = DcpMetadata::decode(MEGATRON, "megatron").unwrap();
        assert_eq!(m.extra_attributes, ["all_local_plans"]);
    }

    /// Megatron up to 0.15 stores some optimizer state N-D reformulated and names the
    /// original shape in `mcore_data`: the keys that do are found, for a converter to refuse.
    #[test]
    fn keys_megatron_stored_reformulated_are_found() {
        use crate::write::Pickler;
        let mut p = Pickler::new();
        p.global("torch.distributed.checkpoint.metadata", "Metadata").new_object().empty_dict().mark();
        p.str("state_dict_metadata").empty_dict().str("mcore_data").empty_dict().mark();
        p.str("opt.exp_avg").empty_dict().mark().str("nd_reformulated_orig_global_shape").int_tuple(&[4, 6]).setitems();
        p.str("opt.step").empty_dict();
        p.setitems().setitems().build();
        let m = DcpMetadata::decode(&p.finish(), "reformulated").unwrap();
        assert_eq!(m.reformulated, ["opt.exp_avg"]);
        assert!(DcpMetadata::decode(MEGATRON, "megatron").unwrap().reformulated.is_empty());
    }

    #[test]
    fn an_items_data_pkl_gives_the_view() {
        let md = DcpMetadata::decode(DCP_2_15, "2.15").unwrap();
        let idx = md.storage_index();
        let info = idx[&("transposed", Some([0u64, 0].as_slice()))];
        assert_eq!(info.relative_path, "__1_0.distcp");
        let item = &ITEMS_2_15[info.offset as usize..(info.offset + info.length) as usize];
        let entries = crate::zip::entries(item, "item").unwrap();
        let pkl = entries.iter().find(|e| e.record.name.ends_with("/data.pkl")).unwrap();
        let t = TorchSaveTensor::decode(pkl.stored_data(item, "item").unwrap(), "data.pkl").unwrap();
        assert_eq!(
            t,
            TorchSaveTensor {
                dtype: DType::F32,
                storage_key: "0".into(),
                storage_numel: 6,
                storage_offset: 0,
                size: vec![3, 2],
                stride: vec![1, 3],
            }
        );
    }

    /// Every truncation and many single-byte changes of real metadata decode or fail, and
    /// never panic (the fuzz target `unpickle_dcp` explores further).
    #[test]
    fn damaged_metadata_never_panics() {
        for bytes in [DCP_2_15, DCP_2_3, MEGATRON] {
            for n in 0..bytes.len() {
                assert!(DcpMetadata::decode(&bytes[..n], "cut").is_err());
            }
            let mut b = bytes.to_vec();
            for i in 0..b.len() {
                for x in [0x00, 0xff, b[i] ^ 0x01, b[i].wrapping_add(1)] {
                    let keep = b[i];
                    b[i] = x;
                    let _ = DcpMetadata::decode(&b, "flipped");
                    b[i] = keep;
                }
            }
        }
    }

    #[test]
    fn sharded_object_keys_parse() {
        let k = ShardedObjectKey::parse("rng_state/shard_0.1_1.8").unwrap();
        assert_eq!((k.key.as_str(), k.offset, k.shape), ("rng_state", vec![0, 1], vec![1, 8]));
        assert_eq!(ShardedObjectKey::parse("a/b/shard_3_80").unwrap().key, "a/b");
        assert!(ShardedObjectKey::parse("decoder.weight").is_none());
        assert!(ShardedObjectKey::parse("x/shard_1.2_3").is_none());
        assert!(ShardedObjectKey::parse("x/shard_a_3").is_none());
    }

    #[test]
    fn megatron_keys_are_what_parse_reads() {
        assert_eq!(megatron_key("rng_state", &[0, 1], &[1, 8]), "rng_state/shard_0.1_1.8");
        let k = ShardedObjectKey::parse(&megatron_key("a/b", &[3], &[80])).unwrap();
        assert_eq!((k.key.as_str(), k.offset, k.shape), ("a/b", vec![3], vec![80]));
    }

    #[test]
    fn a_view_past_its_storage_is_refused() {
        let t = TorchSaveTensor {
            dtype: DType::F32,
            storage_key: "0".into(),
            storage_numel: 6,
            storage_offset: 1,
            size: vec![3, 2],
            stride: vec![1, 3],
        };
        assert_eq!(t.span(), Some(1..7));
        let e = t.check_storage(24, "f").unwrap_err().to_string();
        assert!(e.contains("reaches past the 6 elements"), "{e}");
        let t = TorchSaveTensor { storage_offset: 0, ..t };
        t.check_storage(24, "f").unwrap();
        assert!(t.check_storage(20, "f").unwrap_err().to_string().contains("holds 20 bytes"));
        let huge = TorchSaveTensor { size: vec![u64::MAX, 3], stride: vec![u64::MAX, 1], ..t.clone() };
        assert_eq!(huge.span(), None);
        assert!(huge.check_storage(24, "f").is_err());
        // A stride of 0 spans one element of the storage, whatever the size claims.
        let repeated = TorchSaveTensor { size: vec![1 << 61], stride: vec![0], ..t };
        assert_eq!(repeated.span(), Some(0..1));
        let e = repeated.check_storage(24, "f").unwrap_err().to_string();
        assert!(e.contains("more elements than the 6 of its storage"), "{e}");
    }
}
