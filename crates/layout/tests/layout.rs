//! Layout math and the reference model on their own.

use dckpt_layout::{
    DenseCoord, ExpertCoord, Layout, LayoutError, ModelSpec, OptimizerMode, PRESETS, ParallelConfig, RankOrder,
    ReferenceModel, declared_tensors, snake_owner,
};
use dckpt_shard_spec::{DType, TensorPiece, validate};

fn cfg(tp: u32, pp: u32, cp: u32, ep: u32, etp: u32) -> ParallelConfig {
    ParallelConfig { tp, pp, cp, ep, etp }
}

#[test]
fn default_order_matches_megatron() {
    // tp-cp-ep-dp-pp: tp fastest, pp slowest; the expert view is etp-ep-edp-pp.
    let l = Layout::new(cfg(2, 2, 2, 2, 1), 16).unwrap();
    assert_eq!((l.dp, l.expert_dp), (2, 4));
    assert_eq!(l.dense_coord(0), DenseCoord { tp: 0, cp: 0, dp: 0, pp: 0 });
    assert_eq!(l.dense_coord(1), DenseCoord { tp: 1, cp: 0, dp: 0, pp: 0 });
    assert_eq!(l.dense_coord(2), DenseCoord { tp: 0, cp: 1, dp: 0, pp: 0 });
    assert_eq!(l.dense_coord(4), DenseCoord { tp: 0, cp: 0, dp: 1, pp: 0 });
    assert_eq!(l.dense_coord(8), DenseCoord { tp: 0, cp: 0, dp: 0, pp: 1 });
    assert_eq!(l.expert_coord(1), ExpertCoord { etp: 0, ep: 1, edp: 0, pp: 0 });
    assert_eq!(l.expert_coord(2), ExpertCoord { etp: 0, ep: 0, edp: 1, pp: 0 });
    assert_eq!(l.expert_coord(9), ExpertCoord { etp: 0, ep: 1, edp: 0, pp: 1 });
    // DP x CP group: cp fastest, then dp.
    assert_eq!([0, 2, 4, 6].map(|r| l.dp_cp_rank(r)), [0, 1, 2, 3]);
}

#[test]
fn coordinates_round_trip_in_every_order() {
    for order in ["tp-cp-ep-dp-pp", "tp-dp-cp-ep-pp", "cp-tp-dp-ep-pp", "dp-ep-cp-tp-pp"] {
        let o: RankOrder = order.parse().unwrap();
        assert_eq!(o.to_string(), order);
        let l = Layout::with_order(cfg(2, 2, 2, 2, 2), 32, o).unwrap();
        let mut seen_dense = std::collections::HashSet::new();
        for r in 0..32 {
            let (d, e) = (l.dense_coord(r), l.expert_coord(r));
            assert_eq!(l.dense_rank(d), r, "{order}");
            assert_eq!(l.expert_rank(e), r, "{order}");
            assert_eq!(d.pp, e.pp, "{order}: views disagree on the stage of rank {r}");
            assert!(seen_dense.insert((d.tp, d.cp, d.dp, d.pp)));
            assert!(l.dp_cp_rank(r) < l.dp_cp_size());
        }
    }
    assert!(matches!("tp-cp-ep-dp".parse::<RankOrder>(), Err(LayoutError::BadOrder { .. })));
    assert!(matches!("tp-tp-ep-dp-pp".parse::<RankOrder>(), Err(LayoutError::BadOrder { .. })));
    let o: RankOrder = "tp-pp-cp-ep-dp".parse().unwrap();
    assert!(matches!(Layout::with_order(cfg(2, 2, 1, 1, 1), 8, o), Err(LayoutError::PipelineViewsDisagree { .. })));
}

#[test]
fn invalid_layouts_say_what_to_change() {
    let tiny = ModelSpec::preset("tiny").unwrap();
    let err = |c: ParallelConfig, world: u32| -> String {
        match Layout::new(c, world) {
            Err(e) => e.to_string(),
            Ok(l) => ReferenceModel::new(tiny.clone(), l, OptimizerMode::Adam).unwrap_err().to_string(),
        }
    };
    assert!(err(cfg(2, 1, 1, 1, 1), 3).contains("use a multiple of 2"));
    assert!(err(cfg(1, 1, 1, 4, 2), 12).contains("etp * ep * pp = 8"));
    assert!(err(cfg(8, 1, 1, 1, 1), 8).contains("tp 8 must divide num_attention_heads 4"));
    assert!(err(cfg(1, 3, 1, 1, 1), 3).contains("pp 3 must divide num_layers 4"));
    assert!(err(cfg(1, 1, 1, 3, 1), 3).contains("ep 3 must divide num_experts 4"));
    assert!(err(cfg(1, 1, 1, 1, 128), 128).contains("etp 128 must divide moe_ffn_hidden_size 64"));
    assert!(err(cfg(0, 1, 1, 1, 1), 1).contains("tp must be at least 1"));
    let dense = ModelSpec::preset("gpt-small").unwrap();
    let l = Layout::new(cfg(1, 1, 1, 2, 1), 2).unwrap();
    assert!(ReferenceModel::new(dense, l, OptimizerMode::None).unwrap_err().to_string().contains("need a MoE model"));
}

