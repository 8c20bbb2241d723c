//! A recorded lock history: what this client BELIEVED about its grants, on the machine's
//! monotonic clock. It is the evidence of INV-06's detective control (spec 2.5: "linearizability
//! check over recorded lock history"): a checker outside the code under test turns the records
//! into intervals and asserts that no two grants of one key were believed held at once.
//!
//! One JSON object per line, appended with one `write` each (a line is never split between
//! writers; each process writes its own file anyway). Times are `CLOCK_MONOTONIC` nanoseconds,
//! which every process on one machine shares, so records of different processes compare.
//!
//! What is recorded, and why each bounds the belief from the safe side:
//! - `grant`: the moment the grant's answer arrived (the earliest the client could rely on it),
//!   and `requested_ns`, the moment its Acquire (or, for a handle re-established in another
//!   process, its Renew) was sent: the lock service granted it between the two, the interval a
//!   linearizability check places the grant in (absent from lines written before it existed);
//! - `deadline`: every new local deadline of a session (the latest it could rely on any grant of
//!   that session, since a grant is only trusted while its session's deadline has not passed);
//! - `lost`: the moment the session was found lost (deadline passed, server said gone, closed);
//! - `release`: the moment a release request was SENT (the client stopped relying on it then);
//! - `released`: the moment the lock service's answer that it freed the key arrived (a release
//!   with no `released` after it may have freed the key or not: refused, or its answer lost);
//! - `grant_deadline`: every new deadline of one grant, from a Renew the server answered "still
//!   the holder" (sent at some instant: the grant is relied on until that instant + TTL - margin
//!   at most), the first from the acquire's own send time. A key can be taken from a live session
//!   (an operator's force-revoke), so a grant is trusted only while BOTH its session's and its
//!   own deadline are ahead;
//! - `grant_lost`: the moment the server answered that the handle no longer holds its key;
//! - `revoke`: a force-revoke this client made (the key and the token it took, when it was sent
//!   and when the service answered that it had revoked it): what pairs a break-glass successor
//!   with the grant it deposed.
//!
//! Recording never decides anything: a write error is logged once and recording stops, the grant
//! logic is unchanged.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HistoryEvent {
    Grant {
        key: String,
        owner: String,
        token: u64,
        session: String,
        at_ns: u64,
        /// When the request that was answered with this grant was sent; `None` only in lines
        /// written before it was recorded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        requested_ns: Option<u64>,
    },
    Deadline {
        session: String,
        deadline_ns: u64,
    },
    Lost {
        session: String,
        at_ns: u64,
    },
    Release {
        key: String,
        owner: String,
        token: u64,
        at_ns: u64,
    },
    /// The lock service answered a release of this grant: it freed the key.
    Released {
        key: String,
        owner: String,
        token: u64,
        at_ns: u64,
    },
    GrantDeadline {
        key: String,
        owner: String,
        token: u64,
        deadline_ns: u64,
    },
    GrantLost {
        key: String,
        owner: String,
        token: u64,
        at_ns: u64,
    },
    /// This client force-revoked `key` from the grant of `token` (break-glass: an operator, or
    /// the resolver's takeover of a grant whose workflow is gone): sent at `sent_ns`, answered
    /// (revoked) at `answered_ns`. From the send on, a successor is break-glass, not two holders.
    Revoke {
        key: String,
        token: u64,
        sent_ns: u64,
        answered_ns: u64,
    },
}

/// Appends [`HistoryEvent`]s to a file.
pub struct HistoryRecorder {
    file: Mutex<std::fs::File>,
    failed: AtomicBool,
}

impl HistoryRecorder {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self {
            file: Mutex::new(file),
            failed: AtomicBool::new(false),
        })
    }

    pub fn record(&self, event: &HistoryEvent) {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        let mut line = serde_json::to_vec(event).expect("history events serialize");
        line.push(b'\n');
        let result = self.file.lock().expect("history file").write_all(&line);
        if let Err(e) = result {
            self.failed.store(true, Ordering::Relaxed);
            tracing::error!(error = %e, "lock history: write failed; recording stops");
        }
    }
}

/// `at` on `CLOCK_MONOTONIC` in nanoseconds: the clock `Instant` reads on Linux, but as a number
/// that other processes can compare.
pub fn monotonic_ns(at: Instant) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "CLOCK_MONOTONIC is always available on Linux");
    let now = Instant::now();
    let now_ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    if at >= now {
        now_ns + (at - now).as_nanos() as u64
    } else {
        now_ns.saturating_sub((now - at).as_nanos() as u64)
    }
}

/// Parses a history file; a torn last line (the writer was killed mid-write) is skipped, any
/// other malformed line is an error (the evidence would be incomplete).
pub fn read(path: &Path) -> std::io::Result<Vec<HistoryEvent>> {
    let text = std::fs::read_to_string(path)?;
    let lines: Vec<&str> = text.lines().collect();
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str(line) {
            Ok(e) => events.push(e),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}:{}: {e}", path.display(), i + 1),
                ))
            }
        }
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn monotonic_ns_orders_like_instant_and_matches_its_spacing() {
        let a = Instant::now();
        let b = a + Duration::from_millis(250);
        let (na, nb) = (monotonic_ns(a), monotonic_ns(b));
        let spacing = nb - na;
        assert!(
            (249_000_000..=251_000_000).contains(&spacing),
            "spacing {spacing} ns"
        );
    }

    /// A grant line written before `requested_ns` existed still reads; a new one carries it.
    #[test]
    fn a_grant_line_reads_with_or_without_its_request_time() {
        let old = r#"{"kind":"grant","key":"k","owner":"o","token":5,"session":"s","at_ns":9}"#;
        let HistoryEvent::Grant { requested_ns, .. } = serde_json::from_str(old).unwrap() else {
            panic!("a grant line reads as a grant");
        };
        assert_eq!(requested_ns, None);
        let new = HistoryEvent::Grant {
            key: "k".into(),
            owner: "o".into(),
            token: 5,
            session: "s".into(),
            at_ns: 9,
            requested_ns: Some(7),
        };
        let line = serde_json::to_string(&new).unwrap();
        assert!(line.contains(r#""requested_ns":7"#), "{line}");
        assert_eq!(serde_json::from_str::<HistoryEvent>(&line).unwrap(), new);
    }

    #[test]
    fn a_torn_last_line_is_skipped_other_garbage_is_refused() {
        let dir = std::env::temp_dir().join(format!("lock-history-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("h.jsonl");
        let _ = std::fs::remove_file(&path);
        let r = HistoryRecorder::open(&path).unwrap();
        let e = HistoryEvent::Lost {
            session: "s".into(),
            at_ns: 7,
        };
        r.record(&e);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"kind\":\"gra").unwrap();
        assert_eq!(read(&path).unwrap(), vec![e.clone()]);
        f.write_all(b"\n").unwrap();
        r.record(&e);
        assert!(read(&path).is_err(), "a malformed line inside the file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
