//! Multi-queue sessions, the completion-based submission API, zero copy and
//! the byte-stream adapter, against the fake target.

mod support;

use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use rdmablk_common::protocol::{Opcode, SessionId, Status};
use rdmablk_initiator::{
    BlockDevice, BlockStream, ConnectOptions, ErrorKind, IoCompletion, IoRequest, MemDevice, Session,
};
use support::workload::{self, LoadConfig};
use support::{pattern, FakeConfig, FakeTarget, FakeVolume};

const MIB: usize = 1 << 20;

fn options(queues: usize) -> ConnectOptions {
    ConnectOptions {
        host_id: "mq-host".into(),
        queues,
        connect_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(10),
        ..ConnectOptions::default()
    }
}

fn one_volume(config: FakeConfig, size: usize) -> FakeTarget {
    FakeTarget::start(config, vec![FakeVolume::new("vol0", size, 4096)])
}

fn wait_all(q: &mut rdmablk_initiator::IoQueue) -> Vec<IoCompletion> {
    let mut out = Vec::new();
    while q.outstanding() > 0 {
        let n = q.wait(&mut out, q.outstanding(), Some(Duration::from_secs(20)));
        assert!(n > 0 || q.outstanding() == 0, "no completion within 20 s");
    }
    out
}

#[test]
fn a_session_joins_all_its_queue_pairs_to_one_target_session() {
    let target = one_volume(FakeConfig::default(), 4 * MIB);
    let s = Session::connect(&target.url, options(4)).unwrap();
    assert_eq!(s.queue_count(), 4);
    let connects = target.observed.lock().unwrap().connects.clone();
    assert_eq!(connects.len(), 4, "{connects:?}");
    assert_eq!(connects[0].0, SessionId(0), "the first queue pair creates the session");
    let sid = connects[0].1.expect("session created");
    assert_eq!(s.session_id(), sid);
    for (i, c) in connects.iter().enumerate().skip(1) {
        assert_eq!((c.0, c.1, c.2), (sid, Some(sid), i as u16), "queue pair {i} joins with the session id");
    }
    assert_eq!(target.session_count(), 1);
    assert_eq!(target.observed.lock().unwrap().host_ids, vec!["mq-host".to_owned(); 4]);
}

#[test]
fn threads_get_their_own_queue_pairs_and_share_the_opened_volume() {
    let target = one_volume(FakeConfig { max_io: 64 << 10, ..FakeConfig::default() }, 8 * MIB);
    let s = Session::connect(&target.url, options(4)).unwrap();
    // OPEN once, on one queue pair; the fake answers VolumeNotOpen to I/O on
    // a volume the session has not opened, so every thread below proves the
    // volume is usable on its own queue pair.
    let vol = Arc::new(s.open("vol0").unwrap());
    let opens = target.commands().iter().filter(|c| c.opcode == Opcode::OpenVolume).count();
    assert_eq!(opens, 1);
    let n0 = target.command_count();
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let vol = vol.clone();
            scope.spawn(move || {
                let off = u64::from(t) * 2 * MIB as u64;
                for round in 0..4u8 {
                    let data = pattern(256 << 10, t * 16 + round);
                    vol.write_at(&data, off).unwrap();
                    let mut back = vec![0u8; data.len()];
                    vol.read_at(&mut back, off).unwrap();
                    assert_eq!(back, data);
                }
            });
        }
    });
    let o = target.observed.lock().unwrap();
    let conns: HashSet<usize> = o.command_conns[n0..].iter().copied().collect();
    assert_eq!(conns.len(), 4, "4 threads used {} queue pairs", conns.len());
}

