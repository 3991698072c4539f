//! Sequential readahead into a reactor's buffer pool: which READs form
//! sequential streams, which chunks to read ahead of them, and which chunks
//! read ahead serve a READ's piece. Pure bookkeeping, no I/O: the reactor
//! allocates the chunks, reads them (O_DIRECT, like every read) and copies
//! or hands them over (`Reactor::read_ahead`, `Reactor::read_piece`).
//!
//! Per volume slot, a small table of recent streams: a READ starting near
//! where one ended (`reorder_slack` either side, for reads that overtake
//! each other at depth) extends it, any other READ starts a new one in the
//! place of the least recently used. A stream of [`SEQUENTIAL_READS`] reads
//! is sequential: chunk-aligned, chunk-sized reads are kept in flight ahead
//! of it up to its window, which starts at [`INITIAL_WINDOW`] and grows
//! with every byte the stream reads, up to `Settings::max_window`.
//!
//! A chunk read ahead remembers the volume's write epoch of its range
//! (`backend::WriteEpochs`) from before its read was submitted, and serves
//! a piece only while that epoch is unchanged: a write that started or
//! finished since, on any reactor, makes it unusable. Unconsumed chunks are
//! dropped after `Settings::ttl`, or earlier when the pool runs short.

use std::time::{Duration, Instant};

use crate::engine::pool::ChunkId;

/// Streams tracked per volume slot.
const STREAMS: usize = 8;
/// Reads in a row that make a stream sequential.
pub const SEQUENTIAL_READS: u32 = 3;
/// Bytes ahead of a stream when it becomes sequential (at most `max_window`).
pub const INITIAL_WINDOW: u64 = 1 << 20;
/// How long a chunk read ahead waits for its reader before it is dropped.
pub const TTL: Duration = Duration::from_secs(1);
/// A stream's reads ahead start only once this part of its window is free,
/// and then fill it: they reach the ring in one turn, and the block layer
/// merges adjacent ones into large requests (a disk serves a few large
/// reads much faster than as many bytes in 128 KiB reads).
const BATCH_DIVISOR: u64 = 4;

/// How far a READ may start before or after where its stream ended and
/// still extend it: reads of one stream arrive a little out of order at
/// queue depth (several queue pairs, several reactors' turns), while a
/// random READ of a few KiB must almost never land near a stream.
fn reorder_slack(len: u32) -> u64 {
    (8 * len as u64).clamp(32 << 10, 2 << 20)
}

/// Limits of one reactor's readahead.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Pool chunk size: the size and alignment of every read ahead.
    pub chunk_size: u32,
    /// Most bytes read ahead of one stream (`target.readahead`); 0 turns
    /// readahead off.
    pub max_window: u64,
    /// Most chunks held by readahead on the reactor (in flight or cached).
    pub max_chunks: usize,
    /// Most chunks held by readahead for one volume slot.
    pub max_chunks_per_volume: usize,
    /// How long a cached chunk waits for its reader.
    pub ttl: Duration,
}

impl Settings {
    /// Readahead of at most `max_window` bytes per stream with a pool of
    /// `pool_chunks` chunks: a quarter of the pool at most, and two full
    /// windows per volume.
    pub fn new(chunk_size: u32, max_window: u64, pool_chunks: usize) -> Settings {
        let window_chunks = max_window.div_ceil(chunk_size as u64) as usize;
        Settings { chunk_size, max_window, max_chunks: pool_chunks / 4, max_chunks_per_volume: 2 * window_chunks, ttl: TTL }
    }
}

/// What the counters of readahead say (totals since the reactor started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Chunks read ahead.
    pub issued: u64,
    /// Pieces of READs served from chunks read ahead.
    pub hits: u64,
    /// Chunks dropped before they served anything: not read in time
    /// (`ttl`), given back to a short pool, their volume gone, or their read failed.
    pub unused: u64,
    /// Chunks dropped because a write overlapped them.
    pub invalidated: u64,
}

/// A stream's state apart from where it ends and when it was last read,
/// which its volume keeps in two short arrays ([`VolumeReadahead`]).
#[derive(Clone, Copy, Debug, Default)]
struct Stream {
    /// Its lowest offset read.
    start: u64,
    /// Bytes it read.
    bytes: u64,
    /// Reads in a row.
    run: u32,
    /// Bytes read ahead of where the next READ is expected (0 until
    /// sequential).
    window: u64,
    /// The next chunk-aligned offset to read ahead.
    ahead: u64,
    /// Its reads ahead of this turn have started (`BATCH_DIVISOR`).
    filling: bool,
}

