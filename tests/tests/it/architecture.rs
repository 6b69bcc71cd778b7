//! What ARCHITECTURE.md and the workspace manifest claim about the build, checked on
//! `cargo metadata`: the dependency arrows it forbids, and that `rust-version` is not
//! contradicted by a dependency.
//!
//! Arrows are followed over normal dependencies only (what a library drags into its
//! users; dev-dependencies and build scripts are not part of it), transitively, with every
//! feature of the workspace on (a forbidden arrow behind a feature is still forbidden) and
//! for the host platform (so cargo answers from what a build already downloaded, offline).
//! A rule about a package that does not exist is skipped, so rules can name crates before
//! they land; one that exists must obey.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::process::Command;

use serde_json::Value;

/// Packages that must never be reached from a rule's package.
struct Never {
    from: &'static str,
    to: &'static [&'static str],
    why: &'static str,
}

/// Packages a rule's package may reach only through `via`: with `via` taken out of the
/// graph, none of `to` is reached.
struct Through {
    from: &'static str,
    to: &'static [&'static str],
    via: &'static str,
    why: &'static str,
}

/// The only workspace crates a rule's package may reach.
struct Only {
    from: &'static str,
    allowed: &'static [&'static str],
    why: &'static str,
}

const ASYNC_AND_NETWORK: &[&str] = &["tokio", "object_store", "reqwest"];

const NEVER: &[Never] = &[
    Never { from: "dckpt-shard-spec", to: ASYNC_AND_NETWORK, why: "shard-spec does no IO and has no async" },
    Never { from: "dckpt-layout", to: ASYNC_AND_NETWORK, why: "layout does no IO" },
    Never { from: "dckpt-format", to: ASYNC_AND_NETWORK, why: "the format is bytes in, bytes out" },
    Never { from: "dckpt-torch-format", to: ASYNC_AND_NETWORK, why: "PyTorch's formats are bytes in, bytes out" },
    Never {
        from: "dckpt-torch-format",
        to: &["dckpt-storage", "dckpt-engine", "dckpt-collective"],
        why: "PyTorch's formats are parsed and written without IO; reading their files is convert's",
    },
    Never {
        from: "dckpt-storage",
        to: &["dckpt-collective", "dckpt-shard-spec", "dckpt-layout", "dckpt-format"],
        why: "storage knows nothing of tensors, ranks or checkpoints",
    },
    Never {
        from: "dckpt-collective",
        to: &["dckpt-storage", "dckpt-shard-spec", "dckpt-layout", "dckpt-format"],
        why: "collective knows nothing of tensors or storage",
    },
    Never {
        from: "dckpt-engine",
        to: &["dckpt-layout", "dckpt-reference", "dckpt"],
        why: "the engine knows no model and no layout; the reference driver and the facade sit above it",
    },
    Never {
        from: "dckpt",
        to: &["dckpt-reference"],
        why: "the facade is what embedders link; the reference driver is for the demo, tests and benchmarks",
    },
    Never {
        from: "dckpt-convert",
        to: &["dckpt-reference"],
        why: "converters read and write checkpoints whatever model made them; the CLI sits above them",
    },
];

/// The engine's users above the facade use it as an embedder does, so what the facade
/// offers is enough and the engine's own API can change behind it.
const THROUGH: &[Through] = &[
    Through {
        from: "dckpt-cli",
        to: &["dckpt-engine", "dckpt-layout", "dckpt-storage", "dckpt-collective"],
        via: "dckpt",
        why: "the CLI is a user of the facade: the engine, storage, collectives and layout math only through it",
    },
    Through {
        from: "dckpt-convert",
        to: &["dckpt-engine", "dckpt-collective", "dckpt-storage"],
        via: "dckpt",
        why: "converters reach storage and the engine only through the facade (its checkpointer, a world of one)",
    },
    Through {
        from: "dckpt-reference",
        to: &["dckpt-engine", "dckpt-layout"],
        via: "dckpt",
        why: "the reference driver, under the CLI, reaches the engine and the layout only through the facade",
    },
];

/// Packages a rule's package must not reach when it is built alone (cargo resolving the
/// features of that package only, as its users' builds do): arrows that exist in the
/// workspace only behind a feature someone else turns on.
const ALONE: &[Never] = &[Never {
    from: "dckpt-convert",
    to: &["dckpt-layout", "dckpt-reference"],
    why: "converters know no model and no layout: they use the facade without its `layout` feature",
}];

