//! (d) Threads replaced every round: each step spawns three fresh OS threads that each create,
//! compute, read and drop tensors of a few sizes, then exit. CubeCL opens a stream (with its
//! own memory) for each new thread.

use std::thread;

use burn::tensor::{Device, Tensor, TensorData};

use crate::measure::Workload;
use crate::rng::Rng;

const THREADS: usize = 3;
/// Elements: 1 KiB, 64 KiB and 1 MiB of f32, and one odd size.
const SIZES: [usize; 4] = [256, 16 << 10, 256 << 10, 100_003];

pub struct Threads {
    device: Device,
    seed: u64,
}

impl Threads {
    pub fn new(device: &Device, seed: u64) -> Self {
        Self {
            device: device.clone(),
            seed,
        }
    }
}

impl Workload for Threads {
    fn step(&mut self, step: usize) -> f32 {
        let workers: Vec<_> = (0..THREADS)
            .map(|index| {
                let device = self.device.clone();
                let mut rng = Rng::new(self.seed ^ ((step * THREADS + index) as u64) << 16);
                thread::spawn(move || {
                    SIZES
                        .iter()
                        .map(|&size| {
                            let data = TensorData::new(rng.floats(size), [size]);
                            let x = Tensor::<1>::from_data(data, &device);
                            (x.clone() * 2.0 + x).sum().into_scalar::<f32>()
                        })
                        .sum::<f32>()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("a worker thread"))
            .sum()
    }
}
