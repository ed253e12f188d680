//! Every environment variable disagg reads, in one place.
//!
//! Each optimisation can be switched off by one of these, so that A/B measurements run
//! inside one build (a lesson from the source documents). Configuration that users set
//! routinely is a CLI flag instead; these are for experiments and diagnosis.

/// Where the embedded model and other downloads are cached. Default `~/.cache/disagg`.
pub const CACHE_DIR: &str = "DISAGG_CACHE";

/// `system`: the `disagg` process allocates with glibc's malloc instead of mimalloc
/// (for A/B runs; read once at start).
pub const ALLOCATOR: &str = "DISAGG_ALLOCATOR";

/// Which SIMD kernels the CPU backend uses: `avx512` (AVX-512 VNNI), `avx2`, `scalar`.
/// Default: the best this CPU supports. A request for an unsupported level falls back
/// to the best supported one below it.
pub const CPU_ISA: &str = "DISAGG_CPU_ISA";

/// How quantized weights multiply activations on the CPU: `q8` (default: activations
/// quantized to 8-bit blocks per row, integer dot products, like llama.cpp) or `f32`
/// (weights dequantized block by block, f32 activations: slower, closer to a float
/// reference).
pub const CPU_MATMUL: &str = "DISAGG_CPU_MATMUL";

/// Iterations an idle CPU worker thread spins before it sleeps (default 2000).
/// `0` makes workers sleep at once (for A/B of the spin-wait).
pub const POOL_SPIN: &str = "DISAGG_POOL_SPIN";

/// Threads for the CPU backend when `--threads` is not given (default: all cores).
pub const CPU_THREADS: &str = "DISAGG_THREADS";

/// How many weight blocks ahead the CPU matmul prefetches (default 8; 0 turns
/// software prefetch off).
pub const CPU_PREFETCH: &str = "DISAGG_CPU_PREFETCH";

/// `0`: the CPU attention runs its kernel from before the flash kernel (scores of all
/// keys, then the softmax, then the values; a dot product per score). Default: the flash
/// kernel (one pass over the cache, online softmax, the query rows on the SIMD lanes).
pub const CPU_FLASH_ATTN: &str = "DISAGG_CPU_FLASH_ATTN";

/// `0`: the CPU's flash attention never splits a decode row's keys into tasks per
/// segment of 512. Default: it does when the step's tasks would leave threads idle (one
/// long sequence on more threads than its KV heads); the bits are the same either way.
pub const CPU_ATTN_SPLIT: &str = "DISAGG_CPU_ATTN_SPLIT";

/// `0`: the CPU's flash attention runs every chunk's softmax with the per-row selects of
/// a tile's diagonal. Default: a chunk that every row sees whole skips them (same bits).
/// Read once per process.
pub const CPU_SOFTMAX_FAST: &str = "DISAGG_CPU_SOFTMAX_FAST";

/// API key the gateway requires when `--api-key` is not given (`Authorization: Bearer`).
pub const API_KEY: &str = "DISAGG_API_KEY";

/// Log filter for the servers (tracing-subscriber syntax, e.g. `info,router=debug`).
pub const LOG: &str = "DISAGG_LOG";

/// OTLP/gRPC endpoint for traces (the OpenTelemetry standard variable), used when
/// `--otlp-endpoint` is not given. Unset: no traces are created or exported.
pub const OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Fault injection for the KV transfer of a prefill worker (tests): `corrupt` flips a
/// byte of the second range sent after its checksum, `cut` closes the connection after
/// the second range. Unset or `none`: no fault.
pub const KV_FAULT: &str = "DISAGG_KV_FAULT";

/// Milliseconds an attempt by the head of the router's queue for KV blocks may go
/// unanswered before the next waiting request may try too (default 50; a decode worker
/// refuses as soon as its engine thread takes the reservation, between two steps, while
/// an accepted attempt is answered only after its prefill). Larger values keep the
/// admissions strictly in arrival order on slow or loaded machines (tests).
pub const ROUTER_ADMIT_GRACE_MS: &str = "DISAGG_ROUTER_ADMIT_GRACE_MS";

/// Set on the GPU machine to run the CUDA tests (`kernels/tests/cuda_ops.rs`); unset,
/// they check only the no-driver error and never pretend to have run on a GPU.
pub const TEST_CUDA: &str = "DISAGG_TEST_CUDA";

