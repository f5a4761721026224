//! What a paced request is charged: its payload, or more when one message of its size
//! costs the RNIC more per byte than the flow's chunk does.
//!
//! A pacer counts bytes. A stream of full chunks costs the RNIC about its payload, but a
//! 64 B WRITE takes a whole packet's headers on the wire and a whole message's slot in the
//! processing units: paced by its payload, a tenant of small messages would take several
//! times its share of what bounds them. The `adaptive` law prices a message by the
//! resource it uses most ([`AdaptiveConfig::message_cost`](crate::adaptive::AdaptiveConfig::message_cost))
//! and charges it that cost in the flow's chunk's bytes
//! ([`AdaptiveConfig::charged_bytes`](crate::adaptive::AdaptiveConfig::charged_bytes),
//! which is [`MessageCharge::charged`] of
//! [`AdaptiveConfig::message_charge`](crate::adaptive::AdaptiveConfig::message_charge)).
//! A [`MessageCharge`] is that price in integers, fixed per flow and chunk, so that the
//! daemon can publish it in a tenant page's slot ([`MessageCharge::to_words`]) and a shaper
//! evaluate it at each post without the law, a float or a division by anything but the MTU.
//!
//! Invariants: a request is never charged less than its payload, and its charge never
//! panics, whatever the words read from a page hold; [`MessageCharge::NONE`]
//! (all words zero, what a daemon that does not charge writes) charges the payload.

/// The fixed point of [`MessageCharge`]'s costs: units of 2^-32 bytes.
pub const FIXED_ONE: u64 = 1 << 32;

/// The price of one request in a flow's pace: `max(payload, least_bytes, wire cost)`, where
/// the wire cost of a request of `b` bytes in `n` packets of 2^[`Self::mtu_shift`] bytes is
/// `b x byte_cost + n x packet_cost + request_cost`, in units of 2^-32 bytes
/// ([`FIXED_ONE`]), rounded to the nearest byte: its wire bytes (payload, each packet's
/// headers, the first packet's extra header) already scaled to the chunk's bytes. (Path
/// MTUs are powers of two, so a shift counts the packets; with the costs scaled ahead, a
/// post pays three multiplications and no division.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MessageCharge {
    /// The least a request is charged: one message at MaxTput, in the chunk's bytes.
    pub least_bytes: u64,
    /// What a payload byte costs on the wire, 2^-32 bytes; 0: the wire is not counted
    /// (nor are the next two).
    pub byte_cost: u64,
    /// What a packet's headers cost, 2^-32 bytes.
    pub packet_cost: u64,
    /// What a request's first packet's extra header costs, 2^-32 bytes.
    pub request_cost: u64,
    /// The path MTU that sets the packets, as its base-2 logarithm (12: 4096 B); only its
    /// low six bits are read.
    pub mtu_shift: u32,
}

impl MessageCharge {
    /// Charges the payload.
    pub const NONE: MessageCharge = MessageCharge {
        least_bytes: 0,
        byte_cost: 0,
        packet_cost: 0,
        request_cost: 0,
        mtu_shift: 0,
    };

    /// The charge of a request of `bytes` payload (see the type's documentation): at least
    /// `bytes`. The headers' cost is summed, and the charge kept, in 64 bits, which any
    /// real price stays far below (a million packets of 82 B is 2^56 units); an absurd
    /// price wraps there and may charge less than its terms say, never less than the
    /// payload, and never panics.
    #[inline(always)]
    pub fn charged(&self, bytes: u64) -> u64 {
        let least = bytes.max(self.least_bytes);
        if self.byte_cost == 0 {
            return least;
        }
        let shift = self.mtu_shift & 63;
        let packets = (bytes.wrapping_add((1 << shift) - 1) >> shift).max(1);
        let headers = packets
            .wrapping_mul(self.packet_cost)
            .wrapping_add(self.request_cost)
            .wrapping_add(FIXED_ONE / 2);
        // Below (2^64 - 1)^2 + 2^64 < 2^128: no overflow; the shift's high bits, which no
        // real price reaches, are dropped as the headers' wrap is.
        let fixed = u128::from(bytes) * u128::from(self.byte_cost) + u128::from(headers);
        least.max((fixed >> 32) as u64)
    }

