//! Launchers for the per-row layer kernels in `layers.cu` (embedding, RMSNorm, RoPE + QKV
//! split, SwiGLU, row gather). Each launches one thread block per row.

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::cuda::{load_module, Element, Error};

const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/layers.fatbin"));
const THREADS: u32 = 256;

/// Head counts and size of the fused QKV projection `rope_split` takes apart.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    /// Pair dimension i with i + d/2 (HF layout) rather than (2i, 2i+1) (llama.cpp GGUF).
    pub neox: bool,
}

pub struct Layers {
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

fn rows_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Layers {
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, Error> {
        let module = load_module(&stream, FATBIN)?;
        Ok(Self { stream, module })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn function<T: Element>(&self, kernel: &str) -> Result<CudaFunction, Error> {
        Ok(self
            .module
            .load_function(&format!("{kernel}_{}", T::NAME))?)
    }

    /// `out[r] = table[ids[r]]` for the `ids.len()` rows.
    pub fn embed<T: Element>(
        &self,
        out: &mut CudaSlice<T>,
        table: &CudaSlice<T>,
        ids: &CudaSlice<u32>,
        hidden: usize,
    ) -> Result<(), Error> {
        let f = self.function::<T>("embed")?;
        let h = hidden as i32;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(table).arg(ids).arg(&h);
        // SAFETY: matches `embed_<T>`; ids index rows of `table`, `out` holds `ids.len()` rows.
        unsafe { b.launch(rows_cfg(ids.len())) }?;
        Ok(())
    }

    /// RMSNorm of the first `rows` rows of `x` (width `w.len()`) into `out`.
    pub fn rms_norm<T: Element>(
        &self,
        out: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        eps: f32,
        rows: usize,
    ) -> Result<(), Error> {
        let f = self.function::<T>("rms_norm")?;
        let h = w.len() as i32;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(x).arg(w).arg(&eps).arg(&h);
        // SAFETY: matches `rms_norm_<T>`; `x` and `out` hold at least `rows` rows of `w.len()`.
        unsafe { b.launch(rows_cfg(rows)) }?;
        Ok(())
    }

    /// Splits `rows` fused QKV rows (plus `bias`) into q, k, v, rotating q and k to `pos[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_split<T: Element>(
        &self,
        (q, k, v): (&mut CudaSlice<T>, &mut CudaSlice<T>, &mut CudaSlice<T>),
        qkv: &CudaSlice<T>,
        bias: &CudaSlice<T>,
        pos: &CudaSlice<u32>,
        (cos, sin): (&CudaSlice<f32>, &CudaSlice<f32>),
        heads: Heads,
    ) -> Result<(), Error> {
        let f = self.function::<T>("rope_split")?;
        let (nh, nkv, hs, neox) = (
            heads.num_heads as i32,
            heads.num_kv_heads as i32,
            heads.head_size as i32,
            heads.neox as i32,
        );
        let mut b = self.stream.launch_builder(&f);
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(qkv)
            .arg(bias)
            .arg(pos)
            .arg(cos)
            .arg(sin)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hs)
            .arg(&neox);
        // SAFETY: matches `rope_split_<T>`; one row per position, each position inside the
        // cos/sin tables.
        unsafe { b.launch(rows_cfg(pos.len())) }?;
        Ok(())
    }

    /// `out[r][i] = silu(gu[r][i]) * gu[r][inter + i]` for the first `rows` rows.
    pub fn silu_mul<T: Element>(
        &self,
        out: &mut CudaSlice<T>,
        gu: &CudaSlice<T>,
        inter: usize,
        rows: usize,
    ) -> Result<(), Error> {
        let f = self.function::<T>("silu_mul")?;
        let n = inter as i32;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(gu).arg(&n);
        // SAFETY: matches `silu_mul_<T>`; `gu` holds `rows` rows of 2 * inter, `out` of inter.
        unsafe { b.launch(rows_cfg(rows)) }?;
        Ok(())
    }

    /// `out[i] = x[idx[i]]` for rows of `width`.
    pub fn gather_rows<T: Element>(
        &self,
        out: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        idx: &CudaSlice<u32>,
        width: usize,
    ) -> Result<(), Error> {
        let f = self.function::<T>("gather_rows")?;
        let w = width as i32;
        let mut b = self.stream.launch_builder(&f);
        b.arg(out).arg(x).arg(idx).arg(&w);
        // SAFETY: matches `gather_rows_<T>`; idx are rows of `x`, `out` holds `idx.len()` rows.
        unsafe { b.launch(rows_cfg(idx.len())) }?;
        Ok(())
    }
}
