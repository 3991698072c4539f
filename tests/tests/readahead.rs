//! Sequential readahead (`target.readahead`) against the real daemon on a
//! real file: a READ served from a chunk read ahead returns what the last
//! completed write left there, whoever wrote it (the same queue pair,
//! another queue pair of the session on another reactor, another session),
//! whatever kind of write it was, and the volume's last, short chunk reads
//! right. Every test also checks through the metrics endpoint that
//! readahead really served reads, so none can pass with it silently off.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rdmablk_initiator::{BlockDevice, ConnectOptions, Session, Volume};
use rdmablk_system_tests::{file_volume, sample_sum, scrape, sparse_file, target_section, wait_until, TargetProcess};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const CHUNK: u64 = 128 * KIB;
const BLOCK: u64 = 4096;

fn seed() -> u64 {
    std::env::var("RDMABLK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn options(host: &str, queues: usize) -> ConnectOptions {
    ConnectOptions { host_id: host.to_owned(), queues, ..ConnectOptions::default() }
}

/// Two reactors (queue pairs go round-robin, so the reader's and the
/// writers' queue pairs are served by different reactors), a pool small
/// enough that readahead's quarter of it is exercised, and metrics.
fn start(img: &std::path::Path, size: u64, reactors: u32, extra: &str) -> (TargetProcess, String) {
    let config = format!(
        "{}reactors = {reactors}\nbuffer_pool = \"16MiB\"\nmetrics = \"127.0.0.1:0\"\n{extra}\n{}",
        target_section(),
        file_volume("vol0", img, size, false)
    );
    let target = TargetProcess::start(&config);
    let metrics = target.metrics_addr();
    (target, metrics)
}

/// Block `b` at write version `v`: every 8 bytes are `b + 1` and `v` (LE
/// u32s, never all zero), so a mismatch names the block and the version
/// that was returned.
fn block_bytes(b: u64, v: u32, out: &mut [u8]) {
    for w in out.chunks_exact_mut(8) {
        w[..4].copy_from_slice(&(b as u32 + 1).to_le_bytes());
        w[4..].copy_from_slice(&v.to_le_bytes());
    }
}

fn pattern(offset: u64, len: u64, v: u32) -> Vec<u8> {
    let mut data = vec![0u8; len as usize];
    for (i, blk) in data.chunks_exact_mut(BLOCK as usize).enumerate() {
        block_bytes(offset / BLOCK + i as u64, v, blk);
    }
    data
}

/// What a block of a read holds: (block, version), or `None` for zeroes.
fn decode(blk: &[u8]) -> Option<(u32, u32)> {
    if blk.iter().all(|&b| b == 0) {
        return None;
    }
    Some((u32::from_le_bytes(blk[..4].try_into().unwrap()) - 1, u32::from_le_bytes(blk[4..8].try_into().unwrap())))
}

/// Fills the backing file with version 0 of every block before the target opens it.
fn fill_file(img: &std::path::Path, size: u64) {
    std::fs::write(img, pattern(0, size, 0)).unwrap();
}

fn readahead_metric(metrics: &str, name: &str) -> f64 {
    sample_sum(&scrape(metrics), name)
}

#[derive(Clone, Copy, Debug)]
enum Change {
    /// Through the RDMA data path (larger than the inline limit).
    Write,
    /// Small enough to travel inside the command capsule.
    InlineWrite,
    WriteZeroes,
    Discard,
}

fn apply(vol: &Volume, change: Change, offset: u64, len: u64, v: u32) {
    match change {
        Change::Write | Change::InlineWrite => vol.write_at(&pattern(offset, len, v), offset).expect("write"),
        Change::WriteZeroes => vol.write_zeroes(offset, len).expect("write_zeroes"),
        Change::Discard => vol.discard(offset, len).expect("discard"),
    }
}

/// A reader streams through the volume in 128 KiB READs (so readahead is
/// active); between two of its reads a writer changes a range a little
/// ahead of it (inside the readahead window: cached or still being read):
/// the reader's own queue pair, another queue pair of its session, or
/// another session, with every kind of write. Each read must return
/// exactly what the model says (the writes are completed before it is
/// issued). Without the invalidation this fails at the first write into
/// a cached chunk.
#[test]
fn readahead_never_returns_data_older_than_the_last_completed_write() {
    const SIZE: u64 = 32 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol0.img", SIZE);
    fill_file(&img, SIZE);
    let (target, metrics) = start(&img, SIZE, 2, "");
    let seed = seed();
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let reader = Session::connect(&target.url, options("ra-reader", 2)).expect("connect reader");
    let rvol = reader.open("vol0").expect("open");
    let writer = Session::connect(&target.url, options("ra-writer", 1)).expect("connect writer");
    let wvol = writer.open("vol0").expect("open");
    let zero_ok = rvol.supports_write_zeroes();
    let discard_ok = rvol.supports_discard();

    // The reader session's second queue pair: used from a thread of its own.
    let (to_peer, peer_rx) = mpsc::channel::<(Change, u64, u64, u32)>();
    let (peer_done, done_rx) = mpsc::channel::<()>();
    let peer_vol = reader.open("vol0").expect("open again");
    let peer = std::thread::spawn(move || {
        for (change, offset, len, v) in peer_rx {
            apply(&peer_vol, change, offset, len, v);
            peer_done.send(()).unwrap();
        }
    });

    let mut model = pattern(0, SIZE, 0);
    let mut version = 0u32;
    let mut buf = vec![0u8; CHUNK as usize];
    let mut changes = 0;
    for pass in 0..2 {
        let mut pos = 0;
        while pos < SIZE {
            rvol.read_at(&mut buf, pos).expect("read");
            let want = &model[pos as usize..(pos + CHUNK) as usize];
            if buf[..] != want[..] {
                let bad = (0..CHUNK / BLOCK).find(|&k| buf[(k * BLOCK) as usize..][..BLOCK as usize] != want[(k * BLOCK) as usize..][..BLOCK as usize]).unwrap();
                let at = (pos + bad * BLOCK) as usize;
                panic!(
                    "pass {pass}: READ at {pos} returned stale data at {at}: got {:?}, the last completed write left {:?} ({changes} writes so far)",
                    decode(&buf[(bad * BLOCK) as usize..][..BLOCK as usize]),
                    decode(&model[at..at + BLOCK as usize])
                );
            }
            pos += CHUNK;
            if pos >= SIZE || !rng.gen_bool(0.25) {
                continue;
            }
            // A range within the next 2 MiB (readahead's window is 1 to 4 MiB).
            let change = match rng.gen_range(0..4) {
                0 => Change::Write,
                1 => Change::InlineWrite,
                2 if zero_ok => Change::WriteZeroes,
                3 if discard_ok => Change::Discard,
                _ => Change::Write,
            };
            let len = match change {
                Change::InlineWrite => BLOCK,
                _ => rng.gen_range(2..=64) * BLOCK,
            };
            let offset = (pos + rng.gen_range(0..2 * MIB / BLOCK) * BLOCK).min(SIZE - len);
            version += 1;
            match rng.gen_range(0..3) {
                0 => apply(&rvol, change, offset, len, version),
                1 => {
                    to_peer.send((change, offset, len, version)).unwrap();
                    done_rx.recv().unwrap();
                }
                _ => apply(&wvol, change, offset, len, version),
            }
            let range = offset as usize..(offset + len) as usize;
            match change {
                Change::Write | Change::InlineWrite => model[range].copy_from_slice(&pattern(offset, len, version)),
                Change::WriteZeroes | Change::Discard => model[range].fill(0),
            }
            changes += 1;
        }
    }
    drop(to_peer);
    peer.join().unwrap();
    let hits = readahead_metric(&metrics, "rdmablk_readahead_hits_total");
    let invalidated = readahead_metric(&metrics, "rdmablk_readahead_chunks_invalidated_total");
    let issued = readahead_metric(&metrics, "rdmablk_readahead_chunks_issued_total");
    let unused = readahead_metric(&metrics, "rdmablk_readahead_chunks_unused_total");
    eprintln!("{changes} writes; readahead: {issued} chunks read ahead, {hits} hits, {invalidated} invalidated, {unused} unused");
    assert!(hits > 100.0, "readahead served only {hits} reads: not active");
    assert!(invalidated > 0.0, "no write ever met a chunk read ahead: the test proves nothing");
    target.assert_no_panic();
}

/// The same under concurrency: a writer thread (another session) keeps
/// rewriting blocks ahead of a reader streaming at depth (two threads, so
/// two queue pairs). A read may race a write, but a block must never come
/// back older than the version whose write had completed before the read
/// was issued.
#[test]
fn readahead_under_concurrent_writes_never_goes_back_in_time() {
    const SIZE: u64 = 32 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol0.img", SIZE);
    fill_file(&img, SIZE);
    let (target, metrics) = start(&img, SIZE, 2, "");
    let seed = seed();
    eprintln!("seed {seed} (set RDMABLK_TEST_SEED to replay)");

    let blocks = (SIZE / BLOCK) as usize;
    // The version of each block whose write has completed.
    let completed: Arc<Vec<AtomicU32>> = Arc::new((0..blocks).map(|_| AtomicU32::new(0)).collect());
    // Where the readers are (the writer aims a little ahead).
    let front = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writes = Arc::new(std::sync::atomic::AtomicU64::new(0));

    let writer = {
        let (completed, front, stop, writes, url) =
            (completed.clone(), front.clone(), stop.clone(), writes.clone(), target.url.clone());
        std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let session = Session::connect(&url, options("ra-writer", 1)).expect("connect writer");
            let vol = session.open("vol0").unwrap();
            let mut v = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let len = rng.gen_range(1..=32) * BLOCK;
                let ahead = front.load(Ordering::Relaxed) + rng.gen_range(0..2 * MIB / BLOCK) * BLOCK;
                let offset = (ahead % SIZE).min(SIZE - len);
                v += 1;
                vol.write_at(&pattern(offset, len, v), offset).expect("write");
                for b in offset / BLOCK..(offset + len) / BLOCK {
                    completed[b as usize].fetch_max(v, Ordering::SeqCst);
                }
                writes.fetch_add(1, Ordering::SeqCst);
            }
        })
    };

    let reader = Session::connect(&target.url, options("ra-reader", 2)).expect("connect reader");
    let rvol = Arc::new(reader.open("vol0").unwrap());
    // Two threads read alternate 128 KiB pieces of one sequential stream,
    // two passes at least, until the writer has written a while (it may
    // start late on a loaded machine).
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (rvol, next, completed, front, writes) =
                (rvol.clone(), next.clone(), completed.clone(), front.clone(), writes.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; CHUNK as usize];
                loop {
                    let n = next.fetch_add(CHUNK, Ordering::SeqCst);
                    if n >= 20 * SIZE || (n >= 2 * SIZE && writes.load(Ordering::SeqCst) >= 100) {
                        return;
                    }
                    let pos = n % SIZE;
                    front.store(pos, Ordering::Relaxed);
                    let floor: Vec<u32> =
                        (pos / BLOCK..(pos + CHUNK) / BLOCK).map(|b| completed[b as usize].load(Ordering::SeqCst)).collect();
                    rvol.read_at(&mut buf, pos).expect("read");
                    for (k, blk) in buf.chunks_exact(BLOCK as usize).enumerate() {
                        let b = pos / BLOCK + k as u64;
                        let (got_b, got_v) = decode(blk).expect("no zeroes are written");
                        assert_eq!(got_b as u64, b, "block {b} holds another block's data");
                        assert!(
                            got_v >= floor[k],
                            "block {b} read at version {got_v}, older than version {} completed before the READ was issued",
                            floor[k]
                        );
                    }
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let writes = writes.load(Ordering::SeqCst);
    let hits = readahead_metric(&metrics, "rdmablk_readahead_hits_total");
    eprintln!("{writes} concurrent writes; readahead: {hits} hits");
    assert!(writes >= 100, "the writer hardly ran ({writes} writes)");
    assert!(hits > 50.0, "readahead served only {hits} reads: not active");
    target.assert_no_panic();
}

