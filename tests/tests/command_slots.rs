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
use rdmablk_system_tests::{file_volume, sample_sum, scrape, sparse_file, target_section, TargetProcess};
use workload::LoadConfig;

const VOLUME: u64 = 16 << 20;

#[test]
fn late_send_completions_never_turn_a_legal_queue_depth_into_queue_full() {
    // Each completion waits for the initiator's second SEND after it.
    let target = load_at_depths("2", 128, &[4, 8, 16, 32]);
    let log = target.log();
    assert!(!log.iter().any(|l| l.contains("QueueFull") || l.contains("exceeds the queue depth")), "{}", log.join("\n"));
}

/// Completions held until the 50 ms bound: answers pile up faster than
/// their send completions return, every response slot fills, and answers
/// wait for one (the metrics count them) instead of failing the queue pair.
#[test]
fn answers_wait_for_a_response_slot_when_completions_lag_far_behind() {
    // The target's queue depth is the initiator's: 64 response slots.
    let target = load_at_depths("1000000", 32, &[32]);
    let delayed = sample_sum(&scrape(&target.metrics_addr()), "rdmablk_reactor_answers_delayed_total");
    assert!(delayed > 0.0, "no answer had to wait for a response slot: the test did not reach the case it is for");
}

/// Runs a verifying load at each queue depth against a target whose tcp
/// provider holds send completions (`RDMABLK_TCP_LATE_SEND_COMPLETIONS`).
fn load_at_depths(late: &str, target_depth: u32, depths: &[u32]) -> TargetProcess {
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_file(dir.path(), "vol0.img", VOLUME);
    let config =
        format!(
        "{}queue_depth = {target_depth}\nmetrics = \"127.0.0.1:0\"\n{}",
        target_section(),
        file_volume("vol0", &image, VOLUME, false)
    );
    let target = TargetProcess::start_with_env(&config, &[("RDMABLK_TCP_LATE_SEND_COMPLETIONS", late)], &[]);
    let model = Arc::new(MemDevice::new(VOLUME, 4096).unwrap());
    for &depth in depths {
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
    target
}
