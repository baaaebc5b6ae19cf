//! A barrier between the node processes, served next to the orchestrators (port + 2): every
//! node passes it after a registration round's global operation and before
//! `finish_collective`, so that no node stops serving its tensors while another may still be
//! downloading them (burn-collective's `finish_collective` stops the round's data server
//! without waiting for the other nodes; see [`crate::node`]).
//!
//! Plain TCP, one connection per node and barrier, one line each way (UTF-8, `\n`-terminated):
//!
//! - the node sends `wait WORLD_SIZE ROUND`, two decimal numbers, the world size at least 1;
//! - the service holds the connection until as many live connections wait on the same
//!   (world size, round) as the world size, then answers each `go` and closes it;
//! - to a line it cannot read (not that form, longer than [`MAX_LINE`] bytes, or not sent
//!   within [`REQUEST_TIMEOUT`]) it answers `error WHY` and closes.
//!
//! A waiting connection that its node closed no longer counts (the service checks the waiters
//! of a (world size, round) whenever another arrives). Once released, a (world size, round)
//! is forgotten, so a later collective on the same service can count its rounds from 0 again;
//! two collectives at once on one service are not told apart, as with burn-collective's
//! orchestrator. The node's side, [`wait`], gives up after its timeout with an error.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// The longest request line the service reads, `\n` included.
pub const MAX_LINE: u64 = 128;
/// How long the service waits for a connection's request line.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a node did not pass the barrier.
#[derive(Debug, thiserror::Error)]
pub enum BarrierError {
    /// The service's address does not resolve, or no connection to it.
    #[error("cannot reach the barrier service at {address} (the orchestrator's port + 2): {why}")]
    Connect {
        /// The address tried, `host:port`.
        address: String,
        /// The last failure.
        why: String,
    },
    /// Nothing came back before the deadline.
    #[error("no answer from the barrier service at {address} within {timeout:?}")]
    TimedOut {
        /// The service's address.
        address: String,
        /// The node's timeout.
        timeout: Duration,
    },
    /// The connection failed or closed before the answer.
    #[error("the barrier service at {address} dropped the connection: {why}")]
    Lost {
        /// The service's address.
        address: String,
        /// What failed.
        why: String,
    },
    /// The service refused the request (`error WHY`), or answered something else than `go`.
    #[error("the barrier service at {address} answered {answer:?}")]
    Refused {
        /// The service's address.
        address: String,
        /// Its answer line.
        answer: String,
    },
}

/// Waits at the barrier of `round` for `world_size` nodes, at the service at `address`
/// (`host:port`); returns once every node has arrived, or fails after `timeout` in all.
///
/// # Errors
///
/// The service unreachable, silent until `timeout`, gone, or refusing the request.
pub fn wait(
    address: &str,
    world_size: usize,
    round: usize,
    timeout: Duration,
) -> Result<(), BarrierError> {
    let deadline = Instant::now() + timeout;
    let lost = |err: io::Error| {
        if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            BarrierError::TimedOut {
                address: address.to_string(),
                timeout,
            }
        } else {
            BarrierError::Lost {
                address: address.to_string(),
                why: err.to_string(),
            }
        }
    };
    let stream = connect(address, deadline)?;
    // Zero is not a valid timeout: past the deadline, wait a millisecond more.
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    stream.set_write_timeout(Some(left())).map_err(lost)?;
    (&stream)
        .write_all(format!("wait {world_size} {round}\n").as_bytes())
        .map_err(lost)?;
    stream.set_read_timeout(Some(left())).map_err(lost)?;
    let mut answer = String::new();
    let read = BufReader::new((&stream).take(MAX_LINE))
        .read_line(&mut answer)
        .map_err(lost)?;
    if read == 0 {
        return Err(lost(io::Error::new(
            ErrorKind::UnexpectedEof,
            "closed without an answer",
        )));
    }
    match answer.trim_end() {
        "go" => Ok(()),
        other => Err(BarrierError::Refused {
            address: address.to_string(),
            answer: other.to_string(),
        }),
    }
}

