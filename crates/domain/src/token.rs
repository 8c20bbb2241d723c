//! The fencing token: the integer that crosses every trust boundary (spec 2.6).

use serde::{Deserialize, Serialize};

/// A fencing token: the etcd revision at which a grant's key was created (or the value of a
/// never-reset sequence in the PostgreSQL lock backend).
///
/// Tokens are strictly increasing per lock key and are compared only within one key. Zero is
/// never a valid token: a guard's stored fence starts at zero so that the first grant passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct FencingToken(u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a fencing token must be positive (a missing token is not token zero)")]
pub struct ZeroToken;

impl FencingToken {
    pub fn new(value: u64) -> Result<Self, ZeroToken> {
        if value == 0 {
            return Err(ZeroToken);
        }
        Ok(Self(value))
    }
    pub fn get(self) -> u64 {
        self.0
    }
    /// The value as PostgreSQL `bigint`. Revisions fit: etcd's are i64 on the wire.
    pub fn as_i64(self) -> i64 {
        i64::try_from(self.0).expect("fencing tokens are etcd revisions, which are i64")
    }
    /// The guard predicate, stated once: a token at or above the stored fence is the current
    /// holder (equal means the same grant, since tokens are unique per grant); below is stale.
    pub fn admitted_by(self, stored_fence: u64) -> bool {
        self.0 >= stored_fence
    }
}

impl TryFrom<u64> for FencingToken {
    type Error = ZeroToken;
    fn try_from(value: u64) -> Result<Self, ZeroToken> {
        Self::new(value)
    }
}

impl From<FencingToken> for u64 {
    fn from(value: FencingToken) -> u64 {
        value.0
    }
}

impl std::fmt::Display for FencingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_is_not_a_token() {
        assert_eq!(FencingToken::new(0), Err(ZeroToken));
    }

    #[test]
    fn equal_passes_lower_is_stale() {
        let t = FencingToken::new(10).unwrap();
        assert!(t.admitted_by(0));
        assert!(t.admitted_by(10));
        assert!(!t.admitted_by(11));
    }
}
