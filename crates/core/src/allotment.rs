//! Placeholder; see the crate documentation.