const ONLY: &[Only] = &[
    Only { from: "dckpt-shard-spec", allowed: &[], why: "shard-spec is the bottom of the graph" },
    Only { from: "dckpt-layout", allowed: &["dckpt-shard-spec"], why: "layout builds on the vocabulary alone" },
    Only { from: "dckpt-format", allowed: &["dckpt-shard-spec"], why: "the format builds on the vocabulary alone" },
    Only {
        from: "dckpt-torch-format",
        allowed: &["dckpt-shard-spec", "dckpt-format"],
        why: "PyTorch's formats build on the vocabulary and report through format's error",
    },
];

/// The CLI is the top: no library may reach it.
const TOP: &str = "dckpt-cli";

/// The part of `cargo metadata` the rules read.
struct Graph {
    /// Package id -> name.
    names: BTreeMap<String, String>,
    /// Package id -> ids of its normal dependencies.
    normal: BTreeMap<String, Vec<String>>,
    /// Names of the workspace's packages that have a library target.
    libraries: BTreeSet<String>,
    /// Names of the workspace's packages.
    members: BTreeSet<String>,
}

impl Graph {
    fn from_metadata(m: &Value) -> Graph {
        let packages = m["packages"].as_array().expect("metadata has packages");
        let names: BTreeMap<String, String> = packages.iter().map(|p| (str_of(&p["id"]), str_of(&p["name"]))).collect();
        let member_ids: BTreeSet<String> =
            m["workspace_members"].as_array().expect("metadata has workspace_members").iter().map(str_of).collect();
        let members = member_ids.iter().map(|id| names[id].clone()).collect();
        let libraries = packages
            .iter()
            .filter(|p| member_ids.contains(&str_of(&p["id"])))
            .filter(|p| {
                p["targets"].as_array().into_iter().flatten().any(|t| {
                    t["kind"].as_array().into_iter().flatten().any(|k| matches!(k.as_str(), Some("lib" | "rlib")))
                })
            })
            .map(|p| str_of(&p["name"]))
            .collect();
        let nodes = m["resolve"]["nodes"].as_array().expect("metadata has a resolve graph");
        let normal = nodes
            .iter()
            .map(|n| {
                let deps = n["deps"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|d| d["dep_kinds"].as_array().into_iter().flatten().any(|k| k["kind"].is_null()))
                    .map(|d| str_of(&d["pkg"]))
                    .collect();
                (str_of(&n["id"]), deps)
            })
            .collect();
        Graph { names, normal, libraries, members }
    }

    fn id_of(&self, name: &str) -> Option<&String> {
        self.names.iter().find(|(id, n)| n.as_str() == name && self.normal.contains_key(*id)).map(|(id, _)| id)
    }

    /// Every package `from` reaches over normal dependencies, with the shortest path to it
    /// (`from -> a -> b`); None when `from` is not in the graph.
    fn reach(&self, from: &str) -> Option<BTreeMap<String, Vec<String>>> {
        self.reach_avoiding(from, None)
    }

    /// [`Graph::reach`] with the package `avoid` (and what only it leads to) left out.
    fn reach_avoiding(&self, from: &str, avoid: Option<&str>) -> Option<BTreeMap<String, Vec<String>>> {
        let start = self.id_of(from)?;
        let mut paths: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut queue = VecDeque::from([(start.clone(), vec![from.to_string()])]);
        let mut seen = BTreeSet::from([start.clone()]);
        while let Some((id, path)) = queue.pop_front() {
            for dep in self.normal.get(&id).into_iter().flatten() {
                if Some(self.names[dep].as_str()) == avoid {
                    continue;
                }
                if seen.insert(dep.clone()) {
                    let mut p = path.clone();
                    p.push(self.names[dep].clone());
                    paths.entry(self.names[dep].clone()).or_insert_with(|| p.clone());
                    queue.push_back((dep.clone(), p));
                }
            }
        }
        Some(paths)
    }

