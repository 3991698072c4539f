//! Hostile input over the wire: raw bytes to the real daemon over tcp://.
//!
//! The whole table runs twice, once per store behind the attacked volume
//! (`rdmablk_system_tests::backing`): a file volume, and an RBD volume on an
//! image of the dev Ceph cluster (issue 54). Checks of what the volume holds
//! read the store as another reader sees it: the file's bytes, or the image
//! read back from Ceph by `rbd export`.
//!
//! Every case speaks to the daemon through a plain `TcpStream` with frames
//! built by hand (`rdmablk_system_tests::wire`, after docs/PROTOCOL.md's
//! framing section), below the fabric provider for the framing cases and
//! with hand-encoded capsules for the protocol cases. One daemon serves the
//! whole table; every case runs the same four checks:
//!
//! 1. the daemon answers with the specific status, or a TERMINATE with the
//!    specific code, or drops only that connection, and logs a line that
//!    names the hostile peer;
//! 2. a well-behaved session (the real initiator library) does verified I/O
//!    before the attack, while the hostile connection is open, and after;
//! 3. the volume's bytes, as the store holds them, equal a model that holds
//!    only what the good session wrote;
//! 4. the daemon's resident memory stays under a stated bound.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rdmablk_common::protocol::{
    CommandCapsule, CommandId, Opcode, Status, VolumeId, PROTOCOL_VERSION,
};
use rdmablk_initiator::{BlockDevice, ConnectOptions, Session, Volume};
use rdmablk_system_tests::raw::io_command as io;
use rdmablk_system_tests::wire::{self, Frame};
use rdmablk_system_tests::backing::{Backing, BackingKind};
use rdmablk_system_tests::{file_volume, open_fds, rss_bytes, TargetProcess, WireConn, WireEvent};

const MIB: u64 = 1 << 20;
const VOL_SIZE: u64 = 16 * MIB;
const BS: u32 = 4096;
/// `target.handshake_timeout` of the suite's daemon.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// How far the daemon's RSS may grow over its settled size during the suite.
const RSS_GROWTH_BOUND: u64 = 48 * MIB;

/// What the daemon must do about a case.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Answer the last command with this status (the connection stays up).
    Status(Status),
    /// Send TERMINATE with this code, then close the connection.
    Terminate(u32),
    /// Close the connection.
    Closed,
    /// The attacker hangs up mid-command; the daemon cleans up.
    AttackerHangsUp,
}

type Attack = fn(&Env) -> WireConn;

struct Case {
    name: &'static str,
    attack: Attack,
    expect: Expect,
    /// Besides the peer's address, the daemon's log line must contain these.
    log: &'static [&'static str],
}

/// What attacks need to know.
struct Env {
    url: String,
    /// The id of "vol" (open in the good session).
    vol: VolumeId,
}

/// A hostile connection that passed HELLO and CONNECT (depth `depth`) and
/// opened "vol"; returns it and vol's id.
fn connected(env: &Env, depth: u32) -> (WireConn, VolumeId) {
    let mut c = WireConn::hello(&env.url);
    c.connect("hostile-host", depth);
    let info = c.open_volume("vol");
    (c, info.volume_id)
}

/// A WRITE of `blocks` blocks at block 0 of vol, from the attacker's memory.
fn write_cmd(c: &WireConn, vol: VolumeId, blocks: u32) -> CommandCapsule {
    io(Opcode::Write, vol, 0, blocks, c.descriptor(0, blocks * BS))
}

/// Waits until the daemon has asked for `n` RDMA READs (its WRITEs are in flight).
fn await_read_requests(c: &mut WireConn, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.read_reqs.len() < n {
        assert!(Instant::now() < deadline, "the daemon never RDMA-READ the data ({} of {n})", c.read_reqs.len());
        match c.next_event(Duration::from_millis(50)) {
            WireEvent::Silence => {}
            other => panic!("unexpected while waiting for RDMA READs: {other:?}"),
        }
    }
}

