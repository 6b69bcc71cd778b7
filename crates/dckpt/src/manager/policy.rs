//! What the run root's contents mean, decided without IO: each step's state, which
//! committed steps retention keeps, which step is the latest, and which steps gc removes
//! and why.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use dckpt_engine::format::META_NAME;
use dckpt_storage::ObjectInfo;
use serde::{Deserialize, Serialize};

use super::names::LATEST_NAME;

/// Which committed steps retention keeps: the last `keep_last` and every step that is a
/// multiple of `keep_every`. Neither set keeps every step. The latest committed step and a
/// step being saved are kept whatever the policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetentionPolicy {
    /// Keep the newest N committed steps.
    pub keep_last: Option<u64>,
    /// Keep every step that is a multiple of K. `Some(0)` is no such rule (the CLI and
    /// Python refuse it): read as "a multiple of 0" it kept no step, and a policy of that
    /// rule alone deleted every committed step but the newest.
    pub keep_every: Option<u64>,
}

impl RetentionPolicy {
    /// Keeps every step.
    pub const KEEP_ALL: RetentionPolicy = RetentionPolicy { keep_last: None, keep_every: None };

    /// Whether this policy deletes anything at all.
    pub fn keeps_all(&self) -> bool {
        self.keep_last.is_none() && self.keep_every.is_none_or(|k| k == 0)
    }
}

/// The committed steps (in any order) that `policy` deletes, ascending. `protected` (steps
/// being saved) and the newest committed step are never among them.
pub fn retention_deletes(committed: &[u64], policy: RetentionPolicy, protected: &[u64]) -> Vec<u64> {
    if policy.keeps_all() {
        return Vec::new();
    }
    let sorted: BTreeSet<u64> = committed.iter().copied().collect();
    let newest = sorted.iter().next_back().copied();
    let last: BTreeSet<u64> = match policy.keep_last {
        Some(n) => sorted.iter().rev().take(usize::try_from(n).unwrap_or(usize::MAX)).copied().collect(),
        None => BTreeSet::new(),
    };
    sorted
        .into_iter()
        .filter(|s| Some(*s) != newest && !protected.contains(s) && !last.contains(s))
        .filter(|s| !matches!(policy.keep_every, Some(k) if k > 0 && s % k == 0))
        .collect()
}

/// What a step directory holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepState {
    /// Its metadata is there, decodes, and names only files that are there at their size.
    Committed,
    /// No metadata: a save that never committed, or one still running.
    Uncommitted,
    /// Metadata that does not decode, or that names files which are not there as named.
    Damaged(Damage),
    /// Metadata that is there but could not be judged from here: a storage error reading
    /// it (permissions, I/O, the network), a format version newer than this build reads, a
    /// size past this build's limit. Never removed: it may be a whole checkpoint.
    Unreadable {
        /// The error reading it, as its message.
        error: String,
    },
}

/// What is wrong with a step whose metadata is there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Damage {
    /// The metadata does not read or decode: the error, as its message.
    Metadata {
        /// The error reading it.
        error: String,
    },
    /// A data file the metadata names is not there.
    MissingFile {
        /// The file's name.
        name: String,
    },
    /// A data file the metadata names has another size.
    FileSize {
        /// The file's name.
        name: String,
        /// Its size.
        bytes: u64,
        /// The size the metadata says.
        expected: u64,
    },
}

impl fmt::Display for Damage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Damage::Metadata { error } => write!(f, "damaged: {error}"),
            Damage::MissingFile { name } => write!(f, "damaged: its data file {name} is missing"),
            Damage::FileSize { name, bytes, expected } => {
                write!(f, "damaged: its data file {name} has {bytes} bytes, not {expected}")
            }
        }
    }
}

impl StepState {
    /// Whether the step is a committed checkpoint.
    pub fn is_committed(&self) -> bool {
        matches!(self, StepState::Committed)
    }

    /// Why it is not committed, in words (`None` when it is).
    pub fn problem(&self) -> Option<String> {
        match self {
            StepState::Committed => None,
            StepState::Uncommitted => {
                Some(format!("no {META_NAME} (a save that never committed, or one still running)"))
            }
            StepState::Damaged(d) => Some(d.to_string()),
            StepState::Unreadable { error } => Some(format!("unreadable here, kept: {error}")),
        }
    }
}