/// A connection to `address`, trying each of its socket addresses until `deadline`.
fn connect(address: &str, deadline: Instant) -> Result<TcpStream, BarrierError> {
    let failed = |why: String| BarrierError::Connect {
        address: address.to_string(),
        why,
    };
    let addresses = address
        .to_socket_addrs()
        .map_err(|err| failed(err.to_string()))?;
    let mut why = "the address resolves to nothing".to_string();
    for socket in addresses {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            why = "timed out".into();
            break;
        }
        match TcpStream::connect_timeout(&socket, left) {
            Ok(stream) => return Ok(stream),
            Err(err) => why = format!("{socket}: {err}"),
        }
    }
    Err(failed(why))
}

/// The connections waiting at each (world size, round).
type Waiting = Arc<Mutex<HashMap<(usize, usize), Vec<TcpStream>>>>;

/// The barrier service: a listener and the connections waiting at each barrier.
#[derive(Debug)]
pub struct BarrierService {
    listener: TcpListener,
}

impl BarrierService {
    /// Listens on `address` (for example `0.0.0.0:3002`, or port 0 for any free port).
    ///
    /// # Errors
    ///
    /// The address cannot be bound.
    pub fn bind(address: impl ToSocketAddrs) -> io::Result<Self> {
        Ok(Self {
            listener: TcpListener::bind(address)?,
        })
    }

