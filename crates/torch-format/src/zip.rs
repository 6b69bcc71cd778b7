//! The container `torch.save` writes: a zip archive of stored (uncompressed) entries,
//! `<archive>/data.pkl`, `<archive>/data/<key>` (a storage's raw bytes),
//! `<archive>/version`, `<archive>/byteorder`, ...
//!
//! Only the central directory is trusted for sizes: a local header written with a data
//! descriptor (flag bit 3) carries zero sizes, and PyTorch pads local headers with an extra
//! field so that data is aligned, so an entry's data starts at its local header's offset +
//! 30 + the *local* name and extra lengths.
//!
//! Two ways in:
//! - the whole file as a slice: [`entries`];
//! - ranged reads (S3): [`find_central_directory`] on the file's last bytes says where the
//!   directory is (or which earlier bytes it needs), [`parse_central_directory`] reads the
//!   directory's records, [`Entry::locate`] completes each with the first 30 bytes of its
//!   local header, and [`check_entries`] checks that no two entries overlap.
//!
//! Decoding trusts no byte: every length is checked against the bytes present and the file
//! length, the entry count is bounded by the directory's bytes (46 per record at least),
//! multi-disk archives and encrypted entries are refused, and every failure is a
//! [`FormatError`] naming the record and, where it has one, the byte offset in the file.

use std::ops::Range;

use dckpt_format::FormatError;

/// The end-of-central-directory record's fixed bytes (a comment may follow).
pub const EOCD_BYTES: u64 = 22;
/// The longest zip comment, so the farthest the end record can start from the file's end
/// is `EOCD_BYTES + ZIP_COMMENT_BYTES_MAX`.
pub const ZIP_COMMENT_BYTES_MAX: u64 = 0xFFFF;
/// A central directory record's fixed bytes (name, extra field and comment follow).
pub const CENTRAL_RECORD_BYTES: u64 = 46;
/// A local header's fixed bytes (name and extra field follow).
pub const LOCAL_HEADER_BYTES: u64 = 30;

const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;
const ZIP64_LOCATOR_BYTES: u64 = 20;
const ZIP64_EOCD_BYTES: u64 = 56;
const ZIP64_EXTRA_ID: u16 = 0x0001;
const FLAG_ENCRYPTED: u16 = 1;

/// Where an archive's central directory lies, from its end records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CentralDirectory {
    /// The directory's bytes in the file.
    pub range: Range<u64>,
    /// How many records it declares (at most `range`'s length / 46).
    pub entries: u64,
    /// Whether the sizes came from a zip64 end record.
    pub zip64: bool,
}

/// What [`find_central_directory`] found in the tail it was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TailLookup {
    /// The end records were all in the tail: the directory is here.
    Found(CentralDirectory),
    /// The tail is too short: call again with the file's bytes from `from` to its end.
    NeedFrom(u64),
}

/// One central directory record, before its local header is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectoryEntry {
    /// The entry's name (UTF-8), e.g. `archive/data/0`.
    pub name: String,
    /// Its compression method: 0 is stored, the only one a storage may use.
    pub method: u16,
    /// Its general purpose flags (bit 0: encrypted, bit 3: sizes in a data descriptor).
    pub flags: u16,
    /// The CRC-32 of its uncompressed bytes.
    pub crc32: u32,
    /// Its bytes as stored.
    pub compressed_size: u64,
    /// Its bytes once decompressed (equal to `compressed_size` when stored).
    pub uncompressed_size: u64,
    /// Where its local header starts.
    pub local_header_offset: u64,
}

/// One entry of an archive, located: its record and where its data starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its central directory record.
    pub record: DirectoryEntry,
    /// Where its data starts: local header offset + 30 + the local name and extra lengths.
    pub data_offset: u64,
}

/// Where the central directory of a file of `file_len` bytes lies, given `tail`, the file's
/// last `tail.len()` bytes. A tail of `EOCD_BYTES + ZIP_COMMENT_BYTES_MAX + 76` bytes (or
/// the whole file) always suffices unless the zip64 end record is far from the end; when
/// the tail is too short the answer says from where to read instead.
///
/// The directory must end exactly where the end records start (nothing prepended to the
/// archive, as `torch.save` never does), and a zip64 locator, when present just before the
/// end record, is followed to the zip64 end record whose sizes then hold.
pub fn find_central_directory(tail: &[u8], file_len: u64, file: &str) -> Result<TailLookup, FormatError> {
    let tail_len = tail.len() as u64;
    if tail_len > file_len {
        return Err(FormatError::invalid(file, "tail", format!("{tail_len} bytes of tail for a file of {file_len}")));
    }
    let base = file_len - tail_len;
    let Some(eocd) = find_eocd(tail) else {
        let reach = (EOCD_BYTES + ZIP_COMMENT_BYTES_MAX).min(file_len);
        if tail_len < reach {
            return Ok(TailLookup::NeedFrom(file_len - reach));
        }
        return Err(FormatError::malformed(
            file,
            "end_of_central_directory",
            "no end of central directory record",
            file_len,
        ));
    };
    let eocd_at = base + eocd as u64;
    let rec = &tail[eocd..];
    let (disk, cd_disk) = (le16(rec, 4), le16(rec, 6));
    let (on_disk, total) = (le16(rec, 8), le16(rec, 10));
    if disk != Some(0) || cd_disk != Some(0) || on_disk != total {
        return Err(FormatError::malformed(file, "end_of_central_directory", "a multi-disk archive", eocd_at));
    }
    let (total, size, offset) = (u64::from(total.unwrap_or(0)), le32(rec, 12), le32(rec, 16));
    let (size, offset) = (u64::from(size.unwrap_or(0)), u64::from(offset.unwrap_or(0)));
    // A zip64 locator, when present, sits just before the end record.
    if eocd_at >= ZIP64_LOCATOR_BYTES {
        let loc_at = eocd_at - ZIP64_LOCATOR_BYTES;
        if loc_at < base {
            return Ok(TailLookup::NeedFrom(loc_at));
        }
        let loc = &tail[(loc_at - base) as usize..];
        if le32(loc, 0) == Some(ZIP64_LOCATOR_SIG) {
            return zip64_directory(tail, base, loc_at, file)
                .map(|d| d.map_or_else(TailLookup::NeedFrom, TailLookup::Found));
        }
    }
    if size == 0xFFFF_FFFF || offset == 0xFFFF_FFFF {
        // A writer that needed zip64 and wrote no locator: say so rather than guess.
        return Err(FormatError::malformed(
            file,
            "end_of_central_directory",
            "zip64 sizes without a zip64 locator",
            eocd_at,
        ));
    }
    directory(offset, size, total, eocd_at, false, "end_of_central_directory", eocd_at, file).map(TailLookup::Found)
}

