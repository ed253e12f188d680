//! From a `--model` argument to a running [`EngineCore`]: resolve the model, read its
//! config, tokenizer and weights, size the KV cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kernels::cpu::matmul::MatmulMode;
use kernels::cpu::CpuBackend;
use kernels::{Backend, KvDtype, KvShape};

use crate::config::ModelConfig;
use crate::fetch;
use crate::gguf::Gguf;
use crate::model::{Model, SafetensorsSource, WeightSource};
use crate::scheduler::{EngineConfig, EngineCore};
use crate::tokenizer::Tokenizer;
use crate::EngineError;

/// Where the engine computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

/// Engine options a user sets (CLI flags); see [`EngineOptions::validate`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub device: Device,
    /// CUDA weights in f32 (`Some(true)`) or bf16; `None`: from `DISAGG_CUDA_WEIGHTS`.
    pub cuda_f32_weights: Option<bool>,
    /// CUDA: size the KV cache so the engine uses this fraction of the device's memory
    /// (weights, activations and KV); `None`: `kv_cache_mib`.
    pub gpu_memory_utilization: Option<f64>,
    /// `--model`: a .gguf file, a Hugging Face directory, or the embedded model's name.
    pub model: String,
    /// CPU threads; 0 means all cores (or `DISAGG_THREADS`).
    pub threads: usize,
    /// Memory for the KV cache.
    pub kv_cache_mib: usize,
    pub kv_dtype: KvDtype,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    /// 0: the model's context length.
    pub max_model_len: usize,
    /// How the CPU multiplies quantized weights (default from `DISAGG_CPU_MATMUL`).
    pub cpu_matmul: MatmulMode,
    /// Keep computed KV blocks for reuse by requests with the same prefix.
    pub prefix_caching: bool,
    /// Host memory for the second tier of the prefix cache (0: none).
    pub host_cache_mib: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: Device::Cpu,
            cuda_f32_weights: None,
            gpu_memory_utilization: None,
            model: fetch::EMBEDDED_NAME.into(),
            threads: 0,
            kv_cache_mib: 512,
            kv_dtype: KvDtype::F16,
            block_size: 16,
            max_num_seqs: 64,
            max_batched_tokens: 512,
            max_model_len: 0,
            cpu_matmul: MatmulMode::from_env(),
            prefix_caching: true,
            host_cache_mib: 0,
        }
    }
}

impl EngineOptions {
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if self.block_size == 0 || self.block_size > 1024 {
            return bad(format!("--block-size must be between 1 and 1024, got {}", self.block_size));
        }
        if let Some(f) = self.gpu_memory_utilization {
            if !(f > 0.0 && f <= 1.0) {
                return bad(format!("--gpu-memory-utilization must be in (0, 1], got {f}"));
            }
            if self.device == Device::Cpu {
                return bad("--gpu-memory-utilization applies to --device cuda:N; on the CPU use --kv-cache-mib".into());
            }
        }
        if self.max_num_seqs == 0 {
            return bad("--max-num-seqs must be at least 1".into());
        }
        if self.max_batched_tokens < self.max_num_seqs {
            return bad(format!(
                "--max-batched-tokens ({}) must be at least --max-num-seqs ({}) so every running sequence can decode",
                self.max_batched_tokens, self.max_num_seqs
            ));
        }
        if self.kv_cache_mib == 0 {
            return bad("--kv-cache-mib must be at least 1".into());
        }
        Ok(())
    }

    pub fn resolved_threads(&self) -> usize {
        if self.threads > 0 {
            return self.threads;
        }
        std::env::var(kernels::env::CPU_THREADS)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
    }
}

/// Where a model comes from, resolved.
pub enum ModelSource {
    Gguf(Gguf),
    HfDir(PathBuf),
    /// `random:NAME[:SEED]` (see [`crate::random`]).
    Random {
        name: String,
        seed: u64,
    },
}

pub fn resolve(model: &str) -> Result<ModelSource, EngineError> {
    if let Some(r) = crate::random::parse(model) {
        let (name, seed) = r?;
        return Ok(ModelSource::Random { name, seed });
    }
    let path = if model.is_empty() || model == fetch::EMBEDDED_NAME || model == "embedded" {
        fetch::embedded_model_path()?
    } else {
        PathBuf::from(model)
    };
    if path.is_dir() {
        if !path.join("config.json").exists() {
            return Err(EngineError::Model(format!(
                "{} is a directory without config.json; pass a .gguf file or a Hugging Face model directory",
                path.display()
            )));
        }
        return Ok(ModelSource::HfDir(path));
    }
    if !path.exists() {
        return Err(EngineError::Model(format!(
            "model '{model}' not found: pass a path to a .gguf file or a Hugging Face directory, or '{}' for the embedded model",
            fetch::EMBEDDED_NAME
        )));
    }
    Ok(ModelSource::Gguf(Gguf::open(&path)?))
}

