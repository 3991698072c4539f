//! The committed seed corpus, generated from the real encoders so that it
//! follows the protocol when the protocol changes. `tests/corpus.rs` checks
//! that `corpus/<target>/` holds exactly these bytes and rewrites the files
//! when `RDMABLK_WRITE_SEEDS=1` is set.

use rdmablk_common::protocol::{
    AuthChallenge, AuthResponse, AuthSuccess, BlockCount, CommandCapsule, CommandId, ConnectReply, DataDescriptor,
    Lba, Opcode, ResponseCapsule, SessionId, Status, VolumeId, VolumeInfo, AUTH_ALGORITHM_HMAC_SHA256, FLAG_FUA,
    FLAG_INLINE_DATA, PROTOCOL_VERSION, VOLUME_FLAG_DISCARD, VOLUME_FLAG_READ_ONLY, VOLUME_FLAG_WRITE_ZEROES,
};

use crate::tcp_frames::{
    control, hello, CTL_SCATTER, CTL_WINDOW, Frame, Region, CLIENT_PRIVATE, FLAG_ACK_REQUESTED, FLAG_INVALIDATE, RECV_LEN,
    SERVER_READ_LEN, TY_ACK, TY_DISCONNECT, TY_READ_REQ, TY_READ_RESP, TY_SEND, TY_TERMINATE, TY_WRITE, WINDOW_INDEX,
};

/// Directories (relative to the repository root) whose files are further
/// seeds of `target`: used by scripts/fuzz.sh and replayed by tests/corpus.rs.
pub fn extra_seed_dirs(target: &str) -> &'static [&'static str] {
    match target {
        "config_parse" => &["configs"],
        _ => &[],
    }
}

/// One seed file: `corpus/<target>/<name>`.
pub struct Seed {
    pub target: &'static str,
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut seeds = Vec::new();
    let mut add = |target: &'static str, list: Vec<(String, Vec<u8>)>| {
        seeds.extend(list.into_iter().map(|(name, bytes)| Seed { target, name, bytes }));
    };
    add("capsule_decode", capsules());
    add("tcp_frames", frames());
    add("nvme_tcp_pdus", nvme_tcp_pdus());
    add("nvme_commands", nvme_commands());
    add("config_parse", configs());
    seeds
}

fn message(capsule: &CommandCapsule, inline: &[u8]) -> Vec<u8> {
    let mut m = capsule.to_bytes().to_vec();
    m.extend_from_slice(inline);
    m
}

fn command_with_inline(opcode: Opcode, inline: &[u8]) -> Vec<u8> {
    let mut c = CommandCapsule::new(opcode, CommandId(3));
    c.inline_len = inline.len() as u32;
    message(&c, inline)
}

fn connect_reply() -> ConnectReply {
    ConnectReply {
        version: PROTOCOL_VERSION,
        queue_depth: 32,
        max_io_size: 1 << 20,
        inline_data_size: 4096,
        target_name: "rdmablk".into(),
        session_id: SessionId(0x1234_5678_9abc_def0),
        queue_index: 1,
    }
}

fn volume_info(id: u32, name: &str) -> VolumeInfo {
    VolumeInfo {
        volume_id: VolumeId(id),
        block_size: 4096,
        size_bytes: 64 << 20,
        flags: VOLUME_FLAG_DISCARD | VOLUME_FLAG_WRITE_ZEROES | if id == 2 { VOLUME_FLAG_READ_ONLY } else { 0 },
        name: name.into(),
    }
}

fn response_with(status: Status, data: &[u8]) -> Vec<u8> {
    let mut r = ResponseCapsule::failure(CommandId(3), status, 0);
    r.data_len = data.len() as u32;
    r.result = 1;
    let mut m = r.to_bytes().to_vec();
    m.extend_from_slice(data);
    m
}

