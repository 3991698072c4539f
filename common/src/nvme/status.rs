//! NVMe status: a status code type (SCT) and a status code (SC), plus the
//! Do Not Retry bit. The target's NVMe-oF front end maps every error to
//! one of these in exactly one place; this module only names them.

/// Status code types.
pub mod sct {
    pub const GENERIC: u8 = 0;
    pub const COMMAND_SPECIFIC: u8 = 1;
    pub const MEDIA: u8 = 2;
    pub const PATH: u8 = 3;
}

/// A completion's status, without the phase tag (reserved on fabrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    /// Do Not Retry: the same command would fail again.
    pub dnr: bool,
}

impl Status {
    pub const SUCCESS: Status = Status::generic(0x00);
    pub const INVALID_OPCODE: Status = Status::generic(0x01).no_retry();
    pub const INVALID_FIELD: Status = Status::generic(0x02).no_retry();
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03).no_retry();
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const ABORTED_BY_REQUEST: Status = Status::generic(0x07);
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b).no_retry();
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c).no_retry();
    /// Data SGL Length Invalid.
    pub const SGL_DATA_LENGTH_INVALID: Status = Status::generic(0x0f).no_retry();
    /// SGL Descriptor Type Invalid.
    pub const SGL_TYPE_INVALID: Status = Status::generic(0x11).no_retry();
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16).no_retry();
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::generic(0x20).no_retry();
    /// A transport error the host may retry (NVMe/TCP: a data digest error).
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80).no_retry();
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81).no_retry();
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);

    pub const INVALID_QUEUE_ID: Status = Status::specific(0x01).no_retry();
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02).no_retry();
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::specific(0x05).no_retry();
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09).no_retry();
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0d).no_retry();
    /// Connect, Disconnect: the format (RECFMT) is not supported.
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80).no_retry();
    /// Connect: the controller is busy (e.g. the queue is already connected).
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81);
    /// Connect: a parameter is invalid; dword 0 of the completion says which.
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82).no_retry();
    /// Connect: the host may not reach this subsystem.
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84).no_retry();
    /// Disconnect: sent on the admin queue (it deletes an I/O queue).
    pub const INVALID_QUEUE_TYPE: Status = Status::specific(0x85).no_retry();
    /// A command other than Connect, Property Get/Set and Authentication
    /// Send/Receive on a queue whose host has not authenticated yet
    /// (Linux's NVME_SC_AUTH_REQUIRED).
    pub const AUTHENTICATION_REQUIRED: Status = Status::specific(0x91).no_retry();

    pub const WRITE_FAULT: Status = Status::media(0x80);
    pub const UNRECOVERED_READ_ERROR: Status = Status::media(0x81);
    pub const ACCESS_DENIED: Status = Status::media(0x86).no_retry();

    /// Path related: the namespace is in an ANA Inaccessible group as seen
    /// through this controller. Never DNR: the host retries the command on
    /// another path (and re-reads this controller's ANA log).
    pub const ANA_INACCESSIBLE: Status = Status::path(0x02);

    pub const fn generic(sc: u8) -> Status {
        Status { sct: sct::GENERIC, sc, dnr: false }
    }
    pub const fn specific(sc: u8) -> Status {
        Status { sct: sct::COMMAND_SPECIFIC, sc, dnr: false }
    }
    pub const fn media(sc: u8) -> Status {
        Status { sct: sct::MEDIA, sc, dnr: false }
    }
    pub const fn path(sc: u8) -> Status {
        Status { sct: sct::PATH, sc, dnr: false }
    }
    pub const fn no_retry(self) -> Status {
        Status { dnr: true, ..self }
    }

    pub fn is_success(&self) -> bool {
        self.sct == sct::GENERIC && self.sc == 0
    }

    /// The completion's status field (bits 15:1; bit 0, the phase tag, is
    /// left 0): SC in 8:1, SCT in 11:9, DNR in 15.
    pub fn to_field(self) -> u16 {
        (self.sc as u16) << 1 | ((self.sct & 0x7) as u16) << 9 | (self.dnr as u16) << 15
    }

    /// Reads the status field of a completion (CRD and More ignored).
    pub fn from_field(field: u16) -> Status {
        Status { sc: (field >> 1) as u8, sct: ((field >> 9) & 0x7) as u8, dnr: field & (1 << 15) != 0 }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SCT {:#x} SC {:#04x}{}", self.sct, self.sc, if self.dnr { " DNR" } else { "" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_match_the_kernels_encoding() {
        // Linux keeps (status field >> 1): SCT << 8 | SC, DNR as 0x4000.
        for (s, linux) in [
            (Status::INVALID_FIELD, 0x4002),
            (Status::LBA_OUT_OF_RANGE, 0x4080),
            (Status::CONNECT_INVALID_PARAMETERS, 0x4182),
            (Status::CONNECT_INVALID_HOST, 0x4184),
            (Status::ACCESS_DENIED, 0x4286),
            (Status::WRITE_FAULT, 0x0280),
            (Status::SUCCESS, 0),
            // NVME_SC_SGL_INVALID_DATA, _TYPE and _OFFSET, NVME_SC_CMD_SEQ_ERROR,
            // NVME_SC_TRANSIENT_TR_ERR.
            (Status::SGL_DATA_LENGTH_INVALID, 0x400f),
            (Status::SGL_TYPE_INVALID, 0x4011),
            (Status::SGL_OFFSET_INVALID, 0x4016),
            (Status::COMMAND_SEQUENCE_ERROR, 0x400c),
            (Status::TRANSIENT_TRANSPORT_ERROR, 0x0022),
            // NVME_SC_AUTH_REQUIRED | NVME_STATUS_DNR, as nvmet answers.
            (Status::AUTHENTICATION_REQUIRED, 0x4191),
            // NVME_SC_ANA_INACCESSIBLE, without DNR: the host fails over.
            (Status::ANA_INACCESSIBLE, 0x0302),
        ] {
            assert_eq!(s.to_field() >> 1, linux, "{s}");
            assert_eq!(Status::from_field(s.to_field()), s);
        }
        assert!(Status::SUCCESS.is_success() && !Status::WRITE_FAULT.is_success());
    }
}