/// Weight element type on the CUDA backend: `bf16` (default) or `f32` (for exactness
/// checks against the CPU backend's f32 path; twice the memory and much slower GEMMs).
pub const CUDA_WEIGHTS: &str = "DISAGG_CUDA_WEIGHTS";

/// Set to time every CUDA backend op on the GPU (CUDA events around each op; ops are
/// not synchronized, but CUDA graphs are off); `bench engine` prints the table.
pub const CUDA_PROFILE: &str = "DISAGG_CUDA_PROFILE";

/// `0`: copy every sampled row's logits to the host and sample there, instead of
/// sampling on the device (greedy, temperature, min-p and logprobs entirely there;
/// top-k / top-p down to ≤ 1024 candidates that the host finishes); for A/B runs.
pub const DEVICE_SAMPLING: &str = "DISAGG_DEVICE_SAMPLING";

/// Async scheduling: an engine launches its next step before it reads the last step's
/// tokens, which stay on the device and feed the next step (plain greedy rows; see
/// `EngineCore::step`). `0`: off (each step's tokens reach the host before the next step
/// is scheduled); `1`: on. Default: on for CUDA, off for the CPU backend (whose steps run
/// on the host, so there is nothing to overlap).
pub const ASYNC_SCHEDULING: &str = "DISAGG_ASYNC_SCHEDULING";

/// `0`: the CUDA greedy sample (argmax over the vocabulary) takes one block per row,
/// instead of several blocks per row while the rows alone leave SMs idle; for A/B runs.
pub const CUDA_ARGMAX_SPLIT: &str = "DISAGG_CUDA_ARGMAX_SPLIT";

/// `0`: the CUDA greedy sample reads the logits one 4-byte load at a time per thread,
/// instead of four 16-byte loads in flight (the same token); for A/B runs.
pub const CUDA_ARGMAX_VEC: &str = "DISAGG_CUDA_ARGMAX_VEC";

/// `0`: a CUDA step's packed metadata goes up, and a deferred sample's token ids come
/// down, on the stream that runs the kernels, between the last step's argmax and the next
/// step's graph, instead of on two side streams of their own (ordered by events) that
/// take both copies off that stretch; for A/B runs.
pub const CUDA_COPY_STREAMS: &str = "DISAGG_CUDA_COPY_STREAMS";

/// `0`: a CUDA step's metadata goes up in one copy per buffer, instead of one copy of it
/// all, spread to its buffers by one kernel (`unpack_step`); for A/B runs.
pub const CUDA_PACKED_UPLOAD: &str = "DISAGG_CUDA_PACKED_UPLOAD";

/// `0`: the CUDA backend launches its kernels plainly, each starting once the one before
/// has finished, instead of with programmatic dependent launch (sm_90+: a kernel's
/// launch and its first weight loads overlap the end of the kernel before); for A/B runs.
pub const CUDA_PDL: &str = "DISAGG_CUDA_PDL";

/// The CUDA attention's split-K (flash-decoding) path: when splitting fills the GPU's
/// waves of resident blocks better (few sequences, or a last wave left part-empty), each
/// one's keys are split over several blocks of at least this many keys (default 64; 0:
/// never split).
pub const CUDA_ATTN_CHUNK: &str = "DISAGG_CUDA_ATTN_CHUNK";

/// `0`: run every CUDA decode step's kernels one by one instead of replaying a CUDA
/// graph captured for its batch shape (decode-only steps; captured on the second step of
/// each shape); for A/B runs. Graphs are off while `DISAGG_CUDA_PROFILE` times ops.
pub const CUDA_GRAPHS: &str = "DISAGG_CUDA_GRAPHS";

/// `0`: attention with the per-token f32 kernel instead of the tensor-core flash kernel
/// (f16 KV cache, head_dim 64 or 128; prefill and decode); for A/B runs. The flash kernel
/// rounds q and the probabilities to f16, so f32 weights (the exactness mode) never use
/// it.
pub const CUDA_FLASH: &str = "DISAGG_CUDA_FLASH";