/// The records of the central directory `dir` (from [`find_central_directory`]), given
/// `bytes`, exactly the file's bytes in `dir.range`. Each record's local header offset is checked to leave room for a local header before the
/// directory; names are UTF-8 and unique.
pub fn parse_central_directory(
    bytes: &[u8],
    dir: &CentralDirectory,
    file: &str,
) -> Result<Vec<DirectoryEntry>, FormatError> {
    let want = dir.range.end.saturating_sub(dir.range.start);
    if bytes.len() as u64 != want || dir.range.end < dir.range.start {
        return Err(FormatError::invalid(file, "central_directory", format!("{} bytes given for {want}", bytes.len())));
    }
    // Bounded by the directory's bytes (find_central_directory checked it), so this
    // reservation is a fixed multiple of the input.
    let mut out = Vec::with_capacity(usize::try_from(dir.entries.min(want / CENTRAL_RECORD_BYTES)).unwrap_or(0));
    let mut at = 0usize;
    for i in 0..dir.entries {
        let field = || format!("central_directory[{i}]");
        let pos = dir.range.start + at as u64;
        let (record, len) = central_record(&bytes[at..], pos, dir.range.start, file, &field)?;
        at += len;
        out.push(record);
    }
    if at != bytes.len() {
        let pos = dir.range.start + at as u64;
        return Err(FormatError::malformed(
            file,
            "central_directory",
            format!("{} bytes after the last record", bytes.len() - at),
            pos,
        ));
    }
    let mut names: Vec<(&str, usize)> = out.iter().enumerate().map(|(i, e)| (e.name.as_str(), i)).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(FormatError::invalid(
            file,
            format!("central_directory[{}]", w[1].1),
            format!("entry `{}` appears twice", w[1].0),
        ));
    }
    check_byteorder(&out, file)?;
    Ok(out)
}

/// That the archive's storages are little-endian, as every reader here copies them: a
/// `<archive>/byteorder` record (`torch.save` writes `sys.byteorder` there) must hold
/// `little`; an archive without one is taken as little-endian, as PyTorch takes it. Decided
/// from the directory record's size and CRC-32, without reading the entry: a ranged reader
/// needs no request more.
fn check_byteorder(records: &[DirectoryEntry], file: &str) -> Result<(), FormatError> {
    let is_byteorder = |name: &str| name.split_once('/').is_some_and(|(_, rest)| rest == "byteorder");
    for (i, r) in records.iter().enumerate().filter(|(_, r)| is_byteorder(&r.name)) {
        let holds = |v: &[u8]| r.uncompressed_size == v.len() as u64 && r.crc32 == crc32fast::hash(v);
        if holds(b"little") {
            continue;
        }
        let found = if holds(b"big") { "big-endian storages" } else { "neither `little` nor `big`" };
        return Err(FormatError::invalid(
            file,
            format!("central_directory[{i}] ({})", r.name),
            format!("{found}: only little-endian archives are read (their bytes are copied as they are)"),
        ));
    }
    Ok(())
}

/// Every entry of `archive`, a whole `torch.save` file (or any zip archive), located and
/// checked: the end records, every directory record, every local header (its signature,
/// method and name agree with the directory), data inside the file before the directory,
/// and no two entries overlapping. Entries are in directory order.
pub fn entries(archive: &[u8], file: &str) -> Result<Vec<Entry>, FormatError> {
    let file_len = archive.len() as u64;
    let dir = match find_central_directory(archive, file_len, file)? {
        TailLookup::Found(dir) => dir,
        // Not reached: the whole file is the tail.
        TailLookup::NeedFrom(from) => {
            return Err(FormatError::invalid(file, "tail", format!("bytes from {from} needed")));
        }
    };
    let cd = &archive[dir.range.start as usize..dir.range.end as usize];
    let records = parse_central_directory(cd, &dir, file)?;
    let mut out = Vec::with_capacity(records.len());
    for (i, record) in records.into_iter().enumerate() {
        let local = &archive[record.local_header_offset as usize..];
        out.push(Entry::locate(record, local, dir.range.start, i, file)?);
    }
    check_entries(&out, dir.range.start, file)?;
    Ok(out)
}

/// That no two of `entries` overlap (from local header to data end) and that all end at or
/// before `directory_start`. [`entries`] calls it; a ranged reader calls it once it has
/// located every entry.
pub fn check_entries(entries: &[Entry], directory_start: u64, file: &str) -> Result<(), FormatError> {
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let end = e.data_range().end;
        if end > directory_start {
            let what =
                format!("entry `{}` ends at {end}, past the central directory at {directory_start}", e.record.name);
            return Err(FormatError::invalid(file, format!("central_directory[{i}]"), what));
        }
        spans.push((e.record.local_header_offset, end, i));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            let (a, b) = (&entries[w[0].2].record.name, &entries[w[1].2].record.name);
            let what = format!("entry `{b}` at {} overlaps entry `{a}` ending at {}", w[1].0, w[0].1);
            return Err(FormatError::invalid(file, format!("central_directory[{}]", w[1].2), what));
        }
    }
    Ok(())
}

