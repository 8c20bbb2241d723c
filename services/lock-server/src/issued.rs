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
//!
//! Bounded: each line carries `at`, when its key's token was last raised, and a key not raised for
//! the retention (by default the grant records' week) is pruned into one `{"floor": T}`, the highest
//! token of every pruned key. Sound because both backends draw every key's token from one counter
//! (etcd's revision; lockdb's `lock_token_seq`): a genuinely new grant of ANY key is above every
//! token issued before it, so a minted token at or below the floor, for a key with no entry, is a
//! rewound backend and is refused like any other regression. Pruning runs at start, hourly, and at
//! once when the record holds more than its bound of keys (oldest first), rewriting the file
//! atomically from the flusher, so neither the file nor the memory grows with key churn.

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
/// How long a key's entry is kept after its token was last raised: the grant records' retention
/// (`backend::etcd::GRANT_RETENTION_MS_DEFAULT`), the horizon of the evidence about it anyway.
pub const RETENTION_MS_DEFAULT: u64 = crate::backend::etcd::GRANT_RETENTION_MS_DEFAULT;
/// A shorter retention would prune keys whose grants are still commonly held.
pub const RETENTION_MS_MIN: u64 = 60_000;
/// Most keys kept in memory and in the file: past it the oldest are pruned into the floor at
/// once (down to nine tenths of it), whatever their age. About 100 MB of memory at the bound.
pub const ISSUED_KEYS_MAX: usize = 1_000_000;
/// How often the record is pruned and rewritten while the server runs.
pub const PRUNE_EVERY_MS: u64 = 3_600_000;

/// How long entries are kept and how many at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub retention_ms: u64,
    pub keys_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            retention_ms: RETENTION_MS_DEFAULT,
            keys_max: ISSUED_KEYS_MAX,
        }
    }
}

/// One key's highest issued token and when it was raised (unix ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    t: u64,
    at: i64,
}

fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Regression {
    pub highest_issued_token: u64,
}

struct State {
    tokens: BTreeMap<String, Entry>,
    /// The highest token of every pruned key: a minted token for a key with no entry must be above.
    floor: u64,
    /// Raised tokens not yet on disk, in order.
    pending: Vec<Line>,
    version: u64,
    /// More keys than the bound: the flusher prunes and rewrites the record at once.
    prune_wanted: bool,
}

impl State {
    /// Moves every key last raised before `now - retention` into the floor, then, while more keys
    /// than the bound remain, the oldest ones (down to nine tenths of the bound).
    fn prune(&mut self, now: i64, limits: Limits) {
        let cutoff = now.saturating_sub(i64::try_from(limits.retention_ms).unwrap_or(i64::MAX));
        let mut floor = self.floor;
        self.tokens.retain(|_, e| {
            let keep = e.at >= cutoff;
            if !keep {
                floor = floor.max(e.t);
            }
            keep
        });
        if self.tokens.len() > limits.keys_max {
            let keep = limits.keys_max - limits.keys_max / 10;
            let mut ages: Vec<(i64, u64)> = self.tokens.values().map(|e| (e.at, e.t)).collect();
            let excess = ages.len() - keep;
            // The `excess`-th oldest (time, then token): everything up to it goes.
            let (_, &mut threshold, _) = ages.select_nth_unstable(excess - 1);
            self.tokens.retain(|_, e| {
                let keep = (e.at, e.t) > threshold;
                if !keep {
                    floor = floor.max(e.t);
                }
                keep
            });
        }
        self.floor = floor;
        self.prune_wanted = false;
    }
}

pub struct IssuedTokens {
    path: PathBuf,
    limits: Limits,
    /// The log, opened for appending after the last compaction.
    log: Arc<Mutex<std::fs::File>>,
    state: Mutex<State>,
    flush_wanted: Arc<Notify>,
    persisted_version: watch::Sender<u64>,
}

impl IssuedTokens {
    /// [`IssuedTokens::open_with`] with the default [`Limits`].
    pub fn open(path: impl Into<PathBuf>) -> Result<Arc<Self>, LockError> {
        Self::open_with(path, Limits::default())
    }

