//! The reference GPT / MoE model: its spec, presets, tensor list and byte count.

use dckpt_shard_spec::{DType, Dims, Key, TensorDecl};
use serde::{Deserialize, Serialize};

use crate::{Layout, LayoutError, OptimizerMode};

/// A reference model, as a JSON object (unknown fields are an error, so a typo cannot
/// silently change the model). Field meanings follow Megatron's arguments; `dtype` takes
/// Megatron's and PyTorch's names too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Tokens in the vocabulary, before padding.
    pub vocab_size: u64,
    /// The vocabulary is padded to a multiple of this times tp (default 128).
    #[serde(default = "default_vocab_divisor")]
    pub make_vocab_size_divisible_by: u64,
    /// Width of the residual stream.
    pub hidden_size: u64,
    /// Attention heads per layer.
    pub num_attention_heads: u64,
    /// Key/value head groups (grouped-query attention).
    /// Defaults to `num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_query_groups: Option<u64>,
    /// Width of one attention head.
    /// Defaults to `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_channels: Option<u64>,
    /// Inner width of a dense layer's MLP.
    pub ffn_hidden_size: u64,
    /// Transformer layers, divided evenly over pipeline stages.
    pub num_layers: u64,
    /// Experts per MoE layer; 0 for a dense model.
    #[serde(default)]
    pub num_experts: u64,
    /// Inner width of one expert's MLP.
    /// Defaults to `ffn_hidden_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_ffn_hidden_size: Option<u64>,
    /// Layer `i` is a MoE layer when `num_experts > 0` and `i % moe_layer_freq == 0`.
    #[serde(default = "one")]
    pub moe_layer_freq: u64,
    /// A gated MLP: fc1 holds `[W; V]`, twice the inner width.
    #[serde(default = "yes")]
    pub glu: bool,
    /// Whether the linear layers have biases.
    #[serde(default)]
    pub add_bias: bool,
    /// Whether the output layer shares the input embedding's weight.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// The parameters' element type: bf16, f16 or f32.
    /// Any name [`DType::from_name`] knows (`bf16`, `fp32`, `float16`, `torch.bfloat16`,
    /// ...); written back as the canonical name.
    #[serde(default = "bf16", deserialize_with = "DType::deserialize_any_name")]
    pub dtype: DType,
}

fn default_vocab_divisor() -> u64 {
    128
}
fn one() -> u64 {
    1
}
fn yes() -> bool {
    true
}
fn bf16() -> DType {
    DType::Bf16
}

/// Names of the built-in presets.
pub const PRESETS: [&str; 4] = ["tiny", "gpt-small", "moe-small", "moe-xl"];

impl ModelSpec {
    /// A plain spec with the defaults of the reference model.
    fn base(vocab: u64, h: u64, a: u64, f: u64, layers: u64) -> ModelSpec {
        ModelSpec {
            vocab_size: vocab,
            make_vocab_size_divisible_by: 128,
            hidden_size: h,
            num_attention_heads: a,
            num_query_groups: None,
            kv_channels: None,
            ffn_hidden_size: f,
            num_layers: layers,
            num_experts: 0,
            moe_ffn_hidden_size: None,
            moe_layer_freq: 1,
            glu: true,
            add_bias: false,
            tie_embeddings: false,
            dtype: DType::Bf16,
        }
    }

    /// One of [`PRESETS`].
    pub fn preset(name: &str) -> Option<ModelSpec> {
        let s = match name {
            "tiny" => {
                ModelSpec { num_experts: 4, moe_ffn_hidden_size: Some(64), ..ModelSpec::base(1000, 64, 4, 256, 4) }
            }
            "gpt-small" => ModelSpec { num_query_groups: Some(4), ..ModelSpec::base(32000, 1024, 16, 4096, 8) },
            "moe-small" => ModelSpec {
                num_query_groups: Some(4),
                num_experts: 8,
                moe_ffn_hidden_size: Some(1024),
                ..ModelSpec::base(32000, 1024, 16, 4096, 8)
            },
            "moe-xl" => ModelSpec {
                kv_channels: Some(128),
                num_experts: 256,
                moe_ffn_hidden_size: Some(2048),
                ..ModelSpec::base(129280, 7168, 128, 18432, 64)
            },
            _ => return None,
        };
        Some(s)
    }

