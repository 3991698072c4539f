//! The production daemon, end to end through the real binary: several
//! backends at once, read-only volumes, SIGHUP reloads, SIGTERM during a
//! queue-depth-32 write run, systemd notifications, the metrics endpoint,
//! and a multi-queue session spread over two reactors.

use std::collections::HashMap;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use rdmablk_common::protocol::{
    CommandCapsule, CommandId, DataDescriptor, Opcode, SessionId, Status, VolumeId, VolumeInfo,
    FLAG_FUA, FLAG_INLINE_DATA, VOLUME_FLAG_DISCARD, VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES, VOLUME_INFO_SIZE,
};
use rdmablk_system_tests::raw::io_command as io;
use rdmablk_system_tests::raw::RawQueue;
use rdmablk_system_tests::{
    bin, file_bytes, file_digest, file_volume, http_get, memory_volume, null_volume, sample, scrape,
    sparse_file, target_section, TargetProcess,
};

const MIB: u64 = 1 << 20;
const BS: u32 = 4096;

fn seed() -> u64 {
    let s = std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("seed {s} (set RDMABLK_TEST_SEED to replay)");
    s
}

fn random(rng: &mut impl RngCore, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    v
}

fn status(q: &mut RawQueue, c: CommandCapsule, inline: &[u8]) -> Status {
    let mut c = c;
    c.inline_len = inline.len() as u32;
    q.command(c, inline).unwrap_or_else(|e| panic!("no response to {c:?}: {e:?}")).capsule.status
}

/// WRITE of `data` at block `lba` (4 KiB blocks), from the start of the data buffer.
fn write(q: &mut RawQueue, vol: VolumeId, lba: u64, data: &[u8], fua: bool) -> Status {
    q.data_mut()[..data.len()].copy_from_slice(data);
    let mut c = io(Opcode::Write, vol, lba, (data.len() / BS as usize) as u32, q.descriptor(0, data.len() as u32));
    if fua {
        c.flags |= FLAG_FUA;
    }
    status(q, c, &[])
}

fn write_inline(q: &mut RawQueue, vol: VolumeId, lba: u64, data: &[u8]) -> Status {
    let mut c = io(Opcode::Write, vol, lba, (data.len() / BS as usize) as u32, DataDescriptor::default());
    c.flags = FLAG_INLINE_DATA;
    status(q, c, data)
}

fn read(q: &mut RawQueue, vol: VolumeId, lba: u64, len: usize) -> (Status, Vec<u8>) {
    q.data_mut()[..len].fill(0xee);
    let c = io(Opcode::Read, vol, lba, (len / BS as usize) as u32, q.descriptor(0, len as u32));
    let st = status(q, c, &[]);
    (st, q.data()[..len].to_vec())
}

fn range(q: &mut RawQueue, op: Opcode, vol: VolumeId, lba: u64, blocks: u32) -> Status {
    status(q, io(op, vol, lba, blocks, DataDescriptor::default()), &[])
}

fn flush(q: &mut RawQueue, vol: VolumeId) -> Status {
    status(q, io(Opcode::Flush, vol, 0, 0, DataDescriptor::default()), &[])
}

fn list(q: &mut RawQueue) -> Vec<VolumeInfo> {
    let mut c = CommandCapsule::new(Opcode::ListVolumes, CommandId(0));
    c.descriptor = q.descriptor(0, 32 * VOLUME_INFO_SIZE as u32);
    let r = q.command(c, &[]).expect("LIST");
    assert_eq!(r.capsule.status, Status::Success);
    (0..r.capsule.result as usize)
        .map(|i| VolumeInfo::decode(&q.data()[i * VOLUME_INFO_SIZE..(i + 1) * VOLUME_INFO_SIZE]).unwrap())
        .collect()
}

fn close(q: &mut RawQueue, vol: VolumeId) -> Status {
    let mut c = CommandCapsule::new(Opcode::CloseVolume, CommandId(0));
    c.volume_id = vol;
    status(q, c, &[])
}

fn ids(vols: &[VolumeInfo]) -> HashMap<String, VolumeId> {
    vols.iter().map(|v| (v.name.clone(), v.volume_id)).collect()
}

