//! The restricted unpickler against stdlib pickles and hostile bytes.
//!
//! Every vector is the hex of `pickle.dumps(OBJ, protocol=N)` from CPython 3.11's stdlib
//! (`python3 -c 'import pickle; print(pickle.dumps(OBJ, protocol=N).hex())'`), with `OBJ`
//! and `N` written above it.

use dckpt_torch_format::pickle::{
    DCP_METADATA_GLOBALS, Limits, Object, PickleErrorKind, Value, unpickle, unpickle_with,
};
use proptest::prelude::*;

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn s(x: &str) -> Value {
    Value::Str(x.into())
}

fn int(i: i64) -> Value {
    Value::Int(i)
}

/// The stdlib globals that protocol 2 uses for `bytes` and sets.
const STDLIB: &[(&str, &str)] = &[("_codecs", "encode"), ("builtins", "set"), ("builtins", "frozenset")];

/// `OBJ` of the nested vectors below.
fn nested_expect() -> Value {
    let big = {
        // 2**64 as LONG1 carries it: nine little-endian bytes.
        let mut b = vec![0u8; 9];
        b[8] = 1;
        Value::BigInt(b)
    };
    Value::Dict(vec![
        (s("name"), s("w")),
        (s("shape"), Value::Tuple(vec![int(3), int(4)])),
        (
            s("vals"),
            Value::List(vec![
                int(0),
                int(-1),
                int(255),
                int(256),
                int(65535),
                int(65536),
                int(-(1 << 31)),
                int(1 << 31),
                int(i64::MAX),
                int(i64::MIN),
                big,
            ]),
        ),
        (s("f"), Value::Float(-0.5)),
        (s("b"), Value::Bytes(vec![0, 0xff])),
        (s("n"), Value::None),
        (s("t"), Value::Bool(true)),
        (s("u"), Value::Bool(false)),
        (s("e"), Value::Tuple(vec![])),
        (s("s"), s("h\u{e9}\u{263a}")),
        (
            s("nested"),
            Value::Dict(vec![(
                s("x"),
                Value::List(vec![Value::List(vec![]), Value::List(vec![int(1), Value::Tuple(vec![int(2)])])]),
            )]),
        ),
    ])
}

// OBJ = {"name": "w", "shape": (3, 4), "vals": [0, -1, 255, 256, 65535, 65536, -2**31, 2**31,
// 2**63-1, -2**63, 2**64], "f": -0.5, "b": b"\x00\xff", "n": None, "t": True, "u": False,
// "e": (), "s": "h\u00e9\u263a", "nested": {"x": [[], [1, (2,)]]}}
const NESTED_P2: &str = "80027d71002858040000006e616d65710158010000007771025805000000736861706571034b034b04867104580400000076616c7371055d7106284b004affffffff4bff4d00014dffff4a000001004a000000808a0500000080008a08ffffffffffffff7f8a0800000000000000808a0900000000000000000165580100000066710747bfe00000000000005801000000627108635f636f646563730a656e636f64650a7109580300000000c3bf710a58060000006c6174696e31710b86710c52710d58010000006e710e4e580100000074710f885801000000757110895801000000657111295801000000737112580600000068c3a9e298ba711358060000006e657374656471147d711558010000007871165d7117285d71185d7119284b014b0285711a656573752e";
const NESTED_P3: &str = "80037d71002858040000006e616d65710158010000007771025805000000736861706571034b034b04867104580400000076616c7371055d7106284b004affffffff4bff4d00014dffff4a000001004a000000808a0500000080008a08ffffffffffffff7f8a0800000000000000808a0900000000000000000165580100000066710747bfe00000000000005801000000627108430200ff710958010000006e710a4e580100000074710b88580100000075710c89580100000065710d29580100000073710e580600000068c3a9e298ba710f58060000006e657374656471107d711158010000007871125d7113285d71145d7115284b014b02857116656573752e";
const NESTED_P4: &str = "800495bf000000000000007d94288c046e616d65948c0177948c057368617065944b034b0486948c0476616c73945d94284b004affffffff4bff4d00014dffff4a000001004a000000808a0500000080008a08ffffffffffffff7f8a0800000000000000808a09000000000000000001658c01669447bfe00000000000008c016294430200ff948c016e944e8c017494888c017594898c016594298c0173948c0668c3a9e298ba948c066e6573746564947d948c0178945d94285d945d94284b014b028594656573752e";
const NESTED_P5: &str = "800595bf000000000000007d94288c046e616d65948c0177948c057368617065944b034b0486948c0476616c73945d94284b004affffffff4bff4d00014dffff4a000001004a000000808a0500000080008a08ffffffffffffff7f8a0800000000000000808a09000000000000000001658c01669447bfe00000000000008c016294430200ff948c016e944e8c017494888c017594898c016594298c0173948c0668c3a9e298ba948c066e6573746564947d948c0178945d94285d945d94284b014b028594656573752e";

