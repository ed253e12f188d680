//! Accounting of the paged KV cache: which blocks are free, which sequence holds which.
//!
//! The storage itself lives in the backend (`Backend::Kv`); this module only hands out
//! block ids. Rules it keeps:
//! - Exact accounting: `n_free() + held == n_blocks` at all times; freeing a block that
//!   is not held is a bug and panics in debug builds (it is checked in tests).
//! - A sequence's block table maps position `p` to slot
//!   `table[p / block_size] * block_size + p % block_size`.

/// A free-list allocator of KV blocks.
#[derive(Debug)]
pub struct BlockAllocator {
    n_blocks: usize,
    free: Vec<u32>,
    held: Vec<bool>,
}

impl BlockAllocator {
    pub fn new(n_blocks: usize) -> Self {
        // Hand out low ids first (reversed stack).
        Self { n_blocks, free: (0..n_blocks as u32).rev().collect(), held: vec![false; n_blocks] }
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn n_free(&self) -> usize {
        self.free.len()
    }

    pub fn n_used(&self) -> usize {
        self.n_blocks - self.free.len()
    }

    /// Appends `n` blocks to `table`, or changes nothing and returns false when fewer
    /// than `n` are free.
    pub fn allocate(&mut self, n: usize, table: &mut Vec<u32>) -> bool {
        if n > self.free.len() {
            return false;
        }
        for _ in 0..n {
            let b = self.free.pop().expect("checked above");
            debug_assert!(!self.held[b as usize]);
            self.held[b as usize] = true;
            table.push(b);
        }
        true
    }

    /// Returns every block of `table` to the free list and empties it.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            assert!(self.held[b as usize], "block {b} freed twice");
            self.held[b as usize] = false;
            self.free.push(b);
        }
    }
}

/// Blocks needed to hold `n_tokens` tokens.
pub fn blocks_for(n_tokens: usize, block_size: usize) -> usize {
    n_tokens.div_ceil(block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_all_or_nothing_and_exact() {
        let mut a = BlockAllocator::new(4);
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
}
