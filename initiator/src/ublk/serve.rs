//! The ublk side of `rdmablk attach`: the control device, one thread per
//! queue, and `rdmablk detach`.
//!
//! Each queue thread owns the ublk queue's io_uring (libublk keeps it
//! thread-local) and an `IoQueue` on one of the session's queue pairs. It
//! sleeps on whichever has work: when it has volume requests in flight it
//! waits in `IoQueue::wait`, and a small helper thread turns each CQE
//! posted to the ublk ring (an eventfd registered with the ring) into an
//! `IoWaker::wake`, so a new ublk request ends that wait at once; with
//! nothing in flight it sleeps in the ring's `io_uring_enter`.
//!
//! Buffers: each tag's buffer is a registered `IoBuffer` of the session,
//! given to the kernel as the tag's address in FETCH and
//! COMMIT_AND_FETCH. The kernel copies a WRITE's pages into it before it
//! hands the request over, the target RDMA-READs from it; a READ's data is
//! RDMA-written into it by the target and the kernel copies it to the
//! request's pages at COMMIT. Those two kernel copies are the only ones.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{UblkDev, UblkQueue};
use libublk::{UblkError, UblkFlags, UblkIORes};

use super::record::{pid_alive, AttachRecord, RECORD_DIR};
use super::{result_code, translate, DeviceParams, VolumeOp};
use crate::error::{Error, Result};
use crate::io_queue::{IoCompletion, IoRequest, IoWaker};
use crate::session::{Session, Volume};
use crate::IoBuffer;

const CONTROL: &str = "/dev/ublk-control";

/// `rdmablk attach`'s settings.
#[derive(Clone, Debug)]
pub struct AttachOptions {
    /// ublk queues (= session queue pairs, one thread each).
    pub queues: u16,
    /// Tags per queue: requests in flight per queue.
    pub depth: u16,
}

/// Checks what `attach` needs from the machine before connecting.
pub(crate) fn check_machine() -> Result<()> {
    if !Path::new(CONTROL).exists() {
        return Err(Error::invalid(format!(
            "the kernel has no ublk driver (modprobe ublk_drv): {CONTROL} does not exist"
        )));
    }
    if !rustix::process::geteuid().is_root() {
        return Err(Error::invalid("rdmablk attach creates a ublk device and must run as root"));
    }
    Ok(())
}

fn ublk_err(what: &str, e: UblkError) -> Error {
    Error::invalid(format!("{what}: {e}"))
}

