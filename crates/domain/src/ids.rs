//! Synthetic identifiers. Never natural keys, never personal data (NFR-12).

use serde::{Deserialize, Serialize};

/// Longest identifier accepted anywhere; bounded so that keys, references and log lines stay small.
pub const ID_LENGTH_MAX: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{kind} is empty")]
    Empty { kind: &'static str },
    #[error("{kind} is longer than {ID_LENGTH_MAX} characters")]
    TooLong { kind: &'static str },
    #[error("{kind} may contain only ASCII letters, digits, '-', '_' and '.', got {value:?}")]
    InvalidCharacter { kind: &'static str, value: String },
}

fn validate(kind: &'static str, value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if value.len() > ID_LENGTH_MAX {
        return Err(IdError::TooLong { kind });
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.';
    if !value.chars().all(allowed) {
        return Err(IdError::InvalidCharacter {
            kind,
            value: value.to_string(),
        });
    }
    Ok(())
}

macro_rules! identifier {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn parse(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                validate($kind, &value)?;
                Ok(Self(value))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::parse(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

identifier!(
    /// A stable synthetic account identifier; the unit of locking and the carrier of the fence.
    AccountId,
    "account id"
);
identifier!(
    /// A payout identifier, chosen by the caller that creates the payout.
    PayoutId,
    "payout id"
);
identifier!(
    /// An opaque, synthetic beneficiary reference. Never a name or an account number.
    BeneficiaryRef,
    "beneficiary reference"
);

impl PayoutId {
    /// The GL idempotency key of this payout's lifecycle event `n` (the payment resource's outbox
    /// key, `payment-resource:payout:{id}:event:v{n}`): defined here so the payment resource that
    /// writes it and `payoutctl restore rearm` that finds it in the GL spell it alike.
    pub fn lifecycle_event_key(&self, event_version: i64) -> String {
        format!("payment-resource:payout:{}:event:v{event_version}", self.0)
    }
}

/// The reference the rail sees for a payout, and by which ambiguity is later looked up.
///
/// It can only be derived from a payout id, so it cannot be regenerated on retry: a regenerated
/// reference would make a duplicate payment undetectable at the rail.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClientReference(String);

impl ClientReference {
    pub fn for_payout(payout: &PayoutId) -> Self {
        Self(format!("cref-{}", payout.as_str()))
    }
    /// Accepts a client reference read back from a store or a wire; it must have our shape.
    pub fn parse(value: &str) -> Result<Self, IdError> {
        let payout = value
            .strip_prefix("cref-")
            .ok_or(IdError::InvalidCharacter {
                kind: "client reference",
                value: value.to_string(),
            })?;
        PayoutId::parse(payout)?;
        Ok(Self(value.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ClientReference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(AccountId::parse("acct-1").is_ok());
        assert_eq!(
            AccountId::parse(""),
            Err(IdError::Empty { kind: "account id" })
        );
        assert!(matches!(
            PayoutId::parse("a b"),
            Err(IdError::InvalidCharacter { .. })
        ));
        assert!(matches!(
            PayoutId::parse("x".repeat(65)),
            Err(IdError::TooLong { .. })
        ));
    }

    #[test]
    fn client_reference_is_derived_and_stable() {
        let p = PayoutId::parse("p-42").unwrap();
        assert_eq!(
            ClientReference::for_payout(&p),
            ClientReference::for_payout(&p)
        );
        assert_eq!(ClientReference::for_payout(&p).as_str(), "cref-p-42");
        assert!(ClientReference::parse("cref-p-42").is_ok());
        assert!(ClientReference::parse("p-42").is_err());
    }
}
