//! The zip container `torch.save` writes, cut around a tensor's bytes so that they stream
//! ([`TensorArchive`]), or held whole ([`torch_save_archive`], [`empty_dict_archive`]).

use dckpt_shard_spec::DType;

use super::{ARCHIVE_PREFIX, Pickler, STORAGE_ALIGNMENT, tensor_data_pkl};

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
/// Flag bit 3 (sizes and CRC in a data descriptor) and bit 11 (UTF-8 names), as PyTorch.
const FLAGS: u16 = 0x0808;
/// "Needs zip64" marks a 32-bit field as in the zip64 extra field.
const U32_MAX: u64 = 0xffff_ffff;
/// The extra field id PyTorch pads local headers with (its bytes are `Z`s).
const PAD_ID: u16 = 0x4246;
const ZIP64_ID: u16 = 0x0001;
/// Version 4.5: zip64.
const VERSION_ZIP64: u16 = 45;

/// One entry as the central directory records it.
#[derive(Clone, Debug)]
struct Written {
    name: String,
    crc: u32,
    size: u64,
    local_at: u64,
}

/// An archive's bytes, the start of one or the rest of one: entries appended at `base +
/// out.len()` within the archive.
#[derive(Clone, Debug, Default)]
struct Zip {
    base: u64,
    out: Vec<u8>,
    entries: Vec<Written>,
}

impl Zip {
    fn at(&self) -> u64 {
        self.base + self.out.len() as u64
    }

    fn put16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    fn put32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    fn put64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }

    /// A local header for `name` of `size` bytes, CRC and sizes deferred to the data
    /// descriptor, padded so that the data starts on a [`STORAGE_ALIGNMENT`] boundary.
    fn local_header(&mut self, name: &str, size: u64) -> u64 {
        let local_at = self.at();
        let zip64 = size >= U32_MAX;
        self.put32(LOCAL_SIG);
        self.put16(if zip64 { VERSION_ZIP64 } else { 0 });
        self.put16(FLAGS);
        self.put16(0); // stored
        self.put16(0); // time
        self.put16(0x21); // date: 1980-01-01
        self.put32(0);
        self.put32(if zip64 { U32_MAX as u32 } else { 0 });
        self.put32(if zip64 { U32_MAX as u32 } else { 0 });
        let fixed = 30 + name.len() as u64 + if zip64 { 20 } else { 0 };
        // The pad field's own 4 bytes need room too.
        let pad = (STORAGE_ALIGNMENT - (local_at + fixed + 4) % STORAGE_ALIGNMENT) % STORAGE_ALIGNMENT;
        let extra = if zip64 { 20 } else { 0 } + 4 + pad;
        self.put16(name.len() as u16);
        self.put16(extra as u16);
        self.out.extend_from_slice(name.as_bytes());
        if zip64 {
            self.put16(ZIP64_ID);
            self.put16(16);
            self.put64(0);
            self.put64(0);
        }
        self.put16(PAD_ID);
        self.put16(pad as u16);
        self.out.resize(self.out.len() + pad as usize, b'Z');
        local_at
    }

    fn descriptor(&mut self, crc: u32, size: u64) {
        self.put32(DESCRIPTOR_SIG);
        self.put32(crc);
        if size >= U32_MAX {
            self.put64(size);
            self.put64(size);
        } else {
            self.put32(size as u32);
            self.put32(size as u32);
        }
    }

    /// A whole entry.
    fn add(&mut self, name: &str, data: &[u8]) {
        let local_at = self.local_header(name, data.len() as u64);
        self.out.extend_from_slice(data);
        let crc = crc32fast::hash(data);
        self.descriptor(crc, data.len() as u64);
        self.entries.push(Written { name: name.to_string(), crc, size: data.len() as u64, local_at });
    }

    /// The central directory and the end records (zip64 ones always, as PyTorch).
    fn finish(&mut self) {
        let dir_at = self.at();
        for e in std::mem::take(&mut self.entries).iter() {
            let mut extra = Vec::new();
            for v in [e.size, e.size, e.local_at] {
                // Sizes first, then the offset, each only when its field overflows; the
                // two sizes overflow together.
                if v >= U32_MAX {
                    extra.extend_from_slice(&v.to_le_bytes());
                }
            }
            let zip64 = !extra.is_empty();
            self.put32(CENTRAL_SIG);
            self.put16(if zip64 { VERSION_ZIP64 } else { 0 });
            self.put16(if zip64 { VERSION_ZIP64 } else { 0 });
            self.put16(FLAGS);
            self.put16(0);
            self.put16(0);
            self.put16(0x21);
            self.put32(e.crc);
            let clamp = |v: u64| v.min(U32_MAX) as u32;
            self.put32(clamp(e.size));
            self.put32(clamp(e.size));
            self.put16(e.name.len() as u16);
            self.put16(if zip64 { 4 + extra.len() as u16 } else { 0 });
            self.put16(0); // comment
            self.put16(0); // disk
            self.put16(0); // internal attributes
            self.put32(0); // external attributes
            self.put32(clamp(e.local_at));
            self.out.extend_from_slice(e.name.as_bytes());
            if zip64 {
                self.put16(ZIP64_ID);
                self.put16(extra.len() as u16);
                self.out.extend_from_slice(&extra);
            }
            self.entries.push(e.clone());
        }
        let n = self.entries.len() as u64;
        let dir_len = self.at() - dir_at;
        let eocd64_at = self.at();
        self.put32(ZIP64_EOCD_SIG);
        self.put64(44);
        self.put16(VERSION_ZIP64);
        self.put16(VERSION_ZIP64);
        self.put32(0);
        self.put32(0);
        self.put64(n);
        self.put64(n);
        self.put64(dir_len);
        self.put64(dir_at);
        self.put32(ZIP64_LOCATOR_SIG);
        self.put32(0);
        self.put64(eocd64_at);
        self.put32(1);
        self.put32(EOCD_SIG);
        self.put16(0);
        self.put16(0);
        self.put16(n.min(0xffff) as u16);
        self.put16(n.min(0xffff) as u16);
        self.put32(dir_len.min(U32_MAX) as u32);
        self.put32(dir_at.min(U32_MAX) as u32);
        self.put16(0);
    }
}

