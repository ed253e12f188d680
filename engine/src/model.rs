//! The Llama forward pass, written once against [`kernels::Backend`], and weight
//! loading from GGUF files and Hugging Face directories.
//!
//! Weights are addressed by their GGUF names (`blk.3.attn_q.weight`); the Hugging Face
//! source maps those to its own names. Q, K and V are stacked into one matrix, as are
//! gate and up, so each layer runs four matmuls.

use std::collections::HashMap;
use std::path::Path;

use kernels::quant::GgmlType;
use kernels::{AttnShape, Backend, Rope, SampleSpec, SampledRow, StepBatch, StepLimits, WeightPart};

use crate::config::ModelConfig;
use crate::gguf::Gguf;
use crate::EngineError;

/// Where weights come from.
pub trait WeightSource {
    /// A matrix by GGUF name: (type, rows, cols, row-major bytes).
    fn matrix(&self, name: &str) -> Result<(GgmlType, usize, usize, Vec<u8>), EngineError>;
    /// A vector by GGUF name, as f32.
    fn vector(&self, name: &str) -> Result<Vec<f32>, EngineError>;
    fn has(&self, name: &str) -> bool;
}

impl WeightSource for Gguf {
    fn matrix(&self, name: &str) -> Result<(GgmlType, usize, usize, Vec<u8>), EngineError> {
        let t = self.tensor(name).ok_or_else(|| missing(name))?;
        if t.dims.len() != 2 {
            return Err(EngineError::Model(format!("tensor {name} should be a matrix, has dims {:?}", t.dims)));
        }
        let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
        let (ty, bytes) = self.read_tensor(t)?;
        Ok((ty, rows, cols, bytes))
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        let t = self.tensor(name).ok_or_else(|| missing(name))?;
        self.read_f32(t)
    }

    fn has(&self, name: &str) -> bool {
        self.tensor(name).is_some()
    }
}

fn missing(name: &str) -> EngineError {
    EngineError::Model(format!("the model file has no tensor {name}; is it a complete Llama model?"))
}

/// Tensors of a Hugging Face directory (all `*.safetensors` files), read into memory.
pub struct SafetensorsSource {
    tensors: HashMap<String, (GgmlType, Vec<usize>, Vec<u8>)>,
}

impl SafetensorsSource {
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| EngineError::Model(format!("cannot read {}: {e}", dir.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(EngineError::Model(format!("{} has no *.safetensors files", dir.display())));
        }
        let mut tensors = HashMap::new();
        for f in files {
            let bytes =
                std::fs::read(&f).map_err(|e| EngineError::Model(format!("cannot read {}: {e}", f.display())))?;
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| EngineError::Model(format!("{} is not a valid safetensors file: {e}", f.display())))?;
            for (name, view) in st.tensors() {
                let ty = match view.dtype() {
                    safetensors::Dtype::F32 => GgmlType::F32,
                    safetensors::Dtype::F16 => GgmlType::F16,
                    safetensors::Dtype::BF16 => GgmlType::BF16,
                    other => {
                        return Err(EngineError::Unsupported(format!(
                            "tensor {name} in {} has dtype {other:?}; supported: BF16, F16, F32",
                            f.display()
                        )))
                    }
                };
                tensors.insert(name, (ty, view.shape().to_vec(), view.data().to_vec()));
            }
        }
        Ok(Self { tensors })
    }

    fn hf_name(name: &str) -> String {
        fn map(s: &str) -> &str {
            match s {
                "attn_norm.weight" => "input_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => other,
            }
        }
        match name {
            "token_embd.weight" => "model.embed_tokens.weight".into(),
            "output_norm.weight" => "model.norm.weight".into(),
            "output.weight" => "lm_head.weight".into(),
            _ => match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
                Some((layer, rest)) => format!("model.layers.{layer}.{}", map(rest)),
                None => name.into(),
            },
        }
    }
}

impl WeightSource for SafetensorsSource {
    fn matrix(&self, name: &str) -> Result<(GgmlType, usize, usize, Vec<u8>), EngineError> {
        let hf = Self::hf_name(name);
        let (ty, shape, data) = self.tensors.get(&hf).ok_or_else(|| missing(&hf))?;
        if shape.len() != 2 {
            return Err(EngineError::Model(format!("tensor {hf} should be a matrix, has shape {shape:?}")));
        }
        Ok((*ty, shape[0], shape[1], data.clone()))
    }

    fn vector(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        let hf = Self::hf_name(name);
        let (ty, shape, data) = self.tensors.get(&hf).ok_or_else(|| missing(&hf))?;
        let mut out = vec![0f32; shape.iter().product()];
        kernels::quant::dequantize_row(*ty, data, &mut out);
        Ok(out)
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(&Self::hf_name(name))
    }
}

pub struct Layer<B: Backend> {
    pub attn_norm: B::Vector,
    pub qkv: B::Linear,
    pub attn_out: B::Linear,
    pub ffn_norm: B::Vector,
    pub gate_up: B::Linear,
    pub down: B::Linear,
}

pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub embed: B::Linear,
    pub layers: Vec<Layer<B>>,
    pub norm: B::Vector,
    /// `None` when the output projection is the embedding matrix.
    pub output: Option<B::Linear>,
    pub rope: Rope,
    pub attn: AttnShape,
    /// Bytes of weights one decode step streams (all matrices once).
    pub weight_bytes: usize,
}

/// Activation buffers for one step of up to `max_tokens` tokens and `max_logits`
/// sampled rows, allocated once.
pub struct Workspace<B: Backend> {
    pub max_tokens: usize,
    pub max_logits: usize,
    x: B::Act,
    h: B::Act,
    qkv: B::Act,
    attn: B::Act,
    gu: B::Act,
    act: B::Act,
    sel: B::Act,
    seln: B::Act,
    logits: B::Act,
}

/// How [`Model::forward`] takes the tokens of its logit rows.
pub enum Sampling<'s, 'a> {
    /// The logits are copied to the host.
    Host,
    /// The backend samples where the logits are, one spec per row, into the vector (or,
    /// where it does not, the logits are copied to the host).
    Device(&'s [SampleSpec<'a>], &'s mut Vec<SampledRow>),
    /// Plain greedy rows: the backend takes their argmax and leaves it where it is, for
    /// the next step and for [`Backend::collect_sampled`] (only where
    /// [`Backend::defers_sampling`]).
    Deferred,
}

/// Runs after a layer's K/V are in the cache: `(backend, kv, layer)`.
pub type LayerHook<'a, B> = &'a mut dyn FnMut(&mut B, &<B as Backend>::Kv, usize);

impl<B: Backend> Model<B> {
    pub fn load(
        backend: &B,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        matrix_bytes: impl Fn(&B::Linear) -> usize,
    ) -> Result<Self, EngineError> {
        let check = |name: &str, rows: usize, cols: usize, r: usize, c: usize| {
            if (rows, cols) != (r, c) {
                return Err(EngineError::Model(format!("tensor {name} is {rows}x{cols}, the config says {r}x{c}")));
            }
            Ok(())
        };
        let linear = |names: &[(&str, usize, usize)]| -> Result<B::Linear, EngineError> {
            let mut owned = Vec::new();
            for &(name, r, c) in names {
                let (ty, rows, cols, bytes) = src.matrix(name)?;
                check(name, rows, cols, r, c)?;
                owned.push((ty, rows, cols, bytes));
            }
            let parts: Vec<WeightPart> = owned
                .iter()
                .map(|(ty, rows, cols, bytes)| WeightPart { ty: *ty, rows: *rows, cols: *cols, bytes })
                .collect();
            backend.linear(&parts).map_err(|e| EngineError::Model(e.to_string()))
        };
        let vector = |name: &str, n: usize| -> Result<B::Vector, EngineError> {
            let v = src.vector(name)?;
            if v.len() != n {
                return Err(EngineError::Model(format!("tensor {name} has {} values, expected {n}", v.len())));
            }
            Ok(backend.vector(&v))
        };
        let (d, hd) = (cfg.hidden, cfg.head_dim);
        let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let embed = linear(&[("token_embd.weight", cfg.vocab, d)])?;
        let mut weight_bytes = 0;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let layer = Layer {
                attn_norm: vector(&n("attn_norm.weight"), d)?,
                qkv: linear(&[
                    (&n("attn_q.weight"), qd, d),
                    (&n("attn_k.weight"), kvd, d),
                    (&n("attn_v.weight"), kvd, d),
                ])?,
                attn_out: linear(&[(&n("attn_output.weight"), d, qd)])?,
                ffn_norm: vector(&n("ffn_norm.weight"), d)?,
                gate_up: linear(&[(&n("ffn_gate.weight"), cfg.ffn, d), (&n("ffn_up.weight"), cfg.ffn, d)])?,
                down: linear(&[(&n("ffn_down.weight"), d, cfg.ffn)])?,
            };
            weight_bytes += matrix_bytes(&layer.qkv)
                + matrix_bytes(&layer.attn_out)
                + matrix_bytes(&layer.gate_up)
                + matrix_bytes(&layer.down);
            layers.push(layer);
        }
        let output = if src.has("output.weight") && !cfg.tied_embeddings {
            Some(linear(&[("output.weight", cfg.vocab, d)])?)
        } else {
            None
        };
        weight_bytes += matrix_bytes(output.as_ref().unwrap_or(&embed));
        let freq_factors = if src.has("rope_freqs.weight") { Some(src.vector("rope_freqs.weight")?) } else { None };
        let rope = Rope { interleaved: cfg.rope_interleaved, inv_freq: cfg.rope_inv_freq(freq_factors.as_deref()) };
        let attn = AttnShape {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        Ok(Model { norm: vector("output_norm.weight", d)?, cfg, embed, layers, output, rope, attn, weight_bytes })
    }

