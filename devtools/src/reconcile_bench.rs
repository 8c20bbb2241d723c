//! `payoutdev bench reconcile`: the reconciler's detective pass over a large book, full and
//! incremental, on a private stack of its own (real PostgreSQL, durable).
//!
//! The book is seeded by SQL as the superuser, straight into paydb, proxydb and gldb, in the
//! shapes the services write (`bench e2e --history` seeds entries the same way): `--payouts`
//! POSTED payouts spread evenly over `--accounts` accounts, each with its two ledger entries, its
//! four recorded transitions (the audit chain's trigger on: every row is hashed into its
//! account's chain as a service's would be), its posting's and its lifecycle event's outbox rows
//! and their GL journal (two entries) and event, and its proxy submission, all dated a month
//! back. Then `--new-payouts` more on `--new-accounts` fresh accounts, dated now: the traffic
//! since the last scheduled run.
//!
//! Figures, each the median (min, max) of `--runs` runs: the full pass; the incremental pass
//! after the new traffic (the watermark and anchor of a clean full pass taken before it, the
//! deployment's overlap); the peak resident memory of each (every pass runs in a process of its
//! own, `payoutdev bench reconcile-pass`, which reports its VmHWM as it ends: a process that ran
//! a larger pass before would keep that pass's pages); and the floor, one `count(*)` scan of
//! every table the full pass reads, the least any pass that looks at every row could cost. The rail
//! cross-check and the grant check are left out (no rail proxy, no etcd given): each is bounded
//! per run by its own cap (the rail check's lookups per run, the grant horizon), not by the book.

use std::time::{Duration, Instant};

use clap::Args as ClapArgs;
use serde::Serialize;
use testkit::{PgServer, Stack};

#[derive(ClapArgs)]
pub struct Args {
    /// POSTED payouts in the book before the traffic.
    #[arg(long, default_value_t = 1_000_000)]
    pub payouts: usize,
    /// Accounts the book's payouts are spread over (the payouts must divide evenly).
    #[arg(long, default_value_t = 10_000)]
    pub accounts: usize,
    /// Payouts since the last clean run (the incremental pass's work).
    #[arg(long, default_value_t = 1_000)]
    pub new_payouts: usize,
    /// Fresh accounts those payouts are spread over.
    #[arg(long, default_value_t = 100)]
    pub new_accounts: usize,
    /// Runs of each pass; figures are their median, min and max.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// One JSON object with every figure.
    #[arg(long)]
    pub json: bool,
}

/// One pass's figures over its runs.
#[derive(Debug, Serialize)]
pub struct Figures {
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    /// The process's peak resident memory during the run, median over the runs (MiB).
    pub peak_rss_mib: f64,
    /// Accounts examined (None: every account).
    pub accounts_examined: Option<usize>,
}

#[derive(Debug, Serialize)]
struct Report {
    bench: &'static str,
    profile: &'static str,
    payouts: usize,
    accounts: usize,
    new_payouts: usize,
    new_accounts: usize,
    seed_s: f64,
    floor: Figures,
    full: Figures,
    incremental: Figures,
    full_over_floor: f64,
    incremental_over_full: f64,
}

