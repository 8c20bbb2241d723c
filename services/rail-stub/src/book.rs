//! The movement book: every payment the rail ever made. The ground truth of "did we pay twice".
//!
//! Durable when a file is configured: one JSON object per line, appended and fsynced before the
//! rail answers, so an accepted payment survives the stub's restart whatever the caller saw.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One settled movement of money.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Movement {
    /// Position in the book, from 1; never reused, also across restarts.
    pub sequence: u64,
    pub rail_ref: String,
    pub client_reference: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
    pub accepted_at_unix_ms: i64,
}

/// A payment request on the wire: the order, and the instant after which the rail must refuse
/// it (absent: valid forever, like a rail without expiry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRequest {
    #[serde(flatten)]
    pub order: PaymentOrder,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub valid_until_unix_ms: Option<i64>,
}

/// The decline code of a payment request that reached the rail after its `valid_until`.
pub const EXPIRED_DECLINE_CODE: &str = "EXPIRED";

/// What a payment request carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentOrder {
    pub client_reference: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
}

#[derive(Debug, thiserror::Error)]
pub enum BookError {
    #[error("movements file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("movements file {path}, line {line}: not a movement: {source}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
}

/// The answer of a lookup by client reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Found(Vec<Movement>),
    /// Nothing settled, and the settlement window since the last attempt has passed.
    Absent,
    /// Nothing settled yet, but a movement could still be settling.
    Unknown,
}

#[derive(Default)]
struct Inner {
    movements: Vec<Movement>,
    by_reference: HashMap<String, Vec<usize>>,
    /// When the last payment request for a reference started or ended.
    last_activity: HashMap<String, Instant>,
    /// Payment requests being processed, per reference.
    in_flight: HashMap<String, u32>,
    /// Every payment request ever received in this process's life, per reference.
    submit_requests: BTreeMap<String, u64>,
    /// Payment requests refused because they arrived after their `valid_until`, per reference.
    expired_requests: BTreeMap<String, u64>,
    file: Option<(PathBuf, File)>,
}

pub struct Book {
    inner: Mutex<Inner>,
    settlement_window: Duration,
    /// A restart forgets in-flight attempts; the window is counted from the start as well.
    started_at: Instant,
}

/// A snapshot for `GET /admin/movements`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroundTruth {
    pub movements: Vec<Movement>,
    /// Movements per client reference: a value above one is a duplicate payment.
    pub movement_counts: BTreeMap<String, u64>,
    /// Payment requests received per client reference since the stub started: a value above one
    /// means somebody sent the same reference twice (a retry or a duplicate).
    pub submit_request_counts: BTreeMap<String, u64>,
    pub submit_requests_total: u64,
    /// Payment requests refused (`EXPIRED`, nothing moved) because they reached the rail after
    /// their `valid_until`, per client reference.
    #[serde(default)]
    pub expired_request_counts: BTreeMap<String, u64>,
}

