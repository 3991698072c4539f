//! Attacks spread over many source addresses (127.0.0.2 ... 127.0.0.250 on
//! loopback), against the real daemon: the per-address limits hold against
//! one address, and these check that many addresses together still cannot
//! lock a legitimate host out.
//!
//! - Readers that stop reading, from eight addresses at once and then in
//!   waves of fresh addresses, hold the buffer pool: a legitimate client
//!   (from 127.0.0.1, through the initiator library) must still have every
//!   command (CONNECT, LIST, OPEN, a 1 MiB write and its read) answered
//!   within 1 s while the attack holds. Control commands never wait for a
//!   data chunk; pool chunks are shared max-min fair across the sessions
//!   waiting for them.
//! - Anonymous sessions from 200 addresses fill the session table: a host
//!   that proves who it is (a `[[host]]` with a key) must still connect and
//!   do I/O within 1 s per command. Anonymous sessions can be capped on
//!   their own (`max_anonymous_sessions`), and an idle anonymous session
//!   without an open volume is evicted for an authenticated one when the
//!   table is full.
//! - The same for NVMe/TCP controllers: anonymous host NQNs fill
//!   `max_controllers`, and a host whose NQN is a `[[host]]` entry still
//!   connects.
//!
//! How anonymous and authenticated sessions share one table: a target with
//! `[[host]]` entries answers an unauthenticated CONNECT `AuthRequired`
//! (and an NVMe Connect whose host NQN is no `[[host]]` entry Connect
//! Invalid Host, discovery controllers apart), so the tests that need both
//! start the target without `[[host]]` entries, let the anonymous sessions
//! connect, and then add the `[[host]]` entries by a reload (SIGHUP): the
//! anonymous sessions stay, unauthenticated (SECURITY.md, "Access
//! control"), and the authenticated host arrives at a full table.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore};
use rdmablk_common::auth::generate_key_file;
use rdmablk_common::nvme::fabrics::{property, Property, ANY_CONTROLLER, DISCOVERY_NQN};
use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, Sgl, SubmissionEntry};
use rdmablk_common::nvme::tcp::Digests;
use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode, Status, VolumeId, PROTOCOL_VERSION};
use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
use rdmablk_common::nvme::auth::{HashId, Secret};
use rdmablk_system_tests::nvme_tcp::{connect_data, connect_entry, rw_entry, write_dhchap_secret, HostAuth, NvmeTcpConn, CC_ENABLE};
use rdmablk_system_tests::{
    file_volume, legit_io, pool_use, raise_nofile_limit, sample, sample_sum, scrape, sparse_file, wait_until, wire, TargetProcess,
    WireConn, WireEvent,
};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 64 * MIB;
/// The longest any command of a legitimate host may take, during the attack.
const OP_LIMIT: Duration = Duration::from_secs(1);
/// The reads-that-are-never-read attack: queue depth, and the 1 MiB READs
/// each connection posts.
const DEPTH: u32 = 128;

fn addr(last: usize) -> Ipv4Addr {
    assert!((2..=250).contains(&last), "source addresses 127.0.0.2 ..= 127.0.0.250");
    Ipv4Addr::new(127, 0, 0, last as u8)
}

/// A target on tcp:// with two reactors, metrics, `extra` in `[target]`,
/// the `[[host]]` entries `hosts`, and volume "vol" (allow_any_host: any
/// host without `[[host]]` entries, any authenticated one with them).
fn v1_config(extra: &str, hosts: &str, vol: &Path) -> String {
    format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\npin_reactors = false\nmetrics = \"127.0.0.1:0\"\n{extra}\n{hosts}\n{}",
        file_volume("vol", vol, VOL_SIZE, false)
    )
}

/// A `[[host]]` entry with a key file.
fn host_with_key(id: &str, key: &Path) -> String {
    format!("[[host]]\nid = \"{id}\"\nkey_file = \"{}\"\n", key.display())
}

fn metric(t: &TargetProcess, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(&scrape(&t.metrics_addr()), name, labels).unwrap_or_else(|| panic!("metric {name}{labels:?} missing"))
}

fn sessions(t: &TargetProcess) -> f64 {
    metric(t, "rdmablk_sessions_connected", &[])
}

/// True when the daemon has closed or reset `c`'s connection. Bytes it
/// sent and nobody read (the attackers') count as open.
fn closed_by_target(c: &WireConn) -> bool {
    c.stream.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let closed = match c.stream.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    c.stream.set_nonblocking(false).unwrap();
    closed
}

// ---------------------------------------------------------------------------
// The legitimate host's commands, each timed

/// Every command of a legitimate host: what, how long, and its error.
#[derive(Default)]
struct Timings(Vec<(String, Duration, Option<String>)>);

impl Timings {
    /// Runs `f` as command `what`, prints and records how long it took.
    fn run<T, E: std::fmt::Display>(&mut self, what: String, f: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
        let t0 = Instant::now();
        let r = f();
        let took = t0.elapsed();
        let err = r.as_ref().err().map(|e| e.to_string());
        eprintln!("  {what}: {took:.3?}{}", err.as_ref().map(|e| format!(", FAILED: {e}")).unwrap_or_default());
        self.0.push((what.clone(), took, err.clone()));
        r.map_err(|e| format!("{what}: {e}"))
    }

    fn summary(&self) -> String {
        let worst = self.0.iter().max_by_key(|(_, took, _)| *took);
        format!(
            "{} commands, {} failed, {} over {OP_LIMIT:?}, the slowest {}",
            self.0.len(),
            self.0.iter().filter(|(_, _, e)| e.is_some()).count(),
            self.0.iter().filter(|(_, took, _)| *took > OP_LIMIT).count(),
            worst.map(|(w, t, _)| format!("{w} ({t:.3?})")).unwrap_or_else(|| "-".into())
        )
    }