pub async fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    anyhow::ensure!(
        args.payouts > 0 && args.accounts > 0 && args.payouts.is_multiple_of(args.accounts),
        "--payouts must be a positive multiple of --accounts"
    );
    anyhow::ensure!(
        args.new_payouts > 0
            && args.new_accounts > 0
            && args.new_payouts.is_multiple_of(args.new_accounts),
        "--new-payouts must be a positive multiple of --new-accounts"
    );
    anyhow::ensure!(args.runs > 0, "--runs must be positive");
    let say = |line: String| {
        if !args.json {
            eprintln!("{line}");
        }
    };
    let stack = tokio::task::spawn_blocking(|| Stack::builder().durable(true).start()).await??;
    let paydb = stack
        .provisioned_db(PgServer::Main, db_access::Database::Paydb)
        .await;
    let proxydb = stack
        .provisioned_db(PgServer::Proxy, db_access::Database::Proxydb)
        .await;
    let gldb = stack
        .provisioned_db(PgServer::Main, db_access::Database::Gldb)
        .await;
    let seeded = Instant::now();
    let book = Batch {
        first_payout: 1,
        payouts: args.payouts,
        first_account: 1,
        accounts: args.accounts,
        age: "30 days",
    };
    say(format!(
        "seeding {} payouts over {} accounts ...",
        args.payouts, args.accounts
    ));
    seed(&paydb, &proxydb, &gldb, &book).await?;
    let seed_s = seeded.elapsed().as_secs_f64();
    say(format!("seeded in {seed_s:.0} s"));

    let reader = |server: PgServer, admin: &str| {
        stack
            .pg(server)
            .login_url("reconciler", testkit::system::database_name(admin))
    };
    let databases = Databases {
        paydb: reader(PgServer::Main, &paydb),
        proxydb: reader(PgServer::Proxy, &proxydb),
        gldb: reader(PgServer::Main, &gldb),
    };
    let work = tempfile::tempdir()?;

    let floor = measure(args.runs, || {
        one_pass(work.path(), &databases, Pass::Floor, None)
    })
    .await?;
    say(format!(
        "floor (a count(*) scan of every table): {:.2} s",
        floor.0.median_s
    ));
    let (floor, _) = floor;
    let (full, clean) = measure(args.runs, || {
        one_pass(work.path(), &databases, Pass::Full, None)
    })
    .await?;
    say(format!(
        "full pass: {:.2} s, {:.0} MiB",
        full.median_s, full.peak_rss_mib
    ));

    let traffic = Batch {
        first_payout: args.payouts + 1,
        payouts: args.new_payouts,
        first_account: args.accounts + 1,
        accounts: args.new_accounts,
        age: "0 seconds",
    };
    seed(&paydb, &proxydb, &gldb, &traffic).await?;
    let Some(clean) = clean else {
        anyhow::bail!("the full pass left no watermark");
    };
    let (incremental, _) = measure(args.runs, || {
        one_pass(work.path(), &databases, Pass::Incremental, Some(&clean))
    })
    .await?;
    say(format!(
        "incremental pass: {:.3} s, {:.0} MiB",
        incremental.median_s, incremental.peak_rss_mib
    ));

    let report = Report {
        bench: "reconcile",
        profile: crate::bench::profile(),
        payouts: args.payouts,
        accounts: args.accounts,
        new_payouts: args.new_payouts,
        new_accounts: args.new_accounts,
        seed_s,
        full_over_floor: full.median_s / floor.median_s,
        incremental_over_full: incremental.median_s / full.median_s,
        floor,
        full,
        incremental,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn render(r: &Report) -> String {
    let mut out = format!(
        "reconcile: {} POSTED payouts over {} accounts, then {} new payouts on {} new accounts; \
         {} build; median (min-max) of the runs\n",
        r.payouts, r.accounts, r.new_payouts, r.new_accounts, r.profile
    );
    out.push_str(&format!(
        "{:<44} {:>22} {:>14} {:>10}\n",
        "pass", "time (s)", "peak RSS (MiB)", "accounts"
    ));
    for (name, f) in [
        ("floor: count(*) scan of every table", &r.floor),
        ("full pass (every account)", &r.full),
        ("incremental pass (touched since last run)", &r.incremental),
    ] {
        out.push_str(&format!(
            "{:<44} {:>8.3} ({:.3}-{:.3}) {:>14.0} {:>10}\n",
            name,
            f.median_s,
            f.min_s,
            f.max_s,
            f.peak_rss_mib,
            f.accounts_examined
                .map_or_else(|| "all".to_string(), |n| n.to_string())
        ));
    }
    out.push_str(&format!(
        "full / floor: {:.2}; incremental / full: {:.4}\n",
        r.full_over_floor, r.incremental_over_full
    ));
    out
}

/// Runs `pass` `runs` (at least one) times: the median, min and max time, the median peak
/// memory, and the watermark the last run left.
async fn measure<F, Fut>(runs: usize, mut pass: F) -> anyhow::Result<(Figures, Option<Clean>)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<PassOutcome>>,
{
    let mut times = Vec::with_capacity(runs);
    let mut peaks = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs.max(1) {
        let outcome = pass().await?;
        times.push(Duration::from_secs_f64(outcome.elapsed_s));
        peaks.push(outcome.peak_rss_mib);
        last = Some(outcome);
    }
    let Some(PassOutcome {
        accounts_examined,
        clean: answer,
        ..
    }) = last
    else {
        anyhow::bail!("no run");
    };
    let runs = times.len();
    times.sort_unstable();
    peaks.sort_by(f64::total_cmp);
    let secs = |d: &Duration| d.as_secs_f64();
    Ok((
        Figures {
            median_s: secs(&times[runs / 2]),
            min_s: secs(&times[0]),
            max_s: secs(&times[runs - 1]),
            peak_rss_mib: peaks[runs / 2],
            accounts_examined,
        },
        answer,
    ))
}

/// The process's peak resident set (VmHWM), in MiB; 0 where unknown (not Linux).
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The reconciler's logins to the three databases.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Databases {
    paydb: String,
    proxydb: String,
    gldb: String,
}

