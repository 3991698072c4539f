//! A reactor's fabric side: the completion queues it polls, the RDMA READs
//! and WRITEs that move a command's data between the initiator's buffer
//! and a pool chunk (direct placement), and the queued SENDs.

use arrayvec::ArrayVec;

use super::*;

impl Reactor {
    /// A completion queue of fabric `fi` with room for `reserve` more
    /// entries beside the pool's RDMA operations, created if none has.
    pub(super) fn cq_with_room(&mut self, fi: usize, reserve: u32) -> Result<usize> {
        let chunks = self.engine.pool_mut().capacity() as u32;
        let f = &self.fabrics[fi];
        if let Some(ci) = f.cqs.iter().position(|c| c.reserved + reserve <= c.capacity.saturating_sub(chunks)) {
            return Ok(ci);
        }
        let ci = f.cqs.len();
        let cq = new_cq(&f.fabric, &self.epoll, fi, ci, chunks, self.queue_depth)?;
        tracing::info!(
            "reactor {}: {}: completion queue {} of {} entries created ({} queue pairs served)",
            self.id,
            f.fabric.url(),
            ci + 1,
            cq.capacity,
            self.stats.queue_pairs.get()
        );
        self.fabrics[fi].cqs.push(cq);
        Ok(ci)
    }

    pub(super) fn poll_fabrics(&mut self) -> Result<usize> {
        let mut total = 0;
        for fi in 0..self.fabrics.len() {
            for ci in 0..self.fabrics[fi].cqs.len() {
                for _ in 0..CQ_ROUNDS {
                    let cq = &self.fabrics[fi].cqs[ci].cq;
                    let n = cq.poll(&mut self.wcs).map_err(|e| Error::fabric("completion queue poll failed", e))?;
                    for i in 0..n {
                        let wc = self.wcs[i];
                        self.on_completion(wc);
                    }
                    total += n;
                    if n < self.wcs.len() {
                        break;
                    }
                }
            }
        }
        Ok(total)
    }

    pub(super) fn on_completion(&mut self, wc: Completion) {
        let (kind, gen, si, a, b) = split_wr_id(wc.wr_id);
        let live = self.sessions.get(si as usize).is_some_and(|slot| {
            slot.gen & 0xfff == gen && slot.s.as_ref().is_some_and(|s| s.res.is_some() && s.qp_num == wc.qp_num)
        });
        if !live {
            tracing::trace!("stale completion {wc:?}");
            return;
        }
        match kind {
            K_RECV => self.on_recv(si, a, wc),
            K_SEND => self.on_send(si, a, b, wc),
            K_RDMA => self.on_rdma(si, a, ChunkId(b), wc),
            K_SEND_NOSLOT => {
                let s = self.session(si);
                s.sq_used -= 1;
                s.noslot_sends -= 1;
                if wc.status != WcStatus::Success {
                    self.fail_session(si, completion_reason("response SEND", wc.status));
                }
            }
            _ => tracing::error!("completion with unknown wr_id {:#x}", wc.wr_id.0),
        }
        if self.sessions[si as usize].s.as_ref().is_some_and(|s| !s.resp_wait.is_empty()) {
            // A send completion made room for answers that waited.
            self.post_waiting_responses(si);
        }
        self.maybe_free_session(si);
    }

    pub(super) fn on_send(&mut self, si: u16, slot: u16, ci: u16, wc: Completion) {
        let s = self.session(si);
        s.sq_used -= 1;
        let res = s.res.as_mut().expect("live queue pair");
        res.resp.reclaim(slot as usize);
        s.free_resp.push(slot);
        if let Some(cmd) = self.cmds.get_mut(ci as usize).and_then(|c| c.as_mut()).filter(|c| c.sess == si) {
            cmd.send_inflight = false;
        }
        if wc.status != WcStatus::Success {
            self.fail_session(si, completion_reason("response SEND", wc.status));
        }
        self.maybe_free_cmd(ci);
        self.post_waiting_responses(si);
    }

