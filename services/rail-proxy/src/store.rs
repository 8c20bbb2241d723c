//! proxydb: the intent transaction (high-water advance + unique submission), the outcome written
//! once, guard events and resolutions. Every invariant here is also enforced by the schema.

use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
};
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::model::{Evidence, Outcome, Resolution, Submission, SubmitPayout};

/// The migrations of proxydb, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/proxydb");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("proxydb: {0}")]
    Db(#[from] sqlx::Error),
    #[error("proxydb migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A stored row breaks an invariant the schema should have kept: a bug, stated loudly.
    #[error("proxydb invariant broken: {0}")]
    Invariant(String),
}

/// The result of the intent transaction.
#[derive(Debug, Clone)]
pub enum Intent {
    /// The intent is committed with a NULL outcome: the rail may now be called, once.
    Recorded(Submission),
    /// The token is below the account's high-water. Nothing was recorded but a guard event.
    Fenced { stored: u64, stored_owner: String },
    /// A submission for this payout exists. Nothing will be sent.
    Duplicate { existing: Submission },
}

const COLUMNS: &str =
    "payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, \
     beneficiary_ref, outcome, rail_ref, decline_code, failure_detail, \
     (extract(epoch FROM created_at) * 1000)::bigint AS created_ms, \
     (extract(epoch FROM resolved_at) * 1000)::bigint AS resolved_ms";

fn invariant(detail: impl std::fmt::Display) -> StoreError {
    StoreError::Invariant(detail.to_string())
}

fn submission_from_row(row: &sqlx::postgres::PgRow) -> Result<Submission, StoreError> {
    let outcome: Option<String> = row.try_get("outcome")?;
    let rail_ref: Option<String> = row.try_get("rail_ref")?;
    let decline_code: Option<String> = row.try_get("decline_code")?;
    let failure_detail: Option<String> = row.try_get("failure_detail")?;
    let outcome = match outcome.as_deref() {
        None => Outcome::Pending,
        Some("ACKED") => Outcome::Acked {
            rail_ref: rail_ref.ok_or_else(|| invariant("ACKED without rail_ref"))?,
        },
        Some("REJECTED") => Outcome::Rejected {
            decline_code: decline_code.ok_or_else(|| invariant("REJECTED without code"))?,
        },
        Some("TIMEOUT") => Outcome::Timeout {
            detail: failure_detail.unwrap_or_default(),
        },
        Some(other) => return Err(invariant(format!("unknown outcome {other:?}"))),
    };
    let token: i64 = row.try_get("fence_token")?;
    Ok(Submission {
        payout_id: PayoutId::parse(row.try_get::<String, _>("payout_id")?).map_err(invariant)?,
        account_id: AccountId::parse(row.try_get::<String, _>("account_id")?).map_err(invariant)?,
        token: FencingToken::new(u64::try_from(token).map_err(invariant)?).map_err(invariant)?,
        owner: row.try_get("owner")?,
        client_reference: ClientReference::parse(&row.try_get::<String, _>("client_reference")?)
            .map_err(invariant)?,
        amount_minor: AmountMinor::new(row.try_get("amount_minor")?).map_err(invariant)?,
        currency: Currency::parse(&row.try_get::<String, _>("currency")?).map_err(invariant)?,
        beneficiary_ref: BeneficiaryRef::parse(row.try_get::<String, _>("beneficiary_ref")?)
            .map_err(invariant)?,
        outcome,
        created_at_unix_ms: row.try_get("created_ms")?,
        resolved_at_unix_ms: row.try_get("resolved_ms")?,
    })
}

#[allow(clippy::too_many_arguments)]
async fn guard_event(
    tx: &mut Transaction<'_, Postgres>,
    kind: &str,
    request: &SubmitPayout,
    stored: i64,
    stored_owner: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO guard_event (kind, payout_id, account_id, lock_key, presented, stored, owner, stored_owner) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(kind)
    .bind(request.payout_id.as_str())
    .bind(request.account_id.as_str())
    .bind(request.lock_key())
    .bind(request.token.as_i64())
    .bind(stored)
    .bind(&request.owner)
    .bind(stored_owner)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Steps 6-7 of the token's journey, in one transaction, before the rail is contacted:
/// the conditional high-water advance (equal passes, lower is refused), then the intent row,
/// unique per payout. The high-water row lock serialises every submission of one account.
pub async fn record_intent(pool: &PgPool, request: &SubmitPayout) -> Result<Intent, StoreError> {
    let mut tx = pool.begin().await?;
    let advanced = sqlx::query(
        "INSERT INTO account_high_water (account_id, high_water, owner) VALUES ($1, $2, $3) \
         ON CONFLICT (account_id) DO UPDATE \
           SET high_water = EXCLUDED.high_water, owner = EXCLUDED.owner, updated_at = now() \
           WHERE account_high_water.high_water <= EXCLUDED.high_water \
         RETURNING high_water",
    )
    .bind(request.account_id.as_str())
    .bind(request.token.as_i64())
    .bind(&request.owner)
    .fetch_optional(&mut *tx)
    .await?;
    if advanced.is_none() {
        // The conflicting row is locked by the statement above, so this read is the value that refused us.
        let row =
            sqlx::query("SELECT high_water, owner FROM account_high_water WHERE account_id = $1")
                .bind(request.account_id.as_str())
                .fetch_one(&mut *tx)
                .await?;
        let stored: i64 = row.try_get("high_water")?;
        let stored_owner: String = row.try_get("owner")?;
        if request.token.admitted_by(stored as u64) {
            return Err(invariant(format!(
                "high-water {stored} refused token {} that it admits",
                request.token
            )));
        }
        guard_event(&mut tx, "FENCED", request, stored, &stored_owner).await?;
        tx.commit().await?;
        return Ok(Intent::Fenced {
            stored: stored as u64,
            stored_owner,
        });
    }
    let inserted = sqlx::query(&format!(
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, \
           currency, beneficiary_ref) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
         ON CONFLICT DO NOTHING RETURNING {COLUMNS}"
    ))
    .bind(request.payout_id.as_str())
    .bind(request.account_id.as_str())
    .bind(request.token.as_i64())
    .bind(&request.owner)
    .bind(request.client_reference.as_str())
    .bind(request.amount_minor.get())
    .bind(request.currency.as_str())
    .bind(request.beneficiary_ref.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(row) = inserted {
        let submission = submission_from_row(&row)?;
        tx.commit().await?;
        return Ok(Intent::Recorded(submission));
    }
    let row = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM rail_submission WHERE payout_id = $1 OR client_reference = $2"
    ))
    .bind(request.payout_id.as_str())
    .bind(request.client_reference.as_str())
    .fetch_one(&mut *tx)
    .await?;
    let existing = submission_from_row(&row)?;
    guard_event(
        &mut tx,
        "DUPLICATE",
        request,
        existing.token.as_i64(),
        &existing.owner,
    )
    .await?;
    tx.commit().await?;
    Ok(Intent::Duplicate { existing })
}

