//! Fabric URLs: `tcp://host:port` and `rdma://host:port`.

use std::fmt;
use std::str::FromStr;

use super::{FabricError, FabricErrorKind};

/// Which provider a URL selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    /// One-sided semantics over a TCP stream.
    Tcp,
    /// Real RDMA through libibverbs and librdmacm.
    Rdma,
}

/// A parsed fabric address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FabricUrl {
    pub provider: ProviderKind,
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
}

impl FabricUrl {
    /// Parses `scheme://host:port`; IPv6 hosts are written in brackets.
    pub fn parse(s: &str) -> Result<Self, FabricError> {
        let bad = |why: &str| FabricError::new(FabricErrorKind::InvalidUrl, format!("{s:?}: {why}"));
        let (scheme, rest) = s.split_once("://").ok_or_else(|| bad("expected scheme://host:port"))?;
        let provider = match scheme {
            "tcp" => ProviderKind::Tcp,
            "rdma" => ProviderKind::Rdma,
            _ => return Err(bad("unknown scheme (use tcp:// or rdma://)")),
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = if let Some(after) = rest.strip_prefix('[') {
            let (h, p) = after.split_once("]:").ok_or_else(|| bad("expected [ipv6]:port"))?;
            (h, p)
        } else {
            rest.rsplit_once(':').ok_or_else(|| bad("missing :port"))?
        };
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        let port = port.parse::<u16>().map_err(|_| bad("port is not a number in 0..=65535"))?;
        Ok(FabricUrl { provider, host: host.to_owned(), port })
    }

    /// `host:port` in the form `ToSocketAddrs` accepts.
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for FabricUrl {
    type Err = FabricError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FabricUrl::parse(s)
    }
}

impl fmt::Display for FabricUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.provider {
            ProviderKind::Tcp => "tcp",
            ProviderKind::Rdma => "rdma",
        };
        write!(f, "{scheme}://{}", self.host_port())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let u = FabricUrl::parse("tcp://127.0.0.1:7420").unwrap();
        assert_eq!((u.provider, u.host.as_str(), u.port), (ProviderKind::Tcp, "127.0.0.1", 7420));
        assert_eq!(u.to_string(), "tcp://127.0.0.1:7420");
        let v = FabricUrl::parse("rdma://[::1]:4420").unwrap();
        assert_eq!((v.provider, v.host.as_str(), v.port), (ProviderKind::Rdma, "::1", 4420));
        assert_eq!(v.to_string(), "rdma://[::1]:4420");
    }

    #[cfg(not(feature = "verbs"))]
    #[test]
    fn rdma_without_the_verbs_feature_names_it() {
        let e = crate::fabric::Fabric::open(&FabricUrl::parse("rdma://127.0.0.1:4420").unwrap()).err().unwrap();
        assert_eq!(e.kind, FabricErrorKind::ProviderUnavailable);
        assert!(e.to_string().contains("`verbs` feature"), "{e}");
    }

    #[test]
    fn rejects_bad_urls() {
        for s in ["", "tcp:/x:1", "udp://h:1", "tcp://h", "tcp://:1", "tcp://h:99999", "tcp://h:x"] {
            let e = FabricUrl::parse(s).unwrap_err();
            assert_eq!(e.kind, FabricErrorKind::InvalidUrl, "{s}");
        }
    }
}
