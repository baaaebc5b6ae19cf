//! One node process of the collective: a peer per local device, each on its own thread.
//!
//! Each peer registers with burn-collective (which connects this process to the global
//! orchestrator once every local peer has registered), checks an all-reduce of small
//! integers, trains `steps` steps on its shard of every batch with the gradients averaged over
//! all peers, and unregisters. Peer ids are global: `rank * devices + local index`.
//!
//! With one process (`world_size` 1) only burn-collective's local level runs (no
//! orchestrator). With several, burn-collective 0.21.0 completes one operation between
//! processes and hangs at the second: `SyncService::sync` compares the nodes that synced with
//! all nodes, then clears a copy of that list instead of the list, so from the second sync on
//! the list never equals the nodes again. A training step makes one all-reduce per parameter,
//! so a node with several processes refuses to train ([`NodeError::GlobalTraining`]) and runs
//! the all-reduce check alone.

use std::str::FromStr;
use std::thread;

use burn::backend::wgpu::WgpuDevice;
use burn::collective::{
    self, AllReduceStrategy, CollectiveConfig, CollectiveError, PeerId, ReduceOperation,
};
use burn::optim::SgdConfig;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_communication::Address;

use crate::data::{self, ShardError};
use crate::model::Model;
use crate::report::{PeerReport, Report, check_values};
use crate::{Backend, train};

/// Where this node is and what it trains (the `node` subcommand's options).
#[derive(Debug, Clone, clap::Args)]
pub struct NodeConfig {
    /// The orchestrator's address.
    #[arg(long, default_value = "ws://127.0.0.1:3000")]
    pub orchestrator: String,
    /// This machine's host name or address, as the other nodes reach it.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// This node's port for tensor transfers (listens on every interface; the other nodes
    /// download from it).
    #[arg(long, default_value_t = 3001)]
    pub port: u16,
    /// This process's rank, 0 to world size - 1.
    #[arg(long)]
    pub rank: usize,
    /// The number of node processes.
    #[arg(long)]
    pub world_size: usize,
    /// The local devices, comma-separated, one peer each: default, cpu, discrete:N,
    /// integrated:N, virtual:N. Every node must have as many.
    #[arg(long, value_delimiter = ',', default_value = "default", value_parser = crate::devices::parse)]
    pub devices: Vec<WgpuDevice>,
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
}

/// Why a node stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The rank is not below the world size, or there is no device.
    #[error(
        "rank {rank} with world size {world_size} and {devices} device(s): the rank must be below the world size and there must be a device"
    )]
    Layout {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
        /// The number of devices given.
        devices: usize,
    },
    /// The peers cannot share the batch.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// An address that burn-communication refuses.
    #[error("bad address {0:?}: {1}")]
    Address(String, String),
    /// burn-collective's error (it has no `Display`).
    #[error("peer {peer}: burn-collective failed: {error:?}")]
    Collective {
        /// The peer that saw it.
        peer: usize,
        /// burn-collective's error.
        error: CollectiveError,
    },
    /// Training over several processes, which burn-collective 0.21.0 cannot finish.
    #[error(
        "burn-collective 0.21.0 runs one collective operation between processes, then hangs at \
         the second (its SyncService never clears the list of nodes that synced), and a training \
         step makes one per parameter: with a world size of {0}, run --steps 0 (the all-reduce \
         check alone), or train on several devices of one process (--world-size 1)"
    )]
    GlobalTraining(usize),
    /// A peer's thread panicked.
    #[error("peer {0}'s thread panicked")]
    Panicked(usize),
}

impl NodeConfig {
    /// The number of peers over all processes.
    pub fn peers(&self) -> usize {
        self.world_size * self.devices.len()
    }

    /// burn-collective's configuration, the same on every peer of this process: the local
    /// level alone for one process (no orchestrator), else both levels.
    fn collective(&self) -> Result<CollectiveConfig, NodeError> {
        let local = CollectiveConfig::default().with_num_devices(self.devices.len());
        if self.world_size == 1 {
            return Ok(local);
        }
        let address = |text: String| {
            Address::from_str(&text).map_err(|why| NodeError::Address(text.clone(), why))
        };
        Ok(local
            .with_num_nodes(self.world_size as u32)
            .with_global_address(address(self.orchestrator.clone())?)
            .with_node_address(address(format!("ws://{}:{}", self.host, self.port))?)
            .with_data_service_port(self.port)
            // Burn's default between processes is the ring, which needs every tensor's largest
            // dimension to be at least the number of processes (a bias of size 1 is not):
            // the tree takes any shape.
            .with_global_all_reduce_strategy(AllReduceStrategy::Tree(2)))
    }
}

/// Runs the node; returns each peer's report and each device's memory report, in device
/// order.
pub fn run(config: &NodeConfig) -> Result<Vec<Report>, NodeError> {
    if config.rank >= config.world_size || config.devices.is_empty() {
        return Err(NodeError::Layout {
            rank: config.rank,
            world_size: config.world_size,
            devices: config.devices.len(),
        });
    }
    data::check_peers(config.peers())?;
    if config.world_size > 1 && config.steps > 0 {
        return Err(NodeError::GlobalTraining(config.world_size));
    }
    let collective = config.collective()?;
    let handles: Vec<_> = config
        .devices
        .iter()
        .enumerate()
        .map(|(local, device)| {
            let peer = config.rank * config.devices.len() + local;
            let (config, collective, device) = (config.clone(), collective.clone(), device.clone());
            let handle = thread::spawn(move || {
                run_peer(&config, collective, peer, &device)
                    .map_err(|error| NodeError::Collective { peer, error })
            });
            (peer, handle)
        })
        .collect();
    let mut reports = Vec::new();
    for (peer, handle) in handles {
        reports.push(Report::Peer(
            handle.join().map_err(|_| NodeError::Panicked(peer))??,
        ));
    }
    for device in &config.devices {
        reports.push(Report::memory(config.rank, device));
    }
    Ok(reports)
}

/// One peer: register, the all-reduce check, training, unregister.
fn run_peer(
    config: &NodeConfig,
    collective: CollectiveConfig,
    peer: usize,
    device: &WgpuDevice,
) -> Result<PeerReport, CollectiveError> {
    let id = PeerId::from(peer);
    let peers = config.peers();
    collective::register::<Backend>(id, device.clone(), collective)?;

    let input = Tensor::<Backend, 1>::from_floats(check_values(peer).as_slice(), device);
    let summed = collective::all_reduce::<Backend>(
        id,
        input.into_primitive().tensor(),
        ReduceOperation::Sum,
    )?;
    let all_reduce = Tensor::<Backend, 1>::from_primitive(TensorPrimitive::Float(summed))
        .into_data()
        .to_vec::<f32>()
        .expect("f32 tensor");

    let mut model = Model::new(device);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::with_capacity(config.steps);
    for step in 0..config.steps {
        let shard = data::shard(step, peer, peers).expect("checked before the peers started");
        let (next, loss) = train::step(model, &mut optim, &shard, device, Some(id))?;
        model = next;
        losses.push(loss);
        println!(
            "rank {} peer {peer} step {} shard loss {loss}",
            config.rank,
            step + 1
        );
    }
    let params = model.values();
    collective::finish_collective::<Backend>(id)?;
    Ok(PeerReport {
        rank: config.rank,
        peer,
        device: format!("{device:?}"),
        all_reduce,
        losses,
        params,
    })
}
