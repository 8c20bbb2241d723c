//! The evidence tables beside paydb's audit trail are tamper-evident too (issue 17, section 3):
//! the General Ledger's operating-mode changes and refusals (gldb 0004), the rail proxy's
//! refusals, resolutions and re-armings (proxydb 0007) and paydb's quarantine replays (paydb
//! 0012) are each one hash chain, and `row_chains_intact` finds an edited row, a
//! deleted row, a removed tail, a removed head and (with the anchor an earlier run reported) a
//! rewrite of a whole chain. The tampering is done the only way it can be: as the superuser, with
//! the triggers switched off; no service role may (the attack suite).

use reconciler::row_chains::row_chains_intact;
use reconciler::{AuditHead, Options};
use testkit::db_access::Database;
use testkit::{PgServer, Stack};

/// A fresh paydb and gldb as a deployment has them; `changes` operating-mode changes written by
/// the General Ledger's own role. The superuser's pools (for the tampering) and the reconciler's
/// (for the check).
struct Dbs {
    pay_admin: sqlx::PgPool,
    gl_admin: sqlx::PgPool,
    proxy_admin: sqlx::PgPool,
    pay_reader: sqlx::PgPool,
    proxy_reader: sqlx::PgPool,
    gl_reader: sqlx::PgPool,
    proxy_url: String,
    pay_url: (String, String),
}

async fn dbs(changes: usize) -> Dbs {
    let stack = Stack::shared();
    let pg = stack.pg(PgServer::Main);
    let pay_admin_url = stack.provisioned_db(PgServer::Main, Database::Paydb).await;
    let gl_admin_url = stack.provisioned_db(PgServer::Main, Database::Gldb).await;
    let proxy_admin_url = stack
        .provisioned_db(PgServer::Proxy, Database::Proxydb)
        .await;
    let proxy_pg = stack.pg(PgServer::Proxy);
    let proxy = testkit::system::database_name(&proxy_admin_url).to_string();
    let pay = testkit::system::database_name(&pay_admin_url).to_string();
    let gl = testkit::system::database_name(&gl_admin_url).to_string();
    let ledger = sqlx::PgPool::connect(&pg.login_url("general_ledger", &gl))
        .await
        .unwrap();
    for i in 0..changes {
        sqlx::query(
            "INSERT INTO operating_mode_changes (mode, operator_id, reason) VALUES ($1, $2, $3)",
        )
        .bind(if i % 2 == 0 { "RECONCILE" } else { "MIRROR" })
        .bind("alice")
        .bind(format!("INC-{i}"))
        .execute(&ledger)
        .await
        .unwrap();
    }
    ledger.close().await;
    Dbs {
        pay_admin: sqlx::PgPool::connect(&pay_admin_url).await.unwrap(),
        gl_admin: sqlx::PgPool::connect(&gl_admin_url).await.unwrap(),
        proxy_admin: sqlx::PgPool::connect(&proxy_admin_url).await.unwrap(),
        proxy_reader: sqlx::PgPool::connect(&proxy_pg.login_url("reconciler", &proxy))
            .await
            .unwrap(),
        proxy_url: proxy_pg.login_url("rail_proxy", &proxy),
        pay_reader: sqlx::PgPool::connect(&pg.login_url("reconciler", &pay))
            .await
            .unwrap(),
        gl_reader: sqlx::PgPool::connect(&pg.login_url("reconciler", &gl))
            .await
            .unwrap(),
        pay_url: (
            pg.login_url("payment_resource", &pay),
            pg.login_url("outbox_dispatcher", &pay),
        ),
    }
}

/// Runs `sql` as the superuser with the triggers off (what only a superuser can do).
async fn tamper(admin: &sqlx::PgPool, sql: &str) {
    let mut tx = admin.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
}

async fn findings(d: &Dbs, anchor: Option<Vec<AuditHead>>) -> (Vec<String>, Vec<AuditHead>) {
    let options = Options {
        audit_anchor: anchor,
        ..Options::default()
    };
    let (check, heads) = row_chains_intact(&d.pay_reader, &d.proxy_reader, &d.gl_reader, &options)
        .await
        .unwrap();
    (check.violations, heads)
}

fn head<'a>(heads: &'a [AuditHead], chain: &str) -> &'a AuditHead {
    heads
        .iter()
        .find(|h| h.chain == chain)
        .unwrap_or_else(|| panic!("no head for {chain}: {heads:?}"))
}

/// The chain is written by the database for the service's own inserts (the migration's first
/// row included), and an untouched chain passes: the control for every tampering case below.
#[tokio::test]
async fn an_intact_chain_passes_with_and_without_its_anchor() {
    let d = dbs(4).await;
    let (violations, heads) = findings(&d, None).await;
    assert!(violations.is_empty(), "{violations:?}");
    // The migration's initial MIRROR row, then the four changes.
    assert_eq!(head(&heads, "gldb:operating_mode_changes").seq, 5);
    // Control for the edit case: rewriting a row with its own content is not flagged.
    tamper(
        &d.gl_admin,
        "UPDATE operating_mode_changes SET reason = reason WHERE chain_seq = 3",
    )
    .await;
    let (violations, again) = findings(&d, Some(heads.clone())).await;
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(again, heads);
}

#[tokio::test]
async fn an_edited_row_is_found() {
    let d = dbs(4).await;
    tamper(
        &d.gl_admin,
        "UPDATE operating_mode_changes SET operator_id = 'mallory' WHERE chain_seq = 3",
    )
    .await;
    let (violations, _) = findings(&d, None).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("gldb:operating_mode_changes row seq 3")
            && violations[0].contains("edited"),
        "{violations:?}"
    );
}

