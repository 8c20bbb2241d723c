//! proxydb: the intent transaction (high-water advance + unique submission), the outcome written
//! once, guard events and resolutions. Every invariant here is also enforced by the schema.

use grant_signing::Signature;
use payout_domain::{
    AccountId, AmountMinor, BeneficiaryRef, ClientReference, Currency, FencingToken, PayoutId,
};
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::model::{
    DuplicateClass, Evidence, InquirePayout, Outcome, Payment, Resolution, Submission, SubmitPayout,
};

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
    Duplicate {
        existing: Submission,
        class: DuplicateClass,
    },
    /// proxydb does not admit the token: a copy restored from a backup and not re-armed, or a
    /// token below the last re-arming's horizon. Nothing was recorded but a guard event.
    Restored(Restored),
}

/// Why this database refused a token before its high-water statement could pass it
/// (`incarnation_admits`, migration 0006).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// Whether the database is the one its incarnation row was armed in.
    pub incarnation_current: bool,
    /// The lowest token the database admits since its last re-arming (0: never re-armed).
    pub token_floor: u64,
}

/// The guard's answer to a fenced inquiry, decided in one transaction.
#[derive(Debug, Clone)]
pub enum InquiryGuard {
    /// The token is below the account's high-water. Nothing was recorded but a guard event.
    Fenced { stored: u64, stored_owner: String },
    /// proxydb does not admit the token (see [`Intent::Restored`]). Nothing was recorded but a
    /// guard event, not even the seal.
    Restored(Restored),
    /// The payout had no submission: it is now sealed (NOT_SENT, final) by this inquiry
    /// (`by_this_inquiry`), or was sealed by an earlier one. The rail was never called for it
    /// and never will be.
    Sealed {
        submission: Submission,
        by_this_inquiry: bool,
    },
    /// A submission exists: the rail must be asked. `now_unix_ms` is proxydb's clock at the
    /// guard, the clock `valid_until` was computed on.
    Submitted {
        submission: Submission,
        now_unix_ms: i64,
    },
    /// No submission, and sealing is disabled (the negative control only).
    Unsealed,
    /// The payout's record names another account than the inquiry: bad input (the fence was
    /// presented on the wrong key). Nothing was written, not even the high-water advance.
    OtherAccount { recorded: AccountId },
}

const COLUMNS: &str =
    "payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, \
     beneficiary_ref, outcome, rail_ref, decline_code, failure_detail, sealed_by, \
     (extract(epoch FROM created_at) * 1000)::bigint AS created_ms, \
     (extract(epoch FROM resolved_at) * 1000)::bigint AS resolved_ms, \
     (extract(epoch FROM valid_until) * 1000)::bigint AS valid_until_ms";

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
        Some("NOT_SENT") => Outcome::NotSent {
            sealed_by: row
                .try_get::<Option<String>, _>("sealed_by")?
                .ok_or_else(|| invariant("NOT_SENT without sealed_by"))?,
        },
        Some(other) => return Err(invariant(format!("unknown outcome {other:?}"))),
    };
    let amount_minor: Option<i64> = row.try_get("amount_minor")?;
    let currency: Option<String> = row.try_get("currency")?;
    let beneficiary_ref: Option<String> = row.try_get("beneficiary_ref")?;
    let payment = match (amount_minor, currency, beneficiary_ref) {
        (None, None, None) if matches!(outcome, Outcome::NotSent { .. }) => None,
        (Some(amount_minor), Some(currency), Some(beneficiary_ref))
            if !matches!(outcome, Outcome::NotSent { .. }) =>
        {
            Some(Payment {
                amount_minor: AmountMinor::new(amount_minor).map_err(invariant)?,
                currency: Currency::parse(&currency).map_err(invariant)?,
                beneficiary_ref: BeneficiaryRef::parse(beneficiary_ref).map_err(invariant)?,
            })
        }
        _ => {
            return Err(invariant(
                "a submission carries a whole payment exactly when it is not sealed",
            ))
        }
    };
    let token: i64 = row.try_get("fence_token")?;
    Ok(Submission {
        payout_id: PayoutId::parse(row.try_get::<String, _>("payout_id")?).map_err(invariant)?,
        account_id: AccountId::parse(row.try_get::<String, _>("account_id")?).map_err(invariant)?,
        token: FencingToken::new(u64::try_from(token).map_err(invariant)?).map_err(invariant)?,
        owner: row.try_get("owner")?,
        client_reference: ClientReference::parse(&row.try_get::<String, _>("client_reference")?)
            .map_err(invariant)?,
        payment,
        outcome,
        created_at_unix_ms: row.try_get("created_ms")?,
        resolved_at_unix_ms: row.try_get("resolved_ms")?,
        valid_until_unix_ms: row.try_get("valid_until_ms")?,
        outcome_signature: None,
    })
}

