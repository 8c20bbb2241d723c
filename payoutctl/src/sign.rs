//! `payoutctl sign abandon|fund`: an operator's decision, signed with the operator's own key
//! (`payoutctl keys operator`), as the input of the `abandon` signal:
//!
//! ```text
//! temporal workflow signal --workflow-id payout-... --name abandon \
//!   --input "$(payoutctl sign abandon --operator alice --key-file alice.key \
//!              --payout-id p-1 --reason 'finance ticket 42')"
//! ```
//!
//! Temporal authenticates nobody; the payment resource verifies the signature against the
//! registered operator keys before it records the decision as accepted or carries it out, and
//! records the refusal of anything else. The signature covers the operator, the decision, the
//! payout, the reason and the time, and is honoured for an hour
//! (`grant_signing::operator::MAX_AGE_MS`).
//!
//! `payoutctl sign fund` authorises an account's opening balance (money from outside the ledger):
//! the payment resource opens a funded account only under such a signature, over exactly the
//! account, currency and amount, and the reconciler checks every opening against it after the
//! fact (`account_funding_authorised`).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args as ClapArgs, Subcommand};

#[derive(Subcommand)]
pub enum Command {
    /// Print the signed `abandon` signal input (JSON) for one payout.
    Abandon(AbandonArgs),
    /// Print a signed funding (JSON) of one account's opening balance, for OpenAccount.
    Fund(FundArgs),
}

#[derive(ClapArgs, Clone)]
pub struct FundArgs {
    /// The operator's registered name (the key's).
    #[arg(long, env = "PAYOUT_OPERATOR_NAME")]
    pub operator: String,
    /// The operator's secret key, as `payoutctl keys operator` wrote it.
    #[arg(long, env = "PAYOUT_OPERATOR_KEY_FILE")]
    pub key_file: PathBuf,
    /// The account to open.
    #[arg(long)]
    pub account_id: String,
    /// Its currency (ISO 4217).
    #[arg(long)]
    pub currency: String,
    /// Its opening balance in minor units (positive).
    #[arg(long)]
    pub amount_minor: i64,
}

#[derive(ClapArgs)]
pub struct AbandonArgs {
    /// The operator's registered name (the key's).
    #[arg(long)]
    pub operator: String,
    /// The operator's secret key, as `payoutctl keys operator` wrote it.
    #[arg(long)]
    pub key_file: PathBuf,
    /// The payout to abandon (its id, not its workflow id).
    #[arg(long)]
    pub payout_id: String,
    /// Why: recorded with the decision (at most 1,000 characters).
    #[arg(long)]
    pub reason: String,
}

