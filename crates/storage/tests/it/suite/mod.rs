//! The conformance suite: one function per property of the `Storage` contract, each taking
//! any backend. Every backend runs every function (see `../storage.rs`).

use std::ops::Range;
use std::sync::{Arc, Barrier};

use bytes::Bytes;
use dckpt_storage::{Counting, Error, ObjectInfo, Storage, StorageExt, WriterOptions};

/// Deterministic, position-dependent bytes: a shifted or torn copy never equals the original.
pub fn pattern(len: usize, seed: u64) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// Streams `data` in uneven chunks (mixing `write`, `write_bytes` and `write_vectored`
/// with pieces of uneven sizes, empty ones included) and finishes.
pub fn stream(s: &dyn Storage, path: &str, data: &Bytes) -> dckpt_storage::Result<u64> {
    let mut w = s.writer(path, &WriterOptions { size_hint_bytes: Some(data.len() as u64) })?;
    let mut at = 0;
    let mut step = 1usize;
    while at < data.len() {
        let n = step.min(data.len() - at);
        let chunk = &data[at..at + n];
        match step % 3 {
            0 => w.write_bytes(data.slice(at..at + n))?,
            1 => w.write(chunk)?,
            _ => {
                let mut pieces: Vec<&[u8]> = Vec::new();
                let (mut rest, mut k) = (chunk, 0usize);
                while !rest.is_empty() {
                    let (piece, tail) = rest.split_at((k * 4099 % 3000).min(rest.len()));
                    pieces.push(piece);
                    rest = tail;
                    k += 1;
                }
                w.write_vectored(&pieces)?;
            }
        }
        at += n;
        step = (step * 7 + 3) % (3 << 20) + 1;
    }
    w.finish()
}

fn assert_not_found<T: std::fmt::Debug>(r: dckpt_storage::Result<T>) {
    assert!(matches!(r, Err(Error::NotFound { .. })), "expected NotFound, got {r:?}");
}

/// A reader opened with the object's length reads as any reader does, asks the store for
/// no size (the object's or the wide one's reads through it need none: counted here through
/// a [`Counting`] over the store), and pins its reads to one version; opened with another
/// length, or after the object changed length, it fails with `SizeMismatch` by its first
/// read of bytes; a missing object is `NotFound`.
pub fn sized_reads(s: &Arc<dyn Storage>) {
    let len = (3 << 20) + 4321;
    let data = pattern(len, 44);
    s.put("sz/obj", data.clone()).unwrap();
    let n = len as u64;
    let counted = Counting::new(s.clone());
    let mut reader = counted.reader_sized("sz/obj", n).unwrap();
    let sets: [Vec<Range<u64>>; 4] =
        [vec![0..n], vec![0..0, n..n, 7..7], vec![5..9, n - 3..n, 1 << 20..(2 << 20) + 1], vec![n - 1..n]];
    for set in &sets {
        let mut bufs: Vec<Vec<u8>> = set.iter().map(|r| vec![0u8; (r.end - r.start) as usize]).collect();
        let mut reads: Vec<(u64, &mut [u8])> =
            set.iter().zip(bufs.iter_mut()).map(|(r, b)| (r.start, b.as_mut_slice())).collect();
        reader.read_into(&mut reads).unwrap();
        for (r, b) in set.iter().zip(&bufs) {
            assert_eq!(&b[..], &data[r.start as usize..r.end as usize], "sized reader {r:?}");
        }
    }
    let mut past = [0u8; 2];
    let r = reader.read_into(&mut [(n - 1, &mut past[..])]);
    assert!(matches!(r, Err(Error::OutOfRange { .. })), "a read past the end: {r:?}");
    drop(reader);
    let counts = counted.counts();
    assert_eq!((counts.readers, counts.sizes, counts.ranged_reads), (1, 0, 5), "{counts:?}");
    for wrong in [n - 1, n + 1] {
        let r = s.reader_sized("sz/obj", wrong).and_then(|mut r| r.read_into(&mut [(0, &mut [0u8; 1][..])]));
        assert!(
            matches!(r, Err(Error::SizeMismatch { expected, size, .. }) if expected == wrong && size == n),
            "opened for {wrong} of {n} bytes: {r:?}"
        );
    }
    // The object replaced by a shorter one between two reads of one reader: the second
    // reads the version the first read, or fails.
    let mut reader = s.reader_sized("sz/obj", n).unwrap();
    reader.read_into(&mut [(0, &mut [0u8; 4][..])]).unwrap();
    s.put("sz/obj", pattern(1000, 45)).unwrap();
    let mut got = [0u8; 4];
    match reader.read_into(&mut [(10, &mut got[..])]) {
        Ok(()) => assert_eq!(got[..], data[10..14], "a read of another version"),
        Err(e) => assert!(e.is_transient() || matches!(e, Error::SizeMismatch { .. }), "{e:?}"),
    }
    let r = s.reader_sized("sz/absent", 5).and_then(|mut r| r.read_into(&mut [(0, &mut [0u8; 1][..])]));
    assert!(matches!(r, Err(Error::NotFound { .. })), "{r:?}");
}

