//! `[engine]`: the native engine's KV cache, batching, threads, device and kernel precision.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Bytes of KV cache to allocate (all layers, K and V). Pages are touched lazily, so an idle
    /// gateway does not pay for the whole budget in RSS.
    pub kv_cache_bytes: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences decoded together in one step.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one forward pass; long prompts are chunked.
    pub max_num_batched_tokens: usize,
    /// Fraction of blocks kept free when admitting new sequences, so running ones can grow.
    pub watermark: f32,
    /// Requests waiting for admission beyond this are refused with 503.
    pub max_waiting: usize,
    /// Reuse KV blocks of identical prompt prefixes across requests.
    pub prefix_caching: bool,
    /// Compute threads of this model's engine (0 = one per core).
    pub threads: usize,
    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` (a build with `--features cuda`).
    pub device: ComputeDevice,
    /// Element type of weights, activations and KV cache on CUDA (`auto` = bf16). The CPU path
    /// always computes in f32 over an f16 cache.
    pub dtype: GpuDtype,
    /// Fraction of the GPU's memory this engine may take in all (weights, step workspace, KV
    /// pool); the KV pool gets what is left of it. On CUDA this replaces `kv_cache_bytes`.
    pub gpu_memory_utilization: f32,
    /// Prompt-lookup speculative decoding: the most draft tokens proposed per step by matching
    /// the sequence's last n-gram earlier in its own tokens, verified in one forward (0 = off);
    /// each step sends as many as pay for their rows.
    pub speculative_tokens: usize,
    /// Speculate only while at most this many sequences run: drafts pay when decode is bound
    /// by reading the weights, not in large batches.
    pub speculative_max_seqs: usize,
    /// Bits the CPU batch kernels (decode, drafts, small batches) round activations to before
    /// they meet k-quant weights. Prompt rows take `prompt_precision`.
    pub decode_activation_bits: DecodeBits,
    /// How prompt rows meet quantized weights on the CPU.
    pub prompt_precision: PromptPrecision,
}

/// How prompt rows (prefill) meet quantized weights on the CPU: `auto` takes BF16 AMX tiles
/// where the CPU and OS offer them (2–4× the 16-bit kernels' prefill speed) and `int8`
/// elsewhere, both with a KL divergence from the f32 reference below llama.cpp's on the same
/// file; `int8` rounds k-quant prompt rows' activations to bytes per 256 as llama.cpp's Q8_K
/// and multiplies them as bytes (`vpdpbusd` on AVX-512, 1.5–1.7× the 16-bit kernels;
/// `vpmaddubsw` on AVX2; the 32-element formats keep 16 bits); `int16` keeps 16-bit integer
/// activations (greedy output as the dense-f32 reference's). The kernels take this enum as it
/// is (`engine::quant::tiles`; `lanes`, `lanes8`, `few`, `across`; `prompt_bytes` without
/// AVX-512).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PromptPrecision {
    #[default]
    Auto,
    Int16,
    Int8,
}

/// `decode_activation_bits`: how finely the CPU batch kernels round activations. `16`: greedy
/// output as the dense-f32 reference's. `8`: llama.cpp's rounding for the k-quants (Q8_K) and,
/// on AVX2, for Q4_0/Q4_1/Q5_0/Q5_1 (Q8_0 per 32); each weight byte is multiplied once instead
/// of twice, and the KL divergence from f32 is below llama.cpp's own on the same files (README,
/// "Precision"); Q8_0 rows keep 16 bits. `auto` (the default) takes 8 where bytes cost a step
/// less arithmetic (AVX2 without AVX-512BW, and AVX-512 with VNNI, whose k-quant rows then take
/// `vpdpbusd`) and 16 elsewhere (`engine::quant::ActivationBits::configured`). `8-all`: on
/// AVX2 Q8_0 at 8 bits too, whose KL divergence is above llama.cpp's on Gemma 3
/// (`engine::quant::ActivationBits::Eight`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeBits {
    #[default]
    Auto,
    Eight,
    EightAll,
    Sixteen,
}

impl std::str::FromStr for DecodeBits {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "8" => Ok(Self::Eight),
            "8-all" => Ok(Self::EightAll),
            "16" => Ok(Self::Sixteen),
            _ => Err(format!(
                "decode_activation_bits must be 8, 16 or \"auto\" or \"8-all\" (got {s:?})"
            )),
        }
    }
}

/// A number (`8`, `16`) or a word (`"auto"`, `"8"`, `"8-all"`), as a config file may write
/// either.
impl<'de> Deserialize<'de> for DecodeBits {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Word(String),
            Other(serde::de::IgnoredAny),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Number(n) => n.to_string(),
            Raw::Word(w) => w,
            Raw::Other(_) => "a value of another type".to_string(),
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Where a model's engine computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device {s:?} (expected cpu, cuda or cuda:N)")),
        }
    }
}

impl<'de> Deserialize<'de> for ComputeDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GpuDtype {
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_cache_bytes: 512 << 20,
            block_size: 16,
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            watermark: 0.01,
            max_waiting: 256,
            prefix_caching: true,
            threads: 0,
            device: ComputeDevice::Cpu,
            dtype: GpuDtype::Auto,
            gpu_memory_utilization: 0.9,
            speculative_tokens: 4,
            speculative_max_seqs: 2,
            decode_activation_bits: DecodeBits::default(),
            prompt_precision: PromptPrecision::default(),
        }
    }
}
