//! The lock service's force-revoke audit records as a hash chain (issue 17, section 3), stated
//! once for the side that writes them (the lock-server's etcd backend) and the side that checks
//! them (the reconciler's `lock_audit_chain_intact`).
//!
//! Layout under the lock-server's prefix: one record per force-revoke at
//! `{prefix}audit/{seq:020}` (seq 1, 2, ...), and the chain's head (last seq and hash) at
//! `{prefix}audit-head`, outside the records' prefix so a prefix read of the records never
//! includes it. The record, the head's move and the lock key's delete are one etcd transaction
//! that compares the head's mod revision (or its absence, for the first record): two revokes at
//! once cannot both take a seq.
//!
//! A record's hash is `sha256(prev_hash || content)`, where `content` is [`Record::content`]: a
//! domain tag, the seq, every other field length-prefixed in a fixed order, then the integers,
//! so it depends on no serializer's field order. The first record's `prev_hash` is [`genesis`].
//! A record edited, deleted or moved, a removed tail and a rewritten head each leave the chain
//! inconsistent with itself. (Someone able to write etcd can still rewrite the whole chain
//! consistently: sha256 has no secret.)

use ring::digest::{digest, SHA256};
use serde::{Deserialize, Serialize};

/// A SHA-256 digest.
pub type Hash = [u8; 32];

/// What the chain's first `prev_hash` is the hash of: fixed, so anyone can recompute it.
pub const GENESIS_TAG: &[u8] = b"payout-lock-audit-chain-v1";
/// The domain tag at the start of every record's content.
const CONTENT_TAG: &[u8] = b"payout-lock-audit-record-v1";
/// A record's key is its seq in this many decimal digits, so keys sort in seq order.
pub const SEQ_DIGITS: usize = 20;

/// The first record's `prev_hash`: `sha256("payout-lock-audit-chain-v1")`.
pub fn genesis() -> Hash {
    sha256(GENESIS_TAG)
}

/// `sha256(prev || content)`: a record's hash from the previous record's and its own content.
pub fn link(prev: &Hash, content: &[u8]) -> Hash {
    let mut input = Vec::with_capacity(prev.len() + content.len());
    input.extend_from_slice(prev);
    input.extend_from_slice(content);
    sha256(&input)
}

fn sha256(bytes: &[u8]) -> Hash {
    digest(&SHA256, bytes)
        .as_ref()
        .try_into()
        .expect("SHA-256 is 32 bytes")
}

/// `{prefix}audit/`: every record, and nothing else (`prefix` ends with `/`).
pub fn records_prefix(prefix: &str) -> String {
    format!("{prefix}audit/")
}

/// `{prefix}audit/{seq:020}`.
pub fn record_key(prefix: &str, seq: u64) -> String {
    format!("{prefix}audit/{seq:0width$}", width = SEQ_DIGITS)
}

/// The seq a record key names, if it is one (`{prefix}audit/` then exactly [`SEQ_DIGITS`]
/// digits).
pub fn seq_of_key(prefix: &str, key: &str) -> Option<u64> {
    let digits = key.strip_prefix(&records_prefix(prefix))?;
    if digits.len() != SEQ_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `{prefix}audit-head`: the chain's [`Head`].
pub fn head_key(prefix: &str) -> String {
    format!("{prefix}audit-head")
}

/// One force-revoke, as stored (JSON) at [`record_key`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub seq: u64,
    pub action: String,
    pub key: String,
    pub revoked_owner: String,
    pub revoked_session_id: String,
    pub revoked_token: u64,
    pub operator: String,
    pub reason: String,
    pub at_unix_ms: i64,
    /// The previous record's hash (hex), [`genesis`] for seq 1.
    pub prev_hash: String,
    /// `sha256(prev_hash || content)` (hex).
    pub hash: String,
}

/// The chain's head, as stored (JSON) at [`head_key`]: the last record's seq and hash (hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub seq: u64,
    pub hash: String,
}

impl Record {
    /// A record at `seq` after a record whose hash is `prev`, its `prev_hash` and `hash` filled.
    #[allow(clippy::too_many_arguments)]
    pub fn chained(
        seq: u64,
        prev: &Hash,
        action: &str,
        key: &str,
        revoked_owner: &str,
        revoked_session_id: &str,
        revoked_token: u64,
        operator: &str,
        reason: &str,
        at_unix_ms: i64,
    ) -> Self {
        let mut record = Self {
            seq,
            action: action.into(),
            key: key.into(),
            revoked_owner: revoked_owner.into(),
            revoked_session_id: revoked_session_id.into(),
            revoked_token,
            operator: operator.into(),
            reason: reason.into(),
            at_unix_ms,
            prev_hash: to_hex(prev),
            hash: String::new(),
        };
        record.hash = to_hex(&link(prev, &record.content()));
        record
    }

