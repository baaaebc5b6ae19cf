//! The components of a training loop's memory: [`Components`].

use std::collections::HashMap;
use std::sync::LazyLock;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};
use cubecl_common::device::DeviceId;
use parking_lot::Mutex;

use super::CachingDevice;
use super::device::settled;
use super::scope::{MemoryScope, memory_scope};
use crate::alloc::{MemoryStats, Tag, round_size};

/// The scope of each component.
pub(crate) const PARAMETER: &str = "component.parameter";
pub(crate) const GRADIENT: &str = "component.gradient";
pub(crate) const OPTIMIZER_STATE: &str = "component.optimizer_state";
pub(crate) const ACTIVATION: &str = "component.activation";

/// The parameter bytes [`Components::track`] found, per device.
static PARAMETERS: LazyLock<Mutex<HashMap<DeviceId, u64>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Live bytes by component of a training loop ([`Components`]), in blocks (PyTorch's
/// `component_bytes.*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ComponentBytes {
    /// The module's parameters.
    pub parameter: u64,
    /// Gradients the backward pass made, not yet consumed by the optimizer's step.
    pub gradient: u64,
    /// The optimizer's state (Adam's two moments, ...).
    pub optimizer_state: u64,
    /// What the forward pass made and is still live.
    pub activation: u64,
    /// Every other live block.
    pub other: u64,
}

impl ComponentBytes {
    /// The components of `stats`, with `parameters` the tracked parameter bytes (if tracked);
    /// `None` when no component was tracked or scoped.
    pub(crate) fn of(stats: &MemoryStats, parameters: Option<u64>) -> Option<Self> {
        let scope = |name: &str| stats.scopes.get(name).map(|s| s.current);
        let any = [PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION]
            .iter()
            .any(|name| scope(name).is_some());
        if !any && parameters.is_none() {
            return None;
        }
        let get = |name: &str| scope(name).unwrap_or(0);
        let model_state = get(PARAMETER) + get(OPTIMIZER_STATE);
        let parameter = parameters.map_or(get(PARAMETER), |p| p.min(model_state));
        let gradient = get(GRADIENT);
        let activation = get(ACTIVATION);
        let optimizer_state = model_state - parameter;
        let other = stats
            .memory_allocated()
            .saturating_sub(model_state + gradient + activation);
        Some(Self {
            parameter,
            gradient,
            optimizer_state,
            activation,
            other,
        })
    }

    /// `component_bytes.<name>` and the value of each component.
    pub fn entries(&self) -> [(&'static str, u64); 5] {
        [
            ("component_bytes.parameter", self.parameter),
            ("component_bytes.gradient", self.gradient),
            ("component_bytes.optimizer_state", self.optimizer_state),
            ("component_bytes.activation", self.activation),
            ("component_bytes.other", self.other),
        ]
    }
}

/// The parameter bytes `track` registered for `device`.
pub(crate) fn tracked_parameters<Dev: CachingDevice>(device: &Dev) -> Option<u64> {
    PARAMETERS.lock().get(&device.to_id()).copied()
}

/// The memory scopes of a training loop's phases on one device.
///
/// What a training step's memory is: parameters, gradients, optimizer state, activations and
/// the rest (`component_bytes.*` in `memory_stats`; the categories of PyTorch's profiler memory
/// view, computed here from memory scopes a training loop opens in a few lines, not from
/// PyTorch's profiler).
///
/// ```no_run
/// # #[cfg(feature = "wgpu")]
/// # fn main() {
/// use burn::backend::Autodiff;
/// use burn::backend::wgpu::WgpuDevice;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::{AdamConfig, GradientsParams, Optimizer};
/// use burn::tensor::Tensor;
/// use burn_caching_alloc::backend::{self, CachingWgpu, Components};
///
/// type B = Autodiff<CachingWgpu>;
/// let device = WgpuDevice::default();
/// let components = Components::new(&device);
/// let mut model: Linear<B> = {
///     let _parameters = components.parameters();
///     LinearConfig::new(64, 10).init(&device)
/// };
/// components.track(&model);
/// let mut optimizer = AdamConfig::new().init();
/// for _ in 0..3 {
///     let x = Tensor::<B, 2>::ones([32, 64], &device);
///     let loss = {
///         let _forward = components.forward();
///         model.forward(x).mean()
///     };
///     let grads = {
///         let _backward = components.backward();
///         GradientsParams::from_grads(loss.backward(), &model)
///     };
///     model = {
///         let _step = components.step();
///         optimizer.step(1e-3, model, grads)
///     };
/// }
/// let bytes = backend::memory_stats(&device).components.expect("tracked");
/// println!("parameters {} B, optimizer state {} B", bytes.parameter, bytes.optimizer_state);
/// # }
/// # #[cfg(not(feature = "wgpu"))]
/// # fn main() {}
/// ```
///
/// How each number is made, and what stays approximate:
///
/// - **parameter**: the blocks the module's parameters need, from Burn's module visitor
///   ([`Components::track`]: each float, int and bool parameter's bytes, rounded as the engine
///   rounds a request), capped by what the parameter and optimizer scopes hold.
/// - **optimizer_state**: what the parameter scope ([`Components::parameters`]) and the
///   optimizer step ([`Components::step`]) hold, less the parameters. An optimizer step in Burn
///   returns new parameter tensors (or updates them in place); either way the parameters and
///   the optimizer's state are the live blocks those two scopes made, and the parameters' share
///   is known from their shapes.
/// - **gradient**: what [`Components::backward`] allocated and is still live. When the step
///   ends, whatever the backward pass allocated and the step did not free has become the
///   optimizer's (Burn runs operations in place on buffers they consume, so a gradient's buffer
///   can become a moment); it moves to the optimizer state.
/// - **activation**: what [`Components::forward`] allocated and is still live: the tensors
///   autodiff keeps for the backward pass, and the outputs the loop holds.
/// - **other**: every other live block (input batches, metrics, anything made outside the
///   scopes).
///
/// With burn-train, the forward and backward passes are the user's `TrainStep::step`, where
/// [`Components::forward`] and [`Components::backward`] open; the optimizer's step is the
/// learner's (`learner.optimizer_step`), with no hook around it, so its allocations count as
/// "other" and the gradients it leaves live stay "gradient". The loop above is the way to see
/// all five.
#[derive(Clone, Debug)]
pub struct Components<Dev: CachingDevice> {
    device: Dev,
}

impl<Dev: CachingDevice> Components<Dev> {
    /// The components of `device`'s memory.
    pub fn new(device: &Dev) -> Self {
        Self {
            device: device.clone(),
        }
    }

