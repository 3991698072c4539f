//! The initiator against a fake target built on the fabric API (tcp provider,
//! loopback): negotiation, every command, zero-copy and bounce paths,
//! splitting and pipelining within the queue depth, error mapping, timeouts
//! and lost connections, the raw-command entry point and the CLI.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::protocol::{
    BlockCount, CommandCapsule, CommandId, Lba, Opcode, Status, VolumeId, FLAG_FUA, FLAG_INLINE_DATA,
};
use rdmablk_initiator::{BlockDevice, ConnectOptions, ErrorKind, Session};
use support::{pattern, FakeConfig, FakeTarget, FakeVolume};

const MIB: usize = 1 << 20;

fn options() -> ConnectOptions {
    ConnectOptions {
        host_id: "test-host".into(),
        connect_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(10),
        ..ConnectOptions::default()
    }
}

fn one_volume(config: FakeConfig) -> FakeTarget {
    FakeTarget::start(config, vec![FakeVolume::new("vol0", 8 * MIB, 4096)])
}

#[test]
fn connect_negotiates_and_lists_volumes() {
    let config = FakeConfig { queue_depth: 16, max_io: 256 << 10, inline: 2048, ..FakeConfig::default() };
    let target = FakeTarget::start(
        config,
        vec![
            FakeVolume::new("a", MIB, 512),
            FakeVolume::new("b", 2 * MIB, 4096).read_only(),
            FakeVolume::new("c", 4 * MIB, 4096),
        ],
    );
    let s = Session::connect(&target.url, options()).unwrap();
    assert_eq!(s.target_name(), "fake-target");
    assert_eq!(s.queue_depth(), 16);
    assert_eq!(s.max_io_size(), 256 << 10);
    assert_eq!(s.inline_data_size(), 2048);
    // Every queue pair's CONNECT carries the host id.
    assert_eq!(target.observed.lock().unwrap().host_ids, vec!["test-host".to_owned(); s.queue_count()]);
    let vols = s.list_volumes().unwrap();
    let names: Vec<_> = vols.iter().map(|v| (v.name.as_str(), v.size_bytes, v.block_size, v.read_only())).collect();
    assert_eq!(
        names,
        vec![("a", MIB as u64, 512, false), ("b", 2 * MIB as u64, 4096, true), ("c", 4 * MIB as u64, 4096, false)]
    );
    s.keep_alive().unwrap();
    assert!(s.is_connected());
}

#[test]
fn list_retries_when_more_volumes_than_fit() {
    // max_io 4 KiB: the first attempt has room for 42 entries.
    let config = FakeConfig { max_io: 4096, ..FakeConfig::default() };
    let vols = (0..100).map(|i| FakeVolume::new(&format!("v{i:03}"), 64 * 1024, 4096)).collect();
    let target = FakeTarget::start(config, vols);
    let s = Session::connect(&target.url, options()).unwrap();
    let list = s.list_volumes().unwrap();
    assert_eq!(list.len(), 100);
    assert_eq!(list[99].name, "v099");
    let lists = target.commands().iter().filter(|c| c.opcode == Opcode::ListVolumes).count();
    assert_eq!(lists, 2, "one short attempt, one retry");
}

#[test]
fn version_mismatch_names_both_versions() {
    let target = one_volume(FakeConfig { version_mismatch: Some(2), ..FakeConfig::default() });
    let e = Session::connect(&target.url, options()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::VersionMismatch);
    assert_eq!(e.to_string(), "target speaks protocol v2, this initiator speaks v1");
}

#[test]
fn connect_to_nothing_fails_clearly() {
    // Bind and drop a listener to find a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e = Session::connect(format!("tcp://127.0.0.1:{port}"), options()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fabric, "{e}");
    assert!(e.to_string().contains(&port.to_string()), "{e}");
}

