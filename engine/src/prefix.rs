//! Block hashing for prefix caching, shared by the engines and the router.
//!
//! A prompt is cut into blocks of `block_size` tokens; only full blocks are hashed. The
//! hash of block `i` covers every token up to the end of block `i`: it is
//! `xxh3_64(hash(i-1) ‖ tokens of block i)` seeded with a salt, with `hash(-1)` = the
//! salt. So two prompts share the hash of block `i` exactly when they share their first
//! `(i+1) × block_size` tokens (up to 64-bit collisions: about 3·10⁻⁸ for a million
//! cached blocks). The salt is derived from the model identity (engines of different
//! models never match) and, optionally, a per-request `cache_salt` (tenants that use
//! different salts never share cache). Engines and the router call the same functions,
//! so their hashes agree bit for bit.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A `HashMap` hasher for keys that are block hashes already (uniform 64-bit values):
/// it passes them through instead of hashing them again (SipHash would cost more than
/// the lookup itself).
#[derive(Default, Clone, Copy)]
pub struct PassThrough(u64);

impl std::hash::Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are meant; anything else is folded in, still correct.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// Maps keyed by block hash.
pub type HashMapByBlock<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<PassThrough>>;
pub type HashSetOfBlocks = std::collections::HashSet<u64, std::hash::BuildHasherDefault<PassThrough>>;

/// The per-model, per-tenant seed of a block hash chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HashSalt(pub u64);

impl HashSalt {
    /// The salt for `model_identity` (see `ModelConfig::identity`) and an optional
    /// tenant salt.
    pub fn new(model_identity: &str, cache_salt: Option<&str>) -> HashSalt {
        let m = xxh3_64_with_seed(model_identity.as_bytes(), 0x6469_7361_6767);
        match cache_salt {
            None => HashSalt(m),
            // A separator keeps ("ab", None) and ("a", Some("b")) apart.
            Some(t) => HashSalt(xxh3_64_with_seed(t.as_bytes(), m ^ 0x7465_6e61_6e74)),
        }
    }
}

/// The hash of the block after one whose hash is `prev` (the salt for the first).
pub fn chain(salt: HashSalt, prev: u64, block: &[u32]) -> u64 {
    let mut buf = [0u8; 8 + 4 * 64];
    if block.len() <= 64 {
        buf[..8].copy_from_slice(&prev.to_le_bytes());
        for (i, t) in block.iter().enumerate() {
            buf[8 + 4 * i..12 + 4 * i].copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&buf[..8 + 4 * block.len()], salt.0);
    }
    let mut v = Vec::with_capacity(8 + 4 * block.len());
    v.extend_from_slice(&prev.to_le_bytes());
    for t in block {
        v.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&v, salt.0)
}

/// Extends `hashes` (the hashes of the first `hashes.len()` full blocks of `tokens`)
/// to cover every full block of `tokens`.
pub fn extend_hashes(salt: HashSalt, block_size: usize, tokens: &[u32], hashes: &mut Vec<u64>) {
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let prev = if i == 0 { salt.0 } else { hashes[i - 1] };
        hashes.push(chain(salt, prev, &tokens[i * block_size..(i + 1) * block_size]));
    }
}

/// The hashes of every full block of `tokens`.
pub fn block_hashes(salt: HashSalt, block_size: usize, tokens: &[u32]) -> Vec<u64> {
    let mut h = Vec::with_capacity(tokens.len() / block_size);
    extend_hashes(salt, block_size, tokens, &mut h);
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_cover_the_whole_prefix_and_only_full_blocks() {
        let s = HashSalt::new("m", None);
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[40] = 7; // block 2 (tokens 32..48) and everything after differ
        let (ha, hb) = (block_hashes(s, 16, &a), block_hashes(s, 16, &b));
        assert_eq!(ha.len(), 6);
        assert_eq!(ha[..2], hb[..2]);
        assert!(ha[2..].iter().zip(&hb[2..]).all(|(x, y)| x != y));
        // Same block contents after a different prefix: different hash.
        let c: Vec<u32> = (0..16).chain(0..16).collect();
        let hc = block_hashes(s, 16, &c);
        assert_ne!(hc[0], hc[1]);
        // Extending in pieces gives the same chain.
        let mut h = block_hashes(s, 16, &a[..40]);
        extend_hashes(s, 16, &a, &mut h);
        assert_eq!(h, ha);
        // Long blocks take the slow path and agree with themselves.
        assert_eq!(block_hashes(s, 100, &a), block_hashes(s, 100, &a));
    }

    #[test]
    fn salts_separate_models_and_tenants() {
        let t: Vec<u32> = (0..32).collect();
        let m = block_hashes(HashSalt::new("m", None), 16, &t);
        assert_ne!(m, block_hashes(HashSalt::new("n", None), 16, &t));
        assert_ne!(m, block_hashes(HashSalt::new("m", Some("tenant-a")), 16, &t));
        assert_ne!(
            block_hashes(HashSalt::new("m", Some("a")), 16, &t),
            block_hashes(HashSalt::new("m", Some("b")), 16, &t)
        );
        assert_eq!(m, block_hashes(HashSalt::new("m", None), 16, &t));
    }
}
