//! Which build of our services a stack runs, read from the kernel (`/proc/<pid>/exe`), not from
//! what was saved when they started: `stack up` restarts a part of another build with this
//! `payoutdev`'s (crate::parts), and a benchmark prints the profile of the services it measured
//! and refuses to measure a mixture, or another build than its own.

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use payoutctl::record::StackRecord;
use serde::Serialize;

/// The project's own programs a stack runs, by file name; every other program of a stack
/// (PostgreSQL, etcd, Temporal, Prometheus, Alertmanager) is third-party and keeps the path it
/// was first started with. As started by `testkit::system` and by `stack up` (the reconciler).
const OUR_BINARIES: &[&str] = &[
    "lock-server",
    "payment-resource",
    "rail-stub",
    "rail-proxy",
    "general-ledger",
    "outbox-dispatcher",
    "payout-worker",
    "payout-test-worker",
    "reconciler",
];

/// What the kernel appends to a process's program when the file was removed (cargo replaces a
/// binary it rebuilds): the process still runs the binary of that path, an older one.
const DELETED_SUFFIX: &str = " (deleted)";

/// Whether `program` (a saved launch's) is one of the project's own binaries.
pub fn is_ours(program: &Path) -> bool {
    program
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| OUR_BINARIES.contains(&n))
}

/// The binary this `payoutdev` starts for `program` when it is one of ours (`PAYOUT_BIN_DIR`'s,
/// else the one beside this `payoutdev`: `testkit::util::bin_dir`), with its links resolved as
/// the kernel shows a running program; `None` for a third-party program. The path may not exist
/// (not built, or being relinked by cargo): whoever starts it says so.
pub fn this_build(program: &Path) -> Option<PathBuf> {
    if !is_ours(program) {
        return None;
    }
    let path = bin_dir().join(program.file_name()?);
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

/// The program `pid` runs, as the kernel names it (without the suffix of a removed file); `None`
/// when the process is gone or is not ours to read.
pub fn running_program(pid: u32) -> Option<PathBuf> {
    let link = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let text = link.to_str()?;
    Some(PathBuf::from(
        text.strip_suffix(DELETED_SUFFIX).unwrap_or(text),
    ))
}

/// The profile a binary was built with, from the folder it runs from (`target/debug/x`: `debug`,
/// `target/release/x`: `release`; an installed binary: its folder's name).
pub fn of(program: &Path) -> String {
    program
        .parent()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "unknown".to_string())
}

/// The folder this `payoutdev`'s services come from: its own, or `PAYOUT_BIN_DIR`.
pub fn bin_dir() -> PathBuf {
    let dir = testkit::util::bin_dir();
    std::fs::canonicalize(&dir).unwrap_or(dir)
}

/// `path` as the user typed it when it lies under the working directory (`target/debug/x`).
pub fn shown(path: &Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| path.to_path_buf())
        .display()
        .to_string()
}

/// The services a benchmark measured: their profile and which they are.
#[derive(Debug, Clone, Serialize)]
pub struct Services {
    /// `debug`, `release`, or the name of the folder their binaries run from; `external` for a
    /// deployment given by its endpoints (its build is not this machine's to read).
    pub profile: String,
    /// The parts that run our binaries (every one of `profile`).
    pub parts: Vec<String>,
    /// Where they run: `stack` (the local stack's processes), `in-process` (hosted in this
    /// `payoutdev`: its own build), `external`.
    pub runs: &'static str,
    /// The folder of their binaries (the stack's only).
    pub bin_dir: Option<PathBuf>,
}

impl Services {
    /// Services hosted in this `payoutdev` (the lock, proxy and ledger benchmarks): its own build.
    pub fn in_process(parts: &[&str]) -> Self {
        Self {
            profile: crate::bench::profile().to_string(),
            parts: parts.iter().map(|p| p.to_string()).collect(),
            runs: "in-process",
            bin_dir: None,
        }
    }

    fn external() -> Self {
        Self {
            profile: "external".to_string(),
            parts: Vec::new(),
            runs: "external",
            bin_dir: None,
        }
    }
}

impl fmt::Display for Services {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.runs {
            "external" => write!(f, "services: an external deployment (its build is its own)"),
            "in-process" => write!(
                f,
                "services: {} ({}, hosted in this payoutdev)",
                self.profile,
                self.parts.join(", ")
            ),
            _ => write!(f, "services: {} ({})", self.profile, self.parts.join(", ")),
        }
    }
}

/// The profile of every service of the stack `target` names, after `up` had its chance to start
/// this build's (`run::ensure_up`). An error, saying what to do, when a service's program cannot
/// be read, when they run more than one build, or another build than this `payoutdev`'s: a
/// figure of such a stack would not say what it measured.
pub fn check(target: &payoutctl::target::Target) -> anyhow::Result<Services> {
    if target.is_external() {
        return Ok(Services::external());
    }
    let dir = &target.state_dir;
    let record = StackRecord::load(dir)?;
    let want = bin_dir();
    let mut parts = Vec::new();
    let mut programs: Vec<(String, PathBuf)> = Vec::new();
    for part in &record.parts {
        let Some(saved) = crate::parts::saved_program(dir, &part.name) else {
            continue;
        };
        if !is_ours(&saved) {
            continue;
        }
        // The process that serves the part's port (a part restarted by hand serves under
        // another pid than the recorded one), else the recorded one.
        let pid = crate::stack::serving_pid(part, &record).unwrap_or(part.pid);
        let program = running_program(pid).with_context(|| {
            format!(
                "{} (pid {pid}) is not running: which build it runs is not known; `payoutdev \
                 stack down && payoutdev stack up` restarts the stack with this payoutdev's",
                part.name
            )
        })?;
        parts.push(part.name.clone());
        programs.push((part.name.clone(), program));
    }
    anyhow::ensure!(
        !programs.is_empty(),
        "the stack in {} runs none of our services (started with --infra-only?)",
        dir.display()
    );
    let mut profiles: Vec<String> = programs.iter().map(|(_, p)| of(p)).collect();
    profiles.sort();
    profiles.dedup();
    let list = |pick: &dyn Fn(&PathBuf) -> bool| {
        programs
            .iter()
            .filter(|(_, p)| pick(p))
            .map(|(n, p)| format!("{n} ({})", shown(p)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    anyhow::ensure!(
        profiles.len() == 1,
        "the stack's services run builds of more than one profile ({}): refusing to measure a \
         mixture; {}",
        profiles.join(", "),
        list(&|_| true)
    );
    let profile = profiles.remove(0);
    let foreign = list(&|p| p.parent() != Some(want.as_path()));
    anyhow::ensure!(
        foreign.is_empty(),
        "these services run another build than this payoutdev's ({}): {foreign}",
        shown(&want)
    );
    let own = std::env::current_exe()
        .map(|exe| of(&exe))
        .unwrap_or_else(|_| crate::bench::profile().to_string());
    anyhow::ensure!(
        profile == own,
        "the services are {profile} binaries ({}) but this payoutdev is a {own} build: refusing \
         to measure one profile beside the other; build this profile's services beside this \
         payoutdev (`cargo build --release --bins` for release), or run the payoutdev beside them",
        shown(&want)
    );
    Ok(Services {
        profile,
        parts,
        runs: "stack",
        bin_dir: Some(want),
    })
}
