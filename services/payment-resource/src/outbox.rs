//! The GL payloads written to `ledger_outbox` (spec 002 "Delivery and ordering", with this
//! service in the role that document calls Wallet). Built here, in one place, from the same values
//! the ledger rows and the payout are written from. The dispatcher (issue 6) delivers them
//! unchanged, each according to its row's kind ([`OutboxKind`]): a JOURNAL is a monetary effect
//! (an opening, a posting) for `AppendJournal`; a TRANSACTION_EVENT is one step of a payout's
//! lifecycle for `AppendTransactionEvent`, which creates no monetary entry (spec 002: "Pending and
//! failed lifecycle events may be retained as audit events but do not create monetary entries").

use chrono::{DateTime, SecondsFormat, Utc};
use payment_client::model::Payout;
use payout_domain::{
    AccountId, ClientReference, Currency, FencingToken, PayoutEvent, PayoutId, PayoutState,
};
use serde_json::{json, Value};
use uuid::Uuid;

/// Namespace of the transaction group ids (uuid v5 of the idempotency key): a group id is derived
/// from the movement, so a repeated posting of one movement can never mint a second group.
pub const TRANSACTION_GROUP_NAMESPACE: Uuid =
    Uuid::from_u128(0x6f1c_2a1e_8d4b_4c1f_9b0e_7a52_d1e3_c0a4);

pub const SOURCE_SERVICE: &str = "payment-resource";
/// Actor of fixture-loaded opening balances (no grant: accounts are created out of band).
pub const FIXTURE_ACTOR: &str = "fixture";
/// Actor of a payout's creation (no grant: a payout is created before anyone holds its account),
/// as its audit row names it.
pub const CREATOR_ACTOR: &str = "CREATOR";

/// What an outbox row is, and so which GL call delivers it (paydb 0008's `ledger_outbox.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxKind {
    /// A monetary effect: `AppendJournal`.
    Journal,
    /// A lifecycle step: `AppendTransactionEvent`, no monetary entry.
    TransactionEvent,
}

impl OutboxKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxKind::Journal => "JOURNAL",
            OutboxKind::TransactionEvent => "TRANSACTION_EVENT",
        }
    }
}

/// The name of a payout's creation in the GL's lifecycle history (version 1).
pub const PAYOUT_CREATED: &str = "PAYOUT_CREATED";

/// Every row of the 2.3 table (`payout_domain::TRANSITIONS`) as the lifecycle step the GL
/// records: (from, event, to) -> event type. The one place a transition gets its name; a
/// RAIL_AMBIGUOUS payout settled by evidence (either way) is RESOLVED, and a re-claim by a later
/// holder is CLAIMED again (its metadata says from CLAIMED).
pub const LIFECYCLE_EVENTS: [(PayoutState, PayoutEvent, PayoutState, &str); 13] = {
    use PayoutEvent as E;
    use PayoutState as S;
    [
        (S::Pending, E::Claim, S::Claimed, "PAYOUT_CLAIMED"),
        (S::Pending, E::FundsInsufficient, S::Failed, "PAYOUT_FAILED"),
        (
            S::Pending,
            E::OperatorAbandon,
            S::Abandoned,
            "PAYOUT_ABANDONED",
        ),
        (S::Claimed, E::Claim, S::Claimed, "PAYOUT_CLAIMED"),
        (
            S::Claimed,
            E::SubmissionAccepted,
            S::RailSubmitted,
            "PAYOUT_SUBMITTED",
        ),
        (
            S::RailSubmitted,
            E::RailAcked,
            S::RailAcked,
            "PAYOUT_ACKNOWLEDGED",
        ),
        (
            S::RailSubmitted,
            E::RailDeclined,
            S::Failed,
            "PAYOUT_FAILED",
        ),
        (
            S::RailSubmitted,
            E::RailTimeout,
            S::RailAmbiguous,
            "PAYOUT_AMBIGUOUS",
        ),
        (
            S::RailSubmitted,
            E::OutcomeMissing,
            S::RailAmbiguous,
            "PAYOUT_AMBIGUOUS",
        ),
        (S::RailAcked, E::Posted, S::Posted, "PAYOUT_POSTED"),
        (
            S::RailAmbiguous,
            E::EvidenceFound,
            S::RailAcked,
            "PAYOUT_RESOLVED",
        ),
        (
            S::RailAmbiguous,
            E::EvidenceAbsent,
            S::Failed,
            "PAYOUT_RESOLVED",
        ),
        (
            S::RailAmbiguous,
            E::OperatorAbandon,
            S::Abandoned,
            "PAYOUT_ABANDONED",
        ),
    ]
};

