//! An item's `data.pkl`: the tensor `torch.save` rebuilds, and where its bytes lie.

use dckpt_shard_spec::{DType, checked_numel};

use super::{kind, size_of, torch_dtype};
use crate::pickle::{Value, unpickle};
use dckpt_format::FormatError;

/// The globals an item's `data.pkl` may name: the tensor rebuild functions, the typed
/// storage classes of the persistent ids, dtypes, and the `OrderedDict` of backward hooks.
pub const TORCH_SAVE_GLOBALS: &[(&str, &str)] = &[
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("collections", "OrderedDict"),
    ("torch", "BoolStorage"),
    ("torch", "ByteStorage"),
    ("torch", "CharStorage"),
    ("torch", "ShortStorage"),
    ("torch", "IntStorage"),
    ("torch", "LongStorage"),
    ("torch", "HalfStorage"),
    ("torch", "BFloat16Storage"),
    ("torch", "FloatStorage"),
    ("torch", "DoubleStorage"),
    ("torch", "Float8_e4m3fnStorage"),
    ("torch", "Float8_e5m2Storage"),
    ("torch", "UntypedStorage"),
    // What `torch.save` names for dtypes without a typed storage class (the float8 ones).
    ("torch.storage", "UntypedStorage"),
    ("torch", "bool"),
    ("torch", "uint8"),
    ("torch", "int8"),
    ("torch", "int16"),
    ("torch", "int32"),
    ("torch", "int64"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "float32"),
    ("torch", "float64"),
    ("torch", "float8_e4m3fn"),
    ("torch", "float8_e5m2"),
];

/// The tensor of one item's `data.pkl`: a view of one storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchSaveTensor {
    /// Its dtype.
    pub dtype: DType,
    /// The storage's key: its bytes are the entry `<archive>/data/<key>`.
    pub storage_key: String,
    /// The storage's element count, as the persistent id records it.
    pub storage_numel: u64,
    /// Where the view starts in the storage, in elements.
    pub storage_offset: u64,
    /// The view's size.
    pub size: Vec<u64>,
    /// The view's strides, in elements (a transposed tensor keeps its own).
    pub stride: Vec<u64>,
}

impl TorchSaveTensor {
    /// Decodes an item's `data.pkl`; `file` names it in errors.
    pub fn decode(bytes: &[u8], file: &str) -> Result<TorchSaveTensor, FormatError> {
        let root = unpickle(bytes, TORCH_SAVE_GLOBALS).map_err(|e| e.into_format_error(file))?;
        let Value::Object(o) = &root else {
            return Err(FormatError::invalid(file, "data.pkl", format!("{} where a tensor belongs", kind(&root))));
        };
        let v3 = match (o.module.as_str(), o.name.as_str()) {
            ("torch._utils", "_rebuild_tensor_v2") => false,
            ("torch._utils", "_rebuild_tensor_v3") => true,
            (m, n) => {
                return Err(FormatError::invalid(
                    file,
                    "data.pkl",
                    format!("a call of {m}.{n} where a tensor belongs"),
                ));
            }
        };
        let arg = |i: usize, what: &str| {
            o.args
                .get(i)
                .ok_or_else(|| FormatError::invalid(file, "data.pkl", format!("{}: no {what} argument", o.name)))
        };
        let Value::PersistentId(pid) = arg(0, "storage")? else {
            return Err(FormatError::invalid(file, "data.pkl", "the storage is not a persistent id"));
        };
        let Value::Tuple(pid) = pid.as_ref() else {
            return Err(FormatError::invalid(file, "data.pkl.storage", "a persistent id that is not a tuple"));
        };
        if pid.len() != 5 || pid[0].as_str() != Some("storage") {
            return Err(FormatError::invalid(
                file,
                "data.pkl.storage",
                "not a ('storage', type, key, location, numel) id",
            ));
        }
        let storage_key = match &pid[2] {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => return Err(FormatError::invalid(file, "data.pkl.storage.key", "not a str")),
        };
        let storage_numel = match pid[4].as_i64() {
            Some(n) if n >= 0 => n as u64,
            _ => return Err(FormatError::invalid(file, "data.pkl.storage.numel", "not a non-negative int")),
        };
        let dtype =
            if v3 { torch_dtype(arg(6, "dtype")?, file, "data.pkl.dtype")? } else { storage_dtype(&pid[1], file)? };
        // An untyped storage counts bytes, a typed one elements.
        let untyped = matches!(pid[1].as_global(), Some(("torch" | "torch.storage", "UntypedStorage")));
        let storage_numel = if untyped {
            if !storage_numel.is_multiple_of(dtype.size()) {
                let what = format!("an untyped storage of {storage_numel} bytes holds no whole {dtype} elements");
                return Err(FormatError::invalid(file, "data.pkl.storage.numel", what));
            }
            storage_numel / dtype.size()
        } else {
            storage_numel
        };
        let storage_offset = match arg(1, "storage offset")?.as_i64() {
            Some(n) if n >= 0 => n as u64,
            _ => return Err(FormatError::invalid(file, "data.pkl.storage_offset", "not a non-negative int")),
        };
        let size = size_of(arg(2, "size")?, file, "data.pkl.size")?;
        let stride = size_of(arg(3, "stride")?, file, "data.pkl.stride")?;
        if size.len() != stride.len() {
            return Err(FormatError::invalid(
                file,
                "data.pkl",
                format!("size {size:?} and stride {stride:?} disagree"),
            ));
        }
        Ok(TorchSaveTensor { dtype, storage_key, storage_numel, storage_offset, size, stride })
    }

