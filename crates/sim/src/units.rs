//! Byte sizes as written in scenario files.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A number of bytes, written in a scenario either as an integer (`16`) or as a string with
/// a binary unit (`"4KB"`, `"1 MB"`, `"1GiB"`; K, M and G are powers of 1024, as in the
/// RDMA tools: perftest's 1 MB message is 1048576 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }

    /// Parses `"16"`, `"16B"`, `"4KB"`, `"4 KiB"`, `"1MB"`, `"1GB"` (case-insensitive).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("`{text}` is not a size (expected e.g. 16, \"4KB\", \"1MB\")"))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            other => {
                return Err(format!(
                    "unknown size unit `{other}` in `{text}` (use B, KB, MB or GB)"
                ))
            }
        };
        let bytes = value * scale as f64;
        if !(bytes.is_finite() && bytes >= 0.0 && bytes.fract() == 0.0) {
            return Err(format!("`{text}` is not a whole number of bytes"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
            write!(f, "{}GB", b >> 30)
        } else if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
            write!(f, "{}MB", b >> 20)
        } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
            write!(f, "{}KB", b >> 10)
        } else {
            write!(f, "{b}B")
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count such as 16 or \"1MB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_units() {
        assert_eq!(ByteSize::parse("16"), Ok(ByteSize(16)));
        assert_eq!(ByteSize::parse("16B"), Ok(ByteSize(16)));
        assert_eq!(ByteSize::parse("5 KB"), Ok(ByteSize(5120)));
        assert_eq!(ByteSize::parse("1MB"), Ok(ByteSize(1 << 20)));
        assert_eq!(ByteSize::parse("1GiB"), Ok(ByteSize(1 << 30)));
        assert_eq!(ByteSize::parse("0.5MB"), Ok(ByteSize(1 << 19)));
        assert!(ByteSize::parse("1TB").is_err());
        assert!(ByteSize::parse("big").is_err());
        assert!(ByteSize::parse("1.5B").is_err());
    }

    #[test]
    fn displays_compactly() {
        assert_eq!(ByteSize(1 << 20).to_string(), "1MB");
        assert_eq!(ByteSize(5120).to_string(), "5KB");
        assert_eq!(ByteSize(16).to_string(), "16B");
        assert_eq!(ByteSize(1 << 30).to_string(), "1GB");
    }

    #[test]
    fn deserializes_numbers_and_strings() {
        #[derive(Deserialize)]
        struct S {
            a: ByteSize,
            b: ByteSize,
        }
        let s: Result<S, _> = toml::from_str("a = 16\nb = \"1MB\"\n");
        let s = s.map(|s| (s.a, s.b)).ok();
        assert_eq!(s, Some((ByteSize(16), ByteSize(1 << 20))));
        assert!(toml::from_str::<S>("a = -1\nb = 1\n").is_err());
    }
}
