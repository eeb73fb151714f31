//! The JSON documents of `cudalloc_stats_json` and `cudalloc_snapshot_json`.
//!
//! Stats: one object. Every top-level integer is a `torch.cuda.memory_stats()` key
//! ([`cudalloc_core::Stats::to_torch_dict`]; `reserved_bytes.all.peak` is exact, another
//! `.peak` the sum of the stream shards' peaks, counting blocks held in thread caches: an upper
//! bound when streams of several shards allocate or thread caches are on); the other top-level
//! entries are
//! - `"policy"`: the policy's name;
//! - `"fragmentation"`: free bytes, largest free block, external fragmentation, utilisation,
//!   mapped and virtual bytes, and the free-block histogram as `[bucket, count, bytes]` rows;
//! - `"driver_calls"`: mallocs, frees, maps, unmaps and their total, the device waits, the
//!   pages moved (`Stats::pages_moved`), and the bytes given back and taken back before the
//!   device caught up with them or after their unmap failed (`Stats::given_back_bytes`,
//!   `Stats::taken_back_bytes`), and the blocks lent across streams and the lends given up on
//!   a busy stream (`Stats::lent_blocks`, `Stats::lends_refused_busy`);
//! - `"excess"`: where the reserved bytes are now ([`cudalloc_core::Excess`], read after the
//!   rest): `reserved`, `live` (what the live allocations asked for; blocks held in thread
//!   caches count as live here, as the pools handed them out, though the torch keys count them
//!   as freed), `rounding`, `pending` (waiting for other streams, or pages on their way back),
//!   `releasable` (free chunks the pool could give back now), `pinned` (free bytes sharing a
//!   chunk or segment with a block in use), `stray` (pages whose release failed, held until a
//!   later call releases them; 0 unless a driver call failed) and `pinned_pages` (the part of
//!   `pinned` in whole device pages); every part but `pinned_pages` adds up to `reserved`;
//! - `"thread_cache"`: allocations served from thread caches so far (`hits`), and the blocks
//!   and bytes the caches hold now (the torch keys count both as freed);
//! - `"capi"`: the device ordinal, the number of failed `cudalloc_free` calls and the private
//!   pools (`active`: in use; `retired`: out of use and not dropped yet, their memory not given
//!   back yet or some of it still live; `driver_calls` and `device_waits`: those of every
//!   private pool so far, dropped ones included). The torch keys
//!   and `"driver_calls"` count the device's own allocator only; `cudalloc_device_stats` adds
//!   the private pools to the torch keys.
//!
//! Tag stats (`cudalloc_tag_stats_json`): an array with one object per tag, in the order the
//! tags were first used: `tag`, `allocations`, `allocated_bytes`, `requested_bytes`,
//! `reserved_bytes`, `asleep`, `slept_bytes`, `offloaded_bytes`, `host_buffer_bytes` and
//! `mapped_while_asleep` ([`cudalloc_core::TagStats`]).
//!
//! Snapshot: `{"device", "policy", "segments": [...]}`, each segment with `addr`, `size`,
//! `mapped`, `pool` (`small`/`large`), `stream`, `expandable` and `blocks`, each block with
//! `addr`, `size`, `requested`, `state` (`allocated`, `pending_events`, `free`, `unmapped`,
//! `releasing`, `moved`, `thread_cached`) and `stream`.

use crate::pools::PoolFigures;
use cudalloc_core::{CachingAllocator, Policy};
use cudalloc_sys::Device;
use serde_json::{json, Map, Value};

/// The stats document.
pub fn stats<D: Device>(
    alloc: &CachingAllocator<D>,
    policy: Policy,
    device: usize,
    free_errors: u64,
    pools: PoolFigures,
) -> String {
    let snap = alloc.snapshot();
    let mut out = Map::new();
    for (key, value) in snap.stats.to_torch_dict() {
        out.insert(key, Value::from(value));
    }
    let f = snap.fragmentation();
    let calls = snap.stats.calls;
    out.insert("policy".into(), Value::from(policy.name()));
    out.insert(
        "fragmentation".into(),
        json!({
            "free_bytes": f.free_bytes,
            "largest_free_block": f.largest_free_block,
            "external_fragmentation": f.external_fragmentation,
            "utilisation": f.utilisation,
            "mapped_bytes": f.mapped_bytes,
            "virtual_bytes": f.virtual_bytes,
            "free_histogram": f.free_histogram.iter().map(|&(b, n, s)| json!([b, n, s])).collect::<Vec<_>>(),
        }),
    );
    out.insert(
        "driver_calls".into(),
        json!({
            "mallocs": calls.mallocs,
            "frees": calls.frees,
            "maps": calls.maps,
            "unmaps": calls.unmaps,
            "total": calls.total(),
            "device_waits": snap.stats.device_waits,
            "pages_moved": snap.stats.pages_moved,
            "given_back_bytes": snap.stats.given_back_bytes,
            "taken_back_bytes": snap.stats.taken_back_bytes,
            "lent_blocks": snap.stats.lent_blocks,
            "lends_refused_busy": snap.stats.lends_refused_busy,
        }),
    );
    let e = alloc.excess();
    out.insert(
        "excess".into(),
        json!({
            "reserved": e.reserved,
            "live": e.live,
            "rounding": e.rounding,
            "pending": e.pending,
            "releasable": e.releasable,
            "pinned": e.pinned,
            "stray": e.stray,
            "pinned_pages": e.pinned_pages,
        }),
    );
    let tc = snap.stats.thread_cache;
    out.insert(
        "thread_cache".into(),
        json!({ "hits": tc.hits, "blocks": tc.blocks, "bytes": tc.bytes }),
    );
    out.insert(
        "capi".into(),
        json!({
            "device": device,
            "free_errors": free_errors,
            "private_pools": {
                "active": pools.active,
                "retired": pools.retired,
                "driver_calls": pools.driver_calls,
                "device_waits": pools.device_waits,
            },
        }),
    );
    Value::Object(out).to_string()
}