/// The ublk control flags of every device: user recovery, with the
/// requests the dead server had taken re-issued to the next one (the
/// reconnect fence makes that safe: the next server's session retires the
/// dead one's before anything is re-issued).
const CTRL_FLAGS: u64 = (libublk::sys::UBLK_F_USER_RECOVERY | libublk::sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;

/// Serves `volume` as `/dev/ublkbN`: calls `on_ready` with the path when
/// the device is ready and returns when the device is stopped (SIGINT,
/// SIGTERM, `rdmablk detach`), after deleting it.
///
/// With `recover` (the record of a device whose `rdmablk attach` died, see
/// [`AttachRecord`]), takes that device back instead of creating one: the
/// kernel has held its requests since, and re-issues them to this process.
pub fn attach(
    session: Session,
    volume: Volume,
    opts: &AttachOptions,
    recover: Option<AttachRecord>,
    on_ready: impl FnOnce(&str) + Send + Sync + 'static,
) -> Result<()> {
    let info = volume.info().clone();
    let params = DeviceParams::compute(
        info.block_size,
        info.size_bytes,
        session.max_io_size(),
        info.read_only(),
        volume.supports_discard(),
        volume.supports_write_zeroes(),
    )?;
    let ctrl = match &recover {
        None => UblkCtrlBuilder::default()
            .name("rdmablk")
            .id(-1)
            .nr_queues(opts.queues)
            .depth(opts.depth)
            .io_buf_bytes(params.io_buf_bytes)
            .ctrl_flags(CTRL_FLAGS)
            .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
            .build()
            .map_err(|e| ublk_err("creating the ublk device (/dev/ublk-control)", e))?,
        Some(record) => start_recovery(record, &params)?,
    };
    let dev_id = ctrl.dev_info().dev_id;
    let record = AttachRecord {
        dev_id,
        // The URL, or the list of the volume's gateways (what a restarted
        // attach is given and looks for).
        target: session.targets().to_string(),
        volume: info.name.clone(),
        host_id: session.host_id().to_string(),
        session: String::new(),
        pid: std::process::id(),
        gateway: None,
    };
    let record_dir = Path::new(RECORD_DIR);
    record.with_session_at(session.session_id(), &session.url().to_string()).save_in(record_dir)?;
    session.watch_session(move |id, gateway| {
        if let Err(e) = record.with_session_at(id, &gateway.to_string()).save_in(Path::new(RECORD_DIR)) {
            tracing::error!("updating the attach record: {}", e.one_line());
        }
    });
    let stop = stop_on_signals(dev_id)?;

    let volume = Arc::new(volume);
    let failed = Arc::new(AtomicBool::new(false));
    let (q_session, q_volume, q_failed) = (session.clone(), Arc::clone(&volume), Arc::clone(&failed));
    let q_fn = move |qid: u16, dev: &UblkDev| {
        if let Err(e) = serve_queue(qid, dev, &q_session, &q_volume) {
            tracing::error!(queue = qid, "ublk queue failed: {}", e.one_line());
            q_failed.store(true, Ordering::Relaxed);
        }
    };
    let sys_params = params.to_sys();
    let tgt_fn = move |dev: &mut UblkDev| {
        dev.set_default_params(params.dev_sectors << 9);
        dev.tgt.params = sys_params;
        Ok(())
    };
    let name = info.name.clone();
    let recovered = recover.is_some();
    let dev_fn = move |ctrl: &UblkCtrl| {
        let path = ctrl.get_bdev_path();
        if recovered {
            tracing::info!(device = %path, volume = %name, "ublk device taken back (user recovery)");
        } else {
            tracing::info!(device = %path, volume = %name, "ublk device ready");
        }
        on_ready(&path);
    };
    // libublk keeps the control ring per thread: run_target must run on the
    // thread that built `ctrl`. It returns when the queues have ended.
    let result = ctrl.run_target(tgt_fn, q_fn, dev_fn);
    stop.store(true, Ordering::Relaxed);
    if recovered {
        // libublk deletes only the devices it added.
        let _ = ctrl.del_dev();
    }
    drop(ctrl); // deletes an added device
    AttachRecord::remove_in(record_dir, dev_id);
    result.map_err(|e| ublk_err("serving the ublk device", e))?;
    if failed.load(Ordering::Relaxed) {
        return Err(Error::invalid("a ublk queue failed (see the log); the device was removed"));
    }
    Ok(())
}

/// The process serving a ublk device, if it still runs (none: never
/// started, or its server died and the kernel holds its requests).
fn live_server(info: &libublk::sys::ublksrv_ctrl_dev_info) -> Option<u32> {
    let pid = u32::try_from(info.ublksrv_pid).ok().filter(|&p| p > 0)?;
    pid_alive(pid).then_some(pid)
}

/// Checks that the device of `record` is one this volume can take back
/// (its server gone, the same block size, capacity and buffer size), starts
/// its user recovery and returns its control for `run_target`.
fn start_recovery(record: &AttachRecord, params: &DeviceParams) -> Result<UblkCtrl> {
    let id = record.dev_id;
    let dev = format!("/dev/ublkb{id}");
    let old = UblkCtrl::new_simple(id as i32).map_err(|e| ublk_err(&format!("opening {dev} to take it back"), e))?;
    let info = old.dev_info();
    if let Some(pid) = live_server(&info) {
        return Err(Error::invalid(format!("{dev} is served by process {pid}: not taking it back")));
    }
    if info.flags & CTRL_FLAGS != CTRL_FLAGS {
        return Err(Error::invalid(format!("{dev} was made without user recovery: detach it and attach again")));
    }
    let mut p = libublk::sys::ublk_params { len: std::mem::size_of::<libublk::sys::ublk_params>() as u32, ..Default::default() };
    old.get_params(&mut p).map_err(|e| ublk_err(&format!("reading {dev}'s parameters"), e))?;
    let (shift, sectors) = (p.basic.logical_bs_shift, p.basic.dev_sectors);
    if shift != params.block_shift || sectors != params.dev_sectors || info.max_io_buf_bytes != params.io_buf_bytes {
        return Err(Error::invalid(format!(
            "{dev} does not fit the volume any more: it has blocks of {} bytes, {} sectors and {}-byte buffers; \
             the volume now gives {}, {} and {} (detach it and attach again)",
            1u32 << shift,
            sectors,
            info.max_io_buf_bytes,
            1u32 << params.block_shift,
            params.dev_sectors,
            params.io_buf_bytes
        )));
    }
    // Waits (EBUSY, up to 30 s) until the kernel has noticed the old
    // server's end and quiesced the device.
    old.start_user_recover().map_err(|e| ublk_err(&format!("starting the recovery of {dev}"), e))?;
    drop(old);
    UblkCtrlBuilder::default()
        .name("rdmablk")
        .id(id as i32)
        .nr_queues(info.nr_hw_queues)
        .depth(info.queue_depth)
        .io_buf_bytes(info.max_io_buf_bytes)
        .ctrl_flags(CTRL_FLAGS)
        .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        .build()
        .map_err(|e| ublk_err(&format!("taking back {dev}"), e))
}

/// A thread that stops device `dev_id` on SIGINT or SIGTERM.
fn stop_on_signals(dev_id: u32) -> Result<Arc<AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .map_err(|e| Error::io("installing the SIGINT/SIGTERM handlers", e))?;
    let done = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&done);
    std::thread::Builder::new()
        .name("ublk-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if d.load(Ordering::Relaxed) {
                    return;
                }
                tracing::info!(signal = sig, "stopping /dev/ublkb{dev_id}");
                if let Ok(c) = UblkCtrl::new_simple(dev_id as i32) {
                    let _ = c.kill_dev();
                }
            }
        })
        .map_err(|e| Error::io("starting the signal thread", e))?;
    Ok(done)
}

