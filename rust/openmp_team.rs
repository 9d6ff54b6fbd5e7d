//! Runs work on the process's OpenMP thread team when one exists (torch's libgomp), instead of
//! on new threads.
//!
//! After each parallel op, torch's OpenMP workers keep spinning for a while, waiting for the
//! next one. Threads we start ourselves then share cores with them; handing our work to that
//! very team (`GOMP_parallel`, libgomp's entry point for `#pragma omp parallel`) wakes the
//! spinning workers instead. Without a loaded libgomp, or off Linux, the caller falls back to
//! scoped threads.

use std::ffi::c_void;
use std::sync::OnceLock;

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, u32, u32);

/// libgomp's `GOMP_parallel`, if this process has libgomp loaded (never loads it).
#[cfg(target_os = "linux")]
fn gomp_parallel() -> Option<GompParallel> {
    static FOUND: OnceLock<Option<GompParallel>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        const RTLD_LAZY: i32 = 0x1;
        const RTLD_NOLOAD: i32 = 0x4;
        extern "C" {
            fn dlopen(filename: *const std::ffi::c_char, flags: i32) -> *mut c_void;
            fn dlsym(handle: *mut c_void, symbol: *const std::ffi::c_char) -> *mut c_void;
        }
        // SAFETY: plain libc calls with NUL-terminated names; RTLD_NOLOAD only looks up an
        // already loaded library, and a non-null GOMP_parallel has the signature above (the
        // GCC OpenMP ABI).
        unsafe {
            let handle = dlopen(c"libgomp.so.1".as_ptr(), RTLD_LAZY | RTLD_NOLOAD);
            if handle.is_null() {
                return None;
            }
            let symbol = dlsym(handle, c"GOMP_parallel".as_ptr());
            (!symbol.is_null()).then(|| std::mem::transmute::<*mut c_void, GompParallel>(symbol))
        }
    })
}

#[cfg(not(target_os = "linux"))]
fn gomp_parallel() -> Option<GompParallel> {
    None
}

/// Calls `work` on `threads` threads (the caller among them) and returns when all are done.
/// `work` must not panic across the team: a panic is caught and re-raised here.
pub fn run_on_team(threads: usize, work: &(dyn Fn() + Sync)) {
    if threads > 1 {
        if let Some(parallel) = gomp_parallel() {
            let state = TeamState { work, panicked: std::sync::atomic::AtomicBool::new(false) };
            // SAFETY: `state` outlives the call (GOMP_parallel returns after every thread ran
            // `trampoline`), and `trampoline` only reads it through a shared reference.
            unsafe { parallel(trampoline, &state as *const TeamState as *mut c_void, threads as u32, 0) };
            if state.panicked.load(std::sync::atomic::Ordering::Relaxed) {
                panic!("a thread of the OpenMP team panicked");
            }
            return;
        }
    }
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
}

struct TeamState<'a> {
    work: &'a (dyn Fn() + Sync),
    panicked: std::sync::atomic::AtomicBool,
}

extern "C" fn trampoline(data: *mut c_void) {
    // SAFETY: `data` is the `TeamState` that `run_on_team` keeps alive for the whole call.
    let state = unsafe { &*(data as *const TeamState) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(state.work)).is_err() {
        state.panicked.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_thread_runs_the_work_once() {
        for threads in [1, 2, 3] {
            let calls = AtomicUsize::new(0);
            run_on_team(threads, &|| {
                calls.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(calls.load(Ordering::Relaxed), threads);
        }
    }
}
