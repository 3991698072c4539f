//! Fenced failover of an RBD volume between two gateways, on rdmablk v1
//! (issue 54): the failover test the issue asks for.
//!
//! Two real `rdmablk-target`s export one image of the dev Ceph cluster
//! (`tests/src/ceph.rs`). One session names both (`tcp://A,tcp://B`). 32
//! threads (queue depth 32) write versioned 4 KiB blocks over a small
//! region, so that every block is rewritten often. The owner is frozen with
//! SIGSTOP while writes are inside it (in its librbd); the session fails
//! over to the other gateway, which takes the image over (Ceph blocklists
//! the frozen one), and the writers go on there, rewriting the same blocks
//! with newer versions. The writers stop and the frozen gateway is resumed:
//! whatever it still held must be refused by the OSDs. Every block must then hold its
//! latest acknowledged version or a newer one that was issued, never an
//! older one. The resumed gateway must say it was fenced (proof that it
//! held operations), and a reload makes it the standby of the next round,
//! in which the roles swap.
//!
//! `RDMABLK_RBD_FAILOVER_ROUNDS` sets the rounds (default 20, the issue's
//! 20/20; about 3 s each). The ignored test runs the same rounds with
//! `RDMABLK_FAULT_RBD_NO_BLOCKLIST=1` (takeovers without the blocklist) and
//! expects a stale block: proof that the check sees one land.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
use rdmablk_system_tests::ceph::cluster;
use rdmablk_system_tests::{target_section, TargetProcess};

const BLOCK: usize = 4096;
/// Blocks written: few, so that the writes held by a frozen gateway are
/// rewritten through the other one.
const BLOCKS: u64 = 256;
const THREADS: u64 = 32;
const IMAGE: u64 = 64 << 20;

fn options() -> ConnectOptions {
    ConnectOptions {
        host_id: "rbd-failover".into(),
        queues: 2,
        connect_timeout: Duration::from_secs(1),
        io_timeout: Duration::from_secs(20),
        keepalive_timeout: Duration::from_secs(1),
        reconnect_delay: Duration::from_millis(100),
        ctrl_loss_timeout: Duration::from_secs(60),
        ..ConnectOptions::default()
    }
}

fn gateway_config(image: &str, lock_at_start: bool) -> String {
    format!("{}reactors = 1\n{}allow_any_host = true\n", target_section(), cluster().volume_block("shared", image, lock_at_start))
}

