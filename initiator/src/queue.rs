//! One I/O queue of a session ([`Queue`]): its current connection and the
//! bounce pool and request splitting on top of it.
//!
//! A session holds one [`Queue`] per I/O queue, each behind its own mutex.
//! A `Queue` outlives its connections: after a reconnection the session
//! installs a new [`Conn`] (of a new *generation*) into it, and the bounce
//! pool, registered with the session's protection domain, stays.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdmablk_common::fabric::{Access, Rkey};
use rdmablk_common::protocol::{
    BlockCount, CommandCapsule, CommandId, DataDescriptor, Lba, Opcode, Status, VolumeId, VolumeInfo, FLAG_FUA, FLAG_INLINE_DATA,
    VOLUME_INFO_SIZE,
};

use crate::buffer::Region;
use crate::conn::{piece_status, retry_reason, status_error, Conn, Outcome, PieceError, Response, Stats};
use crate::device::{max_piece, split, WriteFlags};
use crate::error::{Error, Result};

/// What a volume request needs to build capsules and error messages.
#[derive(Clone, Copy)]
pub(crate) struct VolCtx<'a> {
    /// The volume's id in the connection's session.
    pub(crate) id: VolumeId,
    pub(crate) name: &'a str,
    pub(crate) block_size: u32,
    pub(crate) supports_write_zeroes: bool,
}

