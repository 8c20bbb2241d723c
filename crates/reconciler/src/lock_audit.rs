//! The lock service's force-revoke audit in etcd is tamper-evident (issue 17, section 3): each
//! record is chained to the one before it by hash and the chain's head names the last one
//! (`grant_signing::audit_chain`, the definitions the lock-server writes with). This check reads
//! the records and the head in one snapshot and finds an edited record (its content no longer
//! hashes to its hash), a deleted one (a gap in the seqs, a broken link), a removed tail or a
//! rewritten head (the head is not the last record), and records without a head.
//!
//! A rewrite of the whole chain, head included, by someone able to write etcd is consistent in
//! itself (sha256 has no secret): like paydb's chains, it is found only against the head an
//! earlier run reported ([`ANCHOR_CHAIN`] in the anchor, kept outside etcd).

use grant_signing::audit_chain::{self, Head, Record};

use super::{
    check, prefix_end, AuditHead, Check, LockGrants, Options, ReconcileError, Sources,
    GRANT_RECORDS_PAGE,
};

/// The chain's name in a report's heads and in the anchor (no account id contains ':').
pub const ANCHOR_CHAIN: &str = "etcd:lock_audit";

/// The force-revoke audit chain in the lock service's etcd is intact, and still holds the head an
/// earlier run reported (`options.audit_anchor`); answers its head for the next run's anchor.
/// Skipped when no etcd source is configured (the PostgreSQL lock backend chains its lock_audit
/// rows in lockdb itself).
pub async fn lock_audit_chain_intact(
    sources: &Sources,
    options: &Options,
) -> Result<(Check, Option<AuditHead>), ReconcileError> {
    match &sources.lock_grants {
        Some(grants) => lock_audit_chain(grants, options).await,
        None => {
            let mut c = check("lock_audit_chain_intact", "audit");
            c.skipped = Some(
                "no etcd lock records given (PostgreSQL lock backend, or not configured)".into(),
            );
            Ok((c, None))
        }
    }
}

/// The check against the lock service's etcd under `grants.prefix`.
pub async fn lock_audit_chain(
    grants: &LockGrants,
    options: &Options,
) -> Result<(Check, Option<AuditHead>), ReconcileError> {
    let mut c = check("lock_audit_chain_intact", "audit");
    let (records, head) = read_chain(grants).await?;
    let prefix = &grants.prefix;
    let mut chained: Vec<(u64, Option<Record>)> = Vec::new();
    let mut before_the_chain = 0u64;
    for (key, value) in records {
        match audit_chain::seq_of_key(prefix, &key) {
            Some(seq) => chained.push((seq, serde_json::from_slice::<Record>(&value).ok())),
            None => {
                // A record of the lock-server before the chain: `{prefix}audit/{uuid}`, the
                // revoke's fields and no hash.
                let legacy = serde_json::from_slice::<serde_json::Value>(&value)
                    .is_ok_and(|v| v.get("action").is_some() && v.get("hash").is_none());
                if legacy {
                    before_the_chain += 1;
                } else {
                    c.violations.push(format!(
                        "{key}: not a place in the chain (a record's key is its seq in {} digits)",
                        audit_chain::SEQ_DIGITS
                    ));
                }
            }
        }
    }
    // Keys sort in seq order already (fixed width); sorted again so nothing rests on it.
    chained.sort_by_key(|(seq, _)| *seq);
    c.examined = chained.len() as u64;

    // (seq, hash) of the last record read, starting from the genesis.
    let mut last: (u64, String) = (0, audit_chain::to_hex(&audit_chain::genesis()));
    for (seq, record) in &chained {
        let seq = *seq;
        if seq > last.0 + 1 {
            let missing = if seq == last.0 + 2 {
                format!("seq {}", last.0 + 1)
            } else {
                format!("seqs {}..={}", last.0 + 1, seq - 1)
            };
            c.violations.push(format!(
                "record (seq {seq}) follows seq {}: {missing} missing (records deleted)",
                last.0
            ));
        }
        let Some(record) = record else {
            c.violations.push(format!(
                "record (seq {seq}) is unreadable (edited: not a chain record)"
            ));
            // Its hash is unknown: the next record's link is judged against nothing.
            last = (seq, String::new());
            continue;
        };
        if record.seq != seq {
            c.violations.push(format!(
                "record (seq {seq}) says it is seq {} (moved or edited)",
                record.seq
            ));
        }
        if !record.hash_holds() {
            c.violations.push(format!(
                "record (seq {seq}) no longer hashes to its hash (edited: {} of {} by {})",
                record.action, record.key, record.operator
            ));
        }
        // A link is judged only against the record right before it (a gap is reported above).
        if seq == last.0 + 1 && !last.1.is_empty() && record.prev_hash != last.1 {
            c.violations.push(if seq == 1 {
                "record (seq 1): prev_hash is not the chain's genesis (chain broken)".to_string()
            } else {
                format!(
                    "record (seq {seq}): prev_hash is not seq {}'s hash (chain broken: a record \
                     replaced or edited before it)",
                    seq - 1
                )
            });
        }
        last = (seq, record.hash.clone());
    }

    match &head {
        None if chained.is_empty() => {}
        None => c.violations.push(format!(
            "records up to seq {} but no head at {} (head removed)",
            last.0,
            audit_chain::head_key(prefix)
        )),
        Some(Err(())) => c.violations.push(format!(
            "the head at {} is unreadable (edited)",
            audit_chain::head_key(prefix)
        )),
        Some(Ok(head)) => {
            if head.seq != last.0 {
                c.violations.push(if head.seq > last.0 {
                    format!(
                        "the head is at seq {} but the last record is seq {} (tail removed)",
                        head.seq, last.0
                    )
                } else {
                    format!(
                        "the head is at seq {} but records run to seq {} (head rewritten, or \
                         records written beside the chain)",
                        head.seq, last.0
                    )
                });
            } else if head.seq > 0 && head.hash != last.1 {
                c.violations.push(format!(
                    "the head's hash is not seq {}'s (head rewritten or the last record replaced)",
                    head.seq
                ));
            }
        }
    }
    if before_the_chain > 0 {
        c.note = Some(format!(
            "{before_the_chain} force-revoke record(s) written before the chain (not checked)"
        ));
    }
    let anchored = options
        .audit_anchor
        .iter()
        .flatten()
        .filter(|h| h.chain == ANCHOR_CHAIN);
    for earlier in anchored {
        let now = chained
            .iter()
            .find(|(seq, _)| i64::try_from(*seq) == Ok(earlier.seq))
            .and_then(|(_, r)| r.as_ref())
            .map(|r| r.hash.as_str());
        if now != Some(earlier.hash.as_str()) {
            c.violations.push(format!(
                "the chain no longer holds the head reported earlier (seq {}, hash {}): rewritten",
                earlier.seq, earlier.hash
            ));
        }
    }
    let current = match head {
        Some(Ok(head)) if head.seq > 0 => i64::try_from(head.seq).ok().map(|seq| AuditHead {
            chain: ANCHOR_CHAIN.to_string(),
            seq,
            hash: head.hash,
        }),
        _ => None,
    };
    Ok((c, current))
}