impl Entry {
    /// `record` located with `local`, the file's bytes from its local header offset (at
    /// least its 30 fixed bytes; when the name follows too, it is compared), in an archive
    /// whose directory starts at `directory_start`; `index` is its place in the directory,
    /// for errors.
    pub fn locate(
        record: DirectoryEntry,
        local: &[u8],
        directory_start: u64,
        index: usize,
        file: &str,
    ) -> Result<Entry, FormatError> {
        let field = format!("central_directory[{index}] ({}).local_header", record.name);
        let at = record.local_header_offset;
        if le32(local, 0) != Some(LOCAL_SIG) {
            return Err(FormatError::malformed(file, field, "no local header signature", at));
        }
        let (method, name_len, extra_len) = (le16(local, 8), le16(local, 26), le16(local, 28));
        let (Some(method), Some(name_len), Some(extra_len)) = (method, name_len, extra_len) else {
            return Err(FormatError::malformed(file, field, "local header cut short", at));
        };
        if method != record.method {
            let what = format!("method {method}, the directory says {}", record.method);
            return Err(FormatError::malformed(file, field, what, at));
        }
        if usize::from(name_len) != record.name.len() {
            let what = format!("name of {name_len} bytes, the directory's has {}", record.name.len());
            return Err(FormatError::malformed(file, field, what, at));
        }
        let name_at = LOCAL_HEADER_BYTES as usize;
        if let Some(name) = local.get(name_at..name_at + usize::from(name_len))
            && name != record.name.as_bytes()
        {
            return Err(FormatError::malformed(
                file,
                field,
                "a name other than the directory's",
                at + LOCAL_HEADER_BYTES,
            ));
        }
        let header_len = LOCAL_HEADER_BYTES + u64::from(name_len) + u64::from(extra_len);
        let Some(data_offset) = at.checked_add(header_len) else {
            return Err(FormatError::invalid(
                file,
                field,
                format!("local header at {at} of {header_len} bytes overflows"),
            ));
        };
        let end = data_offset.checked_add(record.compressed_size);
        if end.is_none_or(|end| end > directory_start) {
            let what =
                format!("data of {} bytes at {data_offset} runs past the central directory", record.compressed_size);
            return Err(FormatError::invalid(file, field, what));
        }
        Ok(Entry { record, data_offset })
    }

    /// The entry's bytes as stored in the file (for a stored entry, its data). Within the
    /// file for an entry from [`entries`] or [`Entry::locate`]; saturated at `u64::MAX` for
    /// one built by hand.
    pub fn data_range(&self) -> Range<u64> {
        self.data_offset..self.data_offset.saturating_add(self.record.compressed_size)
    }

    /// The entry's data in `archive` (the whole file), refused unless it is stored
    /// uncompressed and unencrypted, as every storage of `torch.save` is.
    pub fn stored_data<'a>(&self, archive: &'a [u8], file: &str) -> Result<&'a [u8], FormatError> {
        self.check_stored(file)?;
        let r = self.data_range();
        let (start, end) = (usize::try_from(r.start), usize::try_from(r.end));
        match (start, end) {
            (Ok(s), Ok(e)) if e <= archive.len() => Ok(&archive[s..e]),
            _ => Err(FormatError::invalid(
                file,
                self.field(),
                format!("data {r:?} past the end of {} bytes", archive.len()),
            )),
        }
    }

    /// That the entry is stored (method 0), unencrypted and of equal stored and
    /// uncompressed sizes: the only entries whose bytes can be read in place.
    pub fn check_stored(&self, file: &str) -> Result<(), FormatError> {
        let r = &self.record;
        if r.method != 0 {
            let what = format!("entry `{}` is compressed (method {}); a storage must be stored", r.name, r.method);
            return Err(FormatError::invalid(file, self.field(), what));
        }
        if r.flags & FLAG_ENCRYPTED != 0 {
            return Err(FormatError::invalid(file, self.field(), format!("entry `{}` is encrypted", r.name)));
        }
        if r.compressed_size != r.uncompressed_size {
            let what = format!(
                "stored entry `{}` of {} bytes says {} uncompressed",
                r.name, r.compressed_size, r.uncompressed_size
            );
            return Err(FormatError::invalid(file, self.field(), what));
        }
        Ok(())
    }

    /// That `data`, the entry's uncompressed bytes, match the directory's CRC-32.
    pub fn verify_crc(&self, data: &[u8], file: &str) -> Result<(), FormatError> {
        let found = crc32fast::hash(data);
        if found != self.record.crc32 {
            let what = format!(
                "entry `{}`: CRC-32 {found:08x}, the directory says {:08x}",
                self.record.name, self.record.crc32
            );
            return Err(FormatError::damaged(file, self.field(), what));
        }
        Ok(())
    }

    fn field(&self) -> String {
        format!("entry `{}`", self.record.name)
    }
}

/// The end record's offset in `tail`: the last signature whose comment length ends the
/// tail exactly (a signature inside a comment does not).
fn find_eocd(tail: &[u8]) -> Option<usize> {
    let last = tail.len().checked_sub(EOCD_BYTES as usize)?;
    let first = last.saturating_sub(ZIP_COMMENT_BYTES_MAX as usize);
    (first..=last)
        .rev()
        .find(|&i| le32(tail, i) == Some(EOCD_SIG) && le16(tail, i + 20).map(usize::from) == Some(last - i))
}

