//! PyTorch's checkpoint files as values and bytes, read without Python and without
//! executing anything: what DCP (`torch.distributed.checkpoint`) and Megatron's
//! `torch_dist` directories hold, and how dckpt writes them back.
//!
//! It owns:
//! - [`pickle`]: a restricted reader of Python pickles (protocols 2 to 5) that turns the
//!   bytes into a [`Value`](pickle::Value) tree, records calls of the globals an allow-list
//!   names instead of making them, and refuses every other global
//!   ([`DCP_METADATA_GLOBALS`](pickle::DCP_METADATA_GLOBALS) lists those of DCP's
//!   `.metadata`);
//! - [`zip`]: the stored zip archive `torch.save` writes, its central directory, entries
//!   and their data ranges, from the whole archive or from ranged reads of its tail;
//! - [`dcp`]: the typed values those hold: DCP's `.metadata` ([`DcpMetadata`](dcp::DcpMetadata):
//!   keys, chunks, where each item lies, every release's variant), the tensor view an
//!   item's `data.pkl` describes ([`TorchSaveTensor`](dcp::TorchSaveTensor)) and Megatron's
//!   ShardedObject keys ([`ShardedObjectKey`](dcp::ShardedObjectKey), [`megatron_key`](dcp::megatron_key));
//! - [`write`](mod@write): the way back: a small pickle writer, DCP's `.metadata` as PyTorch pickles it
//!   ([`encode_dcp_metadata`](write::encode_dcp_metadata), read back by the restricted
//!   reader), and `torch.save` archives cut around a tensor's bytes
//!   ([`TensorArchive`](write::TensorArchive)) so that a writer streams them.
//!
//! It deliberately does no IO (bytes in, values or `Vec<u8>` out), spawns nothing and has
//! no async: reading the files, through ranged reads of any storage, is `dckpt-convert`'s.
//! A reader, a converter or the fuzz target needs this crate and the pure ones below it
//! (shard-spec's dtypes, format's error) alone. Every byte is
//! untrusted: lengths are checked against the bytes present before anything is sized by
//! them, arithmetic is checked, the pickle machine's memory is bounded by its input, and a
//! failure is a [`dckpt_format::FormatError`] naming the file, the field and its
//! [`FormatErrorKind`](dckpt_format::FormatErrorKind) (`Damaged`: a CRC-32 that does not
//! match; `Malformed`: bytes that are no valid pickle or zip, or a pickle that names a
//! global off its allow-list, at a byte offset; `Invalid`: decoded but not what PyTorch
//! writes, such as a view past its storage or overlapping entries), never a panic. [`PickleError`](pickle::PickleError)
//! is the unpickler's own, with the offending opcode's offset.
//!
//! ```
//! use dckpt_format::FormatErrorKind;
//! use dckpt_shard_spec::DType;
//! use dckpt_torch_format::dcp::TorchSaveTensor;
//! use dckpt_torch_format::pickle::unpickle;
//! use dckpt_torch_format::write::TensorArchive;
//! use dckpt_torch_format::zip;
//!
//! // torch.save of a 2x3 bf16 tensor, its bytes streamed between head and tail.
//! let a = TensorArchive::new(DType::Bf16, &[2, 3]);
//! let data = [7u8; 12];
//! let mut bytes = a.head().to_vec();
//! bytes.extend_from_slice(&data);
//! bytes.extend_from_slice(&a.tail(crc32fast::hash(&data)));
//! assert_eq!(bytes.len() as u64, a.len());
//!
//! // Read back: the entries, the view data.pkl describes, and the storage's bytes.
//! let entries = zip::entries(&bytes, "t.pt").unwrap();
//! let pkl = entries.iter().find(|e| e.record.name.ends_with("/data.pkl")).unwrap();
//! let t = TorchSaveTensor::decode(pkl.stored_data(&bytes, "t.pt").unwrap(), "t.pt").unwrap();
//! assert_eq!((t.dtype, t.size.as_slice(), t.stride.as_slice()), (DType::Bf16, &[2, 3][..], &[3, 1][..]));
//! let storage = entries.iter().find(|e| e.record.name.ends_with("/data/0")).unwrap();
//! assert_eq!(storage.stored_data(&bytes, "t.pt").unwrap(), data);
//!
//! // A flipped byte is damage, named by its entry.
//! let mut flipped = bytes.clone();
//! flipped[a.data_offset() as usize] ^= 1;
//! let e = storage.verify_crc(storage.stored_data(&flipped, "t.pt").unwrap(), "t.pt").unwrap_err();
//! assert!(matches!(e.kind(), FormatErrorKind::Damaged { .. }), "{e}");
//!
//! // A pickle that names code is refused, never run.
//! let evil = b"\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.";
//! let e = unpickle(evil, &[]).unwrap_err();
//! assert_eq!(e.to_string(), "global `posix.system` is not on the allow-list (at byte 2)");
//! ```
#![warn(missing_docs)]

pub mod dcp;
pub mod pickle;
pub mod write;
pub mod zip;
