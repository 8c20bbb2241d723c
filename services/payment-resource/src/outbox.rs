//! The GL journal payload written to `ledger_outbox` (spec 002 "Delivery and ordering", with this
//! service in the role that document calls Wallet). Built here, in one place, from the same values
//! the ledger rows are written from. The dispatcher (issue 6) delivers it unchanged.

use chrono::{DateTime, SecondsFormat, Utc};
use payout_domain::{AccountId, ClientReference, Currency, FencingToken, PayoutId};
use serde_json::{json, Value};
use uuid::Uuid;

/// Namespace of the transaction group ids (uuid v5 of the idempotency key): a group id is derived
/// from the movement, so a repeated posting of one movement can never mint a second group.
pub const TRANSACTION_GROUP_NAMESPACE: Uuid =
    Uuid::from_u128(0x6f1c_2a1e_8d4b_4c1f_9b0e_7a52_d1e3_c0a4);

pub const SOURCE_SERVICE: &str = "payment-resource";
/// Actor of fixture-loaded opening balances (no grant: accounts are created out of band).
pub const FIXTURE_ACTOR: &str = "fixture";

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
}

pub fn payout_posting_payload(p: &PayoutPosting<'_>) -> Value {
    let key = payout_posting_key(p.payout_id);
    let asset = p.currency.as_str();
    json!({
        "source_service": SOURCE_SERVICE,
        "idempotency_key": key,
        "source_transaction_id": p.payout_id.as_str(),
        "tracking_code": ClientReference::for_payout(p.payout_id).as_str(),
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
        });
        assert_eq!(
            v["idempotency_key"],
            "payment-resource:payout:p-1:posting:v1"
        );
        assert_eq!(v["tracking_code"], "cref-p-1");
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

    #[test]
    fn group_ids_are_derived_not_generated() {
        let payout = PayoutId::parse("p-1").unwrap();
        assert_eq!(
            transaction_group(&payout_posting_key(&payout)),
            transaction_group(&payout_posting_key(&payout))
        );
    }
}
