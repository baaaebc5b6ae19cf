//! An SVG chart of allocated and reserved bytes over training steps.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::probe::MemoryPoint;

/// One run's readings, one per training step.
#[derive(Debug, Clone, Copy)]
pub struct TimelineRun<'a> {
    /// Legend name, e.g. `caching-wgpu`.
    pub name: &'a str,
    /// Allocated/reserved bytes after each step.
    pub points: &'a [MemoryPoint],
}

/// Why the chart could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    /// No run has any reading (the backend reports no current bytes).
    #[error("no memory readings to plot: the backend reports no allocated/reserved bytes")]
    Empty,
    /// Drawing or writing the SVG failed.
    #[error("cannot draw {}: {message}", path.display())]
    Draw {
        /// The SVG file.
        path: PathBuf,
        /// What plotters reported.
        message: String,
    },
}

const MIB: f64 = 1024.0 * 1024.0;
/// Line colours, one per run; allocated is drawn solid, reserved thicker.
const COLOURS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Draws allocated and reserved MiB against the training step for every run
/// into an 1000 x 500 SVG at `path`.
pub fn write_timeline_svg(path: &Path, runs: &[TimelineRun<'_>]) -> Result<(), TimelineError> {
    let steps = runs.iter().map(|r| r.points.len()).max().unwrap_or(0);
    if steps == 0 {
        return Err(TimelineError::Empty);
    }
    let top = runs
        .iter()
        .flat_map(|r| r.points.iter())
        .map(|p| p.reserved.max(p.allocated))
        .max()
        .unwrap_or(0) as f64
        / MIB;
    let draw_error = |e: &dyn std::fmt::Display| TimelineError::Draw {
        path: path.to_path_buf(),
        message: e.to_string(),
    };

    let root = SVGBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Device memory over training steps", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0usize..steps, 0f64..(top * 1.1).max(1.0))
        .map_err(|e| draw_error(&e))?;
    chart
        .configure_mesh()
        .x_desc("training step")
        .y_desc("MiB")
        .draw()
        .map_err(|e| draw_error(&e))?;

    for (i, run) in runs.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let series = [
            ("allocated", ShapeStyle::from(&colour).stroke_width(1)),
            (
                "reserved",
                ShapeStyle::from(&colour.mix(0.5)).stroke_width(3),
            ),
        ];
        for (which, style) in series {
            let values = run.points.iter().enumerate().map(|(step, p)| {
                let bytes = if which == "allocated" {
                    p.allocated
                } else {
                    p.reserved
                };
                (step + 1, bytes as f64 / MIB)
            });
            chart
                .draw_series(LineSeries::new(values, style))
                .map_err(|e| draw_error(&e))?
                .label(format!("{} {which}", run.name))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| draw_error(&e))?;
    root.present().map_err(|e| draw_error(&e))?;
    Ok(())
}
