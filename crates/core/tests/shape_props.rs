//! Property tests of the request-shaping modules: chunk planner, classifier, yield planner.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use justitia_core::chunk::{
    ChunkError, ChunkLimits, ChunkPlan, Opcode, RemoteAddr, SendFlags, Sge, SgeList, WholeReason,
    WorkRequest, MAX_SGES,
};
use justitia_core::classifier::{ClassifierConfig, FlowClassifier};
use justitia_core::flow::FlowClass;
use justitia_core::yield_plan::{YieldConfig, YieldCursor, YieldPlanner};
use proptest::prelude::*;

fn opcode() -> impl Strategy<Value = Opcode> {
    prop_oneof![
        Just(Opcode::Write),
        any::<u32>().prop_map(|imm| Opcode::WriteWithImm { imm }),
        Just(Opcode::Read),
        Just(Opcode::Send),
        any::<u32>().prop_map(|imm| Opcode::SendWithImm { imm }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(compare, swap)| Opcode::AtomicCmpAndSwp { compare, swap }),
        any::<u64>().prop_map(|add| Opcode::AtomicFetchAndAdd { add }),
    ]
}

/// SGEs in separate, well-aligned regions, a quarter of them empty.
fn sges() -> impl Strategy<Value = Vec<Sge>> {
    prop::collection::vec(
        (
            0u64..1 << 40,
            prop_oneof![1 => Just(0u32), 3 => 1u32..4000],
            any::<u32>(),
        )
            .prop_map(|(addr, length, lkey)| Sge { addr, length, lkey }),
        0..=MAX_SGES,
    )
}

fn flags() -> impl Strategy<Value = SendFlags> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(signaled, fence, solicited, inline)| SendFlags {
            signaled,
            fence,
            solicited,
            inline,
        })
}

fn work_request() -> impl Strategy<Value = WorkRequest> {
    (
        any::<u64>(),
        opcode(),
        sges(),
        0u64..1 << 48,
        any::<u32>(),
        flags(),
    )
        .prop_map(
            |(wr_id, opcode, sges, remote_addr, rkey, flags)| WorkRequest {
                wr_id,
                opcode,
                sges: SgeList::try_from(sges.as_slice()).unwrap(),
                remote: Some(RemoteAddr {
                    addr: remote_addr,
                    rkey,
                }),
                flags,
            },
        )
}

fn limits() -> impl Strategy<Value = ChunkLimits> {
    (1u32..6000, 1usize..40, any::<bool>()).prop_map(|(chunk_bytes, max_sge, split_two_sided)| {
        ChunkLimits {
            chunk_bytes,
            max_sge,
            split_two_sided,
        }
    })
}

