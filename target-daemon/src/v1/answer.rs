//! The v1 answers and the fabric work behind them: the executor's news
//! turned into RDMA READs (a write's data into its chunk) and RDMA WRITEs
//! (a read's data out of its chunk), the response capsules (their slots
//! and the send queue, posted together at the end of each turn), the
//! completions of what was posted, and the teardown of a queue pair.

use arrayvec::ArrayVec;

use rdmablk_common::fabric::{Completion, Payload, QpState, Rkey, SendOp, SendWr, WcStatus};
use rdmablk_common::protocol::{CommandId, ResponseCapsule, Status, RESPONSE_CAPSULE_SIZE, VOLUME_INFO_SIZE};

use super::*;
use crate::error::Error;

impl V1 {
    pub(super) fn new_cmd(&mut self, rt: &mut Runtime, si: u16, cid: CommandId, kind: CmdKind) -> Option<u16> {
        let ci = match self.free_cmds.pop() {
            Some(ci) => ci,
            None if self.cmds.len() < NONE16 as usize => {
                self.cmds.push(None);
                (self.cmds.len() - 1) as u16
            }
            None => {
                tracing::warn!("reactor {}: command slab full", rt.id);
                self.send_queue_full(rt, si, cid);
                return None;
            }
        };
        self.cmds[ci as usize] = Some(Cmd {
            sess: si,
            cid,
            kind,
            exec: None,
            remote: DataDescriptor::default(),
            held_recv: None,
            fabric_ops: 0,
            error: None,
            at_disk: false,
            responded: false,
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

    pub(super) fn session_closing(&self, si: u16) -> bool {
        self.sessions[si as usize].s.as_ref().is_none_or(|s| s.closing.is_some() || s.res.is_none())
    }

    // ---------------------------------------------------------------- the executor's news

    pub(super) fn on_exec(&mut self, rt: &mut Runtime, ci: u16, id: CmdId, ev: Event) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()).filter(|c| c.exec == Some(id)) else {
            // Nothing of ours waits for it: give back what it lends.
            tracing::error!("reactor {}: executor news {ev:?} for no v1 command", rt.id);
            match ev {
                Event::Read { chunk, .. } | Event::Buffer { chunk } => rt.exec.sent(chunk),
                Event::Fetch { chunk, .. } => rt.exec.placed(chunk, false),
                Event::Done { .. } => {}
            }
            return;
        };
        let (si, kind) = (cmd.sess, cmd.kind);
        let closing = self.session_closing(si);
        match ev {
            Event::Read { chunk, off, len, zero, last } => {
                let piece = Piece { chunk, off, len, zero };
                if closing || self.cmd(ci).error.is_some() {
                    rt.exec.sent(chunk);
                } else if last {
                    // The last piece: its RDMA WRITE and the response in one chain.
                    self.respond(rt, ci, &[], Some(piece));
                } else {
                    self.post_rdma(rt, si, ci, piece, false);
                }
            }
            Event::Fetch { chunk, off, len } => {
                if closing {
                    return rt.exec.placed(chunk, false);
                }
                if kind == CmdKind::WriteInline {
                    let slot = self.cmd(ci).held_recv.take().expect("inline data held");
                    let res = self.sessions[si as usize].s.as_ref().and_then(|s| s.res.as_ref()).expect("live queue pair");
                    let src = &res.recv.slot(slot as usize)[COMMAND_CAPSULE_SIZE + off as usize..COMMAND_CAPSULE_SIZE + (off + len) as usize];
                    rt.exec.bytes_mut(chunk)[..len as usize].copy_from_slice(src);
                    self.repost_recv(rt, si, slot);
                    rt.exec.placed(chunk, true);
                } else {
                    self.post_rdma(rt, si, ci, Piece { chunk, off, len, zero: false }, true);
                }
            }
            Event::Buffer { chunk } => {
                if closing {
                    return rt.exec.sent(chunk);
                }
                let entries = self.cmd(ci).list_entries as usize;
                let who = self.sessions[si as usize].s.as_ref().map(|s| s.state.identity());
                let set = Arc::clone(rt.exec.volume_set());
                let buf = rt.exec.bytes_mut(chunk);
                let visible = who.into_iter().flat_map(|who| set.table.visible_to(who));
                for (i, (m, grant)) in visible.take(entries).enumerate() {
                    match m.info_for(grant).to_bytes() {
                        Ok(b) => buf[i * VOLUME_INFO_SIZE..(i + 1) * VOLUME_INFO_SIZE].copy_from_slice(&b),
                        Err(e) => tracing::error!("cannot encode volume info: {e}"),
                    }
                }
                let piece = Piece { chunk, off: 0, len: (entries * VOLUME_INFO_SIZE) as u32, zero: false };
                self.respond(rt, ci, &[], Some(piece));
            }
            Event::Done { result, reached_disk } => {
                let cmd = self.cmd(ci);
                cmd.exec = None;
                cmd.at_disk = reached_disk;
                if let Err(k) = result {
                    cmd.error.get_or_insert(k);
                }
                if let Some(slot) = cmd.held_recv.take() {
                    // An inline write that failed before its data was taken.
                    self.repost_recv(rt, si, slot);
                }
                let cmd = self.cmd(ci);
                let answered = cmd.responded || cmd.answer_waits;
                let ends_with_done = matches!(kind, CmdKind::Write | CmdKind::WriteInline | CmdKind::Flush | CmdKind::Range);
                if !answered && !closing && (ends_with_done || cmd.error.is_some()) {
                    self.respond(rt, ci, &[], None);
                }
                self.maybe_free_cmd(rt, ci);
            }
        }
    }

    // ---------------------------------------------------------------- fabric completions

    pub(super) fn on_completion(&mut self, rt: &mut Runtime, wc: Completion) {
        let (kind, gen, si, a, b) = split_wr_id(wc.wr_id);
        let live = self.sessions.get(si as usize).is_some_and(|slot| {
            slot.gen & 0xfff == gen && slot.s.as_ref().is_some_and(|s| s.res.is_some() && s.qp_num == wc.qp_num)
        });
        if !live {
            tracing::trace!("stale completion {wc:?}");
            return;
        }
        match kind {
            K_RECV => self.on_recv(rt, si, a, wc),
            K_SEND => self.on_send(rt, si, a, b, wc),
            K_RDMA => self.on_rdma(rt, si, a, ChunkId(b), wc),
            K_SEND_NOSLOT => {
                let s = self.session(si);
                s.sq_used -= 1;
                s.noslot_sends -= 1;
                if wc.status != WcStatus::Success {
                    self.fail_session(rt, si, completion_reason("response SEND", wc.status));
                }
            }
            _ => tracing::error!("completion with unknown wr_id {:#x}", wc.wr_id.0),
        }
        if self.sessions[si as usize].s.as_ref().is_some_and(|s| !s.resp_wait.is_empty()) {
            // A send completion made room for answers that waited.
            self.post_waiting_responses(rt, si);
        }
        self.maybe_free_session(rt, si);
    }

    fn on_send(&mut self, rt: &mut Runtime, si: u16, slot: u16, ci: u16, wc: Completion) {
        let s = self.session(si);
        s.sq_used -= 1;
        let res = s.res.as_mut().expect("live queue pair");
        res.resp.reclaim(slot as usize);
        s.free_resp.push(slot);
        if let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()).filter(|c| c.sess == si) {
            cmd.send_inflight = false;
        }
        if wc.status != WcStatus::Success {
            self.fail_session(rt, si, completion_reason("response SEND", wc.status));
        }
        self.maybe_free_cmd(rt, ci);
        self.post_waiting_responses(rt, si);
    }

