//! The validation table's checks the model does not meet (`justitia validate` marks them
//! FAIL): each with the model's figure when it was listed. The test of the whole table fails
//! when a check outside this list leaves its tolerance, when a listed gap closes, or when a
//! gap widens: when the model ends up further from the paper's figure than the listed figure
//! is, by more than one per cent of the paper's figure (the distance is always taken
//! relative to the paper, so a figure near zero such as P6.mapp has the same slack as any
//! other). A gap that narrows by more than that is printed with the new figure to list, so
//! that the ratchet holds the gain. The paper's figures and tolerances are in
//! `crates/sim/validation/targets.toml`.

/// (check id, the model's figure), grouped by target, each group with the mechanism the
/// model lacks.
pub const KNOWN_GAPS: &[(&str, f64)] = &[
    // RoCE-40 (ConnectX-4) is modelled as scheduling packet by packet however many queue
    // pairs stream (no fetch bursts): a latency packet waits for the FIFO and at most one MTU
    // packet per competing QP, which gives the measured median (N3.roce.p50) but not the tail.
    ("N3.roce.p99", 6.735), // paper 16.2 us
    // The RoCE-40 4-QP flow runs at the link's payload rate; the measured one did not.
    ("N3.roce.bw", 36.923), // paper 32.8 Gb/s
    // Two streaming flows put one fetch burst ahead of the latency packet all the time (p99
    // x1.06 of the median); the measured tail is x1.85 the median. A pipeline that fills in
    // whole bursts, and so empties and refills, would spread it; the model's fills packet by
    // packet.
    ("N4.p99", 5.795), // paper 11.8 us
    // Against 16 flows the throughput flow's one QP gets one packet per round-robin turn of
    // 17; the measured flow kept more, as if it sent several messages per turn (a multi-packet
    // quantum for a backlogged queue pair, with messages processed ahead, is not modelled).
    ("N5.16", 0.017), // paper 0.1 x
    // 5 MB against 1 GB with event polling: the wake-up still costs the 5 MB flow 8%.
    ("N6.ib.5mb", 1.088), // paper 1 x
    // RoCE-10: the bandwidth flow keeps 8.5 of the link's 9.26 Gb/s of payload beside the
    // throughput flow; what held the measured one to 7.6 (DCQCN, the throughput flow's share of
    // the wire) is not modelled.
    ("N9.bw", 8.528), // paper 7.6 Gb/s
    // Relaxed target: the model's bandwidth flow keeps more than measured; on RoCE-40 its paced
    // 5 KB chunks never fill the transmit FIFO.
    ("J2.ib.bw", 46.38),    // paper 41.3 Gb/s
    ("J2.roce.p50", 2.235), // paper 6.7 us
    ("J2.roce.p99", 2.293), // paper 7.1 us
    ("J2.roce.bw", 36.5),   // paper 29.7 Gb/s
    // Native: eight streaming flows put seven fetch bursts (224 KB) and the FIFO ahead of each
    // latency packet, x16.7 rather than x71.4; the rest (about 1 MB more of queue, as eRPC's
    // x67 beside the storage service, Justitia §2.2.3, also suggests) is not modelled: QP-context
    // or WQE-cache misses with 16 active queue pairs are one candidate, larger bursts for the
    // 10 MB to 1 GB messages another.
    ("J6.native.p50x", 16.721),  // paper 71.4 x
    ("J6.native.p99x", 16.022),  // paper 79.8 x
    ("J6.gain.p50", 14.323),     // paper 48.8 x
    ("J6.gain.p99", 9.848),      // paper 16.4 x
    ("J6.justitia.p99x", 1.627), // paper 4.87 x
    // The yield is a header-only packet (8% of a 16 KB sub-message), and a sub-message enters
    // the FIFO as one burst.
    ("P1.dapp.bw", 0.085),   // paper < 0.05
    ("P1.mapp.bw", 0.154),   // paper < 0.05
    ("P1.dapp.p50", 1.806),  // paper 1 x
    ("P1.mapp.rate", 1.934), // paper 1 x
    // SEND as WRITE (P1): the yield is a header-only packet and a sub-message enters the FIFO
    // as one burst, so preempt costs the B_App 8.5% and cuts the D_App's mean only from 3.64
    // to 3.10 us; it brings the M_App from 2.91 to 10.9 M msgs/s, near its alone rate, a larger
    // gain than PeRF's (Fig 12b's absolute rates are not given, so which side differs is open).
    ("P4.send.bw", 0.0854),  // paper 0.05
    ("P4.send.dapp", 0.148), // paper 0.75
    ("P4.send.mapp", 3.759), // paper 2.7 x
    // READ: the data leaves the responder's RNIC, where the model isolates nothing; preempt
    // splits the requester's READs (16 KB READs and zero-length WRITE yields), which leaves the
    // D_App's mean at 4.85 us and the M_App at 2.68 M msgs/s. PeRF's RPC-based READ (requests
    // sent to its part on the responder, which WRITEs the data under its own isolation, §4)
    // is not modelled.
    ("P4.read.bw", 0.0842),    // paper 0.05
    ("P4.read.dapp", -0.0037), // paper 0.67
    ("P4.read.mapp", 0.916),   // paper 3 x
    // 1000 B_Apps of 8 QPs: the M_App's one QP gets one turn per round-robin round over 8001
    // queue pairs, 1.6 k msgs/s against 9.7 M. PeRF's QNum_allow (PAUSE/RESUME of the queue
    // pairs of a multi-QP application beyond the allowed number, 1 when the network is
    // saturated, §3.5.1, §5.2.3) is not modelled; the B_Apps' total and spread are met.
    ("P5.mapp", 0.0016), // paper 9.7 M msgs/s
    // QNum_allow again: preempt does not touch throughput flows, so the 16-QP M_App runs as
    // natively and both runs are the same (M_App single 6.18 M msgs/s, D_App p99 1.78 us).
    ("P6.mapp", 0.0), // paper 0.35
    ("P6.dapp", 0.0), // paper 0.22
    // Relaxed Justitia at 15 us never paces: the D_App stays at native latency and the B_App at
    // line rate.
    ("P3.mean", 3.613), // paper 1.5 us
    ("P3.bw", 96.518),  // paper 86 Gb/s
    // The LSG waits for every full input buffer from two BSGs on (RPerf's equation), one buffer
    // above the published points; the real switch's bandwidth loss with more BSGs is not
    // modelled.
    ("R3.1.p50", 0.78),    // paper 0.6 us
    ("R3.1.p999", 1.394),  // paper 0.9 us
    ("R3.2.p50", 10.319),  // paper 5.2 us
    ("R3.2.p999", 10.503), // paper 5.7 us
    ("R3.3.p50", 15.151),  // paper 10.7 us
    ("R3.bw5", 54.176),    // paper 48.4 Gb/s
    // As R3: the model keeps RPerf's equation, RPerf's own points sit one buffer under it; with
    // 1 BSG the LSG queues behind the packet being forwarded.
    ("R4.1.p50", 0.771),  // paper 0.6 us
    ("R4.2.p50", 9.119),  // paper 4.5 us
    ("R4.2.p999", 9.183), // paper 4.6 us
    // Where the LSG's packet falls in the round-robin turn is set by its closed loop.
    ("R5.1.p50", 0.771),  // paper 0.6 us
    ("R5.5.p50", 1.862),  // paper 2.5 us
    ("R5.5.p999", 1.929), // paper 2.6 us
    // The LSG shares the downstream input buffer with two BSGs that fill it.
    ("R6.rr.p999", 19.999), // paper 14.9 us
    // The zero-load RTT fitted to R1 is already 0.48 us; input buffers hold bytes, not packets.
    ("R7.64B.p50", 0.528),   // paper 0.4 us
    ("R7.512B.p50", 25.135), // paper 20 us
    // The pretender's rate is capped by the per-QP message rate fitted to R2.
    ("R8.pretend", 15.899),   // paper 21.5 Gb/s
    ("R8.others", 9.11),      // paper 6.7-7 Gb/s
    ("R8.gamed.p50", 0.817),  // paper 8.5 us
    ("R8.gamed.p999", 1.275), // paper 9.1 us
    // FaSST against the storage service: the storage service's four streaming queue pairs put
    // three fetch bursts ahead of every RPC message. The RPC model's client threads each wait
    // for a whole batch of 8 before the next, so the added wait costs rate one for one (31 us
    // per batch against 3.4 alone); FaSST's threads run coroutines with more requests in
    // flight, which the model does not. Justitia's gain is measured against that deeper
    // native loss (without fetch bursts: loss 0.84, gain x4.2).
    ("A1.loss", 0.901), // paper 0.74
    ("A1.gain", 7.013), // paper 2.5 x
    // eRPC against the storage service, one request at a time: as J6, the storage service's
    // streaming queue pairs put fetch bursts ahead of each request (x8.4; x2.1 without fetch
    // bursts) where the measured eRPC waited x67; Justitia wins back what the model lost.
    ("A2.p50x", 8.384),     // paper 67 x
    ("A2.p99x", 8.157),     // paper 40 x
    ("A2.gain.p50", 7.321), // paper 56.9 x
    ("A2.gain.p99", 6.258), // paper 32.2 x
];
