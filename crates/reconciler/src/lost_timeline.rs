//! A paydb restore's aftermath, as `gl_matches_paydb` reads it (paydb 0014, issue 35 item 9).
//!
//! A restore of paydb loses the writes made after its backup, but the General Ledger keeps what
//! the outbox had delivered of them: lifecycle events and postings of a timeline paydb no longer
//! holds. The re-arming (`payoutctl restore rearm --database paydb`) records each such GL record
//! in `restore_lost_timeline` and lifts the payouts' versions past them, so the re-run writes new
//! event versions and its posting is carried by the GL's journal. Those GL records then have no
//! outbox row in paydb for ever; they are a restore's explained aftermath, not a divergence:
//! [`LostTimeline`] tells them apart and names them in the check's note. A GL record without an
//! outbox row that the table does not name is still a violation.

use std::collections::{BTreeSet, HashSet};

use sqlx::{PgConnection, Row};

/// The GL records paydb's re-armings recorded as a lost timeline, and how many of them a check
/// found in the GL without an outbox row.
#[derive(Debug, Default)]
pub struct LostTimeline {
    /// Journals by idempotency key.
    journals: HashSet<String>,
    /// Events by (payout, event version).
    events: HashSet<(String, i64)>,
    /// What the check met: GL events and journals explained, and their payouts.
    events_explained: u64,
    journals_explained: u64,
    payouts: BTreeSet<String>,
}

impl LostTimeline {
    /// Reads `restore_lost_timeline` in the run's paydb snapshot.
    pub async fn read(paydb: &mut PgConnection) -> Result<Self, sqlx::Error> {
        let mut lost = Self::default();
        for r in sqlx::query(
            "SELECT payout_id, kind, idempotency_key, event_version FROM restore_lost_timeline",
        )
        .fetch_all(&mut *paydb)
        .await?
        {
            let kind: String = r.get("kind");
            if kind == "TRANSACTION_EVENT" {
                let version: Option<i64> = r.get("event_version");
                if let Some(version) = version {
                    lost.events.insert((r.get("payout_id"), version));
                }
            } else {
                lost.journals.insert(r.get("idempotency_key"));
            }
        }
        Ok(lost)
    }

    /// Whether the GL journal `key` is a lost timeline's; counted.
    pub fn explains_journal(&mut self, key: &str) -> bool {
        let explained = self.journals.contains(key);
        if explained {
            self.journals_explained += 1;
        }
        explained
    }

    /// Whether the GL event (payout, version) is a lost timeline's; counted.
    pub fn explains_event(&mut self, payout: &str, version: i64) -> bool {
        let explained = self.events.contains(&(payout.to_string(), version));
        if explained {
            self.events_explained += 1;
            self.payouts.insert(payout.to_string());
        }
        explained
    }

    /// The check's note: the restore's aftermath it met, named and explained (`None` if none).
    /// A lost posting the re-run re-posted is not among them: its outbox row carries the GL's
    /// journal, so it matches like any delivered row.
    pub fn note(&self) -> Option<String> {
        (self.events_explained + self.journals_explained > 0).then(|| {
            format!(
                "restore aftermath: {} GL event(s) of {} payout(s) and {} GL journal(s) are of a \
                 timeline paydb lost in a restore; the re-arming recorded them in \
                 restore_lost_timeline and the re-runs wrote later versions (RESTORE.md, \"paydb \
                 restored: the outbox and the GL\"): explained, not violations",
                self.events_explained,
                self.payouts.len(),
                self.journals_explained
            )
        })
    }
}
