//! What a location holds: the format of a checkpoint or model, told from its files.

use dckpt::storage::{Storage, StorageExt};
use serde::Serialize;

use crate::export::{INDEX_NAME, SINGLE_NAME};
use crate::torch_dist::{DCP_METADATA, MEGATRON_METADATA};
use crate::{ConvertError, Result};

/// A checkpoint or model format this crate recognises: what [`detect`] finds, and what
/// every command that reads a location (inspect, validate, export, convert) goes by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceFormat {
    /// A committed dckpt checkpoint (its metadata file).
    Dckpt,
    /// A PyTorch DCP directory (`.metadata`).
    Dcp,
    /// A Megatron `dist_checkpointing` directory (`.metadata` and `metadata.json`).
    TorchDist,
    /// A Hugging Face safetensors model (an index, `model.safetensors`, or the file named).
    Safetensors,
}

impl SourceFormat {
    /// Its name as the CLI prints it: `dckpt`, `dcp`, `torch_dist` or `safetensors`.
    pub fn name(self) -> &'static str {
        match self {
            SourceFormat::Dckpt => "dckpt",
            SourceFormat::Dcp => "dcp",
            SourceFormat::TorchDist => "torch_dist",
            SourceFormat::Safetensors => "safetensors",
        }
    }

    /// The name of the reader that takes it, as `dckpt export` reports its source and
    /// `dckpt convert` what it cannot convert: DCP and Megatron directories alike are
    /// `torch_dist`, read by [`crate::torch_dist`].
    pub fn reader(self) -> &'static str {
        match self {
            SourceFormat::Dcp => SourceFormat::TorchDist.name(),
            other => other.name(),
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
        (SourceFormat::Dcp | SourceFormat::TorchDist, ConvertTarget::Dckpt) => Ok(Conversion::TorchDistToDckpt),
        (SourceFormat::Dckpt, ConvertTarget::TorchDist) => Ok(Conversion::DckptToTorchDist),
        (SourceFormat::Dckpt, ConvertTarget::Dckpt) => Err(ConvertError::Options {
            detail: "the source is already a dckpt checkpoint (dckpt export writes Hugging Face safetensors)".into(),
        }),
        (SourceFormat::Safetensors | SourceFormat::Dcp | SourceFormat::TorchDist, ConvertTarget::TorchDist) => {
            Err(ConvertError::NotSupported { detail: format!("converting {} to torch_dist", from.reader()) })
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

/// The format of what `storage` holds (`file`: a safetensors file named in the location),
/// told from the files at its root: dckpt's metadata file first, then DCP's `.metadata`
/// (with Megatron's `metadata.json`: `torch_dist`), then a safetensors index or model.
/// Fails with [`ConvertError::UnknownFormat`] when none is there.
pub fn detect(storage: &dyn Storage, file: Option<&str>) -> Result<SourceFormat> {
    if file.is_some() {
        return Ok(SourceFormat::Safetensors);
    }
    if storage.exists(dckpt_format::META_NAME)? {
        return Ok(SourceFormat::Dckpt);
    }
    if storage.exists(DCP_METADATA)? {
        let megatron = storage.exists(MEGATRON_METADATA)?;
        return Ok(if megatron { SourceFormat::TorchDist } else { SourceFormat::Dcp });
    }
    if storage.exists(INDEX_NAME)? || storage.exists(SINGLE_NAME)? {
        return Ok(SourceFormat::Safetensors);
    }
    Err(ConvertError::UnknownFormat {
        location: storage.location(""),
        detail: format!(
            "no dckpt checkpoint ({}), torch_dist/DCP checkpoint ({DCP_METADATA}) or Hugging Face model \
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

    #[test]
    fn each_format_is_told_from_its_files() {
        let m = dckpt::storage::MemoryStorage::new();
        let e = detect(&m, None).unwrap_err();
        assert!(matches!(e, ConvertError::UnknownFormat { .. }), "{e}");
        assert_eq!(detect(&m, Some("x.safetensors")).unwrap(), SourceFormat::Safetensors);
        m.put(SINGLE_NAME, bytes::Bytes::new()).unwrap();
        assert_eq!(detect(&m, None).unwrap(), SourceFormat::Safetensors);
        m.put(DCP_METADATA, bytes::Bytes::new()).unwrap();
        assert_eq!(detect(&m, None).unwrap(), SourceFormat::Dcp);
        m.put(MEGATRON_METADATA, bytes::Bytes::new()).unwrap();
        assert_eq!(detect(&m, None).unwrap(), SourceFormat::TorchDist);
        m.put(dckpt_format::META_NAME, bytes::Bytes::new()).unwrap();
        assert_eq!(detect(&m, None).unwrap(), SourceFormat::Dckpt);
    }

    #[test]
    fn dcp_and_torch_dist_convert_alike() {
        for f in [SourceFormat::Dcp, SourceFormat::TorchDist] {
            assert_eq!(conversion(f, ConvertTarget::Dckpt).unwrap(), Conversion::TorchDistToDckpt);
            let e = conversion(f, ConvertTarget::TorchDist).unwrap_err();
            assert_eq!(e.to_string(), "converting torch_dist to torch_dist: not supported yet");
        }
        assert_eq!((SourceFormat::Dcp.name(), SourceFormat::Dcp.reader()), ("dcp", "torch_dist"));
    }
}