/// Waits until `f` holds, polling every 20 ms, or panics with `what`.
fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn several_volumes_of_each_backend_are_served_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let f0 = sparse_file(dir.path(), "f0.img", 16 * MIB);
    let f1 = dir.path().join("f1.img"); // created by the target
    let config = format!(
        "{}reactors = 2\n{}{}{}{}{}{}",
        target_section(),
        file_volume("f0", &f0, 16 * MIB, false),
        file_volume("f1", &f1, 32 * MIB, false),
        memory_volume("m0", 32 * MIB, false),
        memory_volume("m1", 8 * MIB, false),
        null_volume("n0", 1 << 30),
        null_volume("n1", 64 * MIB),
    );
    let target = TargetProcess::start(&config);
    for name in ["f0", "f1", "m0", "m1", "n0", "n1"] {
        target.wait_for_log(&format!("volume {name} (id"), Duration::from_secs(5));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let (mut q, _) = RawQueue::connected(&target.url, 4 << 20);

    let vols = list(&mut q);
    let names: Vec<&str> = vols.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["f0", "f1", "m0", "m1", "n0", "n1"]);
    for v in &vols {
        assert_eq!(v.flags, VOLUME_FLAG_DISCARD | VOLUME_FLAG_WRITE_ZEROES, "{} advertises {:#x}", v.name, v.flags);
        assert_eq!(v.block_size, BS);
    }
    assert_eq!(vols[4].size_bytes, 1 << 30);

    let mut expect: HashMap<&str, Vec<u8>> = HashMap::new();
    for name in ["f0", "f1", "m0", "m1", "n0", "n1"] {
        let info = q.open_volume(name).expect("open");
        let id = info.volume_id;
        let null = name.starts_with('n');
        // 1 MiB: eight pool chunks, pipelined; FUA on the file volumes.
        let big = random(&mut rng, MIB as usize);
        assert_eq!(write(&mut q, id, 16, &big, name.starts_with('f')), Status::Success, "{name}");
        // An inline write of one block.
        let small = random(&mut rng, BS as usize);
        assert_eq!(write_inline(&mut q, id, 3, &small), Status::Success, "{name}");
        let (st, back) = read(&mut q, id, 16, MIB as usize);
        assert_eq!(st, Status::Success);
        let (st, back_small) = read(&mut q, id, 3, BS as usize);
        assert_eq!(st, Status::Success);
        if null {
            assert!(back.iter().chain(&back_small).all(|&b| b == 0), "{name}: null reads must be zeroes");
        } else {
            assert!(back == big, "{name}: read back other bytes");
            assert!(back_small == small, "{name}: inline write not read back");
        }
        // WRITE_ZEROES over 4 blocks inside the big write, DISCARD elsewhere.
        assert_eq!(range(&mut q, Opcode::WriteZeroes, id, 20, 4), Status::Success, "{name}");
        assert_eq!(range(&mut q, Opcode::Discard, id, 300, 8), Status::Success, "{name}");
        let (st, back) = read(&mut q, id, 16, 12 * BS as usize);
        assert_eq!(st, Status::Success);
        assert!(back[4 * BS as usize..8 * BS as usize].iter().all(|&b| b == 0), "{name}: WRITE_ZEROES");
        if !null {
            assert!(back[..4 * BS as usize] == big[..4 * BS as usize], "{name}: WRITE_ZEROES spilled");
            assert!(back[8 * BS as usize..] == big[8 * BS as usize..12 * BS as usize], "{name}: WRITE_ZEROES spilled");
        }
        assert_eq!(flush(&mut q, id), Status::Success, "{name}");
        let mut model = vec![0u8; (16 * MIB) as usize];
        model[3 * BS as usize..4 * BS as usize].copy_from_slice(&small);
        model[16 * BS as usize..16 * BS as usize + MIB as usize].copy_from_slice(&big);
        model[20 * BS as usize..24 * BS as usize].fill(0);
        expect.insert(name, model);
    }

    // The file volumes hold the bytes (the discarded range is unspecified; it was never written).
    for (name, path) in [("f0", &f0), ("f1", &f1)] {
        let model = &expect[name];
        let got = file_bytes(path, 0, (16 * MIB) as usize);
        let diff = got.iter().zip(model.iter()).position(|(a, b)| a != b);
        assert_eq!(diff, None, "{name}: backing file differs from byte {diff:?} on (block {:?})", diff.map(|d| d / BS as usize));
    }
    // RAM volumes keep their data across sessions while the target runs.
    drop(q);
    let (mut q2, _) = RawQueue::connected(&target.url, 4 << 20);
    let m0 = q2.open_volume("m0").unwrap().volume_id;
    for half in 0..2u64 {
        let (st, back) = read(&mut q2, m0, half * 256, MIB as usize);
        assert_eq!(st, Status::Success);
        let at = (half * MIB) as usize;
        assert!(back == expect["m0"][at..at + MIB as usize], "m0 lost its data between sessions");
    }
}

