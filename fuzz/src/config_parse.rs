//! `config_parse`: [`Config::parse`] on arbitrary text.
//!
//! The input is taken as UTF-8 where it is valid and converted lossily where
//! it is not. `parse` must return, never panic. An error must be a
//! configuration error that names its source, as config.rs promises ("every
//! error names the file, the key and the reason"). A configuration it
//! accepts must satisfy every rule its validation enforces, since the rest
//! of the target relies on them without checking again, and parsing the same
//! text again must give the same configuration.

use std::collections::HashSet;

use rdmablk_common::fabric::ProviderKind;
use rdmablk_common::protocol::{MAX_HOST_ID_LEN, MAX_NAME_LEN};
use std::time::Duration;

use rdmablk_target::config::{
    BackendKind, Config, PoolShare, MAX_BUSY_POLL, MAX_CHUNK_SIZE, MAX_COUNT_LIMIT, MAX_MAX_IO_SIZE,
    MAX_POOL_CHUNKS, MAX_QUEUE_DEPTH, MAX_VOLUMES, PAGE,
};
use rdmablk_target::ErrorKind;

/// The `source` every parse names.
const SOURCE: &str = "fuzz";

/// The harness.
pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match Config::parse(&text, SOURCE) {
        Ok(config) => {
            check_invariants(&config);
            let again = Config::parse(&text, SOURCE).expect("the same text parses twice");
            assert_eq!(again, config, "parsing is not deterministic");
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Config, "parse failed with a non-configuration error: {e}");
            let message = e.to_string();
            assert!(message.starts_with("fuzz: "), "the error does not name its source: {message:?}");
        }
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && !name.contains('\0')
}

