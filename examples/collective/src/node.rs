//! One node process of the collective: a peer per local device, each on its own thread.
//!
//! Each peer registers with burn-collective (which connects this process to the global
//! orchestrator once every local peer has registered), checks an all-reduce of small
//! integers, trains `steps` steps on its shard of every batch with the gradients averaged over
//! all peers, and unregisters. Peer ids are global: `rank * devices + local index`.
//!
//! With one process (`world_size` 1) only burn-collective's local level runs (no
//! orchestrator): one registration, and Burn's `GradientsParams::all_reduce` (one operation
//! per parameter) every step.
//!
//! With several processes, burn-collective 0.21.0 completes only the first operation between
//! processes of a registration: `SyncService::sync` (`src/global/node/sync.rs`, lines 71-79)
//! compares the nodes that synced with all nodes, then clears a copy of that list
//! (`lock().unwrap().to_vec()`) instead of the list, so from the second sync on the list never
//! equals the nodes again and the operation waits forever. The list lives in the global
//! `Node`, which `finish_collective` drops (with the last local peer) and the next `register`
//! builds anew. So a node of several processes makes one registration per global operation:
//!
//! - each step's gradients go through one all-reduce, flattened into one tensor
//!   ([`crate::flat`]);
//! - each operation (the check, then each step) has its registration round: `register`, the
//!   operation, the barrier between the nodes (below), `finish_collective`, then a barrier
//!   between the local peers, so that no peer registers the next round while another still
//!   belongs to this one (burn-collective's local server would take it for a peer of the
//!   current round);
//! - rounds alternate between two orchestrators (the `--orchestrator` port and the next) and
//!   two data ports (`--port` and the next). burn-collective's orchestrator numbers a node by
//!   the number of nodes registered when it arrives (`src/global/orchestrator/state.rs`,
//!   `register`, line 188), so a node registering round r + 1 while another has not yet finished round r
//!   would take that node's number and both would reduce alone, silently. On the other
//!   orchestrator, round r + 1's registration completes only once every node has registered
//!   it, which each does after its `finish_collective` of round r returned (it waits for the
//!   orchestrator's acknowledgement); round r + 2, back on the first orchestrator, so starts
//!   after every node left round r there. The data port alternates for the same reason:
//!   round r's server stops listening asynchronously after its `finish_collective`;
//! - before that `finish_collective`, every node passes a barrier between the processes
//!   ([`crate::barrier`], served by the `orchestrator` subcommand on its port + 2; one local
//!   peer per node goes, between two local barriers), since `finish_collective` stops the
//!   round's data server while another node may still be downloading from it, which then
//!   waits forever.