    /// The same model, `hidden_size` wide with experts `moe_ffn_hidden_size` wide: layers,
    /// experts, heads and their width, the vocabulary and the dense MLP's width are kept, so
    /// every dense tensor's element count scales by one factor (the hidden widths' ratio) and
    /// every expert tensor's by that and the expert widths' ratio. A layout that fits the
    /// spec fits this one and cuts it into the same pieces, except where the distributed
    /// optimizer's even slices round to other element boundaries.
    ///
    /// Benchmarks use it to run a large model's protocol (its chunk and shard counts) with
    /// little data. The head width is pinned explicitly, since it defaulted to the hidden
    /// width over the heads.
    pub fn narrowed(&self, hidden_size: u64, moe_ffn_hidden_size: u64) -> ModelSpec {
        ModelSpec {
            hidden_size,
            kv_channels: Some(self.head_dim()),
            moe_ffn_hidden_size: Some(moe_ffn_hidden_size),
            ..self.clone()
        }
    }

    /// Key/value head groups, `num_query_groups` or else one per head.
    pub fn query_groups(&self) -> u64 {
        self.num_query_groups.unwrap_or(self.num_attention_heads)
    }

    /// Width of one attention head, `kv_channels` or else `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> u64 {
        self.kv_channels.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Inner width of one expert, `moe_ffn_hidden_size` or else `ffn_hidden_size`.
    pub fn moe_ffn(&self) -> u64 {
        self.moe_ffn_hidden_size.unwrap_or(self.ffn_hidden_size)
    }

    fn glu_factor(&self) -> u64 {
        if self.glu { 2 } else { 1 }
    }