/// Who presented which grant for which payout, at which call: the fields of a guard event.
pub(crate) struct Presented<'a> {
    /// `SUBMIT` or `INQUIRE` (`guard_event.operation`).
    pub operation: &'static str,
    pub payout_id: &'a PayoutId,
    pub account_id: &'a AccountId,
    /// The key the call must hold: the account's, `payout:{account_id}`.
    pub lock_key: String,
    pub token: FencingToken,
    pub owner: &'a str,
    /// The key the grant was signed for, as presented.
    pub signed_key: &'a str,
    pub signature: &'a Signature,
}

impl<'a> Presented<'a> {
    pub fn submit(request: &'a SubmitPayout) -> Self {
        Self {
            operation: "SUBMIT",
            payout_id: &request.payout_id,
            account_id: &request.account_id,
            lock_key: request.lock_key(),
            token: request.token,
            owner: &request.owner,
            signed_key: &request.key,
            signature: &request.signature,
        }
    }
    pub fn inquire(request: &'a InquirePayout) -> Self {
        Self {
            operation: "INQUIRE",
            payout_id: &request.payout_id,
            account_id: &request.account_id,
            lock_key: request.lock_key(),
            token: request.token,
            owner: &request.owner,
            signed_key: &request.key,
            signature: &request.signature,
        }
    }
}

/// A grant refused before the high-water statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GrantRefusal {
    /// Not signed by the lock service; the reason as `guard_event.forged_reason` names it
    /// (`UNSIGNED`, `UNKNOWN_KEY_ID`, `BAD_SIGNATURE`).
    Forged { reason: &'static str },
    /// A genuine grant of another key than the account's.
    ForAnotherKey,
}

/// The evidence row of a grant refused before the high-water statement: FORGED_GRANT or
/// GRANT_FOR_ANOTHER_KEY, with the key and signing key id as presented, and the account's
/// high-water as it stands (0 and '' if it has none), which the refusal leaves unchanged. One
/// statement, and the only row the refusal writes.
pub(crate) async fn record_grant_refusal(
    pool: &PgPool,
    presented: &Presented<'_>,
    refusal: GrantRefusal,
) -> Result<(), StoreError> {
    let (kind, forged_reason) = match refusal {
        GrantRefusal::Forged { reason } => ("FORGED_GRANT", Some(reason)),
        GrantRefusal::ForAnotherKey => ("GRANT_FOR_ANOTHER_KEY", None),
    };
    sqlx::query(
        "INSERT INTO guard_event (kind, payout_id, account_id, lock_key, presented, stored, owner, stored_owner, operation, \
           signed_key, signing_key_id, forged_reason) \
         SELECT $1, $2, $3, $4, $5, COALESCE(hw.high_water, 0), $6, COALESCE(hw.owner, ''), $7, $8, $9, $10 \
         FROM (SELECT 1) AS one LEFT JOIN account_high_water hw ON hw.account_id = $3",
    )
    .bind(kind)
    .bind(presented.payout_id.as_str())
    .bind(presented.account_id.as_str())
    .bind(&presented.lock_key)
    .bind(presented.token.as_i64())
    .bind(presented.owner)
    .bind(presented.operation)
    .bind(presented.signed_key)
    .bind(&presented.signature.key_id)
    .bind(forged_reason)
    .execute(pool)
    .await?;
    Ok(())
}