/// A volume whose size is not a multiple of the chunk size: readahead's
/// last chunk is short and never reads past the end; whole-chunk pieces
/// (handed over) and small pieces (copied, some across two chunks) read
/// the right bytes up to the last block.
#[test]
fn readahead_reads_the_short_last_chunk_of_a_volume_right() {
    const SIZE: u64 = 5 * MIB + 36 * KIB;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "end.img", SIZE);
    fill_file(&img, SIZE);
    let (target, metrics) = start(&img, SIZE, 1, "");
    let session = Session::connect(&target.url, options("ra-end", 1)).expect("connect");
    let vol = session.open("vol0").unwrap();
    assert_eq!(vol.size(), SIZE);
    let model = pattern(0, SIZE, 0);

    // Whole chunks: the last READ is the 36 KiB tail.
    let mut pos = 0;
    while pos < SIZE {
        let len = CHUNK.min(SIZE - pos);
        let mut buf = vec![0u8; len as usize];
        vol.read_at(&mut buf, pos).unwrap();
        assert!(buf[..] == model[pos as usize..(pos + len) as usize], "READ of {len} at {pos}");
        pos += len;
    }
    let issued = readahead_metric(&metrics, "rdmablk_readahead_chunks_issued_total");
    let hits = readahead_metric(&metrics, "rdmablk_readahead_hits_total");
    // Reads 4.. of 42 were all read ahead (the stream is sequential after 3).
    assert!(hits >= 30.0, "only {hits} reads served from readahead");
    assert_eq!(hits, issued, "every chunk read ahead served exactly one READ");

    // 12 KiB READs: copied out of cached chunks, some across two chunks.
    let mut pos = 0;
    while pos < SIZE {
        let len = (12 * KIB).min(SIZE - pos);
        let mut buf = vec![0u8; len as usize];
        vol.read_at(&mut buf, pos).unwrap();
        assert!(buf[..] == model[pos as usize..(pos + len) as usize], "READ of {len} at {pos}");
        pos += len;
    }
    let hits2 = readahead_metric(&metrics, "rdmablk_readahead_hits_total");
    assert!(hits2 - hits > 300.0, "only {} small reads served from readahead", hits2 - hits);
    // Nothing read past the end (that read would fail and count as unused),
    // and an idle target gives its readahead chunks back within a second.
    wait_until("readahead chunks released", Duration::from_secs(5), || {
        readahead_metric(&metrics, "rdmablk_readahead_chunks") == 0.0
    });
    let log = target.log().join("\n");
    assert!(!log.contains("read ahead failed"), "{log}");
    target.assert_no_panic();
}