fn cases() -> Vec<Case> {
    vec![
        // ---- framing, before and during the HELLO (the provider's listener)
        Case {
            name: "garbage bytes instead of a HELLO",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&[0xa5; 64]);
                c
            },
            expect: Expect::Closed,
            log: &["dropping a connection in its handshake", "unknown frame type 165"],
        },
        Case {
            name: "HELLO with a wrong magic",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&wire::hello_with(u32::from_le_bytes(*b"NOPE"), wire::VERSION, [64, 64, 1, 1, 0], &[]));
                c
            },
            expect: Expect::Closed,
            log: &["refusing a connection", "bad magic"],
        },
        Case {
            name: "HELLO with a wrong provider version",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&wire::hello_with(wire::MAGIC, 99, [64, 64, 1, 1, 0], &[]));
                c
            },
            expect: Expect::Closed,
            log: &["refusing a connection", "provider version 99"],
        },
        Case {
            name: "HELLO with an oversize length field",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&Frame { length: 1 << 30, ..Frame::new(wire::HELLO) }.encode());
                c
            },
            expect: Expect::Closed,
            log: &["dropping a connection in its handshake", "hello body of 1073741824 bytes"],
        },
        Case {
            name: "a SEND before the HELLO",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&Frame { seq: 1, length: 64, ..Frame::new(wire::SEND) }.encode());
                c.send(&[0; 64]);
                c
            },
            expect: Expect::Closed,
            log: &["dropping a connection in its handshake", "expected HELLO"],
        },
        Case {
            name: "truncated HELLO, then the attacker closes",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&wire::hello()[..20]);
                c.stream.shutdown(std::net::Shutdown::Write).unwrap();
                c
            },
            expect: Expect::Closed,
            log: &["dropping a connection in its handshake", "peer closed"],
        },
        Case {
            name: "slowloris: half a HELLO, then silence",
            attack: |env| {
                let mut c = WireConn::raw(&env.url);
                c.send(&wire::hello()[..16]);
                c
            },
            expect: Expect::Closed,
            log: &["did not complete its hello in time"],
        },
        Case {
            name: "HELLO, then never a CONNECT",
            attack: |env| WireConn::hello(&env.url),
            expect: Expect::Closed,
            log: &["no successful CONNECT within", "target.handshake_timeout"],
        },
        // ---- framing after the HELLO (the provider's queue pair)
        Case {
            name: "unknown frame type",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.send_frame(Frame::new(0x77), &[], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "unknown frame type 119"],
        },
        Case {
            name: "reserved header bytes set",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.send_frame(Frame { reserved: 0xbeef, ..Frame::new(wire::ACK) }, &[], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "reserved field"],
        },
        Case {
            name: "frame length above the provider's maximum",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                let seq = c.take_seq();
                c.send_frame(Frame { seq, length: u32::MAX, ..Frame::new(wire::SEND) }, &[0; 64], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "payload length 4294967295"],
        },
        Case {
            name: "SEND larger than the daemon's receive buffer",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                let seq = c.take_seq();
                c.send_frame(Frame { seq, length: MIB as u32, ..Frame::new(wire::SEND) }, &[0; 4096], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["session disconnected", "local length error"],
        },
        Case {
            name: "wrong sequence number",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.send_frame(Frame { seq: 7, length: 64, ..Frame::new(wire::SEND) }, &[0; 64], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "seq 7 where 1 was due"],
        },
        Case {
            name: "acknowledges frames the daemon never sent",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.send_frame(Frame { ack: 1000, ..Frame::new(wire::ACK) }, &[], true);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "ack 1000 outside"],
        },
        Case {
            name: "a second HELLO after the handshake",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.send(&wire::hello());
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "Hello after the handshake"],
        },
        Case {
            name: "READ_RESP without an RDMA READ",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.send_frame(Frame { length: 8, aux: 1, ..Frame::new(wire::READ_RESP) }, &[0; 8], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_INVALID_REQUEST),
            log: &["protocol error from peer", "READ_RESP without an outstanding READ"],
        },
        Case {
            name: "RDMA WRITE into target memory that was never registered",
            attack: |env| {
                let (mut c, _) = connected(env, 8);
                let seq = c.take_seq();
                let h = Frame { seq, length: 4096, addr: 0x1000, rkey: 0xdead_beef, flags: wire::FLAG_ACK_REQUESTED, ..Frame::new(wire::WRITE) };
                c.send_frame(h, &[0x66; 4096], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_REMOTE_ACCESS),
            log: &["session disconnected"],
        },
        Case {
            name: "RDMA READ of target memory out of bounds",
            attack: |env| {
                let (mut c, _) = connected(env, 8);
                let seq = c.take_seq();
                // Small keys are the likeliest to exist; the range wraps the address space.
                let h = Frame { seq, addr: u64::MAX - 100, rkey: 1, aux: 4096, ..Frame::new(wire::READ_REQ) };
                c.send_frame(h, &[], false);
                c
            },
            expect: Expect::Terminate(wire::TERM_REMOTE_ACCESS),
            log: &["session disconnected"],
        },
        Case {
            name: "truncated frame, then the attacker closes",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let seq = c.take_seq();
                let cmd = write_cmd(&c, vol, 1).to_bytes();
                c.send_frame(Frame { seq, length: 64, ..Frame::new(wire::SEND) }, &cmd[..20], false);
                c.stream.shutdown(std::net::Shutdown::Write).unwrap();
                c
            },
            expect: Expect::Closed,
            log: &["session disconnected"],
        },
        // ---- capsules (protocol v1) inside well-formed frames
        Case {
            name: "truncated capsule",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let mut cmd = write_cmd(&c, vol, 1);
                cmd.command_id = CommandId(0x4242);
                c.send_message(&cmd.to_bytes()[..40]);
                c
            },
            expect: Expect::Status(Status::InvalidField),
            log: &["command 16962 refused"],
        },
        Case {
            name: "I/O before CONNECT",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                let d = c.descriptor(0, BS);
                c.post(io(Opcode::Read, VolumeId(1), 0, 1, d), &[]);
                c
            },
            expect: Expect::Status(Status::NotConnected),
            log: &["refused", "before CONNECT"],
        },
        Case {
            name: "CONNECT sent twice",
            attack: |env| {
                let (mut c, _) = connected(env, 8);
                let mut cc = CommandCapsule::new(Opcode::Connect, CommandId(0));
                cc.version = PROTOCOL_VERSION;
                cc.queue_depth = 8;
                cc.max_io_size = 1 << 20;
                c.post(cc, b"hostile-host");
                c
            },
            expect: Expect::Status(Status::AlreadyConnected),
            log: &["refused", "second CONNECT"],
        },
        Case {
            name: "wrong protocol version",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                let mut cc = CommandCapsule::new(Opcode::Connect, CommandId(0));
                cc.version = PROTOCOL_VERSION + 7;
                cc.queue_depth = 8;
                cc.max_io_size = 1 << 20;
                c.post(cc, b"future-host");
                c
            },
            expect: Expect::Status(Status::VersionMismatch),
            log: &["speaks protocol version 8"],
        },
        Case {
            name: "host id longer than the protocol allows",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                let mut cc = CommandCapsule::new(Opcode::Connect, CommandId(0));
                cc.version = PROTOCOL_VERSION;
                cc.queue_depth = 8;
                cc.max_io_size = 1 << 20;
                c.post(cc, &[b'h'; 300]);
                c
            },
            expect: Expect::Status(Status::InvalidField),
            log: &["refused", "host id"],
        },
        Case {
            name: "unknown opcode",
            attack: |env| {
                let (mut c, _) = connected(env, 8);
                let mut raw = CommandCapsule::new(Opcode::KeepAlive, CommandId(0x77)).to_bytes();
                raw[0] = 0x7f;
                c.send_message(&raw);
                c
            },
            expect: Expect::Status(Status::InvalidOpcode),
            log: &["command 119 refused"],
        },
        Case {
            name: "I/O to an unknown volume",
            attack: |env| {
                let (mut c, _) = connected(env, 8);
                let d = c.descriptor(0, BS);
                c.post(io(Opcode::Read, VolumeId(9999), 0, 1, d), &[]);
                c
            },
            expect: Expect::Status(Status::UnknownVolume),
            log: &["refused"],
        },
        Case {
            name: "I/O to a volume this session did not open",
            attack: |env| {
                let mut c = WireConn::hello(&env.url);
                c.connect("hostile-host", 8);
                // "vol" exists (the good session has it open), but not for this session.
                let d = c.descriptor(0, BS);
                c.post(io(Opcode::Write, env.vol, 0, 1, d), &[]);
                c
            },
            expect: Expect::Status(Status::VolumeNotOpen),
            log: &["refused"],
        },
        Case {
            name: "offset past the end",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let d = c.descriptor(0, BS);
                c.post(io(Opcode::Write, vol, VOL_SIZE / BS as u64, 1, d), &[]);
                c
            },
            expect: Expect::Status(Status::OutOfRange),
            log: &["refused"],
        },
        Case {
            name: "offset + length overflows u64",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let d = c.descriptor(0, 4 * BS);
                c.post(io(Opcode::Write, vol, u64::MAX - 1, 4, d), &[]);
                c
            },
            expect: Expect::Status(Status::OutOfRange),
            log: &["refused"],
        },
        Case {
            name: "misaligned length",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let d = c.descriptor(0, BS + 512);
                c.post(io(Opcode::Write, vol, 0, 1, d), &[]);
                c
            },
            expect: Expect::Status(Status::Misaligned),
            log: &["refused"],
        },
        Case {
            name: "zero-length command",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let d = c.descriptor(0, 0);
                c.post(io(Opcode::Write, vol, 0, 0, d), &[]);
                c
            },
            expect: Expect::Status(Status::ZeroLength),
            log: &["refused"],
        },
        Case {
            name: "length above the max I/O size",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let d = c.descriptor(0, 2 * MIB as u32);
                c.post(io(Opcode::Write, vol, 0, 2 * MIB as u32 / BS, d), &[]);
                c
            },
            expect: Expect::Status(Status::TooLarge),
            log: &["refused"],
        },
        Case {
            name: "more commands than the negotiated queue depth",
            attack: |env| {
                let (mut c, vol) = connected(env, 2);
                // Hold two WRITEs in flight: their RDMA READs go unanswered.
                c.serve_reads = false;
                let w = write_cmd(&c, vol, 1);
                c.post(w, &[]);
                c.post(w, &[]);
                await_read_requests(&mut c, 2);
                c.post(CommandCapsule::new(Opcode::KeepAlive, CommandId(0)), &[]);
                c
            },
            expect: Expect::Status(Status::QueueFull),
            log: &["refused", "negotiated queue depth 2"],
        },
        Case {
            name: "READ into a descriptor whose rkey was never registered",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let mut d = c.descriptor(0, BS);
                d.rkey ^= 0x5a5a_5a5a;
                c.post(io(Opcode::Read, vol, 0, 1, d), &[]);
                c
            },
            // The attacker's "NIC" refuses the daemon's RDMA WRITE, as hardware would.
            expect: Expect::Closed,
            log: &["session disconnected", "RDMA WRITE failed"],
        },
        Case {
            name: "WRITE from a descriptor whose rkey was never registered",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                let mut d = c.descriptor(0, 8 * BS);
                d.rkey ^= 0x5a5a_5a5a;
                c.post(io(Opcode::Write, vol, 0, 8, d), &[]);
                c
            },
            expect: Expect::Closed,
            log: &["session disconnected", "RDMA READ failed"],
        },
        Case {
            name: "the attacker closes the connection mid-command",
            attack: |env| {
                let (mut c, vol) = connected(env, 8);
                c.serve_reads = false;
                let w = write_cmd(&c, vol, 64);
                c.post(w, &[]);
                await_read_requests(&mut c, 1);
                c
            },
            expect: Expect::AttackerHangsUp,
            log: &["session disconnected"],
        },
    ]
}

