//! The router's index of the workers' prefix caches: which worker holds which block
//! hash (see `engine::prefix`), on which tier, kept from the workers' KV events.
//!
//! Rules it keeps:
//! - A worker's entries change only through its own event stream: a snapshot replaces
//!   them all; after it, batches must come numbered one by one. A duplicate (a number
//!   seen already) is ignored; a gap is an error, and the caller subscribes again (the
//!   new stream starts with a snapshot), keeping the old entries meanwhile.
//! - Events for a worker the index does not know, or one not yet synced, change
//!   nothing. Stored/removed are idempotent (removing an unknown hash is a no-op).
//! - Removing a worker removes every entry it had.
//! - Approximate mode (no events): [`KvIndex::predict`] records the blocks of a request
//!   routed to a worker, as if it had cached them, for a limited time.
//!
//! Up to [`MAX_WORKERS`] workers are indexed (a bit each per hash); more are routed
//! without overlap credit. The overlap of a worker with a request is the number of the
//! request's leading blocks it holds, which one pass over the request's hashes gives
//! for every worker at once.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use engine::handle::KvEventBatch;
use engine::prefix::{HashMapByBlock, HashSetOfBlocks};
use engine::scheduler::{CacheTier, KvEvent};

pub const MAX_WORKERS: usize = 64;

#[derive(Clone, Copy, Default, Debug)]
struct Entry {
    device: u64,
    host: u64,
}

#[derive(Default)]
struct WorkerBlocks {
    key: String,
    device: HashSetOfBlocks,
    host: HashSetOfBlocks,
    /// The number of the last batch applied; `None` until a snapshot arrives.
    last_seq: Option<u64>,
    /// Approximate mode: predicted blocks, with when each was last predicted.
    predicted: HashMapByBlock<Instant>,
    predicted_order: VecDeque<(Instant, u64)>,
}

/// Why a batch was not applied.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("no worker with slot {0} is indexed")]
    UnknownWorker(usize),
    #[error("events before the first snapshot")]
    NotSynced,
    #[error("events lost: expected batch {expected}, got {got}")]
    Gap { expected: u64, got: u64 },
}

/// Each indexed worker's overlap with one request, in blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlaps {
    /// Leading blocks on the worker's device tier.
    pub device: Vec<u32>,
    /// Leading blocks on either tier.
    pub any: Vec<u32>,
}

impl Overlaps {
    pub fn any(&self, slot: Option<usize>) -> usize {
        slot.and_then(|s| self.any.get(s)).map_or(0, |&x| x as usize)
    }
}

#[derive(Default)]
pub struct KvIndex {
    map: HashMapByBlock<Entry>,
    workers: Vec<Option<WorkerBlocks>>,
    /// Batches ignored as duplicates, and batches refused (unknown worker, gap).
    pub duplicates: u64,
    pub refused: u64,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Distinct hashes indexed.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The slot of worker `key`, given one if new; `None` when every slot is taken.
    pub fn add_worker(&mut self, key: &str) -> Option<usize> {
        if let Some(s) = self.slot_of(key) {
            return Some(s);
        }
        let s = match self.workers.iter().position(Option::is_none) {
            Some(s) => s,
            None if self.workers.len() < MAX_WORKERS => {
                self.workers.push(None);
                self.workers.len() - 1
            }
            None => return None,
        };
        self.workers[s] = Some(WorkerBlocks { key: key.to_string(), ..Default::default() });
        Some(s)
    }

    pub fn slot_of(&self, key: &str) -> Option<usize> {
        self.workers.iter().position(|w| w.as_ref().is_some_and(|w| w.key == key))
    }

    /// Forgets a worker and every block it had.
    pub fn remove_worker(&mut self, slot: usize) {
        let Some(w) = self.workers.get_mut(slot).and_then(Option::take) else { return };
        for h in w.device.iter().chain(&w.host).chain(w.predicted.keys()) {
            self.clear_bit(*h, slot, true);
            self.clear_bit(*h, slot, false);
        }
    }

    /// Blocks indexed for a worker (device, host).
    pub fn worker_blocks(&self, slot: usize) -> (usize, usize) {
        match self.workers.get(slot).and_then(Option::as_ref) {
            Some(w) => (w.device.len() + w.predicted.len(), w.host.len()),
            None => (0, 0),
        }
    }

    fn set_bit(&mut self, h: u64, slot: usize, device: bool) {
        let e = self.map.entry(h).or_default();
        if device {
            e.device |= 1 << slot;
        } else {
            e.host |= 1 << slot;
        }
    }

