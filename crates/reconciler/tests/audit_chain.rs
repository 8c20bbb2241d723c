//! paydb's audit trail is tamper-evident (issue 17, section 3): every row is chained to the one
//! before it by hash (migration 0005), and `audit_chain_intact` finds an edited row, a deleted
//! row, a removed tail, and (with the anchor an earlier run reported) a rewrite of the whole
//! chain. The tampering is done the only way it can be: as the superuser, with the triggers
//! switched off (`session_replication_role = replica`); no service role may (the attack suite).

use reconciler::{audit_chain_intact, AuditHead, Options};
use testkit::db_access::Database;
use testkit::{PgServer, Stack};

/// A paydb as a deployment has it, with `rows` audit rows written by the payment resource's own
/// role: the superuser's pool (for the tampering) and the reconciler's (for the check).
async fn chained(rows: usize) -> (sqlx::PgPool, sqlx::PgPool) {
    let stack = Stack::shared();
    let admin_url = stack.provisioned_db(PgServer::Main, Database::Paydb).await;
    let db = testkit::system::database_name(&admin_url).to_string();
    let pg = stack.pg(PgServer::Main);
    let service = sqlx::PgPool::connect(&pg.login_url("payment_resource", &db))
        .await
        .unwrap();
    for i in 0..rows {
        sqlx::query(
            "INSERT INTO audit_event (payout_id, kind, actor, detail) \
             VALUES ($1, 'operator_decision', 'OPERATOR', jsonb_build_object('n', $2::int))",
        )
        .bind(format!("p-{i}"))
        .bind(i as i32)
        .execute(&service)
        .await
        .unwrap();
    }
    service.close().await;
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    let reader = sqlx::PgPool::connect(&pg.login_url("reconciler", &db))
        .await
        .unwrap();
    (admin, reader)
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

/// Recomputes every hash and the head after an edit: a chain consistent in itself.
const REWRITE: &str = "
DO $$
DECLARE r audit_event; prev bytea := sha256(convert_to('payout-audit-chain-v1', 'UTF8')); h bytea;
BEGIN
  SET LOCAL timezone = 'UTC';
  FOR r IN SELECT * FROM audit_event ORDER BY chain_seq LOOP
    h := sha256(prev || audit_event_content(r));
    UPDATE audit_event SET prev_hash = prev, row_hash = h WHERE id = r.id;
    prev := h;
  END LOOP;
  UPDATE audit_chain_head SET hash = prev WHERE chain = '';
END $$";

async fn findings(
    reader: &sqlx::PgPool,
    anchor: Option<Vec<AuditHead>>,
) -> (Vec<String>, Vec<AuditHead>) {
    let options = Options {
        audit_anchor: anchor,
        ..Options::default()
    };
    let (check, head) = audit_chain_intact(reader, &options).await.unwrap();
    (check.violations, head)
}

#[tokio::test]
async fn an_intact_chain_passes_and_a_no_op_rewrite_of_a_row_changes_nothing() {
    let (admin, reader) = chained(5).await;
    let (violations, head) = findings(&reader, None).await;
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(head.len(), 1, "one chain: the rows name no account");
    assert_eq!(head[0].seq, 5);
    // Control for the edit case below: rewriting a row with its own content is not flagged.
    tamper(
        &admin,
        "UPDATE audit_event SET detail = detail WHERE chain_seq = 3",
    )
    .await;
    let (violations, again) = findings(&reader, Some(head.clone())).await;
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(again, head);
}

#[tokio::test]
async fn an_edited_row_is_found() {
    let (admin, reader) = chained(5).await;
    tamper(
        &admin,
        "UPDATE audit_event SET detail = '{\"n\": 99}' WHERE chain_seq = 3",
    )
    .await;
    let (violations, _) = findings(&reader, None).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("seq 3)") && violations[0].contains("edited"),
        "{violations:?}"
    );
}

