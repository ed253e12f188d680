//! A persistent thread pool for the CPU kernels.
//!
//! Why not rayon: a decode step runs ~150 short parallel regions (one per matmul) of
//! tens of microseconds each. Waking a sleeping thread costs about as much as such a
//! region, so workers here spin briefly between regions (yielding when the machine is
//! oversubscribed) and only then sleep on a condition variable.
//!
//! Rules this module keeps:
//! - `run` does not return before every worker has finished the job, so the job may
//!   borrow from the caller's stack.
//! - The calling thread takes part in the work as thread 0; workers are 1..n_threads.
//! - Tasks are handed out dynamically (an atomic counter), so a slow core does not hold
//!   back the others.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    generation: AtomicU64,
    /// The current job, valid from the bump of `generation` until `pending` reaches
    /// zero. Written only by the caller of `run` while no worker reads it.
    job: UnsafeCell<Option<*const Job>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    pending: AtomicUsize,
    shutdown: AtomicBool,
    n_sleeping: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    spin_iters: usize,
}

// SAFETY: `job` is only written by the thread inside `run` while all workers are idle
// (pending == 0), and read by workers only between the generation bump (Release/Acquire)
// and their decrement of `pending`; the pointee is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises `run` calls from different threads on one pool.
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, counting the caller of `run`. Idle workers
    /// spin for [`crate::env::POOL_SPIN`] iterations (default 2,000) before sleeping.
    pub fn new(n_threads: usize) -> Self {
        let spin_iters = std::env::var(crate::env::POOL_SPIN).ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
        Self::with_spin_iters(n_threads, spin_iters)
    }

    pub fn with_spin_iters(n_threads: usize, spin_iters: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            n_sleeping: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            spin_iters,
        });
        let workers = (1..n_threads)
            .map(|tid| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("disagg-cpu-{tid}"))
                    .spawn(move || worker_loop(&shared, tid))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        Self { shared, workers, run_lock: Mutex::new(()) }
    }

    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(task, thread)` for every `task` in `0..n_tasks`, spread over the pool.
    /// `thread` is in `0..n_threads()` and can index per-thread scratch space.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            for task in 0..n_tasks {
                f(task, 0);
            }
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let job: &(dyn Fn(usize, usize) + Sync + '_) = &f;
        // SAFETY: workers are idle (the previous run waited for pending == 0), so no one
        // reads `job` now. The lifetime is erased, but we wait below until every worker
        // has stopped using it before `f` goes out of scope.
        unsafe {
            *s.job.get() =
                Some(std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(job) as *const Job);
        }
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next_task.store(0, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.n_sleeping.load(Ordering::SeqCst) > 0 {
            let _l = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        loop {
            let task = s.next_task.fetch_add(1, Ordering::Relaxed);
            if task >= n_tasks {
                break;
            }
            f(task, 0);
        }
        let mut spins = 0usize;
        while s.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker has decremented `pending`, so none holds the pointer.
        unsafe {
            *s.job.get() = None;
        }
    }
}

fn worker_loop(s: &Shared, tid: usize) {
    // Generation 0 is the pool's start: a job published before this thread got to run
    // must still be seen as new.
    let mut seen = 0;
    loop {
        // Wait for a new generation: spin, then yield, then sleep.
        let mut spins = 0usize;
        loop {
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins < s.spin_iters {
                if spins.is_multiple_of(64) {
                    // Stay polite when more threads than cores are runnable.
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                let mut l = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                s.n_sleeping.fetch_add(1, Ordering::SeqCst);
                while s.generation.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                    l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
                }
                s.n_sleeping.fetch_sub(1, Ordering::SeqCst);
                spins = 0;
            }
        }
        // SAFETY: the generation bump (SeqCst, after the Release-ordered job store)
        // happened-before this point, and the caller keeps the job alive until we
        // decrement `pending` below.
        let job = unsafe { (*s.job.get()).expect("job published with the generation") };
        let n_tasks = s.n_tasks.load(Ordering::Relaxed);
        loop {
            let task = s.next_task.fetch_add(1, Ordering::Relaxed);
            if task >= n_tasks {
                break;
            }
            // SAFETY: see above; the pointee outlives this call.
            unsafe { (*job)(task, tid) };
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n_tasks in [0, 1, 2, 7, 100] {
                let hits: Vec<AtomicUsize> = (0..n_tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n_tasks, |t, tid| {
                    assert!(tid < threads);
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn workers_wake_after_sleeping() {
        let pool = ThreadPool::with_spin_iters(2, 10);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let sum = AtomicUsize::new(0);
        pool.run(64, |t, _| {
            sum.fetch_add(t, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
    }
}