    /// Every command succeeded, each within OP_LIMIT, and there were at least `min`.
    fn assert_served(&self, who: &str, min: usize) {
        let failed: Vec<String> =
            self.0.iter().filter_map(|(w, t, e)| e.as_ref().map(|e| format!("{w} after {t:.3?}: {e}"))).collect();
        let slow: Vec<String> = self.0.iter().filter(|(_, t, _)| *t > OP_LIMIT).map(|(w, t, _)| format!("{w} {t:.3?}")).collect();
        assert!(
            failed.is_empty() && slow.is_empty(),
            "{who} during the attack: {}; failed: {failed:?}; over {OP_LIMIT:?}: {slow:?}",
            self.summary()
        );
        assert!(self.0.len() >= min, "{who}: only {} commands ran, {min} expected", self.0.len());
    }
}

fn legit_options(host: &str) -> ConnectOptions {
    ConnectOptions {
        host_id: host.into(),
        queues: 1,
        connect_timeout: Duration::from_secs(10),
        // Longer than chunk_wait_timeout (5 s): a command starved of pool
        // chunks is answered OutOfBuffers, not timed out by the library.
        io_timeout: Duration::from_secs(15),
        // A failure is an error here, not a silent reconnection.
        ctrl_loss_timeout: Duration::ZERO,
        ..ConnectOptions::default()
    }
}

/// What a legitimate host does, each command timed: CONNECT, LIST, OPEN,
/// a 1 MiB write of fresh random bytes and its read back, compared.
fn legit_round(url: &str, options: ConnectOptions, round: usize, log: &mut Timings) -> Result<(), String> {
    let session = log.run(format!("round {round}: CONNECT ({})", options.host_id), || Session::connect(url, options))?;
    let result = (|| {
        let vols = log.run(format!("round {round}: LIST"), || session.list_volumes())?;
        if !vols.iter().any(|v| v.name == "vol") {
            return Err(format!("round {round}: LIST does not show vol: {vols:?}"));
        }
        let vol = log.run(format!("round {round}: OPEN vol"), || session.open("vol"))?;
        let mut data = vec![0u8; MIB as usize];
        rand::thread_rng().fill_bytes(&mut data);
        let offset = (round as u64 % 32) * MIB;
        log.run(format!("round {round}: WRITE 1 MiB at {offset}"), || vol.write_at(&data, offset))?;
        let mut back = vec![0u8; MIB as usize];
        log.run(format!("round {round}: READ 1 MiB at {offset}"), || vol.read_at(&mut back, offset))?;
        if back != data {
            log.0.push((format!("round {round}: verify"), Duration::ZERO, Some("the READ returned other bytes than the WRITE".into())));
            return Err(format!("round {round}: the READ returned other bytes than the WRITE"));
        }
        Ok(())
    })();
    session.close();
    result
}

// ---------------------------------------------------------------------------
// Readers that stop reading

/// One attacking connection from `source`: HELLO, CONNECT (queue depth
/// 128), OPEN, then 128 one-MiB READs. It reads nothing after that, so it
/// acknowledges none of the target's RDMA WRITEs of the data.
fn reader_that_stops_reading(url: &str, source: Ipv4Addr, name: &str) -> WireConn {
    let mut c = WireConn::raw_from(url, source);
    c.send(&wire::hello());
    let (h, body) = c.read_frame(Duration::from_secs(10)).expect("a HELLO_REPLY");
    assert_eq!(h.ty, wire::HELLO_REPLY);
    assert_eq!(u32::from_le_bytes(body[8..12].try_into().unwrap()), 0, "{name}: HELLO accepted");
    let reply = c.connect(name, DEPTH);
    assert_eq!(reply.queue_depth, DEPTH);
    let vol = c.open_volume("vol");
    let blocks = (MIB / vol.block_size as u64) as u32;
    for k in 0..DEPTH as u64 {
        let mut cmd = CommandCapsule::new(Opcode::Read, CommandId(0));
        cmd.volume_id = vol.volume_id;
        cmd.start_block = Lba((k % 64) * blocks as u64);
        cmd.block_count = BlockCount(blocks);
        cmd.descriptor = c.descriptor(0, MIB as u32);
        c.post(cmd, &[]);
    }
    c
}

/// Waits until the pool's state stops changing for half a second (the
/// attack's READs all hold chunks or wait), at most 10 s; returns it.
fn pool_settled(t: &TargetProcess) -> Vec<(u64, u64)> {
    let mut last = pool_use(t, 2);
    let mut since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(10);
    while since.elapsed() < Duration::from_millis(500) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let now = pool_use(t, 2);
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    last
}

#[test]
fn readers_that_stop_reading_from_eight_addresses_do_not_lock_out_a_host() {
    let test_start = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    // The default pool (two reactors of 512 chunks of 128 KiB). The
    // transport timeout is raised so that the attack holds for the whole
    // test: the legitimate host must be served while it does, not after
    // it has been timed out.
    let t = TargetProcess::start(&v1_config("transport_timeout = \"60s\"", "", &vol));
    legit_io(&t.url, 0);
    wait_until("the first session is gone", Duration::from_secs(10), || sessions(&t) == 0.0);

    // Eight attackers, each from its own address: every one within the
    // per-address limits (max_connections_per_address, host_pool_share).
    let t0 = Instant::now();
    let attackers: Vec<WireConn> = (0..8).map(|i| reader_that_stops_reading(&t.url, addr(2 + i), &format!("reader-{i}"))).collect();
    let held = pool_settled(&t);
    eprintln!(
        "8 connections from 127.0.0.2 ..= 127.0.0.9 posted {} 1 MiB READs in {:.2?}: (chunks in use, commands waiting) per reactor {held:?}, of 512 chunks each",
        8 * DEPTH,
        t0.elapsed()
    );
    assert!(held.iter().all(|&(used, _)| used > 0), "the attack holds chunks on both reactors: {held:?}");

    // The legitimate host, from 127.0.0.1, meanwhile: four rounds of
    // CONNECT, LIST, OPEN, 1 MiB write and read back; a failed command
    // ends them (each may take chunk_wait_timeout).
    let mut log = Timings::default();
    for round in 0..4 {
        if legit_round(&t.url, legit_options("legit-host"), round, &mut log).is_err() {
            break;
        }
    }
    let attack_age = t0.elapsed();

    // The attack was in force all along: every attacker still connected,
    // its socket open, and the pool still holding its chunks.
    let still = pool_use(&t, 2);
    let connected = sessions(&t);
    let closed: Vec<&str> = attackers.iter().filter(|c| closed_by_target(c)).map(|c| c.peer.as_str()).collect();
    eprintln!(
        "legitimate host (127.0.0.1): {}; the attack {attack_age:.2?} old at the end: {connected} sessions connected, pool {still:?}, \
         attackers closed by the target {closed:?}; test {:.2?}",
        log.summary(),
        test_start.elapsed()
    );
    log.assert_served("the legitimate host (127.0.0.1)", 4 * 5);
    assert!(closed.is_empty() && connected >= 8.0, "the attackers are still connected: {connected} sessions, closed {closed:?}");
    assert!(still.iter().all(|&(used, _)| used > 0), "the attackers still hold chunks on both reactors: {still:?}");
    drop(attackers);
    t.assert_no_panic();
}

