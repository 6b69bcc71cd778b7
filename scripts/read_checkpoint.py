#!/usr/bin/env python3
"""Read and verify a dckpt checkpoint (format v1, docs/format.md) from Python.

Standalone: needs the standard library and `msgpack`. When `safetensors` is installed it
also parses every data file with it (proving they are valid safetensors files); `numpy` is
not needed.

    python3 scripts/read_checkpoint.py CHECKPOINT_DIR [--json] [--assemble]

Checks the metadata file (magic, version, length, CRC-32), the plain file names, every data
file's size, header CRC and safetensors header, and the CRC-32 of every data block. With
`--assemble` it rebuilds each global tensor from its chunks (checking that they cover it
exactly once) and reports the CRC-32 of its bytes. Exits 0 when everything checks, 1 with
a message naming the file and field otherwise.
"""

import argparse
import json
import os
import re
import struct
import sys
import zlib

import msgpack

META_NAME = "dckpt.meta"
MAGIC = b"DCKPTMD\x00"
VERSION = 1
PREFIX = 24
META_BYTES_MAX = 1 << 30
BLOCK_BYTES_MAX = 1 << 30
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,255}$")
SAVE_ID = re.compile(r"^[0-9a-f]{16}$")
# A data file's name exactly as dckpt makes it: the rank padded to 5 digits and no more, the
# file number from 1 without leading zeros, none for the rank's first file.
DATA_FILE = re.compile(r"^([0-9a-f]{16})-([0-9]{5}|[1-9][0-9]{5,})(?:\.([1-9][0-9]*))?\.safetensors$")
LAYOUT_ENTRIES_MAX = 1 << 17
DTYPE_SIZE = {
    "bool": 1, "u8": 1, "i8": 1, "f8_e4m3": 1, "f8_e5m2": 1,
    "i16": 2, "f16": 2, "bf16": 2,
    "i32": 4, "f32": 4,
    "i64": 8, "f64": 8,
}
READ_BYTES = 32 << 20


class Bad(Exception):
    """A malformed or damaged checkpoint: `file: field: detail`."""

    def __init__(self, file, field, detail):
        super().__init__(f"{file}: {field}: {detail}")


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def read_metadata(root):
    path = os.path.join(root, META_NAME)
    if not os.path.exists(path):
        raise Bad(path, "file", "not a checkpoint (no committed metadata file)")
    size = os.path.getsize(path)
    if size > META_BYTES_MAX:
        raise Bad(path, "length", f"{size} bytes exceeds the limit")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < PREFIX + 4:
        raise Bad(path, "length", f"{len(data)} bytes is too short")
    magic, version, _reserved, body_len = struct.unpack_from("<8sIIQ", data, 0)
    if magic != MAGIC:
        raise Bad(path, "magic", "not a dckpt metadata file")
    if version != VERSION:
        raise Bad(path, "format_version", f"version {version} is not supported (this reader reads {VERSION})")
    if PREFIX + body_len + 4 != len(data):
        total = PREFIX + body_len + 4
        raise Bad(path, "body_length", f"says a {body_len}-byte body, so a {total}-byte file, but the file has {len(data)} bytes")
    (stored,) = struct.unpack_from("<I", data, len(data) - 4)
    actual = zlib.crc32(data[:-4])
    if stored != actual:
        raise Bad(path, "crc32", f"stored {stored:08x}, computed {actual:08x}: the file is damaged")
    try:
        # Maps as lists of pairs, so that a repeated key is seen (a dict keeps the last).
        raw = msgpack.unpackb(data[PREFIX:-4], raw=False, strict_map_key=True, object_pairs_hook=Pairs)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad body
        raise Bad(path, "body", f"not valid MessagePack: {e}") from None
    meta = typed(path, raw)
    check_metadata(path, meta, version)
    return meta


class Pairs(list):
    """A MessagePack map as it was written: its (key, value) pairs in order."""


