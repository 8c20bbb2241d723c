//! `payoutctl outbox quarantine list|replay`: the outbox rows the General Ledger refused for their
//! content (quarantined: delivery stopped, and the account's later rows held behind them), and
//! the operator's release of one after the fix.
//!
//! A replay is paydb's `replay_quarantined(id, operator, reason)` (migration 0010): the release
//! and its durable `outbox_replay` record (who, why, and the error and attempts the row was
//! quarantined with) in one statement, refused for a row that is not quarantined. Only the
//! payment resource may call it, from its ReplayQuarantined method, which answers only an
//! operator's certificate and records the operator that certificate carries: `--operator`
//! chooses which of the operator's certificates is presented, and a name the certificate does
//! not carry is refused with nothing changed.

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::{Args as ClapArgs, Subcommand};
use serde::Serialize;
use sqlx::Row;

use crate::ops::{cell, exit, table, Db, Deployment};

/// `quarantine list` answers at most this many rows, oldest first: a quarantine is an incident
/// (each row holds back its account), so more than a few means the GL refuses a whole class of
/// rows, which the first rows already show.
pub const QUARANTINE_LIST_MAX: i64 = 500;

#[derive(Subcommand)]
pub enum Command {
    /// Rows the General Ledger refused (quarantined), oldest first, and how many of their
    /// account's later rows each one holds back.
    #[command(subcommand)]
    Quarantine(QuarantineCommand),
}

#[derive(Subcommand)]
pub enum QuarantineCommand {
    /// List the quarantined rows (at most 500, oldest first).
    List(ListArgs),
    /// Release one quarantined row for delivery again (after the fix), through the payment
    /// resource under the operator's certified name, recorded with who and why in paydb's
    /// outbox_replay. Exit status 1 when the row is not quarantined or the certificate does not
    /// carry the operator's name (nothing changed).
    Replay(ReplayArgs),
}

#[derive(ClapArgs)]
pub struct ListArgs {
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

#[derive(ClapArgs)]
pub struct ReplayArgs {
    /// The outbox row's id (the first column of `quarantine list`).
    #[arg(value_parser = clap::value_parser!(i64).range(1..))]
    pub id: i64,
    /// Why it is released (the fix made, the ticket): recorded with the replay.
    #[arg(long)]
    pub reason: String,
    /// Who releases it: the operator's name, as the certificate carries it (`<name>.operator`;
    /// the local stack issues one for this name), recorded with the replay.
    #[arg(long)]
    pub operator: String,
    /// One JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

/// One quarantined outbox row.
#[derive(Debug, Clone, Serialize)]
pub struct Quarantined {
    pub id: i64,
    pub account_id: String,
    /// JOURNAL or TRANSACTION_EVENT (paydb 0008).
    pub kind: String,
    /// The payout the row is about, when it is about one.
    pub payout_id: Option<String>,
    pub idempotency_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub quarantined_at: DateTime<Utc>,
    /// Later rows of the same account held behind this one (per-account order).
    pub held_rows: i64,
}

/// A replay as recorded in outbox_replay.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    pub outbox_id: i64,
    pub replay_id: i64,
    pub operator: String,
    pub reason: String,
    /// What the row was quarantined with.
    pub quarantined_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub attempts: i32,
    pub at: DateTime<Utc>,
}

pub async fn quarantined(conn: &mut sqlx::PgConnection) -> anyhow::Result<Vec<Quarantined>> {
    Ok(sqlx::query(
        "SELECT q.id, q.account_id, q.kind, q.payload->>'source_transaction_id' AS subject, \
                q.idempotency_key, q.attempts, q.last_error, q.quarantined_at, \
                (SELECT count(*) FROM ledger_outbox h WHERE h.account_id = q.account_id \
                    AND h.id > q.id AND h.delivered_at IS NULL) AS held_rows \
         FROM ledger_outbox q WHERE q.quarantined_at IS NOT NULL AND q.delivered_at IS NULL \
         ORDER BY q.id LIMIT $1",
    )
    .bind(QUARANTINE_LIST_MAX)
    .fetch_all(&mut *conn)
    .await
    .context("listing the quarantined outbox rows in paydb")?
    .iter()
    .map(|r| {
        let account_id: String = r.get("account_id");
        let subject: Option<String> = r.get("subject");
        Quarantined {
            id: r.get("id"),
            // An account's own event names the account, not a payout.
            payout_id: subject.filter(|s| *s != account_id),
            account_id,
            kind: r.get("kind"),
            idempotency_key: r.get("idempotency_key"),
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            quarantined_at: r.get("quarantined_at"),
            held_rows: r.get("held_rows"),
        }
    })
    .collect())
}

pub fn render_quarantined(rows: &[Quarantined]) -> String {
    if rows.is_empty() {
        return "no quarantined outbox row\n".into();
    }
    let mut out = table(
        &[
            "ID",
            "ACCOUNT",
            "KIND",
            "PAYOUT",
            "ATTEMPTS",
            "HELD",
            "QUARANTINED",
            "LAST_ERROR",
        ],
        &rows
            .iter()
            .map(|q| {
                vec![
                    q.id.to_string(),
                    q.account_id.clone(),
                    q.kind.clone(),
                    cell(&q.payout_id),
                    q.attempts.to_string(),
                    q.held_rows.to_string(),
                    q.quarantined_at
                        .format("%Y-%m-%dT%H:%M:%S%.3fZ")
                        .to_string(),
                    cell(&q.last_error),
                ]
            })
            .collect::<Vec<_>>(),
    );
    if rows.len() as i64 >= QUARANTINE_LIST_MAX {
        out.push_str(&format!(
            "(the first {QUARANTINE_LIST_MAX} only: replay these, then list again)\n"
        ));
    }
    out
}

pub async fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Quarantine(QuarantineCommand::List(args)) => list(args).await,
        Command::Quarantine(QuarantineCommand::Replay(args)) => replay(args).await,
    }
}

