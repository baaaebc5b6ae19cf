//! The command line: `orchestrator` (burn-collective's global orchestrator), `node` (one
//! training process of the collective) and `single` (the same training in one process, the
//! reference). `--help` on each says what it takes; docs/src/several-devices.md has the commands
//! for two machines.

use std::process::ExitCode;

use burn::backend::wgpu::WgpuDevice;
use clap::{Parser, Subcommand};
use collective::node::{self, NodeConfig};
use collective::{devices, single};

#[derive(Parser, Debug)]
#[command(about = "Data-parallel training on N processes with burn-collective over CachingWgpu")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs burn-collective's global orchestrator until Ctrl-C or SIGTERM (one per collective,
    /// on any machine the nodes reach): two of them, on the port and the next, which the
    /// nodes' registration rounds alternate between.
    Orchestrator {
        /// The first of the two ports it listens on (every interface).
        #[arg(long, default_value_t = 3000)]
        port: u16,
    },
    /// Runs one node process: a peer per device, trained with the gradients averaged over
    /// every peer of every node.
    Node(NodeConfig),
    /// Trains the same model on one device, whole batches, no collective: the reference a
    /// node's parameters equal.
    Single {
        /// The device: default, cpu, discrete:N, integrated:N, virtual:N.
        #[arg(long, default_value = "default", value_parser = devices::parse)]
        device: WgpuDevice,
        /// Training steps.
        #[arg(long, default_value_t = 20)]
        steps: usize,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
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
            let Some(next) = port.checked_add(1) else {
                eprintln!("error: port {port} has no next port for the second orchestrator");
                return ExitCode::FAILURE;
            };
            println!("orchestrators on ports {port} and {next} (Ctrl-C stops them)");
            runtime.spawn(burn_collective::start_global_orchestrator(next));
            runtime.block_on(burn_collective::start_global_orchestrator(port));
            ExitCode::SUCCESS
        }
        Command::Node(config) => match node::run(&config) {
            Ok(reports) => {
                reports.iter().for_each(|report| report.print());
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::FAILURE
            }
        },
        Command::Single { device, steps } => {
            single::run(&device, steps)
                .iter()
                .for_each(|report| report.print());
            ExitCode::SUCCESS
        }
    }
}