/// The well-behaved session and what the volume must hold.
struct Suite {
    target: TargetProcess,
    store: Backing,
    model: Vec<u8>,
    vol: Volume,
    session: Session,
    rng: rand::rngs::StdRng,
    good_ios: u64,
    rss_settled: u64,
    rss_max: u64,
    fds_settled: usize,
    _dir: tempfile::TempDir,
}

impl Suite {
    fn start(kind: BackingKind) -> Suite {
        let dir = tempfile::tempdir().unwrap();
        let store = Backing::new(kind, dir.path(), "vol.img", VOL_SIZE);
        let model: Vec<u8> = (0..VOL_SIZE).map(|x| (x as u8).wrapping_mul(29).wrapping_add(7)).collect();
        store.write_at(&model, 0);
        assert!(store.contents() == model, "the store holds the pattern before the target starts");
        let other = dir.path().join("other.img");
        std::fs::write(&other, vec![0x11u8; 4 * MIB as usize]).unwrap();
        let config = format!(
            "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nreactors = 2\npin_reactors = false\nqueue_depth = 32\n\
             buffer_pool = \"8MiB\"\nhandshake_timeout = \"{}s\"\n\n{}\n{}",
            HANDSHAKE_TIMEOUT.as_secs(),
            store.volume("vol", VOL_SIZE, false),
            file_volume("other", &other, 4 * MIB, false)
        );
        // Refused commands are logged at debug level (a flood of bad
        // commands must not flood the log by default); this suite wants them.
        let target = TargetProcess::start_with_env(&config, &[("RUST_LOG", "info,rdmablk_target::v1=debug")], &[]);
        let opts = ConnectOptions { host_id: "good-host".into(), queues: 1, ..ConnectOptions::default() };
        let session = Session::connect(target.url.as_str(), opts).expect("good session connects");
        let vol = session.open("vol").expect("good session opens vol");
        let mut s = Suite {
            target,
            store,
            model,
            vol,
            session,
            rng: rand::rngs::StdRng::seed_from_u64(0x05ca1ab1e),
            good_ios: 0,
            rss_settled: 0,
            rss_max: 0,
            fds_settled: 0,
            _dir: dir,
        };
        // Warm up (pool chunks touched, rings set up) before measuring.
        for _ in 0..32 {
            s.good_io("warm-up");
        }
        s.rss_settled = rss_bytes(s.target.pid());
        s.fds_settled = open_fds(s.target.pid());
        s
    }

