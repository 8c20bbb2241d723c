//! Processes the kit starts, and the faults it can inject into them.
//!
//! Every child gets its own process group, so a signal reaches the whole tree (a PostgreSQL
//! postmaster and its backends, the Temporal CLI and its server). Attached children (tests) also
//! die with the test binary: they are spawned from one long-lived thread with
//! `PR_SET_PDEATHSIG = SIGKILL` (the signal fires when the *spawning thread* exits, so that thread
//! must outlive every test), and an `atexit` hook kills every group still registered.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long a graceful stop waits before escalating to SIGKILL; a service that needs longer to
/// drain is itself a defect under test.
pub const TERMINATE_GRACE_MS: u64 = 10_000;

/// Whether a child must die with this process (tests) or outlive it (`payoutdev stack up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    Attached,
    Detached,
}

#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub name: String,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<PathBuf>,
    /// Run as this (uid, gid): PostgreSQL refuses to run as root.
    pub user: Option<(u32, u32)>,
    /// stdout and stderr are appended here.
    pub log_path: PathBuf,
    pub lifetime: Lifetime,
}

impl ProcessSpec {
    pub fn new(name: &str, program: impl Into<PathBuf>, log_path: impl Into<PathBuf>) -> Self {
        Self {
            name: name.to_string(),
            program: program.into(),
            args: Vec::new(),
            env: BTreeMap::new(),
            cwd: None,
            user: None,
            log_path: log_path.into(),
            lifetime: Lifetime::Attached,
        }
    }
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }
    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Self {
        self.env.insert(key.to_string(), value.into());
        self
    }
    pub fn envs<I: IntoIterator<Item = (String, String)>>(mut self, vars: I) -> Self {
        self.env.extend(vars);
        self
    }
    pub fn user(mut self, user: Option<(u32, u32)>) -> Self {
        self.user = user;
        self
    }
    pub fn lifetime(mut self, lifetime: Lifetime) -> Self {
        self.lifetime = lifetime;
        self
    }
    pub fn cwd(mut self, cwd: impl Into<PathBuf>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    fn command(&self) -> anyhow::Result<Command> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("opening log {}", self.log_path.display()))?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(&self.env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        if let Some(cwd) = &self.cwd {
            cmd.current_dir(cwd);
        }
        if let Some((uid, gid)) = self.user {
            cmd.uid(uid).gid(gid);
        }
        if self.lifetime == Lifetime::Attached {
            // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec, after
            // the uid/gid change (which would otherwise clear the setting).
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        Ok(cmd)
    }
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// The one thread that spawns attached children. It never exits, so PDEATHSIG fires only when
/// the whole process dies.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("testkit-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawner thread");
        Mutex::new(tx)
    })
}

/// Process groups to kill when this process exits.
fn live_groups() -> &'static Mutex<Vec<i32>> {
    static GROUPS: OnceLock<Mutex<Vec<i32>>> = OnceLock::new();
    GROUPS.get_or_init(|| {
        extern "C" fn kill_all_at_exit() {
            if let Ok(groups) = live_groups().lock() {
                for pgid in groups.iter() {
                    // SAFETY: plain syscalls on process groups this process created.
                    unsafe {
                        libc::kill(-pgid, libc::SIGKILL);
                    }
                }
                // Give the kernel a moment to tear the processes down before their files go.
                if !groups.is_empty() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            remove_registered_dirs();
        }
        // SAFETY: registering a plain extern "C" fn.
        unsafe {
            libc::atexit(kill_all_at_exit);
        }
        Mutex::new(Vec::new())
    })
}

fn spawn(spec: &ProcessSpec) -> anyhow::Result<Child> {
    let cmd = spec.command()?;
    let child = match spec.lifetime {
        Lifetime::Detached => {
            let mut cmd = cmd;
            cmd.spawn()
        }
        Lifetime::Attached => {
            let (tx, rx) = mpsc::channel();
            spawner()
                .lock()
                .expect("spawner lock")
                .send((cmd, tx))
                .expect("spawner thread alive");
            rx.recv().expect("spawner replies")
        }
    }
    .with_context(|| format!("starting {} ({})", spec.name, spec.program.display()))?;
    if spec.lifetime == Lifetime::Attached {
        live_groups()
            .lock()
            .expect("groups lock")
            .push(child.id() as i32);
    }
    Ok(child)
}

/// A child process with fault injection: kill, terminate, pause, resume, restart.
pub struct ManagedProcess {
    spec: ProcessSpec,
    child: Mutex<Option<Child>>,
}

impl ManagedProcess {
    pub fn start(spec: ProcessSpec) -> anyhow::Result<Self> {
        let child = spawn(&spec)?;
        Ok(Self {
            spec,
            child: Mutex::new(Some(child)),
        })
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }
    pub fn spec(&self) -> &ProcessSpec {
        &self.spec
    }
    pub fn log_path(&self) -> &Path {
        &self.spec.log_path
    }

