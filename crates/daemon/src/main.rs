//! justitiad: the daemon is assembled in the next steps.

fn main() {}
