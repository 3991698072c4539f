//! Transmission: the reader and I/O threads of one connection.
//!
//! ```text
//!  socket ─▶ reader ──jobs──▶ I/O thread (IoQueue) ──replies──▶ socket
//!                   (requests, and replies the reader decided: refusals)
//! ```
//!
//! The reader takes a slot (at most the queue depth of requests between
//! their header and their reply) and, for a READ or WRITE, a registered
//! buffer from the connection's pool (bounded by a byte budget), reads a
//! WRITE's payload into it, and hands the request to the I/O thread, waking
//! it. The I/O thread submits to its `IoQueue` and sleeps on the queue's
//! completions, or (nothing outstanding) on the waker alone; each
//! completion becomes a reply, which it sends itself, the replies of one
//! wake-up in one `writev`, a READ's data from its buffer; then it gives the
//! buffers back and frees the slots. A request thus costs the server two
//! wake-ups (the reader's for the request, the I/O thread's for it and for
//! its answer), no hand-over to a third thread. The reader keeps reading
//! while the I/O thread sends: a client that writes requests before it
//! reads replies is served up to the queue depth. A connection ends when
//! the reader stops (NBD_CMD_DISC, EOF, an error, a bad request, or the
//! server stopping): the requests in flight are still answered, then a
//! FLUSH makes the connection's writes durable if it left any unflushed.

use std::collections::BTreeMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::server::{Export, Stream};
use super::wire::{self, Command, Request, SimpleReply, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE};
use super::{errno, Failure};
use crate::buffer::IoBuffer;
use crate::device::BlockDevice;
use crate::error::Result;
use crate::session::{Session, Volume};
use crate::submit::{IoCompletion, IoQueue, IoRequest, IoWaker};

/// What every connection of a server shares.
pub(crate) struct Shared {
    pub session: Session,
    pub volume: Arc<Volume>,
    pub export: Export,
    /// Requests one connection has between header and reply.
    pub depth: usize,
    /// Registered bytes one connection's buffers may take.
    pub buffer_budget: usize,
}

/// What the reader hands the I/O thread.
enum Job {
    /// A request for the volume.
    Io { request: Request, buffer: Option<IoBuffer> },
    /// A reply the reader decided on (a refusal, an empty READ or WRITE);
    /// its slot is taken.
    Reply { cookie: u64, error: u32 },
}

/// A reply about to be sent; a successful READ carries its data (the
/// first `len` bytes of the buffer).
struct Reply {
    cookie: u64,
    error: u32,
    data: Option<(IoBuffer, usize)>,
}

/// Serves one negotiated connection until it ends; logs how it ended.
pub(crate) fn serve(shared: &Shared, stream: Stream, peer: &str) {
    let writer_stream = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("{peer}: closing, cannot duplicate its socket: {e}");
            return;
        }
    };
    let mut queue = shared.session.io_queue();
    let waker = match queue.waker() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!("{peer}: closing: {e}");
            return;
        }
    };
    let pool = Pool::new(shared.session.clone(), shared.buffer_budget);
    let slots = Slots::new(shared.depth);
    let broken = AtomicBool::new(false);
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let ended = std::thread::scope(|scope| {
        let (pool, slots, broken, volume) = (&pool, &slots, &broken, &*shared.volume);
        let out = Replies { stream: &writer_stream, pool, slots, broken, peer };
        let io = std::thread::Builder::new().name("nbd-io".into()).spawn_scoped(scope, move || run_io(queue, volume, job_rx, out));
        if let Err(e) = io {
            tracing::warn!("{peer}: closing, no thread for it: {e}");
            return "no thread".to_owned();
        }
        let ended = read_requests(&stream, job_tx, &waker, pool, slots, broken, peer);
        // The I/O thread may be blocked sending to a client that stopped reading.
        if broken.load(Ordering::Acquire) {
            stream.shutdown(Shutdown::Both);
        }
        ended
    });
    stream.shutdown(Shutdown::Both);
    tracing::info!("{peer}: disconnected ({ended})");
}