#[test]
fn writes_to_read_only_volumes_fail_with_their_status() {
    let dir = tempfile::tempdir().unwrap();
    let ro_file = sparse_file(dir.path(), "ro.img", 8 * MIB);
    std::fs::write(&ro_file, vec![0x5au8; (8 * MIB) as usize]).unwrap();
    let config = format!(
        "{}metrics = \"127.0.0.1:0\"\n{}{}{}",
        target_section(),
        file_volume("ro-file", &ro_file, 8 * MIB, true),
        memory_volume("ro-mem", 8 * MIB, true),
        null_volume("rw-null", 8 * MIB),
    );
    let target = TargetProcess::start(&config);
    let before = file_digest(&ro_file);
    let (mut q, _) = RawQueue::connected(&target.url, 1 << 20);
    for name in ["ro-file", "ro-mem"] {
        let info = q.open_volume(name).unwrap();
        assert_eq!(info.flags, VOLUME_FLAG_READ_ONLY, "{name}: read-only volumes advertise nothing else");
        let id = info.volume_id;
        let data = vec![1u8; 8192];
        assert_eq!(write(&mut q, id, 0, &data, false), Status::ReadOnly, "{name}: WRITE");
        assert_eq!(write(&mut q, id, 0, &data, true), Status::ReadOnly, "{name}: WRITE FUA");
        assert_eq!(write_inline(&mut q, id, 1, &data[..4096]), Status::ReadOnly, "{name}: inline WRITE");
        assert_eq!(range(&mut q, Opcode::Discard, id, 0, 1), Status::ReadOnly, "{name}: DISCARD");
        assert_eq!(range(&mut q, Opcode::WriteZeroes, id, 0, 1), Status::ReadOnly, "{name}: WRITE_ZEROES");
        let (st, back) = read(&mut q, id, 0, 8192);
        assert_eq!(st, Status::Success, "{name}: READ");
        let want = if name == "ro-file" { 0x5a } else { 0 };
        assert!(back.iter().all(|&b| b == want), "{name}");
        assert_eq!(flush(&mut q, id), Status::Success, "{name}: FLUSH of a read-only volume");
    }
    assert_eq!(file_digest(&ro_file), before, "a refused write changed the file");

    // Through the library as well: the status becomes a typed error.
    let session = rdmablk_initiator::Session::connect(&target.url, Default::default()).unwrap();
    let vol = session.open("ro-mem").unwrap();
    let err = rdmablk_initiator::BlockDevice::write_at(&vol, &[1u8; 4096], 0).expect_err("write to a read-only volume");
    assert_eq!(err.status(), Some(Status::ReadOnly), "{err}");

    // The refusals are counted against the volume (the library refuses
    // writes to a volume it knows is read-only without sending them).
    let m = scrape(&target.metrics_addr());
    let errors = |v: &str, op: &str| sample(&m, "rdmablk_volume_errors_total", &[("volume", v), ("op", op)]).unwrap();
    assert_eq!(errors("ro-file", "write"), 3.0);
    assert_eq!(errors("ro-mem", "write"), 3.0);
    assert_eq!(errors("ro-file", "discard"), 1.0);
    assert_eq!(errors("ro-file", "write_zeroes"), 1.0);
    assert_eq!(errors("ro-file", "read"), 0.0);
    assert_eq!(sample(&m, "rdmablk_volume_ops_total", &[("volume", "ro-file"), ("op", "read")]), Some(1.0));
}

#[test]
fn sighup_adds_a_volume_a_new_session_uses_while_an_open_session_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let a = sparse_file(dir.path(), "a.img", 16 * MIB);
    let c_path = dir.path().join("c.img");
    let base = format!("{}reactors = 2\n", target_section());
    let target = TargetProcess::start(&format!("{base}{}", file_volume("a", &a, 16 * MIB, false)));
    let url = target.url.clone();

    // The open session keeps doing I/O on "a" the whole time, checking every byte.
    let (mut q1, _) = RawQueue::connected(&url, 1 << 20);
    let a_id = q1.open_volume("a").unwrap().volume_id;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let worker = std::thread::spawn(move || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut rounds = 0u64;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) || rounds < 20 {
            let lba = (rounds % 512) * 8;
            let data = random(&mut rng, 32768);
            assert_eq!(write(&mut q1, a_id, lba, &data, false), Status::Success, "round {rounds}: write");
            let (st, back) = read(&mut q1, a_id, lba, data.len());
            assert_eq!(st, Status::Success, "round {rounds}: read");
            assert!(back == data, "round {rounds}: read back other bytes");
            rounds += 1;
        }
        (q1, rounds)
    });

    let config2 = format!(
        "{base}{}{}{}",
        file_volume("a", &a, 16 * MIB, false),
        memory_volume("b", 16 * MIB, false),
        file_volume("c", &c_path, 8 * MIB, false)
    );
    let summary = target.reload(&config2);
    assert!(summary.contains("reload complete: 2 added, 0 removed"), "{summary}");
    target.wait_for_log("reload: volume b added", Duration::from_secs(1));
    assert!(c_path.exists(), "the added file volume was created");

    // A new session sees and uses the new volumes; "a" kept its id.
    let (mut q2, _) = RawQueue::connected(&url, 1 << 20);
    let vols = ids(&list(&mut q2));
    assert_eq!(vols.len(), 3);
    assert_eq!(vols["a"], a_id, "a reload changed the id of an unchanged volume");
    for name in ["b", "c"] {
        let id = q2.open_volume(name).unwrap().volume_id;
        assert!(id.0 > a_id.0, "new volumes get new ids");
        let data = vec![name.as_bytes()[0]; 65536];
        assert_eq!(write(&mut q2, id, 10, &data, true), Status::Success, "{name}");
        assert_eq!(read(&mut q2, id, 10, 65536), (Status::Success, data.clone()), "{name}");
    }
    assert!(file_bytes(&c_path, 10 * 4096, 65536).iter().all(|&b| b == b'c'));

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut q1, rounds) = worker.join().expect("the open session failed during the reload");
    assert!(rounds >= 20, "{rounds}");
    // The old session can open the new volume too.
    let b_id = q1.open_volume("b").unwrap().volume_id;
    assert_eq!(read(&mut q1, b_id, 10, 4096), (Status::Success, vec![b'b'; 4096]));
    assert!(q1.is_alive());
}

