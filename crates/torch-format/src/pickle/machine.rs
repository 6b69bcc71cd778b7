//! The pickle machine: each opcode run over an arena of nodes, so that the memo shares
//! what Python shares; globals checked against the allow-list as they are named, calls
//! recorded, every length checked against the bytes that remain.

use std::collections::HashMap;

use super::{Limits, PickleError, PickleErrorKind, Value};

pub(super) type Id = usize;

/// A value under construction: containers refer to other nodes by index, so the memo and
/// later mutations share them as Python does.
pub(super) enum Node {
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

pub(super) struct Machine<'a> {
    pub(super) input: &'a [u8],
    pub(super) pos: usize,
    /// Where the opcode being run starts: every error names it.
    pub(super) op_at: usize,
    pub(super) nodes: Vec<Node>,
    /// The offset of the opcode that made each node.
    pub(super) at: Vec<u64>,
    pub(super) stack: Vec<Id>,
    /// The stack's length at each open `MARK`.
    pub(super) marks: Vec<usize>,
    pub(super) memo: HashMap<u32, Id>,
    /// The global node made for each `module\nname`.
    pub(super) globals: HashMap<String, Id>,
    pub(super) allowed: &'a dyn Fn(&str, &str) -> bool,
    pub(super) limits: &'a Limits,
    /// The protocol `PROTO` declared (2 without one).
    pub(super) proto: u8,
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
    pub(super) fn run(&mut self) -> Result<Id, PickleError> {
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