/// The directory from the zip64 end record the locator at `loc_at` points to, or the
/// offset to read from when that record is before the tail.
fn zip64_directory(
    tail: &[u8],
    base: u64,
    loc_at: u64,
    file: &str,
) -> Result<Result<CentralDirectory, u64>, FormatError> {
    let loc = &tail[(loc_at - base) as usize..];
    let (disk, rec_at, disks) = (le32(loc, 4), le64(loc, 8), le32(loc, 16));
    let (Some(0), Some(rec_at), Some(1)) = (disk, rec_at, disks) else {
        return Err(FormatError::malformed(file, "zip64_locator", "a multi-disk archive", loc_at));
    };
    if rec_at.checked_add(ZIP64_EOCD_BYTES).is_none_or(|end| end > loc_at) {
        let what = format!("zip64 end record at {rec_at} does not fit before the locator");
        return Err(FormatError::malformed(file, "zip64_locator", what, loc_at));
    }
    if rec_at < base {
        return Ok(Err(rec_at));
    }
    let rec = &tail[(rec_at - base) as usize..];
    let field = "zip64_end_of_central_directory";
    if le32(rec, 0) != Some(ZIP64_EOCD_SIG) {
        return Err(FormatError::malformed(file, field, "no zip64 end record signature", rec_at));
    }
    let vals = (le64(rec, 4), le32(rec, 16), le32(rec, 20), le64(rec, 24), le64(rec, 32), le64(rec, 40), le64(rec, 48));
    let (Some(len), Some(0), Some(0), Some(on_disk), Some(total), Some(size), Some(offset)) = vals else {
        return Err(FormatError::malformed(file, field, "a multi-disk archive", rec_at));
    };
    let end = len.checked_add(12).filter(|&l| l >= ZIP64_EOCD_BYTES).and_then(|l| rec_at.checked_add(l));
    if on_disk != total || end.is_none_or(|end| end > loc_at) {
        return Err(FormatError::malformed(
            file,
            field,
            format!("record of {len} bytes or {on_disk} != {total} entries"),
            rec_at,
        ));
    }
    directory(offset, size, total, rec_at, true, field, rec_at, file).map(Ok)
}

/// The directory at `offset` of `size` bytes and `total` records, checked to end at or
/// before `end` (its end records) and to have room for its records.
#[allow(clippy::too_many_arguments)]
fn directory(
    offset: u64,
    size: u64,
    total: u64,
    end: u64,
    zip64: bool,
    field: &str,
    at: u64,
    file: &str,
) -> Result<CentralDirectory, FormatError> {
    if offset.checked_add(size).is_none_or(|e| e != end) {
        let what = format!("central directory of {size} bytes at {offset} does not end at its end record at {end}");
        return Err(FormatError::malformed(file, field, what, at));
    }
    if total > size / CENTRAL_RECORD_BYTES {
        let what = format!("{total} entries cannot fit in a central directory of {size} bytes");
        return Err(FormatError::malformed(file, field, what, at));
    }
    Ok(CentralDirectory { range: offset..end, entries: total, zip64 })
}

/// One record at the start of `b` (found at `pos` in the file), with its length; its local
/// header must leave its 30 bytes before `directory_start`.
fn central_record(
    b: &[u8],
    pos: u64,
    directory_start: u64,
    file: &str,
    field: &dyn Fn() -> String,
) -> Result<(DirectoryEntry, usize), FormatError> {
    if le32(b, 0) != Some(CENTRAL_SIG) {
        return Err(FormatError::malformed(file, field(), "no central directory record signature", pos));
    }
    let fixed = (le16(b, 8), le16(b, 10), le32(b, 16), le32(b, 20), le32(b, 24));
    let lens = (le16(b, 28), le16(b, 30), le16(b, 32), le16(b, 34), le32(b, 42));
    let (
        (Some(flags), Some(method), Some(crc32), Some(csize), Some(usize_)),
        (Some(n), Some(m), Some(k), Some(disk), Some(off)),
    ) = (fixed, lens)
    else {
        return Err(FormatError::malformed(file, field(), "record cut short", pos));
    };
    let (n, m, k) = (usize::from(n), usize::from(m), usize::from(k));
    let fixed_len = CENTRAL_RECORD_BYTES as usize;
    let len = fixed_len + n + m + k;
    let (Some(name), Some(extra)) = (b.get(fixed_len..fixed_len + n), b.get(fixed_len + n..fixed_len + n + m)) else {
        return Err(FormatError::malformed(file, field(), "name or extra field past the directory's end", pos));
    };
    if b.len() < len {
        return Err(FormatError::malformed(file, field(), "comment past the directory's end", pos));
    }
    let Ok(name) = std::str::from_utf8(name) else {
        return Err(FormatError::malformed(file, field(), "name is not UTF-8", pos + CENTRAL_RECORD_BYTES));
    };
    let field = || format!("{} ({name})", field());
    let extra_at = pos + (fixed_len + n) as u64;
    let mut usize_ = u64::from(usize_);
    let mut csize = u64::from(csize);
    let mut off = u64::from(off);
    let mut disk = u32::from(disk);
    zip64_extra(extra, extra_at, &mut [&mut usize_, &mut csize, &mut off], &mut disk, file, &field)?;
    if disk != 0 {
        return Err(FormatError::malformed(file, field(), "entry on another disk", pos));
    }
    if off.checked_add(LOCAL_HEADER_BYTES).is_none_or(|e| e > directory_start) {
        let what =
            format!("local header offset {off} leaves no room for a header before the directory at {directory_start}");
        return Err(FormatError::invalid(file, field(), what));
    }
    let record = DirectoryEntry {
        name: name.to_string(),
        method,
        flags,
        crc32,
        compressed_size: csize,
        uncompressed_size: usize_,
        local_header_offset: off,
    };
    Ok((record, len))
}