/// The number of values `cudalloc_device_stats` writes: the nine stat arrays (allocation,
/// segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
/// inactive_split_bytes, requested_bytes), each for all, small_pool and large_pool, then
/// oversize_allocations and oversize_segments, each as current, peak, allocated and freed; then
/// num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free and
/// max_split_size (-1: none).
pub const TORCH_VALUES: usize = 9 * 3 * 4 + 2 * 4 + 6;

/// The values of `torch.cuda.memory_stats()`'s keys, in the order of
/// [`cudalloc_core::Stats::to_torch_dict`] (the order [`TORCH_VALUES`] describes), read without
/// a snapshot.
pub fn torch_values<D: Device>(alloc: &CachingAllocator<D>) -> Vec<i64> {
    let values: Vec<i64> = alloc
        .stats()
        .to_torch_dict()
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    debug_assert_eq!(values.len(), TORCH_VALUES);
    values
}

/// The place of `reserved_bytes.all.peak` among [`torch_values`].
pub fn reserved_peak_index() -> usize {
    static INDEX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *INDEX.get_or_init(|| {
        cudalloc_core::Stats::default()
            .to_torch_dict()
            .iter()
            .position(|(k, _)| k == "reserved_bytes.all.peak")
            .expect("memory_stats has reserved_bytes.all.peak")
    })
}

/// The tag stats document.
pub fn tag_stats<D: Device>(alloc: &CachingAllocator<D>) -> String {
    let tags: Vec<Value> = alloc
        .tag_stats()
        .iter()
        .map(|t| {
            json!({
                "tag": t.tag,
                "allocations": t.allocations,
                "allocated_bytes": t.allocated_bytes,
                "requested_bytes": t.requested_bytes,
                "reserved_bytes": t.reserved_bytes,
                "asleep": t.asleep,
                "slept_bytes": t.slept_bytes,
                "offloaded_bytes": t.offloaded_bytes,
                "host_buffer_bytes": t.host_buffer_bytes,
                "mapped_while_asleep": t.mapped_while_asleep,
            })
        })
        .collect();
    Value::Array(tags).to_string()
}