/// The reader: decodes requests until the connection ends; returns why.
#[allow(clippy::too_many_arguments)]
fn read_requests(
    stream: &Stream,
    jobs: Sender<Job>,
    waker: &IoWaker,
    pool: &Pool,
    slots: &Slots,
    broken: &AtomicBool,
    peer: &str,
) -> String {
    let max = wire::MAX_PAYLOAD;
    let mut input = RequestStream::new(stream);
    let ended = loop {
        if broken.load(Ordering::Acquire) {
            break "sending a reply failed".to_owned();
        }
        let mut h = [0u8; Request::SIZE];
        match input.read_header(&mut h) {
            Ok(true) => {}
            Ok(false) => break "closed by the client without NBD_CMD_DISC, or the server is stopping".to_owned(),
            Err(e) => break format!("reading a request failed: {e}"),
        }
        let request = match Request::decode(&h) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("{peer}: {e}: the stream is out of step, disconnecting");
                break format!("{e}");
            }
        };
        if let Err(e) = request.validate(max) {
            if e.is_fatal() {
                tracing::warn!("{peer}: {e}: disconnecting");
                break format!("{e}");
            }
            // Refused, but the connection stays in step: a WRITE's payload
            // is read and thrown away.
            if let Err(err) = input.discard(request.payload_len()) {
                break format!("reading the payload of a refused request failed: {err}");
            }
            if !refuse(&request, Failure::Request(e), &jobs, waker, slots, peer) {
                break "the I/O thread ended".to_owned();
            }
            continue;
        }
        match request.command {
            Command::Disc => break "NBD_CMD_DISC".to_owned(),
            Command::Read | Command::Write if request.length == 0 => {
                slots.acquire();
                if jobs.send(Job::Reply { cookie: request.cookie, error: 0 }).is_err() {
                    slots.release();
                    break "the I/O thread ended".to_owned();
                }
                waker.wake();
                continue;
            }
            _ => {}
        }
        slots.acquire();
        let buffer = match request.command {
            Command::Read | Command::Write => match pool.take(request.length as usize) {
                Ok(b) => Some(b),
                Err(e) => {
                    if let Err(err) = input.discard(request.payload_len()) {
                        slots.release();
                        break format!("reading the payload of a refused request failed: {err}");
                    }
                    slots.release();
                    if !refuse(&request, Failure::Io(e), &jobs, waker, slots, peer) {
                        break "the I/O thread ended".to_owned();
                    }
                    continue;
                }
            },
            _ => None,
        };
        let mut buffer = buffer;
        if request.command == Command::Write {
            let buf = buffer.as_mut().expect("writes have a buffer");
            if let Err(e) = input.read_payload(&mut buf.as_mut_slice()[..request.length as usize]) {
                pool.give(buffer.take().expect("taken above"));
                slots.release();
                break format!("reading the payload of a {}-byte write failed: {e}", request.length);
            }
        }
        if let Err(mpsc::SendError(job)) = jobs.send(Job::Io { request, buffer }) {
            if let Job::Io { buffer: Some(b), .. } = job {
                pool.give(b);
            }
            slots.release();
            break "the I/O thread ended".to_owned();
        }
        waker.wake();
    };
    drop(jobs);
    waker.wake();
    ended
}

/// What the reader takes from the socket in one receive, at most: several
/// request headers (28 bytes each) and small WRITE payloads arrive
/// together instead of costing a system call each.
const RECEIVE_BUFFER: usize = 16 << 10;