    fn on_rdma(&mut self, rt: &mut Runtime, si: u16, ci: u16, c: ChunkId, wc: Completion) {
        self.session(si).sq_used -= 1;
        let pool = rt.exec.engine().pool();
        let valid = (c.0 as usize) < pool.capacity()
            && pool.is_lent_to_fabric(c)
            && self.cmds.get(ci as usize).and_then(|x| x.as_ref()).is_some_and(|cmd| cmd.sess == si && cmd.fabric_ops > 0);
        if !valid {
            tracing::error!("RDMA completion for a chunk not lent: {wc:?}");
            return;
        }
        rt.exec.engine_mut().pool_mut().return_from_fabric(c);
        let cmd = self.cmd(ci);
        cmd.fabric_ops -= 1;
        // A WRITE command's RDMA READ brought its data; a READ's (or a
        // LIST's) RDMA WRITE sent it.
        let fetching = matches!(cmd.kind, CmdKind::Write);
        let ok = wc.status == WcStatus::Success;
        if !ok {
            let what = if fetching { "RDMA READ" } else { "RDMA WRITE" };
            let usable = wc.status != WcStatus::WrFlushError
                && self.session(si).res.as_ref().is_some_and(|r| r.qp.state() == QpState::Ready);
            if usable {
                tracing::warn!("command {}: {what} failed ({:?}, {} bytes); queue pair still usable", self.cmd(ci).cid.0, wc.status, wc.byte_len);
                self.cmd(ci).error.get_or_insert(ErrorKind::Transfer);
            } else {
                self.fail_session(rt, si, completion_reason(what, wc.status));
            }
        }
        if fetching {
            rt.exec.placed(c, ok);
        } else {
            rt.exec.sent(c);
        }
        self.maybe_free_cmd(rt, ci);
    }