#[test]
fn sighup_refuses_to_remove_an_open_volume_changes_read_only_flags_and_never_reuses_ids() {
    let dir = tempfile::tempdir().unwrap();
    let a = sparse_file(dir.path(), "a.img", 8 * MIB);
    let base = target_section();
    let v_a = file_volume("a", &a, 8 * MIB, false);
    let target = TargetProcess::start(&format!("{base}{v_a}{}{}", memory_volume("b", 8 * MIB, false), null_volume("c", 8 * MIB)));
    let (mut q1, _) = RawQueue::connected(&target.url, 1 << 20);
    let before = ids(&list(&mut q1));
    let a_id = q1.open_volume("a").unwrap().volume_id;

    // Without "a" (open in q1's session), with "b" read-only.
    let config2 = format!("{base}{}{}", memory_volume("b", 8 * MIB, true), null_volume("c", 8 * MIB));
    let summary = target.reload(&config2);
    assert!(summary.contains("0 removed, 1 read-only flag(s) changed, 0 replaced, 1 refused"), "{summary}");
    let why = target.wait_for_log("refusing to remove volume a", Duration::from_secs(1));
    assert!(why.contains("raw-test-host") && why.contains("open by"), "the log says why: {why}");
    // "a" still serves its session.
    assert_eq!(write(&mut q1, a_id, 0, &[7u8; 4096], false), Status::Success);
    let (mut q2, _) = RawQueue::connected(&target.url, 1 << 20);
    assert_eq!(ids(&list(&mut q2)), before, "ids must not change");
    let b = q2.open_volume("b").unwrap();
    assert!(b.read_only());
    assert_eq!(write(&mut q2, b.volume_id, 0, &[1u8; 4096], false), Status::ReadOnly);

    // Once no session has "a" open, the same reload removes it.
    assert_eq!(close(&mut q1, a_id), Status::Success);
    let summary = target.reload(&config2);
    assert!(summary.contains("0 added, 1 removed"), "{summary}");
    assert_eq!(q2.open_volume("a"), Err(Status::UnknownVolume));
    let mut c = io(Opcode::Read, a_id, 0, 1, q1.descriptor(0, 4096));
    c.inline_len = 0;
    assert_eq!(status(&mut q1, c, &[]), Status::UnknownVolume);
    target.wait_for_log("removed volume a (id", Duration::from_secs(5));

    // Added back: a new id, never the old one; "b" read-write again.
    let summary = target.reload(&format!("{base}{v_a}{}{}", memory_volume("b", 8 * MIB, false), null_volume("c", 8 * MIB)));
    assert!(summary.contains("1 added, 0 removed, 1 read-only flag(s) changed"), "{summary}");
    let after = ids(&list(&mut q2));
    assert_ne!(after["a"], a_id, "a volume id was reused");
    assert_eq!((after["b"], after["c"]), (before["b"], before["c"]));
    let a2 = q2.open_volume("a").unwrap().volume_id;
    assert_eq!(read(&mut q2, a2, 0, 4096), (Status::Success, vec![7u8; 4096]), "same file, data kept");
    assert_eq!(write(&mut q2, b.volume_id, 0, &[1u8; 4096], false), Status::Success);

    // A broken configuration changes nothing.
    let summary = target.reload("[target]\nlisten = [\"tcp://127.0.0.1:0\"]\nbogus = 1\n");
    assert!(summary.contains("reload failed") && summary.contains("bogus"), "{summary}");
    assert_eq!(ids(&list(&mut q2)).len(), 3);
}

#[test]
fn sigterm_during_qd32_writes_keeps_every_acknowledged_write() {
    const QD: usize = 32;
    const LEN: usize = 65536;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "v.img", 256 * MIB);
    let config = format!("{}shutdown_timeout = \"10s\"\n{}", target_section(), file_volume("v", &img, 256 * MIB, false));
    let mut target = TargetProcess::start(&config);
    let (mut q, reply) = RawQueue::connected_as(&target.url, QD * LEN, QD, "qd32-host", SessionId(0));
    assert_eq!(reply.queue_depth, QD as u32);
    let vol = q.open_volume("v").unwrap().volume_id;
    let pattern = |i: u64| -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(i ^ 0x5eed);
        random(&mut rng, LEN)
    };

    let mut next = 0u64; // next write index; write i goes to byte offset i * LEN
    let mut inflight: HashMap<CommandId, (u64, usize)> = HashMap::new();
    let mut free_slots: Vec<usize> = (0..QD).collect();
    let mut acked = Vec::new();
    let mut refused = 0;
    let mut signalled = false;
    let mut stopping = false;
    let mut max_inflight_at_signal = 0;
    loop {
        while !stopping && inflight.len() < QD {
            let slot = free_slots.pop().expect("a free buffer slot");
            let data = pattern(next);
            q.data_mut()[slot * LEN..(slot + 1) * LEN].copy_from_slice(&data);
            let mut c = io(Opcode::Write, vol, next * (LEN as u64 / 4096), (LEN / 4096) as u32, q.descriptor(slot * LEN, LEN as u32));
            if next % 3 == 0 {
                c.flags |= FLAG_FUA;
            }
            let id = q.post(c, &[]);
            inflight.insert(id, (next, slot));
            next += 1;
        }
        if !signalled && acked.len() >= 400 {
            max_inflight_at_signal = inflight.len();
            target.signal(libc::SIGTERM);
            signalled = true;
        }
        if inflight.is_empty() {
            break;
        }
        match q.next_response(Duration::from_secs(30)) {
            Ok(r) => {
                let (i, slot) = inflight.remove(&r.capsule.command_id).expect("a response to a command we sent");
                free_slots.push(slot);
                match r.capsule.status {
                    Status::Success => acked.push(i),
                    Status::ShuttingDown => {
                        refused += 1;
                        stopping = true;
                    }
                    s => panic!("write {i}: unexpected status {s:?}"),
                }
            }
            // The target disconnects once its in-flight commands are done.
            Err(e) => {
                assert!(signalled, "connection failed before SIGTERM: {e:?}");
                break;
            }
        }
    }
    assert!(signalled);
    assert_eq!(max_inflight_at_signal, QD, "SIGTERM must arrive with a full queue");
    let code = target.wait_exit(Duration::from_secs(30));
    assert_eq!(code, Some(0), "log:\n{}", target.log().join("\n"));
    target.wait_for_log("shutdown complete", Duration::from_secs(1));
    eprintln!("{} writes acknowledged, {refused} refused with SHUTTING_DOWN, {} unanswered", acked.len(), inflight.len());
    let file = std::fs::read(&img).unwrap();
    for &i in &acked {
        let off = i as usize * LEN;
        assert!(file[off..off + LEN] == pattern(i)[..], "acknowledged write {i} is not in the file");
    }
}

