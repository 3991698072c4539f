//! The rdmablk v1 front end of a reactor: queue pairs' sessions, capsule
//! receipt and planning (`crate::command`), CONNECT and the reconnect
//! fence, authentication, and the answers (response capsules, their slots
//! and send queue). It decides what a command does; `disk.rs` and
//! `fabric_io.rs` carry it out.

use super::*;

impl Reactor {
    /// Whether `target.idle_timeout` applies to a queue pair: connected (a
    /// handshake has its own deadline), live, and nothing of it in flight
    /// (a command waiting for the disk or a chunk is not the peer's silence).
    pub(super) fn may_idle_out(s: &Session) -> bool {
        s.closing.is_none() && s.handshake.is_none() && s.fence.is_none() && s.live_cmds == 0
    }

    /// Destroys a queue pair whose work requests did not all flush. Chunks
    /// lent to it come back; commands still waiting for io_uring stay until done.
    pub(super) fn force_teardown(&mut self, si: u16) {
        for c in 0..self.engine.pool_mut().capacity() {
            let chunk = ChunkId(c as u16);
            if !self.engine.pool_mut().is_lent_to_fabric(chunk) {
                continue;
            }
            let ci = self.chunk_use[c].cmd;
            if self.cmds.get(ci as usize).and_then(|c| c.as_ref()).is_some_and(|cmd| cmd.sess == si) {
                self.engine.pool_mut().return_from_fabric(chunk);
                self.engine.pool_mut().release(chunk);
                if let Some(cmd) = self.cmds[ci as usize].as_mut() {
                    cmd.inflight -= 1;
                }
            }
        }
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        s.res = None;
        s.sq_used = 0;
        s.recv_posted = 0;
        s.noslot_sends = 0;
        for ci in 0..self.cmds.len() {
            if let Some(cmd) = self.cmds[ci].as_mut() {
                if cmd.sess == si {
                    cmd.send_inflight = false;
                }
            }
        }
        self.free_session_cmds(si);
        self.maybe_free_session(si);
    }

    pub(super) fn add_session(&mut self, req: ConnectRequest, fi: usize, admission: Admission) {
        let Admission { handshake, connection } = admission;
        let peer = req.peer();
        if self.shutdown.is_some() {
            req.reject(b"target shutting down");
            return;
        }
        let qd = self.queue_depth;
        let chunks = self.engine.pool_mut().capacity() as u32;
        let reserve = CQ_ENTRIES_PER_DEPTH * qd;
        // Admission by what the device's completion queue really holds, so
        // that it can never overrun.
        let ci = match self.cq_with_room(fi, reserve) {
            Ok(ci) => ci,
            Err(e) => {
                tracing::warn!("reactor {}: refusing connection from {peer}: {e}", self.id);
                req.reject(b"target busy: cannot create a completion queue");
                return;
            }
        };
        if self.free_sessions.is_empty() && self.sessions.len() >= u16::MAX as usize {
            req.reject(b"target busy");
            return;
        }
        let sq_cap = send_queue_depth(qd, chunks);
        let caps = QpCaps { max_send_wr: sq_cap, max_recv_wr: qd, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 256 };
        let f = &self.fabrics[fi];
        let qp = match req.into_queue_pair(&f.pd, &f.cqs[ci].cq, caps) {
            Ok(qp) => qp,
            Err(e) => {
                tracing::warn!("cannot create a queue pair for {peer}: {e}");
                return;
            }
        };
        let got = qp.caps();
        if got.max_send_wr < sq_cap || got.max_recv_wr < qd {
            tracing::warn!("queue pair for {peer} got {got:?}, need {caps:?}; dropping the connection");
            return;
        }
        let mut res = QpRes {
            qp,
            recv: SlotBuf::new(qd as usize, self.recv_slot_size),
            resp: SlotBuf::new(response_slots(qd) as usize, RESPONSE_SLOT_SIZE),
        };
        if let Err(e) = res.recv.register(&f.pd, Access::LOCAL_WRITE).and_then(|()| res.resp.register(&f.pd, Access::NONE)) {
            tracing::warn!("cannot register buffers for {peer}: {e}");
            return;
        }
        let si = match self.free_sessions.pop() {
            Some(si) => si,
            None => {
                self.sessions.push(SessionSlot { gen: 0, s: None });
                (self.sessions.len() - 1) as u16
            }
        };
        let gen = self.sessions[si as usize].gen;
        let slot_size = self.recv_slot_size as u32;
        let sges: Vec<Sge> = (0..qd as usize).map(|i| res.recv.lend(i, slot_size)).collect();
        let wrs: Vec<RecvWr<'_>> =
            sges.iter().enumerate().map(|(i, sge)| RecvWr { wr_id: wr_id(K_RECV, gen, si, i as u16, 0), sges: std::slice::from_ref(sge) }).collect();
        let posted = res.qp.post_recv(&wrs);
        drop(wrs);
        let discard = |this: &mut Reactor| {
            this.sessions[si as usize].gen = this.sessions[si as usize].gen.wrapping_add(1);
            this.free_sessions.push(si);
        };
        if let Err(e) = posted {
            tracing::warn!("cannot post receives for {peer}: {e}");
            discard(self);
            return;
        }
        if let Err(e) = res.qp.accept(&[]) {
            tracing::warn!("cannot accept connection from {peer}: {e}");
            discard(self);
            return;
        }
        self.fabrics[fi].cqs[ci].reserved += reserve;
        let session = Session {
            qp_num: res.qp.qp_num(),
            max_inline: got.max_inline_data,
            res: Some(res),
            fabric: fi,
            cq: ci,
            peer: peer.clone(),
            state: SessionState { shutting_down: self.shutdown.is_some(), ..SessionState::new() },
            shared: None,
            queue_index: 0,
            free_resp: (0..response_slots(qd) as u16).rev().collect(),
            sq_used: 0,
            sq_cap,
            recv_posted: qd,
            noslot_sends: 0,
            slots: qd,
            cq_reserved: reserve,
            closing: None,
            close_deadline: None,
            handshake: Some((handshake, Instant::now() + self.handshake_timeout)),
            _connection: connection,
            tx: Vec::new(),
            fence: None,
            live_cmds: 0,
            resp_wait: VecDeque::new(),
            last_heard: Instant::now(),
        };
        self.sessions[si as usize].s = Some(session);
        self.stats.queue_pairs.add(1);
        tracing::debug!("reactor {}: accepted connection from {peer}", self.id);
    }

