//! A reactor's commands on its block engine (`crate::engine`): the command
//! slab and its pool chunks (waits, shares, accounting), the disk
//! operations it asks the engine for and their completions, readahead, the
//! volume snapshot, per-volume counters. Nothing here reads or writes the
//! rdmablk v1 wire.

use super::*;

impl Reactor {
    /// Picks up a newly published volume set, if there is one.
    #[inline]
    pub(super) fn maybe_refresh(&mut self) {
        if self.registry.generation() != self.vols.generation {
            self.refresh_volumes();
        }
    }

    /// Applies the published volume set: new volumes get a fixed-file slot,
    /// reopened ones get their new descriptor in the same slot, removed ones
    /// retire and free their slot after their last command.
    pub(super) fn refresh_volumes(&mut self) {
        let set = self.registry.volumes();
        let mut seen = vec![false; self.vols.slots.len()];
        let mut by_index = Vec::with_capacity(set.volumes.len());
        for v in &set.volumes {
            let existing = self.vols.slots.iter().position(|s| s.as_ref().is_some_and(|lv| lv.vol.id == v.id));
            let slot = match existing {
                Some(slot) => {
                    let lv = self.vols.slots[slot].as_mut().expect("live slot");
                    if !Arc::ptr_eq(&lv.vol, v) || lv.retiring {
                        // Reloaded: what was read ahead may be of another file.
                        self.readahead.drop_volume(slot as u16);
                    }
                    let same_backend = Arc::ptr_eq(&lv.vol.backend, &v.backend);
                    lv.vol = Arc::clone(v);
                    lv.retiring = false;
                    if !same_backend {
                        let broken = self.attach_fails(v);
                        self.vols.slots[slot].as_mut().expect("live slot").broken = broken;
                    }
                    slot
                }
                None => match self.vols.slots.iter().position(Option::is_none) {
                    None => {
                        tracing::error!("reactor {}: volume {}: no free fixed-file slot; its commands will fail", self.id, v.name);
                        by_index.push(NONE16);
                        continue;
                    }
                    Some(slot) => {
                        let broken = self.attach_fails(v);
                        self.vols.slots[slot] = Some(LocalVolume { vol: Arc::clone(v), broken, inflight: 0, retiring: false });
                        slot
                    }
                },
            };
            seen[slot] = true;
            by_index.push(slot as u16);
        }
        for (slot, lv) in self.vols.slots.iter_mut().enumerate() {
            if let Some(lv) = lv {
                if !seen[slot] && !lv.retiring {
                    tracing::debug!("reactor {}: volume {} retiring ({} commands in flight)", self.id, lv.vol.name, lv.inflight);
                    lv.retiring = true;
                    self.readahead.drop_volume(slot as u16);
                }
            }
        }
        self.release_readahead();
        self.vols.generation = set.generation;
        self.vols.set = set;
        self.vols.by_index = by_index;
        for slot in 0..self.vols.slots.len() {
            self.maybe_release_volume(slot as u16);
        }
    }

    /// Gives the engine `v`'s descriptor now (a new volume, or a new
    /// backend after a reload), so that a failure shows before its first
    /// command: whether it failed (its commands then fail InternalError).
    fn attach_fails(&mut self, v: &Volume) -> bool {
        match self.engine.attach(v) {
            Ok(()) => false,
            Err(e) => {
                tracing::error!("reactor {}: volume {}: {e}", self.id, v.name);
                true
            }
        }
    }

    /// Frees a retired volume's slot once nothing of this reactor uses it.
    pub(super) fn maybe_release_volume(&mut self, slot: u16) {
        let Some(lv) = self.vols.slots[slot as usize].as_ref() else { return };
        if !lv.retiring || lv.inflight > 0 {
            return;
        }
        // Nothing to give back for a volume without a descriptor, or one
        // whose attach failed: the engine holds no file for it.
        if let Err(e) = self.engine.detach(lv.vol.id) {
            tracing::error!("reactor {}: volume {}: {e}", self.id, lv.vol.name);
        }
        tracing::debug!("reactor {}: volume {} released", self.id, lv.vol.name);
        self.vols.slots[slot as usize] = None;
    }