/// A stand-in for DCP metadata: dataclasses and an enum defined in a module named
/// `torch.distributed.checkpoint.metadata` (the script is in the test below), so the
/// pickle has the shape real DCP metadata has: `STACK_GLOBAL`, `NEWOBJ`, `BUILD` of a field
/// dict, an enum `REDUCE`, and memo references to the module string.
const FAKE_DCP_P4: &str = "800495e7000000000000008c25746f7263682e64697374726962757465642e636865636b706f696e742e6d65746164617461948c084d657461646174619493942981947d94288c1373746174655f646963745f6d65746164617461947d948c01779468008c144368756e6b53746f726167654d657461646174619493942981947d94288c076f666673657473944b004b0286948c0573697a6573944b044b0286947562738c0c706c616e6e65725f64617461947d94680768078594738c0c73746f726167655f64617461945d9468008c145f4d454d5f464f524d41545f454e434f44494e479493944b00859452946175622e";

// class E: __reduce__ = lambda self: (os.system, ("id",)); OBJ = E(), protocol 2 (GLOBAL).
const OS_SYSTEM_P2: &str = "800263706f7369780a73797374656d0a71005802000000696471018571025271032e";
// The same at protocol 4 (STACK_GLOBAL).
const OS_SYSTEM_P4: &str = "8004951d000000000000008c05706f736978948c0673797374656d9493948c02696494859452942e";

fn all_vectors() -> Vec<Vec<u8>> {
    [NESTED_P2, NESTED_P3, NESTED_P4, NESTED_P5, FAKE_DCP_P4, OS_SYSTEM_P2, OS_SYSTEM_P4]
        .iter()
        .map(|h| hex(&h.replace(' ', "")))
        .collect()
}

#[test]
fn nested_builtins_decode_at_every_protocol() {
    for (p, h) in [(2, NESTED_P2), (3, NESTED_P3), (4, NESTED_P4), (5, NESTED_P5)] {
        let v = unpickle(&hex(h), STDLIB).unwrap_or_else(|e| panic!("protocol {p}: {e}"));
        assert_eq!(v, nested_expect(), "protocol {p}");
    }
}

#[test]
fn protocol_2_bytes_need_codecs_encode_allowed() {
    let e = unpickle(&hex(NESTED_P2), &[]).unwrap_err();
    assert_eq!(e.kind(), &PickleErrorKind::Forbidden { module: "_codecs".into(), name: "encode".into() });
    // `b"\x00\xff"` is the only bytes object; GLOBAL `_codecs encode` is at byte 148.
    assert_eq!(e.offset(), 148);
}

#[test]
fn memo_shares_a_list_filled_after_it_was_memoized() {
    // x = [1]; OBJ = [x, x], protocol 2: x is memoized empty, APPEND fills it, BINGET
    // refers to it again.
    let v = unpickle(&hex("80025d7100285d71014b01616801652e"), &[]).unwrap();
    let x = Value::List(vec![int(1)]);
    assert_eq!(v, Value::List(vec![x.clone(), x]));
}

#[test]
fn ordered_dict_is_an_object_with_items() {
    // collections.OrderedDict([("a", 1), ("b", 2)]), protocol 4.
    let b = hex(
        "80049530000000000000008c0b636f6c6c656374696f6e73948c0b4f72646572656444696374949394295294288c0161944b018c0162944b02752e",
    );
    let v = unpickle(&b, DCP_METADATA_GLOBALS).unwrap();
    let Value::Object(o) = v else { panic!("{v:?}") };
    assert_eq!(
        *o,
        Object {
            module: "collections".into(),
            name: "OrderedDict".into(),
            args: vec![],
            kwargs: vec![],
            state: None,
            items: vec![(s("a"), int(1)), (s("b"), int(2))],
            appended: vec![],
        }
    );
}

