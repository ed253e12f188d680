//! The CUDA backend (issue "CUDA backend"): opening a device with clear errors where
//! there is none, NVRTC compilation of `ops.cu` at start with an on-disk cache keyed by
//! source hash and GPU architecture, device buffers, the row ops (RMSNorm, SiLU·gate,
//! embedding), each tested against the CPU op on the GPU machine
//! (`DISAGG_TEST_CUDA=1 cargo test -p kernels --test cuda_ops`), and [`CudaBackend`]:
//! the whole model on the device (cuBLAS GEMMs, RoPE + KV write, paged attention).
//!
//! cudarc loads libcuda and libnvrtc at run time, so this compiles and the CPU path
//! runs on machines without CUDA.

pub mod backend;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use backend::{deep_gemv_fits, CudaBackend, CudaKv, CudaLinear};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use sha2::Digest;

use crate::KernelError;

const OPS_SRC: &str = include_str!("ops.cu");

fn dev_err(e: impl std::fmt::Display) -> KernelError {
    KernelError::Device(e.to_string())
}

/// One CUDA device with the kernels of `ops.cu` loaded.
pub struct CudaDevice {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub arch: (i32, i32),
    /// The module was built for sm_90a, so the warpgroup-MMA (wgmma) kernels can run.
    pub wgmma: bool,
    /// The most blocks of a thread block cluster the keys-on-M decode kernels may be
    /// launched in (sm_90: 16 where the non-portable size is allowed, else 8; 0: no
    /// clusters).
    pub km_cluster_max: usize,
    /// Kernels whose dynamic shared memory exceeds what a block may opt into on this GPU
    /// (e.g. the keys-on-M kernel's three head_dim-128 stages on sm_86/89): never launched.
    too_big: Vec<&'static str>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rms_norm: CudaFunction,
    silu_mul: CudaFunction,
    embed: CudaFunction,
    /// Every kernel of `ops.cu` by name.
    funcs: HashMap<&'static str, CudaFunction>,
}

/// The kernels of `ops.cu`.
const KERNELS: &[&str] = &[
    "rms_norm_rows",
    "rms_norm_bf16_rows",
    "splitk_residual_norm_bf16",
    "silu_mul_rows",
    "silu_mul_rows4",
    "silu_mul_rows4_bf16",
    "silu_mul_rows8_bf16_bf16",
    "embed_rows",
    "embed_rows_bf16",
    "cast_f32_bf16",
    "gather_rows",
    "rope_write_kv_f16",
    "rope_write_kv_f32",
    "rope_write_kv_fp8",
    "rope_write_kv_groups_f16",
    "rope_write_kv_groups_f32",
    "rope_write_kv_groups_fp8",
    "rope_write_k_f16",
    "rope_write_k_f16_loops",
    GEMV_NORM_ROPE_M1,
    GEMV_STATS_M1,
    GEMV_STATS_U4_M1,
    GEMV_PNORM_ROPE_U3_M1,
    "attention_f16",
    "attention_f32",
    "attention_fp8",
    "attention_split_f16",
    "attention_split_f32",
    "attention_split_fp8",
    "attention_merge",
    "kv_fp8_to_f16_blocks",
    "argmax_rows",
    "feed_ids",
    "argmax_rows_split",
    "unpack_step",
    "stream_read",
    "sample_rows",
];

/// `op_profile`'s entry (always kept, profiling or not) for the GPU's time from the end of
/// one step's forward pass to the start of the next one's (CUDA events): the sampling
/// and copies between them, and the time the GPU waits for the host (outputs,
/// scheduling, the next step's metadata) unless async scheduling hides it.
pub const STEP_GAP_OP: &str = "gpu_between_steps";