/// A valid command of every opcode (and the flag variants), responses with
/// each reply structure, and the reply structures alone.
fn capsules() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let descriptor = DataDescriptor { remote_addr: 0x7f00_0000_1000, length: 8192, rkey: 0xabcd };
    for &op in Opcode::ALL {
        let mut c = CommandCapsule::new(op, CommandId(7));
        let mut inline = Vec::new();
        if op.is_io() || op == Opcode::CloseVolume {
            c.volume_id = VolumeId(1);
        }
        if op.is_io() && op != Opcode::Flush {
            c.start_block = Lba(16);
            c.block_count = BlockCount(2);
        }
        if op.uses_descriptor() {
            c.descriptor = descriptor;
        }
        match op {
            Opcode::Connect => {
                c.version = PROTOCOL_VERSION;
                c.queue_depth = 32;
                c.max_io_size = 1 << 20;
                inline = b"host-a".to_vec();
            }
            Opcode::AuthNegotiate => {
                c.session_id = SessionId(5);
                inline = b"host-a".to_vec();
            }
            Opcode::AuthReply => {
                inline = AuthResponse { initiator_nonce: [0x11; 32], mac: [0x22; 32] }.to_bytes().to_vec();
            }
            Opcode::OpenVolume => inline = b"vol0".to_vec(),
            _ => {}
        }
        c.inline_len = inline.len() as u32;
        out.push((format!("cmd-{op:?}").to_lowercase(), message(&c, &inline)));
    }
    let mut w = CommandCapsule::new(Opcode::Write, CommandId(8));
    w.volume_id = VolumeId(1);
    w.block_count = BlockCount(1);
    w.flags = FLAG_INLINE_DATA | FLAG_FUA;
    w.inline_len = 512;
    out.push(("cmd-write-inline-fua".into(), message(&w, &[0x5a; 512])));
    let mut join = CommandCapsule::new(Opcode::Connect, CommandId(0));
    join.version = PROTOCOL_VERSION;
    join.queue_depth = 4;
    join.max_io_size = 4096;
    join.session_id = SessionId(0x1234_5678_9abc_def0);
    join.inline_len = 6;
    out.push(("cmd-connect-join".into(), message(&join, b"host-a")));
    out.push(("cmd-connect-no-host".into(), command_with_inline(Opcode::Connect, b"")));

    out.push(("resp-success".into(), ResponseCapsule::success(CommandId(9)).to_bytes().to_vec()));
    out.push((
        "resp-version-mismatch".into(),
        ResponseCapsule::failure(CommandId(1), Status::VersionMismatch, 1).to_bytes().to_vec(),
    ));
    let reply = connect_reply().to_bytes().expect("encodes");
    out.push(("resp-connect-reply".into(), response_with(Status::Success, &reply)));
    let info = volume_info(1, "vol0").to_bytes().expect("encodes");
    out.push(("resp-volume-info".into(), response_with(Status::Success, &info)));
    let challenge =
        AuthChallenge { algorithm: AUTH_ALGORITHM_HMAC_SHA256, target_nonce: [0x33; 32], target_name: "rdmablk".into() }
            .to_bytes()
            .expect("encodes");
    out.push(("resp-auth-challenge".into(), response_with(Status::Success, &challenge)));
    let success = AuthSuccess { mac: [0x44; 32] }.to_bytes();
    out.push(("resp-auth-success".into(), response_with(Status::Success, &success)));

    out.push(("connect-reply".into(), reply.to_vec()));
    out.push(("volume-info".into(), info.to_vec()));
    let mut list = info.to_vec();
    list.extend_from_slice(&volume_info(2, "ro-volume").to_bytes().expect("encodes"));
    out.push(("volume-list".into(), list));
    out.push(("auth-challenge".into(), challenge.to_vec()));
    out.push(("auth-response".into(), AuthResponse { initiator_nonce: [0x55; 32], mac: [0x66; 32] }.to_bytes().to_vec()));
    out
}

/// A work-request frame with `seq` and its payload.
fn wr(mut f: Frame, seq: u32, payload: &[u8]) -> Vec<u8> {
    f.seq = seq;
    f.length = payload.len() as u32;
    let mut out = f.encode().to_vec();
    out.extend_from_slice(payload);
    out
}

fn send(seq: u32, payload: &[u8]) -> Vec<u8> {
    wr(Frame { flags: FLAG_ACK_REQUESTED, ..Frame::new(TY_SEND) }, seq, payload)
}

fn write(seq: u32, region: Region, offset: u64, payload: &[u8]) -> Vec<u8> {
    let f = Frame { flags: FLAG_ACK_REQUESTED, remote_addr: offset, rkey: region.index(), ..Frame::new(TY_WRITE) };
    wr(f, seq, payload)
}

/// A SEND with Invalidate of the key `index` names (a region's, the
/// window's; see the tcp_frames module).
fn send_invalidate(seq: u32, index: u32, payload: &[u8]) -> Vec<u8> {
    wr(Frame { flags: FLAG_ACK_REQUESTED | FLAG_INVALIDATE, rkey: index, ..Frame::new(TY_SEND) }, seq, payload)
}

