//! Sizes with units: `150GB` = 150×10^9 bytes, `140GiB` = 140×2^30. A bare number is refused so
//! nobody has to guess which unit was meant.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("size `{0}` has no unit: write e.g. `150GB` (10^9 bytes) or `140GiB` (2^30 bytes)")]
    NoUnit(String),
    #[error("size `{0}`: unknown unit `{1}` (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")]
    BadUnit(String, String),
    #[error("size `{0}`: `{1}` reads as bits (a capital prefix and a small b, as in Gb/s); sizes are bytes: write `{2}`")]
    Bits(String, String, String),
    #[error("size `{0}` is not a number followed by a unit")]
    BadNumber(String),
    #[error("size `{0}` is negative: a size counts bytes, from 0")]
    Negative(String),
    #[error("size `{0}` is too large: at most 1024TiB")]
    Overflow(String),
    #[error("size `{0}` is a fraction of a byte")]
    Fraction(String),
}

/// The largest size taken (1024 TiB, 2^50 bytes): more than any machine's memory or disk, and
/// small enough that sums and products of a few sizes and rank counts cannot overflow.
pub const MAX_SIZE: u64 = 1 << 50;

/// Parses a byte size with a unit; decimals allowed (`1.5GiB`, `137.42GiB`), computed exactly
/// and rounded down to whole bytes (so the plan's advice, in the unit typed, reads back as at
/// most what it names). A fraction of a byte (`2.5B`), a size that rounds down to nothing
/// (`0.0001KB`), and one over [`MAX_SIZE`] are refused.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    if t.starts_with('-') && t[1..].starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return Err(SizeError::Negative(s.into()));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    if num.is_empty() {
        return Err(SizeError::BadNumber(s.into()));
    }
    if unit.is_empty() {
        return Err(SizeError::NoUnit(s.into()));
    }
    // `Gb`, `Mb`: the bits of network rates, not bytes (`gb` and `GB` are bytes).
    if let Some(prefix) = unit
        .strip_suffix('b')
        .filter(|p| p.len() == 1 && p.chars().all(|c| c.is_ascii_uppercase()))
    {
        return Err(SizeError::Bits(
            s.into(),
            unit.into(),
            format!("{num}{prefix}B"),
        ));
    }
    let mult = multiplier(unit).ok_or_else(|| SizeError::BadUnit(s.into(), unit.into()))?;
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if (whole.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(SizeError::BadNumber(s.into()));
    }
    // Digits past the 18th after the point are below a byte of any unit here: dropped.
    let frac = &frac.trim_end_matches('0')[..frac.trim_end_matches('0').len().min(18)];
    let whole = whole.trim_start_matches('0');
    if whole.len() > 20 {
        return Err(SizeError::Overflow(s.into()));
    }
    let digits = |d: &str| d.parse::<u128>().unwrap_or(0);
    let scale = 10u128.pow(frac.len() as u32);
    let exact = digits(whole)
        .checked_mul(scale)
        .and_then(|w| w.checked_add(digits(frac)))
        .and_then(|n| n.checked_mul(mult as u128))
        .ok_or_else(|| SizeError::Overflow(s.into()))?;
    if mult == 1 && !frac.is_empty() {
        return Err(SizeError::Fraction(s.into()));
    }
    let bytes = exact / scale;
    if bytes == 0 && exact > 0 {
        return Err(SizeError::Fraction(s.into()));
    }
    if bytes > MAX_SIZE as u128 {
        return Err(SizeError::Overflow(s.into()));
    }
    Ok(bytes as u64)
}

/// The unit of a size as typed (`GB` of `150GB`, `GiB` of `140GiB`) and its multiplier.
fn unit_of(typed: &str) -> Option<(&str, u64)> {
    let t = typed.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let unit = t[split..].trim();
    Some((unit, multiplier(unit)?))
}

/// Bytes in one of `unit` (case-insensitive), if it is a known unit.
fn multiplier(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    })
}

