//! The fake's configuration, read once from the environment when the library is first used.
//!
//! Every variable is optional; lists are per device (the last value repeats for the rest).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `FAKE_CUDA_DEVICES` | number of devices | 1 |
//! | `FAKE_CUDA_MEMORY` | bytes per device, suffixes K/M/G, e.g. `8G,64M` | `4G` |
//! | `FAKE_CUDA_VMM` | virtual memory management supported, `1`/`0` per device | `1` |
//! | `FAKE_CUDA_GRANULARITY` | `cuMemGetAllocationGranularity`'s answer | `2M` |
//! | `FAKE_CUDA_PEER` | who may access whom: `all`, `none`, or pairs `0>1,1>0` | `all` |
//! | `FAKE_CUDA_CC` | compute capability, `major.minor` | `8.0` |
//! | `FAKE_CUDA_FAIL` | fault injection: `name@N` fails the Nth call, `name@N+` that call and every one after, `=code` the result (default: out of memory for memory calls, internal error for NVRTC, else unknown) | none |
//! | `FAKE_CUDA_SCHEDULE` | `eager`, `delayed` or `random` | `random` |
//! | `FAKE_CUDA_SEED` | the scheduler's seed | 1 |
//! | `FAKE_CUDA_VIOLATIONS` | a file every contract violation is appended to | none |
//! | `FAKE_CUDA_LEAKS` | where the at-exit report of what was never freed goes: a file, or `stderr` | none |
//! | `FAKE_NCCL_COMM_BYTES` | device memory each communicator of `ncclCommInitAll` takes (NCCL's own buffers), suffixes K/M/G; without room on a device the call fails with `ncclUnhandledCudaError`; freed when the communicator is destroyed or aborted | 0 |
//! | `FAKE_CUDA_DEADLOCK_SECS` | how long a synchronisation may wait for work no thread can make ready | 30 |

use std::env;

/// How ready work on different streams is ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Work runs as soon as it is ready, at the call that queued it.
    Eager,
    /// Work runs only when a synchronisation, a query or a free needs it done.
    Delayed,
    /// At every call a seeded coin decides which ready streams run, and how far.
    Random,
}

impl Schedule {
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "eager" => Some(Self::Eager),
            "delayed" | "lazy" => Some(Self::Delayed),
            "random" => Some(Self::Random),
            _ => None,
        }
    }

    pub fn from_code(code: i32) -> Option<Self> {
        match code {
            0 => Some(Self::Eager),
            1 => Some(Self::Delayed),
            2 => Some(Self::Random),
            _ => None,
        }
    }
}

/// One injected fault: the `nth` call (1-based) of `name` fails with `code`, and with `sticky`
/// every later call too.
#[derive(Debug, Clone)]
pub struct Fault {
    pub name: String,
    pub nth: u64,
    pub sticky: bool,
    pub code: u32,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub devices: usize,
    pub memory: Vec<u64>,
    pub vmm: Vec<bool>,
    pub granularity: u64,
    /// `peer[a][b]`: device a may access device b's memory once enabled.
    pub peer: Vec<Vec<bool>>,
    pub compute_capability: (i32, i32),
    pub faults: Vec<Fault>,
    pub schedule: Schedule,
    pub seed: u64,
    pub violations_file: Option<String>,
    pub leaks: Option<String>,
    pub deadlock_secs: u64,
    pub nccl_comm_bytes: u64,
}