/// cuBLAS workspace of the CUDA backend in MiB (default 32, fixed at start so captured
/// GEMMs never allocate); `0`: cuBLAS's own default.
pub const CUDA_BLAS_WORKSPACE_MIB: &str = "DISAGG_CUDA_BLAS_WORKSPACE_MIB";

/// `0`: decode-only steps take the flash kernel's general form (one warp per 16 rows;
/// a decode token fills only its group's rows of one warp) instead of the form whose
/// four warps split each key tile; for A/B runs.
pub const CUDA_FLASH_DECODE: &str = "DISAGG_CUDA_FLASH_DECODE";

/// `0`: decode-only steps of one token per sequence take the flash kernel's decode form
/// (above) instead of the keys-on-M kernel (S^T = K·Q^T with the group's query heads as
/// the MMA's 8 columns, O^T += V^T·P^T: half the MMAs and registers of 16-row tiles);
/// for A/B runs.
pub const CUDA_DECODE_KM: &str = "DISAGG_CUDA_DECODE_KM";

/// `0`: with an FP8 KV cache, steps that the keys-on-M kernel does not take (prefill,
/// mixed steps) run the per-token attention kernel over the FP8 cache, instead of the
/// flash kernels over an f16 copy of the step's blocks; for A/B runs.
pub const CUDA_FP8_F16_COPY: &str = "DISAGG_CUDA_FP8_F16_COPY";

/// On unless `0`: a step that prefills beside decoding sequences launches the keys-on-M
/// kernel for the decode rows (their keys split in clusters) after the flash kernel's
/// launch for the prompts, instead of one flash launch for all rows; with an FP8 KV cache
/// only the prompts' blocks are then copied to f16, not every sequence's (H200: faster in
/// every measured case, as near the CPU's tokens as one launch; docs/PERF.md).
pub const CUDA_MIXED_SPLIT: &str = "DISAGG_CUDA_MIXED_SPLIT";

/// Largest token count whose bf16 GEMMs take the CUDA backend's own GEMV kernels (f32
/// activations read directly, weights streamed at memory bandwidth, RMSNorm and
/// SiLU·gate fused in) instead of a bf16 cast plus cuBLAS and separate ops. Default 1
/// (measured on the H200: faster at 1 token, slower from 2 on); at most 8; `0`: never.
pub const CUDA_GEMV_MAX_TOKENS: &str = "DISAGG_CUDA_GEMV_MAX_TOKENS";

/// `0`: choose the CUDA attention's key splits by the earlier rule (enough blocks for two
/// per SM) instead of by whole waves of resident blocks; for A/B runs.
pub const CUDA_ATTN_WAVES: &str = "DISAGG_CUDA_ATTN_WAVES";

/// `0`: the CUDA flash-attention kernels read their K and V fragments from shared
/// memory with 32- and 16-bit loads instead of ldmatrix (four 8×8 matrices per
/// instruction, V transposed on the way); for A/B runs.
pub const CUDA_FLASH_LDMATRIX: &str = "DISAGG_CUDA_FLASH_LDMATRIX";

/// `0`: the CUDA flash-attention kernels compute every 16-byte K/V chunk's address from
/// scratch (a division by the block size and a block-table read per chunk) instead of
/// once per key with the per-block parts hoisted; for A/B runs.
pub const CUDA_FLASH_LEAN_LOADS: &str = "DISAGG_CUDA_FLASH_LEAN_LOADS";

/// `0`: in the CUDA flash-decode kernel, warp 0 alone merges the four warps' partial
/// softmaxes instead of all the block's threads (four columns each); for A/B runs.
pub const CUDA_FLASH_WIDE_MERGE: &str = "DISAGG_CUDA_FLASH_WIDE_MERGE";

/// `0`: the CUDA flash kernels' online softmax calls exp2f (which scales around the
/// hardware instruction for f32 subnormals) instead of the bare `ex2.approx.ftz`; for
/// A/B runs. The kernel forms are cumulative: this one, `CUDA_FLASH_SMEM32` and
/// `CUDA_FLASH_OCC3` apply only with ldmatrix on (`CUDA_FLASH_LDMATRIX`), each of them
/// only with the ones before it on.
pub const CUDA_FLASH_FAST_EXP: &str = "DISAGG_CUDA_FLASH_FAST_EXP";