    pub(super) fn volume(&self, slot: u16) -> &Arc<Volume> {
        &self.vols.slots[slot as usize].as_ref().expect("live volume slot").vol
    }

    /// After an engine call that may have started the blocking worker:
    /// its results wake this reactor's epoll set.
    pub(super) fn watch_worker(&mut self) {
        if let Some(fd) = self.engine.started_worker_fd() {
            if let Err(e) = self.epoll.add(fd, TOKEN_BLOCKING) {
                tracing::error!("reactor {}: epoll_ctl: {e}", self.id);
            }
        }
    }

    /// Fails command `ci` whose disk operation could not be queued (the
    /// blocking worker did not start, a fixed file could not be set).
    pub(super) fn engine_refused(&mut self, ci: u16, e: &Error) {
        tracing::error!("reactor {}: {e}", self.id);
        self.cmd(ci).error.get_or_insert(ErrorKind::Internal);
        self.progress(ci);
    }

    /// Queues a command's one disk operation without a chunk (a flush, a
    /// range), tagged `kind`: `op` gets the engine, the volume and the tag.
    pub(super) fn submit_disk(&mut self, ci: u16, kind: u64, op: impl FnOnce(&mut BlockEngine, &Volume, u64) -> Result<()>) {
        let vol = Arc::clone(self.volume(self.cmds[ci as usize].as_ref().expect("live command").vslot));
        match op(&mut self.engine, &vol, ud(kind, ci, NONE16)) {
            Ok(()) => {
                self.watch_worker();
                let cmd = self.cmd(ci);
                cmd.inflight += 1;
                cmd.at_disk = true;
            }
            Err(e) => self.engine_refused(ci, &e),
        }
    }

    /// Reports every finished disk operation (ring, blocking worker, and
    /// those that needed no disk) to `on_disk_done`.
    pub(super) fn reap_engine(&mut self) -> usize {
        // The ring's eventfd (sleeping in epoll; sleeping in the ring there
        // is none) is cleared in `idle_wait` when it fired, not here:
        // reading it every turn cost a syscall per turn.
        let mut done = std::mem::take(&mut self.uring_done);
        let n = self.engine.reap(|u, r| done.push((u, r)));
        for &(u, r) in &done {
            self.on_disk_done(u, r);
        }
        done.clear();
        self.uring_done = done;
        n
    }

