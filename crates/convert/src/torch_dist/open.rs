//! A DCP or `torch_dist` checkpoint opened: its `.metadata` decoded, Megatron's
//! `metadata.json` read where there is one, and the objects at its root listed.

use std::collections::{BTreeMap, HashMap};

use dckpt::storage::Storage;
use dckpt_torch_format::dcp::{DcpMetadata, StateEntry, StorageInfo, TensorMeta};

use super::{DCP_METADATA, DCP_METADATA_BYTES_MAX, MEGATRON_COMMON, MEGATRON_METADATA};
use crate::{ConvertError, Result, SourceFormat};

/// An opened DCP or `torch_dist` checkpoint: its metadata and what lies beside it.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// [`SourceFormat::Dcp`] or [`SourceFormat::TorchDist`].
    pub format: SourceFormat,
    /// The decoded `.metadata`.
    pub metadata: DcpMetadata,
    /// `metadata.json`, for `torch_dist`.
    pub megatron: Option<serde_json::Value>,
    /// The size of `common.pt`, when there is one.
    pub common_bytes: Option<u64>,
    /// Every object at the root with its size, by name.
    pub files: BTreeMap<String, u64>,
    /// `storage_data`'s place of each item, by key and offsets.
    items: HashMap<(String, Option<Vec<u64>>), usize>,
}

impl Checkpoint {
    /// Reads the metadata at the storage root. Fails with [`ConvertError::NotACheckpoint`] when
    /// there is no `.metadata`.
    pub fn open(storage: &dyn Storage) -> Result<Checkpoint> {
        let files: BTreeMap<String, u64> = storage.list("")?.into_iter().map(|o| (o.path, o.size)).collect();
        let Some(&size) = files.get(DCP_METADATA) else {
            return Err(ConvertError::NotACheckpoint { location: storage.location("") });
        };
        let location = storage.location(DCP_METADATA);
        if size > DCP_METADATA_BYTES_MAX {
            return Err(ConvertError::torch_dist(format!(
                "{location}: {size} bytes, more than the {DCP_METADATA_BYTES_MAX} a DCP metadata file may have"
            )));
        }
        let bytes = storage.get(DCP_METADATA)?;
        let metadata = DcpMetadata::decode(&bytes, &location)?;
        if let Some(first) = metadata.reformulated.first() {
            // Their stored shape is not the tensor's: converted as stored, the tensors would
            // keep a shape no model has, and the original one would be lost.
            return Err(ConvertError::torch_dist(format!(
                "{location}: {} keys ({first} first) hold optimizer state Megatron stored N-D reformulated \
                 (mcore_data names nd_reformulated_orig_global_shape), which is not converted; save it \
                 again with Megatron-Core 0.16 or later, or with the dckpt strategy",
                metadata.reformulated.len()
            )));
        }
        let (format, megatron) = match files.get(MEGATRON_METADATA) {
            Some(&n) if n <= 1 << 20 => {
                let raw = storage.get(MEGATRON_METADATA)?;
                let v = serde_json::from_slice(&raw).map_err(|e| {
                    ConvertError::torch_dist(format!("{}: not JSON: {e}", storage.location(MEGATRON_METADATA)))
                })?;
                (SourceFormat::TorchDist, Some(v))
            }
            Some(_) => {
                return Err(ConvertError::torch_dist(format!(
                    "{}: larger than 1 MiB",
                    storage.location(MEGATRON_METADATA)
                )));
            }
            None => (SourceFormat::Dcp, None),
        };
        let common_bytes = files.get(MEGATRON_COMMON).copied();
        let items = metadata
            .storage_data
            .iter()
            .enumerate()
            .map(|(i, (k, _))| ((k.fqn.clone(), k.offset.clone()), i))
            .collect();
        Ok(Checkpoint { format, metadata, megatron, common_bytes, files, items })
    }

    /// The tensors, in the metadata's order.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorMeta)> + Clone {
        self.metadata.state_dict_metadata.iter().filter_map(|(k, e)| match e {
            StateEntry::Tensor(t) => Some((k.as_str(), t)),
            StateEntry::Bytes => None,
        })
    }

    /// The keys of the opaque (bytes) items, in the metadata's order.
    pub fn objects(&self) -> impl Iterator<Item = &str> {
        self.metadata.state_dict_metadata.iter().filter_map(|(k, e)| match e {
            StateEntry::Bytes => Some(k.as_str()),
            StateEntry::Tensor(_) => None,
        })
    }

    /// The PyTorch or Megatron version the checkpoint records, if any: DCP's metadata
    /// version (releases from 2.4 or so), and Megatron's backend and its version.
    pub fn versions(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(v) = &self.metadata.version {
            out.push(format!("DCP metadata {v}"));
        }
        if let Some(m) = &self.megatron {
            let backend = m.get("sharded_backend").and_then(|v| v.as_str()).unwrap_or("?");
            let version = m.get("sharded_backend_version").map(|v| v.to_string()).unwrap_or_else(|| "?".into());
            out.push(format!("Megatron {backend} backend version {version}"));
        }
        out
    }

    /// Where the item of `key` at `offsets` (`None` for a bytes item) lies.
    pub fn item(&self, key: &str, offsets: Option<&[u64]>) -> Result<&StorageInfo> {
        self.items
            .get(&(key.to_string(), offsets.map(<[u64]>::to_vec)))
            .map(|&i| &self.metadata.storage_data[i].1)
            .ok_or_else(|| match offsets {
                Some(o) => ConvertError::torch_dist(format!("{key}: no item for the chunk at {o:?} in {DCP_METADATA}")),
                None => ConvertError::torch_dist(format!("{key}: no item in {DCP_METADATA}")),
            })
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use dckpt::storage::MemoryStorage;
    use dckpt_torch_format::write::Pickler;

    use super::*;

    /// A checkpoint whose `mcore_data` names an N-D reformulated shape is refused on opening,
    /// naming the key: converted, its optimizer state kept a shape no model has.
    #[test]
    fn reformulated_optimizer_state_is_refused() {
        let mut p = Pickler::new();
        p.global("torch.distributed.checkpoint.metadata", "Metadata").new_object().empty_dict().mark();
        p.str("state_dict_metadata").empty_dict().str("mcore_data").empty_dict().mark();
        p.str("opt.exp_avg").empty_dict().mark().str("nd_reformulated_orig_global_shape").int_tuple(&[4, 6]).setitems();
        p.setitems().setitems().build();
        let s = MemoryStorage::new();
        s.put(DCP_METADATA, Bytes::from(p.finish())).unwrap();
        let Err(e) = Checkpoint::open(&s) else { panic!("opened") };
        let e = e.to_string();
        assert!(e.contains("opt.exp_avg") && e.contains("nd_reformulated_orig_global_shape"), "{e}");
    }
}