    /// The bytes the hash covers besides `prev_hash`: the domain tag, the seq (u64, big-endian),
    /// each text field length-prefixed (u32, big-endian) in this order: action, key,
    /// revoked_owner, revoked_session_id, operator, reason; then revoked_token (u64, big-endian)
    /// and at_unix_ms (i64, big-endian).
    pub fn content(&self) -> Vec<u8> {
        let texts = [
            &self.action,
            &self.key,
            &self.revoked_owner,
            &self.revoked_session_id,
            &self.operator,
            &self.reason,
        ];
        let mut m = crate::Message::new(CONTENT_TAG);
        m.u64(self.seq);
        for text in texts {
            m.text(text);
        }
        m.u64(self.revoked_token).i64(self.at_unix_ms);
        m.into_bytes()
    }

    /// The record's `prev_hash`, if it is 64 hex digits.
    pub fn prev(&self) -> Option<Hash> {
        from_hex(&self.prev_hash)
    }

    /// What the record's hash should be: its `prev_hash` linked to its content (`None` when
    /// `prev_hash` is not a hash).
    pub fn recomputed_hash(&self) -> Option<String> {
        Some(to_hex(&link(&self.prev()?, &self.content())))
    }

    /// The record's stored hash is the one its `prev_hash` and content give.
    pub fn hash_holds(&self) -> bool {
        self.recomputed_hash().as_deref() == Some(self.hash.as_str())
    }
}

/// Lowercase hex.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A hash from 64 hex digits.
pub fn from_hex(text: &str) -> Option<Hash> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, prev: &Hash, reason: &str) -> Record {
        Record::chained(
            seq,
            prev,
            "force_revoke",
            "payout:acct-a",
            "worker-1",
            "7587",
            42,
            "alice",
            reason,
            1_700_000_000_000,
        )
    }

    #[test]
    fn genesis_is_the_sha256_of_the_tag() {
        assert_eq!(
            to_hex(&genesis()),
            to_hex(digest(&SHA256, b"payout-lock-audit-chain-v1").as_ref())
        );
    }

    #[test]
    fn a_chained_record_hashes_to_its_hash_and_any_edit_does_not() {
        let first = record(1, &genesis(), "stuck");
        assert!(first.hash_holds());
        assert_eq!(first.prev(), Some(genesis()));
        let second = record(2, &from_hex(&first.hash).unwrap(), "again");
        assert!(second.hash_holds());
        assert_eq!(second.prev_hash, first.hash);
        let edits: [fn(&mut Record); 9] = [
            |r| r.seq += 1,
            |r| r.action.push('x'),
            |r| r.key.push('x'),
            |r| r.revoked_owner.push('x'),
            |r| r.revoked_session_id.push('x'),
            |r| r.revoked_token += 1,
            |r| r.operator.push('x'),
            |r| r.reason.push('x'),
            |r| r.at_unix_ms += 1,
        ];
        for (i, edit) in edits.iter().enumerate() {
            let mut edited = second.clone();
            edit(&mut edited);
            assert!(!edited.hash_holds(), "edit {i} went unnoticed");
        }
        let mut relinked = second.clone();
        relinked.prev_hash = to_hex(&genesis());
        assert!(!relinked.hash_holds());
    }

    #[test]
    fn fields_cannot_slide_into_each_other() {
        let mut a = record(1, &genesis(), "x");
        let mut b = a.clone();
        a.operator = "ab".into();
        a.reason = "c".into();
        b.operator = "a".into();
        b.reason = "bc".into();
        assert_ne!(a.content(), b.content());
    }

    #[test]
    fn the_json_round_trips_whatever_the_field_order() {
        let r = record(3, &genesis(), "stuck");
        let mut v: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        let reordered: serde_json::Map<_, _> = std::mem::take(&mut v).into_iter().rev().collect();
        let back: Record = serde_json::from_value(serde_json::Value::Object(reordered)).unwrap();
        assert_eq!(back, r);
        assert!(back.hash_holds());
    }

    #[test]
    fn keys_sort_in_seq_order_and_only_seq_keys_parse() {
        let p = "/x/";
        assert!(record_key(p, 9) < record_key(p, 10));
        assert_eq!(record_key(p, 7), "/x/audit/00000000000000000007");
        assert_eq!(seq_of_key(p, &record_key(p, 12345)), Some(12345));
        assert_eq!(
            seq_of_key(p, "/x/audit/1f0e0f7c-1111-4222-8333-944445555666"),
            None
        );
        assert_eq!(seq_of_key(p, &head_key(p)), None);
        assert!(!head_key(p).starts_with(&records_prefix(p)));
        assert_eq!(from_hex(&to_hex(&genesis())), Some(genesis()));
        assert_eq!(from_hex("zz"), None);
    }
}