def typed(path, raw):
    """The body as dicts and lists, each field held to the one type docs/format.md gives it
    (section 3.2): a known field written twice or missing is an error, an unknown one is
    skipped however often it appears."""

    def at(where, name):
        return f"{where}.{name}" if where else name

    def uint(bits):
        def check(v, where):
            # bool is an int in Python; MessagePack's booleans are not integers.
            if type(v) is not int or not 0 <= v < 1 << bits:
                raise Bad(path, where, f"{v!r} is not an unsigned {bits}-bit integer")
            return v
        return check

    def of_type(t, what):
        def check(v, where):
            if type(v) is not t:
                raise Bad(path, where, f"expected {what}, found {type(v).__name__}")
            return v
        return check

    def array(item):
        def check(v, where):
            if type(v) is not list:
                raise Bad(path, where, f"expected an array, found {type(v).__name__}")
            return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return check

    def flat(v, where):
        if v is None:
            return None
        v = array(u64)(v, where)
        if len(v) != 2:
            raise Bad(path, where, f"expected [start, stop], found an array of {len(v)} items")
        return v

    def layout(v, where):
        if type(v) is not Pairs:
            raise Bad(path, where, f"expected a map, found {type(v).__name__}")
        if len(v) > LAYOUT_ENTRIES_MAX:
            raise Bad(path, where, f"{len(v)} layout entries exceeds the limit of {LAYOUT_ENTRIES_MAX}")
        out = {}
        for k, x in v:
            string(k, where)
            if k in out:
                raise Bad(path, where, f"the key {k!r} appears twice")
            out[k] = string(x, at(where, k))
        return out

    def struct(fields, optional=()):
        def check(v, where):
            if type(v) is not Pairs:
                raise Bad(path, where or "body", f"expected a map with named fields, found {type(v).__name__}")
            out = {}
            for k, x in v:
                if type(k) is not str:
                    raise Bad(path, where or "body", f"a field name {k!r} that is not a string")
                if k not in fields:
                    continue
                if k in out:
                    raise Bad(path, at(where, k), "appears twice")
                out[k] = fields[k](x, at(where, k))
            for k in fields:
                if k not in out and k not in optional:
                    raise Bad(path, at(where, k), "missing")
            return out
        return check

    u64, u32 = uint(64), uint(32)
    string, binary = of_type(str, "a string"), of_type(bytes, "binary")
    dims = array(u64)
    chunk = struct({"offset": dims, "shape": dims, "flat": flat, "file": u32, "at": u64, "crc32": binary},
                   optional=("flat",))
    entry = struct({"grid_offset": dims, "file": u32, "at": u64, "len": u64, "crc32": binary})
    body = struct({
        "format_version": u32, "save_id": string, "writer": string, "block_bytes": u64, "layout": layout,
        "files": array(struct({"name": string, "bytes": u64, "data_start": u64, "header_crc32": u32})),
        "tensors": array(struct({"key": string, "dtype": string, "global_shape": dims, "chunks": array(chunk)})),
        "objects": array(struct({"key": string, "grid_shape": dims, "entries": array(entry)})),
    })
    return body(raw, "")


