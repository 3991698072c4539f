//! A read's data leaves over NVMe/TCP in order, whichever of its pieces
//! the target has first. Linux's host copies C2HData into the request in
//! arrival order and never reads DATAO, so a piece sent ahead of an
//! earlier one lands at the wrong place: the kernel's host read a file's
//! 144 KiB with its last 16 KiB first (CI, nvme-tcp-fs). The test host
//! (`rdmablk_system_tests::nvme_tcp`) refuses C2HData out of order as a
//! protocol error.
//!
//! The way a later piece comes first here, deterministically: sequential
//! readahead. Three reads of 128 KiB in a row make a stream, whose next
//! chunks are read ahead; a read that starts half a chunk before them has
//! its first piece in no chunk read ahead (a disk read) and its second in
//! one (served at once). The metrics show readahead served pieces, so the
//! test cannot pass with it off.

use std::time::Duration;

use rand::{RngCore, SeedableRng};
use rdmablk_common::nvme::tcp::Digests;
use rdmablk_system_tests::nvme_tcp::NvmeTcpConn;
use rdmablk_system_tests::{file_volume, listen_host, sample_sum, scrape, TargetProcess};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// The target's default pool chunk: a read's pieces are this long.
const CHUNK: u64 = 128 * KIB;
const BS: u64 = 4096;
const VOL_SIZE: u64 = 64 * MIB;
const SUBNQN: &str = "nqn.2026-12.io.rdmablk.test:read-order";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:7b1c0000-0000-4000-8000-0000000000a1";
const NO_DIGESTS: Digests = Digests { header: false, data: false };

#[test]
fn a_read_whose_later_piece_was_read_ahead_sends_its_data_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("vol.img");
    let mut content = vec![0u8; VOL_SIZE as usize];
    rand::rngs::StdRng::seed_from_u64(0x5eed_04de_u64).fill_bytes(&mut content);
    std::fs::write(&img, &content).unwrap();
    let host = listen_host();
    let config = format!(
        "[target]\nlisten = [\"nvme+tcp://{host}:0\"]\nnqn = \"{SUBNQN}\"\nreactors = 1\nmetrics = \"127.0.0.1:0\"\n{}",
        file_volume("vol", &img, VOL_SIZE, true)
    );
    let target = TargetProcess::start(&config);
    let (addr, metrics) = (target.nvme_tcp_addr(), target.metrics_addr());
    let (_admin, cntlid) = NvmeTcpConn::admin(addr, NO_DIGESTS, SUBNQN, HOSTNQN, 0);
    let mut io = NvmeTcpConn::io(addr, NO_DIGESTS, cntlid, 1, SUBNQN, HOSTNQN);
    let mut read = |offset: u64, len: u64| {
        let got = io.read(1, offset / BS, (len / BS) as u32, BS as u32).unwrap_or_else(|s| panic!("read {len} at {offset}: {s}"));
        let want = &content[offset as usize..(offset + len) as usize];
        if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
            panic!("read {len} at {offset}: byte {i} differs from the backing file");
        }
    };
    const ROUNDS: u64 = 8;
    for round in 0..ROUNDS {
        let base = round * 4 * MIB;
        for k in 0..3 {
            read(base + k * CHUNK, CHUNK);
        }
        // The chunks from base + 3 * CHUNK on are being read ahead; a
        // moment for their reads (they are served for a second).
        std::thread::sleep(Duration::from_millis(100));
        // Piece 0: [2.5, 3.5) chunks, from the disk; piece 1: [3.5, 3.625)
        // chunks, from the chunk read ahead at 3.
        read(base + 5 * CHUNK / 2, CHUNK + 16 * KIB);
    }
    let hits = sample_sum(&scrape(&metrics), "rdmablk_readahead_hits_total");
    assert!(hits >= 1.0, "readahead served no piece ({hits}): the case was not exercised");
}
