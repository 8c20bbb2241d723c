//! The row chains of the evidence tables beside paydb's audit trail (paydb 0012, proxydb 0007,
//! gldb 0004): a quarantine replay (`outbox_replay`), the rail proxy's refusals, resolutions and
//! re-armings (`guard_event`, `resolution`, `rearm_event`) and the General Ledger's
//! operating-mode changes and refusals. Each table is one chain: every row carries its `chain_seq` (1, 2, ...), the hash of
//! the row before it and its own, `sha256(prev_hash || its content as canonical JSON, timestamps
//! in UTC)`, written by the database's own trigger as the owner; the chain's head is a row of
//! `row_chain_head` named after the table.
//!
//! [`row_chains_intact`] finds, per table: an edited row (its content no longer hashes to its
//! hash), a deleted row (a gap in the sequence, or a prev_hash that is not the previous row's
//! hash), a removed tail or a rewritten head (the head is not the last row), a removed head, and,
//! against the heads an earlier run reported (the anchor, kept outside the databases), a chain
//! rewritten by someone able to bypass the privileges.

use sqlx::{PgConnection, PgPool, Row};

use crate::{chain_faults, check, hex, store, AuditHead, Check, Options, ReconcileError};

/// The chained tables of paydb.
pub const PAYDB_CHAINS: &[&str] = &["outbox_replay"];
/// The chained tables of gldb.
pub const GLDB_CHAINS: &[&str] = &["operating_mode_changes", "operating_mode_refusals"];
/// The chained tables of proxydb.
pub const PROXYDB_CHAINS: &[&str] = &[
    "guard_event",
    "resolution",
    "rearm_event",
    "instruction_refusal",
];

/// The name a table's chain has in a report and in the anchor: `<database>:<table>`. An
/// account id cannot contain ':', so these never meet paydb's per-account chains.
pub fn chain_name(database: &str, table: &str) -> String {
    format!("{database}:{table}")
}

/// Whether an anchored head names one of these chains (and not one of paydb's accounts).
pub fn is_row_chain(chain: &str) -> bool {
    chain.contains(':')
}

/// Every chained table of paydb and gldb, intact; and their heads, for the next run's anchor.
/// (Each table is read on a connection of its own here; `reconcile` reads them in its snapshots.)
pub async fn row_chains_intact(
    paydb: &PgPool,
    proxydb: &PgPool,
    gldb: &PgPool,
    options: &Options,
) -> Result<(Check, Vec<AuditHead>), ReconcileError> {
    let mut paydb = paydb.acquire().await.map_err(store("paydb"))?;
    let mut proxydb = proxydb.acquire().await.map_err(store("proxydb"))?;
    let mut gldb = gldb.acquire().await.map_err(store("gldb"))?;
    row_chains_in(&mut paydb, &mut proxydb, &mut gldb, options).await
}

/// [`row_chains_intact`] on the given connections: within one snapshot of each database, a chain
/// and its head are read as of one moment, so a row appended meanwhile is no false finding.
pub(crate) async fn row_chains_in(
    paydb: &mut PgConnection,
    proxydb: &mut PgConnection,
    gldb: &mut PgConnection,
    options: &Options,
) -> Result<(Check, Vec<AuditHead>), ReconcileError> {
    let mut c = check("row_chains_intact", "audit");
    let mut heads = Vec::new();
    for (database, conn, tables) in [
        ("paydb", &mut *paydb, PAYDB_CHAINS),
        ("proxydb", &mut *proxydb, PROXYDB_CHAINS),
        ("gldb", &mut *gldb, GLDB_CHAINS),
    ] {
        for table in tables {
            let name = chain_name(database, table);
            let (examined, head) = one_chain(conn, database, table, &name, &mut c).await?;
            c.examined += examined;
            heads.extend(head);
        }
    }
    if let Some(anchor) = &options.audit_anchor {
        let tables = anchor
            .iter()
            .filter(|h| is_row_chain(&h.chain) && h.chain != crate::lock_audit::ANCHOR_CHAIN);
        for earlier in tables {
            let Some((database, table)) = earlier.chain.split_once(':') else {
                continue;
            };
            let conn = match database {
                "paydb" if PAYDB_CHAINS.contains(&table) => &mut *paydb,
                "proxydb" if PROXYDB_CHAINS.contains(&table) => &mut *proxydb,
                "gldb" if GLDB_CHAINS.contains(&table) => &mut *gldb,
                _ => {
                    c.violations.push(format!(
                        "the anchor names chain {:?}, which no database holds",
                        earlier.chain
                    ));
                    continue;
                }
            };
            // `table` is one of the constants above: never text from the anchor file.
            let hash: Option<Vec<u8>> = sqlx::query_scalar(&format!(
                "SELECT row_hash FROM {table} WHERE chain_seq = $1"
            ))
            .bind(earlier.seq)
            .fetch_optional(&mut *conn)
            .await
            .map_err(store(database_name(database)))?;
            if hash.as_deref().map(hex) != Some(earlier.hash.clone()) {
                c.violations.push(format!(
                    "chain {:?} no longer holds the head reported earlier (seq {}, hash {}): rewritten",
                    earlier.chain, earlier.seq, earlier.hash
                ));
            }
        }
    }
    Ok((c, heads))
}

