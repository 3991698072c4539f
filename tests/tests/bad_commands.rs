//! Every kind of bad command gets its own status from the real daemon, and
//! no bad command changes a byte of any volume.
//!
//! Each test runs twice: on file volumes, and on RBD volumes, images of the
//! dev Ceph cluster (issue 54), whose bytes are checked as Ceph holds them
//! (`rbd export`).

use std::time::Duration;

use rdmablk_common::protocol::{
    CommandCapsule, Opcode, Status, VolumeId, VolumeInfo, FLAG_FUA,
    FLAG_INLINE_DATA, PROTOCOL_VERSION, VOLUME_INFO_SIZE,
};
use rdmablk_system_tests::raw::io_command as io;
use rdmablk_system_tests::raw::RawQueue;
use rdmablk_system_tests::backing::{Backing, BackingKind};
use rdmablk_system_tests::{bytes_digest, target_section, TargetProcess};

const MIB: u64 = 1 << 20;

struct Fixture {
    target: TargetProcess,
    /// The stores of "rw", "ro" and "other".
    stores: Vec<Backing>,
    _dir: tempfile::TempDir,
}

fn fixture(kind: BackingKind) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let stores: Vec<Backing> = ["rw.img", "ro.img", "other.img"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let store = Backing::new(kind, dir.path(), name, 16 * MIB);
            // Recognisable contents, so "untouched" means something.
            let pattern: Vec<u8> = (0..16 * MIB).map(|x| (x as u8).wrapping_mul(31).wrapping_add(i as u8)).collect();
            store.write_at(&pattern, 0);
            store
        })
        .collect();
    let config = format!(
        "{}\n{}\n{}\n{}",
        target_section(),
        stores[0].volume("rw", 16 * MIB, false),
        stores[1].volume("ro", 16 * MIB, true),
        stores[2].volume("other", 16 * MIB, false)
    );
    let target = TargetProcess::start(&config);
    Fixture { target, stores, _dir: dir }
}

/// A digest of what `store` holds (the file, or the image as Ceph has it).
fn digest(store: &Backing) -> u64 {
    bytes_digest(&store.contents())
}

/// Stops the target with SIGTERM and expects a clean exit (an rbd volume
/// closes its image, so that removing it need not wait out a killed
/// gateway's watch).
fn stop(fx: &mut Fixture) {
    fx.target.signal(libc::SIGTERM);
    let code = fx.target.wait_exit(Duration::from_secs(20));
    assert_eq!(code, Some(0), "the target's exit on SIGTERM; log:\n{}", fx.target.log().join("\n"));
}

fn list(q: &mut RawQueue) -> Vec<VolumeInfo> {
    let mut c = CommandCapsule::new(Opcode::ListVolumes, Default::default());
    c.descriptor = q.descriptor(0, 16 * VOLUME_INFO_SIZE as u32);
    let r = q.command(c, &[]).expect("LIST");
    assert_eq!(r.capsule.status, Status::Success);
    let n = r.capsule.result as usize;
    (0..n).map(|i| VolumeInfo::decode(&q.data()[i * VOLUME_INFO_SIZE..(i + 1) * VOLUME_INFO_SIZE]).unwrap()).collect()
}

fn status_of(q: &mut RawQueue, c: CommandCapsule, inline: &[u8]) -> Status {
    q.command(c, inline).unwrap_or_else(|e| panic!("no response to {c:?}: {e:?}")).capsule.status
}

#[test]
fn each_bad_command_gets_its_own_status_and_volumes_stay_untouched() {
    each_bad_command(BackingKind::File);
}

#[test]
fn each_bad_command_gets_its_own_status_and_volumes_stay_untouched_on_rbd() {
    each_bad_command(BackingKind::Rbd);
}

