//! Core errors to the `pagedkv_core.errors` classes, and the guard that keeps panics out of Python.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::prelude::*;

use crate::errors::Error;

pub(crate) mod exceptions {
    pyo3::import_exception!(pagedkv_core.errors, PagedKVError);
    pyo3::import_exception!(pagedkv_core.errors, PromptTooLongError);
    pyo3::import_exception!(pagedkv_core.errors, OverloadedError);
    pyo3::import_exception!(pagedkv_core.errors, OutOfBlocksError);
    pyo3::import_exception!(pagedkv_core.errors, UnknownRequestError);
    pyo3::import_exception!(pagedkv_core.errors, UnknownSequenceError);
    pyo3::import_exception!(pagedkv_core.errors, DuplicateRequestError);
    pyo3::import_exception!(pagedkv_core.errors, InvalidConfigError);
    pyo3::import_exception!(pagedkv_core.errors, InvalidStateError);
}

pub(crate) fn to_py_err(error: Error) -> PyErr {
    use exceptions::*;
    let message = error.to_string();
    match error {
        Error::PromptTooLong { .. } | Error::PromptExceedsPool { .. } => PromptTooLongError::new_err(message),
        Error::Overloaded { .. } => OverloadedError::new_err(message),
        Error::OutOfBlocks { .. } => OutOfBlocksError::new_err(message),
        Error::UnknownRequest(_) => UnknownRequestError::new_err(message),
        Error::UnknownSequence(_) => UnknownSequenceError::new_err(message),
        Error::DuplicateRequest(_) | Error::DuplicateSequence(_) => DuplicateRequestError::new_err(message),
        Error::InvalidConfig { .. } => InvalidConfigError::new_err(message),
        Error::InvalidState(_) => InvalidStateError::new_err(message),
    }
}

/// Runs core code so that neither an error nor a panic crosses into Python unmapped.
pub(crate) fn call<T>(f: impl FnOnce() -> crate::errors::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result.map_err(to_py_err),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(exceptions::PagedKVError::new_err(format!("internal error in pagedkv core: {what}")))
        }
    }
}
