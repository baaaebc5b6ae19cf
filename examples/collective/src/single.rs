//! The reference: the same training on one device of one process, on whole batches, without
//! burn-collective. A data-parallel run over any power-of-two number of peers takes the same
//! steps (the loopback test checks it bit for bit).

use burn::backend::Autodiff;
use burn::optim::SgdConfig;
use burn::tensor::backend::AutodiffBackend;

use crate::PeerBackend;
use crate::data;
use crate::model::Model;
use crate::report::{PeerReport, Report};
use crate::train::{self, GradientSync};

/// Trains `steps` steps on `device`; returns the peer report (rank 0, peer 0, no all-reduce)
/// and the device's memory report.
pub fn run<B: PeerBackend>(device: &B::Device, steps: usize) -> [Report; 2]
where
    Autodiff<B>: AutodiffBackend<Device = B::Device>,
{
    let mut model = Model::<Autodiff<B>>::new(device);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let (next, loss) = train::step::<B>(
            model,
            &mut optim,
            &data::batch(step),
            device,
            GradientSync::None,
        )
        .expect("no collective operation runs without a peer");
        model = next;
        losses.push(loss);
    }
    let peer = Report::Peer(PeerReport {
        rank: 0,
        peer: 0,
        device: format!("{device:?}"),
        all_reduce: Vec::new(),
        losses,
        params: model.values(),
    });
    [peer, Report::memory(0, device)]
}
