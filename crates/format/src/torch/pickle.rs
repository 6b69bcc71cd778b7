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
//! where it was found. [`PickleError::into_format_error`] turns one into this crate's
//! [`FormatError`] (kind [`FormatErrorKind::Malformed`]) for a reader that reports per file.
//!
//! ```
//! use dckpt_format::torch::pickle::{Value, unpickle};
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

use std::collections::HashMap;

use crate::{FormatError, FormatErrorKind};

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

type Id = usize;

/// A value under construction: containers refer to other nodes by index, so the memo and
/// later mutations share them as Python does.
enum Node {
    Scalar(Value),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    FrozenSet(Vec<Id>),
    Global {
        module: String,
        name: String,
    },
    /// A call of a global (a `Node::Global`) with a tuple (and a dict of keywords).
    Object {
        class: Id,
        args: Id,
        kwargs: Option<Id>,
        state: Option<Id>,
        items: Vec<(Id, Id)>,
        appended: Vec<Id>,
    },
    /// `_codecs.encode(text, encoding)`: two arguments, checked when expanded.
    Latin1 {
        args: Id,
    },
    /// `builtins.set(iterable)` or `frozenset(iterable)`: at most one argument.
    SetOf {
        args: Id,
        frozen: bool,
    },
    PersistentId(Id),
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    /// Where the opcode being run starts: every error names it.
    op_at: usize,
    nodes: Vec<Node>,
    /// The offset of the opcode that made each node.
    at: Vec<u64>,
    stack: Vec<Id>,
    /// The stack's length at each open `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Id>,
    /// The global node made for each `module\nname`.
    globals: HashMap<String, Id>,
    allowed: &'a dyn Fn(&str, &str) -> bool,
    limits: &'a Limits,
    /// The protocol `PROTO` declared (2 without one).
    proto: u8,
}