/// Where the data of a transfer lives.
pub(crate) enum Data<'a> {
    /// A plain slice: goes through the bounce pool (or inline for small writes).
    ReadSlice(&'a mut [u8]),
    WriteSlice(&'a [u8]),
    /// A registered buffer range the target reaches directly.
    Registered {
        addr: u64,
        rkey: Rkey,
    },
}

/// One I/O queue: its current connection (if any) and its bounce pool.
pub(crate) struct Queue {
    /// The connection of the current generation; `None` while the session
    /// has fewer queue pairs than queues, or after close.
    pub(crate) conn: Option<Conn>,
    bounce: Region,
    chunk: usize,
    chunks: usize,
    stats: Arc<Stats>,
}

/// Most volumes a LIST is allowed to report (bounds the list buffer).
const MAX_VOLUMES: usize = 1 << 20;

/// Largest DISCARD / WRITE_ZEROES piece tried first.
pub(crate) const ZEROES_PIECE: u64 = 1 << 30;

/// Splits relative ranges into pieces of at most `piece` bytes.
fn pieces_of(ranges: &[(u64, u64)], piece: u64) -> Vec<(u64, u64)> {
    ranges.iter().flat_map(|&(rel, len)| split(rel, len, piece)).collect()
}

/// The ranges of `pieces` not marked done.
fn remaining(pieces: &[(u64, u64)], done: &[bool]) -> Vec<(u64, u64)> {
    pieces.iter().zip(done).filter(|(_, &d)| !d).map(|(&p, _)| p).collect()
}

impl Queue {
    pub(crate) fn new(conn: Option<Conn>, bounce: Region, chunk: usize, stats: Arc<Stats>) -> Queue {
        let chunks = bounce.len() / chunk;
        assert!(chunks >= 1);
        Queue { conn, bounce, chunk, chunks, stats }
    }

    fn conn(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("an attempt runs on a queue with a connection")
    }

    /// Reads or writes the parts `ranges` (relative to `offset`) of a
    /// request; the range is already checked. Splits at the max I/O size
    /// and pipelines the pieces. On return `ranges` holds what is not done.
    pub(crate) fn transfer(
        &mut self,
        vol: VolCtx<'_>,
        op: Opcode,
        data: &mut Data<'_>,
        ranges: &mut Vec<(u64, u64)>,
        offset: u64,
        flags: WriteFlags,
    ) -> Outcome {
        let bs = u64::from(vol.block_size);
        let stats = Arc::clone(&self.stats);
        let chunk = self.chunk;
        let Queue { conn, bounce, chunks, .. } = self;
        let conn = conn.as_mut().expect("an attempt runs on a queue with a connection");
        let params = conn.params;
        let piece = match max_piece(u64::from(params.max_io).min(chunk as u64), vol.block_size) {
            Ok(p) => p,
            Err(e) => return Outcome::Failed(e),
        };
        let pieces = pieces_of(ranges, piece);
        let mut done = vec![false; pieces.len()];
        let capsule_for = move |rel: u64, plen: u64| {
            let mut c = CommandCapsule::new(op, CommandId(0));
            c.volume_id = vol.id;
            c.start_block = Lba((offset + rel) / bs);
            c.block_count = BlockCount((plen / bs) as u32);
            if op == Opcode::Write && flags.fua {
                c.flags |= FLAG_FUA;
            }
            c
        };
        let status = |resp: &Response, rel: u64, plen: u64| {
            piece_status(op, &resp.capsule, vol.name, Some(offset + rel), Some(plen), params.failover)
        };
        let timeout = params.io_timeout;
        let outcome = match data {
            Data::Registered { addr, rkey } => {
                let (addr, rkey) = (*addr, *rkey);
                conn.pipeline(
                    pieces.len(),
                    usize::MAX,
                    timeout,
                    |i, _| {
                        let (rel, plen) = pieces[i];
                        let mut c = capsule_for(rel, plen);
                        c.descriptor = DataDescriptor { remote_addr: addr + rel, length: plen as u32, rkey: rkey.0 };
                        Ok((c, &[][..]))
                    },
                    |i, _, resp| {
                        let (rel, plen) = pieces[i];
                        status(resp, rel, plen)?;
                        Stats::add(&stats.zero_copy_bytes, plen);
                        done[i] = true;
                        Ok(())
                    },
                )
            }
            Data::ReadSlice(buf) => {
                let rkey = bounce.rkey();
                let base = bounce.addr();
                let bounce = &*bounce;
                // `issue` only reads the bounce pool's address; `complete`
                // copies out of the chunk of a finished piece.
                conn.pipeline(
                    pieces.len(),
                    *chunks,
                    timeout,
                    |i, lane| {
                        let (rel, plen) = pieces[i];
                        let mut c = capsule_for(rel, plen);
                        c.descriptor = DataDescriptor {
                            remote_addr: base + (lane * chunk) as u64,
                            length: plen as u32,
                            rkey: rkey.0,
                        };
                        Ok((c, &[][..]))
                    },
                    |i, lane, resp| {
                        let (rel, plen) = pieces[i];
                        status(resp, rel, plen)?;
                        let (rel, plen) = (rel as usize, plen as usize);
                        // The piece's command is finished: the target no longer writes this chunk.
                        buf[rel..rel + plen].copy_from_slice(bounce.bytes(lane * chunk..lane * chunk + plen));
                        Stats::add(&stats.bounce_copies, 1);
                        Stats::add(&stats.bounce_bytes, plen as u64);
                        done[i] = true;
                        Ok(())
                    },
                )
            }
            Data::WriteSlice(buf) => {
                let buf: &[u8] = buf;
                let rkey = bounce.rkey();
                let base = bounce.addr();
                let inline_limit = params.inline_limit;
                conn.pipeline(
                    pieces.len(),
                    *chunks,
                    timeout,
                    |i, lane| {
                        let (rel, plen) = pieces[i];
                        let mut c = capsule_for(rel, plen);
                        let src = &buf[rel as usize..(rel + plen) as usize];
                        if src.len() <= inline_limit {
                            c.flags |= FLAG_INLINE_DATA;
                            c.inline_len = src.len() as u32;
                            Stats::add(&stats.inline_writes, 1);
                            Stats::add(&stats.inline_bytes, plen);
                            return Ok((c, src));
                        }
                        // The lane's chunk is not named by any outstanding command.
                        bounce.bytes_mut(lane * chunk..lane * chunk + src.len()).copy_from_slice(src);
                        Stats::add(&stats.bounce_copies, 1);
                        Stats::add(&stats.bounce_bytes, plen);
                        c.descriptor = DataDescriptor {
                            remote_addr: base + (lane * chunk) as u64,
                            length: plen as u32,
                            rkey: rkey.0,
                        };
                        Ok((c, &[][..]))
                    },
                    |i, _, resp| {
                        let (rel, plen) = pieces[i];
                        status(resp, rel, plen)?;
                        done[i] = true;
                        Ok(())
                    },
                )
            }
        };
        *ranges = remaining(&pieces, &done);
        outcome
    }

    /// DISCARD or WRITE_ZEROES over the parts `ranges` (relative to
    /// `offset`) of a checked request. `small` is the session's note that
    /// the target takes these only up to the max I/O size; `zero` a
    /// registered all-zero region for emulating WRITE_ZEROES.
    pub(crate) fn zeroes(
        &mut self,
        vol: VolCtx<'_>,
        op: Opcode,
        ranges: &mut Vec<(u64, u64)>,
        offset: u64,
        zero: &Region,
        small: &AtomicBool,
    ) -> Outcome {
        if op == Opcode::WriteZeroes && !vol.supports_write_zeroes {
            return self.emulate_write_zeroes(vol, ranges, offset, zero);
        }
        let conn = self.conn();
        let max_io = u64::from(conn.params.max_io);
        let failover = conn.params.failover;
        loop {
            let was_small = small.load(Ordering::Relaxed);
            let limit = if was_small { max_io } else { ZEROES_PIECE };
            let piece = match max_piece(limit, vol.block_size) {
                Ok(p) => p,
                Err(e) => return Outcome::Failed(e),
            };
            let bs = u64::from(vol.block_size);
            let pieces = pieces_of(ranges, piece);
            let mut done = vec![false; pieces.len()];
            let mut too_large = false;
            let outcome = conn.pipeline(
                pieces.len(),
                usize::MAX,
                conn.params.io_timeout,
                |i, _| {
                    let (rel, plen) = pieces[i];
                    let mut c = CommandCapsule::new(op, CommandId(0));
                    c.volume_id = vol.id;
                    c.start_block = Lba((offset + rel) / bs);
                    c.block_count = BlockCount((plen / bs) as u32);
                    Ok((c, &[][..]))
                },
                |i, _, resp| {
                    let (rel, plen) = pieces[i];
                    if resp.capsule.status == Status::TooLarge && plen > max_io {
                        too_large = true;
                    }
                    piece_status(op, &resp.capsule, vol.name, Some(offset + rel), Some(plen), failover)?;
                    done[i] = true;
                    Ok(())
                },
            );
            *ranges = remaining(&pieces, &done);
            match outcome {
                Outcome::Failed(_) if too_large && !was_small => {
                    // Idempotent: redo what is left in max-I/O-size pieces.
                    small.store(true, Ordering::Relaxed);
                }
                other => return other,
            }
        }
    }

    /// WRITE_ZEROES for volumes that do not offer it: writes zeroes from
    /// the session's registered zero region, which nothing ever writes.
    fn emulate_write_zeroes(
        &mut self,
        vol: VolCtx<'_>,
        ranges: &mut Vec<(u64, u64)>,
        offset: u64,
        zero: &Region,
    ) -> Outcome {
        let conn = self.conn();
        let failover = conn.params.failover;
        let bs = u64::from(vol.block_size);
        let piece = match max_piece(u64::from(conn.params.max_io).min(zero.len() as u64), vol.block_size) {
            Ok(p) => p,
            Err(e) => return Outcome::Failed(e),
        };
        let pieces = pieces_of(ranges, piece);
        let mut done = vec![false; pieces.len()];
        let (base, rkey) = (zero.addr(), zero.rkey());
        let outcome = conn.pipeline(
            pieces.len(),
            usize::MAX,
            conn.params.io_timeout,
            |i, _| {
                let (rel, plen) = pieces[i];
                let mut c = CommandCapsule::new(Opcode::Write, CommandId(0));
                c.volume_id = vol.id;
                c.start_block = Lba((offset + rel) / bs);
                c.block_count = BlockCount((plen / bs) as u32);
                c.descriptor = DataDescriptor { remote_addr: base, length: plen as u32, rkey: rkey.0 };
                Ok((c, &[][..]))
            },
            |i, _, resp| {
                let (rel, plen) = pieces[i];
                piece_status(Opcode::WriteZeroes, &resp.capsule, vol.name, Some(offset + rel), Some(plen), failover)?;
                done[i] = true;
                Ok(())
            },
        );
        *ranges = remaining(&pieces, &done);
        outcome
    }

    /// A command without data (FLUSH, KEEP_ALIVE, OPEN, CLOSE...); returns
    /// its response whatever the status, except that `ShuttingDown` (and
    /// `NotOwner` on a session with other gateways) retries.
    pub(crate) fn simple(&mut self, capsule: &CommandCapsule, inline: &[u8]) -> Outcome<Response> {
        let conn = self.conn();
        let mut out = None;
        let (timeout, failover) = (conn.params.io_timeout, conn.params.failover);
        // OPEN names its volume inline.
        let volume = (capsule.opcode == Opcode::OpenVolume).then(|| String::from_utf8_lossy(inline));
        let outcome = conn.pipeline(
            1,
            1,
            timeout,
            |_, _| Ok((*capsule, inline)),
            |_, _, resp| {
                if let Some(reason) = retry_reason(capsule.opcode, &resp.capsule, volume.as_deref(), failover) {
                    return Err(PieceError::Retry(reason));
                }
                out = Some(resp.clone());
                Ok(())
            },
        );
        match outcome {
            Outcome::Done(()) => Outcome::Done(out.expect("a finished command has a response")),
            Outcome::Failed(e) => Outcome::Failed(e),
            Outcome::Broken => Outcome::Broken,
            Outcome::Busy => Outcome::Busy,
        }
    }

    /// OPEN_VOLUME; `UnknownVolume` becomes [`Error::UnknownVolume`].
    pub(crate) fn open_volume(&mut self, name: &str) -> Outcome<VolumeInfo> {
        let mut c = CommandCapsule::new(Opcode::OpenVolume, CommandId(0));
        c.inline_len = name.len() as u32;
        let resp = match self.simple(&c, name.as_bytes()) {
            Outcome::Done(r) => r,
            other => return other.map(|_| unreachable!()),
        };
        match resp.capsule.status {
            Status::Success => {}
            Status::UnknownVolume => return Outcome::Failed(Error::UnknownVolume { name: name.to_owned() }),
            _ => return Outcome::Failed(status_error(Opcode::OpenVolume, &resp.capsule, Some(name), None, None)),
        }
        match VolumeInfo::decode(resp.data()) {
            Ok(info) => Outcome::Done(info),
            Err(e) => {
                let e = Error::protocol(format!("the target's OPEN reply for {name:?} is invalid: {e}"));
                self.conn().fail(e.to_string());
                Outcome::Failed(e)
            }
        }
    }

    /// LIST_VOLUMES into the bounce pool (or a bigger temporary region when
    /// the target has more volumes than fit).
    pub(crate) fn list_volumes(&mut self) -> Outcome<Vec<VolumeInfo>> {
        let mut want = 0usize;
        for _attempt in 0..4 {
            let max_io = self.conn().params.max_io as usize;
            let pool_entries = (self.chunks * self.chunk) / VOLUME_INFO_SIZE;
            let max_entries = (max_io / VOLUME_INFO_SIZE).max(1);
            let temp;
            let (region, entries): (&Region, usize) = if want <= pool_entries.min(max_entries) {
                (&self.bounce, pool_entries.min(max_entries))
            } else {
                let entries = want;
                let domain = self.conn().domain();
                let access = domain.access_for(Access::REMOTE_WRITE);
                temp = match Region::new(domain.pd(), entries * VOLUME_INFO_SIZE, access) {
                    Ok(r) => r,
                    Err(e) => return Outcome::Failed(Error::fabric("registering a buffer for the volume list", e)),
                };
                (&temp, entries)
            };
            let bytes = entries * VOLUME_INFO_SIZE;
            let mut c = CommandCapsule::new(Opcode::ListVolumes, CommandId(0));
            c.descriptor = DataDescriptor { remote_addr: region.addr(), length: bytes as u32, rkey: region.rkey().0 };
            let conn = self.conn.as_mut().expect("an attempt runs on a queue with a connection");
            let mut resp = None;
            let (timeout, failover) = (conn.params.io_timeout, conn.params.failover);
            let outcome = conn.pipeline(
                1,
                1,
                timeout,
                |_, _| Ok((c, &[][..])),
                |_, _, r| {
                    if let Some(reason) = retry_reason(Opcode::ListVolumes, &r.capsule, None, failover) {
                        return Err(PieceError::Retry(reason));
                    }
                    resp = Some(r.clone());
                    Ok(())
                },
            );
            let resp = match outcome {
                Outcome::Done(()) => resp.expect("a finished command has a response"),
                other => return other.map(|()| unreachable!()),
            };
            if resp.capsule.status != Status::Success {
                return Outcome::Failed(status_error(Opcode::ListVolumes, &resp.capsule, None, None, None));
            }
            let Ok(total) = usize::try_from(resp.capsule.result) else {
                return Outcome::Failed(Error::protocol(format!("the target reports {} volumes", resp.capsule.result)));
            };
            if total > entries {
                if total > MAX_VOLUMES {
                    return Outcome::Failed(Error::protocol(format!(
                        "the target reports {total} volumes, more than this initiator lists"
                    )));
                }
                want = total;
                continue;
            }
            // The command is finished: the target no longer writes the region.
            let raw = region.bytes(0..total * VOLUME_INFO_SIZE);
            let list: Result<Vec<VolumeInfo>> = raw
                .chunks_exact(VOLUME_INFO_SIZE)
                .enumerate()
                .map(|(i, b)| {
                    VolumeInfo::decode(b).map_err(|e| Error::protocol(format!("volume list entry {i} is invalid: {e}")))
                })
                .collect();
            return match list {
                Ok(l) => Outcome::Done(l),
                Err(e) => Outcome::Failed(e),
            };
        }
        Outcome::Failed(Error::protocol("the volume list kept growing while it was read; gave up after 4 attempts"))
    }
}
