//! The force-revoke audit is a hash chain on both backends (issue 17, section 3). etcd: each
//! revoke appends `{prefix}audit/{seq:020}` linked to the head's hash and moves the head in the
//! revoke's own transaction, so revokes at once each take their own seq. lockdb: lock_audit's
//! BEFORE INSERT trigger (0004, the owner's) fills chain_seq, prev_hash and row_hash, and the
//! lock_server role can insert a record but not change or remove one, nor the head.
//! (The reconciler's `lock_audit_chain_intact` suite tampers with the etcd chain.)

mod support;

use std::time::Duration;

use grant_signing::audit_chain;
use lock_server::backend::Backend;
use lock_server::BackendConfig;
use support::{backend, grant, lockdb, start_with, Kind};
use testkit::pki::TEST_OPERATOR;
use testkit::Stack;

const TTL: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_force_revokes_at_once_each_take_their_own_seq_in_the_chain() {
    let config = backend(Kind::Etcd, "audit-chain").await;
    let BackendConfig::Etcd { prefix, .. } = &config else {
        unreachable!("an etcd backend")
    };
    let prefix = prefix.clone();
    let s = start_with(config).await;
    let session = s.client.open_session("worker-a", TTL).await.unwrap();
    let keys = ["payout:a1", "payout:a2", "payout:a3", "payout:a4"];
    // Held (the handles kept) until the revokes take them.
    let mut held = Vec::new();
    for k in keys {
        held.push(grant(&session, k).await);
    }
    let revoke = |i: usize| {
        s.operator
            .force_revoke(keys[i], held[i].token(), TEST_OPERATOR, "at once")
    };
    let answers = tokio::join!(revoke(0), revoke(1), revoke(2), revoke(3));
    for answer in [answers.0, answers.1, answers.2, answers.3] {
        answer.expect("every revoke lands (a lost head compare is read again)");
    }
    let Backend::Etcd(etcd) = s.server.service.backend() else {
        panic!("etcd backend")
    };
    let records: Vec<audit_chain::Record> = etcd
        .audit_records()
        .await
        .unwrap()
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect();
    assert_eq!(
        records.iter().map(|r| r.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4],
        "one seq each, none taken twice"
    );
    let mut revoked: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    revoked.sort();
    assert_eq!(revoked, keys);
    let mut prev = audit_chain::to_hex(&audit_chain::genesis());
    for r in &records {
        assert!(r.hash_holds(), "seq {}", r.seq);
        assert_eq!(r.prev_hash, prev, "seq {} links to the one before", r.seq);
        prev = r.hash.clone();
    }
    // The head names the last record.
    let mut client = Stack::shared().etcd_client().await.unwrap();
    let head = client
        .get(audit_chain::head_key(&prefix), None)
        .await
        .unwrap();
    let head: audit_chain::Head = serde_json::from_slice(head.kvs()[0].value()).unwrap();
    assert_eq!((head.seq, head.hash), (4, prev));
    s.server.stop().await;
}

fn refused_for_privilege(e: sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "42501")
}

/// What the chain says, row by row (as the owner): seq, prev_hash, row_hash, and the hash the
/// row's content gives now.
async fn chain_rows(admin: &sqlx::PgPool) -> Vec<(i64, Vec<u8>, Vec<u8>, Vec<u8>)> {
    sqlx::query_as(
        "SELECT chain_seq, prev_hash, row_hash, sha256(prev_hash || row_chain_content(t)) \
         FROM lock_audit t ORDER BY chain_seq",
    )
    .fetch_all(admin)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_force_revokes_are_chained_and_the_lock_server_cannot_change_a_record() {
    let (admin_url, login_url) = lockdb(Stack::shared()).await;
    let s = start_with(BackendConfig::Postgres {
        database_url: login_url.clone(),
    })
    .await;
    let session = s.client.open_session("worker-a", TTL).await.unwrap();
    for k in ["payout:p1", "payout:p2", "payout:p3"] {
        let held = grant(&session, k).await;
        s.operator
            .force_revoke(k, held.token(), TEST_OPERATOR, "stuck")
            .await
            .expect("the lock_server role inserts the record; the trigger chains it");
    }
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    let genesis: Vec<u8> = sqlx::query_scalar("SELECT row_chain_genesis('lock_audit')")
        .fetch_one(&admin)
        .await
        .unwrap();
    let rows = chain_rows(&admin).await;
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2, 3]);
    let mut prev = genesis;
    for (seq, prev_hash, row_hash, recomputed) in &rows {
        assert_eq!(prev_hash, &prev, "seq {seq} links to the one before");
        assert_eq!(row_hash, recomputed, "seq {seq} hashes to its hash");
        prev = row_hash.clone();
    }
    let head: (i64, Vec<u8>) =
        sqlx::query_as("SELECT seq, hash FROM row_chain_head WHERE chain = 'lock_audit'")
            .fetch_one(&admin)
            .await
            .unwrap();
    assert_eq!(head, (3, prev.clone()));

    // As the lock-server's own role: no record is changed or removed, the head is not its to
    // write, and a record inserted with made-up chain columns gets its real place anyway.
    let role = sqlx::PgPool::connect(&login_url).await.unwrap();
    for sql in [
        "UPDATE lock_audit SET reason = 'nothing to see' WHERE chain_seq = 2",
        "DELETE FROM lock_audit WHERE chain_seq = 3",
        "UPDATE row_chain_head SET seq = 2",
        "DELETE FROM row_chain_head",
    ] {
        let e = sqlx::query(sql).execute(&role).await.unwrap_err();
        assert!(refused_for_privilege(e), "{sql} must be refused");
    }
    sqlx::query(
        "INSERT INTO lock_audit (action, key, revoked_owner, revoked_session_id, revoked_token, \
         operator, reason, chain_seq, prev_hash, row_hash) \
         VALUES ('force_revoke', 'p9', 'w', 1, 1, 'op', 'forged place', 1, '\\x00', '\\x00')",
    )
    .execute(&role)
    .await
    .unwrap();
    let rows = chain_rows(&admin).await;
    let last = rows.last().unwrap();
    assert_eq!(
        (last.0, &last.1, &last.2),
        (4, &prev, &last.3),
        "the trigger, not the inserter, places a record"
    );

    // Negative control of the recomputation above: an edit (as the superuser, triggers off)
    // leaves the row's hash behind its content.
    let mut tx = admin.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE lock_audit SET reason = 'nothing to see' WHERE chain_seq = 2")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let rows = chain_rows(&admin).await;
    let edited: Vec<i64> = rows.iter().filter(|r| r.2 != r.3).map(|r| r.0).collect();
    assert_eq!(edited, [2]);
    s.server.stop().await;
}
