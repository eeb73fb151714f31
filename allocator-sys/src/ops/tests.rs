//! Tests of the checked operations that need no GPU: the gemm shape checks (exact sizes pass,
//! one element less fails, leading dimensions and batch strides count, negative, overflowing
//! and conjugate configurations fail), the `Send + Sync` bound of `Kernels`, and the error
//! source of `OpsError`; and, where libnvrtc is on the library path (no GPU needed), that the
//! kernels compile and hold every entry point `Kernels::new` loads.

use super::{check_gemm, DecodeShape, Kernels, OpsError};
use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::GemmConfig;

fn cfg(m: i32, n: i32, k: i32, ta: Op, tb: Op, ld: [i32; 3]) -> GemmConfig<f32> {
    GemmConfig {
        transa: ta,
        transb: tb,
        m,
        n,
        k,
        alpha: 1.0,
        lda: ld[0],
        ldb: ld[1],
        beta: 0.0,
        ldc: ld[2],
    }
}

#[test]
fn kernels_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Kernels>();
}

/// An error that wraps a driver error gives it as its `source`.
#[test]
fn a_wrapped_driver_error_is_the_source() {
    use cudarc::driver::sys::CUresult;
    use cudarc::driver::DriverError;
    use std::error::Error;
    let driver = || DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);
    let ops = OpsError::Driver(driver());
    // Compared as values: formatting a `DriverError` asks the driver for its text.
    let source = ops.source().and_then(|s| s.downcast_ref::<DriverError>());
    assert_eq!(source.map(|d| d.0), Some(driver().0));
}

#[test]
fn gemm_exact_sizes_pass_and_one_less_fails() {
    // A: 3x4 (N, lda 3) = 12; B: op(B) 4x5 stored 5x4 (T, ldb 5) = 20; C: 3x5 = 15.
    let c = cfg(3, 5, 4, Op::CUBLAS_OP_N, Op::CUBLAS_OP_T, [3, 5, 3]);
    assert!(check_gemm(&c, 1, [0; 3], [12, 20, 15]).is_ok());
    assert!(check_gemm(&c, 1, [0; 3], [11, 20, 15]).is_err());
    assert!(check_gemm(&c, 1, [0; 3], [12, 19, 15]).is_err());
    assert!(check_gemm(&c, 1, [0; 3], [12, 20, 14]).is_err());
}

#[test]
fn gemm_leading_dimension_counts() {
    // A 3x4 with lda 8: 8 * 3 + 3 = 27 elements.
    let c = cfg(3, 1, 4, Op::CUBLAS_OP_N, Op::CUBLAS_OP_N, [8, 4, 3]);
    assert!(check_gemm(&c, 1, [0; 3], [27, 4, 3]).is_ok());
    assert!(check_gemm(&c, 1, [0; 3], [26, 4, 3]).is_err());
    let short_ld = cfg(3, 1, 4, Op::CUBLAS_OP_N, Op::CUBLAS_OP_N, [2, 4, 3]);
    assert!(check_gemm(&short_ld, 1, [0; 3], [100, 100, 100]).is_err());
}

#[test]
fn gemm_batches_add_strides() {
    // 4 batches of a 2x2 matrix 10 apart: 10 * 3 + 4 = 34.
    let c = cfg(2, 2, 2, Op::CUBLAS_OP_N, Op::CUBLAS_OP_N, [2, 2, 2]);
    assert!(check_gemm(&c, 4, [10, 10, 10], [34, 34, 34]).is_ok());
    assert!(check_gemm(&c, 4, [10, 10, 10], [33, 34, 34]).is_err());
    assert!(check_gemm(&c, 4, [-1, 10, 10], [100, 100, 100]).is_err());
}

#[test]
fn gemm_negative_overflowing_and_conjugate_fail() {
    let neg = cfg(-1, 2, 2, Op::CUBLAS_OP_N, Op::CUBLAS_OP_N, [2, 2, 2]);
    assert!(check_gemm(&neg, 1, [0; 3], [100, 100, 100]).is_err());
    let c = cfg(2, 2, 2, Op::CUBLAS_OP_N, Op::CUBLAS_OP_N, [2, 2, 2]);
    assert!(check_gemm(&c, i32::MAX, [i64::MAX, 0, 0], [usize::MAX; 3]).is_err());
    let conj = cfg(2, 2, 2, Op::CUBLAS_OP_CONJG, Op::CUBLAS_OP_N, [2, 2, 2]);
    assert!(check_gemm(&conj, 1, [0; 3], [100, 100, 100]).is_err());
}

#[test]
fn gemm_empty_products_need_nothing() {
    let c = cfg(0, 5, 4, Op::CUBLAS_OP_N, Op::CUBLAS_OP_N, [1, 4, 1]);
    assert!(check_gemm(&c, 1, [0; 3], [0, 20, 0]).is_ok());
}

/// Compiles `kernels.cu` with NVRTC when the library can be loaded (skipped otherwise: CI has
/// no CUDA), and finds every kernel `Kernels::new` loads in the PTX.
#[test]
fn kernels_compile_where_nvrtc_is_present() {
    let ptx = match super::ptx() {
        Err(OpsError::Compile(m)) if m.contains("not found") => {
            eprintln!("skipped: {m}");
            return;
        }
        other => other.expect("kernels.cu compiles"),
    };
    let text = ptx.to_src();
    for name in [
        "cudalloc_fill_f32",
        "cudalloc_copy_f32",
        "cudalloc_embedding_f32",
        "cudalloc_rmsnorm_f32",
        "cudalloc_rope_f32",
        "cudalloc_softmax_causal_f32",
        "cudalloc_silu_mul_f32",
        "cudalloc_argmax_f32",
        "cudalloc_rope_at_f32",
        "cudalloc_store_rows_f32",
        "cudalloc_decode_attention_f32",
        "cudalloc_attention_part_f32",
        "cudalloc_attention_merge_f32",
        "cudalloc_linear_rows_f32",
        "cudalloc_add_u32",
        "cudalloc_spin_ns",
    ] {
        assert!(
            text.contains(&format!(".entry {name}(")),
            "{name} is not in the PTX"
        );
    }
}

#[test]
fn attention_scratch_holds_scores_or_chunks_whichever_is_larger() {
    let shape = |head_dim, max_len| DecodeShape {
        batch: 2,
        heads: 3,
        head_dim,
        max_len,
    };
    // 575 rows: 9 chunks of 64 keys, each head_dim + 2 floats (594 > 575 for head_dim 64).
    assert_eq!(shape(64, 575).scratch().unwrap(), 6 * 594);
    assert_eq!(shape(8, 575).scratch().unwrap(), 6 * 575);
    // Not split (head_dim not a multiple of 4, or past 256): the scores alone.
    assert_eq!(shape(66, 575).scratch().unwrap(), 6 * 575);
    assert_eq!(shape(260, 575).scratch().unwrap(), 6 * 575);
    assert_eq!(shape(64, 0).scratch().unwrap(), 0);
    let huge = DecodeShape {
        batch: usize::MAX,
        ..shape(64, 575)
    };
    assert!(huge.scratch().is_err(), "an overflowing size is an error");
}