/// `b` in the unit an operator typed (`typed` = `150GB` → `37.5GB`; `1GiB` → `1GiB`), at most
/// two decimals, trailing zeros dropped: a value to type back into the same flag.
pub fn in_unit_of(b: u64, typed: &str) -> String {
    match unit_of(typed) {
        Some((unit, mult)) => {
            // Rounded down: advice "N fits" must never name more than fits. Bytes are whole.
            let hundredths = b as u128 * 100 / mult as u128;
            if mult == 1 || (hundredths == 0 && b > 0) {
                return format!("{b}B");
            }
            let v = format!("{}.{:02}", hundredths / 100, hundredths % 100);
            let v = v.trim_end_matches('0').trim_end_matches('.');
            format!("{v}{unit}")
        }
        None => format_bytes(b),
    }
}

/// `b` echoed in the unit typed, with exact bytes: `150GB (150000000000 bytes)`. When `typed`
/// is exactly `b`, it is echoed as typed.
pub fn echo_size(b: u64, typed: &str) -> String {
    if parse_size(typed) == Ok(b) {
        return format!("{} ({b} bytes)", typed.trim());
    }
    format!("{} ({b} bytes)", in_unit_of(b, typed))
}

/// A URL as a message or a log may show it: its user information (`user:password@`, up to the
/// last `@`, since a password may hold `/` or `@`) shown as `…@`, whether or not the rest
/// parses. An `@` later in the URL (a path's, a query's) hides more than it needs to: never
/// less. Every URL a flag takes (worker URLs, `--l3` Redis URLs) is echoed through this.
pub fn shown_url(u: &str) -> String {
    let (scheme, rest) = u.split_once("://").unwrap_or(("", u));
    match rest.rfind('@') {
        Some(at) => {
            let sep = if scheme.is_empty() { "" } else { "://" };
            format!("{scheme}{sep}…{}", &rest[at..])
        }
        None => u.to_string(),
    }
}

/// A number as an operator would type it back: as Rust writes it where that is short (`0.5`,
/// `86400`, `0.30000000000000004`), in exponent form where that would be long (`1e300`,
/// `-1e-300`, not three hundred digits). Flags' errors echo numbers so.
pub fn shown_number(v: f64) -> String {
    let plain = v.to_string();
    if plain.len() <= 24 {
        plain
    } else {
        format!("{v:e}")
    }
}

