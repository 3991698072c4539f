//! NVMe in-band authentication (DH-HMAC-CHAP, NVMe Base 2.0 section 8.13)
//! of one queue: Authentication Send and Receive (Fabrics types 0x05 and
//! 0x06), the per-queue state machine, and the worker that computes the
//! Diffie-Hellman exponentiations off the reactors.
//!
//! A host whose `[[host]]` has a `dhchap_key_file` must authenticate every
//! queue (the Linux host does): its Connect is answered with AUTHREQ.ATR,
//! and until the exchange succeeds the queue takes nothing but Connect,
//! Property Get/Set, Disconnect and the authentication itself (others get
//! Authentication Required, as from nvmet). The exchange, controller's view:
//!
//! ```text
//!   Send    AUTH_Negotiate        hash and group chosen (the configured ones, which the host must offer);
//!                                 the DH key is generated on the worker meanwhile
//!   Receive Challenge             C1, S1 (fresh random), our DH value
//!   Send    Reply                 R1 checked against HMAC(Kh', Ca1 || S1 || T_ID || 0 || "HostHost" || ...);
//!                                 C2 kept if the host asks the controller to authenticate too
//!   Receive Success1              with R2 if asked
//!   Send    Success2              (bidirectional only)
//! ```
//!
//! Any failure (a wrong response, a message out of order or replayed, a
//! transaction id that changes, a malformed message, a hash or group the
//! host does not offer) is logged with the host NQN and peer address and
//! counted (`rdmablk_nvme_auth_failures_total{reason}`); the next Receive
//! gets AUTH_Failure1 (so does every later authentication command: a
//! refused queue gets no second try) and nothing else runs on the queue.
//! The host then disconnects (Linux does); the target closes a queue not
//! authenticated within `target.handshake_timeout` of its Connect
//! (`Queue::check_deadlines`; the admin queue's closing ends its
//! controller). It does not close at once after Failure1: over NVMe/RDMA a
//! faulted queue pair goes before its last answer, and the Linux host would
//! wait for that answer for ever. Challenges and sequence numbers are fresh
//! random values per transaction, so a recorded Reply answers no later
//! Challenge.

use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use rdmablk_common::nvme::auth::{
    self as dhchap, explanation, message, DhError, DhGroup, DhKey, HashId, Message, Negotiate, SECP_DHCHAP, SPSP,
};
use rdmablk_common::nvme::fabrics::fctype;
use rdmablk_common::nvme::sqe::{admin_opcode, SubmissionEntry};
use rdmablk_common::nvme::status::Status;

use super::queue::{Queue, Reply};
use super::{NvmeStats, MAX_HEAP_DATA};
use crate::auth::NvmeAuthKeys;
use crate::registry::Registry;

/// Indexes into [`NvmeStats::AUTH_FAILURES`].
mod why {
    pub const WRONG_RESPONSE: usize = 0;
    pub const REFUSED_BY_HOST: usize = 1;
    pub const PROTOCOL: usize = 2;
    pub const NOT_USABLE: usize = 3;
    pub const TIMEOUT: usize = 4;
    pub const BUSY: usize = 5;
}
const _: () = assert!(why::BUSY + 1 == NvmeStats::AUTH_FAILURES.len());

/// DH computations waiting for the worker at most; beyond, an
/// authentication is refused (`busy`) rather than queued without bound.
const WORKER_CAPACITY: usize = 64;

/// Whether a command may run on a queue whose host has not authenticated.
pub fn allowed_before_auth(sqe: &SubmissionEntry) -> bool {
    sqe.opcode == admin_opcode::FABRICS
        && matches!(
            sqe.fctype(),
            fctype::CONNECT
                | fctype::PROPERTY_GET
                | fctype::PROPERTY_SET
                | fctype::AUTHENTICATION_SEND
                | fctype::AUTHENTICATION_RECEIVE
                | fctype::DISCONNECT
        )
}

/// A DH computation on the worker; its result, once there.
#[derive(Clone)]
struct Job(Arc<Mutex<Option<JobDone>>>);

enum JobDone {
    Key(DhKey),
    Shared(Result<Vec<u8>, DhError>),
}

