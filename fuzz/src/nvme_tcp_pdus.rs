//! `nvme_tcp_pdus`: an NVMe/TCP PDU stream as a controller (or a host)
//! reads it, through `rdmablk_common::nvme::tcp`.
//!
//! # Input
//!
//! Byte 0 is a control byte, the rest is the stream:
//!
//! | bits | meaning |
//! |---|---|
//! | 0 | the connection is initialized (else only ICReq/ICResp are valid) |
//! | 1 | header digests negotiated |
//! | 2 | data digests negotiated |
//!
//! The stream is walked PDU by PDU as a receiver would: common header,
//! [`CommonHeader::layout`] (with a 64 KiB + 128 PLEN limit), the header
//! and its digest, [`Pdu::decode`]. The walk stops at the first PDU that
//! is refused or incomplete, as a receiver would end the connection.
//!
//! What must hold for every PDU that decodes: the layout lies within PLEN
//! and after the header; encoding the decoded PDU with the same digests,
//! data length and data offset gives exactly the header bytes it came
//! from (every header byte is a field, a digest, or a reserved byte decode
//! checked to be zero; in a CapsuleResp the status bits the codec does not
//! keep, phase, CRD and More, are masked); and a submission entry inside
//! a CapsuleCmd re-encodes byte for byte.

use rdmablk_common::nvme::sqe::SubmissionEntry;
use rdmablk_common::nvme::tcp::{digest, CommonHeader, Digests, Pdu, PduType, CH_SIZE, MAX_HEADER};

/// Most a PDU may be in this harness (a receiver's MAXH2CDATA and header).
pub const MAX_PLEN: u32 = (64 << 10) + 128;

pub fn run(data: &[u8]) {
    walk(data);
}

/// The harness; returns how many PDUs were accepted before the stream
/// ended or one was refused.
pub fn walk(data: &[u8]) -> usize {
    let mut accepted = 0;
    let Some((&control, mut stream)) = data.split_first() else { return accepted };
    let digests = Digests { header: control & 0x02 != 0, data: control & 0x04 != 0 };
    let mut negotiated = (control & 0x01 != 0).then_some(digests);
    while stream.len() >= CH_SIZE {
        let Ok(ch) = CommonHeader::decode(stream) else { return accepted };
        let layout = match ch.layout(negotiated, MAX_PLEN) {
            Ok(l) => l,
            Err(e) => {
                let _ = e.to_string();
                return accepted;
            }
        };
        assert!(layout.plen as u64 == ch.plen as u64 && layout.plen <= MAX_PLEN as usize);
        assert!(layout.header_with_digest >= layout.hlen && layout.header_with_digest <= layout.plen);
        if layout.data_len > 0 {
            assert!(layout.data_offset >= layout.header_with_digest, "{layout:?}");
            let end = layout.data_offset + layout.data_len + if layout.data_digest { 4 } else { 0 };
            assert_eq!(end, layout.plen, "{layout:?}");
        }
        if stream.len() < layout.plen {
            return accepted;
        }
        let pdu_bytes = &stream[..layout.plen];
        let pdu = match Pdu::decode(&ch, &layout, pdu_bytes) {
            Ok(p) => p,
            Err(e) => {
                let _ = e.to_string();
                return accepted;
            }
        };
        assert_eq!(pdu.pdu_type(), ch.pdu_type);
        let mut header = [0u8; MAX_HEADER];
        let align = if layout.data_len > 0 { layout.data_offset } else { 0 };
        let wire_digests = negotiated.unwrap_or_default();
        let (at, plen) = pdu.encode(wire_digests, layout.data_len as u32, align, &mut header);
        assert_eq!((at, plen as usize), (if layout.data_len > 0 { layout.data_offset } else { layout.header_with_digest }, layout.plen), "{pdu:?}");
        let mut want = pdu_bytes[..layout.header_with_digest].to_vec();
        let mut got = header[..layout.header_with_digest].to_vec();
        if ch.pdu_type == PduType::CapsuleResp {
            // Status word, bytes 22..24 of the PDU: phase (bit 0), CRD
            // (12:11 of the status field, so 13:12 here) and More.
            for v in [&mut want, &mut got] {
                v[22] &= !0x01;
                v[23] &= !0x70;
            }
            if layout.header_with_digest > layout.hlen {
                // The digest covers the bits masked above: compare it only
                // when they were clear.
                if want[..layout.hlen] != pdu_bytes[..layout.hlen] {
                    want.truncate(layout.hlen);
                    got.truncate(layout.hlen);
                }
            }
        }
        assert_eq!(got, want, "encode(decode(pdu)) differs for {pdu:?}");
        if let Pdu::CapsuleCmd(sqe) = &pdu {
            assert_eq!(SubmissionEntry::decode_unchecked(&sqe.to_bytes()).as_ref(), Ok(sqe));
            let _ = sqe.validate().map_err(|e| e.to_string());
            let _ = sqe.sgl().map_err(|e| e.to_string());
        }
        if layout.data_digest {
            let data = &pdu_bytes[layout.data_offset..layout.data_offset + layout.data_len];
            let _ = digest(data) == u32::from_le_bytes(pdu_bytes[layout.plen - 4..].try_into().expect("4 bytes"));
        }
        match pdu {
            Pdu::IcReq(r) if negotiated.is_none() => negotiated = Some(r.digests),
            Pdu::IcResp(r) if negotiated.is_none() => negotiated = Some(r.digests),
            _ => {}
        }
        stream = &stream[layout.plen..];
        accepted += 1;
    }
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_seed_walks_to_its_end() {
        let seeds = crate::seeds::all();
        let mut walked = 0;
        for seed in seeds.iter().filter(|s| s.target == "nvme_tcp_pdus") {
            let want = match seed.name.as_str() {
                "icreq-connect" | "icresp-connected" => 2,
                "io-digests" => 8,
                "c2h-termreq" => 1,
                other => panic!("unexpected seed {other}"),
            };
            assert_eq!(walk(&seed.bytes), want, "{}", seed.name);
            walked += 1;
        }
        assert_eq!(walked, 4);
        // One flipped bit in a digested header ends the walk there.
        let mut io = seeds.iter().find(|s| s.name == "io-digests").expect("seed").bytes.clone();
        io[1 + 12] ^= 0x10;
        assert_eq!(walk(&io), 0);
    }
}
