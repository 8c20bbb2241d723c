//! The one workload builder: a seeded batch of payouts over fixture accounts, as the main job
//! (`payoutdev run`), the benchmarks (`payoutdev bench e2e`), the fault suite and the system tests
//! create them. The same seed and shape give the same accounts, amounts and beneficiaries.

use payment_client::model::NewPayout;
use payment_client::PaymentClient;
use payout_activities::types::{AmbiguityPolicy, PayoutInput};
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId};
use rand::{RngExt, SeedableRng};

/// A batch: `payouts` spread over `accounts` fixture accounts (seeded at random, or evenly), a
/// share of them larger than their account can fund.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Every id of the batch starts with it: `{run_id}-acct-{i:04}`, `{run_id}-p-{i:05}`.
    pub run_id: String,
    pub payouts: usize,
    pub accounts: usize,
    /// What each fixture account opens with.
    pub opening_balance_minor: i64,
    /// Share of payouts of `opening_balance_minor + 1` (refused as insufficient funds).
    pub insufficient_rate: f64,
    /// The other payouts' amounts are drawn from 100 ..< this.
    pub amount_max_minor: i64,
    /// Beneficiary references are drawn from `ben-0 ..< ben-{beneficiaries}`.
    pub beneficiaries: u32,
    pub seed: u64,
    pub ambiguity: AmbiguityPolicy,
    /// Payout `i` goes to account `i mod accounts` (with as many accounts as payouts, no two
    /// share one) instead of a seeded random account.
    pub round_robin: bool,
}

impl Batch {
    /// The fixture accounts and the payouts' inputs (nothing created yet).
    pub fn build(&self) -> anyhow::Result<(Vec<AccountId>, Vec<PayoutInput>)> {
        anyhow::ensure!(self.accounts > 0, "a batch needs at least one account");
        let eur = Currency::parse("EUR").expect("supported");
        let accounts = (0..self.accounts)
            .map(|i| AccountId::parse(format!("{}-acct-{i:04}", self.run_id)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed);
        let mut inputs = Vec::with_capacity(self.payouts);
        for i in 0..self.payouts {
            let drawn = rng.random_range(0..accounts.len());
            let account = accounts[if self.round_robin {
                i % accounts.len()
            } else {
                drawn
            }]
            .clone();
            let amount = if rng.random_bool(self.insufficient_rate) {
                self.opening_balance_minor + 1
            } else {
                rng.random_range(100..self.amount_max_minor)
            };
            inputs.push(PayoutInput {
                payout_id: PayoutId::parse(format!("{}-p-{i:05}", self.run_id))?,
                account_id: account,
                amount_minor: AmountMinor::new(amount)?,
                currency: eur.clone(),
                beneficiary_ref: BeneficiaryRef::parse(format!(
                    "ben-{}",
                    rng.random_range(0..self.beneficiaries)
                ))?,
                ambiguity: self.ambiguity,
            });
        }
        Ok((accounts, inputs))
    }

    /// Builds the batch and creates its accounts (funded under `operator`'s signature) and payouts
    /// in the payment resource.
    pub async fn create(
        &self,
        payments: &PaymentClient,
        operator: &testkit::grants::OperatorKey,
    ) -> anyhow::Result<(Vec<AccountId>, Vec<PayoutInput>)> {
        let (accounts, inputs) = self.build()?;
        let eur = Currency::parse("EUR").expect("supported");
        for id in &accounts {
            operator
                .open_account(payments, id, &eur, self.opening_balance_minor)
                .await
                .map_err(|e| anyhow::anyhow!("open account {id}: {e}"))?;
        }
        for input in &inputs {
            payments
                .create_payout(&new_payout(input))
                .await
                .map_err(|e| anyhow::anyhow!("create payout {}: {e}", input.payout_id))?;
        }
        Ok((accounts, inputs))
    }
}

/// One payout on an account of its own, both named after `name` made unique in the shared stack
/// (`p-{unique}`, `a-{unique}`), of `amount_minor` EUR to `ben-e2e`: the system tests' single
/// payouts (nothing created yet).
pub fn unique_payout(
    name: &str,
    amount_minor: i64,
    ambiguity: AmbiguityPolicy,
) -> anyhow::Result<PayoutInput> {
    let unique = testkit::Stack::shared()
        .unique_prefix(name)
        .replace(['/', ':'], "-");
    let unique = unique.trim_matches('-');
    Ok(PayoutInput {
        payout_id: PayoutId::parse(format!("p-{unique}"))?,
        account_id: AccountId::parse(format!("a-{unique}"))?,
        amount_minor: AmountMinor::new(amount_minor)?,
        currency: Currency::parse("EUR")?,
        beneficiary_ref: BeneficiaryRef::parse("ben-e2e")?,
        ambiguity,
    })
}

/// The payment resource's record of a payout the workflow will be started with.
pub fn new_payout(input: &PayoutInput) -> NewPayout {
    NewPayout {
        payout_id: input.payout_id.clone(),
        account_id: input.account_id.clone(),
        amount_minor: input.amount_minor,
        currency: input.currency.clone(),
        beneficiary_ref: input.beneficiary_ref.clone(),
    }
}
