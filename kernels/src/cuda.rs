//! Launchers for the kernels in `attention.cu`, compiled by `build.rs` into one fatbin (SASS
//! for sm_80 and sm_90, PTX for newer GPUs) and loaded through cudarc. The driver library is
//! opened at run time, so a binary built here starts on a machine without one and only fails,
//! with an error, when a CUDA context is asked for.

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DriverError, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::{group_tile, Shape, HEAD_SIZES, PARTITION_SIZE};

const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/attention.fatbin"));
const THREADS: u32 = 128;
/// Rows go in the grid's y dimension, which CUDA caps at 65535.
pub const MAX_ROWS: usize = 65535;

/// Element types of the cache and activations the kernels are built for.
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy + Unpin + 'static {
    const NAME: &'static str;
}
impl Element for f32 {
    const NAME: &'static str = "f32";
}
impl Element for half::f16 {
    const NAME: &'static str = "f16";
}
impl Element for half::bf16 {
    const NAME: &'static str = "bf16";
}

#[derive(Debug)]
pub enum Error {
    Driver(DriverError),
    Unsupported(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Driver(e) => write!(f, "CUDA: {e:?}"),
            Self::Unsupported(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        Self::Driver(e)
    }
}

/// Whether the attention kernel is built for this head layout.
pub fn supported(num_heads: usize, num_kv_heads: usize, head_size: usize) -> Result<(), Error> {
    if !HEAD_SIZES.contains(&head_size) {
        return Err(Error::Unsupported(format!(
            "head size {head_size} (kernels exist for {HEAD_SIZES:?})"
        )));
    }
    if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(Error::Unsupported(format!(
            "{num_heads} query heads over {num_kv_heads} KV heads"
        )));
    }
    Ok(())
}

/// An embedded fatbin loaded into the stream's context (the driver picks the SASS for the GPU,
/// or JIT-compiles the PTX on a newer one).
pub(crate) fn load_module(
    stream: &Arc<CudaStream>,
    fatbin: &[u8],
) -> Result<Arc<CudaModule>, Error> {
    Ok(stream
        .context()
        .load_module(Ptx::from_binary(fatbin.to_vec()))?)
}

/// A step's rows grouped by launch (see `Kernels::plan_rows`).
pub struct RowPlan {
    rows: usize,
    /// Rows whose context fits one partition.
    single: Option<CudaSlice<u32>>,
    /// Longer rows and the partitions their launch uses.
    split: Option<(CudaSlice<u32>, usize)>,
}

pub struct Kernels {
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

impl Kernels {
    /// Loads the kernels into the stream's context.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, Error> {
        let module = load_module(&stream, FATBIN)?;
        Ok(Self { stream, module })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn function(&self, name: &str) -> Result<CudaFunction, Error> {
        Ok(self.module.load_function(name)?)
    }

    /// Splits a step's rows by context length (host copy of `row_ctx`): rows that fit one
    /// partition take the single-pass launch, longer ones the split-K launch sized by the
    /// longest of them, so one long row does not make every row of the batch run and reduce
    /// partitions. Made once per step, used by every layer.
    pub fn plan_rows(&self, row_ctx: &[u32]) -> Result<RowPlan, Error> {
        if row_ctx.len() > MAX_ROWS {
            return Err(Error::Unsupported(format!(
                "{} query rows in one call (at most {MAX_ROWS})",
                row_ctx.len()
            )));
        }
        let (mut single, mut split, mut longest) = (Vec::new(), Vec::new(), 0usize);
        for (i, &c) in row_ctx.iter().enumerate() {
            if c == 0 {
                return Err(Error::Unsupported(format!("row {i} has an empty context")));
            }
            if c as usize <= PARTITION_SIZE {
                single.push(i as u32);
            } else {
                split.push(i as u32);
                longest = longest.max(c as usize);
            }
        }
        let parts = longest.div_ceil(PARTITION_SIZE);
        if parts > 1024 {
            return Err(Error::Unsupported(format!(
                "context of {longest} tokens (at most {})",
                1024 * PARTITION_SIZE
            )));
        }
        let upload = |ids: Vec<u32>| -> Result<Option<CudaSlice<u32>>, Error> {
            Ok(match ids.is_empty() {
                true => None,
                false => Some(self.stream.clone_htod(&ids)?),
            })
        };
        Ok(RowPlan {
            rows: row_ctx.len(),
            single: upload(single)?,
            split: upload(split)?.map(|ids| (ids, parts)),
        })
    }