#[tokio::test]
async fn a_deleted_row_and_a_removed_tail_are_found() {
    let d = dbs(4).await;
    tamper(
        &d.gl_admin,
        "DELETE FROM operating_mode_changes WHERE chain_seq = 2",
    )
    .await;
    let (violations, _) = findings(&d, None).await;
    assert!(
        violations
            .iter()
            .any(|v| v.contains("row seq 3") && v.contains("rows deleted")),
        "{violations:?}"
    );
    let d = dbs(4).await;
    tamper(
        &d.gl_admin,
        "DELETE FROM operating_mode_changes WHERE chain_seq = 5",
    )
    .await;
    let (violations, _) = findings(&d, None).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("the head is at seq 5 but the last row is seq 4"),
        "{violations:?}"
    );
    let d = dbs(1).await;
    tamper(
        &d.gl_admin,
        "DELETE FROM row_chain_head WHERE chain = 'operating_mode_changes'",
    )
    .await;
    let (violations, _) = findings(&d, None).await;
    assert!(
        violations.iter().any(|v| v.contains("no head")),
        "{violations:?}"
    );
}

/// A rewrite of the whole chain (every hash and the head recomputed) is consistent in itself:
/// only the anchor shows it. Without the anchor it passes (the anchor's negative control).
#[tokio::test]
async fn a_rewritten_chain_is_found_only_against_the_anchor() {
    let d = dbs(3).await;
    let (_, anchor) = findings(&d, None).await;
    tamper(
        &d.gl_admin,
        "
DO $$
DECLARE r operating_mode_changes; prev bytea := row_chain_genesis('operating_mode_changes'); h bytea;
BEGIN
  UPDATE operating_mode_changes SET operator_id = 'mallory' WHERE chain_seq = 2;
  FOR r IN SELECT * FROM operating_mode_changes ORDER BY chain_seq LOOP
    h := sha256(prev || row_chain_content(r));
    UPDATE operating_mode_changes SET prev_hash = prev, row_hash = h WHERE chain_seq = r.chain_seq;
    prev := h;
  END LOOP;
  UPDATE row_chain_head SET hash = prev WHERE chain = 'operating_mode_changes';
END $$",
    )
    .await;
    let (without, _) = findings(&d, None).await;
    assert!(without.is_empty(), "consistent in itself: {without:?}");
    let (with, _) = findings(&d, Some(anchor)).await;
    assert_eq!(with.len(), 1, "{with:?}");
    assert!(
        with[0].contains("gldb:operating_mode_changes") && with[0].contains("rewritten"),
        "{with:?}"
    );
}

/// A quarantine replay, released by the payment resource's role (the only one that may call
/// `replay_quarantined`; the dispatcher's is refused), is chained; an edit of its record (the
/// operator's name) is found.
#[tokio::test]
async fn a_quarantine_replay_is_chained_and_only_the_payment_resource_may_make_one() {
    let d = dbs(0).await;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO ledger_outbox (account_id, idempotency_key, payload, quarantined_at, \
         last_error, attempts) VALUES ('acct-1', 'k-1', '{}'::jsonb, now(), 'UNBALANCED', 3) \
         RETURNING id",
    )
    .fetch_one(&d.pay_admin)
    .await
    .unwrap();
    let dispatcher = sqlx::PgPool::connect(&d.pay_url.1).await.unwrap();
    let refused = sqlx::query_scalar::<_, i64>("SELECT replay_quarantined($1, 'alice', 'fix')")
        .bind(id)
        .fetch_one(&dispatcher)
        .await
        .unwrap_err();
    assert_eq!(
        refused
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("42501"),
        "{refused}"
    );
    let payment = sqlx::PgPool::connect(&d.pay_url.0).await.unwrap();
    let replay: i64 = sqlx::query_scalar("SELECT replay_quarantined($1, 'alice', 'GL fixed')")
        .bind(id)
        .fetch_one(&payment)
        .await
        .unwrap();
    assert!(replay > 0);
    let (violations, heads) = findings(&d, None).await;
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(head(&heads, "paydb:outbox_replay").seq, 1);
    tamper(
        &d.pay_admin,
        "UPDATE outbox_replay SET operator_id = 'bob' WHERE chain_seq = 1",
    )
    .await;
    let (violations, _) = findings(&d, None).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("paydb:outbox_replay row seq 1") && violations[0].contains("edited"),
        "{violations:?}"
    );
}

/// The rail proxy's refusal records, written by its own role, are chained; a deleted one (the
/// refusal a stale worker would want forgotten) is found.
#[tokio::test]
async fn a_deleted_guard_event_of_the_proxy_is_found() {
    let d = dbs(0).await;
    let proxy = sqlx::PgPool::connect(&d.proxy_url).await.unwrap();
    for i in 0..3 {
        sqlx::query(
            "INSERT INTO guard_event (kind, payout_id, account_id, lock_key, presented, stored, \
             owner, stored_owner) VALUES ('FENCED', $1, 'acct-1', 'payout:acct-1', 3, 7, \
             'worker-old', 'worker-new')",
        )
        .bind(format!("p-{i}"))
        .execute(&proxy)
        .await
        .unwrap();
    }
    let (violations, heads) = findings(&d, None).await;
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(head(&heads, "proxydb:guard_event").seq, 3);
    tamper(
        &d.proxy_admin,
        "DELETE FROM guard_event WHERE chain_seq = 2",
    )
    .await;
    let (violations, _) = findings(&d, None).await;
    assert!(
        violations
            .iter()
            .any(|v| v.contains("proxydb:guard_event row seq 3") && v.contains("rows deleted")),
        "{violations:?}"
    );
}