/// A block's bytes: block number, version, and a filler that depends on both.
fn block_bytes(block: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(&block.to_le_bytes());
    b[8..16].copy_from_slice(&version.to_le_bytes());
    let mut x = block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version;
    for chunk in b[16..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

/// Per block: the highest version issued and the highest acknowledged.
struct Versions {
    issued: Vec<AtomicU64>,
    acked: Vec<AtomicU64>,
    busy: Vec<AtomicBool>,
}

/// What a round found wrong, if anything.
fn round(a: &TargetProcess, b: &TargetProcess, owner_is_a: bool, image: &str, versions: &Versions) -> Vec<String> {
    let (owner, standby) = if owner_is_a { (a, b) } else { (b, a) };
    let session = Session::connect(format!("{},{}", owner.url, standby.url), options()).expect("connect");
    let vol = Arc::new(session.open("shared").expect("open"));
    let stop = AtomicBool::new(false);
    let served = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (vol, stop, served) = (&vol, &stop, &served);
            s.spawn(move || {
                let mut k = t * 7919;
                while !stop.load(Ordering::Relaxed) {
                    k = k.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let blk = (k >> 33) % BLOCKS;
                    // One writer per block at a time, as a file system writes.
                    if versions.busy[blk as usize].swap(true, Ordering::AcqRel) {
                        continue;
                    }
                    let v = versions.issued[blk as usize].fetch_add(1, Ordering::AcqRel) + 1;
                    vol.write_at(&block_bytes(blk, v), blk * BLOCK as u64).expect("a write failed through the failover");
                    versions.acked[blk as usize].fetch_max(v, Ordering::AcqRel);
                    versions.busy[blk as usize].store(false, Ordering::Release);
                    served.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let wait_served = |n: u64, what: &str| {
            let t0 = Instant::now();
            let start = served.load(Ordering::Relaxed);
            while served.load(Ordering::Relaxed) < start + n {
                assert!(t0.elapsed() < Duration::from_secs(30), "{what}: only {} writes in 30 s", served.load(Ordering::Relaxed) - start);
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        wait_served(500, "through the owner");
        owner.signal(libc::SIGSTOP);
        // Through the other gateway, after its takeover.
        wait_served(2000, "after the freeze");
        stop.store(true, Ordering::Relaxed);
    });
    // Resumed after the last acknowledged write: whatever it held and sends
    // now would overwrite newer versions, with nothing after it to hide it.
    owner.signal(libc::SIGCONT);
    std::thread::sleep(Duration::from_secs(1));
    // What Ceph holds, read by another client: `rbd export`.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("image");
    cluster().export_image(image, &file);
    let bytes = std::fs::read(&file).unwrap();
    let mut problems = Vec::new();
    for blk in 0..BLOCKS {
        let at = (blk as usize) * BLOCK;
        let got = &bytes[at..at + BLOCK];
        let version = u64::from_le_bytes(got[8..16].try_into().unwrap());
        let (acked, issued) = (versions.acked[blk as usize].load(Ordering::Acquire), versions.issued[blk as usize].load(Ordering::Acquire));
        if version < acked || version > issued || (version > 0 && got != block_bytes(blk, version)) {
            problems.push(format!("block {blk}: holds version {version}, acknowledged {acked}, issued {issued}"));
        }
    }
    problems
}

fn run(rounds: usize, env: &[(&str, &str)]) -> (usize, Vec<String>) {
    let c = cluster();
    let image = c.unique_name("failover");
    c.create_image(&image, IMAGE);
    let mut a = TargetProcess::start_with_env(&gateway_config(&image, true), env, &[]);
    let mut b = TargetProcess::start_with_env(&gateway_config(&image, false), env, &[]);
    let versions = Versions {
        issued: (0..BLOCKS).map(|_| AtomicU64::new(0)).collect(),
        acked: (0..BLOCKS).map(|_| AtomicU64::new(0)).collect(),
        busy: (0..BLOCKS).map(|_| AtomicBool::new(false)).collect(),
    };
    let mut all = Vec::new();
    let mut fenced = 0;
    let mut held_rounds = 0;
    let fences = |t: &TargetProcess| t.log().iter().filter(|l| l.contains("Ceph blocklisted this one")).count();
    for r in 0..rounds {
        let owner_is_a = r % 2 == 0;
        let old = if owner_is_a { &a } else { &b };
        let before = fences(old);
        let t0 = Instant::now();
        let problems = round(&a, &b, owner_is_a, &image, &versions);
        let held = fences(old) > before;
        if !held && env.is_empty() {
            // It held nothing (what it had not taken in yet died with its
            // connections): its first command must find it fenced.
            let e = Session::connect(old.url.clone(), options()).and_then(|s| {
                let v = s.open("shared")?;
                let mut buf = vec![0u8; BLOCK];
                v.read_at(&mut buf, 0)
            });
            let e = e.expect_err("a read through the old owner after the takeover");
            assert!(e.to_string().contains("NotOwner"), "the old owner answered: {e}");
        }
        // The log line is written before the refusal is sent, but reaches
        // the test through the pipe reader's thread: wait for it a little.
        let t1 = Instant::now();
        while fences(old) == before && t1.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let was_fenced = fences(old) > before;
        eprintln!("round {r}: {} stale or torn blocks, old owner held operations: {held}, fenced: {was_fenced}, {:?}", problems.len(), t0.elapsed());
        held_rounds += usize::from(held);
        all.extend(problems.into_iter().map(|p| format!("round {r}: {p}")));
        if !was_fenced {
            // Without fencing there is no standby to come back to.
            break;
        }
        fenced += 1;
        // The old owner comes back as the standby of the next round.
        let reloads = old.log().iter().filter(|l| l.contains("reopened as a standby")).count();
        old.signal(libc::SIGHUP);
        rdmablk_system_tests::wait_until("the fenced gateway reopened as a standby", Duration::from_secs(20), || {
            old.log().iter().filter(|l| l.contains("reopened as a standby")).count() > reloads
        });
    }
    a.signal(libc::SIGTERM);
    b.signal(libc::SIGTERM);
    assert_eq!(a.wait_exit(Duration::from_secs(20)), Some(0), "gateway A's exit");
    assert_eq!(b.wait_exit(Duration::from_secs(20)), Some(0), "gateway B's exit");
    c.remove_image(&image);
    eprintln!("{held_rounds} of {rounds} frozen owners held operations that the OSDs refused when resumed");
    (fenced, all)
}

fn rounds() -> usize {
    std::env::var("RDMABLK_RBD_FAILOVER_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20)
}

#[test]
fn a_frozen_gateways_held_writes_never_land_after_the_failover() {
    let n = rounds();
    let (fenced, problems) = run(n, &[]);
    assert!(problems.is_empty(), "{} stale or torn blocks:\n{}", problems.len(), problems.join("\n"));
    assert_eq!(fenced, n, "every frozen owner found itself fenced");
}

/// The proof that the check above can fail: the same rounds with takeovers
/// that do not blocklist the old owner land a stale block. Ignored: how
/// often a stale write lands depends on timing; run it by hand with
/// `--run-ignored only`.
#[test]
#[ignore]
fn without_the_blocklist_a_frozen_gateways_held_writes_land_stale() {
    for attempt in 0..rounds() {
        let (_, problems) = run(1, &[("RDMABLK_FAULT_RBD_NO_BLOCKLIST", "1")]);
        if !problems.is_empty() {
            eprintln!("attempt {attempt}: {} stale blocks, as expected without fencing; the first: {}", problems.len(), problems[0]);
            return;
        }
    }
    panic!("no stale block in {} rounds without the blocklist", rounds());
}

/// An owner that was taken over while frozen with nothing in flight has
/// not met the blocklist when resumed: a reload must still find it fenced
/// off (asking Ceph, not its own memory) and reopen the image as a
/// standby, which then takes it back at a host's first command.
#[test]
fn a_reload_finds_a_quietly_taken_over_owner_and_reopens_it_as_a_standby() {
    let c = cluster();
    let image = c.unique_name("quiet");
    c.create_image(&image, IMAGE);
    let mut a = TargetProcess::start(&gateway_config(&image, true));
    let mut b = TargetProcess::start(&gateway_config(&image, false));
    let write = |t: &TargetProcess, version: u64| {
        let s = Session::connect(t.url.clone(), options()).expect("connect");
        s.open("shared").expect("open").write_at(&block_bytes(7, version), 7 * BLOCK as u64)
    };
    write(&a, 1).expect("a write through the owner");
    // b takes the image over at its first command while a is frozen: a
    // misses the OSD map that blocklists it, and is resumed with nothing
    // in flight and reloaded at once.
    a.signal(libc::SIGSTOP);
    write(&b, 2).expect("a write through the standby, which takes the image over");
    a.signal(libc::SIGCONT);
    a.signal(libc::SIGHUP);
    a.wait_for_log("reopened as a standby", Duration::from_secs(20));
    // a serves again, after taking the image back from b.
    write(&a, 3).expect("a write through the reopened gateway");
    // b, taken over quietly in its turn, finds out at its reload too.
    b.signal(libc::SIGHUP);
    b.wait_for_log("reopened as a standby", Duration::from_secs(20));
    let s = Session::connect(a.url.clone(), options()).expect("connect");
    let mut buf = vec![0u8; BLOCK];
    s.open("shared").expect("open").read_at(&mut buf, 7 * BLOCK as u64).expect("read");
    assert!(buf == block_bytes(7, 3), "a read back something other than its last write");
    for t in [&mut a, &mut b] {
        t.signal(libc::SIGTERM);
        assert_eq!(t.wait_exit(Duration::from_secs(20)), Some(0), "a gateway's exit");
    }
    c.remove_image(&image);
}