#[test]
fn model_spec_json_rejects_unknown_fields() {
    let ok =
        r#"{"vocab_size": 100, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16, "num_layers": 2}"#;
    let spec: ModelSpec = serde_json::from_str(ok).unwrap();
    assert_eq!((spec.make_vocab_size_divisible_by, spec.glu, spec.dtype), (128, true, DType::Bf16));
    let typo = r#"{"vocab_size": 100, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16, "num_layers": 2, "num_expert": 4}"#;
    assert!(serde_json::from_str::<ModelSpec>(typo).unwrap_err().to_string().contains("num_expert"));
}

#[test]
fn model_spec_dtype_takes_megatron_and_pytorch_names_and_writes_the_canonical_one() {
    let spec = |dtype: &str| {
        let json = format!(
            r#"{{"vocab_size": 100, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16, "num_layers": 2, "dtype": "{dtype}"}}"#
        );
        serde_json::from_str::<ModelSpec>(&json)
    };
    for (name, d) in
        [("fp32", DType::F32), ("fp16", DType::F16), ("bfloat16", DType::Bf16), ("torch.float32", DType::F32)]
    {
        let s = spec(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.dtype, d, "{name}");
        let back = serde_json::to_value(&s).unwrap();
        assert_eq!(back["dtype"], d.name(), "{name}");
        assert_eq!(serde_json::from_value::<ModelSpec>(back).unwrap(), s);
    }
    let err = spec("fp33").unwrap_err().to_string();
    assert!(err.contains("unknown dtype \"fp33\"") && err.contains("bf16 (bfloat16)"), "{err}");
}

#[test]
fn padded_vocab_depends_on_tp() {
    let s = ModelSpec::preset("moe-xl").unwrap();
    assert_eq!(s.padded_vocab(1), 129280);
    assert_eq!(s.padded_vocab(8), 130048);
}

/// Specs that exercise every branch of the tensor list.
fn variants() -> Vec<ModelSpec> {
    let mut v: Vec<ModelSpec> = PRESETS.iter().map(|p| ModelSpec::preset(p).unwrap()).collect();
    let tiny = ModelSpec::preset("tiny").unwrap();
    v.push(ModelSpec { add_bias: true, tie_embeddings: true, glu: false, moe_layer_freq: 2, ..tiny.clone() });
    v.push(ModelSpec { add_bias: true, num_experts: 0, dtype: DType::F32, ..tiny });
    v
}

#[test]
fn expected_bytes_formula_agrees_with_declared_tensors() {
    for spec in variants() {
        for tp in [1, 2, 4] {
            let l = Layout::new(cfg(tp, 1, 1, 1, 1), tp).unwrap();
            for opt in OptimizerMode::ALL {
                let declared: u64 = declared_tensors(&spec, &l, opt).iter().map(|d| d.nbytes()).sum();
                assert_eq!(declared, spec.expected_bytes(tp, opt), "{spec:?} tp {tp} {opt}");
            }
        }
    }
    // moe-small by hand: per layer attention (h + (16+8)*64*h + h*16*64) and MoE MLP
    // (h + 8h + 8*2048*h + 8*h*1024); embedding and output 32000 x h; final norm h.
    let h = 1024u64;
    let layer = h + 24 * 64 * h + h * 1024 + h + 8 * h + 8 * 2048 * h + 8 * h * 1024;
    let numel = 8 * layer + 2 * 32000 * h + h;
    assert_eq!(ModelSpec::preset("moe-small").unwrap().expected_bytes(1, OptimizerMode::Adam), numel * 14);
}

#[test]
fn tied_embedding_copy_is_never_main() {
    let spec = ModelSpec { tie_embeddings: true, ..ModelSpec::preset("tiny").unwrap() };
    let l = Layout::new(cfg(2, 2, 1, 1, 1), 8).unwrap();
    for opt in OptimizerMode::ALL {
        let m = ReferenceModel::new(spec.clone(), l, opt).unwrap();
        let last_stage: Vec<u32> = (0..8).filter(|&r| l.dense_coord(r).pp == 1).collect();
        let mut copies = 0;
        for r in last_stage {
            for t in m.rank_state(r).iter().filter(|t| t.key.ends_with("embedding.word_embeddings.weight")) {
                assert_eq!(t.replica_id.pp_copy, 1);
                copies += 1;
            }
        }
        assert!(copies > 0 || opt == OptimizerMode::Layerwise, "{opt}");
        assert!(!m.params().iter().any(|p| p.key == "output_layer.weight"));
    }
}

