//! Host keys: each host's X25519 private key and the public keys of the cluster's members.
//!
//! Keys are written as base64 of their 32 bytes (one line, as `wg genkey` writes them).
//! X25519 arithmetic is snow's (its Curve25519 implementation), so this module computes
//! nothing by hand.
//!
//! Invariants: a [`PrivateKey`] is never printed (its `Debug` shows its public key only);
//! a key whose bytes are all alike (all zeros, a file of newlines decoded as key bytes)
//! or whose public key is all zeros is refused as degenerate.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use snow::params::DHChoice;
use snow::resolvers::{CryptoResolver, DefaultResolver};

/// Bytes of a key, private or public.
pub const KEY_LEN: usize = 32;

/// Why a key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not base64 of 32 bytes.
    #[error("not a key: expected base64 of 32 bytes (as `justitiad genkey` writes), {0}")]
    Format(String),
    /// Every byte alike, or a public key of zeros: no secret at all.
    #[error("a degenerate key (every byte alike, or a zero public key): generate one with `justitiad genkey`")]
    Degenerate,
}

/// This host's static X25519 private key.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKey([u8; KEY_LEN]);

/// A member's static X25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; KEY_LEN]);

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself, even in a debug log.
        write!(f, "PrivateKey(public {})", self.public())
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&STANDARD.encode(self.0))
    }
}

fn decode(text: &str) -> Result<[u8; KEY_LEN], KeyError> {
    let bytes = STANDARD
        .decode(text.trim())
        .map_err(|e| KeyError::Format(e.to_string()))?;
    <[u8; KEY_LEN]>::try_from(bytes.as_slice())
        .map_err(|_| KeyError::Format(format!("{} bytes", bytes.len())))
}

fn all_alike(bytes: &[u8; KEY_LEN]) -> bool {
    bytes.iter().all(|&b| b == bytes[0])
}

impl PrivateKey {
    /// A key from its bytes (for a new key, 32 random bytes the caller draws), refused
    /// when degenerate.
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> Result<Self, KeyError> {
        let key = PrivateKey(bytes);
        if all_alike(&bytes) || key.public().0 == [0; KEY_LEN] {
            return Err(KeyError::Degenerate);
        }
        Ok(key)
    }

    /// A key from its text (base64, surrounding whitespace ignored).
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        Self::from_bytes(decode(text)?)
    }

    /// The key's bytes, for the handshake.
    pub fn bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }

    /// The key as `justitiad genkey` writes it.
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }

    /// Its public key: X25519 of the base point.
    pub fn public(&self) -> PublicKey {
        let mut out = [0; KEY_LEN];
        if let Some(mut dh) = DefaultResolver.resolve_dh(&DHChoice::Curve25519) {
            dh.set(&self.0);
            out.copy_from_slice(&dh.pubkey()[..KEY_LEN]);
        }
        // Curve25519 is compiled in (a feature of this crate's snow): the zeros are never
        // returned, and would be refused as degenerate if they were.
        PublicKey(out)
    }
}

impl PublicKey {
    /// A public key from its text (base64), refused when degenerate.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let bytes = decode(text)?;
        if all_alike(&bytes) {
            return Err(KeyError::Degenerate);
        }
        Ok(PublicKey(bytes))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// RFC 7748 §6.1: Alice's private key and public key.
    #[test]
    fn the_public_key_is_rfc_7748s() {
        let hex = |s: &str| -> [u8; 32] {
            let v: Vec<u8> = (0..64)
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect();
            v.try_into().unwrap()
        };
        let private = PrivateKey::from_bytes(hex(
            "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
        ))
        .unwrap();
        assert_eq!(
            private.public().0,
            hex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
        );
        let text = private.to_base64();
        assert_eq!(PrivateKey::parse(&format!("{text}\n")).unwrap(), private);
        assert!(!format!("{private:?}").contains(&text), "never printed");
    }

    #[test]
    fn degenerate_and_malformed_keys_are_refused_by_name() {
        assert_eq!(
            PrivateKey::from_bytes([0; 32]).err(),
            Some(KeyError::Degenerate),
            "all zeros"
        );
        // A key file of newlines, had it decoded to bytes.
        assert_eq!(
            PrivateKey::from_bytes([b'\n'; 32]).err(),
            Some(KeyError::Degenerate)
        );
        assert!(matches!(
            PrivateKey::parse("\n\n\n"),
            Err(KeyError::Format(_))
        ));
        assert!(matches!(
            PrivateKey::parse(&STANDARD.encode([5u8; 31])),
            Err(KeyError::Format(m)) if m.contains("31 bytes")
        ));
        assert_eq!(
            PublicKey::parse(&STANDARD.encode([0u8; 32])).err(),
            Some(KeyError::Degenerate)
        );
    }
}