#[test]
fn sets_at_protocols_2_and_4() {
    // {1, 2}, protocol 2: REDUCE of `__builtin__ set` (renamed to builtins) with a list.
    let v = unpickle(&hex("8002635f5f6275696c74696e5f5f0a7365740a71005d7101284b014b02658571025271032e"), STDLIB);
    assert_eq!(v.unwrap(), Value::Set(vec![int(1), int(2)]));
    // {1, 2}, protocol 4: EMPTY_SET, ADDITEMS.
    let v = unpickle(&hex("80049509000000000000008f94284b014b02902e"), &[]).unwrap();
    assert_eq!(v, Value::Set(vec![int(1), int(2)]));
    // frozenset({3}), protocol 4.
    let v = unpickle(&hex("8004950600000000000000284b0391942e"), &[]).unwrap();
    assert_eq!(v, Value::FrozenSet(vec![int(3)]));
    // bytearray(b"ab"), protocol 5.
    let v = unpickle(&hex("8005950d000000000000009602000000000000006162942e"), &[]).unwrap();
    assert_eq!(v, Value::ByteArray(b"ab".to_vec()));
}

#[test]
fn dcp_shaped_metadata_is_recorded_not_called() {
    // The script (stand-in modules, as DCP's dataclasses would be pickled):
    //   for n in ("torch", "torch.distributed", "torch.distributed.checkpoint",
    //             "torch.distributed.checkpoint.metadata"): sys.modules[n] = types.ModuleType(n)
    //   @dataclass class ChunkStorageMetadata: offsets: tuple; sizes: tuple
    //   @dataclass class Metadata: state_dict_metadata: dict; planner_data = None; storage_data = None
    //   class _MEM_FORMAT_ENCODING(enum.Enum): TORCH_CONTIGUOUS_FORMAT = 0
    //   (each placed in that module), then
    //   Metadata({"w": ChunkStorageMetadata((0, 2), (4, 2))}, planner_data={"w": ("w",)},
    //            storage_data=[_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT]), protocol 4.
    let v = unpickle(&hex(FAKE_DCP_P4), DCP_METADATA_GLOBALS).unwrap();
    let m = "torch.distributed.checkpoint.metadata";
    let obj = |name: &str, args: Vec<Value>, state: Option<Value>| {
        Value::Object(Box::new(Object {
            module: m.into(),
            name: name.into(),
            args,
            kwargs: vec![],
            state,
            items: vec![],
            appended: vec![],
        }))
    };
    let chunk = obj(
        "ChunkStorageMetadata",
        vec![],
        Some(Value::Dict(vec![
            (s("offsets"), Value::Tuple(vec![int(0), int(2)])),
            (s("sizes"), Value::Tuple(vec![int(4), int(2)])),
        ])),
    );
    let expect = obj(
        "Metadata",
        vec![],
        Some(Value::Dict(vec![
            (s("state_dict_metadata"), Value::Dict(vec![(s("w"), chunk)])),
            (s("planner_data"), Value::Dict(vec![(s("w"), Value::Tuple(vec![s("w")]))])),
            (s("storage_data"), Value::List(vec![obj("_MEM_FORMAT_ENCODING", vec![int(0)], None)])),
        ])),
    );
    assert_eq!(v, expect);
}

#[test]
fn os_system_is_refused_by_name_and_never_called() {
    for (h, offset) in [(OS_SYSTEM_P2, 2), (OS_SYSTEM_P4, 28)] {
        let e = unpickle(&hex(&h.replace(' ', "")), DCP_METADATA_GLOBALS).unwrap_err();
        assert_eq!(e.kind(), &PickleErrorKind::Forbidden { module: "posix".into(), name: "system".into() });
        assert_eq!(e.offset(), offset);
        assert!(e.to_string().contains("`posix.system`"), "{e}");
    }
    // Allowed, it is still only recorded: the call is a value, and nothing ran.
    let v = unpickle(&hex(&OS_SYSTEM_P4.replace(' ', "")), &[("posix", "system")]).unwrap();
    let Value::Object(o) = v else { panic!("{v:?}") };
    assert_eq!((o.module.as_str(), o.name.as_str(), o.args.as_slice()), ("posix", "system", &[s("id")][..]));
}

#[test]
fn a_list_that_contains_itself_is_refused() {
    // l = []; l.append(l); OBJ = l, protocol 4.
    let e = unpickle(&hex("80049506000000000000005d946800612e"), &[]).unwrap_err();
    assert_eq!(e.kind(), &PickleErrorKind::Malformed("a value that contains itself".into()));
    assert_eq!(e.offset(), 11);
}

