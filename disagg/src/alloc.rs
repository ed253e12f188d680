//! The process's memory allocator: mimalloc by default, glibc's malloc with
//! `DISAGG_ALLOCATOR=system` (for A/B runs in one build).
//!
//! Why the choice exists: under load the gateway's threads free what the engine's thread
//! allocated (its outputs) and allocate beside the engine's other threads. glibc's malloc
//! takes an arena's lock where its per-thread cache does not absorb a call, and a handler
//! thread then sleeps on that lock: `perf record -e sched:sched_switch` on `disagg bench
//! serve` showed handler threads asleep in `__lll_lock_wait_private` under `_int_free`
//! and `realloc` (tokenization), and on the H200 host about half of the requests at 64
//! and 256 streams blocked at least once before submission. mimalloc gives each thread
//! its own heap and returns a block freed by another thread through a lock-free list:
//! with it no request blocked there, the time to submission's p99 halved and the gateway
//! spent less CPU per token. Its end-to-end tail was worse than glibc's on one start of
//! the H200 host and better on the next (every level under 1 ms at p99 in four runs of
//! four, against none of four for glibc's); docs/PERF.md has both.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

/// mimalloc, or the system allocator where the environment asks for it (read once, at
/// the process's first allocation, before any other thread exists).
pub struct Switchable;

const UNREAD: u8 = 0;
const MIMALLOC: u8 = 1;
const SYSTEM: u8 = 2;
static CHOICE: AtomicU8 = AtomicU8::new(UNREAD);

/// `kernels::env::ALLOCATOR` as a C string (the first allocation cannot build one).
const VAR: &std::ffi::CStr = c"DISAGG_ALLOCATOR";

#[inline]
fn system() -> bool {
    match CHOICE.load(Ordering::Relaxed) {
        MIMALLOC => false,
        SYSTEM => true,
        _ => read_choice(),
    }
}

#[cold]
fn read_choice() -> bool {
    // SAFETY: getenv reads the environment in place (no allocation); at the first
    // allocation no other thread exists to change it.
    let v = unsafe { libc::getenv(VAR.as_ptr()) };
    // SAFETY: a non-null getenv result is a NUL-terminated string.
    let sys = !v.is_null() && unsafe { std::ffi::CStr::from_ptr(v) }.to_bytes() == b"system";
    CHOICE.store(if sys { SYSTEM } else { MIMALLOC }, Ordering::Relaxed);
    sys
}

/// A `DISAGG_ALLOCATOR` that names neither allocator, as an error to stop on (the
/// choice itself was made at the first allocation: mimalloc for any value but `system`).
pub fn check_choice() -> Result<(), String> {
    match std::env::var(kernels::env::ALLOCATOR) {
        Ok(v) if v != "system" && v != "mimalloc" => {
            Err(format!("{}={v}: use `system` (glibc's malloc) or `mimalloc` (the default)", kernels::env::ALLOCATOR))
        }
        _ => Ok(()),
    }
}

/// The allocator in use: "mimalloc" or "system" (for benchmark reports).
pub fn name() -> &'static str {
    if system() {
        "system"
    } else {
        "mimalloc"
    }
}

// SAFETY: each call goes to the allocator chosen before the first allocation, which never
// changes, so every block is freed and resized by the allocator that made it.
unsafe impl GlobalAlloc for Switchable {
    #[inline]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if system() {
            System.alloc(l)
        } else {
            mimalloc::MiMalloc.alloc(l)
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if system() {
            System.alloc_zeroed(l)
        } else {
            mimalloc::MiMalloc.alloc_zeroed(l)
        }
    }

    #[inline]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if system() {
            System.dealloc(p, l)
        } else {
            mimalloc::MiMalloc.dealloc(p, l)
        }
    }

    #[inline]
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        if system() {
            System.realloc(p, l, new_size)
        } else {
            mimalloc::MiMalloc.realloc(p, l, new_size)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_variable_is_the_documented_one() {
        assert_eq!(super::VAR.to_str().unwrap(), kernels::env::ALLOCATOR);
    }
}