impl Machine<'_> {
    fn err(&self, kind: PickleErrorKind) -> PickleError {
        PickleError { kind, offset: self.op_at as u64 }
    }

    fn malformed(&self, detail: impl Into<String>) -> PickleError {
        self.err(PickleErrorKind::Malformed(detail.into()))
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], PickleError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.input.len());
        let Some(end) = end else { return Err(self.err(PickleErrorKind::Truncated { what })) };
        let s = &self.input[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], PickleError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, PickleError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length read from the input, checked against the bytes that remain.
    fn checked_len(&mut self, declared: u64, what: &'static str) -> Result<usize, PickleError> {
        let left = (self.input.len() - self.pos) as u64;
        if declared > left {
            return Err(self.err(PickleErrorKind::Truncated { what }));
        }
        Ok(declared as usize)
    }

    fn bytes(&mut self, declared: u64, what: &'static str) -> Result<Vec<u8>, PickleError> {
        let n = self.checked_len(declared, what)?;
        Ok(self.take(n, what)?.to_vec())
    }

    fn string(&mut self, declared: u64) -> Result<String, PickleError> {
        let b = self.bytes(declared, "a string")?;
        String::from_utf8(b).map_err(|e| self.malformed(format!("a string is not UTF-8: {e}")))
    }

    /// A `\n`-terminated line (`GLOBAL`'s module and name), without the newline.
    fn line(&mut self, what: &'static str) -> Result<String, PickleError> {
        let rest = &self.input[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.err(PickleErrorKind::Truncated { what }));
        };
        let s =
            std::str::from_utf8(&rest[..n]).map_err(|_| self.malformed(format!("{what} is not UTF-8")))?.to_string();
        self.pos += n + 1;
        Ok(s)
    }

    fn add(&mut self, node: Node) -> Id {
        self.nodes.push(node);
        self.at.push(self.op_at as u64);
        self.nodes.len() - 1
    }

    fn push(&mut self, node: Node) {
        let id = self.add(node);
        self.stack.push(id);
    }

    fn push_scalar(&mut self, v: Value) {
        self.push(Node::Scalar(v));
    }

    fn pop(&mut self) -> Result<Id, PickleError> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return Err(self.malformed("pop of an empty stack (or past a mark)"));
        }
        Ok(self.stack.pop().unwrap_or_default())
    }

    fn top(&self) -> Result<Id, PickleError> {
        match self.stack.last() {
            Some(&id) if self.stack.len() > self.marks.last().copied().unwrap_or(0) => Ok(id),
            _ => Err(self.malformed("no value on the stack")),
        }
    }

    /// The values since the last mark, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Id>, PickleError> {
        let Some(mark) = self.marks.pop() else { return Err(self.malformed("no mark on the stack")) };
        Ok(self.stack.split_off(mark))
    }

    fn pairs(&self, ids: Vec<Id>) -> Result<Vec<(Id, Id)>, PickleError> {
        if !ids.len().is_multiple_of(2) {
            return Err(self.malformed("an odd number of values for keys and values"));
        }
        Ok(ids.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    fn memo_put(&mut self, key: u32) -> Result<(), PickleError> {
        let top = self.top()?;
        if self.memo.len() >= self.limits.memo_entries_max && !self.memo.contains_key(&key) {
            return Err(self.err(PickleErrorKind::LimitExceeded {
                what: "memo entries",
                limit: self.limits.memo_entries_max as u64,
            }));
        }
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), PickleError> {
        let Some(&id) = self.memo.get(&key) else {
            return Err(self.malformed(format!("memo key {key} was never stored")));
        };
        self.stack.push(id);
        Ok(())
    }

    fn global(&mut self, module: String, name: String) -> Result<(), PickleError> {
        // Protocols below 3 name the stdlib's modules as Python 2 did, and Python's reader
        // renames them (`_compat_pickle`); the two that stdlib types use:
        let module = match module.as_str() {
            "__builtin__" if self.proto < 3 => "builtins".to_string(),
            "copy_reg" if self.proto < 3 => "copyreg".to_string(),
            _ => module,
        };
        if !(self.allowed)(&module, &name) {
            return Err(self.err(PickleErrorKind::Forbidden { module, name }));
        }
        // One node per distinct global: memo references to long strings cannot make
        // `STACK_GLOBAL` copy them again and again.
        let key = format!("{module}\n{name}");
        if let Some(&id) = self.globals.get(&key) {
            self.stack.push(id);
            return Ok(());
        }
        let id = self.add(Node::Global { module, name });
        self.globals.insert(key, id);
        self.stack.push(id);
        Ok(())
    }

    fn str_node(&self, id: Id, what: &str) -> Result<String, PickleError> {
        match &self.nodes[id] {
            Node::Scalar(Value::Str(s)) => Ok(s.clone()),
            _ => Err(self.malformed(format!("{what} is not a string"))),
        }
    }

    fn tuple_len(&self, id: Id, what: &str) -> Result<usize, PickleError> {
        match &self.nodes[id] {
            Node::Tuple(items) => Ok(items.len()),
            _ => Err(self.malformed(format!("{what} is not a tuple"))),
        }
    }

    /// `REDUCE`, `NEWOBJ` and `NEWOBJ_EX`: the call recorded, or one of the stdlib
    /// encodings decoded. Arguments are referred to, never copied, so that repeating a call
    /// on a memoized argument costs no more than its opcodes.
    fn call(&mut self, callable: Id, args: Id, kwargs: Option<Id>, what: &str) -> Result<(), PickleError> {
        let n_args = self.tuple_len(args, what)?;
        if let Some(kw) = kwargs
            && !matches!(self.nodes[kw], Node::Dict(_))
        {
            return Err(self.malformed("NEWOBJ_EX's keyword arguments are not a dict"));
        }
        let Node::Global { module, name } = &self.nodes[callable] else {
            return Err(self.malformed("a call of something other than a global"));
        };
        let node = match (module.as_str(), name.as_str(), n_args, kwargs) {
            ("_codecs", "encode", 2, None) => Node::Latin1 { args },
            ("builtins", "set", 0 | 1, None) => Node::SetOf { args, frozen: false },
            ("builtins", "frozenset", 0 | 1, None) => Node::SetOf { args, frozen: true },
            _ => Node::Object { class: callable, args, kwargs, state: None, items: vec![], appended: vec![] },
        };
        self.push(node);
        Ok(())
    }

    fn set_items(&mut self, target: Id, new: Vec<(Id, Id)>) -> Result<(), PickleError> {
        match &mut self.nodes[target] {
            Node::Dict(items) | Node::Object { items, .. } => items.extend(new),
            _ => return Err(self.malformed("SETITEM(S) on something other than a dict or an object")),
        }
        Ok(())
    }

    fn append(&mut self, target: Id, new: Vec<Id>) -> Result<(), PickleError> {
        match &mut self.nodes[target] {
            Node::List(items) | Node::Object { appended: items, .. } => items.extend(new),
            _ => return Err(self.malformed("APPEND(S) on something other than a list or an object")),
        }
        Ok(())
    }

    fn build(&mut self, target: Id, arg: Id) -> Result<(), PickleError> {
        match &mut self.nodes[target] {
            Node::Object { state: state @ None, .. } => *state = Some(arg),
            Node::Object { .. } => return Err(self.malformed("a second BUILD of one object")),
            _ => return Err(self.malformed("BUILD of something other than an object")),
        }
        Ok(())
    }

    /// Runs the opcodes up to `STOP`; the root node.
    fn run(&mut self) -> Result<Id, PickleError> {
        loop {
            self.op_at = self.pos;
            let op = self.u8("an opcode")?;
            if op == b'.' {
                return self.stop();
            }
            self.step(op)?;
        }
    }

    fn stop(&mut self) -> Result<Id, PickleError> {
        if !self.marks.is_empty() || self.stack.len() != 1 {
            return Err(self.malformed(format!(
                "STOP with {} values and {} marks on the stack (expected one value)",
                self.stack.len(),
                self.marks.len()
            )));
        }
        if self.pos != self.input.len() {
            return Err(self.malformed(format!("{} bytes after STOP", self.input.len() - self.pos)));
        }
        Ok(self.stack[0])
    }

    fn step(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            0x80 => {
                let proto = self.u8("PROTO")?;
                if proto > 5 {
                    return Err(self.err(PickleErrorKind::UnsupportedProtocol(proto)));
                }
                self.proto = proto;
            }
            // FRAME: a hint for buffered readers; the frame must lie inside the input.
            0x95 => {
                let n = self.u64("FRAME")?;
                self.checked_len(n, "a frame")?;
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                if self.stack.len() > self.marks.last().copied().unwrap_or(0) {
                    self.stack.pop();
                } else {
                    self.pop_mark()?;
                }
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let top = self.top()?;
                self.stack.push(top);
            }
            b'N' => self.push_scalar(Value::None),
            0x88 => self.push_scalar(Value::Bool(true)),
            0x89 => self.push_scalar(Value::Bool(false)),
            b'J' => {
                let v = i32::from_le_bytes(self.array("BININT")?);
                self.push_scalar(Value::Int(v.into()));
            }
            b'K' => {
                let v = self.u8("BININT1")?;
                self.push_scalar(Value::Int(v.into()));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.array("BININT2")?);
                self.push_scalar(Value::Int(v.into()));
            }
            0x8a => {
                let n = self.u8("LONG1")?;
                self.long(n.into())?;
            }
            0x8b => {
                let n = self.u32("LONG4")?;
                self.long(n.into())?;
            }
            b'G' => {
                let v = f64::from_be_bytes(self.array("BINFLOAT")?);
                self.push_scalar(Value::Float(v));
            }
            0x8c => {
                let n = self.u8("SHORT_BINUNICODE")?;
                let s = self.string(n.into())?;
                self.push_scalar(Value::Str(s));
            }
            b'X' => {
                let n = self.u32("BINUNICODE")?;
                let s = self.string(n.into())?;
                self.push_scalar(Value::Str(s));
            }
            0x8d => {
                let n = self.u64("BINUNICODE8")?;
                let s = self.string(n)?;
                self.push_scalar(Value::Str(s));
            }
            _ => return self.step_bytes_or_containers(op),
        }
        Ok(())
    }

    fn step_bytes_or_containers(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b'C' | b'U' => {
                let n = self.u8("SHORT_BINBYTES")?;
                let b = self.bytes(n.into(), "bytes")?;
                self.push_scalar(Value::Bytes(b));
            }
            b'B' => {
                let n = self.u32("BINBYTES")?;
                let b = self.bytes(n.into(), "bytes")?;
                self.push_scalar(Value::Bytes(b));
            }
            b'T' => {
                let n = i32::from_le_bytes(self.array("BINSTRING")?);
                let n = u64::try_from(n).map_err(|_| self.malformed("BINSTRING with a negative length"))?;
                let b = self.bytes(n, "bytes")?;
                self.push_scalar(Value::Bytes(b));
            }
            0x8e => {
                let n = self.u64("BINBYTES8")?;
                let b = self.bytes(n, "bytes")?;
                self.push_scalar(Value::Bytes(b));
            }
            0x96 => {
                let n = self.u64("BYTEARRAY8")?;
                let b = self.bytes(n, "a bytearray")?;
                self.push_scalar(Value::ByteArray(b));
            }
            b')' => self.push(Node::Tuple(vec![])),
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                if self.stack.len() < self.marks.last().copied().unwrap_or(0) + n {
                    return Err(self.malformed(format!("TUPLE{n} with fewer than {n} values on the stack")));
                }
                let items = self.stack.split_off(self.stack.len() - n);
                self.push(Node::Tuple(items));
            }
            b't' => {
                let items = self.pop_mark()?;
                self.push(Node::Tuple(items));
            }
            b']' => self.push(Node::List(vec![])),
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Node::List(items));
            }
            b'}' => self.push(Node::Dict(vec![])),
            b'd' => {
                let items = self.pop_mark()?;
                let pairs = self.pairs(items)?;
                self.push(Node::Dict(pairs));
            }
            0x8f => self.push(Node::Set(vec![])),
            0x91 => {
                let items = self.pop_mark()?;
                self.push(Node::FrozenSet(items));
            }
            _ => return self.step_mutations(op),
        }
        Ok(())
    }

    fn step_mutations(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b'a' => {
                let v = self.pop()?;
                let target = self.top()?;
                self.append(target, vec![v])?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                self.append(target, items)?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                let target = self.top()?;
                self.set_items(target, vec![(k, v)])?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                let pairs = self.pairs(items)?;
                let target = self.top()?;
                self.set_items(target, pairs)?;
            }
            0x90 => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                match &mut self.nodes[target] {
                    Node::Set(set) => set.extend(items),
                    _ => return Err(self.malformed("ADDITEMS on something other than a set")),
                }
            }
            b'b' => {
                let arg = self.pop()?;
                let target = self.top()?;
                self.build(target, arg)?;
            }
            _ => return self.step_memo_and_globals(op),
        }
        Ok(())
    }

    fn step_memo_and_globals(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            b'q' => {
                let k = self.u8("BINPUT")?;
                self.memo_put(k.into())?;
            }
            b'r' => {
                let k = self.u32("LONG_BINPUT")?;
                self.memo_put(k)?;
            }
            0x94 => {
                let k = u32::try_from(self.memo.len()).map_err(|_| self.malformed("memo full"))?;
                self.memo_put(k)?;
            }
            b'h' => {
                let k = self.u8("BINGET")?;
                self.memo_get(k.into())?;
            }
            b'j' => {
                let k = self.u32("LONG_BINGET")?;
                self.memo_get(k)?;
            }
            b'c' => {
                let module = self.line("GLOBAL's module")?;
                let name = self.line("GLOBAL's name")?;
                self.global(module, name)?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let name = self.str_node(name, "STACK_GLOBAL's name")?;
                let module = self.str_node(module, "STACK_GLOBAL's module")?;
                self.global(module, name)?;
            }
            b'R' => {
                let args = self.pop()?;
                let callable = self.pop()?;
                self.call(callable, args, None, "REDUCE's arguments")?;
            }
            0x81 => {
                let args = self.pop()?;
                let cls = self.pop()?;
                self.call(cls, args, None, "NEWOBJ's arguments")?;
            }
            0x92 => {
                let kwargs = self.pop()?;
                let args = self.pop()?;
                let cls = self.pop()?;
                self.call(cls, args, Some(kwargs), "NEWOBJ_EX's arguments")?;
            }
            b'Q' => {
                let pid = self.pop()?;
                self.push(Node::PersistentId(pid));
            }
            _ => return Err(self.unsupported(op)),
        }
        Ok(())
    }

    fn unsupported(&self, op: u8) -> PickleError {
        let name = match op {
            b'F' => "FLOAT",
            b'I' => "INT",
            b'L' => "LONG",
            b'P' => "PERSID",
            b'S' => "STRING",
            b'V' => "UNICODE",
            b'g' => "GET",
            b'p' => "PUT",
            b'i' => "INST",
            b'o' => "OBJ",
            0x82 => "EXT1",
            0x83 => "EXT2",
            0x84 => "EXT4",
            0x97 => "NEXT_BUFFER",
            0x98 => "READONLY_BUFFER",
            _ => return self.err(PickleErrorKind::UnknownOpcode(op)),
        };
        self.err(PickleErrorKind::UnsupportedOpcode(name))
    }

    /// `LONG1`/`LONG4`: little-endian two's complement of `n` bytes.
    fn long(&mut self, n: u64) -> Result<(), PickleError> {
        let b = self.bytes(n, "a long integer")?;
        if b.len() > 8 {
            self.push_scalar(Value::BigInt(b));
            return Ok(());
        }
        let fill = if b.last().is_some_and(|&x| x & 0x80 != 0) { 0xff } else { 0 };
        let mut a = [fill; 8];
        a[..b.len()].copy_from_slice(&b);
        self.push_scalar(Value::Int(i64::from_le_bytes(a)));
        Ok(())
    }
}

