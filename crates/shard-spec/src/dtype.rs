//! Element types.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// Serialized as its lower-case name (`"bf16"`); [`DType::safetensors_name`] gives the
/// name the safetensors format uses (`"BF16"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// A boolean, one byte per element.
    Bool,
    /// An unsigned 8-bit integer.
    U8,
    /// A signed 8-bit integer.
    I8,
    /// A signed 16-bit integer.
    I16,
    /// A signed 32-bit integer.
    I32,
    /// A signed 64-bit integer.
    I64,
    /// An IEEE 754 half-precision float.
    F16,
    /// A bfloat16: the upper 16 bits of an IEEE 754 single-precision float.
    Bf16,
    /// An IEEE 754 single-precision float.
    F32,
    /// An IEEE 754 double-precision float.
    F64,
    /// An 8-bit float with 4 exponent and 3 mantissa bits (PyTorch's `float8_e4m3fn`).
    F8E4m3,
    /// An 8-bit float with 5 exponent and 2 mantissa bits (PyTorch's `float8_e5m2`).
    F8E5m2,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::Bf16,
        DType::F32,
        DType::F64,
        DType::F8E4m3,
        DType::F8E5m2,
    ];

    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4m3 | DType::F8E5m2 => 1,
            DType::I16 | DType::F16 | DType::Bf16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The lower-case name used on the command line and in dckpt metadata.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F8E4m3 => "f8_e4m3",
            DType::F8E5m2 => "f8_e5m2",
        }
    }

    /// The dtype string of the safetensors format.
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8E4m3 => "F8_E4M3",
            DType::F8E5m2 => "F8_E5M2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Names people write for each dtype besides its canonical [`DType::name`]: safetensors
/// (`BF16`, matched case-insensitively like every name here), Megatron and DeepSpeed
/// (`fp16`), NumPy and PyTorch (`float16`, `half`). Each is unambiguous in every ecosystem
/// that uses it, which is why `float`, `int` and `long` are absent: PyTorch's `float` is
/// f32 but NumPy's and Python's is f64.
const ALIASES: [(DType, &[&str]); 12] = [
    (DType::Bool, &[]),
    (DType::U8, &["uint8"]),
    (DType::I8, &["int8"]),
    (DType::I16, &["int16"]),
    (DType::I32, &["int32"]),
    (DType::I64, &["int64"]),
    (DType::F16, &["fp16", "float16", "half"]),
    (DType::Bf16, &["bfloat16"]),
    (DType::F32, &["fp32", "float32"]),
    (DType::F64, &["fp64", "float64", "double"]),
    (DType::F8E4m3, &["fp8_e4m3", "float8_e4m3fn", "e4m3"]),
    (DType::F8E5m2, &["fp8_e5m2", "float8_e5m2", "e5m2"]),
];

/// What PyTorch prints a dtype as (`str(torch.bfloat16)`), after the `torch.` prefix: its
/// attribute names, where `float`, `int` and `long` are unambiguous. `float8_e4m3fnuz` and
/// `float8_e5m2fnuz` are absent on purpose: they encode differently from safetensors' fp8.
const TORCH: [(&str, DType); 18] = [
    ("bool", DType::Bool),
    ("uint8", DType::U8),
    ("int8", DType::I8),
    ("int16", DType::I16),
    ("short", DType::I16),
    ("int32", DType::I32),
    ("int", DType::I32),
    ("int64", DType::I64),
    ("long", DType::I64),
    ("float16", DType::F16),
    ("half", DType::F16),
    ("bfloat16", DType::Bf16),
    ("float32", DType::F32),
    ("float", DType::F32),
    ("float64", DType::F64),
    ("double", DType::F64),
    ("float8_e4m3fn", DType::F8E4m3),
    ("float8_e5m2", DType::F8E5m2),
];

impl DType {
    /// The dtype a person or another framework names: the canonical name (`bf16`), the
    /// safetensors name (`BF16`), the common aliases (`fp32`, `float32`, `bfloat16`,
    /// `half`, `int64`, `fp8_e4m3`, `float8_e4m3fn`, ...) or PyTorch's printed form
    /// (`torch.bfloat16`, `torch.float`, `torch.long`), in any case.
    ///
    /// This is the parser for input written by people (model specs, command lines).
    /// dckpt's own files keep exactly the canonical names: [`DType`]'s `Serialize` writes
    /// them and its `Deserialize` accepts only them, so the on-storage format does not
    /// depend on this list. Use [`DType::deserialize_any_name`] for a serde field that
    /// should accept every name here.
    ///
    /// ```
    /// use dckpt_shard_spec::DType;
    /// assert_eq!(DType::from_name("fp32"), Ok(DType::F32));
    /// assert_eq!(DType::from_name("torch.bfloat16"), Ok(DType::Bf16));
    /// let err = DType::from_name("float").unwrap_err();
    /// assert!(err.to_string().contains("bf16 (bfloat16)"), "{err}");
    /// ```
    pub fn from_name(name: &str) -> Result<DType, UnknownDType> {
        let lower = name.trim().to_ascii_lowercase();
        if let Some(torch) = lower.strip_prefix("torch.") {
            return TORCH.iter().find(|(n, _)| *n == torch).map(|&(_, d)| d).ok_or_else(|| UnknownDType(name.into()));
        }
        ALIASES
            .iter()
            .find(|(d, aliases)| {
                d.name() == lower
                    || d.safetensors_name().eq_ignore_ascii_case(&lower)
                    || aliases.contains(&lower.as_str())
            })
            .map(|&(d, _)| d)
            .ok_or_else(|| UnknownDType(name.into()))
    }