    // ---------------------------------------------------------------- fabric completions

    pub(super) fn session(&mut self, si: u16) -> &mut Session {
        self.sessions[si as usize].s.as_mut().expect("live session")
    }

    pub(super) fn on_recv(&mut self, si: u16, slot: u16, wc: Completion) {
        // The command came in by this turn's start (its poll found it).
        let start = self.turn_start;
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        s.recv_posted -= 1;
        s.last_heard = start;
        let res = s.res.as_mut().expect("live queue pair");
        res.recv.reclaim(slot as usize);
        if wc.status != WcStatus::Success {
            let reason = if wc.status == WcStatus::WrFlushError {
                "disconnected".to_owned()
            } else {
                completion_reason("receive", wc.status)
            };
            self.fail_session(si, reason);
            return;
        }
        if s.closing.is_some() {
            // A dead queue pair executes nothing more.
            if let Some(sh) = &s.shared {
                sh.count_dropped(1);
            }
            return;
        }
        if s.shared.as_ref().is_some_and(|sh| sh.is_retired()) {
            // Retired by a reconnect fence that this reactor has not acted on yet.
            if let Some(sh) = &s.shared {
                sh.count_dropped(1);
            }
            self.retire_queue_pairs();
            return;
        }
        self.stats.commands.add(1);
        if s.state.outstanding >= s.slots {
            // The initiator ignores the queue depth: answer without a slot.
            let cid = command::command_id_of(&res.recv.slot(slot as usize)[..(wc.byte_len as usize).min(4)]);
            self.repost_recv(si, slot);
            self.send_queue_full(si, cid);
            return;
        }
        // A volume another reactor's queue pair just opened after a reload
        // is in the published set by now (publication happened before that
        // OPEN was answered): one load tells.
        self.maybe_refresh();
        let len = (wc.byte_len as usize).min(self.recv_slot_size);
        let (cid, plan) = self.plan_msg(si, slot, len);
        let plan = match plan {
            Ok(p) => p,
            Err(e) if e.kind() == ErrorKind::QueueFull => {
                let s = self.session(si);
                tracing::debug!("peer {} host {}: command {} refused: {e}", s.peer, s.host(), cid.0);
                self.repost_recv(si, slot);
                self.send_queue_full(si, cid);
                return;
            }
            Err(e) => return self.refuse(si, slot, len, cid, e, start),
        };
        match plan {
            Plan::Connect { negotiated, host_id, join, replaces, reply } => {
                let access = Arc::clone(&self.vols.set.access);
                let s = self.session(si);
                if let Err(e) = crate::auth::check_connect(&s.state.auth, &access, &host_id, join) {
                    tracing::warn!("connect refused: host={host_id} peer={} reason={e}", s.peer);
                    return self.refuse(si, slot, len, cid, e, start);
                }
                self.repost_recv(si, slot);
                let pending = PendingConnect { cid, start, negotiated, host_id, join, reply };
                match replaces {
                    Some(old) => self.fence(si, old, pending),
                    None => self.connect_session(si, pending, None),
                }
            }
            Plan::AuthNegotiate { host_id, session_id } => {
                let name = self.limits.target_name.clone();
                let s = self.session(si);
                let challenge = crate::auth::negotiate(&mut s.state.auth, &host_id, session_id, &name);
                tracing::debug!("authentication started: host={host_id} peer={} session={:#x}", s.peer, session_id.0);
                self.answer_auth(si, slot, len, cid, start, challenge.map(|c| c.to_vec()));
            }
            Plan::AuthReply { response } => {
                let (name, access) = (self.limits.target_name.clone(), Arc::clone(&self.vols.set.access));
                let s = self.session(si);
                let claimed = match &s.state.auth {
                    crate::auth::AuthState::Challenged { host_id, .. } => host_id.clone(),
                    _ => "-".to_owned(),
                };
                let proof = crate::auth::reply(&mut s.state.auth, &access, &response, &name);
                match &proof {
                    Ok(_) => tracing::info!("authenticated: host={claimed} peer={}", s.peer),
                    Err(e) => tracing::warn!("authentication failed: host={claimed} peer={} reason={e}", s.peer),
                }
                self.answer_auth(si, slot, len, cid, start, proof.map(|p| p.to_vec()));
            }
            Plan::Open { volume, grant } => {
                // Under the admin lock, so that a reload cannot remove the
                // volume between this check and marking it open.
                let registry = Arc::clone(&self.registry);
                let admin = registry.admin();
                let (mut volume, mut grant) = (volume, grant);
                if registry.generation() != self.vols.generation {
                    self.refresh_volumes();
                    match self.plan_msg(si, slot, len).1 {
                        Ok(Plan::Open { volume: v, grant: g }) => (volume, grant) = (v, g),
                        Ok(_) => unreachable!("the same capsule plans the same command"),
                        Err(e) => {
                            drop(admin);
                            return self.refuse(si, slot, len, cid, e, start);
                        }
                    }
                }
                let meta = self.vols.set.table.get(volume);
                let (id, info) = (meta.id, meta.info_for(grant).to_bytes());
                let read_only_grant = grant == crate::auth::Grant::ReadOnly;
                if read_only_grant {
                    let s = self.session(si);
                    tracing::info!("volume {} opened read-only: host={} peer={} (read_only_hosts)", id, s.host(), s.peer);
                }
                if let Some(shared) = self.session(si).shared.clone() {
                    shared.mark_open_with_grant(&admin, id, read_only_grant);
                }
                drop(admin);
                self.repost_recv(si, slot);
                if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
                    match info {
                        Ok(d) => {
                            self.cmd(ci).result = id.0 as u64;
                            self.respond(ci, &d, None)
                        }
                        Err(e) => {
                            tracing::error!("cannot encode volume info: {e}");
                            self.cmd(ci).error = Some(ErrorKind::Internal);
                            self.respond(ci, &[], None);
                        }
                    }
                }
            }
            Plan::Close { volume } => {
                let id = self.vols.set.table.get(volume).id;
                if let Some(shared) = self.session(si).shared.clone() {
                    let registry = Arc::clone(&self.registry);
                    let admin = registry.admin();
                    shared.mark_closed(&admin, id);
                }
                self.repost_recv(si, slot);
                if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
                    self.respond(ci, &[], None);
                }
            }
            Plan::KeepAlive => {
                self.repost_recv(si, slot);
                if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
                    self.respond(ci, &[], None);
                }
            }
            Plan::ListVolumes { dest, entries, total } => {
                self.repost_recv(si, slot);
                let kind = if entries == 0 { CmdKind::Immediate } else { CmdKind::List };
                if let Some(ci) = self.new_cmd(si, cid, kind, start) {
                    let cmd = self.cmd(ci);
                    cmd.result = total as u64;
                    cmd.remote = dest;
                    cmd.list_entries = entries;
                    if entries == 0 {
                        self.respond(ci, &[], None);
                    } else {
                        self.pump(ci);
                    }
                }
            }
            Plan::Io(io) => self.start_io(si, slot, cid, io, start),
        }
    }

    /// Answers a command whose receive slot is already reposted with the
    /// failure `e`.
    pub(super) fn answer_error(&mut self, si: u16, cid: CommandId, e: Error, start: Instant) {
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            self.cmd(ci).error = Some(e.kind());
            self.respond(ci, &[], None);
        }
    }

    /// The reconnect fence: a CONNECT creating a session names the earlier
    /// session `old` of the same host that it replaces. That session is
    /// retired on every reactor (its queue pairs stop reading and drop what
    /// they have not submitted to the disk), and this CONNECT is answered
    /// only once its last queue pair, and so its last disk I/O, is gone, or
    /// with `FenceTimeout` after `target.fence_timeout`.
    pub(super) fn fence(&mut self, si: u16, old: SessionId, pending: PendingConnect) {
        let registry = Arc::clone(&self.registry);
        let retired = registry.retire(&mut registry.admin(), old, &pending.host_id);
        let old = match retired {
            Err(e) => {
                let s = self.session(si);
                tracing::warn!("connect refused: host={} peer={} reason={e}", pending.host_id, s.peer);
                return self.answer_error(si, pending.cid, e, pending.start);
            }
            // Gone already: nothing of it can land any more.
            Ok(None) => return self.connect_session(si, pending, Some(old)),
            Ok(Some(shared)) => shared,
        };
        // This reactor's queue pairs of the old session stop now; the
        // others' at their next turn (the registry woke them).
        self.retire_queue_pairs();
        if old.has_ended() {
            self.log_fence(&old, Duration::ZERO);
            return self.connect_session(si, pending, Some(old.id));
        }
        let now = Instant::now();
        let deadline = now + self.fence_timeout;
        let s = self.session(si);
        tracing::info!(
            "fence: host={} peer={} replaces session {:#x}: waiting for its disk I/O to finish",
            pending.host_id,
            s.peer,
            old.id.0
        );
        s.fence = Some(Fence { old, since: now, deadline, connect: pending });
        self.fences_waiting += 1;
    }

    /// Stops every queue pair of this reactor whose session was retired.
    pub(super) fn retire_queue_pairs(&mut self) {
        self.fence_generation = self.registry.fence_generation();
        for si in 0..self.sessions.len() {
            let retired = self.sessions[si]
                .s
                .as_ref()
                .is_some_and(|s| s.closing.is_none() && s.shared.as_ref().is_some_and(|sh| sh.is_retired()));
            if retired {
                self.fail_session(si as u16, "retired: a newer session of this host replaced it (reconnect fence)".into());
            }
        }
    }

    /// Per turn: retires queue pairs when the fence generation moved, and
    /// answers the CONNECTs whose fence is over (or timed out).
    pub(super) fn check_fences(&mut self) {
        if self.registry.fence_generation() != self.fence_generation {
            self.retire_queue_pairs();
        }
        if self.fences_waiting == 0 {
            return;
        }
        let now = Instant::now();
        for si in 0..self.sessions.len() {
            let Some(s) = self.sessions[si].s.as_mut() else { continue };
            let Some(f) = s.fence.as_ref() else { continue };
            let closing = s.closing.is_some();
            if !closing && !f.old.has_ended() && now < f.deadline {
                continue;
            }
            let f = s.fence.take().expect("checked");
            self.fences_waiting -= 1;
            let si = si as u16;
            if closing {
                continue;
            }
            if f.old.has_ended() {
                self.log_fence(&f.old, now.saturating_duration_since(f.since));
                self.connect_session(si, f.connect, Some(f.old.id));
            } else {
                self.registry.counters.fence_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let e = Error::new(
                    ErrorKind::FenceTimeout,
                    format!(
                        "session {:#x} still has disk I/O in flight after {:?} (target.fence_timeout)",
                        f.old.id.0, self.fence_timeout
                    ),
                );
                tracing::warn!("fence: host={} replacing session {:#x}: {e}; answered FenceTimeout", f.connect.host_id, f.old.id.0);
                self.answer_error(si, f.connect.cid, e, f.connect.start);
            }
        }
    }

    pub(super) fn log_fence(&self, old: &SharedSession, took: Duration) {
        let dropped = old.dropped();
        self.registry.counters.fence_dropped_commands.fetch_add(dropped, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            "fence: session {:#x} of host {} retired in {took:?}: {dropped} commands dropped before reaching the disk, every disk I/O it had submitted completed",
            old.id.0,
            old.host_id
        );
    }

    /// Creates or joins the session of a CONNECT (its receive slot is
    /// reposted already) and answers it.
    pub(super) fn connect_session(&mut self, si: u16, c: PendingConnect, replaced: Option<SessionId>) {
        let PendingConnect { cid, start, negotiated, host_id, join, mut reply } = c;
        let registry = Arc::clone(&self.registry);
        let joined = {
            let mut admin = registry.admin();
            match join {
                None => registry.create(&mut admin, &host_id, self.id),
                Some(id) => registry.join(&mut admin, id, &host_id, self.id),
            }
        };
        let joined = match joined {
            Ok(j) => j,
            Err(e) => {
                let id = self.id;
                let s = self.session(si);
                if e.kind() == ErrorKind::LimitReached {
                    tracing::warn!("session refused: host={host_id} peer={} reactor={id} reason={e}", s.peer);
                } else {
                    tracing::info!("session join refused: host={host_id} peer={} reactor={id} reason={e}", s.peer);
                }
                return self.answer_error(si, cid, e, start);
            }
        };
        reply.session_id = joined.session.id;
        reply.queue_index = joined.queue_index;
        let id = self.id;
        let s = self.session(si);
        let how = match (joined.created, replaced) {
            (false, _) => " (joined)".to_owned(),
            (true, None) => " (new session)".to_owned(),
            (true, Some(old)) => format!(" (new session, replaces {:#x})", old.0),
        };
        tracing::info!(
            "session connected: host={host_id} session={:#x} queue={} reactor={id} peer={} queue_depth={} max_io_size={}{how}",
            joined.session.id.0,
            joined.queue_index,
            s.peer,
            negotiated.queue_depth,
            negotiated.max_io_size,
        );
        s.state.connected = Some(negotiated);
        s.state.host_id = Some(host_id);
        // Past its handshake: the slot goes back for the next connection.
        s.handshake = None;
        s.shared = Some(joined.session);
        s.queue_index = joined.queue_index;
        let data = reply.to_bytes();
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            match data {
                Ok(d) => self.respond(ci, &d, None),
                Err(e) => {
                    tracing::error!("cannot encode CONNECT reply: {e}");
                    self.cmd(ci).error = Some(ErrorKind::Internal);
                    self.respond(ci, &[], None);
                }
            }
        }
    }

    /// Answers AUTH_NEGOTIATE or AUTH_REPLY: the reply data, or the
    /// failure's status (the same `AuthFailed` for every failed check).
    pub(super) fn answer_auth(&mut self, si: u16, slot: u16, len: usize, cid: CommandId, start: Instant, reply: Result<Vec<u8>>) {
        let data = match reply {
            Ok(d) => d,
            Err(e) => return self.refuse(si, slot, len, cid, e, start),
        };
        self.repost_recv(si, slot);
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            self.respond(ci, &data, None);
        }
    }

    /// Validates the capsule in receive slot `slot` against this reactor's
    /// volume snapshot and the session's opened set (read lock-free).
    pub(super) fn plan_msg(&self, si: u16, slot: u16, len: usize) -> (CommandId, Result<command::Plan>) {
        let s = self.sessions[si as usize].s.as_ref().expect("live session");
        let res = s.res.as_ref().expect("live queue pair");
        let msg = &res.recv.slot(slot as usize)[..len];
        match &s.shared {
            Some(shared) => command::plan(msg, &self.vols.set.table, &self.limits, &s.state, &shared.open()),
            None => command::plan(msg, &self.vols.set.table, &self.limits, &s.state, &OpenSet::EMPTY),
        }
    }

    /// Answers a command that failed validation with its status (and counts
    /// it against its volume when it names one).
    pub(super) fn refuse(&mut self, si: u16, slot: u16, len: usize, cid: CommandId, e: Error, start: Instant) {
        let target = {
            let s = self.sessions[si as usize].s.as_ref().expect("live session");
            command::io_target(&s.res.as_ref().expect("live queue pair").recv.slot(slot as usize)[..len])
        };
        let s = self.session(si);
        match e.kind() {
            ErrorKind::VersionMismatch => tracing::warn!("peer {}: {e}", s.peer),
            ErrorKind::AccessDenied | ErrorKind::ReadOnly => {
                tracing::info!("refused: host={} peer={} command={}: {e}", s.host(), s.peer, cid.0)
            }
            _ => tracing::debug!("peer {} host {}: command {} refused: {e}", s.peer, s.host(), cid.0),
        }
        if let Some((op, vid)) = target {
            let vslot = self.vols.set.table.index_of(vid).and_then(|i| self.vols.by_index.get(i).copied());
            if let (Some(vslot), Some(oi)) = (vslot.filter(|&v| v != NONE16), metrics::op_index(op)) {
                self.volume(vslot).stats.reactor(self.id).ops[oi].record(0, false, start.elapsed());
            }
        }
        self.repost_recv(si, slot);
        if let Some(ci) = self.new_cmd(si, cid, CmdKind::Immediate, start) {
            self.cmd(ci).error = Some(e.kind());
            self.respond(ci, &[], None);
        }
    }

    pub(super) fn start_io(&mut self, si: u16, slot: u16, cid: CommandId, io: IoPlan, start: Instant) {
        let (kind, volume, offset, len, falloc_len, remote, fua, inline, op) = match io {
            IoPlan::Read { volume, offset, len, dest } => {
                (CmdKind::Read, volume, offset, len, 0, dest, false, false, rdmablk_common::protocol::Opcode::Read)
            }
            IoPlan::Write { volume, offset, len, source, fua } => match source {
                WriteSource::Descriptor(d) => {
                    (CmdKind::Write, volume, offset, len, 0, d, fua, false, rdmablk_common::protocol::Opcode::Write)
                }
                WriteSource::Inline => (
                    CmdKind::WriteInline,
                    volume,
                    offset,
                    len,
                    0,
                    DataDescriptor::default(),
                    fua,
                    true,
                    rdmablk_common::protocol::Opcode::Write,
                ),
            },
            IoPlan::Flush { volume } => {
                (CmdKind::Flush, volume, 0, 0, 0, DataDescriptor::default(), false, false, rdmablk_common::protocol::Opcode::Flush)
            }
            IoPlan::Discard { volume, offset, len } => {
                (CmdKind::Range, volume, offset, 0, len, DataDescriptor::default(), false, false, rdmablk_common::protocol::Opcode::Discard)
            }
            IoPlan::WriteZeroes { volume, offset, len } => (
                CmdKind::Range,
                volume,
                offset,
                0,
                len,
                DataDescriptor::default(),
                false,
                false,
                rdmablk_common::protocol::Opcode::WriteZeroes,
            ),
        };
        let vslot = self.vols.by_index.get(volume).copied().unwrap_or(NONE16);
        if !inline {
            self.repost_recv(si, slot);
        }
        let Some(ci) = self.new_cmd(si, cid, kind, start) else {
            if inline {
                self.repost_recv(si, slot);
            }
            return;
        };
        let broken = vslot == NONE16 || self.vols.slots[vslot as usize].as_ref().is_none_or(|lv| lv.broken);
        {
            let cmd = self.cmd(ci);
            cmd.op = metrics::op_index(op).map_or(NO_OP, |i| i as u8);
            cmd.offset = offset;
            cmd.len = len;
            cmd.falloc_len = falloc_len;
            cmd.remote = remote;
            cmd.fua = fua;
        }
        if broken {
            if inline {
                self.repost_recv(si, slot);
            }
            self.cmd(ci).error = Some(ErrorKind::Internal);
            self.respond(ci, &[], None);
            return;
        }
        let lv = self.vols.slots[vslot as usize].as_mut().expect("live volume slot");
        lv.inflight += 1;
        let backend = Arc::clone(&lv.vol.backend);
        let null = matches!(*backend, Backend::Null);
        let cmd = self.cmd(ci);
        cmd.vslot = vslot;
        cmd.null = null;
        if inline {
            cmd.held_recv = Some(slot);
        }
        match kind {
            CmdKind::Write | CmdKind::WriteInline | CmdKind::Range => self.begin_write(ci),
            CmdKind::Read if matches!(*backend, Backend::File(_)) => self.read_ahead(vslot, offset, len),
            _ => {}
        }
        match kind {
            CmdKind::Flush if !backend.needs_flush() => self.respond(ci, &[], None),
            CmdKind::Flush => self.submit_disk(ci, U_FSYNC, |engine, vol, tag| engine.flush(vol, tag)),
            CmdKind::Range => {
                let how = if op == rdmablk_common::protocol::Opcode::Discard { backend.discard() } else { backend.write_zeroes() };
                match how {
                    // Validation refused volumes without support already.
                    None => {
                        self.cmd(ci).error = Some(ErrorKind::NotSupported);
                        self.respond(ci, &[], None);
                    }
                    Some(RangeOp::Nothing) => self.respond(ci, &[], None),
                    Some(how) => {
                        let kind = if matches!(how, RangeOp::Fallocate(_)) { U_FALLOC } else { U_BLKDEV };
                        self.submit_disk(ci, kind, |engine, vol, tag| engine.range(vol, how, offset, falloc_len, tag))
                    }
                }
            }
            CmdKind::WriteInline if null => {
                // Dropped: nothing to copy, nothing to write.
                self.cmd(ci).held_recv = None;
                self.repost_recv(si, slot);
                self.cmd(ci).done = len;
                self.respond(ci, &[], None);
            }
            _ => self.pump(ci),
        }
    }

    pub(super) fn repost_recv(&mut self, si: u16, slot: u16) {
        let gen = self.sessions[si as usize].gen;
        let size = self.recv_slot_size as u32;
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        let res = s.res.as_mut().expect("live queue pair");
        let sge = res.recv.lend(slot as usize, size);
        let wr = RecvWr { wr_id: wr_id(K_RECV, gen, si, slot, 0), sges: &[sge] };
        // A failed post may still have posted part of the list (as in verbs),
        // so the slot stays lent and counted; FLUSH_TIMEOUT covers the rest.
        let posted = res.qp.post_recv(&[wr]);
        s.recv_posted += 1;
        if let Err(e) = posted {
            self.fail_session(si, format!("cannot post a receive: {e}"));
        }
    }

    /// QUEUE_FULL for a command that got no slot: inline SEND from the stack.
    pub(super) fn send_queue_full(&mut self, si: u16, cid: CommandId) {
        let gen = self.sessions[si as usize].gen;
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        if s.noslot_sends >= s.slots || s.max_inline < RESPONSE_CAPSULE_SIZE as u32 || s.sq_used >= s.sq_cap {
            self.fail_session(si, "protocol violation: initiator exceeds the queue depth".into());
            return;
        }
        let (status, detail) = Error::new(ErrorKind::QueueFull, "").wire_status();
        let bytes = ResponseCapsule::failure(cid, status, detail).to_bytes();
        let wr = SendWr {
            wr_id: wr_id(K_SEND_NOSLOT, gen, si, NONE16, NONE16),
            op: SendOp::Send,
            payload: Payload::Inline(&bytes),
            signaled: true,
        };
        // The capsule is on this stack (inline): post it now, after what
        // this turn queued before it.
        if !s.tx.is_empty() {
            self.flush_session_sends(si);
        }
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        s.sq_used += 1;
        s.noslot_sends += 1;
        let res = s.res.as_ref().expect("live queue pair");
        let posted = res.qp.post_send(&[wr]);
        if let Err(e) = posted {
            self.fail_session(si, format!("cannot post a response: {e}"));
        }
    }

    pub(super) fn session_closing(&self, si: u16) -> bool {
        self.sessions[si as usize].s.as_ref().is_none_or(|s| s.closing.is_some() || s.res.is_none())
    }

    /// Posts the response (after an optional RDMA WRITE of `chain` in the same post).
    pub(super) fn respond(&mut self, ci: u16, data: &[u8], chain: Option<ChunkId>) {
        self.end_write(ci);
        let (si, ok) = {
            let cmd = self.cmds[ci as usize].as_ref().expect("live command");
            (cmd.sess, cmd.error.is_none())
        };
        self.record_io(ci, ok);
        if self.session_closing(si) {
            if let Some(c) = chain {
                self.engine.pool_mut().release(c);
            }
            self.mark_responded(ci);
            self.maybe_free_cmd(ci);
            return;
        }
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        let need = 1 + chain.is_some() as u32;
        if !s.resp_wait.is_empty() || s.free_resp.is_empty() || s.sq_used + need > s.sq_cap {
            // Every response slot or send-queue entry is taken by answers
            // whose send completions have not come back yet (they may come
            // after the initiator's next commands): this answer waits for
            // one, in order. The command still counts against the queue
            // depth, as the initiator has not seen its answer.
            s.resp_wait.push_back(WaitingResponse { ci, data: data.to_vec(), chain });
            self.cmd(ci).answer_waits = true;
            self.stats.answers_delayed.add(1);
            return;
        }
        self.post_response(ci, data, chain);
    }

    /// Answers the responses that waited for a response slot, while there
    /// are slots and send-queue room (after a send completion).
    pub(super) fn post_waiting_responses(&mut self, si: u16) {
        loop {
            let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
            let Some(w) = s.resp_wait.front() else { return };
            let need = 1 + w.chain.is_some() as u32;
            if s.closing.is_some() || s.free_resp.is_empty() || s.sq_used + need > s.sq_cap {
                return;
            }
            let w = s.resp_wait.pop_front().expect("checked");
            self.post_response(w.ci, &w.data, w.chain);
        }
    }

    /// The answer to a command: the initiator may reuse its slot once it
    /// holds it, so from here on the command no longer counts against the
    /// queue depth (its slab entry lives until its send completion).
    pub(super) fn mark_responded(&mut self, ci: u16) {
        let cmd = self.cmds[ci as usize].as_mut().expect("live command");
        if cmd.responded {
            return;
        }
        cmd.responded = true;
        let si = cmd.sess;
        if let Some(s) = self.sessions[si as usize].s.as_mut() {
            s.state.outstanding -= 1;
        }
    }

    /// Posts the response (after an optional RDMA WRITE of `chain` in the
    /// same post); a response slot and send-queue room are free.
    pub(super) fn post_response(&mut self, ci: u16, data: &[u8], chain: Option<ChunkId>) {
        let gen;
        let si;
        let (status, detail, result, remote, cid) = {
            let cmd = self.cmds[ci as usize].as_ref().expect("live command");
            si = cmd.sess;
            gen = self.sessions[si as usize].gen;
            let (status, detail) = match cmd.error {
                Some(k) => Error::new(k, "").wire_status(),
                None => (Status::Success, 0),
            };
            (status, detail, cmd.result, cmd.remote, cmd.cid)
        };
        let data = if status == Status::Success { data } else { &[][..] };
        let rc = ResponseCapsule {
            command_id: cid,
            status,
            detail,
            result: if status == Status::Success { result } else { 0 },
            data_len: data.len() as u32,
        };
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        let need = 1 + chain.is_some() as u32;
        let slot = s.free_resp.pop().expect("the caller checked for a free response slot");
        let res = s.res.as_mut().expect("live queue pair");
        let total = RESPONSE_CAPSULE_SIZE + data.len();
        {
            let buf = res.resp.slot_mut(slot as usize);
            let head: &mut [u8; RESPONSE_CAPSULE_SIZE] = (&mut buf[..RESPONSE_CAPSULE_SIZE]).try_into().expect("32 bytes");
            rc.encode(head);
            buf[RESPONSE_CAPSULE_SIZE..total].copy_from_slice(data);
        }
        let send = QueuedWr {
            wr_id: wr_id(K_SEND, gen, si, slot, ci),
            op: SendOp::Send,
            sge: res.resp.lend(slot as usize, total as u32),
            inline: total as u32 <= s.max_inline,
        };
        // If the post fails part of the chain may be posted (as in verbs):
        // account for all of it; the flush (or FLUSH_TIMEOUT) settles the rest.
        s.sq_used += need;
        match chain {
            None => self.queue_send(si, &[send]),
            Some(c) => {
                let use_ = self.chunk_use[c.0 as usize];
                let mr = &self.fabrics[s.fabric].pool_mr;
                let sge = if use_.zero { mr.zero_sge(use_.len) } else { mr.sge(c, 0, use_.len) };
                self.engine.pool_mut().lend_to_fabric(c);
                let write = QueuedWr {
                    wr_id: wr_id(K_RDMA, gen, si, ci, c.0),
                    op: SendOp::RdmaWrite {
                        remote_addr: remote.remote_addr.wrapping_add(use_.off as u64),
                        rkey: Rkey(remote.rkey),
                    },
                    sge,
                    inline: false,
                };
                self.queue_send(si, &[write, send]);
            }
        }
        self.mark_responded(ci);
        let cmd = self.cmds[ci as usize].as_mut().expect("live command");
        cmd.answer_waits = false;
        cmd.send_inflight = true;
        if chain.is_some() {
            cmd.inflight += 1;
        }
    }

    pub(super) fn free_session_cmds(&mut self, si: u16) {
        for ci in 0..self.cmds.len() {
            if self.cmds[ci].as_ref().is_some_and(|c| c.sess == si) {
                self.maybe_free_cmd(ci as u16);
            }
        }
    }

    /// Stops using a queue pair: disconnects it, and frees it once every
    /// work request has flushed and its commands' io_uring ops completed.
    pub(super) fn fail_session(&mut self, si: u16, reason: String) {
        let Some(s) = self.sessions[si as usize].s.as_ref() else { return };
        if s.closing.is_some() {
            return;
        }
        if !s.tx.is_empty() {
            // Posted before the disconnect, they flush and settle their
            // accounting like everything else outstanding. (A failed post
            // fails the session itself.)
            self.flush_session_sends(si);
        }
        let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
        if s.closing.is_some() {
            return;
        }
        match &s.shared {
            Some(sh) => tracing::info!(
                "session disconnected: host={} session={:#x} queue={} reactor={} peer={} reason={reason}",
                s.host(),
                sh.id.0,
                s.queue_index,
                self.id,
                s.peer
            ),
            None => tracing::info!("session disconnected: host={} reactor={} peer={} reason={reason}", s.host(), self.id, s.peer),
        }
        s.closing = Some(reason);
        s.close_deadline = Some(Instant::now() + FLUSH_TIMEOUT);
        // Answers that waited for a response slot are never sent.
        let waiting = std::mem::take(&mut s.resp_wait);
        if let Some(res) = &s.res {
            res.qp.disconnect();
        }
        for w in waiting {
            if let Some(c) = w.chain {
                self.engine.pool_mut().release(c);
            }
        }
        self.free_session_cmds(si);
        self.maybe_free_session(si);
    }

    pub(super) fn maybe_free_session(&mut self, si: u16) {
        let slot = &mut self.sessions[si as usize];
        let Some(s) = slot.s.as_ref() else { return };
        if s.closing.is_none() || s.live_cmds > 0 || s.sq_used > 0 || s.recv_posted > 0 {
            return;
        }
        let s = slot.s.take().expect("live session");
        slot.gen = slot.gen.wrapping_add(1);
        if s.fence.is_some() {
            self.fences_waiting -= 1;
        }
        self.fabrics[s.fabric].cqs[s.cq].reserved -= s.cq_reserved;
        self.free_sessions.push(si);
        self.stats.queue_pairs.set(self.stats.queue_pairs.get().saturating_sub(1));
        tracing::debug!("queue pair {} freed", s.peer);
        if let Some(shared) = &s.shared {
            if self.registry.leave(shared, self.id) {
                tracing::info!(
                    "session ended: host={} session={:#x} (its last queue pair is gone; {} commands dropped before reaching the disk)",
                    shared.host_id,
                    shared.id.0,
                    shared.dropped()
                );
            }
        }
        drop(s);
    }
}
