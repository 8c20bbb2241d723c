//! Money in integer minor units of a single currency (spec 2.8: no FX, no fees).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("amount must be positive, got {0}")]
    NotPositive(i64),
    #[error("currency must be three upper-case ASCII letters (ISO 4217), got {0:?}")]
    InvalidCurrency(String),
    #[error("currency {0:?} is not supported by this system")]
    UnsupportedCurrency(String),
}

/// A positive amount in minor units (cents). Payouts never move zero or a negative amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct AmountMinor(i64);

impl AmountMinor {
    pub fn new(value: i64) -> Result<Self, MoneyError> {
        if value <= 0 {
            return Err(MoneyError::NotPositive(value));
        }
        Ok(Self(value))
    }
    pub fn get(self) -> i64 {
        self.0
    }
}

impl TryFrom<i64> for AmountMinor {
    type Error = MoneyError;
    fn try_from(value: i64) -> Result<Self, MoneyError> {
        Self::new(value)
    }
}

impl From<AmountMinor> for i64 {
    fn from(value: AmountMinor) -> i64 {
        value.0
    }
}

impl std::fmt::Display for AmountMinor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The currencies this system settles, with their ISO 4217 minor-unit exponents. Bounded on
/// purpose: every currency added needs its exponent right, or amounts are off by powers of ten.
pub const SUPPORTED_CURRENCIES: [(&str, u32); 5] =
    [("EUR", 2), ("USD", 2), ("GBP", 2), ("CHF", 2), ("JPY", 0)];

/// An ISO 4217 alphabetic code. The system is single-currency per account.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Currency(String);

impl Currency {
    /// Accepts only the currencies in [`SUPPORTED_CURRENCIES`]: an unknown code is bad input.
    pub fn parse(value: &str) -> Result<Self, MoneyError> {
        if !(value.len() == 3 && value.chars().all(|c| c.is_ascii_uppercase())) {
            return Err(MoneyError::InvalidCurrency(value.to_string()));
        }
        if !SUPPORTED_CURRENCIES.iter().any(|(code, _)| *code == value) {
            return Err(MoneyError::UnsupportedCurrency(value.to_string()));
        }
        Ok(Self(value.to_string()))
    }

    /// Digits after the decimal point of the major unit (ISO 4217 minor unit).
    pub fn minor_unit_exponent(&self) -> u32 {
        SUPPORTED_CURRENCIES
            .iter()
            .find(|(code, _)| *code == self.0)
            .map(|(_, exponent)| *exponent)
            .expect("a parsed currency is supported")
    }

    /// A signed amount in minor units as a canonical decimal string of the major unit, which is
    /// what the General Ledger takes on the wire: `-1234` EUR is `"-12.34"`, `5` JPY is `"5"`.
    pub fn major_decimal_string(&self, amount_minor: i64) -> String {
        let exponent = self.minor_unit_exponent();
        let sign = if amount_minor < 0 { "-" } else { "" };
        let magnitude = amount_minor.unsigned_abs();
        if exponent == 0 {
            return format!("{sign}{magnitude}");
        }
        let scale = 10u64.pow(exponent);
        format!(
            "{sign}{}.{:0width$}",
            magnitude / scale,
            magnitude % scale,
            width = exponent as usize
        )
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Currency {
    type Error = MoneyError;
    fn try_from(value: String) -> Result<Self, MoneyError> {
        Self::parse(&value)
    }
}

impl From<Currency> for String {
    fn from(value: Currency) -> String {
        value.0
    }
}

impl std::fmt::Display for Currency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_are_positive() {
        assert_eq!(AmountMinor::new(0), Err(MoneyError::NotPositive(0)));
        assert_eq!(AmountMinor::new(-5), Err(MoneyError::NotPositive(-5)));
        assert_eq!(AmountMinor::new(7).unwrap().get(), 7);
    }

    #[test]
    fn currencies_are_iso_codes() {
        assert!(Currency::parse("EUR").is_ok());
        for bad in ["eur", "EU", "EURO", "", "E1R"] {
            assert!(Currency::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Currency::parse("XXX"),
            Err(MoneyError::UnsupportedCurrency("XXX".into()))
        );
    }

    #[test]
    fn major_decimal_strings_are_exact() {
        let eur = Currency::parse("EUR").unwrap();
        assert_eq!(eur.major_decimal_string(-1234), "-12.34");
        assert_eq!(eur.major_decimal_string(5), "0.05");
        assert_eq!(eur.major_decimal_string(100), "1.00");
        assert_eq!(eur.major_decimal_string(i64::MIN), "-92233720368547758.08");
        assert_eq!(
            Currency::parse("JPY").unwrap().major_decimal_string(-7),
            "-7"
        );
    }
}
