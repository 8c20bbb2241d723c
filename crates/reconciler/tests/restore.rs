//! The fence survives a restore of a guard's own database (issue 19, section 3): the reconciler
//! says when a guard's database is a copy restored from a backup and not re-armed
//! (`guard_database_current`), and when paydb's fence is below a token the proxy accepted a
//! submission under (`fence_not_below_proxy_submissions`: paydb was rewound, which a physical
//! restore keeping the database's OIDs would hide from the first check). Each is shown firing on
//! the state a restore leaves, written as the superuser (what no service role may do), and
//! staying quiet on the consistent state beside it. The horizon the procedure re-arms to is read
//! from etcd itself (`LockGrants::horizon`).

use reconciler::{fence_not_below_proxy_submissions, guard_database_current};
use testkit::db_access::{Database, OWNER};
use testkit::etcd::EtcdRole;
use testkit::{PgServer, Stack};

/// A database of `kind` as a deployment has it: the superuser's pool (for the restore's effects),
/// the reconciler's (for the checks) and the owner's URL (for the procedure).
struct Db {
    admin: sqlx::PgPool,
    reader: sqlx::PgPool,
    owner_url: String,
}

async fn provisioned(server: PgServer, kind: Database) -> Db {
    let stack = Stack::shared();
    let admin_url = stack.provisioned_db(server, kind).await;
    let name = testkit::system::database_name(&admin_url).to_string();
    let pg = stack.pg(server);
    Db {
        admin: sqlx::PgPool::connect(&admin_url).await.unwrap(),
        reader: sqlx::PgPool::connect(&pg.login_url("reconciler", &name))
            .await
            .unwrap(),
        owner_url: pg.login_url(OWNER, &name),
    }
}

/// A paydb and a proxydb, each on its own server as in a deployment.
async fn guards() -> (Db, Db) {
    (
        provisioned(PgServer::Main, Database::Paydb).await,
        provisioned(PgServer::Proxy, Database::Proxydb).await,
    )
}

/// Runs `sql` as the superuser with the triggers off (what only a superuser can do; a restore
/// writes the same rows without any trigger firing).
async fn behind_the_back(admin: &sqlx::PgPool, sql: &str) {
    let mut tx = admin.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::raw_sql(sql)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    tx.commit().await.unwrap();
}

async fn current_findings(paydb: &Db, proxydb: &Db) -> Vec<String> {
    let c = guard_database_current(&paydb.reader, &proxydb.reader)
        .await
        .unwrap();
    assert_eq!(c.name, "guard_database_current");
    assert_eq!(c.examined, 2, "both guards' databases");
    c.violations
}

async fn fence_findings(paydb: &Db, proxydb: &Db) -> (u64, Vec<String>) {
    let c = fence_not_below_proxy_submissions(&paydb.reader, &proxydb.reader)
        .await
        .unwrap();
    assert_eq!(c.name, "fence_not_below_proxy_submissions");
    (c.examined, c.violations)
}

/// The procedure's database half, as the owner (what `payoutctl restore rearm` runs).
async fn rearm(db: &Db, horizon: i64) -> i64 {
    let owner = sqlx::PgPool::connect(&db.owner_url).await.unwrap();
    let raised = sqlx::query_scalar("SELECT rearm_after_restore($1, 'reconciler-test', 'test')")
        .bind(horizon)
        .fetch_one(&owner)
        .await
        .unwrap();
    owner.close().await;
    raised
}

/// A database whose incarnation row names another database (what a restore into a new database
/// brings) is reported by name, the other guard's is not; once re-armed by the procedure, neither.
#[tokio::test]
async fn a_guard_database_that_is_not_its_incarnation_is_reported_until_re_armed() {
    let (paydb, proxydb) = guards().await;
    let violations = current_findings(&paydb, &proxydb).await;
    assert!(
        violations.is_empty(),
        "freshly migrated databases are current: {violations:?}"
    );

    behind_the_back(&paydb.admin, "UPDATE incarnation SET database_oid = 0").await;
    let violations = current_findings(&paydb, &proxydb).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].starts_with("paydb: ")
            && violations[0]
                .contains("restored from a backup and not re-armed: run payoutctl restore rearm")
            && violations[0].contains("--database paydb")
            && violations[0].contains("database OID 0"),
        "{violations:?}"
    );

    assert_eq!(rearm(&paydb, 0).await, 0, "no account to raise");
    let violations = current_findings(&paydb, &proxydb).await;
    assert!(violations.is_empty(), "re-armed: {violations:?}");

    // A restore that recreated the guarded table (pg_restore --clean) is the same finding.
    behind_the_back(
        &proxydb.admin,
        "UPDATE incarnation SET guarded_table = 'rail_submission'::regclass",
    )
    .await;
    let violations = current_findings(&paydb, &proxydb).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].starts_with("proxydb: ")
            && violations[0].contains("restored from a backup and not re-armed")
            && violations[0].contains("--database proxydb"),
        "{violations:?}"
    );
    rearm(&proxydb, 0).await;
    assert!(current_findings(&paydb, &proxydb).await.is_empty());
}