fn each_bad_command(kind: BackingKind) {
    let mut fx = fixture(kind);
    let before: Vec<u64> = fx.stores.iter().map(digest).collect();
    let url = fx.target.url.clone();

    // Before CONNECT.
    let mut fresh = RawQueue::open(&url, 1 << 20);
    let d = fresh.descriptor(0, 4096);
    assert_eq!(status_of(&mut fresh, io(Opcode::Read, VolumeId(0), 0, 1, d), &[]), Status::NotConnected);

    // Version mismatch: the target names its own version in the detail.
    let mut old = RawQueue::open(&url, 4096);
    let r = old.connect_command(PROTOCOL_VERSION + 1, 32, 1 << 20, "future-host").unwrap();
    assert_eq!(r.capsule.status, Status::VersionMismatch);
    assert_eq!(r.capsule.detail, PROTOCOL_VERSION as u32);

    let (mut q, reply) = RawQueue::connected(&url, 4 << 20);
    assert!(reply.queue_depth >= 1);
    let max_io = reply.max_io_size;
    assert_eq!(status_of(&mut q, {
        let mut c = CommandCapsule::new(Opcode::Connect, Default::default());
        c.version = PROTOCOL_VERSION;
        c.queue_depth = 8;
        c.max_io_size = 4096;
        c.inline_len = 1;
        c
    }, b"h"), Status::AlreadyConnected);

    let vols = list(&mut q);
    let id_of = |name: &str| vols.iter().find(|v| v.name == name).unwrap_or_else(|| panic!("{name} listed")).volume_id;
    assert_eq!(q.open_volume("nope"), Err(Status::UnknownVolume));
    let rw = q.open_volume("rw").unwrap();
    let ro = q.open_volume("ro").unwrap();
    assert!(ro.read_only() && !rw.read_only());
    assert_eq!(rw.block_size, 4096);
    let bs = rw.block_size;
    let blocks = rw.size_bytes / bs as u64;
    let d1 = q.descriptor(0, bs);

    let cases: Vec<(&str, CommandCapsule, Vec<u8>, Status)> = vec![
        ("unknown volume id", io(Opcode::Read, VolumeId(9999), 0, 1, d1), vec![], Status::UnknownVolume),
        ("volume not opened", io(Opcode::Read, id_of("other"), 0, 1, d1), vec![], Status::VolumeNotOpen),
        ("write to read-only", io(Opcode::Write, ro.volume_id, 0, 1, d1), vec![], Status::ReadOnly),
        ("discard read-only", io(Opcode::Discard, ro.volume_id, 0, 1, Default::default()), vec![], Status::ReadOnly),
        ("zero blocks", io(Opcode::Read, rw.volume_id, 0, 0, q.descriptor(0, 0)), vec![], Status::ZeroLength),
        ("misaligned length", io(Opcode::Read, rw.volume_id, 0, 1, q.descriptor(0, bs + 1)), vec![], Status::Misaligned),
        ("length mismatch", io(Opcode::Read, rw.volume_id, 0, 1, q.descriptor(0, 2 * bs)), vec![], Status::LengthMismatch),
        (
            "above max io",
            io(Opcode::Read, rw.volume_id, 0, (max_io / bs) * 2, q.descriptor(0, max_io * 2)),
            vec![],
            Status::TooLarge,
        ),
        ("past the end", io(Opcode::Read, rw.volume_id, blocks, 1, d1), vec![], Status::OutOfRange),
        ("straddles the end", io(Opcode::Write, rw.volume_id, blocks - 1, 2, q.descriptor(0, 2 * bs)), vec![], Status::OutOfRange),
        ("lba overflow", io(Opcode::Read, rw.volume_id, u64::MAX - 1, 4, q.descriptor(0, 4 * bs)), vec![], Status::OutOfRange),
        ("discard past end", io(Opcode::Discard, rw.volume_id, blocks, 1, Default::default()), vec![], Status::OutOfRange),
        ("write zeroes overflow", io(Opcode::WriteZeroes, rw.volume_id, u64::MAX, 2, Default::default()), vec![], Status::OutOfRange),
        (
            "misaligned inline write",
            {
                let mut c = io(Opcode::Write, rw.volume_id, 0, 1, Default::default());
                c.flags = FLAG_INLINE_DATA;
                c.inline_len = 100;
                c
            },
            vec![0xee; 100],
            Status::Misaligned,
        ),
        (
            "FUA on a read",
            {
                let mut c = io(Opcode::Read, rw.volume_id, 0, 1, d1);
                c.flags = FLAG_FUA;
                c
            },
            vec![],
            Status::InvalidField,
        ),
        ("flush with a descriptor", io(Opcode::Flush, rw.volume_id, 0, 0, d1), vec![], Status::InvalidField),
    ];
    let mut seen = Vec::new();
    for (what, capsule, inline, want) in cases {
        let mut c = capsule;
        c.inline_len = inline.len() as u32;
        let got = status_of(&mut q, c, &inline);
        assert_eq!(got, want, "{what}");
        seen.push(got);
    }

    // Raw bytes the typed encoder cannot produce.
    let mut unknown = CommandCapsule::new(Opcode::KeepAlive, Default::default()).to_bytes();
    unknown[0] = 0x7f;
    unknown[2] = 0x55;
    q.send_bytes(&unknown);
    let r = q.wait_response(rdmablk_common::protocol::CommandId(0x55), Duration::from_secs(10)).unwrap();
    assert_eq!(r.capsule.status, Status::InvalidOpcode);
    let mut reserved = CommandCapsule::new(Opcode::KeepAlive, Default::default()).to_bytes();
    reserved[2] = 0x56;
    reserved[60] = 1;
    q.send_bytes(&reserved);
    let r = q.wait_response(rdmablk_common::protocol::CommandId(0x56), Duration::from_secs(10)).unwrap();
    assert_eq!(r.capsule.status, Status::InvalidField);

    // The queue pair survived all of it, and a good command still works.
    assert!(q.is_alive());
    let keep = CommandCapsule::new(Opcode::KeepAlive, Default::default());
    assert_eq!(status_of(&mut q, keep, &[]), Status::Success);
    let d = q.descriptor(0, bs);
    assert_eq!(status_of(&mut q, io(Opcode::Read, rw.volume_id, 1, 1, d), &[]), Status::Success);
    assert_eq!(&q.data()[..bs as usize], &fx.stores[0].contents()[bs as usize..2 * bs as usize]);

    let after: Vec<u64> = fx.stores.iter().map(digest).collect();
    assert_eq!(before, after, "a rejected command changed a volume");
    stop(&mut fx);
    let after: Vec<u64> = fx.stores.iter().map(digest).collect();
    assert_eq!(before, after, "a volume changed by the target's exit");
}