impl Stream {
    /// Enough reads in a row, and dense: random READs that happen to land
    /// near each other leave gaps at least as large as what they read.
    /// `next`: where the stream's next READ is expected.
    fn sequential(&self, next: u64) -> bool {
        self.run >= SEQUENTIAL_READS && 2 * self.bytes >= next - self.start
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Its read is in flight.
    Reading,
    /// Read, since then.
    Cached(Instant),
    /// Unusable (a write overlapped it, its volume went), its read still in
    /// flight: the chunk is released when the read completes.
    Dropped,
}

#[derive(Debug)]
struct Entry {
    /// Chunk-aligned volume offset.
    offset: u64,
    /// `chunk_size`, less at the volume's end.
    len: u32,
    chunk: ChunkId,
    /// The write epoch of its range when its read was submitted.
    epoch: u64,
    state: State,
    /// Bytes copied out of it so far.
    served: u32,
}

impl Entry {
    fn usable(&self) -> bool {
        self.state != State::Dropped
    }
}

#[derive(Debug, Default)]
struct VolumeReadahead {
    /// Where each stream's next READ is expected. Every READ compares its
    /// offset with all of them (a random one matches none), so they sit
    /// apart from the streams: two cache lines with `last_read` rather
    /// than the whole table, which a reactor back from a disk wait finds
    /// cold (docs/perf-log/issue-20-looks.md, "Issue 20, fifteenth look").
    expected: [u64; STREAMS],
    /// The volume's READ count at each stream's last READ (0: unused):
    /// the least recent stream gives way to a new one.
    last_read: [u64; STREAMS],
    reads: u64,
    streams: [Stream; STREAMS],
    /// The stream of the last READ.
    active: usize,
    entries: Vec<Entry>,
}

/// One part of a piece copied from a cached chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    pub chunk: ChunkId,
    /// Offset in the cached chunk.
    pub from: u32,
    /// Offset in the piece.
    pub to: u32,
    pub len: u32,
}

/// How a READ's piece is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serve {
    /// Not read ahead (or no longer usable): read it from the disk.
    Miss,
    /// Being read ahead: the piece's chunk was attached as a waiter and
    /// comes back from [`Readahead::completed`].
    Wait,
    /// The piece is exactly this cached chunk, which is the piece's now
    /// (no longer readahead's).
    Take(ChunkId),
    /// Copy these parts (the second only when the piece spans two chunks).
    Copy([Option<Part>; 2]),
}

/// One reactor's readahead state, per volume slot.
#[derive(Debug)]
pub struct Readahead {
    settings: Settings,
    vols: Vec<VolumeReadahead>,
    /// Chunks held by all entries (in flight, cached or dropped).
    held: usize,
    /// Chunks readahead no longer holds, to be released to the pool by the
    /// reactor ([`Readahead::take_released`]) after any copy out of them.
    released: Vec<ChunkId>,
    /// READ pieces waiting for a read ahead: (chunk being read, the
    /// piece's chunk). One list for all (its capacity is reused: no
    /// allocation per I/O).
    waiters: Vec<(ChunkId, ChunkId)>,
    /// No cached chunk expires before this (exact after each `expire`):
    /// the reactor asks every turn, so it is not recomputed then.
    expiry: Option<Instant>,
    pub counters: Counters,
}

impl Readahead {
    /// Readahead for volume slots `0..slots`.
    pub fn new(settings: Settings, slots: usize) -> Readahead {
        Readahead {
            settings,
            vols: (0..slots).map(|_| VolumeReadahead::default()).collect(),
            held: 0,
            released: Vec::new(),
            waiters: Vec::new(),
            expiry: None,
            counters: Counters::default(),
        }
    }

    /// Whether readahead is on at all.
    pub fn enabled(&self) -> bool {
        self.settings.max_window > 0 && self.settings.max_chunks > 0
    }

    /// Chunks held now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// A chunk readahead let go of, to give back to the pool; `None` when
    /// there are no more.
    pub fn take_released(&mut self) -> Option<ChunkId> {
        self.released.pop()
    }

    /// Records a READ of `len` bytes at `offset` on volume slot `vslot`;
    /// returns whether its stream is sequential.
    pub fn on_read(&mut self, vslot: u16, offset: u64, len: u32) -> bool {
        if !self.enabled() {
            return false;
        }
        let (initial, max_window) = (INITIAL_WINDOW.min(self.settings.max_window), self.settings.max_window);
        let v = &mut self.vols[vslot as usize];
        let slack = reorder_slack(len);
        let near = |i: usize| v.last_read[i] != 0 && offset + slack >= v.expected[i] && offset <= v.expected[i] + slack;
        let i = match (0..STREAMS).find(|&i| near(i)) {
            Some(i) => {
                let next = v.expected[i].max(offset + len as u64);
                v.expected[i] = next;
                let s = &mut v.streams[i];
                s.run = s.run.saturating_add(1);
                s.bytes += len as u64;
                s.start = s.start.min(offset);
                s.filling = false;
                if s.sequential(next) {
                    s.window = if s.window == 0 { initial } else { (s.window + len as u64).min(max_window) };
                }
                i
            }
            None => {
                let i = (0..STREAMS).min_by_key(|&i| v.last_read[i]).expect("streams");
                v.expected[i] = offset + len as u64;
                v.streams[i] = Stream { start: offset, bytes: len as u64, run: 1, window: 0, ahead: 0, filling: false };
                i
            }
        };
        v.reads += 1;
        v.last_read[i] = v.reads;
        v.active = i;
        v.streams[i].sequential(v.expected[i])
    }

