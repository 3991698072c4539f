//! I/O engines: what a job loop submits to and reaps from.
//!
//! The job loop talks to a small slot-based trait, [`Engine`]: it owns
//! `depth` registered buffers (slots), the loop fills a slot's buffer, submits
//! it with the slot number as the tag, and gets the tag back in a completion.
//! Two engines implement it:
//!
//! - `rdmablk` (default): the initiator's completion-based submission API
//!   ([`IoQueue`]): every slot's request is on the wire at once, up to the
//!   negotiated queue depth, and completions are reaped in batches. Each
//!   slot is its own registered [`IoBuffer`], handed to the request and back
//!   (zero copy).
//! - `rdmablk-sync`: the blocking [`Volume::read_into`] /
//!   [`Volume::write_from`] calls, one request at a time, from one
//!   registered buffer: what an application that does not use the
//!   submission API gets (effective queue depth 1).

use std::collections::VecDeque;
use std::time::Duration;

use rdmablk_initiator::{ConnectOptions, IoBuffer, IoCompletion, IoQueue, IoRequest, Session, Volume};

/// Direction of an I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read = 0,
    Write = 1,
}

/// One I/O handed to an engine.
#[derive(Clone, Copy, Debug)]
pub struct IoReq {
    /// The slot, in `0..depth`.
    pub tag: u32,
    pub dir: Dir,
    pub offset: u64,
    pub len: u32,
}

/// One finished I/O.
#[derive(Debug)]
pub struct IoDone {
    pub tag: u32,
    /// The error, on one line.
    pub error: Option<String>,
}

/// A job's view of a volume: `depth` slots of registered memory and a
/// completion-based submit/reap interface.
pub trait Engine: Send {
    /// fio's name of the engine.
    fn name(&self) -> &'static str;
    /// Slots: the most I/Os in flight.
    fn depth(&self) -> usize;
    /// The volume's size in bytes.
    fn volume_size(&self) -> u64;
    /// The volume's block size.
    fn block_size(&self) -> u32;
    /// The buffer of an idle slot (its first `len` bytes are what a write sends).
    fn buf(&self, tag: u32) -> &[u8];
    /// The buffer of an idle slot, for filling.
    fn buf_mut(&mut self, tag: u32) -> &mut [u8];
    /// Starts the I/Os; their slots must be idle. Errors are fatal for the job.
    fn submit(&mut self, reqs: &[IoReq]) -> Result<(), String>;
    /// Waits until at least `min` I/Os have completed (fewer if fewer are in
    /// flight) and appends every completed one to `out`. While the session
    /// reconnects it waits; the I/Os in flight are re-issued after the
    /// reconnection and complete then.
    fn reap(&mut self, min: usize, out: &mut Vec<IoDone>) -> Result<(), String>;
    /// Times the session reconnected to the target so far.
    fn reconnects(&self) -> u64;
    /// The session is lost for good: reconnection is off
    /// (`ctrl_loss_tmo=0`) or gave up.
    fn is_lost(&self) -> bool;
}

/// Which engine (`ioengine=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Queue,
    Sync,
}

impl EngineKind {
    /// `rdmablk` (or anything fio knows, for job files written for fio) is
    /// the submission API; `rdmablk-sync` the blocking calls.
    pub fn from_ioengine(name: Option<&str>) -> EngineKind {
        match name {
            Some("rdmablk-sync") | Some("rdmablk_sync") => EngineKind::Sync,
            _ => EngineKind::Queue,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Queue => "rdmablk",
            EngineKind::Sync => "rdmablk-sync",
        }
    }
}

/// Who connects: `--host-id` and `--key-file` (both optional).
#[derive(Clone, Copy, Debug, Default)]
pub struct Identity<'a> {
    pub host_id: Option<&'a str>,
    pub key_file: Option<&'a str>,
}

/// How long a `hipri` job polls before it sleeps: longer than any I/O at
/// low depth, so that it practically never sleeps while I/O is in flight.
pub const HIPRI_BUSY_POLL: Duration = Duration::from_millis(1);

/// How the job's session waits and what it exposes.
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// Poll for completions instead of sleeping (`hipri`).
    pub hipri: bool,
    /// A memory window per command (`rkey_scoping`, default on).
    pub rkey_scoping: bool,
    /// How long to keep reconnecting to a lost target (`ctrl_loss_tmo`;
    /// zero: the first loss fails the I/O in flight).
    pub ctrl_loss_timeout: Duration,
}

