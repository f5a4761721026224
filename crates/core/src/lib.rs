//! # justitia-core
//!
//! The policy engine of Justitia (NSDI'22), shared by the daemon, the simulator and the
//! tests. It performs no I/O and never reads a clock: every call that depends on time is
//! handed `now` (a [`std::time::Duration`] since an arbitrary epoch chosen by the caller) and
//! returns a decision. Given the same inputs it returns the same outputs, so a result seen in
//! simulation is a result of the code that ships.
//!
//! | module | what it owns | paper |
//! | --- | --- | --- |
//! | [`flow`] | flow classes, flow and tenant identities, weights | Justitia §2.1, §3 |
//! | [`profile`] | RNIC profiles (MaxRate, MaxTput, MTU, chunk sizes), TOML loading | Justitia §4.2.2, §5.1 |
//! | [`estimator`] | tail-latency estimate over the reference flow's recent samples | Justitia §4.2.1 |
//! | [`control_verbs`] | control verbs a tenant may issue: the host budget shared by weight, each process paced to its share | Husky §4 |
//! | [`controller`] | the SafeUtil AIMD controller, soft admission, unattainable-target mode | Justitia §4.2.2, Pseudocode 1, §4.5 |
//! | [`control_loop`] | the whole per-host loop as one sans-I/O state machine: flows, probes, SafeUtil, allotments | Justitia §4.2, §4.5, §5.1 |
//! | [`allotment`] | multi-resource tokens and per-flow rate allotments | Justitia §4.2.3, App. D |
//! | [`remote_read`] | the utilisation guarantee sent to remote readers | Justitia §4.4 |
//! | [`incast`] | the receiver's share of its link among incoming senders, and the senders' pacing to it | Justitia §6.7 |
//! | [`message_charge`] | what a paced request is charged: its payload, or its message's cost in the chunk's bytes | PeRF §2.3, Husky §3 |
//! | [`pacer`] | the one enforcement algorithm: an allotment to release decisions, bounded burst | Justitia §4.2.3, App. D |
//! | [`queue_turns`] | turns among a process's queue pairs, so that the RNIC's context cache holds the ones that post | Husky §3 |
//! | [`chunk`] | splitting one work request into chunks | Justitia §4.3, §5.2 |
//! | [`classifier`] | per-QP class from observed sizes and depth | PeRF §3.3 |
//! | [`two_sided`] | splitting SENDs and WRITEs with immediate: the shapers' side-channel protocol, sender and receiver halves | Justitia §5.2 |
//! | [`yield_plan`] | zero-length yields between sub-messages | PeRF §4.1 |

pub mod adaptive;
pub mod allotment;
pub mod chunk;
pub mod classifier;
pub mod control_loop;
pub mod control_verbs;
pub mod controller;
pub mod estimator;
pub mod flow;
pub mod incast;
pub mod message_charge;
pub mod pacer;
pub mod profile;
pub mod queue_turns;
pub mod remote_read;
pub mod two_sided;
pub mod yield_plan;
