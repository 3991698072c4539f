//! The served volumes as the rdmablk v1 wire names them: each one's id,
//! geometry, capabilities, the `VolumeInfo` that OPEN answers and LIST
//! writes, and who may use it. Published with every volume set.

use rdmablk_common::protocol::{VolumeId, VolumeInfo, VOLUME_FLAG_READ_ONLY};

use crate::auth::{AccessPolicy, Grant, Identity, VolumeGrants};

/// What the session code needs to know about a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeMeta {
    pub id: VolumeId,
    pub name: String,
    pub block_size: u32,
    /// Size in bytes.
    pub size: u64,
    pub read_only: bool,
    pub discard: bool,
    pub write_zeroes: bool,
    /// What OPEN replies and LIST writes.
    pub info: VolumeInfo,
    /// Who may use it (from the access policy published with the volume set).
    pub grants: VolumeGrants,
}

impl VolumeMeta {
    /// From an opened volume.
    pub fn of(v: &super::Volume) -> VolumeMeta {
        VolumeMeta {
            id: v.id,
            name: v.name.clone(),
            block_size: v.block_size,
            size: v.size,
            read_only: v.read_only,
            discard: v.supports_discard(),
            write_zeroes: v.supports_write_zeroes(),
            info: v.info(),
            grants: VolumeGrants::default(),
        }
    }

    /// What `who` may do with it.
    pub fn grant(&self, who: Identity<'_>, hosts_configured: bool) -> Option<Grant> {
        self.grants.grant(who, hosts_configured)
    }

    /// The `VolumeInfo` a holder of `grant` sees: read-only if either the
    /// volume or the grant is.
    pub fn info_for(&self, grant: Grant) -> VolumeInfo {
        let mut info = self.info.clone();
        if grant == Grant::ReadOnly {
            info.flags |= VOLUME_FLAG_READ_ONLY;
        }
        info
    }
}

/// The served volumes in list order, found by id in O(1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeTable {
    metas: Vec<VolumeMeta>,
    /// `by_id[id]` = index + 1, 0 for none.
    by_id: Vec<u32>,
    /// The access policy has `[[host]]` entries.
    hosts_configured: bool,
}

impl VolumeTable {
    /// A table of `metas` (ids must be distinct and non-zero).
    pub fn new(metas: Vec<VolumeMeta>) -> VolumeTable {
        let max = metas.iter().map(|m| m.id.0 as usize).max().unwrap_or(0);
        let mut by_id = vec![0u32; max + 1];
        for (i, m) in metas.iter().enumerate() {
            assert!(m.id.0 != 0 && by_id[m.id.0 as usize] == 0, "volume ids must be distinct and non-zero");
            by_id[m.id.0 as usize] = i as u32 + 1;
        }
        VolumeTable { metas, by_id, hosts_configured: false }
    }

    /// The same table with each volume's grants from `policy`.
    pub fn with_access(mut self, policy: &AccessPolicy) -> VolumeTable {
        for m in &mut self.metas {
            m.grants = policy.volume(&m.name);
        }
        self.hosts_configured = policy.hosts_configured();
        self
    }

    /// Whether the target has `[[host]]` entries.
    pub fn hosts_configured(&self) -> bool {
        self.hosts_configured
    }

    /// The volumes `who` may use, in list order, with the grant.
    pub fn visible_to<'a>(&'a self, who: Identity<'a>) -> impl Iterator<Item = (&'a VolumeMeta, Grant)> + 'a {
        self.metas.iter().filter_map(move |m| m.grant(who, self.hosts_configured).map(|g| (m, g)))
    }

    /// Index of volume `id`.
    #[inline]
    pub fn index_of(&self, id: VolumeId) -> Option<usize> {
        match self.by_id.get(id.0 as usize) {
            Some(&i) if i > 0 => Some(i as usize - 1),
            _ => None,
        }
    }

    /// The volume at `index`.
    #[inline]
    pub fn get(&self, index: usize) -> &VolumeMeta {
        &self.metas[index]
    }

    /// Every volume, in list order.
    pub fn metas(&self) -> &[VolumeMeta] {
        &self.metas
    }

    /// Number of volumes.
    pub fn len(&self) -> usize {
        self.metas.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }
}