type HeadRead = Option<Result<Head, ()>>;

/// Every record under `{prefix}audit/` (key, value) in key order, and the head, as of one
/// revision: the head and the first page in one transaction, later pages at its revision.
async fn read_chain(
    grants: &LockGrants,
) -> Result<(Vec<(String, Vec<u8>)>, HeadRead), ReconcileError> {
    use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};
    let client = grants.connect().await?;
    let records_prefix = audit_chain::records_prefix(&grants.prefix);
    let range_end = prefix_end(records_prefix.as_bytes());
    let page = |revision: Option<i64>| {
        let options = GetOptions::new()
            .with_range(range_end.clone())
            .with_limit(GRANT_RECORDS_PAGE);
        match revision {
            Some(r) => options.with_revision(r),
            None => options,
        }
    };
    let both = Txn::new().and_then([
        TxnOp::get(audit_chain::head_key(&grants.prefix), None),
        TxnOp::get(records_prefix.clone(), Some(page(None))),
    ]);
    let first = mtls::etcd_access::resend_on_auth_change(|| {
        let (mut client, both) = (client.clone(), both.clone());
        async move { client.txn(both).await }
    })
    .await?;
    let revision = first
        .header()
        .map(|h| h.revision())
        .ok_or(ReconcileError::EtcdNoHeader)?;
    let mut gets = first.op_responses().into_iter().filter_map(|r| match r {
        TxnOpResponse::Get(g) => Some(g),
        _ => None,
    });
    let head: HeadRead = gets
        .next()
        .and_then(|g| g.kvs().first().map(|kv| kv.value().to_vec()))
        .map(|value| serde_json::from_slice::<Head>(&value).map_err(drop));
    let mut records = Vec::new();
    let mut got = gets.next();
    while let Some(g) = got.take() {
        for kv in g.kvs() {
            records.push((
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
            ));
        }
        if let Some(last) = g.kvs().last().filter(|_| g.more()) {
            let mut from = last.key().to_vec();
            from.push(0);
            let next = page(Some(revision));
            got = Some(
                mtls::etcd_access::resend_on_auth_change(|| {
                    let (mut client, from, next) = (client.clone(), from.clone(), next.clone());
                    async move { client.get(from, Some(next)).await }
                })
                .await?,
            );
        }
    }
    Ok((records, head))
}