/// An RDMA WRITE through the window (control bit 6), `offset` into it.
fn window_write(seq: u32, offset: u64, payload: &[u8]) -> Vec<u8> {
    wr(Frame { flags: FLAG_ACK_REQUESTED, remote_addr: offset, rkey: WINDOW_INDEX, ..Frame::new(TY_WRITE) }, seq, payload)
}

fn read_req(seq: u32, region: Region, offset: u64, len: u32) -> Vec<u8> {
    let f = Frame { remote_addr: offset, rkey: region.index(), aux: len, ..Frame::new(TY_READ_REQ) };
    wr(f, seq, &[])
}

fn seed(ctl: u8, frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![ctl];
    for f in frames {
        out.extend_from_slice(f);
    }
    out
}

/// Handshakes, each frame type in a valid state, and the usual protection
/// violations. Control byte: see the tcp_frames module.
fn frames() -> Vec<(String, Vec<u8>)> {
    let c = |recvs| control(true, false, recvs);
    let with_sends = |recvs| control(true, true, recvs);
    let ack = |n: u32| Frame { ack: n, ..Frame::new(TY_ACK) }.encode().to_vec();
    let read_resp = |seq_acked: u32, len: u32| {
        let f = Frame { ack: seq_acked, length: len, aux: 3, ..Frame::new(TY_READ_RESP) };
        let mut out = f.encode().to_vec();
        out.extend((0..len).map(|i| i as u8));
        out
    };
    vec![
        ("handshake-only".into(), seed(c(4), &[])),
        ("raw-hello".into(), seed(control(false, false, 2), &[hello(CLIENT_PRIVATE)])),
        ("raw-hello-no-private".into(), seed(control(false, false, 1), &[hello(b""), send(1, b"x")])),
        ("send".into(), seed(c(2), &[send(1, b"hello, target")])),
        ("send-two".into(), seed(c(2), &[send(1, b"first"), send(2, &[7; RECV_LEN as usize])])),
        ("send-too-long".into(), seed(c(1), &[send(1, &[1; RECV_LEN as usize + 1])])),
        ("send-no-receive".into(), seed(c(0), &[send(1, b"rnr"), send(2, b"dropped")])),
        ("send-empty".into(), seed(c(1), &[send(1, b"")])),
        ("write".into(), seed(c(1), &[write(1, Region::RemoteWrite, 100, &[0xee; 64])])),
        ("write-then-read".into(), seed(c(1), &[
            write(1, Region::RemoteWrite, 0, b"payload"),
            read_req(2, Region::RemoteWrite, 0, 7),
        ])),
        ("write-read-only-region".into(), seed(c(1), &[write(1, Region::RemoteRead, 0, &[1; 16])])),
        ("write-no-rights-region".into(), seed(c(1), &[write(1, Region::NoRights, 0, &[1; 16])])),
        ("write-receive-region".into(), seed(c(1), &[write(1, Region::Receives, 0, &[1; 16])])),
        ("write-past-end".into(), seed(c(1), &[write(1, Region::RemoteWrite, 4090, &[1; 16])])),
        ("write-wraps".into(), seed(c(1), &[write(1, Region::RemoteWrite, u64::MAX - 3, &[1; 16])])),
        ("write-empty-unknown-rkey".into(), seed(c(1), &[
            wr(Frame { rkey: 0xdead_beef, ..Frame::new(TY_WRITE) }, 1, &[]),
        ])),
        ("read".into(), seed(c(1), &[read_req(1, Region::RemoteRead, 0, 256)])),
        ("read-whole-region".into(), seed(c(1), &[read_req(1, Region::RemoteWrite, 0, 4096)])),
        ("read-no-rights".into(), seed(c(1), &[read_req(1, Region::LocalOnly, 0, 16)])),
        ("read-past-end".into(), seed(c(1), &[read_req(1, Region::RemoteRead, 4000, 200)])),
        ("server-sends-acked".into(), seed(with_sends(1), &[ack(2), read_resp(2, SERVER_READ_LEN)])),
        ("server-read-short-response".into(), seed(with_sends(1), &[ack(2), read_resp(2, 16)])),
        ("server-read-long-response".into(), seed(with_sends(1), &[read_resp(0, SERVER_READ_LEN + 64)])),
        ("scatter-send".into(), seed(c(2) | CTL_SCATTER, &[send(1, &(0..150).map(|i| i as u8).collect::<Vec<_>>())])),
        ("scatter-send-too-long".into(), seed(c(1) | CTL_SCATTER, &[send(1, &[9; RECV_LEN as usize + 1])])),
        ("scatter-server-read".into(), seed(with_sends(1) | CTL_SCATTER, &[ack(2), read_resp(2, SERVER_READ_LEN)])),
        ("server-sends-ack-too-far".into(), seed(with_sends(1), &[ack(9)])),
        ("terminate".into(), seed(c(1), &[
            Frame { seq: 1, aux: 1, ..Frame::new(TY_TERMINATE) }.encode().to_vec(),
        ])),
        ("disconnect".into(), seed(c(1), &[send(1, b"bye"), Frame::new(TY_DISCONNECT).encode().to_vec()])),
        ("write-window".into(), seed(c(1) | CTL_WINDOW, &[window_write(1, 0, &[0xee; 64])])),
        ("send-invalidate-window".into(), seed(c(2) | CTL_WINDOW, &[
            send_invalidate(1, WINDOW_INDEX, b"done"),
            window_write(2, 0, &[0xee; 16]),
        ])),
        ("send-invalidate-region".into(), seed(c(1), &[send_invalidate(1, Region::RemoteWrite.index(), b"not a window")])),
        ("send-invalidate-no-window".into(), seed(c(1), &[send_invalidate(1, WINDOW_INDEX, b"none bound")])),
        ("hello-after-handshake".into(), seed(c(1), &[hello(b"again")])),
        ("wrong-seq".into(), seed(c(1), &[send(2, b"x")])),
        ("truncated-header".into(), seed(c(1), &[send(1, b"x")[..20].to_vec()])),
        ("truncated-payload".into(), seed(c(1), &[send(1, b"0123456789")[..36].to_vec()])),
    ]
}