fn recv_notifications(sock: &UnixDatagram, until: impl Fn(&[String]) -> bool, timeout: Duration) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !until(&got) {
        assert!(Instant::now() < deadline, "systemd notifications so far: {got:?}");
        sock.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    got
}

fn count(msgs: &[String], line: &str) -> usize {
    msgs.iter().filter(|m| m.lines().any(|l| l == line)).count()
}

#[test]
fn plays_systemd_ready_status_watchdog_reload_and_stop() {
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    let config = format!("{}reactors = 2\n{}", target_section(), memory_volume("m", 8 * MIB, false));
    let mut target = TargetProcess::start_with_env(
        &config,
        &[("NOTIFY_SOCKET", sock_path.to_str().unwrap()), ("WATCHDOG_USEC", "200000")],
        &[],
    );
    let msgs = recv_notifications(&sock, |m| count(m, "READY=1") >= 1 && count(m, "WATCHDOG=1") >= 2, Duration::from_secs(10));
    let ready = msgs.iter().find(|m| m.lines().any(|l| l == "READY=1")).unwrap();
    assert!(ready.contains("STATUS=serving 1 volume(s) on tcp://"), "{ready}");
    let first_watchdog = msgs.iter().position(|m| m == "WATCHDOG=1").unwrap();
    let first_ready = msgs.iter().position(|m| m.lines().any(|l| l == "READY=1")).unwrap();
    assert!(first_ready < first_watchdog, "READY=1 comes first: {msgs:?}");
    target.wait_for_log("systemd watchdog: pinging every 100ms", Duration::from_secs(1));

    // A reload is bracketed by RELOADING=1 and READY=1.
    target.signal(libc::SIGHUP);
    let msgs = recv_notifications(&sock, |m| count(m, "RELOADING=1") >= 1 && m.iter().rev().any(|x| x.starts_with("READY=1")), Duration::from_secs(10));
    let r = msgs.iter().position(|m| m == "RELOADING=1").unwrap();
    assert!(msgs[r..].iter().any(|m| m.starts_with("READY=1\nSTATUS=")), "{msgs:?}");

    // Watchdog pings keep coming while idle.
    recv_notifications(&sock, |m| count(m, "WATCHDOG=1") >= 3, Duration::from_secs(10));

    target.signal(libc::SIGTERM);
    recv_notifications(&sock, |m| m.iter().any(|x| x.starts_with("STOPPING=1")), Duration::from_secs(10));
    assert_eq!(target.wait_exit(Duration::from_secs(20)), Some(0));
}

#[test]
fn plays_systemd_with_an_abstract_socket() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("rdmablk-test-notify-{}-{}", std::process::id(), rand::random::<u32>());
    let sock = UnixDatagram::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let config = format!("{}{}", target_section(), null_volume("n", 8 * MIB));
    let at = format!("@{name}");
    let _target = TargetProcess::start_with_env(&config, &[("NOTIFY_SOCKET", &at), ("WATCHDOG_USEC", "100000")], &[]);
    recv_notifications(&sock, |m| count(m, "READY=1") >= 1 && count(m, "WATCHDOG=1") >= 2, Duration::from_secs(10));
}

