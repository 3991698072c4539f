//! Versioned 4 KiB blocks for the reset tests: each names the round, the
//! command and the block that wrote it and where, and the rest of it
//! depends on all four, so a read-back tells an old association's write
//! that landed late, a torn block (a mix of two) and zeroes apart.

/// The size of a stamped block.
pub const STAMP_BLOCK: usize = 4096;
/// The stamp at the start of every block.
const MAGIC: &[u8; 8] = b"RSTBLK01";

/// Block `index` of command `cmd` of round `round`, written at `lba`: a
/// header naming all four, then filler that depends on them.
pub fn stamp(round: u32, cmd: u32, index: u32, lba: u64) -> Vec<u8> {
    let mut b = vec![0u8; STAMP_BLOCK];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&round.to_le_bytes());
    b[12..16].copy_from_slice(&cmd.to_le_bytes());
    b[16..20].copy_from_slice(&index.to_le_bytes());
    b[20..28].copy_from_slice(&lba.to_le_bytes());
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (round as u64) << 40 ^ (cmd as u64) << 20 ^ index as u64 ^ lba.rotate_left(29);
    for w in b[32..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    b
}

/// What a block holds, for a failure message.
pub fn describe(b: &[u8]) -> String {
    if b.iter().all(|&x| x == 0) {
        return "zeroes".into();
    }
    if &b[..8] != MAGIC {
        return format!("unknown bytes {:02x?}...", &b[..16]);
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let (round, cmd, index) = (u32_at(8), u32_at(12), u32_at(16));
    let lba = u64::from_le_bytes(b[20..28].try_into().unwrap());
    let whole = if b == stamp(round, cmd, index, lba).as_slice() { "" } else { ", NOT intact (a mix)" };
    format!("round {round} command {cmd} block {index} (written at LBA {lba}){whole}")
}
