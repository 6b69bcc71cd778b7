//! Where the demo may save: its own checkpoint, an empty place, or, asked, anything.

use anyhow::anyhow;
use dckpt::ErrorKind;
use dckpt::engine::read_metadata_local;
use dckpt::format::META_NAME;
use dckpt::storage::Storage;
use dckpt::verify::is_data_file_name;

use super::MADE_BY;

/// Why the demo does not save into a target.
#[derive(Debug)]
pub(super) enum Target {
    /// It holds what the demo may not replace unasked (exit 2: choose another or --replace).
    Refused(String),
    /// Looking at it failed (exit 1).
    Failed(anyhow::Error),
}

/// Whether the save replaces the checkpoint at `storage`, or why the demo does not save
/// there. Nothing is deleted here: the engine's replace deletes the old checkpoint's files
/// only once the new metadata has landed over it, and only if it is still the one it read.
///
/// Without `replace_asked`: the demo's own checkpoint is replaced; a place holding nothing
/// but data files no metadata names (saves that never committed, harmless) gets a new
/// checkpoint, which fails if another save commits there first; anything else is refused.
/// The demo looks before the engine plans: a checkpoint committed by another program in
/// between is replaced as the demo's own would be (still only once the new metadata has
/// landed over exactly what the plan read).
pub(super) fn save_target(storage: &dyn Storage, replace_asked: bool) -> Result<bool, Target> {
    let dir = storage.location("");
    let dir = dir.trim_end_matches('/');
    let meta = match read_metadata_local(storage) {
        Ok(m) => Some(Ok(m)),
        Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => None,
        Err(e) if matches!(e.kind(), ErrorKind::Storage { .. }) => {
            return Err(Target::Failed(anyhow!(e).context(format!("reading {}", storage.location(META_NAME)))));
        }
        Err(e) => Some(Err(e)),
    };
    if replace_asked {
        // The engine replaces whatever is committed when the save plans.
        return Ok(true);
    }
    let hint = "pass --replace to save there anyway, or choose another --dir";
    match meta {
        Some(Ok(m)) if m.layout.get(MADE_BY.0).map(String::as_str) == Some(MADE_BY.1) => Ok(true),
        Some(Ok(m)) => Err(Target::Refused(format!(
            "{dir} holds a checkpoint the demo did not make (save id {}, written by {}); the demo replaces only its \
             own: {hint}",
            m.save_id, m.writer
        ))),
        Some(Err(e)) => Err(Target::Refused(format!(
            "{dir} holds a {META_NAME} the demo cannot read as its own checkpoint ({e}): {hint}"
        ))),
        None => {
            let objects = storage.list("").map_err(|e| Target::Failed(anyhow!(e).context(format!("listing {dir}"))))?;
            let foreign: Vec<&str> =
                objects.iter().map(|o| o.path.as_str()).filter(|p| !is_data_file_name(p)).collect();
            match foreign.first() {
                None => Ok(false),
                Some(first) => Err(Target::Refused(format!(
                    "{dir} is not empty and holds no checkpoint of the demo ({} other object{}, such as {first}): \
                     {hint}",
                    foreign.len(),
                    if foreign.len() == 1 { "" } else { "s" }
                ))),
            }
        }
    }
}