/// One step directory under a run root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepInfo {
    /// The step.
    pub step: u64,
    /// Its directory under the run root.
    pub directory: String,
    /// Committed, uncommitted or damaged.
    pub state: StepState,
    /// Bytes of every object in the directory.
    pub bytes: u64,
    /// Objects in the directory.
    pub objects: u64,
    /// The save id its metadata names, where the metadata decodes.
    pub save_id: Option<String>,
    /// When the save started (Unix seconds), where the save recorded it (managed saves do);
    /// the storage API gives no modification times.
    pub saved_at_unix: Option<u64>,
    /// The layout its metadata recorded.
    pub layout: BTreeMap<String, String>,
}

impl StepInfo {
    /// Whether the step is a committed checkpoint.
    pub fn committed(&self) -> bool {
        self.state.is_committed()
    }
}

/// The `latest` pointer's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatestPointer {
    /// The step.
    pub step: u64,
    /// Its directory under the run root.
    pub directory: String,
    /// The save id of that step's checkpoint.
    pub save_id: String,
}

/// A step that [`choose_latest`] passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// The step.
    pub step: u64,
    /// Why it is not the latest.
    pub reason: String,
    /// Whether its metadata is there but could not be read here ([`StepState::Unreadable`]):
    /// it may be a whole checkpoint newer than the latest, which a restart must not pass over.
    #[serde(default)]
    pub unreadable: bool,
}

/// Which step is the latest committed one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latest {
    /// The step, or `None` where no step is committed.
    pub step: Option<u64>,
    /// Its directory.
    pub directory: Option<String>,
    /// Its save id.
    pub save_id: Option<String>,
    /// Whether the pointer named it (else listing found it).
    pub from_pointer: bool,
    /// Newer steps (and a pointer's step) passed over, and why.
    pub skipped: Vec<Skipped>,
}

/// The latest committed step among `steps`, given what the pointer held (`None`: no
/// pointer; `Some(Err)`: one that does not decode). The pointer is taken when it names a
/// committed step with its save id and no newer step is committed (a commit whose pointer
/// write failed is newer than the pointer); otherwise the newest committed step listed.
pub fn choose_latest(steps: &[StepInfo], pointer: Option<Result<LatestPointer, String>>) -> Latest {
    let newest = steps.iter().filter(|s| s.committed()).max_by_key(|s| s.step);
    let mut skipped: Vec<Skipped> = steps
        .iter()
        .filter(|s| !s.committed() && newest.is_none_or(|n| s.step > n.step))
        .map(|s| Skipped {
            step: s.step,
            reason: s.state.problem().unwrap_or_else(|| "not committed".into()),
            unreadable: matches!(s.state, StepState::Unreadable { .. }),
        })
        .collect();
    let mut from_pointer = false;
    match pointer {
        Some(Ok(p)) => match steps.iter().find(|s| s.step == p.step) {
            Some(s) if s.committed() && s.save_id.as_deref() == Some(p.save_id.as_str()) => {
                from_pointer = newest.is_some_and(|n| n.step == s.step);
            }
            Some(s) if s.committed() => skipped.push(Skipped {
                unreadable: false,
                step: p.step,
                reason: format!(
                    "the pointer names save {} but the step holds save {}",
                    p.save_id,
                    s.save_id.as_deref().unwrap_or("?")
                ),
            }),
            Some(_) => {}
            None => skipped.push(Skipped {
                step: p.step,
                reason: "the pointer names a step that is not there".into(),
                unreadable: false,
            }),
        },
        Some(Err(why)) => {
            skipped.push(Skipped { step: 0, reason: format!("the {LATEST_NAME} pointer: {why}"), unreadable: false })
        }
        None => {}
    }
    skipped.sort_by_key(|s| s.step);
    skipped.dedup();
    Latest {
        step: newest.map(|s| s.step),
        directory: newest.map(|s| s.directory.clone()),
        save_id: newest.and_then(|s| s.save_id.clone()),
        from_pointer,
        skipped,
    }
}

/// What garbage collection removes besides what dead saves left (see
/// [`gc_root`](super::gc_root)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcOptions {
    /// Also the committed steps this policy does not keep (its default keeps them all).
    pub policy: RetentionPolicy,
    /// Steps never touched (being saved).
    pub protected: Vec<u64>,
    /// Say what would be removed; remove nothing.
    pub dry_run: bool,
}

/// Why [`gc_root`](super::gc_root) removes a step directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RemovalReason {
    /// No metadata, and older than the newest committed step.
    Uncommitted,
    /// Damaged, and older than the newest committed step.
    Damaged,
    /// Committed, but the retention policy does not keep it.
    Retention,
}