/// Reads the model's config and tokenizer, not its weights (for the router).
pub fn load_tokenizer(source: &ModelSource) -> Result<(ModelConfig, Tokenizer), EngineError> {
    match source {
        ModelSource::Gguf(g) => {
            let tok = if g.path.with_file_name("tokenizer.json").exists() {
                Tokenizer::from_hf_dir(g.path.parent().unwrap_or(Path::new(".")))?
            } else {
                Tokenizer::from_gguf(g)?
            };
            Ok((ModelConfig::from_gguf(g)?, tok))
        }
        ModelSource::HfDir(dir) => {
            let text = std::fs::read_to_string(dir.join("config.json"))
                .map_err(|e| EngineError::Model(format!("cannot read config.json: {e}")))?;
            Ok((ModelConfig::from_hf_json(&text)?, Tokenizer::from_hf_dir(dir)?))
        }
        ModelSource::Random { name, .. } => {
            let cfg = crate::random::config(name);
            let tok = crate::random::tokenizer(cfg.vocab)?;
            Ok((cfg, tok))
        }
    }
}

/// Reads config, tokenizer and weights onto `backend`.
pub fn load_model<B: Backend>(
    backend: &B,
    source: &ModelSource,
    matrix_bytes: impl Fn(&B::Linear) -> usize,
) -> Result<(Model<B>, Tokenizer), EngineError> {
    let (cfg, tokenizer) = load_tokenizer(source)?;
    let weights: Box<dyn WeightSource + '_> = match source {
        ModelSource::Gguf(g) => Box::new(GgufRef(g)),
        ModelSource::HfDir(dir) => Box::new(SafetensorsSource::open(dir)?),
        ModelSource::Random { seed, .. } => Box::new(crate::random::RandomSource { cfg: cfg.clone(), seed: *seed }),
    };
    if tokenizer.vocab_size() > cfg.vocab {
        return Err(EngineError::Model(format!(
            "the tokenizer has {} tokens but the model only {}; they do not belong together",
            tokenizer.vocab_size(),
            cfg.vocab
        )));
    }
    let model = Model::load(backend, cfg, weights.as_ref(), matrix_bytes)?;
    Ok((model, tokenizer))
}

struct GgufRef<'a>(&'a Gguf);

impl WeightSource for GgufRef<'_> {
    fn matrix(&self, name: &str) -> Result<(kernels::quant::GgmlType, usize, usize, Vec<u8>), EngineError> {
        self.0.matrix(name)
    }
    fn vector(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        self.0.vector(name)
    }
    fn has(&self, name: &str) -> bool {
        self.0.has(name)
    }
}

