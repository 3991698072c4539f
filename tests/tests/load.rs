//! A load run, not a timed test: one session with several queue pairs (one
//! per client thread, like the multi-queue initiator) against a target with
//! two reactors, reporting throughput and what each reactor did from the
//! metrics endpoint. Ignored by default; run it (release build recommended) with
//!
//! ```sh
//! cargo build --release -p rdmablk-target
//! cargo nextest run --release -p rdmablk-system-tests --run-ignored only --no-capture load
//! ```
//!
//! Tunables: RDMABLK_LOAD_SECS (5), RDMABLK_LOAD_QUEUES (4), RDMABLK_LOAD_QD (16),
//! RDMABLK_LOAD_BS (4096), RDMABLK_LOAD_OP (read|write), RDMABLK_LOAD_BACKEND (null|memory|file).
//! It asserts only what does not depend on timing: every command succeeds and
//! both reactors carried queue pairs and commands.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdmablk_common::protocol::{BlockCount, CommandCapsule, CommandId, Lba, Opcode, SessionId, Status};
use rdmablk_system_tests::raw::RawQueue;
use rdmablk_system_tests::{file_volume, memory_volume, null_volume, sample, scrape, sparse_file, target_section, TargetProcess};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
#[ignore = "a load run: see the module docs"]
fn load_one_session_many_queues_two_reactors() {
    let secs: u64 = env("RDMABLK_LOAD_SECS", 5);
    let queues: usize = env("RDMABLK_LOAD_QUEUES", 4);
    let qd: usize = env("RDMABLK_LOAD_QD", 16);
    let bs: usize = env("RDMABLK_LOAD_BS", 4096);
    let op = if env("RDMABLK_LOAD_OP", "read".to_owned()) == "write" { Opcode::Write } else { Opcode::Read };
    let backend: String = env("RDMABLK_LOAD_BACKEND", "null".to_owned());
    let size: u64 = 1 << 30;
    let dir = tempfile::tempdir().unwrap();
    let volume = match backend.as_str() {
        "memory" => memory_volume("v", size, false),
        "file" => file_volume("v", &sparse_file(dir.path(), "v.img", size), size, false),
        _ => null_volume("v", size),
    };
    let config = format!("{}reactors = 2\nmetrics = \"127.0.0.1:0\"\n{volume}", target_section());
    let target = TargetProcess::start(&config);
    let addr = target.metrics_addr();

    let (first, reply) = RawQueue::connected_as(&target.url, qd * bs, qd, "load-host", SessionId(0));
    let mut qs = vec![first];
    for _ in 1..queues {
        qs.push(RawQueue::connected_as(&target.url, qd * bs, qd, "load-host", reply.session_id).0);
    }
    let vol = qs[0].open_volume("v").unwrap().volume_id;
    let cpu = |m: &[rdmablk_system_tests::Sample], r: &str| {
        m.iter().find(|s| s.name == "rdmablk_reactor_cpu_seconds_total" && s.labels["reactor"] == r).unwrap().value
    };
    let m0 = scrape(&addr);
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(secs);
    let threads: Vec<_> = qs
        .into_iter()
        .enumerate()
        .map(|(t, mut q)| {
            std::thread::spawn(move || {
                let blocks = (bs / 4096) as u32;
                let span = size / bs as u64;
                let mut x = 0x9e3779b97f4a7c15u64 ^ t as u64;
                let mut inflight: HashMap<CommandId, usize> = HashMap::new();
                let mut free: Vec<usize> = (0..qd).collect();
                let mut done = 0u64;
                loop {
                    while Instant::now() < deadline && inflight.len() < qd {
                        let slot = free.pop().unwrap();
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let mut c = CommandCapsule::new(op, CommandId(0));
                        c.volume_id = vol;
                        c.start_block = Lba((x % span) * blocks as u64);
                        c.block_count = BlockCount(blocks);
                        c.descriptor = q.descriptor(slot * bs, bs as u32);
                        inflight.insert(q.post(c, &[]), slot);
                    }
                    if inflight.is_empty() {
                        break;
                    }
                    let r = q.next_response(Duration::from_secs(30)).expect("response");
                    assert_eq!(r.capsule.status, Status::Success);
                    free.push(inflight.remove(&r.capsule.command_id).unwrap());
                    done += 1;
                }
                done
            })
        })
        .collect();
    let ops: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let elapsed = t0.elapsed().as_secs_f64();
    let m1 = scrape(&addr);
    println!(
        "{backend} {op:?} bs={bs} queues={queues} qd={qd}: {ops} ops in {elapsed:.2}s = {:.0} IOPS, {:.1} MiB/s",
        ops as f64 / elapsed,
        ops as f64 * bs as f64 / elapsed / (1 << 20) as f64
    );
    for r in ["0", "1"] {
        let cmds = sample(&m1, "rdmablk_reactor_commands_total", &[("reactor", r)]).unwrap()
            - sample(&m0, "rdmablk_reactor_commands_total", &[("reactor", r)]).unwrap();
        let qps = sample(&m0, "rdmablk_reactor_queue_pairs", &[("reactor", r)]).unwrap();
        let busy = cpu(&m1, r) - cpu(&m0, r);
        println!(
            "reactor {r}: {qps} queue pairs, {cmds} commands, {busy:.2} CPU seconds ({:.0}% of one core)",
            100.0 * busy / elapsed
        );
        assert!(qps >= 1.0 && cmds > 0.0, "reactor {r} carried nothing");
    }
}