    /// One line per broken rule, naming the arrow's path; and the rules skipped because
    /// their package does not exist.
    fn violations(&self) -> (Vec<String>, Vec<&'static str>) {
        let (mut broken, mut skipped) = (Vec::new(), Vec::new());
        let arrow = |p: &[String]| p.join(" -> ");
        for rule in NEVER {
            let Some(reach) = self.reach(rule.from) else {
                skipped.push(rule.from);
                continue;
            };
            for to in rule.to {
                if let Some(p) = reach.get(*to) {
                    broken.push(format!("{} ({} must never reach {to}: {})", arrow(p), rule.from, rule.why));
                }
            }
        }
        for rule in THROUGH {
            let Some(reach) = self.reach_avoiding(rule.from, Some(rule.via)) else {
                skipped.push(rule.from);
                continue;
            };
            for to in rule.to {
                if let Some(p) = reach.get(*to) {
                    broken.push(format!(
                        "{} ({} may reach {to} only through {}: {})",
                        arrow(p),
                        rule.from,
                        rule.via,
                        rule.why
                    ));
                }
            }
        }
        for rule in ONLY {
            let Some(reach) = self.reach(rule.from) else {
                skipped.push(rule.from);
                continue;
            };
            for (name, p) in &reach {
                if self.members.contains(name) && !rule.allowed.contains(&name.as_str()) {
                    let allowed = if rule.allowed.is_empty() { "none".to_string() } else { rule.allowed.join(", ") };
                    broken.push(format!(
                        "{} ({} may reach only these workspace crates: {allowed}; {})",
                        arrow(p),
                        rule.from,
                        rule.why
                    ));
                }
            }
        }
        for lib in self.libraries.iter().filter(|l| l.as_str() != TOP) {
            if let Some(p) = self.reach(lib).and_then(|r| r.get(TOP).cloned()) {
                broken.push(format!("{} (no library may depend on {TOP}, the top of the graph)", arrow(&p)));
            }
        }
        skipped.sort_unstable();
        skipped.dedup();
        (broken, skipped)
    }
}

fn str_of(v: &Value) -> String {
    v.as_str().unwrap_or_else(|| panic!("expected a string in cargo metadata, got {v}")).to_string()
}

/// `cargo metadata` of this workspace for the host, every feature on; with default
/// features only if cargo cannot resolve them all (an offline machine that never
/// downloaded an optional dependency), saying so.
fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let version = Command::new(&cargo).arg("-vV").output().expect("running cargo -vV");
    let version = String::from_utf8_lossy(&version.stdout);
    let host = version.lines().find_map(|l| l.strip_prefix("host: ")).expect("cargo -vV names the host").trim();
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let run = |features: &[&str]| {
        let mut c = Command::new(&cargo);
        c.args(["metadata", "--format-version", "1", "--filter-platform", host, "--manifest-path", manifest]);
        c.args(features);
        c.output().expect("running cargo metadata")
    };
    let mut out = run(&["--all-features"]);
    if !out.status.success() {
        eprintln!(
            "cargo metadata --all-features failed, checking default features only: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        out = run(&[]);
    }
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

#[test]
fn no_dependency_arrow_that_architecture_md_forbids() {
    let graph = Graph::from_metadata(&metadata());
    // The rules must bite on the crates that exist today, or they check nothing.
    for crate_ in [
        "dckpt-shard-spec",
        "dckpt-layout",
        "dckpt-format",
        "dckpt-torch-format",
        "dckpt-storage",
        "dckpt-collective",
        TOP,
    ] {
        assert!(graph.members.contains(crate_), "{crate_} is not a workspace member; update the rules");
    }
    let (broken, skipped) = graph.violations();
    if !skipped.is_empty() {
        eprintln!("rules skipped, no such package yet: {}", skipped.join(", "));
    }
    assert!(broken.is_empty(), "forbidden dependency arrows (see ARCHITECTURE.md):\n  {}", broken.join("\n  "));
}

/// A Rust version as numbers, `1.88` and `1.88.0` alike.
fn version(v: &str) -> Vec<u64> {
    let mut parts: Vec<u64> =
        v.split('.').map(|p| p.parse().unwrap_or_else(|_| panic!("rust-version {v:?}"))).collect();
    parts.resize(3, 0);
    parts
}

/// `rust-version` is a promise: every crate of the workspace makes the same one, and no
/// dependency (dev and build ones too, since the tests must build there) needs a newer
/// Rust. The standard library's side is clippy's `incompatible_msrv` (in `cargo xtask
/// test`); language features only a build with that toolchain can check.
/// The metadata above resolves every feature at once; these are the builds an embedder
/// makes without the optional parts: the formats alone, storage without S3, the facade
/// without its defaults. None may reach an async runtime or an HTTP client.
#[test]
fn the_pure_builds_reach_no_async_runtime() {
    for (package, flags) in [
        ("dckpt-format", &[][..]),
        ("dckpt-torch-format", &[][..]),
        ("dckpt-shard-spec", &[][..]),
        ("dckpt-storage", &["--no-default-features"][..]),
        ("dckpt-engine", &[][..]),
        ("dckpt", &["--no-default-features"][..]),
    ] {
        for name in tree(package, flags) {
            assert!(!ASYNC_AND_NETWORK.contains(&name.as_str()), "cargo tree -p {package} {flags:?} reaches {name}");
        }
    }
}

#[test]
fn the_crates_built_alone_reach_nothing_their_rules_forbid() {
    for rule in ALONE {
        let reached = tree(rule.from, &[]);
        for to in rule.to {
            assert!(!reached.iter().any(|n| n == to), "{} built alone reaches {to}: {}", rule.from, rule.why);
        }
    }
}

/// The names of the packages `package` reaches over normal dependencies, built alone with
/// `flags` (cargo resolves the features of that package only).
fn tree(package: &str, flags: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let out = Command::new(&cargo)
        .args(["tree", "-p", package, "-e", "normal", "--prefix", "none", "--manifest-path", manifest])
        .args(flags)
        .output()
        .expect("running cargo tree");
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.lines().any(|l| l.starts_with(package)), "cargo tree -p {package} printed no tree: {tree}");
    tree.lines().map(|l| l.split_whitespace().next().unwrap_or_default().to_string()).collect()
}

