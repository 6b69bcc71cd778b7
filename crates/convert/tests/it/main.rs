//! Conversions between dckpt, Hugging Face safetensors and PyTorch's checkpoints.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests.

mod common;
mod export;
mod hf;
mod torch_convert;
mod torch_fixtures;
mod torch_hostile;
mod torch_ranged_reads;
