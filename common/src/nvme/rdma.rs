//! NVMe/RDMA (NVMe over Fabrics RDMA Transport Specification 1.0b): the
//! rdma_cm private data a host and a controller exchange when a queue
//! connects. Capsules themselves need no codec of their own: a command is
//! a 64-byte submission entry (plus in-capsule data) in one SEND, a
//! response a 16-byte completion entry in one SEND, and data moves by
//! RDMA READ and WRITE under the keyed SGL of the command.
//!
//! | request (host → controller), 32 bytes | |
//! |---|---|
//! | 0..2 | RECFMT: record format, 0 (version 1.0) |
//! | 2..4 | QID: 0 for the admin queue |
//! | 4..6 | HRQSIZE: the host's receive queue size (completions it can take) |
//! | 6..8 | HSQSIZE: the host's submission queue size, 0's based |
//! | 8..10 | CNTLID: the controller an I/O queue joins (0xffff: dynamic) |
//! | 10..32 | reserved |
//!
//! The accept carries RECFMT and CRQSIZE (the controller's receive queue
//! size) in 32 bytes; a reject RECFMT and a status (one of [`reject`]).

use super::{get_u16, need, put_u16, WireError};

/// The one record format there is (NVMe/RDMA 1.0).
pub const RECFMT_1_0: u16 = 0;
/// Size of the connect request's private data (more may follow: the CM pads it).
pub const CM_REQUEST_SIZE: usize = 32;
/// Size of the accept's private data.
pub const CM_ACCEPT_SIZE: usize = 32;
/// Size of a reject's private data.
pub const CM_REJECT_SIZE: usize = 4;
const _: () = assert!(CM_REQUEST_SIZE == 10 + 22 && CM_ACCEPT_SIZE == 4 + 28 && CM_REJECT_SIZE == 2 + 2);

/// Reject statuses (the RDMA transport's "NVMe/RDMA CM Reject Status").
pub mod reject {
    /// The private data is shorter than a request.
    pub const INVALID_LENGTH: u16 = 0x01;
    /// RECFMT is not 0.
    pub const INVALID_RECFMT: u16 = 0x02;
    /// QID is not a queue the controller has.
    pub const INVALID_QID: u16 = 0x03;
    /// HSQSIZE is larger than the controller allows (or zero).
    pub const INVALID_HSQSIZE: u16 = 0x04;
    /// HRQSIZE cannot hold a completion per command.
    pub const INVALID_HRQSIZE: u16 = 0x05;
    /// The controller has no resources for another queue.
    pub const NO_RESOURCES: u16 = 0x06;
    /// The RDMA READ depths asked for cannot be served.
    pub const INVALID_IRD: u16 = 0x07;
    pub const INVALID_ORD: u16 = 0x08;

    /// A short name for logs.
    pub fn name(status: u16) -> &'static str {
        match status {
            INVALID_LENGTH => "invalid private data length",
            INVALID_RECFMT => "invalid record format",
            INVALID_QID => "invalid queue id",
            INVALID_HSQSIZE => "invalid host submission queue size",
            INVALID_HRQSIZE => "invalid host receive queue size",
            NO_RESOURCES => "no resources",
            INVALID_IRD => "invalid IRD",
            INVALID_ORD => "invalid ORD",
            _ => "unknown reject status",
        }
    }
}

/// A host's connect request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmRequest {
    pub recfmt: u16,
    pub qid: u16,
    pub hrqsize: u16,
    /// 0's based: the queue holds `hsqsize + 1` entries.
    pub hsqsize: u16,
    pub cntlid: u16,
}

/// Why a connect request is refused: the reject status to send, and what was wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmRefusal {
    pub status: u16,
    pub value: u64,
}

impl std::fmt::Display for CmRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", reject::name(self.status), self.value)
    }
}

impl CmRequest {
    /// Reads a request. Reserved bytes are not checked (Linux nvmet does
    /// not either; the CM pads what follows).
    pub fn decode(b: &[u8]) -> Result<CmRequest, WireError> {
        need("NVMe/RDMA CM request", b, CM_REQUEST_SIZE)?;
        Ok(CmRequest { recfmt: get_u16(b, 0), qid: get_u16(b, 2), hrqsize: get_u16(b, 4), hsqsize: get_u16(b, 6), cntlid: get_u16(b, 8) })
    }

    pub fn encode(&self) -> [u8; CM_REQUEST_SIZE] {
        let mut out = [0; CM_REQUEST_SIZE];
        put_u16(&mut out, 0, self.recfmt);
        put_u16(&mut out, 2, self.qid);
        put_u16(&mut out, 4, self.hrqsize);
        put_u16(&mut out, 6, self.hsqsize);
        put_u16(&mut out, 8, self.cntlid);
        out
    }

    /// Decodes and checks a request against what the controller allows:
    /// `max_qid` I/O queues, `max_entries` per I/O queue and
    /// `max_admin_entries` for the admin queue. The refusal names the
    /// reject status the host gets.
    pub fn parse(b: &[u8], max_qid: u16, max_entries: u32, max_admin_entries: u32) -> Result<CmRequest, CmRefusal> {
        let r = CmRequest::decode(b).map_err(|_| CmRefusal { status: reject::INVALID_LENGTH, value: b.len() as u64 })?;
        r.validate(max_qid, max_entries, max_admin_entries)?;
        Ok(r)
    }

