//! The embedded target: without `--target`, rdmablk-bench starts an
//! rdmablk target in its own process, on loopback, serving one volume per
//! distinct `--filename` (file backend) or `--backend=null|memory`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rdmablk_target::{Config, RunningTarget, Target};

use crate::options::{Backend, JobOptions, SizeSpec};
use crate::units::bytes_binary;

/// Whether a thread of this process (by its name) belongs to the embedded
/// target: its reactors `rdmablk-rN`, its control thread `rdmablk-ctl` and
/// whatever they start, but not the initiator's `rdmablk-monitor` nor the
/// main thread `rdmablk-bench`.
pub fn is_target_thread(name: &str) -> bool {
    name.starts_with("rdmablk-") && !name.starts_with("rdmablk-monitor") && !name.starts_with("rdmablk-bench")
}

/// Size of a `null` or `memory` volume when no job gives `--size`.
pub const DEFAULT_RAM_VOLUME_SIZE: u64 = 1 << 30;

/// A volume the embedded target serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddedVolume {
    pub name: String,
    pub backend: Backend,
    pub path: Option<PathBuf>,
    pub size: u64,
}

/// What volume each job without `--target` uses.
#[derive(Debug, Default)]
pub struct Layout {
    pub volumes: Vec<EmbeddedVolume>,
    /// For job `i` (by position in the list given to [`layout`]): the index
    /// of its volume, or `None` for jobs with `--target`.
    pub job_volume: Vec<Option<usize>>,
}

/// Bytes a job needs from the start of its volume, if it says (offset and
/// size in bytes).
fn bytes_needed(o: &JobOptions) -> Option<u64> {
    let SizeSpec::Bytes(size) = o.size? else { return None };
    let offset = match o.offset {
        SizeSpec::Bytes(b) => b,
        SizeSpec::Percent(_) => return None,
    };
    let clones = u64::from(o.numjobs.saturating_sub(1)) * o.offset_increment;
    Some(offset + clones + size)
}

fn toml_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Works out the embedded volumes of `jobs`.
pub fn layout(jobs: &[JobOptions]) -> Result<Layout, String> {
    let mut keys: BTreeMap<(u8, String), usize> = BTreeMap::new();
    let mut out = Layout::default();
    for o in jobs {
        if o.target.is_some() {
            out.job_volume.push(None);
            continue;
        }
        let backend = o.embedded_backend();
        let path = match backend {
            Backend::File => {
                let name = o.filename.clone().unwrap_or_else(|| format!("{}.0.0", o.name));
                Some(std::path::absolute(&name).map_err(|e| format!("{name}: {e}"))?)
            }
            _ => None,
        };
        let key = (backend as u8, path.as_ref().map(|p| p.display().to_string()).unwrap_or_default());
        let index = *keys.entry(key).or_insert_with(|| {
            out.volumes.push(EmbeddedVolume { name: format!("vol{}", out.volumes.len()), backend, path, size: 0 });
            out.volumes.len() - 1
        });
        let v = &mut out.volumes[index];
        if let Some(n) = bytes_needed(o) {
            v.size = v.size.max(n);
        }
        out.job_volume.push(Some(index));
    }
    for v in &mut out.volumes {
        let existing = v.path.as_ref().and_then(|p| std::fs::metadata(p).ok()).map(|m| m.len());
        match (existing, v.backend) {
            (Some(len), Backend::File) => v.size = v.size.max(len),
            (None, Backend::File) if v.size == 0 => {
                return Err(format!(
                    "{}: the file does not exist; give --size to create it",
                    v.path.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
                ))
            }
            (_, Backend::Null | Backend::Memory) if v.size == 0 => v.size = DEFAULT_RAM_VOLUME_SIZE,
            _ => {}
        }
        v.size = v.size.next_multiple_of(4096);
    }
    Ok(out)
}

