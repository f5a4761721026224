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
//! - [`post_api`] chooses how the requester posts (`--post-api`): with `ibv_post_send` on a
//!   QP from `ibv_create_qp` (`post-send`, the default), or through the extended send
//!   interface on a QP from `ibv_create_qp_ex` with send-ops flags (`wr`): `wr_id` and
//!   `wr_flags` set on the `ibv_qp_ex` before each request, then `ibv_wr_rdma_write`,
//!   `ibv_wr_rdma_write_imm` or `ibv_wr_rdma_read` and `ibv_wr_set_sge_list`, one
//!   `ibv_wr_start` ... `ibv_wr_complete` wherever `post-send` makes one `ibv_post_send`
//!   call. That is perftest's default on Soft-RoCE, and the shaper intercepts it apart from
//!   `ibv_post_send`. Planning, verification and the report are the same for both, so one
//!   seed gives the same transfers with either. If the device or libibverbs cannot create
//!   such a QP, `wr` fails with an error saying so; it never falls back to `ibv_post_send`.
//! - [`across`] runs the same plans across two hosts, two processes (`--serve` and
//!   `--connect`): the server holds regions filled with a known pattern, the client READs
//!   every transfer from them over the link and checks each byte against the pattern at
//!   the remote offset, the QPs' details exchanged over TCP as perftest does. With
//!   `--two-sided send` or `--two-sided write-imm` on the client the data flows the other
//!   way: SENDs (about half with immediate) or RDMA WRITEs with immediate, which the
//!   server receives and judges, batch by batch, its receives always posted first.
//! - [`two_sided`] draws those messages (random sizes from 1 byte to the largest, random
//!   scatter lists on both ends, receives with slack after the message) from the seed both
//!   ends share, and judges each received message: completion status, opcode, `byte_len`,
//!   immediate flag and value, `wr_id` and order, every byte, the guards around every range
//!   and the rest of the server's region.

pub mod across;
pub mod checker;
pub mod ledger;
pub mod pattern;
pub mod plan;
pub mod post_api;
pub mod two_sided;
