//! Reserved-over-time curves: one panel per trace, one line per allocator, plus the bytes of
//! live requests (what any allocator must at least reserve).

use std::path::Path;

use plotters::prelude::*;
use replay::Measurement;

/// Points per line: each is the maximum of its stretch of operations, so peaks survive.
const POINTS: usize = 1000;
const PANEL_HEIGHT: u32 = 360;
const WIDTH: u32 = 1100;

const COLORS: [RGBColor; 5] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
];

/// One trace's curves: its name, the live-request curve and each allocator's measurement.
pub struct Panel<'a> {
    pub trace: &'a str,
    pub allocated: Vec<u64>,
    pub measurements: Vec<&'a Measurement>,
}

fn downsample(curve: &[u64]) -> Vec<(f64, f64)> {
    let stride = curve.len().div_ceil(POINTS).max(1);
    curve
        .chunks(stride)
        .enumerate()
        .map(|(i, chunk)| {
            let max = chunk.iter().copied().max().unwrap_or(0);
            ((i * stride) as f64, max as f64 / (1u64 << 20) as f64)
        })
        .collect()
}

/// Draws every panel, stacked, into one SVG file at `path`.
pub fn draw(path: &Path, panels: &[Panel<'_>]) -> Result<(), Box<dyn std::error::Error>> {
    let height = PANEL_HEIGHT * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let ops = panel.allocated.len().max(1) as f64;
        let top = panel
            .measurements
            .iter()
            .flat_map(|m| m.reserved_curve.iter())
            .chain(panel.allocated.iter())
            .copied()
            .max()
            .unwrap_or(1) as f64
            / (1u64 << 20) as f64;
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{}: device memory reserved over the replay", panel.trace),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..ops, 0f64..top * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("operation")
            .y_desc("MiB")
            .draw()?;
        for (i, m) in panel.measurements.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(downsample(&m.reserved_curve), color))?
                .label(format!("{} (reserved)", m.allocator))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .draw_series(LineSeries::new(downsample(&panel.allocated), BLACK))?
            .label("live requests (allocated)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
