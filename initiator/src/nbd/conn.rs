//! Transmission: one thread per connection.
//!
//! ```text
//!  socket ─▶ requests ─▶ IoQueue ─▶ rdmablk-target
//!  socket ◀─ replies  ◀─ completions
//! ```
//!
//! The connection's thread (the one that negotiated it) reads requests,
//! takes for each READ or WRITE a registered buffer from the connection's
//! pool (bounded by a byte budget), reads a WRITE's payload into it,
//! submits to the connection's `IoQueue`, and sends each completion's reply
//! itself, the replies of one wake-up in one `writev`, a READ's data from
//! its buffer. It sleeps in one place: in the socket's receive when nothing
//! is in flight, else in [`IoQueue::wait_or_readable`], which ends at a
//! completion or when the socket has more requests, so requests that come
//! while others are in flight are sent at once. A request costs the server
//! two wake-ups at QD1 (its arrival and its answer) and no hand-over
//! between threads. At most the queue depth of requests are between their
//! header and their reply: at the limit (or while the buffer budget is
//! taken) the thread waits for completions only and leaves further
//! requests in the socket. A connection ends when reading ends
//! (NBD_CMD_DISC, EOF, an error, a bad request, or the server stopping):
//! the requests in flight are still answered, then a FLUSH makes the
//! connection's writes durable if it left any unflushed.
//!
//! # Stopping
//! When the server stops, the requests already submitted to the volume
//! complete and are answered as usual: the client may be waiting on them,
//! and a write the target is doing cannot be taken back anyway. Every
//! request taken from the socket after that (still in the receive buffer,
//! or waiting for a registered buffer) is not started: it is answered
//! `NBD_ESHUTDOWN`, as the protocol asks of a server that shuts down
//! ("the error value issued in respect of ... any subsequently received
//! requests SHOULD be ESHUTDOWN"), a WRITE's payload read and dropped.
//! Answering instead of closing over them tells the client which requests
//! did not happen, and starting none keeps the stop short. Reading goes on
//! while requests keep coming: over TCP, what a client has sent may still
//! be on its way, and closing over it would drop those requests unanswered
//! (a `shutdown(SHUT_RD)` would not help: TCP reports the end as soon as
//! the receive queue is empty for a moment). It ends when the client
//! closes or sends NBD_CMD_DISC (the protocol tells a client that gets
//! ESHUTDOWN to disconnect), once nothing has come for [`STOP_QUIET`] with
//! nothing in flight, or [`STOP_DRAIN`] after the stop. Then the server
//! sends its FIN and reads what still comes for up to [`STOP_LINGER`]
//! before closing, so that a close over unread bytes (a TCP reset) does
//! not destroy replies still on their way.

use std::collections::BTreeMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::export::{Export, Stream};
use super::wire::{self, Command, Request, SimpleReply, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, NBD_ESHUTDOWN};
use super::{errno, Failure};
use crate::buffer::IoBuffer;
use crate::device::BlockDevice;
use crate::error::Result;
use crate::io_queue::{IoCompletion, IoQueue, IoRequest};
use crate::session::{Session, Volume};

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

/// A reply about to be sent; a successful READ carries its data (the
/// first `len` bytes of the buffer).
struct Reply {
    cookie: u64,
    error: u32,
    data: Option<(IoBuffer, usize)>,
}

/// How long one sleep lasts at most: the loop looks at the connection
/// again (a lost session ends its requests within `io_timeout` anyway).
const WAIT_SLICE: Duration = Duration::from_millis(500);

/// With the server stopping and nothing in flight, reading ends once no
/// request has come for this long.
pub(crate) const STOP_QUIET: Duration = Duration::from_millis(250);
/// Reading ends this long after the stop at the latest, for a client that
/// goes on sending despite NBD_ESHUTDOWN.
pub(crate) const STOP_DRAIN: Duration = Duration::from_secs(5);
/// After its last reply at a stop, how long a connection reads (and drops)
/// what still comes before it closes.
pub(crate) const STOP_LINGER: Duration = Duration::from_secs(1);

