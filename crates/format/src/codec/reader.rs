//! MessagePack's primitives over the body's bytes, each length checked against the bytes
//! left before anything is sized by it.

use super::fail::{ReadResult, Seg, Why, Within, fail};

/// A position in the body.
pub(super) struct Reader<'a> {
    pub(super) b: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    pub(super) fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    #[inline]
    pub(super) fn byte(&mut self) -> ReadResult<u8> {
        let Some(&m) = self.b.get(self.pos) else {
            return fail(self.pos, Why::Ended);
        };
        self.pos += 1;
        Ok(m)
    }

    #[inline]
    pub(super) fn take(&mut self, n: usize) -> ReadResult<&'a [u8]> {
        match self.pos.checked_add(n).and_then(|end| self.b.get(self.pos..end)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => fail(self.pos, Why::PastEnd { n, left: self.left() }),
        }
    }

    /// A big-endian unsigned integer of `n` bytes.
    #[inline]
    pub(super) fn be(&mut self, n: usize) -> ReadResult<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |v, &x| v << 8 | u64::from(x)))
    }

    /// A length or count that must fit this machine's `usize`.
    #[inline]
    pub(super) fn len(&mut self, n: usize) -> ReadResult<usize> {
        let at = self.pos;
        let v = self.be(n)?;
        match usize::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) => fail(at, Why::LengthTooLarge(v)),
        }
    }

    /// An integer that must not be negative, in any of MessagePack's integer encodings.
    #[inline]
    pub(super) fn u64(&mut self) -> ReadResult<u64> {
        let at = self.pos;
        match self.byte()? {
            m @ 0x00..=0x7f => Ok(u64::from(m)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            m => self.signed(at, m),
        }
    }

    /// The rest of [`Reader::u64`]: what dckpt does not write, so out of its way.
    #[cold]
    #[inline(never)]
    pub(super) fn signed(&mut self, at: usize, m: u8) -> ReadResult<u64> {
        let v = match m {
            0xe0..=0xff => i64::from(m as i8),
            0xd0 => i64::from(self.be(1)? as u8 as i8),
            0xd1 => i64::from(self.be(2)? as u16 as i16),
            0xd2 => i64::from(self.be(4)? as u32 as i32),
            0xd3 => self.be(8)? as i64,
            _ => return fail(at, Why::Expected { what: "an unsigned integer", m }),
        };
        u64::try_from(v).or_else(|_| fail(at, Why::Negative(v)))
    }

    #[inline]
    pub(super) fn u32(&mut self) -> ReadResult<u32> {
        let at = self.pos;
        let v = self.u64()?;
        u32::try_from(v).or_else(|_| fail(at, Why::Over32Bits(v)))
    }

    /// A string's bytes, not checked as UTF-8.
    #[inline]
    pub(super) fn str_bytes(&mut self) -> ReadResult<&'a [u8]> {
        self.str_bytes_as("a string")
    }

    /// A string's bytes; anything else is a failure that expected `what`.
    #[inline]
    pub(super) fn str_bytes_as(&mut self, what: &'static str) -> ReadResult<&'a [u8]> {
        let at = self.pos;
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len(1)?,
            0xda => self.len(2)?,
            0xdb => self.len(4)?,
            m => return fail(at, Why::Expected { what, m }),
        };
        self.take(n)
    }

    /// A field name: a string, compared as bytes with the names this version knows.
    #[inline]
    pub(super) fn field_name(&mut self) -> ReadResult<&'a [u8]> {
        self.str_bytes_as("a field name (a string)")
    }

    #[inline]
    pub(super) fn str(&mut self) -> ReadResult<&'a str> {
        let at = self.pos;
        let b = self.str_bytes()?;
        std::str::from_utf8(b).or_else(|e| fail(at, Why::NotUtf8(e)))
    }

    #[inline]
    pub(super) fn string(&mut self) -> ReadResult<String> {
        self.str().map(str::to_owned)
    }

    pub(super) fn bin(&mut self) -> ReadResult<Vec<u8>> {
        let at = self.pos;
        let n = match self.byte()? {
            0xc4 => self.len(1)?,
            0xc5 => self.len(2)?,
            0xc6 => self.len(4)?,
            m => return fail(at, Why::Expected { what: "binary", m }),
        };
        Ok(self.take(n)?.to_vec())
    }

    /// An array's length, at most the items of `min` bytes each that the bytes left hold.
    #[inline]
    pub(super) fn array_len(&mut self, min: usize) -> ReadResult<usize> {
        let at = self.pos;
        let n = match self.byte()? {
            m @ 0x90..=0x9f => usize::from(m & 0x0f),
            0xdc => self.len(2)?,
            0xdd => self.len(4)?,
            m => return fail(at, Why::Expected { what: "an array", m }),
        };
        if n > self.left() / min {
            return fail(at, Why::ArrayTooLong { n, min, left: self.left() });
        }
        Ok(n)
    }

    /// A map's length, at most half the bytes left (a key and a value take one each).
    #[inline]
    pub(super) fn map_len(&mut self) -> ReadResult<usize> {
        let at = self.pos;
        let n = match self.byte()? {
            m @ 0x80..=0x8f => usize::from(m & 0x0f),
            0xde => self.len(2)?,
            0xdf => self.len(4)?,
            m @ (0x90..=0x9f | 0xdc | 0xdd) => {
                return fail(at, Why::Expected { what: "a map with named fields", m });
            }
            m => return fail(at, Why::Expected { what: "a map", m }),
        };
        if n > self.left() / 2 {
            return fail(at, Why::MapTooLong { n, left: self.left() });
        }
        Ok(n)
    }

    /// Steps over one value of any kind, without decoding or allocating.
    pub(super) fn skip(&mut self) -> ReadResult<()> {
        match msgpack_value_len(&self.b[self.pos..]) {
            Some(n) => {
                self.pos += n;
                Ok(())
            }
            None => fail(self.pos, Why::BadValue),
        }
    }

    /// An array of items that take `min` bytes each at least. Its length is held to what the
    /// bytes left can hold before anything is reserved, and then reserved exactly: memory
    /// stays a fixed multiple of the bytes read (the size of a `T` over `min`), with no
    /// spare capacity from growing the list.
    pub(super) fn vec<T>(
        &mut self,
        min: usize,
        mut item: impl FnMut(&mut Self) -> ReadResult<T>,
    ) -> ReadResult<Vec<T>> {
        let n = self.array_len(min)?;
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            v.push(item(self).within(|| Seg::Index(i))?);
        }
        Ok(v)
    }
}