    pub(super) fn on_disk_done(&mut self, user_data: u64, res: i32) {
        let (kind, ci, c) = split_ud(user_data);
        if kind == U_READAHEAD {
            return self.readahead_done(ci, ChunkId(c), res);
        }
        let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|x| x.as_mut()) else {
            tracing::error!("io_uring completion for a free command slot {ci}");
            return;
        };
        cmd.inflight -= 1;
        let si = cmd.sess;
        let closing = self.sessions[si as usize].s.as_ref().is_none_or(|s| s.closing.is_some() || s.res.is_none());
        if res < 0 {
            let errno = -res;
            let unsupported = matches!(kind, U_FALLOC | U_BLKDEV) && matches!(errno, libc::EOPNOTSUPP | libc::ENOTTY);
            let err = if unsupported { ErrorKind::NotSupported } else { ErrorKind::DeviceIo(errno) };
            let what = match kind {
                U_READ => "read",
                U_WRITE => "write",
                U_FSYNC => "fdatasync",
                U_BLKDEV => "BLKDISCARD/BLKZEROOUT",
                _ => "fallocate",
            };
            let vslot = cmd.vslot;
            let vol = &self.vols.slots[vslot as usize].as_ref().expect("live volume slot").vol.name;
            let cmd = self.cmds[ci as usize].as_mut().expect("live command");
            if err == ErrorKind::NotSupported {
                tracing::debug!("volume {vol}: {what} not supported");
            } else {
                tracing::warn!("volume {vol}: {what} failed: {}", std::io::Error::from_raw_os_error(errno));
            }
            cmd.error.get_or_insert(err);
            if kind == U_READ || kind == U_WRITE {
                self.engine.pool_mut().release(ChunkId(c));
            }
            self.progress(ci);
            return;
        }
        match kind {
            U_READ => {
                let chunk = ChunkId(c);
                if closing || cmd.error.is_some() {
                    self.engine.pool_mut().release(chunk);
                    self.progress(ci);
                    return;
                }
                self.read_chunk_done(si, ci, chunk);
                self.progress(ci);
            }
            U_WRITE => {
                self.engine.pool_mut().release(ChunkId(c));
                cmd.done += self.chunk_use[c as usize].len;
                self.progress(ci);
            }
            // The held write was at the disk all along: it lands now,
            // whatever became of its session meanwhile.
            U_HOLD => {
                cmd.inflight += 1;
                self.submit_write(ci, ChunkId(c));
            }
            _ => self.progress(ci),
        }
    }

    // ---------------------------------------------------------------- commands

    pub(super) fn cmd(&mut self, ci: u16) -> &mut Cmd {
        self.cmds[ci as usize].as_mut().expect("live command")
    }

    pub(super) fn new_cmd(&mut self, si: u16, cid: CommandId, kind: CmdKind, start: Instant) -> Option<u16> {
        let ci = match self.free_cmds.pop() {
            Some(ci) => ci,
            None if self.cmds.len() < NONE16 as usize => {
                self.cmds.push(None);
                (self.cmds.len() - 1) as u16
            }
            None => {
                tracing::warn!("reactor {}: command slab full", self.id);
                self.send_queue_full(si, cid);
                return None;
            }
        };
        self.cmds[ci as usize] = Some(Cmd {
            sess: si,
            cid,
            kind,
            vslot: NONE16,
            op: NO_OP,
            start,
            null: false,
            offset: 0,
            len: 0,
            falloc_len: 0,
            remote: DataDescriptor::default(),
            fua: false,
            next: 0,
            done: 0,
            inflight: 0,
            error: None,
            held_recv: None,
            at_disk: false,
            in_waitq: false,
            waiting_since: start,
            responded: false,
            write_epoch_open: false,
            answer_waits: false,
            send_inflight: false,
            result: 0,
            list_entries: 0,
        });
        let s = self.session(si);
        s.state.outstanding += 1;
        s.live_cmds += 1;
        Some(ci)
    }

    pub(super) fn wants_chunk(&self, ci: u16) -> bool {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return false };
        if cmd.error.is_some() || cmd.responded || self.session_closing(cmd.sess) {
            return false;
        }
        match cmd.kind {
            CmdKind::Read | CmdKind::Write => cmd.next < cmd.len && cmd.inflight < CHUNK_WINDOW,
            CmdKind::WriteInline | CmdKind::List => cmd.next == 0,
            _ => false,
        }
    }

    /// The pool accounts a command's chunks are charged to on this reactor
    /// (its session's and its host's, the peer's source address), and
    /// whether either holds its whole share already (`session_pool_share`,
    /// `host_pool_share`).
    pub(super) fn pool_accounts(&self, ci: u16) -> ([Option<Arc<crate::pool::PoolAccount>>; 2], bool) {
        let si = self.cmds[ci as usize].as_ref().expect("live command").sess;
        let Some(s) = self.sessions[si as usize].s.as_ref() else { return ([None, None], false) };
        let session = s.shared.as_ref().and_then(|sh| sh.pool_account(self.id));
        let host = s._connection.host_pool_account(self.id);
        let at_share = session.is_some_and(|a| a.held() >= self.pool_share) || host.is_some_and(|a| a.held() >= self.host_pool_share);
        ([session.cloned(), host.cloned()], at_share)
    }

    /// Issues chunks for a command while it wants them, the pool has them
    /// and its session and host are under their shares; otherwise queues it
    /// (FIFO) for the next free chunk.
    pub(super) fn pump(&mut self, ci: u16) {
        while self.wants_chunk(ci) {
            let first_in_line = self.waitq.is_empty() || self.waitq.front() == Some(&ci);
            let (accounts, at_share) = self.pool_accounts(ci);
            if !first_in_line || at_share || !self.chunk_for_command() {
                if !self.cmd(ci).in_waitq {
                    self.wait_for_chunk(ci, Instant::now());
                }
                return;
            }
            if self.waitq.front() == Some(&ci) {
                self.waitq.pop_front();
                self.cmd(ci).in_waitq = false;
            }
            let [session, host] = &accounts;
            let c = self.engine.pool_mut().alloc_charged([session.as_ref(), host.as_ref()]).expect("free chunk");
            self.issue(ci, c);
        }
    }

    /// Hands free chunks to waiting commands in order. A command whose
    /// session or host holds its whole share goes to the back of the line,
    /// so it never holds up other sessions' or hosts' commands behind it.
    pub(super) fn pump_waitq(&mut self) {
        if self.waitq.is_empty() || !self.chunk_for_command() {
            return;
        }
        let now = Instant::now();
        let mut passed_over = 0;
        while passed_over < self.waitq.len() && self.chunk_for_command() {
            let Some(ci) = self.waitq.pop_front() else { break };
            let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()) else { continue };
            cmd.in_waitq = false;
            if !self.wants_chunk(ci) {
                continue;
            }
            let (accounts, at_share) = self.pool_accounts(ci);
            if at_share {
                let since = self.cmd(ci).waiting_since;
                self.wait_for_chunk(ci, since);
                passed_over += 1;
                continue;
            }
            passed_over = 0;
            let [session, host] = &accounts;
            let c = self.engine.pool_mut().alloc_charged([session.as_ref(), host.as_ref()]).expect("free chunk");
            self.issue(ci, c);
            if self.cmds[ci as usize].is_some() && self.wants_chunk(ci) {
                // It got a chunk: its wait for the next starts now.
                self.wait_for_chunk(ci, now);
            }
        }
    }

    /// Puts a command at the back of the line for a chunk, waiting since `since`.
    pub(super) fn wait_for_chunk(&mut self, ci: u16, since: Instant) {
        let was_empty = self.waitq.is_empty();
        let cmd = self.cmd(ci);
        cmd.in_waitq = true;
        cmd.waiting_since = since;
        self.waitq.push_back(ci);
        self.waitq_oldest = match self.waitq_oldest {
            Some(oldest) if !was_empty => Some(oldest.min(since)),
            _ => Some(since),
        };
    }

    /// When the next sweep for commands past `target.chunk_wait_timeout`
    /// is due, if any command waits for a chunk.
    pub(super) fn chunk_wait_due(&self) -> Option<Instant> {
        if self.waitq.is_empty() {
            return None;
        }
        self.waitq_oldest.map(|oldest| (oldest + self.chunk_wait_timeout).max(self.chunk_sweep_after))
    }

    /// Gives up every command that has waited for a chunk longer than
    /// `target.chunk_wait_timeout` (since it queued, or since its last
    /// chunk): it is answered `OutOfBuffers`, once, after the chunks it
    /// has in flight have finished (`progress`, as any failed command).
    /// The pool cannot serve it in time: its session's or host's chunks
    /// do not come back (a peer that stopped reading), or others hold the
    /// whole pool.
    pub(super) fn expire_chunk_waits(&mut self, now: Instant) {
        if self.chunk_wait_due().is_none_or(|due| now < due) {
            return;
        }
        let timeout = self.chunk_wait_timeout;
        let mut q = std::mem::take(&mut self.waitq);
        let mut expired = std::mem::take(&mut self.chunk_expired);
        let mut oldest: Option<Instant> = None;
        q.retain(|&ci| {
            // One that no longer wants a chunk (failed, answered, its queue
            // pair closing) waits for no deadline; `pump_waitq` drops it.
            let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()).filter(|_| self.wants_chunk(ci)) else {
                return true;
            };
            if now.saturating_duration_since(cmd.waiting_since) >= timeout {
                expired.push(ci);
                return false;
            }
            oldest = Some(oldest.map_or(cmd.waiting_since, |o| o.min(cmd.waiting_since)));
            true
        });
        self.waitq = q;
        self.waitq_oldest = oldest;
        self.chunk_sweep_after = now + CHUNK_SWEEP_INTERVAL;
        let Some(&first) = expired.first() else {
            self.chunk_expired = expired;
            return;
        };
        let (si, cid, kind, since) = {
            let cmd = self.cmds[first as usize].as_ref().expect("live command");
            (cmd.sess, cmd.cid, cmd.kind, cmd.waiting_since)
        };
        let s = self.sessions[si as usize].s.as_ref().expect("live session");
        tracing::warn!(
            "reactor {}: {} commands waited more than {timeout:?} for a pool chunk (target.chunk_wait_timeout) and are answered OutOfBuffers; {} of {} chunks in use, {} commands still waiting; the first: command {} ({kind:?}, waited {:?}) of host={} peer={}",
            self.id,
            expired.len(),
            self.engine.pool_mut().capacity() - self.engine.pool_mut().free_count(),
            self.engine.pool_mut().capacity(),
            self.waitq.len(),
            cid.0,
            now.saturating_duration_since(since),
            s.host(),
            s.peer
        );
        self.stats.chunk_wait_timeouts.add(expired.len() as u64);
        for &ci in &expired {
            let cmd = self.cmd(ci);
            cmd.in_waitq = false;
            let waited = now.saturating_duration_since(cmd.waiting_since).as_millis().min(u32::MAX as u128) as u32;
            cmd.error.get_or_insert(ErrorKind::OutOfBuffers(waited));
            self.progress(ci);
        }
        expired.clear();
        self.chunk_expired = expired;
    }

    pub(super) fn issue(&mut self, ci: u16, c: ChunkId) {
        let chunk_size = self.engine.pool_mut().chunk_size() as u32;
        let cmd = self.cmd(ci);
        let si = cmd.sess;
        match cmd.kind {
            CmdKind::Read | CmdKind::Write => {
                let off = cmd.next;
                let len = chunk_size.min(cmd.len - off);
                cmd.next += len;
                let (kind, null) = (cmd.kind, cmd.null);
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off, len, zero: null && kind == CmdKind::Read };
                if kind == CmdKind::Read && null {
                    // Zeroes, sent from the zero chunk; the chunk only
                    // accounts for the work request (back-pressure, SQ room).
                    self.read_chunk_done(si, ci, c);
                } else if kind == CmdKind::Read {
                    self.read_piece(ci, c);
                } else {
                    // Counted in flight once posted.
                    self.post_rdma(si, ci, c, true);
                }
            }
            CmdKind::WriteInline => {
                let len = cmd.len;
                let slot = cmd.held_recv.take().expect("inline data held");
                cmd.next = len;
                cmd.inflight += 1;
                // wants_chunk() made sure the session is live.
                let res = self.sessions[si as usize].s.as_ref().and_then(|s| s.res.as_ref()).expect("live queue pair");
                let src = &res.recv.slot(slot as usize)[COMMAND_CAPSULE_SIZE..COMMAND_CAPSULE_SIZE + len as usize];
                self.engine.pool_mut().bytes_mut(c)[..len as usize].copy_from_slice(src);
                self.repost_recv(si, slot);
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off: 0, len, zero: false };
                self.write_chunk(ci, c);
            }
            CmdKind::List => {
                let entries = cmd.list_entries as usize;
                cmd.next = 1;
                let buf = self.engine.pool_mut().bytes_mut(c);
                let who = self.sessions[si as usize].s.as_ref().map(|s| s.state.identity());
                let visible = who.into_iter().flat_map(|who| self.vols.set.table.visible_to(who));
                for (i, (m, grant)) in visible.take(entries).enumerate() {
                    match m.info_for(grant).to_bytes() {
                        Ok(b) => buf[i * VOLUME_INFO_SIZE..(i + 1) * VOLUME_INFO_SIZE].copy_from_slice(&b),
                        Err(e) => tracing::error!("cannot encode volume info: {e}"),
                    }
                }
                self.chunk_use[c.0 as usize] = ChunkUse { cmd: ci, off: 0, len: (entries * VOLUME_INFO_SIZE) as u32, zero: false };
                self.respond(ci, &[], Some(c));
            }
            _ => {
                self.engine.pool_mut().release(c);
            }
        }
    }

    /// Writes a chunk of a WRITE command to the disk (through the ring),
    /// unless fault injection holds its session's writes (test-only). The
    /// caller has counted the write in flight.
    pub(super) fn write_chunk(&mut self, ci: u16, c: ChunkId) {
        self.cmd(ci).at_disk = true;
        if crate::fault::enabled() {
            let (si, vslot) = (self.cmd(ci).sess, self.cmd(ci).vslot);
            let session = self.sessions[si as usize].s.as_ref().and_then(|s| s.shared.as_ref()).map(|sh| sh.id);
            if let Some(session) = session.filter(|&id| crate::fault::holds(id)) {
                let vol = Arc::clone(self.volume(vslot));
                match self.engine.hold_write(&vol, session, ud(U_HOLD, ci, c.0)) {
                    Ok(()) => return self.watch_worker(),
                    Err(e) => tracing::error!("reactor {}: cannot hold a write: {e}", self.id),
                }
            }
        }
        self.submit_write(ci, c);
    }

    /// Queues a chunk's disk write (counted in flight by the caller).
    pub(super) fn submit_write(&mut self, ci: u16, c: ChunkId) {
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let (offset, fua) = (cmd.offset + use_.off as u64, cmd.fua);
        let vol = Arc::clone(self.volume(cmd.vslot));
        if let Err(e) = self.engine.write(&vol, c, use_.len, offset, fua, ud(U_WRITE, ci, c.0)) {
            self.engine.pool_mut().release(c);
            self.cmd(ci).inflight -= 1;
            self.engine_refused(ci, &e);
        }
    }

    /// Decides what a command does next after one of its operations finished.
    pub(super) fn progress(&mut self, ci: u16) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return };
        let si = cmd.sess;
        // An answer waiting for a response slot is decided already: a late
        // completion of the same command (an earlier chunk's RDMA WRITE
        // failing) must not answer it a second time.
        if cmd.responded || cmd.answer_waits || self.session_closing(si) {
            self.maybe_free_cmd(ci);
            return;
        }
        if cmd.error.is_some() {
            if cmd.inflight == 0 {
                if cmd.in_waitq {
                    self.waitq.retain(|&x| x != ci);
                    self.cmd(ci).in_waitq = false;
                }
                if let Some(slot) = self.cmd(ci).held_recv.take() {
                    self.repost_recv(si, slot);
                }
                self.respond(ci, &[], None);
            }
            return;
        }
        match cmd.kind {
            CmdKind::Write | CmdKind::WriteInline if cmd.done == cmd.len && cmd.inflight == 0 => self.respond(ci, &[], None),
            CmdKind::Flush | CmdKind::Range if cmd.inflight == 0 => self.respond(ci, &[], None),
            _ => self.pump(ci),
        }
    }

    pub(super) fn maybe_free_cmd(&mut self, ci: u16) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return };
        let si = cmd.sess;
        let closing = self.session_closing(si);
        if cmd.inflight > 0 || cmd.send_inflight || !(cmd.responded || closing) {
            return;
        }
        self.end_write(ci);
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if cmd.in_waitq {
            self.waitq.retain(|&x| x != ci);
        }
        let (vslot, dropped, responded) = (cmd.vslot, !cmd.responded && !cmd.at_disk, cmd.responded);
        self.cmds[ci as usize] = None;
        self.free_cmds.push(ci);
        if dropped {
            if let Some(sh) = self.sessions[si as usize].s.as_ref().and_then(|s| s.shared.as_ref()) {
                sh.count_dropped(1);
            }
        }
        if vslot != NONE16 {
            if let Some(lv) = self.vols.slots[vslot as usize].as_mut() {
                lv.inflight -= 1;
                if lv.retiring && lv.inflight == 0 {
                    self.maybe_release_volume(vslot);
                }
            }
        }
        if let Some(s) = self.sessions[si as usize].s.as_mut() {
            if !responded {
                s.state.outstanding -= 1;
            }
            s.live_cmds -= 1;
        }
        self.maybe_free_session(si);
    }

    /// Counts a finished I/O command in its volume's metrics (once).
    pub(super) fn record_io(&mut self, ci: u16, ok: bool) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if cmd.op == NO_OP || cmd.vslot == NONE16 || cmd.responded || cmd.answer_waits {
            return;
        }
        let bytes = match cmd.kind {
            CmdKind::Read | CmdKind::Write | CmdKind::WriteInline => cmd.len as u64,
            CmdKind::Range => cmd.falloc_len,
            _ => 0,
        };
        let (op, latency) = (cmd.op as usize, cmd.start.elapsed());
        self.volume(cmd.vslot).stats.reactor(self.id).ops[op].record(bytes, ok, latency);
    }

    /// Counts a READ of a file volume in its stream and, once the stream
    /// is sequential, reads chunks ahead of it: never a chunk a command
    /// waits for, and never the last quarter of the pool.
    pub(super) fn read_ahead(&mut self, vslot: u16, offset: u64, len: u32) {
        if !self.readahead.on_read(vslot, offset, len) {
            return;
        }
        let lv = self.vols.slots[vslot as usize].as_ref().expect("live volume slot");
        // Readahead serves file volumes only: they all have a descriptor.
        if lv.broken || lv.retiring {
            return;
        }
        let size = lv.vol.size;
        while self.waitq.is_empty() && self.engine.pool().free_count() > self.engine.pool().capacity() / 4 {
            let Some((at, n)) = self.readahead.want(vslot, size) else { break };
            let c = self.engine.pool_mut().alloc().expect("free chunk");
            // Taken before the read is submitted: a write that starts
            // later moves it.
            let epoch = self.volume(vslot).writes.of(at, n);
            self.readahead.issued(vslot, at, n, c, epoch);
            // The read holds the volume's slot (its fixed file) until it completes.
            self.vols.slots[vslot as usize].as_mut().expect("live volume slot").inflight += 1;
            let vol = Arc::clone(self.volume(vslot));
            if let Err(e) = self.engine.read(&vol, c, n, at, ud(U_READAHEAD, vslot, c.0)) {
                tracing::debug!("reactor {}: no read ahead: {e}", self.id);
                self.readahead_done(vslot, c, -libc::EIO);
                break;
            }
        }
    }

    /// Reads a READ command's piece (`chunk_use[c]`) into its chunk `c`:
    /// from chunks read ahead when they hold it (waiting for their read if
    /// it is in flight), else from the disk.
    pub(super) fn read_piece(&mut self, ci: u16, c: ChunkId) {
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let (si, vslot, offset) = (cmd.sess, cmd.vslot, cmd.offset + use_.off as u64);
        let writes = &self.vols.slots[vslot as usize].as_ref().expect("live volume slot").vol.writes;
        let serve = self.readahead.lookup(vslot, offset, use_.len, c, |at, n| writes.of(at, n));
        match serve {
            Serve::Miss | Serve::Wait => {
                let cmd = self.cmd(ci);
                cmd.inflight += 1;
                cmd.at_disk = true;
                if serve == Serve::Miss {
                    let vol = Arc::clone(self.volume(vslot));
                    if let Err(e) = self.engine.read(&vol, c, use_.len, offset, ud(U_READ, ci, c.0)) {
                        self.engine.pool_mut().release(c);
                        self.cmd(ci).inflight -= 1;
                        self.engine_refused(ci, &e);
                    }
                }
            }
            Serve::Take(ahead) => {
                // Zero copy: the chunk read ahead takes the place (and the
                // pool charge) of the command's own.
                self.engine.pool_mut().move_charge(c, ahead);
                self.engine.pool_mut().release(c);
                self.chunk_use[ahead.0 as usize] = use_;
                self.read_chunk_done(si, ci, ahead);
            }
            Serve::Copy(parts) => {
                for p in parts.into_iter().flatten() {
                    self.engine.pool_mut().copy_between(p.chunk, p.from as usize, c, p.to as usize, p.len as usize);
                }
                self.read_chunk_done(si, ci, c);
            }
        }
        // After the copy: chunks read through (or found stale) go back.
        self.release_readahead();
    }

    /// A read ahead completed: its chunk is cached (or dropped if it failed
    /// or became unusable meanwhile), and the pieces that waited for it are
    /// served again, from it or from the disk.
    pub(super) fn readahead_done(&mut self, vslot: u16, c: ChunkId, res: i32) {
        if res < 0 {
            tracing::debug!("reactor {}: a read ahead failed: {}", self.id, std::io::Error::from_raw_os_error(-res));
        }
        let mut waiters = std::mem::take(&mut self.readahead_waiters);
        self.readahead.completed(vslot, c, res, Instant::now(), &mut waiters);
        self.release_readahead();
        for &w in &waiters {
            let ci = self.chunk_use[w.0 as usize].cmd;
            let cmd = self.cmd(ci);
            cmd.inflight -= 1;
            let (si, failed) = (cmd.sess, cmd.error.is_some());
            if failed || self.session_closing(si) {
                self.engine.pool_mut().release(w);
            } else {
                self.read_piece(ci, w);
            }
            self.progress(ci);
        }
        waiters.clear();
        self.readahead_waiters = waiters;
        if let Some(lv) = self.vols.slots[vslot as usize].as_mut() {
            lv.inflight -= 1;
            if lv.retiring && lv.inflight == 0 {
                self.maybe_release_volume(vslot);
            }
        }
    }

    /// Gives the chunks readahead let go of back to the pool.
    pub(super) fn release_readahead(&mut self) {
        while let Some(c) = self.readahead.take_released() {
            self.engine.pool_mut().release(c);
        }
    }

    /// Whether the pool has a chunk for a command, after giving back the
    /// oldest chunk cached by readahead if it had none.
    pub(super) fn chunk_for_command(&mut self) -> bool {
        if self.engine.pool_mut().free_count() > 0 {
            return true;
        }
        let evicted = self.readahead.evict();
        self.release_readahead();
        evicted
    }

    /// The range a WRITE, WRITE_ZEROES or DISCARD changes.
    pub(super) fn write_range(&self, ci: u16) -> (u16, u64, u64) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        let len = if cmd.kind == CmdKind::Range { cmd.falloc_len } else { cmd.len as u64 };
        (cmd.vslot, cmd.offset, len)
    }

    /// A write starts, before any of its disk I/O is submitted: what was
    /// read ahead of its range, on this reactor or any other, is unusable
    /// from now on (`backend::WriteEpochs`).
    pub(super) fn begin_write(&mut self, ci: u16) {
        let (vslot, offset, len) = self.write_range(ci);
        self.volume(vslot).writes.bump(offset, len);
        self.cmd(ci).write_epoch_open = true;
        self.readahead.invalidate(vslot, offset, len);
        self.release_readahead();
    }

    /// A write has nothing in flight any more (answered, or given up with
    /// its queue pair): its range's epoch moves again, so that what was
    /// read ahead while it was in flight is not served after it.
    pub(super) fn end_write(&mut self, ci: u16) {
        let cmd = self.cmds[ci as usize].as_ref().expect("live command");
        if !cmd.write_epoch_open || cmd.inflight > 0 {
            return;
        }
        let (vslot, offset, len) = self.write_range(ci);
        self.volume(vslot).writes.bump(offset, len);
        self.cmd(ci).write_epoch_open = false;
    }

    pub(super) fn publish_readahead_stats(&self) {
        let c = self.readahead.counters;
        self.stats.readahead_issued.set(c.issued);
        self.stats.readahead_hits.set(c.hits);
        self.stats.readahead_unused.set(c.unused);
        self.stats.readahead_invalidated.set(c.invalidated);
        self.stats.readahead_chunks.set(self.readahead.held() as u64);
    }
}
