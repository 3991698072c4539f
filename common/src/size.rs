//! Byte sizes with suffixes, as operators write them: `4096`, `4k`, `4KiB`,
//! `1M`, `1MiB`, `2G`, `1GB`. Binary multiples throughout (k = 1024), as
//! storage tools such as fio and dd do.

use std::fmt;

/// Why a size string could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason}")]
pub struct SizeError {
    pub input: String,
    pub reason: &'static str,
}

/// A size in bytes that was written with an optional suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `N[k|K|m|M|g|G|t|T][i][b|B]`.
    pub fn parse(input: &str) -> Result<Self, SizeError> {
        let err = |reason| SizeError { input: input.to_owned(), reason };
        let s = input.trim();
        let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        if digits_end == 0 {
            return Err(err("expected a number"));
        }
        let number: u64 = s[..digits_end].parse().map_err(|_| err("number too large"))?;
        let suffix = s[digits_end..].trim();
        let shift = match suffix.to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kb" | "kib" => 10,
            "m" | "mb" | "mib" => 20,
            "g" | "gb" | "gib" => 30,
            "t" | "tb" | "tib" => 40,
            _ => return Err(err("unknown suffix (use k, M, G or T)")),
        };
        number.checked_mul(1u64 << shift).map(ByteSize).ok_or_else(|| err("size overflows 64 bits"))
    }
}

impl std::str::FromStr for ByteSize {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ByteSize::parse(s)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
        for (unit, shift) in UNITS {
            if self.0 != 0 && self.0 % (1u64 << shift) == 0 {
                return write!(f, "{}{}", self.0 >> shift, unit);
            }
        }
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(ByteSize::parse("4096").unwrap().0, 4096);
        assert_eq!(ByteSize::parse("4k").unwrap().0, 4096);
        assert_eq!(ByteSize::parse("4KiB").unwrap().0, 4096);
        assert_eq!(ByteSize::parse("1MiB").unwrap().0, 1 << 20);
        assert_eq!(ByteSize::parse("1M").unwrap().0, 1 << 20);
        assert_eq!(ByteSize::parse("2G").unwrap().0, 2 << 30);
        assert_eq!(ByteSize::parse("1GB").unwrap().0, 1 << 30);
    }

    #[test]
    fn rejects_garbage() {
        assert!(ByteSize::parse("").is_err());
        assert!(ByteSize::parse("k").is_err());
        assert!(ByteSize::parse("12q").is_err());
        assert!(ByteSize::parse("-1").is_err());
        assert!(ByteSize::parse("99999999999999T").is_err());
    }

    #[test]
    fn displays_largest_exact_unit() {
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
        assert_eq!(ByteSize(12288).to_string(), "12KiB");
        assert_eq!(ByteSize(1000).to_string(), "1000");
    }
}