/// Settings of the embedded target that depend on the jobs.
#[derive(Clone, Copy, Debug)]
pub struct TargetShape {
    pub reactors: Option<usize>,
    pub max_iodepth: u32,
    pub max_bs: u64,
}

/// The target's TOML configuration.
pub fn config_text(volumes: &[EmbeddedVolume], shape: TargetShape) -> String {
    let mut s = String::from("[target]\nname = \"rdmablk-bench\"\nlisten = [\"tcp://127.0.0.1:0\"]\n");
    if let Some(r) = shape.reactors {
        s.push_str(&format!("reactors = {r}\n"));
    }
    let depth = (shape.max_iodepth + 1).clamp(128, 4096);
    let max_io = shape.max_bs.max(1 << 20).next_multiple_of(4096);
    s.push_str(&format!("queue_depth = {depth}\nmax_io_size = {max_io}\nshutdown_timeout = \"5s\"\n"));
    for v in volumes {
        s.push_str(&format!(
            "\n[[volume]]\nname = {}\nbackend = {}\nsize = {}\nallow_any_host = true\n",
            toml_str(&v.name),
            toml_str(v.backend.name()),
            v.size
        ));
        if let Some(p) = &v.path {
            s.push_str(&format!("path = {}\n", toml_str(&p.display().to_string())));
        }
    }
    s
}

/// Starts the target.
pub fn start(volumes: &[EmbeddedVolume], shape: TargetShape) -> Result<RunningTarget, String> {
    let text = config_text(volumes, shape);
    let config = Config::parse(&text, "embedded target").map_err(|e| format!("embedded target: {e}"))?;
    Target::start(config).map_err(|e| format!("embedded target: {e}"))
}

/// One line per volume, for the report header.
pub fn describe(v: &EmbeddedVolume) -> String {
    match &v.path {
        Some(p) => format!("{} = {} {} ({})", v.name, v.backend.name(), p.display(), bytes_binary(v.size as f64)),
        None => format!("{} = {} ({})", v.name, v.backend.name(), bytes_binary(v.size as f64)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str, f: impl FnOnce(&mut JobOptions)) -> JobOptions {
        let mut o = JobOptions::new(name);
        f(&mut o);
        o
    }

    #[test]
    fn one_volume_per_file_or_backend() {
        let jobs = vec![
            job("a", |o| {
                o.filename = Some("/nonexistent-dir-x/a.img".into());
                o.size = Some(SizeSpec::Bytes(1 << 20));
            }),
            job("b", |o| {
                o.filename = Some("/nonexistent-dir-x/a.img".into());
                o.size = Some(SizeSpec::Bytes(4 << 20));
            }),
            job("c", |o| {
                o.backend = Some(Backend::Null);
                o.size = Some(SizeSpec::Bytes(1 << 30));
            }),
            job("d", |o| {
                o.target = Some("tcp://127.0.0.1:1".into());
                o.volume = Some("x".into());
            }),
        ];
        let l = layout(&jobs).unwrap();
        assert_eq!(l.volumes.len(), 2);
        assert_eq!(l.volumes[0].size, 4 << 20);
        assert_eq!(l.volumes[1].backend, Backend::Null);
        assert_eq!(l.job_volume, vec![Some(0), Some(0), Some(1), None]);
        let text = config_text(&l.volumes, TargetShape { reactors: Some(1), max_iodepth: 32, max_bs: 4096 });
        let c = Config::parse(&text, "t").unwrap();
        assert_eq!(c.volumes.len(), 2);
        assert_eq!(c.target.reactors, 1);
    }

    #[test]
    fn sizes_are_required_to_create_files() {
        let e = layout(&[job("a", |o| o.filename = Some("/nonexistent-dir-x/b.img".into()))]).unwrap_err();
        assert!(e.contains("--size"), "{e}");
        let l = layout(&[job("a", |o| o.backend = Some(Backend::Null))]).unwrap();
        assert_eq!(l.volumes[0].size, DEFAULT_RAM_VOLUME_SIZE);
    }
}