#[test]
fn rust_version_is_not_contradicted_by_a_dependency() {
    let m = metadata();
    let members: BTreeSet<String> = m["workspace_members"].as_array().unwrap().iter().map(str_of).collect();
    let packages = m["packages"].as_array().unwrap();
    let ours: BTreeSet<String> = packages
        .iter()
        .filter(|p| members.contains(&str_of(&p["id"])))
        .map(|p| match p["rust_version"].as_str() {
            Some(v) => v.to_string(),
            None => panic!("{} states no rust-version; use rust-version.workspace = true", str_of(&p["name"])),
        })
        .collect();
    assert_eq!(ours.len(), 1, "the workspace's crates state different rust-versions: {ours:?}");
    let ours = ours.into_iter().next().unwrap();
    let resolved: BTreeSet<String> =
        m["resolve"]["nodes"].as_array().unwrap().iter().map(|n| str_of(&n["id"])).collect();
    let newer: Vec<String> = packages
        .iter()
        .filter(|p| resolved.contains(&str_of(&p["id"])))
        .filter_map(|p| {
            let theirs = p["rust_version"].as_str()?;
            (version(theirs) > version(&ours))
                .then(|| format!("{} {} needs {theirs}", str_of(&p["name"]), str_of(&p["version"])))
        })
        .collect();
    assert!(newer.is_empty(), "rust-version says {ours}, but: {}", newer.join("; "));
}