pub fn unix_ms_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Book {
    /// Opens (or creates) the book. Without a path it is memory-only (benchmarks).
    pub fn open(path: Option<&Path>, settlement_window: Duration) -> Result<Self, BookError> {
        let mut inner = Inner::default();
        if let Some(path) = path {
            let io = |source| BookError::Io {
                path: path.to_path_buf(),
                source,
            };
            let mut file = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .open(path)
                .map_err(io)?;
            let mut reader = BufReader::new(&file);
            let mut line = String::new();
            let mut complete_bytes: u64 = 0;
            let mut number = 0;
            loop {
                line.clear();
                let read = reader.read_line(&mut line).map_err(io)?;
                if read == 0 {
                    break;
                }
                number += 1;
                if !line.ends_with('\n') {
                    // A torn last write: the process died before the fsync returned, so the
                    // rail never answered for it. It is cut off so appends start on a clean line.
                    tracing::warn!(
                        line = number,
                        "dropping a torn last line of the movements file"
                    );
                    break;
                }
                let movement: Movement =
                    serde_json::from_str(line.trim_end()).map_err(|source| BookError::Corrupt {
                        path: path.to_path_buf(),
                        line: number,
                        source,
                    })?;
                complete_bytes += read as u64;
                inner.push(movement);
            }
            drop(reader);
            file.set_len(complete_bytes).map_err(io)?;
            file.seek(SeekFrom::End(0)).map_err(io)?;
            inner.file = Some((path.to_path_buf(), file));
        }
        Ok(Self {
            inner: Mutex::new(inner),
            settlement_window,
            started_at: Instant::now(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock is a bug; the book's data is still consistent because
        // every mutation is a push after a successful write.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records that a payment request for `reference` arrived; the returned guard marks its end.
    pub fn begin_attempt<'a>(&'a self, reference: &str) -> AttemptGuard<'a> {
        let mut inner = self.lock();
        *inner
            .submit_requests
            .entry(reference.to_string())
            .or_default() += 1;
        *inner.in_flight.entry(reference.to_string()).or_default() += 1;
        inner
            .last_activity
            .insert(reference.to_string(), Instant::now());
        AttemptGuard {
            book: self,
            reference: reference.to_string(),
        }
    }

    /// Settles a movement: durable (written and fsynced) before this returns. Blocking I/O.
    pub fn settle(&self, order: &PaymentOrder) -> Result<Movement, BookError> {
        let mut inner = self.lock();
        let sequence = inner.movements.len() as u64 + 1;
        let movement = Movement {
            sequence,
            rail_ref: format!("rr-{sequence:08}"),
            client_reference: order.client_reference.clone(),
            amount_minor: order.amount_minor,
            currency: order.currency.clone(),
            beneficiary_ref: order.beneficiary_ref.clone(),
            accepted_at_unix_ms: unix_ms_now(),
        };
        if let Some((path, file)) = inner.file.as_mut() {
            let io = |source| BookError::Io {
                path: path.clone(),
                source,
            };
            let mut line = serde_json::to_vec(&movement).expect("a movement serialises");
            line.push(b'\n');
            file.write_all(&line).map_err(io)?;
            file.sync_data().map_err(io)?;
        }
        inner.push(movement.clone());
        Ok(movement)
    }

    /// Records a payment request refused as expired (no movement).
    pub fn record_expired(&self, reference: &str) {
        *self
            .lock()
            .expired_requests
            .entry(reference.to_string())
            .or_default() += 1;
    }

    pub fn lookup(&self, reference: &str) -> Lookup {
        let inner = self.lock();
        if let Some(indexes) = inner.by_reference.get(reference) {
            return Lookup::Found(
                indexes
                    .iter()
                    .map(|i| inner.movements[*i].clone())
                    .collect(),
            );
        }
        if inner.in_flight.get(reference).copied().unwrap_or(0) > 0 {
            return Lookup::Unknown;
        }
        let last = inner
            .last_activity
            .get(reference)
            .copied()
            .unwrap_or(self.started_at)
            .max(self.started_at);
        if last.elapsed() < self.settlement_window {
            return Lookup::Unknown;
        }
        Lookup::Absent
    }

    pub fn ground_truth(&self) -> GroundTruth {
        let inner = self.lock();
        let movement_counts = inner
            .by_reference
            .iter()
            .map(|(k, v)| (k.clone(), v.len() as u64))
            .collect();
        GroundTruth {
            movements: inner.movements.clone(),
            movement_counts,
            submit_request_counts: inner.submit_requests.clone(),
            submit_requests_total: inner.submit_requests.values().sum(),
            expired_request_counts: inner.expired_requests.clone(),
        }
    }
}

impl Inner {
    fn push(&mut self, movement: Movement) {
        let index = self.movements.len();
        self.by_reference
            .entry(movement.client_reference.clone())
            .or_default()
            .push(index);
        self.movements.push(movement);
    }
}

/// Marks the end of a payment request (also when its task is cancelled).
pub struct AttemptGuard<'a> {
    book: &'a Book,
    reference: String,
}

impl Drop for AttemptGuard<'_> {
    fn drop(&mut self) {
        let mut inner = self.book.lock();
        if let Some(count) = inner.in_flight.get_mut(&self.reference) {
            *count = count.saturating_sub(1);
        }
        inner
            .last_activity
            .insert(self.reference.clone(), Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(reference: &str) -> PaymentOrder {
        PaymentOrder {
            client_reference: reference.into(),
            amount_minor: 100,
            currency: "EUR".into(),
            beneficiary_ref: "ben-1".into(),
        }
    }

    #[test]
    fn movements_survive_reopen_and_a_torn_line_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("movements.jsonl");
        {
            let book = Book::open(Some(&path), Duration::ZERO).unwrap();
            book.settle(&order("cref-a")).unwrap();
            book.settle(&order("cref-a")).unwrap();
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"sequence\":3,")
            .unwrap();
        let book = Book::open(Some(&path), Duration::ZERO).unwrap();
        let truth = book.ground_truth();
        assert_eq!(truth.movements.len(), 2);
        assert_eq!(truth.movement_counts["cref-a"], 2);
        let third = book.settle(&order("cref-b")).unwrap();
        assert_eq!(third.sequence, 3);
        assert_eq!(third.rail_ref, "rr-00000003");
        drop(book);
        assert_eq!(
            Book::open(Some(&path), Duration::ZERO)
                .unwrap()
                .ground_truth()
                .movements
                .len(),
            3
        );
    }

    #[test]
    fn lookup_is_unknown_inside_the_window_and_authoritative_after() {
        let book = Book::open(None, Duration::from_millis(50)).unwrap();
        assert_eq!(
            book.lookup("cref-x"),
            Lookup::Unknown,
            "window counted from start"
        );
        let guard = book.begin_attempt("cref-x");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(book.lookup("cref-x"), Lookup::Unknown, "in flight");
        drop(guard);
        assert_eq!(
            book.lookup("cref-x"),
            Lookup::Unknown,
            "window counted from the end of the attempt"
        );
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(book.lookup("cref-x"), Lookup::Absent);
        book.settle(&order("cref-x")).unwrap();
        assert!(matches!(book.lookup("cref-x"), Lookup::Found(m) if m.len() == 1));
    }
}