/// Most tokens the GEMV kernels take (`…_m1` to `…_m8`: one kernel per token count;
/// by default only 1 uses them, see `DISAGG_CUDA_GEMV_MAX_TOKENS`), and the warps of
/// their blocks (each warp reads two rows of W).
pub(crate) const GEMV_MAX_TOKENS: usize = 8;
pub(crate) const GEMV_DEFAULT_MAX_TOKENS: usize = 1;
pub(crate) const GEMV_WARPS: usize = 8;
/// The elements of x whose squares one partial sum of a prenormed GEMV's input holds
/// (ops.cu `NORM_SPAN`: one GEMV block's rows).
pub(crate) const NORM_SPAN: usize = 2 * GEMV_WARPS;
/// The GEMV kernels by kind (plain, RMSNorm first, RMSNorm first and SiLU·gate after)
/// and token count.
pub(crate) const GEMV_BF16: [&str; GEMV_MAX_TOKENS] = [
    "gemv_bf16_m1",
    "gemv_bf16_m2",
    "gemv_bf16_m3",
    "gemv_bf16_m4",
    "gemv_bf16_m5",
    "gemv_bf16_m6",
    "gemv_bf16_m7",
    "gemv_bf16_m8",
];
pub(crate) const GEMV_NORM_BF16: [&str; GEMV_MAX_TOKENS] = [
    "gemv_norm_bf16_m1",
    "gemv_norm_bf16_m2",
    "gemv_norm_bf16_m3",
    "gemv_norm_bf16_m4",
    "gemv_norm_bf16_m5",
    "gemv_norm_bf16_m6",
    "gemv_norm_bf16_m7",
    "gemv_norm_bf16_m8",
];
pub(crate) const GEMV_NORM_SILU_BF16: [&str; GEMV_MAX_TOKENS] = [
    "gemv_norm_silu_bf16_m1",
    "gemv_norm_silu_bf16_m2",
    "gemv_norm_silu_bf16_m3",
    "gemv_norm_silu_bf16_m4",
    "gemv_norm_silu_bf16_m5",
    "gemv_norm_silu_bf16_m6",
    "gemv_norm_silu_bf16_m7",
    "gemv_norm_silu_bf16_m8",
];

/// The skinny GEMM kernels for 2–8 tokens (ops.cu `skinny_bf16_t1_s{S}`: one n8 tile),
/// by key splits 1, 2, 4, 8 (a thread-block cluster, so sm_90 only).
pub(crate) const SKINNY_KERNELS: [&str; 4] =
    ["skinny_bf16_t1_s1", "skinny_bf16_t1_s2", "skinny_bf16_t1_s4", "skinny_bf16_t1_s8"];

/// Rows of W per skinny GEMM block (ops.cu `SK_WARPS` × 32).
pub(crate) const SKINNY_ROWS: usize = 128;

/// Dynamic shared memory of a skinny GEMM block (ops.cu `SK_SMEM_BYTES(1, SK_WARPS)`):
/// four stages of 64 columns of its rows and 8 tokens, which its f32 partial sums reuse.
pub(crate) fn skinny_smem_bytes() -> usize {
    let stages = 4 * (SKINNY_ROWS + 8) * 64 * 2;
    let partials = 8 * (SKINNY_ROWS + 4) * 4;
    stages.max(partials)
}

/// The one-token QKV GEMV with RoPE and the KV write in its epilogue.
pub(crate) const GEMV_NORM_ROPE_M1: &str = "gemv_norm_rope_bf16_m1";

/// The one-token residual GEMV that leaves the next GEMV's RMSNorm inputs (x · its
/// weight, the sums of x² per [`NORM_SPAN`] elements: ops.cu EPI_STATS), and the one-token GEMVs
/// that take them (NORM_PART) in place of [`GEMV_NORM_BF16`], [`GEMV_NORM_SILU_BF16`] and
/// [`GEMV_NORM_ROPE_M1`].
pub(crate) const GEMV_STATS_M1: &str = "gemv_stats_bf16_m1";
/// [`GEMV_STATS_M1`] with four loads per row in flight at two blocks per SM
/// (`DISAGG_CUDA_GEMV_DEEP`; [`deep_gemv_fits`]).
pub(crate) const GEMV_STATS_U4_M1: &str = "gemv_stats_u4_bf16_m1";
/// `gemv_pnorm_rope_bf16_m1` (the prenormed QKV GEMV with RoPE) with three loads per row
/// in flight at three blocks per SM (`DISAGG_CUDA_GEMV_DEEP`; [`deep_gemv_fits`]).
pub(crate) const GEMV_PNORM_ROPE_U3_M1: &str = "gemv_pnorm_rope_u3_bf16_m1";
pub(crate) const GEMV_PNORM_M1: [&str; 3] =
    ["gemv_pnorm_bf16_m1", "gemv_pnorm_silu_bf16_m1", "gemv_pnorm_rope_bf16_m1"];