/// What `RawConfig::validate` enforces, restated from the accepted value.
pub fn check_invariants(c: &Config) {
    let t = &c.target;
    assert_eq!(c.source, SOURCE);
    assert!(valid_name(&t.name), "target.name {:?}", t.name);

    // A target may serve NVMe-oF alone: `listen` then holds only
    // NVMe-oF entries (nvme+tcp://, nvme+rdma://), which land in `nvme_listen`.
    assert!(!t.listen.is_empty() || !t.nvme_listen.is_empty(), "no listen URL");
    let unique: HashSet<_> = t.listen.iter().collect();
    assert_eq!(unique.len(), t.listen.len(), "a listen URL is listed twice: {:?}", t.listen);
    let unique: HashSet<_> = t.nvme_listen.iter().collect();
    assert_eq!(unique.len(), t.nvme_listen.len(), "an NVMe-oF listen URL is listed twice: {:?}", t.nvme_listen);
    for url in t.listen.iter().chain(t.nvme_listen.iter().map(|l| &l.url)) {
        assert!(!url.host.is_empty(), "listen URL without a host: {url:?}");
    }
    // tcp:// and nvme+tcp:// entries bind TCP ports, rdma:// and
    // nvme+rdma:// rdma_cm ports; never one port twice.
    let wildcard = |h: &str| h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
    for provider in [ProviderKind::Tcp, ProviderKind::Rdma] {
        let binds: Vec<_> = t.listen.iter().chain(t.nvme_listen.iter().map(|l| &l.url)).filter(|u| u.provider == provider).collect();
        for (i, a) in binds.iter().enumerate() {
            for b in &binds[i + 1..] {
                let shared = a.port != 0 && a.port == b.port && (a.host == b.host || wildcard(&a.host) || wildcard(&b.host));
                assert!(!shared, "two listeners on one {provider:?} port: {a:?} and {b:?}");
            }
        }
    }

    assert!(t.reactors >= 1, "reactors = {}", t.reactors);
    assert!((1..=MAX_QUEUE_DEPTH).contains(&t.queue_depth), "queue_depth = {}", t.queue_depth);

    let chunk = t.chunk_size;
    assert!(chunk != 0 && chunk % PAGE == 0 && chunk <= MAX_CHUNK_SIZE, "chunk_size = {chunk}");
    let max_io = t.max_io_size;
    assert!(max_io != 0 && max_io % PAGE == 0, "max_io_size = {max_io}");
    assert!((chunk..=MAX_MAX_IO_SIZE).contains(&max_io), "max_io_size = {max_io}, chunk_size = {chunk}");
    assert!(t.inline_data_size <= chunk && t.inline_data_size <= 64 << 10, "inline_data_size = {}", t.inline_data_size);
    let pool = t.buffer_pool;
    assert!(pool != 0 && pool % chunk as u64 == 0, "buffer_pool = {pool}, chunk_size = {chunk}");
    assert!(pool / chunk as u64 <= MAX_POOL_CHUNKS, "buffer_pool = {pool}: too many chunks");

    for (key, n) in [
        ("max_sessions", t.max_sessions),
        ("max_queues_per_session", t.max_queues_per_session),
        ("max_handshakes", t.max_handshakes),
    ] {
        assert!((1..=MAX_COUNT_LIMIT).contains(&n), "{key} = {n}");
    }
    let handshake = t.handshake_timeout;
    assert!(
        (Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&handshake),
        "handshake_timeout = {handshake:?}"
    );
    assert!(t.busy_poll <= MAX_BUSY_POLL, "busy_poll = {:?}", t.busy_poll);
    for (key, share) in [("session_pool_share", t.session_pool_share), ("host_pool_share", t.host_pool_share)] {
        match share {
            PoolShare::Percent(p) => assert!((1..=100).contains(&p), "{key} = {p}%"),
            PoolShare::Bytes(b) => assert!((chunk as u64..=pool).contains(&b), "{key} = {b} (chunk {chunk}, pool {pool})"),
        }
    }
    let chunks = (pool / chunk as u64) as u32;
    assert!(
        t.host_pool_share.chunks(chunks, chunk) >= t.session_pool_share.chunks(chunks, chunk),
        "host_pool_share {} below session_pool_share {}",
        t.host_pool_share,
        t.session_pool_share
    );
    let wait = t.chunk_wait_timeout;
    assert!((Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&wait), "chunk_wait_timeout = {wait:?}");

    let mut host_ids = HashSet::new();
    for (i, h) in c.hosts.iter().enumerate() {
        assert_eq!(h.index, i, "host index");
        assert!(!h.id.is_empty() && h.id.len() <= MAX_HOST_ID_LEN && !h.id.contains('\0'), "host[{i}].id {:?}", h.id);
        assert!(host_ids.insert(h.id.as_str()), "host id {:?} twice", h.id);
        assert!(h.key_file.as_ref().is_some_and(|k| !k.as_os_str().is_empty()) || h.nqn.is_some(), "host[{i}] with neither key file nor nqn");
    }

    assert!((1..=MAX_VOLUMES).contains(&c.volumes.len()), "{} volumes", c.volumes.len());
    assert_eq!(c.access.len(), c.volumes.len(), "one access entry per volume");
    for (v, a) in c.volumes.iter().zip(&c.access) {
        assert_eq!(a.volume, v.name, "access entries follow the volumes");
        for list in [&a.allowed_hosts, &a.read_only_hosts] {
            let unique: HashSet<_> = list.iter().collect();
            assert_eq!(unique.len(), list.len(), "volume {:?}: a host is granted twice: {list:?}", v.name);
            for id in list {
                assert!(host_ids.contains(id.as_str()), "volume {:?} grants {id:?}, which is no [[host]]", v.name);
            }
        }
    }
    let mut names = HashSet::new();
    let mut paths = HashSet::new();
    for (i, v) in c.volumes.iter().enumerate() {
        assert_eq!(v.index, i, "volume index");
        assert!(valid_name(&v.name), "volume[{i}].name {:?}", v.name);
        assert!(names.insert(&v.name), "volume name {:?} twice", v.name);
        match v.backend {
            BackendKind::File => {
                assert!(!v.path.as_os_str().is_empty(), "volume[{i}]: file backend without a path");
                assert!(paths.insert(&v.path), "volume path {:?} twice", v.path);
            }
            BackendKind::Memory | BackendKind::Null => {
                assert!(v.path.as_os_str().is_empty(), "volume[{i}]: {} backend with a path", v.backend);
                assert!(v.size.is_some(), "volume[{i}]: {} backend without a size", v.backend);
            }
            BackendKind::Rbd => {
                assert!(v.path.as_os_str().is_empty(), "volume[{i}]: rbd backend with a path");
                let r = v.rbd.as_ref().unwrap_or_else(|| panic!("volume[{i}]: rbd backend without its image"));
                for name in [&r.pool, &r.image, &r.client] {
                    assert!(!name.is_empty() && !name.contains(['/', '@', '\0']), "volume[{i}]: rbd name {name:?}");
                }
            }
        }
        assert_eq!(v.rbd.is_some(), v.backend == BackendKind::Rbd, "volume[{i}]: rbd keys on backend {}", v.backend);
        assert!(!(t.iopoll && v.backend == BackendKind::Memory), "volume[{i}]: memory backend on a polled ring");
        if let Some(bs) = v.block_size {
            assert!((512..=65536).contains(&bs) && bs.is_power_of_two(), "volume[{i}].block_size = {bs}");
        }
        if let Some(size) = v.size {
            assert_ne!(size, 0, "volume[{i}].size = 0");
            if let Some(bs) = v.block_size {
                assert_eq!(size % bs as u64, 0, "volume[{i}].size {size} is not a multiple of {bs}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds cover both outcomes: the valid ones reach the end of
    /// validation (so the invariants are checked on them), the others fail
    /// late.
    #[test]
    fn seeds_parse_as_named() {
        let valid = ["good.toml", "minimal.toml", "memory-and-null.toml", "limits.toml", "pool-share-bytes.toml", "pool-shares-and-wait.toml", "hosts.toml", "nvme-only.toml"];
        for seed in crate::seeds::all().into_iter().filter(|s| s.target == "config_parse") {
            let text = String::from_utf8(seed.bytes).expect("seeds are UTF-8");
            let parsed = Config::parse(&text, SOURCE);
            if valid.contains(&seed.name.as_str()) {
                check_invariants(&parsed.unwrap_or_else(|e| panic!("{}: {e}", seed.name)));
            } else {
                assert!(parsed.is_err(), "{} parses", seed.name);
            }
        }
    }
}