def check_metadata(path, m, version):
    if not isinstance(m, dict):
        raise Bad(path, "body", "not a map")
    need = ["format_version", "save_id", "writer", "block_bytes", "layout", "files", "tensors", "objects"]
    for k in need:
        if k not in m:
            raise Bad(path, k, "missing")
    if m["format_version"] != version:
        raise Bad(path, "format_version", "body and prefix disagree")
    if not (isinstance(m["block_bytes"], int) and 1 <= m["block_bytes"] <= BLOCK_BYTES_MAX):
        raise Bad(path, "block_bytes", f"{m['block_bytes']!r} is out of range")
    if not SAVE_ID.match(m["save_id"]):
        raise Bad(path, "save_id", f"{m['save_id']!r} is not 16 lower-case hexadecimal digits")
    names = set()
    prev = None
    for i, f in enumerate(m["files"]):
        plain(path, f"files[{i}].name", f["name"])
        if f["name"] == META_NAME or f["name"] in names:
            raise Bad(path, f"files[{i}].name", f"{f['name']!r} is used twice")
        names.add(f["name"])
        d = DATA_FILE.match(f["name"])
        if not d or d.group(1) != m["save_id"]:
            raise Bad(path, f"files[{i}].name", f"{f['name']!r} is not a data file name of save {m['save_id']}")
        rank, n = int(d.group(2)), int(d.group(3) or 0)
        # Files in rank order, each rank's numbered from 0 without a gap.
        if not (n == 0 if prev is None else (rank == prev[0] and n == prev[1] + 1) or (rank > prev[0] and n == 0)):
            raise Bad(path, f"files[{i}].name", f"{f['name']!r} is out of rank order")
        prev = (rank, n)
        f["rank"] = rank
        if not 8 <= f["data_start"] <= f["bytes"]:
            raise Bad(path, f"files[{i}].data_start", "outside the file")
    for list_name in ("tensors", "objects"):
        keys = [x["key"] for x in m[list_name]]
        for i in range(1, len(keys)):
            # Sorted by code point, as Python compares strings; each key once.
            if keys[i - 1] >= keys[i]:
                raise Bad(path, f"{list_name}[{i}].key", f"{keys[i]!r} is out of order or appears twice")
    for ti, t in enumerate(m["tensors"]):
        if t["dtype"] not in DTYPE_SIZE:
            raise Bad(path, f"tensors[{ti}].dtype", f"unknown dtype {t['dtype']!r}")
        for ci, c in enumerate(t["chunks"]):
            field = f"tensors[{ti}] ({t['key']}).chunks[{ci}]"
            span(path, field, m, c, chunk_numel(c) * DTYPE_SIZE[t["dtype"]])
    for oi, o in enumerate(m["objects"]):
        for ei, e in enumerate(o["entries"]):
            span(path, f"objects[{oi}] ({o['key']}).entries[{ei}]", m, e, e["len"])
    # The pieces of each file tile its data section: no byte escapes a checksum.
    for fi, f in enumerate(m["files"]):
        at = f["data_start"]
        for p in pieces_of(m, fi):
            if p["at"] != at:
                raise Bad(path, f"files[{fi}] ({f['name']})", f"the piece at byte {p['at']} does not follow byte {at}")
            at += p["len"]
        if at != f["bytes"]:
            raise Bad(path, f"files[{fi}] ({f['name']})", f"pieces end at byte {at} but the file has {f['bytes']}")


def plain(path, field, name):
    if not isinstance(name, str) or not NAME.match(name) or name.startswith("."):
        raise Bad(path, field, f"{name!r} is not a plain file name")