#[test]
fn waves_of_sixteen_addresses_do_not_fail_a_legit_writer() {
    const WAVES: usize = 4;
    const WAVE_EVERY: Duration = Duration::from_secs(5);
    /// Addresses per wave, and connections per address.
    const PER_WAVE: usize = 4;
    const PER_ADDRESS: usize = 2;
    const ROUNDS: usize = 6;
    const ROUND_EVERY: Duration = Duration::from_millis(3000);
    let test_start = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    // A short transport timeout: a wave loses its chunks (and its
    // sessions) a few seconds after it came, the next one is there by then.
    let t = TargetProcess::start(&v1_config("transport_timeout = \"3s\"", "", &vol));
    legit_io(&t.url, 0);
    wait_until("the first session is gone", Duration::from_secs(10), || sessions(&t) == 0.0);

    // The legitimate writer, in its own thread: ROUNDS rounds of CONNECT,
    // LIST, OPEN, 1 MiB write and read back, one every ROUND_EVERY (or at
    // once after a slow one); before each, the attack's state.
    let first_wave = Instant::now();
    let url = t.url.clone();
    let metrics = t.metrics_addr();
    let writer = std::thread::spawn(move || {
        let mut log = Timings::default();
        let mut before = Vec::new();
        let mut next = Instant::now() + Duration::from_secs(1);
        for round in 0..ROUNDS {
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            next = Instant::now().max(next) + ROUND_EVERY;
            let m = scrape(&metrics);
            let used: f64 = (0..2).map(|r| sample(&m, "rdmablk_buffer_pool_chunks_in_use", &[("reactor", &r.to_string())]).unwrap()).sum();
            let attackers = sample(&m, "rdmablk_sessions_connected", &[]).unwrap();
            before.push((first_wave.elapsed(), attackers, used));
            let _ = legit_round(&url, legit_options("legit-writer"), round, &mut log);
        }
        (log, before)
    });

    // The waves: every WAVE_EVERY, PER_WAVE fresh addresses with PER_ADDRESS
    // readers that stop reading each. Older waves are kept (their sockets
    // stay open) until the transport timeout ends them at the target.
    let mut held: Vec<WireConn> = Vec::new();
    for w in 0..WAVES {
        std::thread::sleep((first_wave + WAVE_EVERY * w as u32).saturating_duration_since(Instant::now()));
        let t0 = Instant::now();
        for a in 0..PER_WAVE {
            let source = addr(10 + w * PER_WAVE + a);
            for k in 0..PER_ADDRESS {
                held.push(reader_that_stops_reading(&t.url, source, &format!("wave-{w}-{source}-{k}")));
            }
        }
        eprintln!(
            "wave {w} (127.0.0.{} ..= 127.0.0.{}) posted its READs at +{:.2?} in {:.2?}: {} sessions connected, pool {:?}",
            10 + w * PER_WAVE,
            10 + w * PER_WAVE + PER_WAVE - 1,
            t0 - first_wave,
            t0.elapsed(),
            sessions(&t),
            pool_use(&t, 2)
        );
    }
    let (log, before) = writer.join().expect("the legitimate writer's thread panicked");
    eprintln!(
        "legitimate writer (127.0.0.1): {}; before each round (time since the first wave, sessions connected, pool chunks in use): \
         {before:.1?}; test {:.2?}",
        log.summary(),
        test_start.elapsed()
    );
    log.assert_served("the legitimate writer (127.0.0.1)", ROUNDS * 5);
    // The attack was in force at every round: attackers connected and
    // holding chunks when it started.
    for (at, attackers, used) in &before {
        assert!(*attackers >= 1.0 && *used > 0.0, "at +{at:.1?} the attack was not in force: {attackers} sessions, {used} chunks in use");
    }
    drop(held);
    t.assert_no_panic();
}

// ---------------------------------------------------------------------------
// The session table

/// An anonymous session from `source`: HELLO, then CONNECT as `host` (no
/// authentication). The connection, or the CONNECT's status.
fn anonymous_session(url: &str, source: Ipv4Addr, host: &str) -> Result<WireConn, Status> {
    let mut c = WireConn::raw_from(url, source);
    c.send(&wire::hello());
    let (h, body) = c.read_frame(Duration::from_secs(10)).expect("a HELLO_REPLY");
    assert_eq!(h.ty, wire::HELLO_REPLY);
    assert_eq!(u32::from_le_bytes(body[8..12].try_into().unwrap()), 0, "{host} from {source}: HELLO refused");
    let mut cmd = CommandCapsule::new(Opcode::Connect, CommandId(0));
    cmd.version = PROTOCOL_VERSION;
    cmd.queue_depth = 8;
    cmd.max_io_size = 1 << 20;
    let (r, _) = c.command(cmd, host.as_bytes());
    if r.status == Status::Success {
        Ok(c)
    } else {
        Err(r.status)
    }
}