    /// `out[r][h] = softmax(q[r][h] · K[ctx]) · V[ctx]` for every row through the block
    /// tables (see `Shape`), launched as `plan` (from `plan_rows` over the same `row_ctx`)
    /// says. Every row's context length must be ≥ 1.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention<T: Element>(
        &self,
        out: &mut CudaSlice<T>,
        q: &CudaSlice<T>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        block_tables: &CudaSlice<u32>,
        row_seq: &CudaSlice<u32>,
        row_ctx: &CudaSlice<u32>,
        plan: &RowPlan,
        s: &Shape,
    ) -> Result<(), Error> {
        supported(s.num_heads, s.num_kv_heads, s.head_size)?;
        if plan.rows != s.rows || !s.block_size.is_power_of_two() {
            return Err(Error::Unsupported(format!(
                "a plan for {} rows with a shape of {} rows, block size {} (a power of two)",
                plan.rows, s.rows, s.block_size
            )));
        }
        let tile = group_tile(s.num_heads / s.num_kv_heads);
        let f = self.function(&format!(
            "paged_attention_{}_{}_g{tile}",
            T::NAME,
            s.head_size
        ))?;
        // One thread block per KV head (per `tile` of its query heads), row and partition.
        let blocks_x = (s.num_kv_heads * (s.num_heads / s.num_kv_heads).div_ceil(tile)) as u32;
        let (nh, kvh, bs, mb) = (
            s.num_heads as i32,
            s.num_kv_heads as i32,
            s.block_size as i32,
            s.max_blocks as i32,
        );
        let launches = plan
            .single
            .iter()
            .map(|ids| (ids, 1))
            .chain(plan.split.iter().map(|(ids, parts)| (ids, *parts)));
        for (ids, parts) in launches {
            let rows = ids.len();
            let partials = if parts > 1 {
                rows * s.num_heads * parts
            } else {
                1
            };
            // SAFETY: every partition of every (row, head) writes its slots, empty ones
            // included (max -inf, sum 0), before the reduction reads them; single-partition
            // launches never touch them.
            let (mut part_out, mut part_max, mut part_sum) = unsafe {
                (
                    self.stream.alloc::<f32>(partials * s.head_size)?,
                    self.stream.alloc::<f32>(partials)?,
                    self.stream.alloc::<f32>(partials)?,
                )
            };
            let cfg = LaunchConfig {
                grid_dim: (blocks_x, rows as u32, parts as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&f);
            b.arg(&mut *out)
                .arg(&mut part_out)
                .arg(&mut part_max)
                .arg(&mut part_sum)
                .arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(block_tables)
                .arg(ids)
                .arg(row_seq)
                .arg(row_ctx)
                .arg(&nh)
                .arg(&kvh)
                .arg(&bs)
                .arg(&mb)
                .arg(&s.scale);
            // SAFETY: argument types and order match the kernel's signature; buffer sizes
            // follow `Shape`, which the caller guarantees matches the buffers, and `ids` are
            // rows of it.
            unsafe { b.launch(cfg) }?;
            if parts > 1 {
                let f = self.function(&format!("paged_attention_reduce_{}", T::NAME))?;
                let (p, hs) = (parts as i32, s.head_size as i32);
                let cfg = LaunchConfig {
                    grid_dim: (s.num_heads as u32, rows as u32, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.stream.launch_builder(&f);
                b.arg(&mut *out)
                    .arg(&part_out)
                    .arg(&part_max)
                    .arg(&part_sum)
                    .arg(ids)
                    .arg(&p)
                    .arg(&hs);
                // SAFETY: as above; the partial buffers were sized for these rows and parts.
                unsafe { b.launch(cfg) }?;
            }
        }
        Ok(())
    }

    /// Scatters this step's K and V (`[tokens][num_kv_heads * head_size]`) into their slots
    /// (`slots[t] = block * block_size + offset`, negative = skip).
    pub fn reshape_and_cache<T: Element>(
        &self,
        key: &CudaSlice<T>,
        value: &CudaSlice<T>,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        slots: &CudaSlice<i64>,
        token_elems: usize,
    ) -> Result<(), Error> {
        if slots.is_empty() {
            return Ok(());
        }
        let f = self.function(&format!("reshape_and_cache_{}", T::NAME))?;
        let te = token_elems as i32;
        let cfg = LaunchConfig {
            grid_dim: (slots.len() as u32, 1, 1),
            block_dim: (token_elems.clamp(32, 1024) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        b.arg(key)
            .arg(value)
            .arg(k_cache)
            .arg(v_cache)
            .arg(slots)
            .arg(&te);
        // SAFETY: matches the kernel's signature; slots index blocks inside the caches.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Copies whole blocks of one layer's K and V: `pairs` holds (src, dst) block numbers
    /// flattened; `block_bytes` is one block's size in bytes (a multiple of 4).
    pub fn copy_blocks<T: Element>(
        &self,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        pairs: &CudaSlice<i64>,
        block_bytes: usize,
    ) -> Result<(), Error> {
        if pairs.len() < 2 {
            return Ok(());
        }
        if !block_bytes.is_multiple_of(4) {
            return Err(Error::Unsupported(format!(
                "blocks of {block_bytes} bytes (copied as 32-bit words)"
            )));
        }
        let f = self.function("copy_blocks")?;
        let words = (block_bytes / 4) as i32;
        let cfg = LaunchConfig {
            grid_dim: ((pairs.len() / 2) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        b.arg(k_cache).arg(v_cache).arg(pairs).arg(&words);
        // SAFETY: the kernel reads the caches as 32-bit words; block numbers are in range.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