/// `0`: the CUDA flash kernels address shared memory through generic pointers (64-bit
/// arithmetic and two conversions per ldmatrix / cp.async) instead of 32-bit offsets
/// from a base computed once; for A/B runs (only with the fast exp).
pub const CUDA_FLASH_SMEM32: &str = "DISAGG_CUDA_FLASH_SMEM32";

/// `0`: the head_dim-128 flash prefill kernel as ptxas sizes it (2 blocks per SM by its
/// registers) instead of held to 3 blocks per SM; for A/B runs (only with the 32-bit
/// shared addresses).
pub const CUDA_FLASH_OCC3: &str = "DISAGG_CUDA_FLASH_OCC3";

/// `0`: on sm_90 the CUDA flash prefill kernel (head_dim 128) computes S = Q·Kᵀ and O += P·V with
/// mma.sync per warp instead of warpgroup MMAs (wgmma, K and V read from shared memory
/// once per four warps); for A/B runs (only with the 32-bit shared addresses).
pub const CUDA_FLASH_WGMMA: &str = "DISAGG_CUDA_FLASH_WGMMA";

/// `0`: the CUDA flash kernels' lean tile loads read the block table and form a 64-bit
/// address for every key a thread copies, instead of once per pair of keys that share a
/// cache block; for A/B runs.
pub const CUDA_FLASH_PAIR_LOADS: &str = "DISAGG_CUDA_FLASH_PAIR_LOADS";

/// `0`: the CUDA flash kernels apply the causal and end-of-keys mask to every key tile
/// instead of only to tiles that cross a row's diagonal or the end; for A/B runs.
pub const CUDA_FLASH_MASK_EDGE: &str = "DISAGG_CUDA_FLASH_MASK_EDGE";

/// `0`: the CUDA RoPE + KV write of q and k (where it is a kernel of its own) runs one
/// block per token, walking its heads in rounds behind a barrier, instead of the grouped
/// kernel: a thread per (token, group of heads, rotation pair) with all its loads in one
/// round, the step's cos/sin made by its first layer and read by the others (one-token
/// steps on an f16 cache take it only with `DISAGG_CUDA_GEMV_ROPE=0`, else the QKV GEMV
/// does it). The k-only RoPE of warp-specialized prefill steps stays grouped (its switch
/// is `DISAGG_CUDA_ROPE_K_ROUND`); for A/B runs.
pub const CUDA_ROPE_PAIRS: &str = "DISAGG_CUDA_ROPE_PAIRS";

/// Heads per thread of the CUDA grouped RoPE kernel, 1 to 8 (default 8: fewer threads,
/// each with more loads in flight and its index arithmetic paid once); for A/B runs.
pub const CUDA_ROPE_GROUP: &str = "DISAGG_CUDA_ROPE_GROUP";

/// `0`: a one-token step's RoPE + KV write runs as its own kernel after the QKV GEMV,
/// instead of in the GEMV's epilogue (each warp there takes one rotation pair's rows);
/// for A/B runs.
pub const CUDA_GEMV_ROPE: &str = "DISAGG_CUDA_GEMV_ROPE";

/// `0`: the CUDA one-token GEMV kernels load a group of weights and then use it, instead
/// of issuing the next group's loads before using this one's (software pipelining,
/// 64 registers); for A/B runs.
pub const CUDA_GEMV_PIPE: &str = "DISAGG_CUDA_GEMV_PIPE";

/// `0`: a one-token GEMV after RMSNorm computes the norm itself (each block sums the
/// squares of x before its first weight load, then scales x and multiplies by the norm
/// weight as it reads it), instead of taking x · weight and the sums of x² that the
/// residual GEMV before it left; for A/B runs.
pub const CUDA_GEMV_PRENORM: &str = "DISAGG_CUDA_GEMV_PRENORM";

/// `0`: CUDA bf16 GEMMs of 2–8 tokens go to cuBLAS, instead of the skinny GEMM kernel
/// (sm_90); for A/B runs.
pub const CUDA_SKINNY: &str = "DISAGG_CUDA_SKINNY";

/// `0`: before a CUDA bf16 GEMM of more tokens than the GEMV takes, RMSNorm writes f32
/// and a separate kernel casts it to bf16, instead of one kernel writing the bf16 GEMM
/// input; for A/B runs.
pub const CUDA_NORM_CAST: &str = "DISAGG_CUDA_NORM_CAST";