#[test]
fn memo_references_cannot_multiply_memory() {
    // A 1000-byte string memoized, then referenced by BINGET ten thousand times inside a
    // list: 20 kB of input that would expand to 10 MB.
    let mut b = vec![0x80, 0x04, b'X'];
    b.extend(1000u32.to_le_bytes());
    b.extend([b'a'; 1000]);
    b.extend([0x94, 0x30, b']', b'(']);
    for _ in 0..10_000 {
        b.extend([b'h', 0]);
    }
    b.extend([b'e', b'.']);
    let e = unpickle(&b, &[]).unwrap_err();
    assert!(matches!(e.kind(), PickleErrorKind::LimitExceeded { .. }), "{e}");
    // The same references to a short string are fine.
    let mut ok = vec![0x80, 0x04, 0x8c, 1, b'a', 0x94, 0x30, b']', b'('];
    for _ in 0..10_000 {
        ok.extend([b'h', 0]);
    }
    ok.extend([b'e', b'.']);
    let Value::List(items) = unpickle(&ok, &[]).unwrap() else { panic!() };
    assert_eq!(items.len(), 10_000);
}

#[test]
fn repeated_calls_on_a_memoized_tuple_copy_nothing() {
    // A tuple of 50,000 Nones memoized, then 50,000 `REDUCE`s of `collections.OrderedDict`
    // on it: 300 kB of input. Copying the arguments per call would hold 2.5e9 ids; the
    // reader refers to them, and the expansion stops at its budget.
    let mut b = vec![0x80, 0x04, b'('];
    b.extend([b'N'; 50_000]);
    b.extend([b't', 0x94, b'0', b'(']);
    for _ in 0..50_000 {
        b.extend(b"ccollections\nOrderedDict\n");
        b.extend([b'h', 0, b'R']);
    }
    b.extend([b'l', b'.']);
    let e = unpickle(&b, DCP_METADATA_GLOBALS).unwrap_err();
    assert!(matches!(e.kind(), PickleErrorKind::LimitExceeded { .. }), "{e}");
}

#[test]
fn nesting_deeper_than_the_limit_is_refused() {
    // 200 nested lists: 200 EMPTY_LISTs, then 199 APPENDs put each into the one below.
    let mut b = vec![0x80, 0x04];
    b.extend([b']'; 200]);
    b.extend([b'a'; 199]);
    b.push(b'.');
    let e = unpickle(&b, &[]).unwrap_err();
    assert_eq!(e.kind(), &PickleErrorKind::LimitExceeded { what: "nesting depth", limit: 100 });
    let deep = Limits { depth_max: 300, ..Limits::default() };
    assert!(unpickle_with(&b, &|_, _| false, &deep).is_ok());
    // The ceiling holds whatever the limits say.
    let mut b = vec![0x80, 0x04];
    b.extend([b']'; 2000]);
    b.extend([b'a'; 1999]);
    b.push(b'.');
    let e = unpickle_with(&b, &|_, _| false, &Limits { depth_max: usize::MAX, ..Limits::default() }).unwrap_err();
    assert_eq!(e.kind(), &PickleErrorKind::LimitExceeded { what: "nesting depth", limit: 1000 });
}

#[test]
fn memo_entries_are_bounded() {
    let limits = Limits { memo_entries_max: 3, ..Limits::default() };
    let b = hex("80049509000000000000008f94284b014b02902e"); // one MEMOIZE: fine
    assert!(unpickle_with(&b, &|_, _| false, &limits).is_ok());
    let mut many = vec![0x80, 0x04, b'N'];
    many.extend([0x94; 4]);
    many.push(b'.');
    let e = unpickle_with(&many, &|_, _| false, &limits).unwrap_err();
    assert_eq!(e.kind(), &PickleErrorKind::LimitExceeded { what: "memo entries", limit: 3 });
    assert_eq!(e.offset(), 6);
}

