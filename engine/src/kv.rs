//! Accounting of the paged KV cache: which blocks are free, which are held (and by how
//! many sequences), and which hold a cached prefix block.
//!
//! The storage itself lives in the backend (`Backend::Kv`); this module only hands out
//! block ids. Rules it keeps:
//! - Exact accounting: every block is either held (reference count ≥ 1), free, or
//!   cached-and-free (reference count 0, its contents kept under its block hash until
//!   the block is needed). `n_free()` counts both kinds of free block, so
//!   `n_free() + held == n_blocks` at all times; releasing a block more often than it
//!   was taken panics.
//! - A block is registered under a hash (see [`crate::prefix`]) only once every one of
//!   its token slots has been computed; registered blocks are never written again
//!   (sequences only write at positions past what they share).
//! - Eviction is LRU among cached-and-free blocks; free blocks that cache nothing go
//!   first. A sequence's blocks are released last-first, so a chain's tail is evicted
//!   before its head and the cached part of a prefix stays a prefix.
//! - A sequence's block table maps position `p` to slot
//!   `table[p / block_size] * block_size + p % block_size`.

use crate::prefix::HashMapByBlock;

const NIL: u32 = u32::MAX;

/// A doubly linked list over the ids `0..n`, for O(1) LRU order.
#[derive(Debug)]
pub struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    pub fn new(n: usize) -> Self {
        LruList { prev: vec![NIL; n], next: vec![NIL; n], linked: vec![false; n], head: NIL, tail: NIL, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, i: u32) -> bool {
        self.linked[i as usize]
    }

    /// Appends `i` as the most recently used.
    pub fn push_back(&mut self, i: u32) {
        debug_assert!(!self.linked[i as usize]);
        self.linked[i as usize] = true;
        self.prev[i as usize] = self.tail;
        self.next[i as usize] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
        self.len += 1;
    }

    pub fn remove(&mut self, i: u32) {
        debug_assert!(self.linked[i as usize]);
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i as usize] = false;
        self.len -= 1;
    }

    /// Takes the least recently used.
    pub fn pop_front(&mut self) -> Option<u32> {
        let h = self.head;
        if h == NIL {
            return None;
        }
        self.remove(h);
        Some(h)
    }

    /// Marks `i` (linked) as the most recently used.
    pub fn touch(&mut self, i: u32) {
        self.remove(i);
        self.push_back(i);
    }
}

/// A reference-counting allocator of KV blocks with a prefix cache.
#[derive(Debug)]
pub struct BlockAllocator {
    n_blocks: usize,
    refs: Vec<u32>,
    /// The hash a block is registered under.
    hash: Vec<Option<u64>>,
    /// Free blocks that cache nothing.
    free: Vec<u32>,
    /// Free blocks that cache a prefix block, least recently used first.
    lru: LruList,
    cached: HashMapByBlock<u32>,
    caching: bool,
    /// Hashes registered and dropped since the last [`BlockAllocator::take_changes`]:
    /// `(hash, block)`; a dropped block's contents are still intact until the caller
    /// writes into it.
    stored: Vec<u64>,
    evicted: Vec<(u64, u32)>,
}