#[test]
fn a_target_without_joins_leaves_one_queue_and_everything_works() {
    let target = one_volume(FakeConfig { joins: false, ..FakeConfig::default() }, 4 * MIB);
    let s = Session::connect(&target.url, options(4)).unwrap();
    assert_eq!(s.queue_count(), 1);
    let connects = target.observed.lock().unwrap().connects.clone();
    assert_eq!(connects.len(), 2, "one session, one refused join: {connects:?}");
    assert_eq!(connects[1].1, None);
    let vol = Arc::new(s.open("vol0").unwrap());
    std::thread::scope(|scope| {
        for t in 0..3u8 {
            let vol = vol.clone();
            scope.spawn(move || {
                let data = pattern(64 << 10, t);
                vol.write_at(&data, u64::from(t) * MIB as u64).unwrap();
                let mut back = vec![0u8; data.len()];
                vol.read_at(&mut back, u64::from(t) * MIB as u64).unwrap();
                assert_eq!(back, data);
            });
        }
    });
}

#[test]
fn submissions_beyond_the_queue_depth_wait_in_software_and_never_overrun() {
    let target = one_volume(FakeConfig { queue_depth: 4, max_io: 64 << 10, ..FakeConfig::default() }, 8 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    assert_eq!(s.queue_depth(), 4);
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    target.reset_max_outstanding();
    for i in 0..64u64 {
        let mut buf = s.alloc_buffer(64 << 10).unwrap();
        buf.as_mut_slice().copy_from_slice(&pattern(64 << 10, i as u8));
        q.submit(IoRequest::write(&vol, i * (64 << 10), buf), 1000 + i);
    }
    assert_eq!(q.outstanding(), 64);
    assert!(q.in_flight() <= 4, "{} commands on the wire with a queue depth of 4", q.in_flight());
    assert!(q.queued() > 0, "requests beyond the depth wait in the queue");
    let done = wait_all(&mut q);
    let tags: HashSet<u64> = done.iter().map(|c| c.tag).collect();
    assert_eq!(tags, (1000..1064).collect(), "each request completes exactly once");
    assert!(done.iter().all(|c| c.result.is_ok() && c.buffer.is_some()));
    let max = target.max_outstanding();
    assert!(max <= 4, "{max} commands outstanding with a queue depth of 4");
    assert!(max >= 2, "requests were not pipelined (max outstanding {max})");
    for i in 0..64usize {
        assert_eq!(target.volume_data(0)[i * (64 << 10)..(i + 1) * (64 << 10)], pattern(64 << 10, i as u8)[..]);
    }
}

#[test]
fn zero_copy_reads_and_writes_land_in_the_registered_buffer_without_a_bounce() {
    let target = one_volume(FakeConfig::default(), 8 * MIB);
    let s = Session::connect(&target.url, options(2)).unwrap();
    let vol = s.open("vol0").unwrap();
    let data = pattern(3 * MIB, 21);
    let before = s.stats();
    let mut q = s.io_queue();
    let mut buf = s.alloc_buffer(3 * MIB).unwrap();
    buf.as_mut_slice().copy_from_slice(&data);
    q.submit(IoRequest::write(&vol, 4096, buf), 1);
    let mut done = wait_all(&mut q);
    let c = done.pop().unwrap();
    c.result.unwrap();
    assert_eq!(target.volume_data(0)[4096..4096 + 3 * MIB], data[..]);
    // Read it back into a fresh buffer, through the synchronous zero-copy call too.
    let fresh = s.alloc_buffer(3 * MIB).unwrap();
    q.submit(IoRequest::read(&vol, 4096, fresh), 2);
    let back = wait_all(&mut q).pop().unwrap();
    back.result.unwrap();
    let back = back.buffer.unwrap();
    assert!(back.as_slice() == &data[..], "the target's RDMA WRITE did not land in the registered buffer");
    let mut sync_buf = s.alloc_buffer(MIB).unwrap();
    vol.read_into(&mut sync_buf, 0, MIB, 4096).unwrap();
    assert!(sync_buf.as_slice() == &data[..MIB]);
    let after = s.stats();
    assert_eq!(after.bounce_copies, before.bounce_copies, "the zero-copy path used the bounce pool");
    assert_eq!(after.bounce_bytes, before.bounce_bytes);
    assert_eq!(after.zero_copy_bytes - before.zero_copy_bytes, 7 * MIB as u64);
    // A plain slice goes through the bounce pool, which the counter shows.
    let mut plain = vec![0u8; 64 << 10];
    vol.read_at(&mut plain, 4096).unwrap();
    assert_eq!(plain, data[..64 << 10]);
    assert!(s.stats().bounce_copies > after.bounce_copies);
}

#[test]
fn queued_writes_that_fit_the_inline_size_ride_in_the_command_and_larger_ones_are_read_by_the_target() {
    use rdmablk_common::protocol::{FLAG_FUA, FLAG_INLINE_DATA};
    let target = one_volume(FakeConfig::default(), 8 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    assert_eq!(s.inline_data_size(), 4096);
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    let data = pattern(3 * 4096, 7);
    let mut buf = s.alloc_buffer(3 * 4096).unwrap();
    buf.as_mut_slice().copy_from_slice(&data);
    // 4 KiB from the middle of the buffer, with FUA: inline, its own bytes.
    let before = s.stats();
    q.submit(IoRequest::write(&vol, 8192, buf).with_range(4096, 4096).with_fua(), 1);
    let buf = wait_all(&mut q).pop().unwrap().buffer.unwrap();
    let after = s.stats();
    assert_eq!(after.inline_writes - before.inline_writes, 1);
    assert_eq!(after.inline_bytes - before.inline_bytes, 4096);
    // Gathered from the registered buffer by the SEND: still no copy.
    assert_eq!(after.zero_copy_bytes - before.zero_copy_bytes, 4096);
    assert_eq!(after.bounce_copies, before.bounce_copies);
    let w = *target.commands().last().unwrap();
    assert_eq!((w.opcode, w.flags & (FLAG_INLINE_DATA | FLAG_FUA), w.inline_len), (Opcode::Write, FLAG_INLINE_DATA | FLAG_FUA, 4096));
    assert_eq!(w.descriptor.length, 0, "an inline write names no buffer for the target to read");
    assert_eq!(target.volume_data(0)[8192..12288], data[4096..8192]);
    // 8 KiB: above the inline size, so the target RDMA-READs it.
    let before = s.stats();
    q.submit(IoRequest::write(&vol, 16384, buf).with_range(0, 8192), 2);
    wait_all(&mut q).pop().unwrap().result.unwrap();
    let after = s.stats();
    assert_eq!(after.inline_writes, before.inline_writes);
    assert_eq!(after.zero_copy_bytes - before.zero_copy_bytes, 8192);
    let w = *target.commands().last().unwrap();
    assert_eq!((w.flags & FLAG_INLINE_DATA, w.descriptor.length), (0, 8192));
    assert_eq!(target.volume_data(0)[16384..24576], data[..8192]);

    // A target that takes no inline data gets every write by RDMA READ.
    let target = one_volume(FakeConfig { inline: 0, ..FakeConfig::default() }, 8 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    let mut buf = s.alloc_buffer(4096).unwrap();
    buf.as_mut_slice().copy_from_slice(&data[..4096]);
    q.submit(IoRequest::write(&vol, 0, buf), 3);
    wait_all(&mut q).pop().unwrap().result.unwrap();
    assert_eq!(s.stats().inline_writes, 0);
    let w = *target.commands().last().unwrap();
    assert_eq!((w.flags & FLAG_INLINE_DATA, w.descriptor.length), (0, 4096));
    assert_eq!(target.volume_data(0)[..4096], data[..4096]);
}

#[test]
fn large_submissions_are_split_and_reassembled() {
    let target = one_volume(FakeConfig { max_io: 64 << 10, ..FakeConfig::default() }, 8 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let data = pattern(MIB + 8192, 5);
    let mut buf = s.alloc_buffer(2 * MIB).unwrap();
    buf.as_mut_slice()[4096..4096 + data.len()].copy_from_slice(&data);
    let mut q = s.io_queue();
    let n0 = target.command_count();
    q.submit(IoRequest::write(&vol, 8192, buf).with_range(4096, data.len()).with_fua(), 7);
    let c = wait_all(&mut q).pop().unwrap();
    c.result.unwrap();
    let cmds = target.commands()[n0..].to_vec();
    assert_eq!(cmds.len(), 17, "1 MiB + 8 KiB in 64 KiB pieces");
    assert!(cmds.iter().all(|c| c.opcode == Opcode::Write && c.fua() && c.descriptor.length <= 64 << 10));
    assert_eq!(target.volume_data(0)[8192..8192 + data.len()], data[..]);
    let buf = c.buffer.unwrap();
    q.submit(IoRequest::read(&vol, 8192, buf).with_range(MIB / 2, data.len()), 8);
    let c = wait_all(&mut q).pop().unwrap();
    c.result.unwrap();
    assert!(c.buffer.unwrap().as_slice()[MIB / 2..MIB / 2 + data.len()] == data[..]);
}

#[test]
fn a_submitted_batch_is_sent_within_the_depth_and_each_request_completes_once() {
    let target = one_volume(FakeConfig { queue_depth: 8, max_io: 64 << 10, ..FakeConfig::default() }, 8 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    target.reset_max_outstanding();
    let n0 = target.command_count();
    let requests: Vec<(IoRequest, u64)> = (0..32u64)
        .map(|i| {
            let mut buf = s.alloc_buffer(16 << 10).unwrap();
            buf.as_mut_slice().copy_from_slice(&pattern(16 << 10, i as u8));
            // One misaligned request in the middle completes with its error.
            let offset = if i == 13 { 1 } else { i * (16 << 10) };
            (IoRequest::write(&vol, offset, buf), i)
        })
        .collect();
    q.submit_batch(requests);
    assert_eq!(q.outstanding(), 32);
    assert!(q.in_flight() <= 8 && q.in_flight() > 0, "{} on the wire with a depth of 8", q.in_flight());
    let done = wait_all(&mut q);
    let tags: HashSet<u64> = done.iter().map(|c| c.tag).collect();
    assert_eq!(tags, (0..32).collect(), "each request completes exactly once");
    for c in &done {
        assert_eq!(c.result.is_err(), c.tag == 13, "tag {}: {:?}", c.tag, c.result);
        assert!(c.buffer.is_some());
    }
    assert_eq!(target.command_count() - n0, 31, "the invalid request never reached the target");
    assert!(target.max_outstanding() <= 8);
    for i in (0..32usize).filter(|&i| i != 13) {
        assert_eq!(target.volume_data(0)[i * (16 << 10)..(i + 1) * (16 << 10)], pattern(16 << 10, i as u8)[..]);
    }
}

#[test]
fn a_synchronous_call_gets_a_slot_while_the_same_threads_io_queue_holds_an_unreaped_response() {
    // Depth 2: one slot for keep-alives, one for everything else. The
    // IoQueue's command takes it; its response arrives while its owner is
    // busy with a synchronous call on the same queue. The response must not
    // keep the slot (the owner would wait for itself forever).
    let target = one_volume(FakeConfig { queue_depth: 2, ..FakeConfig::default() }, MIB);
    let s = Session::connect(&target.url, ConnectOptions { queue_depth: 2, ..options(1) }).unwrap();
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    let mut buf = s.alloc_buffer(4096).unwrap();
    buf.as_mut_slice().fill(7);
    q.submit(IoRequest::write(&vol, 0, buf), 1);
    assert_eq!(q.in_flight(), 1, "the IoQueue's command holds the only user slot");
    // On another thread (a session has one queue here, so the same one), so
    // that a hang fails the test instead of blocking it.
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        let vol = s2.open("vol0").unwrap();
        let mut back = vec![0u8; 4096];
        let _ = tx.send(vol.read_at(&mut back, 4096));
    });
    let r = rx.recv_timeout(Duration::from_secs(10)).expect("the synchronous read must finish");
    assert!(r.is_ok(), "{r:?}");
    let done = wait_all(&mut q);
    assert_eq!(done.len(), 1);
    assert!(done[0].result.is_ok());
    assert_eq!(target.volume_data(0)[..4096], [7u8; 4096][..]);
}

#[test]
fn bad_submissions_complete_at_once_with_their_error_and_send_nothing() {
    let target = FakeTarget::start(
        FakeConfig::default(),
        vec![FakeVolume::new("rw", MIB, 4096), FakeVolume::new("ro", MIB, 4096).read_only()],
    );
    let s = Session::connect(&target.url, options(1)).unwrap();
    let rw = s.open("rw").unwrap();
    let ro = s.open("ro").unwrap();
    let other_target = one_volume(FakeConfig::default(), MIB);
    let other = Session::connect(&other_target.url, options(1)).unwrap();
    let n0 = target.command_count();
    let mut q = s.io_queue();
    q.submit(IoRequest::write(&rw, 12289, s.alloc_buffer(4096).unwrap()), 1);
    q.submit(IoRequest::read(&rw, MIB as u64, s.alloc_buffer(4096).unwrap()), 2);
    q.submit(IoRequest::write(&ro, 0, s.alloc_buffer(4096).unwrap()), 3);
    q.submit(IoRequest::read(&rw, 0, other.alloc_buffer(4096).unwrap()), 4);
    q.submit(IoRequest::read(&rw, 0, s.alloc_buffer(4096).unwrap()).with_range(4096, 4096), 5);
    q.submit(IoRequest::discard(&rw, 0, 100), 6);
    let mut done = wait_all(&mut q);
    done.sort_by_key(|c| c.tag);
    let kinds: Vec<ErrorKind> = done.iter().map(|c| c.result.as_ref().unwrap_err().kind()).collect();
    use ErrorKind::*;
    assert_eq!(kinds, [Misaligned, OutOfRange, ReadOnly, InvalidArgument, InvalidArgument, Misaligned]);
    assert!(done[..5].iter().all(|c| c.buffer.is_some()), "the buffer comes back with the error");
    assert!(done[0].result.as_ref().unwrap_err().to_string().contains("12289"));
    assert_eq!(target.command_count(), n0, "a refused request reached the target");
}

#[test]
fn target_errors_in_completions_carry_status_volume_and_range() {
    let mut v = FakeVolume::new("flaky", MIB, 4096);
    v.bad_block = Some(20);
    let target = FakeTarget::start(FakeConfig { max_io: 16384, ..FakeConfig::default() }, vec![v]);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("flaky").unwrap();
    let mut q = s.io_queue();
    q.submit(IoRequest::read(&vol, 0, s.alloc_buffer(128 << 10).unwrap()), 9);
    q.submit(IoRequest::read(&vol, 256 << 10, s.alloc_buffer(8192).unwrap()), 10);
    let mut done = wait_all(&mut q);
    done.sort_by_key(|c| c.tag);
    let e = done[0].result.as_ref().unwrap_err();
    assert_eq!(e.status(), Some(Status::IoError));
    let m = e.to_string();
    assert!(m.contains("\"flaky\"") && m.contains("offset 81920") && m.contains("16384 bytes"), "{m}");
    assert!(done[0].buffer.is_some());
    done[1].result.as_ref().unwrap();
    assert!(s.is_connected());
}

#[test]
fn flush_discard_and_write_zeroes_through_the_queue() {
    let target = FakeTarget::start(
        FakeConfig::default(),
        vec![FakeVolume::new("vol0", 4 * MIB, 4096), FakeVolume::new("plain", 4 * MIB, 4096).flags(0)],
    );
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let plain = s.open("plain").unwrap();
    vol.write_at(&pattern(2 * MIB, 3), 0).unwrap();
    plain.write_at(&pattern(2 * MIB, 4), 0).unwrap();
    let mut q = s.io_queue();
    q.submit(IoRequest::write_zeroes(&vol, 4096, MIB as u64), 1);
    q.submit(IoRequest::write_zeroes(&plain, 4096, MIB as u64 + 8192), 2);
    q.submit(IoRequest::discard(&vol, 2 * MIB as u64, 4096), 3);
    q.submit(IoRequest::discard(&plain, 0, 4096), 4);
    q.submit(IoRequest::flush(&vol), 5);
    let done = wait_all(&mut q);
    assert_eq!(done.len(), 5);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert!(target.volume_data(0)[4096..4096 + MIB].iter().all(|&b| b == 0));
    assert_eq!(target.volume_data(0)[..4096], pattern(2 * MIB, 3)[..4096]);
    assert!(target.volume_data(1)[4096..4096 + MIB + 8192].iter().all(|&b| b == 0), "emulated write-zeroes");
    let ops: Vec<Opcode> = target.commands().iter().map(|c| c.opcode).collect();
    assert!(ops.contains(&Opcode::WriteZeroes) && ops.contains(&Opcode::Discard) && ops.contains(&Opcode::Flush));
}

#[test]
fn a_byte_stream_over_a_remote_volume_matches_a_local_model() {
    let target = one_volume(FakeConfig::default(), MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let model = MemDevice::new(MIB as u64, 4096).unwrap();
    let mut remote = BlockStream::new(&vol);
    let mut local = BlockStream::new(&model);
    for (i, &(off, len)) in
        [(1u64, 10usize), (4090, 20), (5000, 9000), (0, 4096), (MIB as u64 - 3, 3)].iter().enumerate()
    {
        let data = pattern(len, i as u8 + 1);
        for s in [&mut remote as &mut dyn WriteSeek, &mut local] {
            s.seek(SeekFrom::Start(off)).unwrap();
            s.write_all(&data).unwrap();
        }
    }
    remote.flush().unwrap();
    assert_eq!(target.volume_data(0), model.contents());
    let mut back = vec![0u8; 12345];
    remote.seek(SeekFrom::Start(4000)).unwrap();
    remote.read_exact(&mut back).unwrap();
    assert_eq!(back, model.contents()[4000..4000 + 12345]);
    remote.seek(SeekFrom::End(-2)).unwrap();
    let mut tail = Vec::new();
    remote.read_to_end(&mut tail).unwrap();
    assert_eq!(tail.len(), 2);
}

trait WriteSeek: Write + Seek {}
impl<T: Write + Seek> WriteSeek for T {}

#[test]
fn stress_four_threads_at_depth_16_against_a_model() {
    // The real-target version runs 20 s (tests/tests/initiator_stress.rs);
    // this one is short by default.
    let duration = workload::duration_from_env("RDMABLK_FAKE_STRESS_SECS", Duration::from_secs(3));
    let size = 32 * MIB;
    let target = one_volume(FakeConfig { queue_depth: 64, max_io: 128 << 10, ..FakeConfig::default() }, size);
    let s = Session::connect(&target.url, options(4)).unwrap();
    let vol = Arc::new(s.open("vol0").unwrap());
    let model = Arc::new(MemDevice::new(size as u64, 4096).unwrap());
    let config = LoadConfig {
        threads: 4,
        depth: 16,
        duration,
        min_ops: 50,
        max_blocks: 96,
        sync_every: 40,
        seed: workload::seed(),
    };
    let report = workload::run(&vol, &model, &config, &Arc::new(AtomicBool::new(false)));
    eprintln!("{report:?}");
    assert!(report.errors.is_empty(), "{} errors, first: {:?}", report.errors.len(), report.errors.first());
    assert!(report.reads > 0 && report.writes > 0 && report.sync_ops > 0);
    assert!(target.max_outstanding() <= 64);
    workload::verify_all(&vol, &model).unwrap();
    assert_eq!(target.volume_data(0), model.contents());
}

#[test]
fn a_waker_ends_a_wait_early_from_another_thread() {
    let target = one_volume(FakeConfig::default(), 4 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    let waker = q.waker().unwrap();
    // Nothing answers: only the waker can end the wait before its timeout.
    target.set_hang(true);
    q.submit(IoRequest::read(&vol, 0, s.alloc_buffer(4096).unwrap()), 1);
    let w = waker.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        w.wake();
    });
    let start = std::time::Instant::now();
    let mut out = Vec::new();
    assert_eq!(q.wait(&mut out, 1, Some(Duration::from_secs(8))), 0);
    let took = start.elapsed();
    t.join().unwrap();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "the wait took {took:?}");
    // A wake-up while nobody waits: the next wait returns at once.
    waker.wake();
    let start = std::time::Instant::now();
    assert_eq!(q.wait(&mut out, 1, Some(Duration::from_secs(8))), 0);
    assert!(start.elapsed() < Duration::from_secs(1), "a pending wake-up was lost: {:?}", start.elapsed());
    // And it is consumed: the wait after that sleeps until the timeout.
    let start = std::time::Instant::now();
    q.wait(&mut out, 1, Some(Duration::from_millis(400)));
    assert!(start.elapsed() >= Duration::from_millis(350), "a consumed wake-up ended a wait: {:?}", start.elapsed());
    target.set_hang(false);
    let done = wait_all(&mut q);
    assert_eq!(done.len(), 1);
    done.into_iter().for_each(|c| c.result.unwrap());
}

#[test]
fn a_wait_also_ends_when_the_callers_descriptor_is_readable() {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    let target = one_volume(FakeConfig::default(), 4 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    let mut q = s.io_queue();
    let (mut mine, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
    // Nothing answers: only the descriptor can end the wait before its timeout.
    target.set_hang(true);
    q.submit(IoRequest::read(&vol, 0, s.alloc_buffer(4096).unwrap()), 1);
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        peer.write_all(b"x").unwrap();
        peer
    });
    let mut out = Vec::new();
    let start = std::time::Instant::now();
    assert_eq!(q.wait_or_readable(&mut out, 1, Some(Duration::from_secs(8)), mine.as_fd()), (0, true));
    let took = start.elapsed();
    let _peer = t.join().unwrap();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(3), "the wait took {took:?}");
    // The caller reads the descriptor; unread, it would end the next wait at once.
    let mut b = [0u8; 1];
    mine.read_exact(&mut b).unwrap();
    let start = std::time::Instant::now();
    assert_eq!(q.wait_or_readable(&mut out, 1, Some(Duration::from_millis(400)), mine.as_fd()), (0, false));
    assert!(start.elapsed() >= Duration::from_millis(350), "the wait ended early: {:?}", start.elapsed());
    // The answer ends it too, and says the descriptor was not readable.
    target.set_hang(false);
    let (n, readable) = q.wait_or_readable(&mut out, 1, Some(Duration::from_secs(8)), mine.as_fd());
    assert_eq!((n, readable), (1, false));
    out.into_iter().for_each(|c| c.result.unwrap());
}

#[test]
fn write_zeroes_with_no_hole_is_written_from_the_zero_region() {
    let target = one_volume(FakeConfig::default(), 4 * MIB);
    let s = Session::connect(&target.url, options(1)).unwrap();
    let vol = s.open("vol0").unwrap();
    vol.write_at(&pattern(256 << 10, 5), 0).unwrap();
    let mut q = s.io_queue();
    q.submit(IoRequest::write_zeroes(&vol, 64 << 10, 128 << 10).with_no_hole(), 1);
    q.submit(IoRequest::write_zeroes(&vol, 0, 4096), 2);
    for c in wait_all(&mut q) {
        c.result.unwrap();
    }
    let data = target.volume_data(0);
    assert!(data[64 << 10..192 << 10].iter().all(|&b| b == 0));
    assert!(data[..4096].iter().all(|&b| b == 0));
    assert_eq!(data[4096..64 << 10], pattern(256 << 10, 5)[4096..64 << 10]);
    let ops: Vec<Opcode> = target.commands().iter().map(|c| c.opcode).collect();
    assert_eq!(
        ops.iter().filter(|&&o| o == Opcode::WriteZeroes).count(),
        1,
        "only the plain one is a WRITE_ZEROES: {ops:?}"
    );
    assert!(ops.iter().filter(|&&o| o == Opcode::Write).count() >= 2, "NO_HOLE went out as writes: {ops:?}");
}
