//! INV-04's detective control: the highest token this lock-server has issued per key, kept
//! durably OUTSIDE the backend it checks: an append-only file of `{"k": key, "t": token}` lines,
//! one `fdatasync` per group commit, compacted (rewritten atomically by rename) at start.
//!
//! A backend restored from an old snapshot, or a PostgreSQL sequence rewound by a restore, would
//! hand out tokens that were already used; every guard downstream would still run and still pass,
//! so fencing would become decoration without anyone noticing. This file is the memory that
//! notices. When the backend returns a token not above what this server issued before for the key
//! (or, for a re-acquire, below it), the grant is REFUSED (fail closed: a grant with a reused token
//! is worse than no grant), a `token_regression` error event is logged and a counter incremented.
//!
//! Each lock-server process has its own file and checks only the tokens it issued itself; several
//! lock-servers each catch the regressions of the keys they serve.
//!
//! Writes are group-committed: a grant waits until a flush that includes it has been fsynced, and
//! concurrent grants share one flush.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};

use crate::error::LockError;

/// A grant waits at most this long for its record to reach the disk; past that the store is
/// considered broken and the grant is refused (a disk that takes seconds to fsync is an outage).
pub const FLUSH_TIMEOUT_MS: u64 = 5_000;
/// After a failed write the flusher pauses before trying again, so a full disk is not a busy loop.
pub const FLUSH_RETRY_MS: u64 = 200;

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Regression {
    pub highest_issued_token: u64,
}

struct State {
    tokens: BTreeMap<String, u64>,
    /// Raised tokens not yet on disk, in order.
    pending: Vec<(String, u64)>,
    version: u64,
}

pub struct IssuedTokens {
    path: PathBuf,
    /// The log, opened for appending after the start-up compaction.
    log: Arc<Mutex<std::fs::File>>,
    state: Mutex<State>,
    flush_wanted: Arc<Notify>,
    persisted_version: watch::Sender<u64>,
}