async fn list(args: ListArgs) -> anyhow::Result<std::process::ExitCode> {
    let parts = args.deployment.parts()?;
    let mut paydb = parts.read(Db::Paydb).await?;
    let rows = quarantined(&mut paydb).await?;
    let _ = sqlx::Connection::close(paydb).await;
    if args.json {
        println!("{}", serde_json::json!({ "quarantined": rows }));
    } else {
        print!("{}", render_quarantined(&rows));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

async fn replay(args: ReplayArgs) -> anyhow::Result<std::process::ExitCode> {
    let reason = args.reason.trim();
    anyhow::ensure!(!reason.is_empty(), "--reason must say why");
    let operator = args.operator.trim();
    anyhow::ensure!(
        mtls::is_operator_name(operator),
        "--operator {operator:?}: an operator's name is one DNS label (letters, digits and '-', at most 63)"
    );
    let parts = args.deployment.parts()?;
    let url = parts.payment_url()?;
    let tls = parts.operator_tls(operator)?;
    let client = payment_client::PaymentClient::connect(&url, &tls)
        .await
        .map_err(|e| exit::unreachable(format!("the payment resource at {url}"), e))?;
    let replay_id = match client.replay_quarantined(args.id, operator, reason).await {
        Ok(answer) => answer.replay_id,
        Err(e @ payment_client::PaymentError::Transport { .. }) => {
            return Err(exit::unreachable(
                format!("the payment resource at {url}"),
                e,
            ))
        }
        Err(e) => {
            let refusal = match e {
                payment_client::PaymentError::OperatorNotCertified { .. } => format!(
                    "the payment resource refused: this certificate does not carry the operator \
                     {operator:?} ({operator}.operator): nothing was replayed"
                ),
                other => format!("the payment resource refused: {other}"),
            };
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"outbox_id": args.id, "replayed": false, "refused": refusal})
                );
            }
            eprintln!("payoutctl: {refusal}");
            return Ok(std::process::ExitCode::from(exit::PROBLEM));
        }
    };
    let mut paydb = parts.read(Db::Paydb).await?;
    let r = sqlx::query(
        "SELECT outbox_id, id, operator_id, reason, quarantined_at, last_error, attempts, at \
         FROM outbox_replay WHERE id = $1",
    )
    .bind(replay_id)
    .fetch_one(&mut paydb)
    .await
    .context("reading the replay's record back")?;
    let _ = sqlx::Connection::close(paydb).await;
    let replayed = Replayed {
        outbox_id: r.get("outbox_id"),
        replay_id: r.get("id"),
        operator: r.get("operator_id"),
        reason: r.get("reason"),
        quarantined_at: r.get("quarantined_at"),
        last_error: r.get("last_error"),
        attempts: r.get("attempts"),
        at: r.get("at"),
    };
    if args.json {
        println!("{}", serde_json::to_string(&replayed)?);
    } else {
        println!(
            "outbox row {} released for delivery (replay {} by {}: {:?}); it was quarantined \
             after {} attempt(s) with: {}",
            replayed.outbox_id,
            replayed.replay_id,
            replayed.operator,
            replayed.reason,
            replayed.attempts,
            replayed.last_error.as_deref().unwrap_or("-")
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_has_help() {
        crate::ops::cli_test::assert_every_flag_has_help::<Command>();
    }
}
