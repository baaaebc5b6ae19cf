//! (e) The single large tensor of cubecl issue 1614, scaled to lavapipe's 128 MiB binding
//! limit: one 6 x 512 x 10000 f32 tensor (117.2 MiB) live at a time.

use burn::tensor::{Device, Tensor};

use crate::measure::Workload;

pub const SHAPE: [usize; 3] = [6, 512, 10_000];
/// The bytes the tensor asks for.
pub const REQUESTED: u64 = (SHAPE[0] * SHAPE[1] * SHAPE[2] * 4) as u64;

pub struct Large {
    device: Device,
    held: Option<Tensor<3>>,
}

impl Large {
    pub fn new(device: &Device, _seed: u64) -> Self {
        Self {
            device: device.clone(),
            held: None,
        }
    }
}

impl Workload for Large {
    fn step(&mut self, step: usize) -> f32 {
        // The previous one goes first: one large tensor at a time.
        self.held = None;
        let tensor = Tensor::<3>::ones(SHAPE, &self.device) * (step + 1) as f32;
        // Kept after the read, so the fused kernel writes it out and it is live when read.
        let sum = tensor.clone().sum().into_scalar::<f32>();
        self.held = Some(tensor);
        sum
    }
}