    /// A serde `deserialize_with` function that reads a dtype by [`DType::from_name`]
    /// (`#[serde(deserialize_with = "DType::deserialize_any_name")]`), for specs written by
    /// people; the error lists the accepted names.
    pub fn deserialize_any_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        DType::from_name(&name).map_err(serde::de::Error::custom)
    }
}

/// A dtype name that [`DType::from_name`] does not know; it displays the accepted names.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {0:?}; accepted: {names} (any case; also PyTorch's torch.<name>)", names = AcceptedNames)]
pub struct UnknownDType(
    /// The name as given.
    pub String,
);

/// The accepted names, grouped by dtype, generated from the tables so the message cannot
/// drift from the parser: `bool, u8 (uint8), ..., bf16 (bfloat16), ...`.
struct AcceptedNames;

impl fmt::Display for AcceptedNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (d, aliases)) in ALIASES.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(d.name())?;
            if !aliases.is_empty() {
                write!(f, " ({})", aliases.join(", "))?;
            }
        }
        Ok(())
    }
}

impl FromStr for DType {
    type Err = UnknownDType;

    /// [`DType::from_name`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::from_name(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.safetensors_name().parse::<DType>(), Ok(d));
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<DType>(&json).unwrap(), d);
        }
    }

    #[test]
    fn the_names_of_other_frameworks() {
        let cases = [
            ("fp32", DType::F32),
            ("FP32", DType::F32),
            ("float32", DType::F32),
            ("fp16", DType::F16),
            ("half", DType::F16),
            ("bfloat16", DType::Bf16),
            ("BFloat16", DType::Bf16),
            ("float64", DType::F64),
            ("double", DType::F64),
            ("int64", DType::I64),
            ("uint8", DType::U8),
            ("fp8_e4m3", DType::F8E4m3),
            ("float8_e4m3fn", DType::F8E4m3),
            ("e5m2", DType::F8E5m2),
            (" bf16 ", DType::Bf16),
            ("torch.bfloat16", DType::Bf16),
            ("torch.float", DType::F32),
            ("torch.half", DType::F16),
            ("torch.long", DType::I64),
            ("torch.int", DType::I32),
            ("torch.short", DType::I16),
            ("torch.float8_e5m2", DType::F8E5m2),
            ("torch.bool", DType::Bool),
        ];
        for (name, d) in cases {
            assert_eq!(DType::from_name(name), Ok(d), "{name}");
        }
        // Ambiguous across frameworks, a different fp8 encoding, or not a dtype at all.
        for name in ["float", "int", "long", "torch.float8_e4m3fnuz", "torch.bf16", "torch.", "f128", ""] {
            assert_eq!(DType::from_name(name), Err(UnknownDType(name.into())), "{name}");
        }
    }

    #[test]
    fn every_torch_name_is_a_torch_dtype_and_every_dtype_has_one() {
        for (name, d) in TORCH {
            assert_eq!(DType::from_name(&format!("torch.{name}")), Ok(d));
        }
        for d in DType::ALL {
            assert!(TORCH.iter().any(|&(_, t)| t == d), "{d} has no torch name");
        }
        for (i, (d, _)) in ALIASES.iter().enumerate() {
            assert_eq!(*d, DType::ALL[i], "ALIASES follows DType::ALL");
        }
    }

    #[test]
    fn an_unknown_name_lists_the_accepted_ones() {
        let msg = DType::from_name("f128").unwrap_err().to_string();
        assert!(msg.starts_with("unknown dtype \"f128\"; accepted: bool, u8 (uint8),"), "{msg}");
        for d in DType::ALL {
            assert!(msg.contains(d.name()), "{msg} lacks {d}");
        }
        assert!(msg.contains("f32 (fp32, float32)"), "{msg}");
        assert!(msg.contains("torch.<name>"), "{msg}");
    }

    /// Files keep exactly the canonical names; only `deserialize_any_name` is lenient.
    #[test]
    fn serde_is_canonical_unless_asked_for_any_name() {
        assert!(serde_json::from_str::<DType>("\"fp32\"").is_err());
        #[derive(Debug, serde::Deserialize)]
        struct Spec {
            #[serde(deserialize_with = "DType::deserialize_any_name")]
            dtype: DType,
        }
        let spec: Spec = serde_json::from_str(r#"{"dtype": "torch.float32"}"#).unwrap();
        assert_eq!(spec.dtype, DType::F32);
        let err = serde_json::from_str::<Spec>(r#"{"dtype": "fp128"}"#).unwrap_err().to_string();
        assert!(err.contains("unknown dtype \"fp128\"; accepted: bool"), "{err}");
        assert!(serde_json::from_str::<Spec>(r#"{"dtype": 4}"#).is_err());
    }

    #[test]
    fn sizes() {
        let sizes: Vec<u64> = DType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1]);
    }
}