    /// One verified write and read of the good session, recorded in the model.
    fn good_io(&mut self, when: &str) {
        let blocks = self.rng.gen_range(1..=16u64);
        let lba = self.rng.gen_range(0..VOL_SIZE / BS as u64 - blocks);
        let (off, len) = (lba * BS as u64, (blocks * BS as u64) as usize);
        let mut data = vec![0u8; len];
        self.rng.fill(&mut data[..]);
        self.vol.write_at(&data, off).unwrap_or_else(|e| panic!("good session write ({when}): {e}"));
        self.model[off as usize..off as usize + len].copy_from_slice(&data);
        let mut back = vec![0u8; len];
        self.vol.read_at(&mut back, off).unwrap_or_else(|e| panic!("good session read ({when}): {e}"));
        assert!(back == data, "good session read back other bytes ({when}) at {off}");
        self.good_ios += 1;
    }

    /// What the store holds (the file, or the image as Ceph has it) equals the model.
    fn check_volume(&self, case: &str) {
        let held = self.store.contents();
        assert_eq!(held.len(), self.model.len(), "{case}: the {:?} store holds {} bytes", self.store.kind(), held.len());
        if let Some(at) = held.iter().zip(&self.model).position(|(a, b)| a != b) {
            let end = (at + 16).min(held.len());
            panic!(
                "{case}: the {:?} volume holds bytes the good session did not write: first at byte {at} (block {}): {:02x?}, model {:02x?}",
                self.store.kind(),
                at / BS as usize,
                &held[at..end],
                &self.model[at..end]
            );
        }
    }