/// Empty, small and multipart objects come back byte for byte, through put and through a
/// writer. `big` must exceed three parts (blocks) of the backend under test.
pub fn round_trips(s: &Arc<dyn Storage>, big: usize) {
    for (i, len) in [0usize, 1, 1000, big].into_iter().enumerate() {
        let data = pattern(len, i as u64);
        let put = format!("rt/put_{len}");
        s.put(&put, data.clone()).unwrap();
        assert_eq!(s.get(&put).unwrap(), data, "put of {len} bytes");
        assert_eq!(s.size(&put).unwrap(), len as u64);

        let streamed = format!("rt/stream_{len}");
        assert_eq!(stream(s.as_ref(), &streamed, &data).unwrap(), len as u64);
        assert_eq!(s.get(&streamed).unwrap(), data, "stream of {len} bytes");
        assert_eq!(s.size(&streamed).unwrap(), len as u64);
    }
    // Overwrite replaces the whole object, longer or shorter.
    s.put("rt/over", pattern(5000, 1)).unwrap();
    s.put("rt/over", pattern(10, 2)).unwrap();
    assert_eq!(s.get("rt/over").unwrap(), pattern(10, 2));
    stream(s.as_ref(), "rt/over", &pattern(70_000, 3)).unwrap();
    assert_eq!(s.get("rt/over").unwrap(), pattern(70_000, 3));
}