#[test]
fn open_unknown_volume_names_it() {
    let target = one_volume(FakeConfig::default());
    let s = Session::connect(&target.url, options()).unwrap();
    let e = s.open("nosuchvol").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownVolume);
    assert!(e.to_string().contains("nosuchvol"), "{e}");
    let e = s.open(&"x".repeat(65)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn every_data_path_round_trips() {
    let target = one_volume(FakeConfig::default());
    let s = Session::connect(&target.url, options()).unwrap();
    let vol = s.open("vol0").unwrap();
    assert_eq!((vol.size(), vol.block_size()), (8 * MIB as u64, 4096));

    // Plain slice, large: bounce pool.
    let big = pattern(3 * MIB, 1);
    vol.write_at(&big, 4096).unwrap();
    assert_eq!(target.volume_data(0)[4096..4096 + 3 * MIB], big[..]);
    let mut back = vec![0u8; 3 * MIB];
    vol.read_at(&mut back, 4096).unwrap();
    assert_eq!(back, big);

    // Plain slice, small: inline.
    let before = s.stats();
    let small = pattern(4096, 2);
    vol.write_at(&small, 0).unwrap();
    let after = s.stats();
    assert_eq!(after.inline_writes - before.inline_writes, 1);
    assert_eq!(after.bounce_copies, before.bounce_copies);
    let last = *target.commands().last().unwrap();
    assert_eq!(last.flags & FLAG_INLINE_DATA, FLAG_INLINE_DATA);
    assert_eq!(target.volume_data(0)[..4096], small[..]);

    // Registered buffer: zero copy, nothing through the bounce pool.
    let mut buf = s.alloc_buffer(2 * MIB).unwrap();
    buf.as_mut_slice().copy_from_slice(&pattern(2 * MIB, 3));
    let before = s.stats();
    vol.write_from(&buf, MIB, MIB, 6 * MIB as u64).unwrap();
    assert_eq!(target.volume_data(0)[6 * MIB..7 * MIB], pattern(2 * MIB, 3)[MIB..]);
    buf.as_mut_slice().fill(0);
    vol.read_into(&mut buf, 4096, 3 * MIB - 4096 * 2 - 4096, 4096).unwrap_err(); // overruns the buffer
    vol.read_into(&mut buf, 4096, MIB, 4096).unwrap();
    assert_eq!(buf.as_slice()[4096..4096 + MIB], big[..MIB]);
    assert!(buf.as_slice()[..4096].iter().all(|&b| b == 0), "bytes before the range untouched");
    let after = s.stats();
    assert_eq!(after.bounce_copies, before.bounce_copies, "zero-copy path used the bounce pool");
    assert_eq!(after.bounce_bytes, before.bounce_bytes);
    assert_eq!(after.zero_copy_bytes - before.zero_copy_bytes, 2 * MIB as u64);
}

#[test]
fn large_requests_are_split_and_pipelined_within_the_queue_depth() {
    let config = FakeConfig { queue_depth: 4, max_io: 64 << 10, inline: 0, ..FakeConfig::default() };
    let target = one_volume(config);
    let s = Session::connect(&target.url, ConnectOptions { queue_depth: 128, ..options() }).unwrap();
    assert_eq!(s.queue_depth(), 4);
    let vol = s.open("vol0").unwrap();
    let data = pattern(MIB + 8192, 9);
    let mut buf = s.alloc_buffer(data.len()).unwrap();
    buf.as_mut_slice().copy_from_slice(&data);
    let n0 = target.command_count();
    target.reset_max_outstanding();
    vol.write_from(&buf, 0, data.len(), 8192).unwrap();
    let cmds = target.commands()[n0..].to_vec();
    assert_eq!(cmds.len(), 17, "1 MiB + 8 KiB in 64 KiB pieces");
    assert!(cmds.iter().all(|c| c.opcode == Opcode::Write && c.descriptor.length <= 64 << 10));
    let blocks: u64 = cmds.iter().map(|c| u64::from(c.block_count.0)).sum();
    assert_eq!(blocks * 4096, data.len() as u64);
    let max = target.max_outstanding();
    assert!(max <= 4, "{max} commands outstanding with a queue depth of 4");
    assert!(max >= 2, "pieces were not pipelined (max outstanding {max})");
    assert_eq!(target.volume_data(0)[8192..8192 + data.len()], data[..]);

    // Reads reassemble in order, through both paths.
    let mut back = vec![0u8; data.len()];
    target.reset_max_outstanding();
    vol.read_at(&mut back, 8192).unwrap();
    assert_eq!(back, data);
    let mut rbuf = s.alloc_buffer(data.len()).unwrap();
    vol.read_into(&mut rbuf, 0, data.len(), 8192).unwrap();
    assert_eq!(rbuf.as_slice(), &data[..]);
    assert!(target.max_outstanding() <= 4);
}

#[test]
fn fua_flush_discard_and_write_zeroes_reach_the_target() {
    let target = one_volume(FakeConfig { zeroes_limited: true, max_io: 64 << 10, ..FakeConfig::default() });
    let s = Session::connect(&target.url, options()).unwrap();
    let vol = s.open("vol0").unwrap();
    let n0 = target.command_count();
    vol.write_at_fua(&pattern(256 << 10, 4), 0).unwrap();
    let cmds = target.commands()[n0..].to_vec();
    assert_eq!(cmds.len(), 4);
    assert!(cmds.iter().all(|c| c.flags & FLAG_FUA != 0), "FUA on every piece");
    vol.flush().unwrap();
    assert_eq!(target.commands().last().unwrap().opcode, Opcode::Flush);

    // write_zeroes over 2 MiB: the target only takes max-I/O-size pieces
    // (TooLarge), so the initiator falls back to those.
    vol.write_at(&pattern(2 * MIB, 5), 0).unwrap();
    vol.write_zeroes(0, 2 * MIB as u64).unwrap();
    assert!(target.volume_data(0)[..2 * MIB].iter().all(|&b| b == 0));
    let mut back = vec![1u8; 2 * MIB];
    vol.read_at(&mut back, 0).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    vol.discard(MIB as u64, MIB as u64).unwrap();
    assert_eq!(target.commands().last().unwrap().opcode, Opcode::Discard);
}

#[test]
fn write_zeroes_is_emulated_and_discard_skipped_without_support() {
    let target = FakeTarget::start(FakeConfig::default(), vec![FakeVolume::new("plain", 4 * MIB, 4096).flags(0)]);
    let s = Session::connect(&target.url, options()).unwrap();
    let vol = s.open("plain").unwrap();
    assert!(!vol.supports_write_zeroes() && !vol.supports_discard());
    vol.write_at(&pattern(3 * MIB, 6), 0).unwrap();
    let n0 = target.command_count();
    vol.write_zeroes(4096, 3 * MIB as u64 - 4096).unwrap();
    let cmds = target.commands()[n0..].to_vec();
    assert!(cmds.iter().all(|c| c.opcode == Opcode::Write), "{cmds:?}");
    assert!(target.volume_data(0)[4096..3 * MIB].iter().all(|&b| b == 0));
    assert_eq!(target.volume_data(0)[..4096], pattern(3 * MIB, 6)[..4096]);
    let n1 = target.command_count();
    vol.discard(0, 4096).unwrap();
    assert_eq!(target.command_count(), n1, "discard without support sends nothing");
}

#[test]
fn bad_requests_are_refused_before_anything_is_sent() {
    let target = FakeTarget::start(
        FakeConfig::default(),
        vec![FakeVolume::new("rw", MIB, 4096), FakeVolume::new("ro", MIB, 4096).read_only()],
    );
    let s = Session::connect(&target.url, options()).unwrap();
    let rw = s.open("rw").unwrap();
    let ro = s.open("ro").unwrap();
    let n0 = target.command_count();

    let e = rw.write_at(&vec![0u8; MIB], 12289).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Misaligned);
    assert_eq!(
        e.to_string(),
        "write of 1048576 bytes at offset 12289 is not aligned to the volume's 4096-byte block size"
    );
    assert_eq!(rw.read_at(&mut [0u8; 100], 0).unwrap_err().kind(), ErrorKind::Misaligned);
    let e = rw.read_at(&mut [0u8; 8192], MIB as u64 - 4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange);
    assert_eq!(e.status(), Some(Status::OutOfRange));
    let e = ro.write_at(&[0u8; 4096], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    assert_eq!(e.status(), Some(Status::ReadOnly));
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(ro.write_zeroes(0, 4096).unwrap_err().kind(), ErrorKind::ReadOnly);
    let mut buf = s.alloc_buffer(8192).unwrap();
    assert_eq!(rw.read_into(&mut buf, 4096, 8192, 0).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(target.command_count(), n0, "a refused request reached the target");

    // A buffer of another session is refused too.
    let other_target = one_volume(FakeConfig::default());
    let other = Session::connect(&other_target.url, options()).unwrap();
    let foreign = other.alloc_buffer(4096).unwrap();
    let e = rw.write_from(&foreign, 0, 4096, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("another session"), "{e}");
}

#[test]
fn target_errors_carry_status_volume_and_range_and_the_session_survives() {
    let mut v = FakeVolume::new("flaky", MIB, 4096);
    v.bad_block = Some(3);
    let target = FakeTarget::start(FakeConfig { max_io: 8192, ..FakeConfig::default() }, vec![v]);
    let s = Session::connect(&target.url, options()).unwrap();
    let vol = s.open("flaky").unwrap();
    let mut buf = vec![0u8; 64 << 10];
    let e = vol.read_at(&mut buf, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Target);
    assert_eq!(e.status(), Some(Status::IoError));
    let m = e.to_string();
    assert!(
        m.contains("\"flaky\"") && m.contains("offset 8192") && m.contains("8192 bytes") && m.contains("errno 5"),
        "{m}"
    );
    // The other pieces were drained; the connection is fine.
    assert!(s.is_connected());
    vol.read_at(&mut buf[..8192], 0).unwrap();
    s.keep_alive().unwrap();
}

#[test]
fn a_stalled_command_times_out_and_closes_the_session() {
    // Reconnection disabled: the first failure is final.
    let target = one_volume(FakeConfig { stall: Some(Opcode::Flush), ..FakeConfig::default() });
    let s = Session::connect(
        &target.url,
        ConnectOptions { io_timeout: Duration::from_millis(300), ctrl_loss_timeout: Duration::ZERO, ..options() },
    )
    .unwrap();
    let vol = s.open("vol0").unwrap();
    let t0 = Instant::now();
    let e = vol.flush().unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("flush") && e.to_string().contains("300ms"), "{e}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
    let e = vol.read_at(&mut [0u8; 4096], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Disconnected);
    assert!(e.to_string().contains("no response within 300ms"), "{e}");
    assert!(!s.is_connected());
}

#[test]
fn a_lost_connection_is_reported_as_disconnected() {
    // Reconnection disabled: the first failure is final.
    let target = one_volume(FakeConfig { drop_on: Some(Opcode::KeepAlive), ..FakeConfig::default() });
    let s = Session::connect(&target.url, ConnectOptions { ctrl_loss_timeout: Duration::ZERO, ..options() }).unwrap();
    let vol = s.open("vol0").unwrap();
    let t0 = Instant::now();
    let e = s.keep_alive().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Disconnected, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "noticed only after {:?}", t0.elapsed());
    assert_eq!(vol.flush().unwrap_err().kind(), ErrorKind::Disconnected);
}

#[test]
fn raw_commands_go_out_as_given() {
    let target = one_volume(FakeConfig::default());
    let s = Session::connect(&target.url, options()).unwrap();
    let _vol = s.open("vol0").unwrap();
    let mut buf = s.alloc_buffer(8192).unwrap();

    // Unknown volume id.
    let mut c = CommandCapsule::new(Opcode::Read, CommandId(999));
    c.volume_id = VolumeId(77);
    c.block_count = BlockCount(1);
    c.descriptor = buf.descriptor(0, 4096);
    let (r, data) = s.raw_command(c, &[], Some(&mut buf)).unwrap();
    assert_eq!(r.status, Status::UnknownVolume);
    assert!(data.is_empty());
    let sent = *target.commands().last().unwrap();
    assert_eq!(sent.volume_id, VolumeId(77));
    assert_ne!(sent.command_id, CommandId(999), "the command id is the slot");

    // Out-of-range LBA, passed through unchecked.
    let mut c = CommandCapsule::new(Opcode::Read, CommandId(0));
    c.volume_id = VolumeId(1);
    c.start_block = Lba(1 << 40);
    c.block_count = BlockCount(1);
    c.descriptor = buf.descriptor(0, 4096);
    assert_eq!(s.raw_command(c, &[], Some(&mut buf)).unwrap().0.status, Status::OutOfRange);

    // Structurally bad bytes: a non-zero reserved byte.
    let mut bytes = CommandCapsule::new(Opcode::KeepAlive, CommandId(0)).to_bytes();
    bytes[60] = 1;
    assert_eq!(s.raw_command_bytes(bytes, &[], None).unwrap().0.status, Status::InvalidField);
    // Unknown opcode.
    let mut bytes = CommandCapsule::new(Opcode::KeepAlive, CommandId(0)).to_bytes();
    bytes[0] = 0x7f;
    assert_eq!(s.raw_command_bytes(bytes, &[], None).unwrap().0.status, Status::InvalidOpcode);
    s.keep_alive().unwrap();
}

#[test]
fn volumes_are_shared_across_threads() {
    let target = one_volume(FakeConfig { queue_depth: 8, max_io: 64 << 10, ..FakeConfig::default() });
    let s = Session::connect(&target.url, options()).unwrap();
    let vol = Arc::new(s.open("vol0").unwrap());
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let vol = Arc::clone(&vol);
            std::thread::spawn(move || {
                let base = u64::from(t) * 2 * MIB as u64;
                for round in 0..5u8 {
                    let data = pattern(256 << 10, t.wrapping_mul(16).wrapping_add(round));
                    let off = base + u64::from(round) * (256 << 10);
                    vol.write_at(&data, off).unwrap();
                    let mut back = vec![0u8; data.len()];
                    vol.read_at(&mut back, off).unwrap();
                    assert_eq!(back, data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(target.max_outstanding() <= 8);
}

#[test]
fn opening_twice_closes_once_at_the_last_handle() {
    let target = one_volume(FakeConfig::default());
    let s = Session::connect(&target.url, options()).unwrap();
    let a = s.open("vol0").unwrap();
    let b = s.open("vol0").unwrap();
    drop(a);
    let closes = |t: &FakeTarget| t.commands().iter().filter(|c| c.opcode == Opcode::CloseVolume).count();
    assert_eq!(closes(&target), 0);
    b.read_at(&mut [0u8; 4096], 0).unwrap();
    b.close().unwrap();
    assert_eq!(closes(&target), 1);
}

#[test]
fn cli_commands_work_end_to_end() {
    use clap::Parser;
    use rdmablk_initiator::cli::{run, Cli};
    let target = FakeTarget::start(
        FakeConfig::default(),
        vec![FakeVolume::new("vol0", 4 * MIB, 4096), FakeVolume::new("ro", MIB, 512).read_only()],
    );
    let dir = tempfile::tempdir().unwrap();
    let cli = |args: &[&str]| {
        let mut full = vec!["rdmablk", "--target", target.url.as_str(), "--host-id", "cli-test"];
        full.extend_from_slice(args);
        let parsed = Cli::try_parse_from(full).unwrap();
        let mut out = Vec::new();
        run(&parsed, &mut out).map(|()| out)
    };
    let out = String::from_utf8(cli(&["list"]).unwrap()).unwrap();
    assert_eq!(
        out,
        "NAME  SIZE     BYTES    BLOCK  ACCESS\n\
         vol0  4.0 MiB  4194304  4096   rw\n\
         ro    1.0 MiB  1048576  512    ro\n"
    );
    let json: serde_json::Value = serde_json::from_slice(&cli(&["list", "-o", "json"]).unwrap()).unwrap();
    assert_eq!(json["volumes"][1]["size"], 1048576);
    assert_eq!((&json["volumes"][1]["name"], &json["volumes"][1]["block_size"]), (&"ro".into(), &512.into()));

    let out = String::from_utf8(cli(&["info", "vol0"]).unwrap()).unwrap();
    assert!(
        out.contains("name: vol0\n") && out.contains("size: 4.0 MiB (4194304 bytes)\n") && out.contains("target_name: fake-target\n"),
        "{out}"
    );
    let json: serde_json::Value = serde_json::from_slice(&cli(&["info", "ro", "--json"]).unwrap()).unwrap();
    assert_eq!(json["read_only"], true);
    assert_eq!(json["block_size"], 512);
    assert_eq!(json["max_io_size"], 1 << 20);

    let input = pattern(MIB, 8);
    let input_path = dir.path().join("in");
    std::fs::write(&input_path, &input).unwrap();
    cli(&["write", "vol0", "--offset", "12k", "--input", input_path.to_str().unwrap(), "--fua"]).unwrap();
    assert!(target.commands().iter().any(|c| c.opcode == Opcode::Write && c.fua()));
    cli(&["flush", "vol0"]).unwrap();
    let out = cli(&["read", "vol0", "--offset", "12288", "--length", "1MiB"]).unwrap();
    assert!(out == input);
    let out_path = dir.path().join("out");
    cli(&["read", "vol0", "--offset", "12k", "--length", "8k", "--output", out_path.to_str().unwrap()]).unwrap();
    assert_eq!(std::fs::read(&out_path).unwrap(), input[..8192]);

    let e = cli(&["write", "vol0", "--offset", "12289", "--input", input_path.to_str().unwrap()]).unwrap_err();
    assert!(e.to_string().contains("12289") && e.to_string().contains("4096"), "{e}");
    let e = cli(&["read", "nosuchvol", "--offset", "0", "--length", "4k"]).unwrap_err();
    assert!(e.to_string().contains("nosuchvol"), "{e}");
    assert_eq!(target.observed.lock().unwrap().host_ids.last().unwrap(), "cli-test");
}