    fn check_memory(&mut self, case: &str) {
        let rss = rss_bytes(self.target.pid());
        self.rss_max = self.rss_max.max(rss);
        assert!(
            rss <= self.rss_settled + RSS_GROWTH_BOUND,
            "{case}: daemon RSS {} MiB, settled at {} MiB, bound +{} MiB",
            rss / MIB,
            self.rss_settled / MIB,
            RSS_GROWTH_BOUND / MIB
        );
    }

    fn run(&mut self, env: &Env, case: &Case) {
        let name = case.name;
        self.good_io("before");
        let mut conn = (case.attack)(env);
        let peer = conn.peer.clone();
        self.good_io("during");
        match case.expect {
            Expect::Status(want) => match conn.next_event(Duration::from_secs(10)) {
                WireEvent::Response(r, _) => {
                    assert_eq!(r.status, want, "{name}: status");
                    if want == Status::VersionMismatch {
                        assert_eq!(r.detail, PROTOCOL_VERSION as u32, "{name}: the daemon names its version");
                    }
                }
                other => panic!("{name}: expected {want:?}, got {other:?}"),
            },
            Expect::Terminate(code) => {
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    match conn.next_event(deadline.saturating_duration_since(Instant::now())) {
                        WireEvent::Terminated { code: got, .. } => {
                            assert_eq!(got, code, "{name}: TERMINATE code");
                            break;
                        }
                        WireEvent::Response(..) => {}
                        other => panic!("{name}: expected TERMINATE {code}, got {other:?}"),
                    }
                }
                assert!(conn.wait_closed(Duration::from_secs(10)), "{name}: the daemon kept the connection after TERMINATE");
            }
            Expect::Closed => {
                let within = HANDSHAKE_TIMEOUT * 2 + Duration::from_secs(5);
                assert!(conn.wait_closed(within), "{name}: the daemon did not close the connection within {within:?}");
            }
            Expect::AttackerHangsUp => {
                let _ = conn.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        let mut needles = vec![peer.as_str()];
        needles.extend_from_slice(case.log);
        let line = self.target.wait_for_log_all(&needles, Duration::from_secs(15));
        eprintln!("{name}: {line}");
        drop(conn);
        self.good_io("after");
        // On rbd this is an `rbd export` of the 16 MiB image per case, about
        // 0.2 s on the dev cluster: cheap enough to check after every case.
        self.check_volume(name);
        self.check_memory(name);
        self.target.assert_no_panic();
    }
}

#[test]
fn hostile_input_is_refused_specifically_and_hurts_no_one_else() {
    run_suite(BackingKind::File);
}

/// The same table against a volume on an image of the dev Ceph cluster.
#[test]
fn hostile_input_is_refused_specifically_and_hurts_no_one_else_on_rbd() {
    run_suite(BackingKind::Rbd);
}

fn run_suite(kind: BackingKind) {
    let table = cases();
    assert!(table.len() >= 25, "the suite covers at least 25 distinct cases");
    let mut names: Vec<&str> = table.iter().map(|c| c.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), table.len(), "case names are distinct");