#[test]
fn the_metrics_endpoint_is_scraped_and_parsed() {
    let dir = tempfile::tempdir().unwrap();
    let f = sparse_file(dir.path(), "f.img", 16 * MIB);
    let config = format!(
        "{}reactors = 2\nmetrics = \"127.0.0.1:0\"\n{}{}",
        target_section(),
        file_volume("f", &f, 16 * MIB, false),
        memory_volume("m", 16 * MIB, false)
    );
    let target = TargetProcess::start(&config);
    let addr = target.metrics_addr();
    let (mut q, _) = RawQueue::connected(&target.url, 1 << 20);
    let fid = q.open_volume("f").unwrap().volume_id;
    let mid = q.open_volume("m").unwrap().volume_id;
    for i in 0..5 {
        assert_eq!(write(&mut q, fid, i * 16, &[i as u8; 65536], false), Status::Success);
    }
    for i in 0..3 {
        assert_eq!(read(&mut q, fid, i * 32, 131072).0, Status::Success);
    }
    assert_eq!(read(&mut q, fid, 4096, 4096).0, Status::OutOfRange);
    assert_eq!(flush(&mut q, fid), Status::Success);
    assert_eq!(range(&mut q, Opcode::Discard, fid, 0, 4), Status::Success);
    for _ in 0..2 {
        assert_eq!(write(&mut q, mid, 0, &[9u8; 8192], false), Status::Success);
    }
    assert_eq!(range(&mut q, Opcode::WriteZeroes, mid, 0, 2), Status::Success);

    let m = scrape(&addr);
    let get = |name: &str, labels: &[(&str, &str)]| sample(&m, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} missing"));
    let vo = |v: &'static str, op: &'static str| [("volume", v), ("op", op)];
    assert_eq!(get("rdmablk_volume_ops_total", &vo("f", "write")), 5.0);
    assert_eq!(get("rdmablk_volume_bytes_total", &vo("f", "write")), 5.0 * 65536.0);
    assert_eq!(get("rdmablk_volume_ops_total", &vo("f", "read")), 4.0);
    assert_eq!(get("rdmablk_volume_errors_total", &vo("f", "read")), 1.0);
    assert_eq!(get("rdmablk_volume_bytes_total", &vo("f", "read")), 3.0 * 131072.0);
    assert_eq!(get("rdmablk_volume_ops_total", &vo("f", "flush")), 1.0);
    assert_eq!(get("rdmablk_volume_ops_total", &vo("f", "discard")), 1.0);
    assert_eq!(get("rdmablk_volume_bytes_total", &vo("f", "discard")), 4.0 * 4096.0);
    assert_eq!(get("rdmablk_volume_ops_total", &vo("m", "write")), 2.0);
    assert_eq!(get("rdmablk_volume_ops_total", &vo("m", "write_zeroes")), 1.0);
    assert_eq!(get("rdmablk_volume_ops_total", &vo("m", "read")), 0.0);
    assert_eq!(get("rdmablk_volume_info", &[("volume", "m"), ("backend", "memory"), ("access", "rw")]), 1.0);
    assert_eq!(get("rdmablk_volume_size_bytes", &[("volume", "f")]), (16 * MIB) as f64);

    // Histograms: cumulative buckets, +Inf = count = ops, a positive sum.
    for (v, op, n) in [("f", "write", 5.0), ("f", "read", 4.0), ("m", "write_zeroes", 1.0)] {
        let mut buckets: Vec<(f64, f64)> = m
            .iter()
            .filter(|s| s.name == "rdmablk_volume_latency_seconds_bucket" && s.labels["volume"] == v && s.labels["op"] == op)
            .map(|s| (s.labels["le"].parse::<f64>().unwrap_or(f64::INFINITY), s.value))
            .collect();
        buckets.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        assert_eq!(buckets.len(), 28, "27 log2 buckets and +Inf");
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "not cumulative: {buckets:?}");
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, n));
        assert_eq!(get("rdmablk_volume_latency_seconds_count", &vo(v, op)), n);
        assert!(get("rdmablk_volume_latency_seconds_sum", &vo(v, op)) > 0.0);
        assert!(buckets[0].1 < n, "{v} {op}: nothing takes under a microsecond");
    }

    // Sessions, queue pairs, the pool, the reactors.
    assert_eq!(get("rdmablk_sessions_connected", &[]), 1.0);
    assert_eq!(get("rdmablk_queue_pairs_connected", &[]), 1.0);
    assert_eq!(get("rdmablk_host_sessions", &[("host", "raw-test-host")]), 1.0);
    assert_eq!(get("rdmablk_host_queue_pairs", &[("host", "raw-test-host")]), 1.0);
    for r in ["0", "1"] {
        let chunks = get("rdmablk_buffer_pool_chunks", &[("reactor", r)]);
        assert_eq!(chunks, 512.0, "64 MiB of 128 KiB chunks");
        assert!(get("rdmablk_buffer_pool_chunks_in_use", &[("reactor", r)]) <= chunks);
        assert_eq!(get("rdmablk_buffer_pool_waiting_commands", &[("reactor", r)]), 0.0);
        assert!(m.iter().any(|s| s.name == "rdmablk_reactor_cpu_seconds_total" && s.labels["reactor"] == r));
    }
    // Every command was handled in a turn with work, whichever reactor had it.
    let busy: f64 = ["0", "1"].iter().map(|r| get("rdmablk_reactor_busy_seconds_total", &[("reactor", r)])).sum();
    assert!(busy > 0.0, "17 commands took no busy time");
    assert_eq!(get("rdmablk_buffer_pool_bytes_in_use", &[]), 0.0, "idle: every chunk is back");
    let commands: f64 = ["0", "1"].iter().map(|r| get("rdmablk_reactor_commands_total", &[("reactor", r)])).sum();
    assert_eq!(commands, 17.0, "CONNECT, 2 OPEN, 14 I/O commands");
    assert_eq!(http_get(&addr, "/nope").0, 404);

    // The session goes away with its queue pair.
    drop(q);
    eventually("sessions_connected drops to 0", Duration::from_secs(10), || {
        sample(&scrape(&addr), "rdmablk_sessions_connected", &[]) == Some(0.0)
    });
    target.wait_for_log("session ended: host=raw-test-host", Duration::from_secs(5));
}