/// `0`: that bf16-writing RMSNorm loads its norm weights after the row's sum of squares,
/// instead of before it waits for the kernel before (programmatic launch; the same
/// values, one round trip fewer after the wait: Llama-3-8B batch 64 −0.8 to −0.9%, batch
/// 16 −0.7 to −1.5% on an H100, docs/PERF.md); for A/B runs.
pub const CUDA_NORM_WEIGHTS_FIRST: &str = "DISAGG_CUDA_NORM_WEIGHTS_FIRST";

/// `0`: past the GEMV, the CUDA SiLU·gate writes f32 and a separate kernel casts it to
/// the down projection's bf16 GEMM input, instead of SiLU·gate writing bf16 itself; for
/// A/B runs.
pub const CUDA_SILU_BF16: &str = "DISAGG_CUDA_SILU_BF16";

/// `0`: past the GEMV, the CUDA flash kernels (prefill and decode forms; when the keys
/// are split, the merge of their partials) write f32 and a separate kernel casts it to
/// the output projection's bf16 GEMM input, instead of writing bf16 themselves; for A/B
/// runs.
pub const CUDA_ATTN_BF16: &str = "DISAGG_CUDA_ATTN_BF16";

/// `0`: past the GEMV and the skinny GEMM, the CUDA gate/up GEMM writes f32 for
/// SiLU·gate, instead of bf16 (the rounding PyTorch and vLLM apply there; half the bytes
/// written and read back); for A/B runs.
pub const CUDA_GU_BF16: &str = "DISAGG_CUDA_GU_BF16";

/// `0`: a CUDA decode step on the keys-on-M attention kernel runs RoPE and the KV write
/// (`rope_write_kv`) before the attention, instead of in the attention kernel; for A/B
/// runs.
pub const CUDA_ATTN_ROPE: &str = "DISAGG_CUDA_ATTN_ROPE";

/// `0`: a CUDA decode step whose keys-on-M attention is split into ≤ 16 key chunks merges
/// them with `attention_merge` (the partials through global memory, a second launch)
/// instead of in the kernel, its splits one thread block cluster (sm_90); for A/B runs.
pub const CUDA_ATTN_CLUSTER: &str = "DISAGG_CUDA_ATTN_CLUSTER";

/// The fewest key splits of a keys-on-M decode attention that merge in the kernel as a
/// cluster (default 2: any): a split count the rule chose in clusters but below this runs
/// the same splits apart, merged by `attention_merge` after it, where the launch has the
/// partials' scratch; for A/B runs.
pub const CUDA_ATTN_CLUSTER_FROM: &str = "DISAGG_CUDA_ATTN_CLUSTER_FROM";

/// `0`: a decode attention whose unsplit blocks would run one per SM and read their keys
/// within a split's fixed cost of the split form's time (by the split form's read rate and
/// fixed cost measured on the H100 and H200; elsewhere, where they ask together for the
/// card's whole memory bandwidth by its clock and bus) is split by whole waves like any
/// other, instead of staying unsplit (keys-on-M f16 kernel at head_dim 128 only, the one
/// whose lone block rate is measured); for A/B runs.
pub const CUDA_ATTN_LONE: &str = "DISAGG_CUDA_ATTN_LONE";

/// `0`: the decode attention's split count assumes that clusters of its splits are as
/// resident as single blocks (the blocks per SM times the SMs) instead of asking the driver
/// how many clusters of each size fit at once (`cuOccupancyMaxActiveClusters`; a
/// cluster's blocks share a GPC); for A/B runs.
pub const CUDA_CLUSTER_WAVES: &str = "DISAGG_CUDA_CLUSTER_WAVES";

/// `0`: the keys-on-M decode kernel, launched programmatically, waits for the kernel
/// before it before it asks for any key tile, instead of asking for the first tiles of
/// keys older than the row's own first; for A/B runs.
pub const CUDA_KM_EARLY: &str = "DISAGG_CUDA_KM_EARLY";

/// `1`: the keys-on-M decode kernel loads its key tiles by bulk copies (the TMA unit,
/// sm_90: one 16-byte-aligned row of K or V per thread, counted in by an mbarrier)
/// instead of sixteen 16-byte cp.async per thread; for A/B runs.
pub const CUDA_KM_BULK: &str = "DISAGG_CUDA_KM_BULK";