/// The reader's side of the socket: headers come through a small receive
/// buffer; a WRITE's payload is copied from it only for the bytes that
/// arrived in the same receive, and the rest is read straight into the
/// request's registered buffer.
struct RequestStream<'a> {
    stream: &'a Stream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl<'a> RequestStream<'a> {
    fn new(stream: &'a Stream) -> Self {
        RequestStream { stream, buf: vec![0u8; RECEIVE_BUFFER].into_boxed_slice(), start: 0, end: 0 }
    }

    /// Receives more into the buffer; the bytes received (0 at EOF).
    fn fill(&mut self) -> io::Result<usize> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let mut s = self.stream;
        loop {
            match s.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Fills `out` (a header); `Ok(false)` at EOF before its first byte.
    fn read_header(&mut self, out: &mut [u8]) -> io::Result<bool> {
        while self.end - self.start < out.len() {
            if self.fill()? == 0 {
                if self.start == self.end {
                    return Ok(false);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("closed after {} of {} bytes", self.end - self.start, out.len()),
                ));
            }
        }
        out.copy_from_slice(&self.buf[self.start..self.start + out.len()]);
        self.start += out.len();
        Ok(true)
    }

    /// Fills `out` (a payload): what is buffered, then straight from the socket.
    fn read_payload(&mut self, out: &mut [u8]) -> io::Result<()> {
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        let mut s = self.stream;
        s.read_exact(&mut out[n..])
    }

    /// Reads and drops `len` bytes (a refused WRITE's payload).
    fn discard(&mut self, len: u32) -> io::Result<()> {
        let mut scratch = vec![0u8; (len as usize).min(64 << 10)];
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(scratch.len());
            self.read_payload(&mut scratch[..n])?;
            left -= n;
        }
        Ok(())
    }
}

/// Has the I/O thread answer a request refused before it reached the
/// volume, logged; false if the I/O thread is gone.
fn refuse(request: &Request, failure: Failure, jobs: &Sender<Job>, waker: &IoWaker, slots: &Slots, peer: &str) -> bool {
    let error = errno(request.command, &failure);
    log_failure(peer, request, &failure, error);
    slots.acquire();
    if jobs.send(Job::Reply { cookie: request.cookie, error }).is_err() {
        slots.release();
        return false;
    }
    waker.wake();
    true
}

fn log_failure(peer: &str, r: &Request, failure: &Failure, error: u32) {
    let why = match failure {
        Failure::Request(e) => e.to_string(),
        Failure::Io(e) => e.one_line(),
    };
    tracing::warn!(
        "{peer}: {} of {} bytes at offset {} (cookie {:#x}) refused with NBD errno {error}: {why}",
        r.command,
        r.length,
        r.offset,
        r.cookie
    );
}

/// A request in the I/O thread.
struct Pending {
    request: Request,
    /// FUA on TRIM or WRITE_ZEROES: a FLUSH follows before the reply.
    flush_after: bool,
    /// The FLUSH of `flush_after` is the one in flight.
    flushing: bool,
}

