//! Recording traces from a running allocator.
