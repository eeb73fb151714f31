//! Peer access (`CachingAllocator::set_peer_access`, PyTorch's `enablePeerAccess`): a device
//! added to the list gets access to every chunk mapped before (the stream shards', the tags'),
//! chunks mapped after get it as they are mapped, and a graph pool made after starts with the
//! list. The simulated device ignores peers; the calls are read from a `LogCalls` log.

use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::wrap::LogCalls;
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(3);
type Logged = Arc<LogCalls<SimDevice>>;

fn logged(policy: Policy) -> (Logged, CachingAllocator<Logged>) {
    let log = Arc::new(LogCalls::new(SimDevice::new(SimConfig::with_capacity(
        4 << 30,
    ))));
    let alloc = CachingAllocator::new(log.clone(), Config::for_policy(policy));
    (log, alloc)
}

/// The `set_access` calls among `lines`.
fn grants(lines: &[String]) -> Vec<&String> {
    lines
        .iter()
        .filter(|l| l.starts_with("set_access"))
        .collect()
}

#[test]
fn a_peer_added_later_gets_access_to_the_chunks_mapped_before() {
    for policy in [Policy::Default, Policy::TorchExpandable] {
        let (log, alloc) = logged(policy);
        let kept = [
            alloc.allocate(90 * MIB, S).unwrap(),
            alloc.allocate(300 * 1024, S).unwrap(),
            alloc.allocate_tagged(30 * MIB, S, "weights").unwrap(),
        ];
        let before = log.take_lines();
        let mapped = grants(&before).len();
        assert!(mapped >= 3, "{policy:?}: {before:?}");
        assert!(!before.iter().any(|l| l.starts_with("unmap")), "{policy:?}");

        alloc.set_peer_access(&[1]).unwrap();
        let granted = log.take_lines();
        assert_eq!(grants(&granted).len(), mapped, "{policy:?}: {granted:?}");
        assert!(
            granted.iter().all(|l| l.contains("peers [1]")),
            "{policy:?}: {granted:?}"
        );

        alloc.set_peer_access(&[1]).unwrap();
        assert!(
            log.take_lines().is_empty(),
            "{policy:?}: no device added, nothing granted"
        );

        let later = alloc.allocate(70 * MIB, StreamId(4)).unwrap();
        let pool = alloc.graph_pool();
        let pooled = pool.allocate(10 * MIB, S).unwrap();
        let after = log.take_lines();
        assert!(!grants(&after).is_empty(), "{policy:?}");
        assert!(
            grants(&after).iter().all(|l| l.contains("peers [1]")),
            "{policy:?}: {after:?}"
        );
        assert_eq!(alloc.peer_access(), vec![1]);
        assert_eq!(pool.peer_access(), vec![1]);
        pool.free(pooled).unwrap();
        drop(pool);
        for a in kept.into_iter().chain([later]) {
            alloc.free(a).unwrap();
        }
    }
}

/// A grant that failed leaves the list as it was: asking again grants every chunk mapped
/// before (a retry of `cudalloc_enable_peer_access` included).
#[test]
fn a_failed_grant_is_granted_when_asked_again() {
    for policy in [Policy::Default, Policy::TorchExpandable] {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 << 30)));
        let log = Arc::new(LogCalls::new(sim.clone()));
        let alloc = CachingAllocator::new(log.clone(), Config::for_policy(policy));
        let a = alloc.allocate(90 * MIB, S).unwrap();
        let mapped = log
            .take_lines()
            .iter()
            .filter(|l| l.starts_with("set_access"))
            .count();
        assert!(mapped >= 1);

        sim.fail_next(); // the first grant of the chunks mapped before fails
        assert!(alloc.set_peer_access(&[1]).is_err(), "{policy:?}");
        let failed = log.take_lines();
        let granted_then = failed
            .iter()
            .filter(|l| l.starts_with("set_access") && !l.contains("err"))
            .count();

        // The caller retries: every chunk not granted yet must be granted now.
        alloc.set_peer_access(&[1]).unwrap();
        let again = log.take_lines();
        let granted_now = again
            .iter()
            .filter(|l| l.starts_with("set_access") && l.contains("peers [1]"))
            .count();
        assert!(
            granted_then + granted_now >= mapped,
            "{policy:?}: {mapped} chunk(s) mapped, the retry granted {granted_now}: {failed:?} then {again:?}"
        );
        alloc.free(a).unwrap();
    }
}
