//! A command slot is free when the initiator may reuse it.
//!
//! The protocol lets an initiator send its next command on a slot as soon as
//! it holds that slot's response. The target must count its queue depth the
//! same way, not by when its own fabric reports the response's SEND
//! complete: Soft-RoCE on Linux 6.12 (and loaded NICs) report that
//! completion after the initiator's next command has arrived. The tcp
//! provider reproduces that order with `RDMABLK_TCP_LATE_SEND_COMPLETIONS=2`
//! in the target's environment; over `rdma://` in the VM stage the kernel
//! does it by itself.

#[path = "../../initiator/tests/support/workload.rs"]
mod workload;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use rdmablk_initiator::{ConnectOptions, MemDevice, Session};
use rdmablk_system_tests::{file_volume, sparse_file, target_section, TargetProcess};
use workload::LoadConfig;

const VOLUME: u64 = 16 << 20;

#[test]
fn late_send_completions_never_turn_a_legal_queue_depth_into_queue_full() {
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_file(dir.path(), "vol0.img", VOLUME);
    let config = format!("{}{}", target_section(), file_volume("vol0", &image, VOLUME, false));
    let target = TargetProcess::start_with_env(&config, &[("RDMABLK_TCP_LATE_SEND_COMPLETIONS", "2")], &[]);
    let model = Arc::new(MemDevice::new(VOLUME, 4096).unwrap());
    for depth in [4u32, 8, 16, 32] {
        let options = ConnectOptions {
            host_id: format!("slots-qd{depth}"),
            queues: 1,
            queue_depth: depth,
            // No reconnection: a QueueFull (or a queue pair the target
            // drops) must show as an error, not be ridden out.
            ctrl_loss_timeout: Duration::ZERO,
            ..ConnectOptions::default()
        };
        let session = Session::connect(target.url.clone(), options).expect("connect");
        assert_eq!(session.queue_depth(), depth);
        let vol = Arc::new(session.open("vol0").unwrap());
        // More requests than the depth: every command slot is reused the
        // moment its response arrives.
        let config = LoadConfig {
            threads: 1,
            depth: 2 * depth as usize,
            duration: Duration::from_millis(1500),
            min_ops: 200,
            max_blocks: 4,
            sync_every: 0,
            seed: workload::seed(),
        };
        let report = workload::run(&vol, &model, &config, &Arc::new(AtomicBool::new(false)));
        eprintln!("queue depth {depth}: {report:?}");
        assert!(report.errors.is_empty(), "queue depth {depth}: {} errors; first: {:?}", report.errors.len(), report.errors.first());
        assert!(report.reads + report.writes >= 200, "{report:?}");
        workload::verify_all(&vol, &model).unwrap();
        drop(vol);
        session.close();
    }
    target.assert_no_panic();
    let log = target.log();
    assert!(!log.iter().any(|l| l.contains("QueueFull") || l.contains("exceeds the queue depth")), "{}", log.join("\n"));
}
