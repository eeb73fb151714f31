//! Where the engine's device memory comes from: the same model runs on either backend.
//!
//! - [`PoolMem`]: every buffer (weights, activations, KV cache, cuBLAS workspace) is a cudalloc
//!   `Buffer` from a `CachingAllocator<CudaDevice>`.
//! - [`CudarcMem`]: every buffer is a cudarc `CudaSlice` from `CudaStream::alloc_zeros` /
//!   `clone_htod` (`cuMemAllocAsync` from the device's default memory pool), wrapped to count
//!   live bytes; cuBLAS keeps its own workspace.

use cudalloc::stats::StatType;
use cudalloc::workspace::CublasHandle;
use cudalloc::CachingAllocator;
use cudalloc_sys::buffer::cudarc::cublas::CudaBlas;
use cudalloc_sys::buffer::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};
use cudalloc_sys::buffer::Buffer;
use cudalloc_sys::ops::mempool;
use cudalloc_sys::CudaDevice;
use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// A row of the memory report: label and value.
pub type Figure = (&'static str, String);

/// The device memory an engine runs on.
pub trait Mem {
    /// An `f32` buffer.
    type F: DevicePtr<f32> + DevicePtrMut<f32>;
    /// A `u32` buffer (token ids).
    type U: DevicePtr<u32> + DevicePtrMut<u32>;

    /// What this backend is, for reports.
    fn label(&self) -> String;
    /// The stream everything runs on.
    fn stream(&self) -> &Arc<CudaStream>;
    /// The cuBLAS handle (on [`Mem::stream`]).
    fn blas(&self) -> &CudaBlas;
    /// `len` floats, zeroed unless the backend was asked not to.
    fn floats(&self, len: usize) -> Result<Self::F>;
    /// A copy of `data`.
    fn upload(&self, data: &[f32]) -> Result<Self::F>;
    /// `len` token ids.
    fn ids(&self, len: usize) -> Result<Self::U>;
    /// A copy of `ids`.
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::U>;
    /// Restarts the peak figures.
    fn reset_peaks(&self) -> Result<()>;
    /// Peak bytes held from the device since the last reset.
    fn peak_reserved(&self) -> Result<u64>;
    /// Peak bytes of live buffers (as requested) since the last reset.
    fn peak_requested(&self) -> u64;
    /// Allocations made since the backend was created (cudalloc: those that reached a pool).
    fn allocations(&self) -> u64;
    /// Backend-specific figures.
    fn figures(&self) -> Result<Vec<Figure>>;
}

/// cudalloc: buffers from a caching allocator.
pub struct PoolMem {
    // The handle (and its workspace) goes before the allocator it came from.
    blas: CublasHandle,
    alloc: Arc<CachingAllocator<CudaDevice>>,
    stream: Arc<CudaStream>,
    policy: String,
    uninit: bool,
    /// The tag the weights ([`Mem::upload`]) are allocated in, if any (the swap example's).
    weights_tag: Option<String>,
}

impl PoolMem {
    pub fn new(
        alloc: Arc<CachingAllocator<CudaDevice>>,
        stream: Arc<CudaStream>,
        policy: &str,
        uninit: bool,
    ) -> Result<PoolMem> {
        let blas = alloc.cublas(&stream)?;
        Ok(PoolMem {
            blas,
            alloc,
            stream,
            policy: policy.to_string(),
            uninit,
            weights_tag: None,
        })
    }

    /// Allocates the weights ([`Mem::upload`]) in tag `tag`, so that they sleep and wake with it.
    #[allow(dead_code)] // the swap example's; the engine's weights are untagged
    pub fn tag_weights(mut self, tag: &str) -> PoolMem {
        self.weights_tag = Some(tag.to_string());
        self
    }

    pub fn allocator(&self) -> &Arc<CachingAllocator<CudaDevice>> {
        &self.alloc
    }
}

impl Mem for PoolMem {
    type F = Buffer<f32>;
    type U = Buffer<u32>;

    fn label(&self) -> String {
        let init = if self.uninit { ", uninit" } else { "" };
        format!("cudalloc ({}{init})", self.policy)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn blas(&self) -> &CudaBlas {
        self.blas.blas()
    }
    fn floats(&self, len: usize) -> Result<Buffer<f32>> {
        Ok(if self.uninit {
            self.alloc.buffer_uninit(len, &self.stream)?
        } else {
            self.alloc.buffer(len, &self.stream)?
        })
    }
    fn upload(&self, data: &[f32]) -> Result<Buffer<f32>> {
        Ok(match &self.weights_tag {
            Some(tag) => self.alloc.tagged_buffer_from(tag, data, &self.stream)?,
            None => self.alloc.buffer_from(data, &self.stream)?,
        })
    }
    fn ids(&self, len: usize) -> Result<Buffer<u32>> {
        Ok(self.alloc.buffer(len, &self.stream)?)
    }
    fn upload_ids(&self, ids: &[u32]) -> Result<Buffer<u32>> {
        Ok(self.alloc.buffer_from(ids, &self.stream)?)
    }
    fn reset_peaks(&self) -> Result<()> {
        self.alloc.reset_peak_stats();
        Ok(())
    }
    fn peak_reserved(&self) -> Result<u64> {
        Ok(self.alloc.stats().reserved_bytes.get(StatType::All).peak as u64)
    }
    fn peak_requested(&self) -> u64 {
        self.alloc.stats().requested_bytes.get(StatType::All).peak as u64
    }
    fn allocations(&self) -> u64 {
        // Those that reached a pool: a thread-cache hit is an allocation in PyTorch's counts but
        // takes no lock and no pool search.
        self.alloc.stats().pool_allocations() as u64
    }
    fn figures(&self) -> Result<Vec<Figure>> {
        let s = self.alloc.stats();
        let frag = self.alloc.snapshot().fragmentation();
        let mib = |v: i64| format!("{:.1} MiB", v as f64 / (1 << 20) as f64);
        let all = StatType::All;
        Ok(vec![
            ("peak reserved", mib(s.reserved_bytes.get(all).peak)),
            (
                "peak allocated (rounded)",
                mib(s.allocated_bytes.get(all).peak),
            ),
            ("peak requested", mib(s.requested_bytes.get(all).peak)),
            (
                "segments now / peak",
                format!(
                    "{} / {}",
                    s.segment.get(all).current,
                    s.segment.get(all).peak
                ),
            ),
            (
                "driver mallocs / frees",
                format!("{} / {}", s.calls.mallocs, s.calls.frees),
            ),
            (
                "page maps / unmaps",
                format!("{} / {}", s.calls.maps, s.calls.unmaps),
            ),
            (
                "device waits (synchronizations)",
                s.device_waits.to_string(),
            ),
            ("allocations", s.allocation.get(all).allocated.to_string()),
            ("OOM retries", s.num_alloc_retries.to_string()),
            (
                "utilisation / external fragmentation now",
                format!(
                    "{:.3} / {:.3}",
                    frag.utilisation, frag.external_fragmentation
                ),
            ),
            (
                "cuBLAS workspace",
                format!(
                    "{} KiB per stream, from the pool",
                    self.blas.workspace_bytes() / 1024
                ),
            ),
        ])
    }
}

/// Live and peak bytes of the cudarc backend's buffers.
#[derive(Debug, Default)]
pub struct Counter {
    live: AtomicU64,
    peak: AtomicU64,
    count: AtomicU64,
}

impl Counter {
    fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
    fn sub(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// A cudarc `CudaSlice` whose bytes are counted while it lives.
#[derive(Debug)]
pub struct Counted<T> {
    slice: CudaSlice<T>,
    bytes: u64,
    counter: Arc<Counter>,
}

impl<T> Counted<T> {
    fn new(slice: CudaSlice<T>, counter: &Arc<Counter>) -> Counted<T> {
        let bytes = slice.num_bytes() as u64;
        counter.add(bytes);
        Counted {
            slice,
            bytes,
            counter: counter.clone(),
        }
    }
}

impl<T> Drop for Counted<T> {
    fn drop(&mut self) {
        self.counter.sub(self.bytes);
    }
}

impl<T> DeviceSlice<T> for Counted<T> {
    fn len(&self) -> usize {
        DeviceSlice::len(&self.slice)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(&self.slice)
    }
}

impl<T> DevicePtr<T> for Counted<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for Counted<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

/// cudarc: `alloc_zeros`/`clone_htod` (cuMemAllocAsync) for every buffer.
pub struct CudarcMem {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    counter: Arc<Counter>,
    retain: bool,
}

impl CudarcMem {
    /// `retain`: let the driver's pool keep freed memory across synchronizations (release
    /// threshold at its maximum) instead of the driver's default (0: trim at every sync).
    pub fn new(stream: Arc<CudaStream>, retain: bool) -> Result<CudarcMem> {
        let threshold = if retain { u64::MAX } else { 0 };
        mempool::set_release_threshold(stream.context(), threshold)?;
        Ok(CudarcMem {
            blas: CudaBlas::new(stream.clone())?,
            stream,
            counter: Arc::new(Counter::default()),
            retain,
        })
    }

    fn counted<T: DeviceRepr>(&self, slice: CudaSlice<T>) -> Counted<T> {
        Counted::new(slice, &self.counter)
    }
}

impl Mem for CudarcMem {
    type F = Counted<f32>;
    type U = Counted<u32>;

    fn label(&self) -> String {
        let keep = if self.retain { ", pool retains" } else { "" };
        format!("cudarc (cuMemAllocAsync{keep})")
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn blas(&self) -> &CudaBlas {
        &self.blas
    }
    fn floats(&self, len: usize) -> Result<Counted<f32>> {
        Ok(self.counted(self.stream.alloc_zeros::<f32>(len)?))
    }
    fn upload(&self, data: &[f32]) -> Result<Counted<f32>> {
        Ok(self.counted(self.stream.clone_htod(data)?))
    }
    fn ids(&self, len: usize) -> Result<Counted<u32>> {
        Ok(self.counted(self.stream.alloc_zeros::<u32>(len)?))
    }
    fn upload_ids(&self, ids: &[u32]) -> Result<Counted<u32>> {
        Ok(self.counted(self.stream.clone_htod(ids)?))
    }
    fn reset_peaks(&self) -> Result<()> {
        let live = self.counter.live.load(Ordering::Relaxed);
        self.counter.peak.store(live, Ordering::Relaxed);
        mempool::reset_peaks(self.stream.context())?;
        Ok(())
    }
    fn peak_reserved(&self) -> Result<u64> {
        Ok(mempool::usage(self.stream.context())?.reserved_high)
    }
    fn peak_requested(&self) -> u64 {
        self.counter.peak.load(Ordering::Relaxed)
    }
    fn allocations(&self) -> u64 {
        self.counter.count.load(Ordering::Relaxed)
    }
    fn figures(&self) -> Result<Vec<Figure>> {
        let u = mempool::usage(self.stream.context())?;
        let mib = |v: u64| format!("{:.1} MiB", v as f64 / (1 << 20) as f64);
        Ok(vec![
            ("default mempool: peak reserved", mib(u.reserved_high)),
            ("default mempool: peak used", mib(u.used_high)),
            ("peak requested (counted)", mib(self.peak_requested())),
            ("allocations", self.allocations().to_string()),
            ("cuBLAS workspace", "cuBLAS's own (not counted)".to_string()),
        ])
    }
}