    /// Posts one RDMA operation for a piece: an RDMA READ into its chunk (a
    /// WRITE command's data) or an RDMA WRITE from it (a READ's).
    fn post_rdma(&mut self, rt: &mut Runtime, si: u16, ci: u16, p: Piece, read: bool) {
        let gen = self.sessions[si as usize].gen;
        let remote = self.cmd(ci).remote;
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        if s.sq_used >= s.sq_cap {
            if read {
                rt.exec.placed(p.chunk, false);
            } else {
                rt.exec.sent(p.chunk);
            }
            self.fail_session(rt, si, "send queue overflow (internal error)".into());
            return;
        }
        let mr = &rt.fabrics[s.fabric].pool_mr;
        let sge = if p.zero { mr.zero_sge(p.len) } else { mr.sge(p.chunk, 0, p.len) };
        let addr = remote.remote_addr.wrapping_add(p.off as u64);
        let op = if read {
            SendOp::RdmaRead { remote_addr: addr, rkey: Rkey(remote.rkey) }
        } else {
            SendOp::RdmaWrite { remote_addr: addr, rkey: Rkey(remote.rkey) }
        };
        let wr = QueuedWr { wr_id: wr_id(K_RDMA, gen, si, ci, p.chunk.0), op, sge, inline: false };
        rt.exec.engine_mut().pool_mut().lend_to_fabric(p.chunk);
        // If the post fails the work request may or may not be posted: keep
        // the chunk lent and counted; the flush (or FLUSH_TIMEOUT) returns it.
        s.sq_used += 1;
        self.queue_send(si, &[wr]);
        self.cmd(ci).fabric_ops += 1;
    }

    /// Queues send work requests for the end of this turn (`flush_sends`).
    fn queue_send(&mut self, si: u16, wrs: &[QueuedWr]) {
        let s = self.session(si);
        let first = s.tx.is_empty();
        s.tx.extend_from_slice(wrs);
        if first {
            self.tx_pending.push(si);
        }
    }

    /// Posts every queue pair's queued work requests, in order, a chunk per
    /// `post_send`. Runs at the end of each turn and before a queue pair
    /// fails (so what it queued is flushed like everything else posted).
    pub(super) fn flush_sends(&mut self, rt: &mut Runtime) {
        while let Some(si) = self.tx_pending.pop() {
            self.flush_session_sends(rt, si);
        }
    }

    pub(super) fn flush_session_sends(&mut self, rt: &mut Runtime, si: u16) {
        let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
        let Some(res) = s.res.as_ref() else {
            s.tx.clear();
            return;
        };
        let mut failed = None;
        for chunk in s.tx.chunks(TX_CHUNK) {
            // Filled in place, neither over a zeroed array nor collected
            // (which copies the whole array out): this runs for every answer.
            let mut wrs = ArrayVec::<SendWr, TX_CHUNK>::new();
            wrs.extend(chunk.iter().map(|q| {
                // An inline response is copied from its (lent) slot at post time.
                let payload =
                    if q.inline { Payload::Inline(res.resp.lent_bytes(&q.sge)) } else { Payload::Sges(std::slice::from_ref(&q.sge)) };
                SendWr { wr_id: q.wr_id, op: q.op, payload, signaled: true }
            }));
            if let Err(e) = res.qp.post_send(&wrs) {
                failed = Some(e);
                break;
            }
        }
        s.tx.clear();
        if let Some(e) = failed {
            self.fail_session(rt, si, format!("cannot post to the send queue: {e}"));
        }
    }