    pub fn pid(&self) -> Option<u32> {
        self.child
            .lock()
            .expect("child lock")
            .as_ref()
            .map(|c| c.id())
    }

    /// True while the child has not exited (a paused child is running).
    pub fn is_running(&self) -> bool {
        let mut guard = self.child.lock().expect("child lock");
        match guard.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    fn signal_group(&self, signal: i32) -> anyhow::Result<()> {
        let pid = self
            .pid()
            .with_context(|| format!("{} is not running", self.spec.name))?;
        // SAFETY: a plain syscall on the group this kit created for the child.
        let rc = unsafe { libc::kill(-(pid as i32), signal) };
        if rc != 0 {
            bail!(
                "signal {signal} to {}: {}",
                self.spec.name,
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// SIGKILL to the whole group: no chance to clean up, like a power cut of that process.
    pub fn kill(&self) -> anyhow::Result<()> {
        self.signal_group(libc::SIGKILL)?;
        self.reap(Duration::from_secs(10))
    }

    /// SIGTERM, then SIGKILL after [`TERMINATE_GRACE_MS`].
    pub fn terminate(&self) -> anyhow::Result<()> {
        self.terminate_with(libc::SIGTERM)
    }

    /// Asks the leader to stop with `signal` (PostgreSQL's fast shutdown is SIGINT: SIGTERM is its
    /// "smart" shutdown, which waits for every client to leave), then SIGKILL after the grace.
    pub fn terminate_with(&self, signal: i32) -> anyhow::Result<()> {
        if !self.is_running() {
            return Ok(());
        }
        // SIGTERM to the leader only: a server shuts its own children down in order (a
        // PostgreSQL backend that gets SIGTERM itself is treated as a crash by the postmaster).
        let pid = self
            .pid()
            .with_context(|| format!("{} is not running", self.spec.name))?;
        // SAFETY: plain syscalls on the child this kit started.
        unsafe {
            libc::kill(pid as i32, signal);
        }
        // A paused process only sees SIGTERM once it runs again.
        let _ = self.signal_group(libc::SIGCONT);
        if self
            .reap(Duration::from_millis(TERMINATE_GRACE_MS))
            .is_err()
        {
            tracing::warn!(process = %self.spec.name, "did not stop on SIGTERM; killing");
            self.signal_group(libc::SIGKILL)?;
            self.reap(Duration::from_secs(10))?;
        }
        Ok(())
    }

    /// SIGSTOP: the process keeps its sockets and leases but does nothing, like a long GC pause.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal_group(libc::SIGSTOP)
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal_group(libc::SIGCONT)
    }

    /// Starts the same program with the same arguments again (after a kill or terminate).
    pub fn restart(&self) -> anyhow::Result<()> {
        if self.is_running() {
            bail!(
                "{} is still running; kill or terminate it first",
                self.spec.name
            );
        }
        let child = spawn(&self.spec)?;
        *self.child.lock().expect("child lock") = Some(child);
        Ok(())
    }

    fn reap(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut guard = self.child.lock().expect("child lock");
                match guard.as_mut() {
                    None => return Ok(()),
                    Some(child) => {
                        if child.try_wait()?.is_some() {
                            let pgid = child.id() as i32;
                            // Leftover members of the group (postgres backends) go too.
                            // SAFETY: signal to the group this kit created.
                            unsafe {
                                libc::kill(-pgid, libc::SIGKILL);
                            }
                            live_groups()
                                .lock()
                                .expect("groups lock")
                                .retain(|g| *g != pgid);
                            *guard = None;
                            return Ok(());
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.spec.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Forgets the child without stopping it (a detached daemon handed over to a pidfile).
    pub fn detach(self) -> Option<u32> {
        let pid = self.pid();
        if let Some(pid) = pid {
            live_groups()
                .lock()
                .expect("groups lock")
                .retain(|g| *g != pid as i32);
        }
        std::mem::forget(self);
        pid
    }

    /// The last `lines` lines of the log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.spec.log_path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        if self.spec.lifetime == Lifetime::Attached && self.is_running() {
            let _ = self.signal_group(libc::SIGKILL);
            let _ = self.reap(Duration::from_secs(5));
        }
    }
}

/// Directories to delete when this process exits (after its children are killed).
pub fn remove_at_exit(dir: &Path) {
    live_groups(); // registers the atexit hook
    cleanup_dirs()
        .lock()
        .expect("dirs lock")
        .push(dir.to_path_buf());
}

fn cleanup_dirs() -> &'static Mutex<Vec<PathBuf>> {
    static DIRS: OnceLock<Mutex<Vec<PathBuf>>> = OnceLock::new();
    DIRS.get_or_init(|| Mutex::new(Vec::new()))
}

fn remove_registered_dirs() {
    if let Ok(dirs) = cleanup_dirs().lock() {
        for dir in dirs.iter() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
