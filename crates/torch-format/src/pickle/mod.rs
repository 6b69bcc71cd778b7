//! A restricted reader of Python pickles, protocols 2 to 5, that never executes anything.
//!
//! [`unpickle`] runs the pickle machine over the bytes with an arena of nodes instead of
//! Python objects, so that the memo shares what Python shares (a list memoized while empty
//! and filled afterwards is seen filled through every reference), and then expands the root
//! into a [`Value`] tree. Globals are the only way a pickle names code: every `GLOBAL` and
//! `STACK_GLOBAL` is checked against the caller's allow-list and refused, naming
//! `module.name` and its byte offset, when it is not on it. A call of an allowed global
//! (`REDUCE`, `NEWOBJ`, `NEWOBJ_EX`) and a `BUILD` on its result are recorded as an
//! [`Object`]; nothing is ever called. Three stdlib encodings are decoded instead of recorded,
//! when their global is allowed: `_codecs.encode(str, "latin1")` (how protocol 2 writes
//! `bytes`) as [`Value::Bytes`], and `builtins.set(list)` / `builtins.frozenset(list)` (how
//! protocols 2 and 3 write sets) as [`Value::Set`] / [`Value::FrozenSet`]. Below protocol
//! 3, `__builtin__` and `copy_reg` are read as `builtins` and `copyreg`, as Python does.
//! A pickle is one value ending exactly at its `STOP`: leftover values, open marks and bytes
//! after `STOP` are refused.
//!
//! Limits, all in [`Limits`]: the memo holds at most `memo_entries_max` entries, the tree is
//! at most `depth_max` deep (expansion recurses, bounded by it; a memo cycle such as a list
//! that contains itself is refused), and the expanded tree holds at most
//! `decoded_bytes_per_input_byte` bytes per input byte (each value counted at
//! `size_of::<Value>()`, each string at its length too), so that a memo reference repeated
//! many times cannot blow up memory. While the machine runs, every opcode adds at most one
//! node and refers to its operands rather than copying them (a call's arguments, a
//! global's names: one node per distinct global), and every length is checked against the
//! bytes that remain before anything is allocated, so the arena is bounded by the input.
//!
//! Errors are a [`PickleError`]: a [`PickleErrorKind`] and the byte offset of the opcode
//! where it was found. [`PickleError::into_format_error`] turns one into `dckpt-format`'s
//! [`FormatError`] (kind [`FormatErrorKind::Malformed`]) for a reader that reports per file.
//!
//! ```
//! use dckpt_torch_format::pickle::{Value, unpickle};
//!
//! // pickle.dumps({"a": [1, 2.5, None]}, protocol=4)
//! let bytes = [
//!     0x80, 0x04, 0x95, 0x18, 0, 0, 0, 0, 0, 0, 0, 0x7d, 0x94, 0x8c, 0x01, b'a', 0x94, 0x5d,
//!     0x94, 0x28, 0x4b, 0x01, 0x47, 0x40, 0x04, 0, 0, 0, 0, 0, 0, 0x4e, 0x65, 0x73, 0x2e,
//! ];
//! let v = unpickle(&bytes, &[]).unwrap();
//! let expect = Value::Dict(vec![(
//!     Value::Str("a".into()),
//!     Value::List(vec![Value::Int(1), Value::Float(2.5), Value::None]),
//! )]);
//! assert_eq!(v, expect);
//!
//! // A global that is not allowed is refused, never called.
//! let evil = b"\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.";
//! let e = unpickle(evil, &[]).unwrap_err();
//! assert_eq!(e.to_string(), "global `posix.system` is not on the allow-list (at byte 2)");
//! ```

mod expand;
mod machine;

use std::collections::HashMap;

use dckpt_format::{FormatError, FormatErrorKind};

use expand::Expand;
use machine::Machine;

