//! Arrays and single values that arrive through the C ABI: `const T*` / `T*` arrays whose
//! length is a separate `size_t` argument, and a pointer to one struct.
//!
//! As with [`super::CBuf`], an array and its count carry the same brand lifetime `'id`, so that
//! an array can only be read or written with its own count: [`with_c_arrays`] and
//! [`with_c_arrays_mut`] hand out a pair of arrays and their count for Rust slices, and a C
//! caller promises in the header that each non-null array holds `count` elements. [`CIn`] and
//! [`COut`] are a pointer to one value, null or valid for `'a`.

use std::marker::PhantomData;

use super::Brand;

/// A `const T*` argument holding [`CCount`] elements (same brand), or null.
#[repr(transparent)]
#[derive(Debug)]
pub struct CArray<'id, T> {
    ptr: *const T,
    _brand: Brand<'id>,
}

/// A `T*` argument with room for [`CCount`] elements (same brand), or null.
#[repr(transparent)]
#[derive(Debug)]
pub struct CArrayMut<'id, T> {
    ptr: *mut T,
    _brand: Brand<'id>,
}

/// The `size_t` element count of the arrays with the same brand `'id`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct CCount<'id> {
    n: usize,
    _brand: Brand<'id>,
}

impl CCount<'_> {
    /// The count.
    pub fn get(self) -> usize {
        self.n
    }
}

impl<T: Copy> CArray<'_, T> {
    /// The `n` elements, or `None` for a null array with `n > 0`.
    pub fn read(self, n: CCount<'_>) -> Option<Vec<T>> {
        if n.n == 0 {
            return Some(Vec::new());
        }
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: a non-null `CArray<'id>` holds `n.n` initialised elements readable for `'id`
        // (made by `with_c_arrays` from slices at least that long, or promised by the C caller in
        // the header) and unchanged during the call; the brand pairs it with its own count.
        Some(unsafe { std::slice::from_raw_parts(self.ptr, n.n) }.to_vec())
    }
}

impl<T: Copy> CArrayMut<'_, T> {
    /// Writes `values` if there is room for them (`values.len() <= n`) and the array is not
    /// null; returns whether it wrote.
    pub fn write(self, n: CCount<'_>, values: &[T]) -> bool {
        if values.len() > n.n || (self.ptr.is_null() && !values.is_empty()) {
            return false;
        }
        // SAFETY: a non-null `CArrayMut<'id>` is valid for writes of `n.n >= values.len()`
        // elements that nothing else touches during the call (made by `with_c_arrays_mut` from
        // exclusively borrowed slices, or promised by the C caller); `values` is a distinct
        // Rust slice. Nothing is written when `values` is empty.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr, values.len()) };
        true
    }
}

/// Calls `f` with two arrays over `a` and `b` and their count (the shorter length), as a C
/// caller would pass them.
pub fn with_c_arrays<A, B, R>(
    a: &[A],
    b: &[B],
    f: impl for<'id> FnOnce(CArray<'id, A>, CArray<'id, B>, CCount<'id>) -> R,
) -> R {
    let n = a.len().min(b.len());
    let brand = PhantomData;
    let (a, b) = (
        CArray {
            ptr: a.as_ptr(),
            _brand: brand,
        },
        CArray {
            ptr: b.as_ptr(),
            _brand: brand,
        },
    );
    f(a, b, CCount { n, _brand: brand })
}

/// Calls `f` with two writable arrays over `a` and `b` and their count (the shorter length).
pub fn with_c_arrays_mut<A, B, R>(
    a: &mut [A],
    b: &mut [B],
    f: impl for<'id> FnOnce(CArrayMut<'id, A>, CArrayMut<'id, B>, CCount<'id>) -> R,
) -> R {
    let n = a.len().min(b.len());
    let brand = PhantomData;
    let a = CArrayMut {
        ptr: a.as_mut_ptr(),
        _brand: brand,
    };
    let b = CArrayMut {
        ptr: b.as_mut_ptr(),
        _brand: brand,
    };
    f(a, b, CCount { n, _brand: brand })
}

/// A `const T*` argument pointing to one value, or null.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct CIn<'a, T> {
    ptr: *const T,
    _life: PhantomData<&'a T>,
}

impl<'a, T: Copy> CIn<'a, T> {
    /// A pointer to `value`.
    pub fn new(value: &'a T) -> Self {
        CIn {
            ptr: value,
            _life: PhantomData,
        }
    }

    /// The value, or `None` for null.
    pub fn read(self) -> Option<T> {
        // SAFETY: a non-null `CIn<'a, T>` points to an initialised `T` readable for `'a` (made
        // from a reference by `new`, or promised by the C caller in the header).
        (!self.ptr.is_null()).then(|| unsafe { self.ptr.read_unaligned() })
    }
}

/// A `T*` argument pointing to one value to fill, or null.
#[repr(transparent)]
#[derive(Debug)]
pub struct COut<'a, T> {
    ptr: *mut T,
    _life: PhantomData<&'a mut T>,
}

impl<'a, T: Copy> COut<'a, T> {
    /// A pointer to `value`.
    pub fn new(value: &'a mut T) -> Self {
        COut {
            ptr: value,
            _life: PhantomData,
        }
    }

    /// Writes `value`; false (nothing written) for null.
    pub fn write(self, value: T) -> bool {
        if self.ptr.is_null() {
            return false;
        }
        // SAFETY: a non-null `COut<'a, T>` is valid for a write of one `T` that nothing else
        // touches during the call (made from an exclusive reference by `new`, or promised by the
        // C caller in the header).
        unsafe { self.ptr.write_unaligned(value) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_read_and_write_only_within_their_count() {
        let (a, b) = ([1i32, 2, 3], [10u64, 20]);
        let read = with_c_arrays(&a, &b, |a, b, n| (a.read(n), b.read(n)));
        assert_eq!(read, (Some(vec![1, 2]), Some(vec![10, 20])));
        let (mut a, mut b) = ([0i32; 2], [0u64; 2]);
        let wrote = with_c_arrays_mut(&mut a, &mut b, |a, b, n| {
            (a.write(n, &[7, 8]), b.write(n, &[1, 2, 3]))
        });
        assert_eq!(wrote, (true, false));
        assert_eq!((a, b), ([7, 8], [0, 0]));
    }

    #[test]
    fn single_values_round_trip_and_null_is_refused() {
        let mut v = 0u64;
        assert!(COut::new(&mut v).write(42));
        assert_eq!(CIn::new(&v).read(), Some(42));
    }
}