    /// The step limits that size a backend's scratch ([`Backend::reserve`]) for steps of
    /// at most `max_tokens` tokens and `max_seqs` sequences of `max_model_len` tokens.
    pub fn step_limits(
        &self,
        max_tokens: usize,
        max_seqs: usize,
        max_model_len: usize,
        block_size: usize,
    ) -> StepLimits {
        let c = &self.cfg;
        StepLimits {
            max_tokens,
            max_seqs,
            max_table_entries: max_seqs * max_model_len.div_ceil(block_size.max(1)),
            widest_input: c.hidden.max(c.ffn).max(self.attn.q_dim()),
            attn: self.attn,
        }
    }

    /// Copies the first `out.len()` logits of the last step (its logit rows in order)
    /// to the host.
    pub fn logits_to_host(&self, be: &mut B, ws: &Workspace<B>, out: &mut [f32]) {
        be.to_host(&ws.logits, out);
    }

    pub fn workspace(&self, backend: &B, max_tokens: usize, max_logits: usize) -> Result<Workspace<B>, EngineError> {
        let c = &self.cfg;
        let act = |len| backend.act(len).map_err(|e| EngineError::Model(e.to_string()));
        Ok(Workspace {
            max_tokens,
            max_logits,
            x: act(max_tokens * c.hidden)?,
            h: act(max_tokens * c.hidden)?,
            qkv: act(max_tokens * self.attn.qkv_dim())?,
            attn: act(max_tokens * self.attn.q_dim())?,
            gu: act(max_tokens * 2 * c.ffn)?,
            act: act(max_tokens * c.ffn)?,
            sel: act(max_logits * c.hidden)?,
            seln: act(max_logits * c.hidden)?,
            logits: act(max_logits * c.vocab)?,
        })
    }

    /// Runs one step: `tokens` (laid out as `batch` says) through all layers, writing
    /// their K/V into `kv`, and the logits of the rows in `logit_rows` into `logits`
    /// (`logit_rows.len() × vocab`). `after_layer(backend, kv, l)`, when given, runs once
    /// layer `l`'s K/V are in the cache (the KV transfer sends them from there while later
    /// layers compute). `sampling` says how the rows' tokens are taken: returns true when
    /// the backend sampled them (on the device, or deferred), false when the logits were
    /// copied to `logits`.
    ///
    /// A decode-only step without a layer hook is replayable: the same ops for every step
    /// of its shape, which a backend may capture once and replay (CUDA graphs).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        be: &mut B,
        ws: &mut Workspace<B>,
        kv: &mut B::Kv,
        tokens: &[u32],
        batch: &StepBatch,
        logit_rows: &[u32],
        logits: &mut [f32],
        sampling: Sampling,
        mut after_layer: Option<LayerHook<B>>,
    ) -> bool {
        let n = tokens.len();
        let m = logit_rows.len();
        assert!(n <= ws.max_tokens && m <= ws.max_logits && n == batch.n_tokens);
        let c = &self.cfg;
        let replayable = after_layer.is_none() && batch.seqs.iter().all(|s| s.rows.len() == 1);
        be.begin_step(tokens, batch, &self.rope, &self.attn, logit_rows);
        be.run_step(replayable, &mut |be| {
            be.embed(&self.embed, tokens, &mut ws.x);
            for (l, layer) in self.layers.iter().enumerate() {
                be.norm_qkv_rope(
                    &ws.x,
                    &layer.attn_norm,
                    c.rms_eps,
                    &mut ws.h,
                    &layer.qkv,
                    &mut ws.qkv,
                    l,
                    batch,
                    &self.rope,
                    &self.attn,
                    kv,
                );
                // Each residual write is told the norm that reads x next (a hint a backend
                // may prepare for): the FFN norm, then the next layer's or the final one.
                be.attention_residual(
                    &ws.qkv,
                    l,
                    batch,
                    &self.attn,
                    kv,
                    &mut ws.attn,
                    &layer.attn_out,
                    &mut ws.x,
                    Some(&layer.ffn_norm),
                );
                let next_norm = self.layers.get(l + 1).map_or(&self.norm, |next| &next.attn_norm);
                be.mlp_residual(
                    &mut ws.x,
                    &layer.ffn_norm,
                    c.rms_eps,
                    n,
                    &mut ws.h,
                    &layer.gate_up,
                    &mut ws.gu,
                    c.ffn,
                    &mut ws.act,
                    &layer.down,
                    Some(next_norm),
                );
                if let Some(hook) = after_layer.as_mut() {
                    hook(be, kv, l);
                }
            }
            if m > 0 {
                be.gather_rows(&ws.x, logit_rows, c.hidden, &mut ws.sel);
                let output = self.output.as_ref().unwrap_or(&self.embed);
                be.norm_matmul(&ws.sel, &self.norm, c.rms_eps, m, &mut ws.seln, output, &mut ws.logits);
            }
        });
        if m == 0 {
            return false;
        }
        match sampling {
            Sampling::Host => {}
            Sampling::Device(specs, out) => {
                assert_eq!(specs.len(), m, "one sampling spec per logit row");
                if be.sample_rows(&mut ws.logits, c.vocab, specs, out) {
                    return true;
                }
            }
            Sampling::Deferred => {
                be.sample_rows_deferred(&ws.logits, c.vocab, m);
                return true;
            }
        }
        be.to_host(&ws.logits, &mut logits[..m * c.vocab]);
        false
    }
}
