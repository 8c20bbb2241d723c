//! `payoutdev stack up` on a stack that is partly down: each part is checked by its own health
//! probe (not only its recorded pid), and only the parts that do not answer are started again,
//! each with the command line, environment and log it was first started with (saved at the first
//! `up` under `<state dir>/parts/`, mode 0600: a service's environment holds its database
//! password, like the stack's credentials file beside it). The infrastructure comes first
//! (PostgreSQL, etcd, Temporal), each waited for before the next, so a service started again
//! finds what it depends on. Every other part keeps running, with its pid.
//!
//! A part that runs one of our own binaries runs this `payoutdev`'s build of it (the binary beside
//! it, or `PAYOUT_BIN_DIR`'s), never the saved path: a stack first started by the debug
//! `payoutdev` ran debug services for ever, so a release `bench e2e` measured debug services. A
//! part that answers but runs another build of ours (its `/proc/<pid>/exe`) is stopped and
//! started again with this build. Third-party programs (PostgreSQL, etcd, Temporal, Prometheus,
//! Alertmanager) keep their saved program.

use std::ffi::OsString;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use payoutctl::record::StackRecord;
use serde::{Deserialize, Serialize};
use testkit::{Lifetime, ManagedProcess, ProcessSpec};

/// Where each part's launch is saved, under the state directory.
const PARTS_DIR: &str = "parts";
/// A part whose process is alive but does not answer gets this long to answer (it may be
/// starting, or PostgreSQL replaying its log) before it is stopped and started again.
const ALIVE_BUT_SILENT_WAIT: Duration = Duration::from_secs(10);
/// A part started again must answer its health probe within this (Temporal replays its SQLite
/// database; a service connects and checks its schema), on a loaded two-core machine.
const RESTARTED_READY_WAIT: Duration = Duration::from_secs(90);
/// How often a waiting `up` asks a part again.
const HEALTH_POLL: Duration = Duration::from_millis(250);
/// A part of another build gets this long to stop on SIGTERM (a worker finishes its tasks, a
/// service drains) before SIGKILL: `stack down`'s grace.
const OTHER_BUILD_STOP_GRACE: Duration = Duration::from_secs(15);
/// A SIGKILLed process is gone within this, or something is wrong with the machine.
const KILLED_EXIT_WAIT: Duration = Duration::from_secs(10);

/// A part's launch as saved: what [`ProcessSpec`] holds, in JSON.
#[derive(Serialize, Deserialize)]
struct SavedLaunch {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: std::collections::BTreeMap<String, String>,
    cwd: Option<PathBuf>,
    user: Option<(u32, u32)>,
    log_path: PathBuf,
}

fn launch_path(dir: &Path, part: &str) -> PathBuf {
    dir.join(PARTS_DIR).join(format!("{part}.json"))
}

/// Saves `part`'s launch (its process as started), for a later `up` that finds it down.
pub fn save(dir: &Path, part: &str, process: &ManagedProcess) -> anyhow::Result<()> {
    save_spec(dir, part, process.spec())
}

fn save_spec(dir: &Path, part: &str, spec: &ProcessSpec) -> anyhow::Result<()> {
    let saved = SavedLaunch {
        name: spec.name.clone(),
        program: spec.program.clone(),
        args: spec
            .args
            .iter()
            .map(|a| {
                a.to_str()
                    .map(str::to_string)
                    .with_context(|| format!("{part}: an argument is not UTF-8: {a:?}"))
            })
            .collect::<anyhow::Result<_>>()?,
        env: spec.env.clone(),
        cwd: spec.cwd.clone(),
        user: spec.user,
        log_path: spec.log_path.clone(),
    };
    std::fs::create_dir_all(dir.join(PARTS_DIR))?;
    let path = launch_path(dir, part);
    let tmp = path.with_extension("json.tmp");
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        file.write_all(&serde_json::to_vec_pretty(&saved)?)?;
    }
    std::fs::rename(&tmp, &path)?;
    Ok(())
}

/// The program `part` was last started with (`None` without a readable saved launch).
pub(crate) fn saved_program(dir: &Path, part: &str) -> Option<PathBuf> {
    load(dir, part).map(|spec| spec.program)
}

fn load(dir: &Path, part: &str) -> Option<ProcessSpec> {
    let text = std::fs::read_to_string(launch_path(dir, part)).ok()?;
    let saved: SavedLaunch = serde_json::from_str(&text).ok()?;
    let mut spec = ProcessSpec::new(&saved.name, saved.program, saved.log_path)
        .args(saved.args.into_iter().map(OsString::from))
        .user(saved.user)
        .lifetime(Lifetime::Detached);
    spec.env = saved.env;
    spec.cwd = saved.cwd;
    Some(spec)
}