/// The server's stop, as a connection sees it.
#[derive(Clone, Copy)]
pub(crate) struct StopSignal<'a> {
    /// Set once the server stops: no request is started after it.
    pub flag: &'a AtomicBool,
    /// Readable once the server stops: wakes a connection that sleeps.
    pub fd: BorrowedFd<'a>,
}

impl StopSignal<'_> {
    fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }
}

/// Serves one negotiated connection until it ends; logs how it ended.
pub(crate) fn serve(shared: &Shared, stream: Stream, peer: &str, stop: StopSignal<'_>) {
    let conn = Connection {
        volume: &shared.volume,
        queue: shared.session.io_queue(),
        pool: Pool::new(shared.session.clone(), shared.buffer_budget),
        depth: shared.depth.max(1),
        pending: Slab::default(),
        batch: Vec::new(),
        replies: Vec::with_capacity(REPLIES_PER_SEND),
        unflushed: false,
        broken: false,
        stop,
        shut_down: 0,
        stream: &stream,
        peer,
    };
    let ended = conn.run();
    if stop.is_set() {
        linger(&stream);
    }
    stream.shutdown(Shutdown::Both);
    tracing::info!("{peer}: disconnected ({ended})");
}

/// What taking one request from the input did.
enum Taken {
    /// Submitted, or answered at once (a refusal, an empty READ or WRITE).
    Done,
    /// Its buffer must wait for buffers in use to come back.
    NoBuffer(Request),
    /// Reading ends: why.
    End(String),
}

/// One connection's state, owned by its thread.
struct Connection<'a> {
    volume: &'a Volume,
    queue: IoQueue,
    pool: Pool,
    /// Requests between their header and their reply, at most.
    depth: usize,
    pending: Slab,
    /// Requests taken this turn, submitted together.
    batch: Vec<(IoRequest, u64)>,
    /// Replies of this turn, sent together.
    replies: Vec<Reply>,
    /// A WRITE, TRIM or WRITE_ZEROES succeeded since the last FLUSH.
    unflushed: bool,
    /// Sending failed: nothing more is sent, and reading ends.
    broken: bool,
    /// Once set, requests taken are answered NBD_ESHUTDOWN.
    stop: StopSignal<'a>,
    /// Requests answered NBD_ESHUTDOWN, for the log.
    shut_down: u64,
    stream: &'a Stream,
    peer: &'a str,
}