/// The snapshot document.
pub fn snapshot<D: Device>(alloc: &CachingAllocator<D>, policy: Policy, device: usize) -> String {
    let snap = alloc.snapshot();
    let segments: Vec<Value> = snap
        .segments
        .iter()
        .map(|seg| {
            let blocks: Vec<Value> = seg
                .blocks
                .iter()
                .map(|b| {
                    json!({
                        "addr": b.addr,
                        "size": b.size,
                        "requested": b.requested,
                        "state": b.state.name(),
                        "stream": seg.stream.0,
                    })
                })
                .collect();
            json!({
                "addr": seg.addr,
                "size": seg.size,
                "mapped": seg.mapped,
                "pool": seg.pool.name(),
                "stream": seg.stream.0,
                "expandable": seg.expandable,
                "tag": seg.tag,
                "blocks": blocks,
            })
        })
        .collect();
    json!({ "device": device, "policy": policy.name(), "segments": segments }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudalloc_core::Config;
    use cudalloc_sys::{SimConfig, SimDevice, StreamId};

    /// One private pool in use, none retired, with no driver call.
    fn one_pool() -> PoolFigures {
        PoolFigures {
            active: 1,
            ..PoolFigures::default()
        }
    }

    /// An allocator of `policy` on a simulated device of 1 GiB.
    fn on_sim(policy: Policy) -> CachingAllocator<SimDevice> {
        CachingAllocator::new(
            SimDevice::new(SimConfig::with_capacity(1 << 30)),
            Config::for_policy(policy),
        )
    }

    #[test]
    fn stats_hold_every_torch_key_as_a_top_level_integer() {
        let alloc = on_sim(Policy::Torch);
        let a = alloc.allocate(3 << 20, StreamId(5)).unwrap();
        let b = alloc.allocate(100, StreamId(5)).unwrap();
        alloc.free(b).unwrap();
        let v: Value =
            serde_json::from_str(&stats(&alloc, Policy::Torch, 0, 2, one_pool())).unwrap();
        let torch = alloc.stats().to_torch_dict();
        for (k, val) in &torch {
            assert_eq!(v[k].as_i64(), Some(*val), "{k}");
        }
        let ints = v
            .as_object()
            .unwrap()
            .values()
            .filter(|x| x.is_i64())
            .count();
        assert_eq!(ints, torch.len(), "only torch keys are top-level integers");
        assert_eq!(v["policy"], "torch");
        assert_eq!(v["allocated_bytes.all.current"], 3 << 20);
        assert!(v["fragmentation"]["free_bytes"].as_u64().unwrap() > 0);
        assert_eq!(v["capi"]["free_errors"], 2);
        assert_eq!(
            v["thread_cache"]["hits"], 0,
            "torch's rules have no thread caches"
        );
        assert!(v["driver_calls"]["total"].as_u64().unwrap() >= 2);
        for key in [
            "pages_moved",
            "given_back_bytes",
            "taken_back_bytes",
            "lent_blocks",
        ] {
            assert_eq!(
                v["driver_calls"][key], 0,
                "{key}: torch's rules give nothing back and lend nothing"
            );
        }

        let s: Value = serde_json::from_str(&snapshot(&alloc, Policy::Torch, 0)).unwrap();
        let segs = s["segments"].as_array().unwrap();
        let blocks: Vec<&Value> = segs
            .iter()
            .flat_map(|g| g["blocks"].as_array().unwrap())
            .collect();
        let live: Vec<&&Value> = blocks
            .iter()
            .filter(|b| b["state"] == "allocated")
            .collect();
        assert_eq!(live.len(), 1);
        assert_eq!(live[0]["addr"], a.ptr());
        assert_eq!(live[0]["requested"], 3 << 20);
        assert_eq!(live[0]["stream"], 5);
        assert!(segs.iter().any(|g| g["pool"] == "small"));
    }

    #[test]
    fn bytes_the_budget_gives_back_are_in_the_driver_calls() {
        // Under `default` a 64 MiB block freed and then a growth of 256 MiB past the budget:
        // the free block's pages go back (the simulated device keeps up: none taken back).
        let alloc = on_sim(Policy::Default);
        let a = alloc.allocate(64 << 20, StreamId(5)).unwrap();
        alloc.free(a).unwrap();
        let b = alloc.allocate(256 << 20, StreamId(5)).unwrap();
        let v: Value =
            serde_json::from_str(&stats(&alloc, Policy::Default, 0, 0, one_pool())).unwrap();
        let calls = &v["driver_calls"];
        assert!(
            calls["given_back_bytes"].as_u64().unwrap() >= 64 << 20,
            "{calls}"
        );
        assert_eq!(calls["taken_back_bytes"], 0, "{calls}");
        alloc.free(b).unwrap();
    }

    #[test]
    fn the_excess_splits_the_reserved_bytes() {
        // Under `default` a 3 MiB block beside the rest of its chunk: the parts add up to the
        // reserved bytes, and the chunk's free bytes are pinned beside the live block.
        let alloc = on_sim(Policy::Default);
        let a = alloc.allocate(3 << 20, StreamId(5)).unwrap();
        let v: Value =
            serde_json::from_str(&stats(&alloc, Policy::Default, 0, 0, one_pool())).unwrap();
        let e = &v["excess"];
        let part = |k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{k} in {e}"));
        assert_eq!(part("live"), 3 << 20, "{e}");
        assert_eq!(
            part("reserved"),
            v["reserved_bytes.all.current"].as_u64().unwrap()
        );
        let parts: u64 = [
            "live",
            "rounding",
            "pending",
            "releasable",
            "pinned",
            "stray",
        ]
        .iter()
        .map(|k| part(k))
        .sum();
        assert_eq!(parts, part("reserved"), "{e}");
        assert!(part("pinned") > 0, "{e}");
        assert!(part("pinned_pages") <= part("pinned"), "{e}");
        alloc.free(a).unwrap();
    }

    #[test]
    fn a_block_in_a_thread_cache_is_thread_cached_in_the_snapshot() {
        let alloc = on_sim(Policy::Default);
        let keep = alloc.allocate(1000, StreamId(5)).unwrap();
        let cached = alloc.allocate(3000, StreamId(5)).unwrap();
        let cached_ptr = cached.ptr();
        alloc.free(cached).unwrap();
        let s: Value = serde_json::from_str(&snapshot(&alloc, Policy::Default, 0)).unwrap();
        let segs = s["segments"].as_array().unwrap();
        let state = |ptr: u64| {
            let mut blocks = segs.iter().flat_map(|g| g["blocks"].as_array().unwrap());
            blocks.find(|b| b["addr"] == ptr).unwrap()["state"].clone()
        };
        assert_eq!(state(keep.ptr()), "allocated");
        assert_eq!(state(cached_ptr), "thread_cached");
        let v: Value = serde_json::from_str(&stats(
            &alloc,
            Policy::Default,
            0,
            0,
            PoolFigures::default(),
        ))
        .unwrap();
        assert_eq!(v["allocation.all.current"], 1);
        assert_eq!(v["thread_cache"]["blocks"], 1);
    }
}