#[test]
fn every_mode_covers_every_tensor_exactly_once() {
    for spec in variants().into_iter().filter(|s| s.num_layers <= 8 && s.hidden_size <= 1024) {
        for (world, c) in [(8, cfg(2, 2, 1, 2, 2)), (16, cfg(2, 2, 2, 1, 1)), (8, cfg(1, 2, 1, 1, 4))] {
            let c = if spec.num_experts == 0 { ParallelConfig { ep: 1, etp: 1, ..c } } else { c };
            let l = Layout::new(c, world).unwrap();
            for opt in OptimizerMode::ALL {
                let m = ReferenceModel::new(spec.clone(), l, opt).unwrap();
                let states: Vec<_> = (0..world).map(|r| m.rank_state(r)).collect();
                let pieces: Vec<TensorPiece> = states
                    .iter()
                    .enumerate()
                    .flat_map(|(r, s)| s.iter().map(move |t| TensorPiece { rank: r as u32, tensor: t }))
                    .collect();
                let decl = m.declared_tensors();
                let cov = validate(&pieces, &[], Some(&decl)).unwrap_or_else(|e| panic!("{opt} {c:?}: {e}"));
                assert_eq!(cov.tensor_bytes, m.expected_bytes());
            }
        }
    }
}

#[test]
fn snake_order_deals_back_and_forth() {
    let owners: Vec<u64> = (0..9).map(|i| snake_owner(i, 4)).collect();
    assert_eq!(owners, [0, 1, 2, 3, 3, 2, 1, 0, 0]);
}

/// A narrowed spec keeps the structure: on the same layout every rank holds the same keys
/// in as many pieces, each a fixed fraction of the original's elements.
#[test]
fn narrowed_spec_keeps_every_rank_s_pieces() {
    let xl = ModelSpec::preset("moe-xl").unwrap();
    let small = xl.narrowed(1, 8);
    assert_eq!((small.hidden_size, small.moe_ffn(), small.head_dim(), small.vocab_size), (1, 8, 128, 129280));
    let layout = Layout::new(cfg(8, 16, 1, 64, 1), 1024).unwrap();
    let big = ReferenceModel::new(xl, layout, OptimizerMode::Adam).unwrap();
    let little = ReferenceModel::new(small, layout, OptimizerMode::Adam).unwrap();
    for rank in [0, 1, 500, 1023] {
        let (b, l) = (big.rank_state(rank), little.rank_state(rank));
        assert_eq!(b.len(), l.len(), "rank {rank}");
        for (b, l) in b.iter().zip(&l) {
            assert_eq!(b.key, l.key);
            let expert = b.key.contains("experts");
            let factor = if expert { 7168 * 256 } else { 7168 };
            assert_eq!(b.region.numel(), l.region.numel() * factor, "{}", b.key);
        }
    }
    assert!(little.expected_bytes() * 10_000 < big.expected_bytes());
}

/// Sizes whose products overflow are errors, never a panic or a wrap: a vocabulary multiple
/// of 2^62 (its padding overflowed, then divided by zero), layers past any model, parallel
/// sizes whose product passes u64 (a chosen wrap was accepted, with tp past the world).
#[test]
fn sizes_too_large_to_multiply_are_errors() {
    let tiny = ModelSpec::preset("tiny").unwrap();
    let at_tp4 = Layout::new(cfg(4, 1, 1, 1, 1), 4).unwrap();
    for spec in [
        ModelSpec { make_vocab_size_divisible_by: 1 << 62, ..tiny.clone() },
        ModelSpec { hidden_size: 1 << 56, kv_channels: Some(8), ..tiny.clone() },
        ModelSpec { num_layers: 1 << 40, ..tiny.clone() },
    ] {
        let e = ReferenceModel::new(spec, at_tp4, OptimizerMode::None).unwrap_err().to_string();
        assert!(e.contains("far too large") || e.contains("is more than"), "{e}");
    }
    let huge = cfg(1 << 22, 1 << 22, 1 << 22, 1, 1);
    assert!(matches!(Layout::new(huge, 1 << 30), Err(LayoutError::WorldNotDivisible { .. })));
    let wrapping = cfg(u32::MAX, u32::MAX, 1 << 31, 1 << 31, u32::MAX);
    assert!(matches!(Layout::new(wrapping, 1 << 31), Err(LayoutError::WorldNotDivisible { .. })));
}

/// An order that is no permutation of the five dimensions is refused where a layout is made
/// (its parse refused it; built directly it gave two ranks one place).
#[test]
fn an_order_that_repeats_a_dimension_is_refused() {
    use dckpt_layout::Dim;
    let r = Layout::with_order(cfg(2, 1, 1, 1, 1), 4, RankOrder([Dim::Tp; 5]));
    assert!(matches!(r, Err(LayoutError::BadOrder { .. })), "{r:?}");
}