/// The lifecycle step of a transition, or `None` for a triple the table does not list (which
/// the state machine never performs).
pub fn lifecycle_event_type(
    from: PayoutState,
    event: PayoutEvent,
    to: PayoutState,
) -> Option<&'static str> {
    LIFECYCLE_EVENTS
        .iter()
        .find(|(f, e, t, _)| (*f, *e, *t) == (from, event, to))
        .map(|(_, _, _, name)| *name)
}

/// A payout's lifecycle event `n`: n = 1 is its creation, n = k + 1 its k-th transition (the
/// payout's `version` after the change, plus one). Unique and increasing per payout, since every
/// transition holds the payout's row lock.
pub fn payout_event_key(payout: &PayoutId, event_version: i64) -> String {
    payout.lifecycle_event_key(event_version)
}

pub fn payout_posting_key(payout: &PayoutId) -> String {
    format!("payment-resource:payout:{}:posting:v1", payout.as_str())
}

pub fn account_opening_key(account: &AccountId) -> String {
    format!("payment-resource:account:{}:opening:v1", account.as_str())
}

pub fn transaction_group(idempotency_key: &str) -> Uuid {
    Uuid::new_v5(&TRANSACTION_GROUP_NAMESPACE, idempotency_key.as_bytes())
}

/// Ids of the system accounts in ledger_entry's account namespace.
pub fn payout_clearing_account(currency: &Currency) -> String {
    format!("sys:payout-clearing:{}", currency.as_str())
}
pub fn funding_account(currency: &Currency) -> String {
    format!("sys:funding:{}", currency.as_str())
}

pub fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The values a payout posting is written from.
pub struct PayoutPosting<'a> {
    pub payout_id: &'a PayoutId,
    pub account_id: &'a AccountId,
    pub beneficiary_ref: &'a str,
    pub currency: &'a Currency,
    pub amount_minor: i64,
    pub owner: &'a str,
    pub token: FencingToken,
    pub transaction_group: Uuid,
    pub occurred_at: DateTime<Utc>,
    /// The rail's reference of the movement (RAIL_ACKED's, or the evidence's).
    pub rail_ref: Option<&'a str>,
}

pub fn payout_posting_payload(p: &PayoutPosting<'_>) -> Value {
    let client_reference = ClientReference::for_payout(p.payout_id);
    let key = payout_posting_key(p.payout_id);
    let asset = p.currency.as_str();
    json!({
        "source_service": SOURCE_SERVICE,
        "idempotency_key": key,
        "source_transaction_id": p.payout_id.as_str(),
        "tracking_code": client_reference.as_str(),
        // First-class in the GL (gldb 0003): what the rail settled it as, what it was sent as.
        "settlement_reference": p.rail_ref.unwrap_or_default(),
        "client_reference": client_reference.as_str(),
        "effect_kind": "PAYOUT_POSTED",
        "effect_version": 1,
        "occurred_at": rfc3339(p.occurred_at),
        "correlation_id": p.payout_id.as_str(),
        "actor_id": p.owner,
        "metadata": {
            "fencing_token": p.token.get(),
            "transaction_group": p.transaction_group.to_string(),
            "account_id": p.account_id.as_str(),
            "payout_id": p.payout_id.as_str(),
        },
        "entries": [
            {
                "line_number": 1,
                "account": {"class": "CUSTOMER_AVAILABLE", "owner_type": "ACCOUNT", "owner_id": p.account_id.as_str()},
                "asset": asset,
                "amount": p.currency.major_decimal_string(-p.amount_minor),
                "description": format!("payout {} to beneficiary {}", p.payout_id, p.beneficiary_ref),
            },
            {
                "line_number": 2,
                "account": {"class": "PAYOUT_CLEARING", "owner_type": "SYSTEM", "owner_id": "rail"},
                "asset": asset,
                "amount": p.currency.major_decimal_string(p.amount_minor),
                "description": format!("payout {} to the rail", p.payout_id),
            },
        ],
    })
}