    /// Loads the file if it exists (a missing file is an empty record: a new server), prunes it,
    /// rewrites it compacted, and starts the flusher on the current runtime. A line written before
    /// lines carried `at` counts as raised now (kept one more retention).
    pub fn open_with(path: impl Into<PathBuf>, limits: Limits) -> Result<Arc<Self>, LockError> {
        let path = path.into();
        if limits.retention_ms < RETENTION_MS_MIN || limits.keys_max < 10 {
            return Err(LockError::invalid(
                "issued_tokens_retention_ms",
                format!("at least {RETENTION_MS_MIN} ms and ten keys"),
            ));
        }
        let now = now_unix_ms();
        let (tokens, floor) = match std::fs::read(&path) {
            Ok(bytes) => parse(&bytes, now).map_err(|e| store_err(&path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (BTreeMap::new(), 0),
            Err(e) => return Err(store_err(&path, e)),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| store_err(&path, e))?;
        }
        let mut state = State {
            tokens,
            floor,
            pending: Vec::new(),
            version: 0,
            prune_wanted: false,
        };
        state.prune(now, limits);
        // Compact: one line per key, written atomically, then appended to from here on.
        let log = compact(&path, &state.tokens, state.floor).map_err(|e| store_err(&path, e))?;
        let (persisted_version, _) = watch::channel(0);
        let me = Arc::new(Self {
            path,
            limits,
            log: Arc::new(Mutex::new(log)),
            state: Mutex::new(state),
            flush_wanted: Arc::new(Notify::new()),
            persisted_version,
        });
        tokio::spawn(flusher(Arc::downgrade(&me), me.flush_wanted.clone()));
        Ok(me)
    }

    /// Keys with an entry (the rest are under the floor).
    pub fn len(&self) -> usize {
        self.state.lock().expect("issued tokens").tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The highest token of every pruned key.
    pub fn floor(&self) -> u64 {
        self.state.lock().expect("issued tokens").floor
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
            .map(|e| e.t)
    }

    /// Checks a token the backend returned and records it durably before the grant is returned.
    /// `minted`: the backend created the entry now (must be strictly above everything issued
    /// before), or returned an existing grant (must not be below). A key with no entry (new, or
    /// pruned) is checked against the floor when minted; an existing grant of a pruned key cannot
    /// be told from a genuine one and is admitted.
    pub async fn admit(&self, key: &str, token: u64, minted: bool) -> Result<(), AdmitError> {
        let wait_for = {
            let mut state = self.state.lock().expect("issued tokens");
            let entry = state.tokens.get(key).copied();
            let regressed = match entry {
                Some(e) if minted => token <= e.t,
                Some(e) => token < e.t,
                None => minted && token <= state.floor,
            };
            if regressed {
                return Err(AdmitError::Regression(Regression {
                    highest_issued_token: entry.map_or(state.floor, |e| e.t),
                }));
            }
            if token > entry.map_or(0, |e| e.t) {
                let at = now_unix_ms();
                state.tokens.insert(key.to_string(), Entry { t: token, at });
                state.pending.push(Line::Key {
                    k: key.to_string(),
                    t: token,
                    at: Some(at),
                });
                state.version += 1;
                if state.tokens.len() > self.limits.keys_max {
                    state.prune_wanted = true;
                }
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
    let prune_every = Duration::from_millis(PRUNE_EVERY_MS);
    let mut last_prune = tokio::time::Instant::now();
    loop {
        let Some(this) = me.upgrade() else { return };
        let prune_due = this.state.lock().expect("issued tokens").prune_wanted
            || last_prune.elapsed() >= prune_every;
        if prune_due {
            last_prune = tokio::time::Instant::now();
            if let Err(error) = this.prune_and_compact().await {
                tracing::error!(path = %this.path.display(), %error, "issued-token record not compacted; appending as before");
                this.state.lock().expect("issued tokens").prune_wanted = false;
            }
            continue;
        }
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
        let until_prune = prune_every.saturating_sub(last_prune.elapsed());
        let _ = tokio::time::timeout(until_prune, wanted.notified()).await;
    }
}

impl IssuedTokens {
    /// Prunes in memory, then rewrites the file from that state (atomically, by rename) and
    /// appends to the new file from then on. Everything raised before the snapshot is in it, so it
    /// counts as persisted once the rename is durable; what was raised meanwhile stays pending.
    async fn prune_and_compact(&self) -> Result<(), String> {
        let (tokens, floor, taken, version) = {
            let mut state = self.state.lock().expect("issued tokens");
            state.prune(now_unix_ms(), self.limits);
            (
                state.tokens.clone(),
                state.floor,
                state.pending.len(),
                state.version,
            )
        };
        let path = self.path.clone();
        let log = self.log.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            // Holding the log's lock: no append lands in the old file after the snapshot.
            let mut file = log.lock().expect("issued-token log");
            *file = compact(&path, &tokens, floor)?;
            Ok(())
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
        self.state
            .lock()
            .expect("issued tokens")
            .pending
            .drain(..taken);
        self.persisted_version.send_if_modified(|v| {
            let raised = version > *v;
            *v = (*v).max(version);
            raised
        });
        tracing::info!(path = %self.path.display(), keys = self.len(), floor, "issued-token record pruned and compacted");
        Ok(())
    }
}

/// One line of the file: a key's raised token (with when; absent in files written before), or the
/// floor.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Line {
    Key {
        k: String,
        t: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<i64>,
    },
    Floor {
        floor: u64,
    },
}

fn write_lines<'a>(lines: impl IntoIterator<Item = &'a Line>) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    for line in lines {
        serde_json::to_writer(&mut bytes, line).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
    }
    Ok(bytes)
}

/// Appends the batch and makes it durable with one `fdatasync`.
fn append(log: &Mutex<std::fs::File>, batch: &[Line]) -> std::io::Result<()> {
    let bytes = write_lines(batch)?;
    let mut file = log.lock().expect("issued-token log");
    file.write_all(&bytes)?;
    file.sync_data()
}

/// Reads the log: the highest token per key with when it was raised (`now` for a line without),
/// and the floor. A last line cut short by a crash was never acknowledged (its fsync did not
/// return), so it is ignored; a bad line elsewhere is corruption.
fn parse(bytes: &[u8], now: i64) -> Result<(BTreeMap<String, Entry>, u64), String> {
    let mut tokens: BTreeMap<String, Entry> = BTreeMap::new();
    let mut floor = 0;
    let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Line>(line) {
            Ok(Line::Key { k, t, at }) => {
                let at = at.unwrap_or(now);
                let entry = tokens.entry(k).or_insert(Entry { t, at });
                if t >= entry.t {
                    *entry = Entry {
                        t,
                        at: at.max(entry.at),
                    };
                }
            }
            Ok(Line::Floor { floor: f }) => floor = floor.max(f),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => return Err(format!("line {}: {e}", i + 1)),
        }
    }
    Ok((tokens, floor))
}

/// Writes the whole record to a new file, makes it durable, renames it over `path`, and returns
/// it opened for appending.
fn compact(
    path: &Path,
    tokens: &BTreeMap<String, Entry>,
    floor: u64,
) -> std::io::Result<std::fs::File> {
    let tmp = path.with_extension("tmp");
    {
        let mut file = std::fs::File::create(&tmp)?;
        let floor_line = Line::Floor { floor };
        let lines: Vec<Line> = tokens
            .iter()
            .map(|(k, e)| Line::Key {
                k: k.clone(),
                t: e.t,
                at: Some(e.at),
            })
            .collect();
        let bytes = write_lines(std::iter::once(&floor_line).chain(lines.iter()))?;
        file.write_all(&bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    std::fs::OpenOptions::new().append(true).open(path)
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

    /// Keys last raised a retention ago are pruned at open into the floor: the file and the map
    /// keep only live keys, and a minted token at or below the floor, for a pruned key or a key
    /// never seen, is still a regression.
    #[tokio::test]
    async fn keys_older_than_the_retention_fall_under_the_floor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("issued.json");
        let now = now_unix_ms();
        std::fs::write(
            &path,
            format!(
                "{{\"k\":\"payout:a\",\"t\":10,\"at\":1}}\n{{\"k\":\"payout:b\",\"t\":20,\"at\":2}}\n{{\"k\":\"payout:c\",\"t\":30,\"at\":{now}}}\n{{\"k\":\"payout:old-format\",\"t\":25}}\n"
            ),
        )
        .unwrap();
        let store = IssuedTokens::open(&path).unwrap();
        assert_eq!((store.len(), store.floor()), (2, 20));
        assert_eq!(store.highest("payout:a"), None);
        assert_eq!(store.highest("payout:old-format"), Some(25));
        for (key, token) in [("payout:a", 15), ("payout:b", 20), ("payout:never-seen", 3)] {
            match store.admit(key, token, true).await {
                Err(AdmitError::Regression(r)) => assert_eq!(r.highest_issued_token, 20),
                other => panic!("{key} {token}: expected a regression, got {other:?}"),
            }
        }
        // A token above the floor is a genuine new grant of a pruned key.
        store.admit("payout:a", 31, true).await.unwrap();
        drop(store);
        let reopened = IssuedTokens::open(&path).unwrap();
        assert_eq!(
            (reopened.floor(), reopened.highest("payout:a")),
            (20, Some(31))
        );
        assert!(matches!(
            reopened.admit("payout:never-seen", 20, true).await,
            Err(AdmitError::Regression(_))
        ));
    }

    /// Mints `payout:k1..=keys` with tokens 1..=keys, a hundred at a time (sharing flushes).
    async fn churn(store: &Arc<IssuedTokens>, keys: u64) {
        for chunk in (1..=keys).collect::<Vec<_>>().chunks(100) {
            let mut admits = tokio::task::JoinSet::new();
            for &i in chunk {
                let store = Arc::clone(store);
                admits.spawn(async move { store.admit(&format!("payout:k{i}"), i, true).await });
            }
            while let Some(result) = admits.join_next().await {
                result.unwrap().unwrap();
            }
        }
    }

    /// Row 4f of issue 34: key churn cannot grow the record without bound. Past its bound the
    /// oldest keys are pruned into the floor at once; a rewound token for one of them is still
    /// refused, a genuine one admitted, and the bound and the floor survive a restart. Control:
    /// with a bound above the churn, every key stays (what the record did for any churn before).
    #[tokio::test]
    async fn key_churn_is_bounded_and_pruned_keys_stay_guarded() {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits {
            retention_ms: RETENTION_MS_DEFAULT,
            keys_max: 1_000,
        };
        let path = dir.path().join("bounded.json");
        let store = IssuedTokens::open_with(&path, limits).unwrap();
        churn(&store, 1_500).await;
        // The flusher prunes as soon as it sees the bound passed: wait for that event.
        let mut pruned = store.persisted_version.subscribe();
        tokio::time::timeout(Duration::from_secs(60), async {
            while store.len() > limits.keys_max {
                store.flush_wanted.notify_one();
                let _ = tokio::time::timeout(Duration::from_millis(100), pruned.changed()).await;
            }
        })
        .await
        .expect("the record pruned to its bound");
        assert!(store.len() <= limits.keys_max, "{}", store.len());
        let floor = store.floor();
        assert!(
            floor >= 500,
            "the oldest keys went under the floor: {floor}"
        );
        assert_eq!(store.highest("payout:k1"), None);
        assert!(matches!(
            store.admit("payout:k1", 1, true).await,
            Err(AdmitError::Regression(Regression { highest_issued_token })) if highest_issued_token == floor
        ));
        store.admit("payout:k1", 1_501, true).await.unwrap();
        drop(store);
        let reopened = IssuedTokens::open_with(&path, limits).unwrap();
        assert!(reopened.len() <= limits.keys_max);
        assert_eq!(reopened.floor(), floor);
        assert_eq!(reopened.highest("payout:k1"), Some(1_501));

        // Control: a bound above the churn keeps every key.
        let unbounded = IssuedTokens::open(dir.path().join("unbounded.json")).unwrap();
        churn(&unbounded, 1_500).await;
        assert_eq!((unbounded.len(), unbounded.floor()), (1_500, 0));
    }
}
