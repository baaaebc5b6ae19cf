//! Burn 0.22.1's stock `Wgpu` backend against the same backend with every tensor in the caching
//! engine, side by side in one process: two logical devices on one adapter (see [`pair`]), the
//! same seed and data, interleaved step by step. Prints a Markdown table of what each side
//! reserves and how long its steps take, then the cost of `Dedicated` mode's slice scans.
//!
//! On a CPU (lavapipe binds at most 128 MiB per buffer, which sizes the workloads):
//! `VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json cargo run --bin side_by_side`
//! Arguments pick parts: `a` `control` `b` `c` `d` `e` `scan` (all by default).

mod init;
mod measure;
mod pair;
mod rng;
mod scan_cost;
mod table;
mod workloads;

use std::time::Instant;

use burn::tensor::Device;

use measure::{Reads, Row, Workload};
use pair::Pair;
use table::mib;
use workloads::{conv::ConvNet, large, mlp::Mlp, threads::Threads, transformer::Transformer};

const SEED: u64 = 0x5EED_0022;

/// One row of the table.
struct Part {
    /// The argument that picks it.
    arg: &'static str,
    name: &'static str,
    steps: usize,
    reads: Reads,
    build: fn(&Device, u64) -> Box<dyn Workload>,
}

const PLAN: [Part; 6] = [
    Part {
        arg: "a",
        name: "(a) MLP 784-512-10, batch 64",
        steps: 20,
        reads: Reads::EveryStep,
        build: |device, seed| Box::new(Mlp::new(device, seed)),
    },
    Part {
        arg: "control",
        name: "(a) MLP 784-512-10, batch 64",
        steps: 20,
        reads: Reads::AtEnd,
        build: |device, seed| Box::new(Mlp::new(device, seed)),
    },
    Part {
        arg: "b",
        name: "(b) TransformerEncoder, varying batch and lengths",
        steps: 12,
        reads: Reads::EveryStep,
        build: |device, seed| Box::new(Transformer::new(device, seed)),
    },
    Part {
        arg: "c",
        name: "(c) conv net, varying batch and image sizes",
        steps: 12,
        reads: Reads::EveryStep,
        build: |device, seed| Box::new(ConvNet::new(device, seed)),
    },
    Part {
        arg: "d",
        name: "(d) 3 fresh threads per round",
        steps: 8,
        reads: Reads::EveryStep,
        build: |device, seed| Box::new(Threads::new(device, seed)),
    },
    Part {
        arg: "e",
        name: "(e) one 6x512x10000 f32 tensor",
        steps: 6,
        reads: Reads::EveryStep,
        build: |device, seed| Box::new(large::Large::new(device, seed)),
    },
];

fn main() {
    let started = Instant::now();
    let picked: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |part: &str| picked.is_empty() || picked.iter().any(|p| p == part);

    let pair = Pair::open();
    let (stock_adapter, hooked_adapter) = pair.adapters();
    println!("stock device:  {:?} on {stock_adapter}", pair.stock);
    println!("hooked device: {:?} on {hooked_adapter}", pair.hooked);
    println!("one engine, registered as (\"wgpu\", 0): the hooked device's\n");

    let mut rows: Vec<Row> = Vec::new();
    for part in PLAN.iter().filter(|part| wanted(part.arg)) {
        let row_start = Instant::now();
        let build = |device: &Device| (part.build)(device, SEED);
        let row = measure::run(&pair, part.name, part.steps, part.reads, &build);
        eprintln!(
            "{} [{}]: {:.1} s; {}",
            part.name,
            part.arg,
            row_start.elapsed().as_secs_f64(),
            row.timing()
        );
        rows.push(row);
    }

    if !rows.is_empty() {
        report(&rows);
    }
    if wanted("scan") {
        scans(&pair);
    }
    pair.check_one_engine();
    println!("the stock device stayed off the engine throughout (one engine registered)");
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}

fn report(rows: &[Row]) {
    println!("{}", table::markdown(rows));
    println!(
        "Bytes in MiB. stock: `memory_pool_usage().bytes_reserved`; hooked: the engine's reserved \
         bytes plus CubeCL's staging and uniform buffers (its `bytes_reserved` less the engine \
         blocks it holds); CubeCL hooked: its `bytes_reserved` on the hooked device. Peaks: the \
         largest reading after a step; engine peak: the engine's own high-water mark. h/s: \
         hooked / stock. rel. diff: the two sides' step values (losses, sums). ¹ the stock \
         pools' pages_peak x page_size summed, an upper bound.\n"
    );

    if let Some(row) = rows.iter().find(|row| row.name.starts_with("(e)")) {
        let requested = large::REQUESTED;
        let peak = |reading: &Option<pair::Reading>| reading.map_or(0, |r| r.total);
        println!(
            "(e) requested {requested} B ({} MiB): reserved / requested at the peak: stock {:.3}, \
             hooked {:.3} (engine + CubeCL's own), engine alone {:.3}\n",
            mib(requested),
            peak(&row.stock.peak) as f64 / requested as f64,
            peak(&row.hooked.peak) as f64 / requested as f64,
            row.engine_peak as f64 / requested as f64,
        );
    }

    println!("What each side holds at each row's end (engine segments, stock pools):");
    for row in rows {
        let peaks = row.stock.peak.zip(row.hooked.peak);
        let above = row.hooked.last.total > row.stock.last.total
            || peaks.is_some_and(|(stock, hooked)| hooked.total > stock.total);
        let mark = if above {
            " (hooked reserved more than stock)"
        } else {
            ""
        };
        println!("{}{mark}:\n{}{}", row.name, row.segments, row.stock_pools);
    }
}

fn scans(pair: &Pair) {
    println!(
        "| live small tensors | stock µs per allocation + drop | hooked (Dedicated) µs |\n|--:|--:|--:|"
    );
    for scan in scan_cost::measure(pair, &[100, 1_000, 10_000]) {
        let [stock, hooked] = scan.per_allocation.map(|time| time.as_secs_f64() * 1e6);
        println!("| {} | {stock:.1} | {hooked:.1} |", scan.live);
    }
    println!();
}
