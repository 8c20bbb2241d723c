//! The fencing token: the integer that crosses every trust boundary (spec 2.6).

use serde::{Deserialize, Serialize};

/// A fencing token: the etcd revision at which a grant's key was created (or the value of a
/// never-reset sequence in the PostgreSQL lock backend).
///
/// Tokens are strictly increasing per lock key and are compared only within one key. Zero is
/// never a valid token: a guard's stored fence starts at zero so that the first grant passes.
/// A token is at most `i64::MAX`: etcd revisions are `int64` on the wire and both guards store
/// tokens as PostgreSQL `bigint`, so a larger value can only be a corrupted or hostile input.
/// Both bounds are checked here, at construction, so every `FencingToken` fits every store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct FencingToken(u64);

/// Why a value is not a fencing token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("a fencing token must be positive (a missing token is not token zero)")]
    Zero,
    #[error(
        "fencing token {value} is above {} (no lock backend issues it; no guard can store it)",
        FencingToken::MAX
    )]
    AboveMax { value: u64 },
}

impl FencingToken {
    /// The largest token: `i64::MAX`, the range of an etcd revision and of a `bigint` column.
    pub const MAX: u64 = i64::MAX as u64;

    pub fn new(value: u64) -> Result<Self, TokenError> {
        if value == 0 {
            return Err(TokenError::Zero);
        }
        if value > Self::MAX {
            return Err(TokenError::AboveMax { value });
        }
        Ok(Self(value))
    }
    pub fn get(self) -> u64 {
        self.0
    }
    /// The value as PostgreSQL `bigint`. Cannot fail: `new` refused everything above `i64::MAX`.
    pub fn as_i64(self) -> i64 {
        self.0 as i64
    }
    /// The guard predicate, stated once: a token at or above the stored fence is the current
    /// holder (equal means the same grant, since tokens are unique per grant); below is stale.
    pub fn admitted_by(self, stored_fence: u64) -> bool {
        self.0 >= stored_fence
    }
}

impl TryFrom<u64> for FencingToken {
    type Error = TokenError;
    fn try_from(value: u64) -> Result<Self, TokenError> {
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
        assert_eq!(FencingToken::new(0), Err(TokenError::Zero));
    }

    #[test]
    fn above_i64_max_is_not_a_token() {
        let max = FencingToken::new(i64::MAX as u64).unwrap();
        assert_eq!(max.as_i64(), i64::MAX);
        for value in [i64::MAX as u64 + 1, u64::MAX] {
            assert_eq!(
                FencingToken::new(value),
                Err(TokenError::AboveMax { value })
            );
        }
        // Deserialising goes through the same check (tokens travel in Temporal payloads).
        assert!(serde_json::from_str::<FencingToken>(&u64::MAX.to_string()).is_err());
        assert!(serde_json::from_str::<FencingToken>("0").is_err());
        assert_eq!(
            serde_json::from_str::<FencingToken>("7").unwrap(),
            FencingToken::new(7).unwrap()
        );
    }

    #[test]
    fn equal_passes_lower_is_stale() {
        let t = FencingToken::new(10).unwrap();
        assert!(t.admitted_by(0));
        assert!(t.admitted_by(10));
        assert!(!t.admitted_by(11));
    }
}