    pub(super) fn on_rdma(&mut self, si: u16, ci: u16, c: ChunkId, wc: Completion) {
        self.session(si).sq_used -= 1;
        let valid = (c.0 as usize) < self.engine.pool_mut().capacity()
            && self.engine.pool_mut().is_lent_to_fabric(c)
            && self.chunk_use[c.0 as usize].cmd == ci
            && self.cmds.get(ci as usize).and_then(|x| x.as_ref()).is_some_and(|cmd| cmd.sess == si);
        if !valid {
            tracing::error!("RDMA completion for a chunk not lent: {wc:?}");
            return;
        }
        self.engine.pool_mut().return_from_fabric(c);
        let use_ = self.chunk_use[c.0 as usize];
        let cmd = self.cmd(ci);
        cmd.inflight -= 1;
        let kind = cmd.kind;
        let ok = wc.status == WcStatus::Success && (kind != CmdKind::Write || wc.byte_len == use_.len);
        if !ok {
            self.engine.pool_mut().release(c);
            let what = if kind == CmdKind::Write { "RDMA READ" } else { "RDMA WRITE" };
            let usable = wc.status != WcStatus::WrFlushError
                && self.session(si).res.as_ref().is_some_and(|r| r.qp.state() == QpState::Ready);
            if usable {
                tracing::warn!("command {}: {what} failed ({:?}, {} bytes); queue pair still usable", self.cmd(ci).cid.0, wc.status, wc.byte_len);
                self.cmd(ci).error.get_or_insert(ErrorKind::Transfer);
                self.progress(ci);
            } else {
                self.fail_session(si, completion_reason(what, wc.status));
                self.maybe_free_cmd(ci);
            }
            return;
        }
        let closing = self.session(si).closing.is_some();
        let cmd = self.cmd(ci);
        if kind == CmdKind::Write && !closing && cmd.error.is_none() && cmd.null {
            // The data crossed the fabric; the null backend drops it.
            cmd.done += use_.len;
            self.engine.pool_mut().release(c);
            self.progress(ci);
            return;
        }
        if kind == CmdKind::Write && !closing && cmd.error.is_none() {
            cmd.inflight += 1;
            self.write_chunk(ci, c);
            return;
        }
        self.engine.pool_mut().release(c);
        self.progress(ci);
    }

    // ---------------------------------------------------------------- io_uring completions

    /// Posts one RDMA op for a chunk: RDMA READ into it (WRITE command) or
    /// RDMA WRITE from it (READ command).
    pub(super) fn post_rdma(&mut self, si: u16, ci: u16, c: ChunkId, read: bool) {
        let gen = self.sessions[si as usize].gen;
        let use_ = self.chunk_use[c.0 as usize];
        let remote = self.cmd(ci).remote;
        let s = self.sessions[si as usize].s.as_mut().expect("live session");
        if s.sq_used >= s.sq_cap {
            self.engine.pool_mut().release(c);
            self.fail_session(si, "send queue overflow (internal error)".into());
            return;
        }
        let mr = &self.fabrics[s.fabric].pool_mr;
        let sge = if use_.zero { mr.zero_sge(use_.len) } else { mr.sge(c, 0, use_.len) };
        let addr = remote.remote_addr.wrapping_add(use_.off as u64);
        let op = if read {
            SendOp::RdmaRead { remote_addr: addr, rkey: Rkey(remote.rkey) }
        } else {
            SendOp::RdmaWrite { remote_addr: addr, rkey: Rkey(remote.rkey) }
        };
        let wr = QueuedWr { wr_id: wr_id(K_RDMA, gen, si, ci, c.0), op, sge, inline: false };
        self.engine.pool_mut().lend_to_fabric(c);
        // If the post fails the work request may or may not be posted: keep
        // the chunk lent and counted; the flush (or FLUSH_TIMEOUT) returns it.
        s.sq_used += 1;
        self.queue_send(si, &[wr]);
        if let Some(cmd) = self.cmds[ci as usize].as_mut() {
            cmd.inflight += 1;
        }
    }

    /// Queues send work requests for the end of this turn (`flush_sends`).
    pub(super) fn queue_send(&mut self, si: u16, wrs: &[QueuedWr]) {
        let s = self.session(si);
        let first = s.tx.is_empty();
        s.tx.extend_from_slice(wrs);
        if first {
            self.tx_pending.push(si);
        }
    }

    /// Posts every session's queued work requests, in order, a chunk per
    /// `post_send`. Runs at the end of each turn and before a session
    /// fails (so what it queued is flushed like everything else posted).
    pub(super) fn flush_sends(&mut self) {
        while let Some(si) = self.tx_pending.pop() {
            self.flush_session_sends(si);
        }
    }

    pub(super) fn flush_session_sends(&mut self, si: u16) {
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
            self.fail_session(si, format!("cannot post to the send queue: {e}"));
        }
    }

    /// A read chunk is in the pool buffer (or, for the null backend, is
    /// zeroes): send it, chained with the response if it is the last.
    pub(super) fn read_chunk_done(&mut self, si: u16, ci: u16, chunk: ChunkId) {
        let use_ = self.chunk_use[chunk.0 as usize];
        let cmd = self.cmd(ci);
        cmd.done += use_.len;
        if cmd.done == cmd.len {
            // The last chunk: its RDMA WRITE and the response in one chain.
            self.respond(ci, &[], Some(chunk));
        } else {
            self.post_rdma(si, ci, chunk, false);
        }
    }

    // ---------------------------------------------------------------- readahead
}