impl Job {
    fn take(&self) -> Option<JobDone> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

type Work = Box<dyn FnOnce() + Send>;

/// Starts `f` on the authentication worker (one thread for the target,
/// started on first use); the reactors are woken when it is done, and the
/// queue's held command runs again. `None` when the worker has
/// [`WORKER_CAPACITY`] jobs waiting already.
fn spawn(registry: &Arc<Registry>, f: impl FnOnce() -> JobDone + Send + 'static) -> Option<Job> {
    static WORKER: OnceLock<Option<SyncSender<Work>>> = OnceLock::new();
    let tx = WORKER.get_or_init(|| {
        let (tx, rx) = mpsc::sync_channel::<Work>(WORKER_CAPACITY);
        let started = std::thread::Builder::new().name("nvme-auth".into()).spawn(move || {
            while let Ok(w) = rx.recv() {
                w();
            }
        });
        match started {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::error!("cannot start the NVMe authentication worker: {e}");
                None
            }
        }
    });
    let job = Job(Arc::new(Mutex::new(None)));
    let (slot, registry) = (Arc::clone(&job.0), Arc::clone(registry));
    let work: Work = Box::new(move || {
        let done = f();
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(done);
        registry.wake_reactors();
    });
    tx.as_ref()?.try_send(work).ok()?;
    Some(job)
}

/// Where a queue stands in its authentication.
enum Step {
    /// Waiting for AUTH_Negotiate.
    Negotiate,
    /// Negotiated: the Challenge is to be received. `key`: the DH key
    /// being generated on the worker, none for the NULL group.
    Challenge { tid: u16, hash: HashId, group: DhGroup, key: Option<Job> },
    /// The Challenge went out: the Reply is expected.
    Reply { tid: u16, hash: HashId, c1: Vec<u8>, s1: u32, key: Option<DhKey> },
    /// The Reply's DH value is on the worker; its response is checked then.
    Verifying { tid: u16, hash: HashId, c1: Vec<u8>, s1: u32, reply: dhchap::Reply, job: Job },
    /// The host proved its secret: Success1 is to be received, with R2
    /// when the host asked the controller to prove its own.
    Success1 { tid: u16, hash: HashId, r2: Option<Vec<u8>> },
    /// Success1 carried R2: the host's Success2 (or Failure2) is expected.
    Success2 { tid: u16 },
    /// Authenticated.
    Done,
    /// Refused (logged and counted when decided): the next Receive gets
    /// AUTH_Failure1 with this explanation, then the queue closes.
    Failed { tid: u16, explanation: u8 },
}

/// One queue's authentication (`Queue::auth`), for a host that must.
pub struct QueueAuth {
    keys: Arc<NvmeAuthKeys>,
    host_nqn: String,
    /// Set once the host proved its secret (and the controller its own
    /// when asked); stays set through a re-authentication.
    pub authenticated: bool,
    /// Not authenticated by then: the queue closes.
    pub due: Instant,
    step: Step,
    /// The command held while the worker computes (its command id).
    held: Option<u16>,
}

impl QueueAuth {
    pub fn new(keys: Arc<NvmeAuthKeys>, host_nqn: String, due: Instant) -> QueueAuth {
        QueueAuth { keys, host_nqn, authenticated: false, due, step: Step::Negotiate, held: None }
    }

    /// Whether a refusal was already logged and counted (the timeout then
    /// counts nothing more).
    pub fn failed(&self) -> bool {
        matches!(self.step, Step::Failed { .. })
    }
}

/// Logs and counts a refusal; the next Receive answers AUTH_Failure1.
fn refuse(q: &mut Queue, reason: usize, tid: u16, expl: u8, what: impl std::fmt::Display) {
    let qid = q.qid().unwrap_or(0);
    let Some(a) = q.auth.as_mut() else { return };
    if !a.failed() {
        tracing::warn!(
            host = %a.host_nqn,
            peer = %q.peer,
            queue = qid,
            "nvme authentication refused: {what} ({})",
            NvmeStats::AUTH_FAILURES[reason]
        );
        NvmeStats::add(&q.sub.stats.auth_failures[reason], 1);
    }
    a.step = Step::Failed { tid, explanation: expl };
    // A failed re-authentication ends what the first one allowed.
    a.authenticated = false;
}

fn succeeded(q: &mut Queue, bidirectional: bool) {
    let qid = q.qid().unwrap_or(0);
    let Some(a) = q.auth.as_mut() else { return };
    a.authenticated = true;
    a.step = Step::Done;
    NvmeStats::add(&q.sub.stats.authenticated, 1);
    let how = if bidirectional { ", and the controller to it" } else { "" };
    if qid == 0 {
        tracing::info!(host = %a.host_nqn, peer = %q.peer, queue = qid, "nvme host {:?} from {} authenticated (queue 0{how})", a.host_nqn, q.peer);
    } else {
        tracing::debug!(host = %a.host_nqn, peer = %q.peer, queue = qid, "nvme host {:?} from {} authenticated (queue {qid}{how})", a.host_nqn, q.peer);
    }
}