/// Replaces each of `vals` (uncompressed size, compressed size, local header offset) that
/// is 0xFFFFFFFF, and then `disk` if 0xFFFF, by the next value of the zip64 extra field, in
/// that order; an extra field that lacks a value needed is refused.
fn zip64_extra(
    extra: &[u8],
    extra_at: u64,
    vals: &mut [&mut u64; 3],
    disk: &mut u32,
    file: &str,
    field: &dyn Fn() -> String,
) -> Result<(), FormatError> {
    if vals.iter().all(|v| **v != 0xFFFF_FFFF) && *disk != 0xFFFF {
        return Ok(());
    }
    let mut at = 0usize;
    let data = loop {
        let (Some(id), Some(len)) = (le16(extra, at), le16(extra, at + 2)) else {
            return Err(FormatError::malformed(file, field(), "zip64 sizes without a zip64 extra field", extra_at));
        };
        let body = extra.get(at + 4..at + 4 + usize::from(len));
        let Some(body) = body else {
            return Err(FormatError::malformed(file, field(), "extra field past its end", extra_at + at as u64));
        };
        if id == ZIP64_EXTRA_ID {
            break body;
        }
        at += 4 + usize::from(len);
    };
    let data_at = extra_at + at as u64 + 4;
    let mut pos = 0usize;
    for v in vals.iter_mut().filter(|v| ***v == 0xFFFF_FFFF) {
        let Some(x) = le64(data, pos) else {
            return Err(FormatError::malformed(file, field(), "zip64 extra field too short", data_at));
        };
        **v = x;
        pos += 8;
    }
    if *disk == 0xFFFF {
        let Some(x) = le32(data, pos) else {
            return Err(FormatError::malformed(file, field(), "zip64 extra field too short", data_at));
        };
        *disk = x;
    }
    Ok(())
}

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn le64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dckpt_format::FormatErrorKind;

    /// `zipfile.ZipFile(b, "w", zipfile.ZIP_STORED)` of Python 3's stdlib, with entries
    /// `archive/data.pkl` = `b"\x80\x02}q\x00."`, `archive/data/0` = `bytes(range(8))`,
    /// `archive/version` = `b"3\n"`, each `writestr(ZipInfo(name, (1980, 1, 1, 0, 0, 0)),
    /// data)`.
    const PY_STORED: &str = "504b030414000000000000002100f29102c5060000000600000010000000617263686976652f646174612e706b6c80027d71002e504b0304140000000000000021009f68aa8808000000080000000e000000617263686976652f646174612f300001020304050607504b030414000000000000002100d19e675502000000020000000f000000617263686976652f76657273696f6e330a504b0102140314000000000000002100f29102c50600000006000000100000000000000000000000800100000000617263686976652f646174612e706b6c504b01021403140000000000000021009f68aa8808000000080000000e0000000000000000000000800134000000617263686976652f646174612f30504b0102140314000000000000002100d19e675502000000020000000f0000000000000000000000800168000000617263686976652f76657273696f6e504b05060000000003000300b7000000970000000000";

    /// The same `zipfile` writing to a stream that cannot seek: one entry `a/data/0` =
    /// `b"abcd"` through `ZipFile.open(ZipInfo(...), "w")`, so its local header has flag bit
    /// 3 and zero CRC and sizes, and a data descriptor follows the data.
    const PY_DESCRIPTOR: &str = "504b03041400080000000000210000000000000000000000000008000000612f646174612f3061626364504b070811cd82ed0400000004000000504b010214031400080000000000210011cd82ed0400000004000000080000000000000000000000800100000000612f646174612f30504b05060000000001000100360000003a0000000000";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// One entry for [`build`].
    struct Item {
        name: String,
        data: Vec<u8>,
        method: u16,
        /// Zero CRC and sizes in the local header, a data descriptor after the data.
        descriptor: bool,
        /// Extra field bytes of the local header only (PyTorch pads data this way).
        local_extra: Vec<u8>,
    }

    fn item(name: &str, data: &[u8]) -> Item {
        Item { name: name.into(), data: data.to_vec(), method: 0, descriptor: false, local_extra: vec![] }
    }

    /// A zip archive of `items` (their data as given, whatever the method), with zip64
    /// central records and end records when `zip64`, and `comment` after the end record.
    fn build(items: &[Item], zip64: bool, comment: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut offsets = vec![];
        for it in items {
            offsets.push(out.len() as u64);
            let crc = crc32fast::hash(&it.data);
            let (lcrc, lsize) = if it.descriptor { (0, 0) } else { (crc, it.data.len() as u32) };
            out.extend_from_slice(&LOCAL_SIG.to_le_bytes());
            out.extend_from_slice(&20u16.to_le_bytes());
            out.extend_from_slice(&(if it.descriptor { 8u16 } else { 0 }).to_le_bytes());
            out.extend_from_slice(&it.method.to_le_bytes());
            out.extend_from_slice(&[0; 4]);
            for v in [lcrc, lsize, lsize] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&(it.name.len() as u16).to_le_bytes());
            out.extend_from_slice(&(it.local_extra.len() as u16).to_le_bytes());
            out.extend_from_slice(it.name.as_bytes());
            out.extend_from_slice(&it.local_extra);
            out.extend_from_slice(&it.data);
            if it.descriptor {
                for v in [0x0807_4b50, crc, it.data.len() as u32, it.data.len() as u32] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        let cd_start = out.len() as u64;
        for (it, &off) in items.iter().zip(&offsets) {
            let len = it.data.len() as u64;
            out.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            out.extend_from_slice(&[45, 3, 45, 0]);
            out.extend_from_slice(&(if it.descriptor { 8u16 } else { 0 }).to_le_bytes());
            out.extend_from_slice(&it.method.to_le_bytes());
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&crc32fast::hash(&it.data).to_le_bytes());
            let (size, off32) = if zip64 { (0xFFFF_FFFF, 0xFFFF_FFFF) } else { (len as u32, off as u32) };
            out.extend_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&(it.name.len() as u16).to_le_bytes());
            out.extend_from_slice(&(if zip64 { 28u16 } else { 0 }).to_le_bytes());
            out.extend_from_slice(&[0; 6]);
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&off32.to_le_bytes());
            out.extend_from_slice(it.name.as_bytes());
            if zip64 {
                out.extend_from_slice(&ZIP64_EXTRA_ID.to_le_bytes());
                out.extend_from_slice(&24u16.to_le_bytes());
                for v in [len, len, off] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        let cd_size = out.len() as u64 - cd_start;
        let n = items.len() as u64;
        if zip64 {
            let rec_at = out.len() as u64;
            out.extend_from_slice(&ZIP64_EOCD_SIG.to_le_bytes());
            out.extend_from_slice(&44u64.to_le_bytes());
            out.extend_from_slice(&[45, 3, 45, 0]);
            out.extend_from_slice(&[0; 8]);
            for v in [n, n, cd_size, cd_start] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&ZIP64_LOCATOR_SIG.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&rec_at.to_le_bytes());
            out.extend_from_slice(&1u32.to_le_bytes());
        }
        out.extend_from_slice(&EOCD_SIG.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        let (n16, size32, off32) =
            if zip64 { (0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF) } else { (n as u16, cd_size as u32, cd_start as u32) };
        out.extend_from_slice(&n16.to_le_bytes());
        out.extend_from_slice(&n16.to_le_bytes());
        out.extend_from_slice(&size32.to_le_bytes());
        out.extend_from_slice(&off32.to_le_bytes());
        out.extend_from_slice(&(comment.len() as u16).to_le_bytes());
        out.extend_from_slice(comment);
        out
    }

    /// What `torch.save` writes, in small: entries whose local headers carry a padding
    /// extra field so the data is 64-aligned.
    fn torch_like(zip64: bool) -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
        let contents: Vec<(String, Vec<u8>)> = vec![
            ("archive/data.pkl".into(), b"\x80\x02}q\x00.".to_vec()),
            ("archive/byteorder".into(), b"little".to_vec()),
            ("archive/data/0".into(), (0..200u8).collect()),
            ("archive/data/1".into(), vec![]),
            ("archive/version".into(), b"3\n".to_vec()),
        ];
        let mut items = vec![];
        let mut at = 0usize;
        for (name, data) in &contents {
            let mut it = item(name, data);
            let pad = (64 - (at + 30 + name.len() + 4) % 64) % 64;
            it.local_extra = [&0x4246u16.to_le_bytes()[..], &(pad as u16).to_le_bytes(), &vec![b'Z'; pad]].concat();
            at += 30 + name.len() + it.local_extra.len() + data.len();
            items.push(it);
        }
        (build(&items, zip64, b""), contents)
    }

    fn check(archive: &[u8], expect: &[(&str, &[u8])]) -> Vec<Entry> {
        let es = entries(archive, "t.pt").unwrap();
        let got: Vec<(&str, &[u8])> =
            es.iter().map(|e| (e.record.name.as_str(), e.stored_data(archive, "t.pt").unwrap())).collect();
        assert_eq!(got, expect);
        for e in &es {
            e.verify_crc(e.stored_data(archive, "t.pt").unwrap(), "t.pt").unwrap();
        }
        es
    }

    #[test]
    fn python_zipfile_stored_archive_reads() {
        let a = unhex(PY_STORED);
        let es = check(
            &a,
            &[
                ("archive/data.pkl", b"\x80\x02}q\x00."),
                ("archive/data/0", &[0, 1, 2, 3, 4, 5, 6, 7]),
                ("archive/version", b"3\n"),
            ],
        );
        assert_eq!(es[1].data_range(), 52 + 30 + 14..52 + 30 + 14 + 8);
        assert_eq!(es[1].record.crc32, 0x88aa_689f);
    }

    /// An archive `torch.save` wrote on a big-endian machine holds big-endian storages:
    /// copied as they are, every element would be silently wrong. It is refused, by entries
    /// and by the ranged reader's directory alike; one without the record reads.
    #[test]
    fn only_little_endian_archives_are_read() {
        let with = |order: Option<&[u8]>| {
            let mut items = vec![item("archive/data.pkl", b"\x80\x02}q\x00."), item("archive/data/0", &[1, 2, 3, 4])];
            items.extend(order.map(|o| item("archive/byteorder", o)));
            build(&items, false, b"")
        };
        let ranged = |a: &[u8]| {
            let TailLookup::Found(dir) = find_central_directory(a, a.len() as u64, "t.pt")? else {
                panic!("whole tail")
            };
            parse_central_directory(&a[dir.range.start as usize..dir.range.end as usize], &dir, "t.pt")
        };
        for order in [None, Some(&b"little"[..])] {
            let a = with(order);
            assert_eq!(entries(&a, "t.pt").unwrap().len(), 2 + usize::from(order.is_some()));
            ranged(&a).unwrap();
        }
        for (order, says) in [(&b"big"[..], "big-endian"), (b"middle", "neither")] {
            let a = with(Some(order));
            for e in [entries(&a, "t.pt").map(drop).unwrap_err(), ranged(&a).map(drop).unwrap_err()] {
                assert_eq!(e.field(), "central_directory[2] (archive/byteorder)", "{e}");
                assert!(e.to_string().contains(says), "{e}");
            }
        }
    }

    #[test]
    fn python_data_descriptor_with_zero_local_sizes_reads() {
        let a = unhex(PY_DESCRIPTOR);
        assert_eq!(&a[14..26], &[0; 12], "the local header's CRC and sizes are zero");
        let es = check(&a, &[("a/data/0", b"abcd")]);
        assert_eq!(es[0].record.flags & 8, 8);
    }

    #[test]
    fn local_extra_padding_moves_the_data_and_zip64_reads_the_same() {
        for zip64 in [false, true] {
            let (a, contents) = torch_like(zip64);
            let expect: Vec<(&str, &[u8])> = contents.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
            let es = check(&a, &expect);
            assert!(es.iter().all(|e| e.data_offset % 64 == 0), "{es:?}");
            let TailLookup::Found(dir) = find_central_directory(&a, a.len() as u64, "t.pt").unwrap() else { panic!() };
            assert_eq!(dir.zip64, zip64);
            assert_eq!(dir.entries, 5);
        }
    }

    #[test]
    fn data_descriptors_built_here_read() {
        let mut items = vec![item("x/data/0", b"0123456789"), item("x/data/1", b"ab")];
        items[0].descriptor = true;
        for zip64 in [false, true] {
            check(&build(&items, zip64, b"a comment"), &[("x/data/0", b"0123456789"), ("x/data/1", b"ab")]);
        }
    }

    #[test]
    fn empty_archive_has_no_entries() {
        assert_eq!(entries(&build(&[], false, b""), "t.pt").unwrap(), vec![]);
        assert_eq!(entries(&build(&[], true, b""), "t.pt").unwrap(), vec![]);
    }

    /// Follows `NeedFrom` from a short tail, then reads the directory and 30 bytes of each
    /// local header, as a reader with ranged reads does.
    fn ranged(a: &[u8], first_tail: usize) -> (Vec<Entry>, usize) {
        let len = a.len() as u64;
        let mut from = a.len() - first_tail.min(a.len());
        let mut lookups = 0;
        let dir = loop {
            lookups += 1;
            assert!(lookups <= 4, "no progress");
            match find_central_directory(&a[from..], len, "t.pt").unwrap() {
                TailLookup::Found(dir) => break dir,
                TailLookup::NeedFrom(f) => {
                    assert!((f as usize) < from, "asks for no new bytes");
                    from = f as usize;
                }
            }
        };
        let cd = &a[dir.range.start as usize..dir.range.end as usize];
        let records = parse_central_directory(cd, &dir, "t.pt").unwrap();
        let es: Vec<Entry> = records
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let at = r.local_header_offset as usize;
                Entry::locate(r, &a[at..at + 30], dir.range.start, i, "t.pt").unwrap()
            })
            .collect();
        check_entries(&es, dir.range.start, "t.pt").unwrap();
        (es, lookups)
    }

    #[test]
    fn ranged_reads_from_a_tail_find_the_same_entries() {
        let (a, _) = torch_like(true);
        let whole = entries(&a, "t.pt").unwrap();
        // 22 bytes: the end record only; then the locator; then the zip64 record.
        assert_eq!(ranged(&a, 22), (whole.clone(), 3));
        assert_eq!(ranged(&a, 98), (whole.clone(), 1));
        for tail in 0..a.len() {
            assert_eq!(ranged(&a, tail).0, whole);
        }
        let long_comment = build(&[item("a/data/0", b"abcd")], false, &[b'c'; 1000]);
        assert_eq!(ranged(&long_comment, 100).1, 2);
    }

    #[test]
    fn end_record_signature_inside_the_comment_is_not_taken() {
        let mut comment = EOCD_SIG.to_le_bytes().to_vec();
        comment.extend_from_slice(&[0; 18]);
        // Its comment length (0) does not reach the end, so it is not the end record.
        comment.extend_from_slice(b"tail");
        let a = build(&[item("a/data/0", b"abcd")], false, &comment);
        check(&a, &[("a/data/0", b"abcd")]);
    }

    #[test]
    fn compressed_entry_is_listed_and_its_data_refused_naming_it() {
        let mut items = vec![item("archive/data.pkl", b"pkl"), item("archive/data/7", b"deflated?")];
        items[1].method = 8;
        let a = build(&items, false, b"");
        let es = entries(&a, "t.pt").unwrap();
        assert_eq!(es[1].record.method, 8);
        let e = es[1].stored_data(&a, "t.pt").unwrap_err();
        assert!(matches!(e.kind(), FormatErrorKind::Invalid { .. }), "{e}");
        assert!(e.to_string().contains("archive/data/7") && e.to_string().contains("method 8"), "{e}");
        assert!(es[0].check_stored("t.pt").is_ok());
    }

    #[test]
    fn crc_mismatch_is_damage() {
        let mut a = build(&[item("a/data/0", b"abcd")], false, b"");
        a[30 + 8] ^= 1;
        let es = entries(&a, "t.pt").unwrap();
        let e = es[0].verify_crc(es[0].stored_data(&a, "t.pt").unwrap(), "t.pt").unwrap_err();
        assert!(matches!(e.kind(), FormatErrorKind::Damaged { .. }), "{e}");
        assert!(e.to_string().contains("a/data/0"), "{e}");
    }

    #[test]
    fn every_prefix_is_refused_and_no_flipped_byte_panics() {
        for (a, zip64) in [(unhex(PY_STORED), false), (unhex(PY_DESCRIPTOR), false), (torch_like(true).0, true)] {
            for n in 0..a.len() {
                assert!(entries(&a[..n], "t.pt").is_err(), "prefix of {n} bytes (zip64 {zip64})");
                let _ = find_central_directory(&a[n..], a.len() as u64, "t.pt");
                let _ = find_central_directory(&a[n..], n as u64, "t.pt");
            }
            for i in 0..a.len() {
                for x in [0x01, 0x80, 0xFF] {
                    let mut b = a.clone();
                    b[i] ^= x;
                    if let Ok(es) = entries(&b, "t.pt") {
                        for e in &es {
                            let _ = e.stored_data(&b, "t.pt").map(|d| e.verify_crc(d, "t.pt"));
                        }
                    }
                }
            }
        }
    }

    fn refused(a: &[u8], needle: &str) {
        let e = entries(a, "t.pt").unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
        assert!(e.to_string().starts_with("t.pt: "), "{e}");
    }

    /// Offset of the `k`-th central record (each has a name of `name_len` bytes, no extra).
    fn central_at(a: &[u8], k: usize) -> usize {
        let TailLookup::Found(dir) = find_central_directory(a, a.len() as u64, "t").unwrap() else { panic!() };
        let mut at = dir.range.start as usize;
        for _ in 0..k {
            at += 46 + [28, 30, 32].iter().map(|&o| usize::from(le16(a, at + o).unwrap())).sum::<usize>();
        }
        at
    }

    #[test]
    fn two_records_sharing_data_are_refused_as_overlapping() {
        let base = build(&[item("a/data/0", b"abcd"), item("a/data/1", b"efgh")], false, b"");
        // The second record pointed at the first's local header (same name length): the
        // whole file shows the names differ; a ranged reader, with 30 bytes of each local
        // header, finds the overlap.
        let mut a = base.clone();
        let c = central_at(&a, 1);
        a[c + 42..c + 46].copy_from_slice(&0u32.to_le_bytes());
        refused(&a, "a name other than the directory's");
        let TailLookup::Found(dir) = find_central_directory(&a, a.len() as u64, "t.pt").unwrap() else { panic!() };
        let cd = &a[dir.range.start as usize..dir.range.end as usize];
        let es: Vec<Entry> = parse_central_directory(cd, &dir, "t.pt")
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, r)| Entry::locate(r, &a[..30], dir.range.start, i, "t.pt").unwrap())
            .collect();
        let e = check_entries(&es, dir.range.start, "t.pt").unwrap_err();
        assert!(matches!(e.kind(), FormatErrorKind::Invalid { .. }), "{e}");
        assert!(e.to_string().contains("overlaps entry `a/data/"), "{e}");
        // The first entry's size grown over the second's header.
        let mut a = base;
        let c0 = central_at(&a, 0);
        a[c0 + 20..c0 + 28].copy_from_slice(&[20, 0, 0, 0, 20, 0, 0, 0]);
        refused(&a, "entry `a/data/1` at 42 overlaps entry `a/data/0` ending at 58");
    }

    #[test]
    fn a_directory_built_by_hand_is_checked_not_trusted() {
        let a = build(&[item("a/data/0", b"abcd")], false, b"");
        let TailLookup::Found(dir) = find_central_directory(&a, a.len() as u64, "t.pt").unwrap() else { panic!() };
        let cd = &a[dir.range.start as usize..dir.range.end as usize];
        let backwards = CentralDirectory { range: dir.range.end..dir.range.start, ..dir.clone() };
        assert!(parse_central_directory(cd, &backwards, "t.pt").is_err());
        let many = CentralDirectory { entries: u64::MAX, ..dir.clone() };
        assert!(parse_central_directory(cd, &many, "t.pt").is_err());
        let mut r = parse_central_directory(cd, &dir, "t.pt").unwrap().remove(0);
        r.local_header_offset = u64::MAX - 10;
        assert!(Entry::locate(r, &a, u64::MAX, 0, "t.pt").is_err());
        assert!(find_central_directory(&a, 3, "t.pt").is_err(), "a tail longer than the file");
    }

    #[test]
    fn offsets_and_sizes_past_the_file_are_refused() {
        let base = build(&[item("a/data/0", b"abcd")], false, b"");
        let c = central_at(&base, 0);
        let mut a = base.clone();
        a[c + 42..c + 46].copy_from_slice(&0x7FFF_0000u32.to_le_bytes());
        refused(&a, "leaves no room for a header");
        let mut a = base.clone();
        a[c + 20..c + 28].copy_from_slice(&[0xFE, 0xFF, 0xFF, 0x7F, 0xFE, 0xFF, 0xFF, 0x7F]);
        refused(&a, "runs past the central directory");
        // The end record's directory offset moved: it no longer ends at the end record.
        let mut a = base.clone();
        let e = a.len() - 22;
        a[e + 16] ^= 1;
        refused(&a, "does not end at its end record");
        // More entries declared than records fit.
        let mut a = base.clone();
        a[e + 8..e + 12].copy_from_slice(&[9, 0, 9, 0]);
        refused(&a, "9 entries cannot fit");
    }

    #[test]
    fn zip64_sizes_that_overflow_are_refused() {
        let base = build(&[item("a/data/0", b"abcd")], true, b"");
        let c = central_at(&base, 0);
        let extra = c + 46 + 8 + 4;
        // Compressed size u64::MAX: data end overflows.
        let mut a = base.clone();
        a[extra + 8..extra + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        refused(&a, "runs past the central directory");
        // Local header offset u64::MAX.
        let mut a = base.clone();
        a[extra + 16..extra + 24].copy_from_slice(&u64::MAX.to_le_bytes());
        refused(&a, "leaves no room for a header");
        // The zip64 record's entry count huge.
        let mut a = base.clone();
        let rec = a.len() - 22 - 20 - 56;
        a[rec + 24..rec + 40].copy_from_slice(&[0xFF; 16]);
        refused(&a, "entries cannot fit");
        // Its directory offset huge.
        let mut a = base;
        a[rec + 48..rec + 56].copy_from_slice(&u64::MAX.to_le_bytes());
        refused(&a, "does not end at its end record");
    }

    #[test]
    fn duplicate_names_and_bad_utf8_are_refused() {
        refused(&build(&[item("a/data/0", b"x"), item("a/data/0", b"y")], false, b""), "appears twice");
        let a = build(&[item("a/data/\u{e9}", b"x")], false, b"");
        let mut b = a.clone();
        let c = central_at(&a, 0);
        b[c + 46 + 7] = 0xFF;
        refused(&b, "not UTF-8");
    }

    #[test]
    fn not_a_zip_is_refused_at_its_end() {
        let e = entries(b"definitely not a zip file at all", "t.pt").unwrap_err();
        assert!(matches!(e.kind(), FormatErrorKind::Malformed { offset: 32, .. }), "{e}");
    }
}
