//! `nvme_commands`: NVMe commands as the target's NVMe-oF front end
//! checks them (`rdmablk_target::nvmf`), after the transport delivered them.
//!
//! # Input
//!
//! Byte 0 is a control byte: bit 0 set runs a valid Connect and controller
//! enable first (so that admin commands get past Connect). Then records:
//!
//! | bytes | meaning |
//! |---|---|
//! | 1 | bit 0: an I/O command (planned against the namespaces) or an admin one (run on an admin queue) |
//! | 64 | the submission entry, as sent (its SGL included) |
//! | 1 | N: the command carries N * 16 bytes of in-capsule data |
//! | N * 16 | the data |
//!
//! What must hold: on the admin queue every command is answered exactly
//! once with its own command id (an Asynchronous Event Request may be
//! held instead), data sent never exceeds what the SGL names, and data
//! asked for (R2T) is never more than the largest transfer; an I/O plan
//! that is accepted lies inside its namespace, moves whole blocks, at most
//! MDTS, as long as the SGL names, and writes only a writable namespace.

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use rdmablk_common::nvme::fabrics::{Connect, ConnectData, Property, CONNECT_DATA_SIZE};
use rdmablk_common::nvme::sqe::{admin_opcode, Sgl, SubmissionEntry, SQE_SIZE};
use rdmablk_target::auth::AccessPolicy;
use rdmablk_target::backend::{open_volumes, VolumeSet};
use rdmablk_target::config::{Config, NvmeTransport};
use rdmablk_target::engine::exec::Executor;
use rdmablk_target::nvmf::io_cmd::{plan, IoPlan};
use rdmablk_target::nvmf::queue::{Action, Queue};
use rdmablk_target::nvmf::{Subsystem, MAX_TRANSFER};
use rdmablk_target::registry::Registry;

const HOST: &str = "nqn.2014-08.org.example:fuzz";

/// A subsystem of two 1 MiB memory volumes, the second read-only.
fn subsystem() -> &'static Arc<Subsystem> {
    static SUB: OnceLock<Arc<Subsystem>> = OnceLock::new();
    SUB.get_or_init(|| {
        let text = "[target]\nname = \"fuzz\"\nlisten = [\"nvme+tcp://127.0.0.1:0\"]\n\
            [[volume]]\nname = \"a\"\nbackend = \"memory\"\nsize = \"1MiB\"\nblock_size = 512\nallow_any_host = true\n\
            [[volume]]\nname = \"b\"\nbackend = \"memory\"\nsize = \"1MiB\"\nblock_size = 4096\nread_only = true\nallow_any_host = true\n";
        let config = Config::parse(text, "fuzz").expect("the harness's configuration");
        let access = Arc::new(AccessPolicy::load(&config).expect("no key files"));
        let set = VolumeSet::new(1, open_volumes(&config).expect("memory volumes")).with_access(access);
        Arc::new(Subsystem::new(&config.target, Arc::new(Registry::new(set, 1))))
    })
}

thread_local! {
    /// The executor admin commands are delivered with (they never reach
    /// it: only I/O commands, which this harness plans but does not run).
    static EXEC: RefCell<Executor> = RefCell::new(
        Executor::standalone(Arc::clone(subsystem().registry.publication()), 4 << 20, 128 << 10).expect("an executor"),
    );
}

/// Delivers one command with its in-capsule data and returns the answers.
fn deliver(q: &mut Queue, sqe: SubmissionEntry, data: &[u8]) -> Vec<Action> {
    EXEC.with_borrow_mut(|exec| {
        if let Some(slot) = q.command(exec, sqe, data.len() as u32) {
            q.data_mut(exec, slot, 0, data.len() as u32).copy_from_slice(data);
            q.data_placed(exec, slot, data.len() as u32, true).expect("all in-capsule data arrived at once");
        }
        let mut actions = std::mem::take(&mut q.actions);
        // Data asked for with R2T arrives as zeroes, in one piece.
        if let Some(Action::RequestData { cid, ttag, off, len }) = actions.last() {
            let (cid, ttag, off, len) = (*cid, *ttag, *off, *len);
            assert!(len > 0 && len <= MAX_TRANSFER && off == 0, "R2T for {len} bytes at {off}");
            let slot = q.check_h2c(ttag, cid, 0, len).expect("the data asked for is accepted");
            q.data_mut(exec, slot, 0, len).fill(0);
            q.data_placed(exec, slot, len, true).expect("all data arrived");
            actions.pop();
            actions.extend(std::mem::take(&mut q.actions));
        }
        actions
    })
}