def span(path, field, m, piece, length):
    fi, at = piece["file"], piece["at"]
    if not 0 <= fi < len(m["files"]):
        raise Bad(path, field + ".file", f"file index {fi} of {len(m['files'])}")
    f = m["files"][fi]
    if at < f["data_start"] or at + length > f["bytes"]:
        raise Bad(path, field + ".at", f"bytes {at}..{at + length} are outside the data section of {f['name']}")
    blocks = -(-length // m["block_bytes"])
    if len(piece["crc32"]) != 4 * blocks:
        raise Bad(path, field + ".crc32", f"{len(piece['crc32'])} bytes for {blocks} blocks")


def pieces_of(m, fi):
    """The chunks and objects stored in file `fi`, by offset: name, at, len, crc32."""
    out = []
    for t in m["tensors"]:
        for c in t["chunks"]:
            if c["file"] == fi:
                n = chunk_numel(c) * DTYPE_SIZE[t["dtype"]]
                out.append({"name": f"tensor {t['key']}", "at": c["at"], "len": n, "crc32": c["crc32"]})
    for o in m["objects"]:
        for e in o["entries"]:
            if e["file"] == fi:
                out.append({"name": f"object {o['key']} {e['grid_offset']}", "at": e["at"], "len": e["len"],
                            "crc32": e["crc32"]})
    out = [p for p in out if p["len"] > 0]
    out.sort(key=lambda p: p["at"])
    return out


def chunk_numel(c):
    flat = c.get("flat")
    return flat[1] - flat[0] if flat is not None else numel(c["shape"])


def verify_file(root, m, fi, try_safetensors):
    """Checks size, header CRC, safetensors header and every block; returns blocks checked."""
    f = m["files"][fi]
    path = os.path.join(root, f["name"])
    size = os.path.getsize(path)
    if size != f["bytes"]:
        raise Bad(path, "size", f"{size} bytes, the metadata says {f['bytes']}")
    block = m["block_bytes"]
    per_read = max(READ_BYTES // block, 1) * block
    blocks = 0
    with open(path, "rb") as h:
        header = h.read(f["data_start"])
        if zlib.crc32(header) != f["header_crc32"]:
            raise Bad(path, "header_crc32", "the safetensors header is damaged")
        check_safetensors_header(path, m, fi, header)
        # Each piece's blocks are counted from the piece's own first byte.
        for p in pieces_of(m, fi):
            h.seek(p["at"])
            lo = 0
            while lo < p["len"]:
                buf = h.read(min(per_read, p["len"] - lo))
                for k in range(0, len(buf), block):
                    b = (lo + k) // block
                    (stored,) = struct.unpack_from("<I", p["crc32"], 4 * b)
                    if zlib.crc32(buf[k:k + block]) != stored:
                        at = p["at"] + lo + k
                        raise Bad(path, f"crc32[{b}]", f"{p['name']}: block {b} at byte {at} fails its checksum")
                    blocks += 1
                lo += len(buf)
    if try_safetensors:
        check_with_safetensors(path)
    return blocks


def check_safetensors_header(path, m, fi, header):
    f = m["files"][fi]
    (n,) = struct.unpack_from("<Q", header, 0)
    if 8 + n != f["data_start"]:
        raise Bad(path, "safetensors header", f"declares {n} bytes, the metadata says {f['data_start'] - 8}")
    entries = json.loads(header[8:])
    # The header says whose file it is: dckpt's, of this save, written by the rank its name gives.
    md = entries.get("__metadata__", {})
    expect = {"format": "dckpt", "save_id": m["save_id"], "rank": str(f["rank"])}
    for k, v in expect.items():
        if md.get(k) != v:
            raise Bad(path, f"__metadata__.{k}", f"is {md.get(k)!r}, not {v!r}")
    declared = sorted(tuple(v["data_offsets"]) for k, v in entries.items() if k != "__metadata__")
    ds = f["data_start"]
    expected = []
    for t in m["tensors"]:
        for c in t["chunks"]:
            if c["file"] == fi:
                expected.append((c["at"] - ds, c["at"] - ds + chunk_numel(c) * DTYPE_SIZE[t["dtype"]]))
    for o in m["objects"]:
        for e in o["entries"]:
            if e["file"] == fi:
                expected.append((e["at"] - ds, e["at"] - ds + e["len"]))
    if declared != sorted(expected):
        raise Bad(path, "safetensors header", "its entries do not match the metadata")


def check_with_safetensors(path):
    """Parses the whole file with the safetensors package (any dtype, no framework)."""
    import safetensors

    with open(path, "rb") as h:
        data = h.read()
    try:
        safetensors.deserialize(data)
    except Exception as e:  # noqa: BLE001
        raise Bad(path, "safetensors", f"the safetensors package rejects it: {e}") from None


def assemble(root, m, t):
    """The global tensor's bytes from its chunks; checks each element is stored exactly once."""
    esz = DTYPE_SIZE[t["dtype"]]
    shape = t["global_shape"]
    total = numel(shape)
    out = bytearray(total * esz)
    seen = bytearray(total)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    files = {}
    for c in t["chunks"]:
        f = m["files"][c["file"]]
        h = files.get(f["name"]) or files.setdefault(f["name"], open(os.path.join(root, f["name"]), "rb"))
        box = c["shape"]
        start, stop = c["flat"] if c.get("flat") is not None else (0, numel(box))
        h.seek(c["at"])
        data = h.read((stop - start) * esz)
        i = start
        while i < stop:
            # Coordinates of box element i, then a run along the last dimension.
            coords, rest = [], i
            for d in range(len(box) - 1, -1, -1):
                coords.append(rest % box[d] if box[d] else 0)
                rest //= box[d] if box[d] else 1
            coords.reverse()
            run = min(stop - i, box[-1] - coords[-1]) if box else 1
            g = sum((c["offset"][d] + coords[d]) * strides[d] for d in range(len(box)))
            if any(seen[g:g + run]):
                raise Bad(t["key"], "coverage", f"element {g} is stored twice")
            seen[g:g + run] = b"\x01" * run
            src = (i - start) * esz
            out[g * esz:(g + run) * esz] = data[src:src + run * esz]
            i += run
    for h in files.values():
        h.close()
    if not all(seen):
        raise Bad(t["key"], "coverage", f"element {seen.index(0)} is not stored")
    return bytes(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="directory holding dckpt.meta")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--assemble", action="store_true", help="rebuild each tensor and print its CRC-32")
    a = p.parse_args()
    try:
        import safetensors  # noqa: F401

        have_safetensors = hasattr(safetensors, "deserialize")
    except ImportError:
        have_safetensors = False
    try:
        m = read_metadata(a.checkpoint)
        blocks = sum(verify_file(a.checkpoint, m, fi, have_safetensors) for fi in range(len(m["files"])))
        tensors = []
        for t in m["tensors"]:
            row = {
                "key": t["key"],
                "dtype": t["dtype"],
                "global_shape": t["global_shape"],
                "chunks": len(t["chunks"]),
                "bytes": numel(t["global_shape"]) * DTYPE_SIZE[t["dtype"]],
            }
            if a.assemble:
                row["crc32"] = zlib.crc32(assemble(a.checkpoint, m, t))
            tensors.append(row)
        objects = []
        for o in m["objects"]:
            row = {"key": o["key"], "grid_shape": o["grid_shape"], "entries": len(o["entries"])}
            if a.assemble:
                row["crc32"] = []
                for e in sorted(o["entries"], key=lambda e: e["grid_offset"]):
                    with open(os.path.join(a.checkpoint, m["files"][e["file"]]["name"]), "rb") as h:
                        h.seek(e["at"])
                        row["crc32"].append(zlib.crc32(h.read(e["len"])))
            objects.append(row)
    except (Bad, OSError, KeyError, TypeError, ValueError, struct.error) as e:
        print(f"read_checkpoint: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    summary = {
        "format_version": m["format_version"],
        "save_id": m["save_id"],
        "writer": m["writer"],
        "layout": m["layout"],
        "files": len(m["files"]),
        "blocks_verified": blocks,
        "safetensors_checked": have_safetensors,
        "tensors": tensors,
        "objects": objects,
    }
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"dckpt checkpoint {m['save_id']} (format {m['format_version']}, written by {m['writer']})")
        print(f"{len(m['files'])} data files, {blocks} blocks verified"
              + (", each a valid safetensors file" if have_safetensors else ""))
        for t in tensors:
            extra = f"  crc32 {t['crc32']:08x}" if "crc32" in t else ""
            print(f"  {t['key']:<48} {t['dtype']:<8} {str(t['global_shape']):<20} {t['chunks']:>4} chunks{extra}")
        for o in objects:
            print(f"  {o['key']:<48} object   grid {o['grid_shape']}  {o['entries']} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
