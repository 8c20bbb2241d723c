//! What a lock key may be: `payout:{account id}`, and nothing else.
//!
//! The lock service serves one kind of key, an account's (spec 2.2: the account is the unit of
//! locking). A key outside that grammar is refused before it reaches the backend, the waiter
//! queues or the issued-token record: no caller can grow etcd, lockdb or this process's memory with
//! keys of its own invention, or make a key that sorts or prefixes like another's.
//!
//! The grammar restates `payout_domain::ids` (the lock service links nothing of the payout
//! domain: tests/tests/dependency_rules.rs); tests/tests/lock_key_grammar.rs holds the two to the
//! same table of accepted and refused keys.

use crate::error::LockError;

/// Every key starts with this.
pub const KEY_PREFIX: &str = "payout:";
/// The longest account id (`payout_domain::ids::ID_LENGTH_MAX`).
pub const ACCOUNT_ID_LENGTH_MAX: usize = 64;
/// The longest key: the prefix and the longest account id.
pub const KEY_LENGTH_MAX: usize = KEY_PREFIX.len() + ACCOUNT_ID_LENGTH_MAX;

/// Whether `c` may appear in an account id: ASCII letters, digits, `-`, `_` and `.`.
fn account_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.'
}

/// `Ok` for `payout:{account id}`; otherwise INVALID_ARGUMENT on `field`, saying what is wrong.
pub fn check(field: &'static str, key: &str) -> Result<(), LockError> {
    let Some(account) = key.strip_prefix(KEY_PREFIX) else {
        return Err(LockError::invalid(
            field,
            format!("must be {KEY_PREFIX}{{account id}}"),
        ));
    };
    if account.is_empty() {
        return Err(LockError::invalid(field, "the account id is empty"));
    }
    if account.len() > ACCOUNT_ID_LENGTH_MAX {
        return Err(LockError::invalid(
            field,
            format!("the account id is longer than {ACCOUNT_ID_LENGTH_MAX} characters"),
        ));
    }
    if !account.chars().all(account_char) {
        return Err(LockError::invalid(
            field,
            "the account id may contain only ASCII letters, digits, '-', '_' and '.'",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_account_keys_pass() {
        let longest = format!("payout:{}", "a".repeat(ACCOUNT_ID_LENGTH_MAX));
        assert_eq!(longest.len(), KEY_LENGTH_MAX);
        for good in ["payout:acct-1", "payout:A.b_c-9", longest.as_str()] {
            assert!(check("key", good).is_ok(), "{good}");
        }
        let too_long = format!("payout:{}", "a".repeat(ACCOUNT_ID_LENGTH_MAX + 1));
        for bad in [
            "",
            "other",
            "payout:",
            "payout:a/b",
            "payout:a b",
            "payout:a\0",
            "payout:é",
            "Payout:a",
            " payout:a",
            too_long.as_str(),
        ] {
            assert!(check("key", bad).is_err(), "{bad:?}");
        }
    }
}
