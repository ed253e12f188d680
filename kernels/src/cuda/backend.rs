//! [`CudaBackend`]: the whole model on one CUDA device, behind [`Backend`].
//!
//! - Weights: every matrix dequantized at load (GGUF quantized types included) and kept
//!   as bf16 (default; `DISAGG_CUDA_WEIGHTS=f32` keeps f32, for exactness checks against
//!   the CPU backend's f32 path). GEMMs go through cuBLAS: bf16 × bf16 with f32
//!   accumulation and f32 output (`cublasGemmEx`), or f32 `cublasSgemm` (no TF32). A
//!   one-token step (batch-1 decode) takes the GEMV kernels instead, which read the f32
//!   activations directly and fuse the RMSNorm before QKV and gate/up, the SiLU·gate
//!   after gate/up, and RoPE with the KV write after QKV (`DISAGG_CUDA_GEMV_ROPE=0`: a
//!   kernel of its own) (`DISAGG_CUDA_GEMV_MAX_TOKENS`: 0 = cuBLAS and separate ops; up
//!   to 8, though from 2 tokens on cuBLAS was measured faster).
//! - Memory: weights at load; then `reserve` sizes every per-step scratch buffer for the
//!   engine's largest step, and the KV cache comes last, so steps never allocate.
//! - Activations: f32 device buffers, allocated once by the engine's workspace.
//! - KV cache: one device buffer per layer in the CPU backend's layout (keys
//!   `[block][kv_head][slot][head_dim]` for all blocks, then values), f16 or f32, so
//!   `kv_export`/`kv_import` move the same transfer layout as every backend.
//! - Per step, only small metadata goes up (token ids, slots, positions, block tables),
//!   never tensors; RoPE angles are made on the device from the positions, as the CPU
//!   backend makes them.
//!
//! - Attention: the tensor-core flash kernel for every step, prefill and decode (one
//!   block per tile of a sequence's tokens × a KV head's query heads, so each K/V read
//!   serves the whole group), split-K over the keys chosen by whole waves of resident blocks
//!   (the split count with the least modelled time), K/V fragments read by ldmatrix.
//!   Decode steps of one token per sequence (GQA groups ≤ 8, at most two waves of
//!   blocks) take the keys-on-M kernel (`flash_decode_km_*`: keys as the MMA's rows,
//!   the group's query heads as its 8 columns; `DISAGG_CUDA_DECODE_KM=0`: the flash
//!   kernel's decode form); its splits, up to 16 on sm_90, run as one thread-block
//!   cluster that merges them in the kernel (`attention_merge` otherwise).
//!   `DISAGG_CUDA_FLASH=0`, f32 KV, other head sizes, and f32 weights (the exactness
//!   mode) take the per-token f32 kernel (same split rule over (token, head) pairs).
//! - CUDA graphs: a decode-only step's ops are captured the second time its shape
//!   (tokens, logit rows, attention splits) is seen and replayed from then on
//!   (`DISAGG_CUDA_GRAPHS=0`: never); at most 512 shapes are kept, a new one taking the
//!   place of the least recently replayed. Everything a step reads from the host is uploaded
//!   by `begin_step` into buffers whose addresses the graphs keep; when one of them must
//!   grow, the graphs are dropped and captured again. A decode step over an FP8 cache's
//!   f16 copy (the keys-on-M kernel off or not fitting) runs op by op: the copy's block
//!   count is a launch argument that grows with the contexts under one shape.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::{result as blas, CudaBlas};
use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{dev_err, CudaDevice, Launch};
use crate::backend::{
    AttnShape, Backend, GraphCounts, KvShape, Rope, SampleSpec, SampledRow, SeqSpan, StepBatch, StepLimits, WeightPart,
};
use crate::cpu::ops::KvDtype;
use crate::KernelError;

/// A weight matrix on the device, `rows × cols`, row-major.
pub enum CudaLinear {
    F32 { w: CudaSlice<f32>, rows: usize, cols: usize },
    Bf16 { w: CudaSlice<u16>, rows: usize, cols: usize },
}

impl CudaLinear {
    pub fn rows(&self) -> usize {
        match self {
            CudaLinear::F32 { rows, .. } | CudaLinear::Bf16 { rows, .. } => *rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            CudaLinear::F32 { cols, .. } | CudaLinear::Bf16 { cols, .. } => *cols,
        }
    }
    /// Bytes on the device.
    pub fn n_bytes(&self) -> usize {
        match self {
            CudaLinear::F32 { rows, cols, .. } => rows * cols * 4,
            CudaLinear::Bf16 { rows, cols, .. } => rows * cols * 2,
        }
    }
}

enum KvBuf {
    F16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
    /// FP8 E4M3 bytes (one-token decode steps on the FP8 keys-on-M kernel; other steps
    /// on the f16 flash kernels over an f16 copy of their blocks, or the per-token kernel).
    Fp8(CudaSlice<u8>),
}

/// The paged KV cache on the device, one buffer per layer.
pub struct CudaKv {
    shape: KvShape,
    layers: Vec<KvBuf>,
}

impl CudaKv {
    /// Elements of one layer's keys (values follow at this offset).
    fn half(&self) -> usize {
        let s = &self.shape;
        s.n_blocks * s.block_size * s.n_kv_heads * s.head_dim
    }
    /// Elements of one block's keys in one layer.
    fn block_elems(&self) -> usize {
        let s = &self.shape;
        s.block_size * s.n_kv_heads * s.head_dim
    }
}

/// The shape of a decode step a graph is captured for: tokens, logit rows, attention
/// splits, and which attention kernel (per-token, flash, flash decode form).
type GraphKey = (usize, usize, usize, u8);

/// Captured decode steps by shape.
struct Graphs(ShapeCache<CudaGraph>);

// SAFETY: a CUDA graph may be used from any thread as long as calls on it are
// serialized; the backend is used through `&mut self` only.
unsafe impl Send for Graphs {}

/// Buffers of the sampling kernel (ops.cu `sample_rows`): per-row parameters and edits
/// in, per-row results out (sized for `rows` rows at load; edits grow as needed).
struct SampleBufs {
    pf: CudaSlice<f32>,
    pi: CudaSlice<i32>,
    pu: CudaSlice<f64>,
    eid: CudaSlice<i32>,
    ev: CudaSlice<f32>,
    eorig: CudaSlice<f32>,
    tok: CudaSlice<u32>,
    f: CudaSlice<f32>,
    z: CudaSlice<f64>,
    n: CudaSlice<i32>,
    cid: CudaSlice<u32>,
    cval: CudaSlice<f32>,
    tid: CudaSlice<u32>,
    tval: CudaSlice<f32>,
}

impl SampleBufs {
    fn new(st: &std::sync::Arc<cudarc::driver::CudaStream>, rows: usize) -> Result<Self, cudarc::driver::DriverError> {
        let cap = crate::backend::SAMPLE_CANDIDATES;
        let rows = rows.max(1);
        Ok(SampleBufs {
            pf: st.alloc_zeros(4 * rows)?,
            pi: st.alloc_zeros(4 * rows)?,
            pu: st.alloc_zeros(rows)?,
            eid: st.alloc_zeros(1)?,
            ev: st.alloc_zeros(3)?,
            eorig: st.alloc_zeros(1)?,
            tok: st.alloc_zeros(rows)?,
            f: st.alloc_zeros(4 * rows)?,
            z: st.alloc_zeros(rows)?,
            n: st.alloc_zeros(2 * rows)?,
            cid: st.alloc_zeros(rows * cap)?,
            cval: st.alloc_zeros(rows * cap)?,
            tid: st.alloc_zeros(rows * 20)?,
            tval: st.alloc_zeros(rows * 20)?,
        })
    }
}

/// The GEMV kernels' fusions (ops.cu).
enum Gemv<'a> {
    Plain,
    Norm,
    NormSilu,
    /// One token's QKV: RMSNorm before, RoPE and the write of k, v into this f16 cache
    /// layer after (`gemv_norm_rope_bf16_m1`).
    NormRope(RopeKv<'a>),
    /// One token's residual GEMV that also leaves the inputs of the next GEMV's RMSNorm
    /// with this weight (`gemv_stats_bf16_m1`; see [`CudaBackend::prenorm`]).
    PlainStats(&'a CudaSlice<f32>),
}

/// What the QKV GEMV's RoPE epilogue needs beyond the step's positions, slots and
/// frequencies (ops.cu `RopeKv`).
struct RopeKv<'a> {
    cache: &'a mut CudaSlice<u16>,
    half: i64,
    n_heads: i32,
    n_kv: i32,
    head_dim: i32,
    interleaved: i32,
    block_size: i32,
}

/// Per-op GPU time from CUDA events (`DISAGG_CUDA_PROFILE`): ops are not synchronized,
/// so the step runs as it would (minus CUDA graphs), and each op's time is the GPU's.
#[derive(Default)]
struct Profile {
    totals: std::collections::BTreeMap<&'static str, (f64, u64)>,
    /// Ops timed but not read yet: name, start and end events.
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
}

/// Makes `dst` hold at least `len` elements, allocating anew (zeroed, a power of two)
/// when it is smaller: true when it moved.
fn fit<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    st: &std::sync::Arc<cudarc::driver::CudaStream>,
    dst: &mut CudaSlice<T>,
    len: usize,
) -> bool {
    let grow = dst.len() < len;
    if grow {
        *dst = st.alloc_zeros::<T>(len.next_power_of_two()).expect("CUDA: allocating step metadata");
    }
    grow
}

/// A new timed event (the profile's and the step gaps' clocks) recorded on `st` now.
fn timed_event(st: &std::sync::Arc<cudarc::driver::CudaStream>) -> CudaEvent {
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    st.record_event(timed).expect("CUDA: recording an event")
}

/// A timed event recorded on `st` now, from `pool` when it has one.
fn pooled_event(pool: &mut Vec<CudaEvent>, st: &std::sync::Arc<cudarc::driver::CudaStream>) -> CudaEvent {
    match pool.pop() {
        Some(e) => {
            e.record(st).expect("CUDA: recording an event");
            e
        }
        None => timed_event(st),
    }
}

/// Most blocks `argmax_rows_split` gives one row.
const ARGMAX_MAX_CHUNKS: usize = 64;

/// Alignment of each upload in the staging memory.
const STAGING_ALIGN: usize = 16;

/// Pinned host memory that each step's metadata is uploaded from, so that the copies
/// never wait for the step in flight (async scheduling): two halves used in turn, each
/// written again only once the copies from it are done.
#[derive(Default)]
struct Staging {
    bufs: [Option<cudarc::driver::PinnedHostSlice<u8>>; 2],
    done: [Option<CudaEvent>; 2],
    cur: usize,
    off: usize,
    /// One copy for the whole step, spread by `unpack_step` (`DISAGG_CUDA_PACKED_UPLOAD`,
    /// on by default); its segments so far: (destination, offset, bytes).
    packed: bool,
    segs: Vec<(u64, usize, usize)>,
}

/// Side streams for the small copies between two steps (`DISAGG_CUDA_COPY_STREAMS`, on
/// by default with packed uploads): the next step's metadata goes up on `up` while the
/// steps before it still run, and a deferred sample's ids come down on `down`, so that
/// on the compute stream the last step's argmax is followed by the next step's
/// `unpack_step` and graph alone. The events order the copies against the kernels that
/// use the same buffers; the next argmax, which rewrites `argmax_out`, waits for the
/// newest copy of ids still uncollected (its event in `CudaBackend::deferred`).
struct CopyStreams {
    up: std::sync::Arc<cudarc::driver::CudaStream>,
    down: std::sync::Arc<cudarc::driver::CudaStream>,
    /// On the compute stream after the last `unpack_step`: `packed_dev` is free from there.
    unpacked: CudaEvent,
    /// On `up` after the last upload: `unpack_step` waits for it.
    uploaded: CudaEvent,
    /// On the compute stream after the last deferred argmax: its copy down waits for it.
    sampled: CudaEvent,
}

impl CopyStreams {
    /// The streams, and `unpacked` recorded on `compute` now (past what it allocated).
    fn new(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        compute: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<Self, cudarc::driver::DriverError> {
        let (up, down) = (ctx.new_stream()?, ctx.new_stream()?);
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(CopyStreams {
            unpacked: compute.record_event(flags)?,
            uploaded: up.record_event(flags)?,
            sampled: down.record_event(flags)?,
            up,
            down,
        })
    }
}

/// `unpack_step`'s segment table (ops.cu `UploadSegs`), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct UploadSegs {
    dst: [u64; MAX_UPLOAD_SEGS],
    off: [u32; MAX_UPLOAD_SEGS],
    words: [u32; MAX_UPLOAD_SEGS],
    n: u32,
    ids_seg: i32,
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for UploadSegs {}

/// ops.cu `MAX_UPLOAD_SEGS`.
const MAX_UPLOAD_SEGS: usize = 12;

impl Staging {
    /// Starts a step's uploads of at most `bytes` (each rounded up to [`STAGING_ALIGN`]).
    fn begin(&mut self, ctx: &std::sync::Arc<cudarc::driver::CudaContext>, bytes: usize) {
        self.cur ^= 1;
        self.off = 0;
        if let Some(e) = &self.done[self.cur] {
            e.synchronize().expect("CUDA: waiting for a metadata upload");
        }
        if self.bufs[self.cur].as_ref().is_none_or(|b| b.len() < bytes) {
            // SAFETY: written before each copy from it.
            let b = unsafe { ctx.alloc_pinned::<u8>(bytes.next_power_of_two().max(1 << 16)) };
            self.bufs[self.cur] = Some(b.expect("CUDA: pinned memory for step metadata"));
        }
    }

    /// Uploads `host` into `dst` through the staging memory, growing `dst` when too small
    /// (true: it moved).
    fn put<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &mut self,
        st: &std::sync::Arc<cudarc::driver::CudaStream>,
        dst: &mut CudaSlice<T>,
        host: &[T],
    ) -> bool {
        let grow = fit(st, dst, host.len());
        if host.is_empty() {
            return grow;
        }
        let bytes = std::mem::size_of_val(host);
        let buf = self.bufs[self.cur].as_mut().expect("begin() allocated it");
        assert!(self.off + bytes <= buf.len(), "CUDA: step metadata beyond its staging memory");
        let base = buf.as_mut_ptr().expect("CUDA: pinned memory");
        let (dptr, _g) = dst.device_ptr_mut(st);
        // SAFETY: the range lies in the buffer, which no copy reads until this one (the
        // half's last copies were waited for in begin()); dst holds host.len() elements.
        unsafe {
            let at = base.add(self.off);
            std::ptr::copy_nonoverlapping(host.as_ptr() as *const u8, at, bytes);
            if self.packed {
                assert!(bytes.is_multiple_of(4) && self.segs.len() < MAX_UPLOAD_SEGS, "CUDA: packed metadata segments");
                self.segs.push((dptr, self.off, bytes));
            } else {
                let src = std::slice::from_raw_parts(at as *const u8, bytes);
                cudarc::driver::result::memcpy_htod_async(dptr, src, st.cu_stream())
                    .expect("CUDA: uploading step metadata");
            }
        }
        self.off += bytes.next_multiple_of(STAGING_ALIGN);
        grow
    }

    /// Ends a step's uploads: the half is free again once the stream has passed here.
    fn end(&mut self, st: &std::sync::Arc<cudarc::driver::CudaStream>) {
        match &self.done[self.cur] {
            Some(e) => e.record(st).expect("CUDA: recording an event"),
            None => {
                let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
                self.done[self.cur] = Some(st.record_event(flags).expect("CUDA: recording an event"));
            }
        }
    }
}

/// At most this many decode shapes are kept captured; a new one takes the place of the
/// least recently replayed.
const MAX_GRAPHS: usize = 512;

/// Values by decode shape, at most `cap` of them: inserting a new shape where there is no
/// room drops the one least recently inserted or got. A long-running server meets more
/// shapes (batch sizes times attention split counts, which follow the contexts) than it
/// keeps; before, shapes past the cap ran op by op for good, however often they came.
struct ShapeCache<V> {
    map: std::collections::HashMap<GraphKey, (V, u64)>,
    clock: u64,
    cap: usize,
}

impl<V> ShapeCache<V> {
    fn new(cap: usize) -> Self {
        ShapeCache { map: Default::default(), clock: 0, cap: cap.max(1) }
    }

    fn get(&mut self, key: &GraphKey) -> Option<&V> {
        self.clock += 1;
        let e = self.map.get_mut(key)?;
        e.1 = self.clock;
        Some(&e.0)
    }