/// A decoded pickle: the Python values it builds, with calls recorded rather than made.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An `int` that fits in 64 bits.
    Int(i64),
    /// An `int` that does not fit in 64 bits: its little-endian two's complement bytes, as
    /// `LONG1`/`LONG4` carry them.
    BigInt(Vec<u8>),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `bytes` (also a Python 2 `str`, `BINSTRING`).
    Bytes(Vec<u8>),
    /// A `bytearray` (`BYTEARRAY8`, protocol 5).
    ByteArray(Vec<u8>),
    /// A `tuple`.
    Tuple(Vec<Value>),
    /// A `list`.
    List(Vec<Value>),
    /// A `dict`, its items in pickle order.
    Dict(Vec<(Value, Value)>),
    /// A `set`, its elements in pickle order.
    Set(Vec<Value>),
    /// A `frozenset`, its elements in pickle order.
    FrozenSet(Vec<Value>),
    /// An allowed global used as a value (a class, a function, or a module attribute such
    /// as `torch.float32`).
    Global {
        /// The module, e.g. `torch`.
        module: String,
        /// The name in it, e.g. `float32`.
        name: String,
    },
    /// What a call of an allowed global would have built.
    Object(Box<Object>),
    /// A persistent id (`BINPERSID`): `torch.save` refers to its storages this way.
    PersistentId(Box<Value>),
}

/// A call of an allowed global, recorded: `REDUCE` (`callable(*args)`), `NEWOBJ`
/// (`cls.__new__(cls, *args)`) or `NEWOBJ_EX` (with keyword arguments), then whatever the
/// pickle did to the result (`BUILD`, `SETITEM(S)`, `APPEND(S)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Object {
    /// The global's module.
    pub module: String,
    /// The global's name.
    pub name: String,
    /// The positional arguments.
    pub args: Vec<Value>,
    /// The keyword arguments (`NEWOBJ_EX` only).
    pub kwargs: Vec<(Value, Value)>,
    /// The state given to `BUILD` (`__setstate__`'s argument, or the `__dict__` items; a
    /// dataclass's is a dict of its fields), if any.
    pub state: Option<Value>,
    /// Items set on it (`SETITEM(S)`), as an `OrderedDict`'s are.
    pub items: Vec<(Value, Value)>,
    /// Elements appended to it (`APPEND(S)`), as a `list` subclass's are.
    pub appended: Vec<Value>,
}

impl Value {
    /// The string, if this is a [`Value::Str`].
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is a [`Value::Int`] (or a [`Value::Bool`], as in Python).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// The value under the string key `key`, if this is a [`Value::Dict`] that has it.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
            _ => None,
        }
    }

    /// `(module, name)` if this is a [`Value::Global`].
    pub fn as_global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }
}

/// The globals that PyTorch DCP's `.metadata` pickle names, checked against the sources of
/// PyTorch 2.3 to 2.9 (`torch/distributed/checkpoint/metadata.py`, `filesystem.py`,
/// `planner.py`). More may be needed for other releases or custom planners and storage
/// writers: a reader refuses them by name, and this list is where to add them.
///
/// - the dataclasses, pickled with `NEWOBJ` + `BUILD` of their field dict (`TensorProperties`
///   has its own `__getstate__`: a tuple with the memory format as an `_MEM_FORMAT_ENCODING`
///   enum member, which pickles as a `REDUCE` of the enum class with its value);
/// - `torch.Size` (a `REDUCE` with a tuple of ints), dtypes and layouts (module attributes
///   such as `torch.float32`, `torch.strided`, pickled as bare globals);
/// - `collections.OrderedDict`, `builtins.set`/`frozenset`, `pathlib` paths (a
///   `StorageMeta.checkpoint_id` may be a path), `_codecs.encode` (protocol 2 `bytes`), and
///   the planner's `WriteItemType`/`LoadItemType` enums.
pub const DCP_METADATA_GLOBALS: &[(&str, &str)] = &[
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    // Releases before DCP had its own `TensorProperties` pickled the sharded tensor's.
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    // Megatron keeps its planner's local plans on the metadata (`all_local_plans`).
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
    // Layouts since 2.4 or so: `_get_layout("torch.strided")`.
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("torch", "strided"),
    ("torch", "sparse_coo"),
    ("torch", "float64"),
    ("torch", "float32"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "float8_e4m3fn"),
    ("torch", "float8_e5m2"),
    ("torch", "float8_e4m3fnuz"),
    ("torch", "float8_e5m2fnuz"),
    ("torch", "complex128"),
    ("torch", "complex64"),
    ("torch", "complex32"),
    ("torch", "int64"),
    ("torch", "int32"),
    ("torch", "int16"),
    ("torch", "int8"),
    ("torch", "uint8"),
    ("torch", "uint16"),
    ("torch", "uint32"),
    ("torch", "uint64"),
    ("torch", "bool"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("_codecs", "encode"),
];

/// The deepest nesting any decode accepts, whatever [`Limits::depth_max`] says: deep
/// enough for any metadata, shallow enough for a thread's stack.
pub const DEPTH_CEILING: usize = 1000;

/// The bounds a decode works within; [`Limits::default`] suits DCP metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The deepest nesting of the decoded tree (the root is depth 1). Expansion recurses
    /// once per level, so values above [`DEPTH_CEILING`] are taken as it.
    pub depth_max: usize,
    /// The most memo entries.
    pub memo_entries_max: usize,
    /// What the expanded tree may hold per byte of input, in bytes: each value counts
    /// `size_of::<Value>()`, each string or bytes its length too; 64 KiB are allowed on
    /// top, whatever the input.
    pub decoded_bytes_per_input_byte: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { depth_max: 100, memo_entries_max: 1 << 22, decoded_bytes_per_input_byte: 128 }
    }
}