// Who authorised a recorded intent: the accepted instruction's key id, signature and issue time
// (NULL for a submit accepted without one: only the negative control's).
fn instruction_key_id(request: &SubmitPayout) -> Option<&str> {
    request
        .instruction
        .as_ref()
        .map(|i| i.signature.key_id.as_str())
}

fn instruction_signature(request: &SubmitPayout) -> Option<&[u8]> {
    request
        .instruction
        .as_ref()
        .map(|i| i.signature.bytes.as_slice())
}

fn instruction_issued_at(request: &SubmitPayout) -> Option<i64> {
    request
        .instruction
        .as_ref()
        .map(|i| i.instruction.issued_at_unix_ms)
}

/// The evidence row of a refused instruction (proxydb 0009): why, which field, the key id and the
/// request as presented, and the account's high-water as it stands, which the refusal leaves
/// unchanged. One statement, and the only row the refusal writes.
pub(crate) async fn record_instruction_refusal(
    pool: &PgPool,
    request: &SubmitPayout,
    refused: &grant_signing::instruction::Refused,
) -> Result<(), StoreError> {
    let field = match refused.field() {
        "" => None,
        field => Some(field),
    };
    let signing_key_id = request
        .instruction
        .as_ref()
        .map(|i| i.signature.key_id.as_str())
        .unwrap_or_default();
    sqlx::query(
        "INSERT INTO instruction_refusal (payout_id, account_id, lock_key, presented, owner, reason, field, \
           signing_key_id, detail, amount_minor, currency, beneficiary_ref, stored, stored_owner) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, COALESCE(hw.high_water, 0), \
           COALESCE(hw.owner, '') \
         FROM (SELECT 1) AS one LEFT JOIN account_high_water hw ON hw.account_id = $2",
    )
    .bind(request.payout_id.as_str())
    .bind(request.account_id.as_str())
    .bind(&request.key)
    .bind(request.token.as_i64())
    .bind(&request.owner)
    .bind(refused.reason())
    .bind(field)
    .bind(signing_key_id)
    .bind(refused.to_string())
    .bind(request.amount_minor.get())
    .bind(request.currency.as_str())
    .bind(request.beneficiary_ref.as_str())
    .execute(pool)
    .await?;
    Ok(())
}

/// The evidence row of a refusal: FENCED (no `duplicate`), or DUPLICATE with its class.
async fn guard_event(
    tx: &mut Transaction<'_, Postgres>,
    kind: &str,
    duplicate: Option<DuplicateClass>,
    presented: &Presented<'_>,
    stored: i64,
    stored_owner: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO guard_event (kind, payout_id, account_id, lock_key, presented, stored, owner, stored_owner, operation, \
           duplicate) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(kind)
    .bind(presented.payout_id.as_str())
    .bind(presented.account_id.as_str())
    .bind(&presented.lock_key)
    .bind(presented.token.as_i64())
    .bind(stored)
    .bind(presented.owner)
    .bind(stored_owner)
    .bind(presented.operation)
    .bind(duplicate.map(DuplicateClass::name))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What the high-water statement did.
enum Advance {
    Advanced,
    /// The token is below the high-water: `(stored, stored_owner)`; a FENCED guard event written.
    Fenced(u64, String),
    /// The database does not admit the token; a DATABASE_RESTORED guard event written.
    Restored(Restored),
}

/// The condition every high-water advance carries (migration 0006): this database is the one its
/// incarnation row was armed in, not a restored copy whose high-waters are rewound, and the token
/// ($2) is not below the last re-arming's horizon. `restore_check` is false only for the negative
/// control.
fn admits_condition(restore_check: bool) -> &'static str {
    if restore_check {
        // `incarnation_admits($2)` (migration 0006) written out: a SQL function whose body has a
        // sub-select is never inlined and re-plans its body on every call, which cost this
        // statement about 40% of its throughput (pgbench: 5.3k/s with the function, 9.3k/s
        // without the condition, 8.4k/s written out). The function stays the definition the
        // diagnostics, the reconciler and `rearm_after_restore` use.
        "WHERE EXISTS (SELECT 1 FROM incarnation i \
           WHERE i.database_oid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()) \
             AND i.guarded_table = 'account_high_water'::regclass AND i.token_floor <= $2)"
    } else {
        ""
    }
}

