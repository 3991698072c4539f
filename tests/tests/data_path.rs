//! The data path end to end: the real daemon on a real store, driven through
//! the initiator library and the CLI, checked against what the store holds.
//! Each test whose subject is the volume's data runs twice: on a sparse file
//! (the test's own name) and on an RBD image of the dev Ceph cluster (its
//! `_on_rbd` twin, issue 54), where "what the store holds" is the image as
//! `rbd export` reads it ([`Backing::contents`]).

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rdmablk_common::protocol::Status;
use rdmablk_initiator::{BlockDevice, ConnectOptions, Session};
use rdmablk_system_tests::backing::{Backing, BackingKind};
use rdmablk_system_tests::{file_volume, random_bytes, rdmablk, sample, scrape, target_section, wait_until, TargetProcess};

const MIB: u64 = 1 << 20;
const VOLUME: u64 = 64 * MIB;

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

/// Stops the target with SIGTERM and expects a clean exit, so that an rbd
/// image is closed (its watch gone) when its `Backing` removes it.
fn stop(mut target: TargetProcess) {
    target.signal(libc::SIGTERM);
    assert_eq!(target.wait_exit(Duration::from_secs(20)), Some(0), "the target's exit on SIGTERM; log:\n{}", target.log().join("\n"));
}

#[test]
fn random_writes_read_back_and_land_in_the_backing_file() {
    random_writes_read_back_and_land_in_the_store(BackingKind::File);
}

#[test]
fn random_writes_read_back_and_land_in_the_backing_file_on_rbd() {
    random_writes_read_back_and_land_in_the_store(BackingKind::Rbd);
}

fn random_writes_read_back_and_land_in_the_store(kind: BackingKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "vol0.img", VOLUME);
    let target = TargetProcess::start(&format!("{}\n{}", target_section(), store.volume("vol0", VOLUME, false)));
    let seed = seed();
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let session = Session::connect(&target.url, ConnectOptions::default()).expect("connect");
    let vol = session.open("vol0").expect("open");
    assert_eq!(vol.size(), VOLUME);
    let bs = vol.block_size() as u64;
    assert_eq!(bs, 4096);
    let mut model = vec![0u8; VOLUME as usize];
    let mut registered = session.alloc_buffer(MIB as usize).expect("alloc_buffer");

    for i in 0..40 {
        let blocks = rng.gen_range(1..=(MIB / bs));
        let len = (blocks * bs) as usize;
        let offset = rng.gen_range(0..=(VOLUME - len as u64) / bs) * bs;
        let data = random_bytes(&mut rng, len);
        if i % 2 == 0 {
            vol.write_at(&data, offset).expect("write_at");
        } else {
            registered.as_mut_slice()[..len].copy_from_slice(&data);
            vol.write_from(&registered, 0, len, offset).expect("write_from");
        }
        model[offset as usize..offset as usize + len].copy_from_slice(&data);

        // Read back through both paths.
        let mut back = vec![0u8; len];
        vol.read_at(&mut back, offset).expect("read_at");
        assert!(back == data, "iteration {i}: read_at returned other bytes at {offset}+{len}");
        registered.as_mut_slice()[..len].fill(0);
        vol.read_into(&mut registered, 0, len, offset).expect("read_into");
        assert!(registered.as_slice()[..len] == data[..], "iteration {i}: read_into returned other bytes");
        // An acknowledged write is in the store (a file's O_DIRECT write,
        // an image's write on the OSDs: librbd's cache is off); check the
        // bytes as another reader of the store sees them.
        assert!(store.bytes_at(offset, len) == data, "iteration {i}: the {kind:?} store differs at {offset}+{len}");
    }
    vol.flush().expect("flush");
    let whole = store.contents();
    assert!(whole == model, "the {kind:?} store differs from the model after flush");
    drop((vol, session));
    stop(target);
}

#[test]
fn writes_larger_than_max_io_are_split_and_reassembled() {
    writes_larger_than_max_io_are_split_and_reassembled_on(BackingKind::File);
}

#[test]
fn writes_larger_than_max_io_are_split_and_reassembled_on_rbd() {
    writes_larger_than_max_io_are_split_and_reassembled_on(BackingKind::Rbd);
}

fn writes_larger_than_max_io_are_split_and_reassembled_on(kind: BackingKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "big.img", VOLUME);
    let config = format!("{}max_io_size = \"256KiB\"\n{}", target_section(), store.volume("big", VOLUME, false));
    let target = TargetProcess::start(&config);
    let session = Session::connect(&target.url, ConnectOptions::default()).expect("connect");
    assert_eq!(session.max_io_size(), 256 * 1024);
    let vol = session.open("big").unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let data = random_bytes(&mut rng, 3 * MIB as usize + 8192);
    vol.write_at(&data, 8192).unwrap();
    let mut back = vec![0u8; data.len()];
    vol.read_at(&mut back, 8192).unwrap();
    assert!(back == data);
    assert!(store.bytes_at(8192, data.len()) == data, "the {kind:?} store differs");
    drop((vol, session));
    stop(target);
}