    /// Whether global layer `layer` has experts instead of a dense MLP.
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        self.num_experts > 0 && layer.is_multiple_of(self.moe_layer_freq)
    }

    /// The vocabulary padded to a multiple of `make_vocab_size_divisible_by * tp`.
    pub fn padded_vocab(&self, tp: u32) -> u64 {
        // Saturating: `check` refuses a spec whose sizes come near it.
        let m = self.make_vocab_size_divisible_by.saturating_mul(tp as u64).max(1);
        self.vocab_size.div_ceil(m).saturating_mul(m)
    }

    /// Checks the spec on its own and against a layout; each error says what to change.
    pub fn check(&self, layout: &Layout) -> Result<(), LayoutError> {
        let err = |reason: String| Err(LayoutError::Model { reason });
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.query_groups()),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("num_layers", self.num_layers),
            ("moe_ffn_hidden_size", self.moe_ffn()),
            ("moe_layer_freq", self.moe_layer_freq),
        ] {
            if v == 0 {
                return err(format!("{name} must be positive"));
            }
        }
        if !matches!(self.dtype, DType::Bf16 | DType::F16 | DType::F32) {
            return err(format!("dtype {} is not a parameter dtype; use bf16, f16 or f32", self.dtype));
        }
        let (a, g) = (self.num_attention_heads, self.query_groups());
        if self.kv_channels.is_none() && !self.hidden_size.is_multiple_of(a) {
            return err(format!(
                "hidden_size {} is not divisible by num_attention_heads {a}; set kv_channels",
                self.hidden_size
            ));
        }
        if self.head_dim() == 0 {
            return err("kv_channels must be positive".into());
        }
        if a % g != 0 {
            return err(format!("num_attention_heads {a} is not a multiple of num_query_groups {g}"));
        }
        let c = layout.config;
        let tp = c.tp as u64;
        if a % tp != 0 || g % tp != 0 {
            return err(format!(
                "tp {tp} must divide num_attention_heads {a} and num_query_groups {g}; choose another tp"
            ));
        }
        if !self.ffn_hidden_size.is_multiple_of(tp) {
            return err(format!("tp {tp} must divide ffn_hidden_size {}; choose another tp", self.ffn_hidden_size));
        }
        if !self.num_layers.is_multiple_of(c.pp as u64) {
            return err(format!("pp {} must divide num_layers {}; choose another pp", c.pp, self.num_layers));
        }
        self.check_sizes(c.tp)?;
        if self.num_experts == 0 {
            if c.ep != 1 || c.etp != 1 {
                return err(format!(
                    "ep {} / etp {} need a MoE model (num_experts > 0); use ep 1 and etp 1 for a dense model",
                    c.ep, c.etp
                ));
            }
        } else {
            if !self.num_experts.is_multiple_of(c.ep as u64) {
                return err(format!("ep {} must divide num_experts {}; choose another ep", c.ep, self.num_experts));
            }
            if !self.moe_ffn().is_multiple_of(c.etp as u64) {
                return err(format!(
                    "etp {} must divide moe_ffn_hidden_size {}; choose another etp",
                    c.etp,
                    self.moe_ffn()
                ));
            }
        }
        Ok(())
    }

    /// One parameter list entry per layer and expert, and every size multiplied out: a spec
    /// past these (a typo, a hostile file) panicked on overflow or wrapped to a division by
    /// zero, where it is an error that says so.
    fn check_sizes(&self, tp: u32) -> Result<(), LayoutError> {
        let err = |reason: String| Err(LayoutError::Model { reason });
        for (name, v) in [("num_layers", self.num_layers), ("num_experts", self.num_experts)] {
            if v > LAYERS_MAX {
                return err(format!("{name} {v} is more than {LAYERS_MAX}"));
            }
        }
        if self.expected_bytes(tp, OptimizerMode::Adam) >= STATE_BYTES_MAX {
            return err(format!(
                "the parameters and their optimizer state would take {STATE_BYTES_MAX} bytes or more at tp {tp}: \
                 a size (or make_vocab_size_divisible_by) is far too large"
            ));
        }
        Ok(())
    }

    /// The bytes the model occupies with its optimizer state, from the closed-form
    /// formula of the reference model — computed without any tensor list or plan.
    pub fn expected_bytes(&self, tp: u32, optimizer: OptimizerMode) -> u64 {
        // Saturating at u64::MAX, never wrapping: `check` compares the result with its bound.
        let s = Sat;
        let (h, gf, e) = (s(self.hidden_size), s(self.glu_factor()), s(self.num_experts));
        let (a, d) = (s(self.num_attention_heads), s(self.head_dim()));
        let qkv_out = (a + s(2) * s(self.query_groups())) * d;
        let proj_in = a * d;
        let bias = |n: Sat| if self.add_bias { n } else { s(0) };
        let attention = h + qkv_out * h + bias(qkv_out) + h * proj_in + bias(h);
        let f = s(self.ffn_hidden_size);
        let dense_mlp = h + gf * f * h + bias(gf * f) + h * f + bias(h);
        let fe = s(self.moe_ffn());
        let moe_mlp = h + e * h + e * gf * fe * h + bias(e * gf * fe) + e * h * fe + bias(e * h);
        // Layers 0, freq, 2 freq, ... have experts (`is_moe_layer`).
        let moe_layers = if self.num_experts > 0 { self.num_layers.div_ceil(self.moe_layer_freq.max(1)) } else { 0 };
        let layers =
            s(self.num_layers) * attention + s(moe_layers) * moe_mlp + s(self.num_layers - moe_layers) * dense_mlp;
        let vp = s(self.padded_vocab(tp));
        let outside = vp * h + h + if self.tie_embeddings { s(0) } else { vp * h };
        let numel = layers + outside;
        let optimizer_bytes = if optimizer == OptimizerMode::None { s(0) } else { s(12) * numel };
        (numel * s(self.dtype.size()) + optimizer_bytes).0
    }
}

