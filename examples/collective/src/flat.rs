//! A step's gradients as one tensor: one collective operation per step instead of one per
//! parameter.
//!
//! `GradientsParams::all_reduce` makes one burn-collective `all_reduce` per parameter. Between
//! processes, burn-collective 0.21.0 completes only the first global operation of a
//! registration (see [`crate::node`]), so a node of several processes reduces a step's
//! gradients as one tensor: [`all_reduce`] lays every gradient end to end in the order the
//! model visits its parameters (the same on every process, since every process builds the
//! same model), makes one `all_reduce`, and cuts the result back into the same shapes. The
//! values are those of the per-parameter reduction: the same sums of the same numbers,
//! element by element.

use burn::collective::{self, CollectiveError, PeerId, ReduceOperation};
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;

/// Where each gradient lies in the flat tensor, in the model's visiting order.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// Each gradient's parameter and shape.
    pub parts: Vec<(ParamId, Vec<usize>)>,
}

/// Takes every gradient of `model`'s float parameters out of `grads`, flattened and laid end
/// to end in the order `model` visits them; `None` when no parameter has a gradient.
pub fn flatten<B: AutodiffBackend, M: AutodiffModule<B>>(
    grads: &mut GradientsParams,
    model: &M,
) -> Option<(Tensor<B::InnerBackend, 1>, Layout)> {
    let mut visitor = Flatten::<B> {
        grads,
        tensors: Vec::new(),
        layout: Layout { parts: Vec::new() },
    };
    model.visit(&mut visitor);
    let Flatten {
        tensors, layout, ..
    } = visitor;
    (!tensors.is_empty()).then(|| (Tensor::cat(tensors, 0), layout))
}

/// Cuts `flat` back into the gradients `layout` describes and registers them in `grads`.
///
/// # Panics
///
/// If `flat` is shorter than the gradients of `layout` (it was not made by [`flatten`] with the
/// same model), or `model` does not have `layout`'s parameters with their ranks.
pub fn unflatten<B: AutodiffBackend, M: AutodiffModule<B>>(
    flat: Tensor<B::InnerBackend, 1>,
    layout: &Layout,
    model: &M,
    grads: &mut GradientsParams,
) {
    let mut visitor = Unflatten::<B> {
        flat,
        offset: 0,
        parts: layout.parts.iter(),
        grads,
    };
    model.visit(&mut visitor);
    assert!(
        visitor.parts.next().is_none(),
        "the model has not every parameter of the layout"
    );
}

/// `grads` averaged (or summed, as `op` says) over every peer of the collective with one
/// burn-collective `all_reduce`: [`flatten`], `all_reduce`, [`unflatten`]. Every peer must
/// call it at the same step, with the same model.
///
/// # Errors
///
/// burn-collective's error.
pub fn all_reduce<B: AutodiffBackend, M: AutodiffModule<B>>(
    mut grads: GradientsParams,
    model: &M,
    peer: PeerId,
    op: ReduceOperation,
) -> Result<GradientsParams, CollectiveError> {
    let Some((flat, layout)) = flatten::<B, M>(&mut grads, model) else {
        return Ok(grads);
    };
    let reduced =
        collective::all_reduce::<B::InnerBackend>(peer, flat.into_primitive().tensor(), op)?;
    let reduced = Tensor::from_primitive(TensorPrimitive::Float(reduced));
    unflatten::<B, M>(reduced, &layout, model, &mut grads);
    Ok(grads)
}

struct Flatten<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    tensors: Vec<Tensor<B::InnerBackend, 1>>,
    layout: Layout,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let shape = grad.dims();
        self.tensors
            .push(grad.reshape([shape.iter().product::<usize>()]));
        self.layout.parts.push((param.id, shape.to_vec()));
    }
}

struct Unflatten<'a, 'l, B: AutodiffBackend> {
    flat: Tensor<B::InnerBackend, 1>,
    offset: usize,
    parts: std::slice::Iter<'l, (ParamId, Vec<usize>)>,
    grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unflatten<'_, '_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // Parameters without a gradient were left out of the layout: skip them.
        if self.parts.as_slice().first().map(|(id, _)| *id) != Some(param.id) {
            return;
        }
        let (_, shape) = self.parts.next().expect("checked above");
        let shape: [usize; D] = shape
            .as_slice()
            .try_into()
            .expect("the parameter has the rank it had when flattened");
        let len: usize = shape.iter().product();
        let part = self.flat.clone().narrow(0, self.offset, len).reshape(shape);
        self.offset += len;
        self.grads.register::<B::InnerBackend, D>(param.id, part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data;
    use crate::model::Model;
    use crate::{Backend, TrainBackend};
    use burn::backend::wgpu::WgpuDevice;

    /// Reads every gradient of `grads` (ids 1 to 4, the model's) as flat values.
    fn values(grads: &GradientsParams) -> Vec<Vec<f32>> {
        let read = |t: Tensor<Backend, 1>| t.into_data().to_vec::<f32>().unwrap();
        vec![
            read(
                grads
                    .get::<Backend, 2>(ParamId::from(1))
                    .unwrap()
                    .flatten(0, 1),
            ),
            read(grads.get::<Backend, 1>(ParamId::from(2)).unwrap()),
            read(
                grads
                    .get::<Backend, 2>(ParamId::from(3))
                    .unwrap()
                    .flatten(0, 1),
            ),
            read(grads.get::<Backend, 1>(ParamId::from(4)).unwrap()),
        ]
    }

    #[test]
    fn flattening_and_cutting_back_gives_the_same_gradients() {
        if !burn_caching_alloc::wgpu::adapter_available(&WgpuDevice::Cpu) {
            let ci = std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"));
            assert!(
                !ci,
                "no wgpu CPU adapter (lavapipe); CI is set, which makes this a failure"
            );
            eprintln!("skipping: no wgpu CPU adapter (install mesa-vulkan-drivers for lavapipe)");
            return;
        }
        let device = WgpuDevice::Cpu;
        let model = Model::<TrainBackend>::new(&device);
        let (inputs, targets) = data::batch(0).tensors::<TrainBackend>(&device);
        let mut grads = GradientsParams::from_grads(model.loss(inputs, targets).backward(), &model);
        let before = values(&grads);

        let (flat, layout) = flatten::<TrainBackend, _>(&mut grads, &model).unwrap();
        assert!(grads.is_empty(), "flatten takes the gradients out");
        let ids: Vec<_> = layout.parts.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, (1..=4).map(ParamId::from).collect::<Vec<_>>());
        let shapes: Vec<_> = layout.parts.iter().map(|(_, s)| s.clone()).collect();
        assert_eq!(shapes, vec![vec![4, 8], vec![8], vec![8, 2], vec![2]]);
        assert_eq!(flat.dims(), [32 + 8 + 16 + 2]);
        assert_eq!(
            flat.clone().into_data().to_vec::<f32>().unwrap(),
            before.concat()
        );

        unflatten::<TrainBackend, _>(flat, &layout, &model, &mut grads);
        assert_eq!(grads.len(), 4);
        assert_eq!(values(&grads), before);
    }
}
