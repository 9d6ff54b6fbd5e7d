//! The PyO3 layer (`pagedkv_core._core`): conversions and error mapping only, one file per part of
//! the core it binds. All logic lives in the plain Rust types.

mod block_manager;
mod decoder;
mod errors;
mod kernels;
mod kv_events;
mod quantized;
mod scheduler;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    scheduler::register(m)?;
    block_manager::register(m)?;
    kv_events::register(m)?;
    kernels::register(m)?;
    quantized::register(m)?;
    decoder::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