#[test]
fn read_only_volume_refuses_writes_with_its_status() {
    read_only_volume_refuses_writes_with_its_status_on(BackingKind::File);
}

#[test]
fn read_only_volume_refuses_writes_with_its_status_on_rbd() {
    read_only_volume_refuses_writes_with_its_status_on(BackingKind::Rbd);
}

fn read_only_volume_refuses_writes_with_its_status_on(kind: BackingKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "ro.img", 8 * MIB);
    store.write_at(&vec![0x5au8; 8 * MIB as usize], 0);
    let target = TargetProcess::start(&format!("{}\n{}", target_section(), store.volume("ro", 8 * MIB, true)));
    let session = Session::connect(&target.url, ConnectOptions::default()).unwrap();
    let vol = session.open("ro").unwrap();
    let err = vol.write_at(&[1u8; 4096], 0).expect_err("write to a read-only volume succeeded");
    assert_eq!(err.status(), Some(Status::ReadOnly), "{err}");
    assert!(err.to_string().contains("read-only"), "{err}");
    let mut back = vec![0u8; 4096];
    vol.read_at(&mut back, 0).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a));
    assert!(store.contents().iter().all(|&b| b == 0x5a), "the refused write changed the {kind:?} store");
    drop((vol, session));
    stop(target);
}

#[test]
fn cli_writes_one_mib_at_12288_flushes_and_reads_it_back() {
    cli_writes_one_mib_at_12288_flushes_and_reads_it_back_on(BackingKind::File);
}

#[test]
fn cli_writes_one_mib_at_12288_flushes_and_reads_it_back_on_rbd() {
    cli_writes_one_mib_at_12288_flushes_and_reads_it_back_on(BackingKind::Rbd);
}