/// Sets the outcome of a submission, which must still be NULL (the database refuses anything else).
pub async fn record_outcome(
    pool: &PgPool,
    payout_id: &PayoutId,
    outcome: &Outcome,
) -> Result<Submission, StoreError> {
    let (name, rail_ref, decline_code, detail) = match outcome {
        Outcome::Pending => return Err(invariant("recording PENDING as an outcome")),
        Outcome::Acked { rail_ref } => ("ACKED", Some(rail_ref.as_str()), None, None),
        Outcome::Rejected { decline_code } => ("REJECTED", None, Some(decline_code.as_str()), None),
        Outcome::Timeout { detail } => ("TIMEOUT", None, None, Some(detail.as_str())),
    };
    let row = sqlx::query(&format!(
        "UPDATE rail_submission SET outcome = $2, rail_ref = $3, decline_code = $4, failure_detail = $5, \
           resolved_at = now() WHERE payout_id = $1 AND outcome IS NULL RETURNING {COLUMNS}"
    ))
    .bind(payout_id.as_str())
    .bind(name)
    .bind(rail_ref)
    .bind(decline_code)
    .bind(detail)
    .fetch_optional(pool)
    .await?;
    match row {
        Some(row) => submission_from_row(&row),
        None => Err(invariant(format!(
            "payout {payout_id}: outcome already recorded or no intent"
        ))),
    }
}

pub async fn find(
    pool: &PgPool,
    payout_id: &PayoutId,
) -> Result<Option<(Submission, Vec<Resolution>)>, StoreError> {
    let Some(row) = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM rail_submission WHERE payout_id = $1"
    ))
    .bind(payout_id.as_str())
    .fetch_optional(pool)
    .await?
    else {
        return Ok(None);
    };
    let submission = submission_from_row(&row)?;
    let rows = sqlx::query(
        "SELECT asked_by, (extract(epoch FROM asked_at) * 1000)::bigint AS asked_ms, evidence, rail_refs, detail \
         FROM resolution WHERE payout_id = $1 ORDER BY id",
    )
    .bind(payout_id.as_str())
    .fetch_all(pool)
    .await?;
    let resolutions = rows
        .iter()
        .map(|row| resolution_from_row(payout_id, row))
        .collect::<Result<_, _>>()?;
    Ok(Some((submission, resolutions)))
}

fn resolution_from_row(
    payout_id: &PayoutId,
    row: &sqlx::postgres::PgRow,
) -> Result<Resolution, StoreError> {
    let evidence: String = row.try_get("evidence")?;
    let evidence = match evidence.as_str() {
        "FOUND" => Evidence::Found {
            rail_refs: row.try_get("rail_refs")?,
        },
        "ABSENT" => Evidence::Absent,
        "UNKNOWN" => Evidence::Unknown {
            detail: row.try_get("detail")?,
        },
        other => return Err(invariant(format!("unknown evidence {other:?}"))),
    };
    Ok(Resolution {
        payout_id: payout_id.clone(),
        asked_by: row.try_get("asked_by")?,
        asked_at_unix_ms: row.try_get("asked_ms")?,
        evidence,
    })
}

pub async fn record_resolution(
    pool: &PgPool,
    payout_id: &PayoutId,
    asked_by: &str,
    evidence: &Evidence,
) -> Result<Resolution, StoreError> {
    let (rail_refs, detail) = match evidence {
        Evidence::Found { rail_refs } => (rail_refs.clone(), String::new()),
        Evidence::Absent => (vec![], String::new()),
        Evidence::Unknown { detail } => (vec![], detail.clone()),
    };
    let row = sqlx::query(
        "INSERT INTO resolution (payout_id, asked_by, evidence, rail_refs, detail) VALUES ($1, $2, $3, $4, $5) \
         RETURNING asked_by, (extract(epoch FROM asked_at) * 1000)::bigint AS asked_ms, evidence, rail_refs, detail",
    )
    .bind(payout_id.as_str())
    .bind(asked_by)
    .bind(evidence.name())
    .bind(&rail_refs)
    .bind(&detail)
    .fetch_one(pool)
    .await?;
    resolution_from_row(payout_id, &row)
}