const GOOD_TARGET: &str = r#"[target]
name = "t1"
listen = ["tcp://127.0.0.1:7420", "tcp://[::1]:0"]
reactors = 2
queue_depth = 64
max_io_size = "1MiB"
inline_data_size = "4KiB"
buffer_pool = "8MiB"
chunk_size = "128KiB"
shutdown_timeout = "2s"
"#;

/// Variants of the configurations the config tests use, each backend, and
/// a few that fail late in validation. The shipped `configs/*.toml` are
/// seeds too, read where they are (see [`extra_seed_dirs`]), so that editing
/// them never makes this corpus stale.
fn configs() -> Vec<(String, Vec<u8>)> {
    let file_volume = "\n[[volume]]\nname = \"vol0\"\nbackend = \"file\"\npath = \"/tmp/vol0.img\"\nsize = \"1GiB\"\nblock_size = 4096\n";
    let texts: Vec<(&str, String)> = vec![
        ("good.toml", format!("{GOOD_TARGET}{file_volume}\n[[volume]]\nname = \"vol1\"\nbackend = \"file\"\npath = \"/dev/loop0\"\nread_only = true\n")),
        ("minimal.toml", "[target]\nlisten = [\"tcp://127.0.0.1:0\"]\n[[volume]]\nname = \"v\"\nbackend = \"null\"\nsize = 4096\n".to_owned()),
        ("memory-and-null.toml", "[target]\nlisten = [\"rdma://10.0.0.1:7420\"]\n\n[[volume]]\nname = \"ram0\"\nbackend = \"memory\"\nsize = \"64MiB\"\nblock_size = \"512\"\n\n[[volume]]\nname = \"null0\"\nbackend = \"null\"\nsize = \"1TiB\"\nread_only = true\n".to_owned()),
        ("limits.toml", format!("{GOOD_TARGET}max_sessions = 8\nmax_queues_per_session = 4\nmax_handshakes = 16\nhandshake_timeout = \"500ms\"\nsession_pool_share = \"50%\"\nmetrics = \"[::1]:9420\"\npin_reactors = false\nsqpoll = true\n{file_volume}")),
        ("pool-share-bytes.toml", format!("{GOOD_TARGET}session_pool_share = \"1MiB\"\n{file_volume}")),
        (
            "pool-shares-and-wait.toml",
            format!("{GOOD_TARGET}session_pool_share = \"1MiB\"\nhost_pool_share = \"50%\"\nchunk_wait_timeout = \"750ms\"\n{file_volume}"),
        ),
        ("iopoll-memory.toml", format!("{GOOD_TARGET}iopoll = true\n[[volume]]\nname = \"m\"\nbackend = \"memory\"\nsize = \"1MiB\"\n")),
        ("duplicate-volume.toml", format!("{GOOD_TARGET}{file_volume}{file_volume}")),
        ("size-not-multiple.toml", format!("{GOOD_TARGET}\n[[volume]]\nname = \"v\"\nbackend = \"null\"\nsize = 1000\nblock_size = 512\n")),
        ("unknown-key.toml", format!("{GOOD_TARGET}colour = \"blue\"\n{file_volume}")),
        ("hosts.toml", format!("{GOOD_TARGET}busy_poll = \"1ms\"\n{file_volume}allowed_hosts = [\"alpha\"]\nread_only_hosts = [\"beta\"]\n\n[[volume]]\nname = \"shared\"\nbackend = \"null\"\nsize = \"1GiB\"\nallow_any_host = true\n\n[[host]]\nid = \"alpha\"\nkey_file = \"/etc/rdmablk/alpha.key\"\n\n[[host]]\nid = \"beta\"\nkey_file = \"/etc/rdmablk/beta.key\"\n")),
        ("grant-unknown-host.toml", format!("{GOOD_TARGET}{file_volume}allowed_hosts = [\"gamma\"]\n[[host]]\nid = \"alpha\"\nkey_file = \"/k\"\n")),
        (
            "nvme-only.toml",
            "[target]\nlisten = [\"nvme+tcp://127.0.0.1:4420\"]\n[[volume]]\nname = \"v\"\nbackend = \"null\"\nsize = 4096\nallowed_hosts = [\"h\"]\n[[host]]\nid = \"h\"\nnqn = \"nqn.2014-08.org.nvmexpress:uuid:seed\"\n".to_owned(),
        ),
        ("bad-toml.toml", "[target\nlisten = [\"tcp://127.0.0.1:0\"\n".to_owned()),
    ];
    texts.into_iter().map(|(name, text)| (name.to_owned(), text.into_bytes())).collect()
}