/// The checker on a made-up graph: a path through a crate that does exist is reported
/// whole, and a rule about a crate that does not exist is skipped.
#[test]
fn the_checker_names_the_whole_arrow_and_skips_absent_crates() {
    let pkg =
        |name: &str| serde_json::json!({"id": format!("{name}-id"), "name": name, "targets": [{"kind": ["lib"]}]});
    let node = |name: &str, deps: &[(&str, Option<&str>)]| {
        let deps: Vec<Value> = deps
            .iter()
            .map(|(d, kind)| serde_json::json!({"pkg": format!("{d}-id"), "dep_kinds": [{"kind": kind, "target": null}]}))
            .collect();
        serde_json::json!({"id": format!("{name}-id"), "deps": deps})
    };
    let m = serde_json::json!({
        "packages": [pkg("dckpt-format"), pkg("dckpt-storage"), pkg("tokio"), pkg("dckpt-shard-spec"), pkg("dckpt-cli"), pkg("proptest")],
        "workspace_members": ["dckpt-format-id", "dckpt-storage-id", "dckpt-shard-spec-id", "dckpt-cli-id"],
        "resolve": {"nodes": [
            node("dckpt-format", &[("dckpt-shard-spec", None), ("dckpt-storage", None)]),
            node("dckpt-storage", &[("tokio", None)]),
            // A dev-dependency is not an arrow.
            node("dckpt-shard-spec", &[("dckpt-cli", Some("dev")), ("proptest", Some("dev"))]),
            node("tokio", &[]),
            node("dckpt-cli", &[("dckpt-format", None)]),
            node("proptest", &[]),
        ]},
    });
    let (broken, skipped) = Graph::from_metadata(&m).violations();
    assert!(
        broken
            .iter()
            .any(|b| b.starts_with("dckpt-format -> dckpt-storage -> tokio (dckpt-format must never reach tokio")),
        "{broken:#?}"
    );
    assert!(
        broken.iter().any(|b| b.starts_with("dckpt-format -> dckpt-storage (dckpt-format may reach only")),
        "{broken:#?}"
    );
    assert!(
        broken.iter().any(|b| b.starts_with(
            "dckpt-cli -> dckpt-format -> dckpt-storage (dckpt-cli may reach dckpt-storage only through dckpt"
        )),
        "{broken:#?}"
    );
    assert_eq!(broken.len(), 3, "{broken:#?}");
    assert_eq!(
        skipped,
        [
            "dckpt",
            "dckpt-collective",
            "dckpt-convert",
            "dckpt-engine",
            "dckpt-layout",
            "dckpt-reference",
            "dckpt-torch-format"
        ]
    );
}

/// The CLI on a made-up graph that reaches the engine both through the facade and around
/// it: only the way around is reported, whole.
#[test]
fn reaching_the_engine_around_the_facade_is_refused() {
    let names = ["dckpt-cli", "dckpt", "dckpt-engine", "dckpt-reference"];
    let arrow = |to: &str| serde_json::json!({"pkg": format!("{to}-id"), "dep_kinds": [{"kind": null}]});
    let m = serde_json::json!({
        "packages": names.iter().map(|n| serde_json::json!({"id": format!("{n}-id"), "name": n})).collect::<Vec<_>>(),
        "workspace_members": names.iter().map(|n| format!("{n}-id")).collect::<Vec<_>>(),
        "resolve": {"nodes": [
            {"id": "dckpt-cli-id", "deps": [arrow("dckpt"), arrow("dckpt-reference")]},
            {"id": "dckpt-reference-id", "deps": [arrow("dckpt-engine")]},
            {"id": "dckpt-id", "deps": [arrow("dckpt-engine")]},
            {"id": "dckpt-engine-id", "deps": []},
        ]},
    });
    let (broken, _) = Graph::from_metadata(&m).violations();
    let start = "dckpt-cli -> dckpt-reference -> dckpt-engine (dckpt-cli may reach dckpt-engine only through dckpt";
    assert!(broken.iter().any(|b| b.starts_with(start)), "{broken:#?}");
    let start = "dckpt-reference -> dckpt-engine (dckpt-reference may reach dckpt-engine only through dckpt";
    assert!(broken.iter().any(|b| b.starts_with(start)), "{broken:#?}");
    assert_eq!(broken.len(), 2, "{broken:#?}");
}