use std::str::FromStr;
use std::sync::{Arc, Barrier, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use burn::backend::Autodiff;
use burn::collective::{
    self, AllReduceStrategy, CollectiveConfig, CollectiveError, PeerId, ReduceOperation,
};
use burn::optim::SgdConfig;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::AutodiffBackend;
use burn_communication::Address;

use crate::PeerBackend;
use crate::barrier;
use crate::data::{self, ShardError};
use crate::devices::{DeviceName, DeviceNameError};
use crate::model::Model;
use crate::report::{PeerReport, Report, check_values};
use crate::train::{self, GradientSync};

/// Where this node is and what it trains (the `node` subcommand's options).
#[derive(Debug, Clone, clap::Args)]
pub struct NodeConfig {
    /// The orchestrator's address, `ws://HOST:PORT`. With several processes the orchestrator
    /// listens on PORT and PORT + 1 (registration rounds alternate between the two), and the
    /// nodes meet at its barrier service on HOST, PORT + 2 at the end of each round.
    #[arg(long, default_value = "ws://127.0.0.1:3000")]
    pub orchestrator: String,
    /// This machine's host name or address, as the other nodes reach it.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// This node's port for tensor transfers (listens on every interface; the other nodes
    /// download from it). With several processes it also uses the next port (registration
    /// rounds alternate between the two). The default leaves the orchestrator's three ports
    /// (3000 to 3002) free on its machine.
    #[arg(long, default_value_t = 3003)]
    pub port: u16,
    /// This process's rank, 0 to world size - 1.
    #[arg(long)]
    pub rank: usize,
    /// The number of node processes.
    #[arg(long)]
    pub world_size: usize,
    /// The local devices, comma-separated, one peer each: on wgpu default, cpu, discrete:N,
    /// integrated:N, virtual:N; on CUDA cuda:N or N. Every node must have as many.
    #[arg(long, value_delimiter = ',', default_value = "default")]
    pub devices: Vec<String>,
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
    /// A device name the backend does not have.
    #[error(transparent)]
    Device(#[from] DeviceNameError),
    /// The peers cannot share the batch.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// An address that burn-communication refuses, or whose port has no next port.
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
    /// The barrier between the nodes at the end of a round failed (for a node's every local
    /// peer, the error of the one that went to it).
    #[error("peer {peer}: the barrier between the nodes failed: {why}")]
    Barrier {
        /// The peer that saw it.
        peer: usize,
        /// The barrier's error.
        why: String,
    },
    /// A peer's thread panicked.
    #[error("peer {0}'s thread panicked")]
    Panicked(usize),
}

/// `address` (`scheme://host:port`) with its port moved up by `offset`.
fn port_plus(address: &str, offset: u16) -> Result<String, NodeError> {
    let error = |why: &str| NodeError::Address(address.to_string(), why.to_string());
    let (head, port) = address
        .rsplit_once(':')
        .ok_or_else(|| error("expected scheme://host:port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| error("expected scheme://host:port, the port a number"))?;
    let port = port
        .checked_add(offset)
        .ok_or_else(|| error("the port has no next port"))?;
    Ok(format!("{head}:{port}"))
}

/// How long a node waits at the barrier between the nodes before it gives up: generous, since
/// the nodes arrive within a global operation of one another.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(600);

/// The barrier service's `host:port` for the orchestrator at `address` (`scheme://host:port`):
/// the same host, the port + 2.
fn barrier_address(address: &str) -> Result<String, NodeError> {
    let moved = port_plus(address, 2)?;
    let (_, host_port) = moved.split_once("://").ok_or_else(|| {
        NodeError::Address(address.to_string(), "expected scheme://host:port".into())
    })?;
    Ok(host_port.to_string())
}

/// burn-collective's configurations, the same on every peer of this process.
#[derive(Debug, Clone)]
enum Rounds {
    /// One process: the local level alone (no orchestrator), one registration.
    Local(CollectiveConfig),
    /// Several processes: one registration per global operation.
    Global {
        /// The rounds alternate between these two configurations (the two orchestrator
        /// ports, the two data ports).
        configs: [CollectiveConfig; 2],
        /// The barrier service's `host:port` ([`barrier_address`]).
        barrier: String,
        /// The number of node processes.
        world_size: usize,
    },
}

impl Rounds {
    /// The configuration of registration round `round`.
    fn config(&self, round: usize) -> CollectiveConfig {
        match self {
            Rounds::Local(config) => config.clone(),
            Rounds::Global { configs, .. } => configs[round % 2].clone(),
        }
    }
}

impl NodeConfig {
    /// The number of peers over all processes.
    pub fn peers(&self) -> usize {
        self.world_size * self.devices.len()
    }

    /// burn-collective's configurations: the local level alone for one process, else both
    /// levels with the orchestrator and data ports of each of the two alternating rounds.
    fn rounds(&self) -> Result<Rounds, NodeError> {
        let local = CollectiveConfig::default().with_num_devices(self.devices.len());
        if self.world_size == 1 {
            return Ok(Rounds::Local(local));
        }
        let address = |text: String| {
            Address::from_str(&text).map_err(|why| NodeError::Address(text.clone(), why))
        };
        let round = |offset: u16| -> Result<CollectiveConfig, NodeError> {
            let port = self.port.checked_add(offset).ok_or_else(|| {
                NodeError::Address(self.port.to_string(), "the port has no next port".into())
            })?;
            Ok(local
                .clone()
                .with_num_nodes(self.world_size as u32)
                .with_global_address(address(port_plus(&self.orchestrator, offset)?)?)
                .with_node_address(address(format!("ws://{}:{port}", self.host))?)
                .with_data_service_port(port)
                // Burn's default between processes is the ring, which needs every tensor's
                // largest dimension to be at least the number of processes: the tree takes
                // any shape.
                .with_global_all_reduce_strategy(AllReduceStrategy::Tree(2)))
        };
        Ok(Rounds::Global {
            configs: [round(0)?, round(1)?],
            barrier: barrier_address(&self.orchestrator)?,
            world_size: self.world_size,
        })
    }
}

/// Runs the node on backend `B`; returns each peer's report and each device's memory report,
/// in device order.
///
/// # Errors
///
/// A bad layout, device name or address, burn-collective's errors, and a failed barrier
/// between the nodes.
pub fn run<B: PeerBackend>(config: &NodeConfig) -> Result<Vec<Report>, NodeError>
where
    Autodiff<B>: AutodiffBackend<Device = B::Device>,
{
    if config.rank >= config.world_size || config.devices.is_empty() {
        return Err(NodeError::Layout {
            rank: config.rank,
            world_size: config.world_size,
            devices: config.devices.len(),
        });
    }
    data::check_peers(config.peers())?;
    let devices = config
        .devices
        .iter()
        .map(|name| B::Device::parse(name))
        .collect::<Result<Vec<_>, _>>()?;
    let rounds = config.rounds()?;
    let local_peers = Arc::new(LocalPeers::new(config.devices.len()));
    let handles: Vec<_> = devices
        .iter()
        .enumerate()
        .map(|(local, device)| {
            let peer = config.rank * config.devices.len() + local;
            let (config, rounds, device) = (config.clone(), rounds.clone(), device.clone());
            let local_peers = local_peers.clone();
            let handle =
                thread::spawn(move || run_peer::<B>(&config, &rounds, &local_peers, peer, &device));
            (peer, handle)
        })
        .collect();
    let mut reports = Vec::new();
    for (peer, handle) in handles {
        reports.push(Report::Peer(
            handle.join().map_err(|_| NodeError::Panicked(peer))??,
        ));
    }
    for device in &devices {
        reports.push(Report::memory(config.rank, device));
    }
    Ok(reports)
}

/// What the peers of this process share between rounds: their barrier, and the outcome of the
/// barrier between the nodes, which one of them (the local barrier's leader) goes to.
struct LocalPeers {
    barrier: Barrier,
    /// Why the barrier between the nodes failed, once it has.
    failure: Mutex<Option<String>>,
}

impl LocalPeers {
    fn new(peers: usize) -> Self {
        Self {
            barrier: Barrier::new(peers),
            failure: Mutex::new(None),
        }
    }
}

/// A peer's registrations: one for a process alone, one per global operation otherwise.
struct Registration<'a, B: PeerBackend> {
    peer: usize,
    device: &'a B::Device,
    rounds: &'a Rounds,
    local: &'a LocalPeers,
    /// The next round to register.
    round: usize,
    registered: bool,
}

impl<B: PeerBackend> Registration<'_, B> {
    /// burn-collective's error, as this peer's.
    fn collective(&self, error: CollectiveError) -> NodeError {
        NodeError::Collective {
            peer: self.peer,
            error,
        }
    }

    /// Registers for the next operation, unless still registered from the last one (one
    /// process).
    fn enter(&mut self) -> Result<(), NodeError> {
        if !self.registered {
            let config = self.rounds.config(self.round);
            collective::register::<B>(PeerId::from(self.peer), self.device.clone(), config)
                .map_err(|error| self.collective(error))?;
            self.round += 1;
            self.registered = true;
        }
        Ok(())
    }

    /// Ends the round after a global operation (several processes): once every local peer
    /// has its result, one of them waits at the barrier between the nodes, until every node's
    /// peers have theirs (so no node stops serving a download still under way); then each
    /// unregisters, and waits until every local peer has (burn-collective drops the global
    /// node with the last).
    fn leave(&mut self) -> Result<(), NodeError> {
        let Rounds::Global {
            barrier: address,
            world_size,
            ..
        } = self.rounds
        else {
            return Ok(());
        };
        let failure = || {
            let failure = self.local.failure.lock();
            failure.unwrap_or_else(PoisonError::into_inner).clone()
        };
        if self.local.barrier.wait().is_leader() {
            // The round just registered: `enter` counted it.
            let round = self.round - 1;
            if let Err(err) = barrier::wait(address, *world_size, round, BARRIER_TIMEOUT) {
                let failure = self.local.failure.lock();
                *failure.unwrap_or_else(PoisonError::into_inner) = Some(err.to_string());
            }
        }
        self.local.barrier.wait();
        if let Some(why) = failure() {
            return Err(NodeError::Barrier {
                peer: self.peer,
                why,
            });
        }
        self.finish()?;
        self.local.barrier.wait();
        Ok(())
    }

    /// Unregisters, if registered.
    fn finish(&mut self) -> Result<(), NodeError> {
        if self.registered {
            self.registered = false;
            collective::finish_collective::<B>(PeerId::from(self.peer))
                .map_err(|error| self.collective(error))?;
        }
        Ok(())
    }
}

/// One peer: the all-reduce check, training, each in its registration round(s).
fn run_peer<B: PeerBackend>(
    config: &NodeConfig,
    rounds: &Rounds,
    local: &LocalPeers,
    peer: usize,
    device: &B::Device,
) -> Result<PeerReport, NodeError>
where
    Autodiff<B>: AutodiffBackend<Device = B::Device>,
{
    let id = PeerId::from(peer);
    let peers = config.peers();
    let collective = |error| NodeError::Collective { peer, error };
    let mut registration = Registration::<B> {
        peer,
        device,
        rounds,
        local,
        round: 0,
        registered: false,
    };

    registration.enter()?;
    let input = Tensor::<B, 1>::from_floats(check_values(peer).as_slice(), device);
    let summed =
        collective::all_reduce::<B>(id, input.into_primitive().tensor(), ReduceOperation::Sum)
            .map_err(collective)?;
    let all_reduce = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(summed))
        .into_data()
        .to_vec::<f32>()
        .expect("f32 tensor");
    registration.leave()?;

    let sync = match rounds {
        Rounds::Local(_) => GradientSync::PerParameter(id),
        Rounds::Global { .. } => GradientSync::Flattened(id),
    };
    let mut model = Model::<Autodiff<B>>::new(device);
    let mut optim = SgdConfig::new().init();
    let mut losses = Vec::with_capacity(config.steps);
    for step in 0..config.steps {
        let shard = data::shard(step, peer, peers).expect("checked before the peers started");
        registration.enter()?;
        let (next, loss) =
            train::step::<B>(model, &mut optim, &shard, device, sync).map_err(collective)?;
        registration.leave()?;
        model = next;
        losses.push(loss);
        println!(
            "rank {} peer {peer} step {} shard loss {loss}",
            config.rank,
            step + 1
        );
    }
    let params = model.values();
    registration.finish()?;
    Ok(PeerReport {
        rank: config.rank,
        peer,
        device: format!("{device:?}"),
        all_reduce,
        losses,
        params,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_port_of_an_address() {
        assert_eq!(
            port_plus("ws://10.0.0.1:3000", 1).unwrap(),
            "ws://10.0.0.1:3001"
        );
        assert_eq!(port_plus("ws://[::1]:80", 0).unwrap(), "ws://[::1]:80");
        for bad in ["ws://host", "ws://host:x", "ws://host:65535"] {
            assert!(
                matches!(port_plus(bad, 1), Err(NodeError::Address(..))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_barrier_service_of_an_orchestrator() {
        assert_eq!(
            barrier_address("ws://10.0.0.1:3000").unwrap(),
            "10.0.0.1:3002"
        );
        assert_eq!(barrier_address("ws://[::1]:80").unwrap(), "[::1]:82");
        for bad in ["10.0.0.1:3000", "ws://host:65534", "ws://host"] {
            assert!(
                matches!(barrier_address(bad), Err(NodeError::Address(..))),
                "{bad}"
            );
        }
    }
}
