//! # justitia-integrity
//!
//! Checks that RDMA transfers deliver exactly what was posted, byte for byte and completion
//! for completion. Its purpose is to prove that the Justitia shaper (`libjustitia.so`,
//! loaded with `LD_PRELOAD`) is invisible to applications when it splits large requests into
//! chunks: a split transfer must land every byte at the right place, touch no byte outside
//! it, and report exactly one completion per signaled request (none for unsignaled ones)
//! with the application's own `wr_id`.
//!
//! The checker connects two RC queue pairs on one device inside one process (on Soft-RoCE
//! the traffic loops back inside the rxe driver) and runs seeded random batches:
//!
//! - [`plan`] draws the batches: RDMA WRITE, READ and WRITE_WITH_IMM of 1 B to 16 MiB,
//!   scattered over several SGEs at random offsets in several memory regions, some
//!   requests unsignaled and always followed by a signaled one, posted as one list or one
//!   by one. Sizes may be steered around a chunk size so chunk boundaries get hit.
//! - [`pattern`] fills sources with a position-dependent pattern, so a chunk landing at the
//!   wrong offset is caught, and fills destinations with the pattern's complement, so a
//!   chunk that never landed is caught.
//! - [`checker`] posts a batch, checks every completion (status, `wr_id`, opcode, byte
//!   count, immediate data, queue pair, order, no extra ones) and every byte of every
//!   destination plus guard bytes around it.

pub mod checker;
pub mod pattern;
pub mod plan;
