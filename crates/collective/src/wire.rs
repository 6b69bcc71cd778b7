//! Byte layouts shared by the backends: frames on a TCP stream, the encoding of a set of
//! per-rank messages, u64 vectors and abort notices. Decoders never trust a length before
//! checking it against a bound.

use std::io::{self, Read, Write};

use bytes::Bytes;

pub(crate) const MAGIC: [u8; 4] = *b"DCKC";
pub(crate) const VERSION: u16 = 1;
pub(crate) const HEADER_BYTES: usize = 28;

/// Frame kinds. Data frames carry the kind of the call they belong to, in both directions.
pub(crate) mod kind {
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const REJECT: u8 = 3;
    pub const BARRIER: u8 = 10;
    pub const BROADCAST: u8 = 11;
    pub const GATHER: u8 = 12;
    pub const ALL_GATHER: u8 = 13;
    pub const ALL_REDUCE: u8 = 14;
    pub const SCATTER: u8 = 15;
    pub const EXCHANGE: u8 = 16;
    /// An exchange's route round (same sequence number as its exchange).
    pub const ROUTE: u8 = 17;
    pub const ABORT: u8 = 20;

    pub fn name(kind: u8) -> &'static str {
        match kind {
            HELLO => "hello",
            WELCOME => "welcome",
            REJECT => "reject",
            BARRIER => "barrier",
            BROADCAST => "broadcast",
            GATHER => "gather",
            ALL_GATHER => "all_gather",
            ALL_REDUCE => "all_reduce",
            SCATTER => "scatter",
            EXCHANGE => "exchange",
            ROUTE => "exchange route",
            ABORT => "abort",
            _ => "unknown",
        }
    }
}

/// One message between two ranks.
#[derive(Debug, Clone)]
pub(crate) struct Frame {
    pub kind: u8,
    pub seq: u64,
    pub payload: Bytes,
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The stream ended cleanly between frames.
    Closed,
    Io(io::Error),
    /// Bad magic, version or checksum.
    Corrupt(String),
    TooLarge {
        len: u64,
    },
}

fn header(kind: u8, seq: u64, len: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6] = kind;
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

fn crc(head: &[u8], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(head);
    hasher.update(payload);
    hasher.finalize()
}

/// The header of a frame: magic, version, kind, seq, length, then crc32 over those and the
/// payload. Computed once when one frame goes to many peers.
pub(crate) fn frame_header(kind: u8, seq: u64, payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = header(kind, seq, payload.len() as u64);
    let sum = crc(&h[..24], payload);
    h[24..28].copy_from_slice(&sum.to_le_bytes());
    h
}

/// Writes one frame (see [`frame_header`]).
pub(crate) fn write_frame(w: &mut impl Write, kind: u8, seq: u64, payload: &[u8]) -> io::Result<()> {
    write_with_header(w, &frame_header(kind, seq, payload), payload)
}

/// Small frames go out in one write (one segment with TCP_NODELAY), large ones in two.
pub(crate) fn write_with_header(w: &mut impl Write, h: &[u8; HEADER_BYTES], payload: &[u8]) -> io::Result<()> {
    const COALESCE_BYTES_MAX: usize = 64 << 10;
    if payload.len() <= COALESCE_BYTES_MAX {
        let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len());
        buf.extend_from_slice(h);
        buf.extend_from_slice(payload);
        w.write_all(&buf)?;
    } else {
        w.write_all(h)?;
        w.write_all(payload)?;
    }
    w.flush()
}

