//! Fabrics commands: Connect, Property Get and Set, Disconnect.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use rdmablk_common::nvme::fabrics::{
    connect_data_offset, fctype, invalid_connect_parameter, property, Connect, ConnectData, Property, ANY_CONTROLLER,
    DISCOVERY_NQN,
};
use rdmablk_common::nvme::sqe::SubmissionEntry;
use rdmablk_common::nvme::status::Status;
use rdmablk_common::nvme::WireError;

use super::auth_cmd::{self, QueueAuth};
use super::identify::VERSION;
use super::queue::{Connected, Fence, Queue, Reply};
use super::MAX_IO_QUEUES;

/// CC fields.
const CC_EN: u32 = 1;
const CC_SHN_MASK: u32 = 0b11 << 14;
/// CSTS fields.
const CSTS_RDY: u32 = 1;
const CSTS_CFS: u32 = 1 << 1;
const CSTS_SHST_COMPLETE: u32 = 0b10 << 2;

/// CAP: MQES (`target.nvme_queue_size` entries, 0-based), CQR (contiguous
/// queues required), TO (7.5 s in 500 ms units), CSS bit 37 (the NVM
/// command set), MPSMIN = MPSMAX = 4 KiB.
pub fn cap(queue_entries: u32) -> u64 {
    (queue_entries as u64 - 1) | 1 << 16 | 15 << 24 | 1 << 37
}

pub fn handle(q: &mut Queue, sqe: &SubmissionEntry, data: &[u8]) -> Reply {
    match sqe.fctype() {
        fctype::CONNECT => connect(q, sqe, data),
        fctype::PROPERTY_GET | fctype::PROPERTY_SET if q.is_admin() => property(q, sqe),
        // Fabrics commands an I/O queue does not take (NVMe Base, Figure 574).
        fctype::PROPERTY_GET | fctype::PROPERTY_SET => Reply::status(Status::INVALID_FIELD),
        fctype::DISCONNECT => disconnect(q, sqe),
        fctype::AUTHENTICATION_SEND => auth_cmd::send(q, sqe, data),
        fctype::AUTHENTICATION_RECEIVE => auth_cmd::receive(q, sqe),
        _ => Reply::status(Status::INVALID_OPCODE),
    }
}

/// Deletes the I/O queue it is sent on: the queue closes once the answer
/// is out (NVMe/TCP: the host then closes the connection). The admin queue
/// is not deleted this way (NVMe Base, section 6.4).
fn disconnect(q: &mut Queue, sqe: &SubmissionEntry) -> Reply {
    if q.is_admin() {
        return Reply::status(Status::INVALID_QUEUE_TYPE);
    }
    // RECFMT, bytes 41:40: only format 0 is defined.
    if sqe.cdw[0] & 0xffff != 0 {
        return Reply::status(Status::CONNECT_INCOMPATIBLE_FORMAT);
    }
    q.actions.push(super::queue::Action::Close(super::CloseReason::by_host("Disconnect")));
    Reply::ok()
}

fn bad_data(offset: u16) -> Reply {
    Reply::Done { status: Status::CONNECT_INVALID_PARAMETERS, result: invalid_connect_parameter(true, offset) }
}