fn cli_writes_one_mib_at_12288_flushes_and_reads_it_back_on(kind: BackingKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "cli.img", VOLUME);
    let target = TargetProcess::start(&format!("{}\n{}", target_section(), store.volume("vol0", VOLUME, false)));
    let url = target.url.as_str();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let input = random_bytes(&mut rng, MIB as usize);
    let input_path = dir.path().join("input");
    std::fs::write(&input_path, &input).unwrap();

    let out = rdmablk(&["--target", url, "write", "vol0", "--offset", "12288", "--input", input_path.to_str().unwrap()], None);
    assert!(out.status.success(), "write failed: {}", String::from_utf8_lossy(&out.stderr));
    let out = rdmablk(&["--target", url, "flush", "vol0"], None);
    assert!(out.status.success(), "flush failed: {}", String::from_utf8_lossy(&out.stderr));
    let out = rdmablk(&["--target", url, "read", "vol0", "--offset", "12288", "--length", "1MiB"], None);
    assert!(out.status.success(), "read failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == input, "read returned other bytes");
    assert!(store.bytes_at(12288, MIB as usize) == input, "the {kind:?} store differs");

    // stdin input and --output file work too.
    let out = rdmablk(&["--target", url, "write", "vol0", "--offset", "0"], Some(&input[..8192]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let output_path = dir.path().join("out");
    let out = rdmablk(&["--target", url, "read", "vol0", "--offset", "0", "--length", "8k", "--output", output_path.to_str().unwrap()], None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&output_path).unwrap() == input[..8192]);
    assert!(store.bytes_at(0, 8192) == input[..8192], "the {kind:?} store differs after the write from stdin");

    let out = rdmablk(&["--target", url, "list"], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("vol0") && text.contains(&VOLUME.to_string()) && text.contains("rw"), "{text}");
    stop(target);
}

#[test]
fn cli_misaligned_write_fails_with_a_clear_message() {
    cli_misaligned_write_fails_with_a_clear_message_on(BackingKind::File);
}

#[test]
fn cli_misaligned_write_fails_with_a_clear_message_on_rbd() {
    cli_misaligned_write_fails_with_a_clear_message_on(BackingKind::Rbd);
}

fn cli_misaligned_write_fails_with_a_clear_message_on(kind: BackingKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "m.img", 8 * MIB);
    // Something to lose: a refused write must leave these bytes as they are.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    store.write_at(&random_bytes(&mut rng, 64 * 1024), 8192);
    let target = TargetProcess::start(&format!("{}\n{}", target_section(), store.volume("vol0", 8 * MIB, false)));
    let before = store.contents();
    let out = rdmablk(&["--target", &target.url, "write", "vol0", "--offset", "12289"], Some(&[7u8; 4096]));
    assert!(!out.status.success(), "misaligned write succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "expected a one-line message, got {err:?}");
    assert!(err.contains("12289") && err.contains("4096"), "message does not name the offset and block size: {err}");
    assert!(store.contents() == before, "the refused misaligned write changed the {kind:?} store");

    let out = rdmablk(&["--target", &target.url, "read", "nosuchvol", "--offset", "0", "--length", "4k"], None);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nosuchvol"));
    stop(target);
}

// File only: its subject is `--check` naming a misspelt key of the config, not a store's data.
#[test]
fn check_mode_validates_and_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("c.img");
    let good = dir.path().join("good.toml");
    std::fs::write(&good, format!("{}\n{}", target_section(), file_volume("vol0", &img, 8 * MIB, false))).unwrap();
    let out = std::process::Command::new(rdmablk_system_tests::bin("rdmablk-target"))
        .args(["--config", good.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("vol0"));

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, format!("{}\n{}blok_size = 4096\n", target_section(), file_volume("vol0", &img, 8 * MIB, false))).unwrap();
    let out = std::process::Command::new(rdmablk_system_tests::bin("rdmablk-target"))
        .args(["--config", bad.to_str().unwrap(), "--check"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("blok_size") && err.contains("bad.toml"), "{err}");
}

#[test]
fn a_polling_initiator_keeps_data_right_and_its_next_call_releases_what_its_held_ack_kept() {
    a_polling_initiator_keeps_data_right_and_its_next_call_releases_what_its_held_ack_kept_on(BackingKind::File);
}

#[test]
fn a_polling_initiator_keeps_data_right_and_its_next_call_releases_what_its_held_ack_kept_on_rbd() {
    a_polling_initiator_keeps_data_right_and_its_next_call_releases_what_its_held_ack_kept_on(BackingKind::Rbd);
}

fn a_polling_initiator_keeps_data_right_and_its_next_call_releases_what_its_held_ack_kept_on(kind: BackingKind) {
    let dir = tempfile::tempdir().unwrap();
    let store = Backing::new(kind, dir.path(), "vol0.img", VOLUME);
    let config = format!("{}reactors = 1\nmetrics = \"127.0.0.1:0\"\n{}", target_section(), store.volume("vol0", VOLUME, false));
    let target = TargetProcess::start(&config);
    let addr = target.metrics_addr();
    let chunks_in_use = || sample(&scrape(&addr), "rdmablk_buffer_pool_chunks_in_use", &[("reactor", "0")]).unwrap();
    let seed = seed();
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    // A polling queue lets each response's ACK ride on its next command.
    let options = ConnectOptions { queues: 1, busy_poll: Duration::from_millis(1), ..ConnectOptions::default() };
    let session = Session::connect(&target.url, options).expect("connect");
    let vol = session.open("vol0").expect("open");
    let bs = vol.block_size() as u64;
    for i in 0..200 {
        let len = (rng.gen_range(1..=16u64) * bs) as usize;
        let offset = rng.gen_range(0..=(VOLUME - len as u64) / bs) * bs;
        let data = random_bytes(&mut rng, len);
        vol.write_at(&data, offset).expect("write_at");
        let mut back = vec![0u8; len];
        vol.read_at(&mut back, offset).expect("read_at");
        assert!(back == data, "iteration {i}: read_at returned other bytes at {offset}+{len}");
        assert!(store.bytes_at(offset, len) == data, "iteration {i}: the {kind:?} store differs at {offset}+{len}");
    }

    // The last read is delivered. On tcp the ACK of its response is held
    // for the queue's next call, which keeps at most that command's buffer
    // on the target (its data's ACK may have left at a poll before the
    // response came); the next call releases everything.
    std::thread::sleep(Duration::from_millis(300));
    let held = chunks_in_use();
    assert!(held <= 1.0, "{held} buffers held after the last read, at most its own may be");
    vol.flush().expect("flush");
    wait_until("the next call released the buffers", Duration::from_secs(10), || chunks_in_use() == 0.0);

    // A queue that sleeps sends each ACK before it delivers the response.
    let session = Session::connect(&target.url, ConnectOptions { queues: 1, ..ConnectOptions::default() }).expect("connect");
    let vol = session.open("vol0").expect("open");
    let mut back = vec![0u8; 4096];
    vol.read_at(&mut back, 0).expect("read_at");
    wait_until("a sleeping queue's ACK released the buffer", Duration::from_secs(10), || chunks_in_use() == 0.0);
    drop((vol, session));
    stop(target);
}