/// SECP, SPSP0, SPSP1 (command bytes 43, 41, 42: dword 10) and the
/// transfer or allocation length (dword 11).
fn check_fields(sqe: &SubmissionEntry) -> Result<u32, Status> {
    let cdw10 = sqe.cdw[0];
    let (spsp0, spsp1, secp) = ((cdw10 >> 8) as u8, (cdw10 >> 16) as u8, (cdw10 >> 24) as u8);
    if secp != SECP_DHCHAP || spsp0 != SPSP || spsp1 != SPSP {
        return Err(Status::INVALID_FIELD);
    }
    match sqe.cdw[1] {
        0 => Err(Status::INVALID_FIELD),
        len if len > MAX_HEAP_DATA => Err(Status::INVALID_FIELD),
        len => Ok(len),
    }
}

/// Another authentication command while one is held for the worker.
fn busy_with_another(q: &Queue, cid: u16) -> bool {
    q.auth.as_ref().and_then(|a| a.held).is_some_and(|h| h != cid)
}

fn hold(q: &mut Queue, cid: u16) -> Reply {
    if let Some(a) = q.auth.as_mut() {
        a.held = Some(cid);
    }
    Reply::Working
}

fn release(q: &mut Queue) {
    if let Some(a) = q.auth.as_mut() {
        a.held = None;
    }
}