    /// The next range to read ahead of the stream of the last READ on
    /// `vslot`, of a volume of `size` bytes, if it wants one and the limits
    /// allow it: chunk-aligned, a chunk long (less at the volume's end).
    /// Submit it and record it with [`Readahead::issued`] before asking
    /// again. After a READ, a stream wants nothing until a quarter of its
    /// window (or the rest up to the volume's end) is free, then all of it.
    pub fn want(&mut self, vslot: u16, size: u64) -> Option<(u64, u32)> {
        if !self.enabled() || self.held >= self.settings.max_chunks {
            return None;
        }
        let cs = self.settings.chunk_size as u64;
        let v = &mut self.vols[vslot as usize];
        if v.entries.len() >= self.settings.max_chunks_per_volume {
            return None;
        }
        let next = v.expected[v.active];
        let s = &mut v.streams[v.active];
        if !s.sequential(next) {
            return None;
        }
        // From the chunk holding the next expected byte: the stream's own
        // READs cover what lies before it.
        s.ahead = s.ahead.max(next / cs * cs);
        let end = (next + s.window).min(size);
        if !s.filling && s.ahead + (s.window / BATCH_DIVISOR).max(cs) > end && end < size {
            return None;
        }
        s.filling = true;
        while s.ahead < end {
            let at = s.ahead;
            if v.entries.iter().any(|e| e.offset == at && e.usable()) {
                s.ahead += cs;
                continue;
            }
            return Some((at, cs.min(size - at) as u32));
        }
        s.filling = false;
        None
    }

    /// Records that `len` bytes at `offset` of `vslot` (from [`Readahead::want`])
    /// are being read into `chunk`, with the range's write epoch `epoch`
    /// taken before the read was submitted.
    pub fn issued(&mut self, vslot: u16, offset: u64, len: u32, chunk: ChunkId, epoch: u64) {
        let cs = self.settings.chunk_size as u64;
        let v = &mut self.vols[vslot as usize];
        let s = &mut v.streams[v.active];
        s.ahead = s.ahead.max(offset + cs);
        v.entries.push(Entry { offset, len, chunk, epoch, state: State::Reading, served: 0 });
        self.held += 1;
        self.counters.issued += 1;
    }

    /// How to serve the piece of `len` bytes (at most a chunk) at `offset`
    /// of `vslot`, to be read into chunk `piece`. `epoch_of(offset, len)`
    /// is the volume's write epoch of a range now: a chunk whose epoch
    /// moved is dropped, not served.
    pub fn lookup(&mut self, vslot: u16, offset: u64, len: u32, piece: ChunkId, epoch_of: impl Fn(u64, u32) -> u64) -> Serve {
        let v = &mut self.vols[vslot as usize];
        if v.entries.is_empty() || len == 0 {
            return Serve::Miss;
        }
        let cs = self.settings.chunk_size as u64;
        let end = offset + len as u64;
        let first = offset / cs * cs;
        if end > first + 2 * cs {
            return Serve::Miss;
        }
        let mut parts = [None; 2];
        let mut wait_on = None;
        let mut stale = None;
        for (k, at) in [first, first + cs].into_iter().filter(|&at| at < end).enumerate() {
            let Some(i) = v.entries.iter().position(|e| e.offset == at && e.usable()) else { return Serve::Miss };
            let e = &v.entries[i];
            if epoch_of(e.offset, e.len) != e.epoch {
                stale = Some(i);
                break;
            }
            let (from, to) = (offset.max(at), end.min(at + cs));
            if to > at + e.len as u64 {
                return Serve::Miss;
            }
            match e.state {
                State::Reading => {
                    wait_on.get_or_insert(i);
                }
                _ => {
                    parts[k] = Some(Part { chunk: e.chunk, from: (from - at) as u32, to: (from - offset) as u32, len: (to - from) as u32 })
                }
            }
        }
        if let Some(i) = stale {
            self.counters.invalidated += 1;
            self.drop_entry(vslot, i);
            return Serve::Miss;
        }
        if let Some(i) = wait_on {
            self.waiters.push((v.entries[i].chunk, piece));
            return Serve::Wait;
        }
        self.counters.hits += 1;
        if let [Some(p), None] = parts {
            let i = v.entries.iter().position(|e| e.chunk == p.chunk).expect("entry of a part");
            if p.from == 0 && p.len == v.entries[i].len {
                let e = v.entries.swap_remove(i);
                self.held -= 1;
                return Serve::Take(e.chunk);
            }
        }
        for p in parts.iter().flatten() {
            let i = v.entries.iter().position(|e| e.chunk == p.chunk).expect("entry of a part");
            let e = &mut v.entries[i];
            e.served += p.len;
            if e.served >= e.len {
                // Read through: released after the caller's copy.
                let e = v.entries.swap_remove(i);
                self.held -= 1;
                self.released.push(e.chunk);
            }
        }
        Serve::Copy(parts)
    }