    pub fn validate(&self, max_qid: u16, max_entries: u32, max_admin_entries: u32) -> Result<(), CmRefusal> {
        if self.recfmt != RECFMT_1_0 {
            return Err(CmRefusal { status: reject::INVALID_RECFMT, value: self.recfmt as u64 });
        }
        if self.qid > max_qid {
            return Err(CmRefusal { status: reject::INVALID_QID, value: self.qid as u64 });
        }
        let limit = if self.qid == 0 { max_admin_entries } else { max_entries };
        let entries = self.hsqsize as u32 + 1;
        // A queue of one entry is no queue: the host must be able to have a
        // command outstanding beside its Connect's successor.
        if entries < 2 || entries > limit {
            return Err(CmRefusal { status: reject::INVALID_HSQSIZE, value: self.hsqsize as u64 });
        }
        // The host takes one completion per command it may have outstanding.
        if (self.hrqsize as u32) < entries {
            return Err(CmRefusal { status: reject::INVALID_HRQSIZE, value: self.hrqsize as u64 });
        }
        Ok(())
    }

    /// Entries of the submission queue (the receives the controller posts).
    pub fn entries(&self) -> u32 {
        self.hsqsize as u32 + 1
    }
}

/// The controller's accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmAccept {
    pub recfmt: u16,
    /// The controller's receive queue size: commands the host may send
    /// before it sees a completion.
    pub crqsize: u16,
}

impl CmAccept {
    pub fn encode(&self) -> [u8; CM_ACCEPT_SIZE] {
        let mut out = [0; CM_ACCEPT_SIZE];
        put_u16(&mut out, 0, self.recfmt);
        put_u16(&mut out, 2, self.crqsize);
        out
    }

    pub fn decode(b: &[u8]) -> Result<CmAccept, WireError> {
        need("NVMe/RDMA CM accept", b, 4)?;
        Ok(CmAccept { recfmt: get_u16(b, 0), crqsize: get_u16(b, 2) })
    }
}

/// A controller's reject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmReject {
    pub recfmt: u16,
    pub status: u16,
}

impl CmReject {
    pub fn encode(&self) -> [u8; CM_REJECT_SIZE] {
        let mut out = [0; CM_REJECT_SIZE];
        put_u16(&mut out, 0, self.recfmt);
        put_u16(&mut out, 2, self.status);
        out
    }

    pub fn decode(b: &[u8]) -> Result<CmReject, WireError> {
        need("NVMe/RDMA CM reject", b, CM_REJECT_SIZE)?;
        Ok(CmReject { recfmt: get_u16(b, 0), status: get_u16(b, 2) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_round_trips_with_the_cm_padding_after_it() {
        let r = CmRequest { recfmt: 0, qid: 3, hrqsize: 128, hsqsize: 127, cntlid: 0x11 };
        let mut padded = r.encode().to_vec();
        padded.extend_from_slice(&[0xee; 24]);
        assert_eq!(CmRequest::decode(&padded).unwrap(), r);
        assert_eq!(&r.encode()[..10], &[0, 0, 3, 0, 128, 0, 127, 0, 0x11, 0]);
    }

    #[test]
    fn each_bad_field_gets_its_own_reject_status() {
        let good = CmRequest { recfmt: 0, qid: 1, hrqsize: 32, hsqsize: 31, cntlid: 1 };
        let check = |r: CmRequest| r.validate(64, 128, 32).map_err(|e| e.status);
        assert_eq!(check(good), Ok(()));
        assert_eq!(CmRequest::parse(&good.encode()[..31], 64, 128, 32).unwrap_err().status, reject::INVALID_LENGTH);
        assert_eq!(check(CmRequest { recfmt: 1, ..good }), Err(reject::INVALID_RECFMT));
        assert_eq!(check(CmRequest { qid: 65, ..good }), Err(reject::INVALID_QID));
        assert_eq!(check(CmRequest { hsqsize: 128, hrqsize: 200, ..good }), Err(reject::INVALID_HSQSIZE));
        assert_eq!(check(CmRequest { hsqsize: 0, ..good }), Err(reject::INVALID_HSQSIZE));
        assert_eq!(check(CmRequest { qid: 0, hsqsize: 63, hrqsize: 64, ..good }), Err(reject::INVALID_HSQSIZE), "admin queue");
        assert_eq!(check(CmRequest { hrqsize: 31, ..good }), Err(reject::INVALID_HRQSIZE));
    }

    #[test]
    fn accept_and_reject_are_little_endian_and_fixed_size() {
        assert_eq!(&CmAccept { recfmt: 0, crqsize: 0x0180 }.encode()[..4], &[0, 0, 0x80, 1]);
        assert_eq!(CmReject { recfmt: 0, status: reject::INVALID_QID }.encode(), [0, 0, 3, 0]);
        assert_eq!(CmReject::decode(&[0, 0, 4, 0]).unwrap().status, reject::INVALID_HSQSIZE);
    }
}