/// `0`: the CUDA flash and keys-on-M attention kernels rescale their output accumulators
/// on every key tile instead of only when one of the warp's row maxima rose (a product
/// with 1 skipped: the same bits); for A/B runs.
pub const CUDA_FLASH_LAZY_RESCALE: &str = "DISAGG_CUDA_FLASH_LAZY_RESCALE";

/// `0`: a keys-on-M decode attention split in a thread block cluster merges its splits
/// reading each split's partial after the maximum over them is known (a round trip per
/// split), instead of every split's in one round of loads (at most 16 splits; the same
/// arithmetic, the same bits); for A/B runs.
pub const CUDA_FLASH_MERGE_ILP: &str = "DISAGG_CUDA_FLASH_MERGE_ILP";

/// `0`: the keys-on-M decode kernel loads q's values and each key tile's block-table
/// entries one after another as it uses them (per the SASS, a round trip each, the loads
/// waiting behind the uses in the instruction stream), instead of all before the first use
/// (one round trip; the same values, the same bits; with the relaxed exit below, Llama-3-8B
/// batch 1 −1.6 to −2.1% and batch 64 −2.8 to −3.3% on an H100, docs/PERF.md); for A/B runs.
pub const CUDA_KM_BATCH_LOADS: &str = "DISAGG_CUDA_KM_BATCH_LOADS";

/// `0`: the keys-on-M decode kernel asks for q's values after its first tiles' copies,
/// instead of (with its loads first and no early trigger from the QKV GEMV, so that the
/// kernel before has finished when it starts) waiting for that kernel first and asking for
/// q beside the tiles' block-table entries, one round trip for both (the same values, the
/// same bits; Llama-3-8B batch 1 −0.05 to −0.28% on an H100, docs/PERF.md); for A/B runs.
pub const CUDA_KM_WAIT_FIRST: &str = "DISAGG_CUDA_KM_WAIT_FIRST";

/// `0`: where the keys-on-M decode kernel waits first (above) and applies RoPE itself
/// (`DISAGG_CUDA_ATTN_ROPE`), it loads the row's k and v and the RoPE frequencies each when
/// it uses them (the k/v write's loads after q is packed, the frequencies' before the early
/// tiles), instead of asking for them beside q and computing cos/sin after its early tiles
/// (the same values, the same bits; on an H100 Llama-3-8B batch 16 at 1k keys −0.94 and
/// −0.96% and batch 64 −0.41% in two alternated rounds, its b64 attention at 1k keys in
/// `decodelab` −1.9 to −3.0%; docs/PERF.md); for A/B runs.
pub const CUDA_KM_KV_EARLY: &str = "DISAGG_CUDA_KM_KV_EARLY";

/// `N`: a CUDA bf16 down projection of N to 128 tokens (past the GEMV and the skinny GEMM)
/// runs as cuBLAS GEMMs over 4 slices of K (up to 64 tokens; 2 up to 128, where a slice
/// keeps ≥ 3,584 columns: Llama-3-8B's 14,336) into partials and one kernel that adds them
/// and the residual and writes the next RMSNorm's bf16 output, which the norm then skips,
/// instead of one cuBLAS GEMM adding into the residual (cuBLAS' own split-K and its
/// reduction launch) and the norm's own launch. Default 65 (two slices, 65–128 tokens:
/// Llama-3-8B b128 0.5–0.7% faster on an H100; four slices at 16–64 tokens were 0.2–0.7%
/// slower there); `0`: never. For A/B runs (docs/PERF.md, twenty-ninth and seventieth
/// sessions).
pub const CUDA_SPLITK_NORM: &str = "DISAGG_CUDA_SPLITK_NORM";

/// `0`: the cluster barrier after a keys-on-M cluster's merge arrives with release (every
/// block's output stores drained first), instead of without (what it guards is only that
/// no block leaves while another reads its shared memory; each value read is used first;
/// in the attention lab on an H100 its exit 0.26 µs sooner, docs/PERF.md); for A/B runs.
pub const CUDA_CLUSTER_RELAXED_EXIT: &str = "DISAGG_CUDA_CLUSTER_RELAXED_EXIT";