    let mut suite = Suite::start(kind);
    let env = Env { url: suite.target.url.clone(), vol: suite.vol.id() };
    let t0 = Instant::now();
    for case in &table {
        suite.run(&env, case);
    }

    // The good session never lost its connection to any of it.
    assert!(suite.session.is_connected(), "the good session survived");
    assert_eq!(suite.session.stats().reconnects, 0, "the good session never had to reconnect");
    // Every hostile connection is gone: descriptors back near where they settled.
    let pid = suite.target.pid();
    let settled = suite.fds_settled;
    rdmablk_system_tests::wait_until("daemon descriptors back to their settled count", Duration::from_secs(15), || {
        open_fds(pid) <= settled + 2
    });
    suite.check_volume("end");
    eprintln!(
        "hostile on {kind:?}: {} cases in {:?}; good session {} verified write+read rounds; daemon RSS settled {} KiB, max {} KiB (bound +{} MiB); fds settled {}, end {}",
        table.len(),
        t0.elapsed(),
        suite.good_ios,
        suite.rss_settled / 1024,
        suite.rss_max / 1024,
        RSS_GROWTH_BOUND / MIB,
        settled,
        open_fds(pid)
    );
    // The daemon still shuts down cleanly (an rbd volume flushes and closes
    // its image, so that dropping the store need not wait out the watch of a
    // killed gateway), and the store it leaves holds the model.
    suite.target.signal(libc::SIGTERM);
    let code = suite.target.wait_exit(Duration::from_secs(20));
    assert_eq!(code, Some(0), "the daemon's exit on SIGTERM after the suite; log:\n{}", suite.target.log().join("\n"));
    suite.check_volume("after the daemon's exit");
}