/// The I/O thread: submits the reader's requests to the connection's
/// `IoQueue`, keeps them in flight together, turns completions into replies
/// and sends them. Ends when the reader is gone and nothing is in flight,
/// after a FLUSH if the connection's writes were not flushed.
fn run_io(mut queue: IoQueue, volume: &Volume, jobs: Receiver<Job>, out: Replies<'_>) {
    let (peer, pool) = (out.peer, out.pool);
    let mut pending = Slab::default();
    let mut batch: Vec<(IoRequest, u64)> = Vec::new();
    let mut done: Vec<IoCompletion> = Vec::new();
    let mut replies: Vec<Reply> = Vec::with_capacity(REPLIES_PER_SEND);
    let mut open = true;
    let mut unflushed = false;
    loop {
        loop {
            match jobs.try_recv() {
                Ok(Job::Io { request, buffer }) => {
                    let (request, p) = build(volume, request, buffer);
                    batch.push((request, pending.insert(p)));
                }
                Ok(Job::Reply { cookie, error }) => replies.push(Reply { cookie, error, data: None }),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if !batch.is_empty() {
            queue.submit_batch(batch.drain(..));
        }
        out.send(&mut replies);
        if queue.outstanding() == 0 {
            if !open {
                break;
            }
            // The reader wakes this sleep with each job (and when it ends).
            queue.wait_woken(Duration::from_millis(500));
            continue;
        }
        queue.wait(&mut done, 1, Some(Duration::from_millis(500)));
        for c in done.drain(..) {
            let p = pending.get_mut(c.tag);
            let command = p.request.command;
            match (&c.result, command) {
                (Ok(()), Command::Write | Command::Trim | Command::WriteZeroes) => unflushed = true,
                (Ok(()), Command::Flush) => unflushed = false,
                _ => {}
            }
            if c.result.is_ok() && p.flush_after && !p.flushing {
                p.flushing = true;
                queue.submit(IoRequest::flush(volume), c.tag);
                continue;
            }
            let p = pending.remove(c.tag);
            let (error, data) = match c.result {
                Ok(()) => {
                    let data = match (command, c.buffer) {
                        (Command::Read, Some(b)) => Some((b, p.request.length as usize)),
                        (_, Some(b)) => {
                            pool.give(b);
                            None
                        }
                        (_, None) => None,
                    };
                    (0, data)
                }
                Err(e) => {
                    if let Some(b) = c.buffer {
                        pool.give(b);
                    }
                    let failure = Failure::Io(e);
                    let error = errno(command, &failure);
                    log_failure(peer, &p.request, &failure, error);
                    (error, None)
                }
            };
            replies.push(Reply { cookie: p.request.cookie, error, data });
        }
        out.send(&mut replies);
    }
    if unflushed && !volume.read_only() {
        queue.submit(IoRequest::flush(volume), u64::MAX);
        while queue.outstanding() > 0 {
            queue.wait(&mut done, 1, None);
        }
        for c in done.drain(..) {
            if let Err(e) = c.result {
                tracing::warn!("{peer}: the flush after the connection's last writes failed: {}", e.one_line());
            }
        }
    }
}

/// The I/O thread's requests by tag.
#[derive(Default)]
struct Slab {
    entries: Vec<Option<Pending>>,
    free: Vec<usize>,
}

impl Slab {
    fn insert(&mut self, p: Pending) -> u64 {
        match self.free.pop() {
            Some(i) => {
                self.entries[i] = Some(p);
                i as u64
            }
            None => {
                self.entries.push(Some(p));
                (self.entries.len() - 1) as u64
            }
        }
    }

    fn get_mut(&mut self, tag: u64) -> &mut Pending {
        self.entries[tag as usize].as_mut().expect("a pending request")
    }

    fn remove(&mut self, tag: u64) -> Pending {
        self.free.push(tag as usize);
        self.entries[tag as usize].take().expect("a pending request")
    }
}

/// The `IoRequest` of a request and its bookkeeping.
fn build(volume: &Volume, r: Request, buffer: Option<IoBuffer>) -> (IoRequest, Pending) {
    let fua = r.flags & CMD_FLAG_FUA != 0;
    let (offset, len) = (r.offset, u64::from(r.length));
    let request = match r.command {
        Command::Read => {
            IoRequest::read(volume, offset, buffer.expect("reads have a buffer")).with_range(0, len as usize)
        }
        Command::Write => {
            let w =
                IoRequest::write(volume, offset, buffer.expect("writes have a buffer")).with_range(0, len as usize);
            if fua {
                w.with_fua()
            } else {
                w
            }
        }
        Command::Flush => IoRequest::flush(volume),
        Command::Trim => IoRequest::discard(volume, offset, len),
        Command::WriteZeroes => {
            let z = IoRequest::write_zeroes(volume, offset, len);
            if r.flags & CMD_FLAG_NO_HOLE != 0 {
                z.with_no_hole()
            } else {
                z
            }
        }
        Command::Disc | Command::Other(_) => unreachable!("the reader keeps {} from the I/O thread", r.command),
    };
    let flush_after = fua && matches!(r.command, Command::Trim | Command::WriteZeroes);
    (request, Pending { request: r, flush_after, flushing: false })
}

/// Replies sent with one `writev` at most (each is a header and, for a
/// READ, its data); more go out in further calls.
const REPLIES_PER_SEND: usize = 32;

/// The connection's sending side, used by the I/O thread only (so replies
/// never interleave on the socket).
struct Replies<'a> {
    stream: &'a Stream,
    pool: &'a Pool,
    slots: &'a Slots,
    broken: &'a AtomicBool,
    peer: &'a str,
}

impl Replies<'_> {
    /// Sends `replies` (emptied), as many per system call as fit, then gives
    /// their buffers back and frees their slots. After a failed send it only
    /// does the latter (and the reader ends).
    fn send(&self, replies: &mut Vec<Reply>) {
        for batch in replies.chunks(REPLIES_PER_SEND) {
            if self.broken.load(Ordering::Acquire) {
                break;
            }
            // On the stack: a batch allocates nothing.
            let mut headers = [[0u8; SimpleReply::SIZE]; REPLIES_PER_SEND];
            for (h, r) in headers.iter_mut().zip(batch) {
                *h = SimpleReply { error: r.error, cookie: r.cookie }.encode();
            }
            let mut slices = [IoSlice::new(&[]); 2 * REPLIES_PER_SEND];
            let mut n = 0;
            for (h, r) in headers.iter().zip(batch) {
                slices[n] = IoSlice::new(h);
                n += 1;
                if let Some((b, len)) = &r.data {
                    slices[n] = IoSlice::new(&b.as_slice()[..*len]);
                    n += 1;
                }
            }
            if let Err(e) = write_all_vectored(self.stream, &mut slices[..n]) {
                tracing::warn!("{}: sending a reply failed: {e}; closing", self.peer);
                self.broken.store(true, Ordering::Release);
                self.stream.shutdown(Shutdown::Both);
            }
        }
        let n = replies.len();
        for reply in replies.drain(..) {
            if let Some((b, _)) = reply.data {
                self.pool.give(b);
            }
        }
        if n > 0 {
            self.slots.release_many(n);
        }
    }
}

