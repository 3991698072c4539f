//! The metrics endpoint of the real daemon, scraped over HTTP:
//!
//! - its series do not grow with sessions: rounds of v1 sessions from many
//!   source addresses (127.0.0.2 ...) and NVMe/TCP controllers come and go,
//!   and the set of series stays the one of an idle target plus two per
//!   host id; no label is a session id, a peer address or port, or a
//!   controller id; host ids past the cap are summed under `(other)`;
//! - `rdmablk_build_info` and the `process_*` metrics describe the daemon
//!   as /proc and the toolchain see it.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdmablk_common::nvme::tcp::Digests;
use rdmablk_common::protocol::{CommandCapsule, CommandId, Opcode, Status, PROTOCOL_VERSION};
use rdmablk_system_tests::nvme_tcp::NvmeTcpConn;
use rdmablk_system_tests::{memory_volume, open_fds, rss_bytes, sample, sample_sum, scrape, wait_until, wire, Sample, TargetProcess, WireConn};

const SUBNQN: &str = "nqn.2026-11.io.rdmablk.test:metrics";
const HOST_NQNS: [&str; 2] = ["nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000000a", "nqn.2014-08.io.rdmablk.test:b"];
/// The v1 host ids of the rounds' sessions.
const HOSTS: [&str; 4] = ["host-a", "host-b", "host-c", "host-d"];
/// Sessions per round: 2 from each of 127.0.0.2 ..= 127.0.0.41.
const SESSIONS: usize = 80;
const CONTROLLERS: usize = 8;
const ROUNDS: usize = 3;
/// Every label name the endpoint may use. A new one is a decision to make
/// here, with its bound.
const LABELS: [&str; 15] =
    ["target", "version", "git_commit", "rustc", "result", "volume", "backend", "access", "op", "le", "class", "reason", "host", "reactor", "cpu"];

fn addr(last: usize) -> Ipv4Addr {
    assert!((2..=250).contains(&last));
    Ipv4Addr::new(127, 0, 0, last as u8)
}

/// A target with a v1 tcp:// and an NVMe/TCP listener, two reactors and
/// the metrics endpoint; its v1 URL and NVMe/TCP address.
fn start() -> (TargetProcess, String, SocketAddr) {
    let config = format!(
        "[target]\nlisten = [\"tcp://127.0.0.1:0\", \"nvme+tcp://127.0.0.1:0\"]\nnqn = \"{SUBNQN}\"\nreactors = 2\nmetrics = \"127.0.0.1:0\"\n{}",
        memory_volume("m", 16 << 20, false)
    );
    let t = TargetProcess::start(&config);
    let line = t.wait_for_log("listening on tcp://", Duration::from_secs(10));
    let at = line.find("tcp://").unwrap();
    let url: String = line[at..].chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != ',').collect();
    let nvme = t.nvme_tcp_addr();
    (t, url, nvme)
}

/// A v1 session of `host` from `source`: HELLO, CONNECT; the connection and
/// the session id.
fn session(url: &str, source: Ipv4Addr, host: &str) -> (WireConn, u64) {
    let mut c = WireConn::raw_from(url, source);
    c.send(&wire::hello());
    let (h, _) = c.read_frame(Duration::from_secs(10)).expect("a HELLO_REPLY");
    assert_eq!(h.ty, wire::HELLO_REPLY);
    let mut cmd = CommandCapsule::new(Opcode::Connect, CommandId(0));
    cmd.version = PROTOCOL_VERSION;
    cmd.queue_depth = 8;
    cmd.max_io_size = 1 << 20;
    let (r, data) = c.command(cmd, host.as_bytes());
    assert_eq!(r.status, Status::Success, "CONNECT of {host} from {source}");
    let reply = rdmablk_common::protocol::ConnectReply::decode(&data).expect("a CONNECT reply");
    (c, reply.session_id.0)
}

/// Every series as `name{k="v",...}`.
fn series(m: &[Sample]) -> BTreeSet<String> {
    m.iter().map(|s| format!("{}{:?}", s.name, s.labels)).collect()
}

fn is_host_series(s: &Sample) -> bool {
    s.name == "rdmablk_host_sessions" || s.name == "rdmablk_host_queue_pairs"
}