/// `get_ranges` and `read_into` agree with slicing the whole object, for scattered,
/// overlapping, adjacent, empty and end-touching ranges; bad ranges and paths are errors.
pub fn ranged_reads(s: &Arc<dyn Storage>) {
    let len = (3 << 20) + 12_345;
    let data = pattern(len, 42);
    s.put("rng/obj", data.clone()).unwrap();
    let n = len as u64;
    let mut sets: Vec<Vec<Range<u64>>> = vec![
        vec![0..n],
        vec![0..0, n..n, 5..5],
        vec![0..10, 10..20, 20..30],
        vec![100..200, 150..250, 0..1, n - 1..n],
        vec![n - 4096..n, 0..4096, 1 << 20..(1 << 20) + 7, (2 << 20) + 3..(3 << 20)],
        // Strided, as a column split reads a row-major chunk: more pieces than one vectored
        // call takes, short gaps between them.
        (0..2100).map(|i| i * 300..i * 300 + 100).collect(),
        // Gaps on either side of 64 KiB.
        vec![0..10, 65_546..65_556, 131_093..131_100, 131_100..131_200],
    ];
    // Seeded random sets, sizes from bytes to a megabyte.
    let mut x = 7u64;
    for _ in 0..8 {
        let mut set = Vec::new();
        for _ in 0..12 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let start = (x >> 33) % n;
            let len = ((x >> 7) % (1 << 20)).min(n - start);
            set.push(start..start + len);
        }
        sets.push(set);
    }
    for set in &sets {
        let got = s.get_ranges("rng/obj", set).unwrap();
        assert_eq!(got.len(), set.len());
        for (r, b) in set.iter().zip(&got) {
            assert_eq!(&b[..], &data[r.start as usize..r.end as usize], "range {r:?}");
        }
        let mut bufs: Vec<Vec<u8>> = set.iter().map(|r| vec![0u8; (r.end - r.start) as usize]).collect();
        let mut reads: Vec<(u64, &mut [u8])> =
            set.iter().zip(bufs.iter_mut()).map(|(r, b)| (r.start, b.as_mut_slice())).collect();
        s.read_into("rng/obj", &mut reads).unwrap();
        for (r, b) in set.iter().zip(&bufs) {
            assert_eq!(&b[..], &data[r.start as usize..r.end as usize], "read_into {r:?}");
        }
    }
    // The same sets through one reader, opened once for all of them.
    let mut reader = s.reader("rng/obj").unwrap();
    for set in &sets {
        let mut bufs: Vec<Vec<u8>> = set.iter().map(|r| vec![0u8; (r.end - r.start) as usize]).collect();
        let mut reads: Vec<(u64, &mut [u8])> =
            set.iter().zip(bufs.iter_mut()).map(|(r, b)| (r.start, b.as_mut_slice())).collect();
        reader.read_into(&mut reads).unwrap();
        for (r, b) in set.iter().zip(&bufs) {
            assert_eq!(&b[..], &data[r.start as usize..r.end as usize], "reader {r:?}");
        }
    }
    let mut past = [0u8; 2];
    assert!(reader.read_into(&mut [(n - 1, &mut past[..])]).is_err(), "a read past the end");
    drop(reader);
    assert!(s.reader("rng/absent").and_then(|mut r| r.read_into(&mut [(0, &mut past[..])])).is_err());
    // Far-apart ranges (several reads, on S3 several GETs) of a bigger object.
    let wide = pattern(9 << 20, 43);
    s.put("rng/wide", wide.clone()).unwrap();
    let m = 1u64 << 20;
    for set in [
        vec![0..10, 3 * m..3 * m + 10, 6 * m..6 * m + 10, 9 * m - 10..9 * m],
        vec![8 * m..9 * m, 0..2 * m, 4 * m..4 * m + 1, 2 * m + 5..2 * m + 6, 6 * m..7 * m],
    ] {
        let got = s.get_ranges("rng/wide", &set).unwrap();
        let mut bufs: Vec<Vec<u8>> = set.iter().map(|r| vec![0u8; (r.end - r.start) as usize]).collect();
        let mut reads: Vec<(u64, &mut [u8])> =
            set.iter().zip(bufs.iter_mut()).map(|(r, b)| (r.start, b.as_mut_slice())).collect();
        s.read_into("rng/wide", &mut reads).unwrap();
        for ((r, b), v) in set.iter().zip(&got).zip(&bufs) {
            assert_eq!(&b[..], &wide[r.start as usize..r.end as usize], "wide range {r:?}");
            assert_eq!(&v[..], &wide[r.start as usize..r.end as usize], "wide read_into {r:?}");
        }
    }
    assert_eq!(s.get_range("rng/obj", 3..9).unwrap(), data.slice(3..9));
    let mut one = [0u8; 16];
    s.read_exact_at("rng/obj", 1000, &mut one).unwrap();
    assert_eq!(&one[..], &data[1000..1016]);

    for bad in [vec![0..n + 1], vec![n + 5..n + 6], vec![0..1, n - 1..n + 1], vec![0..u64::MAX / 2]] {
        let r = s.get_ranges("rng/obj", &bad);
        assert!(matches!(r, Err(Error::OutOfRange { .. })), "{bad:?} gave {r:?}");
    }
    let mut past = [0u8; 2];
    let r = s.read_into("rng/obj", &mut [(n - 1, &mut past[..])]);
    assert!(matches!(r, Err(Error::OutOfRange { .. })), "{r:?}");
    assert_not_found(s.get_ranges("rng/missing", &[0..1]));
    assert_not_found(s.read_into("rng/missing", &mut [(0, &mut [0u8; 1][..])]));
    assert_not_found(s.get("rng/missing"));
    assert_not_found(s.size("rng/missing"));
    // A prefetch is a hint: of a missing object, past the end, or of nothing, it is harmless
    // and changes no bytes.
    s.prefetch("rng/missing", 0, 10);
    s.prefetch("rng/obj", n + 100, 1 << 40);
    s.prefetch("rng/obj", 0, 0);
    s.prefetch("rng/obj", 0, u64::MAX);
    assert_eq!(s.get("rng/obj").unwrap(), data);
    assert!(s.hints().read_window.is_none_or(|w| w > 0), "a read window holds bytes");
}

