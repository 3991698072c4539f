//! Admin commands: Identify, Get Log Page, Set and Get Features,
//! Asynchronous Event Request, Keep Alive, Abort. Anything else is
//! answered Invalid Opcode.

use std::sync::Arc;

use rdmablk_common::nvme::ana;
use rdmablk_common::nvme::sqe::{admin_opcode, SubmissionEntry};
use rdmablk_common::nvme::status::Status;

use super::identify::{self, cns, AEN_SUPPORTED, ERROR_LOG_ENTRIES};
use super::queue::{Queue, Reply};
use super::{discovery, MAX_AERS, MAX_IO_QUEUES};
use crate::config::MAX_NSID;

/// Log page identifiers.
pub mod lid {
    pub const ERROR: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const CHANGED_NAMESPACES: u8 = 0x04;
    pub const COMMAND_EFFECTS: u8 = 0x05;
    pub const ANA: u8 = 0x0c;
    pub const DISCOVERY: u8 = 0x70;
}

/// Feature identifiers.
pub mod fid {
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
}

pub fn handle(q: &mut Queue, sqe: &SubmissionEntry, data: &[u8]) -> Reply {
    q.kept_alive();
    let discovery = q.conn.as_ref().is_some_and(|c| c.ctrl.discovery);
    match sqe.opcode {
        admin_opcode::IDENTIFY => identify(q, sqe, discovery),
        admin_opcode::GET_LOG_PAGE => get_log_page(q, sqe, discovery),
        admin_opcode::SET_FEATURES => set_features(q, sqe, data),
        admin_opcode::GET_FEATURES => get_features(q, sqe),
        admin_opcode::ASYNC_EVENT_REQUEST => {
            if q.aers.len() >= MAX_AERS {
                return Reply::status(Status::ASYNC_EVENT_LIMIT_EXCEEDED);
            }
            q.aers.push(sqe.cid);
            Reply::Held
        }
        admin_opcode::KEEP_ALIVE => Reply::ok(),
        // Dword 0 bit 0 set: the command was not aborted (nothing here
        // waits long enough to be worth aborting).
        admin_opcode::ABORT => Reply::Done { status: Status::SUCCESS, result: 1 },
        _ => Reply::status(Status::INVALID_OPCODE),
    }
}

