//! The one error type of the converters and exports.

use dckpt_format::FormatError;

/// What can go wrong reading, converting or exporting a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The engine failed (a dckpt checkpoint read or written through it).
    #[error(transparent)]
    Engine(#[from] dckpt::Error),
    /// A storage operation failed.
    #[error(transparent)]
    Storage(#[from] dckpt::storage::Error),
    /// A malformed file parsed by `dckpt-format` or `dckpt-torch-format`.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A safetensors file (or its index) that cannot be used as it is.
    #[error("{file}: {}{detail}", tensor.as_ref().map(|t| format!("tensor {t:?}: ")).unwrap_or_default())]
    Safetensors {
        /// The file's location.
        file: String,
        /// The tensor, where one is at fault.
        tensor: Option<String>,
        /// What is wrong.
        detail: String,
    },
    /// A DCP / `torch_dist` checkpoint that cannot be read or converted as it is: its
    /// metadata does not describe what is asked of it, an item lies outside its file, a
    /// chunk's `data.pkl` disagrees with the metadata, ...
    #[error("{detail}")]
    TorchDist {
        /// What is wrong, naming the key, file and offset.
        detail: String,
    },
    /// A DCP / `torch_dist` checkpoint was opened where there is none: neither dckpt's
    /// metadata file nor DCP's `.metadata` is there.
    #[error("not a checkpoint: no {} or {} at {location}", dckpt_format::META_NAME, crate::torch_dist::DCP_METADATA)]
    NotACheckpoint {
        /// Where it looked.
        location: String,
    },
    /// Options that cannot be used.
    #[error("invalid options: {detail}")]
    Options {
        /// What is wrong.
        detail: String,
    },
    /// The output is already there; nothing was written.
    #[error("{location} already exists; remove it or choose another output")]
    Exists {
        /// What is there.
        location: String,
    },
    /// A conversion that is recognised but not implemented yet.
    #[error("{detail}: not supported yet")]
    NotSupported {
        /// Which conversion.
        detail: String,
    },
    /// The checkpoint being read was replaced by another save part way: what was read
    /// after the change belongs to another save than what was read before it.
    #[error(
        "{location}: the checkpoint was replaced while it was read (save {opened} when opened, {now} now); \
         nothing read is usable: run again"
    )]
    Replaced {
        /// The checkpoint.
        location: String,
        /// The save it held when opened.
        opened: String,
        /// The save a later read found.
        now: String,
    },
    /// The last write of an output, the one that marks it whole, failed in a way that does
    /// not say whether it landed (a lost reply): the files it names were kept.
    #[error(
        "{location}: whether the last write of the conversion landed is not known ({detail}); the files it names \
         were kept: see whether it is there before using the output or removing it"
    )]
    CommitUncertain {
        /// The file whose write is in doubt.
        location: String,
        /// The write's error, and what reading it back found.
        detail: String,
    },
    /// Nothing this crate knows how to read.
    #[error("{location}: {detail}")]
    UnknownFormat {
        /// Where.
        location: String,
        /// What was looked for.
        detail: String,
    },
}

impl ConvertError {
    pub(crate) fn torch_dist(detail: impl Into<String>) -> ConvertError {
        ConvertError::TorchDist { detail: detail.into() }
    }

    pub(crate) fn safetensors(file: &str, tensor: Option<&str>, detail: impl Into<String>) -> ConvertError {
        ConvertError::Safetensors { file: file.to_string(), tensor: tensor.map(str::to_string), detail: detail.into() }
    }
}

/// This crate's result.
pub type Result<T, E = ConvertError> = std::result::Result<T, E>;