/// `read_picked_inspected` shows every byte of its range, in order, and fills each pick
/// with its bytes: picks strided as a column split takes them, at both ends of the range,
/// one as long as the range, none; an empty range shows nothing; a range past the end is
/// an error.
pub fn picked_reads(s: &Arc<dyn Storage>) {
    let len = (2 << 20) + 4321;
    let data = pattern(len, 44);
    s.put("pick/obj", data.clone()).unwrap();
    let n = len as u64;
    let cases: Vec<(Range<u64>, Vec<Range<u64>>)> = vec![
        (0..n, (0..2000).map(|i| i * 1000..i * 1000 + 500).collect()),
        (1000..n - 7, vec![1000..1001, 5000..300_000, n - 8..n - 7]),
        (12..12, vec![]),
        (77..600_000, vec![]),
        (3..(1 << 20) + 3, vec![3..(1 << 20) + 3]),
        (n - 100..n, vec![n - 100..n - 100, n - 1..n]),
    ];
    let mut reader = s.reader("pick/obj").unwrap();
    for (range, picks) in &cases {
        let mut bufs: Vec<Vec<u8>> = picks.iter().map(|r| vec![0u8; (r.end - r.start) as usize]).collect();
        let mut reads: Vec<(u64, &mut [u8])> =
            picks.iter().zip(bufs.iter_mut()).map(|(r, b)| (r.start, b.as_mut_slice())).collect();
        let mut shown = Vec::new();
        reader.read_picked_inspected(range.clone(), &mut reads, &mut |piece| shown.extend_from_slice(piece)).unwrap();
        assert!(shown[..] == data[range.start as usize..range.end as usize], "what was shown of {range:?}");
        for (r, b) in picks.iter().zip(&bufs) {
            assert_eq!(&b[..], &data[r.start as usize..r.end as usize], "pick {r:?} of {range:?}");
        }
    }
    let r = reader.read_picked_inspected(n - 10..n + 1, &mut [], &mut |_| {});
    assert!(matches!(r, Err(Error::OutOfRange { .. })), "{r:?}");
}