fn check_admin_answer(sqe: &SubmissionEntry, actions: &[Action]) {
    let answers: Vec<&Action> = actions.iter().filter(|a| !matches!(a, Action::Close(_))).collect();
    if answers.is_empty() {
        assert_eq!(sqe.opcode, admin_opcode::ASYNC_EVENT_REQUEST, "only an AER may be held: {sqe:?}");
        return;
    }
    assert_eq!(answers.len(), 1, "one answer per command: {actions:?}");
    match answers[0] {
        Action::Respond(c, _) => assert_eq!(c.cid, sqe.cid),
        Action::SendData { cid, len, then, .. } => {
            let then = then.as_ref().expect("admin data comes whole, with its completion");
            assert_eq!((*cid, then.cid), (sqe.cid, sqe.cid));
            let named = sqe.sgl().map(|s| s.length()).unwrap_or(0);
            assert!(*len <= named, "{len} bytes sent for an SGL of {named}");
        }
        other => panic!("unexpected answer {other:?}"),
    }
}

fn check_plan(sqe: &SubmissionEntry, q: &mut Queue) {
    let sgl_len = sqe.sgl().map(|s| s.length()).unwrap_or(0);
    let nss = q.namespaces().to_vec();
    let Ok(p) = plan(sqe, &nss, sgl_len) else { return };
    let ns = p.namespace();
    let (bs, size) = (ns.volume.block_size as u64, ns.volume.size);
    match &p {
        IoPlan::Read { offset, len, .. } | IoPlan::Write { offset, len, .. } => {
            let len = *len as u64;
            assert!(offset + len <= size && offset % bs == 0 && len % bs == 0 && len > 0, "{p:?}");
            assert!(len <= MAX_TRANSFER as u64 && len == sgl_len as u64, "{p:?}");
        }
        IoPlan::Range { ranges, .. } => assert!(ranges.iter().all(|(o, l)| o + l <= size), "{p:?}"),
        IoPlan::Flush { .. } | IoPlan::Deallocate { .. } => {}
    }
    if matches!(p, IoPlan::Write { .. } | IoPlan::Range { .. }) {
        assert!(!ns.read_only, "{p:?} on a read-only namespace");
    }
}

pub fn run(data: &[u8]) {
    let Some((&control, mut rest)) = data.split_first() else { return };
    let sub = subsystem();
    let addr = "127.0.0.1:4420".parse().expect("an address");
    // Bit 1: the queue is NVMe/RDMA's (keyed SGLs) rather than NVMe/TCP's.
    let transport = if control & 2 != 0 { NvmeTransport::Rdma } else { NvmeTransport::Tcp };
    let mut q = Queue::new(Arc::clone(sub), transport, 1, addr, addr);
    if control & 1 != 0 {
        let c = Connect { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato_ms: 0 };
        let mut d = [0u8; CONNECT_DATA_SIZE];
        let cd = ConnectData { host_id: [1; 16], controller_id: 0xffff, subsystem_nqn: sub.nqn.clone(), host_nqn: HOST.into() };
        cd.encode(&mut d).expect("valid connect data");
        let mut e = c.to_entry(0xfff0);
        e.set_sgl(Sgl::InCapsule { offset: 0, length: CONNECT_DATA_SIZE as u32 });
        deliver(&mut q, e, &d);
        let cc = Property { offset: 0x14, wide: false, value: 0x0046_0001 };
        deliver(&mut q, cc.to_entry(0xfff1, true), &[]);
        assert!(q.conn.is_some(), "the preamble connects");
    }
    while rest.len() > 1 + SQE_SIZE {
        let kind = rest[0];
        let Ok(sqe) = SubmissionEntry::decode_unchecked(&rest[1..1 + SQE_SIZE]) else { break };
        let n = rest.get(1 + SQE_SIZE).map_or(0, |&n| n as usize * 16);
        let start = 2 + SQE_SIZE;
        let payload = &rest[start.min(rest.len())..(start + n).min(rest.len())];
        rest = &rest[(start + n).min(rest.len())..];
        if kind & 1 != 0 {
            check_plan(&sqe, &mut q);
            continue;
        }
        let actions = deliver(&mut q, sqe, payload);
        check_admin_answer(&sqe, &actions);
    }
    if let Some(c) = q.conn.take() {
        sub.remove_controller(c.ctrl.id);
    }
}