/// `readahead = "0"` turns it off; random READs never start it.
#[test]
fn readahead_off_and_random_reads_read_nothing_ahead() {
    // Sparse: reading it costs nothing, and random READs spread thin.
    const SIZE: u64 = 1024 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_file(dir.path(), "vol0.img", SIZE);
    let (off, metrics) = start(&img, SIZE, 1, "readahead = \"0\"");
    let session = Session::connect(&off.url, options("ra-off", 1)).unwrap();
    let vol = session.open("vol0").unwrap();
    let mut buf = vec![0u8; CHUNK as usize];
    for k in 0..64 {
        vol.read_at(&mut buf, k * CHUNK).unwrap();
    }
    assert_eq!(readahead_metric(&metrics, "rdmablk_readahead_chunks_issued_total"), 0.0);
    drop(vol);
    drop(session);
    drop(off);

    let (on, metrics) = start(&img, SIZE, 1, "");
    let session = Session::connect(&on.url, options("ra-random", 1)).unwrap();
    let vol = session.open("vol0").unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let mut buf = vec![0u8; BLOCK as usize];
    for _ in 0..3000 {
        vol.read_at(&mut buf, rng.gen_range(0..SIZE / BLOCK) * BLOCK).unwrap();
    }
    assert_eq!(readahead_metric(&metrics, "rdmablk_readahead_chunks_issued_total"), 0.0);
    // The same target reads ahead of a sequential stream.
    let mut buf = vec![0u8; CHUNK as usize];
    for k in 0..16 {
        vol.read_at(&mut buf, k * CHUNK).unwrap();
    }
    assert!(readahead_metric(&metrics, "rdmablk_readahead_hits_total") > 0.0);
}