impl Connection<'_> {
    /// Serves requests until reading ends and every request taken is
    /// answered; returns why it ended.
    fn run(mut self) -> String {
        let mut input = RequestStream::new(self.stream);
        let mut done: Vec<IoCompletion> = Vec::new();
        // Why reading ended, once it has.
        let mut ended: Option<String> = None;
        // A request whose header was read and that waits for a buffer.
        let mut stalled: Option<Request> = None;
        // When this connection saw the stop.
        let mut stopped_at: Option<Instant> = None;
        loop {
            // Once stopping, a request taken is refused: it needs no room.
            let stopping = self.stop.is_set();
            if stopping && stopped_at.is_none() {
                stopped_at = Some(Instant::now());
            }
            // Every request already received, up to the queue depth.
            while ended.is_none() && (stopping || self.pending.len() < self.depth) {
                let request = match stalled.take() {
                    Some(r) => r,
                    None if input.has_header() => match self.next_request(&mut input) {
                        Ok(Some(r)) => r,
                        Ok(None) => continue,
                        Err(why) => {
                            ended = Some(why);
                            break;
                        }
                    },
                    None => break,
                };
                if stopping {
                    if let Err(why) = self.refuse_shutting_down(&request, &mut input) {
                        ended = Some(why);
                    }
                    continue;
                }
                match self.take(request, &mut input) {
                    Taken::Done => {}
                    Taken::NoBuffer(r) => {
                        stalled = Some(r);
                        break;
                    }
                    Taken::End(why) => ended = Some(why),
                }
            }
            if !self.batch.is_empty() {
                self.queue.submit_batch(self.batch.drain(..));
            }
            self.send_replies();
            if self.broken && ended.is_none() {
                ended = Some("sending a reply failed".to_owned());
            }
            if ended.is_some() && self.queue.outstanding() == 0 {
                break;
            }
            // Stopping, what arrives is refused at once, whatever is in flight.
            let room = ended.is_none() && (stopping || (stalled.is_none() && self.pending.len() < self.depth));
            if self.queue.outstanding() == 0 {
                // Nothing in flight: sleep until requests come or, unless
                // stopping already, the server stops.
                let wait = stopped_at.map(|at| STOP_QUIET.min((at + STOP_DRAIN).saturating_duration_since(Instant::now())));
                let stop_fd = if stopping { None } else { Some(self.stop.fd) };
                if readable(self.stream.as_fd(), stop_fd, wait) {
                    if let Err(why) = receive(&mut input, false) {
                        ended = Some(why);
                    }
                } else if stopping {
                    ended = Some("the server is stopping".to_owned());
                }
                continue;
            }
            if room {
                let (_, readable) =
                    self.queue.wait_or_readable(&mut done, 1, Some(WAIT_SLICE), self.stream.as_fd());
                if readable {
                    if let Err(why) = receive(&mut input, false) {
                        ended = Some(why);
                    }
                }
            } else {
                self.queue.wait(&mut done, 1, Some(WAIT_SLICE));
            }
            for c in done.drain(..) {
                self.complete(c);
            }
            self.send_replies();
        }
        self.flush_at_end();
        if self.shut_down > 0 {
            tracing::info!(
                "{}: {} request(s) received after the stop answered NBD_ESHUTDOWN, not started",
                self.peer,
                self.shut_down
            );
        }
        ended.unwrap_or_default()
    }

    /// Answers a request taken after the stop `NBD_ESHUTDOWN`, without
    /// starting it (a WRITE's payload is read and dropped). `Err`: its
    /// payload did not come, reading ends.
    fn refuse_shutting_down(&mut self, request: &Request, input: &mut RequestStream<'_>) -> std::result::Result<(), String> {
        if let Err(e) = input.discard(request.payload_len()) {
            return Err(format!("reading the payload of a {}-byte write after the stop failed: {e}", request.length));
        }
        self.shut_down += 1;
        self.replies.push(Reply { cookie: request.cookie, error: NBD_ESHUTDOWN, data: None });
        Ok(())
    }

    /// Decodes and checks the next request header. `Ok(None)`: it was
    /// refused (and answered) or needs no volume; `Err`: reading ends.
    fn next_request(&mut self, input: &mut RequestStream<'_>) -> std::result::Result<Option<Request>, String> {
        let mut h = [0u8; Request::SIZE];
        input.take_header(&mut h);
        let request = match Request::decode(&h) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("{}: {e}: the stream is out of step, disconnecting", self.peer);
                return Err(format!("{e}"));
            }
        };
        if let Err(e) = request.validate(wire::MAX_PAYLOAD) {
            if e.is_fatal() {
                tracing::warn!("{}: {e}: disconnecting", self.peer);
                return Err(format!("{e}"));
            }
            // Refused, but the connection stays in step: a WRITE's payload
            // is read and thrown away.
            if let Err(err) = input.discard(request.payload_len()) {
                return Err(format!("reading the payload of a refused request failed: {err}"));
            }
            self.refuse(&request, Failure::Request(e));
            return Ok(None);
        }
        match request.command {
            Command::Disc => Err("NBD_CMD_DISC".to_owned()),
            Command::Read | Command::Write if request.length == 0 => {
                self.replies.push(Reply { cookie: request.cookie, error: 0, data: None });
                Ok(None)
            }
            _ => Ok(Some(request)),
        }
    }

    /// Gives a valid request its buffer (and a WRITE its payload) and
    /// queues it for submission.
    fn take(&mut self, request: Request, input: &mut RequestStream<'_>) -> Taken {
        let mut buffer = None;
        if matches!(request.command, Command::Read | Command::Write) {
            match self.pool.try_take(request.length as usize) {
                Ok(Some(b)) => buffer = Some(b),
                // Only while others are in flight: their buffers come back.
                Ok(None) if self.pending.len() > 0 => return Taken::NoBuffer(request),
                Ok(None) => unreachable!("an idle connection's pool has room for one request"),
                Err(e) => {
                    if let Err(err) = input.discard(request.payload_len()) {
                        return Taken::End(format!("reading the payload of a refused request failed: {err}"));
                    }
                    self.refuse(&request, Failure::Io(e));
                    return Taken::Done;
                }
            }
        }
        if request.command == Command::Write {
            let buf = buffer.as_mut().expect("writes have a buffer");
            if let Err(e) = input.read_payload(&mut buf.as_mut_slice()[..request.length as usize]) {
                self.pool.give(buffer.take().expect("taken above"));
                return Taken::End(format!("reading the payload of a {}-byte write failed: {e}", request.length));
            }
        }
        let (io, p) = build(self.volume, request, buffer);
        self.batch.push((io, self.pending.insert(p)));
        Taken::Done
    }

    /// Answers a request refused before it reached the volume, logged.
    fn refuse(&mut self, request: &Request, failure: Failure) {
        let error = errno(request.command, &failure);
        log_failure(self.peer, request, &failure, error);
        self.replies.push(Reply { cookie: request.cookie, error, data: None });
    }

    /// Turns a completion into a reply (or the FLUSH a FUA TRIM or
    /// WRITE_ZEROES needs first).
    fn complete(&mut self, c: IoCompletion) {
        let p = self.pending.get_mut(c.tag);
        let command = p.request.command;
        match (&c.result, command) {
            (Ok(()), Command::Write | Command::Trim | Command::WriteZeroes) => self.unflushed = true,
            (Ok(()), Command::Flush) => self.unflushed = false,
            _ => {}
        }
        if c.result.is_ok() && p.flush_after && !p.flushing {
            p.flushing = true;
            self.queue.submit(IoRequest::flush(self.volume), c.tag);
            return;
        }
        let p = self.pending.remove(c.tag);
        let (error, data) = match c.result {
            Ok(()) => {
                let data = match (command, c.buffer) {
                    (Command::Read, Some(b)) => Some((b, p.request.length as usize)),
                    (_, Some(b)) => {
                        self.pool.give(b);
                        None
                    }
                    (_, None) => None,
                };
                (0, data)
            }
            Err(e) => {
                if let Some(b) = c.buffer {
                    self.pool.give(b);
                }
                let failure = Failure::Io(e);
                let error = errno(command, &failure);
                log_failure(self.peer, &p.request, &failure, error);
                (error, None)
            }
        };
        self.replies.push(Reply { cookie: p.request.cookie, error, data });
    }

    /// Sends this turn's replies, as many per system call as fit, then
    /// gives their buffers back. After a failed send nothing more is sent.
    fn send_replies(&mut self) {
        for batch in self.replies.chunks(REPLIES_PER_SEND) {
            if self.broken {
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
                self.broken = true;
                self.stream.shutdown(Shutdown::Both);
            }
        }
        for reply in self.replies.drain(..) {
            if let Some((b, _)) = reply.data {
                self.pool.give(b);
            }
        }
    }

    /// The FLUSH after the connection's last writes, if they were not flushed.
    fn flush_at_end(&mut self) {
        if !self.unflushed || self.volume.read_only() {
            return;
        }
        let mut done = Vec::new();
        self.queue.submit(IoRequest::flush(self.volume), u64::MAX);
        while self.queue.outstanding() > 0 {
            self.queue.wait(&mut done, 1, None);
        }
        for c in done.drain(..) {
            if let Err(e) = c.result {
                tracing::warn!("{}: the flush after the connection's last writes failed: {}", self.peer, e.one_line());
            }
        }
    }
}