fn identify(q: &mut Queue, sqe: &SubmissionEntry, discovery: bool) -> Reply {
    let which = (sqe.cdw[0] & 0xff) as u8;
    let nsid = sqe.nsid;
    let cntlid = q.conn.as_ref().map_or(0, |c| c.ctrl.id);
    if which == cns::CONTROLLER {
        return Reply::Data { data: identify::controller(&q.sub, q.transport, cntlid, discovery) };
    }
    if discovery {
        return Reply::status(Status::INVALID_FIELD);
    }
    let nqn = q.sub.nqn.clone();
    match which {
        cns::NAMESPACE => {
            if nsid == 0 || (nsid > MAX_NSID && nsid != u32::MAX) {
                return Reply::status(Status::INVALID_NAMESPACE);
            }
            let ns = q.namespaces().iter().find(|n| n.nsid == nsid).cloned();
            Reply::Data { data: identify::namespace(&nqn, ns.as_ref()) }
        }
        cns::ACTIVE_NAMESPACES => {
            if nsid >= 0xffff_fffe {
                return Reply::status(Status::INVALID_NAMESPACE);
            }
            Reply::Data { data: identify::active_namespaces(q.namespaces(), nsid) }
        }
        cns::NAMESPACE_DESCRIPTORS => match q.namespaces().iter().find(|n| n.nsid == nsid).cloned() {
            Some(ns) => Reply::Data { data: identify::namespace_descriptors(&nqn, &ns) },
            None => Reply::status(Status::INVALID_NAMESPACE),
        },
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

fn get_log_page(q: &mut Queue, sqe: &SubmissionEntry, discovery: bool) -> Reply {
    let id = (sqe.cdw[0] & 0xff) as u8;
    // LSP (bits 14:8; for the ANA log, bit 0 is Return Groups Only) and
    // RAE (Retain Asynchronous Event).
    let lsp = ((sqe.cdw[0] >> 8) & 0x7f) as u8;
    let retain = sqe.cdw[0] & (1 << 15) != 0;
    let dwords = ((sqe.cdw[1] & 0xffff) << 16 | sqe.cdw[0] >> 16) as u64 + 1;
    let len = dwords * 4;
    let offset = sqe.cdw[2] as u64 | (sqe.cdw[3] as u64) << 32;
    if offset % 4 != 0 || len > 1 << 20 {
        return Reply::status(Status::INVALID_FIELD);
    }
    let page: Vec<u8> = match (id, discovery) {
        (lid::DISCOVERY, true) => discovery::log_page(&q.sub, q.local),
        (lid::ERROR, _) => vec![0; 64 * ERROR_LOG_ENTRIES],
        (lid::SMART, false) => smart_log(),
        (lid::FIRMWARE_SLOT, false) => firmware_log(),
        (lid::CHANGED_NAMESPACES, false) => {
            let mut d = vec![0u8; 4096];
            if q.changed_nsids.len() > 1024 {
                d[..4].copy_from_slice(&u32::MAX.to_le_bytes());
            } else {
                for (i, n) in q.changed_nsids.iter().enumerate() {
                    d[4 * i..4 * i + 4].copy_from_slice(&n.to_le_bytes());
                }
            }
            if !retain {
                q.changed_nsids.clear();
                q.aen_masked = false;
            }
            d
        }
        (lid::COMMAND_EFFECTS, false) => command_effects_log(),
        // Whatever the NSID (a Linux host sends FFFFFFFFh, the
        // specification 0h or FFFFFFFFh) and the other LSP bits; as long as
        // hosts compute it (identify::ANA_LOG_SIZE), zero-padded.
        (lid::ANA, false) => {
            let mut page = q.ana_log(retain).encode(lsp & ana::LSP_RGO != 0);
            debug_assert!(page.len() <= identify::ANA_LOG_SIZE, "{} namespaces' ANA log", q.namespaces().len());
            page.resize(page.len().max(identify::ANA_LOG_SIZE), 0);
            page
        }
        _ => return Reply::status(Status::INVALID_LOG_PAGE),
    };
    if offset > page.len() as u64 {
        return Reply::status(Status::INVALID_FIELD);
    }
    let start = offset as usize;
    let end = (start + len as usize).min(page.len());
    let mut out = page[start..end].to_vec();
    out.resize(len as usize, 0);
    Reply::Data { data: out }
}

/// SMART / health information: no warnings, a plausible temperature, all
/// spare capacity left.
fn smart_log() -> Vec<u8> {
    let mut d = vec![0u8; 512];
    d[1..3].copy_from_slice(&298u16.to_le_bytes());
    d[3] = 100;
    d[4] = 10;
    d
}

fn firmware_log() -> Vec<u8> {
    let mut d = vec![0u8; 512];
    // AFI: slot 1 active; FRS1 the version.
    d[0] = 1;
    let fr = env!("CARGO_PKG_VERSION").as_bytes();
    let n = fr.len().min(8);
    d[8..16].fill(b' ');
    d[8..8 + n].copy_from_slice(&fr[..n]);
    d
}

/// Commands supported and effects: CSUPP for every command served, LBCC
/// (logical block content change) for those that write.
fn command_effects_log() -> Vec<u8> {
    use rdmablk_common::nvme::sqe::io_opcode;
    const CSUPP: u32 = 1;
    const LBCC: u32 = 1 << 1;
    let mut d = vec![0u8; 4096];
    let mut put = |at: usize, v: u32| d[at..at + 4].copy_from_slice(&v.to_le_bytes());
    for op in [
        admin_opcode::GET_LOG_PAGE,
        admin_opcode::IDENTIFY,
        admin_opcode::ABORT,
        admin_opcode::SET_FEATURES,
        admin_opcode::GET_FEATURES,
        admin_opcode::ASYNC_EVENT_REQUEST,
        admin_opcode::KEEP_ALIVE,
    ] {
        put(4 * op as usize, CSUPP);
    }
    put(1024 + 4 * io_opcode::FLUSH as usize, CSUPP);
    put(1024 + 4 * io_opcode::READ as usize, CSUPP);
    for op in [io_opcode::WRITE, io_opcode::WRITE_ZEROES, io_opcode::DATASET_MANAGEMENT] {
        put(1024 + 4 * op as usize, CSUPP | LBCC);
    }
    d
}

fn set_features(q: &mut Queue, sqe: &SubmissionEntry, _data: &[u8]) -> Reply {
    let f = (sqe.cdw[0] & 0xff) as u8;
    if sqe.cdw[0] & (1 << 31) != 0 {
        return Reply::status(Status::FEATURE_NOT_SAVEABLE);
    }
    let ctrl = Arc::clone(&q.conn.as_ref().expect("connected").ctrl);
    let value = sqe.cdw[1];
    let mut st = ctrl.state.lock().unwrap_or_else(|e| e.into_inner());
    match f {
        fid::NUMBER_OF_QUEUES if !ctrl.discovery => {
            let (sq, cq) = ((value & 0xffff) as u16, (value >> 16) as u16);
            if sq == 0xffff || cq == 0xffff {
                return Reply::status(Status::INVALID_FIELD);
            }
            // Granted once per controller, as large as asked up to the limit.
            let n = *st.queues_granted.get_or_insert(sq.min(cq).min(MAX_IO_QUEUES - 1));
            Reply::Done { status: Status::SUCCESS, result: (n as u64) << 16 | n as u64 }
        }
        fid::KEEP_ALIVE_TIMER => {
            st.kato_ms = value;
            drop(st);
            q.kept_alive();
            Reply::ok()
        }
        fid::ASYNC_EVENT_CONFIG if !ctrl.discovery => {
            // Bits of notices this controller never sends are ignored.
            st.aen_config = value & AEN_SUPPORTED;
            Reply::ok()
        }
        fid::VOLATILE_WRITE_CACHE if !ctrl.discovery => {
            // The page cache and the disk's cache stay on; Flush (fdatasync)
            // and FUA (RWF_DSYNC) make writes durable.
            if value & 1 == 0 {
                return Reply::status(Status::INVALID_FIELD);
            }
            Reply::ok()
        }
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

fn get_features(q: &mut Queue, sqe: &SubmissionEntry) -> Reply {
    let f = (sqe.cdw[0] & 0xff) as u8;
    let sel = (sqe.cdw[0] >> 8) & 0b111;
    let ctrl = Arc::clone(&q.conn.as_ref().expect("connected").ctrl);
    let st = ctrl.state.lock().unwrap_or_else(|e| e.into_inner());
    if sel == 3 {
        // Supported capabilities: changeable, not saveable.
        return Reply::Done { status: Status::SUCCESS, result: 0b100 };
    }
    let result = match f {
        fid::NUMBER_OF_QUEUES if !ctrl.discovery => {
            let n = st.queues_granted.unwrap_or(MAX_IO_QUEUES - 1) as u64;
            n << 16 | n
        }
        fid::KEEP_ALIVE_TIMER => st.kato_ms as u64,
        fid::ASYNC_EVENT_CONFIG if !ctrl.discovery => st.aen_config as u64,
        fid::VOLATILE_WRITE_CACHE if !ctrl.discovery => 1,
        _ => return Reply::status(Status::INVALID_FIELD),
    };
    Reply::Done { status: Status::SUCCESS, result }
}