/// `list` is segment-wise, recursive, sorted, with sizes; `delete` is idempotent.
pub fn list_and_delete(s: &Arc<dyn Storage>) {
    for (p, n) in [("ld/a/b", 1), ("ld/a/c/d", 2), ("ld/ab", 3), ("ld/x", 0)] {
        s.put(p, pattern(n, 0)).unwrap();
    }
    let info = |p: &str, n: u64| ObjectInfo { path: p.to_string(), size: n };
    assert_eq!(s.list("ld/a").unwrap(), vec![info("ld/a/b", 1), info("ld/a/c/d", 2)]);
    assert_eq!(s.list("ld/a/c").unwrap(), vec![info("ld/a/c/d", 2)]);
    assert_eq!(s.list("ld").unwrap(), vec![info("ld/a/b", 1), info("ld/a/c/d", 2), info("ld/ab", 3), info("ld/x", 0)]);
    assert_eq!(s.list("ld/nothing").unwrap(), vec![]);
    // A prefix that names an object covers it.
    assert_eq!(s.list("ld/x").unwrap(), vec![info("ld/x", 0)]);
    assert!(s.list("").unwrap().contains(&info("ld/ab", 3)));

    s.delete("ld/a/b").unwrap();
    s.delete("ld/a/b").unwrap(); // idempotent
    s.delete("ld/never").unwrap();
    assert_not_found(s.get("ld/a/b"));
    assert!(!s.exists("ld/a/b").unwrap());
    assert!(s.exists("ld/ab").unwrap());
    assert_eq!(s.list("ld/a").unwrap(), vec![info("ld/a/c/d", 2)]);
    // Below an object there is nothing (not an error of another kind).
    assert_not_found(s.size("ld/ab/under"));
    assert_not_found(s.get("ld/ab/under"));
    s.delete("ld/ab/under").unwrap();
    assert_eq!(s.list("ld/ab/under").unwrap(), vec![]);
    // A name that is only a prefix of objects is no object: deleting it succeeds and
    // removes nothing; no abandoned write is at an object's own name or under it.
    s.delete("ld/a").unwrap();
    s.delete("ld/a/c").unwrap();
    assert_eq!(s.list("ld/a").unwrap(), vec![info("ld/a/c/d", 2)]);
    assert_eq!(s.list_abandoned("ld/ab").unwrap(), vec![]);
    assert_eq!(s.list_abandoned("ld/ab/under").unwrap(), vec![]);
    assert_eq!(s.remove_abandoned("ld/ab").unwrap(), vec![]);
    for p in ["ld/a/c/d", "ld/ab", "ld/x"] {
        s.delete(p).unwrap();
    }
    assert_eq!(s.list("ld").unwrap(), vec![]);
}

/// Names with characters an object store may encode (`~`, `%`, `#`, spaces, brackets,
/// non-ASCII): each is stored, listed and read back under exactly the name given.
pub fn odd_names(s: &Arc<dyn Storage>) {
    let names = ["odd/exp~1/a", "odd/50%/b", "odd/#c [d]", "odd/zo\u{eb}/\u{fc}", "odd/x{y}^z|w"];
    for (i, p) in names.iter().enumerate() {
        s.put(p, pattern(i + 1, 7)).unwrap();
    }
    let mut want: Vec<String> = names.iter().map(|p| p.to_string()).collect();
    want.sort();
    let listed: Vec<String> = s.list("odd").unwrap().into_iter().map(|o| o.path).collect();
    assert_eq!(listed, want);
    assert_eq!(s.list("odd/exp~1").unwrap().len(), 1);
    for (i, p) in names.iter().enumerate() {
        assert_eq!(s.get(p).unwrap(), pattern(i + 1, 7), "{p}");
        assert_eq!(s.size(p).unwrap(), i as u64 + 1, "{p}");
        s.delete(p).unwrap();
    }
    assert_eq!(s.list("odd").unwrap(), vec![]);
}

