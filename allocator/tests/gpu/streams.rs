//! Stream-ordered reuse on a real GPU (needs a CUDA GPU; ignored elsewhere).
//!
//! A block used on a second stream by work that runs for 500 ms (a host function that sleeps,
//! enqueued before the use) and then freed must not be handed to a new allocation of the same
//! size on the first stream before that work ends; it comes back once it has. Whether the work
//! was still running when the new allocation was made is asked of the device (an event
//! recorded after it), not guessed from the clock: an attempt in which it had already ended
//! (the process was held up) proves nothing and is made again. Data written on one stream
//! reads back intact from another after the streams are ordered.

use super::device::GPU;
use cudalloc::snapshot::BlockState;
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{CudaDevice, Device, StreamId};

const SIZE: u64 = 1 << 20;
/// How long stream 2's work runs.
const SLEEP_MS: u32 = 500;
/// Attempts per policy before the test gives up on keeping stream 2 busy.
const ATTEMPTS: usize = 3;

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_used_on_another_stream_waits_for_its_work() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    for policy in Policy::ALL {
        let checked = (0..ATTEMPTS).any(|_| reuse_waits_for_other_stream(policy));
        assert!(
            checked,
            "{policy:?}: stream 2's work ended before the allocation in each of {ATTEMPTS} attempts"
        );
    }
}

/// One attempt (see the module docs); false when stream 2's work had ended before the new
/// allocation was made, so that the attempt checked nothing.
fn reuse_waits_for_other_stream(policy: Policy) -> bool {
    let alloc = CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::for_policy(policy));
    let (s1, s2) = alloc.with_device(|d| (d.create_stream().unwrap(), d.create_stream().unwrap()));
    let done = alloc.with_device(|d| d.create_event().unwrap());
    let a = alloc.allocate(SIZE, s1).unwrap();
    alloc.with_device(|d| {
        d.sleep_on_stream(s2, SLEEP_MS).unwrap();
        d.memset_async(a.ptr(), 0xAB, SIZE, s2).unwrap();
        d.record_event(done, s2).unwrap();
    });
    alloc.record_stream(a.ptr(), s2).unwrap();
    let a_ptr = a.ptr();
    alloc.free(a).unwrap();
    let b = alloc.allocate(SIZE, s1).unwrap();
    let ended = alloc.with_device(|d| d.query_event(done).unwrap());
    if !ended {
        assert_ne!(
            b.ptr(),
            a_ptr,
            "{policy:?}: block reused while stream 2 still used it"
        );
        let pending = alloc
            .snapshot()
            .segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .any(|blk| blk.addr == a_ptr && blk.state == BlockState::PendingEvents);
        assert!(
            pending,
            "{policy:?}: the freed block should wait for its event"
        );
    }
    alloc.with_device(|d| d.wait_stream(s2).unwrap());
    let mut back = vec![0u8; SIZE as usize];
    alloc.with_device(|d| d.copy_from_device(a_ptr, &mut back).unwrap());
    assert!(
        back.iter().all(|&x| x == 0xAB),
        "{policy:?}: stream 2's write was lost"
    );
    // After the work completed, the block is reusable on stream 1 again.
    let again: Vec<_> = (0..4).map(|_| alloc.allocate(SIZE, s1).unwrap()).collect();
    let stats = alloc.stats();
    assert_eq!(
        stats.active.0[0].current as usize,
        again.len() + 1,
        "{policy:?}"
    );
    alloc.free(b).unwrap();
    for x in again {
        alloc.free(x).unwrap();
    }
    alloc.check_invariants().unwrap();
    finish(&alloc, [s1, s2], done);
    !ended
}

fn finish(
    alloc: &CachingAllocator<CudaDevice>,
    streams: [StreamId; 2],
    event: cudalloc_sys::EventHandle,
) {
    alloc.with_device(|d| {
        d.destroy_event(event).unwrap();
        for s in streams {
            d.destroy_stream(s).unwrap();
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn data_written_on_one_stream_reads_back_on_another() {
    let alloc = CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::default());
    let (s1, s2) = alloc.with_device(|d| (d.create_stream().unwrap(), d.create_stream().unwrap()));
    let a = alloc.allocate(64 << 20, s1).unwrap();
    alloc.with_device(|d| {
        d.sleep_on_stream(s1, 20).unwrap();
        d.memset_async(a.ptr(), 0x5A, a.size(), s1).unwrap();
        d.wait_stream(s1).unwrap();
        d.memset_async(a.ptr(), 0x3C, a.size() / 2, s2).unwrap();
        d.wait_stream(s2).unwrap();
        let mut back = vec![0u8; a.size() as usize];
        d.copy_from_device(a.ptr(), &mut back).unwrap();
        let half = back.len() / 2;
        assert!(back[..half].iter().all(|&x| x == 0x3C));
        assert!(back[half..].iter().all(|&x| x == 0x5A));
    });
    alloc.record_stream(a.ptr(), s2).unwrap();
    alloc.free(a).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    let _ = alloc.with_device(|d| d.mem_info());
}