/// Step 7's conditional high-water advance, the one statement both Submit and Inquire run first
/// in their transaction: equal passes, lower is refused (then a FENCED guard event is written),
/// and nothing passes a database that does not admit the token (then a DATABASE_RESTORED guard
/// event is written). The row lock it takes serialises the account.
async fn advance_high_water(
    tx: &mut Transaction<'_, Postgres>,
    presented: &Presented<'_>,
    restore_check: bool,
) -> Result<Advance, StoreError> {
    let advanced = sqlx::query(&format!(
        "INSERT INTO account_high_water (account_id, high_water, owner) SELECT $1, $2, $3 {} \
         ON CONFLICT (account_id) DO UPDATE \
           SET high_water = EXCLUDED.high_water, owner = EXCLUDED.owner, updated_at = now() \
           WHERE account_high_water.high_water <= EXCLUDED.high_water \
         RETURNING high_water",
        admits_condition(restore_check)
    ))
    .bind(presented.account_id.as_str())
    .bind(presented.token.as_i64())
    .bind(presented.owner)
    .fetch_optional(&mut **tx)
    .await?;
    if advanced.is_some() {
        return Ok(Advance::Advanced);
    }
    // The high-water as this copy holds it (0 and '' for an account it has none for).
    let row = sqlx::query(
        "SELECT hw.high_water, hw.owner FROM (SELECT 1) AS one \
         LEFT JOIN account_high_water hw ON hw.account_id = $1",
    )
    .bind(presented.account_id.as_str())
    .fetch_one(&mut **tx)
    .await?;
    let mut stored: i64 = row.try_get::<Option<i64>, _>("high_water")?.unwrap_or(0);
    let stored_owner: String = row
        .try_get::<Option<String>, _>("owner")?
        .unwrap_or_default();
    if restore_check {
        let restored = restored_refusal(tx, presented.token).await?;
        match restored {
            Some(restored) if !restored.incarnation_current => {
                guard_event(
                    tx,
                    "DATABASE_RESTORED",
                    None,
                    presented,
                    stored,
                    &stored_owner,
                )
                .await?;
                return Ok(Advance::Restored(restored));
            }
            // A token below the last re-arming's horizon is stale like one below the high-water:
            // every high-water was raised to that horizon (an account without a row yet has it
            // as its floor), and the holder re-acquires.
            Some(restored) => stored = stored.max(restored.token_floor as i64),
            None => {}
        }
    }
    // The conflicting row is locked by the statement above, so this read is the value that refused us.
    if presented.token.admitted_by(stored as u64) {
        return Err(invariant(format!(
            "high-water {stored} refused token {} that it admits",
            presented.token
        )));
    }
    guard_event(tx, "FENCED", None, presented, stored, &stored_owner).await?;
    Ok(Advance::Fenced(stored as u64, stored_owner))
}

/// Whether this database refuses `token` because it is a restored copy or the token is below the
/// last re-arming's horizon (`None`: it admits the token).
async fn restored_refusal(
    tx: &mut Transaction<'_, Postgres>,
    token: FencingToken,
) -> Result<Option<Restored>, StoreError> {
    let (admits, current, floor): (bool, bool, i64) = sqlx::query_as(
        "SELECT incarnation_admits($1), incarnation_is_current(), \
                coalesce((SELECT token_floor FROM incarnation), 0)",
    )
    .bind(token.as_i64())
    .fetch_one(&mut **tx)
    .await?;
    Ok((!admits).then_some(Restored {
        incarnation_current: current,
        token_floor: u64::try_from(floor).unwrap_or(0),
    }))
}