/// The expansion of the arena into a tree, within the depth and cost bounds.
struct Expand<'a> {
    nodes: &'a [Node],
    at: &'a [u64],
    limits: &'a Limits,
    units_left: u64,
    budget: u64,
    on_path: Vec<bool>,
}

impl<'a> Expand<'a> {
    fn err(&self, id: Id, kind: PickleErrorKind) -> PickleError {
        PickleError { kind, offset: self.at[id] }
    }

    fn charge(&mut self, id: Id, units: u64) -> Result<(), PickleError> {
        match self.units_left.checked_sub(units) {
            Some(left) => {
                self.units_left = left;
                Ok(())
            }
            None => {
                Err(self
                    .err(id, PickleErrorKind::LimitExceeded { what: "the decoded size in bytes", limit: self.budget }))
            }
        }
    }

    fn value(&mut self, id: Id, depth: usize) -> Result<Value, PickleError> {
        let depth_max = self.limits.depth_max.min(DEPTH_CEILING);
        if depth > depth_max {
            return Err(self.err(id, PickleErrorKind::LimitExceeded { what: "nesting depth", limit: depth_max as u64 }));
        }
        if self.on_path[id] {
            return Err(self.err(id, PickleErrorKind::Malformed("a value that contains itself".into())));
        }
        self.charge(id, std::mem::size_of::<Value>() as u64)?;
        self.on_path[id] = true;
        let v = self.node(id, depth);
        self.on_path[id] = false;
        v
    }