/// Opens `count` anonymous sessions, `per_address` from each of the
/// addresses from 127.0.0.`first` on; returns those connected and the
/// statuses of those refused.
fn anonymous_sessions(url: &str, first: usize, count: usize, per_address: usize) -> (Vec<WireConn>, Vec<Status>) {
    let (mut held, mut refused) = (Vec::new(), Vec::new());
    for i in 0..count {
        let source = addr(first + i / per_address);
        match anonymous_session(url, source, &format!("anon-{i}")) {
            Ok(c) => held.push(c),
            Err(s) => refused.push(s),
        }
    }
    (held, refused)
}

/// One held anonymous session and what it keeps doing.
struct Held {
    conn: WireConn,
    /// Its open volume: it reads 4 KiB from it at every turn (it is not idle).
    reads: Option<VolumeId>,
}

/// Sessions kept alive by a thread: a KEEP_ALIVE every `every` on each,
/// and a 4 KiB READ on those with an open volume. A session whose
/// connection the target ends, or that gets no answer, is dropped and
/// recorded.
struct KeptAlive {
    stop: Arc<AtomicBool>,
    alive: Arc<AtomicUsize>,
    /// (peer, what happened) of the sessions that ended.
    ended: Arc<Mutex<Vec<(String, String)>>>,
    handle: std::thread::JoinHandle<Vec<Held>>,
}

/// Sends `cmd` and waits for its answer (serving the target's RDMA
/// operations meanwhile); Err says what came instead.
fn answered(c: &mut WireConn, cmd: CommandCapsule) -> Result<(), String> {
    let id = c.post(cmd, &[]);
    loop {
        match c.next_event(Duration::from_secs(5)) {
            WireEvent::Response(r, _) if r.command_id == id && r.status == Status::Success => return Ok(()),
            WireEvent::Response(r, _) if r.command_id == id => return Err(format!("answered {:?}", r.status)),
            WireEvent::Response(..) => continue,
            WireEvent::Silence => return Err("no answer within 5 s".into()),
            other => return Err(format!("{other:?}")),
        }
    }
}

impl KeptAlive {
    fn start(sessions: Vec<Held>, every: Duration) -> KeptAlive {
        let stop = Arc::new(AtomicBool::new(false));
        let alive = Arc::new(AtomicUsize::new(sessions.len()));
        let ended = Arc::new(Mutex::new(Vec::new()));
        let (s, a, e) = (Arc::clone(&stop), Arc::clone(&alive), Arc::clone(&ended));
        let handle = std::thread::spawn(move || {
            let mut sessions = sessions;
            while !s.load(Ordering::Relaxed) {
                let turn = Instant::now();
                sessions.retain_mut(|h| {
                    let mut r = answered(&mut h.conn, CommandCapsule::new(Opcode::KeepAlive, CommandId(0)));
                    if let (Ok(()), Some(vol)) = (&r, h.reads) {
                        let mut cmd = CommandCapsule::new(Opcode::Read, CommandId(0));
                        cmd.volume_id = vol;
                        cmd.block_count = BlockCount(1);
                        cmd.descriptor = h.conn.descriptor(0, 4096);
                        r = answered(&mut h.conn, cmd);
                    }
                    if let Err(why) = &r {
                        e.lock().unwrap().push((h.conn.peer.clone(), why.clone()));
                        a.fetch_sub(1, Ordering::Relaxed);
                    }
                    r.is_ok()
                });
                while turn.elapsed() < every && !s.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            sessions
        });
        KeptAlive { stop, alive, ended, handle }
    }

    fn alive(&self) -> usize {
        self.alive.load(Ordering::Relaxed)
    }

    fn ended(&self) -> Vec<(String, String)> {
        self.ended.lock().unwrap().clone()
    }

    fn stop(self) -> Vec<Held> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("the keep-alive thread panicked")
    }
}

/// A key file for host `id` in `dir`.
fn key_for(dir: &Path, id: &str) -> PathBuf {
    let k = dir.join(format!("{id}.key"));
    generate_key_file(&k).unwrap();
    k
}

fn authenticated_options(host: &str, key: &Path) -> ConnectOptions {
    legit_options(host).with_key_file(key).unwrap()
}

/// The table attack: 200 addresses with two anonymous sessions
/// each, kept alive, fill `max_sessions` (256). An authenticated host
/// (the `[[host]]` entry "alpha", with its key) must still connect and do
/// its I/O within 1 s per command while they are held.
#[test]
fn two_hundred_addresses_filling_the_session_table_do_not_lock_out_an_authenticated_host() {
    let test_start = Instant::now();
    raise_nofile_limit(2048);
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let alpha_key = key_for(dir.path(), "alpha");
    let extra = "max_sessions = 256";
    let t = TargetProcess::start(&v1_config(extra, "", &vol));

    // 200 addresses (127.0.0.2 ..= 127.0.0.201) x 2 anonymous sessions, in
    // that order: the table takes what it takes, the rest is refused.
    let t0 = Instant::now();
    let (held, refused) = anonymous_sessions(&t.url, 2, 400, 2);
    eprintln!(
        "400 anonymous CONNECTs from 200 addresses in {:.2?}: {} connected, {} refused {:?}",
        t0.elapsed(),
        held.len(),
        refused.len(),
        refused.iter().fold(std::collections::BTreeMap::<String, usize>::new(), |mut m, s| {
            *m.entry(format!("{s:?}")).or_default() += 1;
            m
        })
    );
    assert!(refused.iter().all(|s| *s == Status::LimitReached), "anonymous CONNECTs refused otherwise than LimitReached: {refused:?}");
    assert!(held.len() >= 128, "the attack holds {} sessions: too few to mean anything", held.len());
    let n = held.len();
    let keeper = KeptAlive::start(held.into_iter().map(|conn| Held { conn, reads: None }).collect(), Duration::from_secs(2));

    // The [[host]] entry for alpha arrives (the anonymous sessions stay).
    let line = t.reload(&v1_config(extra, &host_with_key("alpha", &alpha_key), &vol));
    assert!(line.contains("reload complete"), "{line}");
    let before = sessions(&t);
    eprintln!("after the reload adding host alpha: {before} sessions connected, {} kept alive", keeper.alive());
    assert_eq!(before, n as f64, "the anonymous sessions are all held when alpha arrives");

    let mut log = Timings::default();
    for round in 0..3 {
        let _ = legit_round(&t.url, authenticated_options("alpha", &alpha_key), round, &mut log);
    }
    let alive = keeper.alive();
    let ended = keeper.ended();
    eprintln!(
        "authenticated host alpha (127.0.0.1): {}; anonymous sessions still kept alive {alive} of {n}, ended {:?}; test {:.2?}",
        log.summary(),
        &ended[..ended.len().min(5)],
        test_start.elapsed()
    );
    log.assert_served("the authenticated host alpha", 3 * 5);
    // The attack was in force: at most one anonymous session made room for
    // each of alpha's three sessions.
    assert!(alive + 3 >= n, "the anonymous sessions were held throughout: {alive} of {n} still alive, ended {ended:?}");
    drop(keeper.stop());
    t.assert_no_panic();
}