/// No label names a connection: its names are [`LABELS`], and no value is
/// a session id (as hex or decimal), a peer's `address:port` or port, or a
/// controller id.
fn assert_no_connection_labels(m: &[Sample], session_ids: &[u64], peers: &[String], cntlids: &[u16]) {
    let mut forbidden: BTreeSet<String> = BTreeSet::new();
    for id in session_ids {
        forbidden.extend([format!("{id:#x}"), format!("{id:#018x}"), format!("{id:x}"), id.to_string()]);
    }
    for p in peers {
        forbidden.insert(p.clone());
        forbidden.insert(p.rsplit(':').next().unwrap().to_owned());
        forbidden.insert(p.rsplit_once(':').unwrap().0.to_owned());
    }
    // Controller ids are small numbers that reactor and le labels may share;
    // only the cntlid-looking ones above the reactors' count are checked.
    forbidden.extend(cntlids.iter().filter(|&&c| c > 2).map(|c| c.to_string()));
    for s in m {
        for (k, v) in &s.labels {
            assert!(LABELS.contains(&k.as_str()), "{} has label {k}={v:?}: not one of {LABELS:?}", s.name);
            if k == "le" {
                continue;
            }
            assert!(!forbidden.contains(v), "{} {k}={v:?}: a value of one session or connection", s.name);
            // A session id's look (the target's name is the machine's,
            // which a container may have as 12 hex digits).
            let hex = v.strip_prefix("0x").unwrap_or(v);
            let id_like = hex.len() >= 12 && hex.bytes().all(|b| b.is_ascii_hexdigit());
            assert!(!id_like || k == "git_commit" || k == "target", "{} {k}={v:?}: looks like a session id", s.name);
        }
    }
}