pub fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Abandon(args) => {
            println!(
                "{}",
                abandon(&args, grant_signing::operator::now_unix_ms())?
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Fund(args) => {
            println!("{}", fund(&args, grant_signing::operator::now_unix_ms())?);
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

/// The signal's input: what the workflow reads (`AbandonSignal`).
pub fn abandon(args: &AbandonArgs, now_unix_ms: u64) -> anyhow::Result<serde_json::Value> {
    let reason = args.reason.trim();
    anyhow::ensure!(!reason.is_empty(), "--reason must say why");
    anyhow::ensure!(!args.payout_id.trim().is_empty(), "--payout-id is required");
    let text = std::fs::read_to_string(&args.key_file)
        .with_context(|| format!("reading the operator key {}", args.key_file.display()))?;
    let signer = grant_signing::Signer::from_hex(&args.operator, &text)
        .with_context(|| format!("reading the operator key {}", args.key_file.display()))?;
    let signature = signer.sign_decision(&grant_signing::operator::Decision {
        operator: &args.operator,
        decision: "abandon",
        payout_id: args.payout_id.trim(),
        reason,
        signed_at_unix_ms: now_unix_ms,
    });
    Ok(serde_json::json!({
        "operator": args.operator,
        "reason": reason,
        "signed_at_unix_ms": now_unix_ms,
        "signature": grant_signing::operator::to_hex(&signature.bytes),
    }))
}

/// The signed funding: what OpenAccount's `funded_by` and `funding_signature` carry.
pub fn fund(args: &FundArgs, now_unix_ms: u64) -> anyhow::Result<serde_json::Value> {
    payout_domain::AccountId::parse(args.account_id.clone())
        .map_err(|e| anyhow::anyhow!("--account-id: {e}"))?;
    payout_domain::Currency::parse(&args.currency)
        .map_err(|e| anyhow::anyhow!("--currency: {e}"))?;
    anyhow::ensure!(
        args.amount_minor > 0,
        "--amount-minor must be positive (an empty account needs no operator)"
    );
    let text = std::fs::read_to_string(&args.key_file)
        .with_context(|| format!("reading the operator key {}", args.key_file.display()))?;
    let signer = grant_signing::Signer::from_hex(&args.operator, &text)
        .with_context(|| format!("reading the operator key {}", args.key_file.display()))?;
    let signature = signer.sign_funding(&grant_signing::operator::Funding {
        operator: &args.operator,
        account_id: &args.account_id,
        currency: &args.currency,
        amount_minor: args.amount_minor,
        signed_at_unix_ms: now_unix_ms,
    });
    Ok(serde_json::json!({
        "operator": args.operator,
        "account_id": args.account_id,
        "currency": args.currency,
        "amount_minor": args.amount_minor,
        "signed_at_unix_ms": now_unix_ms,
        "signature": grant_signing::operator::to_hex(&signature.bytes),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signed_input_verifies_against_the_registration_line_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("alice.key");
        let line = crate::keys::grant_signing("alice", &key)
            .unwrap()
            .to_string();
        let args = AbandonArgs {
            operator: "alice".into(),
            key_file: key,
            payout_id: "p-1".into(),
            reason: " finance ticket 42 ".into(),
        };
        let input = abandon(&args, 1_000_000).unwrap();
        assert_eq!(input["reason"], "finance ticket 42");
        let operators = grant_signing::Verifier::parse_operators(&line).unwrap();
        let signature = grant_signing::Signature {
            key_id: "alice".into(),
            bytes: grant_signing::operator::from_hex(input["signature"].as_str().unwrap()).unwrap(),
        };
        let decision = |payout_id| grant_signing::operator::Decision {
            operator: "alice",
            decision: "abandon",
            payout_id,
            reason: "finance ticket 42",
            signed_at_unix_ms: 1_000_000,
        };
        assert_eq!(
            operators.verify_decision(&decision("p-1"), &signature, 1_000_000),
            Ok("alice".into())
        );
        assert!(operators
            .verify_decision(&decision("p-2"), &signature, 1_000_000)
            .is_err());
        let e = abandon(
            &AbandonArgs {
                reason: "  ".into(),
                ..args
            },
            0,
        )
        .unwrap_err();
        assert!(e.to_string().contains("--reason"), "{e}");
    }

    #[test]
    fn a_signed_funding_verifies_for_its_account_and_amount_only() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("alice.key");
        let line = crate::keys::grant_signing("alice", &key)
            .unwrap()
            .to_string();
        let args = FundArgs {
            operator: "alice".into(),
            key_file: key,
            account_id: "acct-1".into(),
            currency: "EUR".into(),
            amount_minor: 100_000,
        };
        let signed = fund(&args, 2_000_000).unwrap();
        let operators = grant_signing::Verifier::parse_operators(&line).unwrap();
        let signature = grant_signing::Signature {
            key_id: "alice".into(),
            bytes: grant_signing::operator::from_hex(signed["signature"].as_str().unwrap())
                .unwrap(),
        };
        let funding = |amount_minor| grant_signing::operator::Funding {
            operator: "alice",
            account_id: "acct-1",
            currency: "EUR",
            amount_minor,
            signed_at_unix_ms: 2_000_000,
        };
        assert_eq!(
            operators.verify_funding(&funding(100_000), &signature, None),
            Ok("alice".into())
        );
        assert!(operators
            .verify_funding(&funding(100_001), &signature, None)
            .is_err());
        for (bad, flag) in [
            (
                FundArgs {
                    amount_minor: 0,
                    ..args.clone()
                },
                "--amount-minor",
            ),
            (
                FundArgs {
                    account_id: "a/b".into(),
                    ..args.clone()
                },
                "--account-id",
            ),
            (
                FundArgs {
                    currency: "EURO".into(),
                    ..args.clone()
                },
                "--currency",
            ),
        ] {
            let e = fund(&bad, 0).unwrap_err();
            assert!(e.to_string().contains(flag), "{e}");
        }
    }
}