/// Wakes `waker` for every CQE posted to the ublk ring, until `stop`.
fn ring_bridge(efd: Arc<OwnedFd>, waker: IoWaker, stop: Arc<AtomicBool>) {
    let mut b = [0u8; 8];
    while !stop.load(Ordering::Acquire) {
        match rustix::io::read(&*efd, &mut b) {
            Ok(_) => waker.wake(),
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
    }
}

struct Tag {
    buffer: Option<IoBuffer>,
    addr: *mut u8,
    op: VolumeOp,
}

/// Tells libublk's `start_dev`, which waits for every queue to report its
/// buffers, that this queue's are in place, or (dropped unreported) that
/// the queue failed: libublk 0.4 has only the mlock failure for that, so
/// `start_dev` fails with EPERM and the device is deleted.
struct Registration<'a> {
    dev: &'a UblkDev,
    reported: bool,
}

impl Registration<'_> {
    fn done(&mut self) {
        self.dev.notify_buffer_registration_complete(false);
        self.reported = true;
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if !self.reported {
            self.dev.notify_buffer_registration_complete(true);
        }
    }
}

fn serve_queue(qid: u16, dev: &UblkDev, session: &Session, volume: &Volume) -> Result<()> {
    let mut registration = Registration { dev, reported: false };
    let q = UblkQueue::new(qid, dev).map_err(|e| ublk_err("setting up the ublk queue", e))?;
    let mut ioq = session.io_queue();
    let waker = ioq.waker()?;
    let efd = Arc::new(
        rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
            .map_err(|e| Error::io("creating the ublk ring's eventfd", e.into()))?,
    );
    libublk::io::with_task_io_ring(|ring| ring.submitter().register_eventfd(efd.as_raw_fd()).map_err(UblkError::IOError))
        .map_err(|e| ublk_err("registering the ublk ring's eventfd", e))?;
    let stop = Arc::new(AtomicBool::new(false));
    let bridge = {
        let (efd, stop) = (Arc::clone(&efd), Arc::clone(&stop));
        std::thread::Builder::new()
            .name(format!("ublk-wake-{qid}"))
            .spawn(move || ring_bridge(efd, waker, stop))
            .map_err(|e| Error::io("starting the ublk wake-up thread", e))?
    };

    let buf_len = dev.dev_info.max_io_buf_bytes as usize;
    let mut tags = Vec::with_capacity(q.get_depth() as usize);
    for _ in 0..q.get_depth() {
        let buffer = session.alloc_buffer(buf_len)?;
        let addr = buffer.as_slice().as_ptr() as *mut u8;
        tags.push(Tag { buffer: Some(buffer), addr, op: VolumeOp::Flush });
    }
    for tag in q.tags() {
        // The FETCH's future is only the async API's way to wait for this
        // tag's first request; the completion is read from the ring below.
        #[allow(deprecated, clippy::let_underscore_future)]
        let _ = q.submit_io_cmd(tag, libublk::sys::UBLK_U_IO_FETCH_REQ, tags[tag as usize].addr, -1);
    }

    // Our buffers go to the kernel with each FETCH, not through libublk's
    // registration, which start_dev waits for.
    registration.done();
    let mut arrived: Vec<u16> = Vec::new();
    let mut done: Vec<IoCompletion> = Vec::new();
    let result = loop {
        let to_wait = if ioq.outstanding() == 0 { 1 } else { 0 };
        let r = q.flush_and_wake_io_tasks(
            |user_data, cqe, _| {
                // Our only ring traffic is ublk commands: a result of 0 is a new request.
                if user_data & (libublk::UblkUringData::Target as u64) == 0 && cqe.result() == 0 {
                    arrived.push((user_data & 0xffff) as u16);
                }
            },
            to_wait,
        );
        match r {
            Ok(_) => {}
            Err(UblkError::QueueIsDown) => break Ok(()),
            Err(e) => break Err(ublk_err("waiting on the ublk queue", e)),
        }
        for tag in arrived.drain(..) {
            let iod = q.get_iod(tag);
            let op = translate(iod.op_flags, iod.start_sector, iod.nr_sectors);
            let t = &mut tags[tag as usize];
            t.op = op;
            let req = match op {
                VolumeOp::Read { offset, len } => {
                    IoRequest::read(volume, offset, t.buffer.take().expect("a free tag has its buffer"))
                        .with_range(0, len as usize)
                }
                VolumeOp::Write { offset, len, fua } => {
                    let r = IoRequest::write(volume, offset, t.buffer.take().expect("a free tag has its buffer"))
                        .with_range(0, len as usize);
                    if fua {
                        r.with_fua()
                    } else {
                        r
                    }
                }
                VolumeOp::Flush => IoRequest::flush(volume),
                VolumeOp::Discard { offset, len } => IoRequest::discard(volume, offset, len),
                VolumeOp::WriteZeroes { offset, len } => IoRequest::write_zeroes(volume, offset, len),
                VolumeOp::Unsupported(code) => {
                    tracing::warn!(queue = qid, tag, op = code, "ublk operation not supported");
                    #[allow(deprecated)]
                    q.complete_io_cmd(tag, t.addr, Ok(UblkIORes::Result(result_code(op, &Ok(())))));
                    continue;
                }
            };
            ioq.submit(req, u64::from(tag));
        }
        if ioq.outstanding() > 0 {
            ioq.wait(&mut done, 1, Some(Duration::from_secs(1)));
        }
        for c in done.drain(..) {
            let tag = c.tag as u16;
            let t = &mut tags[tag as usize];
            if let Some(b) = c.buffer {
                t.buffer = Some(b);
            }
            if let Err(e) = &c.result {
                tracing::warn!(queue = qid, tag, "ublk request failed: {}", e.one_line());
            }
            let res = result_code(t.op, &c.result);
            #[allow(deprecated)]
            q.complete_io_cmd(tag, t.addr, Ok(UblkIORes::Result(res)));
        }
    };
    // Requests still with the target hold their tags' buffers: wait for them.
    let limit = Instant::now() + session.options().io_timeout + Duration::from_secs(1);
    while ioq.outstanding() > 0 && Instant::now() < limit {
        ioq.wait(&mut done, 1, Some(Duration::from_millis(100)));
        done.clear();
    }
    stop.store(true, Ordering::Release);
    let _ = rustix::io::write(&*efd, &1u64.to_ne_bytes());
    let _ = bridge.join();
    if result.is_err() {
        // The kernel may still hold FETCH commands naming these buffers:
        // never free memory it could write into.
        std::mem::forget(tags);
    }
    result
}