/// `12.00 GiB (12884901888 bytes)`: binary units, with exact bytes.
pub fn format_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2} {} ({b} bytes)", U[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_credentials() {
        for (u, shown) in [
            ("http://user:pw@h:1/x", "http://…@h:1/x"),
            ("http://u:p@ss@h", "http://…@h"),
            ("rediss://:pw@h:6380", "rediss://…@h:6380"),
            ("redis://u:pw@h:1/0", "redis://…@h:1/0"),
            // A Redis password may hold `/`: the user information ends at the last `@`.
            ("redis://:p/w@h:1", "redis://…@h:1"),
            ("redis-cluster://:pw@a:1,b:2", "redis-cluster://…@a:1,b:2"),
            ("user:pw@h", "…@h"),
            // An `@` in a path hides the host too: more than needed, never less.
            ("http://h:1/a@b", "http://…@b"),
            ("http://a b:1", "http://a b:1"),
            ("redis://h:1", "redis://h:1"),
        ] {
            assert_eq!(shown_url(u), shown, "{u}");
        }
    }

    #[test]
    fn numbers_are_shown_short() {
        for (v, want) in [
            (0.5, "0.5"),
            (86400.0, "86400"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e300, "1e300"),
            (-1e-300, "-1e-300"),
            (1.5e30, "1.5e30"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(shown_number(v), want);
        }
    }

    #[test]
    fn sizes_are_echoed_in_the_unit_typed() {
        assert_eq!(echo_size(1 << 30, "1GiB"), "1GiB (1073741824 bytes)");
        assert_eq!(
            echo_size(150_000_000_000, "150GB"),
            "150GB (150000000000 bytes)"
        );
        assert_eq!(
            echo_size(37_500_000_000, "150GB"),
            "37.5GB (37500000000 bytes)"
        );
        assert_eq!(in_unit_of(13_210_000_000, "150GB"), "13.21GB");
        assert_eq!(in_unit_of(3 << 29, "2GiB"), "1.5GiB");
        // Down, never up: 0.996 TiB is not "1TiB".
        assert_eq!(in_unit_of((1u64 << 40) / 1000 * 996, "2TiB"), "0.99TiB");
        assert_eq!(in_unit_of(5, "1TB"), "5B");
    }

    #[test]
    fn units() {
        assert_eq!(parse_size("150GB"), Ok(150_000_000_000));
        assert_eq!(parse_size("140GiB"), Ok(140 << 30));
        assert_eq!(parse_size("1.5KiB"), Ok(1536));
        assert_eq!(parse_size(" 8 MiB "), Ok(8 << 20));
        assert_eq!(parse_size("150"), Err(SizeError::NoUnit("150".into())));
        assert!(matches!(parse_size("10XB"), Err(SizeError::BadUnit(..))));
        // A capital prefix with a small b is bits; the error names the byte unit to write.
        for bits in ["150Gb", "5Mb", "1Tb", "3Kb"] {
            let e = parse_size(bits).unwrap_err();
            assert!(matches!(e, SizeError::Bits(..)), "{bits}");
            assert!(
                e.to_string()
                    .contains(&format!("write `{}B`", &bits[..bits.len() - 1])),
                "{e}"
            );
        }
        assert_eq!(parse_size("150gb"), Ok(150_000_000_000));
        assert_eq!(parse_size("150GB"), Ok(150_000_000_000));
        assert!(matches!(parse_size("GiB"), Err(SizeError::BadNumber(..))));
        for neg in ["-1GB", " -0.5GiB", "-.5KB"] {
            assert_eq!(
                parse_size(neg),
                Err(SizeError::Negative(neg.into())),
                "{neg}"
            );
        }
        assert!(matches!(parse_size("-GB"), Err(SizeError::BadNumber(..))));
        assert!(matches!(
            parse_size("99999999999TiB"),
            Err(SizeError::Overflow(..))
        ));
        // Exact decimals, rounded down to whole bytes; no fraction of a byte; at most 1024TiB;
        // one point, digits on a side.
        assert_eq!(parse_size("1.1GB"), Ok(1_100_000_000));
        assert_eq!(parse_size("1.1GiB"), Ok(1_181_116_006));
        assert_eq!(parse_size("0.001KB"), Ok(1));
        assert_eq!(parse_size("1.000B"), Ok(1));
        assert_eq!(parse_size("007GB"), Ok(7_000_000_000));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("5.KiB"), Ok(5 << 10));
        assert_eq!(parse_size("1.0000000000000000000001GB"), Ok(1_000_000_000));
        for bad in ["2.5B", "0.0001B", "1.5B", "0.0001KB"] {
            assert_eq!(
                parse_size(bad),
                Err(SizeError::Fraction(bad.into())),
                "{bad}"
            );
        }
        assert_eq!(parse_size("1024TiB"), Ok(MAX_SIZE));
        for big in [
            "1025TiB",
            "16777215TiB",
            "1125899906842625B",
            "1e30GB",
            "99999999999999999999999GB",
        ] {
            assert!(parse_size(big).is_err(), "{big}");
        }
        for bad in [".", "1.2.3GB", "..GB"] {
            assert!(
                matches!(
                    parse_size(bad),
                    Err(SizeError::BadNumber(..) | SizeError::NoUnit(..))
                ),
                "{bad}"
            );
        }
        // The advice, in the unit typed, reads back as at most what it names.
        for (b, t) in [
            (137_420_000_000u64 << 3, "1GiB"),
            (147_573_952_589, "150GiB"),
            (12_345, "1KB"),
            (MAX_SIZE, "1TiB"),
        ] {
            let typed = in_unit_of(b, t);
            let back = parse_size(&typed).unwrap();
            assert!(
                back <= b && b - back < (1 << 40) / 100 + 1,
                "{b} {t} {typed} {back}"
            );
        }
        assert_eq!(parse_size("0GB"), Ok(0));
        // In the unit typed, bytes whole, never truncated.
        assert_eq!(in_unit_of(MAX_SIZE, "1B"), "1125899906842624B");
        assert_eq!(in_unit_of(u64::MAX, "1KB"), "18446744073709551.61KB");
        assert_eq!(format_bytes(1536), "1.50 KiB (1536 bytes)");
    }
}