/// What [`repair`] did.
pub enum Repair {
    /// Every part answers now; these were started again.
    Repaired { restarted: Vec<String> },
    /// The record cannot be repaired part by part (a part has no saved launch: a stack from
    /// before they were saved); the caller starts the whole stack.
    NeedsFullStart { why: String },
}

/// The infrastructure first, in the record's order; then our services.
fn is_infrastructure(name: &str) -> bool {
    name.starts_with("postgres") || name.starts_with("etcd") || name.starts_with("temporal")
}

/// Checks every part of the recorded stack and starts again only those that do not answer,
/// printing what it does on stderr. The record keeps each kept part's pid; a restarted part's
/// new pid replaces its old one.
pub async fn repair(dir: &Path) -> anyhow::Result<Repair> {
    let mut record = StackRecord::load(dir)?;
    if let Some(missing) = record
        .parts
        .iter()
        .find(|p| !launch_path(dir, &p.name).exists())
    {
        return Ok(Repair::NeedsFullStart {
            why: format!("no saved launch for {}", missing.name),
        });
    }
    let order: Vec<usize> = (0..record.parts.len())
        .filter(|&i| is_infrastructure(&record.parts[i].name))
        .chain((0..record.parts.len()).filter(|&i| !is_infrastructure(&record.parts[i].name)))
        .collect();
    eprintln!("checking {} parts", order.len());
    let mut restarted = Vec::new();
    let mut migrated = false;
    for i in order {
        let part = record.parts[i].clone();
        if !migrated && !is_infrastructure(&part.name) {
            // The infrastructure answers: bring every database to this build's schema (as `up`
            // does on a fresh stack) before a service is checked, or a service started again
            // from a newer build than the stack's refuses its database.
            migrate(dir, &record).await?;
            migrated = true;
        }
        let saved = load(dir, &part.name);
        // Our own binaries run as this payoutdev's build; a third-party program keeps its path.
        let this_build = saved
            .as_ref()
            .and_then(|spec| crate::profile::this_build(&spec.program));
        let mut answers =
            crate::stack::healthy(&part, &record, dir, &crate::stack::Look::open(&record, dir))
                .await;
        if !answers && testkit::util::pid_alive(part.pid) {
            eprintln!(
                "  {:<18} running (pid {}) but not answering; waiting up to {:?}",
                part.name, part.pid, ALIVE_BUT_SILENT_WAIT
            );
            answers = wait_healthy(&part, &record, dir, ALIVE_BUT_SILENT_WAIT).await;
            if !answers {
                eprintln!("  {:<18} still silent: stopping it", part.name);
            }
        }
        let why = if answers {
            match this_build
                .as_deref()
                .and_then(|want| other_build(part.pid, want))
            {
                None => {
                    eprintln!("  {:<18} healthy, kept", part.name);
                    continue;
                }
                Some(running) => {
                    // Never stop a part that answers for want of a binary to start instead.
                    anyhow::ensure!(
                        this_build.as_deref().is_some_and(Path::exists),
                        "{} runs {}, and this payoutdev's {} is not built: `cargo build --bins` \
                         (--release for a release payoutdev) builds it",
                        part.name,
                        crate::profile::shown(&running),
                        this_build
                            .as_deref()
                            .map(crate::profile::shown)
                            .unwrap_or_default()
                    );
                    eprintln!(
                        "  {} runs {}; this payoutdev runs {}: restarting it",
                        part.name,
                        crate::profile::shown(&running),
                        crate::profile::shown(&crate::profile::bin_dir())
                    );
                    stop(&part).await?;
                    "starting this build's"
                }
            }
        } else {
            "down: starting it again"
        };
        // Whatever is left of the part's process group (a killed PostgreSQL's backends) goes
        // first: they hold its shared memory and its port. The group id is the recorded leader's
        // pid, which the kernel does not reuse while the group has a member.
        // SAFETY: a signal to the process group `up` created for this part.
        unsafe {
            libc::kill(-(part.pid as i32), libc::SIGKILL);
        }
        let mut spec =
            saved.with_context(|| format!("reading the saved launch of {}", part.name))?;
        if let Some(want) = this_build {
            if spec.program != want {
                // Saved as it runs from now on, so the launch on disk says what runs.
                spec.program = want;
                save_spec(dir, &part.name, &spec)?;
            }
        }
        remove_stale_postgres_locks(&spec)?;
        eprintln!(
            "  {:<18} {why} ({})",
            part.name,
            crate::profile::shown(&spec.program)
        );
        let process = ManagedProcess::start(spec)?;
        let pid = process.pid().context("a started process has a pid")?;
        // Detached: dropping the handle leaves it running.
        drop(process);
        record.parts[i].pid = pid;
        record.save(dir)?;
        let fresh = record.parts[i].clone();
        anyhow::ensure!(
            wait_healthy(&fresh, &record, dir, RESTARTED_READY_WAIT).await,
            "{} (pid {pid}) did not answer within {RESTARTED_READY_WAIT:?} of its restart (log: {})",
            fresh.name,
            load(dir, &fresh.name)
                .map(|s| s.log_path.display().to_string())
                .unwrap_or_default()
        );
        eprintln!("  {:<18} healthy again (pid {pid})", fresh.name);
        restarted.push(fresh.name);
    }
    Ok(Repair::Repaired { restarted })
}

