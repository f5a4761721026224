//! The data pattern: a function of a per-transfer seed and the byte's position in the
//! logical message, so every chunk of a split transfer carries bytes that only fit at its
//! own offset.

/// Bytes per generated word (a power of two: offsets are masked with `WORD - 1`).
const WORD: usize = 8;

/// The 64-bit word that covers logical bytes `8 * index .. 8 * index + 8` (SplitMix64 of
/// the seed and the word index: cheap, and neighbouring words share no structure).
fn word(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The pattern byte at logical offset `offset` of the message seeded with `seed`.
pub fn byte_at(seed: u64, offset: usize) -> u8 {
    word(seed, (offset / WORD) as u64).to_le_bytes()[offset % WORD]
}

/// Writes the pattern bytes for logical offsets `start .. start + out.len()` into `out`.
pub fn fill(seed: u64, start: usize, out: &mut [u8]) {
    let mut pos = 0;
    // Up to the next word boundary one byte at a time, then whole words.
    while pos < out.len() && (start + pos) & (WORD - 1) != 0 {
        out[pos] = byte_at(seed, start + pos);
        pos += 1;
    }
    let mut index = ((start + pos) / WORD) as u64;
    let mut words = out[pos..].chunks_exact_mut(WORD);
    for chunk in &mut words {
        chunk.copy_from_slice(&word(seed, index).to_le_bytes());
        index += 1;
    }
    let tail = words.into_remainder();
    let bytes = word(seed, index).to_le_bytes();
    tail.copy_from_slice(&bytes[..tail.len()]);
}

/// Writes the bitwise complement of the pattern: what a destination holds before a
/// transfer, so that every byte the transfer fails to write differs from the pattern.
pub fn fill_complement(seed: u64, start: usize, out: &mut [u8]) {
    fill(seed, start, out);
    for b in out.iter_mut() {
        *b = !*b;
    }
}

/// Where and how a buffer differs from the pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Logical offset of the first differing byte.
    pub first_offset: usize,
    /// The pattern byte expected there.
    pub expected: u8,
    /// The byte found there.
    pub found: u8,
    /// How many bytes differ in all.
    pub bytes: usize,
}

/// Compares `data` against the pattern for logical offsets `start .. start + data.len()`.
pub fn check(seed: u64, start: usize, data: &[u8]) -> Option<Mismatch> {
    // Compare block by block against a generated copy: memcmp speed for the common case.
    const BLOCK: usize = 64 * 1024;
    let mut expected = vec![0u8; BLOCK.min(data.len())];
    let mut result: Option<Mismatch> = None;
    for (i, got) in data.chunks(BLOCK).enumerate() {
        let base = start + i * BLOCK;
        let want = &mut expected[..got.len()];
        fill(seed, base, want);
        if want == got {
            continue;
        }
        for (k, (&w, &g)) in want.iter().zip(got).enumerate() {
            if w != g {
                match result.as_mut() {
                    Some(m) => m.bytes += 1,
                    None => {
                        result = Some(Mismatch {
                            first_offset: base + k,
                            expected: w,
                            found: g,
                            bytes: 1,
                        })
                    }
                }
            }
        }
    }
    result
}

/// Compares `data` against the complement of the pattern for logical offsets
/// `start .. start + data.len()`: what a destination must still hold where nothing was to
/// land (the slack of a receive buffer after the message, say). For short ranges.
pub fn check_complement(seed: u64, start: usize, data: &[u8]) -> Option<Mismatch> {
    let mut want = vec![0u8; data.len()];
    fill_complement(seed, start, &mut want);
    let mut result: Option<Mismatch> = None;
    for (k, (&w, &g)) in want.iter().zip(data).enumerate() {
        if w != g {
            match result.as_mut() {
                Some(m) => m.bytes += 1,
                None => {
                    result = Some(Mismatch {
                        first_offset: start + k,
                        expected: w,
                        found: g,
                        bytes: 1,
                    })
                }
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_matches_byte_at_for_any_alignment() {
        for start in 0..17 {
            for len in [0, 1, 7, 8, 9, 63, 200] {
                let mut buf = vec![0u8; len];
                fill(42, start, &mut buf);
                let want: Vec<u8> = (start..start + len).map(|o| byte_at(42, o)).collect();
                assert_eq!(buf, want, "start {start} len {len}");
            }
        }
    }

    #[test]
    fn pieces_filled_separately_equal_the_whole() {
        let mut whole = vec![0u8; 1000];
        fill(7, 0, &mut whole);
        let mut pieces = vec![0u8; 1000];
        let (a, rest) = pieces.split_at_mut(333);
        let (b, c) = rest.split_at_mut(5);
        fill(7, 0, a);
        fill(7, 333, b);
        fill(7, 338, c);
        assert_eq!(whole, pieces);
    }

    #[test]
    fn the_pattern_depends_on_position_and_seed() {
        let mut a = vec![0u8; 4096];
        let mut shifted = vec![0u8; 4096];
        let mut other_seed = vec![0u8; 4096];
        fill(1, 0, &mut a);
        fill(1, 8, &mut shifted);
        fill(2, 0, &mut other_seed);
        let same = |x: &[u8], y: &[u8]| x.iter().zip(y).filter(|(p, q)| p == q).count();
        // Random bytes agree about once in 256; a chunk at the wrong offset or from the
        // wrong transfer is far from matching.
        assert!(same(&a, &shifted) < 64, "{}", same(&a, &shifted));
        assert!(same(&a, &other_seed) < 64, "{}", same(&a, &other_seed));
    }

    #[test]
    fn check_accepts_the_pattern_and_locates_differences() {
        let mut buf = vec![0u8; 200_000];
        fill(9, 100, &mut buf);
        assert_eq!(check(9, 100, &buf), None);
        buf[70_000] ^= 0x10;
        buf[150_000] ^= 0x01;
        let m = check(9, 100, &buf);
        assert_eq!(
            m,
            Some(Mismatch {
                first_offset: 70_100,
                expected: byte_at(9, 70_100),
                found: byte_at(9, 70_100) ^ 0x10,
                bytes: 2,
            })
        );
    }

    #[test]
    fn check_complement_accepts_the_complement_and_locates_differences() {
        let mut buf = vec![0u8; 300];
        fill_complement(4, 17, &mut buf);
        assert_eq!(check_complement(4, 17, &buf), None);
        buf[100] = byte_at(4, 117);
        assert_eq!(
            check_complement(4, 17, &buf),
            Some(Mismatch {
                first_offset: 117,
                expected: !byte_at(4, 117),
                found: byte_at(4, 117),
                bytes: 1,
            })
        );
    }

    #[test]
    fn the_complement_differs_from_the_pattern_in_every_byte() {
        let mut buf = vec![0u8; 4099];
        fill_complement(3, 5, &mut buf);
        assert_eq!(check(3, 5, &buf).map(|m| m.bytes), Some(4099));
    }
}