/// `4G`, `64M`, `512K`, `1000`.
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, scale) = match text.chars().last()? {
        'k' | 'K' => (&text[..text.len() - 1], 1u64 << 10),
        'm' | 'M' => (&text[..text.len() - 1], 1 << 20),
        'g' | 'G' => (&text[..text.len() - 1], 1 << 30),
        't' | 'T' => (&text[..text.len() - 1], 1 << 40),
        _ => (text, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(scale)
}

/// The default result of an injected fault of `name`.
pub fn default_fault_code(name: &str) -> u32 {
    if name.starts_with("nvrtc") {
        // NVRTC_ERROR_INTERNAL_ERROR
        return 11;
    }
    if name.starts_with("cuMem") || name.starts_with("nccl") {
        if name.starts_with("nccl") {
            1
        } else {
            crate::codes::OUT_OF_MEMORY
        }
    } else {
        crate::codes::UNKNOWN
    }
}

/// `name@N`, `name@N+`, either with `=code`.
pub fn parse_fault(text: &str) -> Option<Fault> {
    let (spec, code) = match text.split_once('=') {
        Some((spec, code)) => (spec, Some(code.trim().parse::<u32>().ok()?)),
        None => (text, None),
    };
    let (name, when) = spec.split_once('@')?;
    let name = name.trim().to_string();
    let (nth, sticky) = match when.trim().strip_suffix('+') {
        Some(nth) => (nth.trim().parse().ok()?, true),
        None => (when.trim().parse().ok()?, false),
    };
    let code = code.unwrap_or_else(|| default_fault_code(&name));
    Some(Fault {
        name,
        nth,
        sticky,
        code,
    })
}

fn per_device<T: Clone>(
    text: Option<String>,
    parse: impl Fn(&str) -> Option<T>,
    default: T,
    n: usize,
) -> Vec<T> {
    let mut values: Vec<T> = text
        .map(|text| text.split(',').filter_map(parse).collect())
        .unwrap_or_default();
    if values.is_empty() {
        values.push(default);
    }
    while values.len() < n {
        values.push(values.last().expect("one value").clone());
    }
    values.truncate(n.max(1));
    values
}

fn var(name: &str) -> Option<String> {
    env::var(name).ok().filter(|value| !value.trim().is_empty())
}

impl Config {
    pub fn from_env() -> Self {
        let devices = var("FAKE_CUDA_DEVICES")
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(1usize);
        let memory = per_device(var("FAKE_CUDA_MEMORY"), parse_size, 4 << 30, devices);
        let vmm = per_device(
            var("FAKE_CUDA_VMM"),
            |part| match part.trim() {
                "1" | "true" | "yes" => Some(true),
                "0" | "false" | "no" => Some(false),
                _ => None,
            },
            true,
            devices,
        );
        let granularity = var("FAKE_CUDA_GRANULARITY")
            .and_then(|value| parse_size(&value))
            .filter(|value| value.is_power_of_two())
            .unwrap_or(2 << 20);
        let peer_text = var("FAKE_CUDA_PEER").unwrap_or_else(|| "all".to_string());
        let mut peer = vec![vec![false; devices]; devices];
        match peer_text.trim() {
            "all" => {
                for (a, row) in peer.iter_mut().enumerate() {
                    for (b, cell) in row.iter_mut().enumerate() {
                        *cell = a != b;
                    }
                }
            }
            "none" => {}
            pairs => {
                for pair in pairs.split(',') {
                    if let Some((a, b)) = pair.split_once('>')
                        && let (Ok(a), Ok(b)) =
                            (a.trim().parse::<usize>(), b.trim().parse::<usize>())
                        && a < devices
                        && b < devices
                        && a != b
                    {
                        peer[a][b] = true;
                    }
                }
            }
        }
        let compute_capability = var("FAKE_CUDA_CC")
            .and_then(|value| {
                let (major, minor) = value.split_once('.')?;
                Some((major.trim().parse().ok()?, minor.trim().parse().ok()?))
            })
            .unwrap_or((8, 0));
        let faults = var("FAKE_CUDA_FAIL")
            .map(|value| value.split(',').filter_map(parse_fault).collect())
            .unwrap_or_default();
        let schedule = var("FAKE_CUDA_SCHEDULE")
            .and_then(|value| Schedule::parse(&value))
            .unwrap_or(Schedule::Random);
        let seed = var("FAKE_CUDA_SEED")
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(1);
        Self {
            devices,
            memory,
            vmm,
            granularity,
            peer,
            compute_capability,
            faults,
            schedule,
            seed,
            violations_file: var("FAKE_CUDA_VIOLATIONS"),
            leaks: var("FAKE_CUDA_LEAKS"),
            deadlock_secs: var("FAKE_CUDA_DEADLOCK_SECS")
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(30),
            nccl_comm_bytes: var("FAKE_NCCL_COMM_BYTES")
                .and_then(|value| parse_size(&value))
                .unwrap_or(0),
        }
    }
}