    // ---------------------------------------------------------------- responses

    /// Answers command `ci` (after an RDMA WRITE of `chain`, in the same
    /// post, when it has one).
    pub(super) fn respond(&mut self, rt: &mut Runtime, ci: u16, data: &[u8], chain: Option<Piece>) {
        let si = self.cmds[ci as usize].as_ref().expect("live command").sess;
        if self.session_closing(si) {
            if let Some(p) = chain {
                rt.exec.sent(p.chunk);
            }
            self.mark_responded(ci);
            self.maybe_free_cmd(rt, ci);
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
            rt.stats.answers_delayed.add(1);
            return;
        }
        self.post_response(rt, ci, data, chain);
    }

    /// Answers the responses that waited for a response slot, while there
    /// are slots and send-queue room (after a send completion).
    fn post_waiting_responses(&mut self, rt: &mut Runtime, si: u16) {
        loop {
            let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
            let Some(w) = s.resp_wait.front() else { return };
            let need = 1 + w.chain.is_some() as u32;
            if s.closing.is_some() || s.free_resp.is_empty() || s.sq_used + need > s.sq_cap {
                return;
            }
            let w = s.resp_wait.pop_front().expect("checked");
            self.post_response(rt, w.ci, &w.data, w.chain);
        }
    }

    /// The answer to a command: the initiator may reuse its slot once it
    /// holds it, so from here on the command no longer counts against the
    /// queue depth (its slab entry lives until its send completion).
    fn mark_responded(&mut self, ci: u16) {
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
    fn post_response(&mut self, rt: &mut Runtime, ci: u16, data: &[u8], chain: Option<Piece>) {
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
            Some(p) => {
                let mr = &rt.fabrics[s.fabric].pool_mr;
                let sge = if p.zero { mr.zero_sge(p.len) } else { mr.sge(p.chunk, 0, p.len) };
                rt.exec.engine_mut().pool_mut().lend_to_fabric(p.chunk);
                let write = QueuedWr {
                    wr_id: wr_id(K_RDMA, gen, si, ci, p.chunk.0),
                    op: SendOp::RdmaWrite { remote_addr: remote.remote_addr.wrapping_add(p.off as u64), rkey: Rkey(remote.rkey) },
                    sge,
                    inline: false,
                };
                self.queue_send(si, &[write, send]);
                self.cmd(ci).fabric_ops += 1;
            }
        }
        self.mark_responded(ci);
        let cmd = self.cmds[ci as usize].as_mut().expect("live command");
        cmd.answer_waits = false;
        cmd.send_inflight = true;
    }

    // ---------------------------------------------------------------- teardown

    /// Frees command `ci` once nothing of it is in flight: its executor
    /// part is done, its RDMA operations and its response's SEND completed,
    /// and it was answered (or its queue pair is closing).
    pub(super) fn maybe_free_cmd(&mut self, rt: &mut Runtime, ci: u16) {
        let Some(cmd) = self.cmds.get(ci as usize).and_then(|c| c.as_ref()) else { return };
        let si = cmd.sess;
        let closing = self.session_closing(si);
        if cmd.exec.is_some() || cmd.fabric_ops > 0 || cmd.send_inflight || !(cmd.responded || closing) {
            return;
        }
        let (dropped, responded) = (!cmd.responded && !cmd.at_disk, cmd.responded);
        if let Some(slot) = cmd.held_recv {
            self.repost_recv(rt, si, slot);
        }
        self.cmds[ci as usize] = None;
        self.free_cmds.push(ci);
        if let Some(s) = self.sessions[si as usize].s.as_mut() {
            if dropped {
                if let Some(sh) = s.shared.as_ref() {
                    sh.count_dropped(1);
                }
            }
            if !responded {
                s.state.outstanding -= 1;
            }
            s.live_cmds -= 1;
        }
        self.maybe_free_session(rt, si);
    }