/// Authentication Send: AUTH_Negotiate, Reply, Success2, Failure2.
pub fn send(q: &mut Queue, sqe: &SubmissionEntry, data: &[u8]) -> Reply {
    if q.auth.is_none() {
        // The host has no dhchap_key_file (or this is discovery).
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    let tl = match check_fields(sqe) {
        Ok(tl) => tl as usize,
        Err(s) => return Reply::status(s),
    };
    if busy_with_another(q, sqe.cid) {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    let Some(data) = data.get(..tl) else { return Reply::status(Status::SGL_DATA_LENGTH_INVALID) };
    // The held Reply, again: its DH value was on the worker.
    if let Some(Step::Verifying { job, .. }) = q.auth.as_ref().map(|a| &a.step) {
        let Some(done) = job.take() else { return hold(q, sqe.cid) };
        release(q);
        let a = q.auth.as_mut().expect("checked above");
        let Step::Verifying { tid, hash, c1, s1, reply, .. } = std::mem::replace(&mut a.step, Step::Negotiate) else {
            unreachable!("matched above")
        };
        match done {
            JobDone::Shared(Ok(session_key)) => verify(q, tid, hash, &c1, s1, &reply, Some(&session_key)),
            JobDone::Shared(Err(e)) => refuse(q, why::PROTOCOL, tid, explanation::DHGROUP_UNUSABLE, format!("the host's DH value: {e}")),
            JobDone::Key(_) => unreachable!("a Reply's job computes the shared secret"),
        }
        return Reply::ok();
    }
    let msg = match Message::decode(data) {
        Ok(m) => m,
        Err(e) => {
            let tid = data.get(4..6).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            refuse(q, why::PROTOCOL, tid, explanation::INCORRECT_PAYLOAD, format!("malformed message: {e}"));
            return Reply::ok();
        }
    };
    let a = q.auth.as_mut().expect("checked above");
    match (msg, &a.step) {
        // A Negotiate (re)starts a transaction whatever came before, but
        // for a refusal: that ends the queue (no second guess on it).
        (Message::Negotiate(n), step) if !matches!(step, Step::Failed { .. }) => negotiate(q, n),
        (Message::Reply(r), Step::Reply { tid, .. }) if r.tid == *tid => {
            let Step::Reply { tid, hash, c1, s1, key } = std::mem::replace(&mut a.step, Step::Negotiate) else {
                unreachable!("matched above")
            };
            if r.response.len() != hash.digest_len() {
                let hl = r.response.len();
                refuse(q, why::PROTOCOL, tid, explanation::INCORRECT_PAYLOAD, format!("Reply HL {hl}, {hash} needs {}", hash.digest_len()));
                return Reply::ok();
            }
            match key {
                None if !r.dh_value.is_empty() => {
                    refuse(q, why::PROTOCOL, tid, explanation::INCORRECT_PAYLOAD, "a DH value with the NULL group")
                }
                None => verify(q, tid, hash, &c1, s1, &r, None),
                Some(key) => {
                    let peer = r.dh_value.clone();
                    let Some(job) = spawn(&q.sub.registry, move || JobDone::Shared(key.shared(&peer))) else {
                        refuse(q, why::BUSY, tid, explanation::FAILED, "the authentication worker has 64 computations waiting");
                        return Reply::ok();
                    };
                    q.auth.as_mut().expect("checked above").step = Step::Verifying { tid, hash, c1, s1, reply: r, job };
                    return hold(q, sqe.cid);
                }
            }
        }
        (Message::Success2 { tid: t }, Step::Success2 { tid }) if t == *tid => succeeded(q, true),
        (Message::Failure { first: false, tid, explanation: e, .. }, _) => {
            // The host ends the transaction (and disconnects) itself.
            refuse(q, why::REFUSED_BY_HOST, tid, explanation::FAILED, format!("the host refused the controller: {}", explanation::name(e)));
        }
        (m, step) => {
            let (tid, what) = match step {
                Step::Reply { tid, .. } | Step::Success2 { tid } if m.tid() != *tid => {
                    (*tid, format!("transaction id {} in a transaction of {tid}", m.tid()))
                }
                _ => (m.tid(), format!("message {:#04x} out of order (sent {})", m.id(), step_name(step))),
            };
            let expl = if what.starts_with("transaction") { explanation::INCORRECT_PAYLOAD } else { explanation::INCORRECT_MESSAGE };
            refuse(q, why::PROTOCOL, tid, expl, what);
        }
    }
    Reply::ok()
}

fn step_name(s: &Step) -> &'static str {
    match s {
        Step::Negotiate => "before AUTH_Negotiate",
        Step::Challenge { .. } => "before the Challenge was received",
        Step::Reply { .. } | Step::Verifying { .. } => "while the Reply was expected",
        Step::Success1 { .. } => "before Success1 was received",
        Step::Success2 { .. } => "while Success2 was expected",
        Step::Done => "after authentication",
        Step::Failed { .. } => "after a failure",
    }
}

fn negotiate(q: &mut Queue, n: Negotiate) {
    let a = q.auth.as_mut().expect("the caller checked");
    let (hash, group) = (a.keys.hash, a.keys.dh_group);
    if n.sc_c != 0 {
        return refuse(q, why::NOT_USABLE, n.tid, explanation::CONCAT_MISMATCH, "secure channel concatenation (TLS) asked for; not supported");
    }
    if !n.hashes.contains(&(hash as u8)) {
        let what = format!("the host offers hashes {:?}, not {hash} (host[].dhchap_hash)", n.hashes);
        return refuse(q, why::NOT_USABLE, n.tid, explanation::HASH_UNUSABLE, what);
    }
    if !n.dh_groups.contains(&(group as u8)) {
        let what = format!("the host offers DH groups {:?}, not {group} (host[].dhchap_dhgroup)", n.dh_groups);
        return refuse(q, why::NOT_USABLE, n.tid, explanation::DHGROUP_UNUSABLE, what);
    }
    let key = if group == DhGroup::Null {
        None
    } else {
        // Generated meanwhile: the host's Receive usually finds it ready.
        match spawn(&q.sub.registry, move || JobDone::Key(DhKey::generate(group).expect("not the NULL group"))) {
            Some(job) => Some(job),
            None => return refuse(q, why::BUSY, n.tid, explanation::FAILED, "the authentication worker has 64 computations waiting"),
        }
    };
    q.auth.as_mut().expect("the caller checked").step = Step::Challenge { tid: n.tid, hash, group, key };
}

/// Checks the host's response R1 and moves on to Success1.
fn verify(q: &mut Queue, tid: u16, hash: HashId, c1: &[u8], s1: u32, r: &dhchap::Reply, session_key: Option<&[u8]>) {
    let sub_nqn = q.sub.nqn.clone();
    let a = q.auth.as_ref().expect("the caller checked");
    let kh = a.keys.host.transformed(&a.host_nqn);
    let ca = dhchap::augmented_challenge(hash, session_key, c1);
    let want = dhchap::host_response(hash, &kh, &ca, s1, tid, &a.host_nqn, &sub_nqn);
    if !dhchap::same_response(&want, &r.response) {
        return refuse(q, why::WRONG_RESPONSE, tid, explanation::FAILED, "wrong response: the host does not hold its secret");
    }
    // S2 of 0 with a C2 asks for no controller authentication (a C2 for
    // a TLS key only, which this target does not derive).
    let r2 = match (&r.c2, r.seqnum) {
        (Some(c2), s2) if s2 != 0 => {
            let Some(ctrl) = &a.keys.ctrl else {
                return refuse(
                    q,
                    why::NOT_USABLE,
                    tid,
                    explanation::FAILED,
                    "the host asks the controller to authenticate and host[].dhchap_ctrl_key_file is not set",
                );
            };
            let kc = ctrl.transformed(&sub_nqn);
            let ca2 = dhchap::augmented_challenge(hash, session_key, c2);
            Some(dhchap::controller_response(hash, &kc, &ca2, s2, tid, &a.host_nqn, &sub_nqn))
        }
        _ => None,
    };
    q.auth.as_mut().expect("the caller checked").step = Step::Success1 { tid, hash, r2 };
}

/// Authentication Receive: Challenge, Success1, Failure1.
pub fn receive(q: &mut Queue, sqe: &SubmissionEntry) -> Reply {
    if q.auth.is_none() {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    let al = match check_fields(sqe) {
        Ok(al) => al as usize,
        Err(s) => return Reply::status(s),
    };
    if busy_with_another(q, sqe.cid) {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    let a = q.auth.as_mut().expect("checked above");
    let msg = match &mut a.step {
        Step::Challenge { tid, hash, group, key } => {
            let (tid, hash, group) = (*tid, *hash, *group);
            let key = match key.as_ref().map(Job::take) {
                None => None,
                Some(Some(JobDone::Key(k))) => Some(k),
                Some(Some(JobDone::Shared(_))) => unreachable!("a Negotiate's job generates a key"),
                Some(None) => return hold(q, sqe.cid),
            };
            release(q);
            let c1 = dhchap::random_bytes(hash.digest_len());
            let s1 = dhchap::random_seqnum();
            let dh_value = key.as_ref().map_or_else(Vec::new, |k| k.public().to_vec());
            let m = Message::Challenge(dhchap::Challenge { tid, hash, dh_group: group, seqnum: s1, c1: c1.clone(), dh_value });
            q.auth.as_mut().expect("checked above").step = Step::Reply { tid, hash, c1, s1, key };
            m
        }
        Step::Success1 { tid, hash, r2 } => {
            let (tid, hl, r2) = (*tid, hash.digest_len() as u8, r2.take());
            let bidirectional = r2.is_some();
            let m = Message::Success1(dhchap::Success1 { tid, hl, response: r2 });
            if bidirectional {
                a.step = Step::Success2 { tid };
            } else {
                succeeded(q, false);
            }
            m
        }
        Step::Failed { tid, explanation } => {
            Message::Failure { first: true, tid: *tid, reason: dhchap::REASON_FAILED, explanation: *explanation }
        }
        step => {
            let what = format!("Authentication Receive {}", step_name(step));
            let tid = match step {
                Step::Reply { tid, .. } | Step::Success2 { tid } => *tid,
                _ => 0,
            };
            refuse(q, why::PROTOCOL, tid, explanation::INCORRECT_MESSAGE, what);
            Message::Failure { first: true, tid, reason: dhchap::REASON_FAILED, explanation: explanation::INCORRECT_MESSAGE }
        }
    };
    let mut data = msg.encode();
    if data.len() > al {
        // The host's buffer cannot take the message (a Challenge of a large
        // group into a small one): nvmet fails the command the same way.
        let what = format!("Authentication Receive of {al} bytes for a {}-byte message", data.len());
        refuse(q, why::PROTOCOL, msg.tid(), explanation::INCORRECT_PAYLOAD, what);
        return Reply::status(Status::INTERNAL_ERROR);
    }
    // As nvmet: the whole allocation length, zero-filled past the message.
    data.resize(al, 0);
    if msg.id() == message::FAILURE1 {
        tracing::debug!("nvme queue {:?} from {}: AUTH_Failure1 sent", q.qid(), q.peer);
    }
    Reply::Data { data }
}

/// The queue's authentication deadline passed: logged, and counted
/// unless a refusal was already counted. Returns why the queue closes.
pub fn timed_out(q: &mut Queue) -> String {
    let (peer, qid, timeout) = (q.peer, q.qid().unwrap_or(0), q.sub.cfg.handshake_timeout);
    let Some(a) = q.auth.as_mut() else { return "not authenticated".into() };
    let msg = format!("host {:?} not authenticated within {timeout:?} of its Connect (target.handshake_timeout)", a.host_nqn);
    if !a.failed() {
        NvmeStats::add(&q.sub.stats.auth_failures[why::TIMEOUT], 1);
        tracing::warn!(host = %a.host_nqn, %peer, queue = qid, "nvme authentication refused: {msg} (timeout)");
        a.step = Step::Failed { tid: 0, explanation: explanation::FAILED };
    }
    msg
}
