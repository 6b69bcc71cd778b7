//! A model's declaration: the state holds exactly the tensors it declares.

use std::collections::{HashMap, HashSet};

use super::{Problems, TensorPiece};
use crate::{Problem, TensorDecl};

/// The held keys are exactly the declared ones, each with the declared dtype and shape.
pub(super) fn check_declared(groups: &[(&str, &[TensorPiece<'_>])], decls: &[TensorDecl], problems: &mut Problems) {
    let mut declared: HashMap<&str, &TensorDecl> = HashMap::with_capacity(decls.len());
    let mut sorted: Vec<&TensorDecl> = decls.iter().collect();
    sorted.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    for d in sorted {
        if declared.insert(d.key.as_str(), d).is_some() {
            problems.push(Problem::DuplicateDeclaration { key: d.key.to_string() });
        }
    }
    let mut held: HashSet<&str> = HashSet::with_capacity(groups.len());
    for (key, pieces) in groups {
        held.insert(key);
        let t = pieces[0].tensor;
        match declared.get(key) {
            None => problems.push(Problem::UndeclaredTensor { key: (*key).into(), rank: pieces[0].rank }),
            Some(d) if d.dtype != t.dtype || d.global_shape != t.global_shape => {
                problems.push(Problem::DeclarationMismatch {
                    key: (*key).into(),
                    declared_dtype: d.dtype,
                    declared_shape: d.global_shape.clone(),
                    dtype: t.dtype,
                    shape: t.global_shape.clone(),
                })
            }
            Some(_) => {}
        }
    }
    let mut missing: Vec<&str> = declared.keys().filter(|k| !held.contains(*k)).copied().collect();
    missing.sort_unstable();
    for key in missing {
        problems.push(Problem::MissingTensor { key: key.into() });
    }
}