    /// The read of `chunk` for `vslot` completed with `res` (bytes read,
    /// or a negative errno). Appends to `waiters` the chunks of the pieces
    /// that waited for it: each is to be served again
    /// ([`Readahead::lookup`]), which now copies from it, or reads from the
    /// disk if it failed or was dropped.
    pub fn completed(&mut self, vslot: u16, chunk: ChunkId, res: i32, now: Instant, waiters: &mut Vec<ChunkId>) {
        if !self.waiters.is_empty() {
            self.waiters.retain(|&(ahead, piece)| {
                if ahead == chunk {
                    waiters.push(piece);
                }
                ahead != chunk
            });
        }
        let v = &mut self.vols[vslot as usize];
        let Some(i) = v.entries.iter().position(|e| e.chunk == chunk) else {
            debug_assert!(false, "a read ahead completed for a chunk readahead does not hold");
            return;
        };
        let e = &mut v.entries[i];
        if e.state == State::Reading && res >= 0 && res as u32 == e.len {
            e.state = State::Cached(now);
            let due = now + self.settings.ttl;
            self.expiry = Some(self.expiry.map_or(due, |d| d.min(due)));
            return;
        }
        if e.state == State::Reading {
            self.counters.unused += 1;
        }
        let e = v.entries.swap_remove(i);
        self.held -= 1;
        self.released.push(e.chunk);
    }

    /// Drops what overlaps `len` bytes at `offset` of `vslot`, which a
    /// write on this reactor is about to change. (Other reactors find their
    /// chunks stale by the write epoch.)
    pub fn invalidate(&mut self, vslot: u16, offset: u64, len: u64) {
        let v = &self.vols[vslot as usize];
        if v.entries.is_empty() {
            return;
        }
        let end = offset.saturating_add(len.max(1));
        let mut i = 0;
        while i < self.vols[vslot as usize].entries.len() {
            let e = &self.vols[vslot as usize].entries[i];
            if e.usable() && e.offset < end && offset < e.offset + e.len as u64 {
                self.counters.invalidated += 1;
                if self.drop_entry(vslot, i) {
                    continue;
                }
            }
            i += 1;
        }
    }

    /// Drops everything of `vslot` (its volume was removed or reloaded) and
    /// forgets its streams.
    pub fn drop_volume(&mut self, vslot: u16) {
        let mut i = 0;
        while i < self.vols[vslot as usize].entries.len() {
            let e = &self.vols[vslot as usize].entries[i];
            if e.usable() {
                if e.served == 0 {
                    self.counters.unused += 1;
                }
                if self.drop_entry(vslot, i) {
                    continue;
                }
            }
            i += 1;
        }
        // Everything but the entries whose reads are still in flight.
        let v = &mut self.vols[vslot as usize];
        *v = VolumeReadahead { entries: std::mem::take(&mut v.entries), ..VolumeReadahead::default() };
    }

    /// Drops cached chunks nobody read within `ttl`.
    pub fn expire(&mut self, now: Instant) {
        if self.expiry.is_none_or(|due| now < due) {
            return;
        }
        let ttl = self.settings.ttl;
        let mut expiry: Option<Instant> = None;
        for vslot in 0..self.vols.len() {
            let mut i = 0;
            while i < self.vols[vslot].entries.len() {
                let e = &self.vols[vslot].entries[i];
                if matches!(e.state, State::Cached(since) if now.saturating_duration_since(since) >= ttl) {
                    if e.served == 0 {
                        self.counters.unused += 1;
                    }
                    self.drop_entry(vslot as u16, i);
                    continue;
                }
                if let State::Cached(since) = e.state {
                    expiry = Some(expiry.map_or(since + ttl, |d| d.min(since + ttl)));
                }
                i += 1;
            }
        }
        self.expiry = expiry;
    }

