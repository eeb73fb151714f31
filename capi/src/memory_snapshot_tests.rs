//! The document on the simulated device: PyTorch's sums hold (reserved, allocated and active
//! bytes from the blocks), blocks tile their segments, unmapped addresses are in none.

use super::*;
use cudalloc_core::{CachingAllocator, Config};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};

const S: StreamId = StreamId(5);

fn alloc(conf: &str) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(1 << 32)),
        Config::parse(conf).unwrap(),
    )
}

fn records(a: &CachingAllocator<SimDevice>, pool: PoolId) -> Records {
    let mut doc = Document::default();
    doc.add(&a.snapshot(), 3, pool);
    let r = parse(&doc.to_bytes()).expect("a whole document");
    check(a, &r);
    r
}

/// What PyTorch's readers of a snapshot rely on, against the allocator's statistics.
fn check(a: &CachingAllocator<SimDevice>, r: &Records) {
    let stats = a.stats();
    let sum = |states: &[i32]| -> i64 {
        let blocks = r.blocks.iter().filter(|b| states.contains(&b.state));
        blocks.map(|b| b.size as i64).sum()
    };
    let reserved: u64 = r.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(reserved as i64, stats.reserved_bytes.0[0].current);
    assert_eq!(sum(&[1]), stats.allocated_bytes.0[0].current);
    assert_eq!(sum(&[1, 2]), stats.active_bytes.0[0].current);
    assert!(r.blocks.iter().all(|b| (1..=5).contains(&b.state)));
    let mut next = 0;
    for s in &r.segments {
        assert_eq!(s.first_block, next);
        next += s.block_count;
        let mut at = s.address;
        for b in r.blocks_of(s) {
            assert_eq!(b.address, at, "the blocks tile their segment");
            at += b.size;
        }
        assert_eq!(at, s.address + s.total_size);
        assert_eq!(s.device, 3);
    }
    assert_eq!(next as usize, r.blocks.len());
    assert!(r.segments.windows(2).all(|w| w[0].address < w[1].address));
}

fn block(r: &Records, ptr: u64) -> BlockRecord {
    *r.blocks.iter().find(|b| b.address == ptr).unwrap()
}

#[test]
fn fixed_segments_are_reported_whole_with_their_blocks() {
    let a = alloc("policy:torch");
    let big = a.allocate(3 << 20, S).unwrap();
    let small = a.allocate(1000, S).unwrap();
    let gone = a.allocate(2000, S).unwrap();
    let gone_ptr = gone.ptr();
    a.free(gone).unwrap();
    let r = records(&a, (0, 0));
    assert_eq!(r.segments.len(), 2);
    assert_eq!(block(&r, big.ptr()).state, 1);
    assert_eq!(block(&r, big.ptr()).requested, 3 << 20);
    assert_eq!(block(&r, small.ptr()).state, 1);
    assert_eq!(block(&r, gone_ptr).state, 3, "freed: free");
    assert!(r.segments.iter().all(|s| s.stream == 5 && s.pool == (0, 0)));
    let mut flags: Vec<i32> = r.segments.iter().map(|s| s.flags).collect();
    flags.sort_unstable();
    assert_eq!(flags, [0, LARGE], "one small segment, one large");
}

#[test]
fn an_expandable_segment_is_one_segment_per_mapped_run() {
    let a = alloc("policy:torch-expandable");
    let x = a.allocate(40 << 20, S).unwrap();
    let y = a.allocate(40 << 20, S).unwrap();
    let z = a.allocate(40 << 20, S).unwrap();
    let y_ptr = y.ptr();
    a.free(y).unwrap();
    a.empty_cache().unwrap();
    let r = records(&a, (0, 0));
    let large: Vec<&SegmentRecord> = r.segments.iter().filter(|s| s.flags & LARGE != 0).collect();
    assert!(large.iter().all(|s| s.flags & EXPANDABLE != 0));
    assert_eq!(
        large.len(),
        2,
        "the unmapped hole splits the range: {large:?}"
    );
    assert_eq!(block(&r, x.ptr()).state, 1);
    assert_eq!(block(&r, z.ptr()).state, 1);
    assert!(
        r.blocks.iter().all(|b| b.address != y_ptr),
        "unmapped: in no segment"
    );
}

#[test]
fn a_thread_cached_block_is_neither_allocated_nor_active() {
    let a = alloc("policy:default");
    let keep = a.allocate(1000, S).unwrap();
    let cached = a.allocate(3000, S).unwrap();
    let cached_ptr = cached.ptr();
    a.free(cached).unwrap();
    let r = records(&a, (0, 0));
    assert_eq!(block(&r, keep.ptr()).state, 1);
    assert_eq!(block(&r, cached_ptr).state, 5);
    assert_eq!(block(&r, cached_ptr).requested, 3000);
}

#[test]
fn segments_of_several_allocators_carry_their_pools_in_address_order() {
    let own = alloc("policy:torch");
    let pool = alloc("policy:torch-expandable");
    let a = own.allocate(3 << 20, S).unwrap();
    let b = pool.allocate(5 << 20, S).unwrap();
    let mut doc = Document::default();
    doc.add(&pool.snapshot(), 0, (0, 7));
    doc.add(&own.snapshot(), 0, (0, 0));
    let r = parse(&doc.to_bytes()).unwrap();
    let owner = |ptr: u64| {
        let s = r
            .segments
            .iter()
            .find(|s| (s.address..s.address + s.total_size).contains(&ptr));
        s.unwrap().pool
    };
    assert_eq!(owner(a.ptr()), (0, 0));
    assert_eq!(owner(b.ptr()), (0, 7));
    assert!(r.segments.windows(2).all(|w| w[0].address < w[1].address));
}

#[test]
fn an_empty_document_is_its_header_and_a_cut_one_does_not_parse() {
    let bytes = Document::default().to_bytes();
    assert_eq!(bytes.len(), HEADER_BYTES);
    assert_eq!(parse(&bytes), Some(Records::default()));
    let a = alloc("policy:torch");
    let _x = a.allocate(1 << 20, S).unwrap();
    let mut doc = Document::default();
    doc.add(&a.snapshot(), 0, (0, 0));
    let bytes = doc.to_bytes();
    assert_eq!(bytes.len(), HEADER_BYTES + SEGMENT_BYTES + 2 * BLOCK_BYTES);
    assert!(parse(&bytes[..bytes.len() - 1]).is_none());
    assert!(parse(&bytes[..4]).is_none());
}
