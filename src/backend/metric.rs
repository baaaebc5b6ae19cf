//! burn-train metrics of the caching allocator's memory (feature `train`): [`MemoryMetrics`].

use std::sync::Arc;

use burn_train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};
use parking_lot::Mutex;

use super::{CachingDevice, memory_stats};
use crate::alloc::units::MIB;

/// Which number of the device a [`CachingMemoryMetric`] shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryQuantity {
    /// Bytes of live tensors (`CachingMemoryStats::memory_allocated`).
    Allocated,
    /// Bytes of the engine's device segments (`memory_reserved`).
    Reserved,
    /// The engine's peak of allocated blocks since the group's previous reading.
    PeakAllocated,
    /// The peak of reserved bytes since the group's previous reading.
    PeakReserved,
}

impl MemoryQuantity {
    fn label(self) -> &'static str {
        match self {
            MemoryQuantity::Allocated => "GPU Memory Allocated",
            MemoryQuantity::Reserved => "GPU Memory Reserved",
            MemoryQuantity::PeakAllocated => "GPU Memory Peak Allocated",
            MemoryQuantity::PeakReserved => "GPU Memory Peak Reserved",
        }
    }
}

/// One reading of the four numbers, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Reading {
    allocated: u64,
    reserved: u64,
    peak_allocated: u64,
    peak_reserved: u64,
}

impl Reading {
    fn get(&self, quantity: MemoryQuantity) -> u64 {
        match quantity {
            MemoryQuantity::Allocated => self.allocated,
            MemoryQuantity::Reserved => self.reserved,
            MemoryQuantity::PeakAllocated => self.peak_allocated,
            MemoryQuantity::PeakReserved => self.peak_reserved,
        }
    }
}

/// What the metrics of one group share.
#[derive(Default)]
struct Shared {
    /// Readings taken so far; 0: none.
    generation: u64,
    reading: Reading,
    /// The device's peaks (allocated, reserved) at the previous reading: the group's baseline.
    device_peaks: Option<(u64, u64)>,
    /// Whether the group's first metric (the one that takes each round's reading) exists.
    first_made: bool,
}

/// The metrics of one device that share their readings: burn-train metrics of the caching
/// allocator's memory (feature `train`), the bytes of live tensors and of reserved segments
/// beside the loss on `SupervisedTraining`'s dashboard.
///
/// ```no_run
/// # use burn_train::{LearningComponentsTypes, SupervisedTraining};
/// # use burn_caching_alloc::backend::CachingDevice;
/// # fn example<LC, D>(training: SupervisedTraining<LC>, device: D) -> SupervisedTraining<LC>
/// # where LC: LearningComponentsTypes, D: CachingDevice + Clone + Send + Sync {
/// use burn_caching_alloc::backend::MemoryMetrics;
///
/// // training = SupervisedTraining::new(dir, train, valid).metrics((LossMetric::new(),))
/// training.metrics(MemoryMetrics::new(&device).all()) // train and valid
/// # }
/// ```
///
/// Each metric is numeric, in MiB: [`MemoryQuantity::Allocated`] (bytes of live tensors,
/// `memory_allocated`), [`MemoryQuantity::Reserved`] (the engine's segments,
/// `memory_reserved`), and the peaks **since the previous reading** of the group:
/// [`MemoryQuantity::PeakAllocated`] (the engine's peak of allocated blocks, which counts
/// CubeCL's free slices too; equal to the live tensors' peak while history is recorded) and
/// [`MemoryQuantity::PeakReserved`]. Reading changes nothing on the device: the group keeps
/// its own baseline (the device's peaks at its previous reading) and never resets the device's
/// peak statistics, which stay the user's (`max_memory_allocated` reads what it would read
/// without the metrics). When the device's peak rose since the previous reading, that peak
/// was reached since then and is shown; otherwise the peak since then is not known (the
/// device's is older), and the higher of the two readings' current values is shown.
///
/// The metrics of one [`MemoryMetrics`] group share their readings: within one update round
/// (burn-train updates every metric once per item, in the order registered) the group's first
/// metric (the first one [`MemoryMetrics::metric`] made: `Allocated` for
/// [`MemoryMetrics::all`]) reads `memory_stats` and the others show the same reading, so the
/// four numbers of a step belong together. burn-train registers a copy of each metric for
/// training and one for validation; each copy of the first metric takes its own reading, so a
/// validation step never shows the last training step's numbers. (A metric that has already
/// shown the current reading also takes a new one.)
pub struct MemoryMetrics<Dev: CachingDevice> {
    device: Dev,
    shared: Arc<Mutex<Shared>>,
}

impl<Dev: CachingDevice + Clone + Send + Sync> MemoryMetrics<Dev> {
    /// A group of metrics of `device`.
    pub fn new(device: &Dev) -> Self {
        Self {
            device: device.clone(),
            shared: Arc::new(Mutex::new(Shared::default())),
        }
    }

