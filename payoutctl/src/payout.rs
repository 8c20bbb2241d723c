//! `payoutctl payout show|list|create|abandon`: one payout as every store sees it, the payouts of
//! an account or a state, a payout submitted through the payment resource's intake, and an
//! operator's abandon through the workflow's `abandon` Update (answered at once: accepted or
//! refused, and why). When the workflow is not running, a payout that may be abandoned (PENDING,
//! or RAIL_AMBIGUOUS past the resolution SLA by the payment resource's record) has its workflow
//! started again through the resolver's start path (`resolver::resume`), so the abandon goes
//! through the one fenced path (a grant, the operator's signature verified by the payment
//! resource, the same audit rows); anything else is refused and recorded by this command.
//!
//! `show` and `list` only read: paydb, proxydb and gldb as a read-only role, the rail through the
//! proxy's read-only lookup. `create` is the payment resource's CreatePayout (idempotent: the same
//! payout id and content answer the same payout). `abandon` signs the decision as `payoutctl sign
//! abandon` does; the payment resource verifies the signature before anything is carried out.

use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::{Args as ClapArgs, Subcommand};
use serde::Serialize;
use sqlx::Row;

use payout_workflows::abandon::AbandonError;

use crate::ops::{cell, exit, table, Db, Deployment, Parts, READER_NAME};
use payout_domain::{AccountId, AmountMinor, BeneficiaryRef, Currency, PayoutId, PayoutState};

/// `payout list` answers at most this many payouts per call: one page an operator can read, and
/// one bounded query on paydb (its total count of matches is printed when the page is cut).
pub const LIST_LIMIT_MAX: i64 = 1_000;
/// `payout list`'s page size when `--limit` is not given.
pub const LIST_LIMIT_DEFAULT: i64 = 50;
/// A `payout list` of more than this many rows says on stderr what it reads (a page of up to
/// 1,000 rows and its count can take a few seconds on a large paydb).
const LIST_PROGRESS_ABOVE: i64 = 100;
/// `payout show` prints at most this many audit rows, transitions and GL rows of one payout (a
/// payout has a few dozen; more means something loops, and the count says so).
pub const SHOW_ROWS_MAX: i64 = 500;
/// How long `payout abandon` waits for the workflow's answer: the Update is decided by the
/// workflow's next task, which records the decision at the payment resource first (an activity
/// of at most a few seconds). No answer in this time means no worker is polling the payout's
/// queue; nothing was decided that this command saw.
pub const ABANDON_ANSWER_TIMEOUT_MS: u64 = 60_000;
/// `payout abandon` says on stderr that it is still waiting this often.
const PROGRESS_EVERY_MS: u64 = 5_000;
/// How often `payout abandon` asks a run it started again whether it can judge the abandon yet
/// (its `status` query, a read of the workflow's state: cheap, and a quarter second is well
/// under the activities it waits for).
const READY_POLL_MS: u64 = 250;
/// One `status` query of that run may take this long: Temporal answers it once a worker has run
/// the run's workflow task, a second or two on a busy worker; a query not answered by then is
/// asked again (the whole wait is bounded by [`ABANDON_ANSWER_TIMEOUT_MS`]).
const READY_QUERY_TIMEOUT_MS: u64 = 10_000;
/// The settlement window a run started again by `payout abandon` waits between its inquiries
/// when neither `--settlement-window-ms` nor the local stack's record gives one: the
/// reconciler's resume pass default (`reconciler --settlement-window-ms`).
const SETTLEMENT_WINDOW_DEFAULT_MS: u64 = 30_000;
/// The resolution SLA `payout abandon` checks an ambiguous payout whose workflow is not
/// running against (and starts its run with), when `--resolution-sla-ms` is not given: the
/// payment resource's production default (one hour), which the payment resource enforces on
/// its own record in any case.
pub const RESOLUTION_SLA_DEFAULT_MS: u64 = 3_600_000;

#[derive(Subcommand)]
pub enum Command {
    /// One payout as every store sees it: state, state history, audit trail, the rail
    /// submission (proxydb) and the guard's events, the rail's movements, the ledger rows (paydb)
    /// and the General Ledger's journals and events. Reads only. Exit status 1 if there is no
    /// such payout.
    Show(ShowArgs),
    /// Payouts, newest first (or oldest first), filtered by account, state and age (at most
    /// 1,000 per call).
    List(ListArgs),
    /// Submit a payout through the payment resource's CreatePayout. Idempotent: the same payout
    /// id with the same content answers the existing payout; with other content it is refused.
    Create(CreateArgs),
    /// Abandon a payout through its workflow's `abandon` Update, signed with the operator's key:
    /// prints whether it was accepted (carried out, or on record and waiting for the account's
    /// lock) or refused, and why. When the payout's workflow is not running and the payout may
    /// be abandoned (PENDING, or RAIL_AMBIGUOUS past the resolution SLA by the payment
    /// resource's record), the workflow is started again as the reconciler's resume pass starts
    /// it (the account's key taken over from a grant whose workflow is not running, an audited
    /// force-revoke under the operator's name) and then asked. Otherwise (terminal, another
    /// state, the SLA not passed) this command records the refusal in the payment resource's
    /// audit trail itself. Exit status 0 when accepted, 1 when refused.
    Abandon(AbandonArgs),
}