    /// The view's element count (`None` on overflow).
    pub fn numel(&self) -> Option<u64> {
        checked_numel(&self.size)
    }

    /// The storage elements the view reaches, `[first, last + 1)` (empty for an empty
    /// view), or `None` on overflow.
    pub fn span(&self) -> Option<std::ops::Range<u64>> {
        if self.size.contains(&0) {
            return Some(self.storage_offset..self.storage_offset);
        }
        let mut last = self.storage_offset;
        for (&s, &st) in self.size.iter().zip(&self.stride) {
            last = last.checked_add((s - 1).checked_mul(st)?)?;
        }
        Some(self.storage_offset..last.checked_add(1)?)
    }

    /// Checks that the view lies within its storage of `storage_bytes` bytes (the entry's
    /// length) and that the storage holds exactly `storage_numel` elements.
    pub fn check_storage(&self, storage_bytes: u64, file: &str) -> Result<(), FormatError> {
        let want = self.storage_numel.checked_mul(self.dtype.size());
        if want != Some(storage_bytes) {
            let what = format!(
                "storage {} of {} {} elements, but its entry holds {storage_bytes} bytes",
                self.storage_key, self.storage_numel, self.dtype
            );
            return Err(FormatError::invalid(file, "data.pkl.storage", what));
        }
        // More elements than the storage holds: a view that repeats elements (a stride of
        // 0, an expanded tensor). DCP and Megatron clone such views before they save, and
        // read back it would turn a few stored bytes into a tensor of any size.
        if self.numel().is_none_or(|n| n > self.storage_numel) {
            let what = format!(
                "view of size {:?} has more elements than the {} of its storage (stride {:?})",
                self.size, self.storage_numel, self.stride
            );
            return Err(FormatError::invalid(file, "data.pkl", what));
        }
        match self.span() {
            Some(span) if span.end <= self.storage_numel || span.is_empty() => Ok(()),
            _ => {
                let what = format!(
                    "view at offset {} with size {:?} and stride {:?} reaches past the {} elements of its storage",
                    self.storage_offset, self.size, self.stride, self.storage_numel
                );
                Err(FormatError::invalid(file, "data.pkl", what))
            }
        }
    }
}

fn storage_dtype(v: &Value, file: &str) -> Result<DType, FormatError> {
    let Some(("torch", name)) = v.as_global() else {
        return Err(FormatError::invalid(
            file,
            "data.pkl.storage.type",
            format!("{} where a storage type belongs", kind(v)),
        ));
    };
    Ok(match name {
        "BoolStorage" => DType::Bool,
        "ByteStorage" => DType::U8,
        "CharStorage" => DType::I8,
        "ShortStorage" => DType::I16,
        "IntStorage" => DType::I32,
        "LongStorage" => DType::I64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::Bf16,
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "Float8_e4m3fnStorage" => DType::F8E4m3,
        "Float8_e5m2Storage" => DType::F8E5m2,
        other => {
            return Err(FormatError::invalid(
                file,
                "data.pkl.storage.type",
                format!("storage type torch.{other} is not supported"),
            ));
        }
    })
}