#[test]
fn a_wrong_rkey_drops_only_that_connection_and_writes_nothing() {
    a_wrong_rkey(BackingKind::File);
}

#[test]
fn a_wrong_rkey_drops_only_that_connection_and_writes_nothing_on_rbd() {
    a_wrong_rkey(BackingKind::Rbd);
}

fn a_wrong_rkey(kind: BackingKind) {
    let mut fx = fixture(kind);
    let before = digest(&fx.stores[0]);
    let (mut good, _) = RawQueue::connected(&fx.target.url, 1 << 20);
    let good_vol = good.open_volume("rw").unwrap();

    let (mut bad, _) = RawQueue::connected(&fx.target.url, 1 << 20);
    let vol = bad.open_volume("rw").unwrap();
    let mut desc = bad.descriptor(0, 4096);
    desc.rkey ^= 0x5a5a_5a5a;
    // The target's RDMA READ meets a key the initiator never registered: a
    // real NIC fails it and breaks that queue pair. No response arrives and
    // nothing is written.
    let r = bad.command(io(Opcode::Write, vol.volume_id, 0, 1, desc), &[]);
    assert!(r.is_err() || r.as_ref().unwrap().capsule.status != Status::Success, "write with a wrong rkey succeeded: {r:?}");

    // The other session is unaffected.
    let d = good.descriptor(0, 4096);
    assert_eq!(status_of(&mut good, io(Opcode::Read, good_vol.volume_id, 0, 1, d), &[]), Status::Success);
    assert_eq!(digest(&fx.stores[0]), before);
    stop(&mut fx);
    assert_eq!(digest(&fx.stores[0]), before, "the volume changed by the target's exit");
}