/// Connects a session of one queue pair to `url` as `who`, opens `volume`
/// and sets up `depth` slots of `slot_size` bytes.
pub fn open(
    kind: EngineKind,
    url: &str,
    volume: &str,
    depth: u32,
    slot_size: usize,
    who: Identity<'_>,
    tuning: Tuning,
) -> Result<Box<dyn Engine>, String> {
    let max_io = (slot_size as u32).max(1 << 20).next_multiple_of(4096);
    let options = ConnectOptions {
        queues: 1,
        // One slot of a queue pair is kept for keep-alives.
        queue_depth: (depth + 1).min(65535),
        max_io_size: max_io,
        // By default (ctrl_loss_tmo=0) a benchmark reports a lost
        // connection instead of riding it out.
        ctrl_loss_timeout: tuning.ctrl_loss_timeout,
        bounce_pool_size: 1 << 20,
        busy_poll: if tuning.hipri { HIPRI_BUSY_POLL } else { Duration::ZERO },
        rkey_scoping: tuning.rkey_scoping,
        ..ConnectOptions::default()
    };
    let mut options = options;
    if let Some(id) = who.host_id {
        options.host_id = id.to_owned();
    }
    if let Some(path) = who.key_file {
        options = options.with_key_file(path).map_err(|e| format!("--key-file: {}", e.one_line()))?;
    }
    let session = Session::connect(url, options).map_err(|e| format!("connecting to {url}: {}", e.one_line()))?;
    let vol = session.open(volume).map_err(|e| format!("opening volume {volume:?} on {url}: {}", e.one_line()))?;
    let alloc = |len: usize| {
        session.alloc_buffer(len).map_err(|e| format!("registering a {len}-byte buffer: {}", e.one_line()))
    };
    match kind {
        EngineKind::Queue => {
            let mut slots = Vec::with_capacity(depth as usize);
            for _ in 0..depth {
                slots.push(Some(alloc(slot_size)?));
            }
            let queue = session.io_queue();
            Ok(Box::new(QueueEngine { slots, queue, vol, session, done: Vec::with_capacity(depth as usize) }))
        }
        EngineKind::Sync => {
            let buf = alloc(slot_size * depth as usize)?;
            Ok(Box::new(SyncEngine { buf, slot_size, vol, pending: VecDeque::new(), session }))
        }
    }
}

/// The submission-API engine.
struct QueueEngine {
    // Field order is drop order: the queue ends its requests before the
    // buffers, the volume and the session go.
    queue: IoQueue,
    slots: Vec<Option<IoBuffer>>,
    done: Vec<IoCompletion>,
    vol: Volume,
    session: Session,
}

impl Engine for QueueEngine {
    fn name(&self) -> &'static str {
        EngineKind::Queue.name()
    }

    fn depth(&self) -> usize {
        self.slots.len()
    }

    fn volume_size(&self) -> u64 {
        self.vol.info().size_bytes
    }

    fn block_size(&self) -> u32 {
        self.vol.info().block_size
    }

    fn buf(&self, tag: u32) -> &[u8] {
        self.slots[tag as usize].as_ref().expect("slot is idle").as_slice()
    }

    fn buf_mut(&mut self, tag: u32) -> &mut [u8] {
        self.slots[tag as usize].as_mut().expect("slot is idle").as_mut_slice()
    }

    fn submit(&mut self, reqs: &[IoReq]) -> Result<(), String> {
        let slots = &mut self.slots;
        let vol = &self.vol;
        self.queue.submit_batch(reqs.iter().map(|r| {
            let buf = slots[r.tag as usize].take().expect("slot is idle");
            let req = match r.dir {
                Dir::Read => IoRequest::read(vol, r.offset, buf),
                Dir::Write => IoRequest::write(vol, r.offset, buf),
            };
            (req.with_range(0, r.len as usize), u64::from(r.tag))
        }));
        Ok(())
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoDone>) -> Result<(), String> {
        self.done.clear();
        self.queue.wait(&mut self.done, min, None);
        for c in self.done.drain(..) {
            let tag = c.tag as u32;
            let error = c.result.err().map(|e| e.one_line());
            match c.buffer {
                Some(b) => self.slots[tag as usize] = Some(b),
                None => return Err(format!("slot {tag} came back without its buffer")),
            }
            out.push(IoDone { tag, error });
        }
        if self.session.is_lost() && out.is_empty() {
            return Err("the session to the target is lost".into());
        }
        Ok(())
    }

    fn reconnects(&self) -> u64 {
        self.session.stats().reconnects
    }

    fn is_lost(&self) -> bool {
        self.session.is_lost()
    }
}

/// The blocking engine: requests run one at a time, in submission order,
/// when completions are reaped.
struct SyncEngine {
    buf: IoBuffer,
    slot_size: usize,
    vol: Volume,
    pending: VecDeque<IoReq>,
    session: Session,
}

impl Engine for SyncEngine {
    fn name(&self) -> &'static str {
        EngineKind::Sync.name()
    }

    fn depth(&self) -> usize {
        self.buf.len() / self.slot_size
    }

    fn volume_size(&self) -> u64 {
        self.vol.info().size_bytes
    }

    fn block_size(&self) -> u32 {
        self.vol.info().block_size
    }

    fn buf(&self, tag: u32) -> &[u8] {
        let at = tag as usize * self.slot_size;
        &self.buf.as_slice()[at..at + self.slot_size]
    }

    fn buf_mut(&mut self, tag: u32) -> &mut [u8] {
        let at = tag as usize * self.slot_size;
        &mut self.buf.as_mut_slice()[at..at + self.slot_size]
    }

    fn submit(&mut self, reqs: &[IoReq]) -> Result<(), String> {
        self.pending.extend(reqs.iter().copied());
        Ok(())
    }

    fn reap(&mut self, min: usize, out: &mut Vec<IoDone>) -> Result<(), String> {
        let n = min.max(1).min(self.pending.len());
        for _ in 0..n {
            let r = self.pending.pop_front().expect("counted");
            let at = r.tag as usize * self.slot_size;
            let len = r.len as usize;
            let result = match r.dir {
                Dir::Read => self.vol.read_into(&mut self.buf, at, len, r.offset),
                Dir::Write => self.vol.write_from(&self.buf, at, len, r.offset),
            };
            out.push(IoDone { tag: r.tag, error: result.err().map(|e| e.one_line()) });
        }
        Ok(())
    }

    fn reconnects(&self) -> u64 {
        self.session.stats().reconnects
    }

    fn is_lost(&self) -> bool {
        self.session.is_lost()
    }
}
