//! Validation of an `AppendJournalRequest` into a `ValidatedJournal`: everything that can be
//! decided without the database. The canonical payload hash is computed here from the validated
//! values, so two spellings of the same content ("12.30" and "12.3") hash the same.

use std::collections::{BTreeMap, HashSet};

use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use payout_proto::ledger as pb;
use rust_decimal::Decimal;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::amount::{self, AmountError};
use crate::error::LedgerError;

/// Account classes of spec 002 plus the three our payouts need.
pub const ACCOUNT_CLASSES: [&str; 10] = [
    "USER_AVAILABLE",
    "USER_FROZEN",
    "EXTERNAL_BLOCKCHAIN",
    "TREASURY",
    "MARKET_CLEARING",
    "IPG_CLEARING",
    "COMMISSION_REVENUE",
    "CUSTOMER_AVAILABLE",
    "PAYOUT_CLEARING",
    "FUNDING",
];

/// A journal larger than this is a bug on the sender's side, not a business need: the biggest
/// mapping in spec 002 (a market trade) has four lines per asset group.
pub const ENTRIES_PER_JOURNAL_MAX: usize = 64;
/// Bounds the stored size of free-form text and metadata.
pub const TEXT_LENGTH_MAX: usize = 512;
pub const METADATA_LENGTH_MAX: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccountKey {
    pub class: String,
    pub owner_type: String,
    pub owner_id: String,
    pub asset: String,
}

impl std::fmt::Display for AccountKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.class, self.owner_type, self.owner_id, self.asset
        )
    }
}

#[derive(Debug, Clone)]
pub struct ValidEntry {
    pub line_number: u32,
    pub account: AccountKey,
    pub amount: Decimal,
    pub description: String,
}

#[derive(Debug, Clone)]
pub struct ValidatedJournal {
    pub source_service: String,
    pub idempotency_key: String,
    pub source_transaction_id: String,
    pub tracking_code: String,
    pub effect_kind: String,
    pub effect_version: u32,
    pub occurred_at: DateTime<Utc>,
    pub correlation_id: String,
    pub actor_id: String,
    pub metadata: serde_json::Value,
    /// Sorted by line number.
    pub entries: Vec<ValidEntry>,
    pub reversal_of: Option<Uuid>,
    pub correction: Option<(String, String)>,
    /// The source's own order (`None`: not stated). Not content: outside the payload hash.
    pub source_sequence: Option<i64>,
    /// The rail's reference of a settled movement; empty = none.
    pub settlement_reference: String,
    /// The reference the movement was sent with; empty = none.
    pub client_reference: String,
    pub payload_hash: String,
}

pub fn valid_asset(asset: &str) -> bool {
    let b = asset.as_bytes();
    (3..=12).contains(&b.len())
        && b[0].is_ascii_uppercase()
        && b.iter()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
}

pub fn account_key(account: Option<&pb::AccountRef>, asset: &str) -> Option<AccountKey> {
    let a = account?;
    Some(AccountKey {
        class: a.class.clone(),
        owner_type: a.owner_type.clone(),
        owner_id: a.owner_id.clone(),
        asset: asset.to_string(),
    })
}

/// Required text: not blank, and [`bounded`].
pub fn required(value: &str, field: &'static str) -> Result<String, LedgerError> {
    if value.trim().is_empty() {
        return Err(LedgerError::MissingSourceIdentity { field });
    }
    bounded(value, field)
}

/// What every text the GL stores or looks up must be: at most [`TEXT_LENGTH_MAX`] bytes (keys
/// and index rows stay small), and without NUL, which PostgreSQL text cannot hold (the statement
/// would fail as a storage error instead of naming the field).
pub fn bounded(value: &str, field: &'static str) -> Result<String, LedgerError> {
    bounded_to(value, field, TEXT_LENGTH_MAX)
}

/// A rail's settlement reference as long as the payment resource may record one
/// (`payment_client::model::TEXT_LENGTH_MAX`): a posting must never be quarantined for a rail
/// reference the source accepted.
pub const SETTLEMENT_REFERENCE_LENGTH_MAX: usize = 1024;

/// [`bounded`] with another length bound.
pub fn bounded_to(value: &str, field: &'static str, max: usize) -> Result<String, LedgerError> {
    if value.len() > max {
        return Err(LedgerError::InvalidField {
            field,
            detail: format!("longer than {max} bytes"),
        });
    }
    if value.contains('\0') {
        return Err(LedgerError::InvalidField {
            field,
            detail: "contains a NUL character".into(),
        });
    }
    Ok(value.to_string())
}