#[test]
fn series_stay_bounded_over_many_sessions_from_many_addresses() {
    let (t, url, nvme) = start();
    let maddr = t.metrics_addr();
    let idle = scrape(&maddr);
    assert!(!idle.iter().any(is_host_series), "no session, no host series");
    let baseline = series(&idle);
    let mut seen = baseline.clone();
    let (mut session_ids, mut peers, mut cntlids) = (Vec::new(), Vec::new(), Vec::new());

    for round in 0..ROUNDS {
        let mut conns = Vec::new();
        for i in 0..SESSIONS {
            let (c, id) = session(&url, addr(2 + i / 2), HOSTS[i % HOSTS.len()]);
            session_ids.push(id);
            peers.push(c.peer.clone());
            conns.push(c);
        }
        let mut controllers = Vec::new();
        for i in 0..CONTROLLERS {
            let mut c = NvmeTcpConn::connect_from(nvme, addr(100 + i), Digests::default());
            let cntlid = c.admin_connect(SUBNQN, HOST_NQNS[i % 2], 0).unwrap_or_else(|s| panic!("admin Connect {i}: {s}"));
            c.enable();
            peers.push(c.stream.local_addr().unwrap().to_string());
            cntlids.push(cntlid);
            controllers.push(c);
        }
        wait_until("every session and controller counted", Duration::from_secs(10), || {
            let m = scrape(&maddr);
            sample(&m, "rdmablk_sessions_connected", &[]) == Some(SESSIONS as f64)
                && sample(&m, "rdmablk_nvme_controllers", &[]) == Some(CONTROLLERS as f64)
        });
        let m = scrape(&maddr);
        for h in HOSTS {
            let per_host = (SESSIONS / HOSTS.len()) as f64;
            assert_eq!(sample(&m, "rdmablk_host_sessions", &[("host", h)]), Some(per_host), "round {round} {h}");
            assert_eq!(sample(&m, "rdmablk_host_queue_pairs", &[("host", h)]), Some(per_host), "round {round} {h}");
        }
        let now = series(&m);
        // The same series as idle, and the host ones.
        let added: Vec<&String> = now.difference(&baseline).collect();
        assert_eq!(added.len(), 2 * HOSTS.len(), "round {round}: series beyond an idle target's: {added:#?}");
        assert!(m.iter().filter(|s| !baseline.contains(&format!("{}{:?}", s.name, s.labels))).all(is_host_series), "{added:#?}");
        let gone: Vec<&String> = baseline.difference(&now).collect();
        assert!(gone.is_empty(), "round {round}: series gone: {gone:#?}");
        assert_no_connection_labels(&m, &session_ids, &peers, &cntlids);
        seen.extend(now);

        drop(conns);
        drop(controllers);
        wait_until("sessions and controllers gone", Duration::from_secs(15), || {
            let m = scrape(&maddr);
            sample(&m, "rdmablk_sessions_connected", &[]) == Some(0.0) && sample(&m, "rdmablk_nvme_controllers", &[]) == Some(0.0)
        });
    }
    // 240 sessions from 40 addresses and 24 controllers later: the idle
    // target's series and two per host id, ever.
    assert_eq!(seen.len(), baseline.len() + 2 * HOSTS.len(), "{:#?}", seen.difference(&baseline).collect::<Vec<_>>());
    let after = scrape(&maddr);
    assert!(!after.iter().any(is_host_series), "no session, no host series");
    assert_eq!(series(&after), baseline);

    // Anonymous peers may name themselves anything: 100 made-up host ids
    // make 64 named hosts and (other).
    let mut conns = Vec::new();
    for i in 0..100 {
        let (c, id) = session(&url, addr(2 + i / 2), &format!("made-up-{i:03}"));
        session_ids.push(id);
        peers.push(c.peer.clone());
        conns.push(c);
    }
    wait_until("100 sessions counted", Duration::from_secs(10), || {
        sample(&scrape(&maddr), "rdmablk_sessions_connected", &[]) == Some(100.0)
    });
    let m = scrape(&maddr);
    let hosts: Vec<&Sample> = m.iter().filter(|s| s.name == "rdmablk_host_sessions").collect();
    assert_eq!(hosts.len(), 65, "64 host ids and (other)");
    assert_eq!(sample(&m, "rdmablk_host_sessions", &[("host", "(other)")]), Some(36.0));
    assert_eq!(sample_sum(&m, "rdmablk_host_sessions"), 100.0);
    assert_eq!(sample_sum(&m, "rdmablk_host_queue_pairs"), 100.0);
    assert_no_connection_labels(&m, &session_ids, &peers, &cntlids);
    t.assert_no_panic();
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

#[test]
fn build_info_and_process_metrics_describe_the_daemon() {
    let before = unix_now();
    let (t, url, _) = start();
    let maddr = t.metrics_addr();
    let m = scrape(&maddr);
    let get = |m: &[Sample], name: &str| sample(m, name, &[]).unwrap_or_else(|| panic!("{name} missing"));

    // Built from this workspace's version, with the toolchain that builds the tests.
    let info: Vec<&Sample> = m.iter().filter(|s| s.name == "rdmablk_build_info").collect();
    assert_eq!(info.len(), 1, "{info:?}");
    assert_eq!(info[0].value, 1.0);
    assert_eq!(info[0].labels["version"], env!("CARGO_PKG_VERSION"));
    let commit = &info[0].labels["git_commit"];
    if let Ok(out) = std::process::Command::new("git").args(["cat-file", "-t", commit]).output() {
        // A commit of this repository (HEAD may have moved since the build).
        if std::process::Command::new("git").args(["rev-parse", "--git-dir"]).output().is_ok_and(|o| o.status.success()) {
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "commit", "git_commit={commit:?} is no commit here");
        }
    }
    if let Ok(out) = std::process::Command::new("rustc").arg("--version").output() {
        let version = String::from_utf8_lossy(&out.stdout);
        assert_eq!(Some(info[0].labels["rustc"].as_str()), version.split_whitespace().nth(1), "rustc --version: {version}");
    }

    // Started within this test.
    let start_time = get(&m, "process_start_time_seconds");
    assert!(start_time >= before - 1.0 && start_time <= unix_now() + 1.0, "start {start_time}, test began {before}");

    // Descriptors: 30 sessions' sockets show, as /proc counts them.
    let fds_idle = get(&m, "process_open_fds");
    let conns: Vec<WireConn> = (0..30).map(|i| session(&url, addr(2 + i), "fd-host").0).collect();
    wait_until("30 sessions counted", Duration::from_secs(10), || {
        sample(&scrape(&maddr), "rdmablk_sessions_connected", &[]) == Some(30.0)
    });
    let m = scrape(&maddr);
    let fds = get(&m, "process_open_fds");
    let proc_fds = open_fds(t.pid()) as f64;
    assert!(fds >= fds_idle + 30.0, "30 sockets more: {fds_idle} then {fds}");
    assert!((fds - proc_fds).abs() <= 4.0, "process_open_fds {fds}, /proc/PID/fd {proc_fds}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", t.pid())).unwrap();
    let soft = limits.lines().find_map(|l| l.strip_prefix("Max open files")).unwrap().split_whitespace().next().unwrap();
    assert_eq!(get(&m, "process_max_fds"), soft.parse::<f64>().unwrap_or(f64::INFINITY), "{limits}");

    // Memory as /proc/PID/status says, within what moves between two reads.
    let rss = get(&m, "process_resident_memory_bytes");
    let proc_rss = rss_bytes(t.pid()) as f64;
    assert!((rss - proc_rss).abs() <= proc_rss * 0.1, "process_resident_memory_bytes {rss}, VmRSS {proc_rss}");
    assert!(get(&m, "process_virtual_memory_bytes") >= rss);

    // The reactors are threads of the process: their CPU time is part of its.
    let cpu = get(&m, "process_cpu_seconds_total");
    let reactors = sample_sum(&m, "rdmablk_reactor_cpu_seconds_total");
    assert!(cpu > 0.0, "the daemon started and served 30 sessions in no CPU time");
    assert!(cpu + 0.05 >= reactors, "process {cpu} s, its reactors {reactors} s");
    drop(conns);
    let later = get(&scrape(&maddr), "process_cpu_seconds_total");
    assert!(later >= cpu, "process_cpu_seconds_total went back: {cpu} then {later}");
    t.assert_no_panic();
}
