//! The command line: `orchestrator` (burn-collective's global orchestrator), `node` (one
//! training process of the collective) and `single` (the same training in one process, the
//! reference). `--help` on each says what it takes; docs/src/several-devices.md has the commands
//! for two machines.
//!
//! The `orchestrator` subcommand also serves [`collective::barrier`] on its port + 2: the
//! nodes pass it at the end of each registration round, so that none stops serving its
//! tensors while another may still be downloading them.

use std::process::ExitCode;

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use clap::{Parser, Subcommand, ValueEnum};
use collective::barrier::BarrierService;
use collective::devices::DeviceName;
use collective::node::{self, NodeConfig};
use collective::{PeerBackend, single};

#[derive(Parser, Debug)]
#[command(
    about = "Data-parallel training on N processes with burn-collective over burn-caching-alloc"
)]
struct Cli {
    /// The backend the node or single run computes on: wgpu (`CachingWgpu`), or cuda
    /// (`CachingCuda`, when built with the `cuda` feature).
    #[arg(long, global = true, value_enum, default_value_t = BackendName::Wgpu)]
    backend: BackendName,
    #[command(subcommand)]
    command: Command,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum BackendName {
    Wgpu,
    Cuda,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs burn-collective's global orchestrator until Ctrl-C or SIGTERM (one per collective,
    /// on any machine the nodes reach): two of them, on the port and the next, which the
    /// nodes' registration rounds alternate between, and the barrier service the nodes pass
    /// at the end of each round, on the port + 2.
    Orchestrator {
        /// The first of the three ports it listens on (every interface).
        #[arg(long, default_value_t = 3000)]
        port: u16,
    },
    /// Runs one node process: a peer per device, trained with the gradients averaged over
    /// every peer of every node.
    Node(NodeConfig),
    /// Trains the same model on one device, whole batches, no collective: the reference a
    /// node's parameters equal.
    Single {
        /// The device: on wgpu default, cpu, discrete:N, integrated:N, virtual:N; on CUDA
        /// cuda:N or N.
        #[arg(long, default_value = "default")]
        device: String,
        /// Training steps.
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
}

/// A node on backend `B`: its reports, or the error.
fn node_on<B: PeerBackend>(config: &NodeConfig) -> ExitCode
where
    Autodiff<B>: AutodiffBackend<Device = B::Device>,
{
    match node::run::<B>(config) {
        Ok(reports) => {
            reports.iter().for_each(|report| report.print());
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// The one-device reference on backend `B`.
fn single_on<B: PeerBackend>(device: &str, steps: usize) -> ExitCode
where
    Autodiff<B>: AutodiffBackend<Device = B::Device>,
{
    match B::Device::parse(device) {
        Ok(device) => {
            single::run::<B>(&device, steps)
                .iter()
                .for_each(|report| report.print());
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// `--backend cuda` in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn without_cuda() -> ExitCode {
    eprintln!("error: --backend cuda needs the `cuda` feature (cargo build --features cuda)");
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let backend = cli.backend;
    match cli.command {
        Command::Orchestrator { port } => {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(err) => {
                    eprintln!("error: cannot start the async runtime: {err}");
                    return ExitCode::FAILURE;
                }
            };
            let (Some(next), Some(barrier_port)) = (port.checked_add(1), port.checked_add(2))
            else {
                eprintln!(
                    "error: port {port} has no two next ports for the second orchestrator and \
                     the barrier service"
                );
                return ExitCode::FAILURE;
            };
            let barrier = match BarrierService::bind(("0.0.0.0", barrier_port)) {
                Ok(barrier) => barrier,
                Err(err) => {
                    eprintln!("error: cannot listen on port {barrier_port} for the barrier: {err}");
                    return ExitCode::FAILURE;
                }
            };
            barrier.spawn();
            println!(
                "orchestrators on ports {port} and {next}, the nodes' barrier on {barrier_port} \
                 (Ctrl-C stops them)"
            );
            runtime.spawn(burn_collective::start_global_orchestrator(next));
            runtime.block_on(burn_collective::start_global_orchestrator(port));
            ExitCode::SUCCESS
        }
        Command::Node(config) => match backend {
            BackendName::Wgpu => node_on::<collective::Backend>(&config),
            #[cfg(feature = "cuda")]
            BackendName::Cuda => node_on::<collective::CudaBackend>(&config),
            #[cfg(not(feature = "cuda"))]
            BackendName::Cuda => without_cuda(),
        },
        Command::Single { device, steps } => match backend {
            BackendName::Wgpu => single_on::<collective::Backend>(&device, steps),
            #[cfg(feature = "cuda")]
            BackendName::Cuda => single_on::<collective::CudaBackend>(&device, steps),
            #[cfg(not(feature = "cuda"))]
            BackendName::Cuda => without_cuda(),
        },
    }
}
