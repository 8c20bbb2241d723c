//! Small helpers every test needs: free ports, bounded polling, paths of built binaries.

use std::future::Future;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// A port that was free a moment ago. Ports are handed out from a per-process cursor above the
/// ephemeral range's start so two stacks in one process never get the same port, then probed.
pub fn free_port() -> u16 {
    let reserved = RESERVED.lock().expect("reserved ports").clone();
    // Ports below the kernel's ephemeral range (32768+) so outgoing connections never take them.
    const FIRST: u16 = 20_000;
    const LAST: u16 = 32_000;
    static CURSOR: AtomicU16 = AtomicU16::new(0);
    // Spread concurrent test binaries apart by pid.
    let base = FIRST + (std::process::id() % 200) as u16 * 50;
    loop {
        let offset = CURSOR.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (base - FIRST + offset) % (LAST - FIRST);
        if !reserved.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Ports a part of this process's stack is configured to use but may not have bound yet (a
/// stack brought up again on its recorded ports starts its parts in parallel): [`free_port`]
/// never hands them out, or a part picking a fresh port could take another part's.
static RESERVED: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Keeps [`free_port`] away from `ports` for the rest of this process.
pub fn reserve_ports(ports: impl IntoIterator<Item = u16>) {
    RESERVED.lock().expect("reserved ports").extend(ports);
}

/// Polls `check` until it returns `Some`, at most `timeout`. The poll interval is short because
/// everything here is local.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    const POLL_INTERVAL_MS: u64 = 50;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
    }
}

/// The same as [`eventually`], for code that is not async (stack start-up).
pub fn wait_blocking(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    const POLL_INTERVAL_MS: u64 = 50;
    let deadline = Instant::now() + timeout;
    while !check() {
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(POLL_INTERVAL_MS));
    }
    Ok(())
}

/// The workspace root (where `Cargo.toml` with `[workspace]` lives).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .nth(2)
        .expect("crates/testkit is two levels below the root")
        .to_path_buf()
}

/// The cargo target directory: `CARGO_TARGET_DIR` or `<root>/target`.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Where the binaries a stack starts are: `PAYOUT_BIN_DIR` if set; else the directory of the
/// running program when it holds the service binaries too (so `target/release/payoutdev` runs a
/// stack of release binaries, and `target/debug/payoutdev` one of debug binaries); else
/// `target/debug` (test binaries live in `target/debug/deps`, beside no service binary).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PAYOUT_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let own_dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf));
    match own_dir {
        Some(dir) if dir.join("payment-resource").exists() => dir,
        _ => target_dir().join("debug"),
    }
}

/// Path of a binary of this workspace (see [`bin_dir`]).
pub fn workspace_bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "binary {} is not built: run `cargo build --bins` first (the README's test command does)",
        path.display()
    );
    path
}

/// A minimal HTTP/1.0 GET for readiness probes that must not need an async runtime.
/// Returns (status code, body).
pub fn http_get(port: u16, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// (uid, gid) to run PostgreSQL as when this process is root (it refuses to run as root):
/// Debian's `postgres` user, else `nobody`. `None` when not root.
pub fn unprivileged_user() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    for name in ["postgres", "nobody"] {
        let cname = std::ffi::CString::new(name).expect("no NUL");
        // SAFETY: getpwnam returns a pointer to static storage or null; read it immediately.
        let pw = unsafe { libc::getpwnam(cname.as_ptr()) };
        if !pw.is_null() {
            // SAFETY: non-null pointer from getpwnam.
            let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
            return Some((uid, gid));
        }
    }
    panic!(
        "running as root and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as"
    );
}

/// Lets another user (`user`, when there is one) reach `path`: every ancestor folder that others
/// cannot traverse gets the traverse bit (o+x, as 0711: nothing is listed). A checkout or a
/// `mktemp -d` folder is 0700, so a program or a folder inside it is out of reach of a process
/// started as another user until then (seen: the CI clone's `.venv/bin/temporal`, Permission
/// denied, under `/tmp/tmp.XXXX`).
pub fn open_way_to(path: &std::path::Path, user: Option<(u32, u32)>) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if user.is_none() {
        return Ok(());
    }
    for ancestor in path.ancestors().skip(1) {
        if ancestor.as_os_str().is_empty() || ancestor == std::path::Path::new("/") {
            break;
        }
        let meta = std::fs::metadata(ancestor)?;
        let mode = meta.permissions().mode();
        if mode & 0o001 == 0 {
            std::fs::set_permissions(ancestor, std::fs::Permissions::from_mode(mode | 0o711))?;
        }
    }
    Ok(())
}

/// Gives `user` ownership of `dir` (recursively) and makes every ancestor traversable, so an
/// unprivileged server can use a directory made by root (tempdirs are 0700).
pub fn hand_over(dir: &std::path::Path, user: Option<(u32, u32)>) -> anyhow::Result<()> {
    let Some((uid, gid)) = user else {
        return Ok(());
    };
    open_way_to(dir, user)?;
    let status = std::process::Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{gid}"))
        .arg(dir)
        .status()?;
    anyhow::ensure!(
        status.success(),
        "chown -R {uid}:{gid} {} failed",
        dir.display()
    );
    Ok(())
}

/// Whether `pid` is a live process. A zombie (exited, not yet reaped: in a container whose init
/// does not reap, detached daemons end up so) counts as dead.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start())
            .is_some_and(|r| !r.starts_with('Z')),
        Err(_) => false,
    }
}

/// The process listening on TCP `port` (any local address, IPv4 or IPv6), from `/proc/net/tcp*`
/// and each process's open sockets: what serves a port, whichever pid a record holds. Where a
/// listening socket is shared by a process and its children (inherited), the one whose parent
/// does not hold it. `None` when nothing listens there or the sockets cannot be read.
pub fn listening_pid(port: u16) -> Option<u32> {
    // The listening sockets' inodes: local address `ADDR:PORT` (hex), state 0A (LISTEN).
    let mut inodes = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) =
                (fields.get(1), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let local_port = local
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && *state == "0A" && *inode != "0" {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    let mut holders = Vec::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|target| inodes.contains(target.to_string_lossy().as_ref()))
        });
        if holds && pid_alive(pid) {
            holders.push(pid);
        }
    }
    let parent = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    holders
        .iter()
        .copied()
        .find(|&pid| parent(pid).is_none_or(|p| !holders.contains(&p)))
        .or_else(|| holders.first().copied())
}

/// How long [`close_pool`] waits for a pool's connections to close.
const POOL_CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Closes `pool`, waiting at most [`POOL_CLOSE_WAIT`]: sqlx's `Pool::close` waits for every
/// connection's permit, and a permit its return-to-pool task never gives back (a race in sqlx's
/// close, transact-rs/sqlx#3217 and #4349) leaves the wait pending for ever with no I/O and no
/// timer: a clean-clone run of the attack suite hung so, idle, for minutes. Past the bound the
/// pool is dropped, which closes what is left in the background.
pub async fn close_pool(pool: sqlx::PgPool) {
    if tokio::time::timeout(POOL_CLOSE_WAIT, pool.close())
        .await
        .is_err()
    {
        eprintln!("testkit: a pool did not close within {POOL_CLOSE_WAIT:?}; dropped");
    }
}

#[cfg(test)]
mod listening_tests {
    #[test]
    fn the_listening_pid_of_a_port_this_process_holds_is_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(super::listening_pid(port), Some(std::process::id()));
        drop(listener);
        assert_eq!(super::listening_pid(port), None);
    }
}
