//! The server's kernel cache: each kernel (id and execution mode) is validated against the
//! device's limits and compiled by the driver once, then launched from the cache.

use std::collections::HashMap;
use std::sync::Arc;

use cubecl_ir::DeviceProperties;
use cubecl_runtime::compiler::CubeTask;
use cubecl_runtime::id::KernelId;
use cubecl_runtime::server::{ExecutionMode, KernelArguments, LaunchError};
use cubecl_runtime::validation::{validate_cube_dim, validate_units};

use super::super::driver::Driver;

/// Compiled kernels by id and mode.
pub(super) struct KernelCache<D: Driver> {
    kernels: HashMap<KernelId, Arc<D::Kernel>>,
}

impl<D: Driver> KernelCache<D> {
    pub(super) fn new() -> Self {
        Self {
            kernels: HashMap::new(),
        }
    }

    /// How many kernels are compiled.
    pub(super) fn len(&self) -> usize {
        self.kernels.len()
    }

    /// The compiled `kernel` in `mode`, compiled by `driver` on first use.
    pub(super) fn get(
        &mut self,
        driver: &mut D,
        properties: &DeviceProperties,
        kernel: &dyn CubeTask<D::Compiler>,
        mode: ExecutionMode,
        args: &KernelArguments,
    ) -> Result<Arc<D::Kernel>, LaunchError> {
        let mut id = kernel.id();
        id.mode(mode);
        if let Some(compiled) = self.kernels.get(&id) {
            return Ok(compiled.clone());
        }
        validate_cube_dim(properties, &id)?;
        validate_units(properties, &id)?;
        let compiled = Arc::new(driver.compile(kernel, mode, args)?);
        self.kernels.insert(id, compiled.clone());
        Ok(compiled)
    }
}