impl IssuedTokens {
    /// Loads the file if it exists (a missing file is an empty record: a new server) and starts
    /// the flusher on the current runtime.
    pub fn open(path: impl Into<PathBuf>) -> Result<Arc<Self>, LockError> {
        let path = path.into();
        let tokens: BTreeMap<String, u64> = match std::fs::read(&path) {
            Ok(bytes) => parse(&bytes).map_err(|e| store_err(&path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(store_err(&path, e)),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| store_err(&path, e))?;
        }
        // Compact: one line per key, written atomically, then appended to from here on.
        write_atomically(&path, &tokens).map_err(|e| store_err(&path, e))?;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| store_err(&path, e))?;
        let (persisted_version, _) = watch::channel(0);
        let me = Arc::new(Self {
            path,
            log: Arc::new(Mutex::new(log)),
            state: Mutex::new(State {
                tokens,
                pending: Vec::new(),
                version: 0,
            }),
            flush_wanted: Arc::new(Notify::new()),
            persisted_version,
        });
        tokio::spawn(flusher(Arc::downgrade(&me), me.flush_wanted.clone()));
        Ok(me)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn highest(&self, key: &str) -> Option<u64> {
        self.state
            .lock()
            .expect("issued tokens")
            .tokens
            .get(key)
            .copied()
    }

    /// Checks a token the backend returned and records it durably before the grant is returned.
    /// `minted`: the backend created the entry now (must be strictly above everything issued
    /// before), or returned an existing grant (must not be below).
    pub async fn admit(&self, key: &str, token: u64, minted: bool) -> Result<(), AdmitError> {
        let wait_for = {
            let mut state = self.state.lock().expect("issued tokens");
            let highest = state.tokens.get(key).copied().unwrap_or(0);
            let regressed = if minted {
                token <= highest
            } else {
                token < highest
            };
            if regressed {
                return Err(AdmitError::Regression(Regression {
                    highest_issued_token: highest,
                }));
            }
            if token > highest {
                state.tokens.insert(key.to_string(), token);
                state.pending.push((key.to_string(), token));
                state.version += 1;
            }
            state.version
        };
        if *self.persisted_version.borrow() >= wait_for {
            return Ok(());
        }
        self.flush_wanted.notify_one();
        let mut rx = self.persisted_version.subscribe();
        let persisted = tokio::time::timeout(
            Duration::from_millis(FLUSH_TIMEOUT_MS),
            rx.wait_for(|v| *v >= wait_for),
        )
        .await;
        match persisted {
            Ok(Ok(_)) => Ok(()),
            _ => Err(AdmitError::Store(store_err(
                &self.path,
                "record not persisted in time",
            ))),
        }
    }
}

#[derive(Debug)]
pub enum AdmitError {
    Regression(Regression),
    Store(LockError),
}

fn store_err(path: &Path, e: impl std::fmt::Display) -> LockError {
    LockError::Backend {
        backend: "issued-tokens-store",
        detail: format!("{}: {e}", path.display()),
    }
}

impl Drop for IssuedTokens {
    fn drop(&mut self) {
        // Wakes the flusher so it sees the store is gone and ends.
        self.flush_wanted.notify_one();
    }
}

async fn flusher(me: std::sync::Weak<IssuedTokens>, wanted: Arc<Notify>) {
    loop {
        let Some(this) = me.upgrade() else { return };
        let (batch, version) = {
            let mut state = this.state.lock().expect("issued tokens");
            (std::mem::take(&mut state.pending), state.version)
        };
        if version > *this.persisted_version.borrow() {
            let log = this.log.clone();
            let lines = batch.clone();
            let written = tokio::task::spawn_blocking(move || append(&log, &lines)).await;
            let written = match written {
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(panicked) => Err(panicked.to_string()),
            };
            match written {
                Ok(()) => {
                    this.persisted_version.send_replace(version);
                }
                Err(error) => {
                    tracing::error!(path = %this.path.display(), %error, "issued-token record not written");
                    // Put the batch back in front of anything newer and try again after a pause.
                    {
                        let mut state = this.state.lock().expect("issued tokens");
                        let newer = std::mem::take(&mut state.pending);
                        state.pending = batch;
                        state.pending.extend(newer);
                    }
                    drop(this);
                    tokio::time::sleep(Duration::from_millis(FLUSH_RETRY_MS)).await;
                    continue;
                }
            }
            continue;
        }
        // Hold only a weak reference while idle, so the store can be dropped.
        drop(this);
        wanted.notified().await;
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Line {
    k: String,
    t: u64,
}

/// Appends the batch and makes it durable with one `fdatasync`.
fn append(log: &Mutex<std::fs::File>, batch: &[(String, u64)]) -> std::io::Result<()> {
    let mut bytes = Vec::new();
    for (k, t) in batch {
        serde_json::to_writer(
            &mut bytes,
            &Line {
                k: k.clone(),
                t: *t,
            },
        )
        .map_err(std::io::Error::other)?;
        bytes.push(b'\n');
    }
    let mut file = log.lock().expect("issued-token log");
    file.write_all(&bytes)?;
    file.sync_data()
}

/// Reads the log: the highest token per key. A last line cut short by a crash was never
/// acknowledged (its fsync did not return), so it is ignored; a bad line elsewhere is corruption.
fn parse(bytes: &[u8]) -> Result<BTreeMap<String, u64>, String> {
    let mut tokens = BTreeMap::new();
    let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Line>(line) {
            Ok(Line { k, t }) => {
                let entry = tokens.entry(k).or_insert(0);
                *entry = (*entry).max(t);
            }
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => return Err(format!("line {}: {e}", i + 1)),
        }
    }
    Ok(tokens)
}

fn write_atomically(path: &Path, tokens: &BTreeMap<String, u64>) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut file = std::fs::File::create(&tmp)?;
        let mut bytes = Vec::new();
        for (k, t) in tokens {
            serde_json::to_writer(
                &mut bytes,
                &Line {
                    k: k.clone(),
                    t: *t,
                },
            )
            .map_err(std::io::Error::other)?;
            bytes.push(b'\n');
        }
        file.write_all(&bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn regression_is_refused_and_the_record_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("issued.json");
        {
            let store = IssuedTokens::open(&path).unwrap();
            store.admit("k", 10, true).await.unwrap();
            store.admit("k", 10, false).await.unwrap();
            assert!(matches!(
                store.admit("k", 10, true).await,
                Err(AdmitError::Regression(_))
            ));
        }
        let reopened = IssuedTokens::open(&path).unwrap();
        assert_eq!(reopened.highest("k"), Some(10));
        match reopened.admit("k", 7, true).await {
            Err(AdmitError::Regression(r)) => assert_eq!(r.highest_issued_token, 10),
            other => panic!("expected a regression, got {other:?}"),
        }
        assert!(matches!(
            reopened.admit("k", 9, false).await,
            Err(AdmitError::Regression(_))
        ));
        reopened.admit("k", 11, true).await.unwrap();
        reopened.admit("other", 1, true).await.unwrap();
    }

    #[tokio::test]
    async fn a_torn_last_line_is_ignored_and_corruption_elsewhere_refuses_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("issued.log");
        {
            let store = IssuedTokens::open(&path).unwrap();
            store.admit("a", 5, true).await.unwrap();
            store.admit("a", 8, true).await.unwrap();
            store.admit("b", 3, true).await.unwrap();
        }
        // A crash in the middle of an append: the unacknowledged tail is cut short.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(b"{\"k\":\"a\",\"t\":9");
        std::fs::write(&path, &bytes).unwrap();
        let reopened = IssuedTokens::open(&path).unwrap();
        assert_eq!(reopened.highest("a"), Some(8));
        assert_eq!(reopened.highest("b"), Some(3));
        drop(reopened);
        // Damage before the last line is not a crash artefact: refuse to start rather than forget.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("garbage\n{text}")).unwrap();
        assert!(IssuedTokens::open(&path).is_err());
    }
}
