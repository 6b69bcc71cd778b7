//! `dckpt ls ROOT --local TEMPLATE`: the node-local tier as its directories hold it. The
//! rules (what a part, a marker and a complete step are) are the engine's
//! (`dckpt::local::scan_local`); this finds the directories and prints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use dckpt::LocalStepInfo;
use serde::Serialize;

use crate::fmt;

/// One node's (or rank's) directory.
#[derive(Debug, Serialize)]
pub struct NodeDir {
    /// The index the template's placeholder took.
    pub index: usize,
    pub directory: String,
    pub exists: bool,
    pub steps: Vec<LocalStepInfo>,
}

/// One step over every directory.
#[derive(Debug, Serialize)]
pub struct LocalStep {
    pub step: u64,
    /// Every rank's part has a copy in a directory whose rank marked the step.
    pub complete: bool,
    pub world: Option<u32>,
    /// Ranks whose part has no marked copy anywhere.
    pub missing_parts: Vec<u32>,
    pub bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct LocalListing {
    pub template: String,
    /// `node` or `rank`: what the placeholder names.
    pub placeholder: &'static str,
    pub nodes: Vec<NodeDir>,
    pub steps: Vec<LocalStep>,
}

/// Past the largest node or rank index a template's directories are taken to have
/// (dckpt's protocol runs up to 16,384 ranks).
const INDEX_MAX: usize = 1 << 17;

/// Parses `--nodes`: 1 to [`INDEX_MAX`] (a larger count listed that many directories, one
/// by one, and held a row for each).
pub fn parse_nodes(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    match n {
        1..=INDEX_MAX => Ok(n),
        _ => Err(format!("1 to {INDEX_MAX} nodes")),
    }
}

/// Finds the template's directories (the placeholder in one path component) and scans each.
pub fn scan(template: &str, expected: Option<usize>) -> Result<LocalListing> {
    let placeholder = match (template.contains("{node}"), template.contains("{rank}")) {
        (true, false) => "node",
        (false, true) => "rank",
        _ => bail!("--local {template:?}: the template must name exactly one of {{node}} and {{rank}}"),
    };
    let token = format!("{{{placeholder}}}");
    let at = template.find(&token).expect("checked above");
    let component_start = template[..at].rfind('/').map_or(0, |i| i + 1);
    let component_end = template[at..].find('/').map_or(template.len(), |i| at + i);
    let parent = PathBuf::from(if component_start == 0 { "." } else { &template[..component_start] });
    let (before, after) = (&template[component_start..at], &template[at + token.len()..component_end]);
    let mut found: Vec<usize> = Vec::new();
    if parent.is_dir() {
        for entry in std::fs::read_dir(&parent).with_context(|| format!("listing {}", parent.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            // A larger number is some other directory (a date, a job id): counting up to it
            // would stat millions of names, or wrap past usize::MAX to none at all.
            let index: Option<usize> = name
                .strip_prefix(before)
                .and_then(|n| n.strip_suffix(after))
                .and_then(|n| n.parse().ok())
                .filter(|&i| i < INDEX_MAX);
            found.extend(index);
        }
    }
    let count = expected.unwrap_or_else(|| found.iter().max().map_or(0, |m| m + 1));
    let mut nodes = Vec::new();
    for index in 0..count.max(found.iter().max().map_or(0, |m| m + 1)) {
        let directory = template.replace(&token, &index.to_string());
        let exists = Path::new(&directory).is_dir();
        let steps = if exists {
            let dir = crate::store::open(&directory).with_context(|| format!("opening {directory}"))?;
            dckpt::local::scan_local(dir.as_ref()).with_context(|| format!("scanning {directory}"))?
        } else {
            Vec::new()
        };
        nodes.push(NodeDir { index, directory, exists, steps });
    }
    let steps = summarize(&nodes);
    Ok(LocalListing { template: template.into(), placeholder, nodes, steps })
}

fn summarize(nodes: &[NodeDir]) -> Vec<LocalStep> {
    let mut by_step: BTreeMap<u64, (Option<u32>, Vec<u32>, u64)> = BTreeMap::new();
    for n in nodes {
        for s in &n.steps {
            let e = by_step.entry(s.step).or_insert((None, Vec::new(), 0));
            e.0 = e.0.or(s.world);
            e.2 += s.bytes;
            if !s.marked_by.is_empty() {
                e.1.extend(&s.parts);
            }
        }
    }
    by_step
        .into_iter()
        .map(|(step, (world, marked, bytes))| {
            let missing_parts: Vec<u32> = match world {
                Some(w) => (0..w).filter(|r| !marked.contains(r)).collect(),
                None => Vec::new(),
            };
            let complete = world.is_some() && missing_parts.is_empty();
            LocalStep { step, complete, world, missing_parts, bytes }
        })
        .collect()
}

pub fn human(l: &LocalListing) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let complete = l.steps.iter().filter(|s| s.complete).count();
    let _ = writeln!(o, "local tier {}: {} steps, {complete} complete", l.template, l.steps.len());
    for s in &l.steps {
        let state = if s.complete { "complete".to_string() } else { "NOT COMPLETE".to_string() };
        let missing = if s.missing_parts.is_empty() {
            String::new()
        } else {
            format!("  parts without a copy: {:?}", s.missing_parts)
        };
        let _ = writeln!(o, "  {:>12}  {state:<12}  {:>10}{missing}", s.step, fmt::bytes(s.bytes));
    }
    for n in &l.nodes {
        if !n.exists {
            let _ = writeln!(o, "  {} {}: {} is missing", l.placeholder, n.index, n.directory);
            continue;
        }
        let steps: Vec<String> = n
            .steps
            .iter()
            .map(|s| {
                format!("{} (parts {:?}{})", s.step, s.parts, if s.marked_by.is_empty() { ", unmarked" } else { "" })
            })
            .collect();
        let _ = writeln!(
            o,
            "  {} {}: {}",
            l.placeholder,
            n.index,
            if steps.is_empty() { "-".into() } else { steps.join(", ") }
        );
    }
    o
}
