//! The GL's PostgreSQL repository. Every write is one transaction; journal tables only ever see
//! INSERT (the connection runs as role `gl_app`, which holds nothing else on them).

use std::collections::HashMap;
use std::sync::RwLock;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::amount;
use crate::error::LedgerError;
use crate::validate::{AccountKey, ValidatedEvent, ValidatedJournal};

/// Advisory-lock key that every journal post holds shared from its BEGIN (before its receipt
/// sequence is taken) to its COMMIT. Taken exclusive, it waits for every post in flight: a mode
/// change does so, so that a post never commits under a mode it did not check, and a paging
/// reader does so for an instant, to learn the receipt watermark (`Store::receipt_watermark`).
pub const MODE_LOCK_KEY: i64 = 0x0047_4c5f_4d4f_4445; // "GL_MODE" in ASCII
/// A page of ListEntries never exceeds this: bounds memory and response size.
pub const ENTRIES_PAGE_SIZE_MAX: u32 = 500;
/// Namespace of account ids derived from their natural identity, so every GL instance (and a
/// rebuild) derives the same id for the same account.
const ACCOUNT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6c65_6467_6572_2d61_6363_6f75_6e74_0001);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Mirror,
    Reconcile,
    DegradedLedger,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Mirror => "MIRROR",
            Mode::Reconcile => "RECONCILE",
            Mode::DegradedLedger => "DEGRADED_LEDGER",
        }
    }
    pub fn parse(text: &str) -> Option<Self> {
        [Mode::Mirror, Mode::Reconcile, Mode::DegradedLedger]
            .into_iter()
            .find(|m| m.as_str() == text)
    }
}

#[derive(Debug, Clone)]
pub struct ModeState {
    pub mode: Mode,
    pub changed_by: String,
    pub reason: String,
    pub changed_at: DateTime<Utc>,
    pub change_sequence: i64,
}

#[derive(Debug, Clone)]
pub struct StoredEntry {
    pub journal_id: Uuid,
    pub line_number: i32,
    pub account_id: Uuid,
    pub account: AccountKey,
    pub amount: Decimal,
    pub description: String,
    pub receipt_sequence: i64,
    pub recorded_at: DateTime<Utc>,
    pub occurred_at: DateTime<Utc>,
}

#[derive(Debug, Clone)]
pub struct StoredJournal {
    pub id: Uuid,
    pub receipt_sequence: i64,
    pub source_service: String,
    pub idempotency_key: String,
    pub payload_hash: String,
    pub source_transaction_id: String,
    pub tracking_code: String,
    pub effect_kind: String,
    pub effect_version: i32,
    pub reversal_of: Option<Uuid>,
    pub occurred_at: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
    pub correlation_id: String,
    pub actor_id: String,
    pub metadata: serde_json::Value,
    pub correction: Option<(String, String)>,
    /// The source's own order, as first appended (`None`: not stated).
    pub source_sequence: Option<i64>,
    pub settlement_reference: String,
    pub client_reference: String,
    pub entries: Vec<StoredEntry>,
}

#[derive(Debug, Clone)]
pub struct Balance {
    pub account_id: Uuid,
    pub balance: Decimal,
    pub projected_balance: Decimal,
    pub entry_count: i64,
}

#[derive(Debug, Clone, Default)]
pub struct EntryFilter {
    pub account: Option<(String, String, String)>,
    pub asset: Option<String>,
    pub source_transaction_id: Option<String>,
    pub recorded_from: Option<DateTime<Utc>>,
    pub recorded_to: Option<DateTime<Utc>>,
    /// Exclusive cursor (receipt_sequence, line_number).
    pub after: (i64, i32),
    pub limit: u32,
}

pub struct Store {
    pool: PgPool,
    /// Accounts are immutable and never deleted, so a resolved id stays valid forever.
    account_cache: RwLock<HashMap<AccountKey, Uuid>>,
    /// Whether a listing reads only up to the receipt watermark (always, but in the negative
    /// control that shows what it prevents).
    receipt_watermark: bool,
}

pub fn account_id_for(key: &AccountKey) -> Uuid {
    let name = format!(
        "{}\u{1f}{}\u{1f}{}\u{1f}{}",
        key.class, key.owner_type, key.owner_id, key.asset
    );
    Uuid::new_v5(&ACCOUNT_ID_NAMESPACE, name.as_bytes())
}