/// Waits until `socket` is readable (true), `also` is, or `timeout` passes
/// (false for both). A failed poll counts as readable: the receive that
/// follows reports the socket's error.
fn readable(socket: BorrowedFd<'_>, also: Option<BorrowedFd<'_>>, timeout: Option<Duration>) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = timeout.map(|t| Timespec::try_from(t).unwrap_or(Timespec { tv_sec: 1, tv_nsec: 0 }));
    loop {
        let mut fds = [PollFd::new(&socket, PollFlags::IN), PollFd::new(&socket, PollFlags::IN)];
        let n = match &also {
            Some(fd) => {
                fds[1] = PollFd::new(fd, PollFlags::IN);
                2
            }
            None => 1,
        };
        match poll(&mut fds[..n], timeout.as_ref()) {
            Ok(_) => return !fds[0].revents().is_empty(),
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return true,
        }
    }
}

/// After a stop: sends the FIN (after every reply), then reads and drops
/// what the client still sends, until it closes or [`STOP_LINGER`] passes,
/// so that closing over unread bytes (a TCP reset) does not destroy the
/// replies on their way to it.
fn linger(stream: &Stream) {
    stream.shutdown(Shutdown::Write);
    let until = Instant::now() + STOP_LINGER;
    let mut scratch = [0u8; 16 << 10];
    while let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) {
        if stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        let mut s = stream;
        match s.read(&mut scratch) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Receives more requests: blocking (`wait`) or what has arrived. `Err`:
/// why reading ends (EOF, an error).
fn receive(input: &mut RequestStream<'_>, wait: bool) -> std::result::Result<(), String> {
    match input.fill(wait) {
        Ok(0) if input.at_eof() => {
            if input.is_empty() {
                Err("closed by the client without NBD_CMD_DISC, or the server is stopping".to_owned())
            } else {
                Err(format!(
                    "reading a request failed: closed after {} of {} bytes",
                    input.buffered(),
                    Request::SIZE
                ))
            }
        }
        Ok(_) => Ok(()),
        Err(e) => Err(format!("reading a request failed: {e}")),
    }
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
    /// A receive saw the end of the stream.
    eof: bool,
}

impl<'a> RequestStream<'a> {
    fn new(stream: &'a Stream) -> Self {
        RequestStream { stream, buf: vec![0u8; RECEIVE_BUFFER].into_boxed_slice(), start: 0, end: 0, eof: false }
    }

    /// Receives more into the buffer: waiting for bytes (`wait`), or only
    /// what has arrived. Returns the bytes received; 0 is the end of the
    /// stream if [`at_eof`] says so, else (not waiting) nothing had arrived.
    ///
    /// [`at_eof`]: RequestStream::at_eof
    fn fill(&mut self, wait: bool) -> io::Result<usize> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let flags = if wait { rustix::net::RecvFlags::empty() } else { rustix::net::RecvFlags::DONTWAIT };
        loop {
            match rustix::net::recv(self.stream.as_fd(), &mut self.buf[self.end..], flags) {
                Ok((n, _)) => {
                    self.end += n;
                    self.eof |= n == 0;
                    return Ok(n);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) if !wait => return Ok(0),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether a receive found the end of the stream.
    fn at_eof(&self) -> bool {
        self.eof
    }

    /// Bytes received and not taken yet.
    fn buffered(&self) -> usize {
        self.end - self.start
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Whether a whole request header is buffered.
    fn has_header(&self) -> bool {
        self.buffered() >= Request::SIZE
    }

    /// Takes the buffered header into `out`; only after [`has_header`].
    ///
    /// [`has_header`]: RequestStream::has_header
    fn take_header(&mut self, out: &mut [u8; Request::SIZE]) {
        out.copy_from_slice(&self.buf[self.start..self.start + Request::SIZE]);
        self.start += Request::SIZE;
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

/// A request in flight.
struct Pending {
    request: Request,
    /// FUA on TRIM or WRITE_ZEROES: a FLUSH follows before the reply.
    flush_after: bool,
    /// The FLUSH of `flush_after` is the one in flight.
    flushing: bool,
}

/// The connection's requests in flight, by tag.
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

    /// Requests in it.
    fn len(&self) -> usize {
        self.entries.len() - self.free.len()
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
        Command::Disc | Command::Other(_) => unreachable!("next_request keeps {} from the volume", r.command),
    };
    let flush_after = fua && matches!(r.command, Command::Trim | Command::WriteZeroes);
    (request, Pending { request: r, flush_after, flushing: false })
}

/// Replies sent with one `writev` at most (each is a header and, for a
/// READ, its data); more go out in further calls.
const REPLIES_PER_SEND: usize = 32;

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

/// The connection's registered buffers, by size class (powers of two from
/// 4 KiB), allocated on first use and reused; at most `budget` bytes.
struct Pool {
    session: Session,
    free: BTreeMap<usize, Vec<IoBuffer>>,
    /// Bytes allocated (free and in use).
    bytes: usize,
    budget: usize,
}

impl Pool {
    fn new(session: Session, budget: usize) -> Pool {
        Pool { session, free: BTreeMap::new(), bytes: 0, budget }
    }

    /// A buffer of at least `len` bytes, or `None` while the budget is taken
    /// by buffers in use (never when none is: a request larger than the
    /// budget gets one of its own). Idle buffers of other sizes are freed
    /// to make room.
    fn try_take(&mut self, len: usize) -> Result<Option<IoBuffer>> {
        let class = len.max(4096).next_power_of_two();
        let budget = self.budget.max(class);
        loop {
            if let Some(b) = self.free.get_mut(&class).and_then(Vec::pop) {
                return Ok(Some(b));
            }
            if self.bytes + class <= budget {
                let b = self.session.alloc_buffer(class)?;
                self.bytes += class;
                return Ok(Some(b));
            }
            let Some((&size, list)) = self.free.iter_mut().find(|(_, l)| !l.is_empty()) else {
                return Ok(None);
            };
            list.pop();
            self.bytes -= size;
        }
    }

    fn give(&mut self, b: IoBuffer) {
        self.free.entry(b.len()).or_default().push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// The next header, receiving (waiting) as needed; `Err`: why reading ended.
    fn header(input: &mut RequestStream<'_>) -> std::result::Result<[u8; Request::SIZE], String> {
        while !input.has_header() {
            receive(input, true)?;
        }
        let mut h = [0u8; Request::SIZE];
        input.take_header(&mut h);
        Ok(h)
    }

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
        assert_eq!(header(&mut input).unwrap(), [1u8; 28]);
        assert!(input.has_header(), "one receive took both headers");
        assert_eq!(header(&mut input).unwrap(), [2u8; 28]);
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
        assert_eq!(header(&mut input).unwrap(), [3u8; 28]);
        b.write_all(&[4u8; 10]).unwrap();
        drop(b);
        let e = header(&mut input).unwrap_err();
        assert!(e.contains("closed after 10 of 28 bytes"), "{e}");
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
        for i in 0..n {
            assert_eq!(header(&mut input).unwrap(), [(i % 251) as u8; 28], "header {i}");
        }
        writer.join().unwrap();
        let e = header(&mut input).unwrap_err();
        assert!(e.starts_with("closed by the client without NBD_CMD_DISC"), "EOF between requests is a clean end: {e}");
    }

    #[test]
    fn a_receive_that_does_not_wait_takes_what_arrived_and_tells_nothing_from_the_end() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let a = Stream::Unix(a);
        let mut input = RequestStream::new(&a);
        // Nothing yet: no bytes, not the end, and the call returns at once.
        assert_eq!(input.fill(false).unwrap(), 0);
        assert!(!input.at_eof());
        assert_eq!(receive(&mut input, false), Ok(()));
        b.write_all(&[5u8; 30]).unwrap();
        assert_eq!(input.fill(false).unwrap(), 30);
        assert!(input.has_header());
        let mut h = [0u8; Request::SIZE];
        input.take_header(&mut h);
        assert_eq!(h, [5u8; 28]);
        assert_eq!(input.buffered(), 2);
        // The end, with 2 bytes of a header left: an error naming them.
        drop(b);
        assert_eq!(input.fill(false).unwrap(), 0);
        assert!(input.at_eof());
        let e = receive(&mut input, false).unwrap_err();
        assert!(e.contains("closed after 2 of 28 bytes"), "{e}");
    }
}
