//! The arena expanded into a [`Value`] tree, within the depth and cost bounds.

use super::machine::{Id, Node};
use super::{DEPTH_CEILING, Limits, Object, PickleError, PickleErrorKind, Value};

/// The expansion of the arena into a tree, within the depth and cost bounds.
pub(super) struct Expand<'a> {
    pub(super) nodes: &'a [Node],
    pub(super) at: &'a [u64],
    pub(super) limits: &'a Limits,
    pub(super) units_left: u64,
    pub(super) budget: u64,
    pub(super) on_path: Vec<bool>,
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

    pub(super) fn value(&mut self, id: Id, depth: usize) -> Result<Value, PickleError> {
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