    fn clear_bit(&mut self, h: u64, slot: usize, device: bool) {
        if let Some(e) = self.map.get_mut(&h) {
            if device {
                e.device &= !(1 << slot);
            } else {
                e.host &= !(1 << slot);
            }
            if e.device == 0 && e.host == 0 {
                self.map.remove(&h);
            }
        }
    }

    /// Applies one batch of worker `slot`'s events (see the module rules).
    pub fn apply(&mut self, slot: usize, batch: &KvEventBatch) -> Result<(), IndexError> {
        let Some(w) = self.workers.get_mut(slot).and_then(Option::as_mut) else {
            self.refused += 1;
            return Err(IndexError::UnknownWorker(slot));
        };
        if batch.snapshot {
            let old: Vec<(u64, bool)> =
                w.device.drain().map(|h| (h, true)).chain(w.host.drain().map(|h| (h, false))).collect();
            w.last_seq = Some(batch.seq);
            for (h, dev) in old {
                self.clear_bit(h, slot, dev);
            }
            // Predictions (if any) keep their own bits; the snapshot is the truth for
            // events.
        } else {
            match w.last_seq {
                None => {
                    self.refused += 1;
                    return Err(IndexError::NotSynced);
                }
                Some(last) if batch.seq <= last => {
                    self.duplicates += 1;
                    return Ok(());
                }
                Some(last) if batch.seq != last + 1 => {
                    self.refused += 1;
                    return Err(IndexError::Gap { expected: last + 1, got: batch.seq });
                }
                Some(_) => w.last_seq = Some(batch.seq),
            }
        }
        for ev in &batch.events {
            let (stored, tier, hashes) = match ev {
                KvEvent::Stored { tier, hashes } => (true, *tier, hashes),
                KvEvent::Removed { tier, hashes } => (false, *tier, hashes),
            };
            let device = tier == CacheTier::Device;
            for &h in hashes {
                let w = self.workers[slot].as_mut().expect("checked above");
                let set = if device { &mut w.device } else { &mut w.host };
                if stored {
                    if set.insert(h) {
                        self.set_bit(h, slot, device);
                    }
                } else if set.remove(&h) {
                    // A predicted copy keeps the bit until it expires.
                    if !(device && w.predicted.contains_key(&h)) {
                        self.clear_bit(h, slot, device);
                    }
                }
            }
        }
        Ok(())
    }

    /// Approximate mode: records that worker `slot` was sent a request with these
    /// block hashes (predicting it caches them) until `now + ttl`.
    pub fn predict(&mut self, slot: usize, hashes: &[u64], now: Instant) {
        if self.workers.get(slot).and_then(Option::as_ref).is_none() {
            return;
        }
        for &h in hashes {
            let w = self.workers[slot].as_mut().expect("checked above");
            w.predicted.insert(h, now);
            w.predicted_order.push_back((now, h));
            self.set_bit(h, slot, true);
        }
    }

    /// Drops predictions made before `now - ttl`.
    pub fn expire(&mut self, now: Instant, ttl: Duration) {
        for slot in 0..self.workers.len() {
            while let Some(w) = self.workers[slot].as_mut() {
                let Some(&(t, h)) = w.predicted_order.front() else { break };
                if now.duration_since(t) < ttl {
                    break;
                }
                w.predicted_order.pop_front();
                if w.predicted.get(&h) == Some(&t) {
                    w.predicted.remove(&h);
                    if !w.device.contains(&h) {
                        self.clear_bit(h, slot, true);
                    }
                }
            }
        }
    }