/// The one-token GEMV kernels without the software pipelining of their loads
/// (`DISAGG_CUDA_GEMV_PIPE=0`), [plain, RMSNorm, RMSNorm + SiLU·gate].
pub(crate) const GEMV_FLAT_M1: [&str; 3] =
    ["gemv_bf16_m1_flat", "gemv_norm_bf16_m1_flat", "gemv_norm_silu_bf16_m1_flat"];

/// The flash-attention kernels and their head_dim.
pub(crate) const FLASH_KERNELS: [(&str, usize); 25] = [
    ("flash_attn_f16_d64", 64),
    ("flash_attn_f16_d128", 128),
    ("flash_decode_f16_d64", 64),
    ("flash_decode_f16_d128", 128),
    ("flash_attn_lds_f16_d64", 64),
    ("flash_attn_lds_f16_d128", 128),
    ("flash_decode_lds_f16_d64", 64),
    ("flash_decode_lds_f16_d128", 128),
    ("flash_attn_fx_f16_d64", 64),
    ("flash_attn_fx_f16_d128", 128),
    ("flash_decode_fx_f16_d64", 64),
    ("flash_decode_fx_f16_d128", 128),
    ("flash_attn_sa_f16_d64", 64),
    ("flash_attn_sa_f16_d128", 128),
    ("flash_attn_sa3_f16_d128", 128),
    ("flash_decode_sa_f16_d64", 64),
    ("flash_decode_sa_f16_d128", 128),
    ("flash_attn_wg_f16_d128", 128),
    ("flash_attn_wg3_f16_d128", 128),
    ("flash_attn_pp_f16_d128", 128),
    ("flash_attn_ppg_f16_d128", 128),
    ("flash_decode_km_f16_d64", 64),
    ("flash_decode_km_f16_d128", 128),
    ("flash_decode_km_fp8_d64", 64),
    ("flash_decode_km_fp8_d128", 128),
];

/// Whether `kernel` is one of the keys-on-M decode kernels (`flash_decode_km_*`).
pub(crate) fn is_km_kernel(kernel: &str) -> bool {
    kernel.starts_with("flash_decode_km")
}

/// Whether `kernel` is the warp-specialized prefill kernel (`flash_attn_pp_*`: 384
/// threads, tiles of up to 128 rows).
pub(crate) fn is_pp_kernel(kernel: &str) -> bool {
    kernel.starts_with("flash_attn_pp")
}

/// Threads of a flash-attention block: four warps, or three warpgroups for the
/// warp-specialized prefill kernel.
pub(crate) fn flash_block_threads(kernel: &str) -> usize {
    if is_pp_kernel(kernel) {
        384
    } else {
        128
    }
}

/// Dynamic shared memory of a flash-attention block: two stages of a 64-key K and V
/// tile, rows of head_dim + 8 halves (`FA_SMEM_BYTES` in ops.cu); the keys-on-M decode
/// kernels (`flash_decode_km_*`) three (`KM_SMEM_BYTES(HD, KM_STAGES)`); the
/// warp-specialized prefill kernel three of 128-key tiles, unpadded, with its alignment
/// and mbarriers (`PP_SMEM_BYTES`); the FP8 keys-on-M kernels three stages of the
/// bytes as stored, rows of head_dim + 16 (`KM_SMEM_BYTES_FP8`).
pub(crate) fn flash_smem_bytes(kernel: &str, head_dim: usize) -> usize {
    if is_pp_kernel(kernel) {
        return 3 * 2 * 128 * head_dim * 2 + 1024 + 16 * 3; // = PP_SMEM_BYTES
    }
    if kernel.starts_with("flash_decode_km_fp8") {
        return 3 * 2 * 64 * (head_dim + 16);
    }
    let stages = if is_km_kernel(kernel) { 3 } else { 2 };
    stages * 2 * 64 * (head_dim + 8) * 2
}

/// Where compiled PTX is cached: `$DISAGG_CACHE/ptx` (default `~/.cache/disagg/ptx`).
fn ptx_cache_dir() -> PathBuf {
    let base = std::env::var_os(crate::env::CACHE_DIR).map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")).join(".cache/disagg")
    });
    base.join("ptx")
}