/// Done-when of the issue: 256 anonymous sessions held (the default
/// `max_sessions`, full), each with the volume open and reading from it
/// every second (none idle, so no eviction of idle sessions makes room):
/// an authenticated host still connects and does its I/O within 1 s per
/// command.
#[test]
fn an_authenticated_host_connects_while_256_anonymous_sessions_are_held() {
    let test_start = Instant::now();
    raise_nofile_limit(2048);
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let alpha_key = key_for(dir.path(), "alpha");
    let extra = "max_sessions = 256";
    let t = TargetProcess::start(&v1_config(extra, "", &vol));

    // 128 addresses (127.0.0.2 ..= 127.0.0.129) x 2, each session OPENs vol.
    let t0 = Instant::now();
    let (held, refused) = anonymous_sessions(&t.url, 2, 256, 2);
    assert!(refused.is_empty() && held.len() == 256, "256 anonymous sessions connect: {} held, refused {refused:?}", held.len());
    let held: Vec<Held> = held
        .into_iter()
        .map(|mut conn| {
            let reads = Some(conn.open_volume("vol").volume_id);
            Held { conn, reads }
        })
        .collect();
    eprintln!("256 anonymous sessions from 128 addresses connected and opened vol in {:.2?}", t0.elapsed());
    let keeper = KeptAlive::start(held, Duration::from_secs(1));

    let line = t.reload(&v1_config(extra, &host_with_key("alpha", &alpha_key), &vol));
    assert!(line.contains("reload complete"), "{line}");
    std::thread::sleep(Duration::from_millis(1500));
    let before = sessions(&t);
    let ended_before = keeper.ended();
    eprintln!("after the reload adding host alpha: {before} sessions connected, {} active anonymous ones", keeper.alive());
    assert!(
        before == 256.0 && ended_before.is_empty(),
        "256 anonymous sessions held and reading when alpha arrives: {before} sessions, ended {ended_before:?}"
    );

    let mut log = Timings::default();
    for round in 0..3 {
        let _ = legit_round(&t.url, authenticated_options("alpha", &alpha_key), round, &mut log);
    }
    let (alive, ended) = (keeper.alive(), keeper.ended());
    eprintln!(
        "authenticated host alpha (127.0.0.1): {}; anonymous sessions still active {alive} of 256, ended {:?}; test {:.2?}",
        log.summary(),
        &ended[..ended.len().min(5)],
        test_start.elapsed()
    );
    log.assert_served("the authenticated host alpha", 3 * 5);
    assert!(alive + 3 >= 256, "the anonymous sessions were held throughout: {alive} of 256 still active, ended {ended:?}");
    drop(keeper.stop());
    t.assert_no_panic();
}

/// `max_anonymous_sessions` caps the anonymous sessions apart from the
/// table: the ninth under a cap of 8 is refused `LimitReached`, logged with
/// the key, counted; an authenticated host is not held to it.
#[test]
fn max_anonymous_sessions_refuses_the_next_anonymous_session_and_no_authenticated_one() {
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let alpha_key = key_for(dir.path(), "alpha");
    let extra = "max_sessions = 256\nmax_anonymous_sessions = 8";
    let t = TargetProcess::start(&v1_config(extra, "", &vol));
    let (held, refused) = anonymous_sessions(&t.url, 2, 8, 1);
    assert!(refused.is_empty(), "eight anonymous sessions from eight addresses: refused {refused:?}");
    match anonymous_session(&t.url, addr(10), "ninth") {
        Ok(_) => panic!("a ninth anonymous session connected under max_anonymous_sessions = 8"),
        Err(s) => assert_eq!(s, Status::LimitReached),
    }
    t.wait_for_log_all(&["session refused", "ninth", "target.max_anonymous_sessions = 8"], Duration::from_secs(5));
    assert_eq!(metric(&t, "rdmablk_connections_refused_total", &[("reason", "max_anonymous_sessions")]), 1.0);
    let Err(e) = Session::connect(t.url.as_str(), legit_options("tenth")) else {
        panic!("the library's anonymous session is refused too")
    };
    assert_eq!(e.status(), Some(Status::LimitReached), "{e}");

    // Authenticated sessions do not count against it.
    let line = t.reload(&v1_config(extra, &host_with_key("alpha", &alpha_key), &vol));
    assert!(line.contains("reload complete"), "{line}");
    let mut log = Timings::default();
    let _ = legit_round(&t.url, authenticated_options("alpha", &alpha_key), 0, &mut log);
    log.assert_served("the authenticated host alpha with 8 anonymous sessions held", 5);
    drop(held);
    t.assert_no_panic();
}