/// Builds an engine on the CUDA backend (`opts.device` must be `Cuda`).
pub fn cuda_engine(opts: &EngineOptions) -> Result<EngineCore<kernels::cuda::CudaBackend>, EngineError> {
    opts.validate()?;
    let Device::Cuda(ordinal) = opts.device else {
        return Err(EngineError::InvalidRequest("cuda_engine needs --device cuda:N".into()));
    };
    let bf16 = match opts.cuda_f32_weights {
        Some(f32) => !f32,
        None => kernels::cuda::CudaBackend::bf16_weights_from_env().map_err(|e| EngineError::Model(e.to_string()))?,
    };
    let backend = kernels::cuda::CudaBackend::new(ordinal, bf16).map_err(|e| EngineError::Model(e.to_string()))?;
    let mem = || backend.mem_info().map_err(|e| EngineError::Model(e.to_string()));
    // What is free before the weights: the engine's own use is measured from here, so
    // that another process on the device (a second worker of `disagg up`) is not
    // counted against this engine's fraction.
    let free_at_start = if opts.gpu_memory_utilization.is_some() { mem()?.0 } else { 0 };
    let source = resolve(&opts.model)?;
    let (model, tokenizer) = load_model(&backend, &source, |l| l.n_bytes())?;
    let Some(frac) = opts.gpu_memory_utilization else {
        return build_engine(backend, model, tokenizer, opts);
    };
    // The memory plan: weights are loaded; activations are estimated from the
    // workspace's shape; the KV cache takes what the fraction leaves.
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let (free, total) = mem()?;
    let c = &model.cfg;
    let (t, s) = (opts.max_batched_tokens as f64, opts.max_num_seqs as f64);
    let qkv = ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim) as f64;
    let per_token = 2.0 * c.hidden as f64 + qkv + (c.n_heads * c.head_dim) as f64 + 3.0 * c.ffn as f64;
    let widest = c.ffn.max(c.hidden).max(c.n_heads * c.head_dim) as f64;
    let activations = 4.0 * (t * per_token + s * (2.0 * c.hidden as f64 + c.vocab as f64)) + 2.0 * t * widest;
    // cuBLAS workspace, step metadata and attention scratch.
    let margin = 512.0 * (1u64 << 20) as f64;
    let plan =
        GpuMemPlan { frac, total, free_at_start, free, weights: model.weight_bytes, activations: activations + margin };
    let kv = plan.kv_bytes();
    let block = (c.n_layers * 2 * opts.block_size * c.n_kv_heads * c.head_dim * opts.kv_dtype.bytes()) as f64;
    if kv < block {
        let advice = if plan.free_bound() {
            format!(
                "only {:.0} MiB of the device is free (the CUDA context and other processes hold {:.0} MiB): free \
                 it, lower the other engines' --gpu-memory-utilization, or run this engine on another device",
                mib(free as f64),
                mib(plan.others() as f64)
            )
        } else {
            "raise --gpu-memory-utilization (0.9 unless given; `disagg up` divides it among its workers) or lower \
             those flags"
                .to_string()
        };
        return Err(EngineError::Model(format!(
            "out of GPU memory for the KV cache: --gpu-memory-utilization {frac} of {:.0} MiB leaves {:.0} MiB after \
             this engine's weights ({:.0} MiB) and activations (~{:.0} MiB for --max-batched-tokens {} / \
             --max-num-seqs {}); {advice}",
            mib(total as f64),
            mib(kv.max(0.0)),
            mib(plan.own() as f64),
            mib(plan.activations),
            opts.max_batched_tokens,
            opts.max_num_seqs
        )));
    }
    if plan.free_bound() {
        tracing::warn!(
            free_mib = mib(free as f64) as u64,
            others_mib = mib(plan.others() as f64) as u64,
            "the KV cache is held to the device's free memory, below --gpu-memory-utilization {frac}"
        );
    }
    tracing::info!(
        total_mib = mib(total as f64) as u64,
        weights_mib = mib(plan.own() as f64) as u64,
        others_mib = mib(plan.others() as f64) as u64,
        activations_mib = mib(plan.activations) as u64,
        kv_cache_mib = mib(kv) as u64,
        "GPU memory plan at --gpu-memory-utilization {frac}"
    );
    let sized = EngineOptions { kv_cache_mib: (kv / (1u64 << 20) as f64) as usize, ..opts.clone() };
    build_engine(backend, model, tokenizer, &sized)
}

/// The KV cache's share of a device under `--gpu-memory-utilization`, as vLLM reads the
/// flag: the fraction is this engine's own (two engines on one device at 0.45 each both
/// fit), so its budget is `frac × total`, less what its weights took (free memory before
/// them less free memory after) and its activations; and never more than is free now,
/// less the activations. (The CUDA context and the backend's start-up buffers, made
/// before the first reading, are not counted in the budget.)
struct GpuMemPlan {
    frac: f64,
    total: usize,
    /// Free bytes before the weights were loaded, and now.
    free_at_start: usize,
    free: usize,
    /// The weights' bytes as the model counts them: a floor under the measured figure,
    /// which another process freeing memory during the load would lower.
    weights: usize,
    /// Activations and scratch still to allocate, bytes.
    activations: f64,
}

impl GpuMemPlan {
    /// Bytes this engine holds: its weights.
    fn own(&self) -> usize {
        self.free_at_start.saturating_sub(self.free).max(self.weights)
    }
    /// Bytes held before the weights: the CUDA context and other processes.
    fn others(&self) -> usize {
        self.total.saturating_sub(self.free_at_start)
    }
    fn budget(&self) -> f64 {
        self.frac * self.total as f64 - self.own() as f64 - self.activations
    }
    fn room(&self) -> f64 {
        self.free as f64 - self.activations
    }
    /// Bytes for the KV cache (below zero: none).
    fn kv_bytes(&self) -> f64 {
        self.budget().min(self.room())
    }
    /// Whether the device's free memory, not the fraction, limits the cache.
    fn free_bound(&self) -> bool {
        self.room() < self.budget()
    }
}

/// Builds the engine on `opts.device` and runs it on its own thread.
pub fn spawn_engine(opts: &EngineOptions, max_in_flight: usize) -> Result<crate::handle::EngineHandle, EngineError> {
    use crate::handle::EngineHandle;
    Ok(match opts.device {
        Device::Cpu => EngineHandle::spawn(cpu_engine(opts)?, max_in_flight),
        Device::Cuda(_) => EngineHandle::spawn(cuda_engine(opts)?, max_in_flight),
    })
}

