//! The gateways of one volume ([`Targets`]): one target URL, or several
//! rdmablk-target processes that export the same shared volume (an RBD
//! image), only one of which serves it at a time. A session connects to
//! the first that answers, in list order, and fails over to the others
//! (see [`Session`](crate::Session)).

use std::fmt;
use std::str::FromStr;

use rdmablk_common::fabric::{FabricError, FabricErrorKind, FabricUrl};

use crate::error::{Error, Result};

/// Most gateways one volume may list.
pub const MAX_GATEWAYS: usize = 16;

/// The URLs of a volume's gateways, in the order a session tries them: at
/// least one, at most [`MAX_GATEWAYS`], no URL twice, all of one scheme (the
/// session's registered memory belongs to one fabric).
///
/// Written as a comma-separated list, `tcp://10.0.0.1:7420,tcp://10.0.0.2:7420`;
/// one URL is a list of one, parsed exactly as [`FabricUrl::parse`] does.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Targets {
    urls: Vec<FabricUrl>,
}

impl Targets {
    /// Parses one URL, or a comma-separated list of them (spaces around
    /// the commas are allowed).
    pub fn parse(s: &str) -> Result<Targets> {
        if !s.contains(',') {
            let url = FabricUrl::parse(s).map_err(|e| Error::fabric("parsing the target URL", e))?;
            return Ok(Targets { urls: vec![url] });
        }
        let entries: Vec<&str> = s.split(',').map(str::trim).collect();
        Targets::check(&format!("parsing the target URL list {s:?}"), &entries)
    }

    /// The gateways given one by one (an attach file's TOML array).
    pub fn from_list<S: AsRef<str>>(list: &[S]) -> Result<Targets> {
        let entries: Vec<&str> = list.iter().map(|s| s.as_ref().trim()).collect();
        Targets::check(&format!("parsing the target URL list {entries:?}"), &entries)
    }

    /// The gateways as parsed URLs; checked as [`Targets::parse`] checks a list.
    pub fn new(urls: Vec<FabricUrl>) -> Result<Targets> {
        let text: Vec<String> = urls.iter().map(ToString::to_string).collect();
        let entries: Vec<&str> = text.iter().map(String::as_str).collect();
        Targets::check(&format!("checking the target URL list {entries:?}"), &entries)
    }

    /// A list of one.
    pub fn single(url: FabricUrl) -> Targets {
        Targets { urls: vec![url] }
    }

    fn check(context: &str, entries: &[&str]) -> Result<Targets> {
        let n = entries.len();
        let bad = |why: String| Error::fabric(context, FabricError::new(FabricErrorKind::InvalidUrl, why));
        if n == 0 {
            return Err(bad("the list is empty: give at least one tcp://HOST:PORT".into()));
        }
        if n > MAX_GATEWAYS {
            return Err(bad(format!("{n} gateways is more than the {MAX_GATEWAYS} a volume may have")));
        }
        let mut urls: Vec<FabricUrl> = Vec::with_capacity(n);
        for (i, entry) in entries.iter().enumerate() {
            let which = format!("gateway {} of {n}", i + 1);
            if entry.is_empty() {
                return Err(bad(format!("{which} is empty (a list is URL,URL,...: tcp://HOST:PORT,tcp://HOST:PORT)")));
            }
            let url = FabricUrl::parse(entry).map_err(|e| bad(format!("{which}: {}", e.context)))?;
            if let Some(first) = urls.first().filter(|f| f.provider != url.provider) {
                return Err(bad(format!(
                    "{which}, {url}, is not of the scheme of gateway 1, {first}: the gateways of a volume share one \
                     fabric (the session's registered memory), so all are tcp:// or all rdma://"
                )));
            }
            if let Some(j) = urls.iter().position(|u| *u == url) {
                return Err(bad(format!("{which}, {url}, is gateway {} again: list each gateway once", j + 1)));
            }
            urls.push(url);
        }
        Ok(Targets { urls })
    }