fn entry_name(name: &str) -> String {
    format!("{ARCHIVE_PREFIX}/{name}")
}

/// The small records `torch.save` writes before the storages.
fn preamble(z: &mut Zip, pkl: &[u8]) {
    z.add(&entry_name("data.pkl"), pkl);
    z.add(&entry_name(".format_version"), b"1");
    z.add(&entry_name(".storage_alignment"), STORAGE_ALIGNMENT.to_string().as_bytes());
    z.add(&entry_name("byteorder"), b"little");
}

/// A `torch.save` archive held whole: `data.pkl` and the storages `data/<key>` given.
pub fn torch_save_archive(pkl: &[u8], storages: &[(&str, &[u8])]) -> Vec<u8> {
    let mut z = Zip::default();
    preamble(&mut z, pkl);
    for (key, data) in storages {
        z.add(&entry_name(&format!("data/{key}")), data);
    }
    z.add(&entry_name("version"), b"3\n");
    z.finish();
    z.out
}

/// `torch.save({})`: what Megatron's `common.pt` is when there is no common state.
pub fn empty_dict_archive() -> Vec<u8> {
    let mut p = Pickler::new();
    p.empty_dict();
    torch_save_archive(&p.finish(), &[])
}

/// The archive `torch.save` writes for one contiguous tensor, around its bytes: write
/// [`head`](Self::head), the [`data_len`](Self::data_len) bytes of the tensor (row-major),
/// then [`tail`](Self::tail) of their CRC-32.
#[derive(Clone, Debug)]
pub struct TensorArchive {
    head: Zip,
    data_len: u64,
    data_at: u64,
    data_local_at: u64,
}

impl TensorArchive {
    /// The archive of a tensor of `dtype` and `shape`.
    pub fn new(dtype: DType, shape: &[u64]) -> TensorArchive {
        let data_len = shape.iter().product::<u64>() * dtype.size();
        let mut head = Zip::default();
        preamble(&mut head, &tensor_data_pkl(dtype, shape));
        let data_local_at = head.local_header(&entry_name("data/0"), data_len);
        let data_at = head.at();
        TensorArchive { head, data_len, data_at, data_local_at }
    }

    /// The bytes before the tensor's.
    pub fn head(&self) -> &[u8] {
        &self.head.out
    }

    /// The tensor's bytes.
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// Where the tensor's bytes start in the archive (a multiple of 64).
    pub fn data_offset(&self) -> u64 {
        self.data_at
    }

    /// The bytes after the tensor's, whose CRC-32 is `crc`.
    pub fn tail(&self, crc: u32) -> Vec<u8> {
        let mut z = Zip { base: self.data_at + self.data_len, out: Vec::new(), entries: self.head.entries.clone() };
        z.descriptor(crc, self.data_len);
        z.entries.push(Written { name: entry_name("data/0"), crc, size: self.data_len, local_at: self.data_local_at });
        z.add(&entry_name("version"), b"3\n");
        z.finish();
        z.out
    }

    /// The whole archive's length.
    pub fn len(&self) -> u64 {
        self.data_at + self.data_len + self.tail(0).len() as u64
    }

    /// Whether the archive is empty (never: it always holds its records).
    pub fn is_empty(&self) -> bool {
        false
    }
}