fn connect(q: &mut Queue, sqe: &SubmissionEntry, data: &[u8]) -> Reply {
    if q.conn.is_some() {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    let c = Connect::from_entry(sqe);
    if c.recfmt != 0 {
        return Reply::status(Status::CONNECT_INCOMPATIBLE_FORMAT);
    }
    let d = match ConnectData::decode(data) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(peer = %q.peer, reason = %e, "nvme connect from host refused");
            return bad_data(match e {
                WireError::BadNqn { field: "host NQN", .. } => connect_data_offset::HOST_NQN,
                WireError::ReservedNotZero { offset, .. } => offset as u16,
                _ => connect_data_offset::SUBSYSTEM_NQN,
            });
        }
    };
    let discovery = d.subsystem_nqn == DISCOVERY_NQN;
    if !discovery && d.subsystem_nqn != q.sub.nqn {
        tracing::warn!(host = %d.host_nqn, peer = %q.peer, subsystem = %d.subsystem_nqn, "nvme connect from host refused: unknown subsystem");
        return bad_data(connect_data_offset::SUBSYSTEM_NQN);
    }
    let entries = c.queue_entries();
    if c.sqsize == 0 || entries > q.sub.cfg.nvme_queue_size {
        return Reply::Done { status: Status::CONNECT_INVALID_PARAMETERS, result: invalid_connect_parameter(false, 44) };
    }
    let set = q.sub.registry.volumes();
    let host = q.sub.host_view(&set, &d.host_nqn);
    if !discovery && set.access.hosts_configured() && host.id.is_none() {
        tracing::warn!(host = %d.host_nqn, peer = %q.peer, "nvme connect from host refused: not a [[host]] nqn");
        return Reply::status(Status::CONNECT_INVALID_HOST);
    }
    if c.qid == 0 {
        if d.controller_id != ANY_CONTROLLER {
            return bad_data(connect_data_offset::CONTROLLER_ID);
        }
        // The fence: a host that comes back after its old association was
        // torn down starts only once the old one's writes are done (and an
        // old association whose connections were just reset is seen as
        // torn down first).
        if !discovery {
            match q.fence(&d.host_nqn) {
                Fence::Wait { for_turns } => return Reply::Fence { for_turns },
                Fence::Go => {}
                Fence::GaveUp => {
                    tracing::warn!(
                        host = %d.host_nqn,
                        peer = %q.peer,
                        "nvme connect from host refused: an old controller still has writes in flight after {:?} (target.fence_timeout)",
                        q.sub.cfg.fence_timeout
                    );
                    return Reply::status(Status::CONNECT_CONTROLLER_BUSY);
                }
            }
        }
        // A host with a DH-HMAC-CHAP secret authenticates every queue before
        // anything else (require_auth below): anonymous controllers make room for it.
        let protected = set.access.nvme_auth(&d.host_nqn).is_some();
        let ctrl = match q.sub.create_controller(&d.host_nqn, d.host_id, discovery, protected, c.kato_ms) {
            Ok(ctrl) => ctrl,
            Err(why) => {
                tracing::warn!(host = %d.host_nqn, peer = %q.peer, reason = %why, "nvme connect from host refused");
                return Reply::status(Status::CONNECT_CONTROLLER_BUSY);
            }
        };
        q.sq_entries = entries;
        ctrl.add_queue(0);
        tracing::info!(
            host = %d.host_nqn,
            peer = %q.peer,
            controller = ctrl.id,
            kato_ms = c.kato_ms,
            "nvme controller {} created{}",
            ctrl.id,
            if discovery { " (discovery)" } else { "" }
        );
        let id = ctrl.id;
        q.conn = Some(Connected { qid: 0, ctrl, host });
        q.sub.stats.queues.fetch_add(1, Ordering::Relaxed);
        // Its keep-alive and idle clocks start now, not when the Connect
        // came: the fence may have held it for longer than either.
        q.last_heard = Instant::now();
        q.kept_alive();
        let atr = if discovery { 0 } else { require_auth(q, &set, &d.host_nqn) };
        return Reply::Done { status: Status::SUCCESS, result: id as u64 | atr };
    }
    // An I/O queue joins the controller its admin queue created.
    let Some(ctrl) = q.sub.controller(d.controller_id) else { return bad_data(connect_data_offset::CONTROLLER_ID) };
    if ctrl.host_nqn != d.host_nqn || ctrl.host_id != d.host_id || ctrl.is_dead() {
        return bad_data(connect_data_offset::CONTROLLER_ID);
    }
    if ctrl.discovery {
        return Reply::status(Status::INVALID_QUEUE_ID);
    }
    let (enabled, granted) = {
        let st = ctrl.state.lock().unwrap_or_else(|e| e.into_inner());
        (st.csts & CSTS_RDY != 0, st.queues_granted.unwrap_or(MAX_IO_QUEUES - 1))
    };
    if !enabled {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    if c.qid > granted + 1 {
        return Reply::status(Status::INVALID_QUEUE_ID);
    }
    if !ctrl.add_queue(c.qid) {
        return Reply::status(Status::INVALID_QUEUE_ID);
    }
    q.sq_entries = entries;
    ctrl.live_queues.fetch_add(1, Ordering::AcqRel);
    q.conn = Some(Connected { qid: c.qid, ctrl: Arc::clone(&ctrl), host });
    q.sub.stats.queues.fetch_add(1, Ordering::Relaxed);
    // Every queue of a host with a DH-HMAC-CHAP secret authenticates.
    let atr = require_auth(q, &set, &d.host_nqn);
    Reply::Done { status: Status::SUCCESS, result: ctrl.id as u64 | atr }
}

/// A host with `dhchap_key_file` must authenticate this queue: its state
/// is set up and the Connect's answer says so (AUTHREQ.ATR), else 0.
fn require_auth(q: &mut Queue, set: &crate::backend::VolumeSet, host_nqn: &str) -> u64 {
    let Some(keys) = set.access.nvme_auth(host_nqn) else { return 0 };
    let due = Instant::now() + q.sub.cfg.handshake_timeout;
    q.auth = Some(Box::new(QueueAuth::new(Arc::clone(keys), host_nqn.to_owned(), due)));
    rdmablk_common::nvme::auth::CONNECT_AUTHREQ_ATR
}

fn property(q: &mut Queue, sqe: &SubmissionEntry) -> Reply {
    let Ok(p) = Property::from_entry(sqe) else { return Reply::status(Status::INVALID_FIELD) };
    let ctrl = Arc::clone(&q.conn.as_ref().expect("connected").ctrl);
    let mut st = ctrl.state.lock().unwrap_or_else(|e| e.into_inner());
    if sqe.fctype() == fctype::PROPERTY_GET {
        let value = match (p.offset, p.wide) {
            (property::CAP, true) => cap(q.sub.cfg.nvme_queue_size),
            (property::VS, false) => VERSION as u64,
            (property::CC, false) => st.cc as u64,
            (property::CSTS, false) => st.csts as u64,
            _ => return Reply::status(Status::INVALID_FIELD),
        };
        return Reply::Done { status: Status::SUCCESS, result: value };
    }
    if p.offset != property::CC || p.wide {
        return Reply::status(Status::INVALID_FIELD);
    }
    let cc = p.value as u32;
    let was = st.cc;
    st.cc = cc;
    if cc & CC_EN != 0 && was & CC_EN == 0 {
        // IOSQES 6 and IOCQES 4 (64- and 16-byte entries), CSS NVM, 4 KiB pages.
        let good = (cc >> 16) & 0xf == 6 && (cc >> 20) & 0xf == 4 && (cc >> 4) & 0b111 == 0 && (cc >> 7) & 0xf == 0;
        st.csts = if good || ctrl.discovery { CSTS_RDY } else { CSTS_CFS };
    } else if cc & CC_EN == 0 && was & CC_EN != 0 {
        st.csts &= !CSTS_RDY;
    }
    if cc & CC_SHN_MASK != 0 {
        st.csts |= CSTS_SHST_COMPLETE;
    }
    Reply::ok()
}