#[derive(ClapArgs)]
pub struct ShowArgs {
    /// The payout's id (not its workflow id).
    #[arg(value_parser = parse_payout_id)]
    pub payout_id: PayoutId,
    /// One JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

#[derive(ClapArgs)]
pub struct ListArgs {
    /// Only this account's payouts.
    #[arg(long, value_parser = parse_account_id)]
    pub account: Option<AccountId>,
    /// Only payouts in this state (PENDING, CLAIMED, RAIL_SUBMITTED, RAIL_ACKED, RAIL_AMBIGUOUS,
    /// POSTED, FAILED, ABANDONED).
    #[arg(long, value_parser = parse_state)]
    pub state: Option<PayoutState>,
    /// Only payouts created longer ago than this: a whole number and a unit, s, m, h or d
    /// (`15m`, `2h`, `1d`), by paydb's clock.
    #[arg(long, value_parser = parse_age)]
    pub older_than: Option<Duration>,
    /// Oldest first (the longest-waiting payouts at the top) instead of newest first.
    #[arg(long)]
    pub oldest_first: bool,
    /// At most this many payouts, newest first unless --oldest-first (1 to 1,000).
    #[arg(long, default_value_t = LIST_LIMIT_DEFAULT, value_parser = clap::value_parser!(i64).range(1..=LIST_LIMIT_MAX))]
    pub limit: i64,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

#[derive(ClapArgs)]
pub struct CreateArgs {
    /// The account the payout is paid from.
    #[arg(long, value_parser = parse_account_id)]
    pub account: AccountId,
    /// The amount in minor units (cents), positive.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_amount)]
    pub amount_minor: AmountMinor,
    /// The currency (ISO 4217: the account's own).
    #[arg(long, value_parser = parse_currency)]
    pub currency: Currency,
    /// The beneficiary's synthetic reference.
    #[arg(long, value_parser = parse_beneficiary)]
    pub beneficiary: BeneficiaryRef,
    /// The payout's id. Give it to retry safely: a second create with the same id and content
    /// answers the same payout. Without it a new id is made and printed.
    #[arg(long, value_parser = parse_payout_id)]
    pub payout_id: Option<PayoutId>,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

#[derive(ClapArgs)]
pub struct AbandonArgs {
    /// The payout to abandon (its id, not its workflow id).
    #[arg(value_parser = parse_payout_id)]
    pub payout_id: PayoutId,
    /// Why: recorded with the decision (at most 1,000 characters).
    #[arg(long)]
    pub reason: String,
    /// The operator's registered name (the key's).
    #[arg(long)]
    pub operator: String,
    /// The operator's secret key, as `payoutctl keys operator` wrote it.
    #[arg(long)]
    pub key_file: std::path::PathBuf,
    /// The resolution SLA of the deployment (ms): when the payout is RAIL_AMBIGUOUS and its
    /// workflow is not running, an abandon before the SLA has passed since the payment
    /// resource's record of the ambiguity is refused here, and a run started again carries it.
    #[arg(long, env = "PAYOUT_RESOLUTION_SLA_MS", default_value_t = RESOLUTION_SLA_DEFAULT_MS)]
    pub resolution_sla_ms: u64,
    /// The payout workers' task queue, where a workflow that is not running is started again
    /// (the local stack's own, else `payouts`).
    #[arg(long, env = "PAYOUT_TASK_QUEUE")]
    pub task_queue: Option<String>,
    /// The settlement window (ms) a workflow started again waits between its inquiries (the
    /// local stack's own, else 30 s, the reconciler's default).
    #[arg(long, env = "PAYOUT_SETTLEMENT_WINDOW_MS")]
    pub settlement_window_ms: Option<u64>,
    /// One JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub deployment: Deployment,
}

fn parse_payout_id(value: &str) -> Result<PayoutId, String> {
    PayoutId::parse(value).map_err(|e| e.to_string())
}
fn parse_account_id(value: &str) -> Result<AccountId, String> {
    AccountId::parse(value).map_err(|e| e.to_string())
}
fn parse_beneficiary(value: &str) -> Result<BeneficiaryRef, String> {
    BeneficiaryRef::parse(value).map_err(|e| e.to_string())
}
fn parse_currency(value: &str) -> Result<Currency, String> {
    Currency::parse(value).map_err(|e| e.to_string())
}
fn parse_amount(value: &str) -> Result<AmountMinor, String> {
    let n: i64 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a whole number of minor units"))?;
    AmountMinor::new(n).map_err(|e| e.to_string())
}
/// The longest age `payout list --older-than` takes: ten years, far beyond any payout's life,
/// and far inside what paydb's interval arithmetic holds.
pub const LIST_AGE_MAX: Duration = Duration::from_secs(10 * 366 * 24 * 3_600);

/// An age: a whole positive number and a unit (`90s`, `15m`, `2h`, `1d`).
fn parse_age(value: &str) -> Result<Duration, String> {
    let usage = || {
        format!(
            "{value:?} is not an age: a whole positive number and a unit, s, m, h or d (e.g. 15m)"
        )
    };
    let unit_at = value
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(usage)?;
    let (number, unit) = value.split_at(unit_at);
    let n: u64 = number.parse().map_err(|_| usage())?;
    let seconds_per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(usage()),
    };
    if n == 0 {
        return Err(usage());
    }
    let age = n
        .checked_mul(seconds_per)
        .map(Duration::from_secs)
        .filter(|age| *age <= LIST_AGE_MAX)
        .ok_or_else(|| {
            format!(
                "{value:?} is older than any payout can be (at most {} d)",
                LIST_AGE_MAX.as_secs() / 86_400
            )
        })?;
    Ok(age)
}
fn parse_state(value: &str) -> Result<PayoutState, String> {
    PayoutState::parse(&value.to_ascii_uppercase()).ok_or_else(|| {
        format!(
            "{value:?} is not a payout state (one of {})",
            PayoutState::ALL.map(|s| s.as_str()).join(", ")
        )
    })
}

pub async fn run(command: Command) -> anyhow::Result<std::process::ExitCode> {
    match command {
        Command::Show(args) => show(args).await,
        Command::List(args) => list(args).await,
        Command::Create(args) => create(args).await,
        Command::Abandon(args) => abandon(args).await,
    }
}

// ---------------------------------------------------------------------------------------------
// show

/// A payout's row in paydb.
#[derive(Debug, Clone, Serialize)]
pub struct PayoutRow {
    pub payout_id: String,
    pub account_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
    pub state: String,
    pub client_reference: String,
    pub claimed_by: Option<String>,
    pub token_stamp: Option<i64>,
    pub failure_reason: Option<String>,
    pub rail_ref: Option<String>,
    pub rail_outcome: Option<String>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

const PAYOUT_COLUMNS: &str = "id, account_id, amount_minor, currency, beneficiary_ref, state, \
     client_reference, claimed_by, token_stamp, failure_reason, rail_ref, rail_outcome, version, \
     created_at, updated_at";

fn payout_row(r: &sqlx::postgres::PgRow) -> PayoutRow {
    PayoutRow {
        payout_id: r.get("id"),
        account_id: r.get("account_id"),
        amount_minor: r.get("amount_minor"),
        currency: r.get("currency"),
        beneficiary_ref: r.get("beneficiary_ref"),
        state: r.get("state"),
        client_reference: r.get("client_reference"),
        claimed_by: r.get("claimed_by"),
        token_stamp: r.get("token_stamp"),
        failure_reason: r.get("failure_reason"),
        rail_ref: r.get("rail_ref"),
        rail_outcome: r.get("rail_outcome"),
        version: r.get("version"),
        created_at: r.get("created_at"),
        updated_at: r.get("updated_at"),
    }
}

/// One row of the payout's audit trail (paydb's `audit_event`); a `transition` row is a step of
/// its state history.
#[derive(Debug, Clone, Serialize)]
pub struct AuditRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub kind: String,
    pub actor: String,
    pub owner: Option<String>,
    pub token: Option<i64>,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub event: Option<String>,
    pub detail: serde_json::Value,
}

/// The proxy's record of the payout's submission to the rail (proxydb's `rail_submission`).
#[derive(Debug, Clone, Serialize)]
pub struct Submission {
    pub fence_token: i64,
    pub owner: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
    pub outcome: Option<String>,
    pub rail_ref: Option<String>,
    pub decline_code: Option<String>,
    pub failure_detail: Option<String>,
    pub created_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
}

/// A refusal or a duplicate the rail proxy's guard recorded for the payout (proxydb's
/// `guard_event`).
#[derive(Debug, Clone, Serialize)]
pub struct GuardEvent {
    pub at: DateTime<Utc>,
    pub kind: String,
    pub presented: i64,
    pub stored: i64,
    pub owner: String,
    pub stored_owner: String,
}

/// What the rail reports for the payout's client reference, through the proxy's lookup.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case", tag = "answer")]
pub enum Rail {
    Found {
        movements: Vec<Movement>,
    },
    Absent,
    /// Inside the settlement window: the rail's answer is not authoritative yet.
    Unknown {
        detail: String,
    },
    /// The lookup failed (the rest of the record is still shown).
    Error {
        error: String,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct Movement {
    pub rail_ref: String,
    pub amount_minor: i64,
    pub currency: String,
    pub beneficiary_ref: String,
}

/// A row of paydb's ledger for the payout.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerRow {
    pub transaction_group: String,
    pub line_number: i16,
    pub account_id: String,
    pub amount_minor: i64,
    pub currency: String,
    pub counterparty: String,
    pub token: Option<i64>,
    pub created_at: DateTime<Utc>,
}

/// A line of a General Ledger journal for the payout.
#[derive(Debug, Clone, Serialize)]
pub struct GlLine {
    pub journal_id: String,
    pub receipt_sequence: i64,
    pub effect_kind: String,
    pub line_number: i32,
    pub account_class: String,
    pub owner_id: String,
    pub asset_id: String,
    pub amount: String,
    pub recorded_at: DateTime<Utc>,
}

/// A General Ledger transaction event for the payout (one per payout transition).
#[derive(Debug, Clone, Serialize)]
pub struct GlEvent {
    pub event_version: i32,
    pub event_type: String,
    pub occurred_at: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
}

/// Everything `payout show` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PayoutView {
    pub payout: PayoutRow,
    /// The transitions of the audit trail, oldest first: (from, to, event, at, by).
    pub history: Vec<AuditRow>,
    /// The whole audit trail of the payout, oldest first.
    pub audit: Vec<AuditRow>,
    pub submission: Option<Submission>,
    pub guard_events: Vec<GuardEvent>,
    pub rail: Rail,
    pub ledger: Vec<LedgerRow>,
    pub gl_journal_lines: Vec<GlLine>,
    pub gl_events: Vec<GlEvent>,
}

/// The payout's record in every store (`None`: no such payout in paydb).
pub async fn view(parts: &Parts, payout_id: &PayoutId) -> anyhow::Result<Option<PayoutView>> {
    let id = payout_id.as_str();
    let mut paydb = parts.read(Db::Paydb).await?;
    let Some(row) = sqlx::query(&format!(
        "SELECT {PAYOUT_COLUMNS} FROM payout WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut paydb)
    .await
    .context("reading the payout from paydb")?
    else {
        return Ok(None);
    };
    let payout = payout_row(&row);
    let audit: Vec<AuditRow> = sqlx::query(
        "SELECT id, at, kind, actor, owner, token, from_state, to_state, event, detail \
         FROM audit_event WHERE payout_id = $1 ORDER BY id LIMIT $2",
    )
    .bind(id)
    .bind(SHOW_ROWS_MAX)
    .fetch_all(&mut paydb)
    .await
    .context("reading the payout's audit trail from paydb")?
    .iter()
    .map(|r| AuditRow {
        id: r.get("id"),
        at: r.get("at"),
        kind: r.get("kind"),
        actor: r.get("actor"),
        owner: r.get("owner"),
        token: r.get("token"),
        from_state: r.get("from_state"),
        to_state: r.get("to_state"),
        event: r.get("event"),
        detail: r.get("detail"),
    })
    .collect();
    let history = audit
        .iter()
        .filter(|a| a.kind == "transition" || a.kind == "payout_created")
        .cloned()
        .collect();
    let ledger = sqlx::query(
        "SELECT transaction_group::text AS transaction_group, line_number, account_id, \
                amount_minor, currency, counterparty, token, created_at \
         FROM ledger_entry WHERE payout_id = $1 ORDER BY id LIMIT $2",
    )
    .bind(id)
    .bind(SHOW_ROWS_MAX)
    .fetch_all(&mut paydb)
    .await
    .context("reading the payout's ledger rows from paydb")?
    .iter()
    .map(|r| LedgerRow {
        transaction_group: r.get("transaction_group"),
        line_number: r.get("line_number"),
        account_id: r.get("account_id"),
        amount_minor: r.get("amount_minor"),
        currency: r.get("currency"),
        counterparty: r.get("counterparty"),
        token: r.get("token"),
        created_at: r.get("created_at"),
    })
    .collect();
    let _ = sqlx::Connection::close(paydb).await;

    let mut proxydb = parts.read(Db::Proxydb).await?;
    let submission = sqlx::query(
        "SELECT fence_token, owner, amount_minor, currency, beneficiary_ref, outcome, rail_ref, \
                decline_code, failure_detail, created_at, resolved_at \
         FROM rail_submission WHERE payout_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut proxydb)
    .await
    .context("reading the payout's rail submission from proxydb")?
    .map(|r| Submission {
        fence_token: r.get("fence_token"),
        owner: r.get("owner"),
        amount_minor: r.get("amount_minor"),
        currency: r.get("currency"),
        beneficiary_ref: r.get("beneficiary_ref"),
        outcome: r.get("outcome"),
        rail_ref: r.get("rail_ref"),
        decline_code: r.get("decline_code"),
        failure_detail: r.get("failure_detail"),
        created_at: r.get("created_at"),
        resolved_at: r.get("resolved_at"),
    });
    let guard_events = sqlx::query(
        "SELECT created_at, kind, presented, stored, owner, stored_owner FROM guard_event \
         WHERE payout_id = $1 ORDER BY id LIMIT $2",
    )
    .bind(id)
    .bind(SHOW_ROWS_MAX)
    .fetch_all(&mut proxydb)
    .await
    .context("reading the rail proxy's guard events from proxydb")?
    .iter()
    .map(|r| GuardEvent {
        at: r.get("created_at"),
        kind: r.get("kind"),
        presented: r.get("presented"),
        stored: r.get("stored"),
        owner: r.get("owner"),
        stored_owner: r.get("stored_owner"),
    })
    .collect();
    let _ = sqlx::Connection::close(proxydb).await;

    let mut gldb = parts.read(Db::Gldb).await?;
    let gl_journal_lines = sqlx::query(
        "SELECT j.id::text AS journal_id, j.receipt_sequence, j.effect_kind, e.line_number, \
                a.class, a.owner_id, e.asset_id, e.amount::text AS amount, j.recorded_at \
         FROM journals j JOIN entries e ON e.journal_id = j.id \
              JOIN ledger_accounts a ON a.id = e.account_id \
         WHERE j.source_service = 'payment-resource' AND j.source_transaction_id = $1 \
         ORDER BY j.receipt_sequence, e.line_number LIMIT $2",
    )
    .bind(id)
    .bind(SHOW_ROWS_MAX)
    .fetch_all(&mut gldb)
    .await
    .context("reading the payout's journals from gldb")?
    .iter()
    .map(|r| GlLine {
        journal_id: r.get("journal_id"),
        receipt_sequence: r.get("receipt_sequence"),
        effect_kind: r.get("effect_kind"),
        line_number: r.get("line_number"),
        account_class: r.get("class"),
        owner_id: r.get("owner_id"),
        asset_id: r.get("asset_id"),
        amount: r.get("amount"),
        recorded_at: r.get("recorded_at"),
    })
    .collect();
    let gl_events = sqlx::query(
        "SELECT event_version, event_type, occurred_at, recorded_at FROM transaction_events \
         WHERE source_service = 'payment-resource' AND source_transaction_id = $1 \
         ORDER BY event_version LIMIT $2",
    )
    .bind(id)
    .bind(SHOW_ROWS_MAX)
    .fetch_all(&mut gldb)
    .await
    .context("reading the payout's transaction events from gldb")?
    .iter()
    .map(|r| GlEvent {
        event_version: r.get("event_version"),
        event_type: r.get("event_type"),
        occurred_at: r.get("occurred_at"),
        recorded_at: r.get("recorded_at"),
    })
    .collect();
    let _ = sqlx::Connection::close(gldb).await;

    let rail = rail_lookup(parts, payout_id).await;
    Ok(Some(PayoutView {
        payout,
        history,
        audit,
        submission,
        guard_events,
        rail,
        ledger,
        gl_journal_lines,
        gl_events,
    }))
}

/// The rail's movements for the payout, through the proxy (an operator's certificate may ask).
async fn rail_lookup(parts: &Parts, payout_id: &PayoutId) -> Rail {
    let answer = async {
        let url = parts.proxy_url()?;
        let tls = parts.operator_tls(READER_NAME)?;
        let mut proxy = rail_proxy_client::RailProxyClient::connect(&url, &tls)
            .await
            .map_err(|e| exit::unreachable(format!("the rail proxy at {url}"), e))?;
        proxy
            .rail_movements(payout_id)
            .await
            .context("the rail proxy's lookup")
    }
    .await;
    match answer {
        Ok(rail_proxy_client::RailLookup::Found(found)) => Rail::Found {
            movements: found
                .into_iter()
                .map(|m| Movement {
                    rail_ref: m.rail_ref,
                    amount_minor: m.amount_minor,
                    currency: m.currency,
                    beneficiary_ref: m.beneficiary_ref,
                })
                .collect(),
        },
        Ok(rail_proxy_client::RailLookup::Absent) => Rail::Absent,
        Ok(rail_proxy_client::RailLookup::Unknown { detail }) => Rail::Unknown { detail },
        Err(e) => Rail::Error {
            error: format!("{e:#}"),
        },
    }
}

fn time(at: &DateTime<Utc>) -> String {
    at.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// The readable form of `payout show`.
pub fn render_view(v: &PayoutView) -> String {
    let p = &v.payout;
    let mut out = format!(
        "payout {}  {}\n  account {}  amount {} {}  beneficiary {}  client reference {}\n  \
         claimed by {}  token {}  rail ref {}  rail outcome {}  failure {}\n  \
         created {}  updated {}  version {}\n",
        p.payout_id,
        p.state,
        p.account_id,
        p.amount_minor,
        p.currency,
        p.beneficiary_ref,
        p.client_reference,
        cell(&p.claimed_by),
        cell(&p.token_stamp),
        cell(&p.rail_ref),
        cell(&p.rail_outcome),
        cell(&p.failure_reason),
        time(&p.created_at),
        time(&p.updated_at),
        p.version
    );
    out.push_str("\nstate history\n");
    out.push_str(&table(
        &["AT", "FROM", "TO", "EVENT", "ACTOR", "OWNER", "TOKEN"],
        &v.history
            .iter()
            .map(|a| {
                vec![
                    time(&a.at),
                    cell(&a.from_state),
                    cell(&a.to_state),
                    cell(&a.event),
                    a.actor.clone(),
                    cell(&a.owner),
                    cell(&a.token),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    out.push_str("\naudit trail\n");
    out.push_str(&table(
        &["ID", "AT", "KIND", "ACTOR", "TOKEN", "DETAIL"],
        &v.audit
            .iter()
            .map(|a| {
                vec![
                    a.id.to_string(),
                    time(&a.at),
                    a.kind.clone(),
                    a.actor.clone(),
                    cell(&a.token),
                    if a.detail.as_object().is_some_and(|o| o.is_empty()) {
                        "-".into()
                    } else {
                        a.detail.to_string()
                    },
                ]
            })
            .collect::<Vec<_>>(),
    ));
    out.push_str("\nrail submission (proxydb)\n");
    match &v.submission {
        None => out.push_str("  none: the proxy never recorded a submission for this payout\n"),
        Some(s) => out.push_str(&format!(
            "  token {} by {}  {} {} to {}  outcome {}  rail ref {}  decline {}  detail {}\n  \
             recorded {}  resolved {}\n",
            s.fence_token,
            s.owner,
            s.amount_minor,
            s.currency,
            s.beneficiary_ref,
            s.outcome.as_deref().unwrap_or("unresolved"),
            cell(&s.rail_ref),
            cell(&s.decline_code),
            cell(&s.failure_detail),
            time(&s.created_at),
            s.resolved_at
                .as_ref()
                .map(time)
                .unwrap_or_else(|| "-".into())
        )),
    }
    if !v.guard_events.is_empty() {
        out.push_str("\nrail proxy guard events\n");
        out.push_str(&table(
            &["AT", "KIND", "PRESENTED", "STORED", "OWNER", "STORED_OWNER"],
            &v.guard_events
                .iter()
                .map(|g| {
                    vec![
                        time(&g.at),
                        g.kind.clone(),
                        g.presented.to_string(),
                        g.stored.to_string(),
                        g.owner.clone(),
                        g.stored_owner.clone(),
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    out.push_str("\nrail movements\n");
    match &v.rail {
        Rail::Found { movements } => out.push_str(&table(
            &["RAIL_REF", "AMOUNT", "CURRENCY", "BENEFICIARY"],
            &movements
                .iter()
                .map(|m| {
                    vec![
                        m.rail_ref.clone(),
                        m.amount_minor.to_string(),
                        m.currency.clone(),
                        m.beneficiary_ref.clone(),
                    ]
                })
                .collect::<Vec<_>>(),
        )),
        Rail::Absent => out.push_str("  none: the rail reports no movement\n"),
        Rail::Unknown { detail } => out.push_str(&format!(
            "  unknown yet (inside the settlement window): {detail}\n"
        )),
        Rail::Error { error } => out.push_str(&format!("  lookup failed: {error}\n")),
    }
    out.push_str("\nledger (paydb)\n");
    out.push_str(&table(
        &[
            "GROUP",
            "LINE",
            "ACCOUNT",
            "AMOUNT",
            "CURRENCY",
            "COUNTERPARTY",
            "TOKEN",
            "AT",
        ],
        &v.ledger
            .iter()
            .map(|l| {
                vec![
                    l.transaction_group.clone(),
                    l.line_number.to_string(),
                    l.account_id.clone(),
                    l.amount_minor.to_string(),
                    l.currency.clone(),
                    l.counterparty.clone(),
                    cell(&l.token),
                    time(&l.created_at),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    out.push_str("\nGeneral Ledger journals (gldb)\n");
    out.push_str(&table(
        &[
            "RECEIPT", "JOURNAL", "EFFECT", "LINE", "CLASS", "OWNER", "AMOUNT", "ASSET",
        ],
        &v.gl_journal_lines
            .iter()
            .map(|g| {
                vec![
                    g.receipt_sequence.to_string(),
                    g.journal_id.clone(),
                    g.effect_kind.clone(),
                    g.line_number.to_string(),
                    g.account_class.clone(),
                    g.owner_id.clone(),
                    g.amount.clone(),
                    g.asset_id.clone(),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    out.push_str("\nGeneral Ledger transaction events (gldb)\n");
    out.push_str(&table(
        &["VERSION", "EVENT", "OCCURRED", "RECORDED"],
        &v.gl_events
            .iter()
            .map(|e| {
                vec![
                    e.event_version.to_string(),
                    e.event_type.clone(),
                    time(&e.occurred_at),
                    time(&e.recorded_at),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    out
}

async fn show(args: ShowArgs) -> anyhow::Result<std::process::ExitCode> {
    let parts = args.deployment.parts()?;
    let Some(view) = view(&parts, &args.payout_id).await? else {
        eprintln!(
            "payoutctl: no payout {} in paydb (nothing was changed)",
            args.payout_id
        );
        if args.json {
            println!(
                "{}",
                serde_json::json!({"payout_id": args.payout_id.as_str(), "found": false})
            );
        }
        return Ok(std::process::ExitCode::from(exit::PROBLEM));
    };
    if args.json {
        println!("{}", serde_json::to_string(&view)?);
    } else {
        print!("{}", render_view(&view));
    }
    // The stores were read; a rail lookup that could not be made is said in the output and in
    // the exit status.
    Ok(std::process::ExitCode::from(match &view.rail {
        Rail::Error { .. } => exit::PROBLEM,
        _ => exit::OK,
    }))
}

// ---------------------------------------------------------------------------------------------
// list

/// `payout list`'s answer.
#[derive(Debug, Clone, Serialize)]
pub struct Listing {
    pub payouts: Vec<PayoutRow>,
    /// How many payouts match the filters (more than `payouts.len()` when the page was cut).
    pub matching: i64,
    /// The order of `payouts`: oldest first, or newest first.
    pub oldest_first: bool,
}

/// What `payout list` asks of paydb.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub account: Option<AccountId>,
    pub state: Option<PayoutState>,
    /// Only payouts created longer ago than this (by paydb's clock).
    pub older_than: Option<Duration>,
    pub oldest_first: bool,
    pub limit: i64,
}

pub async fn listing(parts: &Parts, q: &ListQuery) -> anyhow::Result<Listing> {
    let limit = q.limit.clamp(1, LIST_LIMIT_MAX);
    let mut paydb = parts.read(Db::Paydb).await?;
    let filter = "($1::text IS NULL OR account_id = $1) AND ($2::text IS NULL OR state = $2) \
                  AND ($3::bigint IS NULL OR created_at < now() - $3 * interval '1 millisecond')";
    let account = q.account.as_ref().map(|a| a.as_str().to_string());
    let state = q.state.map(|s| s.as_str().to_string());
    // Bounded by LIST_AGE_MAX at parsing, so it fits.
    let older_than_ms = q
        .older_than
        .map(|age| i64::try_from(age.as_millis()).unwrap_or(i64::MAX));
    let order = if q.oldest_first {
        "created_at ASC, id ASC"
    } else {
        "created_at DESC, id DESC"
    };
    let payouts = sqlx::query(&format!(
        "SELECT {PAYOUT_COLUMNS} FROM payout WHERE {filter} ORDER BY {order} LIMIT $4"
    ))
    .bind(&account)
    .bind(&state)
    .bind(older_than_ms)
    .bind(limit)
    .fetch_all(&mut paydb)
    .await
    .context("listing payouts in paydb")?
    .iter()
    .map(payout_row)
    .collect::<Vec<_>>();
    let matching = if (payouts.len() as i64) < limit {
        payouts.len() as i64
    } else {
        sqlx::query_scalar(&format!("SELECT count(*) FROM payout WHERE {filter}"))
            .bind(&account)
            .bind(&state)
            .bind(older_than_ms)
            .fetch_one(&mut paydb)
            .await
            .context("counting payouts in paydb")?
    };
    let _ = sqlx::Connection::close(paydb).await;
    Ok(Listing {
        payouts,
        matching,
        oldest_first: q.oldest_first,
    })
}

pub fn render_listing(l: &Listing) -> String {
    let mut out = table(
        &[
            "PAYOUT", "ACCOUNT", "STATE", "AMOUNT", "CURRENCY", "TOKEN", "CREATED", "UPDATED",
        ],
        &l.payouts
            .iter()
            .map(|p| {
                vec![
                    p.payout_id.clone(),
                    p.account_id.clone(),
                    p.state.clone(),
                    p.amount_minor.to_string(),
                    p.currency.clone(),
                    cell(&p.token_stamp),
                    time(&p.created_at),
                    time(&p.updated_at),
                ]
            })
            .collect::<Vec<_>>(),
    );
    out.push_str(&format!(
        "{} payout(s){}\n",
        l.payouts.len(),
        if l.matching > l.payouts.len() as i64 {
            format!(
                " of {} matching ({}; narrow the filters or raise --limit, at most {LIST_LIMIT_MAX})",
                l.matching,
                if l.oldest_first { "oldest first" } else { "newest first" }
            )
        } else {
            String::new()
        }
    ));
    out
}

async fn list(args: ListArgs) -> anyhow::Result<std::process::ExitCode> {
    let parts = args.deployment.parts()?;
    if args.limit > LIST_PROGRESS_ABOVE {
        eprintln!(
            "payoutctl: reading up to {} payouts from paydb ({})",
            args.limit,
            if args.oldest_first {
                "oldest first"
            } else {
                "newest first"
            }
        );
    }
    let query = ListQuery {
        account: args.account.clone(),
        state: args.state,
        older_than: args.older_than,
        oldest_first: args.oldest_first,
        limit: args.limit,
    };
    let listing = listing(&parts, &query).await?;
    if args.json {
        println!("{}", serde_json::to_string(&listing)?);
    } else {
        print!("{}", render_listing(&listing));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------------------------
// create

async fn create(args: CreateArgs) -> anyhow::Result<std::process::ExitCode> {
    let payout_id = match &args.payout_id {
        Some(id) => id.clone(),
        None => {
            let id = PayoutId::parse(format!("p-{}", uuid::Uuid::new_v4()))
                .expect("a generated id has the id's shape");
            eprintln!(
                "payoutctl: payout id {id} (to retry safely, run again with --payout-id {id})"
            );
            id
        }
    };
    let parts = args.deployment.parts()?;
    let url = parts.payment_url()?;
    let tls = parts.operator_tls(READER_NAME)?;
    let client = payment_client::PaymentClient::connect(&url, &tls)
        .await
        .map_err(|e| exit::unreachable(format!("the payment resource at {url}"), e))?;
    let new = payment_client::model::NewPayout {
        payout_id: payout_id.clone(),
        account_id: args.account.clone(),
        amount_minor: args.amount_minor,
        currency: args.currency.clone(),
        beneficiary_ref: args.beneficiary.clone(),
    };
    let payout = match client.create_payout(&new).await {
        Ok(p) => p,
        Err(e @ payment_client::PaymentError::Transport { .. }) => {
            return Err(exit::unreachable(
                format!("the payment resource at {url}"),
                e,
            ))
        }
        Err(e) => {
            eprintln!("payoutctl: payout {payout_id} not created: {e}");
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"payout_id": payout_id.as_str(), "created": false, "refused": e.to_string()})
                );
            }
            return Ok(std::process::ExitCode::from(exit::PROBLEM));
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "created": true,
                "payout_id": payout.payout_id.as_str(),
                "account_id": payout.account_id.as_str(),
                "amount_minor": payout.amount_minor,
                "currency": payout.currency.to_string(),
                "beneficiary_ref": payout.beneficiary_ref,
                "state": payout.state.as_str(),
                "client_reference": payout.client_reference,
                "workflow_id": payout_domain::workflow_id(&payout.payout_id),
                "created_at": payout.created_at,
            })
        );
    } else {
        println!(
            "payout {} {} on account {}: {} {} to {} (client reference {}; workflow {})",
            payout.payout_id,
            payout.state.as_str(),
            payout.account_id,
            payout.amount_minor,
            payout.currency,
            payout.beneficiary_ref,
            payout.client_reference,
            payout_domain::workflow_id(&payout.payout_id)
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------------------------
// abandon

/// What `payout abandon` prints with `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct AbandonReport {
    pub payout_id: String,
    pub workflow_id: String,
    pub accepted: bool,
    /// The workflow's answer (`None` when the Update was rejected by its validator).
    pub answer: Option<payout_workflows::AbandonAnswer>,
    /// The validator's reason, when the Update was rejected.
    pub rejected: Option<String>,
    /// The refusal recorded by this command, when the payout's workflow is not running.
    pub not_running: Option<NotRunning>,
    /// The payout's workflow was not running and this command started it again before asking.
    pub resumed: Option<Resumed>,
    /// Whether the payment resource's own record bears the workflow's answer out (issue 33):
    /// anyone polling the payout queue can answer the Update, so the answer alone is not trusted.
    pub confirmation: Option<Confirmation>,
}

/// What the payment resource's record says of an abandon a workflow answered: the record is the
/// payment resource's, the answer only the word of whoever served the Update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Confirmation {
    /// The record bears the answer out: `abandoned` with the payout ABANDONED by this operator
    /// for this reason; `accepted_waiting_for_lock` with this signed request's accepted decision
    /// on record; `refused` with the request not carried out.
    pub agrees: bool,
    /// The payout's state in the payment resource.
    pub state: String,
    /// The audit row that bears the answer out, if any.
    pub audit_event_id: Option<i64>,
    /// What was compared, in words.
    pub detail: String,
}

/// Checks `answer` (to the abandon `signal`) against the payment resource's `record` of the
/// payout: pure, so every outcome is tested without a system.
pub fn confirm_abandon(
    answer: &payout_workflows::AbandonAnswer,
    signal: &payout_workflows::AbandonSignal,
    record: &payment_client::PayoutWithHistory,
) -> Confirmation {
    use payout_workflows::AbandonOutcome;
    let state = record.payout.state;
    let carried_out = record.history.iter().find(|e| {
        e.kind == "transition"
            && e.to_state.as_deref() == Some(PayoutState::Abandoned.as_str())
            && e.detail["operator"].as_str() == Some(signal.operator.as_str())
            && e.detail["reason"].as_str() == Some(signal.reason.as_str())
    });
    let decided = record.history.iter().find(|e| {
        e.kind == "operator_decision"
            && e.owner.as_deref() == Some(signal.operator.as_str())
            && e.detail["decision"].as_str() == Some("abandon")
            && e.detail["accepted"].as_bool() == Some(true)
            && e.detail["reason"].as_str() == Some(signal.reason.as_str())
            && e.detail["signed_at_unix_ms"].as_u64() == Some(signal.signed_at_unix_ms)
    });
    let (agrees, event, detail) = match answer.outcome {
        AbandonOutcome::Abandoned => (
            state == PayoutState::Abandoned && carried_out.is_some(),
            carried_out,
            "answered abandoned: the payout must be ABANDONED by a transition naming this operator and reason",
        ),
        AbandonOutcome::AcceptedWaitingForLock => (
            decided.is_some() || carried_out.is_some(),
            decided.or(carried_out),
            "answered accepted: this signed request's accepted decision must be on record",
        ),
        AbandonOutcome::Refused => (
            carried_out.is_none(),
            carried_out,
            "answered refused: the request must not have been carried out",
        ),
    };
    Confirmation {
        agrees,
        state: state.as_str().to_string(),
        audit_event_id: event.map(|e| e.id),
        detail: detail.to_string(),
    }
}

/// An abandon of a payout whose workflow is not running (it has completed, or never started):
/// Temporal refused the Update before any worker saw it, so this command records the refusal in
/// the payment resource's audit trail itself (`RecordOperatorDecision`, refused, under the name
/// the operator's certificate carries, with the operator's signature).
#[derive(Debug, Clone, Serialize)]
pub struct NotRunning {
    /// Why, as recorded.
    pub reason: String,
    /// The payout's state as the payment resource reported it.
    pub state: String,
    /// The audit event that records the refusal.
    pub audit_event_id: i64,
}

async fn abandon(args: AbandonArgs) -> anyhow::Result<std::process::ExitCode> {
    let signed = crate::sign::abandon(
        &crate::sign::AbandonArgs {
            operator: args.operator.clone(),
            key_file: args.key_file.clone(),
            payout_id: args.payout_id.to_string(),
            reason: args.reason.clone(),
        },
        grant_signing::operator::now_unix_ms(),
    )?;
    let signal: payout_workflows::AbandonSignal =
        serde_json::from_value(signed).context("the signed abandon input")?;
    let parts = args.deployment.parts()?;
    let client = parts
        .temporal(&format!("payoutctl-{}", args.operator))
        .await?;
    let workflow_id = payout_domain::workflow_id(&args.payout_id);
    let mut resumed = None;
    let mut answer = ask_workflow(&client, &workflow_id, &signal, &args.payout_id).await?;
    if matches!(answer, Err(AbandonError::NotFound { .. })) {
        match resume_for_abandon(&args, &parts, &client, &workflow_id, &signal).await? {
            NotRunningOutcome::Resumed(how) => {
                resumed = Some(how);
                answer = ask_workflow(&client, &workflow_id, &signal, &args.payout_id).await?;
            }
            NotRunningOutcome::Refused(not_running) => {
                return print_abandon(
                    &args,
                    AbandonReport {
                        payout_id: args.payout_id.to_string(),
                        workflow_id,
                        accepted: false,
                        answer: None,
                        rejected: None,
                        not_running: Some(not_running),
                        resumed: None,
                        confirmation: None,
                    },
                )
            }
            NotRunningOutcome::Nothing => return Ok(std::process::ExitCode::from(exit::PROBLEM)),
        }
    }
    let report = match answer {
        Ok(answer) => {
            // The answer is the word of whoever served the Update: the payment resource's record
            // is what was done.
            let confirmation = match payout_state_now(&args, &parts, &workflow_id).await? {
                Some(record) => confirm_abandon(&answer, &signal, &record),
                None => Confirmation {
                    agrees: false,
                    state: String::new(),
                    audit_event_id: None,
                    detail: "the payment resource has no such payout".into(),
                },
            };
            AbandonReport {
                payout_id: args.payout_id.to_string(),
                workflow_id: workflow_id.clone(),
                accepted: answer.accepted,
                answer: Some(answer),
                rejected: None,
                not_running: None,
                resumed,
                confirmation: Some(confirmation),
            }
        }
        Err(AbandonError::Rejected { reason, .. }) => AbandonReport {
            payout_id: args.payout_id.to_string(),
            workflow_id: workflow_id.clone(),
            accepted: false,
            answer: None,
            rejected: Some(reason),
            not_running: None,
            resumed,
            confirmation: None,
        },
        // The run this command started ended before it answered (its inquiry found evidence
        // and it finished the payout): the refusal is recorded as for any closed workflow.
        Err(AbandonError::NotFound { .. }) => {
            let state = match payout_state_now(&args, &parts, &workflow_id).await? {
                Some(found) => found.payout.state,
                None => return Ok(std::process::ExitCode::from(exit::PROBLEM)),
            };
            match record_refusal(
                &args,
                &parts,
                &workflow_id,
                &signal,
                state,
                not_running_note(&workflow_id, state),
            )
            .await?
            {
                Some(not_running) => AbandonReport {
                    payout_id: args.payout_id.to_string(),
                    workflow_id: workflow_id.clone(),
                    accepted: false,
                    answer: None,
                    rejected: None,
                    not_running: Some(not_running),
                    resumed,
                    confirmation: None,
                },
                None => return Ok(std::process::ExitCode::from(exit::PROBLEM)),
            }
        }
        Err(e @ AbandonError::Update { .. }) => return Err(anyhow::Error::new(e)),
    };
    print_abandon(&args, report)
}

fn print_abandon(
    args: &AbandonArgs,
    report: AbandonReport,
) -> anyhow::Result<std::process::ExitCode> {
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", render_abandon(&report));
    }
    let confirmed = report.confirmation.as_ref().is_none_or(|c| c.agrees);
    Ok(std::process::ExitCode::from(
        if report.accepted && confirmed {
            exit::OK
        } else {
            exit::PROBLEM
        },
    ))
}

/// Sends the signed abandon Update to `workflow_id` and waits (bounded by
/// [`ABANDON_ANSWER_TIMEOUT_MS`], saying so on stderr) for its answer.
async fn ask_workflow(
    client: &temporalio_client::Client,
    workflow_id: &str,
    signal: &payout_workflows::AbandonSignal,
    payout_id: &PayoutId,
) -> anyhow::Result<Result<payout_workflows::AbandonAnswer, AbandonError>> {
    eprintln!("payoutctl: asking {workflow_id} to abandon (the workflow answers once the decision is on record)");
    let update = payout_workflows::abandon::execute(client, workflow_id, signal.clone(), None);
    tokio::pin!(update);
    let started = std::time::Instant::now();
    loop {
        tokio::select! {
            answer = &mut update => return Ok(answer),
            _ = tokio::time::sleep(Duration::from_millis(PROGRESS_EVERY_MS)) => {
                let waited = started.elapsed();
                if waited >= Duration::from_millis(ABANDON_ANSWER_TIMEOUT_MS) {
                    anyhow::bail!(
                        "{workflow_id} did not answer within {} s: is a worker polling its task queue? \
                         This command saw no decision; `payoutctl payout show {payout_id}` shows whether one was recorded",
                        ABANDON_ANSWER_TIMEOUT_MS / 1000,
                    );
                }
                eprintln!("payoutctl: still waiting for {workflow_id}'s answer ({} s)", waited.as_secs());
            }
        }
    }
}

/// What `payout abandon` did about a payout whose workflow was not running.
enum NotRunningOutcome {
    /// The payout may be abandoned now (PENDING, or RAIL_AMBIGUOUS past the resolution SLA by
    /// the payment resource's record): its workflow runs again and can judge the Update.
    Resumed(Resumed),
    /// Refused and recorded in the payment resource's audit trail (see [`NotRunning`]).
    Refused(NotRunning),
    /// Nothing could be recorded; stderr says why.
    Nothing,
}

/// The payout's workflow was not running and this command started it again (the resolver's
/// start path: the same takeover and the same resume input as the scheduled resume pass), so
/// the abandon went through the one fenced path: the run takes a grant, the payment resource
/// verifies the operator's signature, and both audit rows are written as for any abandon.
#[derive(Debug, Clone, Serialize)]
pub struct Resumed {
    /// False when a run was already going (the resume pass started it at the same moment).
    pub started: bool,
    /// The owner of the grant the dead run left held on the account's key, taken over (an
    /// audited force-revoke under the operator's name) before the start.
    pub took_over_from: Option<String>,
}

/// The payout as the payment resource records it, with its audit history; `None` once it has
/// said on stderr that there is no such payout.
async fn payout_state_now(
    args: &AbandonArgs,
    parts: &Parts,
    workflow_id: &str,
) -> anyhow::Result<Option<payment_client::PayoutWithHistory>> {
    use payment_client::PaymentError;
    let url = parts.payment_url()?;
    let tls = parts.operator_tls(&args.operator)?;
    let client = payment_client::PaymentClient::connect(&url, &tls)
        .await
        .map_err(|e| exit::unreachable(format!("the payment resource at {url}"), e))?;
    match client.get_payout(&args.payout_id).await {
        Ok(found) => Ok(Some(found)),
        Err(PaymentError::PayoutNotFound { .. }) => {
            eprintln!(
                "payoutctl: no workflow {workflow_id} and no payout {}: nothing was changed or recorded",
                args.payout_id
            );
            Ok(None)
        }
        Err(e @ PaymentError::Transport { .. }) => Err(exit::unreachable(
            format!("the payment resource at {url}"),
            e,
        )),
        Err(e) => Err(anyhow::Error::new(e).context(format!("reading payout {}", args.payout_id))),
    }
}

fn not_running_note(workflow_id: &str, state: PayoutState) -> String {
    format!(
        "refused: workflow {workflow_id} is not running (it has completed, or was never started); \
         the payout is {}{}",
        state.as_str(),
        if state.is_terminal() {
            ": there is nothing to abandon"
        } else {
            ""
        }
    )
}

/// When the payout entered RAIL_AMBIGUOUS, by the payment resource's record (its first
/// transition there), as the workflow and the payment resource's own SLA check read it.
fn ambiguous_since(history: &[payment_client::model::AuditEvent]) -> Option<DateTime<Utc>> {
    history
        .iter()
        .filter(|e| e.kind == "transition" && e.to_state.as_deref() == Some("RAIL_AMBIGUOUS"))
        .map(|e| e.at)
        .min()
}

/// Why an abandon of a payout in `state` whose workflow is not running is refused without
/// starting it, if it is: a terminal payout (nothing to abandon), a state the spec never lets
/// an operator abandon, a RAIL_AMBIGUOUS payout before its resolution SLA by the payment
/// resource's record (fail closed: no recorded entry into RAIL_AMBIGUOUS is an SLA not passed).
fn refusal_without_run(
    workflow_id: &str,
    state: PayoutState,
    since: Option<DateTime<Utc>>,
    sla: Duration,
    now: DateTime<Utc>,
) -> Option<String> {
    match state {
        PayoutState::Pending => None,
        PayoutState::RailAmbiguous => {
            let ends = since.and_then(|s| {
                chrono::Duration::from_std(sla)
                    .ok()
                    .and_then(|sla| s.checked_add_signed(sla))
            });
            match (since, ends) {
                (Some(_), Some(ends)) if ends <= now => None,
                (Some(since), Some(ends)) => Some(format!(
                    "refused: RAIL_AMBIGUOUS since {} and the resolution SLA ({} s) ends at {}: \
                     the rail is still being asked; nothing was started (workflow {workflow_id} \
                     is not running)",
                    time(&since),
                    sla.as_secs(),
                    time(&ends)
                )),
                _ => Some(format!(
                    "refused: RAIL_AMBIGUOUS but the payment resource records no entry into it, \
                     so the resolution SLA is not known to have passed; nothing was started \
                     (workflow {workflow_id} is not running)"
                )),
            }
        }
        state if state.is_terminal() => Some(not_running_note(workflow_id, state)),
        other => Some(format!(
            "refused: state {other} does not allow abandon (only PENDING, or RAIL_AMBIGUOUS past \
             the resolution SLA); workflow {workflow_id} is not running: the reconciler's resume \
             pass hands the payout back to a workflow"
        )),
    }
}

/// An abandon whose workflow is not running: refused and recorded (terminal, a state that does
/// not allow it, an SLA not passed), or the payout's workflow started again as the resume pass
/// starts it (its account's key taken over from a grant whose workflow is not running, then the
/// resume input) and waited for until it can judge the Update: it has read the payout, and a
/// RAIL_AMBIGUOUS run has held a grant and found the SLA passed by the record. A start that
/// races the resume pass's is Temporal's "already started": the Update goes to that run.
async fn resume_for_abandon(
    args: &AbandonArgs,
    parts: &Parts,
    client: &temporalio_client::Client,
    workflow_id: &str,
    signal: &payout_workflows::AbandonSignal,
) -> anyhow::Result<NotRunningOutcome> {
    let Some(found) = payout_state_now(args, parts, workflow_id).await? else {
        return Ok(NotRunningOutcome::Nothing);
    };
    let state = found.payout.state;
    let sla = Duration::from_millis(args.resolution_sla_ms);
    if let Some(note) = refusal_without_run(
        workflow_id,
        state,
        ambiguous_since(&found.history),
        sla,
        Utc::now(),
    ) {
        return Ok(
            match record_refusal(args, parts, workflow_id, signal, state, note).await? {
                Some(not_running) => NotRunningOutcome::Refused(not_running),
                None => NotRunningOutcome::Nothing,
            },
        );
    }
    let local = parts.local_system();
    let temporal = resolver::resume::Temporal::from_client(
        client.clone(),
        args.task_queue
            .clone()
            .or_else(|| local.map(|s| s.task_queue.clone()))
            .unwrap_or_else(|| crate::record::TASK_QUEUE.to_string()),
        args.settlement_window_ms
            .or_else(|| local.map(|s| s.settlement_window_ms))
            .unwrap_or(SETTLEMENT_WINDOW_DEFAULT_MS),
        args.resolution_sla_ms,
        format!("operator {}'s abandon (payoutctl)", args.operator),
    );
    let account = found.payout.account_id.as_str().to_string();
    let lock_url = parts.lock_url()?;
    let lock = lock_client::LockClient::connect(&lock_url, &parts.operator_tls(&args.operator)?)
        .await
        .map_err(|e| exit::unreachable(format!("the lock service at {lock_url}"), e))?;
    let took_over_from = resolver::resume::take_over_if_not_running_as(
        &lock,
        &account,
        &args.operator,
        |holder, holder_process| {
            let temporal = temporal.clone();
            async move { temporal.holder_status(&holder, &holder_process).await }
        },
    )
    .await
    .map_err(|detail| anyhow::anyhow!("{workflow_id} is not running and its account's key could not be checked: {detail}; nothing was started"))?;
    if let Some(from) = &took_over_from {
        eprintln!(
            "payoutctl: took the account's key over from {from} (its workflow is not running)"
        );
    }
    let started = temporal
        .resume(&args.payout_id, &account)
        .await
        .with_context(|| format!("starting {workflow_id} again"))?;
    eprintln!(
        "payoutctl: {workflow_id} was not running; {} (the payout is {}), waiting until it can judge the abandon",
        if started {
            "started it again as the resume pass does"
        } else {
            "a run was started meanwhile (the resume pass)"
        },
        state.as_str()
    );
    wait_until_ready(client, workflow_id).await?;
    Ok(NotRunningOutcome::Resumed(Resumed {
        started,
        took_over_from,
    }))
}

/// Waits (bounded by [`ABANDON_ANSWER_TIMEOUT_MS`]) until the run can judge an abandon: it has
/// read the payout (its first event), and a RAIL_AMBIGUOUS run has found the SLA passed by the
/// payment resource's record (it does so under its grant, after the lock). Before that its
/// validator would judge a state it has not read, or an SLA it has not yet checked.
async fn wait_until_ready(
    client: &temporalio_client::Client,
    workflow_id: &str,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let mut said = std::time::Instant::now();
    let mut last = String::from("(no answer to its status query yet)");
    loop {
        let asked = tokio::time::timeout(
            Duration::from_millis(READY_QUERY_TIMEOUT_MS),
            payout_workflows::client::status(client, workflow_id),
        )
        .await;
        if let Ok(Ok(status)) = asked {
            let read = !status.last_event.is_empty();
            if read && (status.state != PayoutState::RailAmbiguous || status.resolution_sla_passed)
            {
                return Ok(());
            }
            last = format!(
                "{} ({})",
                status.state.as_str(),
                if status.last_event.is_empty() {
                    "not yet read"
                } else {
                    &status.last_event
                }
            );
        }
        let waited = started.elapsed();
        if waited >= Duration::from_millis(ABANDON_ANSWER_TIMEOUT_MS) {
            anyhow::bail!(
                "{workflow_id} runs again but could not judge an abandon within {} s (last seen: \
                 {last}); nothing was asked. Run the command again once it holds the account's lock",
                ABANDON_ANSWER_TIMEOUT_MS / 1000
            );
        }
        if said.elapsed() >= Duration::from_millis(PROGRESS_EVERY_MS) {
            said = std::time::Instant::now();
            eprintln!(
                "payoutctl: {workflow_id} runs again; waiting for it ({} s): {last}",
                waited.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(READY_POLL_MS)).await;
    }
}

/// Records the refusal of an abandon whose workflow is not running (see [`NotRunning`]), with
/// `reason` as its note: what was recorded, or `None` once it has said on stderr why nothing
/// could be (the payment resource refused the record).
async fn record_refusal(
    args: &AbandonArgs,
    parts: &Parts,
    workflow_id: &str,
    signal: &payout_workflows::AbandonSignal,
    state: PayoutState,
    reason: String,
) -> anyhow::Result<Option<NotRunning>> {
    use payment_client::PaymentError;
    let url = parts.payment_url()?;
    let tls = parts.operator_tls(&args.operator)?;
    let client = payment_client::PaymentClient::connect(&url, &tls)
        .await
        .map_err(|e| exit::unreachable(format!("the payment resource at {url}"), e))?;
    let unreachable =
        |e: PaymentError| exit::unreachable(format!("the payment resource at {url}"), e);
    let decision = payment_client::model::OperatorDecision {
        payout_id: args.payout_id.clone(),
        operator: args.operator.clone(),
        decision: "abandon".into(),
        reason: signal.reason.clone(),
        accepted: false,
        note: reason.clone(),
        token: None,
        signature: grant_signing::operator::from_hex(&signal.signature).map(|signature| {
            payment_client::model::OperatorSignature {
                signature,
                signed_at_unix_ms: signal.signed_at_unix_ms,
            }
        }),
    };
    match client.record_operator_decision(&decision).await {
        Ok(event) => Ok(Some(NotRunning {
            reason,
            state: state.as_str().to_string(),
            audit_event_id: event.id,
        })),
        // Answered, and refused at the door (a payment resource whose table does not admit an
        // operator's certificate to it): a refusal, not a connection that failed.
        Err(e @ PaymentError::Transport { code, .. }) if code != tonic::Code::PermissionDenied => {
            Err(unreachable(e))
        }
        Err(e) => {
            eprintln!(
                "payoutctl: {workflow_id} REFUSED ({reason}); the payment resource did not record \
                 the refusal: {e}"
            );
            Ok(None)
        }
    }
}

pub fn render_abandon(r: &AbandonReport) -> String {
    if let Some(n) = &r.not_running {
        return format!(
            "{} REFUSED (the payout's workflow is not running; recorded in the payment resource's \
             audit trail, event {}): {}",
            r.workflow_id, n.audit_event_id, n.reason
        );
    }
    match (&r.answer, &r.rejected) {
        (Some(a), _) => {
            let resumed = match &r.resumed {
                None => String::new(),
                Some(x) => format!(
                    " [its workflow was not running: {}{}]",
                    if x.started {
                        "started again by this command"
                    } else {
                        "started meanwhile by the resume pass"
                    },
                    x.took_over_from
                        .as_deref()
                        .map(|from| format!(", the account's key taken over from {from}"))
                        .unwrap_or_default()
                ),
            };
            let what = match a.outcome {
                payout_workflows::AbandonOutcome::Abandoned => "ACCEPTED: abandoned",
                payout_workflows::AbandonOutcome::AcceptedWaitingForLock => {
                    "ACCEPTED: on record, carried out once the payout holds its account's lock"
                }
                payout_workflows::AbandonOutcome::Refused => "REFUSED",
            };
            let answered = format!(
                "{} {what} (decided by the {}; the payout is {}): {}{resumed}",
                r.workflow_id,
                match a.decided_by {
                    payout_workflows::AbandonDecider::Workflow => "workflow",
                    payout_workflows::AbandonDecider::PaymentResource => "payment resource",
                },
                a.state.as_str(),
                a.reason
            );
            match &r.confirmation {
                Some(c) if !c.agrees => format!(
                    "NOT CONFIRMED: the payment resource's record does not bear the workflow's answer out \
                     (the payout is {} there; {}): whatever answered the Update may not be this system's \
                     worker; nothing is assumed done. The answer was: {answered}",
                    if c.state.is_empty() { "unknown" } else { &c.state },
                    c.detail
                ),
                _ => answered,
            }
        }
        (None, rejected) => format!(
            "{} REFUSED by the workflow's validator (nothing recorded): {}",
            r.workflow_id,
            rejected.as_deref().unwrap_or("no reason given")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payout in `state` whose audit trail is `history`.
    fn record(
        state: PayoutState,
        history: Vec<payment_client::model::AuditEvent>,
    ) -> payment_client::PayoutWithHistory {
        let now = Utc::now();
        payment_client::PayoutWithHistory {
            payout: payment_client::model::Payout {
                payout_id: PayoutId::parse("p-1").unwrap(),
                account_id: AccountId::parse("a-1").unwrap(),
                amount_minor: 100,
                currency: Currency::parse("EUR").unwrap(),
                beneficiary_ref: "ben-1".into(),
                state,
                client_reference: "cref-p-1".into(),
                claimed_by: None,
                token_stamp: None,
                failure_reason: None,
                rail_ref: None,
                rail_outcome: None,
                transaction_group: None,
                created_at: now,
                claimed_at: None,
                submitted_at: None,
                settled_at: None,
                updated_at: now,
                instruction: None,
            },
            history,
        }
    }

    fn event(
        id: i64,
        kind: &str,
        owner: Option<&str>,
        to_state: Option<&str>,
        detail: serde_json::Value,
    ) -> payment_client::model::AuditEvent {
        payment_client::model::AuditEvent {
            id,
            payout_id: Some("p-1".into()),
            account_id: Some("a-1".into()),
            kind: kind.into(),
            actor: "operator".into(),
            owner: owner.map(str::to_string),
            token: Some(7),
            from_state: None,
            to_state: to_state.map(str::to_string),
            event: None,
            detail,
            at: Utc::now(),
        }
    }

    fn answer(outcome: payout_workflows::AbandonOutcome) -> payout_workflows::AbandonAnswer {
        payout_workflows::AbandonAnswer {
            payout_id: "p-1".into(),
            outcome,
            accepted: outcome != payout_workflows::AbandonOutcome::Refused,
            decided_by: payout_workflows::AbandonDecider::PaymentResource,
            reason: String::new(),
            state: PayoutState::Abandoned,
        }
    }

    /// Issue 33, row 3e's logic: an answer is confirmed only by the payment resource's record of
    /// this very request; an answer the record does not bear out (a rogue poller's) is not.
    #[test]
    fn an_abandon_answer_is_confirmed_only_by_the_payment_resources_record() {
        use payout_workflows::AbandonOutcome as O;
        let signal = payout_workflows::AbandonSignal {
            operator: "op-1".into(),
            reason: "customer cancelled".into(),
            signature: "00".into(),
            signed_at_unix_ms: 1_800_000_000_000,
        };
        let abandoned_by_op = event(
            11,
            "transition",
            Some("worker-1"),
            Some("ABANDONED"),
            serde_json::json!({"operator": "op-1", "reason": "customer cancelled"}),
        );
        let decided = |signed_at: u64, reason: &str| {
            event(
                12,
                "operator_decision",
                Some("op-1"),
                None,
                serde_json::json!({"decision": "abandon", "accepted": true, "reason": reason,
                                   "signed_at_unix_ms": signed_at}),
            )
        };
        let cases = [
            (
                "abandoned, on record",
                O::Abandoned,
                record(PayoutState::Abandoned, vec![abandoned_by_op.clone()]),
                true,
            ),
            (
                "abandoned, but PENDING with nothing on record",
                O::Abandoned,
                record(PayoutState::Pending, vec![]),
                false,
            ),
            (
                "abandoned by another operator's request",
                O::Abandoned,
                record(
                    PayoutState::Abandoned,
                    vec![event(
                        11,
                        "transition",
                        None,
                        Some("ABANDONED"),
                        serde_json::json!({"operator": "op-2", "reason": "customer cancelled"}),
                    )],
                ),
                false,
            ),
            (
                "waiting, this request on record",
                O::AcceptedWaitingForLock,
                record(
                    PayoutState::Pending,
                    vec![decided(1_800_000_000_000, "customer cancelled")],
                ),
                true,
            ),
            (
                "waiting, an earlier request on record",
                O::AcceptedWaitingForLock,
                record(
                    PayoutState::Pending,
                    vec![decided(1_700_000_000_000, "customer cancelled")],
                ),
                false,
            ),
            (
                "waiting, another reason on record",
                O::AcceptedWaitingForLock,
                record(
                    PayoutState::Pending,
                    vec![decided(1_800_000_000_000, "other")],
                ),
                false,
            ),
            (
                "waiting, nothing on record",
                O::AcceptedWaitingForLock,
                record(PayoutState::Pending, vec![]),
                false,
            ),
            (
                "refused, not carried out",
                O::Refused,
                record(PayoutState::Posted, vec![]),
                true,
            ),
            (
                "refused, but carried out",
                O::Refused,
                record(PayoutState::Abandoned, vec![abandoned_by_op]),
                false,
            ),
        ];
        for (case, outcome, record, agrees) in cases {
            let c = confirm_abandon(&answer(outcome), &signal, &record);
            assert_eq!(c.agrees, agrees, "{case}: {c:?}");
            assert_eq!(c.state, record.payout.state.as_str(), "{case}");
        }
    }

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        crate::ops::cli_test::parse(args)
    }

    #[test]
    fn bad_input_is_a_usage_error_that_names_the_problem() {
        for (args, words) in [
            (vec!["show", "p 1"], "may contain only"),
            (vec!["list", "--state", "PAID"], "is not a payout state"),
            (vec!["list", "--limit", "1001"], "1001"),
            (vec!["list", "--older-than", "15"], "is not an age"),
            (vec!["list", "--older-than", "15x"], "is not an age"),
            (vec!["list", "--older-than", "m"], "is not an age"),
            (vec!["list", "--older-than", "0m"], "is not an age"),
            (
                vec!["list", "--older-than", "-5m"],
                "unexpected argument '-5'",
            ),
            (
                vec!["list", "--older-than", "99999999999d"],
                "older than any payout",
            ),
            (vec!["list", "--oldest-first=yes"], "unexpected value"),
            (
                vec![
                    "abandon",
                    "p-1",
                    "--reason",
                    "r",
                    "--operator",
                    "o",
                    "--key-file",
                    "k",
                    "--resolution-sla-ms",
                    "soon",
                ],
                "soon",
            ),
            (
                vec![
                    "create",
                    "--account",
                    "a-1",
                    "--amount-minor",
                    "-5",
                    "--currency",
                    "EUR",
                    "--beneficiary",
                    "b-1",
                ],
                "amount must be positive, got -5",
            ),
            (
                vec![
                    "create",
                    "--account",
                    "a-1",
                    "--amount-minor",
                    "5",
                    "--currency",
                    "XYZ",
                    "--beneficiary",
                    "b-1",
                ],
                "not supported",
            ),
        ] {
            let e = parse(&args)
                .err()
                .unwrap_or_else(|| panic!("{args:?} parsed"));
            assert_eq!(e.exit_code(), i32::from(exit::USAGE), "{args:?}");
            assert!(e.to_string().contains(words), "{args:?}: {e}");
        }
        let Command::List(list) = parse(&["list", "--state", "rail_ambiguous"]).unwrap() else {
            panic!("not list")
        };
        assert_eq!(list.state, Some(PayoutState::RailAmbiguous));
        assert_eq!(list.limit, LIST_LIMIT_DEFAULT);
        assert!(!list.oldest_first && list.older_than.is_none());
        let Command::List(list) =
            parse(&["list", "--older-than", "15m", "--oldest-first"]).unwrap()
        else {
            panic!("not list")
        };
        assert_eq!(list.older_than, Some(Duration::from_secs(900)));
        assert!(list.oldest_first);
        for (age, seconds) in [("90s", 90), ("2h", 7_200), ("1d", 86_400)] {
            assert_eq!(parse_age(age), Ok(Duration::from_secs(seconds)), "{age}");
        }
    }

    #[test]
    fn every_flag_has_help() {
        crate::ops::cli_test::assert_every_flag_has_help::<Command>();
    }
}