/// PTX for `src` on `arch`, from the cache or compiled by NVRTC (and cached); with
/// `specific`, for the arch-specific target (`sm_90a`: the warpgroup MMAs of the flash
/// prefill kernel exist only there).
fn ptx_for(src: &str, arch: (i32, i32), specific: bool) -> Result<Ptx, KernelError> {
    let suffix = if specific { "a" } else { "" };
    let arch_name: &'static str = Box::leak(format!("sm_{}{}{suffix}", arch.0, arch.1).into_boxed_str());
    let mut h = sha2::Sha256::new();
    h.update(src.as_bytes());
    h.update(arch_name.as_bytes());
    let key = hex::encode(h.finalize());
    let path = ptx_cache_dir().join(format!("{key}.ptx"));
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(Ptx::from_src(text));
    }
    // SAFETY: only asks the loader whether the library exists.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::Device("NVRTC (libnvrtc.so) was not found; install the CUDA toolkit's NVRTC".into()));
    }
    let opts = CompileOptions { arch: Some(arch_name), ..Default::default() };
    let ptx = compile_ptx_with_opts(src, opts).map_err(|e| dev_err(format!("compiling CUDA kernels: {e}")))?;
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}

/// Most parameters a kernel launched through [`Launch`] takes.
const MAX_KERNEL_PARAMS: usize = 24;

/// One kernel parameter as the 8-byte word [`Launch`] passes: a device buffer's address,
/// or a 4- or 8-byte scalar (little-endian, so a 4-byte one is read from the word's
/// first bytes).
pub(crate) trait KernelParam {
    fn word(self, st: &CudaStream) -> u64;
}
impl<T> KernelParam for &CudaSlice<T> {
    fn word(self, st: &CudaStream) -> u64 {
        self.device_ptr(st).0
    }
}
impl<T> KernelParam for &cudarc::driver::CudaView<'_, T> {
    fn word(self, st: &CudaStream) -> u64 {
        self.device_ptr(st).0
    }
}
impl<T> KernelParam for &mut CudaSlice<T> {
    fn word(self, st: &CudaStream) -> u64 {
        self.device_ptr_mut(st).0
    }
}
macro_rules! scalar_param {
    ($($t:ty => $w:expr),*) => {$(
        impl KernelParam for &$t {
            fn word(self, _: &CudaStream) -> u64 {
                let f: fn($t) -> u64 = $w;
                f(*self)
            }
        }
    )*};
}
scalar_param!(i32 => |v| v as u32 as u64, u32 => |v| v as u64, f32 => |v| v.to_bits() as u64,
    i64 => |v| v as u64, u64 => |v| v);

/// A launch of one of `ops.cu`'s kernels through `cuLaunchKernelEx`, built as cudarc's
/// `LaunchArgs` is (`arg`, then `launch`), which can carry programmatic dependent launch
/// (sm_90+, `DISAGG_CUDA_PDL`): the kernel is then scheduled as the one before it on the
/// stream ends, before that one's writes are flushed, and waits for them in its own code
/// (ops.cu `pdl_wait`), so only kernels that do are launched this way. Inside a captured
/// graph the dependency becomes a programmatic edge.
pub(crate) struct Launch<'a> {
    st: &'a CudaStream,
    func: cudarc::driver::sys::CUfunction,
    words: [u64; MAX_KERNEL_PARAMS],
    n: usize,
    /// Thread block cluster dimensions (sm_90); (1, 1, 1): none.
    cluster: (u32, u32, u32),
}