impl RemovalReason {
    /// The word `dckpt gc` prints and its JSON holds: `uncommitted`, `damaged`, `retention`.
    pub fn as_str(self) -> &'static str {
        match self {
            RemovalReason::Uncommitted => "uncommitted",
            RemovalReason::Damaged => "damaged",
            RemovalReason::Retention => "retention",
        }
    }
}

/// One step directory [`gc_root`](super::gc_root) removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedStep {
    /// The step.
    pub step: u64,
    /// Its directory.
    pub directory: String,
    /// Why.
    pub reason: RemovalReason,
    /// Its bytes.
    pub bytes: u64,
    /// Its objects.
    pub objects: u64,
}

/// What [`gc_root`](super::gc_root) removed (or, in a dry run, would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// Whether nothing was deleted.
    pub dry_run: bool,
    /// Whole step directories, each with why.
    pub steps: Vec<RemovedStep>,
    /// Data files in committed steps that their metadata does not name (saves into that
    /// step that never committed), as `step-N/name`.
    pub data_files: Vec<ObjectInfo>,
    /// Unfinished writes of dead processes (temporaries), by the store's names for them.
    pub unfinished_writes: Vec<ObjectInfo>,
    /// Bytes of all of it.
    pub bytes: u64,
    /// Local-tier steps this rank removed from its node's directory (a manager with a
    /// local tier; each rank its own).
    #[serde(default)]
    pub local_steps: Vec<u64>,
    /// What could not be removed, each naming the step or file and why; what is listed above
    /// was removed (gc goes on past a failure: one undeletable step hid what it had done).
    #[serde(default)]
    pub errors: Vec<String>,
}

