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
    use std::ffi::{c_char, c_int, CStr, CString};

    const RTLD_LAZY: c_int = 0x1;
    const RTLD_NOLOAD: c_int = 0x4;
    /// The start of glibc's `struct dl_phdr_info`: all we read.
    #[repr(C)]
    struct LoadedObject {
        address: usize,
        name: *const c_char,
    }
    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dl_iterate_phdr(
            callback: extern "C" fn(*mut LoadedObject, usize, *mut c_void) -> c_int,
            data: *mut c_void,
        ) -> c_int;
    }
    /// Collects the paths of loaded objects named libgomp*, such as torch's (whose file name
    /// some wheels give a hash suffix).
    extern "C" fn collect_libgomp(object: *mut LoadedObject, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: glibc passes a valid dl_phdr_info whose name is a NUL-terminated string (or
        // null), and `data` is the Vec that `gomp_parallel` passed in.
        unsafe {
            let name = (*object).name;
            if !name.is_null() {
                let path = CStr::from_ptr(name);
                let file = path.to_bytes().rsplit(|&byte| byte == b'/').next().unwrap_or_default();
                if file.starts_with(b"libgomp") {
                    (*(data as *mut Vec<CString>)).push(path.to_owned());
                }
            }
        }
        0
    }

    static FOUND: OnceLock<Option<GompParallel>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let mut paths: Vec<CString> = Vec::new();
        // SAFETY: the callback only appends to `paths`, which outlives the call; RTLD_NOLOAD
        // only looks up an already loaded library, and a non-null GOMP_parallel has the
        // signature above (the GCC OpenMP ABI).
        unsafe {
            dl_iterate_phdr(collect_libgomp, &mut paths as *mut Vec<CString> as *mut c_void);
            paths.iter().find_map(|path| {
                let handle = dlopen(path.as_ptr(), RTLD_LAZY | RTLD_NOLOAD);
                let symbol =
                    if handle.is_null() { std::ptr::null_mut() } else { dlsym(handle, c"GOMP_parallel".as_ptr()) };
                (!symbol.is_null()).then(|| std::mem::transmute::<*mut c_void, GompParallel>(symbol))
            })
        }
    })
}

#[cfg(not(target_os = "linux"))]
fn gomp_parallel() -> Option<GompParallel> {
    None
}

/// Whether `run_on_team` hands work to an OpenMP team (else it starts threads).
pub fn is_available() -> bool {
    gomp_parallel().is_some()
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