    /// Around creating or loading the module: its parameters' blocks (a new module's
    /// parameters are made at their first use, which [`Self::track`] scopes).
    pub fn parameters(&self) -> MemoryScope<Dev> {
        memory_scope(&self.device, PARAMETER)
    }

    /// Around the forward pass and the loss: activations.
    pub fn forward(&self) -> MemoryScope<Dev> {
        memory_scope(&self.device, ACTIVATION)
    }

    /// Around `backward()` (and `GradientsParams::from_grads`): gradients.
    pub fn backward(&self) -> MemoryScope<Dev> {
        memory_scope(&self.device, GRADIENT)
    }

    /// Around the optimizer's step: the optimizer state (and the parameters it returns). When
    /// it ends, what the backward pass allocated and the step left live moves to the optimizer
    /// state.
    pub fn step(&self) -> OptimizerStep<Dev> {
        OptimizerStep {
            scope: Some(memory_scope(&self.device, OPTIMIZER_STATE)),
            device: self.device.clone(),
        }
    }

    /// Records the bytes `module`'s parameters need on this device, from Burn's module
    /// visitor (each parameter's bytes rounded as the engine rounds a request), and returns
    /// them. Call it once the module exists; again if its parameters change shape.
    ///
    /// Burn initialises a new module's parameters lazily, at their first use: the visit does
    /// it, inside the parameter scope, so a module made outside [`Self::parameters`] has its
    /// parameters counted too.
    pub fn track<B: Backend, M: Module<B>>(&self, module: &M) -> u64 {
        let config = super::allocator_settings(&self.device);
        let mut visitor = ParameterBytes {
            divisions: config.roundup_power2_divisions,
            bytes: 0,
        };
        {
            let _parameters = self.parameters();
            module.visit(&mut visitor);
        }
        PARAMETERS.lock().insert(self.device.to_id(), visitor.bytes);
        visitor.bytes
    }
}

/// An active optimizer step ([`Components::step`]).
#[must_use = "the step's scope ends when the guard drops"]
pub struct OptimizerStep<Dev: CachingDevice> {
    scope: Option<MemoryScope<Dev>>,
    device: Dev,
}

impl<Dev: CachingDevice> core::fmt::Debug for OptimizerStep<Dev> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("OptimizerStep")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl<Dev: CachingDevice> Drop for OptimizerStep<Dev> {
    fn drop(&mut self) {
        // The scope ends (the step's queued operations execute inside it), then the server runs
        // them; the gradients freed by then (CubeCL caches their slices) keep their scope, and
        // what is left of them moves.
        self.scope.take();
        let settled = settled(&self.device);
        if let Err(err) = settled.entry.allocator.move_scope_with(
            GRADIENT,
            Some(Tag::new(OPTIMIZER_STATE)),
            &settled.cached,
        ) {
            log::warn!("caching allocator: the gradients left by a step were not moved: {err}");
        }
    }
}

/// Sums the blocks of a module's parameters.
struct ParameterBytes {
    divisions: crate::alloc::RoundupDivisions,
    bytes: u64,
}

impl ParameterBytes {
    fn add(&mut self, bytes: usize) {
        let bytes = (bytes as u64).max(1);
        self.bytes += round_size(bytes, &self.divisions);
    }
}

impl<B: Backend> ModuleVisitor<B> for ParameterBytes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor: &Tensor<B, D> = param;
        self.add(tensor.shape().num_elements() * tensor.dtype().size());
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
        let tensor: &Tensor<B, D, Int> = param;
        self.add(tensor.shape().num_elements() * tensor.dtype().size());
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
        let tensor: &Tensor<B, D, Bool> = param;
        self.add(tensor.shape().num_elements() * tensor.dtype().size());
    }
}