/// Steps 6-7 of the token's journey, in one transaction, before the rail is contacted:
/// the conditional high-water advance (equal passes, lower is refused), then the intent row,
/// unique per payout, with its expiry at the rail `valid_for_ms` after the intent (`None` only
/// for the negative control of the expiry, which writes none).
///
/// The common case (the token passes, the payout has no submission) is one statement, so one
/// round trip and one commit: the high-water advance and the intent are data-modifying parts of
/// the same statement, and the intent is inserted only from the advance's own row. When that
/// statement wrote nothing (the token was refused: nothing at all) or only the advance (the payout
/// already has a submission: the advance alone, which the transaction below makes again, equal
/// passing), the transaction below decides and records the FENCED or DUPLICATE guard event.
pub async fn record_intent(
    pool: &PgPool,
    request: &SubmitPayout,
    valid_for_ms: Option<u64>,
    restore_check: bool,
) -> Result<Intent, StoreError> {
    let valid_for_ms = valid_for_ms
        .map(|ms| i64::try_from(ms).map_err(invariant))
        .transpose()?;
    let fast = sqlx::query(&format!(
        "WITH hw AS ( \
           INSERT INTO account_high_water (account_id, high_water, owner) SELECT $1, $2, $3 {admits} \
           ON CONFLICT (account_id) DO UPDATE \
             SET high_water = EXCLUDED.high_water, owner = EXCLUDED.owner, updated_at = now() \
             WHERE account_high_water.high_water <= EXCLUDED.high_water \
           RETURNING high_water), \
         intent AS ( \
           INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, \
             amount_minor, currency, beneficiary_ref, valid_until, \
             instruction_key_id, instruction_signature, instruction_issued_at) \
           SELECT $4, $1, $2, $3, $5, $6, $7, $8, now() + $9 * interval '1 millisecond', \
             $10, $11, to_timestamp($12::double precision / 1000) FROM hw \
           ON CONFLICT DO NOTHING RETURNING {COLUMNS}) \
         SELECT * FROM intent",
        admits = admits_condition(restore_check)
    ))
    .bind(request.account_id.as_str())
    .bind(request.token.as_i64())
    .bind(&request.owner)
    .bind(request.payout_id.as_str())
    .bind(request.client_reference.as_str())
    .bind(request.amount_minor.get())
    .bind(request.currency.as_str())
    .bind(request.beneficiary_ref.as_str())
    .bind(valid_for_ms)
    .bind(instruction_key_id(request))
    .bind(instruction_signature(request))
    .bind(instruction_issued_at(request))
    .fetch_optional(pool)
    .await?;
    if let Some(row) = fast {
        return Ok(Intent::Recorded(submission_from_row(&row)?));
    }
    record_intent_or_refusal(pool, request, valid_for_ms, restore_check).await
}