/// Why a pickle was refused, and where ([`PickleError::offset`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind} (at byte {offset})")]
pub struct PickleError {
    kind: PickleErrorKind,
    offset: u64,
}

/// What is wrong with a pickle, one variant per kind of failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickleErrorKind {
    /// A global that is not on the allow-list.
    #[error("global `{module}.{name}` is not on the allow-list")]
    Forbidden {
        /// Its module.
        module: String,
        /// Its name.
        name: String,
    },
    /// The bytes end inside an opcode's argument or before `STOP`.
    #[error("the pickle ends inside {what}")]
    Truncated {
        /// What was being read.
        what: &'static str,
    },
    /// A byte that is no pickle opcode.
    #[error("unknown opcode 0x{0:02x}")]
    UnknownOpcode(u8),
    /// An opcode this reader does not take (protocol 0 and 1 text forms, extensions,
    /// out-of-band buffers).
    #[error("opcode {0} is not supported")]
    UnsupportedOpcode(&'static str),
    /// A protocol newer than 5.
    #[error("protocol {0} is not supported (this reader takes up to 5)")]
    UnsupportedProtocol(u8),
    /// Opcodes that do not fit together: a pop of an empty stack, a missing mark, a
    /// `SETITEM` on a tuple, a memo key never stored, invalid UTF-8, bytes after `STOP`, ...
    #[error("{0}")]
    Malformed(String),
    /// A bound of [`Limits`] was reached.
    #[error("{what} exceeds the limit of {limit}")]
    LimitExceeded {
        /// What was counted, e.g. `memo entries`.
        what: &'static str,
        /// The bound.
        limit: u64,
    },
}

impl PickleError {
    /// What is wrong.
    pub fn kind(&self) -> &PickleErrorKind {
        &self.kind
    }

    /// The byte offset of the opcode where it was found (for a failure while expanding the
    /// tree, of the opcode that made the value concerned).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// This error as a [`FormatError`] about `file` (field `pickle`, kind
    /// [`FormatErrorKind::Malformed`] with the same detail and offset).
    pub fn into_format_error(self, file: &str) -> FormatError {
        FormatError::new(
            file,
            "pickle",
            FormatErrorKind::Malformed { detail: self.kind.to_string(), offset: self.offset },
        )
    }
}

/// Decodes `bytes`, one pickle that ends exactly at its `STOP`, with [`Limits::default`];
/// `allowed` lists the `(module, name)` globals it may name.
pub fn unpickle(bytes: &[u8], allowed: &[(&str, &str)]) -> Result<Value, PickleError> {
    unpickle_with(bytes, &|module, name| allowed.iter().any(|&(m, n)| m == module && n == name), &Limits::default())
}

/// Decodes `bytes` as [`unpickle`] does, with a predicate over `(module, name)` for the
/// globals it may name and explicit limits.
pub fn unpickle_with(
    bytes: &[u8],
    allowed: &dyn Fn(&str, &str) -> bool,
    limits: &Limits,
) -> Result<Value, PickleError> {
    let mut machine = Machine {
        input: bytes,
        pos: 0,
        op_at: 0,
        nodes: vec![],
        at: vec![],
        stack: vec![],
        marks: vec![],
        memo: HashMap::new(),
        globals: HashMap::new(),
        allowed,
        limits,
        proto: 2,
    };
    let root = machine.run()?;
    let budget = limits.decoded_bytes_per_input_byte.saturating_mul(bytes.len() as u64).saturating_add(64 << 10);
    let mut expand = Expand {
        nodes: &machine.nodes,
        at: &machine.at,
        limits,
        units_left: budget,
        budget,
        on_path: vec![false; machine.nodes.len()],
    };
    expand.value(root, 1)
}