    /// Inserts `value` for `key`; returns the shape dropped to make room, if any.
    fn insert(&mut self, key: GraphKey, value: V) -> Option<GraphKey> {
        self.clock += 1;
        let dropped = if self.map.len() >= self.cap && !self.map.contains_key(&key) {
            let lru = self.map.iter().min_by_key(|(_, e)| e.1).map(|(k, _)| *k);
            lru.inspect(|k| drop(self.map.remove(k)))
        } else {
            None
        };
        self.map.insert(key, (value, self.clock));
        dropped
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn clear(&mut self) {
        self.map.clear();
    }
}

pub struct CudaBackend {
    /// `DISAGG_CUDA_PROFILE`: GPU time and calls per op, from CUDA events.
    profile: Option<Profile>,
    /// The GPU's time between steps ([`super::STEP_GAP_OP`]): events at each step's
    /// forward pass's start and end (read once the end is done), the last end read, the
    /// summed gaps and their count, and events to record again.
    step_events: std::collections::VecDeque<(CudaEvent, CudaEvent)>,
    last_step_end: Option<CudaEvent>,
    step_gap: (f64, u64),
    event_pool: Vec<CudaEvent>,
    /// Async scheduling (`DISAGG_ASYNC_SCHEDULING`; on by default with device sampling,
    /// off while profiling): deferred samples' ids are copied into pinned host memory,
    /// into one of two slots in turn; the samples not read yet (slot, rows, the event
    /// after the copy), oldest first.
    defer: bool,
    /// Programmatic dependent launch for the step's kernels (`DISAGG_CUDA_PDL`; sm_90+,
    /// on by default): see [`super::Launch`].
    pdl: bool,
    deferred_host: [Option<cudarc::driver::PinnedHostSlice<u32>>; 2],
    deferred: std::collections::VecDeque<(usize, usize, CudaEvent)>,
    deferred_next: usize,
    /// This step's fed rows ([`crate::FedToken`]: row, sampled row), on the device.
    fed_dev: CudaSlice<i32>,
    /// Pinned host memory the step metadata is uploaded from, and the device copy of it
    /// that `unpack_step` spreads (packed uploads).
    staging: Staging,
    /// The copies between steps off the compute stream (`DISAGG_CUDA_COPY_STREAMS`).
    copy_streams: Option<CopyStreams>,
    packed_dev: CudaSlice<u32>,
    dev: CudaDevice,
    blas: CudaBlas,
    bf16_weights: bool,
    /// Activations cast to bf16 for a GEMM.
    x_bf16: CudaSlice<u16>,
    // Per-step metadata, uploaded at layer 0 and reused by every layer.
    /// The model's RoPE frequencies (uploaded when they change: once per model).
    inv_freq: CudaSlice<f32>,
    host_inv_freq: Vec<f32>,
    slots: CudaSlice<i64>,
    pos: CudaSlice<i32>,
    table_off: CudaSlice<i32>,
    tables: CudaSlice<u32>,
    /// The longest context among this step's tokens (a split mixed step: among those of
    /// its flash launch, not the keys-on-M one's).
    max_ctx: usize,
    /// Split-K attention: keys per block (0: off), and the partials' scratch.
    attn_chunk: usize,
    attn_part: CudaSlice<f32>,
    /// FP8 cache, a step on an f16 flash kernel (`DISAGG_CUDA_FP8_F16_COPY`): the step's
    /// blocks converted to f16 (keys, then values; the step's tables in order) and the
    /// identity tables the kernel reads them through.
    fp8_f16_copy: bool,
    step_fp8_copy: bool,
    step_table_blocks: usize,
    /// A step that prefills beside one-row spans (unless `DISAGG_CUDA_MIXED_SPLIT=0`): those rows
    /// to the keys-on-M kernel in a launch of their own (an FP8 cache: only the
    /// prefilling sequences' blocks to the f16 copy). `step_km_part`: that launch.
    mixed_split: bool,
    step_km_part: Option<KmPart>,
    kv_copy: CudaSlice<u16>,
    iota: CudaSlice<u32>,
    /// Each token's RoPE cos/sin (head_dim floats: cos, sin per pair) as the grouped RoPE
    /// kernels write them, read by their later layers and the warp-specialized kernel's q.
    rope_cs: CudaSlice<f32>,
    n_sms: usize,
    /// Rows sampled on the device (`DISAGG_DEVICE_SAMPLING=0`: logits to the host).
    device_sampling: bool,
    argmax_out: CudaSlice<u32>,
    /// `argmax_rows_split` (`DISAGG_CUDA_ARGMAX_SPLIT`, on by default): its partials and
    /// per-row counters.
    argmax_split: bool,
    /// The argmax kernels' 16-byte loads (`DISAGG_CUDA_ARGMAX_VEC`, on by default).
    argmax_vec: bool,
    argmax_pv: CudaSlice<f32>,
    argmax_pi: CudaSlice<i32>,
    argmax_count: CudaSlice<u32>,
    sample: SampleBufs,
    /// This step's token ids and logit rows (from `begin_step`).
    ids: CudaSlice<u32>,
    rows: CudaSlice<u32>,
    n_step: usize,
    /// This step's longest context, on the device (the split-K chunk is made from it), and
    /// a split mixed step's keys-on-M rows' longest.
    max_ctx_dev: CudaSlice<i32>,
    /// The KV cache holds f16 (the flash kernels' element type) or FP8 (the keys-on-M
    /// decode kernel's other one).
    kv_f16: std::cell::Cell<bool>,
    kv_fp8: std::cell::Cell<bool>,
    /// The flash kernel (see the module docs); whether this step takes it, its query
    /// tiles, and the step's key splits (either kernel).
    flash: bool,
    step_flash: bool,
    /// The flash kernel this step launches (chosen once in `prepare_step`).
    step_flash_kernel: &'static str,
    /// This step's tiles all have ≤ 16 rows (decode): the warps split the keys instead
    /// (`flash_decode`: allowed; `DISAGG_CUDA_FLASH_DECODE=0`: never).
    step_decode: bool,
    flash_decode: bool,
    /// Decode steps of one token per sequence and GQA groups of ≤ 8 take the keys-on-M
    /// kernel (`flash_decode_km_*`; `DISAGG_CUDA_DECODE_KM=0`: the flash kernel's decode form).
    decode_km: bool,
    fa_tiles: CudaSlice<i32>,
    n_fa_tiles: usize,
    step_splits: usize,
    /// CUDA graphs: on/off, the captured ones, the shapes seen once, this step's shape.
    graphs_on: bool,
    graphs: Graphs,
    seen: std::collections::HashSet<GraphKey>,
    step_key: GraphKey,
    capturing: bool,
    /// Steps replayed, shapes captured and captured shapes dropped to make room for others.
    graph_counts: GraphCounts,
    /// bf16 GEMMs of at most this many tokens take the GEMV kernel (0: never).
    gemv_max_tokens: usize,
    /// Attention key splits chosen by whole waves of resident blocks
    /// (`DISAGG_CUDA_ATTN_WAVES=0`: the earlier rule, two blocks per SM), and the flash
    /// kernels' resident blocks per SM, by kernel name.
    attn_waves: bool,
    flash_blocks_per_sm: std::collections::HashMap<&'static str, usize>,
    /// The card's memory bandwidth by its clock and bus width, bytes/s (0: not known), and
    /// whether a decode attention whose unsplit blocks would sit one per SM stays unsplit
    /// where splitting would not save its own cost (`DISAGG_CUDA_ATTN_LONE=0`: split by
    /// waves as before), by the split form's read rate and fixed cost on this card
    /// ([`split_costs`]; see [`unsplit_pays`]).
    hbm_bytes_per_s: f64,
    attn_lone: bool,
    split_costs: (f64, f64),
    /// Per keys-on-M kernel, indexed by cluster size s (2 ≤ s ≤ `km_cluster_max`): the
    /// blocks resident at once when launched as clusters of s, as the driver counts them
    /// and as single blocks are (the blocks per SM times the SMs), which the split count
    /// assumes with `cluster_waves` off (`DISAGG_CUDA_CLUSTER_WAVES=0`).
    km_clustered: std::collections::HashMap<&'static str, [Vec<usize>; 2]>,
    cluster_waves: bool,
    /// The flash kernels load K and V fragments by ldmatrix (`DISAGG_CUDA_FLASH_LDMATRIX=0`:
    /// by 32- and 16-bit shared loads).
    flash_ldmatrix: bool,
    /// The flash kernels' K/V tile loads compute addresses once per key, hoisted
    /// (`DISAGG_CUDA_FLASH_LEAN_LOADS=0`: per 16-byte chunk, from scratch).
    flash_lean_loads: bool,
    /// All of a flash-decode block's threads merge its warps' parts
    /// (`DISAGG_CUDA_FLASH_WIDE_MERGE=0`: warp 0 alone).
    flash_wide_merge: bool,
    /// The flash kernels' softmax takes the bare ex2 instruction (subnormals flushed)
    /// rather than exp2f (`DISAGG_CUDA_FLASH_FAST_EXP=0`).
    flash_fast_exp: bool,
    /// The flash kernels address shared memory by 32-bit offsets from a base computed
    /// once (`DISAGG_CUDA_FLASH_SMEM32=0`: generic pointers; with the fast exp only).
    flash_smem32: bool,
    /// The head_dim-128 flash prefill kernel is compiled for 3 blocks per SM rather than
    /// its natural 2 (`DISAGG_CUDA_FLASH_OCC3=0`; with the 32-bit shared addresses only).
    flash_occ3: bool,
    /// On sm_90 the head_dim-128 flash prefill kernel computes on warpgroup MMAs (form 3,
    /// ops.cu) (`DISAGG_CUDA_FLASH_WGMMA=0`: mma.sync per warp; with the 32-bit shared
    /// addresses only).
    flash_wgmma: bool,
    /// Lean tile loads read the block table once per pair of keys in one cache block
    /// (`DISAGG_CUDA_FLASH_PAIR_LOADS=0`: once per key).
    flash_pair_loads: bool,
    /// Only tiles that cross a row's diagonal or the keys' end are masked
    /// (`DISAGG_CUDA_FLASH_MASK_EDGE=0`: every tile).
    flash_mask_edge: bool,
    /// `rope_write_kv` (q and k) by the grouped kernel, a thread per (token, group of heads,
    /// rotation pair) (`DISAGG_CUDA_ROPE_PAIRS=0`: one block per token; the k-only RoPE has
    /// its own switch, `rope_k_round`).
    rope_pairs: bool,
    /// Heads per thread of the grouped RoPE kernel (`DISAGG_CUDA_ROPE_GROUP`; default
    /// `ROPE_GROUP_MAX`).
    rope_group: usize,
    /// One-token QKV GEMVs rotate q, k and write k, v into an f16 cache themselves.
    gemv_rope: bool,
    /// The one-token GEMV kernels issue each group's weight loads before the previous
    /// group is used (`DISAGG_CUDA_GEMV_PIPE=0`: load, then use).
    gemv_pipe: bool,
    /// One-token residual GEMVs told the norm that comes next (`next_norm`) leave its
    /// inputs, and the one-token GEMV of that norm takes them (`DISAGG_CUDA_GEMV_PRENORM=0`:
    /// the GEMV computes the norm itself). See [`Self::prenorm`].
    gemv_prenorm: bool,
    /// One-token GEMVs whose grid leaves room keep more loads per row in flight
    /// (`DISAGG_CUDA_GEMV_DEEP=0`: two everywhere); see [`Self::gemv`].
    gemv_deep: bool,
    /// `DISAGG_CUDA_QKV_TRIGGER`'s bits: where the one-token QKV GEMV lets the attention
    /// after it be scheduled (1: at its blocks' start, 2: as each block's first warp leaves
    /// its loop), 4: that GEMV at two loads per row, 8: the QKV GEMVs' shared-memory
    /// carveout set at start (the largest). Default 13: 1, 4 and 8.
    qkv_trigger: u32,
    /// A split keys-on-M attention merged in its cluster reads every split's partial in
    /// one round of loads (`DISAGG_CUDA_FLASH_MERGE_ILP=0`: M first, then each split's in
    /// turn; the same bits).
    flash_merge_ilp: bool,
    /// The keys-on-M kernel loads q's values and a tile's block-table entries all before
    /// the first use (`DISAGG_CUDA_KM_BATCH_LOADS=0`: each in turn; the same bits).
    km_batch_loads: bool,
    /// With those loads first and no early trigger from the QKV GEMV, the keys-on-M kernel
    /// waits for the kernel before first and asks for q beside its first tiles' block-table
    /// entries (`DISAGG_CUDA_KM_WAIT_FIRST=0`: q after the tiles' copies; the same bits).
    km_wait_first: bool,
    /// With its wait first and RoPE in the kernel, the keys-on-M kernel asks for the row's
    /// k and v and the RoPE frequencies beside q, and computes cos/sin after its early
    /// tiles (`DISAGG_CUDA_KM_KV_EARLY=0`: each when used; the same bits).
    km_kv_early: bool,
    /// The barrier after a keys-on-M cluster's merge arrives without release
    /// (`DISAGG_CUDA_CLUSTER_RELAXED_EXIT=0`: with it).
    cluster_relaxed_exit: bool,
    /// What the last such residual GEMV left: x · the norm weight, and the sums of x² per
    /// `NORM_SPAN` elements.
    prenorm_xg: CudaSlice<f32>,
    prenorm_parts: CudaSlice<f32>,
    /// Whose they are: (x's device address, the norm weight's, x's width), cleared when
    /// they are used or x may have been written otherwise.
    prenormed: Option<(u64, u64, usize)>,
    /// GEMVs that took them.
    prenorm_taken: u64,
    /// `DISAGG_CUDA_SPLITK_NORM` (default 65): the fewest tokens from which a bf16 down
    /// projection past the GEMV and the skinny GEMM is split over K here and finished by one
    /// kernel with the residual add and the next RMSNorm (0: never; see
    /// [`Self::residual_gemm`]).
    splitk_from: usize,
    /// Its partials (splits × tokens × rows), grown on first use.
    splitk_part: CudaSlice<f32>,
    /// What that kernel left in the bf16 GEMM scratch: the RMSNorm of x, as (x's device
    /// address, the norm weight's, the width, tokens, eps bits); taken by the norm it
    /// stands for, cleared where the scratch or x may be written otherwise.
    normed_bf16: Option<(u64, u64, usize, usize, u32)>,
    /// Norms skipped because it was there (tests).
    normed_taken: u64,
    /// How many deep GEMVs (`gemv_deep`) were launched from the host (tests).
    deep_taken: u64,
    /// `DISAGG_CUDA_SKINNY` (sm_90): GEMMs of 2–8 tokens on the skinny kernel (see
    /// [`Self::takes_skinny`]).
    skinny: bool,
    /// RMSNorm before a bf16 GEMM of more tokens than the GEMV takes writes bf16 straight
    /// into the GEMM input (`DISAGG_CUDA_NORM_CAST=0`: f32 RMSNorm, then a cast).
    norm_cast: bool,
    /// That norm loads its weights before its wait (`DISAGG_CUDA_NORM_WEIGHTS_FIRST=0`:
    /// after the row's sum).
    norm_weights_first: bool,
    /// SiLU·gate 4 columns per thread on a (columns, rows) grid
    /// (`DISAGG_CUDA_SILU_ROWS4=0`: one element per thread, a 64-bit division each).
    silu_rows4: bool,
    /// Past the GEMV, SiLU·gate writes the down projection's bf16 GEMM input itself
    /// (`DISAGG_CUDA_SILU_BF16=0`: f32, then a cast).
    silu_bf16: bool,
    /// Past the GEMV, the flash kernels (prefill, decode and keys-on-M forms; split, their
    /// merge) write the output projection's bf16 input themselves
    /// (`DISAGG_CUDA_ATTN_BF16=0`: f32, then a cast).
    attn_bf16: bool,
    /// Past the GEMV and the skinny GEMM, the gate/up GEMM writes bf16 and SiLU·gate
    /// reads it (`DISAGG_CUDA_GU_BF16=0`: f32 gate/up values, half the bytes again).
    gu_bf16: bool,
    /// A step on the keys-on-M decode kernel does RoPE and the KV write in the attention
    /// kernel (`DISAGG_CUDA_ATTN_ROPE=0`: `rope_write_kv` before it).
    attn_rope: bool,
    /// A keys-on-M decode step split into at most `CudaDevice::km_cluster_max` chunks may
    /// launch its splits as thread block clusters that merge in the kernel, where the
    /// split count's model finds that cheaper than `attention_merge` after it
    /// (`DISAGG_CUDA_ATTN_CLUSTER=0`: never); whether this step does.
    attn_cluster: bool,
    /// A split count chosen in clusters but below this runs apart, merged by
    /// `attention_merge`, where it may (`DISAGG_CUDA_ATTN_CLUSTER_FROM`; 2: any may merge in clusters).
    attn_cluster_from: usize,
    step_cluster: bool,
    /// The keys-on-M kernel asks for its first tiles of older keys before waiting for the
    /// kernel before it (`DISAGG_CUDA_KM_EARLY=0`: after).
    km_early: bool,
    /// The keys-on-M kernel loads its tiles by bulk copies (`DISAGG_CUDA_KM_BULK=1`; sm_90).
    km_bulk: bool,
    /// The attention kernels skip rescaling O by 1 (`DISAGG_CUDA_FLASH_LAZY_RESCALE=0`: never).
    flash_lazy_rescale: bool,
    /// Prefill steps at head_dim 128 take the warp-specialized flash kernel
    /// (`flash_attn_pp_f16_d128`, 128-row tiles) where the warpgroup-MMA form runs
    /// (`DISAGG_CUDA_FLASH_WARP_SPEC=0` for the one-warpgroup kernel).
    flash_warp_spec: bool,
    /// Its consumer warpgroups take turns at the tensor cores (`DISAGG_CUDA_FLASH_PP_TURNS=1`;
    /// else each issues whenever ready).
    flash_pp_turns: bool,
    /// Its producer copies by the lean loop where cache blocks are a power of two
    /// (`DISAGG_CUDA_FLASH_PP_LEAN=0`: the general loop).
    flash_pp_lean: bool,
    /// On a step of the warp-specialized kernel, RoPE rotates only k before the attention
    /// and the kernel rotates q as it loads it (`DISAGG_CUDA_PP_ROPE=0`: q too, before).
    pp_rope: bool,
    /// The k-only RoPE is the grouped kernel (`rope_write_k_f16`), its loads in one round and
    /// the cos/sin an earlier layer of the step wrote (`DISAGG_CUDA_ROPE_K_ROUND=0`: the
    /// block-per-token loop form, which makes them in every layer).
    rope_k_round: bool,
    /// `rope_cs` holds this step's cos/sin (a layer's grouped or loop RoPE kernel wrote
    /// them; cleared by `begin_step` and when the buffer is replaced).
    rope_cs_ready: bool,
    /// Set by `norm_qkv_rope` when it left q's RoPE to the warp-specialized attention of
    /// its layer: (layer, interleaved pairs).
    q_rope_pending: Option<(usize, bool)>,
    /// This step's flash tiles are the warp-specialized kernel's (128 rows).
    step_pp: bool,
    /// Set by `norm_qkv_rope` when it left RoPE and the KV write to the attention of its
    /// layer: (layer, interleaved pairs).
    rope_pending: Option<(usize, bool)>,
    /// cuBLAS's workspace, fixed so that captured GEMMs never allocate.
    _blas_ws: CudaSlice<u8>,
}

fn launch_cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n.max(1) as u32)
}

/// Attention partials reserved per SM (rows of head_dim + 2 floats).
const ATTN_PART_ROWS_PER_SM: usize = 256;

/// The most bytes of an FP8 cache's f16 copy (two of every cache byte a step reads) for a
/// step of decode rows only: one that reads more (thousands of cached blocks at once, e.g.
/// hundreds of sequences with the keys-on-M kernel off) takes the per-token kernel over
/// the cache instead. At Llama-3-8B's shape (4 KiB of copy per token) this covers 256k
/// tokens in all: just under eight sequences of 32k.
const FP8_COPY_MAX_BYTES: usize = 1 << 30;

/// Whether a step on an FP8 cache asks for the f16 copy of `copy_bytes` (room for it is
/// checked apart): always when a sequence prefills rows (`prefill`), since the per-token
/// kernel would then take the prompt's whole causal square one query row at a time, and
/// for decode rows within FP8_COPY_MAX_BYTES.
fn fp8_copy_wanted(copy_bytes: usize, prefill: bool) -> bool {
    prefill || copy_bytes <= FP8_COPY_MAX_BYTES
}

/// ops.cu's ROPE_GROUP_MAX: the most heads one thread of the grouped RoPE kernel takes, and
/// its default. At one head per thread an 8k prefill layer of Llama-3-8B took 412 µs
/// against 107 with q, 62 against 27 without (H200, docs/PERF.md); each thread then pays
/// its index arithmetic (64-bit divisions) for two or four values (the likely cost, not
/// measured apart).
const ROPE_GROUP_MAX: usize = 8;

/// The narrowest K slice a split-K residual GEMM takes (`CudaBackend::splitk_splits`):
/// Llama-3-8B's down projection (14,336) in 4.
const SPLITK_MIN_COLS: usize = 3584;

/// From how many tokens the down projection splits over K by default (two slices up to 128
/// tokens): on an H100, Llama-3-8B b128 at 1k keys 0.5–0.7% faster in four alternated
/// rounds, b80 and b96 level; at 4 slices b16–b64 were 0.2–0.7% slower (docs/PERF.md,
/// seventieth session).
const SPLITK_FROM: usize = 65;

/// The keys-on-M decode kernel for `head_dim` (64 or 128).
fn km_kernel(head_dim: usize, fp8: bool) -> &'static str {
    match (head_dim == 64, fp8) {
        (true, false) => "flash_decode_km_f16_d64",
        (false, false) => "flash_decode_km_f16_d128",
        (true, true) => "flash_decode_km_fp8_d64",
        (false, true) => "flash_decode_km_fp8_d128",
    }
}

/// The keys-on-M launch of a split mixed step (`CudaBackend::mixed_split`): its tiles (one
/// row each) at `at..at + n` of the step's tiles, after the other kernel's; its kernel,
/// and its key splits, merged in clusters when more than one.
#[derive(Clone, Copy, Debug)]
struct KmPart {
    at: usize,
    n: usize,
    kernel: &'static str,
    splits: usize,
    cluster: bool,
}

/// A step's block tables as the attention kernels read them (`prepare_step`): its spans'
/// tables laid end to end, a split step's other spans first (so that an FP8 cache's f16
/// copy of the first `copy_blocks` entries holds theirs alone), and each launch's longest
/// context: `max_ctx` for the other spans, `km_max_ctx` for the one-row spans that the
/// keys-on-M launch of a split step takes (`km_span`).
#[derive(Debug, Default, PartialEq)]
struct StepTables {
    tables: Vec<u32>,
    /// Where each span's table starts in `tables` (by the span's index in the step).
    table_off: Vec<usize>,
    copy_blocks: usize,
    max_ctx: usize,
    km_max_ctx: usize,
}

impl StepTables {
    fn new(seqs: &[SeqSpan], km_span: impl Fn(&SeqSpan) -> bool) -> StepTables {
        let mut t = StepTables { table_off: vec![0; seqs.len()], ..Default::default() };
        for km in [false, true] {
            for (s, span) in seqs.iter().enumerate().filter(|(_, span)| km_span(span) == km) {
                t.table_off[s] = t.tables.len();
                t.tables.extend_from_slice(span.block_table);
                let ctx = span.pos0 + span.rows.len();
                if km {
                    t.km_max_ctx = t.km_max_ctx.max(ctx);
                } else {
                    t.max_ctx = t.max_ctx.max(ctx);
                }
            }
            if !km {
                t.copy_blocks = t.tables.len();
            }
        }
        t
    }

    /// The flash kernels' query tiles, `[first row, rows, position of the first, table
    /// offset]`: at most `per` rows of one span each (their rows are the group's query
    /// heads), the latest first so that the causal tail does not straggle; the one-row
    /// spans of a split step (`km_span`) in the second list, for the keys-on-M launch.
    fn tiles(&self, seqs: &[SeqSpan], per: usize, km_span: impl Fn(&SeqSpan) -> bool) -> [Vec<[i32; 4]>; 2] {
        let mut lists: [Vec<[i32; 4]>; 2] = Default::default();
        for (s, span) in seqs.iter().enumerate() {
            let to = &mut lists[usize::from(km_span(span))];
            for r in span.rows.clone().step_by(per) {
                let rows = (span.rows.end - r).min(per);
                to.push([r as i32, rows as i32, (span.pos0 + r - span.rows.start) as i32, self.table_off[s] as i32]);
            }
        }
        for l in &mut lists {
            l.sort_by_key(|t| std::cmp::Reverse(t[2] + t[1]));
        }
        lists
    }
}

/// Key splits for `units` blocks of attention work over `chunks` chunks of keys, when
/// `slots` blocks fit on the GPU at once: the split count (≤ `chunks`) with the least
/// time in a model where each wave of resident blocks costs its chunks plus one
/// (the block's start, its share of the merge). Whole waves matter: 512 units on 396
/// slots run as 2 waves at a 65% fill, as 3 waves of 2 splits at 86%.
/// `max_splits` bounds the partials (see `reserve`).
///
/// Where the kernel can merge `s` splits itself, launched as one thread block cluster
/// (for 2 ≤ s < `clustered.len()`), `clustered[s]` is how many of its blocks are
/// resident at once that way: a cluster's blocks share a GPC, so that can be fewer than
/// `slots`. The splits then either merge in clusters, at that residency, or run apart at
/// `slots` for one unit more (the merge's own launch). Returns the split count and
/// whether the splits merge in clusters; on a tie the fewer splits win, then the cluster.
/// Without `apart`, splits merge in clusters or there is one (a launch that has no
/// partials' scratch for its rows).
fn attn_splits_by_waves(
    units: usize,
    chunks: usize,
    slots: usize,
    max_splits: usize,
    clustered: &[usize],
    apart: bool,
) -> (usize, bool) {
    let units = units.max(1);
    let cost = |s: usize, slots: usize| (units * s).div_ceil(slots.max(1)) * (chunks.div_ceil(s) + 1);
    (1..=chunks.min(max_splits).max(1))
        .flat_map(|s| {
            let merged = (s > 1 && s < clustered.len()).then(|| (cost(s, clustered[s]), s, true));
            let apart =
                (apart || s == 1).then(|| (cost(s, slots) + usize::from(s > 1 && !clustered.is_empty()), s, false));
            merged.into_iter().chain(apart)
        })
        .min_by_key(|&(c, s, merged)| (c, s, !merged))
        .map_or((1, false), |(_, s, merged)| (s, merged))
}

/// The count that the environment variable `name` gives, else `default`; one that does
/// not parse is an error that says what to give (`what`).
fn env_count(name: &str, default: usize, what: &str) -> Result<usize, KernelError> {
    match std::env::var(name) {
        Ok(v) => v.parse().map_err(|_| KernelError::Device(format!("{name}={v}: give {what}"))),
        Err(_) => Ok(default),
    }
}

/// A split rule's choice (`splits`, merged in clusters) with the cluster floor applied: a
/// count chosen in clusters but below `floor` runs the same splits apart, merged by
/// `attention_merge`, where the launch has the partials' scratch (`apart`; without it the
/// clusters stay). `DISAGG_CUDA_ATTN_CLUSTER_FROM`.
fn below_cluster_floor((splits, merged): (usize, bool), apart: bool, floor: usize) -> (usize, bool) {
    (splits, merged && (splits >= floor || !apart))
}

/// The bytes/s one block of a decode attention kernel reads alone on its SM, where
/// measured (0 elsewhere): `flash_decode_km_f16_d128`, 64 unsplit blocks of 32,768 keys
/// (one per SM) at 1.905 TB/s on an H100, 29.8 GB/s a block (`decodelab`, docs/PERF.md,
/// fifty-ninth session); 1.927 TB/s, 30.1 GB/s a block, on an H200 (sixtieth).
fn lone_block_rate(kernel: &str) -> f64 {
    if kernel == "flash_decode_km_f16_d128" {
        29.8e9
    } else {
        0.0
    }
}

/// A split keys-on-M f16 decode attention's read rate (bytes/s) and a split's fixed cost
/// (seconds a launch: the merge, the extra blocks' fill and drain) on the cards where both
/// were measured.
///
/// The H100: the rate at 32k keys in `decodelab` (2.8 TB/s; docs/PERF.md), the cost fitted
/// to where Llama-3-8B's steps ran faster unsplit than split and where not
/// (`tools/gpu-lab/split_ab.sh`; 1k and 4k keys on two starts, sixty-first session): below
/// 1.1 µs (batch 11's 88 blocks at 1k keys, 1.1 µs short of the split form, ran 0.5–1.0%
/// slower unsplit on one start, level on the other), so none. There the blocks stay
/// unsplit from where they alone ask for the split form's rate (96).
///
/// The H200: both from the engine's own launches, traced kernel by kernel at batches 14–16
/// and 1k and 4k keys (sixty-fourth session): two splits took 14.8 µs + bytes at 4.04 TB/s,
/// unsplit blocks 12.4 µs + their bytes at 29.0 GB/s each, so a split costs 2.4 µs more
/// and then reads at 4.04 TB/s (the sixtieth session's 3.55, `decodelab`'s rate at 32k
/// keys, left batches 15 and 16 unsplit at every length; from 2k keys they ran 1.7–6.3%
/// slower so). The steps at 1k keys, batches 13 and 14, ran 1.2–2.2% faster unsplit, which
/// this rule does not see: the attention itself ran faster split, and the gate/up GEMM
/// after it slower, but only with the two splits merged in clusters, not apart
/// (sixty-fifth session; `below_cluster_floor`, PERF.md).
///
/// Elsewhere, the card's bus bandwidth and no fixed cost: unsplit only where the lone
/// blocks ask for all the card gives (the fifty-ninth session's rule).
fn split_costs(card: &str, hbm: f64) -> (f64, f64) {
    if card.contains("H100 80GB HBM3") {
        (2.8e12, 0.0)
    } else if card.contains("H200") {
        (4.04e12, 2.4e-6)
    } else {
        (hbm, 0.0)
    }
}

/// Whether `units` unsplit blocks of a decode attention, at most one per SM, each reading
/// `unit_bytes` at `block_rate` (its rate alone on an SM), finish within a split form's
/// fixed cost of it: that form reads the same bytes at `split_rate` at best and then pays
/// `fixed_s` (see [`split_costs`]). Unsplit, the blocks read at `units` × `block_rate`
/// up to that same ceiling. At 1k keys a block's 512 KiB take ~17.6 µs alone: on an H200
/// batch 16 of Llama-3-8B (128 units) unsplit comes within 1.0 µs of the split form and
/// batch 12 (96 units) 5.1 µs short of it, past its 2.4 µs of fixed cost. With more keys the
/// difference grows with the bytes (batch 16 at 4k keys: 3.9 µs, split), while from where
/// the lone blocks alone ask for the split form's rate there is none. With `split_rate` the
/// card's bandwidth and no fixed cost this is the fifty-ninth session's rule: unsplit only
/// where the blocks ask for the whole bandwidth.
fn unsplit_pays(
    units: usize,
    n_sms: usize,
    unit_bytes: f64,
    block_rate: f64,
    (split_rate, fixed_s): (f64, f64),
) -> bool {
    if block_rate <= 0.0 || split_rate <= 0.0 || units == 0 || units > n_sms {
        return false;
    }
    let bytes = units as f64 * unit_bytes;
    bytes / (units as f64 * block_rate).min(split_rate) - bytes / split_rate <= fixed_s
}

/// `DISAGG_CUDA_QKV_TRIGGER`'s bits as [`CudaBackend::set_qkv_trigger`] and the variable take
/// them: 1 or 2 (not both), 4 and 8.
fn qkv_trigger_bits_valid(bits: u32) -> bool {
    bits & !15 == 0 && bits & 3 != 3
}

/// Whether a one-token GEMV of `blocks` blocks over `k` columns takes the deep kernel with
/// `u` loads per row in flight (four: `__launch_bounds__(256, 2)`; three: `(256, 3)`): its
/// grid fits that many blocks per SM (which is all the deep kernel may have; the classic
/// one has four), and every lane has at least two whole groups of `u` loads, so the first
/// goes out before the kernel waits for its input and the pipelined loop runs (below that,
/// e.g. SmolLM2's 576 columns, the deep kernel would leave most loads to its tail loop).
pub fn deep_gemv_fits(blocks: usize, k: usize, u: usize, n_sms: usize) -> bool {
    let per_sm = if u == 4 { 2 } else { 3 };
    blocks <= per_sm * n_sms && k >= 2 * u * 32 * 8
}

impl CudaBackend {
    /// Whether `DISAGG_CUDA_WEIGHTS` asks for bf16 weights (the default) or f32.
    pub fn bf16_weights_from_env() -> Result<bool, KernelError> {
        match std::env::var(crate::env::CUDA_WEIGHTS).as_deref() {
            Ok("f32") => Ok(false),
            Ok("bf16") | Err(_) => Ok(true),
            Ok(other) => Err(KernelError::Device(format!("{}={other}: use bf16 or f32", crate::env::CUDA_WEIGHTS))),
        }
    }