/// The length of the first MessagePack value in `b`, or `None` when `b` ends inside it or
/// holds a byte that is no MessagePack marker. One pass, no recursion, no allocation.
pub(crate) fn msgpack_value_len(b: &[u8]) -> Option<usize> {
    let (mut pos, mut pending) = (0usize, 1u64);
    let be = |at: usize, n: usize| -> Option<u64> {
        b.get(at..at.checked_add(n)?).map(|s| s.iter().fold(0u64, |v, &x| v << 8 | u64::from(x)))
    };
    while pending > 0 {
        pending -= 1;
        let m = *b.get(pos)?;
        // (header bytes after the marker, payload bytes, items that follow)
        let (head, body, items): (usize, u64, u64) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0, 0),
            0x80..=0x8f => (0, 0, 2 * u64::from(m & 0x0f)),
            0x90..=0x9f => (0, 0, u64::from(m & 0x0f)),
            0xa0..=0xbf => (0, u64::from(m & 0x1f), 0),
            0xc4 | 0xd9 => (1, be(pos + 1, 1)?, 0),
            0xc5 | 0xda => (2, be(pos + 1, 2)?, 0),
            0xc6 | 0xdb => (4, be(pos + 1, 4)?, 0),
            0xc7 => (2, be(pos + 1, 1)?, 0),
            0xc8 => (3, be(pos + 1, 2)?, 0),
            0xc9 => (5, be(pos + 1, 4)?, 0),
            0xca | 0xce | 0xd2 => (4, 0, 0),
            0xcb | 0xcf | 0xd3 => (8, 0, 0),
            0xcc | 0xd0 => (1, 0, 0),
            0xcd | 0xd1 => (2, 0, 0),
            0xd4..=0xd8 => (1, 1 << (m - 0xd4), 0),
            0xdc => (2, 0, be(pos + 1, 2)?),
            0xdd => (4, 0, be(pos + 1, 4)?),
            0xde => (2, 0, 2 * be(pos + 1, 2)?),
            0xdf => (4, 0, 2 * be(pos + 1, 4)?),
            0xc1 => return None,
        };
        pos = pos.checked_add(1 + head)?.checked_add(usize::try_from(body).ok()?)?;
        if pos > b.len() {
            return None;
        }
        pending = pending.checked_add(items)?;
    }
    Some(pos)
}