/// The parts of an account reference, as [`bounded`] text (field `account`).
pub fn check_account_text(account: Option<&pb::AccountRef>) -> Result<(), LedgerError> {
    if let Some(a) = account {
        for part in [&a.class, &a.owner_type, &a.owner_id] {
            bounded(part, "account")?;
        }
    }
    Ok(())
}

/// A `uint32` the GL stores in an `integer` column (versions, line numbers): at most `i32::MAX`.
pub fn storable_u32(value: u32, field: &'static str) -> Result<i32, LedgerError> {
    i32::try_from(value).map_err(|_| LedgerError::InvalidField {
        field,
        detail: format!("{value} is above {}", i32::MAX),
    })
}

/// A source's order position on the wire (`uint64`, 0 = not stated) as the GL stores it
/// (`bigint`, positive): at most `i64::MAX`.
pub fn source_sequence(value: u64) -> Result<Option<i64>, LedgerError> {
    match value {
        0 => Ok(None),
        v => i64::try_from(v)
            .map(Some)
            .map_err(|_| LedgerError::InvalidField {
                field: "source_sequence",
                detail: format!("{v} is above {}", i64::MAX),
            }),
    }
}

pub fn parse_time(value: &str, field: &'static str) -> Result<DateTime<Utc>, LedgerError> {
    DateTime::parse_from_rfc3339(value)
        .map(|t| t.with_timezone(&Utc).trunc_subsecs(6))
        .map_err(|e| LedgerError::InvalidField {
            field,
            detail: format!("{value:?} is not RFC 3339: {e}"),
        })
}

pub fn format_time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Parses metadata text into a JSON object (empty text = `{}`).
pub fn parse_metadata(text: &str) -> Result<serde_json::Value, LedgerError> {
    if text.len() > METADATA_LENGTH_MAX {
        return Err(LedgerError::InvalidField {
            field: "metadata_json",
            detail: "too long".into(),
        });
    }
    if text.trim().is_empty() {
        return Ok(serde_json::Value::Object(Default::default()));
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v) if holds_nul(&v) => Err(LedgerError::InvalidField {
            field: "metadata_json",
            detail: "a string or key contains NUL (\\u0000), which jsonb cannot hold".into(),
        }),
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        Ok(_) => Err(LedgerError::InvalidField {
            field: "metadata_json",
            detail: "not a JSON object".into(),
        }),
        Err(e) => Err(LedgerError::InvalidField {
            field: "metadata_json",
            detail: e.to_string(),
        }),
    }
}

fn holds_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(text) => text.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// JSON with object keys sorted at every level, independent of serde_json's map feature flags.
pub fn canonical_json(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            let fields: Vec<String> = sorted
                .into_iter()
                .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), canonical_json(v)))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(canonical_json)
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}

