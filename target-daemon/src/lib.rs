//! rdmablk target library.
