//! Helpers for system tests that start the real binaries.