/// `rdmablk detach DEV`: stops the device (its `rdmablk attach` then
/// deletes it and exits); refused while a file system on it is mounted.
pub fn detach(path: &str, out: &mut dyn Write) -> Result<()> {
    let id = super::parse_dev_path(path)?;
    if !Path::new(CONTROL).exists() {
        return Err(Error::invalid(format!(
            "the kernel has no ublk driver (modprobe ublk_drv): {CONTROL} does not exist"
        )));
    }
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path.to_string(), e))?;
    let rdev = meta.rdev();
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io("reading /proc/self/mountinfo", e))?;
    let mounts = super::mount_points(&mountinfo, major, minor);
    if !mounts.is_empty() {
        return Err(Error::invalid(format!(
            "refusing to detach {path}: a file system on it is mounted on {} (unmount it first)",
            mounts.join(", ")
        )));
    }
    let ctrl = UblkCtrl::new_simple(id as i32).map_err(|e| ublk_err(&format!("opening ublk device {id}"), e))?;
    if live_server(&ctrl.dev_info()).is_none() {
        // Its rdmablk attach died (the kernel holds the device's requests
        // for a successor): nobody else will delete it.
        ctrl.del_dev().map_err(|e| ublk_err(&format!("deleting {path}"), e))?;
        AttachRecord::remove_in(Path::new(RECORD_DIR), id);
        return writeln!(out, "detached {path} (its rdmablk attach had ended; requests it held failed)")
            .map_err(|e| Error::io("writing the output", e));
    }
    ctrl.kill_dev().map_err(|e| ublk_err(&format!("stopping {path}"), e))?;
    // Its rdmablk attach deletes it when its queues have ended.
    let deadline = Instant::now() + Duration::from_secs(30);
    let cdev = format!("/dev/ublkc{id}");
    while Path::new(path).exists() || Path::new(&cdev).exists() {
        if Instant::now() >= deadline {
            return Err(Error::invalid(format!(
                "{path} is stopped but still exists after 30 s: is its rdmablk attach still running?"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    writeln!(out, "detached {path}").map_err(|e| Error::io("writing the output", e))
}