pub fn validate(req: &pb::AppendJournalRequest) -> Result<ValidatedJournal, LedgerError> {
    let source_service = required(&req.source_service, "source_service")?;
    let idempotency_key = required(&req.idempotency_key, "idempotency_key")?;
    let source_transaction_id = required(&req.source_transaction_id, "source_transaction_id")?;
    let effect_kind = required(&req.effect_kind, "effect_kind")?;
    if req.effect_version == 0 {
        return Err(LedgerError::MissingSourceIdentity {
            field: "effect_version",
        });
    }
    storable_u32(req.effect_version, "effect_version")?;
    let tracking_code = bounded(&req.tracking_code, "tracking_code")?;
    if req.occurred_at.is_empty() {
        return Err(LedgerError::InvalidField {
            field: "occurred_at",
            detail: "missing".into(),
        });
    }
    let occurred_at = parse_time(&req.occurred_at, "occurred_at")?;
    if req.correlation_id.trim().is_empty() {
        return Err(LedgerError::InvalidField {
            field: "correlation_id",
            detail: "missing".into(),
        });
    }
    if req.actor_id.trim().is_empty() {
        return Err(LedgerError::InvalidField {
            field: "actor_id",
            detail: "missing".into(),
        });
    }
    let correlation_id = bounded(&req.correlation_id, "correlation_id")?;
    let actor_id = bounded(&req.actor_id, "actor_id")?;
    let metadata = parse_metadata(&req.metadata_json)?;
    let reversal_of = match req.reversal_of.as_str() {
        "" => None,
        text => Some(
            Uuid::parse_str(text).map_err(|_| LedgerError::ReversalTargetUnknown {
                target: text.into(),
            })?,
        ),
    };
    let correction = match &req.correction {
        None => None,
        Some(c) if c.approved_by.trim().is_empty() || c.approval_reference.trim().is_empty() => {
            return Err(LedgerError::InvalidField {
                field: "correction",
                detail: "an approval needs approved_by and approval_reference".into(),
            })
        }
        Some(c) => Some((
            bounded(&c.approved_by, "correction")?,
            bounded(&c.approval_reference, "correction")?,
        )),
    };

    let source_sequence = source_sequence(req.source_sequence)?;
    let settlement_reference = bounded_to(
        &req.settlement_reference,
        "settlement_reference",
        SETTLEMENT_REFERENCE_LENGTH_MAX,
    )?;
    let client_reference = bounded(&req.client_reference, "client_reference")?;

    if req.entries.is_empty() {
        return Err(LedgerError::EmptyJournal);
    }
    if req.entries.len() > ENTRIES_PER_JOURNAL_MAX {
        return Err(LedgerError::InvalidField {
            field: "entries",
            detail: format!("more than {ENTRIES_PER_JOURNAL_MAX}"),
        });
    }
    let mut seen = HashSet::new();
    let mut entries = Vec::with_capacity(req.entries.len());
    for e in &req.entries {
        let line_number = e.line_number;
        if line_number == 0 {
            return Err(LedgerError::InvalidField {
                field: "line_number",
                detail: "line numbers start at 1".into(),
            });
        }
        storable_u32(line_number, "line_number")?;
        if !seen.insert(line_number) {
            return Err(LedgerError::DuplicateLineNumber { line_number });
        }
        if !valid_asset(&e.asset) {
            return Err(LedgerError::InvalidField {
                field: "asset",
                detail: format!("{:?}", e.asset),
            });
        }
        check_account_text(e.account.as_ref())?;
        let account = match account_key(e.account.as_ref(), &e.asset) {
            Some(k)
                if ACCOUNT_CLASSES.contains(&k.class.as_str())
                    && !k.owner_type.is_empty()
                    && !k.owner_id.is_empty() =>
            {
                k
            }
            other => {
                return Err(LedgerError::UnknownAccount {
                    line_number,
                    account: other
                        .map(|k| k.to_string())
                        .unwrap_or_else(|| "(none)".into()),
                })
            }
        };
        let amount = amount::parse_canonical(&e.amount).map_err(|err| match err {
            AmountError::NonCanonical => LedgerError::NonCanonicalAmount {
                line_number,
                amount: e.amount.clone(),
            },
            AmountError::PrecisionExceeded => LedgerError::PrecisionExceeded { line_number },
            AmountError::OutOfRange => LedgerError::AmountOutOfRange { line_number },
            AmountError::Zero => LedgerError::ZeroAmount { line_number },
        })?;
        let description = bounded(&e.description, "description")?;
        entries.push(ValidEntry {
            line_number,
            account,
            amount,
            description,
        });
    }
    entries.sort_by_key(|e| e.line_number);

    let mut sums: BTreeMap<&str, Decimal> = BTreeMap::new();
    for e in &entries {
        let sum = sums.entry(e.account.asset.as_str()).or_default();
        *sum = sum
            .checked_add(e.amount)
            .ok_or(LedgerError::AmountOutOfRange {
                line_number: e.line_number,
            })?;
    }
    if let Some((asset, sum)) = sums.iter().find(|(_, s)| !s.is_zero()) {
        return Err(LedgerError::Unbalanced {
            asset: asset.to_string(),
            sum: amount::format(*sum),
        });
    }

    let mut journal = ValidatedJournal {
        source_service,
        idempotency_key,
        source_transaction_id,
        tracking_code,
        effect_kind,
        effect_version: req.effect_version,
        occurred_at,
        correlation_id,
        actor_id,
        metadata,
        entries,
        reversal_of,
        correction,
        source_sequence,
        settlement_reference,
        client_reference,
        payload_hash: String::new(),
    };
    journal.payload_hash = payload_hash(&journal);
    Ok(journal)
}

/// A lifecycle event (spec 002 `transaction_events`), validated: non-monetary history, keyed by
/// (source_service, source_transaction_id, event_version).
#[derive(Debug, Clone)]
pub struct ValidatedEvent {
    pub source_service: String,
    pub source_transaction_id: String,
    pub event_type: String,
    pub event_version: i32,
    pub occurred_at: DateTime<Utc>,
    pub correlation_id: String,
    pub actor_id: String,
    pub metadata: serde_json::Value,
    /// The source's own order (`None`: not stated). Not content: outside the payload hash.
    pub source_sequence: Option<i64>,
    /// Of what the event says (type, time, correlation, actor, metadata); the key is its identity.
    pub payload_hash: String,
}