    fn list(&mut self, ids: &[Id], depth: usize) -> Result<Vec<Value>, PickleError> {
        ids.iter().map(|&c| self.value(c, depth + 1)).collect()
    }

    fn pairs(&mut self, ids: &[(Id, Id)], depth: usize) -> Result<Vec<(Value, Value)>, PickleError> {
        ids.iter().map(|&(k, v)| Ok((self.value(k, depth + 1)?, self.value(v, depth + 1)?))).collect()
    }

    /// The elements of a tuple node (a call's arguments, checked to be one when made).
    fn tuple(&self, id: Id) -> &'a [Id] {
        match &self.nodes[id] {
            Node::Tuple(items) => items,
            _ => &[],
        }
    }

    /// `_codecs.encode(text, "latin1")`: the bytes of `text`'s characters, all below 256.
    fn latin1(&mut self, id: Id, args: &[Id]) -> Result<Value, PickleError> {
        let malformed = |this: &Self, what: &str| this.err(id, PickleErrorKind::Malformed(what.into()));
        let (Some(Node::Scalar(Value::Str(text))), Some(Node::Scalar(Value::Str(encoding)))) =
            (args.first().map(|&a| &self.nodes[a]), args.get(1).map(|&a| &self.nodes[a]))
        else {
            return Err(malformed(self, "_codecs.encode of something other than two strings"));
        };
        if encoding != "latin1" && encoding != "latin-1" {
            return Err(malformed(self, "_codecs.encode with an encoding other than latin1"));
        }
        self.charge(id, text.len() as u64)?;
        let bytes: Option<Vec<u8>> = text.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
        bytes.map(Value::Bytes).ok_or_else(|| malformed(self, "_codecs.encode of a character beyond latin-1"))
    }

    fn node(&mut self, id: Id, depth: usize) -> Result<Value, PickleError> {
        let nodes = self.nodes;
        Ok(match &nodes[id] {
            Node::Scalar(v) => {
                let bytes = match v {
                    Value::Str(s) => s.len(),
                    Value::Bytes(b) | Value::ByteArray(b) | Value::BigInt(b) => b.len(),
                    _ => 0,
                };
                self.charge(id, bytes as u64)?;
                v.clone()
            }
            Node::Tuple(ids) => Value::Tuple(self.list(ids, depth)?),
            Node::List(ids) => Value::List(self.list(ids, depth)?),
            Node::Set(ids) => Value::Set(self.list(ids, depth)?),
            Node::FrozenSet(ids) => Value::FrozenSet(self.list(ids, depth)?),
            Node::Dict(ids) => Value::Dict(self.pairs(ids, depth)?),
            Node::Global { module, name } => {
                self.charge(id, (module.len() + name.len()) as u64)?;
                Value::Global { module: module.clone(), name: name.clone() }
            }
            Node::PersistentId(pid) => Value::PersistentId(Box::new(self.value(*pid, depth + 1)?)),
            Node::Object { class, args, kwargs, state, items, appended } => {
                let Node::Global { module, name } = &nodes[*class] else {
                    return Err(
                        self.err(id, PickleErrorKind::Malformed("a call of something other than a global".into()))
                    );
                };
                self.charge(id, (module.len() + name.len()) as u64)?;
                let state = match state {
                    Some(s) => Some(self.value(*s, depth + 1)?),
                    None => None,
                };
                let kwargs = match kwargs.map(|k| &nodes[k]) {
                    Some(Node::Dict(pairs)) => self.pairs(pairs, depth)?,
                    _ => vec![],
                };
                Value::Object(Box::new(Object {
                    module: module.clone(),
                    name: name.clone(),
                    args: self.list(self.tuple(*args), depth)?,
                    kwargs,
                    state,
                    items: self.pairs(items, depth)?,
                    appended: self.list(appended, depth)?,
                }))
            }
            Node::Latin1 { args } => self.latin1(id, self.tuple(*args))?,
            Node::SetOf { args, frozen } => {
                let items = match self.tuple(*args) {
                    [] => vec![],
                    [arg] => match &nodes[*arg] {
                        Node::List(items) | Node::Tuple(items) => self.list(items, depth)?,
                        _ => {
                            let what = "builtins.set or frozenset of something other than a list or tuple";
                            return Err(self.err(id, PickleErrorKind::Malformed(what.into())));
                        }
                    },
                    _ => {
                        return Err(self.err(id, PickleErrorKind::Malformed("builtins.set with many arguments".into())));
                    }
                };
                if *frozen { Value::FrozenSet(items) } else { Value::Set(items) }
            }
        })
    }
}