/// The program `pid` runs when it is another build of `want` (one of our binaries): `None` when
/// it runs `want` itself (an older binary of that path, rebuilt since, is still this build's
/// profile), and when the recorded pid runs no program of that name (gone, or reused by another
/// process: a part restarted by hand answers under another pid, and is not ours to stop).
fn other_build(pid: u32, want: &Path) -> Option<PathBuf> {
    let running = crate::profile::running_program(pid)?;
    (running.file_name() == want.file_name() && running != want).then_some(running)
}

/// Stops a part that answers (one of another build): SIGTERM to its leader, as `stack down`
/// does, SIGKILL to its group after [`OTHER_BUILD_STOP_GRACE`]; returns once it is gone, so its
/// port is free for this build's.
async fn stop(part: &payoutctl::record::Part) -> anyhow::Result<()> {
    let wait_gone = |within: Duration| async move {
        let deadline = Instant::now() + within;
        while testkit::util::pid_alive(part.pid) && Instant::now() < deadline {
            tokio::time::sleep(HEALTH_POLL).await;
        }
        !testkit::util::pid_alive(part.pid)
    };
    // SAFETY: a signal to the part's recorded leader, checked above to run one of our binaries.
    unsafe {
        libc::kill(part.pid as i32, libc::SIGTERM);
    }
    if wait_gone(OTHER_BUILD_STOP_GRACE).await {
        return Ok(());
    }
    eprintln!(
        "  {:<18} did not stop within {OTHER_BUILD_STOP_GRACE:?}; killing it",
        part.name
    );
    // SAFETY: the part's own process group (its leader's pid).
    unsafe {
        libc::kill(-(part.pid as i32), libc::SIGKILL);
    }
    anyhow::ensure!(
        wait_gone(KILLED_EXIT_WAIT).await,
        "{} (pid {}) survived SIGKILL",
        part.name,
        part.pid
    );
    Ok(())
}

/// A killed PostgreSQL leaves `postmaster.pid` (and its socket's lock file) naming a process that
/// is gone, or an unreaped zombie (nothing reaps a detached part's leader here), which PostgreSQL
/// takes for a live server and refuses to start. A lock file whose pid is not alive goes.
fn remove_stale_postgres_locks(spec: &ProcessSpec) -> anyhow::Result<()> {
    let after = |flag: &str| {
        spec.args
            .iter()
            .position(|a| a == flag)
            .and_then(|i| spec.args.get(i + 1))
            .map(PathBuf::from)
    };
    if spec.program.file_name().is_none_or(|n| n != "postgres") {
        return Ok(());
    }
    let mut locks = Vec::new();
    if let Some(data) = after("-D") {
        locks.push(data.join("postmaster.pid"));
    }
    if let Some(sockets) = after("-k") {
        for entry in std::fs::read_dir(&sockets)?.flatten() {
            if entry.file_name().to_string_lossy().ends_with(".lock") {
                locks.push(entry.path());
            }
        }
    }
    for lock in locks {
        let Ok(text) = std::fs::read_to_string(&lock) else {
            continue;
        };
        let pid = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok());
        if pid.is_some_and(|pid| !testkit::util::pid_alive(pid)) {
            std::fs::remove_file(&lock)
                .with_context(|| format!("removing the stale {}", lock.display()))?;
        }
    }
    Ok(())
}

/// Applies this build's migrations to every database of the stack, as the owner role (what
/// `payoutctl migrate` does; nothing when they are applied).
async fn migrate(dir: &Path, record: &StackRecord) -> anyhow::Result<()> {
    for (database, port) in record.databases() {
        let url = StackRecord::login_url(dir, testkit::db_access::OWNER, port, database.name())?;
        payoutctl::migrate::apply(database, &url).await?;
    }
    eprintln!("  databases at this build's schema");
    Ok(())
}

async fn wait_healthy(
    part: &payoutctl::record::Part,
    record: &StackRecord,
    dir: &Path,
    within: Duration,
) -> bool {
    let deadline = Instant::now() + within;
    // The part was (re)started before this wait: what its checks read is final, read once.
    let look = crate::stack::Look::open(record, dir);
    loop {
        if crate::stack::healthy(part, record, dir, &look).await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(HEALTH_POLL).await;
    }
}
