//! Canonical decimal strings: the only form in which amounts cross the GL boundary (spec 002,
//! invariant 3). Parsed once here into `rust_decimal::Decimal`; floats never exist in this crate.

use rust_decimal::Decimal;

/// `numeric(38,18)`: at most 18 digits after the point...
pub const FRACTION_DIGITS_MAX: usize = 18;
/// ...and at most 38 - 18 = 20 before it. rust_decimal's 96-bit mantissa narrows the range further
/// (28 significant digits), which is reported as out of range too.
pub const INTEGER_DIGITS_MAX: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmountError {
    /// Not `-?(0|[1-9][0-9]*)(\.[0-9]+)?`: floats' exponents, '+', leading zeros, separators, blanks.
    NonCanonical,
    PrecisionExceeded,
    OutOfRange,
    Zero,
}

/// Parses a canonical decimal string. Trailing fractional zeros are allowed ("12.30" is how
/// `Currency::major_decimal_string` writes cents); the value, not the spelling, is what is hashed.
pub fn parse_canonical(text: &str) -> Result<Decimal, AmountError> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let (integer, fraction) = match digits.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (digits, None),
    };
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(integer) || (integer.len() > 1 && integer.starts_with('0')) {
        return Err(AmountError::NonCanonical);
    }
    if let Some(fraction) = fraction {
        if !all_digits(fraction) {
            return Err(AmountError::NonCanonical);
        }
        if fraction.len() > FRACTION_DIGITS_MAX {
            return Err(AmountError::PrecisionExceeded);
        }
    }
    if integer.len() > INTEGER_DIGITS_MAX {
        return Err(AmountError::OutOfRange);
    }
    let value = Decimal::from_str_exact(text).map_err(|_| AmountError::OutOfRange)?;
    if value.is_zero() {
        return Err(AmountError::Zero);
    }
    Ok(value)
}

/// The canonical spelling of a stored amount: no trailing zeros, no exponent.
pub fn format(value: Decimal) -> String {
    value.normalize().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_canonical() {
        for ok in [
            "1",
            "-12.34",
            "12.30",
            "0.000000000000000001",
            "99999999999999999999",
            "-0.5",
        ] {
            assert!(parse_canonical(ok).is_ok(), "{ok}");
        }
        assert_eq!(format(parse_canonical("12.30").unwrap()), "12.3");
    }

    #[test]
    fn rejects_each_kind() {
        use AmountError::*;
        let cases = [
            ("", NonCanonical),
            ("+1", NonCanonical),
            ("01", NonCanonical),
            ("1e3", NonCanonical),
            ("1E3", NonCanonical),
            ("1,5", NonCanonical),
            ("1.000,00", NonCanonical),
            ("1 000", NonCanonical),
            (".5", NonCanonical),
            ("5.", NonCanonical),
            ("--1", NonCanonical),
            ("NaN", NonCanonical),
            ("inf", NonCanonical),
            (" 1", NonCanonical),
            ("0.0000000000000000001", PrecisionExceeded),
            ("123456789012345678901", OutOfRange),
            ("12345678901234567890.1234567890123", OutOfRange),
            ("0", Zero),
            ("-0.00", Zero),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_canonical(text), Err(expected), "{text:?}");
        }
    }
}