    /// Lets go of every command of queue pair `si`: what waits for the
    /// executor is abandoned there (what reached the disk runs to its end),
    /// the rest is freed once its RDMA operations flushed.
    fn free_session_cmds(&mut self, rt: &mut Runtime, si: u16) {
        for ci in 0..self.cmds.len() {
            let Some(cmd) = self.cmds[ci].as_ref().filter(|c| c.sess == si) else { continue };
            if let Some(id) = cmd.exec {
                rt.exec.abandon(id);
            }
            self.maybe_free_cmd(rt, ci as u16);
        }
    }

    /// Destroys a queue pair whose work requests did not all flush. Chunks
    /// lent to it come back; commands still waiting for the disk stay until done.
    pub(super) fn force_teardown(&mut self, rt: &mut Runtime, si: u16) {
        let fi = self.sessions[si as usize].s.as_ref().expect("live session").fabric;
        for c in 0..rt.exec.engine().pool().capacity() {
            let chunk = ChunkId(c as u16);
            if !rt.exec.engine().pool().is_lent_to_fabric(chunk) {
                continue;
            }
            let Some((owner, _)) = rt.exec.chunk_owner(chunk) else { continue };
            if owner.transport as usize != self.index || rt.fabrics[fi].owner != self.index {
                continue;
            }
            let ci = owner.tag as u16;
            let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()).filter(|c| c.sess == si && c.fabric_ops > 0) else {
                continue;
            };
            cmd.fabric_ops -= 1;
            let fetching = cmd.kind == CmdKind::Write;
            rt.exec.engine_mut().pool_mut().return_from_fabric(chunk);
            if fetching {
                rt.exec.placed(chunk, false);
            } else {
                rt.exec.sent(chunk);
            }
        }
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        s.res = None;
        s.sq_used = 0;
        s.recv_posted = 0;
        s.noslot_sends = 0;
        for cmd in self.cmds.iter_mut().flatten().filter(|c| c.sess == si) {
            cmd.send_inflight = false;
            cmd.fabric_ops = 0;
        }
        self.free_session_cmds(rt, si);
        self.maybe_free_session(rt, si);
    }

    /// Stops using a queue pair: disconnects it, and frees it once every
    /// work request has flushed and its commands' disk operations completed.
    pub(super) fn fail_session(&mut self, rt: &mut Runtime, si: u16, reason: String) {
        let Some(s) = self.sessions[si as usize].s.as_ref() else { return };
        if s.closing.is_some() {
            return;
        }
        if !s.tx.is_empty() {
            // Posted before the disconnect, they flush and settle their
            // accounting like everything else outstanding. (A failed post
            // fails the session itself.)
            self.flush_session_sends(rt, si);
        }
        let Some(s) = self.sessions[si as usize].s.as_mut() else { return };
        if s.closing.is_some() {
            return;
        }
        match &s.shared {
            Some(sh) => tracing::info!(
                host = %s.host(),
                session = %sh.id,
                queue = s.queue_index,
                reactor = rt.id,
                peer = %s.peer,
                %reason,
                "session disconnected"
            ),
            None => tracing::info!(host = %s.host(), reactor = rt.id, peer = %s.peer, %reason, "session disconnected"),
        }
        s.closing = Some(reason);
        s.close_deadline = Some(Instant::now() + FLUSH_TIMEOUT);
        // Answers that waited for a response slot are never sent.
        let waiting = std::mem::take(&mut s.resp_wait);
        if let Some(res) = &s.res {
            res.qp.disconnect();
        }
        for w in waiting {
            if let Some(p) = w.chain {
                rt.exec.sent(p.chunk);
            }
        }
        self.free_session_cmds(rt, si);
        self.maybe_free_session(rt, si);
    }

    pub(super) fn maybe_free_session(&mut self, rt: &mut Runtime, si: u16) {
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
        rt.fabrics[s.fabric].cqs[s.cq].reserved -= s.cq_reserved;
        self.free_sessions.push(si);
        rt.stats.queue_pairs.set(rt.stats.queue_pairs.get().saturating_sub(1));
        tracing::debug!("queue pair {} freed", s.peer);
        if let Some(shared) = &s.shared {
            if self.sessions_table.leave(shared, rt.id) {
                tracing::info!(
                    host = %shared.host_id,
                    session = %shared.id,
                    reason = %format_args!(
                        "its last queue pair is gone; {} commands dropped before reaching the disk",
                        shared.dropped()
                    ),
                    "session ended"
                );
            }
        }
        drop(s);
    }
}