/// Reads one frame whose payload is at most `len_max` bytes; the length is checked before
/// anything is allocated.
pub(crate) fn read_frame(r: &mut impl Read, len_max: u64) -> Result<Frame, ReadError> {
    let mut h = [0u8; HEADER_BYTES];
    read_header(r, &mut h)?;
    if h[0..4] != MAGIC {
        return Err(ReadError::Corrupt(format!("bad magic {:02x?}", &h[0..4])));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(ReadError::Corrupt(format!("protocol version {version}, expected {VERSION}")));
    }
    let seq = u64_at(&h, 8);
    let len = u64_at(&h, 16);
    if len > len_max {
        return Err(ReadError::TooLarge { len });
    }
    let want = u32::from_le_bytes([h[24], h[25], h[26], h[27]]);
    let n = usize::try_from(len).map_err(|_| ReadError::TooLarge { len })?;
    // Grown as the bytes arrive past a first stretch: the length is the sender's word until
    // the CRC is checked, and a garbled one within the bound (world x the largest message
    // at the hub) would otherwise allocate terabytes before a byte of it came.
    const FIRST_BYTES_MAX: usize = 16 << 20;
    let mut payload = Vec::with_capacity(n.min(FIRST_BYTES_MAX));
    r.take(len).read_to_end(&mut payload).map_err(ReadError::Io)?;
    if payload.len() != n {
        return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    if crc(&h[..24], &payload) != want {
        return Err(ReadError::Corrupt("crc32 mismatch".into()));
    }
    Ok(Frame { kind: h[6], seq, payload: Bytes::from(payload) })
}

/// Reads a whole header; EOF before its first byte is a clean close.
fn read_header(r: &mut impl Read, h: &mut [u8; HEADER_BYTES]) -> Result<(), ReadError> {
    let mut got = 0;
    while got < HEADER_BYTES {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(ReadError::Closed),
            Ok(0) => return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Encodes one message per rank: count (u32), each length (u64), then the bytes.
pub(crate) fn encode_set(parts: &[Bytes]) -> Bytes {
    let total: usize = parts.iter().map(Bytes::len).sum();
    let mut out = Vec::with_capacity(4 + 8 * parts.len() + total);
    out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
    }
    for p in parts {
        out.extend_from_slice(p);
    }
    Bytes::from(out)
}

/// Decodes [`encode_set`] output; expects exactly `count` parts of at most `part_max` bytes
/// each and no trailing bytes.
pub(crate) fn decode_set(b: &[u8], count: usize, part_max: u64) -> Result<Vec<Vec<u8>>, String> {
    let n = b.get(0..4).ok_or("set shorter than its count")?;
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    if n != count {
        return Err(format!("set of {n} messages, expected {count}"));
    }
    let lens_end = 8usize.checked_mul(n).and_then(|x| x.checked_add(4)).ok_or("set count overflows")?;
    let lens = b.get(4..lens_end).ok_or("set shorter than its lengths")?;
    let mut at = lens_end;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let len = u64_at(lens, 8 * i);
        if len > part_max {
            return Err(format!("message {i} of {len} bytes exceeds the limit of {part_max}"));
        }
        let end = at.checked_add(len as usize).ok_or("set length overflows")?;
        out.push(b.get(at..end).ok_or("set shorter than its messages")?.to_vec());
        at = end;
    }
    if at != b.len() {
        return Err(format!("{} trailing bytes after set", b.len() - at));
    }
    Ok(out)
}

pub(crate) fn encode_u64s(values: &[u64]) -> Bytes {
    let mut out = Vec::with_capacity(8 * values.len());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Bytes::from(out)
}

pub(crate) fn decode_u64s(b: &[u8]) -> Result<Vec<u64>, String> {
    if !b.len().is_multiple_of(8) {
        return Err(format!("u64 vector of {} bytes is not a multiple of 8", b.len()));
    }
    Ok(b.chunks_exact(8).map(|c| u64_at(c, 0)).collect())
}

/// Abort notice: what went wrong, and with which rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AbortCode {
    PeerDead = 1,
    Timeout = 2,
    Other = 3,
}

pub(crate) fn encode_abort(code: AbortCode, rank: usize, text: &str) -> Bytes {
    let mut out = Vec::with_capacity(9 + text.len());
    out.push(code as u8);
    out.extend_from_slice(&(rank as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    Bytes::from(out)
}

pub(crate) fn decode_abort(b: &[u8]) -> Option<(AbortCode, usize, String)> {
    let code = match *b.first()? {
        1 => AbortCode::PeerDead,
        2 => AbortCode::Timeout,
        _ => AbortCode::Other,
    };
    let rank = usize::try_from(u64_at(b.get(1..9)?, 0)).ok()?;
    let text = String::from_utf8_lossy(b.get(9..)?).into_owned();
    Some((code, rank, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trips_and_rejects_corruption() {
        let mut buf = Vec::new();
        write_frame(&mut buf, kind::GATHER, 7, b"hello").unwrap();
        let f = read_frame(&mut buf.as_slice(), 16).unwrap();
        assert_eq!((f.kind, f.seq, &f.payload[..]), (kind::GATHER, 7, &b"hello"[..]));
        // Too large is refused before reading the payload.
        assert!(matches!(read_frame(&mut buf.as_slice(), 4), Err(ReadError::TooLarge { len: 5 })));
        let mut bad = buf.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(matches!(read_frame(&mut bad.as_slice(), 16), Err(ReadError::Corrupt(_))));
        assert!(matches!(read_frame(&mut &b""[..], 16), Err(ReadError::Closed)));
        assert!(matches!(read_frame(&mut &b"GET / HTTP/1.1\r\n"[..], 16), Err(ReadError::Io(_))));
        // A length within a large bound that the bytes do not follow (a garbled header):
        // the stream ends first, and no buffer of that length was made (a terabyte here).
        let mut lie = buf[..HEADER_BYTES].to_vec();
        lie[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
        lie.extend_from_slice(b"hello");
        assert!(matches!(read_frame(&mut lie.as_slice(), u64::MAX), Err(ReadError::Io(_))));
    }

    // Decoders see bytes from the network: random input must give errors, never panics.
    #[test]
    fn decoders_survive_random_bytes() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000 {
            let len = (next() % 96) as usize;
            let mut b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if i % 3 == 0 && b.len() >= 6 {
                b[0..4].copy_from_slice(&MAGIC); // get past the magic now and then
                b[4..6].copy_from_slice(&VERSION.to_le_bytes());
            }
            let _ = read_frame(&mut b.as_slice(), 64);
            let _ = decode_set(&b, (next() % 4) as usize, 64);
            let _ = decode_u64s(&b);
            let _ = decode_abort(&b);
        }
    }

    #[test]
    fn set_round_trips_with_empty_parts_and_rejects_lies() {
        let parts = vec![Bytes::new(), Bytes::from_static(b"abc"), Bytes::new()];
        let enc = encode_set(&parts);
        let dec = decode_set(&enc, 3, 3).unwrap();
        assert_eq!(dec, vec![vec![], b"abc".to_vec(), vec![]]);
        assert!(decode_set(&enc, 2, 3).is_err());
        assert!(decode_set(&enc, 3, 2).is_err());
        assert!(decode_set(&enc[..enc.len() - 1], 3, 3).is_err());
        assert!(decode_set(&[0xff, 0xff, 0xff, 0xff], 3, 3).is_err());
    }
}