/// The step directories gc removes, and why: those older than the newest committed step
/// that are not committed, and the committed ones `opts.policy` does not keep; never a
/// protected step, the newest committed step or one newer (a save may be running there).
/// Nothing where no step is committed: every step may be a save still running.
pub fn gc_removals(steps: &[StepInfo], opts: &GcOptions) -> Vec<RemovedStep> {
    let Some(newest) = steps.iter().filter(|s| s.committed()).map(|s| s.step).max() else {
        return Vec::new();
    };
    let committed: Vec<u64> = steps.iter().filter(|s| s.committed()).map(|s| s.step).collect();
    let retired: BTreeSet<u64> = retention_deletes(&committed, opts.policy, &opts.protected).into_iter().collect();
    let removal = |s: &StepInfo| {
        if opts.protected.contains(&s.step) || s.step >= newest {
            return None;
        }
        if retired.contains(&s.step) {
            return Some(RemovalReason::Retention);
        }
        match s.state {
            StepState::Committed => None,
            StepState::Damaged(_) => Some(RemovalReason::Damaged),
            StepState::Uncommitted => Some(RemovalReason::Uncommitted),
            StepState::Unreadable { .. } => None,
        }
    };
    steps
        .iter()
        .filter_map(|s| {
            let reason = removal(s)?;
            Some(RemovedStep {
                step: s.step,
                directory: s.directory.clone(),
                reason,
                bytes: s.bytes,
                objects: s.objects,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::names::step_dir;
    use super::*;

    #[test]
    fn retention_keeps_the_last_n_every_kth_the_newest_and_the_protected() {
        let all: Vec<u64> = (1..=10).collect();
        let p = |keep_last, keep_every| RetentionPolicy { keep_last, keep_every };
        assert_eq!(retention_deletes(&all, p(None, None), &[]), Vec::<u64>::new());
        assert_eq!(retention_deletes(&all, p(Some(3), None), &[]), (1..=7).collect::<Vec<_>>());
        assert_eq!(retention_deletes(&all, p(Some(2), Some(4)), &[]), [1, 2, 3, 5, 6, 7]);
        assert_eq!(retention_deletes(&all, p(None, Some(5)), &[]), [1, 2, 3, 4, 6, 7, 8, 9]);
        // keep_last 0 still keeps the newest committed step, and protected steps stay.
        assert_eq!(retention_deletes(&all, p(Some(0), None), &[3]), [1, 2, 4, 5, 6, 7, 8, 9]);
        assert_eq!(retention_deletes(&[7, 2, 5], p(Some(1), None), &[]), [2, 5]);
        assert_eq!(retention_deletes(&[], p(Some(1), None), &[]), Vec::<u64>::new());
        // keep_every 0 is no rule: alone it keeps every step (it once kept only the newest).
        assert_eq!(retention_deletes(&all, p(None, Some(0)), &[]), Vec::<u64>::new());
        assert_eq!(retention_deletes(&all, p(Some(3), Some(0)), &[]), (1..=7).collect::<Vec<_>>());
    }

    fn with_state(step: u64, state: StepState, save_id: &str) -> StepInfo {
        StepInfo {
            step,
            directory: step_dir(step),
            save_id: state.is_committed().then(|| save_id.to_string()),
            state,
            bytes: 0,
            objects: 0,
            saved_at_unix: None,
            layout: BTreeMap::new(),
        }
    }

    fn info(step: u64, committed: bool, save_id: &str) -> StepInfo {
        with_state(step, if committed { StepState::Committed } else { StepState::Uncommitted }, save_id)
    }

    fn pointer(step: u64, save_id: &str) -> Option<Result<LatestPointer, String>> {
        Some(Ok(LatestPointer { step, directory: step_dir(step), save_id: save_id.into() }))
    }

    #[test]
    fn latest_is_never_uncommitted_and_says_what_it_skipped() {
        let steps = [info(1, true, "a"), info(2, true, "b"), info(3, false, "")];
        let l = choose_latest(&steps, pointer(2, "b"));
        assert_eq!((l.step, l.from_pointer), (Some(2), true));
        assert_eq!(
            l.skipped,
            [Skipped { step: 3, reason: StepState::Uncommitted.problem().unwrap(), unreadable: false }]
        );
        assert!(l.skipped[0].reason.starts_with("no dckpt.meta"), "{l:?}");
        // A pointer to a step that is gone, or to another save, is passed over by name.
        let l = choose_latest(&steps, pointer(9, "z"));
        assert_eq!((l.step, l.from_pointer), (Some(2), false));
        assert!(l.skipped.iter().any(|s| s.step == 9 && s.reason.contains("not there")), "{l:?}");
        let l = choose_latest(&steps, pointer(1, "other"));
        assert!(l.skipped.iter().any(|s| s.step == 1 && s.reason.contains("save other")), "{l:?}");
        // A commit whose pointer write was lost is newer than the pointer: listing wins.
        let l = choose_latest(&[info(1, true, "a"), info(2, true, "b")], pointer(1, "a"));
        assert_eq!((l.step, l.from_pointer), (Some(2), false));
        let l = choose_latest(&[info(1, false, "")], Some(Err("bad json".into())));
        assert_eq!(l.step, None);
        assert_eq!(l.skipped.len(), 2);
        assert_eq!(choose_latest(&[], None).step, None);
    }

    #[test]
    fn gc_removes_by_state_and_policy_never_the_newest_or_newer() {
        let damaged = StepState::Damaged(Damage::MissingFile { name: "x".into() });
        let steps = [
            info(1, true, "a"),
            with_state(2, damaged.clone(), ""),
            info(3, false, ""),
            info(4, true, "d"),
            with_state(5, damaged, ""),
            info(6, false, ""),
        ];
        let reasons = |opts: &GcOptions| -> Vec<(u64, RemovalReason)> {
            gc_removals(&steps, opts).iter().map(|r| (r.step, r.reason)).collect()
        };
        use RemovalReason::*;
        assert_eq!(reasons(&GcOptions::default()), [(2, Damaged), (3, Uncommitted)]);
        let keep_1 =
            GcOptions { policy: RetentionPolicy { keep_last: Some(1), keep_every: None }, ..Default::default() };
        assert_eq!(reasons(&keep_1), [(1, Retention), (2, Damaged), (3, Uncommitted)]);
        let protected = GcOptions { protected: vec![1, 3], ..keep_1 };
        assert_eq!(reasons(&protected), [(2, Damaged)]);
        // A step whose metadata could not be read here is never removed.
        let unreadable =
            [info(1, true, "a"), with_state(2, StepState::Unreadable { error: "EIO".into() }, ""), info(3, true, "c")];
        assert!(gc_removals(&unreadable, &keep_1).iter().all(|r| r.step != 2));
        assert!(gc_removals(&[info(1, false, "")], &GcOptions::default()).is_empty());
        // The words gc prints and its JSON holds.
        assert_eq!(
            serde_json::to_string(&[Uncommitted, Damaged, Retention]).unwrap(),
            r#"["uncommitted","damaged","retention"]"#
        );
        assert_eq!(Retention.as_str(), "retention");
    }
}