#[test]
fn hostile_lengths_and_structure_are_errors() {
    let cases: &[(&[u8], &str)] = &[
        // BINUNICODE8 declaring 2**64-1 bytes.
        (b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff", "ends inside a string"),
        // FRAME longer than the input.
        (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x01\x00N.", "ends inside a frame"),
        (b"\x80\x06N.", "protocol 6 is not supported"),
        (b"\x80\x04e.", "no mark"),
        (b"\x80\x04a.", "pop of an empty stack"),
        (b"\x80\x04h\x05.", "memo key 5 was never stored"),
        (b"\x80\x04)Ns.", "no value on the stack"),
        (b"\x80\x04)NNs.", "SETITEM(S) on something other than a dict"),
        (b"\x80\x04NN.", "STOP with 2 values"),
        (b"\x80\x04N.N", "1 bytes after STOP"),
        (b"\x80\x04N", "ends inside an opcode"),
        (b"\x80\x04\xff", "unknown opcode 0xff"),
        (b"\x80\x04\x82\x01", "opcode EXT1 is not supported"),
        (b"\x80\x04\x8c\x01\xff.", "not UTF-8"),
        (b"\x80\x04T\xff\xff\xff\xff", "negative length"),
        (b"\x80\x04NNN\x86R.", "a call of something other than a global"),
        (b"\x80\x04N\x8c\x01a\x93.", "not a string"),
        (b"\x80\x04]]b.", "BUILD of something other than an object"),
    ];
    for (bytes, want) in cases {
        let e = unpickle(bytes, &[]).unwrap_err();
        assert!(e.to_string().contains(want), "{bytes:?}: {e} (wanted {want:?})");
    }
}

#[test]
fn every_prefix_of_every_vector_is_an_error() {
    for v in all_vectors() {
        for n in 0..v.len() {
            assert!(unpickle(&v[..n], STDLIB).is_err(), "prefix {n} of {v:?}");
        }
    }
}

#[test]
fn errors_convert_to_format_errors() {
    let e = unpickle(b"\x80\x04", &[]).unwrap_err().into_format_error(".metadata");
    assert_eq!(e.to_string(), ".metadata: pickle: the pickle ends inside an opcode (at byte 2)");
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = unpickle(&bytes, DCP_METADATA_GLOBALS);
    }

    #[test]
    fn mutated_vectors_never_panic(which in 0usize..7, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut v = all_vectors().swap_remove(which);
        let i = at.index(v.len());
        v[i] = byte;
        let _ = unpickle(&v, STDLIB);
    }
}

#[test]
fn torch_save_tensors_keep_their_persistent_ids() {
    // The shape of `torch.save`'s data.pkl, protocol 2, made with stand-in modules: a
    // `pickle.Pickler` whose `persistent_id` returns ("storage", torch.FloatStorage, "0",
    // "cpu", 6) for the storage, dumping {"w": T()} where T.__reduce_ex__ returns
    // (torch._utils._rebuild_tensor_v2, (storage, 0, (2, 3), (1, 2), False, OrderedDict())).
    let b = hex(
        "80027d7100580100000077710163746f7263682e5f7574696c730a5f72656275696c645f74656e736f725f76320a71022828580700000073746f72616765710363746f7263680a466c6f617453746f726167650a71045801000000307105580300000063707571064b06747107514b004b024b038671084b014b028671098963636f6c6c656374696f6e730a4f726465726564446963740a710a2952710b74710c52710d732e",
    );
    let allowed = [("torch._utils", "_rebuild_tensor_v2"), ("torch", "FloatStorage"), ("collections", "OrderedDict")];
    let e = unpickle(&b, &allowed[1..]).unwrap_err();
    assert_eq!(e.to_string(), "global `torch._utils._rebuild_tensor_v2` is not on the allow-list (at byte 13)");
    let v = unpickle(&b, &allowed).unwrap();
    let Some(Value::Object(t)) = v.get("w") else { panic!("{v:?}") };
    assert_eq!((t.module.as_str(), t.name.as_str()), ("torch._utils", "_rebuild_tensor_v2"));
    let storage = Value::Tuple(vec![
        s("storage"),
        Value::Global { module: "torch".into(), name: "FloatStorage".into() },
        s("0"),
        s("cpu"),
        int(6),
    ]);
    assert_eq!(t.args[0], Value::PersistentId(Box::new(storage)));
    assert_eq!(
        &t.args[1..5],
        &[int(0), Value::Tuple(vec![int(2), int(3)]), Value::Tuple(vec![int(1), int(2)]), Value::Bool(false)]
    );
    let Value::Object(od) = &t.args[5] else { panic!("{t:?}") };
    assert_eq!((od.module.as_str(), od.name.as_str(), od.items.len()), ("collections", "OrderedDict", 0));
}

#[test]
fn newobj_ex_records_keyword_arguments() {
    // class K: __reduce_ex__ = lambda self, p: (copyreg.__newobj_ex__, (torch.K2, (1,), {"k": 2}))
    // OBJ = K(), protocol 4 (NEWOBJ_EX).
    let b = hex("8004951f000000000000008c05746f726368948c024b329493944b0185947d948c016b944b027392942e");
    let Value::Object(o) = unpickle(&b, &[("torch", "K2")]).unwrap() else { panic!() };
    assert_eq!((o.args.as_slice(), o.kwargs.as_slice()), (&[int(1)][..], &[(s("k"), int(2))][..]));
}