/// Builds an engine on the CPU backend.
pub fn cpu_engine(opts: &EngineOptions) -> Result<EngineCore<CpuBackend>, EngineError> {
    opts.validate()?;
    let backend = CpuBackend::with_options(opts.resolved_threads(), kernels::cpu::Isa::current(), opts.cpu_matmul);
    let source = resolve(&opts.model)?;
    let (model, tokenizer) = load_model(&backend, &source, |l| l.n_bytes())?;
    build_engine(backend, model, tokenizer, opts)
}

/// Sizes the KV cache from the options and assembles the engine.
pub fn build_engine<B: Backend>(
    mut backend: B,
    model: Model<B>,
    tokenizer: Tokenizer,
    opts: &EngineOptions,
) -> Result<EngineCore<B>, EngineError> {
    let c = &model.cfg;
    let mut shape = KvShape {
        n_layers: c.n_layers,
        n_blocks: 0,
        block_size: opts.block_size,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        dtype: opts.kv_dtype,
    };
    shape.n_blocks = (opts.kv_cache_mib << 20) / (shape.n_layers * shape.block_bytes_per_layer());
    if shape.n_blocks == 0 {
        return Err(EngineError::InvalidRequest(format!(
            "--kv-cache-mib {} is smaller than one KV block ({} KiB); raise it",
            opts.kv_cache_mib,
            (shape.n_layers * shape.block_bytes_per_layer()) >> 10
        )));
    }
    let max_model_len = if opts.max_model_len == 0 { c.max_context } else { opts.max_model_len.min(c.max_context) };
    // Scratch and activations first, so that the KV cache is the last, sized allocation
    // and no step allocates later.
    let limits = model.step_limits(opts.max_batched_tokens, opts.max_num_seqs, max_model_len, opts.block_size);
    backend.reserve(&limits).map_err(|e| EngineError::Model(e.to_string()))?;
    let ws = model.workspace(&backend, opts.max_batched_tokens, opts.max_num_seqs)?;
    let kv = backend.kv_cache(shape).map_err(|e| EngineError::Model(e.to_string()))?;
    let cfg = EngineConfig {
        max_num_seqs: opts.max_num_seqs,
        max_batched_tokens: opts.max_batched_tokens,
        max_model_len,
        block_size: opts.block_size,
        n_blocks: shape.n_blocks,
        prefix_caching: opts.prefix_caching,
        host_cache_blocks: (opts.host_cache_mib << 20) / (shape.n_layers * shape.block_bytes_per_layer()),
    };
    Ok(EngineCore::new(backend, model, Arc::new(tokenizer), cfg, ws, kv))
}

#[cfg(test)]
mod tests {
    use super::GpuMemPlan;

    const GIB: usize = 1 << 30;

    #[test]
    fn gpu_memory_fraction_is_the_engines_own() {
        // One engine alone on a 140 GiB device: 1 GiB of context, 16 GiB of weights.
        let alone = GpuMemPlan {
            frac: 0.9,
            total: 140 * GIB,
            free_at_start: 139 * GIB,
            free: 123 * GIB,
            weights: 15 * GIB,
            activations: 3.0 * GIB as f64,
        };
        assert_eq!(alone.own(), 16 * GIB);
        assert!(!alone.free_bound());
        assert_eq!(alone.kv_bytes(), 0.9 * (140 * GIB) as f64 - (19 * GIB) as f64);
        // A second engine at 0.45 after a first took 0.45 (63 GiB): its share does not
        // count the first's memory.
        let second = GpuMemPlan { frac: 0.45, free_at_start: 76 * GIB, free: 60 * GIB, ..alone };
        assert!(!second.free_bound());
        assert_eq!(second.kv_bytes(), 0.45 * (140 * GIB) as f64 - (19 * GIB) as f64);
        // At 0.9 after the first, the free memory is the limit, and the plan says so.
        let greedy = GpuMemPlan { frac: 0.9, ..second };
        assert!(greedy.free_bound());
        assert_eq!(greedy.kv_bytes(), (57 * GIB) as f64);
        assert_eq!(greedy.others(), 64 * GIB);
        // Too little left for anything: below zero.
        let full = GpuMemPlan { free_at_start: 18 * GIB, free: 2 * GIB, ..greedy };
        assert!(full.kv_bytes() < 0.0);
        // Another process freed 10 GiB during the load: the measure says 6 GiB of
        // weights, the model 15; the budget counts 15.
        let freed = GpuMemPlan { free_at_start: 129 * GIB, free: 123 * GIB, ..alone };
        assert_eq!(freed.own(), 15 * GIB);
        assert_eq!(freed.kv_bytes(), 0.9 * (140 * GIB) as f64 - (18 * GIB) as f64);
    }
}
