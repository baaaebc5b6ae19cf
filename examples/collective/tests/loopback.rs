//! burn-collective across processes on one machine: the global orchestrator and node
//! processes on 127.0.0.1 (free ports), each on `CachingWgpu` under lavapipe in CI, spawned from
//! this crate's own binary.
//!
//! - two processes with one device each: the processes meet only at burn-collective's global
//!   level (WebSocket; each node reads its tensor to the host and writes what it downloads);
//! - two processes with two devices each, the all-reduce and training: the local level too,
//!   where burn-collective moves tensors between the two devices with `to_device` (the caching
//!   backend's `send`/`recv`), and the local peers' barrier between registration rounds;
//! - one process with two devices, training: `GradientsParams::all_reduce` at the local level;
//! - two processes with one device each, training: one registration round per global
//!   operation (the check, then each step), the step's gradients flattened into one
//!   all-reduce (`collective::flat`), rounds alternating between two orchestrators and two
//!   data ports per node; two steps, so the third round is back on the first orchestrator and
//!   port. Each round ends with the nodes' barrier (the orchestrator process's service on its
//!   port + 2), without which a node could stop serving while the other still downloads from
//!   it, and that one would wait forever.
//!
//! Asserted: the all-reduce of small-integer floats equals their sum exactly on every peer;
//! where the run trains, every peer's parameters after the steps equal those of the one-process
//! run (`single`) on the same batches bit for bit (the data and weights are exact in f32; see
//! `collective::data`), and the peers' shard losses average to its loss. Each process prints
//! its memory statistics; the test prints the per-process peaks.
//!
//! Across processes the node works around burn-collective 0.21.0, which completes only one
//! operation between processes per registration (see `collective::node`).
//!
//! Bounded: every process is killed when the test ends, passed or failed, and a case fails
//! after `DEADLINE` (generous: two cores, lavapipe, several processes compiling kernels).

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use burn::backend::wgpu::WgpuDevice;
use burn_caching_alloc::wgpu::adapter_available;
use collective::report::{MemoryReport, PeerReport, Report, check_values};

/// The longest a case may take, all processes together.
const DEADLINE: Duration = Duration::from_secs(300);
/// Steps the training case trains.
const STEPS: usize = 2;

/// The cases run one at a time: each starts three processes on a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `CI` set to anything but empty, `0` or `false`.
fn is_ci() -> bool {
    std::env::var_os("CI").is_some_and(|value| {
        let value = value.to_string_lossy();
        let value = value.trim();
        !(value.is_empty() || value == "0" || value.eq_ignore_ascii_case("false"))
    })
}

/// Whether the wgpu CPU adapter (lavapipe) is here; without it the test skips, or fails in CI.
fn cpu_adapter() -> bool {
    if adapter_available(&WgpuDevice::Cpu) {
        return true;
    }
    assert!(
        !is_ci(),
        "no wgpu CPU adapter (install mesa-vulkan-drivers for lavapipe); CI is set, which makes \
         this a failure"
    );
    eprintln!("skipping: no wgpu CPU adapter (install mesa-vulkan-drivers for lavapipe)");
    false
}

/// For each of `widths`, a port nobody listens on now with the `width - 1` next ones free too
/// (each node uses a port and the next; the orchestrator a port and the next two), none
/// shared: the OS picks the first port of each run, and every run is held until all are found
/// (released before the processes bind them).
fn free_port_runs(widths: &[u16]) -> Vec<u16> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for &width in widths {
        loop {
            let first = TcpListener::bind("0.0.0.0:0").expect("bind a port");
            let port = first.local_addr().expect("local address").port();
            let rest: Option<Vec<TcpListener>> = (1..width)
                .map(|offset| {
                    let next = port.checked_add(offset)?;
                    TcpListener::bind(("0.0.0.0", next)).ok()
                })
                .collect();
            if let Some(rest) = rest {
                held.push(first);
                held.extend(rest);
                ports.push(port);
                break;
            }
        }
    }
    ports
}

/// A private, empty folder for `XDG_RUNTIME_DIR` (libwayland wants an existing one).
fn runtime_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("collective-loopback-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    }
    dir
}

/// A process of the run: killed on drop if still running, its output collected by a thread.
struct Process {
    name: String,
    child: Child,
    output: Option<JoinHandle<String>>,
}

impl Process {
    fn spawn(name: &str, args: &[String]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_collective"))
            .args(args)
            // Autotuning compiles and times every kernel variant on first use: minutes on
            // lavapipe in a debug build, for matmuls of a few rows.
            .env("CUBECL_AUTOTUNE_LEVEL", "minimal")
            // Mesa's device-select layer asks Wayland about devices; without a runtime
            // folder libwayland prints an error per enumeration (harmless, but noise).
            .env("XDG_RUNTIME_DIR", runtime_dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {name}: {err}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        let label = name.to_string();
        let output = thread::spawn(move || {
            // stderr on its own thread, so that neither pipe fills while the other is read.
            let errors = thread::spawn(move || {
                let mut text = String::new();
                let _ = stderr.read_to_string(&mut text);
                text
            });
            let mut text = String::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                println!("[{label}] {line}");
                text.push_str(&line);
                text.push('\n');
            }
            let errors = errors.join().unwrap_or_default();
            for line in errors.lines() {
                println!("[{label} stderr] {line}");
            }
            text
        });
        Self {
            name: name.to_string(),
            child,
            output: Some(output),
        }
    }