pub fn validate_event(
    r: &pb::AppendTransactionEventRequest,
) -> Result<ValidatedEvent, LedgerError> {
    let source_service = required(&r.source_service, "source_service")?;
    let source_transaction_id = required(&r.source_transaction_id, "source_transaction_id")?;
    let event_type = required(&r.event_type, "event_type")?;
    let correlation_id = bounded(&r.correlation_id, "correlation_id")?;
    let actor_id = bounded(&r.actor_id, "actor_id")?;
    if r.event_version == 0 {
        return Err(LedgerError::MissingSourceIdentity {
            field: "event_version",
        });
    }
    let event_version = storable_u32(r.event_version, "event_version")?;
    let occurred_at = parse_time(&r.occurred_at, "occurred_at")?;
    let metadata = parse_metadata(&r.metadata_json)?;
    let source_sequence = source_sequence(r.source_sequence)?;
    let canonical = serde_json::json!({
        "event_type": event_type, "occurred_at": format_time(occurred_at), "correlation_id": correlation_id,
        "actor_id": actor_id, "metadata": metadata,
    });
    let payload_hash = hex::encode(Sha256::digest(canonical_json(&canonical).as_bytes()));
    Ok(ValidatedEvent {
        source_service,
        source_transaction_id,
        event_type,
        event_version,
        occurred_at,
        correlation_id,
        actor_id,
        metadata,
        source_sequence,
        payload_hash,
    })
}

