//! Laying out the embedded target's files before jobs read them, as fio
//! does ("Laying out IO file").
//!
//! A read of a hole (a range of a sparse file that was never written, or
//! one that `fallocate` reserved without writing) costs the file system no
//! disk access: it returns zeros from memory, and a benchmark that reads
//! holes measures that, not the disk. So before the embedded target starts,
//! every regular file that a job will read from is checked for holes
//! (`SEEK_HOLE`/`SEEK_DATA`, which report unwritten extents as holes too),
//! and the holes, and the part of the file beyond its end, up to the
//! volume's size, are written with non-zero data. Data already in the file
//! is left alone.
//!
//! fio lays out only missing or short files (and does it by deleting and
//! rewriting them); rdmablk-bench also fills holes of a file of the right
//! size, and never deletes anything.
//!
//! Not laid out:
//! - files that only write jobs use: writes allocate what they write (fio
//!   does not lay those out either);
//! - files that `verify_only` jobs read: laying out would write over what
//!   they are to check (their reads of holes fail the check anyway);
//! - block devices and other non-regular files: they have no holes;
//! - volumes of a remote target (`--target`): the bench cannot see the file
//!   behind them; lay those out on the target's host (for example with
//!   `rdmablk-bench --rw=write` over the whole volume first).

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;

use rustix::fs::SeekFrom;

use crate::embedded::{EmbeddedVolume, Layout};
use crate::job::Rng;
use crate::options::{Backend, JobOptions};

/// Bytes written per call while laying out.
const CHUNK: usize = 1 << 20;

/// Ranges of `file` in `0..size` that hold no data: its holes (unwritten
/// extents included) and whatever lies between its end and `size`.
pub fn holes(file: &File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let len = file.metadata()?.len();
    let mut out = Vec::new();
    let mut pos = 0u64;
    let end = len.min(size);
    while pos < end {
        let data = match rustix::fs::seek(file, SeekFrom::Data(pos)) {
            Ok(d) => d.min(end),
            // No data at or after pos: the rest of the file is a hole.
            Err(rustix::io::Errno::NXIO) => end,
            Err(e) => return Err(e.into()),
        };
        if data > pos {
            out.push((pos, data));
        }
        if data >= end {
            break;
        }
        let hole = rustix::fs::seek(file, SeekFrom::Hole(data)).map_err(std::io::Error::from)?;
        pos = hole.min(end);
    }
    if len < size {
        match out.last_mut() {
            Some(last) if last.1 == len => last.1 = size,
            _ => out.push((len, size)),
        }
    }
    Ok(out)
}

/// Writes non-zero data over `ranges` of `file` and makes it durable.
/// Returns the bytes written.
fn fill(file: &File, ranges: &[(u64, u64)]) -> std::io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut rng = Rng::new(0x1a7d_0f11);
    rng.fill(&mut buf);
    let mut written = 0;
    for &(start, end) in ranges {
        let mut at = start;
        while at < end {
            let n = (end - at).min(CHUNK as u64) as usize;
            file.write_all_at(&buf[..n], at)?;
            at += n as u64;
            written += n as u64;
        }
    }
    file.sync_all()?;
    Ok(written)
}

/// Lays out volume `v` if it is a regular file (or does not exist yet)
/// with holes in `0..v.size`; `job` names the job in fio's message.
/// Returns whether anything was written.
pub fn lay_out(v: &EmbeddedVolume, job: &str) -> Result<bool, String> {
    let Some(path) = &v.path else { return Ok(false) };
    let shown = path.display();
    let exists = match std::fs::metadata(path) {
        Ok(m) if !m.file_type().is_file() => {
            // A block device (or a character device, a FIFO): no holes to fill.
            return Ok(false);
        }
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::NotFound => false,
        Err(e) => return Err(format!("{shown}: {e}")),
    };
    let ranges = if exists {
        // Looked at read-only: a file without holes needs no write access here.
        let file = File::open(path).map_err(|e| format!("{shown}: cannot open the file to look for holes: {e}"))?;
        holes(&file, v.size).map_err(|e| format!("{shown}: cannot find the file's holes: {e}"))?
    } else {
        vec![(0, v.size)]
    };
    if ranges.is_empty() {
        return Ok(false);
    }
    let file = OpenOptions::new().write(true).create(true).truncate(false).open(path).map_err(|e| {
        format!("{shown}: cannot open the file to lay it out (write its holes) before jobs read it: {e}")
    })?;
    // fio's line (fio prints it on standard output; here standard output
    // may be the JSON document).
    eprintln!("{job}: Laying out IO file (1 file / {}MiB)", v.size >> 20);
    fill(&file, &ranges).map_err(|e| {
        format!(
            "{shown}: laying out the file before reading it failed: {e}; the file keeps what it held, plus \
             whatever was written before the error (free space and run again, or give a smaller --size)"
        )
    })?;
    Ok(true)
}

/// Lays out the files of `layout` that jobs will read (see the module
/// documentation for which).
pub fn prepare(layout: &Layout, jobs: &[JobOptions]) -> Result<(), String> {
    for (index, v) in layout.volumes.iter().enumerate() {
        if v.backend != Backend::File {
            continue;
        }
        let users = || jobs.iter().zip(&layout.job_volume).filter(move |(_, jv)| **jv == Some(index)).map(|(j, _)| j);
        if users().any(|j| j.verify_only) {
            continue;
        }
        if let Some(reader) = users().find(|j| j.rw.reads()) {
            lay_out(v, &reader.name)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn vol(path: &Path, size: u64) -> EmbeddedVolume {
        EmbeddedVolume { name: "vol0".into(), backend: Backend::File, path: Some(path.to_owned()), size }
    }

    #[test]
    fn holes_are_found_and_filled_and_data_is_kept() {
        // Sparse files and SEEK_HOLE work alike on tmpfs and disk file systems.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse.img");
        let f = File::create(&path).unwrap();
        f.set_len(8 << 20).unwrap();
        let mark = vec![0x5au8; 1 << 20];
        f.write_all_at(&mark, 2 << 20).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let h = holes(&f, 12 << 20).unwrap();
        assert_eq!(h, [(0, 2 << 20), (3 << 20, 12 << 20)], "the holes around the data, and beyond the end");

        assert!(lay_out(&vol(&path, 12 << 20), "j").unwrap());
        let f = File::open(&path).unwrap();
        let m = f.metadata().unwrap();
        assert_eq!(m.len(), 12 << 20);
        assert!(holes(&f, 12 << 20).unwrap().is_empty());
        use std::os::unix::fs::MetadataExt;
        assert!(m.blocks() * 512 >= 12 << 20, "{} blocks allocated", m.blocks());
        let mut back = vec![0u8; 1 << 20];
        f.read_exact_at(&mut back, 2 << 20).unwrap();
        assert!(back == mark, "the data that was there is kept");
        f.read_exact_at(&mut back, 0).unwrap();
        assert!(back.iter().filter(|&&b| b == 0).count() < 1 << 14, "laid out with non-zero data");
        // Nothing more to do the second time.
        assert!(!lay_out(&vol(&path, 12 << 20), "j").unwrap());
        // A missing file is created and laid out.
        let new = dir.path().join("new.img");
        assert!(lay_out(&vol(&new, 1 << 20), "j").unwrap());
        assert_eq!(std::fs::metadata(&new).unwrap().len(), 1 << 20);
    }
}