/// A full table makes room for an authenticated host by evicting an idle
/// anonymous session without an open volume (it only sends keep-alives):
/// its connection ends and the target logs it; the anonymous sessions that
/// have the volume open and use it stay.
#[test]
fn a_full_table_evicts_an_idle_anonymous_session_for_an_authenticated_host() {
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let alpha_key = key_for(dir.path(), "alpha");
    let extra = "max_sessions = 4";
    let t = TargetProcess::start(&v1_config(extra, "", &vol));
    let (held, refused) = anonymous_sessions(&t.url, 2, 4, 1);
    assert!(refused.is_empty(), "four anonymous sessions: refused {refused:?}");
    // 127.0.0.2 ..= 127.0.0.4 open vol and read from it; 127.0.0.5 is idle.
    let held: Vec<Held> = held
        .into_iter()
        .enumerate()
        .map(|(i, mut conn)| {
            let reads = (i < 3).then(|| conn.open_volume("vol").volume_id);
            Held { conn, reads }
        })
        .collect();
    let idle_peer = held[3].conn.peer.clone();
    let keeper = KeptAlive::start(held, Duration::from_millis(500));

    let line = t.reload(&v1_config(extra, &host_with_key("alpha", &alpha_key), &vol));
    assert!(line.contains("reload complete"), "{line}");
    assert_eq!(sessions(&t), 4.0, "the table is full when alpha arrives");
    let mut log = Timings::default();
    let alpha = log.run("CONNECT (alpha, authenticated, into a full table)".into(), || {
        Session::connect(t.url.as_str(), authenticated_options("alpha", &alpha_key))
    });
    let alpha_result = alpha.as_ref().map(|_| ()).map_err(Clone::clone);
    // The idle one's connection ends; the others are kept.
    let waited = Instant::now();
    while keeper.ended().is_empty() && waited.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let ended = keeper.ended();
    eprintln!("alpha: {}; anonymous sessions ended {ended:?}, {} still active", log.summary(), keeper.alive());
    alpha_result.unwrap_or_else(|e| panic!("an authenticated host into a full table of anonymous sessions: {e}"));
    log.assert_served("the authenticated host alpha", 1);
    assert_eq!(ended.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(), vec![idle_peer.as_str()], "the idle session, and only it, ended");
    t.wait_for_log_all(&[&idle_peer, "evict"], Duration::from_secs(5));
    let alpha = alpha.unwrap();
    let v = alpha.open("vol").expect("alpha opens vol");
    v.write_at(&[0x5a; 4096], 0).expect("alpha writes");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(keeper.alive(), 3, "the three anonymous sessions using vol stay: ended {:?}", keeper.ended());
    drop(v);
    alpha.close();
    drop(keeper.stop());
    t.assert_no_panic();
}

// ---------------------------------------------------------------------------
// NVMe/TCP controllers
//
// A host that proves who it is on NVMe-oF is one whose `[[host]]` has a
// DH-HMAC-CHAP secret (`dhchap_key_file`): each of its queues authenticates
// before anything else. Anonymous means any other NQN (claimed, unproven).

const SUBNQN: &str = "nqn.2026-12.io.rdmablk.test:fair-share";
const LEGIT_NQN: &str = "nqn.2026-12.io.rdmablk.test:fair-share-legit-host";
const NO_DIGESTS: Digests = Digests { header: false, data: false };

fn random_nqn(rng: &mut impl Rng) -> String {
    let b: [u8; 16] = rng.gen();
    let h = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("nqn.2014-08.org.nvmexpress:uuid:{}-{}-{}-{}-{}", h(0..4), h(4..6), h(6..8), h(8..10), h(10..16))
}

/// A DH-HMAC-CHAP secret for LEGIT_NQN in `dir`, and the `[[host]]` entry
/// that makes the host authenticate with it.
fn legit_dhchap_host(dir: &Path) -> (Secret, String) {
    let secret = Secret::generate(Some(HashId::Sha256));
    let key = write_dhchap_secret(dir, "legit.dhchap", &secret);
    (secret, format!("[[host]]\nid = \"legit\"\nnqn = \"{LEGIT_NQN}\"\ndhchap_key_file = \"{}\"\n", key.display()))
}

fn nvme_config(extra: &str, hosts: &str, vol: &Path) -> String {
    format!(
        "[target]\nlisten = [\"nvme+tcp://127.0.0.1:0\", \"tcp://127.0.0.1:0\"]\nnqn = \"{SUBNQN}\"\nreactors = 2\npin_reactors = false\n\
         metrics = \"127.0.0.1:0\"\n{extra}\n{hosts}\n{}nsid = 1\n",
        file_volume("vol", vol, VOL_SIZE, false)
    )
}

/// An admin controller from `source` for a random host NQN on `subnqn`
/// (the subsystem, or discovery), KATO 0; then silence.
fn anonymous_controller(addr: SocketAddr, source: Ipv4Addr, subnqn: &str) -> Result<NvmeTcpConn, String> {
    let mut c = NvmeTcpConn::tcp_from_within(addr, source, Duration::from_secs(5)).map_err(|e| format!("TCP connect: {e}"))?;
    c.timeout = Duration::from_secs(5);
    c.try_initialize(NO_DIGESTS).map_err(|e| format!("ICReq: {e}"))?;
    let data = connect_data(ANY_CONTROLLER, subnqn, &random_nqn(&mut rand::thread_rng()));
    c.try_exec(connect_entry(0, 31, 0), &data, &[], 0).map_err(|e| format!("admin Connect: {e}"))?;
    Ok(c)
}

