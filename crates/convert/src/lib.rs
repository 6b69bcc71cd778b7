//! Checkpoints dckpt did not write, and checkpoints for tools that are not dckpt: PyTorch
//! DCP and Megatron `torch_dist` directories read without Python and without executing a
//! pickle, Hugging Face safetensors models, and the conversions between them and dckpt.
//!
//! The parsing is `dckpt-format`'s (pure); this crate adds the reads through
//! [`dckpt_storage::Storage`] and the engine for what writes or loads dckpt checkpoints.
//!
//! [`torch_dist`] reads DCP and Megatron `torch_dist` directories: format detection, the
//! metadata, where each chunk's elements lie, the elements in row-major order, validation.

#![warn(missing_docs)]

pub mod torch_dist;