/// Which pass a `reconcile-pass` process runs.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize)]
pub enum Pass {
    Floor,
    Full,
    Incremental,
}

/// What a clean pass leaves for the next: the anchor and the watermark.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Clean {
    audit_heads: Vec<reconciler::AuditHead>,
    watermark: reconciler::Watermark,
}

/// What a `reconcile-pass` process is asked.
#[derive(Debug, Serialize, serde::Deserialize)]
struct PassInput {
    databases: Databases,
    pass: Pass,
    since: Option<Clean>,
}

/// What a `reconcile-pass` process reports as it ends.
#[derive(Debug, Serialize, serde::Deserialize)]
struct PassOutcome {
    elapsed_s: f64,
    peak_rss_mib: f64,
    accounts_examined: Option<usize>,
    clean: Option<Clean>,
}

/// `payoutdev bench reconcile-pass`: one pass in a process of its own (the parent's figures).
#[derive(ClapArgs)]
pub struct PassArgs {
    /// The pass's input, written by `bench reconcile`.
    #[arg(long)]
    pub input: std::path::PathBuf,
}

/// Runs one pass in a child process (this executable's `bench reconcile-pass`) and reads its
/// outcome.
async fn one_pass(
    dir: &std::path::Path,
    databases: &Databases,
    pass: Pass,
    since: Option<&Clean>,
) -> anyhow::Result<PassOutcome> {
    use anyhow::Context;
    let input = dir.join("pass.json");
    std::fs::write(
        &input,
        serde_json::to_vec(&PassInput {
            databases: databases.clone(),
            pass,
            since: since.cloned(),
        })?,
    )?;
    let out = tokio::process::Command::new(std::env::current_exe()?)
        .args(["bench", "reconcile-pass", "--input"])
        .arg(&input)
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .context("running bench reconcile-pass")?;
    anyhow::ensure!(out.status.success(), "bench reconcile-pass {pass:?} failed");
    serde_json::from_slice(&out.stdout).context("reading bench reconcile-pass's outcome")
}

/// The child's side: the pass, timed, then its peak memory, as one JSON object on stdout.
pub async fn one_pass_here(args: PassArgs) -> anyhow::Result<std::process::ExitCode> {
    let input: PassInput = serde_json::from_slice(&std::fs::read(&args.input)?)?;
    let connect = |url: String| async move {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(quiet(&url)?)
            .await
    };
    let sources = reconciler::Sources {
        paydb: connect(input.databases.paydb.clone()).await?,
        proxydb: connect(input.databases.proxydb.clone()).await?,
        gldb: connect(input.databases.gldb.clone()).await?,
        rail_proxy: None,
        lock_grants: None,
        // The bench's synthetic book opens its accounts without operators: that check is skipped.
        operators: None,
    };
    let options = match &input.since {
        Some(clean) => reconciler::Options {
            audit_anchor: Some(clean.audit_heads.clone()),
            since: Some(clean.watermark),
            ..reconciler::Options::default()
        },
        None => reconciler::Options::default(),
    };
    let started = Instant::now();
    let (accounts_examined, clean) = match input.pass {
        Pass::Floor => {
            scan_every_table(&sources).await?;
            (None, None)
        }
        Pass::Full | Pass::Incremental => {
            let report = reconciler::reconcile(&sources, &options).await?;
            anyhow::ensure!(
                report.is_clean(),
                "the seeded book must reconcile clean:\n{}",
                report.render()
            );
            (
                report.accounts_examined,
                Some(Clean {
                    audit_heads: report.audit_heads,
                    watermark: report.watermark,
                }),
            )
        }
    };
    let outcome = PassOutcome {
        elapsed_s: started.elapsed().as_secs_f64(),
        peak_rss_mib: peak_rss_mib(),
        accounts_examined,
        clean,
    };
    println!("{}", serde_json::to_string(&outcome)?);
    Ok(std::process::ExitCode::SUCCESS)
}

/// The floor: every table the full pass reads, counted (one sequential scan each).
async fn scan_every_table(sources: &reconciler::Sources) -> anyhow::Result<()> {
    for (pool, tables) in [
        (
            &sources.paydb,
            &[
                "payout",
                "ledger_entry",
                "audit_event",
                "ledger_outbox",
                "account",
            ][..],
        ),
        (
            &sources.proxydb,
            &["rail_submission", "account_high_water"][..],
        ),
        (
            &sources.gldb,
            &["journals", "entries", "transaction_events"][..],
        ),
    ] {
        for table in tables {
            sqlx::query(&format!("SELECT count(*) FROM {table}"))
                .execute(pool)
                .await?;
        }
    }
    Ok(())
}