#[tokio::test]
async fn a_deleted_row_is_found() {
    let (admin, reader) = chained(5).await;
    tamper(&admin, "DELETE FROM audit_event WHERE chain_seq = 2").await;
    let (violations, _) = findings(&reader, None).await;
    assert!(
        violations
            .iter()
            .any(|v| v.contains("seq 3)") && v.contains("rows deleted")),
        "{violations:?}"
    );
}

#[tokio::test]
async fn a_removed_tail_is_found_by_the_head() {
    let (admin, reader) = chained(5).await;
    tamper(&admin, "DELETE FROM audit_event WHERE chain_seq >= 4").await;
    let (violations, _) = findings(&reader, None).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].contains("head is at seq 5"), "{violations:?}");
}

/// A rewrite that recomputes every hash and the head is consistent in itself: without an anchor
/// (the negative control) nothing in paydb shows it; with the head an earlier run reported, the
/// check finds it.
#[tokio::test]
async fn a_rewritten_chain_is_found_only_against_the_anchor_reported_earlier() {
    let (admin, reader) = chained(5).await;
    let (_, anchor) = findings(&reader, None).await;
    tamper(
        &admin,
        "UPDATE audit_event SET detail = '{\"n\": 99}' WHERE chain_seq = 3",
    )
    .await;
    tamper(&admin, REWRITE).await;
    let (without_anchor, _) = findings(&reader, None).await;
    assert!(
        without_anchor.is_empty(),
        "consistent in itself: {without_anchor:?}"
    );
    let (with_anchor, _) = findings(&reader, Some(anchor)).await;
    assert_eq!(with_anchor.len(), 1, "{with_anchor:?}");
    assert!(with_anchor[0].contains("rewritten"), "{with_anchor:?}");
}

/// One chain per account: rows of two accounts make two chains, each with its own head. Removing
/// one account's whole chain and its head leaves nothing inconsistent in paydb: the anchor of an
/// earlier run finds it; removing only a chain's head is found at once.
#[tokio::test]
async fn chains_are_per_account_and_a_removed_chain_or_head_is_found() {
    let (admin, reader) = chained(0).await;
    let pg = Stack::shared().pg(PgServer::Main);
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&admin)
        .await
        .unwrap();
    let service = sqlx::PgPool::connect(&pg.login_url("payment_resource", &db))
        .await
        .unwrap();
    for (i, account) in ["acct-a", "acct-b", "acct-a", "acct-b", "acct-a"]
        .iter()
        .enumerate()
    {
        sqlx::query(
            "INSERT INTO audit_event (payout_id, account_id, kind, actor) \
             VALUES ($1, $2, 'payout_created', 'INTEGRATOR')",
        )
        .bind(format!("q-{i}"))
        .bind(account)
        .execute(&service)
        .await
        .unwrap();
    }
    let (violations, heads) = findings(&reader, None).await;
    assert!(violations.is_empty(), "{violations:?}");
    let by_chain: Vec<(String, i64)> = heads.iter().map(|h| (h.chain.clone(), h.seq)).collect();
    assert_eq!(
        by_chain,
        [("acct-a".to_string(), 3), ("acct-b".to_string(), 2)]
    );
    tamper(
        &admin,
        "DELETE FROM audit_chain_head WHERE chain = 'acct-a'",
    )
    .await;
    let (violations, _) = findings(&reader, None).await;
    assert!(
        violations.len() == 1 && violations[0].contains("no head"),
        "{violations:?}"
    );
    tamper(&admin, "DELETE FROM audit_event WHERE chain = 'acct-a'").await;
    let (without_anchor, _) = findings(&reader, None).await;
    assert!(
        without_anchor.is_empty(),
        "a whole chain gone leaves no trace in paydb: {without_anchor:?}"
    );
    let (with_anchor, _) = findings(&reader, Some(heads)).await;
    assert!(
        with_anchor.len() == 1 && with_anchor[0].contains("\"acct-a\""),
        "{with_anchor:?}"
    );
}