    /// Opens `cuda:ordinal`, keeping weights in bf16 or f32.
    pub fn new(ordinal: usize, bf16_weights: bool) -> Result<CudaBackend, KernelError> {
        let dev = CudaDevice::open(ordinal)?;
        let stream = dev.stream().clone();
        let blas = CudaBlas::new(stream.clone()).map_err(dev_err)?;
        let ws_mib = env_count(crate::env::CUDA_BLAS_WORKSPACE_MIB, 32, "a number of MiB")?;
        let blas_ws = stream.alloc_zeros::<u8>((ws_mib << 20).max(1)).map_err(dev_err)?;
        if ws_mib > 0 {
            let (p, _g) = blas_ws.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both owned by the backend).
            let r = unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut _, blas_ws.len()) };
            if r != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(KernelError::Device(format!("cuBLAS: setting the workspace: {r:?}")));
            }
        }
        let z = |n| stream.alloc_zeros::<f32>(n).map_err(dev_err);
        let profile = std::env::var_os(crate::env::CUDA_PROFILE).map(|_| Default::default());
        let off = |name| std::env::var(name).is_ok_and(|v| v == "0");
        let on = |name| std::env::var(name).is_ok_and(|v| v == "1");
        // __match_any_sync: sm_70 or newer.
        let device_sampling = !off(crate::env::DEVICE_SAMPLING) && dev.arch.0 >= 7;
        let defer = !off(crate::env::ASYNC_SCHEDULING) && device_sampling && profile.is_none();
        let flash_occ = |name: &str, hd: usize| -> usize {
            let smem = super::flash_smem_bytes(name, hd);
            let threads = super::flash_block_threads(name) as u32;
            match dev.func(name).occupancy_max_active_blocks_per_multiprocessor(threads, smem, None) {
                Ok(n) => (n as usize).max(1),
                Err(_) => 1,
            }
        };
        let flash_blocks_per_sm: std::collections::HashMap<&'static str, usize> = if dev.arch.0 >= 8 {
            super::FLASH_KERNELS.iter().map(|&(name, hd)| (name, flash_occ(name, hd))).collect()
        } else {
            Default::default()
        };
        let n_sms = dev
            .context()
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err)? as usize;
        // Two transfers a clock (kHz) over the bus (bits); 0 where the driver does not say.
        let hbm_bytes_per_s = {
            use cudarc::driver::sys::CUdevice_attribute as A;
            let ctx = dev.context();
            match (
                ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
                ctx.attribute(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
            ) {
                (Ok(khz), Ok(bits)) if khz > 0 && bits > 0 => khz as f64 * 1e3 * 2.0 * bits as f64 / 8.0,
                _ => 0.0,
            }
        };
        let km_clustered: std::collections::HashMap<&'static str, [Vec<usize>; 2]> = super::FLASH_KERNELS
            .iter()
            .filter(|(name, _)| super::is_km_kernel(name) && dev.km_cluster_max > 1)
            .map(|&(name, hd)| {
                let full = flash_blocks_per_sm.get(name).copied().unwrap_or(1) * n_sms;
                let (threads, smem) =
                    (super::flash_block_threads(name) as u32, super::flash_smem_bytes(name, hd) as u32);
                // (Where the driver cannot count them, clusters count as single blocks.)
                let resident = |s: usize| {
                    if s < 2 {
                        return full;
                    }
                    super::cluster_resident_blocks(&stream, dev.func(name), threads, smem, s as u32).unwrap_or(full)
                };
                (name, [(0..=dev.km_cluster_max).map(resident).collect(), vec![full; dev.km_cluster_max + 1]])
            })
            .collect();
        let card_split_costs = split_costs(&dev.name, hbm_bytes_per_s);
        let qkv_trigger = match std::env::var(crate::env::CUDA_QKV_TRIGGER) {
            Ok(v) => v.parse().ok().filter(|&b| qkv_trigger_bits_valid(b)).ok_or_else(|| {
                KernelError::Device(format!(
                    "{}={v}: give 0, or 1 (at the start) or 2 (after the loop), plus 4 for two loads per row \
                     and 8 for the shared-memory carveout",
                    crate::env::CUDA_QKV_TRIGGER
                ))
            })?,
            Err(_) => 13,
        };
        if qkv_trigger & 8 != 0 {
            // The SM's 228 KiB: room for one keys-on-M attention block (102 KiB of stages)
            // beside the GEMV's blocks (58% left none: the attention lab, docs/PERF.md).
            for name in [super::GEMV_NORM_ROPE_M1, super::GEMV_PNORM_M1[2], super::GEMV_PNORM_ROPE_U3_M1] {
                dev.func(name)
                    .set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        100,
                    )
                    .map_err(dev_err)?;
            }
        }
        Ok(CudaBackend {
            attn_waves: !off(crate::env::CUDA_ATTN_WAVES),
            hbm_bytes_per_s,
            attn_lone: !off(crate::env::CUDA_ATTN_LONE),
            split_costs: card_split_costs,
            flash_ldmatrix: !off(crate::env::CUDA_FLASH_LDMATRIX),
            flash_lean_loads: !off(crate::env::CUDA_FLASH_LEAN_LOADS),
            flash_wide_merge: !off(crate::env::CUDA_FLASH_WIDE_MERGE),
            flash_fast_exp: !off(crate::env::CUDA_FLASH_FAST_EXP),
            flash_smem32: !off(crate::env::CUDA_FLASH_SMEM32),
            flash_occ3: !off(crate::env::CUDA_FLASH_OCC3),
            // wgmma exists on sm_90 alone, where the module is built for sm_90a.
            flash_wgmma: !off(crate::env::CUDA_FLASH_WGMMA) && dev.wgmma,
            flash_pair_loads: !off(crate::env::CUDA_FLASH_PAIR_LOADS),
            flash_mask_edge: !off(crate::env::CUDA_FLASH_MASK_EDGE),
            rope_pairs: !off(crate::env::CUDA_ROPE_PAIRS),
            rope_group: match std::env::var(crate::env::CUDA_ROPE_GROUP) {
                Ok(v) => match v.parse::<usize>() {
                    Ok(g) if (1..=ROPE_GROUP_MAX).contains(&g) => g,
                    _ => {
                        return Err(KernelError::Device(format!(
                            "{}={v}: give a number of heads from 1 to {ROPE_GROUP_MAX}",
                            crate::env::CUDA_ROPE_GROUP
                        )))
                    }
                },
                Err(_) => ROPE_GROUP_MAX,
            },
            gemv_rope: !off(crate::env::CUDA_GEMV_ROPE),
            gemv_pipe: !off(crate::env::CUDA_GEMV_PIPE),
            gemv_prenorm: !off(crate::env::CUDA_GEMV_PRENORM),
            gemv_deep: !off(crate::env::CUDA_GEMV_DEEP),
            qkv_trigger,
            prenorm_xg: stream.alloc_zeros::<f32>(1).map_err(dev_err)?,
            prenorm_parts: stream.alloc_zeros::<f32>(1).map_err(dev_err)?,
            prenormed: None,
            prenorm_taken: 0,
            splitk_from: env_count(
                crate::env::CUDA_SPLITK_NORM,
                SPLITK_FROM,
                "the fewest tokens whose down projection splits over K (0: never)",
            )?,
            splitk_part: stream.alloc_zeros::<f32>(1).map_err(dev_err)?,
            normed_bf16: None,
            normed_taken: 0,
            deep_taken: 0,
            skinny: !off(crate::env::CUDA_SKINNY) && dev.arch.0 >= 9,
            norm_cast: !off(crate::env::CUDA_NORM_CAST),
            norm_weights_first: !off(crate::env::CUDA_NORM_WEIGHTS_FIRST),
            silu_rows4: !off(crate::env::CUDA_SILU_ROWS4),
            silu_bf16: !off(crate::env::CUDA_SILU_BF16),
            attn_bf16: !off(crate::env::CUDA_ATTN_BF16),
            gu_bf16: !off(crate::env::CUDA_GU_BF16),
            attn_rope: !off(crate::env::CUDA_ATTN_ROPE),
            attn_cluster: !off(crate::env::CUDA_ATTN_CLUSTER),
            attn_cluster_from: env_count(
                crate::env::CUDA_ATTN_CLUSTER_FROM,
                2,
                "the fewest key splits that may merge in a cluster (2: any)",
            )?,
            step_cluster: false,
            km_early: !off(crate::env::CUDA_KM_EARLY),
            km_bulk: on(crate::env::CUDA_KM_BULK) && dev.arch.0 >= 9,
            flash_lazy_rescale: !off(crate::env::CUDA_FLASH_LAZY_RESCALE),
            flash_merge_ilp: !off(crate::env::CUDA_FLASH_MERGE_ILP),
            km_batch_loads: !off(crate::env::CUDA_KM_BATCH_LOADS),
            km_wait_first: !off(crate::env::CUDA_KM_WAIT_FIRST),
            km_kv_early: !off(crate::env::CUDA_KM_KV_EARLY),
            cluster_relaxed_exit: !off(crate::env::CUDA_CLUSTER_RELAXED_EXIT),
            flash_warp_spec: !off(crate::env::CUDA_FLASH_WARP_SPEC),
            flash_pp_turns: on(crate::env::CUDA_FLASH_PP_TURNS),
            flash_pp_lean: !off(crate::env::CUDA_FLASH_PP_LEAN),
            pp_rope: !off(crate::env::CUDA_PP_ROPE),
            rope_k_round: !off(crate::env::CUDA_ROPE_K_ROUND),
            rope_cs_ready: false,
            q_rope_pending: None,
            step_pp: false,
            rope_pending: None,
            flash_blocks_per_sm,
            km_clustered,
            cluster_waves: !off(crate::env::CUDA_CLUSTER_WAVES),
            graphs_on: !off(crate::env::CUDA_GRAPHS) && profile.is_none(),
            // mma.sync m16n8k16 and cp.async need sm_80 or newer.
            flash: bf16_weights && !off(crate::env::CUDA_FLASH) && dev.arch.0 >= 8,
            graphs: Graphs(ShapeCache::new(MAX_GRAPHS)),
            seen: Default::default(),
            step_key: (0, 0, 0, 0),
            capturing: false,
            graph_counts: GraphCounts::default(),
            _blas_ws: blas_ws,
            ids: stream.alloc_zeros::<u32>(1).map_err(dev_err)?,
            rows: stream.alloc_zeros::<u32>(1).map_err(dev_err)?,
            n_step: 0,
            max_ctx_dev: stream.alloc_zeros::<i32>(2).map_err(dev_err)?,
            kv_f16: Default::default(),
            kv_fp8: Default::default(),
            step_flash: false,
            step_flash_kernel: "",
            step_decode: false,
            flash_decode: !off(crate::env::CUDA_FLASH_DECODE),
            decode_km: !off(crate::env::CUDA_DECODE_KM),
            step_splits: 1,
            fa_tiles: stream.alloc_zeros::<i32>(1).map_err(dev_err)?,
            n_fa_tiles: 0,
            gemv_max_tokens: env_count(
                crate::env::CUDA_GEMV_MAX_TOKENS,
                super::GEMV_DEFAULT_MAX_TOKENS,
                "a number of tokens",
            )?
            .min(super::GEMV_MAX_TOKENS),
            profile,
            step_events: Default::default(),
            last_step_end: None,
            step_gap: (0.0, 0),
            event_pool: Vec::new(),
            defer,
            pdl: !off(crate::env::CUDA_PDL) && dev.arch.0 >= 9,
            deferred_host: [None, None],
            deferred: Default::default(),
            deferred_next: 0,
            fed_dev: stream.alloc_zeros::<i32>(2).map_err(dev_err)?,
            staging: Staging { packed: !off(crate::env::CUDA_PACKED_UPLOAD), ..Default::default() },
            packed_dev: stream.alloc_zeros::<u32>(1).map_err(dev_err)?,
            // (After packed_dev: the first upload waits for its allocation.)
            copy_streams: if off(crate::env::CUDA_COPY_STREAMS) || off(crate::env::CUDA_PACKED_UPLOAD) {
                None
            } else {
                Some(CopyStreams::new(&dev.ctx, &stream).map_err(dev_err)?)
            },
            blas,
            bf16_weights,
            x_bf16: stream.alloc_zeros::<u16>(1).map_err(dev_err)?,
            inv_freq: z(1)?,
            host_inv_freq: Vec::new(),
            slots: stream.alloc_zeros::<i64>(1).map_err(dev_err)?,
            pos: stream.alloc_zeros::<i32>(1).map_err(dev_err)?,
            table_off: stream.alloc_zeros::<i32>(1).map_err(dev_err)?,
            tables: stream.alloc_zeros::<u32>(1).map_err(dev_err)?,
            max_ctx: 0,
            attn_chunk: env_count(crate::env::CUDA_ATTN_CHUNK, 64, "a number of keys")?,
            attn_part: z(1)?,
            fp8_f16_copy: !off(crate::env::CUDA_FP8_F16_COPY),
            step_fp8_copy: false,
            step_table_blocks: 0,
            mixed_split: !off(crate::env::CUDA_MIXED_SPLIT),
            step_km_part: None,
            kv_copy: stream.alloc_zeros::<u16>(1).map_err(dev_err)?,
            iota: stream.alloc_zeros::<u32>(1).map_err(dev_err)?,
            rope_cs: z(1)?,
            device_sampling,
            argmax_out: stream.alloc_zeros::<u32>(1).map_err(dev_err)?,
            argmax_split: !off(crate::env::CUDA_ARGMAX_SPLIT),
            argmax_vec: !off(crate::env::CUDA_ARGMAX_VEC),
            argmax_pv: stream.alloc_zeros::<f32>(1).map_err(dev_err)?,
            argmax_pi: stream.alloc_zeros::<i32>(1).map_err(dev_err)?,
            argmax_count: stream.alloc_zeros::<u32>(0).map_err(dev_err)?,
            sample: SampleBufs::new(&stream, 1).map_err(dev_err)?,
            n_sms,
            dev,
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Attention through the flash kernel (default: bf16 weights and not
    /// `DISAGG_CUDA_FLASH=0`); takes effect at the next `begin_step`.
    pub fn set_flash(&mut self, on: bool) {
        self.flash = on;
    }

    /// Decode steps replayed from CUDA graphs (default: on unless `DISAGG_CUDA_GRAPHS=0`
    /// or profiling).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs_on = on && self.profile.is_none();
    }

    /// Split-K attention: chunks of at least `keys` keys (0: never split); takes effect
    /// at the next `begin_step`.
    pub fn set_attn_chunk(&mut self, keys: usize) {
        self.attn_chunk = keys;
    }

    /// bf16 GEMMs of at most `n` tokens take the GEMV kernel (at most 8; 0: never);
    /// captured graphs hold the other choice, so they are dropped when it changes.
    pub fn set_gemv_max_tokens(&mut self, n: usize) {
        let n = n.min(super::GEMV_MAX_TOKENS);
        if n != self.gemv_max_tokens {
            self.buffers_moving();
            self.gemv_max_tokens = n;
        }
    }

    /// Turns a kernel switch on or off; captured graphs hold the other kernels, so they
    /// are dropped when it changes.
    fn set_switch(&mut self, on: bool, switch: fn(&mut Self) -> &mut bool) {
        if *switch(self) != on {
            self.buffers_moving();
            *switch(self) = on;
        }
    }

    /// The flash kernels load K/V fragments by ldmatrix (default: on unless
    /// `DISAGG_CUDA_FLASH_LDMATRIX=0`).
    pub fn set_flash_ldmatrix(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_ldmatrix);
    }

    /// The flash kernels' tile loads compute addresses once per key (default: on unless
    /// `DISAGG_CUDA_FLASH_LEAN_LOADS=0`).
    pub fn set_flash_lean_loads(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_lean_loads);
    }

    /// All of a flash-decode block's threads merge its warps' parts (default: on unless
    /// `DISAGG_CUDA_FLASH_WIDE_MERGE=0`).
    pub fn set_flash_wide_merge(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_wide_merge);
    }

    /// The flash kernels' softmax takes the bare ex2 instruction (default: on unless
    /// `DISAGG_CUDA_FLASH_FAST_EXP=0`).
    pub fn set_flash_fast_exp(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_fast_exp);
    }

    /// The flash kernels address shared memory by 32-bit offsets (default: on unless
    /// `DISAGG_CUDA_FLASH_SMEM32=0`).
    pub fn set_flash_smem32(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_smem32);
    }

    /// The head_dim-128 flash prefill kernel held to 3 blocks per SM (default: on unless
    /// `DISAGG_CUDA_FLASH_OCC3=0`).
    pub fn set_flash_occ3(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_occ3);
    }

    /// The flash prefill kernel on warpgroup MMAs, where the GPU has them (sm_90;
    /// default: on unless `DISAGG_CUDA_FLASH_WGMMA=0`).
    pub fn set_flash_wgmma(&mut self, on: bool) {
        let on = on && self.dev.wgmma;
        self.set_switch(on, |b| &mut b.flash_wgmma);
    }

    /// The flash kernels' lean loads read the block table once per pair of keys
    /// (default: on unless `DISAGG_CUDA_FLASH_PAIR_LOADS=0`).
    pub fn set_flash_pair_loads(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_pair_loads);
    }

    /// The flash kernels mask only tiles that cross a row's diagonal or the keys' end
    /// (default: on unless `DISAGG_CUDA_FLASH_MASK_EDGE=0`).
    pub fn set_flash_mask_edge(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_mask_edge);
    }

    /// Decode steps of one token per sequence (GQA groups of ≤ 8) take the keys-on-M
    /// kernel (default: on unless `DISAGG_CUDA_DECODE_KM=0`; off, the flash kernel's
    /// decode form as the switches above choose it).
    pub fn set_decode_km(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.decode_km);
    }

    /// With an FP8 cache, the steps that the FP8 keys-on-M kernel does not take run the
    /// f16 flash kernels over an f16 copy of their blocks (default: on unless
    /// `DISAGG_CUDA_FP8_F16_COPY=0`, which takes the per-token kernel over the cache).
    pub fn set_fp8_f16_copy(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.fp8_f16_copy);
    }

    /// Whether this step's attention reads an f16 copy of an FP8 cache's blocks (set by
    /// `begin_step`).
    pub fn step_fp8_copy(&self) -> bool {
        self.step_fp8_copy
    }

    /// A step that prefills beside one-row spans (decoding sequences) launches the
    /// keys-on-M kernel for those rows, after the flash kernel's launch for the others;
    /// with an FP8 cache only the prefilling sequences' blocks go to the f16 copy (default:
    /// on unless `DISAGG_CUDA_MIXED_SPLIT=0`; it needs the keys-on-M kernel and its
    /// clusters, else the step takes one launch as before).
    pub fn set_mixed_split(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.mixed_split);
    }

    /// This step's keys-on-M launch beside its other kernel (a split mixed step): its
    /// kernel, rows and key splits (set by `begin_step`).
    pub fn step_km_part(&self) -> Option<(&'static str, usize, usize)> {
        self.step_km_part.map(|p| (p.kernel, p.n, p.splits))
    }

    /// The flash kernel this step launches (set by `begin_step`; "" where the step takes
    /// the per-token kernel): for tests that must know which form they checked.
    pub fn step_flash_kernel(&self) -> &'static str {
        if self.step_flash {
            self.step_flash_kernel
        } else {
            ""
        }
    }

    /// The key splits of this step's attention (set by `begin_step`; 1: unsplit).
    pub fn step_splits(&self) -> usize {
        self.step_splits
    }

    /// The flash kernel a step takes (see the switches above and ops.cu's FLASH_KERNEL
    /// and KM_KERNEL lists); `km`: a decode step the keys-on-M kernel can take.
    fn flash_kernel(&self, head_dim: usize, decode: bool, km: bool) -> &'static str {
        // (An FP8 cache: its own keys-on-M kernel; the others read an f16 copy.)
        let fp8 = self.kv_fp8.get();
        if decode && km && self.decode_km && self.dev.smem_fits(km_kernel(head_dim, fp8)) {
            return km_kernel(head_dim, fp8);
        }
        // The kernel's form (ops.cu's flash_attn_impl V): each switch off falls back
        // to the form below it.
        let form = match (self.flash_ldmatrix, self.flash_fast_exp, self.flash_smem32) {
            (false, ..) => "lds",
            (true, false, _) => "",
            (true, true, false) => "fx",
            (true, true, true) => "sa",
        };
        let d64 = head_dim == 64;
        match (form, decode, d64) {
            ("lds", false, true) => "flash_attn_lds_f16_d64",
            ("lds", true, true) => "flash_decode_lds_f16_d64",
            ("lds", false, false) => "flash_attn_lds_f16_d128",
            ("lds", true, false) => "flash_decode_lds_f16_d128",
            ("", false, true) => "flash_attn_f16_d64",
            ("", true, true) => "flash_decode_f16_d64",
            ("", false, false) => "flash_attn_f16_d128",
            ("", true, false) => "flash_decode_f16_d128",
            ("fx", false, true) => "flash_attn_fx_f16_d64",
            ("fx", true, true) => "flash_decode_fx_f16_d64",
            ("fx", false, false) => "flash_attn_fx_f16_d128",
            ("fx", true, false) => "flash_decode_fx_f16_d128",
            (_, false, true) => "flash_attn_sa_f16_d64",
            (_, true, true) => "flash_decode_sa_f16_d64",
            (_, false, false) if self.step_pp && self.flash_pp_lean => "flash_attn_pp_f16_d128",
            (_, false, false) if self.step_pp => "flash_attn_ppg_f16_d128",
            (_, false, false) if self.flash_wgmma && self.flash_occ3 => "flash_attn_wg3_f16_d128",
            (_, false, false) if self.flash_wgmma => "flash_attn_wg_f16_d128",
            (_, false, false) if self.flash_occ3 => "flash_attn_sa3_f16_d128",
            (_, false, false) => "flash_attn_sa_f16_d128",
            (_, true, false) => "flash_decode_sa_f16_d128",
        }
    }

    /// `rope_write_kv` (q and k) by the grouped kernel, a thread per (token, group of heads,
    /// pair) (default: on unless `DISAGG_CUDA_ROPE_PAIRS=0`, which takes a block per token;
    /// not the k-only RoPE, see `set_rope_k_round`).
    pub fn set_rope_pairs(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.rope_pairs);
    }

    /// Heads per thread of the grouped RoPE kernel, 1 to 8 (default 8; `None` restores it;
    /// `DISAGG_CUDA_ROPE_GROUP` sets it at start).
    pub fn set_rope_group(&mut self, group: Option<usize>) {
        let group = group.unwrap_or(ROPE_GROUP_MAX);
        assert!((1..=ROPE_GROUP_MAX).contains(&group), "RoPE group of {group} heads");
        if self.rope_group != group {
            self.buffers_moving();
            self.rope_group = group;
        }
    }

    /// A one-token step's RoPE + KV write in the QKV GEMV's epilogue (default: on
    /// unless `DISAGG_CUDA_GEMV_ROPE=0`; it needs the pipelined GEMV and an f16 cache).
    pub fn set_gemv_rope(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.gemv_rope);
    }

    /// Whether [`Backend::norm_qkv_rope`] runs as one kernel (the GEMV with RoPE and the
    /// KV write in its epilogue) for a step of `n_tokens` with these weights and cache.
    pub fn fuses_qkv_rope(
        &self,
        w_qkv: &CudaLinear,
        n_tokens: usize,
        kv: &CudaKv,
        layer: usize,
        attn: &AttnShape,
    ) -> bool {
        self.gemv_rope
            && self.gemv_pipe
            && n_tokens == 1
            && self.takes_gemv(w_qkv, 1)
            && matches!(kv.layers.get(layer), Some(KvBuf::F16(_)))
            && attn.head_dim.is_multiple_of(2)
            && w_qkv.rows() == attn.qkv_dim()
    }

    /// A one-token GEMV after RMSNorm takes the norm's inputs from the residual GEMV
    /// before it (default: on unless `DISAGG_CUDA_GEMV_PRENORM=0`).
    pub fn set_gemv_prenorm(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.gemv_prenorm);
    }

    /// How many GEMVs launched from the host have taken their RMSNorm's inputs from the
    /// residual GEMV before them (a replayed graph launches none), for tests that must
    /// know which path they checked.
    pub fn prenormed_gemvs(&self) -> u64 {
        self.prenorm_taken
    }

    /// From how many tokens a bf16 down projection past the GEMV and the skinny GEMM splits
    /// over K and is finished by one kernel with the residual add and the next RMSNorm
    /// (default: as `DISAGG_CUDA_SPLITK_NORM` says, else 65; 0 = never).
    pub fn set_splitk_norm(&mut self, from: usize) {
        if self.splitk_from != from {
            self.buffers_moving();
            self.splitk_from = from;
        }
    }

    /// How many RMSNorms launched from the host were skipped because the split-K residual
    /// kernel before them had written them, for tests.
    pub fn splitk_norms(&self) -> u64 {
        self.normed_taken
    }

    /// How many GEMVs with more loads per row in flight ([`Self::set_gemv_deep`]) were
    /// launched from the host, for tests.
    pub fn deep_gemvs(&self) -> u64 {
        self.deep_taken
    }

    /// The GPU's streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.n_sms
    }

    /// One-token GEMVs with software-pipelined loads (default: on unless
    /// `DISAGG_CUDA_GEMV_PIPE=0`).
    pub fn set_gemv_pipe(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.gemv_pipe);
    }

    /// One-token GEMVs whose grid leaves room keep more loads per row in flight
    /// (default: on unless `DISAGG_CUDA_GEMV_DEEP=0`).
    pub fn set_gemv_deep(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.gemv_deep);
    }

    /// GEMMs of 2–8 tokens on the skinny kernel (default: on, on sm_90, unless
    /// `DISAGG_CUDA_SKINNY=0`; elsewhere it stays off).
    pub fn set_skinny(&mut self, on: bool) {
        let on = on && self.dev.arch.0 >= 9;
        self.set_switch(on, |b| &mut b.skinny);
    }

    /// Programmatic dependent launch of the step's kernels (default: on, on sm_90+, unless
    /// `DISAGG_CUDA_PDL=0`; elsewhere it stays off).
    pub fn set_pdl(&mut self, on: bool) {
        let on = on && self.dev.arch.0 >= 9;
        self.set_switch(on, |b| &mut b.pdl);
    }

    /// Whether the step's kernels go out as programmatic dependent launches.
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// The greedy argmax over several blocks per row while the rows alone leave SMs idle
    /// (default: on unless `DISAGG_CUDA_ARGMAX_SPLIT=0`).
    pub fn set_argmax_split(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.argmax_split);
    }

    /// The argmax kernels' 16-byte loads (default: on unless `DISAGG_CUDA_ARGMAX_VEC=0`).
    pub fn set_argmax_vec(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.argmax_vec);
    }

    /// SiLU·gate past the GEMV writes the down projection's bf16 input itself (default:
    /// on unless `DISAGG_CUDA_SILU_BF16=0`).
    pub fn set_silu_bf16(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.silu_bf16);
    }

    /// The flash kernels (or their merge) write the output projection's bf16 input
    /// themselves (default: on unless `DISAGG_CUDA_ATTN_BF16=0`).
    pub fn set_attn_bf16(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.attn_bf16);
    }

    /// The gate/up GEMM past the GEMV and skinny kernel writes bf16 for SiLU·gate
    /// (default: on unless `DISAGG_CUDA_GU_BF16=0`).
    pub fn set_gu_bf16(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.gu_bf16);
    }

    /// RoPE and the KV write in the keys-on-M decode kernel (default: on unless
    /// `DISAGG_CUDA_ATTN_ROPE=0`).
    pub fn set_attn_rope(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.attn_rope);
    }

    /// A split keys-on-M decode step may merge its splits in the kernel, as thread block
    /// clusters, where the split count's model finds that cheaper (default: on unless
    /// `DISAGG_CUDA_ATTN_CLUSTER=0`; sm_90).
    pub fn set_attn_cluster(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.attn_cluster);
    }

    /// The fewest key splits of a decode attention that merge in a cluster; a count chosen
    /// in clusters but below it runs apart where it may (default:
    /// `DISAGG_CUDA_ATTN_CLUSTER_FROM`, else 2: any).
    pub fn attn_cluster_from(&self) -> usize {
        self.attn_cluster_from
    }

    /// Sets [`Self::attn_cluster_from`].
    pub fn set_attn_cluster_from(&mut self, splits: usize) {
        if self.attn_cluster_from != splits {
            self.buffers_moving();
            self.attn_cluster_from = splits;
        }
    }

    /// Blocks of the keys-on-M kernel for `head_dim` resident at once: alone (indices 0
    /// and 1) and, at index s, launched as clusters of s, as the driver counts them, or as
    /// alone where it cannot (`None` where the GPU has no clusters).
    pub fn km_cluster_residency(&self, head_dim: usize) -> Option<&[usize]> {
        self.km_clustered.get(km_kernel(head_dim, self.kv_fp8.get())).map(|[c, _]| &c[..])
    }

    /// The decode attention's split count counts the clusters of its splits that fit at
    /// once, as the driver says (default: on unless `DISAGG_CUDA_CLUSTER_WAVES=0`; off:
    /// as many as single blocks).
    pub fn set_cluster_waves(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.cluster_waves);
    }

    /// The keys-on-M kernel's first loads of older keys before it waits (default: on
    /// unless `DISAGG_CUDA_KM_EARLY=0`).
    pub fn set_km_early(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.km_early);
    }

    /// The attention kernels rescale O only when a warp's row maxima rose (default: on
    /// unless `DISAGG_CUDA_FLASH_LAZY_RESCALE=0`).
    pub fn set_flash_lazy_rescale(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_lazy_rescale);
    }

    /// A split keys-on-M attention merged in its cluster reads every split's partial in
    /// one round of loads (default: on unless `DISAGG_CUDA_FLASH_MERGE_ILP=0`; the same
    /// bits).
    pub fn set_flash_merge_ilp(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_merge_ilp);
    }

    /// The keys-on-M kernel loads q's values and a tile's block-table entries all before
    /// the first use (default: on unless `DISAGG_CUDA_KM_BATCH_LOADS=0`; the same bits).
    pub fn set_km_batch_loads(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.km_batch_loads);
    }

    /// The keys-on-M kernel waits for the kernel before, then asks for q beside its first
    /// tiles' block-table entries, where its loads come first and the kernel before cannot
    /// let it in early: RoPE is left to it, or the one-token QKV GEMV does not trigger
    /// (default: on unless `DISAGG_CUDA_KM_WAIT_FIRST=0`; the same bits).
    pub fn set_km_wait_first(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.km_wait_first);
    }

    /// Where the keys-on-M kernel waits first and applies RoPE itself, it asks for the
    /// row's k and v and the RoPE frequencies beside q and computes cos/sin after its
    /// early tiles (default: on unless `DISAGG_CUDA_KM_KV_EARLY=0`; the same bits).
    pub fn set_km_kv_early(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.km_kv_early);
    }

    /// `DISAGG_CUDA_QKV_TRIGGER`'s bits 1, 2 and 4 (default: as that variable says, else
    /// 1 and 4): where the one-token QKV GEMV lets the attention after it be scheduled, and
    /// that GEMV at two loads per row. Bit 8, the carveout, stays as set at start.
    pub fn set_qkv_trigger(&mut self, bits: u32) {
        assert!(bits & 8 == 0 && qkv_trigger_bits_valid(bits), "QKV trigger bits {bits}: 1 or 2, plus 4");
        let bits = bits | (self.qkv_trigger & 8);
        if self.qkv_trigger != bits {
            self.buffers_moving();
            self.qkv_trigger = bits;
        }
    }

    /// Whether the one-token QKV GEMV lets the attention after it be scheduled before it
    /// ends (`DISAGG_CUDA_QKV_TRIGGER` bits 1, 2; programmatic launches only).
    fn qkv_lets_attention_in_early(&self) -> bool {
        self.pdl && self.qkv_trigger & 3 != 0
    }

    /// The barrier after a keys-on-M cluster's merge arrives without release (default: on
    /// unless `DISAGG_CUDA_CLUSTER_RELAXED_EXIT=0`).
    pub fn set_cluster_relaxed_exit(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.cluster_relaxed_exit);
    }

    /// Prefill steps at head_dim 128 take the warp-specialized flash kernel where the
    /// warpgroup-MMA form would run (default: on unless `DISAGG_CUDA_FLASH_WARP_SPEC=0`).
    pub fn set_flash_warp_spec(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_warp_spec);
    }

    /// The warp-specialized kernel's consumers take turns at the tensor cores (default:
    /// off unless `DISAGG_CUDA_FLASH_PP_TURNS=1`).
    pub fn set_flash_pp_turns(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_pp_turns);
    }

    /// The warp-specialized kernel's producer takes the lean copy loop for power-of-two
    /// cache blocks (default: on unless `DISAGG_CUDA_FLASH_PP_LEAN=0`).
    pub fn set_flash_pp_lean(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.flash_pp_lean);
    }

    /// On warp-specialized steps the attention rotates q as it loads it and RoPE before
    /// it only k (default: on unless `DISAGG_CUDA_PP_ROPE=0`).
    pub fn set_pp_rope(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.pp_rope);
    }

    /// The k-only RoPE on the grouped kernel, the step's cos/sin made once (default: on
    /// unless `DISAGG_CUDA_ROPE_K_ROUND=0`).
    pub fn set_rope_k_round(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.rope_k_round);
    }

    /// Whether this step's cos/sin table is written, so the next layer's grouped RoPE
    /// kernel reads it instead of making it.
    pub fn rope_cs_ready(&self) -> bool {
        self.rope_cs_ready
    }

    /// Whether `norm_qkv_rope` leaves q's RoPE to this step's attention of `layer`
    /// (warp-specialized kernel, f16 cache, `DISAGG_CUDA_PP_ROPE`).
    pub fn attention_takes_q_rope(&self, kv: &CudaKv, layer: usize) -> bool {
        self.pp_rope
            && self.step_flash
            && super::is_pp_kernel(self.step_flash_kernel)
            && self.step_km_part.is_none()
            && matches!(kv.layers.get(layer), Some(KvBuf::F16(_)))
    }

    /// The keys-on-M kernel's tiles by bulk copies (default: off unless
    /// `DISAGG_CUDA_KM_BULK=1`; sm_90 only, elsewhere the switch stays off).
    pub fn set_km_bulk(&mut self, on: bool) {
        let sm90 = self.dev.arch.0 >= 9;
        self.set_switch(on && sm90, |b| &mut b.km_bulk);
    }

    /// Whether this step's attention merges its key splits in the kernel, as clusters
    /// (set by `begin_step`).
    pub fn step_cluster(&self) -> bool {
        self.step_cluster
    }

    /// Whether this step's [`Backend::norm_qkv_rope`] (when the one-token GEMV does not
    /// fuse it) leaves RoPE and the KV write of `layer` to the layer's attention: the
    /// keys-on-M decode kernel on an f16 cache (set by `begin_step`).
    pub fn attention_takes_rope(&self, kv: &CudaKv, layer: usize, attn: &AttnShape) -> bool {
        self.attn_rope
            && self.step_flash
            && super::is_km_kernel(self.step_flash_kernel)
            && matches!(kv.layers.get(layer), Some(KvBuf::F16(_) | KvBuf::Fp8(_)))
            && attn.head_dim.is_multiple_of(2)
    }

    /// RMSNorm straight to the bf16 GEMM input (default: on unless
    /// `DISAGG_CUDA_NORM_CAST=0`).
    pub fn set_norm_cast(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.norm_cast);
    }

    /// That norm loads its weights before it waits for the kernel before (default: on
    /// unless `DISAGG_CUDA_NORM_WEIGHTS_FIRST=0`; the same values).
    pub fn set_norm_weights_first(&mut self, on: bool) {
        self.set_switch(on, |b| &mut b.norm_weights_first);
    }

    /// Async scheduling's deferred sampling on or off (A/B checks; see
    /// `DISAGG_ASYNC_SCHEDULING`). Switch it only between steps with nothing deferred.
    pub fn set_defer_sampling(&mut self, on: bool) {
        assert!(self.deferred.is_empty(), "CUDA: deferred samples not read yet");
        self.defer = on && self.device_sampling && self.profile.is_none();
    }

    /// How many decode shapes are captured as graphs now.
    pub fn n_graphs(&self) -> usize {
        self.graphs.0.len()
    }

    /// Keeps at most `n` (at least 1) decode shapes captured (`MAX_GRAPHS` unless set;
    /// tests set fewer to see shapes make room for others); drops those captured so far.
    pub fn set_max_graphs(&mut self, n: usize) {
        self.graphs = Graphs(ShapeCache::new(n));
        self.seen.clear();
    }

    /// Per-op GPU time so far (`DISAGG_CUDA_PROFILE` set): name → (seconds, calls), as
    /// of the last copy to the host.
    pub fn profile(&self) -> Option<&std::collections::BTreeMap<&'static str, (f64, u64)>> {
        self.profile.as_ref().map(|p| &p.totals)
    }

    /// Starts timing an op (profiling only): an event on the stream, without waiting.
    fn tic(&self) -> Option<CudaEvent> {
        self.profile.as_ref().map(|_| self.event())
    }

    fn event(&self) -> CudaEvent {
        timed_event(self.dev.stream())
    }

    /// Ends timing an op: its time is read once the stream has reached it ([`Self::settle`]).
    fn toc(&mut self, name: &'static str, t: Option<CudaEvent>) {
        if let Some(start) = t {
            let end = self.event();
            if let Some(p) = self.profile.as_mut() {
                p.pending.push((name, start, end));
            }
        }
    }

    /// Adds the time of every op timed so far (the stream is idle: after a copy to the host).
    fn settle(&mut self) {
        self.read_step_gaps();
        if let Some(p) = self.profile.as_mut() {
            for (name, start, end) in p.pending.drain(..) {
                let ms = start.elapsed_ms(&end).expect("CUDA: reading a profiling event");
                let e = p.totals.entry(name).or_default();
                e.0 += ms as f64 * 1e-3;
                e.1 += 1;
            }
        }
    }

    /// An event recorded on the stream now (timed), from the pool when it has one.
    fn mark(&mut self) -> CudaEvent {
        pooled_event(&mut self.event_pool, self.dev.stream())
    }

    /// Adds the gaps between steps whose events are done ([`super::STEP_GAP_OP`]).
    fn read_step_gaps(&mut self) {
        while self.step_events.front().is_some_and(|(_, end)| end.is_complete()) {
            let (start, end) = self.step_events.pop_front().expect("an entry");
            if let Some(last) = self.last_step_end.take() {
                let ms = last.elapsed_ms(&start).expect("CUDA: reading a step event");
                self.step_gap.0 += ms as f64 * 1e-3;
                self.step_gap.1 += 1;
                self.event_pool.push(last);
            }
            self.event_pool.push(start);
            self.last_step_end = Some(end);
        }
    }

    /// GB/s of `pass`, which moves `bytes` each time: one pass to warm up, then 10 timed.
    fn pass_bandwidth(
        &self,
        bytes: f64,
        mut pass: impl FnMut() -> Result<(), KernelError>,
    ) -> Result<f64, KernelError> {
        pass()?;
        self.dev.synchronize()?;
        let t = std::time::Instant::now();
        let n = 10;
        for _ in 0..n {
            pass()?;
        }
        self.dev.synchronize()?;
        Ok(bytes * n as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    /// Device-to-device copy bandwidth (read + write), GB/s, over `bytes` buffers.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, KernelError> {
        let st = self.dev.stream();
        let a = st.alloc_zeros::<u8>(bytes).map_err(dev_err)?;
        let mut b = st.alloc_zeros::<u8>(bytes).map_err(dev_err)?;
        self.pass_bandwidth(2.0 * bytes as f64, || st.memcpy_dtod(&a, &mut b).map_err(dev_err))
    }

    /// Read bandwidth, GB/s: ops.cu `stream_read` over a `bytes` buffer (16-byte
    /// non-allocating loads, 8 warps per block, 4 blocks per SM), 10 passes.
    pub fn read_bandwidth(&self, bytes: usize) -> Result<f64, KernelError> {
        let st = self.dev.stream().clone();
        let a = st.alloc_zeros::<u16>(bytes / 2).map_err(dev_err)?;
        let sink = st.alloc_zeros::<u32>(1).map_err(dev_err)?;
        let n16 = (bytes / 16) as i64;
        let cfg = LaunchConfig { grid_dim: (4 * self.n_sms as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.pass_bandwidth(bytes as f64, || {
            let mut b = st.launch_builder(self.dev.func("stream_read"));
            b.arg(&a).arg(&n16).arg(&sink);
            // SAFETY: `a` holds n16 16-byte chunks; the sink one value.
            unsafe { b.launch(cfg) }.map(|_| ()).map_err(dev_err)
        })
    }

    /// Free and total device memory, in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), KernelError> {
        self.dev.mem_info()
    }

    /// An out-of-memory error naming what did not fit, the bytes it needed (when known)
    /// and what the device has free.
    fn oom(&self, what: String, bytes: usize, e: cudarc::driver::DriverError) -> KernelError {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let need = if bytes > 0 { format!("{:.1} MiB for ", mib(bytes)) } else { String::new() };
        let free = match self.mem_info() {
            Ok((free, total)) => format!("{:.0} MiB free of {:.0} MiB", mib(free), mib(total)),
            Err(_) => "free memory unknown".into(),
        };
        KernelError::OutOfMemory(format!(
            "{need}{what} does not fit on {} ({e}; {free}); lower --max-batched-tokens or --max-num-seqs, or leave \
             more room with a smaller --kv-cache-mib / --gpu-memory-utilization",
            self.dev.describe()
        ))
    }

    /// `len` zeros on the device, or an out-of-memory error naming `what`.
    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.dev.stream().alloc_zeros::<T>(len).map_err(|e| self.oom(what.into(), len * std::mem::size_of::<T>(), e))
    }

    /// Uploads `host` into `dst`, growing it when too small (true: it moved).
    fn put<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        dst: &mut CudaSlice<T>,
        host: &[T],
    ) -> bool {
        let grow = fit(stream, dst, host.len());
        if !host.is_empty() {
            stream.memcpy_htod(host, &mut dst.slice_mut(..host.len())).expect("CUDA: uploading step metadata");
        }
        grow
    }

    /// A buffer that captured graphs use is about to move: they are dropped (and
    /// captured again when their shapes come back).
    fn buffers_moving(&mut self) {
        assert!(!self.capturing, "CUDA: a buffer grew while a graph was being captured");
        self.graphs.0.clear();
        self.seen.clear();
    }

    /// Key splits of the attention over chunks of at least `attn_chunk` keys (rounded up
    /// to 128 on the warp-specialized kernel): by whole
    /// waves of the `blocks_per_sm` resident blocks (see [`attn_splits_by_waves`]; `rows`
    /// (tokens × query heads) bounds the partials), or by the earlier rule: split-K only
    /// when the `units` (blocks of work) alone leave SMs idle, enough to give every SM
    /// two blocks. `clustered`: the blocks resident at once when s splits launch as a
    /// cluster that merges them (empty: the kernel never does). `pp`: the launch is the
    /// warp-specialized kernel's; `max_ctx`: its longest context; without `apart`, splits
    /// only in clusters (see [`attn_splits_by_waves`]); `block_rate`: the bytes/s one block
    /// of the kernel reads alone on its SM, where measured, and `key_bytes` what it reads
    /// a key (see [`unsplit_pays`]). Returns the split count and whether the splits merge
    /// in clusters.
    fn attn_splits(
        &self,
        units: usize,
        blocks_per_sm: usize,
        rows: usize,
        clustered: &[usize],
        (pp, max_ctx, apart, (block_rate, key_bytes)): (bool, usize, bool, (f64, usize)),
    ) -> (usize, bool) {
        if self.attn_chunk == 0 {
            return (1, false);
        }
        let unit_bytes = (max_ctx * key_bytes) as f64;
        if self.attn_lone && unsplit_pays(units, self.n_sms, unit_bytes, block_rate, self.split_costs) {
            return (1, false);
        }
        // (The warp-specialized kernel splits at multiples of its 128-key tiles.)
        let chunk = if pp { self.attn_chunk.next_multiple_of(128) } else { self.attn_chunk };
        let chunks = max_ctx.div_ceil(chunk).max(1);
        if self.attn_waves {
            let max_splits = (ATTN_PART_ROWS_PER_SM * self.n_sms / rows.max(1)).min(64);
            let chosen = attn_splits_by_waves(units, chunks, self.n_sms * blocks_per_sm, max_splits, clustered, apart);
            return below_cluster_floor(chosen, apart, self.attn_cluster_from);
        }
        let want = (2 * self.n_sms).div_ceil(units.max(1));
        let s = if want > 1 { want.min(chunks) } else { 1 };
        let s = if apart { s } else { s.min(clustered.len().saturating_sub(1)).max(1) };
        below_cluster_floor((s, s > 1 && s < clustered.len()), apart, self.attn_cluster_from)
    }

    /// `sample_rows` for rows that need more than the argmax (ops.cu `sample_rows`).
    fn sample_full(&mut self, x: &mut CudaSlice<f32>, dim: usize, specs: &[SampleSpec], out: &mut Vec<SampledRow>) {
        use crate::backend::SAMPLE_CANDIDATES as CAP;
        const TOP: usize = 20;
        let st = self.dev.stream().clone();
        let rows = specs.len();
        let (mut pf, mut pi, mut pu) = (Vec::with_capacity(4 * rows), Vec::with_capacity(4 * rows), Vec::new());
        let (mut eid, mut ev) = (Vec::new(), Vec::new());
        for s in specs {
            assert!(s.logprobs.is_none_or(|n| n <= TOP), "at most {TOP} logprobs");
            pf.extend([s.temperature, s.top_p, s.min_p, 0.0]);
            let top_k = s.top_k.min(i32::MAX as usize) as i32;
            pi.extend([top_k, eid.len() as i32, s.edits.len() as i32, s.logprobs.map_or(-1, |n| n as i32)]);
            pu.push(s.u);
            for e in s.edits {
                assert!((e.id as usize) < dim, "logit edit of token {} outside the vocabulary", e.id);
                eid.push(e.id as i32);
                ev.extend([e.add, e.rep, e.sub]);
            }
        }
        let b = &mut self.sample;
        Self::put(&st, &mut b.pf, &pf);
        Self::put(&st, &mut b.pi, &pi);
        Self::put(&st, &mut b.pu, &pu);
        Self::put(&st, &mut b.eid, &eid);
        Self::put(&st, &mut b.ev, &ev);
        let n_e = eid.len();
        if b.eorig.len() < n_e {
            b.eorig = st.alloc_zeros(n_e.next_power_of_two()).expect("CUDA: sampling buffers");
        }
        if b.tok.len() < rows {
            *b = SampleBufs::new(&st, rows.next_power_of_two()).expect("CUDA: sampling buffers");
            return self.sample_full(x, dim, specs, out);
        }
        let d = dim as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let mut l = st.launch_builder(self.dev.func("sample_rows"));
        l.arg(&mut *x).arg(&d).arg(&b.pf).arg(&b.pi).arg(&b.pu).arg(&b.eid).arg(&b.ev).arg(&mut b.eorig);
        l.arg(&mut b.tok).arg(&mut b.f).arg(&mut b.z).arg(&mut b.n);
        l.arg(&mut b.cid).arg(&mut b.cval).arg(&mut b.tid).arg(&mut b.tval);
        // SAFETY: argument types match the kernel; x holds `rows` rows of dim; the
        // parameter and output buffers hold `rows` rows (edits: all of them), edit ids lie
        // in the row.
        unsafe { l.launch(cfg) }.expect("CUDA: sampling");
        let get = |e| panic!("CUDA: sampled rows to the host: {e:?}");
        let mut tok = vec![0u32; rows];
        let mut f = vec![0f32; 4 * rows];
        let mut z = vec![0f64; rows];
        let mut n = vec![0i32; 2 * rows];
        st.memcpy_dtoh(&b.tok.slice(..rows), &mut tok).unwrap_or_else(get);
        st.memcpy_dtoh(&b.f.slice(..4 * rows), &mut f).unwrap_or_else(get);
        st.memcpy_dtoh(&b.z.slice(..rows), &mut z).unwrap_or_else(get);
        st.memcpy_dtoh(&b.n.slice(..2 * rows), &mut n).unwrap_or_else(get);
        let (mut cid, mut cval) = (Vec::new(), Vec::new());
        if specs.iter().any(|s| s.truncates()) {
            cid.resize(rows * CAP, 0u32);
            cval.resize(rows * CAP, 0f32);
            st.memcpy_dtoh(&b.cid.slice(..rows * CAP), &mut cid).unwrap_or_else(get);
            st.memcpy_dtoh(&b.cval.slice(..rows * CAP), &mut cval).unwrap_or_else(get);
        }
        let (mut tid, mut tval) = (Vec::new(), Vec::new());
        if specs.iter().any(|s| s.logprobs.is_some_and(|n| n > 0)) {
            tid.resize(rows * TOP, 0u32);
            tval.resize(rows * TOP, 0f32);
            st.memcpy_dtoh(&b.tid.slice(..rows * TOP), &mut tid).unwrap_or_else(get);
            st.memcpy_dtoh(&b.tval.slice(..rows * TOP), &mut tval).unwrap_or_else(get);
        }
        let mut orig = vec![0f32; n_e];
        if n_e > 0 {
            st.memcpy_dtoh(&b.eorig.slice(..n_e), &mut orig).unwrap_or_else(get);
        }
        let mut e0 = 0;
        for (r, s) in specs.iter().enumerate() {
            let drawn = tok[r] != u32::MAX;
            let nc = if drawn { 0 } else { n[2 * r] as usize };
            let nt = s.logprobs.unwrap_or(0).min(TOP).min(dim);
            out.push(SampledRow {
                token: drawn.then_some(tok[r]),
                token_raw_logit: f[4 * r + 3],
                candidates: (0..nc).map(|i| (cid[r * CAP + i], cval[r * CAP + i])).collect(),
                n_finite: if drawn { 0 } else { n[2 * r + 1] as usize },
                z_all: z[r],
                lse: f[4 * r + 1],
                top: (0..nt).map(|i| (tid[r * TOP + i], tval[r * TOP + i])).collect(),
                edit_orig: orig[e0..e0 + s.edits.len()].to_vec(),
            });
            e0 += s.edits.len();
        }
    }

    /// Whether a bf16 GEMM over `n_tokens` takes the skinny kernel: 2–8 tokens (one n8
    /// tile) and K a multiple of its 64-column slabs. In the engine it beat cuBLAS there
    /// (Llama-3-8B decode steps of 2, 4 and 8 tokens); with more tokens it lost to cuBLAS,
    /// in the lab on the 8B shapes and in the engine on SmolLM2's (docs/PERF.md).
    fn takes_skinny(&self, cols: usize, n_tokens: usize) -> bool {
        self.skinny && (2..=8).contains(&n_tokens) && cols.is_multiple_of(64)
    }

    /// Whether a GEMM of `w` over `n_tokens` takes the GEMV kernels.
    fn takes_gemv(&self, w: &CudaLinear, n_tokens: usize) -> bool {
        matches!(w, CudaLinear::Bf16 { .. }) && n_tokens <= self.gemv_max_tokens && w.cols().is_multiple_of(8)
    }

    /// Launches a GEMV kernel (see ops.cu): `n_out` outputs per token (`Gemv::NormSilu`:
    /// W has 2 × `n_out` rows), `norm` the RMSNorm weight for the fused kinds.
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &mut self,
        mut kind: Gemv<'_>,
        w: &CudaLinear,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        n_tokens: usize,
        n_out: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) {
        let CudaLinear::Bf16 { w, rows, cols } = w else { unreachable!("GEMV takes bf16 weights") };
        let st = self.dev.stream().clone();
        // A one-token GEMV after RMSNorm whose input the residual GEMV before it prepared
        // takes x · weight and the sums of squares it left (NORM_PART). Either way what
        // was prepared is spent: this GEMV used it, or it writes something that may be x.
        let normed = matches!(kind, Gemv::Norm | Gemv::NormSilu | Gemv::NormRope(_));
        let pre = normed
            && n_tokens == 1
            && self.gemv_pipe
            && self.prenormed == Some((x.device_ptr(&st).0, norm.device_ptr(&st).0, *cols));
        self.forget_prepared();
        let (rows_out, names, flat, pnorm) = match kind {
            Gemv::Plain => (n_out, &super::GEMV_BF16[..], super::GEMV_FLAT_M1[0], ""),
            Gemv::Norm => (n_out, &super::GEMV_NORM_BF16[..], super::GEMV_FLAT_M1[1], super::GEMV_PNORM_M1[0]),
            Gemv::NormSilu => {
                (2 * n_out, &super::GEMV_NORM_SILU_BF16[..], super::GEMV_FLAT_M1[2], super::GEMV_PNORM_M1[1])
            }
            // (One token, pipelined: checked by fuses_qkv_rope and prenorm.)
            Gemv::NormRope(_) => (
                n_out,
                std::slice::from_ref(&super::GEMV_NORM_ROPE_M1),
                super::GEMV_NORM_ROPE_M1,
                super::GEMV_PNORM_M1[2],
            ),
            Gemv::PlainStats(_) => (n_out, std::slice::from_ref(&super::GEMV_STATS_M1), super::GEMV_STATS_M1, ""),
        };
        assert!(*rows == rows_out && (1..=super::GEMV_MAX_TOKENS).contains(&n_tokens) && cols % 8 == 0);
        assert!(x.len() >= n_tokens * cols && out.len() >= n_tokens * n_out, "GEMV buffers");
        assert!(!normed || norm.len() == *cols, "GEMV: RMSNorm weight of the input width");
        // Plain, Norm: a warp per two outputs (NormRope: the two of one rotation pair);
        // NormSilu: a warp per output (its gate and up rows).
        let warps = if matches!(kind, Gemv::NormSilu) { n_out } else { n_out.div_ceil(2) };
        let blocks = warps.div_ceil(super::GEMV_WARPS);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (32 * super::GEMV_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, k, acc) = (n_out as i32, *cols as i32, i32::from(accumulate));
        // With the deep switch: the residual GEMV at four loads per row in flight where its
        // grid fits two blocks per SM, the prenormed QKV + RoPE at three where three fit
        // (see `deep_gemv_fits`).
        let name = match kind {
            Gemv::PlainStats(_) if self.gemv_deep && deep_gemv_fits(blocks, *cols, 4, self.n_sms) => {
                super::GEMV_STATS_U4_M1
            }
            Gemv::NormRope(_)
                if pre
                    && self.gemv_deep
                    && self.qkv_trigger & 4 == 0
                    && deep_gemv_fits(blocks, *cols, 3, self.n_sms) =>
            {
                super::GEMV_PNORM_ROPE_U3_M1
            }
            _ if pre => pnorm,
            _ if n_tokens == 1 && !self.gemv_pipe => flat,
            _ => names[n_tokens - 1],
        };
        // The prepared buffers by address, where this GEMV reads them (pre) or writes them
        // (PlainStats); both stay where they are while graphs hold them (buffers_moving).
        let prepared = (pre || matches!(kind, Gemv::PlainStats(_)))
            .then(|| (self.prenorm_xg.device_ptr(&st).0, self.prenorm_parts.device_ptr(&st).0));
        let (xg, parts) = prepared.unwrap_or_default();
        let mut b = Launch::new(&st, self.dev.func(name));
        b.arg(w);
        if pre {
            b.arg(&xg).arg(&parts);
        } else {
            b.arg(x).arg(norm);
        }
        b.arg(&eps).arg(&n).arg(&k).arg(&mut *out).arg(&acc);
        match &mut kind {
            Gemv::NormRope(r) => {
                b.arg(&self.pos).arg(&self.inv_freq).arg(&self.slots);
                b.arg(&r.n_heads).arg(&r.n_kv).arg(&r.head_dim).arg(&r.interleaved).arg(&r.block_size);
                b.arg(&mut *r.cache).arg(&r.half);
                // The attention after it may be scheduled early only if launched programmatically.
                let trigger = if self.qkv_lets_attention_in_early() { (self.qkv_trigger & 3) as i32 } else { 0 };
                b.arg(&trigger);
            }
            Gemv::PlainStats(g) => {
                b.arg(*g).arg(&xg).arg(&parts);
            }
            _ => {}
        }
        // SAFETY: argument types match the kernel; x holds n_tokens rows of `cols` (a
        // multiple of 8, so its float4 reads stay aligned), out as many of n_out, W `rows`;
        // NormRope: out is one token's [q|k|v] of whole heads, and the step's slot (which
        // begin_step uploaded with its position) lies in the cache; PlainStats: one token,
        // n_out a multiple of NORM_SPAN (every warp of a block has rows: the kernel's
        // barrier), g, xg n_out wide and n_out / NORM_SPAN partial sums (checked by
        // prenorm); with `pre`, those describe x (its address, width and norm weight,
        // checked above).
        unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: GEMV");
        if pre {
            self.prenorm_taken += 1;
        }
        if name == super::GEMV_STATS_U4_M1 || name == super::GEMV_PNORM_ROPE_U3_M1 {
            self.deep_taken += 1;
        }
    }

    /// Whether a one-token residual GEMV (`w` into x) leaves the inputs of the next
    /// GEMV's RMSNorm with weight `next_norm`, and if so, launches it (`x` += W · `a`): it
    /// writes x · weight and the sums of x² per block's rows as it writes x, so that the
    /// normed GEMV after it (`GEMV_PNORM_M1`) runs the loop of a plain GEMV and scales at
    /// the end, with no norm of its own first (lab: the block's norm made the QKV and
    /// gate/up GEMVs 28% and 15% slower). False (nothing launched) when the switch is off
    /// or the step, weights or widths do not fit.
    fn prenorm(
        &mut self,
        w: &CudaLinear,
        a: &CudaSlice<f32>,
        n_tokens: usize,
        x: &mut CudaSlice<f32>,
        next_norm: Option<&CudaSlice<f32>>,
    ) -> bool {
        let Some(g) = next_norm else { return false };
        let rows = w.rows();
        if !(self.gemv_prenorm
            && self.gemv_pipe
            && n_tokens == 1
            && self.takes_gemv(w, 1)
            && rows.is_multiple_of(super::NORM_SPAN)
            && g.len() == rows)
        {
            return false;
        }
        let st = self.dev.stream().clone();
        if self.prenorm_xg.len() < rows {
            self.buffers_moving();
            self.prenorm_xg = st.alloc_zeros::<f32>(rows).expect("CUDA: the prepared norm input");
            self.prenorm_parts = st.alloc_zeros::<f32>(rows / super::NORM_SPAN).expect("CUDA: the prepared norm sums");
        }
        let t = self.tic();
        // (A plain GEMV: `a` stands in for the norm weight it does not read.)
        self.gemv(Gemv::PlainStats(g), w, a, a, 0.0, 1, rows, x, true);
        self.prenormed = Some((x.device_ptr(&st).0, g.device_ptr(&st).0, rows));
        self.toc("gemv_stats", t);
        true
    }

    /// Forgets what a residual kernel prepared for the norm after it (the GEMV's sums,
    /// `prenormed`; the split-K kernel's bf16 norm, `normed_bf16`): x or the scratch may be
    /// written otherwise from here.
    fn forget_prepared(&mut self) {
        self.prenormed = None;
        self.normed_bf16 = None;
    }

    /// Grows the bf16 GEMM input scratch to `len` values (dropping captured graphs).
    fn grow_x_bf16(&mut self, len: usize) {
        // (Every writer of the scratch but the split-K residual kernel comes here first.)
        self.normed_bf16 = None;
        if self.x_bf16.len() < len {
            self.buffers_moving();
            let st = self.dev.stream().clone();
            self.x_bf16 = st.alloc_zeros::<u16>(len.next_power_of_two()).expect("CUDA: GEMM scratch");
        }
    }

    /// The step's RoPE kernel, k and v into the cache. With `with_q`, q and k rotated in
    /// place in `qkv` (`rope_write_kv`). Without it (a step whose warp-specialized attention
    /// rotates q itself), the cache gets what `rope_write_kv` would store, `qkv` is only
    /// read, and the attention's q takes the cos/sin from `rope_cs`. The grouped kernel
    /// (`rope_write_kv_groups_*`, `rope_write_k_f16`) writes the step's cos/sin to
    /// `rope_cs` in its first launch and reads them in the later ones; the A/B forms, a block
    /// per token (`DISAGG_CUDA_ROPE_PAIRS=0` with q, `DISAGG_CUDA_ROPE_K_ROUND=0` without),
    /// take the same arguments, and only the loop form without q writes the table too.
    #[allow(clippy::too_many_arguments)]
    fn rope_launch(
        &mut self,
        qkv: &CudaSlice<f32>,
        layer: usize,
        batch: &StepBatch,
        rope: &Rope,
        attn: &AttnShape,
        kv: &mut CudaKv,
        with_q: bool,
    ) {
        assert!(attn.head_dim <= 256, "CUDA: RoPE takes head_dim ≤ 256");
        assert!(with_q || matches!(kv.layers[layer], KvBuf::F16(_)), "CUDA: k-only RoPE takes an f16 cache");
        let t = self.tic();
        let st = self.dev.stream().clone();
        let need = batch.n_tokens * attn.head_dim;
        if self.rope_cs.len() < need {
            self.buffers_moving();
            self.rope_cs = st.alloc_zeros::<f32>(need.next_power_of_two()).expect("CUDA: RoPE cos/sin");
            self.rope_cs_ready = false;
        }
        let group = self.rope_group;
        let dtype = kv.shape.dtype;
        // The grouped kernel, a thread per (token, group, pair); or a block per token.
        let grouped = if with_q { self.rope_pairs } else { self.rope_k_round };
        let (name, ready, grid) = if grouped {
            let groups = if with_q { attn.n_heads.div_ceil(group) } else { 0 } + attn.n_kv_heads.div_ceil(group);
            let name = match (dtype, with_q) {
                (KvDtype::F16, true) => "rope_write_kv_groups_f16",
                (KvDtype::F32, true) => "rope_write_kv_groups_f32",
                (KvDtype::Fp8, true) => "rope_write_kv_groups_fp8",
                (_, false) => "rope_write_k_f16",
            };
            (name, i32::from(self.rope_cs_ready), (batch.n_tokens * groups * attn.head_dim / 2).div_ceil(128))
        } else {
            let name = match (dtype, with_q) {
                (KvDtype::F16, true) => "rope_write_kv_f16",
                (KvDtype::F32, true) => "rope_write_kv_f32",
                (KvDtype::Fp8, true) => "rope_write_kv_fp8",
                (_, false) => "rope_write_k_f16_loops",
            };
            (name, 0, batch.n_tokens)
        };
        // The block per token with q leaves the table as it was.
        let writes_table = grouped || !with_q;
        let half = kv.half() as i64;
        let (nh, nkv, hd) = (attn.n_heads as i32, attn.n_kv_heads as i32, attn.head_dim as i32);
        let (il, bs) = (i32::from(rope.interleaved), batch.block_size as i32);
        let (nt, gr) = (batch.n_tokens as i32, group as i32);
        let cfg = LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let mut b = Launch::new(&st, self.dev.func(name));
        b.arg(qkv).arg(&self.pos).arg(&self.inv_freq).arg(&self.slots).arg(&nt);
        b.arg(&nh).arg(&nkv).arg(&hd).arg(&il).arg(&bs);
        match &mut kv.layers[layer] {
            KvBuf::F16(c) => b.arg(c),
            KvBuf::F32(c) => b.arg(c),
            KvBuf::Fp8(c) => b.arg(c),
        };
        b.arg(&half).arg(&mut self.rope_cs).arg(&ready).arg(&gr);
        // SAFETY: argument types match the kernel (without q, an f16 cache:
        // `attention_takes_q_rope` checked it); qkv holds n_tokens rows of q|k|v, the slots
        // lie in the cache, rope_cs holds n_tokens × head_dim floats (with `ready`, this
        // step's, written by an earlier layer's launch on this stream).
        unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: RoPE + KV write");
        self.rope_cs_ready |= writes_table;
        self.toc("rope_write_kv", t);
    }

    /// out[n × rows] (+)= x_bf16[n × cols] · Wᵀ on cuBLAS, W bf16: the input already in the
    /// bf16 scratch (cast, or written there by a fused RMSNorm).
    fn gemm_bf16_scratch(&mut self, w: &CudaLinear, n_tokens: usize, out: &mut CudaSlice<f32>, accumulate: bool) {
        self.gemm_bf16_scratch_to(w, n_tokens, out, accumulate, false);
    }

    /// [`Self::gemm_bf16_scratch`]; with `c_bf16` (cuBLAS only, not accumulating) the
    /// output is written as bf16 into the first half of `out`'s bytes.
    fn gemm_bf16_scratch_to(
        &mut self,
        w: &CudaLinear,
        n_tokens: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
        c_bf16: bool,
    ) {
        let CudaLinear::Bf16 { w, rows, cols } = w else { unreachable!("bf16 GEMM of f32 weights") };
        assert!(self.x_bf16.len() >= n_tokens * cols && out.len() >= n_tokens * rows, "bf16 GEMM buffers");
        assert!(!c_bf16 || !(accumulate || self.takes_skinny(*cols, n_tokens)), "bf16 GEMM output: cuBLAS, C = A·B");
        self.forget_prepared();
        let st = self.dev.stream().clone();
        if self.takes_skinny(*cols, n_tokens) {
            // Key splits: the most (≤ 8, ≤ the 64-column slabs) that keep the blocks within
            // 1.5 waves of one per SM (lab: 4,096 rows take 4, 28,672 take 1).
            let row_blocks = rows.div_ceil(super::SKINNY_ROWS);
            let si = (0..4usize)
                .rev()
                .find(|&i| (1 << i) <= cols / 64 && row_blocks << i <= 3 * self.n_sms / 2)
                .unwrap_or(0);
            let cfg = LaunchConfig {
                grid_dim: (row_blocks as u32, 1 << si, 1),
                block_dim: (super::SKINNY_ROWS as u32, 1, 1),
                shared_mem_bytes: super::skinny_smem_bytes() as u32,
            };
            let (m, n, k, acc) = (n_tokens as i32, *rows as i32, *cols as i32, i32::from(accumulate));
            let mut b = Launch::new(&st, self.dev.func(super::SKINNY_KERNELS[si]));
            b.arg(w).arg(&self.x_bf16).arg(&m).arg(&n).arg(&k).arg(&mut *out).arg(&acc);
            // SAFETY: argument types match the kernel; x holds n_tokens rows of `cols` (a
            // multiple of 64), out as many of `rows`, W `rows` × `cols`; the splits are a
            // cluster dimension the kernel was compiled with (sm_90, checked by the switch).
            unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: skinny GEMM");
            return;
        }
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let (m, n, k) = (*rows as i32, n_tokens as i32, *cols as i32);
        let (a, _ga) = w.device_ptr(&st);
        let (b, _gb) = self.x_bf16.device_ptr(&st);
        let (c, _gc) = out.device_ptr_mut(&st);
        let c_type = if c_bf16 { cudaDataType::CUDA_R_16BF } else { cudaDataType::CUDA_R_32F };
        // SAFETY: as above; types as declared (bf16 A and B, f32 or bf16 C: half the
        // bytes `out` holds).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha as *const f32 as *const _,
                a as *const _,
                cudaDataType::CUDA_R_16BF,
                k,
                b as *const _,
                cudaDataType::CUDA_R_16BF,
                k,
                &beta as *const f32 as *const _,
                c as *mut _,
                c_type,
                m,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .expect("cuBLAS: bf16 GEMM");
    }

    /// Key slices for [`Self::residual_gemm`] of `w` over `n_tokens` (1: unsplit): from
    /// `DISAGG_CUDA_SPLITK_NORM` tokens (past the GEMV and the skinny GEMM) 4 up to 64
    /// tokens and 2 up to 128 (splitklab: the down projection at 16 / 64 / 128 tokens),
    /// fewer where a slice would be narrower than [`SPLITK_MIN_COLS`] or not a whole number
    /// of 64-column slabs; rows a multiple of 4 and ≤ 8,192, the finishing kernel's shape,
    /// and no more than the columns (the bf16 scratch, sized for the input, takes the norm).
    fn splitk_splits(&self, w: &CudaLinear, n_tokens: usize) -> usize {
        let (rows, cols) = (w.rows(), w.cols());
        if self.splitk_from == 0
            || n_tokens < self.splitk_from
            || n_tokens > 128
            || !matches!(w, CudaLinear::Bf16 { .. })
            || self.takes_gemv(w, n_tokens)
            || self.takes_skinny(cols, n_tokens)
            || !rows.is_multiple_of(4)
            || rows > 8192
            || rows > cols
        {
            return 1;
        }
        let mut s = if n_tokens <= 64 { 4 } else { 2 };
        while s > 1 && !(cols.is_multiple_of(64 * s) && cols / s >= SPLITK_MIN_COLS) {
            s /= 2;
        }
        s
    }

    /// x += W · (the bf16 GEMM scratch), x being the residual stream, with `next_norm`
    /// (its weight and eps) the RMSNorm of x that comes next. Where
    /// [`Self::splitk_splits`] splits K, the slices are one strided-batched cuBLAS GEMM
    /// into partials (cuBLAS' own split-K adds a reduction launch) and one kernel
    /// (`splitk_residual_norm_bf16`) adds them to the residual and writes the next norm's
    /// bf16 output, which [`Self::rms_norm_to_bf16`] then takes instead of launching. Else
    /// one GEMM accumulating into x.
    fn residual_gemm(
        &mut self,
        w: &CudaLinear,
        n_tokens: usize,
        x: &mut CudaSlice<f32>,
        next_norm: Option<(&CudaSlice<f32>, f32)>,
    ) {
        let splits = self.splitk_splits(w, n_tokens);
        let t = self.tic();
        let op = gemm_op_name(t.is_some(), w);
        if splits == 1 {
            self.gemm_bf16_scratch(w, n_tokens, x, true);
            self.toc(op, t);
            return;
        }
        let CudaLinear::Bf16 { w, rows, cols } = w else { unreachable!("checked by splitk_splits") };
        let (rows, cols) = (*rows, *cols);
        let need = splits * n_tokens * rows;
        assert!(self.x_bf16.len() >= n_tokens * cols && x.len() >= n_tokens * rows, "split-K GEMM buffers");
        let st = self.dev.stream().clone();
        if self.splitk_part.len() < need {
            self.buffers_moving();
            self.splitk_part = st.alloc_zeros::<f32>(need.next_power_of_two()).expect("CUDA: split-K partials");
        }
        self.forget_prepared();
        let kc = cols / splits;
        let (alpha, beta) = (1f32, 0f32);
        let pstride = (n_tokens * rows) as i64;
        {
            let (a, _ga) = w.device_ptr(&st);
            let (b, _gb) = self.x_bf16.device_ptr(&st);
            let (c, _gc) = self.splitk_part.device_ptr_mut(&st);
            // SAFETY: A is W (rows × cols bf16, row-major: column-major cols × rows for
            // op T), slice s its columns s·kc…, B the scratch's n_tokens rows of `cols`
            // bf16, slice s the same columns, C the partials, slice s at s · pstride (f32,
            // `need` ≤ their length); kc a multiple of 64 keeps every slice 16-byte aligned.
            unsafe {
                blas::gemm_strided_batched_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    rows as i32,
                    n_tokens as i32,
                    kc as i32,
                    &alpha as *const f32 as *const _,
                    a as *const _,
                    cudaDataType::CUDA_R_16BF,
                    cols as i32,
                    kc as i64,
                    b as *const _,
                    cudaDataType::CUDA_R_16BF,
                    cols as i32,
                    kc as i64,
                    &beta as *const f32 as *const _,
                    c as *mut _,
                    cudaDataType::CUDA_R_32F,
                    rows as i32,
                    pstride,
                    splits as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .expect("cuBLAS: split-K GEMM");
        }
        self.toc(op, t);
        let t = self.tic();
        // (The next norm only where rms_norm_to_bf16 would write it: the fused norm on.)
        let (g, eps) = match next_norm {
            Some((g, eps)) if g.len() == rows && self.norm_cast => (Some(g), eps),
            _ => (None, 0.0),
        };
        let (s32, d, norm) = (splits as i32, rows as i32, i32::from(g.is_some()));
        let w_first = i32::from(self.norm_weights_first);
        let cfg = LaunchConfig { grid_dim: (n_tokens as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = Launch::new(&st, self.dev.func("splitk_residual_norm_bf16"));
        b.arg(&self.splitk_part).arg(&s32).arg(&pstride).arg(&mut *x);
        match g {
            Some(g) => b.arg(g),
            None => b.arg(&self.splitk_part),
        };
        b.arg(&eps).arg(&d).arg(&mut self.x_bf16).arg(&w_first).arg(&norm);
        // SAFETY: the partials hold `splits` slices of n_tokens rows of `rows` f32, x and
        // the scratch n_tokens rows of `rows` (checked above); rows a multiple of 4, ≤ 8192
        // (splitk_splits), the kernel's shape; the norm weight `rows` wide when read.
        unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: split-K residual + norm");
        if let Some(g) = g {
            self.normed_bf16 = Some((x.device_ptr(&st).0, g.device_ptr(&st).0, rows, n_tokens, eps.to_bits()));
        }
        self.toc("splitk_residual_norm", t);
    }

    /// RMSNorm of `n_tokens` rows straight into the bf16 GEMM scratch (no f32 copy, no
    /// cast) when the fused kernel takes the width (a multiple of 4, ≤ 8192).
    fn rms_norm_to_bf16(&mut self, x: &CudaSlice<f32>, norm: &CudaSlice<f32>, eps: f32, n_tokens: usize) -> bool {
        let dim = norm.len();
        if !self.norm_cast || !dim.is_multiple_of(4) || dim > 8192 {
            return false;
        }
        assert!(x.len() >= n_tokens * dim, "RMSNorm to bf16: x holds {} values, not {n_tokens} rows of {dim}", x.len());
        let st = self.dev.stream().clone();
        if let Some(note) = self.normed_bf16.take() {
            if note == (x.device_ptr(&st).0, norm.device_ptr(&st).0, dim, n_tokens, eps.to_bits()) {
                // The split-K residual kernel wrote exactly this (residual_gemm).
                self.normed_taken += 1;
                return true;
            }
        }
        let t = self.tic();
        self.grow_x_bf16(n_tokens * dim);
        let cfg = LaunchConfig { grid_dim: (n_tokens as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (d, w_first) = (dim as i32, i32::from(self.norm_weights_first));
        let mut b = Launch::new(&st, self.dev.func("rms_norm_bf16_rows"));
        b.arg(x).arg(norm).arg(&eps).arg(&d).arg(&mut self.x_bf16).arg(&w_first);
        // SAFETY: x holds n_tokens rows of `dim`, the scratch as many (grown above).
        unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: RMSNorm to bf16");
        self.toc("rms_norm_bf16", t);
        true
    }

    /// out = W · rms_norm(x) past the GEMV: the norm written as bf16 straight into the
    /// cuBLAS input where the fused kernel takes the width, else an f32 norm into `h` and
    /// the matmul (which casts). With `c_bf16`, where cuBLAS runs after the fused norm,
    /// `out` gets bf16 values (half its bytes); returns whether it did.
    #[allow(clippy::too_many_arguments)]
    fn norm_then_gemm(
        &mut self,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        n_tokens: usize,
        h: &mut CudaSlice<f32>,
        w: &CudaLinear,
        out: &mut CudaSlice<f32>,
        c_bf16: bool,
    ) -> bool {
        if n_tokens > 0
            && matches!(w, CudaLinear::Bf16 { .. })
            && norm.len() == w.cols()
            && self.rms_norm_to_bf16(x, norm, eps, n_tokens)
        {
            let c_bf16 = c_bf16 && !self.takes_skinny(w.cols(), n_tokens);
            let t = self.tic();
            self.gemm_bf16_scratch_to(w, n_tokens, out, false, c_bf16);
            self.toc(gemm_op_name(t.is_some(), w), t);
            c_bf16
        } else {
            self.rms_norm(x, norm, eps, n_tokens, h);
            self.matmul(w, h, n_tokens, out, false);
            false
        }
    }

    /// The attention into `out` (f32), or with `bf16_out` (the flash kernels, written by
    /// the kernel itself or, split, by the merge) into the bf16 GEMM scratch as the output
    /// projection's input.
    #[allow(clippy::too_many_arguments)]
    fn attention_to(
        &mut self,
        qkv: &CudaSlice<f32>,
        layer: usize,
        batch: &StepBatch,
        attn: &AttnShape,
        kv: &mut CudaKv,
        out: &mut CudaSlice<f32>,
        bf16_out: bool,
    ) {
        if batch.n_tokens == 0 {
            return;
        }
        assert!(attn.head_dim <= 256 && attn.n_heads.is_multiple_of(attn.n_kv_heads));
        assert!(!bf16_out || self.step_flash, "bf16 attention output: the flash kernels only");
        // RoPE and the KV write left by norm_qkv_rope to this kernel (keys on M).
        let rope = self.rope_pending.take();
        assert!(rope.is_none_or(|(l, _)| l == layer), "RoPE left by layer {rope:?}, attention of layer {layer}");
        let q_rope = self.q_rope_pending.take();
        assert!(
            q_rope.is_none_or(|(l, _)| l == layer),
            "q's RoPE left by layer {q_rope:?}, attention of layer {layer}"
        );
        if bf16_out {
            assert!(self.x_bf16.len() >= batch.n_tokens * attn.n_heads * attn.head_dim, "bf16 scratch");
        }
        let t = self.tic();
        let st = self.dev.stream().clone();
        let half = kv.half() as i64;
        let (nh, nkv, hd) = (attn.n_heads as i32, attn.n_kv_heads as i32, attn.head_dim as i32);
        let (bs, scale) = (batch.block_size as i32, attn.scale);
        let splits = self.step_splits;
        let split = splits > 1;
        // Split on the keys-on-M kernel in clusters: merged in the kernel, no partials.
        let cluster = self.step_cluster;
        if split && !cluster {
            let need = batch.n_tokens * attn.n_heads * splits * (attn.head_dim + 2);
            if self.attn_part.len() < need {
                self.buffers_moving();
                self.attn_part = st.alloc_zeros::<f32>(need.next_power_of_two()).expect("CUDA: attention scratch");
            }
        }
        // The flash kernels' switch bits bar RoPE and clusters (below). The keys-on-M kernel
        // waits first where the kernel before cannot have let it in early. Only the one-token
        // QKV GEMV that applies RoPE itself can (its trigger bits), and where RoPE is left to
        // this kernel the kernel before is the QKV GEMM or the plain GEMV.
        let wait_first = self.km_wait_first && (rope.is_some() || !self.qkv_lets_attention_in_early());
        let flash_flags = self.flash_lean_loads as i32
            | (self.flash_wide_merge as i32) << 1
            | (self.flash_mask_edge as i32) << 2
            | (bf16_out as i32) << 3
            | (self.flash_pair_loads as i32) << 4
            | (self.km_early as i32) << 7
            | (self.km_bulk as i32) << 8
            | (self.flash_lazy_rescale as i32) << 9
            | (self.flash_pp_turns as i32) << 10
            | (self.flash_merge_ilp as i32) << 12
            | (self.km_batch_loads as i32) << 13
            | (self.cluster_relaxed_exit as i32) << 14
            | (wait_first as i32) << 15
            | (self.km_kv_early as i32) << 16;
        match &mut kv.layers[layer] {
            c @ (KvBuf::F16(_) | KvBuf::Fp8(_)) if self.step_flash => {
                let name = self.step_flash_kernel;
                // FP8 on an f16 kernel: the step's blocks to the f16 copy first.
                let copy_half =
                    (self.step_table_blocks * kv.shape.block_size * kv.shape.n_kv_heads * kv.shape.head_dim) as i64;
                if self.step_fp8_copy {
                    let KvBuf::Fp8(c8) = &*c else { unreachable!("step_fp8_copy: an FP8 cache") };
                    let be = (kv.shape.block_size * kv.shape.n_kv_heads * kv.shape.head_dim) as i32;
                    let n = self.step_table_blocks as i32;
                    let threads = self.step_table_blocks * be as usize / 16;
                    let mut b = Launch::new(&st, self.dev.func("kv_fp8_to_f16_blocks"));
                    b.arg(c8).arg(&half).arg(&self.tables).arg(&n).arg(&be).arg(&mut self.kv_copy).arg(&copy_half);
                    // SAFETY: argument types match the kernel; the tables index the cache's
                    // blocks, and the copy (sized in prepare_step) holds 2 × n blocks.
                    unsafe { b.launch(launch_cfg(threads), self.pdl) }.expect("CUDA: FP8 cache to f16");
                }
                let cfg = LaunchConfig {
                    grid_dim: (self.n_fa_tiles as u32, attn.n_kv_heads as u32, splits as u32),
                    block_dim: (super::flash_block_threads(name) as u32, 1, 1),
                    shared_mem_bytes: super::flash_smem_bytes(name, attn.head_dim) as u32,
                };
                let mut b = Launch::new(&st, self.dev.func(name));
                b.arg(qkv);
                match c {
                    KvBuf::F16(c) => b.arg(&mut *c).arg(&half).arg(&self.fa_tiles).arg(&self.tables),
                    KvBuf::Fp8(c) if !self.step_fp8_copy => {
                        assert!(name.starts_with("flash_decode_km_fp8"), "FP8 cache: its keys-on-M kernel");
                        b.arg(&mut *c).arg(&half).arg(&self.fa_tiles).arg(&self.tables)
                    }
                    // The copy's block i is the i-th of the step's tables: identity tables.
                    KvBuf::Fp8(_) => b.arg(&mut self.kv_copy).arg(&copy_half).arg(&self.fa_tiles).arg(&self.iota),
                    KvBuf::F32(_) => unreachable!("matched above"),
                };
                b.arg(&nh).arg(&nkv).arg(&bs).arg(&scale).arg(&self.max_ctx_dev);
                // Split: each block writes its partials to the scratch, merged below.
                // The kernel's switch bits (FLASH_LEAN_LOADS, FLASH_WIDE_MERGE,
                // FLASH_MASK_EDGE, FLASH_PAIR_LOADS, the keys-on-M kernel's FLASH_EARLY,
                // FLASH_BULK, FLASH_MERGE_ILP, FLASH_BATCH_LOADS, FLASH_WAIT_FIRST, FLASH_RELAXED_EXIT,
                // FLASH_KV_EARLY, FLASH_LAZY_RESCALE in ops.cu), and FLASH_OUT_BF16: the bf16 GEMM scratch
                // in place of `out`.
                let flags = flash_flags
                    | (rope.is_some() as i32) << 5
                    | (cluster as i32) << 6
                    | (q_rope.is_some() as i32) << 11;
                if bf16_out && (!split || cluster) {
                    b.arg(&mut self.x_bf16);
                } else {
                    b.arg(&mut *out);
                }
                b.arg(&mut self.attn_part).arg(&flags);
                let km = super::is_km_kernel(name);
                assert!(km || rope.is_none(), "RoPE in the attention: the keys-on-M kernel only");
                let pp = super::is_pp_kernel(name);
                assert!(pp || q_rope.is_none(), "q's RoPE in the attention: the warp-specialized kernel only");
                let il = i32::from(rope.or(q_rope).is_some_and(|(_, il)| il));
                if km {
                    // FLASH_ROPE: q rotated as read; k and v of each row stored at its slot
                    // (the cache is written through this launch, as rope_write_kv would).
                    b.arg(&self.inv_freq).arg(&self.slots).arg(&il);
                }
                if pp {
                    // FLASH_PP_ROPE_Q: q rotated as loaded, by rope_write_k_f16's cos/sin.
                    b.arg(&self.rope_cs).arg(&il);
                }
                assert!(km || !cluster, "clusters: the keys-on-M kernel only");
                if cluster {
                    // FLASH_CLUSTER: a (tile, KV head)'s splits are one cluster along z.
                    b.cluster((1, 1, splits as u32));
                }
                // SAFETY: argument types match the kernel; the tiles cover this step's
                // rows and their tables index the cache; the scratch holds every partial;
                // the slots lie in the cache.
                unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: flash attention");
            }
            layer_kv => {
                // (The flag follows the last cache made; a layer's own cache is checked.)
                assert!(!bf16_out, "bf16 attention output: the flash kernel, on an f16 cache, only");
                assert!(rope.is_none(), "RoPE in the attention: the keys-on-M kernel only");
                let name = match (&*layer_kv, split) {
                    (KvBuf::F16(_), false) => "attention_f16",
                    (KvBuf::F32(_), false) => "attention_f32",
                    (KvBuf::Fp8(_), false) => "attention_fp8",
                    (KvBuf::F16(_), true) => "attention_split_f16",
                    (KvBuf::F32(_), true) => "attention_split_f32",
                    (KvBuf::Fp8(_), true) => "attention_split_fp8",
                };
                let cfg = LaunchConfig {
                    grid_dim: (batch.n_tokens as u32, attn.n_heads as u32, splits as u32),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = Launch::new(&st, self.dev.func(name));
                b.arg(qkv);
                match &*layer_kv {
                    KvBuf::F16(c) => b.arg(c),
                    KvBuf::F32(c) => b.arg(c),
                    KvBuf::Fp8(c) => b.arg(c),
                };
                b.arg(&half).arg(&self.pos).arg(&self.table_off).arg(&self.tables);
                b.arg(&nh).arg(&nkv).arg(&hd).arg(&bs).arg(&scale).arg(&self.max_ctx_dev);
                // Split: each block writes its partial to the scratch, merged below.
                if split {
                    b.arg(&mut self.attn_part);
                } else {
                    b.arg(&mut *out);
                }
                // SAFETY: argument types match the kernel; tables index the cache; the
                // scratch holds every partial.
                unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: attention");
            }
        }
        if split && !cluster {
            let sp = splits as i32;
            let mcfg = LaunchConfig {
                grid_dim: (batch.n_tokens as u32, attn.n_heads as u32, 1),
                block_dim: (attn.head_dim.min(256) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = Launch::new(&st, self.dev.func("attention_merge"));
            b.arg(&self.attn_part).arg(&sp).arg(&nh).arg(&hd);
            if bf16_out {
                b.arg(&mut self.x_bf16);
            } else {
                b.arg(&mut *out);
            }
            let bf16 = i32::from(bf16_out);
            b.arg(&bf16);
            // SAFETY: the partials were written just above for these tokens and heads.
            unsafe { b.launch(mcfg, self.pdl) }.expect("CUDA: attention merge");
        }
        // After the merge, which writes every row (a split step's keys-on-M rows too, from
        // partials no kernel wrote for them).
        if let Some(part) = self.step_km_part {
            // A split mixed step's one-row spans: the keys-on-M kernel over the cache
            // itself (an FP8 cache too), their tiles after the others', their own longest
            // context; one split, or splits merged in clusters (no partials).
            assert!(part.splits == 1 || part.cluster, "a split step's keys-on-M launch: clusters only");
            assert!(rope.is_none() && q_rope.is_none(), "a split step: RoPE before the attention");
            let cfg = LaunchConfig {
                grid_dim: (part.n as u32, attn.n_kv_heads as u32, part.splits as u32),
                block_dim: (super::flash_block_threads(part.kernel) as u32, 1, 1),
                shared_mem_bytes: super::flash_smem_bytes(part.kernel, attn.head_dim) as u32,
            };
            let tiles = self.fa_tiles.slice(4 * part.at..4 * (part.at + part.n));
            let ctx = self.max_ctx_dev.slice(1..2);
            let (flags, il) = (flash_flags | i32::from(part.cluster) << 6, 0i32);
            let mut b = Launch::new(&st, self.dev.func(part.kernel));
            b.arg(qkv);
            // (The kernel was named by the last cache made: this layer's must match it.)
            match &mut kv.layers[layer] {
                KvBuf::F16(c) if !part.kernel.contains("_fp8_") => b.arg(c),
                KvBuf::Fp8(c) if part.kernel.contains("_fp8_") => b.arg(c),
                _ => unreachable!("a split step's {}: another cache element type in layer {layer}", part.kernel),
            };
            b.arg(&half).arg(&tiles).arg(&self.tables);
            b.arg(&nh).arg(&nkv).arg(&bs).arg(&scale).arg(&ctx);
            if bf16_out {
                b.arg(&mut self.x_bf16);
            } else {
                b.arg(&mut *out);
            }
            b.arg(&mut self.attn_part).arg(&flags);
            b.arg(&self.inv_freq).arg(&self.slots).arg(&il);
            if part.cluster {
                b.cluster((1, 1, part.splits as u32));
            }
            // SAFETY: argument types match the kernel (its cache's element type named in
            // its name); its tiles (one row each) and their tables index the cache; its
            // splits merge in clusters, so the partials' scratch is not written.
            unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: flash attention (keys on M)");
        }
        self.toc(if self.step_flash { "attention_flash" } else { "attention" }, t);
    }

    /// Per-step metadata: token ids and logit rows, the RoPE frequencies when they
    /// change, each token's slot and position, the block tables, the longest
    /// context, the flash kernel's query tiles, and the attention's key splits.
    fn prepare_step(&mut self, tokens: &[u32], batch: &StepBatch, rope: &Rope, attn: &AttnShape, logit_rows: &[u32]) {
        let mut slots = vec![0i64; batch.n_tokens];
        let mut pos = vec![0i32; batch.n_tokens];
        let mut table_off = vec![0i32; batch.n_tokens];
        let group = attn.n_heads / attn.n_kv_heads.max(1);
        // Some sequence computes more than one row (a prompt or a chunk of one).
        let prefill = batch.seqs.iter().any(|s| s.rows.len() > 1);
        // The keys-on-M kernel takes one-row spans (a group that fits its MMA's 8 columns)
        // on an f16 or FP8 cache. An FP8 cache takes it at decode (one token of every
        // sequence) for the whole step, and else the f16 kernels over a copy.
        let fp8 = self.kv_fp8.get();
        let km_fits = (fp8 || self.kv_f16.get())
            && group <= 8
            && self.flash_decode
            && self.decode_km
            && self.dev.smem_fits(km_kernel(attn.head_dim, fp8));
        let fp8_km = fp8 && km_fits && batch.seqs.iter().all(|s| s.rows.len() == 1);
        let shape_ok = matches!(attn.head_dim, 64 | 128) && (1..=64).contains(&group);
        // A split mixed step: a prompt beside one-row spans, which take the keys-on-M
        // kernel in a launch of their own with splits merged in clusters (it has no
        // partials' scratch); the others the flash kernel (an FP8 cache: over a copy of
        // their blocks alone).
        let km_clusters = self.attn_cluster && self.km_clustered.contains_key(km_kernel(attn.head_dim, fp8));
        let mixed_split = self.mixed_split
            && (self.fp8_f16_copy || !fp8)
            && self.flash
            && shape_ok
            && km_fits
            && km_clusters
            && prefill
            && batch.seqs.iter().any(|s| s.rows.len() == 1);
        let km_span = |s: &SeqSpan| mixed_split && s.rows.len() == 1;
        let layout = StepTables::new(batch.seqs, km_span);
        for (s, span) in batch.seqs.iter().enumerate() {
            for (i, row) in span.rows.clone().enumerate() {
                let p = span.pos0 + i;
                slots[row] = batch.slot(s, p) as i64;
                pos[row] = p as i32;
                table_off[row] = layout.table_off[s] as i32;
            }
        }
        let (km_max_ctx, copy_blocks) = (layout.km_max_ctx, layout.copy_blocks);
        self.max_ctx = layout.max_ctx;
        // Else an f16 copy of the step's blocks (a split step's other spans' blocks),
        // where it fits (made here, before the step's kernel is chosen; a step over the
        // copy is never captured); a copy that does not fit or cannot be made leaves the
        // step to the per-token kernel.
        let copy_bytes = 2 * 2 * copy_blocks * batch.block_size * attn.n_kv_heads * attn.head_dim;
        self.step_fp8_copy = self.flash
            && self.kv_fp8.get()
            && shape_ok
            && !fp8_km
            && self.fp8_f16_copy
            && fp8_copy_wanted(copy_bytes, prefill)
            && self.fit_fp8_copy(copy_bytes / 2, copy_blocks);
        self.step_table_blocks = copy_blocks;
        self.step_flash =
            self.flash && shape_ok && (self.kv_f16.get() || (self.kv_fp8.get() && (fp8_km || self.step_fp8_copy)));
        // (A split step that takes no flash kernel, an FP8 one without its copy, runs the
        // per-token kernel over every row.)
        if !self.step_flash {
            self.max_ctx = self.max_ctx.max(km_max_ctx);
        }
        // Flash tiles: ⌊64 / group⌋ tokens of one sequence each (their rows are the
        // group's query heads), the latest first so the causal tail does not straggle; a
        // step with a tile of more than 16 rows (prefill; a span's first tile is its
        // largest) on the warp-specialized kernel takes ⌊128 / group⌋ tokens instead. (Its
        // conditions follow the form chain flash_kernel walks: ldmatrix, fast exp and
        // 32-bit shared offsets on, then warpgroup MMAs.)
        self.step_pp = self.step_flash
            && batch.seqs.iter().any(|s| s.rows.len().min(64 / group) * group > 16)
            && self.flash_warp_spec
            && self.flash_wgmma
            && self.flash_ldmatrix
            && self.flash_fast_exp
            && self.flash_smem32
            && attn.head_dim == 128
            && self.dev.smem_fits("flash_attn_pp_f16_d128");
        // A split step's one-row spans: the keys-on-M launch's tiles, after the others.
        let [tiles, km_tiles] = if self.step_flash {
            layout.tiles(batch.seqs, if self.step_pp { 128 } else { 64 } / group, km_span)
        } else {
            Default::default()
        };
        self.step_decode = self.flash_decode && tiles.iter().all(|t| t[1] as usize * group <= 16);
        self.n_fa_tiles = tiles.len();
        let flat: Vec<i32> = tiles.iter().chain(&km_tiles).flatten().copied().collect();
        self.n_step = tokens.len();
        let packed = self.staging.packed;
        // Per-buffer uploads: the fed rows' pairs for feed_ids (packed: the ids carry them).
        let fed: Vec<i32> =
            if packed { Vec::new() } else { batch.fed.iter().flat_map(|f| [f.row as i32, f.from as i32]).collect() };
        let new_freq = self.host_inv_freq != rope.inv_freq;
        let st = self.dev.stream().clone();
        // Uploaded from pinned memory, so that no copy waits for the step in flight.
        let sz = |b: usize| b.next_multiple_of(STAGING_ALIGN);
        let bytes = sz(4 * tokens.len())
            + sz(4 * logit_rows.len())
            + if new_freq { sz(4 * rope.inv_freq.len()) } else { 0 }
            + sz(8 * slots.len())
            + sz(4 * (pos.len() + table_off.len()))
            + sz(4 * layout.tables.len())
            + sz(8)
            + sz(4 * flat.len())
            + sz(4 * fed.len());
        let sg = &mut self.staging;
        sg.begin(&self.dev.ctx, bytes + 16 * STAGING_ALIGN);
        // Packed: fed rows go up as their sampled row with the top bit set, which
        // unpack_step replaces by the token.
        let packed_ids: Vec<u32>;
        let ids = if packed && !batch.fed.is_empty() {
            let mut v = tokens.to_vec();
            for f in batch.fed {
                v[f.row as usize] = 0x8000_0000 | f.from;
            }
            packed_ids = v;
            &packed_ids[..]
        } else {
            tokens
        };
        let ids_seg = sg.segs.len();
        let mut moved = sg.put(&st, &mut self.ids, ids);
        moved |= sg.put(&st, &mut self.rows, logit_rows);
        if new_freq {
            self.host_inv_freq.clone_from(&rope.inv_freq);
            moved |= sg.put(&st, &mut self.inv_freq, &rope.inv_freq);
        }
        moved |= sg.put(&st, &mut self.slots, &slots);
        moved |= sg.put(&st, &mut self.pos, &pos);
        moved |= sg.put(&st, &mut self.table_off, &table_off);
        moved |= sg.put(&st, &mut self.tables, &layout.tables);
        // (A split step's keys-on-M launch reads the second: its rows' longest context.)
        moved |= sg.put(&st, &mut self.max_ctx_dev, &[self.max_ctx as i32, km_max_ctx as i32]);
        moved |= sg.put(&st, &mut self.fa_tiles, &flat);
        let mut up = false;
        if packed {
            up = self.unpack_step(if batch.fed.is_empty() { -1 } else { ids_seg as i32 });
        } else {
            // (Read by the feed kernel, outside any graph: it may move.)
            sg.put(&st, &mut self.fed_dev, &fed);
        }
        // (The half is free again once the stream that copied from it has passed here.)
        match &self.copy_streams {
            Some(c) if up => self.staging.end(&c.up),
            _ => self.staging.end(&st),
        }
        if !packed && !fed.is_empty() {
            let n = batch.fed.len() as i32;
            let mut b = st.launch_builder(self.dev.func("feed_ids"));
            b.arg(&mut self.ids).arg(&self.fed_dev).arg(&n).arg(&self.argmax_out);
            // SAFETY: argument types match the kernel; the fed rows lie in this step's ids
            // and their sampled rows in the last deferred sample's.
            unsafe { b.launch(launch_cfg(batch.fed.len())) }.expect("CUDA: feeding sampled ids");
        }
        if moved {
            self.buffers_moving();
        }
        let (units, per_sm) = if self.step_flash {
            // One token per tile, the group within the 8 columns of an MMA tile, and at
            // most two waves of its blocks unsplit: on the H200 (264 slots at head_dim 128)
            // measured faster than the decode form at batches 32 and 64 of Llama-3-8B (1 and
            // 2 waves of 8 KV heads' blocks), level at 128, 2–3% slower at 256 (8 waves;
            // docs/PERF.md).
            let fp8 = self.kv_fp8.get();
            let km_slots =
                self.flash_blocks_per_sm.get(km_kernel(attn.head_dim, fp8)).copied().unwrap_or(1) * self.n_sms;
            // (FP8: at any number of waves, its only flash kernel.)
            let km =
                group <= 8 && tiles.iter().all(|t| t[1] == 1) && (fp8 || tiles.len() * attn.n_kv_heads <= 2 * km_slots);
            self.step_flash_kernel = self.flash_kernel(attn.head_dim, self.step_decode, km);
            let per_sm = self.flash_blocks_per_sm.get(self.step_flash_kernel).copied().unwrap_or(1);
            (tiles.len() * attn.n_kv_heads, per_sm)
        } else {
            (batch.n_tokens * attn.n_heads, 2048 / 256)
        };
        let km = self.step_flash && super::is_km_kernel(self.step_flash_kernel);
        // What a block reads a key of its KV head: K and V, f16 or FP8 values.
        let key_bytes = 2 * attn.head_dim * if self.kv_fp8.get() { 1 } else { 2 };
        debug_assert!(!self.kv_fp8.get() || !self.step_flash || km != self.step_fp8_copy);
        let clustered = match self.km_clustered.get(self.step_flash_kernel) {
            Some([driver, full]) if km && self.attn_cluster => &(if self.cluster_waves { driver } else { full })[..],
            _ => &[],
        };
        (self.step_splits, self.step_cluster) = self.attn_splits(
            units,
            per_sm,
            batch.n_tokens * attn.n_heads,
            clustered,
            (self.step_pp, self.max_ctx, true, (lone_block_rate(self.step_flash_kernel), key_bytes)),
        );
        self.step_km_part = None;
        if self.step_flash && !km_tiles.is_empty() {
            let kernel = km_kernel(attn.head_dim, self.kv_fp8.get());
            let per_sm = self.flash_blocks_per_sm.get(kernel).copied().unwrap_or(1);
            let clustered = match self.km_clustered.get(kernel) {
                Some([driver, full]) => &(if self.cluster_waves { driver } else { full })[..],
                None => &[],
            };
            let n = km_tiles.len();
            let (splits, cluster) = self.attn_splits(
                n * attn.n_kv_heads,
                per_sm,
                n * attn.n_heads,
                clustered,
                (false, km_max_ctx, false, (lone_block_rate(kernel), key_bytes)),
            );
            self.step_km_part = Some(KmPart { at: tiles.len(), n, kernel, splits, cluster });
        }
        // (The same token and logit counts can be one token of each sequence or several
        // of fewer: the keys-on-M kernel's bit keeps their graphs apart; and the same
        // splits can merge in clusters or apart.)
        let kernel = u8::from(self.step_flash)
            | (u8::from(self.step_decode && self.step_flash) << 1)
            | (u8::from(km) << 2)
            | (u8::from(self.step_cluster) << 3);
        self.step_key = (batch.n_tokens, logit_rows.len(), self.step_splits, kernel);
    }

    /// Room for an FP8 cache's f16 copy of `elems` halves and identity tables of `blocks`
    /// (grown to powers of two); false where the device cannot give it.
    fn fit_fp8_copy(&mut self, elems: usize, blocks: usize) -> bool {
        let st = self.dev.stream().clone();
        if self.kv_copy.len() < elems {
            self.buffers_moving();
            match st.alloc_zeros::<u16>(elems.next_power_of_two()) {
                Ok(c) => self.kv_copy = c,
                Err(e) => {
                    tracing::warn!("no room for the FP8 cache's f16 copy ({} MiB): {e}", (2 * elems) >> 20);
                    return false;
                }
            }
        }
        if self.iota.len() < blocks {
            self.buffers_moving();
            let n = blocks.next_power_of_two();
            match st.clone_htod(&(0..n as u32).collect::<Vec<u32>>()) {
                Ok(t) => self.iota = t,
                Err(_) => return false,
            }
        }
        true
    }

    /// Copies the step's packed metadata up in one copy and spreads it to its buffers
    /// (`unpack_step`; fed ids in segment `ids_seg`, -1: none). True where the copy went
    /// on the upload stream ([`CopyStreams`]), not the compute stream.
    fn unpack_step(&mut self, ids_seg: i32) -> bool {
        let st = self.dev.stream().clone();
        let sg = &mut self.staging;
        let words = sg.off / 4;
        if sg.segs.is_empty() {
            return false;
        }
        // (A packed_dev allocated anew is the compute stream's until it has passed here.)
        let grew = fit(&st, &mut self.packed_dev, words);
        let side = self.copy_streams.as_ref().filter(|_| !grew);
        let mut t = UploadSegs { n: sg.segs.len() as u32, ids_seg, ..Default::default() };
        for (i, &(dst, off, bytes)) in sg.segs.iter().enumerate() {
            t.dst[i] = dst;
            t.off[i] = (off / 4) as u32;
            t.words[i] = (bytes / 4) as u32;
        }
        sg.segs.clear();
        let buf = sg.bufs[sg.cur].as_mut().expect("begin() allocated it");
        let base = buf.as_mut_ptr().expect("CUDA: pinned memory");
        let (dptr, g) = self.packed_dev.device_ptr_mut(&st);
        // On the upload stream: after the last unpack_step has read packed_dev.
        let cs = match side {
            Some(c) => {
                c.up.wait(&c.unpacked).expect("CUDA: ordering a metadata upload");
                &c.up
            }
            None => &st,
        };
        // SAFETY: the staging half holds `off` bytes written for this step, read by this
        // copy before begin() reuses it (end()'s event, recorded on the copy's stream);
        // packed_dev holds `words` words, unread by any kernel until unpack_step below.
        unsafe {
            let src = std::slice::from_raw_parts(base as *const u8, words * 4);
            cudarc::driver::result::memcpy_htod_async(dptr, src, cs.cu_stream())
                .expect("CUDA: uploading step metadata");
        }
        drop(g);
        if let Some(c) = side {
            c.uploaded.record(&c.up).expect("CUDA: recording an event");
            st.wait(&c.uploaded).expect("CUDA: ordering a metadata upload");
        }
        let mut b = st.launch_builder(self.dev.func("unpack_step"));
        b.arg(&self.packed_dev).arg(&t).arg(&self.argmax_out);
        // SAFETY: each segment's destination holds its words (the buffers put() sized), the
        // fed rows' sampled rows lie in the last deferred sample (begin_step checks).
        unsafe { b.launch(launch_cfg(words)) }.expect("CUDA: spreading step metadata");
        if let Some(c) = &self.copy_streams {
            c.unpacked.record(&st).expect("CUDA: recording an event");
        }
        side.is_some()
    }

    /// `argmax_out[r]` = the argmax of row r of `x` (rows of `dim`), r < `rows`: over
    /// several blocks per row when the rows alone leave SMs idle (`argmax_rows_split`,
    /// `DISAGG_CUDA_ARGMAX_SPLIT=0`: one block per row).
    fn argmax(&mut self, x: &CudaSlice<f32>, dim: usize, rows: usize) {
        let st = self.dev.stream().clone();
        if let (Some(_), Some((_, _, done))) = (&self.copy_streams, self.deferred.back()) {
            // The newest uncollected sample's ids have left argmax_out (long since, by then;
            // a collected one's copy is done, as is every copy before it on `down`).
            st.wait(done).expect("CUDA: ordering the argmax after the last copy of ids");
        }
        if self.argmax_out.len() < rows {
            self.argmax_out = st.alloc_zeros::<u32>(rows.next_power_of_two()).expect("CUDA: argmax buffer");
        }
        let d = dim as i32;
        let vec = i32::from(self.argmax_vec);
        let chunks = if self.argmax_split {
            (2 * self.n_sms).div_ceil(rows).min(ARGMAX_MAX_CHUNKS).min(dim.div_ceil(1024))
        } else {
            1
        };
        if chunks <= 1 {
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            let mut b = Launch::new(&st, self.dev.func("argmax_rows"));
            b.arg(x).arg(&d).arg(&mut self.argmax_out).arg(&vec);
            // SAFETY: x holds `rows` rows of dim (the engine's logits buffer).
            unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: argmax");
            return;
        }
        if self.argmax_count.len() < rows {
            let n = rows.next_power_of_two();
            self.argmax_pv = st.alloc_zeros(n * ARGMAX_MAX_CHUNKS).expect("CUDA: argmax buffer");
            self.argmax_pi = st.alloc_zeros(n * ARGMAX_MAX_CHUNKS).expect("CUDA: argmax buffer");
            self.argmax_count = st.alloc_zeros(n).expect("CUDA: argmax buffer");
        }
        // (16-byte loads: chunks of whole quads, so that every chunk of an aligned row is.)
        let chunk =
            if self.argmax_vec { dim.div_ceil(chunks).next_multiple_of(4) } else { dim.div_ceil(chunks) } as i32;
        let cfg =
            LaunchConfig { grid_dim: (chunks as u32, rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = Launch::new(&st, self.dev.func("argmax_rows_split"));
        b.arg(x).arg(&d).arg(&chunk).arg(&mut self.argmax_pv).arg(&mut self.argmax_pi);
        b.arg(&mut self.argmax_count).arg(&mut self.argmax_out).arg(&vec);
        // SAFETY: x holds `rows` rows of dim; the partials hold rows × chunks entries, the
        // counters `rows` (zero between launches: each row's last block resets its own).
        unsafe { b.launch(cfg, self.pdl) }.expect("CUDA: argmax");
    }

    /// [`Backend::run_step`] between its step events: the graph of this step's shape when
    /// there is one, else the body (captured on a shape's second step).
    fn run_step_body(&mut self, replayable: bool, body: &mut dyn FnMut(&mut Self)) {
        // (A step over an FP8 cache's f16 copy passes the copy's block count and its V
        // half's offset by value; both grow with the contexts while the shape's key stays,
        // so a replay would convert too few blocks.)
        if !(replayable && self.graphs_on) || self.step_fp8_copy {
            return body(self);
        }
        let key = self.step_key;
        if let Some(g) = self.graphs.0.get(&key) {
            g.launch().expect("CUDA: launching a decode graph");
            self.graph_counts.replayed += 1;
            return;
        }
        // The first step of a shape runs op by op (sizing every scratch buffer); the
        // second is captured.
        if self.seen.insert(key) {
            // (`DISAGG_LOG=kernels=debug` names each shape as it comes: (tokens, logit
            // rows, attention splits, kernel bits).)
            tracing::debug!(?key, "CUDA graphs: a new decode shape runs op by op");
            return body(self);
        }
        let st = self.dev.stream().clone();
        st.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("CUDA: beginning a graph capture");
        self.capturing = true;
        body(self);
        self.capturing = false;
        match st.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(g)) => {
                g.launch().expect("CUDA: launching a decode graph");
                self.graph_counts.captured += 1;
                // (A graph dropped while in flight is freed when it completes. The shape
                // it held runs op by op once more before it is captured again, so that
                // more shapes than the cache keeps, taken in turn, are not captured at
                // every step.)
                if let Some(dropped) = self.graphs.0.insert(key, g) {
                    self.seen.remove(&dropped);
                    self.graph_counts.dropped += 1;
                }
            }
            other => {
                // Nothing ran during the capture: run the step op by op, and stop capturing.
                // The captured launches marked the step's cos/sin table written; it is not.
                tracing::warn!("CUDA graph capture failed ({:?}); decode steps run op by op", other.err());
                self.graphs_on = false;
                self.rope_cs_ready = false;
                body(self);
            }
        }
    }
}

/// The profile's name for a GEMM: "matmul", and while profiling "matmul ROWSxCOLS" so
/// that each weight shape's time shows apart (a few shapes per model, named once).
fn gemm_op_name(profiling: bool, w: &CudaLinear) -> &'static str {
    if !profiling {
        return "matmul";
    }
    static NAMES: std::sync::Mutex<Vec<((usize, usize), &'static str)>> = std::sync::Mutex::new(Vec::new());
    let shape = (w.rows(), w.cols());
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, n)) = names.iter().find(|(s, _)| *s == shape) {
        return n;
    }
    let n: &'static str = Box::leak(format!("matmul {}x{}", shape.0, shape.1).into_boxed_str());
    names.push((shape, n));
    n
}

/// Hands every row of the stacked `parts` (each `cols` wide), dequantized to f32, to
/// `each`, in order.
fn dequantized_rows(parts: &[WeightPart], cols: usize, mut each: impl FnMut(&[f32])) -> Result<(), KernelError> {
    let mut row = vec![0f32; cols];
    for p in parts {
        let rb = p.ty.row_bytes(cols).ok_or_else(|| KernelError::Shape(format!("{} rows of {cols}", p.ty.name())))?;
        for r in 0..p.rows {
            crate::quant::dequantize_row(p.ty, &p.bytes[r * rb..(r + 1) * rb], &mut row);
            each(&row);
        }
    }
    Ok(())
}

impl Backend for CudaBackend {
    type Linear = CudaLinear;
    type Vector = CudaSlice<f32>;
    type Act = CudaSlice<f32>;
    type Kv = CudaKv;

    fn describe(&self) -> String {
        let mut d = format!("{}, weights {}", self.dev.describe(), if self.bf16_weights { "bf16" } else { "f32" });
        if self.hbm_bytes_per_s > 0.0 {
            d += &format!(", memory {:.2} TB/s by its clock and bus", self.hbm_bytes_per_s / 1e12);
        }
        if let Some([c, _]) = self.km_clustered.get(km_kernel(128, false)) {
            let sizes = c.iter().enumerate().skip(2).map(|(s, n)| format!("{s}: {n}")).collect::<Vec<_>>();
            d += &format!(
                ", decode attention blocks resident (head_dim 128): {} alone, in clusters {{{}}}",
                c[0],
                sizes.join(", ")
            );
        }
        d
    }

    fn linear(&self, parts: &[WeightPart]) -> Result<CudaLinear, KernelError> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(0);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(KernelError::Shape("stacked matrices must have the same number of columns".into()));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let st = self.dev.stream();
        let oom = |e: cudarc::driver::DriverError| {
            KernelError::OutOfMemory(format!(
                "a {rows}×{cols} weight matrix does not fit on the device ({e}); use a smaller model or another device"
            ))
        };
        if self.bf16_weights {
            let mut host: Vec<u16> = Vec::with_capacity(rows * cols);
            dequantized_rows(parts, cols, |row| host.extend(row.iter().map(|x| half::bf16::from_f32(*x).to_bits())))?;
            let w = st.clone_htod(&host).map_err(oom)?;
            Ok(CudaLinear::Bf16 { w, rows, cols })
        } else {
            let mut host: Vec<f32> = Vec::with_capacity(rows * cols);
            dequantized_rows(parts, cols, |row| host.extend_from_slice(row))?;
            let w = st.clone_htod(&host).map_err(oom)?;
            Ok(CudaLinear::F32 { w, rows, cols })
        }
    }

    fn vector(&self, v: &[f32]) -> CudaSlice<f32> {
        self.dev.stream().clone_htod(v).expect("CUDA: uploading a weight vector")
    }

    fn act(&self, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        self.zeros(len.max(1), "an activation buffer")
    }

    fn reserve(&mut self, lim: &StepLimits) -> Result<(), KernelError> {
        let n = lim.max_tokens.max(1);
        // The bf16 copy of a GEMM's input (only for steps too big for the GEMV kernel).
        if n > self.gemv_max_tokens {
            let len = n * lim.widest_input;
            self.normed_bf16 = None;
            self.x_bf16 = self.zeros(len, "the bf16 GEMM input")?;
        }
        // Split-K partials, one per (token, query head, split). By waves: at most
        // ATTN_PART_ROWS_PER_SM × SMs of them. By the earlier rule: a step splits only
        // while its units of work (flash tiles of ≤ 64 or 128 rows × KV heads, or tokens × heads)
        // are fewer than 2 × SMs, into at most ⌈2 × SMs / units⌉ splits, so
        // rows × splits < 64 × 4 × SMs (the same bound).
        let len = ATTN_PART_ROWS_PER_SM * self.n_sms * (lim.attn.head_dim + 2);
        self.attn_part = self.zeros(len, "the attention partials")?;
        // Step metadata.
        self.ids = self.zeros(n, "step metadata (ids)")?;
        self.slots = self.zeros(n, "step metadata (slots)")?;
        self.pos = self.zeros(n, "step metadata (positions)")?;
        self.table_off = self.zeros(n, "step metadata (table offsets)")?;
        self.fa_tiles = self.zeros(4 * n, "step metadata (tiles)")?;
        // RoPE's cos/sin per token: the step's table for the grouped RoPE kernels' later
        // layers and the warp-specialized attention's q.
        self.rope_cs = self.zeros(n * lim.attn.head_dim, "RoPE's cos/sin")?;
        self.rope_cs_ready = false;
        self.tables = self.zeros(lim.max_table_entries.max(1), "step metadata (block tables)")?;
        self.rows = self.zeros(lim.max_seqs.max(1), "step metadata (logit rows)")?;
        self.argmax_out = self.zeros(lim.max_seqs.max(1), "the sampled ids")?;
        let rows = lim.max_seqs.max(1).next_power_of_two();
        self.argmax_pv = self.zeros(rows * ARGMAX_MAX_CHUNKS, "the argmax partials")?;
        self.argmax_pi = self.zeros(rows * ARGMAX_MAX_CHUNKS, "the argmax partials")?;
        self.argmax_count = self.zeros(rows, "the argmax counters")?;
        let st = self.dev.stream().clone();
        let rows = lim.max_seqs.max(1);
        let bytes = rows * (crate::backend::SAMPLE_CANDIDATES * 8 + 300);
        self.sample = SampleBufs::new(&st, rows).map_err(|e| self.oom("the sampling buffers".into(), bytes, e))?;
        self.buffers_moving();
        Ok(())
    }

    fn kv_cache(&self, shape: KvShape) -> Result<CudaKv, KernelError> {
        if shape.dtype == KvDtype::Fp8 && self.dev.arch < (8, 9) {
            return Err(KernelError::Shape(format!(
                "an FP8 KV cache needs a GPU of compute capability 8.9 or newer (this is sm_{}{}); use --kv-dtype f16",
                self.dev.arch.0, self.dev.arch.1
            )));
        }
        self.kv_f16.set(shape.dtype == KvDtype::F16);
        self.kv_fp8.set(shape.dtype == KvDtype::Fp8);
        let per_layer = 2 * shape.n_blocks * shape.block_size * shape.n_kv_heads * shape.head_dim;
        let st = self.dev.stream();
        let free = match self.mem_info() {
            Ok((free, total)) => format!("{} MiB free of {} MiB before it", free >> 20, total >> 20),
            Err(_) => "free memory unknown".into(),
        };
        let mut layers = Vec::with_capacity(shape.n_layers);
        for _ in 0..shape.n_layers {
            let r = match shape.dtype {
                KvDtype::F16 => st.alloc_zeros::<u16>(per_layer).map(KvBuf::F16),
                KvDtype::F32 => st.alloc_zeros::<f32>(per_layer).map(KvBuf::F32),
                KvDtype::Fp8 => st.alloc_zeros::<u8>(per_layer).map(KvBuf::Fp8),
            };
            layers.push(r.map_err(|e| {
                KernelError::OutOfMemory(format!(
                    "the KV cache ({} MiB) does not fit on the device ({e}; {free}); lower --kv-cache-mib or size \
                     it with --gpu-memory-utilization",
                    shape.total_bytes() >> 20
                ))
            })?);
        }
        Ok(CudaKv { shape, layers })
    }

    fn begin_step(&mut self, tokens: &[u32], batch: &StepBatch, rope: &Rope, attn: &AttnShape, logit_rows: &[u32]) {
        assert!(
            batch.fed.is_empty()
                || self.deferred.back().is_some_and(|d| batch.fed.iter().all(|f| (f.from as usize) < d.1)),
            "CUDA: fed tokens without a deferred sample of their rows"
        );
        assert!(
            self.rope_pending.is_none() && self.q_rope_pending.is_none(),
            "CUDA: RoPE left to an attention that never ran"
        );
        let t = self.tic();
        self.forget_prepared();
        self.rope_cs_ready = false;
        self.prepare_step(tokens, batch, rope, attn, logit_rows);
        self.toc("step_metadata_upload", t);
    }

    fn run_step(&mut self, replayable: bool, body: &mut dyn FnMut(&mut Self)) {
        let start = self.mark();
        self.run_step_body(replayable, body);
        let end = self.mark();
        self.step_events.push_back((start, end));
    }

    fn embed(&mut self, table: &CudaLinear, ids: &[u32], out: &mut CudaSlice<f32>) {
        let dim = table.cols();
        assert!(ids.iter().all(|&i| (i as usize) < table.rows()) && out.len() >= ids.len() * dim);
        assert_eq!(ids.len(), self.n_step, "CUDA: embed takes the ids given to begin_step");
        self.forget_prepared();
        let st = self.dev.stream().clone();
        let d_ids = &self.ids;
        let (d, n) = (dim as i32, ids.len() as i32);
        let cfg = launch_cfg(ids.len() * dim);
        let r = match table {
            CudaLinear::F32 { w, .. } => {
                let mut b = Launch::new(&st, self.dev.func("embed_rows"));
                b.arg(w).arg(d_ids).arg(&d).arg(&n).arg(out);
                // SAFETY: argument types match the kernel; ids index rows of the table.
                unsafe { b.launch(cfg, self.pdl) }
            }
            CudaLinear::Bf16 { w, .. } => {
                let mut b = Launch::new(&st, self.dev.func("embed_rows_bf16"));
                b.arg(w).arg(d_ids).arg(&d).arg(&n).arg(out);
                // SAFETY: as above.
                unsafe { b.launch(cfg, self.pdl) }
            }
        };
        r.expect("CUDA: embedding");
    }

    fn rms_norm(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        n_tokens: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if n_tokens > 0 {
            let t = self.tic();
            self.dev.rms_norm(x, w, eps, n_tokens, w.len(), out).expect("CUDA: RMSNorm");
            self.toc("rms_norm", t);
        }
    }

    fn matmul(
        &mut self,
        w: &CudaLinear,
        x: &CudaSlice<f32>,
        n_tokens: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) {
        if n_tokens == 0 {
            return;
        }
        self.forget_prepared();
        let t = self.tic();
        let (rows, cols) = (w.rows(), w.cols());
        assert!(x.len() >= n_tokens * cols && out.len() >= n_tokens * rows, "matmul buffers");
        let st = self.dev.stream().clone();
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        // Row-major out[n × rows] = x[n × cols] · Wᵀ is, column-major,
        // out(rows × n) = W(rows × cols, stored as cols × rows, transposed) · x(cols × n).
        let (m, n, k) = (rows as i32, n_tokens as i32, cols as i32);
        match w {
            CudaLinear::F32 { w, .. } => {
                let (a, _ga) = w.device_ptr(&st);
                let (b, _gb) = x.device_ptr(&st);
                let (c, _gc) = out.device_ptr_mut(&st);
                // SAFETY: pointers are live device buffers of the sizes asserted above.
                unsafe {
                    blas::sgemm(
                        *self.blas.handle(),
                        cublasOperation_t::CUBLAS_OP_T,
                        cublasOperation_t::CUBLAS_OP_N,
                        m,
                        n,
                        k,
                        &alpha,
                        a as *const f32,
                        k,
                        b as *const f32,
                        k,
                        &beta,
                        c as *mut f32,
                        m,
                    )
                }
                .expect("cuBLAS: sgemm");
            }
            CudaLinear::Bf16 { .. } if self.takes_gemv(w, n_tokens) => {
                self.gemv(Gemv::Plain, w, x, x, 0.0, n_tokens, rows, out, accumulate);
            }
            CudaLinear::Bf16 { .. } => {
                let len = n_tokens * cols;
                self.grow_x_bf16(len);
                {
                    let mut bld = Launch::new(&st, self.dev.func("cast_f32_bf16"));
                    let n64 = len as i64;
                    bld.arg(x).arg(&mut self.x_bf16).arg(&n64);
                    // SAFETY: x holds `len` values, the scratch at least as many.
                    unsafe { bld.launch(launch_cfg(len), self.pdl) }.expect("CUDA: cast to bf16");
                }
                self.gemm_bf16_scratch(w, n_tokens, out, accumulate);
            }
        }
        self.toc(if self.takes_gemv(w, n_tokens) { "gemv" } else { gemm_op_name(t.is_some(), w) }, t);
    }

    fn rope_write_kv(
        &mut self,
        qkv: &mut CudaSlice<f32>,
        layer: usize,
        batch: &StepBatch,
        rope: &Rope,
        attn: &AttnShape,
        kv: &mut CudaKv,
    ) {
        if batch.n_tokens == 0 {
            return;
        }
        self.rope_launch(qkv, layer, batch, rope, attn, kv, true);
    }

    fn attention(
        &mut self,
        qkv: &CudaSlice<f32>,
        layer: usize,
        batch: &StepBatch,
        attn: &AttnShape,
        kv: &mut CudaKv,
        out: &mut CudaSlice<f32>,
    ) {
        self.attention_to(qkv, layer, batch, attn, kv, out, false);
    }

    fn attention_residual(
        &mut self,
        qkv: &CudaSlice<f32>,
        layer: usize,
        batch: &StepBatch,
        attn: &AttnShape,
        kv: &mut CudaKv,
        out: &mut CudaSlice<f32>,
        w_o: &CudaLinear,
        x: &mut CudaSlice<f32>,
        next_norm: Option<&CudaSlice<f32>>,
    ) {
        let n = batch.n_tokens;
        let fused = self.attn_bf16
            && self.step_flash
            && n > 0
            && matches!(w_o, CudaLinear::Bf16 { .. })
            && w_o.cols() == attn.n_heads * attn.head_dim
            && !self.takes_gemv(w_o, n);
        if !fused {
            self.attention(qkv, layer, batch, attn, kv, out);
            if !self.prenorm(w_o, out, n, x, next_norm) {
                self.matmul(w_o, out, n, x, true);
            }
            return;
        }
        self.grow_x_bf16(n * w_o.cols());
        self.attention_to(qkv, layer, batch, attn, kv, out, true);
        let t = self.tic();
        self.gemm_bf16_scratch(w_o, n, x, true);
        self.toc(gemm_op_name(t.is_some(), w_o), t);
    }

    fn silu_mul(&mut self, gu: &CudaSlice<f32>, n_tokens: usize, ff: usize, out: &mut CudaSlice<f32>) {
        if n_tokens > 0 {
            let t = self.tic();
            self.dev.silu_mul(gu, n_tokens, ff, out, self.silu_rows4).expect("CUDA: SiLU·gate");
            self.toc("silu_mul", t);
        }
    }

    fn norm_matmul(
        &mut self,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        n_tokens: usize,
        h: &mut CudaSlice<f32>,
        w: &CudaLinear,
        out: &mut CudaSlice<f32>,
    ) {
        if n_tokens > 0 && self.takes_gemv(w, n_tokens) {
            let t = self.tic();
            self.gemv(Gemv::Norm, w, x, norm, eps, n_tokens, w.rows(), out, false);
            self.toc("gemv_norm", t);
        } else {
            self.norm_then_gemm(x, norm, eps, n_tokens, h, w, out, false);
        }
    }

    fn norm_qkv_rope(
        &mut self,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        h: &mut CudaSlice<f32>,
        w_qkv: &CudaLinear,
        qkv: &mut CudaSlice<f32>,
        layer: usize,
        batch: &StepBatch,
        rope: &Rope,
        attn: &AttnShape,
        kv: &mut CudaKv,
    ) {
        if !self.fuses_qkv_rope(w_qkv, batch.n_tokens, kv, layer, attn) {
            self.norm_matmul(x, norm, eps, batch.n_tokens, h, w_qkv, qkv);
            if batch.n_tokens > 0 && self.attention_takes_rope(kv, layer, attn) {
                assert!(self.rope_pending.is_none(), "RoPE left to an attention that never ran");
                self.rope_pending = Some((layer, rope.interleaved));
            } else if batch.n_tokens > 0 && self.attention_takes_q_rope(kv, layer) {
                assert!(self.q_rope_pending.is_none(), "RoPE left to an attention that never ran");
                self.rope_launch(qkv, layer, batch, rope, attn, kv, false);
                self.q_rope_pending = Some((layer, rope.interleaved));
            } else {
                self.rope_write_kv(qkv, layer, batch, rope, attn, kv);
            }
            return;
        }
        let t = self.tic();
        let half = kv.half() as i64;
        let KvBuf::F16(cache) = &mut kv.layers[layer] else { unreachable!("checked by fuses_qkv_rope") };
        let rope_kv = RopeKv {
            cache,
            half,
            n_heads: attn.n_heads as i32,
            n_kv: attn.n_kv_heads as i32,
            head_dim: attn.head_dim as i32,
            interleaved: i32::from(rope.interleaved),
            block_size: batch.block_size as i32,
        };
        self.gemv(Gemv::NormRope(rope_kv), w_qkv, x, norm, eps, 1, w_qkv.rows(), qkv, false);
        self.toc("gemv_norm_rope", t);
    }

    fn norm_matmul_silu(
        &mut self,
        x: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        n_tokens: usize,
        h: &mut CudaSlice<f32>,
        w: &CudaLinear,
        gu: &mut CudaSlice<f32>,
        ff: usize,
        out: &mut CudaSlice<f32>,
    ) {
        if n_tokens > 0 && self.takes_gemv(w, n_tokens) && w.rows() == 2 * ff {
            let t = self.tic();
            self.gemv(Gemv::NormSilu, w, x, norm, eps, n_tokens, ff, out, false);
            self.toc("gemv_norm_silu", t);
        } else {
            self.norm_then_gemm(x, norm, eps, n_tokens, h, w, gu, false);
            self.silu_mul(gu, n_tokens, ff, out);
        }
    }

    fn mlp_residual(
        &mut self,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        n_tokens: usize,
        h: &mut CudaSlice<f32>,
        gate_up: &CudaLinear,
        gu: &mut CudaSlice<f32>,
        ff: usize,
        act: &mut CudaSlice<f32>,
        down: &CudaLinear,
        next_norm: Option<&CudaSlice<f32>>,
    ) {
        let bf16 = |w: &CudaLinear| matches!(w, CudaLinear::Bf16 { .. });
        let fused = self.silu_bf16
            && self.silu_rows4
            && n_tokens > 0
            && n_tokens <= 65535
            && ff.is_multiple_of(4)
            && bf16(gate_up)
            && bf16(down)
            && gate_up.rows() == 2 * ff
            && down.cols() == ff
            && !self.takes_gemv(gate_up, n_tokens)
            && !self.takes_gemv(down, n_tokens);
        if !fused {
            self.norm_matmul_silu(x, norm, eps, n_tokens, h, gate_up, gu, ff, act);
            if !self.prenorm(down, act, n_tokens, x, next_norm) {
                self.matmul(down, act, n_tokens, x, true);
            }
            return;
        }
        let gu_bf16 = self.gu_bf16 && ff.is_multiple_of(8);
        let gu_bf16 = self.norm_then_gemm(x, norm, eps, n_tokens, h, gate_up, gu, gu_bf16);
        let t = self.tic();
        self.grow_x_bf16(n_tokens * ff);
        self.dev
            .silu_mul_to_bf16(gu, gu_bf16, n_tokens, ff, &mut self.x_bf16, self.pdl)
            .expect("CUDA: SiLU·gate to bf16");
        self.toc("silu_mul_bf16", t);
        self.residual_gemm(down, n_tokens, x, next_norm.map(|g| (g, eps)));
    }

    fn gather_rows(&mut self, x: &CudaSlice<f32>, rows: &[u32], dim: usize, out: &mut CudaSlice<f32>) {
        if rows.is_empty() {
            return;
        }
        // The rows given to begin_step, already on the device.
        let st = self.dev.stream().clone();
        let (d, n) = (dim as i32, rows.len() as i32);
        // A one-token step's row, copied: what its residual GEMV prepared for the norm
        // after it now describes `out` (the final norm runs on the gathered rows).
        let moves = match self.prenormed.take() {
            Some((px, g, width)) if rows == [0] && width == dim && px == x.device_ptr(&st).0 => Some((g, width)),
            _ => None,
        };
        let mut b = Launch::new(&st, self.dev.func("gather_rows"));
        b.arg(x).arg(&self.rows).arg(&d).arg(&n).arg(&mut *out);
        // SAFETY: rows index rows of x (the engine's own batch rows).
        unsafe { b.launch(launch_cfg(rows.len() * dim), self.pdl) }.expect("CUDA: gather rows");
        self.prenormed = moves.map(|(g, width)| (out.device_ptr(&st).0, g, width));
    }

    fn to_host(&mut self, x: &CudaSlice<f32>, out: &mut [f32]) {
        if !out.is_empty() {
            let t = self.tic();
            self.dev.stream().memcpy_dtoh(&x.slice(..out.len()), out).expect("CUDA: copying to the host");
            self.toc("logits_to_host", t);
            self.dev.synchronize().expect("CUDA: synchronize");
            self.settle();
        }
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling
    }

    fn sample_rows(
        &mut self,
        x: &mut CudaSlice<f32>,
        dim: usize,
        specs: &[SampleSpec],
        out: &mut Vec<SampledRow>,
    ) -> bool {
        if !self.device_sampling || specs.is_empty() {
            return false;
        }
        let t = self.tic();
        let st = self.dev.stream().clone();
        let rows = specs.len();
        out.clear();
        if specs.iter().all(|s| s.plain_greedy()) {
            // Only token ids: the argmax kernel.
            self.argmax(x, dim, rows);
            let mut ids = vec![0u32; rows];
            st.memcpy_dtoh(&self.argmax_out.slice(..rows), &mut ids).expect("CUDA: token ids to the host");
            out.extend(ids.into_iter().map(|t| SampledRow { token: Some(t), ..Default::default() }));
            self.toc("argmax_to_host", t);
        } else {
            self.sample_full(x, dim, specs, out);
            self.toc("sample_to_host", t);
        }
        self.dev.synchronize().expect("CUDA: synchronize");
        self.settle();
        true
    }

    fn graph_counts(&self) -> GraphCounts {
        GraphCounts { held: self.n_graphs(), ..self.graph_counts }
    }

    fn op_profile(&self) -> Vec<(&'static str, f64, u64)> {
        let gaps = (self.step_gap.1 > 0).then_some((super::STEP_GAP_OP, self.step_gap.0, self.step_gap.1));
        self.profile.iter().flat_map(|p| &p.totals).map(|(k, (s, n))| (*k, *s, *n)).chain(gaps).collect()
    }

    fn defers_sampling(&self) -> bool {
        self.defer
    }

    /// The argmax of `rows` rows where the logits are, and its copy into pinned memory
    /// started without waiting: argmax_out keeps it for the next step's feed.
    fn sample_rows_deferred(&mut self, x: &CudaSlice<f32>, dim: usize, rows: usize) {
        assert!(self.defer, "CUDA: deferred sampling is off");
        let t = self.tic();
        let st = self.dev.stream().clone();
        self.argmax(x, dim, rows);
        // Two slots: the one the copy goes to was read before (at most one sample is read
        // after the next step's launch).
        let slot = self.deferred_next;
        self.deferred_next ^= 1;
        assert!(self.deferred.iter().all(|d| d.0 != slot), "CUDA: more than two deferred samples");
        if self.deferred_host[slot].as_ref().is_none_or(|h| h.len() < rows) {
            // SAFETY: read only after the copy into it is done.
            let h = unsafe { self.dev.ctx.alloc_pinned_with_flags::<u32>(rows.next_power_of_two().max(64), 0) };
            self.deferred_host[slot] = Some(h.expect("CUDA: pinned memory for sampled ids"));
        }
        let ptr = self.deferred_host[slot].as_mut().expect("allocated").as_mut_ptr().expect("CUDA: pinned memory");
        // On the download stream: after the argmax.
        let cs = match &self.copy_streams {
            Some(c) => {
                c.sampled.record(&st).expect("CUDA: recording an event");
                c.down.wait(&c.sampled).expect("CUDA: ordering the copy of ids");
                &c.down
            }
            None => &st,
        };
        let (src, g) = self.argmax_out.device_ptr(&st);
        // SAFETY: the slot holds at least `rows` ids and is not read until the event after
        // this copy is done; argmax_out holds `rows` ids, rewritten by no argmax before
        // this copy is done (`argmax` waits for `done`).
        unsafe {
            let dst = std::slice::from_raw_parts_mut(ptr, rows);
            cudarc::driver::result::memcpy_dtoh_async(dst, src, cs.cu_stream()).expect("CUDA: sampled ids to the host");
        }
        drop(g);
        let done = pooled_event(&mut self.event_pool, cs);
        self.deferred.push_back((slot, rows, done));
        self.toc("argmax_deferred", t);
    }

    fn collect_sampled(&mut self, out: &mut Vec<u32>) {
        let (slot, rows, done) = self.deferred.pop_front().expect("CUDA: no deferred sample to collect");
        done.synchronize().expect("CUDA: waiting for sampled ids");
        self.event_pool.push(done);
        let host = self.deferred_host[slot].as_ref().expect("allocated");
        out.clear();
        out.extend_from_slice(&host.as_slice().expect("CUDA: pinned memory")[..rows]);
        self.read_step_gaps();
    }

    fn copy_bandwidth_gbps(&self) -> Option<f64> {
        self.copy_bandwidth(2 << 30).ok()
    }

    fn read_bandwidth_gbps(&self) -> Option<f64> {
        self.read_bandwidth(2 << 30).ok()
    }

    fn kv_shape(&self, kv: &CudaKv) -> KvShape {
        kv.shape
    }

    fn kv_export(&mut self, kv: &CudaKv, layer: usize, blocks: &[u32], out: &mut Vec<u8>) {
        let (be, half) = (kv.block_elems(), kv.half());
        let st = self.dev.stream();
        for &b in blocks {
            let at = b as usize * be;
            for start in [at, half + at] {
                match &kv.layers[layer] {
                    KvBuf::F16(c) => {
                        let mut h = vec![0u16; be];
                        st.memcpy_dtoh(&c.slice(start..start + be), &mut h).expect("CUDA: KV export");
                        out.extend(h.iter().flat_map(|x| x.to_le_bytes()));
                    }
                    KvBuf::F32(c) => {
                        let mut h = vec![0f32; be];
                        st.memcpy_dtoh(&c.slice(start..start + be), &mut h).expect("CUDA: KV export");
                        out.extend(h.iter().flat_map(|x| x.to_le_bytes()));
                    }
                    KvBuf::Fp8(c) => {
                        let mut h = vec![0u8; be];
                        st.memcpy_dtoh(&c.slice(start..start + be), &mut h).expect("CUDA: KV export");
                        out.extend_from_slice(&h);
                    }
                }
            }
        }
    }

    fn kv_import(&mut self, kv: &mut CudaKv, layer: usize, blocks: &[u32], data: &[u8]) {
        let (be, half) = (kv.block_elems(), kv.half());
        let es = kv.shape.dtype.bytes();
        assert_eq!(data.len(), blocks.len() * 2 * be * es, "KV import size");
        let st = self.dev.stream().clone();
        let mut chunks = data.chunks_exact(be * es);
        for &b in blocks {
            let at = b as usize * be;
            for start in [at, half + at] {
                let bytes = chunks.next().expect("sized above");
                match &mut kv.layers[layer] {
                    KvBuf::F16(c) => {
                        let h: Vec<u16> = bytes.chunks_exact(2).map(|x| u16::from_le_bytes([x[0], x[1]])).collect();
                        st.memcpy_htod(&h, &mut c.slice_mut(start..start + be)).expect("CUDA: KV import");
                    }
                    KvBuf::F32(c) => {
                        let h: Vec<f32> =
                            bytes.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect();
                        st.memcpy_htod(&h, &mut c.slice_mut(start..start + be)).expect("CUDA: KV import");
                    }
                    KvBuf::Fp8(c) => {
                        st.memcpy_htod(bytes, &mut c.slice_mut(start..start + be)).expect("CUDA: KV import");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        attn_splits_by_waves, below_cluster_floor, fp8_copy_wanted, lone_block_rate, split_costs, unsplit_pays,
        ShapeCache, StepTables, FP8_COPY_MAX_BYTES,
    };
    use crate::backend::SeqSpan;

    /// Clusters of up to `max` splits, each as resident as single blocks.
    fn full(slots: usize, max: usize) -> Vec<usize> {
        vec![slots; max + 1]
    }

    #[test]
    fn attention_splits_fill_whole_waves() {
        // Batch 64 of 1k tokens, 8 KV heads, 396 resident blocks: 2 waves at 65% fill
        // unsplit; 3 splits run 4 waves of a third of the keys.
        assert_eq!(attn_splits_by_waves(512, 17, 396, 64, &[], true), (3, false));
        // Batch 1: every chunk its own block (one wave).
        assert_eq!(attn_splits_by_waves(8, 17, 396, 64, &[], true), (17, false));
        // Batch 256: already many waves, no split.
        assert_eq!(attn_splits_by_waves(2048, 17, 396, 64, &[], true), (1, false));
        // Bounded by the partials reserved, and by the chunks there are.
        assert_eq!(attn_splits_by_waves(8, 513, 396, 20, &[], true), (20, false));
        assert_eq!(attn_splits_by_waves(8, 1, 396, 64, &[], true), (1, false));
    }

    #[test]
    fn attention_splits_merged_in_clusters_save_the_merge() {
        // Batch 1 of 1k keys on 264 slots (the H200's 132 SMs, two blocks each): 9 splits
        // of two chunks merged in the kernel tie with 17 of one and attention_merge, and
        // the fewer win.
        assert_eq!(attn_splits_by_waves(8, 17, 264, 64, &full(264, 16), true), (9, true));
        // 8 splits at most in a cluster: those would take three chunks; 17 and the merge
        // cost less.
        assert_eq!(attn_splits_by_waves(8, 17, 264, 64, &full(264, 8), true), (17, false));
        // 32k keys: many splits pay for the merge.
        assert_eq!(attn_splits_by_waves(8, 513, 264, 64, &full(264, 16), true), (33, false));
        // Batch 16: two splits, merged in the kernel as before by attention_merge.
        assert_eq!(attn_splits_by_waves(128, 17, 264, 64, &full(264, 16), true), (2, true));
        assert_eq!(attn_splits_by_waves(128, 17, 264, 64, &[], true), (2, false));
    }

    #[test]
    fn lone_blocks_stay_unsplit_where_splitting_saves_less_than_it_costs() {
        let km = lone_block_rate("flash_decode_km_f16_d128");
        let (h100, h200) = (2619e6 * 2.0 * 5120.0 / 8.0, 3201e6 * 2.0 * 6144.0 / 8.0);
        let (h100_costs, h200_costs) = (split_costs("NVIDIA H100 80GB HBM3", h100), split_costs("NVIDIA H200", h200));
        // A block of Llama-3-8B's KV head over 1k and 4k keys (f16 K and V, head_dim 128).
        let (k1, k4) = (1024.0 * 512.0, 4096.0 * 512.0);
        // The batches (8 KV heads a sequence) where the H100's steps ran faster unsplit
        // at 1k keys, 12 to 16 (15 and 16 unsplit by the earlier rule too), and where
        // split, 8 to 11 (11 level on one start):
        for b in 12..=16 {
            assert!(unsplit_pays(8 * b, 132, k1, km, h100_costs), "H100 batch {b}, 1k");
        }
        for b in 8..=11 {
            assert!(!unsplit_pays(8 * b, 132, k1, km, h100_costs), "H100 batch {b}, 1k");
        }
        // 4k keys: 12 to 14 faster unsplit, 8 to 11 faster split.
        assert!(unsplit_pays(96, 132, k4, km, h100_costs));
        assert!(!unsplit_pays(88, 132, k4, km, h100_costs));
        // The H200: at 1k keys 15 and 16 unsplit (16 faster so, 15 level), 12 to 14 split
        // (12 faster so on the sixtieth session's start; the attention of 14 too, its step
        // not: see split_costs); from 2k keys 15 split (faster so by 2.6–6.3% at 2k, 4k and
        // 8k), 16 from 4k (1.7–4.2%; level at 2k).
        let k2 = 2048.0 * 512.0;
        for b in [15, 16] {
            assert!(unsplit_pays(8 * b, 132, k1, km, h200_costs), "H200 batch {b}, 1k");
        }
        for b in 12..=14 {
            assert!(!unsplit_pays(8 * b, 132, k1, km, h200_costs), "H200 batch {b}, 1k");
        }
        assert!(!unsplit_pays(112, 132, k2, km, h200_costs));
        assert!(!unsplit_pays(120, 132, k2, km, h200_costs));
        assert!(unsplit_pays(128, 132, k2, km, h200_costs));
        for k in [k4, 2.0 * k4] {
            assert!(!unsplit_pays(120, 132, k, km, h200_costs));
            assert!(!unsplit_pays(128, 132, k, km, h200_costs));
        }
        // More units than SMs: blocks share SMs, the waves rule decides.
        assert!(!unsplit_pays(136, 132, k1, km, h100_costs));
        // Long contexts with few units split: batch 1 and 8 at 32k.
        assert!(!unsplit_pays(8, 132, 32.0 * k1, km, h200_costs));
        assert!(!unsplit_pays(64, 132, 32.0 * k1, km, h100_costs));
        // Elsewhere, the fifty-ninth session's rule: unsplit only where the blocks ask for
        // the card's whole bandwidth, on an H100 from batch 15 (120 blocks).
        let other = split_costs("NVIDIA A100-SXM4-80GB", h100);
        assert_eq!(other, (h100, 0.0));
        assert!(unsplit_pays(120, 132, k1, km, other));
        assert!(!unsplit_pays(112, 132, k1, km, other));
        assert!(!unsplit_pays(128, 132, k1, km, split_costs("other", h200)));
        // Unknown bandwidth, or a kernel not measured: never.
        assert!(!unsplit_pays(128, 132, k1, km, split_costs("other", 0.0)));
        assert!(!unsplit_pays(128, 132, k1, lone_block_rate("flash_decode_km_fp8_d128"), h100_costs));
    }

    #[test]
    fn fp8_copy_caps_decode_steps_only() {
        // Eight sequences of 32k at Llama-3-8B's shape (4 KiB of copy per token, 16-token
        // blocks): decode rows alone past the cap take the per-token kernel; a 32k prompt
        // beside seven decoding sequences (the same blocks) takes the copy.
        let eight_32k = 2 * 2 * 16 * 8 * 128 * (7 * 2049 + 2048);
        assert!(eight_32k > FP8_COPY_MAX_BYTES);
        assert!(!fp8_copy_wanted(eight_32k, false));
        assert!(fp8_copy_wanted(eight_32k, true));
        assert!(fp8_copy_wanted(FP8_COPY_MAX_BYTES, false));
    }

    #[test]
    fn attention_splits_leave_clusters_that_need_more_waves() {
        // Batch 8 of 32k keys (64 units of 514 chunks) where clusters hold only half the
        // 264 slots: 4 splits in clusters would take two waves, so they run apart in one
        // and attention_merge merges them.
        let half = vec![132; 17];
        assert_eq!(attn_splits_by_waves(64, 514, 264, 64, &half, true), (4, false));
        assert_eq!(attn_splits_by_waves(64, 514, 264, 64, &full(264, 16), true), (4, true));
        // Batch 1 of 1k keys: 72 blocks fit either way, and the cluster stays.
        assert_eq!(attn_splits_by_waves(8, 17, 264, 64, &half, true), (9, true));
    }

    #[test]
    fn attention_splits_without_partials_merge_in_clusters_or_not_at_all() {
        // A launch with no partials' scratch (a split mixed step's decode rows): batch 8 of
        // 32k keys takes 2 splits in clusters where 4 apart would win, batch 1 at 32k 16
        // (the largest cluster) where 33 apart would, and without clusters one split.
        let half = vec![132; 17];
        assert_eq!(attn_splits_by_waves(64, 514, 264, 64, &half, false), (2, true));
        assert_eq!(attn_splits_by_waves(8, 513, 264, 64, &full(264, 16), false), (16, true));
        assert_eq!(attn_splits_by_waves(64, 514, 264, 64, &[], false), (1, false));
    }

    #[test]
    fn attention_splits_below_the_cluster_floor_run_apart() {
        // Batch 14 of 1k keys (112 units of 16 chunks) on the H200's 264 slots: two splits
        // in clusters by default, the same two apart under a floor of 3 or more; batch 1's
        // 9 splits keep their cluster under a floor of 5. A launch without partials'
        // scratch ignores the floor.
        let b14 = attn_splits_by_waves(112, 16, 264, 64, &full(264, 16), true);
        assert_eq!(below_cluster_floor(b14, true, 2), (2, true));
        assert_eq!(below_cluster_floor(b14, true, 3), (2, false));
        let b1 = attn_splits_by_waves(8, 17, 264, 64, &full(264, 16), true);
        assert_eq!(below_cluster_floor(b1, true, 5), (9, true));
        let mixed = attn_splits_by_waves(64, 514, 264, 64, &[132; 17], false);
        assert_eq!(below_cluster_floor(mixed, false, 5), (2, true));
    }

    fn span(rows: std::ops::Range<usize>, pos0: usize, block_table: &[u32]) -> SeqSpan<'_> {
        SeqSpan { rows, pos0, block_table }
    }

    #[test]
    fn split_steps_lay_the_other_spans_tables_first() {
        // Blocks of 16: a decoding sequence at 20, a 40-token prompt, a decoding sequence
        // at 70, a prompt's second chunk of 20 at 100.
        let (a, b, c, d) = ([5, 6], [1, 2, 3], [7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19]);
        let seqs = [span(0..1, 20, &a), span(1..41, 0, &b), span(41..42, 70, &c), span(42..62, 100, &d)];
        let split = StepTables::new(&seqs, |s| s.rows.len() == 1);
        assert_eq!(split.tables, [&b[..], &d, &a, &c].concat());
        assert_eq!(split.table_off, [11, 0, 13, 3]);
        // The copy: the prompts' 11 blocks; each launch its own rows' longest context.
        assert_eq!((split.copy_blocks, split.max_ctx, split.km_max_ctx), (11, 120, 71));
        let whole = StepTables::new(&seqs, |_| false);
        assert_eq!(whole.tables, [&a[..], &b, &c, &d].concat());
        assert_eq!(whole.table_off, [0, 2, 5, 10]);
        assert_eq!((whole.copy_blocks, whole.max_ctx, whole.km_max_ctx), (18, 120, 0));
    }

    #[test]
    fn step_tiles_cover_every_row_once_the_latest_first() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..300 {
            // One to six spans, a third of them one row, the rest up to 300, at positions
            // up to 2k, in blocks of 16 numbered apart.
            let mut specs = Vec::new();
            let (mut row, mut block) = (0, 0u32);
            for _ in 0..1 + next(6) {
                let rows = if next(3) == 0 { 1 } else { 1 + next(300) };
                let pos0 = next(2048);
                let blocks = (pos0 + rows).div_ceil(16) as u32;
                specs.push((row..row + rows, pos0, (block..block + blocks).collect::<Vec<u32>>()));
                (row, block) = (row + rows, block + blocks);
            }
            let seqs: Vec<SeqSpan> = specs.iter().map(|(r, p, t)| span(r.clone(), *p, t)).collect();
            for (split, per) in [false, true].into_iter().flat_map(|s| [1, 8, 16, 32, 64].map(|p| (s, p))) {
                let km = |s: &SeqSpan| split && s.rows.len() == 1;
                let t = StepTables::new(&seqs, km);
                let others: Vec<u32> = seqs.iter().filter(|s| !km(s)).flat_map(|s| s.block_table.to_vec()).collect();
                assert_eq!(t.tables[..t.copy_blocks], others);
                let ctx = |k: bool| seqs.iter().filter(|s| km(s) == k).map(|s| s.pos0 + s.rows.len()).max();
                assert_eq!((t.max_ctx, t.km_max_ctx), (ctx(false).unwrap_or(0), ctx(true).unwrap_or(0)));
                let mut seen = vec![0; row];
                for (list, on_km) in t.tiles(&seqs, per, km).iter().zip([false, true]) {
                    assert!(list.windows(2).all(|w| w[0][2] + w[0][1] >= w[1][2] + w[1][1]), "latest first");
                    for &[r, rows, p, off] in list {
                        let (r, rows) = (r as usize, rows as usize);
                        let s = seqs.iter().find(|s| s.rows.contains(&r)).expect("a tile's row is a span's");
                        assert!((1..=per).contains(&rows) && r + rows <= s.rows.end);
                        assert_eq!(p as usize, s.pos0 + r - s.rows.start);
                        assert_eq!(t.tables[off as usize..][..s.block_table.len()], *s.block_table);
                        assert_eq!(km(s), on_km);
                        seen[r..r + rows].iter_mut().for_each(|n| *n += 1);
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "every row in one tile: {seen:?}");
            }
        }
    }

    #[test]
    fn the_shape_cache_drops_the_least_recently_used() {
        let shape = |n: usize| (n, n, 1, 0u8);
        let mut c = ShapeCache::new(3);
        for n in 1..=3 {
            assert_eq!(c.insert(shape(n), n), None);
        }
        // Shape 1 replayed: shape 2 is now the least recently used, and makes room for 4.
        assert_eq!(c.get(&shape(1)), Some(&1));
        assert_eq!(c.insert(shape(4), 4), Some(shape(2)));
        assert_eq!(c.get(&shape(2)), None);
        assert_eq!(c.len(), 3);
        // A shape already held is replaced in place, dropping none.
        assert_eq!(c.insert(shape(3), 30), None);
        assert_eq!(c.get(&shape(3)), Some(&30));
        // Then 1 (got before 4 was inserted) goes first, then 4.
        assert_eq!(c.insert(shape(5), 5), Some(shape(1)));
        assert_eq!(c.insert(shape(6), 6), Some(shape(4)));
        c.clear();
        assert_eq!(c.len(), 0);
    }
}