    /// The address it listens on.
    ///
    /// # Errors
    ///
    /// The OS's.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves forever: a thread per connection. A failed `accept` is reported on stderr and
    /// the service goes on.
    pub fn run(self) {
        let waiting = Waiting::default();
        for stream in self.listener.incoming() {
            match stream {
                Ok(stream) => {
                    let waiting = waiting.clone();
                    thread::spawn(move || serve(stream, &waiting));
                }
                Err(err) => {
                    eprintln!("barrier service: accept failed: {err}");
                    // Out of file descriptors, say: let some connections end.
                    thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// [`Self::run`] on its own thread.
    pub fn spawn(self) -> thread::JoinHandle<()> {
        thread::spawn(move || self.run())
    }
}

/// One connection: reads its request, then either answers an error or joins the waiters of
/// its barrier, releasing them all if it is the last.
fn serve(stream: TcpStream, waiting: &Waiting) {
    let (world_size, round) = match request(&stream) {
        Ok(request) => request,
        Err(why) => {
            let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
            let _ = (&stream).write_all(format!("error {why}\n").as_bytes());
            return;
        }
    };
    let released = {
        let mut waiting = waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let group = waiting.entry((world_size, round)).or_default();
        group.push(stream);
        group.retain(is_open);
        if group.len() < world_size {
            return;
        }
        waiting.remove(&(world_size, round)).unwrap_or_default()
    };
    for stream in released {
        let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
        if let Err(err) = (&stream).write_all(b"go\n") {
            eprintln!("barrier service: cannot release a node of round {round}: {err}");
        }
    }
}

/// The (world size, round) of a connection's request line, or why not.
fn request(stream: &TcpStream) -> Result<(usize, usize), String> {
    stream
        .set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(|err| err.to_string())?;
    let mut line = String::new();
    BufReader::new(stream.take(MAX_LINE))
        .read_line(&mut line)
        .map_err(|err| format!("cannot read the request: {err}"))?;
    let Some(line) = line.strip_suffix('\n') else {
        return Err(format!(
            "expected a line `wait WORLD_SIZE ROUND` of at most {MAX_LINE} bytes"
        ));
    };
    let fields: Vec<&str> = line.trim_end_matches('\r').split(' ').collect();
    let [verb, world_size, round] = fields.as_slice() else {
        return Err(format!("expected `wait WORLD_SIZE ROUND`, got {line:?}"));
    };
    let number = |text: &str| text.parse::<usize>().ok();
    match (*verb, number(world_size), number(round)) {
        ("wait", Some(world_size), Some(round)) if world_size > 0 => Ok((world_size, round)),
        _ => Err(format!(
            "expected `wait WORLD_SIZE ROUND`, the world size at least 1, got {line:?}"
        )),
    }
}

/// Whether the node at the other end of a waiting connection has not closed it (a closed one
/// reads as end of file without blocking).
fn is_open(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let open = match stream.peek(&mut [0; 1]) {
        Ok(read) => read > 0,
        Err(err) => err.kind() == ErrorKind::WouldBlock,
    };
    open && stream.set_nonblocking(false).is_ok()
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    /// A service on a free loopback port, serving on its own thread; its address.
    fn service() -> String {
        let service = BarrierService::bind("127.0.0.1:0").expect("bind a free port");
        let address = service.local_addr().expect("local address").to_string();
        service.spawn();
        address
    }

    /// A node waiting at `round` on its own thread; sends its index and outcome when done.
    fn node(
        address: &str,
        world_size: usize,
        round: usize,
        index: usize,
        done: &mpsc::Sender<(usize, Result<(), BarrierError>)>,
    ) {
        let (address, done) = (address.to_string(), done.clone());
        thread::spawn(move || {
            let outcome = wait(&address, world_size, round, Duration::from_secs(30));
            let _ = done.send((index, outcome));
        });
    }

    #[test]
    fn no_node_passes_before_the_last_arrives() {
        let address = service();
        let (done, outcomes) = mpsc::channel();
        node(&address, 3, 7, 0, &done);
        node(&address, 3, 7, 1, &done);
        // Another round and another world size do not count towards round 7 of 3.
        node(&address, 3, 8, 10, &done);
        node(&address, 2, 7, 11, &done);
        let early = outcomes.recv_timeout(Duration::from_millis(500));
        assert!(early.is_err(), "passed before the third node: {early:?}");
        node(&address, 3, 7, 2, &done);
        let mut passed: Vec<usize> = (0..3)
            .map(|_| {
                let (index, outcome) = outcomes
                    .recv_timeout(Duration::from_secs(10))
                    .expect("every node of round 7 passes once the third arrives");
                outcome.unwrap_or_else(|err| panic!("node {index}: {err}"));
                index
            })
            .collect();
        passed.sort_unstable();
        assert_eq!(passed, [0, 1, 2]);
        let late = outcomes.recv_timeout(Duration::from_millis(200));
        assert!(late.is_err(), "another barrier passed: {late:?}");
    }

    #[test]
    fn a_released_round_starts_over() {
        let address = service();
        let (done, outcomes) = mpsc::channel();
        for index in 0..2 {
            node(&address, 2, 0, index, &done);
        }
        for _ in 0..2 {
            let (_, outcome) = outcomes.recv_timeout(Duration::from_secs(10)).unwrap();
            outcome.unwrap();
        }
        node(&address, 2, 0, 2, &done);
        let early = outcomes.recv_timeout(Duration::from_millis(500));
        assert!(early.is_err(), "passed alone: {early:?}");
    }

    #[test]
    fn a_node_alone_times_out() {
        let address = service();
        let start = Instant::now();
        let outcome = wait(&address, 2, 0, Duration::from_millis(300));
        assert!(
            matches!(outcome, Err(BarrierError::TimedOut { .. })),
            "{outcome:?}"
        );
        assert!(start.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn a_closed_connection_does_not_count() {
        let address = service();
        let mut gone = TcpStream::connect(&address).unwrap();
        gone.write_all(b"wait 2 5\n").unwrap();
        drop(gone);
        thread::sleep(Duration::from_millis(200));
        let outcome = wait(&address, 2, 5, Duration::from_millis(500));
        assert!(
            matches!(outcome, Err(BarrierError::TimedOut { .. })),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_bad_request_gets_an_error() {
        let address = service();
        for bad in [
            "hello\n",
            "wait 2\n",
            "wait two 1\n",
            "wait 0 1\n",
            "wait 2 1 3\n",
            "wait 2 -1\n",
        ] {
            let mut stream = TcpStream::connect(&address).unwrap();
            stream.write_all(bad.as_bytes()).unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).unwrap();
            assert!(answer.starts_with("error "), "{bad:?}: {answer:?}");
        }
        // As long as a line may be, without its end (exactly `MAX_LINE` bytes, so that the
        // service reads them all and closes without a reset).
        let mut stream = TcpStream::connect(&address).unwrap();
        stream.write_all(&[b'w'; MAX_LINE as usize]).unwrap();
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        assert!(answer.starts_with("error "), "{answer:?}");
        // The node's side reports the refusal.
        let outcome = wait(&address, 0, 1, Duration::from_secs(10));
        assert!(
            matches!(&outcome, Err(BarrierError::Refused { answer, .. }) if answer.starts_with("error ")),
            "{outcome:?}"
        );
    }

    #[test]
    fn no_service_is_an_error() {
        // A port just freed: nothing listens there.
        let address = {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().to_string()
        };
        let outcome = wait(&address, 2, 0, Duration::from_secs(10));
        assert!(
            matches!(outcome, Err(BarrierError::Connect { .. })),
            "{outcome:?}"
        );
    }
}
