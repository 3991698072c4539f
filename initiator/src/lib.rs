//! rdmablk initiator library.