/// Of 16 concurrent creators exactly one wins; the others get `AlreadyExists`, and the stored
/// bytes are the winner's.
pub fn conditional_create_one_winner(s: &Arc<dyn Storage>) {
    const CREATORS: usize = 16;
    let barrier = Arc::new(Barrier::new(CREATORS));
    let results: Vec<(usize, dckpt_storage::Result<()>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..CREATORS)
            .map(|i| {
                let (s, barrier) = (s.clone(), barrier.clone());
                scope.spawn(move || {
                    barrier.wait();
                    (i, s.put_if_absent("cc/commit", pattern(100 + i, i as u64)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let winners: Vec<usize> = results.iter().filter(|(_, r)| r.is_ok()).map(|(i, _)| *i).collect();
    assert_eq!(winners.len(), 1, "winners: {winners:?}; results: {results:?}");
    for (i, r) in &results {
        assert!(r.is_ok() || matches!(r, Err(Error::AlreadyExists { .. })), "creator {i}: {r:?}");
    }
    let w = winners[0];
    assert_eq!(s.get("cc/commit").unwrap(), pattern(100 + w, w as u64));
    let again = s.put_if_absent("cc/commit", Bytes::from_static(b"late"));
    assert!(matches!(again, Err(Error::AlreadyExists { .. })), "{again:?}");
    assert_eq!(s.get("cc/commit").unwrap(), pattern(100 + w, w as u64));
    // A deleted commit marker can be created again.
    s.delete("cc/commit").unwrap();
    s.put_if_absent("cc/commit", Bytes::from_static(b"new")).unwrap();
    assert_eq!(s.get("cc/commit").unwrap(), Bytes::from_static(b"new"));
}

/// Of 16 concurrent conditional replaces of the bytes they all read exactly one wins; the
/// others get `Precondition` and the stored bytes are the winner's. A replace of bytes that are
/// no longer there, or of an object that is not there, fails and changes nothing.
pub fn conditional_replace_one_winner(s: &Arc<dyn Storage>) {
    const REPLACERS: usize = 16;
    let old = pattern(77, 1);
    s.put("cr/commit", old.clone()).unwrap();
    let barrier = Arc::new(Barrier::new(REPLACERS));
    let results: Vec<(usize, dckpt_storage::Result<()>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..REPLACERS)
            .map(|i| {
                let (s, barrier, old) = (s.clone(), barrier.clone(), old.clone());
                scope.spawn(move || {
                    barrier.wait();
                    (i, s.put_if_match("cr/commit", pattern(100 + i, i as u64), &old))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let winners: Vec<usize> = results.iter().filter(|(_, r)| r.is_ok()).map(|(i, _)| *i).collect();
    assert_eq!(winners.len(), 1, "winners: {winners:?}; results: {results:?}");
    for (i, r) in &results {
        assert!(r.is_ok() || matches!(r, Err(Error::Precondition { .. })), "replacer {i}: {r:?}");
    }
    let w = winners[0];
    let won = pattern(100 + w, w as u64);
    assert_eq!(s.get("cr/commit").unwrap(), won);
    // What was read is gone: a late replace of it fails and changes nothing.
    let late = s.put_if_match("cr/commit", Bytes::from_static(b"late"), &old);
    assert!(matches!(late, Err(Error::Precondition { .. })), "{late:?}");
    assert_eq!(s.get("cr/commit").unwrap(), won);
    // Of the bytes that are there it succeeds, also to a shorter and an empty object.
    s.put_if_match("cr/commit", Bytes::from_static(b"next"), &won).unwrap();
    s.put_if_match("cr/commit", Bytes::new(), b"next").unwrap();
    assert_eq!(s.get("cr/commit").unwrap(), Bytes::new());
    // Empty bytes expected of an object that is not empty: not a match.
    s.put("cr/commit", Bytes::from_static(b"full")).unwrap();
    let full = s.put_if_match("cr/commit", Bytes::from_static(b"x"), b"");
    assert!(matches!(full, Err(Error::Precondition { .. })), "{full:?}");
    assert_eq!(s.get("cr/commit").unwrap(), Bytes::from_static(b"full"));
    // No object: a precondition failure too, and nothing is created.
    let absent = s.put_if_match("cr/none", Bytes::from_static(b"x"), b"");
    assert!(matches!(absent, Err(Error::Precondition { .. })), "{absent:?}");
    assert!(matches!(s.get("cr/none"), Err(Error::NotFound { .. })));
    assert_eq!(s.list("cr").unwrap().iter().map(|o| o.path.as_str()).collect::<Vec<_>>(), ["cr/commit"]);
    s.delete("cr/commit").unwrap();
}

/// Aborted and dropped writers leave nothing visible: no object, no listing, and an older
/// object under the same name stays as it was.
pub fn abort_leaves_nothing(s: &Arc<dyn Storage>, big: usize) {
    let data = pattern(big, 9);
    for how in ["abort", "drop"] {
        for len in [10, big] {
            let path = format!("ab/{how}_{len}");
            let mut w = s.writer(&path, &WriterOptions::default()).unwrap();
            w.write(&data[..len]).unwrap();
            match how {
                "abort" => w.abort().unwrap(),
                _ => drop(w),
            }
            assert_not_found(s.get(&path));
        }
    }
    s.put("ab/kept", pattern(33, 1)).unwrap();
    let mut w = s.writer("ab/kept", &WriterOptions::default()).unwrap();
    w.write(&data).unwrap();
    w.abort().unwrap();
    assert_eq!(s.get("ab/kept").unwrap(), pattern(33, 1));
    assert_eq!(s.list("ab").unwrap(), vec![ObjectInfo { path: "ab/kept".into(), size: 33 }]);
}

/// Writes in progress are never abandoned: neither listed nor removed as such, and they
/// finish as if nothing had looked; a store where no process died has nothing abandoned.
pub fn live_writes_are_not_abandoned(s: &Arc<dyn Storage>, big: usize) {
    let data = pattern(big, 4);
    let mut w = s.writer("live/obj", &WriterOptions::default()).unwrap();
    w.write(&data).unwrap();
    assert_eq!(s.list_abandoned("").unwrap(), vec![]);
    assert_eq!(s.remove_abandoned("").unwrap(), vec![]);
    assert_eq!(s.remove_abandoned("live").unwrap(), vec![]);
    assert_eq!(w.finish().unwrap(), big as u64);
    assert_eq!(s.get("live/obj").unwrap(), data);
    assert!(matches!(s.list_abandoned("../x"), Err(Error::InvalidPath { .. })));
    assert!(matches!(s.remove_abandoned("a//b"), Err(Error::InvalidPath { .. })));
}

/// A reader racing with overwrites (put and streamed) sees one whole version, never a mix.
pub fn reader_sees_old_or_new(s: &Arc<dyn Storage>, len: usize, rounds: usize) {
    let versions: Vec<Bytes> = (0..3).map(|i| pattern(len, 100 + i)).collect();
    s.put("race/obj", versions[0].clone()).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            for round in 0..rounds {
                let v = &versions[1 + round % 2];
                if round % 2 == 0 {
                    s.put("race/obj", v.clone()).unwrap();
                } else {
                    stream(s.as_ref(), "race/obj", v).unwrap();
                }
            }
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let mut reads = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) || reads == 0 {
            let got = s.get("race/obj").unwrap();
            assert!(versions.contains(&got), "read {} bytes matching no version", got.len());
            let tail = s.get_ranges("race/obj", &[(len as u64 - 100)..len as u64]).unwrap();
            assert!(versions.iter().any(|v| v.slice(len - 100..) == tail[0]), "torn range");
            reads += 1;
        }
        writer.join().unwrap();
    });
}

/// Bad object paths are rejected up front, on every operation.
pub fn invalid_paths(s: &Arc<dyn Storage>) {
    for bad in ["", "/abs", "a//b", "../x", "a/./b", "a/", "a\\b", "a/.dckpt-tmp.1"] {
        let r = s.put(bad, Bytes::new());
        assert!(matches!(r, Err(Error::InvalidPath { .. })), "put {bad:?}: {r:?}");
        assert!(matches!(s.get(bad), Err(Error::InvalidPath { .. })), "get {bad:?}");
        assert!(s.writer(bad, &WriterOptions::default()).is_err(), "writer {bad:?}");
        assert!(matches!(s.delete(bad), Err(Error::InvalidPath { .. })), "delete {bad:?}");
    }
    assert!(matches!(s.list("/abs"), Err(Error::InvalidPath { .. })));
}