/// The byte stream of an SGE list as maximal runs of consecutive addresses under one key.
/// Two SGE lists describe the same bytes in the same order exactly when their runs match.
fn byte_runs<'a>(sges: impl IntoIterator<Item = &'a Sge>) -> Vec<(u64, u64, u32)> {
    let mut runs: Vec<(u64, u64, u32)> = Vec::new();
    for sge in sges.into_iter().filter(|s| s.length > 0) {
        match runs.last_mut() {
            Some((addr, len, lkey)) if *lkey == sge.lkey && *addr + *len == sge.addr => {
                *len += u64::from(sge.length)
            }
            _ => runs.push((sge.addr, u64::from(sge.length), sge.lkey)),
        }
    }
    runs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn chunks_rebuild_the_request_and_follow_every_rule(
        request in work_request(),
        limits in limits(),
    ) {
        let plan = ChunkPlan::new(request, limits).unwrap();
        let whole = plan.whole_reason();
        let len = request.sges.total_bytes();
        let chunks: Vec<_> = plan.collect();

        if let Some(reason) = whole {
            let expected = if request.opcode.is_atomic() {
                WholeReason::Atomic
            } else if request.flags.inline {
                WholeReason::Inline
            } else if !request.opcode.is_one_sided() && !limits.split_two_sided {
                WholeReason::TwoSidedWithoutPeer
            } else {
                WholeReason::FitsOneChunk
            };
            prop_assert_eq!(reason, expected);
            prop_assert_eq!(chunks.len(), 1);
            prop_assert_eq!(chunks[0].request, request);
            prop_assert!(chunks[0].is_last);
            return Ok(());
        }
        prop_assert!(len > u64::from(limits.chunk_bytes));
        prop_assert!(chunks.len() >= 2);

        // The local byte stream comes back exactly, in order.
        let original = byte_runs(request.sges.iter());
        let rebuilt = byte_runs(chunks.iter().flat_map(|c| c.request.sges.iter()));
        prop_assert_eq!(rebuilt, original);

        // Where the original SGEs end, counted in bytes of the request.
        let mut sge_ends = Vec::new();
        let mut end = 0u64;
        for sge in request.sges.iter() {
            end += u64::from(sge.length);
            sge_ends.push(end);
        }

        let max_sge = limits.max_sge.min(MAX_SGES);
        let mut offset = 0u64;
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.iter().enumerate() {
            let wr = &chunk.request;
            let bytes = wr.sges.total_bytes();
            prop_assert_eq!(chunk.index as usize, i);
            prop_assert_eq!(u64::from(chunk.offset), offset);
            prop_assert_eq!(chunk.is_last, i == last);
            prop_assert!(bytes >= 1 && bytes <= u64::from(limits.chunk_bytes));
            prop_assert!(wr.sges.len() <= max_sge);
            prop_assert!(wr.sges.iter().all(|s| s.length > 0));
            if bytes < u64::from(limits.chunk_bytes) && i != last {
                // Cut short only by the SGE limit, and then at an SGE boundary.
                prop_assert_eq!(wr.sges.len(), max_sge);
                prop_assert!(sge_ends.contains(&(offset + bytes)));
            }
            if request.opcode.is_one_sided() {
                let remote = request.remote.unwrap();
                prop_assert_eq!(
                    wr.remote,
                    Some(RemoteAddr { addr: remote.addr + offset, rkey: remote.rkey })
                );
            } else {
                prop_assert_eq!(wr.remote, request.remote);
            }
            let is_last = i == last;
            prop_assert_eq!(wr.wr_id, if is_last { request.wr_id } else { 0 });
            prop_assert_eq!(wr.flags.signaled, is_last && request.flags.signaled);
            prop_assert_eq!(wr.flags.solicited, is_last && request.flags.solicited);
            prop_assert_eq!(wr.flags.fence, i == 0 && request.flags.fence);
            prop_assert!(!wr.flags.inline);
            let expected_opcode = if is_last {
                request.opcode
            } else {
                request.opcode.without_imm()
            };
            prop_assert_eq!(wr.opcode, expected_opcode);
            prop_assert_eq!(wr.opcode.imm().is_some(), is_last && request.opcode.imm().is_some());
            offset += bytes;
        }
        prop_assert_eq!(offset, len);
    }

    #[test]
    fn arbitrary_input_never_panics_and_errors_follow_the_rules(
        wr_id in any::<u64>(),
        opcode in opcode(),
        raw_sges in prop::collection::vec((any::<u64>(), any::<u32>(), any::<u32>()), 0..=MAX_SGES),
        remote in prop::option::of((any::<u64>(), any::<u32>())),
        flags in flags(),
        chunk_bytes in prop_oneof![Just(0u32), any::<u32>()],
        max_sge in prop_oneof![Just(0usize), any::<usize>()],
    ) {
        let sges: Vec<Sge> = raw_sges
            .into_iter()
            .map(|(addr, length, lkey)| Sge { addr, length, lkey })
            .collect();
        let request = WorkRequest {
            wr_id,
            opcode,
            sges: SgeList::try_from(sges.as_slice()).unwrap(),
            remote: remote.map(|(addr, rkey)| RemoteAddr { addr, rkey }),
            flags,
        };
        let limits = ChunkLimits { chunk_bytes, max_sge, split_two_sided: true };
        let total = request.sges.total_bytes();
        match ChunkPlan::new(request, limits) {
            Err(ChunkError::ZeroChunkSize) => prop_assert_eq!(chunk_bytes, 0),
            Err(ChunkError::ZeroMaxSge) => prop_assert_eq!(max_sge, 0),
            Err(ChunkError::LengthOverflow { total: t }) => {
                prop_assert_eq!(t, total);
                prop_assert!(t > u64::from(u32::MAX));
            }
            Err(ChunkError::MissingRemote { .. }) => {
                prop_assert!(opcode.is_one_sided() && request.remote.is_none());
            }
            Err(ChunkError::LocalAddressOverflow { index, .. }) => {
                let sge = sges[index];
                prop_assert!(sge.addr.checked_add(u64::from(sge.length) - 1).is_none());
            }
            Err(ChunkError::RemoteAddressOverflow { addr, .. }) => {
                prop_assert!(addr.checked_add(total - 1).is_none());
            }
            Err(ChunkError::TooManySges { .. }) => prop_assert!(false, "list was in capacity"),
            Ok(plan) => {
                // Iterate lazily: a plan may have billions of one-byte chunks.
                let covered: u64 = plan
                    .take(10_000)
                    .map(|c| c.request.sges.total_bytes())
                    .sum();
                prop_assert!(covered <= total);
            }
        }
    }

    #[test]
    fn inferred_class_changes_no_more_often_than_the_dwell_allows(
        dwell_ms in 0u64..300,
        half_life_ms in 1u64..500,
        events in prop::collection::vec((0u64..40, 0u8..3, 0u32..1 << 17, 0u32..12), 1..400),
        explicit in prop::option::of(prop::sample::select(FlowClass::ALL.to_vec())),
    ) {
        let config = ClassifierConfig {
            dwell: Duration::from_millis(dwell_ms),
            size_half_life: Duration::from_millis(half_life_ms),
            ..ClassifierConfig::default()
        };
        let mut classifier = FlowClassifier::new(config).unwrap();
        let mut now = Duration::ZERO;
        let mut last = None;
        let mut last_change: Option<Duration> = None;
        for (i, (step_ms, kind, bytes, depth)) in events.into_iter().enumerate() {
            now += Duration::from_millis(step_ms);
            match kind {
                0 => classifier.on_post(now, bytes),
                1 => classifier.on_depth_sample(now, depth),
                _ => {}
            }
            if i == 200 {
                classifier.set_explicit(explicit);
            }
            let class = classifier.class(now);
            if let Some(explicit) = classifier.explicit() {
                prop_assert_eq!(class, explicit);
            }
            let inferred = classifier.inferred();
            if last.is_some() && inferred != last {
                if let Some(previous) = last_change {
                    prop_assert!(
                        now - previous >= config.dwell,
                        "changed at {:?} and {:?}, dwell {:?}", previous, now, config.dwell
                    );
                }
                last_change = Some(now);
            }
            if inferred.is_some() && last.is_none() {
                // The first evidence decides at once; hysteresis counts from there.
                last_change = Some(now);
            }
            last = inferred;
        }
    }

    #[test]
    fn yield_steps_cover_the_message_with_yields_between_every_pair(
        total in prop_oneof![0u64..100_000, 0u64..1 << 32],
        sub_message_bytes in 1u32..70_000,
        yield_unit_bytes in 64u32..70_000,
    ) {
        let config = YieldConfig { sub_message_bytes, yield_unit_bytes };
        let planner = YieldPlanner::new(config).unwrap();
        let per_sub_message = sub_message_bytes.div_ceil(yield_unit_bytes);
        prop_assert_eq!(planner.yields_per_sub_message(), per_sub_message);
        let mut offset = 0u64;
        let mut steps = 0u64;
        let mut previous_yields = None;
        for step in planner.steps(total) {
            prop_assert_eq!(step.offset, offset);
            prop_assert!(step.bytes <= sub_message_bytes);
            prop_assert!(step.bytes > 0 || total == 0);
            if let Some(yields) = previous_yields {
                prop_assert_eq!(yields, per_sub_message);
            }
            previous_yields = Some(step.yields_after);
            offset += u64::from(step.bytes);
            steps += 1;
        }
        prop_assert_eq!(offset, total);
        prop_assert_eq!(previous_yields, Some(0));
        prop_assert_eq!(steps, total.div_ceil(u64::from(sub_message_bytes)).max(1));
    }

    #[test]
    fn steered_yield_plan_still_covers_the_message(
        total in 0u64..1 << 22,
        densities in prop::collection::vec(0u32..2000, 1..50),
    ) {
        let mut planner = YieldPlanner::default();
        let mut cursor = YieldCursor::new(total);
        let mut offset = 0u64;
        let mut i = 0;
        while let Some(step) = planner.next_step(&mut cursor) {
            prop_assert_eq!(step.offset, offset);
            offset += u64::from(step.bytes);
            let expected = if cursor.is_done() { 0 } else { planner.yields_per_sub_message() };
            prop_assert_eq!(step.yields_after, expected);
            planner.set_yields_per_sub_message(densities[i % densities.len()]);
            prop_assert!(planner.yields_per_sub_message() <= 1024);
            i += 1;
        }
        prop_assert_eq!(offset, total);
    }
}