/// `url`'s options without sqlx's per-statement logging: a bench's statements are slow on purpose,
/// and its figures, not a warning per statement, are the output.
fn quiet(url: &str) -> Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
    use sqlx::ConnectOptions;
    Ok(url
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .disable_statement_logging())
}

/// One quiet connection (see [`quiet`]).
async fn connection(url: &str, what: &str) -> anyhow::Result<sqlx::PgConnection> {
    use anyhow::Context;
    use sqlx::ConnectOptions;
    quiet(url)?
        .connect()
        .await
        .with_context(|| format!("seeding: connecting to {what}"))
}

/// A range of seeded payouts (`first_payout..`) on a range of accounts, dated `age` ago.
struct Batch {
    first_payout: usize,
    payouts: usize,
    first_account: usize,
    accounts: usize,
    /// A PostgreSQL interval: how long ago the batch happened.
    age: &'static str,
}

/// Writes `batch` into the three databases as their superuser, behind every trigger but the
/// audit chain's (each row hashed into its account's chain, as a service's write would be).
/// Payout `i` is on account `first_account + (i - first_payout) % accounts`, amount 100 (1.00
/// EUR), and its token is `i`: increasing in each account's order, as the lock service's are.
async fn seed(paydb: &str, proxydb: &str, gldb: &str, batch: &Batch) -> anyhow::Result<()> {
    use anyhow::Context;
    let per_account = (batch.payouts / batch.accounts) as i64;
    let (p0, p1) = (
        batch.first_payout as i64,
        (batch.first_payout + batch.payouts - 1) as i64,
    );
    let (a0, n) = (batch.first_account as i64, batch.accounts as i64);
    // The payouts of the batch, each with its account and its moment.
    let payouts = format!(
        "SELECT i, 'seed-p' || i AS p, 'seed-a' || ({a0} + (i - {p0}) % {n}) AS a, \
                now() - interval '{age}' AS ts \
         FROM generate_series({p0}::bigint, {p1}::bigint) AS i",
        age = batch.age
    );
    let accounts = format!(
        "SELECT 'seed-a' || a AS a, a AS k, now() - interval '{age}' AS ts, \
                {p1} - ({a0} + {n} - 1 - a) AS last_token \
         FROM generate_series({a0}::bigint, {a0} + {n} - 1) AS a",
        age = batch.age
    );
    let opening: i64 = 1_000_000_000;
    let paydb_sql = [
        format!(
            "INSERT INTO account (id, currency, balance_minor, opening_balance_minor, fence, created_at, updated_at) \
             SELECT a, 'EUR', {opening} - 100 * {per_account}, {opening}, last_token, ts, ts FROM ({accounts}) s"
        ),
        format!(
            "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty, created_at) \
             SELECT md5('open' || a)::uuid, l, CASE l WHEN 1 THEN a ELSE 'sys:funding:EUR' END, 'EUR', \
                    CASE l WHEN 1 THEN {opening} ELSE -{opening} END, \
                    CASE l WHEN 1 THEN 'sys:funding:EUR' ELSE a END, ts \
             FROM ({accounts}) s CROSS JOIN (VALUES (1), (2)) AS v(l)"
        ),
        format!(
            "INSERT INTO payout (id, account_id, amount_minor, currency, beneficiary_ref, state, client_reference, \
                claimed_by, token_stamp, rail_ref, rail_outcome, transaction_group, version, created_at, claimed_at, \
                submitted_at, settled_at, updated_at) \
             SELECT p, a, 100, 'EUR', 'ben-seed', 'POSTED', 'cref-' || p, 'seed', i, 'rail-' || p, 'ACKED', \
                    md5('post' || p)::uuid, 4, ts, ts, ts, ts, ts FROM ({payouts}) s"
        ),
        format!(
            "INSERT INTO ledger_entry (transaction_group, line_number, account_id, currency, amount_minor, counterparty, payout_id, token, created_at) \
             SELECT md5('post' || p)::uuid, l, CASE l WHEN 1 THEN a ELSE 'sys:payout-clearing:EUR' END, 'EUR', \
                    CASE l WHEN 1 THEN -100 ELSE 100 END, CASE l WHEN 1 THEN 'sys:payout-clearing:EUR' ELSE a END, \
                    p, i, ts \
             FROM ({payouts}) s CROSS JOIN (VALUES (1), (2)) AS v(l)"
        ),
        format!(
            "INSERT INTO ledger_outbox (account_id, idempotency_key, kind, payload, created_at, next_attempt_at, delivered_at, journal_id) \
             SELECT a, 'seed:journal:' || p, 'JOURNAL', \
                    jsonb_build_object('source_transaction_id', p, 'entries', jsonb_build_array( \
                      jsonb_build_object('line_number', 1, 'amount', '-1.00'), \
                      jsonb_build_object('line_number', 2, 'amount', '1.00'))), \
                    ts, ts, ts, md5('journal' || p)::uuid::text FROM ({payouts}) s \
             UNION ALL \
             SELECT a, 'seed:event:' || p, 'TRANSACTION_EVENT', \
                    jsonb_build_object('source_transaction_id', p, 'event_version', 1, 'event_type', 'PAYOUT_POSTED'), \
                    ts, ts, ts, md5('event' || p)::uuid::text FROM ({payouts}) s"
        ),
    ];
    let mut conn = connection(paydb, "paydb").await?;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await?;
    for sql in &paydb_sql {
        sqlx::query(sql)
            .execute(&mut conn)
            .await
            .with_context(|| format!("seeding paydb: {sql}"))?;
    }
    // The transitions with the audit chain's trigger on: each row hashed into its account's chain.
    sqlx::query("SET session_replication_role = origin")
        .execute(&mut conn)
        .await?;
    let transitions = format!(
        "INSERT INTO audit_event (payout_id, account_id, kind, actor, owner, token, from_state, to_state, event, at) \
         SELECT p, a, 'transition', 'HOLDER', 'seed', i, t.f, t.t, t.e, ts FROM ({payouts}) s \
         CROSS JOIN (VALUES (1, 'PENDING', 'CLAIMED', 'CLAIM'), (2, 'CLAIMED', 'RAIL_SUBMITTED', 'SUBMISSION_ACCEPTED'), \
                            (3, 'RAIL_SUBMITTED', 'RAIL_ACKED', 'RAIL_ACKED'), (4, 'RAIL_ACKED', 'POSTED', 'POSTED')) \
                AS t(step, f, t, e) \
         ORDER BY i, step"
    );
    sqlx::query(&transitions)
        .execute(&mut conn)
        .await
        .context("seeding paydb's transitions")?;
    sqlx::query("ANALYZE").execute(&mut conn).await?;

    let mut conn = connection(proxydb, "proxydb").await?;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await?;
    for sql in [
        format!(
            "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, \
                currency, beneficiary_ref, outcome, rail_ref, created_at, resolved_at) \
             SELECT p, a, i, 'seed', 'cref-' || p, 100, 'EUR', 'ben-seed', 'ACKED', 'rail-' || p, ts, ts \
             FROM ({payouts}) s"
        ),
        format!(
            "INSERT INTO account_high_water (account_id, high_water, owner, updated_at) \
             SELECT a, last_token, 'seed', ts FROM ({accounts}) s"
        ),
        "ANALYZE".to_string(),
    ] {
        sqlx::query(&sql)
            .execute(&mut conn)
            .await
            .with_context(|| format!("seeding proxydb: {sql}"))?;
    }

    let mut conn = connection(gldb, "gldb").await?;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await?;
    for sql in [
        format!(
            "INSERT INTO journals (id, source_service, idempotency_key, payload_hash, source_transaction_id, \
                tracking_code, effect_kind, effect_version, occurred_at, recorded_at, correlation_id, actor_id) \
             SELECT md5('journal' || p)::uuid, 'payment-resource', 'seed:journal:' || p, repeat('0', 64), p, \
                    '', 'PAYOUT_POSTED', 1, ts, ts, p, 'seed' FROM ({payouts}) s"
        ),
        format!(
            "INSERT INTO entries (journal_id, line_number, account_id, asset_id, amount) \
             SELECT md5('journal' || p)::uuid, l, md5(CASE l WHEN 1 THEN a ELSE 'clearing' END)::uuid, 'EUR', \
                    CASE l WHEN 1 THEN -1.00 ELSE 1.00 END \
             FROM ({payouts}) s CROSS JOIN (VALUES (1), (2)) AS v(l)"
        ),
        format!(
            "INSERT INTO transaction_events (id, source_service, source_transaction_id, event_type, event_version, \
                payload_hash, occurred_at, recorded_at, correlation_id, actor_id) \
             SELECT md5('event' || p)::uuid, 'payment-resource', p, 'PAYOUT_POSTED', 1, '', ts, ts, p, 'seed' \
             FROM ({payouts}) s"
        ),
        "ANALYZE".to_string(),
    ] {
        sqlx::query(&sql)
            .execute(&mut conn)
            .await
            .with_context(|| format!("seeding gldb: {sql}"))?;
    }
    Ok(())
}
