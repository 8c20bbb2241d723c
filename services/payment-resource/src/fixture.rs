//! Fixture data: accounts with opening balances, through the same code as `OpenAccount`.

use payout_domain::{AccountId, Currency};
use serde::Deserialize;

use payment_client::model::Account;
use payment_client::{InvalidReason, PaymentError};

use crate::error::ServerError;
use crate::store::Store;

/// Most accounts one fixture run creates: a fixture is for tests and demos, not a bulk import.
pub const FIXTURE_ACCOUNTS_MAX: usize = 100_000;

/// One account of a fixture file: `[{"account_id":"acct-1","currency":"EUR","opening_balance_minor":100000}]`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct FixtureAccount {
    pub account_id: String,
    pub currency: String,
    pub opening_balance_minor: i64,
}

/// `{prefix}1` .. `{prefix}{count}`, each with the same balance and currency.
pub fn numbered(
    prefix: &str,
    count: usize,
    balance_minor: i64,
    currency: &str,
) -> Vec<FixtureAccount> {
    (1..=count)
        .map(|i| FixtureAccount {
            account_id: format!("{prefix}{i}"),
            currency: currency.to_string(),
            opening_balance_minor: balance_minor,
        })
        .collect()
}

/// Opens every account (idempotently: a re-run with the same content changes nothing).
pub async fn load(store: &Store, accounts: &[FixtureAccount]) -> Result<Vec<Account>, ServerError> {
    if accounts.len() > FIXTURE_ACCOUNTS_MAX {
        return Err(PaymentError::invalid("accounts", InvalidReason::TextTooLong).into());
    }
    let mut opened = Vec::with_capacity(accounts.len());
    for a in accounts {
        let account_id = AccountId::parse(a.account_id.clone())
            .map_err(|_| PaymentError::invalid("account_id", InvalidReason::IdInvalid))?;
        let currency = Currency::parse(&a.currency)
            .map_err(|_| PaymentError::invalid("currency", InvalidReason::CurrencyInvalid))?;
        opened.push(
            store
                .open_account_unsigned_for_fixture(&account_id, &currency, a.opening_balance_minor)
                .await?,
        );
    }
    Ok(opened)
}