/// The legitimate NVMe host from 127.0.0.250 with LEGIT_NQN: admin queue
/// (KATO 10 s), enable, one I/O queue, then `rounds` verified 4 KiB writes
/// and reads; every command timed.
fn nvme_host(addr: SocketAddr, nqn: &str, secret: Option<&Secret>, rounds: u64, log: &mut Timings) -> Result<(), String> {
    let auth = secret.map(|s| HostAuth::new(s.clone(), None, nqn, SUBNQN));
    let source = Ipv4Addr::new(127, 0, 0, 250);
    let connect = || NvmeTcpConn::tcp_from_within(addr, source, Duration::from_secs(5));
    let mut admin = log.run("TCP connect of the admin queue".into(), connect)?;
    admin.timeout = Duration::from_secs(10);
    log.run("ICReq of the admin queue".into(), || admin.try_initialize(NO_DIGESTS))?;
    let data = connect_data(ANY_CONTROLLER, SUBNQN, nqn);
    let c = log.run("admin Connect".into(), || admin.try_exec(connect_entry(0, 31, 10_000), &data, &[], 0))?;
    let cntlid = c.cqe.result as u16;
    if let Some(auth) = &auth {
        let run = log.run("DH-HMAC-CHAP of the admin queue".into(), || Ok::<_, String>(admin.authenticate(auth, 1)))?;
        if let Some(e) = run.failure {
            return Err(format!("admin queue authentication: {e}"));
        }
    }
    let cc = Property { offset: property::CC, wide: false, value: CC_ENABLE }.to_entry(0, true);
    log.run("Property Set CC.EN".into(), || admin.try_exec(cc, &[], &[], 0))?;
    let ready_by = Instant::now() + Duration::from_secs(5);
    loop {
        let csts = Property { offset: property::CSTS, wide: false, value: 0 }.to_entry(0, false);
        if log.run("Property Get CSTS".into(), || admin.try_exec(csts, &[], &[], 0))?.cqe.result & 1 == 1 {
            break;
        }
        if Instant::now() > ready_by {
            return Err("CSTS.RDY not set within 5 s of CC.EN".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut nq = SubmissionEntry::new(admin_opcode::SET_FEATURES, 0);
    nq.cdw[0] = 0x07;
    log.run("Set Features number of queues".into(), || admin.try_exec(nq, &[], &[], 0))?;
    let mut io = log.run("TCP connect of the I/O queue".into(), connect)?;
    io.timeout = Duration::from_secs(10);
    log.run("ICReq of the I/O queue".into(), || io.try_initialize(NO_DIGESTS))?;
    let data = connect_data(cntlid, SUBNQN, nqn);
    log.run("I/O queue Connect".into(), || io.try_exec(connect_entry(1, 31, 0), &data, &[], 0))?;
    if let Some(auth) = &auth {
        let run = log.run("DH-HMAC-CHAP of the I/O queue".into(), || Ok::<_, String>(io.authenticate(auth, 2)))?;
        if let Some(e) = run.failure {
            return Err(format!("I/O queue authentication: {e}"));
        }
    }
    for n in 0..rounds {
        let mut block = vec![0u8; 4096];
        rand::thread_rng().fill_bytes(&mut block);
        let lba = 256 + n;
        log.run(format!("NVMe Write LBA {lba}"), || io.try_exec(rw_entry(io_opcode::WRITE, 1, lba, 1, false), &block, &[], 0))?;
        let back = log.run(format!("NVMe Read LBA {lba}"), || io.try_exec(rw_entry(io_opcode::READ, 1, lba, 1, false), &[], &[], 4096))?;
        if back.data != block {
            return Err(format!("NVMe Read of LBA {lba} returned other bytes than the Write before it"));
        }
        log.run("Keep Alive".into(), || admin.try_exec(SubmissionEntry::new(admin_opcode::KEEP_ALIVE, 0), &[], &[], 0))?;
    }
    Ok(())
}

/// Anonymous host NQNs from 48 addresses fill `max_controllers` (64): 32
/// controllers of the subsystem (connected while the target had no
/// `[[host]]` entries, under allow_any_host) and 32 discovery controllers
/// (which any NQN may open, `[[host]]` entries or not). A host whose
/// `[[host]]` has a DH-HMAC-CHAP secret must still connect, authenticate
/// and do its I/O, each command within 1 s: one anonymous controller is
/// torn down for it.
#[test]
fn anonymous_nvme_controllers_from_many_addresses_do_not_lock_out_a_configured_host() {
    let test_start = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let extra = "max_controllers = 64";
    let t = TargetProcess::start(&nvme_config(extra, "", &vol));
    let nvme = t.nvme_tcp_addr();

    // 127.0.0.2 ..= 127.0.0.17, two subsystem controllers each.
    let mut held: Vec<NvmeTcpConn> = (0..32)
        .map(|i| anonymous_controller(nvme, addr(2 + i / 2), SUBNQN).unwrap_or_else(|e| panic!("anonymous controller {i}: {e}")))
        .collect();
    // The [[host]] entry of the legitimate host arrives.
    let (secret, hosts) = legit_dhchap_host(dir.path());
    let line = t.reload(&nvme_config(extra, &hosts, &vol));
    assert!(line.contains("reload complete"), "{line}");
    // 127.0.0.18 ..= 127.0.0.49, one discovery controller each.
    for i in 0..32 {
        held.push(anonymous_controller(nvme, addr(18 + i), DISCOVERY_NQN).unwrap_or_else(|e| panic!("discovery controller {i}: {e}")));
    }
    let before = metric(&t, "rdmablk_nvme_controllers", &[]);
    eprintln!("64 anonymous controllers from 48 addresses in {:.2?}: {before} controllers alive", test_start.elapsed());
    assert_eq!(before, 64.0, "the anonymous controllers fill max_controllers");

    let mut log = Timings::default();
    let result = nvme_host(nvme, LEGIT_NQN, Some(&secret), 4, &mut log);
    let still = metric(&t, "rdmablk_nvme_controllers", &[]);
    let why: Vec<String> = t.log().into_iter().filter(|l| l.contains(LEGIT_NQN) && l.contains("nvme connect from")).collect();
    eprintln!(
        "legitimate NVMe host {LEGIT_NQN} (127.0.0.250): {}{}; the target's log about it {why:?}; controllers alive after it {still}; test {:.2?}",
        log.summary(),
        result.as_ref().err().map(|e| format!(", ended by {e}")).unwrap_or_default(),
        test_start.elapsed()
    );
    log.assert_served("the NVMe host that authenticates", 11 + 3 * 4);
    assert_eq!(metric(&t, "rdmablk_nvme_controllers_evicted_total", &[]), 1.0, "one anonymous controller made room");
    // The attack was in force: one anonymous controller made room for the
    // host's, which ended with its connections when nvme_host returned.
    assert!(still >= 63.0, "the anonymous controllers were held throughout: {still} controllers alive after the host's ended");
    drop(held);
    t.assert_no_panic();
}

/// An NVMe/TCP host from `source` that connects a controller (KATO 0) and
/// one I/O queue of 128 entries, posts 127 reads of 128 KiB and then reads
/// nothing: the target's data stays queued to it, in pool chunks.
fn nvme_reader_that_stops_reading(addr: SocketAddr, source: Ipv4Addr) -> (NvmeTcpConn, NvmeTcpConn) {
    let nqn = random_nqn(&mut rand::thread_rng());
    let mut admin = NvmeTcpConn::connect_from(addr, source, NO_DIGESTS);
    let cntlid = admin.admin_connect(SUBNQN, &nqn, 0).expect("the attacker's admin Connect");
    admin.enable();
    let mut io = NvmeTcpConn::connect_from(addr, source, NO_DIGESTS);
    io.io_connect_sized(cntlid, 1, 127, SUBNQN, &nqn).expect("the attacker's I/O Connect");
    for k in 0..127u64 {
        let mut e = rw_entry(io_opcode::READ, 1, (k % 64) * 32, 32, false);
        e.set_sgl(Sgl::Transport { length: 128 << 10 });
        io.send_command(e, &[]);
    }
    (admin, io)
}

fn chunks_in_use(t: &TargetProcess) -> f64 {
    sample_sum(&scrape(&t.metrics_addr()), "rdmablk_buffer_pool_chunks_in_use")
}

/// A queue whose host reads nothing the target sends keeps its chunks only
/// until `transport_timeout`: then the target closes it, and they are back
/// while the host still holds its sockets open.
#[test]
fn an_nvme_queue_that_reads_nothing_loses_its_chunks_at_the_transport_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let t = TargetProcess::start(&nvme_config("transport_timeout = \"1s\"", "", &vol));
    let nvme = t.nvme_tcp_addr();
    let t0 = Instant::now();
    let held = nvme_reader_that_stops_reading(nvme, addr(2));
    wait_until("the reads hold chunks", Duration::from_secs(10), || chunks_in_use(&t) > 0.0);
    let took = wait_until("the chunks are back while the host holds its sockets", Duration::from_secs(10), || chunks_in_use(&t) == 0.0);
    eprintln!("the stalled queue's chunks were back {:?} after its reads ({took:?} of waiting)", t0.elapsed());
    t.wait_for_log_all(&["target.transport_timeout", "127.0.0.2"], Duration::from_secs(5));
    drop(held);
    t.assert_no_panic();
}

/// Eight NVMe/TCP hosts from eight addresses post reads they never read;
/// another host, from 127.0.0.250, connects and does its I/O meanwhile,
/// each command within 1 s.
#[test]
fn nvme_readers_that_stop_reading_from_eight_addresses_do_not_lock_out_a_host() {
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    // Anonymous NQNs may connect (allow_any_host, no [[host]] entries), so
    // the legitimate host is anonymous too: it proves nothing, it only
    // needs its fair share of the pool.
    let t = TargetProcess::start(&nvme_config("transport_timeout = \"60s\"", "", &vol));
    let nvme = t.nvme_tcp_addr();
    let held: Vec<_> = (0..8).map(|i| nvme_reader_that_stops_reading(nvme, addr(2 + i))).collect();
    wait_until("the attack holds chunks", Duration::from_secs(10), || chunks_in_use(&t) >= 256.0);
    let during = chunks_in_use(&t);
    eprintln!("8 NVMe/TCP hosts hold {during} chunks of 1024");
    let mut log = Timings::default();
    let result = nvme_host(nvme, &random_nqn(&mut rand::thread_rng()), None, 4, &mut log);
    eprintln!("{}{}", log.summary(), result.as_ref().err().map(|e| format!(", ended by {e}")).unwrap_or_default());
    log.assert_served("an NVMe host during the attack", 9 + 3 * 4);
    assert!(chunks_in_use(&t) >= during - 8.0, "the attack was in force throughout");
    drop(held);
    t.assert_no_panic();
}

/// `max_anonymous_controllers`: the anonymous controller beyond it is
/// refused, named in the log; a host with a DH-HMAC-CHAP secret is not
/// held to it.
#[test]
fn max_anonymous_controllers_refuses_the_next_anonymous_controller_and_no_authenticating_one() {
    let dir = tempfile::tempdir().unwrap();
    let vol = sparse_file(dir.path(), "vol.img", VOL_SIZE);
    let (secret, hosts) = legit_dhchap_host(dir.path());
    let extra = "max_controllers = 16\nmax_anonymous_controllers = 4";
    let t = TargetProcess::start(&nvme_config(extra, &hosts, &vol));
    let nvme = t.nvme_tcp_addr();
    // Discovery controllers are anonymous too (any NQN may open one).
    let held: Vec<NvmeTcpConn> =
        (0..4).map(|i| anonymous_controller(nvme, addr(2 + i), DISCOVERY_NQN).unwrap_or_else(|e| panic!("controller {i}: {e}"))).collect();
    let e = anonymous_controller(nvme, addr(6), DISCOVERY_NQN).err().expect("the fifth anonymous controller is refused");
    assert!(e.contains("SC 0x81"), "Connect Controller Busy: {e}");
    t.wait_for_log("target.max_anonymous_controllers = 4", Duration::from_secs(5));
    let mut log = Timings::default();
    let result = nvme_host(nvme, LEGIT_NQN, Some(&secret), 1, &mut log);
    eprintln!("{}{}", log.summary(), result.as_ref().err().map(|e| format!(", ended by {e}")).unwrap_or_default());
    log.assert_served("the host that authenticates", 11 + 3);
    assert_eq!(metric(&t, "rdmablk_nvme_controllers_evicted_total", &[]), 0.0, "the table was not full: nobody made room");
    drop(held);
    t.assert_no_panic();
}