fn is_unique_violation(e: &sqlx::Error, constraint: &str) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23505") && d.constraint() == Some(constraint))
}

impl Store {
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            account_cache: RwLock::new(HashMap::new()),
            receipt_watermark: true,
        }
    }

    /// NEGATIVE CONTROL ONLY: listings read past the receipt watermark, as before it existed, so
    /// a journal that commits behind a higher receipt sequence already paged past is skipped.
    #[doc(hidden)]
    pub fn without_receipt_watermark_for_tests(mut self) -> Self {
        self.receipt_watermark = false;
        self
    }

    /// The highest receipt sequence below which nothing can still commit. A post takes its
    /// receipt sequence at its INSERT, so posts commit out of sequence order: without a bound, a
    /// reader paging by sequence could read 11, move its cursor past it, and never see 10 commit
    /// afterwards. Every post holds [`MODE_LOCK_KEY`] shared from before its sequence is taken to
    /// its commit; taking it exclusive waits for every post in flight (new ones queue behind),
    /// so the highest committed sequence read under it has nothing uncommitted below it, and any
    /// later post takes a higher one. Held for one statement: posts pause only as long as the
    /// posts already in flight take to commit.
    async fn receipt_watermark(&self) -> Result<i64, LedgerError> {
        let mut tx = self
            .pool
            .begin_with(format!(
                "BEGIN; SELECT pg_advisory_xact_lock({MODE_LOCK_KEY})"
            ))
            .await?;
        let highest: Option<i64> = sqlx::query_scalar("SELECT max(receipt_sequence) FROM journals")
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(highest.unwrap_or(0))
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Idempotent on the natural identity. Returns (id, created).
    pub async fn open_account(&self, key: &AccountKey) -> Result<(Uuid, bool), LedgerError> {
        let id = account_id_for(key);
        let mut tx = self.pool.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO ledger_accounts (id, class, owner_type, owner_id, asset_id) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (class, owner_type, owner_id, asset_id) DO NOTHING",
        )
        .bind(id)
        .bind(&key.class)
        .bind(&key.owner_type)
        .bind(&key.owner_id)
        .bind(&key.asset)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        sqlx::query("INSERT INTO account_balances (account_id) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.account_cache
            .write()
            .expect("cache lock")
            .insert(key.clone(), id);
        Ok((id, inserted))
    }

    /// Resolves each entry's account, or names the first line whose account is unknown or holds
    /// another asset.
    async fn resolve_accounts(&self, j: &ValidatedJournal) -> Result<Vec<Uuid>, LedgerError> {
        let cached: Vec<Option<Uuid>> = {
            let cache = self.account_cache.read().expect("cache lock");
            j.entries
                .iter()
                .map(|e| cache.get(&e.account).copied())
                .collect()
        };
        if cached.iter().all(Option::is_some) {
            return Ok(cached.into_iter().flatten().collect());
        }
        let classes: Vec<&str> = j.entries.iter().map(|e| e.account.class.as_str()).collect();
        let owner_types: Vec<&str> = j
            .entries
            .iter()
            .map(|e| e.account.owner_type.as_str())
            .collect();
        let owner_ids: Vec<&str> = j
            .entries
            .iter()
            .map(|e| e.account.owner_id.as_str())
            .collect();
        let rows = sqlx::query(
            "SELECT id, class, owner_type, owner_id, asset_id FROM ledger_accounts
             WHERE (class, owner_type, owner_id) IN (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))",
        )
        .bind(&classes)
        .bind(&owner_types)
        .bind(&owner_ids)
        .fetch_all(&self.pool)
        .await?;
        let mut known: HashMap<AccountKey, Uuid> = HashMap::new();
        for r in &rows {
            let key = AccountKey {
                class: r.get("class"),
                owner_type: r.get("owner_type"),
                owner_id: r.get("owner_id"),
                asset: r.get("asset_id"),
            };
            known.insert(key, r.get("id"));
        }
        self.account_cache
            .write()
            .expect("cache lock")
            .extend(known.clone());
        let mut ids = Vec::with_capacity(j.entries.len());
        for e in &j.entries {
            match known.get(&e.account) {
                Some(id) => ids.push(*id),
                None => {
                    let other_asset = known.keys().any(|k| {
                        k.class == e.account.class
                            && k.owner_type == e.account.owner_type
                            && k.owner_id == e.account.owner_id
                    });
                    let account = format!(
                        "{}/{}/{}",
                        e.account.class, e.account.owner_type, e.account.owner_id
                    );
                    return Err(if other_asset {
                        LedgerError::AccountAssetMismatch {
                            line_number: e.line_number,
                            account,
                            asset: e.account.asset.clone(),
                        }
                    } else {
                        LedgerError::UnknownAccount {
                            line_number: e.line_number,
                            account: format!("{}", e.account),
                        }
                    });
                }
            }
        }
        Ok(ids)
    }

    fn replay(
        existing: StoredJournal,
        j: &ValidatedJournal,
    ) -> Result<(StoredJournal, bool), LedgerError> {
        if existing.payload_hash == j.payload_hash {
            Ok((existing, false))
        } else {
            Err(LedgerError::IdempotencyConflict {
                existing_journal_id: existing.id.to_string(),
            })
        }
    }

    /// Appends one journal atomically, or returns the original for an identical retry.
    ///
    /// One round trip and one commit: gldb's `append_journal` (migration 0005) called in autocommit
    /// takes the shared mode lock, reads the mode, locks the touched accounts' projection rows in
    /// id order, probes the idempotency key, checks a reversal against its target, and inserts the
    /// journal, its entries and the projection's updates, in that order and with that precedence.
    pub async fn append_journal(
        &self,
        j: &ValidatedJournal,
    ) -> Result<(StoredJournal, bool), LedgerError> {
        let account_ids = self.resolve_accounts(j).await?;
        let mut lock_ids = account_ids.clone();
        lock_ids.sort();
        lock_ids.dedup();
        let id = Uuid::new_v4();
        let lines: Vec<i32> = j.entries.iter().map(|e| e.line_number as i32).collect();
        let assets: Vec<&str> = j.entries.iter().map(|e| e.account.asset.as_str()).collect();
        let amounts: Vec<Decimal> = j.entries.iter().map(|e| e.amount).collect();
        let descriptions: Vec<&str> = j.entries.iter().map(|e| e.description.as_str()).collect();
        let appended = sqlx::query(
            "SELECT o_outcome, o_journal_id, o_receipt_sequence, o_recorded_at, o_detail
               FROM append_journal($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
                                   $16, $17, $18, $19, $20, $21, $22, $23, $24, $25)",
        )
        .bind(MODE_LOCK_KEY)
        .bind(&lock_ids)
        .bind(id)
        .bind(&j.source_service)
        .bind(&j.idempotency_key)
        .bind(&j.payload_hash)
        .bind(&j.source_transaction_id)
        .bind(&j.tracking_code)
        .bind(&j.effect_kind)
        .bind(j.effect_version as i32)
        .bind(j.reversal_of)
        .bind(j.occurred_at)
        .bind(&j.correlation_id)
        .bind(&j.actor_id)
        .bind(&j.metadata)
        .bind(j.correction.as_ref().map(|c| c.0.as_str()))
        .bind(j.correction.as_ref().map(|c| c.1.as_str()))
        .bind(j.source_sequence)
        .bind(&j.settlement_reference)
        .bind(&j.client_reference)
        .bind(&lines)
        .bind(&account_ids)
        .bind(&assets)
        .bind(&amounts)
        .bind(&descriptions)
        .fetch_one(&self.pool)
        .await;
        let row = match appended {
            Ok(row) => row,
            Err(e) if is_unique_violation(&e, "journals_reversal_once") => {
                // A concurrent reversal of the same target committed first.
                let target = j.reversal_of.expect("only reversals hit this index");
                let existing: Uuid =
                    sqlx::query_scalar("SELECT id FROM journals WHERE reversal_of = $1")
                        .bind(target)
                        .fetch_one(&self.pool)
                        .await?;
                return Err(LedgerError::AlreadyReversed {
                    target: target.to_string(),
                    existing_reversal: existing.to_string(),
                });
            }
            // numeric_value_out_of_range: an account's projected balance would leave
            // numeric(38,18) (each amount fits; their running sum does not).
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("22003") => {
                return Err(LedgerError::BalanceOutOfRange {
                    detail: e.to_string(),
                });
            }
            Err(e) => return Err(e.into()),
        };
        let outcome: String = row.get("o_outcome");
        let journal_id: Option<Uuid> = row.get("o_journal_id");
        let detail: Option<String> = row.get("o_detail");
        let target = || j.reversal_of.map(|t| t.to_string()).unwrap_or_default();
        let missing = |what: &str| {
            LedgerError::Storage(format!("append_journal answered {outcome} without {what}"))
        };
        match outcome.as_str() {
            "created" => {}
            "existing" => {
                return self
                    .replay_of(journal_id.ok_or_else(|| missing("the journal"))?, j)
                    .await
            }
            "mode_refused" => {
                return Err(LedgerError::ModeRefused {
                    mode: detail.ok_or_else(|| missing("the mode"))?,
                })
            }
            "reversal_target_unknown" => {
                return Err(LedgerError::ReversalTargetUnknown { target: target() })
            }
            "already_reversed" => {
                return Err(LedgerError::AlreadyReversed {
                    target: target(),
                    existing_reversal: journal_id
                        .ok_or_else(|| missing("the reversal"))?
                        .to_string(),
                })
            }
            "reversal_not_mirror" => {
                return Err(LedgerError::ReversalNotMirror {
                    target: target(),
                    detail: detail.unwrap_or_default(),
                })
            }
            other => {
                return Err(LedgerError::Storage(format!(
                    "append_journal answered an unknown outcome {other:?}"
                )))
            }
        }
        let receipt_sequence: i64 = row
            .get::<Option<i64>, _>("o_receipt_sequence")
            .ok_or_else(|| missing("the receipt sequence"))?;
        let recorded_at: DateTime<Utc> = row
            .get::<Option<DateTime<Utc>>, _>("o_recorded_at")
            .ok_or_else(|| missing("the recording time"))?;
        let stored = StoredJournal {
            id,
            receipt_sequence,
            source_service: j.source_service.clone(),
            idempotency_key: j.idempotency_key.clone(),
            payload_hash: j.payload_hash.clone(),
            source_transaction_id: j.source_transaction_id.clone(),
            tracking_code: j.tracking_code.clone(),
            effect_kind: j.effect_kind.clone(),
            effect_version: j.effect_version as i32,
            reversal_of: j.reversal_of,
            occurred_at: j.occurred_at,
            recorded_at,
            correlation_id: j.correlation_id.clone(),
            actor_id: j.actor_id.clone(),
            metadata: j.metadata.clone(),
            correction: j.correction.clone(),
            source_sequence: j.source_sequence,
            settlement_reference: j.settlement_reference.clone(),
            client_reference: j.client_reference.clone(),
            entries: j
                .entries
                .iter()
                .zip(&account_ids)
                .map(|(e, account_id)| StoredEntry {
                    journal_id: id,
                    line_number: e.line_number as i32,
                    account_id: *account_id,
                    account: e.account.clone(),
                    amount: e.amount,
                    description: e.description.clone(),
                    receipt_sequence,
                    recorded_at,
                    occurred_at: j.occurred_at,
                })
                .collect(),
        };
        Ok((stored, true))
    }

    async fn replay_of(
        &self,
        existing: Uuid,
        j: &ValidatedJournal,
    ) -> Result<(StoredJournal, bool), LedgerError> {
        let journal = self.journal(existing).await?.ok_or_else(|| {
            LedgerError::Storage(format!(
                "journal {existing} vanished from an append-only table"
            ))
        })?;
        Self::replay(journal, j)
    }

    pub async fn journal(&self, id: Uuid) -> Result<Option<StoredJournal>, LedgerError> {
        let Some(r) = sqlx::query("SELECT * FROM journals WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
        else {
            return Ok(None);
        };
        let entries = self.entries(&EntryFilter::default(), Some(id)).await?;
        let approved_by: Option<String> = r.get("correction_approved_by");
        let reference: Option<String> = r.get("correction_reference");
        Ok(Some(StoredJournal {
            id,
            receipt_sequence: r.get("receipt_sequence"),
            source_service: r.get("source_service"),
            idempotency_key: r.get("idempotency_key"),
            payload_hash: r.get("payload_hash"),
            source_transaction_id: r.get("source_transaction_id"),
            tracking_code: r.get("tracking_code"),
            effect_kind: r.get("effect_kind"),
            effect_version: r.get("effect_version"),
            reversal_of: r.get("reversal_of"),
            occurred_at: r.get("occurred_at"),
            recorded_at: r.get("recorded_at"),
            correlation_id: r.get("correlation_id"),
            actor_id: r.get("actor_id"),
            metadata: r.get("metadata"),
            correction: approved_by.zip(reference),
            source_sequence: r.get("source_sequence"),
            settlement_reference: r.get("settlement_reference"),
            client_reference: r.get("client_reference"),
            entries,
        }))
    }

    pub async fn journal_id_by_key(&self, key: &str) -> Result<Option<Uuid>, LedgerError> {
        Ok(
            sqlx::query_scalar("SELECT id FROM journals WHERE idempotency_key = $1")
                .bind(key)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// Entries in receipt order. With `journal`, all lines of that journal (the filter is ignored).
    pub async fn entries(
        &self,
        f: &EntryFilter,
        journal: Option<Uuid>,
    ) -> Result<Vec<StoredEntry>, LedgerError> {
        let limit = if journal.is_some() {
            i64::MAX
        } else {
            f.limit.clamp(1, ENTRIES_PAGE_SIZE_MAX) as i64
        };
        let (class, owner_type, owner_id) = match &f.account {
            Some((c, t, o)) => (Some(c.as_str()), Some(t.as_str()), Some(o.as_str())),
            None => (None, None, None),
        };
        // A page of a listing ends at the receipt watermark, so its cursor never passes a journal
        // that has yet to commit; one journal's lines are read whole, as committed.
        let watermark = match journal {
            None if self.receipt_watermark => self.receipt_watermark().await?,
            _ => i64::MAX,
        };
        let rows = sqlx::query(
            "SELECT e.journal_id, e.line_number, e.account_id, a.class, a.owner_type, a.owner_id, e.asset_id, e.amount,
                    e.description, j.receipt_sequence, j.recorded_at, j.occurred_at
             FROM entries e JOIN journals j ON j.id = e.journal_id JOIN ledger_accounts a ON a.id = e.account_id
             WHERE ($1::uuid IS NULL OR e.journal_id = $1)
               AND ($2::text IS NULL OR (a.class = $2 AND a.owner_type = $3 AND a.owner_id = $4))
               AND ($5::text IS NULL OR e.asset_id = $5)
               AND ($6::text IS NULL OR j.source_transaction_id = $6)
               AND ($7::timestamptz IS NULL OR j.recorded_at >= $7)
               AND ($8::timestamptz IS NULL OR j.recorded_at < $8)
               AND (j.receipt_sequence, e.line_number) > ($9, $10)
               AND j.receipt_sequence <= $12
             ORDER BY j.receipt_sequence, e.line_number
             LIMIT $11",
        )
        .bind(journal)
        .bind(class)
        .bind(owner_type)
        .bind(owner_id)
        .bind(f.asset.as_deref())
        .bind(f.source_transaction_id.as_deref())
        .bind(f.recorded_from)
        .bind(f.recorded_to)
        .bind(f.after.0)
        .bind(f.after.1)
        .bind(limit)
        .bind(watermark)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| StoredEntry {
                journal_id: r.get("journal_id"),
                line_number: r.get("line_number"),
                account_id: r.get("account_id"),
                account: AccountKey {
                    class: r.get("class"),
                    owner_type: r.get("owner_type"),
                    owner_id: r.get("owner_id"),
                    asset: r.get("asset_id"),
                },
                amount: r.get("amount"),
                description: r.get("description"),
                receipt_sequence: r.get("receipt_sequence"),
                recorded_at: r.get("recorded_at"),
                occurred_at: r.get("occurred_at"),
            })
            .collect())
    }

    /// The authoritative balance (sum of entries) beside the cached projection.
    pub async fn balance(&self, key: &AccountKey) -> Result<Balance, LedgerError> {
        let row = sqlx::query(
            "SELECT a.id, coalesce((SELECT sum(amount) FROM entries e WHERE e.account_id = a.id), 0) AS balance,
                    (SELECT count(*) FROM entries e WHERE e.account_id = a.id) AS entry_count,
                    coalesce(b.balance, 0) AS projected
             FROM ledger_accounts a LEFT JOIN account_balances b ON b.account_id = a.id
             WHERE a.class = $1 AND a.owner_type = $2 AND a.owner_id = $3 AND a.asset_id = $4",
        )
        .bind(&key.class)
        .bind(&key.owner_type)
        .bind(&key.owner_id)
        .bind(&key.asset)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| LedgerError::NotFound { what: format!("account {key}") })?;
        Ok(Balance {
            account_id: row.get("id"),
            balance: row.get("balance"),
            projected_balance: row.get("projected"),
            entry_count: row.get("entry_count"),
        })
    }

    pub async fn mode(&self) -> Result<ModeState, LedgerError> {
        let r = sqlx::query(
            "SELECT change_sequence, mode, operator_id, reason, changed_at FROM operating_mode_changes
             ORDER BY change_sequence DESC LIMIT 1",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(ModeState {
            mode: Mode::parse(r.get("mode"))
                .expect("the mode column is constrained to known modes"),
            changed_by: r.get("operator_id"),
            reason: r.get("reason"),
            changed_at: r.get("changed_at"),
            change_sequence: r.get("change_sequence"),
        })
    }

    /// An audited mode change. DEGRADED_LEDGER is refused (and the refusal audited): spec 002 says
    /// the initial implementation does not activate it.
    pub async fn set_mode(
        &self,
        mode: Mode,
        operator_id: &str,
        reason: &str,
    ) -> Result<ModeState, LedgerError> {
        if operator_id.trim().is_empty() {
            return Err(LedgerError::InvalidField {
                field: "operator_id",
                detail: "an audited change names its operator".into(),
            });
        }
        if reason.trim().is_empty() {
            return Err(LedgerError::InvalidField {
                field: "reason",
                detail: "an audited change states its reason".into(),
            });
        }
        if mode == Mode::DegradedLedger {
            sqlx::query("INSERT INTO operating_mode_refusals (requested, operator_id, reason, refusal) VALUES ($1, $2, $3, $4)")
                .bind(mode.as_str())
                .bind(operator_id)
                .bind(reason)
                .bind("MODE_NOT_ACTIVATED")
                .execute(&self.pool)
                .await?;
            return Err(LedgerError::ModeNotActivated {
                mode: mode.as_str().into(),
            });
        }
        let mut tx = self.pool.begin().await?;
        // Waits for in-flight posts, which hold the lock shared, so none commits under the old mode after this.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MODE_LOCK_KEY)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO operating_mode_changes (mode, operator_id, reason) VALUES ($1, $2, $3)",
        )
        .bind(mode.as_str())
        .bind(operator_id)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.mode().await
    }

    /// Idempotent on (source_service, source_transaction_id, event_version): an identical retry
    /// (same payload hash) answers the original, whatever its `source_sequence` (delivery
    /// metadata: the original position stays); another payload under the key is a conflict.
    /// Returns (id, created, recorded_at).
    pub async fn append_event(
        &self,
        e: &ValidatedEvent,
    ) -> Result<(Uuid, bool, DateTime<Utc>), LedgerError> {
        let id = Uuid::new_v4();
        let inserted = sqlx::query(
            "INSERT INTO transaction_events (id, source_service, source_transaction_id, event_type, event_version,
                payload_hash, occurred_at, correlation_id, actor_id, metadata, source_sequence)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
             ON CONFLICT (source_service, source_transaction_id, event_version) DO NOTHING
             RETURNING recorded_at",
        )
        .bind(id)
        .bind(&e.source_service)
        .bind(&e.source_transaction_id)
        .bind(&e.event_type)
        .bind(e.event_version)
        .bind(&e.payload_hash)
        .bind(e.occurred_at)
        .bind(&e.correlation_id)
        .bind(&e.actor_id)
        .bind(&e.metadata)
        .bind(e.source_sequence)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(r) = inserted {
            return Ok((id, true, r.get("recorded_at")));
        }
        let r = sqlx::query(
            "SELECT id, payload_hash, recorded_at FROM transaction_events
             WHERE source_service = $1 AND source_transaction_id = $2 AND event_version = $3",
        )
        .bind(&e.source_service)
        .bind(&e.source_transaction_id)
        .bind(e.event_version)
        .fetch_one(&self.pool)
        .await?;
        let existing: Uuid = r.get("id");
        if r.get::<String, _>("payload_hash") != e.payload_hash {
            return Err(LedgerError::IdempotencyConflict {
                existing_journal_id: existing.to_string(),
            });
        }
        Ok((existing, false, r.get("recorded_at")))
    }
}

/// The amount as the wire spells it.
pub fn wire_amount(value: Decimal) -> String {
    amount::format(value)
}
