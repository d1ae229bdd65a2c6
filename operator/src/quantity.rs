//! Kubernetes resource quantities (`8Gi`, `1500Mi`, `2`, `500m`, `1e9`) read as numbers, for
//! deriving worker flags from a pod's limits.

use thiserror::Error;

/// A quantity the operator cannot read.
#[derive(Debug, Error, PartialEq)]
#[error("`{0}` is not a Kubernetes quantity")]
pub struct BadQuantity(pub String);

/// The value of a quantity (`2Gi` -> 2147483648.0, `500m` -> 0.5).
pub fn parse(text: &str) -> Result<f64, BadQuantity> {
    let bad = || BadQuantity(text.to_string());
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    if number.is_empty() {
        return Err(bad());
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let scale = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0_f64.powi(2),
        "Gi" => 1024.0_f64.powi(3),
        "Ti" => 1024.0_f64.powi(4),
        "Pi" => 1024.0_f64.powi(5),
        "Ei" => 1024.0_f64.powi(6),
        exp if exp.starts_with(['e', 'E']) => {
            let power: i32 = exp[1..].parse().map_err(|_| bad())?;
            10.0_f64.powi(power)
        }
        _ => return Err(bad()),
    };
    let result = value * scale;
    if result.is_finite() && result >= 0.0 {
        Ok(result)
    } else {
        Err(bad())
    }
}

/// A byte quantity, rounded up to whole bytes.
pub fn bytes(text: &str) -> Result<u64, BadQuantity> {
    let value = parse(text)?.ceil();
    if value > u64::MAX as f64 {
        return Err(BadQuantity(text.to_string()));
    }
    Ok(value as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_suffixes() {
        assert_eq!(bytes("8Gi"), Ok(8 << 30));
        assert_eq!(bytes("1500Mi"), Ok(1500 << 20));
        assert_eq!(bytes("1G"), Ok(1_000_000_000));
        assert_eq!(bytes("1e9"), Ok(1_000_000_000));
        assert_eq!(bytes("123"), Ok(123));
        assert_eq!(bytes("1.5Ki"), Ok(1536));
    }

    #[test]
    fn cpu_millis() {
        assert_eq!(parse("500m"), Ok(0.5));
        assert_eq!(parse("2"), Ok(2.0));
        assert_eq!(parse("2.5"), Ok(2.5));
    }

    #[test]
    fn rejects_garbage() {
        for text in ["", "Gi", "8Gb", "-1Gi", "1e", "abc", "1..2"] {
            assert!(parse(text).is_err(), "{text} parsed");
        }
    }
}