/// `0`: CUDA prefill steps at head_dim 128 on sm_90 take the one-warpgroup flash kernel
/// (64-row tiles, three blocks per SM) instead of the warp-specialized one (128-row
/// tiles: a producer warpgroup loading K/V tiles, two consumer warpgroups sharing them);
/// for A/B runs.
pub const CUDA_FLASH_WARP_SPEC: &str = "DISAGG_CUDA_FLASH_WARP_SPEC";

/// `1`: the warp-specialized flash kernel's two consumer warpgroups take turns at the
/// tensor cores (FlashAttention-3's ping-pong, by named barriers) instead of issuing
/// their MMAs whenever ready; measured level on the H200 (docs/PERF.md), for A/B runs.
pub const CUDA_FLASH_PP_TURNS: &str = "DISAGG_CUDA_FLASH_PP_TURNS";

/// `0`: the warp-specialized flash kernel's producer computes its copies' addresses by
/// the general loop (with a division path) instead of the lean one for power-of-two
/// cache blocks; the same copies, for A/B runs.
pub const CUDA_FLASH_PP_LEAN: &str = "DISAGG_CUDA_FLASH_PP_LEAN";

/// `0`: on a step of the warp-specialized flash kernel, RoPE rotates q and k before the
/// attention (q written back and read again) instead of k alone, with the kernel rotating
/// q as it loads it; the same bits, for A/B runs.
pub const CUDA_PP_ROPE: &str = "DISAGG_CUDA_PP_ROPE";

/// `0`: a warp-specialized prefill step's k RoPE in its loop form (`rope_write_k_f16_loops`,
/// a block per token: the angles, then k's loads a round at a time, then v's) with the
/// cos/sin made in every layer, instead of the grouped kernel skipping q's heads
/// (`rope_write_k_f16`); the same bits, for A/B runs.
pub const CUDA_ROPE_K_ROUND: &str = "DISAGG_CUDA_ROPE_K_ROUND";

/// Lets the attention be scheduled before the one-token QKV GEMV (with RoPE) ends, so its
/// blocks can ask for their older keys' tiles while the GEMV still runs, where room is
/// left beside it (`griddepcontrol.launch_dependents`; with `DISAGG_CUDA_PDL` only): bit
/// `1` as each GEMV block starts, or `2` as each block's first warp leaves its loop (not
/// both); bit `4` the QKV GEMV at two loads per row (four blocks per SM) instead of the
/// three of `DISAGG_CUDA_GEMV_DEEP`; bit `8` the QKV GEMVs ask for the largest shared-memory
/// carveout (100%), room for an attention block beside them (58% left none). Default `13`
/// (entry, two loads, 100%): 0.2–0.6% faster than `0` (none) at Llama-3-8B batch 1 on five
/// H100 starts and 0.1–1.2% on one H200 start (docs/PERF.md); bits 1, 2 and 4 alone were
/// measured level at the driver's carveout. For A/B runs.
pub const CUDA_QKV_TRIGGER: &str = "DISAGG_CUDA_QKV_TRIGGER";

/// `0`: one-token GEMVs keep two 16-byte loads per row in flight everywhere, instead of
/// more where their grid leaves the SMs room and each lane has two whole groups of them:
/// four in the residual GEMVs that leave the next norm's inputs, at most two blocks per
/// SM (o and down at Llama-3-8B's 4,096 outputs), three in the prenormed QKV GEMV with
/// RoPE at up to three, unless `DISAGG_CUDA_QKV_TRIGGER`'s bit 4 (on by default) keeps it
/// at two (the same bits; Llama-3-8B batch 1 −2% on the H200, PERF.md).
/// Only the prenormed path has them (nothing changes with `DISAGG_CUDA_GEMV_PRENORM=0` or
/// `DISAGG_CUDA_GEMV_PIPE=0`). For A/B runs.
pub const CUDA_GEMV_DEEP: &str = "DISAGG_CUDA_GEMV_DEEP";

/// `0`: the CUDA SiLU·gate runs one element per thread over the flat index (a 64-bit
/// division each) instead of 4 columns per thread on a (columns, rows) grid; for A/B runs.
pub const CUDA_SILU_ROWS4: &str = "DISAGG_CUDA_SILU_ROWS4";