/// paydb's fence below a token the proxy accepted a submission under is reported per account with
/// both numbers: a submission under a higher token than the fence, a fence lowered behind the
/// trigger's back (a restore writes rows without firing it), and an account paydb no longer has.
/// A fence at or above every submission is not, and neither is a sealed (NOT_SENT) row above the
/// fence: a fenced inquiry writes it with a token paydb may never have seen.
#[tokio::test]
async fn a_paydb_fence_below_a_proxy_submission_is_reported() {
    let (paydb, proxydb) = guards().await;
    let (examined, violations) = fence_findings(&paydb, &proxydb).await;
    assert_eq!((examined, violations.len()), (0, 0), "{violations:?}");

    behind_the_back(
        &paydb.admin,
        "INSERT INTO account (id, currency, balance_minor, opening_balance_minor, fence) VALUES \
           ('acct-f1', 'EUR', 0, 0, 10), ('acct-f2', 'EUR', 0, 0, 7)",
    )
    .await;
    behind_the_back(
        &proxydb.admin,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, beneficiary_ref) VALUES \
           ('po-f1a', 'acct-f1', 4, 'w', 'cref-po-f1a', 10, 'EUR', 'ben-1'), \
           ('po-f1b', 'acct-f1', 10, 'w', 'cref-po-f1b', 10, 'EUR', 'ben-1'), \
           ('po-f2a', 'acct-f2', 5, 'w', 'cref-po-f2a', 10, 'EUR', 'ben-1'); \
         INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, outcome, sealed_by, resolved_at) VALUES \
           ('po-f2s', 'acct-f2', 50, 'resolver', 'cref-po-f2s', 'NOT_SENT', 'resolver', now())",
    )
    .await;
    let (examined, violations) = fence_findings(&paydb, &proxydb).await;
    assert!(
        violations.is_empty(),
        "fences at or above every submission: {violations:?}"
    );
    assert_eq!(examined, 2, "one per account with submissions");

    // A submission under a token above paydb's fence: paydb lost the MarkSubmitted that preceded it.
    behind_the_back(
        &proxydb.admin,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, beneficiary_ref) VALUES \
           ('po-f1c', 'acct-f1', 20, 'w', 'cref-po-f1c', 10, 'EUR', 'ben-1')",
    )
    .await;
    let (_, violations) = fence_findings(&paydb, &proxydb).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].contains("account acct-f1")
            && violations[0].contains("fence 10 is below 20")
            && violations[0].contains("po-f1c"),
        "{violations:?}"
    );

    // The fence lowered as a restore lowers it (the trigger refusing a decrease does not fire).
    behind_the_back(
        &paydb.admin,
        "UPDATE account SET fence = 3 WHERE id = 'acct-f2'",
    )
    .await;
    // And an account opened after the backup was taken, gone from the restored paydb.
    behind_the_back(
        &proxydb.admin,
        "INSERT INTO rail_submission (payout_id, account_id, fence_token, owner, client_reference, amount_minor, currency, beneficiary_ref) VALUES \
           ('po-f3', 'acct-f3', 30, 'w', 'cref-po-f3', 10, 'EUR', 'ben-1')",
    )
    .await;
    let (examined, mut violations) = fence_findings(&paydb, &proxydb).await;
    violations.sort();
    assert_eq!((examined, violations.len()), (3, 3), "{violations:?}");
    assert!(
        violations[1].contains("account acct-f2")
            && violations[1].contains("fence 3 is below 5")
            && violations[1].contains("po-f2a"),
        "the sealed row's 50 is no witness: {violations:?}"
    );
    assert!(
        violations[2].contains("account acct-f3")
            && violations[2].contains("no account in paydb")
            && violations[2].contains("token 30"),
        "{violations:?}"
    );

    // The procedure raises every fence to the horizon: the witness holds again for the accounts
    // paydb has (the lost account stays reported: the procedure cannot bring it back).
    behind_the_back(&paydb.admin, "UPDATE incarnation SET database_oid = 0").await;
    assert_eq!(rearm(&paydb, 40).await, 2, "both accounts raised");
    let (_, violations) = fence_findings(&paydb, &proxydb).await;
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].contains("acct-f3"), "{violations:?}");
}

/// The horizon is etcd's current revision, read from the cluster: at least the revision of a
/// write made just before, and moving with the next write. It is above every token the lock
/// service issued, since each is a key's create revision.
#[tokio::test]
async fn the_lock_service_horizon_is_etcds_current_revision() {
    let stack = Stack::shared();
    let prefix = stack.unique_prefix("horizon");
    let grants = reconciler::LockGrants::new(
        stack.etcd_endpoints(),
        stack.etcd_identity_tls(EtcdRole::Reconciler, &prefix),
        prefix.clone(),
    );
    let mut etcd = stack.etcd_client().await.unwrap();
    let key = format!("{}probe", grants.prefix);
    let written = etcd.put(key.as_str(), "1", None).await.unwrap();
    let revision = written.header().unwrap().revision();
    let horizon = grants.horizon().await.unwrap();
    assert!(horizon >= revision, "{horizon} < {revision}");
    let again = etcd.put(key.as_str(), "2", None).await.unwrap();
    let later = grants.horizon().await.unwrap();
    assert!(
        later >= again.header().unwrap().revision() && later > horizon,
        "{later} after {horizon}"
    );

    // Plaintext is refused before anything is dialled.
    let plain = reconciler::LockGrants::new(
        vec![stack.etcd_endpoints()[0].replacen("https://", "http://", 1)],
        stack.etcd_identity_tls(EtcdRole::Reconciler, &prefix),
        prefix,
    );
    let e = plain.horizon().await.unwrap_err();
    assert!(e.to_string().contains("https://"), "{e}");
}
