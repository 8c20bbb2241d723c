//! The cached balances are a disposable projection (spec 002, invariant 8). `rebuild` recomputes
//! them solely from the immutable entries, reports every drift it found, and repairs it.

use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::error::LedgerError;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Drift {
    pub account_id: Uuid,
    pub projected_balance: String,
    pub entries_balance: String,
    pub projected_entry_count: i64,
    pub entries_count: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RebuildReport {
    pub accounts_checked: u64,
    pub drift: Vec<Drift>,
}

/// Runs in one transaction holding the projection table exclusively, so in-flight posts (which
/// lock projection rows) finish first and none interleaves.
pub async fn rebuild(pool: &PgPool) -> Result<RebuildReport, LedgerError> {
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE account_balances IN EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    let rows = sqlx::query(
        "SELECT a.id, coalesce(b.balance, 0) AS projected, coalesce(b.entry_count, 0) AS projected_count,
                (b.account_id IS NULL) AS missing,
                coalesce(s.total, 0) AS actual, coalesce(s.n, 0) AS actual_count
         FROM ledger_accounts a
         LEFT JOIN account_balances b ON b.account_id = a.id
         LEFT JOIN (SELECT account_id, sum(amount) AS total, count(*) AS n FROM entries GROUP BY account_id) s
                ON s.account_id = a.id
         ORDER BY a.id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut drift = Vec::new();
    for r in &rows {
        let id: Uuid = r.get("id");
        let projected: Decimal = r.get("projected");
        let actual: Decimal = r.get("actual");
        let projected_count: i64 = r.get("projected_count");
        let actual_count: i64 = r.get("actual_count");
        let missing: bool = r.get("missing");
        if missing || projected != actual || projected_count != actual_count {
            drift.push(Drift {
                account_id: id,
                projected_balance: crate::amount::format(projected),
                entries_balance: crate::amount::format(actual),
                projected_entry_count: projected_count,
                entries_count: actual_count,
            });
            sqlx::query(
                "INSERT INTO account_balances (account_id, balance, entry_count) VALUES ($1, $2, $3)
                 ON CONFLICT (account_id) DO UPDATE SET balance = EXCLUDED.balance, entry_count = EXCLUDED.entry_count",
            )
            .bind(id)
            .bind(actual)
            .bind(actual_count)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    if !drift.is_empty() {
        tracing::error!(
            alert = "gl_projection_drift",
            accounts = drift.len(),
            "cached balances drifted from entries; repaired"
        );
    }
    Ok(RebuildReport {
        accounts_checked: rows.len() as u64,
        drift,
    })
}