    /// When [`Readahead::expire`] has something to do next, if a chunk is
    /// cached (possibly earlier: a chunk read or dropped since is not
    /// accounted for until then). O(1): the reactor asks every turn.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.expiry
    }

    /// Gives up the cached chunk cached longest (for a command that found
    /// the pool empty). Returns whether there was one.
    pub fn evict(&mut self) -> bool {
        let oldest = self
            .vols
            .iter()
            .enumerate()
            .flat_map(|(vslot, v)| v.entries.iter().enumerate().map(move |(i, e)| (vslot, i, e)))
            .filter_map(|(vslot, i, e)| match e.state {
                State::Cached(since) => Some((since, vslot, i)),
                _ => None,
            })
            .min();
        let Some((_, vslot, i)) = oldest else { return false };
        if self.vols[vslot].entries[i].served == 0 {
            self.counters.unused += 1;
        }
        self.drop_entry(vslot as u16, i)
    }

    /// Drops entry `i` of `vslot`: a cached one is removed and its chunk
    /// released (returns true: the entry at `i` is another one now); one
    /// still being read is marked dropped and goes when its read completes.
    fn drop_entry(&mut self, vslot: u16, i: usize) -> bool {
        let v = &mut self.vols[vslot as usize];
        match v.entries[i].state {
            State::Cached(_) => {
                let e = v.entries.swap_remove(i);
                self.held -= 1;
                self.released.push(e.chunk);
                true
            }
            State::Reading | State::Dropped => {
                v.entries[i].state = State::Dropped;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CS: u32 = 128 << 10;
    const SIZE: u64 = 1 << 30;

    fn settings() -> Settings {
        Settings::new(CS, 4 << 20, 512)
    }

    /// Issues everything `want` asks for, as the reactor does with a
    /// plentiful pool; returns the ranges and gives chunks 100, 101, ...
    fn issue_all(ra: &mut Readahead, vslot: u16, size: u64, next_chunk: &mut u16, epoch: u64) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        while let Some((off, len)) = ra.want(vslot, size) {
            ra.issued(vslot, off, len, ChunkId(*next_chunk), epoch);
            *next_chunk += 1;
            out.push((off, len));
        }
        out
    }

    /// Three chunk-sized READs from offset 0 of `vslot`: its stream is
    /// sequential after them.
    fn start_stream(ra: &mut Readahead, vslot: u16) {
        for k in 0..3u64 {
            assert_eq!(ra.on_read(vslot, k * CS as u64, CS), k == 2);
        }
    }

    /// `completed`, returning the waiters.
    fn done(ra: &mut Readahead, vslot: u16, chunk: ChunkId, res: i32, now: Instant) -> Vec<ChunkId> {
        let mut w = Vec::new();
        ra.completed(vslot, chunk, res, now, &mut w);
        w
    }

    fn drain(ra: &mut Readahead) -> Vec<ChunkId> {
        let mut v = Vec::new();
        while let Some(c) = ra.take_released() {
            v.push(c);
        }
        v.sort();
        v
    }

    #[test]
    fn three_reads_in_a_row_make_a_stream_sequential_and_read_ahead_one_mib() {
        let mut ra = Readahead::new(settings(), 4);
        assert!(!ra.on_read(0, 0, CS));
        assert_eq!(ra.want(0, SIZE), None);
        assert!(!ra.on_read(0, CS as u64, CS));
        assert!(ra.on_read(0, 2 * CS as u64, CS));
        let mut c = 100;
        let issued = issue_all(&mut ra, 0, SIZE, &mut c, 0);
        // The window starts at 1 MiB beyond the next expected read, chunk-aligned.
        let want: Vec<(u64, u32)> = (3..3 + 8).map(|k| (k * CS as u64, CS)).collect();
        assert_eq!(issued, want);
        assert_eq!(ra.held(), 8);
        assert_eq!(ra.counters.issued, 8);
    }

    #[test]
    fn the_window_grows_with_the_stream_up_to_the_maximum() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        let cs = CS as u64;
        let mut c = 0;
        let mut ahead_of_stream = Vec::new();
        for k in 0..100u64 {
            ra.on_read(0, k * cs, CS);
            for (off, _) in issue_all(&mut ra, 0, SIZE, &mut c, 0) {
                let chunk = ra.vols[0].entries.iter().find(|e| e.offset == off).unwrap().chunk;
                done(&mut ra, 0, chunk, CS as i32, now);
            }
            // The reader's next piece takes its chunk.
            if k >= 2 {
                assert!(matches!(ra.lookup(0, (k + 1) * cs, CS, ChunkId(60000), |_, _| 0), Serve::Take(_)), "read {k}");
            }
            let end = ra.vols[0].entries.iter().map(|e| e.offset + e.len as u64).max().unwrap_or(0);
            ahead_of_stream.push(end.saturating_sub((k + 1) * cs));
        }
        assert_eq!(ahead_of_stream[2], 1 << 20, "starts at 1 MiB");
        assert!(ahead_of_stream.iter().all(|&a| a <= 4 << 20), "never beyond the maximum window");
        // Refilled in batches of a quarter window: between 3 and 4 MiB ahead once grown.
        let last = &ahead_of_stream[80..];
        assert!(last.iter().all(|&a| a >= 3 << 20), "grown to the maximum: {last:?}");
        assert!(last.contains(&(4 << 20)), "{last:?}");
        // Each refill is a batch of at least a quarter window (8 chunks of 128 KiB at 4 MiB).
        let refills: Vec<u64> = ahead_of_stream.windows(2).filter(|w| w[1] > w[0]).map(|w| w[1] + cs - w[0]).collect();
        assert!(refills[refills.len() - 3..].iter().all(|&r| r >= 1 << 20), "{refills:?}");
    }

    #[test]
    fn random_reads_never_read_ahead() {
        let mut ra = Readahead::new(settings(), 1);
        // A fixed pseudo-random sequence of 4 KiB reads over 1 GiB.
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..100_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % (SIZE / 4096)) * 4096;
            assert!(!ra.on_read(0, off, 4096), "a random read at {off} looked sequential");
            assert_eq!(ra.want(0, SIZE), None);
        }
        assert_eq!(ra.counters.issued, 0);
    }

    #[test]
    fn a_new_stream_replaces_the_least_recently_read_one() {
        let mut ra = Readahead::new(settings(), 1);
        let base = |k: u64| k << 28;
        // Eight streams, one READ each, then a second READ of stream 0.
        for k in 0..STREAMS as u64 {
            assert!(!ra.on_read(0, base(k), CS));
        }
        assert!(!ra.on_read(0, base(0) + CS as u64, CS));
        // A ninth stream takes the place of stream 1, the least recent.
        assert!(!ra.on_read(0, base(STREAMS as u64), CS));
        assert!(ra.on_read(0, base(0) + 2 * CS as u64, CS), "stream 0 was read last and kept its run");
        assert!(!ra.on_read(0, base(1) + CS as u64, CS), "stream 1 was replaced: a new stream");
        assert!(!ra.on_read(0, base(1) + 2 * CS as u64, CS));
        assert!(ra.on_read(0, base(1) + 3 * CS as u64, CS));
    }

    #[test]
    fn interleaved_streams_are_each_detected() {
        let mut ra = Readahead::new(settings(), 1);
        let (a, b) = (0u64, 512 << 20);
        for k in 0..3u64 {
            ra.on_read(0, a + k * CS as u64, CS);
            assert_eq!(ra.on_read(0, b + k * CS as u64, CS), k == 2);
        }
        // Reads that overtake each other a little stay in their stream.
        assert!(ra.on_read(0, a + 4 * CS as u64, CS));
        assert!(ra.on_read(0, a + 3 * CS as u64, CS));
    }

    #[test]
    fn never_reads_past_the_volume_end() {
        let mut ra = Readahead::new(settings(), 1);
        // A volume of 5.5 chunks (a whole number of 4 KiB blocks).
        let size = 5 * CS as u64 + (CS as u64) / 2;
        start_stream(&mut ra, 0);
        let mut c = 0;
        let issued = issue_all(&mut ra, 0, size, &mut c, 0);
        assert_eq!(issued, vec![(3 * CS as u64, CS), (4 * CS as u64, CS), (5 * CS as u64, CS / 2)]);
        for (off, len) in issued {
            assert!(off + len as u64 <= size);
        }
    }

    #[test]
    fn a_whole_chunk_is_handed_over_and_a_part_is_copied() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        start_stream(&mut ra, 0);
        let mut c = 100;
        issue_all(&mut ra, 0, SIZE, &mut c, 7);
        let cs = CS as u64;
        // In flight: the piece waits, no second read.
        assert_eq!(ra.lookup(0, 3 * cs, CS, ChunkId(1), |_, _| 7), Serve::Wait);
        assert_eq!(done(&mut ra, 0, ChunkId(100), CS as i32, now), vec![ChunkId(1)]);
        assert_eq!(ra.lookup(0, 3 * cs, CS, ChunkId(1), |_, _| 7), Serve::Take(ChunkId(100)));
        assert_eq!(ra.held(), 7);
        assert_eq!(ra.lookup(0, 3 * cs, CS, ChunkId(1), |_, _| 7), Serve::Miss, "handed over: gone from the cache");
        // A 4 KiB piece inside a cached chunk is copied; the chunk stays
        // until read through.
        done(&mut ra, 0, ChunkId(101), CS as i32, now);
        let p = Serve::Copy([Some(Part { chunk: ChunkId(101), from: 8192, to: 0, len: 4096 }), None]);
        assert_eq!(ra.lookup(0, 4 * cs + 8192, 4096, ChunkId(2), |_, _| 7), p);
        assert!(drain(&mut ra).is_empty());
        assert_eq!(ra.counters.hits, 2);
        // A piece across two chunks waits while either is being read,
        // then copies from both.
        done(&mut ra, 0, ChunkId(102), CS as i32, now);
        assert_eq!(ra.lookup(0, 5 * cs + cs / 2, CS, ChunkId(3), |_, _| 7), Serve::Wait);
        assert_eq!(done(&mut ra, 0, ChunkId(103), CS as i32, now), vec![ChunkId(3)]);
        assert_eq!(
            ra.lookup(0, 5 * cs + cs / 2, CS, ChunkId(3), |_, _| 7),
            Serve::Copy([
                Some(Part { chunk: ChunkId(102), from: CS / 2, to: 0, len: CS / 2 }),
                Some(Part { chunk: ChunkId(103), from: 0, to: CS / 2, len: CS / 2 }),
            ])
        );
    }

    #[test]
    fn a_piece_read_through_releases_its_chunk() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        for k in 0..3u64 {
            ra.on_read(0, k * 4096, 4096);
        }
        let mut c = 100;
        let issued = issue_all(&mut ra, 0, SIZE, &mut c, 0);
        assert_eq!(issued[0], (0, CS), "4 KiB reads: from the chunk holding the next byte");
        done(&mut ra, 0, ChunkId(100), CS as i32, now);
        for k in 3..(CS as u64 / 4096) {
            assert!(matches!(ra.lookup(0, k * 4096, 4096, ChunkId(1), |_, _| 0), Serve::Copy(_)));
        }
        assert!(drain(&mut ra).is_empty(), "the first three blocks were never served from it");
    }

    #[test]
    fn a_changed_epoch_makes_a_chunk_unusable_cached_or_in_flight() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        start_stream(&mut ra, 0);
        let mut c = 100;
        issue_all(&mut ra, 0, SIZE, &mut c, 5);
        let cs = CS as u64;
        done(&mut ra, 0, ChunkId(100), CS as i32, now);
        // Cached: dropped and released.
        assert_eq!(ra.lookup(0, 3 * cs, CS, ChunkId(1), |_, _| 6), Serve::Miss);
        assert_eq!(drain(&mut ra), vec![ChunkId(100)]);
        // In flight: dropped, released when its read completes, and the
        // waiter that attached before the write is served again (a miss).
        assert_eq!(ra.lookup(0, 4 * cs, CS, ChunkId(2), |_, _| 5), Serve::Wait);
        assert_eq!(ra.lookup(0, 4 * cs, CS, ChunkId(3), |_, _| 6), Serve::Miss);
        assert_eq!(done(&mut ra, 0, ChunkId(101), CS as i32, now), vec![ChunkId(2)]);
        assert_eq!(drain(&mut ra), vec![ChunkId(101)]);
        assert_eq!(ra.lookup(0, 4 * cs, CS, ChunkId(2), |_, _| 6), Serve::Miss);
        assert_eq!(ra.counters.invalidated, 2);
        // The other chunks, epoch unchanged, still serve.
        done(&mut ra, 0, ChunkId(102), CS as i32, now);
        assert_eq!(ra.lookup(0, 5 * cs, CS, ChunkId(4), |_, _| 5), Serve::Take(ChunkId(102)));
    }

    #[test]
    fn a_local_write_drops_what_it_overlaps_only() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        start_stream(&mut ra, 0);
        let mut c = 100;
        issue_all(&mut ra, 0, SIZE, &mut c, 0);
        let cs = CS as u64;
        done(&mut ra, 0, ChunkId(100), CS as i32, now);
        done(&mut ra, 0, ChunkId(101), CS as i32, now);
        // 4 KiB at the end of chunk 3 (cached).
        ra.invalidate(0, 4 * cs - 4096, 4096);
        assert_eq!(drain(&mut ra), vec![ChunkId(100)], "cached: released at once");
        assert_eq!(ra.lookup(0, 4 * cs, CS, ChunkId(1), |_, _| 0), Serve::Take(ChunkId(101)), "not overlapped");
        // Chunk 102 is in flight when a write overlaps it.
        ra.invalidate(0, 5 * cs, 4096);
        assert_eq!(ra.lookup(0, 5 * cs, CS, ChunkId(1), |_, _| 0), Serve::Miss, "dropped while its read was in flight");
        done(&mut ra, 0, ChunkId(102), CS as i32, now);
        assert_eq!(drain(&mut ra), vec![ChunkId(102)]);
        assert_eq!(ra.lookup(0, 6 * cs, CS, ChunkId(1), |_, _| 0), Serve::Wait, "untouched chunk still usable");
        assert_eq!(ra.counters.invalidated, 2);
    }

    #[test]
    fn a_failed_or_short_read_drops_the_chunk_and_its_waiters_read_the_disk() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        start_stream(&mut ra, 0);
        let mut c = 100;
        issue_all(&mut ra, 0, SIZE, &mut c, 0);
        let cs = CS as u64;
        assert_eq!(ra.lookup(0, 3 * cs, CS, ChunkId(1), |_, _| 0), Serve::Wait);
        assert_eq!(done(&mut ra, 0, ChunkId(100), -libc::EIO, now), vec![ChunkId(1)]);
        assert_eq!(ra.lookup(0, 3 * cs, CS, ChunkId(1), |_, _| 0), Serve::Miss);
        assert_eq!(done(&mut ra, 0, ChunkId(101), 4096, now), vec![]);
        assert_eq!(ra.lookup(0, 4 * cs, CS, ChunkId(1), |_, _| 0), Serve::Miss);
        assert_eq!(drain(&mut ra), vec![ChunkId(100), ChunkId(101)]);
        assert_eq!(ra.counters.unused, 2);
    }

    #[test]
    fn cached_chunks_expire_after_the_ttl_and_an_idle_reactor_holds_none() {
        let mut ra = Readahead::new(settings(), 2);
        let t0 = Instant::now();
        start_stream(&mut ra, 1);
        let mut c = 0;
        let n = issue_all(&mut ra, 1, SIZE, &mut c, 0).len();
        assert_eq!(ra.next_deadline(), None, "nothing cached yet");
        for k in 0..n {
            done(&mut ra, 1, ChunkId(k as u16), CS as i32, t0);
        }
        assert_eq!(ra.next_deadline(), Some(t0 + TTL));
        ra.expire(t0 + TTL / 2);
        assert_eq!(ra.held(), n);
        ra.expire(t0 + TTL);
        assert_eq!(ra.held(), 0);
        assert_eq!(drain(&mut ra).len(), n);
        assert_eq!(ra.next_deadline(), None);
        assert_eq!(ra.counters.unused, n as u64);
    }

    #[test]
    fn eviction_gives_up_the_oldest_cached_chunk() {
        let mut ra = Readahead::new(settings(), 1);
        let t0 = Instant::now();
        start_stream(&mut ra, 0);
        let mut c = 0;
        issue_all(&mut ra, 0, SIZE, &mut c, 0);
        assert!(!ra.evict(), "nothing cached: reads in flight are not evicted");
        done(&mut ra, 0, ChunkId(1), CS as i32, t0 + Duration::from_millis(2));
        done(&mut ra, 0, ChunkId(0), CS as i32, t0 + Duration::from_millis(1));
        assert!(ra.evict());
        assert_eq!(drain(&mut ra), vec![ChunkId(0)]);
    }

    #[test]
    fn limits_per_volume_and_per_reactor_hold() {
        // 4 MiB windows of 128 KiB: 64 chunks per volume; a pool of 256: 64 per reactor.
        let mut ra = Readahead::new(Settings::new(CS, 4 << 20, 256), 4);
        let mut c = 0;
        for vslot in 0..4u16 {
            for stream in 0..3u64 {
                let base = stream << 28;
                for k in 0..40u64 {
                    ra.on_read(vslot, base + k * CS as u64, CS);
                    issue_all(&mut ra, vslot, SIZE, &mut c, 0);
                }
            }
            assert!(ra.vols[vslot as usize].entries.len() <= 64);
        }
        assert_eq!(ra.held(), 64);
    }

    #[test]
    fn a_dropped_volume_keeps_nothing_and_off_means_off() {
        let mut ra = Readahead::new(settings(), 1);
        let now = Instant::now();
        start_stream(&mut ra, 0);
        let mut c = 0;
        let n = issue_all(&mut ra, 0, SIZE, &mut c, 0).len();
        done(&mut ra, 0, ChunkId(0), CS as i32, now);
        ra.drop_volume(0);
        assert_eq!(drain(&mut ra), vec![ChunkId(0)]);
        for k in 1..n {
            assert_eq!(done(&mut ra, 0, ChunkId(k as u16), CS as i32, now), vec![]);
        }
        assert_eq!(ra.held(), 0);
        assert!(!ra.on_read(0, 3 * CS as u64, CS), "streams forgotten");

        let mut off = Readahead::new(Settings::new(CS, 0, 512), 1);
        for k in 0..10u64 {
            assert!(!off.on_read(0, k * CS as u64, CS));
            assert_eq!(off.want(0, SIZE), None);
        }
    }
}
