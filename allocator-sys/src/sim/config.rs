//! How a [`SimDevice`](super::SimDevice) behaves: its capacity, granularity, host backing and
//! ordinal.

/// How a [`SimDevice`](super::SimDevice) behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Device memory in bytes (segments plus pages).
    pub capacity: u64,
    /// VMM granularity in bytes: a power of two, at least [`MALLOC_ALIGNMENT`](crate::device::MALLOC_ALIGNMENT).
    pub granularity: u64,
    /// Keep the contents of segments and pages in sparse host memory (see [`SimDevice::write`](super::SimDevice::write)).
    pub host_backing: bool,
    /// The ordinal the device reports.
    pub ordinal: usize,
    /// Whether the device can make pages exportable as file descriptors
    /// ([`Device::can_share`](crate::Device::can_share); default `true`). Off, a
    /// `create_shareable_page` is refused as a driver without the handle type refuses it.
    pub shareable: bool,
}

impl Default for SimConfig {
    /// An H200: 143 771 MiB, 2 MiB granularity, no host backing, ordinal 0.
    fn default() -> Self {
        Self {
            capacity: 143_771 << 20,
            granularity: 2 << 20,
            host_backing: false,
            ordinal: 0,
            shareable: true,
        }
    }
}

impl SimConfig {
    /// The default configuration with `bytes` of capacity.
    pub fn with_capacity(bytes: u64) -> Self {
        Self::default().capacity(bytes)
    }

    /// Sets the capacity in bytes.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }

    /// Sets the VMM granularity in bytes.
    pub fn granularity(mut self, bytes: u64) -> Self {
        self.granularity = bytes;
        self
    }

    /// Turns host backing on or off.
    pub fn host_backing(mut self, on: bool) -> Self {
        self.host_backing = on;
        self
    }

    /// Says whether the device can make shareable pages.
    pub fn shareable(mut self, on: bool) -> Self {
        self.shareable = on;
        self
    }

    /// Sets the device ordinal.
    pub fn ordinal(mut self, ordinal: usize) -> Self {
        self.ordinal = ordinal;
        self
    }
}