    /// The gateways, in the order they are tried.
    pub fn urls(&self) -> &[FabricUrl] {
        &self.urls
    }

    /// How many gateways there are (at least 1).
    #[allow(clippy::len_without_is_empty)] // never empty
    pub fn len(&self) -> usize {
        self.urls.len()
    }

    /// The first gateway (the only one of a single URL).
    pub fn first(&self) -> &FabricUrl {
        &self.urls[0]
    }

    /// Where `url` is in the list.
    pub fn position(&self, url: &FabricUrl) -> Option<usize> {
        self.urls.iter().position(|u| u == url)
    }
}

/// The order in which a session that lost gateway `failed` of `n` tries
/// them: the next ones in list order, wrapping around, and `failed` last
/// (after a round of the others; one gateway: itself).
pub(crate) fn rotation(n: usize, failed: usize) -> impl Iterator<Item = usize> {
    (1..=n).map(move |k| (failed + k) % n)
}

impl fmt::Display for Targets {
    /// The list as [`Targets::parse`] reads it: `tcp://a:1,tcp://b:2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, u) in self.urls.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{u}")?;
        }
        Ok(())
    }
}

impl FromStr for Targets {
    type Err = Error;
    fn from_str(s: &str) -> Result<Targets> {
        Targets::parse(s)
    }
}

/// Anything that names a volume's gateways: a URL or comma-separated list
/// of them (`&str`, `String`), a [`FabricUrl`], or [`Targets`].
pub trait IntoTargets {
    /// Parses or clones the list.
    fn into_targets(self) -> Result<Targets>;
}

impl IntoTargets for &str {
    fn into_targets(self) -> Result<Targets> {
        Targets::parse(self)
    }
}
impl IntoTargets for String {
    fn into_targets(self) -> Result<Targets> {
        Targets::parse(&self)
    }
}
impl IntoTargets for &String {
    fn into_targets(self) -> Result<Targets> {
        Targets::parse(self)
    }
}
impl IntoTargets for FabricUrl {
    fn into_targets(self) -> Result<Targets> {
        Ok(Targets::single(self))
    }
}
impl IntoTargets for &FabricUrl {
    fn into_targets(self) -> Result<Targets> {
        Ok(Targets::single(self.clone()))
    }
}
impl IntoTargets for Targets {
    fn into_targets(self) -> Result<Targets> {
        Ok(self)
    }
}
impl IntoTargets for &Targets {
    fn into_targets(self) -> Result<Targets> {
        Ok(self.clone())
    }
}
impl IntoTargets for Vec<FabricUrl> {
    fn into_targets(self) -> Result<Targets> {
        Targets::new(self)
    }
}
impl IntoTargets for &[FabricUrl] {
    fn into_targets(self) -> Result<Targets> {
        Targets::new(self.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmablk_common::fabric::ProviderKind;

    fn err(s: &str) -> String {
        let e = Targets::parse(s).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Fabric, "{s}: {e}");
        e.to_string()
    }

    #[test]
    fn one_url_parses_as_before() {
        let t = Targets::parse("tcp://127.0.0.1:7420").unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.first(), &FabricUrl::parse("tcp://127.0.0.1:7420").unwrap());
        assert_eq!(t.to_string(), "tcp://127.0.0.1:7420");
        // The single URL's error is the one Session::connect always gave.
        let e = err("udp://x:1");
        assert!(e.starts_with("parsing the target URL: "), "{e}");
        assert!(e.contains("unknown scheme"), "{e}");
        let e = err("");
        assert!(e.contains("expected scheme://host:port"), "{e}");
    }