impl<'a> Launch<'a> {
    pub(crate) fn new(st: &'a CudaStream, func: &CudaFunction) -> Launch<'a> {
        Launch { st, func: func.cu_function(), words: [0; MAX_KERNEL_PARAMS], n: 0, cluster: (1, 1, 1) }
    }

    /// Launches the grid as thread block clusters of `dims` blocks (sm_90; each grid
    /// dimension a multiple of the cluster's; more than 8 blocks need the kernel's
    /// non-portable cluster size attribute).
    pub(crate) fn cluster(&mut self, dims: (u32, u32, u32)) -> &mut Self {
        self.cluster = dims;
        self
    }

    pub(crate) fn arg(&mut self, p: impl KernelParam) -> &mut Self {
        assert!(self.n < MAX_KERNEL_PARAMS, "a kernel of more than {MAX_KERNEL_PARAMS} parameters");
        self.words[self.n] = p.word(self.st);
        self.n += 1;
        self
    }

    /// Queues the kernel on the stream; with `pdl`, as a programmatic dependent launch.
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the parameters must match the kernel's in number,
    /// order and type, and every buffer must hold what the kernel reads and writes. With
    /// `pdl`, the kernel must call `pdl_wait` before it touches memory that another kernel
    /// writes.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig, pdl: bool) -> Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        self.st.context().bind_to_thread()?;
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_KERNEL_PARAMS];
        for (p, w) in params.iter_mut().zip(self.words.iter_mut()).take(self.n) {
            *p = (w as *mut u64).cast();
        }
        // SAFETY: a plain C struct for which all zeros is a valid value.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n_attrs = 0;
        if pdl {
            let a = &mut attrs[n_attrs];
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if self.cluster != (1, 1, 1) {
            attrs[n_attrs] = cluster_attr(self.cluster);
            n_attrs += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.st.cu_stream(),
            attrs: if n_attrs > 0 { attrs.as_mut_ptr() } else { std::ptr::null_mut() },
            numAttrs: n_attrs as u32,
        };
        // SAFETY: the function belongs to this stream's context; `params` points at
        // `self.n` live words, one per kernel parameter (the caller's contract above).
        unsafe { sys::cuLaunchKernelEx(&config, self.func, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }
}

/// The launch attribute for thread block clusters of `dims` blocks (sm_90).
fn cluster_attr(dims: (u32, u32, u32)) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys;
    // SAFETY: a plain C struct for which all zeros is a valid value.
    let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    a.value.clusterDim.x = dims.0;
    a.value.clusterDim.y = dims.1;
    a.value.clusterDim.z = dims.2;
    a
}

/// How many blocks of `func` (`threads` each, `smem` bytes of dynamic shared memory) the
/// GPU holds at once when launched as clusters of `size` blocks along z: the driver's
/// count of co-resident clusters times `size` (`cuOccupancyMaxActiveClusters`). A cluster's
/// blocks must share a GPC, so this can be fewer than the blocks per SM times the SMs
/// (`None`: the driver cannot say).
pub(crate) fn cluster_resident_blocks(
    st: &CudaStream,
    func: &CudaFunction,
    threads: u32,
    smem: u32,
    size: u32,
) -> Option<usize> {
    use cudarc::driver::sys;
    st.context().bind_to_thread().ok()?;
    let mut attr = cluster_attr((1, 1, size));
    let config = sys::CUlaunchConfig {
        gridDimX: 1,
        gridDimY: 1,
        gridDimZ: size,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: st.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `func` belongs to this stream's context; `config` and its one attribute
    // outlive the call.
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &config) }.result().ok()?;
    (n > 0).then(|| n as usize * size as usize)
}