#[test]
fn two_queue_pairs_of_one_session_land_on_two_reactors() {
    let dir = tempfile::tempdir().unwrap();
    let f = sparse_file(dir.path(), "f.img", 64 * MIB);
    let config = format!(
        "{}reactors = 2\nmetrics = \"127.0.0.1:0\"\n{}{}",
        target_section(),
        memory_volume("m", 64 * MIB, false),
        file_volume("f", &f, 64 * MIB, false)
    );
    let target = TargetProcess::start(&config);
    let addr = target.metrics_addr();
    let (mut qa, ra) = RawQueue::connected_as(&target.url, 4 << 20, 16, "mq-host", SessionId(0));
    let (mut qb, rb) = RawQueue::connected_as(&target.url, 4 << 20, 16, "mq-host", ra.session_id);
    assert_eq!((ra.queue_index, rb.queue_index), (0, 1));
    assert_eq!(rb.session_id, ra.session_id, "the second queue pair joined the first one's session");

    // The log names the reactor of each queue pair: two different ones.
    let sid = format!("session={:#x}", ra.session_id.0);
    let reactor_of = |queue: u16| -> String {
        let line = target.wait_for_log(&format!("host=mq-host {sid} queue={queue} "), Duration::from_secs(5));
        let r = line.split("reactor=").nth(1).expect("reactor=").split_whitespace().next().unwrap().to_owned();
        assert!(line.contains("session connected"), "{line}");
        r
    };
    let (r0, r1) = (reactor_of(0), reactor_of(1));
    assert_ne!(r0, r1, "both queue pairs on reactor {r0}");
    // So do the metrics.
    let m = scrape(&addr);
    for r in ["0", "1"] {
        assert_eq!(sample(&m, "rdmablk_reactor_queue_pairs", &[("reactor", r)]), Some(1.0), "reactor {r}");
    }
    // The session's two, as its host's (per session: no series, see tests/tests/metrics.rs).
    assert_eq!(sample(&m, "rdmablk_host_queue_pairs", &[("host", "mq-host")]), Some(2.0));
    assert_eq!(sample(&m, "rdmablk_host_sessions", &[("host", "mq-host")]), Some(1.0));
    assert_eq!(sample(&m, "rdmablk_sessions_connected", &[]), Some(1.0));

    // Opened on one queue pair, usable from the other; closed likewise.
    let mid = qa.open_volume("m").unwrap().volume_id;
    let fid = qb.open_volume("f").unwrap().volume_id;
    assert_eq!(write(&mut qb, mid, 8, &[0xabu8; 16384], false), Status::Success, "qb uses what qa opened");
    assert_eq!(read(&mut qa, mid, 8, 16384), (Status::Success, vec![0xab; 16384]));
    assert_eq!(write(&mut qa, fid, 8, &[0xcdu8; 16384], true), Status::Success, "qa uses what qb opened");
    assert_eq!(read(&mut qb, fid, 8, 16384), (Status::Success, vec![0xcd; 16384]));

    // Joining someone else's session, or one that does not exist, is refused.
    let mut intruder = RawQueue::open(&target.url, 4096);
    let r = intruder.connect_to_session(8, 1 << 20, "other-host", ra.session_id).unwrap();
    assert_eq!(r.capsule.status, Status::UnknownSession);
    let r = intruder.connect_to_session(8, 1 << 20, "mq-host", SessionId(ra.session_id.0 ^ 0x8000_0000)).unwrap();
    assert_eq!(r.capsule.status, Status::UnknownSession);
    drop(intruder);

    // Both queues at once, in parallel, on their own reactors.
    let before: Vec<f64> =
        ["0", "1"].iter().map(|r| sample(&scrape(&addr), "rdmablk_reactor_commands_total", &[("reactor", r)]).unwrap()).collect();
    let run = |mut q: RawQueue, vol: VolumeId, base: u64| {
        std::thread::spawn(move || {
            for i in 0..200u64 {
                let data = vec![(i as u8) ^ (base as u8); 65536];
                assert_eq!(write(&mut q, vol, base + (i % 64) * 16, &data, false), Status::Success);
                assert_eq!(read(&mut q, vol, base + (i % 64) * 16, 65536), (Status::Success, data));
            }
            q
        })
    };
    let ta = run(qa, mid, 0);
    let tb = run(qb, mid, 4096);
    let mut qa = ta.join().unwrap();
    let qb = tb.join().unwrap();
    let m = scrape(&addr);
    for (i, r) in ["0", "1"].iter().enumerate() {
        let after = sample(&m, "rdmablk_reactor_commands_total", &[("reactor", r)]).unwrap();
        assert!(after - before[i] >= 400.0, "reactor {r} did {} commands", after - before[i]);
    }

    // CLOSE on one queue pair closes for the session.
    assert_eq!(close(&mut qa, mid), Status::Success);
    let mut qb = qb;
    assert_eq!(read(&mut qb, mid, 8, 4096).0, Status::VolumeNotOpen);

    // The session outlives one queue pair and ends with the last.
    drop(qa);
    eventually("qa's queue pair gone", Duration::from_secs(10), || {
        sample(&scrape(&addr), "rdmablk_queue_pairs_connected", &[]) == Some(1.0)
    });
    assert_eq!(read(&mut qb, fid, 8, 4096), (Status::Success, vec![0xcd; 4096]));
    drop(qb);
    eventually("the session ends", Duration::from_secs(10), || {
        sample(&scrape(&addr), "rdmablk_sessions_connected", &[]) == Some(0.0)
    });
    target.wait_for_log(&format!("session ended: host=mq-host {sid}"), Duration::from_secs(5));
    let disconnects = target.log().iter().filter(|l| l.contains("session disconnected: host=mq-host") && l.contains(&sid)).count();
    assert_eq!(disconnects, 2, "one line per queue pair with the reason");
}