/// NVMe/TCP PDU streams (`nvme_tcp_pdus`): byte 0 is the harness's control
/// byte (bit 0 initialized, bit 1 header digests, bit 2 data digests).
fn nvme_tcp_pdus() -> Vec<(String, Vec<u8>)> {
    use rdmablk_common::nvme::cqe::CompletionEntry;
    use rdmablk_common::nvme::fabrics::{Connect, ConnectData, ANY_CONTROLLER, CONNECT_DATA_SIZE};
    use rdmablk_common::nvme::sqe::{io_opcode, Sgl, SubmissionEntry};
    use rdmablk_common::nvme::status::Status;
    use rdmablk_common::nvme::tcp::{DataPdu, Digests, IcReq, IcResp, Pdu, R2t, TermReq};

    fn pdu(out: &mut Vec<u8>, p: Pdu, digests: Digests, data: &[u8]) {
        out.extend_from_slice(&p.to_wire(digests, data, 0));
    }
    let none = Digests::default();
    let both = Digests { header: true, data: true };
    let mut seeds = Vec::new();

    // A host's opening: ICReq, then the admin queue's Connect with its data.
    let mut s = vec![0x00];
    pdu(&mut s, Pdu::IcReq(IcReq { pfv: 0, hpda: 0, digests: none, maxr2t: 0 }), none, &[]);
    let mut connect = Connect { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato_ms: 5000 }.to_entry(1);
    connect.set_sgl(Sgl::InCapsule { offset: 0, length: CONNECT_DATA_SIZE as u32 });
    let mut data = [0u8; CONNECT_DATA_SIZE];
    ConnectData {
        host_id: [0x11; 16],
        controller_id: ANY_CONTROLLER,
        subsystem_nqn: "nqn.2026-11.io.rdmablk:seed".into(),
        host_nqn: "nqn.2014-08.org.nvmexpress:uuid:seed".into(),
    }
    .encode(&mut data)
    .expect("valid connect data");
    pdu(&mut s, Pdu::CapsuleCmd(connect), none, &data);
    seeds.push(("icreq-connect".to_string(), s));

    // A controller's answer, granting both digests, which its next PDU carries.
    let mut s = vec![0x00];
    pdu(&mut s, Pdu::IcResp(IcResp { pfv: 0, cpda: 0, digests: both, maxh2cdata: 131072 }), none, &[]);
    pdu(&mut s, Pdu::CapsuleResp(CompletionEntry { result: 1, ..CompletionEntry::new(1, Status::SUCCESS) }), both, &[]);
    seeds.push(("icresp-connected".to_string(), s));

    // A WRITE with in-capsule data, one through R2T and H2CData, and a READ
    // answered by C2HData with SUCCESS, all with both digests.
    let mut s = vec![0x07];
    let mut w = SubmissionEntry::new(io_opcode::WRITE, 2);
    w.nsid = 1;
    w.set_rw(8, 1, false);
    w.set_sgl(Sgl::InCapsule { offset: 0, length: 512 });
    pdu(&mut s, Pdu::CapsuleCmd(w), both, &[0x5a; 512]);
    let mut w2 = w;
    w2.cid = 3;
    w2.set_sgl(Sgl::Transport { length: 4096 });
    pdu(&mut s, Pdu::CapsuleCmd(w2), both, &[]);
    pdu(&mut s, Pdu::R2T(R2t { cccid: 3, ttag: 1, offset: 0, length: 4096 }), both, &[]);
    pdu(&mut s, Pdu::H2CData(DataPdu { cccid: 3, ttag: 1, offset: 0, length: 4096, last: true, success: false }), both, &[0xa5; 4096]);
    pdu(&mut s, Pdu::CapsuleResp(CompletionEntry::new(3, Status::SUCCESS)), both, &[]);
    let mut r = SubmissionEntry::new(io_opcode::READ, 4);
    r.nsid = 1;
    r.set_rw(0, 8, false);
    r.set_sgl(Sgl::Transport { length: 4096 });
    pdu(&mut s, Pdu::CapsuleCmd(r), both, &[]);
    pdu(&mut s, Pdu::C2HData(DataPdu { cccid: 4, ttag: 0, offset: 0, length: 4096, last: true, success: true }), both, &[0x3c; 4096]);
    pdu(&mut s, Pdu::CapsuleResp(CompletionEntry::new(5, Status::LBA_OUT_OF_RANGE)), both, &[]);
    seeds.push(("io-digests".to_string(), s));

    // A termination with the offending header as its data.
    let mut s = vec![0x01];
    pdu(&mut s, Pdu::C2HTermReq(TermReq { fes: 0x01, fei: 2 }), none, &[0x04, 0, 99, 0, 72, 0, 0, 0]);
    seeds.push(("c2h-termreq".to_string(), s));
    seeds
}

