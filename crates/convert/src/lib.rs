//! Checkpoints dckpt did not write, and checkpoints for tools that are not dckpt: PyTorch
//! DCP and Megatron `torch_dist` directories read without Python and without executing a
//! pickle, Hugging Face safetensors models, and the conversions between them and dckpt.
//!
//! The parsing is pure and lives below: dckpt's own files in `dckpt-format`, PyTorch's
//! (pickles, `torch.save` zips, DCP metadata and their writers) in `dckpt-torch-format`;
//! this crate adds the reads and writes through [`dckpt::storage::Storage`] and the engine
//! for what writes or loads dckpt checkpoints.
//!
//! [`detect`] is the one format detection: which of the formats of [`SourceFormat`] a
//! location holds. [`torch_dist`] reads DCP and Megatron `torch_dist` directories: the
//! metadata, where each chunk's elements lie, the elements in row-major order, validation;
//! and converts them to dckpt checkpoints and back ([`torch_dist::torch_dist_to_dckpt`],
//! [`torch_dist::dckpt_to_torch_dist`]). Every failure is a [`ConvertError`].

#![warn(missing_docs)]

mod cast;
mod detect;
mod error;
pub mod export;
mod glob;
pub mod hf;
mod size;
mod source;
pub mod torch_dist;

pub use cast::{
    bf16_to_f32, cast_into, f16_to_f32, f32_to_bf16, f32_to_f16, is_cast_target, is_castable, output_dtype,
};
pub use detect::{Conversion, ConvertTarget, SourceFormat, conversion, detect, split_file_location};
pub use error::{ConvertError, Result};
pub use export::{ExportOptions, ExportReport, ExportedFile, export};
pub use glob::{KeyFilter, glob_match};
pub use hf::{ConvertReport, HfModel, hf_to_dckpt};
pub use size::parse_size;
pub use source::{DckptSource, RangeRead, SourceTensor, TensorSource, range_region};
