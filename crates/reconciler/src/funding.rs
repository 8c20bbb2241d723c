//! `account_funding_authorised` (INV-03, issue 34): every euro in paydb came from somewhere
//! authorised.
//!
//! paydb has two kinds of ledger group: a payout's posting (its `payout_id` set; checked by
//! `postings_match_payouts`) and an account's opening. An opening is money from outside the
//! ledger, so an operator decides it: the payment resource writes one only under a registered
//! operator's signature over the account, currency and amount, and keeps the signature on the
//! `account_opened` audit row (`grant_signing::operator::Funding`). Whoever holds the payment
//! resource's database login can write a balanced group, an account and an audit row, and the
//! other checks would pass (the group sums to zero, the GL receives it through the outbox); the one
//! thing that login cannot produce is an operator's signature. So every group without a payout
//! must be an opening: exactly two entries, `+x` on a customer account `A` and `-x` on
//! `sys:funding:{CUR}`, `A`'s opening balance `x` in `CUR`, and exactly one `account_opened` row for
//! `A` whose funding signature verifies under the operators' public keys for `(A, CUR, x)`; and
//! every account with an opening balance has its opening group. Without the operators' keys the
//! check reports itself skipped (a missing source), never passed.

use std::collections::BTreeMap;

use sqlx::{PgConnection, Row};

use crate::{check, store, Check, ReconcileError};

/// `sys:funding:{CUR}`: the account an opening's money comes from (the payment resource's
/// `outbox::funding_account`).
pub fn funding_account(currency: &str) -> String {
    format!("sys:funding:{currency}")
}

struct Opening {
    account: String,
    currency: String,
    amount: i64,
}

/// The check, over every ledger group without a payout and every account with an opening balance.
pub async fn account_funding_authorised(
    paydb: &mut PgConnection,
    operators: Option<&grant_signing::Verifier>,
) -> Result<Check, ReconcileError> {
    let mut c = check("account_funding_authorised", "INV-03");
    let Some(operators) = operators else {
        c.skipped = Some(
            "no operator keys given (--operator-keys / PAYOUT_OPERATOR_KEYS): openings not checked"
                .into(),
        );
        return Ok(c);
    };
    let rows = sqlx::query(
        "SELECT transaction_group::text AS g, account_id, currency, amount_minor, counterparty \
         FROM ledger_entry WHERE payout_id IS NULL ORDER BY transaction_group, line_number",
    )
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    let mut groups: BTreeMap<String, Vec<(String, String, i64)>> = BTreeMap::new();
    for r in rows {
        groups.entry(r.get("g")).or_default().push((
            r.get("account_id"),
            r.get("currency"),
            r.get("amount_minor"),
        ));
    }
    c.examined = groups.len() as u64;
    // Each group must be an opening: its customer account, currency and amount.
    let mut openings: BTreeMap<String, (String, Opening)> = BTreeMap::new();
    for (group, entries) in &groups {
        let opening = match entries.as_slice() {
            [(a, cur_a, x), (b, cur_b, y)] if cur_a == cur_b && *x == -*y => {
                let (customer, funding, amount) = if *x > 0 { (a, b, *x) } else { (b, a, *y) };
                (*funding == funding_account(cur_a) && !customer.starts_with("sys:")).then(|| {
                    Opening {
                        account: customer.clone(),
                        currency: cur_a.clone(),
                        amount,
                    }
                })
            }
            _ => None,
        };
        match opening {
            Some(o) => {
                if let Some((other, _)) = openings.get(&o.account) {
                    c.violations.push(format!(
                        "account {}: two opening groups ({other}, {group})",
                        o.account
                    ));
                    continue;
                }
                openings.insert(o.account.clone(), (group.clone(), o));
            }
            None => c.violations.push(format!(
                "ledger group {group} has no payout and is not an account opening (+x on a customer \
                 account, -x on sys:funding): {entries:?}"
            )),
        }
    }
    // Every account with an opening balance, and what its record and audit row say.
    let accounts = sqlx::query(
        "SELECT id, currency, opening_balance_minor FROM account WHERE opening_balance_minor <> 0",
    )
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    let audits = sqlx::query(
        "SELECT account_id, detail::text AS detail FROM audit_event WHERE kind = 'account_opened'",
    )
    .fetch_all(&mut *paydb)
    .await
    .map_err(store("paydb"))?;
    let mut opened: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
    for r in audits {
        let account: Option<String> = r.get("account_id");
        let detail: String = r.get("detail");
        opened
            .entry(account.unwrap_or_default())
            .or_default()
            .push(serde_json::from_str(&detail).unwrap_or(serde_json::Value::Null));
    }
    for r in &accounts {
        let id: String = r.get("id");
        if !openings.contains_key(&id) {
            let balance: i64 = r.get("opening_balance_minor");
            c.violations.push(format!(
                "account {id}: opening balance {balance} without an opening group"
            ));
        }
    }
    let recorded: BTreeMap<String, (String, i64)> = accounts
        .iter()
        .map(|r| {
            (
                r.get::<String, _>("id"),
                (r.get("currency"), r.get("opening_balance_minor")),
            )
        })
        .collect();
    for (account, (group, o)) in &openings {
        if recorded.get(account) != Some(&(o.currency.clone(), o.amount)) {
            c.violations.push(format!(
                "account {account}: opening group {group} moves {} {} but the account records {:?}",
                o.amount,
                o.currency,
                recorded.get(account)
            ));
            continue;
        }
        let rows = opened.get(account).map(Vec::as_slice).unwrap_or_default();
        let [detail] = rows else {
            c.violations.push(format!(
                "account {account}: {} account_opened audit rows, not one",
                rows.len()
            ));
            continue;
        };
        if let Err(why) = verify(operators, account, o, detail) {
            c.violations.push(format!(
                "account {account}: opening group {group} of {} {} is not authorised: {why}",
                o.amount, o.currency
            ));
        }
    }
    Ok(c)
}

/// The opening's funding signature on its audit row, verified for exactly this opening.
fn verify(
    operators: &grant_signing::Verifier,
    account: &str,
    o: &Opening,
    detail: &serde_json::Value,
) -> Result<(), String> {
    let operator = detail["funded_by"]
        .as_str()
        .ok_or("no operator's funding signature on its account_opened row")?;
    let signature = detail["funding_signature"]
        .as_str()
        .and_then(grant_signing::operator::from_hex)
        .ok_or("the funding signature is not hex")?;
    let signed_at = detail["funding_signed_at_unix_ms"]
        .as_u64()
        .ok_or("the funding signature has no time")?;
    operators
        .verify_funding(
            &grant_signing::operator::Funding {
                operator,
                account_id: account,
                currency: &o.currency,
                amount_minor: o.amount,
                signed_at_unix_ms: signed_at,
            },
            &grant_signing::Signature {
                key_id: operator.to_string(),
                bytes: signature,
            },
            None,
        )
        .map(drop)
        .map_err(|refused| format!("{} ({refused})", refused.reason()))
}
