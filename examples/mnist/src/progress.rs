//! A progress bar per epoch (indicatif) and one summary line per epoch.

use indicatif::{ProgressBar, ProgressStyle};

use super::report::EpochReport;
use super::train::TrainObserver;

/// Shows a progress bar while an epoch trains and prints its loss, accuracy
/// and seconds when it ends. The bar is hidden when stderr is not a terminal;
/// the summary lines are always printed (to stdout).
#[derive(Debug, Default)]
pub struct EpochProgress {
    label: String,
    bar: Option<ProgressBar>,
}

impl EpochProgress {
    /// A progress display whose lines start with `label` (e.g. the backend).
    pub fn new(label: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            bar: None,
        }
    }
}

impl TrainObserver for EpochProgress {
    fn epoch_started(&mut self, epoch: usize, steps: usize) {
        let bar = ProgressBar::new(steps as u64);
        let style = ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} steps ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(format!("{} epoch {epoch}", self.label));
        self.bar = Some(bar);
    }

    fn step_finished(&mut self, _epoch: usize, step: usize) {
        if let Some(bar) = &self.bar {
            bar.set_position(step as u64);
        }
    }

    fn epoch_finished(&mut self, report: &EpochReport) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        println!(
            "{} epoch {}: loss {:.4}, test accuracy {:.2}%, {:.2} s",
            self.label,
            report.epoch,
            report.loss,
            report.accuracy * 100.0,
            report.seconds
        );
    }
}