#[test]
fn a_config_with_a_bad_key_names_the_file_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let check = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(bin("rdmablk-target")).args(["--config", path.to_str().unwrap(), "--check"]).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let good = format!("{}metrics = \"127.0.0.1:9420\"\n{}{}", target_section(), memory_volume("m", 8 * MIB, false), null_volume("n", MIB));
    let (code, out, err) = check("good.toml", &good);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("volume m: backend=memory size=8MiB block_size=4096 rw"), "{out}");
    assert!(out.contains("volume n: backend=null size=1MiB block_size=4096 rw"), "{out}");
    assert!(out.contains("metrics http://127.0.0.1:9420/metrics"), "{out}");

    for (file, text, key) in [
        ("t.toml", format!("{}metric = \"127.0.0.1:1\"\n{}", target_section(), memory_volume("m", MIB, false)), "metric"),
        ("v.toml", format!("{}{}readonly = true\n", target_section(), memory_volume("m", MIB, false)), "readonly"),
        ("p.toml", format!("{}{}path = \"/x\"\n", target_section(), null_volume("n", MIB)), "volume[0].path"),
        ("a.toml", format!("{}metrics = \"nowhere\"\n{}", target_section(), null_volume("n", MIB)), "target.metrics"),
    ] {
        let (code, _, err) = check(file, &text);
        assert_eq!(code, Some(2), "{file}: {err}");
        assert!(err.contains(file) && err.contains(key), "{file}: the message names neither the file nor {key}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{file}: one line: {err}");
    }
}

#[test]
fn the_systemd_unit_verifies() {
    // systemd-analyze checks that ExecStart= is executable: point a copy of
    // the unit at the binary just built.
    let Ok(out) = std::process::Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("skipping: systemd-analyze is not installed");
        return;
    };
    assert!(out.status.success());
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../systemd/rdmablk-target.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/rdmablk-target --config /etc/rdmablk/target.toml"), "{unit}");
    for want in [
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "LimitMEMLOCK=infinity",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/rdmablk",
        "PrivateTmp=yes",
        "ProtectHome=yes",
        "CapabilityBoundingSet=",
        "DeviceAllow=",
        "WatchdogSec=",
    ] {
        assert!(unit.lines().any(|l| l.starts_with(want)), "the unit lacks {want}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rdmablk-target.service");
    let exe = bin("rdmablk-target");
    std::fs::write(&path, unit.replace("/usr/bin/rdmablk-target", exe.to_str().unwrap())).unwrap();
    let out = std::process::Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "systemd-analyze verify: {err}");
}

#[test]
fn iopoll_is_refused_for_volumes_without_poll_queues() {
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "v.img", 8 * MIB);
    let path = dir.path().join("iopoll.toml");
    std::fs::write(&path, format!("{}iopoll = true\n{}", target_section(), file_volume("v", &img, 8 * MIB, false))).unwrap();
    let out = std::process::Command::new(bin("rdmablk-target")).args(["--config", path.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("iopoll.toml: volume[0].path") && err.contains("target.iopoll") && err.contains("poll queues"),
        "{err}"
    );
}

/// CPU seconds (user + system) the process has used, from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 here.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // /proc counts in USER_HZ ticks, which Linux fixes at 100 per second.
    ticks as f64 / 100.0
}

#[test]
fn busy_polling_reactors_serve_io_and_still_go_to_sleep_when_idle() {
    let cfg = format!("{}busy_poll = \"5ms\"\nreactors = 1\n{}", target_section(), memory_volume("m", 16 * MIB, false));
    let target = TargetProcess::start(&cfg);
    let (mut q, _) = RawQueue::connected(&target.url, 1 << 20);
    let vol = q.open_volume("m").unwrap().volume_id;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    for lba in 0..64 {
        let data = random(&mut rng, 4096);
        assert_eq!(write(&mut q, vol, lba, &data, false), Status::Success);
        let (st, back) = read(&mut q, vol, lba, 4096);
        assert_eq!((st, back), (Status::Success, data));
    }
    // Idle now: after busy_poll the reactor sleeps, so a second of idleness
    // costs next to no CPU (a reactor that kept polling would burn ~1 s).
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu_seconds(target.pid());
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_seconds(target.pid()) - before;
    assert!(used < 0.3, "an idle target with busy_poll = 5ms used {used:.2} CPU-s in 1 s");
}
