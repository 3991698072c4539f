//! A write of at most the negotiated inline size rides in its command's
//! SEND, gathered from the caller's registered buffer after the capsule
//! (`IoQueue`). Its completion, which hands the buffer back, waits for that
//! SEND's own completion as well as for the response: until then a NIC may
//! read the buffer again to retransmit. Soft-RoCE on Linux 6.12 reports a
//! SEND's completion after the peer's next message; here the tcp
//! provider's late mode does it, in this test process only (a test binary
//! of its own: the mode is read once per process). With
//! `RDMABLK_TCP_LATE_SEND_COMPLETIONS=2` a send completion waits for the
//! peer's second SEND after it, or 50 ms; one write at a time gives the
//! target nothing else to send, so each write's completion can only come
//! from that 50 ms release. The bound checked is a lower one, which a slow
//! machine cannot miss: without the wait the writes take microseconds.

use std::time::{Duration, Instant};

use rdmablk_initiator::{BlockDevice, ConnectOptions, IoRequest, Session};
use rdmablk_system_tests::{file_volume, sparse_file, target_section, TargetProcess};

const VOLUME: u64 = 4 << 20;
const WRITES: u64 = 20;

#[test]
fn a_gathered_write_completes_only_after_its_send_has() {
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_file(dir.path(), "vol0.img", VOLUME);
    let config = format!("{}{}", target_section(), file_volume("vol0", &image, VOLUME, false));
    // Started before the variable is set: the target's own sends complete as usual.
    let target = TargetProcess::start(&config);
    std::env::set_var("RDMABLK_TCP_LATE_SEND_COMPLETIONS", "2");
    let options = ConnectOptions { host_id: "gathered".into(), queues: 1, ..ConnectOptions::default() };
    let session = Session::connect(target.url.clone(), options).expect("connect");
    assert_eq!(session.inline_data_size(), 4096);
    // Every write on a slot of its own: no command waits for a slot whose
    // SEND has not completed, only for its own.
    assert!(u64::from(session.queue_depth()) > WRITES);
    let vol = session.open("vol0").unwrap();
    let mut q = session.io_queue();
    let mut buf = session.alloc_buffer(4096).unwrap();
    let before = session.stats();
    let start = Instant::now();
    for i in 0..WRITES {
        buf.as_mut_slice().fill(i as u8 + 1);
        q.submit(IoRequest::write(&vol, i * 4096, buf), i);
        let mut done = Vec::new();
        assert_eq!(q.wait(&mut done, 1, Some(Duration::from_secs(10))), 1, "write {i} did not complete");
        let c = done.pop().unwrap();
        c.result.unwrap();
        buf = c.buffer.expect("a write hands its buffer back");
    }
    let elapsed = start.elapsed();
    let after = session.stats();
    assert_eq!(after.inline_writes - before.inline_writes, WRITES, "every write rode in its command");
    // 20 writes x 50 ms = 1 s; a keep-alive's answer may release one early.
    assert!(
        elapsed >= Duration::from_millis(WRITES * 50 / 2),
        "{WRITES} writes took {elapsed:?}: their completions did not wait for their SENDs'"
    );
    let mut back = vec![0u8; (WRITES * 4096) as usize];
    vol.read_at(&mut back, 0).unwrap();
    for (i, block) in back.chunks(4096).enumerate() {
        assert!(block.iter().all(|&b| b == i as u8 + 1), "block {i} holds the wrong data");
    }
    drop(q);
    drop(vol);
    session.close();
    target.assert_no_panic();
}