/// The transaction that decides a Submit the single statement did not record: the advance again
/// (refused again: a high-water never goes down), then the intent or the existing submission,
/// with the guard event of a refusal.
async fn record_intent_or_refusal(
    pool: &PgPool,
    request: &SubmitPayout,
    valid_for_ms: Option<i64>,
    restore_check: bool,
) -> Result<Intent, StoreError> {
    let mut tx = pool.begin().await?;
    let presented = Presented::submit(request);
    match advance_high_water(&mut tx, &presented, restore_check).await? {
        Advance::Advanced => {}
        Advance::Fenced(stored, stored_owner) => {
            tx.commit().await?;
            return Ok(Intent::Fenced {
                stored,
                stored_owner,
            });
        }
        Advance::Restored(restored) => {
            tx.commit().await?;
            return Ok(Intent::Restored(restored));
        }
    }
    let inserted = sqlx::query(&format!(
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, \
           currency, beneficiary_ref, valid_until, instruction_key_id, instruction_signature, instruction_issued_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now() + $9 * interval '1 millisecond', \
           $10, $11, to_timestamp($12::double precision / 1000)) \
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
    .bind(valid_for_ms)
    .bind(instruction_key_id(request))
    .bind(instruction_signature(request))
    .bind(instruction_issued_at(request))
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
    let class = DuplicateClass::of(&existing, request);
    guard_event(
        &mut tx,
        "DUPLICATE",
        Some(class),
        &presented,
        existing.token.as_i64(),
        &existing.owner,
    )
    .await?;
    tx.commit().await?;
    Ok(Intent::Duplicate { existing, class })
}

/// The fenced inquiry's guard, in ONE transaction: the same conditional high-water advance as a
/// Submit, then, if the payout has no submission, the seal: a NOT_SENT row, born final, whose
/// `payout_id UNIQUE` makes every later Submit a DUPLICATE. `seal` is false only for the
/// negative control. The high-water row lock serialises this with every Submit of the account,
/// so a Submit either committed its intent before (the rail must be asked) or finds the seal.
pub async fn guard_inquiry(
    pool: &PgPool,
    request: &InquirePayout,
    seal: bool,
    restore_check: bool,
) -> Result<InquiryGuard, StoreError> {
    let mut tx = pool.begin().await?;
    let presented = Presented::inquire(request);
    match advance_high_water(&mut tx, &presented, restore_check).await? {
        Advance::Advanced => {}
        Advance::Fenced(stored, stored_owner) => {
            tx.commit().await?;
            return Ok(InquiryGuard::Fenced {
                stored,
                stored_owner,
            });
        }
        Advance::Restored(restored) => {
            tx.commit().await?;
            return Ok(InquiryGuard::Restored(restored));
        }
    }
    let now_unix_ms: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(&mut *tx)
        .await?;
    let existing = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM rail_submission WHERE payout_id = $1"
    ))
    .bind(request.payout_id.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(row) = existing {
        let submission = submission_from_row(&row)?;
        if submission.account_id != request.account_id {
            tx.rollback().await?;
            return Ok(InquiryGuard::OtherAccount {
                recorded: submission.account_id,
            });
        }
        tx.commit().await?;
        return Ok(if submission.is_sealed() {
            InquiryGuard::Sealed {
                submission,
                by_this_inquiry: false,
            }
        } else {
            InquiryGuard::Submitted {
                submission,
                now_unix_ms,
            }
        });
    }
    if !seal {
        tx.commit().await?;
        return Ok(InquiryGuard::Unsealed);
    }
    let client_reference = ClientReference::for_payout(&request.payout_id);
    let row = sqlx::query(&format!(
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, outcome, \
           sealed_by, resolved_at) VALUES ($1, $2, $3, $4, $5, 'NOT_SENT', $6, now()) RETURNING {COLUMNS}"
    ))
    .bind(request.payout_id.as_str())
    .bind(request.account_id.as_str())
    .bind(request.token.as_i64())
    .bind(&request.owner)
    .bind(client_reference.as_str())
    .bind(&request.asked_by)
    .fetch_one(&mut *tx)
    .await?;
    let sealed = submission_from_row(&row)?;
    tx.commit().await?;
    Ok(InquiryGuard::Sealed {
        submission: sealed,
        by_this_inquiry: true,
    })
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
        Outcome::NotSent { .. } => return Err(invariant("NOT_SENT is only ever born, never set")),
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
        "NEVER_SENT" => Evidence::NeverSent,
        other => return Err(invariant(format!("unknown evidence {other:?}"))),
    };
    Ok(Resolution {
        payout_id: payout_id.clone(),
        asked_by: row.try_get("asked_by")?,
        asked_at_unix_ms: row.try_get("asked_ms")?,
        evidence,
        account_id: None,
        signature: None,
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
        Evidence::Absent | Evidence::NeverSent => (vec![], String::new()),
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
