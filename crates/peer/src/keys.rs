//! Host keys: each host's X25519 private key and the public keys of the cluster's members.
//!
//! Keys are written as base64 of their 32 bytes (one line, as `wg genkey` writes them).
//! X25519 arithmetic is snow's (its Curve25519 implementation), so this module computes
//! nothing by hand.
//!
//! Two members also share a [`PairKey`] without any handshake: a keyed hash of the X25519
//! of one's private key and the other's public key, bound to both public keys. It MACs
//! the handshake messages, so that a receiver refuses a handshake from a host that holds
//! neither key with one keyed hash, before the DH and before the sender's budget (as
//! WireGuard's mac1 does with the responder's public key, but keyed by a secret: a member's
//! public key is in every host's configuration, its pair keys are not).
//!
//! Invariants: a [`PrivateKey`] or [`PairKey`] is never printed (a private key's `Debug`
//! shows its public key only); a key whose bytes are all alike (all zeros, a file of
//! newlines decoded as key bytes) or whose public key is all zeros is refused as
//! degenerate; a public key of small order (whose X25519 with any key is zero) has no
//! pair key.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use snow::params::{DHChoice, HashChoice};
use snow::resolvers::{CryptoResolver, DefaultResolver};
use subtle::ConstantTimeEq;

/// Bytes of a key, private or public.
pub const KEY_LEN: usize = 32;
/// Bytes of a handshake message's MAC (a BLAKE2s HMAC cut to 128 bits, as WireGuard's).
pub const MAC_LEN: usize = 16;
/// Hashed with the two public keys into a pair key: no other use of the same X25519
/// output can give the same key.
const PAIR_LABEL: &[u8] = b"justitia-peer v3 handshake MAC";

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

/// The key two members share without a handshake (see the module documentation).
#[derive(Clone, PartialEq, Eq)]
pub struct PairKey([u8; KEY_LEN]);

impl std::fmt::Debug for PairKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PairKey(..)")
    }
}

/// HMAC-BLAKE2s (snow's, as the Noise specification defines it) of `data` under `key`.
fn hmac(key: &[u8; KEY_LEN], data: &[u8]) -> Option<[u8; KEY_LEN]> {
    let mut hash = DefaultResolver.resolve_hash(&HashChoice::Blake2s)?;
    let mut out = [0; KEY_LEN];
    hash.hmac(key, data, &mut out);
    Some(out)
}

impl PairKey {
    /// The MAC of `data`.
    pub fn mac(&self, data: &[u8]) -> [u8; MAC_LEN] {
        let mut out = [0; MAC_LEN];
        // BLAKE2s is compiled in (a feature of this crate's snow); were it not, the zeros
        // would never verify against a real MAC.
        if let Some(full) = hmac(&self.0, data) {
            out.copy_from_slice(&full[..MAC_LEN]);
        }
        out
    }

    /// Whether `mac` is the MAC of `data` (compared in constant time).
    pub fn verify(&self, data: &[u8], mac: &[u8]) -> bool {
        mac.len() == MAC_LEN && bool::from(self.mac(data).ct_eq(mac))
    }
}

impl PrivateKey {
    /// The pair key of this host and the member whose public key is `remote`: the same
    /// at both ends. `None` when `remote` is of small order (every X25519 with it is zero,
    /// so anyone could compute the key).
    pub fn pair_key(&self, remote: &PublicKey) -> Option<PairKey> {
        let mut dh = DefaultResolver.resolve_dh(&DHChoice::Curve25519)?;
        dh.set(&self.0);
        let mut shared = [0; KEY_LEN];
        dh.dh(&remote.0, &mut shared).ok()?;
        if bool::from(shared.ct_eq(&[0; KEY_LEN])) {
            return None;
        }
        let own = self.public();
        let (low, high) = if own <= *remote {
            (own, *remote)
        } else {
            (*remote, own)
        };
        let mut data = Vec::with_capacity(PAIR_LABEL.len() + 2 * KEY_LEN);
        data.extend_from_slice(PAIR_LABEL);
        data.extend_from_slice(&low.0);
        data.extend_from_slice(&high.0);
        hmac(&shared, &data).map(PairKey)
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

    fn hex(s: &str) -> [u8; 32] {
        let v: Vec<u8> = (0..64)
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect();
        v.try_into().unwrap()
    }

    /// A private key of bytes `seed, seed + 1, ...`.
    fn key(seed: u8) -> PrivateKey {
        PrivateKey::from_bytes(std::array::from_fn(|i| seed.wrapping_add(i as u8))).unwrap()
    }

    /// RFC 7748 §6.1: Alice's private key and public key.
    #[test]
    fn the_public_key_is_rfc_7748s() {
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
    fn both_ends_derive_one_pair_key_and_no_third_key_does() {
        let (a, b, c) = (key(1), key(3), key(5));
        let ab = a.pair_key(&b.public()).unwrap();
        assert_eq!(b.pair_key(&a.public()).unwrap(), ab);
        assert_ne!(c.pair_key(&b.public()).unwrap(), ab, "C claiming to be A");
        assert_ne!(a.pair_key(&c.public()).unwrap(), ab);
        let mac = ab.mac(b"initiation");
        assert!(ab.verify(b"initiation", &mac));
        assert!(!ab.verify(b"initiatioN", &mac));
        let mut flipped = mac;
        flipped[15] ^= 1;
        assert!(!ab.verify(b"initiation", &flipped));
        assert!(!ab.verify(b"initiation", &mac[..15]));
        assert!(!format!("{ab:?}").contains(&STANDARD.encode(ab.0)));
    }

    /// A point of order 8 on Curve25519 (one of the low-order inputs X25519 implementations
    /// list): X25519 with it is zero for every private key.
    #[test]
    fn a_small_order_public_key_has_no_pair_key() {
        let small = hex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800");
        assert_eq!(key(9).pair_key(&PublicKey(small)), None);
        assert_eq!(key(9).pair_key(&PublicKey([0; 32])), None);
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
