//! PyTorch's files, read without Python and without executing anything.
//!
//! [`pickle`] is a restricted reader of Python pickles (protocols 2 to 5): it turns the
//! bytes into a [`Value`](pickle::Value) tree, records calls of the globals an allow-list
//! names instead of making them, and refuses every other global. DCP's `.metadata` file is
//! such a pickle ([`DCP_METADATA_GLOBALS`](pickle::DCP_METADATA_GLOBALS) lists its globals).
//! [`zip`] reads the container `torch.save` writes: a zip archive of stored entries.
//! [`dcp`] types what those hold: DCP's metadata (keys, chunks, where each item lies) and
//! the tensor view an item's `data.pkl` describes.

pub mod dcp;
pub mod pickle;
pub mod write;
pub mod zip;