impl BlockAllocator {
    /// `caching`: keep computed blocks under their hashes for reuse (prefix caching).
    pub fn new(n_blocks: usize, caching: bool) -> Self {
        Self {
            n_blocks,
            refs: vec![0; n_blocks],
            hash: vec![None; n_blocks],
            // Hand out low ids first (reversed stack).
            free: (0..n_blocks as u32).rev().collect(),
            lru: LruList::new(n_blocks),
            cached: HashMapByBlock::default(),
            caching,
            stored: Vec::new(),
            evicted: Vec::new(),
        }
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks that can be allocated now (free, or cached and evictable).
    pub fn n_free(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks held by at least one sequence.
    pub fn n_used(&self) -> usize {
        self.n_blocks - self.n_free()
    }

    /// Blocks registered in the prefix cache (held or not).
    pub fn n_cached(&self) -> usize {
        self.cached.len()
    }

    /// Appends `n` blocks to `table`, or changes nothing and returns false when fewer
    /// than `n` can be had. Cached blocks are evicted (least recently used first) only
    /// when no plain free block is left.
    pub fn allocate(&mut self, n: usize, table: &mut Vec<u32>) -> bool {
        if n > self.n_free() {
            return false;
        }
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let b = self.lru.pop_front().expect("counted above");
                    let h = self.hash[b as usize].take().expect("cached blocks have a hash");
                    self.cached.remove(&h);
                    self.evicted.push((h, b));
                    b
                }
            };
            debug_assert_eq!(self.refs[b as usize], 0);
            self.refs[b as usize] = 1;
            table.push(b);
        }
        true
    }

    /// Drops one reference to each block of `table` (last block first) and empties it.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        while let Some(b) = table.pop() {
            let r = &mut self.refs[b as usize];
            assert!(*r > 0, "block {b} freed twice");
            *r -= 1;
            if *r == 0 {
                if self.hash[b as usize].is_some() {
                    self.lru.push_back(b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// The block cached under `hash`, if any.
    pub fn block_of(&self, hash: u64) -> Option<u32> {
        self.cached.get(&hash).copied()
    }

    /// Takes a reference to cached block `b` and appends it to `table`.
    pub fn acquire(&mut self, b: u32, table: &mut Vec<u32>) {
        if self.refs[b as usize] == 0 {
            self.lru.remove(b);
        }
        self.refs[b as usize] += 1;
        table.push(b);
    }

    /// Registers held block `b`, fully computed, under `hash`. A block registered
    /// already, or a hash cached in another block, leaves things as they are.
    pub fn register(&mut self, b: u32, hash: u64) {
        if !self.caching || self.hash[b as usize].is_some() || self.cached.contains_key(&hash) {
            return;
        }
        debug_assert!(self.refs[b as usize] > 0);
        self.hash[b as usize] = Some(hash);
        self.cached.insert(hash, b);
        self.stored.push(hash);
    }

    /// Hashes registered, and `(hash, block)` evicted, since the last call.
    pub fn take_changes(&mut self) -> (Vec<u64>, Vec<(u64, u32)>) {
        (std::mem::take(&mut self.stored), std::mem::take(&mut self.evicted))
    }

    /// Every cached hash, for a snapshot.
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cached.keys().copied()
    }
}

/// Blocks needed to hold `n_tokens` tokens.
pub fn blocks_for(n_tokens: usize, block_size: usize) -> usize {
    n_tokens.div_ceil(block_size)
}

/// The second tier of the prefix cache: whole blocks (every layer, in the backend's
/// transfer layout) in host memory, keyed by block hash, LRU. Blocks evicted from the
/// device tier are copied here instead of dropped, and copied back on a hit.
pub struct HostTier {
    /// Bytes of one block, all layers.
    block_bytes: usize,
    data: Vec<u8>,
    slot_hash: Vec<Option<u64>>,
    map: HashMapByBlock<u32>,
    lru: LruList,
    free: Vec<u32>,
}

impl HostTier {
    pub fn new(n_slots: usize, block_bytes: usize) -> Self {
        HostTier {
            block_bytes,
            data: vec![0u8; n_slots * block_bytes],
            slot_hash: vec![None; n_slots],
            map: HashMapByBlock::default(),
            lru: LruList::new(n_slots),
            free: (0..n_slots as u32).rev().collect(),
        }
    }

    pub fn n_slots(&self) -> usize {
        self.slot_hash.len()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// The block stored under `hash` (marked most recently used).
    pub fn get(&mut self, hash: u64) -> Option<&[u8]> {
        let s = *self.map.get(&hash)?;
        self.lru.touch(s);
        let o = s as usize * self.block_bytes;
        Some(&self.data[o..o + self.block_bytes])
    }

    /// Stores `block` under `hash`, evicting the least recently used entry when full;
    /// returns the evicted hash. A hash stored already is only marked used.
    pub fn put(&mut self, hash: u64, block: &[u8]) -> Option<u64> {
        assert_eq!(block.len(), self.block_bytes);
        if let Some(&s) = self.map.get(&hash) {
            self.lru.touch(s);
            return None;
        }
        let mut evicted = None;
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = self.lru.pop_front()?;
                let h = self.slot_hash[s as usize].take().expect("used slots have a hash");
                self.map.remove(&h);
                evicted = Some(h);
                s
            }
        };
        let o = s as usize * self.block_bytes;
        self.data[o..o + self.block_bytes].copy_from_slice(block);
        self.slot_hash[s as usize] = Some(hash);
        self.map.insert(hash, s);
        self.lru.push_back(s);
        evicted
    }

    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_all_or_nothing_and_exact() {
        let mut a = BlockAllocator::new(4, false);
        let mut t1 = Vec::new();
        assert!(a.allocate(3, &mut t1));
        assert_eq!(t1, vec![0, 1, 2]);
        let mut t2 = Vec::new();
        assert!(!a.allocate(2, &mut t2));
        assert!(t2.is_empty());
        assert_eq!(a.n_free(), 1);
        a.release(&mut t1);
        assert_eq!(a.n_free(), 4);
        assert!(t1.is_empty());
        assert_eq!(blocks_for(0, 16), 0);
        assert_eq!(blocks_for(17, 16), 2);
    }

    #[test]
    fn cached_blocks_are_shared_counted_free_and_evicted_lru_tail_first() {
        let mut a = BlockAllocator::new(4, true);
        let mut t1 = Vec::new();
        assert!(a.allocate(3, &mut t1));
        for (i, &b) in t1.iter().enumerate() {
            a.register(b, 100 + i as u64);
        }
        assert_eq!(a.take_changes().0, vec![100, 101, 102]);
        // A second sequence shares the first two blocks.
        let mut t2 = Vec::new();
        a.acquire(a.block_of(100).unwrap(), &mut t2);
        a.acquire(a.block_of(101).unwrap(), &mut t2);
        a.release(&mut t1);
        // Block 2 is cached and free; blocks 0 and 1 are still held by t2.
        assert_eq!((a.n_free(), a.n_used(), a.n_cached()), (2, 2, 3));
        a.release(&mut t2);
        assert_eq!((a.n_free(), a.n_used()), (4, 0));
        // Plain free blocks go first, then the LRU order: 102 (released first), then
        // 101 before 100 (a chain's tail before its head).
        let mut t3 = Vec::new();
        assert!(a.allocate(2, &mut t3));
        assert_eq!(a.take_changes().1, vec![(102, 2)]);
        assert!(a.allocate(1, &mut t3));
        assert_eq!(a.take_changes().1, vec![(101, 1)]);
        assert_eq!(a.block_of(100), Some(0));
        assert_eq!(a.block_of(101), None);
        // A duplicate registration keeps the first block.
        a.register(t3[0], 100);
        assert_eq!(a.block_of(100), Some(0));
        a.release(&mut t3);
        assert_eq!(a.n_free(), 4);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_release_panics() {
        let mut a = BlockAllocator::new(2, true);
        let mut t = Vec::new();
        assert!(a.allocate(1, &mut t));
        let mut copy = t.clone();
        a.release(&mut t);
        a.release(&mut copy);
    }

    #[test]
    fn host_tier_is_lru_and_keeps_bytes() {
        let mut h = HostTier::new(2, 3);
        assert_eq!(h.put(1, &[1, 1, 1]), None);
        assert_eq!(h.put(2, &[2, 2, 2]), None);
        assert_eq!(h.get(1), Some(&[1u8, 1, 1][..]));
        // 2 is now the least recently used.
        assert_eq!(h.put(3, &[3, 3, 3]), Some(2));
        assert!(!h.contains(2));
        assert_eq!(h.get(3), Some(&[3u8, 3, 3][..]));
        assert_eq!(h.len(), 2);
    }
}