    #[test]
    fn a_list_parses_in_order() {
        let t = Targets::parse("tcp://a:1,tcp://b:2, tcp://[::1]:3").unwrap();
        let hosts: Vec<(&str, u16)> = t.urls().iter().map(|u| (u.host.as_str(), u.port)).collect();
        assert_eq!(hosts, [("a", 1), ("b", 2), ("::1", 3)]);
        assert!(t.urls().iter().all(|u| u.provider == ProviderKind::Tcp));
        assert_eq!(t.to_string(), "tcp://a:1,tcp://b:2,tcp://[::1]:3");
        assert_eq!(Targets::parse(&t.to_string()).unwrap(), t, "Display round-trips");
        assert_eq!(t.position(&FabricUrl::parse("tcp://b:2").unwrap()), Some(1));
        assert_eq!(Targets::parse("rdma://a:1,rdma://b:1").unwrap().len(), 2);
        let from_toml = Targets::from_list(&["tcp://a:1", "tcp://b:2", "tcp://[::1]:3"]).unwrap();
        assert_eq!(from_toml, t);
        assert_eq!(Targets::new(t.urls().to_vec()).unwrap(), t);
    }

    #[test]
    fn bad_lists_say_which_gateway_and_why() {
        let e = err("tcp://a:1,,tcp://b:2");
        assert!(e.contains("\"tcp://a:1,,tcp://b:2\"") && e.contains("gateway 2 of 3 is empty"), "{e}");
        let e = err("tcp://a:1,");
        assert!(e.contains("gateway 2 of 2 is empty"), "{e}");
        let e = err(",");
        assert!(e.contains("gateway 1 of 2 is empty"), "{e}");
        let e = err("tcp://a:1,garbage");
        assert!(e.contains("gateway 2 of 2: \"garbage\": expected scheme://host:port"), "{e}");
        let e = err("tcp://a:1,udp://b:2");
        assert!(e.contains("gateway 2 of 2: \"udp://b:2\": unknown scheme"), "{e}");
        let e = err("tcp://a:1,tcp://b");
        assert!(e.contains("gateway 2 of 2: \"tcp://b\": missing :port"), "{e}");
        let e = err("tcp://a:1,rdma://b:2");
        assert!(e.contains("gateway 2 of 2, rdma://b:2, is not of the scheme of gateway 1, tcp://a:1"), "{e}");
        let e = err("tcp://a:1,tcp://b:2,tcp://a:1");
        assert!(e.contains("gateway 3 of 3, tcp://a:1, is gateway 1 again"), "{e}");
        let many: Vec<String> = (1..=MAX_GATEWAYS + 1).map(|p| format!("tcp://h:{p}")).collect();
        let e = err(&many.join(","));
        assert!(e.contains("17 gateways is more than the 16"), "{e}");
        let e = Targets::from_list::<&str>(&[]).unwrap_err().to_string();
        assert!(e.contains("the list is empty"), "{e}");
        let e = Targets::from_list(&["tcp://a:1", ""]).unwrap_err().to_string();
        assert!(e.contains("gateway 2 of 2 is empty"), "{e}");
    }

    #[test]
    fn the_rotation_starts_after_the_lost_gateway_and_ends_with_it() {
        assert_eq!(rotation(1, 0).collect::<Vec<_>>(), [0], "one gateway: itself");
        assert_eq!(rotation(2, 0).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(rotation(2, 1).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(rotation(3, 0).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(rotation(3, 1).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(rotation(3, 2).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn every_kind_of_argument_names_targets() {
        let u = FabricUrl::parse("tcp://a:1").unwrap();
        assert_eq!("tcp://a:1,tcp://b:2".into_targets().unwrap().len(), 2);
        assert_eq!(String::from("tcp://a:1").into_targets().unwrap().len(), 1);
        assert_eq!((&u).into_targets().unwrap().first(), &u);
        assert_eq!(vec![u.clone(), u.clone()].into_targets().unwrap_err().kind(), crate::ErrorKind::Fabric);
        let t: Targets = "tcp://a:1,tcp://b:2".parse().unwrap();
        assert_eq!((&t).into_targets().unwrap(), t);
    }
}
