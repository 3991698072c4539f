//! A received v1 capsule: its plan ([`super::command`]), CONNECT and the
//! reconnect fence, authentication, OPEN, CLOSE, LIST, keep-alive, and
//! the I/O commands handed to the reactor's executor. It decides what a
//! command does; `answer.rs` carries the answers out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmablk_common::fabric::{Completion, Payload, RecvWr, SendOp, SendWr, WcStatus};
use rdmablk_common::protocol::{CommandId, DataDescriptor, Opcode, ResponseCapsule, SessionId, RESPONSE_CAPSULE_SIZE};

use super::command::{self, IoPlan, Plan, WriteSource};
use super::*;
use crate::backend::{ByteRanges, RangeOp};
use crate::engine::exec::{self, Owner, Request, NO_VOLUME};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics;
use super::session::OpenSet;

impl V1 {
    pub(super) fn on_recv(&mut self, rt: &mut Runtime, si: u16, slot: u16, wc: Completion) {
        // The command came in by this turn's start (its poll found it).
        let start = rt.turn_start;
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
            self.fail_session(rt, si, reason);
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
            self.retire_queue_pairs(rt);
            return;
        }
        rt.stats.commands.add(1);
        if s.state.outstanding >= s.slots {
            // The initiator ignores the queue depth: answer without a slot.
            let cid = command::command_id_of(&res.recv.slot(slot as usize)[..(wc.byte_len as usize).min(4)]);
            self.repost_recv(rt, si, slot);
            self.send_queue_full(rt, si, cid);
            return;
        }
        // A volume another reactor's queue pair just opened after a reload
        // is in the published set by now (publication happened before that
        // OPEN was answered): one load tells.
        rt.exec.maybe_refresh();
        let len = (wc.byte_len as usize).min(self.recv_slot_size);
        let (cid, plan) = self.plan_msg(rt, si, slot, len);
        let plan = match plan {
            Ok(p) => p,
            Err(e) if e.kind() == ErrorKind::QueueFull => {
                let s = self.session(si);
                tracing::debug!("peer {} host {}: command {} refused: {e}", s.peer, s.host(), cid.0);
                self.repost_recv(rt, si, slot);
                self.send_queue_full(rt, si, cid);
                return;
            }
            Err(e) => return self.refuse(rt, si, slot, len, cid, e, start),
        };
        match plan {
            Plan::Connect { negotiated, host_id, join, replaces, reply } => {
                let access = Arc::clone(&rt.exec.volume_set().access);
                let s = self.session(si);
                let authenticated = match crate::auth::check_connect(&s.state.auth, &access, &host_id, join) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(host = %host_id, peer = %s.peer, reason = %e, "connect refused");
                        return self.refuse(rt, si, slot, len, cid, e, start);
                    }
                };
                self.repost_recv(rt, si, slot);
                let pending = PendingConnect { cid, negotiated, host_id, authenticated, join, reply };
                match replaces {
                    Some(old) => self.fence(rt, si, old, pending),
                    None => self.connect_session(rt, si, pending, None),
                }
            }
            Plan::AuthNegotiate { host_id, session_id } => {
                let name = self.limits.target_name.clone();
                let s = self.session(si);
                let challenge = crate::auth::negotiate(&mut s.state.auth, &host_id, session_id, &name);
                tracing::debug!(host = %host_id, peer = %s.peer, session = %session_id, "authentication started");
                self.answer_auth(rt, si, slot, len, cid, start, challenge.map(|c| c.to_vec()));
            }
            Plan::AuthReply { response } => {
                let (name, access) = (self.limits.target_name.clone(), Arc::clone(&rt.exec.volume_set().access));
                let s = self.session(si);
                let claimed = match &s.state.auth {
                    crate::auth::AuthState::Challenged { host_id, .. } => host_id.clone(),
                    _ => "-".to_owned(),
                };
                let proof = crate::auth::reply(&mut s.state.auth, &access, &response, &name);
                match &proof {
                    Ok(_) => tracing::info!(host = %claimed, peer = %s.peer, "authenticated"),
                    Err(e) => tracing::warn!(host = %claimed, peer = %s.peer, reason = %e, "authentication failed"),
                }
                self.answer_auth(rt, si, slot, len, cid, start, proof.map(|p| p.to_vec()));
            }
            Plan::Open { volume, grant } => {
                // Under the admin lock, so that a reload cannot remove the
                // volume between this check and marking it open.
                let sessions = Arc::clone(&self.sessions_table);
                let admin = sessions.admin();
                let (mut volume, mut grant) = (volume, grant);
                if rt.registry.generation() != rt.exec.volume_set().generation {
                    rt.exec.refresh_volumes();
                    match self.plan_msg(rt, si, slot, len).1 {
                        Ok(Plan::Open { volume: v, grant: g }) => (volume, grant) = (v, g),
                        Ok(_) => unreachable!("the same capsule plans the same command"),
                        Err(e) => {
                            drop(admin);
                            return self.refuse(rt, si, slot, len, cid, e, start);
                        }
                    }
                }
                let meta = rt.exec.volume_set().table.get(volume);
                let (id, info) = (meta.id, meta.info_for(grant).to_bytes());
                let read_only_grant = grant == crate::auth::Grant::ReadOnly;
                if read_only_grant {
                    let s = self.session(si);
                    tracing::info!(volume = %id, host = %s.host(), peer = %s.peer, "volume opened read-only (read_only_hosts)");
                }
                if let Some(shared) = self.session(si).shared.clone() {
                    shared.mark_open_with_grant(&admin, id, read_only_grant);
                }
                drop(admin);
                self.repost_recv(rt, si, slot);
                if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
                    match info {
                        Ok(d) => {
                            self.cmd(ci).result = id.0 as u64;
                            self.respond(rt, ci, &d, None)
                        }
                        Err(e) => {
                            tracing::error!("cannot encode volume info: {e}");
                            self.cmd(ci).error = Some(ErrorKind::Internal);
                            self.respond(rt, ci, &[], None);
                        }
                    }
                }
            }
            Plan::Close { volume } => {
                let id = rt.exec.volume_set().table.get(volume).id;
                if let Some(shared) = self.session(si).shared.clone() {
                    let sessions = Arc::clone(&self.sessions_table);
                    let admin = sessions.admin();
                    shared.mark_closed(&admin, id);
                }
                self.repost_recv(rt, si, slot);
                if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
                    self.respond(rt, ci, &[], None);
                }
            }
            Plan::KeepAlive => {
                self.repost_recv(rt, si, slot);
                if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
                    self.respond(rt, ci, &[], None);
                }
            }
            Plan::ListVolumes { dest, entries, total } => {
                self.repost_recv(rt, si, slot);
                let kind = if entries == 0 { CmdKind::Immediate } else { CmdKind::List };
                if let Some(ci) = self.new_cmd(rt, si, cid, kind) {
                    let cmd = self.cmd(ci);
                    cmd.result = total as u64;
                    cmd.remote = dest;
                    cmd.list_entries = entries;
                    if entries == 0 {
                        self.respond(rt, ci, &[], None);
                    } else {
                        // The entries go out of a pool chunk (registered
                        // memory), like a READ's data.
                        let req = Request {
                            op: exec::Op::Buffer,
                            vslot: NO_VOLUME,
                            offset: 0,
                            len: 0,
                            metric: None,
                            start,
                            timed: false,
                            accounts: self.accounts(rt, si),
                            hold_key: None,
                        };
                        self.submit(rt, ci, req);
                    }
                }
            }
            Plan::Io(io) => self.start_io(rt, si, slot, cid, io, start),
        }
    }

    /// Hands command `ci`'s disk side to the executor; a full executor
    /// fails it (InternalError, as no disk work can start).
    pub(super) fn submit(&mut self, rt: &mut Runtime, ci: u16, req: Request) {
        let owner = Owner { transport: self.index as u8, tag: ci as u32 };
        match rt.exec.submit(owner, req) {
            Some(id) => self.cmd(ci).exec = Some(id),
            None => {
                tracing::warn!("reactor {}: the executor holds as many commands as it can", rt.id);
                self.cmd(ci).error = Some(ErrorKind::Internal);
                self.respond(rt, ci, &[], None);
            }
        }
    }

    /// The pool accounts a command of queue pair `si` is charged to on this
    /// reactor: its session's and its host's (the peer's source address).
    pub(super) fn accounts(&self, rt: &Runtime, si: u16) -> exec::Accounts {
        let s = self.sessions[si as usize].s.as_ref().expect("live session");
        let session = s.shared.as_ref().and_then(|sh| sh.pool_account(rt.id)).cloned();
        let host = s.connection.host_pool_account(rt.id).cloned();
        [session, host]
    }

    /// Answers a command whose receive slot is already reposted with the
    /// failure `e`.
    pub(super) fn answer_error(&mut self, rt: &mut Runtime, si: u16, cid: CommandId, e: Error) {
        if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
            self.cmd(ci).error = Some(e.kind());
            self.respond(rt, ci, &[], None);
        }
    }

    /// The reconnect fence: a CONNECT creating a session names the earlier
    /// session `old` of the same host that it replaces. That session is
    /// retired on every reactor (its queue pairs stop reading and drop what
    /// they have not submitted to the disk), and this CONNECT is answered
    /// only once its last queue pair, and so its last disk I/O, is gone, or
    /// with `FenceTimeout` after `target.fence_timeout`.
    fn fence(&mut self, rt: &mut Runtime, si: u16, old: SessionId, pending: PendingConnect) {
        let sessions = Arc::clone(&self.sessions_table);
        let retired = sessions.retire(&mut sessions.admin(), old, &pending.host_id);
        let old = match retired {
            Err(e) => {
                let s = self.session(si);
                tracing::warn!(host = %pending.host_id, peer = %s.peer, reason = %e, "connect refused");
                return self.answer_error(rt, si, pending.cid, e);
            }
            // Gone already: nothing of it can land any more.
            Ok(None) => return self.connect_session(rt, si, pending, Some(old)),
            Ok(Some(shared)) => shared,
        };
        // This reactor's queue pairs of the old session stop now; the
        // others' at their next turn (the registry woke them).
        self.retire_queue_pairs(rt);
        if old.has_ended() {
            self.log_fence(rt, &old, Duration::ZERO);
            return self.connect_session(rt, si, pending, Some(old.id));
        }
        let now = Instant::now();
        let deadline = now + self.fence_timeout;
        let s = self.session(si);
        tracing::info!(
            host = %pending.host_id,
            peer = %s.peer,
            replaces = %old.id,
            "fence: the new session waits for the disk I/O of the one it replaces to finish"
        );
        s.fence = Some(Fence { old, since: now, deadline, connect: pending });
        self.fences_waiting += 1;
    }

    /// Stops every queue pair of this transport whose session was retired.
    pub(super) fn retire_queue_pairs(&mut self, rt: &mut Runtime) {
        self.fence_generation = rt.registry.fence_generation();
        for si in 0..self.sessions.len() {
            let retired = self.sessions[si]
                .s
                .as_ref()
                .is_some_and(|s| s.closing.is_none() && s.shared.as_ref().is_some_and(|sh| sh.is_retired()));
            if retired {
                let evicted = self.sessions[si].s.as_ref().and_then(|s| s.shared.as_ref()).is_some_and(|sh| sh.is_evicted());
                let reason = if evicted {
                    "evicted: the session table was full (target.max_sessions) and an authenticated host took its place"
                } else {
                    "retired: a newer session of this host replaced it (reconnect fence)"
                };
                self.fail_session(rt, si as u16, reason.into());
            }
        }
    }

    /// Per turn: retires queue pairs when the fence generation moved, and
    /// answers the CONNECTs whose fence is over (or timed out).
    pub(super) fn check_fences(&mut self, rt: &mut Runtime) {
        if rt.registry.fence_generation() != self.fence_generation {
            self.retire_queue_pairs(rt);
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
                self.log_fence(rt, &f.old, now.saturating_duration_since(f.since));
                self.connect_session(rt, si, f.connect, Some(f.old.id));
            } else {
                rt.registry.counters.fence_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let e = Error::new(
                    ErrorKind::FenceTimeout,
                    format!(
                        "session {:#x} still has disk I/O in flight after {:?} (target.fence_timeout)",
                        f.old.id.0, self.fence_timeout
                    ),
                );
                tracing::warn!(host = %f.connect.host_id, replaces = %f.old.id, reason = %e, "fence: CONNECT answered FenceTimeout");
                self.answer_error(rt, si, f.connect.cid, e);
            }
        }
    }

    fn log_fence(&self, rt: &Runtime, old: &SharedSession, took: Duration) {
        let dropped = old.dropped();
        rt.registry.counters.fence_dropped_commands.fetch_add(dropped, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            host = %old.host_id,
            session = %old.id,
            "fence: session {} of host {} retired in {took:?}: {dropped} commands dropped before reaching the disk, every disk I/O it had submitted completed",
            old.id,
            old.host_id
        );
    }

    /// Creates or joins the session of a CONNECT (its receive slot is
    /// reposted already) and answers it.
    fn connect_session(&mut self, rt: &mut Runtime, si: u16, c: PendingConnect, replaced: Option<SessionId>) {
        let PendingConnect { cid, negotiated, host_id, authenticated, join, mut reply } = c;
        let sessions = Arc::clone(&self.sessions_table);
        let joined = {
            let mut admin = sessions.admin();
            match join {
                None => sessions.create(&mut admin, &host_id, authenticated, rt.id),
                Some(id) => sessions.join(&mut admin, id, &host_id, rt.id),
            }
        };
        let joined = match joined {
            Ok(j) => j,
            Err(e) => {
                let id = rt.id;
                let s = self.session(si);
                if e.kind() == ErrorKind::LimitReached {
                    tracing::warn!(host = %host_id, peer = %s.peer, reactor = id, reason = %e, "session refused");
                } else {
                    tracing::info!(host = %host_id, peer = %s.peer, reactor = id, reason = %e, "session join refused");
                }
                return self.answer_error(rt, si, cid, e);
            }
        };
        reply.session_id = joined.session.id;
        reply.queue_index = joined.queue_index;
        let id = rt.id;
        let s = self.session(si);
        let how = match (joined.created, replaced) {
            (false, _) => " (joined)".to_owned(),
            (true, None) => " (new session)".to_owned(),
            (true, Some(old)) => format!(" (new session, replaces {old})"),
        };
        tracing::info!(
            host = %host_id,
            session = %joined.session.id,
            queue = joined.queue_index,
            reactor = id,
            peer = %s.peer,
            queue_depth = negotiated.queue_depth,
            max_io_size = negotiated.max_io_size,
            "session connected{how}"
        );
        s.state.connected = Some(negotiated);
        s.state.host_id = Some(host_id);
        // Past its handshake: the slot goes back for the next connection.
        s.handshake = None;
        s.shared = Some(joined.session);
        s.queue_index = joined.queue_index;
        let data = reply.to_bytes();
        if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
            match data {
                Ok(d) => self.respond(rt, ci, &d, None),
                Err(e) => {
                    tracing::error!("cannot encode CONNECT reply: {e}");
                    self.cmd(ci).error = Some(ErrorKind::Internal);
                    self.respond(rt, ci, &[], None);
                }
            }
        }
    }

    /// Answers AUTH_NEGOTIATE or AUTH_REPLY: the reply data, or the
    /// failure's status (the same `AuthFailed` for every failed check).
    #[allow(clippy::too_many_arguments)]
    fn answer_auth(&mut self, rt: &mut Runtime, si: u16, slot: u16, len: usize, cid: CommandId, start: Instant, reply: Result<Vec<u8>>) {
        let data = match reply {
            Ok(d) => d,
            Err(e) => return self.refuse(rt, si, slot, len, cid, e, start),
        };
        self.repost_recv(rt, si, slot);
        if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
            self.respond(rt, ci, &data, None);
        }
    }

    /// Validates the capsule in receive slot `slot` against this reactor's
    /// volume snapshot and the session's opened set (read lock-free).
    fn plan_msg(&self, rt: &Runtime, si: u16, slot: u16, len: usize) -> (CommandId, Result<command::Plan>) {
        let s = self.sessions[si as usize].s.as_ref().expect("live session");
        let res = s.res.as_ref().expect("live queue pair");
        let msg = &res.recv.slot(slot as usize)[..len];
        let table = &rt.exec.volume_set().table;
        match &s.shared {
            Some(shared) => command::plan(msg, table, &self.limits, &s.state, &shared.open()),
            None => command::plan(msg, table, &self.limits, &s.state, &OpenSet::EMPTY),
        }
    }

    /// Answers a command that failed validation with its status (and counts
    /// it against its volume when it names one).
    #[allow(clippy::too_many_arguments)]
    fn refuse(&mut self, rt: &mut Runtime, si: u16, slot: u16, len: usize, cid: CommandId, e: Error, start: Instant) {
        let target = {
            let s = self.sessions[si as usize].s.as_ref().expect("live session");
            command::io_target(&s.res.as_ref().expect("live queue pair").recv.slot(slot as usize)[..len])
        };
        let s = self.session(si);
        match e.kind() {
            ErrorKind::VersionMismatch => tracing::warn!(peer = %s.peer, reason = %e, "refused"),
            ErrorKind::AccessDenied | ErrorKind::ReadOnly => {
                tracing::info!(host = %s.host(), peer = %s.peer, command = cid.0, reason = %e, "refused")
            }
            _ => tracing::debug!(host = %s.host(), peer = %s.peer, reason = %e, "command {} refused", cid.0),
        }
        if let Some((op, vid)) = target {
            let vslot = rt.exec.volume_set().table.index_of(vid).and_then(|i| rt.exec.slot_of_index(i));
            if let (Some(vslot), Some(oi)) = (vslot, metrics::op_index(op)) {
                rt.exec.count_refused(vslot, oi, start);
            }
        }
        self.repost_recv(rt, si, slot);
        if let Some(ci) = self.new_cmd(rt, si, cid, CmdKind::Immediate) {
            self.cmd(ci).error = Some(e.kind());
            self.respond(rt, ci, &[], None);
        }
    }

    fn start_io(&mut self, rt: &mut Runtime, si: u16, slot: u16, cid: CommandId, io: IoPlan, start: Instant) {
        let (kind, volume, offset, len, remote, op, opcode) = match io {
            IoPlan::Read { volume, offset, len, dest } => (CmdKind::Read, volume, offset, len, dest, exec::Op::Read, Opcode::Read),
            IoPlan::Write { volume, offset, len, source, fua } => match source {
                WriteSource::Descriptor(d) => (CmdKind::Write, volume, offset, len, d, exec::Op::Write { fua }, Opcode::Write),
                WriteSource::Inline => {
                    (CmdKind::WriteInline, volume, offset, len, DataDescriptor::default(), exec::Op::Write { fua }, Opcode::Write)
                }
            },
            IoPlan::Flush { volume } => (CmdKind::Flush, volume, 0, 0, DataDescriptor::default(), exec::Op::Flush, Opcode::Flush),
            IoPlan::Discard { volume, offset, len } | IoPlan::WriteZeroes { volume, offset, len } => {
                let discard = matches!(io, IoPlan::Discard { .. });
                let placeholder = exec::Op::Range { op: RangeOp::Nothing, ranges: ByteRanges::One((offset, len)) };
                let opcode = if discard { Opcode::Discard } else { Opcode::WriteZeroes };
                (CmdKind::Range, volume, offset, 0, DataDescriptor::default(), placeholder, opcode)
            }
        };
        let inline = kind == CmdKind::WriteInline;
        if !inline {
            self.repost_recv(rt, si, slot);
        }
        let Some(ci) = self.new_cmd(rt, si, cid, kind) else {
            if inline {
                self.repost_recv(rt, si, slot);
            }
            return;
        };
        self.cmd(ci).remote = remote;
        let vslot = rt.exec.slot_of_index(volume);
        let Some(vslot) = vslot else {
            if inline {
                self.repost_recv(rt, si, slot);
            }
            self.cmd(ci).error = Some(ErrorKind::Internal);
            self.respond(rt, ci, &[], None);
            return;
        };
        let op = match op {
            exec::Op::Range { ranges, .. } => {
                let backend = &rt.exec.volume(vslot).backend;
                let how = if opcode == Opcode::Discard { backend.discard() } else { backend.write_zeroes() };
                match how {
                    Some(how) => exec::Op::Range { op: how, ranges },
                    // Validation refused volumes without support already.
                    None => {
                        self.cmd(ci).error = Some(ErrorKind::NotSupported);
                        self.respond(rt, ci, &[], None);
                        return;
                    }
                }
            }
            op => op,
        };
        let metric = metrics::op_index(opcode).map(|i| i as u8);
        if inline && rt.exec.is_null(vslot) {
            // Its data is in hand and the null backend drops it: nothing
            // for the executor to fetch or write.
            self.repost_recv(rt, si, slot);
            rt.exec.count_done(vslot, metric, len as u64, start);
            self.respond(rt, ci, &[], None);
            return;
        }
        if inline {
            self.cmd(ci).held_recv = Some(slot);
        }
        let hold_key = self.sessions[si as usize].s.as_ref().and_then(|s| s.shared.as_ref()).map(|sh| sh.id);
        let req = Request {
            op,
            vslot,
            offset,
            len,
            metric,
            start,
            timed: true,
            accounts: self.accounts(rt, si),
            hold_key,
        };
        self.submit(rt, ci, req);
    }

    pub(super) fn repost_recv(&mut self, _rt: &mut Runtime, si: u16, slot: u16) {
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
            self.fail_session(_rt, si, format!("cannot post a receive: {e}"));
        }
    }

    /// QUEUE_FULL for a command that got no slot: inline SEND from the stack.
    pub(super) fn send_queue_full(&mut self, rt: &mut Runtime, si: u16, cid: CommandId) {
        let gen = self.sessions[si as usize].gen;
        let s = self.session(si);
        if s.closing.is_some() {
            return;
        }
        if s.noslot_sends >= s.slots || s.max_inline < RESPONSE_CAPSULE_SIZE as u32 || s.sq_used >= s.sq_cap {
            self.fail_session(rt, si, "protocol violation: initiator exceeds the queue depth".into());
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
            self.flush_session_sends(rt, si);
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
            self.fail_session(rt, si, format!("cannot post a response: {e}"));
        }
    }
}