/// PyTorch's formats on a made-up graph where they read through storage: both of their
/// rules name the arrow, and reaching the format crate alone is allowed.
#[test]
fn torch_format_reaching_storage_is_refused() {
    let names = ["dckpt-torch-format", "dckpt-format", "dckpt-shard-spec", "dckpt-storage", "object_store"];
    let m = serde_json::json!({
        "packages": names.iter().map(|n| serde_json::json!({"id": format!("{n}-id"), "name": n})).collect::<Vec<_>>(),
        "workspace_members": names[..4].iter().map(|n| format!("{n}-id")).collect::<Vec<_>>(),
        "resolve": {"nodes": [
            {"id": "dckpt-torch-format-id", "deps": [
                {"pkg": "dckpt-format-id", "dep_kinds": [{"kind": null}]},
                {"pkg": "dckpt-storage-id", "dep_kinds": [{"kind": null}]},
            ]},
            {"id": "dckpt-format-id", "deps": [{"pkg": "dckpt-shard-spec-id", "dep_kinds": [{"kind": null}]}]},
            {"id": "dckpt-shard-spec-id", "deps": []},
            {"id": "dckpt-storage-id", "deps": [{"pkg": "object_store-id", "dep_kinds": [{"kind": null}]}]},
            {"id": "object_store-id", "deps": []},
        ]},
    });
    let (broken, _) = Graph::from_metadata(&m).violations();
    let from_torch: Vec<&String> = broken.iter().filter(|b| b.starts_with("dckpt-torch-format ->")).collect();
    let starts = [
        "dckpt-torch-format -> dckpt-storage -> object_store (dckpt-torch-format must never reach object_store",
        "dckpt-torch-format -> dckpt-storage (dckpt-torch-format must never reach dckpt-storage",
        "dckpt-torch-format -> dckpt-storage (dckpt-torch-format may reach only these workspace crates: \
         dckpt-shard-spec, dckpt-format;",
    ];
    for start in starts {
        assert!(from_torch.iter().any(|b| b.starts_with(start)), "{start}: {from_torch:#?}");
    }
    assert_eq!(from_torch.len(), 3, "{from_torch:#?}");
}

mod size;

/// The most non-test lines a module may have: beyond it a file holds more than one idea.
const MODULE_LINES_MAX: usize = 600;
/// The most lines a production function may span: beyond it a reader cannot hold it at once.
const FN_LINES_MAX: usize = 80;

/// The size rule, over `crates/*/src`, `tests/src` and `xtask/src`: code that is read far more
/// often than written stays in pieces a reader takes in at once. Test code
/// (`#[cfg(test)]`) is exempt: a table of cases is long and still read at a glance.
#[test]
fn no_module_over_600_lines_and_no_function_over_80() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let files = size::production_files(root);
    // The walk must find the workspace, or the rule checks nothing.
    assert!(files.len() > 100, "only {} source files under {}", files.len(), root.display());
    let mut offenders = Vec::new();
    for file in &files {
        let sizes = size::sizes(&std::fs::read_to_string(file).expect("read a source file"));
        let rel = file.strip_prefix(root).expect("under the root").display();
        if sizes.lines > MODULE_LINES_MAX {
            offenders.push(format!("{rel}:1: module of {} non-test lines (at most {MODULE_LINES_MAX})", sizes.lines));
        }
        for (name, line, lines) in sizes.fns.iter().filter(|f| f.2 > FN_LINES_MAX) {
            offenders.push(format!("{rel}:{line}: fn {name} spans {lines} lines (at most {FN_LINES_MAX})"));
        }
    }
    assert!(offenders.is_empty(), "{} over the size rule:\n{}", offenders.len(), offenders.join("\n"));
}

/// The size lexer on what would fool a plain brace count: braces and `fn` inside strings,
/// raw strings, characters and comments, lifetimes, and test items.
#[test]
fn the_size_lexer_counts_only_production_code() {
    let src = r##"//! { a doc comment's brace
fn one() {
    let s = "}{ fn two() {";
    let r = r#"}"#;
    let c = '}';
    let e = '\'';
    let u = '\u{7d}';
    /* } /* nested } */ } */
    let b = br"}\";
}

pub(crate) fn three<'a>(x: &'a str) -> Result<Vec<u8>, ()> {
    let _ = x;
    Ok(Vec::new())
}

fn declared();

#[cfg(test)]
mod tests {
    fn helper() {}
}
"##;
    let sizes = size::sizes(src);
    let fns: Vec<(&str, usize, usize)> = sizes.fns.iter().map(|(n, a, l)| (n.as_str(), *a, *l)).collect();
    assert_eq!(fns, [("one", 2, 9), ("three", 12, 4)]);
    // 22 lines, of which the test module's 4 are not production.
    assert_eq!(sizes.lines, 18);
    // The files a `#[cfg(test)] mod x;` pulls in are left out; other modules' are not.
    let mods = "#[cfg(test)]\nmod tests;\n#[cfg(test)] pub(crate) mod more;\nmod prod;\n";
    assert_eq!(size::test_mods(&size::mask(mods)), ["tests", "more"]);
}
