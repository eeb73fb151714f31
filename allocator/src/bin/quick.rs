fn main() {
    let args: Vec<String> = std::env::args().collect();
    let policy = cudalloc::Policy::parse(&args[2]).unwrap();
    let t = cudalloc::trace::read(std::path::Path::new(&args[1])).unwrap();
    let cfg = cudalloc::Config::for_policy(policy);
    let r = cudalloc::replay::replay(&t, &cfg, &Default::default());
    println!("{} ops={} seg_allocs={} peak_live={} res={} alloc={} mallocs={} maps={} unmaps={} frees={} ns={:.0} fail={:?} anomalies={:?}", t.name, r.events, t.segment_allocs, r.peak_live_bytes, r.peak_reserved_bytes, r.peak_allocated_bytes, r.device_mallocs, r.device_maps, r.device_unmaps, r.device_frees, r.ns_per_event, r.failure, t.anomalies);
}