/// SHA-256 of the canonical JSON of every field that makes up the journal's content.
///
/// The settlement references are content, but they came after journals were first hashed: each
/// is hashed only when it is not empty, so a journal without them (every journal before they
/// existed, and every opening) keeps the hash it always had, and a sender that adds one to a key
/// already recorded without it is told IDEMPOTENCY_CONFLICT. The source sequence is never hashed:
/// it is where the sender's record sits in its own order, not what the journal says.
pub fn payload_hash(j: &ValidatedJournal) -> String {
    let entries: Vec<serde_json::Value> = j
        .entries
        .iter()
        .map(|e| {
            serde_json::json!({
                "line_number": e.line_number,
                "class": e.account.class,
                "owner_type": e.account.owner_type,
                "owner_id": e.account.owner_id,
                "asset": e.account.asset,
                "amount": amount::format(e.amount),
                "description": e.description,
            })
        })
        .collect();
    let mut canonical = serde_json::json!({
        "source_service": j.source_service,
        "idempotency_key": j.idempotency_key,
        "source_transaction_id": j.source_transaction_id,
        "tracking_code": j.tracking_code,
        "effect_kind": j.effect_kind,
        "effect_version": j.effect_version,
        "occurred_at": format_time(j.occurred_at),
        "correlation_id": j.correlation_id,
        "actor_id": j.actor_id,
        "metadata": j.metadata,
        "entries": entries,
        "reversal_of": j.reversal_of.map(|u| u.to_string()),
        "correction": j.correction.as_ref().map(|(by, reference)| serde_json::json!({"approved_by": by, "approval_reference": reference})),
    });
    for (field, value) in [
        ("settlement_reference", &j.settlement_reference),
        ("client_reference", &j.client_reference),
    ] {
        if !value.is_empty() {
            canonical[field] = serde_json::Value::String(value.clone());
        }
    }
    hex::encode(Sha256::digest(canonical_json(&canonical).as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> pb::AppendJournalRequest {
        pb::AppendJournalRequest {
            source_service: "payment-resource".into(),
            idempotency_key: "k1".into(),
            source_transaction_id: "t1".into(),
            tracking_code: "c".into(),
            effect_kind: "PAYOUT_POSTED".into(),
            effect_version: 1,
            occurred_at: "2026-01-01T00:00:00Z".into(),
            correlation_id: "corr".into(),
            actor_id: "actor".into(),
            metadata_json: r#"{"b":1,"a":{"y":2,"x":null}}"#.into(),
            entries: vec![
                pb::EntryInput {
                    line_number: 1,
                    account: Some(pb::AccountRef {
                        class: "CUSTOMER_AVAILABLE".into(),
                        owner_type: "ACCOUNT".into(),
                        owner_id: "a".into(),
                    }),
                    asset: "EUR".into(),
                    amount: "-12.30".into(),
                    description: String::new(),
                },
                pb::EntryInput {
                    line_number: 2,
                    account: Some(pb::AccountRef {
                        class: "PAYOUT_CLEARING".into(),
                        owner_type: "SYSTEM".into(),
                        owner_id: "rail".into(),
                    }),
                    asset: "EUR".into(),
                    amount: "12.3".into(),
                    description: String::new(),
                },
            ],
            reversal_of: String::new(),
            correction: None,
            source_sequence: 0,
            settlement_reference: String::new(),
            client_reference: String::new(),
        }
    }

    #[test]
    fn hash_ignores_spelling_and_key_order_but_not_content() {
        let a = validate(&request()).unwrap();
        let mut r = request();
        r.entries[0].amount = "-12.3".into();
        r.metadata_json = r#"{"a":{"x":null,"y":2},"b":1}"#.into();
        r.occurred_at = "2026-01-01T01:00:00+01:00".into();
        assert_eq!(a.payload_hash, validate(&r).unwrap().payload_hash);
        r.tracking_code = "other".into();
        assert_ne!(a.payload_hash, validate(&r).unwrap().payload_hash);
    }

    /// A request without the fields added by gldb 0003 hashes exactly as before they existed:
    /// the hash below is the SHA-256 of this canonical JSON, the shape `payload_hash` had then,
    /// so a journal recorded before them still replays (and does not conflict with its retry).
    #[test]
    fn a_journal_without_the_new_fields_keeps_the_hash_it_always_had() {
        const CANONICAL_BEFORE_0003: &str = r#"{"actor_id":"actor","correction":null,"correlation_id":"corr","effect_kind":"PAYOUT_POSTED","effect_version":1,"entries":[{"amount":"-12.3","asset":"EUR","class":"CUSTOMER_AVAILABLE","description":"","line_number":1,"owner_id":"a","owner_type":"ACCOUNT"},{"amount":"12.3","asset":"EUR","class":"PAYOUT_CLEARING","description":"","line_number":2,"owner_id":"rail","owner_type":"SYSTEM"}],"idempotency_key":"k1","metadata":{"a":{"x":null,"y":2},"b":1},"occurred_at":"2026-01-01T00:00:00.000000Z","reversal_of":null,"source_service":"payment-resource","source_transaction_id":"t1","tracking_code":"c"}"#;
        let before = hex::encode(Sha256::digest(CANONICAL_BEFORE_0003.as_bytes()));
        assert_eq!(
            before,
            "9de106837b506e81209f800fbd22a5cad98c08cddf7cf6d2f4a47331773a424a"
        );
        let old_shape = validate(&request()).unwrap();
        assert_eq!(old_shape.payload_hash, before);
        assert_eq!(old_shape.source_sequence, None);

        // The source's order is delivery metadata: any position, the same hash.
        let mut r = request();
        r.source_sequence = 42;
        let positioned = validate(&r).unwrap();
        assert_eq!(positioned.source_sequence, Some(42));
        assert_eq!(positioned.payload_hash, before);

        // A settlement reference is content: it changes the hash, each one on its own.
        let mut r = request();
        r.settlement_reference = "rail-1".into();
        let settled = validate(&r).unwrap().payload_hash;
        assert_ne!(settled, before);
        r.client_reference = "cref-1".into();
        let both = validate(&r).unwrap().payload_hash;
        assert_ne!(both, settled);
        let mut r = request();
        r.client_reference = "cref-1".into();
        assert_ne!(validate(&r).unwrap().payload_hash, before);
        assert_ne!(validate(&r).unwrap().payload_hash, both);
    }

    #[test]
    fn the_new_fields_are_bounded_like_the_others() {
        let mut r = request();
        r.source_sequence = i64::MAX as u64 + 1;
        assert!(matches!(
            validate(&r),
            Err(LedgerError::InvalidField {
                field: "source_sequence",
                ..
            })
        ));
        r.source_sequence = i64::MAX as u64;
        assert_eq!(validate(&r).unwrap().source_sequence, Some(i64::MAX));
        let mut r = request();
        r.settlement_reference = "x".repeat(SETTLEMENT_REFERENCE_LENGTH_MAX);
        assert!(validate(&r).is_ok(), "as long as the source may record one");
        r.settlement_reference = "x".repeat(SETTLEMENT_REFERENCE_LENGTH_MAX + 1);
        assert!(matches!(
            validate(&r),
            Err(LedgerError::InvalidField {
                field: "settlement_reference",
                ..
            })
        ));
        let mut r = request();
        r.client_reference = "a\0b".into();
        assert!(matches!(
            validate(&r),
            Err(LedgerError::InvalidField {
                field: "client_reference",
                ..
            })
        ));
    }
}