/// One step of a payout's lifecycle, as the transaction that made it knows it.
pub struct PayoutLifecycle<'a> {
    /// The payout after the step.
    pub payout: &'a Payout,
    /// `None` for the creation.
    pub transition: Option<(PayoutState, PayoutEvent)>,
    /// [`payout_event_key`]'s n.
    pub event_version: i64,
    /// Who acted: the grant's owner, the verified operator of an abandon, [`CREATOR_ACTOR`].
    pub actor_id: &'a str,
    /// The table's actor of the row (HOLDER, RESOLVER, OPERATOR), or [`CREATOR_ACTOR`].
    pub actor_role: &'a str,
    /// The grant the step was made under (none at creation).
    pub owner: Option<&'a str>,
    pub token: Option<FencingToken>,
    pub occurred_at: DateTime<Utc>,
}

/// The `AppendTransactionEvent` payload of a lifecycle step (kind TRANSACTION_EVENT). Its
/// identity in the GL is (source service, payout id, event version); `idempotency_key` is the
/// outbox row's, which the dispatcher checks against the row.
pub fn payout_event_payload(e: &PayoutLifecycle<'_>) -> Result<Value, String> {
    let p = e.payout;
    let (from, event, event_type) = match e.transition {
        None => (None, None, PAYOUT_CREATED),
        Some((from, event)) => (
            Some(from.as_str()),
            Some(event.as_str()),
            lifecycle_event_type(from, event, p.state).ok_or_else(|| {
                format!(
                    "no lifecycle event for {from} --{}--> {}",
                    event.as_str(),
                    p.state
                )
            })?,
        ),
    };
    Ok(json!({
        "source_service": SOURCE_SERVICE,
        "idempotency_key": payout_event_key(&p.payout_id, e.event_version),
        "source_transaction_id": p.payout_id.as_str(),
        "event_type": event_type,
        "event_version": e.event_version,
        "occurred_at": rfc3339(e.occurred_at),
        "correlation_id": p.payout_id.as_str(),
        "actor_id": e.actor_id,
        "metadata": {
            "from_state": from,
            "to_state": p.state.as_str(),
            "transition_event": event,
            "actor": e.actor_role,
            "owner": e.owner,
            "fencing_token": e.token.map(|t| t.get()),
            "account_id": p.account_id.as_str(),
            "payout_id": p.payout_id.as_str(),
            "amount_minor": p.amount_minor,
            "amount": p.currency.major_decimal_string(p.amount_minor),
            "currency": p.currency.as_str(),
            "beneficiary_ref": p.beneficiary_ref,
            "client_reference": p.client_reference,
            "rail_ref": p.rail_ref,
            "rail_outcome": p.rail_outcome,
            "failure_reason": p.failure_reason,
        },
    }))
}