/// Most layers, and most experts, a spec may have.
const LAYERS_MAX: u64 = 1 << 20;
/// A model state at or past this many bytes (4 EiB) is a spec gone wrong.
const STATE_BYTES_MAX: u64 = 1 << 62;

/// A size that saturates at `u64::MAX` rather than overflowing.
#[derive(Clone, Copy)]
struct Sat(u64);

impl std::ops::Add for Sat {
    type Output = Sat;
    fn add(self, o: Sat) -> Sat {
        Sat(self.0.saturating_add(o.0))
    }
}

impl std::ops::Mul for Sat {
    type Output = Sat;
    fn mul(self, o: Sat) -> Sat {
        Sat(self.0.saturating_mul(o.0))
    }
}

/// How a parameter is split over tensor/expert parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The same on every TP rank.
    Replicated,
    /// Chunk `tp_rank` of `tp` along `axis`.
    Tp {
        /// The axis split over TP ranks.
        axis: usize,
    },
    /// A gated MLP's `[W; V]`: W at chunk `r`, V at chunk `r + tp` of `2 * tp` along `axis`.
    GluTp {
        /// The axis that holds W then V, each split over TP ranks.
        axis: usize,
    },
    /// An expert tensor: experts along axis 0 (EP), and optionally ETP along `axis`,
    /// GLU-canonical if `glu`; `axis: None` is replicated over ETP.
    Expert {
        /// The axis split over ETP ranks, if any.
        axis: Option<usize>,
        /// Whether `axis` holds a gated MLP's W then V.
        glu: bool,
    },
}

/// One parameter of the model as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamDef {
    /// The parameter's Megatron name, e.g. `decoder.layers.0.mlp.linear_fc1.weight`.
    pub key: Key,
    /// Its global shape.
    pub shape: Dims,
    /// How it is split over tensor and expert parallel ranks.
    pub split: Split,
    /// The pipeline stage that owns the parameter.
    pub stage: u32,
    /// Non-zero for the tied output embedding's copy on the last stage (never main).
    pub pp_copy: u32,
}

impl ParamDef {
    /// Whether it belongs to the experts, so is replicated over expert-DP, not DP x CP.
    pub fn is_expert(&self) -> bool {
        matches!(self.split, Split::Expert { .. })
    }
}

