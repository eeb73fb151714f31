//! CUDA graph capture on a real GPU (needs a CUDA GPU; ignored elsewhere): told of a capture,
//! the allocator makes no call that invalidates it, under every policy and capture mode; the
//! `torch` policy's growth is refused with `AllocError::DuringCapture` outside relaxed mode.
//!
//! A binary of its own, with one test: a global-mode capture refuses the unsafe calls of every
//! thread of the process, so a test running beside it would break it (and be broken by it).

use cudalloc::{AllocError, CachingAllocator, Config, Policy};
use cudalloc_sys::{CaptureMode, CudaDevice};

const MIB: u64 = 1 << 20;

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capture_stays_valid_under_every_policy_and_mode() {
    for policy in Policy::ALL {
        for mode in CaptureMode::ALL {
            let alloc =
                CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::for_policy(policy));
            let (s, side) =
                alloc.with_device(|d| (d.create_stream().unwrap(), d.create_stream().unwrap()));
            // A block another stream used, freed during the capture: its events wait for the end.
            let shared = alloc.allocate(MIB, s).unwrap();
            alloc.record_stream(shared.ptr(), side).unwrap();
            alloc.begin_capture(mode);
            alloc.with_device(|d| d.begin_capture(s, mode)).unwrap();
            let mut kept = Vec::new();
            let mut refused = 0;
            for (i, size) in [1000, 3 * MIB, 40 << 10, 25 * MIB, 90 * MIB]
                .into_iter()
                .enumerate()
            {
                match alloc.allocate(size, s) {
                    Ok(a) if i % 2 == 0 => alloc.free(a).unwrap(),
                    Ok(a) => kept.push(a),
                    Err(AllocError::DuringCapture { what: "grow", .. }) => refused += 1,
                    Err(e) => panic!("{policy:?} {mode:?}: {e}"),
                }
            }
            alloc.free(shared).unwrap();
            let ended = alloc.with_device(|d| d.end_capture(s));
            alloc.end_capture(mode).unwrap();
            println!(
                "{policy:?} {mode:?}: {} kept, {refused} refused, end: {ended:?}",
                kept.len()
            );
            ended.unwrap_or_else(|e| panic!("{policy:?} {mode:?}: the capture broke: {e}"));
            let fixed = policy == Policy::Torch && mode != CaptureMode::Relaxed;
            assert_eq!(refused > 0, fixed, "{policy:?} {mode:?}: refusals");
            for a in kept {
                alloc.free(a).unwrap();
            }
            alloc.empty_cache().unwrap();
            alloc.check_invariants().unwrap();
        }
    }
}