/// NVMe commands (`nvme_commands`): byte 0 bit 0 runs the harness's
/// Connect and enable first, bit 1 makes the queue NVMe/RDMA's; then records of a kind byte (bit 0: an I/O
/// command to plan), the 64-byte entry, N and N * 16 bytes of data.
fn nvme_commands() -> Vec<(String, Vec<u8>)> {
    use rdmablk_common::nvme::sqe::{admin_opcode, io_opcode, DsmRange, Sgl, SubmissionEntry, DSM_RANGE_SIZE};

    fn record(out: &mut Vec<u8>, io: bool, e: &SubmissionEntry, data: &[u8]) {
        assert_eq!(data.len() % 16, 0);
        out.push(io as u8);
        out.extend_from_slice(&e.to_bytes());
        out.push((data.len() / 16) as u8);
        out.extend_from_slice(data);
    }
    fn admin(op: u8, cid: u16, cdw: [u32; 6], nsid: u32, len: u32) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(op, cid);
        e.nsid = nsid;
        e.cdw = cdw;
        e.set_sgl(Sgl::Transport { length: len });
        e
    }
    fn io(op: u8, cid: u16, nsid: u32, slba: u64, blocks: u32, len: u32) -> SubmissionEntry {
        let mut e = SubmissionEntry::new(op, cid);
        e.nsid = nsid;
        e.set_rw(slba, blocks, false);
        e.set_sgl(Sgl::Transport { length: len });
        e
    }
    let mut identify = vec![1u8];
    record(&mut identify, false, &admin(admin_opcode::IDENTIFY, 1, [1, 0, 0, 0, 0, 0], 0, 4096), &[]);
    record(&mut identify, false, &admin(admin_opcode::IDENTIFY, 2, [2, 0, 0, 0, 0, 0], 0, 4096), &[]);
    record(&mut identify, false, &admin(admin_opcode::IDENTIFY, 3, [0, 0, 0, 0, 0, 0], 1, 4096), &[]);
    record(&mut identify, false, &admin(admin_opcode::IDENTIFY, 4, [3, 0, 0, 0, 0, 0], 2, 4096), &[]);
    record(&mut identify, false, &admin(admin_opcode::GET_LOG_PAGE, 5, [0x02 | 127 << 16, 0, 0, 0, 0, 0], 0, 512), &[]);
    record(&mut identify, false, &admin(admin_opcode::GET_LOG_PAGE, 6, [0x05 | 1023 << 16, 0, 0, 0, 0, 0], 0, 4096), &[]);
    let mut features = vec![1u8];
    record(&mut features, false, &admin(admin_opcode::SET_FEATURES, 1, [0x07, 0x0003_0003, 0, 0, 0, 0], 0, 0), &[]);
    record(&mut features, false, &admin(admin_opcode::SET_FEATURES, 2, [0x0b, 1 << 8, 0, 0, 0, 0], 0, 0), &[]);
    record(&mut features, false, &admin(admin_opcode::GET_FEATURES, 3, [0x0f, 0, 0, 0, 0, 0], 0, 0), &[]);
    record(&mut features, false, &admin(admin_opcode::ASYNC_EVENT_REQUEST, 4, [0; 6], 0, 0), &[]);
    record(&mut features, false, &admin(admin_opcode::KEEP_ALIVE, 5, [0; 6], 0, 0), &[]);
    let mut ranges = Vec::new();
    for (slba, blocks) in [(0u64, 8u32), (2040, 8)] {
        let mut r = [0u8; DSM_RANGE_SIZE];
        DsmRange { attributes: 0, blocks, slba }.encode(&mut r);
        ranges.extend_from_slice(&r);
    }
    let mut io_plans = vec![1u8];
    record(&mut io_plans, true, &io(io_opcode::READ, 1, 1, 0, 8, 4096), &[]);
    record(&mut io_plans, true, &io(io_opcode::WRITE, 2, 1, 2040, 8, 4096), &[]);
    record(&mut io_plans, true, &io(io_opcode::WRITE, 3, 2, 0, 1, 4096), &[]);
    record(&mut io_plans, true, &io(io_opcode::WRITE_ZEROES, 4, 1, 16, 16, 0), &[]);
    let mut dsm = io(io_opcode::DATASET_MANAGEMENT, 5, 1, 0, 1, 32);
    dsm.cdw = [1, 1 << 2, 0, 0, 0, 0];
    record(&mut io_plans, true, &dsm, &ranges);
    let mut before_connect = vec![0u8];
    record(&mut before_connect, false, &admin(admin_opcode::IDENTIFY, 1, [1, 0, 0, 0, 0, 0], 0, 4096), &[]);
    // An NVMe/RDMA queue (byte 0 bit 1): keyed SGLs move the data; a
    // transport SGL is NVMe/TCP's and refused.
    let keyed = |mut e: SubmissionEntry, len: u32, invalidate: bool| {
        e.set_sgl(Sgl::Keyed { addr: 0x7f00_0000_1000, length: len, key: 0x1234, invalidate });
        e
    };
    let mut rdma = vec![3u8];
    record(&mut rdma, false, &keyed(admin(admin_opcode::IDENTIFY, 1, [1, 0, 0, 0, 0, 0], 0, 0), 4096, true), &[]);
    record(&mut rdma, false, &keyed(admin(admin_opcode::GET_LOG_PAGE, 2, [0x02 | 127 << 16, 0, 0, 0, 0, 0], 0, 0), 512, false), &[]);
    record(&mut rdma, false, &keyed(admin(admin_opcode::KEEP_ALIVE, 3, [0; 6], 0, 0), 0, false), &[]);
    record(&mut rdma, false, &admin(admin_opcode::IDENTIFY, 4, [1, 0, 0, 0, 0, 0], 0, 4096), &[]);
    record(&mut rdma, true, &keyed(io(io_opcode::READ, 5, 1, 0, 8, 0), 4096, true), &[]);
    vec![
        ("identify_and_logs".into(), identify),
        ("features_aer_keep_alive".into(), features),
        ("io_plans".into(), io_plans),
        ("before_connect".into(), before_connect),
        ("rdma_keyed".into(), rdma),
    ]
}