    /// Every indexed worker's overlap with a request whose block hashes are `hashes`.
    pub fn overlaps(&self, hashes: &[u64]) -> Overlaps {
        let n = self.workers.len();
        let mut o = Overlaps { device: vec![0; n], any: vec![0; n] };
        let known: u64 = self.workers.iter().enumerate().filter(|(_, w)| w.is_some()).fold(0, |m, (i, _)| m | 1 << i);
        let (mut dev, mut any) = (known, known);
        let mut i = 0;
        while i < hashes.len() && any != 0 {
            let e = self.map.get(&hashes[i]).copied().unwrap_or_default();
            let (nd, na) = (dev & e.device, any & (e.device | e.host));
            for (mask, out) in [(dev & !nd, &mut o.device), (any & !na, &mut o.any)] {
                let mut m = mask;
                while m != 0 {
                    out[m.trailing_zeros() as usize] = i as u32;
                    m &= m - 1;
                }
            }
            (dev, any) = (nd, na);
            i += 1;
        }
        for (mask, out) in [(dev, &mut o.device), (any, &mut o.any)] {
            let mut m = mask;
            while m != 0 {
                out[m.trailing_zeros() as usize] = i as u32;
                m &= m - 1;
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seq: u64, snapshot: bool, events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch { seq, snapshot, events }
    }
    fn stored(tier: CacheTier, h: &[u64]) -> KvEvent {
        KvEvent::Stored { tier, hashes: h.to_vec() }
    }
    fn removed(tier: CacheTier, h: &[u64]) -> KvEvent {
        KvEvent::Removed { tier, hashes: h.to_vec() }
    }
    use CacheTier::{Device, Host};

    #[test]
    fn overlap_is_the_leading_run_per_worker_and_tier() {
        let mut ix = KvIndex::new();
        let (a, b) = (ix.add_worker("a").unwrap(), ix.add_worker("b").unwrap());
        ix.apply(a, &batch(0, true, vec![stored(Device, &[1, 2, 3])])).unwrap();
        ix.apply(b, &batch(5, true, vec![stored(Device, &[1]), stored(Host, &[2, 3, 4])])).unwrap();
        let o = ix.overlaps(&[1, 2, 3, 4, 5]);
        assert_eq!((o.device[a], o.any[a]), (3, 3));
        assert_eq!((o.device[b], o.any[b]), (1, 4));
        // A hole ends the run even if later blocks are there.
        assert_eq!(ix.overlaps(&[1, 9, 3]).any, vec![1, 1]);
        assert_eq!(ix.overlaps(&[]).any, vec![0, 0]);
    }

    #[test]
    fn follows_events_in_order_and_refuses_gaps_and_strangers() {
        let mut ix = KvIndex::new();
        let a = ix.add_worker("a").unwrap();
        // Before a snapshot nothing applies.
        assert_eq!(ix.apply(a, &batch(1, false, vec![stored(Device, &[1])])), Err(IndexError::NotSynced));
        ix.apply(a, &batch(3, true, vec![stored(Device, &[1, 2])])).unwrap();
        ix.apply(a, &batch(4, false, vec![removed(Device, &[2]), stored(Device, &[7])])).unwrap();
        // A duplicate changes nothing, even if it says otherwise.
        ix.apply(a, &batch(4, false, vec![stored(Device, &[2])])).unwrap();
        assert_eq!(ix.duplicates, 1);
        assert_eq!(ix.overlaps(&[1, 2]).any[a], 1);
        // A gap is refused and leaves the index as it was.
        assert_eq!(
            ix.apply(a, &batch(6, false, vec![removed(Device, &[1])])),
            Err(IndexError::Gap { expected: 5, got: 6 })
        );
        assert_eq!(ix.overlaps(&[1]).any[a], 1);
        // Events of an unknown slot are refused.
        assert_eq!(ix.apply(9, &batch(0, true, vec![stored(Device, &[1])])), Err(IndexError::UnknownWorker(9)));
        // Removing an unknown hash is a no-op; a new snapshot replaces everything.
        ix.apply(a, &batch(5, false, vec![removed(Host, &[42])])).unwrap();
        ix.apply(a, &batch(10, true, vec![stored(Host, &[8])])).unwrap();
        assert_eq!(ix.overlaps(&[1]).any[a], 0);
        assert_eq!(ix.overlaps(&[8]).any[a], 1);
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn removing_a_worker_removes_its_entries_only() {
        let mut ix = KvIndex::new();
        let (a, b) = (ix.add_worker("a").unwrap(), ix.add_worker("b").unwrap());
        ix.apply(a, &batch(0, true, vec![stored(Device, &[1, 2])])).unwrap();
        ix.apply(b, &batch(0, true, vec![stored(Device, &[1])])).unwrap();
        ix.remove_worker(a);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.overlaps(&[1, 2]).any[b], 1);
        assert_eq!(ix.worker_blocks(a), (0, 0));
        // Its slot is reused by the next worker, which starts empty.
        assert_eq!(ix.add_worker("c"), Some(a));
        assert_eq!(ix.overlaps(&[1]).any[a], 0);
        for i in 0..MAX_WORKERS {
            ix.add_worker(&format!("w{i}"));
        }
        assert_eq!(ix.add_worker("one too many"), None);
    }

    #[test]
    fn predictions_expire_but_do_not_hide_events() {
        let mut ix = KvIndex::new();
        let a = ix.add_worker("a").unwrap();
        let t0 = Instant::now();
        ix.predict(a, &[1, 2], t0);
        assert_eq!(ix.overlaps(&[1, 2]).device[a], 2);
        ix.apply(a, &batch(0, true, vec![stored(Device, &[1])])).unwrap();
        ix.expire(t0 + Duration::from_secs(10), Duration::from_secs(5));
        // The prediction of 2 is gone; 1 stays because the worker said so.
        assert_eq!(ix.overlaps(&[1, 2]).device[a], 1);
        assert_eq!(ix.len(), 1);
    }
}
