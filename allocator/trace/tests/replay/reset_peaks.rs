//! Resetting peak statistics on a replayed trace changes no behaviour of the pool: the driver
//! calls of a replay with resets are those of one without.

use cudalloc::{Allocation, Config, Policy, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use cudalloc_trace::{self as trace, Op};
use std::path::Path;

/// Resetting the peak statistics is statistics only: replaying `bert_dynamic` under `default`
/// with a reset every 100 operations makes the same driver calls as without (the budget's base,
/// the highest live bytes so far, is not reset with them).
#[test]
fn resetting_peaks_changes_no_driver_call() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/bert_dynamic.trace.csv.gz");
    let t = trace::read(&path).unwrap();
    let replay = |every: usize| {
        let dev = SimDevice::new(SimConfig::with_capacity(
            cudalloc_trace::replay::DEVICE_CAPACITY,
        ));
        let mut pool = Pool::new(dev, Config::for_policy(Policy::Default));
        let mut slots: Vec<Option<Allocation>> = (0..t.slots).map(|_| None).collect();
        for (i, op) in t.ops.iter().enumerate() {
            if every > 0 && i % every == 0 {
                pool.reset_peak_stats();
            }
            match *op {
                Op::Alloc { slot, stream, size } => {
                    let s = StreamId(t.streams[stream as usize]);
                    slots[slot as usize] = Some(pool.allocate(size, s).unwrap());
                }
                Op::Free { slot } => {
                    if let Some(a) = slots[slot as usize].take() {
                        pool.free(a).unwrap();
                    }
                }
            }
        }
        let c = pool.stats().calls;
        (c.maps, c.unmaps)
    };
    assert_eq!(replay(100), replay(0));
}