    /// Waits for the process to exit by `deadline`; its stdout. Panics (and the drops kill
    /// every process) on a failure or past the deadline.
    fn finish(mut self, deadline: Instant) -> String {
        loop {
            match self.child.try_wait().expect("wait for a child") {
                Some(status) => {
                    let output = self.output.take().expect("read once").join();
                    let output = output.expect("the output reader");
                    assert!(status.success(), "{} failed: {status}", self.name);
                    return output;
                }
                None if Instant::now() >= deadline => {
                    panic!("{} still running after {DEADLINE:?}: killed", self.name)
                }
                None => thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn reports(output: &str) -> Vec<Report> {
    output.lines().filter_map(Report::parse).collect()
}

fn peers(reports: &[Report]) -> Vec<PeerReport> {
    let peers = reports.iter().filter_map(|report| match report {
        Report::Peer(peer) => Some(peer.clone()),
        Report::Memory(_) => None,
    });
    peers.collect()
}

fn memory(reports: &[Report]) -> Vec<MemoryReport> {
    let memory = reports.iter().filter_map(|report| match report {
        Report::Memory(memory) => Some(memory.clone()),
        Report::Peer(_) => None,
    });
    memory.collect()
}

/// `world` nodes with `devices` each (and the orchestrator for more than one) training `steps`
/// steps, then the one-process reference; checks every peer's all-reduce, and its parameters
/// and losses where it trained.
fn run_case(world: usize, devices: &str, steps: usize) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let deadline = Instant::now() + DEADLINE;
    // Two ports per node, then three for the orchestrator process (its two orchestrators and
    // the nodes' barrier).
    let mut widths = vec![2; world];
    widths.push(3);
    let ports = free_port_runs(&widths);
    let orchestrator_port = ports[world];
    let orchestrator = (world > 1).then(|| {
        let args = [
            "orchestrator".into(),
            "--port".into(),
            orchestrator_port.to_string(),
        ];
        Process::spawn("orchestrator", &args)
    });
    let nodes: Vec<Process> = (0..world)
        .map(|rank| {
            let args = [
                "node",
                "--orchestrator",
                &format!("ws://127.0.0.1:{orchestrator_port}"),
                "--host",
                "127.0.0.1",
                "--port",
                &ports[rank].to_string(),
                "--rank",
                &rank.to_string(),
                "--world-size",
                &world.to_string(),
                "--devices",
                devices,
                "--steps",
                &steps.to_string(),
            ];
            let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
            Process::spawn(&format!("node {rank}"), &args)
        })
        .collect();
    let outputs: Vec<String> = nodes
        .into_iter()
        .map(|node| node.finish(deadline))
        .collect();
    drop(orchestrator);
    // The reference after the nodes, so that it never competes with them for the cores.
    let single = Process::spawn(
        "single",
        &[
            "single".into(),
            "--device".into(),
            "cpu".into(),
            "--steps".into(),
            steps.to_string(),
        ],
    )
    .finish(deadline);

    let single = reports(&single);
    let reference = peers(&single).pop().expect("the one-process run's report");
    let per_node = devices.split(',').count();
    let total = world * per_node;
    let mut all_peers = Vec::new();
    for (rank, output) in outputs.iter().enumerate() {
        let reports = reports(output);
        let found = peers(&reports);
        assert_eq!(found.len(), per_node, "node {rank}: one report per device");
        for memory in memory(&reports) {
            println!(
                "node {rank} {}: peak allocated {} B, peak reserved {} B, reserved at the end {} B",
                memory.device, memory.peak_allocated, memory.peak_reserved, memory.reserved
            );
            assert!(
                memory.peak_allocated > 0,
                "node {rank} allocated through the engine"
            );
        }
        all_peers.extend(found);
    }
    for memory in memory(&single) {
        println!(
            "single {}: peak allocated {} B, peak reserved {} B",
            memory.device, memory.peak_allocated, memory.peak_reserved
        );
    }
    all_peers.sort_by_key(|peer| peer.peer);
    assert_eq!(
        all_peers.iter().map(|peer| peer.peer).collect::<Vec<_>>(),
        (0..total).collect::<Vec<_>>()
    );

    let expected_sum: Vec<f32> = (0..24)
        .map(|i| (0..total).map(|peer| check_values(peer)[i]).sum())
        .collect();
    for peer in &all_peers {
        assert_eq!(
            peer.all_reduce, expected_sum,
            "peer {}: the all-reduce",
            peer.peer
        );
        assert_eq!(
            peer.params, reference.params,
            "peer {}: parameters after {steps} steps against the one-process run",
            peer.peer
        );
    }
    // Each peer's loss is its shard's mean; the shards are equal, so their mean is the whole
    // batch's, exactly (the values are small multiples of powers of two).
    for step in 0..steps {
        let mean = all_peers.iter().map(|peer| peer.losses[step]).sum::<f32>() / total as f32;
        assert_eq!(
            mean, reference.losses[step],
            "step {step}: mean of the shard losses"
        );
    }
}

#[test]
fn two_processes_one_device_each_all_reduce_to_the_exact_sum() {
    if cpu_adapter() {
        run_case(2, "cpu", 0);
    }
}

#[test]
fn two_processes_two_devices_each_all_reduce_and_train_as_one_device() {
    if cpu_adapter() {
        run_case(2, "cpu,default", STEPS);
    }
}

#[test]
fn two_processes_one_device_each_train_as_one_device() {
    if cpu_adapter() {
        run_case(2, "cpu", STEPS);
    }
}

#[test]
fn one_process_two_devices_trains_as_one_device() {
    if cpu_adapter() {
        run_case(1, "cpu,default", STEPS);
    }
}