fn database_name(database: &str) -> &'static str {
    match database {
        "paydb" => "paydb",
        "proxydb" => "proxydb",
        _ => "gldb",
    }
}

/// One table's chain: the violations go to `c`; answers how many rows were examined and the
/// chain's head (none while it is empty).
async fn one_chain(
    conn: &mut PgConnection,
    database: &str,
    table: &str,
    name: &str,
    c: &mut Check,
) -> Result<(u64, Option<AuditHead>), ReconcileError> {
    let db = database_name(database);
    // `table` is one of the constants above.
    let rows = sqlx::query(&format!(
        "WITH c AS ( \
           SELECT chain_seq, prev_hash, row_hash, \
                  sha256(prev_hash || row_chain_content(t)) AS recomputed, \
                  lag(row_hash) OVER w AS before, lag(chain_seq) OVER w AS seq_before \
           FROM {table} t WINDOW w AS (ORDER BY chain_seq)) \
         SELECT chain_seq, recomputed <> row_hash AS edited, \
                chain_seq <> coalesce(seq_before, 0) + 1 AS gap, \
                prev_hash <> coalesce(before, row_chain_genesis($1)) AS unlinked \
         FROM c \
         WHERE recomputed <> row_hash OR chain_seq <> coalesce(seq_before, 0) + 1 \
            OR prev_hash <> coalesce(before, row_chain_genesis($1))"
    ))
    .bind(table)
    .fetch_all(&mut *conn)
    .await
    .map_err(store(db))?;
    for r in rows {
        let seq: i64 = r.get("chain_seq");
        c.violations
            .push(format!("{name} row seq {seq}: {}", chain_faults(&r)));
    }
    let examined: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(&mut *conn)
        .await
        .map_err(store(db))?;
    let head: Option<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT seq, hash FROM row_chain_head WHERE chain = $1")
            .bind(table)
            .fetch_optional(&mut *conn)
            .await
            .map_err(store(db))?;
    let last: Option<(i64, Vec<u8>)> = sqlx::query_as(&format!(
        "SELECT chain_seq, row_hash FROM {table} ORDER BY chain_seq DESC LIMIT 1"
    ))
    .fetch_optional(&mut *conn)
    .await
    .map_err(store(db))?;
    match (&head, &last) {
        (None, Some((last_seq, _))) => c.violations.push(format!(
            "{name} has rows up to seq {last_seq} but no head (the head was removed)"
        )),
        (None, None) => c.violations.push(format!(
            "{name} has no head (the migration makes one; it was removed)"
        )),
        (Some((head_seq, head_hash)), last) => {
            let (last_seq, last_hash) = match last {
                Some((seq, hash)) => (*seq, Some(hash)),
                None => (0, None),
            };
            if *head_seq != last_seq || (*head_seq > 0 && Some(head_hash) != last_hash) {
                c.violations.push(format!(
                    "{name}: the head is at seq {head_seq} but the last row is seq {last_seq} \
                     (rows removed from the end, or the head rewritten)"
                ));
            }
        }
    }
    let head = head
        .filter(|(seq, _)| *seq > 0)
        .map(|(seq, hash)| AuditHead {
            chain: name.to_string(),
            seq,
            hash: hex(&hash),
        });
    Ok((examined as u64, head))
}
