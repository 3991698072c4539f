//! Maps keyed by 32-bit numbers this process draws itself: the tcp
//! provider's rkeys, lkeys and queue pair numbers, and the target's volume
//! ids (the block engine's fixed-file slots).
//!
//! Every command touches them on the data path (an initiator binds a
//! window, the peer's RDMA WRITE looks it up, the SEND with Invalidate and
//! the window's drop remove it; a disk operation finds its volume's fixed
//! file), and std's SipHash cost about 100 instructions a lookup, 9 % of an
//! initiator's instructions per 4 KiB read (callgrind, docs/perf-log/issue-20-looks.md "Issue
//! 20, seventh look"). SipHash defends a table against keys an attacker
//! chooses to insert; here this process draws every inserted key itself (at
//! random, or in sequence), and a peer's key is only ever looked up, which
//! costs one probe sequence whatever the key. A multiply by an odd 64-bit
//! constant (Fibonacci hashing) spreads a key over all 64 bits, so both the
//! bucket (low bits) and hashbrown's tag (top 7 bits) vary.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` from a `u32` key this process chose.
pub type KeyMap<V> = HashMap<u32, V, KeyHashing>;

/// The hasher builder of [`KeyMap`], for maps keyed by a newtype of such a
/// `u32` (one whose `Hash` writes only that `u32`, as `#[derive(Hash)]` does).
pub type KeyHashing = BuildHasherDefault<KeyHasher>;

/// The hasher of [`KeyMap`]: Fibonacci hashing of one `u32`.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

/// 2^64 / φ, odd: consecutive keys land far apart.
const FIBONACCI: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for KeyHasher {
    fn write_u32(&mut self, key: u32) {
        self.0 = u64::from(key).wrapping_mul(FIBONACCI);
    }

    /// Not used by `u32` keys; kept correct for any other input.
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(FIBONACCI);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn consecutive_keys_differ_in_bucket_bits_and_in_tag_bits() {
        let build = BuildHasherDefault::<KeyHasher>::default();
        let hashes: Vec<u64> = (1u32..=64).map(|k| build.hash_one(k)).collect();
        let buckets: std::collections::HashSet<u64> = hashes.iter().map(|h| h & 63).collect();
        let tags: std::collections::HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert!(buckets.len() > 32, "low bits spread: {} of 64", buckets.len());
        assert!(tags.len() > 32, "top 7 bits spread: {} of 64", tags.len());
    }

    #[test]
    fn a_map_finds_what_it_holds_and_nothing_else() {
        let mut m: KeyMap<u32> = KeyMap::default();
        for k in (0..10_000u32).map(|i| i.wrapping_mul(2_654_435_761) | 1 << 31) {
            m.insert(k, k ^ 7);
        }
        assert_eq!(m.len(), 10_000);
        for k in (0..10_000u32).map(|i| i.wrapping_mul(2_654_435_761) | 1 << 31) {
            assert_eq!(m.get(&k), Some(&(k ^ 7)));
        }
        assert_eq!(m.get(&0), None);
        assert_eq!(m.get(&5), None);
    }
}