    /// The metric of `quantity` in this group.
    ///
    /// ```no_run
    /// # use burn_caching_alloc::backend::{CachingDevice, MemoryMetrics, MemoryQuantity};
    /// # fn example<D: CachingDevice + Clone + Send + Sync>(device: D) {
    /// let reserved = MemoryMetrics::new(&device).metric(MemoryQuantity::Reserved);
    /// # }
    /// ```
    pub fn metric(&self, quantity: MemoryQuantity) -> CachingMemoryMetric<Dev> {
        let mut shared = self.shared.lock();
        let first = !std::mem::replace(&mut shared.first_made, true);
        drop(shared);
        CachingMemoryMetric {
            device: self.device.clone(),
            quantity,
            name: Arc::new(quantity.label().to_string()),
            shared: self.shared.clone(),
            first,
            seen: 0,
            bytes: 0,
        }
    }

    /// Allocated, reserved, peak allocated and peak reserved, as a tuple for
    /// `SupervisedTraining::metrics` (which registers each for training and validation).
    #[allow(clippy::type_complexity)]
    pub fn all(
        &self,
    ) -> (
        CachingMemoryMetric<Dev>,
        CachingMemoryMetric<Dev>,
        CachingMemoryMetric<Dev>,
        CachingMemoryMetric<Dev>,
    ) {
        (
            self.metric(MemoryQuantity::Allocated),
            self.metric(MemoryQuantity::Reserved),
            self.metric(MemoryQuantity::PeakAllocated),
            self.metric(MemoryQuantity::PeakReserved),
        )
    }
}

/// A burn-train numeric metric of one of a device's memory numbers, in MiB (see
/// [`MemoryMetrics`]). Its input is `()`: it reads the device, not the model's output.
pub struct CachingMemoryMetric<Dev: CachingDevice> {
    device: Dev,
    quantity: MemoryQuantity,
    name: MetricName,
    shared: Arc<Mutex<Shared>>,
    /// Whether this is the group's first metric, which takes a reading at every update.
    first: bool,
    /// The generation of the reading shown.
    seen: u64,
    bytes: u64,
}

impl<Dev: CachingDevice + Clone> Clone for CachingMemoryMetric<Dev> {
    fn clone(&self) -> Self {
        Self {
            device: self.device.clone(),
            quantity: self.quantity,
            name: self.name.clone(),
            shared: self.shared.clone(),
            first: self.first,
            seen: self.seen,
            bytes: self.bytes,
        }
    }
}

impl<Dev: CachingDevice + Clone + Send + Sync> CachingMemoryMetric<Dev> {
    /// What the metric shows, in bytes (after its last update).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The number shown: a new reading for the group's first metric or when this metric has
    /// already shown the current one, else the group's current reading.
    fn read(&mut self) -> u64 {
        let mut shared = self.shared.lock();
        if self.first || shared.generation == 0 || shared.generation == self.seen {
            let stats = memory_stats(&self.device);
            let (allocated, reserved) = (stats.memory_allocated(), stats.memory_reserved());
            let peaks = (
                stats.engine.max_memory_allocated(),
                stats.max_memory_reserved(),
            );
            let previous = shared.reading;
            // The peak since the previous reading: the device's when it rose since then,
            // else the higher of the two readings (see the module documentation).
            let since = |peak: u64, baseline: Option<u64>, before: u64, now: u64| match baseline {
                Some(baseline) if peak <= baseline => before.max(now),
                _ => peak,
            };
            shared.reading = Reading {
                allocated,
                reserved,
                peak_allocated: since(
                    peaks.0,
                    shared.device_peaks.map(|p| p.0),
                    previous.allocated,
                    allocated,
                ),
                peak_reserved: since(
                    peaks.1,
                    shared.device_peaks.map(|p| p.1),
                    previous.reserved,
                    reserved,
                ),
            };
            shared.device_peaks = Some(peaks);
            shared.generation += 1;
        }
        self.seen = shared.generation;
        shared.reading.get(self.quantity)
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

impl<Dev: CachingDevice + Clone + Send + Sync> Metric for CachingMemoryMetric<Dev> {
    type Input = ();

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn description(&self) -> Option<String> {
        Some(match self.quantity {
            MemoryQuantity::Allocated => "Bytes of live tensors (memory_allocated)".into(),
            MemoryQuantity::Reserved => "Bytes of the allocator's segments".into(),
            MemoryQuantity::PeakAllocated => {
                "Peak of allocated blocks since the last reading".into()
            }
            MemoryQuantity::PeakReserved => "Peak of reserved bytes since the last reading".into(),
        })
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("MiB".to_string()),
            higher_is_better: false,
        }
        .into()
    }

    fn update(&mut self, _item: &(), _metadata: &MetricMetadata) -> SerializedEntry {
        self.bytes = self.read();
        let value = mib(self.bytes);
        SerializedEntry::new(format!("{value:.2} MiB"), value.to_string())
    }

    fn clear(&mut self) {}
}

impl<Dev: CachingDevice + Clone + Send + Sync> Numeric for CachingMemoryMetric<Dev> {
    fn value(&self) -> NumericEntry {
        NumericEntry::Value(mib(self.bytes))
    }

    fn running_value(&self) -> NumericEntry {
        NumericEntry::Value(mib(self.bytes))
    }
}