/// Every parameter the model has under `layout`, plus the tied embedding's copy on the
/// last stage when there is one. Sorted by (stage, key).
pub fn params(spec: &ModelSpec, layout: &Layout) -> Vec<ParamDef> {
    let c = layout.config;
    let (h, gf) = (spec.hidden_size, spec.glu_factor());
    let a_d = spec.num_attention_heads * spec.head_dim();
    let qkv_out = (spec.num_attention_heads + 2 * spec.query_groups()) * spec.head_dim();
    let per_stage = spec.num_layers / c.pp as u64;
    let last = c.pp - 1;
    let mut out = Vec::new();
    let mut add = |key: String, shape: Vec<u64>, split: Split, stage: u32| {
        out.push(ParamDef { key: key.into(), shape: shape.into(), split, stage, pp_copy: 0 })
    };
    let glu_or_tp = |axis| if spec.glu { Split::GluTp { axis } } else { Split::Tp { axis } };
    for i in 0..spec.num_layers {
        let stage = (i / per_stage) as u32;
        let p = |s: &str| format!("decoder.layers.{i}.{s}");
        add(p("self_attention.linear_qkv.layer_norm_weight"), vec![h], Split::Replicated, stage);
        add(p("self_attention.linear_qkv.weight"), vec![qkv_out, h], Split::Tp { axis: 0 }, stage);
        add(p("self_attention.linear_proj.weight"), vec![h, a_d], Split::Tp { axis: 1 }, stage);
        if spec.add_bias {
            add(p("self_attention.linear_qkv.bias"), vec![qkv_out], Split::Tp { axis: 0 }, stage);
            add(p("self_attention.linear_proj.bias"), vec![h], Split::Replicated, stage);
        }
        if spec.is_moe_layer(i) {
            let (e, fe) = (spec.num_experts, spec.moe_ffn());
            add(p("pre_mlp_layernorm.weight"), vec![h], Split::Replicated, stage);
            add(p("mlp.router.weight"), vec![e, h], Split::Replicated, stage);
            let fc1 = Split::Expert { axis: Some(1), glu: spec.glu };
            add(p("mlp.experts.linear_fc1.weight"), vec![e, gf * fe, h], fc1, stage);
            add(p("mlp.experts.linear_fc2.weight"), vec![e, h, fe], Split::Expert { axis: Some(2), glu: false }, stage);
            if spec.add_bias {
                add(p("mlp.experts.linear_fc1.bias"), vec![e, gf * fe], fc1, stage);
                add(p("mlp.experts.linear_fc2.bias"), vec![e, h], Split::Expert { axis: None, glu: false }, stage);
            }
        } else {
            let f = spec.ffn_hidden_size;
            add(p("mlp.linear_fc1.layer_norm_weight"), vec![h], Split::Replicated, stage);
            add(p("mlp.linear_fc1.weight"), vec![gf * f, h], glu_or_tp(0), stage);
            add(p("mlp.linear_fc2.weight"), vec![h, f], Split::Tp { axis: 1 }, stage);
            if spec.add_bias {
                add(p("mlp.linear_fc1.bias"), vec![gf * f], glu_or_tp(0), stage);
                add(p("mlp.linear_fc2.bias"), vec![h], Split::Replicated, stage);
            }
        }
    }
    let vp = spec.padded_vocab(c.tp);
    add("embedding.word_embeddings.weight".into(), vec![vp, h], Split::Tp { axis: 0 }, 0);
    add("decoder.final_layernorm.weight".into(), vec![h], Split::Replicated, last);
    if !spec.tie_embeddings {
        add("output_layer.weight".into(), vec![vp, h], Split::Tp { axis: 0 }, last);
    } else if c.pp > 1 {
        out.push(ParamDef {
            key: "embedding.word_embeddings.weight".into(),
            shape: vec![vp, h].into(),
            split: Split::Tp { axis: 0 },
            stage: last,
            pp_copy: 1,
        });
    }
    out.sort_by(|a, b| (a.stage, &a.key, a.pp_copy).cmp(&(b.stage, &b.key, b.pp_copy)));
    out
}

/// The optimizer state keys of parameter `key`, each an fp32 tensor shaped like it.
pub fn optimizer_keys(key: &str) -> [String; 3] {
    [
        format!("optimizer.state.fp32_param.{key}"),
        format!("optimizer.state.exp_avg.{key}"),
        format!("optimizer.state.exp_avg_sq.{key}"),
    ]
}

/// The model's declaration of its global tensors (parameters and optimizer state),
/// sorted by key. The tied copy is the embedding itself and is declared once.
pub fn declared_tensors(spec: &ModelSpec, layout: &Layout, optimizer: OptimizerMode) -> Vec<TensorDecl> {
    let mut out = Vec::new();
    for p in params(spec, layout).into_iter().filter(|p| p.pp_copy == 0) {
        if optimizer != OptimizerMode::None {
            for k in optimizer_keys(&p.key) {
                out.push(TensorDecl { key: k.into(), dtype: DType::F32, global_shape: p.shape.clone() });
            }
        }
        out.push(TensorDecl { key: p.key, dtype: spec.dtype, global_shape: p.shape });
    }
    out.sort();
    out
}
