//! cuBLAS GEMMs for the CUDA path.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::{dev_err, GpuElement};
use crate::engine::ModelError;

/// cuBLAS on the engine's stream.
pub(super) struct Blas<'a>(pub &'a CudaBlas, pub &'a Arc<CudaStream>);

impl Blas<'_> {
    /// `y[rows][out] = x[rows][inp] · w[out][inp]ᵀ`, or `+=` with `accumulate`, accumulated
    /// in f32 (no TF32: f32 models stay f32). In cuBLAS's column-major terms the row-major
    /// `w` is `wᵀ` and `x` is `xᵀ`, so this is `yᵀ = op_T(w) · xᵀ` with m = out, n = rows,
    /// k = inp, and no copies. `y` may be wider than the inputs (f32 logits from bf16).
    pub fn gemm<T: GpuElement, Y: GpuElement>(
        &self,
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        y: &mut CudaSlice<Y>,
        (rows, inp, out): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), ModelError> {
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let (wp, _w) = w.device_ptr(self.1);
        let (xp, _x) = x.device_ptr(self.1);
        let (yp, _y) = y.device_ptr_mut(self.1);
        // SAFETY: `w` holds out × inp, `x` at least rows × inp and `y` rows × out elements
        // (the workspace is sized for the largest step, which the caller checked); alpha and
        // beta are host f32 scalars, as COMPUTE_32F with the default pointer mode expects.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.0.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                out as i32,
                rows as i32,
                inp as i32,
                (&alpha as *const f32).cast::<c_void>(),
                wp as *const c_void,
                T::CUDA,
                inp as i32,
                xp as *const c_void,
                T::CUDA,
                inp as i32,
                (&beta as *const f32).cast::<c_void>(),
                yp as *mut c_void,
                Y::CUDA,
                out as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(dev_err("cuBLAS GEMM"))
    }
}