pub fn account_opening_payload(
    account_id: &AccountId,
    currency: &Currency,
    opening_balance_minor: i64,
    transaction_group: Uuid,
    occurred_at: DateTime<Utc>,
) -> Value {
    let asset = currency.as_str();
    json!({
        "source_service": SOURCE_SERVICE,
        "idempotency_key": account_opening_key(account_id),
        "source_transaction_id": account_id.as_str(),
        "tracking_code": "",
        "effect_kind": "ACCOUNT_OPENED",
        "effect_version": 1,
        "occurred_at": rfc3339(occurred_at),
        "correlation_id": account_id.as_str(),
        "actor_id": FIXTURE_ACTOR,
        "metadata": {
            "fencing_token": null,
            "transaction_group": transaction_group.to_string(),
            "account_id": account_id.as_str(),
            "payout_id": null,
        },
        "entries": [
            {
                "line_number": 1,
                "account": {"class": "CUSTOMER_AVAILABLE", "owner_type": "ACCOUNT", "owner_id": account_id.as_str()},
                "asset": asset,
                "amount": currency.major_decimal_string(opening_balance_minor),
                "description": format!("opening balance of account {account_id}"),
            },
            {
                "line_number": 2,
                "account": {"class": "FUNDING", "owner_type": "SYSTEM", "owner_id": "treasury"},
                "asset": asset,
                "amount": currency.major_decimal_string(-opening_balance_minor),
                "description": format!("funding of account {account_id}"),
            },
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posting_payload_has_the_agreed_shape() {
        let payout = PayoutId::parse("p-1").unwrap();
        let account = AccountId::parse("acct-1").unwrap();
        let eur = Currency::parse("EUR").unwrap();
        let group = transaction_group(&payout_posting_key(&payout));
        let at = DateTime::parse_from_rfc3339("2026-01-02T03:04:05Z")
            .unwrap()
            .with_timezone(&Utc);
        let v = payout_posting_payload(&PayoutPosting {
            payout_id: &payout,
            account_id: &account,
            beneficiary_ref: "ben-1",
            currency: &eur,
            amount_minor: 1234,
            owner: "worker-a",
            token: FencingToken::new(42).unwrap(),
            transaction_group: group,
            occurred_at: at,
            rail_ref: Some("rail-9"),
        });
        assert_eq!(
            v["idempotency_key"],
            "payment-resource:payout:p-1:posting:v1"
        );
        assert_eq!(v["tracking_code"], "cref-p-1");
        assert_eq!(v["settlement_reference"], "rail-9");
        assert_eq!(v["client_reference"], "cref-p-1");
        assert_eq!(v["occurred_at"], "2026-01-02T03:04:05.000000Z");
        assert_eq!(v["metadata"]["fencing_token"], 42);
        assert_eq!(v["entries"][0]["amount"], "-12.34");
        assert_eq!(v["entries"][1]["amount"], "12.34");
        assert_eq!(v["entries"][1]["account"]["class"], "PAYOUT_CLEARING");
        assert_eq!(v["effect_version"], 1);
    }

    #[test]
    fn opening_payload_credits_the_customer_against_funding() {
        let account = AccountId::parse("acct-1").unwrap();
        let eur = Currency::parse("EUR").unwrap();
        let group = transaction_group(&account_opening_key(&account));
        let v = account_opening_payload(&account, &eur, 100_000, group, Utc::now());
        assert_eq!(
            v["idempotency_key"],
            "payment-resource:account:acct-1:opening:v1"
        );
        assert_eq!(v["entries"][0]["amount"], "1000.00");
        assert_eq!(v["entries"][1]["amount"], "-1000.00");
        assert_eq!(v["entries"][1]["account"]["owner_id"], "treasury");
        assert!(v["metadata"]["fencing_token"].is_null());
        assert!(v["metadata"]["payout_id"].is_null());
    }

    /// Every row of the 2.3 table has its lifecycle name, from the one table, and the table
    /// names nothing the state machine does not do: a new row of `TRANSITIONS` without a name
    /// fails here before it could write an event the GL is not told the meaning of.
    #[test]
    fn every_transition_of_the_table_has_a_lifecycle_event() {
        for t in payout_domain::TRANSITIONS {
            let name = lifecycle_event_type(t.from, t.event, t.to)
                .unwrap_or_else(|| panic!("{t:?} has no lifecycle event"));
            assert!(name.starts_with("PAYOUT_"), "{name}");
        }
        for (from, event, to, name) in LIFECYCLE_EVENTS {
            assert!(
                payout_domain::TRANSITIONS
                    .iter()
                    .any(|t| (t.from, t.event, t.to) == (from, event, to)),
                "{name}: ({from}, {event:?}, {to}) is not a row of the table"
            );
        }
        assert_eq!(LIFECYCLE_EVENTS.len(), payout_domain::TRANSITIONS.len());
        // The steps the issue names, each reached by some row.
        let named: std::collections::BTreeSet<&str> =
            LIFECYCLE_EVENTS.iter().map(|(_, _, _, n)| *n).collect();
        for step in [
            "PAYOUT_CLAIMED",
            "PAYOUT_SUBMITTED",
            "PAYOUT_ACKNOWLEDGED",
            "PAYOUT_AMBIGUOUS",
            "PAYOUT_RESOLVED",
            "PAYOUT_FAILED",
            "PAYOUT_ABANDONED",
            "PAYOUT_POSTED",
        ] {
            assert!(named.contains(step), "{step}");
        }
        assert!(!named.contains(PAYOUT_CREATED), "creation is no transition");
        use payout_domain::{PayoutEvent as E, PayoutState as S};
        assert_eq!(
            lifecycle_event_type(S::RailAmbiguous, E::EvidenceFound, S::RailAcked),
            Some("PAYOUT_RESOLVED")
        );
        assert_eq!(
            lifecycle_event_type(S::RailAmbiguous, E::EvidenceAbsent, S::Failed),
            Some("PAYOUT_RESOLVED")
        );
        assert_eq!(
            lifecycle_event_type(S::Pending, E::Posted, S::Posted),
            None,
            "a triple the table does not list has no name"
        );
    }

    #[test]
    fn event_payload_names_the_step_and_its_version() {
        let payout = Payout {
            payout_id: PayoutId::parse("p-1").unwrap(),
            account_id: AccountId::parse("acct-1").unwrap(),
            amount_minor: 1234,
            currency: Currency::parse("EUR").unwrap(),
            beneficiary_ref: "ben-1".into(),
            state: PayoutState::RailAcked,
            client_reference: "cref-p-1".into(),
            claimed_by: Some("worker-a".into()),
            token_stamp: Some(7),
            failure_reason: None,
            rail_ref: Some("rail-9".into()),
            rail_outcome: Some("ACKED".into()),
            transaction_group: None,
            created_at: Utc::now(),
            claimed_at: None,
            submitted_at: None,
            settled_at: None,
            updated_at: Utc::now(),
            instruction: None,
        };
        let at = DateTime::parse_from_rfc3339("2026-01-02T03:04:05Z")
            .unwrap()
            .with_timezone(&Utc);
        let v = payout_event_payload(&PayoutLifecycle {
            payout: &payout,
            transition: Some((PayoutState::RailSubmitted, PayoutEvent::RailAcked)),
            event_version: 4,
            actor_id: "worker-a",
            actor_role: "HOLDER",
            owner: Some("worker-a"),
            token: Some(FencingToken::new(7).unwrap()),
            occurred_at: at,
        })
        .unwrap();
        assert_eq!(v["idempotency_key"], "payment-resource:payout:p-1:event:v4");
        assert_eq!(v["event_type"], "PAYOUT_ACKNOWLEDGED");
        assert_eq!(v["event_version"], 4);
        assert_eq!(v["source_transaction_id"], "p-1");
        assert_eq!(v["correlation_id"], "p-1");
        assert_eq!(v["occurred_at"], "2026-01-02T03:04:05.000000Z");
        assert_eq!(v["metadata"]["from_state"], "RAIL_SUBMITTED");
        assert_eq!(v["metadata"]["to_state"], "RAIL_ACKED");
        assert_eq!(v["metadata"]["transition_event"], "RAIL_ACKED");
        assert_eq!(v["metadata"]["fencing_token"], 7);
        assert_eq!(v["metadata"]["amount"], "12.34");
        assert_eq!(v["metadata"]["rail_ref"], "rail-9");
        assert!(v["metadata"]["failure_reason"].is_null());
        assert!(v.get("entries").is_none(), "an event carries no entries");
        // A state the step does not reach: refused, not named.
        let wrong = payout_event_payload(&PayoutLifecycle {
            transition: Some((PayoutState::Pending, PayoutEvent::Claim)),
            ..PayoutLifecycle {
                payout: &payout,
                transition: None,
                event_version: 2,
                actor_id: "worker-a",
                actor_role: "HOLDER",
                owner: None,
                token: None,
                occurred_at: at,
            }
        });
        assert!(wrong.is_err());
    }

    #[test]
    fn group_ids_are_derived_not_generated() {
        let payout = PayoutId::parse("p-1").unwrap();
        assert_eq!(
            transaction_group(&payout_posting_key(&payout)),
            transaction_group(&payout_posting_key(&payout))
        );
    }
}
