//! Weights drawn on the host from a seeded generator, so both sides start from the same model
//! whatever the device's own random generator does.

use burn::module::{ModuleMapper, Param};
use burn::tensor::{Tensor, TensorData};

use crate::rng::Rng;

/// Replaces every float parameter by `U(-k, k)`, `k = 1/sqrt(fan_in)`, drawn in module order;
/// a layer norm keeps its (constant) initial scale and shift.
pub struct HostInit {
    rng: Rng,
    /// The containers entered, innermost last.
    path: Vec<String>,
}

impl HostInit {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
            path: Vec::new(),
        }
    }
}

impl ModuleMapper for HostInit {
    fn enter_module(&mut self, _name: &str, container_type: &str) {
        self.path.push(container_type.into());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self
            .path
            .last()
            .is_some_and(|kind| kind == "Struct:LayerNorm")
        {
            return param;
        }
        let rng = &mut self.rng;
        param.map(|old| {
            let dims = old.dims();
            let count: usize = dims.iter().product();
            // Linear weights are [in, out]; conv weights [out, in, kh, kw]; biases [out].
            let fan_in = match D {
                1 | 2 => dims[0],
                _ => count / dims[0],
            };
            let k = 1.0 / (fan_in as f32).sqrt();
            let values: Vec<f32> = rng.floats(count).into_iter().map(|v| v * k).collect();
            let fresh = Tensor::<D>::from_data(TensorData::new(values, dims), &old.device());
            if old.is_require_grad() {
                fresh.require_grad()
            } else {
                fresh
            }
        })
    }
}
