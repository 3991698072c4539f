//! The store behind a test volume: a sparse file, or an image of the dev
//! Ceph cluster (`backend = "rbd"`, issue 54). The data-path, crash and
//! hostile suites run once on each, so that an RBD volume is held to what a
//! file volume is: same commands, same checks of what the store holds.

use std::path::{Path, PathBuf};

use crate::ceph::cluster;

/// Which store a suite runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingKind {
    File,
    Rbd,
}

/// One volume's store; an rbd image is removed when this is dropped, if no
/// gateway has it open any more.
#[derive(Debug)]
pub enum Backing {
    File { path: PathBuf },
    Rbd { image: String },
}

impl Backing {
    /// A store of `size` bytes, all zeroes: a sparse file `name` in `dir`,
    /// or a new image of the dev cluster named after `name`.
    pub fn new(kind: BackingKind, dir: &Path, name: &str, size: u64) -> Backing {
        match kind {
            BackingKind::File => Backing::File { path: crate::sparse_file(dir, name, size) },
            BackingKind::Rbd => {
                let c = cluster();
                let image = c.unique_name(&name.replace(['.', '_'], "-"));
                c.create_image(&image, size);
                Backing::Rbd { image }
            }
        }
    }

    pub fn kind(&self) -> BackingKind {
        match self {
            Backing::File { .. } => BackingKind::File,
            Backing::Rbd { .. } => BackingKind::Rbd,
        }
    }

    /// The `[[volume]]` block exporting this store as `name` to any host.
    /// An rbd volume locks its image at start: the only gateway is its
    /// owner, as a file volume's target is (a crash test's restarted
    /// target breaks the lock its killed predecessor left behind).
    pub fn volume(&self, name: &str, size: u64, read_only: bool) -> String {
        match self {
            Backing::File { path } => crate::file_volume(name, path, size, read_only),
            Backing::Rbd { image } => format!(
                "{}size = {size}\nread_only = {read_only}\nallow_any_host = true\n",
                cluster().volume_block(name, image, true)
            ),
        }
    }

    /// [`Backing::volume`] with its hosts' access given by `access` (lines
    /// such as `allowed_hosts = ["alpha"]`, or nothing: no host may open it)
    /// instead of `allow_any_host = true`.
    pub fn volume_with_access(&self, name: &str, size: u64, read_only: bool, access: &str) -> String {
        let block = self.volume(name, size, read_only);
        let head = block.strip_suffix("allow_any_host = true\n").expect("a [[volume]] block ends with its access line");
        format!("{head}{access}\n")
    }

    /// Everything the store holds now, as another reader of it sees it: the
    /// file's bytes, or the image read by `rbd export`.
    pub fn contents(&self) -> Vec<u8> {
        match self {
            Backing::File { path } => std::fs::read(path).expect("read the backing file"),
            Backing::Rbd { image } => {
                let dir = tempfile::tempdir().expect("tempdir");
                let file = dir.path().join("export");
                cluster().export_image(image, &file);
                std::fs::read(&file).expect("read the exported image")
            }
        }
    }

    /// `len` bytes at `offset` of what the store holds now, as
    /// [`Backing::contents`] sees it (an rbd image is exported whole).
    pub fn bytes_at(&self, offset: u64, len: usize) -> Vec<u8> {
        match self {
            Backing::File { path } => crate::file_bytes(path, offset, len),
            Backing::Rbd { image } => rbd_bytes_at(image, offset, len),
        }
    }

    /// Writes `bytes` at `offset` of the store, behind the target's back
    /// (as the test's own setup, before a target opens it).
    pub fn write_at(&self, bytes: &[u8], offset: u64) {
        match self {
            Backing::File { path } => {
                use std::os::unix::fs::FileExt;
                let f = std::fs::OpenOptions::new().write(true).open(path).expect("open the backing file");
                f.write_all_at(bytes, offset).expect("write the backing file");
            }
            Backing::Rbd { image } => {
                // `rbd import` wants a whole image: export, patch, and
                // replace (the image is small and closed at this point).
                let mut all = self.contents();
                all[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes);
                let dir = tempfile::tempdir().expect("tempdir");
                let file = dir.path().join("patched");
                std::fs::write(&file, &all).expect("write the patched image file");
                let c = cluster();
                c.remove_image(image);
                c.import_image(&file, image);
            }
        }
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Backing::Rbd { image } = self {
            // Best effort: a killed gateway's watch keeps the image busy
            // for Ceph's watch timeout (30 s); the dev cluster's memstore
            // forgets whatever is left when it stops.
            let c = cluster();
            let _ = c.rbd(&["rm", "--no-progress", &c.spec(image)]);
        }
    }
}

/// Image `image`'s object name prefix and object size, from `rbd info`
/// once per image (neither changes in an image's life).
fn rbd_layout(image: &str) -> (String, u64) {
    static LAYOUTS: std::sync::Mutex<Vec<(String, String, u64)>> = std::sync::Mutex::new(Vec::new());
    let mut known = LAYOUTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, prefix, size)) = known.iter().find(|(name, _, _)| name == image) {
        return (prefix.clone(), *size);
    }
    let fields = cluster().image_info(image, &["block_name_prefix", "object_size"]);
    let prefix = fields[0].clone();
    let object_size: u64 = fields[1].parse().unwrap_or_else(|_| panic!("rbd info {image}: object_size {:?} is no number", fields[1]));
    known.push((image.to_string(), prefix.clone(), object_size));
    (prefix, object_size)
}

/// A range of image `image` as the OSDs hold it, read object by object
/// with `rados get` (an image of 64 MiB exports in about 0.3 s; the one or
/// two 4 MiB objects of a range read in a few ms). An object that does not
/// exist was never written (zeroes), and one shorter than the object size
/// ends in zeroes.
fn rbd_bytes_at(image: &str, offset: u64, len: usize) -> Vec<u8> {
    let c = cluster();
    let (prefix, object_size) = rbd_layout(image);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut out = vec![0u8; len];
    let end = offset + len as u64;
    let mut pos = offset;
    while pos < end {
        let (objno, within) = (pos / object_size, pos % object_size);
        let take = (object_size - within).min(end - pos) as usize;
        let file = dir.path().join(format!("{objno}"));
        let name = format!("{prefix}.{objno:016x}");
        let got = c.rados(&["-p", c.pool, "get", &name, file.to_str().expect("utf-8 path")]);
        if got.status.success() {
            let object = std::fs::read(&file).expect("read the object's file");
            let have = object.len().saturating_sub(within as usize).min(take);
            let at = (pos - offset) as usize;
            if have > 0 {
                out[at..at + have].copy_from_slice(&object[within as usize..within as usize + have]);
            }
        } else {
            let err = String::from_utf8_lossy(&got.stderr);
            assert!(err.contains("(2) No such file or directory"), "rados get {name} failed ({}): {err}", got.status);
        }
        pos += take as u64;
    }
    out
}