    /// The words a tenant page's slot carries it in, in the order of the fields.
    pub fn to_words(&self) -> [u64; 5] {
        [
            self.least_bytes,
            self.byte_cost,
            self.packet_cost,
            self.request_cost,
            u64::from(self.mtu_shift),
        ]
    }

    /// The charge [`Self::to_words`] wrote; any words give one that [`Self::charged`]
    /// evaluates without panicking.
    #[inline(always)]
    pub fn from_words(words: [u64; 5]) -> MessageCharge {
        MessageCharge {
            least_bytes: words[0],
            byte_cost: words[1],
            packet_cost: words[2],
            request_cost: words[3],
            mtu_shift: words[4] as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x` bytes in the fixed point.
    fn fixed(x: f64) -> u64 {
        (x * FIXED_ONE as f64).round() as u64
    }

    /// RoCE-100's wire seen at a scale of 0.97 (97 Gb/s of MaxRate over 100 of wire, 82 B
    /// of headers a packet, a 16 B RETH): a 64 B WRITE is 64 + 82 + 16 = 162 wire bytes,
    /// charged 157.14 -> 157; a 9000 B one takes 3 packets of 4096, 9000 + 3 x 82 + 16 =
    /// 9262 wire bytes, charged 8984.14 -> 9000 (its payload, which is more); a
    /// zero-length one is one packet, 98 x 0.97 = 95.06 -> 95. With a least of 924 B the
    /// 64 B WRITE is charged 924, and a 5000 B one its wire bytes, 5000 + 2 x 82 + 16 =
    /// 5180 x 0.97 = 5024.6 -> 5025.
    #[test]
    fn a_request_is_charged_the_most_of_its_payload_its_least_and_its_wire_bytes() {
        let wire = MessageCharge {
            least_bytes: 0,
            byte_cost: fixed(0.97),
            packet_cost: fixed(82.0 * 0.97),
            request_cost: fixed(16.0 * 0.97),
            mtu_shift: 12,
        };
        assert_eq!(wire.charged(64), 157);
        assert_eq!(wire.charged(9000), 9000);
        assert_eq!(wire.charged(0), 95);
        let least = MessageCharge {
            least_bytes: 924,
            ..wire
        };
        assert_eq!(least.charged(64), 924);
        assert_eq!(least.charged(5000), 5025);
        assert_eq!(MessageCharge::NONE.charged(64), 64);
        assert_eq!(MessageCharge::NONE.charged(u64::MAX), u64::MAX);
    }

    #[test]
    fn the_words_carry_the_charge_and_any_words_are_safe_to_charge_with() {
        let c = MessageCharge {
            least_bytes: 924,
            byte_cost: 4_166_118_278,
            packet_cost: 341_621_698_765,
            request_cost: 66_657_892_454,
            mtu_shift: 12,
        };
        assert_eq!(MessageCharge::from_words(c.to_words()), c);
        assert_eq!(MessageCharge::from_words([0; 5]), MessageCharge::NONE);
        let hostile = MessageCharge::from_words([u64::MAX; 5]);
        assert_eq!(hostile.charged(u64::MAX), u64::MAX);
        assert_eq!(hostile.charged(0), u64::MAX);
        let wrapping = MessageCharge {
            least_bytes: 0,
            ..hostile
        };
        assert!(
            wrapping.charged(1 << 40) >= 1 << 40,
            "wraps, never below the payload"
        );
        // Packets of 1 B (a shift of 0), 5 B of headers each: 3 B cost 3 + 3 x 5.
        let one_byte_packets = MessageCharge::from_words([0, FIXED_ONE, 5 << 32, 0, 0]);
        assert_eq!(one_byte_packets.charged(3), 18);
        // Only the shift's low six bits count: 200 reads as 8, packets of 256 B.
        let wrapped_shift = MessageCharge::from_words([0, FIXED_ONE, 5 << 32, 0, 200]);
        assert_eq!(wrapped_shift.charged(300), 310, "two packets");
    }

    proptest::proptest! {
        /// Never less than the payload, whatever the words.
        #[test]
        fn a_charge_is_at_least_the_payload(
            words in proptest::array::uniform5(proptest::num::u64::ANY),
            bytes in proptest::num::u64::ANY,
        ) {
            let c = MessageCharge::from_words(words);
            proptest::prop_assert!(c.charged(bytes) >= bytes);
        }
    }
}
