//! What a location holds: the format of a checkpoint or model, told from its files.

use dckpt_storage::{Storage, StorageExt};
use serde::Serialize;

use crate::export::{INDEX_NAME, SINGLE_NAME};
use crate::{ConvertError, Result};

/// A checkpoint or model format this crate recognises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceFormat {
    /// A committed dckpt checkpoint (its metadata file).
    Dckpt,
    /// A PyTorch DCP or Megatron `torch_dist` directory (`.metadata`).
    TorchDist,
    /// A Hugging Face safetensors model (an index, `model.safetensors`, or the file named).
    Safetensors,
}

impl SourceFormat {
    /// Its name as the CLI prints it.
    pub fn name(self) -> &'static str {
        match self {
            SourceFormat::Dckpt => "dckpt",
            SourceFormat::TorchDist => "torch_dist",
            SourceFormat::Safetensors => "safetensors",
        }
    }
}

/// What `dckpt convert` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConvertTarget {
    /// A dckpt checkpoint.
    Dckpt,
    /// A PyTorch DCP / Megatron `torch_dist` directory.
    TorchDist,
}

/// A conversion `dckpt convert` can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    /// A Hugging Face safetensors model into a dckpt checkpoint ([`crate::hf_to_dckpt`]).
    SafetensorsToDckpt,
    /// A DCP / `torch_dist` checkpoint into a dckpt checkpoint
    /// ([`crate::torch_dist::torch_dist_to_dckpt`]).
    TorchDistToDckpt,
    /// A dckpt checkpoint into a `torch_dist` directory
    /// ([`crate::torch_dist::dckpt_to_torch_dist`]).
    DckptToTorchDist,
}

/// The conversion from `from` to `to`, or why there is none.
pub fn conversion(from: SourceFormat, to: ConvertTarget) -> Result<Conversion> {
    match (from, to) {
        (SourceFormat::Safetensors, ConvertTarget::Dckpt) => Ok(Conversion::SafetensorsToDckpt),
        (SourceFormat::TorchDist, ConvertTarget::Dckpt) => Ok(Conversion::TorchDistToDckpt),
        (SourceFormat::Dckpt, ConvertTarget::TorchDist) => Ok(Conversion::DckptToTorchDist),
        (SourceFormat::Dckpt, ConvertTarget::Dckpt) => Err(ConvertError::Options {
            detail: "the source is already a dckpt checkpoint (dckpt export writes Hugging Face safetensors)".into(),
        }),
        (SourceFormat::Safetensors | SourceFormat::TorchDist, ConvertTarget::TorchDist) => {
            Err(ConvertError::NotSupported { detail: format!("converting {} to torch_dist", from.name()) })
        }
    }
}

/// A location split into the store to open and, when it names a `.safetensors` file, that
/// file: `dir/model.safetensors` is `("dir", Some("model.safetensors"))`.
pub fn split_file_location(location: &str) -> (String, Option<String>) {
    let trimmed = location.trim_end_matches('/');
    if trimmed.ends_with(".safetensors") {
        if let Some(at) = trimmed.rfind('/') {
            return (trimmed[..at].to_string(), Some(trimmed[at + 1..].to_string()));
        }
        return (".".to_string(), Some(trimmed.to_string()));
    }
    (location.to_string(), None)
}

/// The format of what `storage` holds (`file`: a safetensors file named in the location).
pub fn detect(storage: &dyn Storage, file: Option<&str>) -> Result<SourceFormat> {
    if file.is_some() {
        return Ok(SourceFormat::Safetensors);
    }
    if storage.exists(dckpt_format::META_NAME)? {
        return Ok(SourceFormat::Dckpt);
    }
    if storage.exists(".metadata")? {
        return Ok(SourceFormat::TorchDist);
    }
    if storage.exists(INDEX_NAME)? || storage.exists(SINGLE_NAME)? {
        return Ok(SourceFormat::Safetensors);
    }
    Err(ConvertError::UnknownFormat {
        location: storage.location(""),
        detail: format!(
            "no dckpt checkpoint ({}), torch_dist/DCP checkpoint (.metadata) or Hugging Face model \
             ({INDEX_NAME} or {SINGLE_NAME}) here",
            dckpt_format::META_NAME
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_naming_a_file_are_split() {
        assert_eq!(split_file_location("/m/model.safetensors"), ("/m".into(), Some("model.safetensors".into())));
        assert_eq!(split_file_location("s3://b/p/x.safetensors"), ("s3://b/p".into(), Some("x.safetensors".into())));
        assert_eq!(split_file_location("w.safetensors"), (".".into(), Some("w.safetensors".into())));
        assert_eq!(split_file_location("/m/dir"), ("/m/dir".into(), None));
    }
}
