//! Which tensors `dckpt export --dtype` casts, and to what. The casts themselves are
//! [`dckpt_shard_spec::cast`]'s, which loads use too.

use dckpt_shard_spec::DType;
pub use dckpt_shard_spec::cast::{bf16_to_f32, cast_into, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Whether `--dtype` casts tensors of this dtype (the others are exported unchanged).
pub fn is_castable(d: DType) -> bool {
    matches!(d, DType::F16 | DType::Bf16 | DType::F32 | DType::F64)
}

/// Whether `d` may be asked for with `--dtype`.
pub fn is_cast_target(d: DType) -> bool {
    matches!(d, DType::F16 | DType::Bf16 | DType::F32)
}

/// The dtype a tensor of `d` is exported as when `target` is asked for.
pub fn output_dtype(d: DType, target: Option<DType>) -> DType {
    match target {
        Some(t) if is_castable(d) => t,
        _ => d,
    }
}