impl CudaDevice {
    /// The device's free and total memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), KernelError> {
        self.ctx.mem_get_info().map_err(dev_err)
    }

    /// Opens `cuda:ordinal`; the error says what is missing and what to use instead.
    pub fn open(ordinal: usize) -> Result<CudaDevice, KernelError> {
        // SAFETY: only asks the loader whether the library exists (CudaContext::new
        // panics without it).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::Device(format!(
                "--device cuda:{ordinal}: no CUDA driver (libcuda.so) on this machine; use --device cpu"
            )));
        }
        let n = CudaContext::device_count().map_err(dev_err)? as usize;
        if ordinal >= n {
            return Err(KernelError::Device(format!(
                "--device cuda:{ordinal}: this machine has {n} CUDA device(s) (cuda:0 … cuda:{})",
                n.saturating_sub(1)
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(dev_err)?;
        let arch = ctx.compute_capability().map_err(dev_err)?;
        let name = ctx.name().map_err(dev_err)?;
        // sm_90 builds for sm_90a (wgmma); an NVRTC older than CUDA 12.0 does not know that
        // target, and then the module is built for sm_90 and the wgmma kernels stay unused.
        let (ptx, wgmma) = match arch {
            (9, 0) => match ptx_for(OPS_SRC, arch, true) {
                Ok(p) => (p, true),
                Err(e) => {
                    tracing::warn!(error = %e, "sm_90a kernels did not compile; building for sm_90 without wgmma");
                    (ptx_for(OPS_SRC, arch, false)?, false)
                }
            },
            _ => (ptx_for(OPS_SRC, arch, false)?, false),
        };
        let module = ctx.load_module(ptx).map_err(dev_err)?;
        // All work goes through one created stream (the legacy default stream cannot be
        // captured into a graph), so cudarc's cross-stream event tracking has nothing to
        // order; off, it records no events that a graph capture would trip on.
        // SAFETY: every buffer of this context is used on this one stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(dev_err)?;
        let f = |n: &str| module.load_function(n).map_err(dev_err);
        let mut funcs = HashMap::new();
        let gemv = [GEMV_BF16, GEMV_NORM_BF16, GEMV_NORM_SILU_BF16];
        let flash = FLASH_KERNELS.iter().map(|(k, _)| k);
        let skinny = SKINNY_KERNELS.iter();
        for &k in KERNELS
            .iter()
            .chain(gemv.iter().flatten())
            .chain(&GEMV_FLAT_M1)
            .chain(&GEMV_PNORM_M1)
            .chain(flash)
            .chain(skinny)
        {
            funcs.insert(k, f(k)?);
        }
        // Dynamic shared memory past the default 48 KiB: the flash kernels' K/V tiles at
        // head_dim 128 (sm_80+) and the skinny GEMMs' ring of stages (68 KiB, sm_90); the
        // backend never launches either on older GPUs, nor a kernel that needs more than
        // this GPU lets a block opt into (listed in `too_big`).
        let flash_kernels = if arch.0 >= 8 { &FLASH_KERNELS[..] } else { &[] };
        let skinny_kernels = if arch.0 >= 9 { &SKINNY_KERNELS[..] } else { &[] };
        let big_smem = flash_kernels
            .iter()
            .map(|&(k, hd)| (k, flash_smem_bytes(k, hd)))
            .chain(skinny_kernels.iter().map(|&k| (k, skinny_smem_bytes())));
        let optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(dev_err)? as usize;
        let mut too_big = Vec::new();
        for (k, bytes) in big_smem {
            if bytes > optin {
                too_big.push(k);
                continue;
            }
            funcs[k]
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(dev_err)?;
        }
        // Clusters of up to 16 blocks (8 are portable) for the keys-on-M kernels' splits.
        let km_cluster_max = if arch.0 >= 9 {
            let wide = FLASH_KERNELS.iter().filter(|(k, _)| is_km_kernel(k)).all(|(k, _)| {
                funcs[k]
                    .set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                        1,
                    )
                    .is_ok()
            });
            if wide {
                16
            } else {
                8
            }
        } else {
            0
        };
        Ok(CudaDevice {
            funcs,
            ordinal,
            name,
            arch,
            wgmma,
            km_cluster_max,
            too_big,
            stream,
            rms_norm: f("rms_norm_rows")?,
            silu_mul: f("silu_mul_rows")?,
            embed: f("embed_rows")?,
            ctx,
        })
    }

    /// Whether `kernel`'s dynamic shared memory fits what a block may use on this GPU.
    pub fn smem_fits(&self, kernel: &str) -> bool {
        !self.too_big.contains(&kernel)
    }

    pub fn describe(&self) -> String {
        format!("cuda:{} {} (sm_{}{})", self.ordinal, self.name, self.arch.0, self.arch.1)
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, KernelError> {
        self.stream.clone_htod(host).map_err(dev_err)
    }

    pub fn download(&self, dev: &CudaSlice<f32>) -> Result<Vec<f32>, KernelError> {
        self.stream.clone_dtoh(dev).map_err(dev_err)
    }

    pub fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, KernelError> {
        self.stream.alloc_zeros::<f32>(n).map_err(dev_err)
    }

    fn check(cond: bool, what: &str) -> Result<(), KernelError> {
        if cond {
            Ok(())
        } else {
            Err(KernelError::Shape(what.into()))
        }
    }

    /// `out[r] = x[r] / rms(x[r]) * w` for `n` rows of `dim`.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        n: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        Self::check(x.len() >= n * dim && out.len() >= n * dim && w.len() >= dim, "rms_norm buffers")?;
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let dim = dim as i32;
        let mut b = self.stream.launch_builder(&self.rms_norm);
        b.arg(x).arg(w).arg(&eps).arg(&dim).arg(out);
        // SAFETY: argument types match the kernel signature; sizes checked above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(dev_err)
    }

    /// `out = silu(g) ⊙ u` for `n` rows `[g | u]` of width `2 * ff`.
    /// `rows4`: 4 columns per thread over a (columns, rows) grid when `ff` is a multiple of
    /// 4 (`silu_mul_rows4`), else one element per thread.
    pub fn silu_mul(
        &self,
        gu: &CudaSlice<f32>,
        n: usize,
        ff: usize,
        out: &mut CudaSlice<f32>,
        rows4: bool,
    ) -> Result<(), KernelError> {
        Self::check(gu.len() >= 2 * n * ff && out.len() >= n * ff, "silu_mul buffers")?;
        if rows4 && ff.is_multiple_of(4) && n <= 65535 {
            let ff = ff as i32;
            let mut b = self.stream.launch_builder(self.func("silu_mul_rows4"));
            b.arg(gu).arg(&ff).arg(out);
            // SAFETY: as above; rows are 16-byte aligned since ff is a multiple of 4.
            return unsafe { b.launch(Self::rows4_cfg(n, ff as usize)) }.map(|_| ()).map_err(dev_err);
        }
        let cfg = LaunchConfig::for_num_elems((n * ff) as u32);
        let (ff, n) = (ff as i32, n as i32);
        let mut b = self.stream.launch_builder(&self.silu_mul);
        b.arg(gu).arg(&ff).arg(&n).arg(out);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(dev_err)
    }

    /// `silu_mul`'s 4-columns-per-thread form writing bf16 bits (the next GEMM's input):
    /// `ff` a multiple of 4, at most 65,535 rows; `pdl`: as a programmatic dependent
    /// launch ([`Launch`]). With `gu_bf16`, `gu` holds bf16 values (its first half of
    /// bytes, as a bf16-output GEMM leaves them), read 8 columns per thread: `ff` a
    /// multiple of 8.
    pub fn silu_mul_to_bf16(
        &self,
        gu: &CudaSlice<f32>,
        gu_bf16: bool,
        n: usize,
        ff: usize,
        out: &mut CudaSlice<u16>,
        pdl: bool,
    ) -> Result<(), KernelError> {
        Self::check(gu.len() >= 2 * n * ff && out.len() >= n * ff, "silu_mul buffers")?;
        Self::check(ff.is_multiple_of(4) && n <= 65535, "silu_mul to bf16: ff a multiple of 4, ≤ 65,535 rows")?;
        Self::check(!gu_bf16 || ff.is_multiple_of(8), "silu_mul of bf16: ff a multiple of 8")?;
        let ff32 = ff as i32;
        let (name, cfg) = if gu_bf16 {
            let cfg = LaunchConfig { grid_dim: (ff.div_ceil(2048) as u32, n as u32, 1), ..Self::rows4_cfg(n, ff) };
            ("silu_mul_rows8_bf16_bf16", cfg)
        } else {
            ("silu_mul_rows4_bf16", Self::rows4_cfg(n, ff))
        };
        let mut b = Launch::new(&self.stream, self.func(name));
        b.arg(gu).arg(&ff32).arg(out);
        // SAFETY: as above; rows are 16-byte (gu) and 8-byte (out) aligned since ff is a
        // multiple of 4 (of 8 for bf16 gu); the kernel waits for the one before (pdl_wait).
        unsafe { b.launch(cfg, pdl) }.map_err(dev_err)
    }

    /// The SiLU·gate kernels' 4-columns-per-thread grid: (columns / 1024, rows).
    fn rows4_cfg(n: usize, ff: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (ff.div_ceil(1024) as u32, n as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// `out[t] = table[ids[t]]`, rows of `dim`. Ids are checked on the host first.
    pub fn embed(
        &self,
        table: &CudaSlice<f32>,
        ids: &[u32],
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let rows = table.len() / dim.max(1);
        Self::check(ids.iter().all(|&i| (i as usize) < rows) && out.len() >= ids.len() * dim, "embed ids or buffers")?;
        let d_ids = self.upload(ids)?;
        let cfg = LaunchConfig::for_num_elems((ids.len() * dim) as u32);
        let (dim, n) = (dim as i32, ids.len() as i32);
        let mut b = self.stream.launch_builder(&self.embed);
        b.arg(table).arg(&d_ids).arg(&dim).arg(&n).arg(out);
        // SAFETY: as above; every id indexes a row of `table`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(dev_err)
    }

    /// Waits for the work queued so far.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(dev_err)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A kernel of `ops.cu` (one of [`KERNELS`], the GEMV lists or [`FLASH_KERNELS`]).
    pub(crate) fn func(&self, name: &str) -> &CudaFunction {
        self.funcs.get(name).unwrap_or_else(|| panic!("kernel {name} is not in ops.cu"))
    }
}