/// Writes every slice with as few system calls as the socket allows.
fn write_all_vectored(mut s: &Stream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() && slices.iter().any(|b| !b.is_empty()) {
        match s.write_vectored(slices) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes")),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A counting semaphore: requests between their header and their reply.
struct Slots {
    state: Mutex<SlotCount>,
    freed: Condvar,
    max: usize,
}

struct SlotCount {
    used: usize,
    /// Threads in `acquire`'s wait: a release wakes (a system call) only
    /// when there is one.
    waiting: usize,
}

impl Slots {
    fn new(max: usize) -> Slots {
        Slots { state: Mutex::new(SlotCount { used: 0, waiting: 0 }), freed: Condvar::new(), max: max.max(1) }
    }

    fn acquire(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while st.used >= self.max {
            st.waiting += 1;
            st = self.freed.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
        }
        st.used += 1;
    }

    fn release(&self) {
        self.release_many(1);
    }

    fn release_many(&self, n: usize) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.used -= n;
        if st.waiting > 0 {
            self.freed.notify_one();
        }
    }
}

/// The connection's registered buffers, by size class (powers of two from
/// 4 KiB), allocated on first use and reused; at most `budget` bytes.
struct Pool {
    session: Session,
    state: Mutex<PoolState>,
    freed: Condvar,
    budget: usize,
}

struct PoolState {
    free: BTreeMap<usize, Vec<IoBuffer>>,
    /// Bytes allocated (free and in use).
    bytes: usize,
    /// Threads in `take`'s wait: `give` wakes (a system call) only when
    /// there is one.
    waiting: usize,
}

impl Pool {
    fn new(session: Session, budget: usize) -> Pool {
        Pool {
            session,
            state: Mutex::new(PoolState { free: BTreeMap::new(), bytes: 0, waiting: 0 }),
            freed: Condvar::new(),
            budget,
        }
    }

    /// A buffer of at least `len` bytes; waits while the budget is taken by
    /// buffers in use. Idle buffers of other sizes are freed to make room.
    fn take(&self, len: usize) -> Result<IoBuffer> {
        let class = len.max(4096).next_power_of_two();
        let budget = self.budget.max(class);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(b) = st.free.get_mut(&class).and_then(Vec::pop) {
                return Ok(b);
            }
            if st.bytes + class <= budget {
                st.bytes += class;
                drop(st);
                return self.session.alloc_buffer(class).inspect_err(|_| {
                    self.state.lock().unwrap_or_else(|e| e.into_inner()).bytes -= class;
                });
            }
            if let Some((&size, list)) = st.free.iter_mut().find(|(_, l)| !l.is_empty()) {
                list.pop();
                st.bytes -= size;
                continue;
            }
            st.waiting += 1;
            st = self.freed.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
        }
    }

    fn give(&self, b: IoBuffer) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.free.entry(b.len()).or_default().push(b);
        if st.waiting > 0 {
            self.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn the_request_stream_splits_buffered_bytes_and_reads_the_rest_from_the_socket() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let a = Stream::Unix(a);
        let mut input = RequestStream::new(&a);
        // Two headers and the first 100 bytes of a payload in one write.
        let payload: Vec<u8> = (0..40_000u32).map(|i| (i * 7) as u8).collect();
        let mut first = vec![1u8; 28];
        first.extend_from_slice(&[2u8; 28]);
        first.extend_from_slice(&payload[..100]);
        b.write_all(&first).unwrap();
        let mut h = [0u8; 28];
        assert!(input.read_header(&mut h).unwrap());
        assert_eq!(h, [1u8; 28]);
        assert!(input.read_header(&mut h).unwrap());
        assert_eq!(h, [2u8; 28]);
        // The payload: 100 bytes buffered, the rest (more than the buffer) from the socket.
        let writer = std::thread::spawn(move || {
            b.write_all(&payload[100..]).unwrap();
            b.write_all(&[3u8; 20]).unwrap();
            b
        });
        let mut got = vec![0u8; 40_000];
        input.read_payload(&mut got).unwrap();
        let mut b = writer.join().unwrap();
        assert!(got.iter().enumerate().all(|(i, &x)| x == (i as u32 * 7) as u8));
        // A header split across two receives, then EOF in the middle of the next.
        b.write_all(&[3u8; 8]).unwrap();
        let mut h3 = [0u8; 28];
        assert!(input.read_header(&mut h3).unwrap());
        assert_eq!(h3, [3u8; 28]);
        b.write_all(&[4u8; 10]).unwrap();
        drop(b);
        let e = input.read_header(&mut h).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("closed after 10 of 28 bytes"), "{e}");
    }

    #[test]
    fn the_request_stream_compacts_a_full_buffer_and_sees_a_clean_end() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let a = Stream::Unix(a);
        let mut input = RequestStream::new(&a);
        // More headers than the buffer holds: the last one straddles its end.
        let n = RECEIVE_BUFFER / 28 + 3;
        let writer = std::thread::spawn(move || {
            for i in 0..n {
                b.write_all(&[(i % 251) as u8; 28]).unwrap();
            }
        });
        let mut h = [0u8; 28];
        for i in 0..n {
            assert!(input.read_header(&mut h).unwrap(), "header {i}");
            assert_eq!(h, [(i % 251) as u8; 28], "header {i}");
        }
        writer.join().unwrap();
        assert!(!input.read_header(&mut h).unwrap(), "EOF between requests is a clean end");
    }
}
